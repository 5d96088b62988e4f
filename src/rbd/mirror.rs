//! RBD mirroring: pool mirror modes, site names and peers, per-image
//! mirroring (enable, disable, promote, demote, resync, mirror snapshots,
//! status), and the `rbd_support` manager module's mirror snapshot
//! schedules.
//!
//! Snapshot-based mirroring: the primary image takes mirror snapshots (by
//! [`Image::mirror_create_snapshot`] or on a schedule, see
//! [`mirror_snapshot_schedule_add`]), and the `rbd-mirror` daemon of each
//! peer site copies the difference between two of them into its
//! non-primary copy. The pool must be in [`MirrorMode::Image`] mode for
//! images to be mirrored one by one, and the sites must know each other as
//! peers ([`mirror_peer_bootstrap_create`] on one,
//! [`mirror_peer_bootstrap_import`] on the other).
//!
//! Bounds: every call here is a librbd or librados call bounded by the
//! connection's timeouts (OSD ops, mon and mgr commands). Promote and demote
//! also wait for the image's exclusive lock, which a stuck peer daemon may
//! never hand over (Ceph 16 Pacific's force promote can hang that way):
//! [`Image::mirror_promote_within`] and [`Image::mirror_demote_within`] run
//! them on a thread of their own and give up waiting after a timeout.

use std::collections::HashSet;
use std::mem::size_of;
use std::os::raw::c_int;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rbd_sys as sys;

use crate::error::{cvt, Error, ErrorKind, Result};
use crate::json::Json;
use crate::rados::{zeroize, Cluster, IoCtx, Secret};
use crate::rbd::Image;
use crate::util::{cstr, from_cstr, sized_buffer, string_from_buf};

/// A pool's mirroring mode (`rbd_mirror_mode_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorMode {
    /// No mirroring.
    Disabled,
    /// Images are mirrored one by one, when enabled on each (what
    /// snapshot-based mirroring needs).
    Image,
    /// Every image with the journaling feature is mirrored.
    Pool,
}

impl MirrorMode {
    fn from_raw(raw: sys::rbd_mirror_mode_t) -> MirrorMode {
        match raw {
            sys::RBD_MIRROR_MODE_IMAGE => MirrorMode::Image,
            sys::RBD_MIRROR_MODE_POOL => MirrorMode::Pool,
            _ => MirrorMode::Disabled,
        }
    }

    fn raw(self) -> sys::rbd_mirror_mode_t {
        match self {
            MirrorMode::Disabled => sys::RBD_MIRROR_MODE_DISABLED,
            MirrorMode::Image => sys::RBD_MIRROR_MODE_IMAGE,
            MirrorMode::Pool => sys::RBD_MIRROR_MODE_POOL,
        }
    }
}

/// Which way a peer site replicates (`rbd_mirror_peer_direction_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorPeerDirection {
    /// This site receives from the peer.
    Rx,
    /// This site only sends to the peer.
    Tx,
    /// Both ways.
    RxTx,
}

impl MirrorPeerDirection {
    fn from_raw(raw: sys::rbd_mirror_peer_direction_t) -> MirrorPeerDirection {
        match raw {
            sys::RBD_MIRROR_PEER_DIRECTION_TX => MirrorPeerDirection::Tx,
            sys::RBD_MIRROR_PEER_DIRECTION_RX_TX => MirrorPeerDirection::RxTx,
            _ => MirrorPeerDirection::Rx,
        }
    }

    fn raw(self) -> sys::rbd_mirror_peer_direction_t {
        match self {
            MirrorPeerDirection::Rx => sys::RBD_MIRROR_PEER_DIRECTION_RX,
            MirrorPeerDirection::Tx => sys::RBD_MIRROR_PEER_DIRECTION_TX,
            MirrorPeerDirection::RxTx => sys::RBD_MIRROR_PEER_DIRECTION_RX_TX,
        }
    }
}

/// A peer site of a pool, from `rbd_mirror_peer_site_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorPeerSite {
    /// The peer's uuid in this pool (what [`mirror_peer_site_remove`] takes).
    pub uuid: String,
    /// Which way it replicates.
    pub direction: MirrorPeerDirection,
    /// The peer's site name.
    pub site_name: String,
    /// The peer's mirror uuid (empty until its daemon has been seen).
    pub mirror_uuid: String,
    /// The cephx user this site's daemon connects to the peer as.
    pub client_name: String,
    /// When the peer's daemon was last seen, if ever.
    pub last_seen: Option<SystemTime>,
}

fn time_of(t: sys::time_t) -> Option<SystemTime> {
    u64::try_from(t)
        .ok()
        .filter(|s| *s > 0)
        .map(|s| UNIX_EPOCH + Duration::from_secs(s))
}

fn io_obj(io: &IoCtx) -> String {
    io.spec()
}

/// This cluster's mirroring site name (the cluster's fsid until one is
/// set). Wraps `rbd_mirror_site_name_get`.
pub fn mirror_site_name_get(cluster: &Cluster) -> Result<String> {
    let buf = sized_buffer(
        64,
        "rbd_mirror_site_name_get",
        &|| "site name".into(),
        |p, len| {
            // SAFETY: `p` is writable for `*len` bytes; on -ERANGE librbd sets
            // `*len` to the size it needs.
            unsafe { sys::rbd_mirror_site_name_get(cluster.raw(), p, len) }
        },
    )?;
    Ok(string_from_buf(&buf))
}

/// Sets this cluster's mirroring site name (empty: back to the fsid).
/// Needs mon caps for `config-key set`. Wraps `rbd_mirror_site_name_set`.
pub fn mirror_site_name_set(cluster: &Cluster, name: &str) -> Result<()> {
    let n = cstr(name, "rbd_mirror_site_name_set", "site name")?;
    // SAFETY: the cluster is connected; `n` is NUL-terminated.
    let ret = unsafe { sys::rbd_mirror_site_name_set(cluster.raw(), n.as_ptr()) };
    cvt(ret, "rbd_mirror_site_name_set", || {
        format!("site name {name:?}")
    })?;
    Ok(())
}

/// The pool's (or the ioctx's namespace's) mirroring mode. Wraps
/// `rbd_mirror_mode_get`.
pub fn mirror_mode_get(io: &IoCtx) -> Result<MirrorMode> {
    let mut raw: sys::rbd_mirror_mode_t = sys::RBD_MIRROR_MODE_DISABLED;
    // SAFETY: the ioctx is live; `raw` is a valid out-pointer of the
    // header's enum type.
    let ret = unsafe { sys::rbd_mirror_mode_get(io.raw(), &mut raw) };
    cvt(ret, "rbd_mirror_mode_get", || io_obj(io))?;
    Ok(MirrorMode::from_raw(raw))
}

/// Sets the pool's (or namespace's) mirroring mode. Disabling fails while
/// images are mirrored or peers are registered. Wraps
/// `rbd_mirror_mode_set`.
pub fn mirror_mode_set(io: &IoCtx, mode: MirrorMode) -> Result<()> {
    // SAFETY: the ioctx is live.
    let ret = unsafe { sys::rbd_mirror_mode_set(io.raw(), mode.raw()) };
    cvt(ret, "rbd_mirror_mode_set", || {
        format!("{} (mode {mode:?})", io_obj(io))
    })?;
    Ok(())
}

/// The pool's mirror uuid (how peers name this site's images). Wraps
/// `rbd_mirror_uuid_get`.
pub fn mirror_uuid_get(io: &IoCtx) -> Result<String> {
    let buf = sized_buffer(64, "rbd_mirror_uuid_get", &|| io_obj(io), |p, len| {
        // SAFETY: `p` is writable for `*len` bytes; -ERANGE sets `*len`.
        unsafe { sys::rbd_mirror_uuid_get(io.raw(), p, len) }
    })?;
    Ok(string_from_buf(&buf))
}

/// Makes a bootstrap token for a peer site to import: base64 JSON with this
/// cluster's fsid, monitors and the key of a `client.rbd-mirror-peer` user
/// it creates. The token is a credential and comes back as a [`Secret`].
/// Needs admin-like mon caps (`auth get-or-create`). Wraps
/// `rbd_mirror_peer_bootstrap_create`.
pub fn mirror_peer_bootstrap_create(io: &IoCtx) -> Result<Secret> {
    let mut buf = sized_buffer(
        1024,
        "rbd_mirror_peer_bootstrap_create",
        &|| io_obj(io),
        |p, len| {
            // SAFETY: `p` is writable for `*len` bytes; on -ERANGE librbd sets
            // `*len` to the size it needs.
            unsafe { sys::rbd_mirror_peer_bootstrap_create(io.raw(), p, len) }
        },
    )?;
    let token = Secret::new(string_from_buf(&buf));
    zeroize(&mut buf);
    Ok(token)
}

/// Imports a peer's bootstrap token: registers the peer site in this pool
/// (and, with [`MirrorPeerDirection::RxTx`], this site in the peer's pool)
/// and stores its monitors and key where this site's `rbd-mirror` daemon
/// finds them. Only `Rx` and `RxTx` are allowed. Wraps
/// `rbd_mirror_peer_bootstrap_import`.
pub fn mirror_peer_bootstrap_import(
    io: &IoCtx,
    direction: MirrorPeerDirection,
    token: &Secret,
) -> Result<()> {
    if direction == MirrorPeerDirection::Tx {
        return Err(Error::invalid(
            "rbd_mirror_peer_bootstrap_import",
            io_obj(io),
            "a bootstrap import is rx or rx-tx, never tx only",
        ));
    }
    let mut raw = token.expose().as_bytes().to_vec();
    if raw.contains(&0) {
        zeroize(&mut raw);
        return Err(Error::invalid(
            "rbd_mirror_peer_bootstrap_import",
            io_obj(io),
            "the token contains a NUL byte (value not shown)",
        ));
    }
    raw.push(0);
    // SAFETY: the ioctx is live; `raw` is NUL-terminated and outlives the
    // call, which only reads it.
    let ret = unsafe {
        sys::rbd_mirror_peer_bootstrap_import(io.raw(), direction.raw(), raw.as_ptr().cast())
    };
    zeroize(&mut raw);
    cvt(ret, "rbd_mirror_peer_bootstrap_import", || io_obj(io)).map_err(|e| match e.kind() {
        ErrorKind::InvalidArgument => e.detail(
            "the token is not valid here: malformed, made by this very cluster, or the peer has the same site name",
        ),
        ErrorKind::NotSupported => e.detail("the peer's pool does not have mirroring enabled"),
        _ => e,
    })?;
    Ok(())
}

/// Registers a peer site by hand (its monitors and key are then set as
/// attributes, or found in a local conf for `site_name`). Returns the
/// peer's uuid. Wraps `rbd_mirror_peer_site_add`.
pub fn mirror_peer_site_add(
    io: &IoCtx,
    direction: MirrorPeerDirection,
    site_name: &str,
    client_name: &str,
) -> Result<String> {
    let s = cstr(site_name, "rbd_mirror_peer_site_add", "site name")?;
    let c = cstr(client_name, "rbd_mirror_peer_site_add", "client name")?;
    let mut uuid = vec![0u8; 64];
    // SAFETY: the ioctx is live; `uuid` is writable for its length; both
    // names are NUL-terminated.
    let ret = unsafe {
        sys::rbd_mirror_peer_site_add(
            io.raw(),
            uuid.as_mut_ptr().cast(),
            uuid.len(),
            direction.raw(),
            s.as_ptr(),
            c.as_ptr(),
        )
    };
    cvt(ret, "rbd_mirror_peer_site_add", || {
        format!("{} peer {site_name:?}", io_obj(io))
    })?;
    Ok(string_from_buf(&uuid))
}

/// Removes a peer site by uuid. Wraps `rbd_mirror_peer_site_remove`.
pub fn mirror_peer_site_remove(io: &IoCtx, uuid: &str) -> Result<()> {
    let u = cstr(uuid, "rbd_mirror_peer_site_remove", "peer uuid")?;
    // SAFETY: the ioctx is live; `u` is NUL-terminated.
    let ret = unsafe { sys::rbd_mirror_peer_site_remove(io.raw(), u.as_ptr()) };
    cvt(ret, "rbd_mirror_peer_site_remove", || {
        format!("{} peer {uuid}", io_obj(io))
    })?;
    Ok(())
}

/// The pool's peer sites. Wraps `rbd_mirror_peer_site_list` and
/// `rbd_mirror_peer_site_list_cleanup`.
pub fn mirror_peer_site_list(io: &IoCtx) -> Result<Vec<MirrorPeerSite>> {
    let mut max: c_int = 8;
    loop {
        let mut peers: Vec<sys::rbd_mirror_peer_site_t> =
            (0..max).map(|_| Default::default()).collect();
        let mut n = max;
        // SAFETY: `peers` has room for `n` entries; on -ERANGE librbd sets
        // `n` to the count it needs and fills nothing.
        let ret = unsafe { sys::rbd_mirror_peer_site_list(io.raw(), peers.as_mut_ptr(), &mut n) };
        if ret == -libc::ERANGE && n > max && n <= 1 << 16 {
            max = n;
            continue;
        }
        cvt(ret, "rbd_mirror_peer_site_list", || io_obj(io))?;
        let count = usize::try_from(n).unwrap_or(0).min(peers.len());
        let out = peers[..count]
            .iter()
            .map(|p| MirrorPeerSite {
                // SAFETY: librbd filled the first `count` entries with valid
                // strings (or nulls).
                uuid: unsafe { from_cstr(p.uuid) },
                direction: MirrorPeerDirection::from_raw(p.direction),
                // SAFETY: as above.
                site_name: unsafe { from_cstr(p.site_name) },
                // SAFETY: as above.
                mirror_uuid: unsafe { from_cstr(p.mirror_uuid) },
                // SAFETY: as above.
                client_name: unsafe { from_cstr(p.client_name) },
                last_seen: time_of(p.last_seen),
            })
            .collect();
        // SAFETY: frees the strings of the `n` filled entries, once (the
        // header's cleanup for this list).
        unsafe { sys::rbd_mirror_peer_site_list_cleanup(peers.as_mut_ptr(), n) };
        return Ok(out);
    }
}

/// How an image is mirrored (`rbd_mirror_image_mode_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorImageMode {
    /// Every write is journaled and replayed (needs the journaling feature,
    /// which krbd cannot map).
    Journal,
    /// Mirror snapshots are copied as they are taken.
    Snapshot,
}

impl MirrorImageMode {
    fn from_raw(raw: sys::rbd_mirror_image_mode_t) -> MirrorImageMode {
        match raw {
            sys::RBD_MIRROR_IMAGE_MODE_JOURNAL => MirrorImageMode::Journal,
            _ => MirrorImageMode::Snapshot,
        }
    }

    fn raw(self) -> sys::rbd_mirror_image_mode_t {
        match self {
            MirrorImageMode::Journal => sys::RBD_MIRROR_IMAGE_MODE_JOURNAL,
            MirrorImageMode::Snapshot => sys::RBD_MIRROR_IMAGE_MODE_SNAPSHOT,
        }
    }
}

/// Whether an image is mirrored (`rbd_mirror_image_state_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorImageState {
    /// Being disabled.
    Disabling,
    /// Mirrored.
    Enabled,
    /// Not mirrored.
    Disabled,
}

/// An image's mirroring state, from `rbd_mirror_image_get_info`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorImageInfo {
    /// The id all sites know the image by (empty while not mirrored).
    pub global_id: String,
    /// Whether it is mirrored.
    pub state: MirrorImageState,
    /// Whether this site's copy is the primary (writable) one.
    pub primary: bool,
}

impl MirrorImageInfo {
    fn from_raw(raw: &sys::rbd_mirror_image_info_t) -> MirrorImageInfo {
        MirrorImageInfo {
            // SAFETY: librbd filled the struct; the string is valid or null.
            global_id: unsafe { from_cstr(raw.global_id) },
            state: match raw.state {
                sys::RBD_MIRROR_IMAGE_DISABLING => MirrorImageState::Disabling,
                sys::RBD_MIRROR_IMAGE_ENABLED => MirrorImageState::Enabled,
                _ => MirrorImageState::Disabled,
            },
            primary: raw.primary,
        }
    }
}

/// The state of an image at one site, as its `rbd-mirror` daemon reports
/// it (`rbd_mirror_image_status_state_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MirrorStatusState {
    /// Nothing known (also: both sites demoted and idle).
    Unknown,
    /// The daemon failed on this image (the description says why, e.g.
    /// split-brain).
    Error,
    /// A full copy is under way.
    Syncing,
    /// Replay is starting.
    StartingReplay,
    /// Replaying (in snapshot mode: copying or idle between snapshots).
    Replaying,
    /// Replay is stopping.
    StoppingReplay,
    /// Not replaying (e.g. this site's copy is the primary).
    Stopped,
    /// A value this version of rbdkit does not know.
    Other(u32),
}

impl MirrorStatusState {
    fn from_raw(raw: sys::rbd_mirror_image_status_state_t) -> MirrorStatusState {
        match raw {
            sys::MIRROR_IMAGE_STATUS_STATE_UNKNOWN => MirrorStatusState::Unknown,
            sys::MIRROR_IMAGE_STATUS_STATE_ERROR => MirrorStatusState::Error,
            sys::MIRROR_IMAGE_STATUS_STATE_SYNCING => MirrorStatusState::Syncing,
            sys::MIRROR_IMAGE_STATUS_STATE_STARTING_REPLAY => MirrorStatusState::StartingReplay,
            sys::MIRROR_IMAGE_STATUS_STATE_REPLAYING => MirrorStatusState::Replaying,
            sys::MIRROR_IMAGE_STATUS_STATE_STOPPING_REPLAY => MirrorStatusState::StoppingReplay,
            sys::MIRROR_IMAGE_STATUS_STATE_STOPPED => MirrorStatusState::Stopped,
            // The C enum's integer type is up to the compiler.
            #[allow(clippy::unnecessary_cast)]
            other => MirrorStatusState::Other(other as u32),
        }
    }

    /// The name the `rbd` CLI prints (`replaying`, `stopped`, ...).
    pub fn name(self) -> &'static str {
        match self {
            MirrorStatusState::Unknown => "unknown",
            MirrorStatusState::Error => "error",
            MirrorStatusState::Syncing => "syncing",
            MirrorStatusState::StartingReplay => "starting_replay",
            MirrorStatusState::Replaying => "replaying",
            MirrorStatusState::StoppingReplay => "stopping_replay",
            MirrorStatusState::Stopped => "stopped",
            MirrorStatusState::Other(_) => "other",
        }
    }
}

/// One site's status of a mirrored image.
#[derive(Debug, Clone, PartialEq)]
pub struct MirrorSiteStatus {
    /// The site's mirror uuid; empty for this (the local) site.
    pub mirror_uuid: String,
    /// The state its daemon reports.
    pub state: MirrorStatusState,
    /// Its daemon's description, e.g. `local image is primary` or
    /// `replaying, {"local_snapshot_timestamp":...}`.
    pub description: String,
    /// When it was last updated.
    pub last_update: Option<SystemTime>,
    /// Whether the daemon that reported it is still running.
    pub up: bool,
}

impl MirrorSiteStatus {
    /// True for this site's own entry.
    pub fn is_local(&self) -> bool {
        self.mirror_uuid.is_empty()
    }

    /// `up+replaying`, as the CLI shows it.
    pub fn summary(&self) -> String {
        format!(
            "{}+{}",
            if self.up { "up" } else { "down" },
            self.state.name()
        )
    }

    /// The snapshot replay figures in the description (`replaying, {...}`),
    /// if it carries any.
    pub fn snapshot_replay(&self) -> Option<SnapshotReplay> {
        SnapshotReplay::parse(&self.description)
    }
}

/// Where snapshot replay stands, from a site's status description.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SnapshotReplay {
    /// The primary's creation time of the newest snapshot copied in full.
    pub local_snapshot_timestamp: Option<SystemTime>,
    /// The creation time of the primary's newest mirror snapshot.
    pub remote_snapshot_timestamp: Option<SystemTime>,
    /// How long copying the last snapshot took.
    pub last_snapshot_sync: Option<Duration>,
    /// How many bytes the last snapshot copied.
    pub last_snapshot_bytes: Option<u64>,
    /// `idle` or `syncing`.
    pub replay_state: Option<String>,
    /// How far the snapshot being copied is, in percent.
    pub syncing_percent: Option<f64>,
}

impl SnapshotReplay {
    /// Reads `<state text>, {json}`; `None` when there is no JSON part.
    pub fn parse(description: &str) -> Option<SnapshotReplay> {
        let at = description.find('{')?;
        let v = Json::parse(&description[at..]).ok()?;
        let secs = |k: &str| {
            v.get(k)
                .and_then(Json::as_f64)
                .filter(|s| *s > 0.0 && s.is_finite())
                .map(|s| UNIX_EPOCH + Duration::from_secs_f64(s))
        };
        Some(SnapshotReplay {
            local_snapshot_timestamp: secs("local_snapshot_timestamp"),
            remote_snapshot_timestamp: secs("remote_snapshot_timestamp"),
            last_snapshot_sync: v
                .get("last_snapshot_sync_seconds")
                .and_then(Json::as_f64)
                .filter(|s| *s >= 0.0 && s.is_finite())
                .map(Duration::from_secs_f64),
            last_snapshot_bytes: v
                .get("last_snapshot_bytes")
                .and_then(Json::as_f64)
                .filter(|b| *b >= 0.0)
                .map(|b| b as u64),
            replay_state: v
                .get("replay_state")
                .and_then(Json::as_str)
                .map(str::to_owned),
            syncing_percent: v.get("syncing_percent").and_then(Json::as_f64),
        })
    }

    /// True when the newest mirror snapshot has been copied and nothing is
    /// being copied.
    pub fn in_sync(&self) -> bool {
        self.replay_state.as_deref() == Some("idle")
            && self.local_snapshot_timestamp.is_some()
            && self.local_snapshot_timestamp == self.remote_snapshot_timestamp
    }
}

/// Every site's status of an image, from
/// `rbd_mirror_image_get_global_status`.
#[derive(Debug, Clone, PartialEq)]
pub struct MirrorGlobalStatus {
    /// The image name.
    pub name: String,
    /// Its mirroring state at this site.
    pub info: MirrorImageInfo,
    /// One entry per site that reported (this site's has an empty uuid).
    pub sites: Vec<MirrorSiteStatus>,
}

impl MirrorGlobalStatus {
    /// This site's entry, written by this site's daemon.
    pub fn local(&self) -> Option<&MirrorSiteStatus> {
        self.sites.iter().find(|s| s.is_local())
    }

    /// The peer sites' entries, written by their daemons.
    pub fn peers(&self) -> impl Iterator<Item = &MirrorSiteStatus> {
        self.sites.iter().filter(|s| !s.is_local())
    }
}

/// The state of a mirror snapshot (`rbd_snap_mirror_state_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorSnapState {
    /// Taken on the primary.
    Primary,
    /// Taken on the primary as it was demoted.
    PrimaryDemoted,
    /// A copy of a primary's snapshot.
    NonPrimary,
    /// A copy of a demotion snapshot.
    NonPrimaryDemoted,
}

/// What a mirror snapshot is, from `rbd_snap_get_mirror_namespace`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorSnapNamespace {
    /// Primary or copy, demoted or not.
    pub state: MirrorSnapState,
    /// The peers still to copy it (primary snapshots).
    pub mirror_peer_uuids: Vec<String>,
    /// Whether the copy is complete (non-primary snapshots).
    pub complete: bool,
    /// The primary site's mirror uuid (non-primary snapshots).
    pub primary_mirror_uuid: String,
    /// The snapshot id on the primary it copies (non-primary snapshots).
    pub primary_snap_id: u64,
    /// How far a copy in progress is.
    pub last_copied_object_number: u64,
}

/// The flags of [`Image::mirror_create_snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MirrorSnapshotFlags {
    /// Do not ask the image's users to quiesce first.
    pub skip_quiesce: bool,
    /// Take the snapshot even if a quiesce request fails.
    pub ignore_quiesce_error: bool,
}

/// Image promotions and demotions still running on an abandoned thread,
/// by cluster fsid and image: a second one would only queue behind it.
static IN_FLIGHT: Mutex<Option<HashSet<String>>> = Mutex::new(None);

fn in_flight() -> std::sync::MutexGuard<'static, Option<HashSet<String>>> {
    IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner())
}

impl Image {
    fn mirror_obj(&self) -> String {
        self.spec()
    }

    /// Enables mirroring of the image in `mode` (snapshot mode takes the
    /// first mirror snapshot). The pool must be in [`MirrorMode::Image`]
    /// mode (or [`MirrorMode::Pool`] for journal mode). Enabling an enabled
    /// image is not an error. Wraps `rbd_mirror_image_enable2`.
    pub fn mirror_enable(&self, mode: MirrorImageMode) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_mirror_image_enable2(self.raw(), mode.raw()) };
        cvt(ret, "rbd_mirror_image_enable2", || self.mirror_obj()).map_err(|e| {
            if e.kind() == ErrorKind::InvalidArgument {
                e.detail(format!(
                    "cannot mirror the image in {mode:?} mode: the pool {} must be in image mirror mode (and journal mode needs the journaling feature)",
                    self.ioctx().spec()
                ))
            } else {
                e
            }
        })?;
        Ok(())
    }

    /// Disables mirroring of the image. On the primary this makes the peers
    /// delete their copies; a non-primary copy needs `force`. Wraps
    /// `rbd_mirror_image_disable`.
    pub fn mirror_disable(&self, force: bool) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_mirror_image_disable(self.raw(), force) };
        cvt(ret, "rbd_mirror_image_disable", || self.mirror_obj())?;
        Ok(())
    }

    /// Makes this site's copy the primary. Without `force` it fails with
    /// [`ErrorKind::Busy`] while another site's copy is primary or its
    /// demotion has not arrived yet; `force` promotes anyway (a split
    /// brain until the other copy is demoted and resynced). It fails with
    /// [`ErrorKind::ReadOnly`] while this site's rbd-mirror daemon, still
    /// replaying, refuses to hand the image over (seen for a moment right
    /// after a demotion arrived): try again. Waits for the exclusive lock,
    /// with no bound of its own: see [`Image::mirror_promote_within`].
    /// Wraps `rbd_mirror_image_promote`.
    pub fn mirror_promote(&self, force: bool) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_mirror_image_promote(self.raw(), force) };
        cvt(ret, "rbd_mirror_image_promote", || self.mirror_obj()).map_err(|e| match e.kind() {
            ErrorKind::Busy => e.detail(
                "the image is primary at another site, or its demotion there has not been copied here yet; demote it there first, or promote with force",
            ),
            ErrorKind::InvalidArgument => {
                e.detail("the image is already primary here, or is not mirrored")
            }
            ErrorKind::ReadOnly => e.detail(
                "this site's rbd-mirror daemon still holds the image (it is replaying); try again",
            ),
            _ => e,
        })?;
        Ok(())
    }

    /// Makes this site's copy non-primary (read-only); the demotion is
    /// copied to the peers as a last mirror snapshot, after which a peer can
    /// be promoted without force. Takes the exclusive lock. Wraps
    /// `rbd_mirror_image_demote`.
    pub fn mirror_demote(&self) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_mirror_image_demote(self.raw()) };
        cvt(ret, "rbd_mirror_image_demote", || self.mirror_obj()).map_err(|e| {
            if e.kind() == ErrorKind::InvalidArgument {
                e.detail("the image is not primary here, or is not mirrored")
            } else {
                e
            }
        })?;
        Ok(())
    }

    /// Flags this site's non-primary copy for a full resync from the
    /// primary: this site's `rbd-mirror` deletes it and copies it anew (a
    /// new image id). Wraps `rbd_mirror_image_resync`.
    pub fn mirror_resync(&self) -> Result<()> {
        // SAFETY: the image is open.
        let ret = unsafe { sys::rbd_mirror_image_resync(self.raw()) };
        cvt(ret, "rbd_mirror_image_resync", || self.mirror_obj()).map_err(|e| {
            if e.kind() == ErrorKind::InvalidArgument {
                e.detail("the image is primary here (a primary cannot resync from itself) or is not mirrored")
            } else {
                e
            }
        })?;
        Ok(())
    }

    /// Takes a mirror snapshot of the primary copy now; the peers' daemons
    /// copy it. Returns its snapshot id. Wraps
    /// `rbd_mirror_image_create_snapshot2`.
    pub fn mirror_create_snapshot(&self, flags: MirrorSnapshotFlags) -> Result<u64> {
        let mut raw = 0u32;
        if flags.skip_quiesce {
            raw |= sys::RBD_SNAP_CREATE_SKIP_QUIESCE;
        }
        if flags.ignore_quiesce_error {
            raw |= sys::RBD_SNAP_CREATE_IGNORE_QUIESCE_ERROR;
        }
        let mut id = 0u64;
        // SAFETY: the image is open; `id` is a valid out-pointer.
        let ret = unsafe { sys::rbd_mirror_image_create_snapshot2(self.raw(), raw, &mut id) };
        cvt(ret, "rbd_mirror_image_create_snapshot2", || {
            self.mirror_obj()
        })
        .map_err(|e| {
            if e.kind() == ErrorKind::InvalidArgument {
                e.detail("the image is not primary here, or is not mirrored in snapshot mode")
            } else {
                e
            }
        })?;
        Ok(id)
    }

    /// The image's mirroring state here. Wraps `rbd_mirror_image_get_info`
    /// and `rbd_mirror_image_get_info_cleanup`.
    pub fn mirror_info(&self) -> Result<MirrorImageInfo> {
        let mut raw = sys::rbd_mirror_image_info_t::default();
        // SAFETY: the image is open; `raw` is a struct of the size passed.
        let ret = unsafe {
            sys::rbd_mirror_image_get_info(
                self.raw(),
                &mut raw,
                size_of::<sys::rbd_mirror_image_info_t>(),
            )
        };
        cvt(ret, "rbd_mirror_image_get_info", || self.mirror_obj())?;
        let out = MirrorImageInfo::from_raw(&raw);
        // SAFETY: librbd filled `raw`; its strings are freed once, here.
        unsafe { sys::rbd_mirror_image_get_info_cleanup(&mut raw) };
        Ok(out)
    }

    /// How the image is mirrored (meaningful only while it is: Ceph 16
    /// answers `Journal` for an image that is not). Wraps
    /// `rbd_mirror_image_get_mode`.
    pub fn mirror_mode(&self) -> Result<MirrorImageMode> {
        let mut raw: sys::rbd_mirror_image_mode_t = sys::RBD_MIRROR_IMAGE_MODE_SNAPSHOT;
        // SAFETY: the image is open; `raw` is a valid out-pointer.
        let ret = unsafe { sys::rbd_mirror_image_get_mode(self.raw(), &mut raw) };
        cvt(ret, "rbd_mirror_image_get_mode", || self.mirror_obj())?;
        Ok(MirrorImageMode::from_raw(raw))
    }

    /// Every site's status of the image. Wraps
    /// `rbd_mirror_image_get_global_status` and
    /// `rbd_mirror_image_global_status_cleanup`.
    pub fn mirror_global_status(&self) -> Result<MirrorGlobalStatus> {
        let mut raw = sys::rbd_mirror_image_global_status_t::default();
        // SAFETY: the image is open; `raw` is a struct of the size passed.
        let ret = unsafe {
            sys::rbd_mirror_image_get_global_status(
                self.raw(),
                &mut raw,
                size_of::<sys::rbd_mirror_image_global_status_t>(),
            )
        };
        cvt(ret, "rbd_mirror_image_get_global_status", || {
            self.mirror_obj()
        })?;
        let sites = if raw.site_statuses.is_null() {
            Vec::new()
        } else {
            // SAFETY: librbd filled `site_statuses_count` entries there.
            unsafe {
                std::slice::from_raw_parts(raw.site_statuses, raw.site_statuses_count as usize)
            }
            .iter()
            .map(|s| MirrorSiteStatus {
                // SAFETY: librbd filled these strings (or left them null).
                mirror_uuid: unsafe { from_cstr(s.mirror_uuid) },
                state: MirrorStatusState::from_raw(s.state),
                // SAFETY: as above.
                description: unsafe { from_cstr(s.description) },
                last_update: time_of(s.last_update),
                up: s.up,
            })
            .collect()
        };
        let out = MirrorGlobalStatus {
            // SAFETY: as above.
            name: unsafe { from_cstr(raw.name) },
            info: MirrorImageInfo::from_raw(&raw.info),
            sites,
        };
        // SAFETY: librbd filled `raw`; everything it allocated is freed
        // once, here.
        unsafe { sys::rbd_mirror_image_global_status_cleanup(&mut raw) };
        Ok(out)
    }

    /// The instance id (the `client.<id>` a watcher is listed by) of this
    /// site's rbd-mirror daemon that reports on the image. Wraps
    /// `rbd_mirror_image_get_instance_id`.
    pub fn mirror_instance_id(&self) -> Result<u64> {
        let buf = sized_buffer(
            32,
            "rbd_mirror_image_get_instance_id",
            &|| self.mirror_obj(),
            |p, len| {
                // SAFETY: `p` is writable for `*len` bytes; on -ERANGE librbd
                // sets `*len` to the size it needs.
                unsafe { sys::rbd_mirror_image_get_instance_id(self.raw(), p, len) }
            },
        )?;
        let text = string_from_buf(&buf);
        text.parse().map_err(|_| {
            Error::with_kind(
                ErrorKind::Other(libc::EBADMSG),
                libc::EBADMSG,
                "rbd_mirror_image_get_instance_id",
                self.mirror_obj(),
                format!("instance id {text:?} is not a number"),
            )
        })
    }

    /// What the mirror snapshot with id `snap_id` is. Wraps
    /// `rbd_snap_get_mirror_namespace` and `rbd_snap_mirror_namespace_cleanup`.
    pub fn snap_mirror_namespace(&self, snap_id: u64) -> Result<MirrorSnapNamespace> {
        let size = size_of::<sys::rbd_snap_mirror_namespace_t>();
        let mut raw = sys::rbd_snap_mirror_namespace_t::default();
        // SAFETY: the image is open; `raw` is a struct of the size passed.
        let ret =
            unsafe { sys::rbd_snap_get_mirror_namespace(self.raw(), snap_id, &mut raw, size) };
        cvt(ret, "rbd_snap_get_mirror_namespace", || {
            format!("{}@{{id {snap_id}}}", self.spec())
        })?;
        let mut peers = Vec::new();
        if !raw.mirror_peer_uuids.is_null() {
            // The uuids are packed: NUL-terminated strings one after another.
            let mut p = raw.mirror_peer_uuids as *const std::os::raw::c_char;
            for _ in 0..raw.mirror_peer_uuids_count {
                // SAFETY: librbd packed `mirror_peer_uuids_count` strings there.
                let s = unsafe { std::ffi::CStr::from_ptr(p) };
                peers.push(s.to_string_lossy().into_owned());
                // SAFETY: the next string starts right after this one's NUL.
                p = unsafe { p.add(s.to_bytes().len() + 1) };
            }
        }
        let out = MirrorSnapNamespace {
            state: match raw.state {
                sys::RBD_SNAP_MIRROR_STATE_PRIMARY => MirrorSnapState::Primary,
                sys::RBD_SNAP_MIRROR_STATE_PRIMARY_DEMOTED => MirrorSnapState::PrimaryDemoted,
                sys::RBD_SNAP_MIRROR_STATE_NON_PRIMARY => MirrorSnapState::NonPrimary,
                _ => MirrorSnapState::NonPrimaryDemoted,
            },
            mirror_peer_uuids: peers,
            complete: raw.complete,
            // SAFETY: librbd filled the string (or left it null).
            primary_mirror_uuid: unsafe { from_cstr(raw.primary_mirror_uuid) },
            primary_snap_id: raw.primary_snap_id,
            last_copied_object_number: raw.last_copied_object_number,
        };
        // SAFETY: librbd filled `raw`; what it allocated is freed once, here.
        unsafe { sys::rbd_snap_mirror_namespace_cleanup(&mut raw, size) };
        Ok(out)
    }

    /// [`Image::mirror_promote`] that stops waiting after `timeout`. The
    /// image moves to a thread of its own for the call and comes back on
    /// success. If the call has not returned by then, the error is
    /// [`ErrorKind::TimedOut`] and the thread keeps the image (and so its
    /// connection) until librbd returns; until then a new promote or demote
    /// of the same image fails at once with [`ErrorKind::Busy`] rather than
    /// queue behind it. Wraps `rbd_mirror_image_promote`.
    pub fn mirror_promote_within(self, force: bool, timeout: Duration) -> Result<Image> {
        let op = "rbd_mirror_image_promote";
        self.within(op, timeout, move |img| img.mirror_promote(force))
    }

    /// [`Image::mirror_demote`] that stops waiting after `timeout`, as
    /// [`Image::mirror_promote_within`] does. Wraps `rbd_mirror_image_demote`.
    pub fn mirror_demote_within(self, timeout: Duration) -> Result<Image> {
        self.within("rbd_mirror_image_demote", timeout, |img| {
            img.mirror_demote()
        })
    }

    fn within(
        self,
        op: &'static str,
        timeout: Duration,
        f: impl FnOnce(&Image) -> Result<()> + Send + 'static,
    ) -> Result<Image> {
        let spec = self.spec();
        let key = format!("{}:{}", self.ioctx().cluster().fsid()?, spec);
        {
            let mut g = in_flight();
            let set = g.get_or_insert_with(HashSet::new);
            if !set.insert(key.clone()) {
                return Err(Error::with_kind(
                    ErrorKind::Busy,
                    libc::EBUSY,
                    op,
                    spec,
                    "an earlier promote or demote of this image is still waiting in librbd (it outlived its timeout); try again later",
                ));
            }
        }
        /// Takes the image's entry out of [`IN_FLIGHT`] when the call is
        /// over, however it ends.
        struct Done(String);
        impl Drop for Done {
            fn drop(&mut self) {
                if let Some(set) = in_flight().as_mut() {
                    set.remove(&self.0);
                }
            }
        }
        let done = Done(key);
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("rbdkit-mirror".into())
            .spawn(move || {
                let _done = done;
                let r = f(&self);
                // A caller that gave up has dropped the receiver: the image
                // is closed here then.
                let _ = tx.send((r, self));
            });
        if let Err(e) = spawned {
            // The closure (and `done` with it) was dropped: the entry is out.
            return Err(
                Error::from_errno(e.raw_os_error().unwrap_or(libc::EAGAIN), op, spec)
                    .detail("cannot start a thread for the call"),
            );
        }
        let started = Instant::now();
        match rx.recv_timeout(timeout) {
            Ok((Ok(()), image)) => Ok(image),
            Ok((Err(e), _)) => Err(e),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(Error::from_errno(
                libc::EIO,
                op,
                spec,
            )
            .detail("the call's thread ended without an answer (it panicked)")),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(Error::with_kind(
                ErrorKind::TimedOut,
                libc::ETIMEDOUT,
                op,
                spec,
                format!(
                    "no answer in {:.0?}: librbd is still waiting (for the image's exclusive lock, which a stuck rbd-mirror daemon may hold); it was left to finish on its own",
                    started.elapsed()
                ),
            )),
        }
    }
}

/// Where a mirror snapshot schedule applies: the whole cluster, a pool, a
/// namespace or one image (the `rbd_support` module's level spec).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScheduleLevel {
    /// The pool (none: every pool).
    pub pool: Option<String>,
    /// The RBD namespace in the pool (none: the whole pool).
    pub namespace: Option<String>,
    /// The image (by name) in that namespace.
    pub image: Option<String>,
}

impl ScheduleLevel {
    /// Every pool.
    pub fn global() -> ScheduleLevel {
        ScheduleLevel::default()
    }

    /// One pool.
    pub fn pool(pool: &str) -> ScheduleLevel {
        ScheduleLevel {
            pool: Some(pool.into()),
            ..Default::default()
        }
    }

    /// One image: `namespace` empty for the default one.
    pub fn image(pool: &str, namespace: &str, image: &str) -> ScheduleLevel {
        ScheduleLevel {
            pool: Some(pool.into()),
            namespace: Some(namespace.into()),
            image: Some(image.into()),
        }
    }

    /// The level spec the module takes: `""`, `pool/`, `pool/ns/`,
    /// `pool/ns/image` (`pool//image` in the default namespace).
    pub fn spec(&self) -> String {
        match (&self.pool, &self.namespace, &self.image) {
            (None, _, _) => String::new(),
            (Some(p), None, None) => format!("{p}/"),
            (Some(p), Some(n), None) => format!("{p}/{n}/"),
            (Some(p), n, Some(i)) => format!("{p}/{}/{i}", n.as_deref().unwrap_or("")),
        }
    }

    fn check(&self, op: &'static str) -> Result<()> {
        let parts = [&self.pool, &self.namespace, &self.image];
        for p in parts.into_iter().flatten() {
            if p.contains('/') || p.contains('"') || p.contains('\\') || p.contains('\0') {
                return Err(Error::invalid(
                    op,
                    self.spec(),
                    format!("{p:?} cannot be part of a schedule level (it holds '/', '\"', '\\' or NUL)"),
                ));
            }
        }
        if self.pool.as_deref() == Some("") || self.image.as_deref() == Some("") {
            return Err(Error::invalid(op, self.spec(), "empty pool or image name"));
        }
        Ok(())
    }
}

/// Checks a schedule interval: a number of minutes, or of `m`inutes,
/// `h`ours or `d`ays (`5m`, `1h`, `2d`), at least one minute.
pub fn check_schedule_interval(interval: &str) -> std::result::Result<(), String> {
    let digits = interval.trim_end_matches(['m', 'h', 'd']);
    let suffix = &interval[digits.len()..];
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || suffix.len() > 1 {
        return Err(format!(
            "interval {interval:?} is not a number of minutes, hours or days such as 5m, 1h or 1d"
        ));
    }
    if digits.trim_start_matches('0').is_empty() {
        return Err(format!("interval {interval:?} is zero"));
    }
    Ok(())
}

/// Checks a schedule start time: `HH:MM`, optionally with seconds and a
/// UTC offset (`14:00`, `14:00:00-05:00`, `02:30Z`).
pub fn check_schedule_start_time(start: &str) -> std::result::Result<(), String> {
    let bad =
        || format!("start time {start:?} is not a time of day such as 14:00 or 14:00:00-05:00");
    let (clock, zone) = match start.find(['+', '-', 'Z']) {
        Some(at) => start.split_at(at),
        None => (start, ""),
    };
    let fields: Vec<&str> = clock.split(':').collect();
    if !(2..=3).contains(&fields.len())
        || fields
            .iter()
            .any(|f| f.len() != 2 || !f.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(bad());
    }
    let n = |i: usize| fields[i].parse::<u32>().unwrap_or(99);
    if n(0) > 23 || n(1) > 59 || (fields.len() == 3 && n(2) > 59) {
        return Err(bad());
    }
    if !zone.is_empty() && zone != "Z" {
        let z = &zone[1..];
        let ok = match z.len() {
            2 => z.bytes().all(|b| b.is_ascii_digit()),
            5 => {
                z.as_bytes()[2] == b':'
                    && z[..2]
                        .bytes()
                        .chain(z[3..].bytes())
                        .all(|b| b.is_ascii_digit())
            }
            4 => z.bytes().all(|b| b.is_ascii_digit()),
            _ => false,
        };
        if !ok {
            return Err(bad());
        }
    }
    Ok(())
}

/// One schedule: every `interval`, aligned to `start_time` if set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorSnapshotSchedule {
    /// The level it applies to, as the module names it (`rbd/img`).
    pub level: String,
    /// `5m`, `1h`, `1d`.
    pub interval: String,
    /// The start time, if one was given (`14:00:00+00:00`).
    pub start_time: Option<String>,
}

/// An image the module will snapshot next, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledImage {
    /// The image (`pool/image` or `pool/ns/image`).
    pub image: String,
    /// When, in the manager's time (`2026-12-04 23:10:00`).
    pub schedule_time: String,
}

/// How long a schedule command retries while the `rbd_support` module is
/// not ready (right after a manager start it answers `EAGAIN`).
const SCHEDULE_RETRY: Duration = Duration::from_secs(20);

fn schedule_command(
    cluster: &Cluster,
    op: &'static str,
    level: &ScheduleLevel,
    fields: &[(&str, &str)],
) -> Result<Vec<u8>> {
    level.check(op)?;
    let mut cmd = format!(
        "{{\"prefix\": \"rbd mirror snapshot schedule {}\", \"level_spec\": \"{}\", \"format\": \"json\"",
        op.rsplit('_').next().unwrap_or(op),
        level.spec()
    );
    for (k, v) in fields {
        if v.contains('"') || v.contains('\\') {
            return Err(Error::invalid(
                op,
                level.spec(),
                format!("{k} {v:?} holds '\"' or '\\'"),
            ));
        }
        cmd.push_str(&format!(", \"{k}\": \"{v}\""));
    }
    cmd.push('}');
    let deadline = Instant::now() + SCHEDULE_RETRY;
    loop {
        match cluster.mgr_command(&cmd, &[]) {
            Ok(r) => return Ok(r.output),
            Err(e) if e.errno() == libc::EAGAIN && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => {
                return Err(Error::with_kind(
                    e.kind(),
                    e.errno(),
                    op,
                    format!("schedule level {:?}", level.spec()),
                    e.to_string(),
                ))
            }
        }
    }
}

/// Adds a mirror snapshot schedule through the manager's `rbd_support`
/// module: every primary image in snapshot mode at that level gets a
/// mirror snapshot every `interval` (`5m`, `1h`, `1d`), aligned to
/// `start_time` (`14:00`, `14:00:00-05:00`) if given. Adding a schedule
/// that exists is not an error. An image level needs the image in snapshot
/// mirror mode. Needs the mgr cap `profile rbd` (or `allow rw`). Bounded by
/// the mon-op timeout per attempt; retried for up to 20 s while the module
/// is starting. Wraps `rados_mgr_command`
/// (`rbd mirror snapshot schedule add`).
pub fn mirror_snapshot_schedule_add(
    cluster: &Cluster,
    level: &ScheduleLevel,
    interval: &str,
    start_time: Option<&str>,
) -> Result<()> {
    let op = "mirror_snapshot_schedule_add";
    check_schedule_interval(interval).map_err(|why| Error::invalid(op, level.spec(), why))?;
    let mut fields = vec![("interval", interval)];
    if let Some(s) = start_time {
        check_schedule_start_time(s).map_err(|why| Error::invalid(op, level.spec(), why))?;
        fields.push(("start_time", s));
    }
    schedule_command(cluster, op, level, &fields)?;
    Ok(())
}

/// Removes a mirror snapshot schedule (`interval` none: every schedule at
/// that level). Removing one that does not exist is not an error. Wraps
/// `rados_mgr_command` (`rbd mirror snapshot schedule remove`).
pub fn mirror_snapshot_schedule_remove(
    cluster: &Cluster,
    level: &ScheduleLevel,
    interval: Option<&str>,
    start_time: Option<&str>,
) -> Result<()> {
    let op = "mirror_snapshot_schedule_remove";
    let mut fields = Vec::new();
    if let Some(i) = interval {
        check_schedule_interval(i).map_err(|why| Error::invalid(op, level.spec(), why))?;
        fields.push(("interval", i));
    }
    if let Some(s) = start_time {
        check_schedule_start_time(s).map_err(|why| Error::invalid(op, level.spec(), why))?;
        fields.push(("start_time", s));
    }
    schedule_command(cluster, op, level, &fields)?;
    Ok(())
}

fn bad_reply(op: &'static str, level: &ScheduleLevel, why: String) -> Error {
    Error::with_kind(
        ErrorKind::Other(libc::EBADMSG),
        libc::EBADMSG,
        op,
        format!("schedule level {:?}", level.spec()),
        format!("unexpected reply from the rbd_support module: {why}"),
    )
}

/// The schedules at `level` and below. Wraps `rados_mgr_command`
/// (`rbd mirror snapshot schedule list`).
pub fn mirror_snapshot_schedule_list(
    cluster: &Cluster,
    level: &ScheduleLevel,
) -> Result<Vec<MirrorSnapshotSchedule>> {
    let op = "mirror_snapshot_schedule_list";
    let out = schedule_command(cluster, op, level, &[])?;
    parse_schedule_list(&String::from_utf8_lossy(&out)).map_err(|why| bad_reply(op, level, why))
}

/// The images at `level` the module will snapshot next. Wraps
/// `rados_mgr_command` (`rbd mirror snapshot schedule status`).
pub fn mirror_snapshot_schedule_status(
    cluster: &Cluster,
    level: &ScheduleLevel,
) -> Result<Vec<ScheduledImage>> {
    let op = "mirror_snapshot_schedule_status";
    let out = schedule_command(cluster, op, level, &[])?;
    parse_schedule_status(&String::from_utf8_lossy(&out)).map_err(|why| bad_reply(op, level, why))
}

/// `{"<level id>": {"name": "rbd/img", "schedule": [{"interval": "5m",
/// "start_time": null}]}}` (an empty reply is no schedule).
fn parse_schedule_list(text: &str) -> std::result::Result<Vec<MirrorSnapshotSchedule>, String> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let v = Json::parse(text)?;
    let levels = v.as_object().ok_or("not an object")?;
    let mut out = Vec::new();
    for (_, level) in levels {
        let name = level
            .get("name")
            .and_then(Json::as_str)
            .ok_or("a level without a name")?;
        for item in level
            .get("schedule")
            .and_then(Json::as_array)
            .ok_or("a level without a schedule")?
        {
            out.push(MirrorSnapshotSchedule {
                level: name.to_owned(),
                interval: item
                    .get("interval")
                    .and_then(Json::as_str)
                    .ok_or("a schedule without an interval")?
                    .to_owned(),
                start_time: item
                    .get("start_time")
                    .and_then(Json::as_str)
                    .map(str::to_owned),
            });
        }
    }
    Ok(out)
}

/// `{"scheduled_images": [{"schedule_time": "...", "image": "rbd/img"}]}`.
fn parse_schedule_status(text: &str) -> std::result::Result<Vec<ScheduledImage>, String> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let v = Json::parse(text)?;
    let list = v
        .get("scheduled_images")
        .and_then(Json::as_array)
        .ok_or("no scheduled_images")?;
    list.iter()
        .map(|i| {
            Ok(ScheduledImage {
                image: i
                    .get("image")
                    .and_then(Json::as_str)
                    .ok_or("an entry without an image")?
                    .to_owned(),
                schedule_time: i
                    .get("schedule_time")
                    .and_then(Json::as_str)
                    .ok_or("an entry without a schedule_time")?
                    .to_owned(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_specs_are_the_modules() {
        assert_eq!(ScheduleLevel::global().spec(), "");
        assert_eq!(ScheduleLevel::pool("rbd").spec(), "rbd/");
        assert_eq!(ScheduleLevel::image("rbd", "", "img").spec(), "rbd//img");
        assert_eq!(
            ScheduleLevel::image("rbd", "ns", "img").spec(),
            "rbd/ns/img"
        );
        let bad = ScheduleLevel::image("rbd", "", "a\"b");
        assert_eq!(
            bad.check("x").unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn intervals_and_start_times_are_checked() {
        for ok in ["1", "5m", "1h", "2d", "90m"] {
            check_schedule_interval(ok).unwrap();
        }
        for bad in ["", "m", "0m", "5s", "1.5h", "5mm", "-1m", "1 h"] {
            let e = check_schedule_interval(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
        for ok in [
            "14:00",
            "14:00:00",
            "14:00:00-05:00",
            "02:30Z",
            "23:59+0100",
        ] {
            check_schedule_start_time(ok).unwrap();
        }
        for bad in [
            "",
            "24:00",
            "1400",
            "14:60",
            "noon",
            "14:00:00-5",
            "14:00 UTC",
        ] {
            assert!(check_schedule_start_time(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn replay_figures_come_from_the_description() {
        let d = r#"replaying, {"bytes_per_second":0.0,"bytes_per_snapshot":81920.0,"last_snapshot_bytes":81920,"last_snapshot_sync_seconds":2,"local_snapshot_timestamp":1684675261,"remote_snapshot_timestamp":1684675261,"replay_state":"idle"}"#;
        let r = SnapshotReplay::parse(d).unwrap();
        assert_eq!(r.last_snapshot_bytes, Some(81920));
        assert_eq!(r.last_snapshot_sync, Some(Duration::from_secs(2)));
        assert_eq!(
            r.local_snapshot_timestamp,
            Some(UNIX_EPOCH + Duration::from_secs(1684675261))
        );
        assert!(r.in_sync());
        let behind = d.replace(
            "\"remote_snapshot_timestamp\":1684675261",
            "\"remote_snapshot_timestamp\":1684675300",
        );
        assert!(!SnapshotReplay::parse(&behind).unwrap().in_sync());
        assert_eq!(SnapshotReplay::parse("local image is primary"), None);
    }

    #[test]
    fn schedule_replies_are_read() {
        let list = r#"{
            "2//10ab": {"name": "rbd/img", "schedule": [{"interval": "5m", "start_time": null},
                                                        {"interval": "1h", "start_time": "14:00:00"}]}
        }"#;
        let s = parse_schedule_list(list).unwrap();
        assert_eq!(s.len(), 2);
        assert!(s.contains(&MirrorSnapshotSchedule {
            level: "rbd/img".into(),
            interval: "1h".into(),
            start_time: Some("14:00:00".into())
        }));
        assert!(parse_schedule_list("{}").unwrap().is_empty());
        assert!(parse_schedule_list("[]").is_err());
        let status = r#"{"scheduled_images": [{"image": "rbd/img", "schedule_time": "2026-12-04 23:10:00"}]}"#;
        assert_eq!(
            parse_schedule_status(status).unwrap(),
            vec![ScheduledImage {
                image: "rbd/img".into(),
                schedule_time: "2026-12-04 23:10:00".into()
            }]
        );
    }
}
