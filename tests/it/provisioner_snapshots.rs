//! End-to-end tests of the provisioner's VolumeSnapshotContent reconciler
//! against a real control plane, real Ceph and the real snapshot-controller
//! (built from external-snapshotter, `tests/support/snapshots.rs`).
use crate::support;

use std::time::{Duration, Instant};

use kube::api::DeleteParams;
use serde_json::json;

use rbdkit::provisioner::snapshots::{ANN_BEING_CREATED, SNAPSHOT_FINALIZER};
use rbdkit::rbd::{self, Image};
use rbdkit::volume::snapshot::{META_KIND, SNAP_NAME};
use rbdkit::volume::{SnapshotId, VolumeId};

use support::data::pattern;
use support::k8s::ControlPlane;
use support::manifests::{apply, deploy_dir, parse_docs};
use support::provisioner::{eventually, Env, WAIT};
use support::snapshots::{self as snaps, SnapshotController};

/// Starts (once per process) the snapshot-controller, then a test world
/// with a StorageClass; returns it and the class name.
async fn setup(test: &str) -> (Env, String) {
    SnapshotController::shared(ControlPlane::shared()).await;
    let mut env = Env::new(test).await;
    let class = env.storage_class("sc", json!({}), json!({})).await;
    (env, class)
}

/// A VolumeSnapshotClass of the test's driver, with the snapshotter Secret
/// named through the `${volumesnapshot.namespace}` template.
async fn snapshot_class(env: &Env, suffix: &str, policy: &str, extra: serde_json::Value) -> String {
    let mut params = json!({
        "csi.storage.k8s.io/snapshotter-secret-name": env.secret,
        "csi.storage.k8s.io/snapshotter-secret-namespace": "${volumesnapshot.namespace}",
    });
    if let serde_json::Value::Object(m) = extra {
        for (k, v) in m {
            params[k] = v;
        }
    }
    snaps::create_class(
        &env.client,
        &format!("{}-{suffix}", env.ns),
        &env.name,
        params,
        policy,
    )
    .await
}

/// A Bound claim `name` of 64 MiB with `seed`'s pattern in its first MiB;
/// returns its volume.
async fn source(env: &Env, class: &str, name: &str, seed: u64) -> VolumeId {
    env.claim(name, class, "64Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound(name).await;
    let handle = pv.spec.unwrap().csi.unwrap().volume_handle;
    let vol = VolumeId::parse(&handle).expect("volume handle");
    let img = Image::open(&env.rbd.ioctx, &vol.image).expect("open source");
    img.write(0, &pattern(seed, 1 << 20))
        .expect("write pattern");
    img.flush().expect("flush");
    vol
}

/// Images of the test's RADOS namespace that are snapshot images.
fn snapshot_images(env: &Env) -> Vec<String> {
    env.images()
        .into_iter()
        .filter(|n| {
            Image::open_read_only(&env.rbd.ioctx, n)
                .and_then(|i| i.metadata_get(META_KIND))
                .is_ok_and(|k| k == "snapshot")
        })
        .collect()
}

async fn content(env: &Env, vs: &kube::api::DynamicObject) -> kube::api::DynamicObject {
    snaps::content_of(&env.client, vs)
        .await
        .expect("a bound VolumeSnapshotContent")
}

async fn wait_content_gone(env: &Env, name: &str) {
    let api = snaps::contents(&env.client);
    eventually(&format!("content {name} gone"), WAIT, || async {
        match api.get_opt(name).await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(c) => Err(format!(
                "finalizers {:?}, annotations {:?}, status {}",
                c.metadata.finalizers, c.metadata.annotations, c.data["status"]
            )),
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_becomes_ready_and_goes_with_its_volumesnapshot() {
    let (env, class) = setup("snap").await;
    let _p = env.start_in_process();
    let vol = source(&env, &class, "src", 7).await;
    let sclass = snapshot_class(&env, "delete", "Delete", json!({})).await;

    let t0 = Instant::now();
    snaps::create_snapshot(&env.client, &env.ns, "snap1", &sclass, "src").await;
    let vs = snaps::wait_ready(&env.client, &env.ns, "snap1", WAIT).await;
    eprintln!(
        "VolumeSnapshot create -> readyToUse took {:?}",
        t0.elapsed()
    );
    assert_eq!(vs.data["status"]["restoreSize"], json!("64Mi"));

    let c = content(&env, &vs).await;
    let handle = c.data["status"]["snapshotHandle"]
        .as_str()
        .expect("snapshotHandle")
        .to_owned();
    let sid = SnapshotId::parse(&handle).expect("rbdkit snapshot handle");
    assert_eq!(sid.snap, SNAP_NAME);
    assert_eq!(sid.pool, vol.pool);
    assert_eq!(c.data["status"]["restoreSize"], json!(64 << 20));
    assert!(c.data["status"]["creationTime"].as_i64().unwrap_or(0) > 0);
    // The snapshot-controller's first finalizer patch may replace the list;
    // the reconciler puts ours back.
    let contents = snaps::contents(&env.client);
    let cname = c.metadata.name.clone().unwrap();
    eventually("rbdkit's finalizer on the content", WAIT, || async {
        let c = contents.get(&cname).await.map_err(|e| e.to_string())?;
        let fin = c.metadata.finalizers.clone().unwrap_or_default();
        if fin.contains(&SNAPSHOT_FINALIZER.to_owned()) {
            Ok(())
        } else {
            Err(format!("finalizers {fin:?}"))
        }
    })
    .await;
    assert!(!c
        .metadata
        .annotations
        .clone()
        .unwrap_or_default()
        .contains_key(ANN_BEING_CREATED));

    // The snapshot image holds the data as it was.
    assert_eq!(snapshot_images(&env), vec![sid.image.clone()]);
    let img = Image::open_snapshot(&env.rbd.ioctx, &sid.image, SNAP_NAME).expect("open snapshot");
    let mut buf = vec![0u8; 1 << 20];
    img.read_exact(0, &mut buf).expect("read snapshot");
    assert!(buf == pattern(7, 1 << 20), "snapshot data differs");
    drop(img);
    // The source keeps no snapshot of its own.
    assert!(env.user_snaps(&vol.image).is_empty());

    // Delete policy: the VolumeSnapshot's deletion removes the content and
    // the snapshot image.
    let cname = c.metadata.name.clone().unwrap();
    snaps::delete_snapshot(&env.client, &env.ns, "snap1").await;
    wait_content_gone(&env, &cname).await;
    eventually("snapshot image removed", WAIT, || async {
        let left = snapshot_images(&env);
        if left.is_empty() && env.trash().is_empty() {
            Ok(())
        } else {
            Err(format!("images {left:?}, trash {:?}", env.trash()))
        }
    })
    .await;
    assert_eq!(env.images(), vec![vol.image.clone()]);
    snaps::delete_class(&env.client, &sclass).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retain_policy_keeps_the_snapshot_image() {
    let (env, class) = setup("snapret").await;
    let _p = env.start_in_process();
    let vol = source(&env, &class, "src", 8).await;
    let sclass = snapshot_class(&env, "retain", "Retain", json!({})).await;
    snaps::create_snapshot(&env.client, &env.ns, "keep", &sclass, "src").await;
    let vs = snaps::wait_ready(&env.client, &env.ns, "keep", WAIT).await;
    let c = content(&env, &vs).await;
    let cname = c.metadata.name.clone().unwrap();
    let sid = SnapshotId::parse(c.data["status"]["snapshotHandle"].as_str().unwrap()).unwrap();

    snaps::delete_snapshot(&env.client, &env.ns, "keep").await;
    let vss = snaps::volume_snapshots(&env.client, &env.ns);
    eventually("VolumeSnapshot gone", WAIT, || async {
        match vss.get_opt("keep").await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(v) => Err(format!("finalizers {:?}", v.metadata.finalizers)),
        }
    })
    .await;
    // The content stays, and so does the image.
    let api = snaps::contents(&env.client);
    assert!(api.get_opt(&cname).await.unwrap().is_some());
    assert_eq!(snapshot_images(&env), vec![sid.image.clone()]);

    // Deleting the retained content lets it go and still keeps the image.
    api.delete(&cname, &DeleteParams::default()).await.unwrap();
    wait_content_gone(&env, &cname).await;
    assert_eq!(snapshot_images(&env), vec![sid.image.clone()]);
    assert!(env.images().contains(&vol.image));

    // Clean up by hand, as an administrator would.
    let cluster = support::ceph::cluster();
    rbdkit::volume::snapshot::delete_snapshot(
        &cluster,
        &rbdkit::volume::NoMetrics,
        &sid,
        &env.name,
    )
    .expect("delete retained snapshot");
    assert!(snapshot_images(&env).is_empty());
    snaps::delete_class(&env.client, &sclass).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_class_parameter_is_reported_and_nothing_is_made() {
    let (env, class) = setup("snapbad").await;
    let vol = {
        let _p = env.start_in_process();
        source(&env, &class, "src", 9).await
    };
    let sclass = snapshot_class(&env, "bad", "Delete", json!({"fooBar": "1"})).await;
    snaps::create_snapshot(&env.client, &env.ns, "bad", &sclass, "src").await;
    let vss = snaps::volume_snapshots(&env.client, &env.ns);
    // The order that lost the error: the snapshot-controller writes the
    // VolumeSnapshot's status before the provisioner reports on its
    // content, so only a content change can carry the error over.
    eventually("the VolumeSnapshot bound, with no error", WAIT, || async {
        let vs = vss.get("bad").await.map_err(|e| e.to_string())?;
        let st = &vs.data["status"];
        match st["boundVolumeSnapshotContentName"].as_str() {
            Some(_) if st["error"].is_null() => Ok(()),
            _ => Err(format!("status {st}")),
        }
    })
    .await;
    let _p = env.start_in_process();
    let msg = eventually("the VolumeSnapshot's status.error", WAIT, || async {
        let vs = vss.get("bad").await.map_err(|e| e.to_string())?;
        match vs.data["status"]["error"]["message"].as_str() {
            Some(m) if m.contains("fooBar") => Ok(m.to_owned()),
            _ => Err(format!("status {}", vs.data["status"])),
        }
    })
    .await;
    assert!(msg.contains("unknown snapshot parameter"), "{msg}");
    assert!(msg.contains(&sclass), "{msg}");
    let vs = vss.get("bad").await.unwrap();
    assert_ne!(vs.data["status"]["readyToUse"], json!(true));
    let c = content(&env, &vs).await;
    let cname = c.metadata.name.clone().unwrap();
    let events = eventually("a SnapshotCreationFailed event", WAIT, || async {
        let ev = snaps::events_about(&env.client, &env.ns, &cname).await;
        if ev
            .iter()
            .any(|e| e.starts_with("SnapshotCreationFailed") && e.contains("fooBar"))
        {
            Ok(ev)
        } else {
            Err(format!("{ev:?}"))
        }
    })
    .await;
    eprintln!("events: {events:?}");
    // Nothing in Ceph, and no finalizer of ours.
    assert_eq!(env.images(), vec![vol.image.clone()]);
    assert!(env.user_snaps(&vol.image).is_empty());
    assert!(!c
        .metadata
        .finalizers
        .clone()
        .unwrap_or_default()
        .contains(&SNAPSHOT_FINALIZER.to_owned()));
    // It can still be deleted.
    snaps::delete_snapshot(&env.client, &env.ns, "bad").await;
    wait_content_gone(&env, &cname).await;
    snaps::delete_class(&env.client, &sclass).await;
}

/// Waits until an image other than `source` shows in the namespace (a
/// snapshot being made), polling fast; returns the names seen.
async fn wait_snapshot_started(env: &Env, source: &str) -> Vec<String> {
    let ioctx = env.rbd.ioctx.clone();
    let source = source.to_owned();
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            let names = rbd::list_names(&ioctx).unwrap_or_default();
            if names.iter().any(|n| *n != source) {
                return names;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Vec::new()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_mid_snapshot_leaves_exactly_one_snapshot_and_no_leak() {
    let (env, class) = setup("snapkill").await;
    let vol = {
        let _p = env.start_in_process();
        source(&env, &class, "src", 10).await
    };
    let sclass = snapshot_class(&env, "kill", "Delete", json!({})).await;

    // Round 1: killed as soon as the snapshot's first image appears, then
    // restarted: one snapshot image, no temporary image or snapshot.
    let mut p = env.start_process("snapkill-1");
    snaps::create_snapshot(&env.client, &env.ns, "s1", &sclass, "src").await;
    let seen = wait_snapshot_started(&env, &vol.image).await;
    p.kill9();
    assert!(
        seen.len() > 1,
        "no snapshot image appeared:\n{}",
        p.log_tail()
    );
    eprintln!("round 1 killed with images {seen:?}");
    let p2 = env.start_process("snapkill-2");
    let vs = snaps::wait_ready(&env.client, &env.ns, "s1", WAIT).await;
    let c = content(&env, &vs).await;
    let sid = SnapshotId::parse(c.data["status"]["snapshotHandle"].as_str().unwrap()).unwrap();
    assert_eq!(snapshot_images(&env), vec![sid.image.clone()]);
    let mut want = vec![vol.image.clone(), sid.image.clone()];
    want.sort();
    let mut have = env.images();
    have.sort();
    assert_eq!(have, want, "a temporary image was left");
    assert!(env.user_snaps(&vol.image).is_empty());
    snaps::delete_snapshot(&env.client, &env.ns, "s1").await;
    wait_content_gone(&env, &c.metadata.name.clone().unwrap()).await;
    assert_eq!(env.images(), vec![vol.image.clone()]);
    drop(p2);

    // Round 2: killed mid-snapshot, the VolumeSnapshot deleted while the
    // provisioner is down; after a restart nothing is left.
    let mut p3 = env.start_process("snapkill-3");
    snaps::create_snapshot(&env.client, &env.ns, "s2", &sclass, "src").await;
    let seen = wait_snapshot_started(&env, &vol.image).await;
    p3.kill9();
    assert!(
        seen.len() > 1,
        "no snapshot image appeared:\n{}",
        p3.log_tail()
    );
    eprintln!("round 2 killed with images {seen:?}");
    let vss = snaps::volume_snapshots(&env.client, &env.ns);
    let cname = eventually("s2's content", WAIT, || async {
        let vs = vss.get("s2").await.map_err(|e| e.to_string())?;
        vs.data["status"]["boundVolumeSnapshotContentName"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("status {}", vs.data["status"]))
    })
    .await;
    snaps::delete_snapshot(&env.client, &env.ns, "s2").await;
    let _p4 = env.start_process("snapkill-4");
    wait_content_gone(&env, &cname).await;
    eventually("no snapshot image left", WAIT, || async {
        let images = env.images();
        if images == vec![vol.image.clone()] && env.trash().is_empty() {
            Ok(())
        } else {
            Err(format!("images {images:?}, trash {:?}", env.trash()))
        }
    })
    .await;
    assert!(env.user_snaps(&vol.image).is_empty());
    snaps::delete_class(&env.client, &sclass).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_snapshot_crds_the_provisioner_says_so_and_provisions() {
    // A control plane of its own, where the CRDs were never installed.
    let cp = ControlPlane::start_private();
    let mut env = Env::new_on(&cp, "snapnocrd").await;
    let class = env.storage_class("sc", json!({}), json!({})).await;
    let mut p = env.start_process("nocrd-1");
    env.claim("data", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_bound("data").await;
    eventually("the missing-CRD log line", WAIT, || async {
        let log = p.log_text();
        if log.contains("VolumeSnapshotContent CRD") && log.contains("is not installed") {
            Ok(())
        } else {
            Err(p.log_tail())
        }
    })
    .await;
    assert!(p.running(), "the provisioner exited:\n{}", p.log_tail());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_rbac_and_example_class_are_enough_for_snapshots() {
    let deploy = deploy_dir();
    let (env, class) = setup("snaprbac").await;
    for file in ["namespace.yaml", "rbac.yaml"] {
        let text = std::fs::read_to_string(deploy.join(file)).unwrap();
        for d in &parse_docs(file, &text) {
            apply(&env.client, d).await;
        }
    }
    // The example class, pointed at this test's driver, cluster and Secret.
    let text = std::fs::read_to_string(deploy.join("example/volumesnapshotclass.yaml")).unwrap();
    let mut example: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    assert_eq!(example["kind"], json!("VolumeSnapshotClass"));
    let sclass = format!("{}-example", env.ns);
    example["metadata"]["name"] = json!(sclass);
    example["driver"] = json!(env.name);
    let p = &mut example["parameters"];
    p["clusterID"] = json!(env.cluster_id);
    p["csi.storage.k8s.io/snapshotter-secret-name"] = json!(env.secret);
    p["csi.storage.k8s.io/snapshotter-secret-namespace"] = json!(env.ns);
    let obj: kube::api::DynamicObject = serde_json::from_value(example).unwrap();
    snaps::classes(&env.client)
        .create(&Default::default(), &obj)
        .await
        .expect("create the example class");

    // Run as the ServiceAccount of deploy/rbac.yaml.
    let kubeconfig = env.kubeconfig_as("system:serviceaccount:rbdkit:rbdkit-provisioner");
    let _p = env.start_in_process_with(&[
        ("--kubeconfig", kubeconfig.to_str().unwrap()),
        ("--leader-election-namespace", "rbdkit"),
    ]);
    let vol = source(&env, &class, "src", 11).await;
    snaps::create_snapshot(&env.client, &env.ns, "s", &sclass, "src").await;
    let vs = snaps::wait_ready(&env.client, &env.ns, "s", WAIT).await;
    let cname = content(&env, &vs).await.metadata.name.unwrap();
    assert_eq!(snapshot_images(&env).len(), 1);
    snaps::delete_snapshot(&env.client, &env.ns, "s").await;
    wait_content_gone(&env, &cname).await;
    assert_eq!(env.images(), vec![vol.image.clone()]);
    snaps::delete_class(&env.client, &sclass).await;
}
