//! CSI v1.13's volume-health RPCs: NodeGetVolumeHealth,
//! NodeGetStorageHealth, ControllerGetVolumeHealth and
//! ControllerListVolumeHealth. They report the same assessments as the
//! v1.12 condition fields (see [`crate::health`]), typed.
//!
//! * Order of checks (the spec's error table first): a missing volume id
//!   is INVALID_ARGUMENT, an unknown one NOT_FOUND, whatever the paths look
//!   like. Paths are compared with the records as strings (error.rs): a
//!   relative one is never resolved, it is just a path where the volume is
//!   not.
//! * NodeGetVolumeHealth may name paths where the CO only *tried* to stage
//!   or publish: a path where the volume is not staged or published is
//!   reported as INACCESSIBLE (`NotStaged` / `NotPublished`), not as an
//!   error. A deferred publication's health is the guest's, through
//!   crust_ops and the runtime (a runtime that cannot answer is
//!   INACCESSIBLE, `RuntimeUnreachable`).
//! * ControllerListVolumeHealth pages over the volumes like ListVolumes
//!   (same opaque token, ABORTED for a token this plugin did not issue) and
//!   returns only volumes with an adverse condition, as the spec suggests;
//!   a page may therefore hold fewer entries than `max_entries`.
//! * NodeGetStorageHealth reports the backend itself (pool directory and
//!   its filesystem, static devices).

use std::path::Path;

use crust_proto::csi::v1 as csi;

use crate::driver::{ControllerParts, NodeParts};
use crate::error::{ControllerError, NodeError};
use crate::health::{Assessment, Problem, Status};
use crate::node::as_recorded;
use crate::paging::{decode_token, encode_token};
use crate::records::VolumeRecord;

impl NodeParts<'_> {
    pub fn node_get_volume_health(
        &self,
        req: &csi::NodeGetVolumeHealthRequest,
    ) -> Result<csi::NodeGetVolumeHealthResponse, NodeError> {
        if req.volume_id.is_empty() {
            return Err(NodeError::Missing("volume_id"));
        }
        let rec = self.node_record(&req.volume_id)?;
        let publish = Some(req.volume_publish_path.as_str()).filter(|p| !p.is_empty());
        let staging = Some(req.staging_target_path.as_str()).filter(|p| !p.is_empty());
        let mut assessment = self.health.assess(&rec);
        if let Some(p) = staging {
            assessment.problems.extend(staging_problem(&rec, p));
        }
        if let Some(p) = publish {
            assessment
                .problems
                .extend(self.publication_problems(&rec, p));
        }
        self.metrics
            .observe_condition(&rec.id, assessment.is_abnormal());
        Ok(csi::NodeGetVolumeHealthResponse {
            volume_health: Some(assessment.volume_health(&rec.id)),
        })
    }

    pub fn node_get_storage_health(&self) -> Result<csi::NodeGetStorageHealthResponse, NodeError> {
        let backend = self.backend.clone();
        let problems = self
            .health
            .bounded("storage health", move || backend.storage_health())
            .unwrap_or_else(|hung| {
                vec![crust_backend::StorageProblem::unreachable(
                    "Unresponsive",
                    format!("the backend's health probe {hung}"),
                )]
            });
        let backend_health = problems
            .into_iter()
            .map(
                |p| csi::node_get_storage_health_response::StorageBackendHealth {
                    status: if p.unreachable {
                        csi::StorageHealthErrorType::StorageUnreachable
                    } else {
                        csi::StorageHealthErrorType::StorageDegraded
                    } as i32,
                    reason: p.reason.to_string(),
                    message: p.message,
                    volume_capability: None,
                },
            )
            .collect();
        Ok(csi::NodeGetStorageHealthResponse { backend_health })
    }

    /// What `path` (a publish path the CO names) says about the volume:
    /// nothing more for a host publication (its mount is checked in the
    /// assessment), the guest's view for a deferred one, INACCESSIBLE when
    /// the volume is not published there.
    fn publication_problems(&self, rec: &VolumeRecord, path: &str) -> Vec<Problem> {
        let found = as_recorded(path).and_then(|p| rec.published.get(&p).map(|x| (x.deferred, p)));
        match found {
            Some((true, p)) => self.deferred_problems(rec, &p),
            Some(_) => Vec::new(),
            None => vec![Problem::new(
                Status::Inaccessible,
                "NotPublished",
                format!("volume {} is not published at {path} on this node", rec.id),
            )],
        }
    }

    /// The guest's view of a deferred publication, through crust_ops and
    /// the runtime that consumed it.
    fn deferred_problems(&self, rec: &VolumeRecord, target: &Path) -> Vec<Problem> {
        let Some(t) = target.to_str() else {
            return Vec::new();
        };
        match self.deferred().deferred_condition(t) {
            Ok(None) => Vec::new(),
            Ok(Some(c)) if !c.abnormal => Vec::new(),
            Ok(Some(c)) => vec![Problem::new(
                Status::Degraded,
                "GuestReportedAbnormal",
                format!("the pod's guest reports: {}", c.message),
            )],
            Err(e) => vec![Problem::new(
                Status::Inaccessible,
                "RuntimeUnreachable",
                format!(
                    "cannot learn the health of volume {} from the runtime using it at {}: {e}",
                    rec.id,
                    target.display()
                ),
            )],
        }
    }
}

impl ControllerParts<'_> {
    pub fn controller_get_volume_health(
        &self,
        req: &csi::ControllerGetVolumeHealthRequest,
    ) -> Result<csi::ControllerGetVolumeHealthResponse, ControllerError> {
        if req.volume_id.is_empty() {
            return Err(ControllerError::Missing("volume_id"));
        }
        let rec = self.ready_record(&req.volume_id)?;
        let assessment = self.controller_assessment(&rec);
        Ok(csi::ControllerGetVolumeHealthResponse {
            volume_health: Some(assessment.volume_health(&rec.id)),
        })
    }

    pub fn controller_list_volume_health(
        &self,
        req: &csi::ControllerListVolumeHealthRequest,
    ) -> Result<csi::ControllerListVolumeHealthResponse, ControllerError> {
        if req.max_entries < 0 {
            return Err(ControllerError::InvalidArgument(format!(
                "max_entries must not be negative (got {})",
                req.max_entries
            )));
        }
        let after = match req.starting_token.as_str() {
            "" => None,
            t => Some(decode_token(t)?),
        };
        let (page, more) = self.state.page(after.as_deref(), req.max_entries as usize);
        let next_token = match (more, page.last()) {
            (true, Some(last)) => encode_token(&last.id),
            _ => String::new(),
        };
        let assessments = self.health.assessments(&page);
        let entries = page
            .iter()
            .zip(assessments)
            .filter(|(_, a)| a.is_abnormal())
            .map(|(rec, a)| a.volume_health(&rec.id))
            .collect();
        Ok(csi::ControllerListVolumeHealthResponse {
            entries,
            next_token,
        })
    }

    /// The volume as the controller sees it: the host's signals.
    fn controller_assessment(&self, rec: &VolumeRecord) -> Assessment {
        self.health.assess(rec)
    }
}

fn staging_problem(rec: &VolumeRecord, path: &str) -> Option<Problem> {
    match (as_recorded(path), &rec.staging) {
        (Some(p), Some(s)) if s.path == p => None,
        _ => Some(Problem::new(
            Status::Inaccessible,
            "NotStaged",
            format!("volume {} is not staged at {path} on this node", rec.id),
        )),
    }
}
