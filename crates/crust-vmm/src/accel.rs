//! Choosing between KVM and TCG.

use rustix::fs::{Mode, OFlags};
use rustix::ioctl::{Ioctl, IoctlOutput, Opcode, opcode};

use crate::{Accel, VmError};

/// The accelerator a launched VM actually uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResolvedAccel {
    Tcg,
    Kvm,
}

/// An argument-less ioctl whose return value is the result.
struct IntIoctl(Opcode);

// SAFETY: no pointer argument is passed and the result is the raw return
// value of a successful call.
unsafe impl Ioctl for IntIoctl {
    type Output = IoctlOutput;
    const IS_MUTATING: bool = false;
    fn opcode(&self) -> Opcode {
        self.0
    }
    fn as_ptr(&mut self) -> *mut core::ffi::c_void {
        core::ptr::null_mut()
    }
    unsafe fn output_from_ptr(
        out: IoctlOutput,
        _: *mut core::ffi::c_void,
    ) -> rustix::io::Result<IoctlOutput> {
        Ok(out)
    }
}

const KVM_API_VERSION: IoctlOutput = 12;

/// Whether KVM really works here: /dev/kvm opens read-write, speaks API 12
/// and can create a VM. A device node alone proves nothing (containers
/// often expose one that fails).
pub fn kvm_usable() -> bool {
    let Ok(kvm) = rustix::fs::open(
        "/dev/kvm",
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return false;
    };
    // SAFETY: KVM_GET_API_VERSION takes no argument.
    let version = unsafe { rustix::ioctl::ioctl(&kvm, IntIoctl(opcode::none(0xAE, 0x00))) };
    if version != Ok(KVM_API_VERSION) {
        return false;
    }
    // SAFETY: KVM_CREATE_VM with machine type 0 (passed as the null
    // pointer) returns a new VM descriptor.
    match unsafe { rustix::ioctl::ioctl(&kvm, IntIoctl(opcode::none(0xAE, 0x01))) } {
        Ok(fd) if fd >= 0 => {
            // SAFETY: the kernel just gave us this descriptor.
            drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
            true
        }
        _ => false,
    }
}

pub fn resolve(accel: Accel) -> Result<ResolvedAccel, VmError> {
    match accel {
        Accel::Tcg => Ok(ResolvedAccel::Tcg),
        Accel::Kvm if kvm_usable() => Ok(ResolvedAccel::Kvm),
        Accel::Kvm => Err(VmError::InvalidConfig(
            "accel kvm requested but /dev/kvm is missing or cannot create a VM".into(),
        )),
        Accel::Auto if kvm_usable() => Ok(ResolvedAccel::Kvm),
        Accel::Auto => Ok(ResolvedAccel::Tcg),
    }
}
