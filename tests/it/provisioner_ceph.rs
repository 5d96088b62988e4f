//! The provisioner's Ceph side against a real cluster, without Kubernetes:
//! the connection cache and the image operations with their ownership
//! checks.
use crate::support;

use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;

use rbdkit::blocking::BlockingPool;
use rbdkit::provisioner::metrics::Metrics;
use rbdkit::rados::Secret;
use rbdkit::rbd::{self, Image, ImageOptions};
use rbdkit::volume::clusters::{ClusterInfo, Connections, Credentials};
use rbdkit::volume::ops::{
    delete_image, ensure_image, expand_image, recorded_pv_name, Deleted, Owner, VolumeError,
    TEMP_SUFFIX,
};
use rbdkit::volume::{NoFence, VolumeId};
use rbdkit::{Error, ErrorKind};

use support::ceph::{cluster, TestCluster, TestNs, POOL};

fn metrics() -> Metrics {
    Metrics::new(&mut Registry::default())
}

fn info() -> ClusterInfo {
    ClusterInfo {
        cluster_id: "test".into(),
        monitors: vec![TestCluster::get().conf_value("mon host").unwrap()],
        rados_namespace: String::new(),
    }
}

fn admin() -> Credentials {
    Credentials {
        user: "admin".into(),
        key: Secret::new(TestCluster::get().admin_key()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_shared_counted_reaped_and_rebuilt() {
    let conns = Connections::new(
        BlockingPool::new(2),
        Duration::from_secs(10),
        Duration::from_secs(30),
        std::sync::Arc::new(metrics()),
    );
    let a = conns.get(&info(), &admin()).await.unwrap();
    let b = conns.get(&info(), &admin()).await.unwrap();
    assert_eq!(
        a.cluster().instance_id(),
        b.cluster().instance_id(),
        "shared"
    );
    assert_eq!(conns.len(), 1);
    // In use: never reaped, however idle.
    assert_eq!(conns.reap(Duration::ZERO), 0);
    drop(b);
    assert_eq!(conns.reap(Duration::ZERO), 0, "still used by a");
    // A broken connection is rebuilt for the next user.
    a.check(&Error::from_errno(libc::ETIMEDOUT, "rados_x", "test"));
    let first = a.cluster().instance_id();
    drop(a);
    let c = conns.get(&info(), &admin()).await.unwrap();
    assert_ne!(
        c.cluster().instance_id(),
        first,
        "rebuilt after a broken call"
    );
    // A request error does not mark it broken.
    c.check(&Error::from_errno(libc::ENOENT, "rbd_open", "x"));
    let second = c.cluster().instance_id();
    drop(c);
    let d = conns.get(&info(), &admin()).await.unwrap();
    assert_eq!(d.cluster().instance_id(), second);
    drop(d);
    // Idle: dropped.
    assert_eq!(conns.reap(Duration::ZERO), 1);
    assert!(conns.is_empty());
    // A wrong key fails (and is not cached).
    let bad = Credentials {
        user: "admin".into(),
        key: Secret::new("AQAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAAAA=="),
    };
    let e = conns.get(&info(), &bad).await.unwrap_err();
    assert!(!e.to_string().contains("AQAAAA"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_cluster_fails_in_bounded_time() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = ClusterInfo {
        cluster_id: "dead".into(),
        monitors: vec![format!("v1:127.0.0.1:{port}")],
        rados_namespace: String::new(),
    };
    let connect_timeout = Duration::from_secs(3);
    let conns = Connections::new(
        BlockingPool::new(2),
        connect_timeout,
        Duration::from_secs(3),
        std::sync::Arc::new(metrics()),
    );
    // The connect bound plus slack for a machine at load 10; unbounded, a
    // connect to a dead monitor waits client_mount_timeout (300 s).
    let bound = connect_timeout + Duration::from_secs(30);
    let t = Instant::now();
    let e = tokio::time::timeout(bound * 2, conns.get(&dead, &admin()))
        .await
        .expect("bounded by the connect timeout")
        .unwrap_err();
    assert!(t.elapsed() < bound, "{:?}", t.elapsed());
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert_eq!(e.op(), "rados_connect", "{e}");
}

/// The volume `image` in the test pool, in `ns`, on cluster "test".
fn volume_in(ns: &TestNs, image: &str) -> VolumeId {
    VolumeId {
        cluster_id: "test".into(),
        pool: POOL.into(),
        rados_namespace: ns.name.clone(),
        image: image.into(),
    }
}

fn owner(pv: &str) -> Owner {
    Owner {
        provisioner: "p.rbdkit.test".into(),
        pv_name: pv.into(),
        pvc_namespace: "ns".into(),
        pvc_name: "claim".into(),
        cluster_id: "test".into(),
    }
}

#[test]
fn image_operations_check_ownership_and_are_idempotent() {
    let ns = TestNs::new("volops");
    let m = metrics();
    let c = cluster();
    let vol = volume_in(&ns, "pvc-1");
    let opts = ImageOptions::new();
    // Create, and create again: same image.
    assert_eq!(
        ensure_image(&c, &m, &NoFence, &vol, 8 << 20, &opts, &owner("pvc-1")).unwrap(),
        8 << 20
    );
    assert_eq!(
        ensure_image(&c, &m, &NoFence, &vol, 8 << 20, &opts, &owner("pvc-1")).unwrap(),
        8 << 20
    );
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec!["pvc-1"]);
    // Someone else's claim on the same name: refused.
    let e = ensure_image(&c, &m, &NoFence, &vol, 8 << 20, &opts, &owner("pvc-2")).unwrap_err();
    assert!(matches!(e, VolumeError::NotOwned { .. }), "{e}");

    // A create cut short (temporary image, no metadata yet) is adopted.
    let vol2 = VolumeId {
        image: "pvc-2".into(),
        ..vol.clone()
    };
    rbd::create(&ns.ioctx, &format!("pvc-2{TEMP_SUFFIX}"), 4 << 20, &opts).unwrap();
    assert_eq!(
        ensure_image(&c, &m, &NoFence, &vol2, 4 << 20, &opts, &owner("pvc-2")).unwrap(),
        4 << 20
    );
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec!["pvc-1", "pvc-2"]);

    // An image that is not ours is never resized or removed.
    rbd::create(&ns.ioctx, "foreign", 4 << 20, &opts).unwrap();
    let foreign = VolumeId {
        image: "foreign".into(),
        ..vol.clone()
    };
    assert!(matches!(
        expand_image(
            &c,
            &m,
            &NoFence,
            &foreign,
            "p.rbdkit.test",
            "foreign",
            8 << 20
        )
        .unwrap_err(),
        VolumeError::NotOwned { .. }
    ));
    assert!(matches!(
        delete_image(&c, &m, &NoFence, &foreign, "p.rbdkit.test", "foreign").unwrap_err(),
        VolumeError::NotOwned { .. }
    ));
    assert!(matches!(
        delete_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-other").unwrap_err(),
        VolumeError::NotOwned { .. }
    ));
    assert_eq!(
        Image::open_read_only(&ns.ioctx, "foreign")
            .unwrap()
            .size()
            .unwrap(),
        4 << 20
    );

    // Expand: grow, same size again is fine, smaller is refused.
    assert_eq!(
        expand_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-1", 16 << 20).unwrap(),
        16 << 20
    );
    assert_eq!(
        expand_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-1", 16 << 20).unwrap(),
        16 << 20
    );
    assert!(matches!(
        expand_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-1", 8 << 20).unwrap_err(),
        VolumeError::ShrinkRefused { .. }
    ));

    // Delete: in use is refused, then removed, then already gone.
    let held = Image::open(&ns.ioctx, "pvc-1").unwrap();
    assert!(matches!(
        delete_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-1").unwrap_err(),
        VolumeError::InUse { .. }
    ));
    held.close().unwrap();
    assert_eq!(
        delete_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-1").unwrap(),
        Deleted::Removed
    );
    assert_eq!(
        delete_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-1").unwrap(),
        Deleted::AlreadyGone
    );
    assert_eq!(
        rbd::list_names(&ns.ioctx).unwrap(),
        vec!["foreign", "pvc-2"]
    );
}

#[test]
fn a_trash_entry_whose_owner_cannot_be_checked_is_not_purged() {
    let ns = TestNs::new("trashowner");
    let m = metrics();
    let c = cluster();
    let vol = |image: &str| volume_in(&ns, image);
    let opts = ImageOptions::new();
    let trashed = |name: &str| -> String {
        ensure_image(&c, &m, &NoFence, &vol(name), 4 << 20, &opts, &owner(name)).unwrap();
        let id = Image::open_read_only(&ns.ioctx, name)
            .unwrap()
            .id()
            .unwrap();
        rbd::trash_move(&ns.ioctx, name, Duration::ZERO).unwrap();
        id
    };
    let in_trash = |id: &str| {
        rbd::trash_list(&ns.ioctx)
            .unwrap()
            .iter()
            .any(|e| e.id == id)
    };

    // Ours and readable: a retry finishes the purge.
    let id = trashed("pvc-t1");
    assert_eq!(
        delete_image(&c, &m, &NoFence, &vol("pvc-t1"), "p.rbdkit.test", "pvc-t1").unwrap(),
        Deleted::Purged
    );
    assert!(!in_trash(&id));

    // Its header is gone, so it cannot be opened: never force-purged.
    let id = trashed("pvc-t2");
    ns.ioctx.remove(&format!("rbd_header.{id}")).unwrap();
    let e = delete_image(&c, &m, &NoFence, &vol("pvc-t2"), "p.rbdkit.test", "pvc-t2").unwrap_err();
    assert!(matches!(e, VolumeError::NotOwned { .. }), "{e}");
    assert!(e.to_string().contains(&id), "{e}");
    assert!(
        in_trash(&id),
        "the unverifiable entry is still in the trash"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reaping_shuts_connections_down_outside_the_cache_lock() {
    let conns = Connections::new(
        BlockingPool::new(4),
        Duration::from_secs(10),
        Duration::from_secs(30),
        std::sync::Arc::new(metrics()),
    );
    // rados_shutdown takes ~2 ms each here: 32 of them under the cache
    // lock (which runtime threads take) held it for ~60 ms or more.
    const N: usize = 32;
    for i in 0..N {
        let c = ClusterInfo {
            cluster_id: format!("reap-{i}"),
            ..info()
        };
        drop(conns.get(&c, &admin()).await.unwrap());
    }
    assert_eq!(conns.len(), N);
    let t = Instant::now();
    assert_eq!(conns.reap(Duration::ZERO), N);
    let took = t.elapsed();
    assert!(conns.is_empty());
    // Against what the N shutdowns cost here and now (a fixed bound fails
    // on a loaded machine): a reap outside a runtime does them itself.
    let inline = Connections::new(
        BlockingPool::new(4),
        Duration::from_secs(10),
        Duration::from_secs(30),
        std::sync::Arc::new(metrics()),
    );
    for i in 0..N {
        let c = ClusterInfo {
            cluster_id: format!("reap-inline-{i}"),
            ..info()
        };
        drop(inline.get(&c, &admin()).await.unwrap());
    }
    let shutdowns = std::thread::spawn(move || {
        let t = Instant::now();
        assert_eq!(inline.reap(Duration::ZERO), N);
        t.elapsed()
    })
    .join()
    .unwrap();
    eprintln!("reap took {took:?}; {N} shutdowns in a reap {shutdowns:?}");
    assert!(
        took < shutdowns / 2,
        "reap held the cache for {took:?}, while {N} rados_shutdowns take {shutdowns:?} \
         (rados_shutdown under the lock?)"
    );
}

#[test]
fn a_temporary_image_with_a_partial_owner_record_is_cleaned_up() {
    let ns = TestNs::new("partial");
    let m = metrics();
    let c = cluster();
    let vol = volume_in(&ns, "pvc-3");
    let opts = ImageOptions::new();
    // A kill -9 between two metadata writes: only the first key is there.
    let temp = format!("pvc-3{TEMP_SUFFIX}");
    rbd::create(&ns.ioctx, &temp, 4 << 20, &opts).unwrap();
    let img = Image::open(&ns.ioctx, &temp).unwrap();
    img.metadata_set("rbdkit.provisioner", "p.rbdkit.test")
        .unwrap();
    drop(img);
    assert_eq!(
        delete_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-3").unwrap(),
        Deleted::Removed
    );
    assert!(rbd::list_names(&ns.ioctx).unwrap().is_empty());

    // One whose partial record names another provisioner stays.
    rbd::create(&ns.ioctx, &temp, 4 << 20, &opts).unwrap();
    let img = Image::open(&ns.ioctx, &temp).unwrap();
    img.metadata_set("rbdkit.provisioner", "someone.else")
        .unwrap();
    drop(img);
    let e = delete_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-3").unwrap_err();
    assert!(matches!(e, VolumeError::NotOwned { .. }), "{e}");
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec![temp]);
}

/// A kill -9 inside librbd's `rbd_remove`, after it removed the image's id
/// object but before its directory entry: the name is still listed but no
/// longer opens. The delete retried after the restart must finish the
/// remove, not report the image gone (which leaked it, with its data, in
/// the chaos test); and an image in that state that is not ours stays.
#[test]
fn a_remove_cut_short_inside_librbd_is_finished_by_the_retry() {
    let ns = TestNs::new("cutshort");
    let m = metrics();
    let c = cluster();
    let vol = |image: &str| volume_in(&ns, image);
    let opts = ImageOptions::new();
    ensure_image(
        &c,
        &m,
        &NoFence,
        &vol("pvc-4"),
        4 << 20,
        &opts,
        &owner("pvc-4"),
    )
    .unwrap();
    // The state librbd's trash move leaves between its two steps.
    ns.ioctx.remove("rbd_id.pvc-4").unwrap();
    let e = Image::open_read_only(&ns.ioctx, "pvc-4").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec!["pvc-4"]);
    // CSI DeleteVolume finds its PV name through the header, by id.
    assert_eq!(
        recorded_pv_name(&c, &m, &vol("pvc-4"), "p.rbdkit.test").unwrap(),
        Some("pvc-4".to_owned())
    );
    assert_eq!(
        delete_image(&c, &m, &NoFence, &vol("pvc-4"), "p.rbdkit.test", "pvc-4").unwrap(),
        Deleted::Removed
    );
    assert!(rbd::list_names(&ns.ioctx).unwrap().is_empty());
    let left: Vec<String> = ns
        .ioctx
        .list_objects()
        .unwrap()
        .into_iter()
        .filter(|o| o.starts_with("rbd_header.") || o.starts_with("rbd_data."))
        .collect();
    assert!(left.is_empty(), "objects of the image left: {left:?}");
    // Nothing left to do: a second retry is a no-op.
    assert_eq!(
        delete_image(&c, &m, &NoFence, &vol("pvc-4"), "p.rbdkit.test", "pvc-4").unwrap(),
        Deleted::AlreadyGone
    );

    // Killed later, after the header went too: only the listing is left,
    // and a retry clears it rather than leaving the PV stuck.
    ensure_image(
        &c,
        &m,
        &NoFence,
        &vol("pvc-6"),
        4 << 20,
        &opts,
        &owner("pvc-6"),
    )
    .unwrap();
    let id = rbd::list(&ns.ioctx).unwrap().remove(0).id;
    ns.ioctx.remove(&format!("rbd_header.{id}")).unwrap();
    ns.ioctx.remove("rbd_id.pvc-6").unwrap();
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec!["pvc-6"]);
    delete_image(&c, &m, &NoFence, &vol("pvc-6"), "p.rbdkit.test", "pvc-6").unwrap();
    assert!(rbd::list_names(&ns.ioctx).unwrap().is_empty());

    // Someone else's image in the same state is left alone.
    rbd::create(&ns.ioctx, "pvc-5", 4 << 20, &opts).unwrap();
    ns.ioctx.remove("rbd_id.pvc-5").unwrap();
    let e = delete_image(&c, &m, &NoFence, &vol("pvc-5"), "p.rbdkit.test", "pvc-5").unwrap_err();
    assert!(matches!(e, VolumeError::NotOwned { .. }), "{e}");
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec!["pvc-5"]);
}

/// A kill -9 inside `rbd_rename` of the temporary image, between its two
/// writes: the final name's id object exists (so the final name opens) but
/// the directory still lists only the temporary name. A retried create must
/// finish the rename (its PV is made on the strength of it), and so must a
/// delete.
#[test]
fn a_rename_cut_short_inside_librbd_is_finished_by_the_retry() {
    let ns = TestNs::new("cutrename");
    let m = metrics();
    let c = cluster();
    let vol = volume_in(&ns, "pvc-6");
    let temp = format!("pvc-6{TEMP_SUFFIX}");
    let opts = ImageOptions::new();
    let cut_short = || {
        ensure_image(&c, &m, &NoFence, &vol, 4 << 20, &opts, &owner("pvc-6")).unwrap();
        // Back to the temporary name, then the first write of the rename.
        rbd::rename(&ns.ioctx, "pvc-6", &temp).unwrap();
        let id = ns.ioctx.read(&format!("rbd_id.{temp}"), 4096, 0).unwrap();
        ns.ioctx.write_full("rbd_id.pvc-6", &id).unwrap();
        Image::open_read_only(&ns.ioctx, "pvc-6").unwrap();
        assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec![temp.clone()]);
    };
    cut_short();
    assert_eq!(
        ensure_image(&c, &m, &NoFence, &vol, 4 << 20, &opts, &owner("pvc-6")).unwrap(),
        4 << 20
    );
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec!["pvc-6"]);

    assert_eq!(
        delete_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-6").unwrap(),
        Deleted::Removed
    );
    cut_short();
    assert_eq!(
        delete_image(&c, &m, &NoFence, &vol, "p.rbdkit.test", "pvc-6").unwrap(),
        Deleted::Removed
    );
    assert!(rbd::list_names(&ns.ioctx).unwrap().is_empty());
    let left: Vec<String> = ns
        .ioctx
        .list_objects()
        .unwrap()
        .into_iter()
        .filter(|o| o.starts_with("rbd_header.") || o.starts_with("rbd_id."))
        .collect();
    assert!(left.is_empty(), "objects of the image left: {left:?}");
}
