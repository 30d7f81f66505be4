//! The accelerator a VM runs under and why: plain data that the VM's
//! record (`crust_vmm::VmState`) and the sandbox's state keep and
//! `crust_vmm::accel` decides.

use serde::{Deserialize, Serialize};

/// The accelerator a launched VM actually uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResolvedAccel {
    Tcg,
    Kvm,
}

impl ResolvedAccel {
    pub fn as_str(self) -> &'static str {
        match self {
            ResolvedAccel::Tcg => "tcg",
            ResolvedAccel::Kvm => "kvm",
        }
    }
}

/// The accelerator of one VM and why it was chosen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccelChoice {
    pub accel: ResolvedAccel,
    pub reason: String,
    /// A KVM boot did not reach the agent and the guest was booted again
    /// under TCG.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fallback: bool,
}

impl AccelChoice {
    pub fn new(accel: ResolvedAccel, reason: impl Into<String>) -> AccelChoice {
        AccelChoice {
            accel,
            reason: reason.into(),
            fallback: false,
        }
    }
}
