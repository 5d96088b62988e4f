//! The CSI GroupController (volume group snapshots) over its unix socket,
//! as csi-snapshotter's group role drives it, against the real test
//! cluster: one instant for every member, a member restored as any
//! snapshot, re-runs adopted, nothing left behind.
use crate::support;

use rbdkit::csi::proto::group_controller_client::GroupControllerClient;
use rbdkit::csi::proto::{
    plugin_capability, volume_content_source, CapacityRange, CreateVolumeGroupSnapshotRequest,
    CreateVolumeRequest, DeleteSnapshotRequest, DeleteVolumeGroupSnapshotRequest,
    DeleteVolumeRequest, GetPluginCapabilitiesRequest, GetSnapshotRequest,
    GetVolumeGroupSnapshotRequest, GroupControllerGetCapabilitiesRequest, VolumeContentSource,
    VolumeGroupSnapshot,
};
use rbdkit::rbd::{self, Image, SnapNamespaceType};
use rbdkit::volume::gc;
use rbdkit::volume::group_snapshot::META_GROUP_SNAPSHOT;
use rbdkit::volume::ops::{META_CLUSTER, META_PROVISIONER, META_PV};
use rbdkit::volume::snapshot::{KIND_SNAPSHOT, META_KIND, META_SNAPSHOT, META_SOURCE, SNAP_NAME};
use rbdkit::volume::{GroupSnapshotId, SnapshotId, VolumeId};
use std::time::Duration;
use support::ceph::POOL;
use support::csi::{mount_cap, CsiEnv, Mode};
use tonic::Code;

const MIB: i64 = 1 << 20;

/// A volume a group snapshot can take: its class gives exclusive-lock.
async fn locked_volume(env: &CsiEnv, name: &str) -> String {
    locked_volume_of(env, name, 8 * MIB).await
}

/// [`locked_volume`] of `bytes`.
async fn locked_volume_of(env: &CsiEnv, name: &str, bytes: i64) -> String {
    let mut params = env.params();
    params.insert("imageFeatures".into(), "layering,exclusive-lock".into());
    env.controller()
        .await
        .create_volume(CreateVolumeRequest {
            name: name.to_owned(),
            capacity_range: Some(CapacityRange {
                required_bytes: bytes,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_cap("xfs")],
            parameters: params,
            secrets: env.secrets(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("CreateVolume {name}: {e}"))
        .into_inner()
        .volume
        .unwrap()
        .volume_id
}

/// CreateVolumeGroupSnapshot called again while it answers not ready, as
/// csi-snapshotter does; the ready group snapshot. Every answer names the
/// same group snapshot and members.
async fn create_until_ready(
    group: &mut GroupControllerClient<tonic::transport::Channel>,
    req: CreateVolumeGroupSnapshotRequest,
) -> VolumeGroupSnapshot {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut first: Option<VolumeGroupSnapshot> = None;
    loop {
        let gs = match group.create_volume_group_snapshot(req.clone()).await {
            Ok(r) => r.into_inner().group_snapshot.unwrap(),
            // Retried, as by the CO (a killed copy's watch, for one).
            Err(e) if e.code() == Code::Aborted && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                continue;
            }
            Err(e) => panic!("CreateVolumeGroupSnapshot {}: {e}", req.name),
        };
        assert_eq!(gs.snapshots.len(), req.source_volume_ids.len(), "{gs:?}");
        if let Some(f) = &first {
            assert_eq!(gs.group_snapshot_id, f.group_snapshot_id);
            assert_eq!(member_ids(&gs), member_ids(f));
        }
        if gs.ready_to_use {
            assert!(gs.snapshots.iter().all(|s| s.ready_to_use), "{gs:?}");
            return gs;
        }
        first.get_or_insert(gs);
        assert!(
            std::time::Instant::now() < deadline,
            "{} not ready in 120 s",
            req.name
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// GetVolumeGroupSnapshot of `gs`, naming its members.
async fn get_group(
    group: &mut GroupControllerClient<tonic::transport::Channel>,
    env: &CsiEnv,
    gs: &VolumeGroupSnapshot,
) -> VolumeGroupSnapshot {
    group
        .get_volume_group_snapshot(GetVolumeGroupSnapshotRequest {
            group_snapshot_id: gs.group_snapshot_id.clone(),
            snapshot_ids: member_ids(gs),
            secrets: env.secrets(),
        })
        .await
        .unwrap_or_else(|e| panic!("GetVolumeGroupSnapshot: {e}"))
        .into_inner()
        .group_snapshot
        .unwrap()
}

/// A group snapshot's member ids, sorted.
fn member_ids(g: &VolumeGroupSnapshot) -> Vec<String> {
    let mut v: Vec<String> = g.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();
    v.sort();
    v
}

fn write(env: &CsiEnv, id: &str, data: &[u8]) {
    let vol = VolumeId::parse(id).unwrap();
    let img = Image::open(&env.rbd.ioctx, &vol.image).unwrap();
    img.write(MIB as u64, data).unwrap();
    img.flush().unwrap();
}

fn read(env: &CsiEnv, id: &str, len: usize) -> Vec<u8> {
    let vol = VolumeId::parse(id).unwrap();
    let img = Image::open_read_only(&env.rbd.ioctx, &vol.image).unwrap();
    let mut buf = vec![0u8; len];
    img.read_exact(MIB as u64, &mut buf).unwrap();
    buf
}

#[tokio::test(flavor = "multi_thread")]
async fn group_snapshot_is_one_instant_and_a_member_restores() {
    let env = CsiEnv::new("csi-group", Mode::Controller).await;
    let caps = env
        .identity()
        .await
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    let group_service = plugin_capability::service::Type::GroupControllerService as i32;
    assert!(
        caps.capabilities.iter().any(|c| matches!(
            &c.r#type,
            Some(plugin_capability::Type::Service(s)) if s.r#type == group_service
        )),
        "{caps:?}"
    );
    let mut group = GroupControllerClient::new(support::csi::channel(&env.socket).await);
    let gcaps = group
        .group_controller_get_capabilities(GroupControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(gcaps.capabilities.len(), 1);

    let a = locked_volume(&env, "pvc-ga").await;
    let b = locked_volume(&env, "pvc-gb").await;
    write(&env, &a, b"a before");
    write(&env, &b, b"b before");
    let req = |name: &str, ids: Vec<String>| CreateVolumeGroupSnapshotRequest {
        name: name.to_owned(),
        source_volume_ids: ids,
        secrets: env.secrets(),
        parameters: Default::default(),
    };
    let gs = create_until_ready(
        &mut group,
        req("groupsnapshot-1", vec![a.clone(), b.clone()]),
    )
    .await;
    write(&env, &a, b"a after!");
    write(&env, &b, b"b after!");
    assert!(gs.ready_to_use);
    assert!(gs.creation_time.is_some());
    let gid = GroupSnapshotId::parse(&gs.group_snapshot_id).unwrap();
    assert_eq!(gid.name, "groupsnapshot-1");
    assert_eq!(gs.snapshots.len(), 2);
    let mut sources: Vec<&str> = gs
        .snapshots
        .iter()
        .map(|s| s.source_volume_id.as_str())
        .collect();
    sources.sort();
    let mut want = vec![a.as_str(), b.as_str()];
    want.sort();
    assert_eq!(sources, want);
    for s in &gs.snapshots {
        assert_eq!(s.group_snapshot_id, gs.group_snapshot_id);
        assert!(s.ready_to_use);
        // Each member is an ordinary snapshot.
        SnapshotId::parse(&s.snapshot_id).unwrap();
        env.controller()
            .await
            .get_snapshot(GetSnapshotRequest {
                snapshot_id: s.snapshot_id.clone(),
                secrets: env.secrets(),
            })
            .await
            .unwrap();
    }
    // No group is left in the pool: the sources are free again.
    assert!(rbd::group_list(&env.rbd.ioctx).unwrap().is_empty());

    // A re-run (the CO retrying) gets the same group snapshot, of the
    // first instant.
    let again = create_until_ready(
        &mut group,
        req("groupsnapshot-1", vec![b.clone(), a.clone()]),
    )
    .await;
    assert_eq!(again.group_snapshot_id, gs.group_snapshot_id);
    let ids = member_ids;
    assert_eq!(ids(&again), ids(&gs));
    let got = get_group(&mut group, &env, &gs).await;
    assert_eq!(ids(&got), ids(&gs));

    // Restore member a into a new volume: the data of the instant.
    let member_a = gs
        .snapshots
        .iter()
        .find(|s| s.source_volume_id == a)
        .unwrap()
        .snapshot_id
        .clone();
    let member_b = gs
        .snapshots
        .iter()
        .find(|s| s.source_volume_id == b)
        .unwrap()
        .snapshot_id
        .clone();
    let restored = env
        .controller()
        .await
        .create_volume(CreateVolumeRequest {
            name: "pvc-from-member".into(),
            volume_capabilities: vec![mount_cap("xfs")],
            parameters: env.params(),
            secrets: env.secrets(),
            volume_content_source: Some(VolumeContentSource {
                r#type: Some(volume_content_source::Type::Snapshot(
                    volume_content_source::SnapshotSource {
                        snapshot_id: member_a.clone(),
                    },
                )),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(read(&env, &restored.volume_id, 8), b"a before");
    let restored_b = env
        .controller()
        .await
        .create_volume(CreateVolumeRequest {
            name: "pvc-from-member-b".into(),
            volume_capabilities: vec![mount_cap("xfs")],
            parameters: env.params(),
            secrets: env.secrets(),
            volume_content_source: Some(VolumeContentSource {
                r#type: Some(volume_content_source::Type::Snapshot(
                    volume_content_source::SnapshotSource {
                        snapshot_id: member_b,
                    },
                )),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(read(&env, &restored_b.volume_id, 8), b"b before");

    // Bad requests name the field.
    for (r, code, field) in [
        (req("", vec![a.clone()]), Code::InvalidArgument, "name"),
        (
            req("gs-2", vec![]),
            Code::InvalidArgument,
            "source_volume_ids",
        ),
        (
            req("gs-2", vec![a.clone(), a.clone()]),
            Code::InvalidArgument,
            "source_volume_ids",
        ),
        (
            req("gs-2", vec!["fake-vol-id".into()]),
            Code::NotFound,
            "source_volume_ids",
        ),
    ] {
        let e = group.create_volume_group_snapshot(r).await.unwrap_err();
        assert_eq!(e.code(), code, "{e}");
        assert!(e.message().contains(field), "{e}");
    }
    let e = group
        .get_volume_group_snapshot(GetVolumeGroupSnapshotRequest {
            group_snapshot_id: gs.group_snapshot_id.clone(),
            snapshot_ids: vec![restored.volume_id.replace("rbdkit1/", "rbdkit1-snap/") + "@x"],
            secrets: env.secrets(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("snapshot_ids"), "{e}");

    // The restores outlive the group snapshot.
    let delete = || DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: gs.group_snapshot_id.clone(),
        snapshot_ids: ids(&gs),
        secrets: env.secrets(),
    };
    group.delete_volume_group_snapshot(delete()).await.unwrap();
    group.delete_volume_group_snapshot(delete()).await.unwrap();
    let e = group
        .get_volume_group_snapshot(GetVolumeGroupSnapshotRequest {
            group_snapshot_id: gs.group_snapshot_id.clone(),
            snapshot_ids: Vec::new(),
            secrets: env.secrets(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    // A member deleted on its own is gone too.
    env.controller()
        .await
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: member_a,
            secrets: env.secrets(),
        })
        .await
        .unwrap();
    assert_eq!(read(&env, &restored.volume_id, 8), b"a before");
    for id in [restored.volume_id, restored_b.volume_id, a, b] {
        env.controller()
            .await
            .delete_volume(DeleteVolumeRequest {
                volume_id: id,
                secrets: env.secrets(),
            })
            .await
            .unwrap();
    }
    let left: Vec<String> = rbd::list_names(&env.rbd.ioctx).unwrap();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn group_snapshot_create_adopts_what_an_interrupted_run_left() {
    let env = CsiEnv::new("csi-group-crash", Mode::Controller).await;
    let mut group = GroupControllerClient::new(support::csi::channel(&env.socket).await);
    let a = locked_volume(&env, "pvc-ca").await;
    let b = locked_volume(&env, "pvc-cb").await;
    let (va, vb) = (VolumeId::parse(&a).unwrap(), VolumeId::parse(&b).unwrap());
    write(&env, &a, b"a instant");
    write(&env, &b, b"b instant");
    // As a run killed right after taking the RBD group snapshot, and while
    // it was making member b under its temporary name, leaves things.
    let io = &env.rbd.ioctx;
    rbd::group_create(io, "gs-crash").unwrap();
    rbd::group_image_add(io, "gs-crash", io, &va.image).unwrap();
    rbd::group_image_add(io, "gs-crash", io, &vb.image).unwrap();
    rbd::group_snap_create(io, "gs-crash", "rbdkit").unwrap();
    let temp = format!("gs-crash-{}.rbdkit-new", vb.image);
    rbd::create(io, &temp, MIB as u64, &Default::default()).unwrap();
    write(&env, &a, b"a later!!");
    write(&env, &b, b"b later!!");

    let req = || CreateVolumeGroupSnapshotRequest {
        name: "gs-crash".into(),
        source_volume_ids: vec![a.clone(), b.clone()],
        secrets: env.secrets(),
        parameters: Default::default(),
    };
    let gs = create_until_ready(&mut group, req()).await;
    // The re-run used the instant the first run took, not a new one.
    for s in &gs.snapshots {
        let sid = SnapshotId::parse(&s.snapshot_id).unwrap();
        let img = Image::open_read_only(io, &sid.image).unwrap();
        let mut buf = [0u8; 9];
        img.read_exact(MIB as u64, &mut buf).unwrap();
        let want: &[u8] = if s.source_volume_id == a {
            b"a instant"
        } else {
            b"b instant"
        };
        assert_eq!(&buf[..], want);
    }
    assert!(rbd::group_list(io).unwrap().is_empty());
    let names = rbd::list_names(io).unwrap();
    assert!(!names.contains(&temp), "{names:?}");

    // A member deleted on its own, the group snapshot gone: a re-run cannot
    // make it again from the same instant, and says so.
    let member_b = gs
        .snapshots
        .iter()
        .find(|s| s.source_volume_id == b)
        .unwrap()
        .snapshot_id
        .clone();
    env.controller()
        .await
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: member_b,
            secrets: env.secrets(),
        })
        .await
        .unwrap();
    let e = group.create_volume_group_snapshot(req()).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    assert!(e.message().contains("take it again"), "{e}");

    group
        .delete_volume_group_snapshot(DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: gs.group_snapshot_id.clone(),
            snapshot_ids: Vec::new(),
            secrets: env.secrets(),
        })
        .await
        .unwrap();
    for id in [a, b] {
        env.controller()
            .await
            .delete_volume(DeleteVolumeRequest {
                volume_id: id,
                secrets: env.secrets(),
            })
            .await
            .unwrap();
    }
    let left: Vec<String> = rbd::list_names(io).unwrap();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// G1 of (A, B) and G2 of (C, B) requested together: G2 adds C, then fails
/// on B. Before, C stayed in G2's RBD group (DeleteVolume of it INTERNAL
/// for ever) and the error was ALREADY_EXISTS, which external-snapshotter
/// never retries.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_group_snapshot_leaves_no_group_and_every_source_deletable() {
    let env = CsiEnv::new("csi-group-fail", Mode::Controller).await;
    let io = &env.rbd.ioctx;
    let mut group = GroupControllerClient::new(support::csi::channel(&env.socket).await);
    let b = locked_volume(&env, "pvc-fb").await;
    let c = locked_volume(&env, "pvc-fc").await;
    let b_image = VolumeId::parse(&b).unwrap().image;
    // G1 is being taken: B is in its RBD group (marked as rbdkit's, as
    // the create does first), no snapshot yet.
    io.write_full("rbdkit.group.groupsnapshot-g1", b"").unwrap();
    rbd::group_create(io, "groupsnapshot-g1").unwrap();
    rbd::group_image_add(io, "groupsnapshot-g1", io, &b_image).unwrap();

    let e = group
        .create_volume_group_snapshot(CreateVolumeGroupSnapshotRequest {
            name: "groupsnapshot-g2".into(),
            source_volume_ids: vec![c.clone(), b.clone()],
            secrets: env.secrets(),
            parameters: Default::default(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "a code the CO retries: {e}");
    assert!(e.message().contains(&b_image), "{e}");
    // Nothing of G2 is left.
    assert_eq!(rbd::group_list(io).unwrap(), vec!["groupsnapshot-g1"]);
    env.delete_volume(&c)
        .await
        .unwrap_or_else(|e| panic!("C, after the failed G2: {e}"));

    // G1's create was killed and given up: deleting B takes it out of the
    // group it was left in, and the group goes with its last member.
    env.delete_volume(&b)
        .await
        .unwrap_or_else(|e| panic!("B, left in G1's group: {e}"));
    assert!(rbd::group_list(io).unwrap().is_empty());
    assert!(io.stat("rbdkit.group.groupsnapshot-g1").is_err());

    // Someone else's group is left alone, and named.
    let d = env.create_volume("pvc-fd", 8 * MIB, mount_cap("xfs")).await;
    let d_image = VolumeId::parse(&d).unwrap().image;
    rbd::group_create(io, "user-group").unwrap();
    rbd::group_image_add(io, "user-group", io, &d_image).unwrap();
    let e = env.delete_volume(&d).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("user-group"), "{e}");
    assert_eq!(
        rbd::group_image_list(io, "user-group").unwrap().len(),
        1,
        "another's group was changed"
    );
    rbd::group_image_remove(io, "user-group", io, &d_image).unwrap();
    rbd::group_remove(io, "user-group").unwrap();
    env.delete_volume(&d).await.unwrap();
}

/// The members agree on one instant while a client writes to both
/// sources: it writes counter n to A, then n to B, over and over, so at any
/// one instant A holds B or B + 1. Two snapshots one after the other would
/// catch B ahead of A. A source without exclusive-lock (librbd cannot hold
/// its writes) is refused, naming it.
#[tokio::test(flavor = "multi_thread")]
async fn members_agree_on_one_instant_while_both_sources_are_written() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let env = CsiEnv::new("csi-group-instant", Mode::Controller).await;
    let mut group = GroupControllerClient::new(support::csi::channel(&env.socket).await);
    let req = |name: &str, ids: Vec<String>| CreateVolumeGroupSnapshotRequest {
        name: name.to_owned(),
        source_volume_ids: ids,
        secrets: env.secrets(),
        parameters: Default::default(),
    };
    let plain = env
        .create_volume("pvc-plain", 8 * MIB, mount_cap("xfs"))
        .await;
    let a = locked_volume(&env, "pvc-ia").await;
    let e = group
        .create_volume_group_snapshot(req("groupsnapshot-plain", vec![a.clone(), plain.clone()]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    let plain_image = VolumeId::parse(&plain).unwrap().image;
    assert!(
        e.message().contains(&plain_image) && e.message().contains("exclusive-lock"),
        "{e}"
    );
    assert!(rbd::group_list(&env.rbd.ioctx).unwrap().is_empty());

    let b = locked_volume(&env, "pvc-ib").await;
    let images: Vec<String> = [&a, &b]
        .iter()
        .map(|id| VolumeId::parse(id).unwrap().image)
        .collect();
    let (stop, count) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let writer = {
        let (stop, count, images) = (Arc::clone(&stop), Arc::clone(&count), images.clone());
        let io = env.rbd.ioctx.clone();
        std::thread::spawn(move || {
            let a = Image::open(&io, &images[0]).unwrap();
            let b = Image::open(&io, &images[1]).unwrap();
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                a.write(0, &n.to_le_bytes()).unwrap();
                b.write(0, &n.to_le_bytes()).unwrap();
                count.store(n, Ordering::SeqCst);
            }
        })
    };
    // Writing before, during and after the group snapshot.
    while count.load(Ordering::SeqCst) < 20 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let before = count.load(Ordering::SeqCst);
    let gs = create_until_ready(
        &mut group,
        req("groupsnapshot-instant", vec![a.clone(), b.clone()]),
    )
    .await;
    let during = count.load(Ordering::SeqCst);
    while count.load(Ordering::SeqCst) < during + 20 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    assert!(during > before, "the writer never ran across the snapshot");

    let value_of = |source: &str| -> u64 {
        let member = gs
            .snapshots
            .iter()
            .find(|s| s.source_volume_id == source)
            .unwrap();
        let image = SnapshotId::parse(&member.snapshot_id).unwrap().image;
        let img = Image::open_read_only(&env.rbd.ioctx, &image).unwrap();
        let mut buf = [0u8; 8];
        img.read_exact(0, &mut buf).unwrap();
        u64::from_le_bytes(buf)
    };
    let (va, vb) = (value_of(&a), value_of(&b));
    assert!(
        va == vb || va == vb + 1,
        "the members are not one instant: A holds {va}, B holds {vb}"
    );
    assert!(
        va >= before,
        "A's member is older than the request: {va} < {before}"
    );
}

/// A member that needs a data copy (the host's librbd 16 cannot clone from
/// a group snapshot) is copied outside the call: Create returns once the
/// instant is taken, its members not ready; Get and the CO's retries are
/// answered from the copy job, and a Delete meanwhile is ABORTED (it would
/// pull the group out from under the copy). The retries end ready with the
/// data of the instant. Killed mid-copy, the restarted controller's retry
/// redoes the member, and a delete instead removes the half-made one.
#[tokio::test(flavor = "multi_thread")]
async fn member_copies_run_outside_the_call_and_survive_a_kill() {
    let mut env = CsiEnv::new("csi-group-copy", Mode::Controller).await;
    let mut group = GroupControllerClient::new(support::csi::channel(&env.socket).await);
    // Sparse and large: its copy reads 4096 objects, seconds of work.
    let a = locked_volume_of(&env, "pvc-big", 16 << 30).await;
    let b = locked_volume(&env, "pvc-small").await;
    write(&env, &a, b"a instant");
    write(&env, &b, b"b instant");
    let secrets = env.secrets();
    let req = |name: &str| CreateVolumeGroupSnapshotRequest {
        name: name.to_owned(),
        source_volume_ids: vec![a.clone(), b.clone()],
        secrets: secrets.clone(),
        parameters: Default::default(),
    };
    let delete = |gs: &VolumeGroupSnapshot| DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: gs.group_snapshot_id.clone(),
        snapshot_ids: Vec::new(),
        secrets: secrets.clone(),
    };

    let first = group
        .create_volume_group_snapshot(req("gs-copy"))
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert!(!first.ready_to_use, "{first:?}");
    assert_eq!(first.snapshots.len(), 2);
    assert!(first.snapshots.iter().all(|s| !s.ready_to_use), "{first:?}");
    let e = group.delete_volume_group_snapshot(delete(&first)).await;
    let e = e.expect_err("a delete while the members are copied");
    assert_eq!(e.code(), Code::Aborted, "{e}");
    let got = get_group(&mut group, &env, &first).await;
    assert!(!got.ready_to_use, "{got:?}");
    write(&env, &a, b"a later!!");
    write(&env, &b, b"b later!!");
    let gs = create_until_ready(&mut group, req("gs-copy")).await;
    assert_eq!(member_ids(&gs), member_ids(&first));
    let io = env.rbd.ioctx.clone();
    let member_data = |gs: &VolumeGroupSnapshot, source: &str| {
        let m = gs.snapshots.iter().find(|s| s.source_volume_id == source);
        let sid = SnapshotId::parse(&m.unwrap().snapshot_id).unwrap();
        let img = Image::open_read_only(&io, &sid.image).unwrap();
        let mut buf = [0u8; 9];
        img.read_exact(MIB as u64, &mut buf).unwrap();
        buf
    };
    assert_eq!(&member_data(&gs, &a), b"a instant");
    assert_eq!(&member_data(&gs, &b), b"b instant");
    // A member carries its own records, none of its source's: gc would
    // take one with the source's PV record for that volume's orphan.
    for m in &gs.snapshots {
        let sid = SnapshotId::parse(&m.snapshot_id).unwrap();
        let meta = Image::open_read_only(&io, &sid.image)
            .unwrap()
            .metadata_list()
            .unwrap();
        assert!(!meta.contains_key(META_PV), "{}: {meta:?}", sid.image);
        assert_eq!(meta.get(META_SOURCE), Some(&m.source_volume_id));
    }
    assert!(rbd::group_list(&io).unwrap().is_empty());

    // Killed while copying, twice: once retried, once deleted.
    let a_image = VolumeId::parse(&a).unwrap().image;
    for (name, retry) in [("gs-kill-retry", true), ("gs-kill-delete", false)] {
        let pending = group
            .create_volume_group_snapshot(req(name))
            .await
            .unwrap()
            .into_inner()
            .group_snapshot
            .unwrap();
        assert!(!pending.ready_to_use);
        let temp = format!("{name}-{a_image}.rbdkit-new");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !rbd::list_names(&io).unwrap().contains(&temp) {
            assert!(std::time::Instant::now() < deadline, "{temp} never showed");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        env.csi.kill9();
        let names = rbd::list_names(&io).unwrap();
        assert!(
            names.contains(&temp),
            "the copy ended before the kill: {names:?}"
        );
        env.csi.restart();
        group = GroupControllerClient::new(support::csi::channel(&env.socket).await);
        if retry {
            let done = create_until_ready(&mut group, req(name)).await;
            assert_eq!(member_ids(&done), member_ids(&pending));
            assert_eq!(&member_data(&done, &a), b"a later!!");
            group
                .delete_volume_group_snapshot(delete(&done))
                .await
                .unwrap();
        } else {
            // ABORTED (retried) until the killed copy's watch is gone.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
            loop {
                match group.delete_volume_group_snapshot(delete(&pending)).await {
                    Ok(_) => break,
                    Err(e) if e.code() == Code::Aborted => {
                        assert!(std::time::Instant::now() < deadline, "{e}");
                        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                    }
                    Err(e) => panic!("DeleteVolumeGroupSnapshot {name}: {e}"),
                }
            }
        }
        let names = rbd::list_names(&io).unwrap();
        assert!(
            !names.iter().any(|n| n.starts_with(name)),
            "{name} left {names:?}"
        );
        assert!(rbd::group_list(&io).unwrap().is_empty());
    }

    group
        .delete_volume_group_snapshot(delete(&gs))
        .await
        .unwrap();
    for id in [&a, &b] {
        env.delete_volume(id).await.unwrap();
    }
    let left: Vec<String> = rbd::list_names(&io).unwrap();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The steps of a group snapshot create, in order: what a kill after each
/// leaves in Ceph is built by [`leave_after`].
const STEPS: &[&str] = &[
    "marker written",
    "group made",
    "A added",
    "B added",
    "group snapshot taken",
    "A's member begun",
    "A's member made",
    "B's member begun",
    "B's member made",
    "group snapshot removed",
    "A taken out",
    "B taken out",
    "group removed",
];

/// Builds what a create of group snapshot `name` of `a` and `b`, killed
/// right after step `k` of [`STEPS`] (1-based), leaves in Ceph, doing each
/// step as the create does.
fn leave_after(env: &CsiEnv, name: &str, k: usize, a: &VolumeId, b: &VolumeId) {
    let io = &env.rbd.ioctx;
    let member = |s: &VolumeId| format!("{name}-{}", s.image);
    let begun = |s: &VolumeId| {
        let temp = format!("{}.rbdkit-new", member(s));
        rbd::create(io, &temp, MIB as u64, &Default::default()).unwrap();
    };
    let made = |s: &VolumeId| {
        let temp = format!("{}.rbdkit-new", member(s));
        let _ = rbd::remove(io, &temp);
        let mut src = Image::open_read_only(io, &s.image).unwrap();
        let snaps = src.snap_list().unwrap();
        let in_group = |id: u64| src.snap_namespace_type(id).unwrap() == SnapNamespaceType::Group;
        let id = snaps.iter().find(|x| in_group(x.id)).unwrap().id;
        src.set_snapshot_by_id(id).unwrap();
        src.copy_to(io, &temp, &Default::default()).unwrap();
        let img = Image::open(io, &temp).unwrap();
        for key in img.metadata_list().unwrap().keys() {
            img.metadata_remove(key).unwrap();
        }
        for (key, value) in [
            (META_PROVISIONER, "rbd.rbdkit.io".to_owned()),
            (META_KIND, KIND_SNAPSHOT.to_owned()),
            (META_SNAPSHOT, format!("{name}/{}", s.image)),
            (META_SOURCE, s.handle()),
            (META_CLUSTER, s.cluster_id.clone()),
            (META_GROUP_SNAPSHOT, name.to_owned()),
        ] {
            img.metadata_set(key, &value).unwrap();
        }
        img.snap_create(SNAP_NAME).unwrap();
        img.close().unwrap();
        rbd::rename(io, &temp, &member(s)).unwrap();
    };
    let marker = format!("rbdkit.group.{name}");
    for step in 1..=k {
        match step {
            1 => io.write_full(&marker, b"").unwrap(),
            2 => rbd::group_create(io, name).unwrap(),
            3 => rbd::group_image_add(io, name, io, &a.image).unwrap(),
            4 => rbd::group_image_add(io, name, io, &b.image).unwrap(),
            5 => rbd::group_snap_create(io, name, "rbdkit").unwrap(),
            6 => begun(a),
            7 => made(a),
            8 => begun(b),
            9 => made(b),
            10 => rbd::group_snap_remove(io, name, "rbdkit").unwrap(),
            11 => rbd::group_image_remove(io, name, io, &a.image).unwrap(),
            12 => rbd::group_image_remove(io, name, io, &b.image).unwrap(),
            13 => rbd::group_remove(io, name).unwrap(),
            _ => unreachable!(),
        }
    }
}

/// What `rbdkit gc` does in Ceph, with no grace: it finds a group a given-up
/// create `name` left, if any, removes it, and finds nothing after.
fn collect_groups(env: &CsiEnv, name: &str, what: &str) {
    let c = support::ceph::cluster();
    let ns = &env.rbd.name;
    let scan = || {
        gc::scan(
            &c,
            &env.cluster_id,
            POOL,
            ns,
            "rbd.rbdkit.io",
            Duration::ZERO,
        )
        .unwrap_or_else(|e| panic!("{what}: gc scan: {e}"))
        .owned
    };
    let groups_before = rbd::group_list(&env.rbd.ioctx).unwrap();
    let found = scan();
    let kinds: Vec<(gc::Kind, &str)> = found
        .iter()
        .map(|o| (o.kind, o.volume.image.as_str()))
        .collect();
    let want: Vec<(gc::Kind, &str)> = groups_before
        .iter()
        .map(|g| (gc::Kind::Group, g.as_str()))
        .collect();
    assert_eq!(kinds, want, "{what}: gc found");
    assert!(groups_before.iter().all(|g| g == name), "{what}");
    for o in &found {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let r = gc::remove(&c, o, "rbd.rbdkit.io", deadline);
        assert_eq!(r.unwrap(), gc::Removed::Removed, "{what}");
    }
    assert!(scan().is_empty(), "{what}: gc found more");
}

/// A create killed after each of its steps, then (1) retried, (2) its
/// group snapshot deleted instead, or (3) given up, its sources deleted:
/// each way, no group or marker is left, and every source can be deleted.
/// A retry after the instant was taken keeps that instant.
#[tokio::test(flavor = "multi_thread")]
async fn a_create_killed_after_any_step_is_finished_undone_or_let_go() {
    let env = CsiEnv::new("csi-group-steps", Mode::Controller).await;
    let mut group = GroupControllerClient::new(support::csi::channel(&env.socket).await);
    let io = env.rbd.ioctx.clone();
    let mut n = 0;
    let mut kept = std::collections::BTreeSet::new();
    for k in 1..=STEPS.len() {
        for way in ["retried", "deleted", "given up"] {
            n += 1;
            let what = format!("killed after {:?}, {way}", STEPS[k - 1]);
            let a = locked_volume(&env, &format!("pvc-s{n}a")).await;
            let b = locked_volume(&env, &format!("pvc-s{n}b")).await;
            let (va, vb) = (VolumeId::parse(&a).unwrap(), VolumeId::parse(&b).unwrap());
            write(&env, &a, b"a instant");
            write(&env, &b, b"b instant");
            let name = format!("gs-step-{n}");
            leave_after(&env, &name, k, &va, &vb);
            write(&env, &a, b"a later!!");
            write(&env, &b, b"b later!!");
            let req = CreateVolumeGroupSnapshotRequest {
                name: name.clone(),
                source_volume_ids: vec![a.clone(), b.clone()],
                secrets: env.secrets(),
                parameters: Default::default(),
            };
            let gid = GroupSnapshotId {
                cluster_id: va.cluster_id.clone(),
                pool: va.pool.clone(),
                rados_namespace: va.rados_namespace.clone(),
                name: name.clone(),
            };
            match way {
                "retried" => {
                    let gs = create_until_ready(&mut group, req).await;
                    assert_eq!(gs.group_snapshot_id, gid.handle(), "{what}");
                    // After the instant was taken the retry keeps it.
                    let want: [&[u8]; 2] = if k >= 5 {
                        [b"a instant", b"b instant"]
                    } else {
                        [b"a later!!", b"b later!!"]
                    };
                    for (source, want) in [(&a, want[0]), (&b, want[1])] {
                        let m = gs.snapshots.iter().find(|s| s.source_volume_id == *source);
                        let sid = SnapshotId::parse(&m.unwrap().snapshot_id).unwrap();
                        let img = Image::open_read_only(&io, &sid.image).unwrap();
                        let mut buf = [0u8; 9];
                        img.read_exact(MIB as u64, &mut buf).unwrap();
                        assert_eq!(&buf[..], want, "{what}");
                    }
                    group
                        .delete_volume_group_snapshot(DeleteVolumeGroupSnapshotRequest {
                            group_snapshot_id: gs.group_snapshot_id.clone(),
                            snapshot_ids: member_ids(&gs),
                            secrets: env.secrets(),
                        })
                        .await
                        .unwrap_or_else(|e| panic!("{what}: delete: {e}"));
                }
                "deleted" => {
                    group
                        .delete_volume_group_snapshot(DeleteVolumeGroupSnapshotRequest {
                            group_snapshot_id: gid.handle(),
                            snapshot_ids: Vec::new(),
                            secrets: env.secrets(),
                        })
                        .await
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                _ => {}
            }
            for id in [&a, &b] {
                env.delete_volume(id)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: DeleteVolume {id}: {e}"));
            }
            if way == "given up" {
                collect_groups(&env, &name, &what);
            }
            assert!(rbd::group_list(&io).unwrap().is_empty(), "{what}");
            // A create given up right after writing its marker, or right
            // before removing it, leaves that empty object alone (no group
            // names it for gc to find); a retry or a delete of the name
            // removes it.
            let marker = format!("rbdkit.group.{name}");
            if (k == 1 || k == STEPS.len()) && way == "given up" {
                assert_eq!(io.stat(&marker).unwrap().size, 0, "{what}");
                io.remove(&marker).unwrap();
            }
            assert!(io.stat(&marker).is_err(), "{what}: marker left");
            // What is left are members (snapshots, the provisioner's to
            // delete) made before a create was given up; nothing else.
            let left: Vec<String> = rbd::list_names(&io)
                .unwrap()
                .into_iter()
                .filter(|i| !kept.contains(i))
                .collect();
            for i in left {
                let member = i.starts_with(&format!("{name}-")) && !i.ends_with(".rbdkit-new");
                assert!(way == "given up" && member, "{what}: left {i}");
                kept.insert(i);
            }
        }
    }
    // Members of given-up creates are ordinary snapshots: they delete.
    let place = VolumeId::parse(
        &env.create_volume("pvc-place", 8 * MIB, mount_cap("xfs"))
            .await,
    )
    .unwrap();
    env.delete_volume(&place.handle()).await.unwrap();
    assert_eq!(rbd::list_names(&io).unwrap().len(), kept.len());
    for image in kept {
        let member = SnapshotId {
            cluster_id: place.cluster_id.clone(),
            pool: place.pool.clone(),
            rados_namespace: place.rados_namespace.clone(),
            image: image.clone(),
            snap: SNAP_NAME.to_owned(),
        };
        env.controller()
            .await
            .delete_snapshot(DeleteSnapshotRequest {
                snapshot_id: member.handle(),
                secrets: env.secrets(),
            })
            .await
            .unwrap_or_else(|e| panic!("member {image}: {e}"));
    }
    assert!(rbd::list_names(&io).unwrap().is_empty());
}
