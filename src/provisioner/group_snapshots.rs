//! The VolumeGroupSnapshotContent reconciler: csi-snapshotter's group role,
//! done in process. The standard snapshot-controller (with its
//! `CSIVolumeGroupSnapshot` gate on and the `groupsnapshot.storage.k8s.io`
//! CRDs installed) turns a VolumeGroupSnapshot into a
//! VolumeGroupSnapshotContent naming this provisioner as its driver; this
//! takes the group snapshot ([`crate::volume::group_snapshot`]), fills the
//! content's status as csi-snapshotter does (from which the
//! snapshot-controller makes one VolumeSnapshot and VolumeSnapshotContent
//! per member), and deletes the members with the group snapshot when the
//! content goes with deletion policy `Delete`.
//!
//! The protocol is csi-snapshotter's (external-snapshotter v8.7):
//! - credentials come from the content's `deletion-secret-*` annotations,
//!   which the snapshot-controller sets from the class's
//!   `csi.storage.k8s.io/group-snapshotter-secret-*` parameters;
//! - the request name is `groupsnapshot-<VolumeGroupSnapshot uid>`, so a
//!   retry (or a re-run after a crash) takes the same group snapshot;
//! - [`ANN_BEING_CREATED`] is set while a create may be in flight;
//! - the status is written in one update: `volumeGroupSnapshotHandle`,
//!   `readyToUse`, `creationTime` and one `volumeSnapshotInfoList` entry per
//!   member (`volumeHandle`, `snapshotHandle`, `creationTime` in
//!   nanoseconds, `readyToUse`, `restoreSize`);
//! - a content being deleted with [`ANN_BEING_DELETED`] set (or an unbound
//!   pre-provisioned one) has its group snapshot deleted (policy `Delete`)
//!   with the member snapshot ids, its status cleared, and the
//!   snapshot-controller's [`BOUND_FINALIZER`] taken off.
//!
//! As for single snapshots, rbdkit adds [`GROUP_SNAPSHOT_FINALIZER`] before
//! any Ceph work, so no content can vanish while its members may exist.
//! The member VolumeSnapshotContents the snapshot-controller makes carry
//! [`MEMBER_ANNOTATION`]; the VolumeSnapshotContent reconciler
//! ([`crate::provisioner::snapshots`]) leaves their images to this one, as
//! csi-snapshotter does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Deserialize;
use serde_json::json;

use crate::provisioner::content::{self, Content};
use crate::provisioner::controller::{edit_meta, Context};
use crate::provisioner::crd::{self, cluster_resource, nanos};
use crate::provisioner::snapshots::SnapshotRef;
use crate::volume::group_snapshot::{self as group, Copies, Ensured, GroupSnapshotInfo};
use crate::volume::ops::VolumeError;
use crate::volume::params::{SecretRef, SnapshotParams, CLUSTER_ID, POOL};
use crate::volume::{GroupSnapshotId, SnapshotId, VolumeId};

/// The group snapshot API group.
pub const GROUP: &str = "groupsnapshot.storage.k8s.io";
/// rbdkit's finalizer on a content whose member images may exist.
pub const GROUP_SNAPSHOT_FINALIZER: &str = "rbdkit.io/group-snapshot-protection";
/// The snapshot-controller's finalizer on a bound content.
pub const BOUND_FINALIZER: &str =
    "groupsnapshot.storage.kubernetes.io/volumegroupsnapshotcontent-bound-protection";
/// Content annotation: a create may be in flight.
pub const ANN_BEING_CREATED: &str =
    "groupsnapshot.storage.kubernetes.io/volumegroupsnapshot-being-created";
/// Content annotation: its VolumeGroupSnapshot is being deleted.
pub const ANN_BEING_DELETED: &str =
    "groupsnapshot.storage.kubernetes.io/volumegroupsnapshot-being-deleted";
/// Content annotation: the Secret's name to snapshot and delete with.
pub const ANN_SECRET_NAME: &str = "groupsnapshot.storage.kubernetes.io/deletion-secret-name";
/// Content annotation: that Secret's namespace.
pub const ANN_SECRET_NAMESPACE: &str =
    "groupsnapshot.storage.kubernetes.io/deletion-secret-namespace";
/// On a member VolumeSnapshotContent: the group snapshot it belongs to.
pub const MEMBER_ANNOTATION: &str = "groupsnapshot.storage.k8s.io/volumeGroupSnapshotHandle";
/// The prefix of csi-snapshotter's request names (`--groupsnapshot-name-prefix`).
pub const NAME_PREFIX: &str = "groupsnapshot";

/// Class parameters csi-snapshotter reads and never passes to the driver.
const RESERVED: &[&str] = &[
    "csi.storage.k8s.io/group-snapshotter-secret-name",
    "csi.storage.k8s.io/group-snapshotter-secret-namespace",
    "csi.storage.k8s.io/group-snapshotter-get-secret-name",
    "csi.storage.k8s.io/group-snapshotter-get-secret-namespace",
    "csi.storage.k8s.io/snapshotter-secret-name",
    "csi.storage.k8s.io/snapshotter-secret-namespace",
    "csi.storage.k8s.io/snapshotter-list-secret-name",
    "csi.storage.k8s.io/snapshotter-list-secret-namespace",
];
const GET_SECRET_NAME: &str = "csi.storage.k8s.io/group-snapshotter-get-secret-name";
const GET_SECRET_NAMESPACE: &str = "csi.storage.k8s.io/group-snapshotter-get-secret-namespace";

/// A `groupsnapshot.storage.k8s.io/v1` VolumeGroupSnapshotContent (the
/// fields used).
#[derive(Debug, Clone, Deserialize)]
pub struct VolumeGroupSnapshotContent {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The spec.
    pub spec: GroupContentSpec,
    /// The status, once the driver has set it.
    #[serde(default)]
    pub status: Option<GroupContentStatus>,
}

/// `VolumeGroupSnapshotContent.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupContentSpec {
    /// The CSI driver (provisioner) name.
    #[serde(default)]
    pub driver: String,
    /// `Delete` or `Retain`.
    #[serde(default)]
    pub deletion_policy: String,
    /// What to snapshot, or which group snapshot it is.
    #[serde(default)]
    pub source: GroupContentSource,
    /// The VolumeGroupSnapshotClass, if any.
    #[serde(default)]
    pub volume_group_snapshot_class_name: Option<String>,
    /// The VolumeGroupSnapshot it is bound to.
    #[serde(default)]
    pub volume_group_snapshot_ref: SnapshotRef,
}

/// `VolumeGroupSnapshotContent.spec.source`: exactly one is set.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupContentSource {
    /// Dynamic: the volume handles to snapshot together.
    #[serde(default)]
    pub volume_handles: Vec<String>,
    /// Pre-provisioned: the group snapshot and its members.
    #[serde(default)]
    pub group_snapshot_handles: Option<GroupSnapshotHandles>,
}

/// `spec.source.groupSnapshotHandles`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupSnapshotHandles {
    /// The group snapshot handle.
    #[serde(default)]
    pub volume_group_snapshot_handle: String,
    /// Its members' snapshot handles.
    #[serde(default)]
    pub volume_snapshot_handles: Vec<String>,
}

/// `VolumeGroupSnapshotContent.status`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupContentStatus {
    /// The group snapshot handle.
    #[serde(default)]
    pub volume_group_snapshot_handle: Option<String>,
    /// Whether every member can be restored.
    #[serde(default)]
    pub ready_to_use: Option<bool>,
    /// The members.
    #[serde(default)]
    pub volume_snapshot_info_list: Vec<MemberInfo>,
    /// The last error recorded.
    #[serde(default)]
    pub error: Option<crate::provisioner::content::StatusError>,
}

/// One entry of `status.volumeSnapshotInfoList` (the fields read).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MemberInfo {
    /// The source volume.
    #[serde(default)]
    pub volume_handle: String,
    /// The member snapshot.
    #[serde(default)]
    pub snapshot_handle: String,
}

cluster_resource!(
    VolumeGroupSnapshotContent,
    group = GROUP,
    version = "v1",
    kind = "VolumeGroupSnapshotContent",
    plural = "volumegroupsnapshotcontents"
);

impl Content for VolumeGroupSnapshotContent {
    const WHAT: &'static str = "group snapshot content";
    const FINALIZER: &'static str = GROUP_SNAPSHOT_FINALIZER;
    const BOUND_FINALIZER: &'static str = BOUND_FINALIZER;
    const ANN_BEING_CREATED: &'static str = ANN_BEING_CREATED;
    const ANN_BEING_DELETED: &'static str = ANN_BEING_DELETED;
    const REASONS: [&'static str; 3] = [
        "GroupSnapshotCreationFailed",
        "GroupSnapshotContentCheckandUpdateFailed",
        "GroupSnapshotDeleteError",
    ];

    fn driver(&self) -> &str {
        &self.spec.driver
    }
    fn deletion_policy(&self) -> &str {
        &self.spec.deletion_policy
    }
    fn ready(&self) -> bool {
        self.status
            .as_ref()
            .and_then(|s| s.ready_to_use)
            .unwrap_or(false)
    }
    fn dynamic(&self) -> bool {
        !self.spec.source.volume_handles.is_empty()
    }
    fn static_source(&self) -> bool {
        self.spec.source.group_snapshot_handles.is_some()
    }
    fn bound_uid(&self) -> &str {
        self.spec
            .volume_group_snapshot_ref
            .uid
            .as_deref()
            .unwrap_or_default()
    }
    fn handle_in_status(&self) -> bool {
        self.status
            .as_ref()
            .is_some_and(|s| s.volume_group_snapshot_handle.is_some())
    }
    fn error_message(&self) -> Option<&str> {
        self.status
            .as_ref()
            .and_then(|s| s.error.as_ref())
            .and_then(|e| e.message.as_deref())
    }
    fn no_source() -> &'static str {
        "the content's spec.source names neither volumeHandles nor groupSnapshotHandles"
    }
    fn error_status(message: &str, time: &str) -> serde_json::Value {
        json!({"status": {
            "readyToUse": false,
            "error": {"message": message, "time": time},
        }})
    }
    fn cleared_status() -> Option<serde_json::Value> {
        // As csi-snapshotter: gone from the storage, so no handle.
        Some(json!({"status": {
            "volumeGroupSnapshotHandle": null,
            "readyToUse": null,
            "creationTime": null,
            "error": null,
        }}))
    }
    async fn create(&self, ctx: &Context) -> Result<(), String> {
        create(self, ctx).await
    }
    async fn check_static(&self, ctx: &Context) -> Result<(), String> {
        check_static(self, ctx).await
    }
    async fn delete_steps(&self, ctx: &Context) -> Result<(), String> {
        delete_steps(self, ctx).await
    }
}

/// A `groupsnapshot.storage.k8s.io/v1` VolumeGroupSnapshotClass (the fields
/// used).
#[derive(Debug, Clone, Deserialize)]
pub struct VolumeGroupSnapshotClass {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The driver it is for.
    #[serde(default)]
    pub driver: String,
    /// Driver parameters.
    #[serde(default)]
    pub parameters: Option<BTreeMap<String, String>>,
}

cluster_resource!(
    VolumeGroupSnapshotClass,
    group = GROUP,
    version = "v1",
    kind = "VolumeGroupSnapshotClass",
    plural = "volumegroupsnapshotclasses"
);

/// The request name of a dynamic content: csi-snapshotter's
/// `groupsnapshot-<VolumeGroupSnapshot uid>`; `None` while unbound.
pub fn request_name(content: &VolumeGroupSnapshotContent) -> Option<String> {
    content
        .spec
        .volume_group_snapshot_ref
        .uid
        .as_deref()
        .filter(|u| !u.is_empty())
        .map(|uid| format!("{NAME_PREFIX}-{uid}"))
}

/// The class parameters rbdkit validates: csi-snapshotter's reserved
/// `csi.storage.k8s.io/` keys removed; any other key under that prefix is
/// refused, as csi-snapshotter refuses it.
pub fn driver_parameters(
    params: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for (k, v) in params {
        if RESERVED.contains(&k.as_str()) {
            continue;
        }
        if k.starts_with("csi.storage.k8s.io/") {
            return Err(format!(
                "unknown parameter {k:?} with the reserved prefix csi.storage.k8s.io/"
            ));
        }
        out.insert(k.clone(), v.clone());
    }
    Ok(out)
}

/// The member VolumeSnapshotContent of a group snapshot: one the
/// snapshot-controller made for a member, whose image the group snapshot
/// owns.
pub fn is_member(annotations: &BTreeMap<String, String>, status_group_handle: bool) -> bool {
    annotations.contains_key(MEMBER_ANNOTATION) || status_group_handle
}

/// `creationTime` of the content's status: RFC 3339, whole seconds (as a
/// Kubernetes `metav1.Time` is written).
pub fn rfc3339_seconds(t: SystemTime) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    k8s_openapi::jiff::Timestamp::from_second(secs)
        .map(|ts| ts.to_string())
        .unwrap_or_default()
}

/// The status csi-snapshotter writes for a group snapshot made (or, for a
/// pre-provisioned content, found: no member list).
pub fn status_of(info: &GroupSnapshotInfo, with_members: bool) -> serde_json::Value {
    let created = info
        .members
        .iter()
        .map(|m| m.created)
        .min()
        .unwrap_or_else(SystemTime::now);
    let mut status = json!({
        "volumeGroupSnapshotHandle": info.id.handle(),
        "readyToUse": info.members.iter().all(|m| m.ready),
        "creationTime": rfc3339_seconds(created),
        "error": null,
    });
    if with_members {
        status["volumeSnapshotInfoList"] = info
            .members
            .iter()
            .map(|m| {
                json!({
                    "volumeHandle": m.source_volume,
                    "snapshotHandle": m.id.handle(),
                    "creationTime": nanos(m.created),
                    "readyToUse": m.ready,
                    "restoreSize": i64::try_from(m.size).unwrap_or(i64::MAX),
                })
            })
            .collect();
    }
    status
}

fn api(ctx: &Context) -> Api<VolumeGroupSnapshotContent> {
    Api::all(ctx.client.clone())
}

/// The class's validated parameters and the class (required for a
/// dynamic content).
async fn class_of(
    content: &VolumeGroupSnapshotContent,
    ctx: &Context,
) -> Result<Option<(VolumeGroupSnapshotClass, SnapshotParams)>, String> {
    let Some(class_name) = content
        .spec
        .volume_group_snapshot_class_name
        .as_deref()
        .filter(|c| !c.is_empty())
    else {
        return Ok(None);
    };
    let classes: Api<VolumeGroupSnapshotClass> = Api::all(ctx.client.clone());
    let class = classes
        .get_opt(class_name)
        .await
        .map_err(|e| format!("cannot read VolumeGroupSnapshotClass {class_name:?}: {e}"))?
        .ok_or_else(|| format!("VolumeGroupSnapshotClass {class_name:?} not found"))?;
    let raw = driver_parameters(&class.parameters.clone().unwrap_or_default())
        .map_err(|e| format!("VolumeGroupSnapshotClass {class_name:?}: {e}"))?;
    let params = SnapshotParams::parse(&raw).map_err(|e| {
        format!(
            "VolumeGroupSnapshotClass {class_name:?}: {}",
            e.to_string()
                .replace("StorageClass", "VolumeGroupSnapshotClass")
        )
    })?;
    Ok(Some((class, params)))
}

/// The Secret named by the content's annotations.
fn annotated_secret(content: &VolumeGroupSnapshotContent) -> Option<SecretRef> {
    let a = content.annotations();
    match (a.get(ANN_SECRET_NAMESPACE), a.get(ANN_SECRET_NAME)) {
        (Some(ns), Some(name)) if !ns.is_empty() && !name.is_empty() => Some(SecretRef {
            namespace: ns.clone(),
            name: name.clone(),
        }),
        _ => None,
    }
}

fn no_secret() -> String {
    format!(
        "the content has no {ANN_SECRET_NAME}/{ANN_SECRET_NAMESPACE} annotations: its VolumeGroupSnapshotClass must name the Secret with the cephx credentials in csi.storage.k8s.io/group-snapshotter-secret-name and -namespace"
    )
}

async fn create(content: &VolumeGroupSnapshotContent, ctx: &Context) -> Result<(), String> {
    let name = content.name_any();
    // Everything that can be checked without Ceph first: a bad class or
    // source leaves no finalizer and makes nothing.
    let (_, params) = class_of(content, ctx).await?.ok_or_else(|| {
        format!("failed to take group snapshot {name} without a group snapshot class")
    })?;
    let request = request_name(content).ok_or_else(|| {
        format!(
            "cannot create group snapshot: content {name} is not bound to a VolumeGroupSnapshot"
        )
    })?;
    let mut sources = Vec::new();
    for h in &content.spec.source.volume_handles {
        sources.push(
            VolumeId::parse(h)
                .map_err(|why| format!("the source volume handle {h:?} is not rbdkit's: {why}"))?,
        );
    }
    let gid = group::place_of(&sources, &request)?;
    for (key, want, have) in [
        (CLUSTER_ID, &params.cluster_id, &gid.cluster_id),
        (POOL, &params.pool, &gid.pool),
    ] {
        if let Some(w) = want.as_ref().filter(|w| *w != have) {
            return Err(format!(
                "the source volumes are not in the {key} {w:?} the VolumeGroupSnapshotClass names; snapshots stay in their sources' pool"
            ));
        }
    }
    let secret = annotated_secret(content).ok_or_else(no_secret)?;
    let conn = ctx.connect(&gid.cluster_id, &secret).await?;

    // Before any image exists: the content cannot go away without us.
    let mark = BTreeMap::from([(ANN_BEING_CREATED.to_owned(), Some("yes".to_owned()))]);
    let protected = edit_meta(&api(ctx), &name, GROUP_SNAPSHOT_FINALIZER, true, &mark)
        .await
        .map_err(|e| format!("Kubernetes API: {e}"))?;
    if !protected {
        return Err(format!(
            "VolumeGroupSnapshotContent {name} is being deleted; not taking its group snapshot"
        ));
    }
    let provisioner = ctx.name.clone();
    let req = request.clone();
    // Members librbd cannot clone are copied here, in the reconcile: a
    // re-run after a kill redoes the member it was copying.
    let info = ctx
        .ceph(&conn, move |c, m, f| {
            let ensured = group::ensure_group_snapshot_fenced(
                c,
                m,
                f,
                &sources,
                &req,
                &provisioner,
                Copies::Inline,
            )?;
            match ensured {
                Ensured::Ready(info) => Ok(info),
                Ensured::Copying(pending) => pending.run(c, m),
            }
        })
        .await
        .map_err(|e| format!("cannot take group snapshot {gid}: {e}"))?;
    api(ctx)
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status_of(&info, true) })),
        )
        .await
        .map_err(|e| format!("Kubernetes API: {e}"))?;
    let done = BTreeMap::from([(ANN_BEING_CREATED.to_owned(), None)]);
    edit_meta(&api(ctx), &name, GROUP_SNAPSHOT_FINALIZER, true, &done)
        .await
        .map_err(|e| format!("Kubernetes API: {e}"))?;
    ctx.events
        .normal(
            &content.object_ref(&()),
            "GroupSnapshotCreated",
            &format!(
                "Group snapshot {} of {} volumes is ready",
                info.id,
                info.members.len()
            ),
        )
        .await;
    tracing::info!(content = %name, group_snapshot = %info.id, members = info.members.len(), "group snapshot ready");
    Ok(())
}

/// The Secret of a pre-provisioned content: its annotations, or the class's
/// `group-snapshotter-get-secret-*` parameters.
async fn static_secret(
    content: &VolumeGroupSnapshotContent,
    ctx: &Context,
) -> Result<SecretRef, String> {
    if let Some(s) = annotated_secret(content) {
        return Ok(s);
    }
    if let Some((class, _)) = class_of(content, ctx).await? {
        let p = class.parameters.unwrap_or_default();
        if let (Some(name), Some(namespace)) = (p.get(GET_SECRET_NAME), p.get(GET_SECRET_NAMESPACE))
        {
            return Ok(SecretRef {
                namespace: namespace.clone(),
                name: name.clone(),
            });
        }
    }
    Err(format!(
        "{}, or its class must name one in {GET_SECRET_NAME} and {GET_SECRET_NAMESPACE}",
        no_secret()
    ))
}

/// A pre-provisioned content: the group snapshot must exist and be ours.
async fn check_static(content: &VolumeGroupSnapshotContent, ctx: &Context) -> Result<(), String> {
    let name = content.name_any();
    let handles = content
        .spec
        .source
        .group_snapshot_handles
        .clone()
        .unwrap_or_default();
    let gid = GroupSnapshotId::parse(&handles.volume_group_snapshot_handle).map_err(|why| {
        format!(
            "the group snapshot handle {:?} is not rbdkit's: {why}",
            handles.volume_group_snapshot_handle
        )
    })?;
    let expected = member_ids(&handles.volume_snapshot_handles)?;
    let secret = static_secret(content, ctx).await?;
    let conn = ctx.connect(&gid.cluster_id, &secret).await?;
    let (g, provisioner) = (gid.clone(), ctx.name.clone());
    let info = ctx
        .ceph(&conn, move |c, m, _| {
            group::get_group_snapshot(c, m, &g, &expected, &provisioner)
        })
        .await
        .map_err(|e| format!("cannot read group snapshot {gid}: {e}"))?
        .ok_or_else(|| format!("group snapshot {gid} does not exist"))?;
    api(ctx)
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status_of(&info, false) })),
        )
        .await
        .map_err(|e| format!("Kubernetes API: {e}"))?;
    tracing::info!(content = %name, group_snapshot = %gid, "pre-provisioned group snapshot ready");
    Ok(())
}

fn member_ids(handles: &[String]) -> Result<Vec<SnapshotId>, String> {
    handles
        .iter()
        .map(|h| {
            SnapshotId::parse(h)
                .map_err(|why| format!("member snapshot handle {h:?} is not rbdkit's: {why}"))
        })
        .collect()
}

/// The group snapshot a content stands for, and its members as the content
/// names them: from its status, its pre-provisioned handles, or the
/// request name a create uses.
fn group_of(content: &VolumeGroupSnapshotContent) -> Option<(GroupSnapshotId, Vec<SnapshotId>)> {
    let status = content.status.clone().unwrap_or_default();
    let statics = content.spec.source.group_snapshot_handles.as_ref();
    let members: Vec<SnapshotId> = if !status.volume_snapshot_info_list.is_empty() {
        status
            .volume_snapshot_info_list
            .iter()
            .filter_map(|m| SnapshotId::parse(&m.snapshot_handle).ok())
            .collect()
    } else {
        statics
            .map(|h| {
                h.volume_snapshot_handles
                    .iter()
                    .filter_map(|s| SnapshotId::parse(s).ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    let handle = status
        .volume_group_snapshot_handle
        .or_else(|| statics.map(|h| h.volume_group_snapshot_handle.clone()));
    if let Some(h) = handle {
        // A handle this driver cannot have made names nothing of ours.
        return GroupSnapshotId::parse(&h).ok().map(|g| (g, members));
    }
    let request = request_name(content)?;
    let sources: Vec<VolumeId> = content
        .spec
        .source
        .volume_handles
        .iter()
        .filter_map(|h| VolumeId::parse(h).ok())
        .collect();
    group::place_of(&sources, &request)
        .ok()
        .map(|g| (g, members))
}

async fn delete_steps(content: &VolumeGroupSnapshotContent, ctx: &Context) -> Result<(), String> {
    let Some((gid, expected)) = group_of(content) else {
        return Ok(());
    };
    let secret = annotated_secret(content).ok_or_else(no_secret)?;
    let conn = ctx.connect(&gid.cluster_id, &secret).await?;
    let (g, provisioner) = (gid.clone(), ctx.name.clone());
    let outcome = ctx
        .ceph(&conn, move |c, m, f| {
            group::delete_group_snapshot_fenced(c, m, f, &g, &expected, &provisioner)
        })
        .await;
    match outcome {
        Ok(()) => {
            tracing::info!(content = %content.name_any(), group_snapshot = %gid, "group snapshot deleted");
            Ok(())
        }
        // The pool itself is gone: so is the group snapshot.
        Err(VolumeError::Ceph(e)) if e.is_not_found() => Ok(()),
        Err(e) => Err(format!("cannot delete group snapshot {gid}: {e}")),
    }
}

/// Runs the VolumeGroupSnapshotContent controller until `shutdown`
/// resolves ([`crd::run`]: it waits for the CRD; with `enabled` false it
/// only waits).
pub async fn run(
    ctx: Arc<Context>,
    config: kube::runtime::controller::Config,
    enabled: bool,
    shutdown: impl std::future::Future<Output = ()> + Clone + Send + Sync + 'static,
) {
    crd::run::<VolumeGroupSnapshotContent, _, _, _>(
        "VolumeGroupSnapshotContent",
        ctx,
        config,
        enabled,
        shutdown,
        content::reconcile::<VolumeGroupSnapshotContent>,
        content::error_policy::<VolumeGroupSnapshotContent>,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume::snapshot::SnapshotInfo;

    #[test]
    fn class_parameters_lose_the_reserved_keys_and_refuse_unknown_ones() {
        let m = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let p = driver_parameters(&m(&[
            ("csi.storage.k8s.io/group-snapshotter-secret-name", "s"),
            ("csi.storage.k8s.io/group-snapshotter-secret-namespace", "n"),
            ("clusterID", "c"),
        ]))
        .unwrap();
        assert_eq!(p, m(&[("clusterID", "c")]));
        let e = driver_parameters(&m(&[("csi.storage.k8s.io/bogus", "x")])).unwrap_err();
        assert!(e.contains("csi.storage.k8s.io/bogus"), "{e}");
    }

    #[test]
    fn the_status_is_written_as_csi_snapshotter_writes_it() {
        let gid = GroupSnapshotId {
            cluster_id: "c".into(),
            pool: "rbd".into(),
            rados_namespace: "".into(),
            name: "groupsnapshot-u1".into(),
        };
        let src = VolumeId {
            cluster_id: "c".into(),
            pool: "rbd".into(),
            rados_namespace: "".into(),
            image: "pvc-1".into(),
        };
        let t = UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 123_456_789);
        let info = GroupSnapshotInfo {
            id: gid.clone(),
            members: vec![SnapshotInfo {
                id: gid.member(&src, "rbdkit"),
                source_volume: src.handle(),
                size: 1 << 20,
                created: t,
                ready: true,
            }],
        };
        let s = status_of(&info, true);
        assert_eq!(s["volumeGroupSnapshotHandle"], gid.handle());
        assert_eq!(s["readyToUse"], true);
        assert_eq!(s["creationTime"], "2023-11-14T22:13:20Z");
        assert!(s["error"].is_null());
        let m = &s["volumeSnapshotInfoList"][0];
        assert_eq!(m["volumeHandle"], src.handle());
        assert_eq!(m["snapshotHandle"], gid.member(&src, "rbdkit").handle());
        assert_eq!(m["creationTime"], 1_700_000_000_123_456_789_i64);
        assert_eq!(m["readyToUse"], true);
        assert_eq!(m["restoreSize"], 1 << 20);
        assert!(status_of(&info, false)
            .get("volumeSnapshotInfoList")
            .is_none());

        let content: VolumeGroupSnapshotContent = serde_json::from_value(json!({
            "metadata": {"name": "groupsnapcontent-u1"},
            "spec": {
                "driver": "d", "deletionPolicy": "Delete",
                "source": {"volumeHandles": [src.handle()]},
                "volumeGroupSnapshotRef": {"namespace": "ns", "name": "g", "uid": "u1"},
            },
        }))
        .unwrap();
        assert_eq!(request_name(&content).as_deref(), Some("groupsnapshot-u1"));
        // Without a status: the request name and the sources give it.
        assert_eq!(group_of(&content).unwrap().0, gid);
        let ann = BTreeMap::from([(MEMBER_ANNOTATION.to_owned(), "h".to_owned())]);
        assert!(is_member(&ann, false));
        assert!(!is_member(&BTreeMap::new(), false));
    }
}
