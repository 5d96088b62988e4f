//! The CSI Node service: stage (map, mkfs, mount), publish (bind mount),
//! and their reverses; expansion, stats and volume health.
//!
//! **Health** (CSI 1.13's NodeGetVolumeHealth, which replaced the alpha
//! VolumeCondition of NodeGetVolumeStats): a staged volume is INACCESSIBLE
//! when its mapper says the mapping no longer serves I/O
//! ([`Mapper::check`]), when it is not mapped, or when its mount or device
//! cannot be read; DEGRADED when a read-write filesystem has been remounted
//! read-only (the kernel does so after an I/O error). NodeGetStorageHealth
//! reports each mapper that cannot map here and Ceph monitors that do not
//! answer.
//!
//! Layout under a staging path, as kubelet gives it:
//! - `<staging>/rbdkit.json`: the stash, what unstaging needs (mapper,
//!   device, options, the staging lock). Written before the lock is taken
//!   and the image mapped, so a crash at any later point leaves enough to
//!   clean up.
//! - `<staging>/volume`: the filesystem's mount point (a directory), or,
//!   for Block volumes, a file the device is bind-mounted onto.
//!
//! Publishing bind-mounts `<staging>/volume` onto the target path. Each
//! step checks what is already in place, so kubelet may repeat any of them
//! after a crash.
//!
//! **One writer.** A read-write stage takes the image's staging lock
//! ([`crate::node::stage_lock`]) before it maps and checks it again after
//! the map, before mkfs or mount: of two nodes racing for an RWO or RWOP
//! volume exactly one stages it, and the other gets FAILED_PRECONDITION
//! naming the holder, with nothing mapped. Multi-node-multi-writer Block
//! (RWX, live migration) takes it shared, so any number of nodes stage it,
//! and none exclusively meanwhile. Read-only stages take no lock. Unstaging
//! releases it. Another node's lock is never broken here: the stage is
//! refused naming the holder until that node unstages, or, if it is dead,
//! until its Node gets the `node.kubernetes.io/out-of-service` taint and
//! the provisioner has fenced it and broken its locks. NodeUnstageVolume carries no secrets: it
//! releases as the Ceph user that staged the volume (kept in its stash),
//! with the credentials an earlier call brought for that user; after a
//! restart of this server with none yet, the release waits (in the state
//! dir) for the next call that brings that user's credentials for the
//! cluster (the userspace mapper releases it itself, at once).
//!
//! **Space reclaim.** Every `--reclaim-poll` the node reads, for each
//! volume it staged read-write, the header xattr through which the
//! provisioner relays a csi-addons ReclaimSpaceJob
//! ([`NodeService::reclaim_pass`]), runs `fstrim` on a staged filesystem
//! and answers in another xattr, both named after the job
//! (`crate::provisioner::reclaim` says why this way). The volume is busy
//! meanwhile, as during any other call on it: an unstage that comes then is
//! ABORTED and retried by kubelet.
//!
//! **Checked before anything is done**: the filesystem type and
//! `mkfsOptions` ([`fs::check_mkfs_options`]: an allow-list per mkfs, so no
//! option reads or writes a host path). A stage repeated at the same
//! staging path with another capability (Block or Mount, fsType, access
//! mode, read-only, mount flags) is ALREADY_EXISTS, as the CSI spec asks.
//!
//! **Read-only stages** mount with `noload` (ext3/4) or `norecovery` (xfs):
//! a restored snapshot of a mounted filesystem needs its journal replayed,
//! which a read-only device cannot do ([`fs::mount_options`]).
//!
//! **Expansion.** ControllerExpandVolume asks for NodeExpandVolume for
//! every volume, Block ones too: a krbd device grows by itself (the kernel
//! client sees the header change), but the loop device over the
//! rbdkit-fuse file does not, until NodeExpandVolume asks the mapper to
//! re-read the size (`refresh`, `LOOP_SET_CAPACITY`). For a filesystem it
//! then grows the filesystem.

use std::collections::HashMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tonic::{Code, Request, Response, Status};

use crate::csi::driver::{credentials, required, status_of, volume_id, Driver};
use crate::csi::proto::{
    node_get_storage_health_response::StorageBackendHealth, volume_health::VolumeHealthEntry,
    NodeGetStorageHealthRequest, NodeGetStorageHealthResponse, NodeGetVolumeHealthRequest,
    NodeGetVolumeHealthResponse, StorageHealthErrorType, VolumeHealth, VolumeHealthErrorType,
};
use crate::csi::proto::{
    node_server::Node, node_service_capability, volume_capability, volume_usage,
    NodeExpandVolumeRequest, NodeExpandVolumeResponse, NodeGetCapabilitiesRequest,
    NodeGetCapabilitiesResponse, NodeGetInfoRequest, NodeGetInfoResponse,
    NodeGetVolumeStatsRequest, NodeGetVolumeStatsResponse, NodePublishVolumeRequest,
    NodePublishVolumeResponse, NodeServiceCapability, NodeStageVolumeRequest,
    NodeStageVolumeResponse, NodeUnpublishVolumeRequest, NodeUnpublishVolumeResponse,
    NodeUnstageVolumeRequest, NodeUnstageVolumeResponse, Topology, VolumeCapability, VolumeUsage,
};
use crate::node::cgroup_io::IoMax;
use crate::node::stage_lock::{self, Acquired, ImageLock, LockMode, MirrorRole};
use crate::node::{fs, mount, options, MapSpec, Mapper};
use crate::volume::ops::VolumeError;
use crate::volume::params::{NodeParams, MAP_OPTIONS, UNMAP_OPTIONS};
use crate::volume::VolumeId;
use crate::Error;

/// The stash file's name under the staging path.
pub const STASH: &str = "rbdkit.json";
/// The mount point (or device file) under the staging path.
pub const VOLUME: &str = "volume";
/// Bound on connecting to each monitor in NodeGetStorageHealth.
const STORAGE_HEALTH_MON_TIMEOUT: Duration = Duration::from_secs(2);

/// What NodeUnstageVolume (and stats and expansion) need to know about a
/// staged volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stash {
    /// The CSI volume id.
    pub volume_id: String,
    /// The mapper's name.
    pub mapper: String,
    /// The block device, once mapped.
    pub device: Option<PathBuf>,
    /// The filesystem, or `None` for a Block volume.
    pub fs_type: Option<String>,
    /// Staged read-only.
    pub read_only: bool,
    /// The mapper's unmap options.
    pub unmap_options: Vec<String>,
    /// Target paths it is published at.
    #[serde(default)]
    pub published: Vec<PathBuf>,
    /// The capability's access mode (`volume_capability::access_mode::Mode`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_mode: Option<i32>,
    /// The capability's mount flags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_flags: Option<Vec<String>>,
    /// The staging lock this node took for it, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock: Option<LockMode>,
    /// The fsid of the image's cluster: krbd tells two clusters' images of
    /// one name apart only by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_fsid: Option<String>,
    /// The Ceph user that staged it (never its key): the staging lock is
    /// released as that user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The image's QoS limits as `io.max`, for krbd (which ignores
    /// librbd's), read at stage: a publish has no credentials to read them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_max: Option<crate::node::cgroup_io::IoMax>,
    /// The dm-crypt mapping of an encrypted volume on a mapper that does
    /// not decrypt (krbd): filesystems and binds use its device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crypt: Option<String>,
}

impl Stash {
    /// The device the filesystem (or the Block bind) is on: the dm-crypt
    /// mapping's, else the mapper's.
    pub fn data_device(&self) -> Option<PathBuf> {
        match &self.crypt {
            Some(name) => Some(crate::node::dmcrypt::device_of(name)),
            None => self.device.clone(),
        }
    }

    fn path(staging: &Path) -> PathBuf {
        staging.join(STASH)
    }

    /// Whether a stage with this capability is the one recorded (fields a
    /// stash of an older version lacks are not compared).
    fn compatible(
        &self,
        fs_type: Option<&str>,
        read_only: bool,
        mode: i32,
        flags: &[String],
    ) -> bool {
        let sorted = |f: &[String]| {
            let mut v = f.to_vec();
            v.sort();
            v
        };
        self.fs_type.as_deref() == fs_type
            && self.read_only == read_only
            && self.access_mode.is_none_or(|m| m == mode)
            && self
                .mount_flags
                .as_ref()
                .is_none_or(|f| sorted(f) == sorted(flags))
    }

    fn remove(staging: &Path) -> Result<(), Status> {
        let p = Stash::path(staging);
        match std::fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_status("remove", &p, e)),
        }
    }

    /// Reads the stash under `staging`, `None` if there is none.
    pub fn read(staging: &Path) -> Result<Option<Stash>, Status> {
        let p = Stash::path(staging);
        match std::fs::read(&p) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| Status::internal(format!("stash {} is unreadable: {e}", p.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Status::internal(format!(
                "cannot read stash {}: {e}",
                p.display()
            ))),
        }
    }

    /// Writes it atomically (a temporary file, fsync, rename).
    pub fn write(&self, staging: &Path) -> Result<(), Status> {
        let p = Stash::path(staging);
        write_atomic(&p, &serde_json::to_vec_pretty(self).unwrap_or_default())
            .map_err(|e| Status::internal(format!("cannot write stash {}: {e}", p.display())))
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// The Node service.
pub struct NodeService {
    driver: Arc<Driver>,
    mappers: Vec<Arc<dyn Mapper>>,
    default_mapper: String,
    state_dir: PathBuf,
    default_fs: String,
    /// Read affinity: the flags and the node's labels.
    read_affinity: ReadAffinityFlags,
    /// The cgroup v2 mount krbd volumes' `io.max` is written under.
    cgroup_root: PathBuf,
    /// The header object of each staged volume, by volume id, once read:
    /// a reclaim pass then reads one xattr per volume and opens no image.
    header_oids: std::sync::Mutex<HashMap<String, String>>,
}

/// `--enable-read-affinity`, `--crush-location-labels`, and the node's
/// labels read at start (`None`: not read).
#[derive(Debug, Clone, Default)]
struct ReadAffinityFlags {
    enabled: bool,
    labels: Vec<String>,
    node_labels: Option<std::collections::BTreeMap<String, String>>,
}

/// A request's secrets, zeroed when dropped (the key's copy in the request).
struct Secrets(HashMap<String, String>);

impl Drop for Secrets {
    fn drop(&mut self) {
        for v in self.0.values_mut() {
            // SAFETY: only zero bytes are written, which keeps it valid UTF-8.
            crate::rados::zeroize(unsafe { v.as_mut_vec() });
        }
    }
}

impl NodeService {
    /// A node service with these mappers; `default_mapper` serves volumes
    /// whose class names none. `state_dir` keeps an index from volume id to
    /// staging path, for calls that do not carry it.
    pub fn new(
        driver: Arc<Driver>,
        mappers: Vec<Arc<dyn Mapper>>,
        default_mapper: String,
        state_dir: PathBuf,
    ) -> NodeService {
        NodeService {
            driver,
            mappers,
            default_mapper,
            state_dir,
            default_fs: "ext4".to_owned(),
            read_affinity: ReadAffinityFlags::default(),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            header_oids: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The filesystem for mount volumes whose capability names none
    /// (default ext4).
    pub fn default_fs(mut self, fs_type: impl Into<String>) -> NodeService {
        self.default_fs = fs_type.into();
        self
    }

    /// Read affinity ([`crate::node::read_affinity`]): the flags, and the
    /// node's labels (`None` when they were not read).
    pub fn read_affinity(
        mut self,
        enabled: bool,
        labels: Vec<String>,
        node_labels: Option<std::collections::BTreeMap<String, String>>,
    ) -> NodeService {
        self.read_affinity = ReadAffinityFlags {
            enabled,
            labels,
            node_labels,
        };
        self
    }

    /// The read affinity map options for a volume of `cluster_id` (none when
    /// it is off for that cluster, or the node has none of the labels).
    fn read_affinity_options(&self, cluster_id: &str) -> Vec<String> {
        use crate::node::read_affinity as ra;
        let config = self.driver.clusters.config();
        let entry = config
            .read_affinity(cluster_id)
            .map(|r| (r.enabled, r.crush_location_labels.as_slice()));
        let flags = &self.read_affinity;
        let labels = ra::labels_for(entry, (flags.enabled, &flags.labels));
        if labels.is_empty() {
            return Vec::new();
        }
        let Some(node_labels) = &flags.node_labels else {
            tracing::warn!(
                cluster = cluster_id,
                "read affinity is on for this cluster, but the node's labels were not read at start (restart the node plugin); mapping without it"
            );
            return Vec::new();
        };
        ra::map_options(&ra::crush_location(labels, node_labels))
    }

    /// The mapper of a stashed volume, told which cluster it is of.
    fn stashed_mapper(&self, stash: &Stash) -> Result<Arc<dyn Mapper>, Status> {
        let m = self.mapper(&stash.mapper)?;
        if let Some(fsid) = &stash.cluster_fsid {
            m.adopt(&stash.volume_id, fsid);
        }
        Ok(m)
    }

    /// The fsid of the volume's cluster and the image's features: which
    /// mapping is the volume's, and what a mapper must support to map it.
    async fn image_facts(
        &self,
        vol: &VolumeId,
        secrets: &HashMap<String, String>,
    ) -> Result<(String, crate::rbd::Features, IoMax), Status> {
        let conn = self.driver.connect(&vol.cluster_id, secrets).await?;
        let v = vol.clone();
        self.driver
            .ceph(&conn, move |c, _m| {
                let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
                let img = crate::rbd::Image::open_read_only(&io, &v.image)?;
                let limits = crate::volume::qos::Limits::from_metadata(&img.metadata_list()?);
                Ok((c.fsid()?, img.features()?, io_max_of(&limits)))
            })
            .await
            .map_err(ceph_call_status)
    }

    /// krbd ignores librbd's QoS settings: a volume with limits gets them
    /// in the `io.max` of the publishing pod's cgroup, for its device
    /// ([`crate::node::cgroup_io`]). A limit that cannot be set is an
    /// error naming why, never silently dropped.
    async fn limit_krbd(&self, id: &str, st: &Stash, target: &Path) -> Result<(), Status> {
        let Some(max) = st.io_max.filter(|m| !m.is_empty()) else {
            return Ok(());
        };
        let Some(dev) = st.device.clone().filter(|_| st.mapper == "krbd") else {
            return Ok(());
        };
        let uid = crate::node::cgroup_io::pod_uid(target).ok_or_else(|| {
            Status::failed_precondition(format!(
                "volume {id} has QoS limits, which krbd enforces through the pod's cgroup, and \
                 target path {} names no pod (.../pods/<uid>/volumes/...)",
                target.display()
            ))
        })?;
        let root = self.cgroup_root.clone();
        let file = blocking(move || crate::node::cgroup_io::apply(&root, &uid, &dev, &max))
            .await
            .map_err(|e| {
                Status::failed_precondition(format!(
                    "volume {id} has QoS limits that krbd cannot enforce here: {}; map it with \
                     rbdkit-fuse (librbd enforces them) or enable cgroup v2's io controller",
                    e.message()
                ))
            })?;
        tracing::info!(volume = %id, file = %file.display(), limits = ?max, "krbd QoS limits set");
        Ok(())
    }

    /// For an encrypted volume (by its image's metadata, or its volume
    /// context): its passphrase from the KMS, after the image's LUKS2 header
    /// took it. A ceph-csi volume still `encryptionPrepared` gets its
    /// header here, only if its header region is all zeroes. `None` for a
    /// plain volume. A volume whose context says encrypted but whose image
    /// does not is refused: its data would be served as if it were
    /// plaintext.
    async fn stage_encryption(
        &self,
        vol: &VolumeId,
        id: &str,
        params: &NodeParams,
        secrets: &HashMap<String, String>,
        read_only: bool,
    ) -> Result<Option<crate::rados::Secret>, Status> {
        use crate::volume::encryption::{self, State};
        use crate::volume::kms::{META_KMS_ID, META_STATE};
        let conn = self.driver.connect(&vol.cluster_id, secrets).await?;
        let v = vol.clone();
        let meta = self
            .driver
            .ceph(&conn, move |c, _m| {
                let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
                Ok(crate::rbd::Image::open_read_only(&io, &v.image)?.metadata_list()?)
            })
            .await
            .map_err(ceph_call_status)?;
        let state = encryption::state_of(&meta, &vol.image).map_err(|e| status_of(&e))?;
        match (state, &params.encryption_kms) {
            (State::Plain, None) => return Ok(None),
            (State::Plain, Some(_)) => {
                return Err(Status::failed_precondition(format!(
                    "volume {id}: its volume context says it is encrypted, but image {vol} has \
                     no {META_STATE} metadata; refusing to stage it (nothing was formatted)"
                )))
            }
            (State::Prepared, _) if read_only => {
                return Err(Status::failed_precondition(format!(
                    "volume {id} is encrypted but has no LUKS2 header yet ({META_STATE} is \
                     encryptionPrepared), and it is staged read-only: it cannot be formatted"
                )))
            }
            _ => {}
        }
        let kms_id = meta
            .get(META_KMS_ID)
            .cloned()
            .or_else(|| params.encryption_kms.clone())
            .unwrap_or_else(|| crate::volume::kms::DEFAULT_KMS_ID.to_owned());
        let key_id = encryption::key_id_of(&meta, id);
        // A Vault KMS: the key stored under the volume id, for the tenant
        // the image records (the claim's namespace).
        let tenant = encryption::key_record(&meta, &vol.image, id)
            .map_err(|e| status_of(&e))?
            .tenant;
        let given = match self
            .driver
            .key_store(&kms_id, tenant.as_deref(), secrets)
            .await?
        {
            None => None,
            Some(store) => Some(store.get(&key_id).await.map_err(|e| {
                if e.kind() == crate::ErrorKind::NotFound {
                    Status::failed_precondition(format!(
                        "volume {id} is encrypted, and its passphrase is not in KMS {kms_id:?}: {e}"
                    ))
                } else {
                    status_of(&e)
                }
            })?),
        };
        let keys = self.driver.kms_keys(&kms_id, secrets, given)?;
        let image = vol.image.clone();
        let passphrase = tokio::task::spawn_blocking(move || {
            encryption::passphrase_of(&meta, &image, &key_id, &keys)
        })
        .await
        .map_err(|e| Status::internal(format!("node task failed: {e}")))?
        .map_err(|e| status_of(&e))?;
        let (v, p) = (vol.clone(), passphrase.clone());
        self.driver
            .ceph(&conn, move |c, _m| {
                let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
                let image = if state == State::Prepared {
                    crate::rbd::Image::open(&io, &v.image)?
                } else {
                    crate::rbd::Image::open_read_only(&io, &v.image)?
                };
                encryption::open_for_stage(
                    &image,
                    state,
                    &p,
                    &crate::volume::luks::FormatOptions::default(),
                )?;
                Ok(())
            })
            .await
            .map_err(ceph_call_status)?;
        Ok(Some(passphrase))
    }

    /// The mappers a stage tries, in order (the class's `mounter`, or the
    /// node's default; with `tryOtherMounters` the others after it), with
    /// each one's map and unmap options, checked before anything is done.
    #[allow(clippy::type_complexity)]
    fn candidates(
        &self,
        params: &NodeParams,
        ctx: &std::collections::BTreeMap<String, String>,
        cluster_id: &str,
    ) -> Result<
        (
            String,
            Vec<Arc<dyn Mapper>>,
            HashMap<&'static str, (Vec<String>, Vec<String>)>,
        ),
        Status,
    > {
        let name = params
            .mounter
            .clone()
            .unwrap_or_else(|| self.default_mapper.clone());
        let mut candidates = vec![self.mapper(&name)?];
        if params.try_other_mounters {
            candidates.extend(self.mappers.iter().filter(|m| m.name() != name).cloned());
        }
        let read_affinity = self.read_affinity_options(cluster_id);
        let mut opts = HashMap::new();
        for m in &candidates {
            let mut map = mapper_options(ctx, MAP_OPTIONS, m.name())?;
            crate::node::read_affinity::add_to(&mut map, &read_affinity);
            let unmap = mapper_options(ctx, UNMAP_OPTIONS, m.name())?;
            opts.insert(m.name(), (map, unmap));
        }
        Ok((name, candidates, opts))
    }

    /// Whether the volume is staged already as asked (`want`: filesystem,
    /// read-only, access mode, mount flags) and mounted: a repeat after
    /// success, or kubelet retrying. Staged with another capability is
    /// ALREADY_EXISTS. After a restart of this server it learns the
    /// credentials here: unstaging needs them to release the lock.
    async fn already_staged(
        &self,
        at: &StageAt<'_>,
        secrets: &HashMap<String, String>,
        stash: &Stash,
        want: (Option<&str>, bool, i32, &[String]),
    ) -> Result<bool, Status> {
        if stash.device.is_none() {
            return Ok(false);
        }
        let (fs_type, read_only, mode, flags) = want;
        if !stash.compatible(fs_type, read_only, mode, flags) {
            return Err(Status::already_exists(format!(
                "volume {} is staged at {} with another capability (was: {}{}, {}); unstage \
                 it first",
                at.id,
                at.staging.display(),
                stash.fs_type.as_deref().unwrap_or("block"),
                stash
                    .access_mode
                    .map(|m| format!(", access mode {m}"))
                    .unwrap_or_default(),
                if stash.read_only {
                    "read-only"
                } else {
                    "read-write"
                },
            )));
        }
        let t = at.staging.join(VOLUME);
        if !blocking(move || mount::is_mount_point(&t)).await? {
            return Ok(false);
        }
        let cluster = &at.vol.cluster_id;
        if !self.driver.clusters_known().contains(cluster)
            && self.driver.connect(cluster, secrets).await.is_ok()
        {
            self.release_pending(cluster, secrets, at.id).await;
        }
        Ok(true)
    }

    /// Maps the volume with the first of `candidates` that can, each try
    /// recorded in the stash first. `Ok(Err(_))`: none could, nothing is
    /// mapped (the last one's error, for the caller to abandon the stage
    /// with); `Err(_)`: a failed map could not be undone either (the stage
    /// keeps its lock and record).
    async fn map_first(
        &self,
        at: &StageAt<'_>,
        candidates: Vec<Arc<dyn Mapper>>,
        mapper_opts: &HashMap<&'static str, (Vec<String>, Vec<String>)>,
        template: &MapSpec,
        stash: &mut Stash,
    ) -> Result<Result<(Arc<dyn Mapper>, PathBuf), Status>, Status> {
        let (id, vol) = (at.id, at.vol);
        let mut last_err = None;
        for m in candidates {
            let (options, unmap_options) = mapper_opts.get(m.name()).cloned().unwrap_or_default();
            stash.mapper = m.name().to_owned();
            stash.unmap_options = unmap_options;
            stash.write(at.staging)?;
            let mut spec = template.clone();
            spec.options = options;
            // Only a mapper that decrypts gets the passphrase; the others
            // map the ciphertext for dm-crypt.
            spec.encryption = spec.encryption.filter(|_| m.decrypts());
            let m2 = Arc::clone(&m);
            let e = match blocking(move || m2.map(&spec)).await {
                Ok(dev) => return Ok(Ok((m, dev))),
                Err(e) => e,
            };
            tracing::warn!(volume = %vol, mapper = m.name(), error = %e.message(), "map failed");
            // A map this side gave up on (a client timeout) may still
            // complete in the mapper: undone here, so nothing stays mapped
            // that no stash knows. A refusal did nothing (and AlreadyExists
            // names a mapping that is not this stage's to undo).
            let refused = matches!(
                e.code(),
                Code::AlreadyExists
                    | Code::InvalidArgument
                    | Code::FailedPrecondition
                    | Code::NotFound
                    | Code::PermissionDenied
            );
            if !refused {
                let (m3, id3, uo) = (Arc::clone(&m), id.to_owned(), stash.unmap_options.clone());
                if let Err(u) = blocking(move || m3.unmap(&id3, &uo)).await {
                    return Err(Status::unavailable(format!(
                        "map of image {vol} with {} failed ({}), and undoing it failed too \
                         ({}); the stage keeps its lock and record: NodeStage again, or \
                         NodeUnstage, cleans it up",
                        m.name(),
                        e.message(),
                        u.message()
                    )));
                }
            }
            last_err = Some(e);
        }
        Ok(Err(last_err.unwrap_or_else(|| {
            Status::internal("no mapper could map the image")
        })))
    }

    /// The staging lock checked again once the image is mapped: another
    /// node may have taken it in between (broken it as a dead node's). Lost,
    /// a mapping this stage made (`unmap`: its mapper and unmap options) is
    /// undone, and the stage aborted with nothing written. Held, this
    /// node's new data-path clients (watchers since `before`) are recorded,
    /// to be fenced before a node that finds this one dead breaks its lock.
    async fn confirm_lock(
        &self,
        at: &StageAt<'_>,
        secrets: &HashMap<String, String>,
        lm: LockMode,
        unmap: Option<(Arc<dyn Mapper>, Vec<String>)>,
        before: &[String],
    ) -> Result<(), Status> {
        let (id, vol) = (at.id, at.vol);
        let n = self.driver.node_id.clone();
        let check = self
            .with_lock(vol, secrets, move |l| Ok((l.holds(lm, &n)?, l.watchers()?)))
            .await;
        let after = match check {
            Ok((true, after)) => after,
            Ok((false, _)) | Err(_) => {
                let why = match check {
                    Err(e) => format!("cannot check it: {}", e.message()),
                    _ => "another node took it".to_owned(),
                };
                if let Some((m, opts)) = unmap {
                    let id2 = id.to_owned();
                    blocking(move || m.unmap(&id2, &opts)).await?;
                    Stash::remove(at.staging)?;
                    self.forget(id);
                }
                return Err(Status::aborted(format!(
                    "the staging lock of image {vol} was lost while mapping it ({why}); \
                     nothing was written"
                )));
            }
        };
        if unmap.is_some() {
            let mine: Vec<String> = after.into_iter().filter(|w| !before.contains(w)).collect();
            self.record_own_watchers(id, &mine);
            let (n, all) = (self.driver.node_id.clone(), self.own_watchers(id));
            if let Err(e) = self
                .with_lock(vol, secrets, move |l| l.record_clients(&n, &all))
                .await
            {
                tracing::warn!(volume = %vol, error = %e.message(), "cannot record the data-path clients");
            }
        }
        Ok(())
    }

    fn mapper(&self, name: &str) -> Result<Arc<dyn Mapper>, Status> {
        self.mappers
            .iter()
            .find(|m| m.name() == name)
            .cloned()
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "mapper {name:?} is not available on node {}",
                    self.driver.node_id
                ))
            })
    }

    fn index_path(&self, volume_id: &str) -> PathBuf {
        let safe: String = volume_id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.state_dir.join("staged").join(format!("{safe}.path"))
    }

    fn remember(&self, volume_id: &str, staging: &Path) -> Result<(), Status> {
        let p = self.index_path(volume_id);
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| Status::internal(format!("cannot create {}: {e}", dir.display())))?;
        }
        write_atomic(&p, staging.as_os_str().as_encoded_bytes())
            .map_err(|e| Status::internal(format!("cannot write {}: {e}", p.display())))
    }

    fn own_watchers_path(&self, volume_id: &str) -> PathBuf {
        self.index_path(volume_id).with_extension("watchers")
    }

    /// The watcher addresses this node's mappers had on the image, kept
    /// across unstaging so a dead mapper's lingering watch is recognised.
    fn own_watchers(&self, volume_id: &str) -> Vec<String> {
        std::fs::read_to_string(self.own_watchers_path(volume_id))
            .map(|t| t.lines().map(str::to_owned).collect())
            .unwrap_or_default()
    }

    /// Adds `watchers` to this node's own, keeping the latest 32.
    fn record_own_watchers(&self, volume_id: &str, watchers: &[String]) {
        let mut all = self.own_watchers(volume_id);
        all.retain(|w| !watchers.contains(w));
        all.extend(watchers.iter().cloned());
        let keep = all.len().saturating_sub(32);
        let p = self.own_watchers_path(volume_id);
        if let Err(e) = write_atomic(&p, all[keep..].join("\n").as_bytes()) {
            tracing::warn!(path = %p.display(), error = %e, "cannot record own watchers");
        }
    }

    /// Runs `f` on the staging lock of `vol`'s image, on the blocking pool,
    /// with the credentials in `secrets` (or those known from an earlier
    /// call).
    async fn with_lock<T: Send + 'static>(
        &self,
        vol: &VolumeId,
        secrets: &HashMap<String, String>,
        f: impl FnOnce(&ImageLock) -> crate::Result<T> + Send + 'static,
    ) -> Result<T, Status> {
        let conn = self.driver.connect(&vol.cluster_id, secrets).await?;
        self.lock_on(&conn, vol, f).await
    }

    /// [`NodeService::with_lock`] on a connection at hand.
    async fn lock_on<T: Send + 'static>(
        &self,
        conn: &crate::volume::clusters::Conn,
        vol: &VolumeId,
        f: impl FnOnce(&ImageLock) -> crate::Result<T> + Send + 'static,
    ) -> Result<T, Status> {
        let v = vol.clone();
        self.driver
            .ceph(conn, move |c, _m| {
                let lock = ImageLock::open(c, &v.pool, &v.rados_namespace, &v.image)?;
                Ok(f(&lock)?)
            })
            .await
            .map_err(ceph_call_status)
    }

    /// Takes the staging lock of `vol` in `mode` for this node. Another
    /// node's lock is a FAILED_PRECONDITION naming it and saying how a dead
    /// node's lock is broken.
    async fn take_lock(
        &self,
        vol: &VolumeId,
        secrets: &HashMap<String, String>,
        mode: LockMode,
        mapped_here: bool,
    ) -> Result<(), Status> {
        let node = self.driver.node_id.clone();
        for round in 0..3 {
            let n = node.clone();
            let got = self
                .with_lock(vol, secrets, move |l| {
                    // A non-primary mirror copy is read-only until promoted:
                    // refused before anything is taken or mapped.
                    if l.mirror_role() == MirrorRole::NonPrimary {
                        return Ok(None);
                    }
                    l.acquire(mode, &n).map(Some)
                })
                .await?;
            let Some(got) = got else {
                return Err(Status::failed_precondition(format!(
                    "image {vol} is a non-primary RBD mirror copy (its primary is at another \
                     site); promote it here first (a VolumeReplication with replicationState \
                     primary) or stage it read-only"
                )));
            };
            let holders = match got {
                Acquired::Taken | Acquired::Ours => return Ok(()),
                Acquired::OursInOtherMode if !mapped_here && round == 0 => {
                    // An interrupted stage with another capability: nothing
                    // of it is mapped, so its lock can go.
                    let n = node.clone();
                    self.with_lock(vol, secrets, move |l| l.release(&n)).await?;
                    continue;
                }
                Acquired::OursInOtherMode => {
                    return Err(Status::failed_precondition(format!(
                    "image {vol} is staged on this node with another access mode; unstage it first"
                )))
                }
                Acquired::Refused(h) => h,
            };
            let who = stage_lock::describe(&holders);
            return Err(Status::failed_precondition(format!(
                "image {vol} is locked for staging by {who} (lock {:?} on its header): it is \
                 staged there, and a read-write volume is staged on one node at a time \
                 (unstage it there first). If that node is dead, taint it: kubectl taint \
                 node NODE node.kubernetes.io/out-of-service=nodeshutdown:NoExecute; the \
                 provisioner then fences it and breaks its locks.",
                stage_lock::LOCK_NAME
            )));
        }
        Err(Status::aborted(format!(
            "the staging lock of image {vol} kept changing hands; try again"
        )))
    }

    fn pending_dir(&self) -> PathBuf {
        self.state_dir.join("release")
    }

    /// Releases this node's staging lock of `id` as `user`, the Ceph user
    /// that staged it (any user known for the cluster, for a stash of an
    /// older version that names none), with the credentials known from
    /// earlier calls. With none (this server restarted since), the release
    /// is recorded and done by the next call that brings that user's
    /// credentials for the cluster.
    async fn release_lock(&self, id: &str, user: Option<&str>) -> Result<(), Status> {
        let vol = volume_id(id)?;
        let conn = match user {
            Some(u) => self.driver.connect_as(&vol.cluster_id, u).await?,
            None if self.driver.clusters_known().contains(&vol.cluster_id) => Some(
                self.driver
                    .connect(&vol.cluster_id, &HashMap::new())
                    .await?,
            ),
            None => None,
        };
        let Some(conn) = conn else {
            let p = self
                .pending_dir()
                .join(self.index_path(id).file_name().unwrap_or_default());
            let record = format!("{id}\n{}", user.unwrap_or_default());
            std::fs::create_dir_all(self.pending_dir())
                .and_then(|()| write_atomic(&p, record.as_bytes()))
                .map_err(|e| io_status("write", &p, e))?;
            tracing::warn!(volume = %vol, user = ?user,
                "no credentials of the user that staged it since this server started: the staging lock is released at the next call that brings them");
            return Ok(());
        };
        let node = self.driver.node_id.clone();
        match self.lock_on(&conn, &vol, move |l| l.release(&node)).await {
            // The image is gone, and its lock with its header.
            Err(s) if s.code() == tonic::Code::NotFound => Ok(()),
            other => other,
        }
    }

    /// Does the releases [`NodeService::release_lock`] had to defer, for
    /// the cluster and user `secrets` are for (best effort: a failure is
    /// retried next time). `staging_now` is left alone: its stage takes
    /// the lock.
    async fn release_pending(
        &self,
        cluster_id: &str,
        secrets: &HashMap<String, String>,
        staging_now: &str,
    ) {
        let Ok(entries) = std::fs::read_dir(self.pending_dir()) else {
            return;
        };
        let Ok(Some(creds)) = credentials(secrets) else {
            return;
        };
        for e in entries.flatten() {
            let Ok(text) = std::fs::read_to_string(e.path()) else {
                continue;
            };
            let (id, user) = text.split_once('\n').unwrap_or((text.as_str(), ""));
            let Ok(vol) = VolumeId::parse(id) else {
                let _ = std::fs::remove_file(e.path());
                continue;
            };
            // Another user's release waits for that user's credentials.
            if vol.cluster_id != cluster_id || (!user.is_empty() && user != creds.user) {
                continue;
            }
            let done = if id == staging_now {
                Ok(())
            } else {
                let node = self.driver.node_id.clone();
                self.with_lock(&vol, secrets, move |l| l.release(&node))
                    .await
            };
            match done {
                Ok(()) => {
                    let _ = std::fs::remove_file(e.path());
                    tracing::info!(volume = %vol, "released a deferred staging lock");
                }
                Err(s) if s.code() == tonic::Code::NotFound => {
                    let _ = std::fs::remove_file(e.path());
                }
                Err(s) => {
                    tracing::warn!(volume = %vol, error = %s.message(), "deferred staging lock release failed; retried later")
                }
            }
        }
    }

    fn forget(&self, volume_id: &str) {
        let _ = std::fs::remove_file(self.index_path(volume_id));
    }

    /// The staging path of a volume: the request's, or the one recorded at
    /// staging.
    /// What is wrong with staged volume `id`, from this node's side: empty
    /// when nothing is. `publish` is a target path to read (else the staging
    /// mount is read). NOT_FOUND when the volume is not staged here.
    async fn health_of(
        &self,
        id: &str,
        publish: &str,
        staging: &str,
    ) -> Result<Vec<VolumeHealthEntry>, Status> {
        let not_staged = || Status::not_found(format!("volume {id} is not staged on this node"));
        let staging = self.staging_of(id, staging).ok_or_else(not_staged)?;
        let stash = Stash::read(&staging)?
            .filter(|s| s.volume_id == id)
            .ok_or_else(not_staged)?;
        let entry =
            |status: VolumeHealthErrorType, reason: &str, message: String| VolumeHealthEntry {
                status: status as i32,
                reason: reason.to_owned(),
                message,
            };
        let mut out = Vec::new();
        match (self.stashed_mapper(&stash), stash.device.clone()) {
            (Ok(m), Some(dev)) => {
                let id2 = id.to_owned();
                let checked = tokio::task::spawn_blocking(move || m.check(&id2, &dev))
                    .await
                    .unwrap_or_else(|e| Err(format!("health check failed: {e}")));
                if let Err(why) = checked {
                    out.push(entry(
                        VolumeHealthErrorType::Inaccessible,
                        "MappingFailed",
                        why,
                    ));
                }
            }
            (Err(e), _) => out.push(entry(
                VolumeHealthErrorType::Inaccessible,
                "MapperUnavailable",
                e.message().to_owned(),
            )),
            (_, None) => out.push(entry(
                VolumeHealthErrorType::Inaccessible,
                "NotMapped",
                format!("volume {id} is staged but its image is not mapped"),
            )),
        }
        let path = if publish.is_empty() {
            staging.join(VOLUME)
        } else {
            PathBuf::from(publish)
        };
        let p = path.clone();
        let read = if stash.fs_type.is_some() {
            blocking(move || fs::stats(&p).map(|st| st.read_only)).await
        } else {
            blocking(move || fs::device_size(&p).map(|_| false)).await
        };
        match read {
            Ok(read_only) if read_only && !stash.read_only => out.push(entry(
                VolumeHealthErrorType::Degraded,
                "FilesystemReadOnly",
                format!(
                    "the filesystem at {} is read-only though staged read-write (remounted so after an I/O error?)",
                    path.display()
                ),
            )),
            Ok(_) => {}
            Err(e) => out.push(entry(
                VolumeHealthErrorType::Inaccessible,
                "VolumePathUnreadable",
                e.message().to_owned(),
            )),
        }
        Ok(out)
    }

    fn staging_of(&self, volume_id: &str, given: &str) -> Option<PathBuf> {
        if !given.is_empty() {
            return Some(PathBuf::from(given));
        }
        std::fs::read_to_string(self.index_path(volume_id))
            .ok()
            .map(PathBuf::from)
    }
}

impl NodeService {
    /// Answers the space reclaim requests for the volumes staged here
    /// read-write (csi-addons ReclaimSpaceJobs, relayed by the provisioner
    /// through the image header: [`stage_lock::ImageLock::request_reclaim`]):
    /// `fstrim` of a staged filesystem ([`fs::trim`], bounded by
    /// [`fs::TRIM_TIMEOUT`]); nothing for a Block volume, whose free space
    /// only its user knows (`blkdiscard` would erase it; the user's own
    /// discards reach the image as they are issued). One xattr read of the
    /// image's header object per staged volume (the object's name is read
    /// once per stage), as the Ceph user that staged it, with the credentials
    /// an earlier call brought (a volume of a user none has brought since
    /// this server started waits for one). A request answered already (the
    /// same id) is not run again, and a volume busy with another call is
    /// left for the next pass. Returns how many requests it answered.
    pub async fn reclaim_pass(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(self.state_dir.join("staged")) else {
            return 0;
        };
        let mut answered = 0;
        let mut staged = std::collections::HashSet::new();
        for entry in entries.flatten() {
            let p = entry.path();
            if p.extension().and_then(|e| e.to_str()) != Some("path") {
                continue;
            }
            let Ok(staging) =
                std::fs::read(&p).map(|b| PathBuf::from(String::from_utf8_lossy(&b).into_owned()))
            else {
                continue;
            };
            let Ok(Some(stash)) = Stash::read(&staging) else {
                continue;
            };
            if stash.read_only || stash.lock.is_none() || stash.device.is_none() {
                continue;
            }
            staged.insert(stash.volume_id.clone());
            match self.answer_reclaim(&stash, &staging).await {
                Ok(true) => answered += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(volume = %stash.volume_id, error = %e.message(), "space reclaim request not answered; looked at again next pass")
                }
            }
        }
        self.header_oids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|id, _| staged.contains(id));
        answered
    }

    /// Answers the reclaim request of one staged volume, if it has a new
    /// one: `Ok(true)` when it answered.
    async fn answer_reclaim(&self, stash: &Stash, staging: &Path) -> Result<bool, Status> {
        let vol = volume_id(&stash.volume_id)?;
        let conn = match stash.user.as_deref() {
            Some(u) => self.driver.connect_as(&vol.cluster_id, u).await?,
            None if self.driver.clusters_known().contains(&vol.cluster_id) => Some(
                self.driver
                    .connect(&vol.cluster_id, &HashMap::new())
                    .await?,
            ),
            None => None,
        };
        let Some(conn) = conn else {
            return Ok(false);
        };
        let cached = self
            .header_oids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&stash.volume_id)
            .cloned();
        let oid = match cached {
            Some(o) => o,
            None => {
                let o = self
                    .lock_on(&conn, &vol, |l| Ok(l.oid().to_owned()))
                    .await?;
                self.header_oids
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(stash.volume_id.clone(), o.clone());
                o
            }
        };
        let n = self.driver.node_id.clone();
        let (v, o) = (vol.clone(), oid.clone());
        let (asked, done) = self
            .driver
            .ceph(&conn, move |c, _m| {
                let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
                let Some(id) = stage_lock::reclaim_request_at(&io, &o, &n)? else {
                    return Ok((None, None));
                };
                Ok((Some(id), stage_lock::reclaim_done_at(&io, &o, &n)?))
            })
            .await
            .map_err(ceph_call_status)?;
        let id = match (asked, done) {
            (Some(id), Some(d)) if d.id == id => {
                // Answered, but the request not taken away (a crash in
                // between): take it away now.
                self.record_reclaim_answer(&conn, &vol, &oid, d).await?;
                return Ok(false);
            }
            (Some(id), _) => id,
            (None, _) => return Ok(false),
        };
        // Busy with a stage, unstage or expansion: the next pass.
        let Ok(_busy) = self.driver.begin(&stash.volume_id) else {
            return Ok(false);
        };
        // Unstaged since it was read: nothing to trim.
        if Stash::read(staging)?.is_none_or(|s| s.volume_id != stash.volume_id) {
            return Ok(false);
        }
        let answer = match &stash.fs_type {
            None => stage_lock::ReclaimDone {
                id,
                ok: true,
                message: "a Block volume: its free space is known only to its user, \
                          whose discards reach the image as they are issued; nothing trimmed"
                    .into(),
                trimmed: 0,
            },
            Some(_) => {
                let target = staging.join(VOLUME);
                let started = std::time::Instant::now();
                let trimmed = blocking(move || {
                    // Never the filesystem under an unmounted mount point.
                    if !mount::is_mount_point(&target)? {
                        return Err(Error::invalid(
                            "fstrim",
                            target.display().to_string(),
                            "the volume's filesystem is not mounted there",
                        ));
                    }
                    fs::trim(&target, fs::TRIM_TIMEOUT)
                })
                .await;
                match trimmed {
                    Ok(bytes) => stage_lock::ReclaimDone {
                        id,
                        ok: true,
                        message: format!(
                            "fstrim trimmed {bytes} bytes in {} ms",
                            started.elapsed().as_millis()
                        ),
                        trimmed: bytes,
                    },
                    Err(e) => stage_lock::ReclaimDone {
                        id,
                        ok: false,
                        message: format!("fstrim failed: {}", e.message()),
                        trimmed: 0,
                    },
                }
            }
        };
        tracing::info!(volume = %vol, ok = answer.ok, message = %answer.message, "space reclaim request answered");
        self.record_reclaim_answer(&conn, &vol, &oid, answer)
            .await?;
        Ok(true)
    }

    /// Writes this node's answer to a reclaim request on the header object
    /// `oid` and takes the request away ([`stage_lock::answer_reclaim_at`]).
    async fn record_reclaim_answer(
        &self,
        conn: &crate::volume::clusters::Conn,
        vol: &VolumeId,
        oid: &str,
        answer: stage_lock::ReclaimDone,
    ) -> Result<(), Status> {
        let n = self.driver.node_id.clone();
        let (v, o) = (vol.clone(), oid.to_owned());
        self.driver
            .ceph(conn, move |c, _m| {
                let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
                Ok(stage_lock::answer_reclaim_at(&io, &o, &n, &answer)?)
            })
            .await
            .map_err(ceph_call_status)
    }

    /// Runs [`NodeService::reclaim_pass`] every `interval` until `stop`.
    pub async fn run_reclaim(
        self: Arc<Self>,
        interval: Duration,
        stop: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => return,
                _ = tokio::time::sleep(interval) => {}
            }
            self.reclaim_pass().await;
        }
    }
}

/// The volumes staged on this node per mapper, from the index under
/// `state_dir` and each one's stash (for the metrics). An entry whose
/// stash names no mapped device (a stage cut short) is not counted.
pub fn staged_volumes(state_dir: &Path) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(state_dir.join("staged")) else {
        return out;
    };
    for e in entries.flatten() {
        if e.path().extension().and_then(|x| x.to_str()) != Some("path") {
            continue;
        }
        let mapper = std::fs::read(e.path())
            .ok()
            .map(|b| PathBuf::from(String::from_utf8_lossy(&b).into_owned()))
            .and_then(|staging| Stash::read(&staging).ok().flatten())
            .filter(|st| st.device.is_some())
            .map(|st| st.mapper);
        if let Some(m) = mapper {
            *out.entry(m).or_insert(0) += 1;
        }
    }
    out
}

/// The `io.max` of librbd's limits: each direction gets the lower of its
/// own limit and the combined one (io.max has no combined limit).
fn io_max_of(limits: &crate::volume::qos::Limits) -> IoMax {
    use crate::volume::qos::Kind;
    IoMax::from_limits(
        limits.get(Kind::Iops),
        limits.get(Kind::ReadIops),
        limits.get(Kind::WriteIops),
        limits.get(Kind::Bps),
        limits.get(Kind::ReadBps),
        limits.get(Kind::WriteBps),
    )
}

/// Which stage a step works for: the volume, its image and staging path.
struct StageAt<'a> {
    id: &'a str,
    vol: &'a VolumeId,
    staging: &'a Path,
}

/// The staged volume put at `target`: `device` bound there (Block, `fs`
/// `None`), or its filesystem (`fs`: type, mkfs options, mount flags) made
/// if the device is blank and mounted there. A blank volume staged
/// read-only is refused: it cannot be formatted.
async fn put_in_place(
    device: &Path,
    target: &Path,
    read_only: bool,
    fs: Option<(String, Vec<String>, Vec<String>)>,
) -> Result<(), Status> {
    let (d, t) = (device.to_path_buf(), target.to_path_buf());
    let Some((fs_type, mkfs, flags)) = fs else {
        ensure_file(target).map_err(|e| io_status("create", target, e))?;
        return blocking(move || mount::ensure_bind(&d, &t, read_only)).await;
    };
    std::fs::create_dir_all(target).map_err(|e| io_status("create", target, e))?;
    blocking(move || {
        if read_only && !mount::is_mount_point(&t)? && fs::probe(&d)? == fs::Probe::Blank {
            return Err(Error::invalid(
                "NodeStageVolume",
                d.display().to_string(),
                "the volume is blank and staged read-only: it cannot be formatted",
            ));
        }
        let mut opts = flags;
        if read_only {
            opts.push("ro".to_owned());
        }
        fs::format_and_mount(&d, &t, &fs_type, &mkfs, &opts)
    })
    .await
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> crate::Result<T> + Send + 'static,
) -> Result<T, Status> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(status_of(&e)),
        Err(e) => Err(Status::internal(format!("node task failed: {e}"))),
    }
}

fn is_block(cap: &VolumeCapability) -> bool {
    matches!(
        cap.access_type,
        Some(volume_capability::AccessType::Block(_))
    )
}

fn is_read_only(cap: &VolumeCapability) -> bool {
    use volume_capability::access_mode::Mode;
    matches!(
        cap.access_mode
            .as_ref()
            .and_then(|m| Mode::try_from(m.mode).ok()),
        Some(Mode::SingleNodeReaderOnly) | Some(Mode::MultiNodeReaderOnly)
    )
}

fn mount_of(cap: &VolumeCapability, default_fs: &str) -> (String, Vec<String>) {
    match &cap.access_type {
        Some(volume_capability::AccessType::Mount(m)) => (
            if m.fs_type.is_empty() {
                default_fs.to_owned()
            } else {
                m.fs_type.clone()
            },
            m.mount_flags.clone(),
        ),
        _ => (default_fs.to_owned(), Vec::new()),
    }
}

fn is_single_writer(cap: &VolumeCapability) -> bool {
    use volume_capability::access_mode::Mode;
    cap.access_mode.as_ref().map(|m| m.mode) == Some(Mode::SingleNodeSingleWriter as i32)
}

/// The staging lock a read-write stage takes: shared for multi-node
/// multi-writer Block (several nodes, as KubeVirt's live migration needs),
/// exclusive for everything else.
fn lock_mode_of(cap: &VolumeCapability) -> LockMode {
    use volume_capability::access_mode::Mode;
    let mode = cap.access_mode.as_ref().map(|m| m.mode);
    if is_block(cap) && mode == Some(Mode::MultiNodeMultiWriter as i32) {
        LockMode::Shared
    } else {
        LockMode::Exclusive
    }
}

/// Makes sure a regular file exists at `path` (a bind-mount target for a
/// block device).
fn ensure_file(path: &Path) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
    {
        Ok(_) => Ok(()),
        // Already a bind-mounted device, or a directory left by a Filesystem
        // attempt: let the mount step report it.
        Err(_) if path.exists() => Ok(()),
        Err(e) => Err(e),
    }
}

/// This mapper's options from a `mapOptions`/`unmapOptions` context entry.
fn mapper_options(
    ctx: &std::collections::BTreeMap<String, String>,
    param: &'static str,
    mapper: &str,
) -> Result<Vec<String>, Status> {
    let kind = match mapper {
        "krbd" => options::MounterKind::Krbd,
        _ => options::MounterKind::Fuse,
    };
    options::options_for(
        ctx.get(param).map(String::as_str).unwrap_or(""),
        kind,
        param,
    )
    .map_err(|e| status_of(&e))
}

/// Unmounts everything at `target` and removes it (a directory, or the
/// file a block device was bound onto). Nothing there is fine.
async fn unmount_and_remove(target: &Path) -> Result<(), Status> {
    let t = target.to_owned();
    blocking(move || mount::ensure_unmounted(&t)).await?;
    if target.is_dir() {
        std::fs::remove_dir(target).map_err(|e| io_status("remove", target, e))?;
    } else if target.exists() {
        std::fs::remove_file(target).map_err(|e| io_status("remove", target, e))?;
    }
    Ok(())
}

fn io_status(what: &str, path: &Path, e: std::io::Error) -> Status {
    Status::internal(format!("cannot {what} {}: {e}", path.display()))
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        req: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let mut req = req.into_inner();
        let secrets = Secrets(std::mem::take(&mut req.secrets));
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let staging = PathBuf::from(required("staging_target_path", &req.staging_target_path)?);
        let cap = req
            .volume_capability
            .clone()
            .ok_or_else(|| Status::invalid_argument("volume_capability is missing"))?;
        let vol = volume_id(&id)?;
        let _busy = self.driver.begin(&id)?;
        let block = is_block(&cap);
        let read_only = is_read_only(&cap);
        let mode = cap.access_mode.as_ref().map_or(0, |m| m.mode);
        let target = staging.join(VOLUME);
        let ctx: std::collections::BTreeMap<String, String> =
            req.volume_context.clone().into_iter().collect();
        let node_params =
            NodeParams::from_context(&ctx).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let (fs_type, flags) = mount_of(&cap, &self.default_fs);
        let fs_type = (!block).then_some(fs_type);
        let mkfs = ctx
            .get(crate::volume::params::MKFS_OPTIONS)
            .map(|s| fs::parse_mkfs_options(s))
            .unwrap_or_default();
        // Bad input is refused before anything is done.
        if let Some(t) = &fs_type {
            fs::check_mkfs_options(t, &mkfs).map_err(|e| {
                Status::invalid_argument(format!("NodeStageVolume of volume {id}: {e}"))
            })?;
        }
        let (mapper_name, candidates, mapper_opts) =
            self.candidates(&node_params, &ctx, &vol.cluster_id)?;
        let lock_mode = match (read_only, lock_mode_of(&cap)) {
            (true, _) => None,
            (false, m) => Some(m),
        };

        // Done already (a repeat after success, or kubelet retrying)? With
        // another capability, that is ALREADY_EXISTS.
        let old_stash = Stash::read(&staging)?;
        if let Some(stash) = &old_stash {
            let at = StageAt {
                id: &id,
                vol: &vol,
                staging: &staging,
            };
            let want = (fs_type.as_deref(), read_only, mode, flags.as_slice());
            if self.already_staged(&at, &secrets.0, stash, want).await? {
                return Ok(Response::new(NodeStageVolumeResponse {}));
            }
        }
        if !staging.is_dir() {
            return Err(Status::not_found(format!(
                "staging_target_path {} does not exist",
                staging.display()
            )));
        }

        let creds = credentials(&secrets.0)?.ok_or_else(|| {
            Status::invalid_argument(
                "NodeStageVolume carries no secrets: the StorageClass must name a node-stage Secret with userID and userKey",
            )
        })?;
        let info = self.driver.cluster(&vol.cluster_id)?;
        self.release_pending(&vol.cluster_id, &secrets.0, &id).await;

        let (fsid, features, io_max) = self.image_facts(&vol, &secrets.0).await?;
        let mut already_mapped = None;
        for m in &candidates {
            m.adopt(&id, &fsid);
            let m2 = Arc::clone(m);
            let id2 = id.clone();
            if let Some(dev) = blocking(move || m2.find(&id2)).await? {
                already_mapped = Some((Arc::clone(m), dev));
                break;
            }
        }

        // The stash first: a crash from here on leaves what unstaging
        // needs (the lock to release, the mapping to undo).
        let mut stash = Stash {
            volume_id: id.clone(),
            mapper: mapper_name.clone(),
            device: None,
            fs_type: fs_type.clone(),
            read_only,
            unmap_options: Vec::new(),
            published: Vec::new(),
            access_mode: Some(mode),
            mount_flags: Some(flags.clone()),
            lock: lock_mode,
            cluster_fsid: Some(fsid.clone()),
            user: Some(creds.user.clone()),
            io_max: (!io_max.is_empty()).then_some(io_max),
            crypt: None,
        };
        if let Some(old) = &old_stash {
            stash.mapper = old.mapper.clone();
            stash.unmap_options = old.unmap_options.clone();
            stash.device = old.device.clone();
            stash.lock = old.lock.or(lock_mode);
            stash.user = old.user.clone().or(stash.user);
            stash.crypt = old.crypt.clone();
        }
        stash.write(&staging)?;
        let mapped_here = already_mapped.is_some();
        // Undoes this call's stash and lock when nothing is mapped here.
        let (id_r, staging_r, vol_r) = (&id, &staging, &vol);
        let user_r = stash.user.clone();
        let abandon = move |why: Status| async move {
            if !mapped_here {
                if lock_mode.is_some() {
                    if let Err(e) = self.release_lock(id_r, user_r.as_deref()).await {
                        tracing::warn!(volume = %vol_r, error = %e.message(), "cannot release the staging lock");
                    }
                }
                if let Err(e) = Stash::remove(staging_r) {
                    tracing::warn!(error = %e.message(), "cannot remove the stash");
                }
            }
            why
        };

        // Single writer: the lock before the map.
        if let Some(lm) = lock_mode {
            if let Err(e) = self.take_lock(&vol, &secrets.0, lm, mapped_here).await {
                // Not ours to release: only undo the stash.
                if !mapped_here {
                    Stash::remove(&staging)?;
                }
                return Err(e);
            }
        }
        // Who watches it before this node maps it. For a single writer, a
        // watcher that is not this node's is a client that maps it without
        // the lock (a node staged before the lock existed): refused.
        let before = if lock_mode.is_some() && !mapped_here {
            match self.with_lock(&vol, &secrets.0, |l| l.watchers()).await {
                Ok(w) => w,
                Err(e) => return Err(abandon(e).await),
            }
        } else {
            Vec::new()
        };
        if lock_mode == Some(LockMode::Exclusive) && !mapped_here {
            let own = self.own_watchers(&id);
            let mut foreign: Vec<String> = before
                .iter()
                .filter(|w| !own.contains(w))
                .cloned()
                .collect();
            if !foreign.is_empty() {
                // A mirrored primary: peer sites' rbd-mirror daemons watch it.
                let known = own.clone();
                foreign = match self
                    .with_lock(&vol, &secrets.0, move |l| l.data_path_watchers(&known))
                    .await
                {
                    Ok(w) => w.into_iter().filter(|w| !own.contains(w)).collect(),
                    Err(e) => return Err(abandon(e).await),
                };
            }
            if !foreign.is_empty() {
                let names: Vec<&str> = foreign.iter().map(|s| s.as_str()).collect();
                return Err(abandon(Status::failed_precondition(format!(
                    "image {vol} is already in use read-write by {} (a client that is not \
                     this node's; another node has it mapped); it can be staged read-write on \
                     one node only",
                    names.join(", ")
                )))
                .await);
            }
        }

        // An encrypted volume: its passphrase, its header checked (or,
        // for a ceph-csi volume not staged before, written, now that this
        // node holds the staging lock) before anything is mapped.
        let crypt = match self
            .stage_encryption(&vol, &id, &node_params, &secrets.0, read_only)
            .await
        {
            Ok(c) => c,
            Err(e) => return Err(abandon(e).await),
        };

        let (mapper, device) = match already_mapped {
            Some(found) => found,
            None => {
                let template = MapSpec {
                    volume_id: id.clone(),
                    monitors: info.monitors.clone(),
                    user: creds.user.clone(),
                    key: creds.key.clone(),
                    pool: vol.pool.clone(),
                    namespace: vol.rados_namespace.clone(),
                    image: vol.image.clone(),
                    cluster_fsid: Some(fsid.clone()),
                    features: Some(features),
                    snapshot: None,
                    read_only,
                    options: Vec::new(),
                    encryption: crypt.clone(),
                };
                let at = StageAt {
                    id: &id,
                    vol: &vol,
                    staging: &staging,
                };
                match self
                    .map_first(&at, candidates, &mapper_opts, &template, &mut stash)
                    .await?
                {
                    Ok(x) => x,
                    Err(e) => return Err(abandon(e).await),
                }
            }
        };
        stash.mapper = mapper.name().to_owned();
        stash.device = Some(device.clone());
        stash.write(&staging)?;
        self.remember(&id, &staging)?;

        // The lock again, now that the image is mapped: if another node took
        // it in between (broke it as a dead node's), this node must not
        // write. Only then mkfs and mount.
        if let Some(lm) = lock_mode {
            let at = StageAt {
                id: &id,
                vol: &vol,
                staging: &staging,
            };
            let unmap = (!mapped_here).then(|| (Arc::clone(&mapper), stash.unmap_options.clone()));
            self.confirm_lock(&at, &secrets.0, lm, unmap, &before)
                .await?;
        }

        // A mapper that does not decrypt (krbd): dm-crypt over its device,
        // recorded first so that unstaging closes it.
        let device = match (&crypt, mapper.decrypts()) {
            (Some(pass), false) => {
                let name = crate::node::dmcrypt::mapping_name(&id);
                stash.crypt = Some(name.clone());
                stash.write(&staging)?;
                let (d, p) = (device.clone(), pass.clone());
                blocking(move || crate::node::dmcrypt::open(&d, &name, &p)).await?
            }
            _ => device,
        };
        let fs_type = fs_type.map(|t| (t, mkfs, flags));
        put_in_place(&device, &target, read_only, fs_type).await?;
        tracing::info!(volume = %vol, device = %device.display(), staging = %staging.display(), lock = ?lock_mode, "NodeStageVolume done");
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        req: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let staging = PathBuf::from(required("staging_target_path", &req.staging_target_path)?);
        let _busy = self.driver.begin(&id)?;
        let target = staging.join(VOLUME);
        let stash = Stash::read(&staging)?;
        unmount_and_remove(&target).await?;
        let mut targets: Vec<(Arc<dyn Mapper>, Vec<String>)> = Vec::new();
        match &stash {
            Some(s) => targets.push((self.stashed_mapper(s)?, s.unmap_options.clone())),
            // No stash: a repeat after success, or a volume staged by
            // something else. The stash is written before any map, so only
            // a mapper that has the volume mapped now gets an unmap; one
            // that cannot answer (a mapper daemon that is down) holds
            // nothing of this node's staging.
            None => {
                for m in &self.mappers {
                    let (m2, id2) = (Arc::clone(m), id.clone());
                    match blocking(move || m2.find(&id2)).await {
                        Ok(Some(_)) => targets.push((Arc::clone(m), Vec::new())),
                        Ok(None) => {}
                        Err(e) => tracing::warn!(
                            volume = %id, mapper = m.name(), error = %e.message(),
                            "NodeUnstageVolume without a stash: this mapper cannot say whether it has the volume; skipped"
                        ),
                    }
                }
            }
        }
        // A mapper that keeps the stage's Ceph client (rbdkit-fuse)
        // releases the lock itself once unmapped: it has the credentials
        // the volume was staged with, which a restarted plugin lacks.
        // dm-crypt over a krbd device goes first: it holds the device.
        let crypt = match &stash {
            Some(s) => s.crypt.clone(),
            None => Some(crate::node::dmcrypt::mapping_name(&id))
                .filter(|n| crate::node::dmcrypt::device_of(n).exists()),
        };
        if let Some(name) = crypt {
            blocking(move || crate::node::dmcrypt::close(&name)).await?;
        }
        let locked = stash.as_ref().is_some_and(|s| s.lock.is_some());
        let mut released = false;
        for (m, opts) in targets {
            let (id2, node) = (id.clone(), self.driver.node_id.clone());
            released |= if locked {
                blocking(move || m.unmap_releasing(&id2, &opts, &node)).await?
            } else {
                blocking(move || m.unmap(&id2, &opts).map(|()| false)).await?
            };
        }
        // Unmapped: now another node may have it. A failure leaves the
        // stash, so kubelet's retry releases it.
        if locked && !released {
            let user = stash.as_ref().and_then(|s| s.user.clone());
            self.release_lock(&id, user.as_deref()).await?;
        }
        Stash::remove(&staging)?;
        self.forget(&id);
        tracing::info!(volume = %id, staging = %staging.display(), "NodeUnstageVolume done");
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        req: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let staging = PathBuf::from(required("staging_target_path", &req.staging_target_path)?);
        let target = PathBuf::from(required("target_path", &req.target_path)?);
        let cap = req
            .volume_capability
            .clone()
            .ok_or_else(|| Status::invalid_argument("volume_capability is missing"))?;
        volume_id(&id)?;
        let _busy = self.driver.begin(&id)?;
        let source = staging.join(VOLUME);
        let s = source.clone();
        if !blocking(move || mount::is_mount_point(&s)).await? {
            return Err(Status::failed_precondition(format!(
                "volume {id} is not staged at {}",
                staging.display()
            )));
        }
        let read_only = req.readonly || is_read_only(&cap);
        let mut stash = Stash::read(&staging)?;
        if let Some(st) = &stash {
            if is_single_writer(&cap) {
                let mut others = Vec::new();
                for t in st.published.iter().filter(|t| **t != target) {
                    let t2 = t.clone();
                    if blocking(move || mount::is_mount_point(&t2)).await? {
                        others.push(t.display().to_string());
                    }
                }
                if !others.is_empty() {
                    return Err(Status::failed_precondition(format!(
                        "volume {id} is single-writer and already published at {}",
                        others.join(", ")
                    )));
                }
            }
        }
        if is_block(&cap) {
            ensure_file(&target).map_err(|e| io_status("create", &target, e))?;
        } else {
            std::fs::create_dir_all(&target).map_err(|e| io_status("create", &target, e))?;
        }
        let t = target.clone();
        blocking(move || mount::ensure_bind(&source, &t, read_only)).await?;
        if let Some(st) = &stash {
            self.limit_krbd(&id, st, &target).await?;
        }
        if let Some(st) = stash.as_mut() {
            if !st.published.contains(&target) {
                st.published.push(target.clone());
                st.write(&staging)?;
            }
        }
        tracing::info!(volume = %id, target = %target.display(), read_only, "NodePublishVolume done");
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let target = PathBuf::from(required("target_path", &req.target_path)?);
        let _busy = self.driver.begin(&id)?;
        unmount_and_remove(&target).await?;
        if let Some(staging) = self.staging_of(&id, "") {
            if let Ok(Some(mut st)) = Stash::read(&staging) {
                if st.published.contains(&target) {
                    st.published.retain(|t| *t != target);
                    st.write(&staging)?;
                }
            }
        }
        tracing::info!(volume = %id, target = %target.display(), "NodeUnpublishVolume done");
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        req: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let path = PathBuf::from(required("volume_path", &req.volume_path)?);
        let meta = match std::fs::metadata(&path) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Status::not_found(format!(
                    "volume_path {} does not exist",
                    path.display()
                )))
            }
            // A dead backend (ENOTCONN, EIO): no usage; NodeGetVolumeHealth
            // reports it.
            Err(_) => None,
        };
        let mut usage = Vec::new();
        match meta {
            Some(m) if m.file_type().is_block_device() => {
                let p = path.clone();
                match blocking(move || fs::device_size(&p)).await {
                    Ok(size) => usage.push(VolumeUsage {
                        available: 0,
                        total: size as i64,
                        used: 0,
                        unit: volume_usage::Unit::Bytes as i32,
                    }),
                    // NodeGetVolumeHealth says why.
                    Err(e) => tracing::debug!(volume = %id, "no stats: {}", e.message()),
                }
            }
            Some(_) => {
                let p = path.clone();
                match blocking(move || fs::stats(&p)).await {
                    Ok(st) => {
                        usage.push(VolumeUsage {
                            available: st.available_bytes as i64,
                            total: st.total_bytes as i64,
                            used: st.used_bytes as i64,
                            unit: volume_usage::Unit::Bytes as i32,
                        });
                        usage.push(VolumeUsage {
                            available: st.free_inodes as i64,
                            total: st.total_inodes as i64,
                            used: st.used_inodes as i64,
                            unit: volume_usage::Unit::Inodes as i32,
                        });
                    }
                    Err(e) => tracing::debug!(volume = %id, "no stats: {}", e.message()),
                }
            }
            None => {}
        }
        Ok(Response::new(NodeGetVolumeStatsResponse { usage }))
    }

    async fn node_expand_volume(
        &self,
        req: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let mut req = req.into_inner();
        let secrets = Secrets(std::mem::take(&mut req.secrets));
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let path = PathBuf::from(required("volume_path", &req.volume_path)?);
        if !path.exists() {
            return Err(Status::not_found(format!(
                "volume_path {} does not exist",
                path.display()
            )));
        }
        let _busy = self.driver.begin(&id)?;
        let staging = self
            .staging_of(&id, &req.staging_target_path)
            .ok_or_else(|| Status::not_found(format!("volume {id} is not staged on this node")))?;
        let stash = Stash::read(&staging)?
            .ok_or_else(|| Status::not_found(format!("volume {id} is not staged on this node")))?;
        let device = stash
            .device
            .clone()
            .ok_or_else(|| Status::failed_precondition(format!("volume {id} is not mapped")))?;
        if let (Ok(vol), false) = (VolumeId::parse(&id), secrets.0.is_empty()) {
            if credentials(&secrets.0)?.is_some() {
                self.release_pending(&vol.cluster_id, &secrets.0, "").await;
            }
        }
        let mapper = self.stashed_mapper(&stash)?;
        let id2 = id.clone();
        // A Block volume too: krbd's device has grown by itself, the loop
        // device of rbdkit-fuse grows here (LOOP_SET_CAPACITY).
        let size = blocking(move || mapper.refresh_size(&id2)).await?;
        // dm-crypt over krbd grows to its device's new size.
        if let Some(name) = stash.crypt.clone() {
            blocking(move || crate::node::dmcrypt::resize(&name)).await?;
        }
        let device = stash.data_device().unwrap_or(device);
        if let Some(fs_type) = stash.fs_type.clone() {
            let mnt = staging.join(VOLUME);
            blocking(move || fs::grow(&device, &mnt, &fs_type)).await?;
        }
        tracing::info!(volume = %id, bytes = size, "NodeExpandVolume done");
        Ok(Response::new(NodeExpandVolumeResponse {
            capacity_bytes: size as i64,
        }))
    }

    async fn node_get_capabilities(
        &self,
        _req: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        use node_service_capability::rpc::Type as T;
        let capabilities = [
            T::StageUnstageVolume,
            T::ExpandVolume,
            T::GetVolumeStats,
            T::SingleNodeMultiWriter,
            T::GetVolumeHealth,
            T::GetStorageHealth,
        ]
        .into_iter()
        .map(|t| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(
                node_service_capability::Rpc { r#type: t as i32 },
            )),
        })
        .collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_volume_health(
        &self,
        req: Request<NodeGetVolumeHealthRequest>,
    ) -> Result<Response<NodeGetVolumeHealthResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        for (field, p) in [
            ("volume_publish_path", &req.volume_publish_path),
            ("staging_target_path", &req.staging_target_path),
        ] {
            if !p.is_empty() && !p.starts_with('/') {
                return Err(Status::invalid_argument(format!(
                    "{field} {p:?} is not an absolute path"
                )));
            }
        }
        let health_statuses = self
            .health_of(&id, &req.volume_publish_path, &req.staging_target_path)
            .await?;
        if !health_statuses.is_empty() {
            tracing::warn!(volume = %id, problems = ?health_statuses, "volume unhealthy");
        }
        Ok(Response::new(NodeGetVolumeHealthResponse {
            volume_health: Some(VolumeHealth {
                volume_id: id,
                health_statuses,
            }),
        }))
    }

    async fn node_get_storage_health(
        &self,
        _req: Request<NodeGetStorageHealthRequest>,
    ) -> Result<Response<NodeGetStorageHealthResponse>, Status> {
        let unreachable = |reason: &str, message: String| StorageBackendHealth {
            status: StorageHealthErrorType::StorageUnreachable as i32,
            reason: reason.to_owned(),
            message,
            volume_capability: None,
        };
        let mut backend_health = Vec::new();
        for m in &self.mappers {
            let m2 = Arc::clone(m);
            let ready = tokio::task::spawn_blocking(move || m2.ready())
                .await
                .unwrap_or_else(|e| Err(format!("readiness check failed: {e}")));
            if let Err(why) = ready {
                backend_health.push(unreachable(
                    "MapperNotReady",
                    format!("mapper {}: {why}", m.name()),
                ));
            }
        }
        let config = self.driver.clusters.config();
        let dead = tokio::task::spawn_blocking(move || {
            crate::volume::clusters::unreachable_clusters(&config, STORAGE_HEALTH_MON_TIMEOUT)
        })
        .await
        .map_err(|e| Status::internal(format!("monitor check failed: {e}")))?;
        for (id, mons) in dead {
            backend_health.push(unreachable(
                "MonitorsUnreachable",
                format!("no monitor of Ceph cluster {id:?} ({mons}) answers"),
            ));
        }
        Ok(Response::new(NodeGetStorageHealthResponse {
            backend_health,
        }))
    }

    async fn node_get_info(
        &self,
        _req: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        // Always set: the plugin offers VOLUME_ACCESSIBILITY_CONSTRAINTS,
        // and images are reachable from every node unless flags say more.
        let topology = Some(Topology {
            segments: self
                .driver
                .topology
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<HashMap<_, _>>(),
        });
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.driver.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: topology,
        }))
    }
}

/// The status of a node-side Ceph call ([`Driver::ceph`]), whose closure
/// fails only with library errors: anything else is INTERNAL.
fn ceph_call_status(e: VolumeError) -> Status {
    match e {
        VolumeError::Ceph(e) => status_of(&e),
        other => Status::internal(other.to_string()),
    }
}
