//! The StorageClass parameters that pick and tune a mapper: `mounter`,
//! `mapOptions` and `unmapOptions`, in ceph-csi's format.
//!
//! `mapOptions` is a `;`-separated list of `<mounter>:<options>` items, each
//! `<options>` a `,`-separated list: `krbd:lock_on_read,queue_depth=1024;
//! nbd:try-netlink`. An item without a prefix applies to the mounter in use.
//! Since only the first `:` splits, an option value holding a `:` needs the
//! prefix (`krbd:crush_location=zone:zone1`). A later item for the same
//! mounter replaces an earlier one, as in ceph-csi.

use std::path::Path;

use crate::error::{Error, ErrorKind, Result};

/// The mappers a `mounter` parameter can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MounterKind {
    /// The kernel rbd client (`rbd`, `krbd`).
    Krbd,
    /// rbdkit's userspace mapper: FUSE file and loop device (`rbdkit-fuse`,
    /// `fuse`).
    Fuse,
}

impl MounterKind {
    /// The name [`crate::node::Mapper::name`] gives it.
    pub fn name(self) -> &'static str {
        match self {
            MounterKind::Krbd => "krbd",
            MounterKind::Fuse => "rbdkit-fuse",
        }
    }
}

/// The mapper for the `mounter` parameter (`None` or empty: the default).
///
/// `rbd`/`krbd` is the kernel client, `rbdkit-fuse`/`fuse` the userspace
/// mapper; `rbd-nbd`/`nbd` is refused as not supported yet. The default is
/// krbd where the kernel has the rbd bus (`<sysfs_root>/bus/rbd`), else the
/// userspace mapper.
pub fn select_mounter(mounter: Option<&str>, sysfs_root: &Path) -> Result<MounterKind> {
    match mounter.map(str::trim).unwrap_or("") {
        "" => Ok(if sysfs_root.join("bus/rbd").exists() {
            MounterKind::Krbd
        } else {
            MounterKind::Fuse
        }),
        "rbd" | "krbd" => Ok(MounterKind::Krbd),
        "rbdkit-fuse" | "fuse" => Ok(MounterKind::Fuse),
        "rbd-nbd" | "nbd" => Err(Error::with_kind(
            ErrorKind::NotSupported,
            libc::EOPNOTSUPP,
            "mounter",
            "rbd-nbd",
            "the rbd-nbd mounter is not supported yet; use krbd or rbdkit-fuse",
        )),
        other => Err(Error::invalid(
            "mounter",
            other,
            format!("unknown mounter {other:?}; use krbd, rbd-nbd or rbdkit-fuse"),
        )),
    }
}

/// The prefixes `mapOptions` items may carry, and the mounter each means
/// (`None`: a mounter rbdkit does not have, whose options are ignored).
fn prefix_kind(prefix: &str) -> Option<Option<MounterKind>> {
    match prefix.to_ascii_lowercase().as_str() {
        "krbd" | "rbd" => Some(Some(MounterKind::Krbd)),
        "rbdkit-fuse" | "fuse" => Some(Some(MounterKind::Fuse)),
        "nbd" | "rbd-nbd" => Some(None),
        _ => None,
    }
}

/// The options for mounter `kind` from a `mapOptions` or `unmapOptions`
/// value (`param` names which, for errors). An unknown prefix is an error.
pub fn options_for(value: &str, kind: MounterKind, param: &'static str) -> Result<Vec<String>> {
    let mut chosen: Option<&str> = None;
    for item in value.split(';') {
        if item.trim().is_empty() {
            continue;
        }
        match item.split_once(':') {
            None => chosen = Some(item.trim()),
            Some((prefix, opts)) => match prefix_kind(prefix.trim()) {
                Some(Some(k)) if k == kind => chosen = Some(opts.trim()),
                Some(_) => {}
                None => {
                    return Err(Error::invalid(
                        param,
                        item.trim(),
                        format!(
                            "unknown mounter type {:?} in {param}; give one of krbd, nbd, \
                             rbdkit-fuse before the \":\" (a value holding \":\" needs it)",
                            prefix.trim()
                        ),
                    ))
                }
            },
        }
    }
    Ok(chosen
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|o| !o.is_empty())
        .map(str::to_owned)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_table() {
        use MounterKind::{Fuse, Krbd};
        // (value, mounter, expected options)
        let table: &[(&str, MounterKind, &[&str])] = &[
            ("", Krbd, &[]),
            (";;", Krbd, &[]),
            (
                "lock_on_read,queue_depth=1024",
                Krbd,
                &["lock_on_read", "queue_depth=1024"],
            ),
            (
                "lock_on_read,queue_depth=1024",
                Fuse,
                &["lock_on_read", "queue_depth=1024"],
            ),
            (
                "krbd:lock_on_read,queue_depth=1024;nbd:try-netlink",
                Krbd,
                &["lock_on_read", "queue_depth=1024"],
            ),
            (
                "krbd:lock_on_read,queue_depth=1024;nbd:try-netlink",
                Fuse,
                &[],
            ),
            (
                "nbd:try-netlink;krbd:alloc_size=65536",
                Krbd,
                &["alloc_size=65536"],
            ),
            (" KRBD : a , b ; fuse:c", Krbd, &["a", "b"]),
            (" KRBD : a , b ; fuse:c", Fuse, &["c"]),
            ("rbdkit-fuse:cache=off", Fuse, &["cache=off"]),
            (
                "krbd:crush_location=zone:zone1,read_from_replica=localize",
                Krbd,
                &["crush_location=zone:zone1", "read_from_replica=localize"],
            ),
            // A later item for the same mounter wins.
            ("krbd:a;krbd:b", Krbd, &["b"]),
            ("a;krbd:b", Krbd, &["b"]),
            ("krbd:force", Krbd, &["force"]),
            ("krbd:", Krbd, &[]),
        ];
        for (value, kind, want) in table {
            let got = options_for(value, *kind, "mapOptions").unwrap();
            assert_eq!(&got, want, "{value:?} for {kind:?}");
        }
    }

    #[test]
    fn unknown_prefixes_are_refused() {
        for value in ["bogus:x", "crush_location=zone:zone1", "krbd:a;iscsi:b"] {
            let e = options_for(value, MounterKind::Krbd, "unmapOptions").unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{value}");
            assert!(e.to_string().contains("unknown mounter type"), "{e}");
            assert!(e.to_string().contains("unmapOptions"), "{e}");
        }
    }

    #[test]
    fn generated_values_round_trip() {
        // A small deterministic generator instead of a proptest dependency:
        // random option lists per mounter, rendered and parsed back.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let words = [
            "lock_on_read",
            "queue_depth=128",
            "noshare",
            "ms_mode=secure",
            "x=a:b",
        ];
        for _ in 0..500 {
            let mut lists: Vec<(&str, Vec<&str>)> = Vec::new();
            for prefix in ["krbd", "nbd", "rbdkit-fuse"] {
                if next(2) == 0 {
                    let n = next(4) as usize;
                    lists.push((prefix, (0..n).map(|_| words[next(5) as usize]).collect()));
                }
            }
            let value = lists
                .iter()
                .map(|(p, o)| format!("{p}:{}", o.join(",")))
                .collect::<Vec<_>>()
                .join(";");
            for (kind, prefix) in [
                (MounterKind::Krbd, "krbd"),
                (MounterKind::Fuse, "rbdkit-fuse"),
            ] {
                let want: Vec<&str> = lists
                    .iter()
                    .find(|(p, _)| *p == prefix)
                    .map(|(_, o)| o.clone())
                    .unwrap_or_default();
                assert_eq!(
                    options_for(&value, kind, "mapOptions").unwrap(),
                    want,
                    "{value:?}"
                );
            }
        }
    }

    #[test]
    fn mounter_selection() {
        let none = tempfile::tempdir().unwrap();
        let with_rbd = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(with_rbd.path().join("bus/rbd")).unwrap();
        assert_eq!(
            select_mounter(None, none.path()).unwrap(),
            MounterKind::Fuse
        );
        assert_eq!(
            select_mounter(Some(""), with_rbd.path()).unwrap(),
            MounterKind::Krbd
        );
        assert_eq!(
            select_mounter(None, with_rbd.path()).unwrap(),
            MounterKind::Krbd
        );
        for v in ["rbd", "krbd"] {
            assert_eq!(
                select_mounter(Some(v), none.path()).unwrap(),
                MounterKind::Krbd
            );
        }
        for v in ["rbdkit-fuse", "fuse"] {
            assert_eq!(
                select_mounter(Some(v), with_rbd.path()).unwrap(),
                MounterKind::Fuse
            );
        }
        let e = select_mounter(Some("rbd-nbd"), none.path()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotSupported);
        assert!(e.to_string().contains("not supported yet"), "{e}");
        let e = select_mounter(Some("iscsi"), none.path()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert_eq!(MounterKind::Krbd.name(), "krbd");
        assert_eq!(MounterKind::Fuse.name(), "rbdkit-fuse");
    }
}
