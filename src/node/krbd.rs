//! [`KrbdMapper`]: maps images with the kernel rbd client through sysfs
//! (`/sys/bus/rbd/add_single_major`, `remove_single_major`), as `rbd map`
//! does, without the rbd CLI.
//!
//! The add string is the kernel's (`drivers/block/rbd.c`):
//! `<mon_addrs> <options> <pool> <image> <snap or ->`, the RADOS namespace
//! given as the `_pool_ns=` option. The cephx key goes to the kernel
//! keyring (see [`super::keyring`]) and the options say
//! `key=client.<user>`; only when the kernel has no `ceph` key type does it
//! go inline as `secret=`, inside the sysfs write, never in argv, a log or
//! an error.
//!
//! A mapping is found by pool, namespace, image and snapshot as sysfs shows
//! them, and by `cluster_fsid` when the caller knows the cluster
//! ([`MapSpec::cluster_fsid`], [`Mapper::adopt`]): two clusters can hold
//! images of the same names (a mirrored pair does). A snapshot mapping is
//! never taken for the head, whoever made it.
//!
//! The sysfs and /dev roots are configurable so that the tests run against
//! a fake tree: the machine this is developed on has no rbd kernel module.
//! The real one is tested in a QEMU guest with Debian's kernel
//! (`tests/it/kernel_vm.rs`).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{keyring, MapSpec, Mapper};
use crate::error::{Error, ErrorKind, Result};
use crate::rbd::Features;
use crate::volume::VolumeId;

/// The snapshot name sysfs shows (and the add string takes) for the head.
const HEAD: &str = "-";

/// One kernel rbd device, from `/sys/bus/rbd/devices/<id>/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KrbdDevice {
    /// The device id: `/dev/rbd<id>`.
    pub id: u32,
    /// `pool`.
    pub pool: String,
    /// `pool_ns` (empty for the default namespace or an old kernel).
    pub namespace: String,
    /// `name`: the image.
    pub image: String,
    /// `current_snap`: `-` for the head.
    pub snapshot: String,
    /// `cluster_fsid`: the cluster the image is in (empty if the kernel
    /// does not say).
    pub cluster_fsid: String,
}

/// What this mapper knows of a volume it mapped: which snapshot (`-` for
/// the head) and, where the node plugin said, which cluster.
#[derive(Debug, Clone)]
struct Known {
    snapshot: String,
    fsid: Option<String>,
}

/// Maps RBD images with the kernel rbd client.
#[derive(Debug)]
pub struct KrbdMapper {
    sysfs: PathBuf,
    dev: PathBuf,
    /// The key type for the keyring path; only tests change it.
    key_type: &'static str,
    /// How long to wait for a device to appear in sysfs and /dev (udev).
    settle: Duration,
    /// Retries of an unmap that answers EBUSY, and the pause between them.
    busy_retries: u32,
    busy_pause: Duration,
    /// One map or unmap at a time: the find-then-add check and the shared
    /// process-keyring entry must not interleave.
    lock: Mutex<HashMap<String, Known>>,
}

impl Default for KrbdMapper {
    fn default() -> Self {
        KrbdMapper::new()
    }
}

impl KrbdMapper {
    /// A mapper on the real `/sys` and `/dev`.
    pub fn new() -> KrbdMapper {
        KrbdMapper::with_roots("/sys", "/dev")
    }

    /// A mapper on another sysfs root and /dev root (for tests).
    pub fn with_roots(sysfs: impl Into<PathBuf>, dev: impl Into<PathBuf>) -> KrbdMapper {
        KrbdMapper {
            sysfs: sysfs.into(),
            dev: dev.into(),
            key_type: keyring::CEPH_KEY_TYPE,
            settle: Duration::from_secs(10),
            busy_retries: 10,
            busy_pause: Duration::from_millis(500),
            lock: Mutex::new(HashMap::new()),
        }
    }

    /// How long a map waits for its device to show up (default 10 s).
    pub fn settle_timeout(mut self, t: Duration) -> Self {
        self.settle = t;
        self
    }

    /// How often, and how far apart, an unmap answered with `EBUSY` is
    /// retried (default 10 times, 500 ms apart).
    pub fn busy_retries(mut self, retries: u32, pause: Duration) -> Self {
        self.busy_retries = retries;
        self.busy_pause = pause;
        self
    }

    fn bus(&self) -> PathBuf {
        self.sysfs.join("bus/rbd")
    }

    /// The bus file to write: the `_single_major` one where the kernel has
    /// it (one major for all rbd devices), else the old one.
    fn bus_file(&self, name: &str) -> PathBuf {
        let single = self.bus().join(format!("{name}_single_major"));
        if single.exists() {
            single
        } else {
            self.bus().join(name)
        }
    }

    /// The features the kernel client supports
    /// (`/sys/bus/rbd/supported_features`, `0x..`), or `None` on a kernel
    /// too old to say.
    pub fn supported_features(&self) -> Result<Option<Features>> {
        let path = self.bus().join("supported_features");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error(e, "read", &path)),
        };
        let t = text.trim();
        let hex = t.strip_prefix("0x").unwrap_or(t);
        u64::from_str_radix(hex, 16)
            .map(|b| Some(Features::from_bits(b)))
            .map_err(|_| {
                Error::invalid(
                    "read",
                    path.display().to_string(),
                    format!("not a hex number: {t:?}"),
                )
            })
    }

    /// Refuses image `features` the kernel client lacks, naming them (no-op
    /// on a kernel that does not list its features: it will refuse the map
    /// itself).
    pub fn check_features(&self, features: Features) -> Result<()> {
        let Some(supported) = self.supported_features()? else {
            return Ok(());
        };
        let missing = features.without(supported);
        if missing.is_empty() {
            return Ok(());
        }
        Err(Error::with_kind(
            ErrorKind::NotSupported,
            libc::EOPNOTSUPP,
            "krbd map",
            self.bus().join("supported_features").display().to_string(),
            format!(
                "the kernel rbd client does not support the image features {} (it supports {}); \
                 disable them on the image or use the rbdkit-fuse mounter",
                missing.names().join(","),
                supported.names().join(",")
            ),
        ))
    }

    /// The kernel's rbd devices now.
    pub fn devices(&self) -> Result<Vec<KrbdDevice>> {
        let dir = self.bus().join("devices");
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_error(e, "readdir", &dir)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_error(e, "readdir", &dir))?;
            let Some(id) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let d = entry.path();
            let attr = |name: &str| -> Result<Option<String>> {
                match std::fs::read_to_string(d.join(name)) {
                    Ok(s) => Ok(Some(s.trim_end_matches('\n').to_owned())),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(io_error(e, "read", &d.join(name))),
                }
            };
            // A device being removed can lose its attributes under us.
            let (Some(pool), Some(image)) = (attr("pool")?, attr("name")?) else {
                continue;
            };
            out.push(KrbdDevice {
                id,
                pool,
                namespace: attr("pool_ns")?.unwrap_or_default(),
                image,
                snapshot: attr("current_snap")?.unwrap_or_else(|| HEAD.to_owned()),
                cluster_fsid: attr("cluster_fsid")?.unwrap_or_default(),
            });
        }
        out.sort_by_key(|d| d.id);
        Ok(out)
    }

    /// The device of `pool/namespace/image@snapshot` of cluster `fsid`
    /// (any cluster's when `None`), if mapped.
    fn find_image(
        &self,
        pool: &str,
        ns: &str,
        image: &str,
        snap: &str,
        fsid: Option<&str>,
    ) -> Result<Option<KrbdDevice>> {
        Ok(self.devices()?.into_iter().find(|d| {
            d.pool == pool
                && d.namespace == ns
                && d.image == image
                && d.snapshot == snap
                && same_cluster(d, fsid)
        }))
    }

    fn dev_path(&self, id: u32) -> PathBuf {
        self.dev.join(format!("rbd{id}"))
    }

    /// The device of `volume_id`: the mapping of its image's head (or of
    /// the snapshot this mapper mapped for it) in its cluster. A mapping of
    /// another snapshot is never taken for it: it may be anyone's. Without
    /// the cluster (a restart, no stash), head mappings of the same name in
    /// two clusters are refused as ambiguous rather than one picked.
    fn find_device(&self, volume_id: &str, known: Option<&Known>) -> Result<Option<KrbdDevice>> {
        let id =
            VolumeId::parse(volume_id).map_err(|e| Error::invalid("krbd find", volume_id, e))?;
        let want = known.map_or(HEAD, |k| k.snapshot.as_str());
        let fsid = known.and_then(|k| k.fsid.as_deref());
        let mut all: Vec<KrbdDevice> = self
            .devices()?
            .into_iter()
            .filter(|d| {
                d.pool == id.pool
                    && d.namespace == id.rados_namespace
                    && d.image == id.image
                    && d.snapshot == want
                    && same_cluster(d, fsid)
            })
            .collect();
        if all.len() > 1 {
            let devs: Vec<String> = all
                .iter()
                .map(|d| format!("rbd{} (cluster {})", d.id, d.cluster_fsid))
                .collect();
            return Err(Error::with_kind(
                ErrorKind::AlreadyExists,
                libc::EEXIST,
                "krbd find",
                volume_id,
                format!(
                    "the image is mapped from more than one cluster ({}) and which one this                      volume is was not recorded; unmap the stale one",
                    devs.join(", ")
                ),
            ));
        }
        Ok(all.pop())
    }

    /// Waits (bounded by the settle timeout) for `probe` to give a value.
    fn settle<T>(&self, mut probe: impl FnMut() -> Result<Option<T>>) -> Result<Option<T>> {
        let deadline = Instant::now() + self.settle;
        loop {
            if let Some(v) = probe()? {
                return Ok(Some(v));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The device node of a mapped device, once udev made it.
    fn wait_dev_node(&self, d: &KrbdDevice, object: &str) -> Result<PathBuf> {
        let path = self.dev_path(d.id);
        self.settle(|| Ok(path.exists().then_some(())))?
            .ok_or_else(|| {
                Error::from_errno(libc::ETIMEDOUT, "krbd map", object).detail(format!(
                    "rbd device {} exists but {} did not appear within {:?}",
                    d.id,
                    path.display(),
                    self.settle
                ))
            })?;
        Ok(path)
    }

    fn do_map(&self, spec: &MapSpec, remembered: &mut HashMap<String, Known>) -> Result<PathBuf> {
        let snap = spec.snapshot.as_deref().unwrap_or(HEAD);
        let object = image_spec(
            &spec.pool,
            &spec.namespace,
            &spec.image,
            spec.snapshot.as_deref(),
        );
        validate(spec, &object)?;
        let fsid = spec.cluster_fsid.as_deref();
        let known = Known {
            snapshot: snap.to_owned(),
            fsid: spec.cluster_fsid.clone(),
        };
        if let Some(d) = self.find_image(&spec.pool, &spec.namespace, &spec.image, snap, fsid)? {
            remembered.insert(spec.volume_id.clone(), known);
            return self.wait_dev_node(&d, &object);
        }

        // key=client.<user> with the key in the keyring; secret= only when
        // the kernel has no ceph key type.
        let key_name = keyring::key_name(&spec.user);
        let (auth, keyed): ([&[u8]; 2], bool) =
            match keyring::add_cephx(self.key_type, &spec.user, &spec.key) {
                Ok(_) => ([b"key=", key_name.as_bytes()], true),
                Err(e) if e.errno() == libc::ENODEV || e.errno() == libc::ENOSYS => {
                    keyring::decode_base64(spec.key.expose(), &key_name)?;
                    ([b"secret=", spec.key.expose().as_bytes()], false)
                }
                Err(e) => return Err(e),
            };
        let mut add = add_string(spec, &auth);
        let file = self.bus_file("add");
        let written = write_bus(&file, &add);
        // It may hold the key (secret=): zeroed before it is freed.
        crate::rados::zeroize(&mut add);
        drop(add);
        if keyed {
            // libceph copied the key while parsing the options.
            let _ = keyring::remove_cephx(self.key_type, &spec.user);
        }
        written.map_err(|errno| {
            Error::from_errno(errno, "krbd map", object.clone()).detail(format!(
                "writing the add string to {} failed: {}{}",
                file.display(),
                std::io::Error::from_raw_os_error(errno),
                map_hint(errno)
            ))
        })?;
        remembered.insert(spec.volume_id.clone(), known);
        let d = self
            .settle(|| self.find_image(&spec.pool, &spec.namespace, &spec.image, snap, fsid))?
            .ok_or_else(|| {
                Error::from_errno(libc::ETIMEDOUT, "krbd map", object.clone()).detail(format!(
                    "the kernel took the add string but no device for it appeared in {} within {:?}",
                    self.bus().join("devices").display(),
                    self.settle
                ))
            })?;
        self.wait_dev_node(&d, &object)
    }
}

/// Whether `d` is of cluster `fsid` (any, when `None` or when the kernel
/// does not report the cluster).
fn same_cluster(d: &KrbdDevice, fsid: Option<&str>) -> bool {
    match fsid {
        Some(f) if !d.cluster_fsid.is_empty() => d.cluster_fsid.eq_ignore_ascii_case(f),
        _ => true,
    }
}

/// `pool/ns/image@snap` for messages.
fn image_spec(pool: &str, ns: &str, image: &str, snap: Option<&str>) -> String {
    let mut s = if ns.is_empty() {
        format!("{pool}/{image}")
    } else {
        format!("{pool}/{ns}/{image}")
    };
    if let Some(snap) = snap {
        s.push('@');
        s.push_str(snap);
    }
    s
}

/// The kernel splits the add string on whitespace and the options on
/// commas: refuse names it would misread.
fn validate(spec: &MapSpec, object: &str) -> Result<()> {
    let bad = |what: &str, v: &str, why: &str| {
        Error::invalid("krbd map", object, format!("{what} {v:?} {why}"))
    };
    if spec.monitors.is_empty() {
        return Err(Error::invalid("krbd map", object, "no monitor addresses"));
    }
    let fields: [(&str, &str); 4] = [
        ("pool", &spec.pool),
        ("image", &spec.image),
        ("user", &spec.user),
        ("namespace", &spec.namespace),
    ];
    for (what, v) in fields {
        if v.is_empty() && what != "namespace" {
            return Err(bad(what, v, "is empty"));
        }
        if v.chars().any(char::is_whitespace) {
            return Err(bad(
                what,
                v,
                "holds whitespace, which the kernel's add string cannot carry",
            ));
        }
    }
    for (what, v) in [("user", &spec.user), ("namespace", &spec.namespace)] {
        if v.contains(',') || v.contains('=') {
            return Err(bad(
                what,
                v,
                "holds ',' or '=', which the kernel's options cannot carry",
            ));
        }
    }
    if let Some(s) = &spec.snapshot {
        if s.is_empty() || s == HEAD || s.chars().any(char::is_whitespace) {
            return Err(bad("snapshot", s, "cannot be mapped by the kernel"));
        }
    }
    for m in &spec.monitors {
        if m.is_empty() || m.contains(',') || m.chars().any(char::is_whitespace) {
            return Err(bad("monitor address", m, "is not host:port"));
        }
    }
    for o in &spec.options {
        if o.is_empty() || o.contains(',') || o.chars().any(char::is_whitespace) {
            return Err(bad("map option", o, "must be one option without spaces"));
        }
        let name = o.split('=').next().unwrap_or("");
        if matches!(name, "name" | "secret" | "key" | "_pool_ns") {
            return Err(bad("map option", o, "is set by the mapper"));
        }
    }
    Ok(())
}

/// Refuses map options the image's `features` cannot take, by name: the
/// kernel answers `exclusive` or `lock_on_read` on an image without
/// exclusive-lock with a bare EINVAL.
fn check_option_features(spec: &MapSpec, features: Features) -> Result<()> {
    if features.contains(Features::EXCLUSIVE_LOCK) {
        return Ok(());
    }
    match spec
        .options
        .iter()
        .find(|o| *o == "exclusive" || *o == "lock_on_read")
    {
        Some(o) => Err(Error::invalid(
            "krbd map",
            image_spec(&spec.pool, &spec.namespace, &spec.image, None),
            format!(
                "map option {o:?} needs the image feature exclusive-lock, which the image \
                 lacks; add exclusive-lock to imageFeatures or drop the option"
            ),
        )),
        None => Ok(()),
    }
}

/// The string for `/sys/bus/rbd/add_single_major`:
/// `<mon1,mon2> name=<user>,<auth>[,_pool_ns=<ns>][,<options>][,read_only]
/// <pool> <image> <snap or ->`.
/// The sysfs `add` string, with `auth` (`key=client.<user>`, or
/// `secret=<key>` when the kernel has no `ceph` key type) as its second
/// option. Built in one buffer of its final size, so no reallocation leaves
/// a copy of a key in freed memory; the caller zeroes it after the write.
fn add_string(spec: &MapSpec, auth: &[&[u8]]) -> Vec<u8> {
    let mut opts = Vec::new();
    if !spec.namespace.is_empty() {
        opts.push(format!("_pool_ns={}", spec.namespace));
    }
    opts.extend(spec.options.iter().cloned());
    if (spec.read_only || spec.snapshot.is_some())
        && !spec.options.iter().any(|o| o == "read_only" || o == "ro")
    {
        opts.push("read_only".to_owned());
    }
    let before = format!("{} name={},", spec.monitors.join(","), spec.user);
    let after = format!(
        "{}{} {} {} {}",
        if opts.is_empty() { "" } else { "," },
        opts.join(","),
        spec.pool,
        spec.image,
        spec.snapshot.as_deref().unwrap_or(HEAD)
    );
    let len = before.len() + auth.iter().map(|a| a.len()).sum::<usize>() + after.len();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(before.as_bytes());
    for a in auth {
        out.extend_from_slice(a);
    }
    out.extend_from_slice(after.as_bytes());
    out
}

/// Writes `data` to a sysfs bus file in one `write(2)` (sysfs stores take
/// one buffer); the errno on failure, so the caller can word an error
/// that does not echo `data`.
fn write_bus(path: &Path, data: &[u8]) -> std::result::Result<(), i32> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    match f.write(data) {
        Ok(n) if n == data.len() => Ok(()),
        Ok(_) => Err(libc::EIO),
        Err(e) => Err(e.raw_os_error().unwrap_or(libc::EIO)),
    }
}

/// What a map errno from the kernel usually means.
fn map_hint(errno: i32) -> &'static str {
    match errno {
        libc::ENOENT => " (the pool, namespace, image or snapshot does not exist)",
        libc::ENXIO => " (the image has features the kernel client does not support)",
        libc::EACCES | libc::EPERM => " (cephx refused the user or key)",
        libc::ETIMEDOUT => " (no monitor answered)",
        libc::EINVAL => " (the kernel refused an option)",
        _ => "",
    }
}

/// Retries `write` while it answers `EBUSY`, at most `retries` more times,
/// `pause` apart; the last errno when it gives up.
fn retry_busy(
    retries: u32,
    pause: Duration,
    mut write: impl FnMut() -> std::result::Result<(), i32>,
) -> std::result::Result<(), i32> {
    let mut left = retries;
    loop {
        match write() {
            Err(libc::EBUSY) if left > 0 => {
                left -= 1;
                std::thread::sleep(pause);
            }
            other => return other,
        }
    }
}

fn io_error(e: std::io::Error, op: &'static str, path: &Path) -> Error {
    Error::from_errno(
        e.raw_os_error().unwrap_or(libc::EIO),
        op,
        path.display().to_string(),
    )
    .detail(e.to_string())
}

impl Mapper for KrbdMapper {
    fn name(&self) -> &'static str {
        "krbd"
    }

    fn map(&self, spec: &MapSpec) -> Result<PathBuf> {
        if let Some(f) = spec.features {
            self.check_features(f)?;
            check_option_features(spec, f)?;
        }
        let mut remembered = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.do_map(spec, &mut remembered)
    }

    fn find(&self, volume_id: &str) -> Result<Option<PathBuf>> {
        let remembered = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        Ok(self
            .find_device(volume_id, remembered.get(volume_id))?
            .map(|d| self.dev_path(d.id)))
    }

    fn unmap(&self, volume_id: &str, options: &[String]) -> Result<()> {
        let mut remembered = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let known = remembered.get(volume_id).cloned();
        let Some(d) = self.find_device(volume_id, known.as_ref())? else {
            remembered.remove(volume_id);
            return Ok(());
        };
        let force = options.iter().any(|o| o == "force");
        let line = if force {
            format!("{} force", d.id)
        } else {
            d.id.to_string()
        };
        let file = self.bus_file("remove");
        let object = image_spec(
            &d.pool,
            &d.namespace,
            &d.image,
            (d.snapshot != HEAD).then_some(d.snapshot.as_str()),
        );
        match retry_busy(self.busy_retries, self.busy_pause, || {
            write_bus(&file, line.as_bytes())
        }) {
            Ok(()) => {}
            // Removed meanwhile (by a kill -9'd earlier attempt, say).
            Err(libc::ENOENT) => {}
            Err(errno) => {
                return Err(
                    Error::from_errno(errno, "krbd unmap", object).detail(format!(
                        "writing {line:?} to {} failed: {}{}",
                        file.display(),
                        std::io::Error::from_raw_os_error(errno),
                        if errno == libc::EBUSY {
                            " (the device is still open; unmapOptions \"krbd:force\" forces it)"
                        } else {
                            ""
                        }
                    )),
                );
            }
        }
        let dir = self.bus().join("devices").join(d.id.to_string());
        let gone = self.settle(|| Ok((!dir.exists()).then_some(())))?;
        if gone.is_none() {
            return Err(
                Error::from_errno(libc::ETIMEDOUT, "krbd unmap", object).detail(format!(
                    "{} still exists after {:?}",
                    dir.display(),
                    self.settle
                )),
            );
        }
        remembered.remove(volume_id);
        Ok(())
    }

    fn refresh_size(&self, volume_id: &str) -> Result<u64> {
        let remembered = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let d = self
            .find_device(volume_id, remembered.get(volume_id))?
            .ok_or_else(|| {
                Error::from_errno(libc::ENOENT, "krbd refresh", volume_id).detail("not mapped")
            })?;
        let dir = self.bus().join("devices").join(d.id.to_string());
        // `refresh` rereads the image header (the kernel also does on its
        // own when the header watch fires).
        let refresh = dir.join("refresh");
        if refresh.exists() {
            write_bus(&refresh, b"1").map_err(|errno| {
                Error::from_errno(errno, "krbd refresh", refresh.display().to_string())
            })?;
        }
        let size_file = dir.join("size");
        let text =
            std::fs::read_to_string(&size_file).map_err(|e| io_error(e, "read", &size_file))?;
        text.trim().parse::<u64>().map_err(|_| {
            Error::invalid(
                "read",
                size_file.display().to_string(),
                format!("not a size: {:?}", text.trim()),
            )
        })
    }

    fn check(&self, volume_id: &str, device: &Path) -> std::result::Result<(), String> {
        let remembered = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        match self.find_device(volume_id, remembered.get(volume_id)) {
            Ok(Some(d)) if self.dev_path(d.id) == device => {
                if device.exists() {
                    Ok(())
                } else {
                    Err(format!(
                        "{} is mapped but has no device node",
                        device.display()
                    ))
                }
            }
            Ok(Some(d)) => Err(format!(
                "the image is mapped to {}, not {}",
                self.dev_path(d.id).display(),
                device.display()
            )),
            Ok(None) => Err("the image is not mapped by the kernel rbd client".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    }

    fn ready(&self) -> std::result::Result<(), String> {
        let add = self.bus_file("add");
        if !add.exists() {
            return Err(format!(
                "{} does not exist: the rbd kernel module is not loaded",
                add.display()
            ));
        }
        self.devices().map(|_| ()).map_err(|e| e.to_string())
    }

    fn adopt(&self, volume_id: &str, cluster_fsid: &str) {
        let mut remembered = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        remembered
            .entry(volume_id.to_owned())
            .or_insert_with(|| Known {
                snapshot: HEAD.to_owned(),
                fsid: None,
            })
            .fsid = Some(cluster_fsid.to_owned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rados::Secret;

    const KEY: &str = "AQBzmwlnAAAAABAAcHyFYS4mxn8Z2x0Tk3nIrA==";
    const FSID_A: &str = "6b1e8a4c-0f0e-4d52-9a3e-1f2a3b4c5d6e";
    const FSID_B: &str = "d0c1b2a3-9e8f-4a7b-8c6d-5e4f3a2b1c0d";

    /// A fake sysfs + /dev tree; the test plays the kernel.
    struct Fake {
        dir: tempfile::TempDir,
    }

    impl Fake {
        fn new(single_major: bool) -> Fake {
            let dir = tempfile::tempdir().unwrap();
            let bus = dir.path().join("sys/bus/rbd");
            std::fs::create_dir_all(bus.join("devices")).unwrap();
            std::fs::create_dir_all(dir.path().join("dev")).unwrap();
            let names: &[&str] = if single_major {
                &["add", "remove", "add_single_major", "remove_single_major"]
            } else {
                &["add", "remove"]
            };
            for n in names {
                std::fs::write(bus.join(n), "").unwrap();
            }
            // Linux 6.x: layering, striping, exclusive-lock, object-map,
            // fast-diff, deep-flatten, data-pool, operations.
            std::fs::write(bus.join("supported_features"), "0x1bd\n").unwrap();
            Fake { dir }
        }

        fn sys(&self) -> PathBuf {
            self.dir.path().join("sys")
        }

        fn bus(&self) -> PathBuf {
            self.sys().join("bus/rbd")
        }

        fn mapper(&self) -> KrbdMapper {
            KrbdMapper::with_roots(self.sys(), self.dir.path().join("dev"))
                .settle_timeout(Duration::from_secs(5))
                .busy_retries(2, Duration::from_millis(10))
        }

        /// Makes the sysfs directory and /dev node of a mapped device.
        fn add_device(&self, id: u32, pool: &str, ns: &str, image: &str, snap: &str) {
            self.add_device_of(id, pool, ns, image, snap, FSID_A);
        }

        /// [`Fake::add_device`] of the cluster `fsid`.
        fn add_device_of(
            &self,
            id: u32,
            pool: &str,
            ns: &str,
            image: &str,
            snap: &str,
            fsid: &str,
        ) {
            let d = self.bus().join("devices").join(id.to_string());
            std::fs::create_dir_all(&d).unwrap();
            for (f, v) in [
                ("pool", pool),
                ("pool_ns", ns),
                ("name", image),
                ("current_snap", snap),
                ("cluster_fsid", fsid),
            ] {
                std::fs::write(d.join(f), format!("{v}\n")).unwrap();
            }
            std::fs::write(d.join("size"), "1073741824\n").unwrap();
            std::fs::write(d.join("refresh"), "").unwrap();
            std::fs::write(self.dir.path().join(format!("dev/rbd{id}")), "").unwrap();
        }

        /// Waits for the mapper to write `file`, returns what it wrote and
        /// empties it, like the kernel consuming a store.
        fn take(&self, file: &str) -> String {
            let path = self.bus().join(file);
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let s = std::fs::read_to_string(&path).unwrap();
                if !s.is_empty() {
                    std::fs::write(&path, "").unwrap();
                    return s;
                }
                assert!(Instant::now() < deadline, "nothing written to {file}");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    fn spec(user: &str) -> MapSpec {
        MapSpec {
            volume_id: "rbdkit1/c1/rbd/ns1/vol-1".into(),
            monitors: vec!["10.0.0.1:6789".into(), "10.0.0.2:6789".into()],
            user: user.into(),
            key: Secret::new(KEY),
            pool: "rbd".into(),
            namespace: "ns1".into(),
            image: "vol-1".into(),
            cluster_fsid: None,
            features: None,
            snapshot: None,
            read_only: false,
            options: vec!["lock_on_read".into(), "queue_depth=128".into()],
            encryption: None,
        }
    }

    #[test]
    fn maps_through_the_keyring_and_finds_the_device() {
        let fake = Fake::new(true);
        let mut mapper = fake.mapper();
        // The "user" key type takes the same path as "ceph", which this
        // kernel lacks (no libceph).
        mapper.key_type = "user";
        let user = format!("krbd-{}", std::process::id());
        let s = spec(&user);
        // The bus file as a FIFO: the mapper's open blocks until the
        // "kernel" opens it, so the kernel can look at the keyring first.
        let add = fake.bus().join("add_single_major");
        std::fs::remove_file(&add).unwrap();
        let c = std::ffi::CString::new(add.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) takes a NUL-terminated path live for the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        std::thread::scope(|scope| {
            let kernel = scope.spawn(|| {
                // The key is in the keyring when the mapper opens the bus
                // file to write the add string. (The process keyring lives
                // in the creds of the thread that made it, so this thread
                // looks in /proc/keys: `<description>: <payload length>`.)
                let line_end = format!("client.{user}: 28");
                let deadline = Instant::now() + Duration::from_secs(5);
                let mut seen = false;
                while !seen && Instant::now() < deadline {
                    let keys = std::fs::read_to_string("/proc/keys").unwrap();
                    seen = keys
                        .lines()
                        .any(|l| l.contains(" user ") && l.ends_with(&line_end));
                    std::thread::sleep(Duration::from_millis(5));
                }
                // Unblocks the mapper's write either way.
                let written = std::fs::read_to_string(&add).unwrap();
                fake.add_device(0, "rbd", "ns1", "vol-1", "-");
                (seen, written)
            });
            let mapped = mapper.map(&s);
            if mapped.is_err() {
                // Release the "kernel" blocked on the FIFO.
                drop(std::fs::OpenOptions::new().write(true).open(&add));
            }
            let (seen, written) = kernel.join().unwrap();
            assert!(seen, "the key was not in the keyring during the write");
            let dev = mapped.unwrap();
            assert_eq!(dev, fake.dir.path().join("dev/rbd0"));
            assert_eq!(
                written,
                format!(
                    "10.0.0.1:6789,10.0.0.2:6789 name={user},key=client.{user},_pool_ns=ns1,\
                     lock_on_read,queue_depth=128 rbd vol-1 -"
                )
            );
            assert!(!written.contains(KEY));
        });
        // Removed from the keyring once the kernel has it.
        assert_eq!(
            keyring::search("user", &format!("client.{user}"), keyring::Keyring::Process).unwrap(),
            None
        );
        // Mapping again returns the same device and writes nothing.
        std::fs::remove_file(&add).unwrap();
        std::fs::write(&add, "").unwrap();
        assert_eq!(mapper.map(&s).unwrap(), fake.dir.path().join("dev/rbd0"));
        assert_eq!(std::fs::read_to_string(&add).unwrap(), "");
        assert_eq!(
            mapper.find(&s.volume_id).unwrap(),
            Some(fake.dir.path().join("dev/rbd0"))
        );
        assert_eq!(
            mapper.check(&s.volume_id, &fake.dir.path().join("dev/rbd0")),
            Ok(())
        );
        assert!(mapper.check(&s.volume_id, Path::new("/dev/rbd9")).is_err());
        assert_eq!(mapper.refresh_size(&s.volume_id).unwrap(), 1 << 30);
        assert_eq!(
            std::fs::read_to_string(fake.bus().join("devices/0/refresh")).unwrap(),
            "1"
        );

        // Unmap: the kernel removes the device when it reads the id.
        std::thread::scope(|scope| {
            let kernel = scope.spawn(|| {
                let line = fake.take("remove_single_major");
                std::fs::remove_dir_all(fake.bus().join("devices/0")).unwrap();
                line
            });
            mapper.unmap(&s.volume_id, &["force".to_owned()]).unwrap();
            assert_eq!(kernel.join().unwrap(), "0 force");
        });
        assert_eq!(mapper.find(&s.volume_id).unwrap(), None);
        // Unmapping what is not mapped is a no-op.
        mapper.unmap(&s.volume_id, &[]).unwrap();
        assert_eq!(
            std::fs::read_to_string(fake.bus().join("remove_single_major")).unwrap(),
            ""
        );
    }

    #[test]
    fn falls_back_to_secret_and_to_the_old_bus_files() {
        // No single-major files; the "ceph" key type is missing here, so
        // the key goes inline.
        let fake = Fake::new(false);
        let mapper = fake.mapper();
        if Path::new("/sys/module/libceph").exists() {
            panic!("this test expects a kernel without libceph");
        }
        let mut s = spec("admin");
        s.namespace.clear();
        s.options.clear();
        s.snapshot = Some("snap-1".into());
        s.volume_id = "rbdkit1/c1/rbd//vol-1".into();
        std::thread::scope(|scope| {
            let kernel = scope.spawn(|| {
                let written = fake.take("add");
                fake.add_device(3, "rbd", "", "vol-1", "snap-1");
                written
            });
            assert_eq!(mapper.map(&s).unwrap(), fake.dir.path().join("dev/rbd3"));
            assert_eq!(
                kernel.join().unwrap(),
                format!("10.0.0.1:6789,10.0.0.2:6789 name=admin,secret={KEY},read_only rbd vol-1 snap-1")
            );
        });
        assert_eq!(
            mapper.find(&s.volume_id).unwrap(),
            Some(fake.dir.path().join("dev/rbd3"))
        );
        // A fresh mapper (after a restart) does not take a snapshot
        // mapping for the volume: it may be anyone's. Mapping again finds it.
        let fresh = fake.mapper();
        assert_eq!(fresh.find(&s.volume_id).unwrap(), None);
        assert_eq!(fresh.map(&s).unwrap(), fake.dir.path().join("dev/rbd3"));
        assert_eq!(
            fresh.find(&s.volume_id).unwrap(),
            Some(fake.dir.path().join("dev/rbd3"))
        );
        std::thread::scope(|scope| {
            let kernel = scope.spawn(|| {
                let line = fake.take("remove");
                std::fs::remove_dir_all(fake.bus().join("devices/3")).unwrap();
                line
            });
            mapper.unmap(&s.volume_id, &[]).unwrap();
            assert_eq!(kernel.join().unwrap(), "3");
        });
    }

    #[test]
    fn a_failed_write_never_echoes_the_secret() {
        let fake = Fake::new(true);
        let mapper = fake.mapper();
        // A directory where the bus file should be: open(2) fails.
        std::fs::remove_file(fake.bus().join("add_single_major")).unwrap();
        std::fs::create_dir(fake.bus().join("add_single_major")).unwrap();
        let e = mapper.map(&spec("admin")).unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.errno(), libc::EISDIR, "{msg}");
        assert!(msg.contains("rbd/ns1/vol-1"), "{msg}");
        assert!(!msg.contains(KEY), "{msg}");
        assert!(!msg.contains("secret="), "{msg}");
        assert!(!format!("{e:?}").contains(KEY));
    }

    #[test]
    fn a_map_that_never_shows_up_times_out() {
        let fake = Fake::new(true);
        let mut mapper = fake.mapper().settle_timeout(Duration::from_millis(200));
        mapper.key_type = "user";
        let e = mapper
            .map(&spec(&format!("to-{}", std::process::id())))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        assert!(!e.to_string().contains(KEY));
    }

    #[test]
    fn refuses_features_the_kernel_lacks() {
        let fake = Fake::new(true);
        let mapper = fake.mapper();
        mapper
            .check_features(Features::LAYERING | Features::EXCLUSIVE_LOCK | Features::OBJECT_MAP)
            .unwrap();
        let e = mapper
            .check_features(Features::LAYERING | Features::JOURNALING)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotSupported);
        let msg = e.to_string();
        assert!(msg.contains("image features journaling "), "{msg}");
        let mut s = spec("admin");
        s.features = Some(Features::JOURNALING);
        let e = mapper.map(&s).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotSupported);
        // Refused before anything reached the kernel.
        assert_eq!(
            std::fs::read_to_string(fake.bus().join("add_single_major")).unwrap(),
            ""
        );
        std::fs::remove_file(fake.bus().join("supported_features")).unwrap();
        assert_eq!(mapper.supported_features().unwrap(), None);
        mapper.check_features(Features::JOURNALING).unwrap();
        std::fs::write(fake.bus().join("supported_features"), "junk").unwrap();
        assert!(mapper.supported_features().is_err());
    }

    #[test]
    fn the_add_string_is_built_in_one_buffer_of_its_size() {
        let s = spec("admin");
        let add = add_string(&s, &[b"secret=", KEY.as_bytes()]);
        assert_eq!(
            String::from_utf8(add.clone()).unwrap(),
            format!(
                "10.0.0.1:6789,10.0.0.2:6789 name=admin,secret={KEY},_pool_ns=ns1,lock_on_read,queue_depth=128 rbd vol-1 -"
            )
        );
        // No spare room: nothing was reallocated, so no freed copy of the key.
        assert_eq!(add.capacity(), add.len());
        let mut bare = spec("admin");
        bare.namespace.clear();
        bare.options.clear();
        let add = add_string(&bare, &[b"key=", b"client.admin"]);
        assert_eq!(
            add,
            b"10.0.0.1:6789,10.0.0.2:6789 name=admin,key=client.admin rbd vol-1 -"
        );
    }

    #[test]
    fn exclusive_and_lock_on_read_need_the_exclusive_lock_feature() {
        let fake = Fake::new(true);
        let mapper = fake.mapper();
        let mut s = spec("admin");
        s.options = vec!["exclusive".into()];
        s.features = Some(Features::LAYERING);
        let e = mapper.map(&s).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let msg = e.to_string();
        assert!(
            msg.contains("\"exclusive\"") && msg.contains("exclusive-lock"),
            "{msg}"
        );
        s.options = vec!["queue_depth=64".into(), "lock_on_read".into()];
        let msg = mapper.map(&s).unwrap_err().to_string();
        assert!(
            msg.contains("\"lock_on_read\"") && msg.contains("exclusive-lock"),
            "{msg}"
        );
        // Refused before anything reached the kernel.
        assert_eq!(
            std::fs::read_to_string(fake.bus().join("add_single_major")).unwrap(),
            ""
        );
    }

    #[test]
    fn refuses_what_the_add_string_cannot_carry() {
        let fake = Fake::new(true);
        let mapper = fake.mapper();
        let cases: [fn(&mut MapSpec); 7] = [
            |s| s.image = "has space".into(),
            |s| s.pool.clear(),
            |s| s.monitors.clear(),
            |s| s.namespace = "a,b".into(),
            |s| s.options = vec!["secret=x".into()],
            |s| s.options = vec!["a,b".into()],
            |s| s.snapshot = Some("-".into()),
        ];
        for change in cases {
            let mut s = spec("admin");
            change(&mut s);
            let e = mapper.map(&s).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        }
        assert_eq!(
            std::fs::read_to_string(fake.bus().join("add_single_major")).unwrap(),
            ""
        );
    }

    #[test]
    fn busy_unmaps_are_retried_a_bounded_number_of_times() {
        let mut calls = 0;
        let r = retry_busy(3, Duration::from_millis(1), || {
            calls += 1;
            if calls < 3 {
                Err(libc::EBUSY)
            } else {
                Ok(())
            }
        });
        assert_eq!((r, calls), (Ok(()), 3));
        let mut calls = 0;
        let r = retry_busy(2, Duration::from_millis(1), || {
            calls += 1;
            Err(libc::EBUSY)
        });
        assert_eq!((r, calls), (Err(libc::EBUSY), 3));
        let mut calls = 0;
        let r = retry_busy(5, Duration::from_millis(1), || {
            calls += 1;
            Err(libc::EINVAL)
        });
        assert_eq!((r, calls), (Err(libc::EINVAL), 1));
    }

    #[test]
    fn find_needs_an_rbdkit_volume_id() {
        let fake = Fake::new(true);
        let e = fake.mapper().find("not-a-handle").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert_eq!(fake.mapper().find("rbdkit1/c/rbd//x").unwrap(), None);
    }

    #[test]
    fn two_clusters_images_of_one_name_are_told_apart_by_fsid() {
        let fake = Fake::new(false);
        let mapper = fake.mapper();
        let mut s = spec("admin");
        s.options.clear();
        // Cluster A's image of the same pool and name is mapped already.
        fake.add_device_of(0, "rbd", "ns1", "vol-1", "-", FSID_A);
        s.cluster_fsid = Some(FSID_B.to_ascii_uppercase());
        std::thread::scope(|scope| {
            let kernel = scope.spawn(|| {
                let written = fake.take("add");
                fake.add_device_of(1, "rbd", "ns1", "vol-1", "-", FSID_B);
                written
            });
            // Not rbd0: that one is cluster A's.
            assert_eq!(mapper.map(&s).unwrap(), fake.dir.path().join("dev/rbd1"));
            assert!(kernel.join().unwrap().ends_with(" rbd vol-1 -"));
        });
        assert_eq!(
            mapper.find(&s.volume_id).unwrap(),
            Some(fake.dir.path().join("dev/rbd1"))
        );
        // After a restart, without the cluster, two candidates: refused by
        // name rather than one picked.
        let fresh = fake.mapper();
        let e = fresh.find(&s.volume_id).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        let msg = e.to_string();
        assert!(
            msg.contains("rbd0") && msg.contains("rbd1") && msg.contains(FSID_B),
            "{msg}"
        );
        assert!(fresh.unmap(&s.volume_id, &[]).is_err());
        assert_eq!(
            std::fs::read_to_string(fake.bus().join("remove")).unwrap(),
            ""
        );
        // Told the cluster (the node plugin's stash), it finds and unmaps B's.
        fresh.adopt(&s.volume_id, FSID_B);
        assert_eq!(
            fresh.find(&s.volume_id).unwrap(),
            Some(fake.dir.path().join("dev/rbd1"))
        );
        std::thread::scope(|scope| {
            let kernel = scope.spawn(|| {
                let line = fake.take("remove");
                std::fs::remove_dir_all(fake.bus().join("devices/1")).unwrap();
                line
            });
            fresh.unmap(&s.volume_id, &[]).unwrap();
            assert_eq!(kernel.join().unwrap(), "1");
        });
        // Cluster A's mapping is untouched and, for cluster B, not this
        // volume's.
        assert!(fake.bus().join("devices/0").exists());
        fresh.adopt(&s.volume_id, FSID_B);
        assert_eq!(fresh.find(&s.volume_id).unwrap(), None);
    }

    #[test]
    fn a_snapshot_mapping_is_never_taken_for_the_head() {
        let fake = Fake::new(true);
        fake.add_device(2, "rbd", "ns1", "vol-1", "snap-9");
        let mapper = fake.mapper();
        let id = spec("admin").volume_id;
        assert_eq!(mapper.find(&id).unwrap(), None);
        // Unmapping the volume leaves someone else's snapshot mapping be.
        mapper.unmap(&id, &[]).unwrap();
        assert_eq!(
            std::fs::read_to_string(fake.bus().join("remove_single_major")).unwrap(),
            ""
        );
        assert!(mapper.check(&id, Path::new("/dev/rbd2")).is_err());
    }

    #[test]
    fn ready_needs_the_bus_files() {
        let fake = Fake::new(true);
        assert_eq!(fake.mapper().ready(), Ok(()));
        for f in ["add", "add_single_major"] {
            std::fs::remove_file(fake.bus().join(f)).unwrap();
        }
        let why = fake.mapper().ready().unwrap_err();
        assert!(
            why.contains("bus/rbd/add") && why.contains("not loaded"),
            "{why}"
        );
    }
}
