//! I/O limits for the kernel's rbd driver: cgroup v2 `io.max`.
//!
//! krbd does not read librbd's per-image QoS settings, so a volume mapped
//! with it is limited where the kernel limits block I/O: the `io.max` file
//! of the pod's cgroup, one line per device (`MAJ:MIN rbps=.. wbps=..
//! riops=.. wiops=..`). The pod's cgroup holds all of its containers, so
//! they share the limit. It needs the unified hierarchy (cgroup v2) with
//! the `io` controller enabled for pods, which the kubelet does on a v2
//! node; on a v1 or hybrid node there is no `io.max` and
//! [`apply`] says so.
//!
//! `io.max` has no combined read+write limit: a combined IOPS or bytes
//! limit caps each direction on its own (see [`IoMax::from_limits`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One device's limits in `io.max` (`None`: no limit, written `max`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoMax {
    /// Bytes read per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rbps: Option<u64>,
    /// Bytes written per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wbps: Option<u64>,
    /// Reads per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub riops: Option<u64>,
    /// Writes per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wiops: Option<u64>,
}

fn min_of(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

impl IoMax {
    /// From librbd's six limits (`iops`, `read_iops`, `write_iops`, `bps`,
    /// `read_bps`, `write_bps`): each direction gets the lower of its own
    /// limit and the combined one.
    pub fn from_limits(
        iops: Option<u64>,
        read_iops: Option<u64>,
        write_iops: Option<u64>,
        bps: Option<u64>,
        read_bps: Option<u64>,
        write_bps: Option<u64>,
    ) -> IoMax {
        IoMax {
            rbps: min_of(read_bps, bps),
            wbps: min_of(write_bps, bps),
            riops: min_of(read_iops, iops),
            wiops: min_of(write_iops, iops),
        }
    }

    /// Whether it limits nothing.
    pub fn is_empty(&self) -> bool {
        *self == IoMax::default()
    }

    /// The `io.max` line for device `major:minor`.
    pub fn line(&self, major: u32, minor: u32) -> String {
        let v = |x: Option<u64>| x.map_or_else(|| "max".to_owned(), |n| n.to_string());
        format!(
            "{major}:{minor} rbps={} wbps={} riops={} wiops={}",
            v(self.rbps),
            v(self.wbps),
            v(self.riops),
            v(self.wiops)
        )
    }
}

/// The cgroup of pod `uid` under the cgroup v2 mount `root`: the kubelet's
/// systemd driver (`kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid
/// with _>.slice`) or its cgroupfs driver (`kubepods/<qos>/pod<uid>`), for
/// the three QoS classes, else found by name up to four levels down (a
/// kubelet `--cgroup-root`).
pub fn pod_cgroup(root: &Path, uid: &str) -> Option<PathBuf> {
    let u = uid.replace('-', "_");
    let mut known = vec![
        root.join(format!("kubepods.slice/kubepods-pod{u}.slice")),
        root.join(format!("kubepods/pod{uid}")),
    ];
    for qos in ["burstable", "besteffort"] {
        known.push(root.join(format!(
            "kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{u}.slice"
        )));
        known.push(root.join(format!("kubepods/{qos}/pod{uid}")));
    }
    if let Some(p) = known.into_iter().find(|p| p.is_dir()) {
        return Some(p);
    }
    let names = [format!("pod{uid}"), format!("pod{u}.slice")];
    find_dir(root, 4, &|n: &str| {
        names.iter().any(|want| n.ends_with(want.as_str()))
    })
}

fn find_dir(dir: &Path, depth: u32, wanted: &dyn Fn(&str) -> bool) -> Option<PathBuf> {
    if depth == 0 {
        return None;
    }
    let entries = std::fs::read_dir(dir).ok()?;
    let mut subdirs = Vec::new();
    for e in entries.flatten() {
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        if wanted(&name) {
            return Some(e.path());
        }
        subdirs.push(e.path());
    }
    subdirs.sort();
    subdirs
        .into_iter()
        .find_map(|d| find_dir(&d, depth - 1, wanted))
}

/// The device numbers of block device `dev`.
pub fn device_numbers(dev: &Path) -> Result<(u32, u32)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let obj = dev.display().to_string();
    let md = std::fs::metadata(dev).map_err(|e| {
        Error::from_errno(e.raw_os_error().unwrap_or(libc::EIO), "stat", obj.clone())
    })?;
    if !md.file_type().is_block_device() {
        return Err(Error::from_errno(libc::ENOTBLK, "stat", obj).detail("not a block device"));
    }
    let rdev = md.rdev();
    Ok((libc::major(rdev), libc::minor(rdev)))
}

/// The pod a publish target path belongs to, as the kubelet makes them: a
/// mount volume's `.../pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`, a
/// Block volume's `.../csi/volumeDevices/publish/<pv>/<uid>`.
pub fn pod_uid(target: &Path) -> Option<String> {
    let parts: Vec<&str> = target.iter().filter_map(|c| c.to_str()).collect();
    let mount = parts
        .windows(3)
        .find(|w| w[0] == "pods" && w[2] == "volumes")
        .map(|w| w[1]);
    let block = parts
        .windows(4)
        .find(|w| w[0] == "volumeDevices" && w[1] == "publish")
        .map(|w| w[3]);
    mount
        .or(block)
        .filter(|uid| !uid.is_empty() && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-'))
        .map(str::to_owned)
}

/// Writes `max` for `device` into the `io.max` of pod `uid`'s cgroup under
/// `root` (the cgroup v2 mount, `/sys/fs/cgroup`). Returns the file written.
/// Fails, naming the reason, where cgroup v2's `io` controller is not
/// there for pods.
pub fn apply(root: &Path, uid: &str, device: &Path, max: &IoMax) -> Result<PathBuf> {
    let controllers = std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
    if !controllers.split_whitespace().any(|c| c == "io") {
        return Err(Error::from_errno(libc::EOPNOTSUPP, "io.max", root.display().to_string())
            .detail("no cgroup v2 io controller here (a cgroup v1 or hybrid node): krbd volumes are not limited"));
    }
    let cgroup = pod_cgroup(root, uid).ok_or_else(|| {
        Error::from_errno(libc::ENOENT, "io.max", root.display().to_string())
            .detail(format!("no cgroup of pod {uid} found"))
    })?;
    let (major, minor) = device_numbers(device)?;
    let file = cgroup.join("io.max");
    std::fs::write(&file, max.line(major, minor)).map_err(|e| {
        Error::from_errno(
            e.raw_os_error().unwrap_or(libc::EIO),
            "write",
            file.display().to_string(),
        )
        .detail("cannot set io.max (is the io controller enabled in the parent's cgroup.subtree_control?)")
    })?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_per_device_with_max_for_no_limit() {
        let m = IoMax::from_limits(Some(500), Some(100), None, None, None, Some(1 << 20));
        assert_eq!(m.riops, Some(100));
        assert_eq!(m.wiops, Some(500));
        assert_eq!(
            m.line(252, 16),
            "252:16 rbps=max wbps=1048576 riops=100 wiops=500"
        );
        assert!(IoMax::default().is_empty());
        assert_eq!(
            IoMax::default().line(1, 2),
            "1:2 rbps=max wbps=max riops=max wiops=max"
        );
    }

    #[test]
    fn pod_cgroups_of_both_kubelet_drivers_are_found() {
        let uid = "0b5e6c3a-1111-2222-3333-444455556666";
        let u = uid.replace('-', "_");
        for layout in [
            format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"),
            format!("kubepods.slice/kubepods-pod{u}.slice"),
            format!("kubepods/besteffort/pod{uid}"),
            format!("custom.slice/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice"),
        ] {
            let root = tempfile::tempdir().unwrap();
            std::fs::create_dir_all(root.path().join(&layout)).unwrap();
            std::fs::create_dir_all(root.path().join("kubepods.slice/other")).unwrap();
            assert_eq!(
                pod_cgroup(root.path(), uid),
                Some(root.path().join(&layout)),
                "{layout}"
            );
            assert_eq!(pod_cgroup(root.path(), "another-uid"), None);
        }
    }

    #[test]
    fn the_pod_of_a_target_path() {
        let uid = "0b5e6c3a-1111-2222-3333-444455556666";
        for t in [
            format!("/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~csi/pvc-1/mount"),
            format!("/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1/{uid}"),
        ] {
            assert_eq!(pod_uid(Path::new(&t)).as_deref(), Some(uid), "{t}");
        }
        assert_eq!(pod_uid(Path::new("/mnt/somewhere/vol")), None);
        assert_eq!(pod_uid(Path::new("/x/pods/../volumes/y")), None);
    }

    #[test]
    fn without_the_io_controller_nothing_is_written() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        let e = apply(root.path(), "u", Path::new("/dev/null"), &IoMax::default()).unwrap_err();
        assert!(e.to_string().contains("no cgroup v2 io controller"), "{e}");
    }
}
