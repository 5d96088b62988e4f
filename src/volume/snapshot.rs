//! Snapshots, restores and volume clones, shared by the CSI controller and
//! (next) the provisioner's VolumeSnapshotContent reconciler.
//!
//! # Design: a snapshot is a clone-backed snapshot image
//! A snapshot of volume `S` is an image of its own (the *snapshot image*,
//! `I`), a copy-on-write clone of a temporary RBD snapshot of `S`, with one
//! RBD snapshot [`SNAP_NAME`] on it that restores are cloned from:
//!
//! ```text
//! S@rbdkit-tmp-I  --clone-->  I ; I@rbdkit  --clone-->  restored volume
//! ```
//!
//! A plain RBD snapshot `S@snap` would be simpler, but it ties the snapshot
//! to `S`: `S` could not be deleted while it has snapshots (a trashed image
//! cannot be cloned by name), yet CSI and Kubernetes treat snapshots as
//! independent of their source. With the snapshot image, `S` keeps no user
//! snapshot: the temporary one is removed right after the clone, and with
//! clone format 2 (set explicitly on every clone, whatever `rbd default
//! clone format` says) librbd keeps it in the snapshot trash namespace for
//! as long as `I` needs it. Snapshotting costs no data copy.
//!
//! A PVC clone is the same without the second level: the new volume is a
//! clone of a temporary snapshot of the source, removed right after.
//!
//! # Deleting a source that has clones
//! Its `rbd_remove` fails (its trashed snapshots still have children), so it
//! is moved to the trash ([`Deleted::Trashed`]) and the delete succeeds. It
//! is purged when its last child goes: deleting or flattening a child calls
//! [`purge_unused_ancestors`] on the chain above it, and [`purge_orphans`]
//! is the garbage collector for anything a crash left behind.
//!
//! # Clone depth
//! Every clone level adds a parent that reads may fall through to. Past
//! [`CloneDepth::soft`] a new volume is flattened in the background
//! ([`Flatten::Background`], [`flatten_volume`], bounded and resumable:
//! librbd's flatten goes on where a stopped one left off); past
//! [`CloneDepth::hard`] it is flattened before it is returned. A snapshot
//! image past the soft limit is flattened before its snapshot is taken,
//! because without `deep-flatten` a flatten does not reach snapshots taken
//! earlier.
//!
//! # Crash safety
//! Every name derives from the request name: the snapshot image `I`, its
//! temporary name `I.rbdkit-new`, the temporary snapshot `S@rbdkit-tmp-I`.
//! The steps are: temporary snapshot, clone under the temporary name, owner
//! metadata, resize, removal of the temporary snapshot, rename to the final
//! name, then (snapshots) flatten if needed and the final RBD snapshot. The
//! final name never exists without its owner record, and once it exists no
//! temporary snapshot is left. A re-run after a kill at any step adopts what
//! is there and finishes; [`delete_snapshot`] and
//! [`crate::volume::ops::delete_image`] clean up a temporary image too.
//!
//! Every function here is blocking: call it through
//! [`crate::blocking::BlockingPool`].

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use crate::rados::{Cluster, IoCtx};
use crate::rbd::{
    self, Features, Image, ImageOptions, LinkedImage, ParentInfo, SnapInfo, SnapNamespaceType,
};
use crate::volume::encryption::{self, NewEncryption};
use crate::volume::kms::{META_KEY_ID, META_KMS_ID};
use crate::volume::ops::{
    check_owner, contradicts, fenced, finish_cut_short_rename, has_snapshots_or_children, ioctx,
    open_if_exists, purge, timed, Deleted, Owner, VolumeError, META_CLUSTER, META_PROVISIONER,
    TEMP_SUFFIX,
};
use crate::volume::params::CloneDepth;
use crate::volume::{CephObserver, Fence, NoFence, SnapshotId, VolumeId};

/// The snapshot and clone operations are called by the CSI controller only,
/// whose CO sends one request per object at a time; a provisioner-side
/// caller will pass its lease fence here.
const UNFENCED: NoFence = NoFence;
use crate::{Error, ErrorKind};

/// Metadata key: what an rbdkit image is when it is not a volume
/// ([`KIND_SNAPSHOT`]).
pub const META_KIND: &str = "rbdkit.kind";
/// [`META_KIND`] of a snapshot image.
pub const KIND_SNAPSHOT: &str = "snapshot";
/// Metadata key: the snapshot's request name (CSI `CreateSnapshot` name).
pub const META_SNAPSHOT: &str = "rbdkit.snapshot";
/// Metadata key: the VolumeSnapshot's namespace, if known.
pub const META_SNAPSHOT_NAMESPACE: &str = "rbdkit.volumesnapshot.namespace";
/// Metadata key: the VolumeSnapshot's name, if known.
pub const META_SNAPSHOT_OBJECT: &str = "rbdkit.volumesnapshot.name";
/// Metadata key: the handle of what an image was made from (a volume for
/// snapshot images and volume clones, a snapshot for restores).
pub const META_SOURCE: &str = "rbdkit.source";
/// The RBD snapshot on a snapshot image that restores are cloned from.
pub const SNAP_NAME: &str = "rbdkit";
/// Start of the temporary RBD snapshot's name on a source; the rest is the
/// name of the image being cloned from it.
pub const TEMP_SNAP_PREFIX: &str = "rbdkit-tmp-";

/// Features a clone may carry over from its parent (those a class may ask
/// for; the others are set by librbd itself).
const CLONE_FEATURES: Features = Features::from_bits(
    Features::LAYERING.bits()
        | Features::EXCLUSIVE_LOCK.bits()
        | Features::OBJECT_MAP.bits()
        | Features::FAST_DIFF.bits()
        | Features::DEEP_FLATTEN.bits(),
);

/// Longest parent chain walked; a deeper one is reported as this deep.
const MAX_WALK: u32 = 64;

/// Who a snapshot belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotOwner {
    /// The provisioner (driver) name.
    pub provisioner: String,
    /// The request name (CSI `CreateSnapshot` name, the VolumeSnapshotContent
    /// for the reconciler).
    pub snapshot_name: String,
    /// The cluster id.
    pub cluster_id: String,
    /// The VolumeSnapshot's namespace (may be empty).
    pub snapshot_namespace: String,
    /// The VolumeSnapshot's name (may be empty).
    pub snapshot_object: String,
}

/// How the snapshot and clone operations bound their work.
#[derive(Clone)]
pub struct CloneOptions {
    /// Clone depth limits.
    pub depth: CloneDepth,
    /// The longest a flatten done inside a request may take; past it the
    /// request fails with a timeout and a retry goes on with the flatten.
    pub flatten_timeout: Duration,
    /// Test hook: fail with `EINTR` right after this step (1-based), as if
    /// the process had been killed there.
    #[doc(hidden)]
    pub stop_after: Option<u32>,
    /// Asked before each destructive step of a volume clone (the
    /// provisioner's lease); [`NoFence`] by default.
    pub fence: std::sync::Arc<dyn Fence>,
    /// The new volume's class encryption, with the request's KMS keys
    /// (which also read the source's passphrase); `None` for a class
    /// without encryption. An encrypted source into a class without it, or
    /// the reverse, is refused by name.
    pub encryption: Option<NewEncryption>,
}

impl std::fmt::Debug for CloneOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CloneOptions")
            .field("depth", &self.depth)
            .field("flatten_timeout", &self.flatten_timeout)
            .field("stop_after", &self.stop_after)
            .finish_non_exhaustive()
    }
}

impl Default for CloneOptions {
    fn default() -> Self {
        CloneOptions {
            depth: CloneDepth::default(),
            flatten_timeout: Duration::from_secs(120),
            stop_after: None,
            fence: std::sync::Arc::new(NoFence),
            encryption: None,
        }
    }
}

impl CloneOptions {
    fn step(&self, n: u32, what: &str) -> Result<(), VolumeError> {
        if self.stop_after == Some(n) {
            return Err(Error::from_errno(libc::EINTR, "test hook", what)
                .detail(format!("stopped after step {n}"))
                .into());
        }
        Ok(())
    }
}

/// A snapshot, as CreateSnapshot and ListSnapshots report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// Its handle.
    pub id: SnapshotId,
    /// The handle of the volume it was taken of.
    pub source_volume: String,
    /// Its size (the smallest volume restored from it).
    pub size: u64,
    /// When it was taken.
    pub created: SystemTime,
    /// Whether restores can be made from it.
    pub ready: bool,
}

/// Whether a new clone was, or still has to be, flattened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flatten {
    /// Within the soft limit: nothing to do.
    NotNeeded,
    /// Past the hard limit: flattened before returning.
    Done,
    /// Past the soft limit: the caller should run [`flatten_volume`] in the
    /// background.
    Background,
}

/// What [`ensure_volume_from_snapshot`] and [`ensure_volume_from_volume`]
/// made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cloned {
    /// The volume's size.
    pub size: u64,
    /// Its clone depth (parents above it) when it was checked, before any
    /// flatten.
    pub depth: u32,
    /// Whether it was or should be flattened.
    pub flatten: Flatten,
}

fn meta(
    image: &Image,
    metrics: &dyn CephObserver,
) -> Result<BTreeMap<String, String>, VolumeError> {
    Ok(timed(metrics, "metadata_list", || image.metadata_list())?)
}

/// The user snapshots of an image (`rbd_snap_list` also lists those in the
/// trash namespace, kept for clones).
pub fn user_snaps(image: &Image, metrics: &dyn CephObserver) -> Result<Vec<SnapInfo>, VolumeError> {
    let mut out = Vec::new();
    for s in timed(metrics, "snap_list", || image.snap_list())? {
        if timed(metrics, "snap_namespace_type", || {
            image.snap_namespace_type(s.id)
        })? == SnapNamespaceType::User
        {
            out.push(s);
        }
    }
    Ok(out)
}

/// Whether `key` of a temporary clone still holds what its parent has
/// (librbd copied it), rather than a record of its own.
pub(crate) fn inherited(cluster: &Cluster, image: &Image, key: &str) -> crate::Result<bool> {
    let Some(p) = image.parent()? else {
        return Ok(false);
    };
    let io = cluster.ioctx_ns(&p.image.pool_name, &p.image.namespace)?;
    let parent = Image::open_by_id_read_only(&io, &p.image.image_id)?;
    Ok(parent.metadata_get(key).ok() == image.metadata_get(key).ok())
}

fn temp_snap_name(new_image: &str) -> String {
    format!("{TEMP_SNAP_PREFIX}{new_image}")
}

fn same_place(source: &VolumeId, target: &VolumeId) -> Result<(), VolumeError> {
    if source.cluster_id != target.cluster_id
        || source.pool != target.pool
        || source.rados_namespace != target.rados_namespace
    {
        return Err(VolumeError::Refused {
            why: format!(
                "the source {source} is in another cluster, pool or namespace than the new volume {target}; clones stay in their source's pool"
            ),
        });
    }
    Ok(())
}

/// Refuses an image that is not one of `provisioner`'s volumes.
fn check_volume(
    meta: &BTreeMap<String, String>,
    provisioner: &str,
    image: &str,
) -> Result<(), VolumeError> {
    match (meta.get(META_PROVISIONER), meta.get(META_KIND)) {
        (Some(p), None) if p == provisioner => Ok(()),
        (Some(p), Some(k)) if p == provisioner => Err(VolumeError::NotOwned {
            image: image.to_owned(),
            why: format!("it is a {k} image, not a volume"),
        }),
        (Some(p), _) => Err(VolumeError::NotOwned {
            image: image.to_owned(),
            why: format!("it belongs to provisioner {p:?}"),
        }),
        _ => Err(VolumeError::NotOwned {
            image: image.to_owned(),
            why: "it has no rbdkit owner metadata".into(),
        }),
    }
}

/// Refuses an image that is not one of `provisioner`'s snapshot images (or
/// not the one made for request `name`, when given).
fn check_snapshot(
    meta: &BTreeMap<String, String>,
    provisioner: &str,
    name: Option<&str>,
    image: &str,
) -> Result<(), VolumeError> {
    let not = |why: String| VolumeError::NotOwned {
        image: image.to_owned(),
        why,
    };
    match meta.get(META_PROVISIONER) {
        Some(p) if p == provisioner => {}
        Some(p) => return Err(not(format!("it belongs to provisioner {p:?}"))),
        None => return Err(not("it has no rbdkit owner metadata".into())),
    }
    if meta.get(META_KIND).map(String::as_str) != Some(KIND_SNAPSHOT) {
        return Err(not("it is a volume, not a snapshot image".into()));
    }
    if let Some(name) = name {
        if meta.get(META_SNAPSHOT).map(String::as_str) != Some(name) {
            return Err(not(format!(
                "it was made for snapshot {:?}",
                meta.get(META_SNAPSHOT).cloned().unwrap_or_default()
            )));
        }
    }
    Ok(())
}

fn check_source(
    meta: &BTreeMap<String, String>,
    image: &str,
    want: &str,
) -> Result<(), VolumeError> {
    match meta.get(META_SOURCE) {
        Some(s) if s == want => Ok(()),
        Some(s) => Err(VolumeError::Conflict {
            image: image.to_owned(),
            why: format!("it was made from {s}, not {want}"),
        }),
        None => Err(VolumeError::Conflict {
            image: image.to_owned(),
            why: format!("it was not made from {want}"),
        }),
    }
}

/// The number of parents above `image` (0 for an image that is not a
/// clone), following each parent at the snapshot the child was cloned
/// from.
pub fn clone_depth(cluster: &Cluster, image: &Image) -> crate::Result<u32> {
    let mut depth = 0;
    let mut next = image.parent()?;
    while let Some(p) = next {
        depth += 1;
        if depth >= MAX_WALK {
            break;
        }
        let io = cluster.ioctx_ns(&p.image.pool_name, &p.image.namespace)?;
        let mut parent = Image::open_by_id_read_only(&io, &p.image.image_id)?;
        parent.set_snapshot_by_id(p.snap_id)?;
        next = parent.parent()?;
    }
    Ok(depth)
}

/// What [`make_clone`] clones from and writes.
struct CloneJob<'a> {
    io: &'a IoCtx,
    /// The parent image and its snapshot.
    parent: &'a str,
    parent_snap: &'a str,
    /// Whether `parent_snap` is a temporary snapshot made (and removed)
    /// here.
    temp_snap: bool,
    /// The final name.
    name: &'a str,
    provisioner: &'a str,
    meta: Vec<(&'static str, String)>,
    /// Grow to this size after the clone (0: keep the parent's).
    size: u64,
    options: ImageOptions,
}

/// Steps 1-6 of the module doc: leaves the clone under its final name with
/// its metadata, and no temporary snapshot. The caller has checked that the
/// final name does not exist.
fn make_clone(
    metrics: &dyn CephObserver,
    job: &CloneJob<'_>,
    opts: &CloneOptions,
) -> Result<(), VolumeError> {
    let io = job.io;
    let temp = format!("{}{TEMP_SUFFIX}", job.name);
    let adopted = match open_if_exists(io, metrics, &temp)? {
        Some(img) => {
            let m = meta(&img, metrics)?;
            if contradicts(&m, job.provisioner, None) {
                return Err(VolumeError::NotOwned {
                    image: temp,
                    why: "its owner metadata names someone else".into(),
                });
            }
            let from_parent = match timed(metrics, "parent", || img.parent())? {
                Some(p) => p.image.image_name == job.parent,
                None => false,
            };
            if from_parent {
                Some(img)
            } else {
                // Left by a request for another source under this name:
                // its name derives from the request, so it is ours.
                drop(img);
                tracing::warn!(image = %temp, "removing a temporary clone of another source");
                timed(metrics, "remove", || rbd::remove(io, &temp))?;
                None
            }
        }
        None => None,
    };
    let image = match adopted {
        Some(img) => {
            drop(img);
            timed(metrics, "open", || Image::open(io, &temp))?
        }
        None => {
            // A restore has no trace of an earlier attempt to go by.
            let mut earlier_attempt = !job.temp_snap;
            if job.temp_snap {
                let parent = timed(metrics, "open", || Image::open(io, job.parent))?;
                fenced(&*opts.fence, "rbd_snap_create", job.parent)?;
                match timed(metrics, "snap_create", || {
                    parent.snap_create(job.parent_snap)
                }) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::AlreadyExists => earlier_attempt = true,
                    Err(e) => return Err(e.into()),
                }
                timed(metrics, "close", || parent.close())?;
            }
            if earlier_attempt {
                finish_removing_temp(metrics, job, opts, &temp)?;
            }
            opts.step(1, job.parent_snap)?;
            fenced(&*opts.fence, "rbd_clone3", &temp)?;
            clone_temp(metrics, job, &temp)?
        }
    };
    opts.step(2, &temp)?;
    // librbd copies the parent's metadata into a clone: drop the parent's
    // owner record before writing ours.
    fenced(&*opts.fence, "rbd_metadata_set", &temp)?;
    for k in meta(&image, metrics)?.keys() {
        if k.starts_with("rbdkit.") && !job.meta.iter().any(|(m, _)| m == k) {
            timed(metrics, "metadata_remove", || image.metadata_remove(k))?;
        }
    }
    for (k, v) in &job.meta {
        timed(metrics, "metadata_set", || image.metadata_set(k, v))?;
    }
    opts.step(3, &temp)?;
    let current = timed(metrics, "size", || image.size())?;
    if job.size > current {
        fenced(&*opts.fence, "rbd_resize", &temp)?;
        timed(metrics, "resize", || image.resize(job.size))?;
    }
    timed(metrics, "close", || image.close())?;
    opts.step(4, &temp)?;
    if job.temp_snap {
        fenced(&*opts.fence, "rbd_snap_remove", job.parent)?;
        remove_temp_snap(io, metrics, job.parent, job.parent_snap)?;
    }
    opts.step(5, &temp)?;
    fenced(&*opts.fence, "rbd_rename", &temp)?;
    match timed(metrics, "rename", || rbd::rename(io, &temp, job.name)) {
        Ok(()) => {}
        // An earlier attempt renamed it: the caller checks what is there.
        Err(e) if matches!(e.kind(), ErrorKind::AlreadyExists | ErrorKind::NotFound) => {}
        Err(e) => return Err(e.into()),
    }
    opts.step(6, job.name)?;
    Ok(())
}

/// An `rbd_remove` of the temporary clone (of a half-made one) killed after
/// its directory entry went leaves a trash entry marked "removing":
/// `rbd_trash_list` hides it, `rbd_list2` shows it under the temporary name,
/// and a new clone of that name leaves it there for good. `rbd_remove` of a
/// name the directory no longer holds finishes such an entry; the name
/// derives from the request, so it is ours.
fn finish_removing_temp(
    metrics: &dyn CephObserver,
    job: &CloneJob<'_>,
    opts: &CloneOptions,
    temp: &str,
) -> Result<(), VolumeError> {
    fenced(&*opts.fence, "rbd_remove", temp)?;
    match timed(metrics, "remove", || rbd::remove(job.io, temp)) {
        Ok(()) => {
            tracing::warn!(
                image = temp,
                "finished a removal of a temporary clone cut short"
            );
            Ok(())
        }
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Clones the job's parent snapshot to `temp` (format 2) and opens it
/// read-write; a half-made clone (killed inside `rbd_clone3`) is removed
/// and made again.
fn clone_temp(
    metrics: &dyn CephObserver,
    job: &CloneJob<'_>,
    temp: &str,
) -> Result<Image, VolumeError> {
    let mut attempts = 0;
    loop {
        attempts += 1;
        match timed(metrics, "clone", || {
            rbd::clone(
                job.io,
                job.parent,
                job.parent_snap,
                job.io,
                temp,
                &job.options,
            )
        }) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e.into()),
        }
        match timed(metrics, "open", || Image::open(job.io, temp)) {
            Ok(image) => return Ok(image),
            Err(e) if e.kind() == ErrorKind::NotFound && attempts < 3 => {
                tracing::warn!(
                    image = temp,
                    "removing a half-made clone left by an interrupted clone"
                );
                match timed(metrics, "remove", || rbd::remove(job.io, temp)) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Removes a temporary snapshot; with clone format 2, one with clones moves
/// to the snapshot trash namespace and librbd removes it with its last
/// clone.
fn remove_temp_snap(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    image: &str,
    snap: &str,
) -> Result<(), VolumeError> {
    let img = match timed(metrics, "open", || Image::open(io, image)) {
        Ok(img) => img,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    match timed(metrics, "snap_remove", || img.snap_remove(snap)) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    timed(metrics, "close", || img.close())?;
    Ok(())
}

fn clone_options(options: &ImageOptions, parent_features: Features) -> crate::Result<ImageOptions> {
    let o = options.clone().clone_format(2)?;
    Ok(match o.get_features() {
        Some(_) => o,
        None => o.features(
            Features::from_bits(parent_features.bits() & CLONE_FEATURES.bits())
                | Features::LAYERING,
        ),
    })
}

/// Makes sure the snapshot image `image` of volume `source` exists, is
/// ours and has its snapshot; creates it if needed (see the module doc).
/// `image` derives from the request name and lives in the source's pool.
/// A snapshot of that name made from another source is a
/// [`VolumeError::Conflict`].
pub fn ensure_snapshot(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    source: &VolumeId,
    image: &str,
    owner: &SnapshotOwner,
    opts: &CloneOptions,
) -> Result<SnapshotInfo, VolumeError> {
    ensure_snapshot_fenced(cluster, metrics, &UNFENCED, source, image, owner, opts)
}

/// [`ensure_snapshot`] with `fence` asked before each destructive step (the
/// provisioner's leader lease).
pub fn ensure_snapshot_fenced(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    source: &VolumeId,
    image: &str,
    owner: &SnapshotOwner,
    opts: &CloneOptions,
) -> Result<SnapshotInfo, VolumeError> {
    let io = ioctx(cluster, metrics, source)?;
    let sid = SnapshotId {
        cluster_id: source.cluster_id.clone(),
        pool: source.pool.clone(),
        rados_namespace: source.rados_namespace.clone(),
        image: image.to_owned(),
        snap: SNAP_NAME.to_owned(),
    };
    let want = source.handle();
    if source.image == image {
        return Err(VolumeError::Refused {
            why: format!("snapshot image name {image:?} is the source's own name"),
        });
    }
    match open_if_exists(&io, metrics, image)? {
        Some(img) => {
            let m = meta(&img, metrics)?;
            check_snapshot(&m, &owner.provisioner, Some(&owner.snapshot_name), image)?;
            check_source(&m, image, &want)?;
            let id = timed(metrics, "id", || img.id())?;
            drop(img);
            finish_cut_short_rename(&io, metrics, fence, image, &id)?;
        }
        None => {
            let src = open_if_exists(&io, metrics, &source.image)?.ok_or_else(|| {
                VolumeError::Missing {
                    image: source.to_string(),
                }
            })?;
            let src_meta = meta(&src, metrics)?;
            check_volume(&src_meta, &owner.provisioner, &source.image)?;
            let features = timed(metrics, "features", || src.features())?;
            drop(src);
            let mut job_meta = vec![
                (META_PROVISIONER, owner.provisioner.clone()),
                (META_KIND, KIND_SNAPSHOT.to_owned()),
                (META_SNAPSHOT, owner.snapshot_name.clone()),
                (META_SOURCE, want.clone()),
                (META_CLUSTER, owner.cluster_id.clone()),
                (META_SNAPSHOT_NAMESPACE, owner.snapshot_namespace.clone()),
                (META_SNAPSHOT_OBJECT, owner.snapshot_object.clone()),
            ];
            // An encrypted source's passphrase record comes with the
            // clone's metadata; it stays valid under the source's key id
            // (the scrypt salt of the metadata KMS), recorded here, so a
            // snapshot needs no KMS keys of its own.
            if encryption::state_of(&src_meta, &source.image)?.encrypted() {
                job_meta.push((META_KMS_ID, encryption::kms_id_of(&src_meta)));
                job_meta.push((META_KEY_ID, encryption::key_id_of(&src_meta, &want)));
            }
            let job = CloneJob {
                io: &io,
                parent: &source.image,
                parent_snap: &temp_snap_name(image),
                temp_snap: true,
                name: image,
                provisioner: &owner.provisioner,
                meta: job_meta,
                size: 0,
                options: clone_options(&ImageOptions::new(), features)?,
            };
            make_clone(metrics, &job, opts)?;
            let img = timed(metrics, "open", || Image::open_read_only(&io, image))?;
            let m = meta(&img, metrics)?;
            check_snapshot(&m, &owner.provisioner, Some(&owner.snapshot_name), image)?;
            check_source(&m, image, &want)?;
        }
    }
    let img = timed(metrics, "open", || Image::open(&io, image))?;
    if !timed(metrics, "snap_exists", || img.snap_exists(SNAP_NAME))? {
        let depth = timed(metrics, "clone_depth", || clone_depth(cluster, &img))?;
        if depth > opts.depth.soft {
            let parent = timed(metrics, "parent", || img.parent())?;
            flatten_open(metrics, &img, opts.flatten_timeout)?;
            purge_unused_ancestors(cluster, metrics, fence, parent, &owner.provisioner)?;
        }
        opts.step(7, image)?;
        match timed(metrics, "snap_create", || img.snap_create(SNAP_NAME)) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e.into()),
        }
    }
    let info = snapshot_info(&img, metrics, sid)?;
    timed(metrics, "close", || img.close())?;
    Ok(info)
}

fn flatten_open(
    metrics: &dyn CephObserver,
    img: &Image,
    timeout: Duration,
) -> Result<(), VolumeError> {
    let deadline = Instant::now() + timeout;
    timed(metrics, "flatten", || img.flatten_with_deadline(deadline)).map_err(|e| {
        if e.kind() == ErrorKind::TimedOut {
            e.detail(format!(
                "flattening took longer than {timeout:?}; a retry goes on where it stopped"
            ))
            .into()
        } else {
            e.into()
        }
    })
}

fn snapshot_info(
    img: &Image,
    metrics: &dyn CephObserver,
    id: SnapshotId,
) -> Result<SnapshotInfo, VolumeError> {
    let m = meta(img, metrics)?;
    let snaps = timed(metrics, "snap_list", || img.snap_list())?;
    let snap = snaps.iter().find(|s| s.name == id.snap);
    let (size, created, ready) = match snap {
        Some(s) => (
            s.size,
            timed(metrics, "snap_timestamp", || img.snap_timestamp(s.id))?,
            true,
        ),
        None => (
            timed(metrics, "size", || img.size())?,
            timed(metrics, "create_timestamp", || img.create_timestamp())?,
            false,
        ),
    };
    Ok(SnapshotInfo {
        id,
        source_volume: m.get(META_SOURCE).cloned().unwrap_or_default(),
        size,
        created,
        ready,
    })
}

/// The snapshot `id` if it exists and is `provisioner`'s.
pub fn get_snapshot(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    id: &SnapshotId,
    provisioner: &str,
) -> Result<Option<SnapshotInfo>, VolumeError> {
    let io = ioctx(cluster, metrics, &id.image_id())?;
    let Some(img) = open_if_exists(&io, metrics, &id.image)? else {
        return Ok(None);
    };
    check_snapshot(&meta(&img, metrics)?, provisioner, None, &id.image)?;
    let info = snapshot_info(&img, metrics, id.clone())?;
    Ok(info.ready.then_some(info))
}

/// Which snapshots [`list_snapshots`] returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapshotFilter {
    /// Only snapshots of this volume handle.
    pub source_volume: Option<String>,
    /// Only this snapshot.
    pub snapshot: Option<SnapshotId>,
}

/// The ready snapshots of `provisioner` in the pool and namespace of
/// `place` (its image is ignored) that pass `filter`, sorted by handle.
pub fn list_snapshots(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    place: &VolumeId,
    provisioner: &str,
    filter: &SnapshotFilter,
) -> Result<Vec<SnapshotInfo>, VolumeError> {
    let io = ioctx(cluster, metrics, place)?;
    let names = match &filter.snapshot {
        Some(s) => vec![s.image.clone()],
        None => timed(metrics, "list", || rbd::list_names(&io))?,
    };
    let mut out = Vec::new();
    for name in names {
        // Another client may remove it meanwhile.
        let Ok(img) = timed(metrics, "open", || Image::open_read_only(&io, &name)) else {
            continue;
        };
        let Ok(m) = meta(&img, metrics) else {
            continue;
        };
        if check_snapshot(&m, provisioner, None, &name).is_err() {
            continue;
        }
        let id = SnapshotId {
            cluster_id: place.cluster_id.clone(),
            pool: place.pool.clone(),
            rados_namespace: place.rados_namespace.clone(),
            image: name,
            snap: SNAP_NAME.to_owned(),
        };
        if filter.snapshot.as_ref().is_some_and(|s| *s != id) {
            continue;
        }
        let info = snapshot_info(&img, metrics, id)?;
        if !info.ready {
            continue;
        }
        if filter
            .source_volume
            .as_ref()
            .is_some_and(|v| *v != info.source_volume)
        {
            continue;
        }
        out.push(info);
    }
    out.sort_by_key(|i| i.id.handle());
    Ok(out)
}

/// One page of `items`: from `start`, at most `max` (0: all). Returns the
/// page and the next start (`None` at the end); `start` past the end is an
/// error.
pub fn page<T: Clone>(
    items: &[T],
    start: usize,
    max: usize,
) -> Result<(Vec<T>, Option<usize>), String> {
    if start > items.len() {
        return Err(format!(
            "starting token {start} is past the end ({} entries)",
            items.len()
        ));
    }
    let max = if max == 0 { usize::MAX } else { max };
    let end = start.saturating_add(max).min(items.len());
    let next = (end < items.len()).then_some(end);
    Ok((items[start..end].to_vec(), next))
}

/// Removes the snapshot `id` if it is `provisioner`'s: its RBD snapshot,
/// then the snapshot image, which goes to the trash while restores of it
/// still live ([`Deleted::Trashed`]). A leftover temporary image and
/// temporary snapshot of an interrupted create go too.
pub fn delete_snapshot(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    id: &SnapshotId,
    provisioner: &str,
) -> Result<Deleted, VolumeError> {
    delete_snapshot_fenced(cluster, metrics, &UNFENCED, id, provisioner)
}

/// [`delete_snapshot`] with `fence` asked before each destructive step.
pub fn delete_snapshot_fenced(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    id: &SnapshotId,
    provisioner: &str,
) -> Result<Deleted, VolumeError> {
    let place = id.image_id();
    let io = ioctx(cluster, metrics, &place)?;
    let temp = format!("{}{TEMP_SUFFIX}", id.image);
    let mut outcome = Deleted::AlreadyGone;
    for name in [id.image.as_str(), temp.as_str()] {
        let Some(img) = open_if_exists(&io, metrics, name)? else {
            if name == temp {
                match timed(metrics, "remove", || rbd::remove(&io, name)) {
                    Ok(()) => outcome = Deleted::Removed,
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(e) => return Err(e.into()),
                }
            }
            continue;
        };
        let m = meta(&img, metrics)?;
        if name == temp {
            if contradicts(&m, provisioner, None) {
                return Err(VolumeError::NotOwned {
                    image: name.to_owned(),
                    why: "its owner metadata names someone else".into(),
                });
            }
        } else {
            check_snapshot(&m, provisioner, None, name)?;
        }
        drop(img);
        // The temporary snapshot on the source, if a create stopped early.
        if let Some(src) = m.get(META_SOURCE).and_then(|s| VolumeId::parse(s).ok()) {
            if same_place(&src, &place).is_ok() {
                remove_temp_snap(&io, metrics, &src.image, &temp_snap_name(&id.image))?;
            }
        }
        let img = timed(metrics, "open", || Image::open(&io, name))?;
        fenced(fence, "rbd_snap_remove", name)?;
        for s in user_snaps(&img, metrics)? {
            // With clone format 2, one with restores moves to the snapshot
            // trash namespace.
            match timed(metrics, "snap_remove", || img.snap_remove(&s.name)) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
        timed(metrics, "close", || img.close())?;
        match remove_or_trash(cluster, metrics, fence, &io, name, name, provisioner)? {
            Deleted::AlreadyGone => {}
            done => outcome = done,
        }
    }
    if outcome == Deleted::AlreadyGone {
        outcome = purge_named_in_trash(cluster, metrics, &io, &id.image, provisioner)?;
    }
    Ok(outcome)
}

/// Removes the temporary RBD snapshot a create of snapshot image `image`
/// may have left on `source` (a create killed before its clone had owner
/// metadata names the source nowhere else). Nothing there is fine; a
/// missing source too.
pub fn remove_temp_snapshot(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    source: &VolumeId,
    image: &str,
) -> Result<(), VolumeError> {
    let io = ioctx(cluster, metrics, source)?;
    let snap = temp_snap_name(image);
    let Some(img) = open_if_exists(&io, metrics, &source.image)? else {
        return Ok(());
    };
    if !timed(metrics, "snap_exists", || img.snap_exists(&snap))? {
        return Ok(());
    }
    drop(img);
    fenced(fence, "rbd_snap_remove", &source.image)?;
    remove_temp_snap(&io, metrics, &source.image, &snap)
}

/// A retry after a trash move: purges the trash entries named `name` that
/// are `provisioner`'s, if nothing depends on them any more.
fn purge_named_in_trash(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    io: &IoCtx,
    name: &str,
    provisioner: &str,
) -> Result<Deleted, VolumeError> {
    let mut outcome = Deleted::AlreadyGone;
    let entries = timed(metrics, "trash_list", || rbd::trash_list(io))?;
    for entry in entries.iter().filter(|e| e.name == name) {
        let Ok(img) = timed(metrics, "open", || {
            Image::open_by_id_read_only(io, &entry.id)
        }) else {
            continue;
        };
        if meta(&img, metrics)?
            .get(META_PROVISIONER)
            .map(String::as_str)
            != Some(provisioner)
        {
            continue;
        }
        drop(img);
        outcome = purge_trashed(
            cluster,
            metrics,
            &UNFENCED,
            io,
            name,
            &entry.id,
            provisioner,
        )?;
    }
    Ok(outcome)
}

/// Removes image `name` (checked to be ours by the caller); one that still
/// has clones goes to the trash instead. Purges the parents it leaves
/// unused.
pub(crate) fn remove_or_trash(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    io: &IoCtx,
    name: &str,
    object: &str,
    provisioner: &str,
) -> Result<Deleted, VolumeError> {
    let (id, parent) = match timed(metrics, "open", || Image::open_read_only(io, name)) {
        Ok(img) => (
            timed(metrics, "id", || img.id())?,
            timed(metrics, "parent", || img.parent())?,
        ),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            // Half-made by a killed create: remove cleans that up too.
            fenced(fence, "rbd_remove", object)?;
            return match timed(metrics, "remove", || rbd::remove(io, name)) {
                Ok(()) => Ok(Deleted::Removed),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(Deleted::AlreadyGone),
                Err(e) => Err(e.into()),
            };
        }
        Err(e) => return Err(e.into()),
    };
    fenced(fence, "rbd_remove", object)?;
    match timed(metrics, "remove", || rbd::remove(io, name)) {
        Ok(()) => {
            purge_unused_ancestors(cluster, metrics, fence, parent, provisioner)?;
            Ok(Deleted::Removed)
        }
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(Deleted::AlreadyGone),
        Err(e) if e.kind() == ErrorKind::Busy && !has_snapshots_or_children(io, metrics, name) => {
            Err(VolumeError::InUse {
                image: name.to_owned(),
                watchers: 0,
            })
        }
        // A group snapshot's part is no snapshot the trash can wait out:
        // reported as librbd reports a group member (EMLINK), so the caller
        // undoes the group first.
        Err(e) if e.kind() == ErrorKind::HasSnapshots && in_group_snapshot(io, metrics, name) => {
            Err(VolumeError::Ceph(crate::Error::from_errno(
                libc::EMLINK,
                "rbd_remove",
                object,
            )))
        }
        Err(e) if matches!(e.kind(), ErrorKind::HasSnapshots | ErrorKind::Busy) => {
            fenced(fence, "rbd_trash_move", object)?;
            timed(metrics, "trash_move", || {
                rbd::trash_move(io, name, Duration::ZERO)
            })?;
            purge_trashed(cluster, metrics, fence, io, name, &id, provisioner)
        }
        Err(e) => Err(e.into()),
    }
}

/// Whether image `name` has a snapshot in the group namespace (its part of
/// an RBD group snapshot).
fn in_group_snapshot(io: &IoCtx, metrics: &dyn CephObserver, name: &str) -> bool {
    let Ok(img) = timed(metrics, "open", || Image::open_read_only(io, name)) else {
        return false;
    };
    let snaps = timed(metrics, "snap_list", || img.snap_list()).unwrap_or_default();
    snaps.iter().any(|s| {
        timed(metrics, "snap_namespace_type", || {
            img.snap_namespace_type(s.id)
        })
        .is_ok_and(|t| t == crate::rbd::SnapNamespaceType::Group)
    })
}

/// Purges trashed image `id` (checked to be ours by the caller) unless it
/// still has clones: then it stays ([`Deleted::Trashed`]) until the last
/// one goes.
pub(crate) fn purge_trashed(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    io: &IoCtx,
    name: &str,
    id: &str,
    provisioner: &str,
) -> Result<Deleted, VolumeError> {
    let (children, parent) = match timed(metrics, "open", || Image::open_by_id_read_only(io, id)) {
        Ok(img) => (
            timed(metrics, "children", || img.children())?,
            timed(metrics, "parent", || img.parent())?,
        ),
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Deleted::AlreadyGone),
        Err(e) => return Err(e.into()),
    };
    if !children.is_empty() {
        tracing::info!(
            image = name,
            clones = children.len(),
            "kept in the trash until its last clone is flattened or deleted"
        );
        return Ok(Deleted::Trashed);
    }
    purge(io, metrics, fence, name, id)?;
    purge_unused_ancestors(cluster, metrics, fence, parent, provisioner)?;
    Ok(Deleted::Purged)
}

/// Walks up from `parent` (the parent an image had before it was deleted or
/// flattened) and purges each trashed ancestor of `provisioner`'s that no
/// longer has clones. Returns how many it purged. Stops at the first image
/// that is not in the trash, not ours, or still in use.
pub fn purge_unused_ancestors(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    parent: Option<ParentInfo>,
    provisioner: &str,
) -> Result<usize, VolumeError> {
    let mut next: Option<LinkedImage> = parent.map(|p| p.image);
    let mut purged = 0;
    while let Some(p) = next.take() {
        if !p.trash || purged as u32 >= MAX_WALK {
            break;
        }
        let io = timed(metrics, "ioctx", || {
            cluster.ioctx_ns(&p.pool_name, &p.namespace)
        })?;
        let img = match timed(metrics, "open", || {
            Image::open_by_id_read_only(&io, &p.image_id)
        }) {
            Ok(img) => img,
            Err(e) if e.kind() == ErrorKind::NotFound => break,
            Err(e) => return Err(e.into()),
        };
        if meta(&img, metrics)?
            .get(META_PROVISIONER)
            .map(String::as_str)
            != Some(provisioner)
        {
            break;
        }
        if !timed(metrics, "children", || img.children())?.is_empty() {
            break;
        }
        let up = timed(metrics, "parent", || img.parent())?;
        drop(img);
        fenced(fence, "rbd_trash_remove", &p.image_name)?;
        match timed(metrics, "trash_remove", || {
            rbd::trash_remove(&io, &p.image_id, true)
        }) {
            Ok(()) => {
                tracing::info!(image = %p.image_name, "purged from the trash: its last clone is gone");
                purged += 1;
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) if matches!(e.kind(), ErrorKind::HasSnapshots | ErrorKind::Busy) => {
                tracing::debug!(image = %p.image_name, "not purged yet: {e}");
                break;
            }
            Err(e) => return Err(e.into()),
        }
        next = up.map(|u| u.image);
    }
    Ok(purged)
}

/// The garbage collector for the pool and namespace of `place`: removes
/// the temporary snapshots on `provisioner`'s volumes whose clone was given
/// up before it had a name (neither it nor its temporary image exists),
/// and purges every trashed image of `provisioner` that no clone depends on
/// any more. Returns how many images and snapshots it removed. A create
/// running at the same moment may lose its temporary snapshot; its retry
/// makes it again.
pub fn purge_orphans(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    place: &VolumeId,
    provisioner: &str,
) -> Result<usize, VolumeError> {
    let io = ioctx(cluster, metrics, place)?;
    let mut purged = 0;
    let names = timed(metrics, "list", || rbd::list_names(&io))?;
    for name in &names {
        let Ok(img) = timed(metrics, "open", || Image::open_read_only(&io, name)) else {
            continue;
        };
        if check_volume(&meta(&img, metrics)?, provisioner, name).is_err() {
            continue;
        }
        for s in user_snaps(&img, metrics)? {
            let Some(target) = s.name.strip_prefix(TEMP_SNAP_PREFIX) else {
                continue;
            };
            let temp = format!("{target}{TEMP_SUFFIX}");
            if names.iter().any(|n| n == target || *n == temp) {
                continue;
            }
            tracing::info!(image = %name, snapshot = %s.name, "removing a temporary snapshot of a clone given up");
            remove_temp_snap(&io, metrics, name, &s.name)?;
            purged += 1;
        }
    }
    for entry in timed(metrics, "trash_list", || rbd::trash_list(&io))? {
        let Ok(img) = timed(metrics, "open", || {
            Image::open_by_id_read_only(&io, &entry.id)
        }) else {
            continue;
        };
        if meta(&img, metrics)?
            .get(META_PROVISIONER)
            .map(String::as_str)
            != Some(provisioner)
        {
            continue;
        }
        drop(img);
        if purge_trashed(
            cluster,
            metrics,
            &UNFENCED,
            &io,
            &entry.name,
            &entry.id,
            provisioner,
        )? == Deleted::Purged
        {
            purged += 1;
        }
    }
    Ok(purged)
}

/// Depth handling for a new volume: flattens it now past the hard limit,
/// asks for a background flatten past the soft one.
fn finish_clone(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    io: &IoCtx,
    vol: &VolumeId,
    provisioner: &str,
    opts: &CloneOptions,
) -> Result<Cloned, VolumeError> {
    let img = timed(metrics, "open", || Image::open(io, &vol.image))?;
    let size = timed(metrics, "size", || img.size())?;
    let depth = timed(metrics, "clone_depth", || clone_depth(cluster, &img))?;
    let flatten = if depth > opts.depth.hard {
        let parent = timed(metrics, "parent", || img.parent())?;
        fenced(&*opts.fence, "rbd_flatten", &vol.image)?;
        flatten_open(metrics, &img, opts.flatten_timeout)?;
        timed(metrics, "close", || img.close())?;
        purge_unused_ancestors(cluster, metrics, &*opts.fence, parent, provisioner)?;
        Flatten::Done
    } else if depth > opts.depth.soft {
        Flatten::Background
    } else {
        Flatten::NotNeeded
    };
    Ok(Cloned {
        size,
        depth,
        flatten,
    })
}

/// Makes sure volume `vol` exists as a restore of snapshot `snap` and is
/// ours; creates it if needed, at `size` bytes (0: the snapshot's size; less
/// than that is refused). The snapshot must be in the same cluster, pool and
/// namespace. A volume of that name made from another source is a
/// [`VolumeError::Conflict`]; a missing snapshot is [`VolumeError::Missing`].
#[allow(clippy::too_many_arguments)]
pub fn ensure_volume_from_snapshot(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    snap: &SnapshotId,
    vol: &VolumeId,
    size: u64,
    options: &ImageOptions,
    owner: &Owner,
    opts: &CloneOptions,
) -> Result<Cloned, VolumeError> {
    let parent = Parent::Snapshot(snap);
    ensure_clone(cluster, metrics, parent, vol, size, options, owner, opts)
}

/// Makes sure volume `vol` exists as a clone of volume `source` and is
/// ours; creates it if needed through a temporary snapshot of `source`, at
/// `size` bytes (0: the source's size; less is refused). Same rules as
/// [`ensure_volume_from_snapshot`].
#[allow(clippy::too_many_arguments)]
pub fn ensure_volume_from_volume(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    source: &VolumeId,
    vol: &VolumeId,
    size: u64,
    options: &ImageOptions,
    owner: &Owner,
    opts: &CloneOptions,
) -> Result<Cloned, VolumeError> {
    let parent = Parent::Volume(source);
    ensure_clone(cluster, metrics, parent, vol, size, options, owner, opts)
}

/// What a new volume is cloned from.
#[derive(Clone, Copy)]
enum Parent<'a> {
    /// A snapshot: cloned from it directly.
    Snapshot(&'a SnapshotId),
    /// A volume: cloned from a temporary snapshot of it.
    Volume(&'a VolumeId),
}

impl Parent<'_> {
    /// The parent's image, as a volume.
    fn image(self) -> VolumeId {
        match self {
            Parent::Snapshot(s) => s.image_id(),
            Parent::Volume(v) => v.clone(),
        }
    }

    /// The handle a clone of it records as its source.
    fn handle(self) -> String {
        match self {
            Parent::Snapshot(s) => s.handle(),
            Parent::Volume(v) => v.handle(),
        }
    }

    /// What a missing parent is called in the error.
    fn missing(self) -> VolumeError {
        let image = match self {
            Parent::Snapshot(s) => s.to_string(),
            Parent::Volume(v) => v.to_string(),
        };
        VolumeError::Missing { image }
    }
}

/// [`ensure_volume_from_snapshot`] and [`ensure_volume_from_volume`]: the
/// same steps, but for how the parent is checked, sized and snapshotted.
#[allow(clippy::too_many_arguments)]
fn ensure_clone(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    parent: Parent<'_>,
    vol: &VolumeId,
    size: u64,
    options: &ImageOptions,
    owner: &Owner,
    opts: &CloneOptions,
) -> Result<Cloned, VolumeError> {
    let parent_image = parent.image();
    same_place(&parent_image, vol)?;
    if matches!(parent, Parent::Volume(_)) && parent_image.image == vol.image {
        return Err(VolumeError::Refused {
            why: format!("volume {vol} cannot be a clone of itself"),
        });
    }
    let io = ioctx(cluster, metrics, vol)?;
    let want = parent.handle();
    match open_if_exists(&io, metrics, &vol.image)? {
        Some(img) => {
            check_owner(&img, metrics, &owner.provisioner, &owner.pv_name)?;
            let m = meta(&img, metrics)?;
            check_source(&m, &vol.image, &want)?;
            if encryption::state_of(&m, &vol.image)?.encrypted() != opts.encryption.is_some() {
                return Err(VolumeError::Conflict {
                    image: vol.image.clone(),
                    why: "it exists, but its encryption is not what the class asks for".into(),
                });
            }
            let id = timed(metrics, "id", || img.id())?;
            drop(img);
            finish_cut_short_rename(&io, metrics, &*opts.fence, &vol.image, &id)?;
        }
        None => {
            let p = open_if_exists(&io, metrics, &parent_image.image)?
                .ok_or_else(|| parent.missing())?;
            let parent_meta = meta(&p, metrics)?;
            let parent_state = encryption::state_of(&parent_meta, &parent_image.image)?;
            let what = match parent {
                Parent::Snapshot(s) => format!("snapshot {s}"),
                Parent::Volume(v) => format!("volume {v}"),
            };
            encryption::check_compatible(
                &what,
                parent_state,
                &encryption::kms_id_of(&parent_meta),
                opts.encryption.as_ref().map(|e| e.params.kms_id.as_str()),
            )
            .map_err(|why| VolumeError::Refused { why })?;
            let crypt_meta = match &opts.encryption {
                Some(e) => encryption::clone_metadata(
                    &parent_meta,
                    &parent.handle(),
                    &parent_image.image,
                    &vol.handle(),
                    &e.params.kms_id,
                    &e.keys,
                )?,
                None => Vec::new(),
            };
            let (parent_size, parent_snap, temp_snap) = match parent {
                Parent::Snapshot(snap) => {
                    check_snapshot(&parent_meta, &owner.provisioner, None, &snap.image)?;
                    let snaps = timed(metrics, "snap_list", || p.snap_list())?;
                    let info = snaps
                        .iter()
                        .find(|i| i.name == snap.snap)
                        .ok_or_else(|| parent.missing())?;
                    (info.size, snap.snap.clone(), false)
                }
                Parent::Volume(source) => {
                    check_volume(&parent_meta, &owner.provisioner, &source.image)?;
                    let src_size = timed(metrics, "size", || p.size())?;
                    (src_size, temp_snap_name(&vol.image), true)
                }
            };
            if size != 0 && size < parent_size {
                return Err(VolumeError::ShrinkRefused {
                    image: vol.image.clone(),
                    current: parent_size,
                    requested: size,
                });
            }
            let features = timed(metrics, "features", || p.features())?;
            drop(p);
            let mut m: Vec<(&'static str, String)> = owner
                .pairs()
                .iter()
                .map(|(k, v)| (*k, (*v).to_owned()))
                .collect();
            m.push((META_SOURCE, want.clone()));
            m.extend(crypt_meta);
            let job = CloneJob {
                io: &io,
                parent: &parent_image.image,
                parent_snap: &parent_snap,
                temp_snap,
                name: &vol.image,
                provisioner: &owner.provisioner,
                meta: m,
                size,
                options: clone_options(options, features)?,
            };
            make_clone(metrics, &job, opts)?;
            let img = timed(metrics, "open", || Image::open_read_only(&io, &vol.image))?;
            check_owner(&img, metrics, &owner.provisioner, &owner.pv_name)?;
            check_source(&meta(&img, metrics)?, &vol.image, &want)?;
        }
    }
    finish_clone(cluster, metrics, &io, vol, &owner.provisioner, opts)
}

/// One bounded round of a background flatten of volume `vol` (ours):
/// `Ok(true)` once it has no parent (and the parents it left unused are
/// purged), `Ok(false)` when `deadline` passed first; call again to go on.
pub fn flatten_volume(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    vol: &VolumeId,
    provisioner: &str,
    deadline: Instant,
) -> Result<bool, VolumeError> {
    let io = ioctx(cluster, metrics, vol)?;
    let img = match timed(metrics, "open", || Image::open(&io, &vol.image)) {
        Ok(img) => img,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return Err(VolumeError::Missing {
                image: vol.to_string(),
            })
        }
        Err(e) => return Err(e.into()),
    };
    check_volume(&meta(&img, metrics)?, provisioner, &vol.image)?;
    let Some(parent) = timed(metrics, "parent", || img.parent())? else {
        return Ok(true);
    };
    match timed(metrics, "flatten", || img.flatten_with_deadline(deadline)) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::TimedOut => return Ok(false),
        Err(e) => return Err(e.into()),
    }
    timed(metrics, "close", || img.close())?;
    purge_unused_ancestors(cluster, metrics, &UNFENCED, Some(parent), provisioner)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_cover_the_list_once() {
        let items: Vec<u32> = (0..5).collect();
        assert_eq!(page(&items, 0, 2).unwrap(), (vec![0, 1], Some(2)));
        assert_eq!(page(&items, 2, 2).unwrap(), (vec![2, 3], Some(4)));
        assert_eq!(page(&items, 4, 2).unwrap(), (vec![4], None));
        assert_eq!(page(&items, 0, 0).unwrap(), (items.clone(), None));
        assert_eq!(page(&items, 5, 2).unwrap(), (vec![], None));
        assert!(page(&items, 6, 2).is_err());
    }

    #[test]
    fn sources_must_share_cluster_pool_and_namespace() {
        let v = |c: &str, p: &str, n: &str| VolumeId {
            cluster_id: c.into(),
            pool: p.into(),
            rados_namespace: n.into(),
            image: "i".into(),
        };
        assert!(same_place(&v("a", "p", ""), &v("a", "p", "")).is_ok());
        for other in [v("b", "p", ""), v("a", "q", ""), v("a", "p", "n")] {
            let e = same_place(&v("a", "p", ""), &other).unwrap_err();
            assert!(matches!(e, VolumeError::Refused { .. }), "{e}");
            assert!(e.to_string().contains("another cluster, pool"), "{e}");
        }
    }

    #[test]
    fn snapshot_images_and_volumes_are_told_apart() {
        let mut m = BTreeMap::from([(META_PROVISIONER.to_owned(), "p".to_owned())]);
        assert!(check_volume(&m, "p", "i").is_ok());
        assert!(check_snapshot(&m, "p", None, "i").is_err());
        assert!(check_volume(&m, "q", "i").is_err());
        m.insert(META_KIND.into(), KIND_SNAPSHOT.into());
        m.insert(META_SNAPSHOT.into(), "snap-1".into());
        assert!(check_volume(&m, "p", "i").is_err());
        assert!(check_snapshot(&m, "p", Some("snap-1"), "i").is_ok());
        assert!(check_snapshot(&m, "p", Some("snap-2"), "i").is_err());
        assert!(check_snapshot(&m, "q", None, "i").is_err());
        m.insert(META_SOURCE.into(), "rbdkit1/c/p//a".into());
        assert!(check_source(&m, "i", "rbdkit1/c/p//a").is_ok());
        assert!(matches!(
            check_source(&m, "i", "rbdkit1/c/p//b").unwrap_err(),
            VolumeError::Conflict { .. }
        ));
    }
}
