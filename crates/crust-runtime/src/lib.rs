//! crust-runtime: the VM runtime. It runs an OCI bundle's process in a
//! QEMU guest, hands the bundle's deferred volumes (found through the
//! KEP-2857 and Kata hand-off records) to the guest as virtio-blk devices,
//! has the guest agent mount them, and serves stats and online resize from
//! inside the guest.
//!
//! - [`bundle`]: OCI `config.json` parsing and validation.
//! - [`discovery`]: which mounts are deferred volumes (hand-off lookup).
//! - [`sandbox`]: the on-disk sandbox state store.
//! - [`shim`]: the per-sandbox shim's HTTP API (server and client).
//! - [`stats`]: JSON shapes of stats and resize.

pub mod bundle;
pub mod discovery;
pub mod sandbox;
pub mod shim;
pub mod stats;
pub mod cli;
pub mod config;
pub mod controller;
pub mod error;
pub mod runtime;
pub mod vm;
pub mod volumes;
