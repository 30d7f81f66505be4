use std::time::Duration;

use crust_handoff::{ErrorKind, HandoffError};
use tonic::{Code, Status};

/// Failures of the Runtime operations. Status codes (see [`OpsError::code`]):
///
/// | error | code |
/// |---|---|
/// | bad request field | INVALID_ARGUMENT |
/// | no record for the target | NOT_FOUND |
/// | different record staged and claimed | ALREADY_EXISTS |
/// | unstage while a claimant is not shown gone (`running`, `unknown`, no answer, device still held) | FAILED_PRECONDITION |
/// | record exists, no runtime consumed it yet (no `runtime-cli` / no sandbox file) | FAILED_PRECONDITION |
/// | stage of a device that is mounted (any namespace) or held, or whose data another device exposes | FAILED_PRECONDITION |
/// | recorded CLI not absolute / not an executable regular file | FAILED_PRECONDITION |
/// | forged or broken record on disk | FAILED_PRECONDITION |
/// | CLI did not finish within the timeout (it is killed) | DEADLINE_EXCEEDED |
/// | CLI exited non-zero | INTERNAL (carries its stderr; a runtime that cannot serve a volume it took is a server-side fault the CO should retry, not a caller mistake) |
/// | CLI output unparseable or out of range | INTERNAL |
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Handoff(#[from] HandoffError),
    #[error("volume {0} is not consumed by a runtime yet")]
    NotConsumed(String),
    /// The runtime consuming the volume does not offer the verb (its CLI's
    /// `crust capabilities` does not list it, or it is Kata's).
    #[error(
        "the runtime of volume {target} cannot {verb} it ({runtime} does not offer `crust {verb}`)"
    )]
    Unsupported {
        target: String,
        verb: &'static str,
        runtime: String,
    },
    /// Unstage refused: the claimant was not shown to be dead.
    #[error(
        "volume at {target} is still claimed by sandbox {by}; stop the sandbox first ({detail})"
    )]
    StillClaimed {
        target: String,
        by: String,
        detail: String,
    },
    /// The device to hand over is mounted or held, or another device
    /// exposes its data (named in `detail`).
    #[error("{detail}")]
    DeviceInUse { device: String, detail: String },
    #[error("runtime cli {path}: {reason}")]
    BadRuntimeCli { path: String, reason: String },
    #[error("`{cli} {op}` did not finish within {timeout:?} and was killed")]
    CliTimeout {
        cli: String,
        op: String,
        timeout: Duration,
    },
    #[error("`{cli} {op}` failed ({status}): {stderr}")]
    CliFailed {
        cli: String,
        op: String,
        status: String,
        stderr: String,
    },
    #[error("`{cli} {op}` printed unusable output: {reason}")]
    BadOutput {
        cli: String,
        op: String,
        reason: String,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl OpsError {
    pub fn code(&self) -> Code {
        match self {
            OpsError::InvalidArgument(_) => Code::InvalidArgument,
            OpsError::Handoff(e) => match e.kind() {
                ErrorKind::InvalidArgument => Code::InvalidArgument,
                ErrorKind::NotFound => Code::NotFound,
                ErrorKind::AlreadyExists => Code::AlreadyExists,
                ErrorKind::FailedPrecondition => Code::FailedPrecondition,
                ErrorKind::Internal => Code::Internal,
            },
            OpsError::NotConsumed(_)
            | OpsError::Unsupported { .. }
            | OpsError::StillClaimed { .. }
            | OpsError::DeviceInUse { .. }
            | OpsError::BadRuntimeCli { .. } => Code::FailedPrecondition,
            OpsError::CliTimeout { .. } => Code::DeadlineExceeded,
            OpsError::CliFailed { .. } | OpsError::BadOutput { .. } | OpsError::Io { .. } => {
                Code::Internal
            }
        }
    }
}

impl From<OpsError> for Status {
    fn from(e: OpsError) -> Status {
        Status::new(
            e.code(),
            crust_fs::sanitize(&e.to_string(), crust_fs::MESSAGE_MAX),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes() {
        let cases: Vec<(OpsError, Code)> = vec![
            (OpsError::InvalidArgument("x".into()), Code::InvalidArgument),
            (
                HandoffError::InvalidArgument("x".into()).into(),
                Code::InvalidArgument,
            ),
            (HandoffError::NotFound("/t".into()).into(), Code::NotFound),
            (
                HandoffError::Conflict("x".into()).into(),
                Code::AlreadyExists,
            ),
            (
                HandoffError::Claimed {
                    target: "/t".into(),
                    by: "sb".into(),
                }
                .into(),
                Code::FailedPrecondition,
            ),
            (
                HandoffError::BadRecord {
                    path: "/r".into(),
                    reason: "forged".into(),
                }
                .into(),
                Code::FailedPrecondition,
            ),
            (OpsError::NotConsumed("/t".into()), Code::FailedPrecondition),
            (
                OpsError::StillClaimed {
                    target: "/t".into(),
                    by: "sb".into(),
                    detail: "it answers".into(),
                },
                Code::FailedPrecondition,
            ),
            (
                HandoffError::StillClaimed {
                    target: "/t".into(),
                    by: "sb".into(),
                }
                .into(),
                Code::FailedPrecondition,
            ),
            (
                OpsError::BadRuntimeCli {
                    path: "x".into(),
                    reason: "not absolute".into(),
                },
                Code::FailedPrecondition,
            ),
            (
                OpsError::CliTimeout {
                    cli: "c".into(),
                    op: "crust stats /t".into(),
                    timeout: Duration::from_secs(1),
                },
                Code::DeadlineExceeded,
            ),
            (
                OpsError::CliFailed {
                    cli: "c".into(),
                    op: "crust stats /t".into(),
                    status: "exit code 1".into(),
                    stderr: "boom".into(),
                },
                Code::Internal,
            ),
            (
                OpsError::BadOutput {
                    cli: "c".into(),
                    op: "crust stats".into(),
                    reason: "not JSON".into(),
                },
                Code::Internal,
            ),
        ];
        for (e, code) in cases {
            let msg = e.to_string();
            let status = Status::from(e);
            assert_eq!(status.code(), code, "{msg}");
            assert_eq!(status.message(), msg);
        }
        let s = Status::from(OpsError::NotConsumed("/t".into()));
        assert_eq!(s.message(), "volume /t is not consumed by a runtime yet");
    }
}
