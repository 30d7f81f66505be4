//! Errors of the Node service. [`NodeError`] holds what any Node RPC may
//! meet (a missing field, an unknown volume, another node, a mount or
//! format refused, crust_ops, the backend, the records); each route's own
//! refusals are a family of their own, wrapped in it:
//!
//! | family | route |
//! |---|---|
//! | [`StageError`] | NodeStageVolume, NodeUnstageVolume |
//! | [`PublishError`] | NodePublishVolume, NodeUnpublishVolume (host and deferred) |
//! | [`RouteError`] | where NodeGetVolumeStats, NodeExpandVolume or a deferred unpublish find the volume |
//! | [`ExpandError`] | NodeExpandVolume's sizes and online growth |
//!
//! Every enum maps its variants to codes in one match (a family's
//! through `NodeError` is the family's own); the conventions are the
//! parent module's.

use std::path::{Path, PathBuf};

use crust_backend::BackendError;
use tonic::{Code, Status};

use super::{HandoverError, backend_code, status};
use crate::caps::{AccessMode, BadMountFlags, FsType};
use crate::guard::Busy;
use crate::state::StateError;

/// What any Node RPC may meet; a route's own refusals are in its family.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0} is required")]
    Missing(&'static str),
    /// The request's own fault (a field's value); the message names the field.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("volume {} not found", crust_fs::quote(.0))]
    NotFound(String),
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
    #[error("volume {volume} is staged at {}, not at {}", staged.display(), asked.display())]
    StagedElsewhere {
        volume: String,
        staged: PathBuf,
        asked: PathBuf,
    },
    /// A path from the CO is not what the call needs (nothing changed).
    #[error("{field} {} {problem}", path.display())]
    PathState {
        field: &'static str,
        path: PathBuf,
        problem: PathProblem,
    },
    /// The capability's fsType is not the volume's.
    #[error("volume {volume} {has}; the capability asks for {asked}")]
    OtherFsType {
        volume: String,
        has: String,
        asked: FsType,
    },
    /// Something that is not this volume's mount is at a CO path.
    #[error("{}", foreign_mount(field, path, what, volume.as_deref()))]
    ForeignMount {
        field: &'static str,
        path: PathBuf,
        what: String,
        /// The volume whose mount was expected; `None` for a first stage.
        volume: Option<String>,
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
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error(transparent)]
    Publish(#[from] PublishError),
    #[error(transparent)]
    Route(#[from] RouteError),
    #[error(transparent)]
    Expand(#[from] ExpandError),
}

impl From<NodeError> for Status {
    fn from(e: NodeError) -> Status {
        let code = match e {
            // Each route's family maps its own codes.
            NodeError::Stage(f) => return f.into(),
            NodeError::Publish(f) => return f.into(),
            NodeError::Route(f) => return f.into(),
            NodeError::Expand(f) => return f.into(),
            NodeError::Missing(_) | NodeError::InvalidArgument(_) | NodeError::BadMountFlags(_) => {
                Code::InvalidArgument
            }
            NodeError::NotFound(_) => Code::NotFound,
            NodeError::TargetHoldsOther { .. }
            | NodeError::ReturnedFsDamaged { .. }
            | NodeError::MountRefused(_)
            | NodeError::DeviceInUse(_)
            | NodeError::FormatRefused(_)
            | NodeError::Aliased(_)
            | NodeError::Handover(_)
            | NodeError::OtherNode { .. }
            | NodeError::StagedElsewhere { .. }
            | NodeError::PathState { .. }
            | NodeError::OtherFsType { .. }
            | NodeError::ForeignMount { .. }
            | NodeError::DeferralUnsupported => Code::FailedPrecondition,
            NodeError::Ops(ref o) => o.code(),
            NodeError::Busy(_) => Code::Aborted,
            NodeError::Backend(ref b) => backend_code(b),
            NodeError::State(_) | NodeError::Internal(_) => Code::Internal,
        };
        status(code, &e)
    }
}

/// NodeStageVolume and NodeUnstageVolume: a repeated stage that differs,
/// what a format must not overwrite, a stage still in use.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
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
    #[error(
        "volume {volume} is already staged at {}; unstage it first (one staging path per volume)",
        staged.display()
    )]
    AlreadyStagedElsewhere { volume: String, staged: PathBuf },
    #[error("volume {volume} is still published at {targets:?}; unpublish it first")]
    StillPublished {
        volume: String,
        targets: Vec<PathBuf>,
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
    /// Data crust must not format over: a raw block volume, a volume crust
    /// formatted that now looks blank, or another filesystem.
    #[error("volume {volume} {found}; refusing to {refused}")]
    WouldOverwrite {
        volume: String,
        found: String,
        refused: String,
    },
    /// A sandbox's guest may have the filesystem mounted (`why`): the
    /// host must not probe, check, grow or mount it.
    #[error("volume {volume}: {why}; the host will not check or mount its filesystem")]
    GuestMayHaveFs { volume: String, why: String },
}

impl From<StageError> for Status {
    fn from(e: StageError) -> Status {
        let code = match &e {
            StageError::StagedWithOtherCapability { .. }
            | StageError::StagedWithOtherDeferral { .. } => Code::AlreadyExists,
            StageError::AlreadyStagedElsewhere { .. }
            | StageError::StillPublished { .. }
            | StageError::CreatedForOtherAccess { .. }
            | StageError::FormatRunning { .. }
            | StageError::Undetachable { .. }
            | StageError::WouldOverwrite { .. }
            | StageError::GuestMayHaveFs { .. } => Code::FailedPrecondition,
            StageError::BlankCheckRunning { .. } => Code::Aborted,
        };
        status(code, &e)
    }
}

/// NodePublishVolume and NodeUnpublishVolume: a repeated publish that
/// differs, a staging that cannot serve it, a target in the wrong state,
/// the one-sandbox-at-a-time rule of deferred publications.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
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
    #[error("volume {volume} is not staged; call NodeStageVolume first")]
    NotStaged { volume: String },
    #[error(
        "parent directory {} of target_path does not exist; the CO must create it",
        path.display()
    )]
    MissingParent { path: PathBuf },
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
}

impl From<PublishError> for Status {
    fn from(e: PublishError) -> Status {
        let code = match &e {
            PublishError::PublishedWithOtherArgs { .. }
            | PublishError::PublishedDeferredThere { .. }
            | PublishError::DeferredWithOtherArgs { .. }
            | PublishError::PublishedOnHostThere { .. } => Code::AlreadyExists,
            PublishError::StagedForOtherAccess { .. }
            | PublishError::DeviceGone { .. }
            | PublishError::StagingNotMounted { .. }
            | PublishError::SingleTarget { .. }
            | PublishError::ReadOnlyMix { .. }
            | PublishError::NotStaged { .. }
            | PublishError::MissingParent { .. }
            | PublishError::InGuest { .. }
            | PublishError::OnHost { .. }
            | PublishError::MountedElsewhere { .. }
            | PublishError::DeviceHeld { .. }
            | PublishError::StageFlagsDiffer { .. } => Code::FailedPrecondition,
        };
        status(code, &e)
    }
}

/// Where a request finds the volume (NodeGetVolumeStats,
/// NodeExpandVolume, a deferred NodeUnpublishVolume): a path where it is
/// not, or a host publication asked for as a deferred one (and back).
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
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
}

impl From<RouteError> for Status {
    fn from(e: RouteError) -> Status {
        let code = match &e {
            RouteError::NotOnNode { .. }
            | RouteError::UnknownPath { .. }
            | RouteError::NotStagedAt { .. }
            | RouteError::NotADeferredPublication { .. } => Code::NotFound,
            RouteError::StagingPathNotTarget { .. }
            | RouteError::HostPublication { .. }
            | RouteError::NotOnHost { .. } => Code::FailedPrecondition,
        };
        status(code, &e)
    }
}

/// NodeExpandVolume's sizes and online growth.
#[derive(Debug, thiserror::Error)]
pub enum ExpandError {
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
    /// Online ext4 growth needs CAP_SYS_RESOURCE.
    #[error(
        "ext4 on {} cannot be grown while it is mounted: this plugin lacks \
         CAP_SYS_RESOURCE, which online ext4 resize needs; the filesystem is \
         grown automatically the next time the volume is staged (restart the \
         pod using it), or run the plugin with CAP_SYS_RESOURCE",
        device.display()
    )]
    CannotGrowOnline { device: PathBuf },
}

impl From<ExpandError> for Status {
    fn from(e: ExpandError) -> Status {
        let code = match &e {
            ExpandError::DeviceTooSmall { .. }
            | ExpandError::DeviceAboveLimit { .. }
            | ExpandError::NoSectorMultiple { .. } => Code::OutOfRange,
            ExpandError::CannotGrowOnline { .. } => Code::FailedPrecondition,
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

#[cfg(test)]
mod tests {
    use super::*;

    type Case = (fn() -> NodeError, Code, &'static str);

    /// A family reaches the wire unchanged through `NodeError`: the same
    /// code and message as on its own.
    #[test]
    fn families_pass_through_node_error() {
        let cases: Vec<Case> = vec![
            (
                || {
                    StageError::StillPublished {
                        volume: "v".into(),
                        targets: vec!["/t".into()],
                    }
                    .into()
                },
                Code::FailedPrecondition,
                "volume v is still published at [\"/t\"]; unpublish it first",
            ),
            (
                || PublishError::NotStaged { volume: "v".into() }.into(),
                Code::FailedPrecondition,
                "volume v is not staged; call NodeStageVolume first",
            ),
            (
                || RouteError::NotOnNode { volume: "v".into() }.into(),
                Code::NotFound,
                "volume v is not staged or published on this node",
            ),
            (
                || {
                    ExpandError::DeviceAboveLimit {
                        volume: "v".into(),
                        size: 9,
                        limit: 8,
                    }
                    .into()
                },
                Code::OutOfRange,
                "device of volume v is already 9 bytes, above limit_bytes 8",
            ),
        ];
        for (make, code, message) in cases {
            let wrapped: Status = make().into();
            let direct: Status = match make() {
                NodeError::Stage(f) => f.into(),
                NodeError::Publish(f) => f.into(),
                NodeError::Route(f) => f.into(),
                NodeError::Expand(f) => f.into(),
                other => panic!("not a family: {other}"),
            };
            assert_eq!((wrapped.code(), wrapped.message()), (code, message));
            assert_eq!((direct.code(), direct.message()), (code, message));
        }
    }
}
