//! Single writer, really: two node services (each `rbdkit csi --mode all`
//! with its own `rbdkit fuse-mapper`, state dir and node id) stage the same
//! volume at the same moment. A read-write (RWO) volume ends up staged on
//! exactly one of them; RWX Block on both; a dead node's lock is broken only
//! when that is configured, and only after its clients are blocklisted.
use crate::support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rbdkit::csi::proto::{volume_capability, NodeUnstageVolumeRequest, VolumeCapability};
use rbdkit::node::fuse::FuseMapper;
use rbdkit::rbd::Image;
use rbdkit::volume::VolumeId;
use support::csi::{mount_cap, CsiEnv, Mode};
use tonic::Code;

const MIB: i64 = 1 << 20;

/// A second node of `a`'s cluster and namespace.
async fn node_of(a: &CsiEnv, node_id: &str, flags: &[&str]) -> CsiEnv {
    CsiEnv::with_ns(
        a.rbd.clone(),
        a.cluster_id.clone(),
        Mode::All,
        node_id,
        flags,
    )
    .await
}

fn staging(env: &CsiEnv, name: &str) -> PathBuf {
    let p = env.path(&format!("staging-{name}"));
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn mapper(env: &CsiEnv) -> FuseMapper {
    FuseMapper::new(env.path("mapper.sock"))
}

/// Loop devices bound to a file of this env's mapper.
fn loop_devices_of(env: &CsiEnv) -> Vec<PathBuf> {
    let root = env.dir.path().to_owned();
    rbdkit::node::loopdev::list()
        .into_iter()
        .filter(|(_, b)| b.starts_with(&root))
        .map(|(d, _)| d)
        .collect()
}

fn mounted(p: &Path) -> bool {
    rbdkit::node::mount::is_mount_point(p).unwrap_or(false)
}

async fn unstage(env: &CsiEnv, id: &str, staging: &Path) {
    env.node()
        .await
        .node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: id.to_owned(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .unwrap_or_else(|e| panic!("NodeUnstageVolume on {}: {e}", env.node_id));
}

async fn delete(env: &CsiEnv, id: &str) {
    env.controller()
        .await
        .delete_volume(rbdkit::csi::proto::DeleteVolumeRequest {
            volume_id: id.to_owned(),
            secrets: env.secrets(),
        })
        .await
        .unwrap_or_else(|e| panic!("DeleteVolume: {e}"));
}

fn rwx_block_cap() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(volume_capability::AccessMode {
            mode: volume_capability::access_mode::Mode::MultiNodeMultiWriter as i32,
        }),
        access_type: Some(volume_capability::AccessType::Block(
            volume_capability::BlockVolume {},
        )),
    }
}

/// Asserts that `loser` holds nothing of volume `id`: no mount, no stash,
/// no mapping, no loop device.
fn holds_nothing(loser: &CsiEnv, id: &str, staging: &Path, round: usize) {
    let who = &loser.node_id;
    assert!(
        !mounted(&staging.join("volume")),
        "round {round}: the loser {who} mounted it"
    );
    assert!(
        !staging.join("rbdkit.json").exists(),
        "round {round}: the loser {who} left a stash"
    );
    let attached: Vec<String> = mapper(loser)
        .list()
        .unwrap()
        .into_iter()
        .map(|a| a.volume_id)
        .collect();
    assert!(
        !attached.iter().any(|v| v == id),
        "round {round}: the loser {who} left {id} mapped: {attached:?}"
    );
    assert!(
        loop_devices_of(loser).is_empty(),
        "round {round}: the loser {who} left loop devices {:?}",
        loop_devices_of(loser)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn two_nodes_racing_for_one_rwo_volume_exactly_one_wins_20_rounds() {
    let a = CsiEnv::new("race-rwo", Mode::All).await;
    let b = node_of(&a, "node-b", &[]).await;
    let (mut na, mut nb) = (a.node().await, b.node().await);
    let mut wins = [0usize; 2];
    for round in 0..20 {
        let id = a
            .create_volume(&format!("pvc-race-{round}"), 32 * MIB, mount_cap("ext4"))
            .await;
        let image = VolumeId::parse(&id).unwrap().image;
        let (sa, sb) = (
            staging(&a, &format!("r{round}")),
            staging(&b, &format!("r{round}")),
        );
        let (ra, rb) = tokio::join!(
            na.node_stage_volume(a.stage_request(&id, &sa, mount_cap("ext4"))),
            nb.node_stage_volume(b.stage_request(&id, &sb, mount_cap("ext4"))),
        );
        assert_eq!(
            ra.is_ok() as usize + rb.is_ok() as usize,
            1,
            "round {round}: exactly one node may win; node-a: {:?}, node-b: {:?}",
            ra.as_ref()
                .map(|_| "staged")
                .map_err(|e| e.message().to_owned()),
            rb.as_ref()
                .map(|_| "staged")
                .map_err(|e| e.message().to_owned()),
        );
        let (winner, ws, loser, ls, err) = match (&ra, &rb) {
            (Ok(_), Err(e)) => (&a, &sa, &b, &sb, e),
            (Err(e), Ok(_)) => (&b, &sb, &a, &sa, e),
            _ => unreachable!(),
        };
        wins[usize::from(std::ptr::eq(winner, &b))] += 1;
        assert_eq!(err.code(), Code::FailedPrecondition, "round {round}: {err}");
        for want in [image.as_str(), winner.node_id.as_str()] {
            assert!(
                err.message().contains(want),
                "round {round}: the loser's error names {want}: {err}"
            );
        }
        assert!(
            mounted(&ws.join("volume")),
            "round {round}: the winner's mount"
        );
        holds_nothing(loser, &id, ls, round);
        unstage(winner, &id, ws).await;
        delete(&a, &id).await;
    }
    eprintln!("wins: node-a {}, node-b {}", wins[0], wins[1]);
}

#[tokio::test(flavor = "multi_thread")]
async fn rwx_block_is_staged_on_both_nodes_and_rwo_is_refused_meanwhile() {
    let a = CsiEnv::new("race-rwx", Mode::All).await;
    let b = node_of(&a, "node-b", &[]).await;
    let id = a.create_volume("pvc-rwx", 32 * MIB, rwx_block_cap()).await;
    let (sa, sb) = (staging(&a, "x"), staging(&b, "x"));
    // One after the other: the second node finds the first one's mapping.
    for (env, s) in [(&a, &sa), (&b, &sb)] {
        env.node()
            .await
            .node_stage_volume(env.stage_request(&id, s, rwx_block_cap()))
            .await
            .unwrap_or_else(|e| panic!("RWX block stage on {}: {e}", env.node_id));
    }

    // Both devices are the one image: what node-a writes, node-b reads.
    let data = support::data::pattern(3, 1 << 20);
    support::data::direct_write(&sa.join("volume"), 8 << 20, &data);
    let back = support::data::direct_read(&sb.join("volume"), 8 << 20, data.len());
    assert!(back == data, "node-b reads what node-a wrote");

    // A single-writer stage of the same image on a third node is refused
    // while they hold it.
    let c = node_of(&a, "node-c", &[]).await;
    let sc = staging(&c, "x");
    let e = c
        .node()
        .await
        .node_stage_volume(c.stage_request(&id, &sc, support::csi::block_cap()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    holds_nothing(&c, &id, &sc, 0);

    unstage(&a, &id, &sa).await;
    unstage(&b, &id, &sb).await;
    // Released by both: now it stages single-writer.
    c.node()
        .await
        .node_stage_volume(c.stage_request(&id, &sc, support::csi::block_cap()))
        .await
        .unwrap_or_else(|e| panic!("RWO stage after both unstaged: {e}"));
    unstage(&c, &id, &sc).await;
    delete(&a, &id).await;
}

/// The `osd blocklist ls` entries (addresses).
fn blocklist() -> Vec<String> {
    let out = support::ceph::mon_json(serde_json::json!({
        "prefix": "osd blocklist ls", "format": "json",
    }))
    .expect("osd blocklist ls");
    // The first JSON value (the monitor may append more after it).
    let v: serde_json::Value = serde_json::Deserializer::from_slice(&out)
        .into_iter()
        .next()
        .and_then(Result::ok)
        .unwrap_or_default();
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["addr"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn unblocklist(addr: &str) {
    let _ = support::ceph::mon_json(serde_json::json!({
        "prefix": "osd blocklist", "blocklistop": "rm", "addr": addr,
    }));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_nodes_lock_is_broken_only_after_its_clients_are_blocklisted() {
    let mut a = CsiEnv::new("race-dead", Mode::All).await;
    let id = a
        .create_volume("pvc-dead", 32 * MIB, mount_cap("ext4"))
        .await;
    let image = VolumeId::parse(&id).unwrap().image;
    let sa = staging(&a, "d");
    a.node()
        .await
        .node_stage_volume(a.stage_request(&id, &sa, mount_cap("ext4")))
        .await
        .unwrap();
    // The mapper's librados client, as its state records it.
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.path("mapper/state.json")).unwrap()).unwrap();
    let mapper_client = state.to_string();
    let before = blocklist();

    // node-a dies: its plugin and its mapper, with no unstage.
    a.csi.kill9();
    a.mapper.as_mut().unwrap().kill9();

    // Without --break-dead-locks, another node is refused, naming node-a,
    // also once node-a's last watch on the image is gone.
    let b = node_of(&a, "node-b", &[]).await;
    let sb = staging(&b, "d");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let watchers = Image::open_read_only(&a.rbd.ioctx, &image)
            .unwrap()
            .watchers()
            .unwrap();
        let e = b
            .node()
            .await
            .node_stage_volume(b.stage_request(&id, &sb, mount_cap("ext4")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("node-a"), "names the holder: {e}");
        holds_nothing(&b, &id, &sb, 0);
        if watchers.is_empty() {
            assert!(e.message().contains("--break-dead-locks"), "says how: {e}");
            break;
        }
        assert!(Instant::now() < deadline, "node-a's watch never expired");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    drop(b);

    // With it, the lock is broken after the grace period, once node-a's
    // clients are blocklisted.
    let c = node_of(
        &a,
        "node-c",
        &["--break-dead-locks", "--dead-lock-grace", "3s"],
    )
    .await;
    let sc = staging(&c, "d");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut refused = 0;
    loop {
        match c
            .node()
            .await
            .node_stage_volume(c.stage_request(&id, &sc, mount_cap("ext4")))
            .await
        {
            Ok(_) => break,
            Err(e) => {
                assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
                assert!(e.message().contains("node-a"), "{e}");
                refused += 1;
                assert!(Instant::now() < deadline, "never broken: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    assert!(refused >= 1, "the grace period was not waited");
    let added: Vec<String> = blocklist()
        .into_iter()
        .filter(|x| !before.contains(x))
        .collect();
    for addr in &added {
        unblocklist(addr);
    }
    assert!(
        added.len() >= 2,
        "node-a's plugin and mapper clients are blocklisted: {added:?}"
    );
    assert!(
        added.iter().any(|x| mapper_client.contains(x.as_str())),
        "node-a's mapper client ({mapper_client}) is among {added:?}"
    );
    std::fs::write(sc.join("volume/after"), b"c owns it").unwrap();
    unstage(&c, &id, &sc).await;
    delete(&c, &id).await;
}

/// Kill -9 and restart of the node plugin, then NodeUnstage with no
/// secrets (as kubelet sends it, say while draining a cordoned node): the
/// lock is released within the call, so the volume stages on another node
/// at once. Before, the release waited for some later call to bring
/// credentials, and on a drained node none came.
#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_plugin_releases_its_lock_at_unstage_without_secrets() {
    let mut a = CsiEnv::new("race-restart", Mode::All).await;
    let b = node_of(&a, "node-b", &[]).await;
    let id = a
        .create_volume("pvc-restart", 32 * MIB, mount_cap("ext4"))
        .await;
    let sa = staging(&a, "k");
    let stage = |env: &CsiEnv, id: &str, s: &Path| {
        let req = env.stage_request(id, s, mount_cap("ext4"));
        let env_socket = env.socket.clone();
        async move {
            rbdkit::csi::proto::node_client::NodeClient::new(
                support::csi::channel(&env_socket).await,
            )
            .node_stage_volume(req)
            .await
        }
    };
    stage(&a, &id, &sa).await.unwrap();

    // Restarted: the lock taken by its previous client is still its own.
    a.csi.restart();
    stage(&a, &id, &sa)
        .await
        .unwrap_or_else(|e| panic!("a repeat after a restart: {e}"));
    let sb = staging(&b, "k");
    let e = stage(&b, &id, &sb).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("node-a"), "{e}");
    holds_nothing(&b, &id, &sb, 0);

    // Killed again, and unstaged by a server that has seen no secrets.
    a.csi.restart();
    unstage(&a, &id, &sa).await;
    assert!(!mounted(&sa.join("volume")));
    stage(&b, &id, &sb)
        .await
        .unwrap_or_else(|e| panic!("node-b, right after node-a unstaged: {e}"));
    unstage(&b, &id, &sb).await;
    delete(&a, &id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stage_killed_at_any_point_converges_on_retry_and_unstage_releases() {
    let mut a = CsiEnv::new("race-kill", Mode::All).await;
    let b = node_of(&a, "node-b", &[]).await;
    for (round, delay_ms) in [0u64, 15, 40, 80, 150, 300, 600].into_iter().enumerate() {
        let id = a
            .create_volume(&format!("pvc-kill-{round}"), 32 * MIB, mount_cap("ext4"))
            .await;
        let sa = staging(&a, &format!("k{round}"));
        let req = a.stage_request(&id, &sa, mount_cap("ext4"));
        let mut client = a.node().await;
        let call = tokio::spawn(async move { client.node_stage_volume(req).await });
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        a.csi.kill9();
        let _ = call.await;
        a.csi.restart();
        // kubelet retries until it succeeds.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match a
                .node()
                .await
                .node_stage_volume(a.stage_request(&id, &sa, mount_cap("ext4")))
                .await
            {
                Ok(_) => break,
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "round {round}: never staged: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        assert!(mounted(&sa.join("volume")), "round {round}");
        // The other node is refused meanwhile, then gets it once unstaged.
        let sb = staging(&b, &format!("k{round}"));
        let e = b
            .node()
            .await
            .node_stage_volume(b.stage_request(&id, &sb, mount_cap("ext4")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "round {round}: {e}");
        unstage(&a, &id, &sa).await;
        b.node()
            .await
            .node_stage_volume(b.stage_request(&id, &sb, mount_cap("ext4")))
            .await
            .unwrap_or_else(|e| panic!("round {round}: after node-a unstaged: {e}"));
        unstage(&b, &id, &sb).await;
        delete(&a, &id).await;
    }
}

/// A break refused because a client that is not the holder's still has
/// the image open fences no one (a live node must never be blocklisted).
/// Before, the holder's address and its node's recorded clients were
/// blocklisted first and the watchers checked after.
#[test]
fn a_refused_break_blocklists_no_one() {
    use rbdkit::node::stage_lock::{Acquired, ImageLock, LockMode};
    use support::ceph::{TestCluster, TestNs, POOL};
    let ns = TestNs::new("race-refused");
    rbdkit::rbd::create(&ns.ioctx, "img", 8 << 20, &rbdkit::rbd::ImageOptions::new()).unwrap();
    let ceph = TestCluster::get();
    // node-x takes the staging lock with a client of its own.
    let holder_client = ceph.connect();
    let holder = ImageLock::open(&holder_client, POOL, &ns.name, "img").unwrap();
    assert!(matches!(
        holder.acquire(LockMode::Exclusive, "node-x").unwrap(),
        Acquired::Taken
    ));
    // Another client, which no node recorded, has the image open.
    let user_client = ceph.connect();
    let io = user_client.ioctx_ns(POOL, &ns.name).unwrap();
    let open = Image::open(&io, "img").unwrap();

    let breaker = ImageLock::open(&support::ceph::cluster(), POOL, &ns.name, "img").unwrap();
    let held = breaker.holders().unwrap().lockers;
    assert_eq!(held.len(), 1);
    let e = breaker.fence_and_break(&held[0]).unwrap_err();
    assert_eq!(e.kind(), rbdkit::ErrorKind::Busy, "{e}");
    let ls = support::ceph::mon_json(serde_json::json!({
        "prefix": "osd blocklist ls",
        "format": "json"
    }))
    .unwrap();
    let ls = String::from_utf8_lossy(&ls);
    // Listed without the messenger prefix (`v1:`).
    let addr = held[0].addr.split_once(':').map_or("", |(_, a)| a);
    assert!(addr.contains('/'), "{:?}", held[0].addr);
    assert!(
        !ls.contains(addr),
        "the break was refused, yet {addr} was blocklisted: {ls}"
    );
    assert_eq!(breaker.holders().unwrap().lockers, held, "the lock changed");
    drop(open);
}
