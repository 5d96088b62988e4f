//! Retry pacing: per-object capped exponential backoff ([`Backoff`],
//! [`FailureCounts`]) and a global token-bucket rate limit ([`RateLimiter`]).
//!
//! kube-runtime's controller requeues whenever its error policy says; these
//! decide *when*. Failures never make an object be dropped: the delay grows
//! to the cap and stays there until the object succeeds.
//!
//! The global limit counts *work*, not wake-ups. Every write the provisioner
//! makes (a finalizer, annotations, a PV, a status, an event) comes back to
//! it as a watch event and so as another reconcile of the same object, which
//! finds the object already handled and does nothing but read. Taking a token
//! at the start of every reconcile made those echoes, several per claim, use
//! most of the budget (a 500-claim burst ran at under 2 claims a second
//! while one provisioning is about 60 ms of Ceph work). So a reconcile runs
//! inside [`RateLimiter::scoped`] and takes its one token only at its first
//! API write or Ceph call ([`before_work`]): a retry storm of failing
//! reconciles is still paced (each failure writes an event or calls Ceph),
//! and a no-op echo is free. One operation (provisioning, deleting or
//! expanding a volume) thus costs one token; letting go of a claim once the
//! binder has bound it finishes a provisioning already paid for
//! ([`prepaid`]). Filtering the echoes out of the watch streams
//! instead would need to tell our writes from everyone else's (the binder
//! writes the same claims), and rate-limiting each write would charge one
//! provisioning five tokens.

use std::cell::Cell;
use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// Exponential backoff: `base * 2^(failures-1)`, capped at `max`, with up to
/// 10% of random jitter added so that retries of many objects spread out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay after the first failure.
    pub base: Duration,
    /// Longest delay, however many failures.
    pub max: Duration,
}

impl Default for Backoff {
    /// The delays external-provisioner uses: 1 s doubling to 5 min.
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(1),
            max: Duration::from_secs(300),
        }
    }
}

impl Backoff {
    /// The delay before retry number `failures` (1 for the first failure),
    /// without jitter.
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(32);
        self.base
            .checked_mul(1u32 << exp.min(31))
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// [`Backoff::delay`] plus up to 10% of jitter, never above `max`.
    pub fn delay_with_jitter(&self, failures: u32) -> Duration {
        let d = self.delay(failures);
        let jitter = d.mul_f64(0.1 * jitter_fraction());
        (d + jitter).min(self.max.max(d))
    }
}

/// A cheap pseudo-random fraction in `[0, 1)`, good enough for jitter.
fn jitter_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Consecutive failures per object, to feed [`Backoff`]. Success resets.
///
/// Entries of objects that stopped failing without succeeding (deleted
/// while failing) are forgotten once they have not failed for a long while
/// (an hour, or four maximum delays if that is longer), so the map cannot
/// grow without bound.
#[derive(Debug)]
pub struct FailureCounts<K> {
    backoff: Backoff,
    counts: Mutex<HashMap<K, (u32, Instant)>>,
}

impl<K: Hash + Eq + Clone> FailureCounts<K> {
    /// Empty counts with the given backoff.
    pub fn new(backoff: Backoff) -> Self {
        FailureCounts {
            backoff,
            counts: Mutex::new(HashMap::new()),
        }
    }

    /// Counts one more failure of `key` and returns how long to wait before
    /// retrying it.
    pub fn failed(&self, key: &K) -> Duration {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let keep = self
            .backoff
            .max
            .saturating_mul(4)
            .max(Duration::from_secs(3600));
        if counts.len() > 1024 {
            counts.retain(|_, (_, at)| now.duration_since(*at) < keep);
        }
        let entry = counts.entry(key.clone()).or_insert((0, now));
        entry.0 = entry.0.saturating_add(1);
        entry.1 = now;
        self.backoff.delay_with_jitter(entry.0)
    }

    /// Forgets the failures of `key` after it succeeded (or went away).
    pub fn succeeded(&self, key: &K) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        counts.remove(key);
    }

    /// How many consecutive failures `key` has had.
    pub fn failures(&self, key: &K) -> u32 {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        counts.get(key).map(|(n, _)| *n).unwrap_or(0)
    }
}

/// A token bucket shared by all workers: at most `burst` operations at once,
/// refilled at `per_second`. Bounds how hard a retry storm can hit the API
/// server and Ceph.
#[derive(Debug)]
pub struct RateLimiter {
    per_second: f64,
    burst: f64,
    state: tokio::sync::Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

impl RateLimiter {
    /// A bucket of `burst` tokens (at least one) refilled at `per_second`
    /// (at least 0.01).
    pub fn new(per_second: f64, burst: u32) -> RateLimiter {
        let burst = f64::from(burst.max(1));
        RateLimiter {
            per_second: per_second.max(0.01),
            burst,
            state: tokio::sync::Mutex::new(Bucket {
                tokens: burst,
                last: Instant::now(),
            }),
        }
    }

    /// Waits for a token. Waiters are served in order (the mutex is fair).
    pub async fn acquire(&self) {
        let mut bucket = self.state.lock().await;
        loop {
            let now = Instant::now();
            let refill = now.duration_since(bucket.last).as_secs_f64() * self.per_second;
            bucket.tokens = (bucket.tokens + refill).min(self.burst);
            bucket.last = now;
            if bucket.tokens >= 1.0 {
                bucket.tokens -= 1.0;
                return;
            }
            let wait = (1.0 - bucket.tokens) / self.per_second;
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        }
    }
}

/// The token of the reconcile running in this scope: the limiter, and
/// whether the token was taken yet.
struct Scope {
    limiter: Arc<RateLimiter>,
    taken: Cell<bool>,
}

tokio::task_local! {
    static SCOPE: Scope;
}

impl RateLimiter {
    /// Runs `fut` (one reconcile) so that its first [`before_work`] waits for
    /// a token of this limiter and later ones are free: at most one token per
    /// reconcile, and none for a reconcile that does no work.
    pub async fn scoped<F: Future>(self: &Arc<Self>, fut: F) -> F::Output {
        let scope = Scope {
            limiter: Arc::clone(self),
            taken: Cell::new(false),
        };
        SCOPE.scope(scope, fut).await
    }
}

/// Call before an API write or a Ceph call: inside [`RateLimiter::scoped`],
/// the first call waits for that limiter's token; later calls, and calls
/// outside any scope (the CSI controller, tests), return at once.
pub async fn before_work() {
    let limiter = SCOPE
        .try_with(|s| (!s.taken.replace(true)).then(|| Arc::clone(&s.limiter)))
        .ok()
        .flatten();
    if let Some(l) = limiter {
        l.acquire().await;
    }
}

/// Marks this scope's token as taken without waiting for one: for a write
/// that finishes an operation an earlier reconcile paid for (letting go of a
/// claim once it is bound). Outside a scope it does nothing.
pub fn prepaid() {
    let _ = SCOPE.try_with(|s| s.taken.set(true));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_never_gives_up() {
        let b = Backoff {
            base: Duration::from_millis(500),
            max: Duration::from_secs(10),
        };
        assert_eq!(b.delay(1), Duration::from_millis(500));
        assert_eq!(b.delay(2), Duration::from_secs(1));
        assert_eq!(b.delay(3), Duration::from_secs(2));
        assert_eq!(b.delay(6), Duration::from_secs(10));
        assert_eq!(b.delay(1000), Duration::from_secs(10));
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(10));
        for n in 1..50 {
            let d = b.delay_with_jitter(n);
            assert!(d >= b.delay(n) && d <= b.max, "{n}: {d:?}");
        }
    }

    #[test]
    fn counts_per_object_and_resets_on_success() {
        let c = FailureCounts::new(Backoff {
            base: Duration::from_secs(1),
            max: Duration::from_secs(60),
        });
        assert!(c.failed(&"a") < Duration::from_millis(1100));
        assert!(c.failed(&"a") >= Duration::from_secs(2));
        assert_eq!(c.failures(&"a"), 2);
        assert_eq!(c.failures(&"b"), 0);
        c.succeeded(&"a");
        assert_eq!(c.failures(&"a"), 0);
    }

    // Virtual time: the bounds below are exact, not a race with the machine.
    #[tokio::test(start_paused = true)]
    async fn rate_limiter_allows_a_burst_then_paces() {
        let r = RateLimiter::new(100.0, 3);
        let start = Instant::now();
        for _ in 0..3 {
            r.acquire().await;
        }
        assert!(start.elapsed() < Duration::from_millis(25));
        for _ in 0..10 {
            r.acquire().await;
        }
        // Ten more tokens at 100 per second take about 100 ms.
        assert!(start.elapsed() >= Duration::from_millis(90));
    }

    #[tokio::test(start_paused = true)]
    async fn a_scope_takes_one_token_at_its_first_work_and_none_without_work() {
        // One token in the bucket, then one every 50 ms.
        let r = Arc::new(RateLimiter::new(20.0, 1));
        let start = Instant::now();
        // Work called three times: one token.
        r.scoped(async {
            for _ in 0..3 {
                before_work().await;
            }
        })
        .await;
        assert!(start.elapsed() < Duration::from_millis(25));
        // No work (an echo of our own write): free, however many.
        for _ in 0..20 {
            r.scoped(async {}).await;
        }
        assert!(start.elapsed() < Duration::from_millis(25));
        // The next reconcile with work waits for the refill.
        r.scoped(before_work()).await;
        assert!(start.elapsed() >= Duration::from_millis(40));
        // Prepaid work takes no token.
        r.scoped(async {
            prepaid();
            before_work().await;
        })
        .await;
        assert!(start.elapsed() < Duration::from_millis(75));
        // Outside a scope nothing is taken and nothing waits.
        let t = Instant::now();
        for _ in 0..10 {
            before_work().await;
        }
        assert!(t.elapsed() < Duration::from_millis(25));
        // The scope ended: its token is not taken again.
        r.scoped(async {}).await;
        let t = Instant::now();
        r.scoped(before_work()).await;
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "{:?}",
            t.elapsed()
        );
    }
}
