//! Pool-level RBD set-up: initialising a pool for RBD and managing rados
//! namespaces.

use rbd_sys as sys;

use crate::error::{cvt, Result};
use crate::rados::IoCtx;
use crate::util::{cstr, split_nul_list, with_growing_buffer};

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
    let mut used = 0usize;
    let buf = with_growing_buffer(
        1024,
        "rbd_namespace_list",
        &|| ioctx.pool_name().to_owned(),
        |buf| {
            let mut len = buf.len();
            // SAFETY: `buf` is writable for `len` bytes; librbd sets `len` to the
            // size used (or needed, with -ERANGE).
            let ret =
                unsafe { sys::rbd_namespace_list(ioctx.raw(), buf.as_mut_ptr().cast(), &mut len) };
            used = len;
            (i64::from(ret), len)
        },
    )?;
    Ok(split_nul_list(&buf[..used.min(buf.len())]))
}
