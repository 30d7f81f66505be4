//! The CSI GroupController service: volume group snapshots (see
//! [`crate::snapshot`] for how members are cut consistently together).

use std::sync::Arc;

use crust_proto::csi::v1 as csi;
use csi::group_controller_server::GroupController;
use tonic::{Request, Response, Status};

use crate::driver::{Driver, blocking};

/// The tonic GroupController service.
#[derive(Clone)]
pub struct GroupControllerService {
    driver: Arc<Driver>,
}

impl GroupControllerService {
    pub fn new(driver: Arc<Driver>) -> Self {
        GroupControllerService { driver }
    }
}

#[tonic::async_trait]
impl GroupController for GroupControllerService {
    async fn group_controller_get_capabilities(
        &self,
        _request: Request<csi::GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::GroupControllerGetCapabilitiesResponse>, Status> {
        Ok(Response::new(csi::GroupControllerGetCapabilitiesResponse {
            capabilities: crate::surface::group_controller_capabilities(
                self.driver.supports_snapshots(),
            ),
        }))
    }

    async fn create_volume_group_snapshot(
        &self,
        request: Request<csi::CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::CreateVolumeGroupSnapshotResponse>, Status> {
        let req = request.into_inner();
        let group = blocking(&self.driver, move |d| {
            d.snapshots().create_volume_group_snapshot(&req)
        })
        .await?;
        Ok(Response::new(csi::CreateVolumeGroupSnapshotResponse {
            group_snapshot: Some(group),
        }))
    }

    async fn delete_volume_group_snapshot(
        &self,
        request: Request<csi::DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::DeleteVolumeGroupSnapshotResponse>, Status> {
        let req = request.into_inner();
        blocking(&self.driver, move |d| {
            d.snapshots().delete_volume_group_snapshot(&req)
        })
        .await?;
        Ok(Response::new(csi::DeleteVolumeGroupSnapshotResponse {}))
    }

    async fn get_volume_group_snapshot(
        &self,
        request: Request<csi::GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<csi::GetVolumeGroupSnapshotResponse>, Status> {
        let req = request.into_inner();
        let group = blocking(&self.driver, move |d| {
            d.snapshots().get_volume_group_snapshot(&req)
        })
        .await?;
        Ok(Response::new(csi::GetVolumeGroupSnapshotResponse {
            group_snapshot: Some(group),
        }))
    }
}
