//! The Kubernetes side of snapshots for tests: the v1 VolumeSnapshot CRDs
//! and the standard snapshot-controller, both from the Go modules pinned in
//! `tests/snapshot-controller` (`scripts/snapshot-controller build|crds`).
//!
//! ```ignore
//! let cp = support::k8s::ControlPlane::shared();
//! support::snapshots::SnapshotController::shared(cp).await; // CRDs + controller
//! let class = snapshots::create_class(&client, "c", &env.name, json!({...}), "Delete").await;
//! snapshots::create_snapshot(&client, &ns, "snap", &class, "claim").await;
//! let vs = snapshots::wait_ready(&client, &ns, "snap", WAIT).await;
//! ```
//!
//! The snapshot-controller turns a VolumeSnapshot into a
//! VolumeSnapshotContent; the driver (rbdkit's provisioner) makes the
//! snapshot and fills the content's status, and the controller copies it
//! back. Every wait is bounded; a failed wait panics with the objects'
//! status and events.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::events::v1::Event;
use kube::api::PostParams;
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};
use kube::Api;
use serde_json::json;
use tokio::sync::OnceCell;

use super::k8s::ControlPlane;
use super::process::Proc;

/// The snapshot API group.
pub const GROUP: &str = "snapshot.storage.k8s.io";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/snapshot-controller")
}

/// Runs `scripts/snapshot-controller ARG` and returns its stdout lines;
/// panics with its stderr if it fails.
fn run_script(arg: &str) -> Vec<String> {
    let out = Command::new(script())
        .arg(arg)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script().display()));
    assert!(
        out.status.success(),
        "{} {arg} failed ({}):\n{}",
        script().display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The snapshot-controller binary (built on first use, minutes; cached).
pub fn controller_binary() -> PathBuf {
    let lines = run_script("build");
    PathBuf::from(lines.last().expect("build printed no path"))
}

/// The API resource of a snapshot kind (`VolumeSnapshot`,
/// `VolumeSnapshotContent`, `VolumeSnapshotClass`).
pub fn resource(kind: &str) -> ApiResource {
    let plural = format!("{}s", kind.to_lowercase()).replace("classs", "classes");
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", kind), &plural)
}

/// VolumeSnapshots of namespace `ns`.
pub fn volume_snapshots(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &resource("VolumeSnapshot"))
}

/// VolumeSnapshotContents (cluster-scoped).
pub fn contents(client: &kube::Client) -> Api<DynamicObject> {
    Api::all_with(client.clone(), &resource("VolumeSnapshotContent"))
}

/// VolumeSnapshotClasses (cluster-scoped).
pub fn classes(client: &kube::Client) -> Api<DynamicObject> {
    Api::all_with(client.clone(), &resource("VolumeSnapshotClass"))
}

/// Installs the three snapshot and three group snapshot CRDs (server-side
/// apply, so it is idempotent) and waits until each is Established.
pub async fn install_crds(client: &kube::Client) {
    let files = tokio::task::spawn_blocking(|| run_script("crds"))
        .await
        .expect("crds");
    assert_eq!(files.len(), 6, "expected six CRD files, got {files:?}");
    super::k8s::apply_crds(client, &files).await;
}

/// A snapshot-controller process, killed on drop.
pub struct SnapshotController {
    proc: Proc,
    _dir: tempfile::TempDir,
}

/// The shared controller, killed at process exit.
static SHARED: OnceCell<()> = OnceCell::const_new();
static SHARED_PROC: Mutex<Option<SnapshotController>> = Mutex::new(None);

extern "C" fn stop_shared() {
    let c = SHARED_PROC.lock().ok().and_then(|mut c| c.take());
    drop(c);
}

impl SnapshotController {
    /// Starts a snapshot-controller against `kubeconfig` (without leader
    /// election: it acts at once). The CRDs must be installed.
    pub fn start(kubeconfig: &Path) -> SnapshotController {
        let bin = controller_binary();
        let dir = tempfile::Builder::new()
            .prefix("snapshot-controller-")
            .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
            .expect("tempdir");
        let proc = Proc::spawn(
            "snapshot-controller",
            &bin,
            vec![
                format!("--kubeconfig={}", kubeconfig.display()),
                "--leader-election=false".into(),
                // The group snapshot CRDs are installed too (its default,
                // said here so a missing CRD fails loudly in its log).
                "--feature-gates=CSIVolumeGroupSnapshot=true".into(),
                // Retry failed objects quickly: the tests wait on them.
                "--retry-interval-start=500ms".into(),
                "--retry-interval-max=5s".into(),
                "--v=2".into(),
            ],
            dir.path().join("snapshot-controller.log"),
        );
        SnapshotController { proc, _dir: dir }
    }

    /// Installs the CRDs into `cp` and starts one snapshot-controller for
    /// the whole test process (stopped when it exits). Every test of a
    /// process that needs snapshots calls this; one controller serves all
    /// of them (two would race on the same VolumeSnapshots).
    pub async fn shared(cp: &ControlPlane) {
        SHARED
            .get_or_init(|| async {
                install_crds(&cp.client().await).await;
                let kubeconfig = cp.kubeconfig_path().to_owned();
                let c = tokio::task::spawn_blocking(move || SnapshotController::start(&kubeconfig))
                    .await
                    .expect("start snapshot-controller");
                *SHARED_PROC.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
                // SAFETY: `stop_shared` is an `extern "C" fn()` with no
                // arguments that does not unwind, as atexit(3) requires.
                let rc = unsafe { libc::atexit(stop_shared) };
                assert_eq!(rc, 0, "atexit failed");
            })
            .await;
        let mut guard = SHARED_PROC.lock().unwrap_or_else(|e| e.into_inner());
        let c = guard.as_mut().expect("shared snapshot-controller");
        assert!(
            c.proc.running(),
            "the snapshot-controller exited:\n{}",
            c.proc.log_tail(40)
        );
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        self.proc.running()
    }

    /// The end of its log.
    pub fn log_tail(&self, n: usize) -> String {
        self.proc.log_tail(n)
    }
}

/// Creates a VolumeSnapshotClass named `name` for `driver` with
/// `parameters` and `deletion_policy` (`Delete` or `Retain`).
pub async fn create_class(
    client: &kube::Client,
    name: &str,
    driver: &str,
    parameters: serde_json::Value,
    deletion_policy: &str,
) -> String {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1"),
        "kind": "VolumeSnapshotClass",
        "metadata": {"name": name},
        "driver": driver,
        "deletionPolicy": deletion_policy,
        "parameters": parameters,
    }))
    .expect("class object");
    classes(client)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("create VolumeSnapshotClass {name}: {e}"));
    name.to_owned()
}

/// Deletes a VolumeSnapshotClass (a missing one is fine).
pub async fn delete_class(client: &kube::Client, name: &str) {
    match classes(client).delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => panic!("delete VolumeSnapshotClass {name}: {e}"),
    }
}

/// Creates a VolumeSnapshot `name` of claim `claim` in `ns` with `class`.
pub async fn create_snapshot(
    client: &kube::Client,
    ns: &str,
    name: &str,
    class: &str,
    claim: &str,
) -> DynamicObject {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1"),
        "kind": "VolumeSnapshot",
        "metadata": {"name": name},
        "spec": {
            "volumeSnapshotClassName": class,
            "source": {"persistentVolumeClaimName": claim},
        },
    }))
    .expect("snapshot object");
    volume_snapshots(client, ns)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("create VolumeSnapshot {ns}/{name}: {e}"))
}

/// Deletes a VolumeSnapshot (a missing one is fine).
pub async fn delete_snapshot(client: &kube::Client, ns: &str, name: &str) {
    match volume_snapshots(client, ns)
        .delete(name, &DeleteParams::default())
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => panic!("delete VolumeSnapshot {ns}/{name}: {e}"),
    }
}

/// The VolumeSnapshotContent bound to a VolumeSnapshot, if any yet.
pub async fn content_of(client: &kube::Client, vs: &DynamicObject) -> Option<DynamicObject> {
    let name = vs.data["status"]["boundVolumeSnapshotContentName"].as_str()?;
    contents(client).get_opt(name).await.ok().flatten()
}

/// Events about object `name` in `ns` (`reason: note`), for messages.
pub async fn events_about(client: &kube::Client, ns: &str, name: &str) -> Vec<String> {
    let mut out = Vec::new();
    for n in [ns, "default"] {
        let api: Api<Event> = Api::namespaced(client.clone(), n);
        if let Ok(list) = api.list(&ListParams::default()).await {
            out.extend(
                list.items
                    .into_iter()
                    .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
                    .map(|e| {
                        format!(
                            "{}: {}",
                            e.reason.unwrap_or_default(),
                            e.note.unwrap_or_default()
                        )
                    }),
            );
        }
    }
    out
}

/// Waits until VolumeSnapshot `ns/name` has `status.readyToUse: true` and
/// returns it; on timeout panics with its status, its content's status and
/// the events about both.
pub async fn wait_ready(
    client: &kube::Client,
    ns: &str,
    name: &str,
    timeout: Duration,
) -> DynamicObject {
    let api = volume_snapshots(client, ns);
    let deadline = Instant::now() + timeout;
    loop {
        let vs = api
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("get VolumeSnapshot {ns}/{name}: {e}"));
        if vs.data["status"]["readyToUse"] == json!(true) {
            return vs;
        }
        if Instant::now() >= deadline {
            let content = content_of(client, &vs).await;
            let content_name = content
                .as_ref()
                .and_then(|c| c.metadata.name.clone())
                .unwrap_or_default();
            panic!(
                "VolumeSnapshot {ns}/{name} not ready after {timeout:?}\n\
                 status: {}\ncontent {content_name}: spec {} status {}\n\
                 events: {:?}\ncontent events: {:?}",
                vs.data["status"],
                content
                    .as_ref()
                    .map(|c| &c.data["spec"])
                    .unwrap_or(&json!(null)),
                content
                    .as_ref()
                    .map(|c| &c.data["status"])
                    .unwrap_or(&json!(null)),
                events_about(client, ns, name).await,
                events_about(client, ns, &content_name).await,
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
