//! Block device ioctls (`linux/fs.h`).

use std::io;

use linux_raw_sys::ioctl as ic;
use rustix::fd::AsFd;

use crate::ioctl;

/// BLKGETSIZE64: the device's size in bytes.
pub fn size_bytes(dev: impl AsFd) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64.
    unsafe { ioctl::ptr(dev, ic::BLKGETSIZE64, &mut size) }?;
    Ok(size)
}

/// BLKFLSBUF: drops the device's buffer cache.
pub fn flush_buffers(dev: impl AsFd) -> io::Result<()> {
    // SAFETY: BLKFLSBUF takes no argument.
    unsafe { ioctl::int(dev, ic::BLKFLSBUF, 0) }.map(drop)
}

/// BLKROGET: whether the device is read-only.
pub fn read_only(dev: impl AsFd) -> io::Result<bool> {
    let mut ro: std::ffi::c_int = 0;
    // SAFETY: BLKROGET writes one int.
    unsafe { ioctl::ptr(dev, ic::BLKROGET, &mut ro) }?;
    Ok(ro != 0)
}

/// BLKROSET: makes the device read-only, or writable again.
pub fn set_read_only(dev: impl AsFd, ro: bool) -> io::Result<()> {
    let mut v = std::ffi::c_int::from(ro);
    // SAFETY: BLKROSET reads one int.
    unsafe { ioctl::ptr(dev, ic::BLKROSET, &mut v) }.map(drop)
}
