//! Leader election on a `coordination.k8s.io/v1` Lease, the way client-go's
//! leaderelection package does it.
//!
//! A candidate reads the Lease. It takes it when it is free or when its
//! record has not changed for a whole lease duration (timed with the local
//! monotonic clock, so clock skew between nodes does not matter); the holder
//! renews it every retry period. Every write carries the `resourceVersion`
//! it read, so two candidates can never both win.
//!
//! Leadership is published through a [`tokio::sync::watch`] channel. It is
//! dropped *at once* when the holder learns someone else holds the Lease, or
//! when it has not managed to renew for the renew deadline (which is shorter
//! than the lease duration, so the old leader stops before anyone else may
//! take over). On shutdown the holder releases the Lease so a standby takes
//! over without waiting.
//!
//! Dropping the controllers does not stop a Ceph call already running on
//! the blocking pool, so the elector also feeds a [`LeaseFence`]: the volume
//! operations ask it before each destructive step, and it allows the step
//! only while the lease is held and still valid for the step's whole bound.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;

/// Timing of the election. Must satisfy
/// `retry_period < renew_deadline < lease_duration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How long a lease is valid without renewal; standbys wait this long
    /// after the last change they saw before taking over.
    pub lease_duration: Duration,
    /// How long the holder keeps acting without a successful renewal.
    pub renew_deadline: Duration,
    /// How often the holder renews and candidates retry.
    pub retry_period: Duration,
}

impl Default for Timing {
    /// client-go's defaults: 15 s, 10 s, 2 s.
    fn default() -> Self {
        Timing {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

impl Timing {
    /// Checks the ordering constraint.
    pub fn validate(&self) -> Result<(), String> {
        if self.retry_period.is_zero()
            || self.retry_period >= self.renew_deadline
            || self.renew_deadline >= self.lease_duration
        {
            return Err(format!(
                "leader election needs 0 < retry period ({:?}) < renew deadline ({:?}) < lease duration ({:?})",
                self.retry_period, self.renew_deadline, self.lease_duration
            ));
        }
        Ok(())
    }
}

/// A candidate for one Lease.
#[derive(Clone)]
pub struct LeaderElector {
    api: Api<Lease>,
    lease_name: String,
    identity: String,
    timing: Timing,
    /// When the last successful acquire or renew was sent, while we lead.
    renewed: Arc<Mutex<Option<std::time::Instant>>>,
}

/// The leader lease as a [`Fence`](crate::volume::Fence) for the volume operations.
///
/// A step may start only while this replica holds the lease and
/// `last renew + lease duration − margin − step bound > now`, where the last
/// renew is when the successful write was *sent* (a standby starts its own
/// lease-duration wait only after it sees that write, so it cannot take over
/// before then) and the margin covers clock-rate differences between nodes.
/// The step bound is the Ceph operation timeout, which bounds each call.
#[derive(Clone)]
pub struct LeaseFence {
    renewed: Arc<Mutex<Option<std::time::Instant>>>,
    lease_name: String,
    lease_duration: Duration,
    margin: Duration,
    step_bound: Duration,
}

impl std::fmt::Debug for LeaseFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseFence")
            .field("lease", &self.lease_name)
            .field("step_bound", &self.step_bound)
            .field("remaining", &self.remaining())
            .finish()
    }
}

/// The fence's safety margin for a lease duration: a tenth of it, at least
/// 100 ms.
pub fn fence_margin(lease_duration: Duration) -> Duration {
    (lease_duration / 10).max(Duration::from_millis(100))
}

/// Checks that fenced steps of `step_bound` can run at all with `timing`:
/// right before a renewal is due, a step must still fit in the lease.
pub fn validate_fence(timing: &Timing, step_bound: Duration) -> Result<(), String> {
    let needed = step_bound + fence_margin(timing.lease_duration) + timing.retry_period;
    if timing.lease_duration <= needed {
        return Err(format!(
            "the lease duration ({:?}) must be longer than the Ceph operation timeout ({step_bound:?}) + the retry period ({:?}) + a tenth of the lease duration ({:?}), so that a Ceph step started by the leader ends before another replica may take over",
            timing.lease_duration,
            timing.retry_period,
            fence_margin(timing.lease_duration)
        ));
    }
    Ok(())
}

impl LeaseFence {
    /// For how much longer a step started now could still run inside the
    /// lease (`None`: the lease is not held).
    pub fn remaining(&self) -> Option<Duration> {
        let renewed = (*self.renewed.lock().unwrap_or_else(|e| e.into_inner()))?;
        let valid_until = renewed + self.lease_duration.saturating_sub(self.margin);
        Some(valid_until.saturating_duration_since(std::time::Instant::now()))
    }
}

impl crate::volume::Fence for LeaseFence {
    fn check(&self, step: &'static str, object: &str) -> crate::Result<()> {
        let refuse = |why: String| {
            Err(crate::Error::with_kind(
                crate::ErrorKind::Fenced,
                libc::ECANCELED,
                step,
                object,
                format!("not made: {why}; the leader will retry it"),
            ))
        };
        match self.remaining() {
            None => refuse(format!(
                "this replica no longer holds the leader lease {}",
                self.lease_name
            )),
            Some(left) if left <= self.step_bound => refuse(format!(
                "the leader lease {} is valid for only {left:?} more (not renewed in time), less than the step's bound of {:?}",
                self.lease_name, self.step_bound
            )),
            Some(_) => Ok(()),
        }
    }
}

impl std::fmt::Debug for LeaderElector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderElector")
            .field("lease", &self.lease_name)
            .field("identity", &self.identity)
            .field("timing", &self.timing)
            .finish()
    }
}

/// What this candidate last saw of someone else's lease.
struct Observed {
    holder: Option<String>,
    renew: Option<MicroTime>,
    resource_version: Option<String>,
    at: Instant,
}

/// The outcome of one attempt.
enum Attempt {
    /// We hold the lease (acquired or renewed).
    Held,
    /// Someone else holds a valid lease.
    Other,
}

impl LeaderElector {
    /// A candidate for the Lease `lease_name` in the namespace of `api`,
    /// known as `identity`.
    pub fn new(api: Api<Lease>, lease_name: &str, identity: &str, timing: Timing) -> Self {
        LeaderElector {
            api,
            lease_name: lease_name.to_owned(),
            identity: identity.to_owned(),
            timing,
            renewed: Arc::default(),
        }
    }

    /// A fence that allows steps of `step_bound` only while this candidate
    /// leads with enough of its lease left (see [`LeaseFence`]).
    pub fn fence(&self, step_bound: Duration) -> LeaseFence {
        LeaseFence {
            renewed: Arc::clone(&self.renewed),
            lease_name: self.lease_name.clone(),
            lease_duration: self.timing.lease_duration,
            margin: fence_margin(self.timing.lease_duration),
            step_bound,
        }
    }

    fn set_renewed(&self, at: Option<Instant>) {
        *self.renewed.lock().unwrap_or_else(|e| e.into_inner()) = at.map(Instant::into_std);
    }

    /// Stops leading: the fence first, so no new step starts.
    fn step_down(&self, leader: &watch::Sender<bool>) {
        self.set_renewed(None);
        leader.send_replace(false);
    }

    /// This candidate's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Runs the election until `shutdown` resolves, publishing leadership on
    /// `leader`. On shutdown, a held lease is released.
    pub async fn run(
        self,
        leader: watch::Sender<bool>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let mut observed: Option<Observed> = None;
        let mut last_renew: Option<Instant> = None;
        tokio::pin!(shutdown);
        loop {
            let started = Instant::now();
            let attempt = tokio::time::timeout(
                self.timing.retry_period.max(Duration::from_secs(1)),
                self.try_acquire_or_renew(&mut observed),
            )
            .await;
            let is_leader = *leader.borrow();
            match attempt {
                Ok(Ok(Attempt::Held)) => {
                    last_renew = Some(started);
                    self.set_renewed(Some(started));
                    if !is_leader {
                        tracing::info!(lease = %self.lease_name, identity = %self.identity, "acquired the lease; leading");
                        leader.send_replace(true);
                    }
                }
                Ok(Ok(Attempt::Other)) => {
                    self.set_renewed(None);
                    if is_leader {
                        tracing::warn!(lease = %self.lease_name, "another replica holds the lease; stopping work");
                        leader.send_replace(false);
                    }
                    last_renew = None;
                }
                Ok(Err(e)) => self.failed(&leader, last_renew, &e.to_string()),
                Err(_) => self.failed(&leader, last_renew, "request timed out"),
            }
            let next = started + self.timing.retry_period;
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tokio::time::sleep_until(next) => {}
            }
            // The deadline check also runs when attempts keep timing out.
            if *leader.borrow() {
                if let Some(t) = last_renew {
                    if t.elapsed() > self.timing.renew_deadline {
                        tracing::warn!(lease = %self.lease_name, "could not renew the lease in time; stopping work");
                        self.step_down(&leader);
                    }
                }
            }
        }
        if *leader.borrow() {
            self.step_down(&leader);
            self.release().await;
        }
        self.set_renewed(None);
    }

    fn failed(&self, leader: &watch::Sender<bool>, last_renew: Option<Instant>, why: &str) {
        tracing::warn!(lease = %self.lease_name, error = why, "leader election request failed");
        if *leader.borrow() && last_renew.is_none_or(|t| t.elapsed() > self.timing.renew_deadline) {
            tracing::warn!(lease = %self.lease_name, "could not renew the lease in time; stopping work");
            self.step_down(leader);
        }
    }

    fn spec_for_us(&self, previous: Option<&LeaseSpec>) -> LeaseSpec {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let ours = previous
            .and_then(|p| p.holder_identity.as_deref())
            .is_some_and(|h| h == self.identity);
        let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.timing.lease_duration.as_secs().max(1) as i32),
            acquire_time: if ours {
                previous.and_then(|p| p.acquire_time.clone())
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if ours || previous.is_none() {
                transitions
            } else {
                transitions + 1
            }),
            ..Default::default()
        }
    }

    async fn try_acquire_or_renew(
        &self,
        observed: &mut Option<Observed>,
    ) -> Result<Attempt, kube::Error> {
        let current = match self.api.get_opt(&self.lease_name).await? {
            Some(l) => l,
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.lease_name.clone()),
                        ..Default::default()
                    },
                    spec: Some(self.spec_for_us(None)),
                };
                return match self.api.create(&PostParams::default(), &lease).await {
                    Ok(_) => Ok(Attempt::Held),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(Attempt::Other),
                    Err(e) => Err(e),
                };
            }
        };
        let spec = current.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let ours = holder.as_deref() == Some(self.identity.as_str());
        if !ours {
            let changed = match observed {
                Some(o) => {
                    o.holder != holder
                        || o.renew != spec.renew_time
                        || o.resource_version != current.metadata.resource_version
                }
                None => true,
            };
            if changed {
                *observed = Some(Observed {
                    holder: holder.clone(),
                    renew: spec.renew_time.clone(),
                    resource_version: current.metadata.resource_version.clone(),
                    at: Instant::now(),
                });
            }
            let duration = spec
                .lease_duration_seconds
                .map(|s| Duration::from_secs(s.max(0) as u64))
                .unwrap_or(self.timing.lease_duration);
            let seen_at = observed.as_ref().map(|o| o.at).unwrap_or_else(Instant::now);
            if holder.is_some() && seen_at.elapsed() < duration {
                return Ok(Attempt::Other);
            }
        }
        let mut lease = current;
        lease.spec = Some(self.spec_for_us(Some(&spec)));
        // `replace` sends the resourceVersion we read: a concurrent writer
        // makes this fail with 409 instead of both of us winning.
        match self
            .api
            .replace(&self.lease_name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(Attempt::Held),
            Err(kube::Error::Api(e)) if e.code == 409 && !ours => Ok(Attempt::Other),
            Err(e) => Err(e),
        }
    }

    /// Gives the lease up so that a standby can take it at once.
    async fn release(&self) {
        let result = async {
            let Some(mut lease) = self.api.get_opt(&self.lease_name).await? else {
                return Ok(());
            };
            let spec = lease.spec.get_or_insert_with(Default::default);
            if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
                return Ok(());
            }
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
            self.api
                .replace(&self.lease_name, &PostParams::default(), &lease)
                .await
                .map(|_| ())
        };
        match tokio::time::timeout(self.timing.retry_period * 2, result).await {
            Ok(Ok(())) => tracing::info!(lease = %self.lease_name, "released the lease"),
            Ok(Err(e)) => {
                tracing::warn!(lease = %self.lease_name, error = %e, "cannot release the lease")
            }
            Err(_) => tracing::warn!(lease = %self.lease_name, "releasing the lease timed out"),
        }
    }
}

/// The Lease name for a provisioner name: external-provisioner's convention
/// of replacing every character that is not a letter, digit, `-` or `.` with
/// `-` (so `rbd.rbdkit.io` stays as it is).
pub fn lease_name_for(provisioner: &str) -> String {
    provisioner
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_must_be_ordered() {
        assert!(Timing::default().validate().is_ok());
        let bad = Timing {
            lease_duration: Duration::from_secs(5),
            renew_deadline: Duration::from_secs(5),
            retry_period: Duration::from_secs(1),
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn the_fence_allows_a_step_only_inside_the_held_lease() {
        use crate::volume::Fence;
        let fence = LeaseFence {
            renewed: Arc::default(),
            lease_name: "l".into(),
            lease_duration: Duration::from_secs(10),
            margin: fence_margin(Duration::from_secs(10)),
            step_bound: Duration::from_secs(5),
        };
        let e = fence.check("rbd_remove", "c:rbd/img").unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Fenced);
        assert!(
            e.to_string().contains("no longer holds the leader lease l"),
            "{e}"
        );
        let now = std::time::Instant::now();
        *fence.renewed.lock().unwrap() = Some(now);
        fence.check("rbd_remove", "c:rbd/img").unwrap();
        // 10 s - 1 s margin - 5 s bound: a renewal 4.5 s old is too old.
        *fence.renewed.lock().unwrap() = now.checked_sub(Duration::from_millis(4500));
        let e = fence.check("rbd_remove", "c:rbd/img").unwrap_err();
        assert!(e.to_string().contains("valid for only"), "{e}");
    }

    #[test]
    fn default_timings_leave_room_for_a_fenced_step() {
        assert!(validate_fence(&Timing::default(), Duration::from_secs(10)).is_ok());
        assert!(validate_fence(&Timing::default(), Duration::from_secs(30)).is_err());
    }

    #[test]
    fn lease_names_are_dns_safe() {
        assert_eq!(lease_name_for("rbd.rbdkit.io"), "rbd.rbdkit.io");
        assert_eq!(lease_name_for("My_Prov/x"), "my-prov-x");
    }
}
