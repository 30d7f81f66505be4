//! "Nobody else has this device": the check every path that hands a
//! device to a guest goes through (crust_ops staging a hand-off record,
//! the runtime's `direct-volume add` and sandbox start), and the hold the
//! runtime keeps while a guest may use the device.
//!
//! A claim also refuses a device whose data another block device exposes
//! (the backing file attached twice, a loop stacked on it, a
//! device-mapper/md holder): see [`crate::alias`]. That scan costs a
//! listing of the loop devices and runs only when a claim is made.
//!
//! The success path is O(1): one `O_EXCL` open, which the kernel refuses
//! (`EBUSY`) while the device is mounted in any mount namespace, claimed
//! by device-mapper/md, a mounted partition's disk, or opened `O_EXCL` by
//! anyone, plus one read of the device's sysfs `holders/`. Only after a
//! refusal is `/proc` scanned (mount tables of every mount namespace,
//! open descriptors) to name the holder in the message.
//!
//! QEMU opens a guest's disk without `O_EXCL`; crust's runtime therefore
//! keeps an [`ExclusiveDevice`] for every device it hands to a guest, for
//! as long as the guest may use it. So "the exclusive open succeeds" is
//! positive proof that no crust sandbox, no mount and no exclusive holder
//! has the device, and host-side mkfs, fsck and mount (all exclusive) are
//! refused by the kernel while a guest has it.

use std::collections::BTreeSet;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rustix::fs::{FileType, Mode, OFlags};

use crate::alias::AliasError;
use crate::device::{self, DeviceError, OPENERS_SCAN_LIMIT, Opener};
use crate::sys;

/// Someone who holds a block device, as named after a refusal.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Holder {
    /// Mounted at `mount_point` in the mount namespace of `pid`.
    Mount { mount_point: PathBuf, pid: u32 },
    /// A kernel holder from sysfs `holders/` (e.g. `dm-0`, `md0`).
    Kernel(String),
    /// A process with the device open.
    Process(Opener),
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Mount { mount_point, pid } => write!(
                f,
                "mounted at {} (mount namespace of pid {pid})",
                mount_point.display()
            ),
            Holder::Kernel(name) => write!(f, "held by {name}"),
            Holder::Process(o) => write!(f, "open by {o}"),
        }
    }
}

/// Why a device cannot be handed over.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("device {} is in use ({}); refusing to {action}", device.display(), describe(holders))]
    InUse {
        device: PathBuf,
        /// Who holds it, as far as this process can see (may be empty:
        /// a holder in another PID namespace).
        holders: Vec<Holder>,
        action: &'static str,
    },
    /// Another block device exposes the same data (named), or that could
    /// not be ruled out.
    #[error(transparent)]
    Aliased(#[from] AliasError),
    #[error(transparent)]
    Device(#[from] DeviceError),
}

impl ClaimError {
    /// The device is in use by someone else, or its data reachable through
    /// another device: the caller's precondition does not hold (as opposed
    /// to a failure to check).
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            ClaimError::InUse { .. } | ClaimError::Aliased(AliasError::Found { .. })
        )
    }
}

fn describe(holders: &[Holder]) -> String {
    if holders.is_empty() {
        return "held exclusively by something this process cannot see".into();
    }
    holders
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// How long a busy device is asked again before it is refused: a process
/// setting up a mount namespace of its own (virtiofsd's sandbox, a
/// container's init) holds a copy of every mount of the node for a
/// moment, which keeps a just-unmounted filesystem alive. A real holder
/// is still refused, this much later.
const TRANSIENT_HOLD: std::time::Duration = std::time::Duration::from_millis(500);
const TRANSIENT_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// What [`claim_exclusive`] callers refuse to do while a device is held.
pub const HAND_TO_GUEST: &str = "hand it to a guest";

/// An `O_EXCL` descriptor on a block device: while it is open, nobody can
/// mount, format, check or exclusively open the device. For a regular
/// file (a VM image under a configured file-device root) it is a plain
/// descriptor: files have no exclusive open.
///
/// The device's own page cache is flushed ([`flush_device_cache`]) when
/// the hold is taken and when it drops: a guest's QEMU may write the
/// device's backing store around it (a loop device's file), and no host
/// use between holds may read what the cache kept from before.
///
/// [`flush_device_cache`]: crate::device::flush_device_cache
#[derive(Debug)]
pub struct ExclusiveDevice {
    fd: OwnedFd,
    path: PathBuf,
    block: bool,
    /// The flush when the hold was taken worked (false without
    /// `CAP_SYS_ADMIN`).
    flushable: bool,
}

impl ExclusiveDevice {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The hold on a regular file its caller opened and checked itself
    /// (a file device: QEMU gets a copy of the same descriptor, so the
    /// path is never looked up again).
    pub fn regular_file(fd: OwnedFd, path: PathBuf) -> ExclusiveDevice {
        ExclusiveDevice {
            fd,
            path,
            block: false,
            flushable: true,
        }
    }

    /// Whether this process can flush the device's page cache: the flush
    /// when the hold was taken worked (always, for a regular file).
    pub fn cache_flushable(&self) -> bool {
        self.flushable
    }

    /// [`flush_device_cache`](crate::device::flush_device_cache) through
    /// the hold (nothing for a regular file). `Ok(false)`: the kernel
    /// refused (no `CAP_SYS_ADMIN`), the cache may be stale.
    fn flush_cache(&self) -> Result<bool, DeviceError> {
        if !self.block {
            return Ok(true);
        }
        let flushed = device::flush_device_cache(self.fd.as_fd(), &self.path)?;
        if !flushed {
            tracing::debug!(device = %self.path.display(),
                "BLKFLSBUF refused (no CAP_SYS_ADMIN): its page cache kept");
        }
        Ok(flushed)
    }
}

impl Drop for ExclusiveDevice {
    fn drop(&mut self) {
        if let Err(e) = self.flush_cache() {
            tracing::warn!(device = %self.path.display(), %e,
                "flushing its page cache as the hold drops");
        }
    }
}

impl AsFd for ExclusiveDevice {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Opens `path` exclusively (read-only or read-write) after checking that
/// nobody else holds it and that no other block device exposes its data;
/// see the module doc. `action` completes the refusal's message
/// ("refusing to {action}").
pub fn claim_exclusive(
    path: &Path,
    writable: bool,
    action: &'static str,
) -> Result<ExclusiveDevice, ClaimError> {
    let dev = hold(path, writable, action)?;
    // After the hold: no new mount of this device can start meanwhile.
    crate::alias::ensure_no_aliases(path, action)?;
    Ok(dev)
}

/// A device held together with the aliases its claimant accepted
/// ([`claim_exclusive_keeping`]), each held too.
pub struct HeldWithAliases {
    pub device: ExclusiveDevice,
    /// The accepted aliases' holds (their kernel names in the same order
    /// as [`HeldWithAliases::names`]).
    pub aliases: Vec<ExclusiveDevice>,
    pub names: Vec<String>,
}

/// [`claim_exclusive`], except that the aliases `keep` accepts (a loop the
/// node's own tooling stacks on the device, such as kubelet's
/// keep-busy loop of a block volume) do not refuse it: each is held
/// exclusively as well, so the host can neither mount nor open the data
/// through it while the device is held. Any other alias refuses.
pub fn claim_exclusive_keeping(
    path: &Path,
    writable: bool,
    action: &'static str,
    keep: &mut dyn FnMut(&crate::alias::Alias) -> bool,
) -> Result<HeldWithAliases, ClaimError> {
    let device = hold(path, writable, action)?;
    let kept = crate::alias::ensure_no_aliases_but(path, action, keep)?;
    let mut aliases = Vec::new();
    let mut names = Vec::new();
    for a in kept {
        aliases.push(hold(&Path::new("/dev").join(&a.name), writable, action)?);
        names.push(a.name);
    }
    Ok(HeldWithAliases {
        device,
        aliases,
        names,
    })
}

/// The `O_EXCL` open and sysfs holder check of [`claim_exclusive`],
/// without the alias scan.
fn hold(path: &Path, writable: bool, action: &'static str) -> Result<ExclusiveDevice, ClaimError> {
    let access = if writable {
        OFlags::RDWR
    } else {
        OFlags::RDONLY
    };
    let st = rustix::fs::stat(path).map_err(|e| DeviceError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::BlockDevice => {}
        FileType::RegularFile => {
            let fd =
                rustix::fs::open(path, access | OFlags::CLOEXEC, Mode::empty()).map_err(|e| {
                    DeviceError::Io {
                        path: path.to_path_buf(),
                        source: e.into(),
                    }
                })?;
            return Ok(ExclusiveDevice::regular_file(fd, path.to_path_buf()));
        }
        _ => return Err(DeviceError::NotBlockDevice(path.to_path_buf()).into()),
    }
    let (major, minor) = (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev));
    let in_use = || ClaimError::InUse {
        device: path.to_path_buf(),
        holders: name_holders(major, minor),
        action,
    };
    let until = Instant::now() + TRANSIENT_HOLD;
    let fd = loop {
        match device::open_block(path, access | OFlags::EXCL) {
            Ok(fd) => break fd,
            Err(DeviceError::Io { source, .. })
                if sys::errno(&source) == Some(rustix::io::Errno::BUSY) =>
            {
                if Instant::now() >= until {
                    return Err(in_use());
                }
                std::thread::sleep(TRANSIENT_POLL);
            }
            Err(e) => return Err(e.into()),
        }
    };
    if !sysfs_holders(major, minor).is_empty() {
        return Err(in_use());
    }
    let mut dev = ExclusiveDevice {
        fd,
        path: path.to_path_buf(),
        block: true,
        flushable: false,
    };
    // Nothing the cache kept from before this hold is read as current.
    dev.flushable = dev.flush_cache()?;
    Ok(dev)
}

/// [`claim_exclusive`] and let go at once: a check that nobody holds the
/// device now and no other device exposes its data.
pub fn ensure_device_free(path: &Path, action: &'static str) -> Result<(), ClaimError> {
    claim_exclusive(path, false, action).map(drop)
}

/// Proof that a guest (or a mount) let go of the device: nobody holds
/// it now. Unlike [`ensure_device_free`] it does not look for aliases: a
/// foreign loop on the same file says nothing about whether a guest still
/// has the device, and must not keep a claim from being released.
pub fn ensure_released(path: &Path, action: &'static str) -> Result<(), ClaimError> {
    hold(path, false, action).map(drop)
}

/// Names in `/sys/dev/block/M:m/holders/` (stacked kernel devices).
fn sysfs_holders(major: u32, minor: u32) -> Vec<String> {
    std::fs::read_dir(format!("/sys/dev/block/{major}:{minor}/holders"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Everyone this process can see holding `major:minor`: mounts in every
/// mount namespace, kernel holders, processes with it open. Bounded by
/// [`OPENERS_SCAN_LIMIT`]; only called after a refusal.
pub fn name_holders(major: u32, minor: u32) -> Vec<Holder> {
    let deadline = Instant::now() + OPENERS_SCAN_LIMIT;
    let mut out: BTreeSet<Holder> = BTreeSet::new();
    for m in mounts_everywhere(major, minor, deadline) {
        out.insert(m);
    }
    for k in sysfs_holders(major, minor) {
        out.insert(Holder::Kernel(k));
    }
    if let Ok(openers) = device::openers_of(major, minor, deadline) {
        for o in openers {
            out.insert(Holder::Process(o));
        }
    }
    out.into_iter().collect()
}

/// Where `major:minor` is mounted, in every mount namespace this process
/// can see (`(mount point, a pid of that namespace)`), bounded by
/// [`OPENERS_SCAN_LIMIT`]. For a caller that must know that a device is
/// mounted only where it put it before taking it away (a handover).
pub fn mounts_everywhere_of(major: u32, minor: u32) -> Vec<(PathBuf, u32)> {
    let deadline = Instant::now() + OPENERS_SCAN_LIMIT;
    mounts_everywhere(major, minor, deadline)
        .into_iter()
        .filter_map(|h| match h {
            Holder::Mount { mount_point, pid } => Some((mount_point, pid)),
            _ => None,
        })
        .collect()
}

/// Mounts of `major:minor` in every mount namespace: one
/// `/proc/PID/mountinfo` per namespace (namespaces are told apart by the
/// inode of `/proc/PID/ns/mnt`).
fn mounts_everywhere(major: u32, minor: u32, deadline: Instant) -> Vec<Holder> {
    let mut seen_ns = BTreeSet::new();
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for ent in rd.flatten() {
        if Instant::now() > deadline {
            break;
        }
        let Some(pid) = ent.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(ns) = rustix::fs::stat(format!("/proc/{pid}/ns/mnt").as_str()) else {
            continue;
        };
        if !seen_ns.insert((ns.st_dev, ns.st_ino)) {
            continue;
        }
        let Ok(text) = std::fs::read(format!("/proc/{pid}/mountinfo")) else {
            continue;
        };
        let Ok(entries) = crate::mount::parse_mountinfo(&text) else {
            continue;
        };
        out.extend(
            entries
                .into_iter()
                .filter(|m| (m.major, m.minor) == (major, minor))
                .map(|m| Holder::Mount {
                    mount_point: m.mount_point,
                    pid,
                }),
        );
    }
    out
}
