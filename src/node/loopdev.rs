//! Loop devices through their ioctls (`linux/loop.h`), not `losetup`.
//!
//! [`attach`] takes a free device from `/dev/loop-control`
//! (`LOOP_CTL_GET_FREE`) and binds a file to it with `LOOP_CONFIGURE`
//! (falling back to `LOOP_SET_FD` + `LOOP_SET_STATUS64` on kernels before
//! 5.8). Another process may take the same free device between the two
//! calls; the bind then fails with `EBUSY` and we ask for another one.
//! [`find_by_backing_file`] scans `/sys/block/loop*/loop/backing_file`, which
//! is how a restarted process finds the devices it bound before.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

const LOOP_SET_FD: libc::c_ulong = 0x4C00;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
const LOOP_SET_CAPACITY: libc::c_ulong = 0x4C07;
const LOOP_SET_DIRECT_IO: libc::c_ulong = 0x4C08;
const LOOP_SET_BLOCK_SIZE: libc::c_ulong = 0x4C09;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;

/// `LO_FLAGS_READ_ONLY`.
const LO_FLAGS_READ_ONLY: u32 = 1;
/// `LO_FLAGS_DIRECT_IO`.
const LO_FLAGS_DIRECT_IO: u32 = 16;

const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

/// `struct loop_info64` from `linux/loop.h`.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

/// `struct loop_config` from `linux/loop.h`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// How to bind a file.
#[derive(Debug, Clone, Copy)]
pub struct LoopOptions {
    /// `LO_FLAGS_READ_ONLY`: the device refuses writes.
    pub read_only: bool,
    /// `LO_FLAGS_DIRECT_IO`: the device reads and writes the file with
    /// direct I/O, so the file's pages are not cached a second time.
    pub direct_io: bool,
    /// The logical block size of the device (512 to 4096; 0 keeps the
    /// kernel's default).
    pub block_size: u32,
}

/// How often to ask for another free device when another process took
/// the one we were given.
const ATTACH_ATTEMPTS: u32 = 20;
/// How long [`detach`] retries a device that is still busy.
const DETACH_TIMEOUT: Duration = Duration::from_secs(10);

fn ioctl_err(op: &'static str, object: &Path) -> Error {
    let errno = std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO);
    Error::from_errno(errno, op, object.display().to_string())
}

fn io_err(e: std::io::Error, op: &'static str, object: &Path) -> Error {
    Error::from_errno(
        e.raw_os_error().unwrap_or(libc::EIO),
        op,
        object.display().to_string(),
    )
}

/// Asks `/dev/loop-control` for a free device (`ioctl(LOOP_CTL_GET_FREE)`)
/// and returns its path; the kernel creates the node if needed.
pub fn get_free() -> Result<PathBuf> {
    let ctl_path = Path::new("/dev/loop-control");
    let ctl = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(ctl_path)
        .map_err(|e| io_err(e, "open", ctl_path))?;
    // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns the device
    // number (loop(4)); the fd is a live /dev/loop-control.
    let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
    if n < 0 {
        return Err(ioctl_err("ioctl(LOOP_CTL_GET_FREE)", ctl_path));
    }
    Ok(PathBuf::from(format!("/dev/loop{n}")))
}

/// Binds `file` to a free loop device and returns the device path.
///
/// Wraps `ioctl(LOOP_CTL_GET_FREE)` and `ioctl(LOOP_CONFIGURE)` (or
/// `LOOP_SET_FD`, `LOOP_SET_STATUS64`, `LOOP_SET_DIRECT_IO` and
/// `LOOP_SET_BLOCK_SIZE` where `LOOP_CONFIGURE` is missing). `file` must be
/// open for writing unless `opts.read_only`. Retries with another device
/// when a racing process took the free one.
pub fn attach(file: &File, file_path: &Path, opts: LoopOptions) -> Result<PathBuf> {
    let mut last = None;
    for _ in 0..ATTACH_ATTEMPTS {
        let dev = get_free()?;
        match attach_to(&dev, file, file_path, opts) {
            Ok(()) => return Ok(dev),
            // EBUSY: someone bound it first. ENXIO/ENOENT: it went away.
            Err(e) if matches!(e.errno(), libc::EBUSY | libc::ENXIO | libc::ENOENT) => {
                last = Some(e);
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
    Err(last
        .unwrap_or_else(|| Error::from_errno(libc::EBUSY, "ioctl(LOOP_CONFIGURE)", "/dev/loop*"))
        .detail(format!(
            "no free loop device after {ATTACH_ATTEMPTS} attempts (each was taken by another process)"
        )))
}

fn open_dev(dev: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(dev)
        .map_err(|e| io_err(e, "open", dev))
}

fn file_name_field(path: &Path) -> [u8; LO_NAME_SIZE] {
    let mut name = [0u8; LO_NAME_SIZE];
    let bytes = path.as_os_str().as_encoded_bytes();
    let n = bytes.len().min(LO_NAME_SIZE - 1);
    name[..n].copy_from_slice(&bytes[..n]);
    name
}

fn attach_to(dev: &Path, file: &File, file_path: &Path, opts: LoopOptions) -> Result<()> {
    let loopf = open_dev(dev)?;
    let mut flags = 0;
    if opts.read_only {
        flags |= LO_FLAGS_READ_ONLY;
    }
    if opts.direct_io {
        flags |= LO_FLAGS_DIRECT_IO;
    }
    // SAFETY: all-zero is a valid `loop_info64` (plain integers and arrays).
    let mut info: LoopInfo64 = unsafe { std::mem::zeroed() };
    info.lo_flags = flags;
    info.lo_file_name = file_name_field(file_path);
    let cfg = LoopConfig {
        fd: file.as_raw_fd() as u32,
        block_size: opts.block_size,
        info,
        reserved: [0; 8],
    };
    // SAFETY: LOOP_CONFIGURE reads one `struct loop_config` (linux/loop.h),
    // which `cfg` is, laid out `repr(C)`; both fds are live.
    let r = unsafe { libc::ioctl(loopf.as_raw_fd(), LOOP_CONFIGURE as _, &cfg) };
    if r == 0 {
        return Ok(());
    }
    let err = ioctl_err("ioctl(LOOP_CONFIGURE)", dev);
    if err.errno() != libc::EINVAL && err.errno() != libc::ENOTTY {
        return Err(err);
    }
    // Before Linux 5.8: the same in four steps.
    // SAFETY: LOOP_SET_FD takes the backing fd as its argument (loop(4)).
    let r = unsafe { libc::ioctl(loopf.as_raw_fd(), LOOP_SET_FD as _, file.as_raw_fd()) };
    if r != 0 {
        return Err(ioctl_err("ioctl(LOOP_SET_FD)", dev));
    }
    // READ_ONLY is taken from how the fd was opened with LOOP_SET_FD, and
    // DIRECT_IO has its own ioctl.
    info.lo_flags = 0;
    // SAFETY: LOOP_SET_STATUS64 reads one `struct loop_info64`.
    let r = unsafe { libc::ioctl(loopf.as_raw_fd(), LOOP_SET_STATUS64 as _, &info) };
    let mut fail = (r != 0).then(|| ioctl_err("ioctl(LOOP_SET_STATUS64)", dev));
    if fail.is_none() && opts.block_size != 0 {
        // SAFETY: LOOP_SET_BLOCK_SIZE takes the size as its argument.
        let r = unsafe {
            libc::ioctl(
                loopf.as_raw_fd(),
                LOOP_SET_BLOCK_SIZE as _,
                opts.block_size as libc::c_ulong,
            )
        };
        fail = (r != 0).then(|| ioctl_err("ioctl(LOOP_SET_BLOCK_SIZE)", dev));
    }
    if fail.is_none() && opts.direct_io {
        // SAFETY: LOOP_SET_DIRECT_IO takes 0 or 1 as its argument.
        let r = unsafe {
            libc::ioctl(
                loopf.as_raw_fd(),
                LOOP_SET_DIRECT_IO as _,
                1 as libc::c_ulong,
            )
        };
        fail = (r != 0).then(|| ioctl_err("ioctl(LOOP_SET_DIRECT_IO)", dev));
    }
    if let Some(e) = fail {
        // SAFETY: LOOP_CLR_FD takes no argument; undo the half-done bind.
        unsafe { libc::ioctl(loopf.as_raw_fd(), LOOP_CLR_FD as _, 0) };
        return Err(e);
    }
    Ok(())
}

/// Unbinds `dev` (`ioctl(LOOP_CLR_FD)`). Succeeds if it is not bound (or
/// does not exist). Retries `EBUSY` for a bounded time. If the device is
/// still open elsewhere (a mounted filesystem) the kernel only marks it to
/// be cleared when its last user closes it, and this returns `Ok` at once.
pub fn detach(dev: &Path) -> Result<()> {
    let deadline = Instant::now() + DETACH_TIMEOUT;
    loop {
        let f = match open_dev(dev) {
            Ok(f) => f,
            Err(e) if matches!(e.errno(), libc::ENOENT | libc::ENXIO) => return Ok(()),
            Err(e) => return Err(e),
        };
        // SAFETY: LOOP_CLR_FD takes no argument (loop(4)); the fd is live.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), LOOP_CLR_FD as _, 0) };
        if r == 0 {
            return Ok(());
        }
        let e = ioctl_err("ioctl(LOOP_CLR_FD)", dev);
        match e.errno() {
            // Not bound (any more).
            libc::ENXIO => return Ok(()),
            libc::EBUSY if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            libc::EBUSY => {
                return Err(e.detail(format!("still busy after {} s", DETACH_TIMEOUT.as_secs())))
            }
            _ => return Err(e),
        }
    }
}

/// Makes `dev` re-read the size of its backing file
/// (`ioctl(LOOP_SET_CAPACITY)`).
pub fn set_capacity(dev: &Path) -> Result<()> {
    let f = open_dev(dev)?;
    // SAFETY: LOOP_SET_CAPACITY takes no argument (loop(4)); the fd is live.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), LOOP_SET_CAPACITY as _, 0) };
    if r != 0 {
        return Err(ioctl_err("ioctl(LOOP_SET_CAPACITY)", dev));
    }
    Ok(())
}

fn sys_dir(dev: &Path) -> Option<PathBuf> {
    let name = dev.file_name()?.to_str()?;
    name.starts_with("loop")
        .then(|| PathBuf::from("/sys/block").join(name))
}

/// The backing file of `dev` as the kernel shows it
/// (`/sys/block/loopN/loop/backing_file`), or `None` if it is not bound.
pub fn backing_file(dev: &Path) -> Option<PathBuf> {
    let dir = sys_dir(dev)?;
    let text = std::fs::read_to_string(dir.join("loop/backing_file")).ok()?;
    let t = text.trim_end_matches('\n');
    (!t.is_empty()).then(|| PathBuf::from(t))
}

/// Whether `dev` does direct I/O on its file (`/sys/block/loopN/loop/dio`).
pub fn direct_io(dev: &Path) -> bool {
    sys_dir(dev)
        .and_then(|d| std::fs::read_to_string(d.join("loop/dio")).ok())
        .is_some_and(|s| s.trim() == "1")
}

/// Writes one block-queue setting of `dev` (`/sys/block/loopN/queue/NAME`,
/// e.g. `nr_requests`, `max_sectors_kb`).
pub fn set_queue_attr(dev: &Path, name: &str, value: &str) -> Result<()> {
    let path = sys_dir(dev)
        .ok_or_else(|| {
            Error::invalid("write", dev.display().to_string(), "not a loop device name")
        })?
        .join("queue")
        .join(name);
    std::fs::write(&path, value)
        .map_err(|e| io_err(e, "write", &path).detail(format!("cannot set {name} to {value}")))
}

/// One block-queue setting of `dev` (`/sys/block/loopN/queue/NAME`).
pub fn queue_attr(dev: &Path, name: &str) -> Option<String> {
    let text = std::fs::read_to_string(sys_dir(dev)?.join("queue").join(name)).ok()?;
    Some(text.trim().to_owned())
}

/// The size of `dev` in bytes (`/sys/block/loopN/size`, in 512-byte sectors).
pub fn size(dev: &Path) -> Option<u64> {
    let dir = sys_dir(dev)?;
    let text = std::fs::read_to_string(dir.join("size")).ok()?;
    text.trim().parse::<u64>().ok().map(|s| s * 512)
}

/// Every bound loop device with its backing file, from
/// `/sys/block/loop*/loop/backing_file`.
pub fn list() -> Vec<(PathBuf, PathBuf)> {
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for ent in rd.flatten() {
        let name = ent.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("loop") {
            continue;
        }
        let dev = PathBuf::from("/dev").join(name);
        if let Some(b) = backing_file(&dev) {
            out.push((dev, b));
        }
    }
    out.sort();
    out
}

/// The devices whose backing file is `file`.
pub fn find_by_backing_file(file: &Path) -> Vec<PathBuf> {
    list()
        .into_iter()
        .filter(|(_, b)| b == file)
        .map(|(d, _)| d)
        .collect()
}

/// Whether something holds `dev` open exclusively (a mounted filesystem, a
/// device-mapper target): an `O_EXCL` open of a block device fails with
/// `EBUSY` then (open(2)).
pub fn in_use(dev: &Path) -> bool {
    match std::fs::metadata(dev) {
        Ok(m) if m.file_type().is_block_device() => {}
        _ => return false,
    }
    let r = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL | libc::O_CLOEXEC)
        .open(dev);
    matches!(r, Err(e) if e.raw_os_error() == Some(libc::EBUSY))
}

/// [`in_use`] still after `within`, looked at every 50 ms: a holder that is
/// closing (a filesystem tool that just exited, a probe woken by the
/// device's change event) is not taken for a mount.
pub fn in_use_for(dev: &Path, within: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + within;
    while in_use(dev) {
        if std::time::Instant::now() >= deadline {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    false
}
