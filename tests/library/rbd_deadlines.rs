//! Long-running librbd calls (remove, trash remove, flatten) stopped by a
//! deadline through their progress callbacks, against a real cluster.

use crate::support;

use std::time::{Duration, Instant};

use rbdkit::rbd::{self, Features, Image, ImageOptions};
use rbdkit::ErrorKind;
use support::ceph::TestNs;

const GIB: u64 = 1 << 30;

/// Without an object map librbd visits every object of the image, so a
/// large sparse image takes long to remove or flatten.
fn slow_opts() -> ImageOptions {
    ImageOptions::new().features(Features::LAYERING)
}

/// Asserts a deadline error came soon after the deadline (the whole
/// operation takes seconds here).
fn assert_stopped(r: rbdkit::Result<()>, started: Instant, what: &str) {
    let e = r.expect_err(what);
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{what}: {e}");
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{what} stopped only after {:?}",
        started.elapsed()
    );
}

#[test]
fn remove_stops_at_its_deadline_and_a_retry_finishes() {
    let ns = TestNs::new("dl-remove");
    rbd::create(&ns.ioctx, "big", 64 * GIB, &slow_opts()).unwrap();
    let t = Instant::now();
    let r = rbd::remove_with_deadline(&ns.ioctx, "big", t + Duration::from_millis(200));
    assert_stopped(r, t, "remove");
    assert_eq!(
        rbd::list_names(&ns.ioctx).unwrap(),
        vec!["big"],
        "not removed yet"
    );
    let t = Instant::now();
    rbd::remove_with_deadline(&ns.ioctx, "big", t + Duration::from_secs(600)).unwrap();
    eprintln!("full remove took {:?}", t.elapsed());
    assert!(rbd::list_names(&ns.ioctx).unwrap().is_empty());
    // Other failures keep their kind, even past the deadline.
    let e = rbd::remove_with_deadline(&ns.ioctx, "big", Instant::now()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
}

#[test]
fn trash_remove_stops_at_its_deadline_and_keeps_the_entry() {
    let ns = TestNs::new("dl-trash");
    rbd::create(&ns.ioctx, "big", 64 * GIB, &slow_opts()).unwrap();
    let id = Image::open_read_only(&ns.ioctx, "big")
        .unwrap()
        .id()
        .unwrap();
    rbd::trash_move(&ns.ioctx, "big", Duration::ZERO).unwrap();
    let t = Instant::now();
    let r = rbd::trash_remove_with_deadline(&ns.ioctx, &id, true, t + Duration::from_millis(200));
    assert_stopped(r, t, "trash remove");
    assert!(rbd::trash_list(&ns.ioctx)
        .unwrap()
        .iter()
        .any(|e| e.id == id));
    let t = Instant::now();
    rbd::trash_remove_with_deadline(&ns.ioctx, &id, true, t + Duration::from_secs(600)).unwrap();
    eprintln!("full trash remove took {:?}", t.elapsed());
    assert!(rbd::trash_list(&ns.ioctx).unwrap().is_empty());
}

#[test]
fn flatten_stops_at_its_deadline_and_a_retry_finishes() {
    let ns = TestNs::new("dl-flatten");
    rbd::create(&ns.ioctx, "parent", 64 * GIB, &slow_opts()).unwrap();
    let parent = Image::open(&ns.ioctx, "parent").unwrap();
    parent.write(0, b"from the parent").unwrap();
    parent.snap_create("s").unwrap();
    parent.snap_protect("s").unwrap();
    rbd::clone(&ns.ioctx, "parent", "s", &ns.ioctx, "child", &slow_opts()).unwrap();
    let child = Image::open(&ns.ioctx, "child").unwrap();
    let t = Instant::now();
    assert_stopped(
        child.flatten_with_deadline(t + Duration::from_millis(200)),
        t,
        "flatten",
    );
    assert!(child.parent().unwrap().is_some(), "still a clone");
    let t = Instant::now();
    child
        .flatten_with_deadline(t + Duration::from_secs(600))
        .unwrap();
    eprintln!("full flatten took {:?}", t.elapsed());
    assert!(child.parent().unwrap().is_none());
    let mut buf = [0u8; 15];
    child.read_exact(0, &mut buf).unwrap();
    assert_eq!(&buf, b"from the parent");
    drop(child);
    parent.snap_unprotect("s").unwrap();
    parent.snap_remove("s").unwrap();
}
