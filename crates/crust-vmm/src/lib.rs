//! Launch and manage one QEMU guest for crust.
//!
//! The machine is `q35` (TCG or KVM) booting the crust guest image
//! (`guest/build-image.sh`) directly, with qboot when installed:
//!
//! * `-nodefaults -no-user-config -nographic -no-reboot`: a guest
//!   power-off or reset ends QEMU (exit status 0);
//! * serial console → `<run_dir>/console.log`, QEMU's own output →
//!   `qemu.log`;
//! * QMP on `<run_dir>/qmp.sock` (server, no wait);
//! * a `virtserialport` named `org.crust.agent` on `<run_dir>/agent.sock`
//!   (server, no wait), for `crust_agent_proto::AgentClient`, and one named
//!   `org.crust.stdio` on `stdio.sock` for container stdio and one named
//!   `org.crust.forward` on `forward.sock` for port-forward;
//! * each boot disk as `-blockdev` (raw over `host_device`/`file`,
//!   `cache.direct=off`, `aio=threads`) + `virtio-blk-pci` with its serial,
//!   on its own `pcie-root-port` `crust-boot<i>`;
//! * `hotplug_ports` empty `pcie-root-port`s `crust-hp0..` for hot-plug;
//! * each [`ShareSpec`] as a `vhost-user-fs-pci` device served by its own
//!   `virtiofsd` (socket `fs<i>.sock`, log `virtiofsd<i>.log`), with guest
//!   RAM from a shared memfd (`memory-backend-memfd,share=on` + one NUMA
//!   node). The daemons belong to the VM: started before QEMU, killed with
//!   it, and a daemon that dies takes QEMU down (a guest whose virtio-fs
//!   stops answering would hang rather than fail).
//!
//! # Hot-plug contract (for the runtime, over QMP)
//!
//! ```text
//! blockdev-add  <DiskSpec::blockdev_add_args()>
//! device_add    <DiskSpec::device_add_args(port)>   port ∈ Vm::hotplug_ports(), unused
//! ... guest agent MountVolume { serial } finds the disk by serial ...
//! device_del    { "id": DiskSpec::device_id() }      then wait for DEVICE_DELETED
//! blockdev-del  { "node-name": DiskSpec::node_name() }
//! ```
//! The guest kernel handles the hot-plug (ACPI PCI hot-plug on q35 roots
//! ports; unplug completes in well under a second). Boot disks can be
//! unplugged the same way (their ports are in [`Vm::boot_disks`]).
//!
//! # Lifecycle
//!
//! [`Vm::launch`] returns once QEMU's sockets exist; the guest boots in the
//! background (wait with the agent client's `wait_ready`). [`Vm::boot`]
//! also waits for the agent and, under `Accel::Auto`, boots again under
//! TCG when a KVM boot hangs (see [`accel`] for how KVM is proven). A launched `Vm`
//! kills and reaps QEMU on drop unless [`Vm::detach`]ed; another process
//! finds it again with [`Vm::attach`]`(run_dir)` (pid + start time +
//! command line check against `vm.json`).

mod boot;
mod config;
mod vm;

use std::path::PathBuf;
use std::time::Duration;

pub mod accel;

pub use accel::{AccelChoice, ResolvedAccel, auto_overhead, kvm_usable};
pub use config::{
    Accel, DEFAULT_ACCEL_CACHE, DEFAULT_KVM_BOOT_TIMEOUT, DEFAULT_KVM_PROBE_TIMEOUT, DiskSpec,
    MAX_ROOT_PORTS, MAX_SERIAL_LEN, MAX_SHARES, MAX_TAG_LEN, MEMORY_SLOTS, NicSpec, QBOOT,
    ShareSpec, USER_NET_DNS, USER_NET_GATEWAY, USER_NET_GUEST, USER_NET_MAC, USER_NET_PREFIX,
    VHOST_NET, VIRTIOFSD_ARGS, VmConfig, boot_port_id, hotplug_port_id, valid_serial,
};
pub use vm::{RunPaths, Vm, VmExit, VmState, open_cgroup_procs, tail};

/// Name of the agent's virtio-serial port (matches
/// `crust_agent_proto::AGENT_PORT_NAME`).
pub const AGENT_PORT_NAME: &str = "org.crust.agent";

/// Name of the container stdio port (matches
/// `crust_agent_proto::STDIO_PORT_NAME`).
pub const STDIO_PORT_NAME: &str = "org.crust.stdio";

/// Name of the port-forward port (matches
/// `crust_agent_proto::FORWARD_PORT_NAME`).
pub const FORWARD_PORT_NAME: &str = "org.crust.forward";

/// Errors launching, finding or stopping a VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("invalid VM config: {0}")]
    InvalidConfig(String),
    #[error("a QEMU (pid {pid}) is already running from {run_dir}")]
    AlreadyRunning { run_dir: PathBuf, pid: u32 },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start {binary}: {source} (is qemu-system-x86 installed?)")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("QEMU exited while starting ({status}); qemu.log ends with:\n{log_tail}")]
    EarlyExit { status: String, log_tail: String },
    #[error("QEMU did not create its sockets within {after:?}; qemu.log ends with:\n{log_tail}")]
    StartTimeout { after: Duration, log_tail: String },
    #[error("the guest agent did not come up within {after:?} under {accel}: {reason}\n{context}")]
    NotReady {
        after: Duration,
        accel: &'static str,
        reason: String,
        context: String,
    },
    #[error("cannot start virtiofsd for share {tag:?}: {reason}")]
    Virtiofsd { tag: String, reason: String },
    #[error("no VM running from {run_dir}: {reason}")]
    NotRunning { run_dir: PathBuf, reason: String },
}
