//! csi-addons EncryptionKeyRotationJobs, reconciled by the provisioner
//! itself (no csi-addons controller or sidecar, as for
//! [`crate::provisioner::network_fence`] and
//! [`crate::provisioner::replication`]).
//!
//! An EncryptionKeyRotationJob (`csiaddons.openshift.io/v1alpha1`,
//! namespaced) names a claim of its namespace
//! (`spec.target.persistentVolumeClaim`). For a claim bound to an
//! encrypted volume of this provisioner whose KMS keeps a passphrase per
//! volume (`metadata`, or a Vault kind), the provisioner gives the volume
//! a new passphrase: a new LUKS2 keyslot, the KMS updated, the old
//! keyslots removed ([`crate::volume::encryption::rotate_volume`]); the
//! volume key and the data stay, so a volume staged on a node (rbdkit-fuse
//! and dm-crypt hold the volume key, not the passphrase) keeps working and
//! no node step is needed. The credentials are the PV's provisioner
//! (deletion) Secret, which also holds the `metadata` KMS's
//! `encryptionPassphrase` and a Vault KMS's Secret keys.
//!
//! The status is csi-addons': `startTime` at the first attempt, `retries`
//! counted on each further one, a `Failed` condition (reason `failed`)
//! carrying the last error, then `result` `Succeeded` or `Failed` with
//! `message` and `completionTime`. A job with a result is done and never
//! looked at again. Transient failures (a claim not bound yet, Ceph or
//! Vault unreachable) are retried with backoff until `backOffLimit`
//! retries ("Maximum retry limit reached") or `retryDeadlineSeconds` after
//! the job's creation ("Time limit reached"); 0 for either means its
//! default (6, 600 s), as in csi-addons. What no retry can change (the
//! claim missing, not encrypted, its
//! header not written yet, or a KMS that gives every volume the Secret's
//! passphrase, the `default` kind) is `Failed` at once with a message and
//! a Warning event naming it, and nothing is changed. `spec.timeout`
//! (csi-addons' gRPC timeout) is not used: each Ceph and Vault call has
//! its own bound.
//!
//! A job whose claim is bound to another driver's volume is left alone (no
//! status, no event): the jobs carry no driver, and csi-addons' own
//! controller may serve that driver in the same cluster.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Config};
use kube::{Resource, ResourceExt};
use serde::Deserialize;
use serde_json::json;

use crate::provisioner::controller::{Context, ReconcileError};
use crate::provisioner::crd::{self, namespaced_resource, now_rfc3339};
use crate::provisioner::network_fence::CSIADDONS_GROUP;
use crate::volume::encryption;
use crate::volume::ops::VolumeError;
use crate::volume::VolumeId;

/// csi-addons' default `backOffLimit`.
pub const DEFAULT_BACKOFF_LIMIT: i32 = 6;
/// csi-addons' default `retryDeadlineSeconds`.
pub const DEFAULT_RETRY_DEADLINE_SECONDS: i64 = 600;
/// csi-addons' `result` of a job that rotated.
pub const SUCCEEDED: &str = "Succeeded";
/// csi-addons' `result` of a job that gave up.
pub const FAILED: &str = "Failed";
/// csi-addons' `message` of a job that rotated.
pub const SUCCESS_MESSAGE: &str = "Key rotation operation successfully completed.";

/// `EncryptionKeyRotationJob.spec.target`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RotationTarget {
    /// The claim, in the job's namespace.
    #[serde(default)]
    pub persistent_volume_claim: String,
}

/// `EncryptionKeyRotationJob.spec`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EncryptionKeyRotationJobSpec {
    /// The claim whose volume gets a new passphrase.
    #[serde(default)]
    pub target: RotationTarget,
    /// Retries before the job fails (0: [`DEFAULT_BACKOFF_LIMIT`]).
    #[serde(default)]
    pub back_off_limit: i32,
    /// Seconds after the job's creation that it may still be retried (0:
    /// [`DEFAULT_RETRY_DEADLINE_SECONDS`]).
    #[serde(default)]
    pub retry_deadline_seconds: i64,
    /// csi-addons' gRPC timeout (not used).
    #[serde(default)]
    pub timeout: Option<i64>,
}

/// `EncryptionKeyRotationJob.status`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EncryptionKeyRotationJobStatus {
    /// [`SUCCEEDED`] or [`FAILED`] once done.
    #[serde(default)]
    pub result: Option<String>,
    /// What happened.
    #[serde(default)]
    pub message: Option<String>,
    /// The conditions (a `Failed` one after a failed attempt).
    #[serde(default)]
    pub conditions: Option<Vec<serde_json::Value>>,
    /// Attempts after the first.
    #[serde(default)]
    pub retries: Option<i32>,
    /// When the first attempt started.
    #[serde(default)]
    pub start_time: Option<String>,
    /// When the job was done.
    #[serde(default)]
    pub completion_time: Option<String>,
}

/// A `csiaddons.openshift.io/v1alpha1` EncryptionKeyRotationJob.
#[derive(Debug, Clone, Deserialize)]
pub struct EncryptionKeyRotationJob {
    /// Standard object metadata.
    pub metadata: ObjectMeta,
    /// The spec.
    #[serde(default)]
    pub spec: EncryptionKeyRotationJobSpec,
    /// The status.
    #[serde(default)]
    pub status: Option<EncryptionKeyRotationJobStatus>,
}

namespaced_resource!(
    EncryptionKeyRotationJob,
    group = CSIADDONS_GROUP,
    version = "v1alpha1",
    kind = "EncryptionKeyRotationJob",
    plural = "encryptionkeyrotationjobs"
);

/// Why an attempt failed.
#[derive(Debug)]
enum Failure {
    /// No retry can help: the job fails at once.
    Refused(String),
    /// A retry may.
    Transient(String),
    /// Another driver's volume: not ours to touch or to fail.
    NotOurs(String),
}

/// The status a reconcile writes, csi-addons' fields.
struct Status {
    start_time: String,
    retries: i32,
    conditions: Vec<serde_json::Value>,
    result: Option<&'static str>,
    message: Option<String>,
}

impl Status {
    /// The status of `job` at the start of an attempt: `startTime` set by
    /// the first, `retries` counted by each further one.
    fn attempt(job: &EncryptionKeyRotationJob) -> Status {
        let old = job.status.clone().unwrap_or_default();
        let (start_time, retries) = match old.start_time {
            Some(t) => (t, old.retries.unwrap_or(0) + 1),
            None => (now_rfc3339(), 0),
        };
        Status {
            start_time,
            retries,
            conditions: old.conditions.unwrap_or_default(),
            result: None,
            message: None,
        }
    }

    /// csi-addons' setFailedCondition: one `Failed` condition, replaced.
    fn failed_condition(&mut self, message: &str, generation: i64) {
        let c = json!({
            "type": "Failed",
            "status": "True",
            "reason": "failed",
            "message": crate::k8s::events::clip(message),
            "observedGeneration": generation,
            "lastTransitionTime": now_rfc3339(),
        });
        match self.conditions.iter_mut().find(|c| c["type"] == "Failed") {
            Some(old) => *old = c,
            None => self.conditions.push(c),
        }
    }

    fn done(&mut self, result: &'static str, message: &str) {
        self.result = Some(result);
        self.message = Some(crate::k8s::events::clip(message));
    }

    fn to_json(&self) -> serde_json::Value {
        let mut s = serde_json::Map::new();
        s.insert("startTime".into(), json!(self.start_time));
        if self.retries > 0 {
            s.insert("retries".into(), json!(self.retries));
        }
        s.insert("conditions".into(), json!(self.conditions));
        if let Some(r) = self.result {
            s.insert("result".into(), json!(r));
            s.insert("completionTime".into(), json!(now_rfc3339()));
        }
        if let Some(m) = &self.message {
            s.insert("message".into(), json!(m));
        }
        json!({ "status": s })
    }
}

/// `backOffLimit` and `retryDeadlineSeconds` with csi-addons' defaults.
fn limits(spec: &EncryptionKeyRotationJobSpec) -> (i32, i64) {
    let backoff = match spec.back_off_limit {
        0 => DEFAULT_BACKOFF_LIMIT,
        n => n,
    };
    let deadline = match spec.retry_deadline_seconds {
        0 => DEFAULT_RETRY_DEADLINE_SECONDS,
        n => n,
    };
    (backoff, deadline)
}

/// Whether `job` is past its retry deadline (creation + `deadline` s).
fn past_deadline(job: &EncryptionKeyRotationJob, deadline: i64) -> bool {
    job.metadata.creation_timestamp.as_ref().is_some_and(|t| {
        k8s_openapi::jiff::Timestamp::now().as_second() - t.0.as_second() > deadline
    })
}

fn key(job: &EncryptionKeyRotationJob) -> String {
    format!(
        "encryptionkeyrotationjob/{}/{}",
        job.namespace().unwrap_or_default(),
        job.name_any()
    )
}

/// Reconciles one EncryptionKeyRotationJob.
pub async fn reconcile(
    job: Arc<EncryptionKeyRotationJob>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let ns = job.namespace().unwrap_or_default();
    let name = job.name_any();
    let api: Api<EncryptionKeyRotationJob> = Api::namespaced(ctx.client.clone(), &ns);
    // The latest status (retries, start time), not the cache's: status
    // writes do not wake this controller.
    let Some(job) = api.get_opt(&name).await? else {
        return Ok(Action::await_change());
    };
    let done = job
        .status
        .as_ref()
        .and_then(|s| s.result.as_deref())
        .is_some_and(|r| !r.is_empty());
    if job.metadata.deletion_timestamp.is_some() || done {
        return Ok(Action::await_change());
    }
    let generation = job.metadata.generation.unwrap_or(0);
    let regarding = job.object_ref(&());
    let mut st = Status::attempt(&job);
    let (backoff, deadline) = limits(&job.spec);
    let claim = job.spec.target.persistent_volume_claim.clone();
    let outcome = if claim.is_empty() {
        Err(Failure::Refused(
            "failed to validate encryptionkeyrotationjob spec: required parameter \
             'PersistentVolumeClaim' is missing"
                .to_owned(),
        ))
    } else if past_deadline(&job, deadline) {
        st.done(FAILED, "Time limit reached");
        Ok(None)
    } else {
        ctx.limiter
            .scoped(rotate_claim(&ctx, &ns, &claim))
            .await
            .map(Some)
    };
    let retry = match outcome {
        Err(Failure::NotOurs(why)) => {
            tracing::debug!(job = %key(&job), why, "not this provisioner's; left alone");
            return Ok(Action::await_change());
        }
        Ok(None) => {
            ctx.events
                .warning(
                    &regarding,
                    "KeyRotationFailed",
                    &format!(
                        "EncryptionKeyRotationJob {ns}/{name}: time limit reached \
                         ({deadline} s after its creation)"
                    ),
                )
                .await;
            None
        }
        Ok(Some(vol)) => {
            st.done(SUCCEEDED, SUCCESS_MESSAGE);
            tracing::info!(job = %key(&job), volume = %vol, "encryption key rotated");
            ctx.events
                .normal(
                    &regarding,
                    "KeyRotated",
                    &format!(
                        "Volume {vol} of PersistentVolumeClaim {ns}/{claim} has a new passphrase"
                    ),
                )
                .await;
            None
        }
        Err(Failure::Refused(why)) => {
            st.failed_condition(&why, generation);
            st.done(FAILED, &why);
            ctx.events
                .warning(&regarding, "KeyRotationFailed", &why)
                .await;
            None
        }
        Err(Failure::Transient(why)) => {
            st.failed_condition(&why, generation);
            if st.retries >= backoff {
                st.done(FAILED, &format!("Maximum retry limit reached: {why}"));
                ctx.events
                    .warning(
                        &regarding,
                        "KeyRotationFailed",
                        &format!("{why} (no retry left of {backoff})"),
                    )
                    .await;
                None
            } else {
                Some(why)
            }
        }
    };
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&st.to_json()))
        .await?;
    match retry {
        Some(why) => Err(ReconcileError(why)),
        None => {
            ctx.pv_failures.succeeded(&key(&job));
            Ok(Action::await_change())
        }
    }
}

/// Rotates the passphrase of the volume of claim `ns`/`claim`; its volume
/// handle.
async fn rotate_claim(ctx: &Context, ns: &str, claim: &str) -> Result<String, Failure> {
    use Failure::{NotOurs, Refused, Transient};
    let what = format!("PersistentVolumeClaim {ns}/{claim}");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), ns);
    let pvc = claims
        .get_opt(claim)
        .await
        .map_err(|e| Transient(format!("cannot read {what}: {e}")))?
        .ok_or_else(|| Refused(format!("{what} not found")))?;
    let pv_name = pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|_| pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
        .ok_or_else(|| Transient(format!("{what} is not bound to any PersistentVolume yet")))?;
    let pv = Api::<PersistentVolume>::all(ctx.client.clone())
        .get_opt(&pv_name)
        .await
        .map_err(|e| Transient(format!("cannot read PersistentVolume {pv_name}: {e}")))?
        .ok_or_else(|| Transient(format!("PersistentVolume {pv_name} of {what} not found")))?;
    let vol: VolumeId = crate::volume::pv::our_volume(&pv, &ctx.name)
        .ok_or_else(|| {
            NotOurs(format!(
                "{what} is bound to PersistentVolume {pv_name}, which is not a volume of \
                 provisioner {:?}: its driver rotates its keys",
                ctx.name
            ))
        })?
        .map_err(|why| Refused(format!("PersistentVolume {pv_name} of {what}: {why}")))?;
    let secret = crate::volume::pv::deletion_secret(&pv).ok_or_else(|| {
        Refused(format!(
            "PersistentVolume {pv_name} of {what} records no provisioner Secret"
        ))
    })?;
    let conn = ctx
        .connect(&vol.cluster_id, &secret)
        .await
        .map_err(Transient)?;
    let config = crate::volume::kms::KmsConfig::load(&ctx.kms_config)
        .map_err(|e| Transient(e.to_string()))?;
    let handle = vol.handle();
    let (v, h) = (vol.clone(), handle.clone());
    let (rec, _kind) = ctx
        .ceph(&conn, move |c, _m, _f| {
            Ok(encryption::rotation_target(c, &v, &h, &config)?)
        })
        .await
        .map_err(|e| match &e {
            VolumeError::Ceph(err)
                if matches!(
                    err.kind(),
                    crate::ErrorKind::InvalidArgument | crate::ErrorKind::NotFound
                ) =>
            {
                Refused(format!("{what}: {e}"))
            }
            _ => Transient(format!("{what}: {e}")),
        })?;
    let kms = crate::provisioner::encryption::rotation_kms(ctx, &rec, &secret)
        .await
        .map_err(|why| Transient(format!("{what}: {why}")))?;
    let v = vol.clone();
    ctx.ceph(&conn, move |c, _m, f| {
        f.check("encryption rotate", &v.to_string())
            .map_err(VolumeError::Ceph)?;
        Ok(encryption::rotate_volume(c, &v, &rec, &kms)?)
    })
    .await
    .map_err(|e| {
        Transient(format!(
            "{what}: cannot rotate the passphrase of {vol}: {e}"
        ))
    })?;
    Ok(handle)
}

/// Requeues a job whose attempt failed after its backoff.
pub fn error_policy(
    job: Arc<EncryptionKeyRotationJob>,
    err: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    let delay = ctx.pv_failures.failed(&key(&job));
    tracing::warn!(job = %key(&job), error = %err, retry_in = ?delay, "encryption key rotation not done; will retry");
    Action::requeue(delay.min(Duration::from_secs(60)))
}

/// What wakes a job's reconcile: its spec (generation) and its deletion,
/// not its status (a retry comes from the backoff, as csi-addons'
/// generation predicate has it).
fn changed(j: &EncryptionKeyRotationJob) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    j.metadata.generation.hash(&mut h);
    j.metadata.deletion_timestamp.is_some().hash(&mut h);
    h.finish()
}

/// Runs the EncryptionKeyRotationJob controller until `shutdown`
/// resolves, once the CRD is installed; with `enabled` false it only
/// waits ([`crd::run_on_changes`]).
pub async fn run(
    ctx: Arc<Context>,
    config: Config,
    enabled: bool,
    shutdown: impl std::future::Future<Output = ()> + Clone + Send + Sync + 'static,
) {
    crd::run_on_changes(
        "EncryptionKeyRotationJob",
        ctx,
        config,
        enabled,
        shutdown,
        changed,
        reconcile,
        error_policy,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(v: serde_json::Value) -> EncryptionKeyRotationJob {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn status_counts_retries_and_keeps_one_failed_condition() {
        let j = job(json!({"metadata": {"name": "j", "namespace": "n"},
            "spec": {"target": {"persistentVolumeClaim": "c"}}}));
        assert_eq!(limits(&j.spec), (6, 600));
        let mut st = Status::attempt(&j);
        assert_eq!(st.retries, 0);
        st.failed_condition("cannot reach", 1);
        let v = st.to_json();
        assert!(v["status"].get("retries").is_none());
        assert!(v["status"].get("result").is_none());
        assert_eq!(v["status"]["conditions"][0]["reason"], "failed");
        let j = job(json!({"metadata": {"name": "j", "namespace": "n"},
            "spec": {"target": {"persistentVolumeClaim": "c"}, "backOffLimit": 2,
                     "retryDeadlineSeconds": 30},
            "status": v["status"]}));
        assert_eq!(limits(&j.spec), (2, 30));
        let mut st = Status::attempt(&j);
        assert_eq!(st.retries, 1);
        st.failed_condition("again", 1);
        st.done(FAILED, "Maximum retry limit reached");
        let v = st.to_json();
        assert_eq!(v["status"]["conditions"].as_array().unwrap().len(), 1);
        assert_eq!(v["status"]["conditions"][0]["message"], "again");
        assert_eq!(v["status"]["result"], FAILED);
        assert!(v["status"]["completionTime"].is_string());
        assert_eq!(
            v["status"]["startTime"],
            j.status.unwrap().start_time.unwrap()
        );
    }

    #[test]
    fn the_deadline_counts_from_creation() {
        let old = job(json!({"metadata": {"name": "j", "namespace": "n",
            "creationTimestamp": "2020-01-01T00:00:00Z"}, "spec": {}}));
        assert!(past_deadline(&old, 600));
        let new = job(json!({"metadata": {"name": "j", "namespace": "n",
            "creationTimestamp": now_rfc3339()}, "spec": {}}));
        assert!(!past_deadline(&new, 600));
    }
}
