//! The Ceph side of provisioning: create, delete and expand images, always
//! checking that an image is ours before touching it.
//!
//! Ownership is recorded in the image's metadata (`rbdkit.*` keys: the
//! provisioner, PV, claim and cluster). An image without it, or made for
//! another PV or provisioner, is never removed or resized.
//!
//! A new image is created under a temporary name, given its metadata, and
//! only then renamed to its final name, so the final name never exists
//! without an owner record, even if the process dies in between. A retry
//! adopts the temporary image.
//!
//! Every destructive step (create, owner metadata, rename, resize, trash
//! move, trash remove, remove) first asks the caller's [`Fence`], so that a
//! provisioner replica deposed while an operation runs changes nothing more.
//!
//! Every function here is blocking: call it through
//! [`crate::blocking::BlockingPool`].

use std::collections::BTreeMap;
use std::fmt;
use std::time::Instant;

use crate::rados::{Cluster, IoCtx};
use crate::rbd::{self, Image, ImageOptions};
use crate::volume::encryption::{self, NewEncryption};
use crate::volume::{CephObserver, Fence, VolumeId};
use crate::{Error, ErrorKind};

/// Metadata key: the provisioner that made the image.
pub const META_PROVISIONER: &str = "rbdkit.provisioner";
/// Metadata key: the PV the image backs.
pub const META_PV: &str = "rbdkit.pv";
/// Metadata key: the claim's namespace.
pub const META_PVC_NAMESPACE: &str = "rbdkit.pvc.namespace";
/// Metadata key: the claim's name.
pub const META_PVC_NAME: &str = "rbdkit.pvc.name";
/// Metadata key: the cluster id.
pub const META_CLUSTER: &str = "rbdkit.cluster";

/// Suffix of the temporary name a new image is created under.
pub const TEMP_SUFFIX: &str = ".rbdkit-new";

/// Who an image belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The provisioner name.
    pub provisioner: String,
    /// The PV name.
    pub pv_name: String,
    /// The claim's namespace.
    pub pvc_namespace: String,
    /// The claim's name.
    pub pvc_name: String,
    /// The cluster id.
    pub cluster_id: String,
}

impl Owner {
    pub(crate) fn pairs(&self) -> [(&'static str, &str); 5] {
        [
            (META_PROVISIONER, &self.provisioner),
            (META_PV, &self.pv_name),
            (META_PVC_NAMESPACE, &self.pvc_namespace),
            (META_PVC_NAME, &self.pvc_name),
            (META_CLUSTER, &self.cluster_id),
        ]
    }
}

/// Why a volume operation did not complete.
#[derive(Debug, Clone)]
pub enum VolumeError {
    /// A Ceph call failed.
    Ceph(Error),
    /// The image exists but is not ours to touch.
    NotOwned {
        /// The image.
        image: String,
        /// Why it is not ours.
        why: String,
    },
    /// The image is open somewhere (it has watchers).
    InUse {
        /// The image.
        image: String,
        /// How many clients have it open.
        watchers: usize,
    },
    /// The image is bigger than the size asked for.
    ShrinkRefused {
        /// The image.
        image: String,
        /// Its size.
        current: u64,
        /// The size asked for.
        requested: u64,
    },
    /// The image is in the trash but cannot be purged yet.
    PurgeBlocked {
        /// The image.
        image: String,
        /// Why (snapshots, clones).
        why: String,
    },
    /// The image to expand does not exist.
    Missing {
        /// The image.
        image: String,
    },
    /// The name is taken by a volume or snapshot made from another source.
    Conflict {
        /// The image.
        image: String,
        /// What it was made from, and what was asked for.
        why: String,
    },
    /// The request cannot be done as asked (a source in another pool, a
    /// clone of an image onto itself).
    Refused {
        /// What is wrong.
        why: String,
    },
    /// The image cannot serve this request as it is made (a group
    /// snapshot source without exclusive-lock).
    Unsuitable {
        /// The image.
        image: String,
        /// What it lacks, and how to give it that.
        why: String,
    },
    /// Something else holds the image for now (another group snapshot
    /// being taken of it): nothing was left behind, and a retry can pass.
    Busy {
        /// The image.
        image: String,
        /// What holds it.
        why: String,
    },
}

impl fmt::Display for VolumeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VolumeError::Ceph(e) => write!(f, "{e}"),
            VolumeError::NotOwned { image, why } => {
                write!(f, "image {image} is not managed by this provisioner ({why}); leaving it alone")
            }
            VolumeError::InUse { image, watchers } => write!(
                f,
                "image {image} is in use ({watchers} client(s) have it open); will retry once it is released"
            ),
            VolumeError::ShrinkRefused {
                image,
                current,
                requested,
            } => write!(
                f,
                "image {image} is {current} bytes; shrinking it to {requested} bytes is refused"
            ),
            VolumeError::PurgeBlocked { image, why } => write!(
                f,
                "image {image} was moved to the trash but cannot be purged yet: {why}"
            ),
            VolumeError::Missing { image } => write!(f, "image {image} does not exist"),
            VolumeError::Conflict { image, why } => {
                write!(f, "image {image} already exists with another source: {why}")
            }
            VolumeError::Refused { why } => write!(f, "{why}"),
            VolumeError::Unsuitable { image, why } => write!(f, "image {image}: {why}"),
            VolumeError::Busy { image, why } => {
                write!(f, "image {image} is busy: {why}; nothing was kept, try again")
            }
        }
    }
}

impl std::error::Error for VolumeError {}

impl From<Error> for VolumeError {
    fn from(e: Error) -> Self {
        VolumeError::Ceph(e)
    }
}

impl VolumeError {
    /// The Ceph error, if this is one.
    pub fn ceph(&self) -> Option<&Error> {
        match self {
            VolumeError::Ceph(e) => Some(e),
            _ => None,
        }
    }
}

/// Says which pool of which cluster may not be used, and the caps that
/// takes: EPERM alone names neither.
fn explain_denied(vol: &VolumeId, e: VolumeError) -> VolumeError {
    match e {
        VolumeError::Ceph(err) if err.kind() == ErrorKind::PermissionDenied => {
            VolumeError::Ceph(err.detail(format!(
                "permission denied: the Ceph user of this Secret may not use pool {} of \
                 cluster {}; it needs osd 'profile rbd pool={}' (see deploy/README.md)",
                vol.pool, vol.cluster_id, vol.pool
            )))
        }
        e => e,
    }
}

/// Times one Ceph call into `rbdkit_ceph_op_duration_seconds`.
pub(crate) fn timed<T>(
    metrics: &dyn CephObserver,
    op: &str,
    f: impl FnOnce() -> crate::Result<T>,
) -> crate::Result<T> {
    let started = Instant::now();
    let out = f();
    metrics.ceph_op(op, started);
    out
}

/// Asks `fence` whether `step` on `object` may run now.
pub(crate) fn fenced(fence: &dyn Fence, step: &'static str, object: &str) -> crate::Result<()> {
    pause::point(step);
    let out = fence.check(step, object);
    pause::record(step, &out);
    if let Err(e) = &out {
        tracing::warn!(error = %e, "fenced: step not made");
    }
    out
}

/// A test hook: parks the next fenced step of a given name just before its
/// fence check, until the test releases it. Inert unless a test arms it.
#[doc(hidden)]
pub mod pause {
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::Duration;

    /// One armed pause point.
    #[derive(Debug)]
    pub struct Pause {
        step: &'static str,
        state: Mutex<State>,
        cond: Condvar,
    }

    #[derive(Debug, Default)]
    struct State {
        reached: bool,
        released: bool,
        outcome: Option<Result<(), String>>,
    }

    static ARMED: Mutex<Option<Arc<Pause>>> = Mutex::new(None);
    static LAST: Mutex<Option<Arc<Pause>>> = Mutex::new(None);

    /// Parks the next `step` (such as `rbd_remove`) in this process.
    pub fn arm(step: &'static str) -> Arc<Pause> {
        let p = Arc::new(Pause {
            step,
            state: Mutex::new(State::default()),
            cond: Condvar::new(),
        });
        *ARMED.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&p));
        p
    }

    impl Pause {
        /// Whether the step has reached the pause point.
        pub fn reached(&self) -> bool {
            self.state.lock().unwrap_or_else(|e| e.into_inner()).reached
        }

        /// Lets the parked step go on to its fence check.
        pub fn release(&self) {
            self.state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .released = true;
            self.cond.notify_all();
        }

        /// What the fence said once released: `Err` holds the message.
        pub fn outcome(&self) -> Option<Result<(), String>> {
            self.state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .outcome
                .clone()
        }
    }

    pub(super) fn point(step: &'static str) {
        let p = {
            let mut armed = ARMED.lock().unwrap_or_else(|e| e.into_inner());
            match armed.as_ref() {
                Some(p) if p.step == step => armed.take(),
                _ => None,
            }
        };
        let Some(p) = p else { return };
        let mut st = p.state.lock().unwrap_or_else(|e| e.into_inner());
        st.reached = true;
        // Bounded: a test that never releases does not hang the process.
        let (st, _) = p
            .cond
            .wait_timeout_while(st, Duration::from_secs(120), |s| !s.released)
            .unwrap_or_else(|e| e.into_inner());
        drop(st);
        *LAST.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
    }

    pub(super) fn record(step: &'static str, out: &crate::Result<()>) {
        let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
        if last.as_ref().is_some_and(|p| p.step == step) {
            if let Some(p) = last.take() {
                p.state.lock().unwrap_or_else(|e| e.into_inner()).outcome =
                    Some(out.clone().map_err(|e| e.to_string()));
            }
        }
    }
}

pub(crate) fn ioctx(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    vol: &VolumeId,
) -> crate::Result<IoCtx> {
    timed(metrics, "ioctx", || {
        cluster.ioctx_ns(&vol.pool, &vol.rados_namespace)
    })
}

/// Opens the image of `vol` read-write; a missing one is
/// [`VolumeError::Missing`], naming the volume.
pub(crate) fn open_volume(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    vol: &VolumeId,
) -> Result<Image, VolumeError> {
    let io = ioctx(cluster, metrics, vol)?;
    match timed(metrics, "open", || Image::open(&io, &vol.image)) {
        Ok(i) => Ok(i),
        Err(e) if e.kind() == ErrorKind::NotFound => Err(VolumeError::Missing {
            image: vol.to_string(),
        }),
        Err(e) => Err(e.into()),
    }
}

/// [`open_volume`], then checks its owner record against `provisioner` and
/// `pv_name` ([`check_owner`]).
pub(crate) fn open_owned(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    vol: &VolumeId,
    provisioner: &str,
    pv_name: &str,
) -> Result<Image, VolumeError> {
    let image = open_volume(cluster, metrics, vol)?;
    check_owner(&image, metrics, provisioner, pv_name)?;
    Ok(image)
}

/// Checks an image's owner record against `provisioner` and `pv_name`.
pub(crate) fn check_owner(
    image: &Image,
    metrics: &dyn CephObserver,
    provisioner: &str,
    pv_name: &str,
) -> Result<(), VolumeError> {
    let meta: BTreeMap<String, String> = timed(metrics, "metadata_list", || image.metadata_list())?;
    let name = image.name().to_owned();
    match (meta.get(META_PROVISIONER), meta.get(META_PV)) {
        (Some(p), Some(v)) if p == provisioner && v == pv_name => Ok(()),
        (Some(p), Some(v)) => Err(VolumeError::NotOwned {
            image: name,
            why: format!("it belongs to provisioner {p:?}, PV {v:?}"),
        }),
        _ => Err(VolumeError::NotOwned {
            image: name,
            why: "it has no rbdkit owner metadata".into(),
        }),
    }
}

/// Makes sure the image of `vol` exists, is ours, and is at least `size`
/// bytes; creates it if needed. Returns its size.
pub fn ensure_image(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    vol: &VolumeId,
    size: u64,
    options: &ImageOptions,
    owner: &Owner,
) -> Result<u64, VolumeError> {
    ensure_image_encrypted(cluster, metrics, fence, vol, size, options, owner, None)
}

/// [`ensure_image`] for a class that may ask for encryption: a new image
/// gets its passphrase and LUKS2 header before it is renamed to its final
/// name ([`crate::volume::encryption::setup_new`]), so a volume never
/// exists under its name without them.
#[allow(clippy::too_many_arguments)]
pub fn ensure_image_encrypted(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    vol: &VolumeId,
    size: u64,
    options: &ImageOptions,
    owner: &Owner,
    encryption: Option<&NewEncryption>,
) -> Result<u64, VolumeError> {
    ensure_image_steps(
        cluster, metrics, fence, vol, size, options, owner, encryption,
    )
    .map_err(|e| explain_denied(vol, e))
}

// The steps of [`ensure_image`].
#[allow(clippy::too_many_arguments)]
fn ensure_image_steps(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    vol: &VolumeId,
    size: u64,
    options: &ImageOptions,
    owner: &Owner,
    encryption: Option<&NewEncryption>,
) -> Result<u64, VolumeError> {
    if let Some(e) = encryption {
        encryption::check_size(size, e.params.sector_size)
            .map_err(|why| VolumeError::Refused { why })?;
    }
    let io = ioctx(cluster, metrics, vol)?;
    // Already there (a retry after the PV create failed, or after a crash)?
    // The id object answers for a new name without building an image
    // context, which copies librbd's whole configuration.
    let existing = if id_object_exists(&io, metrics, &vol.image)? {
        open_if_exists(&io, metrics, &vol.image)?
    } else {
        None
    };
    if let Some(existing) = existing {
        check_owner(&existing, metrics, &owner.provisioner, &owner.pv_name)?;
        let meta = timed(metrics, "metadata_list", || existing.metadata_list())?;
        let state = encryption::state_of(&meta, &vol.image)?;
        if state.encrypted() != encryption.is_some() {
            return Err(VolumeError::Conflict {
                image: vol.image.clone(),
                why: format!(
                    "it exists {}encrypted, and the class asks for {}encryption",
                    if state.encrypted() { "" } else { "un" },
                    if encryption.is_some() { "" } else { "no " }
                ),
            });
        }
        let current = timed(metrics, "size", || existing.size())?;
        let id = timed(metrics, "id", || existing.id())?;
        drop(existing);
        finish_cut_short_rename(&io, metrics, fence, &vol.image, &id)?;
        return Ok(current);
    }
    check_pool_quota(cluster, metrics, vol, size)?;
    let temp = format!("{}{TEMP_SUFFIX}", vol.image);
    let temp_obj = format!("{vol}{TEMP_SUFFIX}");
    let image = create_temp(&io, metrics, fence, &temp, &temp_obj, size, options)?;
    for (k, v) in owner.pairs() {
        fenced(fence, "rbd_metadata_set", &temp_obj)?;
        timed(metrics, "metadata_set", || image.metadata_set(k, v))?;
    }
    if let Some(e) = encryption {
        fenced(fence, "rbd_write", &temp_obj)?;
        let handle = vol.handle();
        timed(metrics, "encryption_format", || {
            encryption::setup_new(
                &image,
                &handle,
                &e.params.kms_id,
                &e.keys,
                &e.format_options(),
            )
        })?;
    }
    let current = timed(metrics, "size", || image.size())?;
    timed(metrics, "close", || image.close())?;
    fenced(fence, "rbd_rename", &temp_obj)?;
    match timed(metrics, "rename", || rbd::rename(&io, &temp, &vol.image)) {
        Ok(()) => Ok(current),
        // Someone (an earlier leader) finished first: check what is there.
        Err(e) if matches!(e.kind(), ErrorKind::AlreadyExists | ErrorKind::NotFound) => {
            let img = timed(metrics, "open", || Image::open_read_only(&io, &vol.image))?;
            check_owner(&img, metrics, &owner.provisioner, &owner.pv_name)?;
            Ok(timed(metrics, "size", || img.size())?)
        }
        Err(e) => Err(e.into()),
    }
}

/// Refuses an image larger than the pool's byte quota (`osd pool
/// get-quota`, through `rados_mon_command`): RBD images are thin, so Ceph
/// itself would accept it and fail only writes, later, inside a workload.
/// A user whose caps do not allow the query is not refused (the quota then
/// still applies to writes).
fn check_pool_quota(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    vol: &VolumeId,
    size: u64,
) -> Result<(), VolumeError> {
    let cmd = serde_json::json!({
        "prefix": "osd pool get-quota",
        "pool": vol.pool,
        "format": "json",
    })
    .to_string();
    let reply = match timed(metrics, "mon_command", || cluster.mon_command(&cmd, &[])) {
        Ok(r) => r,
        // A missing pool is reported by the create itself.
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
            tracing::debug!(pool = %vol.pool, "may not read the pool quota: {e}");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let max = serde_json::from_slice::<serde_json::Value>(&reply.output)
        .ok()
        .and_then(|v| v.get("quota_max_bytes")?.as_u64())
        .unwrap_or(0);
    if max > 0 && size > max {
        return Err(Error::from_errno(libc::EDQUOT, "create", vol.to_string())
            .detail(format!(
                "{size} bytes is more than pool {}'s quota of {max} bytes",
                vol.pool
            ))
            .into());
    }
    Ok(())
}

/// Creates (or adopts) the temporary image and opens it read-write.
///
/// An earlier attempt cut short leaves either a complete temporary image,
/// which is adopted, or (killed inside `rbd_create4`) a half-made one whose
/// name is taken but which cannot be opened; that one is removed and made
/// again. The temporary name derives from the claim's uid, so it is ours.
fn create_temp(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    temp: &str,
    temp_obj: &str,
    size: u64,
    options: &ImageOptions,
) -> Result<Image, VolumeError> {
    let mut attempts = 0;
    loop {
        attempts += 1;
        fenced(fence, "rbd_create4", temp_obj)?;
        match timed(metrics, "create", || rbd::create(io, temp, size, options)) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e.into()),
        }
        match timed(metrics, "open", || Image::open(io, temp)) {
            Ok(image) => return Ok(image),
            Err(e) if e.kind() == ErrorKind::NotFound && attempts < 3 => {
                tracing::warn!(
                    image = temp,
                    "removing a half-created image left by an interrupted create"
                );
                fenced(fence, "rbd_remove", temp_obj)?;
                match timed(metrics, "remove", || rbd::remove(io, temp)) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Whether `rbd_id.<name>` exists: a format 2 image of that name opens
/// only if it does, so a miss saves an `rbd_open` (a configuration copy and
/// a header read) that would fail.
pub(crate) fn id_object_exists(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    name: &str,
) -> Result<bool, VolumeError> {
    match timed(metrics, "stat", || io.stat(&format!("rbd_id.{name}"))) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e.into()),
    }
}

pub(crate) fn open_if_exists(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    name: &str,
) -> Result<Option<Image>, VolumeError> {
    match timed(metrics, "open", || Image::open_read_only(io, name)) {
        Ok(img) => Ok(Some(img)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// What [`delete_image`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// The image was removed.
    Removed,
    /// It went through the trash (it had snapshots or clones) and was purged.
    Purged,
    /// It is in the trash and is purged when its last clone is flattened or
    /// deleted ([`crate::volume::snapshot::purge_unused_ancestors`]).
    Trashed,
    /// There was nothing to remove.
    AlreadyGone,
}

/// Removes the image of `vol` (and a leftover temporary image) if it is
/// ours and nobody has it open. Never forces: an image in use is an
/// [`VolumeError::InUse`] error to retry later.
pub fn delete_image(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    vol: &VolumeId,
    provisioner: &str,
    pv_name: &str,
) -> Result<Deleted, VolumeError> {
    delete_image_steps(cluster, metrics, fence, vol, provisioner, pv_name)
        .map_err(|e| explain_denied(vol, e))
}

// The steps of [`delete_image`].
fn delete_image_steps(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    vol: &VolumeId,
    provisioner: &str,
    pv_name: &str,
) -> Result<Deleted, VolumeError> {
    let io = ioctx(cluster, metrics, vol)?;
    let temp = format!("{}{TEMP_SUFFIX}", vol.image);
    let mut outcome = Deleted::AlreadyGone;
    for name in [vol.image.as_str(), temp.as_str()] {
        let object = if name == temp {
            format!("{vol}{TEMP_SUFFIX}")
        } else {
            vol.to_string()
        };
        // A temporary image is rarely left: its id object says so without
        // an open.
        let image = if name == temp && !id_object_exists(&io, metrics, name)? {
            None
        } else {
            open_if_exists(&io, metrics, name)?
        };
        let Some(image) = image else {
            if name == temp {
                // A create killed half-way leaves a name that cannot be
                // opened; remove cleans that up too.
                fenced(fence, "rbd_remove", &object)?;
                match timed(metrics, "remove", || rbd::remove(&io, name)) {
                    Ok(()) => outcome = Deleted::Removed,
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e.into()),
                }
            } else if let done @ (Deleted::Removed | Deleted::Purged) =
                finish_cut_short_remove(&io, metrics, fence, name, &object, provisioner, pv_name)?
            {
                outcome = done;
            }
            continue;
        };
        match check_owner(&image, metrics, provisioner, pv_name) {
            Ok(()) => {}
            // A temporary image cut short before its metadata was written
            // has no owner record; its name is derived from this PV's uid,
            // so it can only be ours.
            Err(VolumeError::NotOwned { .. }) if name == temp => {
                let meta = timed(metrics, "metadata_list", || image.metadata_list())?;
                // A clone cut short before its own record still carries its
                // parent's (librbd copies metadata into clones).
                let copied = meta.get(META_PV).is_some_and(|p| p != pv_name)
                    && timed(metrics, "parent_metadata", || {
                        crate::volume::snapshot::inherited(cluster, &image, META_PV)
                    })?;
                if !copied && contradicts(&meta, provisioner, Some(pv_name)) {
                    return Err(VolumeError::NotOwned {
                        image: name.to_owned(),
                        why: "its owner metadata names someone else".into(),
                    });
                }
            }
            Err(e) => return Err(e),
        }
        let watchers = timed(metrics, "watchers", || image.watchers())?;
        if !watchers.is_empty() {
            return Err(VolumeError::InUse {
                image: name.to_owned(),
                watchers: watchers.len(),
            });
        }
        if name != temp {
            let id = timed(metrics, "id", || image.id())?;
            finish_cut_short_rename(&io, metrics, fence, &vol.image, &id)?;
        }
        drop(image);
        let remove = || {
            crate::volume::snapshot::remove_or_trash(
                cluster,
                metrics,
                fence,
                &io,
                name,
                &object,
                provisioner,
            )
        };
        let removed = match remove() {
            // In an RBD group: one a failed group snapshot left is undone.
            Err(VolumeError::Ceph(e)) if e.errno() == libc::EMLINK => {
                fenced(fence, "rbd_group_image_remove", &object)?;
                if !crate::volume::group_snapshot::leave_scaffolding_groups(&io, metrics, name)? {
                    return Err(VolumeError::Ceph(e));
                }
                remove()
            }
            other => other,
        };
        match removed? {
            Deleted::AlreadyGone => {}
            done => outcome = done,
        }
    }
    // A retry after a trash move: finish the purge.
    if outcome == Deleted::AlreadyGone {
        let entries = timed(metrics, "trash_list", || rbd::trash_list(&io))?;
        for entry in entries.iter().filter(|e| e.name == vol.image) {
            // Fail closed: a forced purge runs only on an entry proven ours.
            let img = timed(metrics, "open", || {
                Image::open_by_id_read_only(&io, &entry.id)
            })
            .map_err(|e| VolumeError::NotOwned {
                image: format!("{} (trash id {})", vol.image, entry.id),
                why: format!("its owner cannot be checked: {e}"),
            })?;
            check_owner(&img, metrics, provisioner, pv_name)?;
            drop(img);
            outcome = crate::volume::snapshot::purge_trashed(
                cluster,
                metrics,
                fence,
                &io,
                &vol.image,
                &entry.id,
                provisioner,
            )?;
        }
    }
    Ok(outcome)
}

/// Finishes an `rbd_rename` of the temporary image killed between its two
/// writes: librbd first writes the new name's id object, then renames the
/// directory entry. Cut short in between, the final name opens (so the
/// volume looked made and its PV was created) while the directory still
/// lists only the temporary name, which then leaked. Only when the listed
/// temporary name has the very id the final name opens (an image already
/// proven ours): the stray id object goes and the rename is made again.
/// The clones of `snapshot.rs` are renamed the same way and call this too.
pub(crate) fn finish_cut_short_rename(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    name: &str,
    id: &str,
) -> Result<(), VolumeError> {
    let temp = format!("{name}{TEMP_SUFFIX}");
    // librbd writes the new id object, renames the directory entry, then
    // removes the old id object: with that gone, the rename was not cut
    // short, and the directory (a read of the whole pool's list) need not
    // be read.
    if !id_object_exists(io, metrics, &temp)? {
        return Ok(());
    }
    let listed = timed(metrics, "list", || rbd::list(io))?;
    if listed.iter().any(|s| s.name == name) || !listed.iter().any(|s| s.name == temp && s.id == id)
    {
        return Ok(());
    }
    tracing::warn!(image = name, "finishing a rename cut short");
    fenced(fence, "rados_remove", &temp)?;
    match timed(metrics, "remove", || io.remove(&format!("rbd_id.{name}"))) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    fenced(fence, "rbd_rename", &temp)?;
    timed(metrics, "rename", || rbd::rename(io, &temp, name))?;
    Ok(())
}

/// Finishes an `rbd_remove` killed part-way, which leaves an image that no
/// longer opens by name. librbd removes through the trash: it adds a trash
/// entry (marked "removing", which `rbd_trash_list` never shows), removes
/// the image's id object, then its directory entry, then the image. Killed
/// before the directory step, the name is still listed but does not open;
/// killed after it, nothing shows at all. Either way the data stays, and
/// treating the image as gone leaked it. `rbd_remove` on the name finishes
/// both: still listed, only once its header (by id) is proven ours; not
/// listed, librbd acts only on a trash entry of that name that an earlier
/// `rbd_remove` marked as being removed.
fn finish_cut_short_remove(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    name: &str,
    object: &str,
    provisioner: &str,
    pv_name: &str,
) -> Result<Deleted, VolumeError> {
    let listed = timed(metrics, "list", || rbd::list(io))?;
    if let Some(spec) = listed.iter().find(|s| s.name == name) {
        // Fail closed: a listed image whose owner cannot be read stays,
        // unless its header is known to be gone (librbd removes it after the
        // data and before the listing): then nobody's data is left to guard.
        match timed(metrics, "open", || {
            Image::open_by_id_read_only(io, &spec.id)
        }) {
            Ok(img) => check_owner(&img, metrics, provisioner, pv_name)?,
            Err(e) if e.kind() == ErrorKind::NotFound && header_gone(io, metrics, &spec.id) => {}
            Err(e) => {
                return Err(VolumeError::NotOwned {
                    image: format!("{name} (id {})", spec.id),
                    why: format!(
                        "it is listed but does not open, and its owner cannot be checked: {e}"
                    ),
                })
            }
        }
        tracing::warn!(image = object, "finishing a remove cut short");
    }
    fenced(fence, "rbd_remove", object)?;
    match timed(metrics, "remove", || rbd::remove(io, name)) {
        Ok(()) => Ok(Deleted::Removed),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(Deleted::AlreadyGone),
        Err(e) if e.kind() == ErrorKind::Busy => Err(VolumeError::InUse {
            image: name.to_owned(),
            watchers: 0,
        }),
        Err(e) => Err(e.into()),
    }
}

/// True only when `rados_stat` positively reports the image's header
/// object missing; a timeout or a permission error is not an answer.
fn header_gone(io: &IoCtx, metrics: &dyn CephObserver, id: &str) -> bool {
    matches!(
        timed(metrics, "stat", || io.stat(&format!("rbd_header.{id}"))),
        Err(e) if e.kind() == ErrorKind::NotFound
    )
}

pub(crate) fn has_snapshots_or_children(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    name: &str,
) -> bool {
    match timed(metrics, "open", || Image::open_read_only(io, name)) {
        Ok(img) => {
            img.snap_list().map(|s| !s.is_empty()).unwrap_or(false)
                || img.children().map(|c| !c.is_empty()).unwrap_or(false)
        }
        Err(_) => false,
    }
}

pub(crate) fn purge(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    name: &str,
    id: &str,
) -> Result<(), VolumeError> {
    fenced(fence, "rbd_trash_remove", name)?;
    match timed(metrics, "trash_remove", || rbd::trash_remove(io, id, true)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) if matches!(e.kind(), ErrorKind::HasSnapshots | ErrorKind::Busy) => {
            Err(VolumeError::PurgeBlocked {
                image: name.to_owned(),
                why: format!("{e}; it still has snapshots or clones"),
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// Grows the image of `vol` to `size` bytes if it is ours. Returns the new
/// size. A smaller `size` than the image has is refused.
pub fn expand_image(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    vol: &VolumeId,
    provisioner: &str,
    pv_name: &str,
    size: u64,
) -> Result<u64, VolumeError> {
    expand_image_steps(cluster, metrics, fence, vol, provisioner, pv_name, size)
        .map_err(|e| explain_denied(vol, e))
}

// The steps of [`expand_image`].
fn expand_image_steps(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    vol: &VolumeId,
    provisioner: &str,
    pv_name: &str,
    size: u64,
) -> Result<u64, VolumeError> {
    let image = open_owned(cluster, metrics, vol, provisioner, pv_name)?;
    let current = timed(metrics, "size", || image.size())?;
    if size < current {
        return Err(VolumeError::ShrinkRefused {
            image: vol.image.clone(),
            current,
            requested: size,
        });
    }
    if size > current {
        fenced(fence, "rbd_resize2", &vol.to_string())?;
        timed(metrics, "resize", || image.resize(size))?;
    }
    // Limits that grow per GiB follow the new size (also on a retry after
    // a kill between the resize and this).
    crate::volume::qos::refresh(&image, metrics, fence)?;
    timed(metrics, "close", || image.close())?;
    Ok(size)
}

/// The owner record of an image, for tests and tools.
pub fn owner_metadata(image: &Image) -> crate::Result<BTreeMap<String, String>> {
    Ok(image
        .metadata_list()?
        .into_iter()
        .filter(|(k, _)| k.starts_with("rbdkit."))
        .collect())
}

/// Whether a temporary image's (possibly partial) owner record names
/// another provisioner or PV. A kill -9 between two `metadata_set` calls
/// leaves only some keys; what is there still has to agree with us.
pub(crate) fn contradicts(
    meta: &BTreeMap<String, String>,
    provisioner: &str,
    pv_name: Option<&str>,
) -> bool {
    meta.get(META_PROVISIONER).is_some_and(|p| p != provisioner)
        || pv_name.is_some_and(|pv| meta.get(META_PV).is_some_and(|p| p != pv))
}

/// The PV name recorded in the owner metadata of the image of `vol` (or of
/// its temporary image, or of a trash entry with its name), for callers
/// that have only the volume handle (CSI `DeleteVolume`,
/// `ControllerExpandVolume`). `None` when there is no such image at all;
/// an error when the image exists but carries no record of `provisioner`.
pub fn recorded_pv_name(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    vol: &VolumeId,
    provisioner: &str,
) -> Result<Option<String>, VolumeError> {
    let io = ioctx(cluster, metrics, vol)?;
    let read = |image: &Image, name: &str| -> Result<String, VolumeError> {
        let meta = timed(metrics, "metadata_list", || image.metadata_list())?;
        match (meta.get(META_PROVISIONER), meta.get(META_PV)) {
            (Some(p), Some(pv)) if p == provisioner => Ok(pv.clone()),
            (Some(p), _) => Err(VolumeError::NotOwned {
                image: name.to_owned(),
                why: format!("it belongs to provisioner {p:?}"),
            }),
            _ => Err(VolumeError::NotOwned {
                image: name.to_owned(),
                why: "it has no rbdkit owner metadata".into(),
            }),
        }
    };
    if let Some(image) = open_if_exists(&io, metrics, &vol.image)? {
        return read(&image, &vol.image).map(Some);
    }
    // Listed but not openable by name: a remove cut short inside librbd
    // (see [`finish_cut_short_remove`]); its header still opens by id.
    let listed = timed(metrics, "list", || rbd::list(&io))?;
    if let Some(spec) = listed.iter().find(|s| s.name == vol.image) {
        let image = timed(metrics, "open", || {
            Image::open_by_id_read_only(&io, &spec.id)
        })?;
        return read(&image, &vol.image).map(Some);
    }
    let temp = format!("{}{TEMP_SUFFIX}", vol.image);
    if let Some(image) = open_if_exists(&io, metrics, &temp)? {
        // Cut short before its metadata: its name is derived from the
        // request, so it can only be ours; deleting cleans it up.
        return match read(&image, &temp) {
            Ok(pv) => Ok(Some(pv)),
            Err(VolumeError::NotOwned { .. }) => {
                let meta = timed(metrics, "metadata_list", || image.metadata_list())?;
                if contradicts(&meta, provisioner, None) {
                    Err(VolumeError::NotOwned {
                        image: temp,
                        why: "its owner metadata names someone else".into(),
                    })
                } else {
                    Ok(Some(String::new()))
                }
            }
            Err(e) => Err(e),
        };
    }
    let entries = timed(metrics, "trash_list", || rbd::trash_list(&io))?;
    for entry in entries.iter().filter(|e| e.name == vol.image) {
        let image = timed(metrics, "open", || {
            Image::open_by_id_read_only(&io, &entry.id)
        })?;
        if let Ok(pv) = read(&image, &vol.image) {
            return Ok(Some(pv));
        }
    }
    Ok(None)
}
