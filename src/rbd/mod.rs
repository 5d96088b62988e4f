//! librbd: images and everything about them.
//!
//! The layout follows go-ceph's `rbd` package, one file per area:
//! [`image`](crate::rbd::Image) lifecycle and info, snapshots, clones, trash,
//! metadata, watchers, locks, I/O, diff, pool set-up and mirroring. Functions that act
//! on a pool (`create`, `list`, `remove`, trash) take an [`IoCtx`]; the rest
//! are methods on an open [`Image`].
//!
//! [`IoCtx`]: crate::rados::IoCtx

use crate::error::{Error, ErrorKind};

pub mod aio;
mod clone;
mod config;
mod diff;
mod encryption;
mod features;
mod group;
mod image;
mod io;
mod locks;
mod metadata;
mod migration;
mod mirror;
mod options;
mod pool;
mod snap_namespace;
mod snapshot;
#[cfg(feature = "service")]
mod tokio_io;
mod trash;
mod watchers;

#[doc(hidden)]
pub use aio::aio_live_requests;
pub use aio::{AioClose, AioFuture, AioOpen, AioRead, IoBuf, MAX_AIO_LEN};
pub use clone::{clone, clone_by_snap_id, LinkedImage, ParentInfo};
pub use config::{config_pool_list, ConfigOption, ConfigSource};
pub use encryption::{EncryptionAlgorithm, EncryptionFormat, EncryptionSpec};
pub use features::Features;
pub use group::{
    group_create, group_image_add, group_image_list, group_image_remove, group_list, group_remove,
    group_rename, group_snap_create, group_snap_list, group_snap_remove, group_snap_rollback,
    GroupImage, GroupSnap,
};
pub use image::{
    create, list, list_names, remove, remove_with_deadline, rename, Image, ImageInfo, ImageSpec,
};
pub use locks::{LockMode, Locker, Lockers};
pub use migration::{
    migration_abort, migration_commit, migration_execute, migration_prepare, migration_status,
    MigrationState, MigrationStatus,
};
pub use mirror::{
    check_schedule_interval, check_schedule_start_time, mirror_mode_get, mirror_mode_set,
    mirror_peer_bootstrap_create, mirror_peer_bootstrap_import, mirror_peer_site_add,
    mirror_peer_site_list, mirror_peer_site_remove, mirror_site_name_get, mirror_site_name_set,
    mirror_snapshot_schedule_add, mirror_snapshot_schedule_list, mirror_snapshot_schedule_remove,
    mirror_snapshot_schedule_status, mirror_uuid_get, MirrorGlobalStatus, MirrorImageInfo,
    MirrorImageMode, MirrorImageState, MirrorMode, MirrorPeerDirection, MirrorPeerSite,
    MirrorSiteStatus, MirrorSnapNamespace, MirrorSnapState, MirrorSnapshotFlags,
    MirrorSnapshotSchedule, MirrorStatusState, ScheduleLevel, ScheduledImage, SnapshotReplay,
};
pub use options::ImageOptions;
pub use pool::{
    namespace_create, namespace_exists, namespace_list, namespace_remove, pool_init,
    pool_metadata_get, pool_metadata_remove, pool_metadata_set, pool_stats, RbdPoolStats,
};
pub use snap_namespace::{GroupSnapNamespace, SnapNamespaceType, TrashSnapNamespace};
pub use snapshot::SnapInfo;
#[cfg(feature = "service")]
pub use tokio_io::ImageIo;
pub use trash::{
    trash_get, trash_list, trash_move, trash_purge, trash_remove, trash_remove_with_deadline,
    trash_restore, TrashEntry, TrashSource,
};
pub use watchers::{UpdateWatch, Watcher, UNWATCH_TIMEOUT};

/// The librbd version this process loaded, as `(major, minor, extra)`.
/// Wraps `rbd_version`.
pub fn version() -> (i32, i32, i32) {
    let (mut major, mut minor, mut extra) = (0, 0, 0);
    // SAFETY: three valid out-pointers; the call has no other preconditions.
    unsafe { rbd_sys::rbd_version(&mut major, &mut minor, &mut extra) };
    (major, minor, extra)
}

/// The librbd minor version (1.x) of the headers rbdkit was built against.
pub const BUILT_LIBRBD_MINOR: u32 = match u32::from_str_radix(env!("RBDKIT_LIBRBD_MINOR"), 10) {
    Ok(n) => n,
    Err(_) => 0,
};

/// The Ceph release that shipped librbd 1.`minor`.
pub(crate) fn release_name(minor: u32) -> &'static str {
    match minor {
        16 => "Ceph 16 Pacific",
        17 => "Ceph 17 Quincy",
        18 => "Ceph 18 Reef",
        19 => "Ceph 19 Squid",
        20 => "Ceph 20 Tentacle",
        _ => "a newer Ceph",
    }
}

/// The error of a call whose C function the librbd headers rbdkit was
/// built against lack: `NotSupported`, naming the release that added it.
#[allow(dead_code)] // unused when built against the newest headers
pub(crate) fn needs_librbd(op: &'static str, object: impl Into<String>, minor: u32) -> Error {
    Error::with_kind(
        ErrorKind::NotSupported,
        libc::EOPNOTSUPP,
        op,
        object,
        format!(
            "needs librbd 1.{minor} ({}) or newer; rbdkit was built against librbd 1.{BUILT_LIBRBD_MINOR} ({})",
            release_name(minor),
            release_name(BUILT_LIBRBD_MINOR)
        ),
    )
}
