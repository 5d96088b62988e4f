//! csi-sanity (kubernetes-csi/csi-test, built from its Go module by
//! `scripts/csi-sanity`) against `rbdkit csi --mode all` with the userspace
//! mapper, real staging and target directories and real mounts. Skips are
//! listed, with their reasons, in `tests/csi-sanity/skips.txt` only.
use crate::support;

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use support::csi::{CsiEnv, Mode};

#[tokio::test(flavor = "multi_thread")]
async fn csi_sanity_passes() {
    let rbd = std::sync::Arc::new(support::ceph::TestNs::new("sanity"));
    let cluster_id = support::ceph::unique("sanity");
    // ext4's online grow needs CAP_SYS_RESOURCE, which this machine's
    // bounding set lacks; xfs grows online without it (and needs 300 MiB).
    let env = CsiEnv::with_ns(
        rbd,
        cluster_id,
        Mode::All,
        "sanity-node",
        &["--default-fstype", "xfs"],
    )
    .await;
    // Wait until the server answers.
    env.identity().await;

    let secrets = env.path("secrets.yaml");
    // Each side with its own least-privilege user.
    let entry = |s: HashMap<String, String>| {
        format!("  userID: {}\n  userKey: {}\n", s["userID"], s["userKey"])
    };
    let controller = entry(env.secrets());
    let node = entry(env.node_secrets());
    let mut text = String::new();
    for (key, one) in [
        ("CreateVolumeSecret", &controller),
        ("DeleteVolumeSecret", &controller),
        ("ControllerValidateVolumeCapabilitiesSecret", &controller),
        ("ControllerExpandVolumeSecret", &controller),
        ("ControllerModifyVolumeSecret", &controller),
        ("NodeStageVolumeSecret", &node),
        ("NodePublishVolumeSecret", &node),
        ("NodeExpandVolumeSecret", &node),
        ("CreateSnapshotSecret", &controller),
        ("DeleteSnapshotSecret", &controller),
        ("ListSnapshotsSecret", &controller),
    ] {
        text.push_str(&format!("{key}:\n{one}"));
    }
    std::fs::write(&secrets, text).unwrap();
    std::fs::set_permissions(&secrets, std::fs::Permissions::from_mode(0o600)).unwrap();
    let params = env.path("params.yaml");
    let p = env.params();
    std::fs::write(
        &params,
        format!("clusterID: {}\npool: {}\n", p["clusterID"], p["pool"]),
    )
    .unwrap();

    let junit = env.path("junit.xml");
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new(format!("{root}/scripts/csi-sanity"))
        .args([
            "run",
            "--endpoint",
            &format!("unix://{}", env.socket.display()),
            "--secrets",
            &secrets.display().to_string(),
            "--params",
            &params.display().to_string(),
            "--size",
            &(320u64 << 20).to_string(),
            "--expand-size",
            &(400u64 << 20).to_string(),
            "--junit",
            &junit.display().to_string(),
        ])
        .output()
        .expect("run scripts/csi-sanity");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for key in [&env.secrets()["userKey"], &env.node_secrets()["userKey"]] {
        assert!(
            !stdout.contains(key.as_str()) && !stderr.contains(key.as_str()),
            "key in csi-sanity output"
        );
        assert!(
            !env.csi.log_text().contains(key.as_str()),
            "key in the driver's log"
        );
    }
    let keep = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("csi-sanity-junit.xml");
    let _ = std::fs::copy(&junit, &keep);
    let summary: Vec<&str> = stdout
        .lines()
        .chain(stderr.lines())
        .filter(|l| l.contains("passed") && l.contains("failed"))
        .collect();
    eprintln!("csi-sanity: {}", summary.join(" | "));
    assert!(
        out.status.success(),
        "csi-sanity failed:\n{}\n{}",
        &stdout[stdout.len().saturating_sub(20000)..],
        &stderr[stderr.len().saturating_sub(4000)..]
    );
    // Every test that did not pass is skipped for a reason skips.txt gives.
    let skips = std::fs::read_to_string(format!("{root}/tests/csi-sanity/skips.txt")).unwrap();
    let patterns: Vec<String> = skips
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| l.trim_start_matches("gated: ").to_owned())
        .collect();
    let report = std::fs::read_to_string(&junit).expect("junit report");
    let mut unexplained = Vec::new();
    let mut passed = 0;
    for case in report.split("<testcase ").skip(1) {
        let attr = |name: &str| {
            case.split(&format!("{name}=\""))
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or("")
        };
        let (name, status) = (attr("name"), attr("status"));
        if status == "passed" {
            passed += 1;
        } else if !patterns.iter().any(|p| regex_lite_match(p, name)) {
            unexplained.push(format!("{status}: {name}"));
        }
    }
    assert!(
        unexplained.is_empty(),
        "skipped without a reason in skips.txt:\n{}",
        unexplained.join("\n")
    );
    // A report with no passed case means the report was not read (a
    // changed format), not that rbdkit passed: every other case is a skip
    // that skips.txt explains, so no count has to follow the skips.
    assert!(
        passed > 0,
        "no passed test case in the junit report:\n{}",
        report.chars().take(4000).collect::<String>()
    );
    // Nothing left behind in Ceph.
    assert!(rbdkit::rbd::list_names(&env.rbd.ioctx).unwrap().is_empty());
}

/// Whether `name` contains a match of `pattern`, for the small regexes in
/// skips.txt: literals, `(a|b)` groups and `[Ss]` classes.
fn regex_lite_match(pattern: &str, name: &str) -> bool {
    alternatives(pattern)
        .iter()
        .any(|alt| name.contains(alt.as_str()))
}

/// Expands the groups and classes of a pattern into plain alternatives.
fn alternatives(pattern: &str) -> Vec<String> {
    let mut outs = vec![String::new()];
    let mut rest = pattern;
    while let Some(c) = rest.chars().next() {
        let (choices, len): (Vec<String>, usize) = match c {
            '(' => {
                let end = rest.find(')').expect("closing )");
                (
                    rest[1..end].split('|').flat_map(alternatives).collect(),
                    end + 1,
                )
            }
            '[' => {
                let end = rest.find(']').expect("closing ]");
                (rest[1..end].chars().map(String::from).collect(), end + 1)
            }
            _ => (vec![c.to_string()], c.len_utf8()),
        };
        outs = outs
            .iter()
            .flat_map(|o| choices.iter().map(move |ch| format!("{o}{ch}")))
            .collect();
        rest = &rest[len..];
    }
    outs
}
