//! Filesystems on a mapped device, with the node's e2fsprogs and xfsprogs:
//! probing (`blkid`), making (`mkfs.ext4`, `mkfs.xfs`), growing
//! (`resize2fs`, `xfs_growfs`), trimming (`fstrim`), usage (`statvfs(3)`)
//! and the device size (`ioctl(BLKGETSIZE64)`).
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
/// How long an offline grow waits for a device that is not mounted here to
/// be let go (see `wait_unheld`).
pub const HELD_WAIT: Duration = Duration::from_secs(15);
/// Bound on one `fstrim` of a staged filesystem.
pub const TRIM_TIMEOUT: Duration = Duration::from_secs(600);

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

/// How an option of a `mkfs` program may be given in `mkfsOptions`.
#[derive(Clone, Copy)]
enum Allowed {
    /// A flag without a value.
    Flag,
    /// A value matching the check.
    Value(fn(&str) -> bool),
    /// A comma list of suboptions (`name` or `name=value`): the names
    /// allowed, each value a plain word (no `/`).
    Suboptions(&'static [&'static str]),
    /// Refused, with the reason.
    Refused(&'static str),
}

fn number(v: &str) -> bool {
    let digits = v.trim_end_matches(['k', 'K', 'm', 'M', 'g', 'G', 's', 'b']);
    !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit() || c == '.')
}

fn word(v: &str) -> bool {
    !v.is_empty()
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.:^,=+".contains(c))
}

fn any_text(v: &str) -> bool {
    !v.is_empty() && !v.contains('\0')
}

const HOST_PATH: &str =
    "it makes mkfs read or write a path of the host, which the node plugin's privileges would allow";

/// The options of mke2fs (`mkfs.ext2/3/4`) that `mkfsOptions` may use: its
/// getopt letters, each allowed with a checked value or refused by name.
fn mke2fs_option(letter: char) -> Option<Allowed> {
    use Allowed::*;
    Some(match letter {
        'b' | 'C' | 'g' | 'G' | 'i' | 'I' | 'm' | 'N' => Value(number),
        'e' => Value(|v| ["continue", "remount-ro", "panic"].contains(&v)),
        'j' | 'q' | 'v' | 'D' | 'F' | 'K' => Flag,
        'E' => Suboptions(&[
            "stride",
            "stripe_width",
            "stripe-width",
            "resize",
            "lazy_itable_init",
            "lazy_journal_init",
            "assume_storage_prezeroed",
            "packed_meta_blocks",
            "num_backup_sb",
            "root_owner",
            "test_fs",
            "discard",
            "nodiscard",
            "quotatype",
            "encoding",
            "encoding_flags",
            "orphan_file_size",
            "mmp_update_interval",
            "hash_seed",
        ]),
        'J' => Suboptions(&["size", "fast_commit_size", "location"]),
        'L' | 'M' => Value(any_text),
        'o' | 'O' | 'T' | 'U' => Value(word),
        'r' => Value(|v| v == "0" || v == "1"),
        'd' => Refused(
            "-d copies a directory or tarball of the host into the new filesystem, and              the node plugin can read every file of the host",
        ),
        'l' => Refused("-l reads a bad-blocks list from a file of the host"),
        'z' => Refused("-z writes an undo file on the host"),
        'c' => Refused("-c scans the whole device for bad blocks (hours on a large image)"),
        'n' => Refused("-n makes no filesystem (a dry run)"),
        'S' => Refused("-S rewrites only the superblocks, over whatever the device holds"),
        't' => Refused("-t: the filesystem type is the volume capability's fsType"),
        'R' | 's' => Refused("an obsolete option"),
        'V' => Refused("-V makes no filesystem"),
        _ => return None,
    })
}

/// The same for mkfs.xfs.
fn mkfs_xfs_option(letter: char) -> Option<Allowed> {
    use Allowed::*;
    Some(match letter {
        'b' | 's' => Suboptions(&["size", "log"]),
        'd' => Suboptions(&[
            "agcount",
            "agsize",
            "cowextsize",
            "daxinherit",
            "extszinherit",
            "noalign",
            "projinherit",
            "size",
            "su",
            "sunit",
            "sw",
            "swidth",
            "concurrency",
        ]),
        'i' => Suboptions(&[
            "align",
            "attr",
            "maxpct",
            "perblock",
            "projid32bit",
            "size",
            "sparse",
            "nrext64",
            "exchange",
        ]),
        'l' => Suboptions(&[
            "agnum",
            "internal",
            "size",
            "su",
            "sunit",
            "version",
            "lazy-count",
            "sectsize",
            "concurrency",
        ]),
        'm' => Suboptions(&[
            "crc",
            "finobt",
            "uuid",
            "rmapbt",
            "reflink",
            "inobtcount",
            "bigtime",
            "autofsck",
            "metadir",
        ]),
        'n' => Suboptions(&["size", "version", "ftype", "parent"]),
        'L' => Value(any_text),
        'K' | 'q' | 'f' => Flag,
        'r' => Refused("-r makes a realtime section, on a device of the host (rtdev=)"),
        'p' => Refused("-p reads a prototype file of the host and copies host files in"),
        'c' => Refused("-c reads a configuration file of the host"),
        'N' => Refused("-N makes no filesystem (a dry run)"),
        'V' => Refused("-V makes no filesystem"),
        _ => return None,
    })
}

/// Suboptions with a meaning of their own that is refused.
fn refused_suboption(letter: char, name: &str, value: Option<&str>) -> Option<&'static str> {
    match (letter, name) {
        ('l', "logdev")
        | ('l', "name")
        | ('l', "file")
        | ('d', "name")
        | ('d', "file")
        | ('r', _) => Some(HOST_PATH),
        ('J', "device") => Some(HOST_PATH),
        ('l', "internal") if matches!(value, Some("0")) => Some(
            "an external log lives on another device of the host; only the internal log \
             is allowed",
        ),
        ('E', "offset") => Some("the filesystem would start past the start of the volume"),
        ('E', "android_sparse") => Some("it writes a sparse file, not the device"),
        _ => None,
    }
}

/// Checks `mkfsOptions` for `fstype` before anything is done with them: only
/// known, safe options of that type's mkfs are allowed, each named in the
/// error when refused. The argv rbdkit builds is `mkfs.<type> [options]
/// <device>`, and the node plugin runs it with the host's privileges, so an
/// option that reads or writes a host path (`-d /` of mke2fs, `logdev=` of
/// mkfs.xfs), one that makes no filesystem, or anything that is not an
/// option at all (a word that mkfs would take as the device or its size) is
/// refused. Parsed as getopt does (`-m0`, `-qF`, `-E a,b=1`), so what is
/// checked is what mkfs sees.
pub fn check_mkfs_options<S: AsRef<str>>(fstype: &str, options: &[S]) -> Result<()> {
    let (program, table): (&str, fn(char) -> Option<Allowed>) = match fstype {
        "ext4" | "ext3" | "ext2" => ("mke2fs", mke2fs_option),
        "xfs" => ("mkfs.xfs", mkfs_xfs_option),
        _ => return check_fstype(fstype, "mkfsOptions", fstype),
    };
    let refuse = |what: &str, why: String| {
        Err(Error::invalid(
            "mkfsOptions",
            format!("{program} option {what}"),
            why,
        ))
    };
    let mut args = options.iter().map(|s| s.as_ref());
    while let Some(arg) = args.next() {
        let Some(letters) = arg
            .strip_prefix('-')
            .filter(|l| !l.is_empty() && !l.starts_with('-'))
        else {
            return refuse(
                &format!("{arg:?}"),
                format!(
                    "not an option: each word must be a {program} option such as -L label \
                     (mkfs would take other words for the device or its size)"
                ),
            );
        };
        for (i, letter) in letters.char_indices() {
            let flag = format!("-{letter}");
            let Some(allowed) = table(letter) else {
                return refuse(
                    &flag,
                    format!("{flag} is not an option {program} is allowed here"),
                );
            };
            let value = match allowed {
                Allowed::Flag => continue,
                Allowed::Refused(why) => return refuse(&flag, why.to_owned()),
                Allowed::Value(_) | Allowed::Suboptions(_) => {
                    let rest = &letters[i + letter.len_utf8()..];
                    if rest.is_empty() {
                        match args.next() {
                            Some(v) => v,
                            None => return refuse(&flag, format!("{flag} needs a value")),
                        }
                    } else {
                        rest
                    }
                }
            };
            match allowed {
                Allowed::Value(ok) if !ok(value) => {
                    return refuse(
                        &flag,
                        format!("{flag} {value:?} is not a value it takes here"),
                    )
                }
                Allowed::Suboptions(names) => {
                    for sub in value.split(',') {
                        let (name, v) = match sub.split_once('=') {
                            Some((n, v)) => (n, Some(v)),
                            None => (sub, None),
                        };
                        if let Some(why) = refused_suboption(letter, name, v) {
                            return refuse(&format!("{flag} {name}"), format!("{name}: {why}"));
                        }
                        if !names.contains(&name) {
                            return refuse(
                                &format!("{flag} {name}"),
                                format!(
                                    "{flag} {name:?} is not a suboption allowed here (allowed: {})",
                                    names.join(", ")
                                ),
                            );
                        }
                        if v.is_some_and(|v| !word(v) || v.contains('=')) {
                            return refuse(
                                &format!("{flag} {name}"),
                                format!("{flag} {sub:?}: the value must be a plain word"),
                            );
                        }
                    }
                }
                _ => {}
            }
            break;
        }
    }
    Ok(())
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
    check_mkfs_options(fstype, mkfs_options)?;
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
/// needs.
/// - xfs always gets `nouuid`, because a clone or a restored snapshot
///   carries the same filesystem UUID as its parent and xfs refuses to mount
///   a second filesystem with a UUID already mounted.
/// - A read-only mount (`ro`) of ext3/ext4 gets `noload` and of xfs
///   `norecovery`: a snapshot taken while the filesystem was mounted keeps
///   "needs recovery", and replaying the journal (log) needs a writable
///   device, which a read-only volume's is not (the mount fails with
///   `EROFS`). What is seen is the filesystem as of its last checkpoint:
///   what was still only in the journal when the snapshot was taken is not.
pub fn mount_options<S: AsRef<str>>(fstype: &str, options: &[S]) -> Vec<String> {
    let mut out: Vec<String> = options.iter().map(|s| s.as_ref().to_owned()).collect();
    let has = |out: &[String], want: &str| out.iter().flat_map(|o| o.split(',')).any(|o| o == want);
    if fstype == "xfs" && !has(&out, "nouuid") {
        out.push("nouuid".to_owned());
    }
    if has(&out, "ro") {
        let skip_replay = match fstype {
            "ext4" | "ext3" => Some("noload"),
            "xfs" => Some("norecovery"),
            _ => None,
        };
        if let Some(o) = skip_replay.filter(|o| !has(&out, o)) {
            out.push(o.to_owned());
        }
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
                wait_unheld(device, "e2fsck")?;
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

/// Waits, at most [`HELD_WAIT`], until nothing holds `device` exclusively,
/// as `e2fsck` and an offline `resize2fs` need. Just after an unmount a
/// mount namespace made a moment before (a container starting) can still
/// hold a copy of the filesystem until it drops it. Past the wait, the
/// error names the processes whose namespaces still mount it.
fn wait_unheld(device: &Path, op: &'static str) -> Result<()> {
    if !super::loopdev::in_use_for(device, HELD_WAIT) {
        return Ok(());
    }
    let dev = device.display().to_string();
    let who = match super::mount::other_namespaces_mounting(device) {
        Ok(w) if !w.is_empty() => format!(
            "; still mounted in the mount namespace of {}",
            w.into_iter().take(4).collect::<Vec<_>>().join(", ")
        ),
        _ => String::new(),
    };
    Err(Error::from_errno(libc::EBUSY, op, dev).detail(format!(
        "not mounted here, yet the device is still held exclusively after {HELD_WAIT:?}{who}"
    )))
}

/// Discards the free space of the filesystem mounted at `mount_point`
/// (`fstrim -v`), waiting at most `timeout` (then `fstrim` is killed; a
/// later run starts over, which only discards again). Returns the bytes
/// `fstrim` reports trimmed (0 when it prints no count). The discards reach
/// the image: krbd sends them as discards, rbdkit-fuse's loop device as
/// FALLOCATE, which becomes `rbd_aio_write_zeroes` (whole objects freed).
pub fn trim(mount_point: &Path, timeout: Duration) -> Result<u64> {
    let mp = mount_point.display().to_string();
    let out = command::run("fstrim", "fstrim", &["-v", &mp], &mp, timeout)?;
    let out = check("fstrim", &mp, out)?;
    Ok(trimmed_bytes(&out.stdout))
}

/// The byte count of `fstrim -v`'s line: `/mnt: 1 GiB (1073741824 bytes)
/// trimmed`.
fn trimmed_bytes(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| {
            let (before, _) = l.split_once(" bytes)")?;
            let (_, n) = before.rsplit_once('(')?;
            n.trim().parse::<u64>().ok()
        })
        .sum()
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
    /// Mounted read-only (`ST_RDONLY`): by request, or remounted so by the
    /// kernel after an I/O error (ext4's `errors=remount-ro`).
    pub read_only: bool,
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
        read_only: st.f_flag & libc::ST_RDONLY != 0,
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
    fn fstrim_counts_are_read() {
        assert_eq!(
            trimmed_bytes("/mnt/x: 12 MiB (12582912 bytes) trimmed\n"),
            12582912
        );
        assert_eq!(trimmed_bytes("/mnt/x: 0 B (0 bytes) trimmed\n"), 0);
        assert_eq!(trimmed_bytes(""), 0);
        assert_eq!(trimmed_bytes("garbage (x bytes) trimmed"), 0);
    }

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
    fn read_only_mounts_skip_the_journal_replay() {
        assert_eq!(mount_options("ext4", &["ro"]), ["ro", "noload"]);
        assert_eq!(
            mount_options("ext3", &["noatime,ro"]),
            ["noatime,ro", "noload"]
        );
        assert_eq!(
            mount_options("xfs", &["ro"]),
            ["ro", "nouuid", "norecovery"]
        );
        assert_eq!(mount_options("ext4", &["ro", "noload"]), ["ro", "noload"]);
        assert_eq!(mount_options("ext2", &["ro"]), ["ro"]);
        assert_eq!(mount_options("ext4", &["rw"]), ["rw"]);
    }

    #[test]
    fn mkfs_options_are_checked_against_an_allow_list() {
        let ok = |t: &str, o: &str| check_mkfs_options(t, &parse_mkfs_options(o));
        for (t, o) in [
            (
                "ext4",
                "-m0 -Enodiscard,lazy_itable_init=1,lazy_journal_init=1",
            ),
            (
                "ext4",
                "-b 1024 -L data -O ^metadata_csum,64bit -qF -E root_owner=1000:1000",
            ),
            ("ext3", "-j -J size=64 -i 16384 -T news -U random"),
            ("xfs", "-K"),
            (
                "xfs",
                "-f -K -L vol -b size=4096 -s size=512 -m crc=1,reflink=1",
            ),
            (
                "xfs",
                "-d su=64k,sw=4,agcount=8 -l size=64m,lazy-count=1 -i size=512 -n ftype=1",
            ),
            ("xfs", ""),
        ] {
            ok(t, o).unwrap_or_else(|e| panic!("{t} {o:?}: {e}"));
        }
        for (t, o, named) in [
            ("ext4", "-d /etc", "-d"),
            ("ext4", "-qd /", "-d"),
            ("ext4", "-m0 -d/", "-d"),
            ("ext4", "-E nodiscard,offset=4096", "offset"),
            ("ext4", "-J device=/dev/sdb", "device"),
            ("ext4", "-l /etc/passwd", "-l"),
            ("ext4", "-z /tmp/x", "-z"),
            ("ext4", "-t ext2", "-t"),
            ("ext4", "/dev/sdb", "/dev/sdb"),
            ("ext4", "-b", "needs a value"),
            ("ext4", "-b /x", "-b"),
            ("ext4", "--help", "--help"),
            ("ext4", "-Y", "-Y"),
            ("ext4", "-E root_owner=/etc", "plain word"),
            ("xfs", "-l logdev=/dev/sdb", "logdev"),
            ("xfs", "-l internal=0", "internal"),
            ("xfs", "-r rtdev=/dev/sdb", "-r"),
            ("xfs", "-d name=/dev/sdb", "name"),
            ("xfs", "-p /etc/protofile", "-p"),
            ("xfs", "-c options=/etc/x", "-c"),
            ("xfs", "-N", "-N"),
            ("xfs", "-m bogus=1", "bogus"),
            ("btrfs", "-f", "not supported"),
        ] {
            let e = ok(t, o).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{t} {o:?}");
            let m = e.to_string();
            assert!(
                m.contains("mkfsOptions") && m.contains(named),
                "{t} {o:?}: {m}"
            );
        }
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
