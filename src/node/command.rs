//! Running the node's tools (`blkid`, `mkfs.*`, `resize2fs`, `xfs_growfs`).
//!
//! Fixed argv, no shell, an empty environment apart from `PATH` and
//! `LC_ALL=C` (so no secret of ours can leak into a child and messages are
//! stable), stdin from `/dev/null`, and a deadline: on expiry the child's
//! whole process group is killed.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};

/// Where the tools are looked up; the node image's standard directories.
const PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// How much of a child's stderr goes into an error message.
const MAX_STDERR: usize = 2048;

/// A finished child: its exit status and what it printed.
#[derive(Debug)]
pub(crate) struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// The exit code, or `None` when a signal ended the child.
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

/// Runs `program args...` and waits at most `timeout`. A child that does not
/// finish in time is killed (with its process group) and is a `TimedOut`
/// error. A non-zero exit is *not* an error here: see [`check`].
///
/// `op` is the tool's name for error messages; `object` the device or path.
pub(crate) fn run(
    op: &'static str,
    program: &str,
    args: &[&str],
    object: &str,
    timeout: Duration,
) -> Result<Output> {
    run_with_input(op, program, args, object, timeout, None)
}

/// [`run`] with `input` written to the child's stdin (then closed): how a
/// secret (a LUKS passphrase) reaches a tool, never through argv or the
/// environment.
pub(crate) fn run_with_input(
    op: &'static str,
    program: &str,
    args: &[&str],
    object: &str,
    timeout: Duration,
    input: Option<&[u8]>,
) -> Result<Output> {
    let mut child = Command::new(program)
        .args(args)
        .env_clear()
        .env("PATH", PATH)
        .env("LC_ALL", "C")
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| {
            Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), op, object)
                .detail(format!("cannot start {program}: {e}"))
        })?;
    if let (Some(data), Some(mut stdin)) = (input, child.stdin.take()) {
        use std::io::Write;
        // Small (a passphrase): fits the pipe buffer, so this never blocks
        // on a child that does not read; a child that exits early is EPIPE,
        // which its exit status reports.
        let _ = stdin.write_all(data);
        drop(stdin);
    }
    // Drain both pipes on their own threads so a chatty child never blocks.
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                kill_group(child.id());
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::with_kind(
                    ErrorKind::TimedOut,
                    libc::ETIMEDOUT,
                    op,
                    object,
                    format!("{program} did not finish within {timeout:?} and was killed"),
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => {
                kill_group(child.id());
                let _ = child.kill();
                let _ = child.wait();
                return Err(
                    Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), op, object)
                        .detail(format!("waiting for {program}: {e}")),
                );
            }
        }
    };
    Ok(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// Turns a non-zero exit into an error carrying the child's stderr (and
/// stdout, when it printed any).
pub(crate) fn check(op: &'static str, object: &str, out: Output) -> Result<Output> {
    if out.status.success() {
        return Ok(out);
    }
    Err(failure(op, object, &out))
}

/// The error for a child that exited unsuccessfully.
pub(crate) fn failure(op: &'static str, object: &str, out: &Output) -> Error {
    let how = match out.code() {
        Some(c) => format!("exit code {c}"),
        None => "killed by a signal".to_owned(),
    };
    // Both streams: e2fsck, for one, prints why on stdout ("/dev/loop0 is
    // in use.") and only "Cannot continue, aborting." on stderr.
    let (err, so) = (out.stderr.trim(), out.stdout.trim());
    let mut text = match (so.is_empty(), err.is_empty()) {
        (true, _) => err.to_owned(),
        (false, true) => so.to_owned(),
        (false, false) => format!("{err} (stdout: {so})"),
    };
    if text.len() > MAX_STDERR {
        let mut cut = MAX_STDERR;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str("...");
    }
    let detail = if text.is_empty() {
        how
    } else {
        format!("{how}: {text}")
    };
    Error::from_errno(libc::EIO, op, object).detail(detail)
}

fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut buf);
        }
        String::from_utf8_lossy(&buf).into_owned()
    })
}

fn kill_group(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) with a negative pid signals that process group; the
    // child was started with process_group(0), so its group id is its pid
    // and holds only it and its descendants.
    unsafe {
        libc::kill(-pid, libc::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sh -c script`, bounded.
    fn sh(script: &str) -> Output {
        run("sh", "sh", &["-c", script], "x", Duration::from_secs(10)).unwrap()
    }

    #[test]
    fn captures_output_and_exit_code() {
        let out = sh("echo out; echo err >&2; exit 3");
        assert_eq!(out.code(), Some(3));
        assert_eq!(out.stdout, "out\n");
        let e = check("sh", "x", out).unwrap_err();
        // Both streams: e2fsck says why on stdout only.
        assert_eq!(
            e.to_string(),
            "sh on x failed: exit code 3: err (stdout: out) (EIO)"
        );
        let e = check("sh", "x", sh("echo in use; exit 8")).unwrap_err();
        assert_eq!(e.to_string(), "sh on x failed: exit code 8: in use (EIO)");
    }

    #[test]
    fn environment_is_empty_but_path() {
        let out = run("env", "env", &[], "x", Duration::from_secs(10)).unwrap();
        let mut vars: Vec<&str> = out.stdout.lines().collect();
        vars.sort();
        assert_eq!(vars, ["LC_ALL=C".to_owned(), format!("PATH={PATH}")]);
    }

    #[test]
    fn kills_a_child_past_its_deadline() {
        let start = Instant::now();
        // The grandchild `sleep` holds the pipes too: the group kill ends it.
        let e = run(
            "sh",
            "sh",
            &["-c", "sleep 30 & sleep 30"],
            "x",
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn a_missing_program_is_not_found() {
        let e = run(
            "nope",
            "rbdkit-no-such-tool",
            &[],
            "x",
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
    }
}
