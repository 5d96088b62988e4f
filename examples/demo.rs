//! The provisioner demo, driven by `scripts/demo-provisioner`: with a Ceph
//! cluster, a control plane and `rbdkit provisioner` running, it applies the
//! example StorageClass, Secret and PVC from `deploy/`, shows the claim Bound
//! and the image it got, expands the claim, deletes it and shows the image
//! gone. With `--csi-socket` it also plays kubelet on this machine: it
//! stages and publishes the volume through `rbdkit csi --mode node`
//! (NodeStageVolume, NodePublishVolume), writes and reads a file, grows the
//! filesystem after the expansion (NodeExpandVolume), then unpublishes and
//! unstages it.
//!
//! ```text
//! cargo run --example demo -- --kubeconfig K --ceph-conf C --deploy deploy \
//!   --user-id kubernetes --user-key-file KEYFILE \
//!   [--csi-socket SOCK --work DIR --mapper-state-dir DIR]
//! ```
//!
//! The cephx key is read from a file only its owner can read (mode 0600) and
//! only goes into the Secret and the node-stage secrets of the gRPC calls
//! (over the unix socket): never into argv or the environment.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Parser;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Secret};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tonic::transport::Channel;

use rbdkit::csi::client::unix_channel;
use rbdkit::csi::proto::node_client::NodeClient;
use rbdkit::csi::proto::{
    volume_capability, CapacityRange, NodeExpandVolumeRequest, NodePublishVolumeRequest,
    NodeStageVolumeRequest, NodeUnpublishVolumeRequest, NodeUnstageVolumeRequest, VolumeCapability,
};
use rbdkit::rados::{Cluster, ConnectOptions};
use rbdkit::rbd::{self, Image};
use rbdkit::volume::ops::owner_metadata;
use rbdkit::volume::VolumeId;

#[derive(Parser)]
struct Args {
    /// The control plane's kubeconfig.
    #[arg(long)]
    kubeconfig: PathBuf,
    /// A ceph.conf with an admin keyring, to look at the images.
    #[arg(long)]
    ceph_conf: PathBuf,
    /// The deploy/ directory.
    #[arg(long, default_value = "deploy")]
    deploy: PathBuf,
    /// The cephx user the Secret names.
    #[arg(long, default_value = "kubernetes")]
    user_id: String,
    /// A file (mode 0600) holding that user's cephx key.
    #[arg(long)]
    user_key_file: PathBuf,
    /// The size to expand the claim to.
    #[arg(long, default_value = "2Gi")]
    expand_to: String,
    /// The socket of `rbdkit csi --mode node`: stage and mount the volume.
    #[arg(long)]
    csi_socket: Option<PathBuf>,
    /// Where the staging and target paths go (with `--csi-socket`).
    #[arg(long, default_value = "/tmp")]
    work: PathBuf,
    /// The userspace mapper's state dir: no loop device may be left on a
    /// file under it at the end.
    #[arg(long)]
    mapper_state_dir: Option<PathBuf>,
}

const WAIT: Duration = Duration::from_secs(120);
const FIELD_MANAGER: &str = "rbdkit-demo";

/// The key in `path`, which must not be readable by group or others.
fn read_key_file(path: &Path) -> anyhow::Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)
        .with_context(|| format!("stat {}", path.display()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        bail!(
            "{} is readable by others (mode {:o}); chmod 600 it",
            path.display(),
            mode & 0o777
        );
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    Ok(text.trim().to_owned())
}

fn step(text: &str) {
    use std::io::IsTerminal as _;
    if std::io::stdout().is_terminal() {
        println!("\n\x1b[1m-- {text}\x1b[0m");
    } else {
        println!("\n-- {text}");
    }
}

/// The one document in a YAML file, as `T`.
fn load<T: DeserializeOwned>(path: &Path) -> anyhow::Result<(T, Value)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let value: Value =
        serde_saphyr::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
    let typed = serde_json::from_value(value.clone())
        .with_context(|| format!("{} is not the expected kind", path.display()))?;
    Ok((typed, value))
}

async fn apply<K>(api: &Api<K>, obj: &Value) -> anyhow::Result<K>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let name = obj["metadata"]["name"]
        .as_str()
        .context("manifest without a name")?;
    let kind = obj["kind"].as_str().unwrap_or("object");
    let out = api
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(obj),
        )
        .await
        .with_context(|| format!("apply {kind} {name}"))?;
    println!("applied {kind} {name}");
    Ok(out)
}

/// Polls `f` until it returns `Some`, at most [`WAIT`].
async fn wait_for<T, F, Fut>(what: &str, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await? {
            println!("{what}: after {:.1?}", start.elapsed());
            return Ok(v);
        }
        if start.elapsed() > WAIT {
            bail!("{what}: not after {WAIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn storage(
    q: Option<
        &std::collections::BTreeMap<
            String,
            k8s_openapi::apimachinery::pkg::api::resource::Quantity,
        >,
    >,
) -> String {
    q.and_then(|m| m.get("storage"))
        .map(|q| q.0.clone())
        .unwrap_or_else(|| "-".into())
}

async fn show_image(cluster: &Cluster, vol: &VolumeId) -> anyhow::Result<()> {
    let (cluster, vol) = (cluster.clone(), vol.clone());
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let io = cluster.ioctx_ns(&vol.pool, &vol.rados_namespace)?;
        let image = Image::open_read_only(&io, &vol.image)?;
        println!("image {}:", image.spec());
        println!("  size      {} MiB", image.size()? >> 20);
        println!("  features  {}", image.features()?);
        for (k, v) in owner_metadata(&image)? {
            println!("  {k:<20} {v}");
        }
        Ok(())
    })
    .await?
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = rbdkit::k8s::client::client(Some(&args.kubeconfig)).await?;
    let conf = args.ceph_conf.clone();
    let cluster =
        tokio::task::spawn_blocking(move || ConnectOptions::new().conf_file(conf).connect())
            .await??;

    step("Apply the example from deploy/: Namespace, Secret, StorageClass, PVC");
    let (_, ns_doc) = load::<Namespace>(&args.deploy.join("namespace.yaml"))?;
    apply(&Api::<Namespace>::all(client.clone()), &ns_doc).await?;
    let (secret, mut secret_doc) = load::<Secret>(&args.deploy.join("example/secret.yaml"))?;
    let key = read_key_file(&args.user_key_file)?;
    secret_doc["stringData"] = json!({"userID": args.user_id, "userKey": key});
    let secrets: Api<Secret> =
        Api::namespaced(client.clone(), &secret.namespace().unwrap_or_default());
    apply(&secrets, &secret_doc).await?;
    let (class, class_doc) = load::<StorageClass>(&args.deploy.join("example/storageclass.yaml"))?;
    let classes: Api<StorageClass> = Api::all(client.clone());
    apply(&classes, &class_doc).await?;
    let (claim, claim_doc) = load::<PersistentVolumeClaim>(&args.deploy.join("example/pvc.yaml"))?;
    let claim_name = claim.name_any();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(
        client.clone(),
        &claim.namespace().unwrap_or_else(|| "default".into()),
    );
    apply(&claims, &claim_doc).await?;

    step("Wait for the claim to be Bound");
    let bound = wait_for("claim Bound", || async {
        let c = claims.get(&claim_name).await?;
        let phase = c.status.as_ref().and_then(|s| s.phase.clone());
        Ok((phase.as_deref() == Some("Bound")).then_some(c))
    })
    .await?;
    let pv_name = bound
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .context("no volume")?;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let pv = pvs.get(&pv_name).await?;
    let pv_spec = pv.spec.clone().unwrap_or_default();
    let csi = pv_spec.csi.clone().context("not a CSI PV")?;
    println!("claim {claim_name}: Bound to {pv_name}");
    println!("PV {pv_name}:");
    println!("  capacity      {}", storage(pv_spec.capacity.as_ref()));
    println!("  driver        {}", csi.driver);
    println!("  volumeHandle  {}", csi.volume_handle);
    println!(
        "  fsType        {}",
        csi.fs_type.clone().unwrap_or_default()
    );
    println!(
        "  reclaim       {}",
        pv_spec
            .persistent_volume_reclaim_policy
            .clone()
            .unwrap_or_default()
    );
    let vol = VolumeId::parse(&csi.volume_handle).map_err(anyhow::Error::msg)?;
    show_image(&cluster, &vol).await?;

    const FILE: &str = "hello.txt";
    let text = format!("hello from {pv_name}\n");
    let mut node = None;
    if let Some(sock) = &args.csi_socket {
        step("Mount it on this node, as kubelet would (NodeStageVolume, NodePublishVolume)");
        let mut n = NodeDemo::new(&args, sock, &pv_spec, &key).await?;
        n.stage_and_publish().await?;
        n.write_file(FILE, &text)?;
        n.check_file(FILE, &text)?;
        node = Some(n);
    }

    step(&format!("Expand the claim to {}", args.expand_to));
    claims
        .patch(
            &claim_name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"resources": {"requests": {"storage": args.expand_to}}}}),
            ),
        )
        .await?;
    let expanded = wait_for("PV capacity updated", || async {
        let p = pvs.get(&pv_name).await?;
        let cap = storage(p.spec.as_ref().and_then(|s| s.capacity.as_ref()));
        let claim = claims.get(&claim_name).await?;
        let pending = claim
            .status
            .as_ref()
            .and_then(|s| s.allocated_resource_statuses.as_ref())
            .and_then(|s| s.get("storage").cloned());
        Ok((cap == args.expand_to && pending.is_some()).then_some((cap, pending, claim)))
    })
    .await?;
    println!(
        "PV capacity {}; claim resize status {:?}",
        expanded.0,
        expanded.1.unwrap_or_default()
    );
    for c in expanded
        .2
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
    {
        println!(
            "claim condition {}: {}",
            c.type_,
            c.message.unwrap_or_default()
        );
    }
    show_image(&cluster, &vol).await?;

    if let Some(n) = node.as_mut() {
        step(
            "Grow the filesystem (NodeExpandVolume, what kubelet does on FileSystemResizePending)",
        );
        let bytes = i64::try_from(
            rbdkit::volume::quantity::parse_bytes(&args.expand_to)
                .map_err(|e| anyhow::anyhow!("--expand-to: {e}"))?,
        )?;
        n.expand(bytes).await?;
        // kubelet then records the new size on the claim and clears the
        // condition; the demo does the same.
        claims
            .patch_status(
                &claim_name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "capacity": {"storage": args.expand_to},
                    "conditions": null,
                    "allocatedResourceStatuses": null,
                }})),
            )
            .await
            .context("mark the claim resized")?;
        let c = claims.get(&claim_name).await?;
        let st = c.status.unwrap_or_default();
        println!(
            "claim {claim_name}: capacity {}, conditions {:?}",
            storage(st.capacity.as_ref()),
            st.conditions
                .unwrap_or_default()
                .iter()
                .map(|c| c.type_.clone())
                .collect::<Vec<_>>()
        );
        n.check_file(FILE, &text)?;

        step("Unmount it (NodeUnpublishVolume, NodeUnstageVolume)");
        n.unpublish_and_unstage().await?;
    }

    step("Delete the claim");
    claims.delete(&claim_name, &DeleteParams::default()).await?;
    wait_for("PV deleted", || async {
        Ok(pvs.get_opt(&pv_name).await?.is_none().then_some(()))
    })
    .await?;
    let (c, v) = (cluster.clone(), vol.clone());
    let left = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<String>> {
        let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
        Ok(rbd::list_names(&io)?)
    })
    .await??;
    println!("images in pool {}: {left:?}", vol.pool);
    if left.contains(&vol.image) {
        bail!("image {} is still there", vol.image);
    }
    println!("image {} is gone", vol.image);

    step("Remove the StorageClass and the Secret");
    classes
        .delete(&class.name_any(), &DeleteParams::default())
        .await?;
    secrets
        .delete(&secret.name_any(), &DeleteParams::default())
        .await?;
    println!("done");
    Ok(())
}

/// Kubelet's side of one volume: the CSI node calls over a unix socket.
struct NodeDemo {
    client: NodeClient<Channel>,
    volume_id: String,
    context: HashMap<String, String>,
    /// userID and userKey, as kubelet reads them from the node-stage Secret.
    secrets: HashMap<String, String>,
    cap: VolumeCapability,
    staging: PathBuf,
    target: PathBuf,
    mapper_state_dir: Option<PathBuf>,
}

/// The filesystem size at `path`, in MiB.
fn size_mib(path: &Path) -> anyhow::Result<u64> {
    Ok(rbdkit::node::fs::stats(path)?.total_bytes >> 20)
}

impl NodeDemo {
    async fn new(
        args: &Args,
        socket: &Path,
        pv: &k8s_openapi::api::core::v1::PersistentVolumeSpec,
        key: &str,
    ) -> anyhow::Result<NodeDemo> {
        let csi = pv.csi.as_ref().context("not a CSI PV")?;
        let block = pv.volume_mode.as_deref() == Some("Block");
        let access_modes = pv.access_modes.clone().unwrap_or_default();
        let mode = if access_modes.iter().any(|m| m == "ReadWriteOnce") {
            volume_capability::access_mode::Mode::SingleNodeWriter
        } else {
            bail!("the demo mounts ReadWriteOnce volumes only, not {access_modes:?}");
        };
        let access_type = if block {
            volume_capability::AccessType::Block(volume_capability::BlockVolume {})
        } else {
            volume_capability::AccessType::Mount(volume_capability::MountVolume {
                fs_type: csi.fs_type.clone().unwrap_or_default(),
                mount_flags: pv.mount_options.clone().unwrap_or_default(),
                ..Default::default()
            })
        };
        anyhow::ensure!(!block, "the demo mounts Filesystem volumes only");
        let staging = args.work.join("staging");
        // kubelet makes the staging folder and the target's parent.
        std::fs::create_dir_all(&staging)
            .with_context(|| format!("create {}", staging.display()))?;
        std::fs::create_dir_all(args.work.join("pods"))?;
        Ok(NodeDemo {
            client: NodeClient::new(
                unix_channel(
                    socket,
                    Duration::from_secs(30),
                    Some(Duration::from_secs(120)),
                )
                .await
                .with_context(|| format!("cannot reach {}", socket.display()))?,
            ),
            volume_id: csi.volume_handle.clone(),
            context: csi
                .volume_attributes
                .clone()
                .unwrap_or_default()
                .into_iter()
                .collect(),
            secrets: HashMap::from([
                ("userID".to_owned(), args.user_id.clone()),
                ("userKey".to_owned(), key.to_owned()),
            ]),
            cap: VolumeCapability {
                access_mode: Some(volume_capability::AccessMode { mode: mode as i32 }),
                access_type: Some(access_type),
            },
            staging,
            target: args.work.join("pods/demo-pod/mount"),
            mapper_state_dir: args.mapper_state_dir.clone(),
        })
    }

    async fn stage_and_publish(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        self.client
            .node_stage_volume(NodeStageVolumeRequest {
                volume_id: self.volume_id.clone(),
                staging_target_path: self.staging.display().to_string(),
                volume_capability: Some(self.cap.clone()),
                secrets: self.secrets.clone(),
                volume_context: self.context.clone(),
                ..Default::default()
            })
            .await
            .context("NodeStageVolume")?;
        println!("NodeStageVolume: done in {:.1?}", started.elapsed());
        let started = Instant::now();
        self.client
            .node_publish_volume(NodePublishVolumeRequest {
                volume_id: self.volume_id.clone(),
                staging_target_path: self.staging.display().to_string(),
                target_path: self.target.display().to_string(),
                volume_capability: Some(self.cap.clone()),
                volume_context: self.context.clone(),
                ..Default::default()
            })
            .await
            .context("NodePublishVolume")?;
        println!("NodePublishVolume: done in {:.1?}", started.elapsed());
        let m = rbdkit::node::mount::mounted_at(&self.target)?
            .with_context(|| format!("nothing is mounted at {}", self.target.display()))?;
        println!(
            "mounted {} ({}, {} MiB) at {} [{}]",
            m.source,
            m.fstype,
            size_mib(&self.target)?,
            self.target.display(),
            m.mount_options.join(",")
        );
        Ok(())
    }

    fn write_file(&self, name: &str, text: &str) -> anyhow::Result<()> {
        use std::io::Write as _;
        let path = self.target.join(name);
        let mut f =
            std::fs::File::create(&path).with_context(|| format!("create {}", path.display()))?;
        f.write_all(text.as_bytes())?;
        // fsync: the data is in the RBD image when this returns.
        f.sync_all()?;
        println!(
            "wrote and fsynced {} ({} bytes)",
            path.display(),
            text.len()
        );
        Ok(())
    }

    fn check_file(&self, name: &str, text: &str) -> anyhow::Result<()> {
        let path = self.target.join(name);
        let back =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        anyhow::ensure!(back == text, "{} reads {back:?}", path.display());
        println!("read back {}: {:?}", path.display(), back.trim_end());
        Ok(())
    }

    async fn expand(&mut self, bytes: i64) -> anyhow::Result<()> {
        let before = size_mib(&self.target)?;
        let resp = self
            .client
            .node_expand_volume(NodeExpandVolumeRequest {
                volume_id: self.volume_id.clone(),
                volume_path: self.target.display().to_string(),
                staging_target_path: self.staging.display().to_string(),
                capacity_range: Some(CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                volume_capability: Some(self.cap.clone()),
                ..Default::default()
            })
            .await
            .context("NodeExpandVolume")?
            .into_inner();
        let after = size_mib(&self.target)?;
        println!(
            "NodeExpandVolume: device {} MiB; filesystem {before} MiB -> {after} MiB (grown while mounted)",
            resp.capacity_bytes >> 20
        );
        anyhow::ensure!(after > before, "the filesystem did not grow");
        Ok(())
    }

    async fn unpublish_and_unstage(&mut self) -> anyhow::Result<()> {
        self.client
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: self.volume_id.clone(),
                target_path: self.target.display().to_string(),
            })
            .await
            .context("NodeUnpublishVolume")?;
        println!("NodeUnpublishVolume: done");
        self.client
            .node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: self.volume_id.clone(),
                staging_target_path: self.staging.display().to_string(),
            })
            .await
            .context("NodeUnstageVolume")?;
        println!("NodeUnstageVolume: done");
        for p in [&self.target, &self.staging] {
            if let Some(m) = rbdkit::node::mount::mounts_at(p)?.first() {
                bail!("{} is still mounted at {}", m.source, p.display());
            }
        }
        if let Some(dir) = &self.mapper_state_dir {
            let left = loop_devices_under(dir)?;
            anyhow::ensure!(left.is_empty(), "loop devices left: {left:?}");
        }
        println!("no mount and no loop device left");
        Ok(())
    }
}

/// Loop devices whose backing file is under `dir`.
fn loop_devices_under(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block")? {
        let e = e?;
        let back = e.path().join("loop/backing_file");
        if let Ok(file) = std::fs::read_to_string(&back) {
            if Path::new(file.trim()).starts_with(dir) {
                out.push(format!(
                    "/dev/{} on {}",
                    e.file_name().to_string_lossy(),
                    file.trim()
                ));
            }
        }
    }
    Ok(out)
}
