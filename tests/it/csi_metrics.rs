//! `rbdkit csi --http-addr`: `/healthz` (the gRPC socket answers),
//! `/readyz` (Probe is ready) and `/metrics` (per-RPC counts, errors and
//! latencies, Ceph call latencies, staged volumes per mapper), against the
//! real test cluster, with no key in what it serves.
use crate::support;

use rbdkit::csi::proto::{
    DeleteSnapshotRequest, DeleteVolumeRequest, NodeStageVolumeRequest, NodeUnstageVolumeRequest,
};
use support::csi::{block_cap, CsiEnv, Mode};
use support::provisioner::http_get;
use tonic::Code;

const MIB: i64 = 1 << 20;

/// A free port on the loopback (bound and released: the server takes it).
fn free_port() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_csi_server_serves_probes_and_metrics_without_keys() {
    let addr = free_port();
    let a = addr.to_string();
    let rbd = std::sync::Arc::new(support::ceph::TestNs::new("csi-metrics"));
    let mut env = CsiEnv::with_ns(
        rbd,
        support::ceph::unique("csi-metrics"),
        Mode::All,
        "metrics-node",
        &["--http-addr", &a],
    )
    .await;
    env.identity().await;
    let (code, body) =
        support::provisioner::eventually("/healthz", support::provisioner::WAIT, || async {
            match http_get(addr, "/healthz").await {
                (200, b) => Ok((200, b)),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
    assert_eq!((code, body.as_str()), (200, "ok"));
    assert_eq!(http_get(addr, "/readyz").await.0, 200);

    // Work: a volume created and staged, and a call that fails.
    let id = env
        .create_volume("pvc-metrics", 16 * MIB, block_cap())
        .await;
    let staging = env.path("staging");
    std::fs::create_dir_all(&staging).unwrap();
    let stage: NodeStageVolumeRequest = env.stage_request(&id, &staging, block_cap());
    env.node().await.node_stage_volume(stage).await.unwrap();
    let e = env
        .controller()
        .await
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: String::new(),
            secrets: env.secrets(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    let (code, text) = http_get(addr, "/metrics").await;
    assert_eq!(code, 200);
    for want in [
        r#"rbdkit_csi_operations_total{service="Controller",method="CreateVolume",code="OK"} 1"#,
        r#"rbdkit_csi_operations_total{service="Node",method="NodeStageVolume",code="OK"} 1"#,
        r#"rbdkit_csi_operations_total{service="Controller",method="DeleteSnapshot",code="InvalidArgument"} 1"#,
        r#"rbdkit_csi_operation_errors_total{service="Controller",method="DeleteSnapshot"} 1"#,
        r#"rbdkit_csi_operation_duration_seconds_count{service="Controller",method="CreateVolume"} 1"#,
        r#"rbdkit_csi_staged_volumes{mapper="rbdkit-fuse"} 1"#,
        r#"rbdkit_csi_ceph_op_duration_seconds_count{operation="create"}"#,
        "rbdkit_csi_ready 1",
    ] {
        assert!(text.contains(want), "{want} missing from:\n{text}");
    }
    for key in [&env.secrets()["userKey"], &env.node_secrets()["userKey"]] {
        assert!(!text.contains(key.as_str()), "a key in /metrics");
    }

    env.node()
        .await
        .node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .unwrap();
    let (_, text) = http_get(addr, "/metrics").await;
    assert!(!text.contains("rbdkit_csi_staged_volumes{"), "{text}");
    env.controller()
        .await
        .delete_volume(DeleteVolumeRequest {
            volume_id: id,
            secrets: env.secrets(),
        })
        .await
        .unwrap();

    // The mapper gone: not ready, still alive.
    env.mapper.as_mut().unwrap().kill9();
    let (code, why) = http_get(addr, "/readyz").await;
    assert_eq!(code, 503, "{why}");
    assert_eq!(http_get(addr, "/healthz").await.0, 200);
    assert!(http_get(addr, "/metrics")
        .await
        .1
        .contains("rbdkit_csi_ready 0"));
    env.mapper.as_mut().unwrap().restart();
    env.wait_mapper();
    // The server down: /healthz answers no more.
    env.csi.kill9();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
