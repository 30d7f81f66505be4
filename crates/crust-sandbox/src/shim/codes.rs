//! Where the runtime's errors get the shim API's codes: the one mapping
//! from causes (named in [`crate::error`], [`crate::volumes`] and the
//! crates below) to [`Code`]. The shim API server answers with it, and
//! crust-shim turns the same codes into ttrpc statuses.
//!
//! | cause | code |
//! |---|---|
//! | bad flags, limits, signal, mount info, bundle, record, sandbox id | INVALID_ARGUMENT |
//! | no sandbox, record or volume (a bundle file that is not there) | NOT_FOUND |
//! | sandbox or volume id taken, record claimed elsewhere | ALREADY_EXISTS |
//! | wrong sandbox state, guest image missing, device held, record changed, planted share entry, handover required but unreachable | FAILED_PRECONDITION |
//! | a resize ending outside the bounds asked for | OUT_OF_RANGE |
//! | sandbox down or not serving, QMP or the shim or handover unreachable | UNAVAILABLE |
//! | shim, agent or handover too slow | DEADLINE_EXCEEDED |
//! | the rest | INTERNAL |
//!
//! Guest agent and QMP failures, hand-off record errors and the plugin's
//! gRPC refusals keep their own class (see [`agent_code`],
//! [`handoff_code`]).

use crust_agent_proto::{ClientError, ErrorCode};
use crust_handoff::{ErrorKind, HandoffError};
use crust_qmp::QmpError;

use super::{ApiError, Code, ShimError};
use crate::beneath::BeneathError;
use crate::bundle::BundleError;
use crate::discovery::DiscoveryError;
use crate::error::RuntimeError;
use crate::sandbox::SandboxError;
use crate::share::ShareError;
use crate::volumes::{AgentCallError, VolumeError};

impl RuntimeError {
    /// The API code this cause answers.
    pub fn code(&self) -> Code {
        use RuntimeError as E;
        match self {
            E::Bundle(BundleError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Code::NotFound
            }
            E::Bundle(_) => Code::InvalidArgument,
            E::Discovery(DiscoveryError::InvalidSource { .. }) => Code::InvalidArgument,
            E::Discovery(DiscoveryError::Record { source, .. }) => handoff_code(source),
            E::Discovery(DiscoveryError::Config(_)) => Code::InvalidArgument,
            E::Sandbox(SandboxError::InvalidId(..)) => Code::InvalidArgument,
            E::Sandbox(SandboxError::AlreadyExists(_)) => Code::AlreadyExists,
            E::Sandbox(SandboxError::NotFound(_)) => Code::NotFound,
            E::Sandbox(_) => Code::Internal,
            E::Shim(e) => shim_code(e),
            E::Handoff(e) => handoff_code(e),
            E::Volume(e) => e.code(),
            E::Share(e) => share_code(e),
            E::AgentCall(e) => agent_code(&e.cause),
            E::Network(_) => Code::FailedPrecondition,
            E::GuestNetwork(_) => Code::Internal,
            E::Io { .. } => Code::Internal,
            E::EnvSettings(_)
            | E::UnknownSignal(_)
            | E::BadFreezeLimit(_)
            | E::BadIoLimits(_)
            | E::MaxBelowMin { .. }
            | E::BadMountInfo(_) => Code::InvalidArgument,
            E::NoSandbox { .. } | E::NoRecord { .. } | E::NoVolume { .. } => Code::NotFound,
            E::VolumeIdTaken(_) => Code::AlreadyExists,
            E::GuestImageMissing { .. }
            | E::NotCreated { .. }
            | E::NotRunning { .. }
            | E::StillRunning { .. }
            | E::Unclaimed { .. }
            | E::RecordChanged { .. }
            | E::DeviceHeld(_)
            | E::HandoverRequired { .. } => Code::FailedPrecondition,
            E::ResizedOutOfRange { .. } => Code::OutOfRange,
            E::SandboxDown { .. }
            | E::NoExitStatus { .. }
            | E::NotServed(_)
            | E::QmpConnect(_)
            | E::HandoverUnreachable(_) => Code::Unavailable,
            E::ShimNotReady { .. }
            | E::GuestNotReady(_)
            | E::AgentNotReady { .. }
            | E::HandoverTimeout { .. } => Code::DeadlineExceeded,
            E::HandoverRefused { code, .. } => grpc_code(*code),
            E::ShimNotDispatched
            | E::ShimFailedSilently
            | E::ShimExited { .. }
            | E::ShimSocket(_)
            | E::KataLink(_)
            | E::Launch(_)
            | E::HandoverSilent { .. }
            | E::ExeNotUtf8 => Code::Internal,
        }
    }
}

impl VolumeError {
    /// The API code this cause answers.
    pub fn code(&self) -> Code {
        match self {
            VolumeError::Qmp { source, .. } => match source {
                QmpError::InvalidArgument(_) => Code::InvalidArgument,
                QmpError::Timeout { .. } => Code::DeadlineExceeded,
                QmpError::Disconnected(_) => Code::Unavailable,
                _ => Code::Internal,
            },
            VolumeError::Agent { source, .. } => agent_code(source),
            VolumeError::HostDevice { .. } => Code::FailedPrecondition,
            VolumeError::OutOfRange { .. } => Code::OutOfRange,
            VolumeError::Precondition { .. } => Code::FailedPrecondition,
            VolumeError::BadLimits { .. } => Code::InvalidArgument,
        }
    }
}

/// A shim's answer keeps its code; a shim that is slow, gone or garbled
/// is a deadline, unavailable, internal.
fn shim_code(e: &ShimError) -> Code {
    match e {
        ShimError::Api(e) => e.code,
        ShimError::Timeout { .. } => Code::DeadlineExceeded,
        ShimError::Unreachable { .. } => Code::Unavailable,
        ShimError::Protocol(_) => Code::Internal,
    }
}

fn share_code(e: &ShareError) -> Code {
    match e {
        ShareError::Source { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            Code::InvalidArgument
        }
        // Something in the share that crust did not put there.
        ShareError::Beneath(BeneathError::Planted { .. } | BeneathError::Escape { .. }) => {
            Code::FailedPrecondition
        }
        _ => Code::Internal,
    }
}

/// A hand-off record's error class, one to one.
pub fn handoff_code(e: &HandoffError) -> Code {
    match e.kind() {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::FailedPrecondition => Code::FailedPrecondition,
        ErrorKind::Internal => Code::Internal,
    }
}

/// The API code for an agent failure: a silent agent is a deadline, a
/// gone one is unavailable, the agent's own codes map one to one.
pub fn agent_code(e: &ClientError) -> Code {
    match e {
        ClientError::Timeout { .. } | ClientError::NotReady { .. } => Code::DeadlineExceeded,
        ClientError::Connect { .. } | ClientError::Disconnected => Code::Unavailable,
        ClientError::Agent(a) => match a.code {
            ErrorCode::InvalidArgument => Code::InvalidArgument,
            ErrorCode::NotFound => Code::NotFound,
            ErrorCode::AlreadyExists => Code::AlreadyExists,
            ErrorCode::FailedPrecondition => Code::FailedPrecondition,
            ErrorCode::DeadlineExceeded => Code::DeadlineExceeded,
            ErrorCode::ResourceExhausted => Code::OutOfRange,
            _ => Code::Internal,
        },
        _ => Code::Internal,
    }
}

/// crust-csi's gRPC refusal of a handover; ABORTED (still busy after the
/// retries) is a precondition for the caller to retry.
fn grpc_code(c: tonic::Code) -> Code {
    match c {
        tonic::Code::InvalidArgument => Code::InvalidArgument,
        tonic::Code::NotFound => Code::NotFound,
        tonic::Code::AlreadyExists => Code::AlreadyExists,
        tonic::Code::FailedPrecondition | tonic::Code::Aborted => Code::FailedPrecondition,
        tonic::Code::OutOfRange => Code::OutOfRange,
        tonic::Code::Unavailable => Code::Unavailable,
        tonic::Code::DeadlineExceeded => Code::DeadlineExceeded,
        _ => Code::Internal,
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> ApiError {
        match e {
            // A shim's own answer passes through as it came.
            RuntimeError::Shim(ShimError::Api(a)) => a,
            e => ApiError::new(e.code(), e.to_string()),
        }
    }
}

impl From<VolumeError> for ApiError {
    fn from(e: VolumeError) -> ApiError {
        ApiError::new(e.code(), e.to_string())
    }
}

impl From<AgentCallError> for ApiError {
    fn from(e: AgentCallError) -> ApiError {
        ApiError::new(agent_code(&e.cause), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Each cause keeps the code and the words its old `RuntimeError::new`
    /// call gave it: the CLI prints the words, the shim API and
    /// containerd answer the code.
    #[test]
    #[allow(
        clippy::too_many_lines,
        reason = "one row per cause: a table read top to bottom"
    )]
    fn causes_keep_their_codes_and_words() {
        let id = || "sb".to_string();
        let cases: Vec<(RuntimeError, Code, &str)> = vec![
            (
                RuntimeError::UnknownSignal("NOPE".into()),
                Code::InvalidArgument,
                "unknown signal \"NOPE\"",
            ),
            (
                RuntimeError::MaxBelowMin { min: 10, max: 5 },
                Code::InvalidArgument,
                "max 5 is smaller than min 10",
            ),
            (
                RuntimeError::BadMountInfo("bad".into()),
                Code::InvalidArgument,
                "--mount-info: bad",
            ),
            (
                RuntimeError::NoSandbox { id: id() },
                Code::NotFound,
                "sandbox sb does not exist",
            ),
            (
                RuntimeError::NoRecord {
                    what: "volume /t".into(),
                },
                Code::NotFound,
                "no hand-off record for volume /t",
            ),
            (
                RuntimeError::NoVolume {
                    sandbox: id(),
                    path: "/t".into(),
                },
                Code::NotFound,
                "sandbox sb has no volume /t",
            ),
            (
                RuntimeError::VolumeIdTaken("v1".into()),
                Code::AlreadyExists,
                "volume id v1 is taken",
            ),
            (
                RuntimeError::NotCreated {
                    id: id(),
                    status: "running",
                },
                Code::FailedPrecondition,
                "sandbox sb is running, not created",
            ),
            (
                RuntimeError::StillRunning { id: id() },
                Code::FailedPrecondition,
                "sandbox sb is running; kill it first or use --force",
            ),
            (
                RuntimeError::RecordChanged {
                    target: "/t".into(),
                    sandbox: id(),
                    reason: "fstype".into(),
                },
                Code::FailedPrecondition,
                "the hand-off record for /t changed while sandbox sb was claiming it (fstype); \
                 nothing was attached, retry",
            ),
            (
                RuntimeError::ResizedOutOfRange {
                    target: "/t".into(),
                    capacity: 7,
                    min: 8,
                    max: 0,
                },
                Code::OutOfRange,
                "volume /t has 7 bytes after the resize, outside [8, unbounded]",
            ),
            (
                RuntimeError::SandboxDown {
                    id: id(),
                    reason: "shutting down".into(),
                },
                Code::Unavailable,
                "sandbox sb is not running (shutting down)",
            ),
            (
                RuntimeError::NoExitStatus {
                    id: id(),
                    reason: "unknown reason".into(),
                },
                Code::Unavailable,
                "sandbox sb stopped without a workload exit status: unknown reason",
            ),
            (
                RuntimeError::ShimNotReady {
                    id: id(),
                    wait: Duration::from_secs(3),
                },
                Code::DeadlineExceeded,
                "sandbox sb was not ready within 3s",
            ),
            (
                RuntimeError::HandoverTimeout {
                    what: "handing /t back".into(),
                    after: Duration::from_secs(10),
                },
                Code::DeadlineExceeded,
                "handing /t back did not answer within 10s",
            ),
            (
                RuntimeError::HandoverRefused {
                    target: "/t".into(),
                    code: tonic::Code::Aborted,
                    message: "busy".into(),
                },
                Code::FailedPrecondition,
                "crust-csi would not hand over /t: busy",
            ),
            (
                RuntimeError::HandoverRefused {
                    target: "/t".into(),
                    code: tonic::Code::PermissionDenied,
                    message: "no".into(),
                },
                Code::Internal,
                "crust-csi would not hand over /t: no",
            ),
            (
                RuntimeError::ShimFailedSilently,
                Code::Internal,
                "the shim failed without saying why",
            ),
            (
                RuntimeError::KataLink("read-only".into()),
                Code::Internal,
                "linking the shim socket for Kata's CLI: read-only",
            ),
        ];
        for (e, code, words) in cases {
            assert_eq!((e.code(), e.to_string().as_str()), (code, words));
            let api = ApiError::from(e);
            assert_eq!((api.code, api.message.as_str()), (code, words));
        }
    }

    /// A shim's own answer reaches the caller as the shim gave it.
    #[test]
    fn a_shim_answer_passes_through() {
        let answer = ApiError::new(Code::OutOfRange, "too big");
        let e = RuntimeError::Shim(ShimError::Api(answer.clone()));
        assert_eq!(e.code(), Code::OutOfRange);
        assert_eq!(ApiError::from(e), answer);
        let agent = AgentCallError {
            what: "exec",
            cause: ClientError::Disconnected,
        };
        let api = ApiError::from(agent);
        assert_eq!(api.code, Code::Unavailable);
        assert!(api.message.starts_with("exec: "), "{api}");
    }
}
