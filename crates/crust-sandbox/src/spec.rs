//! From a container's OCI spec to what the guest runs: the process, and
//! every mount sorted into where it comes from.
//!
//! | OCI mount | in the guest |
//! |---|---|
//! | `proc`, `sysfs`, `tmpfs`, `devpts`, `mqueue`, `cgroup(2)` | mounted by the agent in the container's namespace |
//! | `/dev/shm` (tmpfs, or CRI's bind of the sandbox shm) | the pod's shm tmpfs in the guest |
//! | bind whose source has a hand-off record (either layout) | the deferred volume, hot-plugged as virtio-blk, with fsGroup/subPath |
//! | any other bind (`/etc/hosts`, `resolv.conf`, termination-log, configMap, secret, token, emptyDir) | bound into the pod's virtio-fs share, then into the container with the spec's ro/rw |
//!
//! Nothing is skipped: an unknown mount type or an OCI feature a VM cannot
//! honour is an error before anything changes.

use std::path::{Path, PathBuf};

use std::collections::BTreeMap;

use crate::net::PodNetworkSpec;
use crate::share::{Propagation, ReadOnly};
use crust_agent_proto::{
    Capabilities, ContainerMount, IdMapping, MountSource, NamespaceSource, ProcessSpec, Rlimit,
    Seccomp, UserNamespace, WorkloadUser,
};
use oci_spec::runtime::Spec;

/// CRI annotations naming a container's role and pod.
pub const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
pub const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// Pod memory hints: containerd 1.7+ passes the pod's memory limit; crust's
/// own pod annotation works with every containerd (the CRI config passes
/// `io.crust.*` pod annotations through `pod_annotations`).
pub const SANDBOX_MEMORY: &str = "io.kubernetes.cri.sandbox-memory";
pub const CRUST_MEMORY: &str = "io.crust.memory-bytes";
/// The pod's CPU limit (containerd 1.7+) as a CFS quota and period.
pub const SANDBOX_CPU_QUOTA: &str = "io.kubernetes.cri.sandbox-cpu-quota";
pub const SANDBOX_CPU_PERIOD: &str = "io.kubernetes.cri.sandbox-cpu-period";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("config.json of {bundle}: {reason}")]
    Invalid { bundle: String, reason: String },
    #[error("unsupported in a crust VM: {0}")]
    Unsupported(String),
    /// The resources of a task Update.
    #[error("update: {0}")]
    Update(String),
}

impl SpecError {
    /// The status code every door answers this error with.
    pub fn code(&self) -> crate::shim::Code {
        use crate::shim::Code;
        match self {
            SpecError::Invalid { .. } | SpecError::Update(_) => Code::InvalidArgument,
            SpecError::Unsupported(_) => Code::FailedPrecondition,
        }
    }
}

/// containerd's type URL for the `LinuxResources` of a task Update (JSON).
pub const LINUX_RESOURCES_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";

/// The spec fields an Update names in its refusals.
pub const MEMORY_FIELD: &str = "linux.resources.memory.limit";
pub const CPU_FIELD: &str = "linux.resources.cpu";

/// One container's limits; `None` leaves that limit as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory: Option<u64>,
    pub cpu: Option<crust_agent_proto::CpuMax>,
}

/// The limits crust applies from OCI `linux.resources`: memory limit and
/// CFS quota/period; the rest (shares, cpusets, hugepages...) is left to
/// the VM boundary. Values a cgroup cannot take are refused, naming the
/// field.
pub fn resource_limits(r: &oci_spec::runtime::LinuxResources) -> Result<Limits, String> {
    let memory = match r.memory().as_ref().and_then(|m| m.limit()) {
        None | Some(0) | Some(-1) => None,
        Some(l) if l < 0 => {
            return Err(format!("{}: {l} is negative", MEMORY_FIELD));
        }
        Some(l) => Some(l as u64),
    };
    let cpu = match r.cpu().as_ref() {
        None => None,
        Some(c) => {
            let period = c.period().unwrap_or(100_000);
            if !(1000..=1_000_000).contains(&period) {
                return Err(format!(
                    "{}.period: {period} us out of 1000..=1000000",
                    CPU_FIELD
                ));
            }
            match c.quota() {
                None => None,
                Some(-1) => Some(crust_agent_proto::CpuMax {
                    quota_us: None,
                    period_us: period,
                }),
                Some(q) if q < 1000 => {
                    return Err(format!(
                        "{}.quota: {q} us, below the 1000 us a cgroup takes",
                        CPU_FIELD
                    ));
                }
                Some(q) => Some(crust_agent_proto::CpuMax {
                    quota_us: Some(q as u64),
                    period_us: period,
                }),
            }
        }
    };
    Ok(Limits { memory, cpu })
}

/// A container's own CFS limit from its spec.
fn own_cpu_max(
    linux: &oci_spec::runtime::Linux,
) -> Result<Option<crust_agent_proto::CpuMax>, String> {
    match linux.resources() {
        Some(r) => Ok(resource_limits(r)?.cpu),
        None => Ok(None),
    }
}

/// The limits a task Update asks for (`resources`: an Any of OCI
/// `LinuxResources` in JSON, as containerd's CRI sends it).
pub fn update_limits(type_url: &str, value: &[u8]) -> Result<Limits, SpecError> {
    if type_url != LINUX_RESOURCES_URL {
        return Err(SpecError::Update(format!(
            "resources of type {type_url:?}: only {LINUX_RESOURCES_URL} is understood"
        )));
    }
    let r: oci_spec::runtime::LinuxResources = serde_json::from_slice(value)
        .map_err(|e| SpecError::Update(format!("LinuxResources do not parse: {e}")))?;
    resource_limits(&r).map_err(SpecError::Update)
}

/// A host security module setting in a container's spec: the guest
/// kernel has no AppArmor or SELinux, so it cannot be enforced there (the
/// VM is the boundary).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LsmSetting {
    AppArmor(String),
    SeLinux(String),
}

impl std::fmt::Display for LsmSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LsmSetting::AppArmor(p) => write!(f, "AppArmor profile {p:?}"),
            LsmSetting::SeLinux(l) => write!(f, "SELinux label {l:?}"),
        }
    }
}

/// A host namespace a node may let its pods ask for
/// (`CRUST_SHIM_HOST_NAMESPACES`); the container then runs in the guest's
/// own namespace of that type, never the host's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum HostNamespace {
    /// `ipc=NODE` (hostIPC).
    Ipc,
    /// `pid=NODE` (hostPID).
    Pid,
}

impl std::fmt::Display for HostNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HostNamespace::Ipc => "ipc",
            HostNamespace::Pid => "pid",
        })
    }
}

/// The one rule for host IPC and PID namespaces. containerd leaves a
/// namespace out of the spec for `ipc=NODE` / `pid=NODE`; a VM cannot
/// join the host's, so such a container is refused, naming the setting,
/// unless the node lets it run in the guest's namespace instead.
pub fn check_host_namespaces(
    ipc: &NamespaceSource,
    pid: &NamespaceSource,
    allowed: &[HostNamespace],
) -> Result<(), SpecError> {
    for (ns, source, what) in [
        (
            HostNamespace::Ipc,
            ipc,
            "ipc=NODE (hostIPC: the host's shared memory and message queues)",
        ),
        (
            HostNamespace::Pid,
            pid,
            "pid=NODE (hostPID: the host's processes)",
        ),
    ] {
        if *source == NamespaceSource::Guest && !allowed.contains(&ns) {
            return Err(SpecError::Unsupported(format!(
                "{what}: a crust pod runs in a VM, which cannot share the host's {ns} namespace; \
                 a node can run such containers in the guest's own {ns} namespace with \
                 CRUST_SHIM_HOST_NAMESPACES={ns}"
            )));
        }
    }
    Ok(())
}

/// What a node gives a `hostNetwork` pod (`CRUST_SHIM_HOST_NETWORK`). A
/// VM cannot join the host's network namespace; without a choice here
/// its guest would have only `lo`, a pod silently without network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum HostNetwork {
    /// Refuse the pod, naming the setting.
    #[default]
    Refuse,
    /// One NIC on QEMU's user-mode network: connections out go through
    /// the host's stack as the host's (its loopback as 10.0.2.2), as a
    /// runc hostNetwork pod's would; the guest's listening ports are not
    /// the host's.
    User,
}

/// The one rule for `hostNetwork` (no network namespace in the spec):
/// refused, naming the setting, unless the node chose [`HostNetwork::User`].
pub fn check_host_network(network: &PodNetworkSpec, mode: HostNetwork) -> Result<(), SpecError> {
    if *network == PodNetworkSpec::Host && mode == HostNetwork::Refuse {
        return Err(SpecError::Unsupported(
            "hostNetwork (network=NODE): a crust pod runs in a VM, which cannot share the host's \
             network namespace; a node can give such pods the host's outbound connectivity \
             through a user-mode network with CRUST_SHIM_HOST_NETWORK=user"
                .into(),
        ));
    }
    Ok(())
}

/// What the shim does with an [`LsmSetting`] (`CRUST_SHIM_LSM_POLICY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LsmPolicy {
    /// Run the container; the shim logs the setting once per pod.
    #[default]
    Ignore,
    /// Refuse the container, naming the setting.
    Refuse,
}

/// The one rule for AppArmor/SELinux settings: under `Refuse` the first
/// one is an error naming it; under `Ignore` they are allowed (the caller
/// logs them).
pub fn check_lsm(settings: &[LsmSetting], policy: LsmPolicy) -> Result<(), SpecError> {
    match (policy, settings.first()) {
        (LsmPolicy::Refuse, Some(s)) => Err(SpecError::Unsupported(format!(
            "{s} (the guest kernel cannot enforce it; CRUST_SHIM_LSM_POLICY=refuse)"
        ))),
        _ => Ok(()),
    }
}

fn lsm_settings(p: &oci_spec::runtime::Process) -> Vec<LsmSetting> {
    let set = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    set(p.apparmor_profile())
        .map(LsmSetting::AppArmor)
        .into_iter()
        .chain(set(p.selinux_label()).map(LsmSetting::SeLinux))
        .collect()
}

/// Which pod a container belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Owns the pod's VM: the CRI sandbox, or a lone container (`ctr run`).
    PodOwner,
    /// A container of pod `sandbox_id`, run in that pod's VM.
    Member { sandbox_id: String },
}

/// A mount before the host side is prepared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Planned {
    /// Handled entirely in the guest.
    Guest(ContainerMount),
    /// A host path to share into the guest.
    HostBind {
        destination: String,
        source: PathBuf,
        /// `ro` (this mount) or `rro` (every mount below it too).
        readonly: ReadOnly,
        /// Mounts made later below the source on the host: `rslave`
        /// (HostToContainer) carries them, the default does not.
        propagation: Propagation,
        options: Vec<String>,
    },
}

/// What the guest is asked to run for one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerPlan {
    pub role: Role,
    pub process: ProcessSpec,
    pub mounts: Vec<Planned>,
    pub masked_paths: Vec<String>,
    pub readonly_paths: Vec<String>,
    pub rootfs_readonly: bool,
    /// `root.path`, absolute (used when containerd passes no rootfs mounts).
    pub root_path: PathBuf,
    pub memory_limit: Option<u64>,
    /// The pod's memory as kubelet sent it (containerd 1.7+'s sandbox
    /// annotation).
    pub pod_memory: Option<u64>,
    /// What the pod's own [`CRUST_MEMORY`] annotation asks for: anyone who
    /// can create a pod sets it, so it is held to the caps
    /// (the containerd door's `pod_memory`).
    pub asked_memory: Option<u64>,
    /// vCPUs the CPU limit asks for (the pod's, else the container's own):
    /// the CFS quota over the period, rounded up.
    pub cpus: Option<u32>,
    /// The container's own CFS limit (`cpu.max` in the guest).
    pub cpu_max: Option<crust_agent_proto::CpuMax>,
    pub cgroups_path: Option<String>,
    /// Raw block devices (`linux.devices` of type b: volumeDevices).
    pub devices: Vec<HostDevice>,
    /// The pod's network (what the sandbox's VM gets).
    pub network: PodNetworkSpec,
    /// The pod's [`crate::net::CRUST_ANTI_SPOOFING`] annotation.
    pub anti_spoofing: crust_podnet::AntiSpoof,
    /// AppArmor profile / SELinux label the spec asks for (see [`check_lsm`]).
    pub lsm: Vec<LsmSetting>,
    /// The container's IPC, UTS and PID namespaces in the guest (see
    /// [`namespace`]).
    pub ipc: NamespaceSource,
    pub uts: NamespaceSource,
    pub pid: NamespaceSource,
    /// OCI `linux.sysctl` (checked by `crust_agent_proto::check_sysctls`).
    pub sysctl: BTreeMap<String, String>,
    /// OCI `linux.seccomp`, enforced by the agent.
    pub seccomp: Option<Seccomp>,
    /// OCI `hostname` (CRI sets the pod's in the sandbox's spec).
    pub hostname: String,
    /// The user namespace and `linux.uidMappings`/`gidMappings` (checked
    /// by `crust_agent_proto::check_user_namespace`; the volumes' part
    /// once they are known, before any is plugged).
    pub user: UserNamespace,
}

/// A bind's propagation (CRI's MountPropagation as containerd writes it).
/// Bidirectional (`rshared`) needs mounts made in the guest to reach the
/// host, which virtio-fs cannot carry: refused, naming the mount.
fn propagation(destination: &str, options: &[String]) -> Result<Propagation, SpecError> {
    let has = |o: &[&str]| options.iter().any(|x| o.contains(&x.as_str()));
    if has(&["rshared", "shared"]) {
        return Err(SpecError::Unsupported(format!(
            "mount {destination}: Bidirectional mount propagation (rshared): mounts made in \
             the guest cannot reach the host through virtio-fs (HostToContainer, rslave, is \
             carried: host mounts made later below the source appear in the container)"
        )));
    }
    Ok(if has(&["rslave", "slave"]) {
        Propagation::Slave
    } else {
        Propagation::Private
    })
}

/// Where a container's namespace of type `typ` comes from in the guest:
/// absent from the spec, the guest's; without a path, a new one; with a
/// path (CRI: the sandbox's), the pod's sandbox container's. A lone
/// container's path names a host namespace the VM cannot join.
///
/// PID: CRI's shareProcessNamespace (POD mode) gives every container
/// `/proc/<sandbox pid>/ns/pid`, the pause container's. Its TARGET mode
/// (an ephemeral container joining one container's) names that
/// container's pid, but every task of a crust pod reports QEMU's pid, so
/// it cannot be told from POD: such a container joins the sandbox's.
pub fn namespace(
    spec: &Spec,
    typ: oci_spec::runtime::LinuxNamespaceType,
) -> Result<NamespaceSource, SpecError> {
    let l = spec.linux().clone().unwrap_or_default();
    let ns = l.namespaces().clone().unwrap_or_default();
    let Some(n) = ns.iter().find(|n| n.typ() == typ) else {
        return Ok(NamespaceSource::Guest);
    };
    match (n.path(), role(spec)) {
        (None, _) => Ok(NamespaceSource::New),
        (Some(_), Role::Member { sandbox_id }) => Ok(NamespaceSource::Container { id: sandbox_id }),
        (Some(p), Role::PodOwner) => Err(SpecError::Unsupported(format!(
            "joining the host's {typ:?} namespace {} (a VM has its own)",
            p.display()
        ))),
    }
}

/// A host block device the container gets as a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostDevice {
    pub path: String,
    pub major: i64,
    pub minor: i64,
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// The device cgroup allows the container no write to it (kubelet's
    /// `volumeDevices` with `readOnly`: permissions `r`): QEMU gets it
    /// read-only too.
    pub readonly: bool,
}

pub fn role(spec: &Spec) -> Role {
    let a = spec.annotations().clone().unwrap_or_default();
    match (a.get(CONTAINER_TYPE).map(String::as_str), a.get(SANDBOX_ID)) {
        (Some("container"), Some(sb)) if !sb.is_empty() => Role::Member {
            sandbox_id: sb.clone(),
        },
        _ => Role::PodOwner,
    }
}

/// Reads `<bundle>/config.json`.
pub fn load(bundle: &Path) -> Result<Spec, SpecError> {
    let invalid = |reason: String| SpecError::Invalid {
        bundle: bundle.display().to_string(),
        reason,
    };
    let bytes = std::fs::read(bundle.join("config.json")).map_err(|e| invalid(e.to_string()))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| invalid(section_error(&bytes).unwrap_or(e.to_string())))
}

/// serde's error names a line, not a field: for the sections a user
/// writes by hand (a Localhost seccomp profile) say which one is wrong.
fn section_error(bytes: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let seccomp = v.get("linux")?.get("seccomp")?;
    serde_json::from_value::<oci_spec::runtime::LinuxSeccomp>(seccomp.clone())
        .err()
        .map(|e| format!("linux.seccomp: {e}"))
}

fn guest_kind(typ: &str) -> Option<MountSource> {
    Some(match typ {
        "proc" => MountSource::Proc,
        "sysfs" => MountSource::Sysfs,
        "tmpfs" => MountSource::Tmpfs,
        "devpts" => MountSource::Devpts,
        "mqueue" => MountSource::Mqueue,
        "cgroup" | "cgroup2" => MountSource::Cgroup,
        _ => return None,
    })
}

/// Refuses what a VM runtime cannot honour, naming it.
fn check_supported(spec: &Spec) -> Result<(), SpecError> {
    let un = |what: &str| Err(SpecError::Unsupported(what.into()));
    if let Some(h) = spec.hooks() {
        let any = [
            h.prestart().as_ref().is_some_and(|v| !v.is_empty()),
            h.create_runtime().as_ref().is_some_and(|v| !v.is_empty()),
            h.create_container().as_ref().is_some_and(|v| !v.is_empty()),
            h.start_container().as_ref().is_some_and(|v| !v.is_empty()),
            h.poststart().as_ref().is_some_and(|v| !v.is_empty()),
            h.poststop().as_ref().is_some_and(|v| !v.is_empty()),
        ];
        if any.iter().any(|b| *b) {
            return un("OCI hooks (they would run on the host, outside the pod's VM)");
        }
    }
    if let Some(l) = spec.linux() {
        for d in l.devices().as_deref().unwrap_or_default() {
            if d.typ() != oci_spec::runtime::LinuxDeviceType::B {
                return un(&format!(
                    "device {} of type {:?} (only block devices, Kubernetes volumeDevices, go into a VM)",
                    d.path().display(),
                    d.typ()
                ));
            }
        }
    }
    Ok(())
}

/// The guest's view of an OCI `process` (containers and execs).
pub fn process_spec(p: &oci_spec::runtime::Process) -> ProcessSpec {
    let user = p.user();
    let rlimits = p
        .rlimits()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|r| Rlimit {
            kind: serde_json::to_value(r.typ())
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            soft: r.soft(),
            hard: r.hard(),
        })
        .collect();
    ProcessSpec {
        args: p.args().clone().unwrap_or_default(),
        env: p.env().clone().unwrap_or_default(),
        cwd: Some(p.cwd().to_string_lossy().into_owned()).filter(|c| !c.is_empty()),
        user: Some(WorkloadUser {
            uid: user.uid(),
            gid: user.gid(),
            supplemental_gids: user.additional_gids().clone().unwrap_or_default(),
        }),
        rlimits,
        terminal: p.terminal().unwrap_or(false),
        no_new_privileges: p.no_new_privileges().unwrap_or(false),
        capabilities: p.capabilities().as_ref().map(capabilities),
        oom_score_adj: p.oom_score_adj(),
        stdio: Default::default(),
    }
}

/// OCI capability sets as `CAP_*` names (oci-spec has checked them).
fn capabilities(c: &oci_spec::runtime::LinuxCapabilities) -> Capabilities {
    let names = |set: &Option<oci_spec::runtime::Capabilities>| -> Vec<String> {
        let mut v: Vec<String> = set
            .iter()
            .flatten()
            .filter_map(|c| serde_json::to_value(c).ok()?.as_str().map(str::to_owned))
            .collect();
        v.sort();
        v
    };
    Capabilities {
        bounding: names(c.bounding()),
        effective: names(c.effective()),
        permitted: names(c.permitted()),
        inheritable: names(c.inheritable()),
        ambient: names(c.ambient()),
    }
}

/// Builds the plan for `spec`; `bundle` resolves a relative `root.path`.
#[allow(
    clippy::too_many_lines,
    reason = "one field per OCI section; each section's logic is a helper"
)]
pub fn plan(spec: &Spec, bundle: &Path) -> Result<ContainerPlan, SpecError> {
    check_supported(spec)?;
    let invalid = |reason: String| SpecError::Invalid {
        bundle: bundle.display().to_string(),
        reason,
    };
    let p = spec
        .process()
        .as_ref()
        .ok_or_else(|| invalid("no process".into()))?;
    let process = process_spec(p);
    if process.args.is_empty() {
        return Err(invalid("process.args is empty".into()));
    }
    let mut mounts = Vec::new();
    let all = spec.mounts().as_deref().unwrap_or_default();
    for (i, m) in all.iter().enumerate() {
        // OCI: a later mount on the same destination covers an earlier
        // one (containerd's default /dev/shm tmpfs, then CRI's bind).
        if all[i + 1..]
            .iter()
            .any(|l| l.destination() == m.destination())
        {
            continue;
        }
        let destination = m.destination().to_string_lossy().into_owned();
        let options = m.options().clone().unwrap_or_default();
        let read_only = ReadOnly::from_options(&options);
        let readonly = read_only != ReadOnly::No;
        let typ = m.typ().clone().unwrap_or_default();
        let is_bind = typ == "bind" || options.iter().any(|o| o == "bind" || o == "rbind");
        let rest: Vec<String> = options
            .iter()
            .filter(|o| !matches!(o.as_str(), "ro" | "rw" | "bind" | "rbind"))
            .cloned()
            .collect();
        if destination == "/dev/shm" {
            mounts.push(Planned::Guest(ContainerMount {
                destination,
                source: MountSource::PodShm,
                readonly,
                options: Vec::new(),
                submounts: Vec::new(),
            }));
            continue;
        }
        if is_bind {
            let source = m
                .source()
                .clone()
                .ok_or_else(|| invalid(format!("bind mount {destination} has no source")))?;
            if !source.is_absolute() {
                return Err(invalid(format!(
                    "bind mount {destination}: source {} is not absolute",
                    source.display()
                )));
            }
            let propagation = propagation(&destination, &options)?;
            mounts.push(Planned::HostBind {
                destination,
                source,
                readonly: read_only,
                propagation,
                options: rest,
            });
            continue;
        }
        let kind = guest_kind(&typ).ok_or_else(|| {
            SpecError::Unsupported(format!("mount {destination} of type {typ:?}"))
        })?;
        mounts.push(Planned::Guest(ContainerMount {
            destination,
            source: kind,
            readonly,
            options: rest,
            submounts: Vec::new(),
        }));
    }
    let linux = spec.linux().clone().unwrap_or_default();
    let root = spec.root().clone().unwrap_or_default();
    let root_path = if root.path().is_absolute() {
        root.path().clone()
    } else {
        bundle.join(root.path())
    };
    let memory_limit = linux
        .resources()
        .as_ref()
        .and_then(|r| r.memory().as_ref())
        .and_then(|m| m.limit())
        .filter(|l| *l > 0)
        .map(|l| l as u64);
    let a = spec.annotations().clone().unwrap_or_default();
    let pod_memory = a
        .get(SANDBOX_MEMORY)
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|m| *m > 0);
    let asked_memory = match a.get(CRUST_MEMORY) {
        None => None,
        Some(v) => match v.parse::<u64>() {
            Ok(m) if m > 0 => Some(m),
            _ => {
                return Err(invalid(format!(
                    "annotation {CRUST_MEMORY} = {v:?}: not a positive byte count"
                )));
            }
        },
    };
    let cfs = |quota: Option<i64>, period: Option<u64>| match (quota, period) {
        (Some(q), Some(p)) if q > 0 && p > 0 => Some((q as u64).div_ceil(p) as u32),
        _ => None,
    };
    let pod_cpus = cfs(
        a.get(SANDBOX_CPU_QUOTA).and_then(|v| v.parse().ok()),
        a.get(SANDBOX_CPU_PERIOD).and_then(|v| v.parse().ok()),
    );
    let cpu_max = own_cpu_max(&linux).map_err(invalid)?;
    let own_cpus = cpu_max.and_then(|c| Some(c.quota_us?.div_ceil(c.period_us) as u32));
    let network = PodNetworkSpec::of(spec).map_err(invalid)?;
    let anti_spoofing = crate::net::anti_spoofing(&a).map_err(invalid)?;
    let (ipc, uts, pid, sysctl) = namespaces_and_sysctls(spec, &linux)?;
    Ok(ContainerPlan {
        anti_spoofing,
        user: user_namespace(spec, &linux, process.user.as_ref())?,
        pid,
        sysctl,
        seccomp: linux
            .seccomp()
            .as_ref()
            .map(seccomp)
            .transpose()
            .map_err(invalid)?,
        ipc,
        uts,
        hostname: spec.hostname().clone().unwrap_or_default(),
        lsm: lsm_settings(p),
        network,
        cpus: pod_cpus.or(own_cpus),
        cpu_max,
        role: role(spec),
        process,
        mounts,
        masked_paths: linux.masked_paths().clone().unwrap_or_default(),
        readonly_paths: linux.readonly_paths().clone().unwrap_or_default(),
        rootfs_readonly: root.readonly().unwrap_or(false),
        root_path,
        memory_limit,
        pod_memory,
        asked_memory,
        cgroups_path: linux
            .cgroups_path()
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned()),
        devices: host_devices(&linux),
    })
}

/// The container's IPC, UTS and PID namespaces and its sysctls, checked
/// before a VM boots (the agent checks again for every caller).
type Namespaces = (
    NamespaceSource,
    NamespaceSource,
    NamespaceSource,
    BTreeMap<String, String>,
);

fn namespaces_and_sysctls(
    spec: &Spec,
    linux: &oci_spec::runtime::Linux,
) -> Result<Namespaces, SpecError> {
    use oci_spec::runtime::LinuxNamespaceType as Ns;
    let (ipc, uts) = (namespace(spec, Ns::Ipc)?, namespace(spec, Ns::Uts)?);
    let sysctl: BTreeMap<String, String> = linux
        .sysctl()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    crust_agent_proto::check_sysctls(&sysctl, &ipc, &uts).map_err(SpecError::Unsupported)?;
    Ok((ipc, uts, namespace(spec, Ns::Pid)?, sysctl))
}

/// The container's user namespace with the spec's mappings, checked
/// before a VM boots (the volumes' filesystems once they are known).
fn user_namespace(
    spec: &Spec,
    linux: &oci_spec::runtime::Linux,
    process: Option<&WorkloadUser>,
) -> Result<UserNamespace, SpecError> {
    let lines = |m: &Option<Vec<oci_spec::runtime::LinuxIdMapping>>| -> Vec<IdMapping> {
        m.iter()
            .flatten()
            .map(|l| IdMapping {
                container_id: l.container_id(),
                host_id: l.host_id(),
                size: l.size(),
            })
            .collect()
    };
    let user = UserNamespace {
        source: namespace(spec, oci_spec::runtime::LinuxNamespaceType::User)?,
        uid_mappings: lines(linux.uid_mappings()),
        gid_mappings: lines(linux.gid_mappings()),
    };
    crust_agent_proto::check_user_namespace(&user, process, &[]).map_err(SpecError::Unsupported)?;
    Ok(user)
}

/// The section as the agent takes it: the same JSON (oci-spec has checked
/// the names of actions, architectures, flags and operators).
pub(crate) fn seccomp(s: &oci_spec::runtime::LinuxSeccomp) -> Result<Seccomp, String> {
    serde_json::to_value(s)
        .and_then(serde_json::from_value)
        .map_err(|e| format!("linux.seccomp: {e}"))
}

fn host_devices(linux: &oci_spec::runtime::Linux) -> Vec<HostDevice> {
    let rules = linux
        .resources()
        .as_ref()
        .and_then(|r| r.devices().clone())
        .unwrap_or_default();
    linux
        .devices()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|d| HostDevice {
            path: d.path().to_string_lossy().into_owned(),
            major: d.major(),
            minor: d.minor(),
            mode: d.file_mode(),
            uid: d.uid(),
            gid: d.gid(),
            readonly: !may_write(&rules, d.major(), d.minor()),
        })
        .collect()
}

/// Whether the device cgroup rules let the container write block device
/// `major:minor`: the last rule that matches decides, as in runc's
/// emulation of the v1 device controller (no rule: no access).
fn may_write(rules: &[oci_spec::runtime::LinuxDeviceCgroup], major: i64, minor: i64) -> bool {
    use oci_spec::runtime::LinuxDeviceType;
    rules
        .iter()
        .rfind(|r| {
            matches!(
                r.typ(),
                None | Some(LinuxDeviceType::A | LinuxDeviceType::B)
            ) && r.major().is_none_or(|m| m == major)
                && r.minor().is_none_or(|m| m == minor)
                && r.access().as_deref().is_none_or(|a| a.contains('w'))
        })
        .is_some_and(|r| r.allow())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::CRUST_ANTI_SPOOFING;
    use serde_json::json;

    fn spec(v: serde_json::Value) -> Spec {
        serde_json::from_value(v).unwrap()
    }

    fn base() -> serde_json::Value {
        json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["sh"], "cwd": "/", "user": {"uid": 0, "gid": 0},
                        "env": ["PATH=/bin"], "terminal": false,
                        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]},
            "root": {"path": "rootfs"},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
                {"destination": "/dev/shm", "type": "bind", "source": "/run/containerd/x/shm", "options": ["rbind", "ro"]},
                {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/x/hosts", "options": ["rbind", "rprivate", "ro"]},
                {"destination": "/data", "type": "bind", "source": "/var/lib/kubelet/pods/u/volumes/v/mount", "options": ["rbind", "rw"]}
            ],
            "annotations": {CONTAINER_TYPE: "container", SANDBOX_ID: "sb1", CRUST_MEMORY: "536870912"},
            "linux": {"resources": {"memory": {"limit": 268435456}}, "cgroupsPath": "/kubepods/pod1/c1",
                      "maskedPaths": ["/proc/kcore"], "readonlyPaths": ["/proc/sys"],
                      "namespaces": [{"type": "pid"}, {"type": "ipc", "path": "/proc/42/ns/ipc"}]}
        })
    }

    #[test]
    fn mounts_are_sorted_by_source() {
        let p = plan(&spec(base()), Path::new("/b")).unwrap();
        assert_eq!(
            p.role,
            Role::Member {
                sandbox_id: "sb1".into()
            }
        );
        assert_eq!(p.root_path, PathBuf::from("/b/rootfs"));
        assert_eq!(p.memory_limit, Some(256 << 20));
        assert_eq!((p.pod_memory, p.asked_memory), (None, Some(512 << 20)));
        assert_eq!(p.cpus, None);
        let mut v = base();
        v["linux"]["resources"]["cpu"] = json!({"quota": 150000, "period": 100000});
        assert_eq!(
            plan(&spec(v.clone()), Path::new("/b")).unwrap().cpus,
            Some(2)
        );
        v["annotations"][SANDBOX_CPU_QUOTA] = json!("400000");
        v["annotations"][SANDBOX_CPU_PERIOD] = json!("100000");
        assert_eq!(plan(&spec(v), Path::new("/b")).unwrap().cpus, Some(4));
        assert_eq!(p.cgroups_path.as_deref(), Some("/kubepods/pod1/c1"));
        assert_eq!(p.process.rlimits[0].kind, "RLIMIT_NOFILE");
        assert_eq!(p.process.capabilities, None);
        let mut v = base();
        v["process"]["capabilities"] = json!({"bounding": ["CAP_NET_BIND_SERVICE", "CAP_CHOWN"],
            "effective": ["CAP_NET_BIND_SERVICE"], "ambient": []});
        let c = plan(&spec(v), Path::new("/b"))
            .unwrap()
            .process
            .capabilities
            .unwrap();
        assert_eq!(c.bounding, vec!["CAP_CHOWN", "CAP_NET_BIND_SERVICE"]);
        assert_eq!(c.effective, vec!["CAP_NET_BIND_SERVICE"]);
        assert!(c.permitted.is_empty() && c.ambient.is_empty());
        let mut v = base();
        v["process"]["capabilities"] = json!({"bounding": ["CAP_BOGUS"]});
        assert!(
            serde_json::from_value::<Spec>(v).is_err(),
            "oci-spec refuses an unknown name"
        );
        assert!(matches!(&p.mounts[0], Planned::Guest(m) if m.source == MountSource::Proc));
        assert!(
            matches!(&p.mounts[1], Planned::Guest(m) if m.source == MountSource::Tmpfs && m.options == vec!["nosuid", "mode=755"])
        );
        assert!(matches!(&p.mounts[2], Planned::Guest(m) if m.source == MountSource::PodShm));
        match &p.mounts[3] {
            Planned::HostBind {
                destination,
                readonly,
                options,
                ..
            } => {
                assert_eq!(destination, "/etc/hosts");
                assert_eq!(*readonly, ReadOnly::Top);
                assert_eq!(options, &vec!["rprivate".to_string()]);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            &p.mounts[4],
            Planned::HostBind {
                readonly: ReadOnly::No,
                ..
            }
        ));
    }

    #[test]
    fn a_device_the_cgroup_lets_no_one_write_is_read_only() {
        let rules = |r: serde_json::Value| -> Vec<oci_spec::runtime::LinuxDeviceCgroup> {
            serde_json::from_value(r).unwrap()
        };
        let deny_all = json!({"allow": false, "access": "rwm"});
        // kubelet's volumeDevices: "mrw", or "r" with readOnly.
        let rw = rules(
            json!([deny_all, {"allow": true, "type": "b", "major": 7, "minor": 3, "access": "mrw"}]),
        );
        let ro = rules(
            json!([deny_all, {"allow": true, "type": "b", "major": 7, "minor": 3, "access": "r"}]),
        );
        assert!(may_write(&rw, 7, 3));
        assert!(!may_write(&ro, 7, 3));
        assert!(!may_write(&rw, 7, 4), "another device");
        assert!(!may_write(&[], 7, 3), "no rule: no access");
        // The last matching rule decides.
        let later_deny = rules(
            json!([{"allow": true, "access": "rwm"}, {"allow": false, "type": "b", "major": 7, "access": "w"}]),
        );
        assert!(!may_write(&later_deny, 7, 3));
        assert!(may_write(&later_deny, 8, 0));
    }

    #[test]
    fn unsupported_features_are_named() {
        for (patch, needle) in [
            (
                json!({"hooks": {"prestart": [{"path": "/bin/true"}]}}),
                "hooks",
            ),
            (
                json!({"linux": {"namespaces": [{"type": "user"}]}}),
                "linux.uidMappings is empty",
            ),
            (
                json!({"linux": {"devices": [{"path": "/dev/ttyS9", "type": "c", "major": 4, "minor": 73}]}}),
                "device",
            ),
            (
                json!({"mounts": [{"destination": "/x", "type": "nfs", "source": "srv:/x"}]}),
                "nfs",
            ),
        ] {
            let mut v = base();
            for (k, val) in patch.as_object().unwrap() {
                if k == "linux" {
                    for (lk, lv) in val.as_object().unwrap() {
                        v["linux"][lk] = lv.clone();
                    }
                } else {
                    v[k] = val.clone();
                }
            }
            let e = plan(&spec(v), Path::new("/b")).unwrap_err();
            assert!(matches!(e, SpecError::Unsupported(_)), "{e}");
            assert!(e.to_string().contains(needle), "{e}");
        }
        let mut v = base();
        v["annotations"] = json!({});
        assert_eq!(role(&spec(v)), Role::PodOwner);
    }

    #[test]
    fn apparmor_and_selinux_run_unless_refused() {
        let mut v = base();
        v["process"]["apparmorProfile"] = json!("cri-containerd.apparmor.d");
        v["process"]["selinuxLabel"] = json!("system_u:system_r:container_t:s0:c1,c2");
        let p = plan(&spec(v), Path::new("/b")).unwrap();
        assert_eq!(
            p.lsm,
            vec![
                LsmSetting::AppArmor("cri-containerd.apparmor.d".into()),
                LsmSetting::SeLinux("system_u:system_r:container_t:s0:c1,c2".into()),
            ]
        );
        check_lsm(&p.lsm, LsmPolicy::Ignore).unwrap();
        let e = check_lsm(&p.lsm, LsmPolicy::Refuse).unwrap_err();
        assert!(matches!(e, SpecError::Unsupported(_)), "{e}");
        assert!(
            e.to_string()
                .contains("AppArmor profile \"cri-containerd.apparmor.d\""),
            "{e}"
        );
        let e = check_lsm(&p.lsm[1..], LsmPolicy::Refuse).unwrap_err();
        assert!(e.to_string().contains("SELinux label \"system_u:"), "{e}");
        // Empty strings are no setting at all.
        let mut v = base();
        v["process"]["apparmorProfile"] = json!("");
        let p = plan(&spec(v), Path::new("/b")).unwrap();
        assert!(p.lsm.is_empty());
        check_lsm(&p.lsm, LsmPolicy::Refuse).unwrap();
    }

    #[test]
    fn host_ipc_and_pid_are_refused_unless_the_node_allows_them() {
        // containerd's ipc=NODE / pid=NODE: the type left out of the spec.
        let mut v = base();
        v["linux"]["namespaces"] = json!([{"type": "mount"}]);
        let p = plan(&spec(v), Path::new("/b")).unwrap();
        let e = check_host_namespaces(&p.ipc, &p.pid, &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ipc=NODE") && e.contains("CRUST_SHIM_HOST_NAMESPACES=ipc"),
            "{e}"
        );
        let e = check_host_namespaces(&p.ipc, &p.pid, &[HostNamespace::Ipc])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("pid=NODE") && e.contains("CRUST_SHIM_HOST_NAMESPACES=pid"),
            "{e}"
        );
        check_host_namespaces(&p.ipc, &p.pid, &[HostNamespace::Pid, HostNamespace::Ipc]).unwrap();
        // A pod's own namespaces are never refused.
        let p = plan(&spec(base()), Path::new("/b")).unwrap();
        check_host_namespaces(&p.ipc, &p.pid, &[]).unwrap();
    }

    #[test]
    fn host_network_is_refused_unless_the_node_chose_user_mode() {
        let e = check_host_network(&PodNetworkSpec::Host, HostNetwork::Refuse).unwrap_err();
        assert_eq!(e.code(), crate::shim::Code::FailedPrecondition);
        let e = e.to_string();
        assert!(
            e.contains("hostNetwork") && e.contains("CRUST_SHIM_HOST_NETWORK=user"),
            "{e}"
        );
        check_host_network(&PodNetworkSpec::Host, HostNetwork::User).unwrap();
        for own in [
            PodNetworkSpec::Empty,
            PodNetworkSpec::Namespace("/x".into()),
        ] {
            check_host_network(&own, HostNetwork::Refuse).unwrap();
        }
    }

    #[test]
    fn ipc_and_uts_namespaces_follow_the_spec() {
        // base(): a member of sb1 with its own pid and the sandbox's ipc.
        let p = plan(&spec(base()), Path::new("/b")).unwrap();
        assert_eq!(p.ipc, NamespaceSource::Container { id: "sb1".into() });
        assert_eq!(p.uts, NamespaceSource::Guest);
        let mut v = base();
        v["annotations"] = json!({});
        v["hostname"] = json!("pod-a");
        v["linux"]["namespaces"] = json!([{"type": "ipc"}, {"type": "uts"}]);
        let p = plan(&spec(v.clone()), Path::new("/b")).unwrap();
        assert_eq!((p.ipc, p.uts), (NamespaceSource::New, NamespaceSource::New));
        assert_eq!(p.hostname, "pod-a");
        v["linux"]["namespaces"] = json!([{"type": "uts", "path": "/proc/1/ns/uts"}]);
        let e = plan(&spec(v), Path::new("/b")).unwrap_err();
        assert!(e.to_string().contains("/proc/1/ns/uts"), "{e}");
    }

    #[test]
    fn seccomp_pid_sysctls_and_oom_score_reach_the_guest() {
        let mut v = base();
        v["process"]["oomScoreAdj"] = json!(500);
        v["linux"]["sysctl"] = json!({"net.ipv4.ip_forward": "1", "kernel.shm_rmid_forced": "1"});
        let section = json!({"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 38,
            "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"],
            "flags": ["SECCOMP_FILTER_FLAG_SPEC_ALLOW"],
            "syscalls": [{"names": ["clone"], "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": 2114060288, "op": "SCMP_CMP_MASKED_EQ"}]}]});
        v["linux"]["seccomp"] = section.clone();
        let p = plan(&spec(v.clone()), Path::new("/b")).unwrap();
        assert_eq!(p.process.oom_score_adj, Some(500));
        // base(): a member of sb1 whose pid namespace has no path: its own.
        assert_eq!(p.pid, NamespaceSource::New);
        assert_eq!(p.sysctl.len(), 2);
        // The agent gets the OCI section as it was written.
        assert_eq!(
            serde_json::to_value(p.seccomp.unwrap()).unwrap(),
            json!({"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 38,
                "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"],
                "flags": ["SECCOMP_FILTER_FLAG_SPEC_ALLOW"],
                "syscalls": [{"names": ["clone"], "action": "SCMP_ACT_ALLOW", "errnoRet": null,
                    "args": [{"index": 0, "value": 2114060288, "valueTwo": null, "op": "SCMP_CMP_MASKED_EQ"}]}],
                "listenerPath": null})
        );
        // CRI's shareProcessNamespace: the sandbox's.
        v["linux"]["namespaces"] = json!([{"type": "pid", "path": "/proc/42/ns/pid"},
            {"type": "ipc", "path": "/proc/42/ns/ipc"}]);
        let p = plan(&spec(v.clone()), Path::new("/b")).unwrap();
        assert_eq!(p.pid, NamespaceSource::Container { id: "sb1".into() });
        // A sysctl that is not namespaced, or IPC's without the namespace.
        for (sysctl, needle) in [
            (
                json!({"kernel.panic": "1"}),
                "\"kernel.panic\" is not namespaced",
            ),
            (
                json!({"kernel.domainname": "x"}),
                "\"kernel.domainname\" needs a UTS namespace",
            ),
        ] {
            let mut w = v.clone();
            w["linux"]["sysctl"] = sysctl;
            let e = plan(&spec(w), Path::new("/b")).unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    #[test]
    fn a_malformed_seccomp_section_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut v = base();
        v["linux"]["seccomp"] = json!({"defaultAction": "SCMP_ACT_ALLOW",
            "architectures": ["SCMP_ARCH_Z80"]});
        std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
        let e = load(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("linux.seccomp: unknown variant `SCMP_ARCH_Z80`"),
            "{e}"
        );
    }

    #[test]
    fn a_user_namespace_carries_the_specs_mappings() {
        let mut v = base();
        v["linux"]["namespaces"] = json!([{"type": "pid"}, {"type": "user"}]);
        v["linux"]["uidMappings"] = json!([{"containerID": 0, "hostID": 100000, "size": 65536}]);
        v["linux"]["gidMappings"] = json!([{"containerID": 0, "hostID": 200000, "size": 65536}]);
        let p = plan(&spec(v.clone()), Path::new("/b")).unwrap();
        assert_eq!(p.user.source, NamespaceSource::New);
        assert_eq!(
            (
                p.user.uid_mappings[0].host_id,
                p.user.gid_mappings[0].host_id
            ),
            (100000, 200000)
        );
        // CRI: a member joins the sandbox's.
        v["linux"]["namespaces"] = json!([{"type": "user", "path": "/proc/42/ns/user"}]);
        let p = plan(&spec(v.clone()), Path::new("/b")).unwrap();
        assert_eq!(
            p.user.source,
            NamespaceSource::Container { id: "sb1".into() }
        );
        // Refused by field before anything boots.
        v["linux"]["namespaces"] = json!([{"type": "user"}]);
        v["linux"]["uidMappings"] = json!([{"containerID": 0, "hostID": 4294967295u32, "size": 1}]);
        let e = plan(&spec(v.clone()), Path::new("/b")).unwrap_err();
        assert!(
            e.to_string()
                .contains("linux.uidMappings[0]: hostID 4294967295"),
            "{e}"
        );
        v["linux"]["namespaces"] = json!([]);
        v["linux"]["uidMappings"] = json!([{"containerID": 0, "hostID": 1000, "size": 1}]);
        let e = plan(&spec(v), Path::new("/b")).unwrap_err();
        assert!(e.to_string().contains("without a user namespace"), "{e}");
    }

    #[test]
    fn the_pods_network_comes_from_its_namespace() {
        let net = |ns: serde_json::Value| {
            let mut v = base();
            v["linux"]["namespaces"] = ns;
            plan(&spec(v), Path::new("/b")).unwrap().network
        };
        assert_eq!(net(json!([{"type": "pid"}])), PodNetworkSpec::Host);
        assert_eq!(net(json!([{"type": "network"}])), PodNetworkSpec::Empty);
        assert_eq!(
            net(json!([{"type": "network", "path": "/var/run/netns/cni-1"}])),
            PodNetworkSpec::Namespace("/var/run/netns/cni-1".into())
        );
    }

    #[test]
    fn anti_spoofing_is_on_unless_the_pod_turns_it_off() {
        let with = |value: Option<&str>| {
            let mut v = base();
            if let Some(x) = value {
                v["annotations"][CRUST_ANTI_SPOOFING] = json!(x);
            }
            plan(&spec(v), Path::new("/b")).map(|p| p.anti_spoofing)
        };
        assert_eq!(with(None).unwrap(), crust_podnet::AntiSpoof::On);
        assert_eq!(with(Some("on")).unwrap(), crust_podnet::AntiSpoof::On);
        assert_eq!(with(Some("off")).unwrap(), crust_podnet::AntiSpoof::Off);
        let e = with(Some("no")).unwrap_err().to_string();
        assert!(
            e.contains(CRUST_ANTI_SPOOFING) && e.contains("\"no\""),
            "{e}"
        );
    }

    #[test]
    fn an_updates_resources_are_read_as_containerd_sends_them() {
        let r = json!({"memory": {"limit": 536870912, "swap": 536870912},
                       "cpu": {"shares": 2048, "quota": 200000, "period": 100000}});
        let l = update_limits(LINUX_RESOURCES_URL, r.to_string().as_bytes()).unwrap();
        assert_eq!(l.memory, Some(512 << 20));
        assert_eq!(
            l.cpu,
            Some(crust_agent_proto::CpuMax {
                quota_us: Some(200_000),
                period_us: 100_000
            })
        );
        // Unlimited CPU; no memory limit leaves it as it is.
        let r = json!({"cpu": {"quota": -1, "period": 100000}});
        let l = update_limits(LINUX_RESOURCES_URL, r.to_string().as_bytes()).unwrap();
        assert_eq!((l.memory, l.cpu.unwrap().quota_us), (None, None));
        for (r, field) in [
            (
                json!({"memory": {"limit": -5}}),
                "linux.resources.memory.limit",
            ),
            (
                json!({"cpu": {"quota": 10, "period": 100000}}),
                "linux.resources.cpu.quota",
            ),
            (
                json!({"cpu": {"quota": 100000, "period": 10}}),
                "linux.resources.cpu.period",
            ),
        ] {
            let e = update_limits(LINUX_RESOURCES_URL, r.to_string().as_bytes()).unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
        }
        let e = update_limits("types.containerd.io/x/WindowsResources", b"{}").unwrap_err();
        assert!(e.to_string().contains("WindowsResources"), "{e}");
        assert!(update_limits(LINUX_RESOURCES_URL, b"{oops").is_err());
    }
}
