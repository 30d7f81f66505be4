//! Flags to requests: each RPC's request is built (and bad input refused
//! with a usage error) before anything connects.

use std::collections::HashMap;
use std::path::PathBuf;

use crust_proto::csi::v1 as csi;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};

use super::CliError;
use super::args::{
    AccessModeArg, CapabilityArgs, ControllerCmd, GroupCmd, NodeCmd, PodArgs, RuntimeArgs,
};
use crate::parse::{KeyValue, to_map};
use crust_kubesim::flow::{DeferVia, FlowConfig};
use crust_kubesim::runtime_cli::RuntimeCli;

impl RuntimeArgs {
    pub fn build(&self) -> RuntimeCli {
        let mut r = RuntimeCli::new(
            self.runtime_bin
                .clone()
                .unwrap_or_else(RuntimeCli::default_bin),
        );
        r.root = self.runtime_root.clone();
        r.crust_root = self.crust_root.clone();
        r.kata_root = self.kata_root.clone();
        r.guest_kernel = self.guest_kernel.clone();
        r.guest_initrd = self.guest_initrd.clone();
        r.accel = self.accel.clone();
        r.timeout = self.runtime_timeout;
        r
    }
}

impl PodArgs {
    pub(super) fn flow_config(&self, work_dir: PathBuf) -> Result<FlowConfig, CliError> {
        let mut f = FlowConfig::new(work_dir, self.runtime.build());
        f.driver_name = self.driver_name.clone();
        if let Some(n) = &self.name {
            f.volume_name = n.clone();
        }
        f.pv_name = self.pv_name.clone();
        if let Some(u) = &self.pod_uid {
            check_name("--pod-uid", u)?;
            f.pod_uid = u.clone();
        }
        if let Some(i) = &self.sandbox_id {
            check_name("--sandbox-id", i)?;
            f.sandbox_id = i.clone();
        }
        if let Some(p) = &self.pv_name {
            check_name("--pv-name", p)?;
        }
        check_name("--name", &f.volume_name)?;
        f.size = self.size;
        f.fs_type = self.fs_type.clone();
        f.mount_flags = self.mount_flags.clone();
        f.fs_group = self.fs_group;
        f.change_policy = self.fs_group_change_policy;
        f.defer_via = self.defer_via;
        f.params = map(&self.params, "--param")?;
        if f.defer_via == DeferVia::None && f.fs_group.is_some() {
            return Err(CliError::Usage(
                "--fs-group is sent as volume_supplemental_group, which needs deferral".into(),
            ));
        }
        Ok(f)
    }
}

impl CapabilityArgs {
    /// Whether any capability flag was given (for RPCs where it is optional).
    pub fn given(&self) -> bool {
        self.block
            || self.fs_type.is_some()
            || !self.mount_flags.is_empty()
            || self.volume_mount_group.is_some()
            || self.supplemental_group.is_some()
            || self.supplemental_group_change_policy.is_some()
            || self.access_mode.is_some()
    }

    pub fn build(&self) -> csi::VolumeCapability {
        let access_type = if self.block {
            AccessType::Block(BlockVolume {})
        } else {
            AccessType::Mount(MountVolume {
                fs_type: self.fs_type.clone().unwrap_or_default(),
                mount_flags: self.mount_flags.clone(),
                volume_mount_group: self
                    .volume_mount_group
                    .map(|g| g.to_string())
                    .unwrap_or_default(),
                volume_supplemental_group: self
                    .supplemental_group
                    .map(|g| g.to_string())
                    .unwrap_or_default(),
                volume_supplemental_group_change_policy: self
                    .supplemental_group_change_policy
                    .map(|p| p.as_str().to_string())
                    .unwrap_or_default(),
            })
        };
        csi::VolumeCapability {
            access_type: Some(access_type),
            access_mode: Some(AccessMode {
                mode: self
                    .access_mode
                    .unwrap_or(AccessModeArg::SingleNodeWriter)
                    .mode() as i32,
            }),
        }
    }

    pub(super) fn optional(&self) -> Option<csi::VolumeCapability> {
        self.given().then(|| self.build())
    }
}

pub(super) fn map(pairs: &[KeyValue], what: &str) -> Result<HashMap<String, String>, CliError> {
    to_map(pairs, what).map_err(CliError::Usage)
}

pub(super) fn topology(pairs: &[KeyValue]) -> Result<Option<csi::Topology>, CliError> {
    if pairs.is_empty() {
        return Ok(None);
    }
    Ok(Some(csi::Topology {
        segments: map(pairs, "--topology")?,
    }))
}

pub(super) fn capacity(
    size: Option<u64>,
    limit: Option<u64>,
) -> Result<Option<csi::CapacityRange>, CliError> {
    if let (Some(s), Some(l)) = (size, limit)
        && l < s
    {
        return Err(CliError::Usage(format!(
            "--limit ({l}) is smaller than --size ({s})"
        )));
    }
    if size.is_none() && limit.is_none() {
        return Ok(None);
    }
    Ok(Some(csi::CapacityRange {
        required_bytes: size.unwrap_or(0) as i64,
        limit_bytes: limit.unwrap_or(0) as i64,
    }))
}

pub(super) fn path_str(p: &std::path::Path) -> Result<String, CliError> {
    p.to_str()
        .map(str::to_string)
        .ok_or_else(|| CliError::Usage(format!("path {} is not UTF-8", p.display())))
}

pub(super) fn opt_path(p: &Option<PathBuf>) -> Result<String, CliError> {
    p.as_deref().map(path_str).unwrap_or(Ok(String::new()))
}

/// A path component kubelet would accept.
pub(super) fn check_name(flag: &str, v: &str) -> Result<(), CliError> {
    if v.is_empty() || v == "." || v == ".." || v.contains('/') || v.contains('\0') || v.len() > 253
    {
        return Err(CliError::Usage(format!(
            "{flag} {v:?}: must be a single non-empty path component"
        )));
    }
    Ok(())
}

pub(super) enum ControllerReq {
    Create(csi::CreateVolumeRequest),
    Delete(csi::DeleteVolumeRequest),
    Get(csi::ControllerGetVolumeRequest),
    Health(csi::ControllerGetVolumeHealthRequest),
    ListHealth(csi::ControllerListVolumeHealthRequest, bool),
    List(csi::ListVolumesRequest, bool),
    Capacity(csi::GetCapacityRequest),
    Expand(csi::ControllerExpandVolumeRequest),
    Validate(csi::ValidateVolumeCapabilitiesRequest),
    Capabilities,
    Publish(csi::ControllerPublishVolumeRequest),
    Unpublish(csi::ControllerUnpublishVolumeRequest),
    Modify(csi::ControllerModifyVolumeRequest),
    SnapCreate(csi::CreateSnapshotRequest),
    SnapDelete(csi::DeleteSnapshotRequest),
    SnapList(csi::ListSnapshotsRequest, bool),
    SnapGet(csi::GetSnapshotRequest),
}

impl ControllerReq {
    #[allow(
        clippy::too_many_lines,
        reason = "one arm per controller subcommand: the flags-to-request table reads best in one place"
    )]
    pub(super) fn build(cmd: ControllerCmd) -> Result<Self, CliError> {
        use ControllerCmd as C;
        Ok(match cmd {
            cmd @ (C::SnapshotCreate { .. }
            | C::SnapshotDelete { .. }
            | C::SnapshotList { .. }
            | C::SnapshotGet { .. }) => Self::snapshot(cmd)?,
            C::Create {
                name,
                size,
                limit,
                cap,
                params,
                mutable_params,
                secrets,
                topology: topo,
                source_snapshot,
                source_volume,
            } => {
                use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
                let content = match (source_snapshot, source_volume) {
                    (Some(s), _) => Some(Type::Snapshot(SnapshotSource { snapshot_id: s })),
                    (None, Some(v)) => Some(Type::Volume(VolumeSource { volume_id: v })),
                    (None, None) => None,
                };
                Self::Create(csi::CreateVolumeRequest {
                    name,
                    capacity_range: capacity(size, limit)?,
                    volume_capabilities: vec![cap.build()],
                    parameters: map(&params, "--param")?,
                    secrets: map(&secrets, "--secret")?,
                    volume_content_source: content
                        .map(|t| csi::VolumeContentSource { r#type: Some(t) }),
                    accessibility_requirements: topology(&topo)?.map(|t| {
                        csi::TopologyRequirement {
                            requisite: vec![t.clone()],
                            preferred: vec![t],
                        }
                    }),
                    mutable_parameters: map(&mutable_params, "--mutable-param")?,
                })
            }
            C::Delete { volume_id, secrets } => Self::Delete(csi::DeleteVolumeRequest {
                volume_id,
                secrets: map(&secrets, "--secret")?,
            }),
            C::Get { volume_id } => Self::Get(csi::ControllerGetVolumeRequest { volume_id }),
            C::VolumeHealth { volume_id } => Self::Health(csi::ControllerGetVolumeHealthRequest {
                volume_id,
                secrets: Default::default(),
            }),
            C::ListVolumeHealth {
                max_entries,
                starting_token,
                all,
            } => Self::ListHealth(
                csi::ControllerListVolumeHealthRequest {
                    max_entries: page_size(max_entries)?,
                    starting_token: starting_token.unwrap_or_default(),
                    secrets: Default::default(),
                },
                all,
            ),
            C::List {
                max_entries,
                starting_token,
                all,
            } => Self::List(
                csi::ListVolumesRequest {
                    max_entries: page_size(max_entries)?,
                    starting_token: starting_token.unwrap_or_default(),
                },
                all,
            ),
            C::Capacity {
                cap,
                params,
                topology: topo,
            } => Self::Capacity(csi::GetCapacityRequest {
                volume_capabilities: cap.optional().into_iter().collect(),
                parameters: map(&params, "--param")?,
                accessible_topology: topology(&topo)?,
            }),
            C::Expand {
                volume_id,
                size,
                limit,
                cap,
                secrets,
            } => Self::Expand(csi::ControllerExpandVolumeRequest {
                volume_id,
                capacity_range: capacity(Some(size), limit)?,
                secrets: map(&secrets, "--secret")?,
                volume_capability: cap.optional(),
            }),
            C::Validate {
                volume_id,
                cap,
                volume_context,
                params,
                mutable_params,
                secrets,
            } => Self::Validate(csi::ValidateVolumeCapabilitiesRequest {
                volume_id,
                volume_context: map(&volume_context, "--volume-context")?,
                volume_capabilities: vec![cap.build()],
                parameters: map(&params, "--param")?,
                secrets: map(&secrets, "--secret")?,
                mutable_parameters: map(&mutable_params, "--mutable-param")?,
            }),
            C::Capabilities => Self::Capabilities,
            C::Publish {
                volume_id,
                node_id,
                cap,
                readonly,
                volume_context,
                secrets,
            } => Self::Publish(csi::ControllerPublishVolumeRequest {
                volume_id,
                node_id,
                volume_capability: Some(cap.build()),
                readonly,
                secrets: map(&secrets, "--secret")?,
                volume_context: map(&volume_context, "--volume-context")?,
            }),
            C::Unpublish {
                volume_id,
                node_id,
                secrets,
            } => Self::Unpublish(csi::ControllerUnpublishVolumeRequest {
                volume_id,
                node_id,
                secrets: map(&secrets, "--secret")?,
            }),
            C::Modify {
                volume_id,
                mutable_params,
                secrets,
            } => Self::Modify(csi::ControllerModifyVolumeRequest {
                volume_id,
                secrets: map(&secrets, "--secret")?,
                mutable_parameters: map(&mutable_params, "--mutable-param")?,
            }),
        })
    }

    /// The snapshot subcommands of `controller`.
    fn snapshot(cmd: ControllerCmd) -> Result<Self, CliError> {
        use ControllerCmd as C;
        Ok(match cmd {
            C::SnapshotCreate {
                source_volume,
                name,
                params,
                secrets,
            } => Self::SnapCreate(csi::CreateSnapshotRequest {
                accessibility_requirements: None,
                source_volume_id: source_volume,
                name,
                secrets: map(&secrets, "--secret")?,
                parameters: map(&params, "--param")?,
            }),
            C::SnapshotDelete {
                snapshot_id,
                secrets,
            } => Self::SnapDelete(csi::DeleteSnapshotRequest {
                snapshot_id,
                secrets: map(&secrets, "--secret")?,
            }),
            C::SnapshotList {
                max_entries,
                starting_token,
                source_volume,
                snapshot_id,
                secrets,
                all,
            } => Self::SnapList(
                csi::ListSnapshotsRequest {
                    max_entries: page_size(max_entries)?,
                    starting_token: starting_token.unwrap_or_default(),
                    source_volume_id: source_volume.unwrap_or_default(),
                    snapshot_id: snapshot_id.unwrap_or_default(),
                    secrets: map(&secrets, "--secret")?,
                },
                all,
            ),
            C::SnapshotGet {
                snapshot_id,
                secrets,
            } => Self::SnapGet(csi::GetSnapshotRequest {
                snapshot_id,
                secrets: map(&secrets, "--secret")?,
            }),
            _ => unreachable!("only snapshot subcommands come here"),
        })
    }
}

/// `--max-entries` (0, CSI's "no limit", when absent).
fn page_size(max_entries: Option<i32>) -> Result<i32, CliError> {
    match max_entries {
        Some(m) if m < 0 => Err(CliError::Usage("--max-entries must not be negative".into())),
        m => Ok(m.unwrap_or(0)),
    }
}

pub(super) enum GroupReq {
    Capabilities,
    Create(csi::CreateVolumeGroupSnapshotRequest),
    Delete(csi::DeleteVolumeGroupSnapshotRequest),
    Get(csi::GetVolumeGroupSnapshotRequest),
}

impl GroupReq {
    pub(super) fn build(cmd: GroupCmd) -> Result<Self, CliError> {
        use GroupCmd as G;
        Ok(match cmd {
            G::Capabilities => Self::Capabilities,
            G::Create {
                name,
                volumes,
                params,
            } => Self::Create(csi::CreateVolumeGroupSnapshotRequest {
                name,
                source_volume_ids: volumes,
                secrets: Default::default(),
                parameters: map(&params, "--param")?,
            }),
            G::Delete {
                group_snapshot_id,
                snapshot_ids,
            } => Self::Delete(csi::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id,
                snapshot_ids,
                secrets: Default::default(),
            }),
            G::Get {
                group_snapshot_id,
                snapshot_ids,
            } => Self::Get(csi::GetVolumeGroupSnapshotRequest {
                group_snapshot_id,
                snapshot_ids,
                secrets: Default::default(),
            }),
        })
    }
}

pub(super) enum NodeReq {
    Stage(csi::NodeStageVolumeRequest),
    Unstage(csi::NodeUnstageVolumeRequest),
    Publish(csi::NodePublishVolumeRequest),
    Unpublish(csi::NodeUnpublishVolumeRequest),
    Stats(csi::NodeGetVolumeStatsRequest),
    Health(csi::NodeGetVolumeHealthRequest),
    StorageHealth,
    Expand(csi::NodeExpandVolumeRequest),
    Capabilities,
    Info,
}

impl NodeReq {
    pub(super) fn build(cmd: NodeCmd) -> Result<Self, CliError> {
        use NodeCmd as N;
        Ok(match cmd {
            N::Stage {
                volume_id,
                staging_path,
                cap,
                publish_context,
                volume_context,
                secrets,
            } => Self::Stage(csi::NodeStageVolumeRequest {
                volume_id,
                publish_context: map(&publish_context, "--publish-context")?,
                staging_target_path: path_str(&staging_path)?,
                volume_capability: Some(cap.build()),
                secrets: map(&secrets, "--secret")?,
                volume_context: map(&volume_context, "--volume-context")?,
            }),
            N::Unstage {
                volume_id,
                staging_path,
            } => Self::Unstage(csi::NodeUnstageVolumeRequest {
                volume_id,
                staging_target_path: path_str(&staging_path)?,
            }),
            N::Publish {
                volume_id,
                target_path,
                staging_path,
                cap,
                readonly,
                publish_context,
                volume_context,
                secrets,
                defer_fs_ops,
            } => Self::Publish(csi::NodePublishVolumeRequest {
                volume_id,
                publish_context: map(&publish_context, "--publish-context")?,
                staging_target_path: opt_path(&staging_path)?,
                target_path: path_str(&target_path)?,
                volume_capability: Some(cap.build()),
                readonly,
                secrets: map(&secrets, "--secret")?,
                volume_context: map(&volume_context, "--volume-context")?,
                defer_fs_ops,
            }),
            N::Unpublish {
                volume_id,
                target_path,
                defer_fs_ops,
            } => Self::Unpublish(csi::NodeUnpublishVolumeRequest {
                volume_id,
                target_path: path_str(&target_path)?,
                defer_fs_ops,
            }),
            N::VolumeHealth {
                volume_id,
                volume_path,
                staging_path,
            } => Self::Health(csi::NodeGetVolumeHealthRequest {
                volume_id,
                volume_publish_path: opt_path(&volume_path)?,
                staging_target_path: opt_path(&staging_path)?,
            }),
            N::StorageHealth => Self::StorageHealth,
            N::Stats {
                volume_id,
                volume_path,
                staging_path,
                defer_fs_ops,
            } => Self::Stats(csi::NodeGetVolumeStatsRequest {
                volume_id,
                volume_path: path_str(&volume_path)?,
                staging_target_path: opt_path(&staging_path)?,
                defer_fs_ops,
            }),
            N::Expand {
                volume_id,
                volume_path,
                size,
                limit,
                staging_path,
                cap,
                secrets,
                defer_fs_ops,
            } => Self::Expand(csi::NodeExpandVolumeRequest {
                volume_id,
                volume_path: path_str(&volume_path)?,
                capacity_range: capacity(size, limit)?,
                staging_target_path: opt_path(&staging_path)?,
                // kubelet always sends the capability; so do we.
                volume_capability: Some(cap.build()),
                secrets: map(&secrets, "--secret")?,
                defer_fs_ops,
            }),
            N::Capabilities => Self::Capabilities,
            N::Info => Self::Info,
        })
    }
}
