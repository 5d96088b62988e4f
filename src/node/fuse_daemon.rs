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
//! device. librbd's cache is off (`rbd_cache=false`) unless a volume's
//! map options turn it on, and then it is write-through. `status` reports
//! `/sys/block/loopN/loop/dio` as `direct_io`. Either way a write is
//! answered once RADOS has it: with librbd's default, write-around, a
//! write was answered before it was sent, so a worker killed then lost it
//! while the next `fsync`, served by the new worker with nothing to flush,
//! succeeded. Off is the default because a write-through ObjectCacher
//! holds no dirty data and costs CPU on every request.
//!
//! # Isolation
//! Every image is served through one FUSE connection, and the kernel lets
//! that connection have [`fk::MAX_BACKGROUND`] background requests in
//! flight. A request to a pool that stalls (full, placement groups
//! inactive, cluster gone) holds its part until librados times it out, so
//! a shared budget would let a few stalled volumes take it all and stall
//! every other volume of the node. So each attach reserves its device's
//! queue depth of the budget (a loop device never has more requests in
//! flight than its `nr_requests`, and each is one FUSE request), and one
//! that would take more than is left is refused: stalled volumes hold
//! only their own parts. The journal has a slot for every request the
//! budget allows plus two synchronous ones per volume, so a reader never
//! waits for a slot either. A FUSE connection per volume would isolate as
//! well, at the price of a mount, reader threads and a journal per volume
//! and a supervisor holding all of them; the reservation gives the same
//! bound with one. Connections to one cluster are shared per user and
//! key; librados' own throttle of ops in flight per client was not what
//! held a healthy pool up in `tests/it/node_fuse.rs`
//! (`a_full_queue_on_many_stalled_volumes_holds_up_no_volume_of_another_pool`).
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
//! What survives, exactly (each point has a test in `tests/it/node_fuse.rs`):
//! - **The data, always**: everything an `fsync` (or `sync`, or unmount)
//!   returned for was flushed by librbd before the reply, so it is in the
//!   image whatever dies afterwards (`fsynced_file_survives_kill9_of_the_daemon`).
//! - **`kill -9` of the worker: the mapping and the mount above it, on
//!   every kernel.** The supervisor still holds every channel fd and the
//!   request journal, so the kernel's connection, the FUSE files and the
//!   loop devices stay; I/O waits in the kernel. The new worker takes the
//!   fds, the journal and the keys back and serves every mapping again
//!   under the same inode at once; then, in the background, for each
//!   image: connects with its key, **fences the dead worker** (below),
//!   re-opens the image and breaks the dead worker's exclusive lock. A
//!   request for an image not yet open waits; an attempt that fails is
//!   retried with backoff for `--reopen-timeout` (5 minutes), and only then
//!   does that image's I/O fail with `EIO`, `status` saying why; its
//!   `detach` clears the loop device (`a_failed_reopen_is_retried_and_a_lasting_one_fails_cleanly`).
//!   The requests the dead worker had read and not answered are served
//!   again from its journal ([`crate::node::fuse_journal`]) before any new
//!   one is read. This does not need the kernel's `FUSE_NOTIFY_RESEND`
//!   (Linux 6.9+, and it does not cover FUSE over io_uring), so Linux 5.14,
//!   6.1 and 6.8 get exactly what 6.18 gets: writes and fsyncs running in a
//!   mounted ext4 across the kill complete without error, on the same
//!   device (`mounted_filesystem_survives_kill9_of_the_worker`,
//!   `worker_kill9_with_writes_and_fsyncs_in_flight`). The control socket
//!   is down for the restart (about 100 ms): calls fail fast.
//! - **Requests in flight across a restart.** A request is served again
//!   only if its reply was never recorded (the journal records a reply
//!   before writing it), so only if the filesystem above never saw it
//!   answered. Until a write is answered, nothing the filesystem does can
//!   depend on it: a write it issued meanwhile to an overlapping range is
//!   concurrent with it, and a block device leaves the order of concurrent
//!   writes open; a flush covers only writes answered before it was
//!   issued. So serving an unanswered write again, even one the dead worker
//!   had partly done, ends with that write's data, as a block device may.
//!   What would break this is the dead worker's own requests landing
//!   *later*: ops still in its sockets or in an OSD's queue overwriting the
//!   write served again, or a newer acknowledged one. So before any request
//!   of an image is served, the dead worker's librados client is
//!   blocklisted and this worker waits for the OSD map that says so (a
//!   request of ours carries that epoch; an OSD serves it only once it has
//!   that map, and from then on refuses the blocklisted client), always,
//!   not only when the image has exclusive-lock
//!   (`takeover_fences_the_dead_worker_before_answering_its_requests`). If
//!   the cluster refuses the blocklist (the user lacks the mon cap for
//!   `osd blocklist`, which `profile rbd` has), the image is not served:
//!   its I/O waits and then fails with `EIO` as above, rather than risk
//!   overwriting acknowledged data. The same fence comes before an `attach`
//!   of a volume the previous instance had mapped (after the whole daemon
//!   died).
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
//! - **Stale watches** (`--blocklist-dead-clients`, off by default; a
//!   worker taking over, or an attach after a restart, always fences, see
//!   above: this flag is about the mappings nobody attaches again). A dead
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
//! and in the supervisor's store; after the supervisor is gone too,
//! `attach` brings them again. Both processes are non-dumpable (see
//! [`crate::node::fuse_supervisor`]). Every `attach` of a new volume proves
//! its key to the cluster (a new librados client authenticates with it), so
//! a wrong or revoked key fails there; only then may the image use a
//! cached connection, and only one made with the same key (and monitors,
//! user and librbd settings): a rotated key gets its own connection
//! (`a_wrong_revoked_or_rotated_key_gets_no_cached_connection`).

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
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
use crate::node::fuse_journal::Journal;
use crate::node::fuse_kernel::{self as fk, op, InHeader, Reply};
use crate::node::fuse_supervisor::{SecretBuf, StoreClient};
use crate::node::loopdev;
use crate::rados::{Cluster, ConnectOptions};
use crate::rbd::Image;
use crate::volume::luks::{DataCipher, Header, VolumeKey};

/// The supervisor store's name for the volume key of `volume_id` (its
/// cephx key is kept under the volume id itself).
fn luks_key_name(volume_id: &str) -> String {
    format!("luks:{volume_id}")
}

/// Unlocks the LUKS2 header of `image` with `passphrase`: the data cipher
/// and the volume key.
fn unlock(image: &Image, passphrase: &[u8], vol: &str) -> Result<(Arc<DataCipher>, VolumeKey)> {
    let h = Header::read(image)?;
    let (key, _) = h.unlock(image, passphrase)?;
    let c = h
        .data_cipher(&key)
        .map_err(|why| Error::invalid("attach", vol.to_owned(), why))?;
    Ok((Arc::new(c), key))
}

/// The data cipher of `image` from a kept volume key (a worker taking over).
fn with_key(image: &Image, key: &crate::rados::Secret, vol: &str) -> Result<Arc<DataCipher>> {
    let h = Header::read(image)?;
    let key = VolumeKey::from_secret(key)
        .filter(|k| h.check_key(k))
        .ok_or_else(|| {
            Error::invalid(
                "attach",
                vol.to_owned(),
                "the kept volume key does not match the image's LUKS2 header",
            )
        })?;
    h.data_cipher(&key)
        .map(Arc::new)
        .map_err(|why| Error::invalid("attach", vol.to_owned(), why))
}

/// The size a mapping serves: the image's, less an encrypted volume's
/// LUKS2 header, in whole sectors.
fn served_size(image: &Image, crypt: Option<&DataCipher>) -> Result<u64> {
    let raw = image.size()?;
    Ok(match crypt {
        Some(c) => {
            let s = c.sector_size() as u64;
            raw.saturating_sub(c.offset) / s * s
        }
        None => raw,
    })
}

/// The loop device's block size: the option's, at least the sector size.
fn block_size(opts: &FuseMapOptions, crypt: Option<&DataCipher>, vol: &str) -> Result<u32> {
    let sector = crypt.map_or(512, |c| c.sector_size() as u32);
    match opts.block_size {
        Some(b) if b < sector => Err(Error::invalid(
            "mapOptions",
            vol.to_owned(),
            format!(
                "rbdkit-fuse option block_size={b} is below the LUKS2 sector size {sector} of \
                 this encrypted volume"
            ),
        )),
        Some(b) => Ok(b),
        None => Ok(sector),
    }
}

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
    /// How long a restarted worker keeps trying (with backoff) to re-open
    /// an image it took over, and to fence its dead predecessor, before it
    /// fails that image's I/O with EIO. Meanwhile the image's I/O waits.
    #[arg(long = "reopen-timeout", default_value = "5m", value_parser = humantime::parse_duration)]
    pub reopen_timeout: Duration,
    /// Run the worker alone, without the supervisor that keeps the FUSE
    /// connection alive across worker restarts.
    #[arg(long = "no-supervisor")]
    pub no_supervisor: bool,
    /// Internal: run as the worker of a supervisor.
    #[arg(long, hide = true)]
    pub worker: bool,
}

/// How long a detach waits for a device that is held open to be let go
/// before it answers EBUSY.
const BUSY_GRACE: Duration = Duration::from_secs(2);
const ROOT_INO: u64 = 1;
/// How long detach waits for the kernel to let go of the file.
const UNBIND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long detach waits for in-flight requests before closing the image.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Test-only hook, off unless this variable is set (no deploy manifest
/// sets it; see [`held_for_test`]): the folder of the `hold` file.
const TEST_HOLD_WRITES_ENV: &str = "RBDKIT_FUSE_TEST_HOLD_WRITES";

/// The folder [`TEST_HOLD_WRITES_ENV`] names, read once; `None` (the
/// default, always in production) leaves the hook off.
fn test_hold_dir() -> Option<&'static Path> {
    static DIR: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    DIR.get_or_init(|| std::env::var_os(TEST_HOLD_WRITES_ENV).map(PathBuf::from))
        .as_deref()
}

/// Test-only: lets the tests of a worker's `kill -9` with a request in
/// flight (`tests/it/node_fuse.rs`) make that race happen every time,
/// instead of hoping the kill lands before the answer. With
/// `RBDKIT_FUSE_TEST_HOLD_WRITES=<dir>` set, a WRITE that arrives while
/// `<dir>/hold` exists claims it (renames it to `<dir>/held`, so one
/// request per `hold` file, and a next worker holds nothing unless armed
/// again) and is never answered by this worker: it stays read and not
/// answered in the journal until the worker dies, and the next one serves
/// it again. Returns the reply to answer, or `None` when it is held.
fn held_for_test(reply: Reply) -> Option<Reply> {
    static HELD: Mutex<Vec<Reply>> = Mutex::new(Vec::new());
    let Some(dir) = test_hold_dir() else {
        return Some(reply);
    };
    if std::fs::rename(dir.join("hold"), dir.join("held")).is_err() {
        return Some(reply);
    }
    tracing::warn!(
        ?reply,
        "test hook: holding a WRITE unanswered until this worker dies"
    );
    HELD.lock().unwrap_or_else(|e| e.into_inner()).push(reply);
    None
}

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
    /// Served decrypted (a LUKS2 volume); its volume key is kept in the
    /// supervisor, never here.
    #[serde(default)]
    encrypted: bool,
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
            && self.encrypted == spec.encryption.is_some()
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
    serving: RwLock<Serving>,
    size: AtomicU64,
    read_only: bool,
    /// The data cipher of an encrypted volume: set before it serves.
    crypt: std::sync::OnceLock<Arc<DataCipher>>,
    /// Whether it is encrypted (then it serves only with `crypt` set).
    encrypted: bool,
}

/// Whether a file's image is open.
enum Serving {
    /// Open: requests go to it.
    Ready(Arc<Image>),
    /// Taken over from a dead worker and not open yet (or its predecessor
    /// not fenced yet): requests wait here, with the last error if any.
    Waiting(Vec<(InHeader, Reply)>, Option<String>),
    /// It could not be opened: requests fail with EIO, for this reason.
    Failed(String),
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
    fn new(ino: u64, name: String, serving: Serving, size: u64, read_only: bool) -> Node {
        Node {
            ino,
            name,
            serving: RwLock::new(serving),
            size: AtomicU64::new(size),
            read_only,
            crypt: std::sync::OnceLock::new(),
            encrypted: false,
        }
    }

    fn encrypted(mut self, crypt: Option<Arc<DataCipher>>, encrypted: bool) -> Node {
        self.encrypted = encrypted;
        if let Some(c) = crypt {
            let _ = self.crypt.set(c);
        }
        self
    }

    /// The cipher to serve with: `Err` (answer EIO) for an encrypted file
    /// whose key is not there, which never serves.
    fn cipher(&self) -> std::result::Result<Option<Arc<DataCipher>>, ()> {
        match (self.crypt.get(), self.encrypted) {
            (Some(c), _) => Ok(Some(Arc::clone(c))),
            (None, false) => Ok(None),
            (None, true) => Err(()),
        }
    }

    /// The open image, if it is; else the request waits (or fails, when
    /// the image could not be opened).
    fn image(&self, hdr: &InHeader, reply: Reply) -> Option<(Arc<Image>, Reply)> {
        if let Serving::Ready(img) = &*self.serving.read().unwrap_or_else(|e| e.into_inner()) {
            return Some((Arc::clone(img), reply));
        }
        let mut s = self.serving.write().unwrap_or_else(|e| e.into_inner());
        match &mut *s {
            Serving::Ready(img) => return Some((Arc::clone(img), reply)),
            Serving::Waiting(parked, _) => parked.push((*hdr, reply)),
            Serving::Failed(_) => {
                drop(s);
                reply.error(libc::EIO);
            }
        }
        None
    }

    /// The open image, if it is.
    fn open_image(&self) -> Option<Arc<Image>> {
        match &*self.serving.read().unwrap_or_else(|e| e.into_inner()) {
            Serving::Ready(img) => Some(Arc::clone(img)),
            _ => None,
        }
    }

    /// Why it does not serve, if it does not.
    fn not_serving(&self) -> Option<String> {
        match &*self.serving.read().unwrap_or_else(|e| e.into_inner()) {
            Serving::Ready(_) => None,
            Serving::Waiting(_, last) => Some(format!(
                "re-opening the image after a worker restart; its I/O waits{}",
                last.as_deref()
                    .map(|e| format!(" (last attempt: {e})"))
                    .unwrap_or_default()
            )),
            Serving::Failed(why) => Some(why.clone()),
        }
    }

    /// Sets the state, and returns the requests that waited.
    fn set(&self, to: Serving) -> Vec<(InHeader, Reply)> {
        let old = std::mem::replace(
            &mut *self.serving.write().unwrap_or_else(|e| e.into_inner()),
            to,
        );
        match old {
            Serving::Waiting(parked, _) => parked,
            _ => Vec::new(),
        }
    }

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

    /// Runs `fut` (which answers its request) to its end: the thread that
    /// wakes it (librbd's completion thread) polls it and writes the reply,
    /// saving a hop to a runtime thread per request (measured: about 20 µs
    /// of CPU per 4 KiB request on 2 cores).
    fn complete<F>(&self, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        InlineTask::start(fut);
    }
}

type ReplyFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A future polled by whoever wakes it: first the reader thread that
/// submitted the request, then librbd's completion callback. The futures
/// here are librbd requests, whose wake comes once, after the result is
/// stored, so the poll in the waker only takes the result and sends the
/// reply (one `writev` to `/dev/fuse`, which does not block).
struct InlineTask {
    state: Mutex<Option<ReplyFuture>>,
}

impl InlineTask {
    fn start<F>(fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let task = Arc::new(InlineTask {
            state: Mutex::new(Some(Box::pin(fut))),
        });
        task.poll();
    }

    fn poll(self: &Arc<Self>) {
        let waker = std::task::Waker::from(Arc::clone(self));
        let mut cx = std::task::Context::from_waker(&waker);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(fut) = state.as_mut() else {
            return;
        };
        if fut.as_mut().poll(&mut cx).is_ready() {
            *state = None;
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
    fn request(&self, hdr: &InHeader, reply: Reply) {
        let ino = hdr.nodeid;
        match hdr.opcode {
            op::FORGET | op::BATCH_FORGET | op::INTERRUPT => {}
            op::LOOKUP => {
                if ino != ROOT_INO {
                    return reply.error(libc::ENOENT);
                }
                let found = {
                    let name = cstr_arg(reply.body());
                    self.nodes
                        .read()
                        .unwrap_or_else(|e| e.into_inner())
                        .values()
                        .find(|n| n.name.as_bytes() == name)
                        .cloned()
                };
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
                    let Some(s) = fk::read_pod::<fk::SetattrIn>(reply.body()) else {
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
                let flags = fk::read_pod::<fk::OpenIn>(reply.body()).map_or(0, |o| o.flags as i32);
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
                let (Some(n), Some(r)) = (self.node(ino), fk::read_pod::<fk::ReadIn>(reply.body()))
                else {
                    return reply.error(libc::EBADF);
                };
                let size = n.size.load(Ordering::SeqCst);
                if r.offset >= size {
                    return reply.ok(&[]);
                }
                let Ok(crypt) = n.cipher() else {
                    return reply.error(libc::EIO);
                };
                let len = (r.size as u64).min(size - r.offset) as usize;
                if crypt.as_ref().is_some_and(|c| !c.aligned(r.offset, len)) {
                    // The loop device's block size is the sector size.
                    return reply.error(libc::EINVAL);
                }
                let Some((image, mut reply)) = n.image(hdr, reply) else {
                    return;
                };
                let Some(mem) = reply.data_mem(len) else {
                    return reply.error(libc::EIO);
                };
                // Straight into the slot the reply is written from (and
                // decrypted there).
                let at = r.offset + crypt.as_ref().map_or(0, |c| c.offset);
                let fut = image.aio_read_buf(at, mem);
                let pos = r.offset;
                self.complete(async move {
                    match fut.await {
                        Ok(got) => {
                            if let Some(c) = &crypt {
                                let whole = got / c.sector_size() * c.sector_size();
                                match reply.data_mut(whole) {
                                    Some(buf) => c.decrypt(pos, buf),
                                    None => return reply.error(libc::EIO),
                                }
                                return reply.ok_data(whole);
                            }
                            reply.ok_data(got)
                        }
                        Err(e) => reply.error(errno_of(&e)),
                    }
                });
            }
            op::WRITE => {
                let (Some(n), Some(w)) =
                    (self.node(ino), fk::read_pod::<fk::WriteIn>(reply.body()))
                else {
                    return reply.error(libc::EBADF);
                };
                if n.read_only {
                    return reply.error(libc::EROFS);
                }
                // The data follows `fuse_write_in`, at the slot's data region.
                if reply.body().len() != std::mem::size_of::<fk::WriteIn>() + w.size as usize {
                    return reply.error(libc::EINVAL);
                }
                if w.offset.saturating_add(w.size as u64) > n.size.load(Ordering::SeqCst) {
                    return reply.error(libc::ENOSPC);
                }
                let Ok(crypt) = n.cipher() else {
                    return reply.error(libc::EIO);
                };
                if crypt
                    .as_ref()
                    .is_some_and(|c| !c.aligned(w.offset, w.size as usize))
                {
                    return reply.error(libc::EINVAL);
                }
                let Some(reply) = held_for_test(reply) else {
                    return;
                };
                let Some((image, reply)) = n.image(hdr, reply) else {
                    return;
                };
                let fut = match &crypt {
                    // Encrypted into a buffer of its own: the journal's copy
                    // stays plaintext, so a request served again after a
                    // worker restart is encrypted once, from the same data.
                    Some(c) => {
                        let Some(plain) = reply.data(w.size as usize) else {
                            return reply.error(libc::EIO);
                        };
                        let mut buf = plain.to_vec();
                        c.encrypt(w.offset, &mut buf);
                        image.aio_write(w.offset + c.offset, buf)
                    }
                    None => {
                        let Some(mem) = reply.data_mem(w.size as usize) else {
                            return reply.error(libc::EIO);
                        };
                        image.aio_write_buf(w.offset, mem)
                    }
                };
                let out = fk::WriteOut {
                    size: w.size,
                    padding: 0,
                };
                self.complete(async move {
                    match fut.await {
                        Ok(()) => reply.ok(fk::pod_bytes(&out)),
                        Err(e) => reply.error(errno_of(&e)),
                    }
                });
            }
            op::FSYNC | op::FLUSH => {
                let Some(n) = self.node(ino) else {
                    return reply.error(libc::EBADF);
                };
                if n.read_only {
                    return reply.ok(&[]);
                }
                let Some((image, reply)) = n.image(hdr, reply) else {
                    return;
                };
                let fut = image.aio_flush();
                self.complete(async move {
                    match fut.await {
                        Ok(()) => reply.ok(&[]),
                        Err(e) => reply.error(errno_of(&e)),
                    }
                });
            }
            op::FALLOCATE => {
                let (Some(n), Some(f)) = (
                    self.node(ino),
                    fk::read_pod::<fk::FallocateIn>(reply.body()),
                ) else {
                    return reply.error(libc::EBADF);
                };
                if n.read_only {
                    return reply.error(libc::EROFS);
                }
                if n.encrypted {
                    // Zeroed ciphertext does not read back as zeroes: the
                    // kernel falls back to writing zeroes, as over dm-crypt.
                    return reply.error(libc::EOPNOTSUPP);
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
                let Some((image, reply)) = n.image(hdr, reply) else {
                    return;
                };
                let len = end.min(size) - f.offset;
                // write_zeroes, not discard: a punched hole must read back
                // as zeroes, which a partial-object discard does not promise.
                let fut = image.aio_write_zeroes(f.offset, len as usize);
                self.complete(async move {
                    match fut.await {
                        Ok(()) => reply.ok(&[]),
                        Err(e) => reply.error(errno_of(&e)),
                    }
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
                let Some(r) = fk::read_pod::<fk::ReadIn>(reply.body()) else {
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
                // At most a page: the journal keeps one for a READDIR reply.
                let max = (r.size as usize).min(4096);
                let mut out = Vec::new();
                for (i, (eino, typ, name)) in entries.iter().enumerate().skip(r.offset as usize) {
                    if !fk::push_dirent(&mut out, max, *eino, i as u64 + 1, *typ, name) {
                        break;
                    }
                }
                reply.ok(&out)
            }
            op::STATFS => {
                let out = {
                    let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
                    let bytes: u64 = nodes.values().map(|n| n.size.load(Ordering::SeqCst)).sum();
                    fk::StatfsOut {
                        blocks: bytes / 4096,
                        files: nodes.len() as u64 + 1,
                        bsize: 4096,
                        frsize: 4096,
                        namelen: 255,
                        ..Default::default()
                    }
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
    /// The connection serving it; none while it is being taken over.
    conn_key: Option<ConnKey>,
}

/// A mapping taken over: its image, connection, client address and, when
/// encrypted, its data cipher.
type TakenOver = (Image, ConnKey, Option<String>, Option<Arc<DataCipher>>);

/// A mapping a restarted worker takes over: its record, the cephx keys to
/// try, and its volume key when it is encrypted.
type TakeOver = (
    Record,
    Vec<crate::rados::Secret>,
    Option<crate::rados::Secret>,
);

/// One librados connection per monitors, user, librbd settings and key
/// (a fingerprint of it): images share a connection only when they were
/// attached with the same key.
type ConnKey = (String, String, Vec<(String, String)>, u64);

/// A fingerprint of a key, for the connection cache: SipHash with this
/// process's own random seed (never logged or stored).
fn key_fingerprint(key: &crate::rados::Secret) -> u64 {
    use std::hash::BuildHasher;
    static SEED: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    SEED.get_or_init(std::collections::hash_map::RandomState::new)
        .hash_one(key.expose().as_bytes())
}

/// A detached image still held by requests in flight, with its record and
/// connection.
type Closing = (std::sync::Weak<Image>, Record, Option<ConnKey>);

/// One lock per volume id, made on first use and dropped with its last
/// user.
#[derive(Default)]
struct VolumeOps(Mutex<HashMap<String, Arc<Mutex<()>>>>);

impl VolumeOps {
    /// Runs `f` holding `vol`'s lock.
    fn with<T>(&self, vol: &str, f: impl FnOnce() -> T) -> T {
        let lock = {
            let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
            Arc::clone(m.entry(vol.to_owned()).or_default())
        };
        let out = {
            let _held = lock.lock().unwrap_or_else(|e| e.into_inner());
            f()
        };
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Ours and the map's: nobody else waits for it.
        if Arc::strong_count(&lock) == 2 {
            m.remove(vol);
        }
        out
    }
}

#[derive(Default)]
struct Table {
    live: BTreeMap<String, Live>,
    /// Recorded before a restart, device dead, not yet attached again.
    stale: BTreeMap<String, Record>,
    next_ino: u64,
    /// Attaches under way, with the queue depth each reserved.
    attaching: BTreeMap<String, u32>,
}

/// An attach's part of the FUSE connection's budget (see
/// [`Daemon::reserve`]), given back when the attach ends; a mapping that
/// went live holds its part through its record from then on.
struct Reservation<'a> {
    daemon: &'a Daemon,
    vol: String,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.daemon.lock_table().attaching.remove(&self.vol);
    }
}

struct Daemon {
    state_dir: PathBuf,
    mnt: PathBuf,
    fs: Arc<Fs>,
    table: Mutex<Table>,
    /// Serialises attach, detach and refresh of one volume; other volumes'
    /// go on meanwhile (one slow cluster never holds up another's).
    ops: VolumeOps,
    conns: Mutex<HashMap<ConnKey, Cluster>>,
    timeout: Duration,
    /// The supervisor that keeps fds and keys, if we run under one.
    store: Option<StoreClient>,
    /// `--blocklist-dead-clients`: the previous instance's client
    /// addresses still to blocklist, with their monitors.
    dead_clients: Mutex<Vec<(String, String)>>,
    /// Dead clients fenced already (blocklisted, OSD map caught up).
    fenced: Mutex<std::collections::HashSet<String>>,
    /// Detached volumes whose image requests in flight still held when the
    /// detach gave up waiting: the image, and what the detach has left to
    /// do once it is closed.
    closing: Mutex<HashMap<String, Closing>>,
    /// `--reopen-timeout`.
    reopen_timeout: Duration,
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

    /// A connection for `spec`: its key is always proven to the cluster
    /// first (a new librados client authenticates with it), so a wrong or
    /// revoked key fails here, and only then is a cached connection made
    /// with that same key (same monitors, user and settings) used instead
    /// of the new one.
    fn connect(&self, spec: &AttachSpec, opts: &FuseMapOptions) -> Result<(ConnKey, Cluster)> {
        let key = (
            spec.monitors.join(","),
            spec.user.clone(),
            opts.librbd.clone(),
            key_fingerprint(&spec.key),
        );
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
        // No ObjectCacher unless the volume asks for one: write-through it
        // keeps no data worth having, and it cost about a fifth of the
        // mapper's CPU per 4 KiB request (bench/analysis.md, issue 39).
        // (Zero-copy writes, `rbd_disable_zero_copy_writes=false`, are not
        // set: with a write-through ObjectCacher, which a pool or image
        // override can still turn on, librbd keeps the caller's buffer in
        // its cache and never answers the write; measured, issue 39.)
        if !opts.librbd.iter().any(|(k, _)| k == "rbd_cache") {
            options = options.set("rbd_cache", "false");
        }
        for (k, v) in &opts.librbd {
            options = options.set(k.clone(), v.clone());
        }
        // Last, so that nothing (an option recorded by an older version
        // either) turns it off: see `require_write_through`.
        let fresh = options.set("rbd_cache_policy", "writethrough").connect()?;
        let cached = {
            let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            match conns.get(&key) {
                Some(c) => Some(c.clone()),
                None => {
                    conns.insert(key.clone(), fresh.clone());
                    None
                }
            }
        };
        let cluster = match cached {
            // The proof is made; the spare client goes.
            Some(c) => {
                drop(fresh);
                c
            }
            None => fresh,
        };
        self.end_dead_clients(&key.0, &cluster);
        Ok((key, cluster))
    }

    /// Fences a dead instance's librados client: blocklists it and waits
    /// for the OSD map that says so, so that none of its requests still in
    /// flight (in its sockets, in an OSD's queue) can land after a request
    /// we send from now on. Once per address.
    fn fence(&self, cluster: &Cluster, addr: &str, volume: &str) -> Result<()> {
        if addr_nonce(addr).is_none_or(|n| n == "0") {
            return Ok(());
        }
        if self
            .fenced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(addr)
        {
            return Ok(());
        }
        cluster
            .blocklist_add(addr, 0)
            .and_then(|()| cluster.wait_for_latest_osdmap())
            .map_err(|e| {
                e.detail(format!(
                    "cannot fence the previous worker's client {addr} of {volume} (blocklisting \
                     it needs the mon cap for `osd blocklist`, as in `profile rbd`): its \
                     requests still in flight could overwrite newer data, so none of ours is sent"
                ))
            })?;
        self.fenced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr.to_owned());
        tracing::info!(client = %addr, volume = %volume,
            "fenced the previous worker's client (blocklisted, OSD map caught up)");
        Ok(())
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
        let used = self
            .lock_table()
            .live
            .values()
            .any(|l| l.conn_key.as_ref() == Some(key));
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
        if let Some(why) = l.node.not_serving() {
            reason = reason.or(Some(why));
        }
        let librbd = match l.conn_key.as_ref().and_then(|k| {
            self.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(k)
                .cloned()
        }) {
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
            stale: false,
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
            stale: true,
            reason: Some(format!(
                "the rbdkit-fuse daemon restarted since {} was mapped on {}: that device no longer \
                 reaches the image (I/O fails); attach the volume again",
                r.volume_id,
                r.device.as_deref().unwrap_or("a device")
            )),
        }
    }

    /// One attempt to take over the image of a mapping the previous worker
    /// served (same inode, file and device): connect with its key (or,
    /// should that one be refused, another kept for the same user: a
    /// rotated one), fence the dead worker's client, open the image and
    /// break that worker's lock.
    fn take_over(
        &self,
        rec: &Record,
        keys: &[crate::rados::Secret],
        volume_key: Option<&crate::rados::Secret>,
    ) -> Result<TakenOver> {
        let mut last = None;
        for key in keys {
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
                encryption: None,
            };
            match self.connect(&spec, &rec.options) {
                Ok(c) => {
                    last = Some(Ok(c));
                    break;
                }
                Err(e) => last = Some(Err(e)),
            }
        }
        let (conn_key, cluster) = last.unwrap_or_else(|| {
            Err(Error::invalid(
                "attach",
                &rec.volume_id,
                "no key kept for it",
            ))
        })?;
        let opened = (|| {
            if !rec.read_only {
                if let Some(addr) = &rec.client_addr {
                    self.fence(&cluster, addr, &rec.volume_id)?;
                }
            }
            let ioctx = cluster.ioctx_ns(&rec.pool, &rec.namespace)?;
            let image = match (&rec.snapshot, rec.read_only) {
                (Some(snap), _) => Image::open_snapshot(&ioctx, &rec.image, snap)?,
                (None, true) => Image::open_read_only(&ioctx, &rec.image)?,
                (None, false) => Image::open(&ioctx, &rec.image)?,
            };
            if !rec.read_only {
                // Refusing here would leave the mounted filesystem's I/O
                // waiting for good; an override made since the attach is
                // only reported.
                if let Err(e) = require_write_through(&image, &rec.volume_id) {
                    tracing::error!(volume = %rec.volume_id, error = %e, "serving it anyway");
                }
                break_dead_lock(&image, rec);
            }
            let crypt = match (rec.encrypted, volume_key) {
                (false, _) => None,
                (true, Some(k)) => Some(with_key(&image, k, &rec.volume_id)?),
                (true, None) => {
                    return Err(Error::invalid(
                        "attach",
                        rec.volume_id.clone(),
                        "no volume key kept for this encrypted mapping",
                    ))
                }
            };
            Ok::<_, Error>((image, crypt))
        })();
        match opened {
            Ok((image, crypt)) => Ok((image, conn_key, cluster.addrs().ok(), crypt)),
            Err(e) => {
                self.drop_conn_if_unused(&conn_key);
                Err(e)
            }
        }
    }

    /// Records a taken-over mapping's new client (the next worker fences
    /// it) before it serves: a mapping whose state cannot be saved is not
    /// served (the next try saves again), since a later takeover would
    /// fence the previous client instead of this one, which could then
    /// write on. The image and its size, or the save's error.
    fn record_takeover(
        &self,
        rec: &Record,
        image: Image,
        size: u64,
        conn_key: ConnKey,
        addr: Option<String>,
    ) -> Result<Image> {
        let mut t = self.lock_table();
        let before = t.live.get_mut(&rec.volume_id).map(|l| {
            let old = (l.rec.size, l.rec.client_addr.clone(), l.conn_key.clone());
            l.rec.size = size;
            l.rec.client_addr = addr;
            l.conn_key = Some(conn_key.clone());
            old
        });
        if let Err(e) = self.save(&t) {
            if let (Some(l), Some((size, addr, key))) = (t.live.get_mut(&rec.volume_id), before) {
                l.rec.size = size;
                l.rec.client_addr = addr;
                l.conn_key = key;
            }
            drop(t);
            drop(image);
            self.drop_conn_if_unused(&conn_key);
            tracing::warn!(volume = %rec.volume_id, error = %e,
                "cannot save the state of a taken-over mapping: not serving it yet");
            return Err(e);
        }
        Ok(image)
    }

    /// Takes over every mapping in `todo` (waiting nodes), retrying each
    /// with backoff until `--reopen-timeout`; then its I/O fails with EIO.
    /// Requests that waited are served once the image is open.
    /// Re-opens every mapping of the previous worker, all at once: one
    /// whose cluster does not answer holds up no other.
    fn take_over_all(&self, todo: Vec<TakeOver>) {
        let started = Instant::now();
        std::thread::scope(|s| {
            for (rec, keys, vk) in todo {
                s.spawn(move || self.take_over_retrying(rec, keys, vk, started));
            }
        });
    }

    /// Re-opens one mapping, retrying with a growing pause until
    /// `--reopen-timeout` from `started`; its parked requests are served
    /// once it is open, or failed (EIO) when it gives up.
    fn take_over_retrying(
        &self,
        rec: Record,
        keys: Vec<crate::rados::Secret>,
        volume_key: Option<crate::rados::Secret>,
        started: Instant,
    ) {
        let mut pause = Duration::from_millis(200);
        for tries in 1u32.. {
            let Some(node) = self.fs.node(rec.ino) else {
                return; // detached meanwhile
            };
            let took = self.take_over(&rec, &keys, volume_key.as_ref()).and_then(
                |(image, conn_key, addr, crypt)| {
                    let size = served_size(&image, crypt.as_deref()).unwrap_or(rec.size);
                    self.record_takeover(&rec, image, size, conn_key, addr)
                        .map(|image| (image, size, crypt))
                },
            );
            match took {
                Ok((image, size, crypt)) => {
                    if let Some(c) = crypt {
                        let _ = node.crypt.set(c);
                    }
                    node.size.store(size, Ordering::SeqCst);
                    let parked = node.set(Serving::Ready(Arc::new(image)));
                    tracing::info!(volume = %rec.volume_id, device = ?rec.device, tries,
                        waited = parked.len(), "took over a mapping of the previous worker");
                    for (hdr, reply) in parked {
                        fk::Handler::request(&*self.fs, &hdr, reply);
                    }
                    return;
                }
                Err(e) if started.elapsed() + pause < self.reopen_timeout => {
                    tracing::warn!(volume = %rec.volume_id, tries, error = %e,
                        "cannot re-open the image of a mapping yet; retrying");
                    let mut s = node.serving.write().unwrap_or_else(|e| e.into_inner());
                    if let Serving::Waiting(_, last) = &mut *s {
                        *last = Some(e.to_string());
                    }
                    drop(s);
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(10));
                }
                Err(e) => {
                    let why = format!(
                        "cannot re-open {} after the worker restarted ({tries} attempts in \
                         {:?}): {e}; its I/O fails (EIO): unstage and stage the volume again",
                        rec.image_spec(),
                        started.elapsed()
                    );
                    tracing::error!(volume = %rec.volume_id, "{why}");
                    for (_, reply) in node.set(Serving::Failed(why)) {
                        reply.error(libc::EIO);
                    }
                    return;
                }
            }
        }
    }

    fn attach(&self, spec: AttachSpec) -> Result<ControlResponse> {
        let vol = spec.volume_id.clone();
        self.ops.with(&vol, || self.attach_locked(spec))
    }

    fn attach_locked(&self, spec: AttachSpec) -> Result<ControlResponse> {
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
            let bs = block_size(&rec.options, node.crypt.get().map(|c| &**c), &vol)?;
            let dev = self.bind(&file, rec.read_only, &rec.options, bs)?;
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

        let _reserved = self.reserve(&vol, crate::node::fuse::queue_depth_of(&opts))?;
        let read_only = spec.read_only || spec.snapshot.is_some() || opts.read_only;
        let before_restart = self.lock_table().stale.get(&vol).cloned();
        let (conn_key, cluster) = self.connect(&spec, &opts)?;
        let opened = (|| {
            // The previous instance wrote this image: nothing of it may
            // land after our writes.
            if let Some(addr) = before_restart
                .as_ref()
                .filter(|_| !read_only)
                .and_then(|old| old.client_addr.as_deref())
            {
                self.fence(&cluster, addr, &vol)?;
            }
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
            let (crypt, key, size) = match &spec.encryption {
                Some(pass) => {
                    let (c, key) = unlock(&image, pass.expose().as_bytes(), &vol)?;
                    let h_size = image.size()?.saturating_sub(c.offset);
                    let size = h_size / c.sector_size() as u64 * c.sector_size() as u64;
                    (Some(c), Some(key), size)
                }
                None => (None, None, image.size()?),
            };
            block_size(&opts, crypt.as_deref(), &vol)?;
            Ok::<_, Error>((image, crypt, key, size))
        })();
        let opened = opened.and_then(|v| match &self.store {
            Some(store) => {
                store.put_key(&vol, &spec.key)?;
                if let Some(k) = &v.2 {
                    store.put_key(&luks_key_name(&vol), &k.to_secret())?;
                }
                Ok(v)
            }
            None => Ok(v),
        });
        let (image, crypt, _key, size) = match opened {
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
        let encrypted = crypt.is_some();
        let bs = block_size(&opts, crypt.as_deref(), &vol)?;
        let node = Arc::new(
            Node::new(
                ino,
                name.clone(),
                Serving::Ready(Arc::new(image)),
                size,
                read_only,
            )
            .encrypted(crypt, encrypted),
        );
        self.fs
            .nodes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ino, Arc::clone(&node));
        let file = self.mnt.join(&name);
        let dev = match self.bind(&file, read_only, &opts, bs) {
            Ok(d) => d,
            Err(e) => {
                self.fs
                    .nodes
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&ino);
                close_node(node, DRAIN_TIMEOUT);
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
            encrypted,
        };
        tracing::info!(volume = %vol, image = %rec.image_spec(), device = %dev.display(), size, encrypted, "attached");
        let mut t = self.lock_table();
        t.stale.remove(&vol);
        t.live.insert(
            vol,
            Live {
                rec,
                node,
                conn_key: Some(conn_key),
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
    fn bind(
        &self,
        file: &Path,
        read_only: bool,
        opts: &FuseMapOptions,
        block_size: u32,
    ) -> Result<PathBuf> {
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
                // krbd's sector size: filesystems made on either mount on
                // both (an encrypted volume's is its LUKS2 sector size, as
                // dm-crypt's). Direct I/O on a FUSE file only needs the loop
                // block size to be at least the file's DIO alignment, which
                // FUSE reports as 512 (no STATX_DIOALIGN, no backing bdev).
                block_size,
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

    fn detach(&self, vol: &str, force: bool, release_of: Option<&str>) -> Result<ControlResponse> {
        self.ops
            .with(vol, || self.detach_locked(vol, force, release_of))
    }

    fn detach_locked(
        &self,
        vol: &str,
        force: bool,
        release_of: Option<&str>,
    ) -> Result<ControlResponse> {
        if let Some(r) = self.finish_closing(vol, release_of) {
            return r;
        }
        let (live, stale) = {
            let t = self.lock_table();
            (
                t.live
                    .get(vol)
                    .map(|l| (l.rec.clone(), l.conn_key.clone(), Arc::clone(&l.node))),
                t.stale.get(vol).cloned(),
            )
        };
        let mut released = false;
        if let Some((rec, conn_key, node)) = live {
            let file = self.mnt.join(&rec.file);
            if node.open_image().is_none() {
                // Taken over but not open (or never to be): what waits for
                // it fails now, else clearing the device would wait for it.
                for (_, reply) in node.set(Serving::Failed(format!("{vol} was detached"))) {
                    reply.error(libc::EIO);
                }
            }
            if let Some(dev) = &rec.device {
                let dev = Path::new(dev);
                if loopdev::backing_file(dev).as_deref() == Some(file.as_path()) {
                    let busy = if force {
                        loopdev::in_use(dev)
                    } else {
                        loopdev::in_use_for(dev, BUSY_GRACE)
                    };
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
            drop(node);
            if let Some(l) = l {
                self.fs
                    .nodes
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&l.node.ino);
                if let Some(held) = close_node(l.node, self.drain_timeout()) {
                    // The lock stays until the image is closed: a write
                    // still in flight could land after another node's.
                    self.lock_closing()
                        .insert(vol.to_owned(), (held, rec.clone(), conn_key.clone()));
                    return Err(self.still_closing(vol));
                }
            }
            if let Some(node_id) = release_of {
                released = self.release_stage_lock(&rec, conn_key.as_ref(), node_id);
            }
            if let Some(k) = conn_key {
                self.drop_conn_if_unused(&k);
            }
            if let Some(store) = &self.store {
                store.drop_key(vol)?;
                store.drop_key(&luks_key_name(vol))?;
            }
            tracing::info!(volume = %vol, "detached");
        } else if let Some(rec) = stale {
            // Its device was cleared at start-up (a busy one on its last
            // close); should it still be bound to our file, clear it.
            if let Some(dev) = rec.device.as_deref().map(Path::new) {
                let ours = loopdev::backing_file(dev).is_some_and(|b| {
                    b.starts_with(&self.mnt) && b.file_name() == Some(rec.file.as_ref())
                });
                if ours {
                    loopdev::detach(dev)?;
                }
            }
            let mut t = self.lock_table();
            t.stale.remove(vol);
            self.save(&t)?;
            if let Some(store) = &self.store {
                store.drop_key(vol)?;
                store.drop_key(&luks_key_name(vol))?;
            }
            tracing::info!(volume = %vol, device = ?rec.device, "forgot a mapping from before the restart");
        }
        Ok(ControlResponse {
            ok: true,
            lock_released: release_of.map(|_| released),
            ..Default::default()
        })
    }

    /// How long a detach waits for the requests in flight on an image to
    /// end: each is bounded by the op timeout.
    fn drain_timeout(&self) -> Duration {
        DRAIN_TIMEOUT.max(self.timeout + Duration::from_secs(5))
    }

    /// Reserves `depth` of the FUSE connection's budget of requests in
    /// flight ([`fk::MAX_BACKGROUND`]) for `vol`'s attach. Mappings hold
    /// their queue depth of it, and so do attaches under way and detached
    /// images whose requests still drain: a device never has more requests
    /// in flight than its queue depth, so volumes whose pools stall hold
    /// only their own parts, and the kernel always has room for the
    /// others'. Refused (`NoSpace`) when the rest is too small.
    fn reserve(&self, vol: &str, depth: u32) -> Result<Reservation<'_>> {
        let draining: Vec<u32> = self
            .lock_closing()
            .values()
            .map(|(_, rec, _)| crate::node::fuse::queue_depth_of(&rec.options))
            .collect();
        let mut t = self.lock_table();
        let held: u32 = t
            .live
            .values()
            .map(|l| crate::node::fuse::queue_depth_of(&l.rec.options))
            .chain(t.attaching.values().copied())
            .chain(draining.iter().copied())
            .sum();
        let volumes = t.live.len() + t.attaching.len() + draining.len();
        let budget = u32::from(fk::MAX_BACKGROUND);
        if held + depth > budget || volumes >= fk::MAX_VOLUMES {
            return Err(Error::with_kind(
                ErrorKind::NoSpace,
                libc::ENOSPC,
                "attach",
                vol.to_owned(),
                format!(
                    "this mapper's FUSE connection has {} of its {budget} requests in flight \
                     left ({held} reserved by {volumes} volumes, at most {} volumes) and this \
                     volume's queue_depth is {depth}: detach a volume, or map with a smaller \
                     queue_depth",
                    budget.saturating_sub(held),
                    fk::MAX_VOLUMES
                ),
            ));
        }
        t.attaching.insert(vol.to_owned(), depth);
        Ok(Reservation {
            daemon: self,
            vol: vol.to_owned(),
        })
    }

    fn lock_closing(&self) -> std::sync::MutexGuard<'_, HashMap<String, Closing>> {
        self.closing.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn still_closing(&self, vol: &str) -> Error {
        Error::with_kind(
            ErrorKind::Busy,
            libc::EBUSY,
            "detach",
            vol.to_owned(),
            format!(
                "its device is cleared, but requests in flight still hold the image after {} s; \
                 it is closed (and its staging lock released) by a detach once they end",
                self.drain_timeout().as_secs()
            ),
        )
    }

    /// A detach of a volume whose image an earlier detach left to requests
    /// in flight: `Busy` while they hold it; once it is closed, the rest of
    /// that detach (the lock, the connection, the key). `None` for any
    /// other volume.
    fn finish_closing(
        &self,
        vol: &str,
        release_of: Option<&str>,
    ) -> Option<Result<ControlResponse>> {
        let mut closing = self.lock_closing();
        let (held, _, _) = closing.get(vol)?;
        if held.strong_count() > 0 {
            return Some(Err(self.still_closing(vol)));
        }
        let (_, rec, conn_key) = closing.remove(vol)?;
        drop(closing);
        let released =
            release_of.is_some_and(|n| self.release_stage_lock(&rec, conn_key.as_ref(), n));
        if let Some(k) = conn_key {
            self.drop_conn_if_unused(&k);
        }
        if let Some(store) = &self.store {
            if let Err(e) = store.drop_key(vol) {
                return Some(Err(e));
            }
        }
        tracing::info!(volume = %vol, "detached, once its last requests ended");
        Some(Ok(ControlResponse {
            ok: true,
            lock_released: release_of.map(|_| released),
            ..Default::default()
        }))
    }

    /// Releases `node_id`'s staging lock of `rec`'s image through the
    /// connection that served it (the stage's own credentials), once its
    /// device is cleared and the image closed. Whether it is released (or
    /// the image is gone); a failure is logged and left to the caller.
    fn release_stage_lock(&self, rec: &Record, conn_key: Option<&ConnKey>, node_id: &str) -> bool {
        let cluster = conn_key.and_then(|k| {
            self.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(k)
                .cloned()
        });
        let Some(cluster) = cluster else {
            return false;
        };
        let done = crate::node::stage_lock::ImageLock::open(
            &cluster,
            &rec.pool,
            &rec.namespace,
            &rec.image,
        )
        .and_then(|l| l.release(node_id));
        match done {
            Ok(()) => true,
            Err(e) if e.kind() == ErrorKind::NotFound => true,
            Err(e) => {
                tracing::warn!(volume = %rec.volume_id, error = %e,
                    "cannot release the staging lock; the node plugin will");
                false
            }
        }
    }

    fn refresh(&self, vol: &str) -> Result<ControlResponse> {
        self.ops.with(vol, || self.refresh_locked(vol))
    }

    fn refresh_locked(&self, vol: &str) -> Result<ControlResponse> {
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
        let Some(image) = node.open_image() else {
            return Err(Error::with_kind(
                ErrorKind::Busy,
                libc::EAGAIN,
                "refresh",
                vol.to_owned(),
                node.not_serving().unwrap_or_default(),
            ));
        };
        let size = match node.crypt.get() {
            Some(c) => {
                let s = c.sector_size() as u64;
                image.size()?.saturating_sub(c.offset) / s * s
            }
            None => image.size()?,
        };
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
            ControlRequest::Attach(spec) => self.attach(*spec),
            ControlRequest::Detach {
                volume_id,
                force,
                release_lock_of,
            } => self.detach(&volume_id, force, release_lock_of.as_deref()),
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
/// set`) that would win over it. Also refuses zero-copy writes with the
/// cache on: the cache keeps the buffer and never answers the write.
fn require_write_through(image: &Image, volume: &str) -> Result<()> {
    let config = image.config_list()?;
    let value = |name: &str| config.iter().find(|o| o.name == name);
    let cache_on = value("rbd_cache").is_none_or(|o| o.value == "true");
    let zero_copy = value("rbd_disable_zero_copy_writes").filter(|z| z.value == "false");
    if let (Some(z), true) = (zero_copy, cache_on) {
        let cache = value("rbd_cache").map_or("default".to_owned(), |c| format!("{:?}", c.source));
        return Err(Error::invalid(
            "attach",
            volume,
            format!(
                "zero-copy writes (rbd_disable_zero_copy_writes=false, a {:?}-level setting) \
                 with librbd's cache on (rbd_cache, a {cache}-level setting): the cache would \
                 keep the mapper's buffer and never answer the write; turn one of them off",
                z.source
            ),
        ));
    }
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
/// `queue_depth` option (default [`crate::node::fuse::VOLUME_QUEUE_DEPTH`],
/// what the attach reserved) as `nr_requests`.
fn tune_device(dev: &Path, opts: &FuseMapOptions) -> Result<()> {
    let kib = fk::MAX_WRITE / 1024;
    if let Err(e) = loopdev::set_queue_attr(dev, "max_sectors_kb", &kib.to_string()) {
        tracing::warn!(device = %dev.display(), error = %e, "cannot set max_sectors_kb");
    }
    // Always written: a loop device keeps its queue settings across binds,
    // so a reused one would inherit the previous mapping's.
    let n = crate::node::fuse::queue_depth_of(opts);
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
/// Flushes and closes the image of `node` once no request holds it (no
/// new one can reach it: it is out of the filesystem's table), waiting up
/// to `drain`. `None` once closed (or nothing was open); otherwise the
/// image, still held by requests in flight, which close it when the last
/// of them lets go.
fn close_node(node: Arc<Node>, drain: Duration) -> Option<std::sync::Weak<Image>> {
    let deadline = Instant::now() + drain;
    let mut node = node;
    let node = loop {
        match Arc::try_unwrap(node) {
            Ok(n) => break n,
            Err(shared) if Instant::now() < deadline => {
                node = shared;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(shared) => return shared.open_image().map(|i| Arc::downgrade(&i)),
        }
    };
    let Serving::Ready(mut image) = node.serving.into_inner().unwrap_or_else(|e| e.into_inner())
    else {
        return None;
    };
    loop {
        match Arc::try_unwrap(image) {
            Ok(img) => {
                let spec = img.spec();
                if let Err(e) = img.flush().and_then(|()| img.close()) {
                    tracing::warn!(image = %spec, error = %e, "closing the image failed");
                }
                return None;
            }
            Err(shared) if Instant::now() < deadline => {
                image = shared;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(shared) => return Some(Arc::downgrade(&shared)),
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
    // An attach carries a key: the bytes are read into a buffer that never
    // grows (no copy left behind) and is zeroed as each line is consumed.
    let mut pending = SecretBuf::with_capacity(1 << 20);
    loop {
        let line_end = loop {
            if let Some(i) = pending.bytes().iter().position(|&b| b == b'\n') {
                break i;
            }
            let before = pending.len();
            let spare = pending.spare();
            if spare.is_empty() {
                return; // a line of 1 MiB: not a request of ours
            }
            match (&stream).read(spare) {
                Ok(0) | Err(_) => {
                    pending.fill(before, 0);
                    return;
                }
                Ok(n) => pending.fill(before, n),
            }
        };
        let parsed = serde_json::from_slice::<ControlRequest>(&pending.bytes()[..line_end]);
        pending.consume(line_end + 1);
        let resp = match parsed {
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
    crate::node::fuse_supervisor::no_core_dumps();
    crate::telemetry::init(crate::telemetry::LogFormat::Text);
    if let Some(dir) = test_hold_dir() {
        tracing::warn!(
            dir = %dir.display(),
            "test hook {TEST_HOLD_WRITES_ENV} is set: a WRITE arriving while `hold` exists \
             in that folder is never answered (for tests only)"
        );
    }
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
    let (channels, journal, held, init, resumed, keys) = match kept {
        Some(crate::node::fuse_supervisor::Kept {
            session: Some((init, mut fds)),
            keys,
        }) if !fds.is_empty() => {
            // A previous worker died; its connection lives on in the
            // supervisor, and its journal with the requests it had read.
            let (journal, held) = Journal::open(fds.remove(0))?;
            let channels: Vec<Arc<fk::Channel>> = fds
                .into_iter()
                .map(|fd| Arc::new(fk::Channel::from_fd(fd)))
                .collect();
            (channels, journal, held, init, true, keys)
        }
        other => {
            let cleared = recover(&mnt);
            std::fs::create_dir_all(&mnt).map_err(|e| io_err(e, "mkdir", &mnt))?;
            let journal = Journal::create()?;
            let session = fk::mount(&mnt, "rbdkit-fuse")?;
            let channels = fk::clone_channels(&session, args.threads)?;
            if let Some(s) = &store {
                let mut fds = vec![journal.fd()];
                fds.extend(channels.iter().map(|c| c.as_fd()));
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
            (channels, journal, Vec::new(), session.init, false, keys)
        }
    };
    tracing::info!(
        mount = %mnt.display(),
        kernel_minor = init.kernel_minor,
        minor = init.minor,
        max_write = init.max_write,
        kernel_resend = init.resend,
        threads = channels.len(),
        resumed,
        "FUSE filesystem ready"
    );
    let daemon = Arc::new(Daemon {
        state_dir: state_dir.clone(),
        mnt: mnt.clone(),
        fs: Arc::clone(&fs),
        table: Mutex::new(Table::default()),
        ops: VolumeOps::default(),
        conns: Mutex::new(HashMap::new()),
        timeout: args.timeout,
        store: daemon_store,
        dead_clients: Mutex::new(if args.blocklist_dead_clients {
            dead_clients_of(&old.attachments)
        } else {
            Vec::new()
        }),
        fenced: Mutex::new(Default::default()),
        closing: Mutex::new(HashMap::new()),
        reopen_timeout: args.reopen_timeout,
    });
    // Every mapping the dead worker served is served again under the same
    // inode at once; its requests wait until its image is open and the dead
    // worker fenced (`take_over_all`, below).
    let mut takeover = Vec::new();
    for rec in &old.attachments {
        match (resumed, keys.get(&rec.volume_id)) {
            (true, Some(key)) => {
                // Its own key first, then those of the same user (rotated).
                let mut ks = vec![key.clone()];
                for r in &old.attachments {
                    if r.user == rec.user && r.monitors == rec.monitors {
                        if let Some(k) = keys.get(&r.volume_id) {
                            if !ks.contains(k) {
                                ks.push(k.clone());
                            }
                        }
                    }
                }
                let vk = keys.get(&luks_key_name(&rec.volume_id)).cloned();
                let node = Arc::new(
                    Node::new(
                        rec.ino,
                        rec.file.clone(),
                        Serving::Waiting(Vec::new(), None),
                        rec.size,
                        rec.read_only,
                    )
                    .encrypted(None, rec.encrypted),
                );
                fs.nodes
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(rec.ino, Arc::clone(&node));
                table.live.insert(
                    rec.volume_id.clone(),
                    Live {
                        rec: rec.clone(),
                        node,
                        conn_key: None,
                    },
                );
                takeover.push((rec.clone(), ks, vk));
            }
            _ => {
                table.stale.insert(rec.volume_id.clone(), rec.clone());
            }
        }
    }
    if resumed {
        clear_unrecorded_devices(&mnt, &mut table);
    }
    *daemon.lock_table() = table;
    daemon.save(&daemon.lock_table())?;
    // The requests the dead worker had read (the kernel keeps them until
    // they are answered, on every kernel) are served again from its
    // journal before any new one is read; those of a mapping being taken
    // over wait for it.
    if resumed {
        let (replayed, answered) = fk::replay(&channels, held, &*fs);
        tracing::info!(
            replayed,
            answered,
            "journal: took over the requests the previous worker had read and not answered"
        );
    }
    if !takeover.is_empty() {
        let daemon = Arc::clone(&daemon);
        std::thread::spawn(move || daemon.take_over_all(takeover));
    }
    journal.start_trimming();
    let readers = fk::serve(&channels, &journal, Arc::clone(&fs))?;

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
                .filter_map(|l| l.node.open_image())
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
                    close_node(l.node, DRAIN_TIMEOUT);
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
