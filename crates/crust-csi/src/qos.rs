//! ControllerModifyVolume: a volume's I/O limits (`crust_handoff::qos`
//! names the keys), changed while a pod may be using it.
//!
//! The limits are merged into the volume's record (a key given replaces
//! its value, `0` lifts it; bad keys or values: INVALID_ARGUMENT, nothing
//! changed), then, for a volume a guest may be using (a deferred
//! publication, or a handover in force), written into its hand-off record
//! and applied live by the consuming runtime (crust_ops, `crust
//! throttle`, QMP `block_set_io_throttle`). A volume mounted on the host
//! only keeps them for the next guest: the host's own I/O is not
//! throttled (buffered writeback escapes cgroup v1 block throttling).

use crust_ops::LimitsApplied;
use crust_proto::csi::v1 as csi;

use crate::driver::ControllerParts;
use crate::error::ControllerError;
use crate::records::HandoverPhase;
use crate::records::VolumeRecord;

type Result<T> = std::result::Result<T, ControllerError>;

/// Where a ControllerModifyVolume was issued, for ordering it against
/// the volume's others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Issued {
    /// Through this node's CSI socket, now.
    Here,
    /// Passed from another node, issued at this time of its clock (Unix
    /// ms): refused unless later than the volume's latest change.
    Passed(i64),
}

impl ControllerParts<'_> {
    pub fn controller_modify_volume(&self, req: &csi::ControllerModifyVolumeRequest) -> Result<()> {
        self.modify_volume(req, Issued::Here)
    }

    /// [`Self::controller_modify_volume`] for either door.
    pub fn modify_volume(
        &self,
        req: &csi::ControllerModifyVolumeRequest,
        issued: Issued,
    ) -> Result<()> {
        if req.volume_id.is_empty() {
            return Err(ControllerError::Missing("volume_id"));
        }
        if req.mutable_parameters.is_empty() {
            return Err(ControllerError::Missing("mutable_parameters"));
        }
        // NOT_FOUND before the values are checked (error.rs's order).
        let rec = self.ready_record(&req.volume_id)?;
        rec.io_limits.merged(&req.mutable_parameters)?;
        let _guard = self.guards.try_begin(&rec.id, "ControllerModifyVolume")?;
        let mut rec = self.ready_record(&req.volume_id)?;
        let limits = rec.io_limits.merged(&req.mutable_parameters)?;
        let issued_ms = match issued {
            Issued::Here => crust_peer_seal::now_unix_ms().max(rec.limits_issued_ms),
            Issued::Passed(t) if t <= rec.limits_issued_ms => {
                return Err(ControllerError::Superseded {
                    volume: rec.id,
                    issued_ms: t,
                    latest_ms: rec.limits_issued_ms,
                });
            }
            Issued::Passed(t) => t,
        };
        if limits != rec.io_limits || issued_ms != rec.limits_issued_ms {
            rec.io_limits = limits;
            rec.limits_issued_ms = issued_ms;
            self.state.put(rec.clone())?;
        }
        let applied = self.apply_io_limits(&rec)?;
        tracing::info!(volume = %rec.id, limits = %limits.to_wire(), applied, ?issued, "volume modified");
        Ok(())
    }

    /// Hands the recorded limits to the guest that may use `rec` (the one
    /// routine for every change of them); says where they took effect.
    fn apply_io_limits(&self, rec: &VolumeRecord) -> Result<&'static str> {
        let Some(target) = guest_target(rec) else {
            return Ok("recorded; applied when a guest consumes the volume");
        };
        let t = target.to_str().unwrap_or_default();
        match self.ops.set_io_limits(t, &rec.io_limits) {
            Ok(LimitsApplied::Live) => Ok("live in the guest"),
            Ok(LimitsApplied::AtNextPlug) => Ok("in the hand-off record; applied at the plug"),
            Err(cause) => Err(ControllerError::LimitsNotApplied {
                volume: rec.id.clone(),
                target: target.to_path_buf(),
                cause: Box::new(cause),
            }),
        }
    }
}

/// The target of the hand-off record a guest may consume `rec` through.
fn guest_target(rec: &VolumeRecord) -> Option<&std::path::Path> {
    if let Some((t, _)) = rec.deferred_publication() {
        return Some(t);
    }
    rec.handover
        .as_ref()
        .filter(|h| h.phase == HandoverPhase::HandedOver)
        .map(|h| h.target.as_path())
}
