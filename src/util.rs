//! Small helpers shared by the wrappers: C strings, NUL-separated lists and
//! the grow-and-retry loop that list calls need on `ERANGE`.

use std::ffi::{CStr, CString};
use std::os::raw::c_char;

use crate::error::{Error, Result};

/// Largest buffer a list call may ask for before we give up (64 MiB): a
/// defence against a library that keeps answering `ERANGE`.
pub(crate) const MAX_BUFFER: usize = 64 << 20;

/// A progress callback that ignores progress. librbd's `*_with_progress`
/// and `*2` calls invoke the callback they are given without a null check,
/// so they must never get a null one.
pub(crate) extern "C" fn no_progress(
    _offset: u64,
    _total: u64,
    _arg: *mut std::os::raw::c_void,
) -> std::os::raw::c_int {
    0
}

/// What [`deadline_progress`] gets as its argument.
pub(crate) struct Deadline {
    at: std::time::Instant,
    /// Set once the callback asked librbd to stop.
    fired: std::sync::atomic::AtomicBool,
}

/// A progress callback that stops the operation once the deadline its
/// argument holds has passed: librbd aborts a long-running operation
/// (remove, trash remove, flatten) when its progress callback returns
/// non-zero, and calls it after each batch of objects.
pub(crate) extern "C" fn deadline_progress(
    _offset: u64,
    _total: u64,
    arg: *mut std::os::raw::c_void,
) -> std::os::raw::c_int {
    // SAFETY: the callers pass a pointer to a `Deadline` that outlives the
    // (synchronous) librbd call that invokes this callback.
    let d = unsafe { &*(arg as *const Deadline) };
    if std::time::Instant::now() >= d.at {
        d.fired.store(true, std::sync::atomic::Ordering::SeqCst);
        -libc::ETIMEDOUT
    } else {
        0
    }
}

/// Runs a librbd call given [`deadline_progress`] and a [`Deadline`], and
/// turns the failure it causes into a [`crate::ErrorKind::TimedOut`] error.
pub(crate) fn with_deadline(
    deadline: std::time::Instant,
    op: &'static str,
    object: impl FnOnce() -> String,
    call: impl FnOnce(ProgressFn, *mut std::os::raw::c_void) -> i32,
) -> Result<()> {
    let d = Deadline {
        at: deadline,
        fired: std::sync::atomic::AtomicBool::new(false),
    };
    let ret = call(Some(deadline_progress), &d as *const Deadline as *mut _);
    if ret < 0 && d.fired.load(std::sync::atomic::Ordering::SeqCst) {
        return Err(Error::from_errno(libc::ETIMEDOUT, op, object()).detail(
            "the deadline passed and the operation was stopped part-way; call it again to finish",
        ));
    }
    crate::error::cvt(ret, op, object)?;
    Ok(())
}

/// librbd's progress callback type.
pub(crate) type ProgressFn = rbd_sys::librbd_progress_fn_t;

/// Calls a function of the `(char *buf, size_t *len)` kind, growing the
/// buffer while it answers `-ERANGE` (librbd then sets `*len` to the size it
/// needs). Returns the buffer cut to the length the call reported.
pub(crate) fn sized_buffer(
    initial: usize,
    op: &'static str,
    object: &dyn Fn() -> String,
    mut call: impl FnMut(*mut std::os::raw::c_char, &mut usize) -> i32,
) -> Result<Vec<u8>> {
    let mut used = 0usize;
    let mut buf = with_growing_buffer(initial, op, object, |buf| {
        let mut len = buf.len();
        let ret = call(buf.as_mut_ptr().cast(), &mut len);
        used = len;
        (i64::from(ret), len)
    })?;
    buf.truncate(used.min(buf.len()));
    Ok(buf)
}

/// Calls a librbd list function that fills an array of `T` and reports the
/// count through its `size_t *` argument, growing the array while it answers
/// `-ERANGE` with a larger count (up to `1 << 20` entries).
///
/// Returns the C return value and the array cut to the reported count. Only
/// when the return value is non-negative does the array hold entries that
/// librbd filled; the caller copies them out and then hands the same array
/// to the matching `*_cleanup` call.
pub(crate) fn fill_array<T: Default + Clone>(
    mut call: impl FnMut(*mut T, &mut usize) -> i32,
) -> (i32, Vec<T>) {
    let mut max = 16usize;
    loop {
        let mut entries = vec![T::default(); max];
        let mut n = max;
        let ret = call(entries.as_mut_ptr(), &mut n);
        if ret == -libc::ERANGE && n > max && n <= 1 << 20 {
            max = n;
            continue;
        }
        entries.truncate(n.min(max));
        return (ret, entries);
    }
}

/// Converts a Rust string for C, refusing interior NUL bytes with a clear
/// error that names what the string was.
pub(crate) fn cstr(s: &str, op: &'static str, what: &str) -> Result<CString> {
    CString::new(s)
        .map_err(|_| Error::invalid(op, what, format!("{what} {s:?} contains a NUL byte")))
}

/// Copies a C string owned by librados/librbd into a `String`.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string valid for this call.
pub(crate) unsafe fn from_cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller guarantees `p` is a valid NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Splits a buffer of NUL-terminated strings (`a\0b\0\0`) into strings.
pub(crate) fn split_nul_list(buf: &[u8]) -> Vec<String> {
    buf.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// Reads a NUL-terminated string out of a fixed buffer.
pub(crate) fn string_from_buf(buf: &[u8]) -> String {
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Calls `f` with a buffer, growing it while `f` reports `ERANGE`.
///
/// `f` gets the buffer and returns the C return value together with the size
/// the library asked for (or 0 when it did not say). The buffer is doubled
/// (or grown to the asked size) until the call succeeds, fails otherwise, or
/// passes [`MAX_BUFFER`]. On success the whole buffer is returned: the caller
/// knows from the call's outputs how much of it holds data.
pub(crate) fn with_growing_buffer<F>(
    initial: usize,
    op: &'static str,
    object: &dyn Fn() -> String,
    mut f: F,
) -> Result<Vec<u8>>
where
    F: FnMut(&mut Vec<u8>) -> (i64, usize),
{
    let mut size = initial.max(16);
    loop {
        let mut buf = vec![0u8; size];
        let (ret, wanted) = f(&mut buf);
        if ret >= 0 {
            return Ok(buf);
        }
        let errno = i32::try_from(-ret).unwrap_or(libc::EIO);
        if errno != libc::ERANGE {
            return Err(Error::from_errno(errno, op, object()));
        }
        let next = wanted.max(size.saturating_mul(2));
        if next > MAX_BUFFER {
            return Err(Error::from_errno(libc::ERANGE, op, object())
                .detail(format!("result larger than {MAX_BUFFER} bytes")));
        }
        size = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_nul_lists() {
        assert_eq!(split_nul_list(b"a\0bc\0\0\0"), vec!["a", "bc"]);
        assert!(split_nul_list(b"\0\0").is_empty());
    }

    #[test]
    fn grows_on_erange_and_stops_at_the_cap() {
        let mut calls = 0;
        let out = with_growing_buffer(4, "t", &String::new, |buf| {
            calls += 1;
            if buf.len() < 100 {
                (-(libc::ERANGE as i64), 100)
            } else {
                buf[0] = 7;
                (0, 0)
            }
        })
        .unwrap();
        assert_eq!(out[0], 7);
        assert_eq!(calls, 2);
        let err = with_growing_buffer(4, "t", &|| "x".into(), |_| (-(libc::ERANGE as i64), 0))
            .unwrap_err();
        assert_eq!(err.errno(), libc::ERANGE);
    }

    #[test]
    fn refuses_interior_nul() {
        let e = cstr("a\0b", "rbd_open", "image name").unwrap_err();
        assert!(e.to_string().contains("image name"), "{e}");
    }
}
