//! Single writer, really: two node services (each `rbdkit csi --mode all`
//! with its own `rbdkit fuse-mapper`, state dir and node id) stage the same
//! volume at the same moment. A read-write (RWO) volume ends up staged on
//! exactly one of them; RWX Block on both; a live node's lock is never
//! broken (a dead node's is, by the provisioner, once the node is declared
//! out of service: `tests/it/provisioner_out_of_service.rs`).
use crate::support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rbdkit::csi::proto::{volume_capability, VolumeCapability};
use rbdkit::node::fuse::FuseMapper;
use rbdkit::node::stage_lock::{Acquired, ImageLock, LockMode};
use rbdkit::rbd::Image;
use rbdkit::volume::VolumeId;
use support::ceph::{TestCluster, TestNs, POOL};
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
        winner.unstage(&id, ws).await;
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

    a.unstage(&id, &sa).await;
    b.unstage(&id, &sb).await;
    // Released by both: now it stages single-writer.
    c.node()
        .await
        .node_stage_volume(c.stage_request(&id, &sc, support::csi::block_cap()))
        .await
        .unwrap_or_else(|e| panic!("RWO stage after both unstaged: {e}"));
    c.unstage(&id, &sc).await;
    delete(&a, &id).await;
}

/// A node that is alive keeps its lock, however long its image has had
/// no watcher: here node-a's plugin was killed between unmapping a volume
/// and releasing its lock (a live node's leftover lock, as a deferred
/// release also leaves), and node-b, run with the old `--break-dead-locks
/// --dead-lock-grace 1s`, is refused for as long as it asks, nothing is
/// blocklisted, and node-a's other volume keeps working. Before, node-b
/// blocklisted node-a's plugin and mapper clients after the grace period
/// (failing every volume of node-a) and broke the lock.
#[tokio::test(flavor = "multi_thread")]
async fn a_live_node_whose_image_lost_its_watcher_is_never_fenced() {
    let mut a = CsiEnv::new("race-alive", Mode::All).await;
    let cap = || mount_cap("ext4");
    let lost = a.create_volume("pvc-lost", 32 * MIB, cap()).await;
    let other = a.create_volume("pvc-other", 32 * MIB, cap()).await;
    let (s_lost, s_other) = (staging(&a, "lost"), staging(&a, "other"));
    for (id, s) in [(&lost, &s_lost), (&other, &s_other)] {
        a.node()
            .await
            .node_stage_volume(a.stage_request(id, s, cap()))
            .await
            .unwrap_or_else(|e| panic!("stage {id} on node-a: {e}"));
    }
    let before = support::ceph::blocklist_addrs();

    // node-a's plugin dies halfway through unstaging `lost`: unmounted,
    // its loop device gone, unmapped, the lock still held.
    a.csi.kill9();
    let file = mapper(&a).find(&lost).unwrap().expect("lost is mapped");
    let umount = std::process::Command::new("umount")
        .arg(s_lost.join("volume"))
        .status()
        .unwrap();
    assert!(umount.success(), "umount");
    for dev in rbdkit::node::loopdev::find_by_backing_file(&file) {
        rbdkit::node::loopdev::detach(&dev).unwrap();
    }
    use rbdkit::node::Mapper;
    mapper(&a).unmap(&lost, &[]).unwrap();
    let image = VolumeId::parse(&lost).unwrap().image;
    let watchers = Image::open_read_only(&a.rbd.ioctx, &image)
        .unwrap()
        .watchers()
        .unwrap();
    assert!(watchers.is_empty(), "{watchers:?}");
    a.csi.restart();
    let l = ImageLock::open(&support::ceph::cluster(), POOL, &a.rbd.name, &image).unwrap();
    let a_clients = l.node_clients("node-a").unwrap();
    assert!(
        a_clients.len() >= 2,
        "node-a's plugin and mapper: {a_clients:?}"
    );

    let b = node_of(
        &a,
        "node-b",
        &["--break-dead-locks", "--dead-lock-grace", "1s"],
    )
    .await;
    let sb = staging(&b, "lost");
    let until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < until {
        let e = b
            .node()
            .await
            .node_stage_volume(b.stage_request(&lost, &sb, cap()))
            .await
            .expect_err("node-b staged a volume node-a holds");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("node-a"), "names the holder: {e}");
        assert!(
            e.message().contains("node.kubernetes.io/out-of-service"),
            "says how a dead node's lock goes: {e}"
        );
        holds_nothing(&b, &lost, &sb, 0);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // Other tests fence their own clients meanwhile: only node-a's
    // clients (and their whole address) matter here.
    let bare = |a: &str| {
        let a = a.trim_start_matches("v1:").trim_start_matches("v2:");
        a.trim_start_matches("any:").to_owned()
    };
    let mut node_a: Vec<String> = a_clients.iter().map(|c| bare(c)).collect();
    node_a.extend(a_clients.iter().filter_map(|c| {
        rbdkit::volume::node_fence::addr_ip(c).map(rbdkit::volume::node_fence::ip_entry)
    }));
    let added: Vec<String> = support::ceph::blocklist_addrs()
        .into_iter()
        .filter(|x| !before.contains(x) && node_a.contains(x))
        .collect();
    assert!(added.is_empty(), "a live node was blocklisted: {added:?}");
    // node-a's other volume works.
    let f = s_other.join("volume/still-here");
    std::fs::write(&f, b"node-a is alive").unwrap();
    std::fs::File::open(&f).unwrap().sync_all().unwrap();

    // The lock is node-a's until it is broken on purpose: break_node
    // takes it (no client watches the image), and node-b stages.
    assert_eq!(l.break_node("node-a", &[]).unwrap(), 1);
    b.node()
        .await
        .node_stage_volume(b.stage_request(&lost, &sb, cap()))
        .await
        .unwrap_or_else(|e| panic!("stage on node-b once the lock is broken: {e}"));
    b.unstage(&lost, &sb).await;
    a.unstage(&other, &s_other).await;
    delete(&a, &lost).await;
    delete(&a, &other).await;
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
    a.unstage(&id, &sa).await;
    assert!(!mounted(&sa.join("volume")));
    stage(&b, &id, &sb)
        .await
        .unwrap_or_else(|e| panic!("node-b, right after node-a unstaged: {e}"));
    b.unstage(&id, &sb).await;
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
        a.unstage(&id, &sa).await;
        b.node()
            .await
            .node_stage_volume(b.stage_request(&id, &sb, mount_cap("ext4")))
            .await
            .unwrap_or_else(|e| panic!("round {round}: after node-a unstaged: {e}"));
        b.unstage(&id, &sb).await;
        delete(&a, &id).await;
    }
}

/// A node's locks are not broken while a client from outside its fenced
/// addresses has the image open (someone else uses it), and are once none
/// does.
#[test]
fn break_node_spares_an_image_open_outside_the_fence() {
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
    // Another client, on an address that is not node-x's, has the image open.
    let user_client = ceph.connect();
    let io = user_client.ioctx_ns(POOL, &ns.name).unwrap();
    let open = Image::open(&io, "img").unwrap();

    let breaker = ImageLock::open(&support::ceph::cluster(), POOL, &ns.name, "img").unwrap();
    let held = breaker.holders().unwrap().lockers;
    assert_eq!(held.len(), 1);
    let node_x: std::net::IpAddr = "192.0.2.7".parse().unwrap();
    let e = breaker.break_node("node-x", &[node_x]).unwrap_err();
    assert_eq!(e.kind(), rbdkit::ErrorKind::Busy, "{e}");
    assert_eq!(breaker.holders().unwrap().lockers, held, "the lock changed");
    assert_eq!(
        breaker.node_clients("node-x").unwrap(),
        vec![held[0].addr.clone()],
        "node-x is known by its lock holder's address"
    );
    drop(open);
    assert_eq!(breaker.break_node("node-x", &[node_x]).unwrap(), 1);
    assert!(breaker.holders().unwrap().lockers.is_empty());
    assert_eq!(
        breaker.break_node("node-x", &[node_x]).unwrap(),
        0,
        "a repeat"
    );
}

/// A NodeStage that gives up on the mapper's attach (its client timeout)
/// while the mapper still completes it: the stage unmaps it before it
/// lets go of its lock and record, so nothing stays mapped that no stash
/// knows, and the retry stages normally. The attach is held up by a
/// monitor that hangs (SIGSTOP): the node service's own connection works
/// on (OSD ops), the mapper's new client waits for the monitor.
#[tokio::test(flavor = "multi_thread")]
async fn an_attach_the_stage_gave_up_on_is_undone_when_it_completes() {
    let mut a = CsiEnv::with_ns(
        std::sync::Arc::new(TestNs::new("race-late")),
        support::ceph::unique("race-late"),
        Mode::All,
        "node-a",
        &["--mapper-attach-timeout", "4s"],
    )
    .await;
    let other = support::ceph::PrivateCluster::start("late");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.path("config.json")).unwrap()).unwrap();
    config.as_array_mut().unwrap().push(serde_json::json!({
        "clusterID": "late-other",
        "monitors": [other.conf_value("mon host").unwrap()],
    }));
    std::fs::write(a.path("config.json"), config.to_string()).unwrap();
    a.csi.restart();
    let secrets = std::collections::HashMap::from([
        ("userID".to_owned(), "admin".to_owned()),
        ("userKey".to_owned(), other.admin_key()),
    ]);
    let id = a
        .controller()
        .await
        .create_volume(rbdkit::csi::proto::CreateVolumeRequest {
            name: "pvc-late".into(),
            capacity_range: Some(rbdkit::csi::proto::CapacityRange {
                required_bytes: 32 * MIB,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_cap("ext4")],
            parameters: std::collections::HashMap::from([
                ("clusterID".to_owned(), "late-other".to_owned()),
                ("pool".to_owned(), POOL.to_owned()),
            ]),
            secrets: secrets.clone(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e}"))
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let sa = staging(&a, "late");
    let mut req = a.stage_request(&id, &sa, mount_cap("ext4"));
    req.secrets = secrets;
    let stage = |req: rbdkit::csi::proto::NodeStageVolumeRequest| {
        let socket = a.socket.clone();
        async move {
            rbdkit::csi::proto::node_client::NodeClient::new(support::csi::channel(&socket).await)
                .node_stage_volume(req)
                .await
        }
    };

    other.pause_daemon("mon.a", true);
    let pending = tokio::spawn(stage(req.clone()));
    // Past the 4 s the stage waits for the attach, then the monitor
    // answers again and the attach completes in the mapper.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let attaching = mapper(&a).list().unwrap_or_default();
    other.pause_daemon("mon.a", false);
    let e = tokio::time::timeout(Duration::from_secs(120), pending)
        .await
        .expect("the stage never returned")
        .unwrap()
        .expect_err("a stage whose attach timed out");
    assert_ne!(e.code(), Code::Ok);
    assert!(
        attaching.is_empty(),
        "mapped before the monitor answered: {attaching:?}"
    );
    // The mapper did complete the attach (at once, or soon after if the
    // stage did not wait for it), and it was undone.
    let line_of = |log: &str, what: &str| {
        log.lines()
            .position(|l| l.contains(what) && l.contains(&id))
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let log = loop {
        let log = std::fs::read_to_string(a.path("mapper.log")).unwrap();
        if line_of(&log, " attached").is_some() {
            break log;
        }
        assert!(
            Instant::now() < deadline,
            "the mapper never completed the attach:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let detached = line_of(&log, " detached");
    assert!(
        detached > line_of(&log, " attached"),
        "the late attach was not undone:\n{log}"
    );
    holds_nothing(&a, &id, &sa, 0);

    // The retry stages it, once.
    stage(req.clone())
        .await
        .unwrap_or_else(|e| panic!("the retry: {e}"));
    assert_eq!(loop_devices_of(&a).len(), 1);
    a.unstage(&id, &sa).await;
    holds_nothing(&a, &id, &sa, 1);
}
