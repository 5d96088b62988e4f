//! Every error kind, provoked for real against the cluster.

use crate::support;

use std::time::{Duration, Instant};

use rbdkit::rados::{ConnectOptions, Secret};
use rbdkit::rbd::{self, Image, ImageOptions};
use rbdkit::ErrorKind;
use support::ceph::{cluster, unique, TestCluster, TestNs, POOL};

const MIB: u64 = 1 << 20;

#[test]
fn missing_image_is_not_found_and_names_it() {
    let ns = TestNs::new("enoent");
    let e = Image::open(&ns.ioctx, "ghost").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert_eq!(e.errno(), libc::ENOENT);
    assert_eq!(e.op(), "rbd_open");
    assert_eq!(e.object(), format!("{POOL}/{}/ghost", ns.name));
    assert_eq!(
        e.to_string(),
        format!(
            "rbd_open on {POOL}/{}/ghost failed: not found (ENOENT)",
            ns.name
        )
    );
    assert_eq!(
        rbd::remove(&ns.ioctx, "ghost").unwrap_err().kind(),
        ErrorKind::NotFound
    );
    assert_eq!(
        cluster().ioctx("no-such-pool").unwrap_err().kind(),
        ErrorKind::NotFound
    );
}

#[test]
fn duplicate_create_is_already_exists_and_keeps_the_first() {
    let ns = TestNs::new("eexist");
    rbd::create(&ns.ioctx, "dup", 2 * MIB, &ImageOptions::new()).unwrap();
    let e = rbd::create(&ns.ioctx, "dup", 4 * MIB, &ImageOptions::new()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    assert!(e.to_string().contains("already exists"), "{e}");
    assert_eq!(
        Image::open(&ns.ioctx, "dup").unwrap().size().unwrap(),
        2 * MIB
    );
}

#[test]
fn removing_an_image_open_elsewhere_is_busy() {
    let ns = TestNs::new("ebusy");
    rbd::create(&ns.ioctx, "held", MIB, &ImageOptions::new()).unwrap();
    // Another connection, as another client would be.
    let other = TestCluster::get().connect();
    let other_io = other.ioctx_ns(POOL, &ns.name).unwrap();
    let holder = Image::open(&other_io, "held").unwrap();
    let e = rbd::remove(&ns.ioctx, "held").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    assert!(e.to_string().contains("watchers"), "{e}");
    assert_eq!(
        rbd::list_names(&ns.ioctx).unwrap(),
        vec!["held"],
        "nothing removed"
    );
    holder.close().unwrap();
    rbd::remove(&ns.ioctx, "held").unwrap();
}

#[test]
fn removing_an_image_with_snapshots_is_has_snapshots() {
    let ns = TestNs::new("enotempty");
    rbd::create(&ns.ioctx, "snappy", MIB, &ImageOptions::new()).unwrap();
    Image::open(&ns.ioctx, "snappy")
        .unwrap()
        .snap_create("s")
        .unwrap();
    let e = rbd::remove(&ns.ioctx, "snappy").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HasSnapshots, "{e}");
    assert!(e.to_string().contains("snapshots"), "{e}");
    assert!(
        Image::open(&ns.ioctx, "snappy").is_ok(),
        "image is untouched"
    );
}

#[test]
fn shrinking_without_permission_is_refused() {
    let ns = TestNs::new("shrink");
    rbd::create(&ns.ioctx, "big", 8 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "big").unwrap();
    img.write(7 * MIB, b"tail data").unwrap();
    let e = img.resize(MIB).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ShrinkRefused, "{e}");
    assert!(e.to_string().contains("smaller"), "{e}");
    let mut buf = [0u8; 9];
    img.read_exact(7 * MIB, &mut buf).unwrap();
    assert_eq!(&buf, b"tail data", "data kept");
}

#[test]
fn writing_as_a_read_only_user_is_permission_denied() {
    let ns = TestNs::new("eperm");
    rbd::create(&ns.ioctx, "guarded", MIB, &ImageOptions::new()).unwrap();
    let admin = cluster();
    let user = unique("ro");
    let cmd = format!(
        r#"{{"prefix": "auth get-or-create", "entity": "client.{user}", "caps": ["mon", "profile rbd", "osd", "profile rbd-read-only"], "format": "json"}}"#
    );
    let reply = admin.mon_command(&cmd, &[]).unwrap();
    let parsed: serde_json::Value = serde_json::from_slice(&reply.output).unwrap();
    let key = parsed[0]["key"]
        .as_str()
        .expect("key in auth reply")
        .to_owned();

    let t = TestCluster::get();
    let ro = ConnectOptions::new()
        .mon_host(t.conf_value("mon host").unwrap())
        .user(&user)
        .key(Secret::new(key.clone()))
        .op_timeout(Duration::from_secs(20))
        .connect()
        .unwrap();
    let io = ro.ioctx_ns(POOL, &ns.name).unwrap();
    // Reading is allowed...
    let img = Image::open_read_only(&io, "guarded").unwrap();
    assert_eq!(img.size().unwrap(), MIB);
    // ...creating and writing are not.
    let e = rbd::create(&io, "nope", MIB, &ImageOptions::new()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(!e.to_string().contains(&key), "no key in errors");
    let e = io.write_full("obj", b"x").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    match Image::open(&io, "guarded") {
        Err(e) => assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}"),
        Ok(rw) => {
            let e = rw.write(0, b"x").unwrap_err();
            assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
        }
    }
    admin
        .mon_command(
            &format!(r#"{{"prefix": "auth rm", "entity": "client.{user}"}}"#),
            &[],
        )
        .unwrap();
}

#[test]
fn an_unreachable_monitor_times_out_within_the_bound() {
    // A port nothing listens on: bind, read the port, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bound = Duration::from_secs(3);
    let start = Instant::now();
    let e = ConnectOptions::new()
        .mon_host(format!("127.0.0.1:{port}"))
        .user("admin")
        .key(Secret::new("AQDKFw1reQzGIxAA73ILXypZ9gY9PItzO4lCEA=="))
        .connect_timeout(bound)
        .op_timeout(bound)
        .connect()
        .unwrap_err();
    let took = start.elapsed();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(
        took >= bound - Duration::from_millis(500),
        "gave up early: {took:?}"
    );
    assert!(
        took < bound + Duration::from_secs(10),
        "not bounded: {took:?} (Ceph's default is 300 s)"
    );
    assert!(!e.to_string().contains("AQDKFw1r"), "no key in errors: {e}");
}

#[test]
fn invalid_input_is_refused_before_any_call() {
    let ns = TestNs::new("einval");
    let e = Image::open(&ns.ioctx, "nul\0byte").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("NUL"), "{e}");
    let e = "layering,warp-drive"
        .parse::<rbdkit::rbd::Features>()
        .unwrap_err();
    assert!(e.to_string().contains("warp-drive"), "{e}");
}
