//! The installer's errors, and the points between its steps where a test
//! injects a failure (named by [`InstallError::Fault`]). Below `install`
//! and `hostfs`, which both raise them.

use std::io;
use std::path::PathBuf;

use crate::containerd::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{0}: {1}")]
    Io(PathBuf, io::Error),
    #[error("payload {0}: {1}")]
    Payload(PathBuf, String),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("install record {0} is unreadable: {1}")]
    Manifest(PathBuf, String),
    #[error("{0} must be an absolute path")]
    NotAbsolute(PathBuf),
    #[error("path {} must name a file or directory below / without `.` or `..` components", .0.display())]
    NotNormal(PathBuf),
    #[error("reloading containerd ({command}) failed: {reason}")]
    Reload { command: String, reason: String },
    /// The installer follows no links under the host root (see
    /// [`crate::hostfs`]).
    #[error(
        "{path} is a symbolic link to {target}; the installer does not follow links on the \
         host: replace it with a copy of the file containerd really reads, or pass that \
         file's path"
    )]
    Symlink { path: PathBuf, target: PathBuf },
    #[error("{path} is a {kind}, not a regular file: refused")]
    NotAFile { path: PathBuf, kind: &'static str },
    #[error("{path} is a {kind}, not a directory: refused")]
    NotADirectory { path: PathBuf, kind: &'static str },
    #[error("stopped after step {0:?} (injected fault)")]
    Fault(Step),
    #[error("{cause}; the install was rolled back, nothing of it is left")]
    RolledBack { cause: Box<InstallError> },
    #[error(
        "{cause}; rolling back failed too ({rollback}): `crust-node-install uninstall` \
         removes what {record} lists"
    )]
    RollbackFailed {
        cause: Box<InstallError>,
        rollback: Box<InstallError>,
        record: PathBuf,
    },
    #[error(
        "{cause}; the upgrade is incomplete: {record} lists everything it wrote (run install \
         again, or uninstall)"
    )]
    Incomplete {
        cause: Box<InstallError>,
        record: PathBuf,
    },
}

/// The points between install steps, where a test can inject a failure
/// ([`crate::install::Options::fault`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The record of intent is written; nothing else yet.
    Recorded,
    /// The payload is in place (and stale files removed).
    Payload,
    /// The drop-in is written (when one is used).
    Dropin,
    /// The root config is written (when it needed a change).
    RootConfig,
}
