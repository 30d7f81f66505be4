//! What proves a block device is the one a record was written for. Device
//! paths are reused: once a loop device is detached, the next attach of
//! any file may get the same `/dev/loopN`, and a record that names only
//! the path then hands a guest another volume. The identity is read from
//! an open descriptor of the device (the hold a plug takes), never from
//! the path:
//!
//! * a loop device: its backing file (`LOOP_GET_STATUS64`'s `lo_device`
//!   and `lo_inode`) and that inode's generation (`FS_IOC_GETVERSION` on
//!   the backing file, opened by the path sysfs names and checked to be
//!   the same inode), which tells an inode number reused by a new file;
//!   `diskseq` is left out on purpose, as a re-attach of the same file
//!   changes it;
//! * another disk: its WWN (`wwid`) where it has one, else its serial,
//!   with the partition number for a partition;
//! * else the UUID of the filesystem on it.
//!
//! The text form (`file:7:0:1234:56`, `wwn:…`, `serial:…`, `fs-uuid:…`)
//! is what records carry.

use std::os::fd::BorrowedFd;
use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags};

use crate::alias::DevNum;

/// Longest text value (WWN, serial, UUID) an identity carries.
const MAX_VALUE: usize = 128;

/// A block device's identity; see the module doc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceIdentity {
    /// A loop device's backing file.
    BackingFile {
        dev: DevNum,
        ino: u64,
        /// None where the backing filesystem keeps no generation.
        generation: Option<u64>,
    },
    Wwn(String),
    Serial(String),
    FsUuid(String),
}

impl std::fmt::Display for DeviceIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceIdentity::BackingFile {
                dev,
                ino,
                generation,
            } => {
                write!(f, "file:{}:{}:{ino}:", dev.major, dev.minor)?;
                match generation {
                    Some(g) => write!(f, "{g}"),
                    None => write!(f, "-"),
                }
            }
            DeviceIdentity::Wwn(v) => write!(f, "wwn:{v}"),
            DeviceIdentity::Serial(v) => write!(f, "serial:{v}"),
            DeviceIdentity::FsUuid(v) => write!(f, "fs-uuid:{v}"),
        }
    }
}

impl std::str::FromStr for DeviceIdentity {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("device identity {s:?}: {why}");
        let (kind, rest) = s.split_once(':').ok_or_else(|| bad("no kind"))?;
        let value = |v: &str| {
            if v.is_empty() || v.len() > MAX_VALUE || !v.bytes().all(|b| b.is_ascii_graphic()) {
                Err(bad("the value must be 1 to 128 printable characters"))
            } else {
                Ok(v.to_string())
            }
        };
        match kind {
            "file" => {
                let f: Vec<&str> = rest.split(':').collect();
                let [major, minor, ino, generation] = f[..] else {
                    return Err(bad("expected file:MAJOR:MINOR:INODE:GENERATION"));
                };
                let num = |v: &str| v.parse::<u64>().map_err(|_| bad("not a number"));
                Ok(DeviceIdentity::BackingFile {
                    dev: DevNum {
                        major: u32::try_from(num(major)?).map_err(|_| bad("major"))?,
                        minor: u32::try_from(num(minor)?).map_err(|_| bad("minor"))?,
                    },
                    ino: num(ino)?,
                    generation: match generation {
                        "-" => None,
                        g => Some(num(g)?),
                    },
                })
            }
            "wwn" => Ok(DeviceIdentity::Wwn(value(rest)?)),
            "serial" => Ok(DeviceIdentity::Serial(value(rest)?)),
            "fs-uuid" => Ok(DeviceIdentity::FsUuid(value(rest)?)),
            _ => Err(bad("the kind must be file, wwn, serial or fs-uuid")),
        }
    }
}

impl DeviceIdentity {
    /// Whether `found` (read from the device now) is the device `self`
    /// (a record's) names. A backing file's generation is compared when
    /// both sides have one: the plugin that wrote the record may see the
    /// pool under another path (a container's mount) and read none.
    pub fn matches(&self, found: &DeviceIdentity) -> bool {
        match (self, found) {
            (
                DeviceIdentity::BackingFile {
                    dev: d1,
                    ino: i1,
                    generation: g1,
                },
                DeviceIdentity::BackingFile {
                    dev: d2,
                    ino: i2,
                    generation: g2,
                },
            ) => d1 == d2 && i1 == i2 && (g1.is_none() || g2.is_none() || g1 == g2),
            _ => self == found,
        }
    }
}

/// The identity of the block device open at `fd` (its node `path` only
/// for the filesystem-UUID fallback and messages).
pub fn identity_of(fd: BorrowedFd<'_>, path: &Path) -> Result<DeviceIdentity, String> {
    let st = rustix::fs::fstat(fd).map_err(|e| format!("{}: {e}", path.display()))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::BlockDevice {
        return Err(format!("{} is not a block device", path.display()));
    }
    let num = DevNum::from_stat(st.st_rdev);
    let sysfs = Path::new("/sys/dev/block").join(num.to_string());
    if sysfs.join("loop").is_dir() {
        return loop_identity(fd, &sysfs, path);
    }
    let partition = std::fs::read_to_string(sysfs.join("partition"))
        .ok()
        .map(|p| p.trim().to_string());
    // A partition's disk is its parent directory in sysfs.
    let disk = if partition.is_some() {
        sysfs.join("..")
    } else {
        sysfs.clone()
    };
    let attr = |rel: &str| {
        std::fs::read_to_string(disk.join(rel))
            .ok()
            .map(|v| v.trim().replace(' ', "_"))
            .filter(|v| !v.is_empty() && v.len() <= MAX_VALUE - 8)
    };
    let with_part = |v: String| match &partition {
        Some(p) => format!("{v}#p{p}"),
        None => v,
    };
    if let Some(w) = attr("wwid").or_else(|| attr("device/wwid")) {
        return Ok(DeviceIdentity::Wwn(with_part(w)));
    }
    if let Some(s) = attr("serial").or_else(|| attr("device/serial")) {
        return Ok(DeviceIdentity::Serial(with_part(s)));
    }
    let sigs = crate::probe::known_signatures(path).map_err(|e| e.to_string())?;
    sigs.into_iter()
        .find_map(|s| s.uuid.filter(|u| !u.is_empty() && u.len() <= MAX_VALUE))
        .map(DeviceIdentity::FsUuid)
        .ok_or_else(|| {
            format!(
                "{} has no identity crust can check: not a loop device, no WWN or serial, \
                 no filesystem UUID",
                path.display()
            )
        })
}

fn loop_identity(fd: BorrowedFd<'_>, sysfs: &Path, path: &Path) -> Result<DeviceIdentity, String> {
    let info = crust_sys::loopdev::get_status(fd)
        .map_err(|e| format!("LOOP_GET_STATUS64 on {}: {e}", path.display()))?;
    let dev = DevNum::from_kernel(info.lo_device);
    let ino = info.lo_inode;
    Ok(DeviceIdentity::BackingFile {
        dev,
        ino,
        generation: backing_generation(sysfs, dev, ino),
    })
}

/// The generation of the loop's backing inode, through the path sysfs
/// names, when that path still leads to the same inode and its
/// filesystem keeps generations.
fn backing_generation(sysfs: &Path, dev: DevNum, ino: u64) -> Option<u64> {
    let name = std::fs::read_to_string(sysfs.join("loop/backing_file")).ok()?;
    let name = name.trim_end_matches('\n');
    if name.ends_with(" (deleted)") {
        return None;
    }
    let f = rustix::fs::open(
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let st = rustix::fs::fstat(&f).ok()?;
    if DevNum::from_stat(st.st_dev) != dev || st.st_ino != ino {
        return None;
    }
    crust_sys::fs::inode_generation(&f).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn text_form_round_trips_and_bad_text_is_refused() {
        for s in [
            "file:259:3:1234:5678",
            "file:7:0:12:-",
            "wwn:naa.600508b1001c4d3f#p1",
            "serial:QM00001",
            "fs-uuid:0b1c2d3e-aaaa-4bbb-8ccc-1234567890ab",
        ] {
            let id: DeviceIdentity = s.parse().unwrap();
            assert_eq!(id.to_string(), s);
        }
        // A generation only one side could read does not refuse.
        let with: DeviceIdentity = "file:7:0:12:5".parse().unwrap();
        let without: DeviceIdentity = "file:7:0:12:-".parse().unwrap();
        let other_gen: DeviceIdentity = "file:7:0:12:6".parse().unwrap();
        let other_ino: DeviceIdentity = "file:7:0:13:-".parse().unwrap();
        assert!(with.matches(&without) && without.matches(&with));
        assert!(!with.matches(&other_gen) && !without.matches(&other_ino));
        for bad in [
            "",
            "file:1:2:3",
            "file:a:2:3:4",
            "disk:x",
            "wwn:",
            "serial:has space",
            "fs-uuid:\u{7}",
        ] {
            assert!(bad.parse::<DeviceIdentity>().is_err(), "{bad:?}");
        }
    }

    /// A loop's identity is its backing file's: the same after a
    /// re-attach of the same file (a new diskseq), another for another
    /// file given the same device number.
    #[test]
    fn a_reused_loop_path_is_told_apart() {
        use crate::loopdev::{AttachOptions, LoopGuard};
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
        for f in [&a, &b] {
            std::fs::File::create(f).unwrap().set_len(1 << 20).unwrap();
        }
        let of = |dev: &Path| {
            let fd =
                rustix::fs::open(dev, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).unwrap();
            identity_of(fd.as_fd(), dev).unwrap()
        };
        let g = LoopGuard::attach(&a, AttachOptions::default()).unwrap();
        let dev = g.path().to_path_buf();
        let first = of(&dev);
        assert!(
            matches!(first, DeviceIdentity::BackingFile { .. }),
            "{first}"
        );
        drop(g);
        let again = LoopGuard::attach(&a, AttachOptions::default()).unwrap();
        assert_eq!(of(again.path()), first, "the same file attached again");
        drop(again);
        let other = LoopGuard::attach(&b, AttachOptions::default()).unwrap();
        assert_ne!(of(other.path()), first, "another file");
    }
}
