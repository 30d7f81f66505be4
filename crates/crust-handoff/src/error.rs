use std::io;

/// Every failure of the hand-off store. [`HandoffError::kind`] tells a
/// gRPC edge which status code to use.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// The caller passed something unacceptable (path, device, option, id).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No hand-off record for that path.
    #[error("no hand-off record for {0}")]
    NotFound(String),
    /// A different record is staged and a sandbox holds it.
    #[error("conflict: {0}")]
    Conflict(String),
    /// Another live sandbox holds the volume (one sandbox at a time).
    #[error("volume {target} is already claimed by sandbox {by}")]
    Claimed { target: String, by: String },
    /// The record cannot go: a sandbox that may still run holds it (its VM
    /// could still have the device).
    #[error("volume at {target} is still claimed by sandbox {by}; stop the sandbox first")]
    StillClaimed { target: String, by: String },
    /// The hand-off root is not root-only: whoever else can write there
    /// could plant or swap records.
    #[error("hand-off root {path} is unsafe: {reason}")]
    UnsafeRoot { path: String, reason: String },
    /// What is on disk is not a record this library would have written:
    /// forged, truncated, a symlink, an unexpected entry.
    #[error("refusing hand-off record {path}: {reason}")]
    BadRecord { path: String, reason: String },
    /// The operation does not exist in this layout.
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

/// Coarse classes the callers map to gRPC codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    Internal,
}

impl HandoffError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            HandoffError::InvalidArgument(_) => ErrorKind::InvalidArgument,
            HandoffError::NotFound(_) => ErrorKind::NotFound,
            HandoffError::Conflict(_) => ErrorKind::AlreadyExists,
            HandoffError::Claimed { .. }
            | HandoffError::StillClaimed { .. }
            | HandoffError::UnsafeRoot { .. }
            | HandoffError::BadRecord { .. }
            | HandoffError::Unsupported(_) => ErrorKind::FailedPrecondition,
            HandoffError::Io { .. } => ErrorKind::Internal,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: impl Into<io::Error>) -> Self {
        HandoffError::Io {
            context: context.into(),
            source: source.into(),
        }
    }

    pub(crate) fn bad(path: impl Into<String>, reason: impl Into<String>) -> Self {
        HandoffError::BadRecord {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

pub type Result<T, E = HandoffError> = std::result::Result<T, E>;
