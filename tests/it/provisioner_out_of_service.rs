//! Non-graceful node shutdown: node A dies with an RWO volume staged (its
//! plugin killed, its mapper frozen, nothing cleaned up; its Ceph clients
//! come from 127.0.0.2, node B's and the cluster's from 127.0.0.1). Node B
//! is refused the volume until the Node gets the
//! `node.kubernetes.io/out-of-service` taint; then the provisioner fences
//! the whole address of node A and breaks its lock, and B stages it within
//! [`MOVE_BOUND`]. A's mapper, let run again, cannot write through its
//! still-mapped device, nor can a new client from A's address; B's data is
//! intact. Removing the taint lifts the fence.
use crate::support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use tonic::Code;

use rbdkit::provisioner::out_of_service::{fenced_annotation, read_fenced, OUT_OF_SERVICE_TAINT};
use support::csi::{block_cap, CsiEnv, Mode};
use support::provisioner::{eventually, from_json, Env, WAIT};

/// How long the move of a volume off an out-of-service node may take,
/// from the taint to the stage on the other node.
const MOVE_BOUND: Duration = Duration::from_secs(60);
/// Node A's address.
const A_IP: &str = "127.0.0.2";

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// The mapper's processes: the supervisor and its worker.
fn mapper_pids(env: &CsiEnv) -> Vec<u32> {
    let sup = env.mapper.as_ref().expect("a mapper").pid();
    let children =
        std::fs::read_to_string(format!("/proc/{sup}/task/{sup}/children")).unwrap_or_default();
    let mut pids = vec![sup];
    pids.extend(
        children
            .split_whitespace()
            .filter_map(|p| p.parse::<u32>().ok()),
    );
    assert!(pids.len() >= 2, "the mapper has no worker");
    pids
}

fn staging(env: &CsiEnv) -> PathBuf {
    let p = env.path("staging");
    std::fs::create_dir_all(&p).unwrap();
    p
}

async fn set_taint(client: &kube::Client, node: &str, on: bool) {
    let taints = if on {
        json!([{"key": OUT_OF_SERVICE_TAINT, "value": "nodeshutdown", "effect": "NoExecute"}])
    } else {
        json!(null)
    };
    Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"taints": taints}})),
        )
        .await
        .unwrap_or_else(|e| panic!("taint Node {node}: {e}"));
}

/// Whether a new client from `ip` may write an object of the test's namespace.
fn writes_from(ip: &str, ns: &str) -> (bool, String) {
    support::ceph::rados_from(
        ip,
        &[
            "-p",
            support::ceph::POOL,
            "-N",
            ns,
            "put",
            "fence-probe",
            "/etc/hostname",
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_of_service_node_is_fenced_and_its_rwo_volume_staged_elsewhere() {
    let mut env = Env::new("oos").await;
    // The class's provisioner user may lift fences too.
    env.secret = env.fencer_secret().await;
    let class = env.storage_class("oos", json!({}), json!({})).await;
    let provisioner = env.start_in_process();
    env.claim("data", &class, "16Mi", &["ReadWriteOnce"], "Block")
        .await;
    let (_, pv) = env.wait_bound("data").await;
    let id = pv.spec.unwrap().csi.unwrap().volume_handle;

    let (name_a, name_b) = (format!("{}-a", env.ns), format!("{}-b", env.ns));
    for n in [&name_a, &name_b] {
        Api::<Node>::all(env.client.clone())
            .create(
                &PostParams::default(),
                &from_json(json!({"metadata": {"name": n}})),
            )
            .await
            .unwrap_or_else(|e| panic!("create Node {n}: {e}"));
    }
    let (rbd, cluster) = (env.rbd.clone(), env.cluster_id.clone());
    let mut a = CsiEnv::with_ns_env(
        rbd.clone(),
        cluster.clone(),
        Mode::All,
        &name_a,
        &[],
        support::ceph::from_address(A_IP),
    )
    .await;
    let b = CsiEnv::with_ns(rbd, cluster, Mode::All, &name_b, &[]).await;
    let (sa, sb) = (staging(&a), staging(&b));
    a.node()
        .await
        .node_stage_volume(a.stage_request(&id, &sa, block_cap()))
        .await
        .unwrap_or_else(|e| panic!("stage on node a: {e}"));
    support::data::direct_write(&sa.join("volume"), 0, &support::data::pattern(1, 1 << 20));

    // Node A dies: its plugin killed, its mapper frozen (cut off, and able
    // to write again once it runs).
    a.csi.kill9();
    let frozen = mapper_pids(&a);
    for pid in &frozen {
        signal(*pid, "-STOP");
    }
    let stage_b = || async {
        b.node()
            .await
            .node_stage_volume(b.stage_request(&id, &sb, block_cap()))
            .await
    };
    // Not out of service: node B is refused, naming node A.
    let e = stage_b().await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains(&name_a), "names the holder: {e}");
    let entry = format!("{A_IP}:0/0");
    assert!(!support::ceph::blocklist_addrs().contains(&entry));

    // The taint: B gets the volume within the bound, after A is fenced.
    set_taint(&env.client, &name_a, true).await;
    let tainted = Instant::now();
    let mut refused = 0;
    while let Err(e) = stage_b().await {
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.message().contains(&name_a), "{e}");
        refused += 1;
        assert!(
            tainted.elapsed() < MOVE_BOUND,
            "not staged on node B {MOVE_BOUND:?} after the taint: {e}; events {:?}",
            env.event_summary(&name_a).await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!(
        "out of service: staged on node B {:?} after the taint ({refused} refusals)",
        tainted.elapsed()
    );
    assert!(
        support::ceph::blocklist_addrs().contains(&entry),
        "node A's address is fenced"
    );
    let node: Node = Api::all(env.client.clone()).get(&name_a).await.unwrap();
    let record = read_fenced(&node, &env.name).unwrap();
    assert_eq!(record.len(), 1, "{:?}", node.metadata.annotations);
    assert_eq!(
        record[0].ips,
        vec![A_IP.parse::<std::net::IpAddr>().unwrap()]
    );
    env.wait_event(&name_a, "NodeFenced", &[&name_a, A_IP])
        .await;

    // B writes; A's mapper runs again and tries to, and so does a new
    // client from A's address: both refused.
    let second = support::data::pattern(2, 1 << 20);
    support::data::direct_write(&sb.join("volume"), 0, &second);
    for pid in &frozen {
        signal(*pid, "-CONT");
    }
    let late = support::data::pattern(3, 1 << 20);
    let write_a = support::data::try_direct_write(&sa.join("volume"), 1 << 20, &late);
    assert!(write_a.is_err(), "node A's device still writes");
    let (ok, err) = writes_from(A_IP, &env.rbd.name);
    assert!(!ok, "a new client from node A's address writes");
    assert!(err.contains("108") || err.contains("shutdown"), "{err}");
    let read = |off: u64| support::data::direct_read(&sb.join("volume"), off, 1 << 20);
    assert!(read(0) == second, "node B's data was overwritten");
    assert!(
        read(1 << 20).iter().all(|&x| x == 0),
        "node A's write landed"
    );

    // Back in service: the fence is lifted, and the record goes.
    set_taint(&env.client, &name_a, false).await;
    eventually("the fence lifted", WAIT, || async {
        let node: Node = Api::all(env.client.clone())
            .get(&name_a)
            .await
            .map_err(|e| e.to_string())?;
        let annotated = node
            .annotations()
            .contains_key(&fenced_annotation(&env.name));
        if annotated || support::ceph::blocklist_addrs().contains(&entry) {
            return Err(format!("annotations {:?}", node.metadata.annotations));
        }
        Ok(())
    })
    .await;
    env.wait_event(&name_a, "NodeUnfenced", &[&name_a]).await;
    let (ok, err) = writes_from(A_IP, &env.rbd.name);
    assert!(ok, "node A's address is served again: {err}");

    // Clean up: B lets go; A's plugin, restarted, unstages what it left.
    b.unstage(&id, &sb).await;
    a.csi.restart();
    a.unstage(&id, &sa).await;
    for n in [&name_a, &name_b] {
        let _ = Api::<Node>::all(env.client.clone())
            .delete(n, &DeleteParams::default())
            .await;
    }
    env.delete_claim("data").await;
    env.wait_gone(&env.pvs(), &pv.metadata.name.clone().unwrap())
        .await;
    provisioner.stop().await;
}
