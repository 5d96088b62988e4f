//! The device's one queue: a thread that owns the queue's ring, fetches
//! requests from the driver, hands them to librbd's AIO and commits each
//! result when librbd's completion wakes it.
//!
//! The driver takes a tag's commands only from the thread that fetched it,
//! so librbd's completion thread does not commit: its waker queues the tag
//! and writes an eventfd that this ring reads.

use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use io_uring::{opcode, types, IoUring};
use rbdkit::rbd::{AioFuture, Image, IoBuf};

use crate::sys;

/// The eventfd read's user data; tags are below 4096.
const EVENT: u64 = u64::MAX;

/// What the queue did, for the run's report.
#[derive(Default, Debug)]
pub(crate) struct Stats {
    /// Requests served.
    pub(crate) requests: u64,
    /// Requests librbd failed.
    pub(crate) errors: u64,
}

/// The tags librbd finished, and the eventfd that says so.
struct Ready {
    tags: Mutex<Vec<u16>>,
    efd: OwnedFd,
}

/// One tag's waker: librbd's completion thread calls it.
struct TagWaker {
    tag: u16,
    ready: Arc<Ready>,
}

impl Wake for TagWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.ready
            .tags
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.tag);
        let one = 1u64.to_ne_bytes();
        // SAFETY: write(2) on an eventfd this struct owns, from an 8-byte
        // buffer that lives across the call.
        unsafe { libc::write(self.ready.efd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

/// A shared memory mapping, unmapped when the last holder drops it: the
/// queue's descriptor area, and its request buffer, which each request in
/// librbd holds too (through its `Slot`), so that a queue that ends early
/// cannot free memory librbd still writes.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory valid until drop; who reads or
// writes which part of it is ruled by the tags (see `Slot`).
unsafe impl Send for Mapping {}
// SAFETY: as for Send; `Mapping` itself is never written through `&self`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// `mmap(2)` of `len` bytes: of `fd` at offset 0 read-only and shared,
    /// or anonymous and writable with `fd` None.
    fn new(fd: Option<i32>, len: usize) -> io::Result<Mapping> {
        let (prot, flags, fd) = match fd {
            Some(fd) => (libc::PROT_READ, libc::MAP_SHARED | libc::MAP_POPULATE, fd),
            None => (
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
            ),
        };
        // SAFETY: mmap(2) with a null hint, a length, valid flags and a
        // descriptor (or -1 for anonymous memory); checked for MAP_FAILED.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once, by its last holder.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// One tag's slice of the queue's buffer, lent to librbd for one request.
struct Slot {
    mem: Arc<Mapping>,
    at: usize,
    len: usize,
}

// SAFETY: `at..at + len` lies in `mem`, which the slot keeps mapped; the
// slice belongs to one tag, and a tag has one request at a time, so no
// other thread touches it while a request holds it.
unsafe impl IoBuf for Slot {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: `at` is within the mapping (checked when the slot is made).
        unsafe { self.mem.ptr.add(self.at) }
    }
    fn len(&self) -> usize {
        self.len
    }
}

type Pending = Pin<Box<dyn Future<Output = i32> + Send>>;

/// The queue's state, made on the main thread and served on its own.
pub(crate) struct Queue {
    ring: IoUring,
    cdev: File,
    descs: Mapping,
    buf: Arc<Mapping>,
    max_io: usize,
    image: Arc<Image>,
    ready: Arc<Ready>,
    wakers: Vec<Waker>,
    pending: Vec<Option<Pending>>,
    efd_buf: Box<[u8; 8]>,
    aborted: usize,
    stats: Stats,
}

impl Queue {
    /// Opens `/dev/ublkc<id>` and maps queue 0's request descriptors.
    pub(crate) fn open(id: u32, depth: u16, max_io: usize, image: Arc<Image>) -> io::Result<Queue> {
        let path = format!("/dev/ublkc{id}");
        let cdev = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))?;
        let depth = usize::from(depth);
        let page = 4096;
        let descs_len = (depth * std::mem::size_of::<sys::IoDesc>()).div_ceil(page) * page;
        // Offset 0 is queue 0's descriptors (UBLKSRV_CMD_BUF_OFFSET),
        // mapped read-only and shared, as the driver's mmap handler requires.
        let descs = Mapping::new(Some(cdev.as_raw_fd()), descs_len)?;
        let buf = Arc::new(Mapping::new(None, depth * max_io)?);
        // SAFETY: eventfd(2) with valid flags; checked below before use.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `efd` is a fresh descriptor owned by nothing else.
        let efd = unsafe { OwnedFd::from_raw_fd(efd) };
        let ready = Arc::new(Ready {
            tags: Mutex::new(Vec::new()),
            efd,
        });
        let wakers = (0..depth as u16)
            .map(|tag| {
                Waker::from(Arc::new(TagWaker {
                    tag,
                    ready: Arc::clone(&ready),
                }))
            })
            .collect();
        Ok(Queue {
            ring: IoUring::new((depth as u32 + 1).next_power_of_two())?,
            cdev,
            descs,
            buf,
            max_io,
            image,
            ready,
            wakers,
            pending: (0..depth).map(|_| None).collect(),
            efd_buf: Box::new([0; 8]),
            aborted: 0,
            stats: Stats::default(),
        })
    }

    /// `tag`'s buffer, its first `len` bytes (`len` <= max_io).
    fn slot(&self, tag: u16, len: usize) -> Slot {
        assert!(len <= self.max_io);
        Slot {
            mem: Arc::clone(&self.buf),
            at: usize::from(tag) * self.max_io,
            len,
        }
    }

    fn slot_addr(&self, tag: u16) -> u64 {
        self.buf.ptr as u64 + (usize::from(tag) * self.max_io) as u64
    }

    /// Queues one SQE, submitting first if the ring is full.
    fn push(&mut self, sqe: io_uring::squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: the entry's buffers (inline command bytes; the tag's
            // slot, the eventfd buffer) live as long as the queue, which
            // outlives the ring's operations (it drains them before drop).
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                return Ok(());
            }
            self.ring.submit()?;
        }
    }

    fn io_cmd(&mut self, op: u32, tag: u16, result: i32) -> io::Result<()> {
        let cmd = sys::io_cmd(0, tag, result, self.slot_addr(tag));
        let sqe = opcode::UringCmd16::new(types::Fd(self.cdev.as_raw_fd()), op)
            .cmd(cmd)
            .build()
            .user_data(u64::from(tag));
        self.push(sqe)
    }

    fn arm_event(&mut self) -> io::Result<()> {
        let fd = self.ready.efd.as_raw_fd();
        let sqe = opcode::Read::new(types::Fd(fd), self.efd_buf.as_mut_ptr(), 8)
            .build()
            .user_data(EVENT);
        self.push(sqe)
    }

    /// Starts the request the driver put in `tag`'s descriptor.
    fn start(&mut self, tag: u16) -> io::Result<()> {
        // SAFETY: `tag` < depth, inside the mapping; the driver wrote this
        // descriptor before completing the tag's fetch, and does not change
        // it until the tag is committed. Read volatile: the kernel writes it.
        let d = unsafe {
            std::ptr::read_volatile(self.descs.ptr.cast::<sys::IoDesc>().add(usize::from(tag)))
        };
        let off = d.start_sector << 9;
        let len = (d.nr_sectors as usize) << 9;
        let done = len as i32;
        let image = &self.image;
        let fut = match (d.op_flags & 0xff) as u8 {
            sys::OP_READ if len <= self.max_io => {
                result(image.aio_read_buf(off, self.slot(tag, len)), |n| n as i32)
            }
            sys::OP_WRITE if len <= self.max_io => {
                result(image.aio_write_buf(off, self.slot(tag, len)), move |()| {
                    done
                })
            }
            sys::OP_FLUSH => result(image.aio_flush(), |()| 0),
            sys::OP_DISCARD => result(image.aio_discard(off, len as u64), move |()| done),
            sys::OP_WRITE_ZEROES => result(image.aio_write_zeroes(off, len), move |()| done),
            _ => Box::pin(async { -libc::EOPNOTSUPP }),
        };
        self.pending[usize::from(tag)] = Some(fut);
        self.poll(tag)
    }

    /// Polls `tag`'s request; commits it (and fetches the next) if done.
    fn poll(&mut self, tag: u16) -> io::Result<()> {
        let i = usize::from(tag);
        let Some(fut) = self.pending[i].as_mut() else {
            return Ok(());
        };
        let mut cx = Context::from_waker(&self.wakers[i]);
        let Poll::Ready(res) = fut.as_mut().poll(&mut cx) else {
            return Ok(());
        };
        self.pending[i] = None;
        self.stats.requests += 1;
        if res < 0 {
            self.stats.errors += 1;
        }
        self.io_cmd(sys::IO_COMMIT_AND_FETCH_REQ, tag, res)
    }

    /// Fetches every tag, then serves until the device is stopped (every
    /// tag's fetch aborted) and no request is left in librbd.
    pub(crate) fn serve(mut self) -> io::Result<Stats> {
        let depth = self.pending.len();
        for tag in 0..depth as u16 {
            self.io_cmd(sys::IO_FETCH_REQ, tag, -1)?;
        }
        self.arm_event()?;
        while self.aborted < depth || self.pending.iter().any(Option::is_some) {
            self.ring.submit_and_wait(1)?;
            let done: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (ud, res) in done {
                self.complete(ud, res)?;
            }
        }
        Ok(std::mem::take(&mut self.stats))
    }

    fn complete(&mut self, ud: u64, res: i32) -> io::Result<()> {
        if ud == EVENT {
            let tags =
                std::mem::take(&mut *self.ready.tags.lock().unwrap_or_else(|p| p.into_inner()));
            for tag in tags {
                self.poll(tag)?;
            }
            return self.arm_event();
        }
        let tag = ud as u16;
        match res {
            0 => self.start(tag),
            r if r == -libc::ENODEV => {
                self.aborted += 1;
                Ok(())
            }
            r => Err(io::Error::other(format!(
                "tag {tag}: fetch/commit failed: {}",
                io::Error::from_raw_os_error(-r)
            ))),
        }
    }
}

/// A request's future as the result the driver takes: `ok`'s byte count,
/// or the negated errno.
fn result<T: Send + 'static>(
    f: AioFuture<T>,
    ok: impl FnOnce(T) -> i32 + Send + 'static,
) -> Pending {
    Box::pin(async move { f.await.map_or_else(|e| -e.errno(), ok) })
}
