//! A small implementation of the kernel FUSE protocol over `/dev/fuse`
//! (`linux/fuse.h`), just what a filesystem of fixed-size files served
//! from RBD images needs.
//!
//! Why not the `fuser` crate: the mapper needs control over things a
//! general-purpose library decides for you: `max_write` of 1 MiB
//! (`FUSE_MAX_PAGES`, `max_pages = 256`), `FOPEN_DIRECT_IO` and
//! `FOPEN_PARALLEL_DIRECT_WRITES` on open, `FUSE_ASYNC_DIO` so the loop
//! device's requests reach us concurrently, several reader threads on
//! cloned fds (`FUSE_DEV_IOC_CLONE`), replies written from whichever thread
//! completed the librbd request, and owning the `/dev/fuse` fd itself (the
//! mount is made with `mount(2)` directly, no `fusermount`), which is what a
//! restart design needs. The protocol subset is small: about a dozen
//! opcodes with fixed-layout structs.
//!
//! Layout: [`mount`] opens `/dev/fuse`, mounts it and answers `FUSE_INIT`;
//! [`serve`] runs reader threads that hand each request to a [`Handler`]
//! with a [`Reply`] that may be used later from any thread.

use std::ffi::CString;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::node::fuse_journal::{Held, Journal, ReplyAt, Slot, SlotMem, State, REPLY_MAX};

/// The protocol version we speak (`FUSE_KERNEL_VERSION`).
const KERNEL_VERSION: u32 = 7;
/// The minor version we speak; the kernel uses the lower of its and ours.
const KERNEL_MINOR_VERSION: u32 = 40;

/// `max_background` in `fuse_init_out`: the kernel's budget of background
/// requests (asynchronous direct I/O, readahead) in flight on the
/// connection. Every volume of the mapper shares the connection, so each
/// reserves its device's queue depth of it at attach, and an attach that
/// would take more than is left is refused: volumes whose pools stall can
/// hold only what they reserved, never another volume's part (see
/// [`crate::node::fuse`]). 32 volumes at the default queue depth.
pub const MAX_BACKGROUND: u16 = 1024;

/// The most volumes a mapper serves at once (each reserves at least the
/// smallest queue depth, 4, of [`MAX_BACKGROUND`]); the journal keeps two
/// slots per volume for its synchronous requests (flush, discard) beyond
/// the background budget.
pub const MAX_VOLUMES: usize = MAX_BACKGROUND as usize / 4;

/// Largest WRITE payload we accept: 1 MiB.
pub const MAX_WRITE: u32 = 1 << 20;
/// `max_pages` in `fuse_init_out`: 1 MiB of 4 KiB pages.
const MAX_PAGES: u16 = 256;
/// Read buffer: a WRITE's headers plus `MAX_WRITE` (the kernel requires at
/// least that, and at least `FUSE_MIN_READ_BUFFER` = 8192).
const BUFFER_SIZE: usize = MAX_WRITE as usize + 64 * 1024;

/// FUSE opcodes (`enum fuse_opcode`).
#[allow(missing_docs)]
pub mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
}

// `fuse_init_in/out` flags.
const FUSE_ASYNC_READ: u32 = 1 << 0;
const FUSE_BIG_WRITES: u32 = 1 << 5;
const FUSE_ASYNC_DIO: u32 = 1 << 15;
const FUSE_PARALLEL_DIROPS: u32 = 1 << 18;
const FUSE_MAX_PAGES: u32 = 1 << 22;
const FUSE_INIT_EXT: u32 = 1 << 30;
/// `FUSE_HAS_RESEND` (bit 39, so bit 7 of `flags2`): the kernel can resend
/// the requests a dead server had read (`FUSE_NOTIFY_RESEND`, Linux 6.9+).
const FUSE2_HAS_RESEND: u32 = 1 << 7;

/// `FOPEN_DIRECT_IO`: no page cache for this open file.
pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
/// `FOPEN_PARALLEL_DIRECT_WRITES`: the kernel need not serialise direct
/// writes to the file behind the inode lock.
pub const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;

/// `FATTR_SIZE` in `fuse_setattr_in.valid`.
pub const FATTR_SIZE: u32 = 1 << 3;

/// `_IOR(229, 0, uint32_t)`: `FUSE_DEV_IOC_CLONE`.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

/// Plain structs of the protocol: any bit pattern is a valid value and
/// there is no implicit padding, so they may be read from and written as
/// bytes.
///
/// # Safety
/// Only for `repr(C)` structs of integers with explicit padding fields.
pub unsafe trait Pod: Copy {}

/// Reads a `T` from the start of `bytes`, if there are enough.
pub fn read_pod<T: Pod>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < std::mem::size_of::<T>() {
        return None;
    }
    // SAFETY: the length is checked above; `T: Pod` accepts any bit pattern,
    // and `read_unaligned` has no alignment requirement.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// The bytes of a `T`.
pub fn pod_bytes<T: Pod>(v: &T) -> &[u8] {
    // SAFETY: `T: Pod` has no padding, so all its bytes are initialised; the
    // slice borrows `v` and has its exact size.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

macro_rules! pod {
    ($(#[$m:meta])* $name:ident { $($f:ident : $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, Default)]
        #[allow(missing_docs)]
        pub struct $name { $(pub $f: $t),* }
        // SAFETY: repr(C), integer fields only, laid out with explicit
        // padding exactly as in linux/fuse.h.
        unsafe impl Pod for $name {}
    };
}

pod!(
    /// `struct fuse_in_header`.
    InHeader { len: u32, opcode: u32, unique: u64, nodeid: u64, uid: u32, gid: u32, pid: u32, total_extlen: u16, padding: u16 }
);
pod!(
    /// `struct fuse_out_header`.
    OutHeader { len: u32, error: i32, unique: u64 }
);
pod!(
    /// `struct fuse_init_in` (the extended form; older kernels send the
    /// first four fields only).
    InitIn { major: u32, minor: u32, max_readahead: u32, flags: u32, flags2: u32, unused: [u32; 11] }
);
pod!(
    /// `struct fuse_init_out`.
    InitOut {
        major: u32, minor: u32, max_readahead: u32, flags: u32,
        max_background: u16, congestion_threshold: u16, max_write: u32,
        time_gran: u32, max_pages: u16, map_alignment: u16, flags2: u32,
        unused: [u32; 7],
    }
);
pod!(
    /// `struct fuse_attr`.
    Attr {
        ino: u64, size: u64, blocks: u64, atime: u64, mtime: u64, ctime: u64,
        atimensec: u32, mtimensec: u32, ctimensec: u32, mode: u32, nlink: u32,
        uid: u32, gid: u32, rdev: u32, blksize: u32, flags: u32,
    }
);
pod!(
    /// `struct fuse_entry_out`.
    EntryOut { nodeid: u64, generation: u64, entry_valid: u64, attr_valid: u64, entry_valid_nsec: u32, attr_valid_nsec: u32, attr: Attr }
);
pod!(
    /// `struct fuse_attr_out`.
    AttrOut { attr_valid: u64, attr_valid_nsec: u32, dummy: u32, attr: Attr }
);
pod!(
    /// `struct fuse_setattr_in`.
    SetattrIn {
        valid: u32, padding: u32, fh: u64, size: u64, lock_owner: u64,
        atime: u64, mtime: u64, ctime: u64, atimensec: u32, mtimensec: u32,
        ctimensec: u32, mode: u32, unused4: u32, uid: u32, gid: u32, unused5: u32,
    }
);
pod!(
    /// `struct fuse_open_in`.
    OpenIn { flags: u32, open_flags: u32 }
);
pod!(
    /// `struct fuse_open_out`.
    OpenOut { fh: u64, open_flags: u32, padding: u32 }
);
pod!(
    /// `struct fuse_read_in`.
    ReadIn { fh: u64, offset: u64, size: u32, read_flags: u32, lock_owner: u64, flags: u32, padding: u32 }
);
pod!(
    /// `struct fuse_write_in`.
    WriteIn { fh: u64, offset: u64, size: u32, write_flags: u32, lock_owner: u64, flags: u32, padding: u32 }
);
pod!(
    /// `struct fuse_write_out`.
    WriteOut { size: u32, padding: u32 }
);
pod!(
    /// `struct fuse_kstatfs` inside `struct fuse_statfs_out`.
    StatfsOut { blocks: u64, bfree: u64, bavail: u64, files: u64, ffree: u64, bsize: u32, namelen: u32, frsize: u32, padding: u32, spare: [u32; 6] }
);
pod!(
    /// `struct fuse_fallocate_in`.
    FallocateIn { fh: u64, offset: u64, length: u64, mode: u32, padding: u32 }
);
pod!(
    /// The fixed part of `struct fuse_dirent`; the name follows, padded to 8.
    DirentHead { ino: u64, off: u64, namelen: u32, typ: u32 }
);

fn os_err(op: &'static str, object: &Path) -> Error {
    let errno = std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO);
    Error::from_errno(errno, op, object.display().to_string())
}

/// One `/dev/fuse` fd of the connection (the first one, or a clone).
/// Replies must go to the fd the request was read from.
#[derive(Debug)]
pub struct Channel {
    fd: OwnedFd,
}

impl Channel {
    /// A channel over a `/dev/fuse` fd of a mounted connection (one handed
    /// over by another process).
    pub fn from_fd(fd: OwnedFd) -> Channel {
        Channel { fd }
    }

    /// The fd, to hand it to another process.
    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// Writes one message (`writev(2)` of a header and its payload).
    fn send(&self, parts: &[&[u8]]) -> std::io::Result<()> {
        let slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        // SAFETY: `IoSlice` is ABI-compatible with `struct iovec` (std
        // documents it); the slices borrow buffers alive for the call.
        let n = unsafe {
            libc::writev(
                self.fd.as_raw_fd(),
                slices.as_ptr().cast::<libc::iovec>(),
                slices.len() as libc::c_int,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        // SAFETY: `buf` is valid for writes of its length.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// A new fd on the same connection with its own processing queue
    /// (`ioctl(FUSE_DEV_IOC_CLONE)` on a fresh `/dev/fuse` open).
    fn clone_channel(&self) -> Result<Channel> {
        let fd = open_dev_fuse()?;
        let session: u32 = self.fd.as_raw_fd() as u32;
        // SAFETY: FUSE_DEV_IOC_CLONE reads a uint32_t fd of the session to
        // join (linux/fuse.h); both fds are live.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), FUSE_DEV_IOC_CLONE as _, &session) };
        if r != 0 {
            return Err(os_err("ioctl(FUSE_DEV_IOC_CLONE)", Path::new("/dev/fuse")));
        }
        Ok(Channel { fd })
    }
}

fn open_dev_fuse() -> Result<OwnedFd> {
    let path = c"/dev/fuse";
    // SAFETY: a NUL-terminated path and plain flags (open(2)).
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(os_err("open", Path::new("/dev/fuse")));
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// What `FUSE_INIT` settled.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct InitInfo {
    /// The kernel's protocol minor version.
    pub kernel_minor: u32,
    /// The minor version in use (the lower of the kernel's and ours).
    pub minor: u32,
    /// `max_write` in use.
    pub max_write: u32,
    /// The kernel can resend in-flight requests (`FUSE_HAS_RESEND`).
    /// Reported only: a restarted worker serves them again from its
    /// journal on every kernel.
    #[serde(default)]
    pub resend: bool,
}

/// A mounted FUSE filesystem: the first channel and what INIT settled.
#[derive(Debug)]
pub struct Session {
    /// The first `/dev/fuse` fd.
    pub channel: Arc<Channel>,
    /// The INIT result.
    pub init: InitInfo,
}

/// Mounts a FUSE filesystem at `mountpoint` (`open("/dev/fuse")`,
/// `mount(2)` with `fd=N,rootmode=40000,user_id=0,group_id=0,allow_other`)
/// and answers the kernel's `FUSE_INIT`.
pub fn mount(mountpoint: &Path, fsname: &str) -> Result<Session> {
    let fd = open_dev_fuse()?;
    let opts = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,allow_other",
        fd.as_raw_fd()
    );
    let c_src = CString::new(fsname)
        .map_err(|_| Error::invalid("mount", fsname, "NUL in the filesystem name"))?;
    let c_target = CString::new(mountpoint.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::invalid("mount", mountpoint.display().to_string(), "NUL in path"))?;
    let c_type = c"fuse.rbdkit";
    let c_opts = CString::new(opts).expect("no NUL in numbers");
    // SAFETY: all strings are NUL-terminated and live for the call; `data`
    // is the option string the fuse filesystem parses (mount(2)).
    let r = unsafe {
        libc::mount(
            c_src.as_ptr(),
            c_target.as_ptr(),
            c_type.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME,
            c_opts.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(os_err("mount(fuse)", mountpoint));
    }
    let channel = Arc::new(Channel { fd });
    let init = match answer_init(&channel) {
        Ok(i) => i,
        Err(e) => {
            let _ = unmount_lazy(mountpoint);
            return Err(e);
        }
    };
    Ok(Session { channel, init })
}

fn answer_init(ch: &Arc<Channel>) -> Result<InitInfo> {
    let dev = Path::new("/dev/fuse");
    let mut buf = vec![0u8; BUFFER_SIZE];
    let n = loop {
        match ch.read(&mut buf) {
            Ok(n) => break n,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => {
                return Err(Error::from_errno(
                    e.raw_os_error().unwrap_or(libc::EIO),
                    "read(FUSE_INIT)",
                    "/dev/fuse",
                ))
            }
        }
    };
    let hdr: InHeader = read_pod(&buf[..n])
        .ok_or_else(|| Error::invalid("read(FUSE_INIT)", "/dev/fuse", "short message"))?;
    if hdr.opcode != op::INIT {
        return Err(Error::invalid(
            "read(FUSE_INIT)",
            "/dev/fuse",
            format!("first message has opcode {}, not INIT", hdr.opcode),
        ));
    }
    let body = &buf[std::mem::size_of::<InHeader>()..n];
    let mut init_in = InitIn::default();
    let m = body.len().min(std::mem::size_of::<InitIn>());
    let mut raw = [0u8; std::mem::size_of::<InitIn>()];
    raw[..m].copy_from_slice(&body[..m]);
    if let Some(v) = read_pod::<InitIn>(&raw) {
        init_in = v;
    }
    let reply = Reply::new(Arc::clone(ch), hdr.unique);
    if init_in.major != KERNEL_VERSION || init_in.minor < 28 {
        reply.error(libc::EPROTO);
        return Err(
            Error::from_errno(libc::EPROTO, "FUSE_INIT", dev.display().to_string()).detail(
                format!(
                    "kernel speaks FUSE {}.{}, need 7.28+",
                    init_in.major, init_in.minor
                ),
            ),
        );
    }
    let minor = init_in.minor.min(KERNEL_MINOR_VERSION);
    let want = FUSE_ASYNC_READ
        | FUSE_BIG_WRITES
        | FUSE_ASYNC_DIO
        | FUSE_PARALLEL_DIROPS
        | FUSE_MAX_PAGES
        | FUSE_INIT_EXT;
    let out = InitOut {
        major: KERNEL_VERSION,
        minor,
        max_readahead: init_in.max_readahead,
        flags: init_in.flags & want,
        max_background: MAX_BACKGROUND,
        congestion_threshold: MAX_BACKGROUND / 4 * 3,
        max_write: MAX_WRITE,
        time_gran: 1,
        max_pages: MAX_PAGES,
        flags2: 0,
        ..Default::default()
    };
    reply.ok(pod_bytes(&out));
    Ok(InitInfo {
        kernel_minor: init_in.minor,
        minor,
        max_write: MAX_WRITE,
        resend: init_in.flags & FUSE_INIT_EXT != 0 && init_in.flags2 & FUSE2_HAS_RESEND != 0,
    })
}

/// Detaches the mount at `path` lazily (`umount2(MNT_DETACH)`): users that
/// still hold files keep them, the name goes at once. Succeeds when nothing
/// is mounted there.
pub fn unmount_lazy(path: &Path) -> Result<()> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::invalid("umount2", path.display().to_string(), "NUL in path"))?;
    // SAFETY: a NUL-terminated path and a flag (umount2(2)).
    let r = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    if r != 0 {
        let e = os_err("umount2", path);
        if e.errno() == libc::EINVAL || e.errno() == libc::ENOENT {
            return Ok(());
        }
        return Err(e);
    }
    Ok(())
}

/// The answer to one request; send it once, from any thread. It owns the
/// journal slot the request was read into (so the request's bytes stay
/// until it is answered), and records the reply there before writing it
/// (see [`crate::node::fuse_journal`]).
pub struct Reply {
    ch: Arc<Channel>,
    unique: u64,
    slot: Option<Slot>,
    len: usize,
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reply")
            .field("unique", &self.unique)
            .finish()
    }
}

impl Reply {
    fn new(ch: Arc<Channel>, unique: u64) -> Reply {
        Reply {
            ch,
            unique,
            slot: None,
            len: 0,
        }
    }

    /// The request's bytes after its `fuse_in_header`.
    pub fn body(&self) -> &[u8] {
        match &self.slot {
            Some(s) => s
                .request(self.len)
                .get(std::mem::size_of::<InHeader>()..)
                .unwrap_or(&[]),
            None => &[],
        }
    }

    /// `len` bytes of the slot's data region, lent to librbd: a WRITE's
    /// payload, or where a READ's data goes (then answer with
    /// [`Reply::ok_data`]).
    pub fn data_mem(&self, len: usize) -> Option<SlotMem> {
        self.slot.as_ref().map(|s| s.data_mem(len))
    }

    /// `len` bytes of the slot's data region: a WRITE's payload.
    pub fn data(&self, len: usize) -> Option<&[u8]> {
        self.slot.as_ref().map(|s| s.data(len))
    }

    /// `len` bytes of the slot's data region to change in place: a READ's
    /// data after librbd filled it, before [`Reply::ok_data`].
    pub fn data_mut(&mut self, len: usize) -> Option<&mut [u8]> {
        self.slot.as_mut().map(|s| s.data_mut(len))
    }

    fn write(ch: &Channel, unique: u64, error: i32, payload: &[u8]) {
        let len = std::mem::size_of::<OutHeader>() + payload.len();
        let hdr = OutHeader {
            len: len as u32,
            error,
            unique,
        };
        // ENOENT: the request was interrupted or the connection aborted,
        // or (a recorded reply sent again) it was answered already; nobody
        // waits for this answer any more.
        let _ = ch.send(&[pod_bytes(&hdr), payload]);
    }

    fn finish(mut self, error: i32, at: ReplyAt, payload: &[u8], len: usize) {
        match self.slot.as_mut() {
            Some(slot) => {
                slot.record(error, at, payload, len);
                let (error, recorded) = slot.recorded();
                Reply::write(&self.ch, self.unique, error, recorded);
            }
            None => Reply::write(&self.ch, self.unique, error, payload),
        }
    }

    /// Success with a payload.
    pub fn ok(self, payload: &[u8]) {
        let at = if payload.len() <= REPLY_MAX {
            ReplyAt::Small
        } else {
            ReplyAt::Dir
        };
        self.finish(0, at, payload, payload.len());
    }

    /// Success with the `len` bytes a READ put at the slot's data region.
    pub fn ok_data(self, len: usize) {
        self.finish(0, ReplyAt::Data, &[], len);
    }

    /// Failure with a positive errno.
    pub fn error(self, errno: i32) {
        self.finish(-errno.abs(), ReplyAt::Small, &[], 0);
    }

    /// Sends the reply a previous worker recorded, again.
    fn resend(self) {
        if let Some(slot) = &self.slot {
            let (error, recorded) = slot.recorded();
            Reply::write(&self.ch, self.unique, error, recorded);
        }
    }
}

/// The filesystem side: gets every request except INIT.
pub trait Handler: Send + Sync + 'static {
    /// Handles one request; its body is [`Reply::body`]. FORGET,
    /// BATCH_FORGET and INTERRUPT take no answer: drop their `reply`.
    fn request(&self, hdr: &InHeader, reply: Reply);
}

/// The session's channel plus `threads - 1` clones: one per reader thread.
pub fn clone_channels(session: &Session, threads: usize) -> Result<Vec<Arc<Channel>>> {
    let mut channels = vec![Arc::clone(&session.channel)];
    for _ in 1..threads.max(1) {
        channels.push(Arc::new(session.channel.clone_channel()?));
    }
    Ok(channels)
}

/// Serves again what a previous worker left in `held` (from
/// [`Journal::open`]): sends recorded replies again and hands unanswered
/// requests to `handler`, each to be answered on the channel it was read
/// from. Returns (requests served again, recorded replies sent again).
pub fn replay<H: Handler>(channels: &[Arc<Channel>], held: Held, handler: &H) -> (usize, usize) {
    let (mut served, mut resent) = (0, 0);
    for (slot, state) in held {
        let Some(ch) = channels.get(slot.channel() as usize) else {
            tracing::warn!(
                channel = slot.channel(),
                "journal slot of an unknown channel"
            );
            continue;
        };
        let Some(hdr) = read_pod::<InHeader>(slot.request(usize::MAX)) else {
            continue;
        };
        let reply = Reply {
            ch: Arc::clone(ch),
            unique: hdr.unique,
            len: hdr.len as usize,
            slot: Some(slot),
        };
        if state == State::Done {
            reply.resend();
            resent += 1;
        } else {
            handler.request(&hdr, reply);
            served += 1;
        }
    }
    (served, resent)
}

/// Starts one reader thread per channel, each reading requests into slots
/// of `journal`. They return when the filesystem is unmounted or the
/// connection aborted (`ENODEV`).
pub fn serve<H: Handler>(
    channels: &[Arc<Channel>],
    journal: &Arc<Journal>,
    handler: Arc<H>,
) -> Result<Vec<std::thread::JoinHandle<()>>> {
    let mut handles = Vec::new();
    for (i, ch) in channels.iter().enumerate() {
        let h = Arc::clone(&handler);
        let ch = Arc::clone(ch);
        let j = Arc::clone(journal);
        let t = std::thread::Builder::new()
            .name(format!("fuse-{i}"))
            .spawn(move || reader(i as u32, ch, j, h))
            .map_err(|e| {
                Error::from_errno(
                    e.raw_os_error().unwrap_or(libc::EAGAIN),
                    "spawn",
                    "fuse reader",
                )
            })?;
        handles.push(t);
    }
    Ok(handles)
}

fn reader<H: Handler>(idx: u32, ch: Arc<Channel>, journal: Arc<Journal>, handler: Arc<H>) {
    loop {
        let mut slot = journal.acquire(idx);
        let n = match ch.read(slot.read_buf()) {
            Ok(n) => n,
            // ENOENT: the request was interrupted before we read it.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::ENOENT)
                ) =>
            {
                continue
            }
            // ENODEV: unmounted or the connection was aborted.
            Err(_) => return,
        };
        slot.mark_in_flight();
        let Some(hdr) = read_pod::<InHeader>(slot.request(n)) else {
            continue;
        };
        let reply = Reply {
            ch: Arc::clone(&ch),
            unique: hdr.unique,
            len: (hdr.len as usize).min(n),
            slot: Some(slot),
        };
        handler.request(&hdr, reply);
    }
}

/// Appends one `struct fuse_dirent` (padded to 8 bytes) to `out`, if it
/// fits in `max` bytes. Returns false when it does not.
pub fn push_dirent(
    out: &mut Vec<u8>,
    max: usize,
    ino: u64,
    off: u64,
    typ: u32,
    name: &[u8],
) -> bool {
    let head = DirentHead {
        ino,
        off,
        namelen: name.len() as u32,
        typ,
    };
    let len = std::mem::size_of::<DirentHead>() + name.len();
    let padded = len.div_ceil(8) * 8;
    if out.len() + padded > max {
        return false;
    }
    out.extend_from_slice(pod_bytes(&head));
    out.extend_from_slice(name);
    out.resize(out.len() + padded - len, 0);
    true
}
