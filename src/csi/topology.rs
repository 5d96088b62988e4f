//! Topology in the CSI services: the pool a CreateVolume goes to from its
//! `accessibility_requirements` ([`crate::volume::topology`]), and the
//! node's place from its Node labels: the topology segments it reports
//! (`--domainlabels`, ceph-csi's flag) and the labels read affinity places
//! it in the CRUSH map by ([`crate::node::read_affinity`]).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tonic::Status;

use crate::csi::driver::{volume_status, Driver, InFlight};
use crate::csi::proto::{Topology, TopologyRequirement};
use crate::volume::clusters::Conn;
use crate::volume::params::ClassParams;
use crate::volume::topology::{self as topo, Segments};
use crate::volume::VolumeId;

fn segments(t: &Topology) -> Segments {
    t.segments
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The preferred and requisite terms of a request.
fn terms(req: Option<&TopologyRequirement>) -> (Vec<Segments>, Vec<Segments>) {
    match req {
        None => (Vec::new(), Vec::new()),
        Some(r) => (
            r.preferred.iter().map(segments).collect(),
            r.requisite.iter().map(segments).collect(),
        ),
    }
}

/// A CSI topology term.
pub(crate) fn topology(s: &Segments) -> Topology {
    Topology {
        segments: s.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    }
}

/// What [`place`] decided: the class's parameters and the volume with the
/// chosen pool, and the volume's accessible topology (none without
/// `topologyConstrainedPools` or requirements).
pub(crate) type Placed = (ClassParams, VolumeId, Option<Segments>);

/// Where CreateVolume `name` goes: `params` and `vol` with the pool the
/// requirements choose (an image of the request already in another of the
/// class's pools keeps its pool), and the volume's accessible topology.
/// Without `topologyConstrainedPools` or requirements, they are returned
/// as they are. `source_pool`: a clone's source pool, which it must share.
pub(crate) async fn place(
    driver: &Driver,
    busy: &InFlight,
    conn: &Conn,
    (params, vol): (ClassParams, VolumeId),
    name: &str,
    requirements: Option<&TopologyRequirement>,
    source_pool: Option<&str>,
) -> Result<Placed, Status> {
    if params.topology_pools.is_empty() {
        return Ok((params, vol, None));
    }
    let (preferred, requisite) = terms(requirements);
    // The spec's code for "cannot be made with that topology".
    let chosen = topo::choose(&params.topology_pools, &preferred, &requisite, source_pool)
        .map_err(Status::resource_exhausted)?;
    let Some(chosen) = chosen else {
        return Ok((params, vol, None));
    };
    let candidates = if source_pool.is_some() {
        vec![chosen.pool.pool.clone()]
    } else {
        topo::candidate_pools(&params, &chosen.pool.pool)
    };
    let (v, provisioner, pv) = (vol.clone(), driver.name.clone(), name.to_owned());
    let found = driver
        .ceph_holding(busy, conn, move |c, m| {
            topo::find_existing(c, m, &v, &candidates, &provisioner, &pv)
        })
        .await
        .map_err(|e| volume_status(&e))?;
    let placement = match found {
        Some(pool) if pool != chosen.pool.pool => {
            let all: Vec<Segments> = preferred.into_iter().chain(requisite).collect();
            topo::placement_of(&params.topology_pools, &pool, &all, &[]).ok_or_else(|| {
                Status::already_exists(format!(
                    "volume {name:?} already exists in pool {pool:?}, which the requested topology does not reach"
                ))
            })?
        }
        _ => chosen,
    };
    let vol = VolumeId {
        pool: placement.pool.pool.clone(),
        ..vol
    };
    tracing::info!(volume = %vol, topology = ?placement.accessible, "placed by topology");
    Ok((
        topo::placed(&params, &placement),
        vol,
        Some(placement.accessible),
    ))
}

/// The segments `--domainlabels` gives node `node`: for each label key (a
/// Node label such as `topology.kubernetes.io/zone`), the key
/// `topology.<driver>/<domain>` (`<domain>` the label's name after its
/// prefix, the driver name lowercased, as ceph-csi names them) with the
/// label's value. A missing label is an error naming it.
pub fn domain_segments(
    driver: &str,
    labels: &[String],
    node_labels: &BTreeMap<String, String>,
    node: &str,
) -> anyhow::Result<BTreeMap<String, String>> {
    let prefix = format!("topology.{}", driver.to_lowercase());
    anyhow::ensure!(
        prefix.len() <= 253,
        "--domainlabels: the topology key prefix {prefix:?} is longer than 253 characters"
    );
    let mut out = BTreeMap::new();
    let mut missing = Vec::new();
    for label in labels.iter().map(|l| l.trim()).filter(|l| !l.is_empty()) {
        let domain = topo::domain_of(label);
        anyhow::ensure!(
            !domain.is_empty() && domain.len() <= 63,
            "--domainlabels: label {label:?} has no name after its prefix, or one longer than 63 characters"
        );
        let key = format!("{prefix}/{domain}");
        anyhow::ensure!(
            !out.contains_key(&key),
            "--domainlabels: two labels name the domain {domain:?}"
        );
        match node_labels.get(label) {
            Some(v) => {
                out.insert(key, v.clone());
            }
            None => missing.push(label.to_owned()),
        }
    }
    anyhow::ensure!(
        missing.is_empty(),
        "--domainlabels: node {node:?} has no label {}",
        missing.join(", ")
    );
    Ok(out)
}

/// The labels of Node `node`, read from the API server (`kubeconfig`, or
/// the pod's service account), retried for up to `bound`. A Node that is
/// missing, or that this service account may not read, fails at once.
pub async fn node_labels(
    kubeconfig: Option<&Path>,
    node: &str,
    bound: Duration,
) -> anyhow::Result<BTreeMap<String, String>> {
    use k8s_openapi::api::core::v1::Node;
    let client = crate::k8s::client::client(kubeconfig)
        .await
        .context("node labels (--domainlabels, read affinity) need the API server")?;
    let api: kube::Api<Node> = kube::Api::all(client);
    let deadline = Instant::now() + bound;
    loop {
        let attempt = tokio::time::timeout(Duration::from_secs(10), api.get(node)).await;
        let err = match attempt {
            Ok(Ok(n)) => return Ok(n.metadata.labels.unwrap_or_default()),
            // Missing or forbidden does not change by waiting.
            Ok(Err(kube::Error::Api(e))) if e.code == 404 || e.code == 403 => {
                anyhow::bail!("cannot read Node {node:?}: {} ({})", e.message, e.code)
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out after 10 s".to_owned(),
        };
        if Instant::now() >= deadline {
            anyhow::bail!("cannot read Node {node:?} within {bound:?}: {err}");
        }
        tracing::warn!(node, error = %err, "cannot read the node's labels yet; retrying");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domain_labels_become_driver_keys() {
        let labels = BTreeMap::from([
            ("topology.kubernetes.io/zone".to_owned(), "zone1".to_owned()),
            ("example.com/region".to_owned(), "east".to_owned()),
            ("rack".to_owned(), "r7".to_owned()),
        ]);
        let l = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let s = domain_segments(
            "RBD.rbdkit.io",
            &l(&["topology.kubernetes.io/zone", "example.com/region", "rack"]),
            &labels,
            "n1",
        )
        .unwrap();
        assert_eq!(
            s,
            BTreeMap::from([
                ("topology.rbd.rbdkit.io/zone".to_owned(), "zone1".to_owned()),
                (
                    "topology.rbd.rbdkit.io/region".to_owned(),
                    "east".to_owned()
                ),
                ("topology.rbd.rbdkit.io/rack".to_owned(), "r7".to_owned()),
            ])
        );
        let e = domain_segments("d", &l(&["a/zone", "b/rack"]), &labels, "n1").unwrap_err();
        assert!(e.to_string().contains("no label a/zone, b/rack"), "{e}");
        let e = domain_segments(
            "d",
            &l(&["topology.kubernetes.io/zone", "other.io/zone"]),
            &labels,
            "n1",
        )
        .unwrap_err();
        assert!(e.to_string().contains("two labels"), "{e}");
        assert!(domain_segments("d", &l(&["x/"]), &labels, "n1").is_err());
        assert!(domain_segments("d", &[], &labels, "n1").unwrap().is_empty());
    }

    #[test]
    fn request_terms_keep_their_order() {
        let t = |z: &str| Topology {
            segments: [("k/zone".to_owned(), z.to_owned())].into(),
        };
        let (p, r) = terms(Some(&TopologyRequirement {
            requisite: vec![t("a"), t("b")],
            preferred: vec![t("b")],
        }));
        assert_eq!(p.len(), 1);
        assert_eq!(r[1]["k/zone"], "b");
        assert_eq!(terms(None), (Vec::new(), Vec::new()));
        assert_eq!(topology(&r[0]), t("a"));
    }
}
