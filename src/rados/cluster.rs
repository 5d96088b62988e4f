//! Connecting to a Ceph cluster: [`ConnectOptions`] and [`Cluster`].

use std::ffi::CString;
use std::fmt;
use std::os::raw::c_char;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use rbd_sys as sys;

use crate::error::{cvt, Error, Result};
use crate::rados::{zeroize, IoCtx, Secret};
use crate::util::{cstr, split_nul_list, with_growing_buffer};

/// Default bound on `rados_connect`: Ceph's own `client_mount_timeout` is 300 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default bound on monitor and OSD operations: Ceph's own default waits forever.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(30);

/// Held around every `rados_conf_parse_env`, which shares one static buffer
/// between all handles of the process.
static PARSE_ENV_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The timeouts `connect` bounds, in the order of its defaults.
const TIMEOUT_OPTIONS: [&str; 3] = [
    "client_mount_timeout",
    "rados_mon_op_timeout",
    "rados_osd_op_timeout",
];

/// Checks that a cephx key is what librados can decode (base64 of a
/// `CryptoKey`: type u16, created 8 bytes, length u16, secret), so that
/// librados never sees a bad one: it logs the value of a key it cannot
/// decode. The error never shows the value.
fn check_key(key: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::invalid(
            "rados_conf_set",
            "key",
            format!("the cephx key is not valid ({why}; value not shown)"),
        ))
    };
    let Some(raw) = base64_decode(key.trim().as_bytes()) else {
        return bad("not base64");
    };
    let mut raw = raw;
    let ok = raw.len() >= 12 && {
        let kind = u16::from_le_bytes([raw[0], raw[1]]);
        let len = u16::from_le_bytes([raw[10], raw[11]]) as usize;
        // 0 = none, 1 = AES (16-byte secret), 2 = AES-256-KRB5 (32-byte
        // secret; the default for new keys from Ceph 20 Tentacle on).
        raw.len() == 12 + len && (kind == 0 || ((kind == 1 || kind == 2) && len >= 16))
    };
    zeroize(&mut raw);
    if ok {
        Ok(())
    } else {
        bad("base64, but not an encoded cephx key")
    }
}

/// Standard base64 with `=` padding (what `ceph auth print-key` prints).
fn base64_decode(text: &[u8]) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    if text.is_empty() || !text.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let groups = text.len() / 4;
    for (i, g) in text.chunks(4).enumerate() {
        let pad = g.iter().rev().take_while(|c| **c == b'=').count();
        if pad > 2 || (pad > 0 && i + 1 != groups) {
            return None;
        }
        let mut n = 0u32;
        for c in &g[..4 - pad] {
            n = (n << 6) | value(*c)?;
        }
        n <<= 6 * pad as u32;
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pad]);
    }
    Some(out)
}

/// True for config option names that hold a cephx key (`key`, spelled
/// with spaces, dashes or underscores and any case).
fn is_key_option(option: &str) -> bool {
    option.trim().eq_ignore_ascii_case("key")
}

/// Where librados reads its configuration from.
#[derive(Debug, Clone, Default)]
enum ConfSource {
    /// `rados_conf_read_file(NULL)`: `$CEPH_CONF`, then the usual paths.
    #[default]
    Default,
    /// One ceph.conf file.
    File(PathBuf),
    /// No file at all: monitors, user and key come from the options.
    None,
}

/// How to connect: a ceph.conf, or monitors plus a cephx user and key, plus
/// timeouts and config overrides. Build one, then call [`ConnectOptions::connect`].
///
/// ```no_run
/// use std::time::Duration;
/// use rbdkit::rados::{ConnectOptions, Secret};
///
/// // From a ceph.conf (or $CEPH_CONF):
/// let cluster = ConnectOptions::new().connect()?;
///
/// // With no file, as a Kubernetes Secret supplies it:
/// let cluster = ConnectOptions::new()
///     .mon_host("10.0.0.1:6789,10.0.0.2:6789")
///     .user("kubernetes")
///     .key(Secret::new("AQD...=="))
///     .op_timeout(Duration::from_secs(20))
///     .connect()?;
/// # Ok::<(), rbdkit::Error>(())
/// ```
#[derive(Clone)]
pub struct ConnectOptions {
    source: ConfSource,
    user: String,
    mon_host: Option<String>,
    key: Option<Secret>,
    keyring: Option<PathBuf>,
    overrides: Vec<(String, String)>,
    connect_timeout: Option<Duration>,
    mon_op_timeout: Option<Duration>,
    osd_op_timeout: Option<Duration>,
    /// Monitor and manager commands wait for their answer without a bound
    /// of librados' own: only for [`Cluster::mgr_command`]'s connection,
    /// whose caller bounds the wait instead.
    unbounded_mon_ops: bool,
}

impl fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let overrides: Vec<(&str, &str)> = self
            .overrides
            .iter()
            .map(|(k, v)| {
                let shown = if is_key_option(k) { "<redacted>" } else { v };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("ConnectOptions")
            .field("source", &self.source)
            .field("user", &self.user)
            .field("mon_host", &self.mon_host)
            .field("key", &self.key)
            .field("keyring", &self.keyring)
            .field("overrides", &overrides)
            .field("connect_timeout", &self.connect_timeout)
            .field("mon_op_timeout", &self.mon_op_timeout)
            .field("osd_op_timeout", &self.osd_op_timeout)
            .field("unbounded_mon_ops", &self.unbounded_mon_ops)
            .finish()
    }
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions::new()
    }
}

impl ConnectOptions {
    /// Options that read `$CEPH_CONF` or the default ceph.conf paths, as user
    /// `admin`, with the default timeouts.
    pub fn new() -> ConnectOptions {
        ConnectOptions {
            source: ConfSource::Default,
            user: "admin".into(),
            mon_host: None,
            key: None,
            keyring: None,
            overrides: Vec::new(),
            connect_timeout: None,
            mon_op_timeout: None,
            osd_op_timeout: None,
            unbounded_mon_ops: false,
        }
    }

    /// Reads this ceph.conf instead of the default search.
    pub fn conf_file(mut self, path: impl AsRef<Path>) -> Self {
        self.source = ConfSource::File(path.as_ref().to_path_buf());
        self
    }

    /// Reads no ceph.conf at all; give monitors and a key (or keyring) instead.
    pub fn no_conf_file(mut self) -> Self {
        self.source = ConfSource::None;
        self
    }

    /// The cephx user id without the `client.` prefix (default `admin`).
    pub fn user(mut self, id: impl Into<String>) -> Self {
        let id = id.into();
        self.user = id.strip_prefix("client.").map(str::to_owned).unwrap_or(id);
        self
    }

    /// Monitor addresses, comma-separated (`mon_host`). Setting monitors
    /// without a conf file implies [`ConnectOptions::no_conf_file`] unless a
    /// file was named.
    pub fn mon_host(mut self, mons: impl Into<String>) -> Self {
        self.mon_host = Some(mons.into());
        if matches!(self.source, ConfSource::Default) {
            self.source = ConfSource::None;
        }
        self
    }

    /// The cephx key of the user, base64.
    pub fn key(mut self, key: impl Into<Secret>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// A keyring file to read the key from.
    pub fn keyring(mut self, path: impl AsRef<Path>) -> Self {
        self.keyring = Some(path.as_ref().to_path_buf());
        self
    }

    /// Sets any librados config option (`rados_conf_set`), after the file is read.
    pub fn set(mut self, option: impl Into<String>, value: impl Into<String>) -> Self {
        self.overrides.push((option.into(), value.into()));
        self
    }

    /// Bound on `rados_connect` (`client_mount_timeout`).
    pub fn connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = Some(t);
        self
    }

    /// Bound on monitor and OSD operations (`rados_mon_op_timeout`,
    /// `rados_osd_op_timeout`).
    pub fn op_timeout(mut self, t: Duration) -> Self {
        self.mon_op_timeout = Some(t);
        self.osd_op_timeout = Some(t);
        self
    }

    /// Bound on monitor operations only (`rados_mon_op_timeout`).
    pub fn mon_op_timeout(mut self, t: Duration) -> Self {
        self.mon_op_timeout = Some(t);
        self
    }

    /// Bound on OSD operations only (`rados_osd_op_timeout`); this also bounds
    /// every librbd call, since librbd does its I/O through librados.
    pub fn osd_op_timeout(mut self, t: Duration) -> Self {
        self.osd_op_timeout = Some(t);
        self
    }

    /// These options, with monitor and manager commands that wait for
    /// their answer without librados' bound: only for
    /// [`Cluster::mgr_command`]'s connection, whose caller bounds the wait.
    pub(super) fn with_unbounded_mon_ops(&self) -> ConnectOptions {
        let mut o = self.clone();
        o.unbounded_mon_ops = true;
        o
    }

    /// The cephx user id this connects as.
    pub fn user_id(&self) -> &str {
        &self.user
    }

    /// Names the cluster for errors: its monitors (as configured), the conf
    /// file they came from, and the user.
    fn label(&self, handle: &ClusterHandle) -> String {
        let mons = handle
            .conf_get("mon_host")
            .ok()
            .filter(|m| !m.trim().is_empty())
            .or_else(|| self.mon_host.clone())
            .unwrap_or_else(|| "no monitors configured".into());
        let conf = match &self.source {
            ConfSource::File(p) => format!(", conf {}", p.display()),
            ConfSource::Default => match std::env::var("CEPH_CONF") {
                Ok(p) => format!(", conf {p}"),
                Err(_) => ", default ceph.conf".into(),
            },
            ConfSource::None => String::new(),
        };
        format!("cluster mon_host={mons}{conf} as client.{}", self.user)
    }

    /// Creates the handle, applies the configuration and connects.
    ///
    /// Wraps `rados_create2`, `rados_conf_read_file`, `rados_conf_set` and
    /// `rados_connect`. Timeouts: an explicit option wins; otherwise a non-zero
    /// value that the conf file, `CEPH_ARGS` or [`ConnectOptions::set`]
    /// changed from Ceph's built-in one is kept; otherwise the defaults
    /// ([`DEFAULT_CONNECT_TIMEOUT`], [`DEFAULT_OP_TIMEOUT`]) apply, so no call
    /// can wait forever.
    pub fn connect(&self) -> Result<Cluster> {
        let target = format!("client.{}", self.user);
        let name = cstr(&target, "rados_create2", "user name")?;
        let cluster_name = c"ceph";
        let mut raw: sys::rados_t = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; both strings are NUL-terminated
        // and outlive the call (librados copies them).
        let ret = unsafe { sys::rados_create2(&mut raw, cluster_name.as_ptr(), name.as_ptr(), 0) };
        cvt(ret, "rados_create2", || target.clone())?;
        // From here on the handle is owned; dropping `handle` shuts it down
        // even when a later step fails (rados_shutdown accepts an unconnected
        // handle).
        let mut handle = ClusterHandle {
            raw,
            label: String::new(),
            options: self.clone(),
        };
        // Ceph's built-in timeouts, read before any file: a value equal to
        // these after the file was read was not set by it.
        let builtin = TIMEOUT_OPTIONS.map(|opt| handle.conf_get(opt).ok());

        match &self.source {
            ConfSource::Default => {
                // SAFETY: a NULL path asks librados for its default search,
                // which honours $CEPH_CONF; `raw` is a live, unconnected handle.
                let ret = unsafe { sys::rados_conf_read_file(raw, ptr::null()) };
                cvt(ret, "rados_conf_read_file", || {
                    std::env::var("CEPH_CONF").unwrap_or_else(|_| "default ceph.conf paths".into())
                })
                .map_err(|e| e.detail("cannot read a ceph.conf ($CEPH_CONF or /etc/ceph/ceph.conf); pass a conf file or monitors"))?;
            }
            ConfSource::File(path) => {
                let shown = path.display().to_string();
                let p = cstr(&shown, "rados_conf_read_file", "conf file path")?;
                // SAFETY: `p` is a NUL-terminated path; `raw` is live and unconnected.
                let ret = unsafe { sys::rados_conf_read_file(raw, p.as_ptr()) };
                cvt(ret, "rados_conf_read_file", || shown.clone())?;
            }
            ConfSource::None => {}
        }
        let ret = {
            // librados.h: rados_conf_parse_env "uses a static buffer" and is
            // not thread-safe, process-wide: serialise every call.
            let _env = PARSE_ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: NULL means "read CEPH_ARGS"; `raw` is live and
            // unconnected; the lock above makes this the only
            // rados_conf_parse_env call running in the process.
            unsafe { sys::rados_conf_parse_env(raw, ptr::null()) }
        };
        cvt(ret, "rados_conf_parse_env", || "CEPH_ARGS".into())?;

        if let Some(m) = &self.mon_host {
            handle.conf_set("mon_host", m)?;
        }
        if let Some(k) = &self.keyring {
            handle.conf_set("keyring", &k.display().to_string())?;
        }
        if let Some(key) = &self.key {
            check_key(key.expose())?;
            handle.conf_set("key", key.expose())?;
        }
        for (k, v) in &self.overrides {
            if is_key_option(k) {
                check_key(v)?;
            }
            handle.conf_set(k, v)?;
        }
        let explicit = [
            (self.connect_timeout, DEFAULT_CONNECT_TIMEOUT),
            (self.mon_op_timeout, DEFAULT_OP_TIMEOUT),
            (self.osd_op_timeout, DEFAULT_OP_TIMEOUT),
        ];
        for ((opt, (explicit, default)), builtin) in
            TIMEOUT_OPTIONS.into_iter().zip(explicit).zip(builtin)
        {
            let configured = handle.conf_get(opt).ok();
            // Kept only when the file, CEPH_ARGS or an override changed it
            // from Ceph's built-in value (300 s, or 0 = forever) to a
            // non-zero one.
            let set_by_config = configured != builtin
                && configured
                    .as_deref()
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .is_some_and(|s| s > 0.0);
            let value = match explicit {
                Some(t) => Some(t),
                None if set_by_config => None,
                None => Some(default),
            };
            if let Some(t) = value {
                handle.conf_set(opt, &format!("{}", t.as_secs_f64().max(0.001)))?;
            }
        }
        if self.unbounded_mon_ops {
            handle.conf_set("rados_mon_op_timeout", "0")?;
        }

        handle.label = self.label(&handle);
        // SAFETY: `raw` is a configured, not yet connected handle.
        let ret = unsafe { sys::rados_connect(raw) };
        cvt(ret, "rados_connect", || handle.label.clone())?;
        Ok(Cluster {
            inner: Arc::new(handle),
        })
    }
}

/// The owned `rados_t`. Shut down exactly once, when the last [`Cluster`],
/// [`IoCtx`] or image that holds it is dropped.
pub(crate) struct ClusterHandle {
    raw: sys::rados_t,
    /// Which cluster, for errors: monitors, conf file and user.
    label: String,
    /// How it was made: [`Cluster::mgr_command`] opens its own connection
    /// the same way.
    options: ConnectOptions,
}

// SAFETY: librados' cluster handle (`librados::RadosClient`) guards its state
// with its own locks and is documented for use from many threads. The one
// call that is not thread-safe, rados_conf_parse_env (header: it "uses a
// static buffer"), is unsafe process-wide, not per handle: `connect` makes
// it only under PARSE_ENV_LOCK.
unsafe impl Send for ClusterHandle {}
// SAFETY: as above; every method here takes `&self` and maps to a librados
// call that is safe to make concurrently on one connected handle.
unsafe impl Sync for ClusterHandle {}

impl ClusterHandle {
    pub(crate) fn raw(&self) -> sys::rados_t {
        self.raw
    }

    fn conf_set(&self, option: &str, value: &str) -> Result<()> {
        let o = cstr(option, "rados_conf_set", "config option")?;
        // The value may be a key: its error names only the option.
        let v = CString::new(value)
            .map_err(|_| Error::invalid("rados_conf_set", option, "value contains a NUL byte"))?;
        // SAFETY: both strings are NUL-terminated and librados copies them.
        let ret = unsafe { sys::rados_conf_set(self.raw, o.as_ptr(), v.as_ptr()) };
        // The value may be a key: no copy of it is left in freed memory.
        zeroize(&mut v.into_bytes_with_nul());
        cvt(ret, "rados_conf_set", || option.to_owned())?;
        Ok(())
    }

    fn conf_get(&self, option: &str) -> Result<String> {
        let o = cstr(option, "rados_conf_get", "config option")?;
        let buf = with_growing_buffer(256, "rados_conf_get", &|| option.to_owned(), |buf| {
            // SAFETY: `buf` is writable for `buf.len()` bytes; librados writes
            // a NUL-terminated value or returns -ENAMETOOLONG.
            let ret = unsafe {
                sys::rados_conf_get(self.raw, o.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
            };
            // ENAMETOOLONG means "buffer too small" here.
            let ret = if ret == -libc::ENAMETOOLONG {
                -libc::ERANGE
            } else {
                ret
            };
            (i64::from(ret), 0)
        })?;
        Ok(crate::util::string_from_buf(&buf))
    }
}

impl Drop for ClusterHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from rados_create2 and is shut down only here;
        // every IoCtx and image holds an Arc to this handle, so none is left.
        unsafe { sys::rados_shutdown(self.raw) };
    }
}

/// A connection to a Ceph cluster (`rados_t`).
///
/// Cheap to clone: clones share one connection, which is shut down when the
/// last clone and the last [`IoCtx`] or image made from it are dropped. It is
/// `Send + Sync`, so one connection can serve many threads.
///
/// Drop it before the process exits (do not park it in a static that is
/// never dropped): librados threads left running while `exit()` tears down
/// librados' C++ statics can abort the process.
#[derive(Clone)]
pub struct Cluster {
    pub(crate) inner: Arc<ClusterHandle>,
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster").finish_non_exhaustive()
    }
}

/// Usage figures of the whole cluster, from `rados_cluster_stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterStats {
    /// Total raw capacity in KiB.
    pub kb: u64,
    /// Raw KiB used.
    pub kb_used: u64,
    /// Raw KiB available.
    pub kb_avail: u64,
    /// Number of objects.
    pub num_objects: u64,
}

/// The reply of a monitor command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MonCommandReply {
    /// The output buffer, JSON when the command asked for `"format": "json"`.
    pub output: Vec<u8>,
    /// The status string (the text `ceph` prints on stderr).
    pub status: String,
}

impl Cluster {
    /// Connects with [`ConnectOptions::new`]: `$CEPH_CONF` or the default
    /// ceph.conf, user `admin`, default timeouts.
    pub fn connect_default() -> Result<Cluster> {
        ConnectOptions::new().connect()
    }

    /// The value of a librados config option on this connection, such as
    /// `mon_host`. Wraps `rados_conf_get`. The cephx `key` is refused: it is
    /// never handed out.
    pub fn config_get(&self, option: &str) -> Result<String> {
        if is_key_option(option) {
            return Err(Error::invalid(
                "rados_conf_get",
                option,
                "the cephx key is not readable through config_get",
            ));
        }
        self.inner.conf_get(option)
    }

    /// The cluster's fsid. Wraps `rados_cluster_fsid`.
    pub fn fsid(&self) -> Result<String> {
        let mut buf = [0u8; 64];
        // SAFETY: `buf` is writable for its length; librados writes a
        // NUL-terminated fsid (37 bytes) or fails with -ERANGE.
        let ret =
            unsafe { sys::rados_cluster_fsid(self.raw(), buf.as_mut_ptr().cast(), buf.len()) };
        cvt(ret, "rados_cluster_fsid", || self.inner.label.clone())?;
        Ok(crate::util::string_from_buf(&buf))
    }

    /// This client's instance id (the `client.<id>` of watchers). Wraps
    /// `rados_get_instance_id`.
    pub fn instance_id(&self) -> u64 {
        // SAFETY: the handle is connected for as long as `self` exists.
        unsafe { sys::rados_get_instance_id(self.raw()) }
    }

    /// This client's addresses as the cluster sees them (the address a
    /// lock owner or watcher is listed by). Wraps `rados_getaddrs`.
    pub fn addrs(&self) -> Result<String> {
        let mut out: *mut c_char = ptr::null_mut();
        // SAFETY: the handle is connected; `out` is a valid out-pointer that
        // librados sets to a buffer we free with rados_buffer_free (header).
        let ret = unsafe { sys::rados_getaddrs(self.raw(), &mut out) };
        cvt(ret, "rados_getaddrs", String::new)?;
        if out.is_null() {
            return Ok(String::new());
        }
        // SAFETY: on success `out` is a NUL-terminated string from librados.
        let s = unsafe { std::ffi::CStr::from_ptr(out) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: `out` came from librados and is freed once, here.
        unsafe { sys::rados_buffer_free(out) };
        Ok(s)
    }

    /// One config option's value on this connection, as librados uses it.
    /// Refuses the options that hold a key. Wraps `rados_conf_get`.
    pub fn conf_get(&self, option: &str) -> Result<String> {
        if is_key_option(option) {
            return Err(Error::invalid(
                "rados_conf_get",
                option,
                "this option holds a key and is never read back",
            ));
        }
        self.inner.conf_get(option)
    }

    /// Blocklists one client instance (`ip:port/nonce`, as [`Cluster::addrs`]
    /// or a lock owner shows it) on the OSDs for `expire_secs` seconds (0:
    /// the cluster's default, an hour): its watches end and its requests are
    /// refused from the next OSD map on. Needs a mon cap that allows
    /// `osd blocklist` (`profile rbd` does). Bounded by the mon-op timeout.
    /// Wraps `rados_blocklist_add`.
    pub fn blocklist_add(&self, client_addr: &str, expire_secs: u32) -> Result<()> {
        let addr = cstr(client_addr, "rados_blocklist_add", "client address")?;
        // SAFETY: the handle is connected; `addr` is a NUL-terminated string
        // that outlives the call (librados only reads it, the header's
        // `char *` notwithstanding).
        let ret = unsafe {
            sys::rados_blocklist_add(self.raw(), addr.as_ptr() as *mut c_char, expire_secs)
        };
        cvt(ret, "rados_blocklist_add", || client_addr.to_owned())?;
        Ok(())
    }

    /// Removes a blocklist entry (`ip:port/nonce`, or `ip:0/0` for a whole
    /// address), so that clients from it are served again. An entry that is
    /// not there is fine. Needs mon cap `allow command "osd blocklist"`
    /// (`profile rbd` allows adding only). Bounded by the mon-op timeout.
    /// Sends the mon command `osd blocklist rm` (librados has no call).
    pub fn blocklist_rm(&self, client_addr: &str) -> Result<()> {
        // An address has no character JSON would need escaped; anything
        // else is not an address.
        if client_addr.is_empty()
            || !client_addr
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b".:[]/".contains(&b))
        {
            return Err(Error::invalid(
                "osd blocklist rm",
                client_addr,
                "not a client address (ip:port/nonce)",
            ));
        }
        let cmd = format!(
            r#"{{"prefix": "osd blocklist", "blocklistop": "rm", "addr": "{client_addr}"}}"#
        );
        match self.mon_command(&cmd, &[]) {
            Err(e) if e.errno() == libc::ENOENT => Ok(()),
            Err(e) => Err(e),
            Ok(_) => Ok(()),
        }
    }

    /// Waits until this client has the cluster's newest OSD map, so that
    /// every request it sends from now on carries that epoch, and an OSD
    /// serves it only once it has that map too (a fence: after
    /// [`Cluster::blocklist_add`], nothing of the blocklisted client lands
    /// after a request of ours). Bounded by the mon-op timeout. Wraps
    /// `rados_wait_for_latest_osdmap`.
    pub fn wait_for_latest_osdmap(&self) -> Result<()> {
        // SAFETY: the handle is connected.
        let ret = unsafe { sys::rados_wait_for_latest_osdmap(self.raw()) };
        cvt(ret, "rados_wait_for_latest_osdmap", || {
            self.inner.label.clone()
        })?;
        Ok(())
    }

    /// Names of all pools. Wraps `rados_pool_list`.
    pub fn pool_list(&self) -> Result<Vec<String>> {
        let mut needed = 0usize;
        let label = || self.inner.label.clone();
        let buf = with_growing_buffer(1024, "rados_pool_list", &label, |buf| {
            // SAFETY: `buf` is writable for `buf.len()` bytes. librados returns
            // the length it needs; if that is larger than the buffer, the
            // list is cut, so we treat it as ERANGE and retry.
            let ret =
                unsafe { sys::rados_pool_list(self.raw(), buf.as_mut_ptr().cast(), buf.len()) };
            if ret < 0 {
                return (i64::from(ret), 0);
            }
            needed = ret as usize;
            if needed > buf.len() {
                (-i64::from(libc::ERANGE), needed)
            } else {
                (0, 0)
            }
        })?;
        Ok(split_nul_list(&buf[..needed.min(buf.len())]))
    }

    /// Creates a pool with the cluster's default PG settings. Wraps
    /// `rados_pool_create`. Fails with `AlreadyExists` if it exists.
    pub fn pool_create(&self, name: &str) -> Result<()> {
        let n = cstr(name, "rados_pool_create", "pool name")?;
        // SAFETY: `n` is NUL-terminated; the handle is connected.
        let ret = unsafe { sys::rados_pool_create(self.raw(), n.as_ptr()) };
        cvt(ret, "rados_pool_create", || name.to_owned())?;
        Ok(())
    }

    /// Deletes a pool and everything in it. Wraps `rados_pool_delete`; the
    /// monitors must allow pool deletion (`mon_allow_pool_delete`).
    pub fn pool_delete(&self, name: &str) -> Result<()> {
        let n = cstr(name, "rados_pool_delete", "pool name")?;
        // SAFETY: `n` is NUL-terminated; the handle is connected.
        let ret = unsafe { sys::rados_pool_delete(self.raw(), n.as_ptr()) };
        cvt(ret, "rados_pool_delete", || name.to_owned())?;
        Ok(())
    }

    /// The id of a pool. Wraps `rados_pool_lookup`.
    pub fn pool_lookup(&self, name: &str) -> Result<i64> {
        let n = cstr(name, "rados_pool_lookup", "pool name")?;
        // SAFETY: `n` is NUL-terminated; the handle is connected.
        let ret = unsafe { sys::rados_pool_lookup(self.raw(), n.as_ptr()) };
        cvt(ret, "rados_pool_lookup", || name.to_owned())
    }

    /// The name of the pool with this id. Wraps `rados_pool_reverse_lookup`.
    pub fn pool_name(&self, id: i64) -> Result<String> {
        let buf = with_growing_buffer(
            128,
            "rados_pool_reverse_lookup",
            &|| format!("pool id {id}"),
            |buf| {
                // SAFETY: `buf` is writable for its length; -ERANGE if too small.
                let ret = unsafe {
                    sys::rados_pool_reverse_lookup(
                        self.raw(),
                        id,
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                    )
                };
                (i64::from(ret), 0)
            },
        )?;
        Ok(crate::util::string_from_buf(&buf))
    }

    /// Whole-cluster usage. Wraps `rados_cluster_stat`.
    pub fn stats(&self) -> Result<ClusterStats> {
        let mut st = sys::rados_cluster_stat_t::default();
        // SAFETY: `st` is a valid out-struct of the header's type.
        let ret = unsafe { sys::rados_cluster_stat(self.raw(), &mut st) };
        cvt(ret, "rados_cluster_stat", || self.inner.label.clone())?;
        Ok(ClusterStats {
            kb: st.kb,
            kb_used: st.kb_used,
            kb_avail: st.kb_avail,
            num_objects: st.num_objects,
        })
    }

    /// Sends a JSON command to the monitors, for admin needs such as
    /// `{"prefix": "osd pool set", ...}`. Wraps `rados_mon_command`.
    ///
    /// Bounded by the mon-op timeout. On failure the error names the command's
    /// `prefix` and carries the monitor's status text, never the command body
    /// (which may hold a key).
    pub fn mon_command(&self, command_json: &str, input: &[u8]) -> Result<MonCommandReply> {
        self.command(
            "rados_mon_command",
            "mon command",
            command_json,
            input,
            |a| {
                // SAFETY: `a` holds one valid C string, an input buffer readable
                // for its length and valid out-pointers (see `command`).
                unsafe {
                    sys::rados_mon_command(
                        self.raw(),
                        a.cmds,
                        1,
                        a.input,
                        a.input_len,
                        a.outbuf,
                        a.outbuf_len,
                        a.outs,
                        a.outs_len,
                    )
                }
            },
        )
    }

    /// `rados_mgr_command` on this connection, waiting as librados does:
    /// callers go through [`Cluster::mgr_command`], which never lets
    /// librados' own timeout end the wait (see there).
    pub(super) fn mgr_command_unbounded(
        &self,
        command_json: &str,
        input: &[u8],
    ) -> Result<MonCommandReply> {
        self.command(
            "rados_mgr_command",
            "mgr command",
            command_json,
            input,
            |a| {
                // SAFETY: as in `mon_command`: valid command array, input and
                // out-pointers for the call's duration. The connection waits
                // for the reply without a bound (`unbounded_mon_ops`), so
                // librados never returns while MgrClient still holds these
                // out-pointers.
                unsafe {
                    sys::rados_mgr_command(
                        self.raw(),
                        a.cmds,
                        1,
                        a.input,
                        a.input_len,
                        a.outbuf,
                        a.outbuf_len,
                        a.outs,
                        a.outs_len,
                    )
                }
            },
        )
    }

    /// How it was made, for [`Cluster::mgr_command`]'s own connection.
    pub(super) fn options(&self) -> &ConnectOptions {
        &self.inner.options
    }

    /// The label errors name this cluster by.
    pub(super) fn label(&self) -> &str {
        &self.inner.label
    }

    /// The buffer handling `rados_mon_command` and `rados_mgr_command`
    /// share: one command, librados-allocated replies freed with
    /// `rados_buffer_free` as the header requires.
    fn command(
        &self,
        op: &'static str,
        kind: &str,
        command_json: &str,
        input: &[u8],
        call: impl FnOnce(&CommandArgs) -> i32,
    ) -> Result<MonCommandReply> {
        let prefix = command_prefix(kind, command_json);
        let cmd = CString::new(command_json)
            .map_err(|_| Error::invalid(op, prefix.clone(), "command contains a NUL byte"))?;
        let cmds = [cmd.as_ptr()];
        let mut outbuf: *mut c_char = ptr::null_mut();
        let mut outbuf_len = 0usize;
        let mut outs: *mut c_char = ptr::null_mut();
        let mut outs_len = 0usize;
        let ret = call(&CommandArgs {
            cmds: cmds.as_ptr() as *mut *const c_char,
            input: input.as_ptr().cast(),
            input_len: input.len(),
            outbuf: &mut outbuf,
            outbuf_len: &mut outbuf_len,
            outs: &mut outs,
            outs_len: &mut outs_len,
        });
        // SAFETY: librados set these to buffers of the given lengths (or left
        // them null); we copy, then free each exactly once.
        let (output, status) = unsafe {
            let output = if outbuf.is_null() {
                Vec::new()
            } else {
                std::slice::from_raw_parts(outbuf as *const u8, outbuf_len).to_vec()
            };
            let status = if outs.is_null() {
                String::new()
            } else {
                String::from_utf8_lossy(std::slice::from_raw_parts(outs as *const u8, outs_len))
                    .into_owned()
            };
            if !outbuf.is_null() {
                sys::rados_buffer_free(outbuf);
            }
            if !outs.is_null() {
                sys::rados_buffer_free(outs);
            }
            (output, status)
        };
        match cvt(ret, op, || prefix.clone()) {
            Ok(_) => Ok(MonCommandReply { output, status }),
            Err(e) if status.is_empty() => Err(e),
            Err(e) => Err(e.detail(status.trim().to_owned())),
        }
    }

    /// Opens an I/O context on a pool, in the default namespace. Wraps
    /// `rados_ioctx_create`.
    pub fn ioctx(&self, pool: &str) -> Result<IoCtx> {
        IoCtx::create(self, pool, "")
    }

    /// Opens an I/O context on a pool and a rados namespace. Wraps
    /// `rados_ioctx_create` and `rados_ioctx_set_namespace`.
    pub fn ioctx_ns(&self, pool: &str, namespace: &str) -> Result<IoCtx> {
        IoCtx::create(self, pool, namespace)
    }

    pub(crate) fn raw(&self) -> sys::rados_t {
        self.inner.raw()
    }
}

/// The arguments `rados_mon_command` and `rados_mgr_command` share.
struct CommandArgs {
    cmds: *mut *const c_char,
    input: *const c_char,
    input_len: usize,
    outbuf: *mut *mut c_char,
    outbuf_len: *mut usize,
    outs: *mut *mut c_char,
    outs_len: *mut usize,
}

/// The `"prefix"` of a JSON command, for error messages: `mon command
/// 'auth add'`.
pub(super) fn command_prefix(kind: &str, json: &str) -> String {
    let Some(at) = json.find("\"prefix\"") else {
        return kind.into();
    };
    let rest = &json[at + 8..];
    let Some(start) = rest.find('"') else {
        return kind.into();
    };
    let rest = &rest[start + 1..];
    match rest.find('"') {
        Some(end) => format!("{kind} '{}'", &rest[..end]),
        None => kind.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_debug_is_redacted() {
        let s = Secret::new("AQBsecretsecret==");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        let o = ConnectOptions::new().key(s);
        assert!(!format!("{o:?}").contains("AQBsecret"));
    }

    #[test]
    fn overrides_that_hold_a_key_are_redacted() {
        let o = ConnectOptions::new()
            .set("key", "AQBsecretsecret==")
            .set("KEY ", "AQBother==")
            .set("mon_host", "10.0.0.1");
        let shown = format!("{o:?}");
        assert!(!shown.contains("AQB"), "{shown}");
        assert!(shown.contains("10.0.0.1"), "{shown}");
    }

    #[test]
    fn keys_are_checked_without_echoing_them() {
        // The shape `ceph auth get-key` prints (AES, 16-byte secret).
        check_key("AQBb1mZnAAAAABAAeXf4S2m5bNXE4U4z0u7K6Q==").unwrap();
        // Tentacle's new keys: AES-256-KRB5, 32-byte secret.
        check_key("AgAAAAAAAAAAACAAAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=").unwrap();
        for bad in [
            "",
            "not-a-key!!",
            "AQBb1mZnAAAAABAAeXf4S2m5bNXE4U4z0u7K6Q=",
            "AQBb1mZnAAAAABAAeXf4S2m5bNXE4U4z0u7K6Q==AAAA",
            "aGVsbG8gd29ybGQ=",
            "AQ==",
        ] {
            let e = check_key(bad).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
            if !bad.is_empty() {
                assert!(!e.to_string().contains(bad), "{e}");
            }
        }
    }

    #[test]
    fn base64_round_trips() {
        assert_eq!(base64_decode(b"aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode(b"aGVsbG8h").unwrap(), b"hello!");
        assert_eq!(base64_decode(b"aGVsbA==").unwrap(), b"hell");
        assert!(base64_decode(b"aGVs=G8=").is_none());
        assert!(base64_decode(b"aGVsbG8").is_none());
    }

    #[test]
    fn conf_parse_env_is_serialised_process_wide() {
        let held = PARSE_ENV_LOCK.lock().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // Fails fast (bad key) right after rados_conf_parse_env.
            let r = ConnectOptions::new()
                .mon_host("127.0.0.1:1")
                .key(Secret::new("not a key"))
                .connect();
            let _ = tx.send(r.map(|_| ()));
        });
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            rx.try_recv().is_err(),
            "connect got past rados_conf_parse_env while another caller held it"
        );
        drop(held);
        let e = rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap()
            .unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument, "{e}");
    }

    #[test]
    fn user_strips_client_prefix() {
        assert_eq!(ConnectOptions::new().user("client.k8s").user_id(), "k8s");
        assert_eq!(ConnectOptions::new().user("k8s").user_id(), "k8s");
    }

    #[test]
    fn mon_command_prefix_is_extracted() {
        assert_eq!(
            command_prefix(
                "mon command",
                r#"{"prefix": "auth add", "entity": "client.x", "key": "AQB"}"#
            ),
            "mon command 'auth add'"
        );
        assert_eq!(command_prefix("mon command", "{}"), "mon command");
    }
}
