//! What marks a PV as a volume of this driver: the annotations and the
//! finalizer external-provisioner's contract puts on it, and how its
//! volume and Secrets are read back.
//!
//! Every writer of such a PV (the provisioner, `rbdkit migrate` through
//! [`super::legacy::csi_pv`]) and every reader (the provisioner's
//! reconcilers, `rbdkit gc`) goes through here, so they cannot disagree.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolume, SecretReference};

use crate::volume::params::SecretRef;
use crate::volume::VolumeId;

/// Annotation naming the provisioner that made a PV.
pub const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
/// The finalizer external-provisioner puts on its PVs, so that a PV cannot
/// disappear before its volume is deleted.
pub const PV_FINALIZER: &str = "external-provisioner.volume.kubernetes.io/finalizer";
/// PV annotation: name of the Secret used to delete the volume (so delete
/// works after the StorageClass is gone).
pub const DELETION_SECRET_NAME: &str = "volume.kubernetes.io/provisioner-deletion-secret-name";
/// PV annotation: namespace of that Secret.
pub const DELETION_SECRET_NAMESPACE: &str =
    "volume.kubernetes.io/provisioner-deletion-secret-namespace";

/// Puts the annotations of a PV that `driver` provisioned into
/// `annotations`: [`PROVISIONED_BY`] and the deletion Secret `secret`.
pub fn annotate(annotations: &mut BTreeMap<String, String>, driver: &str, secret: &SecretRef) {
    annotations.insert(PROVISIONED_BY.to_owned(), driver.to_owned());
    annotations.insert(DELETION_SECRET_NAME.to_owned(), secret.name.clone());
    annotations.insert(
        DELETION_SECRET_NAMESPACE.to_owned(),
        secret.namespace.clone(),
    );
}

/// A Secret as a PV's `SecretReference`.
pub fn secret_reference(s: &SecretRef) -> SecretReference {
    SecretReference {
        name: Some(s.name.clone()),
        namespace: Some(s.namespace.clone()),
    }
}

/// The Secret to delete a PV's volume with: the annotations external-
/// provisioner also uses, else the controller-expand secret reference.
pub fn deletion_secret(pv: &PersistentVolume) -> Option<SecretRef> {
    let ann = pv.metadata.annotations.as_ref();
    let from_ann = ann.and_then(|a| {
        Some(SecretRef {
            name: a.get(DELETION_SECRET_NAME)?.clone(),
            namespace: a.get(DELETION_SECRET_NAMESPACE)?.clone(),
        })
    });
    from_ann.or_else(|| expand_secret(pv))
}

/// The Secret to expand a PV's volume with: its `controllerExpandSecretRef`,
/// else the deletion secret annotations.
pub fn expand_secret(pv: &PersistentVolume) -> Option<SecretRef> {
    let csi = pv.spec.as_ref()?.csi.as_ref()?;
    let r = csi.controller_expand_secret_ref.as_ref()?;
    Some(SecretRef {
        name: r.name.clone()?,
        namespace: r.namespace.clone()?,
    })
}

/// The volume of a PV that `provisioner` made: `None` for any other PV.
pub fn our_volume(pv: &PersistentVolume, provisioner: &str) -> Option<Result<VolumeId, String>> {
    let by = pv.metadata.annotations.as_ref()?.get(PROVISIONED_BY)?;
    let csi = pv.spec.as_ref()?.csi.as_ref()?;
    if by != provisioner || csi.driver != provisioner {
        return None;
    }
    Some(VolumeId::parse(&csi.volume_handle))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{CSIPersistentVolumeSource, PersistentVolumeSpec};
    use kube::api::ObjectMeta;

    #[test]
    fn what_annotate_writes_is_read_back() {
        let secret = SecretRef {
            namespace: "ceph".into(),
            name: "prov".into(),
        };
        let vol = VolumeId {
            cluster_id: "c1".into(),
            pool: "rbd".into(),
            rados_namespace: String::new(),
            image: "pvc-1".into(),
        };
        let mut annotations = BTreeMap::new();
        annotate(&mut annotations, "rbd.rbdkit.io", &secret);
        let mut pv = PersistentVolume {
            metadata: ObjectMeta {
                annotations: Some(annotations),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                csi: Some(CSIPersistentVolumeSource {
                    driver: "rbd.rbdkit.io".into(),
                    volume_handle: vol.handle(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        };
        assert_eq!(deletion_secret(&pv), Some(secret.clone()));
        assert_eq!(our_volume(&pv, "rbd.rbdkit.io"), Some(Ok(vol)));
        assert_eq!(our_volume(&pv, "other.io"), None);
        // Without the annotations, the expand reference is the fallback.
        assert_eq!(expand_secret(&pv), None);
        pv.metadata.annotations = None;
        let csi = pv.spec.as_mut().unwrap().csi.as_mut().unwrap();
        csi.controller_expand_secret_ref = Some(secret_reference(&secret));
        assert_eq!(deletion_secret(&pv), Some(secret));
        assert_eq!(our_volume(&pv, "rbd.rbdkit.io"), None);
    }
}
