//! The csi-addons CRDs of group `csiaddons.openshift.io` (NetworkFence,
//! NetworkFenceClass, ReclaimSpaceJob, ReclaimSpaceCronJob,
//! EncryptionKeyRotationJob) from the Go module
//! pinned in `tests/csi-addons` (`scripts/csi-addons-crds`), installed once
//! per process. No csi-addons controller runs: rbdkit's provisioner
//! reconciles them.

use std::path::Path;
use std::process::{Command, Stdio};

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::Api;
use tokio::sync::OnceCell;

/// The csi-addons API group.
pub const GROUP: &str = "csiaddons.openshift.io";

/// Installs the CRDs (idempotent; once per process).
pub async fn install_crds(client: &kube::Client) {
    static DONE: OnceCell<()> = OnceCell::const_new();
    DONE.get_or_init(|| async {
        let files = tokio::task::spawn_blocking(|| {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/csi-addons-crds");
            let out = Command::new(&script)
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
            assert!(
                out.status.success(),
                "{} failed ({}):\n{}",
                script.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|f| f.contains("/csiaddons.openshift.io_"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .await
        .expect("csi-addons-crds");
        assert_eq!(files.len(), 5, "expected five CRD files, got {files:?}");
        super::k8s::apply_crds(client, &files).await;
    })
    .await;
}

/// A cluster-scoped csi-addons kind (`NetworkFence`, `NetworkFenceClass`).
pub fn cluster_api(client: &kube::Client, kind: &str) -> Api<DynamicObject> {
    let plural = format!("{}s", kind.to_lowercase()).replace("classs", "classes");
    let r =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1alpha1", kind), &plural);
    Api::all_with(client.clone(), &r)
}

/// A namespaced csi-addons kind (`ReclaimSpaceJob`,
/// `ReclaimSpaceCronJob`) in `ns`.
pub fn namespaced_api(client: &kube::Client, ns: &str, kind: &str) -> Api<DynamicObject> {
    let plural = format!("{}s", kind.to_lowercase());
    let r =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1alpha1", kind), &plural);
    Api::namespaced_with(client.clone(), ns, &r)
}
