//! external-provisioner's part of topology, done in process: the
//! accessibility requirements of a claim (from the node the scheduler
//! selected for a WaitForFirstConsumer claim, or the class's
//! `allowedTopologies`), and the PV's node affinity from the topology the
//! volume is reachable from. The pool choice itself is
//! [`crate::volume::topology`].
//!
//! As external-provisioner builds them (without `--strict-topology`): the
//! topology keys are those the node plugin reported on the selected node
//! (its CSINode's `topologyKeys` for this driver), the selected term is
//! that node's values for them; the requisite terms are the class's
//! `allowedTopologies`, or else every node's values for the same keys; the
//! preferred terms are the requisite ones starting from the selected
//! node's. An Immediate claim of a class without `allowedTopologies` has
//! none (ceph-csi's deployment runs external-provisioner with
//! `--immediate-topology=false`), and goes to the class's `pool`.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PersistentVolume,
    PersistentVolumeClaim, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use kube::api::{Api, ListParams};
use kube::ResourceExt;

use crate::provisioner::controller::ANN_SELECTED_NODE;
use crate::volume::topology::Segments;

/// A claim's accessibility requirements.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requirements {
    /// Tried first, in order.
    pub preferred: Vec<Segments>,
    /// The volume must be reachable from one of these.
    pub requisite: Vec<Segments>,
    /// The topology keys of the selected node (empty without one).
    pub keys: Vec<String>,
}

/// The terms of a class's `allowedTopologies`: each selector term expanded
/// into one term per combination of its values, sorted, without
/// duplicates.
pub fn allowed_terms(class: &StorageClass) -> Vec<Segments> {
    let mut out = BTreeSet::new();
    for term in class.allowed_topologies.iter().flatten() {
        let mut combos: Vec<Segments> = vec![Segments::new()];
        for req in term.match_label_expressions.iter().flatten() {
            let mut next = Vec::new();
            for c in &combos {
                for v in &req.values {
                    let mut c = c.clone();
                    c.insert(req.key.clone(), v.clone());
                    next.push(c);
                }
            }
            combos = next;
        }
        out.extend(combos.into_iter().filter(|c| !c.is_empty()));
    }
    out.into_iter().collect()
}

/// `requisite` rotated to start at the first term the selected node's
/// `selected` segments contain; `None` if none does.
pub fn preferred_from(requisite: &[Segments], selected: &Segments) -> Option<Vec<Segments>> {
    let at = requisite
        .iter()
        .position(|t| t.iter().all(|(k, v)| selected.get(k) == Some(v)))?;
    let mut out = requisite[at..].to_vec();
    out.extend_from_slice(&requisite[..at]);
    Some(out)
}

/// The requirements of `claim` (of `class`, for `driver`); `Ok(None)` when
/// it has none. An error says what is missing (the node's CSINode entry,
/// a label) and is retried.
pub async fn requirements(
    client: &kube::Client,
    driver: &str,
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
) -> Result<Option<Requirements>, String> {
    let allowed = allowed_terms(class);
    let Some(node) = claim.annotations().get(ANN_SELECTED_NODE).cloned() else {
        if allowed.is_empty() {
            return Ok(None);
        }
        return Ok(Some(Requirements {
            preferred: allowed.clone(),
            requisite: allowed,
            keys: Vec::new(),
        }));
    };
    let api_err = |e: kube::Error| format!("Kubernetes API: {e}");
    let csinode = Api::<CSINode>::all(client.clone())
        .get_opt(&node)
        .await
        .map_err(api_err)?;
    let keys: Vec<String> = csinode
        .as_ref()
        .and_then(|n| n.spec.drivers.iter().find(|d| d.name == driver))
        .and_then(|d| d.topology_keys.clone())
        .unwrap_or_default();
    if keys.is_empty() {
        return Err(format!(
            "no topology key found for node {node:?}: its CSINode lists none for driver {driver:?} (is the node plugin registered there, with --domainlabels?)"
        ));
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let labels = nodes
        .get_metadata(&node)
        .await
        .map_err(api_err)?
        .metadata
        .labels
        .unwrap_or_default();
    let mut selected = Segments::new();
    for k in &keys {
        let v = labels.get(k).ok_or_else(|| {
            format!("node {node:?} has no label {k:?}, a topology key its node plugin reported")
        })?;
        selected.insert(k.clone(), v.clone());
    }
    let requisite = if !allowed.is_empty() {
        allowed
    } else {
        // Every node that has all the keys, as one term each.
        let list = nodes
            .list_metadata(&ListParams::default().labels(&keys.join(",")))
            .await
            .map_err(api_err)?;
        let mut terms = BTreeSet::new();
        for n in list.items {
            let l = n.metadata.labels.unwrap_or_default();
            let term: Option<Segments> = keys
                .iter()
                .map(|k| l.get(k).map(|v| (k.clone(), v.clone())))
                .collect();
            terms.extend(term);
        }
        terms.insert(selected.clone());
        terms.into_iter().collect::<Vec<_>>()
    };
    let preferred = preferred_from(&requisite, &selected).ok_or_else(|| {
        format!(
            "the selected node {node:?} ({}) is not within the StorageClass's allowedTopologies",
            selected
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        )
    })?;
    Ok(Some(Requirements {
        preferred,
        requisite,
        keys,
    }))
}

/// Puts on `pv` the node affinity of a volume reachable from `accessible`
/// (one term: every segment required, as external-provisioner writes it).
pub fn set_node_affinity(pv: &mut PersistentVolume, accessible: &Segments) {
    if accessible.is_empty() {
        return;
    }
    let expressions = accessible
        .iter()
        .map(|(k, v)| NodeSelectorRequirement {
            key: k.clone(),
            operator: "In".to_owned(),
            values: Some(vec![v.clone()]),
        })
        .collect();
    if let Some(spec) = pv.spec.as_mut() {
        spec.node_affinity = Some(VolumeNodeAffinity {
            required: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(expressions),
                    match_fields: None,
                }],
            }),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn seg(kv: &[(&str, &str)]) -> Segments {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn allowed_topologies_expand_into_terms() {
        let class: StorageClass = serde_json::from_value(json!({
            "metadata": {"name": "c"},
            "provisioner": "p",
            "allowedTopologies": [
                {"matchLabelExpressions": [
                    {"key": "t/region", "values": ["east"]},
                    {"key": "t/zone", "values": ["z2", "z1"]}]},
                {"matchLabelExpressions": [{"key": "t/zone", "values": ["z1"]}]},
                {"matchLabelExpressions": [
                    {"key": "t/region", "values": ["east"]},
                    {"key": "t/zone", "values": ["z1"]}]},
            ],
        }))
        .unwrap();
        assert_eq!(
            allowed_terms(&class),
            [
                seg(&[("t/region", "east"), ("t/zone", "z1")]),
                seg(&[("t/region", "east"), ("t/zone", "z2")]),
                seg(&[("t/zone", "z1")]),
            ]
        );
        let none: StorageClass =
            serde_json::from_value(json!({"metadata": {"name": "c"}, "provisioner": "p"})).unwrap();
        assert!(allowed_terms(&none).is_empty());
    }

    #[test]
    fn the_selected_node_term_comes_first() {
        let t = |z: &str| seg(&[("t/zone", z)]);
        let req = [t("a"), t("b"), t("c")];
        let sel = seg(&[("t/zone", "b"), ("t/node", "n2")]);
        assert_eq!(
            preferred_from(&req, &sel).unwrap(),
            [t("b"), t("c"), t("a")]
        );
        assert!(preferred_from(&req, &seg(&[("t/zone", "d")])).is_none());
    }

    #[test]
    fn node_affinity_requires_every_segment() {
        let mut pv = PersistentVolume {
            spec: Some(Default::default()),
            ..Default::default()
        };
        set_node_affinity(&mut pv, &seg(&[("t/region", "east"), ("t/zone", "z1")]));
        let v = serde_json::to_value(&pv.spec.as_ref().unwrap().node_affinity).unwrap();
        assert_eq!(
            v,
            json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "t/region", "operator": "In", "values": ["east"]},
                {"key": "t/zone", "operator": "In", "values": ["z1"]},
            ]}]}})
        );
        let mut bare = PersistentVolume {
            spec: Some(Default::default()),
            ..Default::default()
        };
        set_node_affinity(&mut bare, &Segments::new());
        assert!(bare.spec.unwrap().node_affinity.is_none());
    }
}
