//! Passes the librbd version that `rbd-sys` found on to this crate as cfg
//! flags, so wrappers of calls added in later Ceph releases compile only where
//! the headers have them; and lays out the release binary's code (see
//! `link/README.md`).

use std::env;
use std::path::Path;
use std::process::Command;

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
    link_layout();
}

/// Release builds of the `rbdkit` binary, when LLD links them: the functions
/// in `link/rbdkit.order` (those the provisioner runs) go first, so the
/// kernel's fault-around maps far fewer pages of cold code; relative
/// relocations are packed (DT_RELR, glibc 2.36+), so the dynamic loader
/// reads kilobytes instead of half a megabyte of them at start-up.
fn link_layout() {
    println!("cargo:rerun-if-changed=link/rbdkit.order");
    println!("cargo:rerun-if-env-changed=RUSTC_LINKER");
    if env::var("PROFILE").as_deref() != Ok("release")
        || env::var("TARGET").as_deref() != Ok("x86_64-unknown-linux-gnu")
        || !lld_links()
    {
        return;
    }
    let dir = env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    if !Path::new(&dir).join("link").join("rbdkit.order").is_file() {
        return;
    }
    // Relative: the linker runs in the package's root, and this output is
    // reused by every clone that shares a target dir (scripts/cargo-target),
    // so an absolute path would name whichever clone built it first.
    let order = Path::new("link").join("rbdkit.order");
    // Names missing from the binary (the file is older than the code) are
    // skipped, so a stale file costs memory, never a failed link.
    for arg in [
        format!("--symbol-ordering-file={}", order.display()),
        "--no-warn-symbol-ordering".to_owned(),
        "-z,pack-relative-relocs".to_owned(),
    ] {
        println!("cargo:rustc-link-arg-bin=rbdkit=-Wl,{arg}");
    }
}

/// Whether rustc links with its own LLD: the default on this target since
/// Rust 1.90, unless a linker or linker features were configured.
fn lld_links() -> bool {
    if env::var_os("RUSTC_LINKER").is_some()
        || env::var("CARGO_ENCODED_RUSTFLAGS").is_ok_and(|f| f.contains("link"))
    {
        return false;
    }
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let Ok(out) = Command::new(rustc).arg("-vV").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(release) = text.lines().find_map(|l| l.strip_prefix("release: ")) else {
        return false;
    };
    let mut parts = release
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (1, 90)
}
