//! QoS on the real node: a VolumeAttributesClass change applied to the
//! claim of a running pod throttles its volume at once (rbdkit-fuse's
//! librbd reads the image's new per-image limit when the header changes),
//! measured with fio beside the pod, on the filesystem the kubelet mounted
//! for it.
use crate::support;

use std::path::Path;

use k8s_openapi::api::storage::v1::VolumeAttributesClass;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

use support::node::{
    busybox_pod, claim_volume, create_pod, delete_pod, prepare_namespace, wait_phase, Node,
    NodePlugin, POD_WAIT,
};
use support::provisioner::{eventually, from_json, Env, WAIT};

/// Random 4 KiB direct reads of `file` (laid out by fio first) for
/// `seconds` after `ramp` seconds: the IOPS fio measured.
fn fio_read_iops(file: &Path, seconds: u32, ramp: u32) -> f64 {
    let out = std::process::Command::new("fio")
        .args([
            "--name=qos",
            &format!("--filename={}", file.display()),
            "--size=32M",
            "--rw=randread",
            "--bs=4k",
            "--direct=1",
            "--ioengine=libaio",
            "--iodepth=8",
            "--time_based",
            &format!("--runtime={seconds}"),
            &format!("--ramp_time={ramp}"),
            "--output-format=json",
        ])
        .output()
        .expect("run fio (Debian package fio; scripts/install-deps)");
    assert!(
        out.status.success(),
        "fio failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("fio output: {e}\n{}", String::from_utf8_lossy(&out.stdout)));
    v["jobs"][0]["read"]["iops"]
        .as_f64()
        .unwrap_or_else(|| panic!("no read iops in {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_class_change_throttles_a_running_pods_volume() {
    let node = Node::shared();
    let mut env = Env::new("nqos").await;
    prepare_namespace(&env.client, &env.ns).await;
    let provisioner = env.start_in_process();
    let plugin = NodePlugin::start(node, &env.client, &env.name, &env.config_path()).await;
    let class = env
        .storage_class(
            "qos",
            json!({"csi.storage.k8s.io/fstype": "ext4"}),
            json!({}),
        )
        .await;
    env.claim("data", &class, "128Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound("data").await;
    let pv_name = pv.metadata.name.clone().unwrap();

    // A pod keeps the volume mounted for the whole test.
    create_pod(
        &env.client,
        &env.ns,
        busybox_pod(
            node,
            "app",
            "echo up > /data/up; while :; do sleep 1; done",
            claim_volume("data"),
            json!([{"name": "data", "mountPath": "/data"}]),
        ),
    )
    .await;
    let pod = wait_phase(node, &env.client, &env.ns, "app", &["Running"], POD_WAIT).await;
    let uid = pod.metadata.uid.clone().unwrap();
    // The pod's volume as the kubelet mounted it for the pod.
    let dir = node
        .kubelet_root
        .join("pods")
        .join(&uid)
        .join("volumes/kubernetes.io~csi")
        .join(&pv_name)
        .join("mount");
    eventually("the pod's volume mounted", WAIT, || async {
        if rbdkit::node::mount::is_mount_point(&dir).unwrap_or(false) {
            Ok(())
        } else {
            Err(format!("{} is not a mount point", dir.display()))
        }
    })
    .await;
    let file = dir.join("fio.dat");

    // Unthrottled first (fio lays the file out here).
    let free = fio_read_iops(&file, 4, 1);
    // A limit well below that, in round tens.
    let limit = ((free / 4.0) as u64).clamp(20, 400) / 10 * 10;
    assert!(
        free >= 3.0 * limit as f64,
        "the unthrottled path does {free:.0} IOPS here: too slow to test a {limit} IOPS limit"
    );

    let vacs: Api<VolumeAttributesClass> = Api::all(env.client.clone());
    let slow = format!("{}-slow", env.ns);
    let unlimited = format!("{}-unlimited", env.ns);
    for (name, value) in [(&slow, limit.to_string()), (&unlimited, "max".to_owned())] {
        vacs.create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": name},
                "driverName": env.name,
                "parameters": {"maxReadIops": value},
            })),
        )
        .await
        .expect("create VolumeAttributesClass");
    }
    let apply = |to: String| {
        let claims = env.claims();
        async move {
            claims
                .patch(
                    "data",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"volumeAttributesClassName": to}})),
                )
                .await
                .expect("set the class");
            eventually(&format!("class {to} applied"), WAIT, || async {
                let c = claims.get("data").await.map_err(|e| e.to_string())?;
                let st = c.status.unwrap_or_default();
                if st.current_volume_attributes_class_name.as_deref() == Some(to.as_str())
                    && st.modify_volume_status.is_none()
                {
                    Ok(())
                } else {
                    Err(format!(
                        "current {:?}, modify {:?}",
                        st.current_volume_attributes_class_name, st.modify_volume_status
                    ))
                }
            })
            .await;
        }
    };

    // The pod keeps running; its volume is throttled to the limit. Only
    // the upper bound is asserted: load on the machine can slow the volume
    // below the limit, never above it.
    apply(slow.clone()).await;
    let throttled = fio_read_iops(&file, 12, 3);
    let error = (throttled - limit as f64).abs() / limit as f64;
    eprintln!(
        "node_qos: unthrottled {free:.0} IOPS, limit {limit}, throttled {throttled:.1} IOPS ({:.1} % off)",
        error * 100.0
    );
    assert!(
        throttled <= 1.10 * limit as f64,
        "with maxReadIops {limit} the volume did {throttled:.1} IOPS (unthrottled {free:.0})"
    );
    // And lifted again by the next class: the image has no read limit.
    apply(unlimited.clone()).await;
    let vol = support::provisioner::volume_id(&pv);
    let img = rbdkit::rbd::Image::open_read_only(&env.rbd.ioctx, &vol.image).unwrap();
    assert!(img.metadata_get("conf_rbd_qos_read_iops_limit").is_err());
    drop(img);
    let lifted = fio_read_iops(&file, 4, 1);
    eprintln!("node_qos: lifted again: {lifted:.0} IOPS");
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(env.client.clone(), &env.ns);
    let phase = pods.get("app").await.unwrap().status.and_then(|s| s.phase);
    assert_eq!(phase.as_deref(), Some("Running"));

    std::fs::remove_file(&file).unwrap();
    delete_pod(node, &env.client, &env.ns, "app").await;
    env.delete_claim("data").await;
    env.wait_gone(&env.pvs(), &pv_name).await;
    for n in [slow, unlimited] {
        let _ = vacs.delete(&n, &DeleteParams::default()).await;
    }
    drop(plugin);
    provisioner.stop().await;
}
