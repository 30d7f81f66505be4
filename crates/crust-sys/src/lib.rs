//! The floor for system calls: every `unsafe` block of crust lives in this
//! crate, behind small safe functions that say what they need from the
//! kernel. Every other crate of the workspace forbids unsafe code.
//!
//! What is here is what no maintained crate wraps: loop, block, filesystem,
//! KVM and TUN ioctls; `mount_setattr(2)`; the one pattern for what a child
//! does between fork and exec; POSIX record locks; a descriptor inherited
//! across exec; glibc's arena cap. Each function checks what it can (name
//! lengths, namespace flags) so a bad argument is an error, never undefined
//! behaviour.

pub mod aio;
pub mod blk;
pub mod buf;
#[cfg(target_arch = "x86_64")]
pub mod compat32;
pub mod fd;
pub mod fs;
mod ioctl;
pub mod kvm;
pub mod lock;
pub mod loopdev;
pub mod malloc;
pub mod mm;
pub mod mount;
pub mod ns;
pub mod rusage;
pub mod spawn;
pub mod tun;
