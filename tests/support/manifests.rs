//! The deploy/ manifests as the tests load them: the YAML files themselves,
//! and the Helm chart (`deploy/helm/rbdkit`) rendered by the project's own
//! helm (`scripts/helm`, built from its Go module and cached).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::de::DeserializeOwned;
use serde_json::Value;

/// `deploy/` in the source tree.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// The chart in `deploy/helm/rbdkit`.
pub fn chart_dir() -> PathBuf {
    deploy_dir().join("helm/rbdkit")
}

/// The non-empty documents of a multi-document YAML text; `what` names it in
/// a parse error.
pub fn parse_docs(what: &str, text: &str) -> Vec<Value> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(text).unwrap_or_else(|e| panic!("{what}: {e}"));
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

/// Every document of every `*.yaml` file directly in `dir` (sorted by file
/// name), with its file.
pub fn yaml_dir(dir: &Path) -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let name = f.display().to_string();
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{name}: {e}"));
        out.extend(
            parse_docs(&name, &text)
                .into_iter()
                .map(|d| (name.clone(), d)),
        );
    }
    out
}

/// Every document under deploy/ and deploy/example/, with its file.
pub fn manifests() -> Vec<(String, Value)> {
    let mut out = yaml_dir(&deploy_dir());
    out.extend(yaml_dir(&deploy_dir().join("example")));
    out
}

/// The objects a user applies to install rbdkit: deploy/*.yaml (not the
/// example), with their files.
pub fn install_manifests() -> Vec<(String, Value)> {
    yaml_dir(&deploy_dir())
}

/// A document as the typed object `T`.
pub fn typed<T: DeserializeOwned>(file: &str, v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{file}: {e}\n{v:#}"))
}

/// The one document of `kind` in `docs`, typed.
pub fn one<T: DeserializeOwned>(docs: &[(String, Value)], kind: &str) -> T {
    let found: Vec<&(String, Value)> = docs.iter().filter(|(_, d)| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "expected one {kind}");
    typed(&found[0].0, &found[0].1)
}

/// The one document of `kind` named `name` in `docs`, typed.
pub fn named<T: DeserializeOwned>(docs: &[(String, Value)], kind: &str, name: &str) -> T {
    let found: Vec<&(String, Value)> = docs
        .iter()
        .filter(|(_, d)| d["kind"] == kind && d["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "expected one {kind} {name}");
    typed(&found[0].0, &found[0].1)
}

/// The ConfigMap with the clusters config (deploy/ also has the KMS one).
pub const CLUSTERS_CONFIGMAP: &str = "rbdkit-clusters";

/// How long a helm run may take: the first one builds helm from its Go
/// module (about 95 s on the 2-core machine; longer when it is busy).
pub const HELM_TIMEOUT_SECS: u32 = 1800;

/// Runs `scripts/helm ARGS...` (bounded by `timeout`), returning its
/// success, stdout and stderr.
pub fn helm(args: &[&str]) -> (bool, String, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/helm");
    let out = Command::new("timeout")
        .arg(HELM_TIMEOUT_SECS.to_string())
        .arg(&script)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The chart rendered by `helm template rbdkit deploy/helm/rbdkit EXTRA...`
/// (e.g. `--set`, `--values FILE`), one entry per object, with the template
/// it came from.
pub fn helm_template(extra: &[&str]) -> Vec<(String, Value)> {
    let chart = chart_dir();
    let mut args = vec!["template", "rbdkit", chart.to_str().unwrap()];
    args.extend_from_slice(extra);
    let (ok, stdout, stderr) = helm(&args);
    assert!(ok, "helm {args:?} failed:\n{stderr}");
    // Each document starts with "# Source: rbdkit/templates/FILE".
    stdout
        .split("\n---")
        .flat_map(|doc| {
            let source = doc
                .lines()
                .find_map(|l| l.strip_prefix("# Source: "))
                .unwrap_or("helm template")
                .to_owned();
            parse_docs(&source, doc)
                .into_iter()
                .map(move |d| (source.clone(), d))
        })
        .collect()
}

/// Server-side applies one manifest document.
pub async fn apply(client: &kube::Client, doc: &serde_json::Value) {
    let api_version = doc["apiVersion"].as_str().unwrap();
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let kind = doc["kind"].as_str().unwrap();
    let plural = format!("{}s", kind.to_lowercase()).replace("classs", "classes");
    let ar = kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(group, version, kind),
        &plural,
    );
    let api: kube::Api<kube::api::DynamicObject> = match doc["metadata"]["namespace"].as_str() {
        Some(ns) => kube::Api::namespaced_with(client.clone(), ns, &ar),
        None => kube::Api::all_with(client.clone(), &ar),
    };
    api.patch(
        doc["metadata"]["name"].as_str().unwrap(),
        &kube::api::PatchParams::apply("rbdkit-tests").force(),
        &kube::api::Patch::Apply(doc),
    )
    .await
    .unwrap_or_else(|e| panic!("apply {kind}: {e}"));
}
