//! tokio `AsyncRead`/`AsyncWrite`/`AsyncSeek` over an image, on top of the
//! AIO futures of [`aio`](super::aio) (feature `service`).

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncSeek, AsyncWrite, ReadBuf};

use crate::rbd::{AioFuture, AioRead, Image};

/// The largest single request the adapter issues.
const MAX_REQUEST: usize = 8 << 20;

/// An image as a tokio byte stream with a position, like a file.
///
/// - Reads issue one `rbd_aio_read` at a time and end (return 0 bytes) at
///   the end of the image.
/// - Writes are write-behind, like `tokio::fs::File`: `poll_write` copies the
///   data into a request and returns at once, with up to
///   [`queue_depth`](ImageIo::with_queue_depth) writes in flight. A failed
///   write is reported by a later `poll_write`, `poll_flush` or
///   `poll_shutdown`; call `flush` (which also runs `rbd_aio_flush`) to know
///   everything is written. Writes never grow the image: at its end
///   `poll_write` returns 0 (so `write_all` fails with `WriteZero`).
/// - A read first waits for the writes in flight, so reads see earlier
///   writes. Seeking is immediate; `SeekFrom::End` is relative to the
///   image's current size.
///
/// The image is held through an [`Arc`], so other tasks may use it at the
/// same time (see the sharing rule in [`aio`](super::aio)).
#[derive(Debug)]
pub struct ImageIo {
    image: Arc<Image>,
    pos: u64,
    read: Option<AioRead>,
    writes: VecDeque<AioFuture<()>>,
    flush: Option<AioFuture<()>>,
    queue_depth: usize,
}

impl ImageIo {
    /// A stream over `image` at position 0, with up to 4 writes in flight.
    pub fn new(image: impl Into<Arc<Image>>) -> ImageIo {
        ImageIo {
            image: image.into(),
            pos: 0,
            read: None,
            writes: VecDeque::new(),
            flush: None,
            queue_depth: 4,
        }
    }

    /// Sets how many writes may be in flight at once (at least 1).
    pub fn with_queue_depth(mut self, depth: usize) -> ImageIo {
        self.queue_depth = depth.max(1);
        self
    }

    /// The current position in bytes.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// The image.
    pub fn image(&self) -> &Arc<Image> {
        &self.image
    }

    /// Gives the image back. Writes still in flight complete anyway (librbd
    /// cannot cancel them), but their errors are lost: flush first.
    pub fn into_inner(self) -> Arc<Image> {
        self.image
    }

    /// The size for I/O at the current position: cached while the position
    /// is inside it, re-read (a call that may block) only at or past it.
    fn size(&self) -> io::Result<u64> {
        Ok(self.image.size_covering(self.pos.saturating_add(1))?)
    }

    /// Polls the writes in flight, oldest first, until one is pending.
    /// Returns the first error met.
    fn poll_writes(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some(front) = self.writes.front_mut() {
            match Pin::new(front).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => {
                    self.writes.pop_front();
                    r?;
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

use std::future::Future;

impl AsyncRead for ImageIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if this.read.is_none() {
            match this.poll_writes(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r?,
            }
            let size = this.size()?;
            if this.pos >= size {
                return Poll::Ready(Ok(())); // end of image
            }
            let len = (buf.remaining() as u64)
                .min(size - this.pos)
                .min(MAX_REQUEST as u64) as usize;
            this.read = Some(this.image.aio_read(this.pos, len));
        }
        let read = this.read.as_mut().expect("a read is in flight");
        match Pin::new(read).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(r) => {
                this.read = None;
                let data = r?;
                // The caller may pass a smaller buffer than the one the read
                // was sized for; the rest is simply read again later.
                let n = data.len().min(buf.remaining());
                buf.put_slice(&data[..n]);
                this.pos += n as u64;
                Poll::Ready(Ok(()))
            }
        }
    }
}

impl AsyncWrite for ImageIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        // Collect finished writes (reporting the first error) and wait for
        // room in the queue.
        if let Poll::Ready(Err(e)) = this.poll_writes(cx) {
            return Poll::Ready(Err(e));
        }
        if this.writes.len() >= this.queue_depth {
            return Poll::Pending; // woken by the oldest write
        }
        // A read left pending by the caller is stale now.
        this.read = None;
        let size = this.size()?;
        if this.pos >= size {
            return Poll::Ready(Ok(0));
        }
        let n = (data.len() as u64)
            .min(size - this.pos)
            .min(MAX_REQUEST as u64) as usize;
        this.writes
            .push_back(this.image.aio_write(this.pos, &data[..n]));
        this.pos += n as u64;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.flush.is_none() {
            match this.poll_writes(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r?,
            }
            this.flush = Some(this.image.aio_flush());
        }
        let flush = this.flush.as_mut().expect("a flush is in flight");
        match Pin::new(flush).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(r) => {
                this.flush = None;
                Poll::Ready(r.map_err(io::Error::from))
            }
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_flush(cx)
    }
}

impl AsyncSeek for ImageIo {
    fn start_seek(self: Pin<&mut Self>, to: io::SeekFrom) -> io::Result<()> {
        let this = self.get_mut();
        let target = match to {
            io::SeekFrom::Start(n) => Some(n),
            io::SeekFrom::Current(d) => this.pos.checked_add_signed(d),
            io::SeekFrom::End(d) => this.image.size()?.checked_add_signed(d),
        };
        let target = target.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek to a negative or overflowing position",
            )
        })?;
        this.read = None;
        this.pos = target;
        Ok(())
    }

    fn poll_complete(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<u64>> {
        Poll::Ready(Ok(self.pos))
    }
}
