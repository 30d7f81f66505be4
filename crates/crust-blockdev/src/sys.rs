//! Thin unsafe helpers around `ioctl(2)` and aligned reads.

use std::ffi::c_void;
use std::io;

use rustix::fd::AsFd;
use rustix::ioctl::{Ioctl, IoctlOutput, Opcode};

/// An ioctl with a caller-supplied argument whose integer return value is
/// kept (LOOP_CTL_GET_FREE returns the device number that way).
struct Raw {
    opcode: Opcode,
    arg: *mut c_void,
}

// SAFETY: `ioctl` (the only constructor) takes `arg` under a contract that
// it is what the kernel expects for `opcode`; the output is the syscall's
// return value, not read through `arg`.
unsafe impl Ioctl for Raw {
    type Output = IoctlOutput;
    const IS_MUTATING: bool = true;

    fn opcode(&self) -> Opcode {
        self.opcode
    }

    fn as_ptr(&mut self) -> *mut c_void {
        self.arg
    }

    unsafe fn output_from_ptr(out: IoctlOutput, _: *mut c_void) -> rustix::io::Result<IoctlOutput> {
        Ok(out)
    }
}

/// Calls `ioctl(fd, opcode, arg)` and returns its non-negative result.
///
/// # Safety
/// `arg` must be what the kernel expects for `opcode`: a valid pointer to a
/// correctly sized, initialised struct, or an integer cast to a pointer.
pub(crate) unsafe fn ioctl<Fd: AsFd>(fd: Fd, opcode: u32, arg: *mut c_void) -> io::Result<i32> {
    // SAFETY: the caller guarantees `arg` matches `opcode` (see above).
    unsafe { rustix::ioctl::ioctl(fd, Raw { opcode, arg }) }.map_err(io::Error::from)
}

/// `ioctl` whose argument is a plain integer.
pub(crate) fn ioctl_int<Fd: AsFd>(fd: Fd, opcode: u32, value: usize) -> io::Result<i32> {
    // SAFETY: only used with opcodes that take an integer argument.
    unsafe { ioctl(fd, opcode, value as *mut c_void) }
}

/// `ioctl` whose argument is a pointer to `T` (read or written by the kernel).
///
/// # Safety
/// `T` must be the exact type the kernel expects for `opcode`.
pub(crate) unsafe fn ioctl_ptr<Fd: AsFd, T>(fd: Fd, opcode: u32, value: &mut T) -> io::Result<i32> {
    // SAFETY: `value` is a live, exclusively borrowed `T`, and the caller
    // guarantees `T` is what the kernel expects for `opcode`.
    unsafe { ioctl(fd, opcode, (value as *mut T).cast()) }
}

pub(crate) fn errno(e: &io::Error) -> Option<rustix::io::Errno> {
    e.raw_os_error().map(rustix::io::Errno::from_raw_os_error)
}

/// A heap buffer aligned for O_DIRECT.
pub(crate) struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

pub(crate) const DIRECT_ALIGN: usize = 4096;

impl AlignedBuf {
    pub(crate) fn new(len: usize) -> Self {
        let storage = vec![0u8; len + DIRECT_ALIGN];
        let addr = storage.as_ptr() as usize;
        let start = (DIRECT_ALIGN - addr % DIRECT_ALIGN) % DIRECT_ALIGN;
        AlignedBuf {
            storage,
            start,
            len,
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }
}

/// Reads up to `buf.len()` bytes at `offset`, stopping early only at EOF.
pub(crate) fn pread_full<Fd: AsFd>(fd: Fd, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let fd = fd.as_fd();
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pread(fd, &mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(done)
}

/// Writes all of `buf` at `offset`.
pub(crate) fn pwrite_full<Fd: AsFd>(fd: Fd, buf: &[u8], offset: u64) -> io::Result<()> {
    let fd = fd.as_fd();
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pwrite(fd, &buf[done..], offset + done as u64) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
