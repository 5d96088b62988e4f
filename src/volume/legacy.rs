//! PVs made by the RBD provisioners rbdkit replaces, and the way off them.
//!
//! Three shapes exist in old clusters:
//! - kubernetes-incubator's rbd-provisioner: `pv.kubernetes.io/provisioned-by:
//!   ceph.com/rbd` and a `spec.rbd` source (monitors, pool, image, user,
//!   secretRef, fsType, readOnly);
//! - the in-tree plugin: `kubernetes.io/rbd` (or no annotation at all, for a
//!   PV written by hand) and the same `spec.rbd`;
//! - rook's flex provisioner: `ceph.rook.io/block` and a `spec.flexVolume`
//!   whose driver is rook's (`ceph.rook.io/rook-ceph`, `rook.io/rook`, …)
//!   with options `pool`, `image`, `clusterNamespace` (older: `clusterName`),
//!   `dataBlockPool`, and `fsType` on the source.
//!
//! [`parse`] reads such a PV; [`resolve`] finds its cluster in the clusters
//! config: a rook PV's cluster namespace is taken as a clusterID (or mapped
//! with `--cluster-map`), an `spec.rbd` PV's monitors are matched against the
//! config's monitors. [`adopt_image`] gives the image rbdkit's owner record
//! so that delete and expand work on it; [`csi_pv`] builds the CSI PV that
//! replaces the old one. Legacy images live in the pool's default RADOS
//! namespace, whatever the clusters config says for new images.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, PersistentVolume, PersistentVolumeSpec,
};
use kube::api::ObjectMeta;

use crate::rados::Cluster;
use crate::volume::clusters::{monitor_list, ClustersConfig};
use crate::volume::ops::{self, timed, Owner, VolumeError, META_PROVISIONER, META_PV};
use crate::volume::params::SecretRef;
use crate::volume::pv::{annotate, secret_reference, PROVISIONED_BY, PV_FINALIZER};
use crate::volume::{CephObserver, Fence, VolumeId};

/// PV annotation: when and from what a PV was migrated (JSON).
pub const MIGRATED_FROM: &str = "rbdkit.io/migrated-from";
/// PV annotation while a migration runs: the reclaim policy to restore.
pub const ORIGINAL_RECLAIM_POLICY: &str = "rbdkit.io/migration-original-reclaim-policy";

/// Which system made a legacy PV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// kubernetes-incubator external-storage's rbd-provisioner.
    RbdProvisioner,
    /// The in-tree `kubernetes.io/rbd` plugin.
    InTree,
    /// rook's flex provisioner.
    RookFlex,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 3] = [Kind::RbdProvisioner, Kind::InTree, Kind::RookFlex];

    /// The provisioner name it put in `pv.kubernetes.io/provisioned-by`.
    pub fn provisioner(self) -> &'static str {
        match self {
            Kind::RbdProvisioner => "ceph.com/rbd",
            Kind::InTree => "kubernetes.io/rbd",
            Kind::RookFlex => "ceph.rook.io/block",
        }
    }

    /// The kind whose provisioner name this is.
    pub fn from_provisioner(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.provisioner() == name)
    }

    /// Parses `--adopt-legacy`'s comma-separated provisioner names.
    pub fn parse_list(list: &str) -> Result<BTreeSet<Kind>, String> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                Kind::from_provisioner(s).ok_or_else(|| {
                    format!(
                        "{s:?} is not a legacy RBD provisioner; expected one of {}",
                        Kind::ALL.map(Kind::provisioner).join(", ")
                    )
                })
            })
            .collect()
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.provisioner())
    }
}

/// Where a legacy PV says its cluster is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// `spec.rbd.monitors`.
    Monitors(Vec<String>),
    /// rook's `clusterNamespace` (or the older `clusterName`).
    Rook(String),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Monitors(m) => write!(f, "monitors {}", m.join(",")),
            Location::Rook(ns) => write!(f, "rook cluster {ns}"),
        }
    }
}

/// What a legacy PV says about its image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LegacyVolume {
    /// Who made it.
    pub kind: Kind,
    /// Which cluster.
    pub location: Location,
    /// The pool.
    pub pool: String,
    /// The image.
    pub image: String,
    /// The filesystem type, if the PV names one.
    pub fs_type: Option<String>,
    /// `readOnly` of the source.
    pub read_only: bool,
    /// rook's `dataBlockPool` (erasure-coded data pool), if any.
    pub data_pool: Option<String>,
    /// `spec.rbd.user`, if any.
    pub user: Option<String>,
    /// `spec.rbd.secretRef`, if any (it holds a `key`, not rbdkit's
    /// `userID`/`userKey`).
    pub secret: Option<SecretRef>,
}

/// Why a PV cannot be taken over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LegacyError {
    /// The PV was not made by any of the legacy systems.
    NotLegacy {
        /// The PV.
        pv: String,
        /// What it is instead.
        why: String,
    },
    /// It is, but a field it needs is missing.
    Malformed {
        /// The PV.
        pv: String,
        /// What is missing.
        why: String,
    },
    /// No cluster of the clusters config matches.
    ClusterNotFound {
        /// The PV.
        pv: String,
        /// What was looked for.
        why: String,
    },
    /// More than one cluster matches its monitors.
    Ambiguous {
        /// The PV.
        pv: String,
        /// The clusters that match.
        clusters: Vec<String>,
    },
}

impl fmt::Display for LegacyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LegacyError::NotLegacy { pv, why } => {
                write!(f, "PV {pv} is not a legacy RBD volume: {why}")
            }
            LegacyError::Malformed { pv, why } => write!(f, "PV {pv}: {why}"),
            LegacyError::ClusterNotFound { pv, why } => {
                write!(f, "PV {pv}: no cluster of the clusters config matches: {why}")
            }
            LegacyError::Ambiguous { pv, clusters } => write!(
                f,
                "PV {pv}: its monitors match several clusters of the clusters config ({}); pass --cluster-map or fix the config",
                clusters.join(", ")
            ),
        }
    }
}

impl std::error::Error for LegacyError {}

/// Whether a flex driver name is rook's (`ceph.rook.io/<name>` or
/// `rook.io/<name>`).
fn is_rook_driver(driver: &str) -> bool {
    ["ceph.rook.io/", "rook.io/"]
        .iter()
        .any(|p| driver.strip_prefix(p).is_some_and(|rest| !rest.is_empty()))
}

fn nonempty(s: Option<&String>) -> Option<String> {
    s.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
}

/// Reads a legacy PV. Anything else is [`LegacyError::NotLegacy`].
pub fn parse(pv: &PersistentVolume) -> Result<LegacyVolume, LegacyError> {
    let name = pv.metadata.name.clone().unwrap_or_default();
    let not = |why: String| LegacyError::NotLegacy {
        pv: name.clone(),
        why,
    };
    let bad = |why: &str| LegacyError::Malformed {
        pv: name.clone(),
        why: why.to_owned(),
    };
    let by = pv
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(PROVISIONED_BY))
        .map(String::as_str);
    let spec = pv
        .spec
        .as_ref()
        .ok_or_else(|| not("it has no spec".into()))?;
    if let Some(rbd) = &spec.rbd {
        let kind = match by {
            Some("ceph.com/rbd") => Kind::RbdProvisioner,
            // A PV written by hand for the in-tree plugin has no annotation.
            Some("kubernetes.io/rbd") | None => Kind::InTree,
            Some(other) => {
                return Err(not(format!(
                    "it has an rbd source but was provisioned by {other:?}"
                )))
            }
        };
        let monitors = monitor_list(&rbd.monitors);
        if monitors.is_empty() {
            return Err(bad("spec.rbd.monitors is empty"));
        }
        let image = nonempty(Some(&rbd.image)).ok_or_else(|| bad("spec.rbd.image is empty"))?;
        return Ok(LegacyVolume {
            kind,
            location: Location::Monitors(monitors),
            // The in-tree plugin's default pool.
            pool: nonempty(rbd.pool.as_ref()).unwrap_or_else(|| "rbd".to_owned()),
            image,
            fs_type: nonempty(rbd.fs_type.as_ref()),
            read_only: rbd.read_only.unwrap_or(false),
            data_pool: None,
            user: nonempty(rbd.user.as_ref()),
            secret: rbd.secret_ref.as_ref().and_then(|s| {
                Some(SecretRef {
                    name: nonempty(s.name.as_ref())?,
                    namespace: nonempty(s.namespace.as_ref()).unwrap_or_default(),
                })
            }),
        });
    }
    if let Some(flex) = &spec.flex_volume {
        if !is_rook_driver(&flex.driver) {
            return Err(not(format!(
                "its flexVolume driver {:?} is not rook's",
                flex.driver
            )));
        }
        if by.is_some_and(|b| b != "ceph.rook.io/block") {
            return Err(not(format!(
                "it has a rook flexVolume source but was provisioned by {:?}",
                by.unwrap_or_default()
            )));
        }
        let opts = flex.options.clone().unwrap_or_default();
        let cluster = nonempty(opts.get("clusterNamespace"))
            .or_else(|| nonempty(opts.get("clusterName")))
            .ok_or_else(|| bad("the flexVolume options name no clusterNamespace or clusterName"))?;
        let pool = nonempty(opts.get("pool"))
            .or_else(|| nonempty(opts.get("blockPool")))
            .ok_or_else(|| bad("the flexVolume options name no pool"))?;
        let image = nonempty(opts.get("image"))
            .ok_or_else(|| bad("the flexVolume options name no image"))?;
        return Ok(LegacyVolume {
            kind: Kind::RookFlex,
            location: Location::Rook(cluster),
            pool,
            image,
            fs_type: nonempty(flex.fs_type.as_ref()).or_else(|| nonempty(opts.get("fsType"))),
            read_only: flex.read_only.unwrap_or(false),
            data_pool: nonempty(opts.get("dataBlockPool")),
            user: None,
            secret: None,
        });
    }
    if spec.csi.is_some() {
        return Err(not("it is already a CSI volume".into()));
    }
    Err(not(
        "it has neither an rbd nor a rook flexVolume source".into()
    ))
}

/// One monitor endpoint, normalised: lowercase host without brackets, port.
pub type Endpoint = (String, u16);

/// The endpoints of a monitor list entry: `host`, `host:port`, `[v6]:port`,
/// `v1:host:port`, `v2:host:port/nonce`, `[v2:…,v1:…]`, or several of
/// them separated by `,`, `;` or spaces. A host without a port stands for
/// both default ports (6789 for v1, 3300 for v2).
pub fn endpoints(monitors: &str) -> BTreeSet<Endpoint> {
    let mut out = BTreeSet::new();
    let lower = monitors.trim().to_ascii_lowercase();
    let mut rest = lower.as_str();
    // An addrvec `[v2:a:3300,v1:a:6789]` is a list of its own.
    if let Some(inner) = rest.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        if inner.starts_with("v1:") || inner.starts_with("v2:") || inner.starts_with("any:") {
            rest = inner;
        }
    }
    for part in rest.split([',', ';', ' ', '\t']) {
        let mut p = part.trim();
        if p.is_empty() {
            continue;
        }
        let mut default_ports: &[u16] = &[6789, 3300];
        for (prefix, port) in [("v1:", 6789u16), ("v2:", 3300), ("any:", 0)] {
            if let Some(r) = p.strip_prefix(prefix) {
                p = r;
                if port != 0 {
                    default_ports = if port == 6789 { &[6789] } else { &[3300] };
                }
            }
        }
        // A nonce after the port: `host:port/123`.
        let p = p.split('/').next().unwrap_or(p);
        let (host, port) = split_host_port(p);
        let host = host.trim_matches(['[', ']']).to_owned();
        if host.is_empty() {
            continue;
        }
        match port {
            Some(port) => {
                out.insert((host, port));
            }
            None => {
                for port in default_ports {
                    out.insert((host.clone(), *port));
                }
            }
        }
    }
    out
}

/// `host:port` → (host, port); `[v6]:port` and bare hosts (v6 included).
fn split_host_port(s: &str) -> (&str, Option<u16>) {
    if let Some(r) = s.strip_prefix('[') {
        if let Some((host, tail)) = r.split_once(']') {
            return (host, tail.strip_prefix(':').and_then(|p| p.parse().ok()));
        }
    }
    match s.rsplit_once(':') {
        // More than one colon without brackets: a bare IPv6 address.
        Some((host, _)) if host.contains(':') => (s, None),
        Some((host, port)) => match port.parse() {
            Ok(p) => (host, Some(p)),
            Err(_) => (s, None),
        },
        None => (s, None),
    }
}

/// The endpoints of a list of monitor entries.
pub fn all_endpoints(monitors: &[String]) -> BTreeSet<Endpoint> {
    monitors.iter().flat_map(|m| endpoints(m)).collect()
}

/// `NAMESPACE=CLUSTER_ID` pairs of `--cluster-map`.
pub fn parse_cluster_map(pairs: &[String]) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for p in pairs {
        let Some((ns, id)) = p
            .split_once('=')
            .map(|(a, b)| (a.trim(), b.trim()))
            .filter(|(a, b)| !a.is_empty() && !b.is_empty())
        else {
            return Err(format!(
                "--cluster-map {p:?}: expected NAMESPACE=CLUSTER_ID"
            ));
        };
        if out.insert(ns.to_owned(), id.to_owned()).is_some() {
            return Err(format!("--cluster-map names {ns:?} twice"));
        }
    }
    Ok(out)
}

/// The clusterID of a legacy volume in `config`.
pub fn resolve(
    pv: &str,
    legacy: &LegacyVolume,
    config: &ClustersConfig,
    cluster_map: &BTreeMap<String, String>,
) -> Result<String, LegacyError> {
    match &legacy.location {
        Location::Rook(ns) => {
            let id = cluster_map.get(ns).unwrap_or(ns);
            if config.get(id).is_some() {
                Ok(id.clone())
            } else if cluster_map.contains_key(ns) {
                Err(LegacyError::ClusterNotFound {
                    pv: pv.to_owned(),
                    why: format!("--cluster-map maps rook cluster {ns:?} to clusterID {id:?}, which the clusters config does not have"),
                })
            } else {
                Err(LegacyError::ClusterNotFound {
                    pv: pv.to_owned(),
                    why: format!("rook cluster namespace {ns:?} is not a clusterID of the clusters config; pass --cluster-map {ns}=CLUSTER_ID"),
                })
            }
        }
        Location::Monitors(mons) => {
            let wanted = all_endpoints(mons);
            let mut ids: Vec<String> = config
                .ids()
                .into_iter()
                .filter(|id| {
                    config
                        .get(id)
                        .is_some_and(|c| !all_endpoints(&c.monitors).is_disjoint(&wanted))
                })
                .collect();
            ids.sort();
            match ids.len() {
                1 => Ok(ids.remove(0)),
                0 => Err(LegacyError::ClusterNotFound {
                    pv: pv.to_owned(),
                    why: format!("no cluster has any of the monitors {}", mons.join(",")),
                }),
                _ => Err(LegacyError::Ambiguous {
                    pv: pv.to_owned(),
                    clusters: ids,
                }),
            }
        }
    }
}

/// The rbdkit volume a legacy PV's image is, once its cluster is known.
pub fn volume_id(legacy: &LegacyVolume, cluster_id: &str) -> VolumeId {
    VolumeId {
        cluster_id: cluster_id.to_owned(),
        pool: legacy.pool.clone(),
        rados_namespace: String::new(),
        image: legacy.image.clone(),
    }
}

/// What [`adopt_image`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adopted {
    /// The owner record was written now.
    Written,
    /// It was already there (a re-run).
    AlreadyOwned,
}

/// Gives the image of `vol` the owner record `owner`, as the provisioner
/// writes it (`rbd_metadata_set`), so that delete and expand accept it.
///
/// Refuses an image that does not exist ([`VolumeError::Missing`]) or
/// whose rbdkit record names another provisioner or PV
/// ([`VolumeError::NotOwned`]). The provisioner key is written last, so a
/// record cut short by a kill is completed by a re-run and is never taken
/// for a complete one.
pub fn adopt_image(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    vol: &VolumeId,
    owner: &Owner,
) -> Result<Adopted, VolumeError> {
    let image = ops::open_volume(cluster, metrics, vol)?;
    let meta = timed(metrics, "metadata_list", || image.metadata_list())?;
    let theirs = |k: &str, mine: &str| meta.get(k).is_some_and(|v| v != mine);
    if theirs(META_PROVISIONER, &owner.provisioner) || theirs(META_PV, &owner.pv_name) {
        return Err(VolumeError::NotOwned {
            image: vol.to_string(),
            why: format!(
                "its rbdkit owner record names provisioner {:?}, PV {:?}",
                meta.get(META_PROVISIONER).cloned().unwrap_or_default(),
                meta.get(META_PV).cloned().unwrap_or_default()
            ),
        });
    }
    let mut pairs = owner.pairs();
    // META_PROVISIONER is first in `pairs`: write it last.
    pairs.rotate_left(1);
    let mut wrote = false;
    for (k, v) in pairs {
        if meta.get(k).map(String::as_str) == Some(v) {
            continue;
        }
        ops::fenced(fence, "rbd_metadata_set", &vol.to_string())?;
        timed(metrics, "metadata_set", || image.metadata_set(k, v))?;
        wrote = true;
    }
    timed(metrics, "close", || image.close())?;
    Ok(if wrote {
        Adopted::Written
    } else {
        Adopted::AlreadyOwned
    })
}

/// What the CSI PV that replaces a legacy one refers to.
#[derive(Debug, Clone)]
pub struct CsiTarget<'a> {
    /// The CSI driver (rbdkit's provisioner name).
    pub driver: &'a str,
    /// The image.
    pub volume: &'a VolumeId,
    /// The Secret delete and expand use.
    pub secret: &'a SecretRef,
    /// The Secret the node stages with.
    pub node_secret: Option<&'a SecretRef>,
    /// The image's features, for the volume attributes.
    pub features: String,
    /// When the migration ran (RFC 3339).
    pub now: &'a str,
}

/// The CSI PV replacing `old` (the legacy PV `legacy` was read from):
/// same name, claimRef, capacity, access modes, volume mode, class, mount
/// options, labels and reclaim policy; a `spec.csi` source of `driver`;
/// rbdkit's provisioned-by and deletion-secret annotations, and
/// [`MIGRATED_FROM`] recording the old source. Status is left out.
pub fn csi_pv(
    old: &PersistentVolume,
    legacy: &LegacyVolume,
    t: &CsiTarget<'_>,
) -> PersistentVolume {
    let spec = old.spec.clone().unwrap_or_default();
    let mut annotations = old.metadata.annotations.clone().unwrap_or_default();
    annotate(&mut annotations, t.driver, t.secret);
    let source = if spec.rbd.is_some() {
        serde_json::json!({"rbd": spec.rbd})
    } else {
        serde_json::json!({"flexVolume": spec.flex_volume})
    };
    let record = serde_json::json!({
        "provisioner": legacy.kind.provisioner(),
        "at": t.now,
        "source": source,
    });
    annotations.insert(MIGRATED_FROM.to_owned(), record.to_string());

    let mut attributes = BTreeMap::from([
        ("clusterID".to_owned(), t.volume.cluster_id.clone()),
        ("pool".to_owned(), t.volume.pool.clone()),
        ("imageName".to_owned(), t.volume.image.clone()),
        (
            "radosNamespace".to_owned(),
            t.volume.rados_namespace.clone(),
        ),
        ("imageFeatures".to_owned(), t.features.clone()),
    ]);
    if let Some(dp) = &legacy.data_pool {
        attributes.insert("dataPool".to_owned(), dp.clone());
    }
    let block = spec.volume_mode.as_deref() == Some("Block");
    let mut finalizers: Vec<String> = old
        .metadata
        .finalizers
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter(|f| f == "kubernetes.io/pv-protection")
        .collect();
    finalizers.push(PV_FINALIZER.to_owned());
    let mut claim_ref = spec.claim_ref.clone();
    if let Some(r) = claim_ref.as_mut() {
        // The binder compares the uid only; an old resourceVersion is stale.
        r.resource_version = None;
    }
    PersistentVolume {
        metadata: ObjectMeta {
            name: old.metadata.name.clone(),
            labels: old.metadata.labels.clone(),
            annotations: Some(annotations),
            finalizers: Some(finalizers),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            access_modes: spec.access_modes.clone(),
            capacity: spec.capacity.clone(),
            claim_ref,
            csi: Some(CSIPersistentVolumeSource {
                driver: t.driver.to_owned(),
                volume_handle: t.volume.handle(),
                fs_type: (!block).then(|| legacy.fs_type.clone().unwrap_or_else(|| "ext4".into())),
                read_only: legacy.read_only.then_some(true),
                volume_attributes: Some(attributes),
                node_stage_secret_ref: t.node_secret.map(secret_reference),
                controller_expand_secret_ref: Some(secret_reference(t.secret)),
                ..Default::default()
            }),
            mount_options: spec.mount_options.clone(),
            node_affinity: spec.node_affinity.clone(),
            persistent_volume_reclaim_policy: spec.persistent_volume_reclaim_policy.clone(),
            storage_class_name: spec.storage_class_name.clone(),
            volume_mode: spec.volume_mode.clone(),
            ..Default::default()
        }),
        status: None,
    }
}

/// The legacy volume a PV is, if `adopt` names its kind and its cluster
/// resolves (the provisioner's `--adopt-legacy`). `None` for any other PV.
pub fn adoptable(
    pv: &PersistentVolume,
    adopt: &BTreeSet<Kind>,
    config: &ClustersConfig,
) -> Option<Result<(LegacyVolume, VolumeId), LegacyError>> {
    if adopt.is_empty() {
        return None;
    }
    let legacy = match parse(pv) {
        Ok(l) => l,
        Err(LegacyError::NotLegacy { .. }) => return None,
        Err(e) => return Some(Err(e)),
    };
    if !adopt.contains(&legacy.kind) {
        return None;
    }
    let name = pv.metadata.name.clone().unwrap_or_default();
    Some(resolve(&name, &legacy, config, &BTreeMap::new()).map(|id| {
        let vol = volume_id(&legacy, &id);
        (legacy, vol)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pv(v: serde_json::Value) -> PersistentVolume {
        serde_json::from_value(v).unwrap()
    }

    fn rbd_pv(by: Option<&str>) -> PersistentVolume {
        let mut ann = serde_json::Map::new();
        if let Some(b) = by {
            ann.insert(PROVISIONED_BY.into(), b.into());
        }
        pv(serde_json::json!({
            "metadata": {"name": "pvc-1", "annotations": ann},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "rbd": {
                    "monitors": ["10.0.0.1:6789", "10.0.0.2"],
                    "image": "kubernetes-dynamic-pvc-abc",
                    "pool": "kube",
                    "user": "kube",
                    "secretRef": {"name": "ceph-secret-user", "namespace": "default"},
                    "fsType": "xfs",
                },
            },
        }))
    }

    fn rook_pv(opts: serde_json::Value) -> PersistentVolume {
        pv(serde_json::json!({
            "metadata": {"name": "pvc-2", "annotations": {PROVISIONED_BY: "ceph.rook.io/block"}},
            "spec": {
                "flexVolume": {"driver": "ceph.rook.io/rook-ceph", "fsType": "ext4", "options": opts},
            },
        }))
    }

    fn config() -> ClustersConfig {
        ClustersConfig::parse(
            r#"[{"clusterID": "rook-ceph", "monitors": ["10.1.0.1:6789"]},
                {"clusterID": "east", "monitors": ["[v2:10.0.0.1:3300,v1:10.0.0.1:6789]", "10.0.0.3:6789"]},
                {"clusterID": "west", "monitors": ["10.9.0.1"]}]"#,
        )
        .unwrap()
    }

    #[test]
    fn parses_each_shape() {
        let l = parse(&rbd_pv(Some("ceph.com/rbd"))).unwrap();
        assert_eq!(l.kind, Kind::RbdProvisioner);
        assert_eq!(l.pool, "kube");
        assert_eq!(l.image, "kubernetes-dynamic-pvc-abc");
        assert_eq!(l.fs_type.as_deref(), Some("xfs"));
        assert_eq!(l.user.as_deref(), Some("kube"));
        assert_eq!(l.secret.as_ref().unwrap().name, "ceph-secret-user");
        assert_eq!(
            l.location,
            Location::Monitors(vec!["10.0.0.1:6789".into(), "10.0.0.2".into()])
        );
        assert_eq!(
            parse(&rbd_pv(Some("kubernetes.io/rbd"))).unwrap().kind,
            Kind::InTree
        );
        assert_eq!(parse(&rbd_pv(None)).unwrap().kind, Kind::InTree);

        let r = parse(&rook_pv(serde_json::json!({
            "clusterNamespace": "rook-ceph", "pool": "replicapool", "image": "pvc-9",
            "storageClass": "rook-ceph-block", "dataBlockPool": "ec"
        })))
        .unwrap();
        assert_eq!(r.kind, Kind::RookFlex);
        assert_eq!(r.location, Location::Rook("rook-ceph".into()));
        assert_eq!(
            (r.pool.as_str(), r.image.as_str()),
            ("replicapool", "pvc-9")
        );
        assert_eq!(r.data_pool.as_deref(), Some("ec"));
        assert_eq!(r.fs_type.as_deref(), Some("ext4"));
        // The older clusterName.
        let old = parse(&rook_pv(serde_json::json!({
            "clusterName": "rook", "pool": "replicapool", "image": "pvc-9"
        })))
        .unwrap();
        assert_eq!(old.location, Location::Rook("rook".into()));
    }

    #[test]
    fn refuses_what_is_not_legacy_or_incomplete() {
        let csi = pv(serde_json::json!({
            "metadata": {"name": "x"},
            "spec": {"csi": {"driver": "rbd.rbdkit.io", "volumeHandle": "h"}},
        }));
        assert!(matches!(parse(&csi), Err(LegacyError::NotLegacy { .. })));
        assert!(matches!(
            parse(&rbd_pv(Some("example.com/other"))),
            Err(LegacyError::NotLegacy { .. })
        ));
        let mut other_flex =
            rook_pv(serde_json::json!({"pool": "p", "image": "i", "clusterNamespace": "n"}));
        other_flex
            .spec
            .as_mut()
            .unwrap()
            .flex_volume
            .as_mut()
            .unwrap()
            .driver = "example.com/lvm".into();
        assert!(matches!(
            parse(&other_flex),
            Err(LegacyError::NotLegacy { .. })
        ));
        let e = parse(&rook_pv(serde_json::json!({"pool": "p", "image": "i"}))).unwrap_err();
        assert!(e.to_string().contains("clusterNamespace"), "{e}");
        let e = parse(&rook_pv(
            serde_json::json!({"clusterNamespace": "n", "pool": "p"}),
        ))
        .unwrap_err();
        assert!(e.to_string().contains("image"), "{e}");
        // Blank monitor entries are dropped (clusters::monitor_list): none left.
        let mut blank = rbd_pv(Some("ceph.com/rbd"));
        blank.spec.as_mut().unwrap().rbd.as_mut().unwrap().monitors = vec![" ".into(), "".into()];
        let e = parse(&blank).unwrap_err();
        assert!(e.to_string().contains("spec.rbd.monitors is empty"), "{e}");
    }

    #[test]
    fn normalises_monitor_forms() {
        let e = |s: &str| endpoints(s).into_iter().collect::<Vec<_>>();
        let h = |h: &str, p: u16| (h.to_owned(), p);
        assert_eq!(e("10.0.0.1:6789"), vec![h("10.0.0.1", 6789)]);
        assert_eq!(
            e("10.0.0.1"),
            vec![h("10.0.0.1", 3300), h("10.0.0.1", 6789)]
        );
        assert_eq!(
            e("[v2:10.0.0.1:3300/0,v1:10.0.0.1:6789/0]"),
            vec![h("10.0.0.1", 3300), h("10.0.0.1", 6789)]
        );
        assert_eq!(e("v1:Mon-A.example"), vec![h("mon-a.example", 6789)]);
        assert_eq!(e("[::1]:6789"), vec![h("::1", 6789)]);
        assert_eq!(e("fe80::1"), vec![h("fe80::1", 3300), h("fe80::1", 6789)]);
        assert_eq!(e("a:1, b:2;c:3"), vec![h("a", 1), h("b", 2), h("c", 3)]);
        assert!(e("  ").is_empty());
    }

    #[test]
    fn resolves_clusters() {
        let c = config();
        let none = BTreeMap::new();
        let rbd = parse(&rbd_pv(Some("ceph.com/rbd"))).unwrap();
        assert_eq!(resolve("pv", &rbd, &c, &none).unwrap(), "east");
        let rook = parse(&rook_pv(serde_json::json!({
            "clusterNamespace": "rook-ceph", "pool": "replicapool", "image": "pvc-9"
        })))
        .unwrap();
        assert_eq!(resolve("pv", &rook, &c, &none).unwrap(), "rook-ceph");
        let map = parse_cluster_map(&["rook-ceph=west".into()]).unwrap();
        assert_eq!(resolve("pv", &rook, &c, &map).unwrap(), "west");
        let bad_map = parse_cluster_map(&["rook-ceph=nowhere".into()]).unwrap();
        let e = resolve("pv", &rook, &c, &bad_map).unwrap_err();
        assert!(e.to_string().contains("nowhere"), "{e}");

        let mut lost = rook.clone();
        lost.location = Location::Rook("other-ns".into());
        let e = resolve("pv", &lost, &c, &none).unwrap_err();
        assert!(matches!(e, LegacyError::ClusterNotFound { .. }));
        assert!(e.to_string().contains("--cluster-map other-ns="), "{e}");

        let mut far = rbd.clone();
        far.location = Location::Monitors(vec!["192.168.0.1:6789".into()]);
        assert!(matches!(
            resolve("pv", &far, &c, &none),
            Err(LegacyError::ClusterNotFound { .. })
        ));
        // A bare host matches the default port of the other form.
        far.location = Location::Monitors(vec!["10.9.0.1:3300".into()]);
        assert_eq!(resolve("pv", &far, &c, &none).unwrap(), "west");

        let two = ClustersConfig::parse(
            r#"[{"clusterID": "a", "monitors": ["10.0.0.1:6789"]},
                {"clusterID": "b", "monitors": ["10.0.0.1"]}]"#,
        )
        .unwrap();
        let e = resolve("pv", &rbd, &two, &none).unwrap_err();
        assert_eq!(
            e,
            LegacyError::Ambiguous {
                pv: "pv".into(),
                clusters: vec!["a".into(), "b".into()]
            }
        );
        assert!(parse_cluster_map(&["x".into()]).is_err());
        assert!(parse_cluster_map(&["a=b".into(), "a=c".into()]).is_err());
    }

    #[test]
    fn builds_the_csi_pv() {
        let mut old = rbd_pv(Some("ceph.com/rbd"));
        old.metadata.finalizers = Some(vec!["kubernetes.io/pv-protection".into()]);
        let spec = old.spec.as_mut().unwrap();
        spec.claim_ref = Some(
            serde_json::from_value(serde_json::json!({
                "kind": "PersistentVolumeClaim", "namespace": "apps", "name": "data",
                "uid": "u-1", "resourceVersion": "77"
            }))
            .unwrap(),
        );
        spec.persistent_volume_reclaim_policy = Some("Retain".into());
        spec.storage_class_name = Some("rbd".into());
        spec.mount_options = Some(vec!["discard".into()]);
        let legacy = parse(&old).unwrap();
        let vol = volume_id(&legacy, "east");
        let secret = SecretRef {
            namespace: "ceph".into(),
            name: "prov".into(),
        };
        let node = SecretRef {
            namespace: "ceph".into(),
            name: "node".into(),
        };
        let new = csi_pv(
            &old,
            &legacy,
            &CsiTarget {
                driver: "rbd.rbdkit.io",
                volume: &vol,
                secret: &secret,
                node_secret: Some(&node),
                features: "layering".into(),
                now: "2026-01-01T00:00:00Z",
            },
        );
        assert_eq!(new.metadata.name.as_deref(), Some("pvc-1"));
        let ann = new.metadata.annotations.as_ref().unwrap();
        assert_eq!(ann[PROVISIONED_BY], "rbd.rbdkit.io");
        let rec: serde_json::Value = serde_json::from_str(&ann[MIGRATED_FROM]).unwrap();
        assert_eq!(rec["provisioner"], "ceph.com/rbd");
        assert_eq!(rec["source"]["rbd"]["image"], "kubernetes-dynamic-pvc-abc");
        let s = new.spec.as_ref().unwrap();
        assert!(s.rbd.is_none());
        let cref = s.claim_ref.as_ref().unwrap();
        assert_eq!(
            (cref.uid.as_deref(), cref.resource_version.as_deref()),
            (Some("u-1"), None)
        );
        assert_eq!(s.storage_class_name.as_deref(), Some("rbd"));
        assert_eq!(
            s.persistent_volume_reclaim_policy.as_deref(),
            Some("Retain")
        );
        assert_eq!(s.mount_options, Some(vec!["discard".to_owned()]));
        let csi = s.csi.as_ref().unwrap();
        assert_eq!(VolumeId::parse(&csi.volume_handle).unwrap(), vol);
        assert_eq!(csi.fs_type.as_deref(), Some("xfs"));
        assert_eq!(
            csi.volume_attributes.as_ref().unwrap()["radosNamespace"],
            ""
        );
        assert_eq!(
            csi.node_stage_secret_ref.as_ref().unwrap().name.as_deref(),
            Some("node")
        );
        assert_eq!(
            new.metadata.finalizers.as_ref().unwrap(),
            &vec![
                "kubernetes.io/pv-protection".to_owned(),
                PV_FINALIZER.to_owned()
            ]
        );
        assert!(crate::volume::pv::our_volume(&new, "rbd.rbdkit.io").is_some());
    }

    #[test]
    fn adoption_needs_the_flag_and_a_cluster() {
        let c = config();
        let rbd = rbd_pv(Some("ceph.com/rbd"));
        assert!(adoptable(&rbd, &BTreeSet::new(), &c).is_none());
        let only_rook = Kind::parse_list("ceph.rook.io/block").unwrap();
        assert!(adoptable(&rbd, &only_rook, &c).is_none());
        let both = Kind::parse_list("ceph.com/rbd, ceph.rook.io/block").unwrap();
        let (_, vol) = adoptable(&rbd, &both, &c).unwrap().unwrap();
        assert_eq!(
            (vol.cluster_id.as_str(), vol.pool.as_str()),
            ("east", "kube")
        );
        let rook =
            rook_pv(serde_json::json!({"clusterName": "rook-ceph", "pool": "p", "image": "i"}));
        let (_, vol) = adoptable(&rook, &both, &c).unwrap().unwrap();
        assert_eq!(vol.cluster_id, "rook-ceph");
        assert!(Kind::parse_list("ceph.com/cephfs").is_err());
    }

    proptest! {
        // Any spelling of the same monitor (bare, with its port, v1/v2
        // prefixed, in an addrvec, upper case) resolves to the same cluster.
        #[test]
        fn monitor_spellings_agree(a in 1u8..255, b in 1u8..255, form in 0usize..6, upper in any::<bool>()) {
            let host = format!("10.{a}.{b}.1");
            let spelled = match form {
                0 => host.clone(),
                1 => format!("{host}:6789"),
                2 => format!("v2:{host}:3300"),
                3 => format!("[v2:{host}:3300/0,v1:{host}:6789/0]"),
                4 => format!("v1:{host}:6789/123"),
                _ => format!("{host}:3300"),
            };
            let spelled = if upper { spelled.to_uppercase() } else { spelled };
            let config = ClustersConfig::parse(&format!(
                r#"[{{"clusterID": "c", "monitors": ["{host}"]}}, {{"clusterID": "d", "monitors": ["10.0.0.0:1"]}}]"#
            )).unwrap();
            let legacy = LegacyVolume {
                kind: Kind::InTree,
                location: Location::Monitors(vec![spelled]),
                pool: "rbd".into(), image: "i".into(), fs_type: None, read_only: false,
                data_pool: None, user: None, secret: None,
            };
            prop_assert_eq!(resolve("pv", &legacy, &config, &BTreeMap::new()).unwrap(), "c");
        }

        // Parsing never panics on arbitrary monitor text.
        #[test]
        fn endpoints_never_panic(s in ".{0,40}") {
            let _ = endpoints(&s);
        }
    }
}
