//! The VolumeSnapshotContent reconciler: what csi-snapshotter does for a
//! CSI driver, done in process. The standard snapshot-controller turns a
//! VolumeSnapshot into a VolumeSnapshotContent naming this provisioner as
//! its driver; this makes (or checks) the RBD snapshot, fills the content's
//! status, and removes the snapshot when the content goes with deletion
//! policy `Delete`. The Ceph work is [`crate::volume::snapshot`].
//!
//! The protocol with the snapshot-controller is csi-snapshotter's:
//! - credentials come from the content's `deletion-secret-*` annotations,
//!   which the snapshot-controller sets from the class's
//!   `csi.storage.k8s.io/snapshotter-secret-*` parameters (templates such as
//!   `${volumesnapshotcontent.name}` resolved);
//! - [`ANN_BEING_CREATED`] is set while a create may be in flight, so that
//!   the snapshot-controller does not let the content go mid-create;
//! - a content being deleted with [`ANN_BEING_DELETED`] set (or an unbound
//!   pre-provisioned one) has its snapshot removed (policy `Delete`) and the
//!   snapshot-controller's [`BOUND_FINALIZER`] taken off.
//!
//! csi-snapshotter keeps no finalizer of its own and relies on the
//! snapshot-controller's, which is only added after the content exists.
//! rbdkit adds [`SNAPSHOT_FINALIZER`] before any Ceph work instead, as the
//! claim reconciler does, so no content can vanish while its snapshot image
//! may exist. The image name derives from the VolumeSnapshot's uid (as
//! csi-snapshotter's request name `snapshot-<uid>` does), so a retry after a
//! crash finds what an earlier attempt made; a delete uses the same name,
//! so a half-made snapshot is removed too.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde::Deserialize;
use serde_json::json;

use crate::provisioner::content::{self, Content, StatusError};
use crate::provisioner::controller::{edit_meta, Context, ReconcileError};
use crate::provisioner::crd::{self, cluster_resource, nanos};
use crate::volume::image_base;
use crate::volume::ops::VolumeError;
use crate::volume::params::{
    SecretRef, SnapshotParams, CLUSTER_ID, POOL, SNAPSHOTTER_SECRET_NAME,
    SNAPSHOTTER_SECRET_NAMESPACE,
};
use crate::volume::snapshot::{self as snap, CloneOptions, SnapshotOwner, SNAP_NAME};
use crate::volume::{SnapshotId, VolumeId};

/// The snapshot API group.
pub const GROUP: &str = "snapshot.storage.k8s.io";
/// rbdkit's finalizer on a content whose snapshot image may exist.
pub const SNAPSHOT_FINALIZER: &str = "rbdkit.io/snapshot-protection";
/// The snapshot-controller's finalizer on a bound content; the driver takes
/// it off once the snapshot is gone (or retained).
pub const BOUND_FINALIZER: &str =
    "snapshot.storage.kubernetes.io/volumesnapshotcontent-bound-protection";
/// Content annotation: a create may be in flight.
pub const ANN_BEING_CREATED: &str = "snapshot.storage.kubernetes.io/volumesnapshot-being-created";
/// Content annotation: its VolumeSnapshot is being deleted.
pub const ANN_BEING_DELETED: &str = "snapshot.storage.kubernetes.io/volumesnapshot-being-deleted";
/// Content annotation: the Secret's name to snapshot and delete with.
pub const ANN_SECRET_NAME: &str = "snapshot.storage.kubernetes.io/deletion-secret-name";
/// Content annotation: that Secret's namespace.
pub const ANN_SECRET_NAMESPACE: &str = "snapshot.storage.kubernetes.io/deletion-secret-namespace";
/// Class parameters csi-snapshotter reads and never passes to the driver.
const SNAPSHOTTER_LIST_SECRET_NAME: &str = "csi.storage.k8s.io/snapshotter-list-secret-name";
const SNAPSHOTTER_LIST_SECRET_NAMESPACE: &str =
    "csi.storage.k8s.io/snapshotter-list-secret-namespace";

/// A `snapshot.storage.k8s.io/v1` VolumeSnapshotContent (the fields used).
#[derive(Debug, Clone, Deserialize)]
pub struct VolumeSnapshotContent {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The spec.
    pub spec: ContentSpec,
    /// The status, once the driver has set it.
    #[serde(default)]
    pub status: Option<ContentStatus>,
}

/// `VolumeSnapshotContent.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContentSpec {
    /// The CSI driver (provisioner) name.
    #[serde(default)]
    pub driver: String,
    /// `Delete` or `Retain`.
    #[serde(default)]
    pub deletion_policy: String,
    /// What the snapshot is of, or which snapshot it is.
    #[serde(default)]
    pub source: ContentSource,
    /// The VolumeSnapshotClass, if any.
    #[serde(default)]
    pub volume_snapshot_class_name: Option<String>,
    /// The VolumeSnapshot it is bound to.
    #[serde(default)]
    pub volume_snapshot_ref: SnapshotRef,
}

/// `VolumeSnapshotContent.spec.source`: exactly one is set.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContentSource {
    /// Dynamic: the volume handle to snapshot.
    #[serde(default)]
    pub volume_handle: Option<String>,
    /// Pre-provisioned: the snapshot handle.
    #[serde(default)]
    pub snapshot_handle: Option<String>,
}

/// `VolumeSnapshotContent.spec.volumeSnapshotRef`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SnapshotRef {
    /// The VolumeSnapshot's namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Its name.
    #[serde(default)]
    pub name: Option<String>,
    /// Its uid (empty while an unbound pre-provisioned content waits).
    #[serde(default)]
    pub uid: Option<String>,
}

/// `VolumeSnapshotContent.status`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContentStatus {
    /// The snapshot handle.
    #[serde(default)]
    pub snapshot_handle: Option<String>,
    /// Whether restores can be made.
    #[serde(default)]
    pub ready_to_use: Option<bool>,
    /// Set on a member of a volume group snapshot.
    #[serde(default)]
    pub volume_group_snapshot_handle: Option<String>,
    /// The last error creating or checking the snapshot.
    #[serde(default)]
    pub error: Option<StatusError>,
}

cluster_resource!(
    VolumeSnapshotContent,
    group = GROUP,
    version = "v1",
    kind = "VolumeSnapshotContent",
    plural = "volumesnapshotcontents"
);

impl Content for VolumeSnapshotContent {
    const WHAT: &'static str = "snapshot content";
    const FINALIZER: &'static str = SNAPSHOT_FINALIZER;
    const BOUND_FINALIZER: &'static str = BOUND_FINALIZER;
    const ANN_BEING_CREATED: &'static str = ANN_BEING_CREATED;
    const ANN_BEING_DELETED: &'static str = ANN_BEING_DELETED;
    const REASONS: [&'static str; 3] = [
        "SnapshotCreationFailed",
        "SnapshotContentCheckandUpdateFailed",
        "SnapshotDeleteError",
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
        self.spec.source.volume_handle.is_some()
    }
    fn static_source(&self) -> bool {
        self.spec.source.snapshot_handle.is_some()
    }
    fn bound_uid(&self) -> &str {
        self.spec
            .volume_snapshot_ref
            .uid
            .as_deref()
            .unwrap_or_default()
    }
    fn handle_in_status(&self) -> bool {
        self.status
            .as_ref()
            .is_some_and(|s| s.snapshot_handle.is_some())
    }
    fn error_message(&self) -> Option<&str> {
        self.status
            .as_ref()
            .and_then(|s| s.error.as_ref())
            .and_then(|e| e.message.as_deref())
    }
    fn no_source() -> &'static str {
        "the content's spec.source names neither a volumeHandle nor a snapshotHandle"
    }
    fn error_status(message: &str, time: &str) -> serde_json::Value {
        // With readyToUse: the snapshot-controller requeues a VolumeSnapshot
        // on a content change only if readyToUse (not the error) differs, so
        // an error set after it first wrote the snapshot's status never
        // reached the VolumeSnapshot until its 15-minute resync.
        // csi-snapshotter sets both for the same reason. Only a content not
        // ready gets here.
        json!({"status": {
            "error": {"message": message, "time": time},
            "readyToUse": false,
        }})
    }
    async fn elsewhere(&self, ctx: &Context) -> Option<Result<Action, ReconcileError>> {
        let group_handle = self
            .status
            .as_ref()
            .is_some_and(|s| s.volume_group_snapshot_handle.is_some());
        if crate::provisioner::group_snapshots::is_member(self.annotations(), group_handle) {
            return Some(member_content(self, ctx).await);
        }
        None
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

/// A `snapshot.storage.k8s.io/v1` VolumeSnapshotClass (the fields used).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotClass {
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
    VolumeSnapshotClass,
    group = GROUP,
    version = "v1",
    kind = "VolumeSnapshotClass",
    plural = "volumesnapshotclasses"
);

/// The name of the snapshot image for a dynamic content (see the module
/// doc): from the VolumeSnapshot's uid, else the content's name.
pub fn image_name(content: &VolumeSnapshotContent, prefix: &str) -> String {
    let base = match content.spec.volume_snapshot_ref.uid.as_deref() {
        Some(uid) if !uid.is_empty() => format!("snapshot-{uid}"),
        _ => content.name_any(),
    };
    format!("{prefix}{}", image_base(&base))
}

/// The class parameters rbdkit validates: those csi-snapshotter strips
/// (its secret keys) removed.
pub fn driver_parameters(params: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    params
        .iter()
        .filter(|(k, _)| {
            ![
                SNAPSHOTTER_SECRET_NAME,
                SNAPSHOTTER_SECRET_NAMESPACE,
                SNAPSHOTTER_LIST_SECRET_NAME,
                SNAPSHOTTER_LIST_SECRET_NAMESPACE,
            ]
            .contains(&k.as_str())
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The Secret named by the content's annotations.
fn annotated_secret(content: &VolumeSnapshotContent) -> Result<SecretRef, String> {
    let a = content.annotations();
    match (a.get(ANN_SECRET_NAMESPACE), a.get(ANN_SECRET_NAME)) {
        (Some(ns), Some(name)) if !ns.is_empty() && !name.is_empty() => Ok(SecretRef {
            namespace: ns.clone(),
            name: name.clone(),
        }),
        _ => Err(format!(
            "the content has no {ANN_SECRET_NAME}/{ANN_SECRET_NAMESPACE} annotations: its VolumeSnapshotClass must name the Secret with the cephx credentials in {SNAPSHOTTER_SECRET_NAME} and {SNAPSHOTTER_SECRET_NAMESPACE}"
        )),
    }
}

fn api(ctx: &Context) -> Api<VolumeSnapshotContent> {
    Api::all(ctx.client.clone())
}

/// A member of a volume group snapshot: its image belongs to the group
/// snapshot, which creates and deletes it
/// ([`crate::provisioner::group_snapshots`]); as csi-snapshotter, only the
/// finalizers are taken off once it goes.
async fn member_content(
    content: &VolumeSnapshotContent,
    ctx: &Context,
) -> Result<Action, ReconcileError> {
    let deleting = content.metadata.deletion_timestamp.is_some()
        && content.annotations().contains_key(ANN_BEING_DELETED);
    if deleting {
        let api = api(ctx);
        let none = BTreeMap::new();
        let name = content.name_any();
        edit_meta(&api, &name, SNAPSHOT_FINALIZER, false, &none).await?;
        edit_meta(&api, &name, BOUND_FINALIZER, false, &none).await?;
        tracing::info!(content = %name, "group snapshot member content released");
    }
    Ok(Action::await_change())
}

async fn set_ready(
    ctx: &Context,
    name: &str,
    info: &snap::SnapshotInfo,
) -> Result<(), ReconcileError> {
    let patch = json!({"status": {
        "snapshotHandle": info.id.handle(),
        "readyToUse": info.ready,
        "restoreSize": i64::try_from(info.size).unwrap_or(i64::MAX),
        "creationTime": nanos(info.created),
        "error": null,
    }});
    api(ctx)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// The class and its validated parameters.
async fn class_params(
    content: &VolumeSnapshotContent,
    ctx: &Context,
) -> Result<SnapshotParams, String> {
    let Some(class_name) = content
        .spec
        .volume_snapshot_class_name
        .as_deref()
        .filter(|c| !c.is_empty())
    else {
        return SnapshotParams::parse(&BTreeMap::new()).map_err(|e| e.to_string());
    };
    let classes: Api<VolumeSnapshotClass> = Api::all(ctx.client.clone());
    let class = classes
        .get_opt(class_name)
        .await
        .map_err(|e| format!("cannot read VolumeSnapshotClass {class_name:?}: {e}"))?
        .ok_or_else(|| format!("VolumeSnapshotClass {class_name:?} not found"))?;
    let raw = driver_parameters(&class.parameters.unwrap_or_default());
    SnapshotParams::parse(&raw).map_err(|e| {
        format!(
            "VolumeSnapshotClass {class_name:?}: {}",
            e.to_string().replace("StorageClass", "VolumeSnapshotClass")
        )
    })
}

async fn create(content: &VolumeSnapshotContent, ctx: &Context) -> Result<(), String> {
    let name = content.name_any();
    let handle = content
        .spec
        .source
        .volume_handle
        .clone()
        .unwrap_or_default();
    // Everything that can be checked without Ceph first: a bad class or
    // source leaves no finalizer and makes nothing.
    let params = class_params(content, ctx).await?;
    let source = VolumeId::parse(&handle)
        .map_err(|why| format!("the source volume handle {handle:?} is not rbdkit's: {why}"))?;
    for (key, want, have) in [
        (CLUSTER_ID, &params.cluster_id, &source.cluster_id),
        (POOL, &params.pool, &source.pool),
    ] {
        if let Some(w) = want.as_ref().filter(|w| *w != have) {
            return Err(format!(
                "the source volume {source} is not in the {key} {w:?} the VolumeSnapshotClass names; snapshots stay in their source's pool"
            ));
        }
    }
    let secret = annotated_secret(content)?;
    let conn = ctx.connect(&source.cluster_id, &secret).await?;

    // Before any image exists: the content cannot go away without us.
    let mark = BTreeMap::from([(ANN_BEING_CREATED.to_owned(), Some("yes".to_owned()))]);
    let protected = edit_meta(&api(ctx), &name, SNAPSHOT_FINALIZER, true, &mark)
        .await
        .map_err(|e| format!("Kubernetes API: {e}"))?;
    if !protected {
        // Gone or being deleted: an image made now could leak.
        return Err(format!(
            "VolumeSnapshotContent {name} is being deleted; not creating its snapshot"
        ));
    }

    let r = &content.spec.volume_snapshot_ref;
    let owner = SnapshotOwner {
        provisioner: ctx.name.clone(),
        snapshot_name: name.clone(),
        cluster_id: source.cluster_id.clone(),
        snapshot_namespace: r.namespace.clone().unwrap_or_default(),
        snapshot_object: r.name.clone().unwrap_or_default(),
    };
    let image = image_name(content, &params.snapshot_name_prefix);
    let opts = CloneOptions {
        depth: params.clone_depth,
        fence: Arc::clone(&ctx.fence),
        ..Default::default()
    };
    let src = source.clone();
    let info = ctx
        .ceph(&conn, move |c, m, f| {
            snap::ensure_snapshot_fenced(c, m, f, &src, &image, &owner, &opts)
        })
        .await
        .map_err(|e| format!("cannot snapshot volume {source}: {e}"))?;
    // A Vault-encrypted source's key, copied under the snapshot's id.
    crate::provisioner::encryption::snapshot_key(
        ctx,
        &conn,
        &info.id.image_id(),
        &info.id.handle(),
        &secret,
    )
    .await?;
    set_ready(ctx, &name, &info)
        .await
        .map_err(|e| e.to_string())?;
    let done = BTreeMap::from([(ANN_BEING_CREATED.to_owned(), None)]);
    edit_meta(&api(ctx), &name, SNAPSHOT_FINALIZER, true, &done)
        .await
        .map_err(|e| format!("Kubernetes API: {e}"))?;
    ctx.events
        .normal(
            &content.object_ref(&()),
            "SnapshotCreated",
            &format!("Snapshot {} of volume {source} is ready", info.id),
        )
        .await;
    tracing::info!(content = %name, snapshot = %info.id, source = %source, "snapshot ready");
    Ok(())
}

/// A pre-provisioned content: the snapshot must exist and be ours.
async fn check_static(content: &VolumeSnapshotContent, ctx: &Context) -> Result<(), String> {
    let name = content.name_any();
    let handle = content
        .spec
        .source
        .snapshot_handle
        .clone()
        .unwrap_or_default();
    let id = SnapshotId::parse(&handle)
        .map_err(|why| format!("the snapshot handle {handle:?} is not rbdkit's: {why}"))?;
    let secret = annotated_secret(content)?;
    let conn = ctx.connect(&id.cluster_id, &secret).await?;
    let provisioner = ctx.name.clone();
    let sid = id.clone();
    let info = ctx
        .ceph(&conn, move |c, m, _| {
            snap::get_snapshot(c, m, &sid, &provisioner)
        })
        .await
        .map_err(|e| format!("cannot read snapshot {id}: {e}"))?
        .ok_or_else(|| format!("snapshot {id} does not exist (or is not ready)"))?;
    set_ready(ctx, &name, &info)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(content = %name, snapshot = %id, "pre-provisioned snapshot ready");
    Ok(())
}

/// The snapshot a content stands for: its status handle, its
/// pre-provisioned handle, or the deterministic name a create uses.
async fn snapshot_of(
    content: &VolumeSnapshotContent,
    ctx: &Context,
) -> Result<Option<SnapshotId>, String> {
    let handle = content
        .status
        .as_ref()
        .and_then(|s| s.snapshot_handle.clone())
        .or_else(|| content.spec.source.snapshot_handle.clone());
    if let Some(h) = handle {
        // A handle this driver cannot have made names no snapshot.
        return Ok(SnapshotId::parse(&h).ok());
    }
    let Some(vh) = content.spec.source.volume_handle.as_deref() else {
        return Ok(None);
    };
    let Ok(source) = VolumeId::parse(vh) else {
        return Ok(None);
    };
    // The prefix is the class's; a class deleted since then is assumed to
    // have had none.
    let prefix = class_params(content, ctx)
        .await
        .map(|p| p.snapshot_name_prefix)
        .unwrap_or_default();
    Ok(Some(SnapshotId {
        cluster_id: source.cluster_id,
        pool: source.pool,
        rados_namespace: source.rados_namespace,
        image: image_name(content, &prefix),
        snap: SNAP_NAME.to_owned(),
    }))
}

async fn delete_steps(content: &VolumeSnapshotContent, ctx: &Context) -> Result<(), String> {
    let Some(id) = snapshot_of(content, ctx).await? else {
        return Ok(());
    };
    let secret = annotated_secret(content)?;
    let conn = ctx.connect(&id.cluster_id, &secret).await?;
    let provisioner = ctx.name.clone();
    let sid = id.clone();
    let source = content
        .spec
        .source
        .volume_handle
        .as_deref()
        .and_then(|h| VolumeId::parse(h).ok());
    // A Vault key of the snapshot goes once its image is gone.
    let done = crate::provisioner::encryption::remove_with_key(
        ctx,
        &conn,
        &id.image_id(),
        &id.handle(),
        true,
        &secret,
        move |c, m, f| {
            let done = match snap::delete_snapshot_fenced(c, m, f, &sid, &provisioner) {
                // The pool itself is gone: so is the snapshot.
                Err(VolumeError::Ceph(e)) if e.is_not_found() => return Ok(None),
                other => other?,
            };
            // A create killed early leaves its temporary snapshot on the
            // source, where only the content's spec can point.
            if let Some(src) =
                source.filter(|s| s.pool == sid.pool && s.rados_namespace == sid.rados_namespace)
            {
                snap::remove_temp_snapshot(c, m, f, &src, &sid.image)?;
            }
            Ok(Some(done))
        },
    )
    .await
    .map_err(|e| format!("cannot delete snapshot {id}: {e}"))?;
    tracing::info!(content = %content.name_any(), snapshot = %id, outcome = ?done, "snapshot deleted");
    Ok(())
}

/// Runs the VolumeSnapshotContent controller until `shutdown` resolves
/// ([`crd::run`]: it waits for the CRD; with `enabled` false it only
/// waits).
pub async fn run(
    ctx: Arc<Context>,
    config: kube::runtime::controller::Config,
    enabled: bool,
    shutdown: impl std::future::Future<Output = ()> + Clone + Send + Sync + 'static,
) {
    crd::run::<VolumeSnapshotContent, _, _, _>(
        "VolumeSnapshotContent",
        ctx,
        config,
        enabled,
        shutdown,
        content::reconcile::<VolumeSnapshotContent>,
        content::error_policy::<VolumeSnapshotContent>,
    )
    .await
}
