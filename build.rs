//! Passes the librbd version that `rbd-sys` found on to this crate as cfg
//! flags, so wrappers of calls added in later Ceph releases compile only where
//! the headers have them.

use std::env;

/// librbd 1.x minor versions with a cfg flag: 16 Pacific, 17 Quincy, 18 Reef,
/// 19 Squid, 20 Tentacle.
const KNOWN_MINORS: &[u32] = &[16, 17, 18, 19, 20];

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_RBD_VERSION_MINOR");
    println!("cargo:rerun-if-env-changed=DEP_RBD_SUPPORTS");
    let minor: u32 = env::var("DEP_RBD_VERSION_MINOR")
        .ok()
        .and_then(|v| v.parse().ok())
        .expect("rbd-sys passes DEP_RBD_VERSION_MINOR");
    // Named in the "needs a newer librbd" errors.
    println!("cargo:rustc-env=RBDKIT_LIBRBD_MINOR={minor}");
    for known in KNOWN_MINORS {
        println!("cargo::rustc-check-cfg=cfg(librbd_1_{known})");
        if minor >= *known {
            println!("cargo:rustc-cfg=librbd_1_{known}");
        }
    }
    let supports = env::var("DEP_RBD_SUPPORTS").unwrap_or_default();
    for name in [
        "aio_flush",
        "aio_open",
        "compare_and_write",
        "locking",
        "invalidate",
        "iovec",
        "watch",
        "writesame",
        "write_zeroes",
        "encryption",
        // Reef (1.18) and later
        "compare_and_write_iovec",
        "encryption_load2",
        "diff_iterate3",
        // Tentacle (1.20)
        "group_snap_get_info",
    ] {
        println!("cargo::rustc-check-cfg=cfg(librbd_supports_{name})");
    }
    for feature in supports.split(',').filter(|s| !s.is_empty()) {
        println!("cargo:rustc-cfg=librbd_supports_{feature}");
    }
}
