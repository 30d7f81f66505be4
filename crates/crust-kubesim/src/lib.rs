//! crust-kubesim: plays kubelet and the container manager for one pod, the
//! way a node would, so the demo, the benchmarks and the end-to-end tests
//! drive crust the way Kubernetes does.
//!
//! - [`flow`]: one pod with deferred filesystem operations (KEP-2857 story
//!   1), step by step, with teardown.
//! - [`runtime_cli`]: runs the `crust-runtime` binary (the container
//!   manager's side).
//! - [`dirs`]: the directories kubelet creates before a CSI call.

pub mod dirs;
pub mod flow;
pub mod runtime_cli;
