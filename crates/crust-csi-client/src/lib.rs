//! crust-csi-client: a CSI client for crust's tools and tests.
//!
//! [`Csi`]: the Identity, Controller and Node clients of one CSI endpoint
//! over a single channel, with a deadline on every call.

use std::future::Future;
use std::time::Duration;

use crust_proto::csi::v1 as csi;
use crust_proto::endpoint::{Endpoint, EndpointError};
use csi::controller_client::ControllerClient;
use csi::group_controller_client::GroupControllerClient;
use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// Default per-call deadline (what kubelet and the sidecars use too).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

const HEADER_MARGIN: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error("cannot connect to {endpoint}: timed out after {timeout:?}")]
    Timeout { endpoint: String, timeout: Duration },
}

/// A connected CSI endpoint. Cloning is cheap (the channel is shared).
#[derive(Clone)]
pub struct Csi {
    identity: IdentityClient<Channel>,
    controller: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    group: GroupControllerClient<Channel>,
    timeout: Duration,
}

macro_rules! rpcs {
    ($($client:ident . $method:ident ( $req:ident ) -> $resp:ident;)*) => {
        $(
            #[doc = concat!("`", stringify!($method), "` with the per-call deadline.")]
            pub async fn $method(&self, req: csi::$req) -> Result<csi::$resp, Status> {
                let mut c = self.$client.clone();
                self.call(req, move |r| async move { c.$method(r).await }).await
            }
        )*
    };
}

impl Csi {
    /// Connects to `endpoint` (bounded by `timeout`).
    pub async fn connect(endpoint: &Endpoint, timeout: Duration) -> Result<Csi, ConnectError> {
        let channel = tokio::time::timeout(timeout, endpoint.connect())
            .await
            .map_err(|_| ConnectError::Timeout {
                endpoint: endpoint.to_string(),
                timeout,
            })??;
        Ok(Csi::from_channel(channel, timeout))
    }

    /// Wraps an existing channel.
    pub fn from_channel(channel: Channel, timeout: Duration) -> Csi {
        Csi {
            identity: IdentityClient::new(channel.clone()),
            controller: ControllerClient::new(channel.clone()),
            node: NodeClient::new(channel.clone()),
            group: GroupControllerClient::new(channel),
            timeout,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A copy using another per-call deadline.
    pub fn with_timeout(&self, timeout: Duration) -> Csi {
        Csi {
            timeout,
            ..self.clone()
        }
    }

    /// The raw tonic clients, for calls this wrapper does not cover.
    pub fn identity_client(&self) -> IdentityClient<Channel> {
        self.identity.clone()
    }
    pub fn controller_client(&self) -> ControllerClient<Channel> {
        self.controller.clone()
    }
    pub fn node_client(&self) -> NodeClient<Channel> {
        self.node.clone()
    }

    /// Enforces the deadline locally (DEADLINE_EXCEEDED) and sends it to the
    /// server as grpc-timeout so it can stop working on the call. The header
    /// gets a small margin: tonic's own timer on the header would otherwise
    /// race ours and report a vague CANCELLED instead.
    async fn call<Req, Resp, F, Fut>(&self, req: Req, f: F) -> Result<Resp, Status>
    where
        F: FnOnce(Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let mut r = Request::new(req);
        r.set_timeout(self.timeout + HEADER_MARGIN);
        match tokio::time::timeout(self.timeout, f(r)).await {
            Ok(res) => res.map(Response::into_inner),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "no answer within {:?}",
                self.timeout
            ))),
        }
    }

    rpcs! {
        identity.get_plugin_info(GetPluginInfoRequest) -> GetPluginInfoResponse;
        identity.get_plugin_capabilities(GetPluginCapabilitiesRequest) -> GetPluginCapabilitiesResponse;
        identity.probe(ProbeRequest) -> ProbeResponse;

        controller.create_volume(CreateVolumeRequest) -> CreateVolumeResponse;
        controller.delete_volume(DeleteVolumeRequest) -> DeleteVolumeResponse;
        controller.controller_publish_volume(ControllerPublishVolumeRequest) -> ControllerPublishVolumeResponse;
        controller.controller_unpublish_volume(ControllerUnpublishVolumeRequest) -> ControllerUnpublishVolumeResponse;
        controller.validate_volume_capabilities(ValidateVolumeCapabilitiesRequest) -> ValidateVolumeCapabilitiesResponse;
        controller.list_volumes(ListVolumesRequest) -> ListVolumesResponse;
        controller.get_capacity(GetCapacityRequest) -> GetCapacityResponse;
        controller.controller_get_capabilities(ControllerGetCapabilitiesRequest) -> ControllerGetCapabilitiesResponse;
        controller.create_snapshot(CreateSnapshotRequest) -> CreateSnapshotResponse;
        controller.delete_snapshot(DeleteSnapshotRequest) -> DeleteSnapshotResponse;
        controller.list_snapshots(ListSnapshotsRequest) -> ListSnapshotsResponse;
        controller.get_snapshot(GetSnapshotRequest) -> GetSnapshotResponse;
        controller.controller_expand_volume(ControllerExpandVolumeRequest) -> ControllerExpandVolumeResponse;
        controller.controller_get_volume(ControllerGetVolumeRequest) -> ControllerGetVolumeResponse;
        controller.controller_modify_volume(ControllerModifyVolumeRequest) -> ControllerModifyVolumeResponse;
        controller.controller_get_volume_health(ControllerGetVolumeHealthRequest) -> ControllerGetVolumeHealthResponse;
        controller.controller_list_volume_health(ControllerListVolumeHealthRequest) -> ControllerListVolumeHealthResponse;

        node.node_stage_volume(NodeStageVolumeRequest) -> NodeStageVolumeResponse;
        node.node_unstage_volume(NodeUnstageVolumeRequest) -> NodeUnstageVolumeResponse;
        node.node_publish_volume(NodePublishVolumeRequest) -> NodePublishVolumeResponse;
        node.node_unpublish_volume(NodeUnpublishVolumeRequest) -> NodeUnpublishVolumeResponse;
        node.node_get_volume_stats(NodeGetVolumeStatsRequest) -> NodeGetVolumeStatsResponse;
        node.node_expand_volume(NodeExpandVolumeRequest) -> NodeExpandVolumeResponse;
        node.node_get_capabilities(NodeGetCapabilitiesRequest) -> NodeGetCapabilitiesResponse;
        node.node_get_info(NodeGetInfoRequest) -> NodeGetInfoResponse;

        group.group_controller_get_capabilities(GroupControllerGetCapabilitiesRequest) -> GroupControllerGetCapabilitiesResponse;
        group.create_volume_group_snapshot(CreateVolumeGroupSnapshotRequest) -> CreateVolumeGroupSnapshotResponse;
        group.delete_volume_group_snapshot(DeleteVolumeGroupSnapshotRequest) -> DeleteVolumeGroupSnapshotResponse;
        group.get_volume_group_snapshot(GetVolumeGroupSnapshotRequest) -> GetVolumeGroupSnapshotResponse;
        node.node_get_volume_health(NodeGetVolumeHealthRequest) -> NodeGetVolumeHealthResponse;
        node.node_get_storage_health(NodeGetStorageHealthRequest) -> NodeGetStorageHealthResponse;
    }

    /// Every page of `ListVolumes`, following `next_token` until it is empty.
    /// A server that hands back a token it already gave is an error, not a
    /// loop.
    pub async fn list_all_volumes(
        &self,
        max_entries: i32,
        starting_token: String,
    ) -> Result<csi::ListVolumesResponse, Status> {
        let mut all = csi::ListVolumesResponse::default();
        let mut token = starting_token;
        let mut seen = std::collections::HashSet::new();
        loop {
            let page = self
                .list_volumes(csi::ListVolumesRequest {
                    max_entries,
                    starting_token: token.clone(),
                })
                .await?;
            all.entries.extend(page.entries);
            if page.next_token.is_empty() {
                return Ok(all);
            }
            if !seen.insert(page.next_token.clone()) {
                return Err(Status::internal(format!(
                    "ListVolumes returned next_token {:?} twice",
                    page.next_token
                )));
            }
            token = page.next_token;
        }
    }

    /// Every page of `ControllerListVolumeHealth`.
    pub async fn list_all_volume_health(
        &self,
        mut req: csi::ControllerListVolumeHealthRequest,
    ) -> Result<csi::ControllerListVolumeHealthResponse, Status> {
        let mut all = csi::ControllerListVolumeHealthResponse::default();
        let mut seen = std::collections::HashSet::new();
        loop {
            let page = self.controller_list_volume_health(req.clone()).await?;
            all.entries.extend(page.entries);
            if page.next_token.is_empty() {
                return Ok(all);
            }
            if !seen.insert(page.next_token.clone()) {
                return Err(Status::internal(format!(
                    "ControllerListVolumeHealth returned next_token {:?} twice",
                    page.next_token
                )));
            }
            req.starting_token = page.next_token;
        }
    }

    /// Every page of `ListSnapshots`.
    pub async fn list_all_snapshots(
        &self,
        mut req: csi::ListSnapshotsRequest,
    ) -> Result<csi::ListSnapshotsResponse, Status> {
        let mut all = csi::ListSnapshotsResponse::default();
        let mut seen = std::collections::HashSet::new();
        loop {
            let page = self.list_snapshots(req.clone()).await?;
            all.entries.extend(page.entries);
            if page.next_token.is_empty() {
                return Ok(all);
            }
            if !seen.insert(page.next_token.clone()) {
                return Err(Status::internal(format!(
                    "ListSnapshots returned next_token {:?} twice",
                    page.next_token
                )));
            }
            req.starting_token = page.next_token;
        }
    }
}
