//! Fixtures for the provisioner's end-to-end tests: a Kubernetes namespace,
//! an RBD namespace, a clusters config and a Secret of their own per test,
//! and a provisioner run in process or as a child process.
//!
//! Every test gets its own provisioner name, so provisioners of tests running
//! side by side never touch each other's claims, and its own clusterID mapped
//! to its own RADOS namespace, so image listings are per test.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::future::Future;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use k8s_openapi::api::core::v1::{
    Namespace, PersistentVolume, PersistentVolumeClaim, Secret as K8sSecret,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::Api;
use serde::de::DeserializeOwned;
use serde_json::json;

use rbdkit::provisioner::ProvisionerArgs;
use rbdkit::rbd;
use rbdkit::volume::quantity::parse_bytes;

use super::ceph::{TestCluster, TestNs, POOL};
use super::k8s::ControlPlane;

/// How long any single wait may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(90);

/// A value from JSON, for building API objects tersely.
pub fn from_json<T: DeserializeOwned>(value: serde_json::Value) -> T {
    serde_json::from_value(value).expect("test object does not deserialize")
}

/// The name in a PV's claimRef.
pub fn claim_name(pv: &PersistentVolume) -> Option<&str> {
    pv.spec.as_ref()?.claim_ref.as_ref()?.name.as_deref()
}

/// The `storage` entry of a capacity map (a PV's `spec.capacity`, a claim's
/// `status.capacity`) as written, such as "16Mi"; "" if there is none.
pub fn storage(capacity: &Option<BTreeMap<String, Quantity>>) -> String {
    capacity
        .as_ref()
        .and_then(|m| m.get("storage"))
        .map(|q| q.0.clone())
        .unwrap_or_default()
}

/// The volume of a PV of the CSI driver (its handle parsed).
pub fn volume_id(pv: &PersistentVolume) -> rbdkit::volume::VolumeId {
    let csi = pv
        .spec
        .as_ref()
        .and_then(|s| s.csi.as_ref())
        .expect("a CSI PV");
    rbdkit::volume::VolumeId::parse(&csi.volume_handle).expect("an rbdkit volume handle")
}

/// A PV's capacity in bytes; 0 if it has none (or it does not parse).
pub fn pv_bytes(pv: &PersistentVolume) -> u64 {
    let q = storage(&pv.spec.as_ref().and_then(|s| s.capacity.clone()));
    parse_bytes(&q).unwrap_or(0)
}

/// Polls `f` every 200 ms until it returns `Ok`, for at most `timeout`;
/// then panics with `what` and the last state `f` described.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match f().await {
            Ok(v) => return v,
            Err(state) => state,
        };
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}; last state: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Checks that `f` keeps returning `Ok` for `period` (polling every 200 ms).
pub async fn stays<F, Fut>(what: &str, period: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + period;
    while Instant::now() < deadline {
        if let Err(state) = f().await {
            panic!("expected {what} for {period:?}, but: {state}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[derive(Parser)]
struct ArgsOnly {
    #[command(flatten)]
    args: ProvisionerArgs,
}

/// One test's world.
pub struct Env {
    /// The admin client.
    pub client: kube::Client,
    /// The kubeconfig path.
    pub kubeconfig: PathBuf,
    /// The Kubernetes namespace (claims, Secret, Lease).
    pub ns: String,
    /// The provisioner name.
    pub name: String,
    /// The clusterID in the clusters config.
    pub cluster_id: String,
    /// The RBD namespace the clusterID maps to.
    pub rbd: std::sync::Arc<TestNs>,
    /// The Secret with the provisioner's cephx credentials (a user with
    /// only `profile rbd` on the test pool).
    pub secret: String,
    /// The Secret with the node's cephx credentials.
    pub node_secret: String,
    dir: tempfile::TempDir,
    classes: Vec<String>,
}

impl Env {
    /// Sets up a test world named after `test` (a short lowercase word).
    pub async fn new(test: &str) -> Env {
        Env::new_on(ControlPlane::shared(), test).await
    }

    /// [`Env::new`] on a given control plane (such as a private one the
    /// test will stop).
    pub async fn new_on(cp: &ControlPlane, test: &str) -> Env {
        let client = cp.client().await;
        let ceph = TestCluster::get();
        let id = super::ceph::unique(test);
        let rbd = std::sync::Arc::new(TestNs::new(test));
        let dir = tempfile::tempdir().expect("tempdir");

        let mons = ceph.conf_value("mon host").expect("mon host in ceph.conf");
        let config = json!([{
            "clusterID": id,
            "monitors": [mons],
            "rbd": {"radosNamespace": rbd.name},
        }]);
        std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write config");

        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &from_json(json!({"metadata": {"name": id}})),
            )
            .await
            .expect("create namespace");
        let secrets: Api<K8sSecret> = Api::namespaced(client.clone(), &id);
        // The provisioner and the node run as least-privileged users
        // (deploy/README.md); the fixtures themselves use the admin.
        for (name, user, key) in [
            (
                "ceph-provisioner",
                super::ceph::PROVISIONER_USER,
                super::ceph::provisioner_key(),
            ),
            ("ceph-node", super::ceph::NODE_USER, super::ceph::node_key()),
        ] {
            secrets
                .create(
                    &PostParams::default(),
                    &from_json(json!({
                        "metadata": {"name": name},
                        "stringData": {"userID": user, "userKey": key},
                    })),
                )
                .await
                .expect("create secret");
        }
        Env {
            client,
            kubeconfig: cp.kubeconfig_path().to_owned(),
            name: format!("{id}.rbdkit.test"),
            cluster_id: id.clone(),
            ns: id,
            rbd,
            secret: "ceph-provisioner".into(),
            node_secret: "ceph-node".into(),
            dir,
            classes: Vec::new(),
        }
    }

    /// Puts `passphrase` as `encryptionPassphrase` into the provisioner and
    /// node-stage Secrets (the `default` and `metadata` KMS read it there,
    /// as ceph-csi's docs ask).
    pub async fn set_encryption_passphrase(&self, passphrase: &str) {
        let secrets: Api<K8sSecret> = Api::namespaced(self.client.clone(), &self.ns);
        for s in [&self.secret, &self.node_secret] {
            secrets
                .patch(
                    s,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"stringData": {"encryptionPassphrase": passphrase}})),
                )
                .await
                .expect("put encryptionPassphrase into the Secret");
        }
    }

    /// Makes the Secret of a provisioner user that may also lift fences
    /// ([`super::ceph::FENCER_USER`]) in the test namespace; its name.
    pub async fn fencer_secret(&self) -> String {
        let name = "ceph-fencer".to_owned();
        Api::<K8sSecret>::namespaced(self.client.clone(), &self.ns)
            .create(
                &PostParams::default(),
                &from_json(json!({
                    "metadata": {"name": name},
                    "stringData": {
                        "userID": super::ceph::FENCER_USER,
                        "userKey": super::ceph::fencer_key(),
                    },
                })),
            )
            .await
            .expect("create the fencer's secret");
        name
    }

    /// A copy of the admin kubeconfig that impersonates `user` (such as
    /// `system:serviceaccount:NS:NAME`), to run as that user's RBAC allows.
    pub fn kubeconfig_as(&self, user: &str) -> PathBuf {
        let text = std::fs::read_to_string(&self.kubeconfig).expect("read kubeconfig");
        assert!(text.contains("\n  user:\n"), "unexpected kubeconfig layout");
        let text = text.replace("\n  user:\n", &format!("\n  user:\n    as: {user}\n"));
        let path = self.dir.path().join("kubeconfig-as");
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }

    /// Rewrites the clusters config, mapping `cluster_id` to this test's
    /// cluster and RADOS namespace (atomically, as a ConfigMap update is).
    pub fn write_config(&self, cluster_id: &str) {
        let mons = TestCluster::get()
            .conf_value("mon host")
            .expect("mon host in ceph.conf");
        let config = json!([{
            "clusterID": cluster_id,
            "monitors": [mons],
            "rbd": {"radosNamespace": self.rbd.name},
        }]);
        let tmp = self.dir.path().join("config.json.new");
        std::fs::write(&tmp, config.to_string()).expect("write config");
        std::fs::rename(&tmp, self.config_path()).expect("replace config");
    }

    /// Path of the clusters config.
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("config.json")
    }

    /// Command-line arguments for a provisioner of this test, with short
    /// timings.
    pub fn cli_args(&self, identity: &str) -> Vec<String> {
        self.cli_args_with(identity, &[])
    }

    /// [`Env::cli_args`] with some flags' values replaced (or added).
    pub fn cli_args_with(&self, identity: &str, overrides: &[(&str, &str)]) -> Vec<String> {
        let mut args: Vec<String> = [
            "--name",
            &self.name,
            "--clusters-config",
            self.config_path().to_str().unwrap(),
            "--kubeconfig",
            self.kubeconfig.to_str().unwrap(),
            "--http-addr",
            "127.0.0.1:0",
            "--leader-election-namespace",
            &self.ns,
            "--leader-election-identity",
            identity,
            "--lease-duration",
            "10s",
            "--renew-deadline",
            "7s",
            "--retry-period",
            "1s",
            // The lease must outlast a fenced Ceph step: 10 > 5 + 1 + 1.
            "--ceph-op-timeout",
            "5s",
            "--backoff-base",
            "500ms",
            "--backoff-max",
            "4s",
            "--config-poll",
            "1s",
            "--shutdown-grace",
            "5s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for (flag, value) in overrides {
            match args.iter().position(|a| a == flag) {
                Some(i) => args[i + 1] = value.to_string(),
                None => args.extend([flag.to_string(), value.to_string()]),
            }
        }
        args
    }

    /// Runs a provisioner in this process; it stops when the handle drops.
    pub fn start_in_process(&self) -> InProcess {
        self.start_in_process_with(&[])
    }

    /// [`Env::start_in_process`] with some flags replaced.
    pub fn start_in_process_with(&self, overrides: &[(&str, &str)]) -> InProcess {
        let identity = format!("{}-inproc", self.ns);
        let argv =
            std::iter::once("test".to_owned()).chain(self.cli_args_with(&identity, overrides));
        let args = ArgsOnly::try_parse_from(argv)
            .expect("provisioner args")
            .args;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(rbdkit::provisioner::run_until(args, async move {
            let _ = rx.await;
        }));
        InProcess {
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// Runs `rbdkit provisioner` as a child process known as `identity`,
    /// logging to a file in the test's directory.
    pub fn start_process(&self, identity: &str) -> ChildProvisioner {
        self.start_process_with(identity, &[])
    }

    /// [`Env::start_process`] with some flags replaced.
    pub fn start_process_with(
        &self,
        identity: &str,
        overrides: &[(&str, &str)],
    ) -> ChildProvisioner {
        let log = self.dir.path().join(format!("{identity}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_rbdkit"))
            .arg("provisioner")
            .args(self.cli_args_with(identity, overrides))
            .args(["--log-format", "json"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .expect("start rbdkit provisioner");
        ChildProvisioner {
            child: Some(child),
            log,
            identity: identity.to_owned(),
        }
    }

    /// Creates a StorageClass of this test's provisioner. `params` are added
    /// to (or, with a `null` value, removed from) the usual ones; `extra`
    /// holds top-level fields such as `reclaimPolicy`.
    pub async fn storage_class(
        &mut self,
        suffix: &str,
        params: serde_json::Value,
        extra: serde_json::Value,
    ) -> String {
        let name = format!("{}-{suffix}", self.ns);
        let mut p = serde_json::Map::new();
        for (k, v) in [
            ("clusterID", self.cluster_id.as_str()),
            ("pool", POOL),
            ("imageFeatures", "layering,exclusive-lock"),
            ("csi.storage.k8s.io/provisioner-secret-name", &self.secret),
            (
                "csi.storage.k8s.io/provisioner-secret-namespace",
                "${pvc.namespace}",
            ),
            (
                "csi.storage.k8s.io/controller-expand-secret-name",
                &self.secret,
            ),
            (
                "csi.storage.k8s.io/controller-expand-secret-namespace",
                &self.ns,
            ),
            (
                "csi.storage.k8s.io/node-stage-secret-name",
                &self.node_secret,
            ),
            ("csi.storage.k8s.io/node-stage-secret-namespace", &self.ns),
        ] {
            p.insert(k.into(), json!(v));
        }
        if let serde_json::Value::Object(over) = params {
            for (k, v) in over {
                if v.is_null() {
                    p.remove(&k);
                } else {
                    p.insert(k, v);
                }
            }
        }
        let mut sc = json!({
            "metadata": {"name": name},
            "provisioner": self.name,
            "parameters": p,
        });
        if let serde_json::Value::Object(extra) = extra {
            for (k, v) in extra {
                sc[k] = v;
            }
        }
        let classes: Api<StorageClass> = Api::all(self.client.clone());
        classes
            .create(&PostParams::default(), &from_json(sc))
            .await
            .expect("create storage class");
        self.classes.push(name.clone());
        name
    }

    /// The claims API of the test namespace.
    pub fn claims(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The PV API.
    pub fn pvs(&self) -> Api<PersistentVolume> {
        Api::all(self.client.clone())
    }

    /// The PVs whose CSI driver is this test's provisioner.
    pub async fn our_pvs(&self) -> Result<Vec<PersistentVolume>, String> {
        let pvs = self
            .pvs()
            .list(&Default::default())
            .await
            .map_err(|e| format!("cannot list PVs: {e}"))?;
        Ok(pvs
            .items
            .into_iter()
            .filter(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.csi.as_ref())
                    .is_some_and(|c| c.driver == self.name)
            })
            .collect())
    }

    /// Creates a claim.
    pub async fn claim(
        &self,
        name: &str,
        class: &str,
        size: &str,
        modes: &[&str],
        volume_mode: &str,
    ) -> PersistentVolumeClaim {
        self.claims()
            .create(
                &PostParams::default(),
                &from_json(json!({
                    "metadata": {"name": name},
                    "spec": {
                        "storageClassName": class,
                        "accessModes": modes,
                        "volumeMode": volume_mode,
                        "resources": {"requests": {"storage": size}},
                    },
                })),
            )
            .await
            .expect("create claim")
    }

    /// Waits until the claim is Bound and returns it with its PV.
    pub async fn wait_bound(&self, claim: &str) -> (PersistentVolumeClaim, PersistentVolume) {
        let claims = self.claims();
        let c = eventually(&format!("claim {claim} Bound"), WAIT, || async {
            let c = claims.get(claim).await.map_err(|e| e.to_string())?;
            let phase = c.status.as_ref().and_then(|s| s.phase.clone());
            if phase.as_deref() == Some("Bound") {
                Ok(c)
            } else {
                Err(format!(
                    "phase {phase:?}; annotations {:?}; events {:?}",
                    c.metadata.annotations,
                    self.event_summary(claim).await
                ))
            }
        })
        .await;
        let pv_name = c.spec.as_ref().unwrap().volume_name.clone().unwrap();
        let pv = self.pvs().get(&pv_name).await.expect("get PV");
        (c, pv)
    }

    /// Waits until no claim in the namespace keeps the provisioner's
    /// finalizer. The provisioner drops it only after the binder has
    /// written the claim's Bound phase, so a test that has just seen Bound
    /// must wait for it; one kept past `WAIT` is stuck.
    pub async fn wait_claim_finalizers_dropped(&self) -> usize {
        let claims = self.claims();
        eventually(
            "no claim keeping the provisioning finalizer",
            WAIT,
            || async {
                let list = claims
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?;
                let kept: Vec<String> = list
                    .items
                    .iter()
                    .filter(|c| {
                        let f = c.metadata.finalizers.as_deref().unwrap_or_default();
                        f.iter()
                            .any(|f| f == rbdkit::provisioner::controller::CLAIM_FINALIZER)
                    })
                    .filter_map(|c| c.metadata.name.clone())
                    .collect();
                if kept.is_empty() {
                    Ok(list.items.len())
                } else {
                    Err(format!("kept by {kept:?}"))
                }
            },
        )
        .await
    }

    /// Claim `claim`'s finalizers.
    pub async fn claim_finalizers(&self, claim: &str) -> Vec<String> {
        let c = self.claims().get(claim).await;
        let c = c.unwrap_or_else(|e| panic!("get claim {claim}: {e}"));
        c.metadata.finalizers.unwrap_or_default()
    }

    /// Claim `claim`'s phase ("" before it has one).
    pub async fn claim_phase(&self, claim: &str) -> String {
        let c = self.claims().get(claim).await;
        let c = c.unwrap_or_else(|e| panic!("get claim {claim}: {e}"));
        c.status.and_then(|s| s.phase).unwrap_or_default()
    }

    /// Waits until an object is gone.
    pub async fn wait_gone<K>(&self, api: &Api<K>, name: &str)
    where
        K: Clone + DeserializeOwned + Debug,
    {
        eventually(&format!("{name} gone"), WAIT, || async {
            match api.get_opt(name).await {
                Ok(None) => Ok(()),
                Ok(Some(o)) => Err(format!("still there: {o:?}")),
                Err(e) => Err(e.to_string()),
            }
        })
        .await
    }

    /// Events about `object` (a claim in the test namespace, or a PV, whose
    /// events go to `default`).
    pub async fn events(&self, object: &str) -> Vec<Event> {
        let mut out = Vec::new();
        for ns in [self.ns.as_str(), "default"] {
            let api: Api<Event> = Api::namespaced(self.client.clone(), ns);
            if let Ok(list) = api.list(&ListParams::default()).await {
                out.extend(list.items.into_iter().filter(|e| {
                    e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(object)
                }));
            }
        }
        out
    }

    /// `reason: note` of the events about `object`.
    pub async fn event_summary(&self, object: &str) -> Vec<String> {
        self.events(object)
            .await
            .iter()
            .map(|e| {
                format!(
                    "{}: {}",
                    e.reason.clone().unwrap_or_default(),
                    e.note.clone().unwrap_or_default()
                )
            })
            .collect()
    }

    /// Waits for an event with `reason` about `object` whose note contains
    /// every one of `words`, and returns it.
    pub async fn wait_event(&self, object: &str, reason: &str, words: &[&str]) -> Event {
        let what = format!("event {reason} on {object} with {words:?}");
        eventually(&what, WAIT, || async {
            let events = self.events(object).await;
            let found = events.iter().find(|e| {
                e.reason.as_deref() == Some(reason)
                    && words
                        .iter()
                        .all(|w| e.note.as_deref().unwrap_or("").contains(w))
            });
            match found {
                Some(e) => Ok(e.clone()),
                None => Err(format!("events: {:?}", self.event_summary(object).await)),
            }
        })
        .await
    }

    /// Image names in the test's RADOS namespace.
    pub fn images(&self) -> Vec<String> {
        rbd::list_names(&self.rbd.ioctx).expect("list images")
    }

    /// The names in the test namespace's RBD trash.
    pub fn trash(&self) -> Vec<String> {
        rbd::trash_list(&self.rbd.ioctx)
            .expect("trash list")
            .into_iter()
            .map(|e| e.name)
            .collect()
    }

    /// The user snapshots of `image` (a temporary one left behind shows).
    pub fn user_snaps(&self, image: &str) -> Vec<String> {
        let img = rbd::Image::open_read_only(&self.rbd.ioctx, image).expect("open");
        img.snap_list()
            .expect("snap list")
            .into_iter()
            .filter(|s| {
                img.snap_namespace_type(s.id).expect("snapshot namespace")
                    == rbd::SnapNamespaceType::User
            })
            .map(|s| s.name)
            .collect()
    }

    /// Deletes a claim.
    pub async fn delete_claim(&self, name: &str) {
        self.claims()
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete claim");
    }

    /// Patches a claim's storage request.
    pub async fn resize_claim(&self, name: &str, size: &str) {
        self.claims()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"resources": {"requests": {"storage": size}}}})),
            )
            .await
            .expect("resize claim");
    }

    /// Sets annotations on a claim.
    pub async fn annotate_claim(&self, name: &str, annotations: BTreeMap<&str, &str>) {
        self.claims()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": annotations}})),
            )
            .await
            .expect("annotate claim");
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // Best effort, without blocking on the runtime: the namespace (and
        // with it claims, Secret, Lease) and the classes. PVs left behind are
        // removed with their finalizers stripped.
        let client = self.client.clone();
        let ns = self.ns.clone();
        let classes = std::mem::take(&mut self.classes);
        let name = self.name.clone();
        let logs: Vec<PathBuf> = std::fs::read_dir(self.dir.path())
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        for log in logs
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
        {
            super::artifacts::copy(&format!("env-{}", self.ns), log);
        }
        let cleanup = async move {
            dump_for_key_grep(&client, &ns, &name).await;
            let pvs: Api<PersistentVolume> = Api::all(client.clone());
            if let Ok(list) = pvs.list(&ListParams::default()).await {
                for pv in list.items {
                    let ours = pv
                        .spec
                        .as_ref()
                        .and_then(|s| s.csi.as_ref())
                        .is_some_and(|c| c.driver == name);
                    if ours {
                        let n = pv.metadata.name.clone().unwrap_or_default();
                        let _ = pvs
                            .patch(
                                &n,
                                &PatchParams::default(),
                                &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                            )
                            .await;
                        let _ = pvs.delete(&n, &DeleteParams::default()).await;
                    }
                }
            }
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
            if let Ok(list) = claims.list(&ListParams::default()).await {
                for c in list.items {
                    let n = c.metadata.name.clone().unwrap_or_default();
                    let _ = claims
                        .patch(
                            &n,
                            &PatchParams::default(),
                            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                        )
                        .await;
                }
            }
            let namespaces: Api<Namespace> = Api::all(client.clone());
            let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
            let sc: Api<StorageClass> = Api::all(client);
            for c in classes {
                let _ = sc.delete(&c, &DeleteParams::default()).await;
            }
        };
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            // Run to completion on a separate thread so Drop can wait.
            let _ = std::thread::scope(|s| {
                s.spawn(|| {
                    handle.block_on(async {
                        tokio::time::timeout(Duration::from_secs(20), cleanup).await
                    })
                })
                .join()
            });
        }
    }
}

/// Saves the events, claims and PVs a test produced to the run's
/// artifacts, for the key grep.
async fn dump_for_key_grep(client: &kube::Client, ns: &str, driver: &str) {
    if super::artifacts::dir().is_none() {
        return;
    }
    let group = format!("env-{ns}");
    let lp = ListParams::default();
    let mut events = Vec::new();
    for n in [ns, "default"] {
        let api: Api<Event> = Api::namespaced(client.clone(), n);
        if let Ok(list) = api.list(&lp).await {
            events.extend(list.items.into_iter().filter(|e| {
                n == ns
                    || e.reporting_controller.as_deref() == Some(driver)
                    || e.regarding
                        .as_ref()
                        .and_then(|r| r.name.as_deref())
                        .is_some_and(|r| r.starts_with("pvc-") || r.starts_with(ns))
            }));
        }
    }
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pvs: Vec<PersistentVolume> = pvs
        .list(&lp)
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|pv| {
            pv.spec
                .as_ref()
                .and_then(|s| s.csi.as_ref())
                .is_some_and(|c| c.driver == driver)
        })
        .collect();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let claims = claims.list(&lp).await.map(|l| l.items).unwrap_or_default();
    let pretty = |v: serde_json::Result<String>| v.unwrap_or_default();
    super::artifacts::save(
        &group,
        "events.json",
        pretty(serde_json::to_string_pretty(&events)).as_bytes(),
    );
    super::artifacts::save(
        &group,
        "pvs.json",
        pretty(serde_json::to_string_pretty(&pvs)).as_bytes(),
    );
    super::artifacts::save(
        &group,
        "claims.json",
        pretty(serde_json::to_string_pretty(&claims)).as_bytes(),
    );
}

/// A provisioner running as a task of the test process.
pub struct InProcess {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl InProcess {
    /// Asks it to stop and waits until it has.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            match tokio::time::timeout(Duration::from_secs(30), task).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => panic!("provisioner failed: {e:#}"),
                Ok(Err(e)) => panic!("provisioner task failed: {e}"),
                Err(_) => panic!("provisioner did not stop within 30 s"),
            }
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A provisioner running as a child process.
pub struct ChildProvisioner {
    child: Option<Child>,
    /// Its log file.
    pub log: PathBuf,
    /// Its identity in the Lease.
    pub identity: String,
}

impl ChildProvisioner {
    /// Kills it with SIGKILL, as a crash or OOM kill would, and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM and waits (at most 30 s) for it to exit; returns its
    /// exit status and how long it took.
    pub fn terminate(&mut self) -> (std::process::ExitStatus, Duration) {
        let mut c = self.child.take().expect("running");
        let started = Instant::now();
        let status = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
        loop {
            if let Some(status) = c.try_wait().expect("wait") {
                return (status, started.elapsed());
            }
            if started.elapsed() > Duration::from_secs(30) {
                let _ = c.kill();
                panic!("no exit 30 s after SIGTERM:\n{}", self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// The whole log.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The address of its HTTP server, from its (JSON) log.
    pub async fn http_addr(&self) -> std::net::SocketAddr {
        eventually(&format!("{} to listen", self.identity), WAIT, || async {
            self.log_text()
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .find_map(|v| v.get("http")?.as_str()?.parse().ok())
                .ok_or_else(|| format!("log so far:\n{}", self.log_tail()))
        })
        .await
    }

    /// The end of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for ChildProvisioner {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- log of provisioner {} ({}) ---\n{}",
                self.identity,
                self.log.display(),
                self.log_tail()
            );
        }
        self.kill9();
        // For the run's key grep.
        let group = self
            .log
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| format!("provisioner-{}", n.to_string_lossy()))
            .unwrap_or_else(|| "provisioner".into());
        super::artifacts::copy(&group, &self.log);
    }
}

/// A plain HTTP/1.1 GET: the status code and the body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send request");
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .expect("response in time")
        .expect("read response");
    let text = String::from_utf8_lossy(&response).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    if path.starts_with("/metrics") {
        super::artifacts::save(
            "metrics",
            &super::artifacts::unique_name("metrics", "txt"),
            body.as_bytes(),
        );
    }
    (code, body)
}

/// Polls `addr`'s `/readyz` until it answers 200 with a body `ok` accepts,
/// for at most [`WAIT`]; returns that body.
pub async fn wait_readyz(
    addr: std::net::SocketAddr,
    what: &str,
    ok: impl Fn(&str) -> bool,
) -> String {
    eventually(what, WAIT, || async {
        match http_get(addr, "/readyz").await {
            (200, b) if ok(&b) => Ok(b),
            other => Err(format!("{other:?}")),
        }
    })
    .await
}
