//! A VolumeGroupSnapshot on the real node, through the real
//! snapshot-controller (group gate on, the group snapshot CRDs installed)
//! and rbdkit's provisioner in its csi-snapshotter group role: a pod writes
//! a sequence to two claims (each number to the first, synced, then to the
//! second, synced) while the group snapshot is taken; both members are
//! restored into claims and read by a pod, and the two sequences are those
//! of one instant: the first has the second's numbers and at most one more.
//! Deleting the group snapshot removes the members. The provisioner runs
//! as the ServiceAccount of `deploy/rbac.yaml`, and the class is
//! `deploy/example/volumegroupsnapshotclass.yaml`, so both are enough.
//! Also: a bad class parameter is reported by name and nothing is made.
use crate::support;

use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use serde_json::json;

use rbdkit::volume::{GroupSnapshotId, SnapshotId, VolumeId};
use support::k8s::ControlPlane;
use support::manifests::{apply, deploy_dir, parse_docs};
use support::node::{
    busybox_pod, create_pod, delete_pod, pod_logs, prepare_namespace, wait_phase, Node, NodePlugin,
    POD_WAIT,
};
use support::provisioner::{eventually, from_json, Env, WAIT};
use support::snapshots::{events_about, volume_snapshots, SnapshotController};

const GROUP: &str = "groupsnapshot.storage.k8s.io";

fn group_api(kind: &str) -> ApiResource {
    let plural = format!("{}s", kind.to_lowercase()).replace("classs", "classes");
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", kind), &plural)
}

/// Numbers 0.. written to /a/seq then /b/seq, each synced before the next
/// write; `wrote N` every 50.
const WRITER: &str = "i=0; while [ $i -lt 1000000 ]; do \
    echo $i >> /a/seq && sync -f /a/seq || { echo WRITE-FAILED a $i; exit 1; }; \
    echo $i >> /b/seq && sync -f /b/seq || { echo WRITE-FAILED b $i; exit 1; }; \
    i=$((i+1)); [ $((i % 50)) -eq 0 ] && echo wrote $i; done";

/// Checks each file holds 0..n-1 in order and prints `COUNT <file> <n>`.
const READER: &str = "for f in /a/seq /b/seq; do n=0; \
    while read x; do [ \"$x\" = \"$n\" ] || { echo BAD $f $n $x; exit 1; }; n=$((n+1)); done < $f; \
    echo COUNT $f $n; done";

async fn progress(client: &kube::Client, ns: &str, pod: &str, at: u64) -> u64 {
    eventually(&format!("the writer past {at}"), WAIT, || async {
        let log = pod_logs(client, ns, pod).await;
        let last = log
            .lines()
            .filter_map(|l| l.strip_prefix("wrote ")?.parse::<u64>().ok())
            .max();
        match last {
            Some(n) if n >= at => Ok(n),
            _ if log.contains("WRITE-FAILED") => Err(format!("a write failed: {log}")),
            _ => Err(format!("log: {log}")),
        }
    })
    .await
}

fn two_volumes(a: &str, b: &str) -> (serde_json::Value, serde_json::Value) {
    (
        json!([
            {"name": "a", "persistentVolumeClaim": {"claimName": a}},
            {"name": "b", "persistentVolumeClaim": {"claimName": b}},
        ]),
        json!([
            {"name": "a", "mountPath": "/a"},
            {"name": "b", "mountPath": "/b"},
        ]),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_snapshot_under_writes_restores_both_claims_at_one_instant() {
    let node = Node::shared();
    SnapshotController::shared(ControlPlane::shared()).await;
    let mut env = Env::new("ngrp").await;
    prepare_namespace(&env.client, &env.ns).await;
    let deploy = deploy_dir();
    for file in ["namespace.yaml", "rbac.yaml"] {
        let text = std::fs::read_to_string(deploy.join(file)).unwrap();
        for d in &parse_docs(file, &text) {
            apply(&env.client, d).await;
        }
    }
    let kubeconfig = env.kubeconfig_as("system:serviceaccount:rbdkit:rbdkit-provisioner");
    let provisioner = env.start_in_process_with(&[
        ("--kubeconfig", kubeconfig.to_str().unwrap()),
        ("--leader-election-namespace", "rbdkit"),
    ]);
    let plugin = NodePlugin::start(node, &env.client, &env.name, &env.config_path()).await;
    let class = env
        .storage_class(
            "fs",
            json!({"csi.storage.k8s.io/fstype": "ext4"}),
            json!({}),
        )
        .await;
    let app = format!("{}-grp", env.ns);
    let mut handles = Vec::new();
    for c in ["db", "log"] {
        env.claim(c, &class, "32Mi", &["ReadWriteOnce"], "Filesystem")
            .await;
        env.claims()
            .patch(
                c,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"app": app}}})),
            )
            .await
            .unwrap();
    }
    for c in ["db", "log"] {
        let (_, pv) = env.wait_bound(c).await;
        handles.push(pv.spec.unwrap().csi.unwrap().volume_handle);
    }

    let (volumes, mounts) = two_volumes("db", "log");
    create_pod(
        &env.client,
        &env.ns,
        busybox_pod(node, "writer", WRITER, volumes, mounts),
    )
    .await;
    wait_phase(node, &env.client, &env.ns, "writer", &["Running"], POD_WAIT).await;
    progress(&env.client, &env.ns, "writer", 100).await;

    // The example class, pointed at this test's driver, cluster, pool and
    // Secret; then the group snapshot, as a user writes it.
    let client = env.client.clone();
    let classes: Api<DynamicObject> =
        Api::all_with(client.clone(), &group_api("VolumeGroupSnapshotClass"));
    let class_name = format!("{}-group", env.ns);
    let file = "example/volumegroupsnapshotclass.yaml";
    let mut example: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(deploy.join(file)).unwrap()).unwrap();
    assert_eq!(example["apiVersion"], json!(format!("{GROUP}/v1")));
    example["metadata"]["name"] = json!(class_name);
    example["driver"] = json!(env.name);
    let p = &mut example["parameters"];
    p["clusterID"] = json!(env.cluster_id);
    p["pool"] = json!(support::ceph::POOL);
    p["csi.storage.k8s.io/group-snapshotter-secret-name"] = json!(env.secret);
    p["csi.storage.k8s.io/group-snapshotter-secret-namespace"] = json!(env.ns);
    classes
        .create(&PostParams::default(), &from_json(example))
        .await
        .expect("create the example VolumeGroupSnapshotClass");
    let vgs_api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &env.ns, &group_api("VolumeGroupSnapshot"));
    vgs_api
        .create(
            &PostParams::default(),
            &from_json(json!({
                "apiVersion": format!("{GROUP}/v1"),
                "kind": "VolumeGroupSnapshot",
                "metadata": {"name": "both"},
                "spec": {
                    "volumeGroupSnapshotClassName": class_name,
                    "source": {"selector": {"matchLabels": {"app": app}}},
                },
            })),
        )
        .await
        .expect("create VolumeGroupSnapshot");
    let vgs = eventually("the VolumeGroupSnapshot ready", WAIT, || async {
        let v = vgs_api.get("both").await.map_err(|e| e.to_string())?;
        if v.data["status"]["readyToUse"] == json!(true) {
            Ok(v)
        } else {
            Err(format!(
                "status {}; events {:?}",
                v.data["status"],
                events_about(&client, &env.ns, "both").await
            ))
        }
    })
    .await;
    let ready_at = progress(&env.client, &env.ns, "writer", 0).await;

    // The content's status, as csi-snapshotter writes it.
    let content_name = vgs.data["status"]["boundVolumeGroupSnapshotContentName"]
        .as_str()
        .expect("bound content")
        .to_owned();
    let contents: Api<DynamicObject> =
        Api::all_with(client.clone(), &group_api("VolumeGroupSnapshotContent"));
    let content = contents.get(&content_name).await.unwrap();
    let status = &content.data["status"];
    let gid =
        GroupSnapshotId::parse(status["volumeGroupSnapshotHandle"].as_str().unwrap()).unwrap();
    assert_eq!(status["readyToUse"], true);
    assert!(
        status["creationTime"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{status}"
    );
    let list = status["volumeSnapshotInfoList"].as_array().unwrap();
    let mut listed: Vec<String> = list
        .iter()
        .map(|m| m["volumeHandle"].as_str().unwrap().to_owned())
        .collect();
    listed.sort();
    let mut want = handles.clone();
    want.sort();
    assert_eq!(listed, want);
    for m in list {
        let sid = SnapshotId::parse(m["snapshotHandle"].as_str().unwrap()).unwrap();
        let src = VolumeId::parse(m["volumeHandle"].as_str().unwrap()).unwrap();
        assert_eq!(sid, gid.member(&src, "rbdkit"));
        assert_eq!(m["readyToUse"], true);
        assert!(m["creationTime"].as_i64().unwrap() > 0);
        assert_eq!(m["restoreSize"], 32 << 20);
    }
    assert!(
        content
            .metadata
            .finalizers
            .clone()
            .unwrap_or_default()
            .iter()
            .any(|f| f == "rbdkit.io/group-snapshot-protection"),
        "{:?}",
        content.metadata.finalizers
    );

    // The snapshot-controller made one VolumeSnapshot per member from it.
    let snaps = volume_snapshots(&client, &env.ns);
    let members = eventually("two member VolumeSnapshots ready", WAIT, || async {
        let l = snaps
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let m: Vec<(String, String)> = l
            .items
            .iter()
            .filter(|s| s.data["status"]["readyToUse"] == json!(true))
            .map(|s| {
                (
                    s.data["spec"]["source"]["persistentVolumeClaimName"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    s.metadata.name.clone().unwrap_or_default(),
                )
            })
            .collect();
        if m.len() == 2 {
            Ok(m)
        } else {
            Err(format!(
                "{:?}",
                l.items
                    .iter()
                    .map(|s| (&s.metadata.name, &s.data["status"]))
                    .collect::<Vec<_>>()
            ))
        }
    })
    .await;
    let member_of = |claim: &str| {
        members
            .iter()
            .find(|(c, _)| c == claim)
            .map(|(_, s)| s.clone())
            .unwrap_or_else(|| panic!("no member for {claim}: {members:?}"))
    };

    // The writer went on after the instant; then it stops.
    progress(&env.client, &env.ns, "writer", ready_at + 100).await;
    delete_pod(node, &env.client, &env.ns, "writer").await;

    // One member restored into a claim, then the other.
    for (claim, source) in [("db-then", member_of("db")), ("log-then", member_of("log"))] {
        env.claims()
            .create(
                &PostParams::default(),
                &from_json(json!({
                    "metadata": {"name": claim},
                    "spec": {
                        "storageClassName": class,
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "32Mi"}},
                        "dataSource": {
                            "apiGroup": "snapshot.storage.k8s.io",
                            "kind": "VolumeSnapshot",
                            "name": source,
                        },
                    },
                })),
            )
            .await
            .unwrap();
        env.wait_bound(claim).await;
    }
    let (volumes, mounts) = two_volumes("db-then", "log-then");
    create_pod(
        &env.client,
        &env.ns,
        busybox_pod(node, "reader", READER, volumes, mounts),
    )
    .await;
    wait_phase(
        node,
        &env.client,
        &env.ns,
        "reader",
        &["Succeeded"],
        POD_WAIT,
    )
    .await;
    let log = pod_logs(&env.client, &env.ns, "reader").await;
    let count = |f: &str| -> u64 {
        log.lines()
            .find_map(|l| l.strip_prefix(&format!("COUNT {f} "))?.parse().ok())
            .unwrap_or_else(|| panic!("no count of {f}: {log}"))
    };
    let (a, b) = (count("/a/seq"), count("/b/seq"));
    eprintln!("restored: /a/seq {a} numbers, /b/seq {b}; {ready_at} written when the group snapshot was ready");
    assert!(
        b >= 100,
        "the snapshot holds the writes made before it: {log}"
    );
    assert!(
        b <= a && a <= b + 1,
        "not one instant: /a/seq has {a} numbers, /b/seq {b}"
    );
    assert!(
        a < ready_at + 100,
        "the restores are of the instant, not of the end: {a}"
    );
    delete_pod(node, &env.client, &env.ns, "reader").await;

    // Deleting the group snapshot removes its members (images and objects);
    // the restores keep their data.
    vgs_api
        .delete("both", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the group snapshot, its content and members gone", WAIT, || async {
        let vgs_left = vgs_api.get_opt("both").await.map_err(|e| e.to_string())?;
        let content_left = contents
            .get_opt(&content_name)
            .await
            .map_err(|e| e.to_string())?;
        let members_left = snaps
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .len();
        let member_images: Vec<String> = env
            .images()
            .into_iter()
            .filter(|i| i.starts_with(&gid.name))
            .collect();
        if vgs_left.is_none() && content_left.is_none() && members_left == 0 && member_images.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "group snapshot {}, content {}, {members_left} member VolumeSnapshots, member images {member_images:?}; events {:?}",
                vgs_left.is_some(),
                content_left.map(|c| c.data["status"].clone()).unwrap_or_default(),
                events_about(&client, "default", &content_name).await
            ))
        }
    })
    .await;

    for c in ["db-then", "log-then", "db", "log"] {
        env.delete_claim(c).await;
    }
    eventually("every image and the trash empty", WAIT, || async {
        let (i, t) = (env.images(), env.trash());
        if i.is_empty() && t.is_empty() {
            Ok(())
        } else {
            Err(format!("images {i:?}, trash {t:?}"))
        }
    })
    .await;
    let _ = classes.delete(&class_name, &DeleteParams::default()).await;
    provisioner.stop().await;
    drop(plugin);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_group_class_is_reported_by_name_and_nothing_is_made() {
    SnapshotController::shared(ControlPlane::shared()).await;
    let mut env = Env::new("grpbad").await;
    let provisioner = env.start_in_process();
    let class = env.storage_class("bad", json!({}), json!({})).await;
    let app = format!("{}-bad", env.ns);
    for c in ["one", "two"] {
        env.claim(c, &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
            .await;
        env.claims()
            .patch(
                c,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"app": app}}})),
            )
            .await
            .unwrap();
        env.wait_bound(c).await;
    }
    let volumes = env.images();
    let client = env.client.clone();
    let classes: Api<DynamicObject> =
        Api::all_with(client.clone(), &group_api("VolumeGroupSnapshotClass"));
    let class_name = format!("{}-group", env.ns);
    classes
        .create(
            &PostParams::default(),
            &from_json(json!({
                "apiVersion": format!("{GROUP}/v1"),
                "kind": "VolumeGroupSnapshotClass",
                "metadata": {"name": class_name},
                "driver": env.name,
                "deletionPolicy": "Delete",
                "parameters": {
                    "bogusParameter": "x",
                    "csi.storage.k8s.io/group-snapshotter-secret-name": env.secret,
                    "csi.storage.k8s.io/group-snapshotter-secret-namespace": env.ns,
                },
            })),
        )
        .await
        .unwrap();
    let vgs_api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &env.ns, &group_api("VolumeGroupSnapshot"));
    vgs_api
        .create(
            &PostParams::default(),
            &from_json(json!({
                "apiVersion": format!("{GROUP}/v1"),
                "kind": "VolumeGroupSnapshot",
                "metadata": {"name": "bad"},
                "spec": {
                    "volumeGroupSnapshotClassName": class_name,
                    "source": {"selector": {"matchLabels": {"app": app}}},
                },
            })),
        )
        .await
        .unwrap();
    // The content's status and an event name the parameter; the user's
    // object carries the error too.
    let contents: Api<DynamicObject> =
        Api::all_with(client.clone(), &group_api("VolumeGroupSnapshotContent"));
    eventually("the error on the VolumeGroupSnapshot", WAIT, || async {
        let v = vgs_api.get("bad").await.map_err(|e| e.to_string())?;
        let content = v.data["status"]["boundVolumeGroupSnapshotContentName"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let c = match content.as_str() {
            "" => None,
            name => contents.get_opt(name).await.map_err(|e| e.to_string())?,
        };
        let content_error = c
            .as_ref()
            .and_then(|c| c.data["status"]["error"]["message"].as_str())
            .unwrap_or_default()
            .to_owned();
        let vgs_error = v.data["status"]["error"]["message"]
            .as_str()
            .unwrap_or_default();
        let events = events_about(&client, "default", &content).await;
        let evented = events.iter().any(|e| e.contains("bogusParameter"));
        if content_error.contains("bogusParameter")
            && vgs_error.contains("bogusParameter")
            && evented
        {
            Ok(())
        } else {
            Err(format!(
                "content error {content_error:?}, group snapshot status {}, events {events:?}",
                v.data["status"]
            ))
        }
    })
    .await;
    assert_eq!(env.images(), volumes, "nothing is made for a bad class");

    vgs_api
        .delete("bad", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the group snapshot and its content gone", WAIT, || async {
        let left = vgs_api.get_opt("bad").await.map_err(|e| e.to_string())?;
        let contents_left = contents
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .filter(|c| c.data["spec"]["driver"] == json!(env.name))
            .count();
        match (left, contents_left) {
            (None, 0) => Ok(()),
            (l, n) => Err(format!("group snapshot left {}, {n} contents", l.is_some())),
        }
    })
    .await;
    assert_eq!(env.images(), volumes);
    for c in ["one", "two"] {
        env.delete_claim(c).await;
    }
    let _ = classes.delete(&class_name, &DeleteParams::default()).await;
    provisioner.stop().await;
}
