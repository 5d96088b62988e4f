//! librados: connections, pools, I/O contexts, objects and omap.
//!
//! Ownership: a [`Cluster`] is an `Arc` around the `rados_t`; every [`IoCtx`]
//! holds an `Arc` to it, and every image holds an `Arc` to its `IoCtx`. So an
//! image always closes before its ioctx, and an ioctx before its cluster, and
//! all three are `'static` values that can move into threads and async tasks.

mod cluster;
mod ioctx;
mod omap;

#[cfg(feature = "service")]
pub(crate) use cluster::zeroize;
pub use cluster::{
    Cluster, ClusterStats, ConnectOptions, MonCommandReply, Secret, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_OP_TIMEOUT,
};
pub use ioctx::{IoCtx, ObjectStat, PoolStats};
pub use omap::omap_text;
