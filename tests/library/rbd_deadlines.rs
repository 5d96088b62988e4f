//! Long-running librbd calls (remove, trash remove, flatten, sparsify)
//! stopped by a deadline through their progress callbacks, against a real
//! cluster.

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

/// The deadline each test gives the slow call.
const DEADLINE: Duration = Duration::from_millis(200);

/// How long after its deadline a stopped call may return at most: the
/// progress callback that sees the deadline comes after the object in
/// flight, and a machine at load 10 is slow to schedule us. How soon it
/// must return is measured against the whole operation instead (see
/// [`assert_early`]); a call that ignored its deadline does not return an
/// error at all (the image is gone, flattened), which each test checks too.
const SLACK: Duration = Duration::from_secs(10);

/// Asserts a deadline error (the call had `DEADLINE` from `started`), and
/// returns how long the call took.
fn assert_stopped(r: rbdkit::Result<()>, started: Instant, what: &str) -> Duration {
    let took = started.elapsed();
    let e = r.expect_err(what);
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{what}: {e}");
    assert!(
        took < DEADLINE + SLACK,
        "{what} stopped only after {took:?}"
    );
    eprintln!("{what} stopped after {took:?}");
    took
}

/// Asserts the stopped call came back soon after its deadline: well before
/// the whole operation, run to its end on the same machine right after,
/// took (seconds here; on a loaded machine both are slower).
fn assert_early(stopped: Duration, whole: Duration, what: &str) {
    eprintln!("full {what} took {whole:?}");
    assert!(
        stopped < DEADLINE + whole.saturating_sub(DEADLINE) / 2,
        "{what} stopped only after {stopped:?}, while all of it took {whole:?}"
    );
}

#[test]
fn remove_stops_at_its_deadline_and_a_retry_finishes() {
    let ns = TestNs::new("dl-remove");
    rbd::create(&ns.ioctx, "big", 64 * GIB, &slow_opts()).unwrap();
    let t = Instant::now();
    let r = rbd::remove_with_deadline(&ns.ioctx, "big", t + DEADLINE);
    let stopped = assert_stopped(r, t, "remove");
    assert_eq!(
        rbd::list_names(&ns.ioctx).unwrap(),
        vec!["big"],
        "not removed yet"
    );
    let t = Instant::now();
    rbd::remove_with_deadline(&ns.ioctx, "big", t + Duration::from_secs(600)).unwrap();
    assert_early(stopped, t.elapsed(), "remove");
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
    let r = rbd::trash_remove_with_deadline(&ns.ioctx, &id, true, t + DEADLINE);
    let stopped = assert_stopped(r, t, "trash remove");
    assert!(rbd::trash_list(&ns.ioctx)
        .unwrap()
        .iter()
        .any(|e| e.id == id));
    let t = Instant::now();
    rbd::trash_remove_with_deadline(&ns.ioctx, &id, true, t + Duration::from_secs(600)).unwrap();
    assert_early(stopped, t.elapsed(), "trash remove");
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
    let stopped = assert_stopped(child.flatten_with_deadline(t + DEADLINE), t, "flatten");
    assert!(child.parent().unwrap().is_some(), "still a clone");
    let t = Instant::now();
    child
        .flatten_with_deadline(t + Duration::from_secs(600))
        .unwrap();
    assert_early(stopped, t.elapsed(), "flatten");
    assert!(child.parent().unwrap().is_none());
    let mut buf = [0u8; 15];
    child.read_exact(0, &mut buf).unwrap();
    assert_eq!(&buf, b"from the parent");
    drop(child);
    parent.snap_unprotect("s").unwrap();
    parent.snap_remove("s").unwrap();
}

#[test]
fn sparsify_stops_at_its_deadline_and_a_retry_finishes() {
    let ns = TestNs::new("dl-sparsify");
    rbd::create(&ns.ioctx, "big", 64 * GIB, &slow_opts()).unwrap();
    let img = Image::open(&ns.ioctx, "big").unwrap();
    // One object of zeroes to deallocate, one of data to keep.
    img.write(0, &vec![0u8; 4 << 20]).unwrap();
    img.write(8 << 20, &[7u8; 4096]).unwrap();
    let before = img.allocated_bytes().unwrap();
    assert!(
        before >= (4 << 20) + 4096,
        "the zeroes are allocated: {before}"
    );
    // Counted by extent, not by object: the 4 KiB of data is 4 KiB.
    assert!(img.disk_usage().unwrap() >= 8 << 20);
    let t = Instant::now();
    let r = img.sparsify_with_deadline(64 << 10, t + DEADLINE);
    let stopped = assert_stopped(r, t, "sparsify");
    let t = Instant::now();
    img.sparsify_with_deadline(64 << 10, t + Duration::from_secs(600))
        .unwrap();
    assert_early(stopped, t.elapsed(), "sparsify");
    let after = img.allocated_bytes().unwrap();
    assert!(
        after <= 64 << 10,
        "allocated {before} bytes before, {after} after"
    );
    let mut back = vec![0u8; 4096];
    img.read_exact(8 << 20, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 7), "the data was kept");
}
