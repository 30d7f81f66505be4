//! Choosing between KVM and TCG.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use rustix::fs::{Mode, OFlags};
use rustix::ioctl::{Ioctl, IoctlOutput, Opcode, opcode};
use rustix::process::{Resource, Rlimit};

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
    let Ok(kvm) = rustix::fs::open("/dev/kvm", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
    else {
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

/// Whether QEMU itself can bring up a KVM machine here: some hosts create
/// VMs fine but fail when QEMU programs the vCPU (e.g. MSRs a nested
/// hypervisor refuses). Starts `qemu -accel kvm -cpu host -S` and waits
/// for its monitor to run a command, which happens after the first
/// machine reset.
async fn qemu_kvm_works(qemu: &Path) -> bool {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("crust-kvm-probe-{}-{nanos}", std::process::id()));
    if std::fs::create_dir(&dir).is_err() {
        return false;
    }
    let sock = dir.join("qmp.sock");
    let mut cmd = Command::new(qemu);
    // The failing case is an assertion (SIGABRT): no core dumps, please.
    // SAFETY: a single raw setrlimit between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let none = Rlimit {
                current: Some(0),
                maximum: Some(0),
            };
            rustix::process::setrlimit(Resource::Core, none)?;
            Ok(())
        });
    }
    let child = cmd
        .args(["-accel", "kvm", "-cpu", "host", "-machine", "q35", "-S"])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-m",
            "64",
        ])
        .arg("-qmp")
        .arg(format!(
            "unix:{},server=on,wait=off",
            sock.to_string_lossy().replace(',', ",,")
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let ok = match child {
        Ok(mut child) => {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let mut ok = false;
            while std::time::Instant::now() < deadline {
                if !matches!(child.try_wait(), Ok(None)) {
                    break;
                }
                if sock.exists() && crate::vm::qmp_ready(&sock).await {
                    ok = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = child.kill();
            let _ = child.wait();
            ok
        }
        Err(_) => false,
    };
    let _ = std::fs::remove_dir_all(&dir);
    ok
}

static KVM_WORKS: tokio::sync::OnceCell<bool> = tokio::sync::OnceCell::const_new();

/// [`kvm_usable`] plus a real QEMU start, cached for the process.
pub async fn kvm_works(qemu: &Path) -> bool {
    *KVM_WORKS
        .get_or_init(|| async { kvm_usable() && qemu_kvm_works(qemu).await })
        .await
}

pub async fn resolve(accel: Accel, qemu: &Path) -> Result<ResolvedAccel, VmError> {
    match accel {
        Accel::Tcg => Ok(ResolvedAccel::Tcg),
        Accel::Kvm if kvm_works(qemu).await => Ok(ResolvedAccel::Kvm),
        Accel::Kvm => Err(VmError::InvalidConfig(
            "accel kvm requested but KVM is unusable here (/dev/kvm missing, or QEMU cannot start a KVM vCPU)".into(),
        )),
        Accel::Auto if kvm_works(qemu).await => Ok(ResolvedAccel::Kvm),
        Accel::Auto => Ok(ResolvedAccel::Tcg),
    }
}
