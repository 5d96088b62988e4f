//! Watchers: the clients that have an image open read-write.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use rbd_sys as sys;

use crate::error::Result;
use crate::rbd::Image;
use crate::util::{fill_array, from_cstr};

/// A client watching an image header, from `rbd_watchers_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watcher {
    /// The client's address.
    pub addr: String,
    /// The client's instance id (`client.<id>`).
    pub id: i64,
    /// The watch cookie.
    pub cookie: u64,
}

impl Image {
    /// Lists the watchers of the image: every client that has it open
    /// read-write, this handle included if it is. Wraps `rbd_watchers_list`.
    pub fn watchers(&self) -> Result<Vec<Watcher>> {
        let (ret, mut ws) = fill_array(|p, n| {
            // SAFETY: `p` has room for `*n` entries; on -ERANGE librbd sets
            // `*n` to the count it needs.
            unsafe { sys::rbd_watchers_list(self.raw(), p, n) }
        });
        self.cvt(ret, "rbd_watchers_list")?;
        let out = ws
            .iter()
            .map(|w| Watcher {
                // SAFETY: librbd filled these entries.
                addr: unsafe { from_cstr(w.addr) },
                id: w.id,
                cookie: w.cookie,
            })
            .collect();
        // SAFETY: the entries were filled and are freed once.
        unsafe { sys::rbd_watchers_list_cleanup(ws.as_mut_ptr(), ws.len()) };
        Ok(out)
    }
}

/// How long dropping an [`UpdateWatch`] waits for a callback that is
/// running, by default.
pub const UNWATCH_TIMEOUT: Duration = Duration::from_secs(30);

/// What librbd's `arg` points to: the callback and the state that lets
/// `Drop` stop new calls and wait, bounded, for a running one.
struct WatchState {
    f: Box<dyn Fn() + Send + Sync + 'static>,
    /// Callbacks running now, and whether the watch is being dropped (both
    /// under one lock, so no call starts once dropping began).
    calls: Mutex<(usize, bool)>,
    idle: Condvar,
}

impl WatchState {
    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, bool)> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Called by librbd on its own thread when the image header changes. No
/// panic may unwind into C: one is caught and dropped.
extern "C" fn update_cb(arg: *mut std::os::raw::c_void) {
    // SAFETY: `arg` is the `Box<WatchState>` leaked in `update_watch`, alive
    // until `UpdateWatch::drop` has unregistered the watch (after which
    // librbd makes no more calls) and freed it, or leaked for good.
    let state = unsafe { &*(arg as *const WatchState) };
    {
        let mut calls = state.lock();
        if calls.1 {
            return; // being dropped: no new calls
        }
        calls.0 += 1;
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&state.f));
    let mut calls = state.lock();
    calls.0 -= 1;
    if calls.0 == 0 {
        state.idle.notify_all();
    }
}

/// A registered header watch; unregisters on drop. Borrows the image, so
/// the image cannot close while the watch exists.
///
/// Dropping it stops further calls at once and waits for a call that is
/// running, for at most [`UNWATCH_TIMEOUT`] (see
/// [`UpdateWatch::set_unwatch_timeout`]). If the callback is still running
/// after that, drop returns without unregistering: the watch and its
/// callback are leaked (they stay valid, so nothing is freed under librbd),
/// later notifications return at once, and closing the image will wait for
/// the stuck callback to return, as `rbd_close` always does.
pub struct UpdateWatch<'a> {
    image: &'a Image,
    handle: u64,
    arg: *mut WatchState,
    timeout: Duration,
}

// SAFETY: the watch only holds a shared image reference (Image is Sync), an
// integer handle and a pointer to `Send + Sync` state that is only freed in
// Drop after librbd stops calling it.
unsafe impl Send for UpdateWatch<'_> {}

impl UpdateWatch<'_> {
    /// Sets how long dropping the watch waits for a running callback.
    pub fn set_unwatch_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }
}

impl Image {
    /// Calls `f` (on a librbd thread) whenever the image header changes:
    /// resize, snapshot, features, metadata. Wraps `rbd_update_watch`.
    pub fn update_watch<F>(&self, f: F) -> Result<UpdateWatch<'_>>
    where
        F: Fn() + Send + Sync + 'static,
    {
        let arg: *mut WatchState = Box::into_raw(Box::new(WatchState {
            f: Box::new(f),
            calls: Mutex::new((0, false)),
            idle: Condvar::new(),
        }));
        let mut handle = 0u64;
        // SAFETY: the image is open; `arg` stays valid until the watch is
        // unregistered (in UpdateWatch::drop) or registration fails (below).
        let ret =
            unsafe { sys::rbd_update_watch(self.raw(), &mut handle, Some(update_cb), arg.cast()) };
        if let Err(e) = self.cvt(ret, "rbd_update_watch") {
            // SAFETY: registration failed, so librbd never saw `arg`.
            drop(unsafe { Box::from_raw(arg) });
            return Err(e);
        }
        Ok(UpdateWatch {
            image: self,
            handle,
            arg,
            timeout: UNWATCH_TIMEOUT,
        })
    }
}

impl Drop for UpdateWatch<'_> {
    fn drop(&mut self) {
        // SAFETY: `arg` is live until freed below (librbd may still call it).
        let state = unsafe { &*self.arg };
        let deadline = Instant::now() + self.timeout;
        let mut calls = state.lock();
        calls.1 = true;
        while calls.0 > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // A callback is stuck: rbd_update_unwatch would wait for it
                // forever. Leak the watch and its state (see the type docs).
                return;
            }
            calls = state
                .idle
                .wait_timeout(calls, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(calls);
        // SAFETY: `handle` was registered on this open image. No callback
        // is running and new ones return at once, so rbd_update_unwatch,
        // which waits for in-flight callbacks, returns promptly; none runs
        // after it returns.
        let ret = unsafe { sys::rbd_update_unwatch(self.image.raw(), self.handle) };
        if ret == 0 {
            // SAFETY: librbd no longer references `arg`; freed exactly once.
            drop(unsafe { Box::from_raw(self.arg) });
        }
        // On failure the state is leaked on purpose: librbd may still call it.
    }
}
