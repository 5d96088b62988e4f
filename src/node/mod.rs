//! The node side of the CSI driver: block devices, filesystems and mounts.
//!
//! A [`Mapper`] turns an RBD image into a local block device; the rest of
//! the node side (mounts, mkfs, growing a filesystem) works on that device
//! and does not care how it was made. Everything here is blocking and
//! idempotent: each call checks what is already there before acting, so a
//! repeat after a crash at any point converges.
//!
//! Errors are the library's [`crate::Error`]: the op names the syscall or
//! tool (`mount`, `ioctl(LOOP_CONFIGURE)`, `mkfs.xfs`) and the object the
//! path or image it concerned.

pub mod cgroup_io;
mod command;
pub mod dmcrypt;
pub mod fs;
pub mod keyring;
pub mod krbd;
pub mod mount;
pub mod options;
pub mod read_affinity;
pub mod stage_lock;

use std::path::{Path, PathBuf};

use crate::rados::Secret;

/// What to map: where the image is, as whom, and how.
#[derive(Debug, Clone)]
pub struct MapSpec {
    /// The CSI volume id: the stable key of the mapping.
    pub volume_id: String,
    /// Monitor addresses (`host:port`), from the clusters config.
    pub monitors: Vec<String>,
    /// The cephx user, without the `client.` prefix.
    pub user: String,
    /// The cephx key. Never put in argv, the environment or a log.
    pub key: Secret,
    /// The pool.
    pub pool: String,
    /// The RADOS namespace (empty for the default one).
    pub namespace: String,
    /// The image.
    pub image: String,
    /// The cluster's fsid (`rados_cluster_fsid`), when known: two clusters
    /// can hold images of the same pool and name (a mirrored pair does), and
    /// the kernel tells their mappings apart only by it.
    pub cluster_fsid: Option<String>,
    /// The image's features, when known: a mapper that cannot serve one
    /// refuses the map naming it (krbd: the kernel's `supported_features`).
    pub features: Option<crate::rbd::Features>,
    /// Map this snapshot instead of the head (always read-only).
    pub snapshot: Option<String>,
    /// Map read-only.
    pub read_only: bool,
    /// This mapper's options from the `mapOptions` parameter.
    pub options: Vec<String>,
    /// The LUKS2 passphrase of an encrypted volume, for a mapper that
    /// decrypts itself ([`Mapper::decrypts`]); others map the ciphertext
    /// and the node opens it with dm-crypt. Never logged.
    pub encryption: Option<Secret>,
}

/// A way to turn an RBD image into a block device on this node.
///
/// The `mounter` StorageClass parameter picks one by [`Mapper::name`].
pub trait Mapper: Send + Sync {
    /// The name the `mounter` parameter uses (`krbd`, `rbdkit-fuse`).
    fn name(&self) -> &'static str;

    /// Maps the image and returns its block device. If `spec.volume_id` is
    /// already mapped, returns that device instead of mapping it again.
    fn map(&self, spec: &MapSpec) -> crate::Result<PathBuf>;

    /// The device `volume_id` is mapped to now, if any.
    fn find(&self, volume_id: &str) -> crate::Result<Option<PathBuf>>;

    /// Unmaps `volume_id`. Succeeds when it is not mapped. `options` are
    /// this mapper's options from `unmapOptions`.
    fn unmap(&self, volume_id: &str, options: &[String]) -> crate::Result<()>;

    /// Unmaps `volume_id` as [`Mapper::unmap`] does, then releases
    /// `node_id`'s staging lock of its image with the mapping's own Ceph
    /// client, if this mapper keeps one (rbdkit-fuse does; krbd's client is
    /// in the kernel). `Ok(true)`: released, or the image is gone;
    /// `Ok(false)`: unmapped, and the lock is the caller's to release.
    fn unmap_releasing(
        &self,
        volume_id: &str,
        options: &[String],
        node_id: &str,
    ) -> crate::Result<bool> {
        let _ = node_id;
        self.unmap(volume_id, options).map(|()| false)
    }

    /// Makes the device of `volume_id` see the image's current size (after
    /// the controller grew it) and returns that size in bytes.
    fn refresh_size(&self, volume_id: &str) -> crate::Result<u64>;

    /// Whether the mapping of `volume_id` still serves I/O; the error says
    /// why not, for NodeGetVolumeHealth.
    fn check(&self, volume_id: &str, device: &Path) -> Result<(), String>;

    /// Whether this mapper can map on this node now (the node plugin's
    /// Probe); the error says why not.
    fn ready(&self) -> Result<(), String>;

    /// Whether the device [`Mapper::map`] returns for an encrypted volume
    /// is already decrypted (rbdkit-fuse, with [`MapSpec::encryption`]);
    /// otherwise it is the ciphertext, for dm-crypt.
    fn decrypts(&self) -> bool {
        false
    }

    /// Tells the mapper which cluster `volume_id` was mapped from, after a
    /// restart made it forget (the node plugin keeps it in its stash). A
    /// mapper whose volume ids already name the mapping ignores it.
    fn adopt(&self, volume_id: &str, cluster_fsid: &str) {
        let _ = (volume_id, cluster_fsid);
    }
}

pub mod fuse;
pub mod fuse_daemon;
pub mod fuse_journal;
pub mod fuse_kernel;
pub mod fuse_supervisor;
pub mod loopdev;
