//! The PersistentVolume the provisioner creates for a claim, and the
//! `volumeHandle` that says where its image is.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeSpec,
};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::ObjectMeta;

use crate::volume::params::{ClassParams, SecretRef};
use crate::volume::pv::{annotate, secret_reference};
use crate::volume::quantity::bytes_quantity;
use crate::volume::VolumeId;

pub use crate::volume::pv::{
    deletion_secret, expand_secret, our_volume, DELETION_SECRET_NAME, DELETION_SECRET_NAMESPACE,
    PROVISIONED_BY, PV_FINALIZER,
};

/// The PV name for a claim: `pvc-<uid>`, as the PV binder expects.
pub fn pv_name_for(claim: &PersistentVolumeClaim) -> Option<String> {
    claim.metadata.uid.as_ref().map(|uid| format!("pvc-{uid}"))
}

/// A claim's volume mode (`Filesystem` when unset).
pub fn claim_volume_mode(claim: &PersistentVolumeClaim) -> String {
    claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_mode.clone())
        .unwrap_or_else(|| "Filesystem".to_owned())
}

/// A claim's access modes.
pub fn claim_access_modes(claim: &PersistentVolumeClaim) -> Vec<String> {
    claim
        .spec
        .as_ref()
        .and_then(|s| s.access_modes.clone())
        .unwrap_or_default()
}

/// Everything a PV is built from.
#[derive(Debug, Clone, Copy)]
pub struct PvInput<'a> {
    /// The provisioner (and CSI driver) name.
    pub provisioner: &'a str,
    /// The PV name.
    pub pv_name: &'a str,
    /// The claim being provisioned.
    pub claim: &'a PersistentVolumeClaim,
    /// Its StorageClass.
    pub class: &'a StorageClass,
    /// The class's parsed parameters.
    pub params: &'a ClassParams,
    /// Where the image is.
    pub volume: &'a VolumeId,
    /// The image size in bytes.
    pub capacity_bytes: u64,
    /// The Secret used to create (and later delete) the image.
    pub provisioner_secret: &'a SecretRef,
    /// The Secret for expansion (the provisioner secret if the class names none).
    pub expand_secret: &'a SecretRef,
    /// The Secret for the node, if the class names one.
    pub node_stage_secret: Option<&'a SecretRef>,
}

/// Builds the PV for a provisioned image.
pub fn build_pv(input: &PvInput<'_>) -> PersistentVolume {
    let claim = input.claim;
    let volume_mode = claim_volume_mode(claim);
    let attributes = crate::volume::volume_context(input.volume, input.params);

    let mut annotations = BTreeMap::new();
    annotate(
        &mut annotations,
        input.provisioner,
        input.provisioner_secret,
    );

    let capacity = BTreeMap::from([("storage".to_owned(), bytes_quantity(input.capacity_bytes))]);

    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(input.pv_name.to_owned()),
            annotations: Some(annotations),
            finalizers: Some(vec![PV_FINALIZER.to_owned()]),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            access_modes: Some(claim_access_modes(claim)),
            capacity: Some(capacity),
            claim_ref: Some(ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("PersistentVolumeClaim".to_owned()),
                namespace: claim.metadata.namespace.clone(),
                name: claim.metadata.name.clone(),
                uid: claim.metadata.uid.clone(),
                resource_version: claim.metadata.resource_version.clone(),
                ..Default::default()
            }),
            csi: Some(CSIPersistentVolumeSource {
                driver: input.provisioner.to_owned(),
                volume_handle: input.volume.handle(),
                fs_type: (volume_mode == "Filesystem").then(|| input.params.fs_type.clone()),
                volume_attributes: Some(attributes),
                node_stage_secret_ref: input.node_stage_secret.map(secret_reference),
                controller_expand_secret_ref: Some(secret_reference(input.expand_secret)),
                ..Default::default()
            }),
            mount_options: input.class.mount_options.clone(),
            persistent_volume_reclaim_policy: Some(
                input
                    .class
                    .reclaim_policy
                    .clone()
                    .unwrap_or_else(|| "Delete".to_owned()),
            ),
            storage_class_name: input.class.metadata.name.clone(),
            volume_mode: Some(volume_mode),
            ..Default::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume::quantity::MIB;
    use k8s_openapi::api::core::v1::{PersistentVolumeClaimSpec, VolumeResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn claim(mode: Option<&str>) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some("data".into()),
                namespace: Some("apps".into()),
                uid: Some("1234-abcd".into()),
                resource_version: Some("42".into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                volume_mode: mode.map(str::to_owned),
                storage_class_name: Some("fast".into()),
                resources: Some(VolumeResourceRequirements {
                    requests: Some(BTreeMap::from([(
                        "storage".to_owned(),
                        Quantity("1Gi".into()),
                    )])),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        }
    }

    fn class() -> StorageClass {
        StorageClass {
            metadata: ObjectMeta {
                name: Some("fast".into()),
                ..Default::default()
            },
            provisioner: "rbd.rbdkit.io".into(),
            reclaim_policy: Some("Retain".into()),
            mount_options: Some(vec!["discard".into()]),
            ..Default::default()
        }
    }

    fn params() -> ClassParams {
        let p: BTreeMap<String, String> = [
            ("clusterID", "c1"),
            ("pool", "rbd"),
            ("csi.storage.k8s.io/provisioner-secret-name", "prov"),
            ("csi.storage.k8s.io/provisioner-secret-namespace", "ceph"),
            ("csi.storage.k8s.io/fstype", "xfs"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        ClassParams::parse(&p).unwrap()
    }

    #[test]
    fn builds_a_filesystem_pv() {
        let claim = claim(None);
        let class = class();
        let params = params();
        let volume = VolumeId {
            cluster_id: "c1".into(),
            pool: "rbd".into(),
            rados_namespace: "k8s".into(),
            image: "pvc-1234-abcd".into(),
        };
        let prov = SecretRef {
            namespace: "ceph".into(),
            name: "prov".into(),
        };
        let node = SecretRef {
            namespace: "ceph".into(),
            name: "node".into(),
        };
        let pv = build_pv(&PvInput {
            provisioner: "rbd.rbdkit.io",
            pv_name: &pv_name_for(&claim).unwrap(),
            claim: &claim,
            class: &class,
            params: &params,
            volume: &volume,
            capacity_bytes: 1024 * MIB,
            provisioner_secret: &prov,
            expand_secret: &prov,
            node_stage_secret: Some(&node),
        });
        assert_eq!(pv.metadata.name.as_deref(), Some("pvc-1234-abcd"));
        assert_eq!(pv.metadata.finalizers, Some(vec![PV_FINALIZER.to_owned()]));
        let ann = pv.metadata.annotations.as_ref().unwrap();
        assert_eq!(ann[PROVISIONED_BY], "rbd.rbdkit.io");
        assert_eq!(ann[DELETION_SECRET_NAME], "prov");
        assert_eq!(ann[DELETION_SECRET_NAMESPACE], "ceph");
        let spec = pv.spec.as_ref().unwrap();
        assert_eq!(spec.capacity.as_ref().unwrap()["storage"].0, "1Gi");
        assert_eq!(spec.access_modes, Some(vec!["ReadWriteOnce".to_owned()]));
        assert_eq!(spec.volume_mode.as_deref(), Some("Filesystem"));
        assert_eq!(spec.mount_options, Some(vec!["discard".to_owned()]));
        assert_eq!(
            spec.persistent_volume_reclaim_policy.as_deref(),
            Some("Retain")
        );
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        let cref = spec.claim_ref.as_ref().unwrap();
        assert_eq!(cref.name.as_deref(), Some("data"));
        assert_eq!(cref.namespace.as_deref(), Some("apps"));
        assert_eq!(cref.uid.as_deref(), Some("1234-abcd"));
        assert_eq!(cref.kind.as_deref(), Some("PersistentVolumeClaim"));
        let csi = spec.csi.as_ref().unwrap();
        assert_eq!(csi.driver, "rbd.rbdkit.io");
        assert_eq!(csi.fs_type.as_deref(), Some("xfs"));
        assert_eq!(VolumeId::parse(&csi.volume_handle).unwrap(), volume);
        let attrs = csi.volume_attributes.as_ref().unwrap();
        assert_eq!(attrs["clusterID"], "c1");
        assert_eq!(attrs["pool"], "rbd");
        assert_eq!(attrs["imageName"], "pvc-1234-abcd");
        assert_eq!(attrs["radosNamespace"], "k8s");
        assert_eq!(
            csi.node_stage_secret_ref.as_ref().unwrap().name.as_deref(),
            Some("node")
        );
        assert_eq!(
            csi.controller_expand_secret_ref
                .as_ref()
                .unwrap()
                .name
                .as_deref(),
            Some("prov")
        );
        // No secret material anywhere: only references.
        let text = serde_json::to_string(&pv).unwrap();
        assert!(!text.contains("userKey"));

        assert_eq!(our_volume(&pv, "rbd.rbdkit.io"), Some(Ok(volume)));
        assert_eq!(our_volume(&pv, "other.io"), None);
        assert_eq!(deletion_secret(&pv), Some(prov.clone()));
        assert_eq!(expand_secret(&pv), Some(prov));
    }

    #[test]
    fn builds_a_block_pv_without_fstype_and_with_default_policy() {
        let claim = claim(Some("Block"));
        let mut class = class();
        class.reclaim_policy = None;
        class.mount_options = None;
        let params = params();
        let volume = VolumeId {
            cluster_id: "c1".into(),
            pool: "rbd".into(),
            rados_namespace: "".into(),
            image: "x".into(),
        };
        let prov = SecretRef {
            namespace: "ceph".into(),
            name: "prov".into(),
        };
        let pv = build_pv(&PvInput {
            provisioner: "p.io",
            pv_name: "pvc-x",
            claim: &claim,
            class: &class,
            params: &params,
            volume: &volume,
            capacity_bytes: 5 * MIB,
            provisioner_secret: &prov,
            expand_secret: &prov,
            node_stage_secret: None,
        });
        let spec = pv.spec.unwrap();
        assert_eq!(spec.volume_mode.as_deref(), Some("Block"));
        assert_eq!(
            spec.persistent_volume_reclaim_policy.as_deref(),
            Some("Delete")
        );
        assert_eq!(spec.capacity.unwrap()["storage"].0, "5Mi");
        let csi = spec.csi.unwrap();
        assert_eq!(csi.fs_type, None);
        assert_eq!(csi.node_stage_secret_ref, None);
        assert_eq!(spec.mount_options, None);
    }
}
