//! crust-runtime: the VM runtime. It runs an OCI bundle's process in a
//! QEMU guest, hands the bundle's deferred volumes (found through the
//! KEP-2857 and Kata hand-off records) to the guest as virtio-blk devices,
//! has the guest agent mount them (options, fsGroup, subPath), and serves
//! stats and online resize from inside the guest.
//!
//! Process model: the `crust-runtime` CLI is short-lived; `create` spawns
//! one detached shim per sandbox (`crust-runtime shim --id ID`) that owns
//! QEMU (crust-vmm), its QMP connection (crust-qmp) and the agent client
//! (crust-agent-proto), and serves the shim API on `<root>/<id>/shim.sock`.
//! Every later command talks to that socket, always with a timeout.
//!
//! - [`bundle`]: OCI `config.json` parsing and validation.
//! - [`discovery`]: which mounts are deferred volumes (hand-off lookup with
//!   parent probing bounded by kubelet's `pods/<uid>/volumes`).
//! - [`sandbox`]: the on-disk sandbox state store and claim liveness.
//! - [`shim`]: the shim's HTTP API (server and client, error codes).
//! - [`claims`]: claiming and releasing hand-off records for a sandbox.
//! - [`handover`]: asking crust-csi to hand a host-published volume over
//!   (and back), with the guest's declared capabilities and filesystems.
//! - [`controller`]: the shim process itself.
//! - [`vm`]: the QEMU guest (adapter over crust-vmm).
//! - [`share`]: the sandbox's virtio-fs share directory on the host.
//! - [`plug`]: the one plug (createFilesystem, exclusive hold, hot-plug,
//!   mount, rollback) and release both front doors use.
//! - [`beneath`]: host steps inside a guest-writable tree, by descriptor.
//! - [`volumes`]: hot-plug, mount, stats and resize of one volume.
//! - [`runtime`]: the CLI side of every command.
//! - [`stats`]: JSON shapes of stats and resize.
//! - [`cli`], [`config`], [`error`]: flags, settings, error causes (their
//!   API codes: [`shim::codes`]).

pub mod alias_watch;
pub mod beneath;
pub mod bundle;
pub mod claims;
pub mod cli;
pub mod config;
pub mod controller;
pub mod discovery;
pub mod error;
pub mod handover;
pub mod katashim;
pub mod metrics;
pub mod plug;
/// What a sandbox persists (its own crate, so tools read the records
/// without linking the runtime).
pub use crust_sandbox_records as records;
pub mod runtime;
pub mod sandbox;
pub mod share;
pub mod shim;
pub mod stats;
pub mod vm;
pub mod volumes;

// The per-poll verbs are the CLI's fast path; their old path stays.
pub use cli::poll;
