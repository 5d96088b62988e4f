//! Layering: clones of protected snapshots, their parents and children.

use rbd_sys as sys;

use crate::error::{cvt, Error, Result};
use crate::rados::IoCtx;
use crate::rbd::options::ImageOptions;
use crate::rbd::Image;
use crate::util::{cstr, fill_array, from_cstr};

/// Creates `child` as a copy-on-write clone of `parent@snapshot`. Wraps
/// `rbd_clone3`. The parent needs the `layering` feature and, with clone
/// format 1, a protected snapshot.
pub fn clone(
    parent_ioctx: &IoCtx,
    parent: &str,
    snapshot: &str,
    child_ioctx: &IoCtx,
    child: &str,
    options: &ImageOptions,
) -> Result<()> {
    let object = child_ioctx.object_spec(child);
    if child.is_empty() {
        return Err(Error::invalid("rbd_clone3", object, "clone name is empty"));
    }
    let p = cstr(parent, "rbd_clone3", "parent image name")?;
    let s = cstr(snapshot, "rbd_clone3", "snapshot name")?;
    let c = cstr(child, "rbd_clone3", "clone name")?;
    let opts = options.to_raw("rbd_clone3", &object)?;
    // SAFETY: both ioctxs are live; all names are NUL-terminated; librbd only
    // reads `opts`.
    let ret = unsafe {
        sys::rbd_clone3(
            parent_ioctx.raw(),
            p.as_ptr(),
            s.as_ptr(),
            child_ioctx.raw(),
            c.as_ptr(),
            opts.0,
        )
    };
    cvt(ret, "rbd_clone3", || {
        format!(
            "{}@{snapshot} -> {object}",
            parent_ioctx.object_spec(parent)
        )
    })?;
    Ok(())
}

/// Creates `child` as a copy-on-write clone of the parent's snapshot with id
/// `snap_id`, which may be in any snapshot namespace (e.g. one image's part
/// of a group snapshot), not only a user snapshot. Wraps `rbd_clone4`, added
/// in librbd 1.19 (Ceph 19 Squid); built against older headers it fails with
/// `NotSupported`. Snapshots other than user ones need clone format 2.
pub fn clone_by_snap_id(
    parent_ioctx: &IoCtx,
    parent: &str,
    snap_id: u64,
    child_ioctx: &IoCtx,
    child: &str,
    options: &ImageOptions,
) -> Result<()> {
    const OP: &str = "rbd_clone4";
    let object = child_ioctx.object_spec(child);
    if child.is_empty() {
        return Err(Error::invalid(OP, object, "clone name is empty"));
    }
    #[cfg(librbd_1_19)]
    {
        let p = cstr(parent, OP, "parent image name")?;
        let c = cstr(child, OP, "clone name")?;
        let opts = options.to_raw(OP, &object)?;
        // SAFETY: both ioctxs are live; both names are NUL-terminated;
        // librbd only reads `opts` (librbd.h: rbd_clone4 takes the parent
        // snapshot by id, otherwise as rbd_clone3).
        let ret = unsafe {
            sys::rbd_clone4(
                parent_ioctx.raw(),
                p.as_ptr(),
                snap_id,
                child_ioctx.raw(),
                c.as_ptr(),
                opts.0,
            )
        };
        cvt(ret, OP, || {
            format!(
                "{}@{{id {snap_id}}} -> {object}",
                parent_ioctx.object_spec(parent)
            )
        })?;
        Ok(())
    }
    #[cfg(not(librbd_1_19))]
    {
        let _ = (parent, snap_id, options);
        Err(crate::rbd::needs_librbd(
            OP,
            format!(
                "{}@{{id {snap_id}}} -> {object}",
                parent_ioctx.object_spec(parent)
            ),
            19,
        ))
    }
}

/// An image linked to another by layering (a parent or a child).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkedImage {
    /// Pool id.
    pub pool_id: i64,
    /// Pool name.
    pub pool_name: String,
    /// Rados namespace.
    pub namespace: String,
    /// Image id.
    pub image_id: String,
    /// Image name.
    pub image_name: String,
    /// True when the image is in the trash.
    pub trash: bool,
}

impl LinkedImage {
    fn from_raw(s: &sys::rbd_linked_image_spec_t) -> LinkedImage {
        // SAFETY: librbd filled these strings; the caller frees them after.
        unsafe {
            LinkedImage {
                pool_id: s.pool_id,
                pool_name: from_cstr(s.pool_name),
                namespace: from_cstr(s.pool_namespace),
                image_id: from_cstr(s.image_id),
                image_name: from_cstr(s.image_name),
                trash: s.trash,
            }
        }
    }
}

/// A clone's parent: the image and the snapshot it was cloned from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentInfo {
    /// The parent image.
    pub image: LinkedImage,
    /// The parent snapshot's id.
    pub snap_id: u64,
    /// The parent snapshot's name.
    pub snap_name: String,
}

impl Image {
    /// The parent of a clone, or `None` for an image that is not a clone (or
    /// was flattened). Wraps `rbd_get_parent`.
    pub fn parent(&self) -> Result<Option<ParentInfo>> {
        let mut img = sys::rbd_linked_image_spec_t::default();
        let mut snap = sys::rbd_snap_spec_t::default();
        // SAFETY: both out-structs are the header's types; on success librbd
        // fills them and we free them below with the matching cleanups.
        let ret = unsafe { sys::rbd_get_parent(self.raw(), &mut img, &mut snap) };
        if ret == -libc::ENOENT {
            return Ok(None);
        }
        self.cvt(ret, "rbd_get_parent")?;
        let info = ParentInfo {
            image: LinkedImage::from_raw(&img),
            snap_id: snap.id,
            // SAFETY: filled by librbd, freed just below.
            snap_name: unsafe { from_cstr(snap.name) },
        };
        // SAFETY: each struct was filled by rbd_get_parent and is cleaned once.
        unsafe {
            sys::rbd_linked_image_spec_cleanup(&mut img);
            sys::rbd_snap_spec_cleanup(&mut snap);
        }
        Ok(Some(info))
    }

    /// The clones of this image (of the snapshot this handle is set to, or
    /// of all snapshots for the head). Wraps `rbd_list_children3`.
    pub fn children(&self) -> Result<Vec<LinkedImage>> {
        self.linked_list("rbd_list_children3", |raw, specs, n| {
            // SAFETY: forwarded from `linked_list`, which upholds the contract.
            unsafe { sys::rbd_list_children3(raw, specs, n) }
        })
    }

    /// All descendants: children, their children, and so on. Wraps
    /// `rbd_list_descendants`.
    pub fn descendants(&self) -> Result<Vec<LinkedImage>> {
        self.linked_list("rbd_list_descendants", |raw, specs, n| {
            // SAFETY: forwarded from `linked_list`, which upholds the contract.
            unsafe { sys::rbd_list_descendants(raw, specs, n) }
        })
    }

    fn linked_list(
        &self,
        op: &'static str,
        call: impl Fn(sys::rbd_image_t, *mut sys::rbd_linked_image_spec_t, *mut usize) -> i32,
    ) -> Result<Vec<LinkedImage>> {
        // `call` gets room for `*n` entries; on -ERANGE librbd sets `*n` to
        // the count it needs and fills nothing.
        let (ret, mut specs) = fill_array(|p, n| call(self.raw(), p, n));
        self.cvt(ret, op)?;
        let out = specs.iter().map(LinkedImage::from_raw).collect();
        // SAFETY: the entries were filled and are freed once.
        unsafe { sys::rbd_linked_image_spec_list_cleanup(specs.as_mut_ptr(), specs.len()) };
        Ok(out)
    }
}
