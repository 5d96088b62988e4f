//! The worker's request journal: the slots its FUSE reader threads read
//! requests into, in a memfd the supervisor keeps across worker restarts.
//!
//! Every request the kernel hands the worker is read straight into a slot
//! (no copy: a WRITE's data is handed to librbd from there, a READ's data
//! is read by librbd into the same slot and written to the kernel from
//! there), and the slot's state says how far the request got:
//!
//! | state | meaning | a new worker |
//! |---|---|---|
//! | `FREE` | nothing | - |
//! | `READING` | a reader is in `read(2)` on channel `channel`; the request's `unique` was zeroed first | a `unique` other than 0: the request arrived, serve it; 0: nothing |
//! | `IN_FLIGHT` | read, not answered | serve it again |
//! | `DONE` | answered, or about to be: the reply is recorded in the slot | send the recorded reply again |
//!
//! A reply is recorded (`DONE`) *before* it is written to `/dev/fuse`, so a
//! request whose answer the kernel may have seen is never executed again;
//! a recorded reply sent twice is refused by the kernel (`ENOENT`: that
//! `unique` is no longer pending) and harms nothing. Why serving an
//! unanswered request again is safe for block semantics, see
//! [`crate::node::fuse_daemon`] ("Requests in flight across a restart").
//!
//! Layout: a header page, then [`SLOTS`] slots of [`SLOT_SIZE`] bytes.
//! Within a slot: the control words at 0, small replies at [`REPLY_AT`],
//! the request read so that a WRITE's data starts at [`DATA_AT`] (page
//! aligned), a READ's data at [`DATA_AT`] too, a READDIR reply at
//! [`DIR_AT`].

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Error, Result};
use crate::node::fuse_kernel::MAX_WRITE;

/// Where a slot's request data (a WRITE's payload, a READ's reply) starts.
pub const DATA_AT: usize = 4096;
/// Where the request is read: `fuse_in_header` and `fuse_write_in` (40
/// bytes each) end exactly at [`DATA_AT`].
pub const REQUEST_AT: usize = DATA_AT - 80;
/// Where replies of up to [`REPLY_MAX`] bytes are recorded.
pub const REPLY_AT: usize = 64;
/// The largest reply recorded at [`REPLY_AT`].
pub const REPLY_MAX: usize = 1024;
/// Where a READDIR reply is recorded (past any READDIR request).
pub const DIR_AT: usize = 2 * DATA_AT;
/// One slot: a control page plus the largest WRITE's data.
pub const SLOT_SIZE: usize = DATA_AT + MAX_WRITE as usize;
/// Slots: more than the kernel can have in flight (`max_background`, plus
/// two synchronous requests per volume, plus the filesystem's own), so a
/// reader never waits for one while requests a stalled volume holds keep
/// theirs. Sparse: a slot's pages exist only while a request uses them.
pub const SLOTS: usize = crate::node::fuse_kernel::MAX_BACKGROUND as usize
    + 2 * crate::node::fuse_kernel::MAX_VOLUMES
    + 64;

/// Free slots kept populated when idle (the most recently used ones: at
/// least one per reader thread waits in `read(2)` at any time).
const KEEP_POPULATED: usize = 8;
/// How long a free slot beyond those stays populated.
const TRIM_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

const HEAD: usize = 4096;
const MAGIC: u64 = 0x7262_646b_6a6e_6c31; // "rbdkjnl1"

/// The state of a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum State {
    /// Nothing in it.
    Free = 0,
    /// A reader waits in `read(2)` with it.
    Reading = 1,
    /// A request read and not answered.
    InFlight = 2,
    /// The reply is recorded.
    Done = 3,
}

/// Where a recorded reply's payload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ReplyAt {
    /// At [`REPLY_AT`].
    Small = 0,
    /// At [`DATA_AT`] (a READ).
    Data = 1,
    /// At [`DIR_AT`] (a READDIR).
    Dir = 2,
}

/// The control words at the start of each slot.
#[repr(C)]
struct Control {
    state: AtomicU32,
    channel: AtomicU32,
    reply_error: AtomicU32,
    reply_at: AtomicU32,
    reply_len: AtomicU32,
    /// The slot's pages were allocated (see [`Journal::populate`]).
    populated: AtomicU32,
}

/// The slots a previous worker left holding requests, with their states.
pub type Held = Vec<(Slot, State)>;

/// The journal's mapping, shared by the worker's threads.
pub struct Journal {
    base: *mut u8,
    len: usize,
    fd: OwnedFd,
    free: Mutex<Vec<u32>>,
    freed: Condvar,
}

// SAFETY: the mapping is plain shared memory; each slot is used by the one
// `Slot` that owns it (handed out under the `free` lock), the header only
// read after `open`/`create`.
unsafe impl Send for Journal {}
// SAFETY: as above.
unsafe impl Sync for Journal {}

impl Drop for Journal {
    fn drop(&mut self) {
        // SAFETY: our own mapping; no `Slot` outlives the `Arc<Journal>`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn os_err(op: &'static str) -> Error {
    let errno = std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO);
    Error::from_errno(errno, op, "fuse journal")
}

fn map(fd: &OwnedFd, len: usize) -> Result<*mut u8> {
    // SAFETY: a shared mapping of our own memfd, of its whole size.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_err("mmap"));
    }
    Ok(p.cast())
}

impl Journal {
    /// A new, empty journal in a fresh memfd.
    pub fn create() -> Result<Arc<Journal>> {
        // SAFETY: a NUL-terminated name and flags (memfd_create(2)).
        let raw = unsafe { libc::memfd_create(c"rbdkit-fuse-journal".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os_err("memfd_create"));
        }
        // SAFETY: `raw` was just created and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let len = HEAD + SLOTS * SLOT_SIZE;
        // SAFETY: ftruncate(2) on our memfd; the pages stay unallocated
        // until touched.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_err("ftruncate"));
        }
        let base = map(&fd, len)?;
        // SAFETY: the header page is ours and 8-aligned.
        unsafe {
            base.cast::<u64>().write(MAGIC);
            base.add(8).cast::<u64>().write(SLOTS as u64);
            base.add(16).cast::<u64>().write(SLOT_SIZE as u64);
        }
        let j = Journal {
            base,
            len,
            fd,
            free: Mutex::new((0..SLOTS as u32).rev().collect()),
            freed: Condvar::new(),
        };
        Ok(Arc::new(j))
    }

    /// The journal a previous worker left in `fd`, with the slots that hold
    /// requests: `IN_FLIGHT` (and `READING` ones whose request arrived) and
    /// `DONE` ones, each with its state. Every other slot is free.
    pub fn open(fd: OwnedFd) -> Result<(Arc<Journal>, Held)> {
        let len = HEAD + SLOTS * SLOT_SIZE;
        // SAFETY: fstat(2) into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_err("fstat"));
        }
        if st.st_size as usize != len {
            return Err(Error::invalid(
                "open",
                "fuse journal",
                format!("{} bytes, not {len}", st.st_size),
            ));
        }
        let base = map(&fd, len)?;
        // SAFETY: the header page, 8-aligned, inside the mapping.
        let (magic, slots, size) = unsafe {
            (
                base.cast::<u64>().read(),
                base.add(8).cast::<u64>().read(),
                base.add(16).cast::<u64>().read(),
            )
        };
        let j = Arc::new(Journal {
            base,
            len,
            fd,
            free: Mutex::new(Vec::new()),
            freed: Condvar::new(),
        });
        if magic != MAGIC || slots != SLOTS as u64 || size != SLOT_SIZE as u64 {
            return Err(Error::invalid(
                "open",
                "fuse journal",
                "not a journal of this version",
            ));
        }
        let mut held = Vec::new();
        let mut free = Vec::new();
        for i in (0..SLOTS as u32).rev() {
            let ctl = j.control(i);
            if ctl.populated.load(Ordering::Relaxed) != 0 {
                j.populate(i);
            }
            // SAFETY: the slot's `unique`, inside the mapping, 8-aligned.
            let unique = unsafe { j.slot_ptr(i, REQUEST_AT + 8).cast::<u64>().read_volatile() };
            let state = match ctl.state.load(Ordering::SeqCst) {
                1 if unique != 0 => State::InFlight,
                2 => State::InFlight,
                3 => State::Done,
                _ => State::Free,
            };
            ctl.state.store(state as u32, Ordering::SeqCst);
            if state == State::Free {
                free.push(i);
            } else {
                let slot = Slot {
                    j: Arc::clone(&j),
                    idx: i,
                };
                held.push((slot, state));
            }
        }
        *j.free.lock().unwrap_or_else(|e| e.into_inner()) = free;
        Ok((j, held))
    }

    /// The memfd, to hand to the supervisor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A free slot for a `read(2)` on channel `channel`: marked `READING`
    /// with the request's `unique` zeroed. Waits while every slot is busy.
    pub fn acquire(self: &Arc<Self>, channel: u32) -> Slot {
        let idx = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(i) = free.pop() {
                    break i;
                }
                free = self.freed.wait(free).unwrap_or_else(|e| e.into_inner());
            }
        };
        if self.control(idx).populated.load(Ordering::Relaxed) == 0 {
            self.populate(idx);
            self.control(idx).populated.store(1, Ordering::Relaxed);
        }
        let slot = Slot {
            j: Arc::clone(self),
            idx,
        };
        // SAFETY: the `unique` of the request header inside our slot,
        // 8-aligned (REQUEST_AT + 8 is).
        unsafe { slot.ptr(REQUEST_AT + 8).cast::<u64>().write_volatile(0) };
        slot.ctl().channel.store(channel, Ordering::Relaxed);
        slot.ctl()
            .state
            .store(State::Reading as u32, Ordering::Release);
        slot
    }

    fn slot_ptr(&self, idx: u32, at: usize) -> *mut u8 {
        debug_assert!((idx as usize) < SLOTS && at <= SLOT_SIZE);
        // SAFETY: within the mapping: slot `idx` < SLOTS spans SLOT_SIZE bytes.
        unsafe { self.base.add(HEAD + idx as usize * SLOT_SIZE + at) }
    }

    fn control(&self, idx: u32) -> &Control {
        // SAFETY: a slot's first bytes, page aligned, hold its control
        // words; atomics accept any bit pattern (a new memfd is zeroes).
        unsafe { &*self.slot_ptr(idx, 0).cast::<Control>() }
    }

    /// Gives the pages of idle slots back (`MADV_REMOVE`), but for the
    /// 8 most recently used free ones (`KEEP_POPULATED`): the journal's
    /// memory follows the requests in flight of the last seconds, not the
    /// peak since start. Runs until the journal is dropped.
    pub fn start_trimming(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let _ = std::thread::Builder::new()
            .name("fuse-trim".into())
            .spawn(move || loop {
                std::thread::sleep(TRIM_AFTER);
                let Some(j) = weak.upgrade() else { return };
                let free = j.free.lock().unwrap_or_else(|e| e.into_inner());
                // The free list is a stack: the bottom ones are the idlest.
                let n = free.len().saturating_sub(KEEP_POPULATED);
                for &idx in &free[..n] {
                    if j.control(idx).populated.load(Ordering::Relaxed) != 0 {
                        // SAFETY: a free slot (we hold the free list, so no
                        // one takes it meanwhile) inside our mapping; its
                        // content, the control words included, is not needed:
                        // zeroes read back as FREE and not populated.
                        unsafe {
                            libc::madvise(j.slot_ptr(idx, 0).cast(), SLOT_SIZE, libc::MADV_REMOVE)
                        };
                    }
                }
            });
    }

    /// Maps every page of slot `idx` into this process before the kernel
    /// copies a request into it: a page fault inside that copy fails when
    /// the worker is being killed, and the kernel then ends the request
    /// with EIO instead of leaving it to the next worker. Content is kept
    /// (`MADV_POPULATE_WRITE`, Linux 5.14+, or a read of each page).
    fn populate(&self, idx: u32) {
        let p = self.slot_ptr(idx, 0);
        // SAFETY: the slot's pages, inside our mapping; populating changes
        // no content.
        let r = unsafe { libc::madvise(p.cast(), SLOT_SIZE, libc::MADV_POPULATE_WRITE) };
        if r != 0 {
            for off in (0..SLOT_SIZE).step_by(4096) {
                // SAFETY: inside the slot; a read faults the page in.
                unsafe { std::ptr::read_volatile(p.add(off)) };
            }
        }
    }

    fn release(&self, idx: u32) {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(idx);
        self.freed.notify_one();
    }
}

/// One slot, owned: nobody else reads or writes it while this lives. Dropped,
/// it is `FREE` again.
pub struct Slot {
    j: Arc<Journal>,
    idx: u32,
}

impl Slot {
    fn ptr(&self, at: usize) -> *mut u8 {
        self.j.slot_ptr(self.idx, at)
    }

    fn ctl(&self) -> &Control {
        self.j.control(self.idx)
    }

    /// The channel the request was read from.
    pub fn channel(&self) -> u32 {
        self.ctl().channel.load(Ordering::Relaxed)
    }

    /// Where `read(2)` writes the request.
    pub fn read_buf(&mut self) -> &mut [u8] {
        // SAFETY: our slot's bytes from REQUEST_AT to its end; `&mut self`
        // makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(REQUEST_AT), SLOT_SIZE - REQUEST_AT) }
    }

    /// The request as read (at most `len` bytes of it).
    pub fn request(&self, len: usize) -> &[u8] {
        let len = len.min(SLOT_SIZE - REQUEST_AT);
        // SAFETY: inside our slot; nothing writes it while it is borrowed
        // (the reply regions do not overlap a request they answer).
        unsafe { std::slice::from_raw_parts(self.ptr(REQUEST_AT), len) }
    }

    /// Marks the request read (`IN_FLIGHT`).
    pub fn mark_in_flight(&self) {
        self.ctl()
            .state
            .store(State::InFlight as u32, Ordering::Release);
    }

    /// `len` bytes at [`DATA_AT`] (a WRITE's payload, a READ's data once
    /// read), to look at.
    pub fn data(&self, len: usize) -> &[u8] {
        let len = len.min(MAX_WRITE as usize);
        // SAFETY: inside our slot; while the slot is borrowed no request
        // of it is in flight (callers read after librbd is done with it,
        // or before it is lent).
        unsafe { std::slice::from_raw_parts(self.ptr(DATA_AT), len) }
    }

    /// `len` bytes at [`DATA_AT`] to change in place (a READ's data,
    /// decrypted before the reply).
    pub fn data_mut(&mut self, len: usize) -> &mut [u8] {
        let len = len.min(MAX_WRITE as usize);
        // SAFETY: inside our slot, borrowed exclusively; librbd is done
        // with the memory it was lent (its request completed).
        unsafe { std::slice::from_raw_parts_mut(self.ptr(DATA_AT), len) }
    }

    /// `len` bytes at [`DATA_AT`], lent to librbd.
    pub fn data_mem(&self, len: usize) -> SlotMem {
        SlotMem {
            ptr: self.ptr(DATA_AT),
            len: len.min(MAX_WRITE as usize),
            _j: Arc::clone(&self.j),
        }
    }

    /// Records a reply (`DONE`): `error` (0 or a negative errno) and the
    /// payload. A `Small` or `Dir` payload is copied in; a `Data` one is
    /// already at [`DATA_AT`] (`payload` must be empty then, `len` says how
    /// much).
    pub fn record(&mut self, error: i32, at: ReplyAt, payload: &[u8], len: usize) {
        let dst = match at {
            ReplyAt::Small => Some(REPLY_AT),
            ReplyAt::Dir => Some(DIR_AT),
            ReplyAt::Data => None,
        };
        if let Some(off) = dst {
            // SAFETY: inside our slot (callers keep Small payloads within
            // REPLY_MAX and Dir ones within a page); `payload` is not in it.
            unsafe {
                std::ptr::copy_nonoverlapping(payload.as_ptr(), self.ptr(off), payload.len())
            };
        }
        let c = self.ctl();
        c.reply_error.store(error as u32, Ordering::Relaxed);
        c.reply_at.store(at as u32, Ordering::Relaxed);
        c.reply_len.store(len as u32, Ordering::Relaxed);
        c.state.store(State::Done as u32, Ordering::Release);
    }

    /// The recorded reply: error and payload.
    pub fn recorded(&self) -> (i32, &[u8]) {
        let c = self.ctl();
        let error = c.reply_error.load(Ordering::Acquire) as i32;
        let (off, max) = match c.reply_at.load(Ordering::Relaxed) {
            1 => (DATA_AT, MAX_WRITE as usize),
            2 => (DIR_AT, DATA_AT),
            _ => (REPLY_AT, REPLY_MAX),
        };
        let len = (c.reply_len.load(Ordering::Relaxed) as usize).min(max);
        // SAFETY: inside our slot, written by `record`.
        (error, unsafe {
            std::slice::from_raw_parts(self.ptr(off), len)
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.ctl()
            .state
            .store(State::Free as u32, Ordering::Release);
        self.j.release(self.idx);
    }
}

/// A slot's data region lent to librbd ([`crate::rbd::IoBuf`]); it keeps
/// the mapping alive. The [`Slot`] that made it must outlive the request
/// (the reply, which owns the slot, waits for it).
pub struct SlotMem {
    ptr: *mut u8,
    len: usize,
    _j: Arc<Journal>,
}

// SAFETY: plain memory of a mapping kept alive by the `Arc`.
unsafe impl Send for SlotMem {}

// SAFETY: `ptr..ptr+len` lies in the mapping the `Arc` keeps; it is the
// data region of one slot, which its owner (the reply waiting for this
// request) does not touch until the request completes.
unsafe impl crate::rbd::IoBuf for SlotMem {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }
}
