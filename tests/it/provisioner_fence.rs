//! A deposed leader changes nothing more in Ceph: a delete parked between
//! two steps (just before `rbd_remove`) while another replica takes the
//! lease is refused by the lease fence when it resumes, and the replica
//! that leads next completes it.
use crate::support;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Api;
use serde_json::json;

use rbdkit::rbd;
use rbdkit::volume::ops::pause;

use support::provisioner::{eventually, http_get, Env, WAIT};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_parked_across_a_lease_takeover_is_fenced() {
    let mut env = Env::new("fence").await;
    let class = env.storage_class("f", json!({}), json!({})).await;
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let provisioner = env.start_in_process_with(&[("--http-addr", &addr.to_string())]);

    let claim = env
        .claim("victim", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound("victim").await;
    let pv_name = pv.metadata.name.clone().unwrap();
    assert_eq!(pv_name, format!("pvc-{}", claim.metadata.uid.unwrap()));
    assert_eq!(env.images(), vec![pv_name.clone()]);

    // Park the delete just before it removes the image (owner, watchers
    // and id already checked).
    let parked = pause::arm("rbd_remove");
    env.delete_claim("victim").await;
    eventually("the delete to reach rbd_remove", WAIT, || async {
        if parked.reached() {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .await;

    // A second replica takes the lease, as it would after a partition.
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.ns);
    let mut lease = leases.get(&env.name).await.unwrap();
    let spec = lease.spec.as_mut().unwrap();
    spec.holder_identity = Some("second-replica".into());
    spec.lease_duration_seconds = Some(8);
    spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
    leases
        .replace(&env.name, &Default::default(), &lease)
        .await
        .unwrap();
    eventually("the deposed leader to notice", WAIT, || async {
        match http_get(addr, "/readyz").await {
            (503, _) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // The parked step resumes: the fence refuses it, and says why.
    parked.release();
    let outcome = eventually("the fence's answer", WAIT, || async {
        parked.outcome().ok_or_else(|| "none yet".to_owned())
    })
    .await;
    let why = outcome.expect_err("the deposed leader's rbd_remove was allowed");
    assert!(
        why.contains("rbd_remove")
            && why.contains(&pv_name)
            && why.contains("no longer holds the leader lease"),
        "{why}"
    );
    assert_eq!(env.images(), vec![pv_name.clone()], "the image was removed");
    assert!(rbd::trash_list(&env.rbd.ioctx).unwrap().is_empty());
    assert!(
        env.pvs().get_opt(&pv_name).await.unwrap().is_some(),
        "the PV went without its image being deleted"
    );

    // The second replica never renews; whoever leads next (here the same
    // process, re-elected) completes the delete.
    env.wait_gone(&env.pvs(), &pv_name).await;
    assert!(env.images().is_empty(), "images left: {:?}", env.images());
    assert!(rbd::trash_list(&env.rbd.ioctx).unwrap().is_empty());
    let holder = leases.get(&env.name).await.unwrap().spec.unwrap();
    assert_ne!(holder.holder_identity.as_deref(), Some("second-replica"));
    provisioner.stop().await;
}
