//! `rbdkit gc` against a real pool and a real control plane: a pool holding
//! foreign images (no metadata, another provisioner's record, an incomplete
//! record, a temporary image without one, a foreign trash entry), images
//! owned by the provisioner and referenced by PVs or by a claim being
//! provisioned, and owned leftovers (orphans, a temporary image, a trash
//! entry, a temporary `rbdkit-tmp-` snapshot on an image still in use). The
//! dry run lists exactly the leftovers and changes nothing;
//! `--apply` removes exactly them; a second `--apply` finds nothing.
use crate::support;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use serde_json::json;

use rbdkit::rbd::{self, Image, ImageOptions};
use rbdkit::volume::ops::{
    self, Owner, META_CLUSTER, META_PROVISIONER, META_PV, META_PVC_NAME, META_PVC_NAMESPACE,
};
use rbdkit::volume::{NoFence, NoMetrics, VolumeId};

use support::provisioner::Env;

const MIB: u64 = 1 << 20;

fn owner(env: &Env, provisioner: &str, pv: &str) -> Owner {
    Owner {
        provisioner: provisioner.into(),
        pv_name: pv.into(),
        pvc_namespace: env.ns.clone(),
        pvc_name: format!("claim-of-{pv}"),
        cluster_id: env.cluster_id.clone(),
    }
}

fn vol(env: &Env, image: &str) -> VolumeId {
    VolumeId {
        cluster_id: env.cluster_id.clone(),
        pool: support::ceph::POOL.into(),
        rados_namespace: env.rbd.name.clone(),
        image: image.into(),
    }
}

/// An image with a complete owner record, made as the provisioner makes it.
fn owned_image(env: &Env, provisioner: &str, image: &str) {
    let o = owner(env, provisioner, image);
    ops::ensure_image(
        &support::ceph::cluster(),
        &NoMetrics,
        &NoFence,
        &vol(env, image),
        8 * MIB,
        &ImageOptions::new(),
        &o,
    )
    .unwrap_or_else(|e| panic!("make {image}: {e}"));
}

/// An image with exactly these metadata pairs.
fn image_with(env: &Env, image: &str, meta: &[(&str, &str)]) {
    rbd::create(&env.rbd.ioctx, image, 8 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&env.rbd.ioctx, image).unwrap();
    for (k, v) in meta {
        img.metadata_set(k, v).unwrap();
    }
}

fn trash(env: &Env, image: &str) {
    rbd::trash_move(&env.rbd.ioctx, image, Duration::from_secs(3600)).unwrap();
}

/// Image names and trash entry names of the test's namespace.
fn pool_state(env: &Env) -> (BTreeSet<String>, BTreeSet<String>) {
    let images = env.images().into_iter().collect();
    let trash = rbd::trash_list(&env.rbd.ioctx)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    (images, trash)
}

/// Runs `rbdkit gc` with `extra` flags and JSON output; returns the
/// report, stdout and stderr.
fn gc(env: &Env, extra: &[&str]) -> (serde_json::Value, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rbdkit"))
        .arg("gc")
        .args(["--provisioner", &env.name])
        .arg("--clusters-config")
        .arg(env.config_path())
        .arg("--kubeconfig")
        .arg(&env.kubeconfig)
        .args(["--timeout", "30s"])
        .args(extra)
        .env_remove("CEPH_CONF")
        .output()
        .expect("run rbdkit gc");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "rbdkit gc {extra:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let key = support::ceph::TestCluster::get().admin_key();
    assert!(
        !stdout.contains(&key) && !stderr.contains(&key),
        "gc printed a key"
    );
    let report = if extra.contains(&"json") {
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
    } else {
        serde_json::Value::Null
    };
    (report, stdout, stderr)
}

/// `kind name action` of each object in a JSON report.
fn objects(report: &serde_json::Value) -> BTreeSet<(String, String, String)> {
    report["objects"]
        .as_array()
        .expect("objects")
        .iter()
        .map(|o| {
            (
                o["kind"].as_str().unwrap().to_owned(),
                o["name"].as_str().unwrap().to_owned(),
                o["action"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_lists_and_removes_exactly_the_provisioners_leftovers() {
    let mut env = Env::new("gc").await;
    // The provisioner Secret is templated (${pvc.namespace}); gc takes the
    // expand Secret, which is not.
    let class = env.storage_class("g", json!({}), json!({})).await;

    // Owned and referenced: two claims provisioned by the real provisioner.
    let provisioner = env.start_in_process();
    env.claim("a", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.claim("b", &class, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    let (_, pv_a) = env.wait_bound("a").await;
    let (_, pv_b) = env.wait_bound("b").await;
    provisioner.stop().await;
    let bound: Vec<String> = [pv_a, pv_b]
        .iter()
        .map(|pv| {
            let handle = &pv
                .spec
                .as_ref()
                .unwrap()
                .csi
                .as_ref()
                .unwrap()
                .volume_handle;
            VolumeId::parse(handle).unwrap().image
        })
        .collect();

    // Owned and referenced by a claim still being provisioned (no PV yet):
    // its class belongs to nobody, so it stays Pending.
    let pending = env
        .claim(
            "pending",
            "no-such-class",
            "8Mi",
            &["ReadWriteOnce"],
            "Filesystem",
        )
        .await;
    let in_flight = format!("pvc-{}", pending.metadata.uid.unwrap());
    owned_image(&env, &env.name, &in_flight);

    // Owned leftovers: two orphans, a temporary image, a trash entry.
    owned_image(&env, &env.name, "pvc-orphan-1");
    owned_image(&env, &env.name, "pvc-orphan-2");
    {
        let o = owner(&env, &env.name, "pvc-temp");
        image_with(
            &env,
            "pvc-temp.rbdkit-new",
            &[
                (META_PROVISIONER, o.provisioner.as_str()),
                (META_PV, &o.pv_name),
                (META_PVC_NAMESPACE, &o.pvc_namespace),
                (META_PVC_NAME, &o.pvc_name),
                (META_CLUSTER, &o.cluster_id),
            ],
        );
    }
    owned_image(&env, &env.name, "pvc-trashed");
    trash(&env, "pvc-trashed");

    // Foreign: no metadata; another provisioner's record; an incomplete
    // record of ours (no PV); another cluster id's record; a temporary
    // image without a record; a foreign trash entry.
    image_with(&env, "pvc-plain", &[("owner", "someone-else")]);
    owned_image(&env, "other.rbdkit.test", "pvc-other");
    image_with(
        &env,
        "pvc-partial",
        &[(META_PROVISIONER, env.name.as_str())],
    );
    image_with(
        &env,
        "pvc-elsewhere",
        &[
            (META_PROVISIONER, env.name.as_str()),
            (META_PV, "pvc-elsewhere"),
            (META_CLUSTER, "another-cluster"),
        ],
    );
    image_with(&env, "pvc-bare.rbdkit-new", &[]);
    image_with(&env, "pvc-foreign-trash", &[]);
    trash(&env, "pvc-foreign-trash");

    // Temporary snapshots (a killed snapshot or clone create leaves one on
    // its source). A leftover on an image still in use; kept: one for the
    // claim still being provisioned, one whose clone is being made (its
    // `.rbdkit-new` image exists), a user's snapshot, and one on a foreign
    // image.
    let snap = |image: &str, name: &str| {
        Image::open(&env.rbd.ioctx, image)
            .unwrap()
            .snap_create(name)
            .unwrap_or_else(|e| panic!("snapshot {image}@{name}: {e}"));
    };
    snap(&bound[0], "rbdkit-tmp-pvc-gone");
    snap(&bound[0], "user-snap");
    snap(&bound[0], "rbdkit-tmp-pvc-bare");
    snap(&bound[1], &format!("rbdkit-tmp-{in_flight}"));
    snap("pvc-plain", "rbdkit-tmp-pvc-gone");
    let snaps = |image: &str| -> BTreeSet<String> {
        Image::open_read_only(&env.rbd.ioctx, image)
            .unwrap()
            .snap_list()
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect()
    };

    let mut kept_images = set(&[
        &bound[0],
        &bound[1],
        &in_flight,
        "pvc-plain",
        "pvc-other",
        "pvc-partial",
        "pvc-elsewhere",
        "pvc-bare.rbdkit-new",
    ]);
    let before = pool_state(&env);
    let mut all_images = kept_images.clone();
    all_images.extend(set(&[
        "pvc-orphan-1",
        "pvc-orphan-2",
        "pvc-temp.rbdkit-new",
    ]));
    assert_eq!(before.0, all_images);
    assert_eq!(before.1, set(&["pvc-trashed", "pvc-foreign-trash"]));

    // 1. Dry run: exactly the leftovers, nothing changed.
    let (report, _, _) = gc(&env, &["--output", "json"]);
    let want = |action: &str| -> BTreeSet<(String, String, String)> {
        [
            ("orphan", "pvc-orphan-1"),
            ("orphan", "pvc-orphan-2"),
            ("temp", "pvc-temp.rbdkit-new"),
            ("trash", "pvc-trashed"),
            ("tempsnap", bound[0].as_str()),
        ]
        .iter()
        .map(|(k, n)| (k.to_string(), n.to_string(), action.to_owned()))
        .collect()
    };
    assert_eq!(objects(&report), want("would remove"), "{report:#}");
    let tempsnap: Vec<_> = report["objects"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["kind"] == "tempsnap")
        .collect();
    assert_eq!(tempsnap[0]["snapshot"], "rbdkit-tmp-pvc-gone", "{report:#}");
    assert_eq!(tempsnap[0]["pv"], "pvc-gone", "{report:#}");
    // The three claims' images, and the in-flight claim's snapshot.
    assert_eq!(report["summary"]["referenced"], json!(4), "{report:#}");
    assert_eq!(report["summary"]["tempsnap"], json!(1), "{report:#}");
    assert_eq!(report["summary"]["foreign"], json!(6), "{report:#}");
    assert_eq!(report["errors"], json!([]), "{report:#}");
    assert_eq!(pool_state(&env), before, "a dry run changed the pool");
    let snaps_before = snaps(&bound[0]);
    assert!(snaps_before.contains("rbdkit-tmp-pvc-gone"));

    // The text report: one line per object, then the summary.
    let (_, text, _) = gc(&env, &[]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    assert!(
        lines[..5].iter().all(|l| l.ends_with("would remove")),
        "{text}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("tempsnap ") && l.contains("@rbdkit-tmp-pvc-gone ")),
        "{text}"
    );
    assert!(
        lines[5].starts_with("summary: 1 pool(s) scanned; 5 to collect"),
        "{text}"
    );

    // 2. Apply: exactly those go.
    let (report, _, _) = gc(&env, &["--apply", "--output", "json"]);
    assert_eq!(objects(&report), want("removed"), "{report:#}");
    let after = pool_state(&env);
    assert_eq!(after.0, kept_images, "images after --apply");
    assert_eq!(after.1, set(&["pvc-foreign-trash"]), "trash after --apply");
    // The foreign and referenced images still carry what they carried.
    let meta = |name: &str| {
        ops::owner_metadata(&Image::open_read_only(&env.rbd.ioctx, name).unwrap()).unwrap()
    };
    assert_eq!(meta("pvc-plain").len(), 0);
    assert_eq!(meta("pvc-other")[META_PROVISIONER], "other.rbdkit.test");
    assert_eq!(meta(&bound[0])[META_PROVISIONER], env.name);
    // Only the leftover snapshot went.
    assert_eq!(
        snaps(&bound[0]),
        set(&["user-snap", "rbdkit-tmp-pvc-bare"]),
        "snapshots after --apply"
    );
    assert_eq!(snaps(&bound[1]), set(&[&format!("rbdkit-tmp-{in_flight}")]));
    assert_eq!(snaps("pvc-plain"), set(&["rbdkit-tmp-pvc-gone"]));

    // 3. A second apply finds nothing.
    let (report, _, _) = gc(&env, &["--apply", "--output", "json"]);
    assert_eq!(objects(&report), BTreeSet::new(), "{report:#}");
    assert_eq!(pool_state(&env), after);

    // Once its claim is gone, the in-flight image is a leftover too, and
    // so is the temporary snapshot taken for it.
    env.delete_claim("pending").await;
    env.wait_gone(&env.claims(), "pending").await;
    let (report, _, _) = gc(&env, &["--apply", "--output", "json"]);
    assert_eq!(
        objects(&report),
        [
            ("orphan".to_owned(), in_flight.clone(), "removed".to_owned()),
            (
                "tempsnap".to_owned(),
                bound[1].clone(),
                "removed".to_owned()
            ),
        ]
        .into_iter()
        .collect(),
        "{report:#}"
    );
    kept_images.remove(&in_flight);
    assert_eq!(pool_state(&env).0, kept_images);
    assert_eq!(snaps(&bound[1]), BTreeSet::new());

    // 4. The RBD group a group snapshot create left, given up (marked, a
    // source still in it): collected once its marker is older than
    // --group-grace (a day by default, so not yet); another's group never.
    let io = &env.rbd.ioctx;
    io.write_full("rbdkit.group.gs-left", b"").unwrap();
    rbd::group_create(io, "gs-left").unwrap();
    rbd::group_image_add(io, "gs-left", io, &bound[0]).unwrap();
    rbd::group_create(io, "user-group").unwrap();
    let (report, _, _) = gc(&env, &["--apply", "--output", "json"]);
    assert_eq!(objects(&report), BTreeSet::new(), "{report:#}");
    let grace = ["--group-grace", "0s", "--output", "json"];
    let (report, _, _) = gc(&env, &grace);
    let group = |action: &str| {
        let o = ("group".to_owned(), "gs-left".to_owned(), action.to_owned());
        BTreeSet::from([o])
    };
    assert_eq!(objects(&report), group("would remove"), "{report:#}");
    assert_eq!(report["summary"]["group"], json!(1), "{report:#}");
    let (report, _, _) = gc(&env, &[&grace[..], &["--apply"]].concat());
    assert_eq!(objects(&report), group("removed"), "{report:#}");
    assert_eq!(rbd::group_list(io).unwrap(), vec!["user-group"]);
    assert!(io.stat("rbdkit.group.gs-left").is_err(), "marker left");
    assert_eq!(pool_state(&env).0, kept_images);
    rbd::group_remove(io, "user-group").unwrap();
}
