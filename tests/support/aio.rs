//! `rbdkit::rbd::aio_live_requests()` counts the AIO requests of the whole
//! process, so the tests that expect it to drop to 0 must not overlap any
//! other test of the binary that issues AIO. Those take [`exclusive`]; every
//! other AIO user takes [`shared`].

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static COUNTER: RwLock<()> = RwLock::new(());

/// A held [`shared`] lock. Async tests hold it across awaits: each test runs
/// on a thread of its own, so no task of the same thread can wait for it.
pub struct Shared(#[allow(dead_code)] RwLockReadGuard<'static, ()>);

/// Held by a test that issues AIO but does not read the live count.
pub fn shared() -> Shared {
    Shared(COUNTER.read().unwrap_or_else(|e| e.into_inner()))
}

/// Held by a test that expects the live count to reach a value.
pub fn exclusive() -> RwLockWriteGuard<'static, ()> {
    COUNTER.write().unwrap_or_else(|e| e.into_inner())
}
