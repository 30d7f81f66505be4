//! crustctl: the CO-side tool of crust.
//!
//! - [`client::Csi`]: Identity, Controller and Node clients of one CSI
//!   endpoint over one channel, with a per-call deadline.
//! - [`cli`]: the `crustctl` command line (every CSI RPC, `bench`,
//!   `flow`, `demo`).
//! - [`flow`]: plays kubelet for one pod with deferred filesystem
//!   operations (KEP-2857 story 1), step by step, with teardown.
//! - [`demo`]: the whole stack from nothing: pool, plugin, guest, flow,
//!   and a check that nothing was left behind.
//! - [`runtime_cli`]: runs the `crust-runtime` binary.
//! - [`bench`]: a driver-agnostic CSI load generator ([`bench::run_bench`]).
//! - [`fmt`]: text and JSON rendering of CSI responses.
//! - [`parse`]: sizes, `key=value` pairs and durations from the command line.

pub mod bench;
pub mod cli;
pub mod client;
pub mod demo;
pub mod dirs;
pub mod flow;
pub mod fmt;
pub mod parse;
pub mod runtime_cli;
