//! Space reclaim, as csi-addons' ReclaimSpace: on demand
//! (`ReclaimSpaceJob`), on a schedule (`ReclaimSpaceCronJob`), and from a
//! claim's `reclaimspace.csiaddons.openshift.io/schedule` annotation, with
//! csi-addons' own CRDs (`csiaddons.openshift.io/v1alpha1`, same fields),
//! reconciled by the leader itself as [`crate::provisioner::network_fence`]
//! says why (no sidecar).
//!
//! **Whose.** A job is ours when its target claim is bound to a PV this
//! provisioner made. A target that names no claim, or a claim that does not
//! exist, is bad input: the job is Failed at once, naming it, with a
//! Warning event. A claim of ours not bound yet counts a failed attempt.
//!
//! **Who does the work.** A volume staged on a node (its staging lock,
//! [`crate::node::stage_lock`], names the node) is trimmed there: its
//! filesystem knows which blocks are free, Ceph does not. The node plugin
//! has no Kubernetes client for this, and csi-addons' node routing needs
//! its sidecar and VolumeAttachments rbdkit does not have, so the request
//! goes through the image itself: the provisioner writes a request id to
//! the header xattr `rbdkit.reclaim.request.<node>`; the node plugin looks
//! every `--reclaim-poll` (30 s) at the volumes it has staged (one xattr
//! read each, bounded by the Ceph op timeout), runs `fstrim` on a
//! filesystem (a Block volume's free space is its user's to know: nothing
//! to do), answers in `rbdkit.reclaim.done.<node>` with the same id, and
//! takes the request away.
//! The id is the job's uid and its attempt, so a re-run after a crash of
//! either side finds it answered or asks again the same way, and a retry
//! after a failed answer asks anew. A volume staged nowhere is sparsified
//! by the provisioner (`rbd_sparsify`: runs of zeroes of 64 KiB and more
//! deallocated), one Ceph op timeout at a time (a later pass goes on; a
//! range done twice is harmless), and only while it holds the lease; an
//! image open elsewhere without the exclusive-lock feature is left alone
//! (a write could land between sparsify's read of zeroes and its
//! deallocation).
//!
//! **Status** as csi-addons writes it: `startTime`, `result`
//! Succeeded|Failed, `message` (while waiting too: which node is asked),
//! `reclaimedSpace` (the image's allocated bytes before less after,
//! counted by extent with `rbd_diff_iterate2`), `retries`,
//! `completionTime`. A job is Failed after `backOffLimit` failed attempts
//! (6) or once `retryDeadlineSeconds` (600) have passed since it started (a
//! node that never answers). The usage before is kept in an annotation of
//! the job before the node is asked, so a restart measures from the same
//! point.
//!
//! **Schedules.** A ReclaimSpaceCronJob creates a ReclaimSpaceJob named
//! `<cronjob>-<unix seconds of the run>` for each run of its schedule
//! ([`crate::provisioner::cron`], UTC) that has come (runs missed while
//! nobody led are one run, the latest; one later than
//! `startingDeadlineSeconds` is skipped). The name makes a repeat after a
//! crash find it. The job is owned by the cron job; `Forbid` (the default)
//! skips a run while the last job has no result, `Replace` deletes it. It
//! keeps `successfulJobsHistoryLimit` (3) and `failedJobsHistoryLimit` (1)
//! finished jobs. A schedule that does not parse is reported by name in a
//! Warning event on the cron job, and nothing runs.
//!
//! **A claim's annotation.** A bound claim of this provisioner with the
//! schedule annotation gets a ReclaimSpaceCronJob `<claim>-reclaimspace`,
//! owned by the claim, with that schedule, recorded in the claim's
//! `reclaimspace.csiaddons.openshift.io/cronjob` annotation; a changed
//! schedule updates it, and removing the annotation deletes it. Unlike
//! csi-addons, which falls back to `@weekly`, a schedule that does not
//! parse is refused: a Warning event on the claim names it, and the cron
//! job is left as it was.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::runtime::controller::{Action, Config};
use kube::{Resource, ResourceExt};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::k8s::backoff::before_work;
use crate::k8s::events::clip;
use crate::node::stage_lock::ImageLock;
use crate::provisioner::controller::{for_provisioner, Context, ReconcileError};
use crate::provisioner::crd::{self, namespaced_resource, now_rfc3339};
use crate::provisioner::cron::Schedule;
use crate::provisioner::network_fence::CSIADDONS_GROUP;
use crate::rbd::{Features, Image};
use crate::volume::ops::VolumeError;
use crate::volume::params::SecretRef;
use crate::volume::pv::{deletion_secret, our_volume};
use crate::volume::quantity::bytes_quantity;
use crate::volume::VolumeId;

/// The claim annotation with a reclaim schedule (csi-addons').
pub const SCHEDULE_ANNOTATION: &str = "reclaimspace.csiaddons.openshift.io/schedule";
/// Claim annotation: the ReclaimSpaceCronJob made for its schedule
/// (csi-addons').
pub const CRONJOB_ANNOTATION: &str = "reclaimspace.csiaddons.openshift.io/cronjob";
/// Job annotation: the image's allocated bytes before the reclaim.
pub const USED_BEFORE_ANNOTATION: &str = "rbdkit.io/reclaim-used-before";
/// Label on the jobs a cron job made, with its name.
pub const CRONJOB_LABEL: &str = "rbdkit.io/reclaimspacecronjob";
/// Label on the cron job made for a claim's annotation, with the claim's
/// name.
pub const MANAGED_LABEL: &str = "rbdkit.io/reclaimspace-for-claim";
/// The smallest run of zeroes `rbd_sparsify` deallocates here.
const SPARSE_SIZE: usize = 64 << 10;
/// How often a job waiting for a node's answer (or a sparsify cut by its
/// deadline) looks again.
const POLL: Duration = Duration::from_secs(2);
/// csi-addons' defaults.
const DEFAULT_BACK_OFF_LIMIT: i32 = 6;
const DEFAULT_RETRY_DEADLINE: i64 = 600;

/// `ReclaimSpaceJob.spec` (and a cron job's template spec).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReclaimSpaceJobSpec {
    /// The target.
    #[serde(default)]
    pub target: Target,
    /// Failed attempts allowed (default 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub back_off_limit: Option<i32>,
    /// Seconds from the start after which it is not retried (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_deadline_seconds: Option<i64>,
    /// A per-call timeout (csi-addons' gRPC timeout; unused here: every
    /// Ceph call is bounded by the op timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
}

/// `spec.target`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Target {
    /// The claim, in the job's namespace.
    #[serde(default)]
    pub persistent_volume_claim: String,
}

/// `ReclaimSpaceJob.status` (the fields read).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReclaimSpaceJobStatus {
    /// Succeeded or Failed, once done.
    #[serde(default)]
    pub result: String,
    /// What happened, or what it waits for.
    #[serde(default)]
    pub message: String,
    /// Failed attempts so far.
    #[serde(default)]
    pub retries: i32,
    /// When it started.
    #[serde(default)]
    pub start_time: Option<String>,
    /// When it finished.
    #[serde(default)]
    pub completion_time: Option<String>,
}

/// `csiaddons.openshift.io/v1alpha1` ReclaimSpaceJob.
#[derive(Debug, Clone, Deserialize)]
pub struct ReclaimSpaceJob {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The spec.
    #[serde(default)]
    pub spec: ReclaimSpaceJobSpec,
    /// The status.
    #[serde(default)]
    pub status: Option<ReclaimSpaceJobStatus>,
}

/// `ReclaimSpaceCronJob.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReclaimSpaceCronJobSpec {
    /// The schedule (cron, UTC).
    #[serde(default)]
    pub schedule: String,
    /// Forbid (default) or Replace.
    #[serde(default)]
    pub concurrency_policy: Option<String>,
    /// No new runs while true.
    #[serde(default)]
    pub suspend: Option<bool>,
    /// A run later than this many seconds after its time is skipped.
    #[serde(default)]
    pub starting_deadline_seconds: Option<i64>,
    /// The jobs' template.
    #[serde(default)]
    pub job_template: JobTemplate,
    /// Successful jobs kept (default 3).
    #[serde(default)]
    pub successful_jobs_history_limit: Option<i32>,
    /// Failed jobs kept (default 1).
    #[serde(default)]
    pub failed_jobs_history_limit: Option<i32>,
}

/// `spec.jobTemplate`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct JobTemplate {
    /// The jobs' spec.
    #[serde(default)]
    pub spec: ReclaimSpaceJobSpec,
}

/// `ReclaimSpaceCronJob.status` (the fields read).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReclaimSpaceCronJobStatus {
    /// The last run's time.
    #[serde(default)]
    pub last_schedule_time: Option<String>,
}

/// `csiaddons.openshift.io/v1alpha1` ReclaimSpaceCronJob.
#[derive(Debug, Clone, Deserialize)]
pub struct ReclaimSpaceCronJob {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The spec.
    #[serde(default)]
    pub spec: ReclaimSpaceCronJobSpec,
    /// The status.
    #[serde(default)]
    pub status: Option<ReclaimSpaceCronJobStatus>,
}

namespaced_resource!(
    ReclaimSpaceJob,
    group = CSIADDONS_GROUP,
    version = "v1alpha1",
    kind = "ReclaimSpaceJob",
    plural = "reclaimspacejobs"
);
namespaced_resource!(
    ReclaimSpaceCronJob,
    group = CSIADDONS_GROUP,
    version = "v1alpha1",
    kind = "ReclaimSpaceCronJob",
    plural = "reclaimspacecronjobs"
);

fn seconds_of(rfc3339: &str) -> Option<i64> {
    rfc3339
        .parse::<k8s_openapi::jiff::Timestamp>()
        .ok()
        .map(|t| t.as_second())
}

fn rfc3339_of(seconds: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_second(seconds)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

fn now_seconds() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_second()
}

/// What a job's or cron job's target claim is to this provisioner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimTarget {
    /// Bound to a PV of ours: its volume and the PV's Secret.
    Ours(VolumeId, SecretRef),
    /// Another driver's claim, or one not bound yet that is not handed to
    /// us: not ours to answer.
    Foreign,
    /// A claim of ours not bound yet (a failed attempt, retried).
    Pending(String),
    /// Bad input that no retry mends: no claim named, no such claim, a
    /// PV of ours it cannot act on.
    Bad(String),
}

/// What the claim `ns/name` is to this provisioner.
pub async fn claim_target(ctx: &Context, ns: &str, name: &str) -> Result<ClaimTarget, kube::Error> {
    if name.is_empty() {
        return Ok(ClaimTarget::Bad(
            "spec.target.persistentVolumeClaim names no claim".into(),
        ));
    }
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), ns);
    let Some(claim) = claims.get_opt(name).await? else {
        return Ok(ClaimTarget::Bad(format!(
            "PersistentVolumeClaim {ns}/{name} not found"
        )));
    };
    let Some(pv_name) = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|v| !v.is_empty())
    else {
        // Ours when handed to us, or when its class names us (a
        // WaitForFirstConsumer claim is handed over only once scheduled).
        let class = claim
            .spec
            .as_ref()
            .and_then(|s| s.storage_class_name.clone())
            .filter(|c| !c.is_empty());
        let ours = for_provisioner(&claim, &ctx.name)
            || match class {
                Some(c) => Api::<StorageClass>::all(ctx.client.clone())
                    .get_opt(&c)
                    .await?
                    .is_some_and(|c| c.provisioner == ctx.name),
                None => false,
            };
        return Ok(if ours {
            ClaimTarget::Pending(format!(
                "PersistentVolumeClaim {ns}/{name} is not bound yet"
            ))
        } else {
            ClaimTarget::Foreign
        });
    };
    let Some(pv) = Api::<PersistentVolume>::all(ctx.client.clone())
        .get_opt(&pv_name)
        .await?
    else {
        return Ok(if for_provisioner(&claim, &ctx.name) {
            ClaimTarget::Bad(format!(
                "PersistentVolumeClaim {ns}/{name} is bound to PersistentVolume {pv_name}, which does not exist"
            ))
        } else {
            ClaimTarget::Foreign
        });
    };
    Ok(match our_volume(&pv, &ctx.name) {
        None => ClaimTarget::Foreign,
        Some(Err(e)) => ClaimTarget::Bad(format!(
            "PersistentVolume {pv_name} of claim {ns}/{name}: {e}"
        )),
        Some(Ok(vol)) => match deletion_secret(&pv) {
            Some(secret) => ClaimTarget::Ours(vol, secret),
            None => ClaimTarget::Bad(format!(
                "PersistentVolume {pv_name} of claim {ns}/{name} names no Secret to reach its cluster with"
            )),
        },
    })
}

/// What one step of a job came to.
enum Step {
    /// Done: whether it worked, what was done, and the usage after.
    Done(bool, String, u64),
    /// Waiting for the node (or a sparsify to go on): what for.
    Pending(String),
}

fn job_key(job: &ReclaimSpaceJob) -> String {
    format!(
        "reclaimspacejob/{}/{}",
        job.namespace().unwrap_or_default(),
        job.name_any()
    )
}

/// When each job that failed an attempt may try again (by provisioner name
/// and [`job_key`]). A failed attempt writes the job's status, whose echo
/// would otherwise start the next attempt at once and spend
/// `backOffLimit` in a second: the backoff is kept here instead. Lost on
/// restart, which costs one early attempt.
static NEXT_TRY: std::sync::LazyLock<std::sync::Mutex<std::collections::HashMap<String, Instant>>> =
    std::sync::LazyLock::new(Default::default);

fn next_try_key(ctx: &Context, job: &ReclaimSpaceJob) -> String {
    format!("{}/{}", ctx.name, job_key(job))
}

/// How long the job waits before its next attempt, if it must.
fn backing_off(ctx: &Context, job: &ReclaimSpaceJob) -> Option<Duration> {
    let next = NEXT_TRY.lock().unwrap_or_else(|e| e.into_inner());
    next.get(&next_try_key(ctx, job))
        .and_then(|at| at.checked_duration_since(Instant::now()))
        .filter(|d| !d.is_zero())
}

fn set_next_try(ctx: &Context, job: &ReclaimSpaceJob, after: Option<Duration>) {
    let mut next = NEXT_TRY.lock().unwrap_or_else(|e| e.into_inner());
    let now = Instant::now();
    next.retain(|_, at| *at > now);
    let key = next_try_key(ctx, job);
    match after {
        Some(d) => {
            next.insert(key, now + d);
        }
        None => {
            next.remove(&key);
        }
    }
}

/// The job as the API server has it now, unless it is done or gone (the
/// cache may not have our own last status write yet: a job done just now
/// is not done again).
async fn fresh_job(
    ctx: &Context,
    job: &ReclaimSpaceJob,
) -> Result<Option<ReclaimSpaceJob>, kube::Error> {
    let fresh = Api::<ReclaimSpaceJob>::namespaced(
        ctx.client.clone(),
        &job.namespace().unwrap_or_default(),
    )
    .get_opt(&job.name_any())
    .await?;
    Ok(fresh.filter(|j| {
        j.metadata.deletion_timestamp.is_none()
            && j.status.as_ref().is_none_or(|s| s.result.is_empty())
    }))
}

/// Reconciles a ReclaimSpaceJob whose target is (or should be) one of our
/// volumes.
pub async fn reconcile_job(
    job: Arc<ReclaimSpaceJob>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let done = job.status.as_ref().is_some_and(|s| !s.result.is_empty());
    if done || job.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    if let Some(wait) = backing_off(&ctx, &job) {
        return Ok(Action::requeue(wait));
    }
    let ns = job.namespace().unwrap_or_default();
    let target = claim_target(&ctx, &ns, &job.spec.target.persistent_volume_claim).await?;
    if target == ClaimTarget::Foreign {
        return Ok(Action::await_change());
    }
    let Some(job) = fresh_job(&ctx, &job).await? else {
        return Ok(Action::await_change());
    };
    let status = job.status.clone().unwrap_or_default();
    let out = match target {
        ClaimTarget::Ours(vol, secret) => {
            ctx.limiter
                .scoped(job_step(&ctx, &job, &status, &vol, &secret))
                .await
        }
        ClaimTarget::Bad(why) => fail(&ctx, &job, &why, None).await,
        ClaimTarget::Pending(why) => retry(&ctx, &job, &status, why).await,
        ClaimTarget::Foreign => Ok(Action::await_change()),
    };
    if out.is_ok() {
        ctx.pv_failures.succeeded(&job_key(&job));
        set_next_try(&ctx, &job, None);
    }
    out
}

/// Requeues a failed job after its backoff.
pub fn job_error_policy(
    job: Arc<ReclaimSpaceJob>,
    err: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    let key = job_key(&job);
    // A failed attempt set its backoff already ([`retry`]).
    let delay = backing_off(&ctx, &job).unwrap_or_else(|| {
        let d = ctx.pv_failures.failed(&key);
        set_next_try(&ctx, &job, Some(d));
        d
    });
    tracing::warn!(job = %key, error = %err, retry_in = ?delay, "reclaim space job not done; will retry");
    Action::requeue(delay)
}

async fn patch_job_status(
    ctx: &Context,
    job: &ReclaimSpaceJob,
    status: serde_json::Value,
) -> Result<(), kube::Error> {
    before_work().await;
    Api::<ReclaimSpaceJob>::namespaced(ctx.client.clone(), &job.namespace().unwrap_or_default())
        .patch_status(
            &job.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": status })),
        )
        .await
        .map(drop)
}

/// Marks the job Failed with `why` (named in its status and a Warning
/// event); `retries` is the attempt count to record, if it changed.
async fn fail(
    ctx: &Context,
    job: &ReclaimSpaceJob,
    why: &str,
    retries: Option<i32>,
) -> Result<Action, ReconcileError> {
    let message = format!("ReclaimSpaceJob {}: {why}", job.name_any());
    tracing::warn!(job = %job_key(job), "{message}");
    ctx.events
        .warning(&job.object_ref(&()), "ReclaimSpaceFailed", &message)
        .await;
    let mut status = json!({"result": "Failed", "message": clip(&message),
        "completionTime": now_rfc3339()});
    if let Some(r) = retries {
        status["retries"] = json!(r);
    }
    patch_job_status(ctx, job, status).await?;
    Ok(Action::await_change())
}

/// Counts a failed attempt: Failed past `backOffLimit`, else retried after
/// the backoff.
async fn retry(
    ctx: &Context,
    job: &ReclaimSpaceJob,
    status: &ReclaimSpaceJobStatus,
    why: String,
) -> Result<Action, ReconcileError> {
    let back_off = job
        .spec
        .back_off_limit
        .unwrap_or(DEFAULT_BACK_OFF_LIMIT)
        .max(0);
    let retries = status.retries.saturating_add(1);
    if retries > back_off {
        let why = format!("{why} (failed {retries} times; backOffLimit is {back_off})");
        return fail(ctx, job, &why, Some(retries)).await;
    }
    // The backoff before the status write, whose echo comes back at once.
    let delay = ctx.pv_failures.failed(&job_key(job));
    set_next_try(ctx, job, Some(delay));
    patch_job_status(ctx, job, json!({"retries": retries, "message": clip(&why)})).await?;
    Err(ReconcileError(why))
}

async fn job_step(
    ctx: &Context,
    job: &ReclaimSpaceJob,
    status: &ReclaimSpaceJobStatus,
    vol: &VolumeId,
    secret: &SecretRef,
) -> Result<Action, ReconcileError> {
    let name = job.name_any();
    let now = now_seconds();
    let started = match status.start_time.as_deref().and_then(seconds_of) {
        Some(s) => s,
        None => {
            patch_job_status(ctx, job, json!({"startTime": now_rfc3339()})).await?;
            now
        }
    };
    let deadline = job
        .spec
        .retry_deadline_seconds
        .unwrap_or(DEFAULT_RETRY_DEADLINE)
        .max(0);
    if now - started > deadline {
        let last = if status.message.is_empty() {
            String::new()
        } else {
            format!(" (last: {})", status.message)
        };
        let why = format!("not done within retryDeadlineSeconds ({deadline} s) of its start{last}");
        return fail(ctx, job, &why, None).await;
    }
    let conn = match ctx.connect(&vol.cluster_id, secret).await {
        Ok(c) => c,
        Err(e) => return retry(ctx, job, status, e).await,
    };
    // The usage before, kept before anyone is asked.
    let before = match job
        .annotations()
        .get(USED_BEFORE_ANNOTATION)
        .and_then(|v| v.parse::<u64>().ok())
    {
        Some(b) => b,
        None => {
            let v = vol.clone();
            let used = ctx
                .ceph(&conn, move |c, _m, _f| {
                    let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
                    Ok(Image::open_read_only(&io, &v.image)?.allocated_bytes()?)
                })
                .await;
            let used = match used {
                Ok(u) => u,
                Err(e) => return retry(ctx, job, status, e.to_string()).await,
            };
            before_work().await;
            Api::<ReclaimSpaceJob>::namespaced(
                ctx.client.clone(),
                &job.namespace().unwrap_or_default(),
            )
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(
                    &json!({"metadata": {"annotations": {USED_BEFORE_ANNOTATION: used.to_string()}}}),
                ),
            )
            .await?;
            used
        }
    };
    // A new request id per attempt: a retry after a failed answer asks
    // the node again.
    let id = format!(
        "{}.{}",
        job.metadata.uid.clone().unwrap_or_else(|| name.clone()),
        status.retries
    );
    let v = vol.clone();
    let sparsify_until = Instant::now() + ctx.conns.op_timeout();
    let step = ctx
        .ceph(&conn, move |c, _m, f| -> Result<Step, VolumeError> {
            let lock = ImageLock::open(c, &v.pool, &v.rados_namespace, &v.image)?;
            let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
            let usage = || Image::open_read_only(&io, &v.image)?.allocated_bytes();
            let (nodes, _) = lock.staged_on()?;
            if let Some(node) = nodes.first() {
                return Ok(match lock.reclaim_done(node)? {
                    Some(d) if d.id == id => {
                        Step::Done(d.ok, format!("node {node}: {}", d.message), usage()?)
                    }
                    _ => {
                        if lock.reclaim_request(node)?.as_deref() != Some(id.as_str()) {
                            lock.request_reclaim(node, &id)?;
                        }
                        Step::Pending(format!(
                            "waiting for node {node}, where the volume is staged, to trim it"
                        ))
                    }
                });
            }
            let in_use = lock.watchers()?.len();
            let locked = Image::open_read_only(&io, &v.image)?
                .features()?
                .contains(Features::EXCLUSIVE_LOCK);
            if in_use > 0 && !locked {
                return Ok(Step::Done(
                    true,
                    format!(
                        "staged on no node, but open by {in_use} clients and without the \
                         exclusive-lock feature: not sparsified"
                    ),
                    usage()?,
                ));
            }
            f.check("rbd_sparsify", &v.to_string())?;
            let img = Image::open(&io, &v.image)?;
            match img.sparsify_with_deadline(SPARSE_SIZE, sparsify_until) {
                Ok(()) => {}
                Err(e) if e.kind() == crate::ErrorKind::TimedOut => {
                    return Ok(Step::Pending(
                        "staged on no node: sparsifying (goes on)".into(),
                    ))
                }
                Err(e) => return Err(e.into()),
            }
            drop(img);
            Ok(Step::Done(
                true,
                "staged on no node: sparsified (runs of zeroes of 64 KiB and more deallocated)"
                    .into(),
                usage()?,
            ))
        })
        .await;
    match step {
        Ok(Step::Pending(why)) => {
            tracing::debug!(job = %job_key(job), "{why}");
            if status.message != why {
                patch_job_status(ctx, job, json!({"message": why})).await?;
            }
            Ok(Action::requeue(POLL))
        }
        Ok(Step::Done(true, message, after)) => {
            let reclaimed = before.saturating_sub(after);
            let message = format!(
                "{message}; the image had {before} bytes allocated before, {after} after: \
                 {reclaimed} bytes returned to the pool"
            );
            tracing::info!(job = %job_key(job), volume = %vol, reclaimed, "{message}");
            ctx.events
                .normal(&job.object_ref(&()), "ReclaimSpaceSucceeded", &message)
                .await;
            patch_job_status(
                ctx,
                job,
                json!({"result": "Succeeded", "message": clip(&message),
                       "reclaimedSpace": bytes_quantity(reclaimed),
                       "completionTime": now_rfc3339()}),
            )
            .await?;
            Ok(Action::await_change())
        }
        Ok(Step::Done(false, message, _)) => retry(ctx, job, status, message).await,
        Err(e) => retry(ctx, job, status, e.to_string()).await,
    }
}

fn cronjob_key(cj: &ReclaimSpaceCronJob) -> String {
    format!(
        "reclaimspacecronjob/{}/{}",
        cj.namespace().unwrap_or_default(),
        cj.name_any()
    )
}

/// The run due now, if any: the latest time of `schedule` after `last` and
/// at or before `now` (runs missed meanwhile are that one run).
pub fn due_run(schedule: &Schedule, last: i64, now: i64) -> Option<i64> {
    schedule.next_after(last).filter(|d| *d <= now)?;
    // The smallest window back from now that holds a run (a window that
    // reaches `last` does), then the last run in it.
    let mut window: i64 = 60;
    loop {
        let start = now.saturating_sub(window).max(last);
        if let Some(mut due) = schedule.next_after(start).filter(|d| *d <= now) {
            while let Some(n) = schedule.next_after(due).filter(|n| *n <= now) {
                due = n;
            }
            return Some(due);
        }
        window = window.saturating_mul(2);
    }
}

/// Reconciles a ReclaimSpaceCronJob whose target is one of our volumes.
pub async fn reconcile_cronjob(
    cj: Arc<ReclaimSpaceCronJob>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    if cj.metadata.deletion_timestamp.is_some() || cj.spec.suspend == Some(true) {
        return Ok(Action::await_change());
    }
    let ns = cj.namespace().unwrap_or_default();
    let name = cj.name_any();
    let target = &cj.spec.job_template.spec.target.persistent_volume_claim;
    match claim_target(&ctx, &ns, target).await? {
        ClaimTarget::Ours(..) => {}
        ClaimTarget::Foreign => return Ok(Action::await_change()),
        ClaimTarget::Pending(_) => return Ok(Action::requeue(Duration::from_secs(60))),
        ClaimTarget::Bad(why) => {
            let why = format!("ReclaimSpaceCronJob {ns}/{name}: {why}; no job is made");
            ctx.events
                .warning(&cj.object_ref(&()), "ReclaimSpaceCronJobFailed", &why)
                .await;
            return Ok(Action::await_change());
        }
    }
    let schedule = match Schedule::parse(&cj.spec.schedule) {
        Ok(s) => s,
        Err(why) => {
            let why = format!("ReclaimSpaceCronJob {ns}/{name}: schedule {why}; no job is made");
            tracing::warn!(cronjob = %cronjob_key(&cj), "{why}");
            ctx.events
                .warning(&cj.object_ref(&()), "InvalidSchedule", &why)
                .await;
            return Ok(Action::await_change());
        }
    };
    let now = now_seconds();
    let last = cj
        .status
        .as_ref()
        .and_then(|s| s.last_schedule_time.as_deref())
        .and_then(seconds_of)
        .or_else(|| {
            cj.metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.as_second())
        })
        .unwrap_or(now);
    let next_wait = |after: i64| {
        let next = schedule.next_after(after).unwrap_or(now + 3600);
        Action::requeue(Duration::from_secs((next - now).clamp(1, 3600) as u64))
    };
    let Some(due) = due_run(&schedule, last, now) else {
        return Ok(next_wait(now));
    };
    let late = cj
        .spec
        .starting_deadline_seconds
        .is_some_and(|d| now - due > d.max(0));
    ctx.limiter
        .scoped(run_cronjob(&ctx, &cj, due, late))
        .await
        .map_err(ReconcileError::from)?;
    ctx.pv_failures.succeeded(&cronjob_key(&cj));
    Ok(next_wait(now))
}

async fn run_cronjob(
    ctx: &Context,
    cj: &ReclaimSpaceCronJob,
    due: i64,
    late: bool,
) -> Result<(), kube::Error> {
    let ns = cj.namespace().unwrap_or_default();
    let name = cj.name_any();
    let jobs: Api<ReclaimSpaceJob> = Api::namespaced(ctx.client.clone(), &ns);
    let mine = jobs
        .list(&ListParams::default().labels(&format!("{CRONJOB_LABEL}={name}")))
        .await?
        .items;
    if late {
        tracing::info!(cronjob = %cronjob_key(cj), due = %rfc3339_of(due), "a run is skipped: later than startingDeadlineSeconds");
        return set_last(ctx, cj, due, &mine).await;
    }
    let job_name = format!("{name}-{due}");
    let running: Vec<&ReclaimSpaceJob> = mine
        .iter()
        .filter(|j| j.name_any() != job_name)
        .filter(|j| j.status.as_ref().is_none_or(|s| s.result.is_empty()))
        .collect();
    if !running.is_empty() {
        if cj.spec.concurrency_policy.as_deref() != Some("Replace") {
            tracing::info!(cronjob = %cronjob_key(cj), "a run is skipped: the last job has not finished (concurrencyPolicy Forbid)");
            return set_last(ctx, cj, due, &mine).await;
        }
        for j in running {
            before_work().await;
            match jobs.delete(&j.name_any(), &DeleteParams::default()).await {
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
                Ok(_) => {}
            }
        }
    }
    let owner = cj.controller_owner_ref(&());
    let job = json!({
        "apiVersion": format!("{CSIADDONS_GROUP}/v1alpha1"),
        "kind": "ReclaimSpaceJob",
        "metadata": {
            "name": job_name,
            "namespace": ns,
            "labels": {CRONJOB_LABEL: name},
            "ownerReferences": owner.into_iter().collect::<Vec<_>>(),
        },
        "spec": cj.spec.job_template.spec,
    });
    let api: Api<DynamicObject> = Api::namespaced_with(
        ctx.client.clone(),
        &ns,
        &ApiResource::erase::<ReclaimSpaceJob>(&()),
    );
    let obj: DynamicObject = serde_json::from_value(job).map_err(kube::Error::SerdeError)?;
    before_work().await;
    match api.create(&PostParams::default(), &obj).await {
        Ok(_) => {
            tracing::info!(cronjob = %cronjob_key(cj), job = %job_name, "reclaim space job created")
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e),
    }
    set_last(ctx, cj, due, &mine).await?;
    prune(cj, &jobs, mine).await
}

/// Records the run at `due`, and the last job that succeeded.
async fn set_last(
    ctx: &Context,
    cj: &ReclaimSpaceCronJob,
    due: i64,
    mine: &[ReclaimSpaceJob],
) -> Result<(), kube::Error> {
    let last_ok = mine
        .iter()
        .filter_map(|j| j.status.as_ref())
        .filter(|s| s.result == "Succeeded")
        .filter_map(|s| s.completion_time.clone())
        .max_by_key(|t| seconds_of(t));
    let mut status = json!({"lastScheduleTime": rfc3339_of(due)});
    if let Some(t) = last_ok {
        status["lastSuccessfulTime"] = json!(t);
    }
    before_work().await;
    Api::<ReclaimSpaceCronJob>::namespaced(ctx.client.clone(), &cj.namespace().unwrap_or_default())
        .patch_status(
            &cj.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": status })),
        )
        .await
        .map(drop)
}

/// Deletes finished jobs past the history limits, oldest first.
async fn prune(
    cj: &ReclaimSpaceCronJob,
    jobs: &Api<ReclaimSpaceJob>,
    mut mine: Vec<ReclaimSpaceJob>,
) -> Result<(), kube::Error> {
    mine.sort_by_key(|j| {
        j.metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second())
    });
    for (result, keep) in [
        (
            "Succeeded",
            cj.spec.successful_jobs_history_limit.unwrap_or(3),
        ),
        ("Failed", cj.spec.failed_jobs_history_limit.unwrap_or(1)),
    ] {
        let done: Vec<&ReclaimSpaceJob> = mine
            .iter()
            .filter(|j| j.status.as_ref().is_some_and(|s| s.result == result))
            .collect();
        let extra = done
            .len()
            .saturating_sub(usize::try_from(keep.max(0)).unwrap_or(0));
        for j in done.into_iter().take(extra) {
            before_work().await;
            match jobs.delete(&j.name_any(), &DeleteParams::default()).await {
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
                Ok(_) => {}
            }
        }
    }
    Ok(())
}

/// Requeues a failed cron job after its backoff.
pub fn cronjob_error_policy(
    cj: Arc<ReclaimSpaceCronJob>,
    err: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    let key = cronjob_key(&cj);
    let delay = ctx.pv_failures.failed(&key);
    tracing::warn!(cronjob = %key, error = %err, retry_in = ?delay, "reclaim space cron job not done; will retry");
    Action::requeue(delay)
}

/// The schedule a claim's annotation asks for: `None` without the
/// annotation, `Some(Err)` naming what is wrong with one that does not
/// parse.
pub fn claim_schedule(claim: &PersistentVolumeClaim) -> Option<Result<String, String>> {
    let s = claim.annotations().get(SCHEDULE_ANNOTATION)?;
    Some(Schedule::parse(s).map(|_| s.trim().to_owned()))
}

/// Makes the claim's ReclaimSpaceCronJob match its schedule annotation:
/// creates it (then records its name on the claim), updates its schedule,
/// or deletes it once the annotation is gone (then the record). A schedule
/// that does not parse is reported in a Warning event on the claim and
/// changes nothing. Does nothing for a claim with neither annotation, so it
/// costs no API call for most claims, nor while the CRD is not installed.
pub async fn sync_claim_schedule(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
) -> Result<(), kube::Error> {
    let schedule = claim_schedule(claim);
    let recorded = claim.annotations().get(CRONJOB_ANNOTATION).cloned();
    if schedule.is_none() && recorded.is_none() {
        return Ok(());
    }
    let ns = claim.namespace().unwrap_or_default();
    let claim_name = claim.name_any();
    let schedule = match schedule {
        Some(Err(why)) => {
            let why = format!(
                "PersistentVolumeClaim {ns}/{claim_name}: annotation {SCHEDULE_ANNOTATION}: {why}; \
                 its reclaim space schedule is left as it was"
            );
            tracing::warn!(claim = %format!("{ns}/{claim_name}"), "{why}");
            ctx.events
                .warning(&claim.object_ref(&()), "InvalidReclaimSpaceSchedule", &why)
                .await;
            return Ok(());
        }
        Some(Ok(s)) => Some(s),
        None => None,
    };
    let name = format!("{claim_name}-reclaimspace");
    let api: Api<DynamicObject> = Api::namespaced_with(
        ctx.client.clone(),
        &ns,
        &ApiResource::erase::<ReclaimSpaceCronJob>(&()),
    );
    let existing = match api.get_opt(&name).await {
        Ok(e) => e,
        // No CRD: nothing to sync.
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
        Err(e) => return Err(e),
    };
    let managed = existing
        .as_ref()
        .is_some_and(|o| o.labels().get(MANAGED_LABEL) == Some(&claim_name));
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let record = |value: Option<&str>| {
        let patch = json!({"metadata": {"annotations": {CRONJOB_ANNOTATION: value}}});
        let claims = claims.clone();
        let claim_name = claim_name.clone();
        async move {
            before_work().await;
            claims
                .patch(&claim_name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(drop)
        }
    };
    let Some(schedule) = schedule else {
        if managed {
            before_work().await;
            match api.delete(&name, &DeleteParams::default()).await {
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
                Ok(_) => {
                    tracing::info!(claim = %format!("{ns}/{claim_name}"), cronjob = %name, "reclaim space schedule removed")
                }
            }
        }
        return record(None).await;
    };
    match existing {
        Some(o) if managed => {
            if o.data["spec"]["schedule"].as_str() != Some(schedule.as_str()) {
                before_work().await;
                api.patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"spec": {"schedule": schedule}})),
                )
                .await?;
                tracing::info!(claim = %format!("{ns}/{claim_name}"), cronjob = %name, %schedule, "reclaim space schedule changed");
            }
        }
        Some(_) => {
            // A cron job of that name that is not the claim's: left alone.
            let why = format!(
                "PersistentVolumeClaim {ns}/{claim_name}: a ReclaimSpaceCronJob {name} not made for \
                 its {SCHEDULE_ANNOTATION} annotation exists; it is left alone and no schedule is set"
            );
            ctx.events
                .warning(&claim.object_ref(&()), "InvalidReclaimSpaceSchedule", &why)
                .await;
            return Ok(());
        }
        None => {
            let owner = claim.controller_owner_ref(&()).map(|mut o| {
                o.controller = Some(false);
                o
            });
            let cj = json!({
                "apiVersion": format!("{CSIADDONS_GROUP}/v1alpha1"),
                "kind": "ReclaimSpaceCronJob",
                "metadata": {
                    "name": name,
                    "namespace": ns,
                    "labels": {MANAGED_LABEL: claim_name},
                    "ownerReferences": owner.into_iter().collect::<Vec<_>>(),
                },
                "spec": {
                    "schedule": schedule,
                    "concurrencyPolicy": "Forbid",
                    "jobTemplate": {"spec": {
                        "target": {"persistentVolumeClaim": claim_name},
                        "backOffLimit": DEFAULT_BACK_OFF_LIMIT,
                        "retryDeadlineSeconds": DEFAULT_RETRY_DEADLINE,
                    }},
                    "successfulJobsHistoryLimit": 3,
                    "failedJobsHistoryLimit": 1,
                },
            });
            let obj: DynamicObject = serde_json::from_value(cj).map_err(kube::Error::SerdeError)?;
            before_work().await;
            match api.create(&PostParams::default(), &obj).await {
                Ok(_) => {
                    tracing::info!(claim = %format!("{ns}/{claim_name}"), cronjob = %name, %schedule, "reclaim space schedule set")
                }
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e),
            }
        }
    }
    if recorded.as_deref() != Some(name.as_str()) {
        record(Some(&name)).await?;
    }
    Ok(())
}

/// Runs the ReclaimSpaceJob and ReclaimSpaceCronJob controllers until
/// `shutdown` resolves, each once its CRD is installed; with `enabled`
/// false (`--reclaim-space=false`) only waits.
pub async fn run(
    ctx: Arc<Context>,
    config: Config,
    enabled: bool,
    shutdown: impl std::future::Future<Output = ()> + Clone + Send + Sync + 'static,
) {
    let jobs = crd::run::<ReclaimSpaceJob, _, _, _>(
        "ReclaimSpaceJob",
        Arc::clone(&ctx),
        config.clone(),
        enabled,
        shutdown.clone(),
        reconcile_job,
        job_error_policy,
    );
    let crons = crd::run::<ReclaimSpaceCronJob, _, _, _>(
        "ReclaimSpaceCronJob",
        ctx,
        config,
        enabled,
        shutdown,
        reconcile_cronjob,
        cronjob_error_policy,
    );
    futures::join!(jobs, crons);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_due_run_is_the_latest_one_come() {
        let s = Schedule::parse("*/5 * * * *").unwrap();
        // A multiple of 300 and 3600.
        let t0 = 1_800_000_000;
        assert_eq!(due_run(&s, t0, t0 + 299), None, "not due yet");
        assert_eq!(due_run(&s, t0, t0 + 300), Some(t0 + 300));
        // Days missed: one run, the latest.
        assert_eq!(due_run(&s, t0, t0 + 3 * 86400 + 17), Some(t0 + 3 * 86400));
        let h = Schedule::parse("@hourly").unwrap();
        assert_eq!(
            due_run(&h, t0, t0 + 400 * 86400 + 3599),
            Some(t0 + 400 * 86400)
        );
    }

    #[test]
    fn claim_schedules_are_read_or_refused_by_name() {
        let claim = |a: Option<&str>| {
            let mut c = PersistentVolumeClaim::default();
            if let Some(a) = a {
                c.metadata.annotations =
                    Some([(SCHEDULE_ANNOTATION.to_owned(), a.to_owned())].into());
            }
            c
        };
        assert_eq!(claim_schedule(&claim(None)), None);
        assert_eq!(
            claim_schedule(&claim(Some(" @daily "))),
            Some(Ok("@daily".to_owned()))
        );
        let e = claim_schedule(&claim(Some("every day")))
            .unwrap()
            .unwrap_err();
        assert!(e.contains("\"every day\""), "{e}");
    }

    #[test]
    fn jobs_are_read_as_csi_addons_writes_them() {
        let j: ReclaimSpaceJob = serde_json::from_value(json!({
            "metadata": {"name": "j"},
            "spec": {"target": {"persistentVolumeClaim": "data"}, "backOffLimit": 2},
            "status": {"result": "", "retries": 1, "reclaimedSpace": "1Mi"},
        }))
        .unwrap();
        assert_eq!(j.spec.target.persistent_volume_claim, "data");
        assert_eq!(j.spec.back_off_limit, Some(2));
        assert_eq!(j.status.unwrap().retries, 1);
        let cj: ReclaimSpaceCronJob = serde_json::from_value(json!({
            "metadata": {"name": "c"},
            "spec": {"schedule": "@weekly", "concurrencyPolicy": "Replace",
                "jobTemplate": {"spec": {"target": {"persistentVolumeClaim": "data"}}}},
        }))
        .unwrap();
        assert_eq!(cj.spec.concurrency_policy.as_deref(), Some("Replace"));
        assert_eq!(
            cj.spec.job_template.spec.target.persistent_volume_claim,
            "data"
        );
        // The template is written back as csi-addons reads it.
        let back = serde_json::to_value(&cj.spec.job_template.spec).unwrap();
        assert_eq!(back, json!({"target": {"persistentVolumeClaim": "data"}}));
    }
}
