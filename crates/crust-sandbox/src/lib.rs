//! crust-sandbox: a sandbox's life on the host, one library for both front
//! doors (the `crust-runtime` CLI's per-sandbox process and
//! `containerd-shim-crust-v2`). A rule that protects data (claims, the
//! exclusive hold, device identity, path resolution beneath a guest-written
//! tree) lives here once, and both doors call it.
//!
//! - [`settings`]: the `CRUST_RUNTIME_*` settings (flags or environment)
//!   and the [`config::Config`] they make.
//! - [`bundle`]: OCI `config.json` parsing and validation.
//! - [`discovery`]: which mounts are deferred volumes (hand-off lookup with
//!   parent probing bounded by kubelet's `pods/<uid>/volumes`).
//! - [`sandbox`]: the on-disk sandbox state store and claim liveness.
//! - [`claims`]: claiming and releasing hand-off records for a sandbox.
//! - [`handover`]: asking crust-csi to hand a host-published volume over
//!   (and back), with the guest's declared capabilities and filesystems.
//! - [`vm`]: the QEMU guest (adapter over crust-vmm): boot and stop.
//! - [`lifecycle`]: a sandbox's boot and teardown, one sequence each.
//! - [`share`]: the sandbox's virtio-fs share directory on the host.
//! - [`beneath`]: host steps inside a guest-writable tree, by descriptor.
//! - [`plug`]: the one plug (createFilesystem, exclusive hold, hot-plug,
//!   mount, rollback) and release both front doors use.
//! - [`volumes`]: hot-plug, mount, stats and resize of one volume.
//! - [`alias_watch`]: a second loop device on a live volume.
//! - [`workload`]: the runtime CLI's workload, a container on the guest's
//!   own root, with its log on the host.
//! - [`shim`]: the per-sandbox HTTP API (server and client, error codes),
//!   which crust_ops and the CLI call on either door.
//! - [`served`]: what that API serves about a sandbox's volumes, its
//!   metrics and its guest, for both doors.
//! - [`katashim`]: the links Kata's tools look for.
//! - [`net`]: the sandbox's network namespace mirrored into its VM;
//!   [`forward`]: port-forward, the namespace's loopback to the guest's.
//! - [`spec`]: an OCI spec to the guest's container request, mount by
//!   mount (what a VM refuses, refused by name).
//! - [`cgroup`]: the sandbox's cgroup, which QEMU and virtiofsd are born in.
//! - [`resize`]: in-place resize of a container: its cgroup in the guest,
//!   memory and vCPU hot-plug, the balloon.
//! - [`metrics`], [`stats`]: what a sandbox reports.
//! - [`error`]: error causes (their API codes: [`shim::codes`]).

pub mod alias_watch;
pub mod beneath;
pub mod bundle;
pub mod cgroup;
pub mod claims;
pub mod config;
pub mod discovery;
pub mod error;
pub mod forward;
pub mod handover;
pub mod katashim;
pub mod lifecycle;
pub mod metrics;
pub mod net;
pub mod plug;
/// What a sandbox persists (its own crate, so tools read the records
/// without linking the sandbox).
pub use crust_sandbox_records as records;
pub mod resize;
pub mod sandbox;
pub mod served;
pub mod settings;
pub mod share;
pub mod shim;
pub mod spec;
pub mod stats;
pub mod vm;
pub mod volumes;
pub mod workload;
