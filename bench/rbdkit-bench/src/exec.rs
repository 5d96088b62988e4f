//! A tiny single-threaded executor that keeps up to `depth` futures in
//! flight: just wakers and `thread::park`, so the measurement has no
//! runtime of its own to pay for (rbdkit's futures need none).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};

/// Slots woken since the executor last looked, and the thread to unpark.
struct Ready {
    woken: Mutex<Vec<usize>>,
    thread: Thread,
}

/// The waker of one slot: records the slot and unparks the executor.
struct SlotWaker {
    slot: usize,
    ready: Arc<Ready>,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.ready
            .woken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.slot);
        self.ready.thread.unpark();
    }
}

/// Runs `make(0)`, `make(1)`, … `make(total - 1)` with at most `depth` of
/// them in flight at once, starting the next as soon as one finishes, and
/// hands each result to `done`. Returns the first error (dropping whatever
/// is still in flight).
pub fn run_queue<F, Fut, T, E, D>(
    depth: usize,
    total: u64,
    mut make: F,
    mut done_with: D,
) -> Result<(), E>
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    D: FnMut(T),
{
    let depth = depth.max(1);
    let ready = Arc::new(Ready {
        woken: Mutex::new(Vec::new()),
        thread: thread::current(),
    });
    let wakers: Vec<Waker> = (0..depth)
        .map(|slot| {
            Waker::from(Arc::new(SlotWaker {
                slot,
                ready: Arc::clone(&ready),
            }))
        })
        .collect();
    let mut slots: Vec<Option<Pin<Box<Fut>>>> = (0..depth).map(|_| None).collect();
    let (mut next, mut done) = (0u64, 0u64);
    let mut to_poll: Vec<usize> = (0..depth).collect();
    let mut woken = Vec::new();
    while done < total {
        for slot in to_poll.drain(..) {
            loop {
                if slots[slot].is_none() {
                    if next == total {
                        break;
                    }
                    slots[slot] = Some(Box::pin(make(next)));
                    next += 1;
                }
                let fut = slots[slot].as_mut().expect("slot was just filled");
                match fut.as_mut().poll(&mut Context::from_waker(&wakers[slot])) {
                    Poll::Ready(result) => {
                        done_with(result?);
                        slots[slot] = None;
                        done += 1;
                    }
                    Poll::Pending => break,
                }
            }
        }
        if done == total {
            break;
        }
        loop {
            std::mem::swap(
                &mut *ready.woken.lock().unwrap_or_else(|p| p.into_inner()),
                &mut woken,
            );
            if !woken.is_empty() {
                break;
            }
            thread::park();
        }
        to_poll.append(&mut woken);
    }
    Ok(())
}

/// Unparks a thread when woken.
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs one future to completion on this thread.
pub fn block_on<Fut: Future>(fut: Fut) -> Fut::Output {
    let waker = Waker::from(Arc::new(Unpark(thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        thread::park();
    }
}
