//! Synchronous (blocking) image I/O: read, write, discard, write-zeroes,
//! compare-and-write and flush. Futures over librbd AIO come with the async layer.

use rbd_sys as sys;

use crate::error::{Error, Result};
use crate::rbd::Image;

/// The largest length one synchronous `rbd_read`/`rbd_write`/
/// `rbd_write_zeroes`/`rbd_discard` call is given: their results pass
/// through an `int` inside librbd, and its buffer copies count in 32 bits,
/// so larger requests are split into calls of at most this size.
pub(crate) const MAX_SYNC_CHUNK: usize = 1 << 30;

impl Image {
    fn check_range(&self, op: &'static str, offset: u64, len: usize) -> Result<()> {
        if offset.checked_add(len as u64).is_none() {
            return Err(Error::invalid(
                op,
                self.spec(),
                format!("offset {offset} + length {len} overflows"),
            ));
        }
        Ok(())
    }

    /// Reads into `buf` at `offset`; returns how many bytes were read (fewer
    /// than asked only past the end of the image). Wraps `rbd_read`, one call
    /// per 1 GiB, so buffers of any size work.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        self.check_range("rbd_read", offset, buf.len())?;
        let mut done = 0usize;
        for chunk in buf.chunks_mut(MAX_SYNC_CHUNK) {
            let at = offset + done as u64;
            // SAFETY: `chunk` is writable for its length (at most 1 GiB, so
            // the count fits librbd's int); librbd writes at most that many
            // bytes and returns the count.
            let ret =
                unsafe { sys::rbd_read(self.raw(), at, chunk.len(), chunk.as_mut_ptr().cast()) };
            let n = (self.cvt(ret, "rbd_read")? as usize).min(chunk.len());
            done += n;
            if n < chunk.len() {
                break; // the end of the image
            }
        }
        Ok(done)
    }

    /// Reads exactly `buf.len()` bytes at `offset`, failing if the image ends
    /// first.
    pub fn read_exact(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let n = self.read(offset, buf)?;
        if n != buf.len() {
            return Err(Error::invalid(
                "rbd_read",
                self.spec(),
                format!(
                    "short read: {n} of {} bytes at offset {offset} (past the end?)",
                    buf.len()
                ),
            ));
        }
        Ok(())
    }

    /// Writes `data` at `offset`; the range must lie within the image.
    /// Wraps `rbd_write`.
    ///
    /// Data of more than 1 GiB is written in 1 GiB calls, in order; if one
    /// fails, the ones before it have been written.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range("rbd_write", offset, data.len())?;
        if data.len() > MAX_SYNC_CHUNK {
            // Check up front, so a range past the end writes nothing.
            let size = self.size()?;
            if offset + data.len() as u64 > size {
                return Err(past_end(
                    "rbd_write",
                    &self.spec(),
                    offset,
                    data.len() as u64,
                    size,
                ));
            }
        }
        let mut done = 0usize;
        for chunk in data.chunks(MAX_SYNC_CHUNK) {
            let at = offset + done as u64;
            // SAFETY: `chunk` is readable for its length (at most 1 GiB);
            // librbd copies it before returning.
            let ret = unsafe { sys::rbd_write(self.raw(), at, chunk.len(), chunk.as_ptr().cast()) };
            let n = self.cvt(ret, "rbd_write")?;
            if n as usize != chunk.len() {
                return Err(Error::with_kind(
                    crate::ErrorKind::InvalidArgument,
                    libc::EINVAL,
                    "rbd_write",
                    self.spec(),
                    format!(
                        "short write: {n} of {} bytes at offset {at} (the range runs past the end of the image)",
                        chunk.len()
                    ),
                ));
            }
            done += chunk.len();
        }
        Ok(())
    }

    /// Deallocates a range; it reads back as zeroes. Wraps `rbd_discard`,
    /// one call per 1 GiB.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        if offset.checked_add(len).is_none() {
            return Err(Error::invalid(
                "rbd_discard",
                self.spec(),
                format!("offset {offset} + length {len} overflows"),
            ));
        }
        for (at, n) in chunks(offset, len) {
            // SAFETY: the image is open; `n` is at most 1 GiB.
            let ret = unsafe { sys::rbd_discard(self.raw(), at, n) };
            self.cvt(ret, "rbd_discard")?;
        }
        Ok(())
    }

    /// Writes zeroes over a range. Wraps `rbd_write_zeroes`, one call per
    /// 1 GiB.
    pub fn write_zeroes(&self, offset: u64, len: usize) -> Result<()> {
        self.check_range("rbd_write_zeroes", offset, len)?;
        for (at, n) in chunks(offset, len as u64) {
            // SAFETY: the image is open; no flags; `n` is at most 1 GiB.
            let ret = unsafe { sys::rbd_write_zeroes(self.raw(), at, n as usize, 0, 0) };
            self.cvt(ret, "rbd_write_zeroes")?;
        }
        Ok(())
    }

    /// Writes `data` at `offset` only if the range currently holds `expected`
    /// (same length). On a mismatch returns `Ok(Some(offset_of_first_mismatch))`
    /// and writes nothing. Wraps `rbd_compare_and_write`.
    #[cfg(librbd_supports_compare_and_write)]
    pub fn compare_and_write(
        &self,
        offset: u64,
        expected: &[u8],
        data: &[u8],
    ) -> Result<Option<u64>> {
        if expected.len() != data.len() {
            return Err(Error::invalid(
                "rbd_compare_and_write",
                self.spec(),
                "compare and write buffers differ in length",
            ));
        }
        self.check_range("rbd_compare_and_write", offset, data.len())?;
        if data.len() > MAX_SYNC_CHUNK {
            return Err(Error::invalid(
                "rbd_compare_and_write",
                self.spec(),
                format!(
                    "{} bytes given; at most {MAX_SYNC_CHUNK} are allowed",
                    data.len()
                ),
            ));
        }
        let mut mismatch = 0u64;
        // SAFETY: both buffers are readable for `data.len()` bytes; the
        // out-pointer is valid.
        let ret = unsafe {
            sys::rbd_compare_and_write(
                self.raw(),
                offset,
                data.len(),
                expected.as_ptr().cast(),
                data.as_ptr().cast(),
                &mut mismatch,
                0,
            )
        };
        if ret == -(libc::EILSEQ as isize) {
            return Ok(Some(mismatch));
        }
        self.cvt(ret, "rbd_compare_and_write")?;
        Ok(None)
    }

    /// Waits until every write so far is durable. Wraps `rbd_flush`.
    pub fn flush(&self) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_flush(self.raw()) };
        self.cvt(ret, "rbd_flush")?;
        Ok(())
    }

    /// Drops librbd's cache for this handle. Wraps `rbd_invalidate_cache`.
    pub fn invalidate_cache(&self) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_invalidate_cache(self.raw()) };
        self.cvt(ret, "rbd_invalidate_cache")?;
        Ok(())
    }
}

/// Splits `len` bytes at `offset` into (offset, length) pieces of at most
/// [`MAX_SYNC_CHUNK`] bytes.
fn chunks(offset: u64, len: u64) -> impl Iterator<Item = (u64, u64)> {
    let step = MAX_SYNC_CHUNK as u64;
    (0..len.div_ceil(step)).map(move |i| (offset + i * step, (len - i * step).min(step)))
}

/// The error for a write whose range runs past the end of the image.
pub(crate) fn past_end(op: &'static str, object: &str, offset: u64, len: u64, size: u64) -> Error {
    Error::with_kind(
        crate::ErrorKind::InvalidArgument,
        libc::EINVAL,
        op,
        object,
        format!("{len} bytes at offset {offset} run past the end of the image ({size} bytes)"),
    )
}
