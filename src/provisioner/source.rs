//! Claims with a data source: what a new volume is cloned from.
//!
//! `spec.dataSourceRef` (else `spec.dataSource`) may name a claim of the
//! same namespace, bound to one of our PVs (a volume clone), or a
//! VolumeSnapshot whose VolumeSnapshotContent is ours and ready (a
//! restore). Anything else is refused; a snapshot that is not ready yet is
//! waited for.
//!
//! A source claim carries [`CLONE_FINALIZER`] from before its image is
//! first touched until no clone of it is in progress, so its PV (and image)
//! cannot go away under a clone.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::ResourceExt;

use crate::provisioner::controller::{edit_meta, pv_capacity};
use crate::provisioner::pv::our_volume;
use crate::volume::{SnapshotId, VolumeId};

/// Finalizer on a source claim while a clone of it is being made.
pub const CLONE_FINALIZER: &str = "rbdkit.io/cloning-protection";
/// API group of VolumeSnapshots and VolumeSnapshotContents.
pub const SNAPSHOT_GROUP: &str = "snapshot.storage.k8s.io";

/// The data source a claim names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataSource {
    /// Its API group (empty for the core group).
    pub api_group: String,
    /// Its kind.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// Its namespace, if `dataSourceRef` names one.
    pub namespace: Option<String>,
}

impl std::fmt::Display for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.api_group.is_empty() {
            write!(f, "{} {:?}", self.kind, self.name)
        } else {
            write!(f, "{}.{} {:?}", self.kind, self.api_group, self.name)
        }
    }
}

/// What a resolved data source is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A clone of the volume of claim `claim` (same namespace).
    Volume {
        /// The source claim's name.
        claim: String,
        /// Its volume.
        volume: VolumeId,
        /// Its size in bytes (its PV's capacity).
        size: u64,
    },
    /// A restore of a snapshot.
    Snapshot {
        /// The VolumeSnapshot's name.
        name: String,
        /// The snapshot.
        snapshot: SnapshotId,
        /// Its restore size in bytes (0 if not reported).
        size: u64,
    },
}

impl Source {
    /// Where the source lives (for a snapshot, its snapshot image).
    pub fn place(&self) -> VolumeId {
        match self {
            Source::Volume { volume, .. } => volume.clone(),
            Source::Snapshot { snapshot, .. } => snapshot.image_id(),
        }
    }

    /// The source's size in bytes (0 if not known).
    pub fn size(&self) -> u64 {
        match self {
            Source::Volume { size, .. } | Source::Snapshot { size, .. } => *size,
        }
    }

    /// How events name it.
    pub fn describe(&self) -> String {
        match self {
            Source::Volume { claim, .. } => format!("claim {claim:?}"),
            Source::Snapshot { name, .. } => format!("VolumeSnapshot {name:?}"),
        }
    }
}

/// Why a data source cannot be used now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unresolved {
    /// Not usable yet (a snapshot not ready): retried with backoff.
    Wait(String),
    /// Not usable as asked: retried with backoff too, but a warning.
    Refused(String),
}

impl From<kube::Error> for Unresolved {
    fn from(e: kube::Error) -> Self {
        Unresolved::Refused(format!("Kubernetes API: {e}"))
    }
}

/// The claim's data source: `dataSourceRef` if set, else `dataSource`.
pub fn data_source(claim: &PersistentVolumeClaim) -> Option<DataSource> {
    let spec = claim.spec.as_ref()?;
    if let Some(r) = &spec.data_source_ref {
        return Some(DataSource {
            api_group: r.api_group.clone().unwrap_or_default(),
            kind: r.kind.clone(),
            name: r.name.clone(),
            namespace: r.namespace.clone().filter(|n| !n.is_empty()),
        });
    }
    spec.data_source.as_ref().map(|r| DataSource {
        api_group: r.api_group.clone().unwrap_or_default(),
        kind: r.kind.clone(),
        name: r.name.clone(),
        namespace: None,
    })
}

/// The name of the source claim, if the claim is a volume clone.
pub fn source_claim(claim: &PersistentVolumeClaim) -> Option<String> {
    let ds = data_source(claim)?;
    (ds.api_group.is_empty() && ds.kind == "PersistentVolumeClaim").then_some(ds.name)
}

fn snapshot_api(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(SNAPSHOT_GROUP, "v1", kind), plural)
}

/// Looks up what `ds` (named by `claim`) is, for a provisioner named
/// `provisioner`.
pub async fn resolve(
    client: &kube::Client,
    provisioner: &str,
    claim: &PersistentVolumeClaim,
    ds: &DataSource,
) -> Result<Source, Unresolved> {
    let namespace = claim.namespace().unwrap_or_default();
    if let Some(ns) = &ds.namespace {
        if *ns != namespace {
            return Err(Unresolved::Refused(format!(
                "the data source {ds} is in namespace {ns:?}; only sources in the claim's own namespace are supported"
            )));
        }
    }
    match (ds.api_group.as_str(), ds.kind.as_str()) {
        ("", "PersistentVolumeClaim") => resolve_claim(client, provisioner, &namespace, ds).await,
        (SNAPSHOT_GROUP, "VolumeSnapshot") => {
            resolve_snapshot(client, provisioner, &namespace, ds).await
        }
        _ => Err(Unresolved::Refused(format!(
            "the data source {ds} is not supported: only a PersistentVolumeClaim or a {SNAPSHOT_GROUP} VolumeSnapshot can be cloned from"
        ))),
    }
}

async fn resolve_claim(
    client: &kube::Client,
    provisioner: &str,
    namespace: &str,
    ds: &DataSource,
) -> Result<Source, Unresolved> {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    let refused = |why: String| Unresolved::Refused(format!("source claim {:?} {why}", ds.name));
    let Some(src) = claims.get_opt(&ds.name).await? else {
        return Err(refused("does not exist".into()));
    };
    let phase = src.status.as_ref().and_then(|s| s.phase.as_deref());
    let pv_name = src
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|v| !v.is_empty());
    let (Some("Bound"), Some(pv_name)) = (phase, pv_name) else {
        return Err(Unresolved::Wait(format!(
            "source claim {:?} is not Bound yet (phase {})",
            ds.name,
            phase.unwrap_or("unknown")
        )));
    };
    if src.metadata.deletion_timestamp.is_some()
        && !src.finalizers().iter().any(|f| f == CLONE_FINALIZER)
    {
        return Err(refused("is being deleted".into()));
    }
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let Some(pv) = pvs.get_opt(&pv_name).await? else {
        return Err(refused(format!(
            "is bound to PV {pv_name}, which does not exist"
        )));
    };
    let volume = match our_volume(&pv, provisioner) {
        Some(Ok(v)) => v,
        Some(Err(e)) => return Err(refused(format!("is bound to PV {pv_name}: {e}"))),
        None => {
            return Err(refused(format!(
                "is bound to PV {pv_name}, which was not provisioned by {provisioner}"
            )))
        }
    };
    Ok(Source::Volume {
        claim: ds.name.clone(),
        size: pv_capacity(&pv),
        volume,
    })
}

fn field<'a>(obj: &'a DynamicObject, path: &[&str]) -> Option<&'a serde_json::Value> {
    let mut v = &obj.data;
    for p in path {
        v = v.get(p)?;
    }
    Some(v)
}

fn str_field(obj: &DynamicObject, path: &[&str]) -> Option<String> {
    field(obj, path)?
        .as_str()
        .map(str::to_owned)
        .filter(|s| !s.is_empty())
}

async fn resolve_snapshot(
    client: &kube::Client,
    provisioner: &str,
    namespace: &str,
    ds: &DataSource,
) -> Result<Source, Unresolved> {
    let snaps: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        namespace,
        &snapshot_api("VolumeSnapshot", "volumesnapshots"),
    );
    let refused = |why: String| Unresolved::Refused(format!("VolumeSnapshot {:?} {why}", ds.name));
    let snap = match snaps.get_opt(&ds.name).await {
        Ok(Some(s)) => s,
        Ok(None) => return Err(refused("does not exist".into())),
        Err(kube::Error::Api(e)) if e.code == 404 => {
            return Err(refused(format!(
                "cannot be read: the {SNAPSHOT_GROUP} CRDs are not installed"
            )))
        }
        Err(e) => return Err(e.into()),
    };
    if snap.metadata.deletion_timestamp.is_some() {
        return Err(refused("is being deleted".into()));
    }
    let wait = |why: String| Unresolved::Wait(format!("VolumeSnapshot {:?} {why}", ds.name));
    let Some(content_name) = str_field(&snap, &["status", "boundVolumeSnapshotContentName"]) else {
        return Err(wait(
            "is not bound to a VolumeSnapshotContent yet; waiting for it".into(),
        ));
    };
    let contents: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &snapshot_api("VolumeSnapshotContent", "volumesnapshotcontents"),
    );
    let Some(content) = contents.get_opt(&content_name).await? else {
        return Err(wait(format!(
            "is bound to VolumeSnapshotContent {content_name:?}, which does not exist yet"
        )));
    };
    let driver = str_field(&content, &["spec", "driver"]).unwrap_or_default();
    if driver != provisioner {
        return Err(refused(format!(
            "is a snapshot of driver {driver:?}, not {provisioner:?}"
        )));
    }
    let ready = field(&content, &["status", "readyToUse"]).and_then(|v| v.as_bool()) == Some(true);
    let handle = str_field(&content, &["status", "snapshotHandle"]);
    let (true, Some(handle)) = (ready, handle) else {
        return Err(wait(format!(
            "is not ready to use yet (VolumeSnapshotContent {content_name:?}); waiting for it"
        )));
    };
    let snapshot = SnapshotId::parse(&handle).map_err(|e| refused(e.to_string()))?;
    let size = field(&content, &["status", "restoreSize"])
        .and_then(|v| v.as_i64())
        .map(|n| n.max(0) as u64)
        .unwrap_or(0);
    Ok(Source::Snapshot {
        name: ds.name.clone(),
        snapshot,
        size,
    })
}

/// Refuses a source in another cluster, pool or RADOS namespace than the
/// StorageClass `class` provisions into (clones stay in their source's
/// pool).
pub fn check_place(source: &Source, target: &VolumeId, class: &str) -> Result<(), String> {
    let from = source.place();
    if from.cluster_id != target.cluster_id
        || from.pool != target.pool
        || from.rados_namespace != target.rados_namespace
    {
        return Err(format!(
            "the data source {} is in cluster {:?}, pool {:?}{}, but StorageClass {class:?} provisions into cluster {:?}, pool {:?}{}; a clone must stay in its source's cluster and pool",
            source.describe(),
            from.cluster_id,
            from.pool,
            ns_words(&from.rados_namespace),
            target.cluster_id,
            target.pool,
            ns_words(&target.rados_namespace),
        ));
    }
    Ok(())
}

fn ns_words(ns: &str) -> String {
    if ns.is_empty() {
        String::new()
    } else {
        format!(" (RADOS namespace {ns:?})")
    }
}

/// Refuses a request smaller than the source.
pub fn check_size(source: &Source, size: u64) -> Result<(), String> {
    let have = source.size();
    if have > size {
        return Err(format!(
            "the claim requests {size} bytes (rounded up to whole MiB), less than its data source {}'s {have} bytes; a clone cannot be smaller than its source",
            source.describe()
        ));
    }
    Ok(())
}

/// Adds or removes [`CLONE_FINALIZER`] on source claim `name`, guarded by
/// its resourceVersion. A missing claim is not an error; the finalizer is
/// not added to a claim being deleted (it reports `Ok(false)` then).
pub async fn set_protection(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    present: bool,
) -> Result<bool, kube::Error> {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    edit_meta(&api, name, CLONE_FINALIZER, present, &BTreeMap::new()).await
}

/// Lets go of source claim `source` once no claim other than `done` (a uid)
/// is still being cloned from it: a clone in progress is a claim naming it
/// as data source that has no PV yet and is not being deleted.
pub async fn release_source(
    client: &kube::Client,
    namespace: &str,
    source: &str,
    done: &str,
) -> Result<(), kube::Error> {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    let others = api.list(&Default::default()).await?;
    let busy = others.items.iter().any(|c| {
        c.metadata.uid.as_deref() != Some(done)
            && c.metadata.deletion_timestamp.is_none()
            && source_claim(c).as_deref() == Some(source)
            && c.spec
                .as_ref()
                .and_then(|s| s.volume_name.as_deref())
                .is_none_or(str::is_empty)
    });
    if busy {
        return Ok(());
    }
    set_protection(client, namespace, source, false)
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(spec: serde_json::Value) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns"},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn data_source_ref_wins_over_data_source() {
        let c = claim(json!({
            "dataSource": {"kind": "PersistentVolumeClaim", "name": "a"},
            "dataSourceRef": {"apiGroup": SNAPSHOT_GROUP, "kind": "VolumeSnapshot", "name": "s"},
        }));
        let ds = data_source(&c).unwrap();
        assert_eq!(ds.kind, "VolumeSnapshot");
        assert_eq!(ds.name, "s");
        assert_eq!(source_claim(&c), None);
        let c = claim(json!({"dataSource": {"kind": "PersistentVolumeClaim", "name": "a"}}));
        assert_eq!(source_claim(&c).as_deref(), Some("a"));
        assert_eq!(data_source(&claim(json!({}))), None);
    }

    #[test]
    fn place_and_size_are_checked_with_both_sides_named() {
        let v = |c: &str, p: &str| VolumeId {
            cluster_id: c.into(),
            pool: p.into(),
            rados_namespace: String::new(),
            image: "i".into(),
        };
        let src = Source::Volume {
            claim: "a".into(),
            volume: v("c1", "p1"),
            size: 8 << 20,
        };
        assert!(check_place(&src, &v("c1", "p1"), "sc").is_ok());
        let e = check_place(&src, &v("c1", "p2"), "sc").unwrap_err();
        assert!(
            e.contains("\"p1\"") && e.contains("\"p2\"") && e.contains("\"sc\""),
            "{e}"
        );
        let e = check_place(&src, &v("c2", "p1"), "sc").unwrap_err();
        assert!(e.contains("\"c1\"") && e.contains("\"c2\""), "{e}");
        assert!(check_size(&src, 8 << 20).is_ok());
        let e = check_size(&src, 4 << 20).unwrap_err();
        assert!(e.contains("smaller than its source"), "{e}");
    }
}
