//! Advisory object locks (the OSD's `cls_lock` class): named locks on one
//! object, exclusive or shared, each holder known by its (client, cookie)
//! pair.
//!
//! The OSD takes and releases a lock atomically, in one operation on the
//! object, so two clients racing for an exclusive lock cannot both get it.
//! A lock taken without a duration stays until it is released or broken: it
//! outlives the client that took it (a crash, a restart), which is what a
//! guard that must survive `kill -9` needs, and why a holder that is gone
//! must be fenced (blocklisted) before its lock is broken.
//!
//! Each call is one OSD operation, bounded by the connection's
//! `rados_osd_op_timeout` like every other object call.

use std::os::raw::c_char;
use std::ptr;

use rbd_sys as sys;

use crate::error::{cvt, Result};
use crate::rados::IoCtx;
use crate::util::{cstr, split_nul_list, string_from_buf};

/// One holder of an object lock, from `rados_list_lockers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectLocker {
    /// The client entity (`client.4123`).
    pub client: String,
    /// The cookie it took the lock with.
    pub cookie: String,
    /// The client's address (`ip:port/nonce`), as `osd blocklist` takes it.
    pub addr: String,
}

/// A named lock on an object and its holders (none when it is free).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObjectLockers {
    /// True when held exclusively.
    pub exclusive: bool,
    /// The tag the holders share (shared locks).
    pub tag: String,
    /// The holders.
    pub lockers: Vec<ObjectLocker>,
}

impl IoCtx {
    fn lock_names(
        &self,
        op: &'static str,
        oid: &str,
        name: &str,
    ) -> Result<(std::ffi::CString, std::ffi::CString)> {
        Ok((cstr(oid, op, "object name")?, cstr(name, op, "lock name")?))
    }

    /// Takes the exclusive lock `name` on object `oid` as (this client,
    /// `cookie`), for no set duration. Fails with `Busy` (`EBUSY`) when
    /// another (client, cookie) holds it and with `AlreadyExists`
    /// (`EEXIST`) when this pair holds it already. Wraps
    /// `rados_lock_exclusive`.
    pub fn lock_exclusive(
        &self,
        oid: &str,
        name: &str,
        cookie: &str,
        description: &str,
    ) -> Result<()> {
        let op = "rados_lock_exclusive";
        let (o, n) = self.lock_names(op, oid, name)?;
        let c = cstr(cookie, op, "lock cookie")?;
        let d = cstr(description, op, "lock description")?;
        // SAFETY: librados.h: the strings are read during the call only;
        // a NULL duration means the lock does not expire; flags 0. The ioctx
        // is live and its settings are never changed (see IoCtxHandle).
        let ret = unsafe {
            sys::rados_lock_exclusive(
                self.raw(),
                o.as_ptr(),
                n.as_ptr(),
                c.as_ptr(),
                d.as_ptr(),
                ptr::null_mut(),
                0,
            )
        };
        cvt(ret, op, || self.lock_spec(oid, name))?;
        Ok(())
    }

    /// Takes the shared lock `name` on object `oid` as (this client,
    /// `cookie`) with `tag`, for no set duration. Holders of a shared lock
    /// all use one tag; `Busy` when it is held exclusively or with another
    /// tag, `AlreadyExists` when this pair holds it already. Wraps
    /// `rados_lock_shared`.
    pub fn lock_shared(
        &self,
        oid: &str,
        name: &str,
        cookie: &str,
        tag: &str,
        description: &str,
    ) -> Result<()> {
        let op = "rados_lock_shared";
        let (o, n) = self.lock_names(op, oid, name)?;
        let c = cstr(cookie, op, "lock cookie")?;
        let t = cstr(tag, op, "lock tag")?;
        let d = cstr(description, op, "lock description")?;
        // SAFETY: as for rados_lock_exclusive: strings read during the call,
        // NULL duration (no expiry), flags 0, a live ioctx.
        let ret = unsafe {
            sys::rados_lock_shared(
                self.raw(),
                o.as_ptr(),
                n.as_ptr(),
                c.as_ptr(),
                t.as_ptr(),
                d.as_ptr(),
                ptr::null_mut(),
                0,
            )
        };
        cvt(ret, op, || self.lock_spec(oid, name))?;
        Ok(())
    }

    /// Releases the lock `name` held by (this client, `cookie`). `NotFound`
    /// (`ENOENT`) when this pair does not hold it (another client that took
    /// it with the same cookie must break it). Wraps `rados_unlock`.
    pub fn unlock(&self, oid: &str, name: &str, cookie: &str) -> Result<()> {
        let op = "rados_unlock";
        let (o, n) = self.lock_names(op, oid, name)?;
        let c = cstr(cookie, op, "lock cookie")?;
        // SAFETY: librados.h: three strings read during the call; live ioctx.
        let ret = unsafe { sys::rados_unlock(self.raw(), o.as_ptr(), n.as_ptr(), c.as_ptr()) };
        cvt(ret, op, || self.lock_spec(oid, name))?;
        Ok(())
    }

    /// Removes the lock `name` held by (`client`, `cookie`), whoever that
    /// is. Breaking a live holder's lock does not stop it writing: fence it
    /// first ([`crate::rados::Cluster::blocklist_add`]). `NotFound` when
    /// that pair does not hold it. Wraps `rados_break_lock`.
    pub fn break_lock(&self, oid: &str, name: &str, client: &str, cookie: &str) -> Result<()> {
        let op = "rados_break_lock";
        let (o, n) = self.lock_names(op, oid, name)?;
        let cl = cstr(client, op, "lock client")?;
        let c = cstr(cookie, op, "lock cookie")?;
        // SAFETY: librados.h: four strings read during the call; `client`
        // is parsed by librados (EINVAL when it is not an entity name).
        let ret = unsafe {
            sys::rados_break_lock(self.raw(), o.as_ptr(), n.as_ptr(), cl.as_ptr(), c.as_ptr())
        };
        cvt(ret, op, || self.lock_spec(oid, name))?;
        Ok(())
    }

    /// The holders of lock `name` on `oid` (empty when nobody holds it).
    /// Wraps `rados_list_lockers`.
    pub fn lockers(&self, oid: &str, name: &str) -> Result<ObjectLockers> {
        let op = "rados_list_lockers";
        let (o, n) = self.lock_names(op, oid, name)?;
        let mut size = 1024usize;
        loop {
            let mut bufs = [vec![0u8; size], vec![0u8; size], vec![0u8; size]];
            let mut tag = vec![0u8; size];
            let (mut tl, mut cl, mut kl, mut al) = (size, size, size, size);
            let mut exclusive = 0i32;
            let [clients, cookies, addrs] = &mut bufs;
            // SAFETY: librados.h: each buffer is writable for the length
            // passed with it; on -ERANGE librados has set every length to
            // what it needs and written nothing we read.
            let ret = unsafe {
                sys::rados_list_lockers(
                    self.raw(),
                    o.as_ptr(),
                    n.as_ptr(),
                    &mut exclusive,
                    tag.as_mut_ptr() as *mut c_char,
                    &mut tl,
                    clients.as_mut_ptr() as *mut c_char,
                    &mut cl,
                    cookies.as_mut_ptr() as *mut c_char,
                    &mut kl,
                    addrs.as_mut_ptr() as *mut c_char,
                    &mut al,
                )
            };
            if ret == -(libc::ERANGE as isize) {
                let need = tl.max(cl).max(kl).max(al);
                if need > size && need <= crate::util::MAX_BUFFER {
                    size = need;
                    continue;
                }
            }
            let count = cvt(ret, op, || self.lock_spec(oid, name))? as usize;
            if count == 0 {
                return Ok(ObjectLockers::default());
            }
            let list = |b: &[u8], len: usize| split_nul_list(&b[..len.min(size)]);
            let clients = list(clients, cl);
            let cookies = list(cookies, kl);
            let addrs = list(addrs, al);
            let lockers = clients
                .into_iter()
                .enumerate()
                .map(|(i, client)| ObjectLocker {
                    client,
                    cookie: cookies.get(i).cloned().unwrap_or_default(),
                    addr: addrs.get(i).cloned().unwrap_or_default(),
                })
                .collect();
            return Ok(ObjectLockers {
                exclusive: exclusive != 0,
                tag: string_from_buf(&tag[..tl.min(size)]),
                lockers,
            });
        }
    }

    fn lock_spec(&self, oid: &str, name: &str) -> String {
        format!("{} lock {name:?}", self.object_spec(oid))
    }
}
