//! What the three CSI services share: the clusters config, the connection
//! cache, the credentials seen so far, the per-volume in-flight guard, the
//! background jobs, and the mapping of errors to gRPC status codes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
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
    /// The KMS config file of encrypted volumes, read at each use.
    pub kms_config: std::path::PathBuf,
    /// The kubeconfig the Vault KMS's tenant kinds read Secrets with
    /// (`None`: the pod's service account).
    pub kubeconfig: Option<std::path::PathBuf>,
    kube: tokio::sync::OnceCell<kube::Client>,
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
    // Where `pools_seen` and `pool_volumes` are kept across restarts.
    pool_index: Option<PathBuf>,
    // `--credentials-dir`: credentials of this server's own.
    credentials_dir: Option<PathBuf>,
    // Node mode: credentials are also kept in the kernel's user keyring,
    // so that a restarted plugin can release what it staged.
    keep_keys: bool,
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
            kms_config: crate::volume::kms::DEFAULT_CONFIG_PATH.into(),
            kubeconfig: None,
            kube: tokio::sync::OnceCell::new(),
            inflight: Arc::new(Mutex::new(HashSet::new())),
            known: Mutex::new(HashMap::new()),
            known_users: Mutex::new(HashMap::new()),
            pools_seen: Mutex::new(HashSet::new()),
            pool_volumes: Mutex::new(HashMap::new()),
            pool_index: None,
            credentials_dir: None,
            keep_keys: false,
        }
    }

    /// Keeps the credentials each call brings in the kernel's user keyring
    /// too (see [`crate::node::keyring::keep_key`]), so that a restarted
    /// node plugin can release a staging lock as the user that took it
    /// ([`Driver::connect_as`]) without waiting for a call that brings
    /// them. For the node service.
    pub fn keeping_keys(mut self) -> Driver {
        self.keep_keys = true;
        self
    }

    fn key_scope(&self, cluster_id: &str) -> String {
        format!("{}/{cluster_id}", self.name)
    }

    /// Keeps the pools volumes were seen in, and what their last scan
    /// found, in `path` (a JSON file) across restarts, starting from what
    /// it holds. A file that cannot be read is logged and started over:
    /// it is an index, not the volumes' record.
    pub fn with_pool_index(mut self, path: PathBuf) -> Driver {
        match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<PoolIndex>(&bytes) {
                Ok(index) => {
                    let seen = self.pools_seen.get_mut().unwrap_or_else(|e| e.into_inner());
                    let volumes = self
                        .pool_volumes
                        .get_mut()
                        .unwrap_or_else(|e| e.into_inner());
                    for p in index.pools {
                        let place = (p.cluster_id, p.pool, p.namespace);
                        seen.insert(place.clone());
                        volumes.insert(place, p.volumes);
                    }
                }
                Err(e) => tracing::warn!(path = %path.display(), error = %e,
                    "the pool index is unreadable; starting a new one"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %path.display(), error = %e,
                "the pool index cannot be read; starting a new one"),
        }
        self.pool_index = Some(path);
        self
    }

    /// Takes credentials for the calls that carry none (ListVolumes,
    /// ControllerListVolumeHealth, GetCapacity) from `dir`, a mounted
    /// Secret, before those an earlier call brought (see
    /// [`CredentialsDir`]).
    pub fn with_credentials_dir(mut self, dir: PathBuf) -> Driver {
        self.credentials_dir = Some(dir);
        self
    }

    /// Whether this server has credentials for `cluster_id` of its own
    /// (`--credentials-dir`) or from an earlier call; an error when
    /// `--credentials-dir` holds half a pair for it.
    pub fn has_credentials(&self, cluster_id: &str) -> Result<bool, Status> {
        Ok(self.standing_credentials(cluster_id)?.is_some()
            || self
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(cluster_id))
    }

    fn standing_credentials(&self, cluster_id: &str) -> Result<Option<Credentials>, Status> {
        match &self.credentials_dir {
            Some(dir) => CredentialsDir(dir.clone()).for_cluster(cluster_id),
            None => Ok(None),
        }
    }

    /// Reads the KMS config of encrypted volumes from `path`.
    pub fn with_kms_config(mut self, path: std::path::PathBuf) -> Driver {
        self.kms_config = path;
        self
    }

    /// Reads Kubernetes objects (the Vault KMS's tenant kinds) through
    /// `path` instead of the pod's service account.
    pub fn with_kubeconfig(mut self, path: Option<std::path::PathBuf>) -> Driver {
        self.kubeconfig = path;
        self
    }

    /// The KMS config, read now.
    pub fn kms(&self) -> Result<crate::volume::kms::KmsConfig, Status> {
        crate::volume::kms::KmsConfig::load(&self.kms_config).map_err(|e| status_of(&e))
    }

    /// The KMS keys for encrypted volumes of KMS `kms_id` from a request's
    /// `secrets`, and, for a Vault KMS, the passphrase `given` fetched from
    /// it ([`Driver::key_store`]): INVALID_ARGUMENT naming the KMS and what
    /// is missing.
    pub fn kms_keys(
        &self,
        kms_id: &str,
        secrets: &HashMap<String, String>,
        given: Option<Secret>,
    ) -> Result<crate::volume::kms::Keys, Status> {
        use crate::volume::kms;
        let kind = self.kms()?.kind(kms_id).map_err(|e| status_of(&e))?;
        let passphrase = secrets
            .get(kms::PASSPHRASE_KEY)
            .map(|p| crate::rados::Secret::from(p.as_str()));
        kms::keys_for(kms_id, kind, passphrase, given).map_err(|e| status_of(&e))
    }

    /// The Vault key store of KMS `kms_id` for a request of `tenant` (the
    /// claim's namespace) with `secrets`, or `None` when `kms_id` is not a
    /// Vault KMS. The tenant kinds (`vaulttokens`, `vaulttenantsa`) read the
    /// tenant's Secrets, ConfigMap or service account through the API server
    /// (--kubeconfig, else the pod's service account); `vault` needs none.
    pub async fn key_store(
        &self,
        kms_id: &str,
        tenant: Option<&str>,
        secrets: &HashMap<String, String>,
    ) -> Result<Option<crate::volume::kms::keystore::KeyStore>, Status> {
        use crate::volume::kms::vault::{KmsContext, VaultKind};
        let Some(vault) = self.kms()?.vault(kms_id).map_err(|e| status_of(&e))? else {
            return Ok(None);
        };
        let kube = if vault.kind() == VaultKind::Vault {
            None
        } else {
            let client = self
                .kube
                .get_or_try_init(|| crate::k8s::client::client(self.kubeconfig.as_deref()))
                .await
                .map_err(|e| {
                    Status::failed_precondition(format!(
                        "KMS {kms_id:?} is a {} KMS, which reads the tenant's Kubernetes objects, \
                         and this driver cannot reach the API server (give --kubeconfig, or run \
                         it in a pod with a service account): {e:#}",
                        vault.kind()
                    ))
                })?;
            Some(client.clone())
        };
        let ctx = KmsContext {
            kube,
            tenant: tenant.map(str::to_owned),
            secrets: secrets
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            csi_namespace: Some(crate::k8s::client::own_namespace()),
        };
        Ok(Some(crate::volume::kms::keystore::KeyStore::new(
            vault, ctx,
        )))
    }

    /// Whether KMS `kms_id` keeps its keys itself (Vault), by `config`.
    fn keeps_keys(config: &crate::volume::kms::KmsConfig, kms_id: &str) -> bool {
        matches!(config.kind(kms_id), Ok(crate::volume::kms::KmsKind::Vault))
    }

    /// The keys of a new encrypted volume `vol` of class encryption `e`:
    /// for a Vault KMS, its passphrase is stored under its handle first (a
    /// new one, or for a clone or restore the parent's), and a retry finds
    /// the one stored. `parent` is the image cloned from, `tenant` the
    /// claim's namespace.
    pub async fn new_encryption(
        &self,
        conn: &Conn,
        e: &crate::volume::encryption::EncryptionParams,
        vol: &VolumeId,
        parent: Option<VolumeId>,
        tenant: Option<&str>,
        secrets: &HashMap<String, String>,
    ) -> Result<crate::volume::encryption::NewEncryption, Status> {
        use crate::volume::encryption;
        let given = match self.key_store(&e.kms_id, tenant, secrets).await? {
            None => None,
            Some(store) => {
                let record = match parent {
                    None => None,
                    Some(p) => {
                        let ph = p.handle();
                        Some(
                            self.ceph(conn, move |c, _m| {
                                Ok(encryption::read_key_record(c, &p, &ph)?)
                            })
                            .await
                            .map_err(|e| volume_status(&e))?,
                        )
                    }
                };
                let got = store.ensure_for(&vol.handle(), record).await;
                Some(got.map_err(|e| status_of(&e))?)
            }
        };
        Ok(encryption::NewEncryption {
            params: e.clone(),
            keys: self.kms_keys(&e.kms_id, secrets, given)?,
        })
    }

    /// After a snapshot image `image` (snapshot handle `handle`) is made: if
    /// its source is encrypted with a Vault KMS, the source's passphrase is
    /// stored under the snapshot's handle and the image records it, so the
    /// snapshot outlives its source (as in ceph-csi).
    pub async fn snapshot_key(
        &self,
        conn: &Conn,
        image: &VolumeId,
        handle: &str,
        secrets: &HashMap<String, String>,
    ) -> Result<(), Status> {
        use crate::volume::encryption;
        let (img, h) = (image.clone(), handle.to_owned());
        let rec = self
            .ceph(conn, move |c, _m| {
                Ok(encryption::read_key_record(c, &img, &h)?)
            })
            .await
            .map_err(|e| volume_status(&e))?;
        let Some(mut rec) = rec.filter(|r| r.state.encrypted() && r.key_id != handle) else {
            return Ok(());
        };
        if rec.tenant.is_none() {
            // The source's tenant (the claim's namespace), as in ceph-csi.
            let src = crate::volume::VolumeId::parse(&rec.key_id).ok();
            if let Some(src) = src {
                let h = rec.key_id.clone();
                rec.tenant = self
                    .ceph(conn, move |c, _m| {
                        Ok(encryption::read_key_record(c, &src, &h)?)
                    })
                    .await
                    .map_err(|e| volume_status(&e))?
                    .and_then(|r| r.tenant);
            }
        }
        let Some(store) = self
            .key_store(&rec.kms_id, rec.tenant.as_deref(), secrets)
            .await?
        else {
            return Ok(());
        };
        store
            .ensure_copy(&rec.key_id, handle)
            .await
            .map_err(|e| status_of(&e))?;
        let (img, h, t) = (image.clone(), handle.to_owned(), rec.tenant);
        self.ceph(conn, move |c, _m| {
            Ok(encryption::record_key_id(c, &img, &h, t.as_deref())?)
        })
        .await
        .map_err(|e| volume_status(&e))
    }

    /// Runs `remove` (which removes the image `image` of volume or snapshot
    /// `handle`) with the image's Vault key noted first, then removes that
    /// key from Vault and clears the note. A retry after the image is gone
    /// still finds the note (rbdkit gc reports one a crash left).
    #[allow(clippy::too_many_arguments)]
    pub async fn remove_with_key<T: Send + 'static>(
        &self,
        busy: &InFlight,
        conn: &Conn,
        image: &VolumeId,
        handle: &str,
        snapshot: bool,
        secrets: &HashMap<String, String>,
        remove: impl FnOnce(&Cluster, &dyn CephObserver) -> Result<T, VolumeError> + Send + 'static,
    ) -> Result<T, Status> {
        use crate::volume::encryption;
        let config = self.kms_config.clone();
        let (img, h, provisioner) = (image.clone(), handle.to_owned(), self.name.clone());
        let (done, noted) = self
            .ceph_holding(busy, conn, move |c, m| {
                encryption::note_key_before_remove(c, &img, &h, snapshot, &provisioner, &|k| {
                    let config = crate::volume::kms::KmsConfig::load(&config)?;
                    Ok(Driver::keeps_keys(&config, k))
                })?;
                let done = remove(c, m)?;
                Ok((done, encryption::keys_to_remove(c, &img, Some(&h))?))
            })
            .await
            .map_err(|e| volume_status(&e))?;
        for (h, key) in noted {
            if let Some(store) = self
                .key_store(&key.kms, key.tenant.as_deref(), secrets)
                .await?
            {
                store.delete(&key.key).await.map_err(|e| status_of(&e))?;
            }
            let img = image.clone();
            self.ceph(conn, move |c, _m| {
                Ok(encryption::forget_key_to_remove(c, &img, &h)?)
            })
            .await
            .map_err(|e| volume_status(&e))?;
        }
        Ok(done)
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
            None => match self.standing_credentials(cluster_id)? {
                Some(c) => c,
                None => self
                    .known
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(cluster_id)
                    .cloned()
                    .ok_or_else(|| {
                        Status::invalid_argument(format!(
                            "the request carries no secrets ({USER_ID}, {USER_KEY}) for cluster \
                             {cluster_id:?}, and this server has none of its own for it \
                             (--credentials-dir)"
                        ))
                    })?,
            },
        };
        self.connect_with(cluster_id, creds).await
    }

    /// A connection to `cluster_id` as `user`, with the credentials an
    /// earlier call brought for that user, or (node mode) those kept in the
    /// kernel's user keyring by an earlier instance; `None` when there are
    /// none.
    pub async fn connect_as(&self, cluster_id: &str, user: &str) -> Result<Option<Conn>, Status> {
        let mut creds = self
            .known_users
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(cluster_id.to_owned(), user.to_owned()))
            .cloned();
        if creds.is_none() && self.keep_keys {
            let scope = self.key_scope(cluster_id);
            let u = user.to_owned();
            let kept =
                tokio::task::spawn_blocking(move || crate::node::keyring::kept_key(&scope, &u))
                    .await
                    .map_err(|e| Status::internal(format!("keyring lookup failed: {e}")))?;
            match kept {
                Ok(Some(key)) => {
                    creds = Some(Credentials {
                        user: user.to_owned(),
                        key,
                    })
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(cluster = %cluster_id, user = %user, error = %e,
                    "cannot read the credentials kept in the kernel keyring"),
            }
        }
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
        let fresh = self
            .known_users
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((cluster_id.to_owned(), creds.user.clone()), creds.clone())
            .is_none_or(|old| old.key.expose() != creds.key.expose());
        if fresh && self.keep_keys {
            let (scope, c) = (self.key_scope(cluster_id), creds.clone());
            // One blocking call: the keyring steps run on one thread.
            let kept = tokio::task::spawn_blocking(move || {
                crate::node::keyring::keep_key(&scope, &c.user, &c.key)
            })
            .await;
            if let Ok(Err(e)) = kept {
                tracing::warn!(cluster = %cluster_id, user = %creds.user, error = %e,
                    "cannot keep the credentials in the kernel keyring; after a restart, a release waits for a call that brings them");
            }
        }
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

    /// Records the volumes (handles) a scan of `pool` found, in the pool
    /// index too when there is one.
    pub fn scanned(&self, pool: &(String, String, String), handles: Vec<String>) {
        let mut volumes = self.pool_volumes.lock().unwrap_or_else(|e| e.into_inner());
        if volumes.get(pool) == Some(&handles) {
            return;
        }
        volumes.insert(pool.clone(), handles);
        self.pools_seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pool.clone());
        if let Some(path) = &self.pool_index {
            let index = PoolIndex {
                pools: volumes
                    .iter()
                    .map(|((c, p, ns), v)| IndexedPool {
                        cluster_id: c.clone(),
                        pool: p.clone(),
                        namespace: ns.clone(),
                        volumes: v.clone(),
                    })
                    .collect(),
            };
            // Written under the lock, so two scans cannot interleave.
            if let Err(e) = write_atomically(path, &index) {
                tracing::warn!(path = %path.display(), error = %e,
                    "the pool index cannot be written; a restart will not know this pool's volumes");
            }
        }
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

/// What [`Driver::with_pool_index`] keeps: no secret, only where volumes
/// were and which.
#[derive(serde::Serialize, serde::Deserialize)]
struct PoolIndex {
    pools: Vec<IndexedPool>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct IndexedPool {
    cluster_id: String,
    pool: String,
    namespace: String,
    volumes: Vec<String>,
}

fn write_atomically(path: &Path, index: &PoolIndex) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let bytes = serde_json::to_vec(index).map_err(std::io::Error::other)?;
    {
        let mut f = std::fs::File::create(&tmp)?;
        std::io::Write::write_all(&mut f, &bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

/// Credentials a server holds itself, for the calls that carry no secrets:
/// a directory, usually a mounted Secret, with the keys of ceph-csi's
/// Secrets as file names. `<clusterID>.userID` and `<clusterID>.userKey`
/// are one cluster's; `userID` and `userKey` serve every other cluster.
/// The files are read at each use, so a rotated Secret is picked up; the
/// key is held only in a [`Secret`].
#[derive(Debug, Clone)]
pub struct CredentialsDir(pub PathBuf);

impl CredentialsDir {
    /// The credentials for `cluster_id`: its own pair, else the shared
    /// one, else `None`. One file of a pair without the other, or an empty
    /// or unreadable one, is an error naming the file (never its content).
    pub fn for_cluster(&self, cluster_id: &str) -> Result<Option<Credentials>, Status> {
        // A cluster id is a file name here only if it cannot climb out.
        let own =
            !cluster_id.is_empty() && !cluster_id.contains('/') && !cluster_id.starts_with('.');
        if own {
            if let Some(c) = self.pair(
                &format!("{cluster_id}.{USER_ID}"),
                &format!("{cluster_id}.{USER_KEY}"),
            )? {
                return Ok(Some(c));
            }
        }
        self.pair(USER_ID, USER_KEY)
    }

    fn pair(&self, user_file: &str, key_file: &str) -> Result<Option<Credentials>, Status> {
        let user = self.read(user_file)?;
        let key = self.read(key_file)?;
        match (user, key) {
            (None, None) => Ok(None),
            (Some(user), Some(key)) => Ok(Some(Credentials {
                user,
                key: Secret::new(key),
            })),
            (Some(_), None) => Err(self.incomplete(key_file)),
            (None, Some(_)) => Err(self.incomplete(user_file)),
        }
    }

    fn incomplete(&self, missing: &str) -> Status {
        Status::failed_precondition(format!(
            "--credentials-dir {}: {missing} is missing (its pair is there)",
            self.0.display()
        ))
    }

    fn read(&self, name: &str) -> Result<Option<String>, Status> {
        let path = self.0.join(name);
        match std::fs::read_to_string(&path) {
            Ok(s) if s.trim().is_empty() => Err(Status::failed_precondition(format!(
                "--credentials-dir: {} is empty",
                path.display()
            ))),
            Ok(s) => Ok(Some(s.trim().to_owned())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Status::failed_precondition(format!(
                "--credentials-dir: {} cannot be read: {}",
                path.display(),
                e.kind()
            ))),
        }
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

#[cfg(test)]
mod credentials_dir_tests {
    use super::*;

    #[test]
    fn a_clusters_own_pair_first_then_the_shared_one_and_half_a_pair_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let creds = CredentialsDir(dir.path().to_owned());
        assert!(creds.for_cluster("c1").unwrap().is_none());
        let write = |name: &str, v: &str| std::fs::write(dir.path().join(name), v).unwrap();
        write("userID", "shared\n");
        write("userKey", "AQBsharedkey==\n");
        write("c1.userID", "own");
        write("c1.userKey", "AQBownkey==");
        assert_eq!(creds.for_cluster("c1").unwrap().unwrap().user, "own");
        assert_eq!(creds.for_cluster("c2").unwrap().unwrap().user, "shared");
        // A cluster id that would climb out of the directory gets the
        // shared pair.
        assert_eq!(creds.for_cluster("../c1").unwrap().unwrap().user, "shared");
        std::fs::remove_file(dir.path().join("c1.userKey")).unwrap();
        let e = creds.for_cluster("c1").unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.message().contains("c1.userKey is missing"), "{e}");
        write("c1.userKey", " \n");
        let e = creds.for_cluster("c1").unwrap_err();
        assert!(e.message().contains("c1.userKey is empty"), "{e}");
        std::fs::write(dir.path().join("userKey"), "AQBsecretvalue==").unwrap();
        std::fs::remove_file(dir.path().join("userID")).unwrap();
        let e = creds.for_cluster("c2").unwrap_err();
        assert!(e.message().contains("userID is missing"), "{e}");
        assert!(!e.message().contains("AQB"), "{e}");
    }
}
