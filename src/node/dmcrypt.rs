//! dm-crypt over a krbd device, through cryptsetup: how krbd serves an
//! encrypted volume (rbdkit-fuse decrypts in its own data path instead).
//!
//! The passphrase reaches cryptsetup on its stdin (`--key-file=-`: all of
//! stdin is the key, no newline handling), never in argv or the
//! environment. The mapping is named after the volume id, so unstaging
//! finds it without a record; it is opened with `--disable-keyring` (the
//! volume key stays in the dm table, so a later `cryptsetup resize` needs
//! no passphrase), as ceph-csi opens its volumes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};
use crate::node::command::{self, run, run_with_input};
use crate::rados::Secret;

/// Bound on one cryptsetup run (its PBKDF takes seconds at most).
const TIMEOUT: Duration = Duration::from_secs(120);
const CRYPTSETUP: &str = "cryptsetup";

/// The dm name of volume `volume_id`'s mapping: `rbdkit-` and the id with
/// anything but letters, digits, `-`, `_` and `.` as `_`, cut (with a hash
/// of the whole id, to stay unique) to dm's 127-byte limit.
pub fn mapping_name(volume_id: &str) -> String {
    let clean: String = volume_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let name = format!("rbdkit-{clean}");
    if name.len() <= 100 {
        return name;
    }
    // FNV-1a: stable across versions, which a mapping must be.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in volume_id.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{}-{h:016x}", &name[..80])
}

/// The device of mapping `name`.
pub fn device_of(name: &str) -> PathBuf {
    Path::new("/dev/mapper").join(name)
}

/// The backing device of active mapping `name`, `None` when it is not
/// active.
pub fn backing(name: &str) -> Result<Option<PathBuf>> {
    if !device_of(name).exists() {
        return Ok(None);
    }
    let out = run(
        "cryptsetup status",
        CRYPTSETUP,
        &["status", name],
        name,
        TIMEOUT,
    )?;
    if !out.status.success() {
        return Ok(None);
    }
    Ok(out
        .stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("device:"))
        .map(|d| PathBuf::from(d.trim())))
}

/// Opens `device`'s LUKS header with `passphrase` as mapping `name` and
/// returns the mapping's device. An active mapping of `name` on the same
/// device is returned as it is; on another device it is an error.
pub fn open(device: &Path, name: &str, passphrase: &Secret) -> Result<PathBuf> {
    let dev = device.display().to_string();
    if let Some(b) = backing(name)? {
        if b == device {
            return Ok(device_of(name));
        }
        return Err(Error::with_kind(
            ErrorKind::AlreadyExists,
            libc::EEXIST,
            "cryptsetup open",
            name.to_owned(),
            format!(
                "the mapping is open on {}, not {dev}; unstage the volume first",
                b.display()
            ),
        ));
    }
    let out = run_with_input(
        "cryptsetup open",
        CRYPTSETUP,
        &[
            "open",
            "--type",
            "luks2",
            "--disable-keyring",
            "--key-file=-",
            &dev,
            name,
        ],
        &dev,
        TIMEOUT,
        Some(passphrase.expose().as_bytes()),
    )?;
    match out.code() {
        Some(0) => Ok(device_of(name)),
        // cryptsetup(8): 2 is "no permission (bad passphrase)".
        Some(2) => Err(Error::with_kind(
            ErrorKind::PermissionDenied,
            libc::EACCES,
            "cryptsetup open",
            dev,
            "no keyslot of its LUKS2 header opens with the passphrase from the KMS (wrong key)",
        )),
        _ => Err(command::failure("cryptsetup open", &dev, &out)),
    }
}

/// Closes mapping `name`; one that is not active is fine.
pub fn close(name: &str) -> Result<()> {
    if !device_of(name).exists() {
        return Ok(());
    }
    let out = run(
        "cryptsetup close",
        CRYPTSETUP,
        &["close", name],
        name,
        TIMEOUT,
    )?;
    if out.status.success() || !device_of(name).exists() {
        return Ok(());
    }
    let e = command::failure("cryptsetup close", name, &out);
    if out.stderr.contains("busy") || out.stderr.contains("in use") {
        return Err(Error::with_kind(
            ErrorKind::Busy,
            libc::EBUSY,
            "cryptsetup close",
            name.to_owned(),
            format!("the mapping is still open or mounted: {e}"),
        ));
    }
    Err(e)
}

/// Grows mapping `name` to its device's size (after the image grew).
pub fn resize(name: &str) -> Result<()> {
    let out = run(
        "cryptsetup resize",
        CRYPTSETUP,
        &["resize", name],
        name,
        TIMEOUT,
    )?;
    command::check("cryptsetup resize", name, out).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_names_are_safe_unique_and_short() {
        assert_eq!(
            mapping_name("rbdkit1/c/rbd//pvc-1"),
            "rbdkit-rbdkit1_c_rbd__pvc-1"
        );
        let long_a = format!("rbdkit1/c/rbd//{}a", "x".repeat(150));
        let long_b = format!("rbdkit1/c/rbd//{}b", "x".repeat(150));
        let (a, b) = (mapping_name(&long_a), mapping_name(&long_b));
        assert_ne!(a, b);
        assert!(a.len() <= 127 && b.len() <= 127);
        assert_eq!(a, mapping_name(&long_a));
    }
}
