//! A Kubernetes CRI v1 client: the `runtime.v1` `RuntimeService` and
//! `ImageService` of `k8s.io/cri-api` (vendored as `proto/cri-api.proto`,
//! tag v0.36.3), for driving containerd's CRI plugin the way kubelet does.
//!
//! [`Cri::connect`] opens one channel for both services on a
//! `unix:///path` endpoint (containerd's gRPC socket).

pub mod v1 {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("runtime.v1");
}

use crust_proto::endpoint::{Endpoint, EndpointError};
use tonic::transport::Channel;
use v1::image_service_client::ImageServiceClient;
use v1::runtime_service_client::RuntimeServiceClient;

/// Both CRI services on one channel. Cheap to clone.
#[derive(Clone)]
pub struct Cri {
    pub runtime: RuntimeServiceClient<Channel>,
    pub image: ImageServiceClient<Channel>,
}

impl Cri {
    /// Connects to `endpoint` (`unix:///run/containerd/containerd.sock`).
    pub async fn connect(endpoint: &str) -> Result<Cri, EndpointError> {
        let channel = Endpoint::parse(endpoint)?.connect().await?;
        Ok(Cri {
            runtime: RuntimeServiceClient::new(channel.clone()),
            image: ImageServiceClient::new(channel),
        })
    }
}
