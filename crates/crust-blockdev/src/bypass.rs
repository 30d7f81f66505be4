//! A loop device's backing file, for a reader and writer that can do the
//! loop driver's job itself (QEMU): its I/O then skips the loop driver's
//! hop, while whoever holds the loop device exclusively still keeps the
//! host (mkfs, fsck, mount) away from the data.
//!
//! The file is found by descriptor and proven, never trusted by name:
//! the path sysfs reports is opened `O_PATH | O_NOFOLLOW` (no side
//! effect of an open, no symlink followed), its device and inode must be
//! what `LOOP_GET_STATUS64` says the loop reads, and only then is it
//! reopened through that descriptor for I/O. Only a loop that maps the
//! whole file one to one qualifies: no offset, no size limit short of
//! the file, no transfer function, writable only when the loop is.
//! Anything else stays on the device, with the reason.
//!
//! Writes that skip the loop device leave its own page cache stale:
//! [`crate::ExclusiveDevice`] flushes it when a hold is taken and when it
//! drops.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use linux_raw_sys::loop_device as ld;
use rustix::fs::{FileType, Mode, OFlags};

use crate::alias::DevNum;
use crate::{device, loopdev};

/// Where a consumer of a loop device should do its I/O.
#[derive(Debug)]
pub enum Route {
    /// The loop's whole backing file, opened read-write or read-only as
    /// asked, proven to be the inode the loop reads.
    BackingFile(OwnedFd),
    /// Through the device itself; the reason it cannot be bypassed.
    Device(String),
}

/// The route for I/O on the block device `held` is open on (the hold a
/// consumer keeps meanwhile; `dev` names it in messages), `writable` or
/// read-only. Every question goes to that descriptor, never to a path
/// that may name another device by now. Never an error: whatever cannot
/// be proven keeps the device.
pub fn route(held: BorrowedFd<'_>, dev: &Path, writable: bool) -> Route {
    match backing_file(held, dev, writable).and_then(Proven::whole) {
        Ok(fd) => Route::BackingFile(fd),
        Err(reason) => Route::Device(reason),
    }
}

/// The loop's backing file, proven its inode; sizes not yet compared.
struct Proven {
    fd: OwnedFd,
    file_bytes: u64,
    device_bytes: u64,
    size_limit: u64,
}

impl Proven {
    /// The descriptor, when the loop maps exactly the whole file.
    fn whole(self) -> Result<OwnedFd, String> {
        let Proven {
            fd,
            file_bytes,
            device_bytes,
            size_limit,
        } = self;
        if file_bytes != device_bytes || (size_limit != 0 && size_limit != file_bytes) {
            return Err(format!(
                "it maps {device_bytes} bytes (size limit {size_limit}) of its {file_bytes}-byte file"
            ));
        }
        Ok(fd)
    }
}

fn backing_file(held: BorrowedFd<'_>, dev: &Path, writable: bool) -> Result<Proven, String> {
    let st = rustix::fs::fstat(held).map_err(|e| format!("{}: {e}", dev.display()))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::BlockDevice {
        return Err("not a block device".into());
    }
    let name = device::sysfs_name_of(rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev))
        .map_err(|e| format!("its sysfs entry: {e}"))?;
    let status = match loopdev::status_of(&name) {
        Ok(Some(s)) => s,
        Ok(None) if name.starts_with("loop") => {
            return Err("a loop device bound to no file".into());
        }
        Ok(None) => return Err("not a loop device".into()),
        Err(e) => return Err(e.to_string()),
    };
    let info =
        crust_sys::loopdev::get_status(held).map_err(|e| format!("LOOP_GET_STATUS64: {e}"))?;
    if info.lo_number != status.number {
        return Err(format!(
            "the node answers as loop{}, sysfs was read for loop{}",
            info.lo_number, status.number
        ));
    }
    if info.lo_offset != 0 {
        return Err(format!(
            "it maps its file from offset {}, not the whole file",
            info.lo_offset
        ));
    }
    if info.lo_encrypt_type != 0 {
        return Err("it transforms its file's data".into());
    }
    if info.lo_rdevice != 0 {
        return Err("its backing file is a device node".into());
    }
    if writable && (info.lo_flags & ld::LO_FLAGS_READ_ONLY as u32 != 0 || device_read_only(held)) {
        return Err("it is read-only, the volume read-write".into());
    }
    if status.backing_deleted {
        return Err("its backing file was deleted or replaced since".into());
    }
    let want = (DevNum::from_kernel(info.lo_device), info.lo_inode);
    let name = status.backing_file.display().to_string();
    // O_PATH: opening has no effect on whatever the path names now.
    let found = rustix::fs::open(
        &status.backing_file,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("its backing file {name}: {e}"))?;
    identify(&found, want, &name)?;
    let access = if writable {
        OFlags::RDWR
    } else {
        OFlags::RDONLY
    };
    // Reopened through the proven descriptor, not the path.
    let fd = rustix::fs::open(
        format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&found)),
        access | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
    .map_err(|e| format!("reopening its backing file {name}: {e}"))?;
    let file_bytes = identify(&fd, want, &name)?;
    let device_bytes = device::size_of_borrowed(held, dev).map_err(|e| e.to_string())?;
    Ok(Proven {
        fd,
        file_bytes,
        device_bytes,
        size_limit: info.lo_sizelimit,
    })
}

/// Checks that `fd` is a regular file with the loop's identity; its size.
fn identify(fd: &OwnedFd, want: (DevNum, u64), name: &str) -> Result<u64, String> {
    let st = rustix::fs::fstat(fd).map_err(|e| format!("{name}: {e}"))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(format!("{name} is not a regular file now"));
    }
    if (DevNum::from_stat(st.st_dev), st.st_ino) != want {
        return Err(format!(
            "{name} is inode {} on {} now, the loop reads inode {} on {}",
            st.st_ino,
            DevNum::from_stat(st.st_dev),
            want.1,
            want.0
        ));
    }
    Ok(st.st_size as u64)
}

/// The block layer's read-only flag (`BLKROGET`: set by `BLKROSET` too).
fn device_read_only(fd: BorrowedFd<'_>) -> bool {
    crust_sys::blk::read_only(fd).unwrap_or(false)
}

/// The size of `dev`'s backing file now, proven the loop's (a node opened
/// on that file must never be resized below it: QEMU truncates a file to
/// the size it is given).
pub fn backing_file_bytes(dev: &Path) -> Result<u64, String> {
    let fd = device::open_block(dev, OFlags::RDONLY).map_err(|e| e.to_string())?;
    backing_file(fd.as_fd(), dev, false).map(|p| p.file_bytes)
}
