//! Generates the librados/librbd bindings and turns the librbd version into
//! cfg flags.
//!
//! Search order for headers and libraries:
//! 1. `RBD_SYS_INCLUDE_DIR` / `RBD_SYS_LIB_DIR` (an install prefix of your own),
//! 2. pkg-config `librbd` and `librados`, where a distribution ships `.pc` files
//!    (Debian does not),
//! 3. the compiler's default paths, linking plainly with `-lrados -lrbd`.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

/// Minor versions of librbd 1.x that we know the Ceph release names of; each
/// one present or older becomes a `librbd_1_NN` cfg flag. Checked against
/// the headers: Pacific 16.2.15 reports 1.16, Reef 18.2.7 1.18, Tentacle
/// 20.2.4 1.20 (Squid 19.2 reports 1.19).
const KNOWN_MINORS: &[(u32, &str)] = &[
    (16, "pacific"),
    (17, "quincy"),
    (18, "reef"),
    (19, "squid"),
    (20, "tentacle"),
];

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=RBD_SYS_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=RBD_SYS_LIB_DIR");
    println!("cargo:rerun-if-env-changed=RBD_SYS_NO_PKG_CONFIG");

    let mut include_dirs: Vec<PathBuf> = Vec::new();
    let mut linked = false;

    if let Some(dir) = env::var_os("RBD_SYS_INCLUDE_DIR") {
        include_dirs.push(PathBuf::from(dir));
    }
    if let Some(dir) = env::var_os("RBD_SYS_LIB_DIR") {
        println!(
            "cargo:rustc-link-search=native={}",
            Path::new(&dir).display()
        );
    } else if env::var_os("RBD_SYS_NO_PKG_CONFIG").is_none() {
        // Optional: only some distributions ship librbd.pc / librados.pc.
        let rbd = pkg_config::Config::new().probe("librbd");
        let rados = pkg_config::Config::new().probe("librados");
        if let (Ok(rbd), Ok(rados)) = (rbd, rados) {
            include_dirs.extend(rbd.include_paths);
            include_dirs.extend(rados.include_paths);
            linked = true;
        }
    }
    if !linked {
        println!("cargo:rustc-link-lib=rados");
        println!("cargo:rustc-link-lib=rbd");
    }

    let header = find_header(&include_dirs, "rbd/librbd.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let text = fs::read_to_string(&header)
        .unwrap_or_else(|e| panic!("rbd-sys: cannot read {}: {e}", header.display()));
    emit_version_cfgs(&text);

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("rados_.*")
        .allowlist_function("rbd_.*")
        .allowlist_type("rados_.*")
        .allowlist_type("rbd_.*")
        .allowlist_var("LIBRADOS_.*")
        .allowlist_var("LIBRBD_.*")
        .allowlist_var("RBD_.*")
        .allowlist_var("CEPH_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for dir in &include_dirs {
        builder = builder.clang_arg(format!("-I{}", dir.display()));
    }
    let bindings = builder.generate().unwrap_or_else(|e| {
        panic!(
            "rbd-sys: bindgen failed on rados/librados.h + rbd/librbd.h ({e}). \
             Install librados-dev, librbd-dev, clang and libclang-dev, or set \
             RBD_SYS_INCLUDE_DIR to the prefix that holds rados/ and rbd/."
        )
    });
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("rbd-sys: cannot write bindings.rs");
}

/// Finds `rel` in the given include dirs, then in the usual system prefixes.
fn find_header(dirs: &[PathBuf], rel: &str) -> PathBuf {
    let defaults = [
        PathBuf::from("/usr/include"),
        PathBuf::from("/usr/local/include"),
    ];
    dirs.iter()
        .chain(defaults.iter())
        .map(|d| d.join(rel))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "rbd-sys: {rel} not found in {dirs:?} or /usr/include. Install librbd-dev \
                 and librados-dev (Debian/Ubuntu), or set RBD_SYS_INCLUDE_DIR."
            )
        })
}

/// Reads `#define NAME VALUE` from header text.
fn define(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let mut it = line.split_whitespace();
        (it.next() == Some("#define") && it.next() == Some(name))
            .then(|| it.next().and_then(|v| v.parse().ok()))
            .flatten()
    })
}

fn emit_version_cfgs(text: &str) {
    let major = define(text, "LIBRBD_VER_MAJOR").expect("LIBRBD_VER_MAJOR in librbd.h");
    let minor = define(text, "LIBRBD_VER_MINOR").expect("LIBRBD_VER_MINOR in librbd.h");
    let extra = define(text, "LIBRBD_VER_EXTRA").unwrap_or(0);
    assert_eq!(
        major, 1,
        "rbd-sys supports librbd 1.x, found {major}.{minor}"
    );

    let (newest, newest_name) = KNOWN_MINORS[KNOWN_MINORS.len() - 1];
    if minor > newest {
        println!(
            "cargo:warning=rbd-sys: librbd 1.{minor} is newer than the newest release rbd-sys \
             knows (1.{newest}, {newest_name}); cfg flags up to librbd_1_{newest} are set"
        );
    }
    let release = KNOWN_MINORS
        .iter()
        .rev()
        .find(|(m, _)| *m <= minor)
        .map_or("older than pacific", |(_, name)| name);
    for (known, _) in KNOWN_MINORS {
        println!("cargo::rustc-check-cfg=cfg(librbd_1_{known})");
        if minor >= *known {
            println!("cargo:rustc-cfg=librbd_1_{known}");
        }
    }
    let mut supports = Vec::new();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        if it.next() != Some("#define") {
            continue;
        }
        let (Some(name), Some(value)) = (it.next(), it.next()) else {
            continue;
        };
        if let Some(feature) = name.strip_prefix("LIBRBD_SUPPORTS_") {
            let feature = feature.to_ascii_lowercase();
            println!("cargo::rustc-check-cfg=cfg(librbd_supports_{feature})");
            if value == "1" {
                println!("cargo:rustc-cfg=librbd_supports_{feature}");
                supports.push(feature);
            }
        }
    }
    // Passed on to dependents as DEP_RBD_* (see `links` in Cargo.toml).
    println!("cargo:version_major={major}");
    println!("cargo:version_minor={minor}");
    println!("cargo:version_extra={extra}");
    println!("cargo:release={release}");
    println!("cargo:supports={}", supports.join(","));
}
