//! Manager commands: [`Cluster::mgr_command`], bounded by rbdkit rather
//! than by librados.
//!
//! Pacific's `rados_mgr_command` hands `MgrClient` pointers into its own
//! stack frame (the reply buffers and the completion) and then waits at
//! most `rados_mon_op_timeout`. When that wait ends first, it returns while
//! the command is still queued; the manager's late answer is then written
//! into freed memory and the process crashes (seen as a SIGSEGV in
//! `ceph::buffer::ptr::release` under `MgrClient::handle_command_reply`,
//! after a manager restart). So every manager command runs on a connection
//! of its own that waits without a bound, on a thread of its own; the
//! caller stops waiting after the mon-op timeout, and the thread keeps its
//! frame alive until the answer comes.

use std::collections::HashSet;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};
use crate::rados::cluster::command_prefix;
use crate::rados::{Cluster, MonCommandReply};

/// The call errors name.
const OP: &str = "rados_mgr_command";

/// The clusters (by fsid) with a manager command that outlived its
/// caller's wait and is still waiting for the manager's answer.
static WAITING: Mutex<Option<HashSet<String>>> = Mutex::new(None);

fn waiting() -> MutexGuard<'static, Option<HashSet<String>>> {
    WAITING.lock().unwrap_or_else(|e| e.into_inner())
}

/// One call's ending, shared by the caller and the call's thread, so
/// that exactly one of them takes an abandoned call out of [`WAITING`].
#[derive(Default)]
struct Ending {
    /// The call returned.
    done: bool,
    /// The caller stopped waiting first, and put the fsid in [`WAITING`].
    abandoned: bool,
}

impl Cluster {
    /// Sends a JSON command to the active manager, for its modules'
    /// commands such as `{"prefix": "rbd mirror snapshot schedule add",
    /// ...}` (the `rbd_support` module). Wraps `rados_mgr_command`.
    ///
    /// Bounded by this connection's mon-op timeout, but not by librados:
    /// Pacific's `rados_mgr_command` crashes the process when the manager
    /// answers after librados stopped waiting. The command runs on a short
    /// connection of its own, made with the same options, that waits for
    /// the answer; past the timeout the error is [`ErrorKind::TimedOut`]
    /// and that connection is left to take the answer. The command may
    /// still run then. Until it is answered, a new manager command to the
    /// same cluster fails at once with [`ErrorKind::Busy`], so at most one
    /// such connection per cluster is left waiting.
    ///
    /// Errors are as for [`Cluster::mon_command`].
    pub fn mgr_command(&self, command_json: &str, input: &[u8]) -> Result<MonCommandReply> {
        let prefix = command_prefix("mgr command", command_json);
        let fsid = self.fsid()?;
        if waiting().as_ref().is_some_and(|w| w.contains(&fsid)) {
            return Err(Error::with_kind(
                ErrorKind::Busy,
                libc::EBUSY,
                OP,
                prefix,
                format!(
                    "an earlier manager command to {} outlived its timeout and still waits for the manager's answer; try again later",
                    self.label()
                ),
            ));
        }
        let ending = Arc::new(Mutex::new(Ending::default()));
        let rx = self.spawn_mgr_command(command_json, input, &fsid, &ending, &prefix)?;
        let started = Instant::now();
        let answer = match self.mon_op_limit() {
            Some(t) => rx.recv_timeout(t),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match answer {
            Ok(r) => r,
            Err(RecvTimeoutError::Disconnected) => Err(Error::from_errno(libc::EIO, OP, prefix)
                .detail("the manager command's thread ended without an answer (it panicked)")),
            Err(RecvTimeoutError::Timeout) => {
                let mut e = ending.lock().unwrap_or_else(|e| e.into_inner());
                if e.done {
                    // Answered between the timeout and the lock.
                    drop(e);
                    return rx
                        .recv()
                        .unwrap_or_else(|_| Err(Error::from_errno(libc::EIO, OP, prefix)));
                }
                e.abandoned = true;
                waiting().get_or_insert_with(HashSet::new).insert(fsid);
                Err(Error::with_kind(
                    ErrorKind::TimedOut,
                    libc::ETIMEDOUT,
                    OP,
                    prefix,
                    format!(
                        "no answer from the manager of {} in {:.0?}; the command was left to finish on its own and may still run",
                        self.label(),
                        started.elapsed()
                    ),
                ))
            }
        }
    }

    /// Starts the command on a thread and a connection of its own, which
    /// waits for the answer however long it takes; the answer comes on the
    /// returned channel.
    fn spawn_mgr_command(
        &self,
        command_json: &str,
        input: &[u8],
        fsid: &str,
        ending: &Arc<Mutex<Ending>>,
        prefix: &str,
    ) -> Result<Receiver<Result<MonCommandReply>>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let options = self.options().with_unbounded_mon_ops();
        let (cmd, input) = (command_json.to_owned(), input.to_vec());
        let (ending, fsid) = (ending.clone(), fsid.to_owned());
        let spawned = std::thread::Builder::new()
            .name("rbdkit-mgr-cmd".into())
            .spawn(move || {
                // `own` is shut down here, after librados has returned.
                let r = options
                    .connect()
                    .and_then(|own| own.mgr_command_unbounded(&cmd, &input));
                let mut e = ending.lock().unwrap_or_else(|e| e.into_inner());
                e.done = true;
                if e.abandoned {
                    if let Some(w) = waiting().as_mut() {
                        w.remove(&fsid);
                    }
                }
                // A caller that gave up has dropped the receiver.
                let _ = tx.send(r);
            });
        match spawned {
            Ok(_) => Ok(rx),
            Err(e) => Err(
                Error::from_errno(e.raw_os_error().unwrap_or(libc::EAGAIN), OP, prefix)
                    .detail("cannot start a thread for the manager command"),
            ),
        }
    }

    /// This connection's mon-op timeout as librados uses it (none: 0,
    /// which waits forever).
    fn mon_op_limit(&self) -> Option<Duration> {
        let secs = self
            .conf_get("rados_mon_op_timeout")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(crate::rados::DEFAULT_OP_TIMEOUT.as_secs_f64());
        (secs > 0.0).then(|| Duration::from_secs_f64(secs))
    }
}
