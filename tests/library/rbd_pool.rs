//! Pool-level RBD against a real cluster: pool metadata, usage stats,
//! config, groups and live migration.

use crate::support;

use rbdkit::rbd::{self, ConfigSource, Features, Image, ImageOptions, MigrationState};
use rbdkit::ErrorKind;
use support::ceph::{cluster, unique, TestNs};

const MIB: u64 = 1 << 20;

#[test]
fn pool_metadata_stats_and_config() {
    // Pool metadata is pool-wide, so this test has a pool of its own.
    let c = cluster();
    let pool = unique("metapool");
    c.pool_create(&pool).unwrap();
    let pio = c.ioctx(&pool).unwrap();
    rbd::pool_init(&pio, false).unwrap();
    rbd::pool_metadata_set(&pio, "conf_rbd_cache", "false").unwrap();
    assert_eq!(
        rbd::pool_metadata_get(&pio, "conf_rbd_cache").unwrap(),
        "false"
    );
    let cfg = rbd::config_pool_list(&pio).unwrap();
    let cache = cfg
        .iter()
        .find(|o| o.name == "rbd_cache")
        .expect("rbd_cache listed");
    assert_eq!(cache.value, "false");
    assert_eq!(cache.source, ConfigSource::Pool);

    let ns = pio.with_namespace("n").unwrap();
    rbd::namespace_create(&pio, "n").unwrap();
    rbd::create(&ns, "a", 8 * MIB, &ImageOptions::new()).unwrap();
    rbd::create(&ns, "b", 4 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns, "a").unwrap();
    img.snap_create("s").unwrap();
    let icfg = img.config_list().unwrap();
    assert_eq!(
        icfg.iter().find(|o| o.name == "rbd_cache").unwrap().value,
        "false",
        "image inherits the pool's value"
    );
    drop(img);
    let stats = rbd::pool_stats(&ns).unwrap();
    assert_eq!(stats.images, 2);
    assert_eq!(stats.image_provisioned_bytes, 12 * MIB);
    assert_eq!(stats.image_snapshots, 1);
    assert_eq!(stats.trash_images, 0);

    rbd::pool_metadata_remove(&pio, "conf_rbd_cache").unwrap();
    let e = rbd::pool_metadata_get(&pio, "conf_rbd_cache").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    drop((ns, pio));
    c.pool_delete(&pool).unwrap();
}

#[test]
fn groups_snapshot_their_images_together() {
    let ns = TestNs::new("group");
    rbd::group_create(&ns.ioctx, "g").unwrap();
    assert_eq!(rbd::group_list(&ns.ioctx).unwrap(), vec!["g"]);
    for n in ["x", "y"] {
        rbd::create(
            &ns.ioctx,
            n,
            4 * MIB,
            &ImageOptions::new().features(Features::LAYERING),
        )
        .unwrap();
        rbd::group_image_add(&ns.ioctx, "g", &ns.ioctx, n).unwrap();
    }
    let imgs = rbd::group_image_list(&ns.ioctx, "g").unwrap();
    let mut names: Vec<_> = imgs.iter().map(|i| i.name.clone()).collect();
    names.sort();
    assert_eq!(names, ["x", "y"]);
    assert!(imgs
        .iter()
        .all(|i| i.attached && i.pool_id == ns.ioctx.pool_id()));

    let x = Image::open(&ns.ioctx, "x").unwrap();
    x.write(0, b"before").unwrap();
    rbd::group_snap_create(&ns.ioctx, "g", "gs").unwrap();
    let snaps = rbd::group_snap_list(&ns.ioctx, "g").unwrap();
    assert_eq!(snaps.len(), 1);
    assert_eq!(snaps[0].name, "gs");
    assert!(snaps[0].complete);
    x.write(0, b"after!").unwrap();
    drop(x);
    rbd::group_snap_rollback(&ns.ioctx, "g", "gs").unwrap();
    let mut buf = [0u8; 6];
    Image::open(&ns.ioctx, "x")
        .unwrap()
        .read_exact(0, &mut buf)
        .unwrap();
    assert_eq!(&buf, b"before");

    rbd::group_snap_remove(&ns.ioctx, "g", "gs").unwrap();
    assert!(rbd::group_snap_list(&ns.ioctx, "g").unwrap().is_empty());
    rbd::group_image_remove(&ns.ioctx, "g", &ns.ioctx, "x").unwrap();
    assert_eq!(rbd::group_image_list(&ns.ioctx, "g").unwrap().len(), 1);
    rbd::group_rename(&ns.ioctx, "g", "g2").unwrap();
    rbd::group_image_remove(&ns.ioctx, "g2", &ns.ioctx, "y").unwrap();
    rbd::group_remove(&ns.ioctx, "g2").unwrap();
    assert!(rbd::group_list(&ns.ioctx).unwrap().is_empty());
    let e = rbd::group_snap_create(&ns.ioctx, "g2", "late").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
}

#[test]
fn live_migration_prepare_execute_commit() {
    let src = TestNs::new("migsrc");
    let dst = TestNs::new("migdst");
    rbd::create(
        &src.ioctx,
        "m",
        8 * MIB,
        &ImageOptions::new().features(Features::LAYERING),
    )
    .unwrap();
    Image::open(&src.ioctx, "m")
        .unwrap()
        .write(3 * MIB, b"moving data")
        .unwrap();
    // Pacific refuses a new object size here (EINVAL), so the move changes
    // namespace and features.
    let opts = ImageOptions::new().features(Features::LAYERING | Features::EXCLUSIVE_LOCK);
    rbd::migration_prepare(&src.ioctx, "m", &dst.ioctx, "m2", &opts).unwrap();
    let st = rbd::migration_status(&dst.ioctx, "m2").unwrap();
    assert_eq!(st.state, MigrationState::Prepared);
    assert_eq!(st.source_image, "m");
    assert_eq!(st.dest_image, "m2");
    assert_eq!(st.source_namespace, src.name);
    assert_eq!(st.dest_namespace, dst.name);
    rbd::migration_execute(&dst.ioctx, "m2").unwrap();
    assert_eq!(
        rbd::migration_status(&dst.ioctx, "m2").unwrap().state,
        MigrationState::Executed
    );
    rbd::migration_commit(&dst.ioctx, "m2").unwrap();
    let m2 = Image::open(&dst.ioctx, "m2").unwrap();
    assert!(m2.features().unwrap().contains(Features::EXCLUSIVE_LOCK));
    let mut buf = [0u8; 11];
    m2.read_exact(3 * MIB, &mut buf).unwrap();
    assert_eq!(&buf, b"moving data");
    assert!(
        rbd::list(&src.ioctx).unwrap().is_empty(),
        "source gone after commit"
    );
}

#[test]
fn migration_abort_restores_the_source() {
    let ns = TestNs::new("migabort");
    rbd::create(&ns.ioctx, "keep", 4 * MIB, &ImageOptions::new()).unwrap();
    rbd::migration_prepare(&ns.ioctx, "keep", &ns.ioctx, "target", &ImageOptions::new()).unwrap();
    rbd::migration_abort(&ns.ioctx, "target").unwrap();
    assert_eq!(rbd::list_names(&ns.ioctx).unwrap(), vec!["keep"]);
    assert_eq!(
        rbd::migration_status(&ns.ioctx, "keep").unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}
