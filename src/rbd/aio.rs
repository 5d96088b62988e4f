//! Asynchronous image I/O: futures over librbd's AIO calls.
//!
//! Every `aio_*` method on [`Image`] submits its request to librbd *when it is
//! called* and returns a future that only reports the result. The futures use
//! nothing but [`std::task::Waker`], so they run on any executor (tokio,
//! `futures::executor`, smol, a hand-written loop); tokio adapters live in
//! `ImageIo` behind the `service` feature.
#![cfg_attr(
    feature = "service",
    doc = "",
    doc = "See [`ImageIo`](crate::rbd::ImageIo) for the tokio adapters."
)]
//!
//! ```no_run
//! # async fn demo(image: &rbdkit::rbd::Image) -> rbdkit::Result<()> {
//! image.aio_write(0, b"hello".to_vec()).await?;
//! let back = image.aio_read(0, 5).await?;
//! assert_eq!(back, b"hello");
//! image.aio_flush().await?;
//! # Ok(()) }
//! ```
//!
//! # Ownership protocol (why dropping a future is safe)
//!
//! librbd cannot cancel a request, so a request owns everything librbd may
//! touch until librbd says it is done:
//!
//! 1. Each request is one heap `Request` behind an [`Arc`]: the buffers
//!    librbd reads or writes, the out-parameters it fills (mismatch offset,
//!    image handle), a waker slot and the result.
//! 2. Two references exist: the future holds one; the other is leaked with
//!    [`Arc::into_raw`] and becomes the completion's callback argument
//!    (`rbd_aio_create_completion`).
//! 3. librbd calls the callback exactly once. The callback (an
//!    `extern "C" fn` that never unwinds: its body runs in `catch_unwind`)
//!    reads `rbd_aio_get_return_value`, releases the completion with
//!    `rbd_aio_release`, stores the result, wakes the waker and drops its
//!    reference.
//! 4. Dropping the future drops only the other reference (and its waker).
//!    Buffers are freed by whichever side lets go last, so never while
//!    librbd may still use them, and always once the request is done.
//! 5. If the submit call itself fails (negative return), librbd never took
//!    the completion: it is released at once, the leaked reference is taken
//!    back, and the future resolves to that error.
//!
//! Dropping a future does **not** cancel its request: a dropped write still
//! lands. [`aio_live_requests`] counts requests whose memory is still held.
//!
//! # Sharing one image
//!
//! [`Image`] is `Send + Sync` and every `aio_*` method takes `&self`, so one
//! handle (e.g. in an `Arc<Image>`) may be used by any number of tasks and
//! threads with any number of requests in flight: librbd serialises access
//! to the handle with its own locks (QEMU drives one handle from many
//! threads the same way). librbd does **not** order requests that are in
//! flight at the same time: await a write before issuing an overlapping read
//! or write if the order matters, and use [`Image::aio_flush`] for
//! durability.
//!
//! The futures are `Send + 'static` and do not borrow the image. That is
//! sound because `rbd_close` (run by [`Image::close`], [`Image::close_async`]
//! or dropping the `Image`) drains the image's I/O queue and waits for every
//! in-flight request to complete, including its callback, before it returns:
//! librbd marks a request finished only after the user callback ran. So after
//! the image is closed no callback is pending, and the futures hold only
//! their own `Request`, never the image handle. Calling a `&mut self` method
//! such as [`Image::set_snapshot`] while requests are in flight is memory-safe
//! (librbd locks), but which view those requests see is unspecified.
//!
//! Callbacks run on librbd's internal thread, one at a time; a waker that
//! blocks there stalls all of librbd's completions. Executors' wakers only
//! queue a task, which is fine.
//!
//! # Opening and closing asynchronously
//!
//! [`Image::open_async`] and [`Image::close_async`] keep the [`IoCtx`] (and
//! so the cluster) alive until librbd is finished with the handle. Dropping
//! one of those futures before it completes hands the rest of the work to a
//! short-lived background thread, which waits for librbd, closes an image
//! that was opened for nobody, and only then lets go of the `IoCtx`. (It
//! cannot be done in the callback: closing or shutting a cluster down on
//! librbd's own thread would deadlock.)

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::future::Future;
use std::os::raw::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

use rbd_sys as sys;

use crate::error::{Error, Result};
use crate::rados::IoCtx;
use crate::rbd::Image;
use crate::util::cstr;

/// The most buffers one `readv`/`writev` may take (Linux `IOV_MAX`; librbd
/// refuses more).
const MAX_IOVECS: usize = 1024;

/// Requests whose state is still allocated, in this process.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// How many AIO requests still hold memory: submitted and not yet both
/// completed by librbd and dropped (or consumed) by their future. Returns to
/// 0 once every request has completed and every future is gone. For tests
/// and leak checks.
#[doc(hidden)]
pub fn aio_live_requests() -> usize {
    LIVE.load(Ordering::SeqCst)
}

/// The iovec array handed to `rbd_aio_readv`/`rbd_aio_writev`, held (never
/// read again) until the request completes.
struct IoVecs {
    _iov: Vec<sys::iovec>,
}

/// Builds the iovecs over `bufs` and the payload that owns both; returns the
/// iovec pointer and count to hand to librbd. The pointers stay valid while
/// the payload lives: moving a `Vec` does not move its heap buffer.
fn iovec_payload(mut bufs: Vec<Vec<u8>>) -> (Payload, *const sys::iovec, c_int) {
    let iov: Vec<sys::iovec> = bufs
        .iter_mut()
        .map(|b| sys::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    let (p, n) = (iov.as_ptr(), iov.len() as c_int);
    (Payload::Bufs(bufs, IoVecs { _iov: iov }), p, n)
}

/// Memory that a request reads into or writes from, owned some other way
/// than by a `Vec` (a slot of a shared mapping, say): see
/// [`Image::aio_read_buf`] and [`Image::aio_write_buf`]. The request keeps
/// the value until librbd is done with the memory, then drops it.
///
/// # Safety
/// `as_mut_ptr` must return memory valid for reads and writes of `len`
/// bytes for as long as the value lives, not moved when the value moves,
/// and not read or written by anyone else while a request holds it.
pub unsafe trait IoBuf: Send + 'static {
    /// The start of the memory.
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// Its length in bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a request owns on librbd's behalf until it completes.
enum Payload {
    None,
    /// Read into / written from memory the caller lent (kept, never read).
    External(#[allow(dead_code)] Box<dyn IoBuf>),
    /// Read into / written from.
    Buf(Vec<u8>),
    /// Written from a buffer other requests (and the caller) may share;
    /// librbd only reads it, and the `Arc` keeps it alive and unmoved.
    Shared {
        _data: Arc<[u8]>,
    },
    /// Scatter/gather buffers and the iovecs pointing into them.
    Bufs(Vec<Vec<u8>>, IoVecs),
    /// Compare-and-write: the expected bytes and the new bytes.
    #[cfg_attr(not(librbd_supports_compare_and_write), allow(dead_code))]
    Pair {
        _expected: Vec<u8>,
        _data: Vec<u8>,
    },
    /// Scatter/gather compare-and-write: the expected and the new buffers,
    /// each with its iovecs.
    #[cfg_attr(not(librbd_supports_compare_and_write_iovec), allow(dead_code))]
    PairV {
        _expected: (Vec<Vec<u8>>, IoVecs),
        _data: (Vec<Vec<u8>>, IoVecs),
    },
}

/// Out-parameters librbd writes before it completes the request.
struct Out {
    mismatch: UnsafeCell<u64>,
    image: UnsafeCell<sys::rbd_image_t>,
}

struct Inner {
    ret: Option<isize>,
    waker: Option<Waker>,
    payload: Payload,
}

/// One in-flight request: shared by its future and librbd's callback.
struct Request {
    inner: Mutex<Inner>,
    out: Out,
}

// SAFETY: the raw pointers in a `Request` (the iovecs, the out image handle)
// point into buffers the same request owns, or are handed over whole to the
// future once the request completed; librbd may use them from any thread
// (header: completions are called from librbd's threads).
unsafe impl Send for Request {}
// SAFETY: `inner` is behind a mutex. The `out` cells are written only by
// librbd before it completes the request, and read only after the future
// saw the result under the mutex (the callback stores it after librbd's
// writes), so no access to them races.
unsafe impl Sync for Request {}

impl Request {
    fn new(payload: Payload) -> Request {
        LIVE.fetch_add(1, Ordering::SeqCst);
        Request {
            inner: Mutex::new(Inner {
                ret: None,
                waker: None,
                payload,
            }),
            out: Out {
                mismatch: UnsafeCell::new(0),
                image: UnsafeCell::new(ptr::null_mut()),
            },
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means a waker panicked; the data is intact.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores the result, lets go of the callback's reference (freeing the
    /// request if its future is gone) and only then wakes the task.
    fn complete(self: Arc<Self>, ret: isize) {
        let waker = {
            let mut inner = self.lock();
            inner.ret = Some(ret);
            inner.waker.take()
        };
        drop(self);
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// librbd's completion callback (`rbd_callback_t`).
///
/// # Safety
/// Called by librbd only, exactly once per completion, with the argument
/// given to `rbd_aio_create_completion` in [`start`].
unsafe extern "C" fn complete_cb(c: sys::rbd_completion_t, arg: *mut c_void) {
    // Nothing may unwind into librbd. The FFI calls cannot panic; a panicking
    // waker is contained here (the request's state stays consistent).
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `c` is the live completion librbd passes to its callback;
        // it stays valid until we release it below.
        let ret = unsafe { sys::rbd_aio_get_return_value(c) };
        // SAFETY: we hold the only user reference to `c` and release it
        // once, here (header: "release" the completion when done with it);
        // librbd keeps its own reference for the rest of its callback path.
        unsafe { sys::rbd_aio_release(c) };
        // SAFETY: `arg` came from `Arc::into_raw` in `start`, and librbd
        // calls the callback once, so this takes back that one reference.
        let req = unsafe { Arc::from_raw(arg as *const Request) };
        req.complete(ret);
    }));
}

/// Turns a completed request into the future's output.
type Finish<T> = fn(isize, Payload, &Out, &'static str, &str) -> Result<T>;

/// Creates the completion, runs `submit` with it and returns the future.
fn start<T>(
    op: &'static str,
    object: String,
    payload: Payload,
    finish: Finish<T>,
    submit: impl FnOnce(&Out, sys::rbd_completion_t) -> c_int,
) -> AioFuture<T> {
    let req = Arc::new(Request::new(payload));
    let arg = Arc::into_raw(Arc::clone(&req)) as *mut c_void;
    let mut c: sys::rbd_completion_t = ptr::null_mut();
    // SAFETY: `complete_cb` has the header's `rbd_callback_t` signature and
    // `arg` stays valid until it runs (we leaked a reference for it); `c` is
    // a valid out-pointer.
    let r = unsafe { sys::rbd_aio_create_completion(arg, Some(complete_cb), &mut c) };
    if r < 0 {
        // SAFETY: no completion exists, so nothing will use `arg`: take back
        // the reference leaked above.
        drop(unsafe { Arc::from_raw(arg as *const Request) });
        let e = errno_error(r, "rbd_aio_create_completion", &object);
        return AioFuture::failed(e, op, object, finish);
    }
    let r = submit(&req.out, c);
    if r < 0 {
        // SAFETY: a negative return from an `rbd_aio_*` submit call means
        // librbd refused the request before handing the completion to its
        // I/O path, so the callback will never run: release the completion
        // (still ours) and take back the reference leaked for the callback.
        unsafe {
            sys::rbd_aio_release(c);
            drop(Arc::from_raw(arg as *const Request));
        }
        let e = errno_error(r, op, &object);
        return AioFuture::failed(e, op, object, finish);
    }
    AioFuture {
        state: FutState::Pending(req),
        op,
        object,
        finish,
    }
}

/// The error for a negative return of a submit call.
fn errno_error(r: c_int, op: &'static str, object: &str) -> Error {
    Error::from_errno(r.checked_neg().unwrap_or(libc::EIO), op, object)
}

enum FutState {
    Pending(Arc<Request>),
    Failed(Error),
    Done,
}

/// The result of one AIO request on an image.
///
/// The request was submitted when the `aio_*` method was called; awaiting
/// the future only waits for librbd to finish it. Dropping the future does
/// not cancel the request (librbd cannot): it runs to the end and its
/// buffers are freed then. The future is `Send + 'static` and does not
/// borrow the image (see the [module docs](crate::rbd::aio)).
#[must_use = "the request is already submitted; the future only reports its result"]
pub struct AioFuture<T> {
    state: FutState,
    op: &'static str,
    object: String,
    finish: Finish<T>,
}

/// The future of [`Image::aio_read`] and [`Image::aio_read_into`]: resolves
/// to the bytes read (fewer than asked only past the end of the image).
pub type AioRead = AioFuture<Vec<u8>>;

impl<T> AioFuture<T> {
    fn failed(e: Error, op: &'static str, object: String, finish: Finish<T>) -> AioFuture<T> {
        AioFuture {
            state: FutState::Failed(e),
            op,
            object,
            finish,
        }
    }

    /// True once librbd has completed the request (or it was never
    /// submitted because of an error); polling then returns `Ready`.
    pub fn is_complete(&self) -> bool {
        match &self.state {
            FutState::Pending(req) => req.lock().ret.is_some(),
            FutState::Failed(_) | FutState::Done => true,
        }
    }

    /// True while librbd has a request of this future in flight or done but
    /// not yet collected.
    fn is_submitted(&self) -> bool {
        matches!(self.state, FutState::Pending(_))
    }
}

impl<T> Future for AioFuture<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        let (ret, payload) = match &this.state {
            FutState::Pending(req) => {
                let mut inner = req.lock();
                match inner.ret {
                    Some(ret) => (ret, std::mem::replace(&mut inner.payload, Payload::None)),
                    None => {
                        match &inner.waker {
                            Some(w) if w.will_wake(cx.waker()) => {}
                            _ => inner.waker = Some(cx.waker().clone()),
                        }
                        return Poll::Pending;
                    }
                }
            }
            FutState::Failed(_) => match std::mem::replace(&mut this.state, FutState::Done) {
                FutState::Failed(e) => return Poll::Ready(Err(e)),
                _ => unreachable!(),
            },
            FutState::Done => panic!("{} future polled after completion", this.op),
        };
        let FutState::Pending(req) = std::mem::replace(&mut this.state, FutState::Done) else {
            unreachable!()
        };
        Poll::Ready((this.finish)(ret, payload, &req.out, this.op, &this.object))
    }
}

impl<T> Drop for AioFuture<T> {
    fn drop(&mut self) {
        if let FutState::Pending(req) = &self.state {
            // Do not keep a task alive (or wake it) for a future nobody
            // awaits. Dropped outside the lock.
            let waker = req.lock().waker.take();
            drop(waker);
        }
    }
}

impl<T> std::fmt::Debug for AioFuture<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AioFuture")
            .field("op", &self.op)
            .field("object", &self.object)
            .field("complete", &self.is_complete())
            .finish()
    }
}

fn finish_unit(ret: isize, _: Payload, _: &Out, op: &'static str, object: &str) -> Result<()> {
    crate::error::cvt(ret, op, || object.to_owned())?;
    Ok(())
}

fn finish_read(
    ret: isize,
    payload: Payload,
    _: &Out,
    op: &'static str,
    object: &str,
) -> Result<Vec<u8>> {
    let n = crate::error::cvt(ret, op, || object.to_owned())? as usize;
    let Payload::Buf(mut buf) = payload else {
        unreachable!("a read owns one buffer")
    };
    buf.truncate(n);
    Ok(buf)
}

fn finish_len(ret: isize, _: Payload, _: &Out, op: &'static str, object: &str) -> Result<usize> {
    Ok(crate::error::cvt(ret, op, || object.to_owned())? as usize)
}

fn finish_readv(
    ret: isize,
    payload: Payload,
    _: &Out,
    op: &'static str,
    object: &str,
) -> Result<Vec<Vec<u8>>> {
    let mut n = crate::error::cvt(ret, op, || object.to_owned())? as usize;
    let Payload::Bufs(mut bufs, _iov) = payload else {
        unreachable!("a readv owns its buffers")
    };
    for b in &mut bufs {
        let take = n.min(b.len());
        b.truncate(take);
        n -= take;
    }
    Ok(bufs)
}

#[cfg(librbd_supports_compare_and_write)]
fn finish_cmpwrite(
    ret: isize,
    _: Payload,
    out: &Out,
    op: &'static str,
    object: &str,
) -> Result<Option<u64>> {
    if ret == -(libc::EILSEQ as isize) {
        // SAFETY: the request completed (`ret` came from the callback, after
        // librbd's last write to the out-parameter), so nothing writes it now.
        return Ok(Some(unsafe { *out.mismatch.get() }));
    }
    crate::error::cvt(ret, op, || object.to_owned())?;
    Ok(None)
}

/// An open handle that nobody else references yet.
struct RawImage(sys::rbd_image_t);

// SAFETY: an open `rbd_image_t` may be used from any thread (`Image` is
// `Send`); this one is referenced by nothing else.
unsafe impl Send for RawImage {}

fn finish_open(
    ret: isize,
    _: Payload,
    out: &Out,
    op: &'static str,
    object: &str,
) -> Result<RawImage> {
    crate::error::cvt(ret, op, || object.to_owned())?;
    // SAFETY: the request completed, so librbd's write of the handle (done
    // before it completes an open) is over.
    let raw = unsafe { *out.image.get() };
    if raw.is_null() {
        return Err(Error::from_errno(libc::EIO, op, object)
            .detail("librbd reported success but returned no image handle"));
    }
    Ok(RawImage(raw))
}

/// The largest buffer one AIO read or write may take (2 GiB - 1): librbd
/// reports the result as an `int` internally and copies write buffers with
/// 32-bit lengths, so larger requests would be cut or misreported. Split
/// them. Discard and write-zeroes carry no buffer and have no such bound
/// (the loop driver sends discards of up to 4 GiB).
pub const MAX_AIO_LEN: u64 = i32::MAX as u64;

fn check_range(image: &Image, op: &'static str, offset: u64, len: u64) -> Result<()> {
    if offset.checked_add(len).is_none() {
        return Err(Error::invalid(
            op,
            image.spec(),
            format!("offset {offset} + length {len} overflows"),
        ));
    }
    Ok(())
}

/// [`check_range`] plus the [`MAX_AIO_LEN`] bound, for requests with a buffer.
fn check_buffer(image: &Image, op: &'static str, offset: u64, len: u64) -> Result<()> {
    if len > MAX_AIO_LEN {
        return Err(Error::invalid(
            op,
            image.spec(),
            format!("{len} bytes in one request; at most {MAX_AIO_LEN} are allowed (split it)"),
        ));
    }
    check_range(image, op, offset, len)
}

/// Checks a write's range against the image size before submitting:
/// librbd's AIO path silently clips a write that runs past the end and
/// still reports success, so the check has to happen here. It uses the
/// size last seen and asks librbd (a call that may block) only when the
/// write reaches past it. (A resize that races with the write, or a shrink
/// by another client, can still clip it, as it would for any client.)
fn check_write_range(image: &Image, op: &'static str, offset: u64, len: u64) -> Result<()> {
    check_buffer(image, op, offset, len)?;
    check_in_image(image, op, offset, len)
}

/// The size half of [`check_write_range`], for writes with no buffer.
fn check_in_image(image: &Image, op: &'static str, offset: u64, len: u64) -> Result<()> {
    check_range(image, op, offset, len)?;
    let size = image.size_covering(offset + len)?;
    if offset + len > size {
        return Err(crate::rbd::io::past_end(
            op,
            &image.spec(),
            offset,
            len,
            size,
        ));
    }
    Ok(())
}

impl Image {
    fn aio_start<T>(
        &self,
        op: &'static str,
        payload: Payload,
        finish: Finish<T>,
        submit: impl FnOnce(&Out, sys::rbd_completion_t) -> c_int,
    ) -> AioFuture<T> {
        start(op, self.spec(), payload, finish, submit)
    }

    fn aio_refused<T>(&self, e: Error, finish: Finish<T>) -> AioFuture<T> {
        AioFuture::failed(e, "rbd_aio", self.spec(), finish)
    }

    /// Reads `len` bytes at `offset`. Wraps `rbd_aio_read`.
    ///
    /// Resolves to the bytes read: fewer than `len` only past the end of the
    /// image.
    pub fn aio_read(&self, offset: u64, len: usize) -> AioRead {
        self.aio_read_into(offset, vec![0; len])
    }

    /// Reads `buf.len()` bytes at `offset` into `buf` (so a buffer can be
    /// reused) and resolves to it, truncated to the bytes read. Wraps
    /// `rbd_aio_read`.
    pub fn aio_read_into(&self, offset: u64, mut buf: Vec<u8>) -> AioRead {
        if let Err(e) = check_buffer(self, "rbd_aio_read", offset, buf.len() as u64) {
            return self.aio_refused(e, finish_read);
        }
        let (p, len) = (buf.as_mut_ptr(), buf.len());
        let raw = self.raw();
        // Moving `buf` into the request does not move its heap memory, so
        // `p` stays valid for as long as the request owns `buf`.
        self.aio_start("rbd_aio_read", Payload::Buf(buf), finish_read, |_, c| {
            // SAFETY: the image is open; `p` is writable for `len` bytes and
            // owned by the request until the completion fires; `c` is a
            // fresh completion.
            unsafe { sys::rbd_aio_read(raw, offset, len, p.cast(), c) }
        })
    }

    /// Reads `buf.len()` bytes at `offset` into memory the caller lends
    /// ([`IoBuf`]), with no copy or allocation on rbdkit's side; resolves to
    /// the bytes read (fewer only past the end of the image). The request
    /// drops `buf` once librbd is done with it. Wraps `rbd_aio_read`.
    pub fn aio_read_buf<B: IoBuf>(&self, offset: u64, mut buf: B) -> AioFuture<usize> {
        if let Err(e) = check_buffer(self, "rbd_aio_read", offset, buf.len() as u64) {
            return self.aio_refused(e, finish_len);
        }
        let (p, len) = (buf.as_mut_ptr(), buf.len());
        let raw = self.raw();
        let payload = Payload::External(Box::new(buf));
        self.aio_start("rbd_aio_read", payload, finish_len, |_, c| {
            // SAFETY: the image is open; `p` is writable for `len` bytes and
            // reserved for this request while it owns `buf` (the `IoBuf`
            // contract), which is until the completion fires.
            unsafe { sys::rbd_aio_read(raw, offset, len, p.cast(), c) }
        })
    }

    /// Writes `buf.len()` bytes from memory the caller lends ([`IoBuf`]) at
    /// `offset`, with no copy on rbdkit's side; the range must lie within
    /// the image. The request drops `buf` once librbd is done with it.
    /// Wraps `rbd_aio_write`.
    pub fn aio_write_buf<B: IoBuf>(&self, offset: u64, mut buf: B) -> AioFuture<()> {
        if let Err(e) = check_write_range(self, "rbd_aio_write", offset, buf.len() as u64) {
            return self.aio_refused(e, finish_unit);
        }
        let (p, len) = (buf.as_mut_ptr(), buf.len());
        let raw = self.raw();
        let payload = Payload::External(Box::new(buf));
        self.aio_start("rbd_aio_write", payload, finish_unit, |_, c| {
            // SAFETY: the image is open; `p` is readable for `len` bytes and
            // reserved for this request while it owns `buf` (the `IoBuf`
            // contract), which is until the completion fires.
            unsafe { sys::rbd_aio_write(raw, offset, len, p.cast(), c) }
        })
    }

    /// Writes `data` at `offset`; the range must lie within the image.
    /// Wraps `rbd_aio_write`.
    ///
    /// The buffer is owned by the request until librbd is done with it
    /// (librbd may use it without copying).
    pub fn aio_write(&self, offset: u64, data: impl Into<Vec<u8>>) -> AioFuture<()> {
        let data: Vec<u8> = data.into();
        if let Err(e) = check_write_range(self, "rbd_aio_write", offset, data.len() as u64) {
            return self.aio_refused(e, finish_unit);
        }
        let (p, len) = (data.as_ptr(), data.len());
        let raw = self.raw();
        self.aio_start("rbd_aio_write", Payload::Buf(data), finish_unit, |_, c| {
            // SAFETY: the image is open; `p` is readable for `len` bytes and
            // owned by the request until the completion fires.
            unsafe { sys::rbd_aio_write(raw, offset, len, p.cast(), c) }
        })
    }

    /// Writes a shared buffer at `offset`; the range must lie within the
    /// image. The same `Arc<[u8]>` can be handed to any number of requests
    /// at once with no copy on rbdkit's side, which is what repeated or
    /// fan-out writes of large blocks want. Wraps `rbd_aio_write`.
    pub fn aio_write_shared(&self, offset: u64, data: Arc<[u8]>) -> AioFuture<()> {
        if let Err(e) = check_write_range(self, "rbd_aio_write", offset, data.len() as u64) {
            return self.aio_refused(e, finish_unit);
        }
        let (p, len) = (data.as_ptr(), data.len());
        let raw = self.raw();
        self.aio_start(
            "rbd_aio_write",
            Payload::Shared { _data: data },
            finish_unit,
            |_, c| {
                // SAFETY: the image is open; `p` is readable for `len` bytes: the
                // request holds an `Arc` to the allocation until the completion
                // fires, and no one can write through a shared `Arc<[u8]>`.
                unsafe { sys::rbd_aio_write(raw, offset, len, p.cast(), c) }
            },
        )
    }

    /// Reads into several buffers in turn, starting at `offset`: each
    /// buffer's length (not capacity) says how much goes into it. Resolves to
    /// the buffers, each truncated to what was read into it (less only past
    /// the end of the image). Wraps `rbd_aio_readv`.
    ///
    /// Takes 1 to 1024 buffers.
    pub fn aio_readv(&self, offset: u64, bufs: Vec<Vec<u8>>) -> AioFuture<Vec<Vec<u8>>> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        if let Err(e) = check_iovecs(self, "rbd_aio_readv", offset, bufs.len(), total) {
            return self.aio_refused(e, finish_readv);
        }
        let (payload, p, n) = iovec_payload(bufs);
        let raw = self.raw();
        self.aio_start("rbd_aio_readv", payload, finish_readv, |_, c| {
            // SAFETY: the image is open; `p` points to `n` iovecs, each
            // describing a writable buffer; the iovecs and the buffers are
            // owned by the request until the completion fires.
            unsafe { sys::rbd_aio_readv(raw, p, n, offset, c) }
        })
    }

    /// Writes several buffers one after the other, starting at `offset`.
    /// Wraps `rbd_aio_writev`.
    ///
    /// Takes 1 to 1024 buffers.
    pub fn aio_writev(&self, offset: u64, bufs: Vec<Vec<u8>>) -> AioFuture<()> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        if let Err(e) = check_iovecs(self, "rbd_aio_writev", offset, bufs.len(), total)
            .and_then(|()| check_write_range(self, "rbd_aio_writev", offset, total))
        {
            return self.aio_refused(e, finish_unit);
        }
        let (payload, p, n) = iovec_payload(bufs);
        let raw = self.raw();
        self.aio_start("rbd_aio_writev", payload, finish_unit, |_, c| {
            // SAFETY: the image is open; `p` points to `n` iovecs over
            // readable buffers owned by the request until the completion
            // fires (librbd only reads them).
            unsafe { sys::rbd_aio_writev(raw, p, n, offset, c) }
        })
    }

    /// Deallocates a range; it reads back as zeroes. Any length (no buffer,
    /// so [`MAX_AIO_LEN`] does not apply). Wraps `rbd_aio_discard`.
    pub fn aio_discard(&self, offset: u64, len: u64) -> AioFuture<()> {
        if let Err(e) = check_range(self, "rbd_aio_discard", offset, len) {
            return self.aio_refused(e, finish_unit);
        }
        let raw = self.raw();
        self.aio_start("rbd_aio_discard", Payload::None, finish_unit, |_, c| {
            // SAFETY: the image is open; `c` is a fresh completion.
            unsafe { sys::rbd_aio_discard(raw, offset, len, c) }
        })
    }

    /// Writes zeroes over a range; it must lie within the image. Any length:
    /// no buffer is involved, so [`MAX_AIO_LEN`] does not apply. Wraps
    /// `rbd_aio_write_zeroes` (no flags).
    pub fn aio_write_zeroes(&self, offset: u64, len: usize) -> AioFuture<()> {
        if let Err(e) = check_in_image(self, "rbd_aio_write_zeroes", offset, len as u64) {
            return self.aio_refused(e, finish_unit);
        }
        let raw = self.raw();
        self.aio_start(
            "rbd_aio_write_zeroes",
            Payload::None,
            finish_unit,
            |_, c| {
                // SAFETY: the image is open; `c` is a fresh completion; zero
                // flags and op flags are 0 (the defaults).
                unsafe { sys::rbd_aio_write_zeroes(raw, offset, len, c, 0, 0) }
            },
        )
    }

    /// Resolves once every write submitted before it is durable. Wraps
    /// `rbd_aio_flush`.
    pub fn aio_flush(&self) -> AioFuture<()> {
        let raw = self.raw();
        self.aio_start("rbd_aio_flush", Payload::None, finish_unit, |_, c| {
            // SAFETY: the image is open; `c` is a fresh completion.
            unsafe { sys::rbd_aio_flush(raw, c) }
        })
    }

    /// Writes `data` at `offset` only if the range currently holds
    /// `expected` (same length). Resolves to `Ok(None)` when written, or to
    /// `Ok(Some(offset_of_first_mismatch))` with nothing written. Wraps
    /// `rbd_aio_compare_and_write`.
    #[cfg(librbd_supports_compare_and_write)]
    pub fn aio_compare_and_write(
        &self,
        offset: u64,
        expected: Vec<u8>,
        data: Vec<u8>,
    ) -> AioFuture<Option<u64>> {
        const OP: &str = "rbd_aio_compare_and_write";
        if expected.len() != data.len() {
            let e = Error::invalid(
                OP,
                self.spec(),
                "compare and write buffers differ in length",
            );
            return self.aio_refused(e, finish_cmpwrite);
        }
        if let Err(e) = check_write_range(self, OP, offset, data.len() as u64) {
            return self.aio_refused(e, finish_cmpwrite);
        }
        let (cmp, buf, len) = (expected.as_ptr(), data.as_ptr(), data.len());
        let raw = self.raw();
        let payload = Payload::Pair {
            _expected: expected,
            _data: data,
        };
        self.aio_start(OP, payload, finish_cmpwrite, |out, c| {
            // SAFETY: the image is open; both buffers are readable for `len`
            // bytes and owned by the request until the completion fires; the
            // mismatch out-pointer lives in the request, so it outlives
            // librbd's write to it.
            let ret = unsafe {
                sys::rbd_aio_compare_and_write(
                    raw,
                    offset,
                    len,
                    cmp.cast(),
                    buf.cast(),
                    c,
                    out.mismatch.get(),
                    0,
                )
            };
            ret.clamp(c_int::MIN as isize, 0) as c_int
        })
    }

    /// Scatter/gather [`aio_compare_and_write`](Image::aio_compare_and_write):
    /// writes the `data` buffers one after the other at `offset` only if the
    /// range currently holds the `expected` buffers' bytes (the same total
    /// length, 1 to 1024 buffers each). Resolves to `Ok(None)` when written,
    /// or to `Ok(Some(offset_of_first_mismatch))` with nothing written.
    /// Wraps `rbd_aio_compare_and_writev`, added in librbd 1.18 (Ceph 18
    /// Reef); built against older headers it fails with `NotSupported`.
    pub fn aio_compare_and_writev(
        &self,
        offset: u64,
        expected: Vec<Vec<u8>>,
        data: Vec<Vec<u8>>,
    ) -> AioFuture<Option<u64>> {
        const OP: &str = "rbd_aio_compare_and_writev";
        #[cfg(librbd_supports_compare_and_write_iovec)]
        {
            let cmp_total: u64 = expected.iter().map(|b| b.len() as u64).sum();
            let total: u64 = data.iter().map(|b| b.len() as u64).sum();
            if cmp_total != total {
                let e = Error::invalid(
                    OP,
                    self.spec(),
                    format!(
                        "{cmp_total} bytes to compare but {total} to write; they must be equal"
                    ),
                );
                return self.aio_refused(e, finish_cmpwrite);
            }
            if let Err(e) = check_iovecs(self, OP, offset, expected.len(), total)
                .and_then(|()| check_iovecs(self, OP, offset, data.len(), total))
                .and_then(|()| check_write_range(self, OP, offset, total))
            {
                return self.aio_refused(e, finish_cmpwrite);
            }
            let (Payload::Bufs(eb, ei), cp, cn) = iovec_payload(expected) else {
                unreachable!("iovec_payload returns Bufs")
            };
            let (Payload::Bufs(db, di), dp, dn) = iovec_payload(data) else {
                unreachable!("iovec_payload returns Bufs")
            };
            let payload = Payload::PairV {
                _expected: (eb, ei),
                _data: (db, di),
            };
            let raw = self.raw();
            self.aio_start(OP, payload, finish_cmpwrite, |out, c| {
                // SAFETY: the image is open; `cp`/`dp` point to `cn`/`dn`
                // iovecs over readable buffers, all owned by the request until
                // the completion fires (librbd only reads them); the mismatch
                // out-pointer lives in the request, so it outlives librbd's
                // write to it (librbd.h: rbd_aio_compare_and_writev).
                let ret = unsafe {
                    sys::rbd_aio_compare_and_writev(
                        raw,
                        offset,
                        cp,
                        cn,
                        dp,
                        dn,
                        c,
                        out.mismatch.get(),
                        0,
                    )
                };
                ret.clamp(c_int::MIN as isize, 0) as c_int
            })
        }
        #[cfg(not(librbd_supports_compare_and_write_iovec))]
        {
            let _ = (offset, expected, data);
            self.aio_refused(
                crate::rbd::needs_librbd(OP, self.spec(), 18),
                finish_cmpwrite,
            )
        }
    }

    /// Opens an image read-write without blocking. Wraps `rbd_aio_open`.
    ///
    /// Dropping the future before it resolves is allowed: a background
    /// thread then waits for librbd and closes the image it opened.
    pub fn open_async(ioctx: &IoCtx, name: &str) -> AioOpen {
        AioOpen::start(ioctx, name, false)
    }

    /// Opens an image read-only without blocking. Wraps
    /// `rbd_aio_open_read_only`.
    pub fn open_read_only_async(ioctx: &IoCtx, name: &str) -> AioOpen {
        AioOpen::start(ioctx, name, true)
    }

    /// Closes the image without blocking, reporting any error. Wraps
    /// `rbd_aio_close`.
    ///
    /// Requests still in flight complete first (librbd drains them). The
    /// image's [`IoCtx`] is kept alive until the close is done, even if the
    /// future is dropped (a background thread then waits for it).
    pub fn close_async(mut self) -> AioClose {
        let ioctx = self.ioctx().clone();
        let object = self.spec();
        // From here on `self` no longer closes the handle on drop.
        let raw = self.take_raw();
        drop(self);
        let inner = start(
            "rbd_aio_close",
            object,
            Payload::None,
            finish_unit,
            |_, c| {
                // SAFETY: `raw` is open and nothing else uses or closes it: it
                // was taken out of the `Image` we own.
                unsafe { sys::rbd_aio_close(raw, c) }
            },
        );
        if !inner.is_submitted() {
            // librbd refused the close, so the handle is still open: close it
            // synchronously rather than leak it (the future still reports
            // librbd's refusal).
            // SAFETY: `raw` is open and closed only here.
            unsafe { sys::rbd_close(raw) };
        }
        AioClose {
            inner: Some(inner),
            ioctx: Some(ioctx),
        }
    }
}

fn check_iovecs(image: &Image, op: &'static str, offset: u64, n: usize, total: u64) -> Result<()> {
    if n == 0 || n > MAX_IOVECS {
        return Err(Error::invalid(
            op,
            image.spec(),
            format!("{n} buffers given; between 1 and {MAX_IOVECS} are allowed"),
        ));
    }
    check_buffer(image, op, offset, total)
}

/// The future of [`Image::open_async`] and [`Image::open_read_only_async`].
#[must_use = "the open is already submitted; dropping the future closes the image again"]
pub struct AioOpen {
    inner: Option<AioFuture<RawImage>>,
    ioctx: Option<IoCtx>,
    name: String,
    read_only: bool,
}

impl AioOpen {
    fn start(ioctx: &IoCtx, name: &str, read_only: bool) -> AioOpen {
        let op = if read_only {
            "rbd_aio_open_read_only"
        } else {
            "rbd_aio_open"
        };
        let object = ioctx.object_spec(name);
        let inner = match cstr(name, op, "image name") {
            Err(e) => AioFuture::failed(e, op, object, finish_open),
            Ok(n) => {
                let io = ioctx.raw();
                start(op, object, Payload::None, finish_open, |out, c| {
                    // SAFETY: the ioctx is live (librbd duplicates it and we
                    // keep ours until the open completes); `n` is
                    // NUL-terminated and copied during the call; the handle
                    // out-pointer lives in the request, so it outlives
                    // librbd's write to it at completion; no snapshot.
                    unsafe {
                        if read_only {
                            sys::rbd_aio_open_read_only(
                                io,
                                n.as_ptr(),
                                out.image.get(),
                                ptr::null(),
                                c,
                            )
                        } else {
                            sys::rbd_aio_open(io, n.as_ptr(), out.image.get(), ptr::null(), c)
                        }
                    }
                })
            }
        };
        AioOpen {
            inner: Some(inner),
            ioctx: Some(ioctx.clone()),
            name: name.to_owned(),
            read_only,
        }
    }
}

impl Future for AioOpen {
    type Output = Result<Image>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Image>> {
        let this = self.get_mut();
        let inner = this
            .inner
            .as_mut()
            .expect("AioOpen polled after completion");
        let res = match Pin::new(inner).poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(r) => r,
        };
        this.inner = None;
        let ioctx = this.ioctx.take().expect("ioctx is held until completion");
        Poll::Ready(res.map(|raw| {
            // SAFETY: `raw` is the open handle librbd just gave us; nothing
            // else references it, so the `Image` becomes its only owner.
            unsafe { Image::from_raw(raw.0, &ioctx, &this.name, this.read_only) }
        }))
    }
}

impl Drop for AioOpen {
    fn drop(&mut self) {
        let (Some(inner), Some(ioctx)) = (self.inner.take(), self.ioctx.take()) else {
            return;
        };
        if !inner.is_submitted() {
            return; // refused before librbd saw it: nothing was opened
        }
        let name = std::mem::take(&mut self.name);
        let read_only = self.read_only;
        in_background(move || {
            if let Ok(raw) = wait(inner) {
                // SAFETY: as in `poll`: the handle is open and ours alone.
                // Dropping the `Image` closes it (synchronously, here on the
                // background thread) before the ioctx goes.
                drop(unsafe { Image::from_raw(raw.0, &ioctx, &name, read_only) });
            }
            drop(ioctx);
        });
    }
}

impl std::fmt::Debug for AioOpen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AioOpen")
            .field("name", &self.name)
            .field("read_only", &self.read_only)
            .finish()
    }
}

/// The future of [`Image::close_async`].
#[must_use = "the close is already submitted; the future only reports its result"]
#[derive(Debug)]
pub struct AioClose {
    inner: Option<AioFuture<()>>,
    // Kept until librbd finished closing: the image handle uses the cluster.
    ioctx: Option<IoCtx>,
}

impl Future for AioClose {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        let inner = this
            .inner
            .as_mut()
            .expect("AioClose polled after completion");
        match Pin::new(inner).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(r) => {
                this.inner = None;
                this.ioctx = None;
                Poll::Ready(r)
            }
        }
    }
}

impl Drop for AioClose {
    fn drop(&mut self) {
        let (Some(inner), Some(ioctx)) = (self.inner.take(), self.ioctx.take()) else {
            return;
        };
        if inner.is_complete() {
            return;
        }
        in_background(move || {
            let _ = wait(inner);
            drop(ioctx);
        });
    }
}

/// Runs `f` on a new short-lived thread, or right here if no thread can be
/// started.
fn in_background(f: impl FnOnce() + Send + 'static) {
    let slot = Arc::new(Mutex::new(Some(f)));
    let theirs = Arc::clone(&slot);
    let spawned = std::thread::Builder::new()
        .name("rbdkit-aio-reap".into())
        .spawn(move || {
            let f = theirs.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(f) = f {
                f();
            }
        });
    if spawned.is_err() {
        let f = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(f) = f {
            f();
        }
    }
}

/// Blocks the current thread until `fut` resolves.
fn wait<F: Future + Unpin>(mut fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = Pin::new(&mut fut).poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

// The futures can be spawned on any multi-threaded executor.
const _: () = {
    const fn send_static<T: Send + 'static>() {}
    send_static::<AioFuture<()>>();
    send_static::<AioRead>();
    send_static::<AioFuture<Vec<Vec<u8>>>>();
    send_static::<AioOpen>();
    send_static::<AioClose>();
};
