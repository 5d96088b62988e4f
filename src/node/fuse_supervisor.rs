//! The supervisor of `rbdkit fuse-mapper`: a small parent process (PID 1
//! of the mapper's container) that does nothing but keep file descriptors
//! and keys alive and restart the worker that serves I/O.
//!
//! The kernel's FUSE connection lives as long as one `/dev/fuse` fd of it
//! is open. The worker mounts the filesystem and hands every channel fd it
//! reads from to the supervisor (`SCM_RIGHTS` over
//! `<state-dir>/supervisor.sock`), and each attached volume's cephx key.
//! When the worker dies (even `kill -9`), the connection, the FUSE files
//! and the loop devices on them stay; I/O waits in the kernel. The
//! supervisor starts a new worker, which takes the fds and keys back,
//! re-opens the images, and serves again the requests the dead worker had
//! read but not answered, from the journal it read them into (on every
//! kernel: see [`crate::node::fuse_daemon`]). A filesystem mounted on a
//! device therefore survives the worker's death.
//!
//! The worker dies with the supervisor (`PR_SET_PDEATHSIG`): if the
//! supervisor itself goes, everything goes, and the next start recovers
//! as described in [`crate::node::fuse_daemon`]. The worker's request
//! journal ([`crate::node::fuse_journal`]) is one more fd kept here.
//!
//! Keys are only ever in the memory of these two processes, and not in a
//! core dump of either: both are non-dumpable (`PR_SET_DUMPABLE` 0: no core
//! dump, no reading of their memory without `CAP_SYS_PTRACE`), every key
//! is a [`Secret`] (its own `MADV_DONTDUMP` page, zeroed when dropped), and
//! the buffers a key passes through on the sockets are zeroed after use.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::node::fuse_daemon::{peer_uid, FuseMapperArgs};
use crate::node::fuse_kernel::InitInfo;
use crate::rados::Secret;

/// Most fds one message carries (one per FUSE reader thread).
const MAX_FDS: usize = 64;
/// Bound on one exchange with the supervisor.
const STORE_TIMEOUT: Duration = Duration::from_secs(10);

/// One request of the worker to the supervisor.
#[derive(Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum StoreRequest {
    /// What is kept: the session (with its fds) and the keys.
    Get,
    /// Keep these fds (attached) of the mounted session.
    PutSession { init: InitInfo },
    /// Keep the key of a volume.
    PutKey {
        volume_id: String,
        #[serde(with = "crate::node::fuse::secret_serde")]
        key: Secret,
    },
    /// Forget the key of a volume.
    DropKey { volume_id: String },
    /// Close the session's fds (a clean stop).
    DropSession,
}

#[derive(Serialize, Deserialize, Default)]
struct StoreResponse {
    ok: bool,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    session: Option<InitInfo>,
    #[serde(default)]
    keys: Vec<KeptKey>,
}

/// One volume's key on the wire.
#[derive(Serialize, Deserialize)]
struct KeptKey {
    volume_id: String,
    #[serde(with = "crate::node::fuse::secret_serde")]
    key: Secret,
}

/// Makes this process non-dumpable ([`crate::rados::keep_keys_out_of_core_dumps`]):
/// keys are in it. `main` does it too; library users of the mapper may not.
pub(crate) fn no_core_dumps() {
    if let Err(e) = crate::rados::keep_keys_out_of_core_dumps() {
        tracing::warn!(error = %e, "cannot make the process non-dumpable");
    }
}

/// A byte buffer that may hold a key: its capacity is fixed up front (it
/// never reallocates, leaving a copy behind) and it is zeroed when dropped.
pub(crate) struct SecretBuf(Vec<u8>);

impl SecretBuf {
    /// An empty buffer for up to `cap` bytes.
    pub(crate) fn with_capacity(cap: usize) -> SecretBuf {
        SecretBuf(Vec::with_capacity(cap))
    }

    /// `value` as one JSON line, in a buffer of exactly its size.
    pub(crate) fn json_line<T: Serialize>(value: &T) -> SecretBuf {
        struct Count(usize);
        impl Write for Count {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0 += b.len();
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut n = Count(0);
        serde_json::to_writer(&mut n, value).expect("serialises");
        let mut buf = SecretBuf::with_capacity(n.0 + 1);
        serde_json::to_writer(&mut buf, value).expect("serialises");
        buf.0.push(b'\n');
        buf
    }

    /// The bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// Appends what fits of `b` without growing; returns how much did.
    pub(crate) fn push(&mut self, b: &[u8]) -> usize {
        let n = b.len().min(self.0.capacity() - self.0.len());
        self.0.extend_from_slice(&b[..n]);
        n
    }

    /// Whether it is full.
    pub(crate) fn is_full(&self) -> bool {
        self.0.len() == self.0.capacity()
    }

    /// Drops the first `n` bytes, moving the rest to the front; the bytes
    /// left behind are zeroed.
    pub(crate) fn consume(&mut self, n: usize) {
        let len = self.0.len();
        let n = n.min(len);
        self.0.copy_within(n.., 0);
        crate::rados::zeroize(&mut self.0[len - n..]);
        self.0.truncate(len - n);
    }

    /// The spare capacity as a zeroed slice to read into: `fill(n)` then
    /// keeps `n` bytes of it.
    pub(crate) fn spare(&mut self) -> &mut [u8] {
        let len = self.0.len();
        self.0.resize(self.0.capacity(), 0);
        &mut self.0[len..]
    }

    /// Keeps `n` bytes of what [`SecretBuf::spare`] lent.
    pub(crate) fn fill(&mut self, before: usize, n: usize) {
        self.0.truncate(before + n);
    }

    /// How many bytes it holds.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

impl Write for SecretBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.push(b) < b.len() {
            return Err(std::io::Error::other("secret buffer full"));
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for SecretBuf {
    fn drop(&mut self) {
        crate::rados::zeroize(&mut self.0);
        // The spare capacity may hold bytes of an earlier, longer content.
        // It is not initialised memory to Rust, so it is written through
        // `MaybeUninit` (never read, never made a `&[u8]`), volatile so
        // the stores before the free are kept.
        for b in self.0.spare_capacity_mut() {
            // SAFETY: `b` is a byte of this Vec's allocation, valid and
            // aligned for a write of one u8; writing reads nothing.
            unsafe { std::ptr::write_volatile(b.as_mut_ptr(), 0) };
        }
        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    }
}

/// The largest message on the supervisor socket.
const MAX_MESSAGE: usize = 1 << 20;

/// What a (re)started worker gets back.
pub struct Kept {
    /// The mounted session and its channel fds, if a previous worker made one.
    pub session: Option<(InitInfo, Vec<OwnedFd>)>,
    /// The keys by volume id.
    pub keys: HashMap<String, Secret>,
}

fn io_err(e: std::io::Error, op: &'static str, object: &Path) -> Error {
    Error::from_errno(
        e.raw_os_error().unwrap_or(libc::EIO),
        op,
        object.display().to_string(),
    )
}

/// Sends `data` with `fds` attached (`sendmsg(2)` with `SCM_RIGHTS`).
fn send_with_fds(stream: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    let raw: Vec<libc::c_int> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let fd_bytes = std::mem::size_of_val(raw.as_slice()) as u32;
    // SAFETY: CMSG_SPACE only computes a size (cmsg(3)).
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8).max(1)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: all-zero is a valid `msghdr` (pointers null, lengths 0).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` has a control buffer of CMSG_SPACE(fd_bytes) bytes,
        // 8-aligned, so CMSG_FIRSTHDR is non-null and CMSG_DATA has room
        // for the fds (cmsg(3)).
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(c),
                fd_bytes as usize,
            );
        }
    }
    // SAFETY: `msg` points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if (n as usize) < data.len() {
        (&*stream).write_all(&data[n as usize..])?;
    }
    Ok(())
}

/// Reads one newline-terminated message and the fds sent with its first
/// bytes (`recvmsg(2)`, `MSG_CMSG_CLOEXEC`), into a buffer zeroed after use.
fn recv_with_fds(stream: &UnixStream) -> std::io::Result<(SecretBuf, Vec<OwnedFd>)> {
    let mut data = SecretBuf::with_capacity(MAX_MESSAGE);
    let mut chunk = SecretBuf::with_capacity(64 * 1024);
    // Zero-filled, not `set_len` over uninitialised bytes: it is handed to
    // `read` as a `&mut [u8]` below.
    chunk.0.resize(chunk.0.capacity(), 0);
    // SAFETY: CMSG_SPACE only computes a size.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<libc::c_int>()) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: chunk.0.as_mut_ptr().cast(),
        iov_len: chunk.0.len(),
    };
    // SAFETY: all-zero is a valid `msghdr`.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at live, writable buffers of the given sizes.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote, with the
    // cmsg(3) macros, within `msg_controllen`; each SCM_RIGHTS payload is
    // an array of fds that are now ours.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let count = len / std::mem::size_of::<libc::c_int>();
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let mut got = n as usize;
    loop {
        data.push(&chunk.0[..got]);
        if got == 0 || data.bytes().ends_with(b"\n") {
            break;
        }
        if data.is_full() {
            return Err(std::io::Error::other("message too long"));
        }
        got = (&*stream).read(&mut chunk.0)?;
    }
    Ok((data, fds))
}

/// The worker's side of the supervisor socket.
#[derive(Debug, Clone)]
pub struct StoreClient {
    path: PathBuf,
}

impl StoreClient {
    /// The store at `<state-dir>/supervisor.sock`.
    pub fn new(state_dir: &Path) -> StoreClient {
        StoreClient {
            path: state_dir.join("supervisor.sock"),
        }
    }

    fn call(
        &self,
        req: &StoreRequest,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(StoreResponse, Vec<OwnedFd>)> {
        let s = UnixStream::connect(&self.path).map_err(|e| {
            io_err(e, "connect", &self.path).detail("the fuse-mapper supervisor is not reachable")
        })?;
        s.set_read_timeout(Some(STORE_TIMEOUT))
            .and_then(|()| s.set_write_timeout(Some(STORE_TIMEOUT)))
            .map_err(|e| io_err(e, "setsockopt", &self.path))?;
        let line = SecretBuf::json_line(req);
        send_with_fds(&s, line.bytes(), fds).map_err(|e| io_err(e, "sendmsg", &self.path))?;
        let (data, got) = recv_with_fds(&s).map_err(|e| io_err(e, "recvmsg", &self.path))?;
        let resp: StoreResponse = serde_json::from_slice(data.bytes()).map_err(|_| {
            Error::invalid(
                "recvmsg",
                self.path.display().to_string(),
                "bad answer from the supervisor",
            )
        })?;
        if !resp.ok {
            return Err(Error::invalid(
                "supervisor",
                self.path.display().to_string(),
                resp.error.unwrap_or_default(),
            ));
        }
        Ok((resp, got))
    }

    /// What the supervisor keeps.
    pub fn get(&self) -> Result<Kept> {
        let (resp, fds) = self.call(&StoreRequest::Get, &[])?;
        Ok(Kept {
            session: resp.session.map(|i| (i, fds)),
            keys: resp
                .keys
                .into_iter()
                .map(|k| (k.volume_id, k.key))
                .collect(),
        })
    }

    /// Hands the session's channel fds to the supervisor.
    pub fn put_session(&self, init: InitInfo, fds: &[BorrowedFd<'_>]) -> Result<()> {
        self.call(&StoreRequest::PutSession { init }, fds)
            .map(|_| ())
    }

    /// Keeps a volume's key.
    pub fn put_key(&self, volume_id: &str, key: &Secret) -> Result<()> {
        let req = StoreRequest::PutKey {
            volume_id: volume_id.to_owned(),
            key: key.clone(),
        };
        self.call(&req, &[]).map(|_| ())
    }

    /// Forgets a volume's key.
    pub fn drop_key(&self, volume_id: &str) -> Result<()> {
        let req = StoreRequest::DropKey {
            volume_id: volume_id.to_owned(),
        };
        self.call(&req, &[]).map(|_| ())
    }

    /// Closes the kept session (a clean stop).
    pub fn drop_session(&self) -> Result<()> {
        self.call(&StoreRequest::DropSession, &[]).map(|_| ())
    }
}

#[derive(Default)]
struct Store {
    session: Option<(InitInfo, Vec<OwnedFd>)>,
    keys: HashMap<String, Secret>,
}

fn serve_store(store: &Mutex<Store>, stream: UnixStream) {
    if peer_uid(&stream) != Some(0) {
        return;
    }
    let _ = stream.set_read_timeout(Some(STORE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(STORE_TIMEOUT));
    let Ok((data, fds)) = recv_with_fds(&stream) else {
        return;
    };
    let mut resp = StoreResponse {
        ok: true,
        ..Default::default()
    };
    let mut st = store.lock().unwrap_or_else(|e| e.into_inner());
    let reply_fds: Vec<BorrowedFd<'_>>;
    match serde_json::from_slice::<StoreRequest>(data.bytes()) {
        Err(_) => {
            resp.ok = false;
            resp.error = Some("malformed request".into());
            reply_fds = Vec::new();
        }
        Ok(StoreRequest::Get) => {
            resp.session = st.session.as_ref().map(|(i, _)| *i);
            resp.keys = st
                .keys
                .iter()
                .map(|(k, v)| KeptKey {
                    volume_id: k.clone(),
                    key: v.clone(),
                })
                .collect();
            reply_fds = st
                .session
                .as_ref()
                .map(|(_, f)| {
                    f.iter()
                        .map(|fd| {
                            use std::os::fd::AsFd;
                            fd.as_fd()
                        })
                        .collect()
                })
                .unwrap_or_default();
        }
        Ok(StoreRequest::PutSession { init }) => {
            tracing::info!(fds = fds.len(), "supervisor keeps the FUSE session");
            st.session = Some((init, fds));
            reply_fds = Vec::new();
        }
        Ok(StoreRequest::PutKey { volume_id, key }) => {
            st.keys.insert(volume_id, key);
            reply_fds = Vec::new();
        }
        Ok(StoreRequest::DropKey { volume_id }) => {
            st.keys.remove(&volume_id);
            reply_fds = Vec::new();
        }
        Ok(StoreRequest::DropSession) => {
            st.session = None;
            reply_fds = Vec::new();
        }
    }
    let line = SecretBuf::json_line(&resp);
    drop(resp);
    let _ = send_with_fds(&stream, line.bytes(), &reply_fds);
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn install_stop_handler() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: `on_stop` only stores to an atomic, which is
        // async-signal-safe (signal-safety(7)); the sigaction is zeroed
        // (no flags, empty mask) apart from the handler.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_stop as extern "C" fn(libc::c_int) as usize;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// Runs the supervisor: keeps the store, starts the worker and restarts it
/// whenever it dies, until a clean stop.
pub fn supervise(args: FuseMapperArgs) -> Result<()> {
    no_core_dumps();
    crate::telemetry::init(crate::telemetry::LogFormat::Text);
    let dir = &args.state_dir;
    std::fs::create_dir_all(dir).map_err(|e| io_err(e, "mkdir", dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| io_err(e, "chmod", dir))?;
    let path = dir.join("supervisor.sock");
    if path.exists() {
        if UnixStream::connect(&path).is_ok() {
            return Err(
                Error::from_errno(libc::EADDRINUSE, "bind", path.display().to_string())
                    .detail("another fuse-mapper supervisor runs on this state dir"),
            );
        }
        std::fs::remove_file(&path).map_err(|e| io_err(e, "unlink", &path))?;
    }
    // SAFETY: umask(2) cannot fail; the socket is 0600 from birth.
    let old = unsafe { libc::umask(0o177) };
    let listener = UnixListener::bind(&path);
    // SAFETY: restores the previous mask.
    unsafe { libc::umask(old) };
    let listener = listener.map_err(|e| io_err(e, "bind", &path))?;
    install_stop_handler();

    let store = Arc::new(Mutex::new(Store::default()));
    {
        let store = Arc::clone(&store);
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                serve_store(&store, s);
            }
        });
    }
    let exe =
        std::env::current_exe().map_err(|e| io_err(e, "readlink", Path::new("/proc/self/exe")))?;
    let mut recent = Vec::<Instant>::new();
    loop {
        let mut cmd = Command::new(&exe);
        cmd.arg("fuse-mapper");
        if args.blocklist_dead_clients {
            cmd.arg("--blocklist-dead-clients");
        }
        let mut child = cmd
            .arg("--worker")
            .arg("--socket")
            .arg(&args.socket)
            .arg("--state-dir")
            .arg(&args.state_dir)
            .arg("--threads")
            .arg(args.threads.to_string())
            .arg("--io-threads")
            .arg(args.io_threads.to_string())
            .arg("--timeout")
            .arg(humantime::format_duration(args.timeout).to_string())
            .arg("--reopen-timeout")
            .arg(humantime::format_duration(args.reopen_timeout).to_string())
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| io_err(e, "spawn", &exe))?;
        tracing::info!(pid = child.id(), "started the fuse-mapper worker");
        let status = loop {
            if STOP.load(Ordering::SeqCst) {
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                let deadline = Instant::now() + Duration::from_secs(30);
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = child.try_wait() {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = child.kill();
                let _ = child.wait();
                return Ok(());
            }
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => return Err(io_err(e, "waitpid", &exe)),
            }
        };
        if status.success() {
            tracing::info!("the worker stopped cleanly; stopping");
            return Ok(());
        }
        tracing::warn!(%status, "the fuse-mapper worker died; restarting it");
        // Back off when it keeps dying: at most 5 restarts in 10 s at full speed.
        recent.retain(|t| t.elapsed() < Duration::from_secs(10));
        recent.push(Instant::now());
        let pause = if recent.len() > 5 { 2000 } else { 100 };
        std::thread::sleep(Duration::from_millis(pause));
    }
}
