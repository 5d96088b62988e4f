//! A host process a test starts (an rbdkit daemon, the registrar), with its
//! output in a log file; killed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A host process with its log file, killed on drop.
pub struct Proc {
    child: Option<Child>,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// What it is, for messages.
    pub what: String,
    /// stdout and stderr.
    pub log: PathBuf,
}

impl Proc {
    /// Starts `program args` with its output appended to `log`, in the
    /// folder of `log`.
    pub fn spawn(what: &str, program: &Path, args: Vec<String>, log: PathBuf) -> Proc {
        let mut p = Proc {
            child: None,
            program: program.to_owned(),
            args,
            env: Vec::new(),
            what: what.to_owned(),
            log,
        };
        p.start();
        p
    }

    /// Starts `rbdkit args` (the binary under test).
    #[cfg(feature = "service")]
    pub fn rbdkit(what: &str, args: Vec<String>, log: PathBuf) -> Proc {
        Proc::rbdkit_with_env(what, args, log, Vec::new())
    }

    /// [`Proc::rbdkit`] with `env` added to its environment (and to that
    /// of every restart).
    #[cfg(feature = "service")]
    pub fn rbdkit_with_env(
        what: &str,
        args: Vec<String>,
        log: PathBuf,
        env: Vec<(String, String)>,
    ) -> Proc {
        let mut p = Proc {
            child: None,
            program: Path::new(env!("CARGO_BIN_EXE_rbdkit")).to_owned(),
            args,
            env,
            what: what.to_owned(),
            log,
        };
        p.start();
        p
    }

    fn start(&mut self) {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open log");
        let mut cmd = Command::new(&self.program);
        // In its own folder: a core file (or any file it makes relative to
        // its working directory) lands there, not in the source tree.
        if let Some(dir) = self.log.parent().filter(|d| d.is_dir()) {
            cmd.current_dir(dir);
        }
        let child = cmd
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env_remove("CEPH_CONF")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup log"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.what));
        self.child = Some(child);
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.try_pid().expect("running")
    }

    /// The process id, unless it was killed or stopped.
    pub fn try_pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL, as a crash or an OOM kill would, and reap it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then (after at most 10 s) SIGKILL, and reap it.
    pub fn terminate(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// kill -9, then the same command again.
    pub fn restart(&mut self) {
        self.kill9();
        self.start();
    }

    /// The whole log.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        tail(&self.log, n)
    }
}

/// Registers `dir` with the test run this process belongs to
/// (`RBDKIT_TEST_RUN_DIR`, set by `scripts/test`): if the run is killed
/// before its clean-up, `scripts/test-reap` unmounts what is under `dir`,
/// detaches its loop devices, takes down a node, control plane or cluster
/// in it, and removes it. Outside a run it does nothing.
pub fn register_dir(dir: &Path) {
    use std::io::Write;
    let Some(run) = std::env::var_os("RBDKIT_TEST_RUN_DIR") else {
        return;
    };
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    // One short O_APPEND write per line: concurrent writers do not mix.
    let line = format!("{}\n", dir.display());
    let appended = std::fs::OpenOptions::new()
        .append(true)
        .open(Path::new(&run).join("dirs"))
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = appended {
        eprintln!("cannot register {} with the test run: {e}", dir.display());
    }
}

/// The iptables comment that tags a rule as this test run's, so that
/// `scripts/test-reap` deletes it if the run is killed: `rbdkit-test:<run
/// id>`, or `rbdkit-test:pid-<pid>` outside `scripts/test` (deleted once that
/// process is gone).
pub fn rule_comment() -> String {
    match std::env::var("RBDKIT_TEST_RUN") {
        Ok(id) if !id.is_empty() => format!("rbdkit-test:{id}"),
        _ => format!("rbdkit-test:pid-{}", std::process::id()),
    }
}

/// The last `n` lines of the file at `path`.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- log of {} ({}) ---\n{}",
                self.what,
                self.log.display(),
                self.log_tail(60)
            );
        }
        self.kill9();
        // For the run's key grep.
        let group = self
            .log
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| format!("proc-{}", n.to_string_lossy()))
            .unwrap_or_else(|| "proc".into());
        super::artifacts::copy(&group, &self.log);
    }
}

/// Runs `SCRIPT down DIR` (a fixture's test-server script: Vault, the
/// control plane, the test node), reporting, never panicking on, a
/// failure: it runs from `Drop` and at process exit.
pub fn script_down(script: &Path, dir: &Path) {
    let name = script.file_name().unwrap_or_default().to_string_lossy();
    match Command::new(script)
        .arg("down")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
    {
        Ok(out) if out.status.success() => {}
        Ok(out) => eprintln!(
            "{name} down {} failed ({}):\n{}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => eprintln!("cannot run {}: {e}", script.display()),
    }
}
