//! Objects kept compactly in watch caches.
//!
//! The provisioner caches every claim and PV of the cluster. Decoded, a PV
//! is about 6.7 kB of heap and a claim 4.6 kB: k8s-openapi keeps every
//! volume source inline, and each label, annotation or quantity map is a
//! B-tree node of half a kilobyte. At 1000 of each that was 10 MB, the
//! largest part of the provisioner's heap. [`Compact`] keeps the object as
//! its JSON (1 to 1.5 kB) with only the metadata kube-runtime needs
//! decoded, plus a small [`Digest`] for the passes that look at every
//! cached object; a reconcile decodes its one object with
//! [`Compact::decode`], which costs microseconds.
//!
//! Stored objects are trimmed of `managedFields` and the
//! `kubectl.kubernetes.io/last-applied-configuration` annotation, which no
//! reconciler reads and which are most of an object's size. An object no
//! reconciler acts on (another provisioner's PV, a claim bound to one) is
//! [stripped](Compact::strip) of its JSON too: its identity and digest are
//! all anything reads of it.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

/// The annotation `kubectl apply` leaves: a copy of the whole object.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// What a cache keeps decoded beside an object's JSON: the fields that
/// passes over every cached object read, so they need not decode each one.
pub trait Digest {
    /// The decoded fields.
    type Digest: Clone + fmt::Debug + Send + Sync + 'static;

    /// Takes them from the full object.
    fn digest(&self) -> Self::Digest;
}

/// The fields of a claim that tell, once it is stripped, which PV it is
/// bound to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimDigest {
    /// `spec.volumeName`, if set.
    pub volume: Option<Box<str>>,
}

impl Digest for PersistentVolumeClaim {
    type Digest = ClaimDigest;

    fn digest(&self) -> ClaimDigest {
        ClaimDigest {
            volume: self
                .spec
                .as_ref()
                .and_then(|s| s.volume_name.as_deref())
                .filter(|v| !v.is_empty())
                .map(Into::into),
        }
    }
}

/// The fields of a PV that tell whether the PV binder could give it to a
/// claim (see `provisioner::controller::could_be_bound_to`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PvDigest {
    /// `spec.storageClassName`.
    pub class: Option<Box<str>>,
    /// `status.phase`.
    pub phase: Option<Box<str>>,
    /// `spec.claimRef`'s namespace and name, if it has a claimRef.
    pub claim: Option<(Box<str>, Box<str>)>,
}

impl Digest for PersistentVolume {
    type Digest = PvDigest;

    fn digest(&self) -> PvDigest {
        let spec = self.spec.as_ref();
        PvDigest {
            class: spec
                .and_then(|s| s.storage_class_name.as_deref())
                .map(Into::into),
            phase: self
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .map(Into::into),
            claim: spec.and_then(|s| s.claim_ref.as_ref()).map(|r| {
                (
                    r.namespace.as_deref().unwrap_or_default().into(),
                    r.name.as_deref().unwrap_or_default().into(),
                )
            }),
        }
    }
}

/// An object of kind `K` as a cache keeps it: its JSON (unless stripped),
/// the metadata that identifies it (name, namespace, uid, resourceVersion,
/// deletion timestamp) and its [`Digest`].
pub struct Compact<K: Digest> {
    metadata: ObjectMeta,
    digest: K::Digest,
    json: Option<Box<[u8]>>,
    kind: PhantomData<fn() -> K>,
}

impl<K> Compact<K>
where
    K: Digest + Serialize + DeserializeOwned + kube::Resource,
{
    /// Trims `obj` and keeps it compactly.
    pub fn new(mut obj: K) -> Result<Compact<K>, serde_json::Error> {
        trim(obj.meta_mut());
        let digest = obj.digest();
        // The identity is kept decoded, so not in the JSON a second time.
        let meta = obj.meta_mut();
        let metadata = ObjectMeta {
            name: meta.name.take(),
            namespace: meta.namespace.take(),
            uid: meta.uid.take(),
            resource_version: meta.resource_version.take(),
            deletion_timestamp: meta.deletion_timestamp.take(),
            ..ObjectMeta::default()
        };
        let json = Some(serde_json::to_vec(&obj)?.into_boxed_slice());
        Ok(Compact {
            metadata,
            digest,
            json,
            kind: PhantomData,
        })
    }

    /// The whole object (as trimmed), decoded again; `None` once
    /// [stripped](Compact::strip).
    pub fn decode(&self) -> Option<Result<K, serde_json::Error>> {
        let json = self.json.as_deref()?;
        Some(serde_json::from_slice(json).map(|obj| self.restore(obj)))
    }

    fn restore(&self, mut obj: K) -> K {
        let meta = obj.meta_mut();
        meta.name.clone_from(&self.metadata.name);
        meta.namespace.clone_from(&self.metadata.namespace);
        meta.uid.clone_from(&self.metadata.uid);
        meta.resource_version
            .clone_from(&self.metadata.resource_version);
        meta.deletion_timestamp
            .clone_from(&self.metadata.deletion_timestamp);
        obj
    }
}

impl<K: Digest> Compact<K> {
    /// The fields kept decoded.
    pub fn digest(&self) -> &K::Digest {
        &self.digest
    }

    /// Drops the JSON, keeping the identity and the digest: for an object
    /// that no reconciler acts on in this version. The next watch event for
    /// the object brings a whole new copy.
    pub fn strip(&mut self) {
        self.json = None;
    }

    /// Whether [`Compact::strip`] dropped the JSON.
    pub fn is_stripped(&self) -> bool {
        self.json.is_none()
    }
}

/// Removes what no reconciler reads and most of an object's size.
pub fn trim(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.remove(LAST_APPLIED);
    }
}

impl<K: Digest> Clone for Compact<K> {
    fn clone(&self) -> Self {
        Compact {
            metadata: self.metadata.clone(),
            digest: self.digest.clone(),
            json: self.json.clone(),
            kind: PhantomData,
        }
    }
}

impl<K: Digest + kube::Resource<DynamicType = ()>> fmt::Debug for Compact<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Compact")
            .field("kind", &K::kind(&()))
            .field("namespace", &self.metadata.namespace)
            .field("name", &self.metadata.name)
            .field("json_bytes", &self.json.as_ref().map(|j| j.len()))
            .finish()
    }
}

impl<'de, K> Deserialize<'de> for Compact<K>
where
    K: Digest + Serialize + DeserializeOwned + kube::Resource,
{
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let obj = K::deserialize(d)?;
        Compact::new(obj).map_err(serde::de::Error::custom)
    }
}

impl<K> kube::Resource for Compact<K>
where
    K: Digest + kube::Resource<DynamicType = ()>,
{
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }

    fn api_version(dt: &()) -> Cow<'_, str> {
        K::api_version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;
    use serde_json::json;

    fn pv_json() -> serde_json::Value {
        json!({
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": "pvc-1",
                "uid": "u-1",
                "resourceVersion": "42",
                "deletionTimestamp": "2026-01-02T03:04:05Z",
                "annotations": {
                    "pv.kubernetes.io/provisioned-by": "rbd.rbdkit.io",
                    LAST_APPLIED: "{\"huge\": true}",
                },
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update"}],
                "finalizers": ["kubernetes.io/pv-protection"],
            },
            "spec": {
                "capacity": {"storage": "1Gi"},
                "storageClassName": "fast",
                "claimRef": {"namespace": "ns", "name": "data", "uid": "c-1"},
                "csi": {"driver": "rbd.rbdkit.io", "volumeHandle": "h",
                        "volumeAttributes": {"pool": "rbd"}},
            },
            "status": {"phase": "Bound"},
        })
    }

    #[test]
    fn keeps_the_object_but_what_no_reconciler_reads() {
        let c: Compact<PersistentVolume> = serde_json::from_value(pv_json()).unwrap();
        assert_eq!(c.name_any(), "pvc-1");
        assert_eq!(c.uid().as_deref(), Some("u-1"));
        assert_eq!(c.resource_version().as_deref(), Some("42"));
        let pv = c.decode().unwrap().unwrap();
        let mut want: PersistentVolume = serde_json::from_value(pv_json()).unwrap();
        trim(&mut want.metadata);
        assert_eq!(pv, want);
        assert!(pv.metadata.managed_fields.is_none());
        assert!(!pv.annotations().contains_key(LAST_APPLIED));
        assert_eq!(pv.annotations().len(), 1);
        assert_eq!(
            c.digest(),
            &PvDigest {
                class: Some("fast".into()),
                phase: Some("Bound".into()),
                claim: Some(("ns".into(), "data".into())),
            }
        );
    }

    #[test]
    fn only_identity_metadata_is_kept_decoded() {
        let c: Compact<PersistentVolume> = serde_json::from_value(pv_json()).unwrap();
        let m = kube::Resource::meta(&c);
        assert!(m.annotations.is_none() && m.finalizers.is_none() && m.managed_fields.is_none());
        // The full object is far larger decoded than kept.
        assert!(c.json.as_ref().unwrap().len() < std::mem::size_of::<PersistentVolume>());
    }

    #[test]
    fn a_stripped_object_keeps_its_identity_and_digest_only() {
        let mut c: Compact<PersistentVolume> = serde_json::from_value(pv_json()).unwrap();
        let digest = c.digest().clone();
        assert!(!c.is_stripped());
        c.strip();
        assert!(c.is_stripped());
        assert!(c.decode().is_none());
        assert_eq!(c.name_any(), "pvc-1");
        assert_eq!(c.resource_version().as_deref(), Some("42"));
        assert_eq!(c.digest(), &digest);
        assert!(format!("{c:?}").contains("json_bytes: None"));
    }

    #[test]
    fn a_claim_digest_names_its_volume() {
        let claim = |v: serde_json::Value| -> Compact<PersistentVolumeClaim> {
            serde_json::from_value(json!({
                "metadata": {"name": "data", "namespace": "ns"},
                "spec": v,
            }))
            .unwrap()
        };
        assert_eq!(
            claim(json!({"volumeName": "pv-9"}))
                .digest()
                .volume
                .as_deref(),
            Some("pv-9")
        );
        assert_eq!(claim(json!({"volumeName": ""})).digest().volume, None);
        assert_eq!(claim(json!({})).digest().volume, None);
    }

    #[test]
    fn names_the_kind_of_what_it_holds() {
        use kube::Resource;
        assert_eq!(
            Compact::<PersistentVolumeClaim>::kind(&()),
            "PersistentVolumeClaim"
        );
        assert_eq!(
            Compact::<PersistentVolume>::plural(&()),
            "persistentvolumes"
        );
        assert_eq!(
            Compact::<PersistentVolume>::url_path(&(), None),
            "/api/v1/persistentvolumes"
        );
    }
}
