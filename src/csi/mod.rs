//! The CSI driver: `rbdkit csi`, a CSI v1 gRPC server with the Identity,
//! Controller and Node services.
//!
//! - [`proto`]: code generated from the CSI spec's `csi.proto`;
//! - [`driver`]: the state the services share, and error mapping;
//! - [`identity`], [`controller`], [`group_controller`], [`node`]: the
//!   services (the group controller, volume group snapshots, with the
//!   controller);
//! - [`metrics`]: `--http-addr`'s probes and Prometheus metrics;
//! - [`client`]: a channel to the server's socket, for those who play kubelet.
//!
//! The controller calls the same volume operations as the provisioner
//! ([`crate::volume`]); the node service maps images through a
//! [`crate::node::Mapper`] and mounts them with [`crate::node`]. With
//! `--mode node` the server holds no volume state of its own beyond the
//! stash files under the staging paths: the userspace mapper runs in its own
//! process (`rbdkit fuse-mapper`), so restarting this server does not touch
//! a mounted volume.

pub mod client;
pub mod controller;
pub mod driver;
pub mod group_controller;
pub mod identity;
pub mod jobs;
pub mod metrics;
pub mod node;
pub mod proto;
pub mod topology;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio_stream::wrappers::UnixListenerStream;

use crate::blocking::BlockingPool;
use crate::node::Mapper;
use crate::telemetry::{self, LogFormat};
use crate::volume::clusters::{ClustersFile, Connections};

/// Which services the server offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Identity + Node (the DaemonSet on every node).
    Node,
    /// Identity + Controller (behind external-provisioner, or for tests).
    Controller,
    /// All three (csi-sanity, single-node clusters).
    All,
}

/// Command-line arguments of `rbdkit csi`.
#[derive(Debug, Clone, clap::Args)]
pub struct CsiArgs {
    /// Where to listen: `unix:///path/to/csi.sock` (or a plain path).
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,

    /// This node's id, as NodeGetInfo reports it (usually the node name).
    #[arg(long, env = "NODE_ID", default_value = "")]
    pub node_id: String,

    /// Which services to offer.
    #[arg(long, value_enum, default_value = "all")]
    pub mode: Mode,

    /// ceph-csi's config.json: the clusters and their monitors.
    #[arg(long, value_name = "FILE")]
    pub clusters_config: PathBuf,

    /// ceph-csi's KMS config (the `ceph-csi-encryption-kms-config`
    /// ConfigMap's config.json), read at each use by encrypted volumes; a
    /// missing file leaves only the `default` KMS.
    #[arg(long, value_name = "FILE", default_value = crate::volume::kms::DEFAULT_CONFIG_PATH)]
    pub kms_config: PathBuf,

    /// The driver name.
    #[arg(long, default_value = "rbd.rbdkit.io")]
    pub driver_name: String,

    /// The socket of the userspace mapper (`rbdkit fuse-mapper`).
    #[arg(long, default_value = "/run/rbdkit/mapper.sock")]
    pub mapper_socket: PathBuf,

    /// How long a NodeStage waits for the userspace mapper's attach; one
    /// given up on is unmapped before the stage fails (the mapper may
    /// still complete it).
    #[arg(long, default_value = "120s")]
    pub mapper_attach_timeout: humantime::Duration,

    /// Where the node service keeps its index of staged volumes, and the
    /// controller the pools it has seen volumes in.
    #[arg(long, default_value = "/var/lib/rbdkit/csi")]
    pub state_dir: PathBuf,

    /// Credentials of the controller's own, for the calls that carry no
    /// secrets (ListVolumes, ControllerListVolumeHealth, GetCapacity): a
    /// directory, usually a mounted Secret, holding `userID` and `userKey`
    /// (every cluster), or `<clusterID>.userID` and `<clusterID>.userKey`
    /// (one). Without it those calls use the credentials an earlier call
    /// brought, so right after a restart they know no cluster.
    #[arg(long, value_name = "DIR")]
    pub credentials_dir: Option<PathBuf>,

    /// The mapper for volumes whose class names none: `krbd` or
    /// `rbdkit-fuse` (default: krbd where /sys/bus/rbd exists).
    #[arg(long)]
    pub default_mapper: Option<String>,

    /// The filesystem of mount volumes whose capability names none.
    #[arg(long, default_value = "ext4", value_parser = ["ext4", "xfs"])]
    pub default_fstype: String,

    /// The sysfs root krbd works under (a fake tree in tests).
    #[arg(long, default_value = "/sys", hide = true)]
    pub sysfs_root: PathBuf,

    /// The /dev root krbd devices appear under (a fake tree in tests).
    #[arg(long, default_value = "/dev", hide = true)]
    pub dev_root: PathBuf,

    /// A topology segment this node reports, `KEY=VALUE` (repeatable).
    #[arg(long = "topology", value_name = "KEY=VALUE")]
    pub topology: Vec<String>,

    /// Node labels (comma-separated, such as `topology.kubernetes.io/zone`)
    /// whose values this node reports as topology segments
    /// `topology.<driver>/<name>` (ceph-csi's flag). Reads the Node from the
    /// API server at start (RBAC: `get` on `nodes`).
    #[arg(long = "domainlabels", value_name = "LABELS", value_delimiter = ',')]
    pub domain_labels: Vec<String>,

    /// Read from the nearest replica (krbd and rbdkit-fuse), placed in the
    /// CRUSH map by the node labels of --crush-location-labels; the
    /// clusters config's `readAffinity` overrides it per cluster.
    #[arg(long)]
    pub enable_read_affinity: bool,

    /// Node labels (comma-separated) giving this node's CRUSH location for
    /// read affinity, such as `topology.kubernetes.io/zone`.
    #[arg(long, value_name = "LABELS", value_delimiter = ',')]
    pub crush_location_labels: Vec<String>,

    /// The kubeconfig to read this node's labels with (--domainlabels, read
    /// affinity); default: the pod's service account.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    pub log_format: LogFormat,

    /// Threads for blocking Ceph calls.
    #[arg(long, default_value_t = 8)]
    pub ceph_threads: usize,

    /// Bound on connecting to a Ceph cluster.
    #[arg(long, default_value = "10s")]
    pub ceph_connect_timeout: humantime::Duration,

    /// Bound on every Ceph operation.
    #[arg(long, default_value = "30s")]
    pub ceph_op_timeout: humantime::Duration,

    /// Removed: a lock is no longer broken because an image lost its
    /// watcher (live nodes lose watches too). A dead node is fenced and its
    /// locks broken when its Node gets the `node.kubernetes.io/out-of-service`
    /// taint (the provisioner does it). Accepted so that old manifests
    /// start, and ignored with a warning.
    #[arg(long, hide = true)]
    pub break_dead_locks: bool,

    /// Removed with --break-dead-locks; ignored.
    #[arg(long, hide = true)]
    pub dead_lock_grace: Option<humantime::Duration>,

    /// Bound on each readiness check of Probe.
    #[arg(long, default_value = "2s")]
    pub probe_timeout: humantime::Duration,

    /// How often the node looks for space reclaim requests of the volumes it
    /// has staged (csi-addons ReclaimSpaceJobs, relayed by the provisioner
    /// through the image header): one header read per staged volume each
    /// time. 0 turns it off.
    #[arg(long, default_value = "30s")]
    pub reclaim_poll: humantime::Duration,

    /// Address of the /healthz (the gRPC socket answers), /readyz (Probe
    /// is ready) and /metrics server; none without it.
    #[arg(long)]
    pub http_addr: Option<std::net::SocketAddr>,
}

/// The socket path of an endpoint (`unix:///p`, `unix:/p` or `/p`).
pub fn socket_path(endpoint: &str) -> anyhow::Result<PathBuf> {
    let p = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    anyhow::ensure!(
        p.starts_with('/'),
        "--endpoint {endpoint:?} is not unix:///absolute/path"
    );
    Ok(PathBuf::from(p))
}

fn parse_topology(items: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    items
        .iter()
        .map(|kv| {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("--topology {kv:?} is not KEY=VALUE"))?;
            anyhow::ensure!(!k.is_empty(), "--topology {kv:?} has an empty key");
            Ok((k.to_owned(), v.to_owned()))
        })
        .collect()
}

/// Binds the socket, replacing a stale one left by a killed server.
fn bind(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if let Ok(m) = std::fs::symlink_metadata(path) {
        anyhow::ensure!(
            m.file_type().is_socket(),
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        );
        std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
    }
    tokio::net::UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))
}

/// The mappers this node can use, and the default.
fn mappers(args: &CsiArgs) -> anyhow::Result<(Vec<Arc<dyn Mapper>>, String)> {
    let krbd_ok = args.sysfs_root.join("bus/rbd").exists();
    let mut list: Vec<Arc<dyn Mapper>> = vec![Arc::new(
        crate::node::fuse::FuseMapper::new(args.mapper_socket.clone())
            .with_attach_timeout(args.mapper_attach_timeout.into()),
    )];
    if krbd_ok {
        list.push(Arc::new(crate::node::krbd::KrbdMapper::with_roots(
            args.sysfs_root.clone(),
            args.dev_root.clone(),
        )));
    }
    let default = match &args.default_mapper {
        Some(m) => crate::volume::params::mapper_for(m)
            .map_err(|e| anyhow::anyhow!("--default-mapper: {}", e.why))?
            .to_owned(),
        None if krbd_ok => "krbd".to_owned(),
        None => "rbdkit-fuse".to_owned(),
    };
    anyhow::ensure!(
        list.iter().any(|m| m.name() == default),
        "--default-mapper {default}: not available here (no {}/bus/rbd)",
        args.sysfs_root.display()
    );
    Ok((list, default))
}

/// This node's labels, read from the API server when something needs them
/// (`--domainlabels`, read affinity by flag or by the clusters config).
async fn node_labels(
    args: &CsiArgs,
    clusters: &ClustersFile,
) -> anyhow::Result<Option<BTreeMap<String, String>>> {
    let wanted = !args.domain_labels.is_empty()
        || args.enable_read_affinity
        || clusters.config().any_read_affinity();
    if args.mode == Mode::Controller || !wanted {
        return Ok(None);
    }
    let labels = topology::node_labels(
        args.kubeconfig.as_deref(),
        &args.node_id,
        Duration::from_secs(60),
    )
    .await?;
    Ok(Some(labels))
}

/// Runs the server until SIGTERM or SIGINT.
pub async fn run(args: CsiArgs) -> anyhow::Result<()> {
    run_until(args, crate::shutdown::signal()).await
}

/// Runs the server until `shutdown` resolves.
pub async fn run_until(
    args: CsiArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use proto::{
        controller_server::ControllerServer, group_controller_server::GroupControllerServer,
        identity_server::IdentityServer, node_server::NodeServer,
    };
    telemetry::init(args.log_format);
    let path = socket_path(&args.endpoint)?;
    if args.mode != Mode::Controller {
        anyhow::ensure!(
            !args.node_id.is_empty(),
            "--node-id is required with --mode node or all"
        );
    }
    let mut topology = parse_topology(&args.topology)?;
    let clusters = Arc::new(ClustersFile::load(&args.clusters_config).map_err(anyhow::Error::msg)?);
    let node_labels = node_labels(&args, &clusters).await?;
    if let Some(labels) = &node_labels {
        let from_labels = self::topology::domain_segments(
            &args.driver_name,
            &args.domain_labels,
            labels,
            &args.node_id,
        )?;
        for (k, v) in from_labels {
            if let Some(old) = topology.insert(k.clone(), v.clone()) {
                anyhow::ensure!(
                    old == v,
                    "--topology {k}={old} and --domainlabels ({k}={v}) disagree"
                );
            }
        }
        tracing::info!(?topology, "node topology");
    }
    let pool = BlockingPool::new(args.ceph_threads);
    let csi_metrics = metrics::CsiMetrics::new();
    let conns = Arc::new(Connections::new(
        pool.clone(),
        args.ceph_connect_timeout.into(),
        args.ceph_op_timeout.into(),
        Arc::new(csi_metrics.clone()),
    ));
    let with_controller = args.mode != Mode::Node;
    let with_node = args.mode != Mode::Controller;
    std::fs::create_dir_all(&args.state_dir)
        .with_context(|| format!("creating {}", args.state_dir.display()))?;
    let mut driver = driver::Driver::new(
        args.driver_name.clone(),
        args.node_id.clone(),
        topology,
        Arc::clone(&clusters),
        Arc::clone(&conns),
        pool,
        Arc::new(csi_metrics.clone()),
    )
    .with_kms_config(args.kms_config.clone())
    .with_kubeconfig(args.kubeconfig.clone());
    if with_controller {
        driver = driver.with_pool_index(args.state_dir.join("controller-pools.json"));
    }
    if with_node {
        driver = driver.keeping_keys();
    }
    if let Some(dir) = &args.credentials_dir {
        anyhow::ensure!(
            dir.is_dir(),
            "--credentials-dir {}: not a directory",
            dir.display()
        );
        driver = driver.with_credentials_dir(dir.clone());
    }
    let driver = Arc::new(driver);

    let mut ready_check: Option<identity::ReadyCheck> = None;
    let node_service = if with_node {
        if args.break_dead_locks || args.dead_lock_grace.is_some() {
            tracing::warn!(
                "--break-dead-locks and --dead-lock-grace are ignored: a dead node's locks are \
                 broken once its Node has the node.kubernetes.io/out-of-service taint, by the \
                 provisioner, after it fenced the node"
            );
        }
        let (list, default) = mappers(&args)?;
        if let Some(m) = list.iter().find(|m| m.name() == default).cloned() {
            ready_check = Some(Arc::new(move || m.ready()));
        }
        Some(Arc::new(
            node::NodeService::new(Arc::clone(&driver), list, default, args.state_dir.clone())
                .default_fs(args.default_fstype.clone())
                .read_affinity(
                    args.enable_read_affinity,
                    args.crush_location_labels.clone(),
                    node_labels.clone(),
                ),
        ))
    } else {
        None
    };

    let listener = bind(&path)?;
    tracing::info!(endpoint = %path.display(), mode = ?args.mode, driver = %args.driver_name, "serving CSI");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let config_watch = tokio::spawn({
        let clusters = Arc::clone(&clusters);
        let mut rx = stop_rx.clone();
        async move {
            clusters
                .watch(Duration::from_secs(5), async move {
                    let _ = rx.changed().await;
                })
                .await
        }
    });
    let reaper = tokio::spawn({
        let conns = Arc::clone(&conns);
        let mut rx = stop_rx.clone();
        async move {
            conns
                .reap_idle(Duration::from_secs(300), async move {
                    let _ = rx.changed().await;
                })
                .await
        }
    });

    let reclaim_poll: Duration = args.reclaim_poll.into();
    let reclaimer = node_service
        .as_ref()
        .filter(|_| !reclaim_poll.is_zero())
        .map(|n| {
            let mut rx = stop_rx.clone();
            tokio::spawn(Arc::clone(n).run_reclaim(reclaim_poll, async move {
                let _ = rx.changed().await;
            }))
        });

    let identity = identity::IdentityService::new(
        Arc::clone(&driver),
        with_controller,
        args.probe_timeout.into(),
        ready_check,
    );
    let http = match args.http_addr {
        Some(addr) => {
            let app = metrics::router(
                csi_metrics.clone(),
                path.clone(),
                with_node.then(|| args.state_dir.clone()),
                args.probe_timeout.into(),
            );
            let mut rx = stop_rx.clone();
            let (bound, task) = crate::telemetry::serve_http(addr, app, async move {
                let _ = rx.changed().await;
            })
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
            tracing::info!(http = %bound, "serving /healthz, /readyz and /metrics");
            Some(task)
        }
        None => None,
    };
    let router = tonic::transport::Server::builder()
        .layer(metrics::RpcMetricsLayer(csi_metrics.clone()))
        .add_service(IdentityServer::new(identity))
        .add_optional_service(with_controller.then(|| {
            ControllerServer::new(controller::ControllerService::new(Arc::clone(&driver)))
        }))
        .add_optional_service(with_controller.then(|| {
            GroupControllerServer::new(group_controller::GroupControllerService::new(Arc::clone(
                &driver,
            )))
        }))
        .add_optional_service(node_service.map(NodeServer::from_arc));
    let served = router
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await;
    let _ = stop_tx.send(true);
    let _ = config_watch.await;
    let _ = reaper.await;
    if let Some(r) = reclaimer {
        let _ = r.await;
    }
    if let Some(h) = http {
        let _ = h.await;
    }
    let _ = std::fs::remove_file(&path);
    served.context("gRPC server failed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_topology() {
        assert_eq!(
            socket_path("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            socket_path("unix:/a.sock").unwrap(),
            PathBuf::from("/a.sock")
        );
        assert_eq!(socket_path("/b.sock").unwrap(), PathBuf::from("/b.sock"));
        assert!(socket_path("tcp://1.2.3.4:5").is_err());
        let t = parse_topology(&["topology.rbd.rbdkit.io/zone=a".into()]).unwrap();
        assert_eq!(t["topology.rbd.rbdkit.io/zone"], "a");
        assert!(parse_topology(&["novalue".into()]).is_err());
    }
}
