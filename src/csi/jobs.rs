//! Controller work that outlives the request that started it: the data
//! copies of a group snapshot's members, on librbd releases that cannot
//! clone from a group snapshot (before Squid, so Pacific and Reef).
//!
//! A copy lasts as long as its data takes. Inside the RPC it held one of
//! the blocking pool's slots, so a few large group snapshots stalled every
//! other controller call, and once the CO's deadline cancelled the request
//! the copy ran on while the CO's retry raced it. Here the copy is a job:
//! it runs on a blocking thread outside that pool, at most
//! [`MAX_RUNNING`] at once, and holds the group snapshot's in-flight id
//! until it ends, so a delete meanwhile is ABORTED (and retried by the CO).
//! The CO's retries of the create are answered at once from the job's
//! state, with the members still copying not ready; csi-snapshotter keeps
//! retrying until all are. A job that fails is reported to the next
//! retry, which then starts over.
//!
//! The state is in memory only: after a restart the CO's next retry finds
//! the group snapshot half made (the RBD group snapshot kept until every
//! member exists) and starts the job again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Semaphore;
use tonic::Status;

use crate::csi::driver::InFlight;
use crate::volume::group_snapshot::GroupSnapshotInfo;

/// The most jobs that copy at once; the others wait for a slot.
pub const MAX_RUNNING: usize = 2;

#[derive(Debug)]
enum JobState {
    /// Copying; what a retry reports meanwhile.
    Running(GroupSnapshotInfo),
    /// Ended with this error, not yet reported.
    Failed(Status),
}

/// The background jobs of one driver, by key (a group snapshot's handle).
#[derive(Debug)]
pub struct Jobs {
    state: Arc<Mutex<HashMap<String, JobState>>>,
    slots: Arc<Semaphore>,
}

impl Default for Jobs {
    fn default() -> Self {
        Jobs::new()
    }
}

impl Jobs {
    /// No jobs.
    pub fn new() -> Jobs {
        Jobs {
            state: Arc::new(Mutex::new(HashMap::new())),
            slots: Arc::new(Semaphore::new(MAX_RUNNING)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, JobState>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Job `key` while it runs: what to report meanwhile.
    pub fn running(&self, key: &str) -> Option<GroupSnapshotInfo> {
        match self.lock().get(key) {
            Some(JobState::Running(info)) => Some(info.clone()),
            _ => None,
        }
    }

    /// Job `key`'s state for the create it was started by: `Ok` while it
    /// runs, its error once if it failed (then forgotten, so the next
    /// retry starts over), `None` with no job (or a finished one).
    pub fn take(&self, key: &str) -> Option<Result<GroupSnapshotInfo, Status>> {
        let mut state = self.lock();
        if let Some(JobState::Running(info)) = state.get(key) {
            return Some(Ok(info.clone()));
        }
        match state.remove(key) {
            Some(JobState::Failed(status)) => Some(Err(status)),
            _ => None,
        }
    }

    /// Runs `work` for `key` in the background, reported meanwhile as
    /// `info`, holding `busy` until it ends.
    pub fn start(
        &self,
        key: String,
        info: GroupSnapshotInfo,
        busy: InFlight,
        work: impl FnOnce() -> Result<GroupSnapshotInfo, Status> + Send + 'static,
    ) {
        self.lock().insert(key.clone(), JobState::Running(info));
        let state = Arc::clone(&self.state);
        let slots = Arc::clone(&self.slots);
        tokio::spawn(async move {
            // The semaphore is never closed.
            let _slot = slots.acquire_owned().await;
            let started = Instant::now();
            let out = tokio::task::spawn_blocking(work)
                .await
                .unwrap_or_else(|e| Err(Status::internal(format!("the copy job ended: {e}"))));
            let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
            match out {
                Ok(done) => {
                    tracing::info!(group_snapshot = %done.id, took = ?started.elapsed(),
                        "group snapshot members copied");
                    st.remove(&key);
                }
                Err(status) => {
                    tracing::warn!(group_snapshot = %key, error = %status.message(),
                        "copying group snapshot members failed; the next retry starts over");
                    st.insert(key, JobState::Failed(status));
                }
            }
            drop(st);
            drop(busy);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume::GroupSnapshotId;

    fn info() -> GroupSnapshotInfo {
        GroupSnapshotInfo {
            id: GroupSnapshotId {
                cluster_id: "c".into(),
                pool: "rbd".into(),
                rados_namespace: String::new(),
                name: "g".into(),
            },
            members: Vec::new(),
        }
    }

    fn busy() -> InFlight {
        crate::csi::driver::test_in_flight("g")
    }

    #[tokio::test]
    async fn a_job_is_reported_while_it_runs_and_its_failure_once() {
        let jobs = Jobs::new();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        jobs.start("g".into(), info(), busy(), move || {
            rx.recv().ok();
            Err(Status::unavailable("pool full"))
        });
        assert!(jobs.running("g").is_some());
        assert!(matches!(jobs.take("g"), Some(Ok(_))));
        tx.send(()).unwrap();
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while jobs.running("g").is_some() {
            assert!(Instant::now() < deadline, "the job never ended");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let failed = jobs.take("g").expect("the failure, once");
        assert_eq!(failed.unwrap_err().message(), "pool full");
        assert!(jobs.take("g").is_none());
    }
}
