//! Smoke test of the test control plane (`scripts/k8s-test-control-plane`):
//! the real PV binder annotates a claim of an external provisioner's storage
//! class, binds it to a PV created the way a provisioner does, and the
//! protection controllers let both be deleted afterwards.
use crate::support;

use std::fmt::Debug;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::wait::{await_condition, conditions, Condition};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use serde_json::json;

use support::ceph::unique;
use support::k8s::ControlPlane;
use support::provisioner::from_json;

const PROVISIONER: &str = "rbd.rbdkit.io";
const PROVISIONER_ANNOTATION: &str = "volume.kubernetes.io/storage-provisioner";
const WAIT: Duration = Duration::from_secs(60);

/// Waits (bounded) until `cond` holds for the object `name`, and returns it;
/// on timeout, panics showing the object as it is.
async fn wait_until<K>(api: &Api<K>, name: &str, what: &str, cond: impl Condition<K>) -> Option<K>
where
    K: Clone + Debug + Send + DeserializeOwned + Resource + 'static,
{
    match tokio::time::timeout(WAIT, await_condition(api.clone(), name, cond)).await {
        Ok(Ok(obj)) => obj,
        Ok(Err(e)) => panic!("watching {name} until {what} failed: {e}"),
        Err(_) => {
            let now = api.get_opt(name).await;
            panic!("{name}: not {what} after {WAIT:?}; it is now {now:#?}")
        }
    }
}

#[tokio::test]
async fn binder_annotates_and_binds_a_claim_to_a_provisioned_volume() {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    let ns = unique("rbdkit-smoke");
    let sc_name = unique("rbdkit-smoke-sc");
    let pv_name = unique("rbdkit-smoke-pv");
    let claim = "data";

    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &from_json(json!({ "metadata": { "name": ns } })),
        )
        .await
        .expect("create namespace");

    // (1) A storage class of our provisioner and a claim that names it.
    let classes: Api<StorageClass> = Api::all(client.clone());
    let sc: StorageClass = from_json(json!({
        "metadata": { "name": sc_name },
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }));
    classes
        .create(&PostParams::default(), &sc)
        .await
        .expect("create storage class");

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let pvc: PersistentVolumeClaim = from_json(json!({
        "metadata": { "name": claim },
        "spec": {
            "storageClassName": sc_name,
            "accessModes": ["ReadWriteOnce"],
            "resources": { "requests": { "storage": "1Gi" } },
        },
    }));
    let pvc = claims
        .create(&PostParams::default(), &pvc)
        .await
        .expect("create claim");
    let pvc_uid = pvc.metadata.uid.clone().expect("claim has a uid");

    // (2) The binder hands the claim to our provisioner.
    let annotated = |obj: Option<&PersistentVolumeClaim>| {
        obj.and_then(|c| c.metadata.annotations.as_ref())
            .and_then(|a| a.get(PROVISIONER_ANNOTATION))
            .is_some_and(|p| p == PROVISIONER)
    };
    let pvc = wait_until(&claims, claim, "annotated for the provisioner", annotated)
        .await
        .expect("claim exists");
    assert_eq!(
        pvc.metadata.annotations.as_ref().unwrap()[PROVISIONER_ANNOTATION],
        PROVISIONER
    );
    assert_eq!(
        pvc.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Pending"),
        "claim is pending while it waits for the provisioner"
    );

    // (3) A volume made the way a CSI provisioner makes one, pre-bound.
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let pv: PersistentVolume = from_json(json!({
        "metadata": {
            "name": pv_name,
            "annotations": { "pv.kubernetes.io/provisioned-by": PROVISIONER },
        },
        "spec": {
            "capacity": { "storage": "1Gi" },
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": sc_name,
            "volumeMode": "Filesystem",
            "csi": {
                "driver": PROVISIONER,
                "volumeHandle": format!("rbd/{pv_name}"),
                "fsType": "ext4",
            },
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": ns,
                "name": claim,
                "uid": pvc_uid,
            },
        },
    }));
    let pv = volumes
        .create(&PostParams::default(), &pv)
        .await
        .expect("create volume");
    let pv_uid = pv.metadata.uid.clone().expect("volume has a uid");

    // (4) The binder binds the claim to that volume, both ways.
    let bound = |obj: Option<&PersistentVolumeClaim>| {
        obj.is_some_and(|c| {
            c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                && c.spec.as_ref().and_then(|s| s.volume_name.as_deref()) == Some(&pv_name)
        })
    };
    let pvc = wait_until(&claims, claim, "bound", bound)
        .await
        .expect("claim exists");
    let status = pvc.status.as_ref().expect("bound claim has a status");
    assert_eq!(status.phase.as_deref(), Some("Bound"));
    assert_eq!(
        status.capacity.as_ref().map(|c| c["storage"].0.as_str()),
        Some("1Gi")
    );
    let pv_bound = |obj: Option<&PersistentVolume>| {
        obj.and_then(|v| v.status.as_ref())
            .and_then(|s| s.phase.as_deref())
            == Some("Bound")
    };
    let pv = wait_until(&volumes, &pv_name, "bound", pv_bound)
        .await
        .expect("volume exists");
    let claim_ref = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref()).unwrap();
    assert_eq!(claim_ref.uid.as_deref(), Some(pvc_uid.as_str()));

    // The protection controllers put their finalizers on both...
    let finalizers = |meta: &kube::api::ObjectMeta| meta.finalizers.clone().unwrap_or_default();
    assert!(
        finalizers(&pvc.metadata).contains(&"kubernetes.io/pvc-protection".to_owned()),
        "claim finalizers: {:?}",
        pvc.metadata.finalizers
    );
    assert!(
        finalizers(&pv.metadata).contains(&"kubernetes.io/pv-protection".to_owned()),
        "volume finalizers: {:?}",
        pv.metadata.finalizers
    );

    // ...and take them off again, so deleting the claim and then the released
    // volume really completes.
    claims
        .delete(claim, &DeleteParams::default())
        .await
        .expect("delete claim");
    wait_until(&claims, claim, "deleted", conditions::is_deleted(&pvc_uid)).await;
    let released = |obj: Option<&PersistentVolume>| {
        obj.and_then(|v| v.status.as_ref())
            .and_then(|s| s.phase.as_deref())
            == Some("Released")
    };
    wait_until(&volumes, &pv_name, "released", released).await;
    volumes
        .delete(&pv_name, &DeleteParams::default())
        .await
        .expect("delete volume");
    wait_until(
        &volumes,
        &pv_name,
        "deleted",
        conditions::is_deleted(&pv_uid),
    )
    .await;

    classes
        .delete(&sc_name, &DeleteParams::default())
        .await
        .expect("delete storage class");
    // No namespace controller runs, so the namespace would stay Terminating;
    // it lives as long as this control plane, which is fine.
}

#[tokio::test]
async fn a_private_control_plane_is_stopped_on_drop() {
    // Always one of its own, so that the drop below is really tested.
    let cp = ControlPlane::start_private();
    let kubeconfig = cp.kubeconfig_path().to_owned();
    assert!(kubeconfig.is_file(), "{} is missing", kubeconfig.display());
    let client = cp.client().await;
    let namespaces: Api<Namespace> = Api::all(client);
    let default = namespaces
        .get("default")
        .await
        .expect("get namespace default");
    assert_eq!(default.metadata.name.as_deref(), Some("default"));
    drop(cp);
    // `down` removed its directory, kubeconfig included.
    assert!(
        !kubeconfig.exists(),
        "{} still exists after drop",
        kubeconfig.display()
    );
}
