//! The Kubernetes provisioner: PVC → RBD image → PV, delete and expand.
//!
//! `rbdkit provisioner --name NAME --clusters-config FILE [--kubeconfig FILE]`
//! watches claims and volumes and, while it holds the leader lease, does for
//! the StorageClasses that name it what external-provisioner plus ceph-csi's
//! controller do for RBD, with every Ceph call made through this crate.
//!
//! Layout:
//! - [`pv`]: the PV built for a claim;
//! - [`secrets`]: cephx credentials from Secrets;
//! - [`controller`]: the reconcilers;
//! - [`encryption`]: the KMS keys of encrypted volumes;
//! - [`metrics`]: Prometheus metrics;
//! - [`source`]: claims with a data source (clones, restores);
//! - [`maintenance`]: background flattens and the trash, while leading.
//! - [`snapshots`]: the VolumeSnapshotContent reconciler;
//! - [`group_snapshots`]: the VolumeGroupSnapshotContent reconciler;
//! - [`content`], [`crd`]: what those two share: csi-snapshotter's flow
//!   and the custom resources' plumbing.
//! - [`topology`]: accessibility requirements of a claim and the PV's node
//!   affinity (`topologyConstrainedPools`).
//! - [`out_of_service`]: Nodes with the out-of-service taint fenced, their
//!   staging locks broken, and the fence lifted when the taint goes.
//! - [`network_fence`]: csi-addons NetworkFences (CIDR blocks fenced).
//! - [`reclaim`]: csi-addons ReclaimSpaceJobs and ReclaimSpaceCronJobs, and
//!   claims' reclaim schedules ([`cron`]).
//! - [`replication`]: csi-addons VolumeReplications (RBD mirroring).
//! - [`key_rotation`]: csi-addons EncryptionKeyRotationJobs (a new
//!   passphrase for an encrypted volume).
//!
//! Parameters, the volume handle, the clusters config and the Ceph
//! operations themselves are in [`crate::volume`], shared with the CSI
//! controller.

pub mod content;
pub mod controller;
pub mod crd;
pub mod cron;
pub mod encryption;
pub mod group_snapshots;
pub mod key_rotation;
pub mod maintenance;
pub mod metrics;
pub mod modify;
pub mod network_fence;
pub mod out_of_service;
pub mod pv;
pub mod reclaim;
pub mod replication;
pub mod secrets;
pub mod snapshots;
pub mod source;
pub mod topology;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::{
    controller::Config as ControllerConfig, reflector, watcher, Controller, WatchStreamExt,
};
use kube::Api;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::blocking::BlockingPool;
use crate::k8s::backoff::{Backoff, RateLimiter};
use crate::k8s::events::Events;
use crate::k8s::health::Health;
use crate::k8s::leader::{lease_name_for, validate_fence, LeaderElector, Timing};
use crate::provisioner::controller::{CachedClaim, CachedPv, Context};
use crate::provisioner::metrics::Metrics;
use crate::telemetry::{self, LogFormat};
use crate::volume::clusters::{ClustersFile, Connections};
use crate::volume::{Fence, NoFence};

/// Command-line arguments of `rbdkit provisioner`.
#[derive(Debug, Clone, clap::Args)]
pub struct ProvisionerArgs {
    /// The provisioner name that StorageClasses name (also the CSI driver
    /// name on the PVs it makes).
    #[arg(long, default_value = "rbd.rbdkit.io")]
    pub name: String,

    /// ceph-csi's config.json: the clusters and their monitors. Re-read when
    /// it changes.
    #[arg(long, value_name = "FILE")]
    pub clusters_config: PathBuf,

    /// ceph-csi's KMS config (the `ceph-csi-encryption-kms-config`
    /// ConfigMap's config.json), read at each encrypted volume's create; a
    /// missing file leaves only the `default` KMS.
    #[arg(long, value_name = "FILE", default_value = crate::volume::kms::DEFAULT_CONFIG_PATH)]
    pub kms_config: PathBuf,

    /// A kubeconfig file; without it, the in-cluster service account is used.
    #[arg(long, value_name = "FILE", env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Address of the /healthz, /readyz and /metrics server.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,

    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    pub log_format: LogFormat,

    /// How many claims and volumes are worked on at once (per kind). Most of
    /// a provisioning is waiting on API round trips, so too few would hold
    /// a burst below `--rate-limit`; each one in flight also holds memory.
    /// 8 kept up with the default rate limit on a loaded 2-core machine (4
    /// too, 16 was no faster). The load on the API server and Ceph is
    /// bounded by `--rate-limit` and `--ceph-threads`, not by this.
    #[arg(long, default_value_t = 8)]
    pub workers: u16,

    /// Threads for blocking Ceph calls: at most this many run at once, each
    /// with an open image's copy of the Ceph configuration. 4 kept up with
    /// the default rate limit (2 too, 8 was no faster).
    #[arg(long, default_value_t = 4)]
    pub ceph_threads: usize,

    /// Global rate limit on operations (reconciles that write to the API
    /// server or call Ceph; the ones our own writes trigger and that find
    /// nothing to do are free), per second. One operation is a provisioning,
    /// a deletion or an expansion: about five API writes and a few Ceph calls.
    #[arg(long, default_value_t = 20.0)]
    pub rate_limit: f64,

    /// Burst of operations allowed above the rate limit.
    #[arg(long, default_value_t = 100)]
    pub rate_burst: u32,

    /// Retry delay after an object's first failure (doubles per failure).
    #[arg(long, default_value = "1s")]
    pub backoff_base: humantime::Duration,

    /// Longest retry delay.
    #[arg(long, default_value = "5m")]
    pub backoff_max: humantime::Duration,

    /// Bound on connecting to a Ceph cluster.
    #[arg(long, default_value = "10s")]
    pub ceph_connect_timeout: humantime::Duration,

    /// Bound on every Ceph operation. With leader election, the lease
    /// duration must exceed it plus the retry period plus a tenth of the
    /// lease: each destructive Ceph step starts only if it would end inside
    /// the lease.
    #[arg(long, default_value = "10s")]
    pub ceph_op_timeout: humantime::Duration,

    /// Close a Ceph connection unused for this long.
    #[arg(long, default_value = "5m")]
    pub ceph_idle_timeout: humantime::Duration,

    /// How often the monitors of every configured cluster are probed; the
    /// connections of a cluster none of whose monitors answer are shut down.
    #[arg(long, default_value = "5s")]
    pub ceph_health_interval: humantime::Duration,

    /// How often the clusters config file is checked for changes.
    #[arg(long, default_value = "5s")]
    pub config_poll: humantime::Duration,

    /// Elect a leader among replicas (off: act at once, for one replica).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_election: bool,

    /// Namespace of the leader Lease (default: this pod's namespace).
    #[arg(long)]
    pub leader_election_namespace: Option<String>,

    /// This replica's name in the Lease (default: pod or host name and pid).
    #[arg(long)]
    pub leader_election_identity: Option<String>,

    /// How long a lease is valid without renewal.
    #[arg(long, default_value = "15s")]
    pub lease_duration: humantime::Duration,

    /// How long the leader keeps acting without renewing.
    #[arg(long, default_value = "10s")]
    pub renew_deadline: humantime::Duration,

    /// How often the lease is renewed or retried.
    #[arg(long, default_value = "2s")]
    pub retry_period: humantime::Duration,

    /// How long in-flight work may take to finish on shutdown.
    #[arg(long, default_value = "30s")]
    pub shutdown_grace: humantime::Duration,

    /// How often the leader resumes background flattens of deep clones and
    /// purges trashed images whose last clone has gone.
    #[arg(long, default_value = "1m")]
    pub maintenance_interval: humantime::Duration,

    /// Delay of the first maintenance pass after the lease is taken, so the
    /// reconciles a restart wakes go first.
    #[arg(long, default_value = "3s")]
    pub maintenance_delay: humantime::Duration,

    /// Handle the VolumeSnapshotContents that name this driver (waits, with
    /// a log line, while the snapshot CRDs are not installed).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub snapshots: bool,

    /// Reconcile csi-addons ReclaimSpaceJobs and ReclaimSpaceCronJobs of
    /// this provisioner's claims, and turn a claim's
    /// `reclaimspace.csiaddons.openshift.io/schedule` annotation into a
    /// ReclaimSpaceCronJob (waits, with a log line, while the CRDs are not
    /// installed).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub reclaim_space: bool,

    /// Handle the csi-addons VolumeReplications whose class names this
    /// provisioner (RBD mirroring; waits, with a log line, while the
    /// replication CRDs are not installed).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub replication: bool,

    /// Handle the csi-addons EncryptionKeyRotationJobs (a new passphrase
    /// for an encrypted volume of this provisioner; waits, with a log
    /// line, while the CRD is not installed). Set false where csi-addons'
    /// own controller serves another driver's jobs.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub key_rotation: bool,

    /// Bound on one mirror promote or demote. Each waits for the image's
    /// exclusive lock, which a stuck rbd-mirror daemon may never hand over
    /// (Ceph 16's force promote); past the bound the call is left to finish
    /// on its own and the reconcile retries.
    #[arg(long, default_value = "60s")]
    pub mirror_op_timeout: humantime::Duration,

    /// Legacy provisioners (`ceph.com/rbd`, `kubernetes.io/rbd`,
    /// `ceph.rook.io/block`, comma-separated) whose unmigrated PVs this
    /// provisioner deletes (reclaim Delete, once released) and expands. Their
    /// cluster is found as `rbdkit migrate` finds it (rook's
    /// `clusterNamespace`, or `clusterName`, as a clusterID; monitors
    /// matched); the image gets rbdkit's owner record first, and one owned
    /// by another rbdkit is never touched.
    #[arg(long, value_name = "PROVISIONER[,...]", default_value = "")]
    pub adopt_legacy: String,

    /// The Secret (`NAMESPACE/NAME`, `userID`/`userKey`) to delete and
    /// expand legacy volumes with (their PVs name none rbdkit can use).
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub legacy_secret: Option<String>,
}

/// Where the connection cache reports: the metrics, and `/readyz` for
/// unreachable clusters.
struct Observer {
    metrics: Metrics,
    health: Health,
}

impl crate::volume::CephObserver for Observer {
    fn ceph_op(&self, op: &str, started: std::time::Instant) {
        self.metrics.ceph_op(op, started);
    }
    fn set_connections(&self, n: usize) {
        self.metrics.set_connections(n);
    }
    fn cluster_reachable(&self, cluster_id: &str, reachable: bool) {
        self.metrics.set_cluster_reachable(cluster_id, reachable);
        self.health.set_cluster_reachable(cluster_id, reachable);
    }
    fn cluster_ops_timing_out(&self, cluster_id: &str, timing_out: bool) {
        self.health
            .set_cluster_ops_timing_out(cluster_id, timing_out);
    }
}

/// Runs the provisioner until SIGTERM or SIGINT.
pub async fn run(args: ProvisionerArgs) -> anyhow::Result<()> {
    run_until(args, crate::shutdown::signal()).await
}

/// Runs the provisioner until `shutdown` resolves, then stops gracefully:
/// in-flight work gets `--shutdown-grace` to finish, and the lease is
/// released.
pub async fn run_until(
    args: ProvisionerArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    telemetry::init(args.log_format);
    let timing = Timing {
        lease_duration: args.lease_duration.into(),
        renew_deadline: args.renew_deadline.into(),
        retry_period: args.retry_period.into(),
    };
    timing.validate().map_err(anyhow::Error::msg)?;
    let op_timeout: Duration = args.ceph_op_timeout.into();
    if args.leader_election {
        validate_fence(&timing, op_timeout).map_err(anyhow::Error::msg)?;
    }
    let backoff = Backoff {
        base: args.backoff_base.into(),
        max: args.backoff_max.into(),
    };
    anyhow::ensure!(
        !backoff.base.is_zero() && backoff.base <= backoff.max,
        "--backoff-base must be > 0 and at most --backoff-max"
    );
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");

    let client = crate::k8s::client::client(args.kubeconfig.as_deref()).await?;
    let clusters = Arc::new(ClustersFile::load(&args.clusters_config).map_err(anyhow::Error::msg)?);
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let health = Health::new(registry);
    let pool = BlockingPool::new(args.ceph_threads);
    let conns = Arc::new(Connections::new(
        pool.clone(),
        args.ceph_connect_timeout.into(),
        args.ceph_op_timeout.into(),
        Arc::new(Observer {
            metrics: metrics.clone(),
            health: health.clone(),
        }),
    ));
    let identity = args
        .leader_election_identity
        .clone()
        .unwrap_or_else(crate::k8s::client::own_identity);

    // One stop signal for every background task.
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
    }

    let (addr, http) = health
        .serve(args.http_addr, stopped(stop_rx.clone()))
        .await
        .with_context(|| format!("cannot listen on {}", args.http_addr))?;
    tracing::info!(name = %args.name, identity = %identity, http = %addr, "provisioner starting");
    tokio::spawn(Arc::clone(&clusters).watch(args.config_poll.into(), stopped(stop_rx.clone())));
    tokio::spawn(
        Arc::clone(&conns).reap_idle(args.ceph_idle_timeout.into(), stopped(stop_rx.clone())),
    );
    tokio::spawn(Arc::clone(&conns).check_health(
        Arc::clone(&clusters),
        args.ceph_health_interval.into(),
        stopped(stop_rx.clone()),
    ));

    // Leadership.
    let (leader_tx, leader_rx) = watch::channel(false);
    let (elector_stop_tx, elector_stop_rx) = watch::channel(false);
    let fence: Arc<dyn Fence>;
    let elector = if args.leader_election {
        let namespace = args
            .leader_election_namespace
            .clone()
            .unwrap_or_else(crate::k8s::client::own_namespace);
        let api: Api<Lease> = Api::namespaced(client.clone(), &namespace);
        let lease = lease_name_for(&args.name);
        tracing::info!(lease = %lease, namespace = %namespace, "leader election enabled");
        let e = LeaderElector::new(api, &lease, &identity, timing);
        fence = Arc::new(e.fence(op_timeout));
        Some(tokio::spawn(e.run(leader_tx, stopped(elector_stop_rx))))
    } else {
        // One replica by configuration: nobody else acts beside it.
        fence = Arc::new(NoFence);
        leader_tx.send_replace(true);
        drop(elector_stop_rx);
        None
    };

    let adopt = crate::volume::legacy::Kind::parse_list(&args.adopt_legacy)
        .map_err(|e| anyhow::anyhow!("--adopt-legacy: {e}"))?;
    let legacy_secret = match &args.legacy_secret {
        Some(s) => match s.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() => {
                Some(crate::volume::params::SecretRef {
                    namespace: ns.to_owned(),
                    name: name.to_owned(),
                })
            }
            _ => anyhow::bail!("--legacy-secret {s:?}: expected NAMESPACE/NAME"),
        },
        None => None,
    };
    anyhow::ensure!(
        adopt.is_empty() || legacy_secret.is_some(),
        "--adopt-legacy needs --legacy-secret"
    );
    let ctx = Arc::new(
        Context::new(
            client.clone(),
            args.name.clone(),
            clusters,
            conns,
            pool,
            Events::new(client.clone(), &args.name, &identity),
            metrics.clone(),
            backoff,
            Arc::new(RateLimiter::new(args.rate_limit, args.rate_burst)),
            fence,
        )
        .with_legacy(adopt, legacy_secret)
        .with_kms_config(args.kms_config.clone())
        .with_reclaim_space(args.reclaim_space)
        .with_mirror_op_timeout(args.mirror_op_timeout.into()),
    );

    let mut leader_rx_loop = leader_rx.clone();
    let mut stop_loop = stop_rx.clone();
    loop {
        // Wait to lead (or to stop).
        tokio::select! {
            r = leader_rx_loop.wait_for(|l| *l) => { if r.is_err() { break; } }
            _ = stop_loop.wait_for(|s| *s) => break,
        }
        if *stop_loop.borrow() {
            break;
        }
        health.set_leader(true);
        metrics.set_leader(true);
        tracing::info!("leading: starting controllers");
        let lost = {
            let mut rx = leader_rx.clone();
            async move {
                let _ = rx.wait_for(|l| !*l).await;
            }
        };
        let work = run_controllers(
            Arc::clone(&ctx),
            args.workers,
            (args.snapshots, args.replication, args.key_rotation),
            health.clone(),
            stopped(stop_rx.clone()),
            (
                args.maintenance_delay.into(),
                args.maintenance_interval.into(),
                op_timeout,
            ),
        );
        let grace: Duration = args.shutdown_grace.into();
        tokio::select! {
            _ = work => {
                tracing::info!("controllers stopped");
            }
            _ = lost => {
                // Dropping the controllers aborts every reconcile in flight.
                tracing::warn!("lost the lease: all work stopped");
            }
            _ = async {
                stopped(stop_rx.clone()).await;
                tokio::time::sleep(grace).await;
            } => {
                tracing::warn!(?grace, "in-flight work did not finish in time; abandoned");
            }
        }
        health.set_leader(false);
        health.set_synced(false);
        metrics.set_leader(false);
        if *stop_loop.borrow() {
            break;
        }
    }
    let _ = elector_stop_tx.send(true);
    if let Some(e) = elector {
        let _ = e.await;
    }
    let _ = stop_tx.send(true);
    let _ = http.await;
    tracing::info!("provisioner stopped");
    Ok(())
}

/// Objects per page of the initial LIST: a page is held twice (the response
/// and the decoded objects) before the cache takes it, so smaller pages keep
/// the peak low; 100 is still few round trips for thousands of objects.
pub(crate) const LIST_PAGE_SIZE: u32 = 100;

/// A watch of every `K`, its objects trimmed of what no reconciler reads
/// ([`crate::k8s::compact::trim`]). `K` is small or [`crate::k8s::compact::Compact`]: the caches
/// hold every claim and PV of the cluster.
fn watch_all<K>(
    api: Api<K>,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    watcher(
        api,
        watcher::Config::default()
            .any_semantic()
            .page_size(LIST_PAGE_SIZE),
    )
    .default_backoff()
    .modify(|o: &mut K| crate::k8s::compact::trim(o.meta_mut()))
}

/// Runs the claim and volume controllers until `shutdown` resolves (then
/// lets in-flight reconciles finish).
async fn run_controllers(
    ctx: Arc<Context>,
    workers: u16,
    (with_snapshots, with_replication, with_key_rotation): (bool, bool, bool),
    health: Health,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    (maintenance_delay, maintenance_interval, op_timeout): (Duration, Duration, Duration),
) {
    let shutdown = futures::FutureExt::shared(Box::pin(shutdown));
    let config = ControllerConfig::default().concurrency(workers);
    let claims: Api<CachedClaim> = Api::all(ctx.client.clone());
    let pvs: Api<CachedPv> = Api::all(ctx.client.clone());

    let (claim_store, claim_writer) = reflector::store();
    let (pv_store, pv_writer) = reflector::store();
    ctx.set_pv_cache(Some(pv_store.clone()));
    let (class_store, class_writer) = reflector::store();
    ctx.set_class_cache(Some(class_store));
    // Only feeds the cache; an error (say, no list or watch on classes)
    // only means claims wait for the binder's handover.
    let classes = watch_all(Api::<StorageClass>::all(ctx.client.clone()))
        .reflect(class_writer)
        .for_each(|_| futures::future::ready(()));
    let strip = Arc::clone(&ctx);
    let claim_controller = Controller::for_stream(
        watch_all(claims)
            .modify(move |c: &mut CachedClaim| strip.strip_foreign_claim(c))
            .reflect(claim_writer)
            .applied_objects(),
        claim_store.clone(),
    )
    .with_config(config.clone())
    .graceful_shutdown_on(shutdown.clone());
    let snapshots = snapshots::run(
        Arc::clone(&ctx),
        config.clone(),
        with_snapshots,
        shutdown.clone(),
    );
    let group_snapshots = group_snapshots::run(
        Arc::clone(&ctx),
        config.clone(),
        with_snapshots,
        shutdown.clone(),
    );
    let replication = replication::run(
        Arc::clone(&ctx),
        config.clone(),
        with_replication,
        shutdown.clone(),
    );
    let key_rotation = key_rotation::run(
        Arc::clone(&ctx),
        config.clone(),
        with_key_rotation,
        shutdown.clone(),
    );
    let nodes = out_of_service::run(Arc::clone(&ctx), config.clone(), shutdown.clone());
    let fences = network_fence::run(Arc::clone(&ctx), config.clone(), shutdown.clone());
    let reclaims = reclaim::run(
        Arc::clone(&ctx),
        config.clone(),
        ctx.reclaim_space,
        shutdown.clone(),
    );
    let strip = Arc::clone(&ctx);
    let pv_controller = Controller::for_stream(
        watch_all(pvs)
            .modify(move |pv: &mut CachedPv| strip.strip_foreign_pv(pv))
            .reflect(pv_writer)
            .applied_objects(),
        pv_store.clone(),
    )
    .with_config(config)
    .graceful_shutdown_on(shutdown);
    let synced = async move {
        if claim_store.wait_until_ready().await.is_ok() && pv_store.wait_until_ready().await.is_ok()
        {
            health.set_synced(true);
            tracing::info!("caches synced; ready");
        }
        std::future::pending::<()>().await
    };

    let claims = claim_controller
        .run(
            controller::reconcile_claim,
            controller::claim_error_policy,
            Arc::clone(&ctx),
        )
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "claim controller");
            }
        });
    let volumes = pv_controller
        .run(
            controller::reconcile_pv,
            controller::pv_error_policy,
            Arc::clone(&ctx),
        )
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "volume controller");
            }
        });
    // Never ends either; dropped (mid-pass too) with the controllers.
    let maintenance = crate::provisioner::maintenance::run(
        Arc::clone(&ctx),
        maintenance_delay,
        maintenance_interval,
        op_timeout,
    );
    // `synced` never ends: it is dropped with the controllers.
    tokio::select! {
        _ = async { futures::join!(claims, volumes, snapshots, group_snapshots, replication, key_rotation, classes, nodes, fences, reclaims) } => {}
        _ = synced => {}
        _ = maintenance => {}
    }
}
