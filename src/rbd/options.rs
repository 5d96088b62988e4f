//! [`ImageOptions`]: the settings of a new image (create, clone, copy),
//! carried to librbd as an `rbd_image_options_t`.

use std::ffi::CString;
use std::ptr;

use rbd_sys as sys;

use crate::error::{cvt, Error, Result};
use crate::rbd::Features;

/// Settings for a new image: features, object size (order), striping and a
/// data pool. Unset fields take the cluster's defaults.
///
/// ```
/// use rbdkit::rbd::{Features, ImageOptions};
/// let opts = ImageOptions::new()
///     .features(Features::LAYERING | Features::EXCLUSIVE_LOCK)
///     .object_size(4 << 20)
///     .unwrap();
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageOptions {
    features: Option<Features>,
    order: Option<u8>,
    stripe_unit: Option<u64>,
    stripe_count: Option<u64>,
    data_pool: Option<String>,
    journal_pool: Option<String>,
    clone_format: Option<u64>,
}

impl ImageOptions {
    /// No options set: the cluster's defaults apply.
    pub fn new() -> ImageOptions {
        ImageOptions::default()
    }

    /// The image's features.
    pub fn features(mut self, features: Features) -> Self {
        self.features = Some(features);
        self
    }

    /// Object size as a power of two exponent (`order`), 12 (4 KiB) to 26 (64 MiB).
    pub fn order(mut self, order: u8) -> Result<Self> {
        if !(12..=26).contains(&order) {
            return Err(Error::invalid(
                "image options",
                "order",
                format!("order {order} is outside 12..=26 (4 KiB to 64 MiB objects)"),
            ));
        }
        self.order = Some(order);
        Ok(self)
    }

    /// Object size in bytes: a power of two from 4 KiB to 64 MiB.
    pub fn object_size(self, bytes: u64) -> Result<Self> {
        if !bytes.is_power_of_two() {
            return Err(Error::invalid(
                "image options",
                "object size",
                format!("object size {bytes} is not a power of two"),
            ));
        }
        self.order(bytes.trailing_zeros() as u8)
    }

    /// Striping: `unit` bytes per stripe unit over `count` objects. The unit
    /// must divide the object size; librbd checks that at create time.
    pub fn striping(mut self, unit: u64, count: u64) -> Result<Self> {
        if unit == 0 || count == 0 {
            return Err(Error::invalid(
                "image options",
                "striping",
                "stripe unit and stripe count must both be > 0",
            ));
        }
        self.stripe_unit = Some(unit);
        self.stripe_count = Some(count);
        Ok(self)
    }

    /// A separate pool for the data objects (erasure-coded pools, say).
    pub fn data_pool(mut self, pool: impl Into<String>) -> Self {
        self.data_pool = Some(pool.into());
        self
    }

    /// The pool for the image's journal (`RBD_IMAGE_OPTION_JOURNAL_POOL`),
    /// used only with the `journaling` feature.
    pub fn journal_pool(mut self, pool: impl Into<String>) -> Self {
        self.journal_pool = Some(pool.into());
        self
    }

    /// Clone format for [`crate::rbd::clone`]: 1 (the parent snapshot must be
    /// protected) or 2 (no protection needed; needs Mimic or newer clients).
    pub fn clone_format(mut self, format: u8) -> Result<Self> {
        if !(1..=2).contains(&format) {
            return Err(Error::invalid(
                "image options",
                "clone format",
                format!("clone format {format} is not 1 or 2"),
            ));
        }
        self.clone_format = Some(u64::from(format));
        Ok(self)
    }

    /// The features set, if any.
    pub fn get_features(&self) -> Option<Features> {
        self.features
    }

    /// The order set, if any.
    pub fn get_order(&self) -> Option<u8> {
        self.order
    }

    /// Builds the librbd options object.
    pub(crate) fn to_raw(&self, op: &'static str, object: &str) -> Result<RawOptions> {
        let raw = RawOptions::new();
        let set_u64 = |opt: u32, v: u64| {
            // SAFETY: `raw.0` is a live options object; `opt` is one of the
            // header's RBD_IMAGE_OPTION_* integer options.
            let ret = unsafe { sys::rbd_image_options_set_uint64(raw.0, opt as i32, v) };
            cvt(ret, op, || object.to_owned()).map(|_| ())
        };
        if let Some(f) = self.features {
            set_u64(sys::RBD_IMAGE_OPTION_FEATURES, f.bits())?;
        }
        if let Some(o) = self.order {
            set_u64(sys::RBD_IMAGE_OPTION_ORDER, u64::from(o))?;
        }
        if let Some(u) = self.stripe_unit {
            set_u64(sys::RBD_IMAGE_OPTION_STRIPE_UNIT, u)?;
        }
        if let Some(c) = self.stripe_count {
            set_u64(sys::RBD_IMAGE_OPTION_STRIPE_COUNT, c)?;
        }
        if let Some(f) = self.clone_format {
            set_u64(sys::RBD_IMAGE_OPTION_CLONE_FORMAT, f)?;
        }
        let pools = [
            (
                sys::RBD_IMAGE_OPTION_DATA_POOL,
                &self.data_pool,
                "data pool",
            ),
            (
                sys::RBD_IMAGE_OPTION_JOURNAL_POOL,
                &self.journal_pool,
                "journal pool",
            ),
        ];
        for (opt, pool, what) in pools {
            let Some(p) = pool else { continue };
            let v = CString::new(p.as_str()).map_err(|_| {
                Error::invalid(op, object, format!("{what} name contains a NUL byte"))
            })?;
            // SAFETY: `raw.0` is live; the data and journal pool options are
            // string options (librbd.h) and librbd copies the value.
            let ret = unsafe { sys::rbd_image_options_set_string(raw.0, opt as i32, v.as_ptr()) };
            cvt(ret, op, || object.to_owned())?;
        }
        Ok(raw)
    }
}

/// An owned `rbd_image_options_t`, destroyed exactly once.
pub(crate) struct RawOptions(pub(crate) sys::rbd_image_options_t);

impl RawOptions {
    fn new() -> RawOptions {
        let mut raw: sys::rbd_image_options_t = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the call cannot fail.
        unsafe { sys::rbd_image_options_create(&mut raw) };
        RawOptions(raw)
    }
}

impl Drop for RawOptions {
    fn drop(&mut self) {
        // SAFETY: created by rbd_image_options_create, destroyed only here.
        unsafe { sys::rbd_image_options_destroy(self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_size_must_be_a_power_of_two_in_range() {
        assert_eq!(
            ImageOptions::new()
                .object_size(4 << 20)
                .unwrap()
                .get_order(),
            Some(22)
        );
        assert!(ImageOptions::new().object_size(3 << 20).is_err());
        assert!(ImageOptions::new().object_size(1 << 30).is_err());
        assert!(ImageOptions::new().striping(0, 4).is_err());
    }
}
