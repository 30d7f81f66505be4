//! Volume operations: mount by virtio serial, stats and health, online
//! growth, unmount.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_agent_proto::{
    AgentError, ErrorCode, FsGroupPolicy, FsType, GUEST_VOLUME_ROOT, GrowVolumeReply, MountVolume,
    MountVolumeReply, ThawVolumeReply, Usage, VolumeCondition, VolumeStats,
};
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::mount::UnmountFlags;

use crate::options::{self, OptionError};
use crate::process;
use crate::sys::{self, Detected};
use crust_fs::GrowTarget;
use crust_fsgroup::FsGroupError;

/// How long MountVolume waits for a disk that is not there yet (hot-plug),
/// within the caller's deadline. Under TCG on a loaded host the guest's
/// PCIe hot-plug has taken more than 10 s (the node soak, at load 9 on two
/// cores); under KVM it takes milliseconds.
const DISK_WAIT: Duration = Duration::from_secs(30);

/// How long a grow waits for the guest kernel to see the host's new disk
/// size before growing to whatever it sees (the host then reports the
/// shortfall).
const RESIZE_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error(transparent)]
    FreezeLimit(#[from] crust_agent_proto::FreezeLimitError),
    #[error("invalid volume name {0:?}: use 1-128 characters from [A-Za-z0-9._-], not '.' or '..'")]
    InvalidName(String),
    #[error("invalid serial {0:?}: use 1-20 characters from [A-Za-z0-9_-]")]
    InvalidSerial(String),
    #[error(transparent)]
    Options(#[from] OptionError),
    #[error("no virtio disk with serial {serial:?} is attached (disks seen: {seen})")]
    NoDisk { serial: String, seen: String },
    #[error("volume {volume:?} is already mounted from disk serial {mounted:?}, not {serial:?}")]
    SerialMismatch {
        volume: String,
        mounted: String,
        serial: String,
    },
    #[error("volume {volume:?} is already mounted {mounted}; unmount it to change that")]
    ModeMismatch {
        volume: String,
        mounted: &'static str,
    },
    #[error("disk serial {serial:?} (/dev/{disk}) is already mounted at {at}")]
    DiskInUse {
        serial: String,
        disk: String,
        at: String,
    },
    #[error(
        "disk serial {serial:?} (/dev/{disk}) is attached read-only; mount it with readonly: true"
    )]
    DiskReadOnly { serial: String, disk: String },
    #[error("disk serial {serial:?} (/dev/{disk}) holds {found}, not {want}")]
    WrongFs {
        serial: String,
        disk: String,
        found: String,
        want: FsType,
    },
    #[error(
        "{tool} found errors it could not fix on /dev/{disk} (exit {code}): {output}; repair the volume offline"
    )]
    Fsck {
        /// The filesystem's preen program (e2fsck).
        tool: &'static str,
        disk: String,
        code: i32,
        output: String,
    },
    #[error("mounting /dev/{disk} ({fstype}) at {target} failed: {errno}{hint}")]
    MountFailed {
        disk: String,
        fstype: FsType,
        target: String,
        errno: Errno,
        hint: String,
    },
    #[error("volume {0:?} is not mounted")]
    NotMounted(String),
    #[error(transparent)]
    FsGroup(#[from] FsGroupError),
    #[error("volume {0:?} is mounted read-only and cannot be grown")]
    ReadOnly(String),
    #[error("growing volume {volume:?} with {tool} failed: {detail}")]
    Grow {
        volume: String,
        tool: &'static str,
        detail: String,
    },
    #[error("volume {volume:?} is busy ({errno}): {detail}")]
    Busy {
        volume: String,
        errno: Errno,
        detail: String,
    },
    #[error("{op} {path}: {errno}")]
    Io {
        op: &'static str,
        path: String,
        errno: Errno,
    },
    #[error("{0}")]
    Deadline(String),
    #[error("{0}")]
    FsSupport(String),
}

impl From<VolumeError> for AgentError {
    fn from(e: VolumeError) -> AgentError {
        use VolumeError::*;
        let code = match &e {
            InvalidName(_) | InvalidSerial(_) | Options(_) | FreezeLimit(_) => {
                ErrorCode::InvalidArgument
            }
            NoDisk { .. } | NotMounted(_) => ErrorCode::NotFound,
            SerialMismatch { .. } | DiskInUse { .. } | ModeMismatch { .. } => {
                ErrorCode::AlreadyExists
            }
            DiskReadOnly { .. } | WrongFs { .. } | Fsck { .. } | ReadOnly(_) | Busy { .. } => {
                ErrorCode::FailedPrecondition
            }
            MountFailed { errno, .. } if *errno == Errno::INVAL => ErrorCode::InvalidArgument,
            MountFailed { errno, .. } if *errno == Errno::ROFS || *errno == Errno::ACCESS => {
                ErrorCode::FailedPrecondition
            }
            FsGroup(FsGroupError::Deadline { .. }) | Deadline(_) => ErrorCode::DeadlineExceeded,
            MountFailed { .. } | FsGroup(_) | Grow { .. } | Io { .. } | FsSupport(_) => {
                ErrorCode::Internal
            }
        };
        AgentError::new(code, e.to_string())
    }
}

/// What the agent remembers about a mounted volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRecord {
    pub serial: String,
    /// Kernel disk name, e.g. `vdb`.
    pub disk: String,
    /// The disk's sysfs node (inode of `/sys/block/<disk>`) when the serial
    /// was read. While it is the same node the disk is the same device, so
    /// stats need not ask the device for its serial again (a virtio request,
    /// costly in an emulated guest); a new node, or none, means reading it.
    pub disk_node: Option<u64>,
    pub fstype: FsType,
    /// Read-only was requested (so a read-only mount is not a fault).
    pub readonly: bool,
    /// The mount this record was made for. While `statx` on the mount
    /// point reports the same one, the record stands without reading the
    /// mount table (costly in an emulated guest, and every stats poll
    /// looks the volume up).
    pub mount: Option<sys::MountIdentity>,
}

pub fn validate_name(volume: &str) -> Result<(), VolumeError> {
    let ok = !volume.is_empty()
        && volume.len() <= 128
        && volume != "."
        && volume != ".."
        && volume
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(VolumeError::InvalidName(volume.into()))
    }
}

fn validate_serial(serial: &str) -> Result<(), VolumeError> {
    let ok = !serial.is_empty()
        && serial.len() <= 20
        && serial
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(VolumeError::InvalidSerial(serial.into()))
    }
}

/// `/run/crust/volumes/<volume>`.
/// The disk's size once the guest kernel sees at least `want` bytes (a
/// resize reaches the guest as an asynchronous config change), or what it
/// sees when the wait runs out (at most [`RESIZE_WAIT`], or the deadline);
/// None when the size cannot be read.
fn wait_for_size(disk: &str, want: Option<u64>, deadline: Option<Instant>) -> Option<u64> {
    let until = Instant::now() + RESIZE_WAIT;
    let until = deadline.map_or(until, |d| d.min(until));
    loop {
        let seen = sys::disk_bytes(disk)?;
        if want.is_none_or(|w| seen >= w) || Instant::now() >= until {
            return Some(seen);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Makes the guest's root mount shared: a guest-rooted container (the
/// runtime CLI's workload) holds a slave copy of it, so a volume mounted
/// below [`GUEST_VOLUME_ROOT`] after the container started (a hot-plug)
/// is there too. Idempotent (the agent may be restarted).
pub fn share_root() -> rustix::io::Result<()> {
    rustix::mount::mount_change("/", rustix::mount::MountPropagationFlags::SHARED)
}

pub fn mount_path(volume: &str) -> PathBuf {
    Path::new(GUEST_VOLUME_ROOT).join(volume)
}

fn io(op: &'static str, path: &Path, errno: Errno) -> VolumeError {
    VolumeError::Io {
        op,
        path: path.display().to_string(),
        errno,
    }
}

fn disk_of_source(source: &str) -> Option<String> {
    source.strip_prefix("/dev/").map(str::to_owned)
}

/// One freeze: its number and the watchdog's wake-up.
type Freeze = (u64, std::sync::mpsc::Sender<()>);

#[derive(Default)]
pub struct Volumes {
    records: Mutex<HashMap<String, VolumeRecord>>,
    /// Volumes frozen for a host-side copy: the freeze's number (a
    /// time-limit thaw of an old freeze never undoes a newer one) and how
    /// to wake its watchdog when the host thaws first.
    frozen: Arc<Mutex<HashMap<String, Freeze>>>,
    freezes: std::sync::atomic::AtomicU64,
    /// Freezes the time limit ended (reported by the next thaw).
    expired: Arc<Mutex<std::collections::HashSet<String>>>,
}

impl Volumes {
    /// The record for `volume`, rebuilt from the mount table if this agent
    /// did not mount it (agent restarted).
    pub fn lookup(&self, volume: &str) -> Option<VolumeRecord> {
        let target = mount_path(volume);
        // Cloned out so the statx runs without the lock held.
        let cached = self.records.lock().expect("records").get(volume).cloned();
        if let Some(r) = cached
            && r.mount.is_some()
            && r.mount == sys::mount_identity(&target)
        {
            return Some(r);
        }
        let entry = sys::mount_at(&target)?;
        if let Some(r) = self.records.lock().expect("records").get_mut(volume) {
            r.mount = Some(entry.identity);
            return Some(r.clone());
        }
        let disk = disk_of_source(&entry.source)?;
        let fstype = FsType::parse(&entry.fstype)?;
        // The node first: a device replaced in between then fails the
        // node check, and its serial is read again.
        let disk_node = sys::disk_node(&disk);
        let rec = VolumeRecord {
            serial: sys::disk_serial(&disk).unwrap_or_default(),
            disk_node,
            readonly: entry.is_readonly(),
            disk,
            fstype,
            mount: Some(entry.identity),
        };
        self.records
            .lock()
            .expect("records")
            .insert(volume.into(), rec.clone());
        Some(rec)
    }

    /// Names of every mounted volume.
    pub fn mounted(&self) -> Vec<String> {
        let root = Path::new(GUEST_VOLUME_ROOT);
        let mut out: Vec<String> = sys::mounts()
            .into_iter()
            .filter(|m| m.mount_point.parent() == Some(root))
            .filter_map(|m| {
                m.mount_point
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// A retry of a mount that happened: the same disk and mode are
    /// success (fsGroup re-applied so a failed walk completes), anything
    /// else is refused.
    fn mounted_already(
        &self,
        req: &MountVolume,
        entry: sys::MountEntry,
        opts: &options::ParsedOptions,
        target: &Path,
        deadline: Option<Instant>,
    ) -> Result<MountVolumeReply, VolumeError> {
        let policy = req.fs_group_policy.unwrap_or(FsGroupPolicy::Always);
        let disk = disk_of_source(&entry.source).unwrap_or_default();
        let mounted = sys::disk_serial(&disk).unwrap_or_default();
        if mounted != req.serial {
            return Err(VolumeError::SerialMismatch {
                volume: req.volume.clone(),
                mounted,
                serial: req.serial.clone(),
            });
        }
        let was_readonly = self
            .lookup(&req.volume)
            .map_or(entry.is_readonly(), |r| r.readonly);
        if was_readonly != opts.readonly {
            return Err(VolumeError::ModeMismatch {
                volume: req.volume.clone(),
                mounted: if was_readonly {
                    "read-only"
                } else {
                    "read-write"
                },
            });
        }
        // Same volume, same disk: done already. fsGroup is re-applied
        // so a retry after a failed walk completes it.
        let mut applied = false;
        if let Some(gid) = req.fs_group
            && !entry.is_readonly()
        {
            applied = crust_fsgroup::apply(target, gid, fsgroup_policy(policy), deadline)?;
        }
        self.lookup(&req.volume);
        Ok(MountVolumeReply {
            mount_path: target.display().to_string(),
            device: entry.source,
            fs_group_applied: applied,
        })
    }

    /// Mounts a volume's disk (found by serial) at its guest path after
    /// every check that can refuse it, then applies fsGroup. A volume
    /// mounted already is answered from its mount (idempotent).
    pub fn mount(
        &self,
        req: &MountVolume,
        deadline: Option<Instant>,
    ) -> Result<MountVolumeReply, VolumeError> {
        validate_name(&req.volume)?;
        validate_serial(&req.serial)?;
        let opts = options::parse(req.fstype, &req.options, req.readonly)?;
        let target = mount_path(&req.volume);
        let policy = req.fs_group_policy.unwrap_or(FsGroupPolicy::Always);

        if let Some(entry) = sys::mount_at(&target) {
            return self.mounted_already(req, entry, &opts, &target, deadline);
        }

        let (disk, disk_node) = find_disk(req, deadline)?;
        let dev = disk.dev_path();
        check_disk(req, &disk, &opts)?;
        preen(req, &disk, &opts, deadline)?;
        mount_disk(req, &disk, &opts, &target)?;
        let mount = sys::mount_identity(&target);
        self.records.lock().expect("records").insert(
            req.volume.clone(),
            VolumeRecord {
                serial: req.serial.clone(),
                disk_node,
                disk: disk.name.clone(),
                fstype: req.fstype,
                readonly: opts.readonly,
                mount,
            },
        );
        let mut applied = false;
        if let Some(gid) = req.fs_group
            && !opts.readonly
        {
            applied = crust_fsgroup::apply(&target, gid, fsgroup_policy(policy), deadline)?;
        }
        Ok(MountVolumeReply {
            mount_path: target.display().to_string(),
            device: dev.display().to_string(),
            fs_group_applied: applied,
        })
    }

    pub fn stat(&self, volume: &str) -> Result<VolumeStats, VolumeError> {
        validate_name(volume)?;
        let rec = self
            .lookup(volume)
            .ok_or_else(|| VolumeError::NotMounted(volume.into()))?;
        let target = mount_path(volume);
        let mut problems: Vec<String> = Vec::new();
        // The flags of the same statvfs tell a read-only mount or
        // superblock (what the kernel sets after an error), so the mount
        // table is not read (costly in an emulated guest).
        let mut read_only = false;
        let (bytes, inodes) = match rustix::fs::statvfs(target.as_path()) {
            Ok(s) => {
                read_only = s.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY);
                let frsize = s.f_frsize;
                (
                    Usage {
                        total: s.f_blocks * frsize,
                        used: s.f_blocks.saturating_sub(s.f_bfree) * frsize,
                        available: s.f_bavail * frsize,
                    },
                    Usage {
                        total: s.f_files,
                        used: s.f_files.saturating_sub(s.f_ffree),
                        available: s.f_ffree,
                    },
                )
            }
            Err(e) => {
                problems.push(format!(
                    "statfs on the volume failed ({e}): the filesystem has shut down or the disk is failing; \
                     stop the pod and repair the volume offline"
                ));
                (Usage::default(), Usage::default())
            }
        };
        let same_device = rec.disk_node.is_some() && sys::disk_node(&rec.disk) == rec.disk_node;
        if !same_device && sys::disk_serial(&rec.disk).as_deref() != Some(rec.serial.as_str()) {
            problems.push(format!(
                "disk serial {:?} (was /dev/{}) is no longer attached to the VM; the volume cannot be read \
                 or written until it is re-attached and the pod restarted",
                rec.serial, rec.disk
            ));
        }
        if read_only && !rec.readonly {
            problems.push(format!(
                "filesystem on /dev/{} was remounted read-only by the kernel although it was mounted \
                 read-write (usually after an I/O or metadata error); check the guest kernel log and \
                 repair the volume offline",
                rec.disk
            ));
        }
        if rec.fstype == FsType::Ext4 {
            let base = Path::new("/sys/fs/ext4").join(&rec.disk);
            let count: u64 = sys::read_attr(base.join("errors_count"))
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            if count > 0 {
                let func = sys::read_attr(base.join("last_error_func")).unwrap_or_default();
                problems.push(format!(
                    "ext4 on /dev/{} has recorded {count} error(s){}; run e2fsck on the volume offline",
                    rec.disk,
                    if func.is_empty() {
                        String::new()
                    } else {
                        format!(" (last in {func})")
                    }
                ));
            }
        }
        // A read probe: XFS (and ext4 after an abort) fail readdir with EIO
        // once shut down, without writing anything to the volume.
        if let Err(e) = probe_readdir(&target) {
            problems.push(format!(
                "reading the volume root failed ({e}): the filesystem has shut down or the disk is \
                 failing; stop the pod and repair the volume offline (e2fsck / xfs_repair)"
            ));
        }
        let condition = if problems.is_empty() {
            VolumeCondition {
                abnormal: false,
                message: format!("volume is mounted from /dev/{} and healthy", rec.disk),
            }
        } else {
            VolumeCondition {
                abnormal: true,
                message: problems.join("; "),
            }
        };
        Ok(VolumeStats {
            bytes,
            inodes,
            condition,
        })
    }

    pub fn grow(
        &self,
        volume: &str,
        want_bytes: Option<u64>,
        deadline: Option<Instant>,
    ) -> Result<GrowVolumeReply, VolumeError> {
        validate_name(volume)?;
        let rec = self
            .lookup(volume)
            .ok_or_else(|| VolumeError::NotMounted(volume.into()))?;
        let target = mount_path(volume);
        if sys::mount_at(&target).is_some_and(|m| m.is_readonly()) {
            return Err(VolumeError::ReadOnly(volume.into()));
        }
        let device_bytes =
            wait_for_size(&rec.disk, want_bytes, deadline).ok_or_else(|| VolumeError::Grow {
                volume: volume.into(),
                tool: "sysfs",
                detail: format!("cannot read the size of /dev/{} (disk detached?)", rec.disk),
            })?;
        let spec = rec.fstype.spec();
        let tool = spec.grow.program;
        let args = process::fs_tool_command(
            &spec.grow,
            match spec.grow_target {
                GrowTarget::Device => format!("/dev/{}", rec.disk),
                GrowTarget::MountPoint => target.display().to_string(),
            },
        );
        let left = deadline.map_or(Duration::from_secs(600), |d| {
            d.saturating_duration_since(Instant::now())
        });
        let out = process::run(&args, &[], left, 64 * 1024).map_err(|e| match e {
            process::RunError::Timeout { .. } => VolumeError::Deadline(format!("{tool}: {e}")),
            e => VolumeError::Grow {
                volume: volume.into(),
                tool,
                detail: e.to_string(),
            },
        })?;
        if !spec.grow.ok.contains(&out.code) {
            return Err(VolumeError::Grow {
                volume: volume.into(),
                tool,
                detail: format!("exit {}: {}", out.code, out.text()),
            });
        }
        let s = rustix::fs::statvfs(target.as_path()).map_err(|e| io("statfs", &target, e))?;
        Ok(GrowVolumeReply {
            device_bytes,
            fs_total_bytes: s.f_blocks * s.f_frsize,
        })
    }

    /// FIFREEZE of a mounted volume, thawed by a watchdog thread after
    /// `max_frozen` unless [`Volumes::thaw`] comes first.
    pub fn freeze(&self, volume: &str, max_frozen_ms: u64) -> Result<(), VolumeError> {
        // Checked here too: the host's doors may be older than this agent.
        let max_frozen = crust_agent_proto::freeze_limit(max_frozen_ms)?;
        validate_name(volume)?;
        self.lookup(volume)
            .ok_or_else(|| VolumeError::NotMounted(volume.into()))?;
        let target = mount_path(volume);
        let mut frozen = self.frozen.lock().expect("frozen");
        if frozen.contains_key(volume) {
            return Err(VolumeError::Busy {
                volume: volume.into(),
                errno: Errno::BUSY,
                detail: "it is already frozen for another copy".into(),
            });
        }
        let dir = rustix::fs::open(
            target.as_path(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io("open", &target, e))?;
        sys::freeze_fs(&dir).map_err(|e| io("FIFREEZE", &target, e))?;
        // No descriptor stays open on the volume (it would block unmount).
        drop(dir);
        let n = self
            .freezes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let (wake, woken) = std::sync::mpsc::channel::<()>();
        frozen.insert(volume.to_string(), (n, wake));
        self.expired.lock().expect("expired").remove(volume);
        drop(frozen);
        let (frozen, expired, name) = (
            self.frozen.clone(),
            self.expired.clone(),
            volume.to_string(),
        );
        std::thread::spawn(move || {
            if woken.recv_timeout(max_frozen) != Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                return;
            }
            let mut f = frozen.lock().expect("frozen");
            if f.get(&name).map(|(m, _)| *m) != Some(n) {
                return;
            }
            f.remove(&name);
            let target = mount_path(&name);
            let thawed = rustix::fs::open(
                target.as_path(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .and_then(|dir| sys::thaw_fs(&dir));
            if let Err(e) = thawed {
                eprintln!("crust-agent: thawing {name} after the time limit: {e}");
            }
            expired.lock().expect("expired").insert(name);
        });
        Ok(())
    }

    /// FITHAW of a volume [`Volumes::freeze`] froze.
    pub fn thaw(&self, volume: &str) -> Result<ThawVolumeReply, VolumeError> {
        validate_name(volume)?;
        let mut frozen = self.frozen.lock().expect("frozen");
        let Some((_, wake)) = frozen.remove(volume) else {
            let expired = self.expired.lock().expect("expired").remove(volume);
            return Ok(ThawVolumeReply {
                was_frozen: false,
                expired,
            });
        };
        let _ = wake.send(());
        let target = mount_path(volume);
        let dir = rustix::fs::open(
            target.as_path(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io("open", &target, e))?;
        sys::thaw_fs(&dir).map_err(|e| io("FITHAW", &target, e))?;
        Ok(ThawVolumeReply {
            was_frozen: true,
            expired: false,
        })
    }

    /// Syncs and unmounts; not mounted is success. The caller makes sure
    /// no container binds it still.
    pub fn unmount(&self, volume: &str) -> Result<(), VolumeError> {
        validate_name(volume)?;
        let target = mount_path(volume);
        while sys::mount_at(&target).is_some() {
            if let Ok(fd) = rustix::fs::open(
                target.as_path(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                let _ = rustix::fs::syncfs(&fd);
            }
            match rustix::mount::unmount(target.as_path(), UnmountFlags::empty()) {
                Ok(()) => {}
                Err(Errno::BUSY) => {
                    return Err(VolumeError::Busy {
                        volume: volume.into(),
                        errno: Errno::BUSY,
                        detail: "files are open or something is mounted inside it".into(),
                    });
                }
                Err(Errno::INVAL) => break,
                Err(e) => return Err(io("umount", &target, e)),
            }
        }
        self.records.lock().expect("records").remove(volume);
        match std::fs::remove_dir(&target) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(
                "rmdir",
                &target,
                Errno::from_io_error(&e).unwrap_or(Errno::IO),
            )),
        }
    }
}

/// The volume's disk, waited for by serial, and its sysfs node (None when
/// the disk was replaced meanwhile).
fn find_disk(
    req: &MountVolume,
    deadline: Option<Instant>,
) -> Result<(sys::Disk, Option<u64>), VolumeError> {
    // Give up a little before the caller's deadline so the NotFound
    // answer arrives instead of a client-side timeout.
    let until = deadline.map_or(Instant::now() + DISK_WAIT, |d| {
        d.checked_sub(Duration::from_millis(300))
            .unwrap_or(d)
            .min(Instant::now() + DISK_WAIT)
    });
    let disk = sys::wait_for_disk(&req.serial, until).map_err(|seen| VolumeError::NoDisk {
        serial: req.serial.clone(),
        seen: if seen.is_empty() {
            "none".into()
        } else {
            seen.iter()
                .map(|d| format!("{}={:?}", d.name, d.serial))
                .collect::<Vec<_>>()
                .join(", ")
        },
    })?;
    // The node, then the serial once more: a device replaced since
    // wait_for_disk read it gets no node, so stats read its serial.
    let disk_node = sys::disk_node(&disk.name)
        .filter(|_| sys::disk_serial(&disk.name).as_deref() == Some(req.serial.as_str()));
    Ok((disk, disk_node))
}

/// Refuses a disk mounted elsewhere, a read-only disk for a read-write
/// mount, and one without the filesystem asked for.
fn check_disk(
    req: &MountVolume,
    disk: &sys::Disk,
    opts: &options::ParsedOptions,
) -> Result<(), VolumeError> {
    let dev = disk.dev_path();
    if let Some(m) = sys::mounts()
        .into_iter()
        .find(|m| m.source == dev.to_string_lossy())
    {
        return Err(VolumeError::DiskInUse {
            serial: req.serial.clone(),
            disk: disk.name.clone(),
            at: m.mount_point.display().to_string(),
        });
    }
    if !opts.readonly && sys::disk_readonly(&disk.name) {
        return Err(VolumeError::DiskReadOnly {
            serial: req.serial.clone(),
            disk: disk.name.clone(),
        });
    }
    sys::ensure_filesystem(req.fstype).map_err(VolumeError::FsSupport)?;
    match sys::detect_fs(&dev)
        .map_err(|e| io("read", &dev, Errno::from_io_error(&e).unwrap_or(Errno::IO)))?
    {
        Detected::Fs(found) if found == req.fstype => Ok(()),
        Detected::Fs(found) => Err(VolumeError::WrongFs {
            serial: req.serial.clone(),
            disk: disk.name.clone(),
            found: format!("an {found} filesystem"),
            want: req.fstype,
        }),
        Detected::Unknown => Err(VolumeError::WrongFs {
            serial: req.serial.clone(),
            disk: disk.name.clone(),
            found: format!(
                "no {} filesystem (unformatted?)",
                FsType::supported_alternatives()
            ),
            want: req.fstype,
        }),
    }
}

/// Like kubelet: preen before a read-write mount (ext4: e2fsck -p; 1 and
/// 2 = fixed, 4 and above = not). A filesystem without a preen step, or a
/// read-only mount, is left as it is.
fn preen(
    req: &MountVolume,
    disk: &sys::Disk,
    opts: &options::ParsedOptions,
    deadline: Option<Instant>,
) -> Result<(), VolumeError> {
    let (Some(preen), false) = (&req.fstype.spec().preen, opts.readonly) else {
        return Ok(());
    };
    let args = process::fs_tool_command(preen, disk.dev_path().to_string_lossy().into_owned());
    let left = deadline.map_or(Duration::from_secs(300), |d| {
        d.saturating_duration_since(Instant::now())
    });
    let out = process::run(&args, &[], left, 64 * 1024).map_err(|e| VolumeError::Fsck {
        tool: preen.program,
        disk: disk.name.clone(),
        code: -1,
        output: e.to_string(),
    })?;
    if !preen.ok.contains(&out.code) {
        return Err(VolumeError::Fsck {
            tool: preen.program,
            disk: disk.name.clone(),
            code: out.code,
            output: out.text(),
        });
    }
    Ok(())
}

/// Creates the mount point and mounts the disk there; a refused mount
/// removes the mount point again and says what the kernel logged.
fn mount_disk(
    req: &MountVolume,
    disk: &sys::Disk,
    opts: &options::ParsedOptions,
    target: &Path,
) -> Result<(), VolumeError> {
    std::fs::create_dir_all(target).map_err(|e| {
        io(
            "mkdir",
            target,
            Errno::from_io_error(&e).unwrap_or(Errno::IO),
        )
    })?;
    let data = std::ffi::CString::new(opts.data.clone()).expect("validated options have no NUL");
    if let Err(errno) = rustix::mount::mount(
        disk.dev_path().as_path(),
        target,
        req.fstype.as_str(),
        opts.flags,
        (!opts.data.is_empty()).then_some(data.as_c_str()),
    ) {
        let _ = std::fs::remove_dir(target);
        let kmsg = sys::kmsg_tail(&[disk.name.as_str()], 3);
        let hint = if kmsg.is_empty() {
            String::new()
        } else {
            format!(" (kernel: {})", kmsg.join(" / "))
        };
        return Err(VolumeError::MountFailed {
            disk: disk.name.clone(),
            fstype: req.fstype,
            target: target.display().to_string(),
            errno,
            hint,
        });
    }
    Ok(())
}

/// The wire policy as the ownership walk spells it.
fn fsgroup_policy(p: FsGroupPolicy) -> crust_fsgroup::FsGroupPolicy {
    match p {
        FsGroupPolicy::Always => crust_fsgroup::FsGroupPolicy::Always,
        FsGroupPolicy::OnRootMismatch => crust_fsgroup::FsGroupPolicy::OnRootMismatch,
    }
}

fn probe_readdir(dir: &Path) -> Result<(), Errno> {
    let fd = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut d = rustix::fs::Dir::new(fd)?;
    match d.read() {
        Some(Err(e)) => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_serials() {
        for ok in ["pvc-1", "a", "A.b_c-9", &"x".repeat(128)] {
            assert!(validate_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(129), "ä"] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
        assert!(validate_serial("crust-0123456789abcd").is_ok());
        assert!(validate_serial("crust-0123456789abcde").is_err());
        assert!(validate_serial("a.b").is_err());
        assert!(validate_serial("").is_err());
    }

    /// Out of range is refused before the volume is even looked up (an
    /// unknown volume here would otherwise answer NOT_FOUND).
    #[test]
    fn freeze_out_of_range_is_invalid_argument() {
        let v = Volumes::default();
        for ms in [0, crust_agent_proto::MAX_FROZEN_MS + 1, u64::MAX] {
            let e = AgentError::from(v.freeze("v1", ms).unwrap_err());
            assert_eq!(e.code, ErrorCode::InvalidArgument, "{ms}: {e}");
            assert!(e.message.contains("600000"), "{e}");
        }
        let e = AgentError::from(v.freeze("v1", 1000).unwrap_err());
        assert_eq!(e.code, ErrorCode::NotFound, "{e}");
    }

    #[test]
    fn error_codes() {
        let c = |e: VolumeError| AgentError::from(e).code;
        assert_eq!(
            c(VolumeError::InvalidName("x/".into())),
            ErrorCode::InvalidArgument
        );
        assert_eq!(
            c(VolumeError::NoDisk {
                serial: "s".into(),
                seen: "none".into()
            }),
            ErrorCode::NotFound
        );
        assert_eq!(
            c(VolumeError::MountFailed {
                disk: "vdb".into(),
                fstype: FsType::Xfs,
                target: "/t".into(),
                errno: Errno::INVAL,
                hint: String::new()
            }),
            ErrorCode::InvalidArgument
        );
        assert_eq!(c(VolumeError::NotMounted("v".into())), ErrorCode::NotFound);
    }
}
