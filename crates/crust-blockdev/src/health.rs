//! Cheap health signals for CSI `VolumeCondition`.
//!
//! Every probe here only reads kernel state (mountinfo, sysfs) or does one
//! small operation on the volume (`statvfs`, reading one directory entry,
//! a 4 KiB read). A hung filesystem can still block those forever, so
//! callers should use [`fs_health_with_timeout`] or [`with_timeout`].

use std::io;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

use crate::{device, mount, sys};

/// Timeout callers should use unless they have a reason not to.
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// Condition of a volume; maps onto CSI `VolumeCondition` (v1.12) and
/// `VolumeHealth` (v1.13).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Ok,
    /// Something is wrong: what kind of thing, and a message that says
    /// what and what to do.
    Abnormal(Symptom),
}

/// What a probe found wrong. The kind lets callers classify the problem
/// (e.g. as a CSI health status) without reading the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Symptom {
    pub kind: SymptomKind,
    pub message: String,
}

/// The causes a probe can tell apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SymptomKind {
    /// Nothing is mounted where the volume should be.
    NotMounted,
    /// Another filesystem is mounted over the volume's mount point.
    MountedOver,
    /// The block device node is gone or is no block device.
    DeviceMissing,
    /// The device has size 0 (lost its backing store).
    DeviceEmpty,
    /// Reading the device fails.
    DeviceUnreadable,
    /// The filesystem's superblock is read-only although read-write was
    /// expected (the kernel's reaction to an error, or an administrator).
    FilesystemReadOnly,
    /// This mount point was remounted read-only.
    MountReadOnly,
    /// The filesystem recorded errors (ext4 `errors_count`).
    FilesystemErrors,
    /// The filesystem answers I/O errors (an XFS shutdown, a failed device).
    FilesystemIoErrors,
    /// A probe did not finish in time (hung I/O).
    Unresponsive,
    /// The probe itself could not run (mount table unreadable, thread
    /// start failed, ...): nothing is known about the volume.
    ProbeFailed,
}

impl SymptomKind {
    /// A short CamelCase name, stable for machines (CSI's `reason`).
    pub fn reason(self) -> &'static str {
        match self {
            SymptomKind::NotMounted => "NotMounted",
            SymptomKind::MountedOver => "MountedOver",
            SymptomKind::DeviceMissing => "DeviceMissing",
            SymptomKind::DeviceEmpty => "DeviceEmpty",
            SymptomKind::DeviceUnreadable => "DeviceUnreadable",
            SymptomKind::FilesystemReadOnly => "FilesystemReadOnly",
            SymptomKind::MountReadOnly => "MountReadOnly",
            SymptomKind::FilesystemErrors => "FilesystemErrors",
            SymptomKind::FilesystemIoErrors => "FilesystemIoErrors",
            SymptomKind::Unresponsive => "Unresponsive",
            SymptomKind::ProbeFailed => "HealthProbeFailed",
        }
    }
}

impl Health {
    fn abnormal(kind: SymptomKind, message: String) -> Health {
        Health::Abnormal(Symptom { kind, message })
    }

    pub fn is_ok(&self) -> bool {
        matches!(self, Health::Ok)
    }

    /// The message of an abnormal result; empty when healthy.
    pub fn message(&self) -> &str {
        match self {
            Health::Ok => "",
            Health::Abnormal(s) => &s.message,
        }
    }

    /// `(abnormal, message)` as CSI wants them; the message is empty when
    /// healthy.
    pub fn to_condition(&self) -> (bool, String) {
        (!self.is_ok(), self.message().to_string())
    }
}

/// Runs `probe` on a separate thread and waits at most `timeout` for it.
///
/// On timeout returns `Abnormal("health probe timed out after …")`. The
/// probe thread cannot be cancelled: it is left running (leaked) and its
/// result dropped when it finishes. A thread stuck in uninterruptible I/O
/// on a dead device may never finish, so a caller polling a dead volume
/// periodically leaks one thread per poll; keep the poll rate modest.
pub fn with_timeout<F>(timeout: Duration, probe: F) -> Health
where
    F: FnOnce() -> Health + Send + 'static,
{
    let (tx, rx) = mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name("crust-health-probe".into())
        .spawn(move || {
            let _ = tx.send(probe());
        });
    if let Err(e) = spawned {
        return Health::abnormal(
            SymptomKind::ProbeFailed,
            format!("could not start health probe: {e}"),
        );
    }
    match rx.recv_timeout(timeout) {
        Ok(h) => h,
        Err(mpsc::RecvTimeoutError::Timeout) => Health::abnormal(
            SymptomKind::Unresponsive,
            format!(
                "health probe timed out after {:.1}s: the filesystem or device is not responding (hung I/O?)",
                timeout.as_secs_f64()
            ),
        ),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Health::abnormal(SymptomKind::ProbeFailed, "health probe panicked".into())
        }
    }
}

/// [`fs_health`] under [`with_timeout`].
pub fn fs_health_with_timeout(
    dev: &Path,
    mountpoint: &Path,
    expected_ro: bool,
    timeout: Duration,
) -> Health {
    let (dev, mp) = (dev.to_path_buf(), mountpoint.to_path_buf());
    with_timeout(timeout, move || fs_health(&dev, &mp, expected_ro))
}

fn read_sysfs(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

fn is_eio(e: &io::Error) -> bool {
    sys::errno(e) == Some(Errno::IO)
}

/// Health of the filesystem of block device `dev` mounted at `mountpoint`
/// (a staging path, or a publish path bind-mounted from it). Checks, in
/// order, stopping at the first problem:
///
/// 1. a mount exists at `mountpoint` (from mountinfo);
/// 2. it is the filesystem of `dev` (major:minor match) and `dev` still
///    exists;
/// 3. it is not read-only when `expected_ro` is false: a read-only
///    superblock means the kernel remounted it after an error (or an
///    admin did); a read-only mount over a writable superblock means
///    someone remounted this mount point;
/// 4. ext4: `/sys/fs/ext4/<dev>/errors_count` is zero;
/// 5. `statvfs` works (XFS answers `EIO` once it has shut down);
/// 6. the mount point can be listed (one directory entry is read).
///
/// Never modifies anything. May block on a hung filesystem (steps 5-6):
/// use [`fs_health_with_timeout`].
pub fn fs_health(dev: &Path, mountpoint: &Path, expected_ro: bool) -> Health {
    let d = dev.display();
    let mp = mountpoint.display();
    let entry = match mount::find_mount(mountpoint) {
        Ok(Some(e)) => e,
        Ok(None) => {
            return Health::abnormal(
                SymptomKind::NotMounted,
                format!(
                    "volume is not mounted at {mp} (expected {d}); it was unmounted outside of the CSI driver: unpublish and publish again"
                ),
            );
        }
        Err(e) => {
            return Health::abnormal(
                SymptomKind::ProbeFailed,
                format!("cannot read the mount table: {e}"),
            );
        }
    };
    let (major, minor) = match device::device_major_minor(dev) {
        Ok(n) => n,
        Err(e) if e.is_not_found() => {
            return Health::abnormal(
                SymptomKind::DeviceMissing,
                format!(
                    "device {d} behind {mp} no longer exists (detached or removed); the data may be unreachable"
                ),
            );
        }
        Err(e) => {
            return Health::abnormal(
                SymptomKind::ProbeFailed,
                format!("cannot inspect device {d}: {e}"),
            );
        }
    };
    if (entry.major, entry.minor) != (major, minor) {
        return Health::abnormal(
            SymptomKind::MountedOver,
            format!(
                "{mp} has {} ({}:{}) mounted, not the volume's device {d} ({major}:{minor}); something was mounted over it",
                entry.source, entry.major, entry.minor
            ),
        );
    }
    let devname = device::sysfs_name_of(major, minor).unwrap_or_else(|_| entry.source.clone());
    if !expected_ro && let Some(h) = read_only_symptom(&entry, dev, mountpoint) {
        return h;
    }
    if let Some(h) = error_count_symptom(&entry, dev, &devname) {
        return h;
    }
    if let Err(e) = rustix::fs::statvfs(mountpoint) {
        let e = io::Error::from(e);
        if is_eio(&e) {
            return Health::abnormal(
                SymptomKind::FilesystemIoErrors,
                format!(
                    "{} on {d} returns I/O errors (statfs on {mp}): the filesystem has shut down or the device failed; unmount it and run {}",
                    entry.fs_type,
                    repair_tool(&entry.fs_type)
                ),
            );
        }
        return Health::abnormal(
            SymptomKind::ProbeFailed,
            format!("statfs on {mp} failed: {e}"),
        );
    }
    match std::fs::read_dir(mountpoint).and_then(|mut it| it.next().transpose()) {
        Ok(_) => Health::Ok,
        Err(e) if is_eio(&e) => Health::abnormal(
            SymptomKind::FilesystemIoErrors,
            format!(
                "reading {mp} fails with an I/O error: the {} filesystem on {d} has shut down or the device failed; unmount it and run {}",
                entry.fs_type,
                repair_tool(&entry.fs_type)
            ),
        ),
        Err(e) => Health::abnormal(SymptomKind::ProbeFailed, format!("cannot read {mp}: {e}")),
    }
}

/// Step 3 of [`fs_health`] for a mount expected read-write: the
/// filesystem or the mount read-only.
fn read_only_symptom(entry: &mount::MountEntry, dev: &Path, mountpoint: &Path) -> Option<Health> {
    let d = dev.display();
    let mp = mountpoint.display();
    if entry.super_read_only() {
        let errors = entry.super_option("errors").unwrap_or("default");
        return Some(Health::abnormal(
            SymptomKind::FilesystemReadOnly,
            format!(
                "filesystem on {d} ({}) is read-only although read-write was expected: the kernel remounts it read-only after an I/O or corruption error (errors={errors}), or an administrator remounted it; check the kernel log and run fsck after unpublishing",
                entry.fs_type
            ),
        ));
    }
    if entry.is_read_only() {
        return Some(Health::abnormal(
            SymptomKind::MountReadOnly,
            format!(
                "mount {mp} of {d} was remounted read-only although read-write was expected; unpublish and publish again"
            ),
        ));
    }
    None
}

/// Step 4 of [`fs_health`]: errors the kernel counted on the filesystem.
fn error_count_symptom(entry: &mount::MountEntry, dev: &Path, devname: &str) -> Option<Health> {
    let d = dev.display();
    if let Some(counter) = error_count(&entry.fs_type)
        && let Some(count) =
            read_sysfs(&counter.count_path(devname)).and_then(|s| s.parse::<u64>().ok())
        && count > 0
    {
        let func = read_sysfs(&counter.first_func_path(devname))
            .filter(|s| !s.is_empty())
            .map(|f| format!(", first in {f}"))
            .unwrap_or_default();
        return Some(Health::abnormal(
            SymptomKind::FilesystemErrors,
            format!(
                "{} on {d} has recorded {count} error(s){func}; the filesystem may be corrupted: run {} after unpublishing",
                entry.fs_type,
                repair_tool(&entry.fs_type)
            ),
        ));
    }
    None
}

/// Health of the filesystem that holds `path` (e.g. a pool directory of
/// backing files): the filesystem answers (no EIO), is not read-only, and
/// (ext4) has recorded no errors. Unlike [`fs_health`] the path need not
/// be a mount point and no particular device is expected. May block on a
/// hung filesystem: wrap in [`with_timeout`].
pub fn containing_fs_health(path: &Path) -> Health {
    let p = path.display();
    let st = match rustix::fs::stat(path) {
        Ok(st) => st,
        Err(e) if e == Errno::IO => {
            return Health::abnormal(
                SymptomKind::FilesystemIoErrors,
                format!("the filesystem holding {p} answers I/O errors (stat)"),
            );
        }
        Err(e) => {
            return Health::abnormal(
                SymptomKind::ProbeFailed,
                format!("cannot stat {p}: {}", io::Error::from(e)),
            );
        }
    };
    let (major, minor) = (rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev));
    let mounts = match mount::mount_info() {
        Ok(m) => m,
        Err(e) => {
            return Health::abnormal(
                SymptomKind::ProbeFailed,
                format!("cannot read the mount table: {e}"),
            );
        }
    };
    if let Some(entry) = mounts.iter().find(|m| (m.major, m.minor) == (major, minor)) {
        if entry.super_read_only() {
            return Health::abnormal(
                SymptomKind::FilesystemReadOnly,
                format!(
                    "the {} filesystem holding {p} ({}) is read-only",
                    entry.fs_type, entry.source
                ),
            );
        }
        if let Some(counter) = error_count(&entry.fs_type)
            && let Ok(name) = device::sysfs_name_of(major, minor)
            && let Some(count) =
                read_sysfs(&counter.count_path(&name)).and_then(|s| s.parse::<u64>().ok())
            && count > 0
        {
            return Health::abnormal(
                SymptomKind::FilesystemErrors,
                format!(
                    "the {} filesystem holding {p} ({}) has recorded {count} error(s); run {}",
                    entry.fs_type,
                    entry.source,
                    repair_tool(&entry.fs_type)
                ),
            );
        }
    }
    match rustix::fs::statvfs(path) {
        Ok(v) if v.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY) => Health::abnormal(
            SymptomKind::MountReadOnly,
            format!("{p} lies on a read-only mount"),
        ),
        Ok(_) => Health::Ok,
        Err(e) if e == Errno::IO => Health::abnormal(
            SymptomKind::FilesystemIoErrors,
            format!("the filesystem holding {p} answers I/O errors (statfs)"),
        ),
        Err(e) => Health::abnormal(
            SymptomKind::ProbeFailed,
            format!("statfs on {p} failed: {}", io::Error::from(e)),
        ),
    }
}

/// The repair command for a mounted filesystem named as the mount table
/// does: its [`crust_fs::FsSpec::repair`], `fsck` for any other.
/// Where the kernel counts errors of a mounted `fs` (crust-fs's spec).
fn error_count(fs: &str) -> Option<crust_fs::ErrorCount> {
    crate::FsType::parse(fs).and_then(|f| f.spec().error_count)
}

fn repair_tool(fs: &str) -> &'static str {
    crate::FsType::parse(fs).map_or("fsck", |f| f.spec().repair)
}

/// Health of a raw block volume: the node exists, is a block device, and
/// its first 4 KiB can be read with `O_DIRECT` (so a dead device or a
/// loop device whose backing file has become unreadable shows up). May
/// block on a hung device: wrap in [`with_timeout`].
pub fn device_health(dev: &Path) -> Health {
    let d = dev.display();
    if !dev.exists() {
        return Health::abnormal(
            SymptomKind::DeviceMissing,
            format!("device {d} no longer exists (detached or removed)"),
        );
    }
    if !device::is_block_device(dev) {
        return Health::abnormal(
            SymptomKind::DeviceMissing,
            format!("{d} is not a block device"),
        );
    }
    let fd = match rustix::fs::open(
        dev,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::DIRECT,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(e) => {
            return Health::abnormal(
                SymptomKind::DeviceUnreadable,
                format!("cannot open {d}: {}", io::Error::from(e)),
            );
        }
    };
    match device::size_of_fd(&fd, dev) {
        Ok(0) => {
            return Health::abnormal(
                SymptomKind::DeviceEmpty,
                format!("device {d} has size 0: it is no longer attached to its backing store"),
            );
        }
        Ok(_) => {}
        Err(e) => {
            return Health::abnormal(
                SymptomKind::DeviceUnreadable,
                format!("cannot read the size of {d}: {e}"),
            );
        }
    }
    let mut buf = sys::AlignedBuf::new(sys::DIRECT_ALIGN);
    match sys::pread_full(&fd, buf.as_mut_slice(), 0) {
        Ok(_) => Health::Ok,
        Err(e) => Health::abnormal(
            SymptomKind::DeviceUnreadable,
            format!("reading {d} fails ({e}): the device or its backing store has failed"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn repair_hints() {
        assert_eq!(repair_tool("xfs"), "xfs_repair");
        assert_eq!(repair_tool("ext4"), "fsck");
        assert_eq!(repair_tool("vfat"), "fsck");
    }

    #[test]
    fn timeout_wrapper_returns_quickly() {
        let start = Instant::now();
        let h = with_timeout(Duration::from_millis(100), || {
            std::thread::sleep(Duration::from_secs(30));
            Health::Ok
        });
        assert!(
            matches!(&h, Health::Abnormal(s) if s.message.contains("timed out after 0.1s")
                && s.kind == SymptomKind::Unresponsive),
            "{h:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn timeout_wrapper_passes_result_through() {
        let x = || Health::abnormal(SymptomKind::ProbeFailed, "x".into());
        assert_eq!(with_timeout(Duration::from_secs(5), x), x());
        assert_eq!(
            with_timeout(Duration::from_secs(5), || Health::Ok),
            Health::Ok
        );
    }

    #[test]
    fn unmounted_path_is_abnormal() {
        let dir = tempfile::tempdir().unwrap();
        let h = fs_health(Path::new("/dev/null"), dir.path(), false);
        assert!(
            matches!(&h, Health::Abnormal(s) if s.message.contains("not mounted")
                && s.kind == SymptomKind::NotMounted),
            "{h:?}"
        );
    }
}
