//! Object maps (omap): the key/value store on each rados object, used for
//! bookkeeping that must survive a crash.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::raw::c_char;
use std::ptr;

use rbd_sys as sys;

use crate::error::{cvt, Error, Result};
use crate::rados::IoCtx;
use crate::util::cstr;

/// How many pairs one `rados_read_op_omap_get_vals2` round asks for.
const OMAP_PAGE: u64 = 512;

/// An owned `rados_write_op_t`, released exactly once.
struct WriteOp(sys::rados_write_op_t);

impl WriteOp {
    fn new() -> WriteOp {
        // SAFETY: rados_create_write_op has no preconditions; it returns a
        // new op that we own.
        WriteOp(unsafe { sys::rados_create_write_op() })
    }
}

impl Drop for WriteOp {
    fn drop(&mut self) {
        // SAFETY: the op came from rados_create_write_op and is released once.
        unsafe { sys::rados_release_write_op(self.0) };
    }
}

/// An owned `rados_read_op_t`, released exactly once.
struct ReadOp(sys::rados_read_op_t);

impl ReadOp {
    fn new() -> ReadOp {
        // SAFETY: rados_create_read_op has no preconditions.
        ReadOp(unsafe { sys::rados_create_read_op() })
    }
}

impl Drop for ReadOp {
    fn drop(&mut self) {
        // SAFETY: the op came from rados_create_read_op and is released once.
        unsafe { sys::rados_release_read_op(self.0) };
    }
}

/// An owned `rados_omap_iter_t`, ended exactly once.
struct OmapIter(sys::rados_omap_iter_t);

impl OmapIter {
    /// Copies out every pair the iterator holds; returns the last key, raw.
    fn drain(
        &self,
        into: &mut BTreeMap<Vec<u8>, Vec<u8>>,
        op: &'static str,
        object: &str,
    ) -> Result<Option<Vec<u8>>> {
        let mut last = None;
        loop {
            let mut key: *mut c_char = ptr::null_mut();
            let mut val: *mut c_char = ptr::null_mut();
            let mut key_len = 0usize;
            let mut val_len = 0usize;
            // SAFETY: the iterator is live; the out-pointers are valid. The
            // returned buffers stay valid until the next call or the end.
            let ret = unsafe {
                sys::rados_omap_get_next2(self.0, &mut key, &mut val, &mut key_len, &mut val_len)
            };
            cvt(ret, op, || object.to_owned())?;
            if key.is_null() {
                return Ok(last);
            }
            // SAFETY: librados gave `key_len`/`val_len` bytes at these pointers,
            // valid until the next rados_omap_get_next2; we copy them now.
            let (k, v) = unsafe {
                let k = std::slice::from_raw_parts(key as *const u8, key_len);
                let v = if val.is_null() {
                    &[][..]
                } else {
                    std::slice::from_raw_parts(val as *const u8, val_len)
                };
                (k.to_vec(), v.to_vec())
            };
            last = Some(k.clone());
            into.insert(k, v);
        }
    }
}

impl Drop for OmapIter {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the iterator came from a completed read op and is ended once.
            unsafe { sys::rados_omap_get_end(self.0) };
        }
    }
}

impl IoCtx {
    /// Sets omap keys on an object, creating it if needed, in one atomic
    /// write op. Wraps `rados_write_op_omap_set2` and `rados_write_op_operate2`.
    pub fn omap_set<K, V>(&self, oid: &str, pairs: &[(K, V)]) -> Result<()>
    where
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        let raw: Vec<(&[u8], &[u8])> = pairs
            .iter()
            .map(|(k, v)| (k.as_ref().as_bytes(), v.as_ref()))
            .collect();
        self.omap_set_bytes(oid, &raw)
    }

    /// [`IoCtx::omap_set`] with keys as raw bytes (omap keys need not be
    /// UTF-8). Wraps `rados_write_op_omap_set2`.
    pub fn omap_set_bytes<K, V>(&self, oid: &str, pairs: &[(K, V)]) -> Result<()>
    where
        K: AsRef<[u8]>,
        V: AsRef<[u8]>,
    {
        let o = cstr(oid, "rados_write_op_omap_set2", "object name")?;
        let keys: Vec<&[u8]> = pairs.iter().map(|(k, _)| k.as_ref()).collect();
        let key_ptrs: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr().cast()).collect();
        let key_lens: Vec<usize> = keys.iter().map(|k| k.len()).collect();
        let val_ptrs: Vec<*const c_char> = pairs
            .iter()
            .map(|(_, v)| v.as_ref().as_ptr().cast())
            .collect();
        let val_lens: Vec<usize> = pairs.iter().map(|(_, v)| v.as_ref().len()).collect();
        let op = WriteOp::new();
        // SAFETY: every pointer array has `pairs.len()` entries whose buffers
        // have the given lengths and outlive the operate call below.
        unsafe {
            sys::rados_write_op_create(op.0, sys::LIBRADOS_CREATE_IDEMPOTENT as i32, ptr::null());
            sys::rados_write_op_omap_set2(
                op.0,
                key_ptrs.as_ptr(),
                val_ptrs.as_ptr(),
                key_lens.as_ptr(),
                val_lens.as_ptr(),
                pairs.len(),
            );
        }
        // SAFETY: the op is fully built; `o` is NUL-terminated; a null mtime
        // asks librados to use the current time.
        let ret = unsafe {
            sys::rados_write_op_operate2(op.0, self.raw(), o.as_ptr(), ptr::null_mut(), 0)
        };
        cvt(ret, "rados_write_op_omap_set2", || self.object_spec(oid))?;
        Ok(())
    }

    /// Removes omap keys from an object (absent keys are ignored). Wraps
    /// `rados_write_op_omap_rm_keys2`.
    pub fn omap_remove<K: AsRef<str>>(&self, oid: &str, keys: &[K]) -> Result<()> {
        let o = cstr(oid, "rados_write_op_omap_rm_keys2", "object name")?;
        let key_ptrs: Vec<*const c_char> =
            keys.iter().map(|k| k.as_ref().as_ptr().cast()).collect();
        let key_lens: Vec<usize> = keys.iter().map(|k| k.as_ref().len()).collect();
        let op = WriteOp::new();
        // SAFETY: both arrays have `keys.len()` entries whose buffers outlive
        // the operate call.
        unsafe {
            sys::rados_write_op_omap_rm_keys2(
                op.0,
                key_ptrs.as_ptr(),
                key_lens.as_ptr(),
                keys.len(),
            );
        }
        // SAFETY: as in `omap_set`.
        let ret = unsafe {
            sys::rados_write_op_operate2(op.0, self.raw(), o.as_ptr(), ptr::null_mut(), 0)
        };
        cvt(ret, "rados_write_op_omap_rm_keys2", || {
            self.object_spec(oid)
        })?;
        Ok(())
    }

    /// Removes every omap key of an object. Wraps `rados_write_op_omap_clear`.
    pub fn omap_clear(&self, oid: &str) -> Result<()> {
        let o = cstr(oid, "rados_write_op_omap_clear", "object name")?;
        let op = WriteOp::new();
        // SAFETY: the op is live; `o` is NUL-terminated.
        let ret = unsafe {
            sys::rados_write_op_omap_clear(op.0);
            sys::rados_write_op_operate2(op.0, self.raw(), o.as_ptr(), ptr::null_mut(), 0)
        };
        cvt(ret, "rados_write_op_omap_clear", || self.object_spec(oid))?;
        Ok(())
    }

    /// Reads the values of the given omap keys; absent keys are left out of
    /// the map. Wraps `rados_read_op_omap_get_vals_by_keys2`.
    pub fn omap_get<K: AsRef<str>>(
        &self,
        oid: &str,
        keys: &[K],
    ) -> Result<BTreeMap<String, Vec<u8>>> {
        let o = cstr(oid, "rados_read_op_omap_get_vals_by_keys2", "object name")?;
        let key_ptrs: Vec<*const c_char> =
            keys.iter().map(|k| k.as_ref().as_ptr().cast()).collect();
        let key_lens: Vec<usize> = keys.iter().map(|k| k.as_ref().len()).collect();
        let op = ReadOp::new();
        let mut iter = OmapIter(ptr::null_mut());
        let mut prval = 0i32;
        // SAFETY: the key arrays have `keys.len()` entries that outlive the
        // operate call; `iter.0` and `prval` are written during operate.
        let ret = unsafe {
            sys::rados_read_op_omap_get_vals_by_keys2(
                op.0,
                key_ptrs.as_ptr(),
                keys.len(),
                key_lens.as_ptr(),
                &mut iter.0,
                &mut prval,
            );
            sys::rados_read_op_operate(op.0, self.raw(), o.as_ptr(), 0)
        };
        let object = self.object_spec(oid);
        cvt(ret, "rados_read_op_omap_get_vals_by_keys2", || {
            object.clone()
        })?;
        cvt(prval, "rados_read_op_omap_get_vals_by_keys2", || {
            object.clone()
        })?;
        let mut out = BTreeMap::new();
        iter.drain(&mut out, "rados_omap_get_next2", &object)?;
        Ok(lossy_keys(out))
    }

    /// Lists every omap pair of an object whose key starts with `prefix`
    /// (all pairs for `""`), paging through as many rounds as needed. Wraps
    /// `rados_read_op_omap_get_vals2`.
    ///
    /// Keys that are not UTF-8 (written by other clients) are shown with
    /// U+FFFD in place of bad bytes; use [`IoCtx::omap_list_bytes`] to get
    /// them exactly.
    pub fn omap_list(&self, oid: &str, prefix: &str) -> Result<BTreeMap<String, Vec<u8>>> {
        Ok(lossy_keys(self.omap_list_bytes(oid, prefix.as_bytes())?))
    }

    /// [`IoCtx::omap_list`] with keys as raw bytes: each page starts after
    /// the exact last key of the one before, so every key is listed once,
    /// UTF-8 or not. Wraps `rados_read_op_omap_get_vals2`.
    pub fn omap_list_bytes(&self, oid: &str, prefix: &[u8]) -> Result<BTreeMap<Vec<u8>, Vec<u8>>> {
        let o = cstr(oid, "rados_read_op_omap_get_vals2", "object name")?;
        let object = self.object_spec(oid);
        let pfx = CString::new(prefix).map_err(|_| {
            Error::invalid(
                "rados_read_op_omap_get_vals2",
                object.clone(),
                "key prefix contains a NUL byte",
            )
        })?;
        let mut out = BTreeMap::new();
        let mut start_after = Vec::new();
        loop {
            let start = CString::new(start_after).map_err(|_| {
                Error::invalid(
                    "rados_read_op_omap_get_vals2",
                    object.clone(),
                    "an omap key contains a NUL byte, so listing cannot continue after it",
                )
            })?;
            let op = ReadOp::new();
            let mut iter = OmapIter(ptr::null_mut());
            let mut more: u8 = 0;
            let mut prval = 0i32;
            // SAFETY: strings are NUL-terminated and outlive the operate call;
            // the out-pointers are written during operate.
            let ret = unsafe {
                sys::rados_read_op_omap_get_vals2(
                    op.0,
                    start.as_ptr(),
                    pfx.as_ptr(),
                    OMAP_PAGE,
                    &mut iter.0,
                    &mut more,
                    &mut prval,
                );
                sys::rados_read_op_operate(op.0, self.raw(), o.as_ptr(), 0)
            };
            cvt(ret, "rados_read_op_omap_get_vals2", || object.clone())?;
            cvt(prval, "rados_read_op_omap_get_vals2", || object.clone())?;
            let last = iter.drain(&mut out, "rados_omap_get_next2", &object)?;
            match last {
                Some(k) if more != 0 => start_after = k,
                _ => return Ok(out),
            }
        }
    }
}

/// Keys as text, bad UTF-8 replaced (distinct raw keys may then collide).
fn lossy_keys(raw: BTreeMap<Vec<u8>, Vec<u8>>) -> BTreeMap<String, Vec<u8>> {
    raw.into_iter()
        .map(|(k, v)| (String::from_utf8_lossy(&k).into_owned(), v))
        .collect()
}

/// Checks that an omap value is UTF-8, for callers that store text.
pub fn omap_text(value: &[u8], key: &str) -> Result<String> {
    String::from_utf8(value.to_vec())
        .map_err(|_| Error::invalid("omap value", key, "value is not UTF-8"))
}
