//! Node labels on the node plugin (`rbdkit csi --mode all`, userspace
//! mapper) against the real API server and cluster: `--domainlabels` in
//! NodeGetInfo's topology, and read affinity (`--enable-read-affinity`,
//! `--crush-location-labels`) reaching librbd on the mapper's connection,
//! read back with `rados_conf_get` (the mapper's `status`). A Node object of
//! the test's own stands for the node (no kubelet needed to read labels).
use crate::support;

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kube::api::{DeleteParams, PostParams};
use kube::Api;
use rbdkit::csi::proto::{DeleteVolumeRequest, NodeGetInfoRequest, NodeUnstageVolumeRequest};
use serde_json::json;
use support::ceph::{unique, TestNs};
use support::csi::{block_cap, CsiEnv, Mode};
use support::k8s::ControlPlane;
use support::provisioner::from_json;

#[tokio::test(flavor = "multi_thread")]
async fn node_labels_give_topology_and_read_affinity() {
    let cp = ControlPlane::shared();
    let client = cp.client().await;
    let node_name = unique("ranode");
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": node_name, "labels": {
                    "topology.kubernetes.io/zone": "eu.west-1a",
                    "kubernetes.io/hostname": node_name,
                    "example.com/rack": "r7",
                }},
                // No kubelet behind it: nothing may be scheduled there.
                "spec": {
                    "unschedulable": true,
                    "taints": [{"key": "rbdkit.test/no-kubelet", "effect": "NoSchedule"}],
                },
            })),
        )
        .await
        .expect("create the Node object");
    let kubeconfig = cp.kubeconfig_path().display().to_string();
    let env = CsiEnv::with_ns(
        Arc::new(TestNs::new("csi-ra")),
        unique("csi-ra"),
        Mode::All,
        &node_name,
        &[
            "--domainlabels",
            "topology.kubernetes.io/zone,example.com/rack",
            "--enable-read-affinity",
            "--crush-location-labels",
            "topology.kubernetes.io/zone,kubernetes.io/hostname",
            "--kubeconfig",
            &kubeconfig,
        ],
    )
    .await;

    let info = env
        .node()
        .await
        .node_get_info(NodeGetInfoRequest::default())
        .await
        .unwrap()
        .into_inner();
    let segments = info.accessible_topology.unwrap().segments;
    assert_eq!(segments.len(), 3, "{segments:?}");
    assert_eq!(segments["topology.rbd.rbdkit.io/zone"], "eu.west-1a");
    assert_eq!(segments["topology.rbd.rbdkit.io/rack"], "r7");
    assert_eq!(segments["topology.rbd.rbdkit.io/node"], node_name);

    let mapper = rbdkit::node::fuse::FuseMapper::new(env.path("mapper.sock"));
    let mut staged = Vec::new();
    for (name, map_options) in [
        ("pvc-ra1", None),
        ("pvc-ra2", Some("rbdkit-fuse:read_from_replica=balance")),
    ] {
        let id = env.create_volume(name, 8 << 20, block_cap()).await;
        let staging = env.path(&format!("staging-{name}"));
        std::fs::create_dir_all(&staging).unwrap();
        let mut req = env.stage_request(&id, &staging, block_cap());
        if let Some(o) = map_options {
            req.volume_context.insert("mapOptions".into(), o.into());
        }
        env.node()
            .await
            .node_stage_volume(req)
            .await
            .unwrap_or_else(|e| panic!("NodeStageVolume {name}: {e}"));
        let status = mapper
            .status(&id)
            .unwrap()
            .expect("the mapper serves the volume");
        assert!(status.healthy, "{status:?}");
        // As the connection serving the image reads them back.
        let got: std::collections::BTreeMap<String, String> =
            status.librbd.iter().cloned().collect();
        if map_options.is_none() {
            assert_eq!(got["rbd_read_from_replica_policy"], "localize", "{got:?}");
            assert_eq!(
                got["crush_location"],
                format!("host={node_name} zone=eu-west-1a"),
                "{got:?}"
            );
        } else {
            // The class set read affinity itself: it wins, whole.
            assert_eq!(got["rbd_read_from_replica_policy"], "balance", "{got:?}");
            assert!(!got.contains_key("crush_location"), "{got:?}");
        }
        staged.push((id, staging));
    }

    for (id, staging) in staged {
        env.node()
            .await
            .node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .unwrap();
        env.controller()
            .await
            .delete_volume(DeleteVolumeRequest {
                volume_id: id,
                secrets: env.secrets(),
            })
            .await
            .unwrap();
    }
    assert!(mapper.list().unwrap().is_empty());
    nodes
        .delete(&node_name, &DeleteParams::default())
        .await
        .unwrap();
}
