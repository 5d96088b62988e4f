//! csi-addons NetworkFences, reconciled by the provisioner itself.
//!
//! **Why here, and not through csi-addons' sidecar.** rbdkit runs no
//! sidecars: the csi-addons controller reaches a driver only through its
//! own sidecar's gRPC, and the provisioner already holds every class's
//! secrets and the leader lease. So the leader reconciles csi-addons' own
//! objects, with their group, version, fields, status and finalizer: a
//! NetworkFence written for ceph-csi works unchanged once its class names
//! this provisioner. (The out-of-service taint,
//! [`crate::provisioner::out_of_service`], fences a node without any of
//! this.)
//!
//! **NetworkFence** (`csiaddons.openshift.io/v1alpha1`, cluster-scoped) is
//! ours when its NetworkFenceClass's `provisioner` (or its deprecated
//! `spec.driver`) is this provisioner's name. `fenceState: Fenced`
//! range-blocklists each of `spec.cidrs` for five years
//! ([`node_fence::fence_ranges`]); `Unfenced` lifts them. A malformed
//! block, one wider than a /16 (IPv4) or /48 (IPv6), and one that holds a
//! monitor's, an OSD's, a manager's or the provisioner's own address are
//! refused by name with nothing fenced ([`node_fence::check_cidrs`]).
//! Credentials: the class's `csiaddons.openshift.io/networkfence-secret-name`
//! and `-namespace` parameters (or the deprecated `spec.secret`); the
//! cluster: its `clusterID` parameter. The status is csi-addons': `result`
//! Succeeded or Failed, and `message` ("fencing operation successful",
//! "unfencing operation successful", or why not). The finalizer is
//! csi-addons' too, added before anything is done and taken off on delete,
//! which, as in csi-addons, does not unfence: set `Unfenced` first.
//! Lifting needs mon cap `allow command "osd blocklist"`; range entries
//! need Ceph 16.2.11, 17.2.1 or later.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Config};
use kube::runtime::{watcher, Controller};
use kube::{Resource, ResourceExt};
use serde::Deserialize;
use serde_json::json;

use crate::provisioner::controller::{edit_meta, Context, ReconcileError};
use crate::volume::node_fence;
use crate::volume::ops::VolumeError;
use crate::volume::params::SecretRef;

/// The csi-addons API group.
pub const CSIADDONS_GROUP: &str = "csiaddons.openshift.io";
/// csi-addons' finalizer on a NetworkFence it acted on.
pub const NETWORK_FENCE_FINALIZER: &str = "csiaddons.openshift.io/network-fence";
/// NetworkFenceClass parameter: the Secret's name.
pub const FENCE_SECRET_NAME: &str = "csiaddons.openshift.io/networkfence-secret-name";
/// NetworkFenceClass parameter: the Secret's namespace.
pub const FENCE_SECRET_NAMESPACE: &str = "csiaddons.openshift.io/networkfence-secret-namespace";
/// How often the CRD is looked for while it is not installed.
const CRD_POLL: std::time::Duration = std::time::Duration::from_secs(60);

/// `csiaddons.openshift.io/v1alpha1` NetworkFence (the fields used).
#[derive(Debug, Clone, Deserialize)]
pub struct NetworkFence {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The spec.
    #[serde(default)]
    pub spec: NetworkFenceSpec,
    /// The status.
    #[serde(default)]
    pub status: Option<NetworkFenceStatus>,
}

/// `NetworkFence.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkFenceSpec {
    /// The NetworkFenceClass (preferred).
    #[serde(default)]
    pub network_fence_class_name: String,
    /// The driver (deprecated, without a class).
    #[serde(default)]
    pub driver: String,
    /// `Fenced` (the default) or `Unfenced`.
    #[serde(default)]
    pub fence_state: String,
    /// The CIDR blocks.
    #[serde(default)]
    pub cidrs: Vec<String>,
    /// The Secret (deprecated, without a class).
    #[serde(default)]
    pub secret: FenceSecret,
    /// Parameters (deprecated, without a class).
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

/// `NetworkFence.spec.secret`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct FenceSecret {
    /// Its name.
    #[serde(default)]
    pub name: String,
    /// Its namespace.
    #[serde(default)]
    pub namespace: String,
}

/// `NetworkFence.status`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct NetworkFenceStatus {
    /// `Succeeded` or `Failed`.
    #[serde(default)]
    pub result: String,
    /// What happened.
    #[serde(default)]
    pub message: String,
}

/// `csiaddons.openshift.io/v1alpha1` NetworkFenceClass (the fields used).
#[derive(Debug, Clone, Deserialize)]
pub struct NetworkFenceClass {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The spec.
    #[serde(default)]
    pub spec: NetworkFenceClassSpec,
}

/// `NetworkFenceClass.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct NetworkFenceClassSpec {
    /// The driver (provisioner) name.
    #[serde(default)]
    pub provisioner: String,
    /// Driver parameters, with the Secret's keys.
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

macro_rules! csiaddons_resource {
    ($t:ty, $kind:literal, $plural:literal) => {
        impl Resource for $t {
            type DynamicType = ();
            type Scope = kube::core::ClusterResourceScope;
            fn kind(_: &()) -> Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> Cow<'_, str> {
                CSIADDONS_GROUP.into()
            }
            fn version(_: &()) -> Cow<'_, str> {
                "v1alpha1".into()
            }
            fn plural(_: &()) -> Cow<'_, str> {
                $plural.into()
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}
csiaddons_resource!(NetworkFence, "NetworkFence", "networkfences");
csiaddons_resource!(
    NetworkFenceClass,
    "NetworkFenceClass",
    "networkfenceclasses"
);

/// What a NetworkFence of ours asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceRequest {
    /// Fence (true) or lift.
    pub fenced: bool,
    /// The cluster.
    pub cluster_id: String,
    /// The credentials.
    pub secret: SecretRef,
    /// The blocks, as given.
    pub cidrs: Vec<String>,
}

/// The request of `nf`, with its class's parameters (`None` when the
/// class is not found); `Ok(None)` when it is another driver's.
pub fn fence_request(
    nf: &NetworkFence,
    class: Option<&NetworkFenceClass>,
    provisioner: &str,
) -> Result<Option<FenceRequest>, String> {
    let spec = &nf.spec;
    let (params, secret) = if !spec.network_fence_class_name.is_empty() {
        let Some(class) = class else {
            return Err(format!(
                "NetworkFenceClass {:?} not found",
                spec.network_fence_class_name
            ));
        };
        if class.spec.provisioner != provisioner {
            return Ok(None);
        }
        let p = &class.spec.parameters;
        let secret = match (p.get(FENCE_SECRET_NAMESPACE), p.get(FENCE_SECRET_NAME)) {
            (Some(ns), Some(n)) if !ns.is_empty() && !n.is_empty() => SecretRef {
                namespace: ns.clone(),
                name: n.clone(),
            },
            _ => {
                return Err(format!(
                    "NetworkFenceClass {:?} names no Secret: set its parameters {FENCE_SECRET_NAME} and {FENCE_SECRET_NAMESPACE}",
                    spec.network_fence_class_name
                ))
            }
        };
        let mut params = spec.parameters.clone();
        params.extend(
            p.iter()
                .filter(|(k, _)| *k != FENCE_SECRET_NAME && *k != FENCE_SECRET_NAMESPACE)
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        (params, secret)
    } else {
        if spec.driver != provisioner {
            return Ok(None);
        }
        if spec.secret.name.is_empty() || spec.secret.namespace.is_empty() {
            return Err("spec.secret names no Secret (name and namespace)".into());
        }
        (
            spec.parameters.clone(),
            SecretRef {
                namespace: spec.secret.namespace.clone(),
                name: spec.secret.name.clone(),
            },
        )
    };
    let fenced = match spec.fence_state.as_str() {
        "" | "Fenced" => true,
        "Unfenced" => false,
        other => {
            return Err(format!(
                "spec.fenceState {other:?} is neither Fenced nor Unfenced"
            ))
        }
    };
    let cluster_id = params
        .get("clusterID")
        .filter(|c| !c.is_empty())
        .cloned()
        .ok_or_else(|| "the parameters have no clusterID".to_owned())?;
    if spec.cidrs.is_empty() {
        return Err("spec.cidrs is empty".into());
    }
    Ok(Some(FenceRequest {
        fenced,
        cluster_id,
        secret,
        cidrs: spec.cidrs.clone(),
    }))
}

async fn set_fence_status(
    ctx: &Context,
    name: &str,
    nf: &NetworkFence,
    ok: bool,
    message: &str,
) -> Result<(), kube::Error> {
    let result = if ok { "Succeeded" } else { "Failed" };
    let message = crate::k8s::events::clip(message);
    let same = nf
        .status
        .as_ref()
        .is_some_and(|s| s.result == result && s.message == message);
    if same {
        return Ok(());
    }
    let patch = json!({"status": {"result": result, "message": message}});
    Api::<NetworkFence>::all(ctx.client.clone())
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(drop)
}

/// Reconciles a NetworkFence.
pub async fn reconcile(nf: Arc<NetworkFence>, ctx: Arc<Context>) -> Result<Action, ReconcileError> {
    let name = nf.name_any();
    let class = if nf.spec.network_fence_class_name.is_empty() {
        None
    } else {
        Api::<NetworkFenceClass>::all(ctx.client.clone())
            .get_opt(&nf.spec.network_fence_class_name)
            .await?
    };
    // Not ours: another driver's class, or no class of ours to tell.
    if class
        .as_ref()
        .is_some_and(|c| c.spec.provisioner != ctx.name)
        || (class.is_none() && nf.spec.driver != ctx.name)
    {
        return Ok(Action::await_change());
    }
    let key = format!("networkfence/{name}");
    let api: Api<NetworkFence> = Api::all(ctx.client.clone());
    if nf.metadata.deletion_timestamp.is_some() {
        edit_meta(
            &api,
            &name,
            NETWORK_FENCE_FINALIZER,
            false,
            &BTreeMap::new(),
        )
        .await?;
        return Ok(Action::await_change());
    }
    let request = match fence_request(&nf, class.as_ref(), &ctx.name) {
        Ok(Some(r)) => r,
        Ok(None) => return Ok(Action::await_change()),
        Err(why) => {
            // Bad input: said in the status, not retried until it changes.
            let why = format!("NetworkFence {name}: {why}");
            ctx.events
                .warning(&nf.object_ref(&()), "NetworkFenceFailed", &why)
                .await;
            set_fence_status(&ctx, &name, &nf, false, &why).await?;
            return Ok(Action::await_change());
        }
    };
    let out = ctx
        .limiter
        .scoped(apply_fence(&ctx, &api, &nf, &request))
        .await;
    match out {
        Ok(()) => {
            ctx.pv_failures.succeeded(&key);
            let msg = if request.fenced {
                "fencing operation successful"
            } else {
                "unfencing operation successful"
            };
            set_fence_status(&ctx, &name, &nf, true, msg).await?;
            Ok(Action::await_change())
        }
        Err((why, retry)) => {
            let why = format!("NetworkFence {name}: {why}");
            ctx.events
                .warning(&nf.object_ref(&()), "NetworkFenceFailed", &why)
                .await;
            set_fence_status(&ctx, &name, &nf, false, &why).await?;
            if retry {
                Err(ReconcileError(why))
            } else {
                Ok(Action::await_change())
            }
        }
    }
}

/// Fences or lifts; the error says whether a retry may help (not for a
/// refused block).
async fn apply_fence(
    ctx: &Context,
    api: &Api<NetworkFence>,
    nf: &NetworkFence,
    r: &FenceRequest,
) -> Result<(), (String, bool)> {
    let cidrs = node_fence::parse_cidrs(&r.cidrs).map_err(|e| (e.to_string(), false))?;
    edit_meta(
        api,
        &nf.name_any(),
        NETWORK_FENCE_FINALIZER,
        true,
        &BTreeMap::new(),
    )
    .await
    .map_err(|e| (format!("Kubernetes API: {e}"), true))?;
    let conn = ctx
        .connect(&r.cluster_id, &r.secret)
        .await
        .map_err(|e| (e, true))?;
    let fenced = r.fenced;
    let what = r.cidrs.join(",");
    let out = ctx
        .ceph(&conn, move |c, _m, f| {
            if fenced {
                f.check("osd blocklist range add", &what)
                    .map_err(VolumeError::Ceph)?;
                node_fence::check_cidrs(&cidrs, &node_fence::protected_addresses(c)?)?;
                node_fence::fence_ranges(c, &cidrs)
            } else {
                f.check("osd blocklist range rm", &what)
                    .map_err(VolumeError::Ceph)?;
                node_fence::unfence_ranges(c, &cidrs)
            }
        })
        .await;
    match out {
        Ok(()) => {
            tracing::info!(fence = %nf.name_any(), cidrs = ?r.cidrs, fenced, "network fence applied");
            Ok(())
        }
        Err(e @ VolumeError::Refused { .. }) => Err((e.to_string(), false)),
        Err(VolumeError::Ceph(e))
            if e.kind() == crate::ErrorKind::PermissionDenied && !fenced =>
        {
            Err((
                format!(
                    "{e} (removing a blocklist entry needs the mon cap `allow command \"osd blocklist\"`)"
                ),
                true,
            ))
        }
        Err(e) => Err((e.to_string(), true)),
    }
}

/// Requeues a failed NetworkFence after its backoff.
pub fn error_policy(nf: Arc<NetworkFence>, err: &ReconcileError, ctx: Arc<Context>) -> Action {
    let delay = ctx
        .pv_failures
        .failed(&format!("networkfence/{}", nf.name_any()));
    tracing::warn!(fence = %nf.name_any(), error = %err, retry_in = ?delay, "network fence not done; will retry");
    Action::requeue(delay)
}

/// Runs the NetworkFence controller until `shutdown` resolves, once the
/// CRD is installed (looked for every minute until then).
pub async fn run(
    ctx: Arc<Context>,
    config: Config,
    shutdown: impl std::future::Future<Output = ()> + Clone + Send + Sync + 'static,
) {
    let mut said = false;
    loop {
        let api: Api<NetworkFence> = Api::all(ctx.client.clone());
        match api.list_metadata(&ListParams::default().limit(1)).await {
            Ok(_) => break,
            Err(e) if !said => {
                tracing::info!(error = %e, "csi-addons NetworkFence CRD not served: NetworkFences are not handled until it is (looking again every minute)");
                said = true;
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = shutdown.clone() => return,
            _ = tokio::time::sleep(CRD_POLL) => {}
        }
    }
    tracing::info!("csi-addons NetworkFence CRD found: handling NetworkFences");
    let fences: Api<NetworkFence> = Api::all(ctx.client.clone());
    Controller::new(fences, watcher::Config::default().any_semantic())
        .with_config(config)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "network fence controller");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nf(spec: serde_json::Value) -> NetworkFence {
        serde_json::from_value(json!({"metadata": {"name": "f"}, "spec": spec})).unwrap()
    }

    fn class(provisioner: &str, params: serde_json::Value) -> NetworkFenceClass {
        serde_json::from_value(json!({"metadata": {"name": "c"},
            "spec": {"provisioner": provisioner, "parameters": params}}))
        .unwrap()
    }

    #[test]
    fn fence_requests_are_read_as_csi_addons_writes_them() {
        let c = class(
            "rbd.rbdkit.io",
            json!({"clusterID": "c1", FENCE_SECRET_NAME: "s", FENCE_SECRET_NAMESPACE: "ns"}),
        );
        let f = nf(json!({"networkFenceClassName": "c", "fenceState": "Fenced",
            "cidrs": ["10.9.0.0/24"]}));
        let r = fence_request(&f, Some(&c), "rbd.rbdkit.io")
            .unwrap()
            .unwrap();
        assert!(r.fenced);
        assert_eq!(r.cluster_id, "c1");
        assert_eq!(r.secret.to_string(), "ns/s");
        assert_eq!(r.cidrs, vec!["10.9.0.0/24".to_owned()]);
        // Another driver's class: not ours.
        let other = class("rbd.csi.ceph.com", json!({}));
        assert_eq!(fence_request(&f, Some(&other), "rbd.rbdkit.io"), Ok(None));
        // The deprecated form.
        let f = nf(json!({"driver": "rbd.rbdkit.io", "fenceState": "Unfenced",
            "cidrs": ["10.9.0.0/24"], "secret": {"name": "s", "namespace": "ns"},
            "parameters": {"clusterID": "c1"}}));
        let r = fence_request(&f, None, "rbd.rbdkit.io").unwrap().unwrap();
        assert!(!r.fenced);
        // Bad input, named.
        for (spec, why) in [
            (
                json!({"networkFenceClassName": "gone", "cidrs": ["10.9.0.0/24"]}),
                "not found",
            ),
            (
                json!({"driver": "rbd.rbdkit.io", "cidrs": ["10.9.0.0/24"],
                "secret": {"name": "s", "namespace": "ns"}}),
                "clusterID",
            ),
            (
                json!({"driver": "rbd.rbdkit.io", "cidrs": [],
                "secret": {"name": "s", "namespace": "ns"}, "parameters": {"clusterID": "c"}}),
                "cidrs",
            ),
            (
                json!({"driver": "rbd.rbdkit.io", "cidrs": ["10.9.0.0/24"], "fenceState": "Maybe",
                "secret": {"name": "s", "namespace": "ns"}, "parameters": {"clusterID": "c"}}),
                "Maybe",
            ),
            (
                json!({"driver": "rbd.rbdkit.io", "cidrs": ["10.9.0.0/24"]}),
                "spec.secret",
            ),
        ] {
            let e = fence_request(&nf(spec), None, "rbd.rbdkit.io").unwrap_err();
            assert!(e.contains(why), "{e}");
        }
        let no_secret = class("rbd.rbdkit.io", json!({"clusterID": "c1"}));
        let f = nf(json!({"networkFenceClassName": "c", "cidrs": ["10.9.0.0/24"]}));
        let e = fence_request(&f, Some(&no_secret), "rbd.rbdkit.io").unwrap_err();
        assert!(e.contains(FENCE_SECRET_NAME), "{e}");
    }
}
