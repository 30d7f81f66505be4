//! Everything persisted about one sandbox (`<root>/<id>/state.json`,
//! stored by `crust_sandbox::sandbox`).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Volume, VolumeEvent, WorkloadMount};

/// The OCI runtime spec version the `state` output follows.
pub const OCI_VERSION: &str = "1.0.2";

/// OCI lifecycle status, plus `creating` while the shim sets up the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Creating,
    Created,
    Running,
    Stopped,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Creating => "creating",
            Status::Created => "created",
            Status::Running => "running",
            Status::Stopped => "stopped",
        }
    }
}

/// What QEMU opened for a plugged volume, and how it does the I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeIo {
    #[serde(flatten)]
    pub io: crust_qmp::BlockIo,
    /// The loop device's backing file, the loop driver skipped
    /// (`crust_blockdev::route`); false: the device itself.
    #[serde(default)]
    pub backing_file: bool,
}

impl std::fmt::Display for VolumeIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on = if self.backing_file {
            "the loop device's backing file"
        } else {
            "the device"
        };
        write!(f, "{on}, {}", self.io)
    }
}

/// A process identified by pid and start time (so a recycled pid is not
/// mistaken for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcRef {
    pub pid: i32,
    pub start_time: u64,
}

impl ProcRef {
    pub fn of(pid: i32) -> Option<ProcRef> {
        proc_start_time(pid).map(|start_time| ProcRef { pid, start_time })
    }

    pub fn current() -> ProcRef {
        ProcRef::of(std::process::id() as i32).expect("/proc/self/stat is readable")
    }

    /// Still running (not a zombie) and still the same process.
    pub fn alive(&self) -> bool {
        proc_start_time(self.pid) == Some(self.start_time)
    }
}

/// Start time (clock ticks since boot) of a live, non-zombie process.
pub fn proc_start_time(pid: i32) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: skip past the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is the state (field 3), starttime is field 22.
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// A host path bound into the sandbox's virtio-fs share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharedMount {
    pub destination: String,
    pub source: String,
    /// Path inside the share (`m<i>`).
    pub path: String,
    pub readonly: bool,
}

/// Everything persisted about one sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxState {
    pub oci_version: String,
    pub id: String,
    pub status: Status,
    /// OCI `pid`: the host process hosting the workload (QEMU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    pub bundle: PathBuf,
    #[serde(default)]
    pub shim: Option<ProcRef>,
    #[serde(default)]
    pub qemu: Option<ProcRef>,
    /// The guest's accelerator and why it was chosen (a hanging KVM boot
    /// retried under TCG shows `fallback: true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accel: Option<crate::AccelChoice>,
    #[serde(default)]
    pub volumes: Vec<Volume>,
    /// How QEMU does each plugged volume's I/O (on what, O_DIRECT or
    /// not, the engine), by target path.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub block_io: std::collections::BTreeMap<String, VolumeIo>,
    #[serde(default)]
    pub mounts: Vec<WorkloadMount>,
    /// Host-path mounts without a hand-off record (not visible in the guest).
    #[serde(default)]
    pub skipped_mounts: Vec<String>,
    /// Host-path mounts without a hand-off record shared into the guest
    /// over virtio-fs (`--share-binds`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared_mounts: Vec<SharedMount>,
    /// Mount sources crust-csi was asked to hand over, recorded before
    /// asking: the plugin may write a record claimed by this sandbox,
    /// which teardown releases and hands back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handover_asked: Vec<String>,
    /// What became of each handover candidate (handed over with its
    /// latency, or left on the host and why).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<VolumeEvent>,
    /// The workload's exit code once it has exited.
    #[serde(default)]
    pub exit_status: Option<i32>,
    /// Why the sandbox stopped abnormally (e.g. QEMU exited).
    #[serde(default)]
    pub reason: Option<String>,
    /// Seconds since the epoch.
    pub created: u64,
    #[serde(default)]
    pub annotations: std::collections::BTreeMap<String, String>,
    /// The pod's network namespace whose interfaces the guest mirrors, and
    /// those interfaces: what a dead shim's cleanup detaches (taps, tc).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network_links: Vec<String>,
}

impl SandboxState {
    /// A sandbox being created from the bundle in `dir`, nothing started.
    pub fn for_bundle_dir(id: &str, dir: std::path::PathBuf) -> SandboxState {
        SandboxState {
            oci_version: OCI_VERSION.into(),
            id: id.into(),
            status: Status::Creating,
            pid: None,
            bundle: dir,
            shim: None,
            qemu: None,
            accel: None,
            volumes: Vec::new(),
            block_io: Default::default(),
            mounts: Vec::new(),
            skipped_mounts: Vec::new(),
            shared_mounts: Vec::new(),
            handover_asked: Vec::new(),
            events: Vec::new(),
            exit_status: None,
            reason: None,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            annotations: Default::default(),
            network_namespace: None,
            network_links: Vec::new(),
        }
    }

    /// Whether this sandbox still holds its volumes (the hand-off claim's
    /// liveness test): its QEMU runs (whether or not its shim does), or,
    /// before QEMU is launched, its shim runs and is still creating it. A
    /// sandbox whose workload exited still holds them: the guest keeps them
    /// mounted until delete.
    pub fn holds_volumes(&self) -> bool {
        // A QEMU that outlived its shim (stuck in the kernel after the
        // shim died) may still have the devices open.
        if self.qemu.is_some_and(|q| q.alive()) {
            return true;
        }
        self.qemu.is_none()
            && self.status != Status::Stopped
            && self.shim.is_some_and(|s| s.alive())
    }

    /// The status as seen from outside: a sandbox whose shim is gone is
    /// stopped whatever the file says.
    pub fn effective(mut self) -> SandboxState {
        if self.status != Status::Stopped && !self.shim.is_some_and(|s| s.alive()) {
            self.status = Status::Stopped;
            self.reason
                .get_or_insert_with(|| "the sandbox's shim is not running".into());
        }
        self
    }
}
