//! Locks: the managed exclusive lock (`exclusive-lock` feature) and the
//! advisory locks `rbd lock` uses.

use std::ptr;

use rbd_sys as sys;

use crate::error::Result;
use crate::rbd::Image;
use crate::util::{cstr, from_cstr, split_nul_list};

/// The mode of a managed lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// One owner.
    Exclusive,
    /// Several owners.
    Shared,
}

impl LockMode {
    fn raw(self) -> sys::rbd_lock_mode_t {
        match self {
            LockMode::Exclusive => sys::RBD_LOCK_MODE_EXCLUSIVE,
            LockMode::Shared => sys::RBD_LOCK_MODE_SHARED,
        }
    }
}

/// One holder of an advisory lock, from `rbd_list_lockers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Locker {
    /// The client entity (`client.4123`).
    pub client: String,
    /// The lock cookie.
    pub cookie: String,
    /// The client's address.
    pub addr: String,
}

/// The advisory locks on an image.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Lockers {
    /// True for an exclusive lock.
    pub exclusive: bool,
    /// The tag of a shared lock.
    pub tag: String,
    /// The holders.
    pub lockers: Vec<Locker>,
}

impl Image {
    /// Acquires the managed lock. Wraps `rbd_lock_acquire`.
    pub fn lock_acquire(&self, mode: LockMode) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_lock_acquire(self.raw(), mode.raw()) };
        self.cvt(ret, "rbd_lock_acquire")?;
        Ok(())
    }

    /// Releases the managed lock. Wraps `rbd_lock_release`.
    pub fn lock_release(&self) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_lock_release(self.raw()) };
        self.cvt(ret, "rbd_lock_release")?;
        Ok(())
    }

    /// True when this handle owns the exclusive lock. Wraps
    /// `rbd_is_exclusive_lock_owner`.
    pub fn is_exclusive_lock_owner(&self) -> Result<bool> {
        let mut owner = 0i32;
        // SAFETY: the image is open; valid out-pointer.
        let ret = unsafe { sys::rbd_is_exclusive_lock_owner(self.raw(), &mut owner) };
        self.cvt(ret, "rbd_is_exclusive_lock_owner")?;
        Ok(owner != 0)
    }

    /// The owners of the managed lock and its mode (empty when unlocked).
    /// Wraps `rbd_lock_get_owners`.
    pub fn lock_owners(&self) -> Result<(LockMode, Vec<String>)> {
        let mut max = 8usize;
        loop {
            let mut owners: Vec<*mut std::os::raw::c_char> = vec![ptr::null_mut(); max];
            let mut n = max;
            let mut mode: sys::rbd_lock_mode_t = sys::RBD_LOCK_MODE_EXCLUSIVE;
            // SAFETY: `owners` has room for `n` pointers; on -ERANGE librbd
            // sets `n` to what it needs.
            let ret = unsafe {
                sys::rbd_lock_get_owners(self.raw(), &mut mode, owners.as_mut_ptr(), &mut n)
            };
            if ret == -libc::ENOENT {
                return Ok((LockMode::Exclusive, Vec::new()));
            }
            if ret == -libc::ERANGE && n > max && n <= 1 << 16 {
                max = n;
                continue;
            }
            self.cvt(ret, "rbd_lock_get_owners")?;
            let n = n.min(max);
            // SAFETY: librbd filled the first `n` pointers with C strings.
            let names = owners[..n]
                .iter()
                .map(|p| unsafe { from_cstr(*p) })
                .collect();
            // SAFETY: frees the `n` strings librbd allocated, once.
            unsafe { sys::rbd_lock_get_owners_cleanup(owners.as_mut_ptr(), n) };
            let mode = if mode == sys::RBD_LOCK_MODE_SHARED {
                LockMode::Shared
            } else {
                LockMode::Exclusive
            };
            return Ok((mode, names));
        }
    }

    /// Breaks a managed lock held by `owner`. Wraps `rbd_lock_break`.
    pub fn lock_break(&self, mode: LockMode, owner: &str) -> Result<()> {
        let o = cstr(owner, "rbd_lock_break", "lock owner")?;
        // SAFETY: the image is open; `o` is NUL-terminated.
        let ret = unsafe { sys::rbd_lock_break(self.raw(), mode.raw(), o.as_ptr()) };
        self.cvt(ret, "rbd_lock_break")?;
        Ok(())
    }

    /// Takes an advisory exclusive lock. Wraps `rbd_lock_exclusive`.
    pub fn lock_exclusive(&self, cookie: &str) -> Result<()> {
        let c = cstr(cookie, "rbd_lock_exclusive", "lock cookie")?;
        // SAFETY: the image is open; `c` is NUL-terminated.
        let ret = unsafe { sys::rbd_lock_exclusive(self.raw(), c.as_ptr()) };
        self.cvt(ret, "rbd_lock_exclusive")?;
        Ok(())
    }

    /// Takes an advisory shared lock. Wraps `rbd_lock_shared`.
    pub fn lock_shared(&self, cookie: &str, tag: &str) -> Result<()> {
        let c = cstr(cookie, "rbd_lock_shared", "lock cookie")?;
        let t = cstr(tag, "rbd_lock_shared", "lock tag")?;
        // SAFETY: the image is open; both strings are NUL-terminated.
        let ret = unsafe { sys::rbd_lock_shared(self.raw(), c.as_ptr(), t.as_ptr()) };
        self.cvt(ret, "rbd_lock_shared")?;
        Ok(())
    }

    /// Releases this client's advisory lock. Wraps `rbd_unlock`.
    pub fn unlock(&self, cookie: &str) -> Result<()> {
        let c = cstr(cookie, "rbd_unlock", "lock cookie")?;
        // SAFETY: the image is open; `c` is NUL-terminated.
        let ret = unsafe { sys::rbd_unlock(self.raw(), c.as_ptr()) };
        self.cvt(ret, "rbd_unlock")?;
        Ok(())
    }

    /// Breaks another client's advisory lock. Wraps `rbd_break_lock`.
    pub fn break_lock(&self, client: &str, cookie: &str) -> Result<()> {
        let cl = cstr(client, "rbd_break_lock", "lock client")?;
        let c = cstr(cookie, "rbd_break_lock", "lock cookie")?;
        // SAFETY: the image is open; both strings are NUL-terminated.
        let ret = unsafe { sys::rbd_break_lock(self.raw(), cl.as_ptr(), c.as_ptr()) };
        self.cvt(ret, "rbd_break_lock")?;
        Ok(())
    }

    /// Lists the advisory lock holders. Wraps `rbd_list_lockers`.
    pub fn lockers(&self) -> Result<Lockers> {
        let mut size = 1024usize;
        loop {
            let (mut tag, mut clients, mut cookies, mut addrs) = (
                vec![0u8; size],
                vec![0u8; size],
                vec![0u8; size],
                vec![0u8; size],
            );
            let (mut tl, mut cl, mut ckl, mut al) = (size, size, size, size);
            let mut exclusive = 0i32;
            // SAFETY: each buffer is writable for the length passed with it;
            // on -ERANGE librbd sets each length to what it needs.
            let ret = unsafe {
                sys::rbd_list_lockers(
                    self.raw(),
                    &mut exclusive,
                    tag.as_mut_ptr().cast(),
                    &mut tl,
                    clients.as_mut_ptr().cast(),
                    &mut cl,
                    cookies.as_mut_ptr().cast(),
                    &mut ckl,
                    addrs.as_mut_ptr().cast(),
                    &mut al,
                )
            };
            if ret == -(libc::ERANGE as isize) {
                let need = tl.max(cl).max(ckl).max(al);
                if need > size && need <= crate::util::MAX_BUFFER {
                    size = need;
                    continue;
                }
            }
            let count = self.cvt(ret, "rbd_list_lockers")?;
            if count == 0 {
                return Ok(Lockers::default());
            }
            tag.truncate(tl.min(size));
            clients.truncate(cl.min(size));
            cookies.truncate(ckl.min(size));
            addrs.truncate(al.min(size));
            let clients = split_nul_list(&clients);
            let cookies = split_nul_list(&cookies);
            let addrs = split_nul_list(&addrs);
            let lockers = clients
                .into_iter()
                .enumerate()
                .map(|(i, client)| Locker {
                    client,
                    cookie: cookies.get(i).cloned().unwrap_or_default(),
                    addr: addrs.get(i).cloned().unwrap_or_default(),
                })
                .collect();
            return Ok(Lockers {
                exclusive: exclusive != 0,
                tag: crate::util::string_from_buf(&tag),
                lockers,
            });
        }
    }
}
