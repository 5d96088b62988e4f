//! QoS through the CSI controller against the real cluster: ceph-csi's
//! StorageClass parameters and a VolumeAttributesClass's (CreateVolume's
//! and ControllerModifyVolume's `mutable_parameters`, as the
//! external-resizer sends them) become librbd's per-image limits, bad ones
//! are refused by name with nothing made or changed, and rbdkit-fuse's
//! mapper throttles a mapped volume as soon as its limit changes.
use crate::support;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use rbdkit::csi::proto::{
    CapacityRange, ControllerExpandVolumeRequest, ControllerModifyVolumeRequest,
    CreateVolumeRequest,
};
use rbdkit::rbd::{self, Image};
use rbdkit::volume::VolumeId;
use support::csi::{block_cap, CsiEnv, Mode};
use support::data::{open_direct, pattern, Aligned};
use tonic::Code;

const MIB: i64 = 1 << 20;
const GIB: i64 = 1 << 30;

/// The image's QoS metadata: its policy and librbd's limits.
fn qos_meta(env: &CsiEnv, id: &str) -> Vec<(String, String)> {
    let vol = VolumeId::parse(id).unwrap();
    let img = Image::open_read_only(&env.rbd.ioctx, &vol.image).unwrap();
    let meta = img.metadata_list().unwrap();
    meta.into_iter()
        .filter(|(k, _)| k.starts_with("rbdkit.qos.") || k.starts_with("conf_rbd_qos_"))
        .collect()
}

fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    p.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn map(p: &[(&str, &str)]) -> HashMap<String, String> {
    pairs(p).into_iter().collect()
}

fn create(
    env: &CsiEnv,
    name: &str,
    bytes: i64,
    class: &[(&str, &str)],
    mutable: &[(&str, &str)],
) -> CreateVolumeRequest {
    let mut parameters = env.params();
    parameters.extend(map(class));
    CreateVolumeRequest {
        name: name.to_owned(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![block_cap()],
        parameters,
        mutable_parameters: map(mutable),
        secrets: env.secrets(),
        ..Default::default()
    }
}

fn modify(env: &CsiEnv, id: &str, mutable: &[(&str, &str)]) -> ControllerModifyVolumeRequest {
    ControllerModifyVolumeRequest {
        volume_id: id.to_owned(),
        secrets: env.secrets(),
        mutable_parameters: map(mutable),
    }
}

/// `n` 4 KiB direct writes, one after the other; how long they took.
fn timed_writes(dev: &std::path::Path, n: u64) -> Duration {
    let f = open_direct(dev, true);
    let mut buf = Aligned::new(4096);
    let t = Instant::now();
    for i in 0..n {
        buf.copy_from_slice(&pattern(i, 4096));
        f.write_all_at(&buf, i * 4096).unwrap();
    }
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread")]
async fn qos_is_set_at_create_changed_by_modify_and_throttles_the_mapper() {
    let env = CsiEnv::new("csi-qos", Mode::All).await;
    let mut ctl = env.controller().await;

    // Bad input: refused by name, nothing made.
    for (class, mutable, named) in [
        (&[("BaseWriteIops", "0")][..], &[][..], "BaseWriteIops"),
        (&[][..], &[("fooIops", "1")][..], "fooIops"),
        (&[][..], &[("maxWriteIops", "soon")][..], "maxWriteIops"),
    ] {
        let e = ctl
            .create_volume(create(&env, "pvc-bad", 64 * MIB, class, mutable))
            .await
            .expect_err("a bad QoS parameter");
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains(named), "{e}");
    }
    assert!(rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());

    // The class's limit, the VolumeAttributesClass's over it, and growth
    // per GiB above a base size.
    let id = ctl
        .create_volume(create(
            &env,
            "pvc-q",
            2 * GIB,
            &[("BaseWriteIops", "1000"), ("BaseReadIops", "500")],
            &[
                ("baseWriteIops", "100"),
                ("writeIopsPerGiB", "10"),
                ("baseVolSizeBytes", &GIB.to_string()),
            ],
        ))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let meta = qos_meta(&env, &id);
    let get = |k: &str| meta.iter().find(|(m, _)| m == k).map(|(_, v)| v.clone());
    assert_eq!(get("conf_rbd_qos_write_iops_limit").as_deref(), Some("110"));
    assert_eq!(get("conf_rbd_qos_read_iops_limit").as_deref(), Some("500"));
    assert_eq!(get("rbdkit.qos.baseWriteIops").as_deref(), Some("100"));

    // An expansion grows the per-GiB limit with the size.
    ctl.controller_expand_volume(ControllerExpandVolumeRequest {
        volume_id: id.clone(),
        capacity_range: Some(CapacityRange {
            required_bytes: 4 * GIB,
            limit_bytes: 0,
        }),
        secrets: env.secrets(),
        ..Default::default()
    })
    .await
    .unwrap();
    let meta = qos_meta(&env, &id);
    assert!(
        meta.contains(&("conf_rbd_qos_write_iops_limit".into(), "130".into())),
        "{meta:?}"
    );

    // A modify that does not fit together changes nothing.
    let e = ctl
        .controller_modify_volume(modify(&env, &id, &[("maxWriteIops", "bad")]))
        .await
        .expect_err("a bad value");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("maxWriteIops"), "{e}");
    assert_eq!(qos_meta(&env, &id), meta);

    // `max` removes a limit; what the request leaves out stays.
    ctl.controller_modify_volume(modify(&env, &id, &[("baseReadIops", "max")]))
        .await
        .unwrap();
    let meta = qos_meta(&env, &id);
    assert!(
        !meta.iter().any(|(k, _)| k.contains("read_iops")),
        "{meta:?}"
    );
    assert!(
        meta.contains(&("conf_rbd_qos_write_iops_limit".into(), "130".into())),
        "{meta:?}"
    );

    // The mapper: unthrottled first, then a limit set while it is mapped
    // throttles it at once (librbd reads the new per-image limit when the
    // header changes). 40 writes per second, 120 writes: at least 2 s
    // (the first second's 40 may pass at once).
    let plain = env.create_volume("pvc-plain", 64 * MIB, block_cap()).await;
    let staging = env.path("staging-plain");
    std::fs::create_dir_all(&staging).unwrap();
    env.node()
        .await
        .node_stage_volume(env.stage_request(&plain, &staging, block_cap()))
        .await
        .unwrap();
    let dev = rbdkit::csi::node::Stash::read(&staging)
        .unwrap()
        .expect("a stash")
        .device
        .expect("a device");
    let free = timed_writes(&dev, 120);
    ctl.controller_modify_volume(modify(&env, &plain, &[("maxWriteIops", "40")]))
        .await
        .unwrap();
    let throttled = timed_writes(&dev, 120);
    eprintln!("120 writes of 4 KiB: {free:?} unthrottled, {throttled:?} at 40 IOPS");
    assert!(
        throttled >= Duration::from_millis(1900),
        "not throttled: {throttled:?}"
    );

    env.unstage(&plain, &staging).await;
    for v in [&id, &plain] {
        env.delete_volume(v).await.unwrap();
    }
    assert!(rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());
}
