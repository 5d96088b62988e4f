//! Least privilege: the e2e provisioner runs as a cephx user with only
//! `profile rbd` on the test pool. A StorageClass pointing at another pool
//! fails with a permission error that names the pool and the cluster (and
//! no key), and nothing is created there.
use crate::support;

use serde_json::json;

use rbdkit::rbd;

use support::ceph::{self, OTHER_POOL};
use support::provisioner::{stays, Env};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_on_another_pool_fails_with_a_permission_error() {
    ceph::other_pool();
    let mut env = Env::new("caps").await;
    let own = env.storage_class("own", json!({}), json!({})).await;
    let other = env
        .storage_class("other", json!({"pool": OTHER_POOL}), json!({}))
        .await;
    let provisioner = env.start_in_process();

    // Its own pool works with the restricted user.
    env.claim("ok", &own, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_bound("ok").await;

    env.claim("denied", &other, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let event = env
        .wait_event(
            "denied",
            "ProvisioningFailed",
            &[
                "ermission",
                &format!("pool {OTHER_POOL}"),
                &format!("cluster {}", env.cluster_id),
                "profile rbd",
            ],
        )
        .await;
    let note = event.note.unwrap_or_default();
    for key in [
        ceph::TestCluster::get().admin_key(),
        ceph::provisioner_key(),
        ceph::node_key(),
    ] {
        assert!(!note.contains(&key), "a key in the event: {note}");
    }
    eprintln!("event: {note}");

    // Nothing in the other pool, and the claim stays Pending.
    let io = ceph::cluster()
        .ioctx_ns(OTHER_POOL, &env.rbd.name)
        .expect("ioctx");
    let images = rbd::list_names(&io).unwrap_or_default();
    assert!(images.is_empty(), "{images:?}");
    stays(
        "the claim Pending",
        std::time::Duration::from_secs(2),
        || async {
            let c = env
                .claims()
                .get("denied")
                .await
                .map_err(|e| e.to_string())?;
            match c.status.and_then(|s| s.phase).as_deref() {
                Some("Pending") => Ok(()),
                p => Err(format!("phase {p:?}")),
            }
        },
    )
    .await;
    provisioner.stop().await;

    // The node user can do what staging does on its pool's images (open
    // read-write, take the exclusive lock, write, read), and nothing on the
    // other pool.
    let (_, pv) = env.wait_bound("ok").await;
    let handle = pv.spec.unwrap().csi.unwrap().volume_handle;
    let image = rbdkit::volume::VolumeId::parse(&handle).unwrap().image;
    let mons = ceph::TestCluster::get().conf_value("mon host").unwrap();
    let ns = env.rbd.name.clone();
    tokio::task::spawn_blocking(move || {
        let node = rbdkit::rados::ConnectOptions::new()
            .no_conf_file()
            .mon_host(mons)
            .user(ceph::NODE_USER)
            .key(rbdkit::rados::Secret::new(ceph::node_key()))
            .connect_timeout(std::time::Duration::from_secs(30))
            .op_timeout(std::time::Duration::from_secs(30))
            .connect()
            .expect("connect as the node user");
        let io = node.ioctx_ns(ceph::POOL, &ns).unwrap();
        let img = rbd::Image::open(&io, &image).expect("open read-write as the node user");
        img.lock_acquire(rbd::LockMode::Exclusive)
            .expect("exclusive lock as the node user");
        img.write(0, &[7u8; 4096]).expect("write as the node user");
        let mut back = [0u8; 4096];
        img.read_exact(0, &mut back).unwrap();
        assert_eq!(back, [7u8; 4096]);
        img.close().unwrap();
        let other = node.ioctx_ns(OTHER_POOL, &ns).unwrap();
        let e = rbd::list_names(&other).expect_err("the node user may not list the other pool");
        assert_eq!(e.kind(), rbdkit::ErrorKind::PermissionDenied, "{e}");
    })
    .await
    .unwrap();
}
