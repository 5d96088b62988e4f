//! kill -9 chaos: the provisioner process is killed at random moments (a
//! seeded RNG: a fixed seed, or `RBDKIT_CHAOS_SEED`; the seed is printed)
//! and restarted each time, while a batch of claims is provisioned,
//! expanded and deleted. Afterwards every remaining claim is Bound to
//! exactly one PV with exactly one image of its size, deleted claims left
//! nothing, and there is no temporary image, trash entry or stuck
//! finalizer: Ceph is checked with the library, Kubernetes with the API.
//!
//! Every incarnation logs to its own file (kept for the run's key grep
//! when `RBDKIT_TEST_ARTIFACTS` is set). On failure the test names each
//! leftover, its owner metadata and claim, and prints the lines of every
//! incarnation's log that mention it.
use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::ListParams;
use serde_json::json;

use rbdkit::provisioner::controller::CLAIM_FINALIZER;
use rbdkit::provisioner::pv::PV_FINALIZER;
use rbdkit::rbd::{self, Image};
use rbdkit::volume::ops::{owner_metadata, TEMP_SUFFIX};
use rbdkit::volume::quantity::{parse_bytes, MIB};

use support::provisioner::{claim_name, eventually, pv_bytes, Env};

const CLAIMS: usize = 24;
/// Claims deleted while the kills go on: every third one, half of them
/// soon after creation (likely mid-provisioning), half once Bound.
const DELETED: usize = 8;
/// Claims expanded while the kills go on.
const EXPANDED: usize = 8;
const KILLS: usize = 32;
/// The seed of the kill moments unless `RBDKIT_CHAOS_SEED` gives another.
const SEED: u64 = 0x00C4_A051_5EED_0001;
/// Bounds for a hang, not claims about speed (each wait returns as soon as
/// its event is seen), generous enough for a machine at load 10: how long
/// the workload may take (the kills stop after [`KILLS`], so it always
/// makes progress), and how long the last incarnation gets to converge.
const WORKLOAD_WAIT: Duration = Duration::from_secs(600);
const SETTLE: Duration = Duration::from_secs(300);

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

async fn phase(env: &Env, claim: &str) -> Option<String> {
    env.claims()
        .get_opt(claim)
        .await
        .ok()
        .flatten()
        .and_then(|c| c.status?.phase)
}

/// Whether some claim is not in its final state (not yet Bound, Bound
/// with our finalizer still on, being expanded, or being deleted), or a
/// temporary image exists.
async fn in_flight(env: &Env) -> bool {
    let Ok(claims) = env.claims().list(&ListParams::default()).await else {
        return false;
    };
    let busy = claims.items.iter().any(|c| {
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
            || c.metadata.deletion_timestamp.is_some()
    });
    busy || env.images().iter().any(|i| i.ends_with(TEMP_SUFFIX))
}

/// What Kubernetes and Ceph hold once the work is done, and what is wrong
/// with it.
#[derive(Default)]
struct Census {
    bound: usize,
    pvs: usize,
    images: usize,
    expanded_ok: usize,
    /// Images no PV references (temporary ones included).
    leaked_images: Vec<String>,
    temp_images: Vec<String>,
    /// PVs whose claim is gone or not theirs, or stuck deleting.
    orphan_pvs: Vec<String>,
    /// PVs with no image.
    missing_images: Vec<String>,
    /// Claims keeping our finalizer, or stuck deleting.
    stuck_finalizers: Vec<String>,
    /// (name, id) of trash entries.
    trash: Vec<(String, String)>,
    /// Ids of image headers that neither the image list nor the trash list
    /// shows (a remove cut short inside librbd, whose trash entry
    /// `rbd_trash_list` hides).
    hidden_images: Vec<String>,
    /// Anything else (a claim not Bound, a wrong size).
    other: Vec<String>,
}

impl Census {
    fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut add = |what: &str, v: &[String]| {
            if !v.is_empty() {
                out.push(format!("{what}: {v:?}"));
            }
        };
        add("leaked images", &self.leaked_images);
        add("temporary images", &self.temp_images);
        add("orphan PVs", &self.orphan_pvs);
        add("PVs without an image", &self.missing_images);
        add("stuck finalizers", &self.stuck_finalizers);
        add("hidden images (header ids)", &self.hidden_images);
        add("other", &self.other);
        if !self.trash.is_empty() {
            out.push(format!("trash entries: {:?}", self.trash));
        }
        out
    }
}

struct Want<'a> {
    /// Claim name -> uid, of the claims that stay.
    remaining: &'a BTreeMap<String, String>,
    deleted: &'a BTreeSet<String>,
    expanded: &'a [String],
}

async fn census(env: &Env, want: &Want<'_>) -> Result<Census, String> {
    let mut c = Census::default();
    let claims = env
        .claims()
        .list(&ListParams::default())
        .await
        .map_err(|e| format!("list claims: {e}"))?
        .items;
    let pvs = env.our_pvs().await?;
    let images: BTreeSet<String> = rbd::list_names(&env.rbd.ioctx)
        .map_err(|e| format!("list images: {e}"))?
        .into_iter()
        .collect();
    let trash = rbd::trash_list(&env.rbd.ioctx).map_err(|e| format!("trash list: {e}"))?;
    c.hidden_images = hidden_headers(env, &trash)?;
    c.pvs = pvs.len();
    c.images = images.len();
    c.trash = trash.into_iter().map(|e| (e.name, e.id)).collect();

    let mut pv_names = BTreeSet::new();
    for pv in &pvs {
        let name = pv.metadata.name.clone().unwrap_or_default();
        let claim = claim_name(pv).unwrap_or_default().to_owned();
        let claim_uid = pv
            .spec
            .as_ref()
            .and_then(|s| s.claim_ref.as_ref())
            .and_then(|r| r.uid.clone())
            .unwrap_or_default();
        pv_names.insert(name.clone());
        let theirs = want.remaining.get(&claim) == Some(&claim_uid);
        if !theirs || pv.metadata.deletion_timestamp.is_some() {
            c.orphan_pvs.push(format!("{name} (claim {claim})"));
            continue;
        }
        if name != format!("pvc-{claim_uid}") {
            c.other
                .push(format!("PV {name} of {claim} is not named after its uid"));
        }
        if !pv
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == PV_FINALIZER))
        {
            c.other.push(format!("PV {name} lacks {PV_FINALIZER}"));
        }
        let want_size = if want.expanded.contains(&claim) {
            16
        } else {
            8
        } * MIB;
        if pv_bytes(pv) != want_size {
            c.other.push(format!(
                "PV {name} of {claim} has {} bytes, not {want_size}",
                pv_bytes(pv)
            ));
        }
        if !images.contains(&name) {
            c.missing_images.push(name.clone());
            continue;
        }
        match Image::open_read_only(&env.rbd.ioctx, &name).and_then(|i| i.size()) {
            Ok(s) if s == want_size => {
                if want_size == 16 * MIB {
                    c.expanded_ok += 1;
                }
            }
            Ok(s) => c.other.push(format!(
                "image {name} of {claim} has {s} bytes, not {want_size}"
            )),
            Err(e) => c.other.push(format!("image {name}: {e}")),
        }
    }
    for i in &images {
        if i.ends_with(TEMP_SUFFIX) {
            c.temp_images.push(i.clone());
        }
        if !pv_names.contains(i) {
            c.leaked_images.push(i.clone());
        }
    }

    let mut seen = BTreeSet::new();
    for claim in &claims {
        let name = claim.metadata.name.clone().unwrap_or_default();
        seen.insert(name.clone());
        let f = claim.metadata.finalizers.clone().unwrap_or_default();
        if f.iter().any(|f| f == CLAIM_FINALIZER) {
            c.stuck_finalizers
                .push(format!("claim {name} keeps {CLAIM_FINALIZER}"));
        }
        if claim.metadata.deletion_timestamp.is_some() || want.deleted.contains(&name) {
            c.stuck_finalizers
                .push(format!("claim {name} is still there, finalizers {f:?}"));
            continue;
        }
        let status = claim.status.clone().unwrap_or_default();
        let volume = claim.spec.as_ref().and_then(|s| s.volume_name.clone());
        let expected_pv = want.remaining.get(&name).map(|uid| format!("pvc-{uid}"));
        if status.phase.as_deref() == Some("Bound") && volume == expected_pv {
            c.bound += 1;
        } else {
            c.other.push(format!(
                "claim {name}: phase {:?}, volume {volume:?}",
                status.phase
            ));
        }
        if want.expanded.contains(&name) {
            // The controller's part of the resize is done; Block waits for
            // the node too (NodeExpandVolume grows rbdkit-fuse's loop
            // device), and this test runs no node.
            let allocated = status
                .allocated_resources
                .as_ref()
                .and_then(|c| c.get("storage"))
                .and_then(|q| parse_bytes(&q.0).ok());
            let node_step = status
                .allocated_resource_statuses
                .as_ref()
                .and_then(|s| s.get("storage"))
                .cloned();
            if allocated != Some(16 * MIB) || node_step.as_deref() != Some("NodeResizePending") {
                c.other.push(format!(
                    "claim {name}: allocated {allocated:?} ({node_step:?}), not 16 MiB waiting for the node"
                ));
            }
        }
    }
    for name in want.remaining.keys() {
        if !seen.contains(name) {
            c.other.push(format!("claim {name} is gone"));
        }
    }
    Ok(c)
}

/// Ids of `rbd_header.*` objects in the test's namespace that belong to no
/// listed image and no listed trash entry.
fn hidden_headers(env: &Env, trash: &[rbd::TrashEntry]) -> Result<Vec<String>, String> {
    let mut known: BTreeSet<String> = rbd::list(&env.rbd.ioctx)
        .map_err(|e| format!("list images: {e}"))?
        .into_iter()
        .map(|s| s.id)
        .collect();
    known.extend(trash.iter().map(|e| e.id.clone()));
    Ok(env
        .rbd
        .ioctx
        .list_objects()
        .map_err(|e| format!("list objects: {e}"))?
        .into_iter()
        .filter_map(|o| o.strip_prefix("rbd_header.").map(str::to_owned))
        .filter(|id| !known.contains(id))
        .collect())
}

/// The owner record of an image (or of a trash entry, by id), as text.
fn owner_of(env: &Env, name: &str, trash_id: Option<&str>) -> String {
    let img = match trash_id {
        Some(id) => Image::open_by_id_read_only(&env.rbd.ioctx, id),
        None => Image::open_read_only(&env.rbd.ioctx, name),
    };
    match img.and_then(|i| owner_metadata(&i)) {
        Ok(m) => format!("{m:?}"),
        Err(e) => format!("(cannot read: {e})"),
    }
}

/// Lines of each log that mention one of `words`, with the log's tail.
fn log_excerpts(logs: &[PathBuf], words: &[String]) -> String {
    let mut out = String::new();
    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let hits: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| words.iter().any(|w| l.contains(w.as_str())))
            .collect();
        if hits.is_empty() {
            continue;
        }
        let name = log.file_name().unwrap_or_default().to_string_lossy();
        out.push_str(&format!(
            "--- {name}: {} of {} lines mention it ---\n",
            hits.len(),
            lines.len()
        ));
        for l in &hits[hits.len().saturating_sub(30)..] {
            out.push_str(l);
            out.push('\n');
        }
        out.push_str(&format!("--- {name}: last lines ---\n"));
        for l in &lines[lines.len().saturating_sub(8)..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

/// A report on each leftover: owner metadata, claim, events and the log
/// lines of every incarnation about it.
async fn diagnose(
    env: &Env,
    census: &Census,
    uids: &BTreeMap<String, String>,
    logs: &[PathBuf],
) -> String {
    let mut out = String::new();
    let mut things: Vec<(String, Option<String>)> = census
        .leaked_images
        .iter()
        .map(|i| (i.clone(), None))
        .collect();
    things.extend(
        census
            .trash
            .iter()
            .map(|(n, id)| (n.clone(), Some(id.clone()))),
    );
    for o in census.orphan_pvs.iter().chain(&census.missing_images) {
        let pv = o.split_whitespace().next().unwrap_or_default().to_owned();
        things.push((pv, None));
    }
    for (name, trash_id) in things {
        let base = name.trim_end_matches(TEMP_SUFFIX).to_owned();
        let uid = base.strip_prefix("pvc-").unwrap_or_default().to_owned();
        let claim = uids
            .iter()
            .find(|(_, u)| **u == uid)
            .map(|(c, _)| c.clone())
            .unwrap_or_else(|| "(unknown)".into());
        out.push_str(&format!(
            "\n=== {name}{}: claim {claim} (uid {uid}); owner metadata {} ===\n",
            trash_id
                .as_ref()
                .map(|i| format!(" (trash id {i})"))
                .unwrap_or_default(),
            owner_of(env, &name, trash_id.as_deref()),
        ));
        out.push_str(&format!(
            "events of claim {claim}: {:?}\nevents of PV {base}: {:?}\n",
            env.event_summary(&claim).await,
            env.event_summary(&base).await
        ));
        let words = vec![base.clone(), format!("{}/{claim}", env.ns)];
        out.push_str(&log_excerpts(logs, &words));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_random_moments_leaves_one_pv_and_one_image_per_claim() {
    let seed = std::env::var("RBDKIT_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SEED);
    eprintln!("chaos seed {seed} (RBDKIT_CHAOS_SEED={seed} replays the kill moments)");
    let mut rng = Rng(seed);

    let mut env = Env::new("chaos").await;
    let class = env
        .storage_class("c", json!({}), json!({"allowVolumeExpansion": true}))
        .await;
    // Every incarnation has the same identity, as a restarted pod has, so
    // it takes the lease back at once instead of waiting for it to expire.
    let flags = [("--leader-election-identity", "chaos")];
    let env = Arc::new(env);
    // After `env`, so that it is killed (and its log shown) before the
    // test's directory goes. Each incarnation has its own log file.
    let mut run = 0;
    let mut p = env.start_process_with(&format!("chaos-{run:02}"), &flags);
    let mut logs = vec![p.log.clone()];

    let names: Vec<String> = (0..CLAIMS).map(|i| format!("c{i:02}")).collect();
    let deleted: BTreeSet<String> = names.iter().skip(2).step_by(3).cloned().collect();
    assert_eq!(deleted.len(), DELETED);
    let uids = Arc::new(Mutex::new(BTreeMap::<String, String>::new()));
    let expanded = Arc::new(Mutex::new(Vec::<String>::new()));

    // The workload, beside the kills: create all; delete half of the
    // doomed ones soon after their creation; expand the first to be Bound;
    // then delete the other doomed ones.
    let workload = {
        let env = Arc::clone(&env);
        let names = names.clone();
        let class = class.clone();
        let deleted = deleted.clone();
        let uids = Arc::clone(&uids);
        let expanded = Arc::clone(&expanded);
        let mut rng = Rng(seed ^ 0x5555);
        tokio::spawn(async move {
            let mut early = Vec::new();
            let mut late = Vec::new();
            for n in &names {
                let c = env
                    .claim(n, &class, "8Mi", &["ReadWriteOnce"], "Block")
                    .await;
                uids.lock()
                    .unwrap()
                    .insert(n.clone(), c.metadata.uid.unwrap_or_default());
                if deleted.contains(n) {
                    if early.len() < DELETED / 2 {
                        let env = Arc::clone(&env);
                        let n = n.clone();
                        let after = rng.millis(0, 1500);
                        early.push(tokio::spawn(async move {
                            tokio::time::sleep(after).await;
                            env.delete_claim(&n).await;
                        }));
                    } else {
                        late.push(n.clone());
                    }
                }
                tokio::time::sleep(rng.millis(50, 400)).await;
            }
            let deadline = Instant::now() + WORKLOAD_WAIT;
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
            for n in &late {
                env.delete_claim(n).await;
                tokio::time::sleep(rng.millis(50, 400)).await;
            }
            for t in early {
                t.await.expect("early delete");
            }
        })
    };

    // KILLS kills, at random moments, while the workload runs; then the
    // last incarnation finishes what is left of it (on a loaded machine,
    // where each incarnation is slow to start, kills without end could
    // starve it).
    let started = Instant::now();
    let mut kills = 0;
    let mut mid_work = 0;
    while kills < KILLS {
        tokio::time::sleep(rng.millis(200, 2500)).await;
        p.kill9();
        kills += 1;
        // Was anything half done at that moment?
        if in_flight(&env).await {
            mid_work += 1;
        }
        run += 1;
        p = env.start_process_with(&format!("chaos-{run:02}"), &flags);
        logs.push(p.log.clone());
    }
    tokio::time::timeout(WORKLOAD_WAIT, workload)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the workload did not finish in {WORKLOAD_WAIT:?} \
                 (replay with RBDKIT_CHAOS_SEED={seed})"
            )
        })
        .expect("workload");
    let chaos_took = started.elapsed();
    let expanded = expanded.lock().unwrap().clone();
    assert_eq!(expanded.len(), EXPANDED, "expanded only {expanded:?}");
    let uids = uids.lock().unwrap().clone();
    let remaining: BTreeMap<String, String> = uids
        .iter()
        .filter(|(n, _)| !deleted.contains(*n))
        .map(|(n, u)| (n.clone(), u.clone()))
        .collect();
    let want = Want {
        remaining: &remaining,
        deleted: &deleted,
        expanded: &expanded,
    };

    // The last incarnation finishes the work.
    let settle_started = Instant::now();
    let deadline = settle_started + SETTLE;
    let census = loop {
        let last = census(&env, &want).await;
        match last {
            Ok(c) if c.problems().is_empty() => break c,
            Ok(c) if Instant::now() >= deadline => {
                let report = diagnose(&env, &c, &uids, &logs).await;
                panic!(
                    "chaos seed {seed}: not clean {SETTLE:?} after the last kill: {:#?}\n\
                     {report}\n(replay with RBDKIT_CHAOS_SEED={seed})",
                    c.problems()
                );
            }
            Err(e) if Instant::now() >= deadline => panic!("chaos seed {seed}: {e}"),
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    };
    let settled = settle_started.elapsed();
    assert_eq!(census.bound, remaining.len());
    assert_eq!(census.pvs, remaining.len());
    assert_eq!(census.images, remaining.len());
    assert_eq!(census.expanded_ok, EXPANDED);

    eprintln!(
        "chaos: seed {seed}, {kills} kill -9s ({mid_work} with work in flight) over {chaos_took:.1?}, \
         settled {settled:.1?} later; {CLAIMS} claims ({} deleted, {} expanded); {} Bound, \
         {} PVs, {} images; 0 leaked images, 0 temporary images, 0 orphan PVs, \
         0 trash entries, 0 hidden images, 0 stuck finalizers",
        deleted.len(),
        expanded.len(),
        census.bound,
        census.pvs,
        census.images,
    );

    // The rest goes too, and takes its images with it.
    for n in remaining.keys() {
        env.delete_claim(n).await;
    }
    eventually("every PV and image gone", SETTLE, || async {
        let n = env.our_pvs().await?.len();
        let images = env.images();
        let trash = env.trash();
        let hidden = hidden_headers(&env, &[])?;
        if n == 0 && images.is_empty() && trash.is_empty() && hidden.is_empty() {
            Ok(())
        } else {
            // Who still has each left image open (a delete waits for it):
            // client instance and address, against the provisioner's.
            let watched: Vec<String> = images
                .iter()
                .map(|i| {
                    let w = Image::open_read_only(&env.rbd.ioctx, i).and_then(|img| img.watchers());
                    format!("{i}: {w:?}")
                })
                .collect();
            Err(format!(
                "{n} PVs, images {images:?} (watchers {watched:?}), trash {trash:?}, hidden \
                 image headers {hidden:?}; provisioner log: {}",
                p.log_tail()
            ))
        }
    })
    .await;
    assert!(p.running(), "{}", p.log_tail());
    assert!(mid_work > 0, "no kill landed while work was in flight");
    drop(p);
}
