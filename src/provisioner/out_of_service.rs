//! Nodes out of service: the dead node is fenced, its staging locks are
//! broken, and the fence is lifted when it is back.
//!
//! **Why a taint, and why here.** A node's staging lock
//! ([`crate::node::stage_lock`]) outlives the node, so that a node that is
//! only cut off cannot be joined by another. Nothing a node plugin sees
//! tells a dead node from a partitioned one (a missing watcher does not:
//! live nodes lose watches too), so rbdkit never guesses. Kubernetes has
//! the signal: an admin, or a fencing operator, puts the
//! `node.kubernetes.io/out-of-service` taint on a Node it knows is off
//! (non-graceful node shutdown, GA since 1.28). The driver has no attach
//! step and no sidecars, so the provisioner, which already has every PV's
//! secrets, acts on it while it holds the leader lease.
//!
//! **Tainted** (any effect): for each cluster, the addresses the node is
//! known by on every volume of ours it holds a staging lock on
//! ([`ImageLock::node_clients`]: the lock holder and the data-path clients
//! the node recorded) give its IPs. They are written to the Node's
//! `<provisioner>/fenced` annotation, with the cluster and the Secret to
//! lift them with, **before** anything is blocklisted, so a crash at any
//! point leaves the record to unfence by. Then each IP is fenced whole
//! ([`node_fence::fence`]: every client from it, now and later, for five
//! years) and, after the OSD map that lists them, the node's locks are
//! broken ([`ImageLock::break_node`], which spares an image that a client
//! from elsewhere has open). Each step is idempotent; the reconcile runs
//! again every [`RECHECK`] while the taint stays, so a volume the node
//! locked meanwhile is covered too. An address of the cluster's own
//! daemons is never fenced: the node is then refused, with an event
//! naming the daemon.
//!
//! **Untainted** with a record: every recorded entry is lifted (`osd
//! blocklist rm`, which needs mon cap `allow command "osd blocklist"`),
//! then the annotation goes. Take the taint off only once the node is
//! really back (rebooted, its old mappings gone). Deleting a fenced Node
//! keeps its fence: lift it by hand (`ceph osd blocklist rm IP:0/0`) before
//! its address is given to another machine.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Config};
use kube::runtime::{reflector, Controller, WatchStreamExt};
use kube::{Resource, ResourceExt};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::node::stage_lock::ImageLock;
use crate::provisioner::controller::{Context, ReconcileError};
use crate::provisioner::maintenance::for_each_pv;
use crate::provisioner::pv::{deletion_secret, our_volume};
use crate::volume::node_fence;
use crate::volume::ops::VolumeError;
use crate::volume::params::SecretRef;
use crate::volume::VolumeId;
use crate::ErrorKind;

/// The taint of a node that is shut down for good.
pub const OUT_OF_SERVICE_TAINT: &str = "node.kubernetes.io/out-of-service";
/// How often a tainted node's volumes are looked at again.
pub const RECHECK: Duration = Duration::from_secs(60);

/// The Node annotation that records what this provisioner fenced of it.
pub fn fenced_annotation(provisioner: &str) -> String {
    format!("{provisioner}/fenced")
}

/// One cluster's share of a node's fence, as the annotation keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fenced {
    /// The cluster.
    #[serde(rename = "clusterID")]
    pub cluster_id: String,
    /// The Secret (`namespace/name`) to lift the fence with.
    pub secret: String,
    /// The IPs fenced.
    pub ips: Vec<IpAddr>,
}

/// The annotation's record. An unreadable one is an error, never taken
/// as empty: it may be all that says which addresses are fenced.
pub fn read_fenced(node: &Node, provisioner: &str) -> Result<Vec<Fenced>, String> {
    let key = fenced_annotation(provisioner);
    match node.annotations().get(&key) {
        None => Ok(Vec::new()),
        Some(v) => serde_json::from_str(v).map_err(|e| {
            format!(
                "annotation {key} of Node {} is not a fence record ({e}); fix or remove it \
                 (and lift what it fenced by hand)",
                node.name_any()
            )
        }),
    }
}

/// Whether the Node has the out-of-service taint.
pub fn out_of_service(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE_TAINT))
}

/// Runs the Node controller until `shutdown` resolves. Nodes are cached
/// without their status (images and conditions are most of a Node).
pub async fn run(
    ctx: Arc<Context>,
    config: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let (store, writer) = reflector::store();
    let nodes = super::watch_all(Api::<Node>::all(ctx.client.clone()))
        .modify(|n: &mut Node| n.status = None)
        .reflect(writer)
        .applied_objects();
    Controller::for_stream(nodes, store)
        .with_config(config)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "node controller");
            }
        })
        .await;
}

async fn reconcile(node: Arc<Node>, ctx: Arc<Context>) -> Result<Action, ReconcileError> {
    if out_of_service(&node) {
        fence_node(&node, &ctx).await?;
        return Ok(Action::requeue(RECHECK));
    }
    if node
        .annotations()
        .contains_key(&fenced_annotation(&ctx.name))
    {
        unfence_node(&node, &ctx).await?;
    }
    ctx.pv_failures
        .succeeded(&format!("node/{}", node.name_any()));
    Ok(Action::await_change())
}

fn error_policy(node: Arc<Node>, err: &ReconcileError, ctx: Arc<Context>) -> Action {
    let delay = ctx.pv_failures.failed(&format!("node/{}", node.name_any()));
    tracing::warn!(node = %node.name_any(), error = %err, retry_in = ?delay, "node fence not done; will retry");
    Action::requeue(delay)
}

/// Our volumes, by cluster, each with its Secret.
async fn volumes_by_cluster(
    ctx: &Context,
) -> Result<BTreeMap<String, Vec<(VolumeId, SecretRef)>>, ReconcileError> {
    let mut by: BTreeMap<String, Vec<(VolumeId, SecretRef)>> = BTreeMap::new();
    for_each_pv(ctx, |pv| {
        if let (Some(Ok(vol)), Some(secret)) = (our_volume(pv, &ctx.name), deletion_secret(pv)) {
            by.entry(vol.cluster_id.clone())
                .or_default()
                .push((vol, secret));
        }
    })
    .await
    .map_err(ReconcileError)?;
    Ok(by)
}

async fn fence_node(node: &Node, ctx: &Context) -> Result<(), ReconcileError> {
    let name = node.name_any();
    let mut record = read_fenced(node, &ctx.name).map_err(ReconcileError)?;
    let mut problems = Vec::new();
    for (cluster_id, vols) in volumes_by_cluster(ctx).await? {
        if let Err(e) = fence_on(node, ctx, &cluster_id, &vols, &mut record).await {
            problems.push(format!("cluster {cluster_id:?}: {}", e.0));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    let why = format!("node {name} is not fully fenced: {}", problems.join("; "));
    ctx.events
        .warning(&node.object_ref(&()), "NodeFenceFailed", &why)
        .await;
    Err(ReconcileError(why))
}

/// Fences the node on one cluster and breaks its locks there.
async fn fence_on(
    node: &Node,
    ctx: &Context,
    cluster_id: &str,
    vols: &[(VolumeId, SecretRef)],
    record: &mut Vec<Fenced>,
) -> Result<(), ReconcileError> {
    let name = node.name_any();
    let secret = vols[0].1.clone();
    let conn = ctx
        .connect(cluster_id, &secret)
        .await
        .map_err(ReconcileError)?;
    let (n, list) = (name.clone(), vols.to_vec());
    let held = ctx
        .ceph(&conn, move |c, _, _| node_locks(c, &n, &list))
        .await
        .map_err(|e| ReconcileError(e.to_string()))?;
    let recorded: BTreeSet<IpAddr> = record
        .iter()
        .filter(|f| f.cluster_id == cluster_id)
        .flat_map(|f| f.ips.iter().copied())
        .collect();
    let found: BTreeSet<IpAddr> = held
        .iter()
        .flat_map(|(_, addrs)| addrs.iter().filter_map(|a| node_fence::addr_ip(a)))
        .collect();
    let new: Vec<IpAddr> = found.difference(&recorded).copied().collect();
    if !new.is_empty() {
        let n = name.clone();
        let check = new.clone();
        ctx.ceph(&conn, move |c, _, _| {
            node_fence::check_fenceable(&n, &check, &node_fence::protected_addresses(c)?)
        })
        .await
        .map_err(|e| ReconcileError(e.to_string()))?;
        // The record first: whatever happens next, it says what to lift.
        record.push(Fenced {
            cluster_id: cluster_id.to_owned(),
            secret: format!("{}/{}", secret.namespace, secret.name),
            ips: new.clone(),
        });
        save_record(ctx, &name, record).await?;
    }
    let all: Vec<IpAddr> = recorded.union(&found).copied().collect();
    if all.is_empty() {
        return Ok(());
    }
    let (n, ips) = (name.clone(), all.clone());
    let broken = ctx
        .ceph(&conn, move |c, _, fence| {
            fence
                .check("rados_blocklist_add", &n)
                .map_err(VolumeError::Ceph)?;
            node_fence::fence(c, &ips)?;
            Ok(break_locks(c, fence, &n, &ips, &held))
        })
        .await
        .map_err(|e| ReconcileError(e.to_string()))?;
    let (done, refused): (Vec<_>, Vec<_>) = broken.into_iter().partition(|r| r.is_ok());
    let done: Vec<String> = done.into_iter().filter_map(Result::ok).collect();
    if !new.is_empty() || !done.is_empty() {
        let note = format!(
            "fenced node {name} on cluster {cluster_id:?}: every client from {} is blocklisted \
             for five years (until the taint is removed); staging locks broken on {}",
            join_ips(&all),
            if done.is_empty() {
                "no volume".to_owned()
            } else {
                done.join(", ")
            }
        );
        tracing::warn!(node = %name, cluster = cluster_id, "{note}");
        ctx.events
            .normal(&node.object_ref(&()), "NodeFenced", &note)
            .await;
    }
    let refused: Vec<String> = refused.into_iter().filter_map(Result::err).collect();
    if refused.is_empty() {
        Ok(())
    } else {
        Err(ReconcileError(refused.join("; ")))
    }
}

/// The volumes of `list` that `node` holds a staging lock on (or has
/// recorded clients of), with the addresses it is known by there. Volumes
/// whose image is gone are skipped.
fn node_locks(
    c: &crate::rados::Cluster,
    node: &str,
    list: &[(VolumeId, SecretRef)],
) -> Result<Vec<(VolumeId, Vec<String>)>, VolumeError> {
    let mut out = Vec::new();
    for (v, _) in list {
        let lock = match ImageLock::open(c, &v.pool, &v.rados_namespace, &v.image) {
            Ok(l) => l,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(VolumeError::Ceph(e)),
        };
        let addrs = lock.node_clients(node).map_err(VolumeError::Ceph)?;
        if !addrs.is_empty() {
            out.push((v.clone(), addrs));
        }
    }
    Ok(out)
}

/// Breaks `node`'s locks on `held`, once fenced by `ips`: per volume, its
/// name (broken) or why not.
fn break_locks(
    c: &crate::rados::Cluster,
    fence: &dyn crate::volume::Fence,
    node: &str,
    ips: &[IpAddr],
    held: &[(VolumeId, Vec<String>)],
) -> Vec<Result<String, String>> {
    held.iter()
        .map(|(v, _)| {
            let spec = v.to_string();
            fence
                .check("rados_break_lock", &spec)
                .and_then(|()| ImageLock::open(c, &v.pool, &v.rados_namespace, &v.image))
                .and_then(|l| l.break_node(node, ips))
                .map(|_| spec.clone())
                .map_err(|e| format!("volume {spec}: {e}"))
        })
        .collect()
}

async fn save_record(ctx: &Context, node: &str, record: &[Fenced]) -> Result<(), ReconcileError> {
    let value = serde_json::to_string(record).map_err(|e| ReconcileError(e.to_string()))?;
    annotate(ctx, node, json!(value)).await
}

async fn annotate(
    ctx: &Context,
    node: &str,
    value: serde_json::Value,
) -> Result<(), ReconcileError> {
    let patch = json!({"metadata": {"annotations": {fenced_annotation(&ctx.name): value}}});
    Api::<Node>::all(ctx.client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

async fn unfence_node(node: &Node, ctx: &Context) -> Result<(), ReconcileError> {
    let name = node.name_any();
    let record = read_fenced(node, &ctx.name).map_err(ReconcileError)?;
    for f in &record {
        let secret = f
            .secret
            .split_once('/')
            .map(|(namespace, name)| SecretRef {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            })
            .ok_or_else(|| ReconcileError(format!("fence record secret {:?}", f.secret)))?;
        let conn = ctx
            .connect(&f.cluster_id, &secret)
            .await
            .map_err(ReconcileError)?;
        let (n, ips) = (name.clone(), f.ips.clone());
        ctx.ceph(&conn, move |c, _, fence| {
            fence
                .check("osd blocklist rm", &n)
                .map_err(VolumeError::Ceph)?;
            node_fence::unfence(c, &ips)
        })
        .await
        .map_err(|e| {
            ReconcileError(format!(
                "cannot lift the fence of node {name} on cluster {:?} ({}): {e}",
                f.cluster_id,
                join_ips(&f.ips)
            ))
        })?;
    }
    annotate(ctx, &name, serde_json::Value::Null).await?;
    let lifted: Vec<String> = record
        .iter()
        .map(|f| format!("{} on cluster {:?}", join_ips(&f.ips), f.cluster_id))
        .collect();
    let note = format!(
        "node {name} is back in service: lifted the fence of {}",
        lifted.join(", ")
    );
    tracing::info!(node = %name, "{note}");
    ctx.events
        .normal(&node.object_ref(&()), "NodeUnfenced", &note)
        .await;
    Ok(())
}

fn join_ips(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_taint_and_the_record_are_read() {
        let mut node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1", "annotations": {"rbd.rbdkit.io/fenced":
                r#"[{"clusterID": "c1", "secret": "ns/s", "ips": ["10.0.0.9"]}]"#}},
            "spec": {"taints": [{"key": OUT_OF_SERVICE_TAINT, "value": "nodeshutdown",
                "effect": "NoExecute"}]},
        }))
        .unwrap();
        assert!(out_of_service(&node));
        let r = read_fenced(&node, "rbd.rbdkit.io").unwrap();
        assert_eq!(r[0].ips, vec!["10.0.0.9".parse::<IpAddr>().unwrap()]);
        assert!(read_fenced(&node, "other.io").unwrap().is_empty());
        node.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert("rbd.rbdkit.io/fenced".into(), "{".into());
        let e = read_fenced(&node, "rbd.rbdkit.io").unwrap_err();
        assert!(e.contains("is not a fence record"), "{e}");
        node.spec = None;
        assert!(!out_of_service(&node));
    }
}
