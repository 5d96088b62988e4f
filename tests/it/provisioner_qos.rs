//! QoS with the provisioner, against the real control plane and Ceph: a
//! StorageClass's ceph-csi QoS parameters, and a claim's
//! VolumeAttributesClass over them, become the image's librbd limits at
//! provisioning; the PV names the class (so the binder binds it); a class
//! that does not exist yet is waited for; one of another driver is refused
//! by name, with no image made. Changing a bound claim's class applies it
//! (the external-resizer's modify role, played by the provisioner), keeps
//! the claim's status as the resizer does, and refuses or waits as above.
use crate::support;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::VolumeAttributesClass;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use rbdkit::rbd::Image;
use rbdkit::volume::VolumeId;
use serde_json::json;

use support::provisioner::{eventually, from_json, Env, WAIT};

async fn vac(env: &Env, name: &str, driver: &str, params: serde_json::Value) {
    let api: Api<VolumeAttributesClass> = Api::all(env.client.clone());
    api.create(
        &PostParams::default(),
        &from_json(json!({
            "metadata": {"name": name},
            "driverName": driver,
            "parameters": params,
        })),
    )
    .await
    .unwrap_or_else(|e| panic!("create VolumeAttributesClass {name}: {e}"));
}

async fn claim_with(env: &Env, name: &str, class: &str, vac: &str) {
    env.claims()
        .create(
            &PostParams::default(),
            &from_json::<PersistentVolumeClaim>(json!({
                "metadata": {"name": name},
                "spec": {
                    "storageClassName": class,
                    "volumeAttributesClassName": vac,
                    "accessModes": ["ReadWriteOnce"],
                    "volumeMode": "Block",
                    "resources": {"requests": {"storage": "8Mi"}},
                },
            })),
        )
        .await
        .unwrap_or_else(|e| panic!("create claim {name}: {e}"));
}

async fn set_class(env: &Env, claim: &str, class: &str) {
    env.claims()
        .patch(
            claim,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"volumeAttributesClassName": class}})),
        )
        .await
        .unwrap_or_else(|e| panic!("set the class of {claim}: {e}"));
}

/// Waits until the claim's status says `class` is applied and no change
/// is under way.
async fn wait_applied(env: &Env, claim: &str, class: &str) {
    eventually(&format!("{claim} at class {class}"), WAIT, || async {
        let c = env.claims().get(claim).await.map_err(|e| e.to_string())?;
        let st = c.status.clone().unwrap_or_default();
        let done = st.current_volume_attributes_class_name.as_deref() == Some(class)
            && st.modify_volume_status.is_none();
        if done {
            Ok(())
        } else {
            Err(format!("{st:?}"))
        }
    })
    .await
}

/// Waits until the claim's `modifyVolumeStatus` is `status` for `class`.
async fn wait_modify_status(
    env: &Env,
    claim: &str,
    class: &str,
    status: &str,
) -> PersistentVolumeClaim {
    eventually(&format!("{claim} {status} for {class}"), WAIT, || async {
        let c = env.claims().get(claim).await.map_err(|e| e.to_string())?;
        let m = c
            .status
            .as_ref()
            .and_then(|s| s.modify_volume_status.clone());
        let now = m.as_ref().map(|m| {
            (
                m.status.as_str(),
                m.target_volume_attributes_class_name.as_deref(),
            )
        });
        if now == Some((status, Some(class))) {
            Ok(c)
        } else {
            Err(format!("{m:?}"))
        }
    })
    .await
}

/// The image's librbd write-IOPS limit, if it has one.
fn write_limit(env: &Env, handle: &str) -> Option<String> {
    let vol = VolumeId::parse(handle).unwrap();
    let img = Image::open_read_only(&env.rbd.ioctx, &vol.image).unwrap();
    img.metadata_get("conf_rbd_qos_write_iops_limit").ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_attributes_classes_are_applied_at_provisioning_and_on_change() {
    let mut env = Env::new("pqos").await;
    let _p = env.start_in_process();
    let class = env
        .storage_class("qos", json!({"BaseWriteIops": "1000"}), json!({}))
        .await;
    let (fast, later, foreign) = (
        format!("{}-fast", env.ns),
        format!("{}-later", env.ns),
        format!("{}-foreign", env.ns),
    );
    vac(&env, &fast, &env.name, json!({"baseWriteIops": "200"})).await;
    vac(&env, &foreign, "other.csi.example", json!({"iops": "1"})).await;

    env.claim("plain", &class, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    claim_with(&env, "fast", &class, &fast).await;
    claim_with(&env, "later", &class, &later).await;
    claim_with(&env, "foreign", &class, &foreign).await;

    let handle = |pv: &k8s_openapi::api::core::v1::PersistentVolume| {
        pv.spec
            .as_ref()
            .unwrap()
            .csi
            .as_ref()
            .unwrap()
            .volume_handle
            .clone()
    };
    let pv_class = |pv: &k8s_openapi::api::core::v1::PersistentVolume| {
        pv.spec
            .as_ref()
            .unwrap()
            .volume_attributes_class_name
            .clone()
    };
    let (_, pv) = env.wait_bound("plain").await;
    assert_eq!(write_limit(&env, &handle(&pv)).as_deref(), Some("1000"));
    assert_eq!(pv_class(&pv), None);
    let (c, pv) = env.wait_bound("fast").await;
    assert_eq!(write_limit(&env, &handle(&pv)).as_deref(), Some("200"));
    assert_eq!(pv_class(&pv).as_deref(), Some(fast.as_str()));
    let current = c.status.unwrap().current_volume_attributes_class_name;
    assert_eq!(current.as_deref(), Some(fast.as_str()));

    // Another driver's class: refused by name, nothing made.
    eventually("the foreign class refused", WAIT, || async {
        let ev = env.event_summary("foreign").await;
        if ev
            .iter()
            .any(|e| e.contains("ProvisioningFailed") && e.contains("other.csi.example"))
        {
            Ok(())
        } else {
            Err(format!("{ev:?}"))
        }
    })
    .await;
    assert_eq!(env.claim_phase("foreign").await, "Pending");
    assert_eq!(env.images().len(), 2, "{:?}", env.images());

    // A class made after its claim: waited for, then applied.
    assert_eq!(env.claim_phase("later").await, "Pending");
    eventually("the claim waiting for its class", WAIT, || async {
        let ev = env.event_summary("later").await;
        let waits = |e: &String| e.starts_with("WaitingForVolumeAttributesClass");
        if ev.iter().any(|e| waits(e) && e.contains(&later)) {
            Ok(())
        } else {
            Err(format!("{ev:?}"))
        }
    })
    .await;
    vac(&env, &later, &env.name, json!({"baseWriteIops": "50"})).await;
    let (_, pv) = env.wait_bound("later").await;
    assert_eq!(write_limit(&env, &handle(&pv)).as_deref(), Some("50"));

    // A bound claim's class changed: applied to the image, the PV and the
    // claim's status, as the external-resizer would.
    let fast_handle = handle(&env.wait_bound("fast").await.1);
    let (slow, ghost) = (format!("{}-slow", env.ns), format!("{}-ghost", env.ns));
    vac(&env, &slow, &env.name, json!({"baseWriteIops": "20"})).await;
    set_class(&env, "fast", &slow).await;
    wait_applied(&env, "fast", &slow).await;
    assert_eq!(write_limit(&env, &fast_handle).as_deref(), Some("20"));
    let (_, pv) = env.wait_bound("fast").await;
    assert_eq!(pv_class(&pv).as_deref(), Some(slow.as_str()));
    let ev = env.event_summary("fast").await;
    assert!(
        ev.iter().any(|e| e.starts_with("VolumeModifySuccessful")),
        "{ev:?}"
    );

    // Another driver's class: Infeasible, the image unchanged.
    set_class(&env, "fast", &foreign).await;
    let c = wait_modify_status(&env, "fast", &foreign, "Infeasible").await;
    let conds = c.status.unwrap().conditions.unwrap_or_default();
    let err = conds.iter().find(|c| c.type_ == "ModifyVolumeError");
    let msg = err.and_then(|c| c.message.clone()).unwrap_or_default();
    assert!(msg.contains("other.csi.example"), "{conds:?}");
    assert_eq!(write_limit(&env, &fast_handle).as_deref(), Some("20"));

    // A class that does not exist yet: Pending, then applied once made.
    set_class(&env, "fast", &ghost).await;
    wait_modify_status(&env, "fast", &ghost, "Pending").await;
    vac(&env, &ghost, &env.name, json!({"baseWriteIops": "30"})).await;
    wait_applied(&env, "fast", &ghost).await;
    assert_eq!(write_limit(&env, &fast_handle).as_deref(), Some("30"));

    for n in ["plain", "fast", "later", "foreign"] {
        env.delete_claim(n).await;
    }
    eventually("every image gone", WAIT, || async {
        let images = env.images();
        if images.is_empty() {
            Ok(())
        } else {
            Err(format!("{images:?}"))
        }
    })
    .await;
    let api: Api<VolumeAttributesClass> = Api::all(env.client.clone());
    for n in [&fast, &later, &foreign, &slow, &ghost] {
        let _ = api.delete(n, &DeleteParams::default()).await;
    }
}
