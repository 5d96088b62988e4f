//! Volume operations shared by the provisioner and the CSI controller.
//!
//! Both front ends turn a request (a claim, or a CSI `CreateVolume`) into
//! the same calls here, so an image made by one can be deleted or expanded
//! by the other:
//! - [`params`]: StorageClass / CSI parameters, validated;
//! - [`id`]: the volume handle (`rbdkit1/cluster/pool/namespace/image`);
//! - [`clusters`]: the ceph-csi clusters config and the connection cache;
//! - [`ops`]: create, delete and expand, with ownership checks;
//! - [`snapshot`]: snapshots, restores, volume clones, clone depth limits
//!   and the trash for sources that still have clones.
//!
//! Nothing here knows about Kubernetes objects; callers pass plain values.

pub mod clusters;
pub mod id;
pub mod ops;
pub mod params;
pub mod snapshot;

use std::collections::BTreeMap;
use std::time::Instant;

pub use id::{SnapshotId, VolumeId};

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

/// Where the volume operations report what they did, for metrics.
///
/// The provisioner and the CSI server each implement it on their own
/// metrics; [`NoMetrics`] discards everything.
pub trait CephObserver: Send + Sync {
    /// One Ceph call named `op` that started at `started` has finished.
    fn ceph_op(&self, op: &str, started: Instant);
    /// The connection cache now holds `n` connections.
    fn set_connections(&self, n: usize);
}

/// A [`CephObserver`] that records nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoMetrics;

impl CephObserver for NoMetrics {
    fn ceph_op(&self, _op: &str, _started: Instant) {}
    fn set_connections(&self, _n: usize) {}
}
