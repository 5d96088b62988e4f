//! Running blocking library calls from async code.
//!
//! librados and librbd calls block the calling thread. [`BlockingPool`] runs
//! them with `tokio::task::spawn_blocking`, at most `limit` at a time, so a
//! slow or dead cluster can tie up only a bounded number of threads (and each
//! call is itself bounded by the connection's timeouts).

use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::error::{Error, Result};

/// A bounded gateway from async code to blocking Ceph calls.
#[derive(Debug, Clone)]
pub struct BlockingPool {
    permits: Arc<Semaphore>,
}

impl BlockingPool {
    /// A pool that runs at most `limit` calls at once (at least one).
    pub fn new(limit: usize) -> BlockingPool {
        BlockingPool {
            permits: Arc::new(Semaphore::new(limit.max(1))),
        }
    }

    /// Runs `f` on a blocking thread once a slot is free and returns its
    /// result. A panic in `f` is resumed in the caller.
    pub async fn run<T, F>(&self, f: F) -> Result<T>
    where
        F: FnOnce() -> Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .map_err(|_| Error::from_errno(libc::ESHUTDOWN, "blocking pool", "closed"))?;
        let joined = tokio::task::spawn_blocking(move || {
            let out = f();
            drop(permit);
            out
        })
        .await;
        match joined {
            Ok(out) => out,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(Error::from_errno(
                libc::ECANCELED,
                "blocking pool",
                "task cancelled",
            )),
        }
    }

    /// How many more calls could start right now.
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }
}

impl Default for BlockingPool {
    fn default() -> Self {
        BlockingPool::new(16)
    }
}
