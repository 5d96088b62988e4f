//! Volume group snapshots: snapshots of several volumes at one instant,
//! for the CSI GroupController.
//!
//! # Design
//! The instant comes from an RBD group snapshot (`rbd_group_snap_create`:
//! librbd notifies every member's quiesce watchers, then takes each
//! member's exclusive lock, so no client writes, snapshots them all and
//! lets go). A member without the exclusive-lock feature would keep taking
//! writes between the snapshots, so such a source is refused
//! ([`VolumeError::Unsuitable`]). The
//! group and its snapshot are scaffolding: each member's state at that
//! instant becomes an ordinary snapshot image of its own
//! ([`GroupSnapshotId::member`], with the same owner records and final RBD
//! snapshot as [`crate::volume::snapshot`]'s), and then the group snapshot,
//! the memberships and the group are removed. So a member is restored,
//! listed and deleted as any snapshot, and the source volumes stay free to
//! be deleted or snapshotted into another group.
//!
//! A member image is made from the member's group snapshot by a clone
//! (`rbd_clone4`, Ceph 19 Squid and later: no data copy) or, where librbd
//! cannot clone from a snapshot outside the user namespace, by a copy of
//! the image as of that snapshot (`rbd_copy3`, which moves the data). A
//! copy takes as long as its data does, so [`Copies::Defer`] leaves it to
//! [`PendingCopies::run`], for a caller that runs it outside any request.
//!
//! # Crash safety
//! Every name derives from the request: the RBD group and the group
//! snapshot's name, each member image `I` and its temporary name
//! `I.rbdkit-new`. A member image gets its owner records and its final
//! snapshot under the temporary name, then is renamed, so the final name
//! never exists half made. The group snapshot is removed only once every
//! member image exists, so a re-run after a kill at any step finds either
//! the group snapshot (and makes the missing members from it) or all the
//! members (and removes what scaffolding is left). A delete removes what a
//! killed copy left under a temporary name.
//!
//! Every function here is blocking: call it through
//! [`crate::blocking::BlockingPool`] (a [`PendingCopies::run`] outside it).

use crate::rados::{Cluster, IoCtx};
use crate::rbd::{self, Features, Image, ImageOptions, SnapNamespaceType};
use crate::volume::ops::{fenced, ioctx, open_if_exists, timed, VolumeError, META_CLUSTER};
use crate::volume::ops::{META_PROVISIONER, TEMP_SUFFIX};
use crate::volume::snapshot::{
    self as snap, SnapshotInfo, KIND_SNAPSHOT, META_KIND, META_SNAPSHOT, META_SOURCE, SNAP_NAME,
};
use crate::volume::{CephObserver, Fence, GroupSnapshotId, NoFence, SnapshotId, VolumeId};
use crate::ErrorKind;

/// Metadata key on a member's snapshot image: the group snapshot's name.
pub const META_GROUP_SNAPSHOT: &str = "rbdkit.groupsnapshot";
/// The RBD group snapshot's name within its group.
const GROUP_SNAP: &str = "rbdkit";
/// Why a source without exclusive-lock is refused.
const NO_EXCLUSIVE_LOCK: &str = "it lacks the exclusive-lock feature: librbd holds a member's \
     writes while the group is snapshotted only by taking its exclusive lock, so the members \
     would not be one instant; make its StorageClass's imageFeatures include exclusive-lock \
     (or enable it: rbd feature enable IMAGE exclusive-lock)";
/// Prefix of the RADOS object that marks an RBD group as rbdkit's
/// scaffolding (RBD groups carry no metadata): written before the group is
/// made, removed after it is gone, so a group it names may be undone.
const GROUP_MARKER: &str = "rbdkit.group.";

fn marker(group: &str) -> String {
    format!("{GROUP_MARKER}{group}")
}

/// Whether RBD group `g` is rbdkit's scaffolding (its marker exists).
fn is_ours(io: &IoCtx, metrics: &dyn CephObserver, g: &str) -> Result<bool, VolumeError> {
    match timed(metrics, "stat", || io.stat(&marker(g))) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e.into()),
    }
}
/// Features a member image keeps from its source (as a clone would).
const MEMBER_FEATURES: Features = Features::from_bits(
    Features::LAYERING.bits()
        | Features::EXCLUSIVE_LOCK.bits()
        | Features::OBJECT_MAP.bits()
        | Features::FAST_DIFF.bits()
        | Features::DEEP_FLATTEN.bits(),
);

/// A group snapshot, as Create and Get report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSnapshotInfo {
    /// Its handle.
    pub id: GroupSnapshotId,
    /// Its members, sorted by handle.
    pub members: Vec<SnapshotInfo>,
}

/// The place a group snapshot of `sources` lives in: their common cluster,
/// pool and namespace. Several of those, a duplicate or none are refused
/// (INVALID_ARGUMENT: the caller names `source_volume_ids`).
pub fn place_of(sources: &[VolumeId], name: &str) -> Result<GroupSnapshotId, String> {
    let Some(first) = sources.first() else {
        return Err("source_volume_ids is empty".into());
    };
    for (i, s) in sources.iter().enumerate() {
        if s.cluster_id != first.cluster_id
            || s.pool != first.pool
            || s.rados_namespace != first.rados_namespace
        {
            return Err(format!(
                "source_volume_ids: {s} is in another cluster, pool or namespace than {first}; the volumes of a group snapshot share one"
            ));
        }
        if sources[..i].contains(s) {
            return Err(format!("source_volume_ids: {s} is named twice"));
        }
    }
    Ok(GroupSnapshotId {
        cluster_id: first.cluster_id.clone(),
        pool: first.pool.clone(),
        rados_namespace: first.rados_namespace.clone(),
        name: crate::volume::image_base(name),
    })
}

fn ignore(kind: ErrorKind, r: crate::Result<()>) -> crate::Result<()> {
    match r {
        Err(e) if e.kind() == kind => Ok(()),
        r => r,
    }
}

/// Whether member image `image` is complete and `provisioner`'s member of
/// group snapshot `group`; a name taken by anything else is a conflict.
fn member_done(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    image: &str,
    group: &str,
    provisioner: &str,
) -> Result<bool, VolumeError> {
    let Some(img) = open_if_exists(io, metrics, image)? else {
        return Ok(false);
    };
    let m = timed(metrics, "metadata_list", || img.metadata_list())?;
    if m.get(META_PROVISIONER).map(String::as_str) != Some(provisioner)
        || m.get(META_GROUP_SNAPSHOT).map(String::as_str) != Some(group)
    {
        return Err(VolumeError::Conflict {
            image: image.to_owned(),
            why: format!("it is not a member of group snapshot {group:?}"),
        });
    }
    Ok(timed(metrics, "snap_exists", || {
        img.snap_exists(SNAP_NAME)
    })?)
}

/// The id and size of source `image`'s part of group snapshot
/// `group`@[`GROUP_SNAP`].
fn group_snap_id(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    image: &Image,
    group: &str,
) -> Result<(u64, u64), VolumeError> {
    for s in timed(metrics, "snap_list", || image.snap_list())? {
        if timed(metrics, "snap_namespace_type", || {
            image.snap_namespace_type(s.id)
        })? != SnapNamespaceType::Group
        {
            continue;
        }
        let g = timed(metrics, "snap_group_namespace", || {
            image.snap_group_namespace(s.id)
        })?;
        if g.group_pool == io.pool_id() && g.group_name == group && g.group_snap_name == GROUP_SNAP
        {
            return Ok((s.id, s.size));
        }
    }
    Err(VolumeError::Missing {
        image: format!("{}@{group}/{GROUP_SNAP} (group snapshot)", image.name()),
    })
}

/// Whether a member that librbd cannot clone is copied in the call
/// (`Inline`) or left for [`PendingCopies::run`] (`Defer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copies {
    /// Copy it now: the call lasts as long as the data copy.
    Inline,
    /// Leave it: the call returns once the instant is taken.
    Defer,
}

/// What [`make_member`] did.
enum Made {
    /// The member image exists.
    Done,
    /// It needs a data copy, deferred; as it will be reported meanwhile.
    NeedsCopy(SnapshotInfo),
}

/// Makes member image `target` of `source` from the source's part of the
/// group snapshot, under the temporary name first.
#[allow(clippy::too_many_arguments)]
fn make_member(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    source: &VolumeId,
    target: &SnapshotId,
    gid: &GroupSnapshotId,
    request_name: &str,
    provisioner: &str,
    copies: Copies,
) -> Result<Made, VolumeError> {
    let temp = format!("{}{TEMP_SUFFIX}", target.image);
    // What an interrupted attempt left under the temporary name is redone.
    remove_temp(io, metrics, fence, &temp)?;
    let mut src = timed(metrics, "open", || Image::open_read_only(io, &source.image))?;
    let features = timed(metrics, "features", || src.features())?;
    let (snap_id, size) = group_snap_id(io, metrics, &src, &gid.name)?;
    let member_features =
        Features::from_bits(features.bits() & MEMBER_FEATURES.bits()) | Features::LAYERING;
    let opts = ImageOptions::new()
        .features(member_features)
        .clone_format(2)?;
    let cloned = timed(metrics, "clone4", || {
        rbd::clone_by_snap_id(io, &source.image, snap_id, io, &temp, &opts)
    });
    match cloned {
        Ok(()) => {}
        // librbd older than Squid clones from user snapshots only: copy.
        Err(e) if e.kind() == ErrorKind::NotSupported && copies == Copies::Defer => {
            let created = timed(metrics, "snap_get_timestamp", || {
                src.snap_timestamp(snap_id)
            })?;
            return Ok(Made::NeedsCopy(SnapshotInfo {
                id: target.clone(),
                source_volume: source.handle(),
                size,
                created,
                ready: false,
            }));
        }
        Err(e) if e.kind() == ErrorKind::NotSupported => {
            timed(metrics, "snap_set_by_id", || {
                src.set_snapshot_by_id(snap_id)
            })?;
            let copy_opts = ImageOptions::new().features(member_features);
            timed(metrics, "copy", || src.copy_to(io, &temp, &copy_opts))?;
        }
        Err(e) => return Err(e.into()),
    }
    drop(src);
    let records = [
        (META_PROVISIONER, provisioner.to_owned()),
        (META_KIND, KIND_SNAPSHOT.to_owned()),
        (META_SNAPSHOT, format!("{request_name}/{}", source.image)),
        (META_SOURCE, source.handle()),
        (META_CLUSTER, source.cluster_id.clone()),
        (META_GROUP_SNAPSHOT, gid.name.clone()),
    ];
    finish_member(io, metrics, &temp, &target.image, &records)?;
    Ok(Made::Done)
}

/// Gives the made image `temp` its owner records and final snapshot, then
/// its final name, so that name never exists half made.
fn finish_member(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    temp: &str,
    image: &str,
    records: &[(&str, String)],
) -> Result<(), VolumeError> {
    let img = timed(metrics, "open", || Image::open(io, temp))?;
    // A clone or copy inherits the source's metadata: its owner record
    // would make the member look like the source's volume (to `rbdkit gc`,
    // an orphan once the source's PV is gone).
    for k in timed(metrics, "metadata_list", || img.metadata_list())?.keys() {
        if k.starts_with("rbdkit.") && !records.iter().any(|(r, _)| r == k) {
            timed(metrics, "metadata_remove", || img.metadata_remove(k))?;
        }
    }
    for (k, v) in records {
        timed(metrics, "metadata_set", || img.metadata_set(k, v))?;
    }
    timed(metrics, "snap_create", || img.snap_create(SNAP_NAME))?;
    timed(metrics, "close", || img.close())?;
    timed(metrics, "rename", || rbd::rename(io, temp, image))?;
    Ok(())
}

/// Removes RBD group `g` with its snapshots and memberships (and the
/// temporary member images named after those), then its marker, whichever
/// of them are there (a kill between the group's removal
/// and its marker's leaves the marker alone).
fn remove_group(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    g: &str,
) -> Result<(), VolumeError> {
    fenced(fence, "rbd_group_remove", g)?;
    match timed(metrics, "group_image_list", || rbd::group_image_list(io, g)) {
        Ok(images) => {
            // What a killed or failed copy left, named after the members.
            for i in images.iter().filter(|i| i.pool_id == io.pool_id()) {
                let member = crate::volume::image_base(&format!("{g}-{}", i.name));
                remove_temp(io, metrics, fence, &format!("{member}{TEMP_SUFFIX}"))?;
            }
            let snaps = timed(metrics, "group_snap_list", || rbd::group_snap_list(io, g))?;
            for s in snaps {
                ignore(
                    ErrorKind::NotFound,
                    timed(metrics, "group_snap_remove", || {
                        rbd::group_snap_remove(io, g, &s.name)
                    }),
                )?;
            }
            for i in images.iter().filter(|i| i.pool_id == io.pool_id()) {
                ignore(
                    ErrorKind::NotFound,
                    timed(metrics, "group_image_remove", || {
                        rbd::group_image_remove(io, g, io, &i.name)
                    }),
                )?;
            }
            ignore(
                ErrorKind::NotFound,
                timed(metrics, "group_remove", || rbd::group_remove(io, g)),
            )?;
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    ignore(
        ErrorKind::NotFound,
        timed(metrics, "remove", || io.remove(&marker(g))),
    )?;
    Ok(())
}

/// Puts every source in the RBD group of `gid` (made if missing) and takes
/// the group snapshot; `redo`: an incomplete one is removed first. A source
/// another group holds is [`VolumeError::Busy`] (a retry can pass once that
/// group snapshot is taken).
fn take_group_snap(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    gid: &GroupSnapshotId,
    sources: &[VolumeId],
    redo: bool,
) -> Result<(), VolumeError> {
    let g = &gid.name;
    timed(metrics, "write_full", || io.write_full(&marker(g), b""))?;
    ignore(
        ErrorKind::AlreadyExists,
        timed(metrics, "group_create", || rbd::group_create(io, g)),
    )?;
    let already = timed(metrics, "group_image_list", || rbd::group_image_list(io, g))?;
    for s in sources {
        if already.iter().any(|i| i.name == s.image && i.attached) {
            continue;
        }
        let added = timed(metrics, "group_image_add", || {
            rbd::group_image_add(io, g, io, &s.image)
        });
        match added {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                return Err(VolumeError::Busy {
                    image: s.to_string(),
                    why: format!(
                        "it is in another RBD group (a group snapshot being taken of it?): {e}"
                    ),
                })
            }
            Err(e) => return Err(e.into()),
        }
    }
    if redo {
        fenced(fence, "rbd_group_snap_remove", g)?;
        timed(metrics, "group_snap_remove", || {
            rbd::group_snap_remove(io, g, GROUP_SNAP)
        })?;
    }
    timed(metrics, "group_snap_create", || {
        rbd::group_snap_create(io, g, GROUP_SNAP)
    })?;
    Ok(())
}

/// Removes what a failed [`take_group_snap`] made and returns its error
/// (the cleanup's own failure is logged: a retry, or a delete of the group
/// snapshot's name, ends it).
fn undo_scaffolding(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    gid: &GroupSnapshotId,
    e: VolumeError,
) -> VolumeError {
    if let Err(undo) = remove_group(io, metrics, fence, &gid.name) {
        tracing::warn!(group = %gid, error = %undo,
            "cannot remove the RBD group of a failed group snapshot; a retry, or a delete of its name, will");
    }
    e
}

/// Removes every RBD group of `image`'s pool and namespace that holds it
/// and is rbdkit's group-snapshot scaffolding (marked by a RADOS object
/// `rbdkit.group.<name>`), with the group's snapshot: a create killed or
/// abandoned half-way can leave a source in one, and librbd refuses to
/// remove an image in a group (`EMLINK`), or with a group snapshot's part
/// (`ENOTEMPTY`). Any other group is
/// [`VolumeError::NotOwned`], naming it. Returns whether it was in a group
/// at all.
pub fn leave_scaffolding_groups(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    image: &str,
) -> Result<bool, VolumeError> {
    let mut found = false;
    for g in timed(metrics, "group_list", || rbd::group_list(io))? {
        let members = match timed(metrics, "group_image_list", || {
            rbd::group_image_list(io, &g)
        }) {
            Ok(m) => m,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(e.into()),
        };
        if !members
            .iter()
            .any(|m| m.name == image && m.pool_id == io.pool_id())
        {
            continue;
        }
        found = true;
        if !is_ours(io, metrics, &g)? {
            return Err(VolumeError::NotOwned {
                image: image.to_owned(),
                why: format!(
                    "it is in RBD group {g:?}, which is not a group snapshot of rbdkit's; remove it from that group first"
                ),
            });
        }
        // The whole group goes, its snapshot first: that snapshot's part on
        // each member is an RBD snapshot of the member, which would keep
        // the image from being purged once out of the group, and without
        // this source the group snapshot can never be finished anyway.
        tracing::warn!(group = %g, image,
            "removing the RBD group a failed or interrupted group snapshot left, to delete one of its sources");
        // The caller asked the fence before removing the image.
        remove_group(io, metrics, &NoFence, &g)?;
    }
    Ok(found)
}

/// What [`ensure_group_snapshot`] got to.
#[derive(Debug)]
pub enum Ensured {
    /// Every member image exists and the scaffolding is gone.
    Ready(GroupSnapshotInfo),
    /// The instant is taken; some members need a data copy (`copies` was
    /// [`Copies::Defer`]).
    Copying(PendingCopies),
}

/// Members of a taken group snapshot still to be copied, and the group
/// snapshot as it is until they are: those members not ready.
#[derive(Debug)]
pub struct PendingCopies {
    /// The group snapshot as reported meanwhile.
    pub info: GroupSnapshotInfo,
    sources: Vec<VolumeId>,
    copies: Vec<(VolumeId, SnapshotId)>,
    request_name: String,
    provisioner: String,
}

impl PendingCopies {
    /// The bytes still to copy (the members' sizes).
    pub fn bytes(&self) -> u64 {
        let pending = |i: &&SnapshotInfo| self.copies.iter().any(|(_, m)| *m == i.id);
        self.info
            .members
            .iter()
            .filter(pending)
            .map(|i| i.size)
            .sum()
    }

    /// Copies the members, then removes the scaffolding; returns the
    /// finished group snapshot. As long as its copies: run it outside any
    /// request. Killed half-way, a re-run of [`ensure_group_snapshot`]
    /// redoes the member it was copying.
    pub fn run(
        self,
        cluster: &Cluster,
        metrics: &dyn CephObserver,
    ) -> Result<GroupSnapshotInfo, VolumeError> {
        let gid = self.info.id.clone();
        let io = ioctx(cluster, metrics, &self.sources[0])?;
        for (s, m) in &self.copies {
            // The marker's age tells `rbdkit gc` the create is alive.
            timed(metrics, "write_full", || {
                io.write_full(&marker(&gid.name), b"")
            })?;
            let (name, prov) = (&self.request_name, &self.provisioner);
            make_member(
                &io,
                metrics,
                &NoFence,
                s,
                m,
                &gid,
                name,
                prov,
                Copies::Inline,
            )?;
        }
        finish(
            cluster,
            metrics,
            &NoFence,
            &io,
            &gid,
            &self.sources,
            &self.provisioner,
        )
    }
}

/// The RBD groups of `io`'s pool and namespace that are rbdkit's
/// scaffolding (marked) and whose marker is at least `grace` old: creates
/// given up, since every attempt writes the marker anew. For `rbdkit gc`;
/// a group whose marker cannot be read is left out.
pub fn abandoned_groups(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    grace: std::time::Duration,
) -> Result<Vec<String>, VolumeError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let mut out = Vec::new();
    for g in timed(metrics, "group_list", || rbd::group_list(io))? {
        let Ok(st) = timed(metrics, "stat", || io.stat(&marker(&g))) else {
            continue;
        };
        let age = now.saturating_sub(u64::try_from(st.mtime).unwrap_or(0));
        if age >= grace.as_secs() {
            out.push(g);
        }
    }
    Ok(out)
}

/// Removes scaffolding group `g` with its snapshots and memberships, then
/// its marker, if it is still rbdkit's (marked); `false` if it is gone.
/// Any other group is [`VolumeError::NotOwned`].
pub fn remove_abandoned_group(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    g: &str,
) -> Result<bool, VolumeError> {
    if !is_ours(io, metrics, g)? {
        let exists = timed(metrics, "group_list", || rbd::group_list(io))?
            .iter()
            .any(|x| x == g);
        if !exists {
            return Ok(false);
        }
        return Err(VolumeError::NotOwned {
            image: g.to_owned(),
            why: "it is an RBD group that no rbdkit group snapshot marks".into(),
        });
    }
    remove_group(io, metrics, &NoFence, g)?;
    Ok(true)
}

/// Makes sure group snapshot `name` of `sources` (volumes of `provisioner`
/// in one pool, see [`place_of`]) exists, taking it if needed (see the
/// module doc). Members that need a data copy are made in the call, or,
/// with [`Copies::Defer`], left to [`PendingCopies::run`].
pub fn ensure_group_snapshot(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    sources: &[VolumeId],
    name: &str,
    provisioner: &str,
    copies: Copies,
) -> Result<Ensured, VolumeError> {
    ensure_group_snapshot_fenced(
        cluster,
        metrics,
        &NoFence,
        sources,
        name,
        provisioner,
        copies,
    )
}

/// [`ensure_group_snapshot`] with `fence` asked before each destructive
/// step (the provisioner's leader lease).
pub fn ensure_group_snapshot_fenced(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    sources: &[VolumeId],
    name: &str,
    provisioner: &str,
    copies: Copies,
) -> Result<Ensured, VolumeError> {
    let gid = place_of(sources, name).map_err(|why| VolumeError::Refused { why })?;
    let io = ioctx(cluster, metrics, &sources[0])?;
    let g = gid.name.clone();
    let mut missing = Vec::new();
    for s in sources {
        let m = gid.member(s, SNAP_NAME);
        if !member_done(&io, metrics, &m.image, &g, provisioner)? {
            missing.push((s, m));
        }
    }
    if !missing.is_empty() {
        let have_snap = match timed(metrics, "group_snap_list", || rbd::group_snap_list(&io, &g)) {
            Ok(snaps) => snaps
                .iter()
                .find(|s| s.name == GROUP_SNAP)
                .map(|s| s.complete),
            Err(e) if e.kind() == ErrorKind::NotFound => None,
            Err(e) => return Err(e.into()),
        };
        match have_snap {
            Some(true) => {}
            // Members made from another instant would not be one group.
            None if missing.len() < sources.len() => {
                return Err(VolumeError::Conflict {
                    image: gid.to_string(),
                    why: "some members exist but the group snapshot they came from is gone; delete the group snapshot and take it again".into(),
                })
            }
            incomplete => {
                for s in sources {
                    let m = timed(metrics, "open", || Image::open_read_only(&io, &s.image))
                        .map_err(|e| match e.kind() {
                            ErrorKind::NotFound => VolumeError::Missing {
                                image: s.to_string(),
                            },
                            _ => e.into(),
                        })?;
                    let meta = timed(metrics, "metadata_list", || m.metadata_list())?;
                    if meta.get(META_PROVISIONER).map(String::as_str) != Some(provisioner)
                        || meta.contains_key(META_KIND)
                    {
                        return Err(VolumeError::NotOwned {
                            image: s.image.clone(),
                            why: format!("it is not a volume of {provisioner:?}"),
                        });
                    }
                    let features = timed(metrics, "features", || m.features())?;
                    if !features.contains(Features::EXCLUSIVE_LOCK) {
                        return Err(VolumeError::Unsuitable {
                            image: s.to_string(),
                            why: NO_EXCLUSIVE_LOCK.into(),
                        });
                    }
                }
                // Any failure from here undoes the group, so no source is
                // left in it (librbd refuses to remove an image in a group).
                take_group_snap(&io, metrics, fence, &gid, sources, incomplete == Some(false))
                    .map_err(|e| undo_scaffolding(&io, metrics, fence, &gid, e))?;
            }
        }
        let mut pending = Vec::new();
        for (s, m) in &missing {
            let made = make_member(&io, metrics, fence, s, m, &gid, name, provisioner, copies)?;
            if let Made::NeedsCopy(info) = made {
                pending.push(((*s).clone(), m.clone(), info));
            }
        }
        if !pending.is_empty() {
            return pending_copies(cluster, metrics, &gid, sources, pending, name, provisioner);
        }
    }
    finish(cluster, metrics, fence, &io, &gid, sources, provisioner).map(Ensured::Ready)
}

/// The scaffolding removed once every member exists; the group snapshot.
fn finish(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    io: &IoCtx,
    gid: &GroupSnapshotId,
    sources: &[VolumeId],
    provisioner: &str,
) -> Result<GroupSnapshotInfo, VolumeError> {
    remove_group(io, metrics, fence, &gid.name)?;
    let members = sources
        .iter()
        .map(|s| gid.member(s, SNAP_NAME))
        .collect::<Vec<_>>();
    get_members(cluster, metrics, gid, &members, provisioner)?.ok_or_else(|| VolumeError::Missing {
        image: gid.to_string(),
    })
}

/// The members left to copy, with the group snapshot as reported until
/// they are: those made as they are, the others not ready.
fn pending_copies(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    gid: &GroupSnapshotId,
    sources: &[VolumeId],
    pending: Vec<(VolumeId, SnapshotId, SnapshotInfo)>,
    request_name: &str,
    provisioner: &str,
) -> Result<Ensured, VolumeError> {
    let mut members = Vec::new();
    for s in sources {
        let m = gid.member(s, SNAP_NAME);
        match pending.iter().find(|(_, p, _)| *p == m) {
            Some((_, _, info)) => members.push(info.clone()),
            None => members.push(
                snap::get_snapshot(cluster, metrics, &m, provisioner)?.ok_or_else(|| {
                    VolumeError::Missing {
                        image: m.to_string(),
                    }
                })?,
            ),
        }
    }
    members.sort_by_key(|i| i.id.handle());
    Ok(Ensured::Copying(PendingCopies {
        info: GroupSnapshotInfo {
            id: gid.clone(),
            members,
        },
        sources: sources.to_vec(),
        copies: pending.into_iter().map(|(s, m, _)| (s, m)).collect(),
        request_name: request_name.to_owned(),
        provisioner: provisioner.to_owned(),
    }))
}

fn get_members(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    gid: &GroupSnapshotId,
    members: &[SnapshotId],
    provisioner: &str,
) -> Result<Option<GroupSnapshotInfo>, VolumeError> {
    let mut out = Vec::new();
    for m in members {
        match snap::get_snapshot(cluster, metrics, m, provisioner)? {
            Some(info) => out.push(info),
            None => return Ok(None),
        }
    }
    out.sort_by_key(|i| i.id.handle());
    Ok(Some(GroupSnapshotInfo {
        id: gid.clone(),
        members: out,
    }))
}

/// The member snapshots of `gid` that `provisioner` made, found by their
/// records in the group snapshot's pool and namespace.
fn find_members(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    gid: &GroupSnapshotId,
    provisioner: &str,
) -> Result<Vec<SnapshotId>, VolumeError> {
    let place = VolumeId {
        cluster_id: gid.cluster_id.clone(),
        pool: gid.pool.clone(),
        rados_namespace: gid.rados_namespace.clone(),
        image: String::new(),
    };
    let io = ioctx(cluster, metrics, &place)?;
    let mut out = Vec::new();
    for image in timed(metrics, "list", || rbd::list_names(&io))? {
        // Another client may remove it meanwhile.
        let Ok(img) = Image::open_read_only(&io, &image) else {
            continue;
        };
        if img.metadata_get(META_PROVISIONER).ok().as_deref() == Some(provisioner)
            && img.metadata_get(META_GROUP_SNAPSHOT).ok().as_deref() == Some(&gid.name)
        {
            out.push(SnapshotId {
                cluster_id: gid.cluster_id.clone(),
                pool: gid.pool.clone(),
                rados_namespace: gid.rados_namespace.clone(),
                image,
                snap: SNAP_NAME.to_owned(),
            });
        }
    }
    Ok(out)
}

/// Group snapshot `gid` if all its members exist. `expected`: the member
/// ids the caller holds (CSI's `snapshot_ids`); a mismatch is refused.
pub fn get_group_snapshot(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    gid: &GroupSnapshotId,
    expected: &[SnapshotId],
    provisioner: &str,
) -> Result<Option<GroupSnapshotInfo>, VolumeError> {
    let mut found = find_members(cluster, metrics, gid, provisioner)?;
    if found.is_empty() {
        return Ok(None);
    }
    found.sort_by_key(|m| m.handle());
    check_expected(gid, &found, expected)?;
    get_members(cluster, metrics, gid, &found, provisioner)
}

fn check_expected(
    gid: &GroupSnapshotId,
    found: &[SnapshotId],
    expected: &[SnapshotId],
) -> Result<(), VolumeError> {
    if let Some(x) = expected.iter().find(|x| !found.contains(x)) {
        return Err(VolumeError::Refused {
            why: format!("snapshot_ids: {x} is not a member of {gid}"),
        });
    }
    Ok(())
}

/// Deletes group snapshot `gid`: each member as a snapshot is deleted, and
/// any scaffolding an interrupted create left. Done when nothing is left.
pub fn delete_group_snapshot(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    gid: &GroupSnapshotId,
    expected: &[SnapshotId],
    provisioner: &str,
) -> Result<(), VolumeError> {
    delete_group_snapshot_fenced(cluster, metrics, &NoFence, gid, expected, provisioner)
}

/// [`delete_group_snapshot`] with `fence` asked before each destructive
/// step.
pub fn delete_group_snapshot_fenced(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    gid: &GroupSnapshotId,
    expected: &[SnapshotId],
    provisioner: &str,
) -> Result<(), VolumeError> {
    let found = find_members(cluster, metrics, gid, provisioner)?;
    let place = VolumeId {
        cluster_id: gid.cluster_id.clone(),
        pool: gid.pool.clone(),
        rados_namespace: gid.rados_namespace.clone(),
        image: String::new(),
    };
    let io = ioctx(cluster, metrics, &place)?;
    // A member already deleted (a retry, or deleted on its own) is no
    // mismatch; one that exists outside this group snapshot is.
    for x in expected.iter().filter(|x| !found.contains(x)) {
        let elsewhere = x.pool != gid.pool
            || x.rados_namespace != gid.rados_namespace
            || open_if_exists(&io, metrics, &x.image)?.is_some();
        if elsewhere {
            return Err(VolumeError::Refused {
                why: format!("snapshot_ids: {x} is not a member of {gid}"),
            });
        }
    }
    remove_group(&io, metrics, fence, &gid.name)?;
    for m in &found {
        snap::delete_snapshot_fenced(cluster, metrics, fence, m, provisioner)?;
    }
    Ok(())
}

/// Removes a member's temporary image, if there is one. One a killed
/// process was copying into keeps that process's watch until the OSDs time
/// it out (`osd_client_watch_timeout`, 30 s by default): [`VolumeError::Busy`]
/// meanwhile, which the CO retries.
fn remove_temp(
    io: &IoCtx,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    temp: &str,
) -> Result<(), VolumeError> {
    fenced(fence, "rbd_remove", temp)?;
    match timed(metrics, "remove", || rbd::remove(io, temp)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == ErrorKind::Busy => Err(VolumeError::Busy {
            image: temp.to_owned(),
            why: format!(
                "a member image left half made is still open, by a copy that was killed (its watch ends within the OSDs' osd_client_watch_timeout) or that still runs: {e}"
            ),
        }),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(pool: &str, image: &str) -> VolumeId {
        VolumeId {
            cluster_id: "c".into(),
            pool: pool.into(),
            rados_namespace: String::new(),
            image: image.into(),
        }
    }

    #[test]
    fn a_group_lives_in_one_pool_with_distinct_members() {
        let g = place_of(&[vol("rbd", "a"), vol("rbd", "b")], "gs-1").unwrap();
        assert_eq!((g.pool.as_str(), g.name.as_str()), ("rbd", "gs-1"));
        assert!(place_of(&[], "x").unwrap_err().contains("empty"));
        let e = place_of(&[vol("rbd", "a"), vol("other", "b")], "x").unwrap_err();
        assert!(e.starts_with("source_volume_ids:"), "{e}");
        let e = place_of(&[vol("rbd", "a"), vol("rbd", "a")], "x").unwrap_err();
        assert!(e.contains("twice"), "{e}");
    }
}
