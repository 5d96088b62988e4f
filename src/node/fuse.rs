//! The `rbdkit-fuse` mapper: RBD images as block devices with no rbd/nbd
//! kernel module, through a FUSE file and a loop device.
//!
//! Two halves talk over a unix socket:
//! - the daemon, `rbdkit fuse-mapper`, a long-running process of its own
//!   (its own container in the node pod): a supervisor
//!   ([`crate::node::fuse_supervisor`]) that keeps the FUSE connection
//!   alive, and a worker ([`crate::node::fuse_daemon`]) that serves the
//!   image data and can be restarted under a mounted filesystem;
//! - [`FuseMapper`], the [`Mapper`] the node plugin uses, which only sends
//!   requests to the daemon. Restarting the CSI server does not touch a
//!   mapped volume.
//!
//! # Control protocol
//! One JSON object per line each way ([`ControlRequest`] in,
//! [`ControlResponse`] out) on a socket only root may use (mode 0600, and
//! the daemon checks the peer's uid with `SO_PEERCRED`). Ops: `attach`
//! (idempotent: an attached volume returns its device), `detach`
//! (idempotent), `refresh` (re-read the image size, grow the file and the
//! loop device), `list`, `status`, `ping`. The cephx key travels only in an
//! `attach` request: the daemon keeps it in memory for the connection and
//! never logs it, puts it in argv or the environment, or writes it to disk.
//!
//! # Replacing the node pod (an upgrade), and draining a node first
//! The one place this is stated; [`crate::node::fuse_daemon`] has the
//! details of each case.
//!
//! The kernel's FUSE connection lives exactly as long as some process holds
//! one of its `/dev/fuse` fds. Inside the daemon's container the supervisor
//! holds them, so a worker crash or `kill -9` is survived (mounted
//! filesystems keep working). Replacing the whole node pod (a DaemonSet
//! rolling update, a node-plugin upgrade, `kubectl delete pod`) ends every
//! process of the container, so:
//! - with SIGTERM first (the normal pod deletion), the daemon flushes each
//!   image, clears its loop devices and closes the images (their locks and
//!   watches go at once); with SIGKILL, the same devices die but the images'
//!   watches linger until the OSDs time them out (see
//!   `--blocklist-dead-clients`);
//! - either way, **every filesystem mounted from this mapper on the node
//!   gets I/O errors from then on**, and what it had not written back
//!   (never `fsync`ed) is lost; what was `fsync`ed is in the image;
//! - the new daemon reports those volumes unhealthy (`NodeGetVolumeStats`'
//!   condition says "the daemon restarted"). They come back only when their
//!   pods are restarted: kubelet then unpublishes and unstages the dead
//!   mounts and stages again on a new device.
//!
//! **Drain the node before replacing the node pod**: `kubectl drain NODE`
//! (cordon, evict the pods), wait until the daemon's `list` is empty (every
//! volume unstaged), then replace the pod, then `kubectl uncordon NODE`.
//! Use `updateStrategy: OnDelete` for the node plugin's DaemonSet so an
//! image bump never replaces it under mounted volumes by itself.
//!
//! ceph-csi's rbd-nbd mounter has the same problem (its rbd-nbd processes
//! live in the node-plugin pod) and answers it with a *volume healer*: when
//! the node plugin starts, it finds the volumes staged on the node (from
//! their VolumeAttachments), fetches their secrets and starts rbd-nbd again
//! attached to the *same* `/dev/nbdX` (the nbd driver lets a new server
//! take over a device whose server died, within its I/O timeout), so the
//! mounts survive a pod replacement. We cannot do that: a FUSE mount whose
//! last `/dev/fuse` fd was closed is aborted for good; no new server can
//! take it over, so there is nothing a healer could reattach to. What we
//! have instead: surviving any crash *inside* the container (the
//! supervisor keeps the connection, the restarted worker reopens the
//! images and serves again, from its journal, what was in flight), which covers
//! what ceph-csi's healer also covers for crashes, and no need to fetch
//! secrets from the API server at start-up. What rbd-nbd's healer covers
//! and we do not: the whole pod being replaced. For that, drain.
//!
//! # Map and unmap options
//! `mapOptions` for this mapper (`rbdkit-fuse:...` or unprefixed, see
//! [`crate::node::options`]), checked by [`FuseMapOptions::parse`] both
//! here and in the daemon; anything else is refused with an error naming
//! the option:
//! - `queue_depth=N`: the loop device's `nr_requests` (4 to the loop
//!   driver's `hw_queue_depth`, 128 by default; default
//!   [`VOLUME_QUEUE_DEPTH`], 32). Every volume of the mapper shares one
//!   FUSE connection, whose kernel budget of requests in flight
//!   ([`crate::node::fuse_kernel::MAX_BACKGROUND`], 1024) each volume
//!   reserves its queue depth of at attach: a volume whose pool stalls
//!   holds at most its own part, so the others never wait for it. An
//!   attach that would take more than is left is refused (`NoSpace`,
//!   naming what is reserved): 32 volumes at the default depth, more at a
//!   smaller one.
//! - `block_size=N`: the loop device's logical block size (512, 1024, 2048
//!   or 4096; default 512, as krbd's, so an XFS with 512-byte sectors or an
//!   ext4 with 1 KiB blocks made on a krbd device mounts here too).
//! - `read_only` (or `ro`): map read-only, as a read-only volume does.
//! - librbd settings for this image, each `name=value`: `rbd_cache`
//!   (default `false`: no ObjectCacher; `true` gives a write-through one,
//!   which reads ahead), `rbd_cache_writethrough_until_flush`
//!   (`true`/`false`),
//!   `rbd_cache_policy` (only `writethrough`, which the daemon sets anyway:
//!   a cache that answers writes before RADOS has them would lose them when
//!   the worker restarts, while the filesystem above sees no error),
//!   `rbd_cache_size`, `rbd_cache_max_dirty`, `rbd_readahead_max_bytes`,
//!   `rbd_readahead_disable_after_bytes` (bytes) and
//!   `rbd_readahead_trigger_requests`; `rbd_disable_zero_copy_writes`
//!   (`false`: librbd sends the mapper's buffer, which the request owns
//!   until it completes, without copying it; refused with the cache on,
//!   which would keep the buffer and never answer the write) and
//!   `rbd_non_blocking_aio` (`false`: librbd submits on the FUSE thread,
//!   not on its own). These change only caching, prefetching and how
//!   requests reach librbd, never where or how data is stored. An image with
//!   settings gets its own librados connection (images with equal settings
//!   share one).
//!
//! - `read_from_replica=no|balance|localize` and
//!   `crush_location=type:name|type:name` (the kernel's words, so one
//!   option string serves both mappers): librbd's
//!   `rbd_read_from_replica_policy` and `crush_location` on the image's
//!   connection (read affinity, [`crate::node::read_affinity`]).
//!
//! `threads` is refused: the FUSE reader threads serve every image of the
//! daemon, so they are the daemon's `--threads` flag, not a per-volume
//! option. A repeated `attach` with other options than the live mapping's
//! is refused (`EEXIST`), like one for another image.
//!
//! # Encrypted volumes
//! An `attach` with a passphrase (`encryption`) unlocks the image's LUKS2
//! header ([`crate::volume::luks`]) and serves its data segment: the file
//! is the image's size less the header, reads are decrypted and writes
//! encrypted (AES-XTS) in the daemon, and the loop device's block size is
//! the header's sector size (so every request is whole sectors). The
//! volume key (never the passphrase) is kept in the supervisor with the
//! cephx key, so a restarted worker serves the mapping again without a
//! PBKDF run. Discards and write-zeroes are refused (`EOPNOTSUPP`), as
//! dm-crypt refuses discards without `allow_discards`: zeroed ciphertext
//! would not read back as zeroes.
//!
//! `unmapOptions`: `force` clears the loop device even while it is mounted
//! or open (the kernel unbinds it on its last close, and until then every
//! I/O fails) and closes the image; without it, `detach` of a busy device
//! fails with `EBUSY`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::node::{MapSpec, Mapper};
use crate::rados::Secret;

/// How long `attach` may take by default: connecting (30 s bound in the
/// daemon) plus opening the image and binding the device.
pub const ATTACH_TIMEOUT: Duration = Duration::from_secs(120);
/// How long any other request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// A [`Secret`] as a JSON string (the key itself: only on the mapper's sockets).
pub(crate) mod secret_serde {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::rados::Secret;

    pub fn serialize<S: Serializer>(s: &Secret, ser: S) -> Result<S::Ok, S::Error> {
        ser.serialize_str(s.expose())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(de: D) -> Result<Secret, D::Error> {
        String::deserialize(de).map(Secret::new)
    }
}

/// An optional [`Secret`] as a JSON string or null.
pub(crate) mod secret_opt_serde {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::rados::Secret;

    pub fn serialize<S: Serializer>(s: &Option<Secret>, ser: S) -> Result<S::Ok, S::Error> {
        match s {
            Some(s) => ser.serialize_some(s.expose()),
            None => ser.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(de: D) -> Result<Option<Secret>, D::Error> {
        Option::<String>::deserialize(de).map(|o| o.map(Secret::new))
    }
}

/// What `attach` carries: a [`MapSpec`] on the wire. `Debug` redacts the key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttachSpec {
    /// The CSI volume id.
    pub volume_id: String,
    /// Monitor addresses.
    pub monitors: Vec<String>,
    /// The cephx user, without `client.`.
    pub user: String,
    /// The cephx key.
    #[serde(with = "secret_serde")]
    pub key: Secret,
    /// The pool.
    pub pool: String,
    /// The RADOS namespace (empty for the default).
    #[serde(default)]
    pub namespace: String,
    /// The image.
    pub image: String,
    /// A snapshot to map instead of the head (read-only).
    #[serde(default)]
    pub snapshot: Option<String>,
    /// Map read-only.
    #[serde(default)]
    pub read_only: bool,
    /// The `mapOptions` of this mapper ([`FuseMapOptions`]).
    #[serde(default)]
    pub options: Vec<String>,
    /// The LUKS2 passphrase of an encrypted volume: the daemon unlocks its
    /// header and serves the decrypted data segment.
    #[serde(
        default,
        with = "secret_opt_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub encryption: Option<Secret>,
}

/// librbd settings a `mapOptions` entry may override, and what values each
/// takes: only caching, prefetching and how requests are handed to librbd,
/// nothing that changes the data.
const LIBRBD_OPTIONS: &[(&str, ValueKind)] = &[
    // false: librbd sends the mapper's buffer without copying it (the
    // mapper keeps it until the request completes). Refused with
    // `rbd_cache=true`, which would keep the buffer and never answer.
    ("rbd_disable_zero_copy_writes", ValueKind::Bool),
    // false: librbd submits on the calling FUSE thread, not its own.
    ("rbd_non_blocking_aio", ValueKind::Bool),
    ("rbd_cache", ValueKind::Bool),
    ("rbd_cache_writethrough_until_flush", ValueKind::Bool),
    (
        "rbd_cache_policy",
        ValueKind::OneOf(&["writethrough", "writeback", "writearound"]),
    ),
    ("rbd_cache_size", ValueKind::Count),
    ("rbd_cache_max_dirty", ValueKind::Count),
    ("rbd_readahead_max_bytes", ValueKind::Count),
    ("rbd_readahead_disable_after_bytes", ValueKind::Count),
    ("rbd_readahead_trigger_requests", ValueKind::Count),
];

#[derive(Debug, Clone, Copy)]
enum ValueKind {
    Bool,
    Count,
    OneOf(&'static [&'static str]),
}

/// The default `queue_depth` of a mapping, which it reserves of the FUSE
/// connection's `max_background` (see the module docs).
pub const VOLUME_QUEUE_DEPTH: u32 = 32;

/// The queue depth a mapping with these options has, and reserves.
pub fn queue_depth_of(opts: &FuseMapOptions) -> u32 {
    opts.queue_depth
        .unwrap_or_else(|| VOLUME_QUEUE_DEPTH.min(loop_hw_queue_depth()))
}

/// The loop driver's tag-set depth (`hw_queue_depth` module parameter):
/// the most `nr_requests` a loop device takes.
pub fn loop_hw_queue_depth() -> u32 {
    std::fs::read_to_string("/sys/module/loop/parameters/hw_queue_depth")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(128)
}

/// The `mapOptions` of the `rbdkit-fuse` mapper, parsed and checked (see
/// the [module docs](self)).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FuseMapOptions {
    /// `queue_depth`: the loop device's `nr_requests`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<u32>,
    /// `block_size`: the loop device's logical block size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// `read_only`/`ro`.
    #[serde(default)]
    pub read_only: bool,
    /// librbd settings (`rbd_cache=false`, ...), in the order given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub librbd: Vec<(String, String)>,
}

impl FuseMapOptions {
    /// Parses `mapOptions` entries; an unknown option or a bad value is an
    /// `InvalidArgument` error naming it. `volume` is for the message.
    pub fn parse(options: &[String], volume: &str) -> Result<FuseMapOptions> {
        let mut out = FuseMapOptions::default();
        let bad = |opt: &str, why: String| {
            Error::invalid(
                "mapOptions",
                volume,
                format!("rbdkit-fuse option {opt:?}: {why}"),
            )
        };
        for raw in options {
            let opt = raw.trim();
            let (name, value) = match opt.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim())),
                None => (opt, None),
            };
            let number = |v: Option<&str>| -> Result<u64> {
                v.and_then(|v| v.parse::<u64>().ok())
                    .ok_or_else(|| bad(opt, "needs a whole number, as name=N".into()))
            };
            match name {
                "queue_depth" => {
                    let max = loop_hw_queue_depth();
                    let n = number(value)?;
                    if !(4..=u64::from(max)).contains(&n) {
                        return Err(bad(
                            opt,
                            format!(
                                "the loop device's nr_requests must be 4 to {max} (the loop \
                                 driver's hw_queue_depth)"
                            ),
                        ));
                    }
                    out.queue_depth = Some(n as u32);
                }
                "block_size" => {
                    let n = number(value)?;
                    if ![512, 1024, 2048, 4096].contains(&n) {
                        return Err(bad(opt, "must be 512, 1024, 2048 or 4096".into()));
                    }
                    out.block_size = Some(n as u32);
                }
                "read_only" | "ro" => {
                    if value.is_some() {
                        return Err(bad(opt, "takes no value".into()));
                    }
                    out.read_only = true;
                }
                // Read affinity, in the kernel's words (as krbd takes
                // them), set on the image's connection in librbd's.
                "read_from_replica" => {
                    let policy = value
                        .and_then(crate::node::read_affinity::librbd_policy)
                        .ok_or_else(|| bad(opt, "must be no, balance or localize".into()))?;
                    out.librbd
                        .retain(|(n, _)| n != "rbd_read_from_replica_policy");
                    out.librbd
                        .push(("rbd_read_from_replica_policy".to_owned(), policy.to_owned()));
                }
                "crush_location" => {
                    let loc = crate::node::read_affinity::librbd_crush_location(
                        value.unwrap_or_default(),
                    )
                    .map_err(|why| bad(opt, format!("{why}; give type:name|type:name")))?;
                    out.librbd.retain(|(n, _)| n != "crush_location");
                    out.librbd.push(("crush_location".to_owned(), loc));
                }
                "threads" => {
                    return Err(bad(
                        opt,
                        "the FUSE reader threads serve every volume of the daemon: set them \
                         with the daemon's --threads flag, not per volume"
                            .into(),
                    ))
                }
                _ => {
                    let Some((_, kind)) = LIBRBD_OPTIONS.iter().find(|(n, _)| *n == name) else {
                        let known: Vec<&str> = [
                            "queue_depth",
                            "block_size",
                            "read_only",
                            "read_from_replica",
                            "crush_location",
                        ]
                        .into_iter()
                        .chain(LIBRBD_OPTIONS.iter().map(|(n, _)| *n))
                        .collect();
                        return Err(bad(
                            opt,
                            format!("unknown option; known: {}", known.join(", ")),
                        ));
                    };
                    let Some(v) = value.filter(|v| !v.is_empty()) else {
                        return Err(bad(opt, "needs a value, as name=value".into()));
                    };
                    let ok = match kind {
                        ValueKind::Bool => v == "true" || v == "false",
                        ValueKind::Count => v.parse::<u64>().is_ok(),
                        ValueKind::OneOf(set) => set.contains(&v),
                    };
                    if !ok {
                        let want = match kind {
                            ValueKind::Bool => "true or false".to_owned(),
                            ValueKind::Count => "a whole number".to_owned(),
                            ValueKind::OneOf(set) => set.join(", "),
                        };
                        return Err(bad(opt, format!("the value must be {want}")));
                    }
                    if name == "rbd_cache_policy" && v != "writethrough" {
                        return Err(bad(
                            opt,
                            "refused: a cache that answers writes before RADOS has them \
                             would lose them, unseen by the filesystem, when the mapper's \
                             worker restarts; only writethrough is allowed"
                                .into(),
                        ));
                    }
                    out.librbd.retain(|(n, _)| n != name);
                    out.librbd.push((name.to_owned(), v.to_owned()));
                }
            }
        }
        if out.librbd_is("rbd_disable_zero_copy_writes", "false")
            && out.librbd_is("rbd_cache", "true")
        {
            return Err(bad(
                "rbd_disable_zero_copy_writes=false",
                "refused with rbd_cache=true: librbd's cache would keep the mapper's \
                 buffer and never answer the write"
                    .into(),
            ));
        }
        Ok(out)
    }

    /// Whether librbd setting `name` is given as `value`.
    fn librbd_is(&self, name: &str, value: &str) -> bool {
        self.librbd.iter().any(|(n, v)| n == name && v == value)
    }
}

/// Whether `unmapOptions` for this mapper ask for `force`; anything else is
/// refused with an error naming it.
pub fn parse_unmap_options(options: &[String], volume: &str) -> Result<bool> {
    let mut force = false;
    for o in options {
        match o.trim() {
            "force" => force = true,
            other => {
                return Err(Error::invalid(
                    "unmapOptions",
                    volume,
                    format!("unknown rbdkit-fuse unmap option {other:?}; known: force"),
                ))
            }
        }
    }
    Ok(force)
}

impl From<&MapSpec> for AttachSpec {
    fn from(s: &MapSpec) -> AttachSpec {
        AttachSpec {
            volume_id: s.volume_id.clone(),
            monitors: s.monitors.clone(),
            user: s.user.clone(),
            key: s.key.clone(),
            pool: s.pool.clone(),
            namespace: s.namespace.clone(),
            image: s.image.clone(),
            snapshot: s.snapshot.clone(),
            read_only: s.read_only,
            options: s.options.clone(),
            encryption: s.encryption.clone(),
        }
    }
}

/// One request to the daemon.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlRequest {
    /// Map a volume; returns its device.
    Attach(Box<AttachSpec>),
    /// Unmap a volume (succeeds if it is not mapped).
    Detach {
        /// The volume.
        volume_id: String,
        /// Clear the device even while it is mounted or open.
        #[serde(default)]
        force: bool,
        /// Once the device is cleared and the image closed, release this
        /// node's staging lock of the image ([`crate::node::stage_lock`])
        /// with the attachment's own Ceph client: the credentials it was
        /// staged with, which a restarted node plugin no longer has.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        release_lock_of: Option<String>,
    },
    /// Re-read the image size and grow the device; returns the size.
    Refresh {
        /// The volume.
        volume_id: String,
    },
    /// Every attachment with its health.
    List,
    /// One attachment with its health.
    Status {
        /// The volume.
        volume_id: String,
    },
    /// Is the daemon alive?
    Ping,
}

/// One attachment as `list` and `status` report it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AttachmentStatus {
    /// The volume.
    pub volume_id: String,
    /// `pool[/namespace]/image[@snapshot]`.
    pub image: String,
    /// The loop device, if one is bound.
    pub device: Option<String>,
    /// The FUSE file the device reads and writes.
    pub file: String,
    /// The size in bytes the daemon serves.
    pub size: u64,
    /// Mapped read-only.
    pub read_only: bool,
    /// The loop device does direct I/O on the file (no second page cache).
    pub direct_io: bool,
    /// The librbd settings of its `mapOptions`, as the connection serving
    /// the image reads them back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub librbd: Vec<(String, String)>,
    /// The mapping serves I/O.
    pub healthy: bool,
    /// Why not, when not healthy.
    pub reason: Option<String>,
    /// A mapping from before the daemon restarted that was not taken over:
    /// its device no longer reaches the image, and attaching the volume
    /// again makes a new one. A live mapping that is unhealthy (being taken
    /// over, or failed) is not stale: it is still mapped.
    #[serde(default)]
    pub stale: bool,
}

/// The daemon's answer to one request.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ControlResponse {
    /// The request succeeded.
    pub ok: bool,
    /// Why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The errno behind `error`, if there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errno: Option<i32>,
    /// `attach`: the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// `attach`, `refresh`: the size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// `list`, `status`: the attachments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<AttachmentStatus>,
    /// `ping`: the daemon's pid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// `detach` with `release_lock_of`: whether the lock was released (or
    /// the image is gone). `false` leaves it to the caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_released: Option<bool>,
}

/// The [`Mapper`] of the `rbdkit-fuse` daemon: every call is one request
/// over the daemon's socket, bounded by a timeout.
#[derive(Debug, Clone)]
pub struct FuseMapper {
    /// The daemon's control socket (`--socket`).
    pub socket: PathBuf,
    /// How long [`Mapper::map`] waits for the daemon's answer
    /// ([`ATTACH_TIMEOUT`] by default). An attach given up on may still
    /// complete in the daemon; the caller unmaps it (the daemon's per-volume
    /// lock makes that unmap wait for the attach).
    pub attach_timeout: Duration,
}

impl FuseMapper {
    /// A mapper talking to the daemon at `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> FuseMapper {
        FuseMapper {
            socket: socket.into(),
            attach_timeout: ATTACH_TIMEOUT,
        }
    }

    /// The same, waiting at most `t` for an attach.
    pub fn with_attach_timeout(mut self, t: Duration) -> FuseMapper {
        self.attach_timeout = t;
        self
    }

    /// Sends one request and waits (at most `timeout`) for the answer. A
    /// daemon that does not run fails at once with an error naming the
    /// socket.
    pub fn call(&self, req: &ControlRequest, timeout: Duration) -> Result<ControlResponse> {
        call(&self.socket, req, timeout)
    }

    /// `ping`: the daemon's pid.
    pub fn ping(&self) -> Result<u32> {
        let r = self.call_ok(&ControlRequest::Ping, REQUEST_TIMEOUT)?;
        Ok(r.pid.unwrap_or(0))
    }

    /// `list`: every attachment with its health.
    pub fn list(&self) -> Result<Vec<AttachmentStatus>> {
        Ok(self
            .call_ok(&ControlRequest::List, REQUEST_TIMEOUT)?
            .attachments)
    }

    /// `status`: one attachment, or `None` if the daemon has none for it.
    pub fn status(&self, volume_id: &str) -> Result<Option<AttachmentStatus>> {
        let r = self.call_ok(
            &ControlRequest::Status {
                volume_id: volume_id.to_owned(),
            },
            REQUEST_TIMEOUT,
        )?;
        Ok(r.attachments.into_iter().next())
    }

    fn call_ok(&self, req: &ControlRequest, timeout: Duration) -> Result<ControlResponse> {
        let r = self.call(req, timeout)?;
        if r.ok {
            return Ok(r);
        }
        let errno = r.errno.unwrap_or(libc::EIO);
        Err(Error::with_kind(
            ErrorKind::from_errno(errno),
            errno,
            "rbdkit-fuse",
            self.socket.display().to_string(),
            r.error
                .unwrap_or_else(|| "the daemon refused the request".into()),
        ))
    }
}

fn io_error(e: &std::io::Error, op: &'static str, socket: &Path, what: &str) -> Error {
    let errno = match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        _ => e.raw_os_error().unwrap_or(libc::EIO),
    };
    Error::from_errno(errno, op, socket.display().to_string()).detail(format!("{what}: {e}"))
}

/// One request to the daemon at `socket`.
pub fn call(socket: &Path, req: &ControlRequest, timeout: Duration) -> Result<ControlResponse> {
    let stream = UnixStream::connect(socket).map_err(|e| {
        io_error(
            &e,
            "connect",
            socket,
            "the rbdkit fuse-mapper daemon is not reachable (is it running?)",
        )
    })?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| io_error(&e, "setsockopt", socket, "cannot set timeouts"))?;
    // An attach line holds the key: sized so it never reallocates (which
    // would leave a copy), and zeroed once sent.
    let mut line = Vec::with_capacity(64 << 10);
    serde_json::to_writer(&mut line, req)
        .map_err(|e| Error::invalid("rbdkit-fuse", socket.display().to_string(), e.to_string()))?;
    line.push(b'\n');
    let sent = (&stream).write_all(&line);
    crate::rados::zeroize(&mut line);
    sent.map_err(|e| io_error(&e, "write", socket, "cannot send the request"))?;
    let mut answer = String::new();
    BufReader::new(&stream)
        .read_line(&mut answer)
        .map_err(|e| io_error(&e, "read", socket, "no answer from the daemon"))?;
    if answer.is_empty() {
        return Err(
            Error::from_errno(libc::ECONNRESET, "read", socket.display().to_string())
                .detail("the daemon closed the connection without answering"),
        );
    }
    serde_json::from_str(&answer).map_err(|e| {
        Error::invalid(
            "rbdkit-fuse",
            socket.display().to_string(),
            format!("bad answer from the daemon: {e}"),
        )
    })
}

impl Mapper for FuseMapper {
    fn name(&self) -> &'static str {
        "rbdkit-fuse"
    }

    fn map(&self, spec: &MapSpec) -> Result<PathBuf> {
        // Checked here too, so a bad StorageClass fails before the daemon.
        FuseMapOptions::parse(&spec.options, &spec.volume_id)?;
        let r = self.call_ok(
            &ControlRequest::Attach(Box::new(spec.into())),
            self.attach_timeout,
        )?;
        r.device.map(PathBuf::from).ok_or_else(|| {
            Error::invalid(
                "rbdkit-fuse",
                spec.volume_id.clone(),
                "attach answered no device",
            )
        })
    }

    fn decrypts(&self) -> bool {
        true
    }

    /// The device of a live mapping, healthy or not: a mapping whose image
    /// is being taken over or failed is still mapped (its stage must not
    /// be abandoned as if nothing were, releasing the lock of an image in
    /// use); [`Mapper::check`] says whether it serves I/O.
    fn find(&self, volume_id: &str) -> Result<Option<PathBuf>> {
        Ok(self
            .status(volume_id)?
            .filter(|s| !s.stale)
            .and_then(|s| s.device)
            .map(PathBuf::from))
    }

    fn unmap(&self, volume_id: &str, options: &[String]) -> Result<()> {
        let force = parse_unmap_options(options, volume_id)?;
        self.call_ok(
            &ControlRequest::Detach {
                volume_id: volume_id.to_owned(),
                force,
                release_lock_of: None,
            },
            REQUEST_TIMEOUT,
        )?;
        Ok(())
    }

    fn unmap_releasing(&self, volume_id: &str, options: &[String], node_id: &str) -> Result<bool> {
        let force = parse_unmap_options(options, volume_id)?;
        let r = self.call_ok(
            &ControlRequest::Detach {
                volume_id: volume_id.to_owned(),
                force,
                release_lock_of: Some(node_id.to_owned()),
            },
            REQUEST_TIMEOUT,
        )?;
        Ok(r.lock_released == Some(true))
    }

    fn ready(&self) -> std::result::Result<(), String> {
        self.ping().map(|_| ()).map_err(|e| e.to_string())
    }

    fn refresh_size(&self, volume_id: &str) -> Result<u64> {
        let r = self.call_ok(
            &ControlRequest::Refresh {
                volume_id: volume_id.to_owned(),
            },
            REQUEST_TIMEOUT,
        )?;
        Ok(r.size.unwrap_or(0))
    }

    fn check(&self, volume_id: &str, device: &Path) -> std::result::Result<(), String> {
        match self.status(volume_id) {
            Err(e) => Err(e.to_string()),
            Ok(None) => Err(format!("volume {volume_id} is not mapped by rbdkit-fuse")),
            Ok(Some(s)) if !s.healthy => Err(s
                .reason
                .unwrap_or_else(|| format!("the mapping of {volume_id} is unhealthy"))),
            Ok(Some(s)) if s.device.as_deref() != Some(&*device.to_string_lossy()) => Err(format!(
                "volume {volume_id} is mapped to {}, not {}",
                s.device.as_deref().unwrap_or("no device"),
                device.display()
            )),
            Ok(Some(_)) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_affinity_options_become_librbd_settings() {
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let p = FuseMapOptions::parse(
            &o(&[
                "read_from_replica=localize",
                "crush_location=host:node-7|zone:z1",
                "rbd_cache=false",
            ]),
            "vol",
        )
        .unwrap();
        assert_eq!(
            p.librbd,
            [
                ("rbd_read_from_replica_policy".into(), "localize".into()),
                ("crush_location".into(), "host=node-7 zone=z1".into()),
                ("rbd_cache".into(), "false".into()),
            ]
        );
        let p = FuseMapOptions::parse(&o(&["read_from_replica=no"]), "vol").unwrap();
        assert_eq!(p.librbd[0].1, "default");
        for bad in [
            "read_from_replica",
            "read_from_replica=always",
            "crush_location",
            "crush_location=zone",
            "crush_location=zone:a b",
        ] {
            let e = FuseMapOptions::parse(&o(&[bad]), "vol").unwrap_err();
            assert!(
                e.to_string().contains(bad.split('=').next().unwrap()),
                "{bad}: {e}"
            );
        }
    }
}
