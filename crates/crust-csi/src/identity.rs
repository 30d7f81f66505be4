//! CSI Identity service.

use std::collections::HashMap;
use std::sync::Arc;

use crust_proto::csi::v1 as csi;
use csi::identity_server::Identity;
use tonic::{Request, Response, Status};

use crate::driver::{Driver, IdentityParts, blocking};
use crate::error::IdentityError;

impl IdentityParts<'_> {
    pub fn plugin_info(&self) -> csi::GetPluginInfoResponse {
        let manifest = HashMap::from([
            ("backend".to_string(), self.backend.kind().to_string()),
            ("node".to_string(), self.cfg.node_id.clone()),
            ("topology-key".to_string(), self.cfg.topology_key()),
            (
                "deferral".to_string(),
                if self.cfg.deferral.enabled {
                    "enabled"
                } else {
                    "disabled"
                }
                .to_string(),
            ),
        ]);
        csi::GetPluginInfoResponse {
            name: self.cfg.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest,
        }
    }

    /// Ready only when every volume operation could run: the backend
    /// works (pool directory writable, loop control openable, static
    /// devices present...), the volume records can be written, and the
    /// filesystem tools are installed. A liveness probe built on this
    /// restarts a plugin whose host mounts went away or read-only.
    pub fn probe(&self) -> Result<csi::ProbeResponse, IdentityError> {
        self.backend
            .probe()
            .map_err(|e| IdentityError::NotReady(e.to_string()))?;
        let records = &self.cfg.state_dir;
        rustix::fs::access(records, rustix::fs::Access::WRITE_OK).map_err(|e| {
            IdentityError::NotReady(format!(
                "state directory {} is not writable: {e}",
                records.display()
            ))
        })?;
        let missing = crust_blockdev::missing_fs_tools();
        if !missing.is_empty() {
            return Err(IdentityError::NotReady(format!(
                "filesystem tools not installed: {}",
                missing.join(", ")
            )));
        }
        Ok(csi::ProbeResponse { ready: Some(true) })
    }
}

/// The tonic Identity service.
#[derive(Clone)]
pub struct IdentityService {
    driver: Arc<Driver>,
}

impl IdentityService {
    pub fn new(driver: Arc<Driver>) -> Self {
        IdentityService { driver }
    }
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _request: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(self.driver.identity().plugin_info()))
    }

    async fn get_plugin_capabilities(
        &self,
        _request: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities: crate::surface::plugin_capabilities(
                self.driver.config().csi_spec,
                self.driver.supports_snapshots(),
            ),
        }))
    }

    async fn probe(
        &self,
        _request: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        let resp = blocking(&self.driver, |d| d.identity().probe()).await?;
        Ok(Response::new(resp))
    }
}
