//! The CSI deploy manifests (`deploy/csidriver.yaml`, `deploy/node-daemonset.yaml`):
//! the DaemonSet's containers' args parse with the real `rbdkit csi` and
//! `rbdkit fuse-mapper` parsers; it gives the node plugin the socket, mounts
//! and propagation it needs and agrees with the CSIDriver, the ConfigMap and
//! the provisioner's image; and every manifest under deploy/ passes a server-side dry run
//! against the real test API server.
use crate::support;

use std::path::Path;

use clap::Parser;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, Volume, VolumeMount};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::discovery::{self, Scope};
use kube::Api;
use serde_json::Value;

use rbdkit::csi::{CsiArgs, Mode};
use rbdkit::node::fuse_daemon::FuseMapperArgs;
use support::k8s::ControlPlane;
use support::manifests::{manifests, named, one, CLUSTERS_CONFIGMAP};

#[derive(Parser)]
struct CsiOnly {
    #[command(flatten)]
    args: CsiArgs,
}

#[derive(Parser)]
struct MapperOnly {
    #[command(flatten)]
    args: FuseMapperArgs,
}

/// A container's args after the subcommand `sub`, through the binary's own
/// parser `P`: an unknown flag or a bad value fails here.
fn parse_args<P: Parser>(c: &Container, sub: &str) -> P {
    let argv = c.args.as_deref().unwrap_or_default();
    assert_eq!(argv.first().map(String::as_str), Some(sub), "{}", c.name);
    P::try_parse_from(std::iter::once("rbdkit".to_owned()).chain(argv[1..].iter().cloned()))
        .unwrap_or_else(|e| panic!("{}: args {argv:?}: {e}", c.name))
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn container<'a>(pod: &'a PodSpec, name: &str) -> &'a Container {
    pod.containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// The value of `--name=value` in a container's args.
fn flag<'a>(c: &'a Container, name: &str) -> &'a str {
    let prefix = format!("{name}=");
    let found: Vec<&str> = c
        .args
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter_map(|a| a.strip_prefix(&prefix))
        .collect();
    assert_eq!(found.len(), 1, "{}: expected one {name}=...", c.name);
    found[0]
}

/// The mount of `c` at exactly `path`, and the pod volume behind it.
fn mount_at<'a>(pod: &'a PodSpec, c: &'a Container, path: &str) -> (&'a VolumeMount, &'a Volume) {
    let m = c
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|m| m.mount_path == path)
        .unwrap_or_else(|| panic!("{}: nothing mounted at {path}", c.name));
    let v = pod
        .volumes
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|v| v.name == m.name)
        .unwrap_or_else(|| panic!("no volume {}", m.name));
    (m, v)
}

fn host_path(v: &Volume) -> &str {
    &v.host_path
        .as_ref()
        .unwrap_or_else(|| panic!("volume {} is not a hostPath", v.name))
        .path
}

fn parent(path: &str) -> &str {
    Path::new(path).parent().unwrap().to_str().unwrap()
}

fn privileged(c: &Container) -> bool {
    c.security_context
        .as_ref()
        .and_then(|s| s.privileged)
        .unwrap_or(false)
}

#[test]
fn csidriver_matches_the_storage_class() {
    let docs = manifests();
    let driver: CSIDriver = one(&docs, "CSIDriver");
    let name = driver.metadata.name.clone().unwrap();
    assert_eq!(name, "rbd.rbdkit.io");
    let class: StorageClass = one(&docs, "StorageClass");
    assert_eq!(
        class.provisioner, name,
        "the example class uses this driver"
    );
    let spec = driver.spec;
    assert_eq!(spec.attach_required, Some(false));
    assert_eq!(spec.pod_info_on_mount, Some(false));
    assert_eq!(spec.fs_group_policy.as_deref(), Some("File"));
    assert_eq!(
        spec.volume_lifecycle_modes,
        Some(vec!["Persistent".to_owned()])
    );
}

#[test]
fn node_daemonset_gives_the_node_plugin_what_it_needs() {
    let docs = manifests();
    let driver: CSIDriver = one(&docs, "CSIDriver");
    let driver_name = driver.metadata.name.unwrap();
    let ds: DaemonSet = one(&docs, "DaemonSet");
    let ds_spec = ds.spec.unwrap();
    // Replacing the pod ends the rbdkit-fuse mappings: only after a drain.
    assert_eq!(
        ds_spec.update_strategy.and_then(|u| u.type_).as_deref(),
        Some("OnDelete")
    );
    let pod = ds_spec.template.spec.unwrap();
    assert_eq!(pod.containers.len(), 3);
    assert_eq!(
        pod.automount_service_account_token,
        Some(false),
        "the node plugin makes no API calls"
    );
    let registrar = container(&pod, "node-driver-registrar");
    let csi = container(&pod, "rbdkit-csi");
    let mapper = container(&pod, "rbdkit-fuse-mapper");

    // Registration: kubelet finds the socket under its plugins dir, named
    // after the driver, and the registrar and the driver share it.
    let reg_path = flag(registrar, "--kubelet-registration-path");
    assert_eq!(
        reg_path,
        format!("/var/lib/kubelet/plugins/{driver_name}/csi.sock")
    );
    let csi_address = flag(registrar, "--csi-address");
    let (_, socket_vol) = mount_at(&pod, registrar, parent(csi_address));
    assert_eq!(host_path(socket_vol), parent(reg_path));
    let (_, reg_vol) = mount_at(&pod, registrar, "/registration");
    assert_eq!(host_path(reg_vol), "/var/lib/kubelet/plugins_registry");

    // The CSI node service, its args as `rbdkit csi` parses them.
    let args = parse_args::<CsiOnly>(csi, "csi").args;
    assert_eq!(args.mode, Mode::Node);
    assert_eq!(args.driver_name, driver_name);
    assert_eq!(
        rbdkit::csi::socket_path(&args.endpoint).unwrap(),
        Path::new(csi_address)
    );
    let (_, v) = mount_at(&pod, csi, parent(csi_address));
    assert_eq!(
        v.name, socket_vol.name,
        "registrar and driver share the socket"
    );
    // kubelet expands $(NODE_NAME) from the env below.
    assert_eq!(args.node_id, "$(NODE_NAME)");
    assert_eq!(
        args.default_mapper, None,
        "krbd where /sys/bus/rbd exists, else rbdkit-fuse"
    );
    let (_, v) = mount_at(&pod, csi, "/sys");
    assert_eq!(host_path(v), "/sys");
    assert_eq!(args.sysfs_root, Path::new("/sys"));
    // The index of staged volumes outlives the container.
    let (_, v) = mount_at(&pod, csi, parent(path_str(&args.state_dir)));
    assert_eq!(host_path(v), parent(path_str(&args.state_dir)));
    let node_name = csi
        .env
        .as_deref()
        .unwrap()
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME env");
    let field = node_name.value_from.as_ref().unwrap().field_ref.as_ref();
    assert_eq!(field.unwrap().field_path, "spec.nodeName");
    // kubelet passes host paths under /var/lib/kubelet: the same path inside,
    // and mounts made there must propagate back to the host.
    let (m, v) = mount_at(&pod, csi, "/var/lib/kubelet");
    assert_eq!(host_path(v), "/var/lib/kubelet");
    assert_eq!(m.mount_propagation.as_deref(), Some("Bidirectional"));
    assert!(privileged(csi));
    let (_, v) = mount_at(&pod, csi, "/dev");
    assert_eq!(host_path(v), "/dev");
    // The clusters config comes from the ConfigMap.
    let config_path = path_str(&args.clusters_config);
    let (m, v) = mount_at(&pod, csi, parent(config_path));
    assert_eq!(m.read_only, Some(true));
    let configmap: ConfigMap = named(&docs, "ConfigMap", CLUSTERS_CONFIGMAP);
    assert_eq!(
        v.config_map.as_ref().unwrap().name,
        configmap.metadata.name.unwrap()
    );
    let key = Path::new(config_path)
        .file_name()
        .unwrap()
        .to_str()
        .unwrap();
    assert!(configmap.data.unwrap().contains_key(key));

    // The mapper: a container of its own, reached over a socket in a dir
    // both containers mount from the host.
    let margs = parse_args::<MapperOnly>(mapper, "fuse-mapper").args;
    assert!(
        !margs.no_supervisor,
        "the supervisor keeps mounts alive across worker restarts"
    );
    assert!(!margs.worker);
    let mapper_socket = path_str(&args.mapper_socket);
    assert_eq!(margs.socket, args.mapper_socket);
    let (_, a) = mount_at(&pod, csi, parent(mapper_socket));
    let (_, b) = mount_at(&pod, mapper, parent(mapper_socket));
    assert_eq!(a.name, b.name);
    assert!(host_path(a).starts_with('/'));
    // Its FUSE mounts (under the state dir) back the loop devices on the
    // host, so they must propagate there.
    let state_dir = path_str(&margs.state_dir);
    let (m, v) = mount_at(&pod, mapper, parent(state_dir));
    assert_eq!(host_path(v), parent(state_dir));
    assert_eq!(m.mount_propagation.as_deref(), Some("Bidirectional"));
    assert!(privileged(mapper));
    let (_, v) = mount_at(&pod, mapper, "/dev");
    assert_eq!(host_path(v), "/dev");
    assert!(!privileged(registrar));

    // The same image as the provisioner.
    let deployment: Deployment = one(&docs, "Deployment");
    let image = deployment.spec.unwrap().template.spec.unwrap().containers[0]
        .image
        .clone();
    assert_eq!(csi.image, image);
    assert_eq!(mapper.image, image);
}

/// Server-side apply of `doc` (`dry_run`: validated and admitted, not stored).
async fn apply(client: &kube::Client, doc: &Value, dry_run: bool) -> Result<(), kube::Error> {
    let (group, version) = match doc["apiVersion"].as_str().unwrap().split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", doc["apiVersion"].as_str().unwrap()),
    };
    let gvk = GroupVersionKind::gvk(group, version, doc["kind"].as_str().unwrap());
    let (resource, caps): (ApiResource, _) = discovery::pinned_kind(client, &gvk).await?;
    let api: Api<DynamicObject> = match (caps.scope, doc["metadata"]["namespace"].as_str()) {
        (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client.clone(), ns, &resource),
        (Scope::Namespaced, None) => Api::default_namespaced_with(client.clone(), &resource),
        (Scope::Cluster, _) => Api::all_with(client.clone(), &resource),
    };
    let mut params = PatchParams::apply("rbdkit-tests").force();
    params.dry_run = dry_run;
    let name = doc["metadata"]["name"].as_str().unwrap();
    api.patch(name, &params, &Patch::Apply(doc)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_manifest_passes_server_side_dry_run() {
    let client = ControlPlane::shared().client().await;
    // deploy/example has a VolumeSnapshotClass and a VolumeReplicationClass:
    // their CRDs must be there.
    support::snapshots::install_crds(&client).await;
    support::replication::install_crds(&client).await;
    let docs = manifests();
    // Namespaced objects can only be dry-run in a namespace that exists.
    for (file, d) in docs.iter().filter(|(_, d)| d["kind"] == "Namespace") {
        apply(&client, d, false)
            .await
            .unwrap_or_else(|e| panic!("{file}: applying the Namespace: {e}"));
    }
    let mut kinds = Vec::new();
    for (file, d) in docs.iter().filter(|(_, d)| d["kind"] != "Namespace") {
        apply(&client, d, true)
            .await
            .unwrap_or_else(|e| panic!("{file}: {} dry run: {e}", d["kind"]));
        kinds.push(d["kind"].as_str().unwrap().to_owned());
    }
    for kind in ["CSIDriver", "DaemonSet", "Deployment", "ConfigMap"] {
        assert!(kinds.iter().any(|k| k == kind), "no {kind} was dry-run");
    }

    // The dry run does validate: Bidirectional propagation in an
    // unprivileged container is refused.
    let (_, ds) = docs.iter().find(|(_, d)| d["kind"] == "DaemonSet").unwrap();
    let mut bad = ds.clone();
    let containers = bad["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .unwrap();
    let registrar = containers
        .iter_mut()
        .find(|c| c["name"] == "node-driver-registrar")
        .unwrap();
    registrar["volumeMounts"][0]["mountPropagation"] = "Bidirectional".into();
    let e = apply(&client, &bad, true)
        .await
        .expect_err("an unprivileged Bidirectional mount was accepted");
    assert!(
        e.to_string().contains("Bidirectional"),
        "unexpected refusal: {e}"
    );
}
