//! crustctl: the CO-side tool of crust.
//!
//! - [`cli`]: the `crustctl` command line (every CSI RPC, `bench`,
//!   `flow`, `demo`).
//! - [`demo`]: the whole stack from nothing: pool, plugin, guest, flow,
//!   and a check that nothing was left behind.
//! - [`parse`]: `key=value` pairs and fsGroupChangePolicy from the command
//!   line.
//!
//! What it drives lives in crates of their own: the CSI client
//! (`crust-csi-client`, re-exported as [`client`] for the tests that reach
//! it through crustctl), the kubelet simulator (`crust-kubesim`), the
//! benchmarks (`crust-bench`) and the printing of results (`crust-report`).

pub mod cli;
pub mod demo;
pub mod parse;

pub use crust_csi_client as client;
