//! The VolumeReplication reconciler: csi-addons' replication API
//! (`replication.storage.openshift.io/v1alpha1` VolumeReplication and
//! VolumeReplicationClass, the same group, version and fields, so objects
//! made for ceph-csi by Ramen or ODF work unchanged) served by the
//! provisioner itself, with no csi-addons controller or sidecar: the
//! replication RPCs are all controller-side, and the provisioner already
//! holds the Ceph connections, the Secrets and the leader lease they need.
//! The Ceph work is [`crate::volume::replication`].
//!
//! A VolumeReplication is this provisioner's when its class's `provisioner`
//! is this provisioner's name. The reconcile follows csi-addons'
//! controller:
//! - `primary`: enable mirroring, promote (see
//!   [`crate::volume::replication::promote`] for when force is used; the
//!   annotation [`FORCE_PROMOTE`] asks for it), add the class's schedule;
//!   then every half interval read the peers' replay for `lastSyncTime`,
//!   `lastSyncDuration`, `lastSyncBytes` and the `Replicating` condition.
//! - `secondary`: demote; with `autoResync`, resync a copy in split brain;
//!   `Degraded` stays True until both copies are demoted and both daemons
//!   idle (when the other site may be promoted).
//! - `resync`: flag the (non-primary) copy for a full resync, once.
//! - deletion: disable mirroring (on the primary; the peers then drop their
//!   copies), then let the objects go.
//!
//! Conditions (`Completed`, `Degraded`, `Resyncing`, `Validated`,
//! `Replicating`) carry csi-addons' types, reasons and messages. Crash
//! safety: the finalizers go on (VolumeReplication, and the claim's
//! `pvc-protection`) before any Ceph step, each step is idempotent, and the
//! one that is not (a resync re-creates the image) is recorded in the
//! [`RESYNC_ANNOTATION`] first.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde::Deserialize;
use serde_json::json;

use crate::provisioner::controller::{edit_meta, Context, ReconcileError};
use crate::provisioner::crd::{self, cluster_resource, namespaced_resource};
use crate::volume::ops::VolumeError;
use crate::volume::params::SecretRef;
use crate::volume::replication::{self as repl, Force, Promoted, ReplicationParams};
use crate::volume::VolumeId;

/// The API group.
pub const GROUP: &str = "replication.storage.openshift.io";
/// The finalizer csi-addons puts on a VolumeReplication (the same one, so
/// tools that look for it find it).
pub const VR_FINALIZER: &str = "replication.storage.openshift.io";
/// The finalizer csi-addons puts on the claim of a VolumeReplication.
pub const PVC_FINALIZER: &str = "replication.storage.openshift.io/pvc-protection";
/// Claim annotation: the VolumeReplication that replicates it.
pub const PVC_OWNER_ANNOTATION: &str = "replication.storage.openshift.io/volume-replication-name";
/// Class parameter: the Secret's name to replicate with.
pub const SECRET_NAME: &str = "replication.storage.openshift.io/replication-secret-name";
/// Class parameter: that Secret's namespace.
pub const SECRET_NAMESPACE: &str = "replication.storage.openshift.io/replication-secret-namespace";
/// VolumeReplication annotation: `"true"` promotes with force even while a
/// peer site holds the volume as primary (a split brain until that copy is
/// demoted and resynced).
pub const FORCE_PROMOTE: &str = "rbdkit.io/force-promote";
/// VolumeReplication annotation: the image id a resync was asked for; the
/// daemon re-creates the image, so a new id means it is done.
pub const RESYNC_ANNOTATION: &str = "rbdkit.io/resync-requested";

/// `VolumeReplication.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeReplicationSpec {
    /// The class.
    #[serde(default)]
    pub volume_replication_class: String,
    /// `primary`, `secondary` or `resync`.
    #[serde(default)]
    pub replication_state: String,
    /// The claim (kind `PersistentVolumeClaim`).
    #[serde(default)]
    pub data_source: DataSource,
    /// Resync a secondary in split brain by itself.
    #[serde(default)]
    pub auto_resync: bool,
}

/// `VolumeReplication.spec.dataSource`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DataSource {
    /// The API group (empty for the core group).
    #[serde(default)]
    pub api_group: Option<String>,
    /// The kind.
    #[serde(default)]
    pub kind: String,
    /// The name.
    #[serde(default)]
    pub name: String,
}

/// `VolumeReplication.status` (the fields read back).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeReplicationStatus {
    /// `Primary`, `Secondary` or `Unknown`.
    #[serde(default)]
    pub state: Option<String>,
    /// The last message.
    #[serde(default)]
    pub message: Option<String>,
    /// The conditions.
    #[serde(default)]
    pub conditions: Option<Vec<serde_json::Value>>,
    /// When the last transition started.
    #[serde(default)]
    pub last_start_time: Option<String>,
    /// When it completed.
    #[serde(default)]
    pub last_completion_time: Option<String>,
}

/// A `replication.storage.openshift.io/v1alpha1` VolumeReplication.
#[derive(Debug, Clone, Deserialize)]
pub struct VolumeReplication {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The spec.
    #[serde(default)]
    pub spec: VolumeReplicationSpec,
    /// The status.
    #[serde(default)]
    pub status: Option<VolumeReplicationStatus>,
}

namespaced_resource!(
    VolumeReplication,
    group = GROUP,
    version = "v1alpha1",
    kind = "VolumeReplication",
    plural = "volumereplications"
);

/// `VolumeReplicationClass.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct VolumeReplicationClassSpec {
    /// The provisioner (driver) it is for.
    #[serde(default)]
    pub provisioner: String,
    /// Driver parameters and csi-addons' secret keys.
    #[serde(default)]
    pub parameters: Option<BTreeMap<String, String>>,
}

/// A `replication.storage.openshift.io/v1alpha1` VolumeReplicationClass.
#[derive(Debug, Clone, Deserialize)]
pub struct VolumeReplicationClass {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The spec.
    #[serde(default)]
    pub spec: VolumeReplicationClassSpec,
}

cluster_resource!(
    VolumeReplicationClass,
    group = GROUP,
    version = "v1alpha1",
    kind = "VolumeReplicationClass",
    plural = "volumereplicationclasses"
);

/// The conditions and state a reconcile leaves, patched as one status.
struct Report {
    state: Option<&'static str>,
    message: String,
    conditions: Vec<serde_json::Value>,
    generation: i64,
    extra: serde_json::Map<String, serde_json::Value>,
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

impl Report {
    fn new(vr: &VolumeReplication) -> Report {
        let st = vr.status.clone().unwrap_or_default();
        Report {
            state: None,
            message: String::new(),
            conditions: st.conditions.unwrap_or_default(),
            generation: vr.metadata.generation.unwrap_or(0),
            extra: serde_json::Map::new(),
        }
    }

    /// csi-addons' setStatusCondition: the transition time moves only when
    /// the status does.
    fn set(&mut self, kind: &str, status: bool, reason: &str, message: String) {
        let status = if status { "True" } else { "False" };
        self.set_raw(kind, status, reason, message);
    }

    fn set_raw(&mut self, kind: &str, status: &str, reason: &str, message: String) {
        let found = self
            .conditions
            .iter_mut()
            .find(|c| c.get("type").and_then(|t| t.as_str()) == Some(kind));
        match found {
            Some(c) => {
                if c.get("status").and_then(|s| s.as_str()) != Some(status) {
                    c["lastTransitionTime"] = json!(now());
                }
                c["status"] = json!(status);
                c["reason"] = json!(reason);
                c["message"] = json!(message);
                c["observedGeneration"] = json!(self.generation);
            }
            None => self.conditions.push(json!({
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": self.generation,
                "lastTransitionTime": now(),
            })),
        }
    }

    fn remove(&mut self, kind: &str) {
        self.conditions
            .retain(|c| c.get("type").and_then(|t| t.as_str()) != Some(kind));
    }

    fn promoted(&mut self) {
        self.set(
            "Completed",
            true,
            "Promoted",
            "volume is promoted to primary and replicating to secondary".into(),
        );
        self.set("Degraded", false, "Healthy", "volume is healthy".into());
        self.set(
            "Resyncing",
            false,
            "NotResyncing",
            "volume is not resyncing".into(),
        );
    }

    fn demoted(&mut self) {
        self.set(
            "Completed",
            true,
            "Demoted",
            "volume is demoted to secondary".into(),
        );
        self.set(
            "Degraded",
            true,
            "VolumeDegraded",
            "volume is degraded".into(),
        );
        self.set(
            "Resyncing",
            false,
            "NotResyncing",
            "volume is not resyncing".into(),
        );
    }

    fn resyncing(&mut self) {
        self.set(
            "Completed",
            true,
            "Demoted",
            "volume is demoted to secondary".into(),
        );
        self.set(
            "Degraded",
            true,
            "VolumeDegraded",
            "volume is degraded".into(),
        );
        self.set(
            "Resyncing",
            true,
            "ResyncTriggered",
            "volume is resyncing changes from primary to secondary".into(),
        );
    }

    fn ready(&mut self) {
        self.set(
            "Degraded",
            false,
            "Healthy",
            "volume is demoted to secondary".into(),
        );
        self.set(
            "Resyncing",
            false,
            "NotResyncing",
            "volume is not resyncing".into(),
        );
    }

    /// csi-addons' failure conditions for `state`; `validation` marks a
    /// prerequisite not met (bad input) rather than an operation failure.
    fn failed(&mut self, state: &str, what: &str, why: &str, validation: bool) {
        let (reason, verb) = match state {
            "primary" => ("FailedToPromote", "failed to promote"),
            "secondary" => ("FailedToDemote", "failed to demote"),
            _ => ("FailedToResync", "failed to resync"),
        };
        self.set("Completed", false, reason, what.to_owned());
        self.set("Degraded", true, "Error", format!("volume {verb}: {why}"));
        let resync_reason = if state == "resync" {
            "FailedToResync"
        } else {
            "NotResyncing"
        };
        self.set(
            "Resyncing",
            false,
            resync_reason,
            "volume is not resyncing".into(),
        );
        if validation {
            self.set(
                "Validated",
                false,
                "PrerequisiteNotMet",
                format!("failed to meet prerequisite: {why}"),
            );
        }
        self.message = why.to_owned();
    }
}

fn api(ctx: &Context, ns: &str) -> Api<VolumeReplication> {
    Api::namespaced(ctx.client.clone(), ns)
}

async fn write_status(ctx: &Context, vr: &VolumeReplication, r: Report) -> Result<(), kube::Error> {
    let ns = vr.namespace().unwrap_or_default();
    let old = vr.status.clone().unwrap_or_default();
    let mut status = serde_json::Map::new();
    if let Some(s) = r.state {
        status.insert("state".into(), json!(s));
        if old.state.as_deref() != Some(s) {
            status.insert("lastCompletionTime".into(), json!(now()));
        }
    } else if old.state.is_none() {
        status.insert("state".into(), json!("Unknown"));
    }
    status.insert(
        "message".into(),
        json!(crate::k8s::events::clip(&r.message)),
    );
    status.insert("conditions".into(), json!(r.conditions));
    status.insert("observedGeneration".into(), json!(r.generation));
    status.extend(r.extra);
    let unchanged = old.message.as_deref() == Some(crate::k8s::events::clip(&r.message).as_str())
        && old.conditions.as_ref() == status.get("conditions").and_then(|c| c.as_array())
        && status
            .get("state")
            .is_none_or(|s| old.state.as_deref() == s.as_str())
        && !status.contains_key("lastSyncTime")
        && !status.contains_key("lastStartTime");
    if unchanged {
        return Ok(());
    }
    api(ctx, &ns)
        .patch_status(
            &vr.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": status})),
        )
        .await?;
    Ok(())
}

/// What the reconcile needs about the claim's volume.
struct Target {
    vol: VolumeId,
    secret: SecretRef,
    claim: PersistentVolumeClaim,
}

/// The claim, its PV and its volume; every reason it cannot be replicated
/// is said by name.
async fn target(
    vr: &VolumeReplication,
    ctx: &Context,
    params: &BTreeMap<String, String>,
) -> Result<Target, String> {
    let ns = vr.namespace().unwrap_or_default();
    let ds = &vr.spec.data_source;
    let core = ds.api_group.as_deref().unwrap_or("").is_empty();
    if ds.kind != "PersistentVolumeClaim" || !core {
        return Err(format!(
            "dataSource {} {:?} is not supported: rbdkit replicates PersistentVolumeClaims (VolumeGroupReplication is not supported)",
            ds.kind, ds.name
        ));
    }
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let claim = claims
        .get_opt(&ds.name)
        .await
        .map_err(|e| format!("cannot read PersistentVolumeClaim {ns}/{}: {e}", ds.name))?
        .ok_or_else(|| format!("PersistentVolumeClaim {ns}/{} not found", ds.name))?;
    let pv_name = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|_| claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
        .ok_or_else(|| format!("PersistentVolumeClaim {ns}/{} is not bound yet", ds.name))?;
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let pv = pvs
        .get_opt(&pv_name)
        .await
        .map_err(|e| format!("cannot read PersistentVolume {pv_name}: {e}"))?
        .ok_or_else(|| format!("PersistentVolume {pv_name} not found"))?;
    let csi = pv
        .spec
        .as_ref()
        .and_then(|s| s.csi.as_ref())
        .filter(|c| c.driver == ctx.name)
        .ok_or_else(|| {
            format!(
                "PersistentVolume {pv_name} is not a volume of driver {:?}; its class's provisioner and the volume's driver must match",
                ctx.name
            )
        })?;
    let vol = VolumeId::parse(&csi.volume_handle)
        .map_err(|why| format!("PersistentVolume {pv_name}: {why}"))?;
    let secret = match (params.get(SECRET_NAME), params.get(SECRET_NAMESPACE)) {
        (Some(name), Some(namespace)) if !name.is_empty() && !namespace.is_empty() => SecretRef {
            namespace: namespace.clone(),
            name: name.clone(),
        },
        (None, None) => crate::volume::pv::deletion_secret(&pv).ok_or_else(|| {
            format!(
                "the VolumeReplicationClass names no Secret ({SECRET_NAME}, {SECRET_NAMESPACE}) and PersistentVolume {pv_name} records none"
            )
        })?,
        _ => {
            return Err(format!(
                "the VolumeReplicationClass must set both {SECRET_NAME} and {SECRET_NAMESPACE}"
            ))
        }
    };
    Ok(Target { vol, secret, claim })
}

/// Reconciles one VolumeReplication.
pub async fn reconcile_vr(
    vr: Arc<VolumeReplication>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let class_name = vr.spec.volume_replication_class.clone();
    let classes: Api<VolumeReplicationClass> = Api::all(ctx.client.clone());
    let ours = vr.finalizers().iter().any(|f| f == VR_FINALIZER);
    let class = match classes.get_opt(&class_name).await? {
        Some(c) if c.spec.provisioner == ctx.name => c,
        // Another driver's.
        Some(_) => return Ok(Action::await_change()),
        None if !ours => {
            // Whose it is shows once the class exists.
            tracing::debug!(vr = %vr.name_any(), class = %class_name, "class not found; looking again later");
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
        None => {
            let why = format!("VolumeReplicationClass {class_name:?} not found");
            if vr.metadata.deletion_timestamp.is_some() {
                // Nothing to disable with: let it go.
                release(&vr, &ctx, None).await?;
                return Ok(Action::await_change());
            }
            let mut r = Report::new(&vr);
            r.failed(
                &vr.spec.replication_state,
                "failed to get volumeReplication class",
                &why,
                true,
            );
            report(&vr, &ctx, r, "ReplicationFailed", &why).await;
            return Err(ReconcileError(why));
        }
    };
    ctx.limiter.acquire().await;
    let key = format!(
        "vr/{}/{}",
        vr.namespace().unwrap_or_default(),
        vr.name_any()
    );
    let out = vr_inner(&vr, &class, &ctx).await;
    if out.is_ok() {
        ctx.pv_failures.succeeded(&key);
    }
    out
}

/// Requeues a failed VolumeReplication after its backoff.
pub fn vr_error_policy(
    vr: Arc<VolumeReplication>,
    err: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    let key = format!(
        "vr/{}/{}",
        vr.namespace().unwrap_or_default(),
        vr.name_any()
    );
    let delay = ctx.pv_failures.failed(&key);
    tracing::warn!(vr = %key, error = %err, retry_in = ?delay, "volume replication not done; will retry");
    Action::requeue(delay)
}

async fn report(vr: &VolumeReplication, ctx: &Context, r: Report, reason: &str, why: &str) {
    ctx.events.warning(&vr.object_ref(&()), reason, why).await;
    if let Err(e) = write_status(ctx, vr, r).await {
        tracing::warn!(vr = %vr.name_any(), error = %e, "cannot set the VolumeReplication's status");
    }
}

/// Takes the claim's annotation and finalizer (when they are this
/// VolumeReplication's) and the VolumeReplication's finalizer off. A
/// VolumeReplication without the finalizer never touched anything.
async fn release(
    vr: &VolumeReplication,
    ctx: &Context,
    claim: Option<&PersistentVolumeClaim>,
) -> Result<(), kube::Error> {
    if !vr.finalizers().iter().any(|f| f == VR_FINALIZER) {
        return Ok(());
    }
    let ns = vr.namespace().unwrap_or_default();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let fetched;
    let claim = match claim {
        Some(c) => Some(c),
        None => {
            fetched = claims.get_opt(&vr.spec.data_source.name).await?;
            fetched.as_ref()
        }
    };
    if let Some(c) = claim {
        let owner = c.annotations().get(PVC_OWNER_ANNOTATION);
        if owner.is_none_or(|o| *o == vr.name_any()) {
            let drop_ann = BTreeMap::from([(PVC_OWNER_ANNOTATION.to_owned(), None)]);
            edit_meta(&claims, &c.name_any(), PVC_FINALIZER, false, &drop_ann).await?;
        }
    }
    edit_meta(
        &api(ctx, &ns),
        &vr.name_any(),
        VR_FINALIZER,
        false,
        &BTreeMap::new(),
    )
    .await?;
    Ok(())
}

fn secs(d: Duration) -> String {
    format!("{}s", d.as_secs())
}

async fn vr_inner(
    vr: &VolumeReplication,
    class: &VolumeReplicationClass,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    let name = vr.name_any();
    let ns = vr.namespace().unwrap_or_default();
    let raw = class.spec.parameters.clone().unwrap_or_default();
    let state = vr.spec.replication_state.as_str();
    let mut r = Report::new(vr);
    let params = match ReplicationParams::parse(&raw) {
        Ok(p) => p,
        Err(why) => {
            if vr.metadata.deletion_timestamp.is_some() {
                release(vr, ctx, None).await?;
                return Ok(Action::await_change());
            }
            let why = format!("VolumeReplicationClass {:?}: {why}", class.name_any());
            r.failed(
                state,
                "failed to validate parameters of volumeReplicationClass",
                &why,
                true,
            );
            report(vr, ctx, r, "ReplicationFailed", &why).await;
            // Classes are immutable: nothing to retry until a new object.
            return Ok(Action::await_change());
        }
    };
    let target = match target(vr, ctx, &raw).await {
        Ok(t) => Some(t),
        Err(why) if vr.metadata.deletion_timestamp.is_some() => {
            tracing::info!(vr = %name, why = %why, "deleted; its volume cannot be found, so nothing is disabled");
            None
        }
        Err(why) => {
            r.failed(state, "failed to find the volume", &why, true);
            report(vr, ctx, r, "ReplicationFailed", &why).await;
            return Err(ReconcileError(why));
        }
    };
    if vr.metadata.deletion_timestamp.is_some() {
        if let Some(t) = &target {
            if vr.finalizers().iter().any(|f| f == VR_FINALIZER) {
                let conn = ctx
                    .connect(&t.vol.cluster_id, &t.secret)
                    .await
                    .map_err(ReconcileError)?;
                let (v, p) = (t.vol.clone(), params.clone());
                ctx.ceph(&conn, move |c, _, f| repl::disable(c, f, &v, &p))
                    .await
                    .map_err(|e| fail_plain(&t.vol, "disable replication of", e))?;
                ctx.events
                    .normal(
                        &vr.object_ref(&()),
                        "ReplicationDisabled",
                        &format!("Mirroring of {} disabled", t.vol),
                    )
                    .await;
            }
        }
        release(vr, ctx, target.as_ref().map(|t| &t.claim)).await?;
        return Ok(Action::await_change());
    }
    let Some(t) = target else {
        unreachable!("a missing target returned above unless deleted")
    };
    if !matches!(state, "primary" | "secondary" | "resync") {
        let why = format!("replicationState {state:?} is not primary, secondary or resync");
        r.failed(state, "unsupported volume state", &why, true);
        report(vr, ctx, r, "ReplicationFailed", &why).await;
        return Ok(Action::await_change());
    }

    if let Some(other) = t
        .claim
        .annotations()
        .get(PVC_OWNER_ANNOTATION)
        .filter(|o| **o != name)
    {
        let why = format!(
            "PersistentVolumeClaim {ns}/{} is already replicated by VolumeReplication {other:?}",
            t.claim.name_any()
        );
        r.failed(state, "failed to find the volume", &why, true);
        report(vr, ctx, r, "ReplicationFailed", &why).await;
        return Ok(Action::await_change());
    }

    // Before any Ceph step: neither object can go while mirroring is on.
    let vr_api = api(ctx, &ns);
    if !edit_meta(&vr_api, &name, VR_FINALIZER, true, &BTreeMap::new()).await? {
        return Ok(Action::await_change());
    }
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let owner = BTreeMap::from([(PVC_OWNER_ANNOTATION.to_owned(), Some(name.clone()))]);
    if !edit_meta(&claims, &t.claim.name_any(), PVC_FINALIZER, true, &owner).await? {
        let why = format!(
            "PersistentVolumeClaim {ns}/{} is being deleted",
            t.claim.name_any()
        );
        r.failed(state, "failed to find the volume", &why, true);
        report(vr, ctx, r, "ReplicationFailed", &why).await;
        return Ok(Action::await_change());
    }
    r.set(
        "Validated",
        true,
        "PrerequisiteMet",
        "volume is validated and met all prerequisites".into(),
    );

    let conn = ctx
        .connect(&t.vol.cluster_id, &t.secret)
        .await
        .map_err(ReconcileError)?;
    let vol = t.vol.clone();
    let old_state = vr.status.as_ref().and_then(|s| s.state.clone());
    if old_state.as_deref()
        != Some(match state {
            "primary" => "Primary",
            _ => "Secondary",
        })
    {
        r.extra.insert("lastStartTime".into(), json!(now()));
    }
    let annotations = vr.annotations().clone();
    let timeout = ctx.mirror_op_timeout;

    match state {
        "primary" => {
            let force = if annotations.get(FORCE_PROMOTE).map(String::as_str) == Some("true") {
                Force::Always
            } else {
                Force::IfPeersDown
            };
            let (v, p) = (vol.clone(), params.clone());
            let promoted = ctx
                .ceph(&conn, move |c, _, f| {
                    repl::enable(c, f, &v, &p)?;
                    repl::promote(c, f, &v, &p, force, timeout)
                })
                .await;
            let promoted = match promoted {
                Ok(p) => p,
                Err(e) => {
                    let validation = matches!(e, VolumeError::Refused { .. });
                    let why = format!("{e}");
                    r.failed("primary", "failed to promote volume", &why, validation);
                    report(vr, ctx, r, "PromoteFailed", &why).await;
                    return Err(ReconcileError(why));
                }
            };
            match &promoted {
                Promoted::Waiting(why) => {
                    r.failed("primary", "failed to promote volume", why, false);
                    r.state = None;
                    write_status(ctx, vr, r).await?;
                    return Ok(Action::requeue(Duration::from_secs(5)));
                }
                Promoted::Forced(why) => {
                    ctx.events
                        .warning(
                            &vr.object_ref(&()),
                            "ForcePromoted",
                            &format!("Volume {vol} force-promoted: {why}; the other copy must be demoted and resynced before it replicates again"),
                        )
                        .await;
                    r.message = format!("volume is marked primary (force-promoted: {why})");
                }
                Promoted::Primary => {
                    if old_state.as_deref() != Some("Primary") {
                        ctx.events
                            .normal(
                                &vr.object_ref(&()),
                                "Promoted",
                                &format!("Volume {vol} is primary here"),
                            )
                            .await;
                    }
                    r.message = "volume is marked primary".into();
                }
            }
            r.state = Some("Primary");
            r.promoted();
            if annotations.contains_key(RESYNC_ANNOTATION) {
                edit_meta(
                    &vr_api,
                    &name,
                    VR_FINALIZER,
                    true,
                    &BTreeMap::from([(RESYNC_ANNOTATION.to_owned(), None)]),
                )
                .await?;
            }
            // The replication info, as GetVolumeReplicationInfo gives it.
            let v = vol.clone();
            // Until a peer replays, and has copied a snapshot, look again
            // soon rather than after half the interval.
            let mut again = Duration::from_secs(15).min(info_interval(&params));
            match ctx.ceph(&conn, move |c, _, _| repl::status(c, &v)).await {
                Ok(st) => {
                    let (healthy, line) = st.replicating();
                    if healthy && st.last_sync().is_some() {
                        again = info_interval(&params);
                    }
                    if healthy {
                        r.set(
                            "Replicating",
                            true,
                            "Replicating",
                            format!("volume is replicating: {line}"),
                        );
                    } else {
                        r.set(
                            "Replicating",
                            false,
                            "NotReplicating",
                            format!("volume is not replicating: {line}"),
                        );
                    }
                    if let Some(s) = st.last_sync() {
                        let t = s
                            .time
                            .duration_since(UNIX_EPOCH)
                            .unwrap_or_default()
                            .as_secs() as i64;
                        if let Ok(ts) = k8s_openapi::jiff::Timestamp::from_second(t) {
                            r.extra.insert("lastSyncTime".into(), json!(ts.to_string()));
                        }
                        if let Some(d) = s.duration {
                            r.extra.insert("lastSyncDuration".into(), json!(secs(d)));
                        }
                        if let Some(b) = s.bytes.filter(|b| *b > 0) {
                            r.extra.insert("lastSyncBytes".into(), json!(b));
                        }
                    }
                }
                Err(e) => {
                    r.set_raw(
                        "Replicating",
                        "Unknown",
                        "Replicating",
                        format!("volume replication status is unknown: {e}"),
                    );
                }
            }
            write_status(ctx, vr, r).await?;
            Ok(Action::requeue(again))
        }
        "secondary" => {
            let v = vol.clone();
            let st = ctx
                .ceph(&conn, move |c, _, f| {
                    repl::demote(c, f, &v, timeout)?;
                    repl::status(c, &v)
                })
                .await;
            let st = match st {
                Ok(st) => st,
                Err(e) => {
                    let validation = matches!(e, VolumeError::Refused { .. });
                    let why = format!("{e}");
                    r.failed("secondary", "failed to demote volume", &why, validation);
                    report(vr, ctx, r, "DemoteFailed", &why).await;
                    return Err(ReconcileError(why));
                }
            };
            r.state = Some("Secondary");
            if old_state.as_deref() != Some("Secondary") {
                ctx.events
                    .normal(
                        &vr.object_ref(&()),
                        "Demoted",
                        &format!("Volume {vol} is secondary here"),
                    )
                    .await;
                r.demoted();
                r.message = "volume is marked secondary and is degraded".into();
                r.remove("Replicating");
                write_status(ctx, vr, r).await?;
                return Ok(Action::requeue(Duration::from_secs(5)));
            }
            let mut resyncing = false;
            if st.split_brain() {
                if vr.spec.auto_resync {
                    resyncing = request_resync(vr, ctx, &conn, &vol, &annotations).await?;
                } else {
                    r.demoted();
                    r.message = format!(
                        "volume is in split brain ({}): set replicationState resync (or autoResync) to replace this copy with the primary's",
                        st.local_summary()
                    );
                    r.remove("Replicating");
                    write_status(ctx, vr, r).await?;
                    return Ok(Action::requeue(Duration::from_secs(30)));
                }
            }
            finish_secondary(vr, ctx, r, &st, resyncing, &annotations).await
        }
        _ => {
            // resync
            let resyncing = request_resync(vr, ctx, &conn, &vol, &annotations).await?;
            let v = vol.clone();
            let st = ctx
                .ceph(&conn, move |c, _, _| repl::status(c, &v))
                .await
                .map_err(|e| fail_plain(&vol, "read the mirror status of", e))?;
            r.state = Some("Secondary");
            finish_secondary(vr, ctx, r, &st, resyncing, &annotations).await
        }
    }
}

/// Degraded until ready (both copies demoted, both daemons idle): requeued
/// every 10 s until then.
async fn finish_secondary(
    vr: &VolumeReplication,
    ctx: &Context,
    mut r: Report,
    st: &repl::ReplicationStatus,
    resyncing: bool,
    annotations: &BTreeMap<String, String>,
) -> Result<Action, ReconcileError> {
    r.remove("Replicating");
    if st.secondary_ready() {
        r.set(
            "Completed",
            true,
            "Demoted",
            "volume is demoted to secondary".into(),
        );
        r.ready();
        r.message = if vr.spec.replication_state == "resync" {
            "volume is marked for resyncing".into()
        } else {
            "volume is marked secondary".into()
        };
        if annotations.contains_key(RESYNC_ANNOTATION) {
            let api = api(ctx, &vr.namespace().unwrap_or_default());
            edit_meta(
                &api,
                &vr.name_any(),
                VR_FINALIZER,
                true,
                &BTreeMap::from([(RESYNC_ANNOTATION.to_owned(), None)]),
            )
            .await?;
        }
        write_status(ctx, vr, r).await?;
        return Ok(Action::requeue(Duration::from_secs(60)));
    }
    if resyncing {
        r.resyncing();
    } else {
        r.demoted();
    }
    r.message = format!("volume is degraded: {}", st.local_summary());
    write_status(ctx, vr, r).await?;
    Ok(Action::requeue(Duration::from_secs(10)))
}

/// Asks for a resync of the copy, once per image (see
/// [`RESYNC_ANNOTATION`]); true while it is under way.
async fn request_resync(
    vr: &VolumeReplication,
    ctx: &Context,
    conn: &crate::volume::clusters::Conn,
    vol: &VolumeId,
    annotations: &BTreeMap<String, String>,
) -> Result<bool, ReconcileError> {
    let asked = annotations.get(RESYNC_ANNOTATION).cloned();
    let v = vol.clone();
    let current = ctx
        .ceph(conn, move |c, _, _| {
            let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
            Ok(crate::rbd::Image::open_read_only(&io, &v.image)?.id()?)
        })
        .await
        .map_err(|e| fail_plain(vol, "read", e))?;
    if let Some(old) = &asked {
        if *old != current {
            // Re-created by the daemon: the resync asked for is done.
            return Ok(false);
        }
    } else {
        // Recorded first: a crash after the resync must not ask again for
        // the image the daemon makes.
        let api = api(ctx, &vr.namespace().unwrap_or_default());
        let rec = BTreeMap::from([(RESYNC_ANNOTATION.to_owned(), Some(current.clone()))]);
        edit_meta(&api, &vr.name_any(), VR_FINALIZER, true, &rec).await?;
    }
    let v = vol.clone();
    let id = current.clone();
    let out = ctx
        .ceph(conn, move |c, _, f| repl::resync(c, f, &v, Some(&id)))
        .await;
    match out {
        Ok(_) => {
            if asked.is_none() {
                ctx.events
                    .normal(
                        &vr.object_ref(&()),
                        "ResyncRequested",
                        &format!("Volume {vol} will be copied anew from the primary"),
                    )
                    .await;
            }
            Ok(true)
        }
        Err(e) => {
            let why = format!("{e}");
            let mut r = Report::new(vr);
            r.failed(
                "resync",
                "failed to resync volume",
                &why,
                matches!(e, VolumeError::Refused { .. }),
            );
            report(vr, ctx, r, "ResyncFailed", &why).await;
            Err(ReconcileError(why))
        }
    }
}

fn fail_plain(vol: &VolumeId, what: &str, e: VolumeError) -> ReconcileError {
    ReconcileError(format!("cannot {what} volume {vol}: {e}"))
}

/// How often a primary's replication info is read: half the schedule
/// interval (the interval itself under 2 minutes, as csi-addons does), an
/// hour without one.
fn info_interval(params: &ReplicationParams) -> Duration {
    let Some(i) = params.interval.as_deref() else {
        return Duration::from_secs(3600);
    };
    let (n, unit) = i.split_at(i.len() - 1);
    let n: u64 = n.parse().unwrap_or(60);
    let d = Duration::from_secs(match unit {
        "h" => n * 3600,
        "d" => n * 86400,
        _ => n * 60,
    });
    if d < Duration::from_secs(120) {
        d
    } else {
        d / 2
    }
}

/// Runs the VolumeReplication controller until `shutdown` resolves; waits,
/// logging once, while the CRD is missing.
pub async fn run(
    ctx: Arc<Context>,
    config: kube::runtime::controller::Config,
    enabled: bool,
    shutdown: impl std::future::Future<Output = ()> + Clone + Send + Sync + 'static,
) {
    use futures::StreamExt;
    use kube::runtime::{reflector, watcher, WatchStreamExt};
    if !enabled {
        tracing::info!(
            "replication disabled (--replication=false): VolumeReplications are not handled"
        );
        shutdown.await;
        return;
    }
    if !crd::wait_installed::<VolumeReplication>(&ctx.client, "VolumeReplication", shutdown.clone())
        .await
    {
        return;
    }
    tracing::info!("replication CRDs found: handling VolumeReplications");
    let (store, writer) = reflector::store();
    // Status writes (ours) wake nothing; spec, annotations, finalizers and
    // deletion do.
    let changed = |vr: &VolumeReplication| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        vr.metadata.generation.hash(&mut h);
        vr.metadata.annotations.hash(&mut h);
        vr.metadata.finalizers.hash(&mut h);
        vr.metadata.deletion_timestamp.is_some().hash(&mut h);
        Some(h.finish())
    };
    let stream = watcher(
        Api::<VolumeReplication>::all(ctx.client.clone()),
        watcher::Config::default().any_semantic(),
    )
    .default_backoff()
    .reflect(writer)
    .applied_objects()
    .predicate_filter(changed, Default::default());
    kube::runtime::Controller::for_stream(stream, store)
        .with_config(config)
        .graceful_shutdown_on(shutdown)
        .run(reconcile_vr, vr_error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "volume replication controller");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_interval_is_csi_addons() {
        let p = |i: Option<&str>| ReplicationParams {
            mode: crate::rbd::MirrorImageMode::Snapshot,
            interval: i.map(str::to_owned),
            start_time: None,
            force_disable: false,
        };
        assert_eq!(info_interval(&p(None)), Duration::from_secs(3600));
        assert_eq!(info_interval(&p(Some("1m"))), Duration::from_secs(60));
        assert_eq!(info_interval(&p(Some("10m"))), Duration::from_secs(300));
        assert_eq!(info_interval(&p(Some("1d"))), Duration::from_secs(43200));
    }

    #[test]
    fn conditions_keep_their_transition_time() {
        let vr: VolumeReplication = serde_json::from_value(json!({
            "metadata": {"name": "v", "namespace": "n", "generation": 3},
            "spec": {"volumeReplicationClass": "c", "replicationState": "primary",
                     "dataSource": {"kind": "PersistentVolumeClaim", "name": "p"}, "autoResync": false},
            "status": {"conditions": [{"type": "Degraded", "status": "False", "reason": "Healthy",
                       "message": "volume is healthy", "lastTransitionTime": "2020-01-01T00:00:00Z",
                       "observedGeneration": 2}]}
        }))
        .unwrap();
        let mut r = Report::new(&vr);
        r.promoted();
        let degraded = r
            .conditions
            .iter()
            .find(|c| c["type"] == "Degraded")
            .unwrap();
        assert_eq!(degraded["lastTransitionTime"], "2020-01-01T00:00:00Z");
        assert_eq!(degraded["observedGeneration"], 3);
        r.demoted();
        let degraded = r
            .conditions
            .iter()
            .find(|c| c["type"] == "Degraded")
            .unwrap();
        assert_eq!(degraded["status"], "True");
        assert_ne!(degraded["lastTransitionTime"], "2020-01-01T00:00:00Z");
        assert_eq!(r.conditions.len(), 3);
        r.failed("primary", "failed to promote volume", "bad", true);
        let validated = r
            .conditions
            .iter()
            .find(|c| c["type"] == "Validated")
            .unwrap();
        assert_eq!(validated["reason"], "PrerequisiteNotMet");
    }
}
