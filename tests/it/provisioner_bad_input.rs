//! Bad input, table-driven, against a real control plane and a real Ceph
//! cluster: each case is a StorageClass and a claim that the provisioner
//! must refuse with an event naming the problem, creating nothing in Ceph
//! and showing no key anywhere (events, claims, its own log).
//!
//! One provisioner (a child process, so its whole log can be read) serves
//! every case; it runs as a user whose RBAC mirrors `deploy/rbac.yaml` but
//! may read only some Secrets, so a Secret it may not read is one case.
use crate::support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::Api;
use serde_json::{json, Value};

use rbdkit::rbd;

use support::ceph::{cluster, unique, TestCluster};
use support::provisioner::{eventually, from_json, http_get, stays, Env, WAIT};

/// One bad input.
struct Case {
    /// Claim (and class suffix) name.
    name: &'static str,
    /// StorageClass parameters over the usual ones (`null` removes one).
    params: Value,
    /// The storage request.
    size: &'static str,
    modes: &'static [&'static str],
    volume_mode: &'static str,
    /// Extra fields of the claim's spec.
    spec: Value,
    /// Words the ProvisioningFailed event must hold.
    words: &'static [&'static str],
}

const RWO: &[&str] = &["ReadWriteOnce"];

fn case(name: &'static str, params: Value, words: &'static [&'static str]) -> Case {
    Case {
        name,
        params,
        size: "8Mi",
        modes: RWO,
        volume_mode: "Filesystem",
        spec: json!({}),
        words,
    }
}

fn claim_case(
    name: &'static str,
    size: &'static str,
    modes: &'static [&'static str],
    volume_mode: &'static str,
    spec: Value,
    words: &'static [&'static str],
) -> Case {
    Case {
        name,
        params: json!({}),
        size,
        modes,
        volume_mode,
        spec,
        words,
    }
}

fn cases(quota_pool: &'static str) -> Vec<Case> {
    vec![
        case(
            "unknown",
            json!({"imagefeatures": "layering"}),
            &["imagefeatures", "unknown parameter"],
        ),
        case(
            "unknown-csi",
            json!({"clusterId": "x"}),
            &["clusterId", "unknown parameter"],
        ),
        case("empty-pool", json!({"pool": ""}), &["pool", "is empty"]),
        case(
            "empty-cluster",
            json!({"clusterID": " "}),
            &["clusterID", "is empty"],
        ),
        case("no-pool", json!({"pool": null}), &["pool", "is required"]),
        case(
            "deps-objmap",
            json!({"imageFeatures": "layering,object-map"}),
            &["imageFeatures", "exclusive-lock"],
        ),
        case(
            "deps-fastdiff",
            json!({"imageFeatures": "layering,exclusive-lock,fast-diff"}),
            &["imageFeatures", "object-map"],
        ),
        case(
            "bad-feature",
            json!({"imageFeatures": "layering,warp-drive"}),
            &["imageFeatures", "warp-drive"],
        ),
        case(
            "empty-features",
            json!({"imageFeatures": ""}),
            &["imageFeatures"],
        ),
        case(
            "objsize-3mi",
            json!({"objectSize": "3Mi"}),
            &["objectSize", "power of two"],
        ),
        case(
            "objsize-huge",
            json!({"objectSize": "128Mi"}),
            &["objectSize", "outside"],
        ),
        case(
            "stripe-no-count",
            json!({"stripeUnit": "64Ki"}),
            &["stripeCount", "missing", "stripeUnit"],
        ),
        case(
            "stripe-count-0",
            json!({"stripeUnit": "64Ki", "stripeCount": "0"}),
            &["stripeCount", "at least 1"],
        ),
        case(
            "stripe-unit-odd",
            json!({"stripeUnit": "3Ki", "stripeCount": "2"}),
            &["stripeUnit", "divide the object size"],
        ),
        case(
            "fstype",
            json!({"csi.storage.k8s.io/fstype": "ntfs"}),
            &["csi.storage.k8s.io/fstype", "ntfs", "not supported"],
        ),
        case(
            "format-1",
            json!({"imageFormat": "1"}),
            &["imageFormat", "only format"],
        ),
        case(
            "encrypted-file",
            json!({"encrypted": "true", "encryptionType": "file"}),
            &["encryptionType", "fscrypt", "not supported"],
        ),
        case(
            "encrypted-cipher",
            json!({"encrypted": "true", "encryptionCipher": "serpent"}),
            &["encryptionCipher", "serpent"],
        ),
        case(
            "thick",
            json!({"thickProvision": "true"}),
            &["thickProvision", "not supported"],
        ),
        case(
            "nbd",
            json!({"mounter": "rbd-nbd"}),
            &["mounter", "rbd-nbd", "not supported"],
        ),
        case(
            "map-options",
            json!({"mapOptions": "krbd:lock_on_read, queue_depth =1"}),
            &["mapOptions", "white space"],
        ),
        case(
            "journal",
            json!({"journalPool": "rbd"}),
            &["journalPool", "journaling"],
        ),
        case(
            "prefix-long",
            json!({"volumeNamePrefix": "p".repeat(65)}),
            &["volumeNamePrefix", "at most 64"],
        ),
        case(
            "no-secret-param",
            json!({"csi.storage.k8s.io/provisioner-secret-name": null,
                   "csi.storage.k8s.io/provisioner-secret-namespace": null}),
            &["provisioner-secret-name", "is required"],
        ),
        case(
            "secret-missing",
            json!({"csi.storage.k8s.io/provisioner-secret-name": "missing"}),
            &["Secret", "missing", "not found"],
        ),
        case(
            "secret-no-key",
            json!({"csi.storage.k8s.io/provisioner-secret-name": "no-key"}),
            &["Secret", "no-key", "userKey"],
        ),
        case(
            "secret-wrong-key",
            json!({"csi.storage.k8s.io/provisioner-secret-name": "wrong-key"}),
            &["cannot connect", "\"admin\""],
        ),
        case(
            "secret-forbidden",
            json!({"csi.storage.k8s.io/provisioner-secret-name": "hidden"}),
            &["Secret", "hidden", "Forbidden"],
        ),
        case(
            "cluster-unknown",
            json!({"clusterID": "no-such-cluster"}),
            &["clusterID", "no-such-cluster", "not in the clusters config"],
        ),
        case(
            "pool-missing",
            json!({"pool": "no-such-pool"}),
            &["no-such-pool", "not found"],
        ),
        Case {
            size: "128Mi",
            ..case(
                "over-quota",
                json!({"pool": quota_pool,
                       "csi.storage.k8s.io/provisioner-secret-name": "quota-user"}),
                Box::leak(Box::new(["quota", quota_pool, "134217728 bytes"])),
            )
        },
        claim_case(
            "size-fraction",
            "1500m",
            RWO,
            "Filesystem",
            json!({}),
            &["storage request", "1500m", "not a whole number of bytes"],
        ),
        // The API server stores any request above 2^63 - 1 bytes as exactly
        // that, which rounds up past it.
        claim_case(
            "size-2e63",
            "9Ei",
            RWO,
            "Filesystem",
            json!({}),
            &["storage request", "9223372036854775807", "2^63 - 1"],
        ),
        claim_case(
            "size-2e64",
            "16Ei",
            RWO,
            "Filesystem",
            json!({}),
            &["storage request", "9223372036854775807", "2^63 - 1"],
        ),
        claim_case(
            "limit-below",
            "1500k",
            RWO,
            "Filesystem",
            json!({"resources": {"requests": {"storage": "1500k"}, "limits": {"storage": "1500k"}}}),
            &["storage limit", "rounded up"],
        ),
        claim_case(
            "rwx-fs",
            "8Mi",
            &["ReadWriteMany"],
            "Filesystem",
            json!({}),
            &["ReadWriteMany", "volumeMode Block"],
        ),
        claim_case(
            "rox-empty",
            "8Mi",
            &["ReadOnlyMany"],
            "Block",
            json!({}),
            &["ReadOnlyMany", "data source"],
        ),
        claim_case(
            "ds-kind",
            "8Mi",
            RWO,
            "Filesystem",
            json!({"dataSourceRef": {"apiGroup": "example.com", "kind": "Widget", "name": "w"}}),
            &["Widget.example.com", "not supported"],
        ),
        claim_case(
            "ds-missing",
            "8Mi",
            RWO,
            "Filesystem",
            json!({"dataSource": {"kind": "PersistentVolumeClaim", "name": "nope"}}),
            &["source claim \"nope\"", "does not exist"],
        ),
        claim_case(
            "selector",
            "8Mi",
            RWO,
            "Filesystem",
            json!({"selector": {"matchLabels": {"disk": "fast"}}}),
            &["selector"],
        ),
    ]
}

/// Runs a mon command as admin, panicking with its status on failure.
fn mon(cmd: Value) {
    cluster()
        .mon_command(&cmd.to_string(), &[])
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
}

/// A fresh cephx key (valid format, known to no user).
fn stranger_key() -> String {
    let out = std::process::Command::new("ceph-authtool")
        .arg("--gen-print-key")
        .output()
        .expect("run ceph-authtool");
    assert!(out.status.success(), "ceph-authtool failed");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Everything in the test namespace and `default` that names `ns`: events
/// and claims, as JSON.
async fn api_text(env: &Env) -> String {
    let mut text = String::new();
    for ns in [env.ns.as_str(), "default"] {
        let events: Api<Event> = Api::namespaced(env.client.clone(), ns);
        for e in events.list(&ListParams::default()).await.unwrap().items {
            text.push_str(&serde_json::to_string(&e).unwrap());
            text.push('\n');
        }
    }
    for c in env
        .claims()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
    {
        text.push_str(&serde_json::to_string(&c).unwrap());
        text.push('\n');
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_gets_an_event_and_creates_nothing() {
    let t0 = Instant::now();
    let mut env = Env::new("badinput").await;
    let admin_key = TestCluster::get().admin_key();
    let wrong_key = stranger_key();

    // A pool with a small byte quota, holding the test's RADOS namespace.
    let quota_pool: &'static str = Box::leak(unique("quota").into_boxed_str());
    mon(json!({"prefix": "osd pool create", "pool": quota_pool, "pg_num": 8}));
    mon(json!({"prefix": "osd pool application enable", "pool": quota_pool, "app": "rbd"}));
    mon(
        json!({"prefix": "osd pool set-quota", "pool": quota_pool, "field": "max_bytes", "val": "67108864"}),
    );
    let quota_io = cluster().ioctx(quota_pool).expect("open quota pool");
    rbd::namespace_create(&quota_io, &env.rbd.name).expect("namespace in quota pool");
    let quota_ns = quota_io.with_namespace(&env.rbd.name).unwrap();
    // The provisioner's restricted user may not use that pool; a user of
    // this test's own may (the same profile on both pools).
    let quota_user = unique("rbdkit-test-quota");
    let quota_key = support::ceph::user_with_caps(
        &quota_user,
        &[
            "mon".into(),
            "profile rbd".into(),
            "osd".into(),
            format!(
                "profile rbd pool={}, profile rbd pool={quota_pool}",
                support::ceph::POOL
            ),
        ],
    );

    // Secrets besides the good one: no key, a key cephx does not know, and
    // a good key the provisioner may not read.
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.ns);
    for (name, data) in [
        ("no-key", json!({"userID": "admin"})),
        (
            "wrong-key",
            json!({"userID": "admin", "userKey": wrong_key}),
        ),
        ("hidden", json!({"userID": "admin", "userKey": admin_key})),
        (
            "quota-user",
            json!({"userID": quota_user, "userKey": quota_key}),
        ),
    ] {
        secrets
            .create(
                &PostParams::default(),
                &from_json(json!({"metadata": {"name": name}, "stringData": data})),
            )
            .await
            .expect("create secret");
    }

    // RBAC: deploy/rbac.yaml's rules, but Secrets by name, and Leases here.
    let user = format!("system:serviceaccount:{}:prov", env.ns);
    let role_name = format!("{}-prov", env.ns);
    let roles: Api<ClusterRole> = Api::all(env.client.clone());
    roles
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": role_name},
                "rules": [
                    {"apiGroups": [""], "resources": ["persistentvolumes"],
                     "verbs": ["get", "list", "watch", "create", "delete", "patch"]},
                    {"apiGroups": [""], "resources": ["persistentvolumeclaims"],
                     "verbs": ["get", "list", "watch", "patch"]},
                    {"apiGroups": [""], "resources": ["persistentvolumeclaims/status"],
                     "verbs": ["patch"]},
                    {"apiGroups": ["storage.k8s.io"], "resources": ["storageclasses"],
                     "verbs": ["get", "list", "watch"]},
                    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
                     "resourceNames": ["ceph-provisioner", "no-key", "wrong-key", "missing", "quota-user"]},
                    {"apiGroups": ["events.k8s.io"], "resources": ["events"],
                     "verbs": ["create", "patch"]},
                    {"apiGroups": ["snapshot.storage.k8s.io"],
                     "resources": ["volumesnapshots", "volumesnapshotcontents"], "verbs": ["get"]},
                    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                     "verbs": ["get", "create", "update"]},
                ],
            })),
        )
        .await
        .expect("create cluster role");
    let bindings: Api<ClusterRoleBinding> = Api::all(env.client.clone());
    bindings
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": role_name},
                "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}],
                "roleRef": {"kind": "ClusterRole", "name": role_name, "apiGroup": "rbac.authorization.k8s.io"},
            })),
        )
        .await
        .expect("create cluster role binding");

    // Classes and claims.
    let table = cases(quota_pool);
    for c in &table {
        let class = env.storage_class(c.name, c.params.clone(), json!({})).await;
        let mut spec = json!({
            "storageClassName": class,
            "accessModes": c.modes,
            "volumeMode": c.volume_mode,
            "resources": {"requests": {"storage": c.size}},
        });
        if let Value::Object(extra) = &c.spec {
            for (k, v) in extra {
                spec[k] = v.clone();
            }
        }
        let claim: PersistentVolumeClaim =
            from_json(json!({"metadata": {"name": c.name}, "spec": spec}));
        env.claims()
            .create(&PostParams::default(), &claim)
            .await
            .unwrap_or_else(|e| panic!("case {}: create claim: {e}", c.name));
    }

    // Size 0 never reaches a provisioner: the API server refuses it.
    let zero_class = env.storage_class("zero", json!({}), json!({})).await;
    let zero: PersistentVolumeClaim = from_json(json!({
        "metadata": {"name": "size-zero"},
        "spec": {"storageClassName": zero_class, "accessModes": RWO,
                 "resources": {"requests": {"storage": "0"}}},
    }));
    let refused = env
        .claims()
        .create(&PostParams::default(), &zero)
        .await
        .expect_err("a claim of size 0 is refused");
    assert!(
        refused.to_string().contains("must be greater than zero"),
        "{refused}"
    );

    // A claim whose class is deleted after the binder handed it to us,
    // before the provisioner gets to it.
    let gone_class = env.storage_class("gone", json!({}), json!({})).await;
    env.claim("class-gone", &gone_class, "8Mi", RWO, "Filesystem")
        .await;
    let claims = env.claims();
    eventually("the binder to hand class-gone to us", WAIT, || async {
        let c = claims.get("class-gone").await.map_err(|e| e.to_string())?;
        match c
            .metadata
            .annotations
            .unwrap_or_default()
            .get("volume.kubernetes.io/storage-provisioner")
        {
            Some(p) if *p == env.name => Ok(()),
            other => Err(format!("annotation {other:?}")),
        }
    })
    .await;
    let sc: Api<StorageClass> = Api::all(env.client.clone());
    sc.delete(&gone_class, &DeleteParams::default())
        .await
        .unwrap();

    // A claim name at the maximum length, and the longest prefix: this one
    // must work (the image name is the prefix and the PV name).
    let long_name: &'static str =
        Box::leak(format!("long-{}", "n".repeat(253 - 5)).into_boxed_str());
    let prefix = "q".repeat(64);
    let long_class = env
        .storage_class("long", json!({"volumeNamePrefix": prefix}), json!({}))
        .await;
    env.claim(long_name, &long_class, "8Mi", RWO, "Filesystem")
        .await;

    let kubeconfig = env.kubeconfig_as(&user);
    let mut provisioner = env.start_process_with(
        "badinput",
        &[("--kubeconfig", kubeconfig.to_str().unwrap())],
    );
    let addr = provisioner.http_addr().await;

    let (_, pv) = env.wait_bound(long_name).await;
    let pv_name = pv.metadata.name.clone().unwrap();
    let long_image = format!("{prefix}{pv_name}");
    assert_eq!(env.images(), vec![long_image.clone()]);
    let image = rbd::Image::open_read_only(&env.rbd.ioctx, &long_image).unwrap();
    let owner = rbdkit::volume::ops::owner_metadata(&image).unwrap();
    assert_eq!(owner["rbdkit.pvc.name"], long_name);
    drop(image);

    // All cases at once, so one run reports every case that is wrong.
    let mut checked = eventually(
        "a named ProvisioningFailed event per case",
        WAIT,
        || async {
            let mut wrong = Vec::new();
            for c in &table {
                let events = env.events(c.name).await;
                let found = events.iter().any(|e| {
                    e.reason.as_deref() == Some("ProvisioningFailed")
                        && c.words
                            .iter()
                            .all(|w| e.note.as_deref().unwrap_or("").contains(w))
                });
                if !found {
                    wrong.push(format!(
                        "{} (want {:?}): {:?}",
                        c.name,
                        c.words,
                        env.event_summary(c.name).await
                    ));
                }
            }
            if wrong.is_empty() {
                Ok(table.len())
            } else {
                Err(wrong.join("\n"))
            }
        },
    )
    .await;
    let gone_words = format!("StorageClass {gone_class:?} not found");
    env.wait_event("class-gone", "ProvisioningFailed", &[&gone_words])
        .await;
    checked += 1;
    eprintln!(
        "{checked} bad claims refused with a named reason (+ size 0 refused by the API server, + 1 maximum-length claim provisioned), {:?} since start",
        t0.elapsed()
    );
    assert!(checked >= 25, "only {checked} cases");

    // Nothing was made in Ceph for any of them (it keeps retrying).
    stays(
        "no image, PV or trash entry for a bad claim",
        Duration::from_secs(3),
        || async {
            let ours: Vec<String> = env
                .our_pvs()
                .await?
                .into_iter()
                .filter_map(|p| p.metadata.name)
                .collect();
            let quota_images = rbd::list_names(&quota_ns).map_err(|e| e.to_string())?;
            let trash = rbd::trash_list(&env.rbd.ioctx).map_err(|e| e.to_string())?;
            if env.images() == vec![long_image.clone()]
                && ours == vec![pv_name.clone()]
                && quota_images.is_empty()
                && trash.is_empty()
            {
                Ok(())
            } else {
                Err(format!(
                    "images {:?}, quota pool images {quota_images:?}, PVs {ours:?}, trash {}",
                    env.images(),
                    trash.len()
                ))
            }
        },
    )
    .await;

    // No key anywhere: events, claims, metrics, the provisioner's log.
    let (code, metrics) = http_get(addr, "/metrics").await;
    assert_eq!(code, 200);
    let text = api_text(&env).await;
    let log = provisioner.log_text();
    assert!(log.contains("ProvisioningFailed") || log.contains("will retry"));
    let mut hits = 0;
    for key in [&admin_key, &wrong_key] {
        for (what, haystack) in [("API objects", &text), ("metrics", &metrics), ("log", &log)] {
            let n = haystack.matches(key.as_str()).count();
            if n > 0 {
                eprintln!("key found {n} times in {what}");
            }
            hits += n;
        }
    }
    eprintln!(
        "key grep: {} bytes of events/claims, {} of metrics, {} of log: {hits} hits",
        text.len(),
        metrics.len(),
        log.len()
    );
    assert_eq!(hits, 0);

    provisioner.terminate();
    drop(quota_ns);
    drop(quota_io);
    let _ = bindings.delete(&role_name, &DeleteParams::default()).await;
    let _ = roles.delete(&role_name, &DeleteParams::default()).await;
    mon(json!({"prefix": "auth del", "entity": format!("client.{quota_user}")}));
    mon(
        json!({"prefix": "osd pool delete", "pool": quota_pool, "pool2": quota_pool,
               "yes_i_really_really_mean_it": true}),
    );
    eprintln!("total {:?}", t0.elapsed());
}
