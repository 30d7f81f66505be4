//! The loop devices bound to the pool's files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crust_blockdev::{LoopError, LoopStatus};

use crate::util::lock;
use crate::{BackendError, Result};

/// Loop devices bound to this pool's files, by backing path. The pool
/// directory is locked to one process and its files are attached only by
/// [`PoolBackend::attach`], so the index is read from sysfs once at open
/// and kept from then on; each entry is checked on use against that one
/// device's status. A lookup costs the same whether the node has ten loop
/// devices or thousands (scanning every `/sys/block/loop*` per call made
/// every RPC slower with each volume and each foreign loop device).
///
/// Each device is kept with its disk sequence number: after a detach a
/// host tool's `losetup -f <pool file>` may get the same device number,
/// and that device is not the pool's (the alias check must see it as
/// another device exposing the volume, not adopt it).
#[derive(Debug, Default)]
pub(super) struct LoopIndex(Mutex<BTreeMap<PathBuf, Vec<Bound>>>);

/// A device node and the disk sequence number of the attach it stands for.
pub(super) type Bound = (PathBuf, Option<u64>);

impl LoopIndex {
    pub(super) fn read(dir: &Path) -> Result<LoopIndex> {
        let mut map: BTreeMap<PathBuf, Vec<Bound>> = BTreeMap::new();
        for s in crust_blockdev::list_loops().map_err(loop_err)? {
            if s.backing_file.parent() == Some(dir) {
                map.entry(s.backing_file)
                    .or_default()
                    .push((s.path, s.diskseq));
            }
        }
        Ok(LoopIndex(Mutex::new(map)))
    }

    /// Every device bound to `file` (also to a deleted earlier copy at the
    /// same path), lowest number first; entries gone stale (detached, or
    /// the number now bound by another attach) are dropped.
    pub(super) fn devices(&self, file: &Path) -> Result<Vec<LoopStatus>> {
        let mut map = lock(&self.0);
        let Some(devs) = map.get_mut(file) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for (d, seq) in devs.iter() {
            match crust_blockdev::loop_status(d) {
                Ok(Some(s)) if s.backing_file == file && s.diskseq == *seq => out.push(s),
                Ok(_) => {}
                Err(LoopError::Device(e)) if e.is_not_found() => {}
                Err(e) => return Err(loop_err(e)),
            }
        }
        devs.retain(|(d, _)| out.iter().any(|s| &s.path == d));
        if devs.is_empty() {
            map.remove(file);
        }
        out.sort_by_key(|s| s.number);
        Ok(out)
    }

    /// The device bound to the current `file`, if any.
    pub(super) fn live(&self, file: &Path) -> Result<Option<PathBuf>> {
        Ok(self
            .devices(file)?
            .into_iter()
            .find(|s| !s.backing_deleted)
            .map(|s| s.path))
    }

    /// Drops what is known of a deleted volume's file.
    pub(super) fn forget(&self, file: &Path) {
        lock(&self.0).remove(file);
    }

    /// Records `dev`, just attached to `file` by this process.
    pub(super) fn add(&self, file: &Path, dev: &Path) -> Result<()> {
        let status = crust_blockdev::loop_status(dev).map_err(|e| {
            // Ours, but unreadable: not left attached unrecorded.
            let _ = crust_blockdev::detach(dev);
            loop_err(e)
        })?;
        let seq = match status {
            Some(s) if s.backing_file == file => s.diskseq,
            // Detached and taken by someone else meanwhile: not ours to undo.
            _ => {
                return Err(BackendError::Device(format!(
                    "{} lost its binding to {} right after the attach",
                    dev.display(),
                    file.display()
                )));
            }
        };
        let mut map = lock(&self.0);
        let devs = map.entry(file.to_path_buf()).or_default();
        devs.retain(|(d, _)| d != dev);
        devs.push((dev.to_path_buf(), seq));
        Ok(())
    }
}

pub(super) fn loop_err(e: LoopError) -> BackendError {
    BackendError::Device(e.to_string())
}
