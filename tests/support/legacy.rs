//! Legacy PVs (rbd-provisioner, in-tree, rook flex) for the migration and
//! adoption tests: a real image in the test pool's default RADOS namespace
//! (where those systems made them), a PV from `tests/fixtures/legacy/`
//! naming it, and a claim Bound to that PV by the real PV binder.

use std::process::Command;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;

use rbdkit::rbd::{self, Image, ImageOptions};

use super::ceph::{cluster, unique, TestCluster, POOL};
use super::provisioner::{from_json, Env};

/// Size of the legacy images.
pub const SIZE: u64 = 64 << 20;
/// Bytes of pattern written at the start of each image.
pub const PATTERN_LEN: usize = 1 << 20;

/// A legacy PV and its Bound claim.
pub struct Legacy {
    /// The PV name.
    pub pv: String,
    /// The claim name (in the Env's namespace).
    pub claim: String,
    /// The image, in the default namespace of [`POOL`].
    pub image: String,
    /// The seed of the pattern written to the image.
    pub seed: u64,
}

/// An ioctx on the default namespace of the test pool.
pub fn pool_ioctx() -> rbdkit::rados::IoCtx {
    cluster().ioctx(POOL).expect("open test pool")
}

/// Makes an image named like `fixture`'s system names them, with a pattern.
pub fn legacy_image(fixture: &str, seed: u64) -> String {
    let tag = unique("legacy").replace('-', "");
    let image = if fixture.starts_with("rook") {
        format!("pvc-{tag}")
    } else {
        format!("kubernetes-dynamic-pvc-{tag}")
    };
    let io = pool_ioctx();
    rbd::create(&io, &image, SIZE, &ImageOptions::new()).expect("create legacy image");
    let img = Image::open(&io, &image).expect("open legacy image");
    img.write(0, &super::data::pattern(seed, PATTERN_LEN))
        .expect("write pattern");
    img.close().expect("close");
    image
}

/// Whether the image still holds its pattern.
pub fn pattern_intact(image: &str, seed: u64) -> bool {
    let img = Image::open_read_only(&pool_ioctx(), image).expect("open image");
    let mut buf = vec![0u8; PATTERN_LEN];
    img.read_exact(0, &mut buf).expect("read");
    buf == super::data::pattern(seed, PATTERN_LEN)
}

/// Removes the image (best effort).
pub fn remove_image(image: &str) {
    let _ = rbd::remove(&pool_ioctx(), image);
}

/// The fixture's PV, with its placeholders filled in.
pub fn fixture_pv(
    fixture: &str,
    env: &Env,
    pv: &str,
    claim: &str,
    image: &str,
) -> PersistentVolume {
    let path = format!(
        "{}/tests/fixtures/legacy/{fixture}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mons = TestCluster::get()
        .conf_value("mon host")
        .expect("mon host in ceph.conf");
    let text = text
        .replace("${MONITORS}", &json!([mons]).to_string())
        .replace("${PV}", pv)
        .replace("${CLAIM}", claim)
        .replace("${NAMESPACE}", &env.ns)
        .replace("${CLASS}", &format!("{}-legacy", env.ns))
        .replace("${POOL}", POOL)
        .replace("${IMAGE}", image);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Creates `fixture`'s PV on a fresh image and a claim pre-bound to it, and
/// waits until the binder has bound them.
pub async fn legacy_claim(env: &Env, fixture: &str, seed: u64) -> Legacy {
    let image = legacy_image(fixture, seed);
    let pv = format!("pvc-{}", unique(&env.ns));
    let claim = unique("legacy");
    let pvs: Api<PersistentVolume> = env.pvs();
    pvs.create(
        &PostParams::default(),
        &fixture_pv(fixture, env, &pv, &claim, &image),
    )
    .await
    .expect("create legacy PV");
    let modes = pvs
        .get(&pv)
        .await
        .unwrap()
        .spec
        .unwrap()
        .access_modes
        .unwrap();
    env.claims()
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": claim},
                "spec": {
                    "storageClassName": format!("{}-legacy", env.ns),
                    "accessModes": [modes[0]],
                    "volumeName": pv,
                    "resources": {"requests": {"storage": "64Mi"}},
                },
            })),
        )
        .await
        .expect("create claim");
    env.wait_bound(&claim).await;
    Legacy {
        pv,
        claim,
        image,
        seed,
    }
}

/// Records every phase a claim goes through until dropped.
pub struct PhaseWatch {
    /// The phases seen, in order, with when.
    pub seen: Arc<Mutex<Vec<(String, std::time::Instant)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl PhaseWatch {
    /// Starts watching `claim`.
    pub async fn start(env: &Env, claim: &str) -> PhaseWatch {
        let api: Api<PersistentVolumeClaim> = env.claims();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = Arc::clone(&seen);
        let cfg = watcher::Config::default().fields(&format!("metadata.name={claim}"));
        let task = tokio::spawn(async move {
            let mut w = watcher(api, cfg).boxed();
            while let Some(ev) = w.next().await {
                let obj = match ev {
                    Ok(watcher::Event::Apply(o)) | Ok(watcher::Event::InitApply(o)) => o,
                    Ok(watcher::Event::Delete(_)) => {
                        s.lock()
                            .unwrap()
                            .push(("Deleted".into(), std::time::Instant::now()));
                        continue;
                    }
                    _ => continue,
                };
                let phase = obj.status.and_then(|st| st.phase).unwrap_or_default();
                s.lock().unwrap().push((phase, std::time::Instant::now()));
            }
        });
        // Let the initial list land.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        PhaseWatch { seen, task }
    }

    /// The phases seen so far.
    pub fn phases(&self) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// How long the claim was in any phase but Bound, in total.
    pub fn not_bound_for(&self) -> std::time::Duration {
        let seen = self.seen.lock().unwrap();
        let mut total = std::time::Duration::ZERO;
        for w in seen.windows(2) {
            if w[0].0 != "Bound" {
                total += w[1].1 - w[0].1;
            }
        }
        total
    }
}

impl Drop for PhaseWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Runs the rbdkit binary with `args`; returns (exit code, stdout, stderr)
/// after checking that no key was printed.
pub fn rbdkit(args: &[String], envs: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rbdkit"))
        .args(args)
        .envs(envs.iter().copied())
        .env_remove("CEPH_CONF")
        .output()
        .expect("run rbdkit");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    for key in [
        TestCluster::get().admin_key(),
        super::ceph::provisioner_key(),
    ] {
        assert!(
            !stdout.contains(&key) && !stderr.contains(&key),
            "rbdkit printed a key:\n{stdout}\n{stderr}"
        );
    }
    (out.status.code().unwrap_or(-1), stdout, stderr)
}

/// Deletes a claim and a PV, dropping their finalizers (best effort).
pub async fn remove_objects(env: &Env, l: &Legacy) {
    let unfin = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    let _ = env
        .claims()
        .delete(&l.claim, &DeleteParams::default())
        .await;
    let _ = env
        .claims()
        .patch(&l.claim, &PatchParams::default(), &unfin)
        .await;
    let _ = env.pvs().delete(&l.pv, &DeleteParams::default()).await;
    let _ = env
        .pvs()
        .patch(&l.pv, &PatchParams::default(), &unfin)
        .await;
}
