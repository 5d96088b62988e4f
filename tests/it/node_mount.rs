//! The node side's filesystems and mounts against real loop devices and real
//! mounts (as root; no Ceph cluster needed). Each test owns its sparse file,
//! loop device and mount points, and a guard takes them all down on any
//! exit, failure included.

use std::io::ErrorKind as IoKind;
use std::path::{Path, PathBuf};
use std::process::Command;

use rbdkit::node::fs::{self, Probe};
use rbdkit::node::mount;

const MIB: u64 = 1 << 20;

/// Loop devices and mount points a test made; taken down on drop.
struct Fixture {
    dir: tempfile::TempDir,
    loops: Vec<PathBuf>,
    mounts: Vec<PathBuf>,
}

impl Fixture {
    fn new() -> Fixture {
        // SAFETY: geteuid(2) has no preconditions and cannot fail.
        assert_eq!(unsafe { libc::geteuid() }, 0, "these tests need root");
        Fixture {
            dir: tempfile::tempdir().unwrap(),
            loops: Vec::new(),
            mounts: Vec::new(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A sparse file of `size` bytes on a fresh loop device.
    fn loop_device(&mut self, name: &str, size: u64) -> (PathBuf, PathBuf) {
        let file = self.path(name);
        std::fs::File::create(&file).unwrap().set_len(size).unwrap();
        let out = losetup(&["-f", "--show", file.to_str().unwrap()]);
        let dev = PathBuf::from(out.trim());
        self.loops.push(dev.clone());
        (file, dev)
    }

    /// Registers a mount point for cleanup and returns it.
    fn mount_point(&mut self, name: &str) -> PathBuf {
        let p = self.path(name);
        self.mounts.push(p.clone());
        p
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for m in self.mounts.iter().rev() {
            if mount::ensure_unmounted(m).is_err() {
                for _ in 0..8 {
                    if mount::umount(m, true).is_err() {
                        break;
                    }
                }
            }
        }
        for l in &self.loops {
            let _ = Command::new("timeout")
                .args(["30", "losetup", "-d"])
                .arg(l)
                .status();
        }
    }
}

/// Runs `losetup` (bounded by `timeout`) and returns its stdout.
fn losetup(args: &[&str]) -> String {
    let out = Command::new("timeout")
        .arg("30")
        .arg("losetup")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "losetup {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Whether this process holds CAP_SYS_RESOURCE (bit 24 of CapEff), which
/// ext4's online resize needs.
fn has_cap_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim();
    u64::from_str_radix(hex, 16).unwrap() & (1 << 24) != 0
}

fn write_synced(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(data)?;
    f.sync_all()
}

/// Grows the backing file and tells the loop device (`losetup -c`).
fn grow_loop(file: &Path, dev: &Path, size: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(size)
        .unwrap();
    losetup(&["-c", dev.to_str().unwrap()]);
    assert_eq!(fs::device_size(dev).unwrap(), size);
}

/// The bind mounts, the stacked-mount and the busy-target cases on a
/// mounted staging directory; shared by the ext4 and xfs tests.
fn check_binds(fx: &mut Fixture, dev: &Path, stage: &Path, fstype: &str) {
    let rw = fx.mount_point("publish-rw");
    let ro = fx.mount_point("publish-ro");
    mount::ensure_bind(stage, &rw, false).unwrap();
    mount::ensure_bind(stage, &rw, false).unwrap();
    mount::ensure_bind(stage, &ro, true).unwrap();
    mount::ensure_bind(stage, &ro, true).unwrap();
    assert_eq!(
        mount::mounts_at(&rw).unwrap().len(),
        1,
        "a repeat must not stack"
    );
    assert_eq!(
        mount::mounts_at(&ro).unwrap().len(),
        1,
        "a repeat must not stack"
    );

    write_synced(&rw.join("through-rw"), b"rw bind").unwrap();
    assert_eq!(std::fs::read(stage.join("through-rw")).unwrap(), b"rw bind");
    assert_eq!(std::fs::read(ro.join("through-rw")).unwrap(), b"rw bind");
    let e = write_synced(&ro.join("through-ro"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    let m = mount::mounted_at(&ro).unwrap().unwrap();
    assert!(m.read_only());
    assert_eq!(m.fstype, fstype);
    assert!(!mount::mounted_at(&rw).unwrap().unwrap().read_only());

    // Three mounts of the device now: the staging one and two binds.
    let points: Vec<PathBuf> = mount::mounts_of_device(dev)
        .unwrap()
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    for p in [stage, &rw, &ro] {
        assert!(
            points.contains(&std::fs::canonicalize(p).unwrap()),
            "{p:?} in {points:?}"
        );
    }

    // A crash between the two steps of a read-only bind leaves it writable;
    // the repeat finishes the job.
    mount::mount(None, &ro, None, libc::MS_REMOUNT | libc::MS_BIND, None).unwrap();
    assert!(!mount::mounted_at(&ro).unwrap().unwrap().read_only());
    mount::ensure_bind(stage, &ro, true).unwrap();
    assert!(mount::mounted_at(&ro).unwrap().unwrap().read_only());

    // Something else at the target is an error, not a second mount.
    let other = fx.path("other");
    std::fs::create_dir_all(&other).unwrap();
    let e = mount::ensure_bind(&other, &rw, false).unwrap_err();
    assert_eq!(e.errno(), libc::EBUSY, "{e}");
    // A bind of the filesystem's root looks like a mount of the device (it
    // is the same thing), but a bind of a subdirectory is not one.
    mount::ensure_mounted(dev, &ro, fstype, &fs::mount_options(fstype, &["ro"])).unwrap();
    let sub = fx.mount_point("publish-sub");
    std::fs::create_dir_all(stage.join("sub")).unwrap();
    mount::ensure_bind(&stage.join("sub"), &sub, false).unwrap();
    let e =
        mount::ensure_mounted(dev, &sub, fstype, &fs::mount_options(fstype, &["rw"])).unwrap_err();
    assert_eq!(e.errno(), libc::EBUSY, "{e}");
    assert!(e.to_string().contains("root /sub"), "{e}");

    for p in [&sub, &ro, &rw] {
        mount::ensure_unmounted(p).unwrap();
        mount::ensure_unmounted(p).unwrap();
        assert!(!mount::is_mount_point(p).unwrap());
    }
}

#[test]
fn ext4_make_mount_bind_grow_unmount() {
    let mut fx = Fixture::new();
    let (file, dev) = fx.loop_device("ext4.img", 256 * MIB);
    let stage = fx.mount_point("stage");

    assert_eq!(fs::probe(&dev).unwrap(), Probe::Blank);
    assert!(fs::make_fs(&dev, "ext4", &[] as &[&str]).unwrap());
    assert_eq!(fs::probe(&dev).unwrap(), Probe::Filesystem("ext4".into()));
    // The ceph-csi defaults were used: no reserved blocks.
    let dumpe2fs = Command::new("timeout")
        .args(["30", "dumpe2fs", "-h"])
        .arg(&dev)
        .output()
        .unwrap();
    let header = String::from_utf8_lossy(&dumpe2fs.stdout);
    assert!(
        header
            .lines()
            .any(|l| l.starts_with("Reserved block count:") && l.ends_with(" 0")),
        "{header}"
    );

    // The wrong type is refused and nothing is touched.
    let e = fs::make_fs(&dev, "xfs", &[] as &[&str]).unwrap_err();
    assert!(
        e.to_string().contains("already holds a ext4 filesystem"),
        "{e}"
    );
    assert_eq!(fs::probe(&dev).unwrap(), Probe::Filesystem("ext4".into()));

    let opts = fs::mount_options("ext4", &["noatime", "nodev"]);
    mount::ensure_mounted(&dev, &stage, "ext4", &opts).unwrap();
    mount::ensure_mounted(&dev, &stage, "ext4", &opts).unwrap();
    assert_eq!(
        mount::mounts_at(&stage).unwrap().len(),
        1,
        "a repeat must not stack"
    );
    let m = mount::mounted_at(&stage).unwrap().unwrap();
    assert_eq!(m.fstype, "ext4");
    assert_eq!(m.dev(), {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&dev).unwrap().rdev()
    });
    assert!(m.mount_options.iter().any(|o| o == "noatime"), "{m:?}");
    assert!(m.mount_options.iter().any(|o| o == "nodev"), "{m:?}");
    assert!(!m.read_only());
    // Asking for read-only where it is read-write is an error, not a no-op.
    let e = mount::ensure_mounted(&dev, &stage, "ext4", &["ro"]).unwrap_err();
    assert!(e.to_string().contains("read-write"), "{e}");

    // A second make_fs on the formatted (and mounted) device keeps the data.
    write_synced(&stage.join("data"), b"keep me").unwrap();
    assert!(!fs::make_fs(&dev, "ext4", &[] as &[&str]).unwrap());
    assert_eq!(std::fs::read(stage.join("data")).unwrap(), b"keep me");

    check_binds(&mut fx, &dev, &stage, "ext4");

    // A raw block volume: the device node bound onto a file.
    let block = fx.mount_point("publish-block");
    mount::ensure_bind(&dev, &block, false).unwrap();
    mount::ensure_bind(&dev, &block, false).unwrap();
    assert_eq!(mount::mounts_at(&block).unwrap().len(), 1);
    {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let md = std::fs::metadata(&block).unwrap();
        assert!(md.file_type().is_block_device());
        assert_eq!(md.rdev(), std::fs::metadata(&dev).unwrap().rdev());
    }
    assert_eq!(fs::device_size(&block).unwrap(), 256 * MIB);
    mount::ensure_unmounted(&block).unwrap();
    assert!(std::fs::metadata(&block).unwrap().is_file());

    let before = fs::stats(&stage).unwrap();
    assert!(
        before.total_bytes > 200 * MIB && before.total_bytes <= 256 * MIB,
        "{before:?}"
    );
    assert!(before.used_bytes > 0 && before.available_bytes < before.total_bytes);
    assert!(before.total_inodes > 0 && before.used_inodes > 0);
    assert_eq!(before.total_inodes, before.free_inodes + before.used_inodes);

    grow_loop(&file, &dev, 512 * MIB);
    if has_cap_sys_resource() {
        fs::grow(&dev, &stage, "ext4").unwrap();
    } else {
        // This machine kind: ext4's online resize is refused, clearly.
        let e = fs::grow(&dev, &stage, "ext4").unwrap_err();
        assert_eq!(e.kind(), rbdkit::ErrorKind::PermissionDenied, "{e}");
        assert!(e.to_string().contains("CAP_SYS_RESOURCE"), "{e}");
        // Offline then: e2fsck and resize2fs on the unmounted device.
        mount::ensure_unmounted(&stage).unwrap();
        fs::grow(&dev, &stage, "ext4").unwrap();
        mount::ensure_mounted(&dev, &stage, "ext4", &opts).unwrap();
    }
    fs::grow(&dev, &stage, "ext4").unwrap_or_else(|e| {
        // A repeat is a no-op: resize2fs has nothing to ask the kernel.
        panic!("second grow: {e}")
    });
    let after = fs::stats(&stage).unwrap();
    assert!(
        after.total_bytes > 450 * MIB && after.total_bytes <= 512 * MIB,
        "{after:?}"
    );
    assert!(after.total_inodes > before.total_inodes);
    assert_eq!(std::fs::read(stage.join("data")).unwrap(), b"keep me");

    mount::ensure_unmounted(&stage).unwrap();
    mount::ensure_unmounted(&stage).unwrap();
    assert!(!mount::is_mount_point(&stage).unwrap());
    assert!(mount::mounts_of_device(&dev).unwrap().is_empty());
}

#[test]
fn xfs_make_mount_bind_grow_unmount() {
    let mut fx = Fixture::new();
    // mkfs.xfs refuses filesystems under 300 MB.
    let (file, dev) = fx.loop_device("xfs.img", 512 * MIB);
    let stage = fx.mount_point("stage");

    assert_eq!(fs::probe(&dev).unwrap(), Probe::Blank);
    assert!(fs::make_fs(&dev, "xfs", &fs::parse_mkfs_options("-K -L rbdkit")).unwrap());
    assert_eq!(fs::probe(&dev).unwrap(), Probe::Filesystem("xfs".into()));
    let label = Command::new("timeout")
        .args(["30", "blkid", "-p", "-o", "value", "-s", "LABEL"])
        .arg(&dev)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&label.stdout).trim(),
        "rbdkit",
        "mkfsOptions used"
    );

    let e = fs::make_fs(&dev, "ext4", &[] as &[&str]).unwrap_err();
    assert!(
        e.to_string().contains("already holds a xfs filesystem"),
        "{e}"
    );

    let opts = fs::mount_options("xfs", &["noatime"]);
    mount::ensure_mounted(&dev, &stage, "xfs", &opts).unwrap();
    mount::ensure_mounted(&dev, &stage, "xfs", &opts).unwrap();
    let m = mount::mounted_at(&stage).unwrap().unwrap();
    assert_eq!(m.fstype, "xfs");
    assert!(
        m.super_options
            .iter()
            .chain(&m.mount_options)
            .any(|o| o == "nouuid"),
        "{m:?}"
    );
    write_synced(&stage.join("data"), b"keep me").unwrap();

    // Unmounted, formatted again: a no-op that keeps the data.
    mount::ensure_unmounted(&stage).unwrap();
    assert!(!fs::make_fs(&dev, "xfs", &[] as &[&str]).unwrap());
    fs::format_and_mount(&dev, &stage, "xfs", &[] as &[&str], &["noatime"]).unwrap();
    fs::format_and_mount(&dev, &stage, "xfs", &[] as &[&str], &["noatime"]).unwrap();
    assert_eq!(std::fs::read(stage.join("data")).unwrap(), b"keep me");

    check_binds(&mut fx, &dev, &stage, "xfs");

    let before = fs::stats(&stage).unwrap();
    assert!(
        before.total_bytes > 400 * MIB && before.total_bytes <= 512 * MIB,
        "{before:?}"
    );
    grow_loop(&file, &dev, 768 * MIB);
    fs::grow(&dev, &stage, "xfs").unwrap();
    fs::grow(&dev, &stage, "xfs").unwrap();
    let after = fs::stats(&stage).unwrap();
    assert!(
        after.total_bytes > 700 * MIB && after.total_bytes <= 768 * MIB,
        "{after:?}"
    );
    assert_eq!(std::fs::read(stage.join("data")).unwrap(), b"keep me");

    mount::ensure_unmounted(&stage).unwrap();
    mount::ensure_unmounted(&stage).unwrap();
    assert!(mount::mounts_of_device(&dev).unwrap().is_empty());
}

#[test]
fn stacked_mounts_all_come_off() {
    let mut fx = Fixture::new();
    let target = fx.mount_point("stacked");
    std::fs::create_dir_all(&target).unwrap();
    for i in 0..3 {
        mount::mount(
            Some(Path::new("tmpfs")),
            &target,
            Some("tmpfs"),
            0,
            Some("size=1m"),
        )
        .unwrap();
        std::fs::write(target.join("layer"), format!("{i}")).unwrap();
    }
    assert_eq!(mount::mounts_at(&target).unwrap().len(), 3);
    assert_eq!(std::fs::read_to_string(target.join("layer")).unwrap(), "2");
    // A mount in use stays and says why; it is not detached.
    let open = std::fs::File::open(target.join("layer")).unwrap();
    let e = mount::ensure_unmounted(&target).unwrap_err();
    assert_eq!(e.errno(), libc::EBUSY, "{e}");
    assert!(e.to_string().contains("still busy"), "{e}");
    assert_eq!(mount::mounts_at(&target).unwrap().len(), 3);
    drop(open);
    mount::ensure_unmounted(&target).unwrap();
    assert!(!mount::is_mount_point(&target).unwrap());
    assert_eq!(
        std::fs::metadata(target.join("layer")).unwrap_err().kind(),
        IoKind::NotFound
    );
}

#[test]
fn a_stale_fuse_mount_is_found_and_unmounted() {
    use std::os::unix::io::AsRawFd;
    let mut fx = Fixture::new();
    let target = fx.mount_point("stale");
    std::fs::create_dir_all(&target).unwrap();
    // A FUSE mount whose server is gone: mount with a /dev/fuse fd, then
    // close the fd without ever answering; the kernel aborts the connection.
    let fuse = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .unwrap();
    let data = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0",
        fuse.as_raw_fd()
    );
    mount::mount(
        Some(Path::new("rbdkit-test")),
        &target,
        Some("fuse"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&data),
    )
    .unwrap();
    drop(fuse);

    let e = std::fs::metadata(&target).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTCONN), "{e}");
    assert!(mount::is_stale(&target));
    assert!(mount::is_mount_point(&target).unwrap());
    let m = mount::mounted_at(&target).unwrap().unwrap();
    assert_eq!(m.fstype, "fuse");
    assert_eq!(m.source, "rbdkit-test");

    // Binding or mounting onto it is refused with the reason.
    let e = mount::ensure_bind(fx.dir.path(), &target, false).unwrap_err();
    assert!(e.to_string().contains("stale"), "{e}");
    let (_, dev) = fx.loop_device("unused.img", 16 * MIB);
    let e = mount::ensure_mounted(&dev, &target, "ext4", &["rw"]).unwrap_err();
    assert_eq!(e.errno(), libc::ENOTCONN, "{e}");
    assert!(e.to_string().contains("stale"), "{e}");

    mount::ensure_unmounted(&target).unwrap();
    mount::ensure_unmounted(&target).unwrap();
    assert!(!mount::is_mount_point(&target).unwrap());
    assert!(std::fs::metadata(&target).unwrap().is_dir());
}

/// A copy of a mount in a mount namespace of its own, as a container that
/// starts while a volume is staged makes: `scripts/unshare-private --keep`
/// (the copies of every other loop-device and FUSE mount dropped, so other
/// tests' devices are not held) running `sleep`. Killed on drop.
struct NamespaceCopy(std::process::Child);

impl NamespaceCopy {
    fn start(keep: &Path) -> NamespaceCopy {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/unshare-private");
        let child = Command::new(script)
            .arg("--keep")
            .arg(keep)
            .args(["sleep", "300"])
            .spawn()
            .unwrap();
        // bash, unshare and sh exec in place: the pid is sleep's once comm
        // says so.
        let comm = format!("/proc/{}/comm", child.id());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::fs::read_to_string(&comm).unwrap_or_default().trim() != "sleep" {
            assert!(
                std::time::Instant::now() < deadline,
                "unshare did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        NamespaceCopy(child)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for NamespaceCopy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The block count in an ext4 superblock (`dumpe2fs -h`, which needs no
/// exclusive open).
fn ext4_block_count(dev: &Path) -> u64 {
    let out = Command::new("timeout")
        .args(["30", "dumpe2fs", "-h"])
        .arg(dev)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("Block count:"))
        .unwrap_or_else(|| panic!("no block count in {text}"))
        .trim()
        .parse()
        .unwrap()
}

/// After the unmount here, a mount namespace made while the volume was
/// mounted still holds its filesystem, and so the device. An offline grow
/// (e2fsck, resize2fs: both need the device to themselves) waits for that
/// copy to go; when it stays, the grow fails naming who holds it and
/// changes nothing.
#[test]
fn an_offline_grow_waits_for_a_namespace_that_still_mounts_the_device() {
    let mut fx = Fixture::new();
    let (file, dev) = fx.loop_device("held.img", 256 * MIB);
    let stage = fx.mount_point("stage");
    std::fs::create_dir(&stage).unwrap();
    assert!(fs::make_fs(&dev, "ext4", &[] as &[&str]).unwrap());
    mount::ensure_mounted(&dev, &stage, "ext4", &[] as &[&str]).unwrap();
    let blocks = ext4_block_count(&dev);

    // A copy that stays: the grow gives up after its wait, and says why.
    let holder = NamespaceCopy::start(&stage);
    mount::ensure_unmounted(&stage).unwrap();
    assert!(mount::mounts_of_device(&dev).unwrap().is_empty());
    grow_loop(&file, &dev, 512 * MIB);
    let t = std::time::Instant::now();
    let e = fs::grow(&dev, &stage, "ext4").unwrap_err();
    assert!(t.elapsed() >= fs::HELD_WAIT, "{:?}", t.elapsed());
    assert_eq!(e.kind(), rbdkit::ErrorKind::Busy, "{e}");
    let who = format!("{} (sleep)", holder.pid());
    assert!(e.to_string().contains(&who), "{e}");
    assert!(e.to_string().contains(&dev.display().to_string()), "{e}");
    assert_eq!(ext4_block_count(&dev), blocks, "nothing may change");
    drop(holder);

    // A copy that goes during the wait: the grow goes on once it has.
    mount::ensure_mounted(&dev, &stage, "ext4", &[] as &[&str]).unwrap();
    let holder = NamespaceCopy::start(&stage);
    mount::ensure_unmounted(&stage).unwrap();
    assert!(rbdkit::node::loopdev::in_use(&dev), "the copy must hold it");
    let stop = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(1));
        drop(holder);
    });
    let t = std::time::Instant::now();
    fs::grow(&dev, &stage, "ext4").unwrap();
    assert!(t.elapsed() >= std::time::Duration::from_secs(1));
    stop.join().unwrap();
    assert_eq!(ext4_block_count(&dev), 2 * blocks);
}
