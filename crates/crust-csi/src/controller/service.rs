//! The tonic Controller service: each RPC runs its operation on the
//! blocking pool through the controller's facade (the snapshot RPCs
//! through the snapshot service's).

use std::sync::Arc;

use crust_proto::csi::v1 as csi;
use csi::controller_server::Controller;
use tonic::{Request, Response, Status};

use crate::config::Expansion;
use crate::driver::{Driver, blocking, blocking_typed};
use crate::error::ControllerError;
use crate::peer::Forwarder;
use crate::surface::health_api_off;

/// The tonic Controller service.
#[derive(Clone)]
pub struct ControllerService {
    driver: Arc<Driver>,
    /// Other nodes' plugins, asked about volumes this node does not have.
    peers: Option<Arc<Forwarder>>,
}

impl ControllerService {
    pub fn new(driver: Arc<Driver>) -> Self {
        let peers = Forwarder::of(&driver);
        ControllerService { driver, peers }
    }
}

fn unimplemented(rpc: &str) -> Status {
    Status::unimplemented(format!("{rpc} is not supported by this plugin"))
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<csi::CreateVolumeRequest>,
    ) -> std::result::Result<Response<csi::CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        let volume = blocking(&self.driver, move |d| d.controller().create_volume(&req)).await?;
        Ok(Response::new(csi::CreateVolumeResponse {
            volume: Some(volume),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<csi::DeleteVolumeRequest>,
    ) -> std::result::Result<Response<csi::DeleteVolumeResponse>, Status> {
        let id = request.into_inner().volume_id;
        blocking(&self.driver, move |d| d.controller().delete_volume(&id)).await?;
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        _request: Request<csi::ControllerPublishVolumeRequest>,
    ) -> std::result::Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        Err(unimplemented("ControllerPublishVolume"))
    }

    async fn controller_unpublish_volume(
        &self,
        _request: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> std::result::Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        Err(unimplemented("ControllerUnpublishVolume"))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> std::result::Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| {
            d.controller().validate_volume_capabilities(&req)
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn list_volumes(
        &self,
        request: Request<csi::ListVolumesRequest>,
    ) -> std::result::Result<Response<csi::ListVolumesResponse>, Status> {
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| d.controller().list_volumes(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn get_capacity(
        &self,
        request: Request<csi::GetCapacityRequest>,
    ) -> std::result::Result<Response<csi::GetCapacityResponse>, Status> {
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| d.controller().get_capacity(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn controller_get_capabilities(
        &self,
        _request: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> std::result::Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse {
            capabilities: crate::surface::controller_capabilities(
                self.driver.config().csi_spec,
                self.driver.supports_snapshots(),
                self.driver.config().expansion,
            ),
        }))
    }

    async fn create_snapshot(
        &self,
        request: Request<csi::CreateSnapshotRequest>,
    ) -> std::result::Result<Response<csi::CreateSnapshotResponse>, Status> {
        let req = request.into_inner();
        let snapshot = blocking(&self.driver, move |d| d.snapshots().create_snapshot(&req)).await?;
        Ok(Response::new(csi::CreateSnapshotResponse {
            snapshot: Some(snapshot),
        }))
    }

    async fn delete_snapshot(
        &self,
        request: Request<csi::DeleteSnapshotRequest>,
    ) -> std::result::Result<Response<csi::DeleteSnapshotResponse>, Status> {
        let req = request.into_inner();
        blocking(&self.driver, move |d| d.snapshots().delete_snapshot(&req)).await?;
        Ok(Response::new(csi::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        request: Request<csi::ListSnapshotsRequest>,
    ) -> std::result::Result<Response<csi::ListSnapshotsResponse>, Status> {
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| d.snapshots().list_snapshots(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn get_snapshot(
        &self,
        request: Request<csi::GetSnapshotRequest>,
    ) -> std::result::Result<Response<csi::GetSnapshotResponse>, Status> {
        let req = request.into_inner();
        let snapshot = blocking(&self.driver, move |d| d.snapshots().get_snapshot(&req)).await?;
        Ok(Response::new(csi::GetSnapshotResponse {
            snapshot: Some(snapshot),
        }))
    }

    async fn controller_expand_volume(
        &self,
        request: Request<csi::ControllerExpandVolumeRequest>,
    ) -> std::result::Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        if self.driver.config().expansion == Expansion::Node {
            return Err(Status::unimplemented(
                "ControllerExpandVolume is not offered (--expansion node): NodeExpandVolume grows \
                 the volume on its node",
            ));
        }
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| {
            d.controller().controller_expand_volume(&req)
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn controller_get_volume(
        &self,
        request: Request<csi::ControllerGetVolumeRequest>,
    ) -> std::result::Result<Response<csi::ControllerGetVolumeResponse>, Status> {
        let id = request.into_inner().volume_id;
        let resp = blocking(&self.driver, move |d| {
            d.controller().controller_get_volume(&id)
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn controller_modify_volume(
        &self,
        request: Request<csi::ControllerModifyVolumeRequest>,
    ) -> std::result::Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        let req = request.into_inner();
        let local = req.clone();
        let here = blocking_typed(&self.driver, move |d| {
            d.controller().controller_modify_volume(&local)
        })
        .await?;
        // Not this node's volume: its owner's plugin answers (crate::peer).
        match (here, &self.peers) {
            (Err(ControllerError::NotFound(_)), Some(peers)) => peers.modify_volume(req).await?,
            (here, _) => here?,
        }
        Ok(Response::new(csi::ControllerModifyVolumeResponse {}))
    }

    async fn controller_get_volume_health(
        &self,
        request: Request<csi::ControllerGetVolumeHealthRequest>,
    ) -> std::result::Result<Response<csi::ControllerGetVolumeHealthResponse>, Status> {
        if !self.driver.config().csi_spec.serves_health_api() {
            return Err(health_api_off("ControllerGetVolumeHealth"));
        }
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| {
            d.controller().controller_get_volume_health(&req)
        })
        .await?;
        Ok(Response::new(resp))
    }

    async fn controller_list_volume_health(
        &self,
        request: Request<csi::ControllerListVolumeHealthRequest>,
    ) -> std::result::Result<Response<csi::ControllerListVolumeHealthResponse>, Status> {
        if !self.driver.config().csi_spec.serves_health_api() {
            return Err(health_api_off("ControllerListVolumeHealth"));
        }
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| {
            d.controller().controller_list_volume_health(&req)
        })
        .await?;
        Ok(Response::new(resp))
    }
}
