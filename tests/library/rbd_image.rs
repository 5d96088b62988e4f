//! librbd images against a real cluster: create options, open modes, info,
//! resize, rename, list, features, metadata, watchers, locks, I/O, copy,
//! diff and disk usage.

use crate::support;

use std::collections::BTreeSet;
use std::ops::ControlFlow;

use rbdkit::rbd::{self, Features, Image, ImageOptions, LockMode};
use rbdkit::ErrorKind;
use support::ceph::{cluster, unique, TestNs, POOL};

const MIB: u64 = 1 << 20;

#[test]
fn create_with_features_order_and_open_every_way() {
    let ns = TestNs::new("create");
    let features =
        Features::LAYERING | Features::EXCLUSIVE_LOCK | Features::OBJECT_MAP | Features::FAST_DIFF;
    let opts = ImageOptions::new()
        .features(features)
        .object_size(MIB)
        .unwrap();
    rbd::create(&ns.ioctx, "img", 64 * MIB, &opts).unwrap();

    let img = Image::open(&ns.ioctx, "img").unwrap();
    let info = img.stat().unwrap();
    assert_eq!(info.size, 64 * MIB);
    assert_eq!(info.object_size, MIB);
    assert_eq!(info.order, 20);
    assert_eq!(info.num_objs, 64);
    assert!(info.block_name_prefix.starts_with("rbd_data."), "{info:?}");
    assert_eq!(img.size().unwrap(), 64 * MIB);
    assert_eq!(img.features().unwrap(), features);
    let id = img.id().unwrap();
    assert!(info.block_name_prefix.ends_with(&id));
    assert_eq!(img.get_name().unwrap(), "img");
    assert!(img.create_timestamp().unwrap() <= std::time::SystemTime::now());
    assert_eq!(img.data_pool_id().unwrap(), ns.ioctx.pool_id());
    drop(img);

    let by_id = Image::open_by_id(&ns.ioctx, &id).unwrap();
    assert_eq!(by_id.name(), "img");
    by_id.close().unwrap();
    let ro = Image::open_by_id_read_only(&ns.ioctx, &id).unwrap();
    assert!(ro.is_read_only());
    let e = ro.write(0, b"x").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly, "{e}");
    let ro2 = Image::open_read_only(&ns.ioctx, "img").unwrap();
    assert_eq!(ro2.size().unwrap(), 64 * MIB);
}

#[test]
fn create_with_striping_and_a_data_pool() {
    let ns = TestNs::new("stripe");
    let opts = ImageOptions::new()
        .features(Features::LAYERING | Features::STRIPING)
        .object_size(4 * MIB)
        .unwrap()
        .striping(64 << 10, 8)
        .unwrap();
    rbd::create(&ns.ioctx, "s", 32 * MIB, &opts).unwrap();
    let img = Image::open(&ns.ioctx, "s").unwrap();
    assert_eq!(img.stripe_unit().unwrap(), 64 << 10);
    assert_eq!(img.stripe_count().unwrap(), 8);
    let data = vec![0xabu8; 300 << 10];
    img.write(100, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    img.read_exact(100, &mut back).unwrap();
    assert_eq!(back, data);

    // A data pool: image headers in the test pool, data objects elsewhere.
    let c = cluster();
    let data_pool = unique("datapool");
    c.pool_create(&data_pool).unwrap();
    let dio = c.ioctx(&data_pool).unwrap();
    dio.application_enable("rbd", false).unwrap();
    let dp = ImageOptions::new().data_pool(&data_pool);
    rbd::create(&ns.ioctx, "dp", 8 * MIB, &dp).unwrap();
    let img = Image::open(&ns.ioctx, "dp").unwrap();
    assert_eq!(img.data_pool_id().unwrap(), dio.pool_id());
    assert!(img.features().unwrap().contains(Features::DATA_POOL));
    img.write(0, b"data in another pool").unwrap();
    drop(img);
    rbd::remove(&ns.ioctx, "dp").unwrap();
    drop(dio);
    c.pool_delete(&data_pool).unwrap();
}

#[test]
fn create_refuses_bad_options_before_calling_librbd() {
    let ns = TestNs::new("badopts");
    let e = rbd::create(
        &ns.ioctx,
        "x",
        MIB,
        &ImageOptions::new().features(Features::OBJECT_MAP),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("exclusive-lock"), "{e}");
    let e = rbd::create(&ns.ioctx, "a/b", MIB, &ImageOptions::new()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let e = rbd::create(&ns.ioctx, "", MIB, &ImageOptions::new()).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    assert!(
        rbd::list(&ns.ioctx).unwrap().is_empty(),
        "nothing was created"
    );
}

#[test]
fn list_rename_and_remove() {
    let ns = TestNs::new("list");
    for n in ["a", "b", "c"] {
        rbd::create(&ns.ioctx, n, MIB, &ImageOptions::new()).unwrap();
    }
    let specs = rbd::list(&ns.ioctx).unwrap();
    let names: BTreeSet<_> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, BTreeSet::from(["a", "b", "c"]));
    assert!(specs.iter().all(|s| !s.id.is_empty()));
    rbd::rename(&ns.ioctx, "b", "bb").unwrap();
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec!["a", "bb", "c"]);
    rbd::remove(&ns.ioctx, "a").unwrap();
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec!["bb", "c"]);
    // Other namespaces do not see these images.
    let other = TestNs::new("list-other");
    assert!(rbd::list(&other.ioctx).unwrap().is_empty());
}

#[test]
fn resize_grows_and_shrinks_only_when_allowed() {
    let ns = TestNs::new("resize");
    rbd::create(&ns.ioctx, "r", 8 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "r").unwrap();
    img.resize(16 * MIB).unwrap();
    assert_eq!(img.size().unwrap(), 16 * MIB);
    img.resize(16 * MIB).unwrap(); // same size: no-op
    let e = img.resize(4 * MIB).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ShrinkRefused, "{e}");
    assert!(
        e.to_string().contains(&format!("{POOL}/{}/r", ns.name)),
        "{e}"
    );
    assert_eq!(
        img.size().unwrap(),
        16 * MIB,
        "refused shrink changed nothing"
    );
    img.resize_allow_shrink(4 * MIB).unwrap();
    assert_eq!(img.size().unwrap(), 4 * MIB);
}

#[test]
fn features_update() {
    let ns = TestNs::new("features");
    let opts = ImageOptions::new().features(Features::LAYERING | Features::EXCLUSIVE_LOCK);
    rbd::create(&ns.ioctx, "f", 8 * MIB, &opts).unwrap();
    let img = Image::open(&ns.ioctx, "f").unwrap();
    img.update_features(Features::OBJECT_MAP | Features::FAST_DIFF, true)
        .unwrap();
    assert!(img
        .features()
        .unwrap()
        .contains(Features::OBJECT_MAP | Features::FAST_DIFF));
    img.update_features(Features::FAST_DIFF, false).unwrap();
    assert!(!img.features().unwrap().contains(Features::FAST_DIFF));
    let e = img.update_features(Features::LAYERING, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

#[test]
fn metadata_set_get_list_remove() {
    let ns = TestNs::new("meta");
    rbd::create(&ns.ioctx, "m", MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "m").unwrap();
    for i in 0..300 {
        img.metadata_set(&format!("key.{i:03}"), &format!("value {i}"))
            .unwrap();
    }
    img.metadata_set("empty", "").unwrap();
    assert_eq!(img.metadata_get("key.042").unwrap(), "value 42");
    let all = img.metadata_list().unwrap();
    assert_eq!(all.len(), 301, "listing pages past 256 keys");
    assert_eq!(all["key.299"], "value 299");
    assert_eq!(all["empty"], "");
    img.metadata_remove("key.042").unwrap();
    let e = img.metadata_get("key.042").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    let long = "x".repeat(10_000);
    img.metadata_set("long", &long).unwrap();
    assert_eq!(
        img.metadata_get("long").unwrap(),
        long,
        "get grows its buffer"
    );
}

#[test]
fn watchers_and_locks() {
    let ns = TestNs::new("watch");
    let opts = ImageOptions::new().features(Features::LAYERING | Features::EXCLUSIVE_LOCK);
    rbd::create(&ns.ioctx, "w", MIB, &opts).unwrap();
    let a = Image::open(&ns.ioctx, "w").unwrap();
    let ws = a.watchers().unwrap();
    assert_eq!(ws.len(), 1, "{ws:?}");
    let b = Image::open(&ns.ioctx, "w").unwrap();
    assert_eq!(a.watchers().unwrap().len(), 2);
    drop(b);
    assert_eq!(a.watchers().unwrap().len(), 1);
    let ro = Image::open_read_only(&ns.ioctx, "w").unwrap();
    assert_eq!(
        ro.watchers().unwrap().len(),
        1,
        "read-only opens do not watch"
    );

    // Managed exclusive lock.
    a.lock_acquire(LockMode::Exclusive).unwrap();
    assert!(a.is_exclusive_lock_owner().unwrap());
    let (mode, owners) = a.lock_owners().unwrap();
    assert_eq!(mode, LockMode::Exclusive);
    assert_eq!(owners.len(), 1);
    a.lock_release().unwrap();
    assert!(!a.is_exclusive_lock_owner().unwrap());

    // Advisory locks.
    assert!(a.lockers().unwrap().lockers.is_empty());
    a.lock_shared("cookie-1", "tag-1").unwrap();
    let l = a.lockers().unwrap();
    assert!(!l.exclusive);
    assert_eq!(l.tag, "tag-1");
    assert_eq!(l.lockers.len(), 1);
    assert_eq!(l.lockers[0].cookie, "cookie-1");
    assert!(l.lockers[0].client.starts_with("client."), "{l:?}");
    a.unlock("cookie-1").unwrap();
    assert!(a.lockers().unwrap().lockers.is_empty());

    // Breaking a lock blocklists its holder, so another client holds it.
    let other = support::ceph::TestCluster::get().connect();
    let other_io = other.ioctx_ns(POOL, &ns.name).unwrap();
    let holder = Image::open_read_only(&other_io, "w").unwrap();
    holder.lock_exclusive("c2").unwrap();
    let l = a.lockers().unwrap();
    assert!(l.exclusive);
    assert_eq!(l.lockers.len(), 1);
    assert_eq!(
        l.lockers[0].client,
        format!("client.{}", other.instance_id())
    );
    a.break_lock(&l.lockers[0].client, "c2").unwrap();
    assert!(a.lockers().unwrap().lockers.is_empty());
}

#[test]
fn read_write_discard_zeroes_flush() {
    let ns = TestNs::new("io");
    rbd::create(&ns.ioctx, "io", 8 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "io").unwrap();
    // Default 4 MiB objects: the test data fills part of object 1.
    let base = 4 * MIB;
    let data: Vec<u8> = (0..MIB as usize).map(|i| (i % 251) as u8).collect();
    img.write(base, &data).unwrap();
    img.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    img.read_exact(base, &mut back).unwrap();
    assert_eq!(back, data);
    img.write_zeroes(base + 8192, 4096).unwrap();
    let mut page = vec![1u8; 4096];
    img.read_exact(base + 8192, &mut page).unwrap();
    assert!(page.iter().all(|b| *b == 0), "zeroed range reads as zeroes");
    img.read_exact(base + 4096, &mut page).unwrap();
    assert_eq!(page[..], data[4096..8192], "neighbours untouched");
    // librbd skips partial-object discards by default, so discard the object.
    img.discard(base, 4 * MIB).unwrap();
    img.read_exact(base + 4096, &mut page).unwrap();
    assert!(
        page.iter().all(|b| *b == 0),
        "discarded range reads as zeroes"
    );
    // Reads past the end are short; writes past the end fail.
    let mut tail = vec![0u8; 8192];
    assert_eq!(img.read(8 * MIB - 4096, &mut tail).unwrap(), 4096);
    assert!(img.write(8 * MIB - 10, &[0u8; 20]).is_err());
    // Compare-and-write.
    let expected = vec![0u8; 512];
    assert_eq!(
        img.compare_and_write(0, &expected, &[9u8; 512]).unwrap(),
        None
    );
    let mism = img.compare_and_write(0, &expected, &[8u8; 512]).unwrap();
    assert_eq!(mism, Some(0));
    let mut first = [0u8; 512];
    img.read_exact(0, &mut first).unwrap();
    assert!(first.iter().all(|b| *b == 9));
    img.invalidate_cache().unwrap();
}

#[test]
fn copy_diff_and_disk_usage() {
    let ns = TestNs::new("copy");
    let opts = ImageOptions::new()
        .features(
            Features::LAYERING
                | Features::EXCLUSIVE_LOCK
                | Features::OBJECT_MAP
                | Features::FAST_DIFF,
        )
        .object_size(MIB)
        .unwrap();
    rbd::create(&ns.ioctx, "src", 16 * MIB, &opts).unwrap();
    let img = Image::open(&ns.ioctx, "src").unwrap();
    assert_eq!(img.disk_usage().unwrap(), 0);
    img.write(0, &[1u8; 4096]).unwrap();
    img.write(5 * MIB, &[2u8; 4096]).unwrap();
    assert_eq!(img.disk_usage().unwrap(), 2 * MIB, "two objects touched");
    img.snap_create("s1").unwrap();
    img.write(9 * MIB, &[3u8; 100]).unwrap();
    let mut changed = Vec::new();
    img.diff_iterate(Some("s1"), 0, 16 * MIB, false, false, |off, len, exists| {
        changed.push((off, len, exists));
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(changed, vec![(9 * MIB, 100, true)]);
    let mut first = None;
    img.diff_iterate(None, 0, 16 * MIB, false, true, |off, _, _| {
        first = Some(off);
        ControlFlow::Break(())
    })
    .unwrap();
    assert_eq!(first, Some(0), "Break stops after the first extent");

    img.copy_to(&ns.ioctx, "dst", &ImageOptions::new()).unwrap();
    let dst = Image::open(&ns.ioctx, "dst").unwrap();
    let mut buf = [0u8; 100];
    dst.read_exact(9 * MIB, &mut buf).unwrap();
    assert_eq!(buf, [3u8; 100]);
    assert!(
        dst.snap_list().unwrap().is_empty(),
        "copy takes the head only"
    );
    img.deep_copy_to(&ns.ioctx, "deep", &ImageOptions::new())
        .unwrap();
    let deep = Image::open(&ns.ioctx, "deep").unwrap();
    assert_eq!(
        deep.snap_list().unwrap().len(),
        1,
        "deep copy keeps snapshots"
    );
}

#[test]
#[should_panic(expected = "boom in callback")]
fn a_panic_in_a_callback_does_not_cross_into_c() {
    let ns = TestNs::new("panic");
    rbd::create(&ns.ioctx, "p", 4 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "p").unwrap();
    img.write(0, b"x").unwrap();
    let _ = img.diff_iterate(None, 0, 4 * MIB, false, false, |_, _, _| {
        panic!("boom in callback")
    });
}

#[test]
fn pool_init_and_namespaces() {
    let c = cluster();
    let name = unique("initpool");
    c.pool_create(&name).unwrap();
    let io = c.ioctx(&name).unwrap();
    rbd::pool_init(&io, false).unwrap();
    rbd::namespace_create(&io, "n1").unwrap();
    assert!(rbd::namespace_exists(&io, "n1").unwrap());
    assert_eq!(rbd::namespace_list(&io).unwrap(), vec!["n1"]);
    let e = rbd::namespace_create(&io, "n1").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    rbd::namespace_remove(&io, "n1").unwrap();
    assert!(!rbd::namespace_exists(&io, "n1").unwrap());
    drop(io);
    c.pool_delete(&name).unwrap();
    assert_eq!(rbd::version().0, 1);
}

#[test]
fn update_watch_fires_on_header_changes() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let ns = TestNs::new("updwatch");
    rbd::create(&ns.ioctx, "u", 4 * MIB, &ImageOptions::new()).unwrap();
    let watched = Image::open(&ns.ioctx, "u").unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = Arc::clone(&hits);
    let watch = watched
        .update_watch(move || {
            h.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    // Another client changes the header.
    let other = support::ceph::TestCluster::get().connect();
    let changer = Image::open(&other.ioctx_ns(POOL, &ns.name).unwrap(), "u").unwrap();
    changer.resize(8 * MIB).unwrap();
    // Bound for a hang only (a loaded machine is slow): returns at once.
    let deadline = Instant::now() + Duration::from_secs(120);
    while hits.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < deadline,
            "no update notification within 120 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(watch);
    let seen = hits.load(Ordering::SeqCst);
    changer.resize(16 * MIB).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        hits.load(Ordering::SeqCst),
        seen,
        "no calls after the watch is dropped"
    );
    assert_eq!(watched.size().unwrap(), 16 * MIB);
}

#[test]
fn timestamps_op_features_overlap_and_object_map_rebuild() {
    let ns = TestNs::new("misc");
    let opts = ImageOptions::new().features(
        Features::LAYERING | Features::EXCLUSIVE_LOCK | Features::OBJECT_MAP | Features::FAST_DIFF,
    );
    rbd::create(&ns.ioctx, "p", 8 * MIB, &opts).unwrap();
    let p = Image::open(&ns.ioctx, "p").unwrap();
    assert!(
        p.access_timestamp().unwrap()
            <= std::time::SystemTime::now() + std::time::Duration::from_secs(60)
    );
    assert!(p.modify_timestamp().is_ok());
    p.write(0, b"x").unwrap();
    p.rebuild_object_map().unwrap();
    assert_eq!(p.flags().unwrap() & 1, 0, "object map valid after rebuild");
    p.snap_create("s").unwrap();
    p.snap_protect("s").unwrap();
    rbd::clone(
        &ns.ioctx,
        "p",
        "s",
        &ns.ioctx,
        "c",
        &ImageOptions::new().clone_format(2).unwrap(),
    )
    .unwrap();
    let c = Image::open(&ns.ioctx, "c").unwrap();
    assert_eq!(c.overlap().unwrap(), 8 * MIB);
    assert_ne!(
        c.op_features().unwrap() & 2,
        0,
        "RBD_OPERATION_FEATURE_CLONE_CHILD"
    );
    assert_ne!(
        p.op_features().unwrap() & 1,
        0,
        "RBD_OPERATION_FEATURE_CLONE_PARENT"
    );
    assert_eq!(p.overlap().unwrap(), 0);
    assert!(ImageOptions::new().clone_format(3).is_err());
}

#[test]
fn metadata_lists_non_utf8_keys_exactly_once_across_pages() {
    let ns = TestNs::new("rawmeta");
    rbd::create(&ns.ioctx, "img", MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "img").unwrap();
    // Past one 256-key page: `\x80` keys (their lossy form sorts after them)
    // and `\xff` keys (it sorts before them).
    let mut keys = Vec::new();
    for i in 0..300 {
        keys.push([&b"m\x80"[..], format!("{i:05}").as_bytes()].concat());
    }
    for i in 0..5 {
        keys.push([&b"m\xff"[..], format!("{i:05}").as_bytes()].concat());
    }
    for k in &keys {
        img.metadata_set_bytes(k, &k[2..]).unwrap();
    }
    let all = img.metadata_list_bytes().unwrap();
    assert_eq!(all.len(), keys.len());
    for k in &keys {
        assert_eq!(all[k], k[2..], "{k:?}");
    }
    let lossy: BTreeSet<String> = keys
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    assert_eq!(img.metadata_list().unwrap().len(), lossy.len());
}

#[test]
fn dropping_an_update_watch_with_a_stuck_callback_is_bounded() {
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    let ns = TestNs::new("stuckwatch");
    rbd::create(&ns.ioctx, "s", 4 * MIB, &ImageOptions::new()).unwrap();
    let watched = Image::open(&ns.ioctx, "s").unwrap();
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let started_tx = Mutex::new(started_tx);
    let release_rx = Arc::new(Mutex::new(release_rx));
    let rel = Arc::clone(&release_rx);
    let mut watch = watched
        .update_watch(move || {
            let _ = started_tx.lock().unwrap().send(());
            // Stuck until the test lets go (or 300 s: far beyond the bound
            // on the drop below, so a drop that waited for it fails).
            let _ = rel.lock().unwrap().recv_timeout(Duration::from_secs(300));
        })
        .unwrap();
    let other = support::ceph::TestCluster::get().connect();
    let changer = Image::open(&other.ioctx_ns(POOL, &ns.name).unwrap(), "s").unwrap();
    changer.resize(8 * MIB).unwrap();
    started_rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the callback runs");
    let unwatch_timeout = Duration::from_secs(1);
    watch.set_unwatch_timeout(unwatch_timeout);
    let t = Instant::now();
    drop(watch);
    // The unwatch bound plus slack for a machine at load 10; waiting for
    // the callback would take its 300 s.
    assert!(
        t.elapsed() < unwatch_timeout + Duration::from_secs(30),
        "drop waited {:?} for a stuck callback",
        t.elapsed()
    );
    // Once the callback returns, the image closes normally.
    release_tx.send(()).unwrap();
    watched.close().unwrap();
}

/// Why the node plugin's staging lock is a lock of its own name on the
/// header and not librbd's advisory lock (`rbd lock add`): the exclusive-lock
/// feature's managed lock is the same cls lock (`rbd_lock`), so an advisory
/// lock held by one client stops another client's writes to the image, while
/// a lock of another name leaves them alone.
#[test]
fn an_advisory_rbd_lock_blocks_exclusive_lock_writers_another_lock_name_does_not() {
    let ns = TestNs::new("locknames");
    let opts = ImageOptions::new()
        .features(rbdkit::rbd::Features::LAYERING | rbdkit::rbd::Features::EXCLUSIVE_LOCK);
    rbd::create(&ns.ioctx, "img", 8 << 20, &opts).unwrap();
    let other = support::ceph::TestCluster::get().connect();
    let io2 = other
        .ioctx(support::ceph::POOL)
        .unwrap()
        .with_namespace(&ns.name)
        .unwrap();

    let holder = Image::open(&io2, "img").unwrap();
    let oid = holder.header_oid().unwrap();
    io2.lock_exclusive(&oid, "rbdkit.stage", "node-a", "")
        .unwrap();
    let writer = Image::open(&ns.ioctx, "img").unwrap();
    writer.write(0, b"allowed").unwrap();
    writer.flush().unwrap();
    drop(writer);
    io2.unlock(&oid, "rbdkit.stage", "node-a").unwrap();

    holder.lock_exclusive("node-a").unwrap();
    let writer = Image::open(&ns.ioctx, "img").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let r = writer.write(0, b"refused").map_err(|e| e.to_string());
        let _ = tx.send(r);
        drop(writer);
    });
    // The write neither succeeds nor fails: librbd waits for the "lock
    // owner" to hand the managed lock over.
    let r = rx.recv_timeout(std::time::Duration::from_secs(15));
    assert!(
        !matches!(r, Ok(Ok(()))),
        "a write went through while an advisory rbd lock was held"
    );
    holder.unlock("node-a").unwrap();
    if r.is_err() {
        // Released: the waiting write goes through now.
        let r = rx.recv_timeout(std::time::Duration::from_secs(120));
        assert!(matches!(r, Ok(Ok(()))), "{r:?}");
    }
    t.join().unwrap();

    // A lock of its own name does not keep the image from being removed
    // (it goes with the header).
    io2.lock_exclusive(&oid, "rbdkit.stage", "node-a", "")
        .unwrap();
    drop(holder);
    rbd::remove(&ns.ioctx, "img").unwrap();
    let e = io2.lockers(&oid, "rbdkit.stage").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
}
