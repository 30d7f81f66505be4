//! crustctl: the CO-side tool of crust.
//!
//! - [`client::Csi`]: Identity, Controller and Node clients of one CSI
//!   endpoint over one channel, with a per-call deadline.
//! - [`cli`]: the `crustctl` command line (every CSI RPC, `bench`).
//! - [`bench`]: a driver-agnostic CSI load generator ([`bench::run_bench`]).
//! - [`fmt`]: text and JSON rendering of CSI responses.
//! - [`parse`]: sizes, `key=value` pairs and durations from the command line.

pub mod bench;
pub mod cli;
pub mod client;
pub mod fmt;
pub mod parse;
