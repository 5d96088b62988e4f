//! kube-apiserver restarted under a running provisioner, with claims being
//! provisioned and deleted: its watches resume, no claim gets a second PV
//! or image, the lease is held again by the same process, and claims made
//! after the restart are provisioned, all without restarting rbdkit.
use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use serde_json::json;

use rbdkit::rbd;
use rbdkit::volume::ops::TEMP_SUFFIX;

use support::k8s::ControlPlane;
use support::provisioner::{eventually, wait_readyz, Env, WAIT};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apiserver_restart_mid_run_resumes_without_duplicates() {
    let cp = ControlPlane::start_private();
    let mut env = Env::new_on(&cp, "apirestart").await;
    let class = env.storage_class("a", json!({}), json!({})).await;
    let mut child = env.start_process("apir-1");
    let http = child.http_addr().await;
    let pid = child.pid();

    for n in ["keep", "gone"] {
        env.claim(n, &class, "8Mi", &["ReadWriteOnce"], "Block")
            .await;
    }
    env.wait_bound("keep").await;
    let (_, gone_pv) = env.wait_bound("gone").await;
    let gone_pv = gone_pv.metadata.name.unwrap();

    // Work in flight at the restart: new claims, and a delete.
    let inflight: Vec<String> = (0..6).map(|i| format!("in{i}")).collect();
    for n in &inflight {
        env.claim(n, &class, "8Mi", &["ReadWriteOnce"], "Block")
            .await;
    }
    env.delete_claim("gone").await;
    let mut bound_before = 0;
    for n in &inflight {
        let c = env.claims().get(n).await.unwrap();
        if c.status.and_then(|s| s.phase).as_deref() == Some("Bound") {
            bound_before += 1;
        }
    }
    eprintln!(
        "restarting kube-apiserver with {bound_before} of {} new claims Bound",
        inflight.len()
    );
    let t0 = Instant::now();
    cp.restart_apiserver();
    eprintln!("kube-apiserver restarted in {:?}", t0.elapsed());
    let restarted_at = k8s_openapi::jiff::Timestamp::now();

    // Claims made after the restart reach the provisioner's resumed watch.
    let after: Vec<String> = (0..4).map(|i| format!("after{i}")).collect();
    for n in &after {
        env.claim(n, &class, "8Mi", &["ReadWriteOnce"], "Block")
            .await;
    }
    let mut want = BTreeMap::new();
    for n in ["keep"]
        .iter()
        .map(|s| s.to_string())
        .chain(inflight.clone())
        .chain(after.clone())
    {
        let (c, pv) = env.wait_bound(&n).await;
        want.insert(pv.metadata.name.unwrap(), c.metadata.uid.unwrap());
    }
    env.wait_gone(&env.pvs(), &gone_pv).await;

    // The lease: held by the same process, and renewed since the restart.
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let lease = eventually("the lease renewed after the restart", WAIT, || async {
        let l = leases.get(&env.name).await.map_err(|e| e.to_string())?;
        let spec = l.spec.clone().unwrap_or_default();
        let renewed = spec.renew_time.as_ref().is_some_and(|t| t.0 > restarted_at);
        if spec.holder_identity.as_deref() == Some("apir-1") && renewed {
            Ok(spec)
        } else {
            Err(format!("{spec:?}"))
        }
    })
    .await;
    eprintln!(
        "lease holder {:?}, transitions {:?}",
        lease.holder_identity, lease.lease_transitions
    );
    wait_readyz(http, "/readyz ok", |b| b == "ok").await;
    assert_eq!(child.pid(), pid, "rbdkit was restarted");
    assert!(child.running(), "{}", child.log_tail());

    // No duplicates: one PV per claim, named after it; one image per PV.
    let pvs = env.our_pvs().await.unwrap();
    let mut per_claim: BTreeMap<String, usize> = BTreeMap::new();
    for pv in &pvs {
        let uid = pv
            .spec
            .as_ref()
            .and_then(|s| s.claim_ref.as_ref())
            .and_then(|r| r.uid.clone())
            .unwrap_or_default();
        *per_claim.entry(uid).or_default() += 1;
    }
    assert!(per_claim.values().all(|n| *n == 1), "{per_claim:?}");
    let pv_names: BTreeSet<String> = pvs.iter().filter_map(|p| p.metadata.name.clone()).collect();
    let want_names: BTreeSet<String> = want.keys().cloned().collect();
    assert_eq!(pv_names, want_names);
    let images: BTreeSet<String> = env.images().into_iter().collect();
    assert!(
        !images.iter().any(|i| i.ends_with(TEMP_SUFFIX)),
        "{images:?}"
    );
    assert_eq!(images, pv_names, "images vs PVs");
    assert!(rbd::trash_list(&env.rbd.ioctx).unwrap().is_empty());
    env.wait_claim_finalizers_dropped().await;
    eprintln!(
        "after the restart: {} claims, {} PVs, {} images, 0 duplicates, 0 stuck finalizers",
        want.len(),
        pvs.len(),
        images.len()
    );
    let log = child.log_text();
    eprintln!(
        "provisioner log: {} warnings, stepped down for want of the API server: {}",
        log.matches("\"level\":\"WARN\"").count(),
        log.contains("stopping work")
    );

    // Clean up through the provisioner.
    for n in ["keep".to_string()]
        .into_iter()
        .chain(inflight)
        .chain(after)
    {
        env.delete_claim(&n).await;
    }
    eventually("every image gone", Duration::from_secs(60), || async {
        let images = env.images();
        if images.is_empty() {
            Ok(())
        } else {
            Err(format!("{images:?}"))
        }
    })
    .await;
    let _ = child.terminate();
    drop(env);
}
