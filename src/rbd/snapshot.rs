//! Snapshots of an image: create, list, remove, protect, rollback, rename,
//! timestamps and limits.

use std::ptr;
use std::time::SystemTime;

use rbd_sys as sys;

use crate::error::{Error, ErrorKind, Result};
use crate::rbd::image::get_timestamp;
use crate::rbd::Image;
use crate::util::{cstr, from_cstr, no_progress, sized_buffer, string_from_buf};

/// One snapshot, as `rbd_snap_list` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapInfo {
    /// The snapshot id.
    pub id: u64,
    /// The image size when the snapshot was taken.
    pub size: u64,
    /// The snapshot name.
    pub name: String,
}

/// The most snapshots [`Image::snap_list`] makes room for (librbd allows far
/// fewer per image), and the most rounds it retries on `ERANGE`.
const MAX_SNAPS: i32 = 1 << 20;
const MAX_ROUNDS: usize = 8;

/// Calls `rbd_snap_list` through `call` with an array that grows while it
/// answers `-ERANGE`, at most [`MAX_ROUNDS`] times and up to [`MAX_SNAPS`]
/// entries; then gives up with `-ERANGE`. Returns the C result and the
/// array (one entry longer than librbd was told, for its terminator).
fn snap_array(
    mut call: impl FnMut(*mut sys::rbd_snap_info_t, &mut i32) -> i32,
) -> (i32, Vec<sys::rbd_snap_info_t>) {
    let mut max: i32 = 16;
    for _ in 0..MAX_ROUNDS {
        let mut snaps = vec![sys::rbd_snap_info_t::default(); max as usize + 1];
        let mut n = max;
        let ret = call(snaps.as_mut_ptr(), &mut n);
        if ret != -libc::ERANGE || max >= MAX_SNAPS {
            return (ret, snaps);
        }
        max = if n > max { n } else { max.saturating_mul(2) }.min(MAX_SNAPS);
    }
    (-libc::ERANGE, vec![sys::rbd_snap_info_t::default()])
}

impl Image {
    fn snap_spec(&self, snap: &str) -> String {
        format!("{}@{}", self.spec(), snap)
    }

    fn snap_call(
        &self,
        op: &'static str,
        snap: &str,
        f: impl FnOnce(*const std::os::raw::c_char) -> i32,
    ) -> Result<()> {
        let s = cstr(snap, op, "snapshot name")?;
        let ret = f(s.as_ptr());
        crate::error::cvt(ret, op, || self.snap_spec(snap))?;
        Ok(())
    }

    /// Creates a snapshot of the image's current state. Wraps `rbd_snap_create`.
    pub fn snap_create(&self, snap: &str) -> Result<()> {
        if snap.is_empty() {
            return Err(Error::invalid(
                "rbd_snap_create",
                self.spec(),
                "snapshot name is empty",
            ));
        }
        // SAFETY: the image is open; `p` is a NUL-terminated name.
        self.snap_call("rbd_snap_create", snap, |p| unsafe {
            sys::rbd_snap_create(self.raw(), p)
        })
    }

    /// Lists the image's user snapshots. Wraps `rbd_snap_list` (retrying with
    /// a larger array on `ERANGE`) and `rbd_snap_list_end`.
    pub fn snap_list(&self) -> Result<Vec<SnapInfo>> {
        let (ret, mut snaps) = snap_array(|p, n| {
            // SAFETY: `p` has room for `*n` entries and one more; on -ERANGE
            // librbd sets `*n` to the count it needs and fills nothing.
            unsafe { sys::rbd_snap_list(self.raw(), p, n) }
        });
        let count = self.cvt(ret, "rbd_snap_list")? as usize;
        let out = snaps[..count.min(snaps.len().saturating_sub(1))]
            .iter()
            .map(|s| SnapInfo {
                id: s.id,
                size: s.size,
                // SAFETY: librbd filled the first `count` entries.
                name: unsafe { from_cstr(s.name) },
            })
            .collect();
        // SAFETY: frees the names librbd allocated in this array, once.
        unsafe { sys::rbd_snap_list_end(snaps.as_mut_ptr()) };
        Ok(out)
    }

    /// True when a snapshot of that name exists. Wraps `rbd_snap_exists`.
    pub fn snap_exists(&self, snap: &str) -> Result<bool> {
        let mut exists = false;
        // SAFETY: the image is open; `p` is NUL-terminated; `exists` is a
        // valid out-pointer.
        self.snap_call("rbd_snap_exists", snap, |p| unsafe {
            sys::rbd_snap_exists(self.raw(), p, &mut exists)
        })?;
        Ok(exists)
    }

    /// Removes a snapshot. Wraps `rbd_snap_remove`. A protected snapshot
    /// fails with [`ErrorKind::Busy`].
    pub fn snap_remove(&self, snap: &str) -> Result<()> {
        // SAFETY: the image is open; `p` is NUL-terminated.
        self.snap_call("rbd_snap_remove", snap, |p| unsafe {
            sys::rbd_snap_remove(self.raw(), p)
        })
        .map_err(|e| match e.kind() {
            ErrorKind::Busy => e.detail("snapshot is protected; unprotect it first"),
            _ => e,
        })
    }

    /// Removes a snapshot, unprotecting it first if needed. Wraps
    /// `rbd_snap_remove2` with `RBD_SNAP_REMOVE_UNPROTECT`.
    pub fn snap_remove_force(&self, snap: &str) -> Result<()> {
        // SAFETY: the image is open; `p` is NUL-terminated; the progress
        // callback is a no-op that ignores its (null) argument.
        self.snap_call("rbd_snap_remove2", snap, |p| unsafe {
            sys::rbd_snap_remove2(
                self.raw(),
                p,
                sys::RBD_SNAP_REMOVE_UNPROTECT,
                Some(no_progress),
                ptr::null_mut(),
            )
        })
    }

    /// Protects a snapshot so clones can be made of it. Wraps `rbd_snap_protect`.
    pub fn snap_protect(&self, snap: &str) -> Result<()> {
        // SAFETY: the image is open; `p` is NUL-terminated.
        self.snap_call("rbd_snap_protect", snap, |p| unsafe {
            sys::rbd_snap_protect(self.raw(), p)
        })
    }

    /// Unprotects a snapshot; fails with [`ErrorKind::Busy`] while it has
    /// clones. Wraps `rbd_snap_unprotect`.
    pub fn snap_unprotect(&self, snap: &str) -> Result<()> {
        // SAFETY: the image is open; `p` is NUL-terminated.
        self.snap_call("rbd_snap_unprotect", snap, |p| unsafe {
            sys::rbd_snap_unprotect(self.raw(), p)
        })
    }

    /// True when the snapshot is protected. Wraps `rbd_snap_is_protected`.
    pub fn snap_is_protected(&self, snap: &str) -> Result<bool> {
        let mut prot = 0i32;
        // SAFETY: the image is open; `p` is NUL-terminated; `prot` is a valid
        // out-pointer.
        self.snap_call("rbd_snap_is_protected", snap, |p| unsafe {
            sys::rbd_snap_is_protected(self.raw(), p, &mut prot)
        })?;
        Ok(prot != 0)
    }

    /// Rolls the image back to a snapshot. Wraps `rbd_snap_rollback`.
    pub fn snap_rollback(&self, snap: &str) -> Result<()> {
        // SAFETY: the image is open; `p` is NUL-terminated.
        self.snap_call("rbd_snap_rollback", snap, |p| unsafe {
            sys::rbd_snap_rollback(self.raw(), p)
        })
    }

    /// Renames a snapshot. Wraps `rbd_snap_rename`.
    pub fn snap_rename(&self, from: &str, to: &str) -> Result<()> {
        let t = cstr(to, "rbd_snap_rename", "snapshot name")?;
        // SAFETY: the image is open; both names are NUL-terminated.
        self.snap_call("rbd_snap_rename", from, |p| unsafe {
            sys::rbd_snap_rename(self.raw(), p, t.as_ptr())
        })
    }

    /// The id of a snapshot. Wraps `rbd_snap_get_id`.
    pub fn snap_id(&self, snap: &str) -> Result<u64> {
        let mut id = 0u64;
        // SAFETY: the image is open; `p` is NUL-terminated; valid out-pointer.
        self.snap_call("rbd_snap_get_id", snap, |p| unsafe {
            sys::rbd_snap_get_id(self.raw(), p, &mut id)
        })?;
        Ok(id)
    }

    /// The name of the snapshot with this id. Wraps `rbd_snap_get_name`.
    pub fn snap_name(&self, id: u64) -> Result<String> {
        let buf = sized_buffer(
            64,
            "rbd_snap_get_name",
            &|| format!("{}@{id}", self.spec()),
            |p, len| {
                // SAFETY: `p` is writable for `*len` bytes; on -ERANGE librbd
                // sets `*len` to what it needs.
                unsafe { sys::rbd_snap_get_name(self.raw(), id, p, len) }
            },
        )?;
        Ok(string_from_buf(&buf))
    }

    /// When the snapshot was taken. Wraps `rbd_snap_get_timestamp`.
    pub fn snap_timestamp(&self, id: u64) -> Result<SystemTime> {
        let (ret, t) = get_timestamp(|ts| {
            // SAFETY: the image is open; `ts` points to a valid out-struct.
            unsafe { sys::rbd_snap_get_timestamp(self.raw(), id, ts) }
        });
        crate::error::cvt(ret, "rbd_snap_get_timestamp", || {
            format!("{}@{id}", self.spec())
        })?;
        Ok(t)
    }

    /// The most snapshots the image may have. Wraps `rbd_snap_get_limit`.
    pub fn snap_limit(&self) -> Result<u64> {
        let mut limit = 0u64;
        // SAFETY: the image is open; valid out-pointer.
        let ret = unsafe { sys::rbd_snap_get_limit(self.raw(), &mut limit) };
        self.cvt(ret, "rbd_snap_get_limit")?;
        Ok(limit)
    }

    /// Sets the most snapshots the image may have. Wraps `rbd_snap_set_limit`.
    pub fn set_snap_limit(&self, limit: u64) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_snap_set_limit(self.raw(), limit) };
        self.cvt(ret, "rbd_snap_set_limit")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snap_list_retries_on_erange_a_bounded_number_of_times() {
        // A library that always wants more: gives up instead of looping.
        let mut calls = 0;
        let (ret, _) = snap_array(|_, n| {
            calls += 1;
            *n = n.saturating_mul(4);
            -libc::ERANGE
        });
        assert_eq!(ret, -libc::ERANGE);
        assert!(calls <= MAX_ROUNDS, "{calls}");
        // One that answers ERANGE without saying how much it needs.
        let mut calls = 0;
        let (ret, _) = snap_array(|_, _| {
            calls += 1;
            -libc::ERANGE
        });
        assert_eq!(ret, -libc::ERANGE);
        assert!(calls <= MAX_ROUNDS, "{calls}");
        // Grows to what is asked for once.
        let (ret, snaps) = snap_array(|_, n| {
            if *n < 100 {
                *n = 100;
                -libc::ERANGE
            } else {
                0
            }
        });
        assert_eq!(ret, 0);
        assert_eq!(snaps.len(), 101);
    }
}
