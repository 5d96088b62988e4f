//! `rbdkit provisioner --adopt-legacy` against a real control plane and a
//! real Ceph cluster: an unmigrated legacy PV (rbd-provisioner shape, and
//! rook flex with the older `clusterName`) is expanded when its claim asks
//! for more, and its image deleted when the claim goes (reclaim Delete),
//! after rbdkit's owner record is written; an image owned by another rbdkit
//! is never touched; without the flag nothing is touched at all.
use crate::support;

use std::time::Duration;

use serde_json::json;

use rbdkit::rbd::Image;
use rbdkit::volume::ops::{self, META_PROVISIONER, META_PV};

use support::legacy::{self as lg};
use support::provisioner::{eventually, stays, Env, WAIT};

fn image_size(image: &str) -> Option<u64> {
    Image::open_read_only(&lg::pool_ioctx(), image)
        .ok()
        .map(|i| i.size().unwrap())
}

async fn legacy_env(test: &str) -> Env {
    let mut env = Env::new(test).await;
    // The class the fixtures name, allowing expansion (the API server
    // refuses a resize otherwise).
    env.storage_class("legacy", json!({}), json!({"allowVolumeExpansion": true}))
        .await;
    env
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_pvs_are_left_alone_without_the_flag_and_expanded_and_deleted_with_it() {
    let env = legacy_env("adopt").await;
    // The old rook flex fixture's `clusterName: rook` must resolve as a
    // clusterID: name the (only) cluster so; monitors match it too.
    env.write_config("rook");
    // First without the flag: nothing is touched. (One test, so that no
    // adopting provisioner of another test runs beside it: legacy PVs
    // name no rbdkit provisioner, any adopter may take them.)
    let plain = env.start_in_process_with(&[("--leader-election", "false")]);
    let l = lg::legacy_claim(&env, "rbd-provisioner", 8).await;
    env.resize_claim(&l.claim, "128Mi").await;
    env.delete_claim(&l.claim).await;
    stays(
        "the legacy image and PV untouched",
        Duration::from_secs(8),
        || async {
            let rec = ops::owner_metadata(
                &Image::open_read_only(&lg::pool_ioctx(), &l.image).map_err(|e| e.to_string())?,
            )
            .map_err(|e| e.to_string())?;
            if image_size(&l.image) != Some(lg::SIZE) || !rec.is_empty() {
                return Err(format!("image changed: {rec:?}"));
            }
            match env.pvs().get_opt(&l.pv).await.map_err(|e| e.to_string())? {
                Some(_) => Ok(()),
                None => Err("the PV was deleted".into()),
            }
        },
    )
    .await;
    let pv = env.pvs().get(&l.pv).await.unwrap();
    assert_eq!(pv.status.unwrap().phase.as_deref(), Some("Released"));
    assert!(lg::pattern_intact(&l.image, l.seed));
    drop(plain);
    lg::remove_objects(&env, &l).await;
    env.wait_gone(&env.pvs(), &l.pv).await;
    lg::remove_image(&l.image);

    // Then with it.
    let secret = format!("{}/{}", env.ns, env.secret);
    let _p = env.start_in_process_with(&[
        ("--adopt-legacy", "ceph.com/rbd,ceph.rook.io/block"),
        ("--legacy-secret", &secret),
        ("--leader-election", "false"),
    ]);
    let l = lg::legacy_claim(&env, "rbd-provisioner", 5).await;

    // Expand: the image grows, the PV's capacity follows, the record is there.
    env.resize_claim(&l.claim, "128Mi").await;
    eventually("legacy image expanded", WAIT, || async {
        match image_size(&l.image) {
            Some(s) if s == 128 << 20 => Ok(()),
            s => Err(format!(
                "size {s:?}; events {:?}",
                env.event_summary(&l.claim).await
            )),
        }
    })
    .await;
    eventually("PV capacity 128Mi", WAIT, || async {
        let pv = env.pvs().get(&l.pv).await.map_err(|e| e.to_string())?;
        let cap = pv.spec.unwrap().capacity.unwrap()["storage"].0.clone();
        (cap == "128Mi").then_some(()).ok_or(cap)
    })
    .await;
    let rec =
        ops::owner_metadata(&Image::open_read_only(&lg::pool_ioctx(), &l.image).unwrap()).unwrap();
    assert_eq!(rec.get(META_PROVISIONER), Some(&env.name), "{rec:?}");
    assert_eq!(rec.get(META_PV), Some(&l.pv), "{rec:?}");
    assert!(lg::pattern_intact(&l.image, l.seed));

    // Delete: the claim goes, the PV is released, image and PV are removed.
    env.delete_claim(&l.claim).await;
    env.wait_gone(&env.pvs(), &l.pv).await;
    eventually("legacy image removed", WAIT, || async {
        match image_size(&l.image) {
            None => Ok(()),
            Some(s) => Err(format!("still there ({s} bytes)")),
        }
    })
    .await;

    // The rook flex shape with the older clusterName: expanded too.
    let r = lg::legacy_claim(&env, "rook-flex-clustername", 9).await;
    env.resize_claim(&r.claim, "96Mi").await;
    eventually("rook image expanded", WAIT, || async {
        match image_size(&r.image) {
            Some(s) if s == 96 << 20 => Ok(()),
            s => Err(format!(
                "size {s:?}; events {:?}",
                env.event_summary(&r.claim).await
            )),
        }
    })
    .await;
    lg::remove_objects(&env, &r).await;
    lg::remove_image(&r.image);

    // An image another rbdkit owns is left alone, PV and all.
    let o = lg::legacy_claim(&env, "rbd-provisioner", 6).await;
    {
        let img = Image::open(&lg::pool_ioctx(), &o.image).unwrap();
        img.metadata_set(META_PROVISIONER, "someone.else.io")
            .unwrap();
        img.metadata_set(META_PV, &o.pv).unwrap();
    }
    env.delete_claim(&o.claim).await;
    env.wait_event(&o.pv, "VolumeFailedDelete", &["someone.else.io"])
        .await;
    assert!(image_size(&o.image).is_some());
    assert!(env.pvs().get_opt(&o.pv).await.unwrap().is_some());
    lg::remove_objects(&env, &o).await;
    lg::remove_image(&o.image);
}
