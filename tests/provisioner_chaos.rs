//! kill -9 chaos: the provisioner process is killed at random moments (a
//! seeded RNG; the seed is printed, `RBDKIT_CHAOS_SEED` replays it) and
//! restarted each time, while a batch of claims is provisioned, expanded
//! and deleted. Afterwards every remaining claim is Bound to exactly one PV
//! with exactly one image, deleted claims left nothing, and there is no
//! temporary image, trash entry or stuck finalizer.
#![cfg(feature = "service")]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::ListParams;
use serde_json::json;

use rbdkit::k8s::quantity::{parse_bytes, MIB};
use rbdkit::provisioner::controller::CLAIM_FINALIZER;
use rbdkit::provisioner::pv::PV_FINALIZER;
use rbdkit::rbd::{self, Image};
use rbdkit::volume::ops::TEMP_SUFFIX;

use support::provisioner::{eventually, Env};

const CLAIMS: usize = 24;
/// Claims deleted while the kills go on (the last ones created).
const DELETED: usize = 8;
/// Claims expanded while the kills go on.
const EXPANDED: usize = 8;
const KILLS: usize = 32;

/// splitmix64: small, seedable, good enough to pick moments.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` milliseconds.
    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo))
    }
}

fn capacity(pv: &PersistentVolume) -> u64 {
    pv.spec
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .and_then(|c| c.get("storage"))
        .and_then(|q| parse_bytes(&q.0).ok())
        .unwrap_or(0)
}

async fn our_pvs(env: &Env) -> Vec<PersistentVolume> {
    env.pvs()
        .list(&ListParams::default())
        .await
        .expect("list PVs")
        .items
        .into_iter()
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.csi.as_ref())
                .is_some_and(|c| c.driver == env.name)
        })
        .collect()
}

async fn phase(env: &Env, claim: &str) -> Option<String> {
    env.claims()
        .get_opt(claim)
        .await
        .ok()
        .flatten()
        .and_then(|c| c.status?.phase)
}

/// Whether some claim is not in its final state: not yet Bound, Bound
/// with our finalizer still on, being expanded, or deleted with its PV
/// still there; or a temporary image exists.
async fn in_flight(env: &Env, deleted: &BTreeSet<String>) -> bool {
    let Ok(claims) = env.claims().list(&ListParams::default()).await else {
        return false;
    };
    let busy = claims.items.iter().any(|c| {
        let name = c.metadata.name.clone().unwrap_or_default();
        let status = c.status.clone().unwrap_or_default();
        let ours = c
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == CLAIM_FINALIZER));
        let resizing = status
            .conditions
            .as_ref()
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Resizing"));
        status.phase.as_deref() != Some("Bound")
            || ours
            || resizing
            || (deleted.contains(&name) && c.metadata.deletion_timestamp.is_some())
    });
    busy || env.images().iter().any(|i| i.ends_with(TEMP_SUFFIX))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_random_moments_leaves_one_pv_and_one_image_per_claim() {
    let seed = std::env::var("RBDKIT_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("chaos seed {seed} (RBDKIT_CHAOS_SEED={seed} replays the kill moments)");
    let mut rng = Rng(seed);

    let mut env = Env::new("chaos").await;
    let class = env
        .storage_class("c", json!({}), json!({"allowVolumeExpansion": true}))
        .await;
    // Every incarnation has the same identity, as a restarted pod has, so
    // it takes the lease back at once instead of waiting for it to expire.
    let flags = [("--leader-election-identity", "chaos")];
    let mut run = 0;
    let mut p = env.start_process_with(&format!("chaos-{run}"), &flags);
    let env = Arc::new(env);

    let names: Vec<String> = (0..CLAIMS).map(|i| format!("c{i:02}")).collect();
    let deleted: BTreeSet<String> = names[CLAIMS - DELETED..].iter().cloned().collect();
    let expanded = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));

    // The workload, beside the kills: create, expand the first to be
    // Bound, delete the last ones (Bound or still being provisioned).
    let workload_done = Arc::new(AtomicBool::new(false));
    let workload = {
        let env = Arc::clone(&env);
        let names = names.clone();
        let class = class.clone();
        let deleted = deleted.clone();
        let expanded = Arc::clone(&expanded);
        let done = Arc::clone(&workload_done);
        let mut rng = Rng(seed ^ 0x5555);
        tokio::spawn(async move {
            for n in &names {
                env.claim(n, &class, "8Mi", &["ReadWriteOnce"], "Block")
                    .await;
                tokio::time::sleep(rng.millis(50, 400)).await;
            }
            let deadline = Instant::now() + Duration::from_secs(90);
            let mut grown = Vec::new();
            while grown.len() < EXPANDED && Instant::now() < deadline {
                for n in names.iter().filter(|n| !deleted.contains(*n)) {
                    if grown.len() < EXPANDED
                        && !grown.contains(n)
                        && phase(&env, n).await.as_deref() == Some("Bound")
                    {
                        env.resize_claim(n, "16Mi").await;
                        grown.push(n.clone());
                        tokio::time::sleep(rng.millis(50, 300)).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            *expanded.lock().unwrap() = grown;
            for n in &deleted {
                env.delete_claim(n).await;
                tokio::time::sleep(rng.millis(50, 400)).await;
            }
            done.store(true, Ordering::SeqCst);
        })
    };

    let started = Instant::now();
    let mut kills = 0;
    let mut mid_work = 0;
    while kills < KILLS || !workload_done.load(Ordering::SeqCst) {
        assert!(
            started.elapsed() < Duration::from_secs(150),
            "the workload did not finish under the kills"
        );
        tokio::time::sleep(rng.millis(200, 2500)).await;
        p.kill9();
        kills += 1;
        // Was anything half done at that moment?
        if in_flight(&env, &deleted).await {
            mid_work += 1;
        }
        run += 1;
        p = env.start_process_with(&format!("chaos-{run}"), &flags);
    }
    workload.await.expect("workload");
    let chaos_took = started.elapsed();
    let expanded = expanded.lock().unwrap().clone();
    assert_eq!(expanded.len(), EXPANDED, "expanded only {expanded:?}");

    // The last incarnation finishes the work.
    let remaining: Vec<String> = names
        .iter()
        .filter(|n| !deleted.contains(*n))
        .cloned()
        .collect();
    let claims = env.claims();
    for n in &deleted {
        env.wait_gone(&claims, n).await;
    }
    let mut bound = BTreeMap::new();
    for n in &remaining {
        let (c, pv) = env.wait_bound(n).await;
        bound.insert(c.metadata.uid.clone().unwrap(), (n.clone(), pv));
    }
    for n in &expanded {
        eventually(
            &format!("{n} expanded to 16Mi"),
            Duration::from_secs(60),
            || async {
                let c = claims.get(n).await.map_err(|e| e.to_string())?;
                let cap = c
                    .status
                    .and_then(|s| s.capacity)
                    .and_then(|c| c.get("storage").cloned())
                    .map(|q| q.0)
                    .unwrap_or_default();
                if parse_bytes(&cap).ok() == Some(16 * MIB) {
                    Ok(())
                } else {
                    Err(format!("claim capacity {cap:?}"))
                }
            },
        )
        .await;
    }
    // PVs of deleted claims are deleted after their claims.
    let pvs = eventually(
        "one PV per remaining claim, none left over",
        Duration::from_secs(60),
        || async {
            let pvs = our_pvs(&env).await;
            if pvs.len() == remaining.len()
                && pvs.iter().all(|p| p.metadata.deletion_timestamp.is_none())
            {
                Ok(pvs)
            } else {
                let names: Vec<_> = pvs.iter().filter_map(|p| p.metadata.name.clone()).collect();
                Err(format!("{} PVs: {names:?}", pvs.len()))
            }
        },
    )
    .await;

    // Kubernetes: every remaining claim is Bound to exactly one PV, its
    // own, with its size; no finalizer of ours is left on a claim.
    let mut pv_names = BTreeSet::new();
    for pv in &pvs {
        let name = pv.metadata.name.clone().unwrap();
        let claim_uid = pv
            .spec
            .as_ref()
            .and_then(|s| s.claim_ref.as_ref())
            .and_then(|r| r.uid.clone())
            .unwrap_or_default();
        let (claim, bound_pv) = bound
            .get(&claim_uid)
            .unwrap_or_else(|| panic!("PV {name} is for no remaining claim ({claim_uid})"));
        assert_eq!(bound_pv.metadata.name.as_deref(), Some(name.as_str()));
        assert_eq!(name, format!("pvc-{claim_uid}"));
        let want = if expanded.contains(claim) { 16 } else { 8 } * MIB;
        assert_eq!(capacity(pv), want, "PV {name} of {claim}");
        assert!(pv
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == PV_FINALIZER)));
        pv_names.insert(name);
    }
    assert_eq!(pv_names.len(), remaining.len());
    for c in claims.list(&ListParams::default()).await.unwrap().items {
        let f = c.metadata.finalizers.clone().unwrap_or_default();
        assert!(
            !f.iter().any(|f| f == CLAIM_FINALIZER),
            "claim {:?} keeps {f:?}",
            c.metadata.name
        );
        assert!(
            c.metadata.deletion_timestamp.is_none(),
            "claim {:?} stuck deleting",
            c.metadata.name
        );
    }

    // Ceph: exactly one image per PV, the PV's size, no temporary image,
    // nothing in the trash.
    let images: BTreeSet<String> = env.images().into_iter().collect();
    let temps: Vec<&String> = images.iter().filter(|i| i.ends_with(TEMP_SUFFIX)).collect();
    assert!(temps.is_empty(), "temporary images left: {temps:?}");
    assert_eq!(images, pv_names, "images vs PVs");
    for pv in &pvs {
        let name = pv.metadata.name.as_deref().unwrap();
        let size = Image::open_read_only(&env.rbd.ioctx, name)
            .and_then(|i| i.size())
            .unwrap();
        assert_eq!(size, capacity(pv), "image {name}");
    }
    let trash = rbd::trash_list(&env.rbd.ioctx).unwrap();
    assert!(trash.is_empty(), "trash: {trash:?}");

    eprintln!(
        "chaos: seed {seed}, {kills} kill -9s ({mid_work} with work in flight) over {chaos_took:?}, {CLAIMS} claims \
         ({} deleted, {} expanded), {} PVs, {} images, 0 temporary images, 0 trash entries, \
         0 stuck finalizers",
        deleted.len(),
        expanded.len(),
        pvs.len(),
        images.len()
    );

    // The rest goes too, and takes its images with it.
    for n in &remaining {
        env.delete_claim(n).await;
    }
    eventually("every PV gone", Duration::from_secs(60), || async {
        let n = our_pvs(&env).await.len();
        let images = env.images();
        if n == 0 && images.is_empty() {
            Ok(())
        } else {
            Err(format!("{n} PVs, images {images:?}"))
        }
    })
    .await;
    assert!(p.running(), "{}", p.log_tail());
    assert!(mid_work > 0, "no kill landed while work was in flight");
    drop(p);
}
