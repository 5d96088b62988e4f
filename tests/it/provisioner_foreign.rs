//! A foreign image (made by someone else, without rbdkit's owner metadata)
//! that has the name a PV would get, or that a forged PV points at, is never
//! touched by the provisioner: not adopted, not expanded, not deleted, not
//! sent to the trash. (The CSI path is checked in tests/it/csi_controller.rs.)
use crate::support;

use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::PostParams;
use serde_json::json;

use rbdkit::provisioner::pv::{PROVISIONED_BY, PV_FINALIZER};
use rbdkit::rbd::{self, Image};
use rbdkit::volume::VolumeId;

use support::provisioner::{eventually, from_json, stays, Env, WAIT};

const MIB: u64 = 1 << 20;

/// Makes a foreign image with a snapshot (so a delete would need the trash).
fn foreign(env: &Env, name: &str) {
    rbd::create(&env.rbd.ioctx, name, 8 * MIB, &Default::default()).unwrap();
    let img = Image::open(&env.rbd.ioctx, name).unwrap();
    img.metadata_set("owner", "someone-else").unwrap();
    img.snap_create("keep").unwrap();
}

/// The foreign image is as it was made.
fn untouched(env: &Env, name: &str) -> Result<(), String> {
    let img = Image::open_read_only(&env.rbd.ioctx, name).map_err(|e| format!("{name}: {e}"))?;
    let size = img.size().map_err(|e| e.to_string())?;
    let meta = rbdkit::volume::ops::owner_metadata(&img).map_err(|e| e.to_string())?;
    let snaps = img.snap_list().map_err(|e| e.to_string())?.len();
    let trash = rbd::trash_list(&env.rbd.ioctx)
        .map_err(|e| e.to_string())?
        .len();
    if size == 8 * MIB && meta.is_empty() && snaps == 1 && trash == 0 {
        Ok(())
    } else {
        Err(format!(
            "{name}: size {size}, owner metadata {meta:?}, {snaps} snapshots, {trash} in trash"
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_images_are_never_adopted_expanded_or_deleted() {
    let mut env = Env::new("foreign").await;
    let class = env
        .storage_class("f", json!({}), json!({"allowVolumeExpansion": true}))
        .await;

    // 1. The image a new PV would get already exists, made by someone else.
    let claim = env
        .claim("squat", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let squatted = format!("pvc-{}", claim.metadata.uid.unwrap());
    foreign(&env, &squatted);

    // 2. A forged PV of ours pointing at another foreign image, bound to a
    // claim that will ask for an expansion and then be deleted.
    foreign(&env, "theirs");
    let handle = VolumeId {
        cluster_id: env.cluster_id.clone(),
        pool: "rbd".into(),
        rados_namespace: env.rbd.name.clone(),
        image: "theirs".into(),
    }
    .handle();
    let pv_name = format!("{}-forged", env.ns);
    let pv: PersistentVolume = from_json(json!({
        "metadata": {
            "name": pv_name,
            "annotations": {PROVISIONED_BY: env.name},
            "finalizers": [PV_FINALIZER],
        },
        "spec": {
            "capacity": {"storage": "8Mi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": class,
            "claimRef": {"namespace": env.ns, "name": "victim"},
            "csi": {
                "driver": env.name,
                "volumeHandle": handle,
                "controllerExpandSecretRef": {"name": env.secret, "namespace": env.ns},
            },
        },
    }));
    env.pvs().create(&PostParams::default(), &pv).await.unwrap();
    let victim: k8s_openapi::api::core::v1::PersistentVolumeClaim = from_json(json!({
        "metadata": {"name": "victim"},
        "spec": {
            "storageClassName": class,
            "accessModes": ["ReadWriteOnce"],
            "volumeName": pv_name,
            "resources": {"requests": {"storage": "8Mi"}},
        },
    }));
    env.claims()
        .create(&PostParams::default(), &victim)
        .await
        .unwrap();
    env.wait_bound("victim").await;

    let provisioner = env.start_in_process();
    env.wait_event(
        "squat",
        "ProvisioningFailed",
        &[&squatted, "not managed", "no rbdkit owner metadata"],
    )
    .await;

    env.resize_claim("victim", "64Mi").await;
    env.wait_event("victim", "VolumeResizeFailed", &["theirs", "not managed"])
        .await;

    env.delete_claim("victim").await;
    env.wait_event(&pv_name, "VolumeFailedDelete", &["theirs", "not managed"])
        .await;

    // Deleting the squatted claim leaves that image alone too.
    env.delete_claim("squat").await;
    env.wait_gone(&env.claims(), "squat").await;

    stays(
        "both foreign images untouched",
        Duration::from_secs(3),
        || async {
            untouched(&env, &squatted)?;
            untouched(&env, "theirs")
        },
    )
    .await;
    // The forged PV stays, held by the finalizer we may not lift on a
    // volume that is not ours.
    eventually("the forged PV still there", WAIT, || async {
        match env.pvs().get_opt(&pv_name).await {
            Ok(Some(_)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    provisioner.stop().await;
}
