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
//! each enum maps them to codes in one match. Two carry a message instead:
//! `InvalidArgument` (the request's own fault, naming the field) and
//! `Internal` (an unexpected host failure, with what was being done).

use std::path::{Path, PathBuf};

use crust_backend::BackendError;
use tonic::{Code, Status};

use crate::caps::{AccessMode, BadMountFlags, FsType};
use crate::guard::Busy;
use crate::state::StateError;

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
}

impl From<ControllerError> for Status {
    fn from(e: ControllerError) -> Status {
        let code = match &e {
            ControllerError::Missing(_)
            | ControllerError::InvalidArgument(_)
            | ControllerError::BadMountFlags(_)
            | ControllerError::BadIoLimits(_) => Code::InvalidArgument,
            ControllerError::NotFound(_) => Code::NotFound,
            ControllerError::ExistsWithOtherArgs { .. }
            | ControllerError::ExistsWithOtherSize { .. }
            | ControllerError::BackingExistsWithOtherSize { .. }
            | ControllerError::SnapshotOfOtherVolume { .. }
            | ControllerError::GroupOfOtherVolumes { .. } => Code::AlreadyExists,
            ControllerError::GuestFreezeFailed { .. }
            | ControllerError::NoWayToFreeze { .. }
            | ControllerError::InUse { .. }
            | ControllerError::Undetachable { .. } => Code::FailedPrecondition,
            ControllerError::LimitBelowMinimum { .. }
            | ControllerError::NoSectorMultiple { .. }
            | ControllerError::LimitBelowSource { .. }
            | ControllerError::CannotShrink { .. } => Code::OutOfRange,
            ControllerError::OtherTopology { .. } => Code::ResourceExhausted,
            ControllerError::BadToken(_) | ControllerError::Busy(_) => Code::Aborted,
            ControllerError::Backend(b) => backend_code(b),
            // The request was good: a record or argument the runtime
            // refused is the node's state, not the caller's fault.
            ControllerError::LimitsNotApplied { cause, .. } => match cause.code() {
                Code::InvalidArgument | Code::NotFound => Code::Internal,
                c => c,
            },
            ControllerError::IdCollision { .. }
            | ControllerError::GroupMemberGone { .. }
            | ControllerError::HostFreezeFailed { .. }
            | ControllerError::FlushFailed { .. }
            | ControllerError::ThawFailed { .. }
            | ControllerError::GuestThawedEarly { .. }
            | ControllerError::GuestThawUnconfirmed { .. }
            | ControllerError::State(_) => Code::Internal,
        };
        status(code, &e)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0} is required")]
    Missing(&'static str),
    /// The request's own fault (a field's value); the message names the field.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("volume {} not found", crust_fs::quote(.0))]
    NotFound(String),
    /// NodeGetVolumeStats/NodeExpandVolume: the volume is nowhere on this node.
    #[error("volume {volume} is not staged or published on this node")]
    NotOnNode { volume: String },
    #[error("{} is not a staged or published path of volume {volume}", path.display())]
    UnknownPath { volume: String, path: PathBuf },
    /// A stats/expand request's `staging_target_path` where the volume is not staged.
    #[error("volume {volume} is not staged at {}", path.display())]
    NotStagedAt { volume: String, path: PathBuf },
    /// A deferred stats/expand request for a path that is no deferred publication.
    #[error(
        "{} is not a publication of volume {volume} with deferred filesystem operations",
        path.display()
    )]
    NotADeferredPublication { volume: String, path: PathBuf },
    #[error(
        "{} is the staging path of volume {volume}; with deferred filesystem operations, \
         volume_path must be the publish target",
        path.display()
    )]
    StagingPathNotTarget { volume: String, path: PathBuf },
    /// A repeated NodeStageVolume that differs from the first.
    #[error(
        "volume {volume} is already staged at {} with a different capability ({}, {mode:?})",
        path.display(),
        if *.block { "block" } else { "mount" }
    )]
    StagedWithOtherCapability {
        volume: String,
        path: PathBuf,
        block: bool,
        mode: AccessMode,
    },
    #[error(
        "volume {volume} is already staged at {} {} deferred filesystem operations \
         ({}={deferred}); unstage it first to change that",
        path.display(),
        if *.deferred { "with" } else { "without" },
        crate::records::DEFER_CONTEXT_KEY
    )]
    StagedWithOtherDeferral {
        volume: String,
        path: PathBuf,
        deferred: bool,
    },
    /// A repeated NodePublishVolume that differs from the first.
    #[error(
        "volume {volume} is already published at {} with readonly={readonly} and access mode \
         {mode:?}",
        target.display()
    )]
    PublishedWithOtherArgs {
        volume: String,
        target: PathBuf,
        readonly: bool,
        mode: AccessMode,
    },
    #[error(
        "volume {volume} is already published at {} with deferred filesystem operations; a \
         host publication there would differ",
        target.display()
    )]
    PublishedDeferredThere { volume: String, target: PathBuf },
    #[error(
        "volume {volume} is already published at {} with deferred filesystem operations and \
         other options (read-only, access mode, mount flags or supplemental group)",
        target.display()
    )]
    DeferredWithOtherArgs { volume: String, target: PathBuf },
    #[error(
        "volume {volume} is already published at {} on the host (bind mount), not with \
         deferred filesystem operations",
        target.display()
    )]
    PublishedOnHostThere { volume: String, target: PathBuf },
    /// NodeExpandVolume before ControllerExpandVolume grew the device.
    #[error(
        "device {} of volume {volume} is {size} bytes, less than the {required} bytes \
         requested; expand the volume with ControllerExpandVolume first",
        device.display()
    )]
    DeviceTooSmall {
        volume: String,
        device: PathBuf,
        size: u64,
        required: u64,
    },
    #[error("device of volume {volume} is already {size} bytes, above limit_bytes {limit}")]
    DeviceAboveLimit {
        volume: String,
        size: u64,
        limit: u64,
    },
    #[error(
        "no size between {size} and {limit} bytes is a multiple of the {sector}-byte sector size"
    )]
    NoSectorMultiple { size: u64, limit: u64, sector: u64 },
    /// Something other than the volume (or our placeholder) is mounted there.
    #[error(
        "{field} {} has something mounted that is not volume {volume}'s{nothing_done}",
        target.display()
    )]
    TargetHoldsOther {
        volume: String,
        /// How the request names the path ("target", "target_path").
        field: &'static str,
        target: PathBuf,
        /// "; nothing was unmounted" where that must be said.
        nothing_done: &'static str,
    },
    /// A filesystem a guest had raw access to failed its userspace check.
    #[error(
        "volume {volume} came back from a guest{} and failed its check, so the host does not \
         mount it: {cause}",
        if sandbox.is_empty() { String::new() } else { format!(" (sandbox {sandbox})") }
    )]
    ReturnedFsDamaged {
        volume: String,
        sandbox: String,
        cause: Box<crust_blockdev::FsError>,
    },
    /// A mount refused because of the target's or device's state.
    #[error(transparent)]
    MountRefused(Box<crust_blockdev::MountError>),
    /// The device is mounted or open in another process (a sandbox's QEMU).
    #[error(transparent)]
    DeviceInUse(Box<crust_blockdev::FsError>),
    /// The format gate found what no proof overrides (a signature, data
    /// found by its full read) on a device about to be formatted.
    #[error(transparent)]
    FormatRefused(Box<crust_blockdev::FsError>),
    /// Another block device exposes the volume's data (its backing file
    /// attached again, a loop stacked on it, a device-mapper/md holder).
    #[error(transparent)]
    Aliased(Box<crust_blockdev::AliasError>),
    /// A handover's own refusal, met by a node call (NodeUnpublish taking a volume back).
    #[error(transparent)]
    Handover(Box<HandoverError>),
    #[error(
        "volume {volume} lives on node {node:?}, this is node {here:?}: a local volume can only \
         be staged and published on its own node"
    )]
    OtherNode {
        volume: String,
        node: String,
        here: String,
    },
    #[error("volume {volume} is not staged; call NodeStageVolume first")]
    NotStaged { volume: String },
    #[error("volume {volume} is staged at {}, not at {}", staged.display(), asked.display())]
    StagedElsewhere {
        volume: String,
        staged: PathBuf,
        asked: PathBuf,
    },
    #[error(
        "volume {volume} is already staged at {}; unstage it first (one staging path per volume)",
        staged.display()
    )]
    AlreadyStagedElsewhere { volume: String, staged: PathBuf },
    #[error(
        "volume {volume} is staged for {} access; it cannot be published for {} access",
        access_name(*staged_block),
        access_name(!*staged_block)
    )]
    StagedForOtherAccess { volume: String, staged_block: bool },
    #[error(
        "volume {volume} was staged on {} but that device is no longer attached to it \
         (node rebooted?); call NodeStageVolume again",
        device.display()
    )]
    DeviceGone { volume: String, device: PathBuf },
    #[error(
        "volume {volume} is not mounted at its staging path {} (unmounted outside \
         the plugin, or the node rebooted); call NodeStageVolume again",
        path.display()
    )]
    StagingNotMounted { volume: String, path: PathBuf },
    #[error("volume {volume} is still published at {targets:?}; unpublish it first")]
    StillPublished {
        volume: String,
        targets: Vec<PathBuf>,
    },
    /// A sandbox's guest may have the filesystem mounted (`why`): the
    /// host must not probe, check, grow or mount it.
    #[error("volume {volume}: {why}; the host will not check or mount its filesystem")]
    GuestMayHaveFs { volume: String, why: String },
    #[error(
        "volume {volume} is already published at {} and access mode {mode:?} allows \
         only one publish target",
        other.display()
    )]
    SingleTarget {
        volume: String,
        other: PathBuf,
        mode: AccessMode,
    },
    /// A path from the CO is not what the call needs (nothing changed).
    #[error("{field} {} {problem}", path.display())]
    PathState {
        field: &'static str,
        path: PathBuf,
        problem: PathProblem,
    },
    #[error(
        "parent directory {} of target_path does not exist; the CO must create it",
        path.display()
    )]
    MissingParent { path: PathBuf },
    /// A deferred-operations call (`defer_fs_ops`) names a host
    /// publication.
    #[error(
        "volume {volume} is published at {} on the host, not with deferred filesystem \
         operations; call {call} without defer_fs_ops",
        path.display()
    )]
    HostPublication {
        volume: String,
        path: PathBuf,
        call: &'static str,
    },
    /// The volume's filesystem is not mounted on the host: in a pod's
    /// guest, or back from one and not yet checked.
    #[error("volume {volume} is not mounted at {}: {why}", path.display())]
    NotOnHost {
        volume: String,
        path: PathBuf,
        why: &'static str,
    },
    /// The volume was created for the other access type.
    #[error(
        "volume {volume} was created for {} access only; {}",
        access_name(*created_block),
        if *created_block {
            "staging it as a filesystem would format it"
        } else {
            "it cannot be staged as raw block"
        }
    )]
    CreatedForOtherAccess { volume: String, created_block: bool },
    /// The capability's fsType is not the volume's.
    #[error("volume {volume} {has}; the capability asks for {asked}")]
    OtherFsType {
        volume: String,
        has: String,
        asked: FsType,
    },
    /// The volume is in (or promised to) a sandbox's guest through a
    /// deferred publication at `target`: one sandbox at a time, and never
    /// the host as well.
    #[error(
        "volume {volume} is published with deferred filesystem operations at {}: {why}",
        target.display()
    )]
    InGuest {
        volume: String,
        target: PathBuf,
        why: &'static str,
    },
    /// The host has the filesystem mounted (a host publication at
    /// `target`), so no guest may mount it.
    #[error(
        "volume {volume} is mounted on the host and published at {}; its filesystem \
         cannot also be mounted in a sandbox's guest (two kernels mounting one \
         filesystem corrupt it): unpublish the host targets first",
        target.display()
    )]
    OnHost { volume: String, target: PathBuf },
    /// The filesystem is mounted on the host outside the plugin's records.
    #[error(
        "the filesystem of volume {volume} is mounted on the host at {at:?}; \
         it cannot be handed to a sandbox while the host has it mounted"
    )]
    MountedElsewhere { volume: String, at: Vec<PathBuf> },
    /// Something (a sandbox's QEMU) still holds the device.
    #[error(
        "device {} of volume {volume} is still in use (a sandbox that has not \
         stopped?); it cannot be mounted on the host",
        device.display()
    )]
    DeviceHeld { volume: String, device: PathBuf },
    /// A host remount of the staging path needs the stage's own flags.
    #[error(
        "volume {volume} must be mounted again at its staging path {} with the mount \
         flags NodeStageVolume used, which differ from this request's; call \
         NodeStageVolume again",
        staging.display()
    )]
    StageFlagsDiffer { volume: String, staging: PathBuf },
    /// A stage repeated while an orphaned format of an earlier plugin
    /// process still runs on the device.
    #[error(
        "volume {volume}: a format started by an earlier plugin process is still running \
         on {} (the device is in use); retry",
        device.display()
    )]
    FormatRunning { volume: String, device: PathBuf },
    /// The backend's one full read of the volume's device (is it all
    /// zero?) has not finished: a format must wait for its verdict.
    #[error(
        "volume {volume}: crust is reading {} in full to prove it holds no data before \
         formatting it ({done_bytes} of {total_bytes} bytes read); retry later",
        device.display()
    )]
    BlankCheckRunning {
        volume: String,
        device: PathBuf,
        done_bytes: u64,
        total_bytes: u64,
    },
    #[error("volume {volume}: cannot detach {} (still in use?): {reason}", device.display())]
    Undetachable {
        volume: String,
        device: PathBuf,
        reason: String,
    },
    /// Read-only raw block makes the whole device read-only.
    #[error(
        "raw block volume {volume} is already published {} at {}; read-only raw block \
         access makes the whole device read-only, so read-only and read-write \
         publications cannot be mixed",
        if *other_readonly { "read-only" } else { "read-write" },
        other.display()
    )]
    ReadOnlyMix {
        volume: String,
        other: PathBuf,
        other_readonly: bool,
    },
    /// Online ext4 growth needs CAP_SYS_RESOURCE.
    #[error(
        "ext4 on {} cannot be grown while it is mounted: this plugin lacks \
         CAP_SYS_RESOURCE, which online ext4 resize needs; the filesystem is \
         grown automatically the next time the volume is staged (restart the \
         pod using it), or run the plugin with CAP_SYS_RESOURCE",
        device.display()
    )]
    CannotGrowOnline { device: PathBuf },
    /// Something that is not this volume's mount is at a CO path.
    #[error("{}", foreign_mount(field, path, what, volume.as_deref()))]
    ForeignMount {
        field: &'static str,
        path: PathBuf,
        what: String,
        /// The volume whose mount was expected; `None` for a first stage.
        volume: Option<String>,
    },
    /// Data crust must not format over: a raw block volume, a volume crust
    /// formatted that now looks blank, or another filesystem.
    #[error("volume {volume} {found}; refusing to {refused}")]
    WouldOverwrite {
        volume: String,
        found: String,
        refused: String,
    },
    #[error(
        "deferral not supported by this plugin configuration: plugin does not support deferred \
         filesystem operations (started with --deferral disabled); the volume would be mounted \
         on the host instead of in the pod's sandbox, which deferral exists to avoid"
    )]
    DeferralUnsupported,
    /// A capability's mount flags outside the allow-list.
    #[error(transparent)]
    BadMountFlags(#[from] BadMountFlags),
    /// crust_ops (hand-off record, runtime CLI); its code passes through.
    #[error("deferred filesystem operation: {0}")]
    Ops(#[from] crust_ops::OpsError),
    #[error(transparent)]
    Busy(#[from] Busy),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    State(#[from] StateError),
    /// An unexpected failure of the host (I/O), with what was being done.
    #[error("{0}")]
    Internal(String),
}

impl From<NodeError> for Status {
    fn from(e: NodeError) -> Status {
        let code = match &e {
            NodeError::Missing(_) | NodeError::InvalidArgument(_) | NodeError::BadMountFlags(_) => {
                Code::InvalidArgument
            }
            NodeError::NotFound(_)
            | NodeError::NotOnNode { .. }
            | NodeError::UnknownPath { .. }
            | NodeError::NotStagedAt { .. }
            | NodeError::NotADeferredPublication { .. } => Code::NotFound,
            NodeError::StagedWithOtherCapability { .. }
            | NodeError::StagedWithOtherDeferral { .. }
            | NodeError::PublishedWithOtherArgs { .. }
            | NodeError::PublishedDeferredThere { .. }
            | NodeError::DeferredWithOtherArgs { .. }
            | NodeError::PublishedOnHostThere { .. } => Code::AlreadyExists,
            NodeError::StagingPathNotTarget { .. }
            | NodeError::TargetHoldsOther { .. }
            | NodeError::ReturnedFsDamaged { .. }
            | NodeError::MountRefused(_)
            | NodeError::DeviceInUse(_)
            | NodeError::FormatRefused(_)
            | NodeError::Aliased(_)
            | NodeError::Handover(_)
            | NodeError::DeferralUnsupported
            | NodeError::OtherNode { .. }
            | NodeError::NotStaged { .. }
            | NodeError::StagedElsewhere { .. }
            | NodeError::AlreadyStagedElsewhere { .. }
            | NodeError::StagedForOtherAccess { .. }
            | NodeError::DeviceGone { .. }
            | NodeError::StagingNotMounted { .. }
            | NodeError::StillPublished { .. }
            | NodeError::GuestMayHaveFs { .. }
            | NodeError::SingleTarget { .. }
            | NodeError::ForeignMount { .. }
            | NodeError::PathState { .. }
            | NodeError::FormatRunning { .. }
            | NodeError::Undetachable { .. }
            | NodeError::ReadOnlyMix { .. }
            | NodeError::CannotGrowOnline { .. }
            | NodeError::InGuest { .. }
            | NodeError::OnHost { .. }
            | NodeError::MountedElsewhere { .. }
            | NodeError::DeviceHeld { .. }
            | NodeError::StageFlagsDiffer { .. }
            | NodeError::HostPublication { .. }
            | NodeError::NotOnHost { .. }
            | NodeError::CreatedForOtherAccess { .. }
            | NodeError::OtherFsType { .. }
            | NodeError::MissingParent { .. }
            | NodeError::WouldOverwrite { .. } => Code::FailedPrecondition,
            NodeError::DeviceTooSmall { .. }
            | NodeError::DeviceAboveLimit { .. }
            | NodeError::NoSectorMultiple { .. } => Code::OutOfRange,
            NodeError::Busy(_) | NodeError::BlankCheckRunning { .. } => Code::Aborted,
            NodeError::Ops(o) => o.code(),
            NodeError::Backend(b) => backend_code(b),
            NodeError::State(_) | NodeError::Internal(_) => Code::Internal,
        };
        status(code, &e)
    }
}

/// Maps a mount error: a bad option is INVALID_ARGUMENT, a target in the
/// wrong state FAILED_PRECONDITION, the rest INTERNAL.
pub(crate) fn mount_err(e: crust_blockdev::MountError) -> NodeError {
    use crust_blockdev::MountError;
    match e {
        MountError::InvalidOption { .. } => NodeError::InvalidArgument(e.to_string()),
        MountError::BadTarget(_)
        | MountError::TargetInUse { .. }
        | MountError::ReadOnlyMismatch { .. }
        | MountError::Busy { .. } => NodeError::MountRefused(Box::new(e)),
        other => NodeError::Internal(other.to_string()),
    }
}

/// Maps a format/grow error: a device that is mounted or open in another
/// process (a sandbox's QEMU) is FAILED_PRECONDITION, the rest INTERNAL.
pub(crate) fn fs_err(context: &str, e: crust_blockdev::FsError) -> NodeError {
    use crust_blockdev::FsError;
    match e {
        FsError::InUse { .. } | FsError::OpenElsewhere { .. } => {
            NodeError::DeviceInUse(Box::new(e))
        }
        FsError::NotBlank { .. } | FsError::HoldsData { .. } => {
            NodeError::FormatRefused(Box::new(e))
        }
        FsError::Aliased(a) => alias_err(a),
        other => NodeError::Internal(format!("{context}: {other}")),
    }
}

/// Maps the alias check: another device exposing the data is
/// FAILED_PRECONDITION, a scan that could not finish INTERNAL.
pub(crate) fn alias_err(e: crust_blockdev::AliasError) -> NodeError {
    match e {
        crust_blockdev::AliasError::Found { .. } => NodeError::Aliased(Box::new(e)),
        other => NodeError::Internal(other.to_string()),
    }
}

/// What is wrong with a path the CO named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathProblem {
    #[error("does not exist; the CO must create it first")]
    Missing,
    #[error("exists but is not a directory")]
    NotADirectory,
    #[error("is a symbolic link; a real directory is required")]
    SymlinkForDirectory,
    #[error("is a symbolic link; refusing to follow it")]
    Symlink,
    #[error("is a directory; a raw block volume is published as a file")]
    DirectoryForBlock,
    #[error(
        "is an existing device node and not this volume's publication; refusing to publish over it"
    )]
    ForeignDeviceNode,
    #[error("exists and is not a regular file")]
    NotARegularFile,
    #[error(
        "is a file with data ({0} bytes); a raw block volume is published on a new or empty file only"
    )]
    FileWithData(u64),
    #[error("exists and is not a directory; a filesystem volume needs a directory")]
    NotADirectoryForFs,
    #[error(
        "has a filesystem mounted on it; a deferred publication leaves the target empty for \
         the pod's runtime"
    )]
    FilesystemMounted,
}

fn access_name(block: bool) -> &'static str {
    if block { "raw block" } else { "filesystem" }
}

/// The message of [`NodeError::ForeignMount`]: a first stage finds a mount
/// already there; later calls find one that is not the volume's.
fn foreign_mount(field: &str, path: &Path, what: &str, volume: Option<&str>) -> String {
    let path = path.display();
    match volume {
        None => format!("{field} {path} already has {what} mounted on it"),
        Some(v) if field == "target_path" => format!(
            "{field} {path} has {what} mounted on it, which is not volume {v}'s \
             publication; nothing was unmounted or removed"
        ),
        Some(v) => format!(
            "{field} {path} has {what} mounted on it, which is not volume {v}'s \
             filesystem; nothing was unmounted"
        ),
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
        let s: Status = NodeError::StagedWithOtherDeferral {
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
        let s: Status = ControllerError::GuestThawedEarly {
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
        let s: Status = NodeError::DeviceTooSmall {
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
        let s: Status = NodeError::StagedForOtherAccess {
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
        let s: Status = NodeError::WouldOverwrite {
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
