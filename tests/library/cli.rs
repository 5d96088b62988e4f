//! The `rbdkit image` CLI against a real cluster: output, JSON and errors.

use crate::support;

use std::process::{Command, Output};

use support::ceph::{TestCluster, TestNs, POOL};

fn rbdkit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rbdkit"))
        .arg("image")
        .args(args)
        .env("CEPH_CONF", TestCluster::get().conf())
        .output()
        .expect("run rbdkit")
}

fn ok(args: &[&str]) -> String {
    let out = rbdkit(args);
    assert!(
        out.status.success(),
        "rbdkit {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs a command that must fail, returning its one-line error.
fn fails(args: &[&str]) -> String {
    let out = rbdkit(args);
    assert!(!out.status.success(), "rbdkit {args:?} should fail");
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    err
}

#[test]
fn create_info_resize_snap_and_remove() {
    let ns = TestNs::new("cli");
    let spec = format!("{POOL}/{}/vol", ns.name);
    ok(&[
        "create",
        &spec,
        "--size",
        "1G",
        "--features",
        "layering,exclusive-lock,object-map,fast-diff",
        "--object-size",
        "8M",
    ]);
    let info: serde_json::Value = serde_json::from_str(&ok(&["info", &spec, "--json"])).unwrap();
    assert_eq!(info["name"], "vol");
    assert_eq!(info["size"], 1u64 << 30);
    assert_eq!(info["object_size"], 8u64 << 20);
    assert_eq!(
        info["features"],
        serde_json::json!(["layering", "exclusive-lock", "object-map", "fast-diff"])
    );
    assert_eq!(info["snapshot_count"], 0);
    assert!(!info["id"].as_str().unwrap().is_empty());
    assert!(ok(&["info", &spec]).contains("size 1 GiB in 128 objects"));

    let listed: Vec<String> =
        serde_json::from_str(&ok(&["ls", &format!("{POOL}/{}", ns.name), "--json"])).unwrap();
    assert_eq!(listed, vec!["vol"]);

    let err = fails(&["resize", &spec, "--size", "512M"]);
    assert!(
        err.contains(&spec) && err.contains("--allow-shrink"),
        "{err}"
    );
    ok(&["resize", &spec, "--size", "2G"]);
    ok(&["resize", &spec, "--size", "1536M", "--allow-shrink"]);
    let info: serde_json::Value = serde_json::from_str(&ok(&["info", &spec, "--json"])).unwrap();
    assert_eq!(info["size"], 1536u64 << 20);

    ok(&["snap", "create", &format!("{spec}@s1")]);
    let snaps: serde_json::Value =
        serde_json::from_str(&ok(&["snap", "ls", &spec, "--json"])).unwrap();
    assert_eq!(snaps[0]["name"], "s1");
    let err = fails(&["rm", &spec]);
    assert!(err.contains(&spec) && err.contains("snapshots"), "{err}");
    ok(&["snap", "rm", &format!("{spec}@s1")]);
    ok(&["rm", &spec]);
    let err = fails(&["info", &spec]);
    assert!(err.contains(&spec) && err.contains("not found"), "{err}");
}

#[test]
fn errors_name_the_image_and_the_reason() {
    let ns = TestNs::new("clierr");
    let spec = format!("{POOL}/{}/dup", ns.name);
    ok(&["create", &spec, "--size", "16M"]);
    let err = fails(&["create", &spec, "--size", "16M"]);
    assert!(
        err.contains(&spec) && err.contains("already exists"),
        "{err}"
    );
    let err = fails(&[
        "create",
        &format!("{POOL}/{}/bad", ns.name),
        "--size",
        "16M",
        "--features",
        "object-map",
    ]);
    assert!(err.contains("exclusive-lock"), "{err}");
    let err = fails(&[
        "create",
        &format!("{POOL}/{}/bad", ns.name),
        "--size",
        "lots",
    ]);
    assert!(err.contains("\"lots\""), "{err}");
    let err = fails(&["create", "no-pool-given", "--size", "1G"]);
    assert!(err.contains("no-pool-given"), "{err}");
    let listed: Vec<String> =
        serde_json::from_str(&ok(&["ls", &format!("{POOL}/{}", ns.name), "--json"])).unwrap();
    assert_eq!(listed, vec!["dup"], "failed creates made nothing");
}
