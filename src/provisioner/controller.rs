//! The reconcilers: claims (provision, expand, clean up after a claim
//! deleted mid-provision) and volumes (delete, release our finalizer).
//!
//! Each returns an [`Action`]; failures go through the error policies, which
//! requeue with per-object capped exponential backoff. Nothing is ever given
//! up on. A reconcile takes a token from the global rate limiter at its
//! first API write or Ceph call ([`before_work`]), so the reconciles our own
//! writes trigger, which find nothing to do, cost none (see
//! [`crate::k8s::backoff`]).
//!
//! Crash safety on the claim side rests on two things written to the API
//! server *before* any image exists: a finalizer on the claim and an
//! annotation recording where its image goes. A claim deleted while being
//! provisioned therefore cannot vanish until its image is cleaned up, even
//! across restarts, and the image name derives from the claim's uid, so a
//! retry finds the image a previous attempt made.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::blocking::BlockingPool;
use crate::k8s::backoff::{before_work, FailureCounts, RateLimiter};
use crate::k8s::compact::{Compact, PvDigest};
use crate::k8s::events::Events;
use crate::provisioner::metrics::Metrics;
use crate::provisioner::modify::NewVolume;
use crate::provisioner::pv::{
    build_pv, claim_access_modes, claim_volume_mode, deletion_secret, expand_secret, our_volume,
    pv_name_for, PvInput, PV_FINALIZER,
};
use crate::provisioner::secrets;
use crate::provisioner::source::{self, Source, Unresolved};
use crate::rados::Cluster;
use crate::volume::clusters::{ClustersFile, Conn, Connections};
use crate::volume::legacy;
use crate::volume::ops::{self, Deleted, Owner, VolumeError};
use crate::volume::params::{check_access, ClassParams, SecretRef, TemplateContext};
use crate::volume::qos;
use crate::volume::quantity::{bytes_quantity, parse_bytes, parse_whole_bytes, round_up_mib, MIB};
use crate::volume::snapshot::{self as snap, CloneOptions, Flatten};
use crate::volume::topology as vtopo;
use crate::volume::{Fence, VolumeId};

/// Finalizer on a claim while its image may exist without a PV.
pub const CLAIM_FINALIZER: &str = "rbdkit.io/provisioning-protection";
/// Claim annotation: the volume handle of the image being provisioned.
pub const CLAIM_VOLUME_ANNOTATION: &str = "rbdkit.io/provisioning-volume";
/// Claim annotation: `namespace/name` of the Secret to clean up with.
pub const CLAIM_SECRET_ANNOTATION: &str = "rbdkit.io/provisioning-secret";
/// Set by the PV binder on claims an external provisioner must handle.
pub const ANN_STORAGE_PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";
/// The older (beta) form of [`ANN_STORAGE_PROVISIONER`].
pub const ANN_STORAGE_PROVISIONER_BETA: &str = "volume.beta.kubernetes.io/storage-provisioner";
/// Set by the scheduler on WaitForFirstConsumer claims.
pub const ANN_SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// PV annotation: its clone is past the soft depth limit and is to be
/// flattened in the background (removed once done).
pub const PV_FLATTEN_ANNOTATION: &str = "rbdkit.io/flatten-pending";

/// The default of `--mirror-op-timeout`.
pub const DEFAULT_MIRROR_OP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// A claim as the claim cache keeps it.
pub type CachedClaim = Compact<PersistentVolumeClaim>;
/// A PV as the PV cache keeps it.
pub type CachedPv = Compact<PersistentVolume>;

/// A failed reconcile; the message has already been reported (event, log).
#[derive(Debug)]
pub struct ReconcileError(pub String);

impl fmt::Display for ReconcileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ReconcileError {}

impl From<kube::Error> for ReconcileError {
    fn from(e: kube::Error) -> Self {
        ReconcileError(format!("Kubernetes API: {e}"))
    }
}

/// What the reconcilers share.
pub struct Context {
    /// The API client.
    pub client: kube::Client,
    /// The provisioner name.
    pub name: String,
    /// The clusters config.
    pub clusters: Arc<ClustersFile>,
    /// The Ceph connection cache.
    pub conns: Arc<Connections>,
    /// Where blocking Ceph calls run.
    pub pool: BlockingPool,
    /// The event publisher.
    pub events: Events,
    /// The metrics.
    pub metrics: Metrics,
    /// Consecutive failures per claim.
    pub claim_failures: FailureCounts<String>,
    /// Consecutive failures per PV.
    pub pv_failures: FailureCounts<String>,
    /// The global rate limit.
    pub limiter: Arc<RateLimiter>,
    /// Asked before every destructive Ceph step: the leader lease.
    pub fence: Arc<dyn Fence>,
    /// When work on an object started, for the duration metrics.
    started: Mutex<HashMap<String, Instant>>,
    /// The legacy provisioners whose PVs are deleted and expanded until
    /// they are migrated (`--adopt-legacy`).
    pub adopt: BTreeSet<legacy::Kind>,
    /// The Secret legacy volumes are deleted and expanded with.
    pub legacy_secret: Option<SecretRef>,
    /// The KMS config file (read at each encrypted create).
    pub kms_config: std::path::PathBuf,
    /// Claims' reclaim space schedule annotations are synced to
    /// ReclaimSpaceCronJobs (`--reclaim-space`).
    pub reclaim_space: bool,
    /// Bound on one mirror promote or demote (`--mirror-op-timeout`).
    pub mirror_op_timeout: std::time::Duration,
    /// PVs (by uid) whose volume this process deleted, so that the echo of
    /// letting go of one (our finalizer removed, the PV still Released) is
    /// not a second delete. Lost on restart, which only costs that echo.
    deleted: Mutex<HashMap<String, Instant>>,
    /// The volume controller's PV cache while leading (set by
    /// [`Context::set_pv_cache`]), so provisioning need not GET a PV it
    /// expects not to exist.
    pv_cache: Mutex<Option<Store<CachedPv>>>,
    /// The StorageClass watch's cache while leading, so a claim of one of
    /// our classes can be taken before the binder hands it over.
    class_cache: Mutex<Option<Store<StorageClass>>>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context").field("name", &self.name).finish()
    }
}

impl Context {
    /// Builds the shared context.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: kube::Client,
        name: String,
        clusters: Arc<ClustersFile>,
        conns: Arc<Connections>,
        pool: BlockingPool,
        events: Events,
        metrics: Metrics,
        backoff: crate::k8s::backoff::Backoff,
        limiter: Arc<RateLimiter>,
        fence: Arc<dyn Fence>,
    ) -> Context {
        Context {
            client,
            name,
            clusters,
            conns,
            pool,
            events,
            metrics,
            claim_failures: FailureCounts::new(backoff),
            pv_failures: FailureCounts::new(backoff),
            limiter,
            fence,
            started: Mutex::new(HashMap::new()),
            adopt: BTreeSet::new(),
            legacy_secret: None,
            kms_config: crate::volume::kms::DEFAULT_CONFIG_PATH.into(),
            reclaim_space: false,
            mirror_op_timeout: DEFAULT_MIRROR_OP_TIMEOUT,
            deleted: Mutex::new(HashMap::new()),
            pv_cache: Mutex::new(None),
            class_cache: Mutex::new(None),
        }
    }

    /// Reads the KMS config for encrypted volumes from `path`.
    pub fn with_kms_config(mut self, path: std::path::PathBuf) -> Self {
        self.kms_config = path;
        self
    }

    /// Syncs claims' reclaim space schedule annotations to
    /// ReclaimSpaceCronJobs (`--reclaim-space`).
    pub fn with_reclaim_space(mut self, on: bool) -> Self {
        self.reclaim_space = on;
        self
    }

    /// Bounds each mirror promote or demote by `timeout`.
    pub fn with_mirror_op_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.mirror_op_timeout = timeout;
        self
    }

    /// Deletes and expands the unmigrated PVs of `adopt`'s provisioners,
    /// with the credentials in `secret`.
    pub fn with_legacy(mut self, adopt: BTreeSet<legacy::Kind>, secret: Option<SecretRef>) -> Self {
        self.adopt = adopt;
        self.legacy_secret = secret;
        self
    }

    /// The volume of a legacy PV this provisioner adopts, if it is one.
    fn legacy_volume(&self, pv: &PersistentVolume) -> Option<Result<VolumeId, String>> {
        legacy::adoptable(pv, &self.adopt, &self.clusters.config())
            .map(|r| r.map(|(_, vol)| vol).map_err(|e| e.to_string()))
    }

    /// Writes rbdkit's owner record onto a legacy PV's image (refusing an
    /// image another rbdkit owns), so the usual checked delete and expand
    /// accept it. A no-op for rbdkit's own PVs.
    pub(crate) async fn adopt_legacy(
        &self,
        conn: &Conn,
        pv: &PersistentVolume,
        vol: &VolumeId,
    ) -> Result<(), String> {
        if our_volume(pv, &self.name).is_some() {
            return Ok(());
        }
        let claim = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
        let owner = Owner {
            provisioner: self.name.clone(),
            pv_name: pv.name_any(),
            pvc_namespace: claim.and_then(|c| c.namespace.clone()).unwrap_or_default(),
            pvc_name: claim.and_then(|c| c.name.clone()).unwrap_or_default(),
            cluster_id: vol.cluster_id.clone(),
        };
        let v = vol.clone();
        self.ceph(conn, move |c, m, f| {
            legacy::adopt_image(c, m, f, &v, &owner)
        })
        .await
        .map(|_| ())
        .map_err(|e| format!("cannot adopt legacy image {vol}: {e}"))
    }

    /// Uses `store` (the PV watch's cache, once it is ready) to look up PVs
    /// by name instead of a GET.
    pub fn set_pv_cache(&self, store: Option<Store<CachedPv>>) {
        *self.pv_cache.lock().unwrap_or_else(|e| e.into_inner()) = store;
    }

    /// The volume of a PV the reconcilers act on: ours, or a legacy PV we
    /// adopt; `None` for any other. Depends only on the PV
    /// (`--adopt-legacy` is fixed for the life of the process).
    fn volume_of(&self, pv: &PersistentVolume) -> Option<Result<VolumeId, String>> {
        our_volume(pv, &self.name).or_else(|| self.legacy_volume(pv))
    }

    /// Whether the PV cache holds `name` stripped: a PV no reconciler acts
    /// on.
    fn foreign_pv(&self, name: &str) -> bool {
        synced(&self.pv_cache)
            .and_then(|s| s.get(&ObjectRef::new(name)))
            .is_some_and(|pv| pv.is_stripped())
    }

    /// Strips a PV the volume reconciler would not act on before the cache
    /// keeps it: another provisioner's PV is its identity and digest only
    /// (the binder check reads no more), about 1 kB less each.
    pub fn strip_foreign_pv(&self, pv: &mut CachedPv) {
        if let Some(Ok(full)) = pv.decode() {
            if self.volume_of(&full).is_none() {
                pv.strip();
            }
        }
    }

    /// Strips a claim that no reconcile can act on: not handed to us, no
    /// finalizer of ours, and bound to a PV the cache holds stripped
    /// ([`Context::strip_foreign_pv`]); for such a claim the claim reconcile
    /// would only look at that PV and stop.
    pub fn strip_foreign_claim(&self, claim: &mut CachedClaim) {
        let Some(volume) = claim.digest().volume.as_deref() else {
            return;
        };
        if !self.foreign_pv(volume) {
            return;
        }
        if let Some(Ok(full)) = claim.decode() {
            if !handed_to(&full, &self.name) {
                claim.strip();
            }
        }
    }

    /// Uses `store` (the StorageClass watch's cache) to tell which claims
    /// may be taken before the binder hands them over.
    pub fn set_class_cache(&self, store: Option<Store<StorageClass>>) {
        *self.class_cache.lock().unwrap_or_else(|e| e.into_inner()) = store;
    }

    /// Every PV in the watch cache, once it has synced.
    pub fn cached_pvs(&self) -> Option<Vec<Arc<CachedPv>>> {
        synced(&self.pv_cache).map(|s| s.state())
    }

    /// Whether a claim not handed over yet (no storage-provisioner
    /// annotation) may be provisioned now. kube-controller-manager's binder
    /// writes that annotation once it has found no PV to bind the claim to,
    /// one claim at a time at its client QPS (20 a second), and that set the
    /// pace of a burst. A PV pre-bound to the claim is bound without it. So
    /// when the class is ours and no PV the binder could choose exists, the
    /// answer is the binder's own; anything else waits for the binder.
    fn may_take_early(&self, claim: &PersistentVolumeClaim) -> bool {
        let Some(spec) = claim.spec.as_ref() else {
            return false;
        };
        let annotations = claim.annotations();
        if spec.selector.is_some()
            || annotations.contains_key(ANN_STORAGE_PROVISIONER)
            || annotations.contains_key(ANN_STORAGE_PROVISIONER_BETA)
        {
            return false;
        }
        let Some(class) = spec.storage_class_name.as_deref().filter(|c| !c.is_empty()) else {
            return false;
        };
        let (Some(classes), Some(pvs)) = (synced(&self.class_cache), synced(&self.pv_cache)) else {
            return false;
        };
        if classes
            .get(&ObjectRef::new(class))
            .is_none_or(|c| c.provisioner != self.name)
        {
            return false;
        }
        let own = pv_name_for(claim);
        let namespace = claim.namespace().unwrap_or_default();
        let name = claim.name_any();
        !pvs.state().iter().any(|pv| {
            could_be_bound_to(
                pv.meta(),
                pv.digest(),
                class,
                &namespace,
                &name,
                own.as_deref(),
            )
        })
    }

    /// The PV named `name`: from the cache when it is set and synced, else
    /// from the API server. A PV created after the cache last heard is
    /// missed, which the PV create's conflict answer then catches; with
    /// `fresh`, a miss is asked of the API server too (for a claim an
    /// earlier attempt worked on, whose PV may be newer than the cache).
    async fn pv_lookup(
        &self,
        name: &str,
        fresh: bool,
    ) -> Result<Option<PersistentVolume>, kube::Error> {
        let cached = synced(&self.pv_cache);
        match cached.as_ref().map(|s| s.get(&ObjectRef::new(name))) {
            // A stripped entry (another provisioner's PV) is asked for.
            Some(Some(pv)) => {
                if let Some(pv) = decode(&pv)? {
                    return Ok(Some(pv));
                }
            }
            Some(None) if !fresh => return Ok(None),
            _ => {}
        }
        Api::<PersistentVolume>::all(self.client.clone())
            .get_opt(name)
            .await
    }

    fn first_attempt(&self, key: &str) -> Instant {
        let mut started = self.started.lock().unwrap_or_else(|e| e.into_inner());
        if started.len() > 4096 {
            // Objects deleted while failing never finish: forget old ones.
            started.retain(|_, t| t.elapsed() < std::time::Duration::from_secs(86400));
        }
        *started.entry(key.to_owned()).or_insert_with(Instant::now)
    }

    fn mark_deleted(&self, uid: &str) {
        let mut d = self.deleted.lock().unwrap_or_else(|e| e.into_inner());
        if d.len() > 4096 {
            d.retain(|_, t| t.elapsed() < std::time::Duration::from_secs(600));
        }
        d.insert(uid.to_owned(), Instant::now());
    }

    fn was_deleted(&self, uid: &str) -> bool {
        self.deleted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(uid)
    }

    fn finished(&self, key: &str) -> Option<Instant> {
        self.started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key)
    }

    /// Runs a blocking volume operation on the pool with `conn`'s cluster,
    /// and flags the connection for rebuilding if the error says so.
    pub(crate) async fn ceph<T: Send + 'static>(
        &self,
        conn: &Conn,
        f: impl FnOnce(&Cluster, &Metrics, &dyn Fence) -> Result<T, VolumeError> + Send + 'static,
    ) -> Result<T, VolumeError> {
        let cluster = conn.cluster().clone();
        let metrics = self.metrics.clone();
        let fence = Arc::clone(&self.fence);
        before_work().await;
        let out = match self
            .pool
            .run(move || Ok(f(&cluster, &metrics, &*fence)))
            .await
        {
            Ok(inner) => inner,
            Err(e) => Err(VolumeError::Ceph(e)),
        };
        match &out {
            Err(VolumeError::Ceph(e)) => conn.check(e),
            // Any other outcome was an answer from the cluster.
            _ => conn.answered(),
        }
        out
    }

    pub(crate) async fn connect(
        &self,
        cluster_id: &str,
        secret: &SecretRef,
    ) -> Result<Conn, String> {
        let cluster = self
            .clusters
            .get(cluster_id)
            .ok_or_else(|| format!("clusterID {cluster_id:?} is not in the clusters config"))?;
        before_work().await;
        let creds = secrets::credentials(&self.client, secret).await?;
        self.conns.get(&cluster, &creds).await.map_err(|e| {
            format!(
                "cannot connect to Ceph cluster {cluster_id:?} as {:?}: {e}",
                creds.user
            )
        })
    }
}

/// The store in `slot`, if it is set and its first list is in.
fn synced<K: kube::Resource + Clone>(slot: &Mutex<Option<Store<K>>>) -> Option<Store<K>>
where
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    slot.lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .filter(|s| {
            matches!(
                futures::FutureExt::now_or_never(s.wait_until_ready()),
                Some(Ok(()))
            )
        })
}

/// Whether the binder could bind claim `namespace/name` of `class` to the PV
/// with metadata `meta` and digest `pv` rather than have it provisioned: a
/// PV of that class that is free, or pre-bound to the claim and not the one
/// we would make (`own`).
pub(crate) fn could_be_bound_to(
    meta: &kube::api::ObjectMeta,
    pv: &PvDigest,
    class: &str,
    namespace: &str,
    name: &str,
    own: Option<&str>,
) -> bool {
    if pv.class.as_deref() != Some(class) || meta.name.as_deref() == own {
        return false;
    }
    if matches!(pv.phase.as_deref(), Some("Released" | "Failed"))
        || meta.deletion_timestamp.is_some()
    {
        return false;
    }
    match &pv.claim {
        None => true,
        Some((ns, n)) => &**ns == namespace && &**n == name,
    }
}

/// Whether `claim` was handed to `provisioner` (its storage-provisioner
/// annotation) or carries our finalizer: a claim our reconcile may act on
/// whatever its PV.
fn handed_to(claim: &PersistentVolumeClaim, provisioner: &str) -> bool {
    for_provisioner(claim, provisioner) || claim.finalizers().iter().any(|f| f == CLAIM_FINALIZER)
}

/// Whether `claim`'s storage-provisioner annotation (either form) names
/// `provisioner`.
pub(crate) fn for_provisioner(claim: &PersistentVolumeClaim, provisioner: &str) -> bool {
    let annotations = claim.annotations();
    [ANN_STORAGE_PROVISIONER, ANN_STORAGE_PROVISIONER_BETA]
        .iter()
        .any(|k| annotations.get(*k).map(String::as_str) == Some(provisioner))
}

/// The object a cache entry holds, decoded; `None` if it was stripped.
fn decode<K>(c: &Compact<K>) -> Result<Option<K>, kube::Error>
where
    K: crate::k8s::compact::Digest + serde::Serialize + serde::de::DeserializeOwned + Resource,
{
    c.decode().transpose().map_err(kube::Error::SerdeError)
}

fn claim_key(claim: &impl Resource) -> String {
    format!(
        "{}/{}",
        claim.namespace().unwrap_or_default(),
        claim.name_any()
    )
}

fn claim_ref(claim: &PersistentVolumeClaim) -> ObjectReference {
    claim.object_ref(&())
}

fn storage_request(claim: &PersistentVolumeClaim) -> Result<u64, String> {
    let q = claim
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .ok_or("the claim requests no storage")?;
    let bytes = parse_whole_bytes(&q.0).map_err(|e| format!("the claim's storage request: {e}"))?;
    // The API server clamps any larger request to 2^63 - 1 bytes, and
    // capacities cannot be reported back above that: refuse such sizes
    // rather than make an image that could never be removed in practice.
    if round_up_mib(bytes) > i64::MAX as u64 {
        return Err(format!(
            "the claim's storage request {:?} rounded up to whole MiB is above 2^63 - 1 bytes (the API server turns any larger request into 9223372036854775807)",
            q.0
        ));
    }
    Ok(bytes)
}

fn storage_limit(claim: &PersistentVolumeClaim) -> Option<u64> {
    let q = claim
        .spec
        .as_ref()?
        .resources
        .as_ref()?
        .limits
        .as_ref()?
        .get("storage")?;
    parse_bytes(&q.0).ok()
}

/// A PV's `spec.capacity.storage` in bytes; 0 if it has none or it does
/// not parse.
pub(crate) fn pv_capacity(pv: &PersistentVolume) -> u64 {
    pv.spec
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .and_then(|c| c.get("storage"))
        .and_then(|q| parse_bytes(&q.0).ok())
        .unwrap_or(0)
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

/// Adds or removes `finalizer` and sets or removes annotations, on the
/// latest version of the object, guarded by its resourceVersion. A missing
/// object is not an error. Returns false when the finalizer was to be added
/// but could not be: the object is gone or being deleted.
pub(crate) async fn edit_meta<K>(
    api: &Api<K>,
    name: &str,
    finalizer: &str,
    present: bool,
    annotations: &BTreeMap<String, Option<String>>,
) -> Result<bool, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + fmt::Debug,
{
    edit_meta_from(api, name, None, finalizer, present, annotations).await
}

/// [`edit_meta`] starting from `cached` (the reconcile's object from the
/// watch cache) instead of a GET: the resourceVersion guard makes a stale
/// copy cost one 409 and then a GET, and a fresh one (the usual case, as the
/// reconcile was woken by its latest change) saves a round trip per write.
pub(crate) async fn edit_meta_from<K>(
    api: &Api<K>,
    name: &str,
    cached: Option<&K>,
    finalizer: &str,
    present: bool,
    annotations: &BTreeMap<String, Option<String>>,
) -> Result<bool, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + fmt::Debug,
{
    let mut attempt = 0;
    let mut cached = cached.filter(|o| o.meta().resource_version.is_some());
    loop {
        attempt += 1;
        let fetched;
        let obj = match cached.take() {
            Some(o) => o,
            None => match api.get_opt(name).await? {
                Some(o) => {
                    fetched = o;
                    &fetched
                }
                None => return Ok(!present),
            },
        };
        let meta = obj.meta();
        let mut finalizers = meta.finalizers.clone().unwrap_or_default();
        let had = finalizers.iter().any(|f| f == finalizer);
        if present && !had {
            finalizers.push(finalizer.to_owned());
        } else if !present {
            finalizers.retain(|f| f != finalizer);
        }
        let current = meta.annotations.clone().unwrap_or_default();
        let ann_changes: serde_json::Map<String, serde_json::Value> = annotations
            .iter()
            .filter(|(k, v)| current.get(*k) != v.as_ref())
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        if had == present && ann_changes.is_empty() {
            return Ok(true);
        }
        if meta.deletion_timestamp.is_some() && present && !had {
            // Finalizers cannot be added to an object being deleted.
            return Ok(false);
        }
        let patch = json!({
            "metadata": {
                "resourceVersion": meta.resource_version,
                "finalizers": finalizers,
                "annotations": ann_changes,
            }
        });
        before_work().await;
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(!present),
            Err(kube::Error::Api(e)) if e.code == 409 && attempt < 5 => continue,
            Err(e) => return Err(e),
        }
    }
}

fn claim_annotations_cleared() -> BTreeMap<String, Option<String>> {
    BTreeMap::from([
        (CLAIM_VOLUME_ANNOTATION.to_owned(), None),
        (CLAIM_SECRET_ANNOTATION.to_owned(), None),
    ])
}

async fn drop_claim_finalizer(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
) -> Result<(), kube::Error> {
    let has = claim.finalizers().iter().any(|f| f == CLAIM_FINALIZER)
        || claim.annotations().contains_key(CLAIM_VOLUME_ANNOTATION);
    if !has {
        return Ok(());
    }
    let api: Api<PersistentVolumeClaim> =
        Api::namespaced(ctx.client.clone(), &claim.namespace().unwrap_or_default());
    edit_meta_from(
        &api,
        &claim.name_any(),
        Some(claim),
        CLAIM_FINALIZER,
        false,
        &claim_annotations_cleared(),
    )
    .await
    .map(drop)
}

// ---------------------------------------------------------------- claims --

/// Reconciles a claim: provisions it, expands it, or cleans up after it.
pub async fn reconcile_claim(
    claim: Arc<CachedClaim>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let claim = match decode(&claim)? {
        Some(c) => c,
        None => {
            let volume = claim.digest().volume.as_deref().unwrap_or_default();
            if ctx.foreign_pv(volume) {
                return Ok(Action::await_change());
            }
            // Its PV changed since the claim was stripped: read it whole.
            let api: Api<PersistentVolumeClaim> =
                Api::namespaced(ctx.client.clone(), &claim.namespace().unwrap_or_default());
            match api.get_opt(&claim.name_any()).await? {
                Some(c) => c,
                None => return Ok(Action::await_change()),
            }
        }
    };
    let mut out = ctx.limiter.scoped(claim_inner(&claim, &ctx)).await;
    let bound = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    if out.is_ok() && ctx.reclaim_space && bound && for_provisioner(&claim, &ctx.name) {
        let sync = crate::provisioner::reclaim::sync_claim_schedule(&ctx, &claim);
        if let Err(e) = ctx.limiter.scoped(sync).await {
            let why = format!("cannot sync the reclaim space schedule: {e}");
            tracing::warn!(claim = %claim_key(&claim), "{why}");
            out = Err(ReconcileError(why));
        }
    }
    if out.is_ok() {
        ctx.claim_failures.succeeded(&claim_key(&claim));
    }
    out
}

/// Requeues a failed claim after its backoff.
pub fn claim_error_policy(
    claim: Arc<CachedClaim>,
    err: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    let key = claim_key(&*claim);
    let delay = ctx.claim_failures.failed(&key);
    tracing::warn!(claim = %key, error = %err, retry_in = ?delay, "claim not done; will retry");
    Action::requeue(delay)
}

async fn claim_inner(
    claim: &PersistentVolumeClaim,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    let for_us = for_provisioner(claim, &ctx.name);
    let has_finalizer = claim.finalizers().iter().any(|f| f == CLAIM_FINALIZER);
    if claim.metadata.deletion_timestamp.is_some() {
        if has_finalizer && for_us {
            return claim_deleted(claim, ctx).await;
        }
        return Ok(Action::await_change());
    }
    let bound_to = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|v| !v.is_empty());
    if let Some(pv_name) = bound_to {
        // Only once the binder is done with the claim (its status written):
        // a write between its claim update and its status update would
        // make it conflict and retry, at its own client QPS.
        let phase = claim.status.as_ref().and_then(|s| s.phase.as_deref());
        if has_finalizer && for_us && phase.is_some_and(|p| p != "Pending") {
            // The end of a provisioning that took its token. Expansion, if
            // asked for, comes with the echo of this write.
            crate::k8s::backoff::prepaid();
            release_source(ctx, claim).await?;
            drop_claim_finalizer(ctx, claim).await?;
            return Ok(Action::await_change());
        }
        if crate::provisioner::modify::needed(claim) {
            return modify(claim, &pv_name, ctx).await;
        }
        return expand(claim, &pv_name, ctx).await;
    }
    if !for_us && !ctx.may_take_early(claim) {
        return Ok(Action::await_change());
    }
    provision(claim, ctx).await
}

/// Why provisioning did not complete: reported as a ProvisioningFailed
/// event, or (`quiet`) only logged.
struct Failure {
    why: String,
    /// Waiting for something not ready yet: the reason of a Normal event
    /// (not a failure).
    wait: Option<&'static str>,
}

impl From<String> for Failure {
    fn from(why: String) -> Self {
        Failure { why, wait: None }
    }
}

impl From<&str> for Failure {
    fn from(why: &str) -> Self {
        why.to_owned().into()
    }
}

impl From<kube::Error> for Failure {
    fn from(e: kube::Error) -> Self {
        format!("Kubernetes API: {e}").into()
    }
}

impl From<crate::volume::params::ParamError> for Failure {
    fn from(e: crate::volume::params::ParamError) -> Self {
        e.to_string().into()
    }
}

impl From<Unresolved> for Failure {
    fn from(u: Unresolved) -> Self {
        match u {
            Unresolved::Wait(why) => Failure {
                why,
                wait: Some("WaitingForDataSource"),
            },
            Unresolved::Refused(why) => why.into(),
        }
    }
}

/// Lets go of the claim's source claim, if it is a clone.
async fn release_source(ctx: &Context, claim: &PersistentVolumeClaim) -> Result<(), kube::Error> {
    let Some(src) = source::source_claim(claim) else {
        return Ok(());
    };
    source::release_source(
        &ctx.client,
        &claim.namespace().unwrap_or_default(),
        &src,
        claim.metadata.uid.as_deref().unwrap_or_default(),
    )
    .await
}

async fn provision(claim: &PersistentVolumeClaim, ctx: &Context) -> Result<Action, ReconcileError> {
    let Some(pv_name) = pv_name_for(claim) else {
        return Ok(Action::await_change());
    };
    let Some(class_name) = claim
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.clone())
        .filter(|c| !c.is_empty())
    else {
        return Ok(Action::await_change());
    };
    let classes: Api<StorageClass> = Api::all(ctx.client.clone());
    let class = match classes.get_opt(&class_name).await? {
        Some(c) => c,
        None => {
            let why = format!("StorageClass {class_name:?} not found");
            ctx.events
                .warning(&claim_ref(claim), "ProvisioningFailed", &why)
                .await;
            return Err(ReconcileError(why));
        }
    };
    if class.provisioner != ctx.name {
        return Ok(Action::await_change());
    }
    if class.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer")
        && !claim.annotations().contains_key(ANN_SELECTED_NODE)
    {
        tracing::debug!(claim = %claim_key(claim), "waiting for a selected node");
        return Ok(Action::await_change());
    }
    let key = claim.metadata.uid.clone().unwrap_or_default();
    // Done by an earlier attempt (the binder has not bound it yet)?
    // Our annotation means an earlier attempt may have made the PV just
    // now, before the PV watch heard of it: a miss would provision twice.
    let earlier = claim.annotations().contains_key(CLAIM_VOLUME_ANNOTATION);
    if let Some(pv) = ctx.pv_lookup(&pv_name, earlier).await? {
        if let Err(f) = check_pv_is_for(&pv, ctx, &key) {
            ctx.events
                .warning(&claim_ref(claim), "ProvisioningFailed", &f.why)
                .await;
            return Err(ReconcileError(f.why));
        }
        release_source(ctx, claim).await?;
        // The finalizer goes once the claim is Bound (above).
        return Ok(Action::await_change());
    }
    let started = ctx.first_attempt(&key);
    match provision_steps(claim, ctx, &class, &pv_name).await {
        Ok(()) => {
            if let Some(t) = ctx.finished(&key) {
                ctx.metrics.provisioned(&class_name, t.elapsed());
                tracing::info!(claim = %claim_key(claim), pv = %pv_name, took = ?started.elapsed(), "provisioned");
            }
            Ok(Action::await_change())
        }
        Err(Failure {
            why,
            wait: Some(reason),
        }) => {
            ctx.events.normal(&claim_ref(claim), reason, &why).await;
            Err(ReconcileError(why))
        }
        Err(f) => {
            ctx.metrics.provision_failed(&class_name);
            ctx.events
                .warning(&claim_ref(claim), "ProvisioningFailed", &f.why)
                .await;
            Err(ReconcileError(f.why))
        }
    }
}

/// What [`place_by_topology`] chose, and from which requirements.
type Chosen = (vtopo::Placement, crate::provisioner::topology::Requirements);

/// The class's parameters with the pool its `topologyConstrainedPools`
/// choose for `claim` (unchanged without them, or without requirements),
/// and the choice. `source_pool`: a clone's source pool, which it shares.
async fn place_by_topology(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    params: &ClassParams,
    source_pool: Option<&str>,
) -> Result<(ClassParams, Option<Chosen>), Failure> {
    if params.topology_pools.is_empty() {
        return Ok((params.clone(), None));
    }
    let reqs =
        crate::provisioner::topology::requirements(&ctx.client, &ctx.name, claim, class).await?;
    let Some(r) = reqs else {
        return Ok((params.clone(), None));
    };
    let chosen = vtopo::choose(
        &params.topology_pools,
        &r.preferred,
        &r.requisite,
        source_pool,
    )?;
    Ok(match chosen {
        Some(p) => (vtopo::placed(params, &p), Some((p, r))),
        None => (params.clone(), None),
    })
}

/// `chosen`, unless an earlier attempt for this claim (another selected
/// node) already made its image, whole or cut short, in another of the
/// class's pools: then that pool, so that a re-run never makes a second
/// image. Refused when the earlier pool is not one of the class's.
async fn keep_earlier_pool(
    ctx: &Context,
    conn: &Conn,
    class_params: &ClassParams,
    vol: &VolumeId,
    pv_name: &str,
    chosen: vtopo::Placement,
    reqs: &crate::provisioner::topology::Requirements,
) -> Result<vtopo::Placement, Failure> {
    let candidates = vtopo::candidate_pools(class_params, &chosen.pool.pool);
    let (v, provisioner, pv) = (vol.clone(), ctx.name.clone(), pv_name.to_owned());
    let found = ctx
        .ceph(conn, move |c, m, _| {
            vtopo::find_existing(c, m, &v, &candidates, &provisioner, &pv)
        })
        .await
        .map_err(|e| {
            format!(
                "cannot look for image {} in the class's pools: {e}",
                vol.image
            )
        })?;
    match found {
        Some(pool) if pool != chosen.pool.pool => {
            let terms: Vec<_> = reqs
                .preferred
                .iter()
                .chain(&reqs.requisite)
                .cloned()
                .collect();
            vtopo::placement_of(&class_params.topology_pools, &pool, &terms, &reqs.keys)
                .ok_or_else(|| {
                    format!(
                        "image {} already exists in pool {pool:?}, which is not one of the class's topologyConstrainedPools",
                        vol.image
                    )
                    .into()
                })
        }
        _ => Ok(chosen),
    }
}

async fn provision_steps(
    claim: &PersistentVolumeClaim,
    ctx: &Context,
    class: &StorageClass,
    pv_name: &str,
) -> Result<(), Failure> {
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let claim_uid = claim.metadata.uid.clone().unwrap_or_default();

    let params = ClassParams::parse(&class.parameters.clone().unwrap_or_default())?;
    let data_source = source::data_source(claim);
    let mut modes = claim_access_modes(claim);
    if data_source.is_some() && modes.iter().any(|m| m == "ReadOnlyMany") {
        // ReadOnlyMany is fine for a volume with content.
        modes.retain(|m| m != "ReadOnlyMany");
        if modes.is_empty() {
            modes.push("ReadWriteOnce".to_owned());
        }
    }
    check_access(&modes, &claim_volume_mode(claim))?;
    check_unsupported(claim)?;
    let (vac, qos_policy) =
        match crate::provisioner::modify::new_volume_policy(ctx, claim, &params.qos).await? {
            NewVolume::Ready(vac, policy) => (vac, policy),
            NewVolume::Missing(why) => {
                return Err(Failure {
                    why,
                    wait: Some("WaitingForVolumeAttributesClass"),
                })
            }
        };
    let requested = storage_request(claim)?;
    let size = round_up_mib(requested.max(1)).max(MIB);
    if let Some(limit) = storage_limit(claim) {
        if limit < size {
            return Err(format!(
                "the claim's storage limit ({limit} bytes) is below the size rounded up to whole MiB ({size} bytes)"
            )
            .into());
        }
    }
    let cluster = ctx.clusters.get(&params.cluster_id).ok_or_else(|| {
        format!(
            "clusterID {:?} is not in the clusters config",
            params.cluster_id
        )
    })?;

    let empty = BTreeMap::new();
    let namespace = claim.namespace().unwrap_or_default();
    let claim_name = claim.name_any();
    let tctx = TemplateContext {
        pv_name,
        pvc_namespace: &namespace,
        pvc_name: &claim_name,
        pvc_annotations: claim.metadata.annotations.as_ref().unwrap_or(&empty),
    };
    let prov_secret = params
        .provisioner_secret
        .as_ref()
        .ok_or("the StorageClass names no provisioner Secret")?
        .resolve(&tctx)?;
    let expand_secret = match &params.expand_secret {
        Some(t) => t.resolve(&tctx)?,
        None => prov_secret.clone(),
    };
    let node_secret = params
        .node_stage_secret
        .as_ref()
        .map(|t| t.resolve(&tctx))
        .transpose()?;

    let class_name = class.name_any();
    let source = match &data_source {
        None => None,
        Some(ds) => Some(source::resolve(&ctx.client, &ctx.name, claim, ds).await?),
    };
    let class_params = params;
    let (params, placement) = place_by_topology(
        ctx,
        claim,
        class,
        &class_params,
        source.as_ref().map(|s| s.place().pool).as_deref(),
    )
    .await?;
    let mut vol = VolumeId {
        cluster_id: params.cluster_id.clone(),
        pool: params.pool.clone(),
        rados_namespace: cluster.rados_namespace.clone(),
        image: params.image_name(pv_name),
    };
    if let Some(s) = &source {
        source::check_place(s, &vol, &class_name)?;
        source::check_size(s, size)?;
    }

    // Credentials and connection first: a missing Secret or an unreachable
    // cluster must not leave a finalizer that needs them to be removed.
    let conn = ctx.connect(&params.cluster_id, &prov_secret).await?;
    let (params, placement) = match placement {
        Some((p, reqs)) if source.is_none() => {
            let kept =
                keep_earlier_pool(ctx, &conn, &class_params, &vol, pv_name, p, &reqs).await?;
            vol.pool = kept.pool.pool.clone();
            (vtopo::placed(&class_params, &kept), Some(kept))
        }
        other => (params, other.map(|(p, _)| p)),
    };
    let encryption = match &params.encryption {
        None => None,
        Some(e) => Some(
            crate::provisioner::encryption::encryption_for(
                ctx,
                e,
                &prov_secret,
                source.is_none().then_some(size),
                &namespace,
            )
            .await?,
        ),
    };

    // Before any image exists: the claim cannot go away without us
    // cleaning up, and we will know where to look.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &namespace);
    let protected = edit_meta_from(
        &claims,
        &claim_name,
        Some(claim),
        CLAIM_FINALIZER,
        true,
        &BTreeMap::from([
            (CLAIM_VOLUME_ANNOTATION.to_owned(), Some(vol.handle())),
            (
                CLAIM_SECRET_ANNOTATION.to_owned(),
                Some(prov_secret.to_string()),
            ),
            // The binder's handover mark, written as the binder writes it
            // (it then skips that write), for a claim taken early: the
            // later steps (letting go, cleaning up) go by it.
            (ANN_STORAGE_PROVISIONER.to_owned(), Some(ctx.name.clone())),
            (
                ANN_STORAGE_PROVISIONER_BETA.to_owned(),
                Some(ctx.name.clone()),
            ),
        ]),
    )
    .await?;
    if !protected {
        // Deleted meanwhile: an image made now would have nothing to clean
        // it up if we died before its PV exists.
        return Err("the claim is being deleted; not provisioning it".into());
    }

    ctx.events
        .normal(
            &claim_ref(claim),
            "Provisioning",
            &format!("External provisioner is provisioning volume for claim \"{namespace}/{claim_name}\""),
        )
        .await;

    let owner = Owner {
        provisioner: ctx.name.clone(),
        pv_name: pv_name.to_owned(),
        pvc_namespace: namespace.clone(),
        pvc_name: claim_name.clone(),
        cluster_id: params.cluster_id.clone(),
    };
    let options = params
        .image_options()
        .map_err(|e| format!("image options: {e}"))?;
    let parent = source.as_ref().map(|s| match s {
        Source::Volume { volume, .. } => volume.clone(),
        Source::Snapshot { snapshot, .. } => snapshot.image_id(),
    });
    let encryption =
        crate::provisioner::encryption::vault_encryption(ctx, &conn, encryption, &vol, parent)
            .await?;
    let vol_c = vol.clone();
    let mut flatten_later = false;
    let created = match source {
        None => ctx
            .ceph(&conn, move |c, m, f| {
                ops::ensure_image_encrypted(
                    c,
                    m,
                    f,
                    &vol_c,
                    size,
                    &options,
                    &owner,
                    encryption.as_ref(),
                )
            })
            .await
            .map_err(|e| format!("cannot create image {vol}: {e}"))?,
        Some(src) => {
            if let Source::Volume { claim: name, .. } = &src {
                // Its PV (and image) stays until the clone is made.
                if !source::set_protection(&ctx.client, &namespace, name, true).await? {
                    return Err(format!("source claim {name:?} is being deleted").into());
                }
            }
            let opts = CloneOptions {
                depth: params.clone_depth,
                fence: Arc::clone(&ctx.fence),
                encryption,
                ..Default::default()
            };
            let what = src.describe();
            let cloned = ctx
                .ceph(&conn, move |c, m, _| match &src {
                    Source::Volume { volume, .. } => snap::ensure_volume_from_volume(
                        c, m, volume, &vol_c, size, &options, &owner, &opts,
                    ),
                    Source::Snapshot { snapshot, .. } => snap::ensure_volume_from_snapshot(
                        c, m, snapshot, &vol_c, size, &options, &owner, &opts,
                    ),
                })
                .await
                .map_err(|e| format!("cannot clone image {vol} from {what}: {e}"))?;
            tracing::info!(image = %vol, source = %what, depth = cloned.depth, flatten = ?cloned.flatten, "cloned");
            flatten_later = cloned.flatten == Flatten::Background;
            cloned.size
        }
    };
    // A clone starts from its own classes, not from the limits it
    // inherited with its source's metadata.
    if !qos_policy.is_empty() || data_source.is_some() {
        let (v, name, pv) = (vol.clone(), ctx.name.clone(), pv_name.to_owned());
        ctx.ceph(&conn, move |c, m, f| {
            qos::apply_to_volume(c, m, f, &v, &name, &pv, &qos_policy, qos::Mode::Replace)
        })
        .await
        .map_err(|e| format!("cannot set the QoS of image {vol}: {e}"))?;
    }
    drop(conn);
    if created < size {
        return Err(format!(
            "image {vol} already exists with {created} bytes, less than the {size} requested"
        )
        .into());
    }

    let pv = build_pv(&PvInput {
        provisioner: &ctx.name,
        pv_name,
        claim,
        class,
        params: &params,
        volume: &vol,
        capacity_bytes: size,
        provisioner_secret: &prov_secret,
        expand_secret: &expand_secret,
        node_stage_secret: node_secret.as_ref(),
    });
    let mut pv = pv;
    if let Some(p) = &placement {
        crate::provisioner::topology::set_node_affinity(&mut pv, &p.accessible);
    }
    crate::provisioner::modify::annotate_pv(&mut pv, vac.as_deref());
    if flatten_later {
        pv.annotations_mut()
            .insert(PV_FLATTEN_ANNOTATION.to_owned(), "true".to_owned());
    }
    before_work().await;
    match pvs.create(&PostParams::default(), &pv).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let existing = pvs
                .get_opt(pv_name)
                .await?
                .ok_or("PV create conflicted but the PV is not there; retrying")?;
            check_pv_is_for(&existing, ctx, &claim_uid)?;
        }
        Err(e) => return Err(format!("cannot create PV {pv_name}: {e}").into()),
    }
    ctx.events
        .normal(
            &claim_ref(claim),
            "ProvisioningSucceeded",
            &format!("Successfully provisioned volume {pv_name} (image {vol})"),
        )
        .await;
    release_source(ctx, claim).await?;
    // The finalizer stays until the binder has bound the claim: dropping it
    // now would race the binder's own claim writes (see claim_inner). A
    // claim deleted before that finds its PV and just lets go.
    Ok(())
}

/// Refuses what this provisioner cannot honour, rather than hand out an
/// empty volume where content or a particular volume was asked for.
fn check_unsupported(claim: &PersistentVolumeClaim) -> Result<(), String> {
    let spec = claim.spec.as_ref();
    if spec.is_some_and(|s| s.selector.is_some()) {
        return Err("the claim has a selector, which dynamic provisioning does not support".into());
    }
    Ok(())
}

fn check_pv_is_for(pv: &PersistentVolume, ctx: &Context, claim_uid: &str) -> Result<(), Failure> {
    let name = pv.name_any();
    if our_volume(pv, &ctx.name).is_none() {
        return Err(format!("PV {name} exists but was not provisioned by {}", ctx.name).into());
    }
    let uid = pv
        .spec
        .as_ref()
        .and_then(|s| s.claim_ref.as_ref())
        .and_then(|r| r.uid.as_deref());
    if uid != Some(claim_uid) {
        return Err(format!("PV {name} exists but is for another claim").into());
    }
    Ok(())
}

/// A claim deleted while it was being provisioned: remove its image unless
/// its PV exists (the PV's own deletion then takes care of it).
async fn claim_deleted(
    claim: &PersistentVolumeClaim,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    let key = claim_key(claim);
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    if let Some(pv_name) = pv_name_for(claim) {
        if pvs.get_opt(&pv_name).await?.is_none() {
            if let Err(why) = cleanup_image(claim, ctx, &pv_name).await {
                ctx.events
                    .warning(&claim_ref(claim), "ProvisioningCleanupFailed", &why)
                    .await;
                return Err(ReconcileError(why));
            }
        }
    }
    release_source(ctx, claim).await?;
    drop_claim_finalizer(ctx, claim).await?;
    ctx.finished(claim.metadata.uid.as_deref().unwrap_or_default());
    tracing::info!(claim = %key, "claim deleted during provisioning; cleaned up");
    Ok(Action::await_change())
}

async fn cleanup_image(
    claim: &PersistentVolumeClaim,
    ctx: &Context,
    pv_name: &str,
) -> Result<(), String> {
    let ann = claim.annotations();
    let (Some(handle), Some(secret)) = (
        ann.get(CLAIM_VOLUME_ANNOTATION),
        ann.get(CLAIM_SECRET_ANNOTATION),
    ) else {
        // The finalizer and these annotations are written together, before
        // any image: without them there is nothing to clean.
        return Ok(());
    };
    let vol = VolumeId::parse(handle)?;
    let (namespace, name) = secret
        .split_once('/')
        .ok_or_else(|| format!("bad {CLAIM_SECRET_ANNOTATION} annotation"))?;
    let secret = SecretRef {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    };
    let conn = ctx.connect(&vol.cluster_id, &secret).await?;
    let provisioner = ctx.name.clone();
    let pv = pv_name.to_owned();
    let vol_c = vol.clone();
    let v = vol.clone();
    let outcome = crate::provisioner::encryption::remove_with_key(
        ctx,
        &conn,
        &vol,
        handle,
        false,
        &secret,
        move |c, m, f| match ops::delete_image(c, m, f, &vol_c, &provisioner, &pv) {
            // Someone else's image holds the name: provisioning refused to
            // adopt it, so nothing of ours is there; leave it and let go.
            Err(e @ VolumeError::NotOwned { .. }) if matches!(&e, VolumeError::NotOwned { image, .. } if *image == v.image) =>
            {
                tracing::warn!(image = %v, "claim deleted; {e}");
                Ok(None)
            }
            other => other.map(Some),
        },
    )
    .await
    .map_err(|e| format!("cannot remove image {vol} of deleted claim: {e}"))?;
    let Some(outcome) = outcome else {
        return Ok(());
    };
    tracing::info!(image = %vol, ?outcome, "removed the image of a claim deleted during provisioning");
    Ok(())
}

// ------------------------------------------------------ attributes class --

/// The PV and volume of a bound claim, if the reconcilers act on them.
async fn bound_volume(
    claim: &PersistentVolumeClaim,
    pv_name: &str,
    ctx: &Context,
) -> Result<Option<(PersistentVolume, VolumeId)>, ReconcileError> {
    let bound = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    if !bound {
        return Ok(None);
    }
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let Some(pv) = pvs.get_opt(pv_name).await? else {
        return Ok(None);
    };
    match ctx.volume_of(&pv) {
        Some(Ok(vol)) => Ok(Some((pv, vol))),
        _ => Ok(None),
    }
}

/// A bound claim whose VolumeAttributesClass changed: applied (see
/// [`crate::provisioner::modify`]), then any expansion.
async fn modify(
    claim: &PersistentVolumeClaim,
    pv_name: &str,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    let Some((pv, vol)) = bound_volume(claim, pv_name, ctx).await? else {
        return Ok(Action::await_change());
    };
    match crate::provisioner::modify::reconcile(claim, &pv, &vol, ctx).await? {
        crate::provisioner::modify::Outcome::Wrote => Ok(Action::await_change()),
        crate::provisioner::modify::Outcome::Idle => expand_volume(claim, &pv, &vol, ctx).await,
    }
}

// ------------------------------------------------------------- expansion --

async fn expand(
    claim: &PersistentVolumeClaim,
    pv_name: &str,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    match bound_volume(claim, pv_name, ctx).await? {
        Some((pv, vol)) => expand_volume(claim, &pv, &vol, ctx).await,
        None => Ok(Action::await_change()),
    }
}

/// Grows the image, the PV and the claim's status to the claim's request,
/// if it asks for more and its class allows it.
async fn expand_volume(
    claim: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    vol: &VolumeId,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    let pv_name = pv.name_any();
    let class_name = claim
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.clone())
        .unwrap_or_default();
    let Ok(requested) = storage_request(claim) else {
        return Ok(Action::await_change());
    };
    let capacity = pv_capacity(pv);
    if requested <= capacity {
        if resize_unfinished(claim) && capacity > 0 {
            tracing::info!(pv = %pv_name, bytes = capacity, "finishing a resize cut short after the PV was grown");
            finish_resize(claim, capacity, ctx).await?;
        }
        return Ok(Action::await_change());
    }
    let classes: Api<StorageClass> = Api::all(ctx.client.clone());
    let allowed = classes
        .get_opt(&class_name)
        .await?
        .and_then(|c| c.allow_volume_expansion)
        .unwrap_or(false);
    if !allowed {
        return Ok(Action::await_change());
    }
    let new_size = round_up_mib(requested);
    match expand_steps(claim, pv, vol, new_size, ctx).await {
        Ok(()) => {
            ctx.metrics.resized(&class_name);
            Ok(Action::await_change())
        }
        Err(why) => {
            ctx.metrics.resize_failed(&class_name);
            ctx.events
                .warning(&claim_ref(claim), "VolumeResizeFailed", &why)
                .await;
            Err(ReconcileError(why))
        }
    }
}

/// The claim's conditions other than the resize ones.
fn other_conditions(claim: &PersistentVolumeClaim) -> Vec<serde_json::Value> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|cs| {
            cs.iter()
                .filter(|c| c.type_ != "Resizing" && c.type_ != "FileSystemResizePending")
                .filter_map(|c| serde_json::to_value(c).ok())
                .collect()
        })
        .unwrap_or_default()
}

async fn expand_steps(
    claim: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    vol: &VolumeId,
    new_size: u64,
    ctx: &Context,
) -> Result<(), String> {
    let namespace = claim.namespace().unwrap_or_default();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &namespace);
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let pv_name = pv.name_any();
    let new_q = bytes_quantity(new_size);
    let kube_err = |e: kube::Error| format!("Kubernetes API: {e}");

    // Only write what changes: a status write wakes this claim's reconcile
    // again, and a retry must wait for its backoff, not loop on its own
    // writes.
    let status = claim.status.clone().unwrap_or_default();
    let allocated = status
        .allocated_resources
        .as_ref()
        .and_then(|r| r.get("storage"))
        .and_then(|q| parse_bytes(&q.0).ok());
    let state = status
        .allocated_resource_statuses
        .as_ref()
        .and_then(|s| s.get("storage"))
        .cloned()
        .unwrap_or_default();
    let resizing = status
        .conditions
        .as_ref()
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Resizing"));
    let already = resizing
        && allocated == Some(new_size)
        && (state == "ControllerResizeInProgress" || state == "ControllerResizeInfeasible");
    if !already {
        let mut conditions = other_conditions(claim);
        conditions.push(json!({"type": "Resizing", "status": "True", "lastTransitionTime": now()}));
        before_work().await;
        claims
            .patch_status(
                &claim.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "conditions": conditions,
                    "allocatedResources": {"storage": new_q},
                    "allocatedResourceStatuses": {"storage": "ControllerResizeInProgress"},
                }})),
            )
            .await
            .map_err(kube_err)?;
        ctx.events
            .normal(
                &claim_ref(claim),
                "Resizing",
                &format!("External resizer is resizing volume {pv_name}"),
            )
            .await;
    }

    let secret = expand_secret(pv)
        .or_else(|| deletion_secret(pv))
        .or_else(|| ctx.legacy_secret.clone())
        .ok_or("the PV names no controller-expand secret")?;
    let conn = ctx.connect(&vol.cluster_id, &secret).await?;
    ctx.adopt_legacy(&conn, pv, vol).await?;
    let provisioner = ctx.name.clone();
    let vol_c = vol.clone();
    let pv_c = pv_name.clone();
    let resized = ctx
        .ceph(&conn, move |c, m, f| {
            ops::expand_image(c, m, f, &vol_c, &provisioner, &pv_c, new_size)
        })
        .await;
    drop(conn);
    if let Err(e) = resized {
        if matches!(e, VolumeError::ShrinkRefused { .. }) && state != "ControllerResizeInfeasible" {
            before_work().await;
            let _ = claims
                .patch_status(
                    &claim.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(json!({"status": {
                        "allocatedResourceStatuses": {"storage": "ControllerResizeInfeasible"},
                    }})),
                )
                .await;
        }
        return Err(format!("cannot resize image {vol}: {e}"));
    }

    before_work().await;
    pvs.patch(
        &pv_name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"capacity": {"storage": new_q}}})),
    )
    .await
    .map_err(kube_err)?;

    finish_resize(claim, new_size, ctx)
        .await
        .map_err(kube_err)?;
    tracing::info!(pv = %pv_name, image = %vol, bytes = new_size, "expanded");
    Ok(())
}

/// The claim's side of a resize whose image and PV are done: its status
/// (and an event). Also run on its own when a crash came between the PV
/// patch and this, which would otherwise leave the claim Resizing forever.
async fn finish_resize(
    claim: &PersistentVolumeClaim,
    new_size: u64,
    ctx: &Context,
) -> Result<(), kube::Error> {
    let namespace = claim.namespace().unwrap_or_default();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &namespace);
    let new_q = bytes_quantity(new_size);
    let mut conditions = other_conditions(claim);
    // Block too, as external-resizer does when NodeExpandVolume is
    // required: krbd's device grows by itself, the loop device of
    // rbdkit-fuse only when kubelet calls NodeExpandVolume.
    conditions.push(json!({
        "type": "FileSystemResizePending",
        "status": "True",
        "lastTransitionTime": now(),
        "message": "Waiting for user to (re-)start a pod to finish file system resize of volume on node.",
    }));
    let status = json!({"status": {
        "conditions": conditions,
        "allocatedResources": {"storage": new_q},
        "allocatedResourceStatuses": {"storage": "NodeResizePending"},
    }});
    before_work().await;
    claims
        .patch_status(
            &claim.name_any(),
            &PatchParams::default(),
            &Patch::Merge(status),
        )
        .await?;
    ctx.events
        .normal(
            &claim_ref(claim),
            "FileSystemResizeRequired",
            "Require file system resize of volume on node",
        )
        .await;
    Ok(())
}

/// Whether the claim's status still says its controller-side resize is
/// under way.
fn resize_unfinished(claim: &PersistentVolumeClaim) -> bool {
    let Some(status) = claim.status.as_ref() else {
        return false;
    };
    let resizing = status
        .conditions
        .as_ref()
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Resizing"));
    let in_progress = status
        .allocated_resource_statuses
        .as_ref()
        .and_then(|s| s.get("storage"))
        .is_some_and(|s| s == "ControllerResizeInProgress");
    resizing || in_progress
}

// ---------------------------------------------------------------- volumes --

/// Reconciles a PV: deletes the volume of a released PV with reclaim policy
/// Delete, or just lets go of a retained one.
pub async fn reconcile_pv(pv: Arc<CachedPv>, ctx: Arc<Context>) -> Result<Action, ReconcileError> {
    // Stripped: not ours in this version (`Context::strip_foreign_pv`).
    let Some(pv) = decode(&pv)? else {
        return Ok(Action::await_change());
    };
    let Some(vol) = ctx.volume_of(&pv) else {
        return Ok(Action::await_change());
    };
    let name = pv.name_any();
    let out = ctx.limiter.scoped(pv_inner(&pv, vol, &ctx)).await;
    if out.is_ok() {
        ctx.pv_failures.succeeded(&name);
    }
    out
}

/// Requeues a failed PV after its backoff.
pub fn pv_error_policy(pv: Arc<CachedPv>, err: &ReconcileError, ctx: Arc<Context>) -> Action {
    let name = pv.name_any();
    let delay = ctx.pv_failures.failed(&name);
    tracing::warn!(pv = %name, error = %err, retry_in = ?delay, "volume not done; will retry");
    Action::requeue(delay)
}

async fn pv_inner(
    pv: &PersistentVolume,
    vol: Result<VolumeId, String>,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    let name = pv.name_any();
    let spec = pv.spec.clone().unwrap_or_default();
    let policy = spec
        .persistent_volume_reclaim_policy
        .clone()
        .unwrap_or_else(|| "Delete".to_owned());
    let phase = pv
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default();
    let deleting = pv.metadata.deletion_timestamp.is_some();
    let has_finalizer = pv.finalizers().iter().any(|f| f == PV_FINALIZER);
    let released = phase == "Released" || (deleting && phase != "Bound");
    let uid = pv.metadata.uid.clone().unwrap_or_default();
    if !released || (deleting && !has_finalizer) || (!has_finalizer && ctx.was_deleted(&uid)) {
        return Ok(Action::await_change());
    }
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    if policy != "Delete" {
        // Retain: the image stays; we only let go of the PV.
        if has_finalizer {
            edit_meta(&pvs, &name, PV_FINALIZER, false, &BTreeMap::new()).await?;
            tracing::info!(pv = %name, policy = %policy, "released; image kept");
        }
        return Ok(Action::await_change());
    }
    let class = spec.storage_class_name.clone().unwrap_or_default();
    let started = ctx.first_attempt(&format!("pv/{name}"));
    match delete_steps(pv, vol, ctx).await {
        Ok(outcome) => {
            edit_meta_from(&pvs, &name, Some(pv), PV_FINALIZER, false, &BTreeMap::new()).await?;
            before_work().await;
            match pvs.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
            // Only now: a failed delete above must be retried in full.
            ctx.mark_deleted(&uid);
            if ctx.finished(&format!("pv/{name}")).is_some() {
                ctx.metrics.deleted(&class, started.elapsed());
            }
            tracing::info!(pv = %name, ?outcome, "volume deleted");
            Ok(Action::await_change())
        }
        Err(why) => {
            ctx.metrics.delete_failed(&class);
            ctx.events
                .warning(&pv.object_ref(&()), "VolumeFailedDelete", &why)
                .await;
            Err(ReconcileError(why))
        }
    }
}

async fn delete_steps(
    pv: &PersistentVolume,
    vol: Result<VolumeId, String>,
    ctx: &Context,
) -> Result<Deleted, String> {
    let vol = vol?;
    let secret = deletion_secret(pv)
        .or_else(|| {
            our_volume(pv, &ctx.name)
                .is_none()
                .then(|| ctx.legacy_secret.clone())
                .flatten()
        })
        .ok_or("the PV names no Secret to delete its volume with")?;
    let conn = ctx.connect(&vol.cluster_id, &secret).await?;
    ctx.adopt_legacy(&conn, pv, &vol).await?;
    let provisioner = ctx.name.clone();
    let pv_name = pv.name_any();
    let vol_c = vol.clone();
    crate::provisioner::encryption::remove_with_key(
        ctx,
        &conn,
        &vol,
        &vol.handle(),
        false,
        &secret,
        move |c, m, f| ops::delete_image(c, m, f, &vol_c, &provisioner, &pv_name),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pv(name: &str, class: &str, claim: Option<(&str, &str)>, phase: Option<&str>) -> CachedPv {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "storageClassName": class,
                "claimRef": claim.map(|(ns, n)| json!({"namespace": ns, "name": n})),
            },
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    #[test]
    fn a_claim_is_ours_to_keep_whole_once_handed_to_us_or_finalized_by_us() {
        let claim = |ann: serde_json::Value, fin: serde_json::Value| -> PersistentVolumeClaim {
            serde_json::from_value(json!({
                "metadata": {"name": "c", "namespace": "ns", "annotations": ann, "finalizers": fin},
                "spec": {"volumeName": "pv-1"},
            }))
            .unwrap()
        };
        let us = "rbd.rbdkit.io";
        assert!(handed_to(
            &claim(json!({ANN_STORAGE_PROVISIONER: us}), json!([])),
            us
        ));
        assert!(handed_to(
            &claim(json!({ANN_STORAGE_PROVISIONER_BETA: us}), json!([])),
            us
        ));
        assert!(handed_to(&claim(json!({}), json!([CLAIM_FINALIZER])), us));
        assert!(!handed_to(
            &claim(json!({ANN_STORAGE_PROVISIONER: "other.io"}), json!([])),
            us
        ));
        assert!(!handed_to(
            &claim(json!({}), json!(["kubernetes.io/pvc-protection"])),
            us
        ));
    }

    #[test]
    fn only_a_free_or_pre_bound_pv_of_the_class_holds_a_claim_back() {
        let own = Some("pvc-1");
        let bound =
            |p: &CachedPv| could_be_bound_to(p.meta(), p.digest(), "fast", "ns", "data", own);
        // Free, of the class: the binder may choose it.
        assert!(bound(&pv("static", "fast", None, Some("Available"))));
        assert!(bound(&pv("static", "fast", None, None)));
        // Pre-bound to this claim by someone else.
        assert!(bound(&pv(
            "static",
            "fast",
            Some(("ns", "data")),
            Some("Available")
        )));
        // Another class, another claim, our own PV, a released one.
        assert!(!bound(&pv("static", "slow", None, Some("Available"))));
        assert!(!bound(&pv(
            "static",
            "fast",
            Some(("ns", "other")),
            Some("Bound")
        )));
        assert!(!bound(&pv(
            "static",
            "fast",
            Some(("other", "data")),
            Some("Bound")
        )));
        assert!(!bound(&pv("pvc-1", "fast", Some(("ns", "data")), None)));
        assert!(!bound(&pv("static", "fast", None, Some("Released"))));
        assert!(!bound(&pv("static", "fast", None, Some("Failed"))));
    }
}
