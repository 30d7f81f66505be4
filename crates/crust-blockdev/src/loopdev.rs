//! Loop devices through the kernel interface (`/dev/loop-control`,
//! `LOOP_CONFIGURE`, `LOOP_CLR_FD`, `LOOP_SET_CAPACITY`), never `losetup`.
//!
//! Devices are attached without `LO_FLAGS_AUTOCLEAR`, so they outlive the
//! process that attached them: after a plugin restart
//! [`find_by_backing`] finds them again through sysfs.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use linux_raw_sys::loop_device as ld;
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

use crate::device::{self, DeviceError};
use crate::sys;

const LOOP_CONTROL: &str = "/dev/loop-control";
/// How often attach retries when another process grabs the free device
/// between `LOOP_CTL_GET_FREE` and `LOOP_CONFIGURE`.
const ATTACH_ATTEMPTS: usize = 64;
/// How long detach waits for the kernel to finish tearing a device down.
const DETACH_WAIT: Duration = Duration::from_secs(2);
const DELETED_SUFFIX: &str = " (deleted)";

/// Errors from loop device operations.
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("backing file {0} is not a regular file")]
    NotRegularFile(PathBuf),
    #[error("no free loop device (LOOP_CTL_GET_FREE): {0}")]
    NoFreeDevice(#[source] io::Error),
    #[error("attaching {backing} to {device} failed: {source}")]
    Attach {
        backing: PathBuf,
        device: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "gave up attaching {0}: free loop devices kept being taken by other processes ({ATTACH_ATTEMPTS} attempts)"
    )]
    Contention(PathBuf),
    #[error("{device} is busy ({reason}); not detached")]
    Busy { device: PathBuf, reason: String },
    #[error("{0} is not a loop device")]
    NotLoop(PathBuf),
    #[error("{op} on {device} failed: {source}")]
    Ioctl {
        op: &'static str,
        device: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reading {path}: {source}")]
    Sysfs {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// How to attach a backing file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttachOptions {
    /// Attach read-only (the backing file is opened `O_RDONLY` too).
    pub read_only: bool,
    /// Ask the kernel for direct I/O to the backing file (no double
    /// caching). The kernel may silently fall back to buffered I/O when the
    /// backing filesystem cannot do it; [`LoopStatus::direct_io`] tells.
    pub direct_io: bool,
    /// Logical block size of the device (512..=4096, a power of two);
    /// 0 lets the kernel choose, which with direct I/O is the backing
    /// file's DIO alignment on newer kernels. A filesystem only mounts on
    /// the sector size it was made for: callers that re-attach a file
    /// must pass the size it was first attached with.
    pub block_size: u32,
}

/// A freshly attached loop device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopInfo {
    /// Device node, `/dev/loopN`.
    pub path: PathBuf,
    /// `N`.
    pub number: u32,
}

/// State of a bound loop device as sysfs reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopStatus {
    /// Device node, `/dev/loopN`.
    pub path: PathBuf,
    /// `N`.
    pub number: u32,
    /// Backing file path as the kernel resolved it at attach time, with the
    /// `" (deleted)"` suffix removed.
    pub backing_file: PathBuf,
    /// The backing file was unlinked (or replaced by a new file at the same
    /// path) after attaching: the device still reads the old inode.
    pub backing_deleted: bool,
    pub read_only: bool,
    pub autoclear: bool,
    pub direct_io: bool,
    /// Logical block size (`queue/logical_block_size`).
    pub block_size: u32,
    /// Current device size in bytes.
    pub size_bytes: u64,
    /// The kernel's disk sequence number (`/sys/block/loopN/diskseq`,
    /// Linux 5.15+): new with every attach, so a device number reused by
    /// another tool's attach is told apart from the one a caller made.
    pub diskseq: Option<u64>,
}

/// Namespace for attaching loop devices.
pub struct LoopDevice;

impl LoopDevice {
    /// Attaches `backing` (a regular file) to a free loop device.
    ///
    /// Uses `LOOP_CTL_GET_FREE` + `LOOP_CONFIGURE` (one atomic ioctl), and
    /// falls back to `LOOP_SET_FD` + `LOOP_SET_STATUS64` on kernels without
    /// `LOOP_CONFIGURE`. Another process may take the free device between
    /// the two calls; the kernel answers `EBUSY` and we ask for another
    /// one. Autoclear is off: the device stays attached after this process
    /// exits, until [`detach`]. Does not check whether `backing` is already
    /// attached somewhere (use [`find_by_backing`] first).
    pub fn attach(backing: &Path, opts: AttachOptions) -> Result<LoopInfo, LoopError> {
        let open_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source: io::Error| LoopError::Open { path, source }
        };
        let backing = std::fs::canonicalize(backing).map_err(open_err(backing))?;
        let meta = std::fs::metadata(&backing).map_err(open_err(&backing))?;
        if !meta.is_file() {
            return Err(LoopError::NotRegularFile(backing));
        }
        let mode = if opts.read_only {
            OFlags::RDONLY
        } else {
            OFlags::RDWR
        };
        let file = rustix::fs::open(&backing, mode | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| open_err(&backing)(e.into()))?;
        let control = rustix::fs::open(LOOP_CONTROL, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| open_err(Path::new(LOOP_CONTROL))(e.into()))?;

        for _ in 0..ATTACH_ATTEMPTS {
            let number =
                crust_sys::loopdev::ctl_get_free(&control).map_err(LoopError::NoFreeDevice)?;
            let device = PathBuf::from(format!("/dev/loop{number}"));
            let dev = match rustix::fs::open(&device, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
            {
                Ok(fd) => fd,
                // devtmpfs creates the node with the device; a short wait
                // covers setups where that lags.
                Err(Errno::NOENT) => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                Err(e) => return Err(open_err(&device)(e.into())),
            };
            match configure(&dev, &file, &backing, opts) {
                Ok(()) => {
                    tracing::debug!(device = %device.display(), backing = %backing.display(), "loop attached");
                    return Ok(LoopInfo {
                        path: device,
                        number: number as u32,
                    });
                }
                Err(e) if sys::errno(&e) == Some(Errno::BUSY) => continue,
                Err(source) => {
                    return Err(LoopError::Attach {
                        backing,
                        device,
                        source,
                    });
                }
            }
        }
        Err(LoopError::Contention(backing))
    }
}

/// The logical block size a loop device over `backing` needs for direct
/// I/O: the file's DIO offset alignment (`statx` `STATX_DIOALIGN`, Linux
/// 6.1+), at least 512 and at most 4096; 512 when the filesystem reports
/// none (then it cannot do direct I/O at all and the size does not matter).
pub fn dio_block_size(backing: &Path) -> io::Result<u32> {
    let st = rustix::fs::statx(
        rustix::fs::CWD,
        backing,
        rustix::fs::AtFlags::empty(),
        rustix::fs::StatxFlags::DIOALIGN,
    )?;
    let align = if st.stx_mask & rustix::fs::StatxFlags::DIOALIGN.bits() != 0 {
        st.stx_dio_offset_align
    } else {
        0
    };
    Ok(align.clamp(512, 4096).next_power_of_two())
}

fn configure(dev: &OwnedFd, file: &OwnedFd, name: &Path, opts: AttachOptions) -> io::Result<()> {
    let mut info = crust_sys::loopdev::zeroed_info();
    let mut flags = 0u32;
    if opts.read_only {
        flags |= ld::LO_FLAGS_READ_ONLY as u32;
    }
    if opts.direct_io {
        flags |= ld::LO_FLAGS_DIRECT_IO as u32;
    }
    info.lo_flags = flags;
    // Informational only (sysfs has the full path); keep it NUL-terminated.
    let bytes = name.as_os_str().as_encoded_bytes();
    let n = bytes.len().min(info.lo_file_name.len() - 1);
    info.lo_file_name[..n].copy_from_slice(&bytes[..n]);

    let mut cfg = crust_sys::loopdev::zeroed_config();
    cfg.block_size = opts.block_size;
    cfg.info = info;
    match crust_sys::loopdev::configure(dev, rustix::fd::AsFd::as_fd(file), &cfg) {
        Ok(_) => Ok(()),
        Err(e) if matches!(sys::errno(&e), Some(Errno::INVAL) | Some(Errno::NOTTY)) => {
            configure_legacy(dev, file, info, opts).map_err(|legacy| {
                tracing::debug!(%legacy, "legacy loop setup failed too");
                e
            })
        }
        Err(e) => Err(e),
    }
}

/// Pre-5.8 kernels: bind, then set the status; unbind again on failure.
fn configure_legacy(
    dev: &OwnedFd,
    file: &OwnedFd,
    mut info: ld::loop_info64,
    opts: AttachOptions,
) -> io::Result<()> {
    crust_sys::loopdev::set_fd(dev, rustix::fd::AsFd::as_fd(file))?;
    // READ_ONLY follows from the open mode; DIRECT_IO has its own ioctl.
    info.lo_flags = 0;
    if let Err(e) = crust_sys::loopdev::set_status(dev, &info) {
        let _ = crust_sys::loopdev::clr_fd(dev);
        return Err(e);
    }
    if opts.block_size != 0
        && let Err(e) = crust_sys::loopdev::set_block_size(dev, opts.block_size)
    {
        let _ = crust_sys::loopdev::clr_fd(dev);
        return Err(e);
    }
    if opts.direct_io {
        // Best effort, as with LOOP_CONFIGURE.
        let _ = crust_sys::loopdev::set_direct_io(dev, true);
    }
    Ok(())
}

fn sysfs_read(path: &Path) -> io::Result<String> {
    std::fs::read_to_string(path).map(|s| s.trim_end_matches('\n').to_owned())
}

fn sysfs_flag(path: &Path) -> bool {
    sysfs_read(path).map(|s| s.trim() == "1").unwrap_or(false)
}

/// Status of the loop device with kernel name `name` ("loop3"), or `None`
/// when it exists but is not bound to a file.
fn status_by_name(name: &str) -> Result<Option<LoopStatus>, LoopError> {
    let Some(number) = name
        .strip_prefix("loop")
        .and_then(|n| n.parse::<u32>().ok())
    else {
        return Ok(None);
    };
    let base = Path::new("/sys/block").join(name);
    let backing_path = base.join("loop/backing_file");
    let raw = match sysfs_read(&backing_path) {
        Ok(s) => s,
        // No "loop" dir (unbound) or the device vanished meanwhile.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        // Reading backing_file of a device being unbound concurrently gives
        // ENXIO or ENODEV depending on how far the detach has got.
        Err(e) if matches!(sys::errno(&e), Some(Errno::NXIO) | Some(Errno::NODEV)) => {
            return Ok(None);
        }
        Err(source) => {
            return Err(LoopError::Sysfs {
                path: backing_path,
                source,
            });
        }
    };
    let (backing, deleted) = match raw.strip_suffix(DELETED_SUFFIX) {
        Some(stripped) => (stripped.to_owned(), true),
        None => (raw, false),
    };
    let sectors: u64 = sysfs_read(&base.join("size"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    Ok(Some(LoopStatus {
        path: PathBuf::from(format!("/dev/{name}")),
        number,
        backing_file: PathBuf::from(backing),
        backing_deleted: deleted,
        read_only: sysfs_flag(&base.join("ro")),
        autoclear: sysfs_flag(&base.join("loop/autoclear")),
        direct_io: sysfs_flag(&base.join("loop/dio")),
        block_size: sysfs_read(&base.join("queue/logical_block_size"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(512),
        size_bytes: sectors * 512,
        diskseq: sysfs_read(&base.join("diskseq"))
            .ok()
            .and_then(|s| s.trim().parse().ok()),
    }))
}

/// Kernel name of a loop device node, or `NotLoop`.
fn loop_name(dev: &Path) -> Result<String, LoopError> {
    let name = device::sysfs_name(dev)?;
    if !name.starts_with("loop") || name == "loop-control" {
        return Err(LoopError::NotLoop(dev.to_path_buf()));
    }
    Ok(name)
}

/// Status of the loop device with kernel name `name` (`loop3`); `Ok(None)`
/// when it is not bound to a file or `name` is no loop device.
pub(crate) fn status_of(name: &str) -> Result<Option<LoopStatus>, LoopError> {
    status_by_name(name)
}

/// Status of one loop device; `Ok(None)` when it is not bound to a file.
/// `Err(NotLoop)` for other block devices.
pub fn loop_status(dev: &Path) -> Result<Option<LoopStatus>, LoopError> {
    status_by_name(&loop_name(dev)?)
}

/// Every bound loop device on the machine (from `/sys/block/loop*`), sorted
/// by number. Unbound devices are left out.
pub fn list_loops() -> Result<Vec<LoopStatus>, LoopError> {
    let dir = Path::new("/sys/block");
    let entries = std::fs::read_dir(dir).map_err(|source| LoopError::Sysfs {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(status) = status_by_name(name)? {
            out.push(status);
        }
    }
    out.sort_by_key(|s| s.number);
    Ok(out)
}

/// Absolute form of `path` for comparing with sysfs: canonical when it
/// exists, otherwise its canonical parent joined with the file name.
fn comparable(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => std::fs::canonicalize(parent)
            .map(|p| p.join(name))
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

/// The loop device currently attached to the file at `path`, if any.
///
/// Compares canonical paths with `/sys/block/loop*/loop/backing_file`.
/// Devices whose backing file was deleted (sysfs shows `" (deleted)"`)
/// do not count: they read an old inode, not the file now at `path`. When
/// several live devices match, the lowest-numbered one is returned.
/// Works across process restarts (it only reads sysfs).
pub fn find_by_backing(path: &Path) -> Result<Option<PathBuf>, LoopError> {
    let target = comparable(path);
    Ok(list_loops()?
        .into_iter()
        .find(|s| !s.backing_deleted && s.backing_file == target)
        .map(|s| s.path))
}

/// Every loop device whose backing path is `path`, including ones whose
/// backing file was deleted since (see [`LoopStatus::backing_deleted`]).
/// For cleanup and health reporting.
pub fn find_all_by_backing(path: &Path) -> Result<Vec<LoopStatus>, LoopError> {
    let target = comparable(path);
    Ok(list_loops()?
        .into_iter()
        .filter(|s| s.backing_file == target)
        .collect())
}

/// Re-reads the backing file's size into the device (`LOOP_SET_CAPACITY`)
/// after the file was grown, and returns the device's new size in bytes.
pub fn refresh_capacity(dev: &Path) -> Result<u64, LoopError> {
    loop_name(dev)?;
    let fd = device::open_block(dev, OFlags::RDONLY)?;
    crust_sys::loopdev::set_capacity(&fd).map_err(|source| LoopError::Ioctl {
        op: "LOOP_SET_CAPACITY",
        device: dev.to_path_buf(),
        source,
    })?;
    Ok(device::size_of_fd(&fd, dev)?)
}

/// Detaches a loop device from its backing file (`LOOP_CLR_FD`). The
/// backing file is untouched.
///
/// Idempotent: an unbound device or a missing device node is success.
/// Refuses with [`LoopError::Busy`] while the device is mounted (listed in
/// this namespace's mountinfo, or held exclusively, e.g. by a mount in
/// another namespace) or has holders. The kernel would otherwise turn
/// `LOOP_CLR_FD` into a deferred "detach on last close"; if another process
/// still has the device open (QEMU, a reader), this function undoes that
/// deferral after a short grace period and reports `Busy` rather than
/// leaving a silently lazy detach behind.
pub fn detach(dev: &Path) -> Result<(), LoopError> {
    let name = match loop_name(dev) {
        Ok(n) => n,
        Err(LoopError::Device(e)) if e.is_not_found() => return Ok(()),
        Err(e) => return Err(e),
    };
    let Some(status) = status_by_name(&name)? else {
        return Ok(());
    };
    let (major, minor) = device::device_major_minor(dev)?;
    if let Ok(mounts) = crate::mount::mount_info()
        && let Some(m) = mounts.iter().find(|m| m.major == major && m.minor == minor)
    {
        return Err(LoopError::Busy {
            device: dev.to_path_buf(),
            reason: format!("mounted at {}", m.mount_point.display()),
        });
    }
    let holders: Vec<String> = std::fs::read_dir(format!("/sys/block/{name}/holders"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    if !holders.is_empty() {
        return Err(LoopError::Busy {
            device: dev.to_path_buf(),
            reason: format!("held by {}", holders.join(", ")),
        });
    }
    // An exclusive holder that is not a mount here may be on its way out
    // (a tool a killed plugin started, finishing): give it a moment.
    let deadline = Instant::now() + DETACH_WAIT;
    let fd = loop {
        match device::open_block(dev, OFlags::RDONLY | OFlags::EXCL) {
            Ok(fd) => break fd,
            Err(DeviceError::Io { source, .. })
                if sys::errno(&source) == Some(Errno::BUSY) && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(DeviceError::Io { source, .. }) if sys::errno(&source) == Some(Errno::BUSY) => {
                let who: Vec<String> = crate::holder::name_holders(major, minor)
                    .iter()
                    .map(ToString::to_string)
                    .collect();
                let reason = if who.is_empty() {
                    "opened exclusively, probably mounted in another mount namespace".into()
                } else {
                    format!("opened exclusively: {}", who.join(", "))
                };
                return Err(LoopError::Busy {
                    device: dev.to_path_buf(),
                    reason,
                });
            }
            Err(e) => return Err(e.into()),
        }
    };
    match crust_sys::loopdev::clr_fd(&fd) {
        Ok(_) => {}
        Err(e) if sys::errno(&e) == Some(Errno::NXIO) => return Ok(()),
        Err(source) => {
            return Err(LoopError::Ioctl {
                op: "LOOP_CLR_FD",
                device: dev.to_path_buf(),
                source,
            });
        }
    }
    drop(fd);
    // With us as the only opener the kernel unbinds on our close; with
    // other openers it only marks the device autoclear.
    let deadline = Instant::now() + DETACH_WAIT;
    loop {
        if status_by_name(&name)?.is_none() {
            tracing::debug!(device = %dev.display(), "loop detached");
            return Ok(());
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if !status.autoclear {
        undo_autoclear(dev);
    }
    Err(LoopError::Busy {
        device: dev.to_path_buf(),
        reason: "still open by another process (e.g. a VM); the detach was cancelled".into(),
    })
}

fn undo_autoclear(dev: &Path) {
    let Ok(fd) = device::open_block(dev, OFlags::RDONLY) else {
        return;
    };
    if let Ok(mut info) = crust_sys::loopdev::get_status(&fd) {
        info.lo_flags &= !(ld::LO_FLAGS_AUTOCLEAR as u32);
        if let Err(e) = crust_sys::loopdev::set_status(&fd, &info) {
            tracing::warn!(device = %dev.display(), %e, "could not cancel deferred loop detach");
        }
    }
}

/// Detaches its loop device when dropped (tests and error paths). Declare
/// it before any [`crate::MountGuard`] on the same device so the mount is
/// released first. The guard remembers the backing file and only detaches
/// if the device is still bound to it, so a device number that was freed
/// and reused by someone else in the meantime is left alone.
#[derive(Debug)]
pub struct LoopGuard {
    info: Option<LoopInfo>,
    backing: Option<PathBuf>,
}

impl LoopGuard {
    /// Attaches `backing` and guards the new device.
    pub fn attach(backing: &Path, opts: AttachOptions) -> Result<Self, LoopError> {
        let info = LoopDevice::attach(backing, opts)?;
        Ok(LoopGuard {
            backing: loop_status(&info.path)?.map(|s| s.backing_file),
            info: Some(info),
        })
    }

    /// Guards a device attached elsewhere (bound to whatever it is bound
    /// to now).
    pub fn adopt(info: LoopInfo) -> Self {
        let backing = loop_status(&info.path)
            .ok()
            .flatten()
            .map(|s| s.backing_file);
        LoopGuard {
            info: Some(info),
            backing,
        }
    }

    /// Guards `/dev/loopN` given its path.
    pub fn adopt_path(path: &Path) -> Result<Self, LoopError> {
        let name = loop_name(path)?;
        let number = name[4..]
            .parse()
            .map_err(|_| LoopError::NotLoop(path.to_path_buf()))?;
        Ok(Self::adopt(LoopInfo {
            path: path.to_path_buf(),
            number,
        }))
    }

    pub fn path(&self) -> &Path {
        &self.info.as_ref().expect("guard armed").path
    }

    pub fn info(&self) -> &LoopInfo {
        self.info.as_ref().expect("guard armed")
    }

    /// Disarms the guard; the device stays attached.
    pub fn release(mut self) -> LoopInfo {
        self.info.take().expect("guard armed")
    }
}

impl Drop for LoopGuard {
    fn drop(&mut self) {
        let Some(info) = self.info.take() else {
            return;
        };
        match loop_status(&info.path) {
            Ok(Some(s)) if Some(&s.backing_file) == self.backing.as_ref() => {}
            // Already detached, or now someone else's device.
            _ => return,
        }
        if let Err(e) = detach(&info.path) {
            tracing::warn!(device = %info.path.display(), %e, "LoopGuard could not detach");
            eprintln!("LoopGuard: could not detach {}: {e}", info.path.display());
        }
    }
}
