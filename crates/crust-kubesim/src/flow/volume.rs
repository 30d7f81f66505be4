//! The CSI side of the pod: plugin discovery, CreateVolume, NodeStage,
//! NodePublish and the expansion, as kubelet and the sidecars call them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crust_proto::csi::v1 as csi;

use super::config::{DEFER_PARAM, DeferVia};
use super::host::{is_mountpoint, is_placeholder};
use super::report::{FlowError, VolumeInfo};
use super::{Flow, Undo, guarded, status_text};
use crust_report::units::human_size;

impl Flow {
    /// GetPluginInfo, NodeGetInfo, NodeGetCapabilities: the driver name for
    /// kubelet's paths and the node's topology.
    pub(super) async fn discover_plugin(
        &mut self,
    ) -> Result<(String, Option<csi::Topology>), FlowError> {
        use csi::node_service_capability::{Type, rpc::Type as T};
        let stop = self.stop.clone();
        let c = self.csi.clone();
        let t0 = Instant::now();
        let r = guarded(&stop, async {
            let info = c
                .get_plugin_info(Default::default())
                .await
                .map_err(|s| format!("GetPluginInfo: {}", status_text(&s)))?;
            let node = c
                .node_get_info(Default::default())
                .await
                .map_err(|s| format!("NodeGetInfo: {}", status_text(&s)))?;
            let caps = c
                .node_get_capabilities(Default::default())
                .await
                .map_err(|s| format!("NodeGetCapabilities: {}", status_text(&s)))?;
            let has: Vec<i32> = caps
                .capabilities
                .iter()
                .filter_map(|c| c.r#type.as_ref().map(|Type::Rpc(r)| r.r#type))
                .collect();
            Ok((info, node, has))
        })
        .await;
        let (info, node, has) = match r {
            Ok(v) => v,
            Err(e) => return self.fail("plugin", t0, e),
        };
        let defer_cap = has.contains(&(T::DeferFsOps as i32));
        self.report.driver = info.name.clone();
        self.report.node_id = node.node_id.clone();
        if self.cfg.deferred() && !defer_cap {
            // kubelet would refuse here (KEP story 6); we let the plugin
            // answer so its error is visible.
            self.note("the plugin does not advertise DEFER_FS_OPS");
        }
        let detail = format!(
            "{} {} on node {}{}",
            info.name,
            info.vendor_version,
            node.node_id,
            if defer_cap {
                ", DEFER_FS_OPS advertised"
            } else {
                ", no DEFER_FS_OPS"
            }
        );
        self.record("plugin", t0, Ok(detail))?;
        Ok((
            self.cfg.driver_name.clone().unwrap_or(info.name),
            node.accessible_topology,
        ))
    }

    /// CreateVolume with the flow's parameters (and deferFsOps=true when
    /// deferral goes through the StorageClass).
    pub(super) async fn create_volume(
        &mut self,
        topology: Option<csi::Topology>,
    ) -> Result<csi::Volume, FlowError> {
        let stop = self.stop.clone();
        let c = self.csi.clone();
        let mut params = self.cfg.params.clone();
        if self.cfg.defer_via == DeferVia::StorageClass {
            params.insert(DEFER_PARAM.into(), "true".into());
        }
        let req = csi::CreateVolumeRequest {
            name: self.cfg.volume_name.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: self.cfg.size as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![self.capability(false)],
            parameters: params,
            accessibility_requirements: topology.map(|t| csi::TopologyRequirement {
                requisite: vec![t.clone()],
                preferred: vec![t],
            }),
            ..Default::default()
        };
        let t0 = Instant::now();
        let r = guarded(&stop, async {
            c.create_volume(req)
                .await
                .map_err(|s| status_text(&s))?
                .volume
                .filter(|v| !v.volume_id.is_empty())
                .ok_or_else(|| "the response carries no volume".to_string())
        })
        .await;
        let vol = match r {
            Ok(v) => v,
            Err(e) => return self.fail("CreateVolume", t0, e),
        };
        self.undo.push(Undo::Volume(vol.volume_id.clone()));
        self.volume_id = Some(vol.volume_id.clone());
        self.volume_context = vol.volume_context.clone();
        let fs_type = vol
            .volume_context
            .get("fsType")
            .cloned()
            .unwrap_or_else(|| self.cfg.fs_type.clone());
        self.report.volume = Some(VolumeInfo {
            id: vol.volume_id.clone(),
            name: self.cfg.volume_name.clone(),
            capacity_bytes: vol.capacity_bytes,
            fs_type: fs_type.clone(),
            context: vol.volume_context.clone().into_iter().collect(),
        });
        let ctx_text = {
            let mut kv: Vec<String> = vol
                .volume_context
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            kv.sort();
            kv.join(",")
        };
        self.record(
            "CreateVolume",
            t0,
            Ok(format!(
                "{}: {} {} (context {})",
                vol.volume_id,
                human_size(vol.capacity_bytes),
                fs_type,
                if ctx_text.is_empty() { "-" } else { &ctx_text }
            )),
        )?;
        if self.cfg.defer_via == DeferVia::StorageClass
            && vol.volume_context.get(DEFER_PARAM).map(String::as_str) != Some("true")
        {
            self.note(format!(
                "the driver did not carry {DEFER_PARAM}=true into the volume context"
            ));
        }
        Ok(vol)
    }

    /// NodeStageVolume at kubelet's staging path.
    pub(super) async fn stage(
        &mut self,
        driver: &str,
        vol: &csi::Volume,
    ) -> Result<PathBuf, FlowError> {
        let stop = self.stop.clone();
        let c = self.csi.clone();
        let staging = self.cfg.staging_path(driver, &vol.volume_id);
        let t0 = Instant::now();
        if let Err(e) = self.make_dirs(&staging) {
            return self.fail("NodeStageVolume", t0, e);
        }
        let staging_s = staging.display().to_string();
        self.staging = Some(staging_s.clone());
        self.report.staging_path = staging_s.clone();
        let req = csi::NodeStageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            publish_context: HashMap::new(),
            staging_target_path: staging_s.clone(),
            volume_capability: Some(self.capability(false)),
            secrets: HashMap::new(),
            volume_context: self.volume_context.clone(),
        };
        let r = guarded(&stop, async {
            c.node_stage_volume(req).await.map_err(|s| status_text(&s))
        })
        .await;
        if let Err(e) = r {
            return self.fail("NodeStageVolume", t0, e);
        }
        self.undo.push(Undo::Staged {
            volume: vol.volume_id.clone(),
            path: staging_s.clone(),
        });
        let staged_mounted = is_mountpoint(&staging);
        self.record(
            "NodeStageVolume",
            t0,
            Ok(format!(
                "{staging_s} ({})",
                if staged_mounted {
                    "mounted on the host"
                } else {
                    "not mounted on the host"
                }
            )),
        )?;
        Ok(staging)
    }

    /// NodePublishVolume at kubelet's target, and a check that the host
    /// mounts are what deferral (or its absence) promises.
    pub(super) async fn publish(
        &mut self,
        vol: &csi::Volume,
        staging: &Path,
    ) -> Result<(), FlowError> {
        let stop = self.stop.clone();
        let c = self.csi.clone();
        let staging_s = staging.display().to_string();
        let target = PathBuf::from(&self.target);
        let t0 = Instant::now();
        if let Err(e) = self.make_dirs(target.parent().expect("target has a parent")) {
            return self.fail("NodePublishVolume", t0, e);
        }
        let req = csi::NodePublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            publish_context: HashMap::new(),
            staging_target_path: staging_s.clone(),
            target_path: self.target.clone(),
            volume_capability: Some(self.capability(true)),
            readonly: false,
            secrets: HashMap::new(),
            volume_context: self.volume_context.clone(),
            defer_fs_ops: self.request_defer(),
        };
        let r = guarded(&stop, async {
            c.node_publish_volume(req)
                .await
                .map_err(|s| status_text(&s))
        })
        .await;
        if let Err(e) = r {
            return self.fail("NodePublishVolume", t0, e);
        }
        self.undo.push(Undo::Published {
            volume: vol.volume_id.clone(),
            target: self.target.clone(),
        });
        // A deferred target shows the plugin's placeholder, never
        // the volume's filesystem.
        let mounted = is_mountpoint(&target) && !is_placeholder(&target);
        let staging_mounted = is_mountpoint(staging);
        let r = match (self.cfg.deferred(), mounted) {
            // The guest will mount it: a host mount too would corrupt it.
            (true, false) if staging_mounted => Err(format!(
                "deferral was requested but the filesystem is still mounted on the host at {staging_s}"
            )),
            (true, false) => Ok(format!(
                "{} (deferred: nothing mounted on the host{})",
                self.target,
                match (self.cfg.fs_group, self.cfg.change_policy) {
                    (Some(g), Some(p)) => format!(", fsGroup {g} {}", p.as_str()),
                    (Some(g), None) => format!(", fsGroup {g}"),
                    _ => String::new(),
                }
            )),
            (true, true) => Err(format!(
                "deferral was requested but {} is mounted on the host",
                self.target
            )),
            (false, true) => Ok(format!("{} (mounted on the host)", self.target)),
            (false, false) => Err(format!(
                "{} is not a mount point after a publish without deferral",
                self.target
            )),
        };
        self.record("NodePublishVolume", t0, r)
    }

    /// ControllerExpandVolume, then NodeExpandVolume when the controller
    /// asks for it.
    pub async fn expand(&mut self, size: u64) -> Result<(), FlowError> {
        let stop = self.stop.clone();
        let id = self.volume_id.clone().unwrap_or_default();
        let c = self.csi.clone();
        let range = Some(csi::CapacityRange {
            required_bytes: size as i64,
            limit_bytes: 0,
        });
        let t0 = Instant::now();
        let req = csi::ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: range,
            secrets: HashMap::new(),
            volume_capability: Some(self.capability(false)),
        };
        let r = guarded(&stop, async {
            c.controller_expand_volume(req)
                .await
                .map_err(|s| status_text(&s))
        })
        .await;
        let resp = match r {
            Ok(r) => r,
            Err(e) => return self.record("ControllerExpandVolume", t0, Err(e)),
        };
        self.record(
            "ControllerExpandVolume",
            t0,
            Ok(format!(
                "capacity {}, node expansion {}",
                human_size(resp.capacity_bytes),
                if resp.node_expansion_required {
                    "required"
                } else {
                    "not required"
                }
            )),
        )?;
        if let Some(v) = &mut self.report.volume {
            v.capacity_bytes = resp.capacity_bytes;
        }
        if !resp.node_expansion_required {
            return Ok(());
        }
        let t0 = Instant::now();
        let req = csi::NodeExpandVolumeRequest {
            volume_id: id,
            volume_path: self.target.clone(),
            capacity_range: range,
            staging_target_path: self.staging.clone().unwrap_or_default(),
            volume_capability: Some(self.capability(false)),
            secrets: HashMap::new(),
            defer_fs_ops: self.request_defer(),
        };
        let r = guarded(&stop, async {
            c.node_expand_volume(req).await.map_err(|s| status_text(&s))
        })
        .await;
        let r = r.map(|resp| {
            self.report.expanded_bytes = Some(resp.capacity_bytes);
            format!(
                "capacity {}{}",
                human_size(resp.capacity_bytes),
                if self.cfg.deferred() {
                    " (grown in the guest)"
                } else {
                    ""
                }
            )
        });
        self.record("NodeExpandVolume", t0, r)
    }
}
