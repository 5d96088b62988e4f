//! The client library against a real Ceph cluster: librados, librbd images,
//! snapshots, pools, AIO, errors and deadlines. This binary is what the Ceph
//! release matrix (`scripts/ceph-release-matrix`) builds and runs for every
//! release; its plain modules build without the `service` feature.
//!
//! One binary for the whole group, so the suite links once (issue 29).

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "service")]
mod cli;
mod errors;
mod rados;
mod rbd_aio;
#[cfg(feature = "service")]
mod rbd_aio_tokio;
mod rbd_deadlines;
mod rbd_image;
mod rbd_large_io;
mod rbd_mirror;
mod rbd_pool;
mod rbd_releases;
mod rbd_snapshots;
