//! Filesystems on a mapped device, with the node's e2fsprogs and xfsprogs:
//! probing (`blkid`), making (`mkfs.ext4`, `mkfs.xfs`), growing
//! (`resize2fs`, `xfs_growfs`), usage (`statvfs(3)`) and the device size
//! (`ioctl(BLKGETSIZE64)`).
//!
//! A device is formatted only when blank: one that already holds a
//! filesystem of another type, or a partition table, is an error and is
//! never reformatted.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Duration;

use super::command::{self, check};
use crate::error::{Error, ErrorKind, Result};

/// Bound on `blkid`.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on `mkfs.*` (lazy init and `-K` keep it short even on big devices).
pub const MKFS_TIMEOUT: Duration = Duration::from_secs(600);
/// Bound on `resize2fs` / `xfs_growfs`.
pub const GROW_TIMEOUT: Duration = Duration::from_secs(600);

/// Filesystem types this node formats and grows.
pub const SUPPORTED: &[&str] = &["ext4", "ext3", "ext2", "xfs"];

/// What `blkid` found on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Nothing: safe to format.
    Blank,
    /// A filesystem (or another signature blkid names by `TYPE`, such as
    /// `LVM2_member` or `crypto_LUKS`).
    Filesystem(String),
    /// A partition table (`PTTYPE`: `dos`, `gpt`).
    PartitionTable(String),
}

/// Probes `device` with `blkid -p -o export` (low-level probing, no cache).
/// blkid's exit code 2 means it found nothing: [`Probe::Blank`].
pub fn probe(device: &Path) -> Result<Probe> {
    let dev = device.display().to_string();
    // blkid also exits 2 when it cannot open the device: make sure it can.
    let md = std::fs::File::open(device)
        .and_then(|f| f.metadata())
        .map_err(|e| {
            Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), "blkid", dev.clone())
                .detail(format!("cannot open the device: {e}"))
        })?;
    let ft = md.file_type();
    if !ft.is_block_device() && !ft.is_file() {
        return Err(Error::from_errno(libc::ENOTBLK, "blkid", dev).detail("not a block device"));
    }
    let out = command::run(
        "blkid",
        "blkid",
        &["-p", "-o", "export", &dev],
        &dev,
        PROBE_TIMEOUT,
    )?;
    if out.code() == Some(2) {
        return Ok(Probe::Blank);
    }
    let out = check("blkid", &dev, out)?;
    let value = |key: &str| {
        out.stdout
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
            .map(str::to_owned)
    };
    if let Some(t) = value("TYPE") {
        return Ok(Probe::Filesystem(t));
    }
    if let Some(t) = value("PTTYPE") {
        return Ok(Probe::PartitionTable(t));
    }
    // Something was found (exit 0) but neither kind: never treat as blank.
    Err(Error::from_errno(libc::EIO, "blkid", dev).detail(format!(
        "found a signature that is neither a filesystem nor a partition table: {}",
        out.stdout.trim().replace('\n', " ")
    )))
}

fn check_fstype(fstype: &str, op: &'static str, device: &str) -> Result<()> {
    if SUPPORTED.contains(&fstype) {
        return Ok(());
    }
    Err(Error::invalid(
        op,
        device,
        format!(
            "filesystem type {fstype:?} is not supported (supported: {})",
            SUPPORTED.join(", ")
        ),
    ))
}

/// The `mkfs` options used when the StorageClass gives none, as ceph-csi:
/// no reserved blocks, no discard at mkfs time and lazy inode table and
/// journal init for ext4 (fast on a thin RBD image); no discard for xfs.
pub fn default_mkfs_options(fstype: &str) -> Vec<String> {
    let opts: &[&str] = match fstype {
        "ext4" | "ext3" | "ext2" => &["-m0", "-Enodiscard,lazy_itable_init=1,lazy_journal_init=1"],
        "xfs" => &["-K"],
        _ => &[],
    };
    opts.iter().map(|s| (*s).to_owned()).collect()
}

/// Splits the StorageClass parameter `mkfsOptions` on whitespace, like
/// ceph-csi. An empty or blank value means "use the defaults".
pub fn parse_mkfs_options(value: &str) -> Vec<String> {
    value.split_whitespace().map(str::to_owned).collect()
}

/// Makes an `fstype` filesystem on `device` if, and only if, it is blank.
///
/// `mkfs_options` replace [`default_mkfs_options`] when not empty. Returns
/// `true` when it formatted, `false` when `device` already held an `fstype`
/// filesystem (the data is kept). Another filesystem type or a partition
/// table is an error, never reformatted.
pub fn make_fs<S: AsRef<str>>(device: &Path, fstype: &str, mkfs_options: &[S]) -> Result<bool> {
    let dev = device.display().to_string();
    let op = mkfs_op(fstype);
    check_fstype(fstype, op, &dev)?;
    match probe(device)? {
        Probe::Blank => {}
        Probe::Filesystem(t) if t == fstype => return Ok(false),
        Probe::Filesystem(t) => {
            return Err(Error::from_errno(libc::EEXIST, op, dev).detail(format!(
                "the device already holds a {t} filesystem, not {fstype}; refusing to reformat it"
            )))
        }
        Probe::PartitionTable(t) => {
            return Err(Error::from_errno(libc::EEXIST, op, dev).detail(format!(
                "the device holds a {t} partition table; refusing to format it"
            )))
        }
    }
    let mut args: Vec<String> = if mkfs_options.is_empty() {
        default_mkfs_options(fstype)
    } else {
        mkfs_options.iter().map(|s| s.as_ref().to_owned()).collect()
    };
    if fstype != "xfs" {
        // mke2fs asks before formatting a whole disk; stdin is /dev/null.
        args.insert(0, "-F".to_owned());
    }
    args.push(dev.clone());
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = command::run(op, op, &argv, &dev, MKFS_TIMEOUT)?;
    check(op, &dev, out)?;
    Ok(true)
}

fn mkfs_op(fstype: &str) -> &'static str {
    match fstype {
        "ext4" => "mkfs.ext4",
        "ext3" => "mkfs.ext3",
        "ext2" => "mkfs.ext2",
        "xfs" => "mkfs.xfs",
        _ => "mkfs",
    }
}

/// The mount options to use for `fstype`: `options` plus what the type
/// needs. xfs always gets `nouuid`, because a clone or a restored snapshot
/// carries the same filesystem UUID as its parent and xfs refuses to mount
/// a second filesystem with a UUID already mounted.
pub fn mount_options<S: AsRef<str>>(fstype: &str, options: &[S]) -> Vec<String> {
    let mut out: Vec<String> = options.iter().map(|s| s.as_ref().to_owned()).collect();
    if fstype == "xfs" && !out.iter().flat_map(|o| o.split(',')).any(|o| o == "nouuid") {
        out.push("nouuid".to_owned());
    }
    out
}

/// Probes the device, formats it if blank, and mounts it at `target` with
/// [`mount_options`]: what NodeStageVolume does with a mount volume.
pub fn format_and_mount<S: AsRef<str>, T: AsRef<str>>(
    device: &Path,
    target: &Path,
    fstype: &str,
    mkfs_options: &[S],
    options: &[T],
) -> Result<()> {
    // Skip the probe when it is mounted already (blkid can be slow on a busy
    // device, and a mounted device is never blank).
    if let Some(m) = super::mount::mounted_at(target)? {
        if m.fstype == fstype {
            return super::mount::ensure_mounted(
                device,
                target,
                fstype,
                &mount_options(fstype, options),
            );
        }
    }
    make_fs(device, fstype, mkfs_options)?;
    super::mount::ensure_mounted(device, target, fstype, &mount_options(fstype, options))
}

/// Grows the filesystem on `device` to fill the device: `resize2fs
/// <device>` for ext2/3/4 (online when mounted, which needs
/// `CAP_SYS_RESOURCE`; offline after `e2fsck -f -p` when not), `xfs_growfs
/// -d <mount_point>` for xfs (which must be mounted at `mount_point`). A
/// no-op when it already fills the device.
pub fn grow(device: &Path, mount_point: &Path, fstype: &str) -> Result<()> {
    let dev = device.display().to_string();
    match fstype {
        "ext4" | "ext3" | "ext2" => {
            if super::mount::mounts_of_device(device)?.is_empty() {
                // Offline, resize2fs insists on a freshly checked filesystem.
                // -p fixes only what is safe to fix unattended.
                let out =
                    command::run("e2fsck", "e2fsck", &["-f", "-p", &dev], &dev, GROW_TIMEOUT)?;
                if !matches!(out.code(), Some(0) | Some(1)) {
                    return Err(command::failure("e2fsck", &dev, &out));
                }
            }
            let out = command::run("resize2fs", "resize2fs", &[&dev], &dev, GROW_TIMEOUT)?;
            if out.code() == Some(1) && out.stderr.contains("Permission denied to resize") {
                // The kernel's online resize needs CAP_SYS_RESOURCE.
                return Err(Error::with_kind(
                    ErrorKind::PermissionDenied,
                    libc::EPERM,
                    "resize2fs",
                    dev,
                    "the kernel refused the online resize: it needs CAP_SYS_RESOURCE, \
                     which this process lacks",
                ));
            }
            check("resize2fs", &dev, out).map(drop)
        }
        "xfs" => {
            let mp = mount_point.display().to_string();
            let out = command::run("xfs_growfs", "xfs_growfs", &["-d", &mp], &mp, GROW_TIMEOUT)?;
            check("xfs_growfs", &mp, out).map(drop)
        }
        other => Err(Error::invalid(
            "grow",
            dev,
            format!(
                "filesystem type {other:?} cannot be grown (supported: {})",
                SUPPORTED.join(", ")
            ),
        )),
    }
}

/// Usage of the filesystem holding `path`, from `statvfs(3)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsStats {
    /// Size of the filesystem in bytes.
    pub total_bytes: u64,
    /// Bytes an unprivileged user may still write.
    pub available_bytes: u64,
    /// Bytes in use (total less free, reserved blocks counted as free).
    pub used_bytes: u64,
    /// Inodes in total.
    pub total_inodes: u64,
    /// Free inodes.
    pub free_inodes: u64,
    /// Inodes in use.
    pub used_inodes: u64,
}

/// `statvfs(3)` on `path`.
pub fn stats(path: &Path) -> Result<FsStats> {
    let obj = path.display().to_string();
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::invalid("statvfs", obj.clone(), "path contains a NUL byte"))?;
    // SAFETY: statvfs is plain old data; all-zero bytes are a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs(3) takes a NUL-terminated path and a pointer to a
    // struct statvfs it fills; both live for the call.
    let ret = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if ret != 0 {
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        return Err(Error::from_errno(errno, "statvfs", obj));
    }
    let frsize = st.f_frsize as u64;
    let blocks = st.f_blocks as u64;
    let bfree = st.f_bfree as u64;
    let files = st.f_files as u64;
    let ffree = st.f_ffree as u64;
    Ok(FsStats {
        total_bytes: blocks * frsize,
        available_bytes: st.f_bavail as u64 * frsize,
        used_bytes: blocks.saturating_sub(bfree) * frsize,
        total_inodes: files,
        free_inodes: ffree,
        used_inodes: files.saturating_sub(ffree),
    })
}

/// `BLKGETSIZE64` from `<linux/fs.h>`: `_IOR(0x12, 114, size_t)`.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// The size in bytes of block device `device`, by `ioctl(BLKGETSIZE64)`.
pub fn device_size(device: &Path) -> Result<u64> {
    let obj = device.display().to_string();
    let f = std::fs::File::open(device).map_err(|e| {
        Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), "open", obj.clone())
            .detail(e.to_string())
    })?;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 (linux/fs.h) writes one u64 through its pointer
    // argument; the fd is open for the call and `size` outlives it.
    let ret = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if ret != 0 {
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        let e = Error::from_errno(errno, "ioctl(BLKGETSIZE64)", obj);
        return Err(if errno == libc::ENOTTY {
            e.detail("not a block device")
        } else {
            e
        });
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xfs_always_gets_nouuid_once() {
        assert_eq!(mount_options("xfs", &["noatime"]), ["noatime", "nouuid"]);
        assert_eq!(
            mount_options("xfs", &["noatime,nouuid"]),
            ["noatime,nouuid"]
        );
        assert_eq!(mount_options("ext4", &["noatime"]), ["noatime"]);
        assert_eq!(mount_options::<&str>("xfs", &[]), ["nouuid"]);
    }

    #[test]
    fn mkfs_options_split_on_whitespace() {
        assert_eq!(
            parse_mkfs_options("  -m0\t-E  nodiscard \n"),
            ["-m0", "-E", "nodiscard"]
        );
        assert!(parse_mkfs_options("   ").is_empty());
        assert_eq!(
            default_mkfs_options("ext4"),
            ["-m0", "-Enodiscard,lazy_itable_init=1,lazy_journal_init=1"]
        );
        assert_eq!(default_mkfs_options("xfs"), ["-K"]);
    }

    #[test]
    fn probes_files_blank_and_partitioned() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("img");
        let f = std::fs::File::create(&img).unwrap();
        f.set_len(8 << 20).unwrap();
        assert_eq!(probe(&img).unwrap(), Probe::Blank);
        // A DOS partition table: one Linux partition entry and the 0x55AA mark.
        let mut mbr = vec![0u8; 512];
        mbr[446 + 4] = 0x83;
        mbr[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
        mbr[446 + 12..446 + 16].copy_from_slice(&4096u32.to_le_bytes());
        mbr[510] = 0x55;
        mbr[511] = 0xaa;
        std::os::unix::fs::FileExt::write_all_at(&f, &mbr, 0).unwrap();
        assert_eq!(probe(&img).unwrap(), Probe::PartitionTable("dos".into()));
        let e = make_fs(&img, "ext4", &[] as &[&str]).unwrap_err();
        assert!(e.to_string().contains("partition table"), "{e}");
    }

    #[test]
    fn refuses_unsupported_types_and_missing_devices() {
        let e = make_fs(Path::new("/nonexistent"), "btrfs", &[] as &[&str]).unwrap_err();
        assert!(e.to_string().contains("not supported"), "{e}");
        let e = probe(Path::new("/nonexistent/dev")).unwrap_err();
        assert_eq!(e.op(), "blkid");
        assert!(e.is_not_found(), "{e}");
        let e = probe(Path::new("/dev/null")).unwrap_err();
        assert_eq!(e.errno(), libc::ENOTBLK);
        let e = grow(Path::new("/dev/null"), Path::new("/"), "vfat").unwrap_err();
        assert!(e.to_string().contains("cannot be grown"), "{e}");
    }

    #[test]
    fn device_size_refuses_a_regular_file() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let e = device_size(f.path()).unwrap_err();
        assert_eq!(e.errno(), libc::ENOTTY);
    }

    #[test]
    fn stats_of_the_root_filesystem_add_up() {
        let s = stats(Path::new("/")).unwrap();
        assert!(s.total_bytes > 0);
        assert!(s.used_bytes <= s.total_bytes);
        assert!(s.available_bytes <= s.total_bytes);
        let e = stats(Path::new("/nonexistent")).unwrap_err();
        assert!(e.is_not_found());
    }
}
