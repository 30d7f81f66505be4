//! Runtime-wide settings (from flags or `CRUST_RUNTIME_*`), shared by the
//! CLI and the shim it spawns.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// How QEMU executes the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Accel {
    Tcg,
    Kvm,
    /// KVM once a probe boot proved it on this host (cached per host
    /// boot), else TCG; a hanging KVM boot is retried under TCG.
    Auto,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
            Accel::Auto => "auto",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    /// Sandbox state: `<root>/<id>/`.
    pub root: PathBuf,
    /// KEP-2857 hand-off root.
    pub crust_root: PathBuf,
    /// Kata direct-volumes hand-off root.
    pub kata_root: PathBuf,
    /// Where each sandbox's shim socket is linked for Kata's CLI
    /// (`<dir>/<id>/shim-monitor.sock`); see [`crate::katashim`].
    pub kata_shim_dirs: Vec<PathBuf>,
    /// kubelet's pods directory; parent probing stops at `<pods>/<uid>/volumes`.
    pub pods_layer_stop: String,
    pub guest_kernel: PathBuf,
    pub guest_initrd: PathBuf,
    pub accel: Accel,
    /// QEMU binary (looked up in PATH unless absolute).
    pub qemu: PathBuf,
    /// Where `--accel auto` keeps its per-host-boot verdict.
    pub accel_cache: PathBuf,
    /// Bound on one call into a shim or the guest agent.
    pub timeout: Duration,
    /// Bound on `create` (guest boot, hot-plug, mounts) and on a resize.
    pub boot_timeout: Duration,
    pub memory_mib: u32,
    pub cpus: u32,
    /// Share bundle binds without a hand-off record into the guest over
    /// virtio-fs (the containerd shim always does); off: they are skipped.
    pub share_binds: bool,
    /// virtiofsd binary for `share_binds` (looked up in PATH unless absolute).
    pub virtiofsd: PathBuf,
    /// crust-csi's Handover service (`unix://` path; empty: never asked).
    pub handover_endpoint: String,
    /// Directories beneath which a regular file may be a volume's disk.
    pub file_device_roots: Vec<PathBuf>,
    /// Netfilter rules in a sandbox's network namespace (the CLI door;
    /// the containerd shim has `CRUST_SHIM_NETNS_RULES`).
    pub netns_rules: crate::net::NetnsRules,
}

/// Where Kata's CSI driver (csi-kata-directvolume) keeps its volumes'
/// backing files in its shipped DaemonSet (`STORAGE_POOL`, a hostPath):
/// `<this>/<volume id>/directvol-rawdisk.<size>`.
pub const DEFAULT_FILE_DEVICE_ROOTS: &str = "/tmp/kata-directvol-storages";

/// The setting behind [`Config::file_device_roots`], as refusals name it.
pub const FILE_DEVICE_SETTING: &str = "--file-device-roots (CRUST_RUNTIME_FILE_DEVICE_ROOTS)";

impl Config {
    /// The default guest image directory: `$CRUST_GUEST_DIR`, else
    /// `<dir of this executable>/../guest-image` (i.e. `target/guest-image`
    /// next to `target/<profile>/crust-runtime`).
    pub fn default_guest_dir() -> PathBuf {
        if let Some(d) = std::env::var_os("CRUST_GUEST_DIR") {
            return PathBuf::from(d);
        }
        std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|p| p.join("../guest-image")))
            .unwrap_or_else(|| PathBuf::from("guest-image"))
    }

    /// Longest a sandbox creation may take: the boot bound, plus what
    /// `--accel auto` may spend proving KVM on a half-working host.
    pub fn create_timeout(&self) -> Duration {
        let extra = match self.accel {
            Accel::Auto => {
                let vc = crust_vmm::VmConfig::new("x", "/", "/", "/");
                crust_vmm::auto_overhead(&vc)
            }
            _ => Duration::ZERO,
        };
        self.boot_timeout + extra
    }

    /// A file installed next to this executable's directory, as the node
    /// installer lays out `/opt/crust` (`bin/qemu-system-x86_64`,
    /// `share/qemu/qboot.rom`): `rel` is relative to the executable's
    /// directory. None when absent (a development build uses the host's).
    pub fn bundled(rel: &str) -> Option<PathBuf> {
        let exe = std::env::current_exe().ok()?;
        let p = exe.parent()?.join(rel);
        p.is_file().then_some(p)
    }

    /// Flags that recreate this configuration in a child process (the shim).
    pub fn to_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::new();
        let mut push = |k: &str, v: OsString| {
            a.push(k.into());
            a.push(v);
        };
        push("--root", self.root.clone().into());
        push("--crust-root", self.crust_root.clone().into());
        push("--kata-root", self.kata_root.clone().into());
        let dirs: Vec<String> = self
            .kata_shim_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        push("--kata-shim-dirs", dirs.join(",").into());
        push("--pods-layer-stop", self.pods_layer_stop.clone().into());
        push("--guest-kernel", self.guest_kernel.clone().into());
        push("--guest-initrd", self.guest_initrd.clone().into());
        push("--accel", self.accel.as_str().into());
        push("--qemu", self.qemu.clone().into());
        push("--accel-cache", self.accel_cache.clone().into());
        push("--timeout-ms", self.timeout.as_millis().to_string().into());
        push(
            "--boot-timeout-ms",
            self.boot_timeout.as_millis().to_string().into(),
        );
        push("--memory-mib", self.memory_mib.to_string().into());
        push("--cpus", self.cpus.to_string().into());
        push("--virtiofsd-binary", self.virtiofsd.clone().into());
        push("--handover-endpoint", self.handover_endpoint.clone().into());
        let roots: Vec<String> = self
            .file_device_roots
            .iter()
            .map(|r| r.display().to_string())
            .collect();
        push("--file-device-roots", roots.join(",").into());
        if self.share_binds {
            a.push("--share-binds".into());
        }
        a
    }
}
