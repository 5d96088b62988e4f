//! VolumeAttributesClasses: the external-resizer's modify role, in process.
//!
//! A claim created with `spec.volumeAttributesClassName` gets the class's
//! parameters (QoS, see [`crate::volume::qos`]) on its image, over its
//! StorageClass's, and its PV names the class (the binder matches them):
//! [`new_volume_policy`]. Changing the name on a bound claim applies the
//! new class to the image ([`reconcile`]) and keeps the claim's status as
//! the external-resizer does:
//!
//! 1. the class does not exist: `modifyVolumeStatus` Pending (retried with
//!    backoff: creating the class does not touch the claim);
//! 2. it is being applied: `modifyVolumeStatus` InProgress, condition
//!    `ModifyingVolume`, event `VolumeModify`;
//! 3. it cannot be (an unknown or immutable parameter, a class of another
//!    driver, limits that do not fit together): `modifyVolumeStatus`
//!    Infeasible, condition `ModifyVolumeError` with the reason, event
//!    `VolumeModifyFailed`; nothing is retried until the claim names
//!    another class;
//! 4. it failed otherwise (Ceph unreachable): still InProgress, the
//!    `ModifyVolumeError` condition, retried with backoff;
//! 5. done: the PV names the class, then the claim's
//!    `currentVolumeAttributesClassName` does, `modifyVolumeStatus` and the
//!    two conditions are gone, event `VolumeModifySuccessful`.
//!
//! Every step is idempotent (the Ceph side writes only what differs) and
//! ordered so that a kill at any point is finished by the next reconcile:
//! the claim's status says "done" only after the image and the PV are.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::VolumeAttributesClass;
use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::k8s::backoff::before_work;
use crate::provisioner::controller::{Context, ReconcileError};
use crate::volume::ops::VolumeError;
use crate::volume::pv::{deletion_secret, expand_secret};
use crate::volume::qos::{self, Policy};
use crate::volume::VolumeId;

/// Claim condition while a class is being applied.
pub const MODIFYING: &str = "ModifyingVolume";
/// Claim condition after a failed attempt.
pub const MODIFY_ERROR: &str = "ModifyVolumeError";

/// The claim's class name, if it names one.
pub fn claim_class(claim: &PersistentVolumeClaim) -> Option<String> {
    claim
        .spec
        .as_ref()?
        .volume_attributes_class_name
        .clone()
        .filter(|n| !n.is_empty())
}

/// The QoS policy of VolumeAttributesClass `name`, checked to be this
/// driver's: `Ok(None)` while it does not exist.
async fn class_policy(ctx: &Context, name: &str) -> Result<Option<Policy>, String> {
    let api: Api<VolumeAttributesClass> = Api::all(ctx.client.clone());
    let vac = api
        .get_opt(name)
        .await
        .map_err(|e| format!("cannot read VolumeAttributesClass {name:?}: {e}"))?;
    let Some(vac) = vac else {
        return Ok(None);
    };
    if vac.driver_name != ctx.name {
        return Err(format!(
            "VolumeAttributesClass {name:?} is for driver {:?}, not {:?}",
            vac.driver_name, ctx.name
        ));
    }
    Policy::from_mutable(&vac.parameters.unwrap_or_default())
        .map(Some)
        .map_err(|e| {
            format!(
                "VolumeAttributesClass {name:?} parameter {:?}: {}",
                e.param, e.why
            )
        })
}

/// What a new claim's image gets: its VolumeAttributesClass (if any) and
/// the policy, the StorageClass's QoS overridden by the class's.
pub enum NewVolume {
    /// Provision with these.
    Ready(Option<String>, Policy),
    /// The claim's class does not exist (yet): wait for it.
    Missing(String),
}

/// The class and policy a new claim's image gets; `Err` if they can never
/// be applied as they are (named in the message).
pub async fn new_volume_policy(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
    class_qos: &Policy,
) -> Result<NewVolume, String> {
    let Some(name) = claim_class(claim) else {
        return Ok(NewVolume::Ready(None, class_qos.clone()));
    };
    let Some(vac) = class_policy(ctx, &name).await? else {
        return Ok(NewVolume::Missing(format!(
            "VolumeAttributesClass {name:?} does not exist"
        )));
    };
    let merged = class_qos.merged(&vac);
    merged.check().map_err(|e| {
        format!(
            "VolumeAttributesClass {name:?} with the StorageClass's QoS: parameter {:?}: {}",
            e.param, e.why
        )
    })?;
    Ok(NewVolume::Ready(Some(name), merged))
}

/// Puts the class name on a new PV.
pub fn annotate_pv(pv: &mut PersistentVolume, class: Option<&str>) {
    if let Some(spec) = pv.spec.as_mut() {
        spec.volume_attributes_class_name = class.map(str::to_owned);
    }
}

/// What the claim's status says now.
struct State {
    current: Option<String>,
    target: Option<String>,
    status: Option<String>,
}

fn state(claim: &PersistentVolumeClaim) -> State {
    let st = claim.status.as_ref();
    let mvs = st.and_then(|s| s.modify_volume_status.as_ref());
    State {
        current: st
            .and_then(|s| s.current_volume_attributes_class_name.clone())
            .filter(|n| !n.is_empty()),
        target: mvs
            .and_then(|m| m.target_volume_attributes_class_name.clone())
            .filter(|n| !n.is_empty()),
        status: mvs.map(|m| m.status.clone()),
    }
}

/// The claim's conditions other than the two of this module, plus `add`.
fn conditions_with(
    claim: &PersistentVolumeClaim,
    add: &[serde_json::Value],
) -> Vec<serde_json::Value> {
    let mut out: Vec<serde_json::Value> = claim
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|cs| {
            cs.iter()
                .filter(|c| c.type_ != MODIFYING && c.type_ != MODIFY_ERROR)
                .filter_map(|c| serde_json::to_value(c).ok())
                .collect()
        })
        .unwrap_or_default();
    out.extend(add.iter().cloned());
    out
}

fn condition(type_: &str, reason: &str, message: &str) -> serde_json::Value {
    json!({
        "type": type_,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now()
        ),
    })
}

/// Writes the claim's status (guarded by its resourceVersion, so a stale
/// copy never overwrites a newer condition) and returns the claim as the
/// API server now has it.
async fn write_status(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
    status: serde_json::Value,
) -> Result<PersistentVolumeClaim, ReconcileError> {
    let api: Api<PersistentVolumeClaim> =
        Api::namespaced(ctx.client.clone(), &claim.namespace().unwrap_or_default());
    before_work().await;
    Ok(api
        .patch_status(
            &claim.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"resourceVersion": claim.metadata.resource_version},
                "status": status,
            })),
        )
        .await?)
}

/// Whether the claim's class differs from the one applied, or a change is
/// under way: only then has [`reconcile`] anything to do.
pub fn needed(claim: &PersistentVolumeClaim) -> bool {
    let st = state(claim);
    claim_class(claim) != st.current || st.status.is_some()
}

/// What [`reconcile`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing to do: the claim's class is applied.
    Idle,
    /// It wrote the claim; the echo of that write reconciles again.
    Wrote,
}

/// Applies a bound claim's VolumeAttributesClass if it is not applied yet
/// (see the module's steps).
pub async fn reconcile(
    claim: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    vol: &VolumeId,
    ctx: &Context,
) -> Result<Outcome, ReconcileError> {
    let st = state(claim);
    let spec = claim_class(claim);
    if spec == st.current && st.status.is_none() {
        return Ok(Outcome::Idle);
    }
    let Some(target) = spec.clone().or_else(|| {
        // Back to no class while a change was under way: only an
        // InProgress one is carried on (the image may have it half).
        (st.status.as_deref() == Some("InProgress"))
            .then(|| st.target.clone())
            .flatten()
    }) else {
        write_status(
            ctx,
            claim,
            json!({"modifyVolumeStatus": null, "conditions": conditions_with(claim, &[])}),
        )
        .await?;
        ctx.events
            .normal(
                &claim.object_ref(&()),
                "VolumeModifyCanceled",
                "Cancelled modify.",
            )
            .await;
        return Ok(Outcome::Wrote);
    };
    if Some(&target) == st.current.as_ref() {
        // Back to the class it has: nothing to apply.
        write_status(
            ctx,
            claim,
            json!({"modifyVolumeStatus": null, "conditions": conditions_with(claim, &[])}),
        )
        .await?;
        return Ok(Outcome::Wrote);
    }
    if st.status.as_deref() == Some("Infeasible") && st.target.as_ref() == Some(&target) {
        // Refused as it is; a new class name tries again.
        return Ok(Outcome::Idle);
    }
    let policy = match class_policy(ctx, &target).await {
        Ok(Some(p)) => p,
        Ok(None) => return pending(ctx, claim, &st, &target).await,
        Err(why) => return infeasible(ctx, claim, &target, &why).await,
    };
    let claim = in_progress(ctx, claim, &st, &target, &pv.name_any()).await?;
    match apply(ctx, pv, vol, policy).await {
        Ok(limits) => {
            tracing::info!(pv = %pv.name_any(), image = %vol, class = %target, limits = %limits,
                "VolumeAttributesClass applied");
        }
        Err(Applied::Refused(why)) => return infeasible(ctx, &claim, &target, &why).await,
        Err(Applied::Failed(why)) => return failed(ctx, &claim, &target, why).await,
    }
    done(ctx, &claim, pv, &target).await
}

/// Step 1: the class does not exist (yet).
async fn pending(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
    st: &State,
    target: &str,
) -> Result<Outcome, ReconcileError> {
    if st.status.as_deref() != Some("Pending") || st.target.as_deref() != Some(target) {
        write_status(
            ctx,
            claim,
            json!({"modifyVolumeStatus": {
                "targetVolumeAttributesClassName": target,
                "status": "Pending",
            }}),
        )
        .await?;
    }
    let why = format!("VolumeAttributesClass {target:?} does not exist.");
    ctx.events
        .warning(&claim.object_ref(&()), "VolumeModifyFailed", &why)
        .await;
    Err(ReconcileError(why))
}

/// Step 2: InProgress before anything changes; the claim as written.
async fn in_progress(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
    st: &State,
    target: &str,
    pv_name: &str,
) -> Result<PersistentVolumeClaim, ReconcileError> {
    if st.status.as_deref() == Some("InProgress") && st.target.as_deref() == Some(target) {
        return Ok(claim.clone());
    }
    let msg = format!("Modifying volume to {target:?} is in progress.");
    let written = write_status(
        ctx,
        claim,
        json!({
            "modifyVolumeStatus": {
                "targetVolumeAttributesClassName": target,
                "status": "InProgress",
            },
            "conditions": conditions_with(claim, &[condition(MODIFYING, "", &msg)]),
        }),
    )
    .await?;
    ctx.events
        .normal(
            &claim.object_ref(&()),
            "VolumeModify",
            &format!(
                "rbdkit is modifying volume {pv_name} of claim {}/{} with VolumeAttributesClass {target}",
                claim.namespace().unwrap_or_default(),
                claim.name_any()
            ),
        )
        .await;
    Ok(written)
}

/// Step 3: marks the change to `target` Infeasible with `why`.
async fn infeasible(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
    target: &str,
    why: &str,
) -> Result<Outcome, ReconcileError> {
    write_status(
        ctx,
        claim,
        json!({
            "modifyVolumeStatus": {
                "targetVolumeAttributesClassName": target,
                "status": "Infeasible",
            },
            "conditions": conditions_with(claim, &[condition(MODIFY_ERROR, "InvalidArgument", why)]),
        }),
    )
    .await?;
    ctx.events
        .warning(&claim.object_ref(&()), "VolumeModifyFailed", why)
        .await;
    tracing::warn!(claim = %format!("{}/{}", claim.namespace().unwrap_or_default(), claim.name_any()),
        class = %target, "VolumeAttributesClass refused: {why}");
    Ok(Outcome::Wrote)
}

/// Step 4: failed for now; retried with backoff.
async fn failed(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
    target: &str,
    why: String,
) -> Result<Outcome, ReconcileError> {
    let msg = format!("{why}. Still modifying to {target:?}.");
    let waiting = format!("Modifying volume to {target:?} failed. Waiting for retry.");
    write_status(
        ctx,
        claim,
        json!({"conditions": conditions_with(claim, &[
            condition(MODIFYING, "", &waiting),
            condition(MODIFY_ERROR, "Internal", &msg),
        ])}),
    )
    .await?;
    ctx.events
        .warning(&claim.object_ref(&()), "VolumeModifyFailed", &msg)
        .await;
    Err(ReconcileError(msg))
}

/// Step 5: the PV first, then the claim: the claim says done only when
/// both are.
async fn done(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    target: &str,
) -> Result<Outcome, ReconcileError> {
    let pv_name = pv.name_any();
    let pv_class = pv
        .spec
        .as_ref()
        .and_then(|s| s.volume_attributes_class_name.as_deref());
    if pv_class != Some(target) {
        let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
        before_work().await;
        pvs.patch(
            &pv_name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"volumeAttributesClassName": target}})),
        )
        .await?;
    }
    write_status(
        ctx,
        claim,
        json!({
            "currentVolumeAttributesClassName": target,
            "modifyVolumeStatus": null,
            "conditions": conditions_with(claim, &[]),
        }),
    )
    .await?;
    let msg = format!(
        "rbdkit modified volume {pv_name} with VolumeAttributesClass {target} successfully"
    );
    ctx.events
        .normal(&claim.object_ref(&()), "VolumeModifySuccessful", &msg)
        .await;
    Ok(Outcome::Wrote)
}

enum Applied {
    Refused(String),
    Failed(String),
}

/// Applies `policy` to the PV's image (a legacy PV's adopted first), with
/// the PV's expand (or deletion) Secret.
async fn apply(
    ctx: &Context,
    pv: &PersistentVolume,
    vol: &VolumeId,
    policy: Policy,
) -> Result<qos::Limits, Applied> {
    let secret = expand_secret(pv)
        .or_else(|| deletion_secret(pv))
        .or_else(|| ctx.legacy_secret.clone())
        .ok_or_else(|| {
            Applied::Failed("the PV names no Secret to modify its volume with".into())
        })?;
    let conn = ctx
        .connect(&vol.cluster_id, &secret)
        .await
        .map_err(Applied::Failed)?;
    ctx.adopt_legacy(&conn, pv, vol)
        .await
        .map_err(Applied::Failed)?;
    let (v, name, pv_name) = (vol.clone(), ctx.name.clone(), pv.name_any());
    ctx.ceph(&conn, move |c, m, f| {
        qos::apply_to_volume(c, m, f, &v, &name, &pv_name, &policy, qos::Mode::Update)
    })
    .await
    .map_err(|e| match e {
        VolumeError::Refused { why } => Applied::Refused(why),
        e => Applied::Failed(format!("cannot modify image {vol}: {e}")),
    })
}
