//! Errors of CreateSnapshot and the group snapshot RPCs (Controller and
//! GroupController services): a name reused for another source, and a
//! copy that could not be made consistent. Wrapped in
//! [`ControllerError`](super::ControllerError); codes in one match here.

use std::path::PathBuf;

use tonic::{Code, Status};

use super::status;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// A snapshot name reused for another source.
    #[error("snapshot {snapshot} already exists for volume {volume}{group}, not for {asked}")]
    SnapshotOfOtherVolume {
        snapshot: String,
        volume: String,
        /// " (in group …)" or empty.
        group: String,
        asked: String,
    },
    #[error("group snapshot {group} already exists for volumes {volumes:?}")]
    GroupOfOtherVolumes { group: String, volumes: Vec<String> },
    #[error("internal error: member {member} of group snapshot {group} is gone")]
    GroupMemberGone { member: String, group: String },
    /// A guest has the volume mounted and would not freeze it.
    #[error(
        "volume {volume} cannot be copied consistently: it is used by a pod's guest and \
         freezing it there failed: {cause}"
    )]
    GuestFreezeFailed { volume: String, cause: String },
    /// A sandbox claims the volume, but through no publication of ours.
    #[error(
        "volume {volume} cannot be copied consistently: {claim}, and no deferred publication \
         of this plugin names the target to freeze it through"
    )]
    NoWayToFreeze { volume: String, claim: String },
    #[error("internal error: volume {volume}: {cause}")]
    HostFreezeFailed { volume: String, cause: String },
    #[error("internal error: flushing {} of volume {volume}: {cause}", device.display())]
    FlushFailed {
        volume: String,
        device: PathBuf,
        cause: String,
    },
    #[error("internal error: snapshot not consistent: {cause}")]
    ThawFailed { cause: String },
    #[error(
        "internal error: snapshot of volume {volume} not consistent: the guest thawed it (time \
         limit {limit:?}) before the copy finished"
    )]
    GuestThawedEarly {
        volume: String,
        limit: std::time::Duration,
    },
    #[error(
        "internal error: snapshot of volume {volume} not consistent: cannot confirm the guest \
         kept it frozen until the copy finished: {cause}"
    )]
    GuestThawUnconfirmed { volume: String, cause: String },
}

impl From<SnapshotError> for Status {
    fn from(e: SnapshotError) -> Status {
        let code = match &e {
            SnapshotError::SnapshotOfOtherVolume { .. }
            | SnapshotError::GroupOfOtherVolumes { .. } => Code::AlreadyExists,
            SnapshotError::GroupMemberGone { .. }
            | SnapshotError::HostFreezeFailed { .. }
            | SnapshotError::FlushFailed { .. }
            | SnapshotError::ThawFailed { .. }
            | SnapshotError::GuestThawedEarly { .. }
            | SnapshotError::GuestThawUnconfirmed { .. } => Code::Internal,
            SnapshotError::GuestFreezeFailed { .. } | SnapshotError::NoWayToFreeze { .. } => {
                Code::FailedPrecondition
            }
        };
        status(code, &e)
    }
}
