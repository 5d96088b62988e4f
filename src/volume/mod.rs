//! Volume operations shared by the provisioner and the CSI controller.
//!
//! Both front ends turn a request (a claim, or a CSI `CreateVolume`) into
//! the same calls here, so an image made by one can be deleted or expanded
//! by the other:
//! - [`params`]: StorageClass / CSI parameters, validated;
//! - [`quantity`]: sizes as Kubernetes quantities (`1Gi`, `500M`) and back;
//! - [`id`]: the volume handle (`rbdkit1/cluster/pool/namespace/image`) and
//!   the image name a request name gives;
//! - [`clusters`]: the ceph-csi clusters config and the connection cache;
//! - [`ops`]: create, delete and expand, with ownership checks;
//! - [`gc`]: what a provisioner left behind, found and removed.
//! - [`pv`]: what marks a PV as this driver's (annotations, finalizer) and
//!   how its volume and Secrets are read back;
//! - [`legacy`]: PVs of the old RBD provisioners, read, matched to a cluster
//!   and taken over.
//! - [`snapshot`]: snapshots, restores, volume clones, clone depth limits
//!   and the trash for sources that still have clones.
//! - [`encryption`], [`kms`], [`luks`]: encrypted volumes, where their
//!   passphrases are kept, and the LUKS2 header both mappers open.
//! - [`group_snapshot`]: volume group snapshots, one instant for several
//!   volumes, each member an ordinary snapshot.
//! - [`node_fence`]: fencing a whole node by its addresses, and lifting it.
//! - [`replication`]: RBD mirroring for csi-addons' VolumeReplication.
//!
//! Nothing here knows about Kubernetes objects (callers pass plain values)
//! except [`pv`] and [`legacy`], whose input is PVs themselves.

pub mod clusters;
pub mod encryption;
pub mod gc;
pub mod group_snapshot;
pub mod id;
pub mod kms;
pub mod legacy;
pub mod luks;
pub mod node_fence;
pub mod ops;
pub mod params;
pub mod pv;
pub mod qos;
pub mod quantity;
pub mod replication;
pub mod snapshot;
pub mod topology;

use std::collections::BTreeMap;
use std::time::Instant;

pub use id::{image_base, GroupSnapshotId, SnapshotId, VolumeId};

use params::ClassParams;

/// The volume attributes (CSI volume context) of a volume: where the image
/// is, what it was made with, and what the node needs to stage it. The
/// provisioner puts them on the PV; the CSI controller returns them from
/// `CreateVolume`. Never holds a secret.
pub fn volume_context(vol: &VolumeId, params: &ClassParams) -> BTreeMap<String, String> {
    let mut ctx = BTreeMap::from([
        ("clusterID".to_owned(), vol.cluster_id.clone()),
        ("pool".to_owned(), vol.pool.clone()),
        ("imageName".to_owned(), vol.image.clone()),
        ("radosNamespace".to_owned(), vol.rados_namespace.clone()),
        ("imageFeatures".to_owned(), params.features.to_string()),
    ]);
    if let Some(dp) = &params.data_pool {
        ctx.insert("dataPool".to_owned(), dp.clone());
    }
    for (k, v) in params.node.attributes() {
        ctx.insert(k.to_owned(), v);
    }
    ctx
}

/// The pools of `cluster` initialised for RBD (the `rbd` application
/// enabled, as `rbd pool init` does), sorted: where volumes can be. One
/// monitor command, `osd pool ls detail`, which needs only the monitors'
/// read capability (`profile rbd` has it).
pub fn rbd_pools(cluster: &crate::rados::Cluster) -> crate::Result<Vec<String>> {
    let reply = cluster.mon_command(
        r#"{"prefix": "osd pool ls", "detail": "detail", "format": "json"}"#,
        &[],
    )?;
    let mut names = pools_with_application(&reply.output, "rbd")
        .map_err(|why| crate::Error::invalid("osd pool ls", "detail", why))?;
    names.sort();
    Ok(names)
}

/// The pools of an `osd pool ls detail` JSON reply whose
/// `application_metadata` names `application`.
fn pools_with_application(json: &[u8], application: &str) -> Result<Vec<String>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| format!("unreadable reply: {e}"))?;
    let pools = v.as_array().ok_or("the reply is not a list of pools")?;
    Ok(pools
        .iter()
        .filter(|p| p["application_metadata"].get(application).is_some())
        .filter_map(|p| p["pool_name"].as_str().map(str::to_owned))
        .collect())
}

/// Where the volume operations report what they did, for metrics.
///
/// The provisioner and the CSI server each implement it on their own
/// metrics; [`NoMetrics`] discards everything.
pub trait CephObserver: Send + Sync {
    /// One Ceph call named `op` that started at `started` has finished.
    fn ceph_op(&self, op: &str, started: Instant);
    /// The connection cache now holds `n` connections.
    fn set_connections(&self, n: usize);
    /// The Ceph cluster `cluster_id` is (or is no longer) reachable.
    fn cluster_reachable(&self, _cluster_id: &str, _reachable: bool) {}
    /// Operations on the Ceph cluster `cluster_id` time out (its monitors
    /// may still answer, as when its OSDs are down), or one has just been
    /// answered again.
    fn cluster_ops_timing_out(&self, _cluster_id: &str, _timing_out: bool) {}
}

/// Permission to make one change to Ceph, asked for immediately before each
/// destructive step of the volume operations (create or rename of the
/// temporary image, its owner metadata, resize, trash move, trash remove,
/// remove).
///
/// The provisioner passes one backed by its leader lease, so that a
/// replica that has been deposed while a step was already running on the
/// blocking pool stops before its next change. An `Err` (of kind
/// [`crate::ErrorKind::Fenced`]) aborts the operation with nothing more
/// changed; whoever leads retries it.
pub trait Fence: Send + Sync {
    /// May `step` (the C function about to be called) on `object` run now?
    fn check(&self, step: &'static str, object: &str) -> crate::Result<()>;
}

/// A [`Fence`] that always allows: for callers whose requests are already
/// serialised by someone else (a CSI controller behind its CO).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoFence;

impl Fence for NoFence {
    fn check(&self, _step: &'static str, _object: &str) -> crate::Result<()> {
        Ok(())
    }
}

/// A [`CephObserver`] that records nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoMetrics;

impl CephObserver for NoMetrics {
    fn ceph_op(&self, _op: &str, _started: Instant) {}
    fn set_connections(&self, _n: usize) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rbd_pools_are_those_with_the_application() {
        let reply = br#"[
            {"pool_name": ".mgr", "application_metadata": {"mgr": {}}},
            {"pool_name": "kube", "application_metadata": {"rbd": {}}},
            {"pool_name": "fs", "application_metadata": {"cephfs": {"data": "fs"}}},
            {"pool_name": "new", "application_metadata": {}}
        ]"#;
        assert_eq!(pools_with_application(reply, "rbd").unwrap(), vec!["kube"]);
        assert!(pools_with_application(b"{}", "rbd").is_err());
        assert!(pools_with_application(b"not json", "rbd").is_err());
    }
}
