//! Facts about block device nodes: size, type, numbers, exclusive use, wiping.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};

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
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64.
    unsafe { sys::ioctl_ptr(fd, linux_raw_sys::ioctl::BLKGETSIZE64, &mut size) }
        .map_err(|e| DeviceError::io(path, e))?;
    Ok(size)
}

/// Size in bytes of a block device (`BLKGETSIZE64`).
pub fn block_device_size(path: &Path) -> Result<u64, DeviceError> {
    let fd = open_block(path, OFlags::RDONLY)?;
    size_of_fd(&fd, path)
}

/// Whether something holds the device exclusively: a mounted filesystem (in
/// any mount namespace), a device-mapper or md holder, or another
/// `O_EXCL` opener. Implemented by trying an `O_EXCL` open, which the
/// kernel refuses with `EBUSY` in exactly those cases. Plain (non-exclusive)
/// openers such as QEMU are not detected.
pub fn is_device_in_use(path: &Path) -> Result<bool, DeviceError> {
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

/// Kernel name of a block device ("loop3", "vda") from its numbers, via
/// `/sys/dev/block/MAJ:MIN`.
pub fn sysfs_name(path: &Path) -> Result<String, DeviceError> {
    let (major, minor) = device_major_minor(path)?;
    sysfs_name_of(major, minor).map_err(|e| DeviceError::io(path, e))
}

pub(crate) fn sysfs_name_of(major: u32, minor: u32) -> io::Result<String> {
    let link = std::fs::read_link(format!("/sys/dev/block/{major}:{minor}"))?;
    link.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_owned)
        .ok_or_else(|| io::Error::other("unexpected /sys/dev/block link"))
}
