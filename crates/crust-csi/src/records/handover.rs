//! A handover in progress or in force, as the volume record keeps it
//! (the service is `crate::handover`).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A handover in progress or in force, as the volume record keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoverRecord {
    /// The publication handed over.
    pub target: PathBuf,
    pub sandbox: String,
    pub runtime_cli: String,
    pub phase: HandoverPhase,
    /// The filesystem was mounted on the host when the handover started
    /// (a rollback restores exactly that).
    #[serde(default)]
    pub host_mounted: bool,
    /// kubelet's subPath binds of the target, taken with it (a rollback
    /// restores them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subpath_binds: Vec<SubpathBind>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HandoverPhase {
    /// Host mounts may be gone; no complete hand-off record yet.
    Preparing,
    /// The record exists, claimed by the sandbox; the guest may use it.
    HandedOver,
}

/// The volume came back from a guest that had raw access to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Returned {
    /// Who had it (empty: a deferred publication's runtime, not recorded).
    pub sandbox: String,
    /// Seconds since the epoch.
    pub at: u64,
}

impl Returned {
    pub fn now(sandbox: &str) -> Returned {
        Returned {
            sandbox: sandbox.to_string(),
            at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        }
    }
}

/// One kubelet subPath bind, as a handover record keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubpathBind {
    pub mount_point: PathBuf,
    /// What it shows, relative to the filesystem's root.
    pub root: PathBuf,
    pub readonly: bool,
}
