//! Background work that must survive restarts, run by the leader only (it
//! runs beside the controllers and stops with them when the lease is lost):
//!
//! - the background flatten of clones past the soft depth limit: their PVs
//!   carry [`PV_FLATTEN_ANNOTATION`] from the moment they are created, so a
//!   restarted provisioner finds them again; librbd's flatten goes on where
//!   a stopped one left off;
//! - [`snap::purge_orphans`] in every pool and RADOS namespace our PVs are
//!   in: trashed sources whose last clone has gone, and temporary snapshots
//!   of clones given up.
//!
//! Each pass is bounded: at most [`MAX_FLATTENS`] volumes, each for at most
//! one Ceph operation timeout per round and [`FLATTEN_ROUNDS`] rounds.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;

use crate::provisioner::controller::{Context, PV_FLATTEN_ANNOTATION};
use crate::provisioner::pv::{deletion_secret, our_volume};
use crate::volume::params::SecretRef;
use crate::volume::snapshot as snap;
use crate::volume::VolumeId;

/// Most volumes flattened in one pass.
pub const MAX_FLATTENS: usize = 16;
/// Most rounds (each bounded by the Ceph operation timeout) one volume's
/// flatten gets in one pass; the next pass goes on.
pub const FLATTEN_ROUNDS: u32 = 6;

/// Runs a pass after `delay` (so that the reconciles a restart wakes go
/// first: a pass may remove the temporary snapshot of a clone that has not
/// started yet, which that clone's retry makes again), then every
/// `interval`, until dropped.
pub async fn run(ctx: Arc<Context>, delay: Duration, interval: Duration, op_timeout: Duration) {
    tokio::time::sleep(delay).await;
    loop {
        let started = Instant::now();
        match pass(&ctx, op_timeout).await {
            Ok((flattened, purged)) => {
                if flattened + purged > 0 {
                    tracing::info!(flattened, purged, took = ?started.elapsed(), "maintenance pass");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "maintenance pass not done; next one in {interval:?}")
            }
        }
        tokio::time::sleep(interval).await;
    }
}

/// One pass: returns how many volumes were flattened and how many images
/// and snapshots purged.
pub async fn pass(ctx: &Context, op_timeout: Duration) -> Result<(usize, usize), String> {
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let mut survey = Survey::default();
    for_each_pv(ctx, |pv| survey.add(pv, &ctx.name)).await?;
    let Survey { places, pending } = survey;
    let mut flattened = 0;
    let mut errors = Vec::new();
    for (pv_name, vol, secret) in pending.into_iter().take(MAX_FLATTENS) {
        match flatten(ctx, &vol, &secret, op_timeout).await {
            Ok(true) => {
                let patch = json!({"metadata": {"annotations": {PV_FLATTEN_ANNOTATION: null}}});
                pvs.patch(&pv_name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(|e| format!("Kubernetes API: {e}"))?;
                tracing::info!(pv = %pv_name, image = %vol, "background flatten done");
                flattened += 1;
            }
            Ok(false) => {
                tracing::info!(pv = %pv_name, image = %vol, "background flatten goes on next pass")
            }
            Err(e) => errors.push(format!("flatten of {vol}: {e}")),
        }
    }
    let mut purged = 0;
    for (place, secret) in places.into_values() {
        match purge(ctx, &place, &secret).await {
            Ok(n) => purged += n,
            Err(e) => errors.push(format!("purge in {}/{}: {e}", place.cluster_id, place.pool)),
        }
    }
    if errors.is_empty() {
        Ok((flattened, purged))
    } else {
        Err(errors.join("; "))
    }
}

/// Calls `f` with every PV of ours, one at a time: from the watch cache
/// while leading (a LIST of them all would hold a second copy, and at 1000
/// PVs that was the provisioner's peak), else from paged LISTs.
pub(crate) async fn for_each_pv(
    ctx: &Context,
    mut f: impl FnMut(&PersistentVolume),
) -> Result<(), String> {
    if let Some(cached) = ctx.cached_pvs() {
        for pv in cached {
            // Decoded one at a time, so only one full PV is held at once.
            // A stripped PV is not ours.
            match pv.decode() {
                Some(Ok(pv)) => f(&pv),
                Some(Err(e)) => return Err(format!("cached PV {}: {e}", pv.name_any())),
                None => {}
            }
        }
        return Ok(());
    }
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let mut params = ListParams::default().limit(crate::provisioner::LIST_PAGE_SIZE);
    loop {
        let page = pvs
            .list(&params)
            .await
            .map_err(|e| format!("Kubernetes API: {e}"))?;
        page.items.iter().for_each(&mut f);
        match page.metadata.continue_.filter(|t| !t.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(()),
        }
    }
}

/// What a pass works on, gathered from the PVs.
#[derive(Default)]
struct Survey {
    /// One of our volumes (and its secret) per cluster, pool and namespace.
    places: BTreeMap<(String, String, String), (VolumeId, SecretRef)>,
    /// Our PVs waiting for a background flatten.
    pending: Vec<(String, VolumeId, SecretRef)>,
}

impl Survey {
    fn add(&mut self, pv: &PersistentVolume, provisioner: &str) {
        let Some(Ok(vol)) = our_volume(pv, provisioner) else {
            return;
        };
        let Some(secret) = deletion_secret(pv) else {
            return;
        };
        if pv.annotations().contains_key(PV_FLATTEN_ANNOTATION)
            && pv.metadata.deletion_timestamp.is_none()
        {
            self.pending
                .push((pv.name_any(), vol.clone(), secret.clone()));
        }
        self.places
            .entry((
                vol.cluster_id.clone(),
                vol.pool.clone(),
                vol.rados_namespace.clone(),
            ))
            .or_insert((vol, secret));
    }
}

async fn flatten(
    ctx: &Context,
    vol: &VolumeId,
    secret: &SecretRef,
    op_timeout: Duration,
) -> Result<bool, String> {
    let conn = ctx.connect(&vol.cluster_id, secret).await?;
    for _ in 0..FLATTEN_ROUNDS {
        let v = vol.clone();
        let name = ctx.name.clone();
        let done = ctx
            .ceph(&conn, move |c, m, f| {
                f.check("rbd_flatten", &v.to_string())?;
                snap::flatten_volume(c, m, &v, &name, Instant::now() + op_timeout)
            })
            .await
            .map_err(|e| e.to_string())?;
        if done {
            return Ok(true);
        }
    }
    Ok(false)
}

async fn purge(ctx: &Context, place: &VolumeId, secret: &SecretRef) -> Result<usize, String> {
    let conn = ctx.connect(&place.cluster_id, secret).await?;
    let p = place.clone();
    let name = ctx.name.clone();
    ctx.ceph(&conn, move |c, m, f| {
        f.check("rbd_trash_remove", &format!("{}/{}", p.cluster_id, p.pool))?;
        snap::purge_orphans(c, m, &p, &name)
    })
    .await
    .map_err(|e| e.to_string())
}
