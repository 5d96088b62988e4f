//! Snapshots, clones and the trash against a real cluster.

use crate::support;

use std::time::{Duration, SystemTime};

use rbdkit::rbd::{self, Features, Image, ImageOptions, TrashSource};
use rbdkit::ErrorKind;
use support::ceph::TestNs;

const MIB: u64 = 1 << 20;

fn layered() -> ImageOptions {
    ImageOptions::new()
        .features(Features::LAYERING | Features::EXCLUSIVE_LOCK | Features::DEEP_FLATTEN)
}

#[test]
fn snapshot_create_list_protect_rollback_remove() {
    let ns = TestNs::new("snap");
    rbd::create(&ns.ioctx, "img", 8 * MIB, &layered()).unwrap();
    let img = Image::open(&ns.ioctx, "img").unwrap();
    img.write(0, b"first").unwrap();
    let before = SystemTime::now() - Duration::from_secs(60);
    img.snap_create("s1").unwrap();
    img.write(0, b"later").unwrap();
    img.snap_create("s2").unwrap();
    let snaps = img.snap_list().unwrap();
    let names: Vec<_> = snaps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["s1", "s2"]);
    assert!(snaps.iter().all(|s| s.size == 8 * MIB));
    assert!(img.snap_exists("s1").unwrap());
    assert!(!img.snap_exists("nope").unwrap());
    let id = img.snap_id("s1").unwrap();
    assert_eq!(id, snaps[0].id);
    assert_eq!(img.snap_name(id).unwrap(), "s1");
    let ts = img.snap_timestamp(id).unwrap();
    assert!(
        ts > before && ts <= SystemTime::now() + Duration::from_secs(60),
        "{ts:?}"
    );

    let dup = img.snap_create("s1").unwrap_err();
    assert_eq!(dup.kind(), ErrorKind::AlreadyExists);
    assert!(dup.to_string().contains("img@s1"), "{dup}");

    img.snap_protect("s1").unwrap();
    assert!(img.snap_is_protected("s1").unwrap());
    let busy = img.snap_remove("s1").unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::Busy, "{busy}");
    img.snap_unprotect("s1").unwrap();
    assert!(!img.snap_is_protected("s1").unwrap());

    img.snap_rollback("s1").unwrap();
    let mut buf = [0u8; 5];
    img.read_exact(0, &mut buf).unwrap();
    assert_eq!(&buf, b"first");

    // Reading at a snapshot through the same handle, and through a snapshot open.
    let mut at = Image::open(&ns.ioctx, "img").unwrap();
    at.set_snapshot(Some("s2")).unwrap();
    at.read_exact(0, &mut buf).unwrap();
    assert_eq!(&buf, b"later");
    at.set_snapshot(None).unwrap();
    let snap_open = Image::open_snapshot(&ns.ioctx, "img", "s2").unwrap();
    snap_open.read_exact(0, &mut buf).unwrap();
    assert_eq!(&buf, b"later");

    img.snap_rename("s2", "s2b").unwrap();
    img.snap_remove("s1").unwrap();
    img.snap_protect("s2b").unwrap();
    img.snap_remove_force("s2b").unwrap();
    assert!(img.snap_list().unwrap().is_empty());
    img.set_snap_limit(5).unwrap();
    assert_eq!(img.snap_limit().unwrap(), 5);
}

#[test]
fn clone_parent_children_flatten() {
    let ns = TestNs::new("clone");
    rbd::create(&ns.ioctx, "parent", 8 * MIB, &layered()).unwrap();
    let parent = Image::open(&ns.ioctx, "parent").unwrap();
    parent.write(MIB, b"golden").unwrap();
    parent.snap_create("base").unwrap();
    parent.snap_protect("base").unwrap();
    rbd::clone(&ns.ioctx, "parent", "base", &ns.ioctx, "child", &layered()).unwrap();

    let child = Image::open(&ns.ioctx, "child").unwrap();
    let p = child.parent().unwrap().expect("a clone has a parent");
    assert_eq!(p.image.image_name, "parent");
    assert_eq!(p.image.namespace, ns.name);
    assert_eq!(p.snap_name, "base");
    let mut buf = [0u8; 6];
    child.read_exact(MIB, &mut buf).unwrap();
    assert_eq!(&buf, b"golden", "clone reads through to its parent");

    let mut at_base = Image::open(&ns.ioctx, "parent").unwrap();
    at_base.set_snapshot(Some("base")).unwrap();
    let kids = at_base.children().unwrap();
    assert_eq!(kids.len(), 1);
    assert_eq!(kids[0].image_name, "child");
    assert_eq!(parent.descendants().unwrap().len(), 1);
    let busy = parent.snap_unprotect("base").unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::Busy, "{busy}");

    child.flatten().unwrap();
    assert!(
        child.parent().unwrap().is_none(),
        "flattened clone has no parent"
    );
    child.read_exact(MIB, &mut buf).unwrap();
    assert_eq!(&buf, b"golden");
    assert!(at_base.children().unwrap().is_empty());
    parent.snap_unprotect("base").unwrap();
    assert!(parent.parent().unwrap().is_none());
}

#[test]
fn trash_move_list_restore_remove() {
    let ns = TestNs::new("trash");
    rbd::create(&ns.ioctx, "t", 4 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "t").unwrap();
    let id = img.id().unwrap();
    img.snap_create("keep").unwrap();
    drop(img);

    rbd::trash_move(&ns.ioctx, "t", Duration::from_secs(0)).unwrap();
    assert!(rbd::list(&ns.ioctx).unwrap().is_empty());
    let entries = rbd::trash_list(&ns.ioctx).unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].id, id);
    assert_eq!(entries[0].name, "t");
    assert_eq!(entries[0].source, TrashSource::User);
    assert_eq!(rbd::trash_get(&ns.ioctx, &id).unwrap().name, "t");

    rbd::trash_restore(&ns.ioctx, &id, "t2").unwrap();
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec!["t2"]);
    assert!(rbd::trash_list(&ns.ioctx).unwrap().is_empty());

    // An image with snapshots cannot be removed directly, but it can be
    // trashed and then purged once its snapshots are gone.
    let e = rbd::remove(&ns.ioctx, "t2").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HasSnapshots);
    let img = Image::open(&ns.ioctx, "t2").unwrap();
    img.snap_remove("keep").unwrap();
    drop(img);
    rbd::trash_move(&ns.ioctx, "t2", Duration::from_secs(3600)).unwrap();
    let deferred = rbd::trash_remove(&ns.ioctx, &id, false).unwrap_err();
    assert_eq!(
        deferred.kind(),
        ErrorKind::PermissionDenied,
        "deferment protects it: {deferred}"
    );
    rbd::trash_remove(&ns.ioctx, &id, true).unwrap();
    assert!(rbd::trash_list(&ns.ioctx).unwrap().is_empty());
    assert_eq!(
        rbd::trash_get(&ns.ioctx, &id).unwrap_err().kind(),
        ErrorKind::NotFound
    );

    rbd::create(&ns.ioctx, "p", MIB, &ImageOptions::new()).unwrap();
    rbd::trash_move(&ns.ioctx, "p", Duration::from_secs(0)).unwrap();
    rbd::trash_purge(&ns.ioctx, SystemTime::now() + Duration::from_secs(5)).unwrap();
    assert!(rbd::trash_list(&ns.ioctx).unwrap().is_empty());
}
