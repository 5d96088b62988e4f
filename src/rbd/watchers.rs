//! Watchers: the clients that have an image open read-write.

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

/// The boxed callback handed to librbd as the watch's `arg`.
type WatchFn = Box<dyn Fn() + Send + Sync + 'static>;

/// Called by librbd on its own thread when the image header changes. No
/// panic may unwind into C: one is caught and dropped.
extern "C" fn update_cb(arg: *mut std::os::raw::c_void) {
    // SAFETY: `arg` is the `Box<WatchFn>` leaked in `update_watch`, alive
    // until `UpdateWatch::drop` has unregistered the watch (after which
    // librbd makes no more calls) and freed it.
    let f = unsafe { &*(arg as *const WatchFn) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

/// A registered header watch; unregisters on drop. Borrows the image, so
/// the image cannot close while the watch exists.
pub struct UpdateWatch<'a> {
    image: &'a Image,
    handle: u64,
    arg: *mut WatchFn,
}

// SAFETY: the watch only holds a shared image reference (Image is Sync), an
// integer handle and a pointer to a `Send + Sync` closure that is only freed
// in Drop after librbd stops calling it.
unsafe impl Send for UpdateWatch<'_> {}

impl Image {
    /// Calls `f` (on a librbd thread) whenever the image header changes:
    /// resize, snapshot, features, metadata. Wraps `rbd_update_watch`.
    pub fn update_watch<F>(&self, f: F) -> Result<UpdateWatch<'_>>
    where
        F: Fn() + Send + Sync + 'static,
    {
        let arg: *mut WatchFn = Box::into_raw(Box::new(Box::new(f)));
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
        })
    }
}

impl Drop for UpdateWatch<'_> {
    fn drop(&mut self) {
        // SAFETY: `handle` was registered on this open image; rbd_update_unwatch
        // waits for in-flight callbacks, so none runs after it returns.
        let ret = unsafe { sys::rbd_update_unwatch(self.image.raw(), self.handle) };
        if ret == 0 {
            // SAFETY: librbd no longer references `arg`; freed exactly once.
            drop(unsafe { Box::from_raw(self.arg) });
        }
        // On failure the closure is leaked on purpose: librbd may still call it.
    }
}
