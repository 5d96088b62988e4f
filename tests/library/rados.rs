//! librados against a real cluster: connecting, pools, mon commands,
//! objects and omap.

use crate::support;

use std::time::Duration;

use rbdkit::rados::{ConnectOptions, Secret, DEFAULT_CONNECT_TIMEOUT, DEFAULT_OP_TIMEOUT};
use rbdkit::ErrorKind;
use support::ceph::{cluster, unique, TestCluster, POOL};

#[test]
fn connects_from_conf_and_reports_fsid() {
    let c = TestCluster::get().connect();
    let fsid = c.fsid().unwrap();
    assert_eq!(fsid.len(), 36, "fsid {fsid:?}");
    assert_eq!(Some(fsid), TestCluster::get().conf_value("fsid"));
    assert!(c.instance_id() > 0);
}

#[test]
fn connects_without_a_file_from_monitors_user_and_key() {
    let t = TestCluster::get();
    let mons = t.conf_value("mon host").expect("mon host in ceph.conf");
    let c = ConnectOptions::new()
        .mon_host(mons)
        .user("client.admin")
        .key(Secret::new(t.admin_key()))
        .connect_timeout(Duration::from_secs(20))
        .connect()
        .expect("connect with mon_host + key and no ceph.conf");
    assert!(c.pool_list().unwrap().contains(&POOL.to_owned()));
}

#[test]
fn timeouts_default_to_bounded_values_and_can_be_set() {
    let c = TestCluster::get()
        .options()
        .osd_op_timeout(Duration::from_secs(7))
        .connect()
        .unwrap();
    assert_eq!(c.config_get("rados_osd_op_timeout").unwrap(), "7");
    let d = ConnectOptions::new()
        .conf_file(TestCluster::get().conf())
        .connect()
        .unwrap();
    for opt in [
        "client_mount_timeout",
        "rados_mon_op_timeout",
        "rados_osd_op_timeout",
    ] {
        let v: f64 = d.config_get(opt).unwrap().parse().unwrap();
        assert!(v > 0.0 && v <= 60.0, "{opt} = {v}: must be bounded");
    }
}

/// The test cluster's ceph.conf without its three timeout lines, with
/// `mon host` replaced when `mon_host` is given.
fn conf_without_timeouts(dir: &std::path::Path, mon_host: Option<&str>) -> std::path::PathBuf {
    let text = std::fs::read_to_string(TestCluster::get().conf()).unwrap();
    let mut out = String::new();
    for line in text.lines() {
        let key = line.split('=').next().unwrap().trim().replace('_', " ");
        if key.ends_with("timeout") {
            continue;
        }
        match (key.as_str(), mon_host) {
            ("mon host", Some(m)) => out.push_str(&format!("mon host = {m}\n")),
            _ => out.push_str(&format!("{line}\n")),
        }
    }
    assert!(!out.contains("mount timeout"), "{out}");
    let path = dir.join("ceph.conf");
    std::fs::write(&path, out).unwrap();
    path
}

#[test]
fn default_timeouts_apply_when_the_conf_sets_none() {
    let dir = tempfile::tempdir().unwrap();
    let conf = conf_without_timeouts(dir.path(), None);
    let c = ConnectOptions::new().conf_file(&conf).connect().unwrap();
    for (opt, want) in [
        ("client_mount_timeout", DEFAULT_CONNECT_TIMEOUT),
        ("rados_mon_op_timeout", DEFAULT_OP_TIMEOUT),
        ("rados_osd_op_timeout", DEFAULT_OP_TIMEOUT),
    ] {
        let v: f64 = c.config_get(opt).unwrap().parse().unwrap();
        assert_eq!(v, want.as_secs_f64(), "{opt}");
    }
    // A value the file does set is kept.
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text = text.replace("[global]\n", "[global]\nclient mount timeout = 12\n");
    std::fs::write(&conf, text).unwrap();
    let c = ConnectOptions::new().conf_file(&conf).connect().unwrap();
    assert_eq!(c.config_get("client_mount_timeout").unwrap(), "12");
}

#[test]
fn connect_to_a_dead_monitor_gives_up_after_the_default_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let conf = conf_without_timeouts(dir.path(), Some(&format!("v1:127.0.0.1:{port}")));
    let (tx, rx) = std::sync::mpsc::channel();
    let started = std::time::Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(ConnectOptions::new().conf_file(&conf).connect().map(|_| ()));
    });
    // Ceph's own client_mount_timeout is 300 s; ours is 30 s.
    let res = rx
        .recv_timeout(DEFAULT_CONNECT_TIMEOUT + Duration::from_secs(30))
        .expect("connect is bounded by DEFAULT_CONNECT_TIMEOUT");
    let e = res.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(
        e.to_string().contains(&format!(":{port}")),
        "names the monitors: {e}"
    );
    assert!(
        started.elapsed() >= DEFAULT_CONNECT_TIMEOUT - Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_malformed_key_is_refused_before_librados_can_log_it() {
    let t = TestCluster::get();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("client.log");
    let bad = "AQD-not-a-valid-key-1234567";
    let e = ConnectOptions::new()
        .mon_host(t.conf_value("mon host").unwrap())
        .user("admin")
        .key(Secret::new(bad))
        .set("log_file", log.display().to_string())
        .set("log_to_stderr", "false")
        .set("err_to_stderr", "false")
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(!e.to_string().contains(bad), "{e}");
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!logged.contains(bad), "librados logged the key:\n{logged}");
    // A key set as a plain option is checked the same way.
    let e = ConnectOptions::new()
        .mon_host(t.conf_value("mon host").unwrap())
        .set("key", bad)
        .connect()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

#[test]
fn the_key_is_never_read_back() {
    let t = TestCluster::get();
    let c = ConnectOptions::new()
        .mon_host(t.conf_value("mon host").unwrap())
        .key(Secret::new(t.admin_key()))
        .connect()
        .unwrap();
    let e = c.config_get("key").unwrap_err();
    assert!(!e.to_string().contains(&t.admin_key()), "{e}");
    assert!(!c.config_get("mon_host").unwrap().is_empty());
}

#[test]
fn errors_of_cluster_wide_calls_name_the_cluster() {
    // A cluster of this test's own, stopped while a connection is open.
    let dir = tempfile::tempdir().unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ceph-test-cluster");
    let up = std::process::Command::new(script)
        .arg("up")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        up.status.success(),
        "{}",
        String::from_utf8_lossy(&up.stderr)
    );
    let conf = dir.path().join("ceph.conf");
    let c = ConnectOptions::new()
        .conf_file(&conf)
        .op_timeout(Duration::from_secs(3))
        .connect()
        .unwrap();
    let mons = c.config_get("mon_host").unwrap();
    let down = std::process::Command::new(script)
        .arg("down")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    let e = c.stats().unwrap_err();
    assert_eq!(e.op(), "rados_cluster_stat");
    assert!(e.object().contains(&mons), "{e}");
    assert!(e.object().contains(&conf.display().to_string()), "{e}");
    drop(c);
}

#[test]
fn pool_create_stats_and_delete() {
    let c = cluster();
    let name = unique("pool");
    c.pool_create(&name).unwrap();
    assert!(c.pool_list().unwrap().contains(&name));
    let dup = c.pool_create(&name).unwrap_err();
    assert_eq!(dup.kind(), ErrorKind::AlreadyExists, "{dup}");
    let id = c.pool_lookup(&name).unwrap();
    assert_eq!(c.pool_name(id).unwrap(), name);
    let io = c.ioctx(&name).unwrap();
    assert_eq!(io.pool_id(), id);
    io.write_full("obj", &[7u8; 4096]).unwrap();
    let stats = io.pool_stats().unwrap();
    assert!(stats.num_objects <= 1, "{stats:?}");
    drop(io);
    c.pool_delete(&name).unwrap();
    assert!(!c.pool_list().unwrap().contains(&name));
    let gone = c.pool_lookup(&name).unwrap_err();
    assert_eq!(gone.kind(), ErrorKind::NotFound);
    assert!(c.stats().unwrap().kb > 0);
}

#[test]
fn mon_command_returns_json_and_names_failures() {
    let c = cluster();
    let reply = c
        .mon_command(r#"{"prefix": "osd pool ls", "format": "json"}"#, &[])
        .unwrap();
    let pools: Vec<String> = serde_json::from_slice(&reply.output).unwrap();
    assert!(pools.contains(&POOL.to_owned()), "{pools:?}");
    let err = c
        .mon_command(
            r#"{"prefix": "osd pool get", "pool": "no-such-pool-x", "var": "size"}"#,
            &[],
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(err.to_string().contains("osd pool get"), "{err}");
}

#[test]
fn objects_write_read_stat_remove() {
    let io = cluster().ioctx_ns(POOL, &unique("objns")).unwrap();
    io.write_full("o1", b"hello world").unwrap();
    io.write("o1", b"W", 6).unwrap();
    assert_eq!(io.read_full("o1").unwrap(), b"hello World");
    assert_eq!(io.read("o1", 5, 0).unwrap(), b"hello");
    assert_eq!(io.stat("o1").unwrap().size, 11);
    io.remove("o1").unwrap();
    let e = io.stat("o1").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(
        e.to_string()
            .contains(&format!("{}/{}/o1", POOL, io.namespace())),
        "{e}"
    );
}

#[test]
fn omap_set_get_list_remove() {
    let io = cluster().ioctx_ns(POOL, &unique("omapns")).unwrap();
    let pairs: Vec<(String, Vec<u8>)> = (0..1200)
        .map(|i| (format!("k/{i:05}"), vec![b'v'; i % 7]))
        .collect();
    io.omap_set("book", &pairs).unwrap();
    io.omap_set("book", &[("other", b"x".as_slice())]).unwrap();
    let all = io.omap_list("book", "").unwrap();
    assert_eq!(all.len(), 1201, "paged listing returns every key");
    let ks = io.omap_list("book", "k/").unwrap();
    assert_eq!(ks.len(), 1200);
    assert_eq!(ks["k/00013"], vec![b'v'; 6]);
    let got = io.omap_get("book", &["other", "missing"]).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got["other"], b"x");
    io.omap_remove("book", &["other", "k/00000"]).unwrap();
    assert_eq!(io.omap_list("book", "").unwrap().len(), 1199);
    io.omap_clear("book").unwrap();
    assert!(io.omap_list("book", "").unwrap().is_empty());
    let e = io.omap_list("nothing-here", "").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
}

/// Omap keys that are not UTF-8: `\x80` ones (their lossy form sorts after
/// them) and `\xff` ones (it sorts before them).
fn raw_keys(prefix: u8, n80: usize, nff: usize) -> Vec<Vec<u8>> {
    let mut keys = Vec::new();
    for i in 0..n80 {
        keys.push([&[prefix, 0x80][..], format!("{i:05}").as_bytes()].concat());
    }
    for i in 0..nff {
        keys.push([&[prefix, 0xff][..], format!("{i:05}").as_bytes()].concat());
    }
    keys
}

#[test]
fn omap_lists_non_utf8_keys_exactly_once_across_pages() {
    let io = cluster().ioctx_ns(POOL, &unique("rawomap")).unwrap();
    let keys = raw_keys(b'k', 600, 10);
    let pairs: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (k.as_slice(), &k[2..])).collect();
    io.omap_set_bytes("raw", &pairs).unwrap();
    io.omap_set("raw", &[("plain", b"p".as_slice())]).unwrap();
    let all = io.omap_list_bytes("raw", b"").unwrap();
    assert_eq!(all.len(), keys.len() + 1);
    for k in &keys {
        assert_eq!(all[k], k[2..], "{k:?}");
    }
    let only = io.omap_list_bytes("raw", b"k\x80").unwrap();
    assert_eq!(only.len(), 600);
    // The text listing ends too, with the lossy forms of the same keys.
    let lossy: std::collections::BTreeSet<String> = keys
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    assert_eq!(io.omap_list("raw", "").unwrap().len(), lossy.len() + 1);
}

#[test]
fn object_listing_and_xattrs() {
    let io = cluster().ioctx_ns(POOL, &unique("listns")).unwrap();
    for i in 0..5 {
        io.write_full(&format!("obj-{i}"), b"x").unwrap();
    }
    let mut names = io.list_objects().unwrap();
    names.sort();
    assert_eq!(
        names,
        (0..5).map(|i| format!("obj-{i}")).collect::<Vec<_>>(),
        "only this namespace"
    );
    io.xattr_set("obj-0", "user.tag", b"blue").unwrap();
    assert_eq!(io.xattr_get("obj-0", "user.tag").unwrap(), b"blue");
    let big = vec![b'z'; 5000];
    io.xattr_set("obj-0", "user.big", &big).unwrap();
    assert_eq!(
        io.xattr_get("obj-0", "user.big").unwrap(),
        big,
        "grows past its first buffer"
    );
    io.xattr_remove("obj-0", "user.tag").unwrap();
    let e = io.xattr_get("obj-0", "user.tag").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Other(libc::ENODATA), "{e}");
}

/// The `VmFlags` of the mapping holding `addr`, from `/proc/self/smaps`.
fn vm_flags_at(addr: usize) -> Vec<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&addr);
                continue;
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.split_whitespace().map(str::to_owned).collect();
            }
        }
    }
    panic!("no mapping holds {addr:#x}");
}

#[test]
fn a_secret_lives_in_memory_core_dumps_leave_out() {
    let key = "AQBzmwlnAAAAABAAcHyFYS4mxn8Z2x0Tk3nIrA==";
    for s in [
        Secret::new(key),
        Secret::from(key.to_owned()),
        Secret::new(key).clone(),
    ] {
        assert_eq!(s.expose(), key);
        let at = s.expose().as_ptr() as usize;
        let flags = vm_flags_at(at);
        // "dd": MADV_DONTDUMP (proc(5)).
        assert!(
            flags.iter().any(|f| f == "dd"),
            "flags at {at:#x}: {flags:?}"
        );
        assert!(!format!("{s:?}").contains(key));
    }
}

#[test]
fn object_locks_exclusive_shared_unlock_break() {
    use rbdkit::rados::ObjectLockers;
    let c = cluster();
    let io = c.ioctx(POOL).unwrap();
    let oid = unique("lockobj");
    io.write_full(&oid, b"x").unwrap();
    let other = TestCluster::get().connect();
    let io2 = other.ioctx(POOL).unwrap();

    assert_eq!(io.lockers(&oid, "l").unwrap(), ObjectLockers::default());
    io.lock_exclusive(&oid, "l", "cookie-a", "mine").unwrap();
    // The same (client, cookie) again: EEXIST; another client: EBUSY.
    let e = io
        .lock_exclusive(&oid, "l", "cookie-a", "mine")
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    let e = io2
        .lock_exclusive(&oid, "l", "cookie-a", "theirs")
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    let e = io2.lock_shared(&oid, "l", "cookie-b", "t", "").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    // Another lock name on the same object is independent.
    io2.lock_exclusive(&oid, "other", "cookie-b", "").unwrap();
    let l = io2.lockers(&oid, "l").unwrap();
    assert!(l.exclusive);
    assert_eq!(l.lockers.len(), 1);
    assert_eq!(l.lockers[0].cookie, "cookie-a");
    assert_eq!(l.lockers[0].client, format!("client.{}", c.instance_id()));
    assert!(l.lockers[0].addr.contains('/'), "{:?}", l.lockers[0]);
    // Only its holder unlocks it; anyone may break it.
    let e = io2.unlock(&oid, "l", "cookie-a").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    io2.break_lock(&oid, "l", &l.lockers[0].client, "cookie-a")
        .unwrap();
    assert!(io.lockers(&oid, "l").unwrap().lockers.is_empty());
    let e = io.unlock(&oid, "l", "cookie-a").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");

    // Shared: every holder with the same tag; exclusive then waits.
    io.lock_shared(&oid, "s", "n1", "tag", "").unwrap();
    io2.lock_shared(&oid, "s", "n2", "tag", "").unwrap();
    let e = io2
        .lock_shared(&oid, "s", "n3", "other-tag", "")
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    let e = io2.lock_exclusive(&oid, "s", "n3", "").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    let s = io.lockers(&oid, "s").unwrap();
    assert!(!s.exclusive);
    assert_eq!(s.tag, "tag");
    let mut cookies: Vec<_> = s.lockers.iter().map(|l| l.cookie.as_str()).collect();
    cookies.sort();
    assert_eq!(cookies, ["n1", "n2"]);
    io.unlock(&oid, "s", "n1").unwrap();
    io2.unlock(&oid, "s", "n2").unwrap();
    io2.lock_exclusive(&oid, "s", "n3", "").unwrap();
    let e = io.break_lock(&oid, "s", "not a client", "n3").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    io.remove(&oid).unwrap();
}

/// A manager command the manager answers only after the caller stopped
/// waiting. Pacific's `rados_mgr_command` would let that late answer write
/// into its freed stack frame and crash the process; rbdkit's waits on a
/// thread and connection of its own, so the answer lands where it belongs.
#[test]
fn a_manager_answer_after_the_timeout_lands_safely() {
    let private = support::ceph::PrivateCluster::start("mgrlate");
    let c = private
        .options()
        .op_timeout(Duration::from_secs(3))
        .connect()
        .unwrap();
    let stat = r#"{"prefix": "pg stat", "format": "json"}"#;
    let reply = c
        .mgr_command(stat, &[])
        .expect("pg stat with the manager up");
    assert!(!reply.output.is_empty(), "{reply:?}");

    for round in 0..3 {
        // Frozen, not stopped: the connection stays up, and the answer
        // comes once the manager goes on.
        private.pause_daemon("mgr.x", true);
        let t = std::time::Instant::now();
        let e = c.mgr_command(stat, &[]).unwrap_err();
        let waited = t.elapsed();
        assert_eq!(e.kind(), ErrorKind::TimedOut, "round {round}: {e}");
        assert!(
            waited >= Duration::from_secs(3) && waited < Duration::from_secs(15),
            "round {round}: waited {waited:?}"
        );
        assert!(e.to_string().contains("mgr command 'pg stat'"), "{e}");
        // The first still waits: a second is refused at once, not queued.
        let t = std::time::Instant::now();
        let e = c.mgr_command(stat, &[]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Busy, "round {round}: {e}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        private.pause_daemon("mgr.x", false);

        // The late answer is taken; then commands are served again.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            match c.mgr_command(stat, &[]) {
                Ok(r) => {
                    assert!(!r.output.is_empty());
                    break;
                }
                Err(e) if std::time::Instant::now() < deadline => {
                    assert!(
                        matches!(e.kind(), ErrorKind::Busy | ErrorKind::TimedOut),
                        "round {round}: {e}"
                    );
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("round {round}: the manager never answered again: {e}"),
            }
        }
    }
}
