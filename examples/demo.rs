//! The provisioner demo, driven by `scripts/demo-provisioner`: with a Ceph
//! cluster, a control plane and `rbdkit provisioner` running, it applies the
//! example StorageClass, Secret and PVC from `deploy/`, shows the claim Bound
//! and the image it got, expands the claim, deletes it and shows the image
//! gone.
//!
//! ```text
//! cargo run --example demo -- --kubeconfig K --ceph-conf C --deploy deploy \
//!   --user-id kubernetes --user-key-file KEYFILE
//! ```
//!
//! The cephx key is read from a file only its owner can read (mode 0600) and
//! only goes into the Secret: never into argv or the environment.

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
    println!("\n\x1b[1m-- {text}\x1b[0m");
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
