//! Client-side encryption of an image (LUKS1, LUKS2): format an image with a
//! passphrase, then load the key into an open handle so that its reads and
//! writes are decrypted and encrypted.
//!
//! Passphrases are only passed through to librbd; they never appear in an
//! error or a log line.

use std::mem::size_of;
use std::os::raw::c_void;

use rbd_sys as sys;

use crate::error::{Error, Result};
use crate::rbd::Image;

/// An encryption format (`rbd_encryption_format_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EncryptionFormat {
    /// LUKS version 1.
    Luks1,
    /// LUKS version 2.
    Luks2,
    /// Either LUKS version, whichever the image has: for loading only.
    /// Added in librbd 1.18 (Ceph 18 Reef).
    Luks,
}

/// The cipher of a newly formatted image (`rbd_encryption_algorithm_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncryptionAlgorithm {
    /// AES-128 (XTS).
    Aes128,
    /// AES-256 (XTS): librbd's default.
    #[default]
    Aes256,
}

impl EncryptionAlgorithm {
    fn raw(self) -> sys::rbd_encryption_algorithm_t {
        match self {
            EncryptionAlgorithm::Aes128 => sys::RBD_ENCRYPTION_ALGORITHM_AES128,
            EncryptionAlgorithm::Aes256 => sys::RBD_ENCRYPTION_ALGORITHM_AES256,
        }
    }
}

/// How to unlock one image of a clone chain, for
/// [`Image::encryption_load_chain`].
#[derive(Clone, Copy)]
pub struct EncryptionSpec<'a> {
    /// The image's format.
    pub format: EncryptionFormat,
    /// Its passphrase.
    pub passphrase: &'a [u8],
}

impl std::fmt::Debug for EncryptionSpec<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncryptionSpec")
            .field("format", &self.format)
            .finish_non_exhaustive()
    }
}

/// The option structs of librbd.h, one per format; all have the passphrase
/// as a pointer and a length, and the format ones an algorithm.
enum RawOpts {
    Luks1(sys::rbd_encryption_luks1_format_options_t),
    Luks2(sys::rbd_encryption_luks2_format_options_t),
    #[cfg(librbd_supports_encryption_load2)]
    Luks(sys::rbd_encryption_luks_format_options_t),
}

impl RawOpts {
    /// The options for `format`. The result points into `passphrase` and
    /// must not outlive it.
    fn new(
        format: EncryptionFormat,
        alg: EncryptionAlgorithm,
        passphrase: &[u8],
        op: &'static str,
        object: &dyn Fn() -> String,
    ) -> Result<RawOpts> {
        let (p, n) = (passphrase.as_ptr().cast(), passphrase.len());
        Ok(match format {
            EncryptionFormat::Luks1 => RawOpts::Luks1(sys::rbd_encryption_luks1_format_options_t {
                alg: alg.raw(),
                passphrase: p,
                passphrase_size: n,
            }),
            EncryptionFormat::Luks2 => RawOpts::Luks2(sys::rbd_encryption_luks2_format_options_t {
                alg: alg.raw(),
                passphrase: p,
                passphrase_size: n,
            }),
            #[cfg(librbd_supports_encryption_load2)]
            EncryptionFormat::Luks => {
                let _ = (alg, op, object);
                RawOpts::Luks(sys::rbd_encryption_luks_format_options_t {
                    passphrase: p,
                    passphrase_size: n,
                })
            }
            #[cfg(not(librbd_supports_encryption_load2))]
            EncryptionFormat::Luks => {
                let _ = alg;
                return Err(crate::rbd::needs_librbd(op, object(), 18));
            }
        })
    }

    fn format(&self) -> sys::rbd_encryption_format_t {
        match self {
            RawOpts::Luks1(_) => sys::RBD_ENCRYPTION_FORMAT_LUKS1,
            RawOpts::Luks2(_) => sys::RBD_ENCRYPTION_FORMAT_LUKS2,
            #[cfg(librbd_supports_encryption_load2)]
            RawOpts::Luks(_) => sys::RBD_ENCRYPTION_FORMAT_LUKS,
        }
    }

    /// The `(opts, opts_size)` pair librbd takes.
    fn ptr_size(&mut self) -> (sys::rbd_encryption_options_t, usize) {
        match self {
            RawOpts::Luks1(o) => (
                (o as *mut sys::rbd_encryption_luks1_format_options_t).cast::<c_void>(),
                size_of::<sys::rbd_encryption_luks1_format_options_t>(),
            ),
            RawOpts::Luks2(o) => (
                (o as *mut sys::rbd_encryption_luks2_format_options_t).cast::<c_void>(),
                size_of::<sys::rbd_encryption_luks2_format_options_t>(),
            ),
            #[cfg(librbd_supports_encryption_load2)]
            RawOpts::Luks(o) => (
                (o as *mut sys::rbd_encryption_luks_format_options_t).cast::<c_void>(),
                size_of::<sys::rbd_encryption_luks_format_options_t>(),
            ),
        }
    }
}

impl Image {
    /// Formats the image for encryption with `passphrase`: writes a LUKS
    /// header at its start (so the usable size shrinks by the header) and,
    /// for an image that is not a clone, loads the key into this handle.
    /// Wraps `rbd_encryption_format`. `format` must be `Luks1` or `Luks2`.
    pub fn encryption_format(
        &self,
        format: EncryptionFormat,
        alg: EncryptionAlgorithm,
        passphrase: &[u8],
    ) -> Result<()> {
        const OP: &str = "rbd_encryption_format";
        if format == EncryptionFormat::Luks {
            return Err(Error::invalid(
                OP,
                self.spec(),
                "format an image as Luks1 or Luks2; Luks is for loading only",
            ));
        }
        let mut opts = RawOpts::new(format, alg, passphrase, OP, &|| self.spec())?;
        let (p, n) = opts.ptr_size();
        // SAFETY: the image is open; `p` points to the option struct of
        // `format` (librbd.h: rbd_encryption_luks{1,2}_format_options_t) and
        // `n` is its size; its passphrase pointer is valid for
        // `passphrase_size` bytes during the call, which is all librbd reads.
        let ret = unsafe { sys::rbd_encryption_format(self.raw(), opts.format(), p, n) };
        self.cvt(ret, OP)?;
        Ok(())
    }

    /// Loads the key of an encrypted image (and of its ancestors, with the
    /// same passphrase) into this handle; later I/O through it is
    /// decrypted. Wraps `rbd_encryption_load`. `Luks` (either version) needs
    /// librbd 1.18 (Ceph 18 Reef).
    pub fn encryption_load(&self, format: EncryptionFormat, passphrase: &[u8]) -> Result<()> {
        const OP: &str = "rbd_encryption_load";
        let mut opts = RawOpts::new(
            format,
            EncryptionAlgorithm::default(),
            passphrase,
            OP,
            &|| self.spec(),
        )?;
        let (p, n) = opts.ptr_size();
        // SAFETY: as in `encryption_format`: `p`/`n` are the option struct of
        // `format` and its size; the passphrase outlives the call.
        let ret = unsafe { sys::rbd_encryption_load(self.raw(), opts.format(), p, n) };
        self.cvt(ret, OP)?;
        Ok(())
    }

    /// Loads the keys of a clone chain: `specs[0]` for this image,
    /// `specs[1]` for its parent, and so on (the last one is reused for the
    /// remaining ancestors). Wraps `rbd_encryption_load2`, added in librbd
    /// 1.18 (Ceph 18 Reef); built against older headers it fails with
    /// `NotSupported`.
    pub fn encryption_load_chain(&self, specs: &[EncryptionSpec<'_>]) -> Result<()> {
        const OP: &str = "rbd_encryption_load2";
        if specs.is_empty() {
            return Err(Error::invalid(OP, self.spec(), "no encryption spec given"));
        }
        #[cfg(librbd_supports_encryption_load2)]
        {
            let mut opts = specs
                .iter()
                .map(|s| {
                    RawOpts::new(
                        s.format,
                        EncryptionAlgorithm::default(),
                        s.passphrase,
                        OP,
                        &|| self.spec(),
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            let raw: Vec<sys::rbd_encryption_spec_t> = opts
                .iter_mut()
                .map(|o| {
                    let format = o.format();
                    let (opts, opts_size) = o.ptr_size();
                    sys::rbd_encryption_spec_t {
                        format,
                        opts,
                        opts_size,
                    }
                })
                .collect();
            // SAFETY: the image is open; `raw` holds `raw.len()` specs, each
            // pointing to an option struct in `opts` of its format with its
            // size; `opts` and the passphrases outlive the call.
            let ret = unsafe { sys::rbd_encryption_load2(self.raw(), raw.as_ptr(), raw.len()) };
            self.cvt(ret, OP)?;
            Ok(())
        }
        #[cfg(not(librbd_supports_encryption_load2))]
        Err(crate::rbd::needs_librbd(OP, self.spec(), 18))
    }
}
