//! A real Ceph cluster for integration tests.
//!
//! `RBDKIT_TEST_CEPH_CONF` names the ceph.conf of a cluster started by
//! `scripts/ceph-test-cluster up` (the README's test command does this).
//! Without it, the first test in a process starts its own cluster with that
//! script and stops it when the process exits. Tests never skip: if no
//! cluster can be had, they fail with the script's error. `CEPH_CONF` is
//! deliberately ignored, so tests never touch a cluster you did not make for
//! them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use rbdkit::rados::{Cluster, ConnectOptions, IoCtx};
use rbdkit::rbd;

/// The pool that `scripts/ceph-test-cluster` creates and initialises.
pub const POOL: &str = "rbd";

/// A cluster the tests may use.
pub struct TestCluster {
    conf: PathBuf,
}

static CLUSTER: OnceLock<TestCluster> = OnceLock::new();
static STARTED_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

extern "C" fn stop_started_cluster() {
    let dir = STARTED_DIR.lock().ok().and_then(|mut d| d.take());
    if let Some(dir) = dir {
        let _ = Command::new(repo_root().join("scripts/ceph-test-cluster"))
            .arg("down")
            .arg(&dir)
            .status();
    }
}

impl TestCluster {
    /// The process-wide test cluster, started on first use if needed.
    pub fn get() -> &'static TestCluster {
        CLUSTER.get_or_init(|| {
            if let Some(conf) = std::env::var_os("RBDKIT_TEST_CEPH_CONF") {
                let conf = PathBuf::from(conf);
                assert!(
                    conf.is_file(),
                    "RBDKIT_TEST_CEPH_CONF={} is not a file",
                    conf.display()
                );
                return TestCluster { conf };
            }
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("ceph-{}", std::process::id()));
            let out = Command::new(repo_root().join("scripts/ceph-test-cluster"))
                .arg("up")
                .arg(&dir)
                .output()
                .expect("run scripts/ceph-test-cluster");
            assert!(
                out.status.success(),
                "scripts/ceph-test-cluster up {} failed; set RBDKIT_TEST_CEPH_CONF or fix:\n{}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            *STARTED_DIR.lock().unwrap() = Some(dir.clone());
            // SAFETY: registers a plain extern "C" fn with no captured state.
            unsafe { libc::atexit(stop_started_cluster) };
            TestCluster {
                conf: dir.join("ceph.conf"),
            }
        })
    }

    /// Path of the cluster's ceph.conf.
    pub fn conf(&self) -> &Path {
        &self.conf
    }

    /// The folder that holds the cluster's files.
    pub fn dir(&self) -> &Path {
        self.conf.parent().expect("conf has a parent")
    }

    /// A line of the ceph.conf, such as `mon host`.
    pub fn conf_value(&self, key: &str) -> Option<String> {
        let text = std::fs::read_to_string(&self.conf).ok()?;
        text.lines().find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim().replace('_', " ") == key).then(|| v.trim().to_owned())
        })
    }

    /// The admin key from the cluster's keyring.
    pub fn admin_key(&self) -> String {
        let keyring = self
            .conf_value("keyring")
            .map(PathBuf::from)
            .unwrap_or_else(|| self.dir().join("keyring"));
        let text = std::fs::read_to_string(&keyring).expect("read keyring");
        let mut in_admin = false;
        for line in text.lines() {
            let t = line.trim();
            if t.starts_with('[') {
                in_admin = t == "[client.admin]";
            } else if in_admin {
                if let Some((k, v)) = t.split_once('=') {
                    if k.trim() == "key" {
                        return v.trim().to_owned();
                    }
                }
            }
        }
        panic!("no client.admin key in {}", keyring.display());
    }

    /// Options for the admin user through the conf file.
    pub fn options(&self) -> ConnectOptions {
        ConnectOptions::new()
            .conf_file(&self.conf)
            .op_timeout(Duration::from_secs(60))
    }

    /// A new admin connection.
    pub fn connect(&self) -> Cluster {
        self.options()
            .connect()
            .expect("connect to the test cluster")
    }
}

static SHARED: Mutex<Option<Cluster>> = Mutex::new(None);

/// Shuts the shared connection down before the process exits. librados
/// threads still running while its C++ statics are destroyed can abort the
/// process (`boost::bad_get`), so the handle must not outlive `main`.
extern "C" fn shut_down_shared_connection() {
    let shared = SHARED.lock().ok().and_then(|mut c| c.take());
    drop(shared);
}

/// One admin connection shared by the tests of a process.
pub fn cluster() -> Cluster {
    let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if shared.is_none() {
        *shared = Some(TestCluster::get().connect());
        // SAFETY: registers a plain extern "C" fn with no captured state.
        // atexit runs handlers in reverse order, so this runs before the
        // cluster daemons are stopped and before librados' own statics go.
        unsafe { libc::atexit(shut_down_shared_connection) };
    }
    shared.as_ref().expect("set above").clone()
}

/// A unique name for this process and call.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// An RBD namespace of its own in the test pool, so tests run in parallel
/// without seeing each other's images. Everything in it is removed on drop.
pub struct TestNs {
    /// An ioctx on the test pool in this namespace.
    pub ioctx: IoCtx,
    /// The namespace name.
    pub name: String,
}

impl TestNs {
    /// Creates a fresh namespace named after `test`.
    pub fn new(test: &str) -> TestNs {
        let cluster = cluster();
        let pool = cluster.ioctx(POOL).expect("open test pool");
        let name = unique(test);
        rbd::namespace_create(&pool, &name).expect("create test namespace");
        TestNs {
            ioctx: pool.with_namespace(&name).expect("ioctx in namespace"),
            name,
        }
    }
}

impl Drop for TestNs {
    fn drop(&mut self) {
        remove_namespace(&self.ioctx, POOL, &self.name);
    }
}

/// Removes everything in namespace `name` of `pool` (`ioctx` is in it),
/// then the namespace. Best effort: children before parents, snapshots
/// before images, then the trash.
pub fn remove_namespace(ioctx: &IoCtx, pool: &str, name: &str) {
    for _ in 0..3 {
        let Ok(images) = rbd::list_names(ioctx) else {
            break;
        };
        for image in images {
            if let Ok(img) = rbd::Image::open(ioctx, &image) {
                if let Ok(snaps) = img.snap_list() {
                    for s in snaps {
                        let _ = img.snap_remove_force(&s.name);
                    }
                }
                drop(img);
            }
            let _ = rbd::remove(ioctx, &image);
        }
    }
    if let Ok(entries) = rbd::trash_list(ioctx) {
        for e in entries {
            let _ = rbd::trash_remove(ioctx, &e.id, true);
        }
    }
    if let Ok(p) = cluster().ioctx(pool) {
        let _ = rbd::namespace_remove(&p, name);
    }
}

/// The cephx user the e2e tests run the provisioner as: only
/// `profile rbd` on the test pool (see deploy/README.md).
pub const PROVISIONER_USER: &str = "rbdkit-test-provisioner";
/// The cephx user for the node side: the same profile on the test pool.
pub const NODE_USER: &str = "rbdkit-test-node";
/// A second RBD pool the restricted users may not use.
pub const OTHER_POOL: &str = "rbd-other";

/// The caps of [`PROVISIONER_USER`] (and [`NODE_USER`]), as `auth
/// get-or-create` takes them: service, cap, service, cap.
pub fn restricted_caps() -> Vec<String> {
    vec![
        "mon".into(),
        "profile rbd".into(),
        "osd".into(),
        format!("profile rbd pool={POOL}"),
    ]
}

/// A monitor command as the admin user; its JSON output.
pub fn mon_json(cmd: serde_json::Value) -> Result<Vec<u8>, rbdkit::Error> {
    cluster()
        .mon_command(&cmd.to_string(), &[])
        .map(|r| r.output)
}

/// Makes (or brings to `caps`) the cephx user `client.<id>` with the admin
/// connection, and returns its key. Idempotent; safe from several test
/// processes at once.
pub fn user_with_caps(id: &str, caps: &[String]) -> String {
    let entity = format!("client.{id}");
    let made = mon_json(serde_json::json!({
        "prefix": "auth get-or-create", "entity": entity, "caps": caps, "format": "json",
    }));
    if made.is_err() {
        // It exists with other caps: set them.
        mon_json(serde_json::json!({"prefix": "auth caps", "entity": entity, "caps": caps}))
            .unwrap_or_else(|e| panic!("auth caps {entity}: {e}"));
    }
    let out = mon_json(serde_json::json!({
        "prefix": "auth get-key", "entity": entity, "format": "json",
    }))
    .unwrap_or_else(|e| panic!("auth get-key {entity}: {e}"));
    let v: serde_json::Value = serde_json::from_slice(&out).expect("auth get-key output");
    v["key"].as_str().expect("a key").to_owned()
}

/// [`PROVISIONER_USER`]'s key.
pub fn provisioner_key() -> String {
    static KEY: OnceLock<String> = OnceLock::new();
    KEY.get_or_init(|| user_with_caps(PROVISIONER_USER, &restricted_caps()))
        .clone()
}

/// [`NODE_USER`]'s key.
pub fn node_key() -> String {
    static KEY: OnceLock<String> = OnceLock::new();
    KEY.get_or_init(|| user_with_caps(NODE_USER, &restricted_caps()))
        .clone()
}

/// A provisioner user that may also lift fences: `profile rbd` plus
/// `allow command "osd blocklist"` on the mon (deploy/README.md).
pub const FENCER_USER: &str = "rbdkit-test-fencer";

/// [`FENCER_USER`]'s key.
pub fn fencer_key() -> String {
    static KEY: OnceLock<String> = OnceLock::new();
    KEY.get_or_init(|| {
        let caps = [
            "mon".into(),
            "profile rbd, allow command \"osd blocklist\"".into(),
            "osd".into(),
            format!("profile rbd pool={POOL}"),
        ];
        user_with_caps(FENCER_USER, &caps)
    })
    .clone()
}

/// The environment that makes a process's Ceph clients come from `ip`, a
/// loopback address other than the cluster's (127.0.0.1): librados cannot
/// be told a client's source address, so the LD_PRELOAD library of
/// `tests/fixtures/bind-source` (built with cc on first use) binds each
/// IPv4 socket to `ip` before it connects. What fences a node by address
/// needs nodes that have addresses of their own.
pub fn from_address(ip: &str) -> Vec<(String, String)> {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    let lib = LIB.get_or_init(|| {
        let src =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bind-source/bind_source.c");
        let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("bind-source-{}.so", std::process::id()));
        let built = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&out)
            .arg(&src)
            .arg("-ldl")
            .output()
            .expect("run cc");
        assert!(
            built.status.success(),
            "cc {}: {}",
            src.display(),
            String::from_utf8_lossy(&built.stderr)
        );
        out
    });
    vec![
        ("LD_PRELOAD".into(), lib.display().to_string()),
        ("BIND_SOURCE_IP".into(), ip.into()),
    ]
}

/// Runs `rados ARGS` as the admin (bounded) from the source address `ip`
/// ([`from_address`]); whether it succeeded, and its stderr.
pub fn rados_from(ip: &str, args: &[&str]) -> (bool, String) {
    let conf = TestCluster::get().conf().display().to_string();
    let out = Command::new("timeout")
        .args(["60", "rados", "-c", &conf, "--rados_osd_op_timeout", "15"])
        .args(["--rados_mon_op_timeout", "15"])
        .args(args)
        .envs(from_address(ip))
        .env_remove("CEPH_CONF")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run rados");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Makes [`OTHER_POOL`] (an initialised RBD pool) if it is not there.
pub fn other_pool() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let c = cluster();
        match c.pool_create(OTHER_POOL) {
            Ok(()) => {}
            Err(e) if e.kind() == rbdkit::ErrorKind::AlreadyExists => {}
            Err(e) => panic!("create pool {OTHER_POOL}: {e}"),
        }
        let io = c.ioctx(OTHER_POOL).expect("open the other pool");
        io.application_enable("rbd", true)
            .expect("enable rbd on the other pool");
        rbd::pool_init(&io, true).expect("rbd pool init");
    });
}

/// A cluster of one test's own, under `CARGO_TARGET_TMPDIR`, for tests that
/// stop its daemons (the shared one must keep running for the others).
/// Stopped and removed on drop.
pub struct PrivateCluster {
    cluster: TestCluster,
    dir: PathBuf,
}

impl PrivateCluster {
    /// Starts a new cluster named after `test` (about 10 s).
    pub fn start(test: &str) -> PrivateCluster {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(unique(&format!("ceph-{test}")));
        let out = Command::new(repo_root().join("scripts/ceph-test-cluster"))
            .arg("up")
            .arg(&dir)
            .output()
            .expect("run scripts/ceph-test-cluster");
        let private = PrivateCluster {
            cluster: TestCluster {
                conf: dir.join("ceph.conf"),
            },
            dir,
        };
        assert!(
            out.status.success(),
            "scripts/ceph-test-cluster up {} failed:\n{}",
            private.dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        private
    }

    /// Stops one daemon (`mon.a`, `mgr.x`, `osd.0`) as a host failure would.
    pub fn stop_daemon(&self, name: &str) {
        self.daemon("stop-daemon", name);
    }

    /// Starts a stopped daemon again.
    pub fn start_daemon(&self, name: &str) {
        self.daemon("start-daemon", name);
    }

    /// Freezes one daemon (SIGSTOP) or lets it go on (SIGCONT): its port
    /// still accepts connections, and nothing answers on them meanwhile
    /// (a monitor that hangs, not one that is gone).
    pub fn pause_daemon(&self, name: &str, paused: bool) {
        let pid_file = self.dir.join(format!("run/ceph-{name}.pid"));
        let pid = std::fs::read_to_string(&pid_file)
            .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()));
        let sig = if paused { "-STOP" } else { "-CONT" };
        let ok = Command::new("kill")
            .args([sig, pid.trim()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {name} ({})", pid.trim());
    }

    fn daemon(&self, verb: &str, name: &str) {
        let out = Command::new(repo_root().join("scripts/ceph-test-cluster"))
            .args([verb, self.dir.to_str().expect("utf-8 dir"), name])
            .output()
            .expect("run scripts/ceph-test-cluster");
        assert!(
            out.status.success(),
            "ceph-test-cluster {verb} {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl std::ops::Deref for PrivateCluster {
    type Target = TestCluster;
    fn deref(&self) -> &TestCluster {
        &self.cluster
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let _ = Command::new(repo_root().join("scripts/ceph-test-cluster"))
            .arg("down")
            .arg(&self.dir)
            .status();
    }
}

/// The `osd blocklist ls` entries (addresses), as the admin sees them.
pub fn blocklist_addrs() -> Vec<String> {
    let out = mon_json(serde_json::json!({
        "prefix": "osd blocklist ls", "format": "json",
    }))
    .expect("osd blocklist ls");
    // The first JSON value (the monitor may append more after it).
    let v: serde_json::Value = serde_json::Deserializer::from_slice(&out)
        .into_iter()
        .next()
        .and_then(Result::ok)
        .unwrap_or_default();
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["addr"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Two clusters that mirror pool [`POOL`] both ways: image mode,
/// snapshot-based, peers bootstrapped, an `rbd-mirror` daemon in each
/// (`scripts/ceph-test-cluster mirror-pair`). Started once per test process
/// (about 30 s) and stopped at exit, or given by `RBDKIT_TEST_MIRROR_PAIR`
/// (`DIR_A:DIR_B`, already paired).
pub struct MirrorPair {
    /// Site A.
    pub a: TestCluster,
    /// Site B.
    pub b: TestCluster,
}

static PAIR: OnceLock<MirrorPair> = OnceLock::new();
static STARTED_PAIR: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

extern "C" fn stop_started_pair() {
    let dirs = std::mem::take(&mut *STARTED_PAIR.lock().unwrap_or_else(|e| e.into_inner()));
    for dir in dirs {
        let _ = Command::new(repo_root().join("scripts/ceph-test-cluster"))
            .arg("down")
            .arg(&dir)
            .status();
    }
}

fn script(args: &[&str]) -> std::process::Output {
    Command::new(repo_root().join("scripts/ceph-test-cluster"))
        .args(args)
        .output()
        .expect("run scripts/ceph-test-cluster")
}

impl MirrorPair {
    /// The process-wide pair.
    pub fn shared() -> &'static MirrorPair {
        PAIR.get_or_init(|| {
            if let Ok(v) = std::env::var("RBDKIT_TEST_MIRROR_PAIR") {
                let (a, b) = v
                    .split_once(':')
                    .expect("RBDKIT_TEST_MIRROR_PAIR is DIR_A:DIR_B");
                return MirrorPair {
                    a: TestCluster {
                        conf: PathBuf::from(a).join("ceph.conf"),
                    },
                    b: TestCluster {
                        conf: PathBuf::from(b).join("ceph.conf"),
                    },
                };
            }
            let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
            let dirs = [
                base.join(format!("mirror-a-{}", std::process::id())),
                base.join(format!("mirror-b-{}", std::process::id())),
            ];
            // SAFETY: registers a plain extern "C" fn with no captured state.
            unsafe { libc::atexit(stop_started_pair) };
            let ups: Vec<_> = dirs
                .iter()
                .map(|d| {
                    STARTED_PAIR.lock().unwrap().push(d.clone());
                    let d = d.to_str().expect("utf-8 dir").to_owned();
                    std::thread::spawn(move || script(&["up", &d]))
                })
                .collect();
            for (up, d) in ups.into_iter().zip(&dirs) {
                let out = up.join().expect("up thread");
                assert!(
                    out.status.success(),
                    "scripts/ceph-test-cluster up {} failed:\n{}",
                    d.display(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let (a, b) = (dirs[0].to_str().unwrap(), dirs[1].to_str().unwrap());
            let out = script(&["mirror-pair", a, b]);
            assert!(
                out.status.success(),
                "scripts/ceph-test-cluster mirror-pair {a} {b} failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            MirrorPair {
                a: TestCluster {
                    conf: dirs[0].join("ceph.conf"),
                },
                b: TestCluster {
                    conf: dirs[1].join("ceph.conf"),
                },
            }
        })
    }

    /// A site's name (its directory's base name).
    pub fn site(c: &TestCluster) -> String {
        c.dir()
            .file_name()
            .and_then(|n| n.to_str())
            .expect("cluster dir name")
            .to_owned()
    }

    /// Stops every daemon of site `c` (rbd-mirror first), as a site loss
    /// would; [`MirrorPair::start_site`] brings it back with its data.
    pub fn stop_site(c: &TestCluster) {
        for d in ["rbd-mirror", "osd.0", "mgr.x", "mon.a"] {
            daemon(c, "stop-daemon", d);
        }
    }

    /// Starts the daemons of a stopped site again.
    pub fn start_site(c: &TestCluster) {
        for d in ["mon.a", "mgr.x", "osd.0", "rbd-mirror"] {
            daemon(c, "start-daemon", d);
        }
    }
}

fn daemon(c: &TestCluster, verb: &str, name: &str) {
    let out = script(&[verb, c.dir().to_str().expect("utf-8 dir"), name]);
    assert!(
        out.status.success(),
        "ceph-test-cluster {verb} {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
