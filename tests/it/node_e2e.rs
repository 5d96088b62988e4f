//! End-to-end tests on a real node: every pod here is a real container that
//! the kubelet (`scripts/k8s-test-node`: kubelet, containerd, runc) starts,
//! with an rbdkit volume that the kubelet stages and publishes through
//! rbdkit's node plugin (registered through the plugin-registration
//! socket), provisioned by rbdkit's provisioner in a real Ceph cluster.
//! Each test has its own namespace, provisioner and driver name, RADOS
//! namespace and node plugin, so they run side by side on the one node.
use crate::support;

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node as K8sNode, Pod};
use k8s_openapi::api::storage::v1::CSINode;
use kube::Api;
use serde_json::json;

use rbdkit::rbd::Image;

use support::node::{
    busybox_pod, claim_volume, create_pod, delete_pod, pod_logs, prepare_namespace, wait_phase,
    Node, NodePlugin, POD_WAIT, TOPOLOGY_KEY,
};
use support::provisioner::{eventually, stays, Env, InProcess, WAIT};

/// One test's world on the shared node.
struct World {
    node: &'static Node,
    env: Env,
    plugin: NodePlugin,
    provisioner: Option<InProcess>,
}

impl World {
    async fn new(test: &str) -> World {
        let node = Node::shared();
        let env = Env::new(test).await;
        prepare_namespace(&env.client, &env.ns).await;
        let provisioner = Some(env.start_in_process());
        let plugin = NodePlugin::start(node, &env.client, &env.name, &env.config_path()).await;
        World {
            node,
            env,
            plugin,
            provisioner,
        }
    }

    fn client(&self) -> &kube::Client {
        &self.env.client
    }

    async fn run(&self, pod: serde_json::Value) {
        create_pod(self.client(), &self.env.ns, pod).await;
    }

    async fn wait(&self, pod: &str, want: &[&str]) -> Pod {
        wait_phase(self.node, self.client(), &self.env.ns, pod, want, POD_WAIT).await
    }

    async fn logs(&self, pod: &str) -> String {
        pod_logs(self.client(), &self.env.ns, pod).await
    }

    async fn delete_pod(&self, pod: &str) {
        delete_pod(self.node, self.client(), &self.env.ns, pod).await;
    }

    /// Runs a pod to Succeeded and returns its log.
    async fn run_to_success(&self, pod: serde_json::Value) -> String {
        let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
        self.run(pod).await;
        self.wait(&name, &["Succeeded"]).await;
        self.logs(&name).await
    }

    /// Deletes the claim and waits until its PV and image are gone and the
    /// node holds nothing of it: no mount, no loop device, no mapping.
    async fn delete_claim_and_check_clean(&self, claim: &str, pv: &str) {
        self.env.delete_claim(claim).await;
        self.env.wait_gone(&self.env.pvs(), pv).await;
        eventually("the image removed", WAIT, || async {
            let images = self.env.images();
            if images.is_empty() {
                Ok(())
            } else {
                Err(format!("images {images:?}"))
            }
        })
        .await;
        eventually("nothing of the volume left on the node", WAIT, || async {
            let mounts = self.plugin.kubelet_mounts(pv);
            let loops = self.plugin.loop_devices();
            let maps = self
                .plugin
                .fuse_mapper()
                .list()
                .map_err(|e| format!("mapper list: {e}"))?;
            if mounts.is_empty() && loops.is_empty() && maps.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "mounts {mounts:?}, loop devices {loops:?}, mappings {:?}",
                    maps.iter().map(|m| &m.image).collect::<Vec<_>>()
                ))
            }
        })
        .await;
    }

    async fn finish(mut self) {
        if let Some(p) = self.provisioner.take() {
            p.stop().await;
        }
    }
}

fn data_mount() -> serde_json::Value {
    json!([{"name": "data", "mountPath": "/data"}])
}

/// 1. A pod writes a file and exits; a second pod mounts the same claim and
///    reads it back; deleting the claim leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn filesystem_claim_written_by_one_pod_is_read_by_the_next() {
    let mut w = World::new("nfs").await;
    let class = w
        .env
        .storage_class(
            "fs",
            json!({"csi.storage.k8s.io/fstype": "ext4"}),
            json!({}),
        )
        .await;
    w.env
        .claim("data", &class, "64Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = w.env.wait_bound("data").await;
    let pv_name = pv.metadata.name.clone().unwrap();
    let text = format!("written by a pod in {}", w.env.ns);

    let script =
        format!("set -e; echo '{text}' > /data/hello; sync -f /data/hello; cat /data/hello");
    let out = w
        .run_to_success(busybox_pod(
            w.node,
            "writer",
            &script,
            claim_volume("data"),
            data_mount(),
        ))
        .await;
    assert_eq!(out.trim(), text);
    // The kubelet mounted it where a kubelet does: a staging path under
    // plugins/kubernetes.io/csi and a target under the pod's volumes.
    w.delete_pod("writer").await;

    let out = w
        .run_to_success(busybox_pod(
            w.node,
            "reader",
            "cat /data/hello; mount | grep ' /data '",
            claim_volume("data"),
            data_mount(),
        ))
        .await;
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some(text.as_str()), "reader log: {out}");
    let mount_line = lines.next().unwrap_or_default();
    assert!(
        mount_line.contains("/dev/loop") && mount_line.contains(" ext4 "),
        "the pod's /data is not the ext4 on a loop device: {out}"
    );
    w.delete_pod("reader").await;

    w.delete_claim_and_check_clean("data", &pv_name).await;
    w.env.wait_gone(&w.env.claims(), "data").await;
    w.finish().await;
}

/// 2. A pod writes bytes to the raw device of a Block claim; the test reads
///    them back from the image with the library.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn block_claim_bytes_written_by_a_pod_are_in_the_image() {
    let mut w = World::new("nblk").await;
    let class = w.env.storage_class("blk", json!({}), json!({})).await;
    w.env
        .claim("raw", &class, "16Mi", &["ReadWriteOnce"], "Block")
        .await;
    let (_, pv) = w.env.wait_bound("raw").await;
    let pv_name = pv.metadata.name.clone().unwrap();
    let word = format!("rbdkit-block-{}", w.env.ns);
    // 4 KiB of "word\n" repeated, at 1 MiB into the device.
    let script = format!(
        "set -e; yes '{word}' | head -c 4096 > /tmp/blk; \
         dd if=/tmp/blk of=/dev/xvda bs=4096 seek=256 conv=notrunc,fsync; echo written"
    );
    let mut pod = busybox_pod(
        w.node,
        "blockwriter",
        &script,
        claim_volume("raw"),
        json!([]),
    );
    pod["spec"]["containers"][0]["volumeDevices"] =
        json!([{"name": "data", "devicePath": "/dev/xvda"}]);
    let out = w.run_to_success(pod).await;
    assert!(out.contains("written"), "pod log: {out}");
    w.delete_pod("blockwriter").await;

    let vol = support::provisioner::volume_id(&pv);
    let image = Image::open_read_only(&w.env.rbd.ioctx, &vol.image).unwrap();
    let mut buf = vec![0u8; 4096];
    image.read_exact(1 << 20, &mut buf).unwrap();
    let want: Vec<u8> = format!("{word}\n")
        .into_bytes()
        .into_iter()
        .cycle()
        .take(4096)
        .collect();
    assert!(
        buf == want,
        "the image at 1 MiB holds {:?}...",
        String::from_utf8_lossy(&buf[..64])
    );
    drop(image);

    w.delete_claim_and_check_clean("raw", &pv_name).await;
    w.finish().await;
}

/// 3. A WaitForFirstConsumer class: nothing is provisioned until the real
///    scheduler picks the node for a pod; then the claim is provisioned for
///    that node, whose topology the node plugin reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wait_for_first_consumer_is_provisioned_for_the_scheduled_node() {
    let mut w = World::new("nwffc").await;
    let class = w
        .env
        .storage_class(
            "wffc",
            json!({}),
            json!({"volumeBindingMode": "WaitForFirstConsumer"}),
        )
        .await;
    w.env
        .claim("late", &class, "32Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    stays(
        "no volume before a pod uses the claim",
        Duration::from_secs(3),
        || async {
            let c = w
                .env
                .claims()
                .get("late")
                .await
                .map_err(|e| e.to_string())?;
            let bound = c.spec.as_ref().and_then(|s| s.volume_name.clone());
            if bound.is_none() && w.env.images().is_empty() {
                Ok(())
            } else {
                Err(format!("bound to {bound:?}, images {:?}", w.env.images()))
            }
        },
    )
    .await;

    // No nodeName: the scheduler places it.
    w.run(busybox_pod(
        w.node,
        "consumer",
        "echo placed > /data/f && cat /data/f",
        claim_volume("late"),
        data_mount(),
    ))
    .await;
    let pod = w.wait("consumer", &["Succeeded"]).await;
    assert_eq!(
        pod.spec.as_ref().unwrap().node_name.as_deref(),
        Some(w.node.name.as_str())
    );
    assert_eq!(w.logs("consumer").await.trim(), "placed");
    let (claim, pv) = w.env.wait_bound("late").await;
    assert_eq!(
        claim
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("volume.kubernetes.io/selected-node"))
            .map(String::as_str),
        Some(w.node.name.as_str()),
        "the scheduler's choice is on the claim"
    );
    // The topology the node plugin reported reached the API: the CSINode
    // lists the key, and the kubelet labelled the node with it.
    let csinode: CSINode = Api::all(w.client().clone())
        .get(&w.node.name)
        .await
        .unwrap();
    let ours = csinode
        .spec
        .drivers
        .iter()
        .find(|d| d.name == w.env.name)
        .expect("our driver in the CSINode");
    assert_eq!(ours.node_id, w.node.name);
    assert_eq!(ours.topology_keys, Some(vec![TOPOLOGY_KEY.to_owned()]));
    let k8s_node: K8sNode = Api::all(w.client().clone())
        .get(&w.node.name)
        .await
        .unwrap();
    assert_eq!(
        k8s_node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(TOPOLOGY_KEY))
            .map(String::as_str),
        Some(w.node.name.as_str())
    );
    let pv_name = pv.metadata.name.clone().unwrap();
    w.delete_pod("consumer").await;
    w.delete_claim_and_check_clean("late", &pv_name).await;
    w.finish().await;
}

/// `df -k /data` lines of a pod's log: the size in KiB of each.
fn df_sizes(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.starts_with("DF "))
        .filter_map(|l| l.split_whitespace().nth(2)?.parse().ok())
        .collect()
}

/// 4. A running pod's xfs volume grows; `df` inside the pod sees the new
///    size without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_running_pod_sees_its_volume_grow() {
    let mut w = World::new("ngrow").await;
    let class = w
        .env
        .storage_class(
            "xfs",
            json!({"csi.storage.k8s.io/fstype": "xfs"}),
            json!({"allowVolumeExpansion": true}),
        )
        .await;
    w.env
        .claim("grow", &class, "320Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = w.env.wait_bound("grow").await;
    let pv_name = pv.metadata.name.clone().unwrap();
    w.run(busybox_pod(
        w.node,
        "watcher",
        "while :; do echo \"DF $(df -k /data | tail -1)\"; sleep 1; done",
        claim_volume("grow"),
        data_mount(),
    ))
    .await;
    let pod = w.wait("watcher", &["Running"]).await;
    let started = pod
        .status
        .as_ref()
        .unwrap()
        .container_statuses
        .clone()
        .unwrap()[0]
        .state
        .clone();
    let before = eventually("df in the pod", WAIT, || async {
        let log = w.logs("watcher").await;
        df_sizes(&log).last().copied().ok_or(log)
    })
    .await;
    // xfs keeps some of the device for itself (its log, above all).
    assert!(
        (200 * 1024..=320 * 1024).contains(&before),
        "a 320 MiB xfs shows {before} KiB"
    );

    w.env.resize_claim("grow", "640Mi").await;
    let after = eventually("df in the pod to see the new size", WAIT, || async {
        let log = w.logs("watcher").await;
        match df_sizes(&log).last() {
            Some(&s) if s >= before + 300 * 1024 => Ok(s),
            s => Err(format!(
                "last df {s:?} KiB; claim status {:?}\n{}",
                w.env
                    .claims()
                    .get("grow")
                    .await
                    .ok()
                    .and_then(|c| c.status)
                    .map(|s| (s.capacity, s.conditions)),
                w.node.kubelet_log_tail(10)
            )),
        }
    })
    .await;
    assert!(
        after <= 640 * 1024,
        "a 640 MiB xfs shows {after} KiB (it showed {before} KiB at 320 MiB)"
    );
    eprintln!("xfs in the pod: {before} KiB at 320 MiB, {after} KiB at 640 MiB");
    // The same container, never restarted.
    let pod: Pod = Api::namespaced(w.client().clone(), &w.env.ns)
        .get("watcher")
        .await
        .unwrap();
    let cs = &pod
        .status
        .as_ref()
        .unwrap()
        .container_statuses
        .clone()
        .unwrap()[0];
    assert_eq!(cs.restart_count, 0);
    assert_eq!(cs.state, started);
    eventually("the claim's capacity to be 640Mi", WAIT, || async {
        let c = w
            .env
            .claims()
            .get("grow")
            .await
            .map_err(|e| e.to_string())?;
        let cap = c
            .status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get("storage"))
            .map(|q| q.0.clone());
        if cap.as_deref() == Some("640Mi") {
            Ok(())
        } else {
            Err(format!("capacity {cap:?}"))
        }
    })
    .await;

    w.delete_pod("watcher").await;
    w.delete_claim_and_check_clean("grow", &pv_name).await;
    w.finish().await;
}

/// Appends `n` checksummed records to /data/log, each with an fsync, one
/// every 50 ms, and fails on the first write that fails.
fn writer_script(n: u32) -> String {
    format!(
        "i=0; while [ $i -lt {n} ]; do \
           printf '%08d %s\\n' $i $(echo $i | md5sum | cut -c1-32) \
             | dd of=/data/log oflag=append conv=notrunc,fsync 2>/dev/null || {{ echo WRITE-FAILED $i; exit 1; }}; \
           [ $((i % 20)) -eq 0 ] && echo wrote $i; \
           i=$((i+1)); sleep 0.05; \
         done; echo done $i"
    )
}

/// Waits until the writer pod has reported record `at`.
async fn progress(w: &World, at: u32) {
    eventually(&format!("the writer past record {at}"), WAIT, || async {
        let log = w.logs("writer").await;
        let last = log
            .lines()
            .filter_map(|l| l.strip_prefix("wrote ")?.parse::<u32>().ok())
            .max();
        match last {
            Some(n) if n >= at => Ok(()),
            _ if log.contains("WRITE-FAILED") => Err(format!("a write failed: {log}")),
            _ => Err(format!("log: {log}")),
        }
    })
    .await
}

/// Reads /data/log back and checks every record's number and checksum.
const VERIFY_SCRIPT: &str = "n=0; while read i sum; do \
    [ \"$i\" = \"$(printf %08d $n)\" ] || { echo BAD-ORDER $n $i; exit 1; }; \
    [ \"$sum\" = \"$(echo $n | md5sum | cut -c1-32)\" ] || { echo BAD-SUM $n; exit 1; }; \
    n=$((n+1)); done < /data/log; echo OK $n";

/// 5. While a pod keeps writing (fsync'd, checksummed records), the node
///    plugin is killed with SIGKILL: the CSI service (not in the data path:
///    writes go on, and the restarted service serves the next pod), and
///    then the FUSE mapper's worker (the supervisor keeps the FUSE
///    connection and starts a new worker; writes wait and then go on). No
///    write fails and every record reads back intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_go_on_across_kill_9_of_the_node_plugin() {
    let mut w = World::new("nkill").await;
    let class = w
        .env
        .storage_class(
            "fs",
            json!({"csi.storage.k8s.io/fstype": "ext4"}),
            json!({}),
        )
        .await;
    w.env
        .claim("busy", &class, "64Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = w.env.wait_bound("busy").await;
    let pv_name = pv.metadata.name.clone().unwrap();
    let records = 400;
    w.run(busybox_pod(
        w.node,
        "writer",
        &writer_script(records),
        claim_volume("busy"),
        data_mount(),
    ))
    .await;
    w.wait("writer", &["Running", "Succeeded"]).await;
    progress(&w, 40).await;
    let old_pid = w.plugin.csi.pid();
    w.plugin.csi.kill9();
    tokio::time::sleep(Duration::from_secs(1)).await;
    progress(&w, 80).await;
    w.plugin.csi.restart();
    assert_ne!(w.plugin.csi.pid(), old_pid);

    progress(&w, 120).await;
    let worker = w
        .plugin
        .mapper_worker_pid()
        .expect("the fuse-mapper supervisor has a worker");
    let status = std::process::Command::new("kill")
        .args(["-KILL", &worker.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    progress(&w, 200).await;
    let new_worker = eventually("a new mapper worker", WAIT, || async {
        match w.plugin.mapper_worker_pid() {
            Some(p) if p != worker => Ok(p),
            p => Err(format!("worker {p:?}")),
        }
    })
    .await;
    assert_ne!(new_worker, worker);
    assert!(w.plugin.mapper.running(), "the supervisor itself is gone");

    w.wait("writer", &["Succeeded"]).await;
    let log = w.logs("writer").await;
    assert!(
        log.contains(&format!("done {records}")),
        "writer log: {log}"
    );
    w.delete_pod("writer").await;

    // A new pod: staged and published by the restarted CSI service, on the
    // mapping the new worker serves.
    let out = w
        .run_to_success(busybox_pod(
            w.node,
            "verifier",
            VERIFY_SCRIPT,
            claim_volume("busy"),
            data_mount(),
        ))
        .await;
    assert_eq!(out.trim(), format!("OK {records}"));
    w.delete_pod("verifier").await;
    w.delete_claim_and_check_clean("busy", &pv_name).await;
    w.finish().await;
}

/// 7. With `fsGroup`, the volume root is group-owned by that group and
///    setgid, and a non-root user of the group writes to it (the CSIDriver
///    of deploy/ has fsGroupPolicy File). This pod is on the CNI bridge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fs_group_owns_the_volume_root() {
    let mut w = World::new("nfsg").await;
    let class = w
        .env
        .storage_class(
            "fs",
            json!({"csi.storage.k8s.io/fstype": "ext4"}),
            json!({}),
        )
        .await;
    w.env
        .claim("shared", &class, "32Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = w.env.wait_bound("shared").await;
    let pv_name = pv.metadata.name.clone().unwrap();
    let mut pod = busybox_pod(
        w.node,
        "grouped",
        "set -e; stat -c 'root %g %A' /data; id -u; touch /data/mine; stat -c 'file %g' /data/mine",
        claim_volume("shared"),
        data_mount(),
    );
    pod["spec"]["hostNetwork"] = json!(false);
    pod["spec"]["securityContext"] =
        json!({"fsGroup": 4242, "runAsUser": 1000, "runAsGroup": 1000});
    let out = w.run_to_success(pod).await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "pod log: {out}");
    let root: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(root[..2], ["root", "4242"], "pod log: {out}");
    assert!(
        root[2].starts_with('d') && root[2].as_bytes()[6] == b's',
        "the root is not setgid and group-writable: {out}"
    );
    assert_eq!(lines[1], "1000");
    assert_eq!(lines[2], "file 4242", "pod log: {out}");
    w.delete_pod("grouped").await;
    w.delete_claim_and_check_clean("shared", &pv_name).await;
    w.finish().await;
}
