//! Facts about block device nodes: size, type, numbers, who uses them,
//! wiping.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, StatxFlags};
use rustix::io::Errno;

use crate::sys;

/// Errors about a block device node.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("{0} is not a block device")]
    NotBlockDevice(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl DeviceError {
    fn io(path: &Path, source: impl Into<io::Error>) -> Self {
        DeviceError::Io {
            path: path.to_path_buf(),
            source: source.into(),
        }
    }

    /// True when the device node does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, DeviceError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

/// Whether `path` (following symlinks) is a block device node. Missing
/// paths and unreadable ones are simply `false`.
pub fn is_block_device(path: &Path) -> bool {
    rustix::fs::stat(path)
        .map(|st| FileType::from_raw_mode(st.st_mode) == FileType::BlockDevice)
        .unwrap_or(false)
}

/// `(major, minor)` of a block device node (following symlinks).
pub fn device_major_minor(path: &Path) -> Result<(u32, u32), DeviceError> {
    let st = rustix::fs::stat(path).map_err(|e| DeviceError::io(path, e))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::BlockDevice {
        return Err(DeviceError::NotBlockDevice(path.to_path_buf()));
    }
    Ok((rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev)))
}

/// Opens a block device node, refusing anything that is not one.
pub(crate) fn open_block(path: &Path, flags: OFlags) -> Result<OwnedFd, DeviceError> {
    let fd = rustix::fs::open(path, flags | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| DeviceError::io(path, e))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| DeviceError::io(path, e))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::BlockDevice {
        return Err(DeviceError::NotBlockDevice(path.to_path_buf()));
    }
    Ok(fd)
}

pub(crate) fn size_of_fd(fd: &OwnedFd, path: &Path) -> Result<u64, DeviceError> {
    size_of_borrowed(fd.as_fd(), path)
}

pub(crate) fn size_of_borrowed(fd: BorrowedFd<'_>, path: &Path) -> Result<u64, DeviceError> {
    crust_sys::blk::size_bytes(fd).map_err(|e| DeviceError::io(path, e))
}

/// Writes back and drops the block device's own page cache
/// (`BLKFLSBUF`): what the host reads through the device node next comes
/// from its backing store. Needed where something writes that store
/// around the device (QEMU on a loop device's backing file). Without
/// `CAP_SYS_ADMIN` the kernel refuses: `Ok(false)`.
pub fn flush_device_cache(fd: BorrowedFd<'_>, path: &Path) -> Result<bool, DeviceError> {
    match crust_sys::blk::flush_buffers(fd) {
        Ok(_) => Ok(true),
        Err(e) if matches!(sys::errno(&e), Some(Errno::PERM) | Some(Errno::ACCESS)) => Ok(false),
        Err(e) => Err(DeviceError::io(path, e)),
    }
}

/// Size in bytes of a block device (`BLKGETSIZE64`).
pub fn block_device_size(path: &Path) -> Result<u64, DeviceError> {
    let fd = open_block(path, OFlags::RDONLY)?;
    size_of_fd(&fd, path)
}

/// Sets or clears the kernel's read-only flag of a block device
/// (`BLKROSET`): a read-only bind of a device node does not stop writes
/// through it, this does.
pub fn set_read_only(path: &Path, read_only: bool) -> Result<(), DeviceError> {
    let fd = open_block(path, OFlags::RDONLY)?;
    crust_sys::blk::set_read_only(&fd, read_only).map_err(|e| DeviceError::io(path, e))?;
    Ok(())
}

/// Whether something holds the device exclusively: a mounted filesystem (in
/// any mount namespace), a device-mapper or md holder, or another
/// `O_EXCL` opener. Implemented by trying an `O_EXCL` open, which the
/// kernel refuses with `EBUSY` in exactly those cases. Plain (non-exclusive)
/// openers such as QEMU are NOT detected: see [`device_openers`] and
/// [`is_device_in_use`].
pub fn is_device_held_exclusively(path: &Path) -> Result<bool, DeviceError> {
    match open_block(path, OFlags::RDONLY | OFlags::EXCL) {
        Ok(_) => Ok(false),
        Err(DeviceError::Io { source, .. })
            if sys::errno(&source) == Some(rustix::io::Errno::BUSY) =>
        {
            Ok(true)
        }
        Err(e) => Err(e),
    }
}

/// Whether anything but this process uses the device: an exclusive holder
/// ([`is_device_held_exclusively`]: a mount, device-mapper, `O_EXCL`
/// opener) or another process with a plain open descriptor
/// ([`device_openers`]; e.g. QEMU, which opens a disk without `O_EXCL`
/// while its guest's kernel has the filesystem mounted).
pub fn is_device_in_use(path: &Path) -> Result<bool, DeviceError> {
    Ok(is_device_held_exclusively(path)? || !device_openers(path)?.is_empty())
}

/// A process with an open descriptor on a block device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Opener {
    pub pid: u32,
    /// `/proc/PID/comm` ("qemu-system-x86" is truncated by the kernel to
    /// 15 bytes), or "?" when the process went away meanwhile.
    pub comm: String,
}

impl std::fmt::Display for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} ({})", self.pid, self.comm)
    }
}

/// Longest a [`device_openers`] scan may take before it gives up (an
/// error, never an "unused" answer).
pub const OPENERS_SCAN_LIMIT: Duration = Duration::from_secs(5);

/// Processes other than this one that hold `path`'s device open, found by
/// scanning `/proc/*/fd`: a descriptor matches when it is a block device
/// node with the same device numbers (whatever path it was opened by).
///
/// Only processes in this PID namespace are visible (a node plugin must
/// run with the host's to see the runtimes' QEMU). Processes and
/// descriptors that vanish during the scan are skipped; `statx` is asked
/// not to sync attributes so a descriptor on a hung network filesystem
/// does not stall the scan, which is also bounded by
/// [`OPENERS_SCAN_LIMIT`]. Sorted by pid, one entry per process.
pub fn device_openers(path: &Path) -> Result<Vec<Opener>, DeviceError> {
    let (major, minor) = device_major_minor(path)?;
    openers_of(major, minor, Instant::now() + OPENERS_SCAN_LIMIT)
        .map_err(|e| DeviceError::io(path, e))
}

pub(crate) fn openers_of(major: u32, minor: u32, deadline: Instant) -> io::Result<Vec<Opener>> {
    let mut found = Vec::new();
    for_other_processes(deadline, "/proc/*/fd for other openers", |pid, comm| {
        if process_has_device(pid, major, minor) {
            found.push(Opener { pid, comm: comm() });
        }
    })?;
    found.sort_by_key(|o| o.pid);
    Ok(found)
}

/// Calls `f(pid, comm)` for every process but this one (`comm()` reads its
/// name, `?` when it is gone); `TimedOut` naming `what` was scanned once
/// `deadline` passes.
pub(crate) fn for_other_processes(
    deadline: Instant,
    what: &str,
    mut f: impl FnMut(u32, &dyn Fn() -> String),
) -> io::Result<()> {
    let me = std::process::id();
    for ent in std::fs::read_dir("/proc")? {
        let Ok(ent) = ent else { continue };
        let Some(pid) = ent.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        if Instant::now() > deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("scanning {what} took too long"),
            ));
        }
        let comm = || {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim_end().to_owned())
                .unwrap_or_else(|_| "?".into())
        };
        f(pid, &comm);
    }
    Ok(())
}

/// Whether process `pid` has a descriptor on block device `major:minor`.
/// Any error (the process exited, a descriptor was closed) is "no".
fn process_has_device(pid: u32, major: u32, minor: u32) -> bool {
    let dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let Ok(fds) = std::fs::read_dir(&dir) else {
        return false;
    };
    fds.flatten().any(|fd| {
        let link = fd.path();
        // Sockets, pipes, anon inodes ("socket:[123]") are never devices.
        match std::fs::read_link(&link) {
            Ok(t) if t.as_os_str().as_encoded_bytes().first() == Some(&b'/') => {}
            _ => return false,
        }
        match rustix::fs::statx(
            rustix::fs::CWD,
            &link,
            AtFlags::STATX_DONT_SYNC,
            StatxFlags::TYPE,
        ) {
            Ok(st) => {
                FileType::from_raw_mode(st.stx_mode.into()) == FileType::BlockDevice
                    && st.stx_rdev_major == major
                    && st.stx_rdev_minor == minor
            }
            Err(_) => false,
        }
    })
}

/// Overwrites the first and last `edge_bytes` of a block device with
/// zeros (the whole device if it is smaller than twice that) and flushes
/// it, so [`crate::probe_fs`] reports it `Blank` afterwards: every
/// signature it looks for lives in the first or last 128 KiB. Refuses a
/// device that is in use (see [`is_device_in_use`]); the device is held
/// with `O_EXCL` while wiping so nobody mounts it half-wiped.
pub fn wipe_edges(path: &Path, edge_bytes: u64) -> Result<(), DeviceError> {
    let fd = match open_block(path, OFlags::RDWR | OFlags::EXCL) {
        Err(DeviceError::Io { source, .. })
            if sys::errno(&source) == Some(rustix::io::Errno::BUSY) =>
        {
            return Err(DeviceError::Io {
                path: path.to_path_buf(),
                source: io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    "device is in use (mounted or held); refusing to wipe it",
                ),
            });
        }
        other => other?,
    };
    // Plain openers (a guest's QEMU) are not stopped by O_EXCL.
    if let Some(o) = device_openers(path)?.first() {
        return Err(DeviceError::Io {
            path: path.to_path_buf(),
            source: io::Error::new(
                io::ErrorKind::ResourceBusy,
                format!("device is open by {o}; refusing to wipe it"),
            ),
        });
    }
    let size = size_of_fd(&fd, path)?;
    let ranges = if size <= edge_bytes.saturating_mul(2) {
        vec![(0, size)]
    } else {
        vec![(0, edge_bytes), (size - edge_bytes, edge_bytes)]
    };
    let chunk = vec![0u8; 1 << 20];
    for (start, len) in ranges {
        let mut off = 0;
        while off < len {
            let n = (len - off).min(chunk.len() as u64) as usize;
            sys::pwrite_full(&fd, &chunk[..n], start + off)
                .map_err(|e| DeviceError::io(path, e))?;
            off += n as u64;
        }
    }
    rustix::fs::fsync(&fd).map_err(|e| DeviceError::io(path, e))?;
    Ok(())
}

/// Zeroes the whole block device `path` if the device can do it without
/// writing every block (`fallocate(PUNCH_HOLE | KEEP_SIZE)`, which the
/// kernel turns into a write-zeroes request and refuses rather than fall
/// back to writing; a loop device punches holes in its file). Returns
/// whether it did; `Ok(false)` when the device cannot. Refuses a device
/// that is held or open elsewhere, like [`wipe_edges`].
pub fn zero_out_fast(path: &Path) -> Result<bool, DeviceError> {
    let fd = open_block(path, OFlags::RDWR | OFlags::EXCL)?;
    if let Some(o) = device_openers(path)?.first() {
        return Err(DeviceError::Io {
            path: path.to_path_buf(),
            source: io::Error::new(
                io::ErrorKind::ResourceBusy,
                format!("device is open by {o}; refusing to zero it"),
            ),
        });
    }
    let size = size_of_fd(&fd, path)?;
    let mode = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
    match rustix::fs::fallocate(&fd, mode, 0, size) {
        Ok(()) => {}
        Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::INVAL) => return Ok(false),
        Err(e) => return Err(DeviceError::io(path, e)),
    }
    rustix::fs::fsync(&fd).map_err(|e| DeviceError::io(path, e))?;
    Ok(true)
}

/// Kernel name of a block device ("loop3", "vda") from its numbers, via
/// `/sys/dev/block/MAJ:MIN`.
pub fn sysfs_name(path: &Path) -> Result<String, DeviceError> {
    let (major, minor) = device_major_minor(path)?;
    sysfs_name_of(major, minor).map_err(|e| DeviceError::io(path, e))
}

/// Logical sector size of block device `path`
/// (`/sys/dev/block/MAJ:MIN/queue/logical_block_size`).
pub fn logical_block_size(path: &Path) -> Result<u32, DeviceError> {
    let (major, minor) = device_major_minor(path)?;
    let f = format!("/sys/dev/block/{major}:{minor}/queue/logical_block_size");
    let s = std::fs::read_to_string(&f).map_err(|e| DeviceError::io(path, e))?;
    s.trim()
        .parse()
        .map_err(|_| DeviceError::io(path, io::Error::other(format!("{f}: {s:?}"))))
}

pub(crate) fn sysfs_name_of(major: u32, minor: u32) -> io::Result<String> {
    let link = std::fs::read_link(format!("/sys/dev/block/{major}:{minor}"))?;
    link.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_owned)
        .ok_or_else(|| io::Error::other("unexpected /sys/dev/block link"))
}
