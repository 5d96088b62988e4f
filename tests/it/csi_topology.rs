//! CreateVolume with `topologyConstrainedPools` against the real cluster,
//! two pools standing for two zones: the pool of the preferred zone, then
//! of a requisite one, the accessible topology returned, re-runs that keep
//! the image an earlier attempt made (whole or cut short) in another pool,
//! clones kept in their source's pool, and what cannot be placed refused.
use crate::support;

use std::collections::HashMap;

use rbdkit::csi::proto::{
    volume_content_source, CreateSnapshotRequest, CreateVolumeRequest, DeleteSnapshotRequest,
    DeleteVolumeRequest, Topology, TopologyRequirement, Volume, VolumeContentSource,
};
use rbdkit::rbd;
use rbdkit::volume::VolumeId;
use serde_json::json;
use support::ceph::POOL;
use support::csi::{mount_cap, CsiEnv, Mode};
use support::topology::{topo_pool, topo_secrets, TopoNs, TOPO_POOL};
use tonic::Code;

const ZONE: &str = "topology.rbd.rbdkit.io/zone";
const NODE: &str = "topology.rbd.rbdkit.io/node";

fn zone(z: &str) -> Topology {
    Topology {
        segments: HashMap::from([
            (ZONE.to_owned(), z.to_owned()),
            (NODE.to_owned(), format!("node-in-{z}")),
        ]),
    }
}

fn reqs(preferred: &[&str], requisite: &[&str]) -> Option<TopologyRequirement> {
    Some(TopologyRequirement {
        preferred: preferred.iter().map(|z| zone(z)).collect(),
        requisite: requisite.iter().map(|z| zone(z)).collect(),
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn create_volume_goes_to_the_pool_of_the_requested_zone() {
    topo_pool();
    let env = CsiEnv::new("csi-topo", Mode::Controller).await;
    let topo = TopoNs::new(&env.rbd.name);
    let mut params = env.params();
    params.insert(
        "topologyConstrainedPools".into(),
        json!([
            {"poolName": POOL, "domainSegments": [{"domainLabel": "zone", "value": "zone-a"}]},
            {"poolName": TOPO_POOL, "domainSegments": [{"domainLabel": "zone", "value": "zone-b"}]},
        ])
        .to_string(),
    );
    let create = |name: &str, r: Option<TopologyRequirement>, source: Option<&str>| {
        let params = params.clone();
        let name = name.to_owned();
        let source = source.map(|s| VolumeContentSource {
            r#type: Some(volume_content_source::Type::Snapshot(
                volume_content_source::SnapshotSource {
                    snapshot_id: s.to_owned(),
                },
            )),
        });
        let env = &env;
        async move {
            env.controller()
                .await
                .create_volume(CreateVolumeRequest {
                    name,
                    capacity_range: Some(rbdkit::csi::proto::CapacityRange {
                        required_bytes: 8 << 20,
                        limit_bytes: 0,
                    }),
                    volume_capabilities: vec![mount_cap("ext4")],
                    parameters: params,
                    secrets: topo_secrets(),
                    accessibility_requirements: r,
                    volume_content_source: source,
                    ..Default::default()
                })
                .await
                .map(|r| r.into_inner().volume.unwrap())
        }
    };
    let pool_of = |v: &Volume| VolumeId::parse(&v.volume_id).unwrap().pool;
    let zone_b = vec![Topology {
        segments: HashMap::from([(ZONE.to_owned(), "zone-b".to_owned())]),
    }];

    // Preferred zone-b, though zone-a comes first among the requisite ones.
    let v = create("pvc-t1", reqs(&["zone-b"], &["zone-a", "zone-b"]), None)
        .await
        .unwrap();
    assert_eq!(pool_of(&v), TOPO_POOL);
    assert_eq!(v.volume_context["pool"], TOPO_POOL);
    // Only the segment the pool needs, not the node.
    assert_eq!(v.accessible_topology, zone_b);
    assert_eq!(topo.images(), ["pvc-t1"]);
    assert!(rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());

    // A re-run, and one with other requirements (the scheduler picked
    // another node meanwhile): the image made first is kept, not remade.
    let again = create("pvc-t1", reqs(&["zone-b"], &["zone-a", "zone-b"]), None)
        .await
        .unwrap();
    assert_eq!(again.volume_id, v.volume_id);
    let moved = create("pvc-t1", reqs(&["zone-a"], &["zone-a", "zone-b"]), None)
        .await
        .unwrap();
    assert_eq!(moved.volume_id, v.volume_id);
    assert_eq!(moved.accessible_topology, zone_b);
    // ... unless where it is cannot serve the request.
    let e = create("pvc-t1", reqs(&[], &["zone-a"]), None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    assert!(e.message().contains(TOPO_POOL), "{e}");
    assert!(rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());

    // A create cut short in zone-a's pool (its temporary image) is finished
    // there, whatever is asked now.
    rbd::create(
        &env.rbd.ioctx,
        "pvc-t2.rbdkit-new",
        8 << 20,
        &Default::default(),
    )
    .unwrap();
    let v2 = create("pvc-t2", reqs(&["zone-b"], &["zone-a", "zone-b"]), None)
        .await
        .unwrap();
    assert_eq!(pool_of(&v2), POOL);
    assert_eq!(v2.accessible_topology[0].segments[ZONE], "zone-a");
    assert_eq!(rbd::list_names(&env.rbd.ioctx).unwrap(), ["pvc-t2"]);
    assert_eq!(topo.images(), ["pvc-t1"]);

    // Nothing fits: the spec's RESOURCE_EXHAUSTED, naming the terms.
    let e = create("pvc-t3", reqs(&[], &["zone-c"]), None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(
        e.message().contains("topologyConstrainedPools") && e.message().contains("zone-c"),
        "{e}"
    );
    // No requirements: the class's pool, reachable from anywhere.
    let v4 = create("pvc-t4", None, None).await.unwrap();
    assert_eq!(pool_of(&v4), POOL);
    assert!(v4.accessible_topology.is_empty());

    // A restore stays in its source's pool: zone-b's, though zone-a is
    // preferred; with only zone-a allowed it cannot be made.
    let snap = env
        .controller()
        .await
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: v.volume_id.clone(),
            name: "snapshot-t1".into(),
            secrets: topo_secrets(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    let r = create(
        "pvc-r1",
        reqs(&["zone-a"], &["zone-a", "zone-b"]),
        Some(&snap.snapshot_id),
    )
    .await
    .unwrap();
    assert_eq!(pool_of(&r), TOPO_POOL);
    assert_eq!(r.accessible_topology, zone_b);
    let e = create("pvc-r2", reqs(&[], &["zone-a"]), Some(&snap.snapshot_id))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(e.message().contains("source is in pool"), "{e}");

    let mut ctl = env.controller().await;
    ctl.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id,
        secrets: topo_secrets(),
    })
    .await
    .unwrap();
    for id in [r.volume_id, v.volume_id, v2.volume_id, v4.volume_id] {
        ctl.delete_volume(DeleteVolumeRequest {
            volume_id: id,
            secrets: topo_secrets(),
        })
        .await
        .unwrap();
    }
    assert!(topo.images().is_empty(), "{:?}", topo.images());
    assert!(rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());
}
