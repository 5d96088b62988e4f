//! Image metadata: string key/value pairs stored with the image header.

use std::collections::BTreeMap;

use rbd_sys as sys;

use crate::error::Result;
use crate::rbd::Image;
use crate::util::{cstr, sized_buffer, split_nul_list, string_from_buf};

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

    /// Lists all metadata pairs, paging through as many rounds as needed.
    /// Wraps `rbd_metadata_list`.
    pub fn metadata_list(&self) -> Result<BTreeMap<String, String>> {
        let mut out = BTreeMap::new();
        let mut start = String::new();
        loop {
            let s = cstr(&start, "rbd_metadata_list", "metadata key")?;
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
            let keys = split_nul_list(&keys);
            // Values may be empty strings, so split without dropping empties.
            let vals: Vec<String> = vals
                .split(|b| *b == 0)
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .collect();
            let got = keys.len() as u64;
            for (i, k) in keys.into_iter().enumerate() {
                start.clone_from(&k);
                out.insert(k, vals.get(i).cloned().unwrap_or_default());
            }
            if got < PAGE {
                return Ok(out);
            }
        }
    }
}
