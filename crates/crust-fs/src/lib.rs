//! What crust knows about filesystems, in one place and without I/O.
//!
//! * [`FsType`]: the filesystems crust formats, mounts and hands to guests.
//! * [`options`]: THE mount-option allow-list. The CSI plugin (host mounts,
//!   CreateVolume, deferred publications), crust_ops (hand-off records)
//!   and the guest agent (mounts in the guest) all call
//!   [`options::parse`], so whatever the plugin accepts the guest accepts
//!   too, and a value the kernel would refuse (e.g. `commit=` beyond what
//!   `INT_MAX / HZ` allows) is refused before anything is attached.
//! * [`FsSpec`] ([`FsType::spec`]): each filesystem's tools with their
//!   arguments (format, check, preen, grow, and whether growing takes the
//!   device or the mount point and works offline), its Debian package,
//!   its superblock magic and limits. crust_blockdev builds every command
//!   it runs from these, the guest agent its own (by absolute path).
//! * [`detect`], [`identify`], [`FsType::superblock_bytes`]: recognising a
//!   filesystem and its size from the first bytes of a device (the host
//!   probe and the guest agent read the bytes, this crate reads them).
//! * [`FsType::ALL`], [`FsType::NAMES`], [`FsType::supported_list`]: the
//!   lists other crates report (NodeGetInfo, the hand-off store's default
//!   policy, crustctl's `--fs-type` values, "supported: …" messages).
//!
//! The guest agent is a small static binary, so this crate depends on std,
//! serde and thiserror only.
//!
//! Adding a filesystem type touches this crate and the image scripts:
//!
//! 1. a variant of [`FsType`], in [`FsType::ALL`] and [`FsType::spec`];
//! 2. its [`FsSpec`] (package, tools and arguments, magic, minimum size),
//!    and a larger [`SUPERBLOCK_HEAD`] if its magic or size fields lie
//!    beyond it (btrfs: 64 KiB; a unit test checks);
//! 3. its arms in [`identify`] (any check beyond the magic) and
//!    [`FsType::superblock_bytes`];
//! 4. its option table in [`options`] (`fs_table`, `known_name`);
//! 5. its package and tools in `scripts/install-deps.sh`,
//!    `scripts/build-images.sh` (the CSI image's tool list) and, for the
//!    tools the guest runs, `guest/build-image.sh` (`X=$(tool …)`,
//!    `add_prog "$X" /usr/sbin/…`) with its kernel module in
//!    `FS_MODULES`. `tests/scripts.rs` fails until the scripts name every
//!    tool and package of every [`FsSpec`].
//!
//! Nothing outside this crate and those scripts has to change: the other
//! crates take commands, magics, sizes and lists from here. Exhaustive
//! matches stop the build at steps 1 and 3–4. Behaviour that is particular
//! to one filesystem still wants a review: in crust-csi `node/stage.rs`
//! and `node/usage.rs` (ext4 grows offline before a mount, xfs after a
//! fresh one and gets `nouuid` on clones), the ext4 error counters and
//! `CAP_SYS_RESOURCE` rule in crust_blockdev (`health.rs`, `fs.rs`) and
//! the agent's `volume.rs`, crust_blockdev's table of foreign signatures
//! in `probe.rs` (it names btrfs as "not ours"), and the test-only
//! `crust-ops/src/bin/crust-test-runtime-cli.rs` (grows by statfs magic).
//! Tests that use a type's name as their example of an unsupported one
//! need another example.

pub mod options;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use options::{MountFlag, OptionError, ParsedOptions};

/// Filesystems crust formats and mounts (on the host or in a guest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FsType {
    Ext4,
    Xfs,
}

impl FsType {
    /// Every supported type, for capability reporting.
    pub const ALL: [FsType; 2] = [FsType::Ext4, FsType::Xfs];

    /// The names of [`FsType::ALL`], in that order (e.g. clap's possible
    /// values).
    pub const NAMES: [&'static str; FsType::ALL.len()] = {
        let mut out = [""; FsType::ALL.len()];
        let mut i = 0;
        while i < out.len() {
            out[i] = FsType::ALL[i].spec().name;
            i += 1;
        }
        out
    };

    /// `"ext4, xfs"`: the supported types for messages
    /// (`"… (supported: ext4, xfs)"`).
    pub fn supported_list() -> String {
        FsType::NAMES.join(", ")
    }

    /// `"ext4 or xfs"` (`"ext4, xfs or btrfs"` with three): the supported
    /// types as alternatives in a sentence.
    pub fn supported_alternatives() -> String {
        match FsType::NAMES.split_last() {
            Some((last, [])) => (*last).to_string(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        }
    }

    /// Name as `mount(2)`, CSI and the hand-off records spell it.
    pub const fn as_str(self) -> &'static str {
        self.spec().name
    }

    /// `"ext4"` or `"xfs"` (exact, lower case). An empty string is not a
    /// type: choosing a default is the caller's policy.
    pub fn parse(s: &str) -> Option<FsType> {
        FsType::ALL.into_iter().find(|f| f.as_str() == s)
    }

    /// Tools and limits of this filesystem.
    pub const fn spec(self) -> &'static FsSpec {
        match self {
            FsType::Ext4 => &EXT4,
            FsType::Xfs => &XFS,
        }
    }

    /// Bytes this filesystem spans, from its superblock in `head` (the
    /// first [`SUPERBLOCK_HEAD`] bytes of the device): ext4's blocks count
    /// (with the 64-bit high half) times its block size; xfs's data blocks
    /// (`sb_dblocks`) times `sb_blocksize`, big-endian. `Err` says what is
    /// wrong (no superblock of this type, an implausible block size or
    /// size).
    pub fn superblock_bytes(self, head: &[u8]) -> Result<u64, &'static str> {
        let magic = self.spec().magic;
        match self {
            FsType::Ext4 => {
                let sb = head.get(1024..2048).unwrap_or_default();
                if sb.len() < 0x154 || !magic.found_in(head) {
                    return Err("no ext4 superblock");
                }
                let log = le32(sb, 0x18);
                if log > 6 {
                    return Err("implausible ext4 block size");
                }
                let mut blocks = u64::from(le32(sb, 0x04));
                const INCOMPAT_64BIT: u32 = 0x80;
                if le32(sb, 0x60) & INCOMPAT_64BIT != 0 {
                    blocks |= u64::from(le32(sb, 0x150)) << 32;
                }
                blocks
                    .checked_mul(1024 << log)
                    .ok_or("implausible ext4 size")
            }
            FsType::Xfs => {
                let sb = head;
                if sb.len() < 16 || !magic.found_in(head) {
                    return Err("no xfs superblock");
                }
                let block = u64::from(u32::from_be_bytes(sb[4..8].try_into().expect("4 bytes")));
                if !block.is_power_of_two() || !(512..=65536).contains(&block) {
                    return Err("implausible xfs block size");
                }
                u64::from_be_bytes(sb[8..16].try_into().expect("8 bytes"))
                    .checked_mul(block)
                    .ok_or("implausible xfs size")
            }
        }
    }
}

impl fmt::Display for FsType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An fstype crust does not support. Never echoes more than a bounded,
/// printable prefix of the caller's text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported filesystem type {0} (supported: {list})", list = FsType::supported_list())]
pub struct UnknownFsType(pub String);

impl FromStr for FsType {
    type Err = UnknownFsType;
    fn from_str(s: &str) -> Result<Self, UnknownFsType> {
        FsType::parse(s).ok_or_else(|| UnknownFsType(quote_short(s)))
    }
}

/// A program crust runs on a filesystem: `program`, then `args`, then the
/// device (or, for [`FsSpec::grow`] with [`GrowTarget::MountPoint`], the
/// mount point) as the last argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tool {
    pub program: &'static str,
    pub args: &'static [&'static str],
    /// Exit codes that count as success.
    pub ok: &'static [i32],
}

/// What a grow tool takes as its last argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrowTarget {
    /// The block device (`resize2fs /dev/vdb`).
    Device,
    /// Where the filesystem is mounted (`xfs_growfs -d /mnt`).
    MountPoint,
}

/// A filesystem's signature: `bytes` at `offset` from the start of the
/// device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Magic {
    pub offset: usize,
    pub bytes: &'static [u8],
}

impl Magic {
    /// Whether `head` (the start of a device) carries this magic.
    pub fn found_in(&self, head: &[u8]) -> bool {
        head.get(self.offset..self.offset + self.bytes.len()) == Some(self.bytes)
    }
}

/// How a filesystem is created, checked and grown, how it is recognised,
/// and how small it may be. Every tool crust runs on a filesystem, on the
/// host ([`FsSpec::host_tools`]) and in the guest
/// ([`FsSpec::guest_tools`]), is named here and nowhere else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsSpec {
    pub name: &'static str,
    /// The Debian package that has its tools (the image scripts and
    /// `scripts/install-deps.sh` install it; a test checks they do).
    pub package: &'static str,
    /// Creates the filesystem, with its force flag: crust decides itself
    /// whether a device is blank.
    pub mkfs: Tool,
    /// Checks (and fixes what is safe to fix) an unmounted filesystem
    /// before growing it offline; None when there is no such check.
    pub fsck: Option<Tool>,
    /// Preens the filesystem before the guest agent mounts it read-write
    /// (like kubelet); None when the mount itself is enough.
    pub preen: Option<Tool>,
    /// Checks an unmounted filesystem in userspace before the host kernel
    /// mounts what a guest had raw access to, step by step (every step
    /// must exit with one of its `ok` codes). ext4's first step replays a
    /// journal in userspace.
    pub check: &'static [Tool],
    /// Grows the filesystem to fill its device.
    pub grow: Tool,
    /// What [`FsSpec::grow`] takes as its last argument.
    pub grow_target: GrowTarget,
    /// Whether the filesystem can be grown while unmounted ([`FsSpec::fsck`]
    /// then [`FsSpec::grow`] on the device).
    pub grows_offline: bool,
    /// The repair command a message tells an operator to run.
    pub repair: &'static str,
    /// Its superblock magic ([`detect`]).
    pub magic: Magic,
    /// Smallest device the tools will format (xfsprogs >= 5.19 refuses
    /// filesystems below 300 MiB).
    pub min_bytes: u64,
    /// Where the kernel counts the errors a mounted instance met (health
    /// checks read it); None when it keeps no such count.
    pub error_count: Option<ErrorCount>,
    /// The guest kernel (6.1) can make an idmapped mount of it
    /// (`MOUNT_ATTR_IDMAP`): what a user-namespaced container needs to see
    /// its own ids on the volume.
    pub idmap: bool,
}

/// The kernel's per-instance error count in sysfs:
/// `<dir>/<device name>/<count>`, beside the function of the first error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorCount {
    pub dir: &'static str,
    pub count: &'static str,
    pub first_func: &'static str,
}

impl ErrorCount {
    /// The count's file for the filesystem on block device `devname`.
    pub fn count_path(&self, devname: &str) -> String {
        format!("{}/{devname}/{}", self.dir, self.count)
    }

    /// The file naming the kernel function of the first error.
    pub fn first_func_path(&self, devname: &str) -> String {
        format!("{}/{devname}/{}", self.dir, self.first_func)
    }
}

impl FsSpec {
    /// Every program the host runs on this filesystem (crust_blockdev:
    /// format, check, grow), each once.
    pub fn host_tools(&self) -> Vec<&'static str> {
        let mut out = vec![self.mkfs.program];
        out.extend(self.fsck.map(|t| t.program));
        out.extend(self.check.iter().map(|t| t.program));
        out.push(self.grow.program);
        dedup(out)
    }

    /// Every program the guest agent runs on this filesystem (preen before
    /// a read-write mount, grow), each once.
    pub fn guest_tools(&self) -> Vec<&'static str> {
        let mut out: Vec<_> = self.preen.map(|t| t.program).into_iter().collect();
        out.push(self.grow.program);
        dedup(out)
    }
}

fn dedup(v: Vec<&'static str>) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::with_capacity(v.len());
    for t in v {
        if !out.contains(&t) {
            out.push(t);
        }
    }
    out
}

const MIB: u64 = 1 << 20;

static EXT4: FsSpec = FsSpec {
    name: "ext4",
    package: "e2fsprogs",
    // Lazy init keeps formatting small test volumes and large sparse
    // files fast; errors=remount-ro makes the kernel flip the filesystem
    // read-only on corruption, which crust_blockdev's health check reports.
    mkfs: Tool {
        program: "mkfs.ext4",
        args: &[
            "-F",
            "-q",
            "-e",
            "remount-ro",
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
        ],
        ok: &[0],
    },
    // resize2fs insists on a freshly checked filesystem; 1 = errors fixed.
    fsck: Some(Tool {
        program: "e2fsck",
        args: &["-f", "-p"],
        ok: &[0, 1],
    }),
    // 1 and 2 = errors fixed; 4 and above = left uncorrected or failed.
    preen: Some(Tool {
        program: "e2fsck",
        args: &["-p"],
        ok: &[0, 1, 2, 3],
    }),
    check: &[
        Tool {
            program: "e2fsck",
            args: &["-E", "journal_only", "-p"],
            ok: &[0, 1],
        },
        Tool {
            program: "e2fsck",
            args: &["-f", "-n"],
            ok: &[0],
        },
    ],
    grow: Tool {
        program: "resize2fs",
        args: &[],
        ok: &[0],
    },
    grow_target: GrowTarget::Device,
    grows_offline: true,
    repair: "fsck",
    // s_magic (0xEF53, little-endian) at 0x38 of the superblock at 1024.
    magic: Magic {
        offset: 1080,
        bytes: &[0x53, 0xEF],
    },
    min_bytes: MIB,
    error_count: Some(ErrorCount {
        dir: "/sys/fs/ext4",
        count: "errors_count",
        first_func: "first_error_func",
    }),
    idmap: true,
};

static XFS: FsSpec = FsSpec {
    name: "xfs",
    package: "xfsprogs",
    mkfs: Tool {
        program: "mkfs.xfs",
        args: &["-f", "-q", "-K"],
        ok: &[0],
    },
    fsck: None,
    preen: None,
    // A dirty log cannot be replayed in userspace (only a mount does, and
    // `xfs_repair -L` discards it), so it fails this check.
    check: &[Tool {
        program: "xfs_repair",
        args: &["-n"],
        ok: &[0],
    }],
    grow: Tool {
        program: "xfs_growfs",
        args: &["-d"],
        ok: &[0],
    },
    grow_target: GrowTarget::MountPoint,
    grows_offline: false,
    repair: "xfs_repair",
    magic: Magic {
        offset: 0,
        bytes: b"XFSB",
    },
    min_bytes: 300 * MIB,
    // xfs reports corruption by shutting down (the mount turns read-only
    // or answers EIO), which the health checks see without a count.
    error_count: None,
    idmap: true,
};

/// How many bytes from the start of a device [`detect`] and
/// [`FsType::superblock_bytes`] need to see.
pub const SUPERBLOCK_HEAD: usize = 4096;

/// The supported filesystem whose magic `head` (the start of a device)
/// carries, by magic alone (ext2 and ext3 share ext4's magic; see
/// [`identify`]). When several magics match, the one nearest the start
/// wins.
pub fn detect(head: &[u8]) -> Option<FsType> {
    FsType::ALL
        .into_iter()
        .filter(|f| f.spec().magic.found_in(head))
        .min_by_key(|f| f.spec().magic.offset)
}

/// [`detect`], then the filesystem's own check that the superblock is
/// really one crust mounts as that type: `Err` names what it is instead
/// (`"ext3 filesystem"`: ext2/3/4 share the magic, and ext4 is told apart
/// by features only ext4 uses). None: no supported magic.
pub fn identify(head: &[u8]) -> Option<Result<FsType, &'static str>> {
    let fs = detect(head)?;
    Some(match fs {
        FsType::Ext4 => ext4_features(head).map(|()| fs),
        FsType::Xfs => Ok(fs),
    })
}

fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

fn ext4_features(head: &[u8]) -> Result<(), &'static str> {
    const SB: usize = 1024;
    if head.len() < SB + 0x68 {
        return Err("truncated ext superblock");
    }
    let compat = le32(head, SB + 0x5C);
    let incompat = le32(head, SB + 0x60);
    let ro_compat = le32(head, SB + 0x64);
    // extents, 64bit, flex_bg, mmp, inline_data, csum_seed, largedir, encrypt
    let ext4_incompat = 0x40 | 0x80 | 0x100 | 0x200 | 0x1000 | 0x2000 | 0x4000 | 0x8000 | 0x10000;
    // huge_file, gdt_csum, dir_nlink, extra_isize, quota, bigalloc, metadata_csum
    let ext4_ro = 0x8 | 0x10 | 0x20 | 0x40 | 0x100 | 0x200 | 0x400;
    if incompat & ext4_incompat != 0 || ro_compat & ext4_ro != 0 {
        Ok(())
    } else if compat & 0x4 != 0 {
        Err("ext3 filesystem")
    } else {
        Err("ext2 filesystem")
    }
}

/// The one sanitizer for caller text in messages (ids, names, paths, and
/// as a last guard whole error messages): control characters escaped, at
/// most `max` characters kept (then `…`). An error never carries raw
/// control bytes or kilobytes of a caller's input.
pub fn sanitize(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max) + 4);
    for (n, c) in s.chars().enumerate() {
        if n == max {
            out.push('…');
            break;
        }
        if c.is_control() && c != '\n' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A caller's string in double quotes, [`sanitize`]d to [`QUOTE_MAX`]
/// characters (and its newlines escaped too): for every echo site.
pub fn quote(s: &str) -> String {
    quote_bounded(s, QUOTE_MAX)
}

/// Longest prefix of a caller's string [`quote`] keeps, in characters.
pub const QUOTE_MAX: usize = 256;

/// Longest error message sent to a client ([`sanitize`] bound).
pub const MESSAGE_MAX: usize = 8192;

/// [`quote`] with a shorter bound, for words such as fstypes.
pub fn quote_short(s: &str) -> String {
    quote_bounded(s, 32)
}

fn quote_bounded(s: &str, max: usize) -> String {
    let inner = sanitize(s, max)
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    format!("\"{inner}\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for f in FsType::ALL {
            assert_eq!(FsType::parse(f.as_str()), Some(f));
            assert_eq!(f.as_str().parse::<FsType>(), Ok(f));
            assert_eq!(f.to_string(), f.as_str());
        }
        assert_eq!(FsType::parse(""), None);
        assert_eq!(FsType::parse("EXT4"), None);
        let e = "btrfs\0x".repeat(100).parse::<FsType>().unwrap_err();
        assert!(!e.to_string().contains('\0'), "{e}");
        assert!(e.to_string().len() < 200, "{e}");
    }

    #[test]
    fn quoting_bounds_and_escapes() {
        assert_eq!(quote("vol-1"), "\"vol-1\"");
        let q = quote("a\0b\nc\"d");
        assert!(!q.contains('\0') && !q.contains('\n'), "{q}");
        let long = quote(&"x".repeat(10_000));
        assert!(long.chars().count() <= QUOTE_MAX + 3, "{}", long.len());
        assert!(long.ends_with("…\""));
        let m = sanitize("line1\nline2\u{1b}[31m", 100);
        assert_eq!(m, "line1\nline2\\u{1b}[31m");
    }

    #[test]
    fn specs() {
        assert_eq!(FsType::Xfs.spec().min_bytes, 300 * MIB);
        assert!(FsType::Ext4.spec().grows_offline);
        assert!(!FsType::Xfs.spec().grows_offline);
        assert_eq!(FsType::Ext4.spec().fsck.map(|t| t.program), Some("e2fsck"));
        assert_eq!(
            FsType::Ext4.spec().host_tools(),
            ["mkfs.ext4", "e2fsck", "resize2fs"]
        );
        assert_eq!(FsType::Ext4.spec().guest_tools(), ["e2fsck", "resize2fs"]);
        assert_eq!(
            FsType::Xfs.spec().host_tools(),
            ["mkfs.xfs", "xfs_repair", "xfs_growfs"]
        );
        assert_eq!(FsType::Xfs.spec().guest_tools(), ["xfs_growfs"]);
        for f in FsType::ALL {
            let s = f.spec();
            assert_eq!(s.name, f.as_str());
            // Offline growth runs the grow tool on the device.
            assert!(
                !s.grows_offline || s.grow_target == GrowTarget::Device,
                "{f}"
            );
            let m = s.magic;
            assert!(!m.bytes.is_empty() && m.offset + m.bytes.len() <= SUPERBLOCK_HEAD);
            for t in [s.mkfs, s.grow]
                .iter()
                .chain(s.fsck.iter())
                .chain(s.preen.iter())
                .chain(s.check)
            {
                assert!(t.ok.contains(&0), "{f}: {t:?}");
            }
        }
    }

    #[test]
    fn name_lists() {
        assert_eq!(FsType::NAMES, ["ext4", "xfs"]);
        assert_eq!(FsType::supported_list(), "ext4, xfs");
        assert_eq!(FsType::supported_alternatives(), "ext4 or xfs");
        assert_eq!(
            "btrfs".parse::<FsType>().unwrap_err().to_string(),
            "unsupported filesystem type \"btrfs\" (supported: ext4, xfs)"
        );
    }

    /// A synthetic ext superblock at 1024 in a [`SUPERBLOCK_HEAD`] buffer.
    fn ext_head(blocks_lo: u32, log: u32, incompat: u32, blocks_hi: u32) -> Vec<u8> {
        let mut b = vec![0u8; SUPERBLOCK_HEAD];
        let sb = 1024;
        b[sb + 0x38..sb + 0x3a].copy_from_slice(&[0x53, 0xEF]);
        b[sb + 0x04..sb + 0x08].copy_from_slice(&blocks_lo.to_le_bytes());
        b[sb + 0x18..sb + 0x1c].copy_from_slice(&log.to_le_bytes());
        b[sb + 0x60..sb + 0x64].copy_from_slice(&incompat.to_le_bytes());
        b[sb + 0x150..sb + 0x154].copy_from_slice(&blocks_hi.to_le_bytes());
        b
    }

    fn xfs_head(block: u32, dblocks: u64) -> Vec<u8> {
        let mut b = vec![0u8; SUPERBLOCK_HEAD];
        b[0..4].copy_from_slice(b"XFSB");
        b[4..8].copy_from_slice(&block.to_be_bytes());
        b[8..16].copy_from_slice(&dblocks.to_be_bytes());
        b
    }

    #[test]
    fn detection_by_magic() {
        assert_eq!(detect(&[0u8; SUPERBLOCK_HEAD]), None);
        assert_eq!(detect(&[]), None);
        assert_eq!(identify(&[0u8; SUPERBLOCK_HEAD]), None);
        // Magic only: an ext2 superblock is "ext4" to detect, not to identify.
        let ext2 = ext_head(1000, 2, 0, 0);
        assert_eq!(detect(&ext2), Some(FsType::Ext4));
        assert_eq!(detect(&ext2[..1082]), Some(FsType::Ext4));
        assert_eq!(detect(&ext2[..1081]), None);
        assert_eq!(identify(&ext2), Some(Err("ext2 filesystem")));
        assert_eq!(
            identify(&ext2[..1100]),
            Some(Err("truncated ext superblock"))
        );
        let mut ext3 = ext2.clone();
        ext3[1024 + 0x5C] = 0x4;
        assert_eq!(identify(&ext3), Some(Err("ext3 filesystem")));
        let ext4 = ext_head(1000, 2, 0x40, 0);
        assert_eq!(identify(&ext4), Some(Ok(FsType::Ext4)));
        let mut ro = ext2.clone();
        ro[1024 + 0x64] = 0x8;
        assert_eq!(identify(&ro), Some(Ok(FsType::Ext4)));
        let xfs = xfs_head(4096, 1);
        assert_eq!(detect(&xfs), Some(FsType::Xfs));
        assert_eq!(identify(&xfs), Some(Ok(FsType::Xfs)));
        // Both magics: the one nearest the start (xfs at 0) wins.
        let mut both = ext4.clone();
        both[0..4].copy_from_slice(b"XFSB");
        assert_eq!(detect(&both), Some(FsType::Xfs));
    }

    #[test]
    fn sizes_from_superblocks() {
        let e = FsType::Ext4;
        assert_eq!(e.superblock_bytes(&ext_head(1000, 2, 0, 7)), Ok(4_096_000));
        // The high half counts only with the 64bit feature.
        assert_eq!(
            e.superblock_bytes(&ext_head(1, 2, 0x80, 1)),
            Ok(((1u64 << 32) + 1) * 4096)
        );
        assert_eq!(
            e.superblock_bytes(&ext_head(1, 7, 0, 0)),
            Err("implausible ext4 block size")
        );
        assert_eq!(
            e.superblock_bytes(&ext_head(u32::MAX, 6, 0x80, u32::MAX)),
            Err("implausible ext4 size")
        );
        assert_eq!(e.superblock_bytes(&[0u8; 4096]), Err("no ext4 superblock"));
        assert_eq!(
            e.superblock_bytes(&ext_head(1, 0, 0, 0)[..2047]),
            Err("no ext4 superblock")
        );
        assert_eq!(
            e.superblock_bytes(&xfs_head(4096, 9)),
            Err("no ext4 superblock")
        );

        let x = FsType::Xfs;
        assert_eq!(x.superblock_bytes(&xfs_head(4096, 9)), Ok(9 * 4096));
        assert_eq!(x.superblock_bytes(&xfs_head(4096, 9)[..16]), Ok(9 * 4096));
        assert_eq!(
            x.superblock_bytes(&xfs_head(4096, 9)[..15]),
            Err("no xfs superblock")
        );
        for bad in [0, 256, 3000, 131_072] {
            assert_eq!(
                x.superblock_bytes(&xfs_head(bad, 9)),
                Err("implausible xfs block size")
            );
        }
        assert_eq!(
            x.superblock_bytes(&xfs_head(65536, u64::MAX)),
            Err("implausible xfs size")
        );
        assert_eq!(
            x.superblock_bytes(&ext_head(1, 0, 0, 0)),
            Err("no xfs superblock")
        );
    }
}
