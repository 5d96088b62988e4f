//! The Helm chart `deploy/helm/rbdkit`, rendered by helm built from its Go
//! module (`scripts/helm`): by default it renders exactly the objects of
//! deploy/*.yaml (compared as objects, not text); `helm lint --strict` is
//! clean; and each value changes what it names, everywhere it is used.
use crate::support;

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Container};
use k8s_openapi::api::storage::v1::CSIDriver;
use serde_json::{json, Value};

use rbdkit::volume::clusters::ClustersConfig;
use support::manifests::{helm, helm_template, install_manifests, named, one, CLUSTERS_CONFIGMAP};

/// Objects by "kind namespace/name", with the JSON text of ConfigMap data
/// parsed (the chart writes config.json with its own indentation).
fn by_key(docs: &[(String, Value)]) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for (file, d) in docs {
        let mut d = d.clone();
        if d["kind"] == "ConfigMap" {
            if let Some(data) = d["data"].as_object_mut() {
                for (k, v) in data.iter_mut() {
                    if k.ends_with(".json") {
                        let text = v.as_str().unwrap_or_default();
                        *v = serde_json::from_str(text)
                            .unwrap_or_else(|e| panic!("{file}: data {k}: {e}"));
                    }
                }
            }
        }
        let key = format!(
            "{} {}/{}",
            d["kind"].as_str().unwrap_or("?"),
            d["metadata"]["namespace"].as_str().unwrap_or(""),
            d["metadata"]["name"].as_str().unwrap_or("?")
        );
        assert!(out.insert(key.clone(), d).is_none(), "{file}: {key} twice");
    }
    out
}

#[test]
fn default_values_render_the_objects_of_deploy() {
    let files = by_key(&install_manifests());
    let chart = by_key(&helm_template(&[]));
    assert_eq!(
        files.keys().collect::<Vec<_>>(),
        chart.keys().collect::<Vec<_>>(),
        "the chart and deploy/*.yaml have different objects"
    );
    for (key, want) in &files {
        let got = &chart[key];
        assert!(
            got == want,
            "{key} differs:\nchart:\n{}\ndeploy/:\n{}",
            serde_json::to_string_pretty(got).unwrap(),
            serde_json::to_string_pretty(want).unwrap()
        );
    }
    // Sanity of the comparison itself: every kind deploy/ installs is there.
    for kind in [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Deployment",
        "CSIDriver",
        "DaemonSet",
    ] {
        assert!(
            files.keys().any(|k| k.starts_with(&format!("{kind} "))),
            "deploy/ has no {kind}"
        );
    }
}

#[test]
fn helm_lint_is_clean() {
    let chart = support::manifests::chart_dir();
    let (ok, stdout, stderr) = helm(&["lint", "--strict", chart.to_str().unwrap()]);
    assert!(ok, "helm lint --strict failed:\n{stdout}\n{stderr}");
    assert!(
        !stdout.contains("[WARNING]") && !stdout.contains("[ERROR]"),
        "helm lint:\n{stdout}"
    );
    assert!(
        stdout.contains("1 chart(s) linted, 0 chart(s) failed"),
        "{stdout}"
    );
}

fn container<'a>(containers: &'a [Container], name: &str) -> &'a Container {
    containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn args(c: &Container) -> Vec<String> {
    c.args.clone().unwrap_or_default()
}

#[test]
fn values_change_what_they_name() {
    let clusters = json!([
        {"clusterID": "east", "monitors": ["192.0.2.1:6789"]},
        {"clusterID": "west", "monitors": ["192.0.2.2:6789", "192.0.2.3:3300"],
         "rbd": {"radosNamespace": "k8s"}}
    ]);
    let clusters_arg = format!("clusters={clusters}");
    let docs = helm_template(&[
        "--set",
        "image.repository=registry.example/rbdkit",
        "--set",
        "image.tag=v9",
        "--set",
        "image.pullPolicy=Always",
        "--set",
        "registrarImage.repository=registry.example/registrar",
        "--set",
        "driverName=block.example.io",
        "--set",
        "namespace=storage",
        "--set",
        "createNamespace=false",
        "--set",
        "node.kubeletDir=/data/kubelet",
        "--set",
        "provisioner.replicas=3",
        "--set",
        "provisioner.httpPort=9090",
        "--set",
        "provisioner.resources.limits.memory=1Gi",
        "--set",
        "logLevel=debug",
        "--set-json",
        &clusters_arg,
    ]);
    assert!(!docs.iter().any(|(_, d)| d["kind"] == "Namespace"));
    for (file, d) in &docs {
        if d["kind"] != "CSIDriver" && !d["kind"].as_str().unwrap().starts_with("Cluster") {
            assert_eq!(d["metadata"]["namespace"], "storage", "{file}");
        }
    }
    let driver: CSIDriver = one(&docs, "CSIDriver");
    assert_eq!(driver.metadata.name.as_deref(), Some("block.example.io"));

    let cm: ConfigMap = named(&docs, "ConfigMap", CLUSTERS_CONFIGMAP);
    let text = &cm.data.unwrap()["config.json"];
    let parsed: Value = serde_json::from_str(text).unwrap();
    assert_eq!(parsed, clusters);
    let config = ClustersConfig::parse(text).unwrap();
    assert_eq!(config.ids().len(), 2, "{text}");
    assert!(config.get("west").is_some(), "{text}");

    let dep: Deployment = one(&docs, "Deployment");
    let spec = dep.spec.unwrap();
    assert_eq!(spec.replicas, Some(3));
    let pod = spec.template.spec.unwrap();
    let p = container(&pod.containers, "provisioner");
    assert_eq!(p.image.as_deref(), Some("registry.example/rbdkit:v9"));
    assert_eq!(p.image_pull_policy.as_deref(), Some("Always"));
    let a = args(p);
    assert!(a.contains(&"--name=block.example.io".to_owned()), "{a:?}");
    assert!(a.contains(&"--http-addr=0.0.0.0:9090".to_owned()), "{a:?}");
    assert_eq!(p.ports.as_ref().unwrap()[0].container_port, 9090);
    let limits = p.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert_eq!(limits["memory"].0, "1Gi");
    let env = p.env.as_ref().unwrap();
    assert!(env
        .iter()
        .any(|e| e.name == "RUST_LOG" && e.value.as_deref() == Some("debug")));

    let ds: DaemonSet = one(&docs, "DaemonSet");
    let pod = ds.spec.unwrap().template.spec.unwrap();
    for name in ["rbdkit-csi", "rbdkit-fuse-mapper"] {
        let c = container(&pod.containers, name);
        assert_eq!(
            c.image.as_deref(),
            Some("registry.example/rbdkit:v9"),
            "{name}"
        );
    }
    let reg = container(&pod.containers, "node-driver-registrar");
    assert_eq!(
        reg.image.as_deref(),
        Some("registry.example/registrar:v2.13.0")
    );
    assert!(args(reg).contains(
        &"--kubelet-registration-path=/data/kubelet/plugins/block.example.io/csi.sock".to_owned()
    ));
    let csi = container(&pod.containers, "rbdkit-csi");
    assert!(args(csi).contains(&"--driver-name=block.example.io".to_owned()));
    assert!(csi
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .any(|m| m.mount_path == "/data/kubelet"
            && m.mount_propagation.as_deref() == Some("Bidirectional")));
    let host_paths: Vec<&str> = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .filter_map(|v| v.host_path.as_ref().map(|h| h.path.as_str()))
        .collect();
    for want in [
        "/data/kubelet",
        "/data/kubelet/plugins/block.example.io",
        "/data/kubelet/plugins_registry",
    ] {
        assert!(host_paths.contains(&want), "{want} not in {host_paths:?}");
    }
    assert!(
        !host_paths.iter().any(|p| p.contains("/var/lib/kubelet")),
        "{host_paths:?}"
    );
}
