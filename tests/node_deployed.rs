//! rbdkit as a user deploys it (issue 9, item 6): its own OCI image
//! (`scripts/rbdkit-image`, from the release binary) and the registrar's are
//! imported into a real node's containerd (`scripts/k8s-test-node`), then
//! deploy/ is applied as it is (only the clusters ConfigMap gets the test
//! cluster, and the example Secret its key), and:
//! 1. a pod writes a file to a filesystem claim and exits, a second pod reads
//!    it back, and deleting the claim leaves no image, PV, mount or loop device;
//! 2. a pod writes bytes to a block claim, and the test reads them from the
//!    image with the library.
//!
//! The same runs against the Helm chart rendered by helm (`scripts/helm`).
//!
//! What the node needs from its host, as a real node has it: the kubelet's
//! root at /var/lib/kubelet (the DaemonSet's host paths), /var/lib/rbdkit a
//! shared mount (Bidirectional propagation; `/` is private on this machine),
//! the Ceph cluster on an address pods can reach (`CEPH_TEST_ADDR`), and the
//! `kubernetes` Service's address reaching the API server (kube-proxy's job:
//! one DNAT rule here, as kube-proxy would write it).
#![cfg(feature = "service")]

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::CSINode;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::discovery::{self, Scope};
use kube::Api;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use rbdkit::rados::ConnectOptions;
use rbdkit::rbd::{self, Image};
use support::k8s::ControlPlane;
use support::manifests::{deploy_dir, helm_template, install_manifests, yaml_dir};
use support::provisioner::eventually;

const WAIT: Duration = Duration::from_secs(180);
/// How long one script (cluster, node, image) may take; the first image
/// build and node build are the slow ones.
const SCRIPT_TIMEOUT_SECS: u32 = 1800;
/// The clusterID of deploy/example/storageclass.yaml.
const CLUSTER_ID: &str = "ceph-1";

/// One node at a time: the DaemonSet's host paths are fixed.
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs a command (bounded by `timeout`), returning its stdout; panics with
/// its output when it fails.
fn run(what: &str, cmd: &mut Command) -> String {
    let prog = cmd.get_program().to_owned();
    let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
    let out = Command::new("timeout")
        .arg(SCRIPT_TIMEOUT_SECS.to_string())
        .arg(prog)
        .args(args)
        .envs(
            cmd.get_envs()
                .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))),
        )
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command whose failure is only reported (cleanup).
fn run_quiet(cmd: &mut Command) {
    match cmd.stdin(Stdio::null()).output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => eprintln!("{cmd:?}: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => eprintln!("{cmd:?}: {e}"),
    }
}

/// The value of `export NAME=value` in a script's output.
fn export(out: &str, name: &str) -> String {
    let prefix = format!("export {name}=");
    out.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {name} in:\n{out}"))
        .to_owned()
}

/// This machine's own non-loopback IPv4 address (the node's address).
fn node_ip() -> String {
    let out = run(
        "ip route get",
        Command::new("ip").args(["-4", "route", "get", "1.1.1.1"]),
    );
    let words: Vec<&str> = out.split_whitespace().collect();
    let ip = words
        .windows(2)
        .find(|w| w[0] == "src")
        .map(|w| w[1].to_owned())
        .unwrap_or_else(|| panic!("no source address in: {out}"));
    assert!(!ip.starts_with("127."), "{ip}");
    ip
}

/// The release binary next to this test's profile dir.
fn release_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/debug/deps/node_deployed-HASH -> target/release/rbdkit
    let target = exe.parent().unwrap().parent().unwrap().parent().unwrap();
    let bin = target.join("release/rbdkit");
    assert!(
        bin.is_file(),
        "{} is missing: the image is made from the release binary \
         (cargo build --release --bin rbdkit; scripts/test builds it)",
        bin.display()
    );
    bin
}

/// A mount point in this mount namespace, with its source.
fn mounts() -> Vec<(String, String)> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            Some((f[4].to_owned(), f.get(sep + 2)?.to_string()))
        })
        .collect()
}

/// The backing files of the loop devices in use.
fn loop_backing_files() -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(f) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            out.push(format!("{name}: {}", f.trim()));
        }
    }
    out
}

const RBDKIT_HOST_DIR: &str = "/var/lib/rbdkit";

/// A Ceph cluster, a control plane and a node with the images imported.
struct Stack {
    base: PathBuf,
    ceph_dir: PathBuf,
    ceph_conf: PathBuf,
    cp: ControlPlane,
    node_dir: PathBuf,
    busybox: String,
    /// iptables rules (after -t nat -A/-D) this stack added.
    nat: Vec<Vec<String>>,
    bind_mounted: bool,
}

impl Stack {
    fn up(name: &str) -> Stack {
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("nd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        support::process::register_dir(&base);
        let ip = node_ip();
        let ceph_dir = base.join("ceph");
        let out = run(
            "ceph-test-cluster up",
            Command::new(repo().join("scripts/ceph-test-cluster"))
                .arg("up")
                .arg(&ceph_dir)
                .env("CEPH_TEST_ADDR", &ip),
        );
        let ceph_conf = PathBuf::from(export(&out, "CEPH_CONF"));
        let cp = ControlPlane::start_private();
        let mut stack = Stack {
            base: base.clone(),
            ceph_dir,
            ceph_conf,
            cp,
            node_dir: base.join("node"),
            busybox: String::new(),
            nat: Vec::new(),
            bind_mounted: false,
        };
        // The DaemonSet's rbdkit-state volume has Bidirectional propagation,
        // which needs a shared mount on the host.
        std::fs::create_dir_all(RBDKIT_HOST_DIR).unwrap();
        if !mounts().iter().any(|(m, _)| m == RBDKIT_HOST_DIR) {
            run(
                "bind mount",
                Command::new("mount").args(["--bind", RBDKIT_HOST_DIR, RBDKIT_HOST_DIR]),
            );
            stack.bind_mounted = true;
        }
        run(
            "make-rshared",
            Command::new("mount").args(["--make-rshared", RBDKIT_HOST_DIR]),
        );
        let out = run(
            "k8s-test-node up",
            Command::new(repo().join("scripts/k8s-test-node"))
                .arg("up")
                .arg(&stack.node_dir)
                .arg(stack.cp.kubeconfig_path())
                .env("K8S_TEST_NODE_KUBELET_ROOT", "/var/lib/kubelet")
                .env("K8S_TEST_NODE_OWNER_PID", std::process::id().to_string()),
        );
        stack.busybox = export(&out, "K8S_TEST_NODE_IMAGE");
        let bins = PathBuf::from(export(&out, "K8S_TEST_NODE_BIN"));
        let containerd = export(&out, "K8S_TEST_NODE_CONTAINERD");
        // The images, imported as a user's node would pull them.
        let rbdkit = run(
            "rbdkit-image rbdkit",
            Command::new(repo().join("scripts/rbdkit-image"))
                .args(["rbdkit", "--binary"])
                .arg(release_binary()),
        );
        let registrar = run(
            "rbdkit-image registrar",
            Command::new(repo().join("scripts/rbdkit-image"))
                .args(["registrar", "--binary"])
                .arg(bins.join("registrar")),
        );
        for layout in [rbdkit.trim(), registrar.trim()] {
            let tar = base.join("image.tar");
            run(
                "tar",
                Command::new("tar")
                    .arg("-C")
                    .arg(layout)
                    .arg("-cf")
                    .arg(&tar)
                    .arg("."),
            );
            run(
                "ctr images import",
                Command::new(bins.join("ctr"))
                    .args(["--address", &containerd, "-n", "k8s.io", "images", "import"])
                    .arg(&tar),
            );
            std::fs::remove_file(&tar).unwrap();
        }
        // kube-proxy's job for the `kubernetes` Service (10.0.0.1:443): pods
        // on the bridge and host-network pods reach the API server.
        let server = std::fs::read_to_string(stack.cp.kubeconfig_path())
            .unwrap()
            .lines()
            .find_map(|l| l.trim().strip_prefix("server: https://").map(str::to_owned))
            .expect("server in kubeconfig");
        let bridge = std::fs::read_to_string(stack.node_dir.join("bridge"))
            .unwrap()
            .trim()
            .to_owned();
        // The bridge plugin makes the bridge with the first pod; made
        // now, it takes the setting before any pod exists (the plugin
        // reuses a bridge of that name).
        if !Path::new("/sys/class/net").join(&bridge).exists() {
            run(
                "ip link add",
                Command::new("ip").args(["link", "add", "name", &bridge, "type", "bridge"]),
            );
        }
        run(
            "route_localnet",
            Command::new("sysctl").arg(format!("net.ipv4.conf.{bridge}.route_localnet=1")),
        );
        // Tagged with the run, whose reaper deletes them if it is killed.
        let comment = support::process::rule_comment();
        for (chain, iface) in [("PREROUTING", Some(&bridge)), ("OUTPUT", None)] {
            let mut rule = vec![chain.to_owned()];
            if let Some(i) = iface {
                rule.extend(["-i".to_owned(), i.clone()]);
            }
            rule.extend(
                [
                    "-d",
                    "10.0.0.1/32",
                    "-p",
                    "tcp",
                    "--dport",
                    "443",
                    "-m",
                    "comment",
                    "--comment",
                    &comment,
                    "-j",
                    "DNAT",
                    "--to-destination",
                    &server,
                ]
                .map(str::to_owned),
            );
            run(
                "iptables",
                Command::new("iptables")
                    .args(["-t", "nat", "-A"])
                    .args(&rule),
            );
            stack.nat.push(rule);
        }
        stack
    }

    fn mon(&self) -> String {
        let conf = std::fs::read_to_string(&self.ceph_conf).unwrap();
        conf.lines()
            .find_map(|l| l.strip_prefix("mon host = v1:"))
            .expect("mon host")
            .to_owned()
    }

    fn ceph(&self, args: &[&str]) -> String {
        run(
            "ceph",
            Command::new("ceph")
                .args(args)
                .env("CEPH_CONF", &self.ceph_conf),
        )
    }

    fn images(&self) -> Vec<String> {
        let c = ConnectOptions::new()
            .conf_file(&self.ceph_conf)
            .op_timeout(Duration::from_secs(60))
            .connect()
            .unwrap();
        rbd::list_names(&c.ioctx("rbd").unwrap()).unwrap()
    }

    fn read_image(&self, name: &str, offset: u64, len: usize) -> Vec<u8> {
        let c = ConnectOptions::new()
            .conf_file(&self.ceph_conf)
            .op_timeout(Duration::from_secs(60))
            .connect()
            .unwrap();
        let io = c.ioctx("rbd").unwrap();
        let img = Image::open_read_only(&io, name).unwrap();
        let mut buf = vec![0u8; len];
        let n = img.read(offset, &mut buf).unwrap();
        buf.truncate(n);
        buf
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        run_quiet(
            Command::new(repo().join("scripts/k8s-test-node"))
                .arg("down")
                .arg(&self.node_dir),
        );
        // The deployed node plugin kept its Ceph user's key in this host's
        // kernel keyring (its containers share the host's): not left behind.
        support::csi::forget_kept_keys(&format!("rbd.rbdkit.io/{CLUSTER_ID}"));
        for rule in &self.nat {
            let mut r = rule.clone();
            // -D takes the same spec as -A.
            r.insert(0, "-D".to_owned());
            run_quiet(Command::new("iptables").args(["-t", "nat"]).args(&r));
        }
        // What the killed mapper left mounted under the host dir (deepest
        // first), then the bind mount itself.
        let mut under: Vec<String> = mounts()
            .into_iter()
            .map(|(m, _)| m)
            .filter(|m| m.starts_with(&format!("{RBDKIT_HOST_DIR}/")))
            .collect();
        under.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in under {
            run_quiet(Command::new("umount").args(["-l", &m]));
        }
        if self.bind_mounted {
            run_quiet(Command::new("umount").arg(RBDKIT_HOST_DIR));
        }
        for d in ["csi", "fuse"] {
            let _ = std::fs::remove_dir_all(Path::new(RBDKIT_HOST_DIR).join(d));
        }
        let _ = std::fs::remove_dir_all("/run/rbdkit");
        run_quiet(
            Command::new(repo().join("scripts/ceph-test-cluster"))
                .arg("down")
                .arg(&self.ceph_dir),
        );
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// Server-side apply of one document of any kind.
async fn apply(client: &kube::Client, doc: &Value) {
    let (group, version) = match doc["apiVersion"].as_str().unwrap().split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", doc["apiVersion"].as_str().unwrap()),
    };
    let gvk = GroupVersionKind::gvk(group, version, doc["kind"].as_str().unwrap());
    let (resource, caps): (ApiResource, _) = discovery::pinned_kind(client, &gvk)
        .await
        .unwrap_or_else(|e| panic!("{gvk:?}: {e}"));
    let api: Api<DynamicObject> = match (caps.scope, doc["metadata"]["namespace"].as_str()) {
        (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client.clone(), ns, &resource),
        (Scope::Namespaced, None) => Api::default_namespaced_with(client.clone(), &resource),
        (Scope::Cluster, _) => Api::all_with(client.clone(), &resource),
    };
    let name = doc["metadata"]["name"].as_str().unwrap();
    api.patch(
        name,
        &PatchParams::apply("rbdkit-tests").force(),
        &Patch::Apply(doc),
    )
    .await
    .unwrap_or_else(|e| panic!("apply {} {name}: {e}", doc["kind"]));
}

fn from_json<T: DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).unwrap()
}

/// The example Secret with the key of a Ceph user with the rbd profile, and
/// the example StorageClass as it is.
fn example_objects(stack: &Stack) -> Vec<Value> {
    let key = stack
        .ceph(&[
            "auth",
            "get-or-create-key",
            "client.kubernetes",
            "mon",
            "profile rbd",
            "osd",
            "profile rbd pool=rbd",
            "mgr",
            "profile rbd pool=rbd",
        ])
        .trim()
        .to_owned();
    let mut out = Vec::new();
    for (file, mut d) in yaml_dir(&deploy_dir().join("example")) {
        match d["kind"].as_str().unwrap() {
            "Secret" => {
                assert_eq!(d["stringData"]["userID"], "kubernetes", "{file}");
                d["stringData"]["userKey"] = json!(key);
                out.push(d);
            }
            "StorageClass" => {
                assert_eq!(d["parameters"]["clusterID"], CLUSTER_ID, "{file}");
                out.push(d);
            }
            _ => {}
        }
    }
    assert_eq!(out.len(), 2);
    out
}

fn clusters_json(stack: &Stack) -> Value {
    json!([{"clusterID": CLUSTER_ID, "monitors": [stack.mon()]}])
}

/// Applies `objects` (Namespaces first) and waits until the node plugin is
/// registered with the kubelet and a provisioner is the ready leader.
async fn install(client: &kube::Client, objects: &[Value]) {
    let mut sorted: Vec<&Value> = objects.iter().collect();
    sorted.sort_by_key(|d| d["kind"] != "Namespace");
    for d in sorted {
        apply(client, d).await;
    }
    let ds: Api<DaemonSet> = Api::namespaced(client.clone(), "rbdkit");
    eventually("the node plugin ready", WAIT, || async {
        let d = ds.get("rbdkit-csi-node").await.map_err(|e| e.to_string())?;
        let s = d.status.unwrap_or_default();
        if s.number_ready == 1 {
            Ok(())
        } else {
            Err(format!("{s:?}"))
        }
    })
    .await;
    let nodes: Api<CSINode> = Api::all(client.clone());
    eventually("the driver registered on the node", WAIT, || async {
        let list = nodes
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        let found = list.items.iter().any(|n| {
            n.spec
                .drivers
                .iter()
                .any(|d| d.name == "rbd.rbdkit.io" && d.node_id == hostname())
        });
        if found {
            Ok(())
        } else {
            Err(format!("{:?}", list.items))
        }
    })
    .await;
    let deps: Api<Deployment> = Api::namespaced(client.clone(), "rbdkit");
    eventually("a ready provisioner (the leader)", WAIT, || async {
        let d = deps
            .get("rbdkit-provisioner")
            .await
            .map_err(|e| e.to_string())?;
        let s = d.status.unwrap_or_default();
        if s.ready_replicas.unwrap_or(0) >= 1 {
            Ok(())
        } else {
            Err(format!("{s:?}"))
        }
    })
    .await;
}

fn hostname() -> String {
    run("hostname", &mut Command::new("hostname"))
        .trim()
        .to_owned()
}

/// Runs a pod to its end; panics unless it Succeeded.
async fn run_pod(client: &kube::Client, pod: Value) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
    pods.create(&PostParams::default(), &from_json(pod))
        .await
        .unwrap_or_else(|e| panic!("create pod {name}: {e}"));
    let phase = eventually(&format!("pod {name} to finish"), WAIT, || async {
        let p = pods.get(&name).await.map_err(|e| e.to_string())?;
        let status = p.status.unwrap_or_default();
        match status.phase.as_deref() {
            Some(ph @ ("Succeeded" | "Failed")) => Ok(ph.to_owned()),
            _ => Err(format!("{status:?}")),
        }
    })
    .await;
    assert_eq!(phase, "Succeeded", "pod {name}");
    pods.delete(&name, &DeleteParams::default()).await.unwrap();
    eventually(&format!("pod {name} gone"), WAIT, || async {
        match pods.get_opt(&name).await {
            Ok(None) => Ok(()),
            Ok(Some(_)) => Err("still there".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
}

fn pod(name: &str, image: &str, script: &str, claim: &str, block: bool) -> Value {
    let (mounts, devices) = if block {
        (json!([]), json!([{"name": "v", "devicePath": "/dev/xvda"}]))
    } else {
        (json!([{"name": "v", "mountPath": "/data"}]), json!([]))
    };
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "c", "image": image, "command": ["sh", "-c", script],
                "volumeMounts": mounts, "volumeDevices": devices
            }],
            "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": claim}}]
        }
    })
}

/// Creates a claim of the example class and waits until it is bound;
/// returns its PV.
async fn bound_claim(
    client: &kube::Client,
    name: &str,
    mode: &str,
    size: &str,
) -> PersistentVolume {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    let mut claim = yaml_dir(&deploy_dir().join("example"))
        .into_iter()
        .find(|(_, d)| d["kind"] == "PersistentVolumeClaim")
        .expect("the example claim")
        .1;
    claim["metadata"]["name"] = json!(name);
    claim["spec"]["volumeMode"] = json!(mode);
    claim["spec"]["resources"]["requests"]["storage"] = json!(size);
    claims
        .create(&PostParams::default(), &from_json(claim))
        .await
        .unwrap();
    let pv_name = eventually(&format!("claim {name} bound"), WAIT, || async {
        let c = claims.get(name).await.map_err(|e| e.to_string())?;
        match c.spec.as_ref().and_then(|s| s.volume_name.clone()) {
            Some(v) if c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound") => Ok(v),
            _ => Err(format!("{:?}", c.status)),
        }
    })
    .await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    pvs.get(&pv_name).await.unwrap()
}

fn image_of(pv: &PersistentVolume) -> String {
    let csi = pv.spec.as_ref().unwrap().csi.as_ref().unwrap();
    csi.volume_attributes.as_ref().unwrap()["imageName"].clone()
}

/// Deletes the claim and checks what is left: no PV, no image, no mount of
/// the PV, no loop device on an rbdkit mapping.
async fn delete_claim_leaves_nothing(
    stack: &Stack,
    client: &kube::Client,
    name: &str,
    pv: &PersistentVolume,
) {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    claims.delete(name, &DeleteParams::default()).await.unwrap();
    let pv_name = pv.metadata.name.clone().unwrap();
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    eventually(&format!("PV {pv_name} gone"), WAIT, || async {
        match pvs.get_opt(&pv_name).await {
            Ok(None) => Ok(()),
            Ok(Some(p)) => Err(format!("{:?}", p.status)),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    let image = image_of(pv);
    assert!(!stack.images().contains(&image), "image {image} is left");
    let left: Vec<_> = mounts()
        .into_iter()
        .filter(|(m, src)| m.contains(&pv_name) || src.contains(&image))
        .collect();
    assert!(left.is_empty(), "mounts left: {left:?}");
    let loops: Vec<_> = loop_backing_files()
        .into_iter()
        .filter(|l| l.contains(RBDKIT_HOST_DIR) || l.contains(&image))
        .collect();
    assert!(loops.is_empty(), "loop devices left: {loops:?}");
    // The mapper serves no file for the image any more.
    let served: Vec<String> = std::fs::read_dir(format!("{RBDKIT_HOST_DIR}/fuse/mnt"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        !served.iter().any(|f| f.contains(&image)),
        "still mapped: {served:?}"
    );
}

/// Claims 1 and 2 of issue 9 against an installed rbdkit.
async fn claims(stack: &Stack, client: &kube::Client) {
    // 1. A filesystem claim: written by one pod, read by the next.
    let pv = bound_claim(client, "fs-claim", "Filesystem", "1Gi").await;
    let tag = format!("written-by-a-pod-{}", std::process::id());
    run_pod(
        client,
        pod(
            "writer",
            &stack.busybox,
            &format!("echo {tag} > /data/file && sync"),
            "fs-claim",
            false,
        ),
    )
    .await;
    run_pod(
        client,
        pod(
            "reader",
            &stack.busybox,
            &format!("test \"$(cat /data/file)\" = {tag}"),
            "fs-claim",
            false,
        ),
    )
    .await;
    delete_claim_leaves_nothing(stack, client, "fs-claim", &pv).await;

    // 2. A block claim: raw bytes from a pod, read back with the library.
    let pv = bound_claim(client, "block-claim", "Block", "64Mi").await;
    let offset = 1 << 20;
    let bytes = format!("raw-bytes-from-a-pod-{}", std::process::id());
    run_pod(
        client,
        pod(
            "block-writer",
            &stack.busybox,
            &format!(
                "printf %s {bytes} | dd of=/dev/xvda bs=4096 seek={} conv=notrunc,fsync",
                offset / 4096
            ),
            "block-claim",
            true,
        ),
    )
    .await;
    let got = stack.read_image(&image_of(&pv), offset, bytes.len());
    assert_eq!(String::from_utf8_lossy(&got), bytes);
    delete_claim_leaves_nothing(stack, client, "block-claim", &pv).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_manifests_run_filesystem_and_block_claims() {
    let _one = ONE_NODE.lock().await;
    let stack = Stack::up("deploy");
    let client = stack.cp.client().await;
    let clusters = clusters_json(&stack);
    let mut objects: Vec<Value> = install_manifests()
        .into_iter()
        .map(|(_, mut d)| {
            if d["kind"] == "ConfigMap" && d["metadata"]["name"] == "rbdkit-clusters" {
                d["data"]["config.json"] = json!(clusters.to_string());
            }
            d
        })
        .collect();
    objects.extend(example_objects(&stack));
    install(&client, &objects).await;
    claims(&stack, &client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_chart_runs_filesystem_and_block_claims() {
    let _one = ONE_NODE.lock().await;
    let stack = Stack::up("helm");
    let client = stack.cp.client().await;
    let clusters = format!("clusters={}", clusters_json(&stack));
    let mut objects: Vec<Value> = helm_template(&["--set-json", &clusters])
        .into_iter()
        .map(|(_, d)| d)
        .collect();
    objects.extend(example_objects(&stack));
    install(&client, &objects).await;
    claims(&stack, &client).await;
}
