//! The user a process runs as, shared by the workload
//! ([`crate::messages`]) and container ([`crate::containers`]) requests.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadUser {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups, e.g. the pod's fsGroup.
    #[serde(default)]
    pub supplemental_gids: Vec<u32>,
}
