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
use crate::rados::IoCtx;
use crate::util::{cstr, split_nul_list, with_growing_buffer};

/// Default bound on `rados_connect`: Ceph's own `client_mount_timeout` is 300 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default bound on monitor and OSD operations: Ceph's own default waits forever.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(30);

/// A cephx key. Its `Debug` output is redacted, and it is handed to librados
/// only through `rados_conf_set("key")`: it is never logged or put in errors.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a base64 cephx key.
    pub fn new(key: impl Into<String>) -> Secret {
        Secret(key.into())
    }

    /// The key itself. Use only to pass it on to librados.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Secret {
        Secret(s)
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Secret {
        Secret(s.to_owned())
    }
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
#[derive(Debug, Clone)]
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

    /// The cephx user id this connects as.
    pub fn user_id(&self) -> &str {
        &self.user
    }

    /// Creates the handle, applies the configuration and connects.
    ///
    /// Wraps `rados_create2`, `rados_conf_read_file`, `rados_conf_set` and
    /// `rados_connect`. Timeouts: an explicit option wins; otherwise a non-zero
    /// value from the conf file is kept; otherwise the defaults
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
        let handle = ClusterHandle { raw };

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
        // SAFETY: NULL means "read CEPH_ARGS"; `raw` is live and unconnected.
        // The header notes this call is not thread-safe (static buffer): it is
        // only ever made here, on a handle no other thread can see yet.
        let ret = unsafe { sys::rados_conf_parse_env(raw, ptr::null()) };
        cvt(ret, "rados_conf_parse_env", || "CEPH_ARGS".into())?;

        if let Some(m) = &self.mon_host {
            handle.conf_set("mon_host", m)?;
        }
        if let Some(k) = &self.keyring {
            handle.conf_set("keyring", &k.display().to_string())?;
        }
        if let Some(key) = &self.key {
            handle.conf_set("key", key.expose())?;
        }
        for (k, v) in &self.overrides {
            handle.conf_set(k, v)?;
        }
        for (opt, explicit, default) in [
            (
                "client_mount_timeout",
                self.connect_timeout,
                DEFAULT_CONNECT_TIMEOUT,
            ),
            (
                "rados_mon_op_timeout",
                self.mon_op_timeout,
                DEFAULT_OP_TIMEOUT,
            ),
            (
                "rados_osd_op_timeout",
                self.osd_op_timeout,
                DEFAULT_OP_TIMEOUT,
            ),
        ] {
            let value = match explicit {
                Some(t) => Some(t),
                None if handle.conf_get_secs(opt).is_some_and(|s| s > 0.0) => None,
                None => Some(default),
            };
            if let Some(t) = value {
                handle.conf_set(opt, &format!("{}", t.as_secs_f64().max(0.001)))?;
            }
        }

        // SAFETY: `raw` is a configured, not yet connected handle.
        let ret = unsafe { sys::rados_connect(raw) };
        cvt(ret, "rados_connect", || {
            self.mon_host
                .clone()
                .unwrap_or_else(|| format!("cluster as {target}"))
        })?;
        Ok(Cluster {
            inner: Arc::new(handle),
        })
    }
}

/// The owned `rados_t`. Shut down exactly once, when the last [`Cluster`],
/// [`IoCtx`] or image that holds it is dropped.
pub(crate) struct ClusterHandle {
    raw: sys::rados_t,
}

// SAFETY: librados' cluster handle (`librados::RadosClient`) guards its state
// with its own locks and is documented for use from many threads; the only
// non-thread-safe call, rados_conf_parse_env (header: "BUG: this is not
// threadsafe"), is made in `connect` before the handle is shared.
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

    fn conf_get_secs(&self, option: &str) -> Option<f64> {
        self.conf_get(option).ok()?.trim().parse().ok()
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
    /// `mon_host`. Wraps `rados_conf_get`.
    pub fn config_get(&self, option: &str) -> Result<String> {
        self.inner.conf_get(option)
    }

    /// The cluster's fsid. Wraps `rados_cluster_fsid`.
    pub fn fsid(&self) -> Result<String> {
        let mut buf = [0u8; 64];
        // SAFETY: `buf` is writable for its length; librados writes a
        // NUL-terminated fsid (37 bytes) or fails with -ERANGE.
        let ret =
            unsafe { sys::rados_cluster_fsid(self.raw(), buf.as_mut_ptr().cast(), buf.len()) };
        cvt(ret, "rados_cluster_fsid", String::new)?;
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

    /// Names of all pools. Wraps `rados_pool_list`.
    pub fn pool_list(&self) -> Result<Vec<String>> {
        let mut needed = 0usize;
        let buf = with_growing_buffer(1024, "rados_pool_list", &String::new, |buf| {
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
        cvt(ret, "rados_cluster_stat", String::new)?;
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
        let prefix = command_prefix(command_json);
        let cmd = CString::new(command_json).map_err(|_| {
            Error::invalid(
                "rados_mon_command",
                prefix.clone(),
                "command contains a NUL byte",
            )
        })?;
        let cmds = [cmd.as_ptr()];
        let mut outbuf: *mut c_char = ptr::null_mut();
        let mut outbuf_len = 0usize;
        let mut outs: *mut c_char = ptr::null_mut();
        let mut outs_len = 0usize;
        // SAFETY: `cmds` holds one valid C string; `input` is readable for its
        // length; the out-pointers are valid. librados allocates outbuf/outs,
        // which we free below with rados_buffer_free as the header requires.
        let ret = unsafe {
            sys::rados_mon_command(
                self.raw(),
                cmds.as_ptr() as *mut *const c_char,
                1,
                input.as_ptr().cast(),
                input.len(),
                &mut outbuf,
                &mut outbuf_len,
                &mut outs,
                &mut outs_len,
            )
        };
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
        match cvt(ret, "rados_mon_command", || prefix.clone()) {
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

/// The `"prefix"` of a JSON mon command, for error messages.
fn command_prefix(json: &str) -> String {
    let Some(at) = json.find("\"prefix\"") else {
        return "mon command".into();
    };
    let rest = &json[at + 8..];
    let Some(start) = rest.find('"') else {
        return "mon command".into();
    };
    let rest = &rest[start + 1..];
    match rest.find('"') {
        Some(end) => format!("mon command '{}'", &rest[..end]),
        None => "mon command".into(),
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
    fn user_strips_client_prefix() {
        assert_eq!(ConnectOptions::new().user("client.k8s").user_id(), "k8s");
        assert_eq!(ConnectOptions::new().user("k8s").user_id(), "k8s");
    }

    #[test]
    fn mon_command_prefix_is_extracted() {
        assert_eq!(
            command_prefix(r#"{"prefix": "auth add", "entity": "client.x", "key": "AQB"}"#),
            "mon command 'auth add'"
        );
        assert_eq!(command_prefix("{}"), "mon command");
    }
}
