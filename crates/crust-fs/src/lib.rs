//! What crust knows about filesystems, in one place and without I/O.
//!
//! * [`FsType`]: the filesystems crust formats, mounts and hands to guests.
//! * [`options`]: THE mount-option allow-list. The CSI plugin (host mounts,
//!   CreateVolume, deferred publications), crust_ops (hand-off records)
//!   and the guest agent (mounts in the guest) all call
//!   [`options::parse`], so whatever the plugin accepts the guest accepts
//!   too, and a value the kernel would refuse (e.g. `commit=` beyond what
//!   `INT_MAX / HZ` allows) is refused before anything is attached.
//! * [`FsSpec`] ([`FsType::spec`]): each filesystem's tools and limits.
//!
//! The guest agent is a small static binary, so this crate depends on std,
//! serde and thiserror only. Adding a filesystem type: a variant of
//! [`FsType`], its [`FsSpec`], and its option table in [`options`].

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

    /// Name as `mount(2)`, CSI and the hand-off records spell it.
    pub fn as_str(self) -> &'static str {
        self.spec().name
    }

    /// `"ext4"` or `"xfs"` (exact, lower case). An empty string is not a
    /// type: choosing a default is the caller's policy.
    pub fn parse(s: &str) -> Option<FsType> {
        FsType::ALL.into_iter().find(|f| f.as_str() == s)
    }

    /// Tools and limits of this filesystem.
    pub fn spec(self) -> &'static FsSpec {
        match self {
            FsType::Ext4 => &EXT4,
            FsType::Xfs => &XFS,
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
#[error("unsupported filesystem type {0} (supported: ext4, xfs)")]
pub struct UnknownFsType(pub String);

impl FromStr for FsType {
    type Err = UnknownFsType;
    fn from_str(s: &str) -> Result<Self, UnknownFsType> {
        FsType::parse(s).ok_or_else(|| UnknownFsType(quote_short(s)))
    }
}

/// How a filesystem is created, checked and grown, and how small it may be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsSpec {
    pub name: &'static str,
    /// Creates the filesystem (run with its force flag: crust decides
    /// itself whether a device is blank).
    pub mkfs: &'static str,
    /// Checks an unmounted filesystem; None when there is no offline check
    /// crust runs before growing.
    pub fsck: Option<&'static str>,
    /// Grows a mounted filesystem (ext4 also unmounted, after `fsck`).
    pub grow: &'static str,
    /// Whether the filesystem can be grown while unmounted.
    pub grows_offline: bool,
    /// Smallest device the tools will format (xfsprogs >= 5.19 refuses
    /// filesystems below 300 MiB).
    pub min_bytes: u64,
}

const MIB: u64 = 1 << 20;

static EXT4: FsSpec = FsSpec {
    name: "ext4",
    mkfs: "mkfs.ext4",
    fsck: Some("e2fsck"),
    grow: "resize2fs",
    grows_offline: true,
    min_bytes: MIB,
};

static XFS: FsSpec = FsSpec {
    name: "xfs",
    mkfs: "mkfs.xfs",
    fsck: None,
    grow: "xfs_growfs",
    grows_offline: false,
    min_bytes: 300 * MIB,
};

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
        assert_eq!(FsType::Ext4.spec().fsck, Some("e2fsck"));
    }
}
