//! `rbdkit gc`: lists (and with `--apply` removes) the images, temporary
//! images, trash entries and temporary snapshots a provisioner owns that no
//! PV or claim refers to, and the RBD groups group snapshot creates left,
//! and reports the Vault keys of removed encrypted images whose removal
//! from Vault a crash cut short ([`crate::volume::gc::kms_leftovers`]). The
//! Ceph side is [`crate::volume::gc`]; this is the Kubernetes side and the
//! report.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, ListParams};
use serde_json::json;

use crate::rados::{Cluster, ConnectOptions};
use crate::volume::clusters::{ClusterInfo, ClustersFile, Credentials};
use crate::volume::gc::{self, Kind, Owned, References, Removed};
use crate::volume::params::SecretRef;
use crate::volume::pv::{DELETION_SECRET_NAME, DELETION_SECRET_NAMESPACE, PROVISIONED_BY};
use crate::volume::VolumeId;

/// How `rbdkit gc` prints its report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GcOutput {
    /// One line per object, then a summary.
    Text,
    /// One JSON document.
    Json,
}

/// Command-line arguments of `rbdkit gc`.
///
/// The pools looked at are those of the provisioner's StorageClasses, of its
/// PVs, and any given with `--pool`. Credentials: `--keyring` or `--keyfile`
/// (with `--id`) for every cluster; or else `--secret`; or else, per pool,
/// the provisioner (or expand) Secret of a StorageClass or the deletion
/// Secret of a PV using it, when it holds no template.
#[derive(Debug, Args)]
pub struct GcArgs {
    /// The provisioner (and CSI driver) name whose leftovers to collect.
    #[arg(long, default_value = "rbd.rbdkit.io")]
    pub provisioner: String,
    /// ceph-csi's config.json: the clusters and their monitors.
    #[arg(long, value_name = "FILE")]
    pub clusters_config: PathBuf,
    /// A kubeconfig file; without it, the in-cluster service account is used.
    #[arg(long, value_name = "FILE", env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Remove what is listed (default: only list it).
    #[arg(long)]
    pub apply: bool,
    /// Output format.
    #[arg(long, default_value = "text")]
    pub output: GcOutput,
    /// Another pool to look at, `CLUSTER_ID:POOL` (its RADOS namespace comes
    /// from the clusters config). May be repeated.
    #[arg(long = "pool", value_name = "CLUSTER_ID:POOL")]
    pub pools: Vec<String>,
    /// A Secret with `userID` and `userKey`, `NAMESPACE/NAME`, for every
    /// cluster.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub secret: Option<String>,
    /// ceph.conf to read as well (monitors still come from the clusters
    /// config), with --keyring or --keyfile.
    #[arg(short = 'c', long = "conf")]
    pub conf: Option<PathBuf>,
    /// cephx user id, without `client.`, with --keyring or --keyfile.
    #[arg(long = "id", default_value = "admin")]
    pub id: String,
    /// Keyring file holding the user's key.
    #[arg(long = "keyring")]
    pub keyring: Option<PathBuf>,
    /// File holding only the user's key (kept off the command line).
    #[arg(long = "keyfile")]
    pub keyfile: Option<PathBuf>,
    /// Bound on connecting, on each Ceph operation and on each API request.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// How long a group snapshot create's RBD group must have been left
    /// (since its last attempt wrote its marker) before it is collected: a
    /// create under way, its copies included, must not lose its group.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    pub group_grace: Duration,
    /// Bound on removing one image or trash entry (a later run finishes one
    /// cut short).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub remove_deadline: Duration,
}

/// Where a pool's credentials come from.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum CredSource {
    /// `--keyring` / `--keyfile` / `-c`.
    Flags,
    /// A Kubernetes Secret.
    Secret(SecretRef),
    /// None found.
    None,
}

/// A (cluster, pool) to scan.
type PoolKey = (String, String);

async fn list<K>(api: Api<K>, what: &str, timeout: Duration) -> anyhow::Result<Vec<K>>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match tokio::time::timeout(timeout, api.list(&ListParams::default())).await {
        Ok(Ok(l)) => Ok(l.items),
        Ok(Err(e)) => Err(anyhow::anyhow!("cannot list {what}: {e}")),
        Err(_) => Err(anyhow::anyhow!(
            "listing {what} timed out after {timeout:?}"
        )),
    }
}

fn untemplated(name: Option<&String>, namespace: Option<&String>) -> Option<SecretRef> {
    let (name, namespace) = (name?, namespace?);
    (!name.contains("${") && !namespace.contains("${")).then(|| SecretRef {
        namespace: namespace.clone(),
        name: name.clone(),
    })
}

/// What Kubernetes refers to, and the pools of this provisioner with a
/// Secret for each where one is known.
async fn kube_state(
    client: &kube::Client,
    provisioner: &str,
    timeout: Duration,
) -> anyhow::Result<(References, BTreeMap<PoolKey, Option<SecretRef>>)> {
    let pvs: Vec<PersistentVolume> =
        list(Api::all(client.clone()), "PersistentVolumes", timeout).await?;
    let claims: Vec<PersistentVolumeClaim> =
        list(Api::all(client.clone()), "PersistentVolumeClaims", timeout).await?;
    let classes: Vec<StorageClass> =
        list(Api::all(client.clone()), "StorageClasses", timeout).await?;

    let mut refs = References::default();
    let mut pools: BTreeMap<PoolKey, Option<SecretRef>> = BTreeMap::new();
    let mut add = |key: PoolKey, secret: Option<SecretRef>| {
        let slot = pools.entry(key).or_default();
        if slot.is_none() {
            *slot = secret;
        }
    };
    for sc in &classes {
        if sc.provisioner != provisioner {
            continue;
        }
        let p = sc.parameters.clone().unwrap_or_default();
        let (Some(cluster), Some(pool)) = (p.get("clusterID"), p.get("pool")) else {
            continue;
        };
        let secret = untemplated(
            p.get("csi.storage.k8s.io/provisioner-secret-name"),
            p.get("csi.storage.k8s.io/provisioner-secret-namespace"),
        )
        .or_else(|| {
            untemplated(
                p.get("csi.storage.k8s.io/controller-expand-secret-name"),
                p.get("csi.storage.k8s.io/controller-expand-secret-namespace"),
            )
        });
        add((cluster.clone(), pool.clone()), secret);
    }
    for pv in &pvs {
        if let Some(n) = &pv.metadata.name {
            refs.pv_names.insert(n.clone());
        }
        let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.as_ref()) else {
            continue;
        };
        // Any PV naming an image keeps it, whoever made the PV.
        let Ok(vol) = VolumeId::parse(&csi.volume_handle) else {
            continue;
        };
        let annotations = pv.metadata.annotations.as_ref();
        let ours = csi.driver == provisioner
            || annotations
                .and_then(|a| a.get(PROVISIONED_BY))
                .is_some_and(|p| p == provisioner);
        if ours {
            let secret = annotations.and_then(|a| {
                untemplated(
                    a.get(DELETION_SECRET_NAME),
                    a.get(DELETION_SECRET_NAMESPACE),
                )
            });
            add((vol.cluster_id.clone(), vol.pool.clone()), secret);
        }
        refs.volumes.insert(vol);
    }
    // A claim being provisioned has an image (or a temporary one) before
    // its PV exists; the PV will be named pvc-<uid>.
    for c in &claims {
        if let Some(uid) = &c.metadata.uid {
            refs.pv_names.insert(format!("pvc-{uid}"));
        }
    }
    Ok((refs, pools))
}

/// The connection flags, for the blocking pool.
#[derive(Clone)]
struct GcConn {
    timeout: Duration,
    id: String,
    conf: Option<PathBuf>,
    keyring: Option<PathBuf>,
    keyfile: Option<PathBuf>,
}

impl GcConn {
    /// Connects to `cluster` with `creds`, or else with the flags.
    fn connect(
        &self,
        cluster: &ClusterInfo,
        creds: Option<&Credentials>,
    ) -> crate::Result<Cluster> {
        let mut o = ConnectOptions::new()
            .connect_timeout(self.timeout)
            .op_timeout(self.timeout);
        match creds {
            Some(c) => o = o.user(c.user.clone()).key(c.key.clone()),
            None => {
                o = o.user(&self.id);
                if let Some(c) = &self.conf {
                    o = o.conf_file(c);
                }
                if let Some(k) = &self.keyring {
                    o = o.keyring(k);
                }
                if let Some(f) = &self.keyfile {
                    o = o.key(super::read_keyfile(f)?);
                }
            }
        }
        // Monitors come from the clusters config, even with a conf file.
        o.mon_host(cluster.monitors.join(","))
            .connect()
            .map_err(|e| e.detail(format!("cluster {}", cluster.cluster_id)))
    }
}

/// One object in the report.
struct Line {
    object: Owned,
    action: String,
    error: Option<String>,
}

/// Runs `rbdkit gc` and prints its report. Fails (after printing) when
/// anything could not be scanned or removed.
pub async fn run_gc(args: GcArgs) -> anyhow::Result<()> {
    let clusters = ClustersFile::load(&args.clusters_config).map_err(anyhow::Error::msg)?;
    let client = crate::k8s::client::client(args.kubeconfig.as_deref()).await?;
    let (refs, mut pools) = kube_state(&client, &args.provisioner, args.timeout).await?;
    for p in &args.pools {
        let Some((c, pool)) = p
            .split_once(':')
            .filter(|(c, p)| !c.is_empty() && !p.is_empty())
        else {
            anyhow::bail!("--pool {p:?}: expected CLUSTER_ID:POOL");
        };
        pools.entry((c.to_owned(), pool.to_owned())).or_default();
    }
    let flags = args.keyring.is_some() || args.keyfile.is_some();
    let global_secret = match &args.secret {
        Some(s) => {
            let Some((ns, name)) = s.split_once('/') else {
                anyhow::bail!("--secret {s:?}: expected NAMESPACE/NAME");
            };
            Some(SecretRef {
                namespace: ns.to_owned(),
                name: name.to_owned(),
            })
        }
        None => None,
    };

    let conn = GcConn {
        timeout: args.timeout,
        id: args.id.clone(),
        conf: args.conf.clone(),
        keyring: args.keyring.clone(),
        keyfile: args.keyfile.clone(),
    };
    let mut problems: Vec<String> = Vec::new();
    let mut lines: Vec<Line> = Vec::new();
    // Vault keys of removed images: reported, not removed (gc holds no
    // Vault credentials; a retried delete of the handle removes them).
    let mut kms_keys: Vec<gc::KmsLeftover> = Vec::new();
    let mut scanned = Vec::new();
    let (mut owned_total, mut foreign_total) = (0usize, 0usize);
    let mut secrets: BTreeMap<SecretRef, Credentials> = BTreeMap::new();
    for ((cluster_id, pool), secret) in &pools {
        let Some(info) = clusters.get(cluster_id) else {
            problems.push(format!(
                "pool {pool} of cluster {cluster_id}: the cluster is not in {}",
                args.clusters_config.display()
            ));
            continue;
        };
        let source = if flags {
            CredSource::Flags
        } else if let Some(s) = global_secret.clone().or_else(|| secret.clone()) {
            CredSource::Secret(s)
        } else {
            CredSource::None
        };
        let creds = match &source {
            CredSource::Flags => None,
            CredSource::Secret(s) => match secrets.get(s) {
                Some(c) => Some(c.clone()),
                None => match tokio::time::timeout(
                    args.timeout,
                    crate::provisioner::secrets::credentials(&client, s),
                )
                .await
                .unwrap_or_else(|_| Err(format!("reading Secret {s} timed out")))
                {
                    Ok(c) => {
                        secrets.insert(s.clone(), c.clone());
                        Some(c)
                    }
                    Err(why) => {
                        problems.push(format!("pool {pool} of cluster {cluster_id}: {why}"));
                        continue;
                    }
                },
            },
            CredSource::None => {
                problems.push(format!(
                    "pool {pool} of cluster {cluster_id}: no Secret without templates names it; pass --secret, --keyring or --keyfile"
                ));
                continue;
            }
        };
        let ns = info.rados_namespace.clone();
        scanned.push(json!({"cluster": cluster_id, "pool": pool, "namespace": ns}));
        let work = {
            let (cid, pool, prov) = (cluster_id.clone(), pool.clone(), args.provisioner.clone());
            let (conn, info, grace) = (conn.clone(), info.clone(), args.group_grace);
            move || -> crate::Result<(Cluster, gc::Scan, Vec<gc::KmsLeftover>)> {
                let c = conn.connect(&info, creds.as_ref())?;
                let s = gc::scan(&c, &cid, &pool, &info.rados_namespace, &prov, grace)?;
                let k = gc::kms_leftovers(&c, &cid, &pool, &info.rados_namespace)?;
                Ok((c, s, k))
            }
        };
        let (cluster, scan, kms_left) = match tokio::task::spawn_blocking(work).await? {
            Ok(r) => r,
            Err(e) => {
                problems.push(format!("pool {pool} of cluster {cluster_id}: {e}"));
                continue;
            }
        };
        kms_keys.extend(kms_left);
        owned_total += scan.owned.len();
        foreign_total += scan.foreign;
        problems.extend(scan.unreadable.iter().cloned());
        let mut picked = gc::select(&scan.owned, &refs);
        if args.apply && !picked.is_empty() {
            // Look again right before removing: a claim or PV made since
            // the first look keeps its image.
            let (fresh, _) = kube_state(&client, &args.provisioner, args.timeout).await?;
            picked.retain(|o| !fresh.refers_to(o));
            for o in picked {
                let deadline = Instant::now() + args.remove_deadline;
                let (c, prov, obj) = (cluster.clone(), args.provisioner.clone(), o.clone());
                let r = tokio::task::spawn_blocking(move || gc::remove(&c, &obj, &prov, deadline))
                    .await?;
                lines.push(match r {
                    Ok(Removed::Removed) => Line {
                        object: o,
                        action: "removed".into(),
                        error: None,
                    },
                    Ok(Removed::AlreadyGone) => Line {
                        object: o,
                        action: "already gone".into(),
                        error: None,
                    },
                    Err(e) => Line {
                        object: o,
                        action: "failed".into(),
                        error: Some(e.to_string()),
                    },
                });
            }
        } else {
            lines.extend(picked.into_iter().map(|o| Line {
                object: o,
                action: "would remove".into(),
                error: None,
            }));
        }
        // rados_shutdown may block: not on the runtime.
        let _ = tokio::task::spawn_blocking(move || drop(cluster)).await;
    }

    let count = |k: Kind| lines.iter().filter(|l| l.object.kind == k).count();
    let failed = lines.iter().filter(|l| l.error.is_some()).count();
    let removed = lines.iter().filter(|l| l.action == "removed").count();
    let referenced = owned_total.saturating_sub(lines.len());
    match args.output {
        GcOutput::Text => {
            for l in &lines {
                let o = &l.object;
                let what = match &o.snap {
                    Some(snap) => format!("{}@{snap}", o.volume),
                    None => o.volume.to_string(),
                };
                let mut line = format!(
                    "{:<6} {what}  id={} pv={} claim={}  {}",
                    o.kind, o.image_id, o.pv_name, o.claim, l.action
                );
                if let Some(e) = &l.error {
                    line.push_str(&format!(": {e}"));
                }
                println!("{line}");
            }
            for k in &kms_keys {
                println!(
                    "kmskey {}  kms={} key={} tenant={}  left in the KMS (retry the delete of this handle, or remove the key there)",
                    k.handle,
                    k.key.kms,
                    k.key.key,
                    k.key.tenant.as_deref().unwrap_or("-")
                );
            }
            for p in &problems {
                println!("error  {p}");
            }
            println!(
                "summary: {} pool(s) scanned; {} to collect ({} orphan, {} temp, {} trash, {} tempsnap, {} group); {} removed, {} failed; {} owned and still referenced; {} foreign left alone; {} KMS key(s) of removed images; {} error(s){}",
                scanned.len(),
                lines.len(),
                count(Kind::Orphan),
                count(Kind::Temp),
                count(Kind::Trash),
                count(Kind::TempSnap),
                count(Kind::Group),
                removed,
                failed,
                referenced,
                foreign_total,
                kms_keys.len(),
                problems.len(),
                if args.apply { "" } else { "; dry run, pass --apply to remove" },
            );
        }
        GcOutput::Json => {
            let objects: Vec<_> = lines
                .iter()
                .map(|l| {
                    let o = &l.object;
                    json!({
                        "kind": o.kind.to_string(),
                        "cluster": o.volume.cluster_id,
                        "pool": o.volume.pool,
                        "namespace": o.volume.rados_namespace,
                        "name": o.volume.image,
                        "snapshot": o.snap,
                        "image_id": o.image_id,
                        "pv": o.pv_name,
                        "claim": o.claim,
                        "action": l.action,
                        "error": l.error,
                    })
                })
                .collect();
            println!(
                "{}",
                json!({
                    "apply": args.apply,
                    "pools": scanned,
                    "objects": objects,
                    "kms_keys": kms_keys.iter().map(|k| json!({
                        "handle": k.handle,
                        "kms": k.key.kms,
                        "key": k.key.key,
                        "tenant": k.key.tenant,
                    })).collect::<Vec<_>>(),
                    "errors": problems,
                    "summary": {
                        "to_collect": lines.len(),
                        "orphan": count(Kind::Orphan),
                        "temp": count(Kind::Temp),
                        "trash": count(Kind::Trash),
                        "tempsnap": count(Kind::TempSnap),
                        "group": count(Kind::Group),
                        "removed": removed,
                        "failed": failed,
                        "referenced": referenced,
                        "foreign": foreign_total,
                    },
                })
            );
        }
    }
    anyhow::ensure!(
        failed == 0 && problems.is_empty(),
        "{failed} removal(s) failed and {} pool(s) or object(s) could not be scanned",
        problems.len()
    );
    Ok(())
}
