//! csi-addons NetworkFences, reconciled by the provisioner itself (the
//! csi-addons CRDs from their Go module, no csi-addons controller): a CIDR
//! block is range-blocklisted and a client in it is refused by the OSDs;
//! unfencing lets it in again; blocks that would fence the cluster itself,
//! too wide or malformed are refused by name with nothing added; deleting
//! takes csi-addons' finalizer off.
//!
//! The client "in another network" is the `rados` CLI with its sockets
//! bound to 127.0.0.3 (`support::ceph::rados_from`): the cluster's daemons
//! and every other client here are on 127.0.0.1.
use crate::support;

use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;

use support::csi_addons::cluster_api;
use support::provisioner::{eventually, from_json, Env, WAIT};

const OUTSIDE: &str = "127.0.0.3";

/// Whether a client at [`OUTSIDE`] may write an object; its error if not.
fn write_from_outside(ns: &str) -> Result<(), String> {
    let args = [
        "-p",
        support::ceph::POOL,
        "-N",
        ns,
        "put",
        "nf-probe",
        "/etc/hostname",
    ];
    match support::ceph::rados_from(OUTSIDE, &args) {
        (true, _) => Ok(()),
        (false, err) => Err(err),
    }
}

fn ranges() -> Vec<String> {
    let out = support::ceph::mon_json(json!({"prefix": "osd blocklist ls"})).unwrap();
    String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|a| a.starts_with("cidr:"))
        .map(str::to_owned)
        .collect()
}

async fn wait_status(api: &Api<DynamicObject>, name: &str, result: &str, words: &[&str]) {
    eventually(&format!("NetworkFence {name} {result}"), WAIT, || async {
        let o = api.get(name).await.map_err(|e| e.to_string())?;
        let s = &o.data["status"];
        let (r, m) = (
            s["result"].as_str().unwrap_or_default(),
            s["message"].as_str().unwrap_or_default(),
        );
        if r == result && words.iter().all(|w| m.contains(w)) {
            Ok(())
        } else {
            Err(format!("status {r:?}: {m}"))
        }
    })
    .await
}

async fn create_fence(api: &Api<DynamicObject>, name: &str, class: &str, cidrs: &[&str]) {
    api.create(
        &PostParams::default(),
        &from_json(json!({
            "apiVersion": "csiaddons.openshift.io/v1alpha1",
            "kind": "NetworkFence",
            "metadata": {"name": name},
            "spec": {"networkFenceClassName": class, "fenceState": "Fenced", "cidrs": cidrs},
        })),
    )
    .await
    .unwrap_or_else(|e| panic!("create NetworkFence {name}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_fence_blocklists_its_cidrs_and_refuses_to_fence_the_cluster() {
    let env = Env::new("nfence").await;
    support::csi_addons::install_crds(&env.client).await;
    let fencer = env.fencer_secret().await;
    let class = format!("{}-class", env.ns);
    cluster_api(&env.client, "NetworkFenceClass")
        .create(
            &PostParams::default(),
            &from_json(json!({
                "apiVersion": "csiaddons.openshift.io/v1alpha1",
                "kind": "NetworkFenceClass",
                "metadata": {"name": class},
                "spec": {"provisioner": env.name, "parameters": {
                    "clusterID": env.cluster_id,
                    "csiaddons.openshift.io/networkfence-secret-name": fencer,
                    "csiaddons.openshift.io/networkfence-secret-namespace": env.ns,
                }},
            })),
        )
        .await
        .expect("create the NetworkFenceClass");
    let provisioner = env.start_in_process();
    let fences = cluster_api(&env.client, "NetworkFence");
    write_from_outside(&env.rbd.name).expect("a client outside writes before the fence");

    // Fenced: the block is blocklisted, and the client in it refused.
    let name = format!("{}-outside", env.ns);
    create_fence(&fences, &name, &class, &[&format!("{OUTSIDE}/32")]).await;
    wait_status(
        &fences,
        &name,
        "Succeeded",
        &["fencing operation successful"],
    )
    .await;
    let entry = format!("cidr:{OUTSIDE}:0/32");
    assert!(ranges().contains(&entry), "{:?}", ranges());
    let o = fences.get(&name).await.unwrap();
    assert!(
        o.metadata
            .finalizers
            .unwrap_or_default()
            .contains(&"csiaddons.openshift.io/network-fence".to_owned()),
        "csi-addons' finalizer"
    );
    let e = write_from_outside(&env.rbd.name).expect_err("a fenced client wrote");
    assert!(e.contains("108") || e.contains("shutdown"), "{e}");
    write_from_outside_ok_on_loopback();

    // Unfenced: lifted, and the client writes again.
    fences
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"fenceState": "Unfenced"}})),
        )
        .await
        .expect("set Unfenced");
    wait_status(
        &fences,
        &name,
        "Succeeded",
        &["unfencing operation successful"],
    )
    .await;
    assert!(!ranges().contains(&entry), "{:?}", ranges());
    write_from_outside(&env.rbd.name).expect("a client outside writes once unfenced");

    // Blocks that would fence the cluster, too wide or malformed: refused
    // by name, nothing added.
    let before = ranges();
    for (suffix, cidr, why) in [
        ("mon", "127.0.0.0/24", "monitor"),
        ("wide", "10.0.0.0/8", "wider than /16"),
        ("bad", "10.0.0.1", "no /prefix"),
    ] {
        let n = format!("{}-{suffix}", env.ns);
        create_fence(&fences, &n, &class, &[cidr]).await;
        wait_status(&fences, &n, "Failed", &[cidr, why]).await;
        fences.delete(&n, &DeleteParams::default()).await.unwrap();
    }
    assert_eq!(ranges(), before, "a refused fence added an entry");

    // Delete: the finalizer comes off and the object goes.
    fences
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    eventually("the NetworkFence gone", WAIT, || async {
        match fences.get_opt(&name).await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let _ = cluster_api(&env.client, "NetworkFenceClass")
        .delete(&class, &DeleteParams::default())
        .await;
    provisioner.stop().await;
}

/// The cluster's own clients (on 127.0.0.1) are untouched by the fence.
fn write_from_outside_ok_on_loopback() {
    let ns = support::ceph::TestNs::new("nfence-inside");
    rbdkit::rbd::create(
        &ns.ioctx,
        "still",
        1 << 20,
        &rbdkit::rbd::ImageOptions::new(),
    )
    .expect("a client on 127.0.0.1 still writes");
}
