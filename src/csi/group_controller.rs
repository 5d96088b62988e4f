//! The CSI GroupController service: volume group snapshots
//! (CreateVolumeGroupSnapshot, DeleteVolumeGroupSnapshot,
//! GetVolumeGroupSnapshot) through [`crate::volume::group_snapshot`].
//!
//! A member's `snapshot_id` is an ordinary snapshot handle, so CreateVolume
//! restores one member as it restores any snapshot.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::csi::controller::{class_params, csi_snapshot, timestamp};
use crate::csi::driver::{required, volume_status, Driver, InFlight};
use crate::csi::proto::{
    group_controller_server::GroupController, group_controller_service_capability,
    CreateVolumeGroupSnapshotRequest, CreateVolumeGroupSnapshotResponse,
    DeleteVolumeGroupSnapshotRequest, DeleteVolumeGroupSnapshotResponse,
    GetVolumeGroupSnapshotRequest, GetVolumeGroupSnapshotResponse,
    GroupControllerGetCapabilitiesRequest, GroupControllerGetCapabilitiesResponse,
    GroupControllerServiceCapability, VolumeGroupSnapshot,
};
use crate::volume::clusters::Conn;
use crate::volume::group_snapshot::{
    self as group, Copies, Ensured, GroupSnapshotInfo, PendingCopies,
};
use crate::volume::ops::VolumeError;
use crate::volume::params::{SnapshotParams, CLUSTER_ID, POOL};
use crate::volume::{GroupSnapshotId, SnapshotId, VolumeId};

/// The GroupController service.
pub struct GroupControllerService {
    driver: Arc<Driver>,
}

impl GroupControllerService {
    /// A group controller over `driver`.
    pub fn new(driver: Arc<Driver>) -> GroupControllerService {
        GroupControllerService { driver }
    }

    /// Starts the members' data copies as a job holding `busy`; returns
    /// the group snapshot as reported until they are done.
    fn copy_in_background(
        &self,
        handle: String,
        busy: InFlight,
        conn: Conn,
        pending: PendingCopies,
    ) -> GroupSnapshotInfo {
        let info = pending.info.clone();
        tracing::info!(group_snapshot = %info.id, bytes = pending.bytes(),
            "group snapshot taken; copying the members librbd cannot clone in the background");
        let observer = Arc::clone(&self.driver.observer);
        self.driver.jobs.start(handle, info.clone(), busy, move || {
            let out = pending.run(conn.cluster(), observer.as_ref());
            if let Err(VolumeError::Ceph(e)) = &out {
                conn.check(e);
            }
            out.map_err(|e| volume_status(&e))
        });
        info
    }
}

fn csi_group(info: &GroupSnapshotInfo) -> VolumeGroupSnapshot {
    let handle = info.id.handle();
    let snapshots: Vec<_> = info
        .members
        .iter()
        .map(|m| {
            let mut s = csi_snapshot(m);
            s.group_snapshot_id = handle.clone();
            s
        })
        .collect();
    VolumeGroupSnapshot {
        group_snapshot_id: handle,
        ready_to_use: info.members.iter().all(|m| m.ready),
        // The members were taken together; the earliest stands for all.
        creation_time: info.members.iter().map(|m| m.created).min().map(timestamp),
        snapshots,
    }
}

/// The member ids a request names (`snapshot_ids`); one this driver cannot
/// have made is no member of anything of ours.
fn member_ids(ids: &[String]) -> Result<Vec<SnapshotId>, Status> {
    ids.iter()
        .map(|id| {
            SnapshotId::parse(id).map_err(|why| {
                Status::invalid_argument(format!("snapshot_ids: {why}; not a member"))
            })
        })
        .collect()
}

#[tonic::async_trait]
impl GroupController for GroupControllerService {
    async fn group_controller_get_capabilities(
        &self,
        _req: Request<GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<GroupControllerGetCapabilitiesResponse>, Status> {
        use group_controller_service_capability::rpc::Type as T;
        Ok(Response::new(GroupControllerGetCapabilitiesResponse {
            capabilities: vec![GroupControllerServiceCapability {
                r#type: Some(group_controller_service_capability::Type::Rpc(
                    group_controller_service_capability::Rpc {
                        r#type: T::CreateDeleteGetVolumeGroupSnapshot as i32,
                    },
                )),
            }],
        }))
    }

    async fn create_volume_group_snapshot(
        &self,
        req: Request<CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<CreateVolumeGroupSnapshotResponse>, Status> {
        let req = req.into_inner();
        let name = required("name", &req.name)?.to_owned();
        if req.source_volume_ids.is_empty() {
            return Err(Status::invalid_argument("source_volume_ids is empty"));
        }
        let mut sources = Vec::new();
        for id in &req.source_volume_ids {
            required("source_volume_ids entry", id)?;
            sources.push(VolumeId::parse(id).map_err(|why| {
                Status::not_found(format!("source_volume_ids: no such volume: {why}"))
            })?);
        }
        let gid = group::place_of(&sources, &name).map_err(Status::invalid_argument)?;
        let (_, params) = class_params(
            &req.parameters,
            "VolumeGroupSnapshotClass",
            SnapshotParams::parse,
        )?;
        for (key, want, have) in [
            (CLUSTER_ID, &params.cluster_id, &gid.cluster_id),
            (POOL, &params.pool, &gid.pool),
        ] {
            if want.as_ref().is_some_and(|w| w != have) {
                return Err(Status::invalid_argument(format!(
                    "the source volumes are not in the {key} {:?} the group snapshot class names; snapshots stay in their sources' pool",
                    want.as_deref().unwrap_or_default()
                )));
            }
        }
        let handle = gid.handle();
        // A retry while the members are copied: answered from the job.
        if let Some(state) = self.driver.jobs.take(&handle) {
            let info = state?;
            return Ok(Response::new(CreateVolumeGroupSnapshotResponse {
                group_snapshot: Some(csi_group(&info)),
            }));
        }
        let busy = self.driver.begin(&handle)?;
        let conn = self.driver.connect(&gid.cluster_id, &req.secrets).await?;
        let provisioner = self.driver.name.clone();
        let ensured = self
            .driver
            .ceph_holding(&busy, &conn, move |c, m| {
                group::ensure_group_snapshot(c, m, &sources, &name, &provisioner, Copies::Defer)
            })
            .await
            .map_err(|e| volume_status(&e))?;
        let info = match ensured {
            Ensured::Ready(info) => info,
            Ensured::Copying(pending) => self.copy_in_background(handle, busy, conn, pending),
        };
        tracing::info!(group_snapshot = %info.id, members = info.members.len(),
            ready = info.members.iter().all(|m| m.ready), "CreateVolumeGroupSnapshot done");
        Ok(Response::new(CreateVolumeGroupSnapshotResponse {
            group_snapshot: Some(csi_group(&info)),
        }))
    }

    async fn delete_volume_group_snapshot(
        &self,
        req: Request<DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<DeleteVolumeGroupSnapshotResponse>, Status> {
        let req = req.into_inner();
        let id = required("group_snapshot_id", &req.group_snapshot_id)?;
        // An id this driver cannot have made names nothing: done.
        let Ok(gid) = GroupSnapshotId::parse(id) else {
            return Ok(Response::new(DeleteVolumeGroupSnapshotResponse {}));
        };
        if self.driver.clusters.get(&gid.cluster_id).is_none() {
            return Ok(Response::new(DeleteVolumeGroupSnapshotResponse {}));
        }
        let expected = member_ids(&req.snapshot_ids)?;
        let busy = self.driver.begin(id)?;
        let conn = self.driver.connect(&gid.cluster_id, &req.secrets).await?;
        let (g, provisioner) = (gid.clone(), self.driver.name.clone());
        let outcome = self
            .driver
            .ceph_holding(&busy, &conn, move |c, m| {
                group::delete_group_snapshot(c, m, &g, &expected, &provisioner)
            })
            .await;
        match outcome {
            Ok(()) => {}
            // The pool itself is gone: so is the group snapshot.
            Err(VolumeError::Ceph(e)) if e.is_not_found() => {}
            Err(e) => return Err(volume_status(&e)),
        }
        tracing::info!(group_snapshot = %gid, "DeleteVolumeGroupSnapshot done");
        Ok(Response::new(DeleteVolumeGroupSnapshotResponse {}))
    }

    async fn get_volume_group_snapshot(
        &self,
        req: Request<GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<GetVolumeGroupSnapshotResponse>, Status> {
        let req = req.into_inner();
        let id = required("group_snapshot_id", &req.group_snapshot_id)?;
        let gid = GroupSnapshotId::parse(id)
            .map_err(|why| Status::not_found(format!("no such group snapshot: {why}")))?;
        if self.driver.clusters.get(&gid.cluster_id).is_none() {
            return Err(Status::not_found(format!(
                "no such group snapshot: cluster {:?} is not in the clusters config",
                gid.cluster_id
            )));
        }
        let expected = member_ids(&req.snapshot_ids)?;
        if let Some(info) = self.driver.jobs.running(&gid.handle()) {
            return Ok(Response::new(GetVolumeGroupSnapshotResponse {
                group_snapshot: Some(csi_group(&info)),
            }));
        }
        let conn = self.driver.connect(&gid.cluster_id, &req.secrets).await?;
        let (g, provisioner) = (gid.clone(), self.driver.name.clone());
        let found = self
            .driver
            .ceph(&conn, move |c, m| {
                group::get_group_snapshot(c, m, &g, &expected, &provisioner)
            })
            .await;
        match found {
            Ok(Some(info)) => Ok(Response::new(GetVolumeGroupSnapshotResponse {
                group_snapshot: Some(csi_group(&info)),
            })),
            Ok(None) => Err(Status::not_found(format!("no such group snapshot: {gid}"))),
            Err(VolumeError::Ceph(e)) if e.is_not_found() => {
                Err(Status::not_found(format!("no such group snapshot: {gid}")))
            }
            Err(e) => Err(volume_status(&e)),
        }
    }
}
