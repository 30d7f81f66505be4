//! crust's CSI plugin: Identity, Controller and Node services for local
//! block volumes (a pool of sparse files on loop devices, or
//! pre-provisioned block devices), ext4/xfs or raw block, with online
//! expansion, capacity, node topology and volume health; KEP-2857
//! deferred filesystem operations (the volume's device is handed to the
//! pod's VM runtime through crust_ops, in process), runtime-driven
//! deferral (the `Handover` service: a VM runtime takes a host-published
//! volume into its guest, see [`handover`]) and Prometheus metrics.
//!
//! Run it with [`serve`] (the `crust-csi` binary is a thin wrapper):
//!
//! ```no_run
//! # async fn run() -> Result<(), crust_csi::ServeError> {
//! let cfg = crust_csi::Config::pool(
//!     "/run/crust-csi/csi.sock".into(),
//!     "/var/lib/crust-csi".into(),
//!     "/var/lib/crust-csi/pool".into(),
//!     10 << 30,
//! );
//! crust_csi::serve(cfg, async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```

pub mod caps;
pub mod config;
pub mod controller;
mod defer;
mod driver;
pub mod error;
pub mod group_controller;
pub mod guard;
pub mod handover;
pub mod health;
pub mod history;
pub mod identity;
pub mod metrics;
pub mod node;
mod paging;
pub mod peer;
mod placeholder;
pub mod qos;
pub mod records;
pub mod server;
pub mod snapshot;
pub mod state;
pub mod subpath_binds;
pub mod surface;
mod volume_health;
mod workers;

pub use config::{
    BackendConfig, Cli, Config, CsiSpec, DEFAULT_DRIVER_NAME, DEFAULT_HANDOVER_ENDPOINT,
    DEFAULT_VOLUME_SIZE, DeferralConfig, Expansion, Gate, HANDOVER_CRASH_ENV, Hooks, PeerConfig,
};
pub use driver::Driver;
pub use error::{ControllerError, HandoverError, IdentityError, NodeError, PeerError, ServeError};
pub use records::volume_id_for;
pub use server::{build_backend, serve, serve_with_backend};

/// Caps glibc's malloc at two arenas. With one arena per busy thread
/// (tokio workers, blocking pool, health workers) the plugin's resident
/// memory at 1,024 volumes was 73 MiB instead of 20; the plugin is not
/// allocation-bound. Call first thing in `main`, before any thread starts.
pub fn limit_malloc_arenas() {
    crust_sys::malloc::limit_arenas(2);
}
