//! Snapshot namespaces: besides user snapshots, an image has snapshots taken
//! for a group snapshot, snapshots waiting in the trash (removed while a
//! clone still needs them) and mirror snapshots. `rbd_snap_list` shows only
//! user snapshots; these calls look at the others by snapshot id.

use std::mem::size_of;

use rbd_sys as sys;

use crate::error::Result;
use crate::rbd::Image;
use crate::util::{from_cstr, string_from_buf, with_growing_buffer};

/// The namespace a snapshot belongs to (`rbd_snap_namespace_type_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SnapNamespaceType {
    /// An ordinary snapshot, made by `snap_create`.
    User,
    /// Part of a group snapshot.
    Group,
    /// Removed while clones depend on it; gone once they are.
    Trash,
    /// A mirror snapshot (snapshot-based mirroring).
    Mirror,
    /// A type this version of rbdkit does not know.
    Other(u32),
}

impl SnapNamespaceType {
    pub(crate) fn from_raw(raw: sys::rbd_snap_namespace_type_t) -> SnapNamespaceType {
        match raw {
            sys::RBD_SNAP_NAMESPACE_TYPE_USER => SnapNamespaceType::User,
            sys::RBD_SNAP_NAMESPACE_TYPE_GROUP => SnapNamespaceType::Group,
            sys::RBD_SNAP_NAMESPACE_TYPE_TRASH => SnapNamespaceType::Trash,
            sys::RBD_SNAP_NAMESPACE_TYPE_MIRROR => SnapNamespaceType::Mirror,
            // The C enum's integer type is up to the compiler.
            #[allow(clippy::unnecessary_cast)]
            other => SnapNamespaceType::Other(other as u32),
        }
    }
}

/// The group snapshot an image snapshot belongs to
/// (`rbd_snap_group_namespace_t`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSnapNamespace {
    /// The pool id of the group.
    pub group_pool: i64,
    /// The group's name.
    pub group_name: String,
    /// The group snapshot's name.
    pub group_snap_name: String,
}

/// What a snapshot in the trash was before it was removed
/// (`rbd_snap_trash_namespace_t`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrashSnapNamespace {
    /// The namespace the snapshot was in.
    pub original_namespace_type: SnapNamespaceType,
    /// The snapshot's name there.
    pub original_name: String,
}

impl Image {
    fn snap_id_spec(&self, snap_id: u64) -> String {
        format!("{}@{{id {snap_id}}}", self.spec())
    }

    /// The namespace of the snapshot with id `snap_id`. Wraps
    /// `rbd_snap_get_namespace_type`.
    pub fn snap_namespace_type(&self, snap_id: u64) -> Result<SnapNamespaceType> {
        let mut raw: sys::rbd_snap_namespace_type_t = 0;
        // SAFETY: the image is open; `raw` is a valid out-pointer of the
        // header's enum type.
        let ret = unsafe { sys::rbd_snap_get_namespace_type(self.raw(), snap_id, &mut raw) };
        crate::error::cvt(ret, "rbd_snap_get_namespace_type", || {
            self.snap_id_spec(snap_id)
        })?;
        Ok(SnapNamespaceType::from_raw(raw))
    }

    /// The group snapshot that snapshot `snap_id` is part of; fails with
    /// `InvalidArgument` for a snapshot in another namespace. Wraps
    /// `rbd_snap_get_group_namespace` and `rbd_snap_group_namespace_cleanup`.
    pub fn snap_group_namespace(&self, snap_id: u64) -> Result<GroupSnapNamespace> {
        let mut ns = sys::rbd_snap_group_namespace_t::default();
        let size = size_of::<sys::rbd_snap_group_namespace_t>();
        // SAFETY: the image is open; `ns` is the header's struct and `size`
        // its size (librbd checks it against its own).
        let ret = unsafe { sys::rbd_snap_get_group_namespace(self.raw(), snap_id, &mut ns, size) };
        crate::error::cvt(ret, "rbd_snap_get_group_namespace", || {
            self.snap_id_spec(snap_id)
        })?;
        // SAFETY: on success librbd filled both strings (NUL-terminated, or
        // null); they are freed just below.
        let out = unsafe {
            GroupSnapNamespace {
                group_pool: ns.group_pool,
                group_name: from_cstr(ns.group_name),
                group_snap_name: from_cstr(ns.group_snap_name),
            }
        };
        // SAFETY: `ns` was filled by rbd_snap_get_group_namespace and is
        // cleaned up once, with the same size.
        unsafe { sys::rbd_snap_group_namespace_cleanup(&mut ns, size) };
        Ok(out)
    }

    /// The name snapshot `snap_id` had before it moved to the trash; fails
    /// with `InvalidArgument` for a snapshot that is not in the trash. Wraps
    /// `rbd_snap_get_trash_namespace` (growing the buffer on `ERANGE`).
    pub fn snap_trash_original_name(&self, snap_id: u64) -> Result<String> {
        let object = || self.snap_id_spec(snap_id);
        let buf = with_growing_buffer(64, "rbd_snap_get_trash_namespace", &object, |buf| {
            // SAFETY: the image is open; `buf` is writable for `buf.len()`
            // bytes, the size passed; librbd answers -ERANGE rather than
            // write past it.
            let ret = unsafe {
                sys::rbd_snap_get_trash_namespace(
                    self.raw(),
                    snap_id,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            (i64::from(ret), 0)
        })?;
        Ok(string_from_buf(&buf))
    }

    /// The original namespace and name of snapshot `snap_id`, which is in the
    /// trash. Wraps `rbd_snap_get_trash_namespace2` and
    /// `rbd_snap_trash_namespace_cleanup`, added in librbd 1.19 (Ceph 19
    /// Squid); built against older headers it fails with `NotSupported`.
    pub fn snap_trash_namespace(&self, snap_id: u64) -> Result<TrashSnapNamespace> {
        #[cfg(librbd_1_19)]
        {
            let mut ns = sys::rbd_snap_trash_namespace_t::default();
            let size = size_of::<sys::rbd_snap_trash_namespace_t>();
            // SAFETY: the image is open; `ns` is the header's struct and
            // `size` its size (librbd checks it against its own).
            let ret =
                unsafe { sys::rbd_snap_get_trash_namespace2(self.raw(), snap_id, &mut ns, size) };
            crate::error::cvt(ret, "rbd_snap_get_trash_namespace2", || {
                self.snap_id_spec(snap_id)
            })?;
            let out = TrashSnapNamespace {
                original_namespace_type: SnapNamespaceType::from_raw(ns.original_namespace_type),
                // SAFETY: on success librbd filled the name (NUL-terminated);
                // it is freed just below.
                original_name: unsafe { from_cstr(ns.original_name) },
            };
            // SAFETY: `ns` was filled by rbd_snap_get_trash_namespace2 and is
            // cleaned up once, with the same size.
            unsafe { sys::rbd_snap_trash_namespace_cleanup(&mut ns, size) };
            Ok(out)
        }
        #[cfg(not(librbd_1_19))]
        Err(crate::rbd::needs_librbd(
            "rbd_snap_get_trash_namespace2",
            self.snap_id_spec(snap_id),
            19,
        ))
    }
}
