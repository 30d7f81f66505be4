//! Loop device ioctls (`linux/loop.h`).

use std::io;

use linux_raw_sys::loop_device as ld;
use rustix::fd::{AsFd, AsRawFd, BorrowedFd};

use crate::ioctl;

/// `struct loop_info64`.
pub type LoopInfo = ld::loop_info64;
/// `struct loop_config` (LOOP_CONFIGURE).
pub type LoopConfig = ld::loop_config;

/// An all-zero `loop_info64`, the starting point of every request.
pub fn zeroed_info() -> LoopInfo {
    // SAFETY: integers and byte arrays only; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// An all-zero `loop_config`.
pub fn zeroed_config() -> LoopConfig {
    // SAFETY: integers, byte arrays and a loop_info64; all-zero is valid.
    unsafe { std::mem::zeroed() }
}

/// LOOP_CTL_GET_FREE on `/dev/loop-control`: the number of a free device
/// (made if none is).
pub fn ctl_get_free(ctl: impl AsFd) -> io::Result<u32> {
    // SAFETY: LOOP_CTL_GET_FREE takes no argument.
    let n = unsafe { ioctl::int(ctl, ld::LOOP_CTL_GET_FREE, 0) }?;
    Ok(n as u32)
}

/// LOOP_CTL_REMOVE of device `n` (EBUSY when bound or open).
pub fn ctl_remove(ctl: impl AsFd, n: u32) -> io::Result<()> {
    // SAFETY: LOOP_CTL_REMOVE takes the device number as an integer.
    unsafe { ioctl::int(ctl, ld::LOOP_CTL_REMOVE, n as usize) }.map(drop)
}

/// LOOP_SET_FD: binds `file` to the device (pre-5.8 setup).
pub fn set_fd(dev: impl AsFd, file: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: LOOP_SET_FD takes a descriptor number as an integer.
    unsafe { ioctl::int(dev, ld::LOOP_SET_FD, file.as_raw_fd() as usize) }.map(drop)
}

/// LOOP_CLR_FD: unbinds the device (deferred while it is open).
pub fn clr_fd(dev: impl AsFd) -> io::Result<()> {
    // SAFETY: LOOP_CLR_FD takes no argument.
    unsafe { ioctl::int(dev, ld::LOOP_CLR_FD, 0) }.map(drop)
}

/// LOOP_GET_STATUS64.
pub fn get_status(dev: impl AsFd) -> io::Result<LoopInfo> {
    let mut info = zeroed_info();
    // SAFETY: LOOP_GET_STATUS64 writes one struct loop_info64.
    unsafe { ioctl::ptr(dev, ld::LOOP_GET_STATUS64, &mut info) }?;
    Ok(info)
}

/// LOOP_SET_STATUS64.
pub fn set_status(dev: impl AsFd, info: &LoopInfo) -> io::Result<()> {
    let mut info = *info;
    // SAFETY: LOOP_SET_STATUS64 reads one struct loop_info64.
    unsafe { ioctl::ptr(dev, ld::LOOP_SET_STATUS64, &mut info) }.map(drop)
}

/// LOOP_CONFIGURE (5.8+): binds `file` and sets the status of `config`
/// (its `fd` is `file`'s) at once.
pub fn configure(dev: impl AsFd, file: BorrowedFd<'_>, config: &LoopConfig) -> io::Result<()> {
    let mut config = *config;
    config.fd = file.as_raw_fd() as u32;
    // SAFETY: LOOP_CONFIGURE reads one struct loop_config; a bad fd in it
    // is the kernel's EBADF, not memory.
    unsafe { ioctl::ptr(dev, ld::LOOP_CONFIGURE, &mut config) }.map(drop)
}

/// LOOP_SET_BLOCK_SIZE.
pub fn set_block_size(dev: impl AsFd, size: u32) -> io::Result<()> {
    // SAFETY: LOOP_SET_BLOCK_SIZE takes the size as an integer.
    unsafe { ioctl::int(dev, ld::LOOP_SET_BLOCK_SIZE, size as usize) }.map(drop)
}

/// LOOP_SET_DIRECT_IO.
pub fn set_direct_io(dev: impl AsFd, on: bool) -> io::Result<()> {
    // SAFETY: LOOP_SET_DIRECT_IO takes 0 or 1 as an integer.
    unsafe { ioctl::int(dev, ld::LOOP_SET_DIRECT_IO, usize::from(on)) }.map(drop)
}

/// LOOP_SET_CAPACITY: rereads the backing file's size.
pub fn set_capacity(dev: impl AsFd) -> io::Result<()> {
    // SAFETY: LOOP_SET_CAPACITY takes no argument.
    unsafe { ioctl::int(dev, ld::LOOP_SET_CAPACITY, 0) }.map(drop)
}
