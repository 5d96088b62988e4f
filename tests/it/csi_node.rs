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
    CapacityRange, ControllerExpandVolumeRequest, DeleteVolumeRequest, NodeExpandVolumeRequest,
    NodeGetCapabilitiesRequest, NodeGetInfoRequest, NodeGetVolumeStatsRequest,
    NodePublishVolumeRequest, NodeUnpublishVolumeRequest, NodeUnstageVolumeRequest,
    VolumeCapability,
};
use rbdkit::rbd::Image;
use rbdkit::volume::VolumeId;
use support::csi::{block_cap, mount_cap, CsiEnv, Mode};
use support::data::pattern;
use tonic::Code;

const MIB: i64 = 1 << 20;

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
    env.controller()
        .await
        .delete_volume(DeleteVolumeRequest {
            volume_id: id.to_owned(),
            secrets: env.secrets(),
        })
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
    assert!(!stats.volume_condition.unwrap().abnormal);
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
    let cond = stats.volume_condition.unwrap();
    assert!(!cond.abnormal, "{}", cond.message);
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
    assert!(e.message().contains("in use"), "{e}");
    assert!(!mounted(&pb.staging.join("volume")));
    drop(node_b);

    unstage(&env, &id, &p).await;
    delete(&env, &id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_report_a_dead_mapper_as_abnormal() {
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
    assert!(!ok.volume_condition.unwrap().abnormal);
    env.mapper.as_mut().unwrap().kill9();
    let bad = env
        .node()
        .await
        .node_get_volume_stats(req())
        .await
        .unwrap()
        .into_inner();
    let cond = bad.volume_condition.unwrap();
    assert!(cond.abnormal, "a dead mapper must be reported");
    // The restarted mapper knows the volume but reports it unhealthy until
    // it is staged again; unpublish and unstage still clean up.
    env.mapper.as_mut().unwrap().restart();
    env.wait_mapper();
    let after = env
        .node()
        .await
        .node_get_volume_stats(req())
        .await
        .unwrap()
        .into_inner();
    assert!(after.volume_condition.unwrap().abnormal);
    unpublish(&env, &id, &p).await;
    unstage(&env, &id, &p).await;
    stage(&env, &id, &p, mount_cap("ext4")).await;
    publish(&env, &id, &p, mount_cap("ext4"), false).await;
    let healed = env
        .node()
        .await
        .node_get_volume_stats(req())
        .await
        .unwrap()
        .into_inner();
    assert!(!healed.volume_condition.unwrap().abnormal);
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
        .node_get_info(NodeGetInfoRequest {})
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
    assert_eq!(caps.capabilities.len(), 5);
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
