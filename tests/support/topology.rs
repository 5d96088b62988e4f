//! A second RBD pool for topology tests (one pool per zone), the RADOS
//! namespace of a test in it, and a cephx user with `profile rbd` on both
//! pools (the shared least-privilege users have only the first).
//!
//! ```ignore
//! support::topology::topo_pool();
//! let ns = TopoNs::new(&env.rbd.name); // same namespace name in the second pool
//! ```

use std::collections::HashMap;
use std::sync::OnceLock;

use rbdkit::rados::IoCtx;
use rbdkit::rbd;

use super::ceph::{cluster, user_with_caps, POOL};

/// The second pool.
pub const TOPO_POOL: &str = "rbd-topo";
/// A user with `profile rbd` on [`POOL`] and [`TOPO_POOL`].
pub const TOPO_USER: &str = "rbdkit-test-topo";

/// Makes [`TOPO_POOL`] (an initialised RBD pool) if it is not there.
pub fn topo_pool() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let c = cluster();
        match c.pool_create(TOPO_POOL) {
            Ok(()) => {}
            Err(e) if e.kind() == rbdkit::ErrorKind::AlreadyExists => {}
            Err(e) => panic!("create pool {TOPO_POOL}: {e}"),
        }
        let io = c.ioctx(TOPO_POOL).expect("open the topology pool");
        io.application_enable("rbd", true)
            .expect("enable rbd on the topology pool");
        rbd::pool_init(&io, true).expect("rbd pool init");
    });
}

/// [`TOPO_USER`]'s key.
pub fn topo_key() -> String {
    static KEY: OnceLock<String> = OnceLock::new();
    KEY.get_or_init(|| {
        user_with_caps(
            TOPO_USER,
            &[
                "mon".into(),
                "profile rbd".into(),
                "osd".into(),
                format!("profile rbd pool={POOL}, profile rbd pool={TOPO_POOL}"),
            ],
        )
    })
    .clone()
}

/// CSI secrets of [`TOPO_USER`].
pub fn topo_secrets() -> HashMap<String, String> {
    HashMap::from([
        ("userID".to_owned(), TOPO_USER.to_owned()),
        ("userKey".to_owned(), topo_key()),
    ])
}

/// A test's RADOS namespace in [`TOPO_POOL`] (named as its namespace in
/// [`POOL`]); everything in it is removed on drop.
pub struct TopoNs {
    /// An ioctx in the namespace.
    pub ioctx: IoCtx,
    /// The namespace.
    pub name: String,
}

impl TopoNs {
    /// Creates namespace `name` in [`TOPO_POOL`] (the pool must exist).
    pub fn new(name: &str) -> TopoNs {
        let pool = cluster().ioctx(TOPO_POOL).expect("open the topology pool");
        rbd::namespace_create(&pool, name).expect("create namespace in the topology pool");
        TopoNs {
            ioctx: pool.with_namespace(name).expect("ioctx in namespace"),
            name: name.to_owned(),
        }
    }

    /// The images in it, sorted.
    pub fn images(&self) -> Vec<String> {
        let mut v = rbd::list_names(&self.ioctx).unwrap_or_default();
        v.sort();
        v
    }
}

impl Drop for TopoNs {
    fn drop(&mut self) {
        super::ceph::remove_namespace(&self.ioctx, TOPO_POOL, &self.name);
    }
}
