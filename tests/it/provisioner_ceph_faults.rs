//! A Ceph daemon stopped under a running provisioner, on a private cluster
//! (the shared one keeps running for the other tests): the OSD, then in
//! another test the monitor. Operations started meanwhile fail within their
//! bounds with events that say so, `/readyz` reports the cluster degraded,
//! and once the daemon is back everything completes without restarting
//! rbdkit. Nothing is leaked: no image without a PV, no PV without a claim,
//! no finalizer left.
use crate::support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{PersistentVolume, Secret as K8sSecret};
use kube::api::PostParams;
use kube::Api;
use serde_json::json;

use rbdkit::rados::Cluster;
use rbdkit::rbd;
use rbdkit::volume::quantity::MIB;

use support::ceph::{PrivateCluster, POOL};
use support::provisioner::{
    eventually, from_json, http_get, pv_bytes, wait_readyz, ChildProvisioner, Env, WAIT,
};

/// `--ceph-op-timeout` of the provisioner under test (the fixture's).
const OP_TIMEOUT: Duration = Duration::from_secs(5);

/// Slack on the bounds below (the API round trips, a machine at load 10).
/// What they guard against is a call without a bound: an OSD op then
/// waits forever and a connect client_mount_timeout (300 s), so the event
/// never comes within the wait for it (90 s).
const SLACK: Duration = Duration::from_secs(45);

// Dropped in this order: the provisioner, then the test's objects, then
// the cluster.
struct World {
    child: ChildProvisioner,
    env: Env,
    ceph: PrivateCluster,
    cluster_id: String,
    class: String,
    http: SocketAddr,
}

impl World {
    async fn new(test: &str) -> World {
        World::with_health_interval(test, "1s").await
    }

    /// With `--ceph-health-interval` `every` (how soon the monitor probe
    /// sees a monitor go).
    async fn with_health_interval(test: &str, every: &str) -> World {
        let mut env = Env::new(test).await;
        let ceph = PrivateCluster::start(test);
        let cluster_id = format!("{}-private", env.cluster_id);
        let secrets: Api<K8sSecret> = Api::namespaced(env.client.clone(), &env.ns);
        secrets
            .create(
                &PostParams::default(),
                &from_json(json!({
                    "metadata": {"name": "ceph-private"},
                    "stringData": {"userID": "admin", "userKey": ceph.admin_key()},
                })),
            )
            .await
            .unwrap();
        let config = json!([{
            "clusterID": cluster_id,
            "monitors": [ceph.conf_value("mon host").unwrap()],
        }]);
        std::fs::write(env.config_path(), config.to_string()).unwrap();
        let ns = env.ns.clone();
        let class = env
            .storage_class(
                "p",
                json!({
                    "clusterID": cluster_id,
                    "csi.storage.k8s.io/provisioner-secret-name": "ceph-private",
                    "csi.storage.k8s.io/provisioner-secret-namespace": ns,
                    "csi.storage.k8s.io/controller-expand-secret-name": "ceph-private",
                    "csi.storage.k8s.io/node-stage-secret-name": "ceph-private",
                }),
                json!({"allowVolumeExpansion": true}),
            )
            .await;
        let child =
            env.start_process_with(&format!("{test}-1"), &[("--ceph-health-interval", every)]);
        let http = child.http_addr().await;
        World {
            child,
            env,
            ceph,
            cluster_id,
            class,
            http,
        }
    }

    async fn readyz(&self) -> (u16, String) {
        http_get(self.http, "/readyz").await
    }

    /// Images in the private cluster's pool, and its trash entries.
    fn ceph_state(&self) -> (BTreeSet<String>, usize) {
        let c: Cluster = self.ceph.connect();
        let io = c.ioctx(POOL).unwrap();
        let images = rbd::list_names(&io).unwrap().into_iter().collect();
        let trash = rbd::trash_list(&io).unwrap().len();
        drop(io);
        drop(c);
        (images, trash)
    }

    /// The size of `image` in the private cluster's pool, read by librbd.
    fn image_size(&self, image: &str) -> u64 {
        let c: Cluster = self.ceph.connect();
        let io = c.ioctx(POOL).unwrap();
        let size = rbd::Image::open_read_only(&io, image)
            .and_then(|i| i.size())
            .unwrap();
        drop(io);
        drop(c);
        size
    }

    async fn our_pvs(&self) -> Vec<PersistentVolume> {
        self.env.our_pvs().await.unwrap()
    }

    /// The end of every fault test: the [`World::audit`], no key in the
    /// provisioner's log, and the provisioner stopped.
    async fn finish(mut self, left: &[&str]) {
        self.audit(left).await;
        assert!(!self.child.log_text().contains(&self.ceph.admin_key()));
        let _ = self.child.terminate();
    }

    /// What every fault test ends with: the claims `left` Bound, one PV
    /// each and one image per PV; nothing else in Ceph or Kubernetes; no
    /// finalizer of ours on a claim. Then everything is deleted, and its
    /// images with it.
    async fn audit(&self, left: &[&str]) {
        let mut want = BTreeSet::new();
        for n in left {
            let (_, pv) = self.env.wait_bound(n).await;
            want.insert(pv.metadata.name.unwrap());
        }
        let pvs: BTreeSet<String> = eventually("only the claims' PVs", WAIT, || async {
            let pvs: BTreeSet<String> = self
                .our_pvs()
                .await
                .into_iter()
                .filter_map(|p| p.metadata.name)
                .collect();
            if pvs == want {
                Ok(pvs)
            } else {
                Err(format!("PVs {pvs:?}, want {want:?}"))
            }
        })
        .await;
        let (images, trash) = self.ceph_state();
        assert_eq!(images, pvs, "images vs PVs");
        assert_eq!(trash, 0, "trash entries");
        let claims = self.env.wait_claim_finalizers_dropped().await;
        eprintln!(
            "after the fault: {} claims, {} PVs, {} images, 0 trash entries, 0 stuck finalizers",
            claims,
            pvs.len(),
            images.len()
        );
        for n in left {
            self.env.delete_claim(n).await;
        }
        eventually("every PV and image gone", WAIT, || async {
            let pvs = self.our_pvs().await.len();
            let (images, trash) = self.ceph_state();
            if pvs == 0 && images.is_empty() && trash == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{pvs} PVs, images {images:?}, {trash} in the trash"
                ))
            }
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn osd_stopped_mid_run_times_out_reports_degraded_and_recovers() {
    let mut w = World::new("osdfault").await;
    let env = &w.env;
    env.claim("grow", &w.class, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    env.claim("del", &w.class, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    env.wait_bound("grow").await;
    let (_, del_pv) = env.wait_bound("del").await;
    let del_pv = del_pv.metadata.name.unwrap();
    assert_eq!(w.readyz().await, (200, "ok".to_owned()));
    let pid = w.child.pid();

    // The OSD goes; the monitor still answers, so the probe sees nothing.
    w.ceph.stop_daemon("osd.0");
    let t0 = Instant::now();
    env.claim("new", &w.class, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    env.resize_claim("grow", "16Mi").await;
    env.delete_claim("del").await;

    let e = env
        .wait_event("new", "ProvisioningFailed", &["ETIMEDOUT", &w.cluster_id])
        .await;
    let first_failure = t0.elapsed();
    let note = e.note.unwrap_or_default();
    eprintln!("first provisioning failure after {first_failure:?}: {note}");
    assert!(note.contains("cannot create image"), "{note}");
    // One bounded call (plus the API round trips) before the event.
    assert!(first_failure < OP_TIMEOUT * 2 + SLACK, "{first_failure:?}");
    env.wait_event("grow", "VolumeResizeFailed", &["ETIMEDOUT"])
        .await;
    env.wait_event(&del_pv, "VolumeFailedDelete", &["ETIMEDOUT"])
        .await;
    let body = wait_readyz(w.http, "/readyz to report the cluster degraded", |b| {
        b.starts_with("degraded") && b.contains(&w.cluster_id)
    })
    .await;
    eprintln!("/readyz with the OSD down: {body}");
    assert!(body.contains("timing out"), "{body}");
    assert!(w.child.running(), "{}", w.child.log_tail());

    // Back: everything completes, in the same process.
    w.ceph.start_daemon("osd.0");
    let t1 = Instant::now();
    env.wait_bound("new").await;
    env.wait_gone(&env.pvs(), &del_pv).await;
    let grown = eventually("grow's PV at 16Mi", WAIT, || async {
        let (_, pv) = env.wait_bound("grow").await;
        if pv_bytes(&pv) == 16 * MIB {
            Ok(pv)
        } else {
            Err(format!("capacity {}", pv_bytes(&pv)))
        }
    })
    .await;
    eprintln!("all done {:?} after the OSD came back", t1.elapsed());
    wait_readyz(w.http, "/readyz ok again", |b| b == "ok").await;
    assert_eq!(w.child.pid(), pid);
    assert!(w.child.running(), "{}", w.child.log_tail());
    assert_eq!(
        w.image_size(grown.metadata.name.as_deref().unwrap()),
        16 * MIB
    );
    w.finish(&["grow", "new"]).await;
}

/// The operations start once the probe has seen the monitor go: before
/// that, a session opened earlier still reaches the OSD, and an operation
/// that needs no monitor (a resize) may simply succeed. One did, 43 ms
/// before the probe noticed, which is how this test once waited in vain
/// for a VolumeResizeFailed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_stopped_mid_run_is_reported_and_recovers() {
    let mut w = World::new("monfault").await;
    let env = &w.env;
    env.claim("grow", &w.class, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    env.claim("del", &w.class, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    let (_, grow_pv) = env.wait_bound("grow").await;
    let grow_image = grow_pv.metadata.name.unwrap();
    let (_, del_pv) = env.wait_bound("del").await;
    let del_pv = del_pv.metadata.name.unwrap();
    assert_eq!(w.readyz().await, (200, "ok".to_owned()));
    let pid = w.child.pid();

    w.ceph.stop_daemon("mon.a");
    let stopped = Instant::now();
    let body = wait_readyz(w.http, "/readyz to report the cluster unreachable", |b| {
        b.starts_with("degraded") && b.contains(&w.cluster_id)
    })
    .await;
    eprintln!(
        "/readyz with the monitor down after {:?}: {body}",
        stopped.elapsed()
    );
    assert!(body.contains("unreachable"), "{body}");
    let t0 = Instant::now();
    env.claim("new", &w.class, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    env.resize_claim("grow", "16Mi").await;
    env.delete_claim("del").await;
    let e = env
        .wait_event("new", "ProvisioningFailed", &[&w.cluster_id])
        .await;
    let first_failure = t0.elapsed();
    let note = e.note.unwrap_or_default();
    eprintln!("first provisioning failure after {first_failure:?}: {note}");
    assert!(
        note.contains("unreachable") || note.contains("ETIMEDOUT"),
        "{note}"
    );
    // At worst one connect bound (10 s) and one op bound.
    assert!(
        first_failure < Duration::from_secs(10) + OP_TIMEOUT + SLACK,
        "{first_failure:?}"
    );
    let e = env
        .wait_event("grow", "VolumeResizeFailed", &[&w.cluster_id])
        .await;
    eprintln!(
        "resize failure after {:?}: {}",
        t0.elapsed(),
        e.note.unwrap_or_default()
    );
    let e = env
        .wait_event(&del_pv, "VolumeFailedDelete", &[&w.cluster_id])
        .await;
    eprintln!(
        "delete failure after {:?}: {}",
        t0.elapsed(),
        e.note.unwrap_or_default()
    );
    assert!(w.child.running(), "{}", w.child.log_tail());
    assert!(
        t0.elapsed() < Duration::from_secs(10) + OP_TIMEOUT + SLACK,
        "{:?}",
        t0.elapsed()
    );

    w.ceph.start_daemon("mon.a");
    let t1 = Instant::now();
    env.wait_bound("new").await;
    env.wait_gone(&env.pvs(), &del_pv).await;
    eventually("grow's PV at 16Mi", WAIT, || async {
        let (_, pv) = env.wait_bound("grow").await;
        if pv_bytes(&pv) == 16 * MIB {
            Ok(())
        } else {
            Err(format!("capacity {}", pv_bytes(&pv)))
        }
    })
    .await;
    eprintln!("all done {:?} after the monitor came back", t1.elapsed());
    assert_eq!(w.image_size(&grow_image), 16 * MIB);
    wait_readyz(w.http, "/readyz ok again", |b| b == "ok").await;
    assert_eq!(w.child.pid(), pid);
    assert!(w.child.running(), "{}", w.child.log_tail());
    w.finish(&["grow", "new"]).await;
}

/// Before the probe sees the monitor go (here it never looks), the session
/// opened earlier still reaches the OSD: a resize, which needs no monitor,
/// completes, and a provisioning, which asks the monitor for the pool's
/// quota, times out within its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_stopped_unseen_resize_completes_and_create_times_out() {
    let mut w = World::with_health_interval("monunseen", "1h").await;
    let env = &w.env;
    env.claim("grow", &w.class, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    let (_, grow_pv) = env.wait_bound("grow").await;
    let grow_image = grow_pv.metadata.name.unwrap();
    let pid = w.child.pid();

    w.ceph.stop_daemon("mon.a");
    let t0 = Instant::now();
    env.resize_claim("grow", "16Mi").await;
    env.wait_event("grow", "FileSystemResizeRequired", &[])
        .await;
    let (_, pv) = env.wait_bound("grow").await;
    assert_eq!(pv_bytes(&pv), 16 * MIB);
    eprintln!("resized with the monitor down after {:?}", t0.elapsed());

    let t1 = Instant::now();
    env.claim("new", &w.class, "8Mi", &["ReadWriteOnce"], "Block")
        .await;
    let e = env
        .wait_event("new", "ProvisioningFailed", &["ETIMEDOUT", &w.cluster_id])
        .await;
    let failed = t1.elapsed();
    let note = e.note.unwrap_or_default();
    eprintln!("provisioning failure after {failed:?}: {note}");
    assert!(failed < OP_TIMEOUT * 2 + SLACK, "{failed:?}");
    let body = wait_readyz(w.http, "/readyz to report the cluster degraded", |b| {
        b.starts_with("degraded") && b.contains(&w.cluster_id)
    })
    .await;
    eprintln!("/readyz: {body}");
    assert!(w.child.running(), "{}", w.child.log_tail());

    w.ceph.start_daemon("mon.a");
    let t2 = Instant::now();
    env.wait_bound("new").await;
    eprintln!("provisioned {:?} after the monitor came back", t2.elapsed());
    wait_readyz(w.http, "/readyz ok again", |b| b == "ok").await;
    assert_eq!(w.child.pid(), pid);
    assert_eq!(w.image_size(&grow_image), 16 * MIB);
    w.finish(&["grow", "new"]).await;
}
