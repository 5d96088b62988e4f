//! csi-addons EncryptionKeyRotationJobs, reconciled by the provisioner
//! itself (the CRD from csi-addons' Go module, no csi-addons controller),
//! against the real cluster and API server, the provisioner running as
//! the ServiceAccount of deploy/rbac.yaml: a job for a claim encrypted
//! with the `metadata` KMS gives its volume a new passphrase (the old one
//! no longer opens the LUKS2 header, the new one from the image's KMS
//! record does, the volume key and the data are unchanged, one keyslot
//! is left), and so does one for a claim of a Vault KMS (`vaulttokens`,
//! the real Vault); a job for a claim never bound is retried up to its
//! `backOffLimit`, then fails; jobs for a claim that is not encrypted, one
//! of the `default` KMS and a missing claim fail by name at once with a
//! Warning event, and change nothing; no passphrase reaches a status or an
//! event. And on the test node: a volume staged through rbdkit-fuse keeps
//! working through a rotation with no node step, and its next stage opens
//! with the new passphrase.
use crate::node_fuse::tempdir;
use crate::support;

use std::collections::BTreeMap;

use kube::api::{DynamicObject, PostParams};
use kube::Api;
use serde_json::json;

use rbdkit::rados::Secret;
use rbdkit::rbd::Image;
use rbdkit::volume::kms::{self, META_DEK};
use rbdkit::volume::luks::Header;
use rbdkit::volume::VolumeId;
use rbdkit::ErrorKind;
use support::csi_addons::GROUP;
use support::data::pattern;
use support::manifests::{apply, deploy_dir, parse_docs};
use support::provisioner::{eventually, from_json, volume_id, Env, WAIT};

const KEK: &str = "the-kms-passphrase-of-the-ekr-secret";
const KMS_ID: &str = "ekr-meta";
const VAULT_ID: &str = "ekr-vault";
const MIB: u64 = 1 << 20;

fn jobs(env: &Env) -> Api<DynamicObject> {
    let r = kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(GROUP, "v1alpha1", "EncryptionKeyRotationJob"),
        "encryptionkeyrotationjobs",
    );
    Api::namespaced_with(env.client.clone(), &env.ns, &r)
}

async fn create_job(env: &Env, name: &str, claim: &str) {
    jobs(env)
        .create(
            &PostParams::default(),
            &from_json(json!({
                "apiVersion": "csiaddons.openshift.io/v1alpha1",
                "kind": "EncryptionKeyRotationJob",
                "metadata": {"name": name},
                "spec": {"target": {"persistentVolumeClaim": claim}},
            })),
        )
        .await
        .unwrap_or_else(|e| panic!("create EncryptionKeyRotationJob {name}: {e}"));
}

/// Waits for the job's `result`; its status.
async fn wait_result(env: &Env, name: &str, result: &str) -> serde_json::Value {
    let api = jobs(env);
    eventually(&format!("job {name} {result}"), WAIT, || async {
        let o = api.get(name).await.map_err(|e| e.to_string())?;
        let s = o.data["status"].clone();
        match s["result"].as_str() {
            Some(r) if r == result => Ok(s),
            _ => Err(format!("status {s}")),
        }
    })
    .await
}

/// The image's metadata and LUKS2 keyslots (none without a header).
fn snapshot(env: &Env, vol: &VolumeId) -> (BTreeMap<String, String>, Vec<u32>) {
    let img = Image::open_read_only(&env.rbd.ioctx, &vol.image).unwrap();
    let meta = img.metadata_list().unwrap();
    let slots = Header::read(&img).map(|h| h.keyslots).unwrap_or_default();
    (meta, slots)
}

/// The CRDs, the `metadata` KMS's passphrase in the test's Secrets, and a
/// KMS config of [`KMS_ID`] (`metadata`) and the entries of `more`; the
/// config's dir and path.
async fn prepare(env: &Env, test: &str, more: serde_json::Value) -> (tempfile::TempDir, String) {
    support::csi_addons::install_crds(&env.client).await;
    support::artifacts::note_secret(KEK);
    env.set_encryption_passphrase(KEK).await;
    let dir = tempdir(test);
    let path = dir.path().join("config.json");
    let mut config = json!({KMS_ID: {"encryptionKMSType": "metadata"}});
    if let serde_json::Value::Object(more) = more {
        config.as_object_mut().unwrap().extend(more);
    }
    std::fs::write(&path, config.to_string()).unwrap();
    (dir, path.display().to_string())
}

/// A class encrypted with the `metadata` KMS [`KMS_ID`].
async fn metadata_class(env: &mut Env) -> String {
    env.storage_class(
        "enc",
        json!({"encrypted": "true", "encryptionKMSID": KMS_ID}),
        json!({}),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_rotation_job_gives_an_encrypted_claim_a_new_passphrase_and_refuses_others() {
    let mut env = Env::new("ekr").await;
    // And a Vault KMS (`vaulttokens`, the token in the claim's namespace).
    let vault = support::kms::VaultServer::shared().await;
    let (section, mount) = support::kms::vaulttokens_kms(vault, &env.client, &env.ns).await;
    let (_dir, kms_config) = prepare(&env, "ekr", json!({ VAULT_ID: section })).await;
    // Run as the ServiceAccount of deploy/rbac.yaml.
    let deploy = deploy_dir();
    for file in ["namespace.yaml", "rbac.yaml"] {
        let text = std::fs::read_to_string(deploy.join(file)).unwrap();
        for d in &parse_docs(file, &text) {
            apply(&env.client, d).await;
        }
    }
    // What deploy/README.md says `vaulttokens` needs besides: `get` on
    // the tenant's ConfigMaps (here in the tenant's namespace only).
    for d in [
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "vault-tenant-config", "namespace": env.ns},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "vault-tenant-config", "namespace": env.ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                "name": "vault-tenant-config"},
            "subjects": [{"kind": "ServiceAccount", "name": "rbdkit-provisioner",
                "namespace": "rbdkit"}]}),
    ] {
        apply(&env.client, &d).await;
    }
    let kubeconfig = env.kubeconfig_as("system:serviceaccount:rbdkit:rbdkit-provisioner");
    let provisioner = env.start_in_process_with(&[
        ("--kms-config", kms_config.as_str()),
        ("--kubeconfig", kubeconfig.to_str().unwrap()),
        ("--leader-election-namespace", "rbdkit"),
    ]);
    let enc = metadata_class(&mut env).await;
    let shared = env
        .storage_class("shared", json!({"encrypted": "true"}), json!({}))
        .await;
    let plain = env.storage_class("plain", json!({}), json!({})).await;
    let in_vault = env
        .storage_class(
            "vault",
            json!({"encrypted": "true", "encryptionKMSID": VAULT_ID}),
            json!({}),
        )
        .await;
    env.claim("vdata", &in_vault, "64Mi", &["ReadWriteOnce"], "Block")
        .await;
    // A claim of a class that does not exist: never bound.
    env.claim(
        "pending",
        "no-such-class",
        "64Mi",
        &["ReadWriteOnce"],
        "Block",
    )
    .await;
    env.claim("data", &enc, "64Mi", &["ReadWriteOnce"], "Block")
        .await;
    env.claim("shared", &shared, "64Mi", &["ReadWriteOnce"], "Block")
        .await;
    env.claim("plain", &plain, "64Mi", &["ReadWriteOnce"], "Block")
        .await;
    let vol = volume_id(&env.wait_bound("data").await.1);
    let shared_vol = volume_id(&env.wait_bound("shared").await.1);
    let plain_vol = volume_id(&env.wait_bound("plain").await.1);
    let vault_vol = volume_id(&env.wait_bound("vdata").await.1);

    // The old passphrase, the volume key, and data written with it.
    let handle = vol.handle();
    let kek = Secret::new(KEK.to_owned());
    let (meta, slots) = snapshot(&env, &vol);
    assert_eq!(slots.len(), 1, "{slots:?}");
    let old = kms::unwrap_dek(&kek, &handle, meta.get(META_DEK).unwrap()).unwrap();
    support::artifacts::note_secret(old.expose());
    let data = pattern(11, 64 * 1024);
    let key = {
        let img = Image::open(&env.rbd.ioctx, &vol.image).unwrap();
        let h = Header::read(&img).unwrap();
        let (key, _) = h.unlock(&img, old.expose().as_bytes()).unwrap();
        let mut ct = data.clone();
        h.data_cipher(&key).unwrap().encrypt(0, &mut ct);
        img.write(h.data_offset + MIB, &ct).unwrap();
        img.flush().unwrap();
        key
    };
    let before_shared = snapshot(&env, &shared_vol);
    let before_plain = snapshot(&env, &plain_vol);

    // The job: Succeeded, as csi-addons writes it.
    create_job(&env, "rotate-data", "data").await;
    let st = wait_result(&env, "rotate-data", "Succeeded").await;
    assert_eq!(
        st["message"], "Key rotation operation successfully completed.",
        "{st}"
    );
    assert!(
        st["startTime"].is_string() && st["completionTime"].is_string(),
        "{st}"
    );
    env.wait_event("rotate-data", "KeyRotated", &[&handle, "data"])
        .await;

    // The old passphrase opens nothing; the KMS's new one opens the one
    // keyslot left, with the same volume key; the data is unchanged.
    let (meta, slots) = snapshot(&env, &vol);
    assert_eq!(slots.len(), 1, "one keyslot left: {slots:?}");
    let new = kms::unwrap_dek(&kek, &handle, meta.get(META_DEK).unwrap()).unwrap();
    support::artifacts::note_secret(new.expose());
    assert_ne!(new, old, "the KMS record holds a new passphrase");
    let img = Image::open_read_only(&env.rbd.ioctx, &vol.image).unwrap();
    let h = Header::read(&img).unwrap();
    assert_eq!(
        h.unlock(&img, old.expose().as_bytes()).unwrap_err().kind(),
        ErrorKind::PermissionDenied,
        "the old passphrase still opens the header"
    );
    let (key2, slot) = h.unlock(&img, new.expose().as_bytes()).unwrap();
    assert_eq!(vec![slot], slots);
    assert_eq!(key2.bytes(), key.bytes(), "the volume key is kept");
    let mut back = vec![0u8; data.len()];
    img.read_exact(h.data_offset + MIB, &mut back).unwrap();
    h.data_cipher(&key2).unwrap().decrypt(0, &mut back);
    assert!(back == data, "the data changed");
    drop(img);

    // A Vault volume: the passphrase in Vault is replaced, and only the
    // new one opens the header (the Vault calls made from the rotation's
    // blocking steps).
    let vhandle = vault_vol.handle();
    let vold = vault.kv2_passphrase(&mount, &vhandle).await.unwrap();
    support::artifacts::note_secret(&vold);
    create_job(&env, "rotate-vault", "vdata").await;
    wait_result(&env, "rotate-vault", "Succeeded").await;
    let vnew = vault.kv2_passphrase(&mount, &vhandle).await.unwrap();
    support::artifacts::note_secret(&vnew);
    assert_ne!(vnew, vold, "Vault holds a new passphrase");
    let img = Image::open_read_only(&env.rbd.ioctx, &vault_vol.image).unwrap();
    let h = Header::read(&img).unwrap();
    assert_eq!(h.keyslots.len(), 1, "{:?}", h.keyslots);
    assert!(
        h.unlock(&img, vold.as_bytes()).is_err(),
        "the old passphrase opens"
    );
    h.unlock(&img, vnew.as_bytes())
        .expect("Vault's new passphrase opens");
    drop(img);

    // A claim never bound: retried, then Failed past backOffLimit.
    jobs(&env)
        .create(
            &PostParams::default(),
            &from_json(json!({
                "apiVersion": "csiaddons.openshift.io/v1alpha1",
                "kind": "EncryptionKeyRotationJob",
                "metadata": {"name": "rotate-pending"},
                "spec": {"target": {"persistentVolumeClaim": "pending"}, "backOffLimit": 1},
            })),
        )
        .await
        .unwrap();
    let st = wait_result(&env, "rotate-pending", "Failed").await;
    let msg = st["message"].as_str().unwrap_or_default();
    assert!(
        msg.starts_with("Maximum retry limit reached") && msg.contains("not bound"),
        "{st}"
    );
    assert_eq!(st["retries"], 1, "{st}");
    assert_eq!(st["conditions"][0]["type"], "Failed", "{st}");

    // Refused by name, Failed at once, nothing changed.
    for (job, claim, words) in [
        ("rotate-plain", "plain", vec!["plain", "not encrypted"]),
        (
            "rotate-shared",
            "shared",
            vec!["shared", "\"default\"", "Secret"],
        ),
        ("rotate-gone", "gone", vec!["gone", "not found"]),
    ] {
        create_job(&env, job, claim).await;
        let st = wait_result(&env, job, "Failed").await;
        let msg = st["message"].as_str().unwrap_or_default();
        assert!(words.iter().all(|w| msg.contains(w)), "{job}: {st}");
        assert!(st.get("retries").is_none(), "{job} was retried: {st}");
        env.wait_event(job, "KeyRotationFailed", &words).await;
    }
    assert_eq!(
        snapshot(&env, &shared_vol),
        before_shared,
        "the shared-KMS volume changed"
    );
    assert_eq!(
        snapshot(&env, &plain_vol),
        before_plain,
        "the plain volume changed"
    );

    // A claim bound to another driver's volume: left alone, no status and
    // no event (csi-addons' controller may serve that driver).
    let foreign_pv = format!("{}-foreign", env.ns);
    Api::<k8s_openapi::api::core::v1::PersistentVolume>::all(env.client.clone())
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": foreign_pv},
                "spec": {
                    "capacity": {"storage": "1Mi"},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "claimRef": {"namespace": env.ns, "name": "foreign"},
                    "csi": {"driver": "other.csi.example", "volumeHandle": "elsewhere"},
                },
            })),
        )
        .await
        .unwrap();
    env.claims()
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": "foreign"},
                "spec": {
                    "storageClassName": "",
                    "volumeName": foreign_pv,
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Mi"}},
                },
            })),
        )
        .await
        .unwrap();
    env.wait_bound("foreign").await;
    create_job(&env, "rotate-foreign", "foreign").await;
    support::provisioner::stays(
        "another driver's job untouched",
        std::time::Duration::from_secs(5),
        || async {
            let j = jobs(&env)
                .get("rotate-foreign")
                .await
                .map_err(|e| e.to_string())?;
            let ev = env.event_summary("rotate-foreign").await;
            match (&j.data.get("status"), ev.is_empty()) {
                (None | Some(serde_json::Value::Null), true) => Ok(()),
                (st, _) => Err(format!("status {st:?}, events {ev:?}")),
            }
        },
    )
    .await;
    let _ = Api::<k8s_openapi::api::core::v1::PersistentVolume>::all(env.client.clone())
        .delete(&foreign_pv, &Default::default())
        .await;

    // No passphrase in any status or event.
    let mut text =
        serde_json::to_string(&jobs(&env).list(&Default::default()).await.unwrap()).unwrap();
    for j in [
        "rotate-data",
        "rotate-vault",
        "rotate-pending",
        "rotate-plain",
        "rotate-shared",
        "rotate-gone",
    ] {
        text += &env.event_summary(j).await.join("\n");
    }
    for secret in [KEK, old.expose(), new.expose(), &vold, &vnew] {
        assert!(!text.contains(secret), "a passphrase in a status or event");
    }
    provisioner.stop().await;
}

/// A volume staged on the node (rbdkit-fuse) while its passphrase is
/// rotated keeps working, with no node step: a pod that wrote before the
/// job writes and reads again after it; the next stage opens the volume
/// with the new passphrase and reads both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_staged_volume_keeps_working_through_a_rotation() {
    use support::node::{
        busybox_pod, claim_volume, create_pod, delete_pod, pod_logs, prepare_namespace, wait_phase,
        Node, NodePlugin, POD_WAIT,
    };
    let node = Node::shared();
    let mut env = Env::new("ekrs").await;
    prepare_namespace(&env.client, &env.ns).await;
    let (_dir, kms_flag) = prepare(&env, "ekrs", json!({})).await;
    let provisioner = env.start_in_process_with(&[("--kms-config", kms_flag.as_str())]);
    let plugin = NodePlugin::start_with(
        node,
        &env.client,
        &env.name,
        &env.config_path(),
        &["--kms-config".to_owned(), kms_flag.clone()],
    )
    .await;
    let class = metadata_class(&mut env).await;
    env.claim("data", &class, "64Mi", &["ReadWriteOnce"], "Filesystem")
        .await;
    let vol = volume_id(&env.wait_bound("data").await.1);
    let handle = vol.handle();
    let kek = Secret::new(KEK.to_owned());
    let dek = || {
        let img = Image::open_read_only(&env.rbd.ioctx, &vol.image).unwrap();
        let p = kms::unwrap_dek(&kek, &handle, &img.metadata_list().unwrap()[META_DEK]).unwrap();
        support::artifacts::note_secret(p.expose());
        p
    };
    let old = dek();
    let mounts = json!([{"name": "data", "mountPath": "/data"}]);

    // Staged and written; the job runs while the pod waits; then the
    // pod writes and reads again on the same stage.
    let script = "set -e; echo BEFORE > /data/before; sync -f /data/before; echo written; \
                  while [ ! -e /data/go ] && [ $((i=i+1)) -lt 120 ]; do sleep 1; done; \
                  echo AFTER > /data/after; sync -f /data/after; cat /data/before /data/after";
    let pod = busybox_pod(node, "stay", script, claim_volume("data"), mounts.clone());
    create_pod(&env.client, &env.ns, pod).await;
    wait_phase(node, &env.client, &env.ns, "stay", &["Running"], POD_WAIT).await;
    eventually("the pod wrote", WAIT, || async {
        let log = pod_logs(&env.client, &env.ns, "stay").await;
        if log.contains("written") {
            Ok(())
        } else {
            Err(log)
        }
    })
    .await;
    create_job(&env, "rotate-staged", "data").await;
    wait_result(&env, "rotate-staged", "Succeeded").await;
    let new = dek();
    assert_ne!(new, old, "a new passphrase in the KMS record");
    {
        let img = Image::open_read_only(&env.rbd.ioctx, &vol.image).unwrap();
        let h = Header::read(&img).unwrap();
        assert!(
            h.unlock(&img, old.expose().as_bytes()).is_err(),
            "the old passphrase opens"
        );
    }
    // Tell the pod to go on, through the stage it has (a second pod on the
    // same node shares the RWO volume's stage).
    let pod = busybox_pod(
        node,
        "go",
        "touch /data/go; sync -f /data/go",
        claim_volume("data"),
        mounts.clone(),
    );
    create_pod(&env.client, &env.ns, pod).await;
    wait_phase(node, &env.client, &env.ns, "go", &["Succeeded"], POD_WAIT).await;
    wait_phase(node, &env.client, &env.ns, "stay", &["Succeeded"], POD_WAIT).await;
    let log = pod_logs(&env.client, &env.ns, "stay").await;
    assert!(log.contains("BEFORE\nAFTER"), "pod log: {log}");
    delete_pod(node, &env.client, &env.ns, "go").await;
    delete_pod(node, &env.client, &env.ns, "stay").await;

    // A new stage: the node reads the new passphrase and both files.
    let pod = busybox_pod(
        node,
        "again",
        "cat /data/before /data/after",
        claim_volume("data"),
        mounts,
    );
    create_pod(&env.client, &env.ns, pod).await;
    wait_phase(
        node,
        &env.client,
        &env.ns,
        "again",
        &["Succeeded"],
        POD_WAIT,
    )
    .await;
    let log = pod_logs(&env.client, &env.ns, "again").await;
    assert!(log.contains("BEFORE\nAFTER"), "pod log: {log}");
    delete_pod(node, &env.client, &env.ns, "again").await;
    let text = env.event_summary("rotate-staged").await.join("\n");
    for secret in [KEK, old.expose(), new.expose()] {
        assert!(!text.contains(secret), "a passphrase in an event");
    }
    drop(plugin);
    provisioner.stop().await;
}
