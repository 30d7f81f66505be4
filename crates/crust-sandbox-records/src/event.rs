//! What became of each handover candidate, kept in the sandbox's state.

use serde::{Deserialize, Serialize};

/// What happened to one candidate mount, kept in the sandbox's state and
/// logged: the "event" of the handover decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeEvent {
    /// The mount source (a host publish target).
    pub target: String,
    pub destination: String,
    /// `handed-over`, or `host`: the host mount is used (shared over
    /// virtio-fs where the sandbox shares binds, else not visible).
    pub outcome: String,
    pub message: String,
    /// HandOver request to the plugin's answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_ms: Option<u64>,
    /// HandOver request to mounted in the guest (includes the guest's boot
    /// when the volume is asked for at sandbox creation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elapsed_ms: Option<u64>,
    /// Hot-plug and mount in the running guest: with `answer_ms`, what a
    /// handover adds to a container's start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plug_ms: Option<u64>,
}

/// [`VolumeEvent::outcome`] of a volume now in the guest.
pub const HANDED_OVER: &str = "handed-over";
/// [`VolumeEvent::outcome`] of a volume left on the host.
pub const ON_HOST: &str = "host";
