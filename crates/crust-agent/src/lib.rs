//! crust-agent: runs inside each crust guest VM and serves the
//! [`crust_agent_proto`] protocol on the virtio-serial port
//! `org.crust.agent`.
//!
//! * Volumes are found by virtio-blk serial, mounted at
//!   `/run/crust/volumes/<volume>` with allow-listed options
//!   ([`options`]), and given Kubernetes fsGroup semantics (`crust_fsgroup`).
//! * Stats come from statvfs; health from the mount table, ext4's error
//!   counter, disk presence and a read probe ([`volume`]).
//! * Containers ([`container`]): every process the host asks for runs in
//!   one, in its own mount namespace over a rootfs shared with virtio-fs
//!   (a pod's containers) or over the guest's own root (the runtime CLI's
//!   workload), with a cgroup, volume binds resolved beneath the volume
//!   root with openat2 ([`subpath`]), exec processes, terminals and stdio
//!   over the second port.
//! * The pod's network ([`network`]): each virtio-net NIC, found by MAC,
//!   gets the name, MTU, addresses, routes and neighbours of the interface
//!   CNI made in the pod's namespace.
//! * Port-forward ([`forward`]): host connections to a pod port reach the
//!   guest's `localhost:<port>` over a third port.
//! * Every request runs on its own thread, so a slow Exec never holds up a
//!   Ping; mount-changing operations are serialized.
//!
//! The agent is not PID 1: the initramfs `/init` (busybox sh) sets up the
//! guest, reaps orphans and restarts the agent if it dies.

pub mod container;
pub mod forward;
pub mod modprobe;
pub mod network;
pub mod options;
pub mod port;
pub mod process;
pub mod server;
pub mod subpath;
pub mod sys;
pub mod volume;

pub use server::{Config, RunFailure, run};
