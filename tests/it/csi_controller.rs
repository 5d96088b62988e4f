//! The CSI Identity and Controller services over their unix socket, as
//! external-provisioner drives them, against the real test cluster.
use crate::support;

use std::collections::HashMap;

use rbdkit::csi::proto::{
    volume_content_source, CapacityRange, ControllerExpandVolumeRequest,
    ControllerGetCapabilitiesRequest, ControllerGetVolumeHealthRequest,
    ControllerListVolumeHealthRequest, CreateSnapshotRequest, CreateVolumeRequest,
    DeleteSnapshotRequest, DeleteVolumeRequest, GetCapacityRequest, GetPluginCapabilitiesRequest,
    GetPluginInfoRequest, GetSnapshotRequest, ListSnapshotsRequest, ListVolumesRequest,
    ProbeRequest, ValidateVolumeCapabilitiesRequest, VolumeContentSource,
};
use rbdkit::rbd::{self, Image};
use rbdkit::volume::ops::{owner_metadata, META_PROVISIONER, META_PV};
use rbdkit::volume::VolumeId;
use support::csi::{mount_cap, CsiEnv, Mode};
use tonic::Code;

const MIB: i64 = 1 << 20;

#[tokio::test(flavor = "multi_thread")]
async fn identity_reports_the_plugin_and_probes_ceph() {
    let env = CsiEnv::new("csi-ident", Mode::Controller).await;
    let mut id = env.identity().await;
    let info = id
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "rbd.rbdkit.io");
    assert!(!info.vendor_version.is_empty());
    let caps = id
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    let text = format!("{caps:?}");
    assert!(text.contains("VolumeExpansion"), "{text}");
    assert_eq!(caps.capabilities.len(), 4, "{text}");
    let probe = id.probe(ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true));
}

/// One decommissioned cluster in `config.json` must not make the plugin
/// unready: Probe is about this process, and provisioning on the other
/// clusters goes on. The dead cluster is reported by NodeGetStorageHealth.
#[tokio::test(flavor = "multi_thread")]
async fn probe_is_ready_with_an_unreachable_cluster_and_provisions_on_the_others() {
    let mut env = CsiEnv::new("csi-probe", Mode::All).await;
    // A second cluster whose two monitors do not answer (ports nothing
    // listens on); the server re-reads the config on restart.
    let dead: Vec<String> = (0..2)
        .map(|_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        })
        .collect();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(env.path("config.json")).unwrap()).unwrap();
    config.as_array_mut().unwrap().push(serde_json::json!({
        "clusterID": "decommissioned",
        "monitors": dead,
    }));
    std::fs::write(env.path("config.json"), config.to_string()).unwrap();
    env.csi.restart();
    let probe = env
        .identity()
        .await
        .probe(ProbeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        probe.ready,
        Some(true),
        "one dead cluster made Probe unready"
    );
    let id = env
        .create_volume("pvc-probe-live", 16 * MIB, mount_cap("ext4"))
        .await;
    assert!(!id.is_empty());
    let storage = env.storage_health().await;
    let reasons: Vec<(&str, &str)> = storage
        .backend_health
        .iter()
        .map(|b| (b.reason.as_str(), b.message.as_str()))
        .collect();
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert_eq!(reasons[0].0, "MonitorsUnreachable");
    assert!(
        reasons[0].1.contains("\"decommissioned\"") && reasons[0].1.contains(&dead[0]),
        "{reasons:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn create_is_idempotent_owned_and_refuses_a_different_size() {
    let env = CsiEnv::new("csi-create", Mode::Controller).await;
    let mut ctl = env.controller().await;
    let req = |bytes: i64| CreateVolumeRequest {
        name: "pvc-0000-create".into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_cap("ext4")],
        parameters: {
            let mut p = env.params();
            p.insert("csi.storage.k8s.io/pvc/name".into(), "data".into());
            p.insert("csi.storage.k8s.io/pvc/namespace".into(), "apps".into());
            p
        },
        secrets: env.secrets(),
        ..Default::default()
    };
    let first = ctl.create_volume(req(64 * MIB)).await.unwrap().into_inner();
    let vol = first.volume.unwrap();
    assert_eq!(vol.capacity_bytes, 64 * MIB);
    assert_eq!(vol.volume_context["imageName"], "pvc-0000-create");
    let again = ctl.create_volume(req(64 * MIB)).await.unwrap().into_inner();
    assert_eq!(again.volume.unwrap().volume_id, vol.volume_id);

    let id = VolumeId::parse(&vol.volume_id).unwrap();
    let img = Image::open_read_only(&env.rbd.ioctx, &id.image).unwrap();
    assert_eq!(img.size().unwrap(), 64 << 20);
    let owner = owner_metadata(&img).unwrap();
    assert_eq!(owner[META_PROVISIONER], "rbd.rbdkit.io");
    assert_eq!(owner[META_PV], "pvc-0000-create");
    assert_eq!(owner["rbdkit.pvc.name"], "data");
    drop(img);

    let e = ctl.create_volume(req(128 * MIB)).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    assert_eq!(rbd::list_names(&env.rbd.ioctx).unwrap().len(), 1);

    let del = || DeleteVolumeRequest {
        volume_id: vol.volume_id.clone(),
        secrets: env.secrets(),
    };
    ctl.delete_volume(del()).await.unwrap();
    ctl.delete_volume(del()).await.unwrap();
    assert!(rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_name_the_problem_and_create_nothing() {
    let env = CsiEnv::new("csi-bad", Mode::Controller).await;
    let mut ctl = env.controller().await;
    let base = || CreateVolumeRequest {
        name: "pvc-bad".into(),
        capacity_range: Some(CapacityRange {
            required_bytes: 16 * MIB,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_cap("ext4")],
        parameters: env.params(),
        secrets: env.secrets(),
        ..Default::default()
    };
    let key = env.secrets()["userKey"].clone();
    let cases: Vec<(&str, CreateVolumeRequest, Code, &str)> = vec![
        (
            "no name",
            CreateVolumeRequest {
                name: String::new(),
                ..base()
            },
            Code::InvalidArgument,
            "name",
        ),
        (
            "no caps",
            CreateVolumeRequest {
                volume_capabilities: vec![],
                ..base()
            },
            Code::InvalidArgument,
            "volume_capabilities",
        ),
        (
            "unknown param",
            {
                let mut r = base();
                r.parameters
                    .insert("imagefeatures".into(), "layering".into());
                r
            },
            Code::InvalidArgument,
            "imagefeatures",
        ),
        (
            "encrypted without a passphrase in the Secret",
            {
                let mut r = base();
                r.parameters.insert("encrypted".into(), "true".into());
                r
            },
            Code::InvalidArgument,
            "encryptionPassphrase",
        ),
        (
            "file encryption",
            {
                let mut r = base();
                r.parameters.insert("encrypted".into(), "true".into());
                r.parameters.insert("encryptionType".into(), "file".into());
                r
            },
            Code::InvalidArgument,
            "encryptionType",
        ),
        (
            "unknown cluster",
            {
                let mut r = base();
                r.parameters.insert("clusterID".into(), "nope".into());
                r
            },
            Code::InvalidArgument,
            "nope",
        ),
        (
            "wrong key",
            {
                let mut r = base();
                r.secrets.insert(
                    "userKey".into(),
                    "AQBzb21ldGhpbmcgZWxzZSBlbnRpcmVseQ==".into(),
                );
                r
            },
            Code::PermissionDenied,
            support::ceph::PROVISIONER_USER,
        ),
        (
            "limit below required",
            CreateVolumeRequest {
                capacity_range: Some(CapacityRange {
                    required_bytes: 10 * MIB,
                    limit_bytes: MIB,
                }),
                ..base()
            },
            Code::OutOfRange,
            "limit_bytes",
        ),
    ];
    for (what, req, code, word) in cases {
        let e = ctl.create_volume(req).await.expect_err(what);
        assert!(
            e.code() == code || (what == "wrong key" && e.code() != Code::Ok),
            "{what}: {e}"
        );
        assert!(e.message().contains(word), "{what}: {e}");
        assert!(!e.message().contains(&key), "{what}: key in error");
    }
    assert!(rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn expand_validate_list_and_capacity() {
    let env = CsiEnv::new("csi-misc", Mode::Controller).await;
    let mut ctl = env.controller().await;
    let caps = ctl
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 12);
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(
            env.create_volume(&format!("pvc-list-{i}"), 8 * MIB, mount_cap("xfs"))
                .await,
        );
    }
    // A foreign image in the same pool is not listed.
    rbd::create(&env.rbd.ioctx, "foreign", 1 << 20, &Default::default()).unwrap();

    // Health: nothing wrong with a new volume; a foreign image is no volume.
    let h = ctl
        .controller_get_volume_health(ControllerGetVolumeHealthRequest {
            volume_id: ids[0].clone(),
            secrets: env.secrets(),
        })
        .await
        .unwrap()
        .into_inner()
        .volume_health
        .unwrap();
    assert_eq!(
        (h.volume_id.as_str(), h.health_statuses.len()),
        (ids[0].as_str(), 0)
    );
    let mut foreign = VolumeId::parse(&ids[0]).unwrap();
    foreign.image = "foreign".into();
    for (id, code) in [
        (String::new(), Code::InvalidArgument),
        ("fake-vol-id".to_owned(), Code::NotFound),
        (foreign.handle(), Code::NotFound),
    ] {
        let e = ctl
            .controller_get_volume_health(ControllerGetVolumeHealthRequest {
                volume_id: id.clone(),
                secrets: env.secrets(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{id:?}: {e}");
    }
    let list = ctl
        .controller_list_volume_health(ControllerListVolumeHealthRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(list.entries.is_empty(), "{list:?}");
    let e = ctl
        .controller_list_volume_health(ControllerListVolumeHealthRequest {
            max_entries: -1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");

    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = ctl
            .list_volumes(ListVolumesRequest {
                max_entries: 2,
                starting_token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.entries.len() <= 2);
        seen.extend(
            page.entries
                .into_iter()
                .map(|e| e.volume.unwrap().volume_id),
        );
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    let mut want = ids.clone();
    want.sort();
    assert_eq!(seen, want);
    let e = ctl
        .list_volumes(ListVolumesRequest {
            max_entries: 0,
            starting_token: "bogus".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted);

    let grown = ctl
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: ids[0].clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 32 * MIB,
                limit_bytes: 0,
            }),
            secrets: env.secrets(),
            volume_capability: Some(mount_cap("xfs")),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 32 * MIB);
    assert!(grown.node_expansion_required);
    let id = VolumeId::parse(&ids[0]).unwrap();
    assert_eq!(
        Image::open_read_only(&env.rbd.ioctx, &id.image)
            .unwrap()
            .size()
            .unwrap(),
        32 << 20
    );
    // The foreign image cannot be expanded through a forged handle.
    let forged = VolumeId {
        image: "foreign".into(),
        ..id.clone()
    }
    .handle();
    let e = ctl
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: forged.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 64 * MIB,
                limit_bytes: 0,
            }),
            secrets: env.secrets(),
            volume_capability: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    let e = ctl
        .delete_volume(DeleteVolumeRequest {
            volume_id: forged,
            secrets: env.secrets(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(rbd::list_names(&env.rbd.ioctx)
        .unwrap()
        .contains(&"foreign".to_owned()));

    let ok = ctl
        .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
            volume_id: ids[1].clone(),
            volume_capabilities: vec![mount_cap("xfs")],
            secrets: env.secrets(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ok.confirmed.is_some(), "{}", ok.message);
    let missing = VolumeId {
        image: "no-such".into(),
        ..id.clone()
    }
    .handle();
    let e = ctl
        .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
            volume_id: missing,
            volume_capabilities: vec![mount_cap("xfs")],
            secrets: env.secrets(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");

    let cap = ctl
        .get_capacity(GetCapacityRequest {
            volume_capabilities: vec![],
            parameters: env.params(),
            accessible_topology: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(cap.available_capacity > 0);
    let any = ctl
        .get_capacity(GetCapacityRequest {
            volume_capabilities: vec![],
            parameters: HashMap::new(),
            accessible_topology: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(any.available_capacity > 0);

    for id in ids {
        ctl.delete_volume(DeleteVolumeRequest {
            volume_id: id,
            secrets: env.secrets(),
        })
        .await
        .unwrap();
    }
    assert_eq!(
        rbd::list_names(&env.rbd.ioctx).unwrap(),
        vec!["foreign".to_owned()]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshots_restores_and_clones() {
    let env = CsiEnv::new("csi-snap", Mode::Controller).await;
    let mut ctl = env.controller().await;
    let caps = format!(
        "{:?}",
        ctl.controller_get_capabilities(ControllerGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner()
    );
    for want in [
        "CreateDeleteSnapshot",
        "ListSnapshots",
        "CloneVolume",
        "GetSnapshot",
    ] {
        assert!(caps.contains(want), "{want}: {caps}");
    }
    let src = env
        .create_volume("pvc-snap-src", 16 * MIB, mount_cap("ext4"))
        .await;
    let other = env
        .create_volume("pvc-snap-other", 8 * MIB, mount_cap("ext4"))
        .await;
    let src_image = VolumeId::parse(&src).unwrap().image;
    let data = support::data::pattern(11, 1 << 20);
    let img = Image::open(&env.rbd.ioctx, &src_image).unwrap();
    img.write(0, &data).unwrap();
    img.close().unwrap();

    let snap_req = |source: &str, name: &str| CreateSnapshotRequest {
        source_volume_id: source.to_owned(),
        name: name.to_owned(),
        secrets: env.secrets(),
        parameters: HashMap::new(),
        ..Default::default()
    };
    let snap = ctl
        .create_snapshot(snap_req(&src, "snapshot-1"))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(snap.ready_to_use);
    assert_eq!(snap.size_bytes, 16 * MIB);
    assert_eq!(snap.source_volume_id, src);
    assert!(snap.creation_time.is_some());
    let again = ctl
        .create_snapshot(snap_req(&src, "snapshot-1"))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(again.snapshot_id, snap.snapshot_id);

    // Refusals.
    let e = ctl
        .create_snapshot(snap_req(&other, "snapshot-1"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    let missing_vol = VolumeId {
        image: "no-such".into(),
        ..VolumeId::parse(&src).unwrap()
    }
    .handle();
    let e = ctl
        .create_snapshot(snap_req(&missing_vol, "snapshot-2"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    let mut in_other_pool = snap_req(&src, "snapshot-3");
    in_other_pool
        .parameters
        .insert("pool".into(), "elsewhere".into());
    let e = ctl.create_snapshot(in_other_pool).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("pool"), "{e}");

    // Listing: all, by id, by source, in pages, and a bad token.
    let s2 = ctl
        .create_snapshot(snap_req(&other, "snapshot-4"))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    let list = |max: i32, token: &str, source: &str, id: &str| ListSnapshotsRequest {
        max_entries: max,
        starting_token: token.to_owned(),
        source_volume_id: source.to_owned(),
        snapshot_id: id.to_owned(),
        secrets: env.secrets(),
    };
    let all = ctl
        .list_snapshots(list(0, "", "", ""))
        .await
        .unwrap()
        .into_inner();
    let mut ids: Vec<String> = all
        .entries
        .iter()
        .map(|e| e.snapshot.clone().unwrap().snapshot_id)
        .collect();
    let mut want = vec![snap.snapshot_id.clone(), s2.snapshot_id.clone()];
    want.sort();
    ids.sort();
    assert_eq!(ids, want);
    let first = ctl
        .list_snapshots(list(1, "", "", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.entries.len(), 1);
    assert!(!first.next_token.is_empty());
    let second = ctl
        .list_snapshots(list(1, &first.next_token, "", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(second.entries.len(), 1);
    assert!(second.next_token.is_empty());
    let by_source = ctl
        .list_snapshots(list(0, "", &other, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_source.entries.len(), 1);
    assert_eq!(
        by_source.entries[0].snapshot.as_ref().unwrap().snapshot_id,
        s2.snapshot_id
    );
    let by_id = ctl
        .list_snapshots(list(0, "", "", &snap.snapshot_id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_id.entries.len(), 1);
    let none = ctl
        .list_snapshots(list(0, "", "", "rbdkit1-snap/x/y//z@rbdkit"))
        .await
        .unwrap()
        .into_inner();
    assert!(none.entries.is_empty());
    let got = ctl
        .get_snapshot(GetSnapshotRequest {
            snapshot_id: s2.snapshot_id.clone(),
            secrets: env.secrets(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.snapshot.unwrap(), s2);
    let e = ctl
        .get_snapshot(GetSnapshotRequest {
            snapshot_id: "rbdkit1-snap/x/y//z@rbdkit".into(),
            secrets: env.secrets(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    let e = ctl
        .list_snapshots(list(0, "nope", "", ""))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "{e}");

    // Restore (bigger) and clone (source size); both hold the data.
    let from = |source: volume_content_source::Type, name: &str, bytes: i64| CreateVolumeRequest {
        name: name.to_owned(),
        capacity_range: (bytes > 0).then_some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_cap("ext4")],
        parameters: env.params(),
        secrets: env.secrets(),
        volume_content_source: Some(VolumeContentSource {
            r#type: Some(source),
        }),
        ..Default::default()
    };
    let of_snap = |id: &str| {
        volume_content_source::Type::Snapshot(volume_content_source::SnapshotSource {
            snapshot_id: id.to_owned(),
        })
    };
    let of_vol = |id: &str| {
        volume_content_source::Type::Volume(volume_content_source::VolumeSource {
            volume_id: id.to_owned(),
        })
    };
    let restored = ctl
        .create_volume(from(of_snap(&snap.snapshot_id), "pvc-restore", 32 * MIB))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(restored.capacity_bytes, 32 * MIB);
    assert!(restored.content_source.is_some());
    let cloned = ctl
        .create_volume(from(of_vol(&src), "pvc-clone", 0))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(cloned.capacity_bytes, 16 * MIB);
    for id in [&restored.volume_id, &cloned.volume_id] {
        let name = VolumeId::parse(id).unwrap().image;
        let img = Image::open_read_only(&env.rbd.ioctx, &name).unwrap();
        let mut buf = vec![0u8; data.len()];
        img.read_exact(0, &mut buf).unwrap();
        assert!(buf == data, "{name} does not hold the source's data");
    }
    let again = ctl
        .create_volume(from(of_vol(&src), "pvc-clone", 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.volume.unwrap().volume_id, cloned.volume_id);
    let e = ctl
        .create_volume(from(of_vol(&other), "pvc-clone", 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    let e = ctl
        .create_volume(from(of_snap(&snap.snapshot_id), "pvc-small", 8 * MIB))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{e}");
    let missing_snap = snap.snapshot_id.replace("snapshot-1", "snapshot-none");
    for (what, source) in [
        ("missing snapshot", of_snap(&missing_snap)),
        ("unreadable snapshot id", of_snap("nonsense")),
        ("missing volume", of_vol(&missing_vol)),
    ] {
        let e = ctl
            .create_volume(from(source, "pvc-missing", 0))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{what}: {e}");
    }
    let mut elsewhere = from(of_vol(&src), "pvc-elsewhere", 0);
    elsewhere
        .parameters
        .insert("pool".into(), "elsewhere".into());
    let e = ctl.create_volume(elsewhere).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("another cluster, pool"), "{e}");

    // ListVolumes shows volumes only, not snapshot images.
    let vols = ctl
        .list_volumes(ListVolumesRequest {
            max_entries: 0,
            starting_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(vols.entries.len(), 4, "{vols:?}");

    // The source and the snapshot go while their clones live; the last
    // clone's delete purges them.
    let del_vol = |id: &str| DeleteVolumeRequest {
        volume_id: id.to_owned(),
        secrets: env.secrets(),
    };
    let del_snap = |id: &str| DeleteSnapshotRequest {
        snapshot_id: id.to_owned(),
        secrets: env.secrets(),
    };
    ctl.delete_volume(del_vol(&src)).await.unwrap();
    ctl.delete_snapshot(del_snap(&snap.snapshot_id))
        .await
        .unwrap();
    ctl.delete_snapshot(del_snap(&snap.snapshot_id))
        .await
        .unwrap();
    ctl.delete_snapshot(del_snap("not-a-snapshot-id"))
        .await
        .unwrap();
    assert_eq!(rbd::trash_list(&env.rbd.ioctx).unwrap().len(), 2);
    for id in [&restored.volume_id, &cloned.volume_id, &other] {
        ctl.delete_volume(del_vol(id)).await.unwrap();
    }
    ctl.delete_snapshot(del_snap(&s2.snapshot_id))
        .await
        .unwrap();
    ctl.delete_volume(del_vol(&other)).await.unwrap();
    assert!(rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());
    assert!(rbd::trash_list(&env.rbd.ioctx).unwrap().is_empty());
}

/// ControllerListVolumeHealth with one pool that cannot be read (its
/// cluster's monitor and OSD stopped): the volumes the last list found
/// there are reported inaccessible, naming the pool and the error, and the
/// other pools are listed all the same. Before, the one pool's error was
/// the whole list's, and nothing was listed.
#[tokio::test(flavor = "multi_thread")]
async fn list_volume_health_reports_an_unreadable_pool_and_lists_the_others() {
    let creds = tempfile::tempdir().unwrap();
    let dir = creds.path().display().to_string();
    let mut env = CsiEnv::with_ns(
        std::sync::Arc::new(support::ceph::TestNs::new("csi-hlist")),
        support::ceph::unique("csi-hlist"),
        Mode::Controller,
        "node-a",
        &["--ceph-op-timeout", "5s", "--credentials-dir", &dir],
    )
    .await;
    let other = support::ceph::PrivateCluster::start("hlist");
    // The controller's own credentials, read at each use: the test user
    // for every cluster, admin for the other one.
    let write = |name: &str, v: &str| std::fs::write(creds.path().join(name), v).unwrap();
    write("userID", support::ceph::PROVISIONER_USER);
    write("userKey", &support::ceph::provisioner_key());
    write("hlist-other.userID", "admin");
    write("hlist-other.userKey", &other.admin_key());
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(env.path("config.json")).unwrap()).unwrap();
    config.as_array_mut().unwrap().push(serde_json::json!({
        "clusterID": "hlist-other",
        "monitors": [other.conf_value("mon host").unwrap()],
    }));
    std::fs::write(env.path("config.json"), config.to_string()).unwrap();
    env.csi.restart();
    let live = env
        .create_volume("pvc-hlist-live", 8 * MIB, mount_cap("ext4"))
        .await;
    let mut ctl = env.controller().await;
    let made = ctl
        .create_volume(CreateVolumeRequest {
            name: "pvc-hlist-other".into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 8 * MIB,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_cap("ext4")],
            parameters: HashMap::from([
                ("clusterID".to_owned(), "hlist-other".to_owned()),
                ("pool".to_owned(), support::ceph::POOL.to_owned()),
            ]),
            secrets: HashMap::from([
                ("userID".to_owned(), "admin".to_owned()),
                ("userKey".to_owned(), other.admin_key()),
            ]),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create on the other cluster: {e}"))
        .into_inner();
    let gone = made.volume.unwrap().volume_id;
    let list = || async {
        env.controller()
            .await
            .controller_list_volume_health(ControllerListVolumeHealthRequest::default())
            .await
    };
    let first = list().await.unwrap().into_inner();
    assert!(first.entries.is_empty(), "both healthy: {first:?}");

    // One volume's health with its pool's OSD down: an error that says the
    // volume cannot be read (the op timeout), never NOT_FOUND: it exists.
    other.stop_daemon("osd.0");
    let e = env
        .controller()
        .await
        .controller_get_volume_health(ControllerGetVolumeHealthRequest {
            volume_id: gone.clone(),
            ..Default::default()
        })
        .await
        .expect_err("health of a volume whose OSD is down");
    assert_ne!(e.code(), Code::NotFound, "{e}");
    other.stop_daemon("mon.a");
    let after = list()
        .await
        .unwrap_or_else(|e| panic!("one unreadable pool failed the whole list: {e}"))
        .into_inner();
    let check = |after: &rbdkit::csi::proto::ControllerListVolumeHealthResponse| {
        let ids: Vec<&str> = after.entries.iter().map(|e| e.volume_id.as_str()).collect();
        assert_eq!(ids, vec![gone.as_str()], "{after:?}");
        let h = &after.entries[0].health_statuses[0];
        assert_eq!(h.reason, "PoolUnreadable", "{h:?}");
        assert!(h.message.contains("\"hlist-other\""), "{h:?}");
        assert!(!ids.contains(&live.as_str()));
    };
    check(&after);
    // A restarted controller still knows what was in the pool it cannot
    // read (its index in --state-dir), and does not call it healthy.
    env.csi.restart();
    let restarted = env
        .controller()
        .await
        .controller_list_volume_health(ControllerListVolumeHealthRequest::default())
        .await
        .unwrap_or_else(|e| panic!("after a restart: {e}"))
        .into_inner();
    check(&restarted);
    drop(other);
}

/// ListVolumes and ControllerListVolumeHealth carry no secrets. After a
/// kill -9 and restart, a controller with credentials of its own
/// (`--credentials-dir`, a mounted Secret) lists every volume at once: the
/// pools come from its index in `--state-dir`, and without that (a new
/// pod) from the cluster's RBD pools. A pool the user may not read (the
/// provisioner user has `profile rbd` on the test pool only) is skipped.
/// Before, a restarted controller knew no pool, and listed nothing, until
/// a call with secrets brought one.
#[tokio::test(flavor = "multi_thread")]
async fn lists_know_every_volume_after_a_restart() {
    let creds = tempfile::tempdir().unwrap();
    let cluster_id = support::ceph::unique("csi-relist");
    std::fs::write(
        creds.path().join(format!("{cluster_id}.userID")),
        support::ceph::PROVISIONER_USER,
    )
    .unwrap();
    std::fs::write(
        creds.path().join(format!("{cluster_id}.userKey")),
        support::ceph::provisioner_key(),
    )
    .unwrap();
    let dir = creds.path().display().to_string();
    let mut env = CsiEnv::with_ns(
        std::sync::Arc::new(support::ceph::TestNs::new("csi-relist")),
        cluster_id,
        Mode::Controller,
        "node-a",
        &["--credentials-dir", &dir],
    )
    .await;
    let mut made = Vec::new();
    for i in 0..2 {
        made.push(
            env.create_volume(&format!("pvc-relist-{i}"), 8 * MIB, mount_cap("ext4"))
                .await,
        );
    }
    made.sort();
    let listed = |env: &CsiEnv| {
        let socket = env.path("csi.sock");
        async move {
            let mut ctl = rbdkit::csi::proto::controller_client::ControllerClient::new(
                support::csi::channel(&socket).await,
            );
            let mut ids: Vec<String> = ctl
                .list_volumes(ListVolumesRequest::default())
                .await
                .unwrap_or_else(|e| panic!("ListVolumes: {e}"))
                .into_inner()
                .entries
                .into_iter()
                .map(|e| e.volume.unwrap().volume_id)
                .collect();
            ids.sort();
            let health = ctl
                .controller_list_volume_health(ControllerListVolumeHealthRequest::default())
                .await
                .unwrap_or_else(|e| panic!("ControllerListVolumeHealth: {e}"))
                .into_inner();
            assert!(health.entries.is_empty(), "{health:?}");
            ids
        }
    };
    assert_eq!(listed(&env).await, made);
    env.csi.restart();
    assert_eq!(
        listed(&env).await,
        made,
        "after a restart, with the pool index"
    );
    std::fs::remove_file(env.path("csi-state/controller-pools.json"))
        .expect("the controller keeps its pool index in --state-dir");
    env.csi.restart();
    assert_eq!(
        listed(&env).await,
        made,
        "after a restart, found in the cluster"
    );
}
