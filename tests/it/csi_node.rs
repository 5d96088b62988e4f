//! The CSI Node service over its unix socket, driven the way kubelet drives
//! it, with the userspace mapper, real mounts and the real test cluster.
use crate::support;

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rbdkit::csi::proto::{
    volume_health::VolumeHealthEntry, CapacityRange, ControllerExpandVolumeRequest,
    DeleteVolumeRequest, NodeExpandVolumeRequest, NodeGetCapabilitiesRequest, NodeGetInfoRequest,
    NodeGetVolumeHealthRequest, NodeGetVolumeStatsRequest, NodePublishVolumeRequest,
    NodeUnpublishVolumeRequest, NodeUnstageVolumeRequest, VolumeCapability, VolumeHealthErrorType,
};
use rbdkit::rbd::Image;
use rbdkit::volume::VolumeId;
use support::csi::{block_cap, mount_cap, CsiEnv, Mode};
use support::data::pattern;
use tonic::Code;

const MIB: i64 = 1 << 20;

/// What NodeGetVolumeHealth says is wrong with a published volume (the
/// publish path given, or with only the volume id as csi-sanity asks).
async fn health(env: &CsiEnv, id: &str, p: &Paths, by_path: bool) -> Vec<VolumeHealthEntry> {
    let h = env
        .node()
        .await
        .node_get_volume_health(NodeGetVolumeHealthRequest {
            volume_id: id.to_owned(),
            volume_publish_path: if by_path {
                p.target.display().to_string()
            } else {
                String::new()
            },
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .volume_health
        .unwrap();
    assert_eq!(h.volume_id, id);
    h.health_statuses
}

struct Paths {
    staging: std::path::PathBuf,
    target: std::path::PathBuf,
}

fn paths(env: &CsiEnv, name: &str) -> Paths {
    let staging = env.path(&format!("staging-{name}"));
    std::fs::create_dir_all(&staging).unwrap();
    // kubelet creates the target's parent; the plugin creates the target.
    let parent = env.path(&format!("pods-{name}"));
    std::fs::create_dir_all(&parent).unwrap();
    Paths {
        staging,
        target: parent.join("mount"),
    }
}

async fn stage(env: &CsiEnv, id: &str, p: &Paths, cap: VolumeCapability) {
    env.node()
        .await
        .node_stage_volume(env.stage_request(id, &p.staging, cap))
        .await
        .unwrap_or_else(|e| panic!("NodeStageVolume: {e}"));
}

async fn publish(env: &CsiEnv, id: &str, p: &Paths, cap: VolumeCapability, readonly: bool) {
    env.node()
        .await
        .node_publish_volume(NodePublishVolumeRequest {
            volume_id: id.to_owned(),
            staging_target_path: p.staging.display().to_string(),
            target_path: p.target.display().to_string(),
            volume_capability: Some(cap),
            readonly,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("NodePublishVolume: {e}"));
}

async fn unpublish(env: &CsiEnv, id: &str, p: &Paths) {
    env.node()
        .await
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: id.to_owned(),
            target_path: p.target.display().to_string(),
        })
        .await
        .unwrap_or_else(|e| panic!("NodeUnpublishVolume: {e}"));
}

async fn unstage(env: &CsiEnv, id: &str, p: &Paths) {
    env.node()
        .await
        .node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: id.to_owned(),
            staging_target_path: p.staging.display().to_string(),
        })
        .await
        .unwrap_or_else(|e| panic!("NodeUnstageVolume: {e}"));
}

async fn delete(env: &CsiEnv, id: &str) {
    env.delete_volume(id)
        .await
        .unwrap_or_else(|e| panic!("DeleteVolume: {e}"));
}

fn mounted(path: &Path) -> bool {
    rbdkit::node::mount::is_mount_point(path).unwrap()
}

/// No loop device of ours is left.
fn loop_devices_of(env: &CsiEnv) -> Vec<String> {
    let mut out = Vec::new();
    let root = env.dir.path().display().to_string();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let f = e.path().join("loop/backing_file");
        if let Ok(b) = std::fs::read_to_string(&f) {
            if b.trim().starts_with(&root) {
                out.push(e.file_name().to_string_lossy().into_owned());
            }
        }
    }
    out
}

async fn filesystem_round_trip(fs_type: &str) {
    let env = CsiEnv::new(&format!("csi-fs-{fs_type}"), Mode::All).await;
    let id = env
        .create_volume(&format!("pvc-fs-{fs_type}"), 320 * MIB, mount_cap(fs_type))
        .await;
    let p = paths(&env, "a");
    stage(&env, &id, &p, mount_cap(fs_type)).await;
    // Kubelet may repeat any call.
    stage(&env, &id, &p, mount_cap(fs_type)).await;
    publish(&env, &id, &p, mount_cap(fs_type), false).await;
    publish(&env, &id, &p, mount_cap(fs_type), false).await;
    let file = p.target.join("hello.txt");
    std::fs::write(&file, b"written through the node plugin").unwrap();
    std::fs::File::open(&file).unwrap().sync_all().unwrap();
    let info = rbdkit::node::mount::mounted_at(&p.staging.join("volume"))
        .unwrap()
        .expect("staged mount");
    assert_eq!(info.fstype, fs_type);
    if fs_type == "xfs" {
        // A clone carries its parent's UUID; xfs must not refuse it.
        assert!(
            info.super_options.iter().any(|o| o == "nouuid"),
            "{:?}",
            info.super_options
        );
    }

    unpublish(&env, &id, &p).await;
    unpublish(&env, &id, &p).await;
    assert!(!p.target.exists());
    unstage(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    assert!(!mounted(&p.staging.join("volume")));
    assert!(
        loop_devices_of(&env).is_empty(),
        "{:?}",
        loop_devices_of(&env)
    );

    // Staged again (the filesystem is not made again): the file is there.
    stage(&env, &id, &p, mount_cap(fs_type)).await;
    publish(&env, &id, &p, mount_cap(fs_type), true).await;
    assert_eq!(
        std::fs::read(&file).unwrap(),
        b"written through the node plugin"
    );
    // Published read-only: writes fail.
    let e = std::fs::write(p.target.join("other"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    delete(&env, &id).await;
    assert!(rbdkit::rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn ext4_volume_is_staged_published_and_keeps_its_data() {
    filesystem_round_trip("ext4").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn xfs_volume_is_staged_published_and_keeps_its_data() {
    filesystem_round_trip("xfs").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn block_volume_bytes_reach_the_image() {
    let env = CsiEnv::new("csi-block", Mode::All).await;
    let id = env.create_volume("pvc-block", 32 * MIB, block_cap()).await;
    let p = paths(&env, "b");
    stage(&env, &id, &p, block_cap()).await;
    publish(&env, &id, &p, block_cap(), false).await;
    let data = pattern(7, 1 << 20);
    {
        let mut dev = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&p.target)
            .unwrap();
        // O_DIRECT needs an aligned buffer.
        let mut buf = AlignedBuf::new(data.len());
        buf.as_mut().copy_from_slice(&data);
        dev.seek(SeekFrom::Start(4 << 20)).unwrap();
        dev.write_all(buf.as_ref()).unwrap();
        dev.sync_all().unwrap();
    }
    // kubelet's stats on a block volume: its size.
    let stats = env
        .node()
        .await
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: p.target.display().to_string(),
            staging_target_path: p.staging.display().to_string(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.usage[0].total, 32 * MIB);
    assert_eq!(health(&env, &id, &p, true).await, vec![]);
    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    let vol = VolumeId::parse(&id).unwrap();
    let img = Image::open_read_only(&env.rbd.ioctx, &vol.image).unwrap();
    let mut back = vec![0u8; data.len()];
    img.read(4 << 20, &mut back).unwrap();
    assert!(
        back == data,
        "bytes written through the device differ in the image"
    );
    drop(img);
    delete(&env, &id).await;
}

struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        AlignedBuf { ptr, len }
    }
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn as_ref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, 4096).unwrap();
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn node_expansion_grows_the_filesystem() {
    let env = CsiEnv::new("csi-expand", Mode::All).await;
    // xfs grows online here; ext4's online resize needs CAP_SYS_RESOURCE,
    // which this machine's capability bounding set lacks.
    let id = env
        .create_volume("pvc-expand", 300 * MIB, mount_cap("xfs"))
        .await;
    let p = paths(&env, "e");
    stage(&env, &id, &p, mount_cap("xfs")).await;
    publish(&env, &id, &p, mount_cap("xfs"), false).await;
    let before = rbdkit::node::fs::stats(&p.target).unwrap().total_bytes;
    env.controller()
        .await
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 600 * MIB,
                limit_bytes: 0,
            }),
            secrets: env.secrets(),
            volume_capability: Some(mount_cap("xfs")),
        })
        .await
        .unwrap();
    let resp = env
        .node()
        .await
        .node_expand_volume(NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: p.target.display().to_string(),
            capacity_range: Some(CapacityRange {
                required_bytes: 600 * MIB,
                limit_bytes: 0,
            }),
            staging_target_path: p.staging.display().to_string(),
            volume_capability: Some(mount_cap("xfs")),
            secrets: Default::default(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.capacity_bytes, 600 * MIB);
    let after = rbdkit::node::fs::stats(&p.target).unwrap().total_bytes;
    assert!(
        after > before + (200 << 20),
        "df saw {before} then {after} bytes"
    );
    // statvfs through the published path, as df does.
    let stats = env
        .node()
        .await
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: p.target.display().to_string(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.usage.len(), 2, "bytes and inodes");
    assert_eq!(stats.usage[0].total as u64, after);
    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    delete(&env, &id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killing_the_grpc_server_does_not_touch_a_mounted_volume() {
    let mut env = CsiEnv::new("csi-kill", Mode::All).await;
    let id = env
        .create_volume("pvc-kill", 64 * MIB, mount_cap("ext4"))
        .await;
    let p = paths(&env, "k");
    stage(&env, &id, &p, mount_cap("ext4")).await;
    publish(&env, &id, &p, mount_cap("ext4"), false).await;

    // A writer appends numbered, fsynced records until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let file = p.target.join("log");
    let writer = {
        let (stop, written, file) = (stop.clone(), written.clone(), file.clone());
        std::thread::spawn(move || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&file)?;
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                f.write_all(&n.to_le_bytes())?;
                f.sync_data()?;
                n += 1;
                written.store(n, Ordering::SeqCst);
            }
            Ok(())
        })
    };
    let wait_for = |min: u64| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while written.load(Ordering::SeqCst) < min {
            assert!(
                Instant::now() < deadline,
                "writer stalled at {}",
                written.load(Ordering::SeqCst)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for(20);
    env.csi.kill9();
    let at_kill = written.load(Ordering::SeqCst);
    // Writes go on while no server runs.
    wait_for(at_kill + 50);
    env.csi.restart();
    // The restarted server finds the volume staged and healthy.
    let stats = env
        .node()
        .await
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: p.target.display().to_string(),
            staging_target_path: p.staging.display().to_string(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!stats.usage.is_empty());
    assert_eq!(health(&env, &id, &p, true).await, vec![]);
    wait_for(written.load(Ordering::SeqCst) + 20);
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap().expect("writer never failed");
    let total = written.load(Ordering::SeqCst);

    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    stage(&env, &id, &p, mount_cap("ext4")).await;
    publish(&env, &id, &p, mount_cap("ext4"), false).await;
    let mut bytes = Vec::new();
    std::fs::File::open(&file)
        .unwrap()
        .read_to_end(&mut bytes)
        .unwrap();
    assert_eq!(
        bytes.len() as u64,
        total * 8,
        "every fsynced record is there"
    );
    for (i, rec) in bytes.chunks(8).enumerate() {
        assert_eq!(u64::from_le_bytes(rec.try_into().unwrap()), i as u64);
    }
    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    delete(&env, &id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_node_cannot_stage_a_volume_read_write() {
    let env = CsiEnv::new("csi-rwo", Mode::All).await;
    let id = env
        .create_volume("pvc-rwo", 32 * MIB, mount_cap("ext4"))
        .await;
    let p = paths(&env, "r");
    stage(&env, &id, &p, mount_cap("ext4")).await;

    let node_b = CsiEnv::with_ns(
        env.rbd.clone(),
        env.cluster_id.clone(),
        Mode::All,
        "node-b",
        &[],
    )
    .await;
    let pb = paths(&node_b, "r");
    let e = node_b
        .node()
        .await
        .node_stage_volume(node_b.stage_request(&id, &pb.staging, mount_cap("ext4")))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    let image = VolumeId::parse(&id).unwrap().image;
    assert!(e.message().contains(&image), "{e}");
    assert!(
        e.message().contains("locked for staging by node node-a"),
        "{e}"
    );
    assert!(!mounted(&pb.staging.join("volume")));
    drop(node_b);

    unstage(&env, &id, &p).await;
    delete(&env, &id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn health_reports_a_dead_mapper_as_inaccessible() {
    let mut env = CsiEnv::new("csi-dead", Mode::All).await;
    let id = env
        .create_volume("pvc-dead", 32 * MIB, mount_cap("ext4"))
        .await;
    let p = paths(&env, "d");
    stage(&env, &id, &p, mount_cap("ext4")).await;
    publish(&env, &id, &p, mount_cap("ext4"), false).await;
    let req = || NodeGetVolumeStatsRequest {
        volume_id: id.clone(),
        volume_path: p.target.display().to_string(),
        staging_target_path: p.staging.display().to_string(),
    };
    let ok = env
        .node()
        .await
        .node_get_volume_stats(req())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.usage.len(), 2);
    assert_eq!(health(&env, &id, &p, true).await, vec![]);
    assert_eq!(health(&env, &id, &p, false).await, vec![]);
    let storage = env.storage_health().await;
    assert_eq!(storage.backend_health, vec![]);
    env.mapper.as_mut().unwrap().kill9();
    let bad = health(&env, &id, &p, true).await;
    assert!(
        bad.iter()
            .any(|e| e.status == VolumeHealthErrorType::Inaccessible as i32
                && e.reason == "MappingFailed"),
        "a dead mapper must be reported: {bad:?}"
    );
    // Without the publish path too (the staging mount is read instead).
    assert!(!health(&env, &id, &p, false).await.is_empty());
    let storage = env.storage_health().await;
    assert!(
        storage
            .backend_health
            .iter()
            .any(|b| b.reason == "MapperNotReady" && b.message.contains("rbdkit-fuse")),
        "{storage:?}"
    );
    // The restarted mapper knows the volume but reports it unhealthy until
    // it is staged again; unpublish and unstage still clean up.
    env.mapper.as_mut().unwrap().restart();
    env.wait_mapper();
    // Stats still answer (no usage from a dead mount).
    env.node().await.node_get_volume_stats(req()).await.unwrap();
    assert!(!health(&env, &id, &p, true).await.is_empty());
    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    stage(&env, &id, &p, mount_cap("ext4")).await;
    publish(&env, &id, &p, mount_cap("ext4"), false).await;
    assert_eq!(health(&env, &id, &p, true).await, vec![]);
    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    // The dead mapper's watch lingers until the OSD times it out (30 s by
    // default); until then the delete is refused as in use, and retried, as
    // external-provisioner does.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let r = env
            .controller()
            .await
            .delete_volume(DeleteVolumeRequest {
                volume_id: id.clone(),
                secrets: env.secrets(),
            })
            .await;
        match r {
            Ok(_) => break,
            Err(e) if e.code() == Code::FailedPrecondition && Instant::now() < deadline => {
                assert!(e.message().contains("in use"), "{e}");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(e) => panic!("DeleteVolume: {e}"),
        }
    }
    assert!(rbdkit::rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn node_info_capabilities_and_bad_requests() {
    let env = CsiEnv::new("csi-nodeinfo", Mode::All).await;
    let mut node = env.node().await;
    let info = node
        .node_get_info(NodeGetInfoRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "node-a");
    assert_eq!(
        info.accessible_topology.unwrap().segments["topology.rbd.rbdkit.io/node"],
        "node-a"
    );
    let caps = node
        .node_get_capabilities(NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 6);
    // Health of a volume not staged here, and of none.
    let e = node
        .node_get_volume_health(NodeGetVolumeHealthRequest {
            volume_id: "rbdkit1/c/p//nope".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    let e = node
        .node_get_volume_health(NodeGetVolumeHealthRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("volume_id"), "{e}");
    let e = node
        .node_get_volume_health(NodeGetVolumeHealthRequest {
            volume_id: "rbdkit1/c/p//nope".into(),
            volume_publish_path: "relative/path".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("volume_publish_path"), "{e}");
    let p = paths(&env, "x");
    let mut req = env.stage_request("", &p.staging, mount_cap("ext4"));
    assert_eq!(
        node.node_stage_volume(req.clone())
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    req.volume_id = "rbdkit1/c/p//nope".into();
    req.volume_capability = None;
    assert_eq!(
        node.node_stage_volume(req.clone())
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    req.volume_capability = Some(mount_cap("ext4"));
    req.secrets.clear();
    let e = node.node_stage_volume(req).await.unwrap_err();
    assert!(e.message().contains("secrets"), "{e}");
    let e = node
        .node_publish_volume(NodePublishVolumeRequest {
            volume_id: "rbdkit1/c/p//nope".into(),
            staging_target_path: p.staging.display().to_string(),
            target_path: p.target.display().to_string(),
            volume_capability: Some(mount_cap("ext4")),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
}

fn cap(
    mode: rbdkit::csi::proto::volume_capability::access_mode::Mode,
    fs_type: Option<&str>,
) -> VolumeCapability {
    use rbdkit::csi::proto::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(match fs_type {
            Some(t) => AccessType::Mount(MountVolume {
                fs_type: t.to_owned(),
                ..Default::default()
            }),
            None => AccessType::Block(BlockVolume {}),
        }),
    }
}

/// Reader-only (ROX) Filesystem capability.
fn rox_cap(fs_type: &str) -> VolumeCapability {
    cap(
        rbdkit::csi::proto::volume_capability::access_mode::Mode::MultiNodeReaderOnly,
        Some(fs_type),
    )
}

/// The device under a staging path, from its stash.
fn staged_device(p: &Paths) -> std::path::PathBuf {
    let stash = rbdkit::csi::node::Stash::read(&p.staging)
        .unwrap()
        .expect("a stash");
    stash.device.expect("a device")
}

/// A snapshot of a volume taken while its filesystem is mounted keeps the
/// journal (ext4) or log (xfs) unreplayed; a restore of it staged read-only
/// must mount without replaying it (the device is read-only).
async fn read_only_restore_of_a_snapshot_of_a_mounted_fs(fs_type: &str) {
    use rbdkit::csi::proto::{
        volume_content_source, CreateSnapshotRequest, CreateVolumeRequest, DeleteSnapshotRequest,
        VolumeContentSource,
    };
    let env = CsiEnv::new(&format!("csi-rox-{fs_type}"), Mode::All).await;
    let bytes = if fs_type == "xfs" {
        320 * MIB
    } else {
        64 * MIB
    };
    let id = env
        .create_volume(&format!("pvc-rox-{fs_type}"), bytes, mount_cap(fs_type))
        .await;
    let p = paths(&env, "src");
    // Written and cleanly unmounted once, then mounted again and written.
    stage(&env, &id, &p, mount_cap(fs_type)).await;
    std::fs::write(p.staging.join("volume/kept"), b"from the first mount").unwrap();
    unstage(&env, &id, &p).await;
    stage(&env, &id, &p, mount_cap(fs_type)).await;
    let f = p.staging.join("volume/later");
    std::fs::write(&f, b"journalled").unwrap();
    std::fs::File::open(&f).unwrap().sync_all().unwrap();

    let mut ctl = env.controller().await;
    let snap = ctl
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: id.clone(),
            name: format!("snap-rox-{fs_type}"),
            secrets: env.secrets(),
            parameters: Default::default(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    let restored = ctl
        .create_volume(CreateVolumeRequest {
            name: format!("pvc-rox-{fs_type}-restored"),
            capacity_range: Some(CapacityRange {
                required_bytes: bytes,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![rox_cap(fs_type)],
            parameters: env.params(),
            secrets: env.secrets(),
            volume_content_source: Some(VolumeContentSource {
                r#type: Some(volume_content_source::Type::Snapshot(
                    volume_content_source::SnapshotSource {
                        snapshot_id: snap.snapshot_id.clone(),
                    },
                )),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let q = paths(&env, "rox");
    stage(&env, &restored, &q, rox_cap(fs_type)).await;
    publish(&env, &restored, &q, rox_cap(fs_type), true).await;
    assert_eq!(
        std::fs::read(q.target.join("kept")).unwrap(),
        b"from the first mount"
    );
    let e = std::fs::write(q.target.join("x"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    unpublish(&env, &restored, &q).await;
    unstage(&env, &restored, &q).await;
    unstage(&env, &id, &p).await;
    delete(&env, &restored).await;
    ctl.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id,
        secrets: env.secrets(),
    })
    .await
    .unwrap();
    delete(&env, &id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn read_only_restore_of_a_mounted_ext4_snapshot_stages() {
    read_only_restore_of_a_snapshot_of_a_mounted_fs("ext4").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn read_only_restore_of_a_mounted_xfs_snapshot_stages() {
    read_only_restore_of_a_snapshot_of_a_mounted_fs("xfs").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn block_volume_expansion_reaches_the_device() {
    let env = CsiEnv::new("csi-expand-block", Mode::All).await;
    let id = env
        .create_volume("pvc-grow-blk", 32 * MIB, block_cap())
        .await;
    let p = paths(&env, "g");
    stage(&env, &id, &p, block_cap()).await;
    publish(&env, &id, &p, block_cap(), false).await;
    assert_eq!(rbdkit::node::fs::device_size(&p.target).unwrap(), 32 << 20);
    let grown = env
        .controller()
        .await
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 64 * MIB,
                limit_bytes: 0,
            }),
            secrets: env.secrets(),
            volume_capability: Some(block_cap()),
        })
        .await
        .unwrap()
        .into_inner();
    // The loop device over the mapper's file does not grow by itself
    // (krbd's device does): kubelet must be told to call NodeExpandVolume.
    assert!(
        grown.node_expansion_required,
        "ControllerExpandVolume of a block volume must ask for NodeExpandVolume"
    );
    let resp = env
        .node()
        .await
        .node_expand_volume(NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: p.target.display().to_string(),
            capacity_range: Some(CapacityRange {
                required_bytes: 64 * MIB,
                limit_bytes: 0,
            }),
            staging_target_path: p.staging.display().to_string(),
            volume_capability: Some(block_cap()),
            secrets: env.node_secrets(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.capacity_bytes, 64 * MIB);
    assert_eq!(rbdkit::node::fs::device_size(&p.target).unwrap(), 64 << 20);
    // The new end is writable.
    let data = pattern(9, 1 << 20);
    support::data::direct_write(&p.target, (63 << 20) as u64, &data);
    assert!(support::data::direct_read(&p.target, (63 << 20) as u64, 1 << 20) == data);
    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    delete(&env, &id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn blkdiscard_of_a_6_gib_block_volume_works() {
    const GIB: u64 = 1 << 30;
    let env = CsiEnv::new("csi-discard", Mode::All).await;
    let id = env
        .create_volume("pvc-discard", 6 * GIB as i64, block_cap())
        .await;
    let p = paths(&env, "z");
    stage(&env, &id, &p, block_cap()).await;
    publish(&env, &id, &p, block_cap(), false).await;
    let data = pattern(5, 1 << 20);
    let offsets = [GIB / 2, 3 * GIB, 5 * GIB + 4096];
    for (zero, args) in [(true, &["-z"][..]), (true, &[][..])] {
        for at in offsets {
            support::data::direct_write(&p.target, at, &data);
        }
        let out = std::process::Command::new("blkdiscard")
            .args(args)
            .arg(&p.target)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "blkdiscard {args:?} of 6 GiB: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if zero {
            for at in offsets {
                let back = support::data::direct_read(&p.target, at, 1 << 20);
                assert!(
                    back.iter().all(|b| *b == 0),
                    "not zero at {at} after {args:?}"
                );
            }
        }
    }
    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    delete(&env, &id).await;
}

/// Writes the filesystem image `file` into the volume's RBD image,
/// skipping the all-zero MiBs.
fn copy_into_image(env: &CsiEnv, id: &str, file: &Path) {
    let vol = VolumeId::parse(id).unwrap();
    let img = Image::open(&env.rbd.ioctx, &vol.image).unwrap();
    let mut f = std::fs::File::open(file).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        if buf[..n].iter().any(|b| *b != 0) {
            img.write(at, &buf[..n]).unwrap();
        }
        at += n as u64;
    }
    img.close().unwrap();
}

/// Filesystems made on a device with 512-byte sectors (krbd's, another
/// node's, an in-tree volume's) mount through rbdkit-fuse: XFS with
/// 512-byte sectors and ext4 with 1 KiB blocks.
async fn filesystem_made_elsewhere_mounts(fs_type: &str) {
    let env = CsiEnv::new(&format!("csi-foreign-{fs_type}"), Mode::All).await;
    let bytes = if fs_type == "xfs" {
        320 * MIB
    } else {
        64 * MIB
    };
    let id = env
        .create_volume(&format!("pvc-foreign-{fs_type}"), bytes, mount_cap(fs_type))
        .await;
    let file = env.path("fs.img");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(bytes as u64)
        .unwrap();
    let src = env.path("content");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("hello"), b"made elsewhere").unwrap();
    let out = if fs_type == "xfs" {
        std::process::Command::new("mkfs.xfs")
            .args(["-q", "-f", "-s", "size=512", "-b", "size=4096"])
            .arg(&file)
            .output()
            .unwrap()
    } else {
        std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "1024", "-d"])
            .arg(&src)
            .arg(&file)
            .output()
            .unwrap()
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    copy_into_image(&env, &id, &file);

    let p = paths(&env, "f");
    stage(&env, &id, &p, mount_cap(fs_type)).await;
    publish(&env, &id, &p, mount_cap(fs_type), false).await;
    if fs_type != "xfs" {
        assert_eq!(
            std::fs::read(p.target.join("hello")).unwrap(),
            b"made elsewhere"
        );
    }
    let f = p.target.join("written-here");
    std::fs::write(&f, pattern(1, 3 << 20)).unwrap();
    std::fs::File::open(&f).unwrap().sync_all().unwrap();
    assert!(std::fs::read(&f).unwrap() == pattern(1, 3 << 20));
    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    delete(&env, &id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn xfs_with_512_byte_sectors_made_elsewhere_mounts() {
    filesystem_made_elsewhere_mounts("xfs").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ext4_with_1k_blocks_made_elsewhere_mounts() {
    filesystem_made_elsewhere_mounts("ext4").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn mkfs_options_that_reach_host_paths_are_refused_by_name() {
    let env = CsiEnv::new("csi-mkfs-opts", Mode::All).await;
    let id = env
        .create_volume("pvc-mkfs-opts", 32 * MIB, mount_cap("ext4"))
        .await;
    let p = paths(&env, "m");
    let mut node = env.node().await;
    for (fs_type, opts, named) in [
        ("ext4", "-d /etc", "-d"),
        ("ext4", "-m0 -d/", "-d"),
        ("ext4", "-J device=/dev/null", "device"),
        ("ext4", "-E offset=4096", "offset"),
        ("ext4", "-z /tmp/undo", "-z"),
        ("ext4", "/etc", "/etc"),
        ("ext3", "-l /etc/passwd", "-l"),
        ("xfs", "-l logdev=/dev/null", "logdev"),
        ("xfs", "-r rtdev=/dev/null", "-r"),
        ("xfs", "-d name=/dev/null", "name"),
        ("xfs", "-p /etc/passwd", "-p"),
        ("xfs", "-c options=/etc/passwd", "-c"),
    ] {
        let mut req = env.stage_request(&id, &p.staging, mount_cap(fs_type));
        req.volume_context
            .insert("mkfsOptions".to_owned(), opts.to_owned());
        let e = node.node_stage_volume(req).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{opts}: {e}");
        assert!(
            e.message().contains("mkfsOptions") && e.message().contains(named),
            "{opts}: the error names {named}: {e}"
        );
        // Refused before anything was done.
        assert!(!p.staging.join("rbdkit.json").exists(), "{opts}");
        let mapped = rbdkit::node::fuse::FuseMapper::new(env.path("mapper.sock"))
            .status(&id)
            .unwrap();
        assert!(mapped.is_none(), "{opts}: mapped {mapped:?}");
    }
    // Safe options are used.
    let mut req = env.stage_request(&id, &p.staging, mount_cap("ext4"));
    req.volume_context.insert(
        "mkfsOptions".to_owned(),
        "-m0 -L rbdkit-opts -E nodiscard,lazy_itable_init=1 -b 4096 -O ^metadata_csum".to_owned(),
    );
    node.node_stage_volume(req).await.unwrap();
    let dev = staged_device(&p);
    let out = std::process::Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "LABEL"])
        .arg(&dev)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "rbdkit-opts");
    unstage(&env, &id, &p).await;
    delete(&env, &id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn restaging_with_an_incompatible_capability_is_already_exists() {
    use rbdkit::csi::proto::volume_capability::access_mode::Mode as M;
    let env = CsiEnv::new("csi-restage", Mode::All).await;
    let id = env
        .create_volume("pvc-restage", 32 * MIB, mount_cap("ext4"))
        .await;
    let p = paths(&env, "s");
    stage(&env, &id, &p, mount_cap("ext4")).await;
    let mut node = env.node().await;
    for (what, other) in [
        ("block", block_cap()),
        ("xfs", mount_cap("xfs")),
        ("read-only", cap(M::SingleNodeReaderOnly, Some("ext4"))),
        (
            "multi-node writer",
            cap(M::MultiNodeMultiWriter, Some("ext4")),
        ),
    ] {
        let e = node
            .node_stage_volume(env.stage_request(&id, &p.staging, other))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::AlreadyExists, "{what}: {e}");
        assert!(mounted(&p.staging.join("volume")), "{what}: still staged");
    }
    // The same capability again is fine.
    stage(&env, &id, &p, mount_cap("ext4")).await;
    unstage(&env, &id, &p).await;
    delete(&env, &id).await;
}

/// Files named `core*` in `dir`.
fn cores_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("core"))
        .collect()
}

/// Lets `pid` dump core (soft RLIMIT_CORE to the hard limit), then sends
/// it SIGABRT (whose default action dumps core; Rust handles SIGSEGV
/// itself).
fn crash_with_core_allowed(pid: u32) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit(2) with valid pointers; `pid` is our child.
    let r = unsafe { libc::prlimit(pid as i32, libc::RLIMIT_CORE, std::ptr::null(), &mut lim) };
    assert_eq!(r, 0, "prlimit get");
    lim.rlim_cur = lim.rlim_max;
    assert!(
        lim.rlim_cur > 64 << 20,
        "core dumps are limited: {}",
        lim.rlim_cur
    );
    // SAFETY: as above.
    let r = unsafe { libc::prlimit(pid as i32, libc::RLIMIT_CORE, &lim, std::ptr::null_mut()) };
    assert_eq!(r, 0, "prlimit set");
    // SAFETY: kill(2) of our own child.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGABRT) }, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn processes_holding_keys_write_no_core_dump() {
    // A core file lands in the process's working directory here.
    let pattern = std::fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap();
    assert!(
        !pattern.starts_with('|') && !pattern.contains('/'),
        "this test needs a core_pattern relative to the working directory, not {pattern:?}"
    );
    let env = CsiEnv::new("csi-core", Mode::All).await;
    let id = env.create_volume("pvc-core", 32 * MIB, block_cap()).await;
    let p = paths(&env, "c");
    // The plugin and the mapper now hold the node key.
    stage(&env, &id, &p, block_cap()).await;
    let dir = env.dir.path().to_owned();
    assert_eq!(
        std::fs::read_link(format!("/proc/{}/cwd", env.csi.pid())).unwrap(),
        dir
    );
    let supervisor = env.mapper.as_ref().unwrap().pid();
    let worker: u32 =
        std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children"))
            .unwrap()
            .split_whitespace()
            .next()
            .expect("the mapper's worker")
            .parse()
            .unwrap();
    for (what, pid) in [
        ("rbdkit csi", env.csi.pid()),
        ("the mapper's worker", worker),
        ("the mapper's supervisor", supervisor),
    ] {
        crash_with_core_allowed(pid);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::path::Path::new(&format!("/proc/{pid}/cwd")).exists()
            && std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| !s.contains(") Z "))
                .unwrap_or(false)
        {
            assert!(Instant::now() < deadline, "{what} did not die");
            std::thread::sleep(Duration::from_millis(50));
        }
        // A core is written before the process is reaped; give it time.
        std::thread::sleep(Duration::from_millis(500));
        let cores = cores_in(&dir);
        for c in &cores {
            let _ = std::fs::remove_file(dir.join(c));
        }
        assert!(
            cores.is_empty(),
            "{what} dumped core with the key in it: {cores:?}"
        );
    }
    drop(env);
}
