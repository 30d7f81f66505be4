//! Filesystem and signature probing by reading superblocks directly.
//!
//! The only question the CSI layer asks is "may I format this?", so the
//! rule is conservative: anything that is not provably all zeros where
//! filesystems, partition tables and volume managers keep their
//! signatures is reported, and only [`Probe::Blank`] may be formatted.

use std::io;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};

use crate::{FsType, device, sys};

/// How many bytes at the start and at the end of a device must be zero for
/// it to count as blank.
pub const BLANK_EDGE_BYTES: u64 = 128 * 1024;

/// What a device holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Every byte in the first and the last [`BLANK_EDGE_BYTES`] (the whole
    /// device if it is smaller than twice that) is zero, AND libblkid's
    /// signature database (`wipefs --no-act --json`) finds no filesystem,
    /// RAID member or partition table. Data without any signature (a raw
    /// block volume written in the middle) cannot be seen by any probe:
    /// callers keep a record of raw use and of their own formatting.
    Blank,
    /// A filesystem crust supports, recognised by [`crust_fs::identify`]
    /// (e.g. ext4: an ext superblock with ext4-only features).
    Fs(FsType),
    /// Something else: another filesystem, a partition table, or just
    /// non-zero bytes. The string says what was recognised.
    Unknown(String),
}

impl Probe {
    /// The filesystem type if the device holds one we support.
    pub fn fs_type(&self) -> Option<FsType> {
        match self {
            Probe::Fs(fs) => Some(*fs),
            _ => None,
        }
    }
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Probe::Blank => f.write_str("blank"),
            Probe::Fs(fs) => write!(f, "{fs} filesystem"),
            Probe::Unknown(what) => f.write_str(what),
        }
    }
}

/// Errors reading a device for probing.
#[derive(Debug, thiserror::Error)]
#[error("probing {path}: {source}")]
pub struct ProbeError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Reads the first and last [`BLANK_EDGE_BYTES`] of `dev` (a block device
/// or a regular image file) and classifies them; see [`Probe`] for the
/// exact blank rule. Reads with `O_DIRECT` when possible so a stale page
/// cache (e.g. the backing file was written behind the loop device's back)
/// cannot make data look blank.
pub fn probe_fs(dev: &Path) -> Result<Probe, ProbeError> {
    let err = |source: io::Error| ProbeError {
        path: dev.to_path_buf(),
        source,
    };
    let (fd, size) = open_sized(dev)?;

    let head_len = size.min(BLANK_EDGE_BYTES) as usize;
    let head = read_region(&fd, 0, head_len).map_err(err)?;
    if let Some(found) = classify_head(&head) {
        return Ok(found);
    }
    let mut nonzero = head.iter().any(|&b| b != 0);
    let tail_start = size.saturating_sub(BLANK_EDGE_BYTES).max(head_len as u64);
    if !nonzero && tail_start < size {
        // Align down for O_DIRECT; re-reading a little of the head is fine.
        let aligned = tail_start - tail_start % sys::DIRECT_ALIGN as u64;
        let tail = read_region(&fd, aligned, (size - aligned) as usize).map_err(err)?;
        if tail.len() >= 512 && &tail[tail.len() - 512..tail.len() - 512 + 8] == b"EFI PART" {
            return Ok(Probe::Unknown("GPT partition table (backup header)".into()));
        }
        nonzero = tail.iter().any(|&b| b != 0);
    }
    if nonzero {
        return Ok(Probe::Unknown(
            "unrecognised non-zero data in the first or last 128 KiB".into(),
        ));
    }
    // Zero edges are not enough: libblkid's signature database knows
    // filesystems, RAID members and partition tables anywhere it looks.
    if let Some(sig) = known_signatures(dev)?.first() {
        return Ok(Probe::Unknown(format!(
            "a {} signature at offset {:#x}",
            sig.kind, sig.offset
        )));
    }
    Ok(Probe::Blank)
}

/// Bytes the filesystem `fs` on `dev` spans, from its superblock (read
/// here, parsed by [`FsType::superblock_bytes`]): ext4's blocks count
/// (with the 64-bit high half) times its block size; xfs's data blocks
/// (`sb_dblocks`) times `sb_blocksize`, big-endian.
pub fn fs_bytes(dev: &Path, fs: FsType) -> Result<u64, ProbeError> {
    let err = |source: io::Error| ProbeError {
        path: dev.to_path_buf(),
        source,
    };
    let bad = |what: &str| err(io::Error::new(io::ErrorKind::InvalidData, what.to_string()));
    // Buffered, unlike probe_fs: a mounted filesystem's newest superblock
    // may be in the page cache, not on the disk yet.
    let fd = rustix::fs::open(dev, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| err(e.into()))?;
    let head = read_region(&fd, 0, crust_fs::SUPERBLOCK_HEAD).map_err(err)?;
    fs.superblock_bytes(&head).map_err(bad)
}

/// Whether the filesystem `fs` on the block device `dev` is at least
/// 1 MiB smaller than the device (grown while the filesystem was not).
pub fn fs_needs_grow(dev: &Path, fs: FsType) -> Result<bool, ProbeError> {
    let fs_size = fs_bytes(dev, fs)?;
    let dev_size = device::block_device_size(dev).map_err(|e| ProbeError {
        path: dev.to_path_buf(),
        source: io::Error::other(e),
    })?;
    Ok(dev_size >= fs_size.saturating_add(1 << 20))
}

/// Opens `dev` for reading (`O_DIRECT` when possible) and returns its
/// size: a block device's from the kernel, a regular file's from `fstat`;
/// anything else is refused.
pub(crate) fn open_sized(dev: &Path) -> Result<(std::os::fd::OwnedFd, u64), ProbeError> {
    let err = |source: io::Error| ProbeError {
        path: dev.to_path_buf(),
        source,
    };
    let (fd, _direct) = open_for_probe(dev).map_err(err)?;
    let st = rustix::fs::fstat(&fd).map_err(|e| err(e.into()))?;
    let size = match FileType::from_raw_mode(st.st_mode) {
        FileType::BlockDevice => device::size_of_fd(&fd, dev).map_err(|e| match e {
            device::DeviceError::Io { source, .. } => err(source),
            other => err(io::Error::other(other.to_string())),
        })?,
        FileType::RegularFile => st.st_size as u64,
        _ => {
            return Err(err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a block device or regular file",
            )));
        }
    };
    Ok((fd, size))
}

fn open_for_probe(dev: &Path) -> io::Result<(std::os::fd::OwnedFd, bool)> {
    let base = OFlags::RDONLY | OFlags::CLOEXEC;
    match rustix::fs::open(dev, base | OFlags::DIRECT, Mode::empty()) {
        Ok(fd) => Ok((fd, true)),
        // tmpfs and a few others refuse O_DIRECT.
        Err(rustix::io::Errno::INVAL) => Ok((rustix::fs::open(dev, base, Mode::empty())?, false)),
        Err(e) => Err(e.into()),
    }
}

/// Reads `len` bytes at `offset` (short at EOF) through an aligned buffer.
fn read_region(fd: &std::os::fd::OwnedFd, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let padded = len.div_ceil(sys::DIRECT_ALIGN) * sys::DIRECT_ALIGN;
    let mut buf = sys::AlignedBuf::new(padded);
    let n = sys::pread_full(fd, buf.as_mut_slice(), offset)?;
    Ok(buf.as_slice()[..n.min(len)].to_vec())
}

fn at(buf: &[u8], off: usize, sig: &[u8]) -> bool {
    buf.len() >= off + sig.len() && &buf[off..off + sig.len()] == sig
}

/// Recognises signatures in the first [`BLANK_EDGE_BYTES`] of a device.
/// Exposed for unit tests of the rule.
pub fn classify_head(head: &[u8]) -> Option<Probe> {
    match crust_fs::identify(head) {
        Some(Ok(fs)) => return Some(Probe::Fs(fs)),
        Some(Err(what)) => return Some(Probe::Unknown(what.into())),
        None => {}
    }
    let known: &[(usize, &[u8], &str)] = &[
        (0, b"LUKS\xba\xbe", "LUKS encrypted volume"),
        (
            0,
            b"SKUL\xba\xbe",
            "LUKS2 encrypted volume (secondary header)",
        ),
        (512, b"EFI PART", "GPT partition table"),
        (512, b"LABELONE", "LVM2 physical volume"),
        (1024, b"LABELONE", "LVM2 physical volume"),
        (4086, b"SWAPSPACE2", "swap space"),
        (4086, b"SWAP-SPACE", "swap space"),
        (0, b"hsqs", "squashfs filesystem"),
        (3, b"NTFS    ", "NTFS filesystem"),
        (32769, b"CD001", "iso9660 filesystem"),
        (65600, b"_BHRfS_M", "btrfs filesystem"),
        (0, b"\xfc\x4e\x2b\xa9", "md RAID member (v1.1)"),
        (4096, b"\xfc\x4e\x2b\xa9", "md RAID member (v1.2)"),
        (1024, b"\x10\x20\xf5\xf2", "f2fs filesystem"),
    ];
    for (off, sig, what) in known {
        if at(head, *off, sig) {
            return Some(Probe::Unknown((*what).into()));
        }
    }
    if at(head, 510, &[0x55, 0xAA]) {
        return Some(Probe::Unknown(
            "DOS/MBR partition table or boot sector".into(),
        ));
    }
    None
}

/// A signature libblkid found on a device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct Signature {
    /// What it is (`ext4`, `xfs`, `dos`, `gpt`, `linux_raid_member`...).
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(deserialize_with = "hex_offset")]
    pub offset: u64,
    /// The filesystem's (or table's) UUID, where it has one.
    #[serde(default)]
    pub uuid: Option<String>,
}

fn hex_offset<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let s: String = serde::Deserialize::deserialize(d)?;
    u64::from_str_radix(s.trim_start_matches("0x"), 16).map_err(serde::de::Error::custom)
}

/// Parses `wipefs --json` output; empty output is no signature.
pub fn parse_wipefs_json(out: &str) -> Result<Vec<Signature>, String> {
    #[derive(serde::Deserialize)]
    struct Out {
        signatures: Vec<Signature>,
    }
    if out.trim().is_empty() {
        return Ok(Vec::new());
    }
    serde_json::from_str::<Out>(out)
        .map(|o| o.signatures)
        .map_err(|e| format!("unexpected wipefs output: {e}"))
}

/// Every signature libblkid's database knows on `dev` (filesystems, RAID
/// and volume-manager members, partition tables), from
/// `wipefs --no-act --json` (read-only). A failure is an error, never
/// "no signature".
pub fn known_signatures(dev: &Path) -> Result<Vec<Signature>, ProbeError> {
    let err = |e: String| ProbeError {
        path: dev.to_path_buf(),
        source: io::Error::other(e),
    };
    let out = crate::tool::run_accepting(
        "wipefs",
        &["--no-act".as_ref(), "--json".as_ref(), dev.as_os_str()],
        dev,
        &[0],
    )
    .map_err(|e| err(e.to_string()))?;
    parse_wipefs_json(&out).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_head_is_unclassified() {
        assert_eq!(classify_head(&[0u8; 4096]), None);
    }

    #[test]
    fn signatures() {
        let mut b = vec![0u8; BLANK_EDGE_BYTES as usize];
        b[0..4].copy_from_slice(b"XFSB");
        assert_eq!(classify_head(&b), Some(Probe::Fs(FsType::Xfs)));

        let mut b = vec![0u8; BLANK_EDGE_BYTES as usize];
        b[1080] = 0x53;
        b[1081] = 0xEF;
        assert_eq!(
            classify_head(&b),
            Some(Probe::Unknown("ext2 filesystem".into()))
        );
        b[1024 + 0x5C] = 0x4;
        assert_eq!(
            classify_head(&b),
            Some(Probe::Unknown("ext3 filesystem".into()))
        );
        b[1024 + 0x60] = 0x40;
        assert_eq!(classify_head(&b), Some(Probe::Fs(FsType::Ext4)));

        let mut b = vec![0u8; 4096];
        b[510] = 0x55;
        b[511] = 0xAA;
        assert!(matches!(classify_head(&b), Some(Probe::Unknown(s)) if s.contains("MBR")));
        b[512..520].copy_from_slice(b"EFI PART");
        assert!(matches!(classify_head(&b), Some(Probe::Unknown(s)) if s.contains("GPT")));
    }

    #[test]
    fn wipefs_json() {
        assert_eq!(parse_wipefs_json("").unwrap(), vec![]);
        assert_eq!(
            parse_wipefs_json("{\"signatures\": [\n\n]}").unwrap(),
            vec![]
        );
        let out = r#"{"signatures": [{"device":"loop0","offset":"0x438","type":"ext4","uuid":"a8","label":null},
            {"device":"loop0","offset":"0x1fe","type":"dos","uuid":null,"label":null}]}"#;
        assert_eq!(
            parse_wipefs_json(out).unwrap(),
            vec![
                Signature {
                    kind: "ext4".into(),
                    offset: 0x438,
                    uuid: Some("a8".into()),
                },
                Signature {
                    kind: "dos".into(),
                    offset: 0x1fe,
                    uuid: None,
                }
            ]
        );
        assert!(parse_wipefs_json("garbage").is_err());
        assert!(parse_wipefs_json(r#"{"signatures":[{"type":"x","offset":"zz"}]}"#).is_err());
    }
}
