//! crust-runtime: the runtime-CLI door to a crust sandbox. It runs an OCI
//! bundle's process in a QEMU guest, hands the bundle's deferred volumes
//! (found through the KEP-2857 and Kata hand-off records) to the guest as
//! virtio-blk devices, has the guest agent mount them (options, fsGroup,
//! subPath), and serves stats and online resize from inside the guest.
//! What a sandbox is and does lives in crust-sandbox, which the
//! containerd shim calls too; this crate is the CLI's adapter over it.
//!
//! Process model: the `crust-runtime` CLI is short-lived; `create` spawns
//! one detached process per sandbox (`crust-runtime shim --id ID`,
//! [`controller`]) that owns QEMU, its QMP connection and the agent client,
//! and serves the sandbox API on `<root>/<id>/shim.sock`. Every later
//! command talks to that socket, always with a timeout.
//!
//! - [`cli`]: flags and verbs ([`poll`]: the per-poll fast path).
//! - [`runtime`]: the CLI side of every command.
//! - [`controller`]: the per-sandbox process.

pub mod cli;
pub mod controller;
pub mod runtime;

// The per-poll verbs are the CLI's fast path; their old path stays.
pub use cli::poll;
