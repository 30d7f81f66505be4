//! Containers in the guest: several per guest (the containers of one pod),
//! each in its own root filesystem (a virtio-fs share) and mount
//! namespace, with processes whose stdio travels over the stdio port
//! ([`crate::stdio`]).
//!
//! Lifecycle, as the OCI runtime spec has it: [`CreateContainer`] sets up
//! the rootfs and mounts and leaves the init process waiting before
//! `exec`; [`StartContainer`] lets it run; [`ExecProcess`] adds a process
//! to a running container; [`WaitProcess`] reports an exit; once nothing
//! runs [`RemoveContainer`] frees everything.
//!
//! Wire example: `{"id": 4, "op": "create_container", "args": {"id": "c1",
//! "rootfs": {"kind": "share", "tag": "pod", "path": "c1/rootfs"},
//! "process": {"args": ["sh"], "stdio": {"stream": 3, "stdout": true}},
//! "mounts": [{"destination": "/proc", "source": {"kind": "proc"}}]}}`.

use serde::{Deserialize, Serialize};

use crate::user::WorkloadUser;

/// Where the virtio-fs share `<tag>` is mounted in the guest:
/// `/run/crust/shares/<tag>`.
pub const GUEST_SHARE_ROOT: &str = "/run/crust/shares";

/// A path inside a virtio-fs share: relative, normalized, no `..`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareRef {
    pub tag: String,
    pub path: String,
}

/// A container's root filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Rootfs {
    /// A directory of a virtio-fs share (an image's rootfs).
    Share(ShareRef),
    /// The guest's own root, bound into the container's mount namespace:
    /// the runtime CLI's workload, which runs on the guest's tools.
    Guest,
}

/// Which streams of a process travel over the stdio port, and under which
/// stream id (chosen by the host, unique per guest, never 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdioSpec {
    /// 0: no stdio at all (everything on /dev/null).
    #[serde(default)]
    pub stream: u32,
    #[serde(default)]
    pub stdin: bool,
    #[serde(default)]
    pub stdout: bool,
    #[serde(default)]
    pub stderr: bool,
}

/// An OCI `process.rlimits` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    /// `RLIMIT_NOFILE`, ...
    #[serde(rename = "type")]
    pub kind: String,
    pub soft: u64,
    pub hard: u64,
}

/// What runs: the OCI `process` of a container or an exec.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ProcessSpec {
    /// argv; `args[0]` is looked up in the process's `PATH`.
    pub args: Vec<String>,
    /// `KEY=VALUE`; exactly the environment of the process.
    #[serde(default)]
    pub env: Vec<String>,
    /// Working directory inside the container (created if missing); `/`.
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub user: Option<WorkloadUser>,
    #[serde(default)]
    pub rlimits: Vec<Rlimit>,
    /// A pseudo-terminal as stdin/stdout/stderr (stderr merges into stdout).
    #[serde(default)]
    pub terminal: bool,
    #[serde(default)]
    pub no_new_privileges: bool,
    /// OCI `process.capabilities`; `None` leaves the process every
    /// capability (as runc does for a spec without the section).
    #[serde(default)]
    pub capabilities: Option<Capabilities>,
    /// OCI `process.oomScoreAdj` (-1000..=1000); none leaves the agent's.
    #[serde(default)]
    pub oom_score_adj: Option<i32>,
    #[serde(default)]
    pub stdio: StdioSpec,
}

/// The five capability sets, as `CAP_*` names.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Capabilities {
    #[serde(default)]
    pub bounding: Vec<String>,
    #[serde(default)]
    pub effective: Vec<String>,
    #[serde(default)]
    pub permitted: Vec<String>,
    #[serde(default)]
    pub inheritable: Vec<String>,
    #[serde(default)]
    pub ambient: Vec<String>,
}

/// The source of a container mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MountSource {
    /// A file or directory of a virtio-fs share (bind mount).
    Share(ShareRef),
    /// A deferred volume mounted by MountVolume, or a subPath of it.
    Volume {
        volume: String,
        #[serde(default)]
        subpath: Option<String>,
    },
    /// The pod's shared memory (one tmpfs per guest, for `/dev/shm`).
    PodShm,
    Tmpfs,
    Proc,
    Sysfs,
    Devpts,
    Mqueue,
    Cgroup,
}

/// One mount of the container, in OCI order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerMount {
    /// Absolute path in the container.
    pub destination: String,
    pub source: MountSource,
    #[serde(default)]
    pub readonly: bool,
    /// Other OCI options: `nosuid`, `nodev`, `noexec`, and for tmpfs,
    /// devpts and mqueue their data options (`size=`, `mode=`, ...).
    #[serde(default)]
    pub options: Vec<String>,
    /// A share source's host mounts below it (relative paths): reached
    /// before the bind, so they come with it as mounts of their own and a
    /// read-only bind leaves them their own flags, as runc's does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub submounts: Vec<String>,
}

/// Create a container: mount namespace, rootfs, mounts; the init process
/// waits before `exec` until [`StartContainer`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateContainer {
    /// `[A-Za-z0-9._-]`, at most 128 bytes.
    pub id: String,
    pub rootfs: Rootfs,
    #[serde(default)]
    pub rootfs_readonly: bool,
    pub process: ProcessSpec,
    #[serde(default)]
    pub mounts: Vec<ContainerMount>,
    /// OCI `linux.maskedPaths` / `linux.readonlyPaths`.
    #[serde(default)]
    pub masked_paths: Vec<String>,
    #[serde(default)]
    pub readonly_paths: Vec<String>,
    /// The container's memory limit in the guest (cgroup `memory.max`).
    #[serde(default)]
    pub memory_limit_bytes: Option<u64>,
    /// Raw block devices (Kubernetes `volumeDevices`), hot-plugged first.
    #[serde(default)]
    pub devices: Vec<BlockDevice>,
    /// The container's IPC namespace (OCI `linux.namespaces`).
    #[serde(default)]
    pub ipc: NamespaceSource,
    /// The container's UTS namespace.
    #[serde(default)]
    pub uts: NamespaceSource,
    /// OCI `hostname`, set in a new UTS namespace (empty: the guest's).
    #[serde(default)]
    pub hostname: String,
    /// The container's PID namespace: a new one makes its init PID 1 and
    /// hides the agent; the pod's when CRI shares it.
    #[serde(default)]
    pub pid: NamespaceSource,
    /// OCI `linux.sysctl`: namespaced ones only (see [`sysctl_namespace`]).
    #[serde(default)]
    pub sysctl: std::collections::BTreeMap<String, String>,
    /// OCI `linux.seccomp`, for the container's process and every exec.
    #[serde(default)]
    pub seccomp: Option<Seccomp>,
    /// The container's user namespace and its mappings (checked by
    /// [`check_user_namespace`]).
    #[serde(default)]
    pub user: UserNamespace,
}

impl CreateContainer {
    /// A container of `process` on `rootfs` with nothing else: no mounts,
    /// the guest's namespaces, no limit, no filter.
    pub fn new(id: impl Into<String>, rootfs: Rootfs, process: ProcessSpec) -> CreateContainer {
        CreateContainer {
            id: id.into(),
            rootfs,
            rootfs_readonly: false,
            process,
            mounts: Vec::new(),
            masked_paths: Vec::new(),
            readonly_paths: Vec::new(),
            memory_limit_bytes: None,
            devices: Vec::new(),
            ipc: NamespaceSource::default(),
            uts: NamespaceSource::default(),
            hostname: String::new(),
            pid: NamespaceSource::default(),
            sysctl: std::collections::BTreeMap::new(),
            seccomp: None,
            user: UserNamespace::default(),
        }
    }
}

/// One line of a user namespace's uid or gid map (OCI `linux.uidMappings`
/// / `gidMappings` entry): ids `container_id..container_id+size` in the
/// container are `host_id..` in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdMapping {
    #[serde(rename = "containerID")]
    pub container_id: u32,
    #[serde(rename = "hostID")]
    pub host_id: u32,
    pub size: u32,
}

/// A container's user namespace: the guest's (none in the spec), a new one
/// with these mappings, or the pod's (CRI: the sandbox's; its own mappings
/// apply).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct UserNamespace {
    #[serde(default)]
    pub source: NamespaceSource,
    #[serde(default)]
    pub uid_mappings: Vec<IdMapping>,
    #[serde(default)]
    pub gid_mappings: Vec<IdMapping>,
}

/// Lines the kernel takes in one uid_map or gid_map (since 4.15).
pub const MAX_ID_MAP_LINES: usize = 340;
/// The last valid id: `u32::MAX` is `(uid_t)-1`, "no id", in every
/// namespace, the guest's included.
pub const LAST_ID: u32 = u32::MAX - 1;

/// The one check of a container's user namespace, made by the shim before
/// a VM boots and by the agent for every caller: mappings the kernel would
/// take (ids within the guest's, no overlap, no empty range, at most
/// [`MAX_ID_MAP_LINES`]), the process's ids mapped, and every crust volume
/// (`(destination, fstype)`) on a filesystem the guest can idmap. Errors
/// name the field.
pub fn check_user_namespace(
    user: &UserNamespace,
    process: Option<&WorkloadUser>,
    volumes: &[(&str, &str)],
) -> Result<(), String> {
    if user.source == NamespaceSource::Guest {
        for (field, m) in [
            ("uidMappings", &user.uid_mappings),
            ("gidMappings", &user.gid_mappings),
        ] {
            if !m.is_empty() {
                return Err(format!(
                    "linux.{field} without a user namespace in linux.namespaces"
                ));
            }
        }
        return Ok(());
    }
    let new = matches!(user.source, NamespaceSource::New);
    check_id_map("uidMappings", &user.uid_mappings, new)?;
    check_id_map("gidMappings", &user.gid_mappings, new)?;
    if let (true, Some(p)) = (new, process) {
        let mapped = |m: &[IdMapping], id: u32| {
            m.iter()
                .any(|l| id >= l.container_id && u64::from(id) < end(l.container_id, l.size))
        };
        if !mapped(&user.uid_mappings, p.uid) {
            return Err(format!(
                "process.user.uid {} is not mapped by linux.uidMappings",
                p.uid
            ));
        }
        if let Some(g) = std::iter::once(&p.gid)
            .chain(&p.supplemental_gids)
            .find(|g| !mapped(&user.gid_mappings, **g))
        {
            return Err(format!(
                "process.user gid {g} is not mapped by linux.gidMappings"
            ));
        }
    }
    for (dest, fstype) in volumes {
        let idmaps = crust_fs::FsType::parse(fstype).is_some_and(|t| t.spec().idmap);
        if !idmaps {
            return Err(format!(
                "mount {dest}: its {fstype} volume cannot be idmapped by the guest kernel, so linux.uidMappings cannot be honoured on it"
            ));
        }
    }
    Ok(())
}

fn end(start: u32, size: u32) -> u64 {
    u64::from(start) + u64::from(size)
}

fn check_id_map(field: &str, map: &[IdMapping], required: bool) -> Result<(), String> {
    if required && map.is_empty() {
        return Err(format!(
            "linux.{field} is empty: a new user namespace needs at least one line"
        ));
    }
    if map.len() > MAX_ID_MAP_LINES {
        return Err(format!(
            "linux.{field} has {} lines; the kernel takes at most {MAX_ID_MAP_LINES}",
            map.len()
        ));
    }
    let past = u64::from(LAST_ID) + 1;
    for (i, l) in map.iter().enumerate() {
        if l.size == 0 {
            return Err(format!("linux.{field}[{i}]: size is 0"));
        }
        for (what, start) in [("containerID", l.container_id), ("hostID", l.host_id)] {
            if end(start, l.size) > past {
                return Err(format!(
                    "linux.{field}[{i}]: {what} {start} + size {} goes past {LAST_ID}, the guest's last id",
                    l.size
                ));
            }
        }
        for (j, o) in map[..i].iter().enumerate() {
            let overlap =
                |a: u32, b: u32| u64::from(a) < end(b, o.size) && u64::from(b) < end(a, l.size);
            if overlap(l.container_id, o.container_id) {
                return Err(format!("linux.{field}[{i}] overlaps [{j}] in containerID"));
            }
            if overlap(l.host_id, o.host_id) {
                return Err(format!("linux.{field}[{i}] overlaps [{j}] in hostID"));
            }
        }
    }
    Ok(())
}

/// An OCI `linux.seccomp` section, in the spec's own JSON shape (the shim
/// passes it through), names (`SCMP_ACT_*`, `SCMP_ARCH_*`,
/// `SECCOMP_FILTER_FLAG_*`, syscalls) kept as strings: the agent resolves
/// them with libseccomp and names the field it cannot.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Seccomp {
    pub default_action: String,
    #[serde(default)]
    pub default_errno_ret: Option<u32>,
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub flags: Vec<String>,
    #[serde(default)]
    pub syscalls: Vec<SeccompRule>,
    /// SCMP_ACT_NOTIFY's agent socket (a host path: refused in a guest).
    #[serde(default)]
    pub listener_path: Option<String>,
}

/// One `linux.seccomp.syscalls` entry.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SeccompRule {
    pub names: Vec<String>,
    pub action: String,
    #[serde(default)]
    pub errno_ret: Option<u32>,
    #[serde(default)]
    pub args: Vec<SeccompArg>,
}

/// An argument condition: `op` compares argument `index` with `value`
/// (`SCMP_CMP_MASKED_EQ`: `arg & value == value_two`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SeccompArg {
    pub index: u32,
    pub value: u64,
    #[serde(default)]
    pub value_two: Option<u64>,
    pub op: SeccompOp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum SeccompOp {
    #[serde(rename = "SCMP_CMP_NE")]
    NotEqual,
    #[serde(rename = "SCMP_CMP_LT")]
    Less,
    #[serde(rename = "SCMP_CMP_LE")]
    LessOrEqual,
    #[default]
    #[serde(rename = "SCMP_CMP_EQ")]
    Equal,
    #[serde(rename = "SCMP_CMP_GE")]
    GreaterOrEqual,
    #[serde(rename = "SCMP_CMP_GT")]
    Greater,
    #[serde(rename = "SCMP_CMP_MASKED_EQ")]
    MaskedEqual,
}

/// OCI `linux.sysctl`: only namespaced names, each in a namespace the
/// container has of its own (or the pod's); any other would change the
/// guest that every container of the pod shares. The one check, made by
/// the shim before a VM boots and by the agent for every caller.
pub fn check_sysctls(
    sysctl: &std::collections::BTreeMap<String, String>,
    ipc: &NamespaceSource,
    uts: &NamespaceSource,
) -> Result<(), String> {
    for (name, value) in sysctl {
        let shared = |ns: &NamespaceSource, what: &str| {
            Err(format!(
                "linux.sysctl {name:?} needs {what} namespace of the container's or the pod's, not the guest's ({ns:?})"
            ))
        };
        match sysctl_namespace(name) {
            None => {
                return Err(format!(
                    "linux.sysctl {name:?} is not namespaced: it would change the whole guest"
                ));
            }
            Some(SysctlNamespace::Ipc) if *ipc == NamespaceSource::Guest => {
                return shared(ipc, "an IPC");
            }
            Some(SysctlNamespace::Uts) if *uts == NamespaceSource::Guest => {
                return shared(uts, "a UTS");
            }
            _ => {}
        }
        if value.contains(['\0', '\n']) {
            return Err(format!(
                "linux.sysctl {name:?}: the value has a NUL or newline"
            ));
        }
    }
    Ok(())
}

/// The namespace a sysctl belongs to, as runc decides it; `None` for one
/// that is not namespaced (it would change the whole guest: refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SysctlNamespace {
    Ipc,
    Uts,
    /// The guest's network namespace, which is the pod's.
    Net,
}

/// The one rule for which sysctls a container may set (shim and agent).
/// Names use dots, or slashes (then a dot is part of a component, as in
/// `net/ipv4/conf/eth0.100/rp_filter`).
pub fn sysctl_namespace(name: &str) -> Option<SysctlNamespace> {
    const IPC: &[&str] = &[
        "kernel.msgmax",
        "kernel.msgmnb",
        "kernel.msgmni",
        "kernel.sem",
        "kernel.shmall",
        "kernel.shmmax",
        "kernel.shmmni",
        "kernel.shm_rmid_forced",
    ];
    let dotted = name.replace('/', ".");
    let name = dotted.as_str();
    let valid = !name.is_empty()
        && name.split('.').all(|c| {
            !c.is_empty()
                && c.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
        });
    if !valid {
        None
    } else if IPC.contains(&name) || name.starts_with("fs.mqueue.") {
        Some(SysctlNamespace::Ipc)
    } else if matches!(name, "kernel.hostname" | "kernel.domainname") {
        Some(SysctlNamespace::Uts)
    } else if name.starts_with("net.") {
        Some(SysctlNamespace::Net)
    } else {
        None
    }
}

/// Where one of a container's namespaces comes from.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum NamespaceSource {
    /// The guest's own (the spec does not list the type).
    #[default]
    Guest,
    /// A new one for this container.
    New,
    /// That of another running container of the pod (CRI: the sandbox's).
    Container { id: String },
}

/// A hot-plugged virtio-blk disk made a device node in the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockDevice {
    /// virtio-blk serial of the disk.
    pub serial: String,
    /// Absolute path of the node in the container (e.g. `/dev/xvda`).
    pub path: String,
    /// Permission bits of the node (OCI `fileMode`), default 0660.
    #[serde(default)]
    pub mode: Option<u32>,
    #[serde(default)]
    pub uid: Option<u32>,
    #[serde(default)]
    pub gid: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessReply {
    /// Guest pid.
    pub pid: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartContainer {
    pub id: String,
}

/// Start one more process in a running container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecProcess {
    pub container: String,
    /// `[A-Za-z0-9._-]`, at most 128 bytes, unique in the container.
    pub exec_id: String,
    pub process: ProcessSpec,
}

/// Names a process: the container's init (`exec_id` none) or an exec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessRef {
    pub container: String,
    #[serde(default)]
    pub exec_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalProcess {
    #[serde(flatten)]
    pub process: ProcessRef,
    pub signal: i32,
    /// Every process of the container (init only).
    #[serde(default)]
    pub all: bool,
}

/// Waits up to `timeout_ms` for the process to exit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitProcess {
    #[serde(flatten)]
    pub process: ProcessRef,
    pub timeout_ms: u64,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessExit {
    pub pid: u32,
    /// Exit status, or 128+signal when killed (what containerd reports).
    pub exit_code: i32,
    pub signal: Option<i32>,
    /// Processes of the container the guest's OOM killer killed during
    /// its life (its cgroup's `memory.events` `oom_kill`; init only, 0 for
    /// an exec). Absent from an older agent: 0.
    #[serde(default)]
    pub oom_kills: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitReply {
    /// None: still running when the timeout passed.
    pub exited: Option<ProcessExit>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloseStdin {
    #[serde(flatten)]
    pub process: ProcessRef,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResizePty {
    #[serde(flatten)]
    pub process: ProcessRef,
    pub width: u16,
    pub height: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerPids {
    pub id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PidsReply {
    pub pids: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerStats {
    pub id: String,
}

/// From the container's cgroup in the guest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerStatsReply {
    pub memory_bytes: u64,
    pub memory_limit_bytes: Option<u64>,
    pub cpu_usage_ns: u64,
    pub pids: u64,
}

/// A CFS bandwidth limit: `quota_us` of CPU time per `period_us`
/// (cgroup v2 `cpu.max`); no quota means unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuMax {
    pub quota_us: Option<u64>,
    pub period_us: u64,
}

/// Sets a container's limits in its cgroup, all or nothing: a memory
/// limit below what the container holds and cannot give back (anonymous
/// and shared memory: the guest has no swap) is refused before anything
/// is written; a write that fails puts back what was written before it.
/// `None` leaves that limit as it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateContainer {
    pub id: String,
    #[serde(default)]
    pub memory_limit_bytes: Option<u64>,
    #[serde(default)]
    pub cpu_max: Option<CpuMax>,
}

/// Brings every present vCPU online (hot-plugged ones arrive offline) and
/// waits up to `timeout_ms` for `want` to be online.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OnlineCpus {
    pub want: u32,
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OnlineCpusReply {
    pub online: u32,
}

/// Kill whatever still runs, undo the mounts, forget the container.
/// Unknown ids are a success (idempotent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveContainer {
    pub id: String,
}

/// The guest's memory as its kernel sees it (`/proc/meminfo`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestInfo {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestInfoReply {
    pub mem_total_bytes: u64,
    /// `MemAvailable`: what the guest could give back without killing.
    #[serde(default)]
    pub mem_available_bytes: u64,
    pub cpus: u32,
    pub kernel_release: String,
}

/// Checks a container or exec id.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Checks a share-relative path: relative, no empty, `.` or `..` component.
pub fn valid_share_path(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('/')
        && !p.contains('\0')
        && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn create_container_wire_shape() {
        let v = json!({
            "id": "c1",
            "rootfs": {"kind": "share", "tag": "pod", "path": "c1/rootfs"},
            "process": {"args": ["sh"], "stdio": {"stream": 3, "stdout": true}},
            "mounts": [
                {"destination": "/proc", "source": {"kind": "proc"}},
                {"destination": "/data", "source": {"kind": "volume", "volume": "v1", "subpath": "a"}, "readonly": true},
                {"destination": "/etc/hosts", "source": {"kind": "share", "tag": "pod", "path": "c1/m0"}}
            ]
        });
        let c: CreateContainer = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(
            c.rootfs,
            Rootfs::Share(ShareRef {
                tag: "pod".into(),
                path: "c1/rootfs".into()
            })
        );
        assert_eq!(c.process.stdio.stream, 3);
        assert!(!c.process.terminal);
        assert_eq!(c.mounts[0].source, MountSource::Proc);
        assert_eq!(
            c.mounts[1].source,
            MountSource::Volume {
                volume: "v1".into(),
                subpath: Some("a".into())
            }
        );
        let back = serde_json::to_value(&c).unwrap();
        assert_eq!(back["mounts"][2]["source"]["kind"], "share");
        let sig = SignalProcess {
            process: ProcessRef {
                container: "c".into(),
                exec_id: Some("e".into()),
            },
            signal: 9,
            all: false,
        };
        assert_eq!(
            serde_json::to_value(&sig).unwrap(),
            json!({"container": "c", "exec_id": "e", "signal": 9, "all": false})
        );
    }

    #[test]
    fn ids_and_paths() {
        for ok in ["c1", "a.b_c-d", &"x".repeat(128)] {
            assert!(valid_id(ok), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(129)] {
            assert!(!valid_id(bad), "{bad}");
        }
        assert!(valid_share_path("c1/rootfs"));
        for bad in ["", "/abs", "a/../b", "a//b", "./a", "a/."] {
            assert!(!valid_share_path(bad), "{bad}");
        }
    }

    #[test]
    fn sysctls_are_sorted_by_namespace() {
        use SysctlNamespace::*;
        for (name, ns) in [
            ("kernel.shm_rmid_forced", Some(Ipc)),
            ("kernel/msgmax", Some(Ipc)),
            ("fs.mqueue.msg_max", Some(Ipc)),
            ("kernel.domainname", Some(Uts)),
            ("net.ipv4.ip_unprivileged_port_start", Some(Net)),
            ("net/ipv4/conf/eth0.100/rp_filter", Some(Net)),
            ("kernel.panic", None),
            ("vm.overcommit_memory", None),
            ("fs.file-max", None),
            ("net.ipv4..x", None),
            ("net/../kernel/panic", None),
            ("net.ipv4.a b", None),
            ("", None),
        ] {
            assert_eq!(sysctl_namespace(name), ns, "{name}");
        }
    }

    #[test]
    fn user_namespace_mappings_are_checked_by_field() {
        let m = |c: u32, h: u32, n: u32| IdMapping {
            container_id: c,
            host_id: h,
            size: n,
        };
        let ns = |uid: Vec<IdMapping>, gid: Vec<IdMapping>| UserNamespace {
            source: NamespaceSource::New,
            uid_mappings: uid,
            gid_mappings: gid,
        };
        let root = WorkloadUser {
            uid: 0,
            gid: 0,
            supplemental_gids: vec![10],
        };
        let good = ns(vec![m(0, 100000, 65536)], vec![m(0, 100000, 65536)]);
        check_user_namespace(&good, Some(&root), &[("/data", "ext4"), ("/x", "xfs")]).unwrap();
        // The wire shape is the OCI one.
        assert_eq!(
            serde_json::to_value(m(0, 100000, 65536)).unwrap(),
            json!({"containerID": 0, "hostID": 100000, "size": 65536})
        );
        check_user_namespace(&UserNamespace::default(), Some(&root), &[("/d", "vfat")]).unwrap();
        let many: Vec<IdMapping> = (0..341).map(|i| m(i, 1000 + i, 1)).collect();
        let last = LAST_ID;
        for (user, needle) in [
            (
                ns(vec![m(0, last, 2)], vec![m(0, 0, 1)]),
                "linux.uidMappings[0]: hostID 4294967294 + size 2 goes past 4294967294",
            ),
            (
                ns(vec![m(last, 0, 2)], vec![m(0, 0, 1)]),
                "linux.uidMappings[0]: containerID 4294967294 + size 2",
            ),
            (
                ns(vec![m(0, 0, 1)], vec![m(0, 100, 10), m(5, 500, 10)]),
                "linux.gidMappings[1] overlaps [0] in containerID",
            ),
            (
                ns(vec![m(0, 100, 10), m(10, 105, 10)], vec![m(0, 0, 1)]),
                "linux.uidMappings[1] overlaps [0] in hostID",
            ),
            (
                ns(vec![m(0, 0, 1), m(1, 1, 0)], vec![m(0, 0, 1)]),
                "linux.uidMappings[1]: size is 0",
            ),
            (
                ns(many.clone(), vec![m(0, 0, 1)]),
                "linux.uidMappings has 341 lines; the kernel takes at most 340",
            ),
            (
                ns(Vec::new(), vec![m(0, 0, 1)]),
                "linux.uidMappings is empty",
            ),
            (
                ns(vec![m(1, 100, 10)], vec![m(0, 100, 65536)]),
                "process.user.uid 0 is not mapped by linux.uidMappings",
            ),
            (
                ns(vec![m(0, 100, 10)], vec![m(0, 100, 5)]),
                "process.user gid 10 is not mapped by linux.gidMappings",
            ),
            (
                UserNamespace {
                    source: NamespaceSource::Guest,
                    uid_mappings: vec![m(0, 0, 1)],
                    gid_mappings: Vec::new(),
                },
                "linux.uidMappings without a user namespace",
            ),
        ] {
            let e = check_user_namespace(&user, Some(&root), &[]).unwrap_err();
            assert!(e.contains(needle), "{e}");
        }
        // 340 lines is the kernel's limit, not past it.
        let ok: Vec<IdMapping> = many[..MAX_ID_MAP_LINES].to_vec();
        check_user_namespace(&ns(ok.clone(), ok), None, &[]).unwrap();
        let e = check_user_namespace(&good, Some(&root), &[("/data", "ext4"), ("/old", "vfat")])
            .unwrap_err();
        assert!(
            e.contains("mount /old: its vfat volume cannot be idmapped"),
            "{e}"
        );
    }

    #[test]
    fn seccomp_is_the_oci_section() {
        let s: Seccomp = serde_json::from_value(json!({
            "defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1,
            "architectures": ["SCMP_ARCH_X86_64"], "flags": ["SECCOMP_FILTER_FLAG_LOG"],
            "syscalls": [{"names": ["personality"], "action": "SCMP_ACT_ALLOW",
                          "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_EQ"},
                                   {"index": 1, "value": 255, "valueTwo": 4, "op": "SCMP_CMP_MASKED_EQ"}]}]
        }))
        .unwrap();
        assert_eq!(s.default_errno_ret, Some(1));
        let a = s.syscalls[0].args[1];
        assert_eq!((a.op, a.value_two), (SeccompOp::MaskedEqual, Some(4)));
        assert_eq!(
            serde_json::to_value(&s).unwrap()["syscalls"][0]["args"][0]["op"],
            "SCMP_CMP_EQ"
        );
    }
}
