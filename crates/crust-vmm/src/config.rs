//! What a guest is launched with, and the QMP arguments for its disks.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use crate::VmError;

/// Which accelerator QEMU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Software emulation; works everywhere.
    Tcg,
    /// Hardware virtualization; launch fails if /dev/kvm is unusable.
    Kvm,
    /// KVM once a probe boot of the guest image reached its agent under
    /// KVM on this host (cached per host boot), TCG otherwise; a KVM boot
    /// that hangs is retried under TCG (see [`crate::accel`]).
    #[default]
    Auto,
}

/// A disk attached at boot, or described for hot-plug.
///
/// Naming used on the QEMU side (and by [`DiskSpec::blockdev_add_args`] /
/// [`DiskSpec::device_add_args`] for hot-plug): block node
/// `crust-node-<id>`, device `crust-disk-<id>`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DiskSpec {
    /// `[A-Za-z][A-Za-z0-9_-]*`, at most 20 bytes; unique within the VM.
    pub id: String,
    /// Absolute path of a block device or regular file.
    pub path: PathBuf,
    /// virtio-blk serial the guest sees (`/sys/block/vdX/serial`):
    /// `[A-Za-z0-9_-]`, 1..=20 bytes (the virtio-blk limit).
    pub serial: String,
    pub readonly: bool,
}

/// Longest virtio-blk serial (VIRTIO_BLK_ID_BYTES).
pub const MAX_SERIAL_LEN: usize = 20;

impl DiskSpec {
    /// QEMU block node name.
    pub fn node_name(&self) -> String {
        format!("crust-node-{}", self.id)
    }

    /// QEMU device id (for `device_del`).
    pub fn device_id(&self) -> String {
        format!("crust-disk-{}", self.id)
    }

    /// Checks id, serial and path.
    pub fn validate(&self) -> Result<(), VmError> {
        let bad = |m: String| Err(VmError::InvalidConfig(m));
        let id_ok = !self.id.is_empty()
            && self.id.len() <= 20
            && self.id.as_bytes()[0].is_ascii_alphabetic()
            && self
                .id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !id_ok {
            return bad(format!(
                "disk id {:?}: use 1-20 characters [A-Za-z0-9_-] starting with a letter",
                self.id
            ));
        }
        if !valid_serial(&self.serial) {
            return bad(format!(
                "disk {:?}: serial {:?} must be 1-{MAX_SERIAL_LEN} characters [A-Za-z0-9_-]",
                self.id, self.serial
            ));
        }
        if !self.path.is_absolute() {
            return bad(format!(
                "disk {:?}: path {} is not absolute",
                self.id,
                self.path.display()
            ));
        }
        match std::fs::metadata(&self.path) {
            Ok(m) if m.is_file() || is_block(&m) => Ok(()),
            Ok(_) => bad(format!(
                "disk {:?}: {} is neither a block device nor a regular file",
                self.id,
                self.path.display()
            )),
            Err(e) => bad(format!("disk {:?}: {}: {e}", self.id, self.path.display())),
        }
    }

    /// Arguments of QMP `blockdev-add` for this disk (also used verbatim as
    /// the `-blockdev` JSON of boot disks): raw format over `host_device`
    /// or `file`, O_DIRECT (`cache.direct=on`) with the best engine the
    /// host allows ([`crust_qmp::BlockIo::host_best`]; buffered only under
    /// the A/B switch [`crust_qmp::HOST_CACHE_ENV`]).
    pub fn blockdev_add_args(&self) -> Value {
        let is_blk = std::fs::metadata(&self.path)
            .map(|m| is_block(&m))
            .unwrap_or(false);
        let mut file = json!({
            "driver": if is_blk { "host_device" } else { "file" },
            "filename": self.path,
            "read-only": self.readonly,
        });
        crust_qmp::BlockIo::host_best().apply(&mut file);
        json!({
            "node-name": self.node_name(),
            "driver": "raw",
            "read-only": self.readonly,
            "file": file,
        })
    }

    /// The iothread a boot disk's device runs in.
    pub fn iothread_id(&self) -> String {
        format!("iothread-{}", self.device_id())
    }

    /// Arguments of QMP `device_add` putting the disk on root port `bus`
    /// (one of [`crate::Vm::hotplug_ports`]).
    pub fn device_add_args(&self, bus: &str) -> Value {
        json!({
            "driver": "virtio-blk-pci",
            "id": self.device_id(),
            "drive": self.node_name(),
            "serial": self.serial,
            "bus": bus,
        })
    }
}

fn is_block(m: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    m.file_type().is_block_device()
}

/// Whether `s` is usable as a virtio-blk serial here.
pub fn valid_serial(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_SERIAL_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A host directory shared into the guest over virtio-fs: one `virtiofsd`
/// per share ([`VIRTIOFSD_ARGS`]), a `vhost-user-fs-pci` device with `tag`.
/// In the guest: `mount -t virtiofs <tag> <dir>`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShareSpec {
    /// `[A-Za-z0-9._-]`, 1..=36 bytes (the virtio-fs tag limit).
    pub tag: String,
    /// Absolute path of an existing directory.
    pub dir: PathBuf,
}

/// Longest virtio-fs tag.
pub const MAX_TAG_LEN: usize = 36;

/// How virtiofsd serves every share (besides its socket and directory):
/// the guest's page cache follows the host's (`cache=auto`), extended
/// attributes pass through (file capabilities of image binaries), the
/// daemon runs in its own namespaces (`sandbox=namespace`, the default) and
/// host mount points below the share are announced as submounts, and the
/// daemon cannot make device nodes on the host (`-mknod`: a guest's `/dev`
/// is its own tmpfs; a node in a shared rootfs would be a host device).
pub const VIRTIOFSD_ARGS: &[&str] = &[
    "--cache",
    "auto",
    "--xattr",
    "--announce-submounts",
    "--sandbox",
    "namespace",
    "--modcaps=-mknod",
];

impl ShareSpec {
    pub fn validate(&self) -> Result<(), VmError> {
        let bad = |m: String| Err(VmError::InvalidConfig(m));
        let tag_ok = !self.tag.is_empty()
            && self.tag.len() <= MAX_TAG_LEN
            && self
                .tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !tag_ok {
            return bad(format!(
                "share tag {:?}: use 1-{MAX_TAG_LEN} characters [A-Za-z0-9._-]",
                self.tag
            ));
        }
        if !self.dir.is_absolute() || !self.dir.is_dir() {
            return bad(format!(
                "share {:?}: {} is not an existing absolute directory",
                self.tag,
                self.dir.display()
            ));
        }
        Ok(())
    }
}

/// A virtio-net NIC on a tap the caller opened (one descriptor per
/// queue; several make a multi-queue NIC). QEMU inherits the descriptors,
/// so it never opens a tap by name. Without descriptors
/// ([`NicSpec::user_mode`]) the NIC is on QEMU's user-mode network.
#[derive(Debug, Clone)]
pub struct NicSpec {
    /// `aa:bb:cc:dd:ee:ff`: the guest finds its interface by it.
    pub mac: String,
    /// Offered to the guest (`host_mtu`).
    pub mtu: u32,
    pub fds: Vec<std::sync::Arc<std::os::fd::OwnedFd>>,
}

/// QEMU's user-mode network (`-netdev user`, NAT through the host's own
/// sockets): the guest's address, the gateway (the host; its loopback
/// too) and the DNS forwarder, on [`USER_NET_PREFIX`].
pub const USER_NET_GUEST: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 0, 2, 15);
pub const USER_NET_GATEWAY: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 0, 2, 2);
pub const USER_NET_DNS: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 0, 2, 3);
pub const USER_NET_PREFIX: u8 = 24;
/// The user-mode NIC's MAC (locally administered, QEMU's usual).
pub const USER_NET_MAC: &str = "52:54:00:12:34:56";

/// `/dev/vhost-net`: the in-kernel virtio-net data path, used when the
/// host has it.
pub const VHOST_NET: &str = "/dev/vhost-net";

impl NicSpec {
    /// A NIC on QEMU's user-mode network ([`USER_NET_GUEST`]).
    pub fn user_mode() -> NicSpec {
        NicSpec {
            mac: USER_NET_MAC.into(),
            mtu: 1500,
            fds: Vec::new(),
        }
    }

    /// QEMU's `-netdev` and `-device` values for NIC `i`.
    pub fn qemu_args(&self, i: usize, vhost: bool) -> (String, String) {
        use std::os::fd::AsRawFd;
        if self.fds.is_empty() {
            let net = std::net::Ipv4Addr::from(
                u32::from(USER_NET_GUEST) & (u32::MAX << (32 - USER_NET_PREFIX)),
            );
            return (
                format!(
                    "user,id=crust-net{i},net={net}/{USER_NET_PREFIX},host={USER_NET_GATEWAY},\
                     dhcpstart={USER_NET_GUEST},dns={USER_NET_DNS},ipv6=off"
                ),
                format!(
                    "virtio-net-pci,id=crust-nic{i},netdev=crust-net{i},mac={},romfile=",
                    self.mac
                ),
            );
        }
        let fds: Vec<String> = self.fds.iter().map(|f| f.as_raw_fd().to_string()).collect();
        let fd_arg = match fds.as_slice() {
            [one] => format!("fd={one}"),
            many => format!("fds={}", many.join(":")),
        };
        let vhost = if vhost { "on" } else { "off" };
        let netdev = format!("tap,id=crust-net{i},{fd_arg},vhost={vhost}");
        let mut device = format!(
            "virtio-net-pci,id=crust-nic{i},netdev=crust-net{i},mac={},host_mtu={},romfile=",
            self.mac, self.mtu
        );
        if self.fds.len() > 1 {
            // Two vectors per queue pair, one for config, one for control.
            device.push_str(&format!(",mq=on,vectors={}", 2 * self.fds.len() + 2));
        }
        (netdev, device)
    }
}

/// Everything needed to launch one guest.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Shown in `ps` and QEMU messages; `[A-Za-z0-9._-]`, 1-64 bytes.
    pub name: String,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub memory_mib: u32,
    /// Room for memory hot-add (`-m M,slots=…,maxmem=…`, DIMMs onlined by
    /// the guest kernel as they arrive); 0 or not above `memory_mib`: none.
    pub max_memory_mib: u32,
    pub cpus: u32,
    /// Room for vCPU hot-plug (`-smp N,maxcpus=M`; the guest onlines what
    /// arrives); 0 or not above `cpus`: none.
    pub max_cpus: u32,
    /// Holds `qmp.sock`, `agent.sock`, `console.log`, `qemu.log`,
    /// `qemu.pid` and `vm.json`. Created (0700) if missing.
    pub run_dir: PathBuf,
    pub accel: Accel,
    /// Disks attached at boot, each on its own root port (so they can be
    /// unplugged later too).
    pub disks: Vec<DiskSpec>,
    /// Appended to the kernel command line.
    pub kernel_cmdline_extra: Vec<String>,
    /// Directories shared over virtio-fs (guest RAM then comes from a
    /// shared memfd, as vhost-user requires).
    pub shares: Vec<ShareSpec>,
    /// virtiofsd binary (looked up in PATH unless absolute).
    pub virtiofsd_binary: PathBuf,
    /// NICs at boot (the pod's network), in order.
    pub nics: Vec<NicSpec>,
    /// Empty `pcie-root-port`s reserved for hot-plug
    /// (`crust-hp0`..`crust-hp<N-1>`).
    pub hotplug_ports: u32,
    /// QEMU binary (looked up in PATH unless absolute).
    pub qemu_binary: PathBuf,
    /// Firmware image; `None` uses qboot when installed (faster direct
    /// kernel boot) and QEMU's default SeaBIOS otherwise.
    pub firmware: Option<PathBuf>,
    /// SIGKILL QEMU when the thread that launched it exits (Linux
    /// parent-death signal; meant for tests). Off by default so a VM can
    /// outlive the process that launched it.
    pub die_with_parent: bool,
    /// Cgroup directories (one per v1 hierarchy, or the v2 group) that
    /// QEMU and every virtiofsd join before they exec, so everything they
    /// allocate is charged there (the pod's cgroup). Must exist.
    pub cgroups: Vec<PathBuf>,
    /// Where `Accel::Auto` keeps its per-host-boot verdict (root-only);
    /// `None` probes on every boot.
    pub accel_cache: Option<PathBuf>,
    /// How long a KVM probe boot may take to reach the agent.
    pub kvm_probe_timeout: Duration,
    /// How long an `Auto` boot under KVM may take to reach the agent
    /// before it is retried under TCG ([`crate::Vm::boot`]).
    pub kvm_boot_timeout: Duration,
    /// The size of TCG's translation buffer in MiB (QEMU's `tb-size`): its
    /// pages are touched as code is translated and never given back, so
    /// it bounds what emulation adds to the pod's memory. 0: QEMU's own
    /// default (up to 1 GiB). Unused under KVM.
    pub tcg_tb_mib: u32,
}

/// Default [`VmConfig::accel_cache`].
pub const DEFAULT_ACCEL_CACHE: &str = "/run/crust-vmm";
/// Default [`VmConfig::kvm_probe_timeout`]: a KVM guest reaches its agent
/// in about a second; this is the most a half-working host pays per boot
/// of the host.
pub const DEFAULT_KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`VmConfig::kvm_boot_timeout`]: generous for a proven KVM.
pub const DEFAULT_KVM_BOOT_TIMEOUT: Duration = Duration::from_secs(20);
/// Default [`VmConfig::tcg_tb_mib`].
pub const DEFAULT_TCG_TB_MIB: u32 = 32;

/// qboot as packaged by Debian's qemu-system-data.
pub const QBOOT: &str = "/usr/share/qemu/qboot.rom";

impl VmConfig {
    /// A config with defaults: 256 MiB, 1 vCPU, Auto accel (verdicts in
    /// [`DEFAULT_ACCEL_CACHE`]), no disks, 8 hot-plug ports.
    pub fn new(
        name: impl Into<String>,
        kernel: impl Into<PathBuf>,
        initrd: impl Into<PathBuf>,
        run_dir: impl Into<PathBuf>,
    ) -> Self {
        VmConfig {
            name: name.into(),
            kernel: kernel.into(),
            initrd: initrd.into(),
            memory_mib: 256,
            max_memory_mib: 0,
            cpus: 1,
            max_cpus: 0,
            run_dir: run_dir.into(),
            accel: Accel::Auto,
            disks: Vec::new(),
            kernel_cmdline_extra: Vec::new(),
            shares: Vec::new(),
            nics: Vec::new(),
            virtiofsd_binary: PathBuf::from("virtiofsd"),
            hotplug_ports: 8,
            qemu_binary: PathBuf::from("qemu-system-x86_64"),
            firmware: None,
            die_with_parent: false,
            cgroups: Vec::new(),
            accel_cache: Some(PathBuf::from(DEFAULT_ACCEL_CACHE)),
            kvm_probe_timeout: DEFAULT_KVM_PROBE_TIMEOUT,
            kvm_boot_timeout: DEFAULT_KVM_BOOT_TIMEOUT,
            tcg_tb_mib: DEFAULT_TCG_TB_MIB,
        }
    }

    /// Checks everything that can be checked before starting QEMU.
    pub fn validate(&self) -> Result<(), VmError> {
        let bad = |m: String| Err(VmError::InvalidConfig(m));
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 64
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
        if !name_ok {
            return bad(format!(
                "name {:?}: use 1-64 characters [A-Za-z0-9._-]",
                self.name
            ));
        }
        for (what, p) in [("kernel", &self.kernel), ("initrd", &self.initrd)] {
            if !p.is_absolute() {
                return bad(format!("{what} {} is not an absolute path", p.display()));
            }
            if !p.is_file() {
                return bad(format!("{what} {} does not exist", p.display()));
            }
        }
        if let Some(fw) = &self.firmware
            && (!fw.is_absolute() || !fw.is_file())
        {
            return bad(format!(
                "firmware {} is not an existing absolute path",
                fw.display()
            ));
        }
        self.validate_run_dir()?;
        if !(16..=65536).contains(&self.memory_mib) {
            return bad(format!("memory_mib {} out of 16..=65536", self.memory_mib));
        }
        if self.max_memory_mib > 65536 {
            return bad(format!(
                "max_memory_mib {} above 65536",
                self.max_memory_mib
            ));
        }
        if !(1..=64).contains(&self.cpus) {
            return bad(format!("cpus {} out of 1..=64", self.cpus));
        }
        if self.max_cpus > 64 {
            return bad(format!("max_cpus {} above 64", self.max_cpus));
        }
        let ports = self.disks.len() as u32 + self.hotplug_ports;
        if ports > MAX_ROOT_PORTS {
            return bad(format!(
                "{} disks + {} hot-plug ports exceed the {MAX_ROOT_PORTS} root ports available",
                self.disks.len(),
                self.hotplug_ports
            ));
        }
        for a in &self.kernel_cmdline_extra {
            if a.is_empty() || a.contains(char::is_whitespace) {
                return bad(format!(
                    "kernel_cmdline_extra entry {a:?} must be one word without spaces"
                ));
            }
        }
        if self.shares.len() > MAX_SHARES {
            return bad(format!("at most {MAX_SHARES} shares"));
        }
        let mut tags = std::collections::HashSet::new();
        for sh in &self.shares {
            sh.validate()?;
            if !tags.insert(&sh.tag) {
                return bad(format!("share tag {:?} used twice", sh.tag));
            }
        }
        let mut ids = std::collections::HashSet::new();
        let mut serials = std::collections::HashSet::new();
        for d in &self.disks {
            d.validate()?;
            if !ids.insert(&d.id) {
                return bad(format!("disk id {:?} used twice", d.id));
            }
            if !serials.insert(&d.serial) {
                return bad(format!("disk serial {:?} used twice", d.serial));
            }
        }
        Ok(())
    }

    /// The run directory: absolute, short enough for its sockets' paths,
    /// UTF-8 without newlines.
    fn validate_run_dir(&self) -> Result<(), VmError> {
        let bad = |m: String| Err(VmError::InvalidConfig(m));
        if !self.run_dir.is_absolute() {
            return bad(format!(
                "run_dir {} is not absolute",
                self.run_dir.display()
            ));
        }
        // sun_path holds 107 bytes plus NUL.
        let longest = self.run_dir.join("agent.sock");
        if longest.as_os_str().len() > 107 {
            return bad(format!(
                "run_dir {} is too long for unix socket paths (max ~96 bytes)",
                self.run_dir.display()
            ));
        }
        if self
            .run_dir
            .to_str()
            .is_none_or(|s| s.contains(['\n', '\0']))
        {
            return bad("run_dir must be valid UTF-8 without newlines".into());
        }
        Ok(())
    }

    pub(crate) fn firmware_path(&self) -> Option<PathBuf> {
        self.firmware.clone().or_else(|| {
            let q = Path::new(QBOOT);
            q.is_file().then(|| q.to_path_buf())
        })
    }
}

/// DIMM slots for memory hot-add.
pub const MEMORY_SLOTS: u32 = 8;

impl VmConfig {
    /// Whether memory can be hot-added.
    pub fn memory_hotplug(&self) -> bool {
        self.max_memory_mib > self.memory_mib
    }

    /// Whether vCPUs can be hot-plugged.
    pub fn cpu_hotplug(&self) -> bool {
        self.max_cpus > self.cpus
    }
}

/// Shares per VM (each is a PCI device and a daemon).
pub const MAX_SHARES: usize = 4;

/// Root ports fit on pcie.0 next to the fixed devices.
pub const MAX_ROOT_PORTS: u32 = 24;

/// Id of the `i`-th hot-plug root port.
pub fn hotplug_port_id(i: u32) -> String {
    format!("crust-hp{i}")
}

/// Id of the root port holding boot disk number `i`.
pub fn boot_port_id(i: usize) -> String {
    format!("crust-boot{i}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(id: &str, serial: &str, path: &Path) -> DiskSpec {
        DiskSpec {
            id: id.into(),
            path: path.into(),
            serial: serial.into(),
            readonly: false,
        }
    }

    #[test]
    fn disk_validation() {
        let f = tempfile::NamedTempFile::new().unwrap();
        assert!(
            disk("d1", "crust-12345678901234", f.path())
                .validate()
                .is_ok()
        );
        for (id, serial) in [
            ("1d", "s"),
            ("d", "crust-123456789012345"),
            ("d", ""),
            ("d", "a b"),
            ("d", "a,b"),
            ("d.x", "s"),
            ("", "s"),
        ] {
            assert!(
                disk(id, serial, f.path()).validate().is_err(),
                "{id} {serial}"
            );
        }
        assert!(
            disk("d", "s", Path::new("relative/path"))
                .validate()
                .is_err()
        );
        assert!(
            disk("d", "s", Path::new("/nonexistent/x"))
                .validate()
                .is_err()
        );
        assert!(disk("d", "s", Path::new("/tmp")).validate().is_err());
    }

    #[test]
    fn qmp_args_shape() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut d = disk("vol1", "crust-vol1", f.path());
        d.readonly = true;
        let b = d.blockdev_add_args();
        assert_eq!(b["node-name"], "crust-node-vol1");
        assert_eq!(b["file"]["driver"], "file");
        assert_eq!(b["file"]["cache"]["direct"], true);
        assert_eq!(
            b["file"]["aio"],
            crust_qmp::BlockIo::host_best().aio.as_str()
        );
        assert_eq!(b["read-only"], true);
        let dev = d.device_add_args("crust-hp3");
        assert_eq!(dev["bus"], "crust-hp3");
        assert_eq!(dev["serial"], "crust-vol1");
        assert_eq!(dev["drive"], "crust-node-vol1");
        assert_eq!(dev["id"], "crust-disk-vol1");
    }

    #[test]
    fn config_validation() {
        let k = tempfile::NamedTempFile::new().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ok = VmConfig::new("vm-1", k.path(), k.path(), dir.path().join("run"));
        assert!(ok.validate().is_ok());
        let mut c = ok.clone();
        c.name = "bad name".into();
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.kernel = "vmlinuz".into();
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.run_dir = PathBuf::from("/").join("x".repeat(120));
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.hotplug_ports = 30;
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.kernel_cmdline_extra = vec!["a b".into()];
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.disks = vec![disk("a", "s1", k.path()), disk("b", "s1", k.path())];
        assert!(c.validate().unwrap_err().to_string().contains("twice"));
    }
}
