//! crust's node installer, the `kata-deploy` of crust: puts the runtime
//! pieces (`crust-runtime`, `containerd-shim-crust-v2`, QEMU, `virtiofsd`,
//! the guest image) on a Kubernetes node under one prefix (`/opt/crust`),
//! self-contained (every binary carries its libraries and loader under
//! `<prefix>/lib`; nothing is taken from the host), writes a containerd
//! drop-in for the `crust` RuntimeClass handler in the host's config
//! format, and removes exactly that on uninstall.
//!
//! The binary runs in the node-install DaemonSet with the host's `/`
//! mounted at `--host-root`; the tests run the same functions against a
//! temporary directory.

pub mod containerd;
pub mod install;
pub mod label;

pub use containerd::Version;
pub use install::{Manifest, Options, PayloadInfo, Report, RootAction, install, uninstall};
