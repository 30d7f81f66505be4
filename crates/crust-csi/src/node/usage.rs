//! NodeGetVolumeStats and NodeExpandVolume for host publications (the
//! deferred and handed-over ones are answered from the guest through
//! crust_ops, `crate::defer`).

use std::fs;
use std::path::{Path, PathBuf};

use crust_proto::csi::v1 as csi;

use super::{check_staging_hint, lookup_path, require};
use crate::caps::{Capability, FsType};
use crate::config::Expansion;
use crate::driver::NodeParts;
use crate::error::{ExpandError, NodeError, RouteError};
use crate::records::{HostMount, VolumeRecord};

type Result<T> = std::result::Result<T, NodeError>;

/// The device's current size after picking up a grown backing store
/// (LOOP_SET_CAPACITY for loop devices), checked against the requested
/// capacity range of a NodeExpandVolume.
pub(crate) fn refreshed_device_size(
    id: &str,
    device: &Path,
    required: u64,
    limit: u64,
) -> Result<u64> {
    let size = match crust_blockdev::loop_status(device) {
        Ok(Some(_)) => crust_blockdev::refresh_capacity(device)
            .map_err(|e| NodeError::Internal(format!("refreshing device size: {e}")))?,
        _ => crust_blockdev::block_device_size(device)
            .map_err(|e| NodeError::Internal(format!("reading device size: {e}")))?,
    };
    if required > size {
        return Err(ExpandError::DeviceTooSmall {
            volume: id.to_string(),
            device: device.to_path_buf(),
            size,
            required,
        }
        .into());
    }
    if limit != 0 && size > limit {
        return Err(ExpandError::DeviceAboveLimit {
            volume: id.to_string(),
            size,
            limit,
        }
        .into());
    }
    Ok(size)
}

/// Where a volume path's stats and expansion are answered.
enum UsageRoute {
    /// In the pod's guest, through crust_ops and the runtime CLI.
    Guest,
    /// On the host: the staged device, published as raw block or as a
    /// filesystem.
    Host { block: bool, device: PathBuf },
}

impl NodeParts<'_> {
    /// `--expansion node`: grows the backing store to the requested size
    /// (the controller does not, since it does not advertise EXPAND_VOLUME)
    /// and records the new capacity. A request within the current size
    /// changes nothing.
    fn grow_backing_on_node(
        &self,
        rec: &mut VolumeRecord,
        required: u64,
        limit: u64,
    ) -> Result<()> {
        if self.cfg.expansion != Expansion::Node || required <= rec.capacity_bytes {
            return Ok(());
        }
        let target = crate::controller::align(required, limit).map_err(|e| match e {
            crate::error::ControllerError::NoSectorMultiple {
                size,
                limit,
                sector,
            } => ExpandError::NoSectorMultiple {
                size,
                limit,
                sector,
            }
            .into(),
            other => NodeError::Internal(other.to_string()),
        })?;
        let grown = self.backend.expand(&rec.id, target)?;
        rec.capacity_bytes = grown;
        self.state.put(rec.clone())?;
        tracing::info!(volume = %rec.id, size = grown, "backing store grown by NodeExpandVolume");
        Ok(())
    }

    /// Where stats and expansion of `path` are answered, decided once:
    /// from the guest when the records say the publication there is
    /// deferred (or handed over), or the request asks for it (then `path`
    /// must be such a publication); else on the host, for the staged
    /// device, as raw block or filesystem.
    fn usage_route(&self, rec: &VolumeRecord, path: &Path, requested: bool) -> Result<UsageRoute> {
        let id = &rec.id;
        let published = rec.published.get(path);
        match published {
            Some(p) if p.deferred => return Ok(UsageRoute::Guest),
            Some(_) if requested => {
                return Err(RouteError::HostPublication {
                    volume: id.clone(),
                    path: path.to_path_buf(),
                    call: "NodeGetVolumeStats or NodeExpandVolume",
                }
                .into());
            }
            None if requested => {
                return Err(if rec.staging.as_ref().is_some_and(|s| s.path == path) {
                    RouteError::StagingPathNotTarget {
                        volume: id.clone(),
                        path: path.to_path_buf(),
                    }
                } else {
                    RouteError::NotADeferredPublication {
                        volume: id.clone(),
                        path: path.to_path_buf(),
                    }
                }
                .into());
            }
            _ => {}
        }
        let Some(s) = &rec.staging else {
            return Err(RouteError::NotOnNode { volume: id.clone() }.into());
        };
        if let Some(p) = published {
            if p.handed_over {
                return Err(RouteError::NotOnHost {
                    volume: id.clone(),
                    path: path.to_path_buf(),
                    why: "it was handed to a VM sandbox and returned, and stays unmounted \
                          until a host publication needs it",
                }
                .into());
            }
            return Ok(UsageRoute::Host {
                block: p.block,
                device: s.device.clone(),
            });
        }
        if s.path == path {
            if !s.block && s.host_mount != HostMount::Mounted {
                return Err(RouteError::NotOnHost {
                    volume: id.clone(),
                    path: path.to_path_buf(),
                    why: "its filesystem is left to a pod's runtime (deferred filesystem \
                          operations)",
                }
                .into());
            }
            return Ok(UsageRoute::Host {
                block: s.block,
                device: s.device.clone(),
            });
        }
        Err(RouteError::UnknownPath {
            volume: id.clone(),
            path: path.to_path_buf(),
        }
        .into())
    }

    pub fn node_get_volume_stats(
        &self,
        req: &csi::NodeGetVolumeStatsRequest,
    ) -> Result<csi::NodeGetVolumeStatsResponse> {
        require(&[
            ("volume_id", !req.volume_id.is_empty()),
            ("volume_path", !req.volume_path.is_empty()),
        ])?;
        let rec = self.node_record(&req.volume_id)?;
        let path = lookup_path(&rec, &req.volume_path)?;
        check_staging_hint(&rec, &req.staging_target_path)?;
        if req.defer_fs_ops && !self.cfg.deferral.enabled {
            return Err(NodeError::DeferralUnsupported);
        }
        let (block, device) = match self.usage_route(&rec, &path, req.defer_fs_ops)? {
            UsageRoute::Guest => return self.deferred().stats_deferred(&rec, &path),
            UsageRoute::Host { block, device } => (block, device),
        };
        let mut cond = self.health.condition(&rec);
        let mut usage = Vec::new();
        let mut add_problem = |m: String| {
            if cond.abnormal {
                cond.message = format!("{}; {m}", cond.message);
            } else {
                cond = crate::health::Condition::abnormal(m);
            }
        };
        if block {
            // Measure what is published when the path is the device file.
            let measured = if crust_blockdev::is_block_device(&path) {
                path.clone()
            } else {
                device.clone()
            };
            let key = format!("BLKGETSIZE64 {}", measured.display());
            match self
                .health
                .bounded(&key, move || crust_blockdev::block_device_size(&measured))
            {
                Ok(Ok(size)) => usage.push(csi::VolumeUsage {
                    available: 0,
                    total: size as i64,
                    used: 0,
                    unit: csi::volume_usage::Unit::Bytes as i32,
                }),
                Ok(Err(e)) => add_problem(format!("cannot read the device size: {e}")),
                Err(e) => add_problem(e),
            }
        } else {
            let key = format!("statvfs {}", path.display());
            let p = path.clone();
            match self.health.bounded(&key, move || crust_blockdev::usage(&p)) {
                Ok(Ok(u)) => {
                    usage.push(csi::VolumeUsage {
                        available: u.bytes_available as i64,
                        total: u.bytes_total as i64,
                        used: u.bytes_used as i64,
                        unit: csi::volume_usage::Unit::Bytes as i32,
                    });
                    usage.push(csi::VolumeUsage {
                        available: u.inodes_free as i64,
                        total: u.inodes_total as i64,
                        used: u.inodes_used as i64,
                        unit: csi::volume_usage::Unit::Inodes as i32,
                    });
                }
                Ok(Err(e)) => add_problem(format!("cannot measure usage: {e}")),
                Err(e) => add_problem(e),
            }
        }
        self.metrics.observe_condition(&rec.id, cond.abnormal);
        Ok(csi::NodeGetVolumeStatsResponse {
            usage,
            volume_condition: self.cfg.csi_spec.serves_condition().then(|| cond.into()),
        })
    }

    pub fn node_expand_volume(
        &self,
        req: &csi::NodeExpandVolumeRequest,
    ) -> Result<csi::NodeExpandVolumeResponse> {
        require(&[
            ("volume_id", !req.volume_id.is_empty()),
            ("volume_path", !req.volume_path.is_empty()),
        ])?;
        // NOT_FOUND before any other check (re-read under the guard below).
        let rec = self.node_record(&req.volume_id)?;
        let path = lookup_path(&rec, &req.volume_path)?;
        check_staging_hint(&rec, &req.staging_target_path)?;
        let (required, limit) = match &req.capacity_range {
            Some(r) if r.required_bytes < 0 || r.limit_bytes < 0 => {
                return Err(NodeError::InvalidArgument(
                    "capacity range must not be negative".into(),
                ));
            }
            Some(r) if r.limit_bytes != 0 && r.required_bytes > r.limit_bytes => {
                return Err(NodeError::InvalidArgument(format!(
                    "required_bytes {} is larger than limit_bytes {}",
                    r.required_bytes, r.limit_bytes
                )));
            }
            Some(r) => (r.required_bytes as u64, r.limit_bytes as u64),
            None => (0, 0),
        };
        let cap = match &req.volume_capability {
            Some(c) => Some(Capability::from_proto(c).map_err(NodeError::InvalidArgument)?),
            None => None,
        };
        if req.defer_fs_ops && !self.cfg.deferral.enabled {
            return Err(NodeError::DeferralUnsupported);
        }
        let _guard = self.guards.try_begin(&req.volume_id, "NodeExpandVolume")?;
        let mut rec = self.node_record(&req.volume_id)?;
        if let Some(c) = &cap {
            c.checked_mount_flags(rec.fs_type)?;
        }
        let (recorded_block, device) = match self.usage_route(&rec, &path, req.defer_fs_ops)? {
            UsageRoute::Guest => {
                if cap.as_ref().is_some_and(|c| c.access.is_block()) {
                    return Err(NodeError::InvalidArgument(
                        "deferred filesystem operations cannot expand a raw block volume".into(),
                    ));
                }
                self.grow_backing_on_node(&mut rec, required, limit)?;
                return self
                    .deferred()
                    .expand_deferred(&rec, &path, required, limit);
            }
            UsageRoute::Host { block, device } => (block, device),
        };
        // Block or filesystem: the capability if given, else what the
        // path is (a device node, or a directory with a mount).
        let block = match &cap {
            Some(c) => c.access.is_block(),
            None => {
                let p = path.clone();
                let key = format!("stat {}", path.display());
                match self.health.bounded(&key, move || fs::metadata(&p)) {
                    Ok(Ok(m)) if m.is_dir() => {
                        recorded_block && !crust_blockdev::is_mountpoint(&path).unwrap_or(false)
                    }
                    Ok(Ok(_)) => true,
                    _ => recorded_block,
                }
            }
        };
        if block != recorded_block {
            return Err(NodeError::InvalidArgument(format!(
                "volume {} is used as {} at {}, not as {}",
                rec.id,
                if recorded_block {
                    "raw block"
                } else {
                    "a filesystem"
                },
                path.display(),
                if block { "raw block" } else { "a filesystem" }
            )));
        }
        self.grow_backing_on_node(&mut rec, required, limit)?;
        // Pick up a grown backing store (LOOP_SET_CAPACITY for loop devices).
        let size = refreshed_device_size(&rec.id, &device, required, limit)?;
        if !block {
            let s = rec.staging.as_ref().expect("resolved above");
            let fs = s.fs_type.unwrap_or(rec.fs_type);
            if fs == FsType::Ext4 && !crust_blockdev::can_grow_ext4_online() {
                // The kernel's online ext4 resize needs CAP_SYS_RESOURCE.
                if super::stage::fs_needs_grow(&device, FsType::Ext4)? {
                    return Err(ExpandError::CannotGrowOnline {
                        device: device.clone(),
                    }
                    .into());
                }
            } else {
                crust_blockdev::grow_fs(&device, &s.path, fs).map_err(|e| {
                    NodeError::Internal(format!("growing {fs} on {}: {e}", device.display()))
                })?;
            }
        }
        self.health.forget(&rec.id);
        tracing::info!(volume = %rec.id, size, block, "node expansion done");
        Ok(csi::NodeExpandVolumeResponse {
            capacity_bytes: size as i64,
        })
    }
}
