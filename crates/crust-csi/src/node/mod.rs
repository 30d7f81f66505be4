//! CSI Node service.
//!
//! * NodeStageVolume attaches the volume (loop device or static device);
//!   for filesystem access it creates the filesystem only on a blank
//!   device (never reformats: a device holding another filesystem or
//!   unknown data is FAILED_PRECONDITION) and mounts it at the staging
//!   path. The staging path must already exist as a directory (the CO
//!   creates it); if it does not, FAILED_PRECONDITION.
//! * NodePublishVolume bind-mounts the staging mount onto the target
//!   directory (created if missing; its parent must exist), or for raw
//!   block the device node onto a target file (created if missing).
//!   `readonly` is a read-only bind; for raw block, where a read-only bind
//!   does not stop writes to a device node, the device itself is set
//!   read-only (BLKROSET), so read-only and read-write raw publications of
//!   one volume cannot be mixed.
//! * Unpublish/unstage unmount, remove the target (only one the plugin
//!   recorded creating, before it created it), detach: data is never
//!   deleted, and neither is a file or directory a CO or user made.
//! * Path syntax errors are INVALID_ARGUMENT; a path in the wrong state
//!   (missing, a file where a directory is needed, something else mounted
//!   there) is FAILED_PRECONDITION and nothing on the node is changed.
//!
//! KEP-2857: `NodeParts::fs_ops_route` decides whether a request's
//! filesystem operations are deferred to the pod's runtime (`defer_fs_ops`
//! in the request, or `deferFsOps=true` in the volume context); the
//! deferred paths are in `defer.rs`. With `--deferral disabled` a request
//! for deferral fails with FAILED_PRECONDITION instead of silently
//! mounting on the host. A volume staged with `deferFsOps=true` in its
//! volume context is attached and formatted but never mounted on the host.
//! While a sandbox's guest may have the filesystem mounted (a deferred
//! publication, a deferred or unmounted-for-deferral stage, or a sandbox's
//! claim on a hand-off record naming the device), a repeated
//! NodeStageVolume only checks that the device is attached: no probe,
//! e2fsck, resize2fs or mount on the host. Formatting, offline growth and
//! host remounts also refuse (FAILED_PRECONDITION) a device another
//! process has open (QEMU does not open it `O_EXCL`).
//!
//! Layout: this module decides (request checks, the route, the record);
//! [`stage`] stages and unstages, [`publish`] publishes on the host,
//! [`usage`] measures and grows, [`target`] owns the host paths and
//! mounts; deferred publication is in `crate::defer`, the handover to a VM
//! runtime in `crate::handover`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use crust_proto::csi::v1 as csi;
use csi::node_server::Node;
use tonic::{Request, Response, Status};

use crate::caps::{Capability, FsType};
use crate::driver::{Driver, NodeParts, blocking};
use crate::error::{NodeError, RouteError};
use crate::records::DEFER_CONTEXT_KEY;
use crate::records::{Phase, VolumeRecord};

mod publish;
mod stage;
mod target;
mod usage;

pub(crate) use stage::mount_flags_of;
pub(crate) use target::{
    check_parent, mounted_here, publication_of, remove_created_target, sync_and_unmount,
};
pub(crate) use usage::refreshed_device_size;

type Result<T> = std::result::Result<T, NodeError>;

/// How a request's filesystem operations are carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsOps {
    /// The plugin mounts/measures/grows on the host (standard CSI).
    Host,
    /// The pod's runtime mounts the filesystem in its guest; the plugin
    /// hands the device over through crust_ops.
    Deferred,
}

/// A StorageClass's `deferFsOps` (copied into the volume context).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeferMode {
    /// Host mounts; a VM runtime that asks gets the volume by handover
    /// (the default).
    Auto,
    /// Deferred at NodeStage/NodePublish, as KEP-2857 `defer_fs_ops`
    /// (for runtimes that only read hand-off records, e.g. Kata).
    Always,
    /// Host mounts only; never handed over.
    Never,
}

impl DeferMode {
    /// `auto` (or absent), `true`, `false`.
    pub fn parse(v: Option<&str>) -> std::result::Result<DeferMode, String> {
        match v {
            None | Some("auto") => Ok(DeferMode::Auto),
            Some("true") => Ok(DeferMode::Always),
            Some("false") => Ok(DeferMode::Never),
            Some(v) => Err(format!(
                "{DEFER_CONTEXT_KEY}={}: expected \"auto\", \"true\" or \"false\"",
                crust_fs::quote(v)
            )),
        }
    }

    /// The mode a volume was created with (its parameters).
    pub fn of(rec: &VolumeRecord) -> DeferMode {
        DeferMode::parse(rec.parameters.get(DEFER_CONTEXT_KEY).map(String::as_str))
            .unwrap_or(DeferMode::Auto)
    }
}

/// Whether a volume context asks for deferral at stage/publish
/// (`deferFsOps=true`).
pub(crate) fn context_defers(volume_context: Option<&HashMap<String, String>>) -> Result<bool> {
    let v = volume_context.and_then(|c| c.get(DEFER_CONTEXT_KEY));
    DeferMode::parse(v.map(String::as_str))
        .map(|m| m == DeferMode::Always)
        .map_err(|e| NodeError::InvalidArgument(format!("volume_context {e}")))
}

/// The first check of every Node RPC (error.rs's ordering): a required
/// field left empty is INVALID_ARGUMENT before the volume is looked up.
pub(crate) fn require(fields: &[(&'static str, bool)]) -> Result<()> {
    match fields.iter().find(|(_, present)| !present) {
        Some((field, _)) => Err(NodeError::Missing(field)),
        None => Ok(()),
    }
}

/// A path a request names to find volume `rec` at (`volume_path` of
/// NodeGetVolumeStats and NodeExpandVolume), decided from the string
/// alone: paths are recorded only in the form [`abs_path`] accepts, so
/// any other string (a relative one, never resolved against the plugin's
/// working directory; one with `.` or `..`) is a path where the volume is
/// not, NOT_FOUND like any other. Empty is checked by [`require`].
pub(crate) fn lookup_path(rec: &VolumeRecord, p: &str) -> Result<PathBuf> {
    as_recorded(p).ok_or_else(|| {
        RouteError::UnknownPath {
            volume: rec.id.clone(),
            path: PathBuf::from(p),
        }
        .into()
    })
}

/// `p` in the one form paths are recorded in, or None: such a string
/// names no place of any volume.
pub(crate) fn as_recorded(p: &str) -> Option<PathBuf> {
    crust_blockdev::validate_abs_path(p).ok()
}

/// The optional `staging_target_path` of NodeGetVolumeStats and
/// NodeExpandVolume: when given, the volume must be staged exactly there
/// (NOT_FOUND otherwise, as for `volume_path`).
pub(crate) fn check_staging_hint(rec: &VolumeRecord, p: &str) -> Result<()> {
    if p.is_empty() {
        return Ok(());
    }
    let staged_here =
        as_recorded(p).is_some_and(|p| rec.staging.as_ref().is_some_and(|s| s.path == p));
    if !staged_here {
        return Err(RouteError::NotStagedAt {
            volume: rec.id.clone(),
            path: PathBuf::from(p),
        }
        .into());
    }
    Ok(())
}

pub(crate) fn abs_path(field: &'static str, p: &str) -> Result<PathBuf> {
    if p.is_empty() {
        return Err(NodeError::Missing(field));
    }
    crust_blockdev::validate_abs_path(p)
        .map_err(|e| NodeError::InvalidArgument(format!("{field}: {e}")))
}

fn node_cap(cap: Option<&csi::VolumeCapability>) -> Result<Capability> {
    let cap = cap.ok_or(NodeError::Missing("volume_capability"))?;
    Capability::from_proto(cap).map_err(NodeError::InvalidArgument)
}

impl NodeParts<'_> {
    /// KEP-2857 seam: decides how filesystem operations of a request are
    /// carried out: deferred to the pod's runtime when the request
    /// (`defer_fs_ops`) or the volume context (`deferFsOps=true`) asks for
    /// it. A plugin started with `--deferral disabled` refuses such a
    /// request (FAILED_PRECONDITION), never serving it with a host mount.
    pub fn fs_ops_route(
        &self,
        requested: bool,
        volume_context: Option<&HashMap<String, String>>,
    ) -> Result<FsOps> {
        let from_context = context_defers(volume_context)?;
        if !(requested || from_context) {
            return Ok(FsOps::Host);
        }
        if !self.cfg.deferral.enabled {
            return Err(NodeError::DeferralUnsupported);
        }
        Ok(FsOps::Deferred)
    }

    pub(crate) fn node_record(&self, id: &str) -> Result<VolumeRecord> {
        match self.state.get(id) {
            Some(r) if r.phase == Phase::Ready => Ok(r),
            _ => Err(NodeError::NotFound(id.to_string())),
        }
    }

    /// `NodeParts::node_record` for NodeStage/NodePublish, which carry the
    /// volume context: a volume of another node (named by the record or
    /// by the context's `<driver>/node`) is FAILED_PRECONDITION naming
    /// that node, the spec's code for a CO exceeding a volume's
    /// single-node capability, rather than NOT_FOUND: the volume exists,
    /// just not here.
    pub(crate) fn node_record_here(
        &self,
        id: &str,
        volume_context: &HashMap<String, String>,
    ) -> Result<VolumeRecord> {
        let owner = match self.state.get(id) {
            Some(r) if r.phase == Phase::Ready && r.node_id == self.cfg.node_id => return Ok(r),
            Some(r) if r.phase == Phase::Ready => Some(r.node_id),
            _ => volume_context
                .get(&self.cfg.topology_key())
                .filter(|n| **n != self.cfg.node_id)
                .cloned(),
        };
        match owner {
            Some(node) => Err(NodeError::OtherNode {
                volume: id.to_string(),
                node,
                here: self.cfg.node_id.clone(),
            }),
            None => Err(NodeError::NotFound(id.to_string())),
        }
    }

    pub fn node_get_info(&self) -> csi::NodeGetInfoResponse {
        csi::NodeGetInfoResponse {
            node_id: self.cfg.node_id.clone(),
            max_volumes_per_node: self.cfg.max_volumes_per_node,
            accessible_topology: Some(self.cfg.topology()),
            supported_file_systems: FsType::NAMES.map(String::from).to_vec(),
        }
    }
}

/// The tonic Node service.
#[derive(Clone)]
pub struct NodeService {
    driver: Arc<Driver>,
}

impl NodeService {
    pub fn new(driver: Arc<Driver>) -> Self {
        NodeService { driver }
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> std::result::Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        blocking(&self.driver, move |d| d.node().node_stage_volume(&req)).await?;
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> std::result::Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        blocking(&self.driver, move |d| d.node().node_unstage_volume(&req)).await?;
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> std::result::Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        blocking(&self.driver, move |d| d.node().node_publish_volume(&req)).await?;
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> std::result::Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        blocking(&self.driver, move |d| d.node().node_unpublish_volume(&req)).await?;
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> std::result::Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| d.node().node_get_volume_stats(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn node_expand_volume(
        &self,
        request: Request<csi::NodeExpandVolumeRequest>,
    ) -> std::result::Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| d.node().node_expand_volume(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> std::result::Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities: crate::surface::node_capabilities(
                self.driver.config().csi_spec,
                self.driver.deferral_enabled(),
            ),
        }))
    }

    async fn node_get_info(
        &self,
        _request: Request<csi::NodeGetInfoRequest>,
    ) -> std::result::Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(self.driver.node().node_get_info()))
    }

    async fn node_get_volume_health(
        &self,
        request: Request<csi::NodeGetVolumeHealthRequest>,
    ) -> std::result::Result<Response<csi::NodeGetVolumeHealthResponse>, Status> {
        if !self.driver.config().csi_spec.serves_health_api() {
            return Err(crate::surface::health_api_off("NodeGetVolumeHealth"));
        }
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| d.node().node_get_volume_health(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn node_get_storage_health(
        &self,
        _request: Request<csi::NodeGetStorageHealthRequest>,
    ) -> std::result::Result<Response<csi::NodeGetStorageHealthResponse>, Status> {
        if !self.driver.config().csi_spec.serves_health_api() {
            return Err(crate::surface::health_api_off("NodeGetStorageHealth"));
        }
        let resp = blocking(&self.driver, |d| d.node().node_get_storage_health()).await?;
        Ok(Response::new(resp))
    }
}
