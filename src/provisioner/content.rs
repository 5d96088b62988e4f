//! csi-snapshotter's flow, once for both of its roles: a content object
//! (VolumeSnapshotContent, VolumeGroupSnapshotContent) is either dynamic
//! (the driver makes what it names) or static (it names something that
//! exists), is bound to the user's object, and is released when the
//! snapshot-controller marks it for deletion. [`Content`] says how one kind
//! does each step; [`reconcile`] and [`error_policy`] run the flow.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;

use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::provisioner::controller::{edit_meta, Context, ReconcileError};
use crate::provisioner::crd::now_rfc3339;

/// `status.error` of a content (the part read back).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct StatusError {
    /// The message.
    #[serde(default)]
    pub message: Option<String>,
}

/// A content kind of external-snapshotter, as the provisioner handles it.
pub trait Content:
    Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static
{
    /// What it is called in logs ("snapshot content"); also, without
    /// spaces, the key of its backoff.
    const WHAT: &'static str;
    /// The finalizer the provisioner keeps on it while it owns storage.
    const FINALIZER: &'static str;
    /// The snapshot-controller's finalizer on a bound content.
    const BOUND_FINALIZER: &'static str;
    /// The annotation csi-snapshotter sets while it creates.
    const ANN_BEING_CREATED: &'static str;
    /// The annotation the snapshot-controller sets when it may be deleted.
    const ANN_BEING_DELETED: &'static str;
    /// Event reasons: a dynamic create failed, a static check failed, a
    /// delete failed.
    const REASONS: [&'static str; 3];

    /// The CSI driver it is for.
    fn driver(&self) -> &str;
    /// Its `deletionPolicy` (`Delete` or `Retain`).
    fn deletion_policy(&self) -> &str;
    /// Whether its status says ready.
    fn ready(&self) -> bool;
    /// Whether the driver makes what it names (else it names a handle).
    fn dynamic(&self) -> bool;
    /// Whether it names an existing handle.
    fn static_source(&self) -> bool;
    /// The uid of the user's object it is bound to (empty: unbound).
    fn bound_uid(&self) -> &str;
    /// Whether its status holds a handle (so storage may exist).
    fn handle_in_status(&self) -> bool;
    /// The message of its `status.error`, if it has one.
    fn error_message(&self) -> Option<&str>;
    /// The error when it names neither a source nor a handle.
    fn no_source() -> &'static str;
    /// The status patch that records an error.
    fn error_status(message: &str, time: &str) -> serde_json::Value {
        json!({"status": {"error": {"message": message, "time": time}}})
    }
    /// The status patch after its storage was deleted, if it needs one.
    fn cleared_status() -> Option<serde_json::Value> {
        None
    }

    /// Handled by another flow before this one looks at it (Some: the
    /// outcome), e.g. a member of a group snapshot.
    fn elsewhere(
        &self,
        ctx: &Context,
    ) -> impl Future<Output = Option<Result<Action, ReconcileError>>> + Send {
        let _ = ctx;
        async { None }
    }
    /// Makes what a dynamic content names and fills its status.
    fn create(&self, ctx: &Context) -> impl Future<Output = Result<(), String>> + Send;
    /// Checks a static content's handle and fills its status.
    fn check_static(&self, ctx: &Context) -> impl Future<Output = Result<(), String>> + Send;
    /// Deletes its storage (`Delete` policy).
    fn delete_steps(&self, ctx: &Context) -> impl Future<Output = Result<(), String>> + Send;
}

fn key<K: Content>(content: &K) -> String {
    format!("{}/{}", K::WHAT.replace(' ', ""), content.name_any())
}

fn api<K: Content>(ctx: &Context) -> Api<K> {
    Api::all(ctx.client.clone())
}

/// Reconciles a content of this driver (others are left alone).
pub async fn reconcile<K: Content>(
    content: Arc<K>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    if content.driver() != ctx.name {
        return Ok(Action::await_change());
    }
    ctx.limiter.acquire().await;
    let out = inner(content.as_ref(), &ctx).await;
    if out.is_ok() {
        ctx.pv_failures.succeeded(&key(content.as_ref()));
    }
    out
}

/// Requeues a failed content after its backoff.
pub fn error_policy<K: Content>(
    content: Arc<K>,
    err: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    let delay = ctx.pv_failures.failed(&key(content.as_ref()));
    tracing::warn!(content = %content.name_any(), error = %err, retry_in = ?delay, "{} not done; will retry", K::WHAT);
    Action::requeue(delay)
}

async fn inner<K: Content>(content: &K, ctx: &Context) -> Result<Action, ReconcileError> {
    if let Some(outcome) = content.elsewhere(ctx).await {
        return outcome;
    }
    if content.meta().deletion_timestamp.is_some() {
        let unbound_static = content.static_source() && content.bound_uid().is_empty();
        if unbound_static || content.annotations().contains_key(K::ANN_BEING_DELETED) {
            return released(content, ctx).await;
        }
        // Still bound: the snapshot-controller says when it may go.
        return Ok(Action::await_change());
    }
    if content.ready() {
        // Also puts our finalizer back: the snapshot-controller's first
        // finalizer patch replaces the whole list when its cache had none.
        let has_finalizer = content.finalizers().iter().any(|f| f == K::FINALIZER);
        if !has_finalizer || content.annotations().contains_key(K::ANN_BEING_CREATED) {
            let change = BTreeMap::from([(K::ANN_BEING_CREATED.to_owned(), None)]);
            edit_meta(
                &api::<K>(ctx),
                &content.name_any(),
                K::FINALIZER,
                true,
                &change,
            )
            .await?;
        }
        return Ok(Action::await_change());
    }
    let result = if content.dynamic() {
        content.create(ctx).await
    } else if content.static_source() {
        content.check_static(ctx).await
    } else {
        Err(K::no_source().to_owned())
    };
    match result {
        Ok(()) => Ok(Action::await_change()),
        Err(why) => {
            let reason = if content.dynamic() {
                K::REASONS[0]
            } else {
                K::REASONS[1]
            };
            report_error(content, ctx, reason, &why).await;
            Err(ReconcileError(why))
        }
    }
}

/// A warning event and `status.error`, as csi-snapshotter records a failure.
pub async fn report_error<K: Content>(content: &K, ctx: &Context, reason: &str, why: &str) {
    ctx.events
        .warning(&content.object_ref(&()), reason, why)
        .await;
    let message = crate::k8s::events::clip(why);
    // The same error again: a new time would only wake this reconciler at
    // once (a status change is a change), past its backoff.
    if content.error_message() == Some(message.as_str()) {
        return;
    }
    let patch = K::error_status(&message, &now_rfc3339());
    if let Err(e) = api::<K>(ctx)
        .patch_status(
            &content.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        tracing::warn!(content = %content.name_any(), error = %e, "cannot set the content's status.error");
    }
}

/// A content marked for deletion: its storage goes (policy `Delete`, and
/// only what we made or checked: our finalizer or a status handle), then
/// the finalizers.
async fn released<K: Content>(content: &K, ctx: &Context) -> Result<Action, ReconcileError> {
    let name = content.name_any();
    let ours = content.finalizers().iter().any(|f| f == K::FINALIZER);
    let has_status = content.handle_in_status();
    if content.deletion_policy() == "Delete" && (ours || has_status) {
        if let Err(why) = content.delete_steps(ctx).await {
            ctx.events
                .warning(&content.object_ref(&()), K::REASONS[2], &why)
                .await;
            return Err(ReconcileError(why));
        }
        if let (true, Some(clear)) = (has_status, K::cleared_status()) {
            api::<K>(ctx)
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&clear))
                .await?;
        }
    }
    let api = api::<K>(ctx);
    let none = BTreeMap::new();
    edit_meta(&api, &name, K::FINALIZER, false, &none).await?;
    edit_meta(&api, &name, K::BOUND_FINALIZER, false, &none).await?;
    tracing::info!(content = %name, policy = %content.deletion_policy(), "{} released", K::WHAT);
    Ok(Action::await_change())
}
