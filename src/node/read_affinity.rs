//! Read affinity: reads served by the nearest replica (`localize`), the
//! node's place in the CRUSH map taken from its labels, as ceph-csi does.
//!
//! The same two map options go to either mapper:
//! - krbd (Linux 5.8+, OSDs Octopus+): `read_from_replica=localize` and
//!   `crush_location=zone:z1|host:n1` (the kernel's form: `type:name`
//!   pairs joined by `|`);
//! - rbdkit-fuse: the same words, which [`crate::node::fuse::FuseMapOptions`]
//!   turns into librbd's `rbd_read_from_replica_policy=localize` and
//!   `crush_location=zone=z1 host=n1` on the image's connection.
//!
//! Which labels: `--crush-location-labels` with `--enable-read-affinity`,
//! unless the cluster's entry in the clusters config says otherwise
//! (`"readAffinity": {"enabled": ..., "crushLocationLabels": [...]}`:
//! disabled there is off; enabled with labels uses those; enabled without
//! labels uses the flag's).

use std::collections::BTreeMap;

/// The map option that turns localized reads on.
pub const READ_FROM_REPLICA: &str = "read_from_replica";
/// The map option with the node's CRUSH location.
pub const CRUSH_LOCATION: &str = "crush_location";

/// The labels whose values place this node for one cluster (see the module
/// doc): `config` is the cluster's `readAffinity` (enabled, labels), if it
/// has one; `cli` the flags' (enabled, labels).
pub fn labels_for<'a>(
    config: Option<(bool, &'a [String])>,
    cli: (bool, &'a [String]),
) -> &'a [String] {
    match config {
        Some((false, _)) => &[],
        Some((true, labels)) if !labels.is_empty() => labels,
        _ if cli.0 => cli.1,
        _ => &[],
    }
}

/// The CRUSH location from node labels: for each of `labels` the node has
/// with a value, its name after the prefix (`topology.kubernetes.io/zone`
/// is `zone`; Kubernetes' `hostname` is CRUSH's `host`) with the value,
/// dots made dashes (CRUSH bucket names have none).
pub fn crush_location(
    labels: &[String],
    node_labels: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for label in labels.iter().map(|l| l.trim()) {
        let Some(value) = node_labels.get(label).map(|v| v.trim()) else {
            continue;
        };
        if value.is_empty() {
            continue;
        }
        let mut kind = label.split_once('/').map_or(label, |(_, n)| n).trim();
        if kind == "hostname" {
            kind = "host";
        }
        if kind.is_empty() {
            continue;
        }
        out.insert(kind.to_owned(), value.replace('.', "-"));
    }
    out
}

/// The map options for `location` (none when it is empty), in the kernel's
/// form, sorted by type so the same node always maps alike.
pub fn map_options(location: &BTreeMap<String, String>) -> Vec<String> {
    if location.is_empty() {
        return Vec::new();
    }
    let pairs: Vec<String> = location.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    vec![
        format!("{READ_FROM_REPLICA}=localize"),
        format!("{CRUSH_LOCATION}={}", pairs.join("|")),
    ]
}

/// Adds `extra` (from [`map_options`]) to a volume's map options, unless
/// they already set read affinity themselves: the class's choice wins.
pub fn add_to(options: &mut Vec<String>, extra: &[String]) {
    let set_already = options.iter().any(|o| {
        let name = o.split_once('=').map_or(o.as_str(), |(n, _)| n).trim();
        name == READ_FROM_REPLICA || name == CRUSH_LOCATION
    });
    if !set_already {
        options.extend(extra.iter().cloned());
    }
}

/// librbd's form of a kernel-form `crush_location` value
/// (`zone:z1|host:n1` becomes `zone=z1 host=n1`); `Err` says what is wrong.
pub fn librbd_crush_location(kernel_form: &str) -> Result<String, String> {
    let ok = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    let mut out = Vec::new();
    for pair in kernel_form.split('|') {
        let Some((k, v)) = pair.split_once(':') else {
            return Err(format!("{pair:?} is not type:name"));
        };
        if !ok(k) || !ok(v) {
            return Err(format!(
                "{pair:?}: a CRUSH type and name are letters, digits, '-' and '_'"
            ));
        }
        out.push(format!("{k}={v}"));
    }
    Ok(out.join(" "))
}

/// librbd's `rbd_read_from_replica_policy` for a `read_from_replica` value
/// (the kernel's `no`, `balance`, `localize`).
pub fn librbd_policy(value: &str) -> Option<&'static str> {
    match value {
        "no" => Some("default"),
        "balance" => Some("balance"),
        "localize" => Some("localize"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_config_entry_decides_over_the_flags() {
        let cli = l(&["topology.kubernetes.io/zone"]);
        let cfg = l(&["example.com/rack"]);
        assert_eq!(labels_for(None, (true, &cli)), &cli[..]);
        assert!(labels_for(None, (false, &cli)).is_empty());
        assert!(labels_for(Some((false, &cfg)), (true, &cli)).is_empty());
        assert_eq!(labels_for(Some((true, &cfg)), (false, &cli)), &cfg[..]);
        assert_eq!(labels_for(Some((true, &[])), (true, &cli)), &cli[..]);
        assert!(labels_for(Some((true, &[])), (false, &cli)).is_empty());
    }

    #[test]
    fn node_labels_make_the_kernel_option_string() {
        let node = BTreeMap::from([
            (
                "topology.kubernetes.io/zone".to_owned(),
                "eu.west.1a".to_owned(),
            ),
            ("kubernetes.io/hostname".to_owned(), "node-7".to_owned()),
            ("rack".to_owned(), " r2 ".to_owned()),
            ("empty.io/row".to_owned(), "".to_owned()),
        ]);
        let loc = crush_location(
            &l(&[
                "topology.kubernetes.io/zone",
                "kubernetes.io/hostname",
                "rack",
                "empty.io/row",
                "missing.io/dc",
            ]),
            &node,
        );
        assert_eq!(
            map_options(&loc),
            [
                "read_from_replica=localize",
                "crush_location=host:node-7|rack:r2|zone:eu-west-1a"
            ]
        );
        assert!(map_options(&BTreeMap::new()).is_empty());
        assert_eq!(
            librbd_crush_location("host:node-7|rack:r2|zone:eu-west-1a").unwrap(),
            "host=node-7 rack=r2 zone=eu-west-1a"
        );
        for bad in ["", "zone", "zone:", "zone:a b", "zone:a|", "a=b:c"] {
            assert!(librbd_crush_location(bad).is_err(), "{bad:?}");
        }
        assert_eq!(librbd_policy("no"), Some("default"));
        assert_eq!(librbd_policy("sometimes"), None);
    }

    #[test]
    fn the_class_own_read_affinity_wins() {
        let extra = map_options(&BTreeMap::from([("zone".to_owned(), "a".to_owned())]));
        let mut opts = l(&["queue_depth=128"]);
        add_to(&mut opts, &extra);
        assert_eq!(opts.len(), 3);
        let mut own = l(&["read_from_replica=balance"]);
        add_to(&mut own, &extra);
        assert_eq!(own, ["read_from_replica=balance"]);
        let mut own = l(&["crush_location=zone:b"]);
        add_to(&mut own, &extra);
        assert_eq!(own, ["crush_location=zone:b"]);
    }
}
