//! Space reclaim on the real node (kubelet, rbdkit-fuse), through
//! csi-addons' own ReclaimSpaceJob and ReclaimSpaceCronJob CRDs (from
//! their Go module) reconciled by rbdkit's provisioner, running as the
//! ServiceAccount of `deploy/rbac.yaml` (so that RBAC is enough):
//!
//! - a pod writes a file of random bytes and deletes it, and writes a file
//!   of zeroes and keeps it; the image keeps the deleted file's space until
//!   a ReclaimSpaceJob has the node plugin trim the staged filesystem; the
//!   image's allocated bytes then drop by most of the file, and the job's
//!   `reclaimedSpace` says so (the bytes are printed);
//! - a claim's `reclaimspace.csiaddons.openshift.io/schedule` annotation
//!   gets a ReclaimSpaceCronJob, which makes jobs that succeed; removing
//!   the annotation removes it;
//! - the volume unstaged, a job has the provisioner sparsify it: the file
//!   of zeroes no longer takes space in the pool;
//! - bad input is named: a job for a claim that does not exist is Failed
//!   saying so (status and event), one for a claim not bound yet is Failed
//!   past its backOffLimit after the provisioner's backoff, and a schedule
//!   that does not parse (on a claim, on a cron job) is refused in a
//!   Warning event.
//!
//! And a job survives kill -9 of the provisioner (a child process) while
//! it waits for the node, measured from the usage recorded before.
use crate::support;

use std::collections::BTreeMap;
use std::time::Instant;

use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;

use rbdkit::rbd::Image;
use rbdkit::volume::VolumeId;
use support::manifests::{apply, deploy_dir, parse_docs};
use support::node::{
    busybox_pod, claim_volume, create_pod, delete_pod, pod_logs, prepare_namespace, wait_phase,
    Node, NodePlugin, POD_WAIT,
};
use support::provisioner::{eventually, from_json, Env, WAIT};

/// The file the pod writes and deletes, in MiB.
const FILE_MIB: u64 = 96;
/// The file of zeroes the pod writes and keeps, in MiB.
const ZEROES_MIB: u64 = 32;
const SCHEDULE: &str = "reclaimspace.csiaddons.openshift.io/schedule";

/// The image's allocated bytes, by extent.
fn used(env: &Env, image: &str) -> u64 {
    Image::open_read_only(&env.rbd.ioctx, image)
        .and_then(|i| i.allocated_bytes())
        .expect("allocated bytes")
}

async fn create_job(jobs: &Api<DynamicObject>, name: &str, claim: &str) {
    jobs.create(
        &PostParams::default(),
        &from_json(json!({
            "apiVersion": "csiaddons.openshift.io/v1alpha1",
            "kind": "ReclaimSpaceJob",
            "metadata": {"name": name},
            "spec": {"target": {"persistentVolumeClaim": claim}},
        })),
    )
    .await
    .unwrap_or_else(|e| panic!("create ReclaimSpaceJob {name}: {e}"));
}

/// Waits for the job's result and returns the job.
async fn wait_result(jobs: &Api<DynamicObject>, name: &str, want: &str) -> DynamicObject {
    eventually(&format!("ReclaimSpaceJob {name} {want}"), WAIT, || async {
        let j = jobs.get(name).await.map_err(|e| e.to_string())?;
        match j.data["status"]["result"].as_str() {
            Some(r) if r == want => Ok(j),
            Some(r) if !r.is_empty() => panic!("job {name} {r}: {}", j.data["status"]),
            _ => Err(format!("status {}", j.data["status"])),
        }
    })
    .await
}

fn reclaimed(job: &DynamicObject) -> u64 {
    let q = match &job.data["status"]["reclaimedSpace"] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n.to_string(),
        other => panic!("reclaimedSpace {other}"),
    };
    rbdkit::volume::quantity::parse_bytes(&q).expect("a quantity")
}

fn message(job: &DynamicObject) -> String {
    job.data["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn space_freed_in_a_pod_returns_to_the_pool_after_a_reclaim() {
    let node = Node::shared();
    let mut env = Env::new("reclaim").await;
    prepare_namespace(&env.client, &env.ns).await;
    support::csi_addons::install_crds(&env.client).await;
    let deploy = deploy_dir();
    for file in ["namespace.yaml", "rbac.yaml"] {
        let text = std::fs::read_to_string(deploy.join(file)).unwrap();
        for d in &parse_docs(file, &text) {
            apply(&env.client, d).await;
        }
    }
    let kubeconfig = env.kubeconfig_as("system:serviceaccount:rbdkit:rbdkit-provisioner");
    let provisioner = env.start_in_process_with(&[
        ("--kubeconfig", kubeconfig.to_str().unwrap()),
        ("--leader-election-namespace", "rbdkit"),
    ]);
    let plugin = NodePlugin::start_with(
        node,
        &env.client,
        &env.name,
        &env.config_path(),
        &["--reclaim-poll".into(), "1s".into()],
    )
    .await;
    let class = env
        .storage_class(
            "fs",
            json!({"csi.storage.k8s.io/fstype": "ext4"}),
            json!({}),
        )
        .await;
    env.claim("data", &class, "256Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound("data").await;
    let image = VolumeId::parse(
        &pv.spec
            .as_ref()
            .unwrap()
            .csi
            .as_ref()
            .unwrap()
            .volume_handle,
    )
    .unwrap()
    .image;
    let jobs = support::csi_addons::namespaced_api(&env.client, &env.ns, "ReclaimSpaceJob");
    let crons = support::csi_addons::namespaced_api(&env.client, &env.ns, "ReclaimSpaceCronJob");

    // Bad input, named: a job for a claim that does not exist.
    create_job(&jobs, "nosuch", "missing").await;
    let job = wait_result(&jobs, "nosuch", "Failed").await;
    let m = message(&job);
    assert!(
        m.contains("PersistentVolumeClaim") && m.contains("missing") && m.contains("not found"),
        "{m}"
    );
    env.wait_event("nosuch", "ReclaimSpaceFailed", &["missing", "not found"])
        .await;

    // A claim of ours not bound yet (WaitForFirstConsumer, no pod): each
    // attempt fails, after the provisioner's backoff (500 ms doubling
    // here), and the job is Failed past its backOffLimit, saying why.
    let later = env
        .storage_class(
            "wffc",
            json!({"csi.storage.k8s.io/fstype": "ext4"}),
            json!({"volumeBindingMode": "WaitForFirstConsumer"}),
        )
        .await;
    env.claim("later", &later, "32Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let started = Instant::now();
    jobs.create(
        &PostParams::default(),
        &from_json(json!({
            "apiVersion": "csiaddons.openshift.io/v1alpha1",
            "kind": "ReclaimSpaceJob",
            "metadata": {"name": "unbound"},
            "spec": {"target": {"persistentVolumeClaim": "later"}, "backOffLimit": 2},
        })),
    )
    .await
    .expect("create ReclaimSpaceJob unbound");
    let job = wait_result(&jobs, "unbound", "Failed").await;
    let took = started.elapsed();
    let m = message(&job);
    assert!(
        m.contains("later") && m.contains("not bound yet") && m.contains("backOffLimit is 2"),
        "{m}"
    );
    assert_eq!(job.data["status"]["retries"], 3, "{}", job.data["status"]);
    assert!(
        took >= std::time::Duration::from_millis(1400),
        "three attempts 0.5 s and 1 s apart took only {took:?}"
    );

    // Written and deleted, and zeroes written and kept; the pod stays, so
    // the volume stays staged.
    let empty = used(&env, &image);
    let script = format!(
        "set -e; dd if=/dev/urandom of=/data/big bs=1M count={FILE_MIB} conv=fsync 2>/dev/null; \
         dd if=/dev/zero of=/data/zeroes bs=1M count={ZEROES_MIB} conv=fsync 2>/dev/null; \
         sync; echo written; sleep 2; rm /data/big; sync; echo deleted; sleep 3600"
    );
    let mount = json!([{"name": "data", "mountPath": "/data"}]);
    create_pod(
        &env.client,
        &env.ns,
        busybox_pod(node, "app", &script, claim_volume("data"), mount),
    )
    .await;
    wait_phase(node, &env.client, &env.ns, "app", &["Running"], POD_WAIT).await;
    eventually("the pod deleted its file", WAIT, || async {
        let log = pod_logs(&env.client, &env.ns, "app").await;
        if log.contains("deleted") {
            Ok(())
        } else {
            Err(log)
        }
    })
    .await;
    // Deleted, not discarded (no `discard` mount option): still allocated.
    let written = used(&env, &image);
    let file = FILE_MIB << 20;
    let zeroes = ZEROES_MIB << 20;
    assert!(
        written >= empty + (file + zeroes) * 3 / 4,
        "the deleted file's space is still allocated before the reclaim: {empty} bytes empty, \
         {written} after"
    );

    // On demand: the node trims the staged filesystem.
    let started = Instant::now();
    create_job(&jobs, "now", "data").await;
    let job = wait_result(&jobs, "now", "Succeeded").await;
    let took = started.elapsed();
    let after = used(&env, &image);
    let freed = written.saturating_sub(after);
    let reported = reclaimed(&job);
    let m = message(&job);
    eprintln!(
        "reclaim (node fstrim): a {FILE_MIB} MiB file deleted in a pod; the image had {written} \
         bytes ({:.1} MiB) allocated, {after} ({:.1} MiB) after the ReclaimSpaceJob: {freed} bytes \
         ({:.1} MiB) returned to the pool (the job's reclaimedSpace: {reported} bytes, {:.1} MiB), \
         in {took:?}; {m}",
        mib(written),
        mib(after),
        mib(freed),
        mib(reported)
    );
    assert!(m.contains("fstrim"), "the node trimmed: {m}");
    assert!(
        freed >= file * 3 / 4,
        "only {freed} of the file's {file} bytes returned"
    );
    assert!(
        after >= empty + zeroes * 3 / 4,
        "the kept file of zeroes is still allocated: {after}"
    );
    assert!(reported >= file * 3 / 4, "reclaimedSpace {reported}");
    env.wait_event(
        "now",
        "ReclaimSpaceSucceeded",
        &["fstrim", "returned to the pool"],
    )
    .await;
    // The node's answer is on the image's header, and its request taken
    // away: a node looking for requests reads one missing xattr.
    let header = Image::open_read_only(&env.rbd.ioctx, &image)
        .and_then(|i| i.header_oid())
        .expect("header object");
    let xattr = |what: &str| {
        env.rbd
            .ioctx
            .xattr_get(&header, &format!("rbdkit.reclaim.{what}.{}", node.name))
    };
    assert!(
        xattr("request").is_err(),
        "the answered request is taken away"
    );
    let done: serde_json::Value =
        serde_json::from_slice(&xattr("done").expect("the node's answer")).unwrap();
    assert_eq!(done["ok"], true, "{done}");
    assert!(
        done["trimmed"].as_u64().unwrap_or(0) >= file * 3 / 4,
        "{done}"
    );

    // A schedule that does not parse is refused by name, and makes nothing.
    env.annotate_claim("data", BTreeMap::from([(SCHEDULE, "every day")]))
        .await;
    env.wait_event(
        "data",
        "InvalidReclaimSpaceSchedule",
        &["every day", "fields"],
    )
    .await;
    assert!(
        crons.get_opt("data-reclaimspace").await.unwrap().is_none(),
        "no cron job for a bad schedule"
    );

    // On a schedule: the claim's annotation gets a cron job, which makes
    // jobs.
    env.annotate_claim("data", BTreeMap::from([(SCHEDULE, "* * * * *")]))
        .await;
    let cron = eventually("the schedule's cron job", WAIT, || async {
        crons
            .get_opt("data-reclaimspace")
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "no cron job yet".to_owned())
    })
    .await;
    assert_eq!(cron.data["spec"]["schedule"], "* * * * *");
    assert_eq!(
        cron.data["spec"]["jobTemplate"]["spec"]["target"]["persistentVolumeClaim"],
        "data"
    );
    let recorded = env.claims().get("data").await.unwrap();
    assert_eq!(
        recorded
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("reclaimspace.csiaddons.openshift.io/cronjob"))
            .map(String::as_str),
        Some("data-reclaimspace")
    );
    // Its last run two minutes ago: the next one is due now, not at the
    // next minute.
    let past =
        k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(120);
    crons
        .patch_status(
            "data-reclaimspace",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"lastScheduleTime": past.to_string()}})),
        )
        .await
        .expect("set lastScheduleTime");
    let scheduled = eventually("a job of the schedule succeeded", WAIT, || async {
        let list = jobs
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .into_iter()
            .find(|j| {
                j.metadata
                    .name
                    .as_deref()
                    .unwrap_or("")
                    .starts_with("data-reclaimspace-")
                    && j.data["status"]["result"] == "Succeeded"
            })
            .ok_or_else(|| "no finished job of the schedule yet".to_owned())
    })
    .await;
    eprintln!(
        "reclaim (scheduled job {}): {}",
        scheduled.metadata.name.as_deref().unwrap_or_default(),
        message(&scheduled)
    );
    // A cron job of its own with a bad schedule: refused by name.
    crons
        .create(
            &PostParams::default(),
            &from_json(json!({
                "apiVersion": "csiaddons.openshift.io/v1alpha1",
                "kind": "ReclaimSpaceCronJob",
                "metadata": {"name": "badcron"},
                "spec": {"schedule": "61 * * * *",
                    "jobTemplate": {"spec": {"target": {"persistentVolumeClaim": "data"}}}},
            })),
        )
        .await
        .expect("create the bad cron job");
    env.wait_event("badcron", "InvalidSchedule", &["\"61\"", "minute"])
        .await;
    // The annotation gone, so is the cron job.
    env.claims()
        .patch(
            "data",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {SCHEDULE: null}}})),
        )
        .await
        .expect("remove the schedule");
    eventually("the cron job deleted", WAIT, || async {
        match crons.get_opt("data-reclaimspace").await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // Staged nowhere: the provisioner sparsifies, and the file of zeroes
    // goes from the pool.
    delete_pod(node, &env.client, &env.ns, "app").await;
    eventually("the volume unstaged", WAIT, || async {
        match plugin.fuse_mapper().list() {
            Ok(l) if l.is_empty() => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let before = used(&env, &image);
    create_job(&jobs, "offline", "data").await;
    let job = wait_result(&jobs, "offline", "Succeeded").await;
    let after = used(&env, &image);
    let freed = before.saturating_sub(after);
    let m = message(&job);
    eprintln!(
        "reclaim (sparsify, unstaged): a {ZEROES_MIB} MiB file of zeroes; the image had {before} \
         bytes ({:.1} MiB) allocated, {after} ({:.1} MiB) after: {freed} bytes ({:.1} MiB) \
         returned to the pool (reclaimedSpace {} bytes); {m}",
        mib(before),
        mib(after),
        mib(freed),
        reclaimed(&job)
    );
    assert!(m.contains("sparsified"), "{m}");
    assert!(
        freed >= zeroes * 3 / 4,
        "only {freed} of the {zeroes} bytes of zeroes returned"
    );

    for j in ["now", "nosuch", "unbound", "offline"] {
        let _ = jobs.delete(j, &DeleteParams::default()).await;
    }
    let _ = crons.delete("badcron", &DeleteParams::default()).await;
    env.delete_claim("data").await;
    env.wait_gone(&env.pvs(), pv.metadata.name.as_deref().unwrap())
        .await;
    provisioner.stop().await;
    drop(plugin);
}

/// A provisioner killed with SIGKILL while a job waits for the node, and a
/// new one started: the job is resumed with the same request and measured
/// from the usage recorded before the node was asked (a re-measure after
/// the trim would report nothing reclaimed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_survives_kill_9_of_the_provisioner_and_reports_from_before() {
    let node = Node::shared();
    let mut env = Env::new("reclaimk").await;
    prepare_namespace(&env.client, &env.ns).await;
    support::csi_addons::install_crds(&env.client).await;
    let mut first = env.start_process("crash-1");
    // The node looks seldom, so the provisioner dies while it waits.
    let plugin = NodePlugin::start_with(
        node,
        &env.client,
        &env.name,
        &env.config_path(),
        &["--reclaim-poll".into(), "8s".into()],
    )
    .await;
    let class = env
        .storage_class(
            "fs",
            json!({"csi.storage.k8s.io/fstype": "ext4"}),
            json!({}),
        )
        .await;
    env.claim("data", &class, "128Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound("data").await;
    let image = VolumeId::parse(
        &pv.spec
            .as_ref()
            .unwrap()
            .csi
            .as_ref()
            .unwrap()
            .volume_handle,
    )
    .unwrap()
    .image;
    let file_mib = 48u64;
    let script = format!(
        "set -e; dd if=/dev/urandom of=/data/big bs=1M count={file_mib} conv=fsync 2>/dev/null; \
         sync; rm /data/big; sync; echo deleted; sleep 3600"
    );
    let mount = json!([{"name": "data", "mountPath": "/data"}]);
    create_pod(
        &env.client,
        &env.ns,
        busybox_pod(node, "app", &script, claim_volume("data"), mount),
    )
    .await;
    wait_phase(node, &env.client, &env.ns, "app", &["Running"], POD_WAIT).await;
    eventually("the pod deleted its file", WAIT, || async {
        let log = pod_logs(&env.client, &env.ns, "app").await;
        if log.contains("deleted") {
            Ok(())
        } else {
            Err(log)
        }
    })
    .await;
    let written = used(&env, &image);

    let jobs = support::csi_addons::namespaced_api(&env.client, &env.ns, "ReclaimSpaceJob");
    create_job(&jobs, "crash", "data").await;
    let waiting = eventually("the job waiting for the node", WAIT, || async {
        let j = jobs.get("crash").await.map_err(|e| e.to_string())?;
        let asked = message(&j).contains("waiting for node");
        let recorded = j
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key("rbdkit.io/reclaim-used-before"));
        if asked && recorded {
            Ok(j)
        } else {
            Err(format!("{:?} {}", j.metadata.annotations, j.data["status"]))
        }
    })
    .await;
    first.kill9();
    assert!(
        waiting.data["status"]["result"]
            .as_str()
            .unwrap_or("")
            .is_empty(),
        "still running when killed: {}",
        waiting.data["status"]
    );
    let mut second = env.start_process("crash-2");
    let job = wait_result(&jobs, "crash", "Succeeded").await;
    let after = used(&env, &image);
    let reported = reclaimed(&job);
    let m = message(&job);
    eprintln!(
        "reclaim across kill -9: {written} bytes allocated before, {after} after; reclaimedSpace \
         {reported} bytes ({:.1} MiB of a {file_mib} MiB file); {m}",
        mib(reported)
    );
    let file = file_mib << 20;
    assert!(m.contains("fstrim"), "{m}");
    assert!(
        reported >= file * 3 / 4,
        "measured from before the kill: reclaimedSpace {reported} of the file's {file} bytes"
    );
    assert!(written.saturating_sub(after) >= file * 3 / 4);

    delete_pod(node, &env.client, &env.ns, "app").await;
    let _ = jobs.delete("crash", &DeleteParams::default()).await;
    env.delete_claim("data").await;
    env.wait_gone(&env.pvs(), pv.metadata.name.as_deref().unwrap())
        .await;
    second.kill9();
    drop(plugin);
}
