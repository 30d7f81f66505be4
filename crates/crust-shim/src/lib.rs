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
//! - [`pod`]: the pod's VM, share, volumes; its lifecycle routines are crust-sandbox's.
//! - [`vm`]: the handles of a booted pod VM.
//! - [`resize`]: in-place resize (task Update): cgroup limits in the guest,
//!   memory and vCPU hot-plug, the balloon.
//! - [`shimapi`]: the crust shim API of the pod (`crust stats|resize`).
//! - [`spec`]: OCI spec → guest container request, mount by mount.
//! - [`io`]: stdio FIFOs ↔ the guest's stdio port.
//! - [`forward`]: port-forward, the pod namespace's loopback ↔ the guest's.
//! - [`cgroup`]: the VM in the sandbox's cgroup.
//! - [`config`]: settings from the environment.

pub mod bootstrap;
pub mod cgroup;
pub mod config;
pub mod forward;
pub mod io;
pub mod net;
pub mod pod;
pub mod resize;
pub mod shimapi;
pub mod spec;
pub mod start_reply;
pub mod task;
pub mod vm;
