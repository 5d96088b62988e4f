//! Image metadata: string key/value pairs stored with the image header.

use std::collections::BTreeMap;
use std::ffi::CString;

use rbd_sys as sys;

use crate::error::{Error, Result};
use crate::rbd::Image;
use crate::util::{cstr, sized_buffer, string_from_buf};

/// How many pairs one `rbd_metadata_list` round asks for.
const PAGE: u64 = 256;

impl Image {
    /// Reads one metadata value. Wraps `rbd_metadata_get`.
    pub fn metadata_get(&self, key: &str) -> Result<String> {
        let k = cstr(key, "rbd_metadata_get", "metadata key")?;
        let buf = sized_buffer(
            256,
            "rbd_metadata_get",
            &|| format!("{} key {key:?}", self.spec()),
            |p, len| {
                // SAFETY: `p` is writable for `*len` bytes; on -ERANGE librbd
                // sets `*len` to what it needs.
                unsafe { sys::rbd_metadata_get(self.raw(), k.as_ptr(), p, len) }
            },
        )?;
        Ok(string_from_buf(&buf))
    }

    /// Sets one metadata value. Wraps `rbd_metadata_set`.
    pub fn metadata_set(&self, key: &str, value: &str) -> Result<()> {
        let k = cstr(key, "rbd_metadata_set", "metadata key")?;
        let v = cstr(value, "rbd_metadata_set", "metadata value")?;
        // SAFETY: the image is open; both strings are NUL-terminated.
        let ret = unsafe { sys::rbd_metadata_set(self.raw(), k.as_ptr(), v.as_ptr()) };
        crate::error::cvt(ret, "rbd_metadata_set", || {
            format!("{} key {key:?}", self.spec())
        })?;
        Ok(())
    }

    /// Removes one metadata key. Wraps `rbd_metadata_remove`.
    pub fn metadata_remove(&self, key: &str) -> Result<()> {
        let k = cstr(key, "rbd_metadata_remove", "metadata key")?;
        // SAFETY: the image is open; `k` is NUL-terminated.
        let ret = unsafe { sys::rbd_metadata_remove(self.raw(), k.as_ptr()) };
        crate::error::cvt(ret, "rbd_metadata_remove", || {
            format!("{} key {key:?}", self.spec())
        })?;
        Ok(())
    }

    /// Sets one metadata value with the key and value as raw bytes (other
    /// clients may write keys that are not UTF-8). Neither may contain a NUL
    /// byte. Wraps `rbd_metadata_set`.
    pub fn metadata_set_bytes(&self, key: &[u8], value: &[u8]) -> Result<()> {
        let nul = |what: &str| {
            Error::invalid(
                "rbd_metadata_set",
                self.spec(),
                format!("metadata {what} contains a NUL byte"),
            )
        };
        let k = CString::new(key).map_err(|_| nul("key"))?;
        let v = CString::new(value).map_err(|_| nul("value"))?;
        // SAFETY: the image is open; both strings are NUL-terminated.
        let ret = unsafe { sys::rbd_metadata_set(self.raw(), k.as_ptr(), v.as_ptr()) };
        self.cvt(ret, "rbd_metadata_set")?;
        Ok(())
    }

    /// Lists all metadata pairs, paging through as many rounds as needed.
    /// Wraps `rbd_metadata_list`.
    ///
    /// Keys and values that are not UTF-8 are shown with U+FFFD in place of
    /// bad bytes; [`Image::metadata_list_bytes`] gives them exactly.
    pub fn metadata_list(&self) -> Result<BTreeMap<String, String>> {
        Ok(self
            .metadata_list_bytes()?
            .into_iter()
            .map(|(k, v)| {
                (
                    String::from_utf8_lossy(&k).into_owned(),
                    String::from_utf8_lossy(&v).into_owned(),
                )
            })
            .collect())
    }

    /// All metadata pairs as raw bytes. Each page starts after the exact last
    /// key of the one before, so every key is listed once, UTF-8 or not.
    /// Wraps `rbd_metadata_list`.
    pub fn metadata_list_bytes(&self) -> Result<BTreeMap<Vec<u8>, Vec<u8>>> {
        let mut out = BTreeMap::new();
        let mut start: Vec<u8> = Vec::new();
        loop {
            // Keys come NUL-separated, so none holds a NUL byte.
            let s = CString::new(start.clone()).map_err(|_| {
                Error::invalid(
                    "rbd_metadata_list",
                    self.spec(),
                    "metadata key contains a NUL byte",
                )
            })?;
            let mut keys_len = 4096usize;
            let mut vals_len = 4096usize;
            let (keys, vals) = loop {
                let mut keys = vec![0u8; keys_len];
                let mut vals = vec![0u8; vals_len];
                // SAFETY: both buffers are writable for the lengths passed; on
                // -ERANGE librbd sets both lengths to what it needs.
                let ret = unsafe {
                    sys::rbd_metadata_list(
                        self.raw(),
                        s.as_ptr(),
                        PAGE,
                        keys.as_mut_ptr().cast(),
                        &mut keys_len,
                        vals.as_mut_ptr().cast(),
                        &mut vals_len,
                    )
                };
                if ret == -libc::ERANGE && keys_len.max(vals_len) <= crate::util::MAX_BUFFER {
                    keys_len = keys_len.max(keys.len() * 2);
                    vals_len = vals_len.max(vals.len() * 2);
                    continue;
                }
                self.cvt(ret, "rbd_metadata_list")?;
                keys.truncate(keys_len.min(keys.len()));
                vals.truncate(vals_len.min(vals.len()));
                break (keys, vals);
            };
            let keys: Vec<&[u8]> = keys.split(|b| *b == 0).filter(|k| !k.is_empty()).collect();
            // Values may be empty strings, so split without dropping empties.
            let vals: Vec<&[u8]> = vals.split(|b| *b == 0).collect();
            let got = keys.len() as u64;
            for (i, k) in keys.into_iter().enumerate() {
                start = k.to_vec();
                out.insert(
                    k.to_vec(),
                    vals.get(i).map(|v| v.to_vec()).unwrap_or_default(),
                );
            }
            if got < PAGE {
                return Ok(out);
            }
        }
    }
}
