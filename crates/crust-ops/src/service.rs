//! The gRPC edge: proto <-> typed requests, [`OpsError`] -> `Status`.

use std::sync::Arc;
use std::time::Duration;

use crust_handoff::FsGroupChangePolicy;
use crust_handoff::qos::IoLimits;
use crust_proto::runtime::v1alpha1 as pb;
use pb::runtime_server::{Runtime, RuntimeServer};
use tonic::{Request, Response, Status};

use crate::error::OpsError;
use crate::ops::{CrustOps, ExpandRequest, LimitsApplied, StageRequest};
use crate::parse::{UsageUnit, VolumeStats};

/// Checks and converts a wire stage request. Only BLOCK volumes.
pub fn stage_request_from_proto(
    r: pb::RuntimeStageVolumeRequest,
) -> Result<StageRequest, OpsError> {
    use pb::volume_type::Type;
    let t = r.volume_type.map(|v| v.r#type).unwrap_or_default();
    match Type::try_from(t) {
        Ok(Type::Block) => {}
        Ok(Type::Network) => {
            return Err(OpsError::InvalidArgument(
                "volume_type NETWORK is not supported: crust_ops hands off block devices only"
                    .into(),
            ));
        }
        Ok(Type::Unknown) => {
            return Err(OpsError::InvalidArgument(
                "volume_type is required (BLOCK)".into(),
            ));
        }
        Err(_) => {
            return Err(OpsError::InvalidArgument(format!(
                "volume_type {t} is unknown"
            )));
        }
    }
    if r.volume_target_path.is_empty() {
        return Err(OpsError::InvalidArgument(
            "volume_target_path is required".into(),
        ));
    }
    if r.volume_backing_path.is_empty() {
        return Err(OpsError::InvalidArgument(
            "volume_backing_path is required".into(),
        ));
    }
    if r.fs_type.is_empty() {
        return Err(OpsError::InvalidArgument("fs_type is required".into()));
    }
    let fs_group =
        match r.volume_supplemental_group.as_str() {
            "" => None,
            g => Some(crust_handoff::validate::parse_fs_group(g).map_err(|e| {
                OpsError::InvalidArgument(format!("volume_supplemental_group: {e}"))
            })?),
        };
    use pb::volume_group_change_policy::Policy;
    let p = r
        .volume_supplemental_group_change_policy
        .map(|p| p.policy)
        .unwrap_or_default();
    let fs_group_change_policy = match Policy::try_from(p) {
        Ok(Policy::Unknown) => None,
        Ok(Policy::Always) => Some(FsGroupChangePolicy::Always),
        Ok(Policy::OnRootMismatch) => Some(FsGroupChangePolicy::OnRootMismatch),
        Err(_) => {
            return Err(OpsError::InvalidArgument(format!(
                "volume_supplemental_group_change_policy {p} is unknown"
            )));
        }
    };
    Ok(StageRequest {
        target_path: r.volume_target_path,
        device: r.volume_backing_path,
        fs_type: r.fs_type,
        mount_flags: r.mount_flags,
        fs_group,
        fs_group_change_policy,
        // The KEP's request has no limits: set later by set_io_limits.
        io_limits: Default::default(),
    })
}

pub fn expand_request_from_proto(
    r: pb::RuntimeExpandVolumeRequest,
) -> Result<ExpandRequest, OpsError> {
    if r.volume_target_path.is_empty() {
        return Err(OpsError::InvalidArgument(
            "volume_target_path is required".into(),
        ));
    }
    let range = r.capacity_range.unwrap_or_default();
    let non_negative = |name: &str, v: i64| {
        u64::try_from(v).map_err(|_| OpsError::InvalidArgument(format!("{name} is negative")))
    };
    Ok(ExpandRequest {
        target_path: r.volume_target_path,
        required_bytes: non_negative("required_bytes", range.required_bytes)?,
        limit_bytes: non_negative("limit_bytes", range.limit_bytes)?,
    })
}

pub fn stats_to_proto(s: VolumeStats) -> pb::RuntimeGetVolumeStatsResponse {
    use pb::volume_usage::Unit;
    pb::RuntimeGetVolumeStatsResponse {
        usage: s
            .usage
            .into_iter()
            .map(|u| pb::VolumeUsage {
                // parse guarantees every value fits in i64.
                available: u.available as i64,
                total: u.total as i64,
                used: u.used as i64,
                unit: match u.unit {
                    UsageUnit::Unknown => Unit::Unknown,
                    UsageUnit::Bytes => Unit::Bytes,
                    UsageUnit::Inodes => Unit::Inodes,
                } as i32,
            })
            .collect(),
        volume_condition: s.condition.map(|c| pb::VolumeCondition {
            abnormal: c.abnormal,
            message: c.message,
        }),
    }
}

/// Longest freeze a caller may ask for: the one limit every door checks
/// ([`crust_agent_proto::MAX_FROZEN_MS`]).
pub const MAX_FREEZE: Duration = Duration::from_millis(crust_agent_proto::MAX_FROZEN_MS);

/// Checks a wire freeze request: (target, time limit).
pub fn freeze_request_from_proto(
    r: pb::RuntimeFreezeVolumeRequest,
) -> Result<(String, Duration), OpsError> {
    required(&r.volume_target_path)?;
    let limit = crust_agent_proto::freeze_limit(r.max_frozen_ms)
        .map_err(|e| OpsError::InvalidArgument(e.to_string()))?;
    Ok((r.volume_target_path, limit))
}

/// Checks a wire I/O-limits request: (target, limits), the keys read as
/// CSI's mutable parameters are.
pub fn io_limits_request_from_proto(
    r: pb::RuntimeSetVolumeIoLimitsRequest,
) -> Result<(String, IoLimits), OpsError> {
    required(&r.volume_target_path)?;
    let params: std::collections::BTreeMap<String, String> = r.io_limits.into_iter().collect();
    let limits =
        IoLimits::from_params(&params).map_err(|e| OpsError::InvalidArgument(e.to_string()))?;
    Ok((r.volume_target_path, limits))
}

fn required(path: &str) -> Result<(), OpsError> {
    if path.is_empty() {
        return Err(OpsError::InvalidArgument(
            "volume_target_path is required".into(),
        ));
    }
    Ok(())
}

/// `Runtime` over a shared [`CrustOps`].
#[derive(Clone)]
pub struct RuntimeService {
    ops: Arc<CrustOps>,
}

impl RuntimeService {
    pub fn new(ops: Arc<CrustOps>) -> Self {
        RuntimeService { ops }
    }

    pub fn into_server(self) -> RuntimeServer<Self> {
        RuntimeServer::new(self)
    }

    /// Runs one synchronous crust_ops operation (file I/O, a runtime CLI)
    /// on the blocking pool; its error becomes the status.
    async fn call<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&CrustOps) -> Result<T, OpsError> + Send + 'static,
    ) -> Result<T, Status> {
        let ops = self.ops.clone();
        tokio::task::spawn_blocking(move || f(&ops))
            .await
            .map_err(|e| Status::internal(format!("{op}: {e}")))?
            .map_err(|e| log_err(op, e))
    }
}

fn log_err(op: &str, e: OpsError) -> Status {
    tracing::warn!(op, code = ?e.code(), error = %e, "request failed");
    e.into()
}

#[tonic::async_trait]
impl Runtime for RuntimeService {
    async fn runtime_stage_volume(
        &self,
        request: Request<pb::RuntimeStageVolumeRequest>,
    ) -> Result<Response<pb::RuntimeStageVolumeResponse>, Status> {
        let req =
            stage_request_from_proto(request.into_inner()).map_err(|e| log_err("stage", e))?;
        self.call("stage", move |ops| ops.stage(req)).await?;
        Ok(Response::new(pb::RuntimeStageVolumeResponse {}))
    }

    async fn runtime_unstage_volume(
        &self,
        request: Request<pb::RuntimeUnstageVolumeRequest>,
    ) -> Result<Response<pb::RuntimeUnstageVolumeResponse>, Status> {
        let target = request.into_inner().volume_target_path;
        required(&target).map_err(|e| log_err("unstage", e))?;
        self.call("unstage", move |ops| ops.unstage(&target))
            .await?;
        Ok(Response::new(pb::RuntimeUnstageVolumeResponse {}))
    }

    async fn runtime_get_volume_stats(
        &self,
        request: Request<pb::RuntimeGetVolumeStatsRequest>,
    ) -> Result<Response<pb::RuntimeGetVolumeStatsResponse>, Status> {
        let target = request.into_inner().volume_target_path;
        required(&target).map_err(|e| log_err("stats", e))?;
        let stats = self.call("stats", move |ops| ops.stats(&target)).await?;
        Ok(Response::new(stats_to_proto(stats)))
    }

    async fn runtime_expand_volume(
        &self,
        request: Request<pb::RuntimeExpandVolumeRequest>,
    ) -> Result<Response<pb::RuntimeExpandVolumeResponse>, Status> {
        let req =
            expand_request_from_proto(request.into_inner()).map_err(|e| log_err("expand", e))?;
        let capacity = self.call("expand", move |ops| ops.expand(req)).await?;
        Ok(Response::new(pb::RuntimeExpandVolumeResponse {
            capacity_bytes: capacity as i64,
        }))
    }

    async fn runtime_freeze_volume(
        &self,
        request: Request<pb::RuntimeFreezeVolumeRequest>,
    ) -> Result<Response<pb::RuntimeFreezeVolumeResponse>, Status> {
        let (target, limit) =
            freeze_request_from_proto(request.into_inner()).map_err(|e| log_err("freeze", e))?;
        self.call("freeze", move |ops| ops.freeze(&target, limit))
            .await?;
        Ok(Response::new(pb::RuntimeFreezeVolumeResponse {}))
    }

    async fn runtime_thaw_volume(
        &self,
        request: Request<pb::RuntimeThawVolumeRequest>,
    ) -> Result<Response<pb::RuntimeThawVolumeResponse>, Status> {
        let target = request.into_inner().volume_target_path;
        required(&target).map_err(|e| log_err("thaw", e))?;
        let stayed_frozen = self.call("thaw", move |ops| ops.thaw(&target)).await?;
        Ok(Response::new(pb::RuntimeThawVolumeResponse {
            stayed_frozen,
        }))
    }

    async fn runtime_set_volume_io_limits(
        &self,
        request: Request<pb::RuntimeSetVolumeIoLimitsRequest>,
    ) -> Result<Response<pb::RuntimeSetVolumeIoLimitsResponse>, Status> {
        let (target, limits) = io_limits_request_from_proto(request.into_inner())
            .map_err(|e| log_err("set I/O limits", e))?;
        let applied = self
            .call("set I/O limits", move |ops| {
                ops.set_io_limits(&target, &limits)
            })
            .await?;
        Ok(Response::new(pb::RuntimeSetVolumeIoLimitsResponse {
            applied_live: applied == LimitsApplied::Live,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn stage_req() -> pb::RuntimeStageVolumeRequest {
        pb::RuntimeStageVolumeRequest {
            volume_type: Some(pb::VolumeType {
                r#type: pb::volume_type::Type::Block as i32,
            }),
            volume_target_path: "/t/mount".into(),
            volume_backing_path: "/dev/loop3".into(),
            fs_type: "ext4".into(),
            mount_flags: vec!["noatime".into()],
            volume_supplemental_group: "100".into(),
            volume_supplemental_group_change_policy: Some(pb::VolumeGroupChangePolicy {
                policy: pb::volume_group_change_policy::Policy::OnRootMismatch as i32,
            }),
        }
    }

    #[test]
    fn stage_conversion() {
        let r = stage_request_from_proto(stage_req()).unwrap();
        assert_eq!(r.fs_group, Some(100));
        assert_eq!(
            r.fs_group_change_policy,
            Some(FsGroupChangePolicy::OnRootMismatch)
        );
        assert_eq!(
            r.mount_info().to_json(),
            r#"{"volume-type":"block","device":"/dev/loop3","fstype":"ext4","metadata":{"fsGroup":"100","fsGroupChangePolicy":"OnRootMismatch"},"options":["noatime"]}"#
        );
        let mut plain = stage_req();
        plain.volume_supplemental_group.clear();
        plain.volume_supplemental_group_change_policy = None;
        let r = stage_request_from_proto(plain).unwrap();
        assert_eq!((r.fs_group, r.fs_group_change_policy), (None, None));
    }

    #[test]
    fn stage_conversion_rejects() {
        type Mutation = Box<dyn Fn(&mut pb::RuntimeStageVolumeRequest)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (
                Box::new(|r| r.volume_type = None),
                "volume_type is required",
            ),
            (
                Box::new(|r| r.volume_type = Some(pb::VolumeType { r#type: 2 })),
                "NETWORK",
            ),
            (
                Box::new(|r| r.volume_type = Some(pb::VolumeType { r#type: 9 })),
                "unknown",
            ),
            (
                Box::new(|r| r.volume_target_path.clear()),
                "volume_target_path",
            ),
            (
                Box::new(|r| r.volume_backing_path.clear()),
                "volume_backing_path",
            ),
            (Box::new(|r| r.fs_type.clear()), "fs_type"),
            (
                Box::new(|r| r.volume_supplemental_group = "-1".into()),
                "supplemental_group",
            ),
            (
                Box::new(|r| r.volume_supplemental_group = "users".into()),
                "supplemental_group",
            ),
            (
                Box::new(|r| r.volume_supplemental_group = "4294967296".into()),
                "32 bits",
            ),
            (
                Box::new(|r| {
                    r.volume_supplemental_group_change_policy =
                        Some(pb::VolumeGroupChangePolicy { policy: 7 })
                }),
                "change_policy 7",
            ),
        ];
        for (mutate, why) in cases {
            let mut r = stage_req();
            mutate(&mut r);
            let e = stage_request_from_proto(r).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(e.to_string().contains(why), "{e} (wanted {why})");
        }
    }

    #[test]
    fn expand_conversion() {
        let r = expand_request_from_proto(pb::RuntimeExpandVolumeRequest {
            volume_target_path: "/t".into(),
            capacity_range: None,
        })
        .unwrap();
        assert_eq!((r.required_bytes, r.limit_bytes), (0, 0));
        for (req, lim) in [(-1, 0), (0, -1)] {
            let e = expand_request_from_proto(pb::RuntimeExpandVolumeRequest {
                volume_target_path: "/t".into(),
                capacity_range: Some(pb::CapacityRange {
                    required_bytes: req,
                    limit_bytes: lim,
                }),
            })
            .unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
        }
    }

    #[test]
    fn stats_conversion_keeps_units_and_condition() {
        let s = crate::parse::parse_stats(
            br#"{"usage":[{"available":1,"total":3,"used":2,"unit":"BYTES"},{"total":5,"unit":2}],"volume_condition":{"abnormal":true,"message":"bad"}}"#,
        )
        .unwrap();
        let p = stats_to_proto(s);
        assert_eq!(p.usage[0].unit, pb::volume_usage::Unit::Bytes as i32);
        assert_eq!(
            (p.usage[0].available, p.usage[0].total, p.usage[0].used),
            (1, 3, 2)
        );
        assert_eq!(p.usage[1].unit, pb::volume_usage::Unit::Inodes as i32);
        let c = p.volume_condition.unwrap();
        assert!(c.abnormal);
        assert_eq!(c.message, "bad");
    }
}
