//! Claims with a data source against a real control plane and a real Ceph
//! cluster: PVC clones (data, a bigger size, depth limits, the source
//! deleted while its clone lives, refusals), and a kill -9 loop during a
//! clone; restores from a VolumeSnapshot, waiting until it is ready.
use crate::support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::PostParams;
use serde_json::{json, Value};

use rbdkit::provisioner::controller::PV_FLATTEN_ANNOTATION;
use rbdkit::provisioner::source::CLONE_FINALIZER;
use rbdkit::rbd::{self, Image};
use rbdkit::volume::quantity::MIB;

use support::data::pattern;
use support::k8s::ControlPlane;
use support::provisioner::{claim_name, eventually, from_json, stays, storage, Env, WAIT};
use support::snapshots::{self as snaps, SnapshotController};

const BLOCK: &str = "Block";
const RWO: &[&str] = &["ReadWriteOnce"];

/// Creates a Block claim with data source `source` (a `dataSource` or
/// `dataSourceRef` object, as `field` says).
async fn claim_from(env: &Env, name: &str, class: &str, size: &str, field: &str, source: Value) {
    env.claims()
        .create(
            &PostParams::default(),
            &from_json::<PersistentVolumeClaim>(json!({
                "metadata": {"name": name},
                "spec": {
                    "storageClassName": class,
                    "accessModes": RWO,
                    "volumeMode": BLOCK,
                    "resources": {"requests": {"storage": size}},
                    field: source,
                },
            })),
        )
        .await
        .unwrap_or_else(|e| panic!("create claim {name}: {e}"));
}

/// Creates a claim cloned from claim `source`.
async fn clone_claim(env: &Env, name: &str, class: &str, size: &str, source: &str) {
    let ds = json!({"kind": "PersistentVolumeClaim", "name": source});
    claim_from(env, name, class, size, "dataSource", ds).await;
}

/// A Bound claim of `mib` MiB holding `pattern(seed)` in its first MiB;
/// returns its image name.
async fn source_with_data(env: &Env, name: &str, class: &str, mib: u64, seed: u64) -> String {
    env.claim(name, class, &format!("{mib}Mi"), RWO, BLOCK)
        .await;
    let (_, pv) = env.wait_bound(name).await;
    let image = pv.metadata.name.unwrap();
    let img = Image::open(&env.rbd.ioctx, &image).expect("open source image");
    img.write(0, &pattern(seed, MIB as usize))
        .expect("write pattern");
    img.flush().expect("flush");
    drop(img);
    image
}

fn first_mib(env: &Env, image: &str) -> Vec<u8> {
    let img = Image::open_read_only(&env.rbd.ioctx, image)
        .unwrap_or_else(|e| panic!("open {image}: {e}"));
    let mut buf = vec![0u8; MIB as usize];
    img.read_exact(0, &mut buf).expect("read");
    buf
}

fn size_of(env: &Env, image: &str) -> u64 {
    Image::open_read_only(&env.rbd.ioctx, image)
        .and_then(|i| i.size())
        .unwrap_or_else(|e| panic!("image {image}: {e}"))
}

fn has_parent(env: &Env, image: &str) -> bool {
    Image::open_read_only(&env.rbd.ioctx, image)
        .and_then(|i| i.parent())
        .unwrap_or_else(|e| panic!("image {image}: {e}"))
        .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_has_the_data_a_bigger_size_and_outlives_its_source() {
    let mut env = Env::new("clone").await;
    let class = env.storage_class("clone", json!({}), json!({})).await;
    let provisioner = env.start_in_process();
    let src = source_with_data(&env, "src", &class, 8, 11).await;

    let t0 = Instant::now();
    clone_claim(&env, "copy", &class, "16Mi", "src").await;
    let (claim, pv) = env.wait_bound("copy").await;
    eprintln!("clone claim create -> Bound took {:?}", t0.elapsed());
    let copy = pv.metadata.name.clone().unwrap();
    assert_eq!(storage(&pv.spec.as_ref().unwrap().capacity), "16Mi");
    assert_eq!(storage(&claim.status.as_ref().unwrap().capacity), "16Mi");
    assert_eq!(size_of(&env, &copy), 16 * MIB);
    assert_eq!(first_mib(&env, &copy), pattern(11, MIB as usize));
    assert!(has_parent(&env, &copy), "a clone, not a copy");
    let owner =
        rbdkit::volume::ops::owner_metadata(&Image::open_read_only(&env.rbd.ioctx, &copy).unwrap())
            .unwrap();
    assert_eq!(owner["rbdkit.pv"], copy);
    assert_eq!(owner["rbdkit.pvc.name"], "copy");
    // No temporary snapshot or image left; the source is let go of.
    assert!(
        env.user_snaps(&src).is_empty(),
        "{:?}",
        env.user_snaps(&src)
    );
    let mut images = env.images();
    images.sort();
    let mut want = vec![src.clone(), copy.clone()];
    want.sort();
    assert_eq!(images, want);
    eventually(
        "the source claim to lose the clone finalizer",
        WAIT,
        || async {
            let f = env.claim_finalizers("src").await;
            if f.iter().any(|f| f == CLONE_FINALIZER) {
                Err(format!("{f:?}"))
            } else {
                Ok(())
            }
        },
    )
    .await;
    env.wait_event("copy", "ProvisioningSucceeded", &[&copy])
        .await;

    // Smaller than its source: refused, nothing made.
    clone_claim(&env, "small", &class, "4Mi", "src").await;
    env.wait_event(
        "small",
        "ProvisioningFailed",
        &["smaller than its source", "\"src\""],
    )
    .await;
    // A source that does not exist: refused.
    clone_claim(&env, "orphan", &class, "8Mi", "nope").await;
    env.wait_event(
        "orphan",
        "ProvisioningFailed",
        &["source claim \"nope\"", "does not exist"],
    )
    .await;
    assert_eq!(env.images().len(), 2, "{:?}", env.images());

    // The source goes while its clone lives: its image waits in the trash,
    // the clone stays readable.
    env.delete_claim("small").await;
    env.delete_claim("orphan").await;
    let src_pv = src.clone();
    env.delete_claim("src").await;
    env.wait_gone(&env.pvs(), &src_pv).await;
    assert_eq!(env.images(), vec![copy.clone()]);
    assert_eq!(env.trash(), vec![src.clone()]);
    assert_eq!(first_mib(&env, &copy), pattern(11, MIB as usize));

    // The clone goes: the trashed source is purged with it.
    env.delete_claim("copy").await;
    env.wait_gone(&env.pvs(), &copy).await;
    eventually("images and trash empty", WAIT, || async {
        let (i, t) = (env.images(), env.trash());
        if i.is_empty() && t.is_empty() {
            Ok(())
        } else {
            Err(format!("images {i:?}, trash {t:?}"))
        }
    })
    .await;
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_in_another_pool_is_refused_with_both_named() {
    support::ceph::other_pool();
    let mut env = Env::new("clonepool").await;
    let class = env.storage_class("here", json!({}), json!({})).await;
    let other = env
        .storage_class(
            "there",
            json!({"pool": support::ceph::OTHER_POOL}),
            json!({}),
        )
        .await;
    let provisioner = env.start_in_process();
    source_with_data(&env, "src", &class, 8, 3).await;
    clone_claim(&env, "elsewhere", &other, "8Mi", "src").await;
    env.wait_event(
        "elsewhere",
        "ProvisioningFailed",
        &[
            "pool \"rbd\"",
            "pool \"rbd-other\"",
            &other,
            "claim \"src\"",
        ],
    )
    .await;
    stays("no clone made", Duration::from_secs(2), || async {
        let n = env.images().len();
        let f = env.claim_finalizers("src").await;
        if n == 1 && !f.iter().any(|f| f == CLONE_FINALIZER) {
            Ok(())
        } else {
            Err(format!("{n} images, source finalizers {f:?}"))
        }
    })
    .await;
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_chains_are_flattened_now_past_the_hard_limit_and_later_past_the_soft_one() {
    let mut env = Env::new("clonedepth").await;
    let class = env
        .storage_class(
            "depth",
            json!({"rbdSoftMaxCloneDepth": "1", "rbdHardMaxCloneDepth": "2"}),
            json!({}),
        )
        .await;
    // No maintenance pass in this run, so the background flatten is seen
    // to wait for the restart.
    let provisioner = env.start_in_process_with(&[("--maintenance-delay", "1h")]);
    let c0 = source_with_data(&env, "c0", &class, 8, 21).await;
    let mut images = vec![c0];
    for i in 1..=3 {
        clone_claim(
            &env,
            &format!("c{i}"),
            &class,
            "8Mi",
            &format!("c{}", i - 1),
        )
        .await;
        let (_, pv) = env.wait_bound(&format!("c{i}")).await;
        images.push(pv.metadata.name.clone().unwrap());
        let flagged = pv
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(PV_FLATTEN_ANNOTATION));
        // Depth 1: within the soft limit; 2: past it; 3: past the hard one
        // (flattened before the PV was made).
        assert_eq!(flagged, i == 2, "c{i}: flatten annotation {flagged}");
    }
    assert!(has_parent(&env, &images[1]));
    assert!(has_parent(&env, &images[2]), "c2 flattened too early");
    assert!(
        !has_parent(&env, &images[3]),
        "c3 past the hard limit not flattened"
    );
    assert_eq!(first_mib(&env, &images[3]), pattern(21, MIB as usize));
    provisioner.stop().await;

    // A restarted provisioner finds the pending flatten and does it.
    let provisioner = env.start_in_process_with(&[("--maintenance-delay", "1s")]);
    let c2_pv = images[2].clone();
    eventually(
        "c2 flattened by the restarted provisioner",
        WAIT,
        || async {
            let pv = env.pvs().get(&c2_pv).await.map_err(|e| e.to_string())?;
            let flagged = pv
                .metadata
                .annotations
                .is_some_and(|a| a.contains_key(PV_FLATTEN_ANNOTATION));
            if !flagged && !has_parent(&env, &c2_pv) {
                Ok(())
            } else {
                Err(format!(
                    "annotation {flagged}, parent {}",
                    has_parent(&env, &c2_pv)
                ))
            }
        },
    )
    .await;
    for (i, image) in images.iter().enumerate() {
        assert_eq!(first_mib(&env, image), pattern(21, MIB as usize), "c{i}");
    }
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_during_a_clone_and_restarted_leaves_one_clone_and_no_leak() {
    let mut env = Env::new("clonecrash").await;
    let class = env.storage_class("crash", json!({}), json!({})).await;
    let mut p = env.start_process("clonecrash");
    let src = source_with_data(&env, "src", &class, 64, 31).await;
    clone_claim(&env, "copy", &class, "96Mi", "src").await;

    // Round 0 kills at the first sign of the clone (a temporary snapshot
    // on the source, or a second image); the later rounds at growing
    // delays after the restarted replica starts leading. Restarts keep the
    // identity so the lease is taken back at once.
    let mut stages = Vec::new();
    for round in 0..5u64 {
        let seen = if round == 0 {
            let ioctx = env.rbd.ioctx.clone();
            let src_c = src.clone();
            tokio::task::spawn_blocking(move || {
                let deadline = Instant::now() + WAIT;
                while Instant::now() < deadline {
                    let names = rbd::list_names(&ioctx).unwrap_or_default();
                    let snaps = Image::open_read_only(&ioctx, &src_c)
                        .and_then(|i| i.snap_list())
                        .map(|s| s.len())
                        .unwrap_or(0);
                    if names.len() > 1 || snaps > 0 {
                        return format!("images {names:?}, source snapshots {snaps}");
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                "nothing seen".to_owned()
            })
            .await
            .unwrap()
        } else {
            eventually("the restarted replica to lead", WAIT, || async {
                if p.log_text().contains("starting controllers") {
                    Ok(())
                } else {
                    Err(p.log_tail())
                }
            })
            .await;
            tokio::time::sleep(Duration::from_millis((round - 1) * 150)).await;
            format!(
                "images {:?}, source snapshots {:?}",
                env.images(),
                env.user_snaps(&src)
            )
        };
        p.kill9();
        let phase = env.claim_phase("copy").await;
        stages.push(format!("round {round}: {seen}; claim {phase}"));
        p = env.start_process("clonecrash");
    }
    eprintln!("kills: {stages:#?}");
    let (_, pv) = env.wait_bound("copy").await;
    let copy = pv.metadata.name.unwrap();
    let clean = || async {
        let mut images = env.images();
        images.sort();
        let mut want = vec![src.clone(), copy.clone()];
        want.sort();
        let snaps = env.user_snaps(&src);
        let t = env.trash();
        let f = env.claim_finalizers("src").await;
        if images == want
            && snaps.is_empty()
            && t.is_empty()
            && !f.iter().any(|f| f == CLONE_FINALIZER)
        {
            Ok(())
        } else {
            Err(format!("images {images:?}, source snapshots {snaps:?}, trash {t:?}, source finalizers {f:?}"))
        }
    };
    eventually("exactly one clone and no leftovers", WAIT, clean).await;
    stays("still exactly one clone", Duration::from_secs(2), clean).await;
    assert_eq!(size_of(&env, &copy), 96 * MIB);
    assert_eq!(first_mib(&env, &copy), pattern(31, MIB as usize));
    let ours = env
        .our_pvs()
        .await
        .unwrap()
        .iter()
        .filter(|p| claim_name(p) == Some("copy"))
        .count();
    assert_eq!(ours, 1);
    drop(p);
}

/// Creates a claim restored from VolumeSnapshot `snapshot`.
async fn restore_claim(env: &Env, name: &str, class: &str, size: &str, snapshot: &str) {
    let ds = json!({
        "apiGroup": "snapshot.storage.k8s.io",
        "kind": "VolumeSnapshot",
        "name": snapshot,
    });
    claim_from(env, name, class, size, "dataSourceRef", ds).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restores_have_the_snapshot_data_and_wait_for_a_snapshot_not_ready() {
    SnapshotController::shared(ControlPlane::shared()).await;
    let mut env = Env::new("restore").await;
    let class = env.storage_class("restore", json!({}), json!({})).await;
    let snap_class = snaps::create_class(
        &env.client,
        &format!("{}-snap", env.ns),
        &env.name,
        json!({
            "csi.storage.k8s.io/snapshotter-secret-name": env.secret,
            "csi.storage.k8s.io/snapshotter-secret-namespace": env.ns,
        }),
        "Delete",
    )
    .await;
    let provisioner = env.start_in_process();
    let src = source_with_data(&env, "src", &class, 8, 41).await;

    // A snapshot, then the source changes: the restore has the old data.
    snaps::create_snapshot(&env.client, &env.ns, "snap", &snap_class, "src").await;
    snaps::wait_ready(&env.client, &env.ns, "snap", WAIT).await;
    let img = Image::open(&env.rbd.ioctx, &src).unwrap();
    img.write(0, &pattern(42, MIB as usize)).unwrap();
    img.flush().unwrap();
    drop(img);
    let t0 = Instant::now();
    restore_claim(&env, "restored", &class, "12Mi", "snap").await;
    let (claim, pv) = env.wait_bound("restored").await;
    eprintln!("restore claim create -> Bound took {:?}", t0.elapsed());
    let restored = pv.metadata.name.clone().unwrap();
    assert_eq!(size_of(&env, &restored), 12 * MIB);
    assert_eq!(storage(&claim.status.unwrap().capacity), "12Mi");
    assert_eq!(first_mib(&env, &restored), pattern(41, MIB as usize));
    assert_eq!(first_mib(&env, &src), pattern(42, MIB as usize));

    // Smaller than the snapshot: refused.
    restore_claim(&env, "tiny", &class, "4Mi", "snap").await;
    env.wait_event(
        "tiny",
        "ProvisioningFailed",
        &["smaller than its source", "\"snap\""],
    )
    .await;

    // A snapshot that is not ready (its claim does not exist yet): the
    // restore waits with an event and makes nothing, then goes on.
    snaps::create_snapshot(&env.client, &env.ns, "early", &snap_class, "later").await;
    restore_claim(&env, "from-early", &class, "8Mi", "early").await;
    env.wait_event(
        "from-early",
        "WaitingForDataSource",
        &["VolumeSnapshot \"early\""],
    )
    .await;
    let before = env.images();
    stays(
        "nothing restored while not ready",
        Duration::from_secs(2),
        || async {
            let (images, p) = (env.images(), env.claim_phase("from-early").await);
            if images == before && p == "Pending" {
                Ok(())
            } else {
                Err(format!("images {images:?}, phase {p}"))
            }
        },
    )
    .await;
    source_with_data(&env, "later", &class, 8, 43).await;
    let (_, pv) = env.wait_bound("from-early").await;
    let image = pv.metadata.name.unwrap();
    assert!(has_parent(&env, &image), "a clone of the snapshot image");
    provisioner.stop().await;
}
