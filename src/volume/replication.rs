//! Volume replication: the Ceph side of csi-addons' VolumeReplication
//! (enable, promote, demote, resync, status), on RBD snapshot-based
//! mirroring ([`crate::rbd::Image::mirror_enable`] and friends).
//!
//! The semantics follow csi-addons' replication service as ceph-csi
//! implements it, so the same VolumeReplication objects (Ramen, ODF) mean
//! the same thing here:
//! - **enable**: mirror the image in the class's mode (snapshot unless
//!   `mirroringMode: journal`); the pool must already be mirrored in image
//!   mode with its peers bootstrapped (a platform step, see the README).
//! - **promote**: make this site's copy primary and add the class's mirror
//!   snapshot schedule. A copy that another site still holds as primary is
//!   refused by name while that site's rbd-mirror daemon is up (demote it
//!   there first); once no peer daemon is up the site is taken for lost and
//!   the copy is force-promoted, bounded (Ceph 16's force promote can hang
//!   on a daemon that never lets the image go).
//! - **demote**: make it non-primary (bounded the same way).
//! - **resync**: flag a non-primary copy for a full copy from the primary
//!   (after a split brain); **ready** once both copies are demoted and both
//!   daemons are up and idle, which is when the other site may be promoted.
//!
//! Every function is blocking, asks the caller's [`Fence`] before each step
//! that changes Ceph, and is idempotent: a step already done is skipped.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use crate::rados::Cluster;
use crate::rbd::{
    self, Image, MirrorImageMode, MirrorImageState, MirrorMode, MirrorSiteStatus,
    MirrorSnapNamespace, MirrorSnapState, MirrorStatusState, ScheduleLevel,
};
use crate::volume::ops::VolumeError;
use crate::volume::{Fence, VolumeId};
use crate::ErrorKind;

/// The prefix of the class parameters csi-addons reserves for itself
/// (secrets); they are never driver parameters.
pub const RESERVED_PREFIX: &str = "replication.storage.openshift.io/";
/// Class parameter: `snapshot` (the default) or `journal`.
pub const MIRRORING_MODE: &str = "mirroringMode";
/// Class parameter: how often the primary takes a mirror snapshot (`5m`,
/// `1h`, `1d`).
pub const SCHEDULING_INTERVAL: &str = "schedulingInterval";
/// Class parameter: what the schedule is aligned to (`14:00:00-05:00`).
pub const SCHEDULING_START_TIME: &str = "schedulingStartTime";
/// Class parameter: `never` (the only value): a clone's parent is not
/// flattened for it.
pub const FLATTEN_MODE: &str = "flattenMode";
/// Class parameter: `true` lets disabling give up a non-primary copy that
/// is not replaying.
pub const FORCE: &str = "force";

/// The validated parameters of a VolumeReplicationClass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationParams {
    /// How images are mirrored.
    pub mode: MirrorImageMode,
    /// The mirror snapshot interval, if the class sets one.
    pub interval: Option<String>,
    /// What that schedule is aligned to.
    pub start_time: Option<String>,
    /// Whether disabling may give up a non-primary copy.
    pub force_disable: bool,
}

impl ReplicationParams {
    /// Validates a class's parameters; keys with [`RESERVED_PREFIX`] are
    /// csi-addons' and skipped. Anything unknown or malformed is refused by
    /// name.
    pub fn parse(params: &BTreeMap<String, String>) -> Result<ReplicationParams, String> {
        let mut out = ReplicationParams {
            mode: MirrorImageMode::Snapshot,
            interval: None,
            start_time: None,
            force_disable: false,
        };
        for (k, v) in params {
            if k.starts_with(RESERVED_PREFIX) {
                continue;
            }
            match k.as_str() {
                MIRRORING_MODE => {
                    out.mode = match v.as_str() {
                        "snapshot" | "" => MirrorImageMode::Snapshot,
                        "journal" => MirrorImageMode::Journal,
                        _ => {
                            return Err(format!(
                                "parameter {MIRRORING_MODE}: {v:?} is neither snapshot nor journal"
                            ))
                        }
                    }
                }
                SCHEDULING_INTERVAL => {
                    // csi-addons' own pattern: a number and m, h or d.
                    if !v.ends_with(['m', 'h', 'd']) {
                        return Err(format!(
                            "parameter {SCHEDULING_INTERVAL}: {v:?} is not a number of minutes, hours or days such as 5m, 1h or 1d"
                        ));
                    }
                    rbd::check_schedule_interval(v)
                        .map_err(|why| format!("parameter {SCHEDULING_INTERVAL}: {why}"))?;
                    out.interval = Some(v.clone());
                }
                SCHEDULING_START_TIME => {
                    rbd::check_schedule_start_time(v)
                        .map_err(|why| format!("parameter {SCHEDULING_START_TIME}: {why}"))?;
                    out.start_time = Some(v.clone());
                }
                FLATTEN_MODE => {
                    if v != "never" {
                        return Err(format!(
                            "parameter {FLATTEN_MODE}: only \"never\" is supported ({v:?} given): flatten a clone before replicating it"
                        ));
                    }
                }
                FORCE => {
                    out.force_disable = match v.as_str() {
                        "true" => true,
                        "false" => false,
                        _ => return Err(format!("parameter {FORCE}: {v:?} is neither true nor false")),
                    }
                }
                _ => {
                    return Err(format!(
                        "unknown parameter {k:?} (known: {MIRRORING_MODE}, {SCHEDULING_INTERVAL}, {SCHEDULING_START_TIME}, {FLATTEN_MODE}, {FORCE}, and {RESERVED_PREFIX}* secrets)"
                    ))
                }
            }
        }
        if out.start_time.is_some() && out.interval.is_none() {
            return Err(format!(
                "parameter {SCHEDULING_START_TIME} needs {SCHEDULING_INTERVAL}"
            ));
        }
        if out.mode == MirrorImageMode::Journal && out.interval.is_some() {
            return Err(format!(
                "parameter {SCHEDULING_INTERVAL} applies to snapshot mirroring only, not to {MIRRORING_MODE} journal"
            ));
        }
        Ok(out)
    }
}

/// Where a volume stands in mirroring, as this site sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicationStatus {
    /// The volume.
    pub volume: String,
    /// Mirroring is enabled for the image.
    pub enabled: bool,
    /// Mirroring is being disabled.
    pub disabling: bool,
    /// This site's copy is the primary.
    pub primary: bool,
    /// This site's daemon's entry.
    pub local: Option<MirrorSiteStatus>,
    /// The peer sites' daemons' entries.
    pub peers: Vec<MirrorSiteStatus>,
    /// The newest mirror snapshot of this site's copy.
    pub newest_snapshot: Option<MirrorSnapNamespace>,
    /// When this copy was promoted after a peer's orderly demotion: the
    /// time of its first primary mirror snapshot after the copy of that
    /// demotion. `None` when its newest non-primary mirror snapshot is not
    /// a demotion (it never took over from a peer, or did so by force).
    pub promoted_after_handover: Option<SystemTime>,
}

/// What a peer daemon writes for a primary copy.
const PRIMARY_DESCRIPTION: &str = "local image is primary";

impl ReplicationStatus {
    /// A peer site whose daemon is up and does not replay this copy, as
    /// `peer <uuid> is <state> (<description>)`; a peer that is down is
    /// not counted.
    pub fn peer_not_replaying(&self) -> Option<String> {
        self.idle_peer(|_| true)
    }

    /// A peer that has not caught up with this copy's promotion yet: this
    /// copy took over from the peer's orderly demotion, and the peer's
    /// daemon, up and not replaying, last reported before that promotion
    /// (it still shows what it wrote while its own copy was primary). A
    /// peer that reported since holds a primary copy of its own (a forced
    /// promotion: a split brain), which it will never replay from this one,
    /// so it is not waited for; neither is a peer that is down.
    pub fn peer_behind_promotion(&self) -> Option<String> {
        let promoted = self.promoted_after_handover?;
        self.idle_peer(|p| p.last_update.is_none_or(|t| t < promoted))
    }

    /// The first peer that is up, not replaying and `also`, for messages.
    fn idle_peer(&self, also: impl Fn(&MirrorSiteStatus) -> bool) -> Option<String> {
        self.peers
            .iter()
            .find(|p| p.up && p.state != MirrorStatusState::Replaying && also(p))
            .map(|p| {
                format!(
                    "peer {} is {} ({})",
                    short(&p.mirror_uuid),
                    p.summary(),
                    p.description
                )
            })
    }

    /// A peer site whose daemon is up holds its copy as primary.
    pub fn primary_elsewhere(&self) -> bool {
        self.peers
            .iter()
            .any(|p| p.up && p.description.starts_with(PRIMARY_DESCRIPTION))
    }

    /// No peer site's daemon is up (or none ever reported): the peers are
    /// taken for lost.
    pub fn peers_down(&self) -> bool {
        !self.peers.iter().any(|p| p.up)
    }

    /// This site's daemon reports a split brain (both copies were primary).
    pub fn split_brain(&self) -> bool {
        self.local
            .as_ref()
            .is_some_and(|l| l.description.contains("split-brain"))
    }

    /// For a demoted copy: every copy is demoted and every daemon is up and
    /// idle, so another site may be promoted without force (csi-addons'
    /// "ready" of a resync). A copy of another site's image must also have
    /// that site's demotion in full: the daemons report idle as soon as they
    /// see it, before it is copied.
    pub fn secondary_ready(&self) -> bool {
        let idle = |s: &MirrorSiteStatus| s.up && s.state == MirrorStatusState::Unknown;
        let copied = match &self.newest_snapshot {
            Some(n)
                if matches!(
                    n.state,
                    MirrorSnapState::NonPrimary | MirrorSnapState::NonPrimaryDemoted
                ) =>
            {
                n.state == MirrorSnapState::NonPrimaryDemoted && n.complete
            }
            _ => true,
        };
        !self.primary
            && copied
            && self.local.as_ref().is_some_and(idle)
            && !self.peers.is_empty()
            && self.peers.iter().all(idle)
    }

    /// For a primary: the newest mirror snapshot a peer has copied in full,
    /// how long that copy took and how many bytes it moved.
    pub fn last_sync(&self) -> Option<LastSync> {
        self.peers
            .iter()
            .filter_map(|p| p.snapshot_replay())
            .filter_map(|r| {
                Some(LastSync {
                    time: r.local_snapshot_timestamp?,
                    duration: r.last_snapshot_sync,
                    bytes: r.last_snapshot_bytes,
                    in_sync: r.in_sync(),
                })
            })
            .max_by_key(|s| s.time)
    }

    /// For a primary: whether every peer is up and replaying, and a line
    /// saying how each peer is.
    pub fn replicating(&self) -> (bool, String) {
        if self.peers.is_empty() {
            return (false, "no peer site has reported on the image yet".into());
        }
        let healthy = self
            .peers
            .iter()
            .all(|p| p.up && p.state == MirrorStatusState::Replaying);
        let line = self
            .peers
            .iter()
            .map(|p| {
                format!(
                    "peer {}: {} {}",
                    short(&p.mirror_uuid),
                    p.summary(),
                    p.description
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        (healthy, line)
    }

    /// This site's entry as the CLI shows it, for messages.
    pub fn local_summary(&self) -> String {
        match &self.local {
            Some(l) => format!("{} ({})", l.summary(), l.description),
            None => "no status from this site's rbd-mirror daemon".into(),
        }
    }
}

fn short(uuid: &str) -> &str {
    uuid.get(..8).unwrap_or(uuid)
}

/// The newest mirror snapshot a peer copied in full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LastSync {
    /// The primary's creation time of that snapshot.
    pub time: SystemTime,
    /// How long copying it took.
    pub duration: Option<Duration>,
    /// How many bytes it moved.
    pub bytes: Option<u64>,
    /// Nothing newer is waiting to be copied.
    pub in_sync: bool,
}

/// How a promotion went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Promoted {
    /// This site's copy is primary now (or already was).
    Primary,
    /// Force-promoted; says why.
    Forced(String),
    /// Not yet: another site's demotion has not been copied here; says
    /// which.
    Waiting(String),
}

/// When a promotion may use force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Force {
    /// Only when no peer site's daemon is up.
    IfPeersDown,
    /// Always when needed (the user asked for it).
    Always,
}

fn open(cluster: &Cluster, vol: &VolumeId) -> Result<Image, VolumeError> {
    let io = cluster.ioctx_ns(&vol.pool, &vol.rados_namespace)?;
    Ok(Image::open(&io, &vol.image)?)
}

/// Reads where `vol` stands.
pub fn status(cluster: &Cluster, vol: &VolumeId) -> Result<ReplicationStatus, VolumeError> {
    let img = open(cluster, vol)?;
    status_of(&img, vol)
}

fn status_of(img: &Image, vol: &VolumeId) -> Result<ReplicationStatus, VolumeError> {
    let info = img.mirror_info()?;
    let enabled = info.state == MirrorImageState::Enabled;
    let (local, peers) = if enabled {
        let g = img.mirror_global_status()?;
        (g.local().cloned(), g.peers().cloned().collect())
    } else {
        (None, Vec::new())
    };
    let mut mirror_snaps = Vec::new();
    if enabled {
        for snap in img.snap_list()? {
            if let Ok(ns) = img.snap_mirror_namespace(snap.id) {
                mirror_snaps.push((snap.id, ns));
            }
        }
    }
    mirror_snaps.sort_by_key(|(id, _)| *id);
    let promoted_after_handover = match handover_promotion(&mirror_snaps) {
        Some(id) => Some(img.snap_timestamp(id)?),
        None => None,
    };
    Ok(ReplicationStatus {
        volume: vol.to_string(),
        enabled,
        disabling: info.state == MirrorImageState::Disabling,
        primary: info.primary,
        local,
        peers,
        newest_snapshot: mirror_snaps.pop().map(|(_, ns)| ns),
        promoted_after_handover,
    })
}

/// The id of the mirror snapshot that promoted this copy after a peer's
/// orderly demotion: the first primary one after the newest non-primary
/// one, when that one is the copy of a demotion. `snaps` are by id.
fn handover_promotion(snaps: &[(u64, MirrorSnapNamespace)]) -> Option<u64> {
    let last_copy = snaps
        .iter()
        .rposition(|(_, ns)| ns.state != MirrorSnapState::Primary)?;
    if snaps[last_copy].1.state != MirrorSnapState::NonPrimaryDemoted {
        return None;
    }
    snaps.get(last_copy + 1).map(|(id, _)| *id)
}

/// Enables mirroring of `vol` in the class's mode. Refused by name when
/// the pool is not mirrored in image mode.
pub fn enable(
    cluster: &Cluster,
    fence: &dyn Fence,
    vol: &VolumeId,
    params: &ReplicationParams,
) -> Result<(), VolumeError> {
    let img = open(cluster, vol)?;
    let info = img.mirror_info()?;
    match info.state {
        MirrorImageState::Enabled => {
            let mode = img.mirror_mode()?;
            if mode != params.mode {
                return Err(VolumeError::Refused {
                    why: format!(
                        "image {vol} is already mirrored in {mode:?} mode, not the class's {:?}",
                        params.mode
                    ),
                });
            }
            return Ok(());
        }
        MirrorImageState::Disabling => {
            return Err(VolumeError::Refused {
                why: format!("mirroring of image {vol} is being disabled; try again once it is"),
            })
        }
        MirrorImageState::Disabled => {}
    }
    let pool_mode = rbd::mirror_mode_get(img.ioctx())?;
    if pool_mode != MirrorMode::Image
        && !(pool_mode == MirrorMode::Pool && params.mode == MirrorImageMode::Journal)
    {
        return Err(VolumeError::Refused {
            why: format!(
                "pool {} is in mirror mode {pool_mode:?}, not image: enable it (rbd mirror pool enable {} image) and bootstrap its peer sites first",
                img.ioctx().spec(),
                img.ioctx().spec()
            ),
        });
    }
    if let Some(parent) = img.parent()? {
        let p = parent.image;
        let pio = cluster.ioctx_ns(&p.pool_name, &p.namespace)?;
        let mirrored = Image::open_read_only(&pio, &p.image_name)
            .and_then(|i| i.mirror_info())
            .map(|i| i.state == MirrorImageState::Enabled)
            .unwrap_or(false);
        if !mirrored {
            return Err(VolumeError::Refused {
                why: format!(
                    "image {vol} is a clone of {}, which is not mirrored: flatten the volume first",
                    pio.object_spec(&p.image_name)
                ),
            });
        }
    }
    fence.check("rbd_mirror_image_enable2", &img.spec())?;
    img.mirror_enable(params.mode)?;
    Ok(())
}

/// Promotes `vol` here (see the module doc), then adds the class's
/// schedule. `timeout` bounds the promotion itself.
pub fn promote(
    cluster: &Cluster,
    fence: &dyn Fence,
    vol: &VolumeId,
    params: &ReplicationParams,
    force: Force,
    timeout: Duration,
) -> Result<Promoted, VolumeError> {
    let img = open(cluster, vol)?;
    let st = status_of(&img, vol)?;
    if !st.enabled {
        return Err(VolumeError::Refused {
            why: format!("image {vol} is not mirrored; enable replication first"),
        });
    }
    let mut outcome = Promoted::Primary;
    let img = if st.primary {
        img
    } else {
        fence.check("rbd_mirror_image_promote", &img.spec())?;
        match img.mirror_promote_within(false, timeout) {
            Ok(img) => img,
            Err(e) if e.kind() == ErrorKind::ReadOnly => {
                return Ok(Promoted::Waiting(format!(
                    "image {vol} is still held by this site's rbd-mirror daemon ({})",
                    st.local_summary()
                )))
            }
            Err(e) if e.kind() == ErrorKind::Busy => {
                // Primary elsewhere, or a demotion not copied here yet.
                let st = status(cluster, vol)?;
                let forced = if force == Force::Always {
                    "force was asked for".to_owned()
                } else if st.peers_down() {
                    format!(
                        "no peer site's rbd-mirror daemon is up (this site: {})",
                        st.local_summary()
                    )
                } else if st.primary_elsewhere() {
                    return Err(VolumeError::Refused {
                        why: format!(
                            "image {vol} is primary at a peer site whose rbd-mirror daemon is up ({}); demote it there first (its VolumeReplication to secondary), or annotate this VolumeReplication rbdkit.io/force-promote=true to promote anyway (a split brain until that copy is resynced)",
                            st.replicating().1
                        ),
                    });
                } else {
                    return Ok(Promoted::Waiting(format!(
                        "image {vol} waits for the other site's demotion to be copied here ({})",
                        st.local_summary()
                    )));
                };
                fence.check("rbd_mirror_image_promote", &vol.to_string())?;
                let img = open(cluster, vol)?;
                let img = match img.mirror_promote_within(true, timeout) {
                    Ok(img) => img,
                    Err(e) if e.kind() == ErrorKind::ReadOnly => {
                        return Ok(Promoted::Waiting(format!(
                            "image {vol} is still held by this site's rbd-mirror daemon ({})",
                            st.local_summary()
                        )))
                    }
                    Err(e) => return Err(e.into()),
                };
                outcome = Promoted::Forced(forced);
                img
            }
            Err(e) => return Err(e.into()),
        }
    };
    if let Some(interval) = &params.interval {
        let level = ScheduleLevel::image(&vol.pool, &vol.rados_namespace, &vol.image);
        fence.check("rados_mgr_command", &img.spec())?;
        rbd::mirror_snapshot_schedule_add(cluster, &level, interval, params.start_time.as_deref())?;
    }
    Ok(outcome)
}

/// The clients that have the primary `img` open other than the peer
/// sites' rbd-mirror daemons (one per peer that is up) and this site's:
/// the mappers of nodes that stage it.
fn users(img: &Image, st: &ReplicationStatus) -> Result<usize, VolumeError> {
    let local = img.mirror_instance_id().ok();
    let watchers = img
        .watchers()?
        .into_iter()
        .filter(|w| Some(w.id as u64) != local)
        .count();
    Ok(watchers.saturating_sub(st.peers.iter().filter(|p| p.up).count()))
}

/// Demotes `vol` here; a copy that is not primary is left as it is. A
/// primary still staged on a node is not demoted (`InUse`; retry): writes
/// after the demotion would fail, and the copy the peer gets would miss
/// what the filesystem flushes at unmount. Nor is one that took over from
/// a peer whose daemon, up, has not replayed it since (`Refused`; retry):
/// that peer would never copy it.
pub fn demote(
    cluster: &Cluster,
    fence: &dyn Fence,
    vol: &VolumeId,
    timeout: Duration,
) -> Result<(), VolumeError> {
    let io = cluster.ioctx_ns(&vol.pool, &vol.rados_namespace)?;
    let ro = Image::open_read_only(&io, &vol.image)?;
    let st = status_of(&ro, vol)?;
    if !st.enabled {
        return Err(VolumeError::Refused {
            why: format!("image {vol} is not mirrored; enable replication first"),
        });
    }
    if !st.primary {
        return Ok(());
    }
    let n = users(&ro, &st)?;
    if n > 0 {
        return Err(VolumeError::InUse {
            image: vol.to_string(),
            watchers: n,
        });
    }
    // A peer whose daemon has not started replaying this primary since it
    // handed over (it still reports its old state, e.g. `up+stopped, local
    // image is primary`) would never copy it once it is demoted too: both
    // copies demoted, its daemon stops, and a failback to it would lose
    // this site's writes since the promotion (mirror_dr caught it). A peer
    // that is primary itself (after a site loss) is not waited for.
    if let Some(p) = st.peer_behind_promotion() {
        return Err(VolumeError::Refused {
            why: format!(
                "image {vol} is not demoted yet: {p}, last reported before this copy's promotion, and would not copy this site's last writes once both copies are demoted; retrying until it replays"
            ),
        });
    }
    drop(ro);
    let img = open(cluster, vol)?;
    fence.check("rbd_mirror_image_demote", &img.spec())?;
    img.mirror_demote_within(timeout)?;
    Ok(())
}

/// Flags the non-primary copy of `vol` for a full resync, unless the image
/// is no longer the one with id `unless_id` (the resync asked for earlier
/// has re-created it). Returns the id of the image flagged (or found).
pub fn resync(
    cluster: &Cluster,
    fence: &dyn Fence,
    vol: &VolumeId,
    unless_replaced: Option<&str>,
) -> Result<String, VolumeError> {
    let img = open(cluster, vol)?;
    let info = img.mirror_info()?;
    if info.state != MirrorImageState::Enabled {
        return Err(VolumeError::Refused {
            why: format!("image {vol} is not mirrored; enable replication first"),
        });
    }
    if info.primary {
        return Err(VolumeError::Refused {
            why: format!(
                "image {vol} is primary here: a resync replaces this copy with the peer's; demote it first (replicationState secondary)"
            ),
        });
    }
    let id = img.id()?;
    if let Some(old) = unless_replaced {
        if old != id {
            // Already re-created by the daemon since the resync was asked.
            return Ok(id);
        }
    }
    fence.check("rbd_mirror_image_resync", &img.spec())?;
    img.mirror_resync()?;
    Ok(id)
}

/// Disables mirroring of `vol` (the VolumeReplication went away). On the
/// primary the peers then delete their copies. A non-primary copy that is
/// replaying is left alone (its primary's disable removes it); one that is
/// not is given up only with the class's `force`.
pub fn disable(
    cluster: &Cluster,
    fence: &dyn Fence,
    vol: &VolumeId,
    params: &ReplicationParams,
) -> Result<(), VolumeError> {
    let img = match open(cluster, vol) {
        Ok(i) => i,
        Err(VolumeError::Ceph(e)) if e.is_not_found() => return Ok(()),
        Err(e) => return Err(e),
    };
    let st = status_of(&img, vol)?;
    if !st.enabled {
        return Ok(());
    }
    let level = ScheduleLevel::image(&vol.pool, &vol.rados_namespace, &vol.image);
    if st.primary {
        // A peer that does not replay yet (right after a failback its copy
        // still holds its own demotion) would keep its copy: its daemon
        // deletes only a copy linked to this primary. A peer that is down
        // is not waited for.
        if let Some(p) = st.peer_not_replaying() {
            return Err(VolumeError::Refused {
                why: format!(
                    "mirroring of image {vol} is not disabled yet: {p}, and would keep its copy; retrying until it replays"
                ),
            });
        }
        fence.check("rados_mgr_command", &img.spec())?;
        if let Err(e) = rbd::mirror_snapshot_schedule_remove(cluster, &level, None, None) {
            // The schedule of an image that is gone is dropped by the
            // module itself; nothing else depends on this.
            if e.kind() != ErrorKind::NotFound && e.kind() != ErrorKind::InvalidArgument {
                return Err(e.into());
            }
        }
        fence.check("rbd_mirror_image_disable", &img.spec())?;
        img.mirror_disable(false)?;
        return Ok(());
    }
    let replaying = st
        .local
        .as_ref()
        .is_some_and(|l| l.up && l.state == MirrorStatusState::Replaying);
    if replaying {
        return Ok(());
    }
    if !params.force_disable {
        return Err(VolumeError::Refused {
            why: format!(
                "image {vol} is a non-primary copy that is not replaying ({}); disable mirroring at the primary's site, or set the class parameter {FORCE}: \"true\" to give this copy up",
                st.local_summary()
            ),
        });
    }
    fence.check("rbd_mirror_image_disable", &img.spec())?;
    img.mirror_disable(true)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> Result<ReplicationParams, String> {
        ReplicationParams::parse(
            &pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn class_parameters_are_checked_by_name() {
        let p = params(&[
            ("mirroringMode", "snapshot"),
            ("schedulingInterval", "5m"),
            ("schedulingStartTime", "14:00:00-05:00"),
            (
                "replication.storage.openshift.io/replication-secret-name",
                "s",
            ),
        ])
        .unwrap();
        assert_eq!(p.mode, MirrorImageMode::Snapshot);
        assert_eq!(p.interval.as_deref(), Some("5m"));
        assert_eq!(params(&[]).unwrap().mode, MirrorImageMode::Snapshot);
        for (pairs, word) in [
            (vec![("mirroringMode", "async")], "mirroringMode"),
            (vec![("schedulingInterval", "5")], "schedulingInterval"),
            (vec![("schedulingInterval", "0m")], "schedulingInterval"),
            (
                vec![("schedulingStartTime", "14:00")],
                "needs schedulingInterval",
            ),
            (vec![("flattenMode", "force")], "flattenMode"),
            (vec![("force", "yes")], "force"),
            (
                vec![("replicationMode", "snapshot")],
                "unknown parameter \"replicationMode\"",
            ),
            (
                vec![("mirroringMode", "journal"), ("schedulingInterval", "5m")],
                "snapshot mirroring only",
            ),
        ] {
            let e = params(&pairs).unwrap_err();
            assert!(e.contains(word), "{pairs:?}: {e}");
        }
    }

    fn site(uuid: &str, up: bool, state: MirrorStatusState, d: &str) -> MirrorSiteStatus {
        MirrorSiteStatus {
            mirror_uuid: uuid.into(),
            state,
            description: d.into(),
            last_update: None,
            up,
        }
    }

    /// An enabled image's status with these entries and no mirror snapshot.
    fn status(primary: bool, local: MirrorSiteStatus, peer: MirrorSiteStatus) -> ReplicationStatus {
        ReplicationStatus {
            volume: "c:rbd/img".into(),
            enabled: true,
            disabling: false,
            primary,
            local: Some(local),
            peers: vec![peer],
            newest_snapshot: None,
            promoted_after_handover: None,
        }
    }

    #[test]
    fn a_peer_that_does_not_replay_yet_is_named() {
        use MirrorStatusState::*;
        let mut st = status(
            true,
            site("", true, Stopped, "local image is primary"),
            site("abcdef0123", true, Stopped, "local image is primary"),
        );
        let p = st.peer_not_replaying().expect("a stale peer");
        assert!(
            p.contains("up+stopped") && p.contains("local image is primary"),
            "{p}"
        );
        st.peers[0].state = Replaying;
        assert_eq!(st.peer_not_replaying(), None);
        st.peers[0].state = Unknown;
        st.peers[0].up = false;
        assert_eq!(
            st.peer_not_replaying(),
            None,
            "a peer that is down is not waited for"
        );
    }

    #[test]
    fn only_a_peer_behind_a_handover_is_waited_for() {
        use MirrorStatusState::*;
        let t = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let mut peer = site("abcdef0123", true, Stopped, "local image is primary");
        peer.last_update = Some(t(100));
        let mut st = status(
            true,
            site("", true, Stopped, "local image is primary"),
            peer,
        );
        // Never took over from a peer (or by force): a primary peer is a
        // split brain, never waited for.
        assert_eq!(st.peer_behind_promotion(), None);
        // Promoted at 200 after the peer's demotion; the peer last wrote at
        // 100, while its own copy was primary: stale, waited for.
        st.promoted_after_handover = Some(t(200));
        let p = st.peer_behind_promotion().expect("a stale peer");
        assert!(p.contains("peer abcdef01 is up+stopped"), "{p}");
        // It wrote since: its copy is primary again (forced), not stale.
        st.peers[0].last_update = Some(t(300));
        assert_eq!(st.peer_behind_promotion(), None);
        st.peers[0].last_update = Some(t(100));
        st.peers[0].up = false;
        assert_eq!(st.peer_behind_promotion(), None, "down: not waited for");
        st.peers[0].up = true;
        st.peers[0].state = Replaying;
        assert_eq!(st.peer_behind_promotion(), None);
    }

    #[test]
    fn the_promotion_after_a_handover_is_found() {
        use MirrorSnapState::*;
        let ns = |state| MirrorSnapNamespace {
            state,
            mirror_peer_uuids: Vec::new(),
            complete: true,
            primary_mirror_uuid: String::new(),
            primary_snap_id: 0,
            last_copied_object_number: 0,
        };
        let snaps = |states: &[MirrorSnapState]| -> Vec<(u64, MirrorSnapNamespace)> {
            states
                .iter()
                .enumerate()
                .map(|(i, s)| (10 + i as u64, ns(*s)))
                .collect()
        };
        // B after a planned failover: A's demotion copied, then promoted.
        let b = snaps(&[NonPrimary, NonPrimaryDemoted, Primary, Primary]);
        assert_eq!(handover_promotion(&b), Some(12));
        // Always primary, or promoted by force over plain copies.
        assert_eq!(handover_promotion(&snaps(&[Primary, Primary])), None);
        assert_eq!(handover_promotion(&snaps(&[NonPrimary, Primary])), None);
        // Demoted itself since, or not promoted yet.
        assert_eq!(
            handover_promotion(&snaps(&[NonPrimaryDemoted, Primary, PrimaryDemoted])),
            None
        );
        assert_eq!(handover_promotion(&snaps(&[NonPrimaryDemoted])), None);
        assert_eq!(handover_promotion(&[]), None);
    }

    #[test]
    fn status_reads_like_the_daemons_write_it() {
        use MirrorStatusState::*;
        let mut st = status(
            false,
            site("", true, Replaying, "replaying, {}"),
            site("1234567890", true, Stopped, "local image is primary"),
        );
        assert!(st.primary_elsewhere());
        assert!(!st.peers_down());
        assert!(!st.secondary_ready());
        st.peers[0].up = false;
        assert!(st.peers_down() && !st.primary_elsewhere());
        st.local = Some(site("", true, Unknown, "remote image demoted"));
        st.peers = vec![site(
            "1234567890",
            true,
            Unknown,
            "remote image is not primary",
        )];
        assert!(st.secondary_ready());
        // Idle, but the other site's demotion is still being copied here.
        let mut copy = MirrorSnapNamespace {
            state: MirrorSnapState::NonPrimaryDemoted,
            mirror_peer_uuids: vec![],
            complete: false,
            primary_mirror_uuid: "1234567890".into(),
            primary_snap_id: 7,
            last_copied_object_number: 3,
        };
        st.newest_snapshot = Some(copy.clone());
        assert!(!st.secondary_ready());
        copy.complete = true;
        st.newest_snapshot = Some(copy.clone());
        assert!(st.secondary_ready());
        copy.state = MirrorSnapState::NonPrimary;
        st.newest_snapshot = Some(copy);
        assert!(!st.secondary_ready());
        st.local = Some(site("", true, Error, "split-brain detected"));
        assert!(st.split_brain() && !st.secondary_ready());

        st.primary = true;
        st.local = Some(site("", true, Stopped, "local image is primary"));
        st.peers = vec![site(
            "abcdef0123",
            true,
            Replaying,
            r#"replaying, {"last_snapshot_bytes":4096,"last_snapshot_sync_seconds":1,"local_snapshot_timestamp":1700000000,"remote_snapshot_timestamp":1700000000,"replay_state":"idle"}"#,
        )];
        let s = st.last_sync().unwrap();
        assert_eq!(s.bytes, Some(4096));
        assert!(s.in_sync);
        let (healthy, line) = st.replicating();
        assert!(healthy, "{line}");
        assert!(line.starts_with("peer abcdef01: up+replaying"), "{line}");
    }
}
