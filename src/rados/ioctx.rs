//! I/O contexts ([`IoCtx`]): a pool plus a rados namespace, and the object
//! calls made through them.

use std::fmt;
use std::ptr;
use std::sync::Arc;

use rbd_sys as sys;

use crate::error::{cvt, Error, Result};
use crate::rados::cluster::{Cluster, ClusterHandle};
use crate::util::cstr;

/// The owned `rados_ioctx_t`, destroyed exactly once, before the cluster
/// handle it holds an `Arc` to.
pub(crate) struct IoCtxHandle {
    raw: sys::rados_ioctx_t,
    pool: String,
    namespace: String,
    // Declared last so it drops after `raw` is destroyed in `Drop::drop`.
    cluster: Arc<ClusterHandle>,
}

// SAFETY: librados.h on rados_ioctx_t: "Changing any of these settings is not
// thread-safe" (pool, snap context, locator, namespace). This handle's
// namespace is set once, in `IoCtx::create`, before it is shared, and no
// setter is ever exposed, so the remaining calls (object I/O, omap, lookups)
// are the thread-safe kind and the handle may move between threads.
unsafe impl Send for IoCtxHandle {}
// SAFETY: as above: no method changes the ioctx's settings after creation, so
// shared references from several threads only make thread-safe librados calls.
unsafe impl Sync for IoCtxHandle {}

impl Drop for IoCtxHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from rados_ioctx_create and is destroyed only
        // here; images opened from it hold an Arc to this handle, so none is
        // left, and `cluster` is still alive until after this body returns.
        unsafe { sys::rados_ioctx_destroy(self.raw) };
    }
}

/// An I/O context: one pool and one rados namespace (`rados_ioctx_t`).
///
/// Cheap to clone (clones share the handle). The namespace is fixed when the
/// context is made; use [`IoCtx::with_namespace`] for another one. Because
/// nothing can change its settings after creation, it is `Send + Sync`.
/// Images opened from it keep it (and the cluster) alive.
#[derive(Clone)]
pub struct IoCtx {
    pub(crate) inner: Arc<IoCtxHandle>,
}

impl fmt::Debug for IoCtx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoCtx")
            .field("pool", &self.inner.pool)
            .field("namespace", &self.inner.namespace)
            .finish()
    }
}

/// Usage figures of one pool, from `rados_ioctx_pool_stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Bytes stored.
    pub num_bytes: u64,
    /// Number of objects.
    pub num_objects: u64,
    /// Number of object clones (snapshots).
    pub num_object_clones: u64,
    /// Objects read.
    pub num_rd: u64,
    /// KiB read.
    pub num_rd_kb: u64,
    /// Objects written.
    pub num_wr: u64,
    /// KiB written.
    pub num_wr_kb: u64,
}

/// Size and modification time of an object, from `rados_stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectStat {
    /// Size in bytes.
    pub size: u64,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
}

impl IoCtx {
    pub(crate) fn create(cluster: &Cluster, pool: &str, namespace: &str) -> Result<IoCtx> {
        let p = cstr(pool, "rados_ioctx_create", "pool name")?;
        let ns = cstr(namespace, "rados_ioctx_set_namespace", "namespace")?;
        let mut raw: sys::rados_ioctx_t = ptr::null_mut();
        // SAFETY: the cluster handle is connected; `p` is NUL-terminated;
        // `raw` is a valid out-pointer.
        let ret = unsafe { sys::rados_ioctx_create(cluster.raw(), p.as_ptr(), &mut raw) };
        cvt(ret, "rados_ioctx_create", || pool.to_owned())?;
        // SAFETY: `raw` is a fresh ioctx that no other thread can see yet, so
        // changing its namespace here is the single-threaded case the header
        // requires; librados copies the string.
        unsafe { sys::rados_ioctx_set_namespace(raw, ns.as_ptr()) };
        Ok(IoCtx {
            inner: Arc::new(IoCtxHandle {
                raw,
                pool: pool.to_owned(),
                namespace: namespace.to_owned(),
                cluster: Arc::clone(&cluster.inner),
            }),
        })
    }

    /// A new context on the same pool in another namespace.
    pub fn with_namespace(&self, namespace: &str) -> Result<IoCtx> {
        IoCtx::create(&self.cluster(), &self.inner.pool, namespace)
    }

    /// The cluster this context belongs to.
    pub fn cluster(&self) -> Cluster {
        Cluster {
            inner: Arc::clone(&self.inner.cluster),
        }
    }

    /// The pool name.
    pub fn pool_name(&self) -> &str {
        &self.inner.pool
    }

    /// The rados namespace (empty for the default one).
    pub fn namespace(&self) -> &str {
        &self.inner.namespace
    }

    /// The pool id. Wraps `rados_ioctx_get_id`.
    pub fn pool_id(&self) -> i64 {
        // SAFETY: the handle is live for as long as `self`.
        unsafe { sys::rados_ioctx_get_id(self.raw()) }
    }

    /// `pool` or `pool/namespace`, for messages.
    pub fn spec(&self) -> String {
        if self.inner.namespace.is_empty() {
            self.inner.pool.clone()
        } else {
            format!("{}/{}", self.inner.pool, self.inner.namespace)
        }
    }

    pub(crate) fn object_spec(&self, name: &str) -> String {
        format!("{}/{}", self.spec(), name)
    }

    pub(crate) fn raw(&self) -> sys::rados_ioctx_t {
        self.inner.raw
    }

    /// Usage of the pool. Wraps `rados_ioctx_pool_stat`.
    pub fn pool_stats(&self) -> Result<PoolStats> {
        let mut st = sys::rados_pool_stat_t::default();
        // SAFETY: `st` is a valid out-struct of the header's type.
        let ret = unsafe { sys::rados_ioctx_pool_stat(self.raw(), &mut st) };
        cvt(ret, "rados_ioctx_pool_stat", || self.inner.pool.clone())?;
        Ok(PoolStats {
            num_bytes: st.num_bytes,
            num_objects: st.num_objects,
            num_object_clones: st.num_object_clones,
            num_rd: st.num_rd,
            num_rd_kb: st.num_rd_kb,
            num_wr: st.num_wr,
            num_wr_kb: st.num_wr_kb,
        })
    }

    /// Tags the pool with an application (`rbd`, `rgw`, `cephfs`, ...).
    /// Wraps `rados_application_enable`.
    pub fn application_enable(&self, app: &str, force: bool) -> Result<()> {
        let a = cstr(app, "rados_application_enable", "application name")?;
        // SAFETY: `a` is NUL-terminated; the handle is live.
        let ret =
            unsafe { sys::rados_application_enable(self.raw(), a.as_ptr(), i32::from(force)) };
        cvt(ret, "rados_application_enable", || self.inner.pool.clone())?;
        Ok(())
    }

    /// Writes a whole object, replacing it. Wraps `rados_write_full`.
    pub fn write_full(&self, oid: &str, data: &[u8]) -> Result<()> {
        let o = cstr(oid, "rados_write_full", "object name")?;
        // SAFETY: `data` is readable for its length; `o` is NUL-terminated.
        let ret = unsafe {
            sys::rados_write_full(self.raw(), o.as_ptr(), data.as_ptr().cast(), data.len())
        };
        cvt(ret, "rados_write_full", || self.object_spec(oid))?;
        Ok(())
    }

    /// Writes `data` at `offset`, creating the object if needed. Wraps `rados_write`.
    pub fn write(&self, oid: &str, data: &[u8], offset: u64) -> Result<()> {
        let o = cstr(oid, "rados_write", "object name")?;
        // SAFETY: `data` is readable for its length; `o` is NUL-terminated.
        let ret = unsafe {
            sys::rados_write(
                self.raw(),
                o.as_ptr(),
                data.as_ptr().cast(),
                data.len(),
                offset,
            )
        };
        cvt(ret, "rados_write", || self.object_spec(oid))?;
        Ok(())
    }

    /// Reads up to `len` bytes at `offset`. Wraps `rados_read`.
    pub fn read(&self, oid: &str, len: usize, offset: u64) -> Result<Vec<u8>> {
        let o = cstr(oid, "rados_read", "object name")?;
        let mut buf = vec![0u8; len];
        // SAFETY: `buf` is writable for `len` bytes; librados returns how many
        // it wrote, never more than `len`.
        let ret = unsafe {
            sys::rados_read(self.raw(), o.as_ptr(), buf.as_mut_ptr().cast(), len, offset)
        };
        let n = cvt(ret, "rados_read", || self.object_spec(oid))?;
        buf.truncate((n as usize).min(len));
        Ok(buf)
    }

    /// Reads a whole object. Wraps `rados_stat` and `rados_read`.
    pub fn read_full(&self, oid: &str) -> Result<Vec<u8>> {
        let st = self.stat(oid)?;
        let len = usize::try_from(st.size)
            .map_err(|_| Error::invalid("rados_read", self.object_spec(oid), "object too large"))?;
        self.read(oid, len, 0)
    }

    /// Size and mtime of an object. Wraps `rados_stat`.
    pub fn stat(&self, oid: &str) -> Result<ObjectStat> {
        let o = cstr(oid, "rados_stat", "object name")?;
        let mut size = 0u64;
        let mut mtime: libc::time_t = 0;
        // SAFETY: out-pointers are valid; `o` is NUL-terminated.
        let ret = unsafe { sys::rados_stat(self.raw(), o.as_ptr(), &mut size, &mut mtime) };
        cvt(ret, "rados_stat", || self.object_spec(oid))?;
        Ok(ObjectStat { size, mtime })
    }

    /// Removes an object. Wraps `rados_remove`.
    pub fn remove(&self, oid: &str) -> Result<()> {
        let o = cstr(oid, "rados_remove", "object name")?;
        // SAFETY: `o` is NUL-terminated; the handle is live.
        let ret = unsafe { sys::rados_remove(self.raw(), o.as_ptr()) };
        cvt(ret, "rados_remove", || self.object_spec(oid))?;
        Ok(())
    }
}

/// An owned `rados_list_ctx_t`, closed exactly once.
struct ListCtx(sys::rados_list_ctx_t);

impl Drop for ListCtx {
    fn drop(&mut self) {
        // SAFETY: opened by rados_nobjects_list_open, closed only here.
        unsafe { sys::rados_nobjects_list_close(self.0) };
    }
}

impl IoCtx {
    /// Names of the objects in this pool and namespace. Wraps
    /// `rados_nobjects_list_open`, `rados_nobjects_list_next2` and
    /// `rados_nobjects_list_close`. Walks the whole pool: use on small pools.
    pub fn list_objects(&self) -> Result<Vec<String>> {
        let mut raw: sys::rados_list_ctx_t = ptr::null_mut();
        // SAFETY: the ioctx is live; `raw` is a valid out-pointer.
        let ret = unsafe { sys::rados_nobjects_list_open(self.raw(), &mut raw) };
        cvt(ret, "rados_nobjects_list_open", || self.spec())?;
        let ctx = ListCtx(raw);
        let mut out = Vec::new();
        loop {
            let mut entry: *const std::os::raw::c_char = ptr::null();
            let mut entry_len = 0usize;
            // SAFETY: the list is open; key and namespace outputs are not
            // wanted (null). `entry` stays valid until the next call.
            let ret = unsafe {
                sys::rados_nobjects_list_next2(
                    ctx.0,
                    &mut entry,
                    ptr::null_mut(),
                    ptr::null_mut(),
                    &mut entry_len,
                    ptr::null_mut(),
                    ptr::null_mut(),
                )
            };
            if ret == -libc::ENOENT {
                return Ok(out);
            }
            cvt(ret, "rados_nobjects_list_next2", || self.spec())?;
            // SAFETY: librados gave `entry_len` bytes at `entry`, valid until
            // the next call; we copy them now.
            let name = unsafe { std::slice::from_raw_parts(entry as *const u8, entry_len) };
            out.push(String::from_utf8_lossy(name).into_owned());
        }
    }

    /// Reads an extended attribute of an object. Wraps `rados_getxattr`.
    pub fn xattr_get(&self, oid: &str, name: &str) -> Result<Vec<u8>> {
        let o = cstr(oid, "rados_getxattr", "object name")?;
        let n = cstr(name, "rados_getxattr", "xattr name")?;
        let mut size = 256usize;
        loop {
            let mut buf = vec![0u8; size];
            // SAFETY: `buf` is writable for `size` bytes; librados returns the
            // length (or -ERANGE if the value is larger).
            let ret = unsafe {
                sys::rados_getxattr(
                    self.raw(),
                    o.as_ptr(),
                    n.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    size,
                )
            };
            if ret == -libc::ERANGE && size < crate::util::MAX_BUFFER {
                size *= 4;
                continue;
            }
            let len = cvt(ret, "rados_getxattr", || {
                format!("{} xattr {name:?}", self.object_spec(oid))
            })? as usize;
            buf.truncate(len.min(size));
            return Ok(buf);
        }
    }

    /// Sets an extended attribute of an object. Wraps `rados_setxattr`.
    pub fn xattr_set(&self, oid: &str, name: &str, value: &[u8]) -> Result<()> {
        let o = cstr(oid, "rados_setxattr", "object name")?;
        let n = cstr(name, "rados_setxattr", "xattr name")?;
        // SAFETY: `value` is readable for its length; names are NUL-terminated.
        let ret = unsafe {
            sys::rados_setxattr(
                self.raw(),
                o.as_ptr(),
                n.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
            )
        };
        cvt(ret, "rados_setxattr", || {
            format!("{} xattr {name:?}", self.object_spec(oid))
        })?;
        Ok(())
    }

    /// Removes an extended attribute of an object. Wraps `rados_rmxattr`.
    pub fn xattr_remove(&self, oid: &str, name: &str) -> Result<()> {
        let o = cstr(oid, "rados_rmxattr", "object name")?;
        let n = cstr(name, "rados_rmxattr", "xattr name")?;
        // SAFETY: names are NUL-terminated; the ioctx is live.
        let ret = unsafe { sys::rados_rmxattr(self.raw(), o.as_ptr(), n.as_ptr()) };
        cvt(ret, "rados_rmxattr", || {
            format!("{} xattr {name:?}", self.object_spec(oid))
        })?;
        Ok(())
    }
}
