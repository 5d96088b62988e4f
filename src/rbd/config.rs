//! librbd configuration as it applies to a pool or an image, with where each
//! value comes from.

use rbd_sys as sys;

use crate::error::{cvt, Result};
use crate::rados::IoCtx;
use crate::rbd::Image;
use crate::util::from_cstr;

/// Where a config value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigSource {
    /// The client's config (ceph.conf, defaults).
    Config,
    /// Pool metadata.
    Pool,
    /// Image metadata.
    Image,
}

/// One librbd option and its effective value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigOption {
    /// The option name, such as `rbd_cache`.
    pub name: String,
    /// The effective value.
    pub value: String,
    /// Where the value comes from.
    pub source: ConfigSource,
}

fn collect(entries: &[sys::rbd_config_option_t]) -> Vec<ConfigOption> {
    entries
        .iter()
        .map(|e| ConfigOption {
            // SAFETY: librbd filled these strings; the caller cleans them after.
            name: unsafe { from_cstr(e.name) },
            // SAFETY: as above.
            value: unsafe { from_cstr(e.value) },
            source: match e.source {
                sys::RBD_CONFIG_SOURCE_POOL => ConfigSource::Pool,
                sys::RBD_CONFIG_SOURCE_IMAGE => ConfigSource::Image,
                _ => ConfigSource::Config,
            },
        })
        .collect()
}

/// The librbd options as they apply to images in this pool. Wraps
/// `rbd_config_pool_list`.
pub fn config_pool_list(ioctx: &IoCtx) -> Result<Vec<ConfigOption>> {
    let mut max: i32 = 256;
    loop {
        let mut entries = vec![sys::rbd_config_option_t::default(); max as usize];
        let mut n = max;
        // SAFETY: `entries` has room for `n`; on -ERANGE librbd sets `n` to
        // the count it needs.
        let ret = unsafe { sys::rbd_config_pool_list(ioctx.raw(), entries.as_mut_ptr(), &mut n) };
        if ret == -libc::ERANGE && n > max && n <= 1 << 16 {
            max = n;
            continue;
        }
        cvt(ret, "rbd_config_pool_list", || ioctx.spec())?;
        let n = n.clamp(0, max);
        let out = collect(&entries[..n as usize]);
        // SAFETY: the first `n` entries were filled and are freed once.
        unsafe { sys::rbd_config_pool_list_cleanup(entries.as_mut_ptr(), n) };
        return Ok(out);
    }
}

impl Image {
    /// The librbd options as they apply to this image. Wraps
    /// `rbd_config_image_list`.
    pub fn config_list(&self) -> Result<Vec<ConfigOption>> {
        let mut max: i32 = 256;
        loop {
            let mut entries = vec![sys::rbd_config_option_t::default(); max as usize];
            let mut n = max;
            // SAFETY: `entries` has room for `n`; on -ERANGE librbd sets `n`
            // to the count it needs.
            let ret =
                unsafe { sys::rbd_config_image_list(self.raw(), entries.as_mut_ptr(), &mut n) };
            if ret == -libc::ERANGE && n > max && n <= 1 << 16 {
                max = n;
                continue;
            }
            self.cvt(ret, "rbd_config_image_list")?;
            let n = n.clamp(0, max);
            let out = collect(&entries[..n as usize]);
            // SAFETY: the first `n` entries were filled and are freed once.
            unsafe { sys::rbd_config_image_list_cleanup(entries.as_mut_ptr(), n) };
            return Ok(out);
        }
    }
}
