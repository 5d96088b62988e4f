//! Watchers: the clients that have an image open read-write.

use rbd_sys as sys;

use crate::error::Result;
use crate::rbd::Image;
use crate::util::from_cstr;

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
        let mut max = 8usize;
        loop {
            let mut ws = vec![sys::rbd_image_watcher_t::default(); max];
            let mut n = max;
            // SAFETY: `ws` has room for `n` entries; on -ERANGE librbd sets
            // `n` to the count it needs.
            let ret = unsafe { sys::rbd_watchers_list(self.raw(), ws.as_mut_ptr(), &mut n) };
            if ret == -libc::ERANGE && n > max && n <= 1 << 16 {
                max = n;
                continue;
            }
            self.cvt(ret, "rbd_watchers_list")?;
            let n = n.min(max);
            let out = ws[..n]
                .iter()
                .map(|w| Watcher {
                    // SAFETY: librbd filled the first `n` entries.
                    addr: unsafe { from_cstr(w.addr) },
                    id: w.id,
                    cookie: w.cookie,
                })
                .collect();
            // SAFETY: the first `n` entries were filled and are freed once.
            unsafe { sys::rbd_watchers_list_cleanup(ws.as_mut_ptr(), n) };
            return Ok(out);
        }
    }
}
