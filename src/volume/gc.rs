//! Garbage collection: what a provisioner left behind in Ceph.
//!
//! [`scan`] lists, in one pool (and RADOS namespace), every image, temporary
//! image and trash entry whose owner record (see [`crate::volume::ops`])
//! names a given provisioner. [`select`] keeps those that no PV and no claim
//! refers to. [`remove`] removes one of them after checking, right before
//! the removal, that it is still the same object with the same owner record.
//! Anything without a complete owner record of that provisioner is never
//! touched: not even a temporary image without one, although the
//! provisioner itself cleans those up for its own claims.
//!
//! A temporary RBD snapshot (`rbdkit-tmp-<new image>`, taken on a source
//! for a snapshot image or a PVC clone) that a killed create left on one of
//! the provisioner's images is a leftover too, even when the image itself
//! is still in use: it is ours by its name and the image's owner record,
//! and it is left alone while the image it was for is still being made (its
//! temporary image exists) or a claim or PV of that name exists.
//!
//! An RBD group that a group snapshot create marked as its scaffolding
//! (see [`crate::volume::group_snapshot`]) and left, given up, is a
//! leftover once its marker is older than the grace [`scan`] is given:
//! every attempt of a create writes its marker anew.
//!
//! Nothing here knows about Kubernetes: the caller passes the references it
//! found (the CLI, `rbdkit gc`, lists PVs and claims).

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::time::{Duration, Instant};

use crate::rados::{Cluster, IoCtx};
use crate::rbd::{self, Image};
use crate::volume::group_snapshot;
use crate::volume::ops::{
    VolumeError, META_CLUSTER, META_PROVISIONER, META_PV, META_PVC_NAME, META_PVC_NAMESPACE,
    TEMP_SUFFIX,
};
use crate::volume::snapshot::TEMP_SNAP_PREFIX;
use crate::volume::{NoMetrics, VolumeId};
use crate::ErrorKind;

/// What kind of leftover an object is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A temporary `rbdkit-tmp-` RBD snapshot on one of our images (a
    /// snapshot or clone create cut short). First, so that it goes before
    /// the image it is on, when both are collected.
    TempSnap,
    /// A finished image (its PV is gone).
    Orphan,
    /// A temporary `.rbdkit-new` image (a create cut short).
    Temp,
    /// A trash entry (a delete cut short, or one blocked by snapshots).
    Trash,
    /// An RBD group a group snapshot create left (its name in `image`).
    Group,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Orphan => "orphan",
            Kind::Temp => "temp",
            Kind::Trash => "trash",
            Kind::TempSnap => "tempsnap",
            Kind::Group => "group",
        })
    }
}

/// An object whose owner record names the provisioner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owned {
    /// Image, temporary image, trash entry or temporary snapshot.
    pub kind: Kind,
    /// Where it is; `image` is the image's (or trash entry's) name; for a
    /// temporary snapshot, the image it is on.
    pub volume: VolumeId,
    /// The image id (for a trash entry, the id it is listed under).
    pub image_id: String,
    /// The PV recorded as its owner; for a temporary snapshot, the image
    /// (and PV) it was taken for.
    pub pv_name: String,
    /// The claim recorded as its owner, `namespace/name` (for a temporary
    /// snapshot, the owner of the image it is on).
    pub claim: String,
    /// The temporary snapshot's name (only for [`Kind::TempSnap`]).
    pub snap: Option<String>,
}

impl Owned {
    /// The name of the finished image this object is (or would have
    /// become): the temporary suffix removed.
    pub fn final_name(&self) -> &str {
        match self.kind {
            Kind::Temp => self
                .volume
                .image
                .strip_suffix(TEMP_SUFFIX)
                .unwrap_or(&self.volume.image),
            Kind::TempSnap => &self.pv_name,
            _ => &self.volume.image,
        }
    }

    fn with_final_name(&self) -> VolumeId {
        VolumeId {
            image: self.final_name().to_owned(),
            ..self.volume.clone()
        }
    }
}

/// What one pool holds, as [`scan`] saw it.
#[derive(Debug, Clone, Default)]
pub struct Scan {
    /// Objects owned by the provisioner.
    pub owned: Vec<Owned>,
    /// How many images and trash entries belong to someone else (no owner
    /// record, an incomplete one, or another provisioner's or cluster's).
    pub foreign: usize,
    /// Objects that could not be read (they are left alone), with why.
    pub unreadable: Vec<String>,
}

/// What Kubernetes still refers to.
#[derive(Debug, Clone, Default)]
pub struct References {
    /// Volume handles of PVs (the CSI driver's and the provisioner's).
    pub volumes: HashSet<VolumeId>,
    /// PV names that exist, and `pvc-<uid>` of every claim that exists
    /// (a claim being provisioned has no PV yet).
    pub pv_names: HashSet<String>,
}

impl References {
    /// Whether `o` (or the image it would become) is still referred to.
    pub fn refers_to(&self, o: &Owned) -> bool {
        self.pv_names.contains(&o.pv_name) || self.volumes.contains(&o.with_final_name())
    }
}

/// Which owner record an image carries, if it is a complete one of
/// `provisioner` in `cluster_id`: `(pv, claim)`.
fn owner_of(
    meta: &BTreeMap<String, String>,
    provisioner: &str,
    cluster_id: &str,
) -> Option<(String, String)> {
    if meta.get(META_PROVISIONER).map(String::as_str) != Some(provisioner) {
        return None;
    }
    if meta
        .get(META_CLUSTER)
        .is_some_and(|c| c.as_str() != cluster_id)
    {
        return None;
    }
    let pv = meta.get(META_PV).filter(|p| !p.is_empty())?;
    let claim = format!(
        "{}/{}",
        meta.get(META_PVC_NAMESPACE)
            .map(String::as_str)
            .unwrap_or(""),
        meta.get(META_PVC_NAME).map(String::as_str).unwrap_or("")
    );
    Some((pv.clone(), claim))
}

/// Lists the images and trash entries of `pool` (in the RADOS namespace
/// `rados_namespace`) and sorts out those whose owner record names
/// `provisioner`, and the scaffolding groups given up at least
/// `group_grace` ago. Uses `rbd_list2`, `rbd_trash_list`,
/// `rbd_open_read_only`, `rbd_open_by_id_read_only`, `rbd_metadata_list`,
/// `rbd_group_list` and `rados_stat`; each call is bounded by the
/// connection's operation timeout.
pub fn scan(
    cluster: &Cluster,
    cluster_id: &str,
    pool: &str,
    rados_namespace: &str,
    provisioner: &str,
    group_grace: Duration,
) -> crate::Result<Scan> {
    let io = cluster.ioctx_ns(pool, rados_namespace)?;
    let at = |image: &str| VolumeId {
        cluster_id: cluster_id.to_owned(),
        pool: pool.to_owned(),
        rados_namespace: rados_namespace.to_owned(),
        image: image.to_owned(),
    };
    let mut out = Scan::default();
    let names = rbd::list_names(&io)?;
    let present: HashSet<&str> = names.iter().map(String::as_str).collect();
    for name in &names {
        let name = name.as_str();
        let img = match Image::open_read_only(&io, name) {
            Ok(i) => i,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => {
                out.unreadable.push(e.to_string());
                continue;
            }
        };
        let read = img.metadata_list().and_then(|m| Ok((m, img.id()?)));
        let (meta, id) = match read {
            Ok(r) => r,
            Err(e) => {
                out.unreadable.push(e.to_string());
                continue;
            }
        };
        let Some((pv_name, claim)) = owner_of(&meta, provisioner, cluster_id) else {
            out.foreign += 1;
            continue;
        };
        let kind = if name.ends_with(TEMP_SUFFIX) {
            Kind::Temp
        } else {
            Kind::Orphan
        };
        match img.snap_list() {
            Ok(snaps) => {
                for snap in snaps {
                    let Some(target) = snap.name.strip_prefix(TEMP_SNAP_PREFIX) else {
                        continue;
                    };
                    // A create still under way: its clone is being made.
                    if target.is_empty()
                        || present.contains(format!("{target}{TEMP_SUFFIX}").as_str())
                    {
                        continue;
                    }
                    out.owned.push(Owned {
                        kind: Kind::TempSnap,
                        volume: at(name),
                        image_id: id.clone(),
                        pv_name: target.to_owned(),
                        claim: claim.clone(),
                        snap: Some(snap.name.clone()),
                    });
                }
            }
            Err(e) => out.unreadable.push(e.to_string()),
        }
        out.owned.push(Owned {
            kind,
            volume: at(name),
            image_id: id,
            pv_name,
            claim,
            snap: None,
        });
    }
    for entry in rbd::trash_list(&io)? {
        let meta = Image::open_by_id_read_only(&io, &entry.id).and_then(|i| i.metadata_list());
        let meta = match meta {
            Ok(m) => m,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => {
                out.unreadable.push(e.to_string());
                continue;
            }
        };
        let Some((pv_name, claim)) = owner_of(&meta, provisioner, cluster_id) else {
            out.foreign += 1;
            continue;
        };
        out.owned.push(Owned {
            kind: Kind::Trash,
            volume: at(&entry.name),
            image_id: entry.id,
            pv_name,
            claim,
            snap: None,
        });
    }
    let groups = group_snapshot::abandoned_groups(&io, &NoMetrics, group_grace);
    for g in groups.map_err(|e| match e {
        VolumeError::Ceph(e) => e,
        other => crate::Error::invalid("rbd_group_list", pool, other.to_string()),
    })? {
        out.owned.push(Owned {
            kind: Kind::Group,
            volume: at(&g),
            image_id: String::new(),
            pv_name: String::new(),
            claim: String::new(),
            snap: None,
        });
    }
    Ok(out)
}

/// The owned objects that nothing refers to: the ones to collect.
pub fn select(owned: &[Owned], refs: &References) -> Vec<Owned> {
    let mut out: Vec<Owned> = owned
        .iter()
        .filter(|o| !refs.refers_to(o))
        .cloned()
        .collect();
    out.sort_by(|a, b| (&a.volume.image, a.kind, &a.snap).cmp(&(&b.volume.image, b.kind, &b.snap)));
    out
}

/// What [`remove`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removed {
    /// It was removed.
    Removed,
    /// It was already gone (a second run, or someone else removed it).
    AlreadyGone,
}

/// Opens `o`'s image again (`None`: gone since the scan) and checks it is
/// the same image with the same owner record.
fn reopen(
    io: &IoCtx,
    o: &Owned,
    provisioner: &str,
    read_only: bool,
) -> Result<Option<Image>, VolumeError> {
    let opened = if read_only {
        Image::open_read_only(io, &o.volume.image)
    } else {
        Image::open(io, &o.volume.image)
    };
    let image = match opened {
        Ok(i) => i,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if image.id()? != o.image_id {
        return Err(VolumeError::NotOwned {
            image: o.volume.to_string(),
            why: "it was replaced by another image since the scan".into(),
        });
    }
    recheck(&image, o, provisioner)?;
    Ok(Some(image))
}

/// Checks that what is there now is still `o`, with the same owner record
/// (for a temporary snapshot: any owner record of ours on its image).
fn recheck(image: &Image, o: &Owned, provisioner: &str) -> Result<(), VolumeError> {
    let meta = image.metadata_list()?;
    let what = format!("{} ({})", o.volume, o.kind);
    match owner_of(&meta, provisioner, &o.volume.cluster_id) {
        Some(_) if o.kind == Kind::TempSnap => Ok(()),
        Some((pv, _)) if pv == o.pv_name => Ok(()),
        Some((pv, _)) => Err(VolumeError::NotOwned {
            image: what,
            why: format!("its owner record now names PV {pv:?}"),
        }),
        None => Err(VolumeError::NotOwned {
            image: what,
            why: format!("it no longer has an owner record of provisioner {provisioner:?}"),
        }),
    }
}

/// Removes `o`, found by [`scan`], if it still is what the scan saw: the
/// same image id, an owner record of `provisioner` for the same PV, and (for
/// an image) no watchers. Idempotent: a second call reports
/// [`Removed::AlreadyGone`]. An image with snapshots or clones is not
/// forced: that is a [`VolumeError::PurgeBlocked`] error. A temporary
/// snapshot is removed with `rbd_snap_remove` (one with clones moves to the
/// snapshot trash namespace, as the provisioner's own cleanup does), unless
/// the clone it was for is being made again by then. The removal stops
/// at `deadline` (`rbd_remove_with_progress`,
/// `rbd_trash_remove_with_progress`); a later call finishes it.
pub fn remove(
    cluster: &Cluster,
    o: &Owned,
    provisioner: &str,
    deadline: Instant,
) -> Result<Removed, VolumeError> {
    let io = cluster.ioctx_ns(&o.volume.pool, &o.volume.rados_namespace)?;
    let blocked = |e: crate::Error| VolumeError::PurgeBlocked {
        image: o.volume.to_string(),
        why: format!("{e}; it has snapshots or clones, which gc leaves to you"),
    };
    match o.kind {
        Kind::TempSnap => {
            let snap = o.snap.as_deref().unwrap_or_default();
            if !snap.starts_with(TEMP_SNAP_PREFIX) {
                return Err(VolumeError::NotOwned {
                    image: format!("{}@{snap}", o.volume),
                    why: format!("not a {TEMP_SNAP_PREFIX} snapshot"),
                });
            }
            let Some(image) = reopen(&io, o, provisioner, false)? else {
                return Ok(Removed::AlreadyGone);
            };
            let temp = format!("{}{TEMP_SUFFIX}", o.pv_name);
            match Image::open_read_only(&io, &temp) {
                Ok(_) => {
                    return Err(VolumeError::Refused {
                        why: format!(
                            "{}@{snap}: its clone {temp} is being made again; left alone",
                            o.volume
                        ),
                    })
                }
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
            match image.snap_remove(snap) {
                Ok(()) => Ok(Removed::Removed),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(Removed::AlreadyGone),
                Err(e) => Err(e.into()),
            }
        }
        Kind::Orphan | Kind::Temp => {
            let Some(image) = reopen(&io, o, provisioner, true)? else {
                return Ok(Removed::AlreadyGone);
            };
            let watchers = image.watchers()?;
            if !watchers.is_empty() {
                return Err(VolumeError::InUse {
                    image: o.volume.to_string(),
                    watchers: watchers.len(),
                });
            }
            drop(image);
            match rbd::remove_with_deadline(&io, &o.volume.image, deadline) {
                Ok(()) => Ok(Removed::Removed),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(Removed::AlreadyGone),
                Err(e) if matches!(e.kind(), ErrorKind::HasSnapshots | ErrorKind::Busy) => {
                    Err(blocked(e))
                }
                Err(e) => Err(e.into()),
            }
        }
        Kind::Group => {
            match group_snapshot::remove_abandoned_group(&io, &NoMetrics, &o.volume.image)? {
                true => Ok(Removed::Removed),
                false => Ok(Removed::AlreadyGone),
            }
        }
        Kind::Trash => {
            match rbd::trash_get(&io, &o.image_id) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Removed::AlreadyGone),
                Err(e) => return Err(e.into()),
            }
            // Fail closed: a forced purge runs only on an entry proven ours.
            let image = Image::open_by_id_read_only(&io, &o.image_id).map_err(|e| {
                VolumeError::NotOwned {
                    image: o.volume.to_string(),
                    why: format!("its owner cannot be checked: {e}"),
                }
            })?;
            recheck(&image, o, provisioner)?;
            drop(image);
            match rbd::trash_remove_with_deadline(&io, &o.image_id, true, deadline) {
                Ok(()) => Ok(Removed::Removed),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(Removed::AlreadyGone),
                Err(e) if matches!(e.kind(), ErrorKind::HasSnapshots | ErrorKind::Busy) => {
                    Err(blocked(e))
                }
                Err(e) => Err(e.into()),
            }
        }
    }
}

/// A Vault key whose image is gone but whose removal from the KMS was not
/// confirmed: a delete cut short between the two
/// ([`crate::volume::encryption::KEYS_TO_REMOVE`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KmsLeftover {
    /// The volume or snapshot handle the key belonged to.
    pub handle: String,
    /// The KMS, the key's id there, and the tenant.
    pub key: crate::volume::encryption::KeyToRemove,
}

/// The [`KmsLeftover`]s noted in one pool (and RADOS namespace): notes
/// whose image no longer exists. A note whose image still exists belongs
/// to a delete not done yet, and is left out.
pub fn kms_leftovers(
    cluster: &Cluster,
    cluster_id: &str,
    pool: &str,
    namespace: &str,
) -> crate::Result<Vec<KmsLeftover>> {
    let place = VolumeId {
        cluster_id: cluster_id.to_owned(),
        pool: pool.to_owned(),
        rados_namespace: namespace.to_owned(),
        image: String::new(),
    };
    let notes = crate::volume::encryption::keys_to_remove(cluster, &place, None)?;
    if notes.is_empty() {
        return Ok(Vec::new());
    }
    let io = cluster.ioctx_ns(pool, namespace)?;
    let mut out = Vec::new();
    for (handle, key) in notes {
        let image = VolumeId::parse(&handle)
            .map(|v| v.image)
            .or_else(|_| crate::volume::SnapshotId::parse(&handle).map(|s| s.image));
        let gone = match image {
            Ok(name) => match Image::open_read_only(&io, &name) {
                Ok(_) => false,
                Err(e) if e.kind() == ErrorKind::NotFound => true,
                Err(e) => return Err(e),
            },
            Err(_) => true,
        };
        if gone {
            out.push(KmsLeftover { handle, key });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn owned(kind: Kind, image: &str, pv: &str) -> Owned {
        Owned {
            kind,
            volume: VolumeId {
                cluster_id: "c".into(),
                pool: "rbd".into(),
                rados_namespace: String::new(),
                image: image.into(),
            },
            image_id: "id".into(),
            pv_name: pv.into(),
            claim: "ns/c".into(),
            snap: None,
        }
    }

    #[test]
    fn only_complete_records_of_this_provisioner_and_cluster_are_ours() {
        let full = meta(&[
            (META_PROVISIONER, "p"),
            (META_PV, "pvc-1"),
            (META_PVC_NAMESPACE, "ns"),
            (META_PVC_NAME, "c"),
            (META_CLUSTER, "c1"),
        ]);
        assert_eq!(
            owner_of(&full, "p", "c1"),
            Some(("pvc-1".into(), "ns/c".into()))
        );
        assert_eq!(owner_of(&full, "other", "c1"), None);
        assert_eq!(owner_of(&full, "p", "c2"), None);
        assert_eq!(owner_of(&meta(&[(META_PROVISIONER, "p")]), "p", "c1"), None);
        assert_eq!(owner_of(&meta(&[(META_PV, "pvc-1")]), "p", "c1"), None);
        assert_eq!(owner_of(&BTreeMap::new(), "p", "c1"), None);
    }

    #[test]
    fn referenced_objects_are_not_selected() {
        let all = vec![
            owned(Kind::Orphan, "pvc-1", "pvc-1"),
            owned(Kind::Temp, "pvc-2.rbdkit-new", "pvc-2"),
            owned(Kind::Trash, "pvc-3", "pvc-3"),
            owned(Kind::Orphan, "pfx-pvc-4", "pvc-4"),
            owned(Kind::Temp, "pvc-5.rbdkit-new", "pvc-5"),
        ];
        let mut refs = References::default();
        // A PV by name; a claim being provisioned (by its pvc-<uid>).
        refs.pv_names.insert("pvc-1".into());
        refs.pv_names.insert("pvc-2".into());
        // A PV by handle (its image has a prefix).
        refs.volumes.insert(all[3].volume.clone());
        // A PV by handle whose temporary image is still there.
        refs.volumes.insert(VolumeId {
            image: "pvc-5".into(),
            ..all[4].volume.clone()
        });
        let picked: Vec<String> = select(&all, &refs)
            .into_iter()
            .map(|o| o.volume.image)
            .collect();
        assert_eq!(picked, vec!["pvc-3"]);
        assert_eq!(all[1].final_name(), "pvc-2");
    }
}
