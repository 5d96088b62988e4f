//! What the three CSI services share: the clusters config, the connection
//! cache, the credentials seen so far, the per-volume in-flight guard, the
//! background jobs, and the mapping of errors to gRPC status codes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tonic::{Code, Status};

use crate::blocking::BlockingPool;
use crate::rados::{Cluster, Secret};
use crate::volume::clusters::{ClusterInfo, ClustersFile, Conn, Connections, Credentials};
use crate::volume::ops::VolumeError;
use crate::volume::{CephObserver, VolumeId};
use crate::{Error, ErrorKind};

/// The Secret keys ceph-csi uses for the cephx user and key.
pub const USER_ID: &str = "userID";
/// The Secret key holding the cephx key.
pub const USER_KEY: &str = "userKey";

/// State shared by the Identity, Controller and Node services.
pub struct Driver {
    /// The driver name (`rbd.rbdkit.io`).
    pub name: String,
    /// This node's id (node mode).
    pub node_id: String,
    /// Topology segments this node reports.
    pub topology: BTreeMap<String, String>,
    /// The ceph-csi clusters config.
    pub clusters: Arc<ClustersFile>,
    /// Cached connections, per (cluster, user).
    pub conns: Arc<Connections>,
    /// The pool blocking Ceph calls run on.
    pub pool: BlockingPool,
    /// Where Ceph call timings go.
    pub observer: Arc<dyn CephObserver>,
    /// Work that outlives its request (a group snapshot's member copies).
    pub jobs: crate::csi::jobs::Jobs,
    inflight: Arc<Mutex<HashSet<String>>>,
    // Calls that carry no secrets (ListVolumes, GetCapacity, Probe) use the
    // credentials an earlier call brought for the same cluster. In memory
    // only.
    known: Mutex<HashMap<String, Credentials>>,
    // The same per (cluster, user): what must run as the user that staged
    // a volume (releasing its staging lock) waits for that user's.
    known_users: Mutex<HashMap<(String, String), Credentials>>,
    pools_seen: Mutex<HashSet<(String, String, String)>>,
    // Per pool, the volumes its last successful scan found: what a health
    // list reports as unreachable when the pool cannot be scanned.
    pool_volumes: Mutex<HashMap<(String, String, String), Vec<String>>>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("name", &self.name)
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

/// Holds a volume id for one operation; a second operation on the same id
/// is refused with ABORTED until the last clone of this is dropped, as the
/// CSI spec asks. A clone moved into the blocking work (see
/// [`Driver::ceph_holding`]) keeps the id busy while that work runs on
/// after its request was cancelled, so a retry cannot race it.
#[derive(Debug, Clone)]
pub struct InFlight {
    _key: Arc<InFlightKey>,
}

#[derive(Debug)]
struct InFlightKey {
    set: Arc<Mutex<HashSet<String>>>,
    key: String,
}

/// An in-flight guard of its own, for unit tests.
#[cfg(test)]
pub(crate) fn test_in_flight(key: &str) -> InFlight {
    InFlight {
        _key: Arc::new(InFlightKey {
            set: Arc::new(Mutex::new(HashSet::from([key.to_owned()]))),
            key: key.to_owned(),
        }),
    }
}

impl Drop for InFlightKey {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

impl Driver {
    /// A driver with nothing in flight and no credentials known yet.
    pub fn new(
        name: String,
        node_id: String,
        topology: BTreeMap<String, String>,
        clusters: Arc<ClustersFile>,
        conns: Arc<Connections>,
        pool: BlockingPool,
        observer: Arc<dyn CephObserver>,
    ) -> Driver {
        Driver {
            name,
            node_id,
            topology,
            clusters,
            conns,
            pool,
            observer,
            jobs: crate::csi::jobs::Jobs::new(),
            inflight: Arc::new(Mutex::new(HashSet::new())),
            known: Mutex::new(HashMap::new()),
            known_users: Mutex::new(HashMap::new()),
            pools_seen: Mutex::new(HashSet::new()),
            pool_volumes: Mutex::new(HashMap::new()),
        }
    }

    /// Marks `key` (a volume id or name) busy, or fails with ABORTED if an
    /// operation on it is already running.
    pub fn begin(&self, key: &str) -> Result<InFlight, Status> {
        let mut set = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        if !set.insert(key.to_owned()) {
            return Err(Status::aborted(format!(
                "an operation on {key} is already in progress"
            )));
        }
        Ok(InFlight {
            _key: Arc::new(InFlightKey {
                set: Arc::clone(&self.inflight),
                key: key.to_owned(),
            }),
        })
    }

    /// The cluster of the clusters config named `cluster_id`.
    pub fn cluster(&self, cluster_id: &str) -> Result<ClusterInfo, Status> {
        self.clusters.get(cluster_id).ok_or_else(|| {
            Status::invalid_argument(format!(
                "clusterID {cluster_id:?} is not in the clusters config"
            ))
        })
    }

    /// A connection to `cluster_id` with the credentials in `secrets`, or,
    /// when the call brought none, with those an earlier call brought.
    pub async fn connect(
        &self,
        cluster_id: &str,
        secrets: &HashMap<String, String>,
    ) -> Result<Conn, Status> {
        let creds = match credentials(secrets)? {
            Some(c) => c,
            None => self
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(cluster_id)
                .cloned()
                .ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "the request carries no secrets ({USER_ID}, {USER_KEY}) for cluster {cluster_id:?}"
                    ))
                })?,
        };
        self.connect_with(cluster_id, creds).await
    }

    /// A connection to `cluster_id` as `user`, with the credentials an
    /// earlier call brought for that user; `None` when none has since this
    /// server started.
    pub async fn connect_as(&self, cluster_id: &str, user: &str) -> Result<Option<Conn>, Status> {
        let creds = self
            .known_users
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(cluster_id.to_owned(), user.to_owned()))
            .cloned();
        match creds {
            Some(c) => self.connect_with(cluster_id, c).await.map(Some),
            None => Ok(None),
        }
    }

    async fn connect_with(&self, cluster_id: &str, creds: Credentials) -> Result<Conn, Status> {
        let info = self.cluster(cluster_id)?;
        let conn = self.conns.get(&info, &creds).await.map_err(|e| {
            Status::new(
                status_of(&e).code(),
                format!(
                    "cannot connect to Ceph cluster {cluster_id:?} as {:?}: {e}",
                    creds.user
                ),
            )
        })?;
        self.known_users
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((cluster_id.to_owned(), creds.user.clone()), creds.clone());
        self.known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(cluster_id.to_owned(), creds);
        Ok(conn)
    }

    /// Runs `f` on the blocking pool with the connection's cluster; a
    /// connection-level failure marks the connection for rebuilding.
    pub async fn ceph<T: Send + 'static>(
        &self,
        conn: &Conn,
        f: impl FnOnce(&Cluster, &dyn CephObserver) -> Result<T, VolumeError> + Send + 'static,
    ) -> Result<T, VolumeError> {
        let cluster = conn.cluster().clone();
        let observer = Arc::clone(&self.observer);
        let out = match self
            .pool
            .run(move || Ok(f(&cluster, observer.as_ref())))
            .await
        {
            Ok(inner) => inner,
            Err(e) => Err(VolumeError::Ceph(e)),
        };
        if let Err(VolumeError::Ceph(e)) = &out {
            conn.check(e);
        }
        out
    }

    /// [`Driver::ceph`] for work on a busy id: `busy` stays held until `f`
    /// returns, even if the request that waits for it is cancelled.
    pub async fn ceph_holding<T: Send + 'static>(
        &self,
        busy: &InFlight,
        conn: &Conn,
        f: impl FnOnce(&Cluster, &dyn CephObserver) -> Result<T, VolumeError> + Send + 'static,
    ) -> Result<T, VolumeError> {
        let busy = busy.clone();
        self.ceph(conn, move |c, m| {
            let out = f(c, m);
            drop(busy);
            out
        })
        .await
    }

    /// Remembers that volumes live in this pool, for ListVolumes.
    pub fn saw_pool(&self, vol: &VolumeId) {
        self.pools_seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((
                vol.cluster_id.clone(),
                vol.pool.clone(),
                vol.rados_namespace.clone(),
            ));
    }

    /// Records the volumes (handles) a scan of `pool` found.
    pub fn scanned(&self, pool: &(String, String, String), handles: Vec<String>) {
        self.pool_volumes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pool.clone(), handles);
    }

    /// The volumes the last successful scan of `pool` found.
    pub fn last_scanned(&self, pool: &(String, String, String)) -> Vec<String> {
        self.pool_volumes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(pool)
            .cloned()
            .unwrap_or_default()
    }

    /// The (cluster, pool, namespace) triples volumes were seen in, sorted.
    pub fn pools_seen(&self) -> Vec<(String, String, String)> {
        let mut v: Vec<_> = self
            .pools_seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// The clusters some call has brought credentials for.
    pub fn clusters_known(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }
}

/// The cephx credentials in a request's secrets: `None` when it has none,
/// an error naming the missing key when it has only part. Never echoes a
/// value.
pub fn credentials(secrets: &HashMap<String, String>) -> Result<Option<Credentials>, Status> {
    if secrets.is_empty() {
        return Ok(None);
    }
    let get = |k: &str| -> Result<String, Status> {
        match secrets.get(k).map(|v| v.trim()) {
            Some(v) if !v.is_empty() => Ok(v.to_owned()),
            Some(_) => Err(Status::invalid_argument(format!("secret {k:?} is empty"))),
            None => Err(Status::invalid_argument(format!(
                "the secrets have no {k:?} key"
            ))),
        }
    };
    Ok(Some(Credentials {
        user: get(USER_ID)?,
        key: Secret::new(get(USER_KEY)?),
    }))
}

/// The gRPC status for a library error.
pub fn status_of(e: &Error) -> Status {
    let code = match e.kind() {
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::Busy | ErrorKind::HasSnapshots => Code::FailedPrecondition,
        ErrorKind::PermissionDenied => Code::PermissionDenied,
        ErrorKind::TimedOut => Code::DeadlineExceeded,
        ErrorKind::InvalidArgument | ErrorKind::ShrinkRefused => Code::InvalidArgument,
        ErrorKind::NoSpace => Code::ResourceExhausted,
        ErrorKind::ReadOnly => Code::FailedPrecondition,
        ErrorKind::NotSupported => Code::InvalidArgument,
        ErrorKind::Fenced => Code::Aborted,
        _ => Code::Internal,
    };
    Status::new(code, e.to_string())
}

/// The gRPC status for a volume operation's error.
pub fn volume_status(e: &VolumeError) -> Status {
    match e {
        VolumeError::Ceph(e) => status_of(e),
        VolumeError::NotOwned { .. } => Status::failed_precondition(e.to_string()),
        VolumeError::InUse { .. } => Status::failed_precondition(e.to_string()),
        VolumeError::ShrinkRefused { .. } => Status::invalid_argument(e.to_string()),
        VolumeError::PurgeBlocked { .. } => Status::failed_precondition(e.to_string()),
        VolumeError::Missing { .. } => Status::not_found(e.to_string()),
        VolumeError::Conflict { .. } => Status::already_exists(e.to_string()),
        VolumeError::Refused { .. } => Status::invalid_argument(e.to_string()),
        // ABORTED: a code the CO retries (external-snapshotter treats
        // ALREADY_EXISTS and FAILED_PRECONDITION as final).
        VolumeError::Busy { .. } => Status::aborted(e.to_string()),
        VolumeError::Unsuitable { .. } => Status::failed_precondition(e.to_string()),
    }
}

/// Parses a volume id, with INVALID_ARGUMENT for an empty one and NOT_FOUND
/// for one this driver cannot have made (a volume that cannot exist).
pub fn volume_id(id: &str) -> Result<VolumeId, Status> {
    if id.is_empty() {
        return Err(Status::invalid_argument("volume_id is empty"));
    }
    VolumeId::parse(id).map_err(|why| Status::not_found(format!("no such volume: {why}")))
}

/// Requires a non-empty field.
pub fn required<'a>(field: &str, value: &'a str) -> Result<&'a str, Status> {
    if value.is_empty() {
        Err(Status::invalid_argument(format!("{field} is empty")))
    } else {
        Ok(value)
    }
}
