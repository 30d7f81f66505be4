//! The raw `ioctl(2)` under the typed wrappers of this crate.

use std::ffi::c_void;
use std::io;

use rustix::fd::AsFd;
use rustix::ioctl::{Ioctl, IoctlOutput, Opcode};

/// An ioctl whose argument the caller vouches for and whose integer return
/// value is kept (LOOP_CTL_GET_FREE and KVM_CREATE_VM return results so).
struct Raw {
    opcode: Opcode,
    arg: *mut c_void,
}

// SAFETY: the constructors below take `arg` under a contract that it is
// what the kernel expects for `opcode`; the output is the syscall's return
// value, never read through `arg`.
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

/// `ioctl(fd, opcode, value)` with an integer (or no) argument.
///
/// # Safety
/// `opcode` must take an integer argument, or none: the kernel must never
/// dereference `value`.
pub(crate) unsafe fn int<Fd: AsFd>(fd: Fd, opcode: u32, value: usize) -> io::Result<i32> {
    // SAFETY: the caller guarantees the kernel reads no memory at `value`.
    unsafe {
        rustix::ioctl::ioctl(
            fd,
            Raw {
                opcode,
                arg: value as *mut c_void,
            },
        )
    }
    .map_err(io::Error::from)
}

/// `ioctl(fd, opcode, &mut value)`: the kernel reads or writes one `T`.
///
/// # Safety
/// `T` must be exactly the type the kernel reads or writes for `opcode`.
pub(crate) unsafe fn ptr<Fd: AsFd, T>(fd: Fd, opcode: u32, value: &mut T) -> io::Result<i32> {
    let arg = (value as *mut T).cast();
    // SAFETY: `value` is a live, exclusively borrowed `T` for the whole
    // call, and the caller guarantees `T` matches `opcode`.
    unsafe { rustix::ioctl::ioctl(fd, Raw { opcode, arg }) }.map_err(io::Error::from)
}
