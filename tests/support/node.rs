//! A real Kubernetes node for end-to-end tests: containerd, runc, a kubelet
//! and the kube-scheduler (`scripts/k8s-test-node`) joined to the shared
//! control plane, and rbdkit's node plugin on it as host processes
//! (`rbdkit fuse-mapper`, `rbdkit csi --mode node` and the plugin registrar),
//! registered with the kubelet through its plugin-registration socket as the
//! DaemonSet does.
//!
//! ```ignore
//! let node = support::node::Node::shared();
//! let plugin = NodePlugin::start(node, &client, &env.name, &env.config_path()).await;
//! create_pod(&client, &ns, busybox_pod("writer", "echo hi > /data/f", ...)).await;
//! ```
//!
//! Every wait is bounded; a wait that fails panics with the pod's status,
//! its logs, the namespace's events and the end of the kubelet's log.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode};
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use kube::Api;
use serde_json::json;

use super::k8s::ControlPlane;
use super::process::tail;
pub use super::process::Proc;
use super::provisioner::from_json;

/// How long a pod may take to reach a phase.
pub const POD_WAIT: Duration = Duration::from_secs(120);

/// The node.
#[derive(Debug)]
pub struct Node {
    dir: PathBuf,
    /// The node name (this machine's hostname).
    pub name: String,
    /// The kubelet's root directory.
    pub kubelet_root: PathBuf,
    /// The image every test pod runs (busybox, imported, never pulled).
    pub image: String,
    /// The node's binaries (`registrar`, `ctr`, ...).
    pub bin: PathBuf,
}

static SHARED: OnceLock<Result<Node, String>> = OnceLock::new();
static SHARED_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/k8s-test-node")
}

extern "C" fn stop_shared() {
    let dir = SHARED_DIR.lock().ok().and_then(|mut d| d.take());
    if let Some(dir) = dir {
        super::process::script_down(&script(), &dir);
    }
}

fn launch(cp: &ControlPlane) -> Result<Node, String> {
    // Under /tmp, not the target dir: unix socket paths under the kubelet
    // root must stay short.
    let dir = tempfile::Builder::new()
        .prefix("rbdkit-node-")
        .tempdir_in("/tmp")
        .map_err(|e| format!("cannot create a node directory: {e}"))?
        .keep();
    // Its containers run with an environment of their own: the run's reaper
    // finds the node by its dir (`scripts/k8s-test-node down`).
    super::process::register_dir(&dir);
    let out = Command::new(script())
        .arg("up")
        .arg(&dir)
        .arg(cp.kubeconfig_path())
        .env("K8S_TEST_NODE_OWNER_PID", std::process::id().to_string())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script().display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let var = |k: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(&format!("export {k}=")))
            .map(str::to_owned)
    };
    match (
        out.status.success(),
        var("K8S_TEST_NODE_NAME"),
        var("K8S_TEST_NODE_KUBELET_ROOT"),
        var("K8S_TEST_NODE_IMAGE"),
        var("K8S_TEST_NODE_BIN"),
    ) {
        (true, Some(name), Some(root), Some(image), Some(bin)) => Ok(Node {
            dir,
            name,
            kubelet_root: root.into(),
            image,
            bin: bin.into(),
        }),
        _ => Err(format!(
            "could not start a Kubernetes node for the tests ({} up {} exited with {}; \
             its logs are in that directory).\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
            script().display(),
            dir.display(),
            out.status
        )),
    }
}

impl Node {
    /// The process-wide node (and with it the shared control plane), started
    /// on first use and stopped when the process exits.
    pub fn shared() -> &'static Node {
        let shared = SHARED.get_or_init(|| {
            let cp = ControlPlane::shared();
            let node = launch(cp)?;
            *SHARED_DIR.lock().unwrap_or_else(|e| e.into_inner()) = Some(node.dir.clone());
            // SAFETY: `stop_shared` is an `extern "C" fn()` that does not
            // unwind, as atexit requires. Registered after the control
            // plane's handler, so it runs before it (atexit is LIFO).
            let rc = unsafe { libc::atexit(stop_shared) };
            if rc != 0 {
                stop_shared();
                return Err("libc::atexit failed; stopped the node".to_owned());
            }
            Ok(node)
        });
        match shared {
            Ok(node) => node,
            Err(e) => panic!("{e}"),
        }
    }

    /// The last `n` lines of the kubelet's log.
    pub fn kubelet_log_tail(&self, n: usize) -> String {
        tail(&self.dir.join("kubelet.log"), n)
    }
}

/// What a namespace needs before pods run in it, since the test control
/// plane runs neither the serviceaccount controller nor the root-CA
/// publisher: the `default` ServiceAccount and the `kube-root-ca.crt`
/// ConfigMap.
pub async fn prepare_namespace(client: &kube::Client, ns: &str) {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    match sas
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": "default"}})),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create the default ServiceAccount in {ns}: {e}"),
    }
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let ca = cms_ca(client).await;
    match cms
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": "kube-root-ca.crt"}, "data": {"ca.crt": ca}})),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create kube-root-ca.crt in {ns}: {e}"),
    }
}

/// The CA the node script published in `default`.
async fn cms_ca(client: &kube::Client) -> String {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    cms.get("kube-root-ca.crt")
        .await
        .expect("kube-root-ca.crt in default (made by k8s-test-node up)")
        .data
        .and_then(|d| d.get("ca.crt").cloned())
        .expect("ca.crt in kube-root-ca.crt")
}

/// A pod of the busybox image running `script` with `sh -c`, never
/// restarted, with no service-account token, on the host network. `volumes`
/// and `mounts` are its `volumes` and the container's `volumeMounts`;
/// `extra` holds more container fields (such as `volumeDevices`).
pub fn busybox_pod(
    node: &Node,
    name: &str,
    script: &str,
    volumes: serde_json::Value,
    mounts: serde_json::Value,
) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            // The tests are about volumes: pod networking (the CNI bridge)
            // is not needed and only adds a netns per pod.
            "hostNetwork": true,
            "terminationGracePeriodSeconds": 2,
            "volumes": volumes,
            "containers": [{
                "name": "main",
                "image": node.image,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", script],
                "volumeMounts": mounts,
            }],
        },
    })
}

/// A volume of `claim`, named `data`.
pub fn claim_volume(claim: &str) -> serde_json::Value {
    json!([{"name": "data", "persistentVolumeClaim": {"claimName": claim}}])
}

/// Creates a pod.
pub async fn create_pod(client: &kube::Client, ns: &str, pod: serde_json::Value) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let name = pod["metadata"]["name"].as_str().unwrap_or("?").to_owned();
    pods.create(&PostParams::default(), &from_json(pod))
        .await
        .unwrap_or_else(|e| panic!("create pod {ns}/{name}: {e}"));
}

/// The pod's container log (through the API server and the kubelet).
pub async fn pod_logs(client: &kube::Client, ns: &str, name: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    match tokio::time::timeout(
        Duration::from_secs(20),
        pods.logs(name, &LogParams::default()),
    )
    .await
    {
        Ok(Ok(text)) => text,
        Ok(Err(e)) => format!("<no logs: {e}>"),
        Err(_) => "<no logs: timed out>".to_owned(),
    }
}

/// Everything there is to know about a pod that did not do what a test
/// expected: its status, logs, the namespace's events and the kubelet's log.
pub async fn diagnostics(node: &Node, client: &kube::Client, ns: &str, name: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let status = match pods.get_opt(name).await {
        Ok(Some(p)) => serde_json::to_string_pretty(&p.status).unwrap_or_default(),
        Ok(None) => "<pod gone>".to_owned(),
        Err(e) => format!("<get failed: {e}>"),
    };
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let events = events
        .list(&ListParams::default())
        .await
        .map(|l| {
            l.items
                .iter()
                .map(|e| {
                    format!(
                        "{} {}: {}",
                        e.regarding
                            .as_ref()
                            .and_then(|r| r.name.clone())
                            .unwrap_or_default(),
                        e.reason.clone().unwrap_or_default(),
                        e.note.clone().unwrap_or_default()
                    )
                })
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_else(|e| format!("<events: {e}>"));
    format!(
        "--- pod {ns}/{name} status ---\n{status}\n--- its logs ---\n{}\n--- events in {ns} ---\n{events}\n\
         --- kubelet log (last 40 lines) ---\n{}",
        pod_logs(client, ns, name).await,
        node.kubelet_log_tail(40)
    )
}

/// Waits until the pod's phase is one of `want` and returns the pod; panics
/// with [`diagnostics`] on a timeout or when it ends in another phase.
pub async fn wait_phase(
    node: &Node,
    client: &kube::Client,
    ns: &str,
    name: &str,
    want: &[&str],
    timeout: Duration,
) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let deadline = Instant::now() + timeout;
    loop {
        let phase = match pods.get_opt(name).await {
            Ok(Some(p)) => {
                let phase = p.status.as_ref().and_then(|s| s.phase.clone());
                if let Some(ph) = phase.as_deref() {
                    if want.contains(&ph) {
                        return p;
                    }
                }
                phase
            }
            _ => None,
        };
        let terminal = matches!(phase.as_deref(), Some("Succeeded" | "Failed"));
        if terminal || Instant::now() >= deadline {
            panic!(
                "pod {ns}/{name} is {phase:?}, expected one of {want:?} within {timeout:?}\n{}",
                diagnostics(node, client, ns, name).await
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Deletes a pod and waits (bounded) until it is gone, which the kubelet
/// only allows once its containers have stopped.
pub async fn delete_pod(node: &Node, client: &kube::Client, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let _ = pods.delete(name, &DeleteParams::default()).await;
    let deadline = Instant::now() + POD_WAIT;
    while let Ok(Some(_)) = pods.get_opt(name).await {
        if Instant::now() >= deadline {
            panic!(
                "pod {ns}/{name} still there {POD_WAIT:?} after delete\n{}",
                diagnostics(node, client, ns, name).await
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// rbdkit's node plugin on the node, as the DaemonSet runs it: the FUSE
/// mapper, `rbdkit csi --mode node` on
/// `<kubelet root>/plugins/<driver>/csi.sock`, and the registrar.
pub struct NodePlugin {
    /// The driver name (each test's own).
    pub driver: String,
    /// Mapper socket, mapper state, CSI state, logs.
    pub dir: tempfile::TempDir,
    /// `rbdkit fuse-mapper` (the supervisor; the worker is its child).
    pub mapper: Proc,
    /// `rbdkit csi --mode node`.
    pub csi: Proc,
    /// The plugin registrar.
    pub registrar: Proc,
    /// The CSI socket.
    pub socket: PathBuf,
    kubelet_root: PathBuf,
}

/// The topology key the node plugin reports.
pub const TOPOLOGY_KEY: &str = "topology.rbd.rbdkit.io/node";

impl NodePlugin {
    /// Starts the plugin for `driver` with the clusters config at `config`,
    /// creates its CSIDriver object from `deploy/csidriver.yaml` (renamed to
    /// `driver`), and waits until the kubelet has registered it (the
    /// driver is in the node's CSINode object).
    pub async fn start(
        node: &Node,
        client: &kube::Client,
        driver: &str,
        config: &Path,
    ) -> NodePlugin {
        NodePlugin::start_with(node, client, driver, config, &[]).await
    }

    /// [`NodePlugin::start`] with more `rbdkit csi` flags (such as
    /// `--kms-config`).
    pub async fn start_with(
        node: &Node,
        client: &kube::Client,
        driver: &str,
        config: &Path,
        extra: &[String],
    ) -> NodePlugin {
        create_csidriver(client, driver).await;
        let dir = tempfile::Builder::new()
            .prefix("rbdkit-np-")
            .tempdir_in("/tmp")
            .expect("tempdir");
        super::process::register_dir(dir.path());
        let d = dir.path();
        let rbdkit = Path::new(env!("CARGO_BIN_EXE_rbdkit"));
        let mapper_sock = d.join("mapper.sock");
        let mapper = Proc::spawn(
            "fuse-mapper",
            rbdkit,
            vec![
                "fuse-mapper".into(),
                "--socket".into(),
                mapper_sock.display().to_string(),
                "--state-dir".into(),
                d.join("fuse").display().to_string(),
            ],
            d.join("mapper.log"),
        );
        let plugin_dir = node.kubelet_root.join("plugins").join(driver);
        std::fs::create_dir_all(&plugin_dir).expect("plugin dir");
        let socket = plugin_dir.join("csi.sock");
        let mut csi_args: Vec<String> = vec![
            "csi".into(),
            "--mode".into(),
            "node".into(),
            "--driver-name".into(),
            driver.into(),
            "--node-id".into(),
            node.name.clone(),
            "--endpoint".into(),
            format!("unix://{}", socket.display()),
            "--clusters-config".into(),
            config.display().to_string(),
            "--mapper-socket".into(),
            mapper_sock.display().to_string(),
            "--state-dir".into(),
            d.join("csi").display().to_string(),
            "--default-mapper".into(),
            "rbdkit-fuse".into(),
            "--topology".into(),
            format!("{TOPOLOGY_KEY}={}", node.name),
        ];
        csi_args.extend(extra.iter().cloned());
        let csi = Proc::spawn(
            "rbdkit csi --mode node",
            rbdkit,
            csi_args,
            d.join("csi.log"),
        );
        let registrar = Proc::spawn(
            "registrar",
            &node.bin.join("registrar"),
            vec![
                format!("--csi-address={}", socket.display()),
                format!("--kubelet-registration-path={}", socket.display()),
                format!(
                    "--registration-dir={}",
                    node.kubelet_root.join("plugins_registry").display()
                ),
            ],
            d.join("registrar.log"),
        );
        let mut plugin = NodePlugin {
            driver: driver.to_owned(),
            dir,
            mapper,
            csi,
            registrar,
            socket,
            kubelet_root: node.kubelet_root.clone(),
        };
        plugin.wait_registered(node, client).await;
        plugin
    }

    /// Waits until the node's CSINode lists this driver.
    pub async fn wait_registered(&mut self, node: &Node, client: &kube::Client) {
        let csinodes: Api<CSINode> = Api::all(client.clone());
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(n)) = csinodes.get_opt(&node.name).await {
                if n.spec.drivers.iter().any(|d| d.name == self.driver) {
                    return;
                }
            }
            if Instant::now() >= deadline || !self.registrar.running() {
                panic!(
                    "driver {} not registered with the kubelet\n--- registrar ---\n{}\n--- csi ---\n{}\n\
                     --- kubelet ---\n{}",
                    self.driver,
                    self.registrar.log_tail(20),
                    self.csi.log_tail(20),
                    node.kubelet_log_tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// A client of the mapper's control socket.
    pub fn fuse_mapper(&self) -> rbdkit::node::fuse::FuseMapper {
        rbdkit::node::fuse::FuseMapper::new(self.dir.path().join("mapper.sock"))
    }

    /// The mapper worker's pid (the supervisor's child), if it runs.
    pub fn mapper_worker_pid(&self) -> Option<u32> {
        let sup = self.mapper.try_pid()?;
        let children = std::fs::read_to_string(format!("/proc/{sup}/task/{sup}/children")).ok()?;
        children.split_whitespace().next()?.parse().ok()
    }

    /// Loop devices whose backing file is under this plugin's directory.
    pub fn loop_devices(&self) -> Vec<String> {
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir("/sys/block") else {
            return out;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let backing = e.path().join("loop/backing_file");
            if let Ok(b) = std::fs::read_to_string(backing) {
                if Path::new(b.trim()).starts_with(self.dir.path()) {
                    out.push(format!("/dev/{name}"));
                }
            }
        }
        out
    }

    /// Mounts under the kubelet root whose source is one of this plugin's
    /// loop devices, or that mention `pv`.
    pub fn kubelet_mounts(&self, pv: &str) -> Vec<String> {
        let loops = self.loop_devices();
        rbdkit::node::mount::mountinfo()
            .unwrap_or_default()
            .into_iter()
            .filter(|m| m.mount_point.starts_with(&self.kubelet_root))
            .filter(|m| loops.contains(&m.source) || m.mount_point.to_string_lossy().contains(pv))
            .map(|m| format!("{} on {}", m.source, m.mount_point.display()))
            .collect()
    }
}

impl Drop for NodePlugin {
    fn drop(&mut self) {
        // After a failed test pods may still use the volumes: unmount what
        // sits on our loop devices, then stop the mapper cleanly, then
        // whatever is left under our directory.
        self.registrar.kill9();
        self.csi.kill9();
        super::csi::forget_kept_keys(&format!("{}/", self.driver));
        let loops = self.loop_devices();
        let mut mounts: Vec<PathBuf> = rbdkit::node::mount::mountinfo()
            .unwrap_or_default()
            .into_iter()
            .filter(|m| loops.contains(&m.source))
            .map(|m| m.mount_point)
            .collect();
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in mounts {
            let _ = rbdkit::node::mount::umount(&m, true);
        }
        self.mapper.terminate();
        let root = self.dir.path().to_owned();
        let mut left: Vec<PathBuf> = rbdkit::node::mount::mountinfo()
            .unwrap_or_default()
            .into_iter()
            .map(|m| m.mount_point)
            .filter(|p| p.starts_with(&root))
            .collect();
        left.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for p in left {
            let _ = rbdkit::node::mount::ensure_unmounted(&p);
        }
        let _ = std::fs::remove_dir_all(self.kubelet_root.join("plugins").join(&self.driver));
        // The kubelet deregisters a plugin when its registration socket goes.
        let _ = std::fs::remove_file(
            self.kubelet_root
                .join("plugins_registry")
                .join(format!("{}-reg.sock", self.driver)),
        );
    }
}

/// Creates the CSIDriver object of `deploy/csidriver.yaml` under the name
/// `driver` (attachRequired false, fsGroupPolicy File, as deployed).
pub async fn create_csidriver(client: &kube::Client, driver: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/csidriver.yaml");
    let text = std::fs::read_to_string(&path).expect("read deploy/csidriver.yaml");
    let mut obj: serde_json::Value =
        serde_saphyr::from_str(&text).expect("deploy/csidriver.yaml parses");
    obj["metadata"]["name"] = json!(driver);
    let api: Api<CSIDriver> = Api::all(client.clone());
    match api.create(&PostParams::default(), &from_json(obj)).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create CSIDriver {driver}: {e}"),
    }
}
