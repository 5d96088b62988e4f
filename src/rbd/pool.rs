//! Pool-level RBD set-up: initialising a pool for RBD and managing rados
//! namespaces.

use rbd_sys as sys;

use crate::error::{cvt, Result};
use crate::rados::IoCtx;
use crate::util::{cstr, sized_buffer, split_nul_list};

/// Prepares a pool for RBD (tags it with the `rbd` application and creates
/// the directory objects). Wraps `rbd_pool_init`.
pub fn pool_init(ioctx: &IoCtx, force: bool) -> Result<()> {
    // SAFETY: the ioctx is live.
    let ret = unsafe { sys::rbd_pool_init(ioctx.raw(), force) };
    cvt(ret, "rbd_pool_init", || ioctx.pool_name().to_owned())?;
    Ok(())
}

/// Creates an RBD namespace in the ioctx's pool. Wraps `rbd_namespace_create`.
pub fn namespace_create(ioctx: &IoCtx, name: &str) -> Result<()> {
    let n = cstr(name, "rbd_namespace_create", "namespace")?;
    // SAFETY: the ioctx is live; `n` is NUL-terminated.
    let ret = unsafe { sys::rbd_namespace_create(ioctx.raw(), n.as_ptr()) };
    cvt(ret, "rbd_namespace_create", || {
        format!("{}/{name}", ioctx.pool_name())
    })?;
    Ok(())
}

/// Removes an empty RBD namespace. Wraps `rbd_namespace_remove`.
pub fn namespace_remove(ioctx: &IoCtx, name: &str) -> Result<()> {
    let n = cstr(name, "rbd_namespace_remove", "namespace")?;
    // SAFETY: the ioctx is live; `n` is NUL-terminated.
    let ret = unsafe { sys::rbd_namespace_remove(ioctx.raw(), n.as_ptr()) };
    cvt(ret, "rbd_namespace_remove", || {
        format!("{}/{name}", ioctx.pool_name())
    })?;
    Ok(())
}

/// True when the RBD namespace exists. Wraps `rbd_namespace_exists`.
pub fn namespace_exists(ioctx: &IoCtx, name: &str) -> Result<bool> {
    let n = cstr(name, "rbd_namespace_exists", "namespace")?;
    let mut exists = false;
    // SAFETY: the ioctx is live; `n` is NUL-terminated; valid out-pointer.
    let ret = unsafe { sys::rbd_namespace_exists(ioctx.raw(), n.as_ptr(), &mut exists) };
    cvt(ret, "rbd_namespace_exists", || {
        format!("{}/{name}", ioctx.pool_name())
    })?;
    Ok(exists)
}

/// Lists the RBD namespaces of the ioctx's pool. Wraps `rbd_namespace_list`.
pub fn namespace_list(ioctx: &IoCtx) -> Result<Vec<String>> {
    let buf = sized_buffer(
        1024,
        "rbd_namespace_list",
        &|| ioctx.pool_name().to_owned(),
        |p, len| {
            // SAFETY: `p` is writable for `*len` bytes; librbd sets `*len` to the
            // size used (or needed, with -ERANGE).
            unsafe { sys::rbd_namespace_list(ioctx.raw(), p, len) }
        },
    )?;
    Ok(split_nul_list(&buf))
}

/// Reads one pool-level RBD metadata value (pool-wide image defaults such as
/// `conf_rbd_qos_iops_limit`). Wraps `rbd_pool_metadata_get`.
pub fn pool_metadata_get(ioctx: &IoCtx, key: &str) -> Result<String> {
    let k = cstr(key, "rbd_pool_metadata_get", "metadata key")?;
    let buf = sized_buffer(
        256,
        "rbd_pool_metadata_get",
        &|| format!("{} key {key:?}", ioctx.spec()),
        |p, len| {
            // SAFETY: `p` is writable for `*len` bytes; on -ERANGE librbd sets
            // `*len` to what it needs.
            unsafe { sys::rbd_pool_metadata_get(ioctx.raw(), k.as_ptr(), p, len) }
        },
    )?;
    Ok(crate::util::string_from_buf(&buf))
}

/// Sets one pool-level RBD metadata value. Wraps `rbd_pool_metadata_set`.
pub fn pool_metadata_set(ioctx: &IoCtx, key: &str, value: &str) -> Result<()> {
    let k = cstr(key, "rbd_pool_metadata_set", "metadata key")?;
    let v = cstr(value, "rbd_pool_metadata_set", "metadata value")?;
    // SAFETY: the ioctx is live; both strings are NUL-terminated.
    let ret = unsafe { sys::rbd_pool_metadata_set(ioctx.raw(), k.as_ptr(), v.as_ptr()) };
    cvt(ret, "rbd_pool_metadata_set", || {
        format!("{} key {key:?}", ioctx.spec())
    })?;
    Ok(())
}

/// Removes one pool-level RBD metadata key. Wraps `rbd_pool_metadata_remove`.
pub fn pool_metadata_remove(ioctx: &IoCtx, key: &str) -> Result<()> {
    let k = cstr(key, "rbd_pool_metadata_remove", "metadata key")?;
    // SAFETY: the ioctx is live; `k` is NUL-terminated.
    let ret = unsafe { sys::rbd_pool_metadata_remove(ioctx.raw(), k.as_ptr()) };
    cvt(ret, "rbd_pool_metadata_remove", || {
        format!("{} key {key:?}", ioctx.spec())
    })?;
    Ok(())
}

/// RBD usage figures of a pool (or namespace), from `rbd_pool_stats_get`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RbdPoolStats {
    /// Number of images.
    pub images: u64,
    /// Bytes provisioned by the images (their sizes, summed).
    pub image_provisioned_bytes: u64,
    /// Number of image snapshots.
    pub image_snapshots: u64,
    /// Number of images in the trash.
    pub trash_images: u64,
}

/// RBD usage of the ioctx's pool and namespace. Wraps `rbd_pool_stats_create`,
/// `rbd_pool_stats_option_add_uint64`, `rbd_pool_stats_get` and
/// `rbd_pool_stats_destroy`.
pub fn pool_stats(ioctx: &IoCtx) -> Result<RbdPoolStats> {
    /// Owns the stats object; destroyed once on every path.
    struct Stats(sys::rbd_pool_stats_t);
    impl Drop for Stats {
        fn drop(&mut self) {
            // SAFETY: created by rbd_pool_stats_create, destroyed only here.
            unsafe { sys::rbd_pool_stats_destroy(self.0) };
        }
    }
    let mut out = RbdPoolStats::default();
    let mut raw: sys::rbd_pool_stats_t = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the call cannot fail.
    unsafe { sys::rbd_pool_stats_create(&mut raw) };
    let stats = Stats(raw);
    for (opt, slot) in [
        (sys::RBD_POOL_STAT_OPTION_IMAGES, &mut out.images),
        (
            sys::RBD_POOL_STAT_OPTION_IMAGE_PROVISIONED_BYTES,
            &mut out.image_provisioned_bytes,
        ),
        (
            sys::RBD_POOL_STAT_OPTION_IMAGE_SNAPSHOTS,
            &mut out.image_snapshots,
        ),
        (
            sys::RBD_POOL_STAT_OPTION_TRASH_IMAGES,
            &mut out.trash_images,
        ),
    ] {
        // SAFETY: `slot` points into `out`, which outlives the get call below;
        // librbd writes the value there during rbd_pool_stats_get.
        let ret = unsafe { sys::rbd_pool_stats_option_add_uint64(stats.0, opt as i32, slot) };
        cvt(ret, "rbd_pool_stats_option_add_uint64", || ioctx.spec())?;
    }
    // SAFETY: the ioctx is live; every registered slot is still valid.
    let ret = unsafe { sys::rbd_pool_stats_get(ioctx.raw(), stats.0) };
    cvt(ret, "rbd_pool_stats_get", || ioctx.spec())?;
    drop(stats);
    Ok(out)
}
