//! `rbdkit migrate`: turns PVs of the old RBD provisioners (rbd-provisioner,
//! the in-tree plugin, rook flex) into rbdkit CSI PVs on the same images,
//! with no data moved. The legacy logic is [`crate::volume::legacy`]; this
//! is the Kubernetes side, the steps and the report.
//!
//! A dry run by default. With `--apply`, per PV:
//! 1. the image is checked: it must exist, and carry no other rbdkit
//!    owner's record;
//! 2. the PV's reclaim policy is set to Retain, the original kept in the
//!    annotation [`ORIGINAL_RECLAIM_POLICY`];
//! 3. rbdkit's owner record is written onto the image;
//! 4. the CSI PV is recorded on the claim ([`CLAIM_RECORD`]), the old PV is
//!    deleted (its finalizers dropped: a Bound PV's pv-protection finalizer
//!    is otherwise never removed) and the CSI PV created under the same name
//!    with the same claimRef;
//! 5. the original reclaim policy is restored and the claim's record
//!    dropped. [`MIGRATED_FROM`] on the PV says when and from what.
//!
//! Every step is idempotent and the state lives on the PV and the claim, so
//! a re-run after a kill at any point continues where it stopped. Between
//! the delete and the create of step 4 the PV is missing for one API round
//! trip; if the PV binder syncs the claim inside that window it marks the
//! claim Lost, and binds it again as soon as it sees the new PV (its
//! `syncBoundClaim` rebinds a claim whose volume names it by uid).
//!
//! Test hook: `RBDKIT_MIGRATE_EXIT_AFTER=STEP` (`retain`, `metadata`,
//! `record`, `delete`, `create`, `restore`) makes `--apply` exit with
//! status 75 right after that step of the first PV, as a kill would; the
//! crash tests use it. It is read only with `--apply`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use serde_json::json;

use crate::rados::{Cluster, ConnectOptions};
use crate::rbd::Image;
use crate::volume::clusters::{ClustersConfig, ClustersFile, Credentials};
use crate::volume::legacy::{self, CsiTarget, MIGRATED_FROM, ORIGINAL_RECLAIM_POLICY};
use crate::volume::ops::{self, Owner, VolumeError};
use crate::volume::params::SecretRef;
use crate::volume::{NoFence, NoMetrics, VolumeId};

/// Claim annotation while its PV is being recreated: the CSI PV to create.
pub const CLAIM_RECORD: &str = "rbdkit.io/migration-pv";

/// Command-line arguments of `rbdkit migrate`.
///
/// Ceph is reached with the credentials (`userID`, `userKey`) of the
/// `--secret` Secret and the monitors of the clusters config; the new PVs
/// name that Secret for delete and expand, and `--node-secret` (default:
/// `--secret`) for the node.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// The legacy PVs to migrate, by name.
    #[arg(
        value_name = "PV",
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    pub pvs: Vec<String>,
    /// Migrate every legacy PV (and finish any migration cut short).
    #[arg(long)]
    pub all: bool,
    /// Make the changes (default: only print the plan).
    #[arg(long)]
    pub apply: bool,
    /// A kubeconfig file; without it, the in-cluster service account is used.
    #[arg(long, value_name = "FILE", env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// ceph-csi's config.json: the clusters and their monitors.
    #[arg(long, value_name = "FILE")]
    pub clusters_config: PathBuf,
    /// The CSI driver (rbdkit's provisioner name) the new PVs name.
    #[arg(long, default_value = "rbd.rbdkit.io")]
    pub driver: String,
    /// Which clusterID a rook cluster namespace (or clusterName) is, when it
    /// is not itself a clusterID of the clusters config. May be repeated.
    #[arg(long = "cluster-map", value_name = "NAMESPACE=CLUSTER_ID")]
    pub cluster_map: Vec<String>,
    /// The Secret (`NAMESPACE/NAME`, with `userID` and `userKey`) to reach
    /// Ceph with, and that the new PVs name for delete and expand.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub secret: String,
    /// The Secret the new PVs name for the node (default: `--secret`).
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub node_secret: Option<String>,
    /// Bound on each Kubernetes and Ceph call, e.g. `30s`.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

fn secret_ref(flag: &str, s: &str) -> anyhow::Result<SecretRef> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() => Ok(SecretRef {
            namespace: ns.to_owned(),
            name: name.to_owned(),
        }),
        _ => anyhow::bail!("{flag} {s:?}: expected NAMESPACE/NAME"),
    }
}

/// Exits as a kill would, if the test hook names `step`.
fn hook(step: &str) {
    if std::env::var("RBDKIT_MIGRATE_EXIT_AFTER").as_deref() == Ok(step) {
        eprintln!("rbdkit migrate: test hook: exiting after step {step}");
        std::process::exit(75);
    }
}

struct Run {
    args: MigrateArgs,
    config: ClustersConfig,
    cluster_map: BTreeMap<String, String>,
    secret: SecretRef,
    node_secret: SecretRef,
    creds: Credentials,
    pvs: Api<PersistentVolume>,
    client: kube::Client,
}

/// Bounds a Kubernetes call.
async fn bounded<T>(
    timeout: Duration,
    what: &str,
    f: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(timeout, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: timed out after {timeout:?}")),
    }
}

impl Run {
    /// Connects to `cluster_id` and runs `f` on the blocking pool.
    async fn ceph<T: Send + 'static>(
        &self,
        cluster_id: &str,
        f: impl FnOnce(&Cluster) -> Result<T, VolumeError> + Send + 'static,
    ) -> Result<T, String> {
        let info = self
            .config
            .get(cluster_id)
            .cloned()
            .ok_or_else(|| format!("cluster {cluster_id} is not in the clusters config"))?;
        let (creds, timeout) = (self.creds.clone(), self.args.timeout);
        let cluster_id = cluster_id.to_owned();
        tokio::task::spawn_blocking(move || {
            let c = ConnectOptions::new()
                .user(creds.user.clone())
                .key(creds.key.clone())
                .mon_host(info.monitors.join(","))
                .connect_timeout(timeout)
                .op_timeout(timeout)
                .connect()
                .map_err(|e| format!("cannot connect to cluster {cluster_id}: {e}"))?;
            f(&c).map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| format!("Ceph task: {e}"))?
    }

    fn claims(&self, ns: &str) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), ns)
    }

    /// The claim recording the CSI PV `name` is to become, if any.
    async fn recorded(
        &self,
        name: &str,
    ) -> Result<Option<(PersistentVolumeClaim, PersistentVolume)>, String> {
        let all: Api<PersistentVolumeClaim> = Api::all(self.client.clone());
        let list = bounded(
            self.args.timeout,
            "list claims",
            all.list(&ListParams::default()),
        )
        .await?;
        for c in list.items {
            let Some(text) = c
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(CLAIM_RECORD))
            else {
                continue;
            };
            let pv: PersistentVolume = serde_json::from_str(text).map_err(|e| {
                format!(
                    "claim {}'s {CLAIM_RECORD} annotation: {e}",
                    c.metadata.name.clone().unwrap_or_default()
                )
            })?;
            if pv.metadata.name.as_deref() == Some(name) {
                return Ok(Some((c, pv)));
            }
        }
        Ok(None)
    }
}

/// Runs `rbdkit migrate`; prints a plan (dry run) or what was done. Fails
/// (after printing) when any PV could not be migrated.
pub async fn run_migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let config = (*ClustersFile::load(&args.clusters_config)
        .map_err(anyhow::Error::msg)?
        .config())
    .clone();
    let cluster_map = legacy::parse_cluster_map(&args.cluster_map).map_err(anyhow::Error::msg)?;
    let secret = secret_ref("--secret", &args.secret)?;
    let node_secret = match &args.node_secret {
        Some(s) => secret_ref("--node-secret", s)?,
        None => secret.clone(),
    };
    let client = crate::k8s::client::client(args.kubeconfig.as_deref()).await?;
    let creds = tokio::time::timeout(
        args.timeout,
        crate::provisioner::secrets::credentials(&client, &secret),
    )
    .await
    .unwrap_or_else(|_| Err(format!("reading Secret {secret} timed out")))
    .map_err(anyhow::Error::msg)?;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let run = Run {
        args,
        config,
        cluster_map,
        secret,
        node_secret,
        creds,
        pvs,
        client,
    };

    let names: Vec<String> = if run.args.all {
        let mut names = std::collections::BTreeSet::new();
        let list = bounded(
            run.args.timeout,
            "list PVs",
            run.pvs.list(&ListParams::default()),
        )
        .await
        .map_err(anyhow::Error::msg)?;
        for pv in list.items {
            let pending = pv
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(ORIGINAL_RECLAIM_POLICY));
            if legacy::parse(&pv).is_ok() || pending {
                names.insert(pv.metadata.name.clone().unwrap_or_default());
            }
        }
        // PVs deleted by a run cut short before it made their successor.
        let all: Api<PersistentVolumeClaim> = Api::all(run.client.clone());
        let claims = bounded(
            run.args.timeout,
            "list claims",
            all.list(&ListParams::default()),
        )
        .await
        .map_err(anyhow::Error::msg)?;
        for c in claims.items {
            if let Some(t) = c
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(CLAIM_RECORD))
            {
                if let Ok(pv) = serde_json::from_str::<PersistentVolume>(t) {
                    names.extend(pv.metadata.name);
                }
            }
        }
        names.into_iter().collect()
    } else {
        run.args.pvs.clone()
    };

    let (mut done, mut failed) = (0usize, 0usize);
    for name in &names {
        let out = if run.args.apply {
            apply_one(&run, name).await
        } else {
            plan_one(&run, name).await
        };
        match out {
            Ok(line) => {
                done += 1;
                println!("{name}: {line}");
            }
            Err(why) => {
                failed += 1;
                println!("{name}: error: {why}");
            }
        }
    }
    println!(
        "summary: {} PV(s); {} {}, {} refused or failed{}",
        names.len(),
        done,
        if run.args.apply {
            "migrated"
        } else {
            "can be migrated"
        },
        failed,
        if run.args.apply {
            ""
        } else {
            "; dry run, pass --apply to migrate"
        }
    );
    anyhow::ensure!(failed == 0, "{failed} PV(s) not migrated");
    Ok(())
}

/// The legacy volume of `pv`, its rbdkit volume and the image's features,
/// checked against the image (step 1).
async fn check(
    run: &Run,
    pv: &PersistentVolume,
) -> Result<(legacy::LegacyVolume, VolumeId, String), String> {
    let name = pv.metadata.name.clone().unwrap_or_default();
    let l = legacy::parse(pv).map_err(|e| e.to_string())?;
    let cluster =
        legacy::resolve(&name, &l, &run.config, &run.cluster_map).map_err(|e| e.to_string())?;
    let vol = legacy::volume_id(&l, &cluster);
    let (driver, v) = (run.args.driver.clone(), vol.clone());
    let features = run
        .ceph(&cluster, move |c| {
            let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
            let img = match Image::open_read_only(&io, &v.image) {
                Ok(i) => i,
                Err(e) if e.kind() == crate::ErrorKind::NotFound => {
                    return Err(VolumeError::Missing {
                        image: v.to_string(),
                    })
                }
                Err(e) => return Err(e.into()),
            };
            let meta = ops::owner_metadata(&img)?;
            let mine = |k: &str, want: &str| meta.get(k).is_none_or(|x| x == want);
            if !mine(ops::META_PROVISIONER, &driver) || !mine(ops::META_PV, &name) {
                return Err(VolumeError::NotOwned {
                    image: v.to_string(),
                    why: format!(
                        "its rbdkit owner record names provisioner {:?}, PV {:?}",
                        meta.get(ops::META_PROVISIONER).cloned().unwrap_or_default(),
                        meta.get(ops::META_PV).cloned().unwrap_or_default()
                    ),
                });
            }
            Ok(img.features()?.to_string())
        })
        .await
        .map_err(|e| format!("refused: {e}"))?;
    Ok((l, vol, features))
}

fn policy(pv: &PersistentVolume) -> String {
    pv.spec
        .as_ref()
        .and_then(|s| s.persistent_volume_reclaim_policy.clone())
        .unwrap_or_else(|| "Delete".to_owned())
}

fn is_migrated(pv: &PersistentVolume, driver: &str) -> bool {
    pv.spec
        .as_ref()
        .and_then(|s| s.csi.as_ref())
        .is_some_and(|c| c.driver == driver)
        && pv
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(MIGRATED_FROM))
}

async fn plan_one(run: &Run, name: &str) -> Result<String, String> {
    let Some(pv) = bounded(run.args.timeout, "get PV", run.pvs.get_opt(name)).await? else {
        return match run.recorded(name).await? {
            Some(_) => Ok("a migration was cut short after the old PV was deleted; --apply creates the CSI PV".into()),
            None => Err(format!("PV {name} not found")),
        };
    };
    if is_migrated(&pv, &run.args.driver) {
        return Ok(
            match pv
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ORIGINAL_RECLAIM_POLICY))
            {
                Some(p) => format!("migrated; --apply restores reclaim policy {p}"),
                None => "already migrated; nothing to do".into(),
            },
        );
    }
    let (l, vol, _) = check(run, &pv).await?;
    let original = pv
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ORIGINAL_RECLAIM_POLICY).cloned())
        .unwrap_or_else(|| policy(&pv));
    let claim = claim_of(&pv)
        .map(|(ns, n, _)| format!("{ns}/{n}"))
        .ok_or("the PV is not bound to a claim; only bound PVs are migrated")?;
    Ok(format!(
        "{} volume {}/{} ({}) on cluster {}, claim {claim}: would set Retain, write rbdkit's owner record, recreate as a CSI PV of {} with handle {}, then restore reclaim policy {original}",
        l.kind, l.pool, l.image, l.location, vol.cluster_id, run.args.driver, vol.handle()
    ))
}

fn claim_of(pv: &PersistentVolume) -> Option<(String, String, String)> {
    let r = pv.spec.as_ref()?.claim_ref.as_ref()?;
    Some((r.namespace.clone()?, r.name.clone()?, r.uid.clone()?))
}

async fn apply_one(run: &Run, name: &str) -> Result<String, String> {
    let t = run.args.timeout;
    let pv = bounded(t, "get PV", run.pvs.get_opt(name)).await?;
    let pv = match pv {
        Some(pv) if is_migrated(&pv, &run.args.driver) => {
            return finish(run, pv, "already migrated").await
        }
        Some(pv) => pv,
        None => {
            let Some((_, new)) = run.recorded(name).await? else {
                return Err(format!("PV {name} not found"));
            };
            let created = create(run, &new).await?;
            return finish(run, created, "migrated (resumed after the old PV's delete)").await;
        }
    };
    let (l, vol, features) = check(run, &pv).await?;
    let (claim_ns, claim_name, _) =
        claim_of(&pv).ok_or("the PV is not bound to a claim; only bound PVs are migrated")?;

    // 2: Retain, the original recorded first (same patch).
    let mut pv = pv;
    if pv.metadata.deletion_timestamp.is_none()
        && !pv
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(ORIGINAL_RECLAIM_POLICY))
    {
        let patch = json!({
            "metadata": {
                "resourceVersion": pv.metadata.resource_version,
                "annotations": {ORIGINAL_RECLAIM_POLICY: policy(&pv)},
            },
            "spec": {"persistentVolumeReclaimPolicy": "Retain"},
        });
        pv = bounded(
            t,
            "set Retain",
            run.pvs
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await?;
    }
    hook("retain");

    // 3: the owner record.
    let owner = Owner {
        provisioner: run.args.driver.clone(),
        pv_name: name.to_owned(),
        pvc_namespace: claim_ns.clone(),
        pvc_name: claim_name.clone(),
        cluster_id: vol.cluster_id.clone(),
    };
    let v = vol.clone();
    run.ceph(&vol.cluster_id, move |c| {
        legacy::adopt_image(c, &NoMetrics, &NoFence, &v, &owner)
    })
    .await
    .map_err(|e| format!("cannot write the owner record: {e}"))?;
    hook("metadata");

    // 4: record the successor on the claim, delete, create.
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let new = legacy::csi_pv(
        &pv,
        &l,
        &CsiTarget {
            driver: &run.args.driver,
            volume: &vol,
            secret: &run.secret,
            node_secret: Some(&run.node_secret),
            features,
            now: &now,
        },
    );
    let record = serde_json::to_string(&new).map_err(|e| e.to_string())?;
    let claims = run.claims(&claim_ns);
    let patch = json!({"metadata": {"annotations": {CLAIM_RECORD: record}}});
    bounded(
        t,
        "record the CSI PV on the claim",
        claims.patch(&claim_name, &PatchParams::default(), &Patch::Merge(&patch)),
    )
    .await?;
    hook("record");

    let uid = pv.metadata.uid.clone();
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..Default::default()
    };
    match tokio::time::timeout(t, run.pvs.delete(name, &dp)).await {
        Ok(Ok(_)) => {}
        Ok(Err(kube::Error::Api(e))) if e.code == 404 => {}
        Ok(Err(e)) => return Err(format!("delete the old PV: {e}")),
        Err(_) => return Err(format!("delete the old PV: timed out after {t:?}")),
    }
    // A Bound PV keeps its pv-protection finalizer for ever: drop it (and
    // any other) so the name is free at once.
    let unfinalize = json!({"metadata": {"finalizers": null}});
    match tokio::time::timeout(
        t,
        run.pvs
            .patch(name, &PatchParams::default(), &Patch::Merge(&unfinalize)),
    )
    .await
    {
        Ok(Ok(_)) => {}
        Ok(Err(kube::Error::Api(e))) if e.code == 404 => {}
        Ok(Err(e)) => return Err(format!("drop the old PV's finalizers: {e}")),
        Err(_) => {
            return Err(format!(
                "drop the old PV's finalizers: timed out after {t:?}"
            ))
        }
    }
    hook("delete");
    let created = create(run, &new).await?;
    finish(
        run,
        created,
        &format!(
            "migrated from {} ({}/{}) to {}",
            l.kind,
            l.pool,
            l.image,
            vol.handle()
        ),
    )
    .await
}

/// Creates the CSI PV (waiting, bounded, for the old one's name to be
/// free), or takes the one a cut-short run made.
async fn create(run: &Run, new: &PersistentVolume) -> Result<PersistentVolume, String> {
    let name = new.metadata.name.clone().unwrap_or_default();
    let deadline = tokio::time::Instant::now() + run.args.timeout;
    loop {
        match tokio::time::timeout(
            run.args.timeout,
            run.pvs.create(&PostParams::default(), new),
        )
        .await
        {
            Ok(Ok(pv)) => {
                hook("create");
                return Ok(pv);
            }
            Ok(Err(kube::Error::Api(e))) if e.code == 409 => {
                let cur = bounded(run.args.timeout, "get PV", run.pvs.get_opt(&name)).await?;
                match cur {
                    Some(pv) if is_migrated(&pv, &run.args.driver) => return Ok(pv),
                    // The old PV is still going away.
                    _ if tokio::time::Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    _ => {
                        return Err(format!(
                        "PV {name} still exists and is not the CSI PV; is it still being deleted?"
                    ))
                    }
                }
            }
            Ok(Err(e)) => return Err(format!("create the CSI PV: {e}")),
            Err(_) => {
                return Err(format!(
                    "create the CSI PV: timed out after {:?}",
                    run.args.timeout
                ))
            }
        }
    }
}

/// Step 5: restores the reclaim policy and drops the claim's record.
async fn finish(run: &Run, pv: PersistentVolume, what: &str) -> Result<String, String> {
    let t = run.args.timeout;
    let name = pv.metadata.name.clone().unwrap_or_default();
    let original = pv
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ORIGINAL_RECLAIM_POLICY))
        .cloned();
    if let Some(p) = &original {
        let patch = json!({
            "metadata": {"annotations": {ORIGINAL_RECLAIM_POLICY: null}},
            "spec": {"persistentVolumeReclaimPolicy": p},
        });
        bounded(
            t,
            "restore the reclaim policy",
            run.pvs
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await?;
        hook("restore");
    }
    if let Some((ns, claim, _)) = claim_of(&pv) {
        let claims = run.claims(&ns);
        if let Some(c) = bounded(t, "get claim", claims.get_opt(&claim)).await? {
            if c.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(CLAIM_RECORD))
            {
                let patch = json!({"metadata": {"annotations": {CLAIM_RECORD: null}}});
                bounded(
                    t,
                    "drop the claim's record",
                    claims.patch(&claim, &PatchParams::default(), &Patch::Merge(&patch)),
                )
                .await?;
            }
        }
    }
    Ok(match original {
        Some(p) => format!("{what}; reclaim policy {p}"),
        None => what.to_owned(),
    })
}
