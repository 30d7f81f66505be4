//! `containerd-shim-crust-v2` (runtime type `io.containerd.crust.v2`):
//! containerd's shim v2 for crust. One shim process and one VM per pod:
//! the pod's first container (the CRI sandbox, or a lone `ctr run`
//! container) boots the VM, every other container of the pod (CRI
//! annotations) runs in it through the same shim.
//!
//! - [`bootstrap`]: `start` / serve / `delete`, the ttrpc server (task API
//!   v2 and v3 on one socket).
//! - [`start_reply`]: answering `start` in the caller's format (containerd
//!   1.x, 2.0–2.2, 2.3+).
//! - [`task`]: the task service.
//! - [`pod`]: the pod's VM, share, volumes; its lifecycle routines, OCI
//!   spec translation, cgroup, resize and port-forward are crust-sandbox's.
//! - [`shimapi`]: the crust shim API of the pod (`crust stats|resize`).
//! - [`io`]: stdio FIFOs ↔ the guest's stdio port.
//! - [`config`]: settings from the environment.

pub mod bootstrap;
pub mod config;
pub mod io;
pub mod net;
pub mod pod;
pub mod shimapi;
pub mod start_reply;
pub mod task;
