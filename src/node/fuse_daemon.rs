//! The `rbdkit fuse-mapper` daemon: serves RBD images as files of a FUSE
//! filesystem it mounts itself, binds a loop device to each file and
//! answers the control protocol of [`crate::node::fuse`].
//!
//! # Data path
//! Each image is one regular file `<state-dir>/mnt/<ino>.<volume>` whose
//! size is the image's. A FUSE READ or WRITE becomes one librbd AIO request
//! ([`Image::aio_read`], [`Image::aio_write`]); the reply is written to
//! `/dev/fuse` by librbd's completion thread itself, in the waker of the
//! request's future (no hop to another thread per request), so as many
//! requests are in flight as the kernel sends (reader threads only parse
//! and submit). Each loop device takes block requests of at most 1 MiB
//! (`max_sectors_kb`), the FUSE `max_write`, so one block request is one
//! FUSE request. FSYNC and FLUSH call [`Image::aio_flush`] and are answered
//! only after librbd flushed, so an `fsync` in a filesystem on the device
//! returns once the data is in RADOS. Discards and write-zeroes from the
//! loop device arrive as FALLOCATE and become `rbd_aio_write_zeroes`.
//!
//! **No double caching**: the loop device is bound with `LO_FLAGS_DIRECT_IO`
//! and every open of the file gets `FOPEN_DIRECT_IO`, so the file has no page
//! cache; the only caches are the filesystem's page cache above the loop
//! device and librbd's own cache. `status` reports
//! `/sys/block/loopN/loop/dio` as `direct_io`. librbd's cache is always
//! write-through here (a write is answered once RADOS has it): with its
//! default, write-around, a write was answered before it was sent, so a
//! worker killed then lost it while the next `fsync`, served by the new
//! worker with nothing to flush, succeeded.
//!
//! # State, crash and restart
//! Two processes (see [`crate::node::fuse_supervisor`]): a supervisor that
//! only holds the `/dev/fuse` fds and the keys and restarts the worker, and
//! the worker (this module) that mounts, serves I/O and answers the control
//! socket. `--no-supervisor` runs the worker alone.
//!
//! The attachments (volume, image, inode, file, device, librados client
//! address; never the key) are kept in `<state-dir>/state.json`, written
//! atomically (temp file, fsync, rename, fsync of the folder). An exclusive
//! `flock` on `<state-dir>/lock` keeps a second worker off the same state
//! (and proves a previous one is dead).
//!
//! What survives, exactly (each point has a test in `tests/node_fuse.rs`):
//! - **The data, always**: everything an `fsync` (or `sync`, or unmount)
//!   returned for was flushed by librbd before the reply, so it is in the
//!   image whatever dies afterwards (`fsynced_file_survives_kill9_of_the_daemon`).
//! - **`kill -9` of the worker: the mapping and the mount above it.** The
//!   supervisor still holds every channel fd, so the kernel's connection,
//!   the FUSE files and the loop devices stay; I/O waits in the kernel. The
//!   new worker takes the fds and keys back, re-opens each image under the
//!   same inode (breaking the dead worker's exclusive lock, below), asks the
//!   kernel to resend what the dead worker had read but not answered
//!   (`FUSE_NOTIFY_RESEND`, when INIT reported `FUSE_HAS_RESEND`), and only
//!   then reads requests. Writes and fsyncs running in a mounted ext4 across
//!   the kill complete without error, on the same device
//!   (`mounted_filesystem_survives_kill9_of_the_worker`). A resent write may
//!   reach the image twice, with the same data at the same offset. The
//!   control socket is down for the restart (about 100 ms): calls fail fast.
//! - **`kill -9` of the supervisor (or of the whole container): not the
//!   mapping.** The worker dies with it (`PR_SET_PDEATHSIG`), the FUSE
//!   connection with them, so the loop device and a filesystem on it get
//!   `EIO`/`ENOTCONN` from then on; dirty data still in that filesystem's
//!   page cache (never fsynced) is lost. A restarted daemon finds every loop
//!   device whose backing file is under its mount folder (recorded in the
//!   state or not yet) and clears it with `LOOP_CLR_FD`. A device still
//!   open or mounted is not torn down under its user: the kernel only marks
//!   it to be cleared on its last close. Then the dead FUSE mount is
//!   detached lazily and a fresh one made. Volumes of the state are reported
//!   by `status` as unhealthy ("the daemon restarted") until `attach` maps
//!   them again on a new device; `detach` forgets them. That is safe even
//!   while the old device is still mounted: it can never reach the image
//!   again (`restart_with_the_old_filesystem_still_mounted`).
//! - **An attach killed after binding its device, before saving its
//!   record** (so before it answered): the next worker clears that device
//!   and never reuses its inode number
//!   (`worker_restart_clears_a_device_whose_attach_did_not_finish`).
//! - **The exclusive lock**: a dead worker still owns the image's exclusive
//!   lock, and librbd would wait ~30 s for its watch to expire. The state
//!   records each attachment's librados client address; on re-open the
//!   worker breaks the lock if that exact client owns it (the flock proves
//!   that process is dead; librbd blocklists it).
//!
//! - **A clean stop** (SIGTERM to the supervisor, forwarded to the worker)
//!   flushes every image, clears the loop devices, unmounts and exits 0:
//!   mappings end (`clean_stop_flushes_and_clears_everything`).
//! - **Stale watches** (`--blocklist-dead-clients`, off by default). A dead
//!   worker's librados client keeps its watch on each image header it had
//!   open until the OSDs time it out (`osd_client_watch_timeout`, 30 s):
//!   meanwhile the image shows a watcher, so a single-writer check sees a
//!   user and `rbd rm` (DeleteVolume) fails with `EBUSY`. No other client
//!   can unwatch it (a watch belongs to its client instance); the only way
//!   to end it early is to blocklist that instance, which makes each OSD
//!   drop its watches on the next map. That is safe here: the state
//!   records each mapping's client address (`ip:port/nonce`; the nonce is
//!   unique per client instance, so no live client shares it), and the
//!   flock proves the process that owned it is gone. With the flag, the
//!   restarted worker blocklists the recorded addresses (no expiry given:
//!   the cluster's default, as librbd's own lock breaks) at its first
//!   connect to their cluster: at once after a worker restart (the
//!   supervisor kept the keys), or at the first `attach` with a key for
//!   that cluster after the whole daemon died (no key survives that: until
//!   then there is no connection to do it with)
//!   (`blocklisting_ends_the_dead_clients_watches_at_once`). Why it is
//!   opt-in: it needs a mon cap for `osd blocklist` (ceph-csi's node user
//!   has `mon 'profile rbd'`, which grants it, as librbd needs it to break
//!   a dead owner's exclusive lock; a user with only `mon 'allow r'` gets
//!   `EACCES`, logged, and the watch then times out as before), and each
//!   entry is a change to the cluster's OSD map, which an operator should
//!   choose. Without it, the CSI node service tells its own mapper's dead
//!   watchers apart by the addresses it records per volume.
//!
//! Keys live only in memory: in the librados connections of the worker
//! (one per monitors + user) and in the supervisor's store. After the
//! supervisor is gone too, `attach` brings them again.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::node::fuse::{
    AttachSpec, AttachmentStatus, ControlRequest, ControlResponse, FuseMapOptions,
};
use crate::node::fuse_kernel::{self as fk, op, InHeader, Reply};
use crate::node::fuse_supervisor::StoreClient;
use crate::node::loopdev;
use crate::rados::{Cluster, ConnectOptions};
use crate::rbd::Image;

/// Arguments of `rbdkit fuse-mapper`.
#[derive(Debug, Clone, clap::Args)]
pub struct FuseMapperArgs {
    /// The control socket (created mode 0600).
    #[arg(long, default_value = "/run/rbdkit/mapper.sock")]
    pub socket: PathBuf,
    /// Where the state file and the FUSE mount live.
    #[arg(long = "state-dir", default_value = "/var/lib/rbdkit/fuse")]
    pub state_dir: PathBuf,
    /// FUSE reader threads (each on its own cloned /dev/fuse fd).
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// Threads of the async runtime (signals, the clean stop). Replies to
    /// the kernel are written by librbd's completion thread.
    #[arg(long = "io-threads", default_value_t = 2)]
    pub io_threads: usize,
    /// Bound on connecting to a cluster and on each cluster operation.
    #[arg(long = "timeout", default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// After a restart, blocklist the previous instance's librados clients
    /// (`rados_blocklist_add`, as `osd blocklist add`) at the first connect
    /// to their cluster, so their watches end at once rather than after
    /// `osd_client_watch_timeout` (30 s). Needs mon caps for `osd
    /// blocklist` (`profile rbd` has them). See the module docs.
    #[arg(long = "blocklist-dead-clients")]
    pub blocklist_dead_clients: bool,
    /// Run the worker alone, without the supervisor that keeps the FUSE
    /// connection alive across worker restarts.
    #[arg(long = "no-supervisor")]
    pub no_supervisor: bool,
    /// Internal: run as the worker of a supervisor.
    #[arg(long, hide = true)]
    pub worker: bool,
}

const ROOT_INO: u64 = 1;
/// How long detach waits for the kernel to let go of the file.
const UNBIND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long detach waits for in-flight requests before closing the image.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// One attachment as recorded in the state file (no key).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    volume_id: String,
    monitors: Vec<String>,
    user: String,
    pool: String,
    namespace: String,
    image: String,
    snapshot: Option<String>,
    read_only: bool,
    ino: u64,
    file: String,
    device: Option<String>,
    size: u64,
    /// The librados client address that opened the image (its lock owner).
    #[serde(default)]
    client_addr: Option<String>,
    /// The mapOptions it was attached with.
    #[serde(default)]
    options: FuseMapOptions,
}

impl Record {
    fn image_spec(&self) -> String {
        let mut s = self.pool.clone();
        if !self.namespace.is_empty() {
            s.push('/');
            s.push_str(&self.namespace);
        }
        s.push('/');
        s.push_str(&self.image);
        if let Some(snap) = &self.snapshot {
            s.push('@');
            s.push_str(snap);
        }
        s
    }

    fn same_image(&self, spec: &AttachSpec, opts: &FuseMapOptions) -> bool {
        self.pool == spec.pool
            && self.namespace == spec.namespace
            && self.image == spec.image
            && self.snapshot == spec.snapshot
            && self.read_only == (spec.read_only || spec.snapshot.is_some() || opts.read_only)
            && &self.options == opts
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StateFile {
    next_ino: u64,
    attachments: Vec<Record>,
}

/// One file of the filesystem.
struct Node {
    ino: u64,
    name: String,
    image: Arc<Image>,
    size: AtomicU64,
    read_only: bool,
}

/// The FUSE filesystem: a root folder of image files.
struct Fs {
    nodes: RwLock<BTreeMap<u64, Arc<Node>>>,
    alive: AtomicBool,
}

fn dir_attr() -> fk::Attr {
    fk::Attr {
        ino: ROOT_INO,
        mode: libc::S_IFDIR | 0o755,
        nlink: 2,
        blksize: 4096,
        ..Default::default()
    }
}

impl Node {
    fn attr(&self) -> fk::Attr {
        let size = self.size.load(Ordering::SeqCst);
        fk::Attr {
            ino: self.ino,
            size,
            blocks: size.div_ceil(512),
            mode: libc::S_IFREG | if self.read_only { 0o400 } else { 0o600 },
            nlink: 1,
            blksize: 4096,
            ..Default::default()
        }
    }
}

fn cstr_arg(body: &[u8]) -> &[u8] {
    let end = body.iter().position(|&b| b == 0).unwrap_or(body.len());
    &body[..end]
}

impl Fs {
    fn node(&self, ino: u64) -> Option<Arc<Node>> {
        self.nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&ino)
            .cloned()
    }

    fn attr_out(attr: fk::Attr) -> fk::AttrOut {
        // attr_valid 0: every stat asks us, so a grown image is seen at once.
        fk::AttrOut {
            attr,
            ..Default::default()
        }
    }

    /// Answers with `fut`'s result when it completes: the thread that
    /// wakes it (librbd's completion thread) polls it and writes the reply,
    /// saving a hop to a runtime thread per request (measured: about 20 µs
    /// of CPU per 4 KiB request on 2 cores).
    fn complete<F>(&self, reply: Reply, fut: F)
    where
        F: std::future::Future<Output = std::result::Result<Vec<u8>, i32>> + Send + 'static,
    {
        InlineTask::start(reply, fut);
    }
}

type ReplyFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = std::result::Result<Vec<u8>, i32>> + Send>>;

/// A future polled by whoever wakes it: first the reader thread that
/// submitted the request, then librbd's completion callback. The futures
/// here are librbd requests, whose wake comes once, after the result is
/// stored, so the poll in the waker only takes the result and sends the
/// reply (one `writev` to `/dev/fuse`, which does not block).
struct InlineTask {
    state: Mutex<Option<(ReplyFuture, Reply)>>,
}

impl InlineTask {
    fn start<F>(reply: Reply, fut: F)
    where
        F: std::future::Future<Output = std::result::Result<Vec<u8>, i32>> + Send + 'static,
    {
        let task = Arc::new(InlineTask {
            state: Mutex::new(Some((Box::pin(fut), reply))),
        });
        task.poll();
    }

    fn poll(self: &Arc<Self>) {
        let waker = std::task::Waker::from(Arc::clone(self));
        let mut cx = std::task::Context::from_waker(&waker);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some((fut, _)) = state.as_mut() else {
            return;
        };
        let std::task::Poll::Ready(out) = fut.as_mut().poll(&mut cx) else {
            return;
        };
        let (_, reply) = state.take().expect("checked above");
        drop(state);
        match out {
            Ok(data) => reply.ok(&data),
            Err(errno) => reply.error(errno),
        }
    }
}

impl std::task::Wake for InlineTask {
    fn wake(self: Arc<Self>) {
        self.poll();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.poll();
    }
}

fn errno_of(e: &Error) -> i32 {
    match e.errno() {
        0 => libc::EIO,
        n => n,
    }
}

impl fk::Handler for Fs {
    fn request(&self, hdr: &InHeader, body: &[u8], reply: Option<Reply>) {
        let Some(reply) = reply else { return };
        let ino = hdr.nodeid;
        match hdr.opcode {
            op::LOOKUP => {
                if ino != ROOT_INO {
                    return reply.error(libc::ENOENT);
                }
                let name = cstr_arg(body);
                let found = self
                    .nodes
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .values()
                    .find(|n| n.name.as_bytes() == name)
                    .cloned();
                match found {
                    Some(n) => {
                        let e = fk::EntryOut {
                            nodeid: n.ino,
                            generation: 1,
                            attr: n.attr(),
                            ..Default::default()
                        };
                        reply.ok(fk::pod_bytes(&e))
                    }
                    None => reply.error(libc::ENOENT),
                }
            }
            op::GETATTR | op::SETATTR => {
                if ino == ROOT_INO {
                    return reply.ok(fk::pod_bytes(&Fs::attr_out(dir_attr())));
                }
                let Some(n) = self.node(ino) else {
                    return reply.error(libc::ENOENT);
                };
                if hdr.opcode == op::SETATTR {
                    let Some(s) = fk::read_pod::<fk::SetattrIn>(body) else {
                        return reply.error(libc::EINVAL);
                    };
                    // The size is the image's; only the controller changes it.
                    if s.valid & fk::FATTR_SIZE != 0 && s.size != n.size.load(Ordering::SeqCst) {
                        return reply.error(libc::EPERM);
                    }
                }
                reply.ok(fk::pod_bytes(&Fs::attr_out(n.attr())))
            }
            op::OPEN => {
                let Some(n) = self.node(ino) else {
                    return reply.error(libc::ENOENT);
                };
                let flags = fk::read_pod::<fk::OpenIn>(body).map_or(0, |o| o.flags as i32);
                if n.read_only && flags & libc::O_ACCMODE != libc::O_RDONLY {
                    return reply.error(libc::EROFS);
                }
                let out = fk::OpenOut {
                    fh: n.ino,
                    open_flags: fk::FOPEN_DIRECT_IO | fk::FOPEN_PARALLEL_DIRECT_WRITES,
                    padding: 0,
                };
                reply.ok(fk::pod_bytes(&out))
            }
            op::READ => {
                let (Some(n), Some(r)) = (self.node(ino), fk::read_pod::<fk::ReadIn>(body)) else {
                    return reply.error(libc::EBADF);
                };
                let size = n.size.load(Ordering::SeqCst);
                if r.offset >= size {
                    return reply.ok(&[]);
                }
                let len = (r.size as u64).min(size - r.offset) as usize;
                let fut = n.image.aio_read(r.offset, len);
                self.complete(reply, async move { fut.await.map_err(|e| errno_of(&e)) });
            }
            op::WRITE => {
                let (Some(n), Some(w)) = (self.node(ino), fk::read_pod::<fk::WriteIn>(body)) else {
                    return reply.error(libc::EBADF);
                };
                if n.read_only {
                    return reply.error(libc::EROFS);
                }
                let start = std::mem::size_of::<fk::WriteIn>();
                let Some(data) = body.get(start..start + w.size as usize) else {
                    return reply.error(libc::EINVAL);
                };
                if w.offset.saturating_add(w.size as u64) > n.size.load(Ordering::SeqCst) {
                    return reply.error(libc::ENOSPC);
                }
                let fut = n.image.aio_write(w.offset, data.to_vec());
                let written = w.size;
                self.complete(reply, async move {
                    fut.await.map_err(|e| errno_of(&e))?;
                    let out = fk::WriteOut {
                        size: written,
                        padding: 0,
                    };
                    Ok(fk::pod_bytes(&out).to_vec())
                });
            }
            op::FSYNC | op::FLUSH => {
                let Some(n) = self.node(ino) else {
                    return reply.error(libc::EBADF);
                };
                if n.read_only {
                    return reply.ok(&[]);
                }
                let fut = n.image.aio_flush();
                self.complete(reply, async move {
                    fut.await.map_err(|e| errno_of(&e))?;
                    Ok(Vec::new())
                });
            }
            op::FALLOCATE => {
                let (Some(n), Some(f)) = (self.node(ino), fk::read_pod::<fk::FallocateIn>(body))
                else {
                    return reply.error(libc::EBADF);
                };
                if n.read_only {
                    return reply.error(libc::EROFS);
                }
                let size = n.size.load(Ordering::SeqCst);
                let zero = libc::FALLOC_FL_PUNCH_HOLE as u32 | libc::FALLOC_FL_ZERO_RANGE as u32;
                let known = zero | libc::FALLOC_FL_KEEP_SIZE as u32;
                if f.mode & !known != 0 {
                    return reply.error(libc::EOPNOTSUPP);
                }
                let end = f.offset.saturating_add(f.length);
                if f.mode & zero == 0 {
                    // Plain allocation: the image is already that big.
                    return if end <= size {
                        reply.ok(&[])
                    } else {
                        reply.error(libc::EOPNOTSUPP)
                    };
                }
                if f.offset >= size {
                    return reply.ok(&[]);
                }
                let len = end.min(size) - f.offset;
                // write_zeroes, not discard: a punched hole must read back
                // as zeroes, which a partial-object discard does not promise.
                let fut = n.image.aio_write_zeroes(f.offset, len as usize);
                self.complete(reply, async move {
                    fut.await.map_err(|e| errno_of(&e))?;
                    Ok(Vec::new())
                });
            }
            op::RELEASE | op::RELEASEDIR | op::FSYNCDIR | op::DESTROY => reply.ok(&[]),
            op::OPENDIR => {
                if ino != ROOT_INO {
                    return reply.error(libc::ENOTDIR);
                }
                reply.ok(fk::pod_bytes(&fk::OpenOut::default()))
            }
            op::READDIR => {
                let Some(r) = fk::read_pod::<fk::ReadIn>(body) else {
                    return reply.error(libc::EINVAL);
                };
                let mut entries: Vec<(u64, u32, Vec<u8>)> = vec![
                    (ROOT_INO, libc::DT_DIR as u32, b".".to_vec()),
                    (ROOT_INO, libc::DT_DIR as u32, b"..".to_vec()),
                ];
                for n in self
                    .nodes
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .values()
                {
                    entries.push((n.ino, libc::DT_REG as u32, n.name.as_bytes().to_vec()));
                }
                let mut out = Vec::new();
                for (i, (eino, typ, name)) in entries.iter().enumerate().skip(r.offset as usize) {
                    if !fk::push_dirent(&mut out, r.size as usize, *eino, i as u64 + 1, *typ, name)
                    {
                        break;
                    }
                }
                reply.ok(&out)
            }
            op::STATFS => {
                let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
                let bytes: u64 = nodes.values().map(|n| n.size.load(Ordering::SeqCst)).sum();
                let out = fk::StatfsOut {
                    blocks: bytes / 4096,
                    files: nodes.len() as u64 + 1,
                    bsize: 4096,
                    frsize: 4096,
                    namelen: 255,
                    ..Default::default()
                };
                reply.ok(fk::pod_bytes(&out))
            }
            _ => reply.error(libc::ENOSYS),
        }
    }
}

/// A live attachment.
struct Live {
    rec: Record,
    node: Arc<Node>,
    conn_key: ConnKey,
}

/// One librados connection per monitors, user and librbd settings.
type ConnKey = (String, String, Vec<(String, String)>);

#[derive(Default)]
struct Table {
    live: BTreeMap<String, Live>,
    /// Recorded before a restart, device dead, not yet attached again.
    stale: BTreeMap<String, Record>,
    next_ino: u64,
}

struct Daemon {
    state_dir: PathBuf,
    mnt: PathBuf,
    fs: Arc<Fs>,
    table: Mutex<Table>,
    /// Serialises attach, detach and refresh.
    ops: Mutex<()>,
    conns: Mutex<HashMap<ConnKey, Cluster>>,
    timeout: Duration,
    /// The supervisor that keeps fds and keys, if we run under one.
    store: Option<StoreClient>,
    /// `--blocklist-dead-clients`: the previous instance's client
    /// addresses still to blocklist, with their monitors.
    dead_clients: Mutex<Vec<(String, String)>>,
}

fn io_err(e: std::io::Error, op: &'static str, object: &Path) -> Error {
    Error::from_errno(
        e.raw_os_error().unwrap_or(libc::EIO),
        op,
        object.display().to_string(),
    )
}

/// Writes `data` to `path` atomically: a temp file, fsync, rename, fsync of
/// the folder.
fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| io_err(e, "open", &tmp))?;
    f.write_all(data)
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err(e, "write", &tmp))?;
    std::fs::rename(&tmp, path).map_err(|e| io_err(e, "rename", path))?;
    if let Some(dir) = path.parent() {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_err(e, "fsync", dir))?;
    }
    Ok(())
}

fn file_name(ino: u64, volume_id: &str) -> String {
    let clean: String = volume_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(200)
        .collect();
    format!("{ino}.{clean}")
}

impl Daemon {
    fn state_path(&self) -> PathBuf {
        self.state_dir.join("state.json")
    }

    fn save(&self, table: &Table) -> Result<()> {
        let mut attachments: Vec<Record> = table.live.values().map(|l| l.rec.clone()).collect();
        attachments.extend(table.stale.values().cloned());
        let state = StateFile {
            next_ino: table.next_ino,
            attachments,
        };
        let data = serde_json::to_vec_pretty(&state).expect("state serialises");
        write_atomic(&self.state_path(), &data)
    }

    fn lock_table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn connect(&self, spec: &AttachSpec, opts: &FuseMapOptions) -> Result<(ConnKey, Cluster)> {
        let key = (
            spec.monitors.join(","),
            spec.user.clone(),
            opts.librbd.clone(),
        );
        if let Some(c) = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            let c = c.clone();
            self.end_dead_clients(&key.0, &c);
            return Ok((key, c));
        }
        if spec.monitors.is_empty() {
            return Err(Error::invalid(
                "attach",
                &spec.volume_id,
                "no monitors given",
            ));
        }
        let mut options = ConnectOptions::new()
            .mon_host(key.0.clone())
            .user(spec.user.clone())
            .key(spec.key.clone())
            .connect_timeout(self.timeout)
            .op_timeout(self.timeout);
        for (k, v) in &opts.librbd {
            options = options.set(k.clone(), v.clone());
        }
        // Last, so that nothing (an option recorded by an older version
        // either) turns it off: see `require_write_through`.
        let cluster = options.set("rbd_cache_policy", "writethrough").connect()?;
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone(), cluster.clone());
        self.end_dead_clients(&key.0, &cluster);
        Ok((key, cluster))
    }

    /// With `--blocklist-dead-clients`: blocklists the previous instance's
    /// clients on the cluster at `monitors`, once each. They are dead (we
    /// hold the state dir's flock) and their nonces are never reused, so
    /// no live client can be hit; their watches and locks end with them.
    fn end_dead_clients(&self, monitors: &str, cluster: &Cluster) {
        let todo: Vec<String> = {
            let mut dead = self.dead_clients.lock().unwrap_or_else(|e| e.into_inner());
            let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut *dead)
                .into_iter()
                .partition(|(m, _)| m == monitors);
            *dead = rest;
            mine.into_iter().map(|(_, a)| a).collect()
        };
        for addr in todo {
            match cluster.blocklist_add(&addr, 0) {
                Ok(()) => tracing::info!(client = %addr,
                    "blocklisted the previous instance's client: its watches end now"),
                Err(e) => tracing::warn!(client = %addr, error = %e,
                    "cannot blocklist the previous instance's client (mon caps?); its watches \
                     end when the OSDs time them out"),
            }
        }
    }

    fn drop_conn_if_unused(&self, key: &ConnKey) {
        let used = self.lock_table().live.values().any(|l| &l.conn_key == key);
        if !used {
            self.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(key);
        }
    }

    fn status_of_live(&self, l: &Live) -> AttachmentStatus {
        let file = self.mnt.join(&l.rec.file);
        let device = l.rec.device.clone();
        let mut reason = None;
        let mut direct_io = false;
        if !self.fs.alive.load(Ordering::SeqCst) {
            reason = Some(format!(
                "the FUSE filesystem at {} is no longer served (unmounted?)",
                self.mnt.display()
            ));
        }
        match &device {
            None => reason = reason.or(Some("no loop device is bound".into())),
            Some(d) => {
                let d = Path::new(d);
                direct_io = loopdev::direct_io(d);
                if loopdev::backing_file(d).as_deref() != Some(file.as_path()) {
                    reason = reason.or(Some(format!(
                        "{} is no longer bound to {}",
                        d.display(),
                        file.display()
                    )));
                }
            }
        }
        let librbd = match self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&l.conn_key)
        {
            Some(c) => l
                .rec
                .options
                .librbd
                .iter()
                .map(|(k, _)| (k.clone(), c.conf_get(k).unwrap_or_default()))
                .collect(),
            None => Vec::new(),
        };
        AttachmentStatus {
            volume_id: l.rec.volume_id.clone(),
            image: l.rec.image_spec(),
            device,
            librbd,
            file: file.display().to_string(),
            size: l.node.size.load(Ordering::SeqCst),
            read_only: l.rec.read_only,
            direct_io,
            healthy: reason.is_none(),
            reason,
        }
    }

    fn status_of_stale(&self, r: &Record) -> AttachmentStatus {
        AttachmentStatus {
            volume_id: r.volume_id.clone(),
            image: r.image_spec(),
            device: r.device.clone(),
            file: self.mnt.join(&r.file).display().to_string(),
            size: r.size,
            read_only: r.read_only,
            direct_io: false,
            librbd: Vec::new(),
            healthy: false,
            reason: Some(format!(
                "the rbdkit-fuse daemon restarted since {} was mapped on {}: that device no longer \
                 reaches the image (I/O fails); attach the volume again",
                r.volume_id,
                r.device.as_deref().unwrap_or("a device")
            )),
        }
    }

    /// Re-opens the image of a mapping the previous worker served (same
    /// inode, file and device), after breaking that worker's lock.
    fn reopen(&self, rec: &Record, key: &crate::rados::Secret) -> Result<Live> {
        let spec = AttachSpec {
            volume_id: rec.volume_id.clone(),
            monitors: rec.monitors.clone(),
            user: rec.user.clone(),
            key: key.clone(),
            pool: rec.pool.clone(),
            namespace: rec.namespace.clone(),
            image: rec.image.clone(),
            snapshot: rec.snapshot.clone(),
            read_only: rec.read_only,
            options: Vec::new(),
        };
        let (conn_key, cluster) = self.connect(&spec, &rec.options)?;
        let ioctx = cluster.ioctx_ns(&rec.pool, &rec.namespace)?;
        let image = match (&rec.snapshot, rec.read_only) {
            (Some(snap), _) => Image::open_snapshot(&ioctx, &rec.image, snap)?,
            (None, true) => Image::open_read_only(&ioctx, &rec.image)?,
            (None, false) => Image::open(&ioctx, &rec.image)?,
        };
        if !rec.read_only {
            // Refusing here would leave the mounted filesystem's I/O waiting
            // for good; an override made since the attach is only reported.
            if let Err(e) = require_write_through(&image, &rec.volume_id) {
                tracing::error!(volume = %rec.volume_id, error = %e, "serving it anyway");
            }
            break_dead_lock(&image, rec);
        }
        let size = image.size()?;
        let mut rec = rec.clone();
        rec.size = size;
        rec.client_addr = cluster.addrs().ok();
        let node = Arc::new(Node {
            ino: rec.ino,
            name: rec.file.clone(),
            image: Arc::new(image),
            size: AtomicU64::new(size),
            read_only: rec.read_only,
        });
        Ok(Live {
            rec,
            node,
            conn_key,
        })
    }

    fn attach(&self, spec: AttachSpec) -> Result<ControlResponse> {
        let _ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let vol = spec.volume_id.clone();
        if vol.is_empty() {
            return Err(Error::invalid("attach", "", "empty volume id"));
        }
        let opts = FuseMapOptions::parse(&spec.options, &vol)?;
        let existing = self
            .lock_table()
            .live
            .get(&vol)
            .map(|l| (l.rec.clone(), Arc::clone(&l.node)));
        if let Some((rec, node)) = existing {
            if !rec.same_image(&spec, &opts) {
                return Err(Error::with_kind(
                    ErrorKind::AlreadyExists,
                    libc::EEXIST,
                    "attach",
                    vol,
                    format!(
                        "already attached to {} (read_only={}, options {:?}); detach it first",
                        rec.image_spec(),
                        rec.read_only,
                        rec.options
                    ),
                ));
            }
            let file = self.mnt.join(&rec.file);
            if let Some(dev) = &rec.device {
                if loopdev::backing_file(Path::new(dev)).as_deref() == Some(file.as_path()) {
                    return Ok(ControlResponse {
                        ok: true,
                        device: Some(dev.clone()),
                        size: Some(node.size.load(Ordering::SeqCst)),
                        ..Default::default()
                    });
                }
            }
            // The image is open but its device went away: bind a new one.
            let dev = self.bind(&file, rec.read_only, &rec.options)?;
            let mut t = self.lock_table();
            if let Some(l) = t.live.get_mut(&vol) {
                l.rec.device = Some(dev.display().to_string());
            }
            self.save(&t)?;
            return Ok(ControlResponse {
                ok: true,
                device: Some(dev.display().to_string()),
                size: Some(node.size.load(Ordering::SeqCst)),
                ..Default::default()
            });
        }

        let read_only = spec.read_only || spec.snapshot.is_some() || opts.read_only;
        let before_restart = self.lock_table().stale.get(&vol).cloned();
        let (conn_key, cluster) = self.connect(&spec, &opts)?;
        let opened = (|| {
            let ioctx = cluster.ioctx_ns(&spec.pool, &spec.namespace)?;
            let image = match (&spec.snapshot, read_only) {
                (Some(snap), _) => Image::open_snapshot(&ioctx, &spec.image, snap)?,
                (None, true) => Image::open_read_only(&ioctx, &spec.image)?,
                (None, false) => Image::open(&ioctx, &spec.image)?,
            };
            if !read_only {
                require_write_through(&image, &vol)?;
            }
            if let Some(old) = before_restart.as_ref().filter(|_| !read_only) {
                break_dead_lock(&image, old);
            }
            let size = image.size()?;
            Ok::<_, Error>((image, size))
        })();
        let opened = opened.and_then(|v| match &self.store {
            Some(store) => store.put_key(&vol, &spec.key).map(|()| v),
            None => Ok(v),
        });
        let (image, size) = match opened {
            Ok(v) => v,
            Err(e) => {
                self.drop_conn_if_unused(&conn_key);
                return Err(e);
            }
        };
        let ino = {
            let mut t = self.lock_table();
            t.next_ino = t.next_ino.max(ROOT_INO + 1);
            let ino = t.next_ino;
            t.next_ino += 1;
            ino
        };
        let name = file_name(ino, &vol);
        let node = Arc::new(Node {
            ino,
            name: name.clone(),
            image: Arc::new(image),
            size: AtomicU64::new(size),
            read_only,
        });
        self.fs
            .nodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ino, Arc::clone(&node));
        let file = self.mnt.join(&name);
        let dev = match self.bind(&file, read_only, &opts) {
            Ok(d) => d,
            Err(e) => {
                self.fs
                    .nodes
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&ino);
                close_node(node);
                self.drop_conn_if_unused(&conn_key);
                return Err(e);
            }
        };
        let rec = Record {
            volume_id: vol.clone(),
            monitors: spec.monitors.clone(),
            user: spec.user.clone(),
            pool: spec.pool.clone(),
            namespace: spec.namespace.clone(),
            image: spec.image.clone(),
            snapshot: spec.snapshot.clone(),
            read_only,
            ino,
            file: name,
            device: Some(dev.display().to_string()),
            size,
            client_addr: cluster.addrs().ok(),
            options: opts,
        };
        tracing::info!(volume = %vol, image = %rec.image_spec(), device = %dev.display(), size, "attached");
        let mut t = self.lock_table();
        t.stale.remove(&vol);
        t.live.insert(
            vol,
            Live {
                rec,
                node,
                conn_key,
            },
        );
        self.save(&t)?;
        Ok(ControlResponse {
            ok: true,
            device: Some(dev.display().to_string()),
            size: Some(size),
            ..Default::default()
        })
    }

    /// Opens the FUSE file and binds a loop device to it, set up as `opts`
    /// ask.
    fn bind(&self, file: &Path, read_only: bool, opts: &FuseMapOptions) -> Result<PathBuf> {
        let f = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(file)
            .map_err(|e| io_err(e, "open", file))?;
        let dev = loopdev::attach(
            &f,
            file,
            loopdev::LoopOptions {
                read_only,
                direct_io: true,
                block_size: opts.block_size.unwrap_or(4096),
            },
        )?;
        if let Err(e) = tune_device(&dev, opts) {
            let _ = loopdev::detach(&dev);
            return Err(e);
        }
        if !loopdev::direct_io(&dev) {
            tracing::warn!(device = %dev.display(), "loop device does not do direct I/O on the FUSE file");
        }
        Ok(dev)
    }

    fn detach(&self, vol: &str, force: bool) -> Result<ControlResponse> {
        let _ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let (live, stale) = {
            let t = self.lock_table();
            (
                t.live.get(vol).map(|l| (l.rec.clone(), l.conn_key.clone())),
                t.stale.get(vol).cloned(),
            )
        };
        if let Some((rec, conn_key)) = live {
            let file = self.mnt.join(&rec.file);
            if let Some(dev) = &rec.device {
                let dev = Path::new(dev);
                if loopdev::backing_file(dev).as_deref() == Some(file.as_path()) {
                    let busy = loopdev::in_use(dev);
                    if busy && !force {
                        return Err(Error::with_kind(
                            ErrorKind::Busy,
                            libc::EBUSY,
                            "detach",
                            vol.to_owned(),
                            format!(
                                "{} is mounted or held open; unmount it first",
                                dev.display()
                            ),
                        ));
                    }
                    loopdev::detach(dev)?;
                    if busy {
                        // Marked to unbind on its last close; from now on
                        // its I/O fails (the file goes below).
                        tracing::warn!(volume = %vol, device = %dev.display(),
                            "force: cleared a device that is still mounted or open");
                    } else {
                        wait_unbound(dev, &file)?;
                    }
                }
            }
            let l = {
                let mut t = self.lock_table();
                let l = t.live.remove(vol);
                self.save(&t)?;
                l
            };
            if let Some(l) = l {
                self.fs
                    .nodes
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&l.node.ino);
                close_node(l.node);
            }
            self.drop_conn_if_unused(&conn_key);
            if let Some(store) = &self.store {
                store.drop_key(vol)?;
            }
            tracing::info!(volume = %vol, "detached");
        } else if let Some(rec) = stale {
            // Its device was cleared at start-up; forget it.
            let mut t = self.lock_table();
            t.stale.remove(vol);
            self.save(&t)?;
            if let Some(store) = &self.store {
                store.drop_key(vol)?;
            }
            tracing::info!(volume = %vol, device = ?rec.device, "forgot a mapping from before the restart");
        }
        Ok(ControlResponse {
            ok: true,
            ..Default::default()
        })
    }

    fn refresh(&self, vol: &str) -> Result<ControlResponse> {
        let _ops = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let (rec, node) = {
            let t = self.lock_table();
            match t.live.get(vol) {
                Some(l) => (l.rec.clone(), Arc::clone(&l.node)),
                None => {
                    return Err(Error::with_kind(
                        ErrorKind::NotFound,
                        libc::ENOENT,
                        "refresh",
                        vol.to_owned(),
                        "not attached (attach it first)",
                    ))
                }
            }
        };
        // rbd_get_size refreshes the header when the image changed.
        let size = node.image.size()?;
        node.size.store(size, Ordering::SeqCst);
        let file = self.mnt.join(&rec.file);
        // attr_valid is 0, so a stat makes the kernel fetch the new size.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let seen = std::fs::metadata(&file)
                .map_err(|e| io_err(e, "stat", &file))?
                .len();
            if seen == size {
                break;
            }
            if Instant::now() > deadline {
                return Err(
                    Error::from_errno(libc::EIO, "stat", file.display().to_string())
                        .detail(format!("the kernel still sees {seen} bytes, not {size}")),
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(dev) = &rec.device {
            loopdev::set_capacity(Path::new(dev))?;
        }
        let mut t = self.lock_table();
        if let Some(l) = t.live.get_mut(vol) {
            l.rec.size = size;
        }
        self.save(&t)?;
        tracing::info!(volume = %vol, size, "refreshed");
        Ok(ControlResponse {
            ok: true,
            size: Some(size),
            ..Default::default()
        })
    }

    fn handle(&self, req: ControlRequest) -> Result<ControlResponse> {
        match req {
            ControlRequest::Attach(spec) => self.attach(spec),
            ControlRequest::Detach { volume_id, force } => self.detach(&volume_id, force),
            ControlRequest::Refresh { volume_id } => self.refresh(&volume_id),
            ControlRequest::List => {
                let t = self.lock_table();
                let mut attachments: Vec<_> =
                    t.live.values().map(|l| self.status_of_live(l)).collect();
                attachments.extend(t.stale.values().map(|r| self.status_of_stale(r)));
                Ok(ControlResponse {
                    ok: true,
                    attachments,
                    ..Default::default()
                })
            }
            ControlRequest::Status { volume_id } => {
                let t = self.lock_table();
                let s = match (t.live.get(&volume_id), t.stale.get(&volume_id)) {
                    (Some(l), _) => Some(self.status_of_live(l)),
                    (None, Some(r)) => Some(self.status_of_stale(r)),
                    (None, None) => None,
                };
                Ok(ControlResponse {
                    ok: true,
                    attachments: s.into_iter().collect(),
                    ..Default::default()
                })
            }
            ControlRequest::Ping => Ok(ControlResponse {
                ok: true,
                pid: Some(std::process::id()),
                ..Default::default()
            }),
        }
    }
}

/// The distinct client addresses of `records` (a previous instance's), with
/// their monitors. Only full `ip:port/nonce` addresses: a nonce is what
/// makes one client instance unique.
fn dead_clients_of(records: &[Record]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for r in records {
        let Some(addr) = r.client_addr.as_deref() else {
            continue;
        };
        if addr_nonce(addr).is_none_or(|n| n == "0") {
            continue;
        }
        if !out.iter().any(|(_, a)| a == addr) {
            out.push((r.monitors.join(","), addr.to_owned()));
        }
    }
    out
}

/// The nonce of a librados address (`ip:port/nonce`): unique per client
/// instance.
fn addr_nonce(addr: &str) -> Option<&str> {
    let tail = addr.rsplit('/').next()?;
    let end = tail
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(tail.len());
    (end > 0).then(|| &tail[..end])
}

/// Refuses a writable mapping whose librbd cache would answer a write
/// before RADOS has it (`writeback`, or `writearound`, librbd's default).
/// The worker's restart is invisible to the filesystem above, so such a
/// write would be lost with the dead worker while the next `fsync` (served
/// by the new worker, with nothing to flush) succeeds. The connection sets
/// `writethrough`; this catches a pool or image override (`rbd config pool
/// set`) that would win over it.
fn require_write_through(image: &Image, volume: &str) -> Result<()> {
    let config = image.config_list()?;
    let value = |name: &str| config.iter().find(|o| o.name == name);
    let cache_on = value("rbd_cache").is_none_or(|o| o.value == "true");
    match value("rbd_cache_policy") {
        Some(p) if cache_on && p.value != "writethrough" => Err(Error::invalid(
            "attach",
            volume,
            format!(
                "the image's rbd_cache_policy is {} (a {:?}-level override): a write \
                 that librbd's cache answered would be lost if the mapper's worker \
                 restarted; remove the override or set it to writethrough",
                p.value, p.source
            ),
        )),
        _ => Ok(()),
    }
}

/// A killed daemon leaves its exclusive lock behind, and librbd would wait
/// for that client's watch to time out (about 30 s) before taking it over.
/// We hold the state dir's flock, so the process that opened the image
/// before the restart is dead: break the lock if (and only if) that very
/// client instance owns it. librbd blocklists it while breaking.
fn break_dead_lock(image: &Image, old: &Record) {
    let Some(dead) = old.client_addr.as_deref().and_then(addr_nonce) else {
        return;
    };
    let Ok((mode, owners)) = image.lock_owners() else {
        return;
    };
    for owner in owners {
        if addr_nonce(&owner) == Some(dead) {
            match image.lock_break(mode, &owner) {
                Ok(()) => tracing::info!(volume = %old.volume_id, owner = %owner,
                    "broke the exclusive lock of this daemon's previous, dead instance"),
                Err(e) => tracing::warn!(volume = %old.volume_id, owner = %owner, error = %e,
                    "cannot break the dead instance's lock; librbd will wait for it to expire"),
            }
        }
    }
}

/// Sets up a freshly bound device: requests of at most 1 MiB
/// (`max_sectors_kb`), so that each is one FUSE request (the loop driver's
/// default of 1280 KiB splits a 4 MiB read into seven uneven ones), and the
/// `queue_depth` option (default: the most the driver allows) as
/// `nr_requests`.
fn tune_device(dev: &Path, opts: &FuseMapOptions) -> Result<()> {
    let kib = fk::MAX_WRITE / 1024;
    if let Err(e) = loopdev::set_queue_attr(dev, "max_sectors_kb", &kib.to_string()) {
        tracing::warn!(device = %dev.display(), error = %e, "cannot set max_sectors_kb");
    }
    // Always written: a loop device keeps its queue settings across binds,
    // so a reused one would inherit the previous mapping's.
    let n = opts
        .queue_depth
        .unwrap_or_else(crate::node::fuse::loop_hw_queue_depth);
    loopdev::set_queue_attr(dev, "nr_requests", &n.to_string())?;
    Ok(())
}

/// Waits until the kernel let go of `file` on `dev` (the unbind finishes
/// when the device's last opener closes it).
fn wait_unbound(dev: &Path, file: &Path) -> Result<()> {
    let deadline = Instant::now() + UNBIND_TIMEOUT;
    while loopdev::backing_file(dev).as_deref() == Some(file) {
        if Instant::now() > deadline {
            return Err(Error::from_errno(
                libc::EBUSY,
                "ioctl(LOOP_CLR_FD)",
                dev.display().to_string(),
            )
            .detail(format!(
                "still bound to {} after {} s: something holds the device open",
                file.display(),
                UNBIND_TIMEOUT.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Flushes and closes the image once the requests still in flight let go
/// of it (bounded); past the bound the last of them closes it.
fn close_node(node: Arc<Node>) {
    let Ok(node) = Arc::try_unwrap(node) else {
        return;
    };
    let mut image = node.image;
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    loop {
        match Arc::try_unwrap(image) {
            Ok(img) => {
                let spec = img.spec();
                if let Err(e) = img.flush().and_then(|()| img.close()) {
                    tracing::warn!(image = %spec, error = %e, "closing the image failed");
                }
                return;
            }
            Err(shared) if Instant::now() < deadline => {
                image = shared;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => return,
        }
    }
}

/// After a worker restart: a loop device on one of our files that no record
/// names was bound by an attach killed before it saved its record (and so
/// before it answered: nobody was given that device). Clear it, and never
/// hand out its inode number again.
fn clear_unrecorded_devices(mnt: &Path, table: &mut Table) {
    for (dev, backing) in loopdev::list() {
        let Ok(rel) = backing.strip_prefix(mnt) else {
            continue;
        };
        let name = rel.to_string_lossy();
        if table.live.values().any(|l| l.rec.file == name)
            || table.stale.values().any(|r| r.file == name)
        {
            continue;
        }
        if let Some(ino) = name.split('.').next().and_then(|n| n.parse::<u64>().ok()) {
            table.next_ino = table.next_ino.max(ino + 1);
        }
        match loopdev::detach(&dev) {
            Ok(()) => {
                tracing::info!(device = %dev.display(), file = %name, "cleared a loop device of an attach that did not finish")
            }
            Err(e) => {
                tracing::warn!(device = %dev.display(), error = %e, "cannot clear a loop device of an unfinished attach")
            }
        }
    }
}

/// What a previous run left: loop devices on our files and the dead mount.
fn recover(mnt: &Path) -> Vec<PathBuf> {
    let mut cleared = Vec::new();
    for (dev, backing) in loopdev::list() {
        if backing.starts_with(mnt) {
            let busy = loopdev::in_use(&dev);
            match loopdev::detach(&dev) {
                Ok(()) => {
                    tracing::info!(device = %dev.display(), file = %backing.display(), busy,
                        "cleared a loop device left by the previous run (a busy one is cleared on its last close)");
                    cleared.push(dev);
                }
                Err(e) => {
                    tracing::warn!(device = %dev.display(), error = %e, "cannot clear a stale loop device")
                }
            }
        }
    }
    // Stacked mounts are possible after several crashes: peel them all.
    for _ in 0..16 {
        if !is_mountpoint(mnt) {
            break;
        }
        if let Err(e) = fk::unmount_lazy(mnt) {
            tracing::warn!(path = %mnt.display(), error = %e, "cannot detach the old FUSE mount");
            break;
        }
    }
    cleared
}

/// Whether `path` is a mount point, from `/proc/self/mountinfo`.
fn is_mountpoint(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| unescape_mount(m) == want)
}

fn unescape_mount(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

fn lock_state_dir(dir: &Path) -> Result<File> {
    let path = dir.join("lock");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| io_err(e, "open", &path))?;
    // A killed predecessor may still be exiting: wait for it, bounded.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // SAFETY: flock(2) on a live fd; the lock goes with the fd.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r != 0 {
        return Err(
            Error::from_errno(libc::EBUSY, "flock", path.display().to_string())
                .detail("another rbdkit fuse-mapper uses this state dir"),
        );
    }
    Ok(f)
}

/// The uid of the process at the other end of a unix socket
/// (`SO_PEERCRED`), for the control sockets' root-only check.
pub(crate) fn peer_uid(stream: &UnixStream) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills one `struct ucred` (unix(7)); `cred` and
    // `len` are valid out-pointers of that size.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(cred.uid)
}

fn serve_client(daemon: &Daemon, stream: UnixStream) {
    if peer_uid(&stream) != Some(0) {
        let _ =
            (&stream).write_all(b"{\"ok\":false,\"error\":\"only root may use this socket\"}\n");
        return;
    }
    let _ = stream.set_read_timeout(Some(Duration::from_secs(300)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(30)));
    let mut reader = BufReader::new(&stream);
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let resp = match serde_json::from_str::<ControlRequest>(&line) {
            // The parse error may quote the input, which may hold a key.
            Err(_) => ControlResponse {
                ok: false,
                error: Some(
                    "malformed request (not a known op as one JSON object per line)".into(),
                ),
                errno: Some(libc::EINVAL),
                ..Default::default()
            },
            Ok(req) => match daemon.handle(req) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "request failed");
                    ControlResponse {
                        ok: false,
                        error: Some(e.to_string()),
                        errno: Some(e.errno()),
                        ..Default::default()
                    }
                }
            },
        };
        let mut out = serde_json::to_vec(&resp).expect("response serialises");
        out.push(b'\n');
        if (&stream).write_all(&out).is_err() {
            return;
        }
    }
}

fn bind_socket(path: &Path) -> Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io_err(e, "mkdir", dir))?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(
                Error::from_errno(libc::EADDRINUSE, "bind", path.display().to_string())
                    .detail("another daemon answers on this socket"),
            );
        }
        std::fs::remove_file(path).map_err(|e| io_err(e, "unlink", path))?;
    }
    // SAFETY: umask(2) cannot fail; it makes the socket 0600 from birth, so
    // no one else can connect between bind and chmod.
    let old = unsafe { libc::umask(0o177) };
    let l = UnixListener::bind(path);
    // SAFETY: as above; restores the previous mask.
    unsafe { libc::umask(old) };
    let l = l.map_err(|e| io_err(e, "bind", path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| io_err(e, "chmod", path))?;
    Ok(l)
}

/// Runs `rbdkit fuse-mapper`: the supervisor (which starts the worker),
/// or the worker itself with `--worker` or `--no-supervisor`.
pub fn run(args: FuseMapperArgs) -> Result<()> {
    if !args.worker && !args.no_supervisor {
        return crate::node::fuse_supervisor::supervise(args);
    }
    if args.worker {
        // Die with the supervisor: without it nobody keeps our fds.
        // SAFETY: prctl(2) PR_SET_PDEATHSIG with a signal number.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    }
    crate::k8s::telemetry::init(crate::k8s::telemetry::LogFormat::Text);
    let state_dir = args.state_dir.clone();
    std::fs::create_dir_all(&state_dir).map_err(|e| io_err(e, "mkdir", &state_dir))?;
    std::fs::set_permissions(&state_dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| io_err(e, "chmod", &state_dir))?;
    let _lock = lock_state_dir(&state_dir)?;
    let mnt = state_dir.join("mnt");
    let store = args.worker.then(|| StoreClient::new(&state_dir));
    // A supervisor that is gone makes this fail: then we must not run.
    let kept = match &store {
        Some(s) => Some(s.get()?),
        None => None,
    };

    let state_path = state_dir.join("state.json");
    let old: StateFile = match std::fs::read(&state_path) {
        Ok(data) => serde_json::from_slice(&data).map_err(|e| {
            Error::invalid(
                "read",
                state_path.display().to_string(),
                format!("bad state file: {e}"),
            )
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => StateFile::default(),
        Err(e) => return Err(io_err(e, "read", &state_path)),
    };

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.io_threads.max(1))
        .thread_name("fuse-io")
        .enable_all()
        .build()
        .map_err(|e| io_err(e, "start", Path::new("tokio runtime")))?;
    let fs = Arc::new(Fs {
        nodes: RwLock::new(BTreeMap::new()),
        alive: AtomicBool::new(true),
    });
    let mut table = Table {
        next_ino: old.next_ino.max(ROOT_INO + 1),
        ..Default::default()
    };
    let daemon_store = store.clone();
    let (channels, init, resumed, keys) = match kept {
        Some(crate::node::fuse_supervisor::Kept {
            session: Some((init, fds)),
            keys,
        }) => {
            // A previous worker died; its connection lives on in the supervisor.
            let channels: Vec<Arc<fk::Channel>> = fds
                .into_iter()
                .map(|fd| Arc::new(fk::Channel::from_fd(fd)))
                .collect();
            (channels, init, true, keys)
        }
        other => {
            let cleared = recover(&mnt);
            std::fs::create_dir_all(&mnt).map_err(|e| io_err(e, "mkdir", &mnt))?;
            let session = fk::mount(&mnt, "rbdkit-fuse")?;
            let channels = fk::clone_channels(&session, args.threads)?;
            if let Some(s) = &store {
                let fds: Vec<_> = channels.iter().map(|c| c.as_fd()).collect();
                s.put_session(session.init, &fds)?;
            }
            if !cleared.is_empty() || !old.attachments.is_empty() {
                tracing::info!(
                    cleared_devices = cleared.len(),
                    stale = old.attachments.len(),
                    "recovered from a previous run"
                );
            }
            let keys = other.map(|k| k.keys).unwrap_or_default();
            (channels, session.init, false, keys)
        }
    };
    tracing::info!(
        mount = %mnt.display(),
        kernel_minor = init.kernel_minor,
        minor = init.minor,
        max_write = init.max_write,
        resend = init.resend,
        threads = channels.len(),
        resumed,
        "FUSE filesystem ready"
    );
    let daemon = Arc::new(Daemon {
        state_dir: state_dir.clone(),
        mnt: mnt.clone(),
        fs: Arc::clone(&fs),
        table: Mutex::new(Table::default()),
        ops: Mutex::new(()),
        conns: Mutex::new(HashMap::new()),
        timeout: args.timeout,
        store: daemon_store,
        dead_clients: Mutex::new(if args.blocklist_dead_clients {
            dead_clients_of(&old.attachments)
        } else {
            Vec::new()
        }),
    });
    for rec in old.attachments {
        let key = keys.get(&rec.volume_id);
        match (resumed, key) {
            (true, Some(key)) => match daemon.reopen(&rec, key) {
                Ok(live) => {
                    fs.nodes
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(live.node.ino, Arc::clone(&live.node));
                    tracing::info!(volume = %rec.volume_id, device = ?rec.device, "took over a mapping of the previous worker");
                    table.live.insert(rec.volume_id.clone(), live);
                }
                Err(e) => {
                    tracing::error!(volume = %rec.volume_id, error = %e, "cannot re-open the image of a mapping");
                    table.stale.insert(rec.volume_id.clone(), rec);
                }
            },
            _ => {
                table.stale.insert(rec.volume_id.clone(), rec);
            }
        }
    }
    if resumed {
        clear_unrecorded_devices(&mnt, &mut table);
    }
    *daemon.lock_table() = table;
    daemon.save(&daemon.lock_table())?;
    // Requests the dead worker had read go back to the queue first, and only
    // then, with every image open, do we read: a request read by us before
    // the resend would be moved back and served twice.
    if resumed && init.resend {
        fk::notify_resend(&channels[0])?;
        tracing::info!(
            "asked the kernel to resend the requests the previous worker had not answered"
        );
    }
    let readers = fk::serve(&channels, Arc::clone(&fs))?;

    // The filesystem ends when someone unmounts it: mark every mapping dead.
    {
        let fs = Arc::clone(&fs);
        std::thread::spawn(move || {
            for r in readers {
                let _ = r.join();
            }
            fs.alive.store(false, Ordering::SeqCst);
            tracing::error!("the FUSE filesystem was unmounted; mappings are dead");
        });
    }
    // SIGTERM/SIGINT: a clean stop. Flush every image, unmount, and let the
    // supervisor close the session; the mappings end.
    {
        let daemon = Arc::clone(&daemon);
        rt.spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                return;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            let images: Vec<Arc<Image>> = daemon
                .lock_table()
                .live
                .values()
                .map(|l| Arc::clone(&l.node.image))
                .collect();
            for img in images {
                let _ = img.aio_flush().await;
            }
            // The devices cannot outlive us: clear them (a device still
            // mounted is only marked, and goes on its last close).
            let devices: Vec<String> = daemon
                .lock_table()
                .live
                .values()
                .filter_map(|l| l.rec.device.clone())
                .collect();
            for dev in devices {
                let _ = loopdev::detach(Path::new(&dev));
            }
            let _ = fk::unmount_lazy(&daemon.mnt);
            // Close the images, so their exclusive locks and watches go now
            // rather than when the cluster times them out. The state file
            // keeps the records: they are reported dead after a restart.
            let lives: Vec<Live> = std::mem::take(&mut daemon.lock_table().live)
                .into_values()
                .collect();
            daemon
                .fs
                .nodes
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .clear();
            tokio::task::block_in_place(|| {
                for l in lives {
                    close_node(l.node);
                }
            });
            if let Some(s) = &daemon.store {
                let _ = s.drop_session();
            }
            tracing::info!("stopping on signal");
            std::process::exit(0);
        });
    }

    let listener = bind_socket(&args.socket)?;
    tracing::info!(socket = %args.socket.display(), state_dir = %state_dir.display(), "fuse-mapper ready");
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let daemon = Arc::clone(&daemon);
        std::thread::spawn(move || serve_client(&daemon, stream));
    }
    Ok(())
}
