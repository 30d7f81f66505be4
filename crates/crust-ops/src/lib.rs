//! crust_ops: the KEP-2857 `Runtime` service.
//!
//! A CSI plugin that defers filesystem operations to the pod's runtime
//! calls [`CrustOps`] in process (or the `crust-ops` daemon over a unix
//! socket). Stage/unstage write and remove the hand-off record
//! ([`crust_handoff`]); stats and expand run the consuming runtime's CLI:
//!
//! - CRUST layout: `<runtime-cli> crust stats <target>` and
//!   `<runtime-cli> crust resize <target> <min> <max>` (0 = unspecified),
//!   the CLI taken from the record's `runtime-cli` file;
//! - Kata layout: `<kata-runtime> direct-volume stats --volume-path P` and
//!   `direct-volume resize --volume-path P --size N`.
//!
//! Stage refuses a device that is mounted or held ([`crust_blockdev::ensure_device_free`])
//! and flags outside crust's one allow-list ([`crust_fs::options`]).
//! Unstage of a record that a sandbox claims needs positive proof that the
//! sandbox is gone: its runtime's typed `crust sandbox-state` answer
//! ([`crust_handoff::liveness`]) or, for Kata, no shim answering, and in
//! both cases a free device (see [`CrustOps::unstage`]). Nothing a guest
//! can write (stats messages) decides a claim.
//!
//! [`CrustOps`] is synchronous: record I/O and the runtime CLI run on the
//! caller's thread (the plugin's request thread; the daemon's blocking
//! pool), so no call crosses between sync and async code.
//!
//! Status codes: see [`OpsError`].

pub mod cli;
mod error;
mod ops;
pub mod parse;
pub mod server;
pub mod service;

pub use error::OpsError;
pub use ops::{
    ClaimantState, CrustOps, DEFAULT_CLI_TIMEOUT, DEFAULT_KATA_RUNTIME, DEFAULT_KATA_SHIM_DIRS,
    DeviceClaim, ExpandRequest, KATA_SHIM_SOCKET, LayoutMode, LimitsApplied, OpsConfig,
    StageRequest,
};
pub use parse::{UsageUnit, VolumeCondition, VolumeStats, VolumeUsage};
pub use service::RuntimeService;

/// Default socket of the daemon.
pub const DEFAULT_ENDPOINT: &str = "unix:///run/crust/ops.sock";
