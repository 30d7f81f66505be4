//! Creating and growing filesystems. These exec the filesystem tools
//! through [`crate::tool`], the crate's one runner of programs.

use std::path::{Path, PathBuf};

use crate::device::{self, DeviceError};
use crate::probe::{Probe, ProbeError};
use crate::tool::{self, ToolError};
use crate::usage::{UsageError, usage};

pub use crate::probe::{Signature, known_signatures, parse_wipefs_json};
pub use crust_fs::FsType;
use crust_fs::{GrowTarget, Tool};

/// Errors from formatting or growing a filesystem.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("unsupported filesystem type {0:?} (supported: {list})", list = FsType::supported_list())]
    UnsupportedFsType(String),
    #[error("refusing to format {device}: it is not blank, it holds {found}")]
    NotBlank { device: PathBuf, found: Probe },
    /// A full read found a non-zero byte on a device without a signature.
    #[error(
        "refusing to format {}: it holds data (a non-zero byte at offset {offset}, found by reading the whole device)",
        device.display()
    )]
    HoldsData { device: PathBuf, offset: u64 },
    /// A tool was missing, could not start, or failed; the messages are
    /// the runner's own.
    #[error(transparent)]
    Tool(#[from] ToolError),
    #[error(
        "{what} needs the {capability} capability, which this process does not have (unmount and use grow_fs_offline, or grant the capability)"
    )]
    MissingCapability {
        capability: &'static str,
        what: &'static str,
    },
    #[error("{device} is in use (mounted or held); {what} needs it unmounted")]
    InUse { device: PathBuf, what: &'static str },
    #[error("device {} is open by {opener}{}; refusing to {action}", device.display(), more_openers(*others))]
    OpenElsewhere {
        device: PathBuf,
        opener: crate::device::Opener,
        /// How many other processes have it open too.
        others: usize,
        action: &'static str,
    },
    /// The userspace check of [`check_unmounted`] found problems (or a
    /// dirty xfs log it cannot replay): the host must not mount it.
    #[error("{tool} found problems in the {fstype} filesystem on {} ({status}); the host will not mount it: {output}", device.display())]
    CheckFailed {
        tool: &'static str,
        fstype: FsType,
        device: PathBuf,
        status: String,
        output: String,
    },
    #[error("{0} cannot be grown offline ({tool} needs a mounted filesystem)", tool = .0.spec().grow.program)]
    OfflineGrowUnsupported(FsType),
    #[error("{device} is not the filesystem mounted at {mountpoint}")]
    NotMounted {
        device: PathBuf,
        mountpoint: PathBuf,
    },
    /// Another device exposes the data of the device to be formatted.
    #[error(transparent)]
    Aliased(#[from] crate::alias::AliasError),
    #[error(transparent)]
    Probe(#[from] ProbeError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Usage(#[from] UsageError),
    #[error(transparent)]
    Mount(#[from] crate::mount::MountError),
}

impl FsError {
    /// Whether the failing step ran a filesystem tool (which may have
    /// written to the device), rather than refusing before it.
    pub fn tool_ran(&self) -> bool {
        matches!(
            self,
            FsError::Tool(ToolError::Failed { .. }) | FsError::CheckFailed { .. }
        )
    }
}

fn more_openers(n: usize) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" and {n} other process(es)")
    }
}

/// What [`grow_fs_offline`] refuses to do while another process (a guest's
/// QEMU) has the device open.
pub const CHECK_OR_GROW: &str = "check or grow a filesystem another kernel may have mounted";
/// What [`mkfs`] refuses to do while another process has the device open.
pub const FORMAT: &str = "format a device another process or kernel may be using";
/// For callers about to mount a device on the host (see
/// [`ensure_no_other_openers`]).
pub const MOUNT: &str = "mount a filesystem another kernel may have mounted";

/// How often, and how far apart, an opener is looked for again before a
/// refusal: a prober such as udev's blkid opens a new device briefly.
const OPENER_CHECKS: usize = 4;
const OPENER_RECHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// Refuses with [`FsError::InUse`] if the device is held exclusively
/// (mounted), then as [`ensure_no_other_openers`].
fn require_unused(dev: &Path, what: &'static str, action: &'static str) -> Result<(), FsError> {
    if device::is_device_held_exclusively(dev)? {
        return Err(FsError::InUse {
            device: dev.to_path_buf(),
            what,
        });
    }
    ensure_no_other_openers(dev, action)
}

/// Refuses with [`FsError::OpenElsewhere`] (saying it refuses to
/// `action`, e.g. [`MOUNT`]) when another process keeps `dev` open across
/// a few re-checks about 100 ms apart (a prober such as udev's blkid holds
/// a device only briefly; a guest's QEMU for as long as the guest runs).
/// See [`crate::device_openers`].
pub fn ensure_no_other_openers(dev: &Path, action: &'static str) -> Result<(), FsError> {
    let mut openers = device::device_openers(dev)?;
    for _ in 1..OPENER_CHECKS {
        if openers.is_empty() {
            return Ok(());
        }
        std::thread::sleep(OPENER_RECHECK);
        openers = device::device_openers(dev)?;
    }
    match openers.first() {
        None => Ok(()),
        Some(o) => Err(FsError::OpenElsewhere {
            device: dev.to_path_buf(),
            opener: o.clone(),
            others: openers.len() - 1,
            action,
        }),
    }
}

/// Every filesystem tool this module runs: each [`FsType`]'s
/// [`crust_fs::FsSpec::host_tools`], then `wipefs` (signatures before a
/// format). A host or container image without one of them cannot serve
/// every volume.
pub fn fs_tools() -> Vec<&'static str> {
    let mut tools: Vec<&'static str> = Vec::new();
    for t in FsType::ALL
        .into_iter()
        .flat_map(|f| f.spec().host_tools())
        .chain(["wipefs"])
    {
        if !tools.contains(&t) {
            tools.push(t);
        }
    }
    tools
}

/// The tools of [`fs_tools`] that cannot be found (readiness checks).
pub fn missing_fs_tools() -> Vec<&'static str> {
    fs_tools()
        .into_iter()
        .filter(|t| tool::find_tool(t).is_err())
        .collect()
}

/// Runs a filesystem's `tool` as its [`Tool`] says: its arguments, then
/// `target` (a device or a mount point); its `ok` exit codes succeed.
fn run_tool(tool: &Tool, target: &Path) -> Result<String, FsError> {
    let mut args: Vec<&std::ffi::OsStr> = tool.args.iter().map(|a| a.as_ref()).collect();
    args.push(target.as_os_str());
    Ok(tool::run_accepting(tool.program, &args, target, tool.ok)?)
}

/// Runs `fstype`'s mkfs on `dev` after `check` passed (the tools run with
/// `-f`/`-F`: the gate's check is what keeps data safe). A device that is
/// mounted ([`FsError::InUse`]) or open in another process
/// ([`FsError::OpenElsewhere`]) is refused before anything is read. Only
/// [`crate::gate`] calls this.
pub(crate) fn make_fs(
    dev: &Path,
    fstype: FsType,
    check: impl FnOnce(&Path) -> Result<(), FsError>,
) -> Result<(), FsError> {
    if !device::is_block_device(dev) {
        return Err(DeviceError::NotBlockDevice(dev.to_path_buf()).into());
    }
    require_unused(dev, "formatting", FORMAT)?;
    check(dev)?;
    run_tool(&fstype.spec().mkfs, dev).map(drop)
}

const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this process has capability `bit` in its effective set.
fn has_capability(bit: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << bit) != 0)
}

/// Whether [`grow_fs`] can grow a mounted ext4 here: the kernel's online
/// resize ioctl needs `CAP_SYS_RESOURCE`, which some sandboxes drop even
/// for root. XFS only needs `CAP_SYS_ADMIN`.
pub fn can_grow_ext4_online() -> bool {
    has_capability(CAP_SYS_RESOURCE)
}

/// Grows the filesystem of `dev`, mounted at `mountpoint`, online to fill
/// the device, and returns the filesystem's new total size in bytes
/// (`statvfs` `f_blocks * f_frsize`, i.e. [`crate::Usage::bytes_total`]).
///
/// Checks that `mountpoint` really is a mount of `dev` first, then runs
/// the filesystem's [`crust_fs::FsSpec::grow`] on the device or the mount
/// point: ext4 runs `resize2fs <dev>`, xfs runs
/// `xfs_growfs -d <mountpoint>`. Growing to the
/// current size is a no-op, so this is idempotent. Online ext4 growth
/// needs `CAP_SYS_RESOURCE` ([`FsError::MissingCapability`] without it,
/// see [`can_grow_ext4_online`]).
pub fn grow_fs(dev: &Path, mountpoint: &Path, fstype: FsType) -> Result<u64, FsError> {
    let (major, minor) = device::device_major_minor(dev)?;
    match crate::mount::find_mount(mountpoint)? {
        Some(m) if m.major == major && m.minor == minor => {}
        _ => {
            return Err(FsError::NotMounted {
                device: dev.to_path_buf(),
                mountpoint: mountpoint.to_path_buf(),
            });
        }
    }
    if fstype == FsType::Ext4 && !can_grow_ext4_online() {
        return Err(FsError::MissingCapability {
            capability: "CAP_SYS_RESOURCE",
            what: "growing a mounted ext4 filesystem",
        });
    }
    let spec = fstype.spec();
    let target = match spec.grow_target {
        GrowTarget::Device => dev,
        GrowTarget::MountPoint => mountpoint,
    };
    run_tool(&spec.grow, target)?;
    let total = usage(mountpoint)?.bytes_total;
    tracing::info!(device = %dev.display(), %fstype, total, "filesystem grown");
    Ok(total)
}

/// Grows an unmounted filesystem to fill its device, where its
/// [`crust_fs::FsSpec::grows_offline`]: its `fsck` then its `grow` on the
/// device. ext4: `e2fsck -f -p` (resize2fs insists on a freshly checked
/// filesystem; exit codes 0 and 1, "no errors" and "errors fixed", are
/// accepted) then `resize2fs`. The
/// device must not be in use: not mounted ([`FsError::InUse`]) and not
/// open in any other process ([`FsError::OpenElsewhere`]): QEMU opens a
/// guest's disk without `O_EXCL`, and checking a filesystem a guest kernel
/// has mounted corrupts it. XFS can only grow mounted
/// ([`FsError::OfflineGrowUnsupported`]). Idempotent.
pub fn grow_fs_offline(dev: &Path, fstype: FsType) -> Result<(), FsError> {
    let spec = fstype.spec();
    if !spec.grows_offline {
        return Err(FsError::OfflineGrowUnsupported(fstype));
    }
    require_unused(dev, "offline resize", CHECK_OR_GROW)?;
    if let Some(fsck) = &spec.fsck {
        run_tool(fsck, dev)?;
    }
    run_tool(&spec.grow, dev)?;
    tracing::info!(device = %dev.display(), %fstype, "filesystem grown offline");
    Ok(())
}

/// What [`check_unmounted`] refuses to do while the device is in use.
pub const CHECK: &str = "check a filesystem another kernel may have mounted";

/// Checks an unmounted filesystem in userspace before the host kernel
/// mounts it, for a volume whose filesystem a guest had raw access to (the
/// host kernel must not parse what a workload may have crafted), by the
/// steps of its [`crust_fs::FsSpec::check`]:
///
/// * ext4: a journal left by a guest that did not unmount is replayed by
///   `e2fsck -E journal_only -p` (userspace), then `e2fsck -f -n` must
///   exit 0;
/// * xfs: `xfs_repair -n` must exit 0. A dirty log cannot be replayed in
///   userspace (only a mount does that, and `xfs_repair -L` discards it),
///   so it fails the check: mount the volume in a guest again, or decide
///   by hand.
///
/// The device must not be mounted or open elsewhere ([`FsError::InUse`],
/// [`FsError::OpenElsewhere`]). A failed check is [`FsError::CheckFailed`]
/// with the tool's output.
pub fn check_unmounted(dev: &Path, fstype: FsType) -> Result<(), FsError> {
    require_unused(dev, "a filesystem check", CHECK)?;
    let failed = |tool, e: FsError| match e {
        FsError::Tool(ToolError::Failed { status, stderr, .. }) => FsError::CheckFailed {
            tool,
            fstype,
            device: dev.to_path_buf(),
            status,
            output: tail(&stderr, 600),
        },
        e => e,
    };
    for step in fstype.spec().check {
        run_tool(step, dev).map_err(|e| failed(step.program, e))?;
    }
    tracing::info!(device = %dev.display(), %fstype, "userspace filesystem check passed");
    Ok(())
}

/// The last `max` bytes of `s` (on a character boundary).
fn tail(s: &str, max: usize) -> String {
    let mut cut = s.len().saturating_sub(max);
    while !s.is_char_boundary(cut) {
        cut += 1;
    }
    s[cut..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_tools_are_the_specs_tools() {
        let mut tools = fs_tools();
        tools.sort_unstable();
        assert_eq!(
            tools,
            [
                "e2fsck",
                "mkfs.ext4",
                "mkfs.xfs",
                "resize2fs",
                "wipefs",
                "xfs_growfs",
                "xfs_repair"
            ]
        );
        assert_eq!(
            FsError::UnsupportedFsType("btrfs".into()).to_string(),
            "unsupported filesystem type \"btrfs\" (supported: ext4, xfs)"
        );
        assert_eq!(
            FsError::OfflineGrowUnsupported(FsType::Xfs).to_string(),
            "xfs cannot be grown offline (xfs_growfs needs a mounted filesystem)"
        );
    }

    /// The runner's errors read the same inside an [`FsError`] (callers
    /// log and return these texts), and only a tool that ran counts as
    /// having touched the device.
    #[test]
    fn tool_errors_keep_their_messages() {
        let cases = [
            (
                ToolError::NotFound("mkfs.xfs"),
                "mkfs.xfs not found in PATH, /usr/sbin or /sbin",
                false,
            ),
            (
                ToolError::Spawn {
                    tool: "resize2fs",
                    source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
                },
                "running resize2fs: permission denied",
                false,
            ),
            (
                ToolError::Failed {
                    tool: "mkfs.ext4",
                    target: PathBuf::from("/dev/loop9"),
                    status: "exit status: 1".into(),
                    stderr: "bad".into(),
                },
                "mkfs.ext4 on /dev/loop9 failed (exit status: 1): bad",
                true,
            ),
        ];
        for (tool_error, text, ran) in cases {
            assert_eq!(tool_error.to_string(), text);
            let e = FsError::from(tool_error);
            assert_eq!(e.to_string(), text);
            assert_eq!(e.tool_ran(), ran, "{e}");
        }
    }
}
