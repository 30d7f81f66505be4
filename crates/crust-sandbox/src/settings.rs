//! The sandbox's settings as flags and environment (`CRUST_RUNTIME_*`):
//! the CLI takes them as global flags, the containerd shim and the
//! per-poll path from the environment alone.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser};
use crust_handoff::{DEFAULT_CRUST_ROOT, DEFAULT_KATA_ROOT};

use crate::config::{Accel, Config};
use crate::error::RuntimeError;

/// The QEMU looked up on PATH unless --qemu says otherwise.
pub const DEFAULT_QEMU: &str = "qemu-system-x86_64";

#[derive(Debug, Clone, Args)]
pub struct GlobalOpts {
    /// Sandbox state directory.
    #[arg(
        long,
        env = "CRUST_RUNTIME_ROOT",
        default_value = "/run/crust-runtime",
        global = true
    )]
    pub root: PathBuf,
    /// KEP-2857 hand-off root.
    #[arg(long, env = "CRUST_RUNTIME_CRUST_ROOT", default_value = DEFAULT_CRUST_ROOT, global = true)]
    pub crust_root: PathBuf,
    /// Kata direct-volumes hand-off root.
    #[arg(long, env = "CRUST_RUNTIME_KATA_ROOT", default_value = DEFAULT_KATA_ROOT, global = true)]
    pub kata_root: PathBuf,
    /// Where Kata's CLI looks for a sandbox's shim: the shim socket is linked
    /// as `<dir>/<id>/shim-monitor.sock` in each (comma-separated; empty: none).
    #[arg(
        long,
        env = "CRUST_RUNTIME_KATA_SHIM_DIRS",
        default_value = crate::katashim::DEFAULT_DIRS,
        value_delimiter = ',',
        global = true
    )]
    pub kata_shim_dirs: Vec<String>,
    /// kubelet's pods dir (`<kubelet root>/pods`): subPath probing stops
    /// at `<this>/<uid>/volumes`. Empty (the default): read from each
    /// pod's mount sources, `/var/lib/kubelet/pods` for a bundle that
    /// names no pod; set, a pod whose sources say otherwise is refused.
    #[arg(
        long,
        env = "CRUST_RUNTIME_PODS_LAYER_STOP",
        default_value = "",
        global = true
    )]
    pub pods_layer_stop: String,
    /// Guest kernel (default: $CRUST_GUEST_DIR/vmlinuz or <exe dir>/../guest-image/vmlinuz).
    #[arg(long, env = "CRUST_RUNTIME_GUEST_KERNEL", global = true)]
    pub guest_kernel: Option<PathBuf>,
    /// Guest initramfs (default: next to the kernel, initramfs.cpio.gz).
    #[arg(long, env = "CRUST_RUNTIME_GUEST_INITRD", global = true)]
    pub guest_initrd: Option<PathBuf>,
    #[arg(
        long,
        env = "CRUST_RUNTIME_ACCEL",
        value_enum,
        default_value = "auto",
        global = true
    )]
    pub accel: Accel,
    /// QEMU binary (looked up in PATH unless absolute).
    #[arg(
        long,
        env = "CRUST_RUNTIME_QEMU",
        default_value = DEFAULT_QEMU,
        global = true
    )]
    pub qemu: PathBuf,
    /// Root-only directory holding the `--accel auto` verdict of this host boot.
    #[arg(long, env = "CRUST_RUNTIME_ACCEL_CACHE", default_value = crust_vmm::DEFAULT_ACCEL_CACHE, global = true)]
    pub accel_cache: PathBuf,
    /// Bound on one call into a shim or guest agent, in milliseconds.
    #[arg(
        long,
        env = "CRUST_RUNTIME_TIMEOUT_MS",
        default_value = "10000",
        global = true
    )]
    pub timeout_ms: u64,
    /// Bound on sandbox creation and on one resize, in milliseconds.
    #[arg(
        long,
        env = "CRUST_RUNTIME_BOOT_TIMEOUT_MS",
        default_value = "120000",
        global = true
    )]
    pub boot_timeout_ms: u64,
    /// Guest memory.
    #[arg(
        long,
        env = "CRUST_RUNTIME_MEMORY_MIB",
        default_value = "256",
        global = true
    )]
    pub memory_mib: u32,
    /// Guest vCPUs.
    #[arg(long, env = "CRUST_RUNTIME_CPUS", default_value = "1", global = true)]
    pub cpus: u32,
    /// Share the bundle's binds that have no hand-off record into the
    /// guest over virtio-fs (as the containerd shim does) instead of
    /// skipping them.
    #[arg(long, env = "CRUST_RUNTIME_SHARE_BINDS", global = true)]
    pub share_binds: bool,
    /// virtiofsd binary for --share-binds (looked up in PATH unless absolute).
    #[arg(
        long,
        env = "CRUST_RUNTIME_VIRTIOFSD",
        default_value = "virtiofsd",
        global = true
    )]
    pub virtiofsd_binary: PathBuf,
    /// crust-csi's Handover service (root-only unix socket): a container
    /// mount whose source is a target where crust-csi published a volume
    /// on the host is taken into the guest; empty: never asked.
    #[arg(
        long,
        env = "CRUST_RUNTIME_HANDOVER_ENDPOINT",
        default_value = crate::handover::DEFAULT_ENDPOINT,
        global = true
    )]
    pub handover_endpoint: String,
    /// Directories beneath which a regular file may be a volume's disk
    /// (comma-separated; empty: none). The default serves Kata's CSI
    /// driver. Every directory on such a file's path must be root's and
    /// writable by nobody else (root's sticky /tmp aside), with no symlink.
    #[arg(
        long,
        env = "CRUST_RUNTIME_FILE_DEVICE_ROOTS",
        default_value = crate::config::DEFAULT_FILE_DEVICE_ROOTS,
        value_delimiter = ',',
        global = true
    )]
    pub file_device_roots: Vec<String>,
    /// What a bundle's network namespace holding netfilter rules gets:
    /// refused, carried into the guest, or ignored (logged).
    #[arg(
        long,
        env = "CRUST_RUNTIME_NETNS_RULES",
        value_enum,
        default_value = "refuse",
        global = true
    )]
    pub netns_rules: crate::net::NetnsRules,
}

impl GlobalOpts {
    /// The settings from the environment alone, defaults as for the whole
    /// command line (the per-poll path, `poll`, reads them so).
    pub fn from_env() -> Result<GlobalOpts, RuntimeError> {
        #[derive(Parser)]
        #[command(name = "crust-runtime")]
        struct EnvOnly {
            #[command(flatten)]
            global: GlobalOpts,
        }
        EnvOnly::try_parse_from(["crust-runtime"])
            .map(|e| e.global)
            .map_err(RuntimeError::EnvSettings)
    }

    pub fn config(&self) -> Config {
        let dir = Config::default_guest_dir();
        let guest_kernel = self
            .guest_kernel
            .clone()
            .unwrap_or_else(|| dir.join("vmlinuz"));
        let guest_initrd = self.guest_initrd.clone().unwrap_or_else(|| {
            guest_kernel
                .parent()
                .map(|p| p.join("initramfs.cpio.gz"))
                .unwrap_or_else(|| dir.join("initramfs.cpio.gz"))
        });
        Config {
            root: self.root.clone(),
            crust_root: self.crust_root.clone(),
            kata_root: self.kata_root.clone(),
            kata_shim_dirs: self
                .kata_shim_dirs
                .iter()
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .collect(),
            pods_layer_stop: self.pods_layer_stop.clone(),
            guest_kernel,
            guest_initrd,
            accel: self.accel,
            qemu: self.qemu.clone(),
            accel_cache: self.accel_cache.clone(),
            timeout: Duration::from_millis(self.timeout_ms.max(1)),
            boot_timeout: Duration::from_millis(self.boot_timeout_ms.max(1)),
            memory_mib: self.memory_mib,
            cpus: self.cpus.max(1),
            share_binds: self.share_binds,
            virtiofsd: self.virtiofsd_binary.clone(),
            handover_endpoint: self.handover_endpoint.clone(),
            file_device_roots: self
                .file_device_roots
                .iter()
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .collect(),
            netns_rules: self.netns_rules,
        }
    }
}
