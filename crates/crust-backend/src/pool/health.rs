//! What the pool reports about one volume's backing and about itself.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::PoolBackend;
use super::index::Entry;
use crate::util::{self, lock};
use crate::{BackingState, StorageProblem};

impl PoolBackend {
    pub(super) fn backing_health(&self, volume_id: &str) -> BackingState {
        let Some(entry) = self.entry(volume_id) else {
            return BackingState::Missing(format!("volume {volume_id} is not in the pool index"));
        };
        let path = self.dir.join(&entry.file);
        let p = path.display();
        let loops = match self.loops.devices(&path) {
            Ok(l) => l,
            Err(e) => return BackingState::Degraded(format!("cannot list loop devices: {e}")),
        };
        let stale: Vec<PathBuf> = loops
            .iter()
            .filter(|s| s.backing_deleted)
            .map(|s| s.path.clone())
            .collect();
        let meta = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if stale.is_empty() {
                    return BackingState::Missing(format!(
                        "backing file {p} was removed outside of the CSI driver; the volume's data is gone"
                    ));
                }
                return BackingState::Missing(format!(
                    "backing file {p} was removed while attached; {} still holds the deleted data: copy it off before detaching",
                    util::display_list(&stale)
                ));
            }
            Err(e) => return BackingState::Degraded(format!("cannot stat backing file {p}: {e}")),
        };
        if !meta.is_file() {
            return BackingState::Degraded(format!("backing file {p} is not a regular file"));
        }
        if !stale.is_empty() {
            return BackingState::Degraded(format!(
                "{} is attached to a deleted earlier copy of {p}; writes through it do not reach the volume's file: unpublish, unstage and stage again",
                util::display_list(&stale)
            ));
        }
        if meta.len() != entry.size_bytes {
            return BackingState::Degraded(format!(
                "backing file {p} is {} bytes but the volume is {} bytes",
                meta.len(),
                entry.size_bytes
            ));
        }
        let live: Vec<&crust_blockdev::LoopStatus> = loops.iter().collect();
        if live.len() > 1 {
            let devs: Vec<PathBuf> = live.iter().map(|s| s.path.clone()).collect();
            return BackingState::Degraded(format!(
                "{p} is attached more than once ({}); concurrent writers corrupt filesystems",
                util::display_list(&devs)
            ));
        }
        if let Some(s) = live.first()
            && s.size_bytes != meta.len()
        {
            return BackingState::Degraded(format!(
                "{} is {} bytes but its backing file is {}; the device size was not refreshed after an expand",
                s.path.display(),
                s.size_bytes,
                meta.len()
            ));
        }
        BackingState::Healthy
    }

    pub(super) fn pool_health(&self) -> Vec<StorageProblem> {
        let d = self.dir.display();
        if !self.dir.is_dir() {
            return vec![StorageProblem::unreachable(
                "PoolUnavailable",
                format!("pool directory {d} is missing or not a directory"),
            )];
        }
        let mut problems = Vec::new();
        if !Path::new("/dev/loop-control").exists() {
            problems.push(StorageProblem::unreachable(
                "LoopDevicesUnavailable",
                "/dev/loop-control is missing: no volume can be attached (load the loop module)",
            ));
        }
        if let crust_blockdev::Health::Abnormal(s) = crust_blockdev::containing_fs_health(&self.dir)
        {
            use crust_blockdev::SymptomKind as K;
            problems.push(match s.kind {
                K::FilesystemReadOnly | K::MountReadOnly => StorageProblem::degraded(
                    "PoolReadOnly",
                    format!(
                        "{}: volumes cannot be created or expanded, and writes to volumes fail",
                        s.message
                    ),
                ),
                K::FilesystemErrors => StorageProblem::degraded("PoolFilesystemErrors", s.message),
                K::FilesystemIoErrors => {
                    StorageProblem::unreachable("PoolFilesystemIoErrors", s.message)
                }
                _ => StorageProblem::degraded(s.kind.reason(), s.message),
            });
            return problems;
        }
        if let Err(e) = rustix::fs::access(&self.dir, rustix::fs::Access::WRITE_OK) {
            problems.push(StorageProblem::degraded(
                "PoolNotWritable",
                format!("pool directory {d} is not writable: {e}"),
            ));
        }
        match crust_blockdev::usage(&self.dir) {
            Ok(u) if u.bytes_available == 0 => problems.push(StorageProblem::degraded(
                "PoolFilesystemFull",
                format!(
                    "the filesystem holding pool directory {d} is full: writes to volumes that \
                     need new blocks fail"
                ),
            )),
            Ok(u) => {
                // Sparse files: space promised to volumes but not written
                // yet must still fit, or a volume's writes fail later.
                let promised = self.unwritten_bytes();
                if promised > u.bytes_available {
                    problems.push(StorageProblem::degraded(
                        "PoolOvercommitted",
                        format!(
                            "volumes in pool {d} may still write {promised} bytes but its \
                             filesystem has {} bytes available: writes may fail with ENOSPC",
                            u.bytes_available
                        ),
                    ));
                }
            }
            Err(e) => problems.push(StorageProblem::degraded(
                "HealthProbeFailed",
                format!("statfs on pool directory {d} failed: {e}"),
            )),
        }
        problems
    }

    /// Bytes the pool's volumes may still write before their sparse files
    /// are fully allocated.
    fn unwritten_bytes(&self) -> u64 {
        let entries: Vec<Entry> = lock(&self.state).index.volumes.values().cloned().collect();
        entries
            .iter()
            .map(|e| {
                let allocated = std::fs::metadata(self.dir.join(&e.file))
                    .map(|m| m.blocks() * 512)
                    .unwrap_or(0);
                e.size_bytes.saturating_sub(allocated)
            })
            .sum()
    }
}
