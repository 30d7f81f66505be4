//! The shim's settings: the same `CRUST_RUNTIME_*` variables as
//! `crust-runtime` (roots, guest image, accelerator, timeouts), inherited
//! from containerd's environment, plus a few of its own.

use std::path::{Path, PathBuf};

use clap::Parser;
use crust_sandbox::config::Config;
use crust_sandbox::settings::GlobalOpts;

use crust_sandbox::spec::{HostNamespace, HostNetwork, LsmPolicy};

/// Memory the guest gets on top of its containers' limits: the kernel
/// (about 54 MiB reserved at boot by this image's kernel), the agent, the
/// rootfs image and room to work once the containers fill their limits
/// (`tests/guest_room.rs`: about 21 MiB left at 96). A RuntimeClass
/// `overhead.podFixed.memory` should state at least this plus QEMU's,
/// virtiofsd's and the shim's own PSS (the README's density benchmark).
pub const DEFAULT_OVERHEAD_MIB: u32 = 96;

#[derive(Debug, Parser)]
#[command(name = "containerd-shim-crust-v2", no_binary_name = true)]
struct EnvOpts {
    #[command(flatten)]
    global: GlobalOpts,
    /// The runtime CLI recorded in hand-off claims (crust_ops runs
    /// `<cli> crust stats|resize`); default: `crust-runtime-poll` next to
    /// the shim, else `crust-runtime` there.
    #[arg(long, env = "CRUST_SHIM_RUNTIME_CLI")]
    runtime_cli: Option<PathBuf>,
    /// Guest memory beyond the containers' limits.
    #[arg(long, env = "CRUST_SHIM_MEMORY_OVERHEAD_MIB", default_value_t = DEFAULT_OVERHEAD_MIB)]
    overhead_mib: u32,
    /// virtiofsd binary.
    #[arg(long, env = "CRUST_SHIM_VIRTIOFSD", default_value = "virtiofsd")]
    virtiofsd: PathBuf,
    /// Ceiling of a pod's guest memory with hot-added DIMMs.
    #[arg(long, env = "CRUST_SHIM_MAX_MEMORY_MIB", default_value_t = 8192)]
    max_memory_mib: u32,
    /// Ceiling of a pod's vCPUs with hot-plugged ones; 0: the host's cores.
    #[arg(long, env = "CRUST_SHIM_MAX_CPUS", default_value_t = 0)]
    max_cpus: u32,
    /// A container's AppArmor profile / SELinux label: `ignore` (logged
    /// once per pod) or `refuse`.
    #[arg(
        long,
        env = "CRUST_SHIM_LSM_POLICY",
        value_enum,
        default_value = "ignore"
    )]
    lsm_policy: LsmPolicy,
    /// Netfilter rules already in a pod's network namespace, which the
    /// guest's traffic would bypass: `refuse` the pod (and publish an
    /// event naming them), apply them in the `guest` (iptables rules), or
    /// `ignore` them (logged).
    /// (The runtime CLI's `CRUST_RUNTIME_NETNS_RULES` is the same choice
    /// for its door; the shim takes its own, which it puts in the runtime
    /// settings it passes on.)
    #[arg(
        id = "shim_netns_rules",
        long = "shim-netns-rules",
        env = "CRUST_SHIM_NETNS_RULES",
        value_enum,
        default_value = "refuse"
    )]
    netns_rules: NetnsRules,
    /// Host namespaces (`ipc`, `pid`, comma-separated) a container may ask
    /// for and get the guest's own instead; any other is refused.
    #[arg(
        long,
        env = "CRUST_SHIM_HOST_NAMESPACES",
        value_enum,
        value_delimiter = ','
    )]
    host_namespaces: Vec<HostNamespace>,
    /// A `hostNetwork` pod: `refuse` it, or give its guest the host's
    /// connectivity through QEMU's `user` (user-mode, NAT) network.
    #[arg(
        long,
        env = "CRUST_SHIM_HOST_NETWORK",
        value_enum,
        default_value = "refuse"
    )]
    host_network: HostNetwork,
}

pub use crust_sandbox::net::NetnsRules;

/// A pod's [`crust_sandbox::spec::CRUST_MEMORY`] annotation above a cap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "annotation {} = {asked} asks for {cap}",
    crust_sandbox::spec::CRUST_MEMORY
)]
pub struct MemoryAskRefused {
    pub asked: u64,
    pub cap: String,
}

#[derive(Debug, Clone)]
pub struct ShimConfig {
    pub runtime: Config,
    pub runtime_cli: String,
    pub overhead_mib: u32,
    pub virtiofsd: PathBuf,
    pub max_memory_mib: u32,
    /// 0: the host's cores ([`ShimConfig::max_vcpus`]).
    pub max_cpus: u32,
    pub lsm_policy: LsmPolicy,
    pub host_namespaces: Vec<HostNamespace>,
    pub host_network: HostNetwork,
}

impl ShimConfig {
    pub fn from_env() -> anyhow::Result<ShimConfig> {
        let o = EnvOpts::try_parse_from(Vec::<String>::new())?;
        let runtime_cli = match o.runtime_cli {
            Some(p) => p,
            None => crust_sandbox::claims::cli_in(
                std::env::current_exe()?
                    .parent()
                    .unwrap_or(Path::new("/usr/local/bin")),
            ),
        };
        let mut runtime = o.global.config();
        if std::env::var_os("CRUST_RUNTIME_GUEST_KERNEL").is_none()
            && std::env::var_os("CRUST_GUEST_DIR").is_none()
            && let Ok(exe) = std::env::current_exe()
            && let Some(dir) = exe.parent()
        {
            // Installed next to the binaries: <dir>/../guest-image or /usr/share.
            for d in [
                dir.join("../guest-image"),
                PathBuf::from("/usr/share/crust/guest-image"),
            ] {
                if d.join("vmlinuz").is_file() {
                    runtime.guest_kernel = d.join("vmlinuz");
                    runtime.guest_initrd = d.join("initramfs.cpio.gz");
                    break;
                }
            }
        }
        runtime.netns_rules = o.netns_rules;
        Ok(ShimConfig {
            runtime,
            runtime_cli: runtime_cli.to_string_lossy().into_owned(),
            overhead_mib: o.overhead_mib,
            virtiofsd: o.virtiofsd,
            max_memory_mib: o.max_memory_mib,
            max_cpus: o.max_cpus,
            lsm_policy: o.lsm_policy,
            host_namespaces: o.host_namespaces,
            host_network: o.host_network,
        })
    }

    /// The bounds in-place resize holds a pod's VM to.
    pub fn bounds(&self) -> crust_sandbox::resize::Bounds {
        crust_sandbox::resize::Bounds {
            overhead_mib: self.overhead_mib,
            max_memory_mib: self.max_memory_mib,
        }
    }

    /// How many vCPUs a pod's VM can grow to (QEMU's `maxcpus`).
    pub fn max_vcpus(&self) -> u32 {
        match self.max_cpus {
            0 => std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1)
                .min(64),
            n => n.min(64),
        }
    }

    /// The pod's memory in bytes: what kubelet sent (`kubelet`: the
    /// sandbox's memory, else the first container's limit), or what the
    /// pod's own annotation asks for when it stays within the node's cap
    /// ([`ShimConfig::max_memory_mib`], guest overhead included) and the
    /// pod's limits (kubelet's, and the pod cgroup's `cgroup_limit`).
    /// Anything else is refused, naming the annotation and the cap.
    pub fn pod_memory(
        &self,
        kubelet: Option<u64>,
        asked: Option<u64>,
        cgroup_limit: Option<u64>,
    ) -> Result<Option<u64>, MemoryAskRefused> {
        let Some(asked) = asked else {
            return Ok(kubelet);
        };
        let refuse = |cap: String| MemoryAskRefused { asked, cap };
        let guest = self.guest_memory_mib(asked);
        if guest > self.max_memory_mib {
            return Err(refuse(format!(
                "a {guest} MiB guest with the overhead, above the node's cap of {} MiB \
                 (CRUST_SHIM_MAX_MEMORY_MIB)",
                self.max_memory_mib
            )));
        }
        for (limit, whose) in [
            (kubelet, crust_sandbox::spec::SANDBOX_MEMORY),
            (cgroup_limit, "the pod cgroup's memory limit"),
        ] {
            if let Some(l) = limit.filter(|l| asked > *l) {
                return Err(refuse(format!(
                    "above the pod's own limit ({whose}: {l} bytes)"
                )));
            }
        }
        Ok(Some(asked))
    }

    /// Guest memory for a pod whose containers ask for `limits` bytes in
    /// total (0: unknown): the limits plus the overhead, at least the
    /// configured default.
    pub fn guest_memory_mib(&self, limits: u64) -> u32 {
        let want = (limits.div_ceil(1 << 20) as u32).saturating_add(self.overhead_mib);
        if limits == 0 {
            self.runtime.memory_mib.max(self.overhead_mib)
        } else {
            want
        }
    }
}

/// A configuration for the crate's unit tests: the defaults, with every
/// state root under `dir`.
#[cfg(test)]
pub(crate) fn for_tests(dir: &Path) -> ShimConfig {
    let mut runtime = EnvOpts::try_parse_from(Vec::<String>::new())
        .expect("defaults parse")
        .global
        .config();
    runtime.root = dir.join("rt");
    runtime.crust_root = dir.join("crust");
    runtime.kata_root = dir.join("kata");
    runtime.handover_endpoint = String::new();
    ShimConfig {
        runtime,
        runtime_cli: "/x".into(),
        overhead_mib: 160,
        virtiofsd: "virtiofsd".into(),
        max_memory_mib: 8192,
        max_cpus: 0,
        lsm_policy: LsmPolicy::Ignore,
        host_namespaces: Vec::new(),
        host_network: HostNetwork::Refuse,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shim's own settings and the runtime's it flattens in never
    /// share a name (clap panics at the shim's start otherwise, before
    /// it can say anything to containerd).
    #[test]
    fn the_shims_settings_and_the_runtimes_do_not_clash() {
        use clap::CommandFactory;
        EnvOpts::command().debug_assert();
        let c = for_tests(Path::new("/nonexistent"));
        assert_eq!(c.runtime.netns_rules, NetnsRules::Refuse);
    }

    #[test]
    fn memory_follows_the_limits() {
        let mut c = for_tests(Path::new("/nonexistent"));
        c.runtime.memory_mib = 256;
        assert_eq!(c.guest_memory_mib(0), 256);
        assert_eq!(c.guest_memory_mib(512 << 20), 672);
        assert_eq!(c.guest_memory_mib((512 << 20) + 1), 673);
    }

    #[test]
    fn a_pods_own_memory_annotation_stays_within_the_caps() {
        let mut c = for_tests(Path::new("/nonexistent"));
        c.overhead_mib = 96;
        c.max_memory_mib = 8192;
        const GIB: u64 = 1 << 30;
        // Without the annotation: kubelet's figure, whatever it is.
        assert_eq!(c.pod_memory(Some(GIB), None, None), Ok(Some(GIB)));
        assert_eq!(c.pod_memory(None, None, Some(GIB)), Ok(None));
        // Less than kubelet's and the cgroup's, within the cap: taken.
        assert_eq!(
            c.pod_memory(Some(2 * GIB), Some(GIB), Some(2 * GIB)),
            Ok(Some(GIB))
        );
        // 16 GiB on an 8 GiB node; 8 GiB plus the guest overhead too.
        for asked in [16 * GIB, 8 * GIB] {
            let e = c.pod_memory(None, Some(asked), None).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("io.crust.memory-bytes")
                    && msg.contains("CRUST_SHIM_MAX_MEMORY_MIB")
                    && msg.contains("8192 MiB"),
                "{msg}"
            );
        }
        // More than the pod's own limits.
        let e = c.pod_memory(Some(GIB), Some(2 * GIB), None).unwrap_err();
        assert!(
            e.to_string().contains("io.kubernetes.cri.sandbox-memory"),
            "{e}"
        );
        let e = c.pod_memory(None, Some(2 * GIB), Some(GIB)).unwrap_err();
        assert!(e.to_string().contains("pod cgroup's memory limit"), "{e}");
    }
}
