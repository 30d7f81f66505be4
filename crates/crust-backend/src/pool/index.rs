//! The pool's persisted index (`index.json`) and the names of its files.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Entry {
    /// File name inside the pool directory.
    pub(super) file: String,
    pub(super) size_bytes: u64,
    /// A volume being filled from a snapshot or another volume: its file
    /// is written under a temp name and renamed when complete (see
    /// [`PoolBackend::reconcile`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) pending: bool,
    /// How the file was made (for [`Backend::blankness`]). `None` in
    /// indexes written before it was recorded: such an entry may be a
    /// clone as well as an empty create, so it answers `Copy` and the
    /// plugin's own record of the volume's content source decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) made: Option<Made>,
    /// Logical block size of its loop device, fixed when the volume is
    /// made (a filesystem mounts only on the sector size it was made on).
    /// `None` in entries written before it was recorded: those were
    /// always attached with 512-byte sectors, so they keep 512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) block_size: Option<u32>,
}

/// Sector size of volumes made before the pool recorded one.
pub(super) const LEGACY_BLOCK_SIZE: u32 = 512;

impl Entry {
    pub(super) fn block_size(&self) -> u32 {
        self.block_size.unwrap_or(LEGACY_BLOCK_SIZE)
    }
}

/// How a volume's file was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Made {
    /// `create`: a new sparse file, all zeros.
    Empty,
    /// `create_from`: a copy of a volume or a snapshot.
    Copy,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct SnapEntry {
    /// File name inside `snapshots/`.
    pub(super) file: String,
    pub(super) source_volume_id: String,
    pub(super) size_bytes: u64,
    pub(super) allocated_bytes: u64,
    pub(super) created_unix_ms: i64,
    pub(super) method: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) group_id: Option<String>,
    /// Being copied; never reported (see [`PoolBackend::reconcile`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) pending: bool,
    /// The source volume's block size, which volumes restored from this
    /// snapshot keep (`None`: 512, as for [`Entry::block_size`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) block_size: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct GroupEntry {
    pub(super) source_volume_ids: Vec<String>,
    pub(super) snapshot_ids: Vec<String>,
    pub(super) created_unix_ms: i64,
    pub(super) complete: bool,
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Index {
    pub(super) version: u32,
    pub(super) volumes: BTreeMap<String, Entry>,
    #[serde(default)]
    pub(super) snapshots: BTreeMap<String, SnapEntry>,
    #[serde(default)]
    pub(super) groups: BTreeMap<String, GroupEntry>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) index: Index,
    /// Bytes promised to creates/expands still writing their files.
    pub(super) reserved: u64,
    /// The in-memory index has changes the file on disk lacks
    /// ([`IndexSync::Deferred`]).
    pub(super) dirty: bool,
    /// Volumes created since the index was last written: neither their
    /// entry nor their file is known durable, and nothing was attached.
    pub(super) unwritten: std::collections::HashSet<String>,
}

pub(super) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// File name for a new volume's image.
pub(super) fn image_name(id: &str) -> String {
    let safe = !id.starts_with('.')
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if safe {
        return format!("{id}.img");
    }
    let prefix: String = id
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let digest = Sha256::digest(id.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{hex}.img")
}

#[cfg(test)]
mod tests {
    use super::image_name;

    #[test]
    fn image_names() {
        assert_eq!(image_name("pvc-1234_a.b"), "pvc-1234_a.b.img");
        let odd = image_name("ns/vol name");
        assert!(
            odd.starts_with("ns_vol_name-") && odd.ends_with(".img"),
            "{odd}"
        );
        assert_ne!(image_name("a/b"), image_name("a_b"));
        assert_ne!(image_name("a/b"), image_name("a:b"));
        assert!(image_name("..").starts_with("__-"));
        assert!(image_name(&"x".repeat(200)).len() < 100);
    }
}
