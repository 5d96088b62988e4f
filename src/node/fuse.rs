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

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::node::{MapSpec, Mapper};
use crate::rados::Secret;

/// How long `attach` may take: connecting (30 s bound in the daemon) plus
/// opening the image and binding the device.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(120);
/// How long any other request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

mod secret_serde {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::rados::Secret;

    pub fn serialize<S: Serializer>(s: &Secret, ser: S) -> Result<S::Ok, S::Error> {
        ser.serialize_str(s.expose())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(de: D) -> Result<Secret, D::Error> {
        String::deserialize(de).map(Secret::new)
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
        }
    }
}

/// One request to the daemon.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlRequest {
    /// Map a volume; returns its device.
    Attach(AttachSpec),
    /// Unmap a volume (succeeds if it is not mapped).
    Detach {
        /// The volume.
        volume_id: String,
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
    /// The mapping serves I/O.
    pub healthy: bool,
    /// Why not, when not healthy.
    pub reason: Option<String>,
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
}

/// The [`Mapper`] of the `rbdkit-fuse` daemon: every call is one request
/// over the daemon's socket, bounded by a timeout.
#[derive(Debug, Clone)]
pub struct FuseMapper {
    /// The daemon's control socket (`--socket`).
    pub socket: PathBuf,
}

impl FuseMapper {
    /// A mapper talking to the daemon at `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> FuseMapper {
        FuseMapper {
            socket: socket.into(),
        }
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
    let mut line = serde_json::to_vec(req)
        .map_err(|e| Error::invalid("rbdkit-fuse", socket.display().to_string(), e.to_string()))?;
    line.push(b'\n');
    (&stream)
        .write_all(&line)
        .map_err(|e| io_error(&e, "write", socket, "cannot send the request"))?;
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
        let r = self.call_ok(&ControlRequest::Attach(spec.into()), ATTACH_TIMEOUT)?;
        r.device.map(PathBuf::from).ok_or_else(|| {
            Error::invalid(
                "rbdkit-fuse",
                spec.volume_id.clone(),
                "attach answered no device",
            )
        })
    }

    fn find(&self, volume_id: &str) -> Result<Option<PathBuf>> {
        Ok(self
            .status(volume_id)?
            .filter(|s| s.healthy)
            .and_then(|s| s.device)
            .map(PathBuf::from))
    }

    fn unmap(&self, volume_id: &str, _options: &[String]) -> Result<()> {
        self.call_ok(
            &ControlRequest::Detach {
                volume_id: volume_id.to_owned(),
            },
            REQUEST_TIMEOUT,
        )?;
        Ok(())
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
