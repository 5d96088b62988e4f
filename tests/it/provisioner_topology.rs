//! `topologyConstrainedPools` with the built-in provisioner (no
//! external-provisioner), against the real API server and Ceph: two pools
//! stand for two zones. A WaitForFirstConsumer claim whose selected node
//! (a Node object with its labels, and the CSINode the node plugin
//! registers with its topology keys) is in zone-b gets its image in
//! zone-b's pool and a PV whose node affinity says zone-b; a claim of a
//! class with `allowedTopologies` goes to the allowed zone's pool; one
//! whose allowed zone no pool serves is refused by name, nothing made.
use crate::support;

use k8s_openapi::api::core::v1::{Node, PersistentVolume, Secret as K8sSecret};
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::{Api, DeleteParams, PostParams};
use rbdkit::volume::VolumeId;
use serde_json::json;

use support::ceph::{unique, POOL};
use support::provisioner::{eventually, from_json, Env, WAIT};
use support::topology::{topo_key, topo_pool, TopoNs, TOPO_POOL, TOPO_USER};

const ZONE: &str = "topology.rbd.rbdkit.io/zone";

/// A Node in `zone` and its CSINode with the zone as topology key (what
/// the node plugin's registration makes), with no kubelet behind it.
async fn node_in(env: &Env, zone: &str) -> String {
    let name = unique(&format!("topo-{zone}"));
    Api::<Node>::all(env.client.clone())
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": name, "labels": {ZONE: zone}},
                "spec": {
                    "unschedulable": true,
                    "taints": [{"key": "rbdkit.test/no-kubelet", "effect": "NoSchedule"}],
                },
            })),
        )
        .await
        .expect("create Node");
    Api::<CSINode>::all(env.client.clone())
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": name},
                "spec": {"drivers": [{
                    "name": env.name, "nodeID": name, "topologyKeys": [ZONE],
                }]},
            })),
        )
        .await
        .expect("create CSINode");
    name
}

fn zone_affinity(pv: &PersistentVolume) -> Vec<(String, Vec<String>)> {
    let terms = pv
        .spec
        .as_ref()
        .and_then(|s| s.node_affinity.as_ref())
        .and_then(|a| a.required.as_ref())
        .map(|r| r.node_selector_terms.clone())
        .unwrap_or_default();
    terms
        .iter()
        .flat_map(|t| t.match_expressions.clone().unwrap_or_default())
        .map(|e| (e.key, e.values.unwrap_or_default()))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn claims_go_to_the_pool_of_their_zone() {
    topo_pool();
    let mut env = Env::new("ptopo").await;
    let topo = TopoNs::new(&env.rbd.name);
    // A provisioner user with both pools.
    Api::<K8sSecret>::namespaced(env.client.clone(), &env.ns)
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": "ceph-topo"},
                "stringData": {"userID": TOPO_USER, "userKey": topo_key()},
            })),
        )
        .await
        .unwrap();
    let _p = env.start_in_process();
    let pools = json!([
        {"poolName": POOL, "domainSegments": [{"domainLabel": "zone", "value": "zone-a"}]},
        {"poolName": TOPO_POOL, "domainSegments": [{"domainLabel": "zone", "value": "zone-b"}]},
    ])
    .to_string();
    let params = json!({
        "topologyConstrainedPools": pools,
        "csi.storage.k8s.io/provisioner-secret-name": "ceph-topo",
    });
    let wffc = env
        .storage_class(
            "wffc",
            params.clone(),
            json!({"volumeBindingMode": "WaitForFirstConsumer"}),
        )
        .await;
    let allowed_in = |zone: &str| {
        json!({"allowedTopologies": [{"matchLabelExpressions": [
            {"key": ZONE, "values": [zone]}]}]})
    };
    let allowed = env
        .storage_class("allowed", params.clone(), allowed_in("zone-b"))
        .await;
    let only_c = env
        .storage_class("only-c", params, allowed_in("zone-c"))
        .await;
    let node_b = node_in(&env, "zone-b").await;

    // The scheduler's choice, written as kube-scheduler writes it.
    env.claim("in-b", &wffc, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    env.annotate_claim(
        "in-b",
        [("volume.kubernetes.io/selected-node", node_b.as_str())].into(),
    )
    .await;
    env.claim("allowed", &allowed, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    env.claim("in-c", &only_c, "8Mi", &["ReadWriteOnce"], "Block")
        .await;

    for claim in ["in-b", "allowed"] {
        let (_, pv) = env.wait_bound(claim).await;
        let handle = &pv
            .spec
            .as_ref()
            .unwrap()
            .csi
            .as_ref()
            .unwrap()
            .volume_handle;
        let vol = VolumeId::parse(handle).unwrap();
        assert_eq!(vol.pool, TOPO_POOL, "{claim}");
        assert_eq!(
            zone_affinity(&pv),
            [(ZONE.to_owned(), vec!["zone-b".to_owned()])],
            "{claim}"
        );
        assert_eq!(
            pv.spec
                .as_ref()
                .unwrap()
                .csi
                .as_ref()
                .unwrap()
                .volume_attributes
                .as_ref()
                .unwrap()["pool"],
            TOPO_POOL
        );
    }
    assert_eq!(topo.images().len(), 2, "{:?}", topo.images());
    assert!(env.images().is_empty(), "{:?}", env.images());

    // A zone no pool serves: refused by name, nothing made.
    eventually("the zone-c claim refused", WAIT, || async {
        let ev = env.event_summary("in-c").await;
        if ev
            .iter()
            .any(|e| e.contains("ProvisioningFailed") && e.contains("zone-c"))
        {
            Ok(())
        } else {
            Err(format!("{ev:?}"))
        }
    })
    .await;
    assert_eq!(topo.images().len(), 2);
    assert!(env.images().is_empty());

    for claim in ["in-b", "in-c", "allowed"] {
        env.delete_claim(claim).await;
    }
    eventually("images deleted", WAIT, || async {
        if topo.images().is_empty() {
            Ok(())
        } else {
            Err(format!("{:?}", topo.images()))
        }
    })
    .await;
    let _ = Api::<CSINode>::all(env.client.clone())
        .delete(&node_b, &DeleteParams::default())
        .await;
    let _ = Api::<Node>::all(env.client.clone())
        .delete(&node_b, &DeleteParams::default())
        .await;
}
