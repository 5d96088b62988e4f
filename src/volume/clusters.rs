//! Clusters and connections.
//!
//! The clusters config is ceph-csi's `config.json`, so that a ceph-csi
//! ConfigMap can be mounted as it is:
//!
//! ```json
//! [{"clusterID": "c1", "monitors": ["10.0.0.1:6789"], "rbd": {"radosNamespace": "k8s"}}]
//! ```
//!
//! [`ClustersFile`] reads it and re-reads it when its content changes (a
//! mounted ConfigMap is updated by swapping a symlink, which polling sees and
//! inotify on the file does not). A bad new version is logged and the last
//! good one kept.
//!
//! [`Connections`] keeps one connection per (cluster, monitors, user),
//! shared by the workers that need it, counted while in use, dropped after it
//! has been idle a while, and rebuilt when a call shows it is broken or the
//! Secret's key changed. Keys live only in memory, inside
//! [`crate::rados::Secret`].
//!
//! A cluster that has gone away must not keep librados' messenger threads
//! hunting for monitors: [`Connections::check_health`] probes the monitors
//! of every configured cluster (TCP, no credentials) and shuts the cached
//! connections of an unreachable one down. Connecting to a cluster marked
//! unreachable is then refused until its backoff has passed (capped
//! exponential, one attempt in flight at a time), and allowed at once when
//! a probe sees its monitors again.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::blocking::BlockingPool;
use crate::rados::{Cluster, ConnectOptions, Secret};
use crate::volume::CephObserver;
use crate::{Error, ErrorKind};

/// One cluster of the clusters config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterInfo {
    /// The id StorageClasses use.
    pub cluster_id: String,
    /// Monitor addresses.
    pub monitors: Vec<String>,
    /// The RADOS namespace for RBD images (empty: the default one).
    pub rados_namespace: String,
}

#[derive(Deserialize)]
struct RawEntry {
    #[serde(rename = "clusterID")]
    cluster_id: String,
    #[serde(default)]
    monitors: Vec<String>,
    #[serde(default)]
    rbd: Option<RawRbd>,
    #[serde(rename = "readAffinity", default)]
    read_affinity: Option<RawReadAffinity>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawReadAffinity {
    #[serde(default)]
    enabled: bool,
    #[serde(default)]
    crush_location_labels: Vec<String>,
}

/// A cluster's `readAffinity` entry (ceph-csi's): whether its volumes read
/// from the nearest replica, and the node labels that place the node in
/// its CRUSH map (none: the node plugin's `--crush-location-labels`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadAffinity {
    /// `enabled`.
    pub enabled: bool,
    /// `crushLocationLabels`.
    pub crush_location_labels: Vec<String>,
}

#[derive(Deserialize)]
struct RawRbd {
    #[serde(rename = "radosNamespace", default)]
    rados_namespace: Option<String>,
}

/// A monitor list as written (config.json's `monitors`, a PV's
/// `spec.rbd.monitors`): each entry trimmed, empty ones dropped, in order.
pub fn monitor_list(entries: &[String]) -> Vec<String> {
    entries
        .iter()
        .map(|m| m.trim().to_owned())
        .filter(|m| !m.is_empty())
        .collect()
}

/// The parsed clusters config.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClustersConfig {
    clusters: HashMap<String, ClusterInfo>,
    read_affinity: HashMap<String, ReadAffinity>,
}

impl ClustersConfig {
    /// Parses ceph-csi's `config.json`. Entries need a `clusterID` and at
    /// least one monitor; ids must be unique. Other fields (`cephFS`, …)
    /// are ignored.
    pub fn parse(text: &str) -> Result<ClustersConfig, String> {
        let raw: Vec<RawEntry> =
            serde_json::from_str(text).map_err(|e| format!("not a ceph-csi config.json: {e}"))?;
        let mut clusters = HashMap::new();
        let mut read_affinity = HashMap::new();
        for (i, e) in raw.into_iter().enumerate() {
            if e.cluster_id.trim().is_empty() {
                return Err(format!("entry {i} has an empty clusterID"));
            }
            let monitors = monitor_list(&e.monitors);
            if monitors.is_empty() {
                return Err(format!("cluster {:?} has no monitors", e.cluster_id));
            }
            let info = ClusterInfo {
                cluster_id: e.cluster_id.clone(),
                monitors,
                rados_namespace: e.rbd.and_then(|r| r.rados_namespace).unwrap_or_default(),
            };
            if let Some(ra) = e.read_affinity {
                let labels: Vec<String> = ra
                    .crush_location_labels
                    .iter()
                    .map(|l| l.trim().to_owned())
                    .filter(|l| !l.is_empty())
                    .collect();
                read_affinity.insert(
                    e.cluster_id.clone(),
                    ReadAffinity {
                        enabled: ra.enabled,
                        crush_location_labels: labels,
                    },
                );
            }
            if clusters.insert(e.cluster_id.clone(), info).is_some() {
                return Err(format!("cluster {:?} is listed twice", e.cluster_id));
            }
        }
        Ok(ClustersConfig {
            clusters,
            read_affinity,
        })
    }

    /// The `readAffinity` entry of cluster `cluster_id`, if it has one.
    pub fn read_affinity(&self, cluster_id: &str) -> Option<&ReadAffinity> {
        self.read_affinity.get(cluster_id)
    }

    /// Whether any cluster turns read affinity on.
    pub fn any_read_affinity(&self) -> bool {
        self.read_affinity.values().any(|r| r.enabled)
    }

    /// The cluster with this id.
    pub fn get(&self, cluster_id: &str) -> Option<&ClusterInfo> {
        self.clusters.get(cluster_id)
    }

    /// The cluster ids, in no particular order.
    pub fn ids(&self) -> Vec<String> {
        self.clusters.keys().cloned().collect()
    }

    /// How many clusters there are.
    pub fn len(&self) -> usize {
        self.clusters.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.clusters.is_empty()
    }
}

/// The clusters config file, kept current.
#[derive(Debug)]
pub struct ClustersFile {
    path: PathBuf,
    current: RwLock<Arc<ClustersConfig>>,
    last_text: Mutex<String>,
}

impl ClustersFile {
    /// Reads the file; it must exist and parse.
    pub fn load(path: &Path) -> Result<ClustersFile, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read clusters config {}: {e}", path.display()))?;
        let config = ClustersConfig::parse(&text)
            .map_err(|e| format!("clusters config {}: {e}", path.display()))?;
        Ok(ClustersFile {
            path: path.to_owned(),
            current: RwLock::new(Arc::new(config)),
            last_text: Mutex::new(text),
        })
    }

    /// The current config.
    pub fn config(&self) -> Arc<ClustersConfig> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The cluster with this id in the current config.
    pub fn get(&self, cluster_id: &str) -> Option<ClusterInfo> {
        self.config().get(cluster_id).cloned()
    }

    /// Re-reads the file; returns true when a new config was taken.
    pub fn reload(&self) -> bool {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot re-read the clusters config; keeping the last one");
                return false;
            }
        };
        {
            let mut last = self.last_text.lock().unwrap_or_else(|e| e.into_inner());
            if *last == text {
                return false;
            }
            *last = text.clone();
        }
        match ClustersConfig::parse(&text) {
            Ok(config) => {
                tracing::info!(path = %self.path.display(), clusters = config.len(), "clusters config reloaded");
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(config);
                true
            }
            Err(e) => {
                tracing::error!(path = %self.path.display(), error = %e, "the new clusters config is invalid; keeping the last good one");
                false
            }
        }
    }

    /// Polls the file every `every` until `shutdown` resolves.
    pub async fn watch(
        self: Arc<Self>,
        every: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(every) => {}
            }
            let me = Arc::clone(&self);
            // File reads block; they are short, but keep them off the runtime.
            let _ = tokio::task::spawn_blocking(move || me.reload()).await;
        }
    }
}

/// cephx credentials from a Secret: the user id and its key.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The user id, without `client.`.
    pub user: String,
    /// The key; never printed.
    pub key: Secret,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("key", &self.key)
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ConnKey {
    cluster_id: String,
    monitors: String,
    user: String,
}

struct Live {
    cluster: Cluster,
    key: Secret,
}

struct Slot {
    live: tokio::sync::Mutex<Option<Live>>,
    broken: AtomicBool,
    users: AtomicUsize,
    last_used: Mutex<Instant>,
}

/// A connection in use. Dropping it returns it to the cache.
pub struct Conn {
    cluster: Cluster,
    slot: Arc<Slot>,
    cluster_id: String,
    observer: Arc<dyn CephObserver>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("cluster", &self.cluster)
            .finish()
    }
}

impl Conn {
    /// The connected cluster.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Looks at an error from a call on this connection and, if it means the
    /// connection itself is unusable (timed out, shut down, blocklisted,
    /// refused), makes the next user rebuild it.
    pub fn check(&self, e: &Error) {
        if is_connection_error(e) {
            tracing::warn!(error = %e, "Ceph connection looks broken; it will be rebuilt");
            self.slot.broken.store(true, Ordering::SeqCst);
        }
        match e.kind() {
            // The monitor probe cannot see this (e.g. the OSDs are down).
            ErrorKind::TimedOut => self.observer.cluster_ops_timing_out(&self.cluster_id, true),
            // Refused by a fence: Ceph was not asked.
            ErrorKind::Fenced => {}
            _ => self.answered(),
        }
    }

    /// Records that the cluster answered a call made on this connection.
    pub fn answered(&self) {
        self.observer
            .cluster_ops_timing_out(&self.cluster_id, false);
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        *self
            .slot
            .last_used
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.slot.users.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether an error means the connection (not the request) is bad.
pub fn is_connection_error(e: &Error) -> bool {
    match e.kind() {
        ErrorKind::TimedOut => true,
        // ESHUTDOWN is also how Ceph reports a blocklisted client.
        ErrorKind::Other(n) => {
            n == libc::ESHUTDOWN || n == libc::ENOTCONN || n == libc::ECONNREFUSED
        }
        _ => false,
    }
}

/// What is known of a cluster's reachability.
#[derive(Debug)]
struct Reach {
    reachable: bool,
    failures: u32,
    retry_at: Option<Instant>,
    /// When the attempt in flight started (a cancelled one expires).
    connecting: Option<Instant>,
    why: String,
}

impl Default for Reach {
    fn default() -> Self {
        Reach {
            reachable: true,
            failures: 0,
            retry_at: None,
            connecting: None,
            why: String::new(),
        }
    }
}

/// Backoff between connect attempts to an unreachable cluster.
const RECONNECT_BASE: Duration = Duration::from_secs(1);
/// The longest backoff between connect attempts.
const RECONNECT_MAX: Duration = Duration::from_secs(60);

fn reconnect_delay(failures: u32) -> Duration {
    RECONNECT_BASE
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(RECONNECT_MAX)
}

/// Whether a monitor address (ceph-csi forms: `host`, `host:port`,
/// `[v2:addr:port/0,v1:addr:port/0]`) accepts a TCP connection within
/// `timeout`, name lookup included. Blocking; a lookup that outlives the
/// bound is left to finish on a thread of its own.
pub fn monitor_reachable(mon: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let Some(addrs) = resolve_bounded(monitor_socket_addr(mon), timeout) else {
        return false;
    };
    addrs.into_iter().any(|a| {
        let left = deadline.saturating_duration_since(Instant::now());
        !left.is_zero() && std::net::TcpStream::connect_timeout(&a, left).is_ok()
    })
}

/// `host:port` of the first address of a monitor entry (port 6789 if it
/// names none).
fn monitor_socket_addr(mon: &str) -> String {
    let mon = mon.trim().trim_start_matches('[').trim_end_matches(']');
    let first = mon.split(',').next().unwrap_or(mon);
    let addr = first
        .trim_start_matches("v2:")
        .trim_start_matches("v1:")
        .split('/')
        .next()
        .unwrap_or(first);
    if addr
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        && !addr.ends_with(']')
    {
        addr.to_owned()
    } else {
        format!("{addr}:6789")
    }
}

/// Resolves `host:port` within `timeout`: `getaddrinfo` has no timeout of
/// its own, so it runs on a detached thread and is given up on after it.
fn resolve_bounded(host_port: String, timeout: Duration) -> Option<Vec<std::net::SocketAddr>> {
    use std::net::ToSocketAddrs;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("mon-resolve".into())
        .spawn(move || {
            let r = host_port.to_socket_addrs().map(|a| a.collect::<Vec<_>>());
            let _ = tx.send(r);
        })
        .ok()?;
    rx.recv_timeout(timeout).ok()?.ok()
}

/// The clusters of `config` none of whose monitors answer within
/// `timeout`, with the monitors tried, sorted by id. Every monitor is
/// probed at once, so the whole check takes about `timeout`, however many
/// clusters and monitors are dead.
pub fn unreachable_clusters(config: &ClustersConfig, timeout: Duration) -> Vec<(String, String)> {
    let (tx, rx) = std::sync::mpsc::channel::<(String, bool)>();
    let mut pending: HashMap<String, (usize, Vec<String>)> = HashMap::new();
    for id in config.ids() {
        let Some(info) = config.get(&id) else {
            continue;
        };
        pending.insert(id.clone(), (info.monitors.len(), info.monitors.clone()));
        for mon in info.monitors.clone() {
            let (tx2, id2) = (tx.clone(), id.clone());
            let spawned = std::thread::Builder::new()
                .name("mon-probe".into())
                .spawn(move || {
                    let _ = tx2.send((id2, monitor_reachable(&mon, timeout)));
                });
            if spawned.is_err() {
                // Counted as a monitor that did not answer.
                let _ = tx.send((id.clone(), false));
            }
        }
    }
    drop(tx);
    // A little past `timeout`: each probe bounds itself by it.
    let deadline = Instant::now() + timeout + Duration::from_millis(500);
    let mut answered: HashSet<String> = HashSet::new();
    while pending.values().any(|(left, _)| *left > 0) {
        let wait = deadline.saturating_duration_since(Instant::now());
        let Ok((id, ok)) = rx.recv_timeout(wait) else {
            break;
        };
        if ok {
            answered.insert(id.clone());
        }
        if let Some((left, _)) = pending.get_mut(&id) {
            *left = left.saturating_sub(1);
        }
    }
    let mut dead: Vec<(String, String)> = pending
        .into_iter()
        .filter(|(id, _)| !answered.contains(id))
        .map(|(id, (_, mons))| (id, mons.join(",")))
        .collect();
    dead.sort();
    dead
}

/// The connection cache.
pub struct Connections {
    pool: BlockingPool,
    slots: Mutex<HashMap<ConnKey, Arc<Slot>>>,
    reach: Mutex<HashMap<String, Reach>>,
    connect_timeout: Duration,
    op_timeout: Duration,
    metrics: Arc<dyn CephObserver>,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.slots.lock().map(|s| s.len()).unwrap_or(0);
        f.debug_struct("Connections").field("slots", &n).finish()
    }
}

impl Connections {
    /// An empty cache. Connecting runs on `pool` and is bounded by
    /// `connect_timeout`; every later call by `op_timeout`.
    pub fn new(
        pool: BlockingPool,
        connect_timeout: Duration,
        op_timeout: Duration,
        metrics: Arc<dyn CephObserver>,
    ) -> Connections {
        Connections {
            pool,
            slots: Mutex::new(HashMap::new()),
            reach: Mutex::new(HashMap::new()),
            connect_timeout,
            op_timeout,
            metrics,
        }
    }

    /// The bound on every Ceph call of its connections (what a long call
    /// cut by a deadline, such as a sparsify, is given at a time).
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// A connection to `cluster` as `creds.user`, made now if there is no
    /// usable one.
    pub async fn get(&self, cluster: &ClusterInfo, creds: &Credentials) -> crate::Result<Conn> {
        let key = ConnKey {
            cluster_id: cluster.cluster_id.clone(),
            monitors: cluster.monitors.join(","),
            user: creds.user.clone(),
        };
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            let slot = slots
                .entry(key.clone())
                .or_insert_with(|| {
                    Arc::new(Slot {
                        live: tokio::sync::Mutex::new(None),
                        broken: AtomicBool::new(false),
                        users: AtomicUsize::new(0),
                        last_used: Mutex::new(Instant::now()),
                    })
                })
                .clone();
            // Counted while still under the map lock, so the reaper cannot
            // drop a slot between lookup and use.
            slot.users.fetch_add(1, Ordering::SeqCst);
            slot
        };
        // From here the count is released by Conn's Drop, or below on error.
        let mut live = slot.live.lock().await;
        let usable = match live.as_ref() {
            Some(l) => l.key == creds.key && !slot.broken.load(Ordering::SeqCst),
            None => false,
        };
        if !usable {
            if let Some(old) = live.take() {
                tracing::info!(cluster = %key.cluster_id, user = %key.user, "rebuilding Ceph connection");
                // rados_shutdown may block: not on the runtime.
                drop(tokio::task::spawn_blocking(move || drop(old)));
            }
            self.begin_connect(&key.cluster_id)?;
            let options = ConnectOptions::new()
                .mon_host(key.monitors.clone())
                .user(creds.user.clone())
                .key(creds.key.clone())
                .connect_timeout(self.connect_timeout)
                .op_timeout(self.op_timeout)
                // These connections only create, resize, snapshot and remove
                // images, never read or write them: with the cache on,
                // every open starts an object cacher and its flusher thread.
                .set("rbd_cache", "false")
                // Their few messages need one messenger thread, not three;
                // and Ceph's ring of recent log entries, kept for a daemon's
                // crash dump, is never read here. Each cost about half a
                // MiB of resident memory (bench/analysis.md, section 5).
                .set("ms_async_op_threads", "1")
                .set("log_max_recent", "1");
            let started = Instant::now();
            let connected = self.pool.run(move || options.connect()).await;
            self.metrics.ceph_op("connect", started);
            self.end_connect(&key.cluster_id, connected.as_ref().err());
            match connected {
                Ok(cluster) => {
                    tracing::info!(cluster = %key.cluster_id, user = %key.user, "connected to Ceph");
                    *live = Some(Live {
                        cluster,
                        key: creds.key.clone(),
                    });
                    slot.broken.store(false, Ordering::SeqCst);
                }
                Err(e) => {
                    drop(live);
                    slot.users.fetch_sub(1, Ordering::SeqCst);
                    return Err(e);
                }
            }
        }
        let cluster = live.as_ref().map(|l| l.cluster.clone());
        drop(live);
        self.metrics.set_connections(self.len());
        match cluster {
            Some(cluster) => Ok(Conn {
                cluster,
                slot,
                cluster_id: key.cluster_id,
                observer: Arc::clone(&self.metrics),
            }),
            None => {
                slot.users.fetch_sub(1, Ordering::SeqCst);
                Err(Error::from_errno(
                    libc::ENOTCONN,
                    "rados_connect",
                    key.cluster_id,
                ))
            }
        }
    }

    /// Refuses a connect to a cluster known to be unreachable until its
    /// backoff has passed, and lets only one attempt run at a time.
    fn begin_connect(&self, cluster_id: &str) -> crate::Result<()> {
        let mut reach = self.reach.lock().unwrap_or_else(|e| e.into_inner());
        let r = reach.entry(cluster_id.to_owned()).or_default();
        if r.reachable {
            return Ok(());
        }
        let now = Instant::now();
        let wait = r.retry_at.map(|t| t.saturating_duration_since(now));
        let in_flight = r
            .connecting
            .is_some_and(|t| t.elapsed() < self.connect_timeout.saturating_mul(2));
        if in_flight || wait.is_some_and(|w| !w.is_zero()) {
            let when = match wait {
                Some(w) if !w.is_zero() => format!("next attempt in {}s", w.as_secs().max(1)),
                _ => "an attempt is in progress".to_owned(),
            };
            return Err(
                Error::from_errno(libc::ENOTCONN, "rados_connect", cluster_id)
                    .detail(format!("Ceph cluster is unreachable ({}); {when}", r.why)),
            );
        }
        r.connecting = Some(now);
        Ok(())
    }

    fn end_connect(&self, cluster_id: &str, failed: Option<&Error>) {
        let changed = {
            let mut reach = self.reach.lock().unwrap_or_else(|e| e.into_inner());
            let r = reach.entry(cluster_id.to_owned()).or_default();
            r.connecting = None;
            match failed {
                None => {
                    let was = r.reachable;
                    *r = Reach::default();
                    !was
                }
                // A refused key or a missing pool says nothing about reachability.
                Some(e) if !is_connection_error(e) => false,
                Some(e) => Self::failed(r, e.to_string()),
            }
        };
        if changed {
            self.metrics.cluster_reachable(cluster_id, failed.is_none());
        }
    }

    /// Records a failure; returns whether the cluster just became unreachable.
    fn failed(r: &mut Reach, why: String) -> bool {
        let was = r.reachable;
        r.reachable = false;
        r.failures = r.failures.saturating_add(1);
        r.retry_at = Some(Instant::now() + reconnect_delay(r.failures));
        r.why = why;
        was
    }

    /// The ids of the clusters currently marked unreachable, sorted.
    pub fn unreachable(&self) -> Vec<String> {
        let reach = self.reach.lock().unwrap_or_else(|e| e.into_inner());
        let mut ids: Vec<String> = reach
            .iter()
            .filter(|(_, r)| !r.reachable)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// Probes the monitors of every cluster in `config` once (each probe
    /// bounded by `timeout`), records the result, and shuts down the cached
    /// connections of the clusters none of whose monitors answer.
    pub async fn check_clusters(&self, config: &ClustersConfig, timeout: Duration) {
        let probes = config.ids().into_iter().filter_map(|id| {
            let mons = config.get(&id)?.monitors.clone();
            Some(async move {
                let ok = tokio::task::spawn_blocking(move || {
                    mons.iter().any(|m| monitor_reachable(m, timeout))
                })
                .await
                .unwrap_or(false);
                (id, ok)
            })
        });
        for (id, ok) in futures::future::join_all(probes).await {
            let (changed, now_reachable) = {
                let mut reach = self.reach.lock().unwrap_or_else(|e| e.into_inner());
                let r = reach.entry(id.clone()).or_default();
                if ok {
                    // Seen again: reconnect on demand at once.
                    let was = r.reachable;
                    r.reachable = true;
                    r.failures = 0;
                    r.retry_at = None;
                    (!was, true)
                } else {
                    let changed = Self::failed(r, "no monitor answers".to_owned());
                    (changed, false)
                }
            };
            self.metrics.cluster_reachable(&id, now_reachable);
            if changed && now_reachable {
                tracing::info!(cluster = %id, "Ceph cluster reachable again");
            }
            if !now_reachable {
                self.shut_down(&id, changed);
            }
        }
    }

    /// Shuts the idle cached connections of `cluster_id` down (off the
    /// runtime threads, and not under the map lock); one in use is marked
    /// broken instead and goes when its user is done.
    fn shut_down(&self, cluster_id: &str, log: bool) {
        let slots: Vec<Arc<Slot>> = {
            let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            slots
                .iter()
                .filter(|(k, _)| k.cluster_id == cluster_id)
                .map(|(_, s)| Arc::clone(s))
                .collect()
        };
        let mut closed = Vec::new();
        for slot in slots {
            slot.broken.store(true, Ordering::SeqCst);
            if let Ok(mut live) = slot.live.try_lock() {
                closed.extend(live.take());
            }
        }
        if log || !closed.is_empty() {
            tracing::warn!(cluster = %cluster_id, closed = closed.len(), "Ceph cluster unreachable: no monitor answers; its connections are shut down until it is back");
        }
        if !closed.is_empty() {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => drop(rt.spawn_blocking(move || drop(closed))),
                Err(_) => drop(closed),
            }
        }
    }

    /// Runs [`Connections::check_clusters`] on the current config every
    /// `every` until `shutdown`.
    pub async fn check_health(
        self: Arc<Self>,
        clusters: Arc<ClustersFile>,
        every: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let timeout = (every / 2).clamp(Duration::from_millis(100), Duration::from_secs(3));
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(every) => {}
            }
            self.check_clusters(&clusters.config(), timeout).await;
        }
    }

    /// How many connections are cached.
    pub fn len(&self) -> usize {
        self.slots.lock().map(|s| s.len()).unwrap_or(0)
    }

    /// True when none are.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops connections nobody has used for `idle`. Returns how many.
    ///
    /// They are taken out under the map lock but shut down (`rados_shutdown`
    /// can block) after it is released, on tokio's blocking pool when
    /// called inside a runtime.
    pub fn reap(&self, idle: Duration) -> usize {
        let mut removed = Vec::new();
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.retain(|key, slot| {
            let in_use = slot.users.load(Ordering::SeqCst) > 0;
            let recent = slot
                .last_used
                .lock()
                .map(|t| t.elapsed() < idle)
                .unwrap_or(true);
            let keep = in_use || recent;
            if !keep {
                tracing::info!(cluster = %key.cluster_id, user = %key.user, "closing idle Ceph connection");
                removed.push(Arc::clone(slot));
            }
            keep
        });
        drop(slots);
        let dropped = removed.len();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || drop(removed))),
            Err(_) => drop(removed),
        }
        self.metrics.set_connections(self.len());
        dropped
    }

    /// Reaps idle connections every `idle / 2` until `shutdown`.
    pub async fn reap_idle(
        self: Arc<Self>,
        idle: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let every = (idle / 2).max(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(every) => {}
            }
            // reap only takes the map lock; shutdowns go to the blocking pool.
            self.reap(idle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monitor_address_forms() {
        let t = Duration::from_millis(200);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(monitor_reachable(&format!("127.0.0.1:{port}"), t));
        assert!(monitor_reachable(
            &format!("[v2:127.0.0.1:{port}/0,v1:127.0.0.1:1/0]"),
            t
        ));
        drop(l);
        assert!(!monitor_reachable(&format!("127.0.0.1:{port}"), t));
        assert!(!monitor_reachable("no-such-host.invalid", t));
        assert_eq!(monitor_socket_addr("mon-a"), "mon-a:6789");
        assert_eq!(monitor_socket_addr("[v2:10.0.0.1:3300/0]"), "10.0.0.1:3300");
    }

    #[test]
    fn unreachable_clusters_names_each_dead_one() {
        let live = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let live = live.local_addr().map(|a| (a, live)).unwrap();
        let dead = |n: usize| -> Vec<String> {
            (0..n)
                .map(|_| {
                    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                    l.local_addr().unwrap().to_string()
                })
                .collect()
        };
        let config = serde_json::json!([
            {"clusterID": "ok", "monitors": [dead(1)[0], live.0.to_string()]},
            {"clusterID": "gone", "monitors": dead(2)},
            {"clusterID": "unnamed", "monitors": ["no-such-host.invalid", "mon.invalid:3300"]},
        ]);
        let config = ClustersConfig::parse(&config.to_string()).unwrap();
        let timeout = Duration::from_millis(300);
        let dead = unreachable_clusters(&config, timeout);
        let ids: Vec<&str> = dead.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["gone", "unnamed"], "{dead:?}");
        assert!(dead[1].1.contains("mon.invalid:3300"), "{dead:?}");
    }

    #[test]
    fn parses_a_ceph_csi_config() {
        let c = ClustersConfig::parse(
            r#"[
              {"clusterID": "c1", "monitors": ["10.0.0.1:6789", " 10.0.0.2:6789 "],
               "rbd": {"radosNamespace": "k8s", "mirrorDaemonCount": 1},
               "cephFS": {"subvolumeGroup": "csi"}},
              {"clusterID": "c2", "monitors": ["[v2:1.2.3.4:3300,v1:1.2.3.4:6789]"]}
            ]"#,
        )
        .unwrap();
        assert_eq!(c.len(), 2);
        let c1 = c.get("c1").unwrap();
        assert_eq!(c1.monitors, vec!["10.0.0.1:6789", "10.0.0.2:6789"]);
        assert_eq!(c1.rados_namespace, "k8s");
        assert_eq!(c.get("c2").unwrap().rados_namespace, "");
        assert!(c.get("c3").is_none());
        assert!(ClustersConfig::parse("[]").unwrap().is_empty());
        assert!(c.read_affinity("c1").is_none());
        assert!(!c.any_read_affinity());
    }

    #[test]
    fn read_affinity_entries_are_kept_per_cluster() {
        let c = ClustersConfig::parse(
            r#"[
              {"clusterID": "c1", "monitors": ["m"],
               "readAffinity": {"enabled": true,
                                "crushLocationLabels": ["topology.kubernetes.io/zone", " "]}},
              {"clusterID": "c2", "monitors": ["m"], "readAffinity": {"enabled": false}}
            ]"#,
        )
        .unwrap();
        let r = c.read_affinity("c1").unwrap();
        assert!(r.enabled);
        assert_eq!(r.crush_location_labels, ["topology.kubernetes.io/zone"]);
        assert!(!c.read_affinity("c2").unwrap().enabled);
        assert!(c.any_read_affinity());
    }

    #[test]
    fn monitor_lists_are_trimmed_and_lose_empty_entries() {
        let raw: Vec<String> = [" 10.0.0.2:6789 ", "", "  ", "\t[v2:1.2.3.4:3300]\n", "b"]
            .map(String::from)
            .into();
        assert_eq!(
            monitor_list(&raw),
            vec!["10.0.0.2:6789", "[v2:1.2.3.4:3300]", "b"]
        );
        assert!(monitor_list(&[" ".to_owned()]).is_empty());
        let c = ClustersConfig::parse(r#"[{"clusterID": "x", "monitors": [" ", ""]}]"#);
        assert!(c.unwrap_err().contains("no monitors"));
    }

    #[test]
    fn refuses_bad_configs() {
        for (text, want) in [
            ("{}", "not a ceph-csi config.json"),
            (r#"[{"monitors": ["a"]}]"#, "clusterID"),
            (
                r#"[{"clusterID": "", "monitors": ["a"]}]"#,
                "empty clusterID",
            ),
            (r#"[{"clusterID": "x"}]"#, "no monitors"),
            (
                r#"[{"clusterID": "x", "monitors": ["a"]}, {"clusterID": "x", "monitors": ["b"]}]"#,
                "twice",
            ),
        ] {
            let e = ClustersConfig::parse(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn reloads_when_the_file_changes_and_keeps_the_last_good_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, r#"[{"clusterID": "a", "monitors": ["m1"]}]"#).unwrap();
        let f = ClustersFile::load(&path).unwrap();
        assert!(f.get("a").is_some());
        assert!(!f.reload(), "unchanged file is not a reload");
        std::fs::write(&path, r#"[{"clusterID": "b", "monitors": ["m2"]}]"#).unwrap();
        assert!(f.reload());
        assert!(f.get("a").is_none());
        assert_eq!(f.get("b").unwrap().monitors, vec!["m2"]);
        std::fs::write(&path, "not json").unwrap();
        assert!(!f.reload());
        assert!(f.get("b").is_some(), "bad config keeps the last good one");
        std::fs::remove_file(&path).unwrap();
        assert!(!f.reload());
        assert!(ClustersFile::load(&path).is_err());
    }

    #[test]
    fn credentials_never_print_the_key() {
        let c = Credentials {
            user: "kube".into(),
            key: Secret::new("AQBsecretsecret=="),
        };
        let shown = format!("{c:?}");
        assert!(shown.contains("kube") && !shown.contains("AQB"), "{shown}");
    }

    #[test]
    fn an_unreachable_cluster_is_retried_after_a_capped_backoff_one_attempt_at_a_time() {
        assert_eq!(reconnect_delay(1), Duration::from_secs(1));
        assert_eq!(reconnect_delay(3), Duration::from_secs(4));
        assert_eq!(reconnect_delay(40), RECONNECT_MAX);
        let c = Connections::new(
            BlockingPool::new(1),
            Duration::from_secs(1),
            Duration::from_secs(1),
            Arc::new(crate::volume::NoMetrics),
        );
        // Reachable (or unknown): connects are never held back.
        c.begin_connect("a").unwrap();
        c.begin_connect("a").unwrap();
        // A refused key says nothing about reachability.
        c.end_connect(
            "a",
            Some(&Error::from_errno(libc::EPERM, "rados_connect", "a")),
        );
        assert!(c.unreachable().is_empty());
        c.end_connect(
            "a",
            Some(&Error::from_errno(libc::ETIMEDOUT, "rados_connect", "a")),
        );
        assert_eq!(c.unreachable(), vec!["a".to_owned()]);
        let e = c.begin_connect("a").unwrap_err();
        assert!(
            e.to_string().contains("unreachable") && e.to_string().contains("next attempt in"),
            "{e}"
        );
        // Once the backoff has passed, exactly one attempt may run.
        c.reach.lock().unwrap().get_mut("a").unwrap().retry_at = Some(Instant::now());
        c.begin_connect("a").unwrap();
        let e = c.begin_connect("a").unwrap_err();
        assert!(e.to_string().contains("in progress"), "{e}");
        c.end_connect("a", None);
        assert!(c.unreachable().is_empty());
        c.begin_connect("a").unwrap();
    }

    #[test]
    fn classifies_connection_errors() {
        assert!(is_connection_error(&Error::from_errno(
            libc::ETIMEDOUT,
            "x",
            ""
        )));
        assert!(is_connection_error(&Error::from_errno(
            libc::ESHUTDOWN,
            "x",
            ""
        )));
        assert!(!is_connection_error(&Error::from_errno(
            libc::ENOENT,
            "x",
            ""
        )));
        assert!(!is_connection_error(&Error::from_errno(
            libc::EBUSY,
            "x",
            ""
        )));
    }
}
