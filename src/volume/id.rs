//! The volume handle: which cluster, pool, namespace and image a volume is;
//! and [`image_base`], the image name a request name gives.
//!
//! The same handle is the PV's `volumeHandle` and the CSI `volume_id`, so
//! the provisioner and the CSI driver can each work on the other's volumes.

use std::fmt;

/// Version tag at the start of every volume handle this code writes.
const HANDLE_VERSION: &str = "rbdkit1";

/// Where an image lives: cluster, pool, RADOS namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VolumeId {
    /// The clusters-config entry.
    pub cluster_id: String,
    /// The pool.
    pub pool: String,
    /// The RADOS namespace (empty for the default one).
    pub rados_namespace: String,
    /// The image name.
    pub image: String,
}

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rados_namespace.is_empty() {
            write!(f, "{}:{}/{}", self.cluster_id, self.pool, self.image)
        } else {
            write!(
                f,
                "{}:{}/{}/{}",
                self.cluster_id, self.pool, self.rados_namespace, self.image
            )
        }
    }
}

impl VolumeId {
    /// The `volumeHandle`: `rbdkit1/<cluster>/<pool>/<namespace>/<image>`,
    /// each part with `%` and `/` percent-encoded.
    pub fn handle(&self) -> String {
        format!(
            "{HANDLE_VERSION}/{}/{}/{}/{}",
            escape(&self.cluster_id),
            escape(&self.pool),
            escape(&self.rados_namespace),
            escape(&self.image)
        )
    }

    /// Reads a handle made by [`VolumeId::handle`].
    pub fn parse(handle: &str) -> Result<VolumeId, String> {
        let parts: Vec<&str> = handle.split('/').collect();
        match parts.as_slice() {
            [HANDLE_VERSION, cluster, pool, ns, image] => {
                let id = VolumeId {
                    cluster_id: unescape(cluster)?,
                    pool: unescape(pool)?,
                    rados_namespace: unescape(ns)?,
                    image: unescape(image)?,
                };
                if id.cluster_id.is_empty() || id.pool.is_empty() || id.image.is_empty() {
                    return Err(format!("volume handle {handle:?} has an empty part"));
                }
                Ok(id)
            }
            _ => Err(format!(
                "volume handle {handle:?} is not {HANDLE_VERSION}/cluster/pool/namespace/image"
            )),
        }
    }
}

/// Version tag at the start of every snapshot handle this code writes.
const SNAP_HANDLE_VERSION: &str = "rbdkit1-snap";

/// Where a snapshot lives: the snapshot image (a clone of the source
/// volume, see [`crate::volume::snapshot`]) and the RBD snapshot on it that
/// restores are cloned from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SnapshotId {
    /// The clusters-config entry.
    pub cluster_id: String,
    /// The pool.
    pub pool: String,
    /// The RADOS namespace (empty for the default one).
    pub rados_namespace: String,
    /// The snapshot image's name.
    pub image: String,
    /// The RBD snapshot's name on that image.
    pub snap: String,
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.image_id(), self.snap)
    }
}

impl SnapshotId {
    /// The snapshot handle (CSI `snapshot_id`, `snapshotHandle`):
    /// `rbdkit1-snap/<cluster>/<pool>/<namespace>/<image>@<snap>`, each part
    /// with `%`, `/` and `@` percent-encoded.
    pub fn handle(&self) -> String {
        format!(
            "{SNAP_HANDLE_VERSION}/{}/{}/{}/{}@{}",
            escape_snap(&self.cluster_id),
            escape_snap(&self.pool),
            escape_snap(&self.rados_namespace),
            escape_snap(&self.image),
            escape_snap(&self.snap)
        )
    }

    /// Reads a handle made by [`SnapshotId::handle`]; anything else (a
    /// volume handle included) is refused.
    pub fn parse(handle: &str) -> Result<SnapshotId, String> {
        let bad = || {
            format!(
                "snapshot handle {handle:?} is not {SNAP_HANDLE_VERSION}/cluster/pool/namespace/image@snapshot"
            )
        };
        let parts: Vec<&str> = handle.split('/').collect();
        let [SNAP_HANDLE_VERSION, cluster, pool, ns, last] = parts.as_slice() else {
            return Err(bad());
        };
        if last.matches('@').count() != 1 || [cluster, pool, ns].iter().any(|p| p.contains('@')) {
            return Err(bad());
        }
        let (image, snap) = last.split_once('@').ok_or_else(bad)?;
        let id = SnapshotId {
            cluster_id: unescape(cluster)?,
            pool: unescape(pool)?,
            rados_namespace: unescape(ns)?,
            image: unescape(image)?,
            snap: unescape(snap)?,
        };
        if id.cluster_id.is_empty()
            || id.pool.is_empty()
            || id.image.is_empty()
            || id.snap.is_empty()
        {
            return Err(format!("snapshot handle {handle:?} has an empty part"));
        }
        Ok(id)
    }

    /// The snapshot image as a [`VolumeId`] (same cluster, pool, namespace).
    pub fn image_id(&self) -> VolumeId {
        VolumeId {
            cluster_id: self.cluster_id.clone(),
            pool: self.pool.clone(),
            rados_namespace: self.rados_namespace.clone(),
            image: self.image.clone(),
        }
    }
}

/// Version tag at the start of every group snapshot handle this code writes.
const GROUP_SNAP_HANDLE_VERSION: &str = "rbdkit1-gsnap";

/// Where a volume group snapshot lives: the pool and RADOS namespace of its
/// members, and the group snapshot's name, from which the RBD group taken
/// for it and each member's snapshot image are named
/// ([`GroupSnapshotId::member`]).
///
/// A member is an ordinary snapshot ([`SnapshotId`]): restoring one into a
/// volume, or deleting it alone, goes through the single-snapshot path.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupSnapshotId {
    /// The clusters-config entry.
    pub cluster_id: String,
    /// The pool of every member.
    pub pool: String,
    /// The RADOS namespace of every member (empty for the default one).
    pub rados_namespace: String,
    /// The group snapshot's name (also the RBD group's).
    pub name: String,
}

impl fmt::Display for GroupSnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rados_namespace.is_empty() {
            write!(f, "{}:{}/{} (group)", self.cluster_id, self.pool, self.name)
        } else {
            write!(
                f,
                "{}:{}/{}/{} (group)",
                self.cluster_id, self.pool, self.rados_namespace, self.name
            )
        }
    }
}

impl GroupSnapshotId {
    /// The CSI `group_snapshot_id`:
    /// `rbdkit1-gsnap/<cluster>/<pool>/<namespace>/<name>`, each part with
    /// `%` and `/` percent-encoded.
    pub fn handle(&self) -> String {
        format!(
            "{GROUP_SNAP_HANDLE_VERSION}/{}/{}/{}/{}",
            escape(&self.cluster_id),
            escape(&self.pool),
            escape(&self.rados_namespace),
            escape(&self.name)
        )
    }

    /// Reads a handle made by [`GroupSnapshotId::handle`]; anything else
    /// (a volume or snapshot handle included) is refused.
    pub fn parse(handle: &str) -> Result<GroupSnapshotId, String> {
        let parts: Vec<&str> = handle.split('/').collect();
        let [GROUP_SNAP_HANDLE_VERSION, cluster, pool, ns, name] = parts.as_slice() else {
            return Err(format!(
                "group snapshot handle {handle:?} is not {GROUP_SNAP_HANDLE_VERSION}/cluster/pool/namespace/name"
            ));
        };
        let id = GroupSnapshotId {
            cluster_id: unescape(cluster)?,
            pool: unescape(pool)?,
            rados_namespace: unescape(ns)?,
            name: unescape(name)?,
        };
        if id.cluster_id.is_empty() || id.pool.is_empty() || id.name.is_empty() {
            return Err(format!(
                "group snapshot handle {handle:?} has an empty part"
            ));
        }
        Ok(id)
    }

    /// The snapshot of member `source` (a volume in this group snapshot's
    /// pool and namespace): the snapshot image `<name>-<source image>` (or a
    /// stable hash of that, see [`image_base`]) and its snapshot `snap`.
    /// Derived from the request alone, so a re-run finds what an earlier
    /// attempt made, and parseable by [`SnapshotId::parse`] as any snapshot.
    pub fn member(&self, source: &VolumeId, snap: &str) -> SnapshotId {
        SnapshotId {
            cluster_id: self.cluster_id.clone(),
            pool: self.pool.clone(),
            rados_namespace: self.rados_namespace.clone(),
            image: image_base(&format!("{}-{}", self.name, source.image)),
            snap: snap.to_owned(),
        }
    }
}

/// The image name for a request name (a CSI request's, or a snapshot
/// content's): the name itself when it is a safe image name, else a stable
/// hash of it. Deterministic, so a retried request finds the image the
/// first attempt made, whichever front end made it.
pub fn image_base(name: &str) -> String {
    let safe = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if safe {
        return name.to_owned();
    }
    // 128-bit FNV-1a: stable across releases and platforms.
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for b in name.bytes() {
        h ^= u128::from(b);
        h = h.wrapping_mul(0x0000000001000000000000000000013B);
    }
    format!("csi-vol-{h:032x}")
}

fn escape(s: &str) -> String {
    s.replace('%', "%25").replace('/', "%2F")
}

/// [`escape`] that also encodes `@`, the separator of a snapshot handle.
fn escape_snap(s: &str) -> String {
    escape(s).replace('@', "%40")
}

fn unescape(s: &str) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        match rest.get(i + 1..i + 3) {
            Some("25") => out.push('%'),
            Some("2F") | Some("2f") => out.push('/'),
            Some("40") => out.push('@'),
            _ => return Err(format!("bad escape in volume handle part {s:?}")),
        }
        rest = &rest[i + 3..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_handles_round_trip() {
        let id = VolumeId {
            cluster_id: "fsid-1".into(),
            pool: "rbd".into(),
            rados_namespace: "".into(),
            image: "pvc-1".into(),
        };
        assert_eq!(id.handle(), "rbdkit1/fsid-1/rbd//pvc-1");
        assert_eq!(VolumeId::parse(&id.handle()).unwrap(), id);
        let odd = VolumeId {
            cluster_id: "a/b%c".into(),
            pool: "p%2F".into(),
            rados_namespace: "ns/1".into(),
            image: "i".into(),
        };
        assert_eq!(VolumeId::parse(&odd.handle()).unwrap(), odd);
        for bad in [
            "",
            "rbdkit1/a/b/c",
            "rbdkit2/a/b/c/d",
            "rbdkit1/a/b/c/d/e",
            "rbdkit1//b/c/d",
            "rbdkit1/a/b/c/%zz",
        ] {
            assert!(VolumeId::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn snapshot_handles_round_trip_and_parse_strictly() {
        let id = SnapshotId {
            cluster_id: "fsid-1".into(),
            pool: "rbd".into(),
            rados_namespace: "".into(),
            image: "snapshot-1".into(),
            snap: "rbdkit".into(),
        };
        assert_eq!(id.handle(), "rbdkit1-snap/fsid-1/rbd//snapshot-1@rbdkit");
        assert_eq!(SnapshotId::parse(&id.handle()).unwrap(), id);
        let odd = SnapshotId {
            cluster_id: "a/b".into(),
            pool: "p@q".into(),
            rados_namespace: "ns%1".into(),
            image: "i@j".into(),
            snap: "s/t@u".into(),
        };
        assert_eq!(SnapshotId::parse(&odd.handle()).unwrap(), odd);
        let vol = id.image_id().handle();
        for bad in [
            "",
            vol.as_str(),
            "rbdkit1-snap/a/b/c/d",
            "rbdkit1-snap/a/b/c/d@",
            "rbdkit1-snap/a/b/c/@s",
            "rbdkit1-snap/a/b/c/d@s@t",
            "rbdkit1-snap/a@x/b/c/d@s",
            "rbdkit1-snap/a/b/c/d/e@s",
            "rbdkit1-snap//b/c/d@s",
            "rbdkit2-snap/a/b/c/d@s",
            "rbdkit1-snap/a/b/c/%zz@s",
        ] {
            assert!(SnapshotId::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn group_snapshot_handles_round_trip_and_members_are_snapshots() {
        let g = GroupSnapshotId {
            cluster_id: "fsid-1".into(),
            pool: "rbd".into(),
            rados_namespace: "".into(),
            name: "groupsnapshot-1".into(),
        };
        assert_eq!(g.handle(), "rbdkit1-gsnap/fsid-1/rbd//groupsnapshot-1");
        assert_eq!(GroupSnapshotId::parse(&g.handle()).unwrap(), g);
        let odd = GroupSnapshotId {
            cluster_id: "a/b".into(),
            pool: "p%q".into(),
            rados_namespace: "ns/1".into(),
            name: "n@m".into(),
        };
        assert_eq!(GroupSnapshotId::parse(&odd.handle()).unwrap(), odd);
        let vol = VolumeId {
            cluster_id: "fsid-1".into(),
            pool: "rbd".into(),
            rados_namespace: "".into(),
            image: "pvc-1".into(),
        };
        let m = g.member(&vol, "rbdkit");
        assert_eq!(m.image, "groupsnapshot-1-pvc-1");
        assert_eq!(SnapshotId::parse(&m.handle()).unwrap(), m);
        // A name that is no safe image name still gives one, stably.
        let mut long = g.clone();
        long.name = "x".repeat(250);
        let lm = long.member(&vol, "rbdkit");
        assert!(lm.image.starts_with("csi-vol-"), "{}", lm.image);
        assert_eq!(lm, long.member(&vol, "rbdkit"));
        for bad in [
            "",
            "fake-vol-id",
            vol.handle().as_str(),
            m.handle().as_str(),
            "rbdkit1-gsnap/a/b/c",
            "rbdkit1-gsnap/a/b/c/d/e",
            "rbdkit1-gsnap//b/c/d",
            "rbdkit1-gsnap/a/b/c/",
            "rbdkit1-gsnap/a/b/c/%zz",
        ] {
            assert!(GroupSnapshotId::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn request_names_map_to_stable_safe_image_names() {
        assert_eq!(image_base("pvc-1234"), "pvc-1234");
        let odd = image_base("sanity/with spaces@x");
        assert!(odd.starts_with("csi-vol-") && odd.len() == 8 + 32, "{odd}");
        assert_eq!(odd, image_base("sanity/with spaces@x"));
        assert_ne!(odd, image_base("sanity/with spaces@y"));
        assert!(image_base(&"a".repeat(300)).starts_with("csi-vol-"));
    }
}
