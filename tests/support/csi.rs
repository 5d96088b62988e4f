//! The CSI driver as kubelet and external-provisioner see it: `rbdkit csi`
//! (and the userspace mapper it needs) as child processes on a unix socket,
//! and gRPC clients to drive them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rbdkit::csi::proto::{
    controller_client::ControllerClient, identity_client::IdentityClient, node_client::NodeClient,
    volume_capability, CapacityRange, CreateVolumeRequest, DeleteVolumeRequest,
    NodeGetStorageHealthRequest, NodeGetStorageHealthResponse, NodeStageVolumeRequest,
    VolumeCapability,
};
use serde_json::json;
use tonic::transport::Channel;

use super::ceph::{
    node_key, provisioner_key, unique, TestCluster, TestNs, NODE_USER, PROVISIONER_USER,
};

/// The rbdkit daemons a [`CsiEnv`] runs.
pub type Daemon = super::process::Proc;

/// A channel over a unix socket, retried until the server listens.
pub async fn channel(socket: &Path) -> Channel {
    // A server starting under an emulated CPU (the kernel guest, TCG) on a
    // busy host can take longer than 30 s to listen.
    let bound = if std::env::var_os("RBDKIT_IN_GUEST").is_some() {
        120
    } else {
        30
    };
    rbdkit::csi::client::unix_channel(socket, Duration::from_secs(bound), None)
        .await
        .unwrap_or_else(|e| panic!("cannot reach {}: {e}", socket.display()))
}

/// One CSI world: a clusters config pointing at the test cluster (in a
/// RADOS namespace of its own), a mapper daemon, and a CSI server.
pub struct CsiEnv {
    /// The RBD namespace the clusterID maps to (shared by the nodes of one
    /// test).
    pub rbd: Arc<TestNs>,
    /// The clusterID.
    pub cluster_id: String,
    /// The working folder (sockets, state, staging and target paths).
    pub dir: tempfile::TempDir,
    /// The userspace mapper, if started.
    pub mapper: Option<Daemon>,
    /// The CSI server.
    pub csi: Daemon,
    /// The CSI socket.
    pub socket: PathBuf,
    /// The node id.
    pub node_id: String,
}

/// Which services the server runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Identity + Controller.
    Controller,
    /// Everything, with a userspace mapper.
    All,
}

impl CsiEnv {
    /// Starts a world named after `test`.
    pub async fn new(test: &str, mode: Mode) -> CsiEnv {
        let rbd = Arc::new(TestNs::new(test));
        let cluster_id = unique(test);
        CsiEnv::with_ns(rbd, cluster_id, mode, "node-a", &[]).await
    }

    /// Starts a world on an existing namespace and clusterID (a second node
    /// of the same cluster, say).
    pub async fn with_ns(
        rbd: Arc<TestNs>,
        cluster_id: String,
        mode: Mode,
        node_id: &str,
        extra_args: &[&str],
    ) -> CsiEnv {
        CsiEnv::with_ns_env(rbd, cluster_id, mode, node_id, extra_args, Vec::new()).await
    }

    /// [`CsiEnv::with_ns`] with `env` added to the environment of the CSI
    /// server and the mapper (such as [`super::ceph::from_address`]).
    pub async fn with_ns_env(
        rbd: Arc<TestNs>,
        cluster_id: String,
        mode: Mode,
        node_id: &str,
        extra_args: &[&str],
        env: Vec<(String, String)>,
    ) -> CsiEnv {
        let ceph = TestCluster::get();
        // Under /tmp, not the target dir: unix socket paths are short.
        let dir = tempfile::Builder::new()
            .prefix("rbdkit-csi-")
            .tempdir_in("/tmp")
            .expect("tempdir");
        super::process::register_dir(dir.path());
        let mons = ceph.conf_value("mon host").expect("mon host in ceph.conf");
        let config = json!([{
            "clusterID": cluster_id,
            "monitors": [mons],
            "rbd": {"radosNamespace": rbd.name},
        }]);
        let config_path = dir.path().join("config.json");
        std::fs::write(&config_path, config.to_string()).expect("write config");
        let mapper_sock = dir.path().join("mapper.sock");
        let mapper = (mode == Mode::All).then(|| {
            Daemon::rbdkit_with_env(
                &format!("fuse-mapper {node_id}"),
                vec![
                    "fuse-mapper".into(),
                    "--socket".into(),
                    mapper_sock.display().to_string(),
                    "--state-dir".into(),
                    dir.path().join("mapper").display().to_string(),
                ],
                dir.path().join("mapper.log"),
                env.clone(),
            )
        });
        let socket = dir.path().join("csi.sock");
        let mut args: Vec<String> = vec![
            "csi".into(),
            "--endpoint".into(),
            format!("unix://{}", socket.display()),
            "--node-id".into(),
            node_id.into(),
            "--mode".into(),
            if mode == Mode::All {
                "all"
            } else {
                "controller"
            }
            .into(),
            "--clusters-config".into(),
            config_path.display().to_string(),
            "--mapper-socket".into(),
            mapper_sock.display().to_string(),
            "--state-dir".into(),
            dir.path().join("csi-state").display().to_string(),
            "--topology".into(),
            format!("topology.rbd.rbdkit.io/node={node_id}"),
        ];
        // rbdkit-fuse unless the test picks another.
        if !extra_args.contains(&"--default-mapper") {
            args.extend(["--default-mapper".into(), "rbdkit-fuse".into()]);
        }
        args.extend(extra_args.iter().map(|a| a.to_string()));
        let csi = Daemon::rbdkit_with_env(
            &format!("rbdkit csi {node_id}"),
            args,
            dir.path().join("csi.log"),
            env,
        );
        let env = CsiEnv {
            rbd,
            cluster_id,
            dir,
            mapper,
            csi,
            socket,
            node_id: node_id.to_owned(),
        };
        if mode == Mode::All {
            env.wait_mapper();
        }
        env
    }

    /// Waits (at most 30 s) until the mapper daemon answers on its socket.
    pub fn wait_mapper(&self) {
        let m = rbdkit::node::fuse::FuseMapper::new(self.dir.path().join("mapper.sock"));
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(e) = m.ping() {
            assert!(Instant::now() < deadline, "the mapper never answered: {e}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The secrets of controller-side calls: the least-privilege
    /// provisioner user, as deploy/README.md gives it.
    pub fn secrets(&self) -> HashMap<String, String> {
        HashMap::from([
            ("userID".to_owned(), PROVISIONER_USER.to_owned()),
            ("userKey".to_owned(), provisioner_key()),
        ])
    }

    /// The secrets of node-side calls (stage, publish, expand): the
    /// least-privilege node user.
    pub fn node_secrets(&self) -> HashMap<String, String> {
        HashMap::from([
            ("userID".to_owned(), NODE_USER.to_owned()),
            ("userKey".to_owned(), node_key()),
        ])
    }

    /// The parameters of a test StorageClass.
    pub fn params(&self) -> HashMap<String, String> {
        HashMap::from([
            ("clusterID".to_owned(), self.cluster_id.clone()),
            ("pool".to_owned(), super::ceph::POOL.to_owned()),
        ])
    }

    /// An Identity client.
    pub async fn identity(&self) -> IdentityClient<Channel> {
        IdentityClient::new(channel(&self.socket).await)
    }

    /// A Controller client.
    pub async fn controller(&self) -> ControllerClient<Channel> {
        ControllerClient::new(channel(&self.socket).await)
    }

    /// A Node client.
    pub async fn node(&self) -> NodeClient<Channel> {
        NodeClient::new(channel(&self.socket).await)
    }

    /// NodeGetStorageHealth of this node.
    pub async fn storage_health(&self) -> NodeGetStorageHealthResponse {
        self.node()
            .await
            .node_get_storage_health(NodeGetStorageHealthRequest::default())
            .await
            .unwrap_or_else(|e| panic!("NodeGetStorageHealth: {e}"))
            .into_inner()
    }

    /// NodeUnstageVolume of `id` at `staging`, as kubelet sends it (no
    /// secrets); panics naming the node on failure.
    pub async fn unstage(&self, id: &str, staging: &Path) {
        self.node()
            .await
            .node_unstage_volume(rbdkit::csi::proto::NodeUnstageVolumeRequest {
                volume_id: id.to_owned(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .unwrap_or_else(|e| panic!("NodeUnstageVolume on {}: {e}", self.node_id));
    }

    /// DeleteVolume of `id` with the controller's secrets.
    pub async fn delete_volume(&self, id: &str) -> Result<(), tonic::Status> {
        self.controller()
            .await
            .delete_volume(DeleteVolumeRequest {
                volume_id: id.to_owned(),
                secrets: self.secrets(),
            })
            .await
            .map(|_| ())
    }

    /// A path in the working folder.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Creates a volume and returns its id.
    pub async fn create_volume(&self, name: &str, bytes: i64, cap: VolumeCapability) -> String {
        let resp = self
            .controller()
            .await
            .create_volume(CreateVolumeRequest {
                name: name.to_owned(),
                capacity_range: Some(CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![cap],
                parameters: self.params(),
                secrets: self.secrets(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("CreateVolume {name}: {e}"))
            .into_inner();
        resp.volume.expect("volume").volume_id
    }

    /// A NodeStageVolume request as kubelet sends it.
    pub fn stage_request(
        &self,
        volume_id: &str,
        staging: &Path,
        cap: VolumeCapability,
    ) -> NodeStageVolumeRequest {
        NodeStageVolumeRequest {
            volume_id: volume_id.to_owned(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap),
            secrets: self.node_secrets(),
            ..Default::default()
        }
    }
}

/// A single-node-writer Filesystem capability.
pub fn mount_cap(fs_type: &str) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(volume_capability::AccessType::Mount(
            volume_capability::MountVolume {
                fs_type: fs_type.to_owned(),
                ..Default::default()
            },
        )),
    }
}

/// A single-node-writer Block capability.
pub fn block_cap() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(volume_capability::AccessType::Block(
            volume_capability::BlockVolume {},
        )),
    }
}

impl Drop for CsiEnv {
    fn drop(&mut self) {
        // Leave no mount behind, even after a failed test: first what the
        // node service mounted (deepest first), then the mapper stops
        // cleanly, then whatever a killed mapper left.
        self.csi.kill9();
        // Nor the credentials the node service kept in this uid's kernel
        // keyring (they would outlive the run), for every cluster of its
        // config (a test may have added one).
        let config = std::fs::read(self.dir.path().join("config.json")).unwrap_or_default();
        let ids: Vec<String> = serde_json::from_slice::<serde_json::Value>(&config)
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|c| c["clusterID"].as_str().map(str::to_owned))
            .collect();
        for id in ids.iter().chain(std::iter::once(&self.cluster_id)) {
            forget_kept_keys(&format!("rbd.rbdkit.io/{id}"));
        }
        let root = self.dir.path().to_owned();
        let under = || -> Vec<PathBuf> {
            let mut v: Vec<PathBuf> = rbdkit::node::mount::mountinfo()
                .unwrap_or_default()
                .into_iter()
                .map(|m| m.mount_point)
                .filter(|p| p.starts_with(&root))
                .collect();
            v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
            v.dedup();
            v
        };
        let mapper_mnt = root.join("mapper");
        for p in under().into_iter().filter(|p| !p.starts_with(&mapper_mnt)) {
            let _ = rbdkit::node::mount::ensure_unmounted(&p);
        }
        // A mapper killed with -9 leaves its loop devices bound; clear them
        // while their files still show under this folder.
        let clear_loops = || {
            for (dev, file) in rbdkit::node::loopdev::list() {
                if file.starts_with(&root) {
                    let _ = rbdkit::node::loopdev::detach(&dev);
                }
            }
        };
        clear_loops();
        if let Some(m) = self.mapper.as_mut() {
            m.terminate();
        }
        for p in under() {
            let _ = rbdkit::node::mount::ensure_unmounted(&p);
        }
        clear_loops();
    }
}

/// Drops the credentials node services kept in this uid's kernel keyring
/// under `scope` (`<driver>/<clusterID>`, or a prefix of it), as listed in
/// `/proc/keys`. Best effort: for fixtures' clean-up.
pub fn forget_kept_keys(scope: &str) {
    let Ok(keys) = std::fs::read_to_string("/proc/keys") else {
        return;
    };
    let prefix = format!("rbdkit:{scope}");
    for line in keys.lines() {
        // serial flags usage timeout perm uid gid type description: ...
        let Some(desc) = line.split_whitespace().nth(8) else {
            continue;
        };
        let desc = desc.trim_end_matches(':');
        if !desc.starts_with(&prefix) {
            continue;
        }
        if let Some((kept_scope, user)) = desc["rbdkit:".len()..].rsplit_once(':') {
            let _ = rbdkit::node::keyring::forget_key(kept_scope, user);
        }
    }
}
