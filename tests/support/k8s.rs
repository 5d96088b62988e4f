//! A real Kubernetes control plane for integration tests: etcd,
//! kube-apiserver and a kube-controller-manager running the PV binder and the
//! PV/PVC protection controllers (see `tests/k8s-control-plane/README.md`).
//!
//! `RBDKIT_TEST_KUBECONFIG` names the kubeconfig of a control plane started
//! by `scripts/k8s-test-control-plane up DIR`; tests then use that one.
//! Without it, [`ControlPlane::shared`] starts one per test process with that
//! script (under `CARGO_TARGET_TMPDIR`) and stops it when the process exits,
//! and [`ControlPlane::start`] starts a private one that is stopped on drop.
//! Tests never skip: if no control plane can be had, they panic with the
//! script's error output.
//!
//! ```ignore
//! let cp = support::k8s::ControlPlane::shared();
//! let client = cp.client().await;
//! ```

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};

/// Environment variable naming the kubeconfig of an already running control
/// plane to use instead of starting one.
pub const KUBECONFIG_ENV: &str = "RBDKIT_TEST_KUBECONFIG";

/// A control plane the tests may use.
#[derive(Debug)]
pub struct ControlPlane {
    kubeconfig: PathBuf,
    /// The state directory, if this handle started the control plane and so
    /// must stop it.
    owned_dir: Option<PathBuf>,
}

/// The shared instance, or why it could not be started (so that every test
/// reports that error instead of each trying again).
static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
/// The directory of the shared instance, taken by the atexit handler.
static SHARED_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/k8s-test-control-plane")
}

extern "C" fn stop_shared() {
    let dir = SHARED_DIR.lock().ok().and_then(|mut d| d.take());
    if let Some(dir) = dir {
        down(&dir);
    }
}

/// Runs `k8s-test-control-plane down DIR`, reporting (not panicking on) errors:
/// this runs from `Drop` and at process exit.
fn down(dir: &Path) {
    super::process::script_down(&script(), dir);
}

/// The control plane named by `RBDKIT_TEST_KUBECONFIG`, if set.
fn from_env() -> Option<ControlPlane> {
    let path = PathBuf::from(std::env::var_os(KUBECONFIG_ENV)?);
    assert!(
        path.is_file(),
        "{KUBECONFIG_ENV}={} is not a file",
        path.display()
    );
    Some(ControlPlane {
        kubeconfig: path,
        owned_dir: None,
    })
}

/// Starts a new control plane with the script in a fresh directory under
/// `CARGO_TARGET_TMPDIR`; the error holds the script's output.
fn launch() -> Result<ControlPlane, String> {
    let dir = tempfile::Builder::new()
        .prefix("k8s-cp-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .map_err(|e| format!("cannot create a directory under CARGO_TARGET_TMPDIR: {e}"))?
        .keep();
    let out = Command::new(script())
        .arg("up")
        .arg(&dir)
        // If this process dies without running its exit handlers, a
        // watchdog started by the script stops the control plane.
        .env("K8S_TEST_CP_OWNER_PID", std::process::id().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script().display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let kubeconfig = stdout
        .lines()
        .find_map(|l| l.strip_prefix("export KUBECONFIG="))
        .map(PathBuf::from);
    match kubeconfig {
        Some(kubeconfig) if out.status.success() => Ok(ControlPlane {
            kubeconfig,
            owned_dir: Some(dir),
        }),
        _ => Err(format!(
            "could not start a Kubernetes control plane for the tests \
             ({} up {} exited with {}; its logs are in that directory).\n\
             --- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
            script().display(),
            dir.display(),
            out.status
        )),
    }
}

impl ControlPlane {
    /// The process-wide control plane: the one named by
    /// `RBDKIT_TEST_KUBECONFIG`, or else one started on first use and stopped
    /// when the process exits. Blocks while it starts (seconds when the
    /// binaries are cached, the first build takes many minutes).
    pub fn shared() -> &'static ControlPlane {
        let shared = SHARED.get_or_init(|| {
            if let Some(cp) = from_env() {
                return Ok(cp);
            }
            let mut cp = launch()?;
            // The shared instance is stopped by the exit handler, not by Drop
            // (statics are never dropped).
            let dir = cp.owned_dir.take();
            *SHARED_DIR.lock().unwrap_or_else(|e| e.into_inner()) = dir;
            // SAFETY: `stop_shared` is an `extern "C" fn()` with no arguments
            // that does not unwind (it only reports errors), as atexit requires.
            let rc = unsafe { libc::atexit(stop_shared) };
            if rc != 0 {
                stop_shared();
                return Err("libc::atexit failed; stopped the control plane".to_owned());
            }
            Ok(cp)
        });
        match shared {
            Ok(cp) => cp,
            Err(e) => panic!("{e}"),
        }
    }

    /// A control plane of this test's own: started now and stopped when the
    /// returned value is dropped. With `RBDKIT_TEST_KUBECONFIG` set, that
    /// control plane is returned instead (and left running on drop).
    pub fn start() -> ControlPlane {
        from_env().unwrap_or_else(|| launch().unwrap_or_else(|e| panic!("{e}")))
    }

    /// A control plane of this test's own even when `RBDKIT_TEST_KUBECONFIG`
    /// is set: started now and stopped when the returned value is dropped.
    pub fn start_private() -> ControlPlane {
        launch().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Stops kube-apiserver and starts it again (same port, same etcd), and
    /// waits until it is ready. Only for a control plane this handle started.
    pub fn restart_apiserver(&self) {
        let dir = self
            .owned_dir
            .as_ref()
            .expect("restart_apiserver needs a private control plane (start_private)");
        let out = Command::new(script())
            .arg("restart-apiserver")
            .arg(dir)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script().display()));
        assert!(
            out.status.success(),
            "k8s-test-control-plane restart-apiserver {} failed ({}):\n{}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The admin kubeconfig (client certificate in group `system:masters`).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The kube client configuration for the admin kubeconfig.
    pub async fn config(&self) -> kube::Config {
        let kubeconfig = kube::config::Kubeconfig::read_from(&self.kubeconfig)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", self.kubeconfig.display()));
        kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap_or_else(|e| panic!("bad kubeconfig {}: {e}", self.kubeconfig.display()))
    }

    /// An admin client for this control plane.
    pub async fn client(&self) -> kube::Client {
        kube::Client::try_from(self.config().await)
            .unwrap_or_else(|e| panic!("cannot build a kube client: {e}"))
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some(dir) = self.owned_dir.take() {
            down(&dir);
        }
    }
}

/// Applies the CRDs in `files` (YAML; server-side apply, so it is
/// idempotent) and waits until each is Established.
pub async fn apply_crds(client: &kube::Client, files: &[String]) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Api, Patch, PatchParams};
    use std::time::{Duration, Instant};
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let pp = PatchParams::apply("rbdkit-tests").force();
    for file in files {
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("read {file}: {e}"));
        let value: serde_json::Value =
            serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("parse {file}: {e}"));
        let crd: CustomResourceDefinition =
            serde_json::from_value(value).unwrap_or_else(|e| panic!("{file}: not a CRD: {e}"));
        let name = crd.metadata.name.clone().expect("CRD name");
        api.patch(&name, &pp, &Patch::Apply(&crd))
            .await
            .unwrap_or_else(|e| panic!("apply CRD {name}: {e}"));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let c = api.get(&name).await.expect("get CRD");
            let established = c
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                });
            if established {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "CRD {name} not Established after 60 s: {:?}",
                c.status
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
