//! The error of a runtime command, with the class the CLI reports.

use crust_handoff::{ErrorKind, HandoffError};

use crate::beneath::BeneathError;
use crate::bundle::BundleError;
use crate::discovery::DiscoveryError;
use crate::sandbox::SandboxError;
use crate::share::ShareError;
use crate::shim::{ApiError, Code, ShimError};
use crate::volumes::VolumeError;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Shim(#[from] ShimError),
    #[error(transparent)]
    Handoff(#[from] HandoffError),
    #[error(transparent)]
    Volume(#[from] VolumeError),
    #[error(transparent)]
    Share(#[from] ShareError),
    #[error("{message}")]
    Coded { code: Code, message: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl RuntimeError {
    pub fn new(code: Code, message: impl Into<String>) -> RuntimeError {
        RuntimeError::Coded {
            code,
            message: message.into(),
        }
    }

    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RuntimeError {
        let context = context.into();
        move |source| RuntimeError::Io { context, source }
    }

    pub fn code(&self) -> Code {
        match self {
            RuntimeError::Bundle(BundleError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Code::NotFound
            }
            RuntimeError::Bundle(_) => Code::InvalidArgument,
            RuntimeError::Discovery(DiscoveryError::InvalidSource { .. }) => Code::InvalidArgument,
            RuntimeError::Discovery(DiscoveryError::Record { source, .. }) => handoff_code(source),
            RuntimeError::Discovery(DiscoveryError::Config(_)) => Code::InvalidArgument,
            RuntimeError::Sandbox(SandboxError::InvalidId(..)) => Code::InvalidArgument,
            RuntimeError::Sandbox(SandboxError::AlreadyExists(_)) => Code::AlreadyExists,
            RuntimeError::Sandbox(SandboxError::NotFound(_)) => Code::NotFound,
            RuntimeError::Sandbox(_) => Code::Internal,
            RuntimeError::Shim(ShimError::Api(e)) => e.code,
            RuntimeError::Shim(ShimError::Timeout { .. }) => Code::DeadlineExceeded,
            RuntimeError::Shim(ShimError::Unreachable { .. }) => Code::Unavailable,
            RuntimeError::Shim(ShimError::Protocol(_)) => Code::Internal,
            RuntimeError::Handoff(e) => handoff_code(e),
            RuntimeError::Volume(e) => e.code(),
            RuntimeError::Share(ShareError::Source { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Code::InvalidArgument
            }
            // Something in the share that crust did not put there.
            RuntimeError::Share(ShareError::Beneath(
                BeneathError::Planted { .. } | BeneathError::Escape { .. },
            )) => Code::FailedPrecondition,
            RuntimeError::Share(_) => Code::Internal,
            RuntimeError::Coded { code, .. } => *code,
            RuntimeError::Io { .. } => Code::Internal,
        }
    }
}

pub fn handoff_code(e: &HandoffError) -> Code {
    match e.kind() {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::FailedPrecondition => Code::FailedPrecondition,
        ErrorKind::Internal => Code::Internal,
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> ApiError {
        match e {
            RuntimeError::Shim(ShimError::Api(a)) => a,
            e => ApiError::new(e.code(), e.to_string()),
        }
    }
}
