//! The trash: deferred deletion of images, restore and purge.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rbd_sys as sys;

use crate::error::{cvt, Result};
use crate::rados::IoCtx;
use crate::util::{cstr, fill_array, from_cstr};

/// Why an image is in the trash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TrashSource {
    /// Moved by a user (`rbd trash mv`, [`trash_move`]).
    User,
    /// Moved by mirroring.
    Mirroring,
    /// Moved by migration.
    Migration,
    /// Being removed (a remove that moves to the trash first).
    Removing,
    /// A parent kept for its clones.
    UserParent,
    /// A value this library does not know.
    Other(u32),
}

/// One trash entry, from `rbd_trash_list` / `rbd_trash_get`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrashEntry {
    /// The image id (the key for restore and remove).
    pub id: String,
    /// The image's name when it was moved.
    pub name: String,
    /// Why it is there.
    pub source: TrashSource,
    /// When it was moved.
    pub deletion_time: SystemTime,
    /// Before this time it can only be removed with force.
    pub deferment_end_time: SystemTime,
}

fn entry(e: &sys::rbd_trash_image_info_t) -> TrashEntry {
    let at = |t: libc::time_t| UNIX_EPOCH + Duration::from_secs(t.max(0) as u64);
    TrashEntry {
        // SAFETY: librbd filled these strings; the caller cleans them after.
        id: unsafe { from_cstr(e.id) },
        // SAFETY: as above.
        name: unsafe { from_cstr(e.name) },
        source: match e.source {
            sys::RBD_TRASH_IMAGE_SOURCE_USER => TrashSource::User,
            sys::RBD_TRASH_IMAGE_SOURCE_MIRRORING => TrashSource::Mirroring,
            sys::RBD_TRASH_IMAGE_SOURCE_MIGRATION => TrashSource::Migration,
            sys::RBD_TRASH_IMAGE_SOURCE_REMOVING => TrashSource::Removing,
            sys::RBD_TRASH_IMAGE_SOURCE_USER_PARENT => TrashSource::UserParent,
            other => TrashSource::Other(other),
        },
        deletion_time: at(e.deletion_time),
        deferment_end_time: at(e.deferment_end_time),
    }
}

/// Moves an image to the trash; it can be restored until it is removed.
/// `delay` keeps it from being purged before then. Wraps `rbd_trash_move`.
pub fn trash_move(ioctx: &IoCtx, name: &str, delay: Duration) -> Result<()> {
    let n = cstr(name, "rbd_trash_move", "image name")?;
    // SAFETY: the ioctx is live; `n` is NUL-terminated.
    let ret = unsafe { sys::rbd_trash_move(ioctx.raw(), n.as_ptr(), delay.as_secs()) };
    cvt(ret, "rbd_trash_move", || ioctx.object_spec(name))?;
    Ok(())
}

/// Lists the trash of the ioctx's pool and namespace. Wraps `rbd_trash_list`.
pub fn trash_list(ioctx: &IoCtx) -> Result<Vec<TrashEntry>> {
    let (ret, mut entries) = fill_array(|p, n| {
        // SAFETY: `p` has room for `*n` entries; on -ERANGE librbd sets `*n`
        // to the count it needs.
        unsafe { sys::rbd_trash_list(ioctx.raw(), p, n) }
    });
    cvt(ret, "rbd_trash_list", || ioctx.spec())?;
    let out = entries.iter().map(entry).collect();
    // SAFETY: the entries were filled and are freed once.
    unsafe { sys::rbd_trash_list_cleanup(entries.as_mut_ptr(), entries.len()) };
    Ok(out)
}

/// One trash entry by image id. Wraps `rbd_trash_get`.
pub fn trash_get(ioctx: &IoCtx, id: &str) -> Result<TrashEntry> {
    let i = cstr(id, "rbd_trash_get", "image id")?;
    let mut info = sys::rbd_trash_image_info_t::default();
    // SAFETY: `info` is a valid out-struct, cleaned below once filled.
    let ret = unsafe { sys::rbd_trash_get(ioctx.raw(), i.as_ptr(), &mut info) };
    cvt(ret, "rbd_trash_get", || {
        format!("{} (trash id {id})", ioctx.spec())
    })?;
    let out = entry(&info);
    // SAFETY: filled by rbd_trash_get, cleaned once.
    unsafe { sys::rbd_trash_get_cleanup(&mut info) };
    Ok(out)
}

/// Restores a trashed image under `name`. Wraps `rbd_trash_restore`.
pub fn trash_restore(ioctx: &IoCtx, id: &str, name: &str) -> Result<()> {
    let i = cstr(id, "rbd_trash_restore", "image id")?;
    let n = cstr(name, "rbd_trash_restore", "image name")?;
    // SAFETY: the ioctx is live; both strings are NUL-terminated.
    let ret = unsafe { sys::rbd_trash_restore(ioctx.raw(), i.as_ptr(), n.as_ptr()) };
    cvt(ret, "rbd_trash_restore", || ioctx.object_spec(name))?;
    Ok(())
}

/// Deletes a trashed image for good. `force` ignores the deferment time.
/// Wraps `rbd_trash_remove`.
pub fn trash_remove(ioctx: &IoCtx, id: &str, force: bool) -> Result<()> {
    let i = cstr(id, "rbd_trash_remove", "image id")?;
    // SAFETY: the ioctx is live; `i` is NUL-terminated.
    let ret = unsafe { sys::rbd_trash_remove(ioctx.raw(), i.as_ptr(), force) };
    cvt(ret, "rbd_trash_remove", || {
        format!("{} (trash id {id})", ioctx.spec())
    })?;
    Ok(())
}

/// [`trash_remove`] that stops once `deadline` passes, with an
/// [`crate::ErrorKind::TimedOut`] error; the image's data may then be partly
/// removed, and a later call finishes. Wraps `rbd_trash_remove_with_progress`,
/// whose progress callback checks the deadline.
pub fn trash_remove_with_deadline(
    ioctx: &IoCtx,
    id: &str,
    force: bool,
    deadline: std::time::Instant,
) -> Result<()> {
    let i = cstr(id, "rbd_trash_remove_with_progress", "image id")?;
    crate::util::with_deadline(
        deadline,
        "rbd_trash_remove_with_progress",
        || format!("{} (trash id {id})", ioctx.spec()),
        |cb, arg| {
            // SAFETY: the ioctx is live; `i` is NUL-terminated; `cb`/`arg`
            // are the deadline callback and its `Instant`, which outlives
            // this call.
            unsafe { sys::rbd_trash_remove_with_progress(ioctx.raw(), i.as_ptr(), force, cb, arg) }
        },
    )
}

/// Removes every trashed image whose deferment ended before `expire`.
/// Wraps `rbd_trash_purge`.
pub fn trash_purge(ioctx: &IoCtx, expire: SystemTime) -> Result<()> {
    let ts = expire
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as libc::time_t;
    // SAFETY: the ioctx is live; threshold -1 disables the usage threshold.
    let ret = unsafe { sys::rbd_trash_purge(ioctx.raw(), ts, -1.0) };
    cvt(ret, "rbd_trash_purge", || ioctx.spec())?;
    Ok(())
}
