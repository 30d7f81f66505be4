//! Protocol between the crust host side and `crust-agent`, the agent inside
//! each guest VM.
//!
//! * Transport: the guest's virtio-serial port named [`AGENT_PORT_NAME`];
//!   on the host, the unix socket of QEMU's chardev behind it.
//! * Framing ([`frame`]): 4-byte big-endian length + JSON body, at most
//!   [`frame::MAX_FRAME_LEN`] (1 MiB).
//! * Messages ([`messages`]): every [`Request`] carries an id and a relative
//!   deadline; every [`Response`] echoes the id with a result or an
//!   [`AgentError`] whose [`ErrorCode`] maps onto gRPC codes.
//! * Containers ([`containers`]): several per guest, rootfs over virtio-fs,
//!   their stdio multiplexed on a second port ([`stdio`]).
//! * Port-forward ([`forward`]): host TCP connections carried to the
//!   guest's `localhost` on a third port, with per-stream windows.
//! * Host client ([`AgentClient`], feature `client`, on by default): tokio,
//!   concurrent calls multiplexed by id, per-call timeouts, reconnects.

pub mod containers;
pub mod forward;
pub mod frame;
pub mod messages;
pub mod mux;
pub mod network;
pub mod stdio;
pub mod user;

#[cfg(feature = "client")]
mod client;

#[cfg(feature = "client")]
pub use client::{AgentClient, ClientError, DEFAULT_TIMEOUT};
pub use containers::*;
pub use forward::FORWARD_PORT_NAME;
pub use frame::{FrameDecoder, FrameError, MAX_FRAME_LEN};
pub use messages::*;
pub use network::{
    ConfigureNetwork, ConfigureNetworkReply, GuestRules, NetAddress, NetInterface, NetNeighbour,
    NetRoute, RouteScope,
};
pub use stdio::STDIO_PORT_NAME;

/// Name of the virtio-serial port (`virtserialport,name=...`).
pub const AGENT_PORT_NAME: &str = "org.crust.agent";

/// Bumped on incompatible wire changes; reported by [`PingReply`].
pub const PROTOCOL_VERSION: u32 = 2;

/// Where the agent mounts volume `<v>`: `/run/crust/volumes/<v>`.
pub const GUEST_VOLUME_ROOT: &str = "/run/crust/volumes";

/// Cap on each of [`ExecReply::stdout`] and [`ExecReply::stderr`].
pub const MAX_EXEC_OUTPUT: usize = 256 * 1024;
