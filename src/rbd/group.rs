//! Groups: sets of images that are snapshotted together (crash-consistent
//! group snapshots).

use std::mem::size_of;

use rbd_sys as sys;

use crate::error::{cvt, Result};
use crate::rados::IoCtx;
use crate::util::{cstr, fill_array, from_cstr, sized_buffer, split_nul_list};

/// An image in a group, from `rbd_group_image_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupImage {
    /// Image name.
    pub name: String,
    /// Pool id of the image.
    pub pool_id: i64,
    /// False while the image is only half added or removed.
    pub attached: bool,
}

/// A group snapshot, from `rbd_group_snap_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSnap {
    /// Snapshot name.
    pub name: String,
    /// False while the snapshot is being taken (or failed half-way).
    pub complete: bool,
}

fn group_obj(io: &IoCtx, group: &str) -> String {
    format!("{} (group)", io.object_spec(group))
}

/// Creates a group. Wraps `rbd_group_create`.
pub fn group_create(io: &IoCtx, group: &str) -> Result<()> {
    let g = cstr(group, "rbd_group_create", "group name")?;
    // SAFETY: the ioctx is live; `g` is NUL-terminated.
    let ret = unsafe { sys::rbd_group_create(io.raw(), g.as_ptr()) };
    cvt(ret, "rbd_group_create", || group_obj(io, group))?;
    Ok(())
}

/// Removes a group (its images stay). Wraps `rbd_group_remove`.
pub fn group_remove(io: &IoCtx, group: &str) -> Result<()> {
    let g = cstr(group, "rbd_group_remove", "group name")?;
    // SAFETY: the ioctx is live; `g` is NUL-terminated.
    let ret = unsafe { sys::rbd_group_remove(io.raw(), g.as_ptr()) };
    cvt(ret, "rbd_group_remove", || group_obj(io, group))?;
    Ok(())
}

/// Renames a group. Wraps `rbd_group_rename`.
pub fn group_rename(io: &IoCtx, from: &str, to: &str) -> Result<()> {
    let f = cstr(from, "rbd_group_rename", "group name")?;
    let t = cstr(to, "rbd_group_rename", "group name")?;
    // SAFETY: the ioctx is live; both names are NUL-terminated.
    let ret = unsafe { sys::rbd_group_rename(io.raw(), f.as_ptr(), t.as_ptr()) };
    cvt(ret, "rbd_group_rename", || group_obj(io, from))?;
    Ok(())
}

/// Lists the groups of the ioctx's pool and namespace. Wraps `rbd_group_list`.
pub fn group_list(io: &IoCtx) -> Result<Vec<String>> {
    let buf = sized_buffer(1024, "rbd_group_list", &|| io.spec(), |p, len| {
        // SAFETY: `p` is writable for `*len` bytes; librbd sets `*len` to the
        // size used (or needed, with -ERANGE).
        unsafe { sys::rbd_group_list(io.raw(), p, len) }
    })?;
    Ok(split_nul_list(&buf))
}

/// Adds an image to a group. Wraps `rbd_group_image_add`.
pub fn group_image_add(group_io: &IoCtx, group: &str, image_io: &IoCtx, image: &str) -> Result<()> {
    let g = cstr(group, "rbd_group_image_add", "group name")?;
    let i = cstr(image, "rbd_group_image_add", "image name")?;
    // SAFETY: both ioctxs are live; both names are NUL-terminated.
    let ret =
        unsafe { sys::rbd_group_image_add(group_io.raw(), g.as_ptr(), image_io.raw(), i.as_ptr()) };
    cvt(ret, "rbd_group_image_add", || {
        format!(
            "{} -> {}",
            image_io.object_spec(image),
            group_obj(group_io, group)
        )
    })?;
    Ok(())
}

/// Removes an image from a group. Wraps `rbd_group_image_remove`.
pub fn group_image_remove(
    group_io: &IoCtx,
    group: &str,
    image_io: &IoCtx,
    image: &str,
) -> Result<()> {
    let g = cstr(group, "rbd_group_image_remove", "group name")?;
    let i = cstr(image, "rbd_group_image_remove", "image name")?;
    // SAFETY: both ioctxs are live; both names are NUL-terminated.
    let ret = unsafe {
        sys::rbd_group_image_remove(group_io.raw(), g.as_ptr(), image_io.raw(), i.as_ptr())
    };
    cvt(ret, "rbd_group_image_remove", || {
        format!(
            "{} in {}",
            image_io.object_spec(image),
            group_obj(group_io, group)
        )
    })?;
    Ok(())
}

/// Lists a group's images. Wraps `rbd_group_image_list`.
pub fn group_image_list(io: &IoCtx, group: &str) -> Result<Vec<GroupImage>> {
    let g = cstr(group, "rbd_group_image_list", "group name")?;
    let size = size_of::<sys::rbd_group_image_info_t>();
    let (ret, mut entries) = fill_array(|p, n| {
        // SAFETY: `p` has room for `*n` entries of `size` bytes; on -ERANGE
        // librbd sets `*n` to the count it needs.
        unsafe { sys::rbd_group_image_list(io.raw(), g.as_ptr(), p, size, n) }
    });
    cvt(ret, "rbd_group_image_list", || group_obj(io, group))?;
    let out = entries
        .iter()
        .map(|e| GroupImage {
            // SAFETY: librbd filled these entries.
            name: unsafe { from_cstr(e.name) },
            pool_id: e.pool,
            attached: e.state == sys::RBD_GROUP_IMAGE_STATE_ATTACHED,
        })
        .collect();
    // SAFETY: the entries were filled and are freed once.
    unsafe { sys::rbd_group_image_list_cleanup(entries.as_mut_ptr(), size, entries.len()) };
    Ok(out)
}

/// Snapshots every image of the group at once. Wraps `rbd_group_snap_create`.
pub fn group_snap_create(io: &IoCtx, group: &str, snap: &str) -> Result<()> {
    let g = cstr(group, "rbd_group_snap_create", "group name")?;
    let s = cstr(snap, "rbd_group_snap_create", "snapshot name")?;
    // SAFETY: the ioctx is live; both names are NUL-terminated.
    let ret = unsafe { sys::rbd_group_snap_create(io.raw(), g.as_ptr(), s.as_ptr()) };
    cvt(ret, "rbd_group_snap_create", || {
        format!("{}@{snap}", group_obj(io, group))
    })?;
    Ok(())
}

/// Removes a group snapshot. Wraps `rbd_group_snap_remove`.
pub fn group_snap_remove(io: &IoCtx, group: &str, snap: &str) -> Result<()> {
    let g = cstr(group, "rbd_group_snap_remove", "group name")?;
    let s = cstr(snap, "rbd_group_snap_remove", "snapshot name")?;
    // SAFETY: the ioctx is live; both names are NUL-terminated.
    let ret = unsafe { sys::rbd_group_snap_remove(io.raw(), g.as_ptr(), s.as_ptr()) };
    cvt(ret, "rbd_group_snap_remove", || {
        format!("{}@{snap}", group_obj(io, group))
    })?;
    Ok(())
}

/// Rolls every image of the group back to a group snapshot. Wraps
/// `rbd_group_snap_rollback`.
pub fn group_snap_rollback(io: &IoCtx, group: &str, snap: &str) -> Result<()> {
    let g = cstr(group, "rbd_group_snap_rollback", "group name")?;
    let s = cstr(snap, "rbd_group_snap_rollback", "snapshot name")?;
    // SAFETY: the ioctx is live; both names are NUL-terminated.
    let ret = unsafe { sys::rbd_group_snap_rollback(io.raw(), g.as_ptr(), s.as_ptr()) };
    cvt(ret, "rbd_group_snap_rollback", || {
        format!("{}@{snap}", group_obj(io, group))
    })?;
    Ok(())
}

/// Lists a group's snapshots. Wraps `rbd_group_snap_list`.
pub fn group_snap_list(io: &IoCtx, group: &str) -> Result<Vec<GroupSnap>> {
    let g = cstr(group, "rbd_group_snap_list", "group name")?;
    let size = size_of::<sys::rbd_group_snap_info_t>();
    let (ret, mut entries) = fill_array(|p, n| {
        // SAFETY: `p` has room for `*n` entries of `size` bytes; on -ERANGE
        // librbd sets `*n` to the count it needs.
        unsafe { sys::rbd_group_snap_list(io.raw(), g.as_ptr(), p, size, n) }
    });
    cvt(ret, "rbd_group_snap_list", || group_obj(io, group))?;
    let out = entries
        .iter()
        .map(|e| GroupSnap {
            // SAFETY: librbd filled these entries.
            name: unsafe { from_cstr(e.name) },
            complete: e.state == sys::RBD_GROUP_SNAP_STATE_COMPLETE,
        })
        .collect();
    // SAFETY: the entries were filled and are freed once.
    unsafe { sys::rbd_group_snap_list_cleanup(entries.as_mut_ptr(), size, entries.len()) };
    Ok(out)
}
