//! The deploy/ manifests: they parse, agree with each other and with the
//! provisioner's flags and parameters, and their RBAC is enough for a whole
//! provision / expand / delete cycle against the real control plane.
use crate::support;

use std::time::Duration;

use clap::Parser;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, PersistentVolumeClaim, Secret, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use rbdkit::provisioner::ProvisionerArgs;
use rbdkit::rbd::Image;
use rbdkit::volume::clusters::ClustersConfig;
use rbdkit::volume::params::ClassParams;

use support::manifests::{manifests, named, one, typed, CLUSTERS_CONFIGMAP};
use support::provisioner::{eventually, Env, WAIT};

#[derive(Parser)]
struct ArgsOnly {
    #[command(flatten)]
    args: ProvisionerArgs,
}

#[test]
fn manifests_parse_and_agree_with_the_provisioner() {
    let docs = manifests();
    for (file, d) in &docs {
        match d["kind"].as_str().unwrap_or_default() {
            "Namespace" => drop(typed::<Namespace>(file, d)),
            "ServiceAccount" => drop(typed::<ServiceAccount>(file, d)),
            "ClusterRole" => drop(typed::<ClusterRole>(file, d)),
            "ClusterRoleBinding" => drop(typed::<ClusterRoleBinding>(file, d)),
            "Role" => drop(typed::<Role>(file, d)),
            "RoleBinding" => drop(typed::<RoleBinding>(file, d)),
            "ConfigMap" => drop(typed::<ConfigMap>(file, d)),
            "Deployment" => drop(typed::<Deployment>(file, d)),
            // The CSI node plugin's; checked in tests/it/csi_deploy.rs.
            "DaemonSet" | "CSIDriver" => {}
            "Secret" => drop(typed::<Secret>(file, d)),
            "StorageClass" => drop(typed::<StorageClass>(file, d)),
            "PersistentVolumeClaim" => drop(typed::<PersistentVolumeClaim>(file, d)),
            // Checked in tests/it/provisioner_snapshots.rs.
            "VolumeSnapshotClass" => {}
            // Checked in tests/it/node_group_snapshots.rs.
            "VolumeGroupSnapshotClass" => {}
            // csi-addons' kind; tests/it/mirror_dr.rs makes a class of its
            // own with the same fields.
            "VolumeReplicationClass" => {}
            other => panic!("{file}: unexpected kind {other:?}"),
        }
    }

    // The Deployment: two replicas of `rbdkit provisioner` with flags the
    // binary accepts, its config mounted where the flag says.
    let deployment: Deployment = one(&docs, "Deployment");
    let spec = deployment.spec.unwrap();
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.unwrap();
    let sa: ServiceAccount = one(&docs, "ServiceAccount");
    assert_eq!(pod.service_account_name, sa.metadata.name);
    let c = &pod.containers[0];
    let argv = c.args.clone().unwrap();
    assert_eq!(argv[0], "provisioner");
    let args =
        ArgsOnly::try_parse_from(std::iter::once("rbdkit".to_owned()).chain(argv[1..].to_vec()))
            .unwrap_or_else(|e| panic!("deployment args: {e}"))
            .args;
    assert!(args.leader_election);
    let mount_dir = args
        .clusters_config
        .parent()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let mount = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.mount_path == mount_dir)
        .expect("the clusters config directory is mounted");
    let volume = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == mount.name)
        .unwrap();
    let configmap: ConfigMap = named(&docs, "ConfigMap", CLUSTERS_CONFIGMAP);
    assert_eq!(
        volume.config_map.as_ref().unwrap().name,
        configmap.metadata.name.clone().unwrap()
    );
    let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .clone()
            .unwrap()
    };
    assert_eq!(probe_path(&c.liveness_probe), "/healthz");
    assert_eq!(probe_path(&c.readiness_probe), "/readyz");

    // The clusters config and the example class agree.
    let file_name = args.clusters_config.file_name().unwrap().to_str().unwrap();
    let config = ClustersConfig::parse(&configmap.data.unwrap()[file_name]).unwrap();
    let class: StorageClass = one(&docs, "StorageClass");
    assert_eq!(class.provisioner, args.name);
    let params = ClassParams::parse(&class.parameters.clone().unwrap()).unwrap();
    assert!(config.get(&params.cluster_id).is_some());
    let secret: Secret = one(&docs, "Secret");
    let prov_secret = params.provisioner_secret.as_ref().unwrap();
    assert_eq!(prov_secret.name, secret.metadata.name.clone().unwrap());
    assert_eq!(
        prov_secret.namespace,
        secret.metadata.namespace.clone().unwrap()
    );
    let data = secret.string_data.unwrap();
    assert!(data.contains_key("userID") && data.contains_key("userKey"));
    let pvc: PersistentVolumeClaim = one(&docs, "PersistentVolumeClaim");
    assert_eq!(pvc.spec.unwrap().storage_class_name, class.metadata.name);

    // The ClusterRole grants what the provisioner calls.
    let role: ClusterRole = one(&docs, "ClusterRole");
    let rules = role.rules.unwrap();
    let allows = |group: &str, resource: &str, verb: &str| {
        rules.iter().any(|r| {
            r.api_groups.as_ref().unwrap().iter().any(|g| g == group)
                && r.resources.as_ref().unwrap().iter().any(|x| x == resource)
                && r.verbs.iter().any(|v| v == verb)
        })
    };
    for (group, resource, verbs) in [
        (
            "",
            "persistentvolumes",
            &["get", "list", "watch", "create", "delete", "patch"][..],
        ),
        (
            "",
            "persistentvolumeclaims",
            &["get", "list", "watch", "patch"][..],
        ),
        ("", "persistentvolumeclaims/status", &["patch"][..]),
        ("storage.k8s.io", "storageclasses", &["get"][..]),
        ("storage.k8s.io", "volumeattributesclasses", &["get"][..]),
        ("storage.k8s.io", "csinodes", &["get"][..]),
        ("", "nodes", &["get", "list"][..]),
        ("", "secrets", &["get"][..]),
        ("events.k8s.io", "events", &["create", "patch"][..]),
    ] {
        for verb in verbs {
            assert!(allows(group, resource, verb), "{verb} {group}/{resource}");
        }
    }
    assert!(
        !allows("", "secrets", "list"),
        "Secrets are read one by one, never listed"
    );
}

/// Server-side apply of one manifest of type `K`.
async fn apply<K>(client: &kube::Client, v: &Value)
where
    K: kube::Resource<DynamicType = ()> + DeserializeOwned,
{
    let _: K = serde_json::from_value(v.clone()).unwrap();
    let resource = kube::api::ApiResource::erase::<K>(&());
    let name = v["metadata"]["name"].as_str().unwrap();
    let api: Api<kube::api::DynamicObject> = match v["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    api.patch(
        name,
        &PatchParams::apply("rbdkit-tests").force(),
        &Patch::Apply(v),
    )
    .await
    .unwrap_or_else(|e| panic!("apply {name}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_rbac_is_enough_for_a_whole_cycle() {
    let mut env = Env::new("rbac").await;
    for (file, d) in manifests() {
        if !file.ends_with("namespace.yaml") && !file.ends_with("rbac.yaml") {
            continue;
        }
        match d["kind"].as_str().unwrap() {
            "Namespace" => apply::<Namespace>(&env.client, &d).await,
            "ServiceAccount" => apply::<ServiceAccount>(&env.client, &d).await,
            "ClusterRole" => apply::<ClusterRole>(&env.client, &d).await,
            "ClusterRoleBinding" => apply::<ClusterRoleBinding>(&env.client, &d).await,
            "Role" => apply::<Role>(&env.client, &d).await,
            "RoleBinding" => apply::<RoleBinding>(&env.client, &d).await,
            other => panic!("unexpected {other}"),
        }
    }
    let class = env
        .storage_class("rbac", json!({}), json!({"allowVolumeExpansion": true}))
        .await;
    // Run as the ServiceAccount of deploy/rbac.yaml.
    let kubeconfig = env.kubeconfig_as("system:serviceaccount:rbdkit:rbdkit-provisioner");
    let provisioner = env.start_in_process_with(&[
        ("--kubeconfig", kubeconfig.to_str().unwrap()),
        ("--leader-election-namespace", "rbdkit"),
    ]);
    env.claim("data", &class, "8Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let (_, pv) = env.wait_bound("data").await;
    let pv_name = pv.metadata.name.unwrap();
    env.wait_event("data", "ProvisioningSucceeded", &[]).await;

    env.resize_claim("data", "16Mi").await;
    let pvs = env.pvs();
    eventually("PV at 16Mi", WAIT, || async {
        let p = pvs.get(&pv_name).await.map_err(|e| e.to_string())?;
        let cap = p.spec.unwrap().capacity.unwrap()["storage"].0.clone();
        if cap == "16Mi" {
            Ok(())
        } else {
            Err(format!("capacity {cap}"))
        }
    })
    .await;
    let claims = env.claims();
    eventually("claim resize status", WAIT, || async {
        let c = claims.get("data").await.map_err(|e| e.to_string())?;
        let s = c.status.unwrap_or_default();
        let state = s.allocated_resource_statuses.unwrap_or_default();
        if state.get("storage").map(String::as_str) == Some("NodeResizePending") {
            Ok(())
        } else {
            Err(format!("{state:?}"))
        }
    })
    .await;
    assert_eq!(
        Image::open_read_only(&env.rbd.ioctx, &pv_name)
            .unwrap()
            .size()
            .unwrap(),
        16 << 20
    );

    env.delete_claim("data").await;
    env.wait_gone(&pvs, &pv_name).await;
    assert!(env.images().is_empty(), "images: {:?}", env.images());
    tokio::time::sleep(Duration::from_millis(100)).await;
    provisioner.stop().await;
}
