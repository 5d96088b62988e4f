//! Keys in memory: [`Secret`], and keeping them out of core dumps.
//!
//! A cephx key is as good as the cluster access it grants, so its copies
//! are kept few, short-lived and out of anything written to disk:
//! - a [`Secret`] holds its bytes in pages of their own, mapped with
//!   `MADV_DONTDUMP` (left out of a core dump even when one is written),
//!   `MADV_WIPEONFORK` (a forked child sees zeroes) and, where the memlock
//!   limit allows, `mlock` (never swapped out); they are zeroed before they
//!   are unmapped;
//! - [`keep_keys_out_of_core_dumps`] makes the whole process non-dumpable
//!   (`PR_SET_DUMPABLE` 0): no core file, no `ptrace` or `/proc/PID/mem`
//!   by processes without `CAP_SYS_PTRACE`. The daemons that hold keys
//!   (`rbdkit csi`, the provisioner, `rbdkit fuse-mapper`) call it first
//!   thing. librados keeps its own copy of the key in its configuration,
//!   out of our reach: only the process-wide setting covers that one;
//! - buffers that held a key on its way (a request line, a decoded key for
//!   the kernel keyring) are overwritten with [`zeroize`] before they are
//!   freed.

use std::fmt;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// Overwrites a buffer with zeroes in a way the compiler may not drop as a
/// dead store.
pub(crate) fn zeroize(buf: &mut [u8]) {
    for b in buf.iter_mut() {
        // SAFETY: `b` is a valid, aligned, exclusive reference to one byte.
        unsafe { std::ptr::write_volatile(b, 0) };
    }
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
}

/// Makes this process non-dumpable (`prctl(PR_SET_DUMPABLE, 0)`): the
/// kernel writes no core file for it, and processes without
/// `CAP_SYS_PTRACE` cannot attach to it or read its memory. Lasts until the
/// process `execve`s another program, so each key-holding daemon calls it.
pub fn keep_keys_out_of_core_dumps() -> Result<()> {
    // SAFETY: prctl(2) PR_SET_DUMPABLE takes an integer argument (0 or 1)
    // and touches no memory of ours.
    let ret = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    if ret != 0 {
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        return Err(Error::from_errno(errno, "prctl(PR_SET_DUMPABLE)", "0"));
    }
    Ok(())
}

/// Pages of their own holding a key's bytes (see the module docs).
struct KeyPages {
    ptr: NonNull<u8>,
    len: usize,
    mapped: usize,
}

// SAFETY: the pages are written only while the value is built and read
// only afterwards (no interior mutability); the pointer is owned.
unsafe impl Send for KeyPages {}
// SAFETY: as above: shared references only read.
unsafe impl Sync for KeyPages {}

impl KeyPages {
    fn holding(bytes: &[u8]) -> KeyPages {
        // SAFETY: sysconf(3) takes an integer name and returns a value.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(4096);
        let mapped = bytes.len().max(1).div_ceil(page) * page;
        // SAFETY: mmap(2) of a fresh private anonymous mapping: no address
        // hint, no fd; it either fails or returns `mapped` writable bytes
        // that no one else refers to.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        let Some(ptr) = NonNull::new(p.cast::<u8>()).filter(|_| p != libc::MAP_FAILED) else {
            // Out of address space or map count: as a failed allocation.
            std::alloc::handle_alloc_error(
                std::alloc::Layout::from_size_align(mapped, page)
                    .unwrap_or(std::alloc::Layout::new::<u8>()),
            );
        };
        // SAFETY: madvise(2) and mlock(2) on exactly the mapping made above;
        // they change how the kernel treats it, not its contents. Each is
        // best effort: an older kernel or a low memlock limit leaves the
        // other protections.
        unsafe {
            libc::madvise(p, mapped, libc::MADV_DONTDUMP);
            libc::madvise(p, mapped, libc::MADV_WIPEONFORK);
            libc::mlock(p, mapped);
        }
        // SAFETY: the mapping is `mapped >= bytes.len()` bytes long, ours
        // alone, and cannot overlap `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr.as_ptr(), bytes.len()) };
        KeyPages {
            ptr,
            len: bytes.len(),
            mapped,
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the first `len` bytes of the mapping were written in
        // `holding` and stay mapped until drop.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for KeyPages {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours and `mapped` bytes long; no reference
        // into it outlives `self`.
        let all = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.mapped) };
        zeroize(all);
        // SAFETY: unmaps exactly the mapping made in `holding`, once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped) };
    }
}

/// A cephx key. Its `Debug` output is redacted, and it is handed to librados
/// only through `rados_conf_set("key")`: it is never logged or put in errors.
/// Its bytes live in memory that core dumps leave out and are overwritten
/// with zeroes when it is dropped (see the module docs).
pub struct Secret(KeyPages);

impl Secret {
    /// Wraps a base64 cephx key. The `String` it came in is zeroed.
    pub fn new(key: impl Into<String>) -> Secret {
        let mut key = key.into();
        let s = Secret(KeyPages::holding(key.as_bytes()));
        // SAFETY: only zero bytes are written, which keeps it valid UTF-8.
        zeroize(unsafe { key.as_mut_vec() });
        s
    }

    /// The key itself. Use only to pass it on to librados.
    pub fn expose(&self) -> &str {
        // SAFETY: the bytes were copied from a `String` in `new` (or from
        // another `Secret` in `clone`) and never change.
        unsafe { std::str::from_utf8_unchecked(self.0.bytes()) }
    }
}

impl Clone for Secret {
    fn clone(&self) -> Secret {
        Secret(KeyPages::holding(self.0.bytes()))
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        let (a, b) = (self.0.bytes(), other.0.bytes());
        // Length, then every byte: no early exit on the first difference.
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl Eq for Secret {}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Secret {
        Secret::new(s)
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Secret {
        Secret(KeyPages::holding(s.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroize_clears_the_buffer() {
        let mut b = *b"AQBsecret";
        zeroize(&mut b);
        assert_eq!(b, [0u8; 9]);
    }

    #[test]
    fn secrets_round_trip_and_compare() {
        let a = Secret::new("AQBsecret==");
        let b = a.clone();
        assert_eq!(a, b);
        assert_eq!(b.expose(), "AQBsecret==");
        assert_ne!(a, Secret::from(""));
        assert_eq!(Secret::from("").expose(), "");
        let long = "k".repeat(10_000);
        assert_eq!(Secret::from(long.as_str()).expose(), long);
    }

    #[test]
    fn a_dumpable_flag_of_zero_sticks() {
        // In a child, so the test process stays dumpable.
        // SAFETY: fork(2) in a test; the child only calls async-signal-safe
        // prctl and _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let ok = keep_keys_out_of_core_dumps().is_ok()
                // SAFETY: prctl(2) PR_GET_DUMPABLE takes no pointer.
                && unsafe { libc::prctl(libc::PR_GET_DUMPABLE) } == 0;
            // SAFETY: _exit(2) ends the child at once.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waitpid(2) on our child with a valid status pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }
}
