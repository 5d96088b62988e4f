//! Quality of service: per-image I/O limits, set from a
//! VolumeAttributesClass (CSI `mutable_parameters`) or a StorageClass, with
//! ceph-csi's parameter names.
//!
//! A limit is kept twice in the image's metadata:
//! - the **policy** as given (`rbdkit.qos.<parameter>`: base, cap, per-GiB
//!   growth), so an expansion can compute it again for the new size;
//! - the **effective limit** as librbd's per-image config override
//!   (`conf_rbd_qos_<kind>_limit`). Every librbd client reads those when
//!   it opens the image and again when the header changes, so
//!   rbdkit-fuse's mapper applies a change to a mapped volume at once. The
//!   kernel client (krbd) ignores them: a krbd volume is not limited.
//!
//! Parameters, per kind (`Iops`, `ReadIops`, `WriteIops`, `Bps`, `ReadBps`,
//! `WriteBps`): `base<Kind>`, `max<Kind>`, `<kind>PerGiB`, plus one
//! `baseVolSizeBytes`. The limit is `base`, grown by `perGiB` for every
//! whole GiB the image has above `baseVolSizeBytes`, capped at `max`; a
//! `max` alone is the limit itself (ceph-csi's cgroup form). Each value is
//! a whole number above 0, or `max` to remove a limit set before. A
//! parameter a request leaves out keeps its value (the CSI spec: no change
//! from the absence of a key); a new volume starts from its request alone.
//!
//! Applying is idempotent and crash-safe: it writes only what differs, one
//! key at a time, policy first, so a re-run after a kill converges.

use std::collections::BTreeMap;
use std::fmt;

use crate::rados::Cluster;
use crate::rbd::Image;
use crate::volume::ops::{self, fenced, timed, VolumeError};
use crate::volume::params::ParamError;
use crate::volume::{CephObserver, Fence, VolumeId};

/// The image-metadata prefix of the stored policy.
pub const POLICY_PREFIX: &str = "rbdkit.qos.";
/// `baseVolSizeBytes`: the size the per-GiB growth starts above.
pub const BASE_VOL_SIZE: &str = "baseVolSizeBytes";

const GIB: u64 = 1 << 30;

/// One kind of limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// Reads and writes per second, together.
    Iops,
    /// Reads per second.
    ReadIops,
    /// Writes per second.
    WriteIops,
    /// Bytes per second, read and written together.
    Bps,
    /// Bytes read per second.
    ReadBps,
    /// Bytes written per second.
    WriteBps,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 6] = [
        Kind::Iops,
        Kind::ReadIops,
        Kind::WriteIops,
        Kind::Bps,
        Kind::ReadBps,
        Kind::WriteBps,
    ];

    /// The parameter names: base, cap, per-GiB growth.
    pub fn params(self) -> [&'static str; 3] {
        match self {
            Kind::Iops => ["baseIops", "maxIops", "iopsPerGiB"],
            Kind::ReadIops => ["baseReadIops", "maxReadIops", "readIopsPerGiB"],
            Kind::WriteIops => ["baseWriteIops", "maxWriteIops", "writeIopsPerGiB"],
            Kind::Bps => ["baseBps", "maxBps", "bpsPerGiB"],
            Kind::ReadBps => ["baseReadBps", "maxReadBps", "readBpsPerGiB"],
            Kind::WriteBps => ["baseWriteBps", "maxWriteBps", "writeBpsPerGiB"],
        }
    }

    /// The librbd option that enforces it.
    pub fn librbd_option(self) -> &'static str {
        match self {
            Kind::Iops => "rbd_qos_iops_limit",
            Kind::ReadIops => "rbd_qos_read_iops_limit",
            Kind::WriteIops => "rbd_qos_write_iops_limit",
            Kind::Bps => "rbd_qos_bps_limit",
            Kind::ReadBps => "rbd_qos_read_bps_limit",
            Kind::WriteBps => "rbd_qos_write_bps_limit",
        }
    }

    /// The image-metadata key of the effective limit (`conf_` + option).
    pub fn conf_key(self) -> String {
        format!("conf_{}", self.librbd_option())
    }
}

/// The StorageClass parameters of older ceph-csi releases and the
/// VolumeAttributesClass names they stand for.
pub const CLASS_ALIASES: &[(&str, &str)] = &[
    ("BaseReadIops", "baseReadIops"),
    ("BaseWriteIops", "baseWriteIops"),
    ("BaseReadBytesPerSecond", "baseReadBps"),
    ("BaseWriteBytesPerSecond", "baseWriteBps"),
    ("ReadIopsPerGiB", "readIopsPerGiB"),
    ("WriteIopsPerGiB", "writeIopsPerGiB"),
    ("ReadBpsPerGiB", "readBpsPerGiB"),
    ("WriteBpsPerGiB", "writeBpsPerGiB"),
    ("BaseVolSizeBytes", BASE_VOL_SIZE),
];

/// Keys external-resizer adds with `--extra-modify-metadata`: accepted and
/// without effect.
const EXTRA_METADATA: &[&str] = &[
    "csi.storage.k8s.io/pvc/name",
    "csi.storage.k8s.io/pvc/namespace",
    "csi.storage.k8s.io/pv/name",
];

/// Every parameter name this module knows.
pub fn parameter_names() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = Kind::ALL.iter().flat_map(|k| k.params()).collect();
    v.push(BASE_VOL_SIZE);
    v
}

/// One parameter's value: a number, or `max` (no limit: remove it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// A whole number above 0.
    Value(u64),
    /// `max`: no limit.
    Unlimited,
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Setting::Value(v) => write!(f, "{v}"),
            Setting::Unlimited => f.write_str("max"),
        }
    }
}

fn parse_setting(key: &str, value: &str) -> Result<Setting, ParamError> {
    let v = value.trim();
    if v == "max" {
        return Ok(Setting::Unlimited);
    }
    let n: u64 = v.parse().map_err(|_| ParamError {
        param: key.to_owned(),
        why: format!("{value:?} is not a whole number or \"max\""),
    })?;
    if n == 0 {
        return Err(ParamError {
            param: key.to_owned(),
            why: "0 is refused: librbd reads it as no limit and the kernel's io.max as no I/O at all; use \"max\" to remove a limit".into(),
        });
    }
    if n > i64::MAX as u64 {
        return Err(ParamError {
            param: key.to_owned(),
            why: format!("{n} is too large"),
        });
    }
    Ok(Setting::Value(n))
}

/// A QoS policy: parameter name → setting. Empty means "no QoS asked for".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy(BTreeMap<&'static str, Setting>);

impl Policy {
    /// Whether it names no parameter.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The setting of `param`, if given.
    pub fn get(&self, param: &str) -> Option<Setting> {
        self.0.get(param).copied()
    }

    /// Parses CSI `mutable_parameters` (a VolumeAttributesClass's
    /// parameters): every key must be a QoS parameter (or
    /// external-resizer's extra metadata). An unknown key is refused by
    /// name.
    pub fn from_mutable(params: &BTreeMap<String, String>) -> Result<Policy, ParamError> {
        let names = parameter_names();
        let mut out = Policy::default();
        for (key, value) in params {
            if EXTRA_METADATA.contains(&key.as_str()) {
                continue;
            }
            let Some(name) = names.iter().copied().find(|n| *n == key.as_str()) else {
                return Err(ParamError {
                    param: key.clone(),
                    why: format!(
                        "unknown or immutable parameter; the parameters a VolumeAttributesClass may set are {}",
                        names.join(", ")
                    ),
                });
            };
            out.0.insert(name, parse_setting(key, value)?);
        }
        // How they fit together is checked with what the image has
        // ([`apply`]), or for a new volume with its class ([`Policy::check`]).
        Ok(out)
    }

    /// The QoS parameters of a StorageClass (ceph-csi's older names, such as
    /// `BaseReadIops`); other keys are left to the class's own parser.
    pub fn from_class(params: &BTreeMap<String, String>) -> Result<Policy, ParamError> {
        let mut out = Policy::default();
        for &(alias, name) in CLASS_ALIASES {
            if let Some(v) = params.get(alias) {
                match parse_setting(alias, v)? {
                    Setting::Unlimited => {}
                    s => {
                        out.0.insert(name, s);
                    }
                }
            }
        }
        out.check().map_err(|mut e| {
            // Name the class's own key.
            if let Some((alias, _)) = CLASS_ALIASES.iter().find(|(_, n)| *n == e.param) {
                e.param = (*alias).to_owned();
            }
            e
        })?;
        Ok(out)
    }

    /// `self` with `over`'s settings taking precedence.
    pub fn merged(&self, over: &Policy) -> Policy {
        let mut out = self.clone();
        for (k, v) in &over.0 {
            out.0.insert(*k, *v);
        }
        out
    }

    /// The settings that are numbers (what is stored).
    fn values(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        self.0.iter().filter_map(|(k, v)| match v {
            Setting::Value(n) => Some((*k, *n)),
            Setting::Unlimited => None,
        })
    }

    fn value(&self, param: &str) -> Option<u64> {
        match self.0.get(param) {
            Some(Setting::Value(n)) => Some(*n),
            _ => None,
        }
    }

    /// Whether any parameter of `kind` has a number.
    fn governs(&self, kind: Kind) -> bool {
        kind.params().iter().any(|p| self.value(p).is_some())
    }

    /// Checks that the numbers fit together: a per-GiB growth needs its
    /// base and `baseVolSizeBytes`; a base is not above its cap.
    pub fn check(&self) -> Result<(), ParamError> {
        for kind in Kind::ALL {
            let [base, max, per_gib] = kind.params();
            if self.value(per_gib).is_some() {
                if self.value(base).is_none() {
                    return Err(ParamError {
                        param: per_gib.to_owned(),
                        why: format!("needs {base}: the limit grows from it"),
                    });
                }
                if self.value(BASE_VOL_SIZE).is_none() {
                    return Err(ParamError {
                        param: per_gib.to_owned(),
                        why: format!("needs {BASE_VOL_SIZE}: the size the growth starts above"),
                    });
                }
            }
            if let (Some(b), Some(m)) = (self.value(base), self.value(max)) {
                if b > m {
                    return Err(ParamError {
                        param: base.to_owned(),
                        why: format!("{b} is above {max} ({m})"),
                    });
                }
            }
        }
        Ok(())
    }

    /// The effective limit of `kind` for an image of `size` bytes, if any.
    pub fn limit(&self, kind: Kind, size: u64) -> Option<u64> {
        let [base, max, per_gib] = kind.params();
        let cap = self.value(max);
        let Some(b) = self.value(base) else {
            return cap;
        };
        let mut limit = b;
        if let (Some(g), Some(from)) = (self.value(per_gib), self.value(BASE_VOL_SIZE)) {
            if size > from {
                limit = limit.saturating_add(((size - from) / GIB).saturating_mul(g));
            }
        }
        Some(cap.map_or(limit, |c| limit.min(c)))
    }

    /// Every effective limit for an image of `size` bytes.
    pub fn limits(&self, size: u64) -> Limits {
        Limits(
            Kind::ALL
                .iter()
                .filter_map(|k| self.limit(*k, size).map(|l| (*k, l)))
                .collect(),
        )
    }

    /// The policy stored in an image's metadata (unknown `rbdkit.qos.` keys
    /// and unreadable values are skipped).
    pub fn from_metadata(meta: &BTreeMap<String, String>) -> Policy {
        let names = parameter_names();
        let mut out = Policy::default();
        for (k, v) in meta {
            let Some(param) = k.strip_prefix(POLICY_PREFIX) else {
                continue;
            };
            if let (Some(name), Ok(n)) = (
                names.iter().copied().find(|n| *n == param),
                v.parse::<u64>(),
            ) {
                out.0.insert(name, Setting::Value(n));
            }
        }
        out
    }
}

/// Effective limits, per kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits(pub BTreeMap<Kind, u64>);

impl Limits {
    /// The limits an image's metadata enforces for librbd
    /// (`conf_rbd_qos_*_limit`; 0 or unreadable is no limit).
    pub fn from_metadata(meta: &BTreeMap<String, String>) -> Limits {
        Limits(
            Kind::ALL
                .iter()
                .filter_map(|k| {
                    let v: u64 = meta.get(&k.conf_key())?.trim().parse().ok()?;
                    (v > 0).then_some((*k, v))
                })
                .collect(),
        )
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The limit of `kind`.
    pub fn get(&self, kind: Kind) -> Option<u64> {
        self.0.get(&kind).copied()
    }
}

impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|(k, v)| format!("{}={v}", k.librbd_option()))
            .collect();
        f.write_str(&parts.join(" "))
    }
}

/// How [`apply`] combines the request with what the image has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// ControllerModifyVolume: parameters the request leaves out keep
    /// their stored value.
    Update,
    /// A new volume: the request alone (the limits a clone copied from
    /// its source go).
    Replace,
}

/// Applies `policy` to the open (read-write) `image`: stores the policy and
/// the effective limits for the image's size, removing those no longer
/// set. A policy that does not fit together (see [`Policy::check`]) is
/// [`VolumeError::Refused`], with nothing written. Returns the effective
/// limits.
pub fn apply(
    image: &Image,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    policy: &Policy,
    mode: Mode,
) -> Result<Limits, VolumeError> {
    let meta = timed(metrics, "metadata_list", || image.metadata_list())?;
    let stored = Policy::from_metadata(&meta);
    let target = match mode {
        Mode::Update => stored.merged(policy),
        Mode::Replace => policy.clone(),
    };
    target.check().map_err(|e| VolumeError::Refused {
        why: format!(
            "QoS parameter {:?}: {} (with what image {} already has: {})",
            e.param,
            e.why,
            image.spec(),
            describe(&stored)
        ),
    })?;
    let size = timed(metrics, "size", || image.size())?;
    let limits = target.limits(size);
    let object = image.spec();
    let mut writes: Vec<(String, Option<String>)> = Vec::new();
    // The policy first: a kill after it leaves what a re-run needs.
    let names = parameter_names();
    for name in &names {
        let key = format!("{POLICY_PREFIX}{name}");
        let want = target.value(name).map(|v| v.to_string());
        if meta.get(&key) != want.as_ref() {
            writes.push((key, want));
        }
    }
    for kind in Kind::ALL {
        // On a volume in use, a limit set by hand (`rbd config image set`)
        // that no policy of ours ever governed is left alone. A new volume
        // has only what its request asks for: a clone's copies of its
        // source's limits go.
        if mode == Mode::Update && !target.governs(kind) && !stored.governs(kind) {
            continue;
        }
        let key = kind.conf_key();
        let want = limits.get(kind).map(|v| v.to_string());
        if meta.get(&key) != want.as_ref() {
            writes.push((key, want));
        }
    }
    for (key, value) in writes {
        match value {
            Some(v) => {
                fenced(fence, "rbd_metadata_set", &object)?;
                timed(metrics, "metadata_set", || image.metadata_set(&key, &v))?;
            }
            None => {
                fenced(fence, "rbd_metadata_remove", &object)?;
                match timed(metrics, "metadata_remove", || image.metadata_remove(&key)) {
                    Ok(()) => {}
                    Err(e) if e.is_not_found() => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    Ok(limits)
}

/// [`apply`] to the image of `vol`, once it is proven the volume of
/// `provisioner`'s PV `pv_name` (an empty `pv_name`: an image cut short
/// before its owner record, which only its creator can name).
#[allow(clippy::too_many_arguments)]
pub fn apply_to_volume(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
    vol: &VolumeId,
    provisioner: &str,
    pv_name: &str,
    policy: &Policy,
    mode: Mode,
) -> Result<Limits, VolumeError> {
    let image = ops::open_owned(cluster, metrics, vol, provisioner, pv_name)?;
    let limits = apply(&image, metrics, fence, policy, mode)?;
    timed(metrics, "close", || image.close())?;
    Ok(limits)
}

/// Computes the effective limits again for the image's current size (after
/// an expansion), if it has a policy. Returns them, or `None` without one.
pub fn refresh(
    image: &Image,
    metrics: &dyn CephObserver,
    fence: &dyn Fence,
) -> Result<Option<Limits>, VolumeError> {
    let meta = timed(metrics, "metadata_list", || image.metadata_list())?;
    if Policy::from_metadata(&meta).is_empty() {
        return Ok(None);
    }
    apply(image, metrics, fence, &Policy::default(), Mode::Update).map(Some)
}

/// `name=value ...` of a policy's numbers, for messages (never a secret).
pub fn describe(policy: &Policy) -> String {
    let parts: Vec<String> = policy.values().map(|(k, v)| format!("{k}={v}")).collect();
    if parts.is_empty() {
        "no QoS".to_owned()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn ceph_csi_examples_give_the_limits_they_document() {
        // examples/rbd/volumeattributesclass.yaml: a 20 GiB base, +12 IOPS
        // and +209715 B/s per GiB above it, capped.
        let p = Policy::from_mutable(&map(&[
            ("baseIops", "1800"),
            ("maxIops", "10000"),
            ("baseBps", "104857600"),
            ("maxBps", "188743680"),
            ("iopsPerGiB", "12"),
            ("bpsPerGiB", "209715"),
            ("baseVolSizeBytes", "21474836480"),
        ]))
        .unwrap();
        assert_eq!(p.limit(Kind::Iops, 10 * GIB), Some(1800));
        assert_eq!(p.limit(Kind::Iops, 100 * GIB), Some(1800 + 80 * 12));
        // Whole GiB only.
        assert_eq!(p.limit(Kind::Iops, 21 * GIB - 1), Some(1800));
        assert_eq!(p.limit(Kind::Iops, 1000 * GIB), Some(10000));
        assert_eq!(p.limit(Kind::Bps, 100 * GIB), Some(104857600 + 80 * 209715));
        assert_eq!(p.limit(Kind::ReadIops, 100 * GIB), None);
        // examples/rbd/volumeattributesclass-cgroup.yaml: caps alone.
        let c = Policy::from_mutable(&map(&[
            ("maxReadIops", "1000"),
            ("maxWriteIops", "2000"),
            ("maxReadBps", "104857600"),
            ("maxWriteBps", "209715200"),
        ]))
        .unwrap();
        let l = c.limits(GIB);
        assert_eq!(l.get(Kind::ReadIops), Some(1000));
        assert_eq!(l.get(Kind::WriteBps), Some(209715200));
        assert_eq!(l.get(Kind::Iops), None);
    }

    #[test]
    fn bad_parameters_are_refused_by_name() {
        let e = Policy::from_mutable(&map(&[("XXX_FakeKey", "XXX_FakeValue")])).unwrap_err();
        assert_eq!(e.param, "XXX_FakeKey");
        assert!(e.why.contains("unknown or immutable"), "{}", e.why);
        // An immutable class parameter is not a mutable one.
        assert_eq!(
            Policy::from_mutable(&map(&[("pool", "rbd")]))
                .unwrap_err()
                .param,
            "pool"
        );
        for (k, v, why) in [
            ("baseIops", "0", "use \"max\""),
            ("baseIops", "-1", "not a whole number"),
            ("maxBps", "10M", "not a whole number"),
        ] {
            let e = Policy::from_mutable(&map(&[(k, v)])).unwrap_err();
            assert_eq!(e.param, k);
            assert!(e.why.contains(why), "{k}={v}: {}", e.why);
        }
        // How they fit together: checked on what the image will have.
        let checked = |pairs: &[(&str, &str)]| Policy::from_mutable(&map(pairs)).unwrap().check();
        let e = checked(&[("iopsPerGiB", "5")]).unwrap_err();
        assert_eq!(
            (e.param.as_str(), e.why.contains("needs baseIops")),
            ("iopsPerGiB", true)
        );
        let e = checked(&[("baseIops", "5"), ("iopsPerGiB", "5")]).unwrap_err();
        assert!(e.why.contains(BASE_VOL_SIZE), "{}", e.why);
        let e = checked(&[("baseIops", "500"), ("maxIops", "100")]).unwrap_err();
        assert_eq!(e.param, "baseIops");
        // external-resizer's extra metadata is no parameter.
        assert!(
            Policy::from_mutable(&map(&[("csi.storage.k8s.io/pvc/name", "c")]))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_request_keeps_what_it_leaves_out_and_max_removes() {
        let stored =
            Policy::from_mutable(&map(&[("maxReadIops", "100"), ("maxWriteIops", "50")])).unwrap();
        let change =
            Policy::from_mutable(&map(&[("maxReadIops", "200"), ("maxWriteIops", "max")])).unwrap();
        let m = stored.merged(&change);
        assert_eq!(m.limit(Kind::ReadIops, GIB), Some(200));
        assert_eq!(m.limit(Kind::WriteIops, GIB), None);
        assert_eq!(describe(&m), "maxReadIops=200");
    }

    #[test]
    fn storage_class_names_map_onto_the_same_policy() {
        let p = Policy::from_class(&map(&[
            ("BaseReadIops", "100"),
            ("ReadIopsPerGiB", "10"),
            ("BaseVolSizeBytes", "1073741824"),
            ("pool", "rbd"),
        ]))
        .unwrap();
        assert_eq!(p.limit(Kind::ReadIops, 3 * GIB), Some(120));
        let e = Policy::from_class(&map(&[("ReadIopsPerGiB", "10")])).unwrap_err();
        assert_eq!(e.param, "ReadIopsPerGiB");
    }

    #[test]
    fn metadata_round_trips() {
        let p = Policy::from_mutable(&map(&[("baseIops", "10"), ("maxIops", "max")])).unwrap();
        let meta: BTreeMap<String, String> = p
            .values()
            .map(|(k, v)| (format!("{POLICY_PREFIX}{k}"), v.to_string()))
            .chain([(Kind::Iops.conf_key(), "10".to_owned())])
            .collect();
        assert_eq!(
            Policy::from_metadata(&meta).get("baseIops"),
            Some(Setting::Value(10))
        );
        assert_eq!(Policy::from_metadata(&meta).get("maxIops"), None);
        assert_eq!(Limits::from_metadata(&meta).get(Kind::Iops), Some(10));
        assert_eq!(Kind::Iops.conf_key(), "conf_rbd_qos_iops_limit");
    }
}
