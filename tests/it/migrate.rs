//! `rbdkit migrate` against a real control plane and a real Ceph cluster:
//! for each legacy PV shape (rbd-provisioner, in-tree, rook flex with
//! `clusterNamespace` and with the older `clusterName`), a claim Bound to the
//! legacy PV; the dry run changes nothing; `--apply` leaves a CSI PV of
//! rbdkit under the same name, the claim bound to it all along (watched:
//! the binder may mark it Lost for the one round trip the PV is missing, and
//! binds it again at once; never Pending or unbound), the
//! image with rbdkit's owner record and its data intact. A run killed after
//! each step is finished by a re-run. Missing images, unknown clusters and
//! images of another rbdkit are refused with clear messages.
use crate::support;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PersistentVolume;

use rbdkit::rbd::Image;
use rbdkit::volume::legacy::{MIGRATED_FROM, ORIGINAL_RECLAIM_POLICY};
use rbdkit::volume::ops::{self, META_PROVISIONER, META_PV};
use rbdkit::volume::VolumeId;

use support::legacy::{self as lg, Legacy, PhaseWatch};
use support::provisioner::Env;

fn args(env: &Env, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "migrate".into(),
        "--kubeconfig".into(),
        env.kubeconfig.display().to_string(),
        "--clusters-config".into(),
        env.config_path().display().to_string(),
        "--driver".into(),
        env.name.clone(),
        "--secret".into(),
        format!("{}/{}", env.ns, env.secret),
        "--node-secret".into(),
        format!("{}/{}", env.ns, env.node_secret),
        "--timeout".into(),
        "20s".into(),
    ];
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn owner_record(image: &str) -> BTreeMap<String, String> {
    let img = Image::open_read_only(&lg::pool_ioctx(), image).unwrap();
    ops::owner_metadata(&img).unwrap()
}

/// Checks everything a finished migration promises.
async fn assert_migrated(env: &Env, l: &Legacy, original_policy: &str, watch: &PhaseWatch) {
    let pv: PersistentVolume = env.pvs().get(&l.pv).await.expect("the PV exists");
    let spec = pv.spec.clone().unwrap();
    assert!(spec.rbd.is_none() && spec.flex_volume.is_none(), "{spec:?}");
    let csi = spec.csi.clone().expect("a CSI source");
    assert_eq!(csi.driver, env.name);
    let vol = VolumeId::parse(&csi.volume_handle).unwrap();
    assert_eq!(
        vol,
        VolumeId {
            cluster_id: env.cluster_id.clone(),
            pool: support::ceph::POOL.into(),
            rados_namespace: String::new(),
            image: l.image.clone(),
        }
    );
    assert!(csi.controller_expand_secret_ref.is_some() && csi.node_stage_secret_ref.is_some());
    assert_eq!(
        spec.persistent_volume_reclaim_policy.as_deref(),
        Some(original_policy)
    );
    let ann = pv.metadata.annotations.clone().unwrap_or_default();
    assert!(ann.contains_key(MIGRATED_FROM), "{ann:?}");
    assert!(!ann.contains_key(ORIGINAL_RECLAIM_POLICY), "{ann:?}");
    assert_eq!(ann.get("pv.kubernetes.io/provisioned-by"), Some(&env.name));

    let claim = env.claims().get(&l.claim).await.unwrap();
    assert_eq!(
        spec.claim_ref.as_ref().and_then(|r| r.uid.clone()),
        claim.metadata.uid
    );
    assert_eq!(
        claim.spec.unwrap().volume_name.as_deref(),
        Some(l.pv.as_str())
    );
    assert!(!claim
        .metadata
        .annotations
        .unwrap_or_default()
        .contains_key(rbdkit::cli::migrate::CLAIM_RECORD));
    // The binder has seen the new PV: it is Bound again, and the claim was
    // Bound at every change the watch saw.
    support::provisioner::eventually("PV Bound", support::provisioner::WAIT, || async {
        let p = env.pvs().get(&l.pv).await.map_err(|e| e.to_string())?;
        let phase = p.status.and_then(|s| s.phase).unwrap_or_default();
        (phase == "Bound").then_some(()).ok_or(phase)
    })
    .await;
    // The binder marks the claim Lost if it syncs it while the PV is
    // missing (one API round trip), and binds it again when it sees the
    // new PV: never Pending, never unbound, and Bound again at once.
    env.wait_bound(&l.claim).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let phases = watch.phases();
    assert_eq!(
        phases.last().map(String::as_str),
        Some("Bound"),
        "{phases:?}"
    );
    assert!(
        phases.iter().all(|p| p == "Bound" || p == "Lost"),
        "the claim went through {phases:?}"
    );
    let lost = watch.not_bound_for();
    eprintln!(
        "claim {}: phases {phases:?}, not Bound for {lost:?}",
        l.claim
    );
    assert!(
        lost < std::time::Duration::from_secs(20),
        "Lost for {lost:?}"
    );

    let rec = owner_record(&l.image);
    assert_eq!(rec.get(META_PROVISIONER), Some(&env.name), "{rec:?}");
    assert_eq!(rec.get(META_PV), Some(&l.pv), "{rec:?}");
    assert!(lg::pattern_intact(&l.image, l.seed), "the data changed");
}

async fn one_shape(test: &str, fixture: &str, policy: &str, map: Option<&str>) {
    let env = Env::new(test).await;
    let l = lg::legacy_claim(&env, fixture, 7).await;
    let map_arg = map.map(|m| format!("{m}={}", env.cluster_id));
    let mut extra: Vec<&str> = Vec::new();
    if let Some(m) = &map_arg {
        extra.extend(["--cluster-map", m.as_str()]);
    }
    extra.push(&l.pv);

    // Dry run: a plan, and nothing changed.
    let before = env.pvs().get(&l.pv).await.unwrap();
    let (code, out, err) = lg::rbdkit(&args(&env, &extra), &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("would set Retain") && out.contains("dry run"),
        "{out}"
    );
    let after = env.pvs().get(&l.pv).await.unwrap();
    assert_eq!(
        before.metadata.resource_version,
        after.metadata.resource_version
    );
    assert!(owner_record(&l.image).is_empty());

    let watch = PhaseWatch::start(&env, &l.claim).await;
    let mut apply = extra.clone();
    apply.push("--apply");
    let (code, out, err) = lg::rbdkit(&args(&env, &apply), &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("migrated from"), "{out}");
    assert_migrated(&env, &l, policy, &watch).await;

    // A second run has nothing to do.
    let (code, out, err) = lg::rbdkit(&args(&env, &apply), &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("already migrated"), "{out}");
    lg::remove_objects(&env, &l).await;
    lg::remove_image(&l.image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrates_an_rbd_provisioner_pv() {
    one_shape("migrbdp", "rbd-provisioner", "Delete", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrates_an_in_tree_pv() {
    one_shape("migintree", "in-tree", "Delete", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrates_a_rook_flex_pv() {
    one_shape("migrook", "rook-flex", "Retain", Some("rook-ceph")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrates_an_old_rook_flex_pv_with_cluster_name() {
    one_shape(
        "migrookold",
        "rook-flex-clustername",
        "Delete",
        Some("rook"),
    )
    .await;
}

/// A run that dies after each step in turn (on one PV each), then a re-run
/// (which also finds, on its claim, a PV deleted before its successor was
/// made) finishes them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_killed_after_any_step_is_finished_by_a_rerun() {
    let env = Env::new("migcrash").await;
    let steps = [
        "retain", "metadata", "record", "delete", "create", "restore",
    ];
    let mut legacies = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let l = lg::legacy_claim(&env, "rbd-provisioner", 100 + i as u64).await;
        let (code, out, err) = lg::rbdkit(
            &args(&env, &["--apply", &l.pv]),
            &[("RBDKIT_MIGRATE_EXIT_AFTER", step)],
        );
        assert_eq!(code, 75, "step {step}: {out}\n{err}");
        assert!(err.contains(&format!("after step {step}")), "{err}");
        legacies.push(l);
    }
    // The PV deleted before its successor exists is only on its claim.
    assert!(env.pvs().get_opt(&legacies[3].pv).await.unwrap().is_none());
    // PV names, not --all: other tests' PVs run beside these.
    let names: Vec<&str> = legacies.iter().map(|l| l.pv.as_str()).collect();
    let (code, out, err) = lg::rbdkit(&args(&env, &names), &[]);
    assert_eq!(code, 0, "dry run: {out}\n{err}");
    assert!(out.contains("cut short"), "{out}");
    let watches = {
        let mut w = Vec::new();
        for l in &legacies {
            w.push(PhaseWatch::start(&env, &l.claim).await);
        }
        w
    };
    let mut apply = names.clone();
    apply.push("--apply");
    let (code, out, err) = lg::rbdkit(&args(&env, &apply), &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    for (l, w) in legacies.iter().zip(&watches) {
        assert!(out.contains(&l.pv), "{out}");
        // The claim of the PV deleted mid-run may have been marked Lost by
        // the binder while its PV was missing; it must be Bound again.
        if l.pv == legacies[3].pv {
            env.wait_bound(&l.claim).await;
            let fresh = PhaseWatch::start(&env, &l.claim).await;
            assert_migrated(&env, l, "Delete", &fresh).await;
        } else {
            assert_migrated(&env, l, "Delete", w).await;
        }
    }
    for l in &legacies {
        lg::remove_objects(&env, l).await;
        lg::remove_image(&l.image);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_missing_images_unknown_clusters_and_other_owners() {
    let env = Env::new("migrefuse").await;
    // Missing image.
    let l = lg::legacy_claim(&env, "rbd-provisioner", 1).await;
    lg::remove_image(&l.image);
    let (code, out, _) = lg::rbdkit(&args(&env, &["--apply", &l.pv]), &[]);
    assert_ne!(code, 0);
    assert!(
        out.contains("refused") && out.contains("does not exist") && out.contains(&l.image),
        "{out}"
    );
    let pv = env.pvs().get(&l.pv).await.unwrap();
    assert!(pv.spec.unwrap().rbd.is_some(), "the PV was changed");
    lg::remove_objects(&env, &l).await;

    // Unknown cluster: a rook namespace that is no clusterID, no map.
    let r = lg::legacy_claim(&env, "rook-flex", 2).await;
    let (code, out, _) = lg::rbdkit(&args(&env, &["--apply", &r.pv]), &[]);
    assert_ne!(code, 0);
    assert!(
        out.contains("rook-ceph") && out.contains("--cluster-map"),
        "{out}"
    );
    assert!(owner_record(&r.image).is_empty());
    lg::remove_objects(&env, &r).await;
    lg::remove_image(&r.image);

    // Monitors no cluster has.
    let mut other = lg::fixture_pv("in-tree", &env, "x", "y", "z");
    other.spec.as_mut().unwrap().rbd.as_mut().unwrap().monitors = vec!["192.0.2.1:6789".into()];
    let l2 = lg::legacy_claim(&env, "in-tree", 3).await;
    let mut spec = env.pvs().get(&l2.pv).await.unwrap();
    let _ = &mut spec;
    lg::remove_objects(&env, &l2).await;
    env.wait_gone(&env.pvs(), &l2.pv).await;
    let mut moved = lg::fixture_pv("in-tree", &env, &l2.pv, &l2.claim, &l2.image);
    moved.spec.as_mut().unwrap().rbd = other.spec.unwrap().rbd.map(|mut r| {
        r.image = l2.image.clone();
        r
    });
    moved.spec.as_mut().unwrap().claim_ref = None;
    env.pvs().create(&Default::default(), &moved).await.unwrap();
    let (code, out, _) = lg::rbdkit(&args(&env, &[&l2.pv]), &[]);
    assert_ne!(code, 0);
    assert!(
        out.contains("no cluster has any of the monitors 192.0.2.1:6789"),
        "{out}"
    );
    let _ = env.pvs().delete(&l2.pv, &Default::default()).await;
    lg::remove_image(&l2.image);

    // An image another rbdkit owns.
    let o = lg::legacy_claim(&env, "rbd-provisioner", 4).await;
    {
        let img = Image::open(&lg::pool_ioctx(), &o.image).unwrap();
        img.metadata_set(META_PROVISIONER, "someone.else.io")
            .unwrap();
        img.metadata_set(META_PV, "pvc-other").unwrap();
    }
    let (code, out, _) = lg::rbdkit(&args(&env, &["--apply", &o.pv]), &[]);
    assert_ne!(code, 0);
    assert!(out.contains("someone.else.io"), "{out}");
    assert!(env
        .pvs()
        .get(&o.pv)
        .await
        .unwrap()
        .spec
        .unwrap()
        .rbd
        .is_some());
    lg::remove_objects(&env, &o).await;
    lg::remove_image(&o.image);
}
