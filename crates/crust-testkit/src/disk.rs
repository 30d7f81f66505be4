//! Loop-backed test disks on top of crust-blockdev's guards, so every test
//! crate gets the same sparse-file + attach + mkfs + mount setup and the
//! same cleanup on drop (also when the test panics).

use std::path::{Path, PathBuf};

use crust_blockdev::{AttachOptions, FsType, LoopGuard, MountGuard};
use tempfile::TempDir;

/// A sparse file attached to a loop device, optionally formatted. The
/// device is detached on drop; drop every mount of it (and stop every VM
/// using it) first, as a mounted or open device is not detached.
#[derive(Debug)]
pub struct LoopDisk {
    dev: LoopGuard,
    file: PathBuf,
}

impl LoopDisk {
    /// Creates `file` as a sparse file of `size` bytes (truncating an
    /// existing one) and attaches it to a free loop device.
    pub fn new(file: impl Into<PathBuf>, size: u64) -> LoopDisk {
        let file = file.into();
        std::fs::File::create(&file)
            .and_then(|f| f.set_len(size))
            .unwrap_or_else(|e| panic!("create {}: {e}", file.display()));
        let dev = LoopGuard::attach(&file, AttachOptions::default())
            .unwrap_or_else(|e| panic!("attach {}: {e}", file.display()));
        LoopDisk { dev, file }
    }

    /// [`LoopDisk::new`], then a fresh `fstype` filesystem on the device
    /// (`crust_blockdev::mkfs`).
    pub fn with_fs(file: impl Into<PathBuf>, size: u64, fstype: FsType) -> LoopDisk {
        let disk = LoopDisk::new(file, size);
        crust_blockdev::mkfs(disk.dev(), fstype)
            .unwrap_or_else(|e| panic!("mkfs {fstype} on {}: {e}", disk.dev().display()));
        disk
    }

    /// The device node, `/dev/loopN`.
    pub fn dev(&self) -> &Path {
        self.dev.path()
    }

    pub fn dev_str(&self) -> &str {
        self.dev().to_str().expect("loop device path is UTF-8")
    }

    /// The backing file, as given.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// The filesystem on the device, as its superblock says (so a disk
    /// formatted by other means than [`LoopDisk::with_fs`] mounts too).
    pub fn fstype(&self) -> FsType {
        let found = crust_blockdev::probe_fs(self.dev())
            .unwrap_or_else(|e| panic!("probe {}: {e}", self.dev().display()));
        found
            .fs_type()
            .unwrap_or_else(|| panic!("{} holds no ext4/xfs: {found}", self.dev().display()))
    }

    /// Grows the backing file only (what a CSI plugin does before asking
    /// the runtime to expand); the device keeps its old size.
    pub fn grow_file(&self, size: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&self.file)
            .and_then(|f| f.set_len(size))
            .unwrap_or_else(|e| panic!("grow {}: {e}", self.file.display()));
    }

    /// Re-reads the backing file's size into the device; returns it.
    pub fn refresh_capacity(&self) -> u64 {
        crust_blockdev::refresh_capacity(self.dev())
            .unwrap_or_else(|e| panic!("refresh capacity of {}: {e}", self.dev().display()))
    }

    /// Grows the backing file and makes the device see the new size.
    pub fn grow(&self, size: u64) {
        self.grow_file(size);
        let now = self.refresh_capacity();
        assert_eq!(now, size, "{} did not take the new size", self.dev_str());
    }

    /// Mounts the filesystem at `target` (created if missing); unmounted
    /// when the guard drops.
    pub fn mount(&self, target: &Path, options: &[&str], readonly: bool) -> MountGuard {
        std::fs::create_dir_all(target)
            .unwrap_or_else(|e| panic!("create {}: {e}", target.display()));
        let options: Vec<String> = options.iter().map(|o| o.to_string()).collect();
        let dev = self.dev();
        MountGuard::mount_fs(dev, target, self.fstype(), &options, readonly)
            .unwrap_or_else(|e| panic!("mount {} on {}: {e}", dev.display(), target.display()))
    }

    /// Mounts the filesystem on a fresh temp dir; unmounted, then the dir
    /// removed, on drop.
    pub fn mount_temp(&self, options: &[&str], readonly: bool) -> TempMount {
        let dir = tempfile::tempdir().expect("temp mount dir");
        let guard = self.mount(dir.path(), options, readonly);
        TempMount { guard, _dir: dir }
    }

    /// Mounts the filesystem on the host for the duration of `f` (test setup
    /// and verification); the unmount must succeed.
    pub fn with_host_mount<R>(&self, readonly: bool, f: impl FnOnce(&Path) -> R) -> R {
        let m = self.mount_temp(&[], readonly);
        let r = f(m.path());
        m.unmount();
        r
    }
}

/// A mount on its own temp dir. Fields drop in order: the mount, then the
/// directory.
#[derive(Debug)]
pub struct TempMount {
    guard: MountGuard,
    _dir: TempDir,
}

impl TempMount {
    pub fn path(&self) -> &Path {
        self.guard.target()
    }

    /// Unmounts now, panicking if that fails.
    pub fn unmount(self) {
        let TempMount { guard, _dir } = self;
        let target = guard.target().to_path_buf();
        guard
            .unmount()
            .unwrap_or_else(|e| panic!("unmount {}: {e}", target.display()));
    }
}

/// Detaches, when dropped, every loop device whose backing file lies under
/// a directory (a pool's images): what a failing test leaves attached.
pub struct LoopsUnder(pub PathBuf);

impl Drop for LoopsUnder {
    fn drop(&mut self) {
        if let Ok(loops) = crust_blockdev::list_loops() {
            for l in loops
                .into_iter()
                .filter(|l| l.backing_file.starts_with(&self.0))
            {
                let _ = LoopGuard::adopt_path(&l.path);
            }
        }
    }
}
