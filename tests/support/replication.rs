//! The Kubernetes side of volume replication for tests: csi-addons'
//! VolumeReplication CRDs from the Go module pinned in `tests/csi-addons`
//! (`scripts/csi-addons-crds`), and the objects made from them.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;
use tokio::sync::OnceCell;

use rbdkit::provisioner::replication::{VolumeReplication, GROUP};

use super::provisioner::eventually;

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1alpha1", kind), plural)
}

/// Installs the two CRDs once per process (idempotent across processes).
pub async fn install_crds(client: &kube::Client) {
    static DONE: OnceCell<()> = OnceCell::const_new();
    DONE.get_or_init(|| async {
        let files = tokio::task::spawn_blocking(|| {
            let out =
                Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/csi-addons-crds"))
                    .output()
                    .expect("run scripts/csi-addons-crds");
            assert!(
                out.status.success(),
                "scripts/csi-addons-crds failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout)
                .expect("utf-8 paths")
                .lines()
                .filter(|f| f.contains("/replication.storage.openshift.io_"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .await
        .expect("crds");
        assert_eq!(files.len(), 2, "expected two CRD files, got {files:?}");
        super::k8s::apply_crds(client, &files).await;
    })
    .await;
}

/// Creates a VolumeReplicationClass.
pub async fn create_class(
    client: &kube::Client,
    name: &str,
    provisioner: &str,
    parameters: serde_json::Value,
) {
    let api: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &resource("VolumeReplicationClass", "volumereplicationclasses"),
    );
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1alpha1"),
        "kind": "VolumeReplicationClass",
        "metadata": {"name": name},
        "spec": {"provisioner": provisioner, "parameters": parameters},
    }))
    .expect("class object");
    api.create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("create VolumeReplicationClass {name}: {e}"));
}

/// The VolumeReplications of `ns`, as dynamic objects (to write).
pub fn vrs(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        ns,
        &resource("VolumeReplication", "volumereplications"),
    )
}

/// Creates a VolumeReplication of claim `claim` in `state`.
pub async fn create_vr(
    client: &kube::Client,
    ns: &str,
    name: &str,
    class: &str,
    claim: &str,
    state: &str,
) {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1alpha1"),
        "kind": "VolumeReplication",
        "metadata": {"name": name},
        "spec": {
            "volumeReplicationClass": class,
            "replicationState": state,
            "dataSource": {"kind": "PersistentVolumeClaim", "name": claim},
            "autoResync": false,
        },
    }))
    .expect("VolumeReplication object");
    vrs(client, ns)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("create VolumeReplication {name}: {e}"));
}

/// Sets `spec.replicationState` (and `autoResync`).
pub async fn set_state(
    client: &kube::Client,
    ns: &str,
    name: &str,
    state: &str,
    auto_resync: bool,
) {
    vrs(client, ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"replicationState": state, "autoResync": auto_resync}})),
        )
        .await
        .unwrap_or_else(|e| panic!("set {name} {state}: {e}"));
}

/// Reads a VolumeReplication.
pub async fn get(client: &kube::Client, ns: &str, name: &str) -> VolumeReplication {
    let api: Api<VolumeReplication> = Api::namespaced(client.clone(), ns);
    api.get(name)
        .await
        .unwrap_or_else(|e| panic!("get VolumeReplication {name}: {e}"))
}

/// A condition's `status` ("True", "False", "Unknown"), if set.
pub fn condition(vr: &VolumeReplication, kind: &str) -> Option<String> {
    vr.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c["type"] == kind)
        .and_then(|c| c["status"].as_str().map(str::to_owned))
}

/// One line about a VolumeReplication's status, for failed waits.
pub fn describe(vr: &VolumeReplication) -> String {
    match &vr.status {
        Some(s) => format!(
            "state {:?}, message {:?}, conditions {}",
            s.state,
            s.message,
            serde_json::to_string(&s.conditions).unwrap_or_default()
        ),
        None => "no status".into(),
    }
}

/// Waits until the VolumeReplication is in `state` with condition `cond`
/// at `want` (e.g. `Degraded` `False`).
pub async fn wait(
    client: &kube::Client,
    ns: &str,
    name: &str,
    state: &str,
    cond: Option<(&str, &str)>,
    timeout: Duration,
) -> VolumeReplication {
    eventually(
        &format!("VolumeReplication {name} {state} {cond:?}"),
        timeout,
        || async {
            let vr = get(client, ns, name).await;
            let st = vr.status.as_ref().and_then(|s| s.state.clone());
            let ok = st.as_deref() == Some(state)
                && cond.is_none_or(|(k, v)| condition(&vr, k).as_deref() == Some(v));
            if ok {
                Ok(vr)
            } else {
                Err(describe(&vr))
            }
        },
    )
    .await
}
