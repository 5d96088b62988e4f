//! librados: connections, pools, I/O contexts, objects, omap and object
//! locks; and [`Secret`], the key type.
//!
//! Ownership: a [`Cluster`] is an `Arc` around the `rados_t`; every [`IoCtx`]
//! holds an `Arc` to it, and every image holds an `Arc` to its `IoCtx`. So an
//! image always closes before its ioctx, and an ioctx before its cluster, and
//! all three are `'static` values that can move into threads and async tasks.

mod blocklist;
mod cluster;
mod ioctx;
mod lock;
mod mgr;
mod omap;
mod secret;

pub use blocklist::Cidr;
pub use cluster::{
    Cluster, ClusterStats, ConnectOptions, MonCommandReply, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_OP_TIMEOUT,
};
pub use ioctx::{IoCtx, ObjectStat, PoolStats};
pub use lock::{ObjectLocker, ObjectLockers};
pub use omap::omap_text;
pub(crate) use secret::zeroize;
pub use secret::{keep_keys_out_of_core_dumps, Secret};
