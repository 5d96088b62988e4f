//! Mounts by syscall: `mount(2)`, bind mounts, `umount2(2)`, and what is
//! mounted where, from `/proc/self/mountinfo`.
//!
//! The `ensure_*` helpers are idempotent: each looks at the mount table
//! first, so a repeat after a crash between any two steps converges. Paths
//! are looked up in the mount table without `stat`ing the mount point, so a
//! stale mount (a dead FUSE backend: `stat` fails with `ENOTCONN`/`EIO`)
//! is still found and can be unmounted.

use std::ffi::CString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};

/// The mount table of this process.
pub const MOUNTINFO: &str = "/proc/self/mountinfo";

/// At most this many mounts stacked on one target are taken off by
/// [`ensure_unmounted`] before it gives up.
const MAX_STACKED: usize = 64;

/// How long [`ensure_unmounted`] retries a mount that is busy.
const BUSY_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// One line of `/proc/self/mountinfo` (see `proc_pid_mountinfo(5)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    /// The mount's unique id.
    pub mount_id: u32,
    /// The parent mount's id.
    pub parent_id: u32,
    /// `st_dev` of the filesystem: major number.
    pub major: u32,
    /// `st_dev` of the filesystem: minor number.
    pub minor: u32,
    /// The directory of the filesystem that is the root of this mount
    /// (`/` for a plain mount; a subdirectory for a bind mount of one).
    pub root: PathBuf,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`/`ro`, `noatime`, `nodev`, ...).
    pub mount_options: Vec<String>,
    /// The filesystem type (`ext4`, `xfs`, `fuse.rbdkit`).
    pub fstype: String,
    /// The mount source (a device path for block filesystems).
    pub source: String,
    /// Per-superblock options.
    pub super_options: Vec<String>,
}

impl MountInfo {
    /// True when the mount itself is read-only.
    pub fn read_only(&self) -> bool {
        self.mount_options.iter().any(|o| o == "ro")
    }

    /// `st_dev` of the filesystem as one number (`makedev(major, minor)`).
    pub fn dev(&self) -> u64 {
        libc::makedev(self.major, self.minor)
    }
}

/// Decodes the octal escapes (`\040` space, `\011` tab, `\012` newline,
/// `\134` backslash) the kernel puts in mountinfo fields.
fn unescape_bytes(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

fn unescape(field: &[u8]) -> String {
    String::from_utf8_lossy(&unescape_bytes(field)).into_owned()
}

/// Paths keep their bytes: a mount point need not be UTF-8.
fn unescape_path(field: &[u8]) -> PathBuf {
    PathBuf::from(std::ffi::OsString::from_vec(unescape_bytes(field)))
}

fn split_opts(s: &[u8]) -> Vec<String> {
    s.split(|b| *b == b',')
        .filter(|o| !o.is_empty())
        .map(unescape)
        .collect()
}

/// Parses the text of a mountinfo file. A line that does not have the
/// documented shape is an error naming the line.
pub fn parse_mountinfo(text: impl AsRef<[u8]>) -> Result<Vec<MountInfo>> {
    let bad = |line: &[u8], why: &str| {
        Error::invalid(
            "parse mountinfo",
            MOUNTINFO,
            format!("{why} in line {:?}", String::from_utf8_lossy(line)),
        )
    };
    let mut out = Vec::new();
    for line in text
        .as_ref()
        .split(|b| *b == b'\n')
        .filter(|l| !l.trim_ascii().is_empty())
    {
        let fields: Vec<&[u8]> = line.split(|b| *b == b' ').collect();
        // The optional fields end at a lone "-".
        let sep = fields
            .iter()
            .skip(6)
            .position(|f| *f == b"-")
            .map(|p| p + 6)
            .ok_or_else(|| bad(line, "no \"-\" separator"))?;
        if fields.len() < sep + 3 {
            return Err(bad(line, "too few fields"));
        }
        let num = |s: &[u8]| {
            std::str::from_utf8(s)
                .ok()
                .and_then(|s| s.parse::<u32>().ok())
                .ok_or_else(|| bad(line, "bad number"))
        };
        let colon = fields[2]
            .iter()
            .position(|b| *b == b':')
            .ok_or_else(|| bad(line, "bad major:minor"))?;
        out.push(MountInfo {
            mount_id: num(fields[0])?,
            parent_id: num(fields[1])?,
            major: num(&fields[2][..colon])?,
            minor: num(&fields[2][colon + 1..])?,
            root: unescape_path(fields[3]),
            mount_point: unescape_path(fields[4]),
            mount_options: split_opts(fields[5]),
            fstype: unescape(fields[sep + 1]),
            source: unescape(fields[sep + 2]),
            super_options: fields
                .get(sep + 3)
                .map(|s| split_opts(s))
                .unwrap_or_default(),
        });
    }
    Ok(out)
}

/// Reads and parses `/proc/self/mountinfo`, in mount order.
pub fn mountinfo() -> Result<Vec<MountInfo>> {
    let text = std::fs::read(MOUNTINFO).map_err(|e| io_error(e, "read", MOUNTINFO))?;
    parse_mountinfo(&text)
}

/// The absolute path the mount table uses for `path`, found without
/// `stat`ing `path` itself when that fails (a stale mount point): the parent
/// is resolved and the last component appended.
pub fn normalize(path: &Path) -> Result<PathBuf> {
    if let Ok(p) = std::fs::canonicalize(path) {
        return Ok(p);
    }
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| io_error(e, "getcwd", &path.display().to_string()))?
            .join(path)
    };
    let mut lexical = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::ParentDir => {
                lexical.pop();
            }
            Component::CurDir => {}
            other => lexical.push(other),
        }
    }
    match (lexical.parent(), lexical.file_name()) {
        (Some(parent), Some(name)) => match std::fs::canonicalize(parent) {
            Ok(p) => Ok(p.join(name)),
            Err(_) => Ok(lexical),
        },
        _ => Ok(lexical),
    }
}

/// The mounts at `path`, bottom first (the last one is what `path` shows).
pub fn mounts_at(path: &Path) -> Result<Vec<MountInfo>> {
    let target = normalize(path)?;
    Ok(mountinfo()?
        .into_iter()
        .filter(|m| m.mount_point == target)
        .collect())
}

/// What is mounted at `path` now (the top of any stack), if anything.
pub fn mounted_at(path: &Path) -> Result<Option<MountInfo>> {
    Ok(mounts_at(path)?.pop())
}

/// True when `path` is a mount point (a stale one too).
pub fn is_mount_point(path: &Path) -> Result<bool> {
    Ok(mounted_at(path)?.is_some())
}

/// Where block device `device` is mounted: every mount of its filesystem,
/// bind mounts included. Matched by device number, so `/dev/loop0` and a
/// symlink to it are the same device.
pub fn mounts_of_device(device: &Path) -> Result<Vec<MountInfo>> {
    let rdev = block_rdev(device)?;
    Ok(mountinfo()?
        .into_iter()
        .filter(|m| m.dev() == rdev)
        .collect())
}

/// Processes in other mount namespaces that still have block device
/// `device` mounted, one `pid (comm)` per namespace, for messages. Such a
/// copy keeps the filesystem, and so the device, held after this
/// namespace unmounted it: a namespace made while it was mounted (a
/// container starting, a build's sandbox) copied the mount.
pub fn other_namespaces_mounting(device: &Path) -> Result<Vec<String>> {
    let rdev = block_rdev(device)?;
    let ours = std::fs::read_link("/proc/self/ns/mnt").ok();
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    let procs = std::fs::read_dir("/proc").map_err(|e| io_error(e, "read_dir", "/proc"))?;
    for entry in procs.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let base = entry.path();
        // A process can exit between the listing and the reads: skip it.
        let Ok(ns) = std::fs::read_link(base.join("ns/mnt")) else {
            continue;
        };
        if Some(&ns) == ours.as_ref() || !seen.insert(ns) {
            continue;
        }
        let Ok(text) = std::fs::read(base.join("mountinfo")) else {
            continue;
        };
        let mounts = parse_mountinfo(text).unwrap_or_default();
        if mounts.iter().any(|m| m.dev() == rdev) {
            let comm = std::fs::read_to_string(base.join("comm")).unwrap_or_default();
            out.push(format!("{pid} ({})", comm.trim()));
        }
    }
    Ok(out)
}

/// `st_rdev` of a block device, or an error that says it is not one.
fn block_rdev(device: &Path) -> Result<u64> {
    let obj = device.display().to_string();
    let md = std::fs::metadata(device).map_err(|e| io_error(e, "stat", &obj))?;
    if !md.file_type().is_block_device() {
        return Err(Error::from_errno(libc::ENOTBLK, "stat", obj).detail("not a block device"));
    }
    Ok(md.rdev())
}

/// True when `stat(path)` fails the way a mount whose backend died does
/// (`ENOTCONN`, `EIO`, `ESTALE`).
pub fn is_stale(path: &Path) -> bool {
    match std::fs::metadata(path) {
        Ok(_) => false,
        Err(e) => matches!(
            e.raw_os_error(),
            Some(libc::ENOTCONN) | Some(libc::EIO) | Some(libc::ESTALE)
        ),
    }
}

/// Mount options split the way `mount(2)` takes them: `MS_*` flags and the
/// filesystem's data string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountFlags {
    /// The `MS_*` flags.
    pub flags: libc::c_ulong,
    /// The rest, for the filesystem (`discard`, `nouuid`, `errors=...`).
    pub data: Vec<String>,
}

impl MountFlags {
    /// True when the options ask for a read-only mount.
    pub fn read_only(&self) -> bool {
        self.flags & libc::MS_RDONLY != 0
    }

    /// The data string, comma-joined (`None` when empty).
    pub fn data_string(&self) -> Option<String> {
        (!self.data.is_empty()).then(|| self.data.join(","))
    }
}

/// Splits mount options (as in a CSI capability's `mount_flags` or an
/// fstab) into `MS_*` flags and the data string, the way `mount(8)` does.
/// Options only the mount CLI knows (`defaults`, `_netdev`, `nofail`,
/// `auto`, `x-*`) are dropped; `bind`/`remount`/`move` are refused since
/// they change what the call does.
pub fn split_options<S: AsRef<str>>(options: &[S]) -> Result<MountFlags> {
    let mut f = MountFlags::default();
    for opt in options.iter().flat_map(|o| o.as_ref().split(',')) {
        let opt = opt.trim();
        let (set, clear): (libc::c_ulong, libc::c_ulong) = match opt {
            "" | "defaults" | "_netdev" | "nofail" | "auto" | "noauto" | "user" | "nouser"
            | "users" | "owner" | "group" | "comment" => (0, 0),
            o if o.starts_with("x-") || o.starts_with("comment=") => (0, 0),
            "ro" => (libc::MS_RDONLY, 0),
            "rw" => (0, libc::MS_RDONLY),
            "nosuid" => (libc::MS_NOSUID, 0),
            "suid" => (0, libc::MS_NOSUID),
            "nodev" => (libc::MS_NODEV, 0),
            "dev" => (0, libc::MS_NODEV),
            "noexec" => (libc::MS_NOEXEC, 0),
            "exec" => (0, libc::MS_NOEXEC),
            "sync" => (libc::MS_SYNCHRONOUS, 0),
            "async" => (0, libc::MS_SYNCHRONOUS),
            "dirsync" => (libc::MS_DIRSYNC, 0),
            "noatime" => (libc::MS_NOATIME, 0),
            "atime" => (0, libc::MS_NOATIME),
            "nodiratime" => (libc::MS_NODIRATIME, 0),
            "diratime" => (0, libc::MS_NODIRATIME),
            "relatime" => (libc::MS_RELATIME, 0),
            "norelatime" => (0, libc::MS_RELATIME),
            "strictatime" => (libc::MS_STRICTATIME, 0),
            "nostrictatime" => (0, libc::MS_STRICTATIME),
            "lazytime" => (libc::MS_LAZYTIME, 0),
            "nolazytime" => (0, libc::MS_LAZYTIME),
            "silent" => (libc::MS_SILENT, 0),
            "loud" => (0, libc::MS_SILENT),
            "mand" => (libc::MS_MANDLOCK, 0),
            "nomand" => (0, libc::MS_MANDLOCK),
            "nosymfollow" => (libc::MS_NOSYMFOLLOW, 0),
            "bind" | "rbind" | "remount" | "move" | "make-shared" | "make-private"
            | "make-slave" | "make-unbindable" => {
                return Err(Error::invalid(
                    "mount",
                    opt,
                    format!("mount option {opt:?} is not allowed here"),
                ))
            }
            other => {
                if !f.data.iter().any(|d| d == other) {
                    f.data.push(other.to_owned());
                }
                (0, 0)
            }
        };
        f.flags = (f.flags | set) & !clear;
    }
    Ok(f)
}

fn path_cstr(p: &Path, op: &'static str) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| Error::invalid(op, p.display().to_string(), "path contains a NUL byte"))
}

fn io_error(e: std::io::Error, op: &'static str, object: &str) -> Error {
    Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), op, object).detail(e.to_string())
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// `mount(2)`: mounts `source` (a device; `None` for a remount) on `target`
/// with filesystem type `fstype`, `flags` and the `data` string.
pub fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<()> {
    let src = source.map(|s| path_cstr(s, "mount")).transpose()?;
    let tgt = path_cstr(target, "mount")?;
    let fst = fstype
        .map(|t| CString::new(t).map_err(|_| Error::invalid("mount", t, "NUL in fstype")))
        .transpose()?;
    let dat = data
        .map(|d| CString::new(d).map_err(|_| Error::invalid("mount", d, "NUL in options")))
        .transpose()?;
    // SAFETY: mount(2) takes NUL-terminated strings or NULL for source,
    // fstype and data (NULL is allowed for remounts and binds per the man
    // page); every pointer is a live CString or null for this call.
    let ret = unsafe {
        libc::mount(
            src.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            tgt.as_ptr(),
            fst.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            dat.as_ref()
                .map_or(std::ptr::null(), |s| s.as_ptr().cast::<libc::c_void>()),
        )
    };
    if ret != 0 {
        let errno = last_errno();
        let what = match source {
            Some(s) => format!(
                "mounting {} ({}) with flags {flags:#x} and options {:?}",
                s.display(),
                fstype.unwrap_or("-"),
                data.unwrap_or("")
            ),
            None => format!("remounting with flags {flags:#x}"),
        };
        return Err(
            Error::from_errno(errno, "mount", target.display().to_string()).detail(format!(
                "{what}: {}",
                std::io::Error::from_raw_os_error(errno)
            )),
        );
    }
    Ok(())
}

/// `mount(2)` with `MS_BIND`: makes `source` visible at `target`; a
/// read-only bind takes the second `MS_REMOUNT|MS_BIND|MS_RDONLY` step the
/// kernel needs (the first call ignores `MS_RDONLY`).
pub fn bind(source: &Path, target: &Path, read_only: bool) -> Result<()> {
    mount(Some(source), target, None, libc::MS_BIND, None)?;
    if read_only {
        if let Err(e) = remount_bind(target, true) {
            // Never leave a writable bind where a read-only one was asked.
            let _ = umount(target, false);
            return Err(e);
        }
    }
    Ok(())
}

/// Flips an existing bind mount at `target` between read-only and
/// read-write (`MS_REMOUNT|MS_BIND[|MS_RDONLY]`).
fn remount_bind(target: &Path, read_only: bool) -> Result<()> {
    let ro = if read_only { libc::MS_RDONLY } else { 0 };
    mount(
        None,
        target,
        None,
        libc::MS_REMOUNT | libc::MS_BIND | ro,
        None,
    )
}

/// `umount2(2)` of `target` (never following a symlink there), with
/// `MNT_DETACH` when `detach` is set: the mount disappears now and is freed
/// when no longer busy, the way out for a stale mount.
pub fn umount(target: &Path, detach: bool) -> Result<()> {
    let tgt = path_cstr(target, "umount2")?;
    let flags = libc::UMOUNT_NOFOLLOW | if detach { libc::MNT_DETACH } else { 0 };
    // SAFETY: umount2(2) takes a NUL-terminated path, live for the call, and
    // flags from <sys/mount.h>.
    let ret = unsafe { libc::umount2(tgt.as_ptr(), flags) };
    if ret != 0 {
        let errno = last_errno();
        return Err(Error::from_errno(
            errno,
            "umount2",
            target.display().to_string(),
        ));
    }
    Ok(())
}

/// Mounts filesystem `fstype` on `device` at `target` with `options`
/// (see [`split_options`]), creating the `target` directory if missing.
///
/// A no-op when `device` is already mounted there with the same
/// read-only-ness; an error when something else is mounted there, when the
/// mount there is stale, or when it is `ro` where `rw` was asked (or the
/// other way round). Filesystem-specific options (`nouuid` for xfs) are the
/// caller's: see `fs::mount_options`.
pub fn ensure_mounted<S: AsRef<str>>(
    device: &Path,
    target: &Path,
    fstype: &str,
    options: &[S],
) -> Result<()> {
    let opts = split_options(options)?;
    let obj = target.display().to_string();
    let rdev = block_rdev(device)?;
    if let Some(m) = mounted_at(target)? {
        if is_stale(target) {
            return Err(Error::from_errno(libc::ENOTCONN, "mount", obj)
                .detail("the mount there is stale; unmount it first"));
        }
        if m.dev() != rdev || m.root != Path::new("/") {
            return Err(Error::from_errno(libc::EBUSY, "mount", obj).detail(format!(
                "{} ({}, root {}) is mounted there, not {}",
                m.source,
                m.fstype,
                m.root.display(),
                device.display()
            )));
        }
        if m.read_only() != opts.read_only() {
            return Err(Error::from_errno(libc::EBUSY, "mount", obj).detail(format!(
                "{} is already mounted there {}, but {} was asked",
                device.display(),
                if m.read_only() {
                    "read-only"
                } else {
                    "read-write"
                },
                if opts.read_only() {
                    "read-only"
                } else {
                    "read-write"
                },
            )));
        }
        if m.fstype != fstype {
            return Err(Error::from_errno(libc::EBUSY, "mount", obj).detail(format!(
                "{} is mounted there as {}, not {fstype}",
                device.display(),
                m.fstype
            )));
        }
        return Ok(());
    }
    std::fs::create_dir_all(target).map_err(|e| io_error(e, "mkdir", &obj))?;
    mount(
        Some(device),
        target,
        Some(fstype),
        opts.flags,
        opts.data_string().as_deref(),
    )
}

/// Bind-mounts `source` (a directory, or a block device / file for raw
/// block volumes) at `target`, read-only if asked, creating `target` (a
/// directory, or an empty file when `source` is not a directory).
///
/// A no-op when `source` is already bound there; a bind left read-write by
/// a crash between the two steps of a read-only bind is finished (and the
/// other way round). An error when something else is mounted there.
pub fn ensure_bind(source: &Path, target: &Path, read_only: bool) -> Result<()> {
    let obj = target.display().to_string();
    let src = std::fs::metadata(source)
        .map_err(|e| io_error(e, "stat", &source.display().to_string()))?;
    if let Some(m) = mounted_at(target)? {
        if is_stale(target) {
            return Err(Error::from_errno(libc::ENOTCONN, "mount", obj)
                .detail("the mount there is stale; unmount it first"));
        }
        let tgt = std::fs::metadata(target).map_err(|e| io_error(e, "stat", &obj))?;
        // A bind shows the very inode of its source.
        if tgt.dev() != src.dev() || tgt.ino() != src.ino() {
            return Err(Error::from_errno(libc::EBUSY, "mount", obj).detail(format!(
                "{} ({}, root {}) is mounted there, not a bind of {}",
                m.source,
                m.fstype,
                m.root.display(),
                source.display()
            )));
        }
        if m.read_only() != read_only {
            remount_bind(target, read_only)?;
        }
        return Ok(());
    }
    if src.is_dir() {
        std::fs::create_dir_all(target).map_err(|e| io_error(e, "mkdir", &obj))?;
    } else if std::fs::symlink_metadata(target).is_err() {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_error(e, "mkdir", &obj))?;
        }
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(target)
            .map_err(|e| io_error(e, "create", &obj))?;
    }
    bind(source, target, read_only)
}

/// Unmounts everything mounted at `target` (stacked mounts one by one, top
/// first). A no-op when nothing is mounted there. A stale mount, or one
/// the plain unmount cannot take off, is detached (`MNT_DETACH`); a busy
/// healthy mount is retried for a short while and then an error (detaching
/// it would hide that it is in use).
pub fn ensure_unmounted(target: &Path) -> Result<()> {
    let obj = target.display().to_string();
    for _ in 0..MAX_STACKED {
        if mounted_at(target)?.is_none() {
            return Ok(());
        }
        match umount(target, false) {
            Ok(()) => {}
            // Gone between the look and the call.
            Err(e) if e.kind() == ErrorKind::InvalidArgument && !is_mount_point(target)? => {}
            Err(e) if is_stale(target) || e.errno() == libc::ENOTCONN || e.errno() == libc::EIO => {
                umount(target, true)?;
            }
            Err(e) if e.errno() == libc::EBUSY => umount_busy(target)?,
            Err(e) => return Err(e),
        }
    }
    Err(
        Error::from_errno(libc::EBUSY, "umount2", obj).detail(format!(
            "still mounted after taking off {MAX_STACKED} mounts"
        )),
    )
}

/// Retries an unmount that answered `EBUSY`, for a bounded time. A short
/// `EBUSY` is common: a child forked by another thread holds copies of our
/// file descriptors until it execs (`O_CLOEXEC` only closes them then).
fn umount_busy(target: &Path) -> Result<()> {
    let deadline = std::time::Instant::now() + BUSY_WAIT;
    loop {
        std::thread::sleep(std::time::Duration::from_millis(20));
        match umount(target, false) {
            Err(e) if e.errno() == libc::EBUSY => {
                if std::time::Instant::now() >= deadline {
                    return Err(e.detail(format!(
                        "still busy after {BUSY_WAIT:?}: a process has files open or its \
                         working directory under it"
                    )));
                }
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
36 22 7:0 / /var/lib/kubelet/plugins/x/globalmount rw,noatime - xfs /dev/loop0 rw,nouuid
37 22 7:0 / /var/lib/kubelet/pods/with\\040space/vol ro,noatime master:3 - xfs /dev/loop0 rw,nouuid
40 22 0:52 /sub /mnt/bind\\134back rw shared:9 master:2 - tmpfs tmp\\011fs rw
41 22 0:53 / /mnt/fuse rw,nosuid,nodev - fuse.rbdkit rbdkit rw,user_id=0
";

    #[test]
    fn parses_mountinfo_with_escapes_and_optional_fields() {
        let m = parse_mountinfo(SAMPLE).unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(m[0].mount_point, Path::new("/"));
        assert_eq!(m[0].super_options, ["rw", "errors=remount-ro"]);
        assert_eq!((m[1].major, m[1].minor), (7, 0));
        assert_eq!(m[1].fstype, "xfs");
        assert_eq!(m[1].source, "/dev/loop0");
        assert!(!m[1].read_only());
        assert_eq!(
            m[2].mount_point,
            Path::new("/var/lib/kubelet/pods/with space/vol")
        );
        assert!(m[2].read_only());
        assert_eq!(m[3].mount_point, Path::new("/mnt/bind\\back"));
        assert_eq!(m[3].root, Path::new("/sub"));
        assert_eq!(m[3].source, "tmp\tfs");
        assert_eq!(m[4].fstype, "fuse.rbdkit");
        assert_eq!(m[4].mount_options, ["rw", "nosuid", "nodev"]);
        assert_eq!(m[1].dev(), libc::makedev(7, 0));
    }

    #[test]
    fn refuses_malformed_lines() {
        let e = parse_mountinfo("22 1 8:1 / / rw shared:1 ext4 /dev/sda1 rw\n").unwrap_err();
        assert!(e.to_string().contains("separator"), "{e}");
        let e = parse_mountinfo("x 1 8:1 / / rw - ext4 /dev/sda1 rw\n").unwrap_err();
        assert!(e.to_string().contains("bad number"), "{e}");
        let e = parse_mountinfo("1 1 81 / / rw - ext4 /dev/sda1 rw\n").unwrap_err();
        assert!(e.to_string().contains("major:minor"), "{e}");
    }

    #[test]
    fn unescape_leaves_other_backslashes() {
        assert_eq!(unescape(br"a\040b"), "a b");
        assert_eq!(unescape(br"a\\b"), r"a\\b");
        assert_eq!(unescape(br"end\04"), r"end\04");
        assert_eq!(unescape(br"\012"), "\n");
        // Not UTF-8: the path keeps its bytes.
        assert_eq!(
            unescape_path(br"/mnt/\377x").as_os_str().as_bytes(),
            b"/mnt/\xffx"
        );
    }

    #[test]
    fn the_live_mount_table_parses_and_has_root() {
        let m = mountinfo().unwrap();
        assert!(m.iter().any(|m| m.mount_point == Path::new("/")));
        assert!(is_mount_point(Path::new("/proc")).unwrap());
        assert!(!is_mount_point(Path::new("/proc/self")).unwrap());
    }

    #[test]
    fn splits_flags_from_data() {
        let f = split_options(&[
            "ro",
            "noatime,nodev",
            "nosuid",
            "noexec",
            "discard",
            "defaults",
            "_netdev",
            "errors=remount-ro",
            "discard",
        ])
        .unwrap();
        assert_eq!(
            f.flags,
            libc::MS_RDONLY | libc::MS_NOATIME | libc::MS_NODEV | libc::MS_NOSUID | libc::MS_NOEXEC
        );
        assert!(f.read_only());
        assert_eq!(
            f.data_string().as_deref(),
            Some("discard,errors=remount-ro")
        );
        // A later option wins, as in mount(8).
        let f = split_options(&["ro", "rw", "noexec", "exec"]).unwrap();
        assert_eq!(f.flags, 0);
        assert_eq!(f.data_string(), None);
        let e = split_options(&["bind"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn normalize_resolves_the_parent_of_a_missing_path() {
        let dir = tempfile::tempdir().unwrap();
        let real = std::fs::canonicalize(dir.path()).unwrap();
        let p = dir.path().join("sub/../missing");
        assert_eq!(normalize(&p).unwrap(), real.join("missing"));
        assert_eq!(normalize(dir.path()).unwrap(), real);
    }

    #[test]
    fn unmounting_nothing_is_a_no_op() {
        let dir = tempfile::tempdir().unwrap();
        ensure_unmounted(dir.path()).unwrap();
        ensure_unmounted(&dir.path().join("missing")).unwrap();
    }

    #[test]
    fn mounting_a_non_device_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = ensure_mounted(&file, &dir.path().join("t"), "ext4", &["rw"]).unwrap_err();
        assert_eq!(e.errno(), libc::ENOTBLK);
        assert!(e.to_string().contains("not a block device"), "{e}");
    }
}
