//! Space and inode usage of a mounted filesystem.

use std::io;
use std::path::{Path, PathBuf};

/// Usage figures in bytes and inodes, as CSI `VolumeUsage` wants them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// `f_blocks * f_frsize`.
    pub bytes_total: u64,
    /// `(f_blocks - f_bfree) * f_frsize`.
    pub bytes_used: u64,
    /// `f_bavail * f_frsize`: what an unprivileged writer can still use
    /// (excludes ext4's root reserve, so used + available ≤ total).
    pub bytes_available: u64,
    /// `f_files`.
    pub inodes_total: u64,
    /// `f_files - f_ffree`.
    pub inodes_used: u64,
    /// `f_ffree`.
    pub inodes_free: u64,
}

/// `statvfs` failed.
#[derive(Debug, thiserror::Error)]
#[error("statvfs {path}: {source}")]
pub struct UsageError {
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Usage of the filesystem containing `path` (use the mount point). For a
/// raw block volume use [`crate::block_device_size`] instead: `statvfs` on a
/// device node describes devtmpfs.
pub fn usage(path: &Path) -> Result<Usage, UsageError> {
    let st = rustix::fs::statvfs(path).map_err(|e| UsageError {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    let frsize = st.f_frsize;
    Ok(Usage {
        bytes_total: st.f_blocks.saturating_mul(frsize),
        bytes_used: st
            .f_blocks
            .saturating_sub(st.f_bfree)
            .saturating_mul(frsize),
        bytes_available: st.f_bavail.saturating_mul(frsize),
        inodes_total: st.f_files,
        inodes_used: st.f_files.saturating_sub(st.f_ffree),
        inodes_free: st.f_ffree,
    })
}
