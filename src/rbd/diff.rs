//! Changed-extent iteration between snapshots (`rbd diff`), which is also
//! how disk usage is counted.

use std::ops::ControlFlow;
use std::os::raw::{c_int, c_void};
use std::panic::{self, AssertUnwindSafe};
use std::ptr;

use rbd_sys as sys;

use crate::error::Result;
use crate::rbd::Image;
use crate::util::cstr;

/// What the trampoline needs: the caller's closure, and a place to keep a
/// panic so it can be resumed after librbd has returned.
struct DiffState<'f> {
    f: &'f mut dyn FnMut(u64, u64, bool) -> ControlFlow<()>,
    panic: Option<Box<dyn std::any::Any + Send>>,
    stopped: bool,
}

/// Called by librbd for each extent. No panic may unwind into C, so the
/// closure runs under `catch_unwind` and a panic stops the iteration.
extern "C" fn diff_cb(offset: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `&mut DiffState` passed to rbd_diff_iterate2 by
    // `diff_iterate`, alive and not otherwise borrowed for the whole call.
    let state = unsafe { &mut *(arg as *mut DiffState<'_>) };
    match panic::catch_unwind(AssertUnwindSafe(|| {
        (state.f)(offset, len as u64, exists != 0)
    })) {
        Ok(ControlFlow::Continue(())) => 0,
        Ok(ControlFlow::Break(())) => {
            state.stopped = true;
            -libc::ECANCELED
        }
        Err(payload) => {
            state.panic = Some(payload);
            -libc::ECANCELED
        }
    }
}

impl Image {
    /// Calls `f(offset, length, exists)` for each extent in
    /// `[offset, offset+len)` that changed since `from_snapshot` (or that is
    /// allocated at all, for `None`). `exists == false` means the extent was
    /// discarded. With `whole_object`, extents are whole objects (fast with
    /// `fast-diff`). Return `ControlFlow::Break` to stop early. Wraps
    /// `rbd_diff_iterate2`.
    ///
    /// A panic in `f` stops the iteration and is resumed once librbd returns.
    pub fn diff_iterate<F>(
        &self,
        from_snapshot: Option<&str>,
        offset: u64,
        len: u64,
        include_parent: bool,
        whole_object: bool,
        mut f: F,
    ) -> Result<()>
    where
        F: FnMut(u64, u64, bool) -> ControlFlow<()>,
    {
        let from = from_snapshot
            .map(|s| cstr(s, "rbd_diff_iterate2", "snapshot name"))
            .transpose()?;
        let mut state = DiffState {
            f: &mut f,
            panic: None,
            stopped: false,
        };
        // SAFETY: the image is open; `from` is NUL-terminated or null; the
        // callback only dereferences `state`, which outlives this call.
        let ret = unsafe {
            sys::rbd_diff_iterate2(
                self.raw(),
                from.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
                offset,
                len,
                u8::from(include_parent),
                u8::from(whole_object),
                Some(diff_cb),
                (&mut state as *mut DiffState<'_>).cast(),
            )
        };
        if let Some(p) = state.panic.take() {
            panic::resume_unwind(p);
        }
        if state.stopped && ret == -libc::ECANCELED {
            return Ok(());
        }
        self.cvt(ret, "rbd_diff_iterate2")?;
        Ok(())
    }
}
