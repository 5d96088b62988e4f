//! VolumeAttributesClasses at provisioning: a claim created with
//! `spec.volumeAttributesClassName` gets the class's parameters (QoS, see
//! [`crate::volume::qos`]) on its image, over its StorageClass's, and its
//! PV names the class (the binder matches them).
//!
//! Changing the class of a bound claim is the external-resizer's modify
//! role; this provisioner does not play it yet: `rbdkit csi` serves
//! ControllerModifyVolume for the external-resizer sidecar.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::VolumeAttributesClass;
use kube::api::Api;

use crate::provisioner::controller::Context;
use crate::volume::qos::Policy;

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
