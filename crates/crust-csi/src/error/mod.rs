//! Error enums of the three CSI services, mapped to `tonic::Status` with
//! the codes the CSI spec prescribes.
//!
//! Conventions (documented for COs and tests):
//! * the order of checks, in every RPC that names a volume: a required
//!   field left empty is INVALID_ARGUMENT first; then an unknown volume is
//!   NOT_FOUND (before any other check of the request's values); then a
//!   path the request names to *find* the volume at (`volume_path` and
//!   `staging_target_path` of NodeGetVolumeStats and NodeExpandVolume)
//!   where the volume is not is NOT_FOUND, decided from the string alone:
//!   a relative path is never resolved against the plugin's working
//!   directory, it is just a place where no volume is (NodeGetVolumeHealth
//!   reports such a path instead of refusing it). The csi-sanity
//!   conformance suite pins this order;
//! * two exceptions, both the spec's idempotency: DeleteVolume and
//!   NodeUnpublishVolume of an unknown volume answer OK (kubelet retries a
//!   failed unpublish forever, and the volume may be deleted already);
//! * a path the request names as the *place* of an operation (stage,
//!   publish, unstage, unpublish targets) that is relative, has `..` or is
//!   not normalized, an unsupported fsType/access mode/parameter:
//!   INVALID_ARGUMENT (wrong whatever the node's state);
//! * a path whose *state* is wrong (staging directory missing, a file where
//!   a directory is needed, a missing parent of a publish target, something
//!   else mounted there), a volume still staged/published, a filesystem on
//!   the device that is not the requested one: FAILED_PRECONDITION;
//! * unknown volume: NOT_FOUND; another operation in flight on the same
//!   volume: ABORTED; sizes: OUT_OF_RANGE / RESOURCE_EXHAUSTED;
//! * deferred filesystem operations: requested of a plugin started with
//!   `--deferral disabled`, FAILED_PRECONDITION; for raw block access, or
//!   `volume_supplemental_group*` without deferral, INVALID_ARGUMENT; a
//!   second deferred publication of a volume, or mixing deferred and host
//!   publications, FAILED_PRECONDITION; errors of crust_ops keep its code
//!   (a hand-off record no runtime consumed yet: FAILED_PRECONDITION "not
//!   consumed by a runtime yet"; a mount flag that looks like a credential
//!   or a target outside `--allowed-target-prefix`: INVALID_ARGUMENT; a
//!   runtime CLI that timed out: DEADLINE_EXCEEDED; one that failed:
//!   INTERNAL).
//!
//! Variants are named by cause and carry the facts their message needs;
//! each enum maps them to codes in one match. A service's enum may wrap a
//! family of its routes' own errors (the Node service's in `node.rs`, the
//! snapshot RPCs' [`SnapshotError`]), which then keeps its own mapping. Two carry a message instead:
//! `InvalidArgument` (the request's own fault, naming the field) and
//! `Internal` (an unexpected host failure, with what was being done).

use std::path::PathBuf;

use crust_backend::BackendError;
use tonic::{Code, Status};

use crate::caps::{BadMountFlags, FsType};
use crate::guard::Busy;
use crate::state::StateError;

mod node;
pub use node::{ExpandError, NodeError, PathProblem, PublishError, RouteError, StageError};

mod snapshot;
pub(crate) use node::{alias_err, fs_err, mount_err};
pub use snapshot::SnapshotError;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("plugin is not ready: {0}")]
    NotReady(String),
}

impl From<IdentityError> for Status {
    fn from(e: IdentityError) -> Status {
        match e {
            IdentityError::NotReady(_) => status(Code::FailedPrecondition, &e),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("{0} is required")]
    Missing(&'static str),
    /// The request's own fault (a field's value); the message names the field.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("volume {} not found", crust_fs::quote(.0))]
    NotFound(String),
    /// CreateVolume: `limit_bytes` is below the smallest volume possible.
    #[error(
        "cannot create a volume of at most {limit} bytes: the smallest volume possible here \
         is {min} bytes"
    )]
    LimitBelowMinimum { limit: u64, min: u64 },
    #[error(
        "no size between {size} and {limit} bytes is a multiple of the {sector}-byte sector size"
    )]
    NoSectorMultiple { size: u64, limit: u64, sector: u64 },
    /// A restore or clone must be at least as large as its source.
    #[error("limit_bytes {limit} is smaller than the source ({source_bytes} bytes)")]
    LimitBelowSource { limit: u64, source_bytes: u64 },
    #[error("volume {volume} is {current} bytes, above limit_bytes {limit}; volumes cannot shrink")]
    CannotShrink {
        volume: String,
        current: u64,
        limit: u64,
    },
    /// Volumes and snapshots live on the node that creates them.
    #[error("none of the requisite topologies is this node ({key}={node}); {rule}")]
    OtherTopology {
        key: String,
        node: String,
        rule: &'static str,
    },
    /// A retried CreateVolume whose name exists with other arguments.
    #[error(
        "volume {name:?} already exists with different fsType, parameters, capabilities or \
         content source (fsType {fs_type}, parameters {parameters:?})"
    )]
    ExistsWithOtherArgs {
        name: String,
        fs_type: FsType,
        parameters: std::collections::BTreeMap<String, String>,
    },
    #[error(
        "volume {name:?} already exists with {capacity} bytes, outside the requested range \
         (required {required}, limit {limit})"
    )]
    ExistsWithOtherSize {
        name: String,
        capacity: u64,
        required: u64,
        limit: u64,
    },
    #[error("backing store of volume {name:?} already exists with another size: {cause}")]
    BackingExistsWithOtherSize { name: String, cause: BackendError },
    /// Two names hashed to one volume id.
    #[error(
        "internal error: volume id {id} of name {name:?} collides with existing volume {existing:?}"
    )]
    IdCollision {
        id: String,
        name: String,
        existing: String,
    },
    /// DeleteVolume of a volume a node still uses.
    #[error("volume {volume} is still {use_}; {first} first")]
    InUse {
        volume: String,
        use_: String,
        first: &'static str,
    },
    #[error("volume {volume} is attached as {} and cannot be detached: {reason}", device.display())]
    Undetachable {
        volume: String,
        device: PathBuf,
        reason: String,
    },
    #[error("starting_token {} is not a token this plugin issued", crust_fs::quote(.0))]
    BadToken(String),
    /// A ControllerModifyVolume passed from another node, issued no
    /// later than the volume's latest change (delayed or replayed).
    #[error(
        "volume {volume}: this ModifyVolume was issued at {issued_ms} (Unix ms), not after the volume's latest change at {latest_ms}; send a new one"
    )]
    Superseded {
        volume: String,
        issued_ms: i64,
        latest_ms: i64,
    },
    /// CreateVolume's or ControllerModifyVolume's mutable parameters.
    #[error(transparent)]
    BadIoLimits(#[from] crust_handoff::QosError),
    /// ControllerModifyVolume: recorded, but the guest using the volume
    /// did not take the limits live; the runtime's code is kept.
    #[error(
        "volume {volume}: the new I/O limits are recorded (every later plug applies them), but \
         the guest using it at {} did not take them: {cause}", target.display()
    )]
    LimitsNotApplied {
        volume: String,
        target: PathBuf,
        cause: Box<crust_ops::OpsError>,
    },
    /// A capability's mount flags outside the allow-list.
    #[error(transparent)]
    BadMountFlags(#[from] BadMountFlags),
    #[error(transparent)]
    Busy(#[from] Busy),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    State(#[from] StateError),
    /// CreateSnapshot and the group snapshot RPCs; their codes are the family's.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
}

impl From<ControllerError> for Status {
    fn from(e: ControllerError) -> Status {
        let code = match &e {
            ControllerError::Snapshot(_) => {
                let ControllerError::Snapshot(f) = e else {
                    unreachable!()
                };
                return f.into();
            }
            ControllerError::Missing(_)
            | ControllerError::InvalidArgument(_)
            | ControllerError::BadMountFlags(_)
            | ControllerError::BadIoLimits(_) => Code::InvalidArgument,
            ControllerError::NotFound(_) => Code::NotFound,
            ControllerError::ExistsWithOtherArgs { .. }
            | ControllerError::ExistsWithOtherSize { .. }
            | ControllerError::BackingExistsWithOtherSize { .. } => Code::AlreadyExists,
            ControllerError::InUse { .. } | ControllerError::Undetachable { .. } => {
                Code::FailedPrecondition
            }
            ControllerError::LimitBelowMinimum { .. }
            | ControllerError::NoSectorMultiple { .. }
            | ControllerError::LimitBelowSource { .. }
            | ControllerError::CannotShrink { .. } => Code::OutOfRange,
            ControllerError::OtherTopology { .. } => Code::ResourceExhausted,
            ControllerError::BadToken(_)
            | ControllerError::Busy(_)
            | ControllerError::Superseded { .. } => Code::Aborted,
            ControllerError::Backend(b) => backend_code(b),
            // The request was good: a record or argument the runtime
            // refused is the node's state, not the caller's fault.
            ControllerError::LimitsNotApplied { cause, .. } => match cause.code() {
                Code::InvalidArgument | Code::NotFound => Code::Internal,
                c => c,
            },
            ControllerError::IdCollision { .. } | ControllerError::State(_) => Code::Internal,
        };
        status(code, &e)
    }
}

/// Every message leaves through the one sanitizer (control characters
/// escaped, bounded): a caller's string that an echo site forgot to quote
/// still cannot carry raw bytes or kilobytes back.
fn status(code: Code, e: &dyn std::fmt::Display) -> Status {
    Status::new(
        code,
        crust_fs::sanitize(&e.to_string(), crust_fs::MESSAGE_MAX),
    )
}

fn backend_code(e: &BackendError) -> Code {
    match e {
        BackendError::NotFound(_) => Code::NotFound,
        BackendError::SizeMismatch { .. } => Code::AlreadyExists,
        BackendError::Exhausted { .. } => Code::ResourceExhausted,
        BackendError::OutOfRange(..) | BackendError::Shrink { .. } => Code::OutOfRange,
        BackendError::Invalid(_) => Code::InvalidArgument,
        BackendError::Unsupported { .. } => Code::Unimplemented,
        BackendError::SnapshotNotFound(_) => Code::NotFound,
        BackendError::SnapshotConflict { .. } => Code::AlreadyExists,
        BackendError::Device(_) | BackendError::Io { .. } => Code::Internal,
    }
}

/// Why a ControllerModifyVolume passed between nodes' plugins failed
/// (`crate::peer`), on either side.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The shared key is missing or unusable (its Secret not created yet).
    #[error("{0} (the Secret crust-csi-peer-key: README, Install on Kubernetes)")]
    Key(#[from] crust_peer_seal::KeyError),
    /// A request this node received and refused.
    #[error("peer request refused: {0}")]
    Refused(#[from] crust_peer_seal::Refusal),
    /// A host failure on this side (no random bytes, a panicked read).
    #[error("{0}")]
    Internal(String),
    /// `--peers` gave no address to ask.
    #[error("volume {volume} is not on node {node}, and no other node could be asked: {reason}")]
    NoPeers {
        volume: String,
        node: String,
        reason: String,
    },
    /// Every node asked answered that it does not have the volume.
    #[error("volume {volume} is on none of the {asked} nodes' plugins asked from node {node}")]
    Nowhere {
        volume: String,
        node: String,
        asked: usize,
    },
    /// Some nodes did not answer, and the owner may be one of them.
    #[error(
        "volume {volume} is not on node {node}, and {unanswered} of the {asked} nodes' plugins asked did not answer (the owner may be one of them): {detail}"
    )]
    Unanswered {
        volume: String,
        node: String,
        asked: usize,
        unanswered: usize,
        detail: String,
    },
    /// The owner's plugin answered with an error: its code is the answer.
    #[error("node {node}'s plugin ({address}), which has the volume: {message}")]
    Owner {
        address: String,
        node: String,
        code: Code,
        message: String,
    },
    /// More than one node says it has the volume.
    #[error("volume {volume} is on more than one node: {nodes}")]
    ManyOwners { volume: String, nodes: String },
}

impl PeerError {
    /// The status a refused sender gets: the receiver's own key problem
    /// (its path, its length) stays in the receiver's log.
    pub fn for_the_sender(self) -> Status {
        match self {
            PeerError::Key(_) => Status::unauthenticated(
                "the receiving node's peer key is not usable (its log says why)",
            ),
            e => e.into(),
        }
    }
}

impl From<PeerError> for Status {
    fn from(e: PeerError) -> Status {
        let code = match &e {
            PeerError::Key(_) => Code::FailedPrecondition,
            PeerError::Refused(crust_peer_seal::Refusal::Flooded) => Code::ResourceExhausted,
            PeerError::Refused(_) => Code::Unauthenticated,
            PeerError::Internal(_) | PeerError::ManyOwners { .. } => Code::Internal,
            PeerError::NoPeers { .. } | PeerError::Unanswered { .. } => Code::Unavailable,
            PeerError::Nowhere { .. } => Code::NotFound,
            PeerError::Owner { code, .. } => *code,
        };
        status(code, &e)
    }
}

/// Errors that stop the server from starting or running.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("socket {path}: {reason}")]
    Socket { path: String, reason: String },
    #[error(transparent)]
    State(#[from] StateError),
    #[error("backend: {0}")]
    Backend(String),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("deferral (crust_ops): {0}")]
    Ops(#[from] crust_ops::OpsError),
    #[error("metrics endpoint {address}: {source}")]
    Metrics {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("peer endpoint {address}: {source}")]
    Peer {
        address: String,
        #[source]
        source: std::io::Error,
    },
}

/// Why a handover or hand-back failed (the codes: `crate::handover`'s
/// module doc).
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("{0} is required")]
    Missing(&'static str),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("the handover service answers root only (the caller is uid {0})")]
    NotRoot(u32),
    #[error(transparent)]
    Busy(#[from] Busy),
    #[error("volume {volume} is in sandbox {sandbox}'s guest: {detail}")]
    HeldBySandbox {
        volume: String,
        sandbox: String,
        detail: String,
    },
    #[error("deferral was required but the volume cannot be handed over: {0}")]
    Required(String),
    #[error("volume {volume} was handed to sandbox {holder}, not to {caller}; nothing was changed")]
    WrongSandbox {
        volume: String,
        holder: String,
        caller: String,
    },
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error(transparent)]
    State(#[from] StateError),
}

impl From<HandoverError> for Status {
    fn from(e: HandoverError) -> Status {
        let code = match &e {
            HandoverError::Missing(_) | HandoverError::InvalidArgument(_) => Code::InvalidArgument,
            HandoverError::NotRoot(_) => Code::PermissionDenied,
            HandoverError::Busy(_) => Code::Aborted,
            HandoverError::HeldBySandbox { .. }
            | HandoverError::Required(_)
            | HandoverError::WrongSandbox { .. } => Code::FailedPrecondition,
            HandoverError::State(_) => Code::Internal,
            HandoverError::Node(_) => {
                let HandoverError::Node(n) = e else {
                    unreachable!()
                };
                return n.into();
            }
        };
        Status::new(
            code,
            crust_fs::sanitize(&e.to_string(), crust_fs::MESSAGE_MAX),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Variants named by cause keep the messages the former strings had.
    #[test]
    fn cause_variants_keep_their_messages() {
        let s: Status = StageError::StagedWithOtherDeferral {
            volume: "vol-a".into(),
            path: "/st".into(),
            deferred: true,
        }
        .into();
        assert_eq!(s.code(), Code::AlreadyExists);
        assert_eq!(
            s.message(),
            "volume vol-a is already staged at /st with deferred filesystem operations \
             (deferFsOps=true); unstage it first to change that"
        );
        let s: Status = SnapshotError::GuestThawedEarly {
            volume: "vol-b".into(),
            limit: std::time::Duration::from_secs(60),
        }
        .into();
        assert_eq!(s.code(), Code::Internal);
        assert_eq!(
            s.message(),
            "internal error: snapshot of volume vol-b not consistent: the guest thawed it (time \
             limit 60s) before the copy finished"
        );
        let s: Status = ExpandError::DeviceTooSmall {
            volume: "vol-c".into(),
            device: "/dev/loop9".into(),
            size: 10,
            required: 20,
        }
        .into();
        assert_eq!(s.code(), Code::OutOfRange);
        assert_eq!(
            s.message(),
            "device /dev/loop9 of volume vol-c is 10 bytes, less than the 20 bytes requested; \
             expand the volume with ControllerExpandVolume first"
        );
    }

    #[test]
    fn codes_follow_the_spec() {
        let s: Status = ControllerError::Busy(Busy {
            volume: "vol-x".into(),
            running: "CreateVolume",
        })
        .into();
        assert_eq!(s.code(), Code::Aborted);
        assert!(
            s.message()
                .contains("CreateVolume already in progress for volume vol-x")
        );
        let s: Status = ControllerError::Backend(BackendError::Exhausted {
            requested: 10,
            available: 1,
        })
        .into();
        assert_eq!(s.code(), Code::ResourceExhausted);
        let s: Status = NodeError::DeferralUnsupported.into();
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(
            s.message()
                .starts_with("deferral not supported by this plugin configuration")
        );
        let s: Status = NodeError::DeferralUnsupported.into();
        assert!(
            s.message()
                .contains("plugin does not support deferred filesystem operations")
        );
        let s: Status = NodeError::Ops(crust_ops::OpsError::NotConsumed("/t".into())).into();
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().contains("not consumed by a runtime yet"));
        // Errors named by cause: one code each, the message a user reads.
        let s: Status = NodeError::StagedElsewhere {
            volume: "v".into(),
            staged: "/s/a".into(),
            asked: "/s/b".into(),
        }
        .into();
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert_eq!(s.message(), "volume v is staged at /s/a, not at /s/b");
        let s: Status = PublishError::StagedForOtherAccess {
            volume: "v".into(),
            staged_block: true,
        }
        .into();
        assert_eq!(
            s.message(),
            "volume v is staged for raw block access; it cannot be published for filesystem access"
        );
        let s: Status = NodeError::ForeignMount {
            field: "target_path",
            path: "/t".into(),
            what: "tmpfs (tmpfs)".into(),
            volume: Some("v".into()),
        }
        .into();
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().starts_with(
            "target_path /t has tmpfs (tmpfs) mounted on it, which is not volume v's publication"
        ));
        let s: Status = NodeError::ForeignMount {
            field: "staging_target_path",
            path: "/s".into(),
            what: "/dev/x".into(),
            volume: None,
        }
        .into();
        assert_eq!(
            s.message(),
            "staging_target_path /s already has /dev/x mounted on it"
        );
        let s: Status = StageError::WouldOverwrite {
            volume: "v".into(),
            found: "holds xfs filesystem, not ext4".into(),
            refused: "format or mount it".into(),
        }
        .into();
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert_eq!(
            s.message(),
            "volume v holds xfs filesystem, not ext4; refusing to format or mount it"
        );
        let s: Status = IdentityError::NotReady("pool dir gone".into()).into();
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().contains("pool dir gone"));
    }
}
