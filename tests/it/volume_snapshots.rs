//! Snapshots, restores and volume clones of the volume layer
//! (`rbdkit::volume::snapshot`) against the real test cluster: data,
//! idempotence, sizes, clone depth limits, sources deleted while their
//! clones live, and re-runs after a stop at every step.
use crate::support;

use rbdkit::rados::Cluster;
use rbdkit::rbd::{self, Features, Image, ImageOptions, SnapNamespaceType};
use rbdkit::volume::ops::{
    delete_image, ensure_image, owner_metadata, Deleted, Owner, VolumeError,
};
use rbdkit::volume::params::CloneDepth;
use rbdkit::volume::snapshot::{
    clone_depth, delete_snapshot, ensure_snapshot, ensure_volume_from_snapshot,
    ensure_volume_from_volume, flatten_volume, get_snapshot, list_snapshots, purge_orphans,
    CloneOptions, Flatten, SnapshotFilter, SnapshotOwner, META_SOURCE, SNAP_NAME,
};
use rbdkit::volume::{NoFence, NoMetrics, SnapshotId, VolumeId};
use support::ceph::{cluster, TestNs, POOL};
use support::data::pattern;

const MIB: u64 = 1 << 20;
const PROV: &str = "snap.rbdkit.test";

struct Env {
    ns: TestNs,
    c: Cluster,
}

impl Env {
    fn new(test: &str) -> Env {
        Env {
            ns: TestNs::new(test),
            c: cluster(),
        }
    }

    fn vol(&self, image: &str) -> VolumeId {
        VolumeId {
            cluster_id: "test".into(),
            pool: POOL.into(),
            rados_namespace: self.ns.name.clone(),
            image: image.into(),
        }
    }

    fn owner(&self, pv: &str) -> Owner {
        Owner {
            provisioner: PROV.into(),
            pv_name: pv.into(),
            pvc_namespace: "apps".into(),
            pvc_name: format!("claim-{pv}"),
            cluster_id: "test".into(),
        }
    }

    fn snap_owner(&self, name: &str) -> SnapshotOwner {
        SnapshotOwner {
            provisioner: PROV.into(),
            snapshot_name: name.into(),
            cluster_id: "test".into(),
            snapshot_namespace: "apps".into(),
            snapshot_object: format!("vs-{name}"),
        }
    }

    /// A volume of `mib` MiB holding `pattern(seed)` in its first MiB.
    fn volume(&self, name: &str, mib: u64, seed: u64) -> VolumeId {
        let vol = self.vol(name);
        let opts = ImageOptions::new().features(Features::LAYERING);
        ensure_image(
            &self.c,
            &NoMetrics,
            &NoFence,
            &vol,
            mib * MIB,
            &opts,
            &self.owner(name),
        )
        .unwrap();
        self.write(name, seed);
        vol
    }

    fn write(&self, name: &str, seed: u64) {
        let img = Image::open(&self.ns.ioctx, name).unwrap();
        img.write(0, &pattern(seed, MIB as usize)).unwrap();
        img.flush().unwrap();
        img.close().unwrap();
    }

    fn first_mib(&self, name: &str) -> Vec<u8> {
        let img = Image::open_read_only(&self.ns.ioctx, name).unwrap();
        let mut buf = vec![0u8; MIB as usize];
        img.read_exact(0, &mut buf).unwrap();
        buf
    }

    fn names(&self) -> Vec<String> {
        let mut v = rbd::list_names(&self.ns.ioctx).unwrap();
        v.sort();
        v
    }

    fn trash(&self) -> Vec<String> {
        let mut v: Vec<String> = rbd::trash_list(&self.ns.ioctx)
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        v.sort();
        v
    }

    /// User snapshots of `image` (temporary ones would show here; those in
    /// the trash namespace, kept for clones, do not).
    fn user_snaps(&self, image: &str) -> Vec<String> {
        let img = Image::open_read_only(&self.ns.ioctx, image).unwrap();
        img.snap_list()
            .unwrap()
            .into_iter()
            .filter(|s| img.snap_namespace_type(s.id).unwrap() == SnapNamespaceType::User)
            .map(|s| s.name)
            .collect()
    }

    fn depth(&self, image: &str) -> u32 {
        let img = Image::open_read_only(&self.ns.ioctx, image).unwrap();
        clone_depth(&self.c, &img).unwrap()
    }

    fn snapshot(&self, source: &VolumeId, image: &str, opts: &CloneOptions) -> SnapshotId {
        ensure_snapshot(
            &self.c,
            &NoMetrics,
            source,
            image,
            &self.snap_owner(image),
            opts,
        )
        .unwrap()
        .id
    }

    fn restore(&self, snap: &SnapshotId, name: &str, size: u64, opts: &CloneOptions) -> Flatten {
        ensure_volume_from_snapshot(
            &self.c,
            &NoMetrics,
            snap,
            &self.vol(name),
            size,
            &ImageOptions::new(),
            &self.owner(name),
            opts,
        )
        .unwrap()
        .flatten
    }

    fn clone_of(&self, source: &VolumeId, name: &str, size: u64, opts: &CloneOptions) -> Flatten {
        ensure_volume_from_volume(
            &self.c,
            &NoMetrics,
            source,
            &self.vol(name),
            size,
            &ImageOptions::new(),
            &self.owner(name),
            opts,
        )
        .unwrap()
        .flatten
    }

    fn delete(&self, name: &str) -> Deleted {
        delete_image(&self.c, &NoMetrics, &NoFence, &self.vol(name), PROV, name).unwrap()
    }
}

#[test]
fn snapshot_restore_and_clone_keep_the_data_and_are_idempotent() {
    let env = Env::new("vsnap");
    let opts = CloneOptions::default();
    let src = env.volume("pvc-src", 16, 1);

    let first = ensure_snapshot(
        &env.c,
        &NoMetrics,
        &src,
        "snap-a",
        &env.snap_owner("snap-a"),
        &opts,
    )
    .unwrap();
    assert!(first.ready);
    assert_eq!(first.size, 16 * MIB);
    assert_eq!(first.source_volume, src.handle());
    assert_eq!(first.id.snap, SNAP_NAME);
    let again = ensure_snapshot(
        &env.c,
        &NoMetrics,
        &src,
        "snap-a",
        &env.snap_owner("snap-a"),
        &opts,
    )
    .unwrap();
    assert_eq!(again, first);
    assert_eq!(env.names(), ["pvc-src", "snap-a"]);
    assert!(
        env.user_snaps("pvc-src").is_empty(),
        "temporary snapshot left"
    );
    let meta = owner_metadata(&Image::open_read_only(&env.ns.ioctx, "snap-a").unwrap()).unwrap();
    assert_eq!(meta["rbdkit.kind"], "snapshot");
    assert_eq!(meta[META_SOURCE], src.handle());
    assert_eq!(meta["rbdkit.volumesnapshot.name"], "vs-snap-a");

    // The source changes after the snapshot; the restore has the old data.
    env.write("pvc-src", 2);
    assert_eq!(
        env.restore(&first.id, "pvc-restored", 0, &opts),
        Flatten::NotNeeded
    );
    assert_eq!(
        env.restore(&first.id, "pvc-restored", 0, &opts),
        Flatten::NotNeeded
    );
    assert_eq!(env.first_mib("pvc-restored"), pattern(1, MIB as usize));
    let restored = Image::open_read_only(&env.ns.ioctx, "pvc-restored").unwrap();
    assert_eq!(restored.size().unwrap(), 16 * MIB);
    assert_eq!(
        owner_metadata(&restored).unwrap()["rbdkit.pv"],
        "pvc-restored"
    );
    drop(restored);
    assert_eq!(env.depth("pvc-restored"), 2);

    // A bigger restore and a bigger clone; the clone has the new data.
    env.restore(&first.id, "pvc-restored-big", 32 * MIB, &opts);
    assert_eq!(
        Image::open_read_only(&env.ns.ioctx, "pvc-restored-big")
            .unwrap()
            .size()
            .unwrap(),
        32 * MIB
    );
    assert_eq!(
        env.clone_of(&src, "pvc-clone", 48 * MIB, &opts),
        Flatten::NotNeeded
    );
    assert_eq!(
        Image::open_read_only(&env.ns.ioctx, "pvc-clone")
            .unwrap()
            .size()
            .unwrap(),
        48 * MIB
    );
    assert_eq!(env.first_mib("pvc-clone"), pattern(2, MIB as usize));
    assert!(
        env.user_snaps("pvc-src").is_empty(),
        "temporary snapshot left"
    );

    // Refusals: smaller, another source under a taken name, a missing
    // snapshot, another namespace, a snapshot id of a volume.
    let e = ensure_volume_from_volume(
        &env.c,
        &NoMetrics,
        &src,
        &env.vol("pvc-small"),
        8 * MIB,
        &ImageOptions::new(),
        &env.owner("pvc-small"),
        &opts,
    )
    .unwrap_err();
    assert!(matches!(e, VolumeError::ShrinkRefused { .. }), "{e}");
    let other = env.volume("pvc-other", 8, 3);
    let e = ensure_snapshot(
        &env.c,
        &NoMetrics,
        &other,
        "snap-a",
        &env.snap_owner("snap-a"),
        &opts,
    )
    .unwrap_err();
    assert!(matches!(e, VolumeError::Conflict { .. }), "{e}");
    let e = ensure_volume_from_volume(
        &env.c,
        &NoMetrics,
        &other,
        &env.vol("pvc-clone"),
        0,
        &ImageOptions::new(),
        &env.owner("pvc-clone"),
        &opts,
    )
    .unwrap_err();
    assert!(matches!(e, VolumeError::Conflict { .. }), "{e}");
    let missing = SnapshotId {
        image: "snap-none".into(),
        ..first.id.clone()
    };
    let e = ensure_volume_from_snapshot(
        &env.c,
        &NoMetrics,
        &missing,
        &env.vol("pvc-x"),
        0,
        &ImageOptions::new(),
        &env.owner("pvc-x"),
        &opts,
    )
    .unwrap_err();
    assert!(matches!(e, VolumeError::Missing { .. }), "{e}");
    let elsewhere = VolumeId {
        rados_namespace: "another-ns".into(),
        ..env.vol("pvc-x")
    };
    let e = ensure_volume_from_snapshot(
        &env.c,
        &NoMetrics,
        &first.id,
        &elsewhere,
        0,
        &ImageOptions::new(),
        &env.owner("pvc-x"),
        &opts,
    )
    .unwrap_err();
    assert!(matches!(e, VolumeError::Refused { .. }), "{e}");
    let not_a_snapshot = SnapshotId {
        image: "pvc-src".into(),
        ..first.id.clone()
    };
    let e = ensure_volume_from_snapshot(
        &env.c,
        &NoMetrics,
        &not_a_snapshot,
        &env.vol("pvc-x"),
        0,
        &ImageOptions::new(),
        &env.owner("pvc-x"),
        &opts,
    )
    .unwrap_err();
    assert!(matches!(e, VolumeError::NotOwned { .. }), "{e}");
    assert!(!env.names().contains(&"pvc-x".to_owned()));

    // Listing and lookup.
    let b = env.snapshot(&other, "snap-b", &opts);
    let all = list_snapshots(&env.c, &NoMetrics, &src, PROV, &SnapshotFilter::default()).unwrap();
    let ids: Vec<_> = all.iter().map(|s| s.id.clone()).collect();
    assert_eq!(ids, [first.id.clone(), b.clone()]);
    let of_other = SnapshotFilter {
        source_volume: Some(other.handle()),
        snapshot: None,
    };
    let found = list_snapshots(&env.c, &NoMetrics, &src, PROV, &of_other).unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].id, b);
    let one = SnapshotFilter {
        source_volume: None,
        snapshot: Some(missing.clone()),
    };
    assert!(list_snapshots(&env.c, &NoMetrics, &src, PROV, &one)
        .unwrap()
        .is_empty());
    assert!(get_snapshot(&env.c, &NoMetrics, &b, PROV)
        .unwrap()
        .is_some());
    assert!(get_snapshot(&env.c, &NoMetrics, &missing, PROV)
        .unwrap()
        .is_none());

    // Delete everything; deletes are idempotent; nothing is left.
    for id in [&first.id, &b] {
        assert_ne!(
            delete_snapshot(&env.c, &NoMetrics, id, PROV).unwrap(),
            Deleted::AlreadyGone
        );
        // Kept in the trash for the restores, or gone: either way done.
        assert!(matches!(
            delete_snapshot(&env.c, &NoMetrics, id, PROV).unwrap(),
            Deleted::AlreadyGone | Deleted::Trashed
        ));
    }
    for name in [
        "pvc-restored",
        "pvc-restored-big",
        "pvc-clone",
        "pvc-src",
        "pvc-other",
    ] {
        env.delete(name);
    }
    assert!(env.names().is_empty(), "{:?}", env.names());
    assert!(env.trash().is_empty(), "{:?}", env.trash());
}

#[test]
fn a_source_with_live_clones_goes_to_the_trash_and_is_purged_with_the_last() {
    let env = Env::new("vtrash");
    let opts = CloneOptions::default();
    let src = env.volume("pvc-src", 8, 5);
    let snap = env.snapshot(&src, "snap-1", &opts);
    env.restore(&snap, "pvc-r", 0, &opts);
    env.clone_of(&src, "pvc-c", 0, &opts);

    // The source goes while its snapshot and clone live.
    assert_eq!(env.delete("pvc-src"), Deleted::Trashed);
    assert_eq!(
        env.delete("pvc-src"),
        Deleted::Trashed,
        "a retry is fine too"
    );
    assert_eq!(env.names(), ["pvc-c", "pvc-r", "snap-1"]);
    assert_eq!(env.trash(), ["pvc-src"]);
    // Its clones still read its data.
    assert_eq!(env.first_mib("pvc-c"), pattern(5, MIB as usize));
    assert_eq!(env.first_mib("pvc-r"), pattern(5, MIB as usize));
    // A restore from the snapshot still works.
    env.restore(&snap, "pvc-r2", 0, &opts);
    assert_eq!(env.first_mib("pvc-r2"), pattern(5, MIB as usize));

    // The snapshot goes while its restores live.
    assert_eq!(
        delete_snapshot(&env.c, &NoMetrics, &snap, PROV).unwrap(),
        Deleted::Trashed
    );
    assert_eq!(env.trash(), ["pvc-src", "snap-1"]);
    // Flattening one restore and deleting the other frees the snapshot
    // image, but the source still has pvc-c.
    assert!(flatten_volume(
        &env.c,
        &NoMetrics,
        &env.vol("pvc-r2"),
        PROV,
        std::time::Instant::now() + std::time::Duration::from_secs(60)
    )
    .unwrap());
    assert_eq!(env.first_mib("pvc-r2"), pattern(5, MIB as usize));
    assert_eq!(env.delete("pvc-r"), Deleted::Removed);
    assert_eq!(env.trash(), ["pvc-src"]);
    // The last clone goes: the source is purged.
    assert_eq!(env.delete("pvc-c"), Deleted::Removed);
    assert!(env.trash().is_empty(), "{:?}", env.trash());
    assert_eq!(env.names(), ["pvc-r2"]);
    assert_eq!(purge_orphans(&env.c, &NoMetrics, &src, PROV).unwrap(), 0);
    env.delete("pvc-r2");
    assert!(env.names().is_empty());
}

#[test]
fn clone_chains_are_flattened_past_the_limits() {
    let env = Env::new("vdepth");
    let opts = CloneOptions {
        depth: CloneDepth { soft: 2, hard: 3 },
        ..Default::default()
    };
    let src = env.volume("pvc-0", 8, 7);
    let mut prev = src.clone();
    let mut outcomes = Vec::new();
    for i in 1..=4 {
        let name = format!("pvc-{i}");
        outcomes.push(env.clone_of(&prev, &name, 0, &opts));
        prev = env.vol(&name);
    }
    assert_eq!(
        outcomes,
        [
            Flatten::NotNeeded,
            Flatten::NotNeeded,
            Flatten::Background,
            Flatten::Done
        ]
    );
    assert_eq!(
        [1, 2, 3, 4].map(|i| env.depth(&format!("pvc-{i}"))),
        [1, 2, 3, 0]
    );
    assert_eq!(env.first_mib("pvc-4"), pattern(7, MIB as usize));
    // The background flatten, in bounded rounds.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    assert!(flatten_volume(&env.c, &NoMetrics, &env.vol("pvc-3"), PROV, deadline).unwrap());
    assert_eq!(env.depth("pvc-3"), 0);
    assert_eq!(env.first_mib("pvc-3"), pattern(7, MIB as usize));

    // Snapshots: a snapshot image past the soft limit is flattened before
    // its snapshot is taken, so restores stay within the limits.
    let s2 = env.snapshot(&env.vol("pvc-2"), "snap-2", &opts);
    assert_eq!(env.depth("snap-2"), 0);
    env.restore(&s2, "pvc-from-2", 0, &opts);
    assert_eq!(env.depth("pvc-from-2"), 1);
    assert_eq!(env.first_mib("pvc-from-2"), pattern(7, MIB as usize));

    // Everything deletes cleanly, children first or not.
    delete_snapshot(&env.c, &NoMetrics, &s2, PROV).unwrap();
    for i in 0..=4 {
        env.delete(&format!("pvc-{i}"));
    }
    env.delete("pvc-from-2");
    assert!(env.names().is_empty(), "{:?}", env.names());
    assert!(env.trash().is_empty(), "{:?}", env.trash());
}

#[test]
fn a_rerun_after_a_stop_at_any_step_leaves_exactly_one_and_no_leak() {
    let env = Env::new("vcrash");
    let src = env.volume("pvc-src", 8, 9);
    let stop = |n: u32| CloneOptions {
        stop_after: Some(n),
        ..Default::default()
    };
    let ok = CloneOptions::default();
    let leftovers = |env: &Env, keep: &[&str]| {
        let mut want: Vec<String> = keep.iter().map(|s| s.to_string()).collect();
        want.sort();
        assert_eq!(env.names(), want);
        assert!(
            env.user_snaps("pvc-src").is_empty(),
            "temporary snapshot left: {:?} (keeping {keep:?})",
            env.user_snaps("pvc-src")
        );
        assert!(env.trash().is_empty(), "{:?}", env.trash());
    };

    for step in 1..=7 {
        let name = format!("snap-{step}");
        let e = ensure_snapshot(
            &env.c,
            &NoMetrics,
            &src,
            &name,
            &env.snap_owner(&name),
            &stop(step),
        )
        .unwrap_err();
        assert!(e.to_string().contains("test hook"), "{e}");
        let info =
            ensure_snapshot(&env.c, &NoMetrics, &src, &name, &env.snap_owner(&name), &ok).unwrap();
        assert!(info.ready, "step {step}");
        leftovers(&env, &["pvc-src", &name]);
        env.restore(&info.id, "pvc-check", 0, &ok);
        assert_eq!(
            env.first_mib("pvc-check"),
            pattern(9, MIB as usize),
            "step {step}"
        );
        env.delete("pvc-check");
        delete_snapshot(&env.c, &NoMetrics, &info.id, PROV).unwrap();
        leftovers(&env, &["pvc-src"]);
    }
    // Given up after a stop instead of re-run: the delete cleans up.
    for step in 1..=6 {
        let name = format!("snap-gone-{step}");
        ensure_snapshot(
            &env.c,
            &NoMetrics,
            &src,
            &name,
            &env.snap_owner(&name),
            &stop(step),
        )
        .unwrap_err();
        let id = SnapshotId {
            cluster_id: "test".into(),
            pool: POOL.into(),
            rados_namespace: env.ns.name.clone(),
            image: name.clone(),
            snap: SNAP_NAME.into(),
        };
        delete_snapshot(&env.c, &NoMetrics, &id, PROV).unwrap();
        if step < 3 {
            // Before step 3 no image names the source yet, so the delete
            // cannot find the temporary snapshot; the garbage collector
            // finds it by its name.
            assert_eq!(
                env.user_snaps("pvc-src"),
                [format!("rbdkit-tmp-{name}")],
                "step {step}"
            );
            assert_eq!(purge_orphans(&env.c, &NoMetrics, &src, PROV).unwrap(), 1);
        }
        leftovers(&env, &["pvc-src"]);
    }

    let snap = env.snapshot(&src, "snap-base", &ok);
    for step in 1..=6 {
        let name = format!("pvc-clone-{step}");
        let e = ensure_volume_from_volume(
            &env.c,
            &NoMetrics,
            &src,
            &env.vol(&name),
            16 * MIB,
            &ImageOptions::new(),
            &env.owner(&name),
            &stop(step),
        )
        .unwrap_err();
        assert!(e.to_string().contains("test hook"), "{e}");
        env.clone_of(&src, &name, 16 * MIB, &ok);
        assert_eq!(
            Image::open_read_only(&env.ns.ioctx, &name)
                .unwrap()
                .size()
                .unwrap(),
            16 * MIB
        );
        assert_eq!(env.first_mib(&name), pattern(9, MIB as usize));
        leftovers(&env, &["pvc-src", "snap-base", &name]);
        env.delete(&name);

        let name = format!("pvc-restore-{step}");
        let e = ensure_volume_from_snapshot(
            &env.c,
            &NoMetrics,
            &snap,
            &env.vol(&name),
            0,
            &ImageOptions::new(),
            &env.owner(&name),
            &stop(step),
        )
        .unwrap_err();
        assert!(e.to_string().contains("test hook"), "{e}");
        env.restore(&snap, &name, 0, &ok);
        assert_eq!(env.first_mib(&name), pattern(9, MIB as usize));
        leftovers(&env, &["pvc-src", "snap-base", &name]);
        // Given up instead: the delete of the volume cleans the temporary
        // image too.
        env.delete(&name);
        let name = format!("pvc-abandoned-{step}");
        let _ = ensure_volume_from_snapshot(
            &env.c,
            &NoMetrics,
            &snap,
            &env.vol(&name),
            0,
            &ImageOptions::new(),
            &env.owner(&name),
            &stop(step),
        );
        env.delete(&name);
        leftovers(&env, &["pvc-src", "snap-base"]);
    }
    delete_snapshot(&env.c, &NoMetrics, &snap, PROV).unwrap();
    env.delete("pvc-src");
    assert!(env.names().is_empty());
    assert!(env.trash().is_empty());
}
