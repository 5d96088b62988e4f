//! RBD mirroring against real clusters: pool modes, site names, peers and
//! bootstrap tokens on the shared cluster; image mirroring, promotion,
//! demotion, resync, status and mirror snapshot schedules on two clusters
//! mirroring each other with an rbd-mirror daemon each way
//! (`support::ceph::MirrorPair`).

use crate::support;

use std::time::{Duration, Instant};

use rbdkit::rados::{Cluster, IoCtx};
use rbdkit::rbd::{
    self, Image, ImageOptions, MirrorImageMode, MirrorImageState, MirrorMode, MirrorPeerDirection,
    MirrorSnapState, MirrorSnapshotFlags, MirrorStatusState, ScheduleLevel,
};
use rbdkit::ErrorKind;
use support::ceph::{cluster, unique, MirrorPair, POOL};

const MIB: u64 = 1 << 20;
/// Longest any one wait on the daemons may take.
const WAIT: Duration = Duration::from_secs(90);

fn until<T>(what: &str, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        match f() {
            Ok(v) => return v,
            Err(last) if Instant::now() > deadline => {
                panic!("timed out after {WAIT:?} waiting for {what}; last: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

#[test]
fn pool_mode_site_name_peers_and_tokens() {
    // Pool-wide settings: a pool of this test's own on the shared cluster.
    let c = cluster();
    let pool = unique("mirrorpool");
    c.pool_create(&pool).unwrap();
    let io = c.ioctx(&pool).unwrap();
    rbd::pool_init(&io, false).unwrap();

    assert_eq!(rbd::mirror_mode_get(&io).unwrap(), MirrorMode::Disabled);
    rbd::mirror_mode_set(&io, MirrorMode::Image).unwrap();
    assert_eq!(rbd::mirror_mode_get(&io).unwrap(), MirrorMode::Image);
    assert_eq!(rbd::mirror_uuid_get(&io).unwrap().len(), 36);
    // No name set: the fsid.
    let name = rbd::mirror_site_name_get(&c).unwrap();
    assert!(!name.is_empty());

    let uuid = rbd::mirror_peer_site_add(&io, MirrorPeerDirection::RxTx, "far-site", "client.far")
        .unwrap();
    let peers = rbd::mirror_peer_site_list(&io).unwrap();
    assert_eq!(peers.len(), 1, "{peers:?}");
    assert_eq!(peers[0].uuid, uuid);
    assert_eq!(peers[0].site_name, "far-site");
    assert_eq!(peers[0].client_name, "client.far");
    assert_eq!(peers[0].direction, MirrorPeerDirection::RxTx);
    assert_eq!(peers[0].last_seen, None);
    rbd::mirror_peer_site_remove(&io, &uuid).unwrap();
    assert!(rbd::mirror_peer_site_list(&io).unwrap().is_empty());
    // A tx-only peer is refused, naming the pool and the peer.
    let e = rbd::mirror_peer_site_add(&io, MirrorPeerDirection::Tx, "far-site", "client.far")
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(
        e.to_string().contains(&pool) && e.to_string().contains("far-site"),
        "{e}"
    );
    assert!(rbd::mirror_peer_site_list(&io).unwrap().is_empty());

    // A token is a credential: it never shows in Debug.
    let token = rbd::mirror_peer_bootstrap_create(&io).unwrap();
    assert!(token.expose().len() > 40);
    assert_eq!(format!("{token:?}"), "Secret(<redacted>)");
    // A cluster's own token, and a tx-only import, are refused by name
    // without the key in the message.
    let e = rbd::mirror_peer_bootstrap_import(&io, MirrorPeerDirection::RxTx, &token).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains(&pool), "{e}");
    assert!(!e.to_string().contains(token.expose()), "{e}");
    let e = rbd::mirror_peer_bootstrap_import(&io, MirrorPeerDirection::Tx, &token).unwrap_err();
    assert!(e.to_string().contains("never tx only"), "{e}");
    assert!(rbd::mirror_peer_site_list(&io).unwrap().is_empty());

    rbd::mirror_mode_set(&io, MirrorMode::Disabled).unwrap();
    c.pool_delete(&pool).unwrap();
}

#[test]
fn a_mirror_pair_has_its_sites_and_peers() {
    let pair = MirrorPair::shared();
    for (me, peer) in [(&pair.a, &pair.b), (&pair.b, &pair.a)] {
        let c = me.connect();
        let io = c.ioctx(POOL).unwrap();
        assert_eq!(rbd::mirror_site_name_get(&c).unwrap(), MirrorPair::site(me));
        assert_eq!(rbd::mirror_mode_get(&io).unwrap(), MirrorMode::Image);
        let peers = rbd::mirror_peer_site_list(&io).unwrap();
        assert_eq!(peers.len(), 1, "{peers:?}");
        assert_eq!(peers[0].site_name, MirrorPair::site(peer));
        assert_eq!(peers[0].direction, MirrorPeerDirection::RxTx);
        // Filled once the peer's daemon has been seen.
        assert_eq!(
            peers[0].mirror_uuid,
            rbd::mirror_uuid_get(&peer.connect().ioctx(POOL).unwrap()).unwrap()
        );
    }
}

/// Site A and B connections and ioctxs on the mirrored pool.
struct Sites {
    a: Cluster,
    ia: IoCtx,
    ib: IoCtx,
}

fn sites() -> Sites {
    let pair = MirrorPair::shared();
    let (a, b) = (pair.a.connect(), pair.b.connect());
    Sites {
        ia: a.ioctx(POOL).unwrap(),
        ib: b.ioctx(POOL).unwrap(),
        a,
    }
}

/// Waits until the copy of `name` in `io` (non-primary) has copied the
/// primary snapshot `snap_id` in full.
fn wait_copied(io: &IoCtx, name: &str, snap_id: u64) {
    until(&format!("{name} copied up to snapshot {snap_id}"), || {
        let img = Image::open_read_only(io, name).map_err(|e| e.to_string())?;
        let snaps = img.snap_list().map_err(|e| e.to_string())?;
        let done = snaps.iter().any(|s| {
            img.snap_mirror_namespace(s.id)
                .is_ok_and(|m| m.primary_snap_id == snap_id && m.complete)
        });
        if done {
            Ok(())
        } else {
            Err(format!(
                "snapshots {:?}",
                snaps.iter().map(|s| &s.name).collect::<Vec<_>>()
            ))
        }
    })
}

fn read(io: &IoCtx, name: &str, len: usize) -> Vec<u8> {
    let img = Image::open_read_only(io, name).unwrap();
    let mut buf = vec![0u8; len];
    img.read_exact(0, &mut buf).unwrap();
    buf
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Promotes the copy at `io`, retrying while the other site's demotion is
/// on its way (`Busy`) and while this site's daemon, done copying it, still
/// holds the image (`ReadOnly`).
fn promote_when_demotion_arrives(io: &IoCtx, name: &str) {
    until(&format!("{name} promotable"), || {
        let img = Image::open(io, name).map_err(|e| e.to_string())?;
        match img.mirror_promote_within(false, Duration::from_secs(30)) {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.kind(), ErrorKind::Busy | ErrorKind::ReadOnly) => {
                Err(e.to_string())
            }
            Err(e) => panic!("promote {name}: {e}"),
        }
    })
}

#[test]
fn an_image_fails_over_and_back_without_losing_a_byte() {
    let s = sites();
    let name = unique("mirrored");
    rbd::create(&s.ia, &name, 16 * MIB, &ImageOptions::new()).unwrap();
    let a = Image::open(&s.ia, &name).unwrap();
    let first = pattern(1, MIB as usize);
    a.write(0, &first).unwrap();

    // Not mirrored yet: a mirror snapshot is refused by name.
    assert_eq!(a.mirror_info().unwrap().state, MirrorImageState::Disabled);
    let e = a
        .mirror_create_snapshot(MirrorSnapshotFlags::default())
        .unwrap_err();
    assert!(e.to_string().contains(&name), "{e}");
    a.mirror_enable(MirrorImageMode::Snapshot).unwrap();
    a.mirror_enable(MirrorImageMode::Snapshot).unwrap(); // a repeat is fine
    let info = a.mirror_info().unwrap();
    assert_eq!(info.state, MirrorImageState::Enabled);
    assert!(info.primary);
    assert_eq!(info.global_id.len(), 36);
    assert_eq!(a.mirror_mode().unwrap(), MirrorImageMode::Snapshot);

    let snap = a
        .mirror_create_snapshot(MirrorSnapshotFlags::default())
        .unwrap();
    let ns = a.snap_mirror_namespace(snap).unwrap();
    assert_eq!(ns.state, MirrorSnapState::Primary);
    wait_copied(&s.ib, &name, snap);
    assert!(read(&s.ib, &name, first.len()) == first, "B's copy differs");

    // B's copy: non-primary, replaying, its replay figures in the status.
    let b = Image::open(&s.ib, &name).unwrap();
    let bi = b.mirror_info().unwrap();
    assert!(!bi.primary);
    assert_eq!(bi.global_id, info.global_id);
    let st = until("B's daemon replaying", || {
        let st = b.mirror_global_status().map_err(|e| e.to_string())?;
        match st.local() {
            Some(l) if l.up && l.state == MirrorStatusState::Replaying => Ok(st),
            other => Err(format!("{other:?}")),
        }
    });
    let replay = st
        .local()
        .unwrap()
        .snapshot_replay()
        .expect("replay figures");
    assert!(replay.local_snapshot_timestamp.is_some(), "{replay:?}");
    // Writing to the copy is refused.
    let e = b.write(0, b"no").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly, "{e}");
    // Promoting it while A is primary is refused by name.
    let e = b.mirror_promote(false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    assert!(e.to_string().contains(&name), "{e}");
    drop(b);

    // A's view: primary, the peer's daemon replaying.
    let st = until("A sees the peer replaying", || {
        let st = a.mirror_global_status().map_err(|e| e.to_string())?;
        let peers: Vec<_> = st.peers().collect();
        if peers
            .iter()
            .any(|p| p.up && p.state == MirrorStatusState::Replaying)
        {
            Ok(st)
        } else {
            Err(format!("{:?}", st.sites))
        }
    });
    assert_eq!(st.local().unwrap().description, "local image is primary");

    // Planned failover: demote A, promote B without force.
    let a = a.mirror_demote_within(Duration::from_secs(30)).unwrap();
    assert!(!a.mirror_info().unwrap().primary);
    drop(a);
    promote_when_demotion_arrives(&s.ib, &name);
    let b = Image::open(&s.ib, &name).unwrap();
    let second = pattern(2, MIB as usize);
    b.write(MIB, &second).unwrap();
    let snap = b
        .mirror_create_snapshot(MirrorSnapshotFlags::default())
        .unwrap();
    wait_copied(&s.ia, &name, snap);

    // Failback: demote B, promote A; A has both writes.
    let b = b.mirror_demote_within(Duration::from_secs(30)).unwrap();
    drop(b);
    promote_when_demotion_arrives(&s.ia, &name);
    let back = read(&s.ia, &name, 2 * MIB as usize);
    assert!(back[..MIB as usize] == first[..], "first write lost");
    assert!(back[MIB as usize..] == second[..], "B's write lost");

    // Disabling on the primary makes B's daemon delete its copy, once it
    // replays from A (a copy still holding its own demotion is linked to
    // no primary, and would be left).
    let a = Image::open(&s.ia, &name).unwrap();
    until("B replaying from A again", || {
        let st = a.mirror_global_status().map_err(|e| e.to_string())?;
        if st
            .peers()
            .any(|p| p.up && p.state == MirrorStatusState::Replaying)
        {
            Ok(())
        } else {
            Err(format!("{:?}", st.sites))
        }
    });
    a.mirror_disable(false).unwrap();
    drop(a);
    until("B's copy deleted", || {
        let names = rbd::list_names(&s.ib).map_err(|e| e.to_string())?;
        if names.contains(&name) {
            Err("still there".into())
        } else {
            Ok(())
        }
    });
    rbd::remove(&s.ia, &name).unwrap();
}

#[test]
fn a_force_promoted_copy_wins_and_the_other_resyncs_from_it() {
    let s = sites();
    let name = unique("splitbrain");
    rbd::create(&s.ia, &name, 8 * MIB, &ImageOptions::new()).unwrap();
    let a = Image::open(&s.ia, &name).unwrap();
    a.write(0, &pattern(3, MIB as usize)).unwrap();
    a.mirror_enable(MirrorImageMode::Snapshot).unwrap();
    let snap = a
        .mirror_create_snapshot(MirrorSnapshotFlags::default())
        .unwrap();
    wait_copied(&s.ib, &name, snap);

    // B takes over with force while A is still primary: a split brain.
    let b = Image::open(&s.ib, &name).unwrap();
    let b = b
        .mirror_promote_within(true, Duration::from_secs(60))
        .unwrap();
    assert!(b.mirror_info().unwrap().primary);
    let winner = pattern(4, MIB as usize);
    b.write(0, &winner).unwrap();
    a.write(0, &pattern(5, MIB as usize)).unwrap(); // lost on resync

    // A gives up: demote, then resync (refused on a primary, by name).
    let e = a.mirror_resync().unwrap_err();
    assert!(e.to_string().contains(&name), "{e}");
    let a = a.mirror_demote_within(Duration::from_secs(30)).unwrap();
    let old_id = a.id().unwrap();
    until("A's daemon sees the split brain", || {
        let st = a.mirror_global_status().map_err(|e| e.to_string())?;
        let l = st.local().cloned();
        match l {
            Some(l) if l.description.contains("split-brain") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    a.mirror_resync().unwrap();
    drop(a);
    let snap = b
        .mirror_create_snapshot(MirrorSnapshotFlags::default())
        .unwrap();
    // The daemon re-creates A's copy (a new id) and copies B's data.
    until("A's copy re-created", || {
        let img = Image::open_read_only(&s.ia, &name).map_err(|e| e.to_string())?;
        let id = img.id().map_err(|e| e.to_string())?;
        if id != old_id {
            Ok(())
        } else {
            Err(format!("still {id}"))
        }
    });
    wait_copied(&s.ia, &name, snap);
    assert!(
        read(&s.ia, &name, winner.len()) == winner,
        "A did not take B's data"
    );

    b.mirror_disable(false).unwrap();
    drop(b);
    until("A's copy deleted", || {
        let names = rbd::list_names(&s.ia).map_err(|e| e.to_string())?;
        if names.contains(&name) {
            Err("still there".into())
        } else {
            Ok(())
        }
    });
    rbd::remove(&s.ib, &name).unwrap();
}

#[test]
fn a_promotion_that_outlives_its_timeout_is_left_to_finish() {
    let s = sites();
    let name = unique("slowpromote");
    rbd::create(&s.ia, &name, 4 * MIB, &ImageOptions::new()).unwrap();
    let a = Image::open(&s.ia, &name).unwrap();
    a.mirror_enable(MirrorImageMode::Snapshot).unwrap();
    let a = a.mirror_demote_within(Duration::from_secs(30)).unwrap();
    drop(a);
    // No wait at all: the call is still running when the caller gives up.
    let a = Image::open(&s.ia, &name).unwrap();
    let e = a.mirror_promote_within(false, Duration::ZERO).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(e.to_string().contains(&name), "{e}");
    // It finishes on its own; meanwhile a second call is refused at once.
    let a2 = Image::open(&s.ia, &name).unwrap();
    match a2.mirror_promote_within(false, Duration::from_secs(30)) {
        Err(e) if e.kind() == ErrorKind::Busy => {
            assert!(e.to_string().contains("still waiting"), "{e}")
        }
        // The first one was quick: this one found the image primary.
        Err(e) => assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}"),
        Ok(_) => panic!("a second promotion of a primary succeeded"),
    }
    until("the abandoned promotion done", || {
        let img = Image::open_read_only(&s.ia, &name).map_err(|e| e.to_string())?;
        if img.mirror_info().map_err(|e| e.to_string())?.primary {
            Ok(())
        } else {
            Err("not primary yet".into())
        }
    });
    let img = Image::open(&s.ia, &name).unwrap();
    img.mirror_disable(false).unwrap();
    drop(img);
    until("B's copy gone", || {
        if rbd::list_names(&s.ib)
            .map_err(|e| e.to_string())?
            .contains(&name)
        {
            Err("still there".into())
        } else {
            Ok(())
        }
    });
    rbd::remove(&s.ia, &name).unwrap();
}

#[test]
fn snapshot_schedules_go_through_the_manager() {
    let s = sites();
    let name = unique("scheduled");
    rbd::create(&s.ia, &name, 4 * MIB, &ImageOptions::new()).unwrap();
    let level = ScheduleLevel::image(POOL, "", &name);

    // Bad input is refused by name before anything is sent.
    let e = rbd::mirror_snapshot_schedule_add(&s.a, &level, "5s", None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("\"5s\""), "{e}");
    let e = rbd::mirror_snapshot_schedule_add(&s.a, &level, "5m", Some("noon")).unwrap_err();
    assert!(e.to_string().contains("\"noon\""), "{e}");
    // Not in snapshot mirror mode: the module refuses, and the error names
    // the level.
    let e = rbd::mirror_snapshot_schedule_add(&s.a, &level, "1m", None).unwrap_err();
    assert!(e.to_string().contains(&name), "{e}");

    let img = Image::open(&s.ia, &name).unwrap();
    img.mirror_enable(MirrorImageMode::Snapshot).unwrap();
    rbd::mirror_snapshot_schedule_add(&s.a, &level, "1m", None).unwrap();
    rbd::mirror_snapshot_schedule_add(&s.a, &level, "1m", None).unwrap(); // idempotent
    rbd::mirror_snapshot_schedule_add(&s.a, &level, "1h", Some("14:00")).unwrap();
    let list = rbd::mirror_snapshot_schedule_list(&s.a, &level).unwrap();
    let mine: Vec<_> = list.iter().filter(|x| x.level.ends_with(&name)).collect();
    assert_eq!(mine.len(), 2, "{list:?}");
    assert!(mine
        .iter()
        .any(|x| x.interval == "1m" && x.start_time.is_none()));
    assert!(mine
        .iter()
        .any(|x| x.interval == "1h" && x.start_time.is_some()));
    // Listing the pool shows the image's schedules too.
    let pool = rbd::mirror_snapshot_schedule_list(&s.a, &ScheduleLevel::pool(POOL)).unwrap();
    assert!(pool.iter().any(|x| x.level.ends_with(&name)), "{pool:?}");
    // The status parses (the module adds images on its own refresh, up to a
    // minute later, so the list may still be empty).
    let status = rbd::mirror_snapshot_schedule_status(&s.a, &level).unwrap();
    assert!(
        status.iter().all(|i| i.image.ends_with(&name)),
        "{status:?}"
    );

    rbd::mirror_snapshot_schedule_remove(&s.a, &level, Some("1h"), Some("14:00")).unwrap();
    let list = rbd::mirror_snapshot_schedule_list(&s.a, &level).unwrap();
    assert_eq!(
        list.iter().filter(|x| x.level.ends_with(&name)).count(),
        1,
        "{list:?}"
    );
    rbd::mirror_snapshot_schedule_remove(&s.a, &level, None, None).unwrap();
    assert!(!rbd::mirror_snapshot_schedule_list(&s.a, &level)
        .unwrap()
        .iter()
        .any(|x| x.level.ends_with(&name)));

    // A command the manager does not know names its prefix.
    let e =
        s.a.mgr_command(r#"{"prefix": "rbd no such command"}"#, &[])
            .unwrap_err();
    assert!(
        e.to_string().contains("mgr command 'rbd no such command'"),
        "{e}"
    );

    img.mirror_disable(false).unwrap();
    drop(img);
    until("B's copy gone", || {
        if rbd::list_names(&s.ib)
            .map_err(|e| e.to_string())?
            .contains(&name)
        {
            Err("still there".into())
        } else {
            Ok(())
        }
    });
    rbd::remove(&s.ia, &name).unwrap();
}
