//! Topology: which pool a volume goes to, from where it must be reachable.
//!
//! A StorageClass's `topologyConstrainedPools` (ceph-csi's parameter, in its
//! JSON form) lists pools each reachable from one failure domain:
//!
//! ```json
//! [{"poolName": "pool-east-1", "dataPool": "ec-east-1",
//!   "domainSegments": [{"domainLabel": "region", "value": "east"},
//!                      {"domainLabel": "zone", "value": "zone1"}]}]
//! ```
//!
//! A CSI `CreateVolume` brings `accessibility_requirements`: topology terms
//! (segment maps such as `{"topology.rbd.rbdkit.io/zone": "zone1"}`), the
//! preferred ones in order, and the requisite ones. [`choose`] walks the
//! preferred terms, then the requisite ones, and takes the first pool whose
//! every domain segment the term has: a term's key matches a `domainLabel`
//! by its name after the first `/` (so `zone` matches
//! `topology.rbd.rbdkit.io/zone`, whatever the driver's prefix).
//!
//! The volume's accessible topology is the part of that term the pool's
//! segments matched (ceph-csi returns the whole term; a term that also
//! names the node would tie the volume to that one node).
//!
//! [`find_existing`] makes the choice crash-safe: an image of the request
//! already made (or half made) in another of the class's pools, by an
//! earlier attempt whose requirements differed, is found and kept, so a
//! re-run never makes a second one.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::rados::Cluster;
use crate::volume::ops::{check_owner, id_object_exists, ioctx, open_if_exists, TEMP_SUFFIX};
use crate::volume::params::{ClassParams, ParamError};
use crate::volume::{CephObserver, VolumeId};
use crate::ErrorKind;

/// `topologyConstrainedPools`: pools per failure domain (JSON).
pub const TOPOLOGY_CONSTRAINED_POOLS: &str = "topologyConstrainedPools";

/// A topology term: segment key to value.
pub type Segments = BTreeMap<String, String>;

/// One entry of `topologyConstrainedPools`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConstrainedPool {
    /// The pool for the image.
    pub pool: String,
    /// Its data pool, if any (replaces the class's `dataPool`).
    pub data_pool: Option<String>,
    /// The failure domain it serves: (domain label, value) pairs, all of
    /// which a term must have.
    pub segments: Vec<(String, String)>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawPool {
    pool_name: String,
    #[serde(default)]
    data_pool: Option<String>,
    #[serde(default)]
    domain_segments: Vec<RawSegment>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawSegment {
    domain_label: String,
    value: String,
}

fn bad(why: impl Into<String>) -> ParamError {
    ParamError {
        param: TOPOLOGY_CONSTRAINED_POOLS.to_owned(),
        why: why.into(),
    }
}

fn pool_name_ok(name: &str) -> bool {
    !name.is_empty() && !name.contains(['/', '@']) && name.trim() == name
}

/// Parses `topologyConstrainedPools`: a JSON array of `{"poolName",
/// "dataPool" (optional), "domainSegments": [{"domainLabel", "value"}]}`.
/// An empty value or `[]` is no constraint. Every error names the parameter
/// and the entry.
pub fn parse_constrained_pools(text: &str) -> Result<Vec<ConstrainedPool>, ParamError> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let raw: Vec<RawPool> = serde_json::from_str(text).map_err(|e| {
        bad(format!(
            "is not a JSON list of {{\"poolName\", \"dataPool\", \"domainSegments\": [{{\"domainLabel\", \"value\"}}]}}: {e}"
        ))
    })?;
    let mut out: Vec<ConstrainedPool> = Vec::new();
    for (i, p) in raw.into_iter().enumerate() {
        if !pool_name_ok(&p.pool_name) {
            return Err(bad(format!(
                "entry {i}: poolName {:?} is not a valid pool name",
                p.pool_name
            )));
        }
        if let Some(dp) = &p.data_pool {
            if !pool_name_ok(dp) {
                return Err(bad(format!(
                    "entry {i} ({}): dataPool {dp:?} is not a valid pool name",
                    p.pool_name
                )));
            }
        }
        if p.domain_segments.is_empty() {
            return Err(bad(format!(
                "entry {i} ({}): domainSegments is empty; name the failure domain the pool serves",
                p.pool_name
            )));
        }
        let mut segments: Vec<(String, String)> = Vec::new();
        for s in p.domain_segments {
            let label = s.domain_label.trim();
            if label.is_empty() || label.contains('/') || s.value.trim().is_empty() {
                return Err(bad(format!(
                    "entry {i} ({}): domain segment {:?}={:?} needs a label without '/' (such as \"zone\") and a value",
                    p.pool_name, s.domain_label, s.value
                )));
            }
            if segments.iter().any(|(l, _)| l == label) {
                return Err(bad(format!(
                    "entry {i} ({}): domainLabel {label:?} is given twice",
                    p.pool_name
                )));
            }
            segments.push((label.to_owned(), s.value.trim().to_owned()));
        }
        if out.iter().any(|o| o.pool == p.pool_name) {
            return Err(bad(format!(
                "entry {i}: pool {:?} is listed twice",
                p.pool_name
            )));
        }
        out.push(ConstrainedPool {
            pool: p.pool_name,
            data_pool: p.data_pool.filter(|d| !d.is_empty()),
            segments,
        });
    }
    Ok(out)
}

/// The domain a segment key names: its part after the first `/`
/// (`topology.rbd.rbdkit.io/zone` is `zone`), or the whole key.
pub fn domain_of(key: &str) -> &str {
    key.split_once('/').map_or(key, |(_, d)| d)
}

/// The segments of `term` that `pool` needs, if the term has all of them.
fn matched(pool: &ConstrainedPool, term: &Segments) -> Option<Segments> {
    let mut out = Segments::new();
    for (label, value) in &pool.segments {
        let (k, _) = term
            .iter()
            .find(|(k, v)| domain_of(k) == label.as_str() && *v == value)?;
        out.insert(k.to_string(), value.clone());
    }
    Some(out)
}

/// Where a volume goes: the pool, its data pool, and the topology it is
/// reachable from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The constrained pool chosen.
    pub pool: ConstrainedPool,
    /// The segments the volume is accessible from (one term).
    pub accessible: Segments,
}

/// Chooses the pool for requirements `preferred` then `requisite` (see the
/// module doc). `only_pool`: the pool a source (snapshot, volume) is in,
/// which a clone must share. `Ok(None)`: no constraint applies (no pools,
/// or no requirements). An error says why none of the pools fits.
pub fn choose(
    pools: &[ConstrainedPool],
    preferred: &[Segments],
    requisite: &[Segments],
    only_pool: Option<&str>,
) -> Result<Option<Placement>, String> {
    if pools.is_empty() || (preferred.is_empty() && requisite.is_empty()) {
        return Ok(None);
    }
    for term in preferred.iter().chain(requisite) {
        for p in pools
            .iter()
            .filter(|p| only_pool.is_none_or(|o| o == p.pool))
        {
            if let Some(accessible) = matched(p, term) {
                return Ok(Some(Placement {
                    pool: p.clone(),
                    accessible,
                }));
            }
        }
    }
    let terms: Vec<String> = preferred.iter().chain(requisite).map(show).collect();
    Err(match only_pool {
        Some(o) => format!(
            "the source is in pool {o:?}, which no requested topology ({}) reaches by {TOPOLOGY_CONSTRAINED_POOLS}; a clone stays in its source's pool",
            terms.join("; ")
        ),
        None => format!(
            "none of the {TOPOLOGY_CONSTRAINED_POOLS} pools matches the requested topology ({})",
            terms.join("; ")
        ),
    })
}

/// The placement of a volume found in `pool` (by [`find_existing`]): the
/// first requested term the pool matches, or else its segments under the
/// keys `keys` name (the node's topology keys).
pub fn placement_of(
    pools: &[ConstrainedPool],
    pool: &str,
    terms: &[Segments],
    keys: &[String],
) -> Option<Placement> {
    let p = pools.iter().find(|p| p.pool == pool)?;
    if let Some(accessible) = terms.iter().find_map(|t| matched(p, t)) {
        return Some(Placement {
            pool: p.clone(),
            accessible,
        });
    }
    let mut accessible = Segments::new();
    for (label, value) in &p.segments {
        let key = keys.iter().find(|k| domain_of(k) == label.as_str())?;
        accessible.insert(key.clone(), value.clone());
    }
    Some(Placement {
        pool: p.clone(),
        accessible,
    })
}

/// `params` with the pool and data pool of `placement` (the pool's own
/// data pool, or none: ceph-csi's rule).
pub fn placed(params: &ClassParams, placement: &Placement) -> ClassParams {
    let mut p = params.clone();
    p.pool = placement.pool.pool.clone();
    p.data_pool = placement.pool.data_pool.clone();
    p
}

/// The pools [`find_existing`] looks in for a volume placed in `first`:
/// that one, then the class's other pools and its `pool`.
pub fn candidate_pools(params: &ClassParams, first: &str) -> Vec<String> {
    let mut out = vec![first.to_owned()];
    for p in params
        .topology_pools
        .iter()
        .map(|p| &p.pool)
        .chain(std::iter::once(&params.pool))
    {
        if !out.contains(p) {
            out.push(p.clone());
        }
    }
    out
}

/// `a=b,c=d` of a term, for messages.
fn show(t: &Segments) -> String {
    t.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The pool among `pools` (tried in order) that already holds request
/// `vol.image`: the image itself, owned by `provisioner` for `pv_name`, or
/// its temporary name (a create cut short). `vol.pool` is ignored. A pool
/// that does not exist, or that the user may not read, holds nothing of
/// ours. Blocking.
pub fn find_existing(
    cluster: &Cluster,
    metrics: &dyn CephObserver,
    vol: &VolumeId,
    pools: &[String],
    provisioner: &str,
    pv_name: &str,
) -> Result<Option<String>, crate::volume::ops::VolumeError> {
    let temp = format!("{}{TEMP_SUFFIX}", vol.image);
    for pool in pools {
        let place = VolumeId {
            pool: pool.clone(),
            ..vol.clone()
        };
        let io = match ioctx(cluster, metrics, &place) {
            Ok(io) => io,
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::PermissionDenied) => {
                continue
            }
            Err(e) => return Err(e.into()),
        };
        let probe = |name: &str| match id_object_exists(&io, metrics, name) {
            Err(crate::volume::ops::VolumeError::Ceph(e))
                if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::PermissionDenied) =>
            {
                Ok(false)
            }
            r => r,
        };
        if probe(&vol.image)? {
            if let Some(img) = open_if_exists(&io, metrics, &vol.image)? {
                if check_owner(&img, metrics, provisioner, pv_name).is_ok() {
                    return Ok(Some(pool.clone()));
                }
            }
        }
        if probe(&temp)? {
            return Ok(Some(pool.clone()));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(kv: &[(&str, &str)]) -> Segments {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const EXAMPLE: &str = r#"
      [{"poolName":"pool0","dataPool":"ec-pool0",
        "domainSegments":[{"domainLabel":"region","value":"east"},
                          {"domainLabel":"zone","value":"zone1"}]},
       {"poolName":"pool1",
        "domainSegments":[{"domainLabel":"region","value":"east"},
                          {"domainLabel":"zone","value":"zone2"}]},
       {"poolName":"pool2",
        "domainSegments":[{"domainLabel":"region","value":"west"},
                          {"domainLabel":"zone","value":"zone1"}]}]"#;

    #[test]
    fn the_json_form_parses_and_bad_entries_are_named() {
        let p = parse_constrained_pools(EXAMPLE).unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p[0].data_pool.as_deref(), Some("ec-pool0"));
        assert_eq!(p[1].data_pool, None);
        assert_eq!(
            p[2].segments,
            [
                ("region".into(), "west".into()),
                ("zone".into(), "zone1".into())
            ]
        );
        assert!(parse_constrained_pools("").unwrap().is_empty());
        assert!(parse_constrained_pools(" [] ").unwrap().is_empty());
        for (text, words) in [
            ("{", "not a JSON list"),
            (r#"[{"pool":"a"}]"#, "not a JSON list"),
            (
                r#"[{"poolName":"a/b","domainSegments":[{"domainLabel":"z","value":"1"}]}]"#,
                "entry 0",
            ),
            (r#"[{"poolName":"a","domainSegments":[]}]"#, "is empty"),
            (
                r#"[{"poolName":"a","domainSegments":[{"domainLabel":"x/zone","value":"1"}]}]"#,
                "without '/'",
            ),
            (
                r#"[{"poolName":"a","domainSegments":[{"domainLabel":"zone","value":""}]}]"#,
                "and a value",
            ),
            (
                r#"[{"poolName":"a","domainSegments":[{"domainLabel":"zone","value":"1"},{"domainLabel":"zone","value":"2"}]}]"#,
                "twice",
            ),
            (
                r#"[{"poolName":"a","domainSegments":[{"domainLabel":"zone","value":"1"}]},
                   {"poolName":"a","domainSegments":[{"domainLabel":"zone","value":"2"}]}]"#,
                "listed twice",
            ),
        ] {
            let e = parse_constrained_pools(text).unwrap_err();
            assert_eq!(e.param, TOPOLOGY_CONSTRAINED_POOLS);
            assert!(e.why.contains(words), "{text}: {e}");
        }
    }

    #[test]
    fn preferred_terms_come_first_then_requisite() {
        let pools = parse_constrained_pools(EXAMPLE).unwrap();
        let z = |r: &str, z: &str| {
            seg(&[
                ("topology.rbd.rbdkit.io/region", r),
                ("topology.rbd.rbdkit.io/zone", z),
                ("topology.rbd.rbdkit.io/node", "n1"),
            ])
        };
        // The preferred term decides, though an earlier pool matches a
        // requisite one.
        let got = choose(
            &pools,
            &[z("east", "zone2")],
            &[z("east", "zone1"), z("east", "zone2")],
            None,
        )
        .unwrap()
        .unwrap();
        assert_eq!(got.pool.pool, "pool1");
        // Only the segments the pool needs: not the node.
        assert_eq!(
            got.accessible,
            seg(&[
                ("topology.rbd.rbdkit.io/region", "east"),
                ("topology.rbd.rbdkit.io/zone", "zone2")
            ])
        );
        // No preferred match: the requisite terms, in order.
        let got = choose(&pools, &[z("north", "zone9")], &[z("west", "zone1")], None)
            .unwrap()
            .unwrap();
        assert_eq!(got.pool.pool, "pool2");
        // Keys of any prefix match by their domain.
        let got = choose(
            &pools,
            &[],
            &[seg(&[("region", "east"), ("example.com/zone", "zone1")])],
            None,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (got.pool.pool.as_str(), got.pool.data_pool.as_deref()),
            ("pool0", Some("ec-pool0"))
        );
        // A value must match too; half a domain is no match.
        let e = choose(&pools, &[seg(&[("zone", "zone2")])], &[], None).unwrap_err();
        assert!(e.contains("none of the") && e.contains("zone=zone2"), "{e}");
        // No requirements or no pools: no constraint.
        assert_eq!(choose(&pools, &[], &[], None).unwrap(), None);
        assert_eq!(choose(&[], &[z("east", "zone1")], &[], None).unwrap(), None);
        // A clone stays in its source's pool.
        let got = choose(
            &pools,
            &[z("east", "zone1")],
            &[z("east", "zone1"), z("east", "zone2")],
            Some("pool1"),
        )
        .unwrap()
        .unwrap();
        assert_eq!(got.pool.pool, "pool1");
        let e = choose(&pools, &[z("east", "zone1")], &[], Some("pool1")).unwrap_err();
        assert!(e.contains("source is in pool \"pool1\""), "{e}");
    }

    #[test]
    fn a_found_pool_gets_its_own_topology() {
        let pools = parse_constrained_pools(EXAMPLE).unwrap();
        let keys = vec!["topology.d/region".to_owned(), "topology.d/zone".to_owned()];
        let p = placement_of(
            &pools,
            "pool0",
            &[seg(&[("topology.d/zone", "zone2")])],
            &keys,
        )
        .unwrap();
        assert_eq!(
            p.accessible,
            seg(&[("topology.d/region", "east"), ("topology.d/zone", "zone1")])
        );
        let t = seg(&[("a/region", "east"), ("a/zone", "zone1")]);
        assert_eq!(
            placement_of(&pools, "pool0", std::slice::from_ref(&t), &[])
                .unwrap()
                .accessible,
            t
        );
        assert!(placement_of(&pools, "nope", &[], &keys).is_none());
        assert!(placement_of(&pools, "pool0", &[], &keys[..1]).is_none());
        assert_eq!(domain_of("a/b/c"), "b/c");
        assert_eq!(domain_of("zone"), "zone");
    }
}
