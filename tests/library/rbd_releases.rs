//! Calls whose C functions depend on the Ceph release: snapshot namespaces,
//! clone by snapshot id, vectored compare-and-write, encryption. Each test
//! runs on every release: where the headers rbdkit was built against have
//! the call it must work, elsewhere it must fail with `NotSupported` naming
//! the release that added it.

use crate::support;

use futures::executor::block_on;
use rbdkit::rbd::{
    self, EncryptionAlgorithm, EncryptionFormat, EncryptionSpec, Features, Image, ImageOptions,
    SnapNamespaceType, BUILT_LIBRBD_MINOR,
};
use rbdkit::{Error, ErrorKind};
use support::ceph::TestNs;

const MIB: u64 = 1 << 20;

fn layered() -> ImageOptions {
    ImageOptions::new().features(Features::LAYERING | Features::EXCLUSIVE_LOCK)
}

fn clone_v2() -> ImageOptions {
    ImageOptions::new()
        .features(Features::LAYERING | Features::EXCLUSIVE_LOCK)
        .clone_format(2)
        .unwrap()
}

/// True when rbdkit was built against librbd 1.`minor` or newer.
fn built_at_least(minor: u32) -> bool {
    BUILT_LIBRBD_MINOR >= minor
}

/// Asserts that `e` is the "built against too old a librbd" error.
fn assert_needs(e: &Error, minor: u32, release: &str) {
    assert_eq!(e.kind(), ErrorKind::NotSupported, "{e}");
    let want = format!("needs librbd 1.{minor} ({release}) or newer");
    assert!(e.to_string().contains(&want), "{e} lacks '{want}'");
}

#[test]
fn built_version_matches_loaded_librbd() {
    let (major, minor, _) = rbd::version();
    assert_eq!(major, 1);
    assert_eq!(
        minor as u32, BUILT_LIBRBD_MINOR,
        "headers and library differ"
    );
}

#[test]
fn removed_snapshot_with_clone_moves_to_trash_namespace() {
    let ns = TestNs::new("trashsnap");
    rbd::create(&ns.ioctx, "parent", 8 * MIB, &layered()).unwrap();
    let parent = Image::open(&ns.ioctx, "parent").unwrap();
    parent.snap_create("s1").unwrap();
    let id = parent.snap_id("s1").unwrap();
    assert_eq!(
        parent.snap_namespace_type(id).unwrap(),
        SnapNamespaceType::User
    );
    let not_trash = parent.snap_trash_original_name(id).unwrap_err();
    assert_eq!(not_trash.kind(), ErrorKind::InvalidArgument, "{not_trash}");

    rbd::clone(&ns.ioctx, "parent", "s1", &ns.ioctx, "child", &clone_v2()).unwrap();
    // A clone v2 parent snapshot is not removed but moved to the trash.
    parent.snap_remove("s1").unwrap();
    // rbd_snap_list may still show it, under a generated name.
    let left = parent.snap_list().unwrap();
    assert!(left.iter().all(|s| s.name != "s1"), "{left:?}");
    assert_eq!(
        parent.snap_namespace_type(id).unwrap(),
        SnapNamespaceType::Trash
    );
    assert_eq!(parent.snap_trash_original_name(id).unwrap(), "s1");
    match parent.snap_trash_namespace(id) {
        Ok(t) => {
            assert!(
                built_at_least(19),
                "worked on librbd 1.{BUILT_LIBRBD_MINOR}"
            );
            assert_eq!(t.original_name, "s1");
            assert_eq!(t.original_namespace_type, SnapNamespaceType::User);
        }
        Err(e) => {
            assert!(!built_at_least(19), "{e}");
            assert_needs(&e, 19, "Ceph 19 Squid");
        }
    }
    let missing = parent.snap_namespace_type(id + 1_000_000).unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::NotFound, "{missing}");

    drop(parent);
    rbd::remove(&ns.ioctx, "child").unwrap();
    rbd::remove(&ns.ioctx, "parent").unwrap();
}

#[test]
fn group_snapshot_namespace_and_clone_by_snap_id() {
    let ns = TestNs::new("groupsnap");
    rbd::create(&ns.ioctx, "img", 8 * MIB, &layered()).unwrap();
    let img = Image::open(&ns.ioctx, "img").unwrap();
    img.write(0, b"in the group snapshot").unwrap();
    rbd::group_create(&ns.ioctx, "g").unwrap();
    rbd::group_image_add(&ns.ioctx, "g", &ns.ioctx, "img").unwrap();

    // Snapshot ids grow within a pool, so the image's group snapshot lies
    // between the two user snapshots taken around it.
    img.snap_create("before").unwrap();
    rbd::group_snap_create(&ns.ioctx, "g", "gs").unwrap();
    img.snap_create("after").unwrap();
    let (lo, hi) = (
        img.snap_id("before").unwrap(),
        img.snap_id("after").unwrap(),
    );
    let ids: Vec<u64> = (lo + 1..hi)
        .filter(|&id| img.snap_namespace_type(id).ok() == Some(SnapNamespaceType::Group))
        .collect();
    assert_eq!(
        ids.len(),
        1,
        "group snapshots between ids {lo} and {hi}: {ids:?}"
    );
    let gid = ids[0];
    let g = img.snap_group_namespace(gid).unwrap();
    assert_eq!(g.group_name, "g");
    assert_eq!(g.group_snap_name, "gs");
    assert_eq!(g.group_pool, ns.ioctx.pool_id());
    let not_group = img.snap_group_namespace(lo).unwrap_err();
    assert_eq!(not_group.kind(), ErrorKind::InvalidArgument, "{not_group}");

    img.write(0, b"written after the snapshots").unwrap();
    match rbd::clone_by_snap_id(&ns.ioctx, "img", gid, &ns.ioctx, "child", &clone_v2()) {
        Ok(()) => {
            assert!(
                built_at_least(19),
                "worked on librbd 1.{BUILT_LIBRBD_MINOR}"
            );
            let child = Image::open(&ns.ioctx, "child").unwrap();
            let p = child.parent().unwrap().expect("the clone has a parent");
            assert_eq!(p.snap_id, gid);
            assert_eq!(p.image.image_name, "img");
            let mut buf = [0u8; 21];
            child.read_exact(0, &mut buf).unwrap();
            assert_eq!(&buf, b"in the group snapshot");
            drop(child);
            rbd::remove(&ns.ioctx, "child").unwrap();
        }
        Err(e) => {
            assert!(!built_at_least(19), "{e}");
            assert_needs(&e, 19, "Ceph 19 Squid");
            assert!(e.to_string().contains("img@{id "), "{e}");
        }
    }
    // And by the id of a user snapshot, on every release that has the call.
    let by_user = rbd::clone_by_snap_id(&ns.ioctx, "img", lo, &ns.ioctx, "c2", &clone_v2());
    assert_eq!(by_user.is_ok(), built_at_least(19), "{by_user:?}");
    if by_user.is_ok() {
        rbd::remove(&ns.ioctx, "c2").unwrap();
    }

    rbd::group_snap_remove(&ns.ioctx, "g", "gs").unwrap();
    rbd::group_image_remove(&ns.ioctx, "g", &ns.ioctx, "img").unwrap();
    rbd::group_remove(&ns.ioctx, "g").unwrap();
    img.snap_remove("before").unwrap();
    img.snap_remove("after").unwrap();
    drop(img);
    rbd::remove(&ns.ioctx, "img").unwrap();
}

#[test]
fn aio_compare_and_writev_writes_only_on_match() {
    // The process-wide AIO count is read by tests/library/rbd_aio.rs.
    let _aio = support::aio::shared();
    let ns = TestNs::new("cawv");
    rbd::create(&ns.ioctx, "img", 4 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "img").unwrap();
    img.write(0, b"aaaabbbb").unwrap();
    let res = block_on(img.aio_compare_and_writev(
        0,
        vec![b"aaaa".to_vec(), b"bbbb".to_vec()],
        vec![b"cccc".to_vec(), b"dddd".to_vec()],
    ));
    if !built_at_least(18) {
        assert_needs(&res.unwrap_err(), 18, "Ceph 18 Reef");
        return;
    }
    assert_eq!(res.unwrap(), None);
    let mut buf = [0u8; 8];
    img.read_exact(0, &mut buf).unwrap();
    assert_eq!(&buf, b"ccccdddd");

    // A mismatch in the second buffer (byte 5) writes nothing.
    let res = block_on(img.aio_compare_and_writev(
        0,
        vec![b"cccc".to_vec(), b"dXdd".to_vec()],
        vec![b"eeee".to_vec(), b"ffff".to_vec()],
    ));
    assert_eq!(res.unwrap(), Some(5));
    img.read_exact(0, &mut buf).unwrap();
    assert_eq!(&buf, b"ccccdddd");

    let uneven = block_on(img.aio_compare_and_writev(
        0,
        vec![b"cccc".to_vec()],
        vec![b"eeee".to_vec(), b"ffff".to_vec()],
    ));
    assert_eq!(uneven.unwrap_err().kind(), ErrorKind::InvalidArgument);
}

#[test]
fn luks2_encrypted_image_reads_back_only_with_its_passphrase() {
    const PASS: &[u8] = b"correct horse battery staple";
    let ns = TestNs::new("luks");
    rbd::create(&ns.ioctx, "img", 64 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "img").unwrap();
    let luks = img.encryption_format(EncryptionFormat::Luks, EncryptionAlgorithm::Aes256, PASS);
    assert_eq!(luks.unwrap_err().kind(), ErrorKind::InvalidArgument);
    img.encryption_format(EncryptionFormat::Luks2, EncryptionAlgorithm::Aes256, PASS)
        .unwrap();
    let secret = b"plaintext only the key holder sees";
    img.write(0, secret).unwrap();
    img.flush().unwrap();
    drop(img);

    // Without the key the image holds the LUKS header, not the data.
    let raw = Image::open(&ns.ioctx, "img").unwrap();
    let mut head = vec![0u8; 4096];
    raw.read_exact(0, &mut head).unwrap();
    assert_eq!(&head[..4], b"LUKS");
    assert!(!head.windows(secret.len()).any(|w| w == secret));
    let wrong = raw
        .encryption_load(EncryptionFormat::Luks2, b"wrong passphrase")
        .unwrap_err();
    assert!(!wrong.to_string().contains("wrong passphrase"), "{wrong}");
    assert_eq!(wrong.op(), "rbd_encryption_load");
    drop(raw);

    let read_with = |load: &dyn Fn(&Image) -> rbdkit::Result<()>| -> rbdkit::Result<Vec<u8>> {
        let img = Image::open(&ns.ioctx, "img").unwrap();
        load(&img)?;
        let mut buf = vec![0u8; secret.len()];
        img.read_exact(0, &mut buf).unwrap();
        Ok(buf)
    };
    let buf = read_with(&|i| i.encryption_load(EncryptionFormat::Luks2, PASS)).unwrap();
    assert_eq!(buf, secret);

    // Loading as "either LUKS version" and through load2 came with Reef.
    let either = read_with(&|i| i.encryption_load(EncryptionFormat::Luks, PASS));
    let chain = read_with(&|i| {
        i.encryption_load_chain(&[EncryptionSpec {
            format: EncryptionFormat::Luks,
            passphrase: PASS,
        }])
    });
    if built_at_least(18) {
        assert_eq!(either.unwrap(), secret);
        assert_eq!(chain.unwrap(), secret);
    } else {
        assert_needs(&either.unwrap_err(), 18, "Ceph 18 Reef");
        assert_needs(&chain.unwrap_err(), 18, "Ceph 18 Reef");
    }
}
