//! The CSI Node service: stage (map, mkfs, mount), publish (bind mount),
//! and their reverses; expansion, stats and volume health.
//!
//! Layout under a staging path, as kubelet gives it:
//! - `<staging>/rbdkit.json`: the stash, what unstaging needs (mapper,
//!   device, options). Written before the image is mapped, so a crash at
//!   any later point leaves enough to clean up.
//! - `<staging>/volume`: the filesystem's mount point (a directory), or,
//!   for Block volumes, a file the device is bind-mounted onto.
//!
//! Publishing bind-mounts `<staging>/volume` onto the target path. Each
//! step checks what is already in place, so kubelet may repeat any of them
//! after a crash.

use std::collections::HashMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status};

use crate::csi::driver::{credentials, required, status_of, volume_id, Driver};
use crate::csi::proto::{
    node_server::Node, node_service_capability, volume_capability, volume_usage,
    NodeExpandVolumeRequest, NodeExpandVolumeResponse, NodeGetCapabilitiesRequest,
    NodeGetCapabilitiesResponse, NodeGetInfoRequest, NodeGetInfoResponse,
    NodeGetVolumeStatsRequest, NodeGetVolumeStatsResponse, NodePublishVolumeRequest,
    NodePublishVolumeResponse, NodeServiceCapability, NodeStageVolumeRequest,
    NodeStageVolumeResponse, NodeUnpublishVolumeRequest, NodeUnpublishVolumeResponse,
    NodeUnstageVolumeRequest, NodeUnstageVolumeResponse, Topology, VolumeCapability,
    VolumeCondition, VolumeUsage,
};
use crate::node::{fs, mount, options, MapSpec, Mapper};
use crate::rbd::Image;
use crate::volume::ops::VolumeError;
use crate::volume::params::{NodeParams, MAP_OPTIONS, UNMAP_OPTIONS};
use crate::Error;

/// The stash file's name under the staging path.
pub const STASH: &str = "rbdkit.json";
/// The mount point (or device file) under the staging path.
pub const VOLUME: &str = "volume";

/// What NodeUnstageVolume (and stats and expansion) need to know about a
/// staged volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stash {
    /// The CSI volume id.
    pub volume_id: String,
    /// The mapper's name.
    pub mapper: String,
    /// The block device, once mapped.
    pub device: Option<PathBuf>,
    /// The filesystem, or `None` for a Block volume.
    pub fs_type: Option<String>,
    /// Staged read-only.
    pub read_only: bool,
    /// The mapper's unmap options.
    pub unmap_options: Vec<String>,
    /// Target paths it is published at.
    #[serde(default)]
    pub published: Vec<PathBuf>,
}

impl Stash {
    fn path(staging: &Path) -> PathBuf {
        staging.join(STASH)
    }

    /// Reads the stash under `staging`, `None` if there is none.
    pub fn read(staging: &Path) -> Result<Option<Stash>, Status> {
        let p = Stash::path(staging);
        match std::fs::read(&p) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| Status::internal(format!("stash {} is unreadable: {e}", p.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Status::internal(format!(
                "cannot read stash {}: {e}",
                p.display()
            ))),
        }
    }

    /// Writes it atomically (a temporary file, fsync, rename).
    pub fn write(&self, staging: &Path) -> Result<(), Status> {
        let p = Stash::path(staging);
        write_atomic(&p, &serde_json::to_vec_pretty(self).unwrap_or_default())
            .map_err(|e| Status::internal(format!("cannot write stash {}: {e}", p.display())))
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// The Node service.
pub struct NodeService {
    driver: Arc<Driver>,
    mappers: Vec<Arc<dyn Mapper>>,
    default_mapper: String,
    state_dir: PathBuf,
    default_fs: String,
}

impl NodeService {
    /// A node service with these mappers; `default_mapper` serves volumes
    /// whose class names none. `state_dir` keeps an index from volume id to
    /// staging path, for calls that do not carry it.
    pub fn new(
        driver: Arc<Driver>,
        mappers: Vec<Arc<dyn Mapper>>,
        default_mapper: String,
        state_dir: PathBuf,
    ) -> NodeService {
        NodeService {
            driver,
            mappers,
            default_mapper,
            state_dir,
            default_fs: "ext4".to_owned(),
        }
    }

    /// The filesystem for mount volumes whose capability names none
    /// (default ext4).
    pub fn default_fs(mut self, fs_type: impl Into<String>) -> NodeService {
        self.default_fs = fs_type.into();
        self
    }

    fn mapper(&self, name: &str) -> Result<Arc<dyn Mapper>, Status> {
        self.mappers
            .iter()
            .find(|m| m.name() == name)
            .cloned()
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "mapper {name:?} is not available on node {}",
                    self.driver.node_id
                ))
            })
    }

    fn index_path(&self, volume_id: &str) -> PathBuf {
        let safe: String = volume_id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.state_dir.join("staged").join(format!("{safe}.path"))
    }

    fn remember(&self, volume_id: &str, staging: &Path) -> Result<(), Status> {
        let p = self.index_path(volume_id);
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| Status::internal(format!("cannot create {}: {e}", dir.display())))?;
        }
        write_atomic(&p, staging.as_os_str().as_encoded_bytes())
            .map_err(|e| Status::internal(format!("cannot write {}: {e}", p.display())))
    }

    fn own_watchers_path(&self, volume_id: &str) -> PathBuf {
        self.index_path(volume_id).with_extension("watchers")
    }

    /// The watcher addresses this node's mappers had on the image, kept
    /// across unstaging so a dead mapper's lingering watch is recognised.
    fn own_watchers(&self, volume_id: &str) -> Vec<String> {
        std::fs::read_to_string(self.own_watchers_path(volume_id))
            .map(|t| t.lines().map(str::to_owned).collect())
            .unwrap_or_default()
    }

    fn record_own_watchers(&self, volume_id: &str, watchers: &[String]) {
        let p = self.own_watchers_path(volume_id);
        if let Err(e) = write_atomic(&p, watchers.join("\n").as_bytes()) {
            tracing::warn!(path = %p.display(), error = %e, "cannot record own watchers");
        }
    }

    /// The addresses watching the image of `vol`.
    async fn watchers(
        &self,
        vol: &crate::volume::VolumeId,
        secrets: &HashMap<String, String>,
    ) -> Result<Vec<String>, Status> {
        let conn = self.driver.connect(&vol.cluster_id, secrets).await?;
        let v = vol.clone();
        self.driver
            .ceph(&conn, move |c, _m| {
                let io = c.ioctx_ns(&v.pool, &v.rados_namespace)?;
                let img = Image::open_read_only(&io, &v.image)?;
                Ok(img.watchers()?.into_iter().map(|w| w.addr).collect())
            })
            .await
            .map_err(|e| match e {
                VolumeError::Ceph(e) => status_of(&e),
                other => Status::internal(other.to_string()),
            })
    }

    fn forget(&self, volume_id: &str) {
        let _ = std::fs::remove_file(self.index_path(volume_id));
    }

    /// The staging path of a volume: the request's, or the one recorded at
    /// staging.
    fn staging_of(&self, volume_id: &str, given: &str) -> Option<PathBuf> {
        if !given.is_empty() {
            return Some(PathBuf::from(given));
        }
        std::fs::read_to_string(self.index_path(volume_id))
            .ok()
            .map(PathBuf::from)
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> crate::Result<T> + Send + 'static,
) -> Result<T, Status> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(status_of(&e)),
        Err(e) => Err(Status::internal(format!("node task failed: {e}"))),
    }
}

fn is_block(cap: &VolumeCapability) -> bool {
    matches!(
        cap.access_type,
        Some(volume_capability::AccessType::Block(_))
    )
}

fn is_read_only(cap: &VolumeCapability) -> bool {
    use volume_capability::access_mode::Mode;
    matches!(
        cap.access_mode
            .as_ref()
            .and_then(|m| Mode::try_from(m.mode).ok()),
        Some(Mode::SingleNodeReaderOnly) | Some(Mode::MultiNodeReaderOnly)
    )
}

fn mount_of(cap: &VolumeCapability, default_fs: &str) -> (String, Vec<String>) {
    match &cap.access_type {
        Some(volume_capability::AccessType::Mount(m)) => (
            if m.fs_type.is_empty() {
                default_fs.to_owned()
            } else {
                m.fs_type.clone()
            },
            m.mount_flags.clone(),
        ),
        _ => (default_fs.to_owned(), Vec::new()),
    }
}

fn is_single_writer(cap: &VolumeCapability) -> bool {
    use volume_capability::access_mode::Mode;
    cap.access_mode.as_ref().map(|m| m.mode) == Some(Mode::SingleNodeSingleWriter as i32)
}

/// Makes sure a regular file exists at `path` (a bind-mount target for a
/// block device).
fn ensure_file(path: &Path) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
    {
        Ok(_) => Ok(()),
        // Already a bind-mounted device, or a directory left by a Filesystem
        // attempt: let the mount step report it.
        Err(_) if path.exists() => Ok(()),
        Err(e) => Err(e),
    }
}

/// This mapper's options from a `mapOptions`/`unmapOptions` context entry.
fn mapper_options(
    ctx: &std::collections::BTreeMap<String, String>,
    param: &'static str,
    mapper: &str,
) -> Result<Vec<String>, Status> {
    let kind = match mapper {
        "krbd" => options::MounterKind::Krbd,
        _ => options::MounterKind::Fuse,
    };
    options::options_for(
        ctx.get(param).map(String::as_str).unwrap_or(""),
        kind,
        param,
    )
    .map_err(|e| status_of(&e))
}

/// Unmounts everything at `target` and removes it (a directory, or the
/// file a block device was bound onto). Nothing there is fine.
async fn unmount_and_remove(target: &Path) -> Result<(), Status> {
    let t = target.to_owned();
    blocking(move || mount::ensure_unmounted(&t)).await?;
    if target.is_dir() {
        std::fs::remove_dir(target).map_err(|e| io_status("remove", target, e))?;
    } else if target.exists() {
        std::fs::remove_file(target).map_err(|e| io_status("remove", target, e))?;
    }
    Ok(())
}

fn io_status(what: &str, path: &Path, e: std::io::Error) -> Status {
    Status::internal(format!("cannot {what} {}: {e}", path.display()))
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        req: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let staging = PathBuf::from(required("staging_target_path", &req.staging_target_path)?);
        let cap = req
            .volume_capability
            .clone()
            .ok_or_else(|| Status::invalid_argument("volume_capability is missing"))?;
        let vol = volume_id(&id)?;
        let _busy = self.driver.begin(&id)?;
        let block = is_block(&cap);
        let read_only = is_read_only(&cap);
        let target = staging.join(VOLUME);
        let ctx: std::collections::BTreeMap<String, String> =
            req.volume_context.clone().into_iter().collect();
        let node_params =
            NodeParams::from_context(&ctx).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let mapper_name = node_params
            .mounter
            .clone()
            .unwrap_or_else(|| self.default_mapper.clone());
        let mut candidates = vec![self.mapper(&mapper_name)?];
        if node_params.try_other_mounters {
            candidates.extend(
                self.mappers
                    .iter()
                    .filter(|m| m.name() != mapper_name)
                    .cloned(),
            );
        }

        // Done already (a repeat after success, or kubelet retrying)?
        if let Some(stash) = Stash::read(&staging)? {
            let t = target.clone();
            if stash.device.is_some() && blocking(move || mount::is_mount_point(&t)).await? {
                return Ok(Response::new(NodeStageVolumeResponse {}));
            }
        }
        if !staging.is_dir() {
            return Err(Status::not_found(format!(
                "staging_target_path {} does not exist",
                staging.display()
            )));
        }

        let creds = credentials(&req.secrets)?.ok_or_else(|| {
            Status::invalid_argument(
                "NodeStageVolume carries no secrets: the StorageClass must name a node-stage Secret with userID and userKey",
            )
        })?;
        let info = self.driver.cluster(&vol.cluster_id)?;

        // Single writer: a read-write stage needs the image unused, unless
        // this node's mapper is the one holding it (a repeat).
        let mut already_mapped = None;
        for m in &candidates {
            let m2 = Arc::clone(m);
            let id2 = id.clone();
            if let Some(dev) = blocking(move || m2.find(&id2)).await? {
                already_mapped = Some((Arc::clone(m), dev));
                break;
            }
        }
        if !read_only && already_mapped.is_none() {
            let watchers = self.watchers(&vol, &req.secrets).await?;
            // A mapper of this node that died leaves its watch behind until
            // the OSD times it out; that one is ours, not another writer.
            let own = self.own_watchers(&id);
            let foreign: Vec<String> = watchers.into_iter().filter(|w| !own.contains(w)).collect();
            if !foreign.is_empty() {
                return Err(Status::failed_precondition(format!(
                    "image {vol} is already in use read-write by {} (another node has it staged); it can be staged read-write on one node only",
                    foreign.join(", ")
                )));
            }
        }

        let mut stash = Stash {
            volume_id: id.clone(),
            mapper: mapper_name.clone(),
            device: None,
            fs_type: (!block).then(|| mount_of(&cap, &self.default_fs).0),
            read_only,
            unmap_options: Vec::new(),
            published: Vec::new(),
        };
        let (mapper, device) = match already_mapped {
            Some(found) => found,
            None => {
                let mut last_err = None;
                let mut mapped = None;
                for m in candidates {
                    stash.mapper = m.name().to_owned();
                    stash.unmap_options = mapper_options(&ctx, UNMAP_OPTIONS, m.name())?;
                    stash.write(&staging)?;
                    let spec = MapSpec {
                        volume_id: id.clone(),
                        monitors: info.monitors.clone(),
                        user: creds.user.clone(),
                        key: creds.key.clone(),
                        pool: vol.pool.clone(),
                        namespace: vol.rados_namespace.clone(),
                        image: vol.image.clone(),
                        snapshot: None,
                        read_only,
                        options: mapper_options(&ctx, MAP_OPTIONS, m.name())?,
                    };
                    let m2 = Arc::clone(&m);
                    match blocking(move || m2.map(&spec)).await {
                        Ok(dev) => {
                            mapped = Some((m, dev));
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(volume = %vol, mapper = m.name(), error = %e.message(), "map failed");
                            last_err = Some(e);
                        }
                    }
                }
                match mapped {
                    Some(x) => x,
                    None => {
                        return Err(last_err
                            .unwrap_or_else(|| Status::internal("no mapper could map the image")))
                    }
                }
            }
        };
        stash.mapper = mapper.name().to_owned();
        stash.device = Some(device.clone());
        stash.write(&staging)?;
        self.remember(&id, &staging)?;
        if !read_only {
            // Every watcher now is this node's mapper (or a dead one of it).
            let now = self.watchers(&vol, &req.secrets).await?;
            self.record_own_watchers(&id, &now);
        }

        if block {
            ensure_file(&target).map_err(|e| io_status("create", &target, e))?;
            let (d, t) = (device.clone(), target.clone());
            blocking(move || mount::ensure_bind(&d, &t, read_only)).await?;
        } else {
            let (fs_type, flags) = mount_of(&cap, &self.default_fs);
            let mkfs = ctx
                .get(crate::volume::params::MKFS_OPTIONS)
                .map(|s| fs::parse_mkfs_options(s))
                .unwrap_or_default();
            std::fs::create_dir_all(&target).map_err(|e| io_status("create", &target, e))?;
            let (d, t) = (device.clone(), target.clone());
            blocking(move || {
                if read_only && !mount::is_mount_point(&t)? && fs::probe(&d)? == fs::Probe::Blank {
                    return Err(Error::invalid(
                        "NodeStageVolume",
                        d.display().to_string(),
                        "the volume is blank and staged read-only: it cannot be formatted",
                    ));
                }
                let mut opts = flags;
                if read_only {
                    opts.push("ro".to_owned());
                }
                fs::format_and_mount(&d, &t, &fs_type, &mkfs, &opts)
            })
            .await?;
        }
        tracing::info!(volume = %vol, device = %device.display(), staging = %staging.display(), "NodeStageVolume done");
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        req: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let staging = PathBuf::from(required("staging_target_path", &req.staging_target_path)?);
        let _busy = self.driver.begin(&id)?;
        let target = staging.join(VOLUME);
        let stash = Stash::read(&staging)?;
        unmount_and_remove(&target).await?;
        let targets: Vec<(Arc<dyn Mapper>, Vec<String>)> = match &stash {
            Some(s) => vec![(self.mapper(&s.mapper)?, s.unmap_options.clone())],
            None => self
                .mappers
                .iter()
                .map(|m| (Arc::clone(m), Vec::new()))
                .collect(),
        };
        for (m, opts) in targets {
            let id2 = id.clone();
            blocking(move || m.unmap(&id2, &opts)).await?;
        }
        let p = Stash::path(&staging);
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_status("remove", &p, e)),
        }
        self.forget(&id);
        tracing::info!(volume = %id, staging = %staging.display(), "NodeUnstageVolume done");
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        req: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let staging = PathBuf::from(required("staging_target_path", &req.staging_target_path)?);
        let target = PathBuf::from(required("target_path", &req.target_path)?);
        let cap = req
            .volume_capability
            .clone()
            .ok_or_else(|| Status::invalid_argument("volume_capability is missing"))?;
        volume_id(&id)?;
        let _busy = self.driver.begin(&id)?;
        let source = staging.join(VOLUME);
        let s = source.clone();
        if !blocking(move || mount::is_mount_point(&s)).await? {
            return Err(Status::failed_precondition(format!(
                "volume {id} is not staged at {}",
                staging.display()
            )));
        }
        let read_only = req.readonly || is_read_only(&cap);
        let mut stash = Stash::read(&staging)?;
        if let Some(st) = &stash {
            if is_single_writer(&cap) {
                let mut others = Vec::new();
                for t in st.published.iter().filter(|t| **t != target) {
                    let t2 = t.clone();
                    if blocking(move || mount::is_mount_point(&t2)).await? {
                        others.push(t.display().to_string());
                    }
                }
                if !others.is_empty() {
                    return Err(Status::failed_precondition(format!(
                        "volume {id} is single-writer and already published at {}",
                        others.join(", ")
                    )));
                }
            }
        }
        if is_block(&cap) {
            ensure_file(&target).map_err(|e| io_status("create", &target, e))?;
        } else {
            std::fs::create_dir_all(&target).map_err(|e| io_status("create", &target, e))?;
        }
        let t = target.clone();
        blocking(move || mount::ensure_bind(&source, &t, read_only)).await?;
        if let Some(st) = stash.as_mut() {
            if !st.published.contains(&target) {
                st.published.push(target.clone());
                st.write(&staging)?;
            }
        }
        tracing::info!(volume = %id, target = %target.display(), read_only, "NodePublishVolume done");
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let target = PathBuf::from(required("target_path", &req.target_path)?);
        let _busy = self.driver.begin(&id)?;
        unmount_and_remove(&target).await?;
        if let Some(staging) = self.staging_of(&id, "") {
            if let Ok(Some(mut st)) = Stash::read(&staging) {
                if st.published.contains(&target) {
                    st.published.retain(|t| *t != target);
                    st.write(&staging)?;
                }
            }
        }
        tracing::info!(volume = %id, target = %target.display(), "NodeUnpublishVolume done");
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        req: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let path = PathBuf::from(required("volume_path", &req.volume_path)?);
        let meta = match std::fs::metadata(&path) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Status::not_found(format!(
                    "volume_path {} does not exist",
                    path.display()
                )))
            }
            // A dead backend (ENOTCONN, EIO): report it as a condition.
            Err(_) => None,
        };
        let stash = self
            .staging_of(&id, &req.staging_target_path)
            .and_then(|s| Stash::read(&s).ok().flatten());
        let mut abnormal: Option<String> = None;
        if let Some(s) = &stash {
            if let (Ok(m), Some(dev)) = (self.mapper(&s.mapper), s.device.clone()) {
                let id2 = id.clone();
                match tokio::task::spawn_blocking(move || m.check(&id2, &dev)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(why)) => abnormal = Some(why),
                    Err(e) => abnormal = Some(format!("health check failed: {e}")),
                }
            }
        }
        let mut usage = Vec::new();
        match meta {
            Some(m) if m.file_type().is_block_device() => {
                let p = path.clone();
                match blocking(move || fs::device_size(&p)).await {
                    Ok(size) => usage.push(VolumeUsage {
                        available: 0,
                        total: size as i64,
                        used: 0,
                        unit: volume_usage::Unit::Bytes as i32,
                    }),
                    Err(e) => {
                        abnormal.get_or_insert(format!("device unreadable: {}", e.message()));
                    }
                }
            }
            Some(_) => {
                let p = path.clone();
                match blocking(move || fs::stats(&p)).await {
                    Ok(st) => {
                        usage.push(VolumeUsage {
                            available: st.available_bytes as i64,
                            total: st.total_bytes as i64,
                            used: st.used_bytes as i64,
                            unit: volume_usage::Unit::Bytes as i32,
                        });
                        usage.push(VolumeUsage {
                            available: st.free_inodes as i64,
                            total: st.total_inodes as i64,
                            used: st.used_inodes as i64,
                            unit: volume_usage::Unit::Inodes as i32,
                        });
                    }
                    Err(e) => {
                        abnormal.get_or_insert(format!("filesystem unreadable: {}", e.message()));
                    }
                }
            }
            None => {
                abnormal.get_or_insert(format!(
                    "volume_path {} cannot be read (its backend may have died)",
                    path.display()
                ));
            }
        }
        Ok(Response::new(NodeGetVolumeStatsResponse {
            usage,
            volume_condition: Some(VolumeCondition {
                abnormal: abnormal.is_some(),
                message: abnormal.unwrap_or_else(|| "volume is healthy".to_owned()),
            }),
        }))
    }

    async fn node_expand_volume(
        &self,
        req: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = required("volume_id", &req.volume_id)?.to_owned();
        let path = PathBuf::from(required("volume_path", &req.volume_path)?);
        if !path.exists() {
            return Err(Status::not_found(format!(
                "volume_path {} does not exist",
                path.display()
            )));
        }
        let _busy = self.driver.begin(&id)?;
        let staging = self
            .staging_of(&id, &req.staging_target_path)
            .ok_or_else(|| Status::not_found(format!("volume {id} is not staged on this node")))?;
        let stash = Stash::read(&staging)?
            .ok_or_else(|| Status::not_found(format!("volume {id} is not staged on this node")))?;
        let device = stash
            .device
            .clone()
            .ok_or_else(|| Status::failed_precondition(format!("volume {id} is not mapped")))?;
        let mapper = self.mapper(&stash.mapper)?;
        let id2 = id.clone();
        let size = blocking(move || mapper.refresh_size(&id2)).await?;
        if let Some(fs_type) = stash.fs_type.clone() {
            let mnt = staging.join(VOLUME);
            blocking(move || fs::grow(&device, &mnt, &fs_type)).await?;
        }
        tracing::info!(volume = %id, bytes = size, "NodeExpandVolume done");
        Ok(Response::new(NodeExpandVolumeResponse {
            capacity_bytes: size as i64,
        }))
    }

    async fn node_get_capabilities(
        &self,
        _req: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        use node_service_capability::rpc::Type as T;
        let capabilities = [
            T::StageUnstageVolume,
            T::ExpandVolume,
            T::GetVolumeStats,
            T::VolumeCondition,
            T::SingleNodeMultiWriter,
        ]
        .into_iter()
        .map(|t| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(
                node_service_capability::Rpc { r#type: t as i32 },
            )),
        })
        .collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _req: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        // Always set: the plugin offers VOLUME_ACCESSIBILITY_CONSTRAINTS,
        // and images are reachable from every node unless flags say more.
        let topology = Some(Topology {
            segments: self
                .driver
                .topology
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<HashMap<_, _>>(),
        });
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.driver.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: topology,
        }))
    }
}
