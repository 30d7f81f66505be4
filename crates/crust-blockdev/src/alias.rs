//! "No other device exposes this data": before a device goes to a guest
//! or to a host mount, every other block device on the node that reads
//! and writes the same bytes is found, so two kernels never cache and
//! write one filesystem.
//!
//! `O_EXCL` and sysfs `holders/` see only claims on the device itself.
//! They miss:
//!
//! * another loop device bound to the same backing file (any host tool's
//!   `losetup -f <file>`), or to a hard link of it, or bound in another
//!   mount namespace, or to a file since deleted. Loops are compared by
//!   the identity `LOOP_GET_STATUS64` reports (`lo_device`, `lo_inode`:
//!   the backing inode), never by the sysfs path, which misses all of
//!   these. Their partitions (`loopMp*`) are named too;
//! * a loop device whose backing file is the device itself (a loop
//!   stacked on it): its `lo_rdevice` is the device's number, whatever
//!   node it was opened through;
//! * kernel holders (device-mapper, md) of the device or its partitions.
//!
//! Any overlap counts: a loop on the same file at another offset is still
//! refused (conservative; such setups are not crust's).
//!
//! Cost: one `/sys/block` listing plus, per loop device, an open, one
//! ioctl and a close of its node; no per-device sysfs file is read on that
//! path, as a sysfs lookup costs more than the ioctl. It runs at stage,
//! claim and hot-plug time, and on a stats poll at most once per volume
//! per `crust_sandbox::alias_watch::ALIAS_RESCAN` (30 s); `tests/bench.rs`
//! measures it with 1,000 loops attached.
//! The scan is bounded by [`ALIAS_SCAN_LIMIT`] and fails closed. A loop
//! device unbound or removed while it is scanned is no alias.
//!
//! [`find_aliases_in`] takes the sysfs root and the loop query as
//! arguments, so the holder and partition branches (no device-mapper or
//! md on the test kernels) are tested on a fixture directory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::sys;

/// Upper bound of one scan; past it the check fails (closed).
pub const ALIAS_SCAN_LIMIT: Duration = Duration::from_secs(5);
/// At most this many aliases are named in a message.
const NAMED_MAX: usize = 8;

/// `major:minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct DevNum {
    pub major: u32,
    pub minor: u32,
}

impl DevNum {
    /// From a `st_dev`/`st_rdev` as `stat` returns it.
    pub fn from_stat(dev: u64) -> DevNum {
        DevNum {
            major: rustix::fs::major(dev),
            minor: rustix::fs::minor(dev),
        }
    }

    /// From the kernel's `huge_encode_dev` form (`loop_info64` fields).
    pub fn from_kernel(dev: u64) -> DevNum {
        DevNum {
            major: ((dev & 0xf_ff00) >> 8) as u32,
            minor: ((dev & 0xff) | ((dev >> 12) & 0xf_ff00)) as u32,
        }
    }

    fn parse(s: &str) -> Option<DevNum> {
        let (a, b) = s.trim().split_once(':')?;
        Some(DevNum {
            major: a.parse().ok()?,
            minor: b.parse().ok()?,
        })
    }
}

impl std::fmt::Display for DevNum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// What a bound loop device reads: its backing file's inode and, for a
/// block device as backing file, that device's number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopBacking {
    /// Filesystem holding the backing inode (`lo_device`).
    pub dev: DevNum,
    /// `lo_inode`.
    pub ino: u64,
    /// `lo_rdevice`; `None` for a regular file.
    pub rdev: Option<DevNum>,
}

/// The answer about one loop device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoopQuery {
    Bound(LoopBacking),
    /// Not bound (any more), or gone.
    Unbound,
    /// Could not be asked; `String` says why.
    Failed(String),
}

/// What must have no alias.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AliasTarget {
    /// A block device by kernel name (`loop3`, `loop3p1`, `vdb`).
    Device(String),
    /// A regular file (a VM image): loops bound to it are its aliases.
    File { dev: DevNum, ino: u64 },
}

/// Why a device exposes the same data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AliasKind {
    /// A loop bound to the same backing inode.
    SameBackingFile { dev: DevNum, ino: u64 },
    /// A loop backed by the same block device the target's loop reads.
    SameBackingDevice { rdev: DevNum },
    /// A loop whose backing file is `of` (the target, or a partition or
    /// the whole disk of it).
    StackedOn { of: String },
    /// A kernel holder (device-mapper, md) of `of`.
    Holder { of: String },
    /// A partition of `disk`, which is an alias for `why`.
    PartitionOf { disk: String, why: Box<AliasKind> },
    /// A bound loop that could not be asked what it reads.
    Unidentified { reason: String },
}

impl AliasKind {
    fn phrase(&self) -> String {
        match self {
            AliasKind::SameBackingFile { dev, ino } => {
                format!("is bound to the same backing file (inode {ino} on {dev})")
            }
            AliasKind::SameBackingDevice { rdev } => {
                format!("is backed by the same block device ({rdev})")
            }
            AliasKind::StackedOn { of } => format!("is a loop device backed by /dev/{of} itself"),
            AliasKind::Holder { of } => {
                format!("holds /dev/{of} (a stacked kernel device: device-mapper, md)")
            }
            AliasKind::PartitionOf { disk, why } => {
                format!("is a partition of /dev/{disk}, which {}", why.phrase())
            }
            AliasKind::Unidentified { reason } => {
                format!("is a bound loop device that could not be identified ({reason})")
            }
        }
    }
}

/// Another block device exposing (some of) the same data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alias {
    /// Kernel name (`loop7`, `loop7p1`, `dm-0`).
    pub name: String,
    pub kind: AliasKind,
}

impl std::fmt::Display for Alias {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "/dev/{} {}", self.name, self.kind.phrase())
    }
}

/// Why a device with aliases is refused, or why that could not be told.
#[derive(Debug, thiserror::Error)]
pub enum AliasError {
    #[error(
        "device {} is not the only device exposing its data: {}; refusing to {action}",
        device.display(), list(aliases)
    )]
    Found {
        device: PathBuf,
        aliases: Vec<Alias>,
        action: &'static str,
    },
    #[error(
        "cannot tell whether another device exposes the data of {}: {reason}; refusing to {action}",
        device.display()
    )]
    Unknown {
        device: PathBuf,
        reason: String,
        action: &'static str,
    },
}

fn list(aliases: &[Alias]) -> String {
    let mut s = aliases
        .iter()
        .take(NAMED_MAX)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    if aliases.len() > NAMED_MAX {
        s.push_str(&format!(" (and {} more)", aliases.len() - NAMED_MAX));
    }
    s
}

/// Refuses `device` (a block device node or a regular file) when another
/// block device exposes its data; see the module doc. `action` completes
/// the message ("refusing to {action}").
pub fn ensure_no_aliases(device: &Path, action: &'static str) -> Result<(), AliasError> {
    ensure_no_aliases_but(device, action, &mut |_| false).map(drop)
}

/// [`ensure_no_aliases`], except for the aliases `keep` accepts, which
/// are returned (a caller that accepts one holds it too). Any other alias
/// still refuses the device, all of them named.
pub fn ensure_no_aliases_but(
    device: &Path,
    action: &'static str,
    keep: &mut dyn FnMut(&Alias) -> bool,
) -> Result<Vec<Alias>, AliasError> {
    let unknown = |reason: String| AliasError::Unknown {
        device: device.to_path_buf(),
        reason,
        action,
    };
    let st = rustix::fs::stat(device).map_err(|e| unknown(e.to_string()))?;
    let target = match FileType::from_raw_mode(st.st_mode) {
        FileType::BlockDevice => {
            let num = DevNum::from_stat(st.st_rdev);
            let name = crate::device::sysfs_name_of(num.major, num.minor)
                .map_err(|e| unknown(format!("/sys/dev/block/{num}: {e}")))?;
            AliasTarget::Device(name)
        }
        FileType::RegularFile => AliasTarget::File {
            dev: DevNum::from_stat(st.st_dev),
            ino: st.st_ino,
        },
        _ => return Err(unknown("neither a block device nor a regular file".into())),
    };
    let aliases = find_aliases_in(
        Path::new("/sys"),
        &target,
        &mut query_loop,
        Instant::now() + ALIAS_SCAN_LIMIT,
    )
    .map_err(unknown)?;
    let (kept, others): (Vec<Alias>, Vec<Alias>) = aliases.into_iter().partition(|a| keep(a));
    if others.is_empty() {
        return Ok(kept);
    }
    Err(AliasError::Found {
        device: device.to_path_buf(),
        aliases: others,
        action,
    })
}

/// Every other device exposing `target`'s data, from the sysfs tree at
/// `sysfs` and `query` (what a loop device reads, by kernel name). `Err`
/// when the scan cannot be completed by `deadline` or sysfs cannot be
/// read.
pub fn find_aliases_in(
    sysfs: &Path,
    target: &AliasTarget,
    query: &mut dyn FnMut(&str) -> LoopQuery,
    deadline: Instant,
) -> Result<Vec<Alias>, String> {
    let class = sysfs.join("class/block");
    let mut out = Vec::new();
    // The devices whose data is the target's: the target, its partitions
    // and, for a partition, its disk. Holders of and loops on any of them
    // are aliases.
    let mut sources: Vec<(String, DevNum)> = Vec::new();
    // The target's own loop (it or its disk) and what it reads.
    let mut own_loop: Option<String> = None;
    let mut backing: Option<LoopBacking> = None;
    match target {
        AliasTarget::File { dev, ino } => {
            backing = Some(LoopBacking {
                dev: *dev,
                ino: *ino,
                rdev: None,
            })
        }
        AliasTarget::Device(name) => {
            let dir = class.join(name);
            let num = read_devnum(&dir)
                .ok_or_else(|| format!("cannot read {}", dir.join("dev").display()))?;
            sources.push((name.clone(), num));
            let disk = if dir.join("partition").exists() {
                let disk = disk_of(&dir)
                    .ok_or_else(|| format!("cannot tell the disk of {}", dir.display()))?;
                if let Some(n) = read_devnum(&class.join(&disk)) {
                    sources.push((disk.clone(), n));
                }
                disk
            } else {
                for p in partitions(&dir, name) {
                    if let Some(n) = read_devnum(&dir.join(&p)) {
                        sources.push((p, n));
                    }
                }
                name.clone()
            };
            if is_loop_name(&disk) {
                match query(&disk) {
                    LoopQuery::Bound(b) => backing = Some(b),
                    LoopQuery::Unbound => {}
                    LoopQuery::Failed(why) => return Err(format!("{disk}: {why}")),
                }
                own_loop = Some(disk);
            }
        }
    }
    for (name, _) in &sources {
        for h in list_dir(&class.join(name).join("holders")) {
            out.push(Alias {
                name: h,
                kind: AliasKind::Holder { of: name.clone() },
            });
        }
    }

    let block = sysfs.join("block");
    let entries = std::fs::read_dir(&block).map_err(|e| format!("{}: {e}", block.display()))?;
    for ent in entries {
        if Instant::now() > deadline {
            return Err(format!(
                "the scan of loop devices took longer than {ALIAS_SCAN_LIMIT:?}"
            ));
        }
        let Ok(ent) = ent else { continue };
        let Ok(name) = ent.file_name().into_string() else {
            continue;
        };
        if !is_loop_name(&name) || own_loop.as_deref() == Some(name.as_str()) {
            continue;
        }
        let dir = block.join(&name);
        let kind = match query(&name) {
            LoopQuery::Unbound => continue,
            // Unbound or removed during the scan (only a bound loop device
            // has `loop/`): no alias.
            LoopQuery::Failed(_) if !dir.join("loop").exists() => continue,
            LoopQuery::Failed(reason) => Some(AliasKind::Unidentified { reason }),
            LoopQuery::Bound(b) => alias_kind(&b, backing.as_ref(), &sources),
        };
        let Some(kind) = kind else { continue };
        for p in partitions(&dir, &name) {
            out.push(Alias {
                name: p,
                kind: AliasKind::PartitionOf {
                    disk: name.clone(),
                    why: Box::new(kind.clone()),
                },
            });
        }
        out.push(Alias { name, kind });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Whether a loop reading `b` exposes the target's data.
fn alias_kind(
    b: &LoopBacking,
    target: Option<&LoopBacking>,
    sources: &[(String, DevNum)],
) -> Option<AliasKind> {
    if let Some(t) = target {
        if (b.dev, b.ino) == (t.dev, t.ino) {
            return Some(AliasKind::SameBackingFile {
                dev: b.dev,
                ino: b.ino,
            });
        }
        if let (Some(r), Some(tr)) = (b.rdev, t.rdev)
            && r == tr
        {
            return Some(AliasKind::SameBackingDevice { rdev: r });
        }
    }
    let r = b.rdev?;
    sources
        .iter()
        .find(|(_, n)| *n == r)
        .map(|(of, _)| AliasKind::StackedOn { of: of.clone() })
}

fn is_loop_name(name: &str) -> bool {
    name.strip_prefix("loop")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()))
}

fn read_devnum(dir: &Path) -> Option<DevNum> {
    DevNum::parse(&std::fs::read_to_string(dir.join("dev")).ok()?)
}

fn list_dir(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Partitions of the disk whose sysfs directory is `dir`: subdirectories
/// named after it with a `partition` file.
fn partitions(dir: &Path, disk: &str) -> Vec<String> {
    list_dir(dir)
        .into_iter()
        .filter(|n| n.starts_with(disk) && n != disk && dir.join(n).join("partition").exists())
        .collect()
}

/// The disk of a partition: the parent of its sysfs directory.
fn disk_of(dir: &Path) -> Option<String> {
    let real = std::fs::canonicalize(dir).ok()?;
    Some(real.parent()?.file_name()?.to_str()?.to_owned())
}

/// Asks the loop device `name` (`loopN`) what it reads, through its node
/// in `/dev`.
fn query_loop(name: &str) -> LoopQuery {
    let path = format!("/dev/{name}");
    let fd = match rustix::fs::open(
        path.as_str(),
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        // Removed meanwhile (or its node not here): the caller tells by sysfs.
        Err(e) => return LoopQuery::Failed(format!("opening {path}: {e}")),
    };
    match crust_sys::loopdev::get_status(&fd) {
        // A stale node (another device's number) must not answer for
        // loopN: the kernel's own index says which loop answered.
        Ok(info) if name[4..].parse() != Ok(info.lo_number) => LoopQuery::Failed(format!(
            "{path} answers as loop{}: a stale device node",
            info.lo_number
        )),
        Ok(info) => LoopQuery::Bound(LoopBacking {
            dev: DevNum::from_kernel(info.lo_device),
            ino: info.lo_inode,
            rdev: (info.lo_rdevice != 0).then(|| DevNum::from_kernel(info.lo_rdevice)),
        }),
        Err(e) if sys::errno(&e) == Some(Errno::NXIO) => LoopQuery::Unbound,
        Err(e) => LoopQuery::Failed(format!("LOOP_GET_STATUS64 on {path}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs-shaped fixture: `class/block/NAME` links into
    /// `devices/virtual/block`, whole disks also under `block/`.
    struct Fixture(tempfile::TempDir);

    impl Fixture {
        fn new() -> Fixture {
            let t = tempfile::tempdir().unwrap();
            for d in ["class/block", "block", "devices/virtual/block"] {
                std::fs::create_dir_all(t.path().join(d)).unwrap();
            }
            Fixture(t)
        }

        fn root(&self) -> &Path {
            self.0.path()
        }

        fn disk(&self, name: &str, num: &str, bound: bool) -> PathBuf {
            let real = self.root().join("devices/virtual/block").join(name);
            std::fs::create_dir_all(real.join("holders")).unwrap();
            std::fs::write(real.join("dev"), format!("{num}\n")).unwrap();
            if bound {
                std::fs::create_dir(real.join("loop")).unwrap();
            }
            let rel = PathBuf::from("../../devices/virtual/block").join(name);
            std::os::unix::fs::symlink(&rel, self.root().join("class/block").join(name)).unwrap();
            std::os::unix::fs::symlink(
                PathBuf::from("../devices/virtual/block").join(name),
                self.root().join("block").join(name),
            )
            .unwrap();
            real
        }

        fn partition(&self, disk: &str, name: &str, num: &str) -> PathBuf {
            let real = self
                .root()
                .join("devices/virtual/block")
                .join(disk)
                .join(name);
            std::fs::create_dir_all(real.join("holders")).unwrap();
            std::fs::write(real.join("dev"), format!("{num}\n")).unwrap();
            std::fs::write(real.join("partition"), "1\n").unwrap();
            let rel = PathBuf::from("../../devices/virtual/block")
                .join(disk)
                .join(name);
            std::os::unix::fs::symlink(&rel, self.root().join("class/block").join(name)).unwrap();
            real
        }

        fn hold(&self, dev_dir: &Path, holder: &str) {
            std::fs::create_dir(dev_dir.join("holders").join(holder)).unwrap();
        }

        fn scan(
            &self,
            target: AliasTarget,
            q: &[(&str, LoopQuery)],
        ) -> Result<Vec<String>, String> {
            let mut query = |name: &str| {
                q.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, a)| a.clone())
                    .unwrap_or(LoopQuery::Unbound)
            };
            find_aliases_in(
                self.root(),
                &target,
                &mut query,
                Instant::now() + ALIAS_SCAN_LIMIT,
            )
            .map(|v| v.iter().map(ToString::to_string).collect())
        }
    }

    fn file(ino: u64) -> LoopQuery {
        LoopQuery::Bound(LoopBacking {
            dev: DevNum { major: 8, minor: 1 },
            ino,
            rdev: None,
        })
    }

    fn blockdev(major: u32, minor: u32) -> LoopQuery {
        LoopQuery::Bound(LoopBacking {
            dev: DevNum { major: 0, minor: 5 },
            ino: 99,
            rdev: Some(DevNum { major, minor }),
        })
    }

    fn dev(name: &str) -> AliasTarget {
        AliasTarget::Device(name.into())
    }

    #[test]
    fn kernel_holders_of_the_device_and_its_partitions_are_aliases() {
        let f = Fixture::new();
        let vdb = f.disk("vdb", "252:16", false);
        let part = f.partition("vdb", "vdb1", "252:17");
        f.hold(&vdb, "md0");
        f.hold(&part, "dm-0");
        let found = f.scan(dev("vdb"), &[]).unwrap();
        assert_eq!(
            found,
            [
                "/dev/dm-0 holds /dev/vdb1 (a stacked kernel device: device-mapper, md)",
                "/dev/md0 holds /dev/vdb (a stacked kernel device: device-mapper, md)",
            ]
        );
        // Through the partition: its own holder, and its disk's.
        let found = f.scan(dev("vdb1"), &[]).unwrap();
        assert_eq!(found.len(), 2, "{found:?}");
    }

    #[test]
    fn no_holder_no_loop_is_no_alias() {
        let f = Fixture::new();
        f.disk("vdb", "252:16", false);
        f.disk("loop0", "7:0", false);
        assert_eq!(f.scan(dev("vdb"), &[]).unwrap(), Vec::<String>::new());
    }

    #[test]
    fn same_backing_inode_and_its_partitions_are_named() {
        let f = Fixture::new();
        f.disk("loop3", "7:3", true);
        f.disk("loop7", "7:7", true);
        f.partition("loop7", "loop7p1", "259:0");
        f.disk("loop8", "7:8", true);
        let found = f
            .scan(
                dev("loop3"),
                &[
                    ("loop3", file(1234)),
                    ("loop7", file(1234)),
                    ("loop8", file(55)),
                ],
            )
            .unwrap();
        assert_eq!(
            found,
            [
                "/dev/loop7 is bound to the same backing file (inode 1234 on 8:1)",
                "/dev/loop7p1 is a partition of /dev/loop7, which is bound to the same \
                 backing file (inode 1234 on 8:1)",
            ]
        );
    }

    #[test]
    fn loops_stacked_on_the_device_or_its_partition_are_aliases() {
        let f = Fixture::new();
        f.disk("vdb", "252:16", false);
        f.partition("vdb", "vdb1", "252:17");
        f.disk("loop1", "7:1", true);
        f.disk("loop2", "7:2", true);
        f.disk("loop4", "7:4", true);
        let q = [
            ("loop1", blockdev(252, 16)),
            ("loop2", blockdev(252, 17)),
            ("loop4", blockdev(252, 32)),
        ];
        let found = f.scan(dev("vdb"), &q).unwrap();
        assert_eq!(
            found,
            [
                "/dev/loop1 is a loop device backed by /dev/vdb itself",
                "/dev/loop2 is a loop device backed by /dev/vdb1 itself",
            ]
        );
    }

    #[test]
    fn a_regular_file_is_aliased_by_a_loop_bound_to_it() {
        let f = Fixture::new();
        f.disk("loop5", "7:5", true);
        let target = AliasTarget::File {
            dev: DevNum { major: 8, minor: 1 },
            ino: 77,
        };
        assert!(
            f.scan(target.clone(), &[("loop5", file(78))])
                .unwrap()
                .is_empty()
        );
        assert_eq!(f.scan(target, &[("loop5", file(77))]).unwrap().len(), 1);
    }

    #[test]
    fn vanished_loops_are_skipped_and_unidentifiable_ones_named() {
        let f = Fixture::new();
        f.disk("loop3", "7:3", true);
        let gone = f.disk("loop6", "7:6", true);
        f.disk("loop9", "7:9", true);
        let failed = LoopQuery::Failed("EIO".into());
        // loop6 unbound while scanned: its `loop/` is gone too.
        std::fs::remove_dir(gone.join("loop")).unwrap();
        let found = f
            .scan(
                dev("loop3"),
                &[
                    ("loop3", file(1)),
                    ("loop6", failed.clone()),
                    ("loop9", failed),
                ],
            )
            .unwrap();
        assert_eq!(
            found,
            ["/dev/loop9 is a bound loop device that could not be identified (EIO)"]
        );
    }

    #[test]
    fn a_late_scan_fails_closed() {
        let f = Fixture::new();
        f.disk("loop3", "7:3", true);
        f.disk("loop4", "7:4", true);
        let mut q = |_: &str| file(1);
        let past = Instant::now() - Duration::from_secs(1);
        assert!(find_aliases_in(f.root(), &dev("loop3"), &mut q, past).is_err());
    }

    #[test]
    fn kernel_device_numbers_decode() {
        // huge_encode_dev(MKDEV(259, 300)): minor's high bits above bit 20.
        let enc = (300u64 & 0xff) | (259 << 8) | ((300u64 & !0xff) << 12);
        assert_eq!(
            DevNum::from_kernel(enc),
            DevNum {
                major: 259,
                minor: 300
            }
        );
    }
}
