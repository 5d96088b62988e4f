//! # rbdkit
//!
//! Ceph RBD in process: a safe Rust library over `librados` and `librbd`,
//! and (with the default `service` feature) a CLI and a Kubernetes
//! provisioner built on it.
//!
//! ```no_run
//! use rbdkit::rados::ConnectOptions;
//! use rbdkit::rbd::{self, Image, ImageOptions};
//!
//! let cluster = ConnectOptions::new().conf_file("/etc/ceph/ceph.conf").connect()?;
//! let ioctx = cluster.ioctx("rbd")?;
//! rbd::create(&ioctx, "vol-1", 1 << 30, &ImageOptions::new())?;
//! let image = Image::open(&ioctx, "vol-1")?;
//! image.write(0, b"hello")?;
//! image.resize(2 << 30)?;
//! image.close()?;
//! rbd::remove(&ioctx, "vol-1")?;
//! # Ok::<(), rbdkit::Error>(())
//! ```
//!
//! ## Design
//! - Every handle (`rados_t`, `rados_ioctx_t`, `rbd_image_t`, options, ops,
//!   iterators) is owned by one Rust value and freed exactly once on drop.
//! - An image holds its [`rados::IoCtx`], which holds its [`rados::Cluster`]
//!   (both through `Arc`), so closing always runs image → ioctx → cluster,
//!   and all of them are `'static` and can move into threads or tasks.
//! - Every failed call becomes one [`Error`] that keeps the errno, the C
//!   function and the `pool/namespace/image` it concerned.
//! - Every call is bounded: [`rados::ConnectOptions`] sets connect, monitor
//!   and OSD timeouts (30 s by default) where Ceph would wait 300 s or forever.
//! - Calls are plainly blocking. With the `service` feature, `blocking`
//!   runs them on a bounded pool of threads for async code.
//!
//! See `vendor-notes.md` for the Ceph releases and C symbols covered.
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod error;
mod json;
pub mod rados;
pub mod rbd;
mod util;

#[cfg(feature = "service")]
pub mod blocking;
#[cfg(feature = "service")]
pub mod cli;
#[cfg(feature = "service")]
pub mod csi;
#[cfg(feature = "service")]
pub mod k8s;
#[cfg(feature = "service")]
pub mod node;
#[cfg(feature = "service")]
pub mod provisioner;
#[cfg(feature = "service")]
mod shutdown;
#[cfg(feature = "service")]
pub mod telemetry;
#[cfg(feature = "service")]
pub mod volume;

pub use error::{Error, ErrorKind, Result};

// Compile-time proof of the thread-safety promises made in the docs.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<rados::Cluster>();
    send_sync::<rados::IoCtx>();
    send_sync::<rbd::Image>();
    send_sync::<Error>();
};
