//! End-to-end tests of the provisioner against a real control plane (etcd,
//! kube-apiserver, kube-controller-manager with the PV binder) and a real
//! Ceph cluster. Each test has its own namespace, StorageClasses,
//! provisioner name and RADOS namespace, so they run in parallel.
use crate::support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use serde_json::json;

use rbdkit::provisioner::pv::{PROVISIONED_BY, PV_FINALIZER};
use rbdkit::rbd::{self, Features, Image};
use rbdkit::volume::quantity::MIB;
use rbdkit::volume::VolumeId;

use support::provisioner::{claim_name, eventually, http_get, stays, storage, Env, WAIT};

fn image_size(env: &Env, name: &str) -> u64 {
    Image::open_read_only(&env.rbd.ioctx, name)
        .and_then(|i| i.size())
        .unwrap_or_else(|e| panic!("image {name}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisions_a_claim_and_deletes_it_with_its_image() {
    let mut env = Env::new("prov").await;
    let class = env
        .storage_class("fast", json!({}), json!({"mountOptions": ["discard"]}))
        .await;
    let provisioner = env.start_in_process();

    let t0 = Instant::now();
    // 15 MB (decimal) is rounded up to 15 MiB.
    env.claim("data", &class, "15M", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (claim, pv) = env.wait_bound("data").await;
    eprintln!("PVC create -> Bound took {:?}", t0.elapsed());

    let pv_name = pv.metadata.name.clone().unwrap();
    assert_eq!(
        pv_name,
        format!("pvc-{}", claim.metadata.uid.clone().unwrap())
    );
    assert_eq!(
        pv.metadata.annotations.as_ref().unwrap()[PROVISIONED_BY],
        env.name
    );
    assert!(pv
        .metadata
        .finalizers
        .as_ref()
        .unwrap()
        .contains(&PV_FINALIZER.to_owned()));
    let spec = pv.spec.clone().unwrap();
    assert_eq!(storage(&spec.capacity), "15Mi");
    assert_eq!(spec.access_modes, Some(vec!["ReadWriteOnce".to_owned()]));
    assert_eq!(spec.volume_mode.as_deref(), Some("Filesystem"));
    assert_eq!(
        spec.persistent_volume_reclaim_policy.as_deref(),
        Some("Delete")
    );
    assert_eq!(spec.mount_options, Some(vec!["discard".to_owned()]));
    assert_eq!(spec.storage_class_name.as_deref(), Some(class.as_str()));
    let csi = spec.csi.unwrap();
    assert_eq!(csi.driver, env.name);
    assert_eq!(csi.fs_type.as_deref(), Some("ext4"));
    let vol = VolumeId::parse(&csi.volume_handle).unwrap();
    assert_eq!(vol.cluster_id, env.cluster_id);
    assert_eq!(vol.pool, "rbd");
    assert_eq!(vol.rados_namespace, env.rbd.name);
    assert_eq!(vol.image, pv_name);
    assert_eq!(
        csi.node_stage_secret_ref.unwrap().name.as_deref(),
        Some("ceph-node")
    );
    assert_eq!(
        csi.controller_expand_secret_ref.unwrap().name.as_deref(),
        Some("ceph-provisioner")
    );
    // No key material anywhere in the PV.
    let text = serde_json::to_string(&pv).unwrap();
    assert!(!text.contains(&support::ceph::TestCluster::get().admin_key()));

    // The image: size, features, owner.
    assert_eq!(env.images(), vec![pv_name.clone()]);
    let image = Image::open_read_only(&env.rbd.ioctx, &pv_name).unwrap();
    assert_eq!(image.size().unwrap(), 15 * MIB);
    let features = image.features().unwrap();
    assert!(
        features.contains(Features::LAYERING | Features::EXCLUSIVE_LOCK),
        "{features}"
    );
    assert!(!features.contains(Features::OBJECT_MAP), "{features}");
    let owner = rbdkit::volume::ops::owner_metadata(&image).unwrap();
    assert_eq!(owner["rbdkit.provisioner"], env.name);
    assert_eq!(owner["rbdkit.pv"], pv_name);
    assert_eq!(owner["rbdkit.pvc.namespace"], env.ns);
    assert_eq!(owner["rbdkit.pvc.name"], "data");
    assert_eq!(owner["rbdkit.cluster"], env.cluster_id);
    drop(image);
    env.wait_event("data", "ProvisioningSucceeded", &[&pv_name])
        .await;
    // The claim loses the provisioning finalizer (just after that event).
    eventually("the provisioning finalizer to go", WAIT, || async {
        let claim = env.claims().get("data").await.map_err(|e| e.to_string())?;
        let f = claim.metadata.finalizers.unwrap_or_default();
        if f.iter().any(|f| f.starts_with("rbdkit.io/")) {
            Err(format!("finalizers {f:?}"))
        } else {
            Ok(())
        }
    })
    .await;

    // Delete: PV and image go, even with the StorageClass gone (all that
    // is needed is on the PV and in its Secret).
    let classes: Api<k8s_openapi::api::storage::v1::StorageClass> = Api::all(env.client.clone());
    classes.delete(&class, &Default::default()).await.unwrap();
    let t1 = Instant::now();
    env.delete_claim("data").await;
    env.wait_gone(&env.pvs(), &pv_name).await;
    eprintln!("PVC delete -> PV gone took {:?}", t1.elapsed());
    assert!(env.images().is_empty(), "images left: {:?}", env.images());
    assert!(rbd::trash_list(&env.rbd.ioctx).unwrap().is_empty());
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_pv_of_the_class_is_left_to_the_binder_and_others_are_taken_early() {
    let mut env = Env::new("early").await;
    let class = env.storage_class("early", json!({}), json!({})).await;
    // A free PV of our class, made by hand: the binder must get to bind
    // the first claim to it, so rbdkit may not provision that claim.
    let static_pv = format!("{}-static", env.ns);
    env.pvs()
        .create(
            &Default::default(),
            &support::provisioner::from_json(json!({
                "metadata": {"name": static_pv},
                "spec": {
                    "capacity": {"storage": "20Mi"},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": class,
                    "csi": {"driver": "static.example", "volumeHandle": static_pv},
                },
            })),
        )
        .await
        .unwrap();
    eventually("the hand-made PV Available", WAIT, || async {
        let pv = env.pvs().get(&static_pv).await.map_err(|e| e.to_string())?;
        match pv.status.and_then(|s| s.phase).as_deref() {
            Some("Available") => Ok(()),
            p => Err(format!("phase {p:?}")),
        }
    })
    .await;
    let provisioner = env.start_in_process();

    env.claim("first", &class, "10Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound("first").await;
    assert_eq!(pv.metadata.name.as_deref(), Some(static_pv.as_str()));
    assert!(env.images().is_empty(), "images: {:?}", env.images());

    // With no free PV left, the next claim is ours from the start; it
    // carries the binder's handover mark with our name either way.
    env.claim("second", &class, "10Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (claim, pv) = env.wait_bound("second").await;
    let uid = claim.metadata.uid.clone().unwrap();
    assert_eq!(pv.metadata.name, Some(format!("pvc-{uid}")));
    assert_eq!(
        claim.metadata.annotations.unwrap()["volume.kubernetes.io/storage-provisioner"],
        env.name
    );
    assert_eq!(env.images(), vec![format!("pvc-{uid}")]);

    env.delete_claim("second").await;
    env.wait_gone(&env.pvs(), &format!("pvc-{uid}")).await;
    env.delete_claim("first").await;
    env.pvs()
        .delete(&static_pv, &Default::default())
        .await
        .unwrap();
    assert!(env.images().is_empty(), "images left: {:?}", env.images());
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retain_keeps_the_image_and_lets_go_of_the_pv() {
    let mut env = Env::new("retain").await;
    let class = env
        .storage_class("keep", json!({}), json!({"reclaimPolicy": "Retain"}))
        .await;
    let provisioner = env.start_in_process();
    env.claim("data", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound("data").await;
    let pv_name = pv.metadata.name.clone().unwrap();
    assert_eq!(
        pv.spec
            .as_ref()
            .unwrap()
            .persistent_volume_reclaim_policy
            .as_deref(),
        Some("Retain")
    );
    env.delete_claim("data").await;
    let pvs = env.pvs();
    eventually("PV released without our finalizer", WAIT, || async {
        let pv = pvs.get(&pv_name).await.map_err(|e| e.to_string())?;
        let phase = pv.status.as_ref().and_then(|s| s.phase.clone());
        let fins = pv.metadata.finalizers.clone().unwrap_or_default();
        if phase.as_deref() == Some("Released") && !fins.iter().any(|f| f == PV_FINALIZER) {
            Ok(())
        } else {
            Err(format!("phase {phase:?}, finalizers {fins:?}"))
        }
    })
    .await;
    assert_eq!(env.images(), vec![pv_name.clone()]);
    // Deleting the PV now leaves the image alone.
    pvs.delete(&pv_name, &Default::default()).await.unwrap();
    env.wait_gone(&pvs, &pv_name).await;
    stays(
        "the retained image to stay",
        Duration::from_secs(3),
        || async {
            if env.images() == vec![pv_name.clone()] {
                Ok(())
            } else {
                Err(format!("images: {:?}", env.images()))
            }
        },
    )
    .await;
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expansion_grows_the_image_and_the_pv() {
    let mut env = Env::new("expand").await;
    let class = env
        .storage_class("grow", json!({}), json!({"allowVolumeExpansion": true}))
        .await;
    let provisioner = env.start_in_process();
    env.claim("fs", &class, "10Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.claim("blk", &class, "10Mi", &["ReadWriteOnce"], "Block")
        .await;
    let (_, fs_pv) = env.wait_bound("fs").await;
    let (_, blk_pv) = env.wait_bound("blk").await;
    let fs_pv = fs_pv.metadata.name.unwrap();
    let blk_pv = blk_pv.metadata.name.unwrap();

    env.resize_claim("fs", "20Mi").await;
    env.resize_claim("blk", "30Mi").await;
    let pvs = env.pvs();
    let claims = env.claims();
    for (pv, want) in [(&fs_pv, "20Mi"), (&blk_pv, "30Mi")] {
        eventually(&format!("PV {pv} at {want}"), WAIT, || async {
            let p = pvs.get(pv).await.map_err(|e| e.to_string())?;
            let cap = storage(&p.spec.as_ref().unwrap().capacity);
            if cap == want {
                Ok(())
            } else {
                Err(format!("capacity {cap}"))
            }
        })
        .await;
    }
    assert_eq!(image_size(&env, &fs_pv), 20 * MIB);
    assert_eq!(image_size(&env, &blk_pv), 30 * MIB);

    // Both wait for the node: the filesystem to grow, and for Block the
    // device (the loop device of rbdkit-fuse grows only when kubelet calls
    // NodeExpandVolume).
    for (claim, want) in [("fs", "20Mi"), ("blk", "30Mi")] {
        let st = eventually(
            &format!("{claim} claim NodeResizePending"),
            WAIT,
            || async {
                let c = claims.get(claim).await.map_err(|e| e.to_string())?;
                let status = c.status.clone().unwrap_or_default();
                let pending = status
                    .conditions
                    .as_ref()
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "FileSystemResizePending"));
                let node = status
                    .allocated_resource_statuses
                    .as_ref()
                    .and_then(|s| s.get("storage"))
                    .map(String::as_str)
                    == Some("NodeResizePending");
                if pending && node {
                    Ok(status)
                } else {
                    Err(format!("{status:?}"))
                }
            },
        )
        .await;
        assert_eq!(storage(&st.allocated_resources), want);
        assert_eq!(
            storage(&st.capacity),
            "10Mi",
            "the node has not grown {claim} yet"
        );
        env.wait_event(claim, "FileSystemResizeRequired", &[]).await;
    }

    // Shrinking the image is refused: someone grew it to 50 MiB behind our
    // back, and the claim now asks for 40 MiB.
    Image::open(&env.rbd.ioctx, &blk_pv)
        .unwrap()
        .resize(50 * MIB)
        .unwrap();
    env.resize_claim("blk", "40Mi").await;
    env.wait_event("blk", "VolumeResizeFailed", &["shrinking"])
        .await;
    assert_eq!(image_size(&env, &blk_pv), 50 * MIB);
    let p = pvs.get(&blk_pv).await.unwrap();
    assert_eq!(storage(&p.spec.unwrap().capacity), "30Mi");
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_first_consumer_waits_for_the_selected_node() {
    let mut env = Env::new("wffc").await;
    let class = env
        .storage_class(
            "late",
            json!({}),
            json!({"volumeBindingMode": "WaitForFirstConsumer"}),
        )
        .await;
    // Also covers running without leader election (a single replica).
    let provisioner = env.start_in_process_with(&[("--leader-election", "false")]);
    env.claim("data", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let claims = env.claims();
    stays(
        "no volume before a node is selected",
        Duration::from_secs(5),
        || async {
            let c = claims.get("data").await.map_err(|e| e.to_string())?;
            let phase = c.status.as_ref().and_then(|s| s.phase.clone());
            if phase.as_deref() == Some("Pending") && env.images().is_empty() {
                Ok(())
            } else {
                Err(format!("phase {phase:?}, images {:?}", env.images()))
            }
        },
    )
    .await;
    env.annotate_claim(
        "data",
        BTreeMap::from([("volume.kubernetes.io/selected-node", "node-1")]),
    )
    .await;
    let (_, pv) = env.wait_bound("data").await;
    assert_eq!(env.images(), vec![pv.metadata.name.unwrap()]);
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_rwx_is_provisioned_and_filesystem_rwx_refused() {
    let mut env = Env::new("rwx").await;
    let class = env.storage_class("shared", json!({}), json!({})).await;
    let provisioner = env.start_in_process();
    env.claim("blk", &class, "8Mi", &["ReadWriteMany"], "Block")
        .await;
    env.claim("fs", &class, "8Mi", &["ReadWriteMany"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound("blk").await;
    let spec = pv.spec.clone().unwrap();
    assert_eq!(spec.access_modes, Some(vec!["ReadWriteMany".to_owned()]));
    assert_eq!(spec.volume_mode.as_deref(), Some("Block"));
    assert_eq!(spec.csi.unwrap().fs_type, None);
    env.wait_event("fs", "ProvisioningFailed", &["ReadWriteMany", "Block"])
        .await;
    let fs = env.claims().get("fs").await.unwrap();
    assert_eq!(fs.status.unwrap().phase.as_deref(), Some("Pending"));
    assert_eq!(env.images(), vec![pv.metadata.name.unwrap()]);
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_parameters_produce_an_event_and_no_image() {
    let mut env = Env::new("badparam").await;
    let deps = env
        .storage_class(
            "deps",
            json!({"imageFeatures": "layering,object-map"}),
            json!({}),
        )
        .await;
    let typo = env
        .storage_class("typo", json!({"imagefeatures": "layering"}), json!({}))
        .await;
    let size = env
        .storage_class("size", json!({"objectSize": "3Mi"}), json!({}))
        .await;
    let nosecret = env
        .storage_class(
            "nosecret",
            json!({"csi.storage.k8s.io/provisioner-secret-name": "missing"}),
            json!({}),
        )
        .await;
    let provisioner = env.start_in_process();
    env.claim("deps", &deps, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.claim("typo", &typo, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.claim("size", &size, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_event(
        "deps",
        "ProvisioningFailed",
        &["imageFeatures", "exclusive-lock"],
    )
    .await;
    env.wait_event(
        "typo",
        "ProvisioningFailed",
        &["imagefeatures", "unknown parameter"],
    )
    .await;
    env.wait_event(
        "size",
        "ProvisioningFailed",
        &["objectSize", "power of two"],
    )
    .await;
    env.claim(
        "nosecret",
        &nosecret,
        "8Mi",
        &["ReadWriteOnce"],
        "Filesystem",
    )
    .await;
    env.wait_event(
        "nosecret",
        "ProvisioningFailed",
        &["Secret", "missing", "not found"],
    )
    .await;
    // No finalizer was left behind that would need the missing Secret.
    env.delete_claim("nosecret").await;
    env.wait_gone(&env.claims(), "nosecret").await;
    // It keeps retrying, and still creates nothing.
    stays("no image and no PV", Duration::from_secs(3), || async {
        let ours = env.our_pvs().await?.len();
        if env.images().is_empty() && ours == 0 {
            Ok(())
        } else {
            Err(format!("images {:?}, PVs {ours}", env.images()))
        }
    })
    .await;
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_an_image_held_open_waits_until_it_is_released() {
    let mut env = Env::new("inuse").await;
    let class = env.storage_class("busy", json!({}), json!({})).await;
    let provisioner = env.start_in_process();
    env.claim("data", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound("data").await;
    let pv_name = pv.metadata.name.unwrap();

    // Hold the image open read-write through the library: it has a watcher.
    let held = Image::open(&env.rbd.ioctx, &pv_name).unwrap();
    assert!(!held.watchers().unwrap().is_empty());
    env.delete_claim("data").await;
    env.wait_event(&pv_name, "VolumeFailedDelete", &["in use"])
        .await;
    let pvs = env.pvs();
    stays(
        "PV and image kept while in use",
        Duration::from_secs(3),
        || async {
            let pv = pvs.get_opt(&pv_name).await.map_err(|e| e.to_string())?;
            if pv.is_some() && env.images() == vec![pv_name.clone()] {
                Ok(())
            } else {
                Err(format!("PV {:?}, images {:?}", pv.is_some(), env.images()))
            }
        },
    )
    .await;

    held.close().unwrap();
    env.wait_gone(&pvs, &pv_name).await;
    assert!(env.images().is_empty(), "images: {:?}", env.images());
    provisioner.stop().await;
}

/// The holder of this test's Lease.
async fn lease_holder(env: &Env) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let lease = leases.get_opt(&env.name).await.ok()??;
    lease.spec?.holder_identity.filter(|h| !h.is_empty())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_processes_only_the_leader_acts() {
    let mut env = Env::new("leader").await;
    let class = env.storage_class("ha", json!({}), json!({})).await;
    let mut a = env.start_process("replica-a");
    let mut b = env.start_process("replica-b");
    let first = eventually("a lease holder", WAIT, || async {
        lease_holder(&env)
            .await
            .ok_or_else(|| "no holder".to_owned())
    })
    .await;
    let (leader, standby) = if first == "replica-a" {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    assert_eq!(first, leader.identity);

    env.claim("one", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_bound("one").await;
    let acted: Vec<String> = env
        .events("one")
        .await
        .iter()
        .filter_map(|e| e.reporting_instance.clone())
        .collect();
    assert!(!acted.is_empty());
    assert!(
        acted.iter().all(|i| *i == leader.identity),
        "events from {acted:?}, leader is {}",
        leader.identity
    );
    assert!(standby.running() && leader.running());
    assert!(
        !standby.log_tail().contains("starting controllers"),
        "standby acted:\n{}",
        standby.log_tail()
    );

    // Health: both live, only the leader ready; metrics on the leader.
    let leader_http = leader.http_addr().await;
    let standby_http = standby.http_addr().await;
    assert_eq!(http_get(leader_http, "/healthz").await.0, 200);
    assert_eq!(http_get(standby_http, "/healthz").await.0, 200);
    eventually("leader ready", WAIT, || async {
        match http_get(leader_http, "/readyz").await {
            (200, _) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let (code, body) = http_get(standby_http, "/readyz").await;
    assert_eq!((code, body.as_str()), (503, "not the leader"));
    let (code, metrics) = http_get(leader_http, "/metrics").await;
    assert_eq!(code, 200);
    for name in [
        "controller_persistentvolumeclaim_provision_total{class=",
        "controller_persistentvolumeclaim_provision_duration_seconds_bucket{",
        "rbdkit_ceph_op_duration_seconds_count{operation=\"create\"}",
        "rbdkit_leader 1",
    ] {
        assert!(metrics.contains(name), "no {name} in\n{metrics}");
    }
    let key = support::ceph::TestCluster::get().admin_key();
    assert!(!metrics.contains(&key));

    // Someone else takes the lease: the leader stops at once, and nothing
    // is provisioned while the intruder holds it.
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let mut lease = leases.get(&env.name).await.unwrap();
    let spec = lease.spec.as_mut().unwrap();
    spec.holder_identity = Some("intruder".into());
    spec.lease_duration_seconds = Some(6);
    spec.renew_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
        k8s_openapi::jiff::Timestamp::now(),
    ));
    leases
        .replace(&env.name, &Default::default(), &lease)
        .await
        .unwrap();
    eventually("the leader to stop", WAIT, || async {
        match http_get(leader_http, "/readyz").await {
            (503, _) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(
        leader.log_text().contains("lost the lease"),
        "{}",
        leader.log_tail()
    );
    env.claim("paused", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let claims = env.claims();
    stays(
        "no provisioning while the intruder leads",
        Duration::from_secs(3),
        || async {
            let c = claims.get("paused").await.map_err(|e| e.to_string())?;
            match c.status.and_then(|s| s.phase).as_deref() {
                Some("Pending") if env.images().len() == 1 => Ok(()),
                other => Err(format!("phase {other:?}, images {:?}", env.images())),
            }
        },
    )
    .await;
    // The intruder never renews: a replica takes over and provisions.
    env.wait_bound("paused").await;
    let holder = lease_holder(&env).await.unwrap();
    assert!(
        holder == leader.identity || holder == standby.identity,
        "{holder}"
    );
    let (leader, standby) = if holder == leader.identity {
        (leader, standby)
    } else {
        (standby, leader)
    };

    // The leader dies; the standby takes over and provisions.
    leader.kill9();

    let standby_id = standby.identity.clone();
    eventually("the standby to take the lease", WAIT, || async {
        match lease_holder(&env).await {
            Some(h) if h == standby_id => Ok(()),
            other => Err(format!("holder {other:?}")),
        }
    })
    .await;
    env.claim("two", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_bound("two").await;
    let acted: Vec<String> = env
        .events("two")
        .await
        .iter()
        .filter_map(|e| e.reporting_instance.clone())
        .collect();
    assert!(
        acted.iter().all(|i| *i == standby_id),
        "events from {acted:?}"
    );
    assert_eq!(env.images().len(), 3, "images: {:?}", env.images());
    // SIGTERM: a graceful exit that releases the lease at once.
    let (status, took) = standby.terminate();
    assert!(status.success(), "{status}: {}", standby.log_tail());
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert_eq!(lease_holder(&env).await, None, "lease released");
    assert!(standby.log_text().contains("released the lease"));

    // The key never reached a log.
    for p in [&*leader, &*standby] {
        assert!(
            !p.log_text().contains(&key),
            "key in the log of {}",
            p.identity
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_provision_and_restarted_leaves_one_image_and_one_pv() {
    let mut env = Env::new("crash").await;
    let class = env.storage_class("crash", json!({}), json!({})).await;

    // Round 1: kill as soon as any image (temporary or final) appears.
    let mut p = env.start_process("crash-1");
    env.claim("data", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let ioctx = env.rbd.ioctx.clone();
    let seen = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            let names = rbd::list_names(&ioctx).unwrap_or_default();
            if !names.is_empty() {
                return names;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Vec::new()
    })
    .await
    .unwrap();
    p.kill9();
    assert!(!seen.is_empty(), "no image appeared:\n{}", p.log_tail());
    let pv_before = env.claims().get("data").await.unwrap();
    eprintln!(
        "killed with images {seen:?}; claim annotations {:?}",
        pv_before.metadata.annotations
    );

    // Round 2: restart; exactly one image and one PV.
    let p2 = env.start_process("crash-2");
    let (_, pv) = env.wait_bound("data").await;
    let pv_name = pv.metadata.name.unwrap();
    assert_eq!(env.images(), vec![pv_name.clone()]);
    let ours: Vec<String> = env
        .our_pvs()
        .await
        .unwrap()
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    assert_eq!(ours, vec![pv_name]);
    drop(p2);

    // Round 3: a claim deleted while the provisioner is dead mid-provision
    // loses its image once the provisioner is back, and no PV is left.
    let mut p3 = env.start_process("crash-3");
    env.claim("gone", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let claims = env.claims();
    // Kill it as soon as work on the claim shows (its finalizer, a second
    // image, or already a PV), polling fast so the kill often lands
    // mid-provision.
    let deadline = Instant::now() + WAIT;
    let stage = loop {
        let c = claims.get("gone").await.unwrap();
        let uid = c.metadata.uid.clone().unwrap();
        let finalizer = c
            .metadata
            .finalizers
            .unwrap_or_default()
            .iter()
            .any(|f| f == rbdkit::provisioner::controller::CLAIM_FINALIZER);
        let images = env.images().len();
        let pv = env
            .pvs()
            .get_opt(&format!("pvc-{uid}"))
            .await
            .unwrap()
            .is_some();
        if finalizer || images > 1 || pv {
            break format!("finalizer {finalizer}, images {images}, PV {pv}");
        }
        assert!(
            Instant::now() < deadline,
            "provisioning of 'gone' never started:\n{}",
            p3.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    p3.kill9();
    eprintln!("killed round 3 at: {stage}");
    env.delete_claim("gone").await;
    let _p4 = env.start_process("crash-4");
    env.wait_gone(&claims, "gone").await;
    // Whether the kill came before or after its PV was made, the end state
    // is the same: no image and no PV for the deleted claim.
    let cleaned = || async {
        let n = env
            .our_pvs()
            .await?
            .iter()
            .filter(|p| claim_name(p) == Some("gone"))
            .count();
        let images = env.images();
        if n == 0 && images.len() == 1 {
            Ok(())
        } else {
            Err(format!("{n} PVs for 'gone', images {images:?}"))
        }
    };
    eventually("the deleted claim's volume cleaned up", WAIT, cleaned).await;
    stays(
        "nothing left for the deleted claim",
        Duration::from_secs(2),
        cleaned,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_send_the_image_through_the_trash() {
    let mut env = Env::new("trash").await;
    let class = env.storage_class("snap", json!({}), json!({})).await;
    let provisioner = env.start_in_process();
    env.claim("data", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound("data").await;
    let pv_name = pv.metadata.name.unwrap();
    {
        let image = Image::open(&env.rbd.ioctx, &pv_name).unwrap();
        image.snap_create("backup").unwrap();
        image.close().unwrap();
    }
    env.delete_claim("data").await;
    // Remove fails on the snapshot: the image goes to the trash, and the
    // purge waits (never forced) while the snapshot exists.
    env.wait_event(&pv_name, "VolumeFailedDelete", &["trash", "snapshots"])
        .await;
    assert!(env.images().is_empty(), "images: {:?}", env.images());
    let trash = rbd::trash_list(&env.rbd.ioctx).unwrap();
    assert_eq!(trash.len(), 1, "{trash:?}");
    assert_eq!(trash[0].name, pv_name);
    assert!(env.pvs().get_opt(&pv_name).await.unwrap().is_some());

    // Once the snapshot is gone the purge completes, then the PV goes.
    let trashed = Image::open_by_id(&env.rbd.ioctx, &trash[0].id).unwrap();
    trashed.snap_remove("backup").unwrap();
    trashed.close().unwrap();
    env.wait_gone(&env.pvs(), &pv_name).await;
    assert!(rbd::trash_list(&env.rbd.ioctx).unwrap().is_empty());
    provisioner.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clusters_config_is_reloaded_when_it_changes() {
    let mut env = Env::new("reload").await;
    let class = env.storage_class("later", json!({}), json!({})).await;
    // The class's clusterID is not in the config yet.
    env.write_config("some-other-cluster");
    let provisioner = env.start_in_process();
    env.claim("data", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    env.wait_event(
        "data",
        "ProvisioningFailed",
        &[&env.cluster_id, "clusters config"],
    )
    .await;
    // Fixing the file is enough: no restart.
    env.write_config(&env.cluster_id.clone());
    let (_, pv) = env.wait_bound("data").await;
    assert_eq!(env.images(), vec![pv.metadata.name.unwrap()]);
    provisioner.stop().await;
}
