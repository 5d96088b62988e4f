//! The node side on a real kernel: Debian 12's 6.1 (rbd.ko, FUSE without
//! `FUSE_HAS_RESEND`) in a QEMU guest with a one-node Ceph of its own
//! (`scripts/kernel-vm`). This machine's kernel has no rbd driver, so krbd
//! is tested here against the real `/sys/bus/rbd`; `csi_krbd.rs` keeps the
//! fake-sysfs test of the add and remove strings.
//!
//! [`debian_6_1_guest`] boots the guest once and runs this same test binary
//! in it, with the tests of [`GUEST_TESTS`]: the [`guest`] module's tests
//! (ignored on the host, where there is no rbd driver), rbd-nbd measured
//! beside rbdkit-fuse ([`peers`]), the userspace mapper's worker-restart
//! tests of `node_fuse.rs`, as they are, and `encryption.rs`'s dm-crypt
//! tests. Every krbd path `csi_krbd.rs`'s fake sysfs covers is covered here
//! on the real kernel too.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Command;

mod peers;

/// What the guest runs, in this order (one vCPU: one at a time).
const GUEST_TESTS: &[&str] = &[
    "kernel_vm::guest::krbd_stage_publish_unpublish_unstage_ext4_and_xfs",
    "kernel_vm::guest::krbd_kill9_of_the_node_plugin_leaves_mapping_and_mount",
    "kernel_vm::guest::krbd_online_expansion_of_ext4_and_xfs",
    "kernel_vm::guest::krbd_block_volume_grows_online",
    "kernel_vm::guest::krbd_ms_mode_crc_on_the_v2_port_and_map_options",
    "kernel_vm::guest::krbd_probe_is_ready_with_krbd_the_default",
    "kernel_vm::guest::krbd_one_writer_across_two_node_plugins",
    "kernel_vm::guest::krbd_exclusive_map_option_keeps_a_second_writer_out",
    "kernel_vm::guest::krbd_what_the_fake_sysfs_test_covers_on_the_real_kernel",
    "kernel_vm::guest::krbd_inline_secret_where_the_kernel_keyring_is_unavailable",
    "kernel_vm::guest::krbd_takes_the_read_affinity_options",
    "kernel_vm::guest::krbd_read_from_replica_with_crush_location",
    "kernel_vm::peers::rbd_nbd_lifecycle_map_mkfs_mount_write_read_grow_unmap",
    "kernel_vm::peers::rbd_nbd_and_rbdkit_fuse_kill9_side_by_side",
    "kernel_vm::guest::krbd_refuses_image_features_the_kernel_lacks_by_name",
    "kernel_vm::guest::krbd_qos_limits_go_into_the_pods_cgroup_io_max",
    "encryption::guest::krbd_stages_an_encrypted_volume_through_dm_crypt",
    "encryption::guest::fuse_and_krbd_open_each_others_encrypted_volumes",
    "node_fuse::worker_kill9_with_writes_and_fsyncs_in_flight",
    "node_fuse::mounted_filesystem_survives_kill9_of_the_worker",
];

/// Guest tests that fail for a known defect that is being fixed elsewhere:
/// they must fail, and the run fails once one passes (then drop it here).
const KNOWN_DEFECTS: &[(&str, &str)] = &[];

/// The outcome of each test in libtest's output (`test NAME ... ok`).
fn outcomes(log: &str) -> Vec<(String, String)> {
    log.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("test ")?;
            let (name, outcome) = rest.split_once(" ... ")?;
            Some((name.to_owned(), outcome.trim().to_owned()))
        })
        .collect()
}

/// Boots the guest, runs [`GUEST_TESTS`] in it, and checks each outcome.
/// Fails (never skips) when QEMU or the guest image cannot be had.
#[test]
fn debian_6_1_guest() {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let me = std::env::current_exe().expect("current_exe");
    // The build's output folder: the test binary, rbdkit (CARGO_BIN_EXE_*).
    let bins = Path::new(env!("CARGO_BIN_EXE_rbdkit"))
        .parent()
        .expect("bin dir")
        .to_owned();
    assert!(
        me.starts_with(&bins),
        "{} is not under {}",
        me.display(),
        bins.display()
    );
    let out = match support::artifacts::dir() {
        Some(d) => d.join("kernel-vm"),
        None => PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kernel-vm"),
    };
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let mut cmd = Command::new(repo.join("scripts/kernel-vm"));
    cmd.arg("run")
        .arg("--out")
        .arg(&out)
        .arg("--share")
        .arg(&bins)
        .arg("--mkdir")
        .arg(env!("CARGO_TARGET_TMPDIR"))
        .arg("--")
        .arg(&me)
        .args([
            "--include-ignored",
            "--exact",
            "--test-threads=1",
            "--show-output",
        ])
        .args(GUEST_TESTS);
    let t0 = std::time::Instant::now();
    let status = cmd.status().expect("run scripts/kernel-vm");
    let log = std::fs::read_to_string(out.join("guest.log")).unwrap_or_default();
    let got = outcomes(&log);
    eprintln!(
        "kernel-vm: {:.0} s wall; guest output in {}",
        t0.elapsed().as_secs_f64(),
        out.display()
    );
    for (name, outcome) in &got {
        eprintln!("  guest: {name} ... {outcome}");
    }
    let mut wrong = Vec::new();
    for want in GUEST_TESTS {
        let outcome = got.iter().find(|(n, _)| n == want).map(|(_, o)| o.as_str());
        let known = KNOWN_DEFECTS.iter().find(|(n, _)| n == want);
        match (outcome, known) {
            (Some("ok"), None) | (Some("FAILED"), Some(_)) => {}
            (Some("ok"), Some((_, why))) => wrong.push(format!(
                "{want} passes now: drop it from KNOWN_DEFECTS ({why})"
            )),
            (o, _) => wrong.push(format!("{want}: {}", o.unwrap_or("did not run"))),
        }
    }
    let rc = status.code().unwrap_or(-1);
    assert!(
        !got.is_empty() || rc == 0,
        "scripts/kernel-vm failed before any guest test ran (exit {rc}: 90 Ceph did not start, \
         92 the guest ended without a result; other: its message above, e.g. no QEMU or no image); \
         console and logs in {}",
        out.display()
    );
    // libtest exits 101 when a test failed; anything else is the guest's.
    let failed_as_known =
        got.iter().filter(|(_, o)| o == "FAILED").count() == KNOWN_DEFECTS.len() && rc == 101;
    let key_hits = std::fs::read_to_string(out.join("key-hits")).unwrap_or_default();
    assert!(
        key_hits.trim().is_empty(),
        "a cephx key of the guest's cluster is in: {key_hits}"
    );
    assert!(
        wrong.is_empty() && (rc == 0 || failed_as_known),
        "kernel-vm exit {rc}; {}\n--- guest output (last 150 lines of {}) ---\n{}",
        wrong.join("; "),
        out.join("guest.log").display(),
        support::process::tail(&out.join("guest.log"), 150)
    );
}

/// The tests that need the guest's kernel: ignored on the host, run by
/// [`debian_6_1_guest`] in the guest with `--include-ignored`.
mod guest {
    use crate::support;

    use std::collections::HashMap;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::path::{Path, PathBuf};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use rbdkit::csi::node::VOLUME;
    use rbdkit::csi::proto::{
        identity_client::IdentityClient, node_client::NodeClient, CapacityRange,
        ControllerExpandVolumeRequest, CreateVolumeRequest, DeleteVolumeRequest,
        NodeExpandVolumeRequest, NodePublishVolumeRequest, NodeStageVolumeRequest,
        NodeUnpublishVolumeRequest, NodeUnstageVolumeRequest, ProbeRequest, VolumeCapability,
    };
    use serde_json::json;
    use support::ceph::{unique, TestCluster, TestNs};
    use support::csi::{block_cap, channel, mount_cap, CsiEnv, Mode};
    use support::process::Proc;

    const MIB: i64 = 1 << 20;
    const SYS_RBD: &str = "/sys/bus/rbd";

    /// Panics unless this runs in the kernel guest.
    pub(super) fn require_guest() {
        assert!(
            std::env::var_os("RBDKIT_IN_GUEST").is_some(),
            "this test needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"
        );
        assert!(
            Path::new(SYS_RBD).exists(),
            "no {SYS_RBD}: rbd.ko not loaded"
        );
    }

    /// The mon's v1 address as the kernel takes it (`ip:port`, no `v1:`).
    pub(super) fn mon_v1() -> String {
        let host = TestCluster::get().conf_value("mon host").expect("mon host");
        host.trim_start_matches("v1:").to_owned()
    }

    /// The mon's msgr2 address (the guest's cluster binds v2 too).
    fn mon_v2() -> String {
        let out = support::ceph::mon_json(json!({"prefix": "mon dump", "format": "json"}))
            .expect("mon dump");
        let dump: serde_json::Value = serde_json::from_slice(&out).expect("mon dump json");
        dump["mons"][0]["public_addrs"]["addrvec"]
            .as_array()
            .expect("addrvec")
            .iter()
            .find(|a| a["type"] == "v2")
            .and_then(|a| a["addr"].as_str())
            .expect("a v2 address: the guest's cluster binds msgr2")
            .to_owned()
    }

    /// One krbd device in sysfs.
    #[derive(Debug)]
    struct Dev {
        id: String,
        image: String,
    }

    /// The kernel's rbd devices in RADOS namespace `ns`.
    fn devices_in(ns: &str) -> Vec<Dev> {
        let mut v = Vec::new();
        for e in std::fs::read_dir(format!("{SYS_RBD}/devices")).unwrap() {
            let p = e.unwrap().path();
            let attr = |n: &str| {
                std::fs::read_to_string(p.join(n))
                    .unwrap_or_default()
                    .trim()
                    .to_owned()
            };
            if attr("pool_ns") == ns {
                v.push(Dev {
                    id: p.file_name().unwrap().to_string_lossy().into_owned(),
                    image: attr("name"),
                });
            }
        }
        v
    }

    fn sys_attr(dev: &Dev, name: &str) -> String {
        std::fs::read_to_string(format!("{SYS_RBD}/devices/{}/{name}", dev.id))
            .unwrap_or_else(|e| panic!("rbd{} {name}: {e}", dev.id))
            .trim()
            .to_owned()
    }

    fn mount_of(path: &Path) -> Option<rbdkit::node::mount::MountInfo> {
        rbdkit::node::mount::mountinfo()
            .unwrap()
            .into_iter()
            .rev()
            .find(|m| m.mount_point == path)
    }

    fn write_synced(path: &Path, data: &[u8]) {
        let mut f = std::fs::File::create(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        f.write_all(data).unwrap();
        f.sync_all().unwrap();
    }

    /// `rbdkit csi --mode node` as node `node_id`, its files under `dir`.
    fn spawn_node(dir: &Path, node_id: &str, config: &Path) -> (Proc, PathBuf) {
        spawn_node_with(dir, node_id, config, &[])
    }

    /// [`spawn_node`] with more arguments.
    fn spawn_node_with(
        dir: &Path,
        node_id: &str,
        config: &Path,
        extra: &[&str],
    ) -> (Proc, PathBuf) {
        let socket = dir.join(format!("csi-{node_id}.sock"));
        let mut args: Vec<String> = vec![
            "csi".into(),
            "--mode".into(),
            "node".into(),
            "--endpoint".into(),
            format!("unix://{}", socket.display()),
            "--node-id".into(),
            node_id.into(),
            "--clusters-config".into(),
            config.display().to_string(),
            "--state-dir".into(),
            dir.join(format!("state-{node_id}")).display().to_string(),
            "--mapper-socket".into(),
            dir.join("mapper.sock").display().to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let log = dir.join(format!("csi-{node_id}.log"));
        (
            Proc::rbdkit(&format!("rbdkit csi {node_id}"), args, log),
            socket,
        )
    }

    /// The controller (through `CsiEnv`) and `rbdkit csi --mode node` with
    /// its default mapper, which is krbd where `/sys/bus/rbd` exists.
    struct World {
        ns: Arc<TestNs>,
        ctl: CsiEnv,
        node: Proc,
        socket: PathBuf,
        dir: tempfile::TempDir,
    }

    impl World {
        async fn new(test: &str, monitor: String) -> World {
            require_guest();
            let ns = Arc::new(TestNs::new(test));
            let cluster_id = unique(test);
            let ctl = CsiEnv::with_ns(
                Arc::clone(&ns),
                cluster_id.clone(),
                Mode::Controller,
                "ctl",
                &[],
            )
            .await;
            let dir = tempfile::Builder::new()
                .prefix("kvm-node-")
                .tempdir_in("/tmp")
                .unwrap();
            // The monitors as a ceph-csi config.json lists them: ip:port.
            let config = json!([{
                "clusterID": cluster_id,
                "monitors": [monitor],
                "rbd": {"radosNamespace": ns.name},
            }]);
            let config_path = dir.path().join("config.json");
            std::fs::write(&config_path, config.to_string()).unwrap();
            let (node, socket) = spawn_node(dir.path(), "guest", &config_path);
            World {
                ns,
                ctl,
                node,
                socket,
                dir,
            }
        }

        async fn node(&self) -> NodeClient<tonic::transport::Channel> {
            NodeClient::new(channel(&self.socket).await)
        }

        /// A staging folder and a publish target (its parent made, as kubelet does).
        fn paths(&self, name: &str) -> (PathBuf, PathBuf) {
            let staging = self.dir.path().join(format!("staging-{name}"));
            let parent = self.dir.path().join(format!("pod-{name}"));
            std::fs::create_dir_all(&staging).unwrap();
            std::fs::create_dir_all(&parent).unwrap();
            (staging, parent.join("vol"))
        }

        fn stage_req(
            &self,
            id: &str,
            staging: &Path,
            cap: VolumeCapability,
            ctx: &[(&str, &str)],
        ) -> NodeStageVolumeRequest {
            let mut r = self.ctl.stage_request(id, staging, cap);
            r.volume_context = ctx
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>();
            r
        }

        async fn stage(
            &self,
            id: &str,
            staging: &Path,
            cap: VolumeCapability,
            ctx: &[(&str, &str)],
        ) {
            let t0 = Instant::now();
            self.node()
                .await
                .node_stage_volume(self.stage_req(id, staging, cap, ctx))
                .await
                .unwrap_or_else(|e| panic!("NodeStageVolume: {e}\n{}", self.node.log_tail(30)));
            eprintln!("NodeStageVolume {id}: {:?}", t0.elapsed());
        }

        async fn publish(&self, id: &str, staging: &Path, target: &Path, cap: VolumeCapability) {
            self.node()
                .await
                .node_publish_volume(NodePublishVolumeRequest {
                    volume_id: id.to_owned(),
                    staging_target_path: staging.display().to_string(),
                    target_path: target.display().to_string(),
                    volume_capability: Some(cap),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("NodePublishVolume: {e}\n{}", self.node.log_tail(30)));
        }

        async fn unpublish(&self, id: &str, target: &Path) {
            self.node()
                .await
                .node_unpublish_volume(NodeUnpublishVolumeRequest {
                    volume_id: id.to_owned(),
                    target_path: target.display().to_string(),
                })
                .await
                .unwrap_or_else(|e| panic!("NodeUnpublishVolume: {e}\n{}", self.node.log_tail(30)));
        }

        async fn unstage(&self, id: &str, staging: &Path) {
            self.node()
                .await
                .node_unstage_volume(NodeUnstageVolumeRequest {
                    volume_id: id.to_owned(),
                    staging_target_path: staging.display().to_string(),
                })
                .await
                .unwrap_or_else(|e| panic!("NodeUnstageVolume: {e}\n{}", self.node.log_tail(30)));
        }

        async fn delete(&self, id: &str) {
            self.ctl
                .controller()
                .await
                .delete_volume(DeleteVolumeRequest {
                    volume_id: id.to_owned(),
                    secrets: self.ctl.secrets(),
                })
                .await
                .unwrap_or_else(|e| panic!("DeleteVolume: {e}"));
        }

        /// The one krbd device of this world.
        /// Creates a volume with StorageClass parameters `extra` too.
        async fn create_with(
            &self,
            name: &str,
            bytes: i64,
            cap: VolumeCapability,
            extra: &[(&str, &str)],
        ) -> String {
            let mut params = self.ctl.params();
            params.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            self.ctl
                .controller()
                .await
                .create_volume(CreateVolumeRequest {
                    name: name.into(),
                    capacity_range: Some(CapacityRange {
                        required_bytes: bytes,
                        limit_bytes: 0,
                    }),
                    volume_capabilities: vec![cap],
                    parameters: params,
                    secrets: self.ctl.secrets(),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("CreateVolume {name}: {e}"))
                .into_inner()
                .volume
                .unwrap()
                .volume_id
        }

        async fn stage_err(
            &self,
            id: &str,
            staging: &Path,
            cap: VolumeCapability,
            ctx: &[(&str, &str)],
        ) -> tonic::Status {
            self.node()
                .await
                .node_stage_volume(self.stage_req(id, staging, cap, ctx))
                .await
                .expect_err("NodeStageVolume succeeded")
        }

        /// The one krbd device of this world.
        fn device(&self) -> Dev {
            let mut d = devices_in(&self.ns.name);
            assert_eq!(d.len(), 1, "krbd devices in {}: {d:?}", self.ns.name);
            d.remove(0)
        }

        /// The node plugin's log has no key in it.
        fn assert_no_key_in_log(&self) {
            let log = self.node.log_text();
            for k in [support::ceph::node_key(), support::ceph::provisioner_key()] {
                assert!(!log.contains(&k), "a cephx key in the node plugin's log");
            }
        }
    }

    impl Drop for World {
        fn drop(&mut self) {
            // Leave no mount or mapping behind, even after a failure.
            self.node.kill9();
            let root = self.dir.path().to_owned();
            let mut mounts: Vec<PathBuf> = rbdkit::node::mount::mountinfo()
                .unwrap_or_default()
                .into_iter()
                .map(|m| m.mount_point)
                .filter(|p| p.starts_with(&root))
                .collect();
            mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
            for p in mounts {
                let _ = rbdkit::node::mount::ensure_unmounted(&p);
            }
            for d in devices_in(&self.ns.name) {
                let _ = std::fs::write(
                    format!("{SYS_RBD}/remove_single_major"),
                    format!("{} force", d.id),
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_stage_publish_unpublish_unstage_ext4_and_xfs() {
        let w = World::new("kvm-fs", mon_v1()).await;
        // xfsprogs 6.1 makes no filesystem under 300 MB.
        for (fs, size) in [("ext4", 64 * MIB), ("xfs", 320 * MIB)] {
            let id = w
                .ctl
                .create_volume(&format!("pvc-{fs}"), size, mount_cap(fs))
                .await;
            let (staging, target) = w.paths(fs);
            w.stage(&id, &staging, mount_cap(fs), &[]).await;
            let dev = w.device();
            let vol = rbdkit::volume::VolumeId::parse(&id).unwrap();
            assert_eq!(dev.image, vol.image);
            let m = mount_of(&staging.join(VOLUME)).expect("staging mounted");
            assert_eq!(m.source, format!("/dev/rbd{}", dev.id), "{m:?}");
            assert_eq!(m.fstype, fs);
            assert_eq!(sys_attr(&dev, "size"), size.to_string());
            w.publish(&id, &staging, &target, mount_cap(fs)).await;
            let data = support::data::pattern(7, 3 << 20);
            write_synced(&target.join("f"), &data);
            w.unpublish(&id, &target).await;
            w.unstage(&id, &staging).await;
            assert!(mount_of(&staging.join(VOLUME)).is_none() && mount_of(&target).is_none());
            assert!(
                devices_in(&w.ns.name).is_empty(),
                "NodeUnstageVolume left the krbd device"
            );
            // A new mapping of the image has the file: it went to Ceph.
            w.stage(&id, &staging, mount_cap(fs), &[]).await;
            w.publish(&id, &staging, &target, mount_cap(fs)).await;
            assert!(
                std::fs::read(target.join("f")).unwrap() == data,
                "{fs}: file differs after a new map"
            );
            w.unpublish(&id, &target).await;
            w.unstage(&id, &staging).await;
            assert!(devices_in(&w.ns.name).is_empty());
            w.delete(&id).await;
        }
        w.assert_no_key_in_log();
    }

    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_kill9_of_the_node_plugin_leaves_mapping_and_mount() {
        let mut w = World::new("kvm-kill", mon_v1()).await;
        let id = w
            .ctl
            .create_volume("pvc-kill", 64 * MIB, mount_cap("ext4"))
            .await;
        let (staging, target) = w.paths("k");
        w.stage(&id, &staging, mount_cap("ext4"), &[]).await;
        w.publish(&id, &staging, &target, mount_cap("ext4")).await;
        write_synced(&target.join("before"), b"before the kill");
        let dev = w.device();
        w.node.kill9();
        // The kernel holds the mapping and the mount, not the plugin.
        assert_eq!(w.device().id, dev.id);
        assert!(mount_of(&staging.join(VOLUME)).is_some() && mount_of(&target).is_some());
        write_synced(&target.join("after"), b"written with no plugin");
        assert_eq!(
            std::fs::read(target.join("before")).unwrap(),
            b"before the kill"
        );
        // A restarted plugin carries on: the calls kubelet repeats, then teardown.
        w.node.restart();
        w.stage(&id, &staging, mount_cap("ext4"), &[]).await;
        w.publish(&id, &staging, &target, mount_cap("ext4")).await;
        assert_eq!(w.device().id, dev.id, "the restart mapped the image again");
        w.unpublish(&id, &target).await;
        w.unstage(&id, &staging).await;
        assert!(devices_in(&w.ns.name).is_empty());
        w.stage(&id, &staging, mount_cap("ext4"), &[]).await;
        w.publish(&id, &staging, &target, mount_cap("ext4")).await;
        assert_eq!(
            std::fs::read(target.join("after")).unwrap(),
            b"written with no plugin"
        );
        // Killed again, then drained: NodeUnstage, which carries no secrets,
        // releases the staging lock at once, with the credentials the plugin
        // kept in the kernel's user keyring.
        w.node.restart();
        w.unpublish(&id, &target).await;
        w.unstage(&id, &staging).await;
        let image = rbdkit::volume::VolumeId::parse(&id).unwrap().image;
        let lock = rbdkit::node::stage_lock::ImageLock::open(
            &support::ceph::cluster(),
            support::ceph::POOL,
            &w.ns.name,
            &image,
        )
        .unwrap();
        assert!(
            lock.holders().unwrap().lockers.is_empty(),
            "the staging lock outlived NodeUnstage after a restart"
        );
        w.delete(&id).await;
        w.assert_no_key_in_log();
    }

    /// krbd ignores librbd's QoS settings: a volume's limits go into the
    /// `io.max` of the publishing pod's cgroup (found by the pod uid in the
    /// target path, as the kubelet's systemd driver names it), and 50
    /// direct 4 KiB writes from that cgroup run at most at the limit (only
    /// that bound is asserted: load can only slow them more).
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_qos_limits_go_into_the_pods_cgroup_io_max() {
        const LIMIT: f64 = 10.0;
        const WRITES: u32 = 50;
        let w = World::new("kvm-qos", mon_v1()).await;
        let id = w
            .ctl
            .create_volume("pvc-qos", 64 * MIB, mount_cap("ext4"))
            .await;
        let image = rbdkit::volume::VolumeId::parse(&id).unwrap().image;
        // What a class's QoS sets: librbd's image setting.
        rbdkit::rbd::Image::open(&w.ns.ioctx, &image)
            .unwrap()
            .metadata_set("conf_rbd_qos_write_iops_limit", &LIMIT.to_string())
            .unwrap();
        // A pod's cgroup as the kubelet's systemd driver makes it, with the
        // io controller enabled down to it.
        let uid = "5f0c2d1e-7a3b-4c8d-9e0f-1a2b3c4d5e6f";
        let root = Path::new("/sys/fs/cgroup");
        let kubepods = root.join("kubepods.slice");
        let pod = kubepods.join(format!("kubepods-pod{}.slice", uid.replace('-', "_")));
        std::fs::write(root.join("cgroup.subtree_control"), "+io").unwrap();
        std::fs::create_dir_all(&kubepods).unwrap();
        std::fs::write(kubepods.join("cgroup.subtree_control"), "+io").unwrap();
        std::fs::create_dir_all(&pod).unwrap();

        let (staging, _) = w.paths("q");
        let target = w.dir.path().join(format!(
            "pods/{uid}/volumes/kubernetes.io~csi/pvc-qos/mount"
        ));
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        w.stage(&id, &staging, mount_cap("ext4"), &[]).await;
        w.publish(&id, &staging, &target, mount_cap("ext4")).await;
        let dev = PathBuf::from(format!("/dev/rbd{}", w.device().id));
        let (major, minor) = rbdkit::node::cgroup_io::device_numbers(&dev).unwrap();
        let io_max = std::fs::read_to_string(pod.join("io.max")).unwrap();
        assert!(
            io_max.contains(&format!(
                "{major}:{minor} rbps=max wbps=max riops=max wiops={LIMIT}"
            )),
            "{io_max}"
        );

        // Direct writes from a process in the pod's cgroup.
        let t = Instant::now();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec dd if=/dev/zero of={}/f bs=4k count={WRITES} oflag=direct",
                pod.display(),
                target.display()
            ))
            .output()
            .unwrap();
        let took = t.elapsed().as_secs_f64();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stat = std::fs::read_to_string(pod.join("io.stat")).unwrap();
        let wios: u64 = stat
            .lines()
            .find(|l| l.starts_with(&format!("{major}:{minor} ")))
            .and_then(|l| l.split_whitespace().find_map(|f| f.strip_prefix("wios=")))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let iops = f64::from(WRITES) / took;
        eprintln!("{WRITES} direct 4 KiB writes in the pod's cgroup: {took:.2} s, {iops:.1} IOPS (limit {LIMIT}), wios {wios}");
        assert!(
            wios >= u64::from(WRITES),
            "the writes were not the pod cgroup's: {stat}"
        );
        assert!(iops <= LIMIT * 1.5, "{iops:.1} IOPS over the {LIMIT} limit");

        w.unpublish(&id, &target).await;
        w.unstage(&id, &staging).await;
        w.delete(&id).await;
        let _ = std::fs::remove_dir(&pod);
        let _ = std::fs::remove_dir(&kubepods);
    }

    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_online_expansion_of_ext4_and_xfs() {
        let w = World::new("kvm-grow", mon_v1()).await;
        // ext4's online resize needs CAP_SYS_RESOURCE, which the guest has
        // and the host does not.
        for (fs, from, to) in [("ext4", 64 * MIB, 160 * MIB), ("xfs", 320 * MIB, 480 * MIB)] {
            let id = w
                .ctl
                .create_volume(&format!("pvc-grow-{fs}"), from, mount_cap(fs))
                .await;
            let (staging, target) = w.paths(&format!("g-{fs}"));
            w.stage(&id, &staging, mount_cap(fs), &[]).await;
            w.publish(&id, &staging, &target, mount_cap(fs)).await;
            write_synced(&target.join("f"), b"kept across the growth");
            let before = rbdkit::node::fs::stats(&target).unwrap().total_bytes;
            let range = Some(CapacityRange {
                required_bytes: to,
                limit_bytes: 0,
            });
            w.ctl
                .controller()
                .await
                .controller_expand_volume(ControllerExpandVolumeRequest {
                    volume_id: id.clone(),
                    capacity_range: range,
                    secrets: w.ctl.secrets(),
                    volume_capability: Some(mount_cap(fs)),
                })
                .await
                .unwrap();
            let resp = w
                .node()
                .await
                .node_expand_volume(NodeExpandVolumeRequest {
                    volume_id: id.clone(),
                    volume_path: target.display().to_string(),
                    capacity_range: range,
                    staging_target_path: staging.display().to_string(),
                    volume_capability: Some(mount_cap(fs)),
                    secrets: Default::default(),
                })
                .await
                .unwrap_or_else(|e| panic!("NodeExpandVolume: {e}\n{}", w.node.log_tail(30)))
                .into_inner();
            assert_eq!(resp.capacity_bytes, to);
            assert_eq!(sys_attr(&w.device(), "size"), to.to_string());
            let after = rbdkit::node::fs::stats(&target).unwrap().total_bytes;
            assert!(
                after as i64 > before as i64 + (to - from) / 2,
                "{fs} mounted on krbd: df saw {before} then {after} bytes"
            );
            assert_eq!(
                std::fs::read(target.join("f")).unwrap(),
                b"kept across the growth"
            );
            w.unpublish(&id, &target).await;
            w.unstage(&id, &staging).await;
            w.delete(&id).await;
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_ms_mode_crc_on_the_v2_port_and_map_options() {
        // Only the v2 port is given: the kernel's default (legacy) messenger
        // would time out there, ms_mode=crc talks msgr2.
        let w = World::new("kvm-msgr2", mon_v2()).await;
        let id = w
            .ctl
            .create_volume("pvc-msgr2", 32 * MIB, block_cap())
            .await;
        let (staging, target) = w.paths("b");
        w.stage(
            &id,
            &staging,
            block_cap(),
            &[(
                "mapOptions",
                "krbd:ms_mode=crc,alloc_size=65536,queue_depth=64",
            )],
        )
        .await;
        let dev = w.device();
        // config_info holds the add string (never printed: it names the key).
        let info = sys_attr(&dev, "config_info");
        assert!(
            info.contains("ms_mode=crc"),
            "ms_mode=crc not in rbd{}'s options",
            dev.id
        );
        let q = |n: &str| {
            std::fs::read_to_string(format!("/sys/block/rbd{}/queue/{n}", dev.id))
                .unwrap()
                .trim()
                .to_owned()
        };
        assert_eq!(q("discard_granularity"), "65536", "alloc_size");
        let tags =
            std::fs::read_to_string(format!("/sys/block/rbd{}/mq/0/nr_tags", dev.id)).unwrap();
        assert_eq!(tags.trim(), "64", "queue_depth");
        w.publish(&id, &staging, &target, block_cap()).await;
        let data = support::data::pattern(3, 1 << 20);
        {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(&target)
                .unwrap();
            f.seek(SeekFrom::Start(4 << 20)).unwrap();
            f.write_all(&data).unwrap();
            f.sync_all().unwrap();
        }
        let mut back = vec![0u8; data.len()];
        {
            let mut f = std::fs::File::open(&target).unwrap();
            f.seek(SeekFrom::Start(4 << 20)).unwrap();
            f.read_exact(&mut back).unwrap();
        }
        assert!(back == data);
        w.unpublish(&id, &target).await;
        w.unstage(&id, &staging).await;
        assert!(devices_in(&w.ns.name).is_empty());
        w.delete(&id).await;
        w.assert_no_key_in_log();
    }

    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_probe_is_ready_with_krbd_the_default() {
        let w = World::new("kvm-probe", mon_v1()).await;
        // A bound for a hang only: the guest runs under TCG (no KVM) on a
        // host at load 10, where one probe can take seconds; returns as
        // soon as the probe says ready.
        const READY_WITHIN: Duration = Duration::from_secs(120);
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let ready = IdentityClient::new(channel(&w.socket).await)
                .probe(ProbeRequest {})
                .await
                .expect("Probe")
                .into_inner()
                .ready;
            if ready == Some(true) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "Probe not ready after {READY_WITHIN:?} with krbd the default mapper \
                 ({ready:?}):\n{}",
                w.node.log_tail(10)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_refuses_image_features_the_kernel_lacks_by_name() {
        let w = World::new("kvm-feat", mon_v1()).await;
        let supported = std::fs::read_to_string(format!("{SYS_RBD}/supported_features")).unwrap();
        eprintln!("6.1's krbd supported_features: {}", supported.trim());
        let mut params = w.ctl.params();
        params.insert(
            "imageFeatures".into(),
            "layering,exclusive-lock,journaling".into(),
        );
        let vol = w
            .ctl
            .controller()
            .await
            .create_volume(CreateVolumeRequest {
                name: "pvc-journal".into(),
                capacity_range: Some(CapacityRange {
                    required_bytes: 32 * MIB,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![block_cap()],
                parameters: params,
                secrets: w.ctl.secrets(),
                ..Default::default()
            })
            .await
            .expect("CreateVolume with journaling")
            .into_inner()
            .volume
            .unwrap();
        let (staging, _) = w.paths("j");
        let mut req = w.ctl.stage_request(&vol.volume_id, &staging, block_cap());
        req.volume_context = vol.volume_context.clone();
        let err = w
            .node()
            .await
            .node_stage_volume(req)
            .await
            .expect_err("a journaling image must not map on krbd");
        assert!(
            devices_in(&w.ns.name).is_empty(),
            "a refused stage left a mapping"
        );
        w.delete(&vol.volume_id).await;
        assert!(
            err.message().contains("journaling"),
            "the refusal does not name the feature: {:?}: {}",
            err.code(),
            err.message()
        );
    }

    /// The single-writer guard with krbd: a second node plugin (another
    /// node id, the same kernel) is refused a read-write stage of a volume
    /// the first has staged, naming the lock, and maps nothing.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_one_writer_across_two_node_plugins() {
        let w = World::new("kvm-rwo", mon_v1()).await;
        let (mut other, other_sock) =
            spawn_node(w.dir.path(), "other", &w.dir.path().join("config.json"));
        let id = w
            .ctl
            .create_volume("pvc-rwo", 32 * MIB, mount_cap("ext4"))
            .await;
        let (staging, _) = w.paths("a");
        let (staging_b, _) = w.paths("b");
        w.stage(&id, &staging, mount_cap("ext4"), &[]).await;
        let mut b = NodeClient::new(channel(&other_sock).await);
        let err = b
            .node_stage_volume(w.stage_req(&id, &staging_b, mount_cap("ext4"), &[]))
            .await
            .expect_err("a second writer must be refused");
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
        assert!(err.message().contains("locked for staging"), "{err}");
        assert_eq!(devices_in(&w.ns.name).len(), 1, "the refused stage mapped");
        assert!(mount_of(&staging_b.join(VOLUME)).is_none());
        w.unstage(&id, &staging).await;
        b.node_stage_volume(w.stage_req(&id, &staging_b, mount_cap("ext4"), &[]))
            .await
            .unwrap_or_else(|e| panic!("stage on the other node after the unstage: {e}"));
        b.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging_b.display().to_string(),
        })
        .await
        .unwrap();
        assert!(devices_in(&w.ns.name).is_empty());
        other.kill9();
        w.delete(&id).await;
    }

    async fn expand(w: &World, id: &str, staging: &Path, path: &Path, to: i64) -> i64 {
        let range = Some(CapacityRange {
            required_bytes: to,
            limit_bytes: 0,
        });
        w.ctl
            .controller()
            .await
            .controller_expand_volume(ControllerExpandVolumeRequest {
                volume_id: id.to_owned(),
                capacity_range: range,
                secrets: w.ctl.secrets(),
                volume_capability: Some(block_cap()),
            })
            .await
            .unwrap();
        w.node()
            .await
            .node_expand_volume(NodeExpandVolumeRequest {
                volume_id: id.to_owned(),
                volume_path: path.display().to_string(),
                capacity_range: range,
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(block_cap()),
                secrets: Default::default(),
            })
            .await
            .unwrap_or_else(|e| panic!("NodeExpandVolume: {e}\n{}", w.node.log_tail(30)))
            .into_inner()
            .capacity_bytes
    }

    /// A Block volume grows while published: ControllerExpandVolume, then
    /// NodeExpandVolume on the published device file; the pod's device has
    /// the new size and takes data at its new end, the old data kept.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_block_volume_grows_online() {
        let w = World::new("kvm-bgrow", mon_v1()).await;
        let (from, to) = (32 * MIB, 96 * MIB);
        let id = w.ctl.create_volume("pvc-bgrow", from, block_cap()).await;
        let (staging, target) = w.paths("bg");
        w.stage(&id, &staging, block_cap(), &[]).await;
        w.publish(&id, &staging, &target, block_cap()).await;
        let head = support::data::pattern(11, 1 << 20);
        support::data::direct_write(&target, 1 << 20, &head);
        assert_eq!(rbdkit::node::fs::device_size(&target).unwrap(), from as u64);
        assert_eq!(expand(&w, &id, &staging, &target, to).await, to);
        assert_eq!(sys_attr(&w.device(), "size"), to.to_string());
        assert_eq!(
            rbdkit::node::fs::device_size(&target).unwrap(),
            to as u64,
            "the published device did not grow"
        );
        let tail = support::data::pattern(12, 1 << 20);
        let at = (to - 2 * MIB) as u64;
        support::data::direct_write(&target, at, &tail);
        assert!(support::data::direct_read(&target, at, tail.len()) == tail);
        assert!(support::data::direct_read(&target, 1 << 20, head.len()) == head);
        // Repeated (kubelet retries): the same answer, nothing else done.
        assert_eq!(expand(&w, &id, &staging, &target, to).await, to);
        w.unpublish(&id, &target).await;
        w.unstage(&id, &staging).await;
        assert!(devices_in(&w.ns.name).is_empty());
        w.delete(&id).await;
    }

    /// A librbd client of the image (rbdkit-fuse, rbd-nbd and the rbd CLI
    /// are ones) writes a 4 KiB block at 0, bounded.
    async fn librbd_write(ns: &TestNs, image: &str) -> Result<(), rbdkit::Error> {
        let io = ns.ioctx.clone();
        let image = image.to_owned();
        tokio::time::timeout(
            Duration::from_secs(120),
            tokio::task::spawn_blocking(move || {
                let img = rbdkit::rbd::Image::open(&io, &image)?;
                img.write(0, &[7u8; 4096])?;
                img.flush()
            }),
        )
        .await
        .expect("a librbd write still waiting after 120 s")
        .unwrap()
    }

    /// `mapOptions: krbd:exclusive`: the kernel takes the image's
    /// exclusive lock at map time and does not hand it over, so a second
    /// writer is refused while the volume is staged: librbd (as rbdkit-fuse,
    /// rbd-nbd and the rbd CLI are) with EROFS, and so is a second krbd
    /// mapping ("peer will not release lock"); without the option the kernel
    /// hands the lock over on request. On an image without the
    /// exclusive-lock feature the option is refused by name before the map.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_exclusive_map_option_keeps_a_second_writer_out() {
        let w = World::new("kvm-excl", mon_v1()).await;
        let ctx = [("mapOptions", "krbd:exclusive")];
        // No exclusive-lock (the default features): refused, nothing mapped.
        let plain = w
            .ctl
            .create_volume("pvc-nolock", 32 * MIB, block_cap())
            .await;
        let (staging, target) = w.paths("n");
        let err = w.stage_err(&plain, &staging, block_cap(), &ctx).await;
        eprintln!(
            "exclusive without exclusive-lock: {:?}: {}",
            err.code(),
            err.message()
        );
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
        assert!(
            err.message().contains("exclusive-lock") && err.message().contains("exclusive"),
            "{err}"
        );
        assert!(devices_in(&w.ns.name).is_empty(), "a refused stage mapped");
        w.delete(&plain).await;

        let id = w
            .create_with(
                "pvc-excl",
                32 * MIB,
                block_cap(),
                &[("imageFeatures", "layering,exclusive-lock")],
            )
            .await;
        let image = rbdkit::volume::VolumeId::parse(&id).unwrap().image;
        w.stage(&id, &staging, block_cap(), &ctx).await;
        let dev = w.device();
        assert!(
            sys_attr(&dev, "config_info")
                .split_whitespace()
                .nth(1)
                .is_some_and(|opts| opts.split(',').any(|o| o == "exclusive")),
            "exclusive not among rbd{}'s options",
            dev.id
        );
        w.publish(&id, &staging, &target, block_cap()).await;
        let data = support::data::pattern(21, 64 << 10);
        support::data::direct_write(&target, 0, &data);
        let t0 = Instant::now();
        let err = librbd_write(&w.ns, &image)
            .await
            .expect_err("a librbd write while krbd holds the lock with exclusive");
        eprintln!(
            "librbd write under krbd:exclusive: {err} after {:?}",
            t0.elapsed()
        );
        assert_eq!(err.errno(), libc::EROFS, "{err}");
        // A second krbd mapping (another node's, had it no stage lock):
        // the kernel takes the lock at map time, is refused, and the map
        // fails.
        let add = format!(
            "{} name={user},secret={key},_pool_ns={ns} rbd {image} -",
            mon_v1(),
            user = support::ceph::NODE_USER,
            key = support::ceph::node_key(),
            ns = w.ns.name,
        );
        let second = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("{SYS_RBD}/add_single_major"))
            .and_then(|mut f| f.write_all(add.as_bytes()));
        drop(add);
        let n = devices_in(&w.ns.name).len();
        let second = second.expect_err("a second krbd mapping under krbd:exclusive");
        eprintln!("second krbd map under krbd:exclusive: {second}");
        assert_eq!(second.raw_os_error(), Some(libc::EROFS), "{second}");
        assert_eq!(n, 1, "the refused map left a device");
        // The kernel's device still writes: the lock stayed.
        support::data::direct_write(&target, 0, &data);
        assert!(support::data::direct_read(&target, 0, data.len()) == data);
        w.unpublish(&id, &target).await;
        w.unstage(&id, &staging).await;
        // Unstaged, the lock is free: librbd writes.
        librbd_write(&w.ns, &image)
            .await
            .expect("librbd write after the unstage");

        // Without the option the kernel hands the lock over on request.
        w.stage(&id, &staging, block_cap(), &[]).await;
        librbd_write(&w.ns, &image)
            .await
            .expect("librbd write while krbd maps without exclusive");
        w.unstage(&id, &staging).await;
        assert!(devices_in(&w.ns.name).is_empty());
        w.delete(&id).await;
    }

    /// What `csi_krbd.rs` runs against a fake sysfs, on the real kernel:
    /// `mounter: rbd`; `mapOptions` in ceph-csi's form (the krbd part
    /// reaches the kernel, the nbd part does not; `lock_on_read` needs an
    /// image with exclusive-lock, which the fake does not check); the key through the
    /// kernel keyring (`key=client.<user>`, which the fake cannot take); a
    /// repeated stage maps nothing more; bytes through the published path
    /// land on the kernel's device; `unmapOptions: krbd:force` removes a
    /// device something still holds open, and without it the unstage fails
    /// naming that option (and a retry succeeds once the holder is gone); a
    /// repeated unstage succeeds; no userspace mapper runs meanwhile (the
    /// plugin's mapper socket names nothing); no key in the plugin's log.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_what_the_fake_sysfs_test_covers_on_the_real_kernel() {
        let w = World::new("kvm-paths", mon_v1()).await;
        // lock_on_read needs exclusive-lock (the kernel refuses it without).
        let id = w
            .create_with(
                "pvc-paths",
                32 * MIB,
                block_cap(),
                &[("imageFeatures", "layering,exclusive-lock")],
            )
            .await;
        let vol = rbdkit::volume::VolumeId::parse(&id).unwrap();
        let (staging, target) = w.paths("p");
        let ctx = [
            ("mounter", "rbd"),
            (
                "mapOptions",
                "krbd:lock_on_read,queue_depth=128;nbd:try-netlink",
            ),
            ("unmapOptions", "krbd:force"),
        ];
        w.stage(&id, &staging, block_cap(), &ctx).await;
        let dev = w.device();
        w.stage(&id, &staging, block_cap(), &ctx).await;
        assert_eq!(w.device().id, dev.id, "a repeated stage mapped again");
        assert_eq!(sys_attr(&dev, "pool"), "rbd");
        assert_eq!(sys_attr(&dev, "pool_ns"), vol.rados_namespace);
        assert_eq!(sys_attr(&dev, "name"), vol.image);
        assert_eq!(sys_attr(&dev, "current_snap"), "-");
        // Read, never printed: it would name the key if it were inline.
        let info = sys_attr(&dev, "config_info");
        let opts: Vec<&str> = info
            .split_whitespace()
            .nth(1)
            .unwrap_or("")
            .split(',')
            .collect();
        let user = support::ceph::NODE_USER;
        for want in [
            format!("name={user}"),
            format!("key=client.{user}"),
            "lock_on_read".to_owned(),
            "queue_depth=128".to_owned(),
            format!("_pool_ns={}", vol.rados_namespace),
        ] {
            assert!(
                opts.contains(&want.as_str()),
                "{want} not among rbd{}'s options",
                dev.id
            );
        }
        assert!(
            !opts.iter().any(|o| o.starts_with("secret=")),
            "the key went inline although the kernel has the ceph key type"
        );
        assert!(
            !opts.iter().any(|o| o.contains("try-netlink")),
            "nbd options reached krbd"
        );
        let tags =
            std::fs::read_to_string(format!("/sys/block/rbd{}/mq/0/nr_tags", dev.id)).unwrap();
        assert_eq!(tags.trim(), "128", "queue_depth");
        w.publish(&id, &staging, &target, block_cap()).await;
        let data = support::data::pattern(31, 64 << 10);
        support::data::direct_write(&target, 1 << 20, &data);
        let rbd_dev = PathBuf::from(format!("/dev/rbd{}", dev.id));
        assert!(support::data::direct_read(&rbd_dev, 1 << 20, data.len()) == data);
        // Held open, and removed all the same: krbd:force.
        let holder = std::fs::File::open(&rbd_dev).unwrap();
        w.unpublish(&id, &target).await;
        w.unstage(&id, &staging).await;
        assert!(
            devices_in(&w.ns.name).is_empty(),
            "krbd:force left the device"
        );
        drop(holder);
        w.unstage(&id, &staging).await;
        w.delete(&id).await;

        // Held open without krbd:force: the unstage fails naming it and
        // leaves the mapping; kubelet's retry succeeds once it is let go.
        let id = w.ctl.create_volume("pvc-busy", 32 * MIB, block_cap()).await;
        w.stage(&id, &staging, block_cap(), &[]).await;
        let dev = w.device();
        let holder = std::fs::File::open(format!("/dev/rbd{}", dev.id)).unwrap();
        let err = w
            .node()
            .await
            .node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .expect_err("an unstage of a device held open");
        assert!(err.message().contains("krbd:force"), "{err}");
        assert_eq!(w.device().id, dev.id);
        drop(holder);
        w.unstage(&id, &staging).await;
        assert!(devices_in(&w.ns.name).is_empty());
        w.delete(&id).await;
        w.assert_no_key_in_log();
    }

    /// Makes `add_key(2)` fail with ENOSYS on this thread and whatever it
    /// starts from now on (seccomp), as on a kernel built without keys.
    fn deny_add_key() {
        const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
        let ins = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter {
            code: code as u16,
            jt,
            jf,
            k,
        };
        let prog = [
            // seccomp_data.arch
            ins(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0, 0, 4),
            ins(
                libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K,
                0,
                3,
                AUDIT_ARCH_X86_64,
            ),
            // seccomp_data.nr
            ins(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0, 0, 0),
            ins(
                libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K,
                0,
                1,
                libc::SYS_add_key as u32,
            ),
            ins(
                libc::BPF_RET | libc::BPF_K,
                0,
                0,
                libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
            ),
            ins(libc::BPF_RET | libc::BPF_K, 0, 0, libc::SECCOMP_RET_ALLOW),
        ];
        let fprog = libc::sock_fprog {
            len: prog.len() as u16,
            filter: prog.as_ptr().cast_mut(),
        };
        // SAFETY: prctl(2)'s PR_SET_NO_NEW_PRIVS takes integers; its
        // PR_SET_SECCOMP with SECCOMP_MODE_FILTER takes a pointer to a
        // sock_fprog whose program lives for the call (the kernel copies it).
        unsafe {
            let (one, zero): (libc::c_ulong, libc::c_ulong) = (1, 0);
            assert_eq!(
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, one, zero, zero, zero),
                0
            );
            assert_eq!(
                libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER as libc::c_ulong,
                    std::ptr::addr_of!(fprog) as libc::c_ulong,
                ),
                0,
                "seccomp: {}",
                std::io::Error::last_os_error()
            );
        }
    }

    /// Where the kernel keyring cannot take the key (`add_key` ENOSYS: a
    /// kernel without keys), the key goes inline as `secret=` in the sysfs
    /// write, and the real kernel maps with it; still in no log.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_inline_secret_where_the_kernel_keyring_is_unavailable() {
        let mut w = World::new("kvm-secret", mon_v1()).await;
        // The plugin again, started from a thread with the filter (a child
        // inherits its parent thread's seccomp filters).
        w.node.kill9();
        let (dir, config) = (w.dir.path().to_owned(), w.dir.path().join("config.json"));
        w.node = std::thread::spawn(move || {
            deny_add_key();
            spawn_node(&dir, "guest", &config).0
        })
        .join()
        .unwrap();
        let id = w
            .ctl
            .create_volume("pvc-secret", 32 * MIB, block_cap())
            .await;
        let (staging, target) = w.paths("s");
        w.stage(&id, &staging, block_cap(), &[]).await;
        let dev = w.device();
        let info = sys_attr(&dev, "config_info");
        let opts: Vec<&str> = info
            .split_whitespace()
            .nth(1)
            .unwrap_or("")
            .split(',')
            .collect();
        assert!(
            opts.iter().any(|o| o.starts_with("secret="))
                && !opts.iter().any(|o| o.starts_with("key=")),
            "rbd{} was not mapped with the key inline",
            dev.id
        );
        w.publish(&id, &staging, &target, block_cap()).await;
        let data = support::data::pattern(41, 64 << 10);
        support::data::direct_write(&target, 0, &data);
        assert!(support::data::direct_read(&target, 0, data.len()) == data);
        w.unpublish(&id, &target).await;
        w.unstage(&id, &staging).await;
        assert!(devices_in(&w.ns.name).is_empty());
        w.delete(&id).await;
        w.assert_no_key_in_log();
    }

    /// `read_from_replica` with `crush_location`, given as krbd map options
    /// (`mapOptions`, as the node service passes them today): the kernel
    /// takes them (its client options show them), reads and writes work
    /// (one OSD: the replica is the primary); a value the kernel refuses
    /// fails the stage and maps nothing.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_read_from_replica_with_crush_location() {
        let w = World::new("kvm-rfr", mon_v1()).await;
        let id = w.ctl.create_volume("pvc-rfr", 32 * MIB, block_cap()).await;
        let (staging, target) = w.paths("r");
        let ctx = [(
            "mapOptions",
            "krbd:read_from_replica=localize,crush_location=host:kernel-vm",
        )];
        w.stage(&id, &staging, block_cap(), &ctx).await;
        let dev = w.device();
        let info = sys_attr(&dev, "config_info");
        let opts: Vec<&str> = info
            .split_whitespace()
            .nth(1)
            .unwrap_or("")
            .split(',')
            .collect();
        assert!(
            opts.contains(&"read_from_replica=localize")
                && opts.contains(&"crush_location=host:kernel-vm"),
            "rbd{}'s options lack them",
            dev.id
        );
        // libceph's view of its client (debugfs).
        if !Path::new("/sys/kernel/debug/ceph").exists() {
            let _ = std::process::Command::new("mount")
                .args(["-t", "debugfs", "debugfs", "/sys/kernel/debug"])
                .status();
        }
        let mut client_opts = String::new();
        for e in std::fs::read_dir("/sys/kernel/debug/ceph")
            .unwrap()
            .flatten()
        {
            client_opts +=
                &std::fs::read_to_string(e.path().join("client_options")).unwrap_or_default();
        }
        eprintln!("libceph client options: {}", client_opts.trim());
        assert!(
            client_opts.contains("read_from_replica=localize"),
            "libceph does not show read_from_replica=localize: {client_opts}"
        );
        w.publish(&id, &staging, &target, block_cap()).await;
        let data = support::data::pattern(51, 64 << 10);
        support::data::direct_write(&target, 0, &data);
        assert!(support::data::direct_read(&target, 0, data.len()) == data);
        w.unpublish(&id, &target).await;
        w.unstage(&id, &staging).await;
        let err = w
            .stage_err(
                &id,
                &staging,
                block_cap(),
                &[("mapOptions", "krbd:read_from_replica=bogus")],
            )
            .await;
        eprintln!(
            "read_from_replica=bogus: {:?}: {}",
            err.code(),
            err.message()
        );
        assert!(
            err.message().contains("the kernel refused an option"),
            "{err}"
        );
        assert!(devices_in(&w.ns.name).is_empty(), "a refused stage mapped");
        w.delete(&id).await;
    }

    /// Read affinity: the map options the node plugin forms from node
    /// labels (`rbdkit::node::read_affinity`) are taken by the kernel
    /// (Linux 5.8+) as they are, and the device reads and writes.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "needs the kernel guest: kernel_vm::debian_6_1_guest runs it there"]
    async fn krbd_takes_the_read_affinity_options() {
        use rbdkit::node::read_affinity::{crush_location, map_options};
        let labels: std::collections::BTreeMap<String, String> = [
            ("topology.kubernetes.io/zone", "z.1"),
            ("kubernetes.io/hostname", "guest"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let opts = map_options(&crush_location(
            &[
                "topology.kubernetes.io/zone".into(),
                "kubernetes.io/hostname".into(),
            ],
            &labels,
        ));
        assert_eq!(opts.len(), 2);
        let w = World::new("kvm-ra", mon_v1()).await;
        let id = w.ctl.create_volume("pvc-ra", 32 * MIB, block_cap()).await;
        let (staging, target) = w.paths("ra");
        let map = format!("krbd:{}", opts.join(","));
        w.stage(&id, &staging, block_cap(), &[("mapOptions", &map)])
            .await;
        let dev = w.device();
        let info = sys_attr(&dev, "config_info");
        for o in &opts {
            assert!(
                info.contains(o.as_str()),
                "{o} not in rbd{}'s options",
                dev.id
            );
        }
        w.publish(&id, &staging, &target, block_cap()).await;
        let data = support::data::pattern(5, 1 << 20);
        {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(&target)
                .unwrap();
            f.write_all(&data).unwrap();
            f.sync_all().unwrap();
        }
        let mut back = vec![0u8; data.len()];
        std::fs::File::open(&target)
            .unwrap()
            .read_exact(&mut back)
            .unwrap();
        assert!(back == data);
        w.unpublish(&id, &target).await;
        w.unstage(&id, &staging).await;
        assert!(devices_in(&w.ns.name).is_empty());
        w.delete(&id).await;
        w.assert_no_key_in_log();
    }
}
