//! Topology on the real node: the node plugin reads its Node's zone label
//! (`--domainlabels`, ceph-csi's flag) and reports it; a WaitForFirstConsumer
//! claim of a `topologyConstrainedPools` class is placed by the real
//! kube-scheduler (the pod names no node), and the provisioner puts its
//! image in the pool of that node's zone, with a PV whose node affinity
//! says the zone; the pod writes and reads its data there.
use crate::support;

use k8s_openapi::api::core::v1::{Node as K8sNode, Secret as K8sSecret};
use kube::api::{Api, Patch, PatchParams, PostParams};
use rbdkit::volume::VolumeId;
use serde_json::json;

use support::ceph::POOL;
use support::node::{
    busybox_pod, claim_volume, create_pod, delete_pod, pod_logs, prepare_namespace, wait_phase,
    Node, NodePlugin, POD_WAIT,
};
use support::provisioner::{eventually, from_json, Env, WAIT};
use support::topology::{topo_key, topo_pool, TopoNs, TOPO_POOL, TOPO_USER};

/// The Node label the plugin reads (it reports it as
/// `topology.<driver name>/zone`, as ceph-csi does).
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

async fn set_zone(client: &kube::Client, node: &str, zone: Option<&str>) {
    Api::<K8sNode>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {ZONE_LABEL: zone}}})),
        )
        .await
        .expect("label the test Node");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wait_for_first_consumer_claim_lands_in_the_pool_of_its_node_zone() {
    topo_pool();
    let node = Node::shared();
    let mut env = Env::new("ntopo").await;
    prepare_namespace(&env.client, &env.ns).await;
    let topo = TopoNs::new(&env.rbd.name);
    // One user with both pools, to provision and to stage.
    Api::<K8sSecret>::namespaced(env.client.clone(), &env.ns)
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": "ceph-topo"},
                "stringData": {"userID": TOPO_USER, "userKey": topo_key()},
            })),
        )
        .await
        .unwrap();
    set_zone(&env.client, &node.name, Some("zone-b")).await;
    let kubeconfig = env.kubeconfig.display().to_string();
    let extra = [
        "--domainlabels".to_owned(),
        ZONE_LABEL.to_owned(),
        "--kubeconfig".to_owned(),
        kubeconfig,
    ];
    let plugin =
        NodePlugin::start_with(node, &env.client, &env.name, &env.config_path(), &extra).await;
    let provisioner = env.start_in_process();
    let pools = json!([
        {"poolName": POOL, "domainSegments": [{"domainLabel": "zone", "value": "zone-a"}]},
        {"poolName": TOPO_POOL, "domainSegments": [{"domainLabel": "zone", "value": "zone-b"}]},
    ])
    .to_string();
    let class = env
        .storage_class(
            "wffc",
            json!({
                "topologyConstrainedPools": pools,
                "csi.storage.k8s.io/provisioner-secret-name": "ceph-topo",
                "csi.storage.k8s.io/node-stage-secret-name": "ceph-topo",
                "csi.storage.k8s.io/fstype": "ext4",
            }),
            json!({"volumeBindingMode": "WaitForFirstConsumer"}),
        )
        .await;
    env.claim("zoned", &class, "32Mi", &["ReadWriteOnce"], "Filesystem")
        .await;

    // No nodeName: kube-scheduler picks the node, then the provisioner
    // provisions for it.
    create_pod(
        &env.client,
        &env.ns,
        busybox_pod(
            node,
            "zoned",
            "echo in-zone-b > /data/f && sync && cat /data/f",
            claim_volume("zoned"),
            json!([{"name": "data", "mountPath": "/data"}]),
        ),
    )
    .await;
    wait_phase(
        node,
        &env.client,
        &env.ns,
        "zoned",
        &["Succeeded"],
        POD_WAIT,
    )
    .await;
    assert_eq!(
        pod_logs(&env.client, &env.ns, "zoned").await.trim(),
        "in-zone-b"
    );
    let (claim, pv) = env.wait_bound("zoned").await;
    let selected = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("volume.kubernetes.io/selected-node").cloned());
    assert_eq!(selected.as_deref(), Some(node.name.as_str()));
    let spec = pv.spec.clone().unwrap();
    let vol = VolumeId::parse(&spec.csi.as_ref().unwrap().volume_handle).unwrap();
    assert_eq!(vol.pool, TOPO_POOL, "the image is in zone-b's pool");
    assert_eq!(topo.images(), vec![vol.image.clone()]);
    assert!(env.images().is_empty(), "{:?}", env.images());
    let affinity = spec.node_affinity.clone();
    let zone_key = format!("topology.{}/zone", env.name);
    let zones: Vec<(String, Vec<String>)> = spec
        .node_affinity
        .and_then(|a| a.required)
        .map(|r| r.node_selector_terms)
        .unwrap_or_default()
        .into_iter()
        .flat_map(|t| t.match_expressions.unwrap_or_default())
        .map(|e| (e.key, e.values.unwrap_or_default()))
        .filter(|(k, _)| *k == zone_key)
        .collect();
    assert_eq!(
        zones,
        vec![(zone_key.clone(), vec!["zone-b".to_owned()])],
        "the PV's node affinity names the zone: {affinity:?}"
    );

    delete_pod(node, &env.client, &env.ns, "zoned").await;
    env.delete_claim("zoned").await;
    eventually("the image gone from zone-b's pool", WAIT, || async {
        match topo.images() {
            i if i.is_empty() => Ok(()),
            i => Err(format!("{i:?}")),
        }
    })
    .await;
    set_zone(&env.client, &node.name, None).await;
    provisioner.stop().await;
    drop(plugin);
}
