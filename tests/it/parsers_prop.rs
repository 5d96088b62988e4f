//! Property tests of every parser of outside input: StorageClass parameters,
//! quantities, volume handles, the clusters config, CLI image specs and map
//! options. They never panic, round trips hold, and errors name the input.
//!
//! `PROPTEST_CASES` overrides the case count (256 by default, for CI).
use std::collections::BTreeMap;

use proptest::prelude::*;

use rbdkit::cli::ImageSpec;
use rbdkit::node::options::{options_for, MounterKind};
use rbdkit::volume::clusters::ClustersConfig;
use rbdkit::volume::params::ClassParams;
use rbdkit::volume::quantity::{bytes_quantity, parse_bytes, parse_whole_bytes};
use rbdkit::volume::{SnapshotId, VolumeId};

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Keys a StorageClass may hold, plus some it may not.
const KEYS: &[&str] = &[
    "clusterID",
    "pool",
    "dataPool",
    "imageFeatures",
    "objectSize",
    "stripeUnit",
    "stripeCount",
    "volumeNamePrefix",
    "imageFormat",
    "journalPool",
    "mounter",
    "mapOptions",
    "unmapOptions",
    "mkfsOptions",
    "tryOtherMounters",
    "encrypted",
    "thickProvision",
    "csi.storage.k8s.io/fstype",
    "csi.storage.k8s.io/provisioner-secret-name",
    "csi.storage.k8s.io/provisioner-secret-namespace",
    "csi.storage.k8s.io/node-stage-secret-name",
    "csi.storage.k8s.io/node-stage-secret-namespace",
    "csi.storage.k8s.io/pv/name",
    "clusterId",
    "",
];

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,12}",
        "[0-9]{1,8}(Ki|Mi|Gi|k|M|m|e3)?",
        Just("layering,exclusive-lock,object-map,fast-diff".to_owned()),
        Just("true".to_owned()),
        Just("rbd".to_owned()),
        Just("${pvc.namespace}".to_owned()),
        Just("krbd:a,b;rbdkit-fuse:c".to_owned()),
    ]
}

fn params() -> impl Strategy<Value = BTreeMap<String, String>> {
    proptest::collection::btree_map(
        prop_oneof![
            proptest::sample::select(KEYS).prop_map(str::to_owned),
            ".{0,10}"
        ],
        value(),
        0..10,
    )
}

fn base() -> BTreeMap<String, String> {
    [
        ("clusterID", "c1"),
        ("pool", "rbd"),
        ("csi.storage.k8s.io/provisioner-secret-name", "s"),
        ("csi.storage.k8s.io/provisioner-secret-namespace", "ns"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// A part of a name: anything but the separators the format uses.
fn part(sep: &'static str) -> impl Strategy<Value = String> {
    ".{1,12}".prop_filter("no separator", move |s| !s.contains(|c| sep.contains(c)))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn class_params_never_panic_and_errors_name_a_parameter(p in params()) {
        for parsed in [ClassParams::parse(&p), ClassParams::parse_csi(&p)] {
            if let Err(e) = parsed {
                prop_assert!(!e.param.is_empty() || p.contains_key(""), "{e}");
                prop_assert!(e.to_string().contains(&format!("{:?}", e.param)), "{e}");
                // It names a key that is there, or one that is missing.
                let known_missing = [
                    "clusterID", "pool", "stripeUnit", "stripeCount",
                    "csi.storage.k8s.io/provisioner-secret-name",
                    "csi.storage.k8s.io/provisioner-secret-namespace",
                    "csi.storage.k8s.io/node-stage-secret-name",
                    "csi.storage.k8s.io/node-stage-secret-namespace",
                ];
                prop_assert!(
                    p.contains_key(&e.param) || known_missing.contains(&e.param.as_str()),
                    "{e} for {p:?}"
                );
            }
        }
    }

    #[test]
    fn class_params_keep_what_they_accept(
        shift in 12u32..=26,
        prefix in "[a-z0-9._-]{0,64}",
        stripes in 1u64..16,
    ) {
        let mut p = base();
        let osize = 1u64 << shift;
        p.insert("objectSize".into(), osize.to_string());
        p.insert("stripeUnit".into(), format!("{}Ki", (osize >> 10).max(4) / 4));
        p.insert("stripeCount".into(), stripes.to_string());
        p.insert("volumeNamePrefix".into(), prefix.clone());
        let c = ClassParams::parse(&p).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(c.object_size, Some(osize));
        prop_assert_eq!(c.striping, Some((osize / 4, stripes)));
        prop_assert_eq!(c.image_name("pvc-1"), format!("{prefix}pvc-1"));
        prop_assert_eq!(c.cluster_id, "c1");
    }

    #[test]
    fn objects_sizes_not_a_power_of_two_are_refused(n in 4097u64..(64 << 20)) {
        prop_assume!(!n.is_power_of_two());
        let mut p = base();
        p.insert("objectSize".into(), n.to_string());
        let e = ClassParams::parse(&p).unwrap_err();
        prop_assert_eq!(e.param, "objectSize");
    }

    #[test]
    fn quantities_never_panic(s in ".{0,40}") {
        let _ = parse_bytes(&s);
        let whole = parse_whole_bytes(&s);
        if let Ok(b) = whole {
            prop_assert_eq!(parse_bytes(&s).unwrap(), b);
        }
        if let Err(e) = parse_bytes(&s) {
            prop_assert!(e.to_string().contains(&format!("{s:?}")), "{e}");
        }
    }

    #[test]
    fn quantities_round_trip(n in any::<u64>(), mib in 0u64..(1 << 40)) {
        prop_assert_eq!(parse_bytes(&n.to_string()).unwrap(), n);
        prop_assert_eq!(parse_whole_bytes(&n.to_string()).unwrap(), n);
        prop_assert_eq!(parse_bytes(&bytes_quantity(n).0).unwrap(), n);
        prop_assert_eq!(parse_bytes(&format!("{mib}Mi")).unwrap(), mib << 20);
        // A fraction of a byte rounds up, or is refused by the strict form.
        let milli = format!("{}m", u128::from(mib) * 1000 + 1);
        prop_assert_eq!(parse_bytes(&milli).unwrap(), mib + 1);
        prop_assert!(parse_whole_bytes(&milli).is_err());
    }

    #[test]
    fn volume_handles_round_trip(
        cluster_id in ".{1,20}",
        pool in ".{1,20}",
        rados_namespace in ".{0,20}",
        image in ".{1,40}",
    ) {
        let id = VolumeId { cluster_id, pool, rados_namespace, image };
        let handle = id.handle();
        prop_assert_eq!(VolumeId::parse(&handle).unwrap(), id);
    }

    #[test]
    fn snapshot_handles_round_trip_and_are_never_volume_handles(
        cluster_id in ".{1,20}",
        pool in ".{1,20}",
        rados_namespace in ".{0,20}",
        image in ".{1,40}",
        snap in ".{1,20}",
    ) {
        let id = SnapshotId { cluster_id, pool, rados_namespace, image, snap };
        let handle = id.handle();
        prop_assert_eq!(SnapshotId::parse(&handle).unwrap(), id.clone());
        prop_assert!(VolumeId::parse(&handle).is_err());
        prop_assert!(SnapshotId::parse(&id.image_id().handle()).is_err());
    }

    #[test]
    fn snapshot_handles_never_panic(s in "(rbdkit1-snap/)?[a-z%/@0-9A-F]{0,30}") {
        if let Ok(id) = SnapshotId::parse(&s) {
            prop_assert_eq!(SnapshotId::parse(&id.handle()).unwrap(), id);
        }
    }

    #[test]
    fn volume_handles_never_panic(s in "(rbdkit1/)?[a-z%/0-9A-F]{0,30}") {
        if let Ok(id) = VolumeId::parse(&s) {
            prop_assert_eq!(VolumeId::parse(&id.handle()).unwrap(), id);
        }
    }

    #[test]
    fn clusters_config_never_panics(s in ".{0,60}") {
        let _ = ClustersConfig::parse(&s);
        let _ = ClustersConfig::parse(&format!("[{{\"clusterID\": {s:?}, \"monitors\": [{s:?}]}}]"));
    }

    #[test]
    fn clusters_config_keeps_its_entries(
        ids in proptest::collection::btree_set("[a-z0-9-]{1,12}", 1..5),
        ns in "[a-z0-9]{0,8}",
    ) {
        let entries: Vec<serde_json::Value> = ids
            .iter()
            .map(|id| serde_json::json!({
                "clusterID": id,
                "monitors": ["10.0.0.1:6789", " "],
                "rbd": {"radosNamespace": ns},
            }))
            .collect();
        let text = serde_json::Value::Array(entries.clone()).to_string();
        let c = ClustersConfig::parse(&text).unwrap();
        prop_assert_eq!(c.len(), ids.len());
        for id in &ids {
            let info = c.get(id).unwrap();
            prop_assert_eq!(&info.monitors, &vec!["10.0.0.1:6789".to_owned()]);
            prop_assert_eq!(&info.rados_namespace, &ns);
        }
        // The same id twice is refused, naming it.
        let mut twice = entries.clone();
        twice.push(entries[0].clone());
        let e = ClustersConfig::parse(&serde_json::Value::Array(twice).to_string()).unwrap_err();
        prop_assert!(e.contains(ids.iter().next().unwrap().as_str()), "{e}");
    }

    #[test]
    fn image_specs_never_panic(s in ".{0,40}") {
        match ImageSpec::parse(&s) {
            Ok(spec) => prop_assert_eq!(ImageSpec::parse(&spec.to_string()).unwrap(), spec),
            Err(e) => prop_assert!(e.to_string().contains("image spec"), "{e}"),
        }
    }

    #[test]
    fn image_specs_round_trip(
        pool in part("/@"),
        namespace in prop_oneof![Just(String::new()), part("/@")],
        image in part("/@"),
        snap in proptest::option::of(part("@")),
    ) {
        let spec = ImageSpec { pool, namespace, image, snap };
        prop_assert_eq!(ImageSpec::parse(&spec.to_string()).unwrap(), spec);
    }

    #[test]
    fn map_options_never_panic(s in ".{0,40}") {
        for kind in [MounterKind::Krbd, MounterKind::Fuse] {
            match options_for(&s, kind, "mapOptions") {
                Ok(opts) => prop_assert!(opts.iter().all(|o| !o.is_empty() && o.trim() == o)),
                Err(e) => prop_assert!(e.to_string().contains("mapOptions"), "{e}"),
            }
        }
    }

    #[test]
    fn map_options_pick_their_mounter(
        krbd in proptest::collection::vec("[a-z_]{1,8}(=[0-9]{1,4})?", 0..5),
        fuse in proptest::collection::vec("[a-z_]{1,8}", 0..5),
    ) {
        let value = format!("krbd:{};rbdkit-fuse:{}", krbd.join(","), fuse.join(","));
        prop_assert_eq!(options_for(&value, MounterKind::Krbd, "mapOptions").unwrap(), krbd);
        prop_assert_eq!(options_for(&value, MounterKind::Fuse, "mapOptions").unwrap(), fuse);
    }
}
