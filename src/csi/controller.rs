//! The CSI Controller service: create, delete, expand, validate, list
//! volumes and report capacity, through the same volume operations the
//! provisioner uses ([`crate::volume::ops`]), with the same ownership
//! records and crash safety; and snapshots, restores and volume clones
//! through [`crate::volume::snapshot`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tonic::{Code, Request, Response, Status};

use crate::csi::driver::{required, volume_id, volume_status, Driver, InFlight};
use crate::csi::proto::{
    controller_server::Controller, controller_service_capability, list_volumes_response,
    validate_volume_capabilities_response, volume_capability, CapacityRange,
    ControllerExpandVolumeRequest, ControllerExpandVolumeResponse,
    ControllerGetCapabilitiesRequest, ControllerGetCapabilitiesResponse,
    ControllerGetVolumeRequest, ControllerGetVolumeResponse, ControllerModifyVolumeRequest,
    ControllerModifyVolumeResponse, ControllerPublishVolumeRequest,
    ControllerPublishVolumeResponse, ControllerServiceCapability, ControllerUnpublishVolumeRequest,
    ControllerUnpublishVolumeResponse, CreateSnapshotRequest, CreateSnapshotResponse,
    CreateVolumeRequest, CreateVolumeResponse, DeleteSnapshotRequest, DeleteSnapshotResponse,
    DeleteVolumeRequest, DeleteVolumeResponse, GetCapacityRequest, GetCapacityResponse,
    GetSnapshotRequest, GetSnapshotResponse, ListSnapshotsRequest, ListSnapshotsResponse,
    ListVolumesRequest, ListVolumesResponse, ValidateVolumeCapabilitiesRequest,
    ValidateVolumeCapabilitiesResponse, Volume, VolumeCapability,
};
use crate::csi::proto::{list_snapshots_response, volume_content_source, Snapshot};
use crate::csi::proto::{
    volume_health::VolumeHealthEntry, ControllerGetNodeInfoRequest, ControllerGetNodeInfoResponse,
    ControllerGetVolumeHealthRequest, ControllerGetVolumeHealthResponse,
    ControllerListVolumeHealthRequest, ControllerListVolumeHealthResponse, VolumeHealth,
    VolumeHealthErrorType,
};
use crate::rbd::{self, Image};
use crate::volume::ops::{self, Owner, VolumeError, META_PROVISIONER};
use crate::volume::params::{
    check_access, ClassParams, SnapshotParams, CLUSTER_ID, POOL, PVC_NAMESPACE_META, PVC_NAME_META,
    VOLUMESNAPSHOTCONTENT_NAME_META,
};
use crate::volume::qos;
use crate::volume::quantity::{round_up_mib, MIB};
use crate::volume::snapshot::{
    self as snap, CloneOptions, Flatten, SnapshotFilter, SnapshotInfo, SnapshotOwner, META_KIND,
};
use crate::volume::NoFence;
use crate::volume::{image_base, volume_context, SnapshotId, VolumeId};

/// How long one round of a background flatten may hold a blocking thread.
const FLATTEN_ROUND: Duration = Duration::from_secs(60);
/// Rounds of a background flatten before it is given up (until the next
/// clone of the volume asks again).
const FLATTEN_ROUNDS: u32 = 120;

/// What a new volume is made from.
enum Source {
    Snapshot(SnapshotId),
    Volume(VolumeId),
}

/// Parses a snapshot id, with INVALID_ARGUMENT for an empty one and
/// NOT_FOUND for one this driver cannot have made.
fn snapshot_id(id: &str) -> Result<SnapshotId, Status> {
    required("snapshot_id", id)?;
    SnapshotId::parse(id).map_err(|why| Status::not_found(format!("no such snapshot: {why}")))
}

/// The volume id in request field `field`: INVALID_ARGUMENT naming the
/// field when it is empty, NOT_FOUND for one this driver cannot have made.
fn volume_field(field: &str, id: &str) -> Result<VolumeId, Status> {
    required(field, id)?;
    volume_id(id)
}

/// A request's parameters, parsed by `parse`, with the map they were parsed
/// from (for the CO's extra metadata). A bad one is INVALID_ARGUMENT, and
/// the message names `class`, where the CO took the parameters from.
pub(crate) fn class_params<P, E: std::fmt::Display>(
    parameters: &HashMap<String, String>,
    class: &str,
    parse: impl FnOnce(&BTreeMap<String, String>) -> Result<P, E>,
) -> Result<(BTreeMap<String, String>, P), Status> {
    let raw: BTreeMap<String, String> = parameters.clone().into_iter().collect();
    let params = parse(&raw)
        .map_err(|e| Status::invalid_argument(e.to_string().replace("StorageClass", class)))?;
    Ok((raw, params))
}

pub(crate) fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

pub(crate) fn csi_snapshot(info: &SnapshotInfo) -> Snapshot {
    Snapshot {
        size_bytes: info.size.min(i64::MAX as u64) as i64,
        snapshot_id: info.id.handle(),
        source_volume_id: info.source_volume.clone(),
        creation_time: Some(timestamp(info.created)),
        ready_to_use: info.ready,
        group_snapshot_id: String::new(),
        accessible_topology: Vec::new(),
    }
}

/// Flattens `vol` in bounded rounds on the blocking pool, in the
/// background (a clone past the soft depth limit).
fn flatten_in_background(driver: Arc<Driver>, vol: VolumeId) {
    tokio::spawn(async move {
        let conn = match driver.connect(&vol.cluster_id, &HashMap::new()).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(volume = %vol, "background flatten not started: {}", e.message());
                return;
            }
        };
        for _ in 0..FLATTEN_ROUNDS {
            let (v, name) = (vol.clone(), driver.name.clone());
            let round = driver
                .ceph(&conn, move |c, m| {
                    snap::flatten_volume(c, m, &v, &name, Instant::now() + FLATTEN_ROUND)
                })
                .await;
            match round {
                Ok(true) => {
                    tracing::info!(volume = %vol, "background flatten done");
                    return;
                }
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!(volume = %vol, "background flatten stopped: {e}");
                    return;
                }
            }
        }
        tracing::warn!(volume = %vol, "background flatten given up after {FLATTEN_ROUNDS} rounds");
    });
}

/// The CSI controller's fence: none. Its caller (external-provisioner or
/// external-resizer, which do their own leader election) sends at most one
/// request per volume at a time, and the driver refuses a second one in
/// flight, so no deposed replica of ours acts beside a new one.
const CO_SERIALISED: NoFence = NoFence;

/// Size of a volume whose request names none.
pub const DEFAULT_SIZE: u64 = 1 << 30;

/// The Controller service.
pub struct ControllerService {
    driver: Arc<Driver>,
}

impl ControllerService {
    /// A controller over `driver`.
    pub fn new(driver: Arc<Driver>) -> ControllerService {
        ControllerService { driver }
    }
}

/// The access mode and volume mode a capability asks for, in Kubernetes'
/// words, so the provisioner's [`check_access`] rules apply unchanged.
fn k8s_modes(cap: &VolumeCapability) -> Result<(String, &'static str), Status> {
    use volume_capability::access_mode::Mode;
    let mode = cap
        .access_mode
        .as_ref()
        .ok_or_else(|| Status::invalid_argument("a volume capability has no access_mode"))?;
    let volume_mode = match &cap.access_type {
        Some(volume_capability::AccessType::Block(_)) => "Block",
        Some(volume_capability::AccessType::Mount(m)) => {
            if !matches!(m.fs_type.as_str(), "" | "ext4" | "ext3" | "xfs") {
                return Err(Status::invalid_argument(format!(
                    "fs_type {:?} is not supported; use ext4, ext3 or xfs",
                    m.fs_type
                )));
            }
            "Filesystem"
        }
        None => {
            return Err(Status::invalid_argument(
                "a volume capability has no access_type (block or mount)",
            ))
        }
    };
    let access = match Mode::try_from(mode.mode) {
        Ok(Mode::SingleNodeWriter) | Ok(Mode::SingleNodeMultiWriter) => "ReadWriteOnce",
        Ok(Mode::SingleNodeSingleWriter) => "ReadWriteOncePod",
        Ok(Mode::SingleNodeReaderOnly) | Ok(Mode::MultiNodeReaderOnly) => "ReadOnlyMany",
        Ok(Mode::MultiNodeMultiWriter) | Ok(Mode::MultiNodeSingleWriter) => "ReadWriteMany",
        _ => {
            return Err(Status::invalid_argument(format!(
                "access mode {} is not supported",
                mode.mode
            )))
        }
    };
    Ok((access.to_owned(), volume_mode))
}

/// Checks capabilities for a new empty volume (`empty`) or an existing one.
fn check_caps(caps: &[VolumeCapability], empty: bool) -> Result<(), Status> {
    if caps.is_empty() {
        return Err(Status::invalid_argument("volume_capabilities is empty"));
    }
    for cap in caps {
        let (access, volume_mode) = k8s_modes(cap)?;
        if !empty && access == "ReadOnlyMany" {
            continue;
        }
        check_access(&[access], volume_mode).map_err(Status::invalid_argument)?;
    }
    Ok(())
}

/// The size to create for a capacity range, rounded up to whole MiB.
fn size_for(range: Option<&CapacityRange>) -> Result<(u64, u64, u64), Status> {
    let (req, limit) = match range {
        Some(r) => (r.required_bytes, r.limit_bytes),
        None => (0, 0),
    };
    if req < 0 || limit < 0 {
        return Err(Status::out_of_range("capacity_range holds a negative size"));
    }
    let (req, limit) = (req as u64, limit as u64);
    if limit > 0 && req > limit {
        return Err(Status::out_of_range(format!(
            "required_bytes {req} is more than limit_bytes {limit}"
        )));
    }
    let wanted = if req == 0 {
        if limit > 0 {
            limit.min(DEFAULT_SIZE)
        } else {
            DEFAULT_SIZE
        }
    } else {
        req
    };
    let size = round_up_mib(wanted.max(MIB));
    if limit > 0 && size > limit {
        return Err(Status::out_of_range(format!(
            "{wanted} bytes rounded up to whole MiB ({size}) is more than limit_bytes {limit}"
        )));
    }
    Ok((size, req, limit))
}

fn to_hash(m: BTreeMap<String, String>) -> HashMap<String, String> {
    m.into_iter().collect()
}

impl ControllerService {
    /// This driver's volumes, sorted by handle, each with what is wrong with
    /// it when `health` is asked for. The pools are those volumes were seen
    /// in (kept across restarts with `--state-dir`) and every RBD pool of
    /// each configured cluster this server has credentials for. A seen pool
    /// that cannot be scanned fails the list (ListVolumes), or, for health,
    /// has the volumes its last scan found reported inaccessible, naming
    /// the error, and the other pools are listed all the same. A found pool
    /// this user may not read is not this driver's and is skipped.
    async fn scan_volumes(&self, health: bool) -> Result<Vec<ScannedVolume>, Status> {
        // A cluster gone from the config takes its pools out of the list.
        let seen: BTreeSet<_> = self
            .driver
            .pools_seen()
            .into_iter()
            .filter(|(c, _, _)| self.driver.clusters.get(c).is_some())
            .collect();
        // Which clusters this server has credentials for, read once.
        let mut with_credentials = BTreeSet::new();
        for id in self.driver.clusters.config().ids() {
            if self.driver.has_credentials(&id)? {
                with_credentials.insert(id);
            } else {
                tracing::warn!(cluster = %id,
                    "volumes cannot be listed: no credentials for this cluster yet (--credentials-dir, or a call with secrets)");
            }
        }
        let mut places = seen.clone();
        places.extend(self.found_pools(&with_credentials).await);
        let mut all = Vec::new();
        for place in places {
            // Without credentials nothing is known of it (warned above):
            // not "inaccessible".
            if !with_credentials.contains(&place.0) {
                continue;
            }
            match self.scan_pool(&place, health).await {
                Ok(found) => {
                    self.driver
                        .scanned(&place, found.iter().map(|v| v.handle.clone()).collect());
                    all.extend(found);
                }
                // The pool (or the namespace in it) is gone, and its
                // volumes with it.
                Err(e) if e.code() == Code::NotFound => self.driver.scanned(&place, Vec::new()),
                Err(e) if e.code() == Code::PermissionDenied && !seen.contains(&place) => {
                    tracing::debug!(cluster = %place.0, pool = %place.1, "pool not readable by this user; skipped");
                }
                Err(e) if health => all.extend(self.unreadable(&place, &e)),
                Err(e) => return Err(e),
            }
        }
        all.sort_by(|a, b| a.handle.cmp(&b.handle));
        Ok(all)
    }

    /// The RBD pools of `clusters` (those this server has credentials
    /// for), in each cluster's namespace. A cluster that cannot be asked is
    /// logged and left to the pools seen there.
    async fn found_pools(&self, clusters: &BTreeSet<String>) -> Vec<(String, String, String)> {
        let mut out = Vec::new();
        for cluster_id in clusters {
            let Ok(info) = self.driver.cluster(cluster_id) else {
                continue;
            };
            let found = match self.driver.connect(cluster_id, &HashMap::new()).await {
                Ok(conn) => self
                    .driver
                    .ceph(&conn, |c, _m| Ok(crate::volume::rbd_pools(c)?))
                    .await
                    .map_err(|e| volume_status(&e)),
                Err(e) => Err(e),
            };
            match found {
                Ok(pools) => out.extend(
                    pools
                        .into_iter()
                        .map(|p| (cluster_id.clone(), p, info.rados_namespace.clone())),
                ),
                Err(e) => tracing::warn!(cluster = %cluster_id, error = %e.message(),
                    "the cluster's pools cannot be listed; only those seen before are"),
            }
        }
        out
    }

    /// What a health list says of a pool that cannot be scanned: the
    /// volumes its last scan found, inaccessible.
    fn unreadable(&self, place: &(String, String, String), e: &Status) -> Vec<ScannedVolume> {
        let (cluster_id, pool, ns) = place;
        let why = format!(
            "pool {pool:?} (namespace {ns:?}) of cluster {cluster_id:?} cannot be read: {}",
            e.message()
        );
        tracing::warn!(cluster = %cluster_id, pool = %pool, error = %e.message(),
            "volume health: a pool cannot be scanned; its volumes are reported inaccessible");
        self.driver
            .last_scanned(place)
            .into_iter()
            .map(|handle| ScannedVolume {
                handle,
                size: 0,
                problems: vec![health_entry(
                    VolumeHealthErrorType::Inaccessible,
                    "PoolUnreadable",
                    why.clone(),
                )],
            })
            .collect()
    }

    /// One pool's volumes of this driver (one blocking call).
    async fn scan_pool(
        &self,
        place: &(String, String, String),
        health: bool,
    ) -> Result<Vec<ScannedVolume>, Status> {
        let (cluster_id, pool, ns) = place.clone();
        let conn = self.driver.connect(&cluster_id, &HashMap::new()).await?;
        let name = self.driver.name.clone();
        self.driver
            .ceph(&conn, move |c, _m| {
                let io = c.ioctx_ns(&pool, &ns)?;
                let pool_health = if health {
                    pool_health(c, &pool)
                } else {
                    Vec::new()
                };
                let mut out = Vec::new();
                for image in rbd::list_names(&io)? {
                    // Another client may remove it meanwhile.
                    let Ok(img) = Image::open_read_only(&io, &image) else {
                        continue;
                    };
                    if img.metadata_get(META_PROVISIONER).ok().as_deref() != Some(&name)
                        || img.metadata_get(META_KIND).is_ok()
                    {
                        continue;
                    }
                    let vol = VolumeId {
                        cluster_id: cluster_id.clone(),
                        pool: pool.clone(),
                        rados_namespace: ns.clone(),
                        image,
                    };
                    let mut problems = Vec::new();
                    if health {
                        problems = image_health(&img);
                        problems.extend(pool_health.iter().cloned());
                    }
                    // One unreadable header is that volume's problem,
                    // not a failed list (0: size unknown).
                    let size = img.size().unwrap_or_else(|e| {
                        problems.push(health_entry(
                            VolumeHealthErrorType::Degraded,
                            "HeaderUnreadable",
                            format!("the image's size cannot be read: {e}"),
                        ));
                        0
                    });
                    out.push(ScannedVolume {
                        handle: vol.handle(),
                        size,
                        problems,
                    });
                }
                Ok(out)
            })
            .await
            .map_err(|e| volume_status(&e))
    }
}

/// One of this driver's volumes, as [`ControllerService::scan_volumes`]
/// found it.
struct ScannedVolume {
    handle: String,
    size: u64,
    problems: Vec<VolumeHealthEntry>,
}

/// librbd.h `RBD_FLAG_OBJECT_MAP_INVALID` and `RBD_FLAG_FAST_DIFF_INVALID`.
const FLAG_OBJECT_MAP_INVALID: u64 = 1 << 0;
const FLAG_FAST_DIFF_INVALID: u64 = 1 << 1;

fn health_entry(status: VolumeHealthErrorType, reason: &str, message: String) -> VolumeHealthEntry {
    VolumeHealthEntry {
        status: status as i32,
        reason: reason.to_owned(),
        message,
    }
}

/// What the image's own header says is wrong: an object map librbd has
/// flagged invalid (after a crash of a writer without the lock released),
/// which slows I/O and diffs until `rbd object-map rebuild`.
fn image_health(img: &Image) -> Vec<VolumeHealthEntry> {
    match img.flags() {
        Ok(f) if f & (FLAG_OBJECT_MAP_INVALID | FLAG_FAST_DIFF_INVALID) != 0 => vec![health_entry(
            VolumeHealthErrorType::Degraded,
            "ObjectMapInvalid",
            "the image's object map is flagged invalid; run `rbd object-map rebuild`".to_owned(),
        )],
        Ok(_) => Vec::new(),
        Err(e) => vec![health_entry(
            VolumeHealthErrorType::Degraded,
            "HeaderUnreadable",
            format!("the image's flags cannot be read: {e}"),
        )],
    }
}

/// A full pool: writes to every image in it block.
fn pool_health(c: &crate::rados::Cluster, pool: &str) -> Vec<VolumeHealthEntry> {
    match pool_max_avail(c, pool) {
        Ok(0) => vec![health_entry(
            VolumeHealthErrorType::Degraded,
            "PoolFull",
            format!("pool {pool:?} has no space left (ceph df max_avail is 0)"),
        )],
        // Not knowing is no known problem (the user may lack `ceph df`).
        _ => Vec::new(),
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        req: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let req = req.into_inner();
        let name = required("name", &req.name)?.to_owned();
        let source = match req
            .volume_content_source
            .as_ref()
            .and_then(|s| s.r#type.as_ref())
        {
            None => None,
            Some(volume_content_source::Type::Snapshot(s)) => {
                Some(Source::Snapshot(snapshot_id(&s.snapshot_id)?))
            }
            Some(volume_content_source::Type::Volume(v)) => {
                Some(Source::Volume(volume_field("volume_id", &v.volume_id)?))
            }
        };
        // ReadOnlyMany is fine for a restore or a clone: it has content.
        check_caps(&req.volume_capabilities, source.is_none())?;
        let (raw, params) = class_params(&req.parameters, "StorageClass", ClassParams::parse_csi)?;
        // The VolumeAttributesClass's parameters take precedence over the
        // StorageClass's (the spec's rule for mutable_parameters).
        let qos_policy = params.qos.merged(&mutable_policy(&req.mutable_parameters)?);
        qos_policy.check().map_err(|e| {
            Status::invalid_argument(format!("QoS parameter {:?}: {}", e.param, e.why))
        })?;
        let (mut size, required_bytes, limit) = size_for(req.capacity_range.as_ref())?;
        if source.is_some() && required_bytes == 0 {
            // The source's size (a larger limit only caps it).
            size = 0;
        }
        let busy = self.driver.begin(&name)?;
        let info = self.driver.cluster(&params.cluster_id)?;
        let vol = VolumeId {
            cluster_id: params.cluster_id.clone(),
            pool: params.pool.clone(),
            rados_namespace: info.rados_namespace.clone(),
            image: params.image_name(&image_base(&name)),
        };
        let conn = self
            .driver
            .connect(&params.cluster_id, &req.secrets)
            .await?;
        let source_pool = source.as_ref().map(|s| match s {
            Source::Snapshot(s) => s.pool.clone(),
            Source::Volume(v) => v.pool.clone(),
        });
        let (params, vol, accessible) = crate::csi::topology::place(
            &self.driver,
            &busy,
            &conn,
            (params, vol),
            &name,
            req.accessibility_requirements.as_ref(),
            source_pool.as_deref(),
        )
        .await?;
        let owner = Owner {
            provisioner: self.driver.name.clone(),
            pv_name: name.clone(),
            pvc_namespace: raw.get(PVC_NAMESPACE_META).cloned().unwrap_or_default(),
            pvc_name: raw.get(PVC_NAME_META).cloned().unwrap_or_default(),
            cluster_id: params.cluster_id.clone(),
        };
        let options = params
            .image_options()
            .map_err(|e| Status::invalid_argument(format!("image options: {e}")))?;
        let encryption = match &params.encryption {
            None => None,
            Some(e) => {
                let parent = source.as_ref().map(|s| match s {
                    Source::Snapshot(s) => s.image_id(),
                    Source::Volume(v) => v.clone(),
                });
                let tenant = Some(owner.pvc_namespace.as_str()).filter(|t| !t.is_empty());
                Some(
                    self.driver
                        .new_encryption(&conn, e, &vol, parent, tenant, &req.secrets)
                        .await?,
                )
            }
        };
        let v = vol.clone();
        let created = match source {
            None => self
                .driver
                .ceph_holding(&busy, &conn, move |c, m| {
                    ops::ensure_image_encrypted(
                        c,
                        m,
                        &CO_SERIALISED,
                        &v,
                        size,
                        &options,
                        &owner,
                        encryption.as_ref(),
                    )
                })
                .await
                .map_err(|e| volume_status(&e))?,
            Some(source) => {
                let opts = CloneOptions {
                    depth: params.clone_depth,
                    encryption,
                    ..Default::default()
                };
                let cloned = self
                    .driver
                    .ceph_holding(&busy, &conn, move |c, m| match &source {
                        Source::Snapshot(s) => snap::ensure_volume_from_snapshot(
                            c, m, s, &v, size, &options, &owner, &opts,
                        ),
                        Source::Volume(s) => snap::ensure_volume_from_volume(
                            c, m, s, &v, size, &options, &owner, &opts,
                        ),
                    })
                    .await
                    .map_err(|e| match e {
                        VolumeError::ShrinkRefused { .. } => Status::out_of_range(e.to_string()),
                        e => volume_status(&e),
                    })?;
                tracing::info!(volume = %vol, depth = cloned.depth, flatten = ?cloned.flatten, "cloned");
                if cloned.flatten == Flatten::Background {
                    flatten_in_background(Arc::clone(&self.driver), vol.clone());
                }
                cloned.size
            }
        };
        self.driver.saw_pool(&vol);
        // A clone starts from its own request, not from the limits it
        // inherited with its source's metadata.
        if !qos_policy.is_empty() || req.volume_content_source.is_some() {
            self.apply_qos(&busy, &conn, &vol, &name, qos_policy, qos::Mode::Replace)
                .await?;
        }
        let compatible = created >= required_bytes.max(1) && (limit == 0 || created <= limit);
        if !compatible {
            return Err(Status::already_exists(format!(
                "volume {name:?} already exists as image {vol} with {created} bytes, which does not fit the requested range"
            )));
        }
        tracing::info!(volume = %vol, bytes = created, "CreateVolume done");
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: created as i64,
                volume_id: vol.handle(),
                volume_context: to_hash(volume_context(&vol, &params)),
                content_source: req.volume_content_source.clone(),
                accessible_topology: accessible
                    .iter()
                    .map(crate::csi::topology::topology)
                    .collect(),
            }),
        }))
    }

    async fn delete_volume(
        &self,
        req: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?;
        // An id this driver cannot have made names no volume: done.
        let Ok(vol) = VolumeId::parse(id) else {
            return Ok(Response::new(DeleteVolumeResponse {}));
        };
        let busy = self.driver.begin(id)?;
        let conn = self.driver.connect(&vol.cluster_id, &req.secrets).await?;
        let name = self.driver.name.clone();
        let v = vol.clone();
        // A Vault key goes once the image is gone.
        let done = self
            .driver
            .remove_with_key(&busy, &conn, &vol, id, false, &req.secrets, move |c, m| {
                match ops::recorded_pv_name(c, m, &v, &name) {
                    Ok(None) => Ok(ops::Deleted::AlreadyGone),
                    Ok(Some(pv)) => ops::delete_image(c, m, &CO_SERIALISED, &v, &name, &pv),
                    // The pool itself is gone: so is the volume.
                    Err(VolumeError::Ceph(e)) if e.is_not_found() => Ok(ops::Deleted::AlreadyGone),
                    Err(e) => Err(e),
                }
            })
            .await?;
        tracing::info!(volume = %vol, outcome = ?done, "DeleteVolume done");
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        _req: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "ControllerPublishVolume: the driver needs no attach step (attachRequired: false)",
        ))
    }

    async fn controller_unpublish_volume(
        &self,
        _req: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "ControllerUnpublishVolume: the driver needs no attach step (attachRequired: false)",
        ))
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = req.into_inner();
        let vol = volume_id(&req.volume_id)?;
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities is empty"));
        }
        let conn = self.driver.connect(&vol.cluster_id, &req.secrets).await?;
        let v = vol.clone();
        self.driver
            .ceph(&conn, move |c, _m| {
                let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
                Image::open_read_only(&io, &v.image)?;
                Ok(())
            })
            .await
            .map_err(|e| volume_status(&e))?;
        let checked = check_caps(&req.volume_capabilities, false)
            .and_then(|()| mutable_policy(&req.mutable_parameters).map(drop));
        let confirmed = match checked {
            Ok(()) => Some(validate_volume_capabilities_response::Confirmed {
                volume_context: req.volume_context.clone(),
                volume_capabilities: req.volume_capabilities.clone(),
                parameters: req.parameters.clone(),
                mutable_parameters: req.mutable_parameters.clone(),
            }),
            Err(s) => {
                return Ok(Response::new(ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message: s.message().to_owned(),
                }))
            }
        };
        Ok(Response::new(ValidateVolumeCapabilitiesResponse {
            confirmed,
            message: String::new(),
        }))
    }

    async fn list_volumes(
        &self,
        req: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let req = req.into_inner();
        let start = page_start(req.max_entries, &req.starting_token)?;
        let mut all: Vec<(String, u64)> = self
            .scan_volumes(false)
            .await?
            .into_iter()
            .map(|v| (v.handle, v.size))
            .collect();
        all.sort();
        if start > all.len() {
            return Err(Status::aborted(format!(
                "starting_token {start} is past the end ({} volumes)",
                all.len()
            )));
        }
        let max = if req.max_entries == 0 {
            usize::MAX
        } else {
            req.max_entries as usize
        };
        let end = start.saturating_add(max).min(all.len());
        let entries = all[start..end]
            .iter()
            .map(|(id, size)| list_volumes_response::Entry {
                volume: Some(Volume {
                    capacity_bytes: *size as i64,
                    volume_id: id.clone(),
                    ..Default::default()
                }),
                status: None,
            })
            .collect();
        let next_token = if end < all.len() {
            end.to_string()
        } else {
            String::new()
        };
        Ok(Response::new(ListVolumesResponse {
            entries,
            next_token,
        }))
    }

    async fn get_capacity(
        &self,
        req: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let req = req.into_inner();
        let targets: Vec<(String, String)> =
            match (req.parameters.get(CLUSTER_ID), req.parameters.get(POOL)) {
                (Some(c), Some(p)) => vec![(c.clone(), p.clone())],
                (None, None) => {
                    let mut v: Vec<(String, String)> = self
                        .driver
                        .pools_seen()
                        .into_iter()
                        .map(|(c, p, _)| (c, p))
                        .collect();
                    v.dedup();
                    v
                }
                _ => {
                    return Err(Status::invalid_argument(format!(
                        "parameters need both {CLUSTER_ID} and {POOL}, or neither"
                    )))
                }
            };
        let mut available: u64 = 0;
        for (cluster_id, pool) in targets {
            let conn = self.driver.connect(&cluster_id, &HashMap::new()).await?;
            let avail = self
                .driver
                .ceph(&conn, move |c, _m| Ok(pool_max_avail(c, &pool)?))
                .await
                .map_err(|e| volume_status(&e))?;
            available = available.saturating_add(avail);
        }
        Ok(Response::new(GetCapacityResponse {
            available_capacity: available.min(i64::MAX as u64) as i64,
            maximum_volume_size: None,
            minimum_volume_size: Some(MIB as i64),
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _req: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        use controller_service_capability::rpc::Type as T;
        let capabilities = [
            T::CreateDeleteVolume,
            T::ExpandVolume,
            T::ListVolumes,
            T::GetCapacity,
            T::SingleNodeMultiWriter,
            T::CreateDeleteSnapshot,
            T::ListSnapshots,
            T::CloneVolume,
            T::GetSnapshot,
            T::GetVolumeHealth,
            T::ListVolumeHealth,
            T::ModifyVolume,
        ]
        .into_iter()
        .map(|t| ControllerServiceCapability {
            r#type: Some(controller_service_capability::Type::Rpc(
                controller_service_capability::Rpc { r#type: t as i32 },
            )),
        })
        .collect();
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn create_snapshot(
        &self,
        req: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let req = req.into_inner();
        let name = required("name", &req.name)?.to_owned();
        let source = volume_field("source_volume_id", &req.source_volume_id)?;
        let (raw, params) = class_params(
            &req.parameters,
            "VolumeSnapshotClass",
            SnapshotParams::parse,
        )?;
        for (key, want, have) in [
            (CLUSTER_ID, &params.cluster_id, &source.cluster_id),
            (POOL, &params.pool, &source.pool),
        ] {
            if want.as_ref().is_some_and(|w| w != have) {
                return Err(Status::invalid_argument(format!(
                    "the source volume {source} is not in the {key} {:?} the snapshot class names; snapshots stay in their source's pool",
                    want.as_deref().unwrap_or_default()
                )));
            }
        }
        let busy = self.driver.begin(&format!("snapshot/{name}"))?;
        let conn = self
            .driver
            .connect(&source.cluster_id, &req.secrets)
            .await?;
        let (snapshot_namespace, snapshot_object) =
            params.snapshot_object.clone().unwrap_or_default();
        let owner = SnapshotOwner {
            provisioner: self.driver.name.clone(),
            snapshot_name: raw
                .get(VOLUMESNAPSHOTCONTENT_NAME_META)
                .cloned()
                .unwrap_or_else(|| name.clone()),
            cluster_id: source.cluster_id.clone(),
            snapshot_namespace,
            snapshot_object,
        };
        let image = format!("{}{}", params.snapshot_name_prefix, image_base(&name));
        let opts = CloneOptions {
            depth: params.clone_depth,
            ..Default::default()
        };
        let src = source.clone();
        let info = self
            .driver
            .ceph_holding(&busy, &conn, move |c, m| {
                snap::ensure_snapshot(c, m, &src, &image, &owner, &opts)
            })
            .await
            .map_err(|e| volume_status(&e))?;
        // A Vault-encrypted source's key, copied under the snapshot's id.
        self.driver
            .snapshot_key(&conn, &info.id.image_id(), &info.id.handle(), &req.secrets)
            .await?;
        self.driver.saw_pool(&source);
        tracing::info!(snapshot = %info.id, source = %source, "CreateSnapshot done");
        Ok(Response::new(CreateSnapshotResponse {
            snapshot: Some(csi_snapshot(&info)),
        }))
    }

    async fn delete_snapshot(
        &self,
        req: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let req = req.into_inner();
        let id = required("snapshot_id", &req.snapshot_id)?;
        // An id this driver cannot have made names no snapshot: done.
        let Ok(sid) = SnapshotId::parse(id) else {
            return Ok(Response::new(DeleteSnapshotResponse {}));
        };
        let busy = self.driver.begin(id)?;
        let conn = self.driver.connect(&sid.cluster_id, &req.secrets).await?;
        let name = self.driver.name.clone();
        let s = sid.clone();
        let done = self
            .driver
            .remove_with_key(
                &busy,
                &conn,
                &sid.image_id(),
                id,
                true,
                &req.secrets,
                move |c, m| match snap::delete_snapshot(c, m, &s, &name) {
                    // The pool itself is gone: so is the snapshot.
                    Err(VolumeError::Ceph(e)) if e.is_not_found() => Ok(ops::Deleted::AlreadyGone),
                    other => other,
                },
            )
            .await?;
        tracing::info!(snapshot = %sid, outcome = ?done, "DeleteSnapshot done");
        Ok(Response::new(DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        req: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        let req = req.into_inner();
        let start = page_start(req.max_entries, &req.starting_token)?;
        let empty = || {
            Ok(Response::new(ListSnapshotsResponse {
                entries: Vec::new(),
                next_token: String::new(),
            }))
        };
        let mut filter = SnapshotFilter::default();
        let mut places: Vec<VolumeId> = Vec::new();
        if !req.snapshot_id.is_empty() {
            // One this driver cannot have made does not exist.
            let Ok(sid) = SnapshotId::parse(&req.snapshot_id) else {
                return empty();
            };
            places.push(sid.image_id());
            filter.snapshot = Some(sid);
        }
        if !req.source_volume_id.is_empty() {
            let Ok(vol) = VolumeId::parse(&req.source_volume_id) else {
                return empty();
            };
            if places.is_empty() {
                places.push(vol.clone());
            }
            filter.source_volume = Some(req.source_volume_id.clone());
        }
        if places.is_empty() {
            places = self
                .driver
                .pools_seen()
                .into_iter()
                .map(|(cluster_id, pool, rados_namespace)| VolumeId {
                    cluster_id,
                    pool,
                    rados_namespace,
                    image: String::new(),
                })
                .collect();
        }
        let mut all: Vec<SnapshotInfo> = Vec::new();
        for place in places {
            if self.driver.clusters.get(&place.cluster_id).is_none() {
                continue;
            }
            let conn = self.driver.connect(&place.cluster_id, &req.secrets).await?;
            let (name, f) = (self.driver.name.clone(), filter.clone());
            let found = self
                .driver
                .ceph(&conn, move |c, m| {
                    snap::list_snapshots(c, m, &place, &name, &f)
                })
                .await;
            match found {
                Ok(found) => all.extend(found),
                Err(VolumeError::Ceph(e)) if e.is_not_found() => {}
                Err(e) => return Err(volume_status(&e)),
            }
        }
        all.sort_by_key(|i| i.id.handle());
        let (entries, next) =
            snap::page(&all, start, req.max_entries as usize).map_err(Status::aborted)?;
        Ok(Response::new(ListSnapshotsResponse {
            entries: entries
                .iter()
                .map(|i| list_snapshots_response::Entry {
                    snapshot: Some(csi_snapshot(i)),
                })
                .collect(),
            next_token: next.map(|n| n.to_string()).unwrap_or_default(),
        }))
    }

    async fn get_snapshot(
        &self,
        req: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        let req = req.into_inner();
        let sid = snapshot_id(&req.snapshot_id)?;
        if self.driver.clusters.get(&sid.cluster_id).is_none() {
            return Err(Status::not_found(format!(
                "no such snapshot: cluster {:?} is not in the clusters config",
                sid.cluster_id
            )));
        }
        let conn = self.driver.connect(&sid.cluster_id, &req.secrets).await?;
        let (name, s) = (self.driver.name.clone(), sid.clone());
        let found = self
            .driver
            .ceph(&conn, move |c, m| snap::get_snapshot(c, m, &s, &name))
            .await;
        match found {
            Ok(Some(info)) => Ok(Response::new(GetSnapshotResponse {
                snapshot: Some(csi_snapshot(&info)),
            })),
            Ok(None) => Err(Status::not_found(format!("no such snapshot: {sid}"))),
            Err(VolumeError::Ceph(e)) if e.is_not_found() => {
                Err(Status::not_found(format!("no such snapshot: {sid}")))
            }
            Err(e) => Err(volume_status(&e)),
        }
    }

    async fn controller_expand_volume(
        &self,
        req: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = req.into_inner();
        let vol = volume_id(&req.volume_id)?;
        let range = req
            .capacity_range
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("capacity_range is missing"))?;
        let (size, _, _) = size_for(Some(range))?;
        let busy = self.driver.begin(&req.volume_id)?;
        let conn = self.driver.connect(&vol.cluster_id, &req.secrets).await?;
        let name = self.driver.name.clone();
        let v = vol.clone();
        let new_size = self
            .driver
            .ceph_holding(&busy, &conn, move |c, m| {
                let pv = ops::recorded_pv_name(c, m, &v, &name)?.ok_or_else(|| {
                    VolumeError::Missing {
                        image: v.image.clone(),
                    }
                })?;
                ops::expand_image(c, m, &CO_SERIALISED, &v, &name, &pv, size)
            })
            .await
            .map_err(|e| volume_status(&e))?;
        tracing::info!(volume = %vol, bytes = new_size, "ControllerExpandVolume done");
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: new_size as i64,
            // Block too: krbd's device grows by itself, but the loop device
            // of rbdkit-fuse only when NodeExpandVolume asks the mapper to
            // re-read the size. The controller does not know the mapper.
            node_expansion_required: true,
        }))
    }

    async fn controller_get_volume(
        &self,
        _req: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "ControllerGetVolume is not supported",
        ))
    }

    async fn controller_get_volume_health(
        &self,
        req: Request<ControllerGetVolumeHealthRequest>,
    ) -> Result<Response<ControllerGetVolumeHealthResponse>, Status> {
        let req = req.into_inner();
        let vol = volume_id(&req.volume_id)?;
        let conn = self.driver.connect(&vol.cluster_id, &req.secrets).await?;
        let (v, name) = (vol.clone(), self.driver.name.clone());
        let found = self
            .driver
            .ceph(&conn, move |c, _m| {
                let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
                let img = Image::open_read_only(&io, &v.image)?;
                // Only a missing key means "not ours": a timeout or any
                // other failure to read it is an error, not NOT_FOUND.
                match img.metadata_get(META_PROVISIONER) {
                    Ok(owner) if owner == name => {}
                    Ok(_) => return Err(VolumeError::Missing { image: v.image }),
                    Err(e) if e.is_not_found() => {
                        return Err(VolumeError::Missing { image: v.image })
                    }
                    Err(e) => return Err(VolumeError::Ceph(e)),
                }
                let mut problems = image_health(&img);
                problems.extend(pool_health(c, &v.pool));
                Ok(problems)
            })
            .await;
        let health_statuses = match found {
            Ok(p) => p,
            Err(VolumeError::Ceph(e)) if e.is_not_found() => {
                return Err(Status::not_found(format!("no such volume: {vol}")))
            }
            Err(e) => return Err(volume_status(&e)),
        };
        Ok(Response::new(ControllerGetVolumeHealthResponse {
            volume_health: Some(VolumeHealth {
                volume_id: req.volume_id,
                health_statuses,
            }),
        }))
    }

    async fn controller_list_volume_health(
        &self,
        req: Request<ControllerListVolumeHealthRequest>,
    ) -> Result<Response<ControllerListVolumeHealthResponse>, Status> {
        let req = req.into_inner();
        let start = page_start(req.max_entries, &req.starting_token)?;
        // Only the volumes something is wrong with.
        let abnormal: Vec<VolumeHealth> = self
            .scan_volumes(true)
            .await?
            .into_iter()
            .filter(|v| !v.problems.is_empty())
            .map(|v| VolumeHealth {
                volume_id: v.handle,
                health_statuses: v.problems,
            })
            .collect();
        let (entries, next) =
            snap::page(&abnormal, start, req.max_entries as usize).map_err(Status::aborted)?;
        Ok(Response::new(ControllerListVolumeHealthResponse {
            entries,
            next_token: next.map(|n| n.to_string()).unwrap_or_default(),
        }))
    }

    async fn controller_get_node_info(
        &self,
        _req: Request<ControllerGetNodeInfoRequest>,
    ) -> Result<Response<ControllerGetNodeInfoResponse>, Status> {
        // The spec ties GET_NODE_INFO to PUBLISH_UNPUBLISH_VOLUME, which a
        // driver with no attach step does not offer.
        Err(Status::unimplemented(
            "ControllerGetNodeInfo is not supported (no ControllerPublishVolume)",
        ))
    }

    async fn controller_modify_volume(
        &self,
        req: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        let req = req.into_inner();
        let vol = volume_id(&req.volume_id)?;
        let policy = mutable_policy(&req.mutable_parameters)?;
        if self.driver.clusters.get(&vol.cluster_id).is_none() {
            return Err(Status::not_found(format!(
                "no such volume: cluster {:?} is not in the clusters config",
                vol.cluster_id
            )));
        }
        let busy = self.driver.begin(&req.volume_id)?;
        let conn = self.driver.connect(&vol.cluster_id, &req.secrets).await?;
        let (v, name) = (vol.clone(), self.driver.name.clone());
        let found = self
            .driver
            .ceph_holding(&busy, &conn, move |c, m| {
                ops::recorded_pv_name(c, m, &v, &name)
            })
            .await;
        let pv = match found {
            Ok(Some(pv)) => pv,
            Ok(None) => return Err(Status::not_found(format!("no such volume: {vol}"))),
            Err(VolumeError::Ceph(e)) if e.is_not_found() => {
                return Err(Status::not_found(format!("no such volume: {vol}")))
            }
            Err(e) => return Err(volume_status(&e)),
        };
        let limits = self
            .apply_qos(&busy, &conn, &vol, &pv, policy, qos::Mode::Update)
            .await?;
        tracing::info!(volume = %vol, limits = %limits, "ControllerModifyVolume done");
        Ok(Response::new(ControllerModifyVolumeResponse {}))
    }
}

/// A request's `mutable_parameters` as a QoS policy: INVALID_ARGUMENT
/// naming an unknown or immutable parameter (which the CO reports as an
/// Infeasible modification).
fn mutable_policy(params: &HashMap<String, String>) -> Result<qos::Policy, Status> {
    let raw: BTreeMap<String, String> = params.clone().into_iter().collect();
    qos::Policy::from_mutable(&raw).map_err(|e| {
        Status::invalid_argument(format!(
            "mutable parameter (VolumeAttributesClass parameter) {:?}: {}",
            e.param, e.why
        ))
    })
}

impl ControllerService {
    /// Applies a QoS policy to the volume `vol` of PV `pv_name`.
    async fn apply_qos(
        &self,
        busy: &InFlight,
        conn: &crate::volume::clusters::Conn,
        vol: &VolumeId,
        pv_name: &str,
        policy: qos::Policy,
        mode: qos::Mode,
    ) -> Result<qos::Limits, Status> {
        let (v, name, pv) = (vol.clone(), self.driver.name.clone(), pv_name.to_owned());
        self.driver
            .ceph_holding(busy, conn, move |c, m| {
                qos::apply_to_volume(c, m, &CO_SERIALISED, &v, &name, &pv, &policy, mode)
            })
            .await
            .map_err(|e| volume_status(&e))
    }
}

/// The bytes a pool can still take (`max_avail` of `ceph df`).
fn pool_max_avail(cluster: &crate::rados::Cluster, pool: &str) -> crate::Result<u64> {
    let reply = cluster.mon_command(r#"{"prefix": "df", "format": "json"}"#, &[])?;
    let v: serde_json::Value = serde_json::from_slice(&reply.output).map_err(|e| {
        crate::Error::invalid("ceph df", pool.to_owned(), format!("unreadable reply: {e}"))
    })?;
    v["pools"]
        .as_array()
        .and_then(|pools| pools.iter().find(|p| p["name"] == pool))
        .and_then(|p| p["stats"]["max_avail"].as_u64())
        .ok_or_else(|| crate::Error::from_errno(libc::ENOENT, "ceph df", pool.to_owned()))
}

/// The first index of a List call's page: `starting_token` is an index this
/// driver returned (empty: 0), and `max_entries` must not be negative.
fn page_start(max_entries: i32, starting_token: &str) -> Result<usize, Status> {
    if max_entries < 0 {
        return Err(Status::invalid_argument("max_entries is negative"));
    }
    if starting_token.is_empty() {
        return Ok(0);
    }
    starting_token.parse().map_err(|_| {
        Status::aborted(format!(
            "starting_token {starting_token:?} is not one this driver returned"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::proto::volume_capability::{access_mode::Mode, AccessMode, AccessType};

    fn cap(mode: Mode, block: bool) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: Some(if block {
                AccessType::Block(Default::default())
            } else {
                AccessType::Mount(Default::default())
            }),
        }
    }

    #[test]
    fn a_page_starts_at_a_returned_token_and_refuses_bad_input() {
        assert_eq!(page_start(0, "").unwrap(), 0);
        assert_eq!(page_start(5, "7").unwrap(), 7);
        let neg = page_start(-1, "").unwrap_err();
        assert_eq!(neg.code(), tonic::Code::InvalidArgument);
        assert!(neg.message().contains("max_entries"), "{neg:?}");
        let bad = page_start(0, "x1").unwrap_err();
        assert_eq!(bad.code(), tonic::Code::Aborted);
        assert!(bad.message().contains("\"x1\""), "{bad:?}");
    }

    #[test]
    fn capabilities_follow_the_provisioner_rules() {
        assert!(check_caps(&[cap(Mode::SingleNodeWriter, false)], true).is_ok());
        assert!(check_caps(&[cap(Mode::MultiNodeMultiWriter, true)], true).is_ok());
        assert!(check_caps(&[cap(Mode::MultiNodeMultiWriter, false)], true).is_err());
        assert!(check_caps(&[cap(Mode::MultiNodeReaderOnly, false)], true).is_err());
        assert!(check_caps(&[cap(Mode::MultiNodeReaderOnly, false)], false).is_ok());
        assert!(check_caps(&[], true).is_err());
        let mut no_type = cap(Mode::SingleNodeWriter, false);
        no_type.access_type = None;
        assert!(check_caps(&[no_type], true).is_err());
    }

    #[test]
    fn sizes_round_up_and_respect_the_limit() {
        let r = |req, limit| CapacityRange {
            required_bytes: req,
            limit_bytes: limit,
        };
        assert_eq!(size_for(None).unwrap().0, DEFAULT_SIZE);
        assert_eq!(size_for(Some(&r(1, 0))).unwrap().0, MIB);
        assert_eq!(size_for(Some(&r(MIB as i64 + 1, 0))).unwrap().0, 2 * MIB);
        assert!(size_for(Some(&r(10, 5))).is_err());
        assert!(size_for(Some(&r(MIB as i64 + 1, MIB as i64 + 2))).is_err());
        assert!(size_for(Some(&r(-1, 0))).is_err());
    }

    #[test]
    fn request_checks_name_the_field_and_the_class() {
        let e = volume_field("source_volume_id", "").unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.message(), "source_volume_id is empty");
        let e = volume_field("volume_id", "not-a-handle").unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert_eq!(
            snapshot_id("").unwrap_err().message(),
            "snapshot_id is empty"
        );

        let raw = HashMap::from([("pool".to_owned(), "rbd".to_owned())]);
        let (seen, n) =
            class_params(&raw, "VolumeSnapshotClass", |m| Ok::<_, String>(m.len())).unwrap();
        assert_eq!((seen.get("pool").map(String::as_str), n), (Some("rbd"), 1));
        let e = class_params(&raw, "VolumeSnapshotClass", |_| {
            Err::<(), _>("StorageClass parameter \"pool\": bad")
        })
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.message(), "VolumeSnapshotClass parameter \"pool\": bad");
    }
}
