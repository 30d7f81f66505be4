//! crust's node installer, the `kata-deploy` of crust: puts the runtime
//! pieces (`crust-runtime`, `containerd-shim-crust-v2`, QEMU, `virtiofsd`,
//! the guest image) on a Kubernetes node under one prefix (`/opt/crust`),
//! self-contained (every binary carries its libraries and loader under
//! `<prefix>/lib`; nothing is taken from the host), writes a containerd
//! drop-in for the `crust` RuntimeClass handler in the host's config
//! format, and removes exactly that on uninstall.
//!
//! **Links and special files on the host are refused, not followed.**
//! Every host path is walked without following symbolic links
//! ([`hostfs`]), and only regular files are read or replaced. Following
//! them deliberately (and restoring them at uninstall) was weighed and
//! rejected: where a distribution links containerd's config, the link
//! points into a tree the node's own tooling owns and often mounts
//! read-only (Flatcar keeps its default under `/usr/share/containerd`,
//! NixOS's `/etc` entries are links into the read-only `/nix/store`), so writing through the
//! link fails or is undone by that tooling, and replacing the link with a
//! file silently forks the node from it. Under `--host-root`, an absolute
//! link would also resolve inside the installer's container, not on the
//! host. The error names the link and its target so the operator can make
//! the choice (copy the file in place, or pass the real path); a config
//! that is not TOML is reported by line and column, never quoted. The
//! install record is written before anything else and kept a superset of
//! what exists, so a failure or crash at any step is undone (see
//! [`install::install`]).
//!
//! The binary runs in the node-install DaemonSet with the host's `/`
//! mounted at `--host-root`; the tests run the same functions against a
//! temporary directory.

pub mod containerd;
pub mod error;
pub mod hostfs;
pub mod install;
#[cfg(feature = "apiserver")]
pub mod label;

pub use containerd::Version;
pub use install::{
    InstallError, Manifest, Options, PayloadInfo, Report, RootAction, Step, install, uninstall,
};
