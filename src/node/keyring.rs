//! The kernel keyring, for the cephx key the kernel rbd client uses.
//!
//! krbd's `key=client.<id>` option makes libceph look up a key of type
//! `ceph` named `client.<id>` in the keyrings of the process that writes
//! the sysfs `add` file. Its payload is the binary cephx key, the base64
//! key decoded (`ceph_crypto_key_decode` in the kernel's
//! `net/ceph/crypto.c`), and Ceph's own tools add it to the process
//! keyring (`set_kernel_secret` in Ceph's `common/secret.c`). libceph copies
//! the key when it parses the options, so it can be removed right after.
//!
//! The process keyring is held in the credentials of the thread that made
//! it, so the key must be added by the thread that then writes the sysfs
//! file; the krbd mapper does both in one call on one thread.
//!
//! Without libceph loaded the `ceph` key type is not registered and
//! `add_key(2)` answers `ENODEV`; the caller then falls back to `secret=`.

use crate::error::{Error, Result};
use crate::rados::Secret;

/// The key type libceph registers.
pub const CEPH_KEY_TYPE: &str = "ceph";

/// Which keyring a key goes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keyring {
    /// `KEY_SPEC_PROCESS_KEYRING`: shared by this process's threads, gone
    /// with the process (what Ceph's tools use).
    Process,
    /// `KEY_SPEC_SESSION_KEYRING`.
    Session,
    /// `KEY_SPEC_USER_KEYRING`.
    User,
}

impl Keyring {
    fn spec(self) -> i32 {
        match self {
            Keyring::Process => libc::KEY_SPEC_PROCESS_KEYRING,
            Keyring::Session => libc::KEY_SPEC_SESSION_KEYRING,
            Keyring::User => libc::KEY_SPEC_USER_KEYRING,
        }
    }
}

/// A key's serial number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySerial(pub i32);

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn cstring(s: &str, op: &'static str) -> Result<std::ffi::CString> {
    std::ffi::CString::new(s).map_err(|_| Error::invalid(op, s, "contains a NUL byte"))
}

/// `add_key(2)`: adds (or updates) a key of `key_type` named `description`
/// with `payload` to `keyring`.
pub fn add_key(
    key_type: &str,
    description: &str,
    payload: &[u8],
    keyring: Keyring,
) -> Result<KeySerial> {
    let t = cstring(key_type, "add_key")?;
    let d = cstring(description, "add_key")?;
    // SAFETY: add_key(2) takes two NUL-terminated strings, a payload pointer
    // with its length, and a keyring id; all live for the call, and it
    // returns the serial or -1 with errno.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_add_key,
            t.as_ptr(),
            d.as_ptr(),
            payload.as_ptr().cast::<libc::c_void>(),
            payload.len(),
            keyring.spec(),
        )
    };
    if ret < 0 {
        let errno = last_errno();
        let e = Error::from_errno(errno, "add_key", format!("{key_type} key {description}"));
        return Err(if errno == libc::ENODEV {
            e.detail(format!(
                "the kernel has no {key_type:?} key type (for \"ceph\": libceph is not loaded)"
            ))
        } else {
            e
        });
    }
    Ok(KeySerial(ret as i32))
}

/// `keyctl(KEYCTL_SEARCH)`: the key of `key_type` named `description` in
/// `keyring` (and keyrings linked from it), if any.
pub fn search(key_type: &str, description: &str, keyring: Keyring) -> Result<Option<KeySerial>> {
    let t = cstring(key_type, "keyctl(KEYCTL_SEARCH)")?;
    let d = cstring(description, "keyctl(KEYCTL_SEARCH)")?;
    // SAFETY: keyctl(2) KEYCTL_SEARCH takes a keyring id, two NUL-terminated
    // strings live for the call and a destination keyring (0: none).
    let ret = unsafe {
        libc::syscall(
            libc::SYS_keyctl,
            libc::KEYCTL_SEARCH,
            keyring.spec(),
            t.as_ptr(),
            d.as_ptr(),
            0,
        )
    };
    if ret < 0 {
        return match last_errno() {
            libc::ENOKEY | libc::ENOENT => Ok(None),
            errno => Err(Error::from_errno(
                errno,
                "keyctl(KEYCTL_SEARCH)",
                format!("{key_type} key {description}"),
            )),
        };
    }
    Ok(Some(KeySerial(ret as i32)))
}

/// `keyctl(KEYCTL_READ)`: the payload of a key (for key types that allow
/// reading it back, such as `user`).
pub fn read(serial: KeySerial) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: keyctl(2) KEYCTL_READ writes at most `len` bytes to the
        // buffer and returns the payload's full size; the buffer lives for
        // the call.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_keyctl,
                libc::KEYCTL_READ,
                serial.0,
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        if ret < 0 {
            return Err(Error::from_errno(
                last_errno(),
                "keyctl(KEYCTL_READ)",
                format!("key {}", serial.0),
            ));
        }
        let n = ret as usize;
        if n <= buf.len() {
            buf.truncate(n);
            return Ok(buf);
        }
        buf.resize(n, 0);
    }
}

/// `keyctl(KEYCTL_UNLINK)`: removes a key from `keyring` (the kernel frees
/// it once nothing links it).
pub fn unlink(serial: KeySerial, keyring: Keyring) -> Result<()> {
    // SAFETY: keyctl(2) KEYCTL_UNLINK takes two integer ids and no pointers.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_keyctl,
            libc::KEYCTL_UNLINK,
            serial.0,
            keyring.spec(),
        )
    };
    if ret < 0 {
        return Err(Error::from_errno(
            last_errno(),
            "keyctl(KEYCTL_UNLINK)",
            format!("key {}", serial.0),
        ));
    }
    Ok(())
}

fn keyctl(op: u32, a: libc::c_long, b: libc::c_long, what: &str) -> Result<()> {
    // SAFETY: the keyctl(2) operations used here (SETPERM, SET_TIMEOUT,
    // LINK) take integer arguments only, no pointers.
    let ret = unsafe { libc::syscall(libc::SYS_keyctl, op, a, b) };
    if ret < 0 {
        return Err(Error::from_errno(last_errno(), "keyctl", what.to_owned()));
    }
    Ok(())
}

/// The permissions of a kept key: all for its possessor; view, read and
/// search for processes of its owner's uid (root), which is how a restarted
/// process, possessing nothing of the old one's, finds it.
const KEPT_PERM: libc::c_long = 0x3f0b_0000;

/// How long a kept key lives unless kept again.
pub const KEPT_FOR: std::time::Duration = std::time::Duration::from_secs(400 * 24 * 3600);

fn kept_name(scope: &str, user: &str) -> String {
    format!("rbdkit:{scope}:{user}")
}

/// Keeps `user`'s cephx `key` for `scope` (a driver and cluster) in this
/// uid's user keyring, in kernel memory only (never on disk), for
/// [`KEPT_FOR`], replacing an older one. A `user`-type key, added to the
/// process keyring first so that this thread possesses it while it sets
/// its permissions (processes of this uid may view, search and read it)
/// and timeout, then linked into the user keyring and unlinked from the
/// process keyring. All on this thread (the process keyring lives in its
/// credentials).
pub fn keep_key(scope: &str, user: &str, key: &Secret) -> Result<()> {
    let name = kept_name(scope, user);
    let serial = add_key("user", &name, key.expose().as_bytes(), Keyring::Process)?;
    let s = libc::c_long::from(serial.0);
    let linked = keyctl(libc::KEYCTL_SETPERM, s, KEPT_PERM, &name)
        .and_then(|()| {
            keyctl(
                libc::KEYCTL_SET_TIMEOUT,
                s,
                KEPT_FOR.as_secs() as libc::c_long,
                &name,
            )
        })
        .and_then(|()| {
            keyctl(
                libc::KEYCTL_LINK,
                s,
                libc::c_long::from(Keyring::User.spec()),
                &name,
            )
        });
    let _ = unlink(serial, Keyring::Process);
    linked
}

/// The key [`keep_key`] kept for `scope` and `user`, if it is still there.
pub fn kept_key(scope: &str, user: &str) -> Result<Option<Secret>> {
    let name = kept_name(scope, user);
    let Some(serial) = search("user", &name, Keyring::User)? else {
        return Ok(None);
    };
    match String::from_utf8(read(serial)?) {
        Ok(key) => Ok(Some(Secret::new(key))),
        Err(e) => {
            crate::rados::zeroize(&mut e.into_bytes());
            Err(Error::invalid("keyctl(KEYCTL_READ)", &name, "not UTF-8"))
        }
    }
}

/// Drops the key [`keep_key`] kept for `scope` and `user`; a no-op when
/// there is none.
pub fn forget_key(scope: &str, user: &str) -> Result<()> {
    match search("user", &kept_name(scope, user), Keyring::User)? {
        Some(serial) => match unlink(serial, Keyring::User) {
            Err(e) if e.is_not_found() || e.errno() == libc::ENOKEY => Ok(()),
            other => other,
        },
        None => Ok(()),
    }
}

/// The key name krbd's `key=` option refers to: `client.<user>`.
pub fn key_name(user: &str) -> String {
    format!("client.{user}")
}

/// Adds the cephx `key` of `user` as a `key_type` key named
/// `client.<user>` to the process keyring, payload the decoded key.
pub(crate) fn add_cephx(key_type: &str, user: &str, key: &Secret) -> Result<KeySerial> {
    let mut payload = decode_base64(key.expose(), &key_name(user))?;
    let ret = add_key(key_type, &key_name(user), &payload, Keyring::Process);
    // Volatile writes: a plain loop before the free is a dead store the
    // compiler may drop.
    crate::rados::zeroize(&mut payload);
    ret
}

/// Adds `user`'s cephx key to the process keyring as the `ceph` key
/// `client.<user>`, for krbd's `key=client.<user>` option.
pub fn add_ceph_key(user: &str, key: &Secret) -> Result<KeySerial> {
    add_cephx(CEPH_KEY_TYPE, user, key)
}

/// Removes the `key_type` key `client.<user>` from the process keyring; a
/// no-op when it is not there.
pub(crate) fn remove_cephx(key_type: &str, user: &str) -> Result<()> {
    match search(key_type, &key_name(user), Keyring::Process)? {
        Some(serial) => match unlink(serial, Keyring::Process) {
            Err(e) if e.is_not_found() || e.errno() == libc::ENOKEY => Ok(()),
            other => other,
        },
        None => Ok(()),
    }
}

/// Removes the `ceph` key `client.<user>` from the process keyring.
pub fn remove_ceph_key(user: &str) -> Result<()> {
    remove_cephx(CEPH_KEY_TYPE, user)
}

/// Decodes standard base64 (with `=` padding, surrounding whitespace
/// ignored). The error names `what` and never the value.
pub(crate) fn decode_base64(text: &str, what: &str) -> Result<Vec<u8>> {
    fn val(c: u8) -> Option<u32> {
        match c {
            b'A'..=b'Z' => Some((c - b'A') as u32),
            b'a'..=b'z' => Some((c - b'a') as u32 + 26),
            b'0'..=b'9' => Some((c - b'0') as u32 + 52),
            b'+' => Some(62),
            b'/' => Some(63),
            _ => None,
        }
    }
    let bad = |why: String| {
        Error::invalid(
            "base64 decode",
            what,
            format!("the key is not valid base64: {why}"),
        )
    };
    let s = text.trim().as_bytes();
    if s.is_empty() {
        return Err(bad("it is empty".into()));
    }
    if !s.len().is_multiple_of(4) {
        return Err(bad(format!(
            "its length {} is not a multiple of 4",
            s.len()
        )));
    }
    // Sized up front: a reallocation would leave a copy of the key behind.
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let chunks = s.len() / 4;
    for (i, chunk) in s.chunks(4).enumerate() {
        let last = i + 1 == chunks;
        let pad = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            crate::rados::zeroize(&mut out);
            return Err(bad(format!("misplaced padding in group {}", i + 1)));
        }
        let mut n = 0u32;
        for (j, &c) in chunk[..4 - pad].iter().enumerate() {
            let Some(v) = val(c) else {
                crate::rados::zeroize(&mut out);
                return Err(bad(format!("bad character at offset {}", i * 4 + j)));
            };
            n |= v << (18 - 6 * j);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_base64_like_the_reference() {
        assert_eq!(decode_base64("aGVsbG8=", "k").unwrap(), b"hello");
        assert_eq!(decode_base64("aGVsbG8h", "k").unwrap(), b"hello!");
        assert_eq!(decode_base64(" aGk= \n", "k").unwrap(), b"hi");
        assert_eq!(decode_base64("/+8=", "k").unwrap(), [0xff, 0xef]);
        // A cephx key: type 1 (AES), created, length 16, the 16 key bytes.
        let key = decode_base64("AQBzmwlnAAAAABAAcHyFYS4mxn8Z2x0Tk3nIrA==", "k").unwrap();
        assert_eq!(key.len(), 28);
        assert_eq!(&key[..2], &[1, 0]);
        assert_eq!(&key[10..12], &[16, 0]);
    }

    #[test]
    fn base64_errors_never_echo_the_key() {
        for bad in ["AQB*bwln", "AQB", "AQ==AQ==", "A===", ""] {
            let e = decode_base64(bad, "client.x key").unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains("client.x key"), "{msg}");
            if !bad.is_empty() {
                assert!(!msg.contains(bad), "{msg} echoes {bad}");
            }
        }
    }

    #[test]
    fn a_user_key_round_trips_through_the_process_keyring() {
        let secret = Secret::new("AQBzmwlnAAAAABAAcHyFYS4mxn8Z2x0Tk3nIrA==");
        let user = format!("rbdkit-test-{}", std::process::id());
        let serial = add_cephx("user", &user, &secret).unwrap();
        let found = search("user", &key_name(&user), Keyring::Process).unwrap();
        assert_eq!(found, Some(serial));
        let payload = read(serial).unwrap();
        assert_eq!(payload, decode_base64(secret.expose(), "k").unwrap());
        // Adding again updates the same key.
        assert_eq!(add_cephx("user", &user, &secret).unwrap(), serial);
        remove_cephx("user", &user).unwrap();
        assert_eq!(
            search("user", &key_name(&user), Keyring::Process).unwrap(),
            None
        );
        remove_cephx("user", &user).unwrap();
    }

    #[test]
    fn the_ceph_key_type_needs_libceph() {
        let secret = Secret::new("AQBzmwlnAAAAABAAcHyFYS4mxn8Z2x0Tk3nIrA==");
        let user = format!("rbdkit-ceph-{}", std::process::id());
        if std::path::Path::new("/sys/module/libceph").exists() {
            add_ceph_key(&user, &secret).unwrap();
            remove_ceph_key(&user).unwrap();
        } else {
            // This machine kind: no libceph, so no "ceph" key type.
            let e = add_ceph_key(&user, &secret).unwrap_err();
            assert_eq!(e.errno(), libc::ENODEV, "{e}");
            let msg = e.to_string();
            assert!(msg.contains("libceph is not loaded"), "{msg}");
            assert!(msg.contains(&format!("client.{user}")), "{msg}");
            assert!(!msg.contains(secret.expose()), "{msg}");
        }
        let e = add_ceph_key(&user, &Secret::new("not base64!")).unwrap_err();
        assert!(!e.to_string().contains("not base64!"), "{e}");
    }
}
