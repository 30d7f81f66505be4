//! Requests, replies and errors exchanged with the guest agent.
//!
//! On the wire a request is
//! `{"id": 7, "deadline_ms": 30000, "op": "mount_volume", "args": {...}}`
//! and a response is `{"id": 7, "result": {...}}` or
//! `{"id": 7, "error": {"code": "not_found", "message": "..."}}`.
//! A response with id 0 reports a frame the agent could not attribute to a
//! request (malformed JSON without a readable id, an oversized frame).

use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::containers::*;
use crate::network::{ConfigureNetwork, ConfigureNetworkReply};
pub use crate::user::WorkloadUser;

/// One request. `deadline_ms` is relative to when the agent reads it (host
/// and guest clocks are unrelated); 0 means no deadline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub id: u64,
    #[serde(default)]
    pub deadline_ms: u64,
    #[serde(flatten)]
    pub op: Operation,
}

/// Every operation the agent understands.
#[allow(
    clippy::large_enum_variant,
    reason = "one request at a time, decoded once: CreateContainer's size costs nothing"
)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "args", rename_all = "snake_case")]
pub enum Operation {
    Ping(Ping),
    MountVolume(MountVolume),
    StatVolume(StatVolume),
    GrowVolume(GrowVolume),
    UnmountVolume(UnmountVolume),
    Exec(Exec),
    Shutdown(Shutdown),
    CreateContainer(CreateContainer),
    StartContainer(StartContainer),
    ExecProcess(ExecProcess),
    SignalProcess(SignalProcess),
    WaitProcess(WaitProcess),
    CloseStdin(CloseStdin),
    ResizePty(ResizePty),
    ContainerPids(ContainerPids),
    ContainerStats(ContainerStats),
    RemoveContainer(RemoveContainer),
    GuestInfo(GuestInfo),
    FreezeVolume(FreezeVolume),
    ThawVolume(ThawVolume),
    ConfigureNetwork(ConfigureNetwork),
    UpdateContainer(UpdateContainer),
    OnlineCpus(OnlineCpus),
}

/// Wire names of every operation, for telling "unknown op" apart from
/// "known op with bad arguments".
pub const OPERATION_NAMES: &[&str] = &[
    "ping",
    "mount_volume",
    "stat_volume",
    "grow_volume",
    "unmount_volume",
    "exec",
    "shutdown",
    "create_container",
    "start_container",
    "exec_process",
    "signal_process",
    "wait_process",
    "close_stdin",
    "resize_pty",
    "container_pids",
    "container_stats",
    "remove_container",
    "guest_info",
    "freeze_volume",
    "thaw_volume",
    "configure_network",
    "update_container",
    "online_cpus",
];

impl Operation {
    /// The wire name (`"mount_volume"`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            Operation::Ping(_) => Ping::NAME,
            Operation::MountVolume(_) => MountVolume::NAME,
            Operation::StatVolume(_) => StatVolume::NAME,
            Operation::GrowVolume(_) => GrowVolume::NAME,
            Operation::UnmountVolume(_) => UnmountVolume::NAME,
            Operation::Exec(_) => Exec::NAME,
            Operation::Shutdown(_) => Shutdown::NAME,
            Operation::CreateContainer(_) => CreateContainer::NAME,
            Operation::StartContainer(_) => StartContainer::NAME,
            Operation::ExecProcess(_) => ExecProcess::NAME,
            Operation::SignalProcess(_) => SignalProcess::NAME,
            Operation::WaitProcess(_) => WaitProcess::NAME,
            Operation::CloseStdin(_) => CloseStdin::NAME,
            Operation::ResizePty(_) => ResizePty::NAME,
            Operation::ContainerPids(_) => ContainerPids::NAME,
            Operation::ContainerStats(_) => ContainerStats::NAME,
            Operation::RemoveContainer(_) => RemoveContainer::NAME,
            Operation::GuestInfo(_) => GuestInfo::NAME,
            Operation::FreezeVolume(_) => FreezeVolume::NAME,
            Operation::ThawVolume(_) => ThawVolume::NAME,
            Operation::ConfigureNetwork(_) => ConfigureNetwork::NAME,
            Operation::UpdateContainer(_) => UpdateContainer::NAME,
            Operation::OnlineCpus(_) => OnlineCpus::NAME,
        }
    }
}

/// One response: the request's id and either a result or an error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub id: u64,
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// Result (operation-specific JSON) or error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Result(serde_json::Value),
    Error(AgentError),
}

impl Response {
    /// A successful response carrying `reply`.
    pub fn ok<T: Serialize>(id: u64, reply: &T) -> Response {
        match serde_json::to_value(reply) {
            Ok(v) => Response {
                id,
                outcome: Outcome::Result(v),
            },
            Err(e) => Response::err(id, AgentError::new(ErrorCode::Internal, e.to_string())),
        }
    }

    /// A failed response.
    pub fn err(id: u64, error: AgentError) -> Response {
        Response {
            id,
            outcome: Outcome::Error(error),
        }
    }
}

/// Coarse failure classes, aligned with gRPC/CSI codes so the runtime can
/// map them one to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    DeadlineExceeded,
    ResourceExhausted,
    Unimplemented,
    Internal,
    /// A code this build does not know (newer agent).
    #[serde(other)]
    Unknown,
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ErrorCode::InvalidArgument => "InvalidArgument",
            ErrorCode::NotFound => "NotFound",
            ErrorCode::AlreadyExists => "AlreadyExists",
            ErrorCode::FailedPrecondition => "FailedPrecondition",
            ErrorCode::DeadlineExceeded => "DeadlineExceeded",
            ErrorCode::ResourceExhausted => "ResourceExhausted",
            ErrorCode::Unimplemented => "Unimplemented",
            ErrorCode::Internal => "Internal",
            ErrorCode::Unknown => "Unknown",
        };
        f.write_str(s)
    }
}

/// An error reported by the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct AgentError {
    pub code: ErrorCode,
    pub message: String,
}

impl AgentError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        AgentError {
            code,
            message: message.into(),
        }
    }
}

/// Ties a request type to its reply type and wire name.
pub trait Call: Into<Operation> {
    type Reply: Serialize + DeserializeOwned;
    const NAME: &'static str;
}

macro_rules! call {
    ($req:ident => $reply:ty, $name:literal) => {
        impl Call for $req {
            type Reply = $reply;
            const NAME: &'static str = $name;
        }
        impl From<$req> for Operation {
            fn from(r: $req) -> Operation {
                Operation::$req(r)
            }
        }
    };
}

call!(Ping => PingReply, "ping");
call!(MountVolume => MountVolumeReply, "mount_volume");
call!(StatVolume => VolumeStats, "stat_volume");
call!(GrowVolume => GrowVolumeReply, "grow_volume");
call!(FreezeVolume => Empty, "freeze_volume");
call!(ThawVolume => ThawVolumeReply, "thaw_volume");
call!(UnmountVolume => Empty, "unmount_volume");
call!(Exec => ExecReply, "exec");
call!(Shutdown => Empty, "shutdown");
call!(CreateContainer => ProcessReply, "create_container");
call!(StartContainer => ProcessReply, "start_container");
call!(ExecProcess => ProcessReply, "exec_process");
call!(SignalProcess => Empty, "signal_process");
call!(WaitProcess => WaitReply, "wait_process");
call!(CloseStdin => Empty, "close_stdin");
call!(ResizePty => Empty, "resize_pty");
call!(ContainerPids => PidsReply, "container_pids");
call!(ContainerStats => ContainerStatsReply, "container_stats");
call!(RemoveContainer => Empty, "remove_container");
call!(GuestInfo => GuestInfoReply, "guest_info");
call!(ConfigureNetwork => ConfigureNetworkReply, "configure_network");
call!(UpdateContainer => Empty, "update_container");
call!(OnlineCpus => OnlineCpusReply, "online_cpus");

/// Reply with no data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

/// Liveness probe.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ping {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PingReply {
    /// Agent crate version.
    pub version: String,
    /// [`crate::PROTOCOL_VERSION`] the agent speaks.
    pub protocol: u32,
    /// Guest uptime.
    pub uptime_ms: u64,
}

/// Filesystems the agent mounts (crust's one definition).
pub use crust_fs::FsType;

/// Kubernetes `fsGroupChangePolicy`, spelled as in the pod spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum FsGroupPolicy {
    /// Recursively change group ownership and permissions on every mount.
    #[default]
    Always,
    /// Only when the volume root does not already have the group, the
    /// setgid bit and group rwx.
    OnRootMismatch,
}

/// Mount the filesystem of the virtio-blk disk whose serial is `serial` at
/// `/run/crust/volumes/<volume>` and apply `fs_group`.
///
/// Idempotent: the same volume already mounted from the same serial is a
/// success. fsGroup is not applied to read-only mounts (as kubelet does).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountVolume {
    /// Host-chosen key; `[A-Za-z0-9._-]`, at most 128 bytes, not `.`/`..`.
    pub volume: String,
    /// virtio-blk serial of the disk (as in `/sys/block/vd*/serial`).
    pub serial: String,
    pub fstype: FsType,
    /// Mount options from an allow-list (see the agent docs); anything
    /// else is InvalidArgument.
    #[serde(default)]
    pub options: Vec<String>,
    #[serde(default)]
    pub readonly: bool,
    #[serde(default)]
    pub fs_group: Option<u32>,
    /// Defaults to `Always` when `fs_group` is set.
    #[serde(default)]
    pub fs_group_policy: Option<FsGroupPolicy>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountVolumeReply {
    /// Guest path of the mount, `/run/crust/volumes/<volume>`.
    pub mount_path: String,
    /// Guest block device, e.g. `/dev/vdb`.
    pub device: String,
    /// Whether ownership/permissions were changed for fsGroup on this call.
    pub fs_group_applied: bool,
}

/// Usage and health of a mounted volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatVolume {
    pub volume: String,
}

/// statvfs-derived usage plus a health verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeStats {
    /// total = f_blocks·f_frsize, used = (f_blocks−f_bfree)·f_frsize,
    /// available = f_bavail·f_frsize (what `df -P -B1` prints).
    pub bytes: Usage,
    /// total = f_files, used = f_files−f_ffree, available = f_ffree.
    pub inodes: Usage,
    pub condition: VolumeCondition,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub total: u64,
    pub used: u64,
    pub available: u64,
}

/// CSI `VolumeCondition`: `abnormal` plus a message a person can act on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeCondition {
    pub abnormal: bool,
    pub message: String,
}

/// Grow the filesystem online to the disk's current size (the host resizes
/// the disk first, e.g. QMP `block_resize`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrowVolume {
    pub volume: String,
    /// The size the host resized the disk to. The guest kernel learns of a
    /// new capacity asynchronously (a virtio config interrupt): the agent
    /// waits, within the request's deadline, until it sees at least this
    /// many bytes before growing, instead of growing to the old size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_bytes: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrowVolumeReply {
    /// Disk size the guest kernel sees.
    pub device_bytes: u64,
    /// Filesystem size after growing (f_blocks·f_frsize).
    pub fs_total_bytes: u64,
}

/// Longest a guest filesystem may stay frozen, in milliseconds: its
/// writers block meanwhile. The one limit every door that takes a freeze
/// checks through [`freeze_limit`]: crust_ops, the runtime CLI, the shim
/// API and the agent.
pub const MAX_FROZEN_MS: u64 = 600_000;

/// A freeze time limit outside `1..=MAX_FROZEN_MS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FreezeLimitError {
    #[error("max_frozen_ms must be between 1 and {MAX_FROZEN_MS}, not 0")]
    Zero,
    #[error("max_frozen_ms must be between 1 and {MAX_FROZEN_MS}, not {0}")]
    TooLong(u64),
}

/// The time limit of a freeze asked for with `max_frozen_ms`, checked
/// against [`MAX_FROZEN_MS`].
pub fn freeze_limit(max_frozen_ms: u64) -> Result<std::time::Duration, FreezeLimitError> {
    match max_frozen_ms {
        0 => Err(FreezeLimitError::Zero),
        ms if ms > MAX_FROZEN_MS => Err(FreezeLimitError::TooLong(ms)),
        ms => Ok(std::time::Duration::from_millis(ms)),
    }
}

/// Freeze the volume's filesystem (FIFREEZE) for a point-in-time copy of
/// its disk on the host. The agent thaws it by itself after
/// `max_frozen_ms`, so a host that goes away never leaves the guest's
/// writers blocked. Freezing a frozen volume is refused (FailedPrecondition):
/// one copy at a time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezeVolume {
    pub volume: String,
    pub max_frozen_ms: u64,
}

/// Thaw the volume (FITHAW). Not frozen (never, or already thawed by the
/// time limit) is a success whose reply says so.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThawVolume {
    pub volume: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThawVolumeReply {
    /// True when the volume was still frozen from this freeze until this
    /// thaw: a copy made meanwhile is consistent.
    pub was_frozen: bool,
    /// True when the time limit thawed it first.
    pub expired: bool,
}

/// Sync and unmount; a volume that is not mounted is a success. Refused
/// with FailedPrecondition while a container binds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnmountVolume {
    pub volume: String,
}

/// Run a command to completion (diagnostics and tests).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exec {
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<String>,
    /// Killed (process group) after this long → DeadlineExceeded.
    pub timeout_ms: u64,
    /// Run in this container's mount namespace (its root, its mounts),
    /// which lasts until the container is removed; none: the guest's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecReply {
    /// Exit status, or 128+signal when killed by a signal.
    pub exit_code: i32,
    pub signal: Option<i32>,
    /// Captured output, lossily decoded, each capped at
    /// [`crate::MAX_EXEC_OUTPUT`] bytes.
    pub stdout: String,
    pub stderr: String,
    /// Whether output was cut.
    pub truncated: bool,
}

/// Stop the workload, unmount every volume, sync and power the guest off.
/// The reply is sent before the power-off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shutdown {}

/// Parses a request body. On failure returns the id if one was readable
/// (so the error can be addressed) and the error to send back: unknown
/// operations are `Unimplemented`, everything else `InvalidArgument`.
pub fn parse_request(body: &[u8]) -> Result<Request, (u64, AgentError)> {
    // One pass for a good request; only a bad one is looked at as a tree
    // to say which field or operation is wrong.
    if let Ok(req) = serde_json::from_slice::<Request>(body) {
        return Ok(req);
    }
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        (
            0,
            AgentError::new(ErrorCode::InvalidArgument, format!("malformed JSON: {e}")),
        )
    })?;
    let id = value.get("id").and_then(|v| v.as_u64()).unwrap_or(0);
    let op = value.get("op").and_then(|v| v.as_str()).map(str::to_owned);
    serde_json::from_value::<Request>(value).map_err(|e| {
        let err = match op {
            Some(op) if !OPERATION_NAMES.contains(&op.as_str()) => AgentError::new(
                ErrorCode::Unimplemented,
                format!(
                    "unknown operation {op:?} (agent protocol {})",
                    crate::PROTOCOL_VERSION
                ),
            ),
            _ => AgentError::new(ErrorCode::InvalidArgument, format!("bad request: {e}")),
        };
        (id, err)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn freeze_limit_bounds() {
        assert_eq!(freeze_limit(0), Err(FreezeLimitError::Zero));
        assert_eq!(freeze_limit(1).unwrap().as_millis(), 1);
        assert_eq!(
            freeze_limit(MAX_FROZEN_MS).unwrap().as_millis(),
            u128::from(MAX_FROZEN_MS)
        );
        for ms in [MAX_FROZEN_MS + 1, u64::MAX] {
            let e = freeze_limit(ms).unwrap_err();
            assert_eq!(e, FreezeLimitError::TooLong(ms));
            assert!(e.to_string().contains("between 1 and 600000"), "{e}");
        }
    }

    #[test]
    fn request_wire_shape() {
        let req = Request {
            id: 9,
            deadline_ms: 1500,
            op: MountVolume {
                volume: "v1".into(),
                serial: "s1".into(),
                fstype: FsType::Xfs,
                options: vec!["noatime".into()],
                readonly: false,
                fs_group: Some(2000),
                fs_group_policy: Some(FsGroupPolicy::OnRootMismatch),
            }
            .into(),
        };
        let v = serde_json::to_value(&req).unwrap();
        assert_eq!(v["op"], "mount_volume");
        assert_eq!(v["id"], 9);
        assert_eq!(v["args"]["fstype"], "xfs");
        assert_eq!(v["args"]["fs_group_policy"], "OnRootMismatch");
        let back: Request = serde_json::from_value(v).unwrap();
        assert_eq!(back, req);
        assert_eq!(back.op.name(), "mount_volume");
    }

    #[test]
    fn every_operation_round_trips() {
        let ops: Vec<Operation> = vec![
            Ping {}.into(),
            StatVolume { volume: "a".into() }.into(),
            GrowVolume {
                volume: "a".into(),
                device_bytes: Some(1 << 30),
            }
            .into(),
            UnmountVolume { volume: "a".into() }.into(),
            Exec {
                args: vec!["df".into()],
                env: vec![],
                timeout_ms: 10,
                container: Some("w".into()),
            }
            .into(),
            Shutdown {}.into(),
            UpdateContainer {
                id: "c".into(),
                memory_limit_bytes: Some(512 << 20),
                cpu_max: Some(CpuMax {
                    quota_us: Some(200_000),
                    period_us: 100_000,
                }),
            }
            .into(),
            OnlineCpus {
                want: 2,
                timeout_ms: 10,
            }
            .into(),
        ];
        for (i, op) in ops.into_iter().enumerate() {
            let name = op.name();
            assert!(OPERATION_NAMES.contains(&name));
            let req = Request {
                id: i as u64 + 1,
                deadline_ms: 0,
                op,
            };
            let body = serde_json::to_vec(&req).unwrap();
            assert_eq!(parse_request(&body).unwrap(), req, "{name}");
        }
    }

    #[test]
    fn response_wire_shape() {
        let ok = Response::ok(
            3,
            &GrowVolumeReply {
                device_bytes: 10,
                fs_total_bytes: 8,
            },
        );
        assert_eq!(
            serde_json::to_value(&ok).unwrap(),
            json!({"id": 3, "result": {"device_bytes": 10, "fs_total_bytes": 8}})
        );
        let err = Response::err(4, AgentError::new(ErrorCode::NotFound, "no disk"));
        let v = serde_json::to_value(&err).unwrap();
        assert_eq!(
            v,
            json!({"id": 4, "error": {"code": "not_found", "message": "no disk"}})
        );
        assert_eq!(serde_json::from_value::<Response>(v).unwrap(), err);
        // A code from a newer agent still parses.
        let v = json!({"id": 5, "error": {"code": "brand_new", "message": "?"}});
        match serde_json::from_value::<Response>(v).unwrap().outcome {
            Outcome::Error(e) => assert_eq!(e.code, ErrorCode::Unknown),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rootfs_shape() {
        assert_eq!(
            serde_json::to_value(Rootfs::Guest).unwrap(),
            json!({"kind": "guest"})
        );
        let share = Rootfs::Share(ShareRef {
            tag: "pod".into(),
            path: "c/rootfs".into(),
        });
        let v = serde_json::to_value(&share).unwrap();
        assert_eq!(
            v,
            json!({"kind": "share", "tag": "pod", "path": "c/rootfs"})
        );
        assert_eq!(serde_json::from_value::<Rootfs>(v).unwrap(), share);
    }

    #[test]
    fn parse_errors_are_classified() {
        let (id, e) = parse_request(b"{not json").unwrap_err();
        assert_eq!((id, e.code), (0, ErrorCode::InvalidArgument));
        let (id, e) = parse_request(br#"{"id": 12, "op": "teleport", "args": {}}"#).unwrap_err();
        assert_eq!((id, e.code), (12, ErrorCode::Unimplemented));
        assert!(e.message.contains("teleport"));
        let (id, e) = parse_request(br#"{"id": 13, "op": "mount_volume", "args": {"volume": 1}}"#)
            .unwrap_err();
        assert_eq!((id, e.code), (13, ErrorCode::InvalidArgument));
        let (id, e) = parse_request(br#"{"id": 14, "op": "mount_volume", "args": {"volume": "v", "serial": "s", "fstype": "btrfs"}}"#).unwrap_err();
        assert_eq!((id, e.code), (14, ErrorCode::InvalidArgument));
        let (id, e) = parse_request(br#"[1,2,3]"#).unwrap_err();
        assert_eq!((id, e.code), (0, ErrorCode::InvalidArgument));
    }
}
