//! Test-only helpers shared by the integration tests of every crust crate.
//!
//! The machines that run the tests have two cores, so guests are rationed
//! machine-wide through [`VmSlot`] (a lock file per slot), not per process:
//! nextest runs each test in its own process.
//!
//! [`LoopDisk`] and [`TempMount`] wrap crust-blockdev's loop and mount
//! guards for tests that need a real formatted block device; [`AliasCase`]
//! makes the devices a host tool may stack on or beside them.

mod alias;
mod capture;
mod cni;
mod containerd;
mod disk;
mod python;
mod qemu;

pub use alias::{Alias, AliasCase, assert_fsck_clean, losetup, sha256};
pub use capture::Capture;
pub use cni::{CniNamespace, ip};
pub use containerd::{
    BUSYBOX_IMAGE, CRI_NAMESPACE, CRUST_HANDLER, CRUST_RUNTIME_TYPE, Containerd, ContainerdOptions,
    Events, PAUSE_IMAGE, WEBSERVER_IMAGE, ensure_test_images, pid_alive, test_images_dir,
    unmount_below,
};
pub use disk::{LoopDisk, LoopsUnder, TempMount};
pub use python::{DEFAULT_VENV, PyAnswer, grpc_python, grpc_python_calls, venv_python_with};
pub use qemu::{HangingKvmQemu, QemuStart};

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use rustix::fs::{FlockOperation, flock};

/// How many guests may run at once across every test process on the machine.
pub const VM_SLOTS: usize = 2;

pub(crate) const SLOT_DIR: &str = "/tmp/crust-test-vm-slots";

/// One of the machine-wide guest slots; released when dropped.
pub struct VmSlot {
    _file: File,
    pub index: usize,
}

impl VmSlot {
    /// How many slots there are: [`VM_SLOTS`], or fewer with
    /// `CRUST_TEST_VM_SLOTS`.
    pub fn limit() -> usize {
        std::env::var("CRUST_TEST_VM_SLOTS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(VM_SLOTS)
            .clamp(1, VM_SLOTS)
    }

    /// Blocks until a slot is free.
    pub fn acquire() -> VmSlot {
        let slots = VmSlot::limit();
        std::fs::create_dir_all(SLOT_DIR).expect("create vm slot dir");
        loop {
            for index in 0..slots {
                let path = Path::new(SLOT_DIR).join(format!("slot-{index}.lock"));
                let file = OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path)
                    .expect("open vm slot lock");
                if flock(&file, FlockOperation::NonBlockingLockExclusive).is_ok() {
                    return VmSlot { _file: file, index };
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// The workspace root (two levels above this crate's manifest).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("workspace root")
        .to_path_buf()
}

/// Where `guest/build-image.sh` leaves the kernel and initramfs.
/// `CRUST_GUEST_DIR` overrides the default `<workspace>/target/guest-image`.
pub fn guest_image_dir() -> PathBuf {
    std::env::var_os("CRUST_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/guest-image"))
}

/// Kernel and initramfs paths; panics with the command to run when missing,
/// because a test that needs a guest cannot say anything useful without one.
pub fn guest_image() -> (PathBuf, PathBuf) {
    let dir = guest_image_dir();
    let kernel = dir.join("vmlinuz");
    let initrd = dir.join("initramfs.cpio.gz");
    assert!(
        kernel.is_file() && initrd.is_file(),
        "guest image missing in {}: run guest/build-image.sh first",
        dir.display()
    );
    (kernel, initrd)
}

/// Builds the guest image with `guest/build-image.sh` when it is missing
/// (CI builds it before the tests; a stale image is not detected here:
/// rerun the script after changing the agent). One build at a time across
/// all test processes. The nested cargo build gets its own target dir, as
/// the outer `cargo test` may hold the lock on the usual one.
pub fn ensure_guest_image() {
    let dir = guest_image_dir();
    let ready = || dir.join("vmlinuz").is_file() && dir.join("initramfs.cpio.gz").is_file();
    if ready() {
        return;
    }
    std::fs::create_dir_all(SLOT_DIR).expect("create vm slot dir");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(Path::new(SLOT_DIR).join("image-build.lock"))
        .expect("open image build lock");
    flock(&lock, FlockOperation::LockExclusive).expect("lock image build");
    if ready() {
        return;
    }
    let root = workspace_root();
    let status = std::process::Command::new(root.join("guest/build-image.sh"))
        .arg("--out")
        .arg(&dir)
        .env("CARGO_TARGET_DIR", root.join("target/guest-agent-build"))
        .stdin(std::process::Stdio::null())
        .status()
        .expect("run guest/build-image.sh");
    assert!(status.success(), "guest/build-image.sh failed");
}

/// Panics unless running as root: the real-device tests need loop devices
/// and mounts, and skipping them silently would hide missing coverage.
pub fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test needs root (loop devices, mounts)"
    );
}

/// `len` pseudo-random bytes from `seed`, not 0 (xorshift): data no
/// shifted or truncated copy of itself matches, without a dependency.
pub fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

/// A test that cannot run without an outside tool (csi-sanity, critest)
/// calls this when the tool is missing: under `CI=true` (what
/// scripts/test.sh sets) that fails the test, since CI lays the tools out
/// and a skip there would hide lost coverage; elsewhere the test says it
/// skipped and why.
pub fn missing_tool(what: &str) {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    assert!(!ci, "{what} (CI=true: a missing tool fails the test)");
    eprintln!("SKIPPED: {what}");
}

/// Kills and reaps a child process when dropped, so a failing test leaves
/// no daemon or QEMU behind.
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    pub fn new(child: Child) -> Self {
        ChildGuard(Some(child))
    }

    pub fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("child already taken")
    }

    /// The child's pid (0 once taken).
    pub fn child_id(&self) -> u32 {
        self.0.as_ref().map_or(0, Child::id)
    }

    /// Hands the child back without killing it.
    pub fn into_inner(mut self) -> Child {
        self.0.take().expect("child already taken")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The path of a binary built from this workspace, for tests of one crate
/// that drive another crate's binary (Cargo only sets `CARGO_BIN_EXE_*` for
/// the crate's own binaries). Looks next to the running test executable.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/test-xxxx -> target/<profile>/<name>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target profile dir");
    let path = profile_dir.join(name);
    assert!(
        path.is_file(),
        "{} not built: run `cargo build --workspace --bins` first",
        path.display()
    );
    path
}
