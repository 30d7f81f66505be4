//! The two KVM ioctls a host probe needs.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

use rustix::fd::AsFd;
use rustix::ioctl::opcode;

use crate::ioctl;

/// KVM_GET_API_VERSION on an open `/dev/kvm` (12 on every kernel since
/// 2.6.22).
pub fn api_version(kvm: impl AsFd) -> io::Result<i32> {
    // SAFETY: KVM_GET_API_VERSION takes no argument.
    unsafe { ioctl::int(kvm, opcode::none(0xAE, 0x00), 0) }
}

/// KVM_CREATE_VM of machine type 0: a new VM's descriptor.
pub fn create_vm(kvm: impl AsFd) -> io::Result<OwnedFd> {
    // SAFETY: KVM_CREATE_VM takes the machine type as an integer.
    let fd = unsafe { ioctl::int(kvm, opcode::none(0xAE, 0x01), 0) }?;
    if fd < 0 {
        return Err(io::Error::other("KVM_CREATE_VM returned no descriptor"));
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
