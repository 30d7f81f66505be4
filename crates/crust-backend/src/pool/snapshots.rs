//! Snapshots, snapshot groups and volumes filled from a copy: their
//! files are written under a temp name and entered as pending, so a crash
//! leaves nothing half made (settled at open by `settle_pending`).

use std::fs::OpenOptions;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::index::{
    Entry, GroupEntry, LEGACY_BLOCK_SIZE, Made, SnapEntry, State, image_name, now_ms,
};
use super::{PoolBackend, SNAPSHOTS};
use crate::util::{self, io_err, lock};
use crate::{Allocation, BackendError, ContentSource, GroupInfo, Result, SnapshotInfo};

impl PoolBackend {
    pub(super) fn snapshot_volume(
        &self,
        snapshot_id: &str,
        source_volume_id: &str,
        group: Option<&str>,
    ) -> Result<SnapshotInfo> {
        util::validate_id(snapshot_id)?;
        // Source first, then the snapshot: the same order everywhere.
        let _src = self.ids.lock(source_volume_id);
        let _snap = self.ids.lock(snapshot_id);
        let (file, src_path, src_size) = {
            let mut st = lock(&self.state);
            if let Some(e) = st.index.snapshots.get(snapshot_id) {
                if e.source_volume_id != source_volume_id || e.group_id.as_deref() != group {
                    return Err(BackendError::SnapshotConflict {
                        id: snapshot_id.to_owned(),
                        existing_source: e.source_volume_id.clone(),
                        requested_source: source_volume_id.to_owned(),
                    });
                }
                if !e.pending {
                    return Ok(Self::snapshot_info(snapshot_id, e));
                }
            }
            let src = st
                .index
                .volumes
                .get(source_volume_id)
                .filter(|e| !e.pending)
                .cloned()
                .ok_or_else(|| BackendError::NotFound(source_volume_id.to_owned()))?;
            let src_path = self.dir.join(&src.file);
            // A snapshot holds at most what its source holds now.
            let estimate = std::fs::metadata(&src_path)
                .map(|m| m.blocks() * 512)
                .map_err(io_err(&src_path))?;
            let available = self.available(&st)?;
            if estimate > available {
                return Err(BackendError::Exhausted {
                    requested: estimate,
                    available,
                });
            }
            let file = image_name(snapshot_id);
            st.index.snapshots.insert(
                snapshot_id.to_owned(),
                SnapEntry {
                    file: file.clone(),
                    source_volume_id: source_volume_id.to_owned(),
                    size_bytes: src.size_bytes,
                    allocated_bytes: estimate,
                    created_unix_ms: now_ms(),
                    method: String::new(),
                    group_id: group.map(str::to_owned),
                    pending: true,
                    block_size: Some(src.block_size()),
                },
            );
            st.reserved += estimate;
            if let Err(e) = self.persist(&mut st) {
                st.reserved -= estimate;
                st.index.snapshots.remove(snapshot_id);
                return Err(e);
            }
            (file, src_path, src.size_bytes)
        };
        let sdir = self.snapshots_dir();
        let copied = util::ensure_private_dir(&sdir)
            .and_then(|_| Self::copy_into_place(&src_path, &sdir.join(&file)));
        let mut st = lock(&self.state);
        let estimate = st
            .index
            .snapshots
            .get(snapshot_id)
            .map(|e| e.allocated_bytes)
            .unwrap_or(0);
        st.reserved -= estimate;
        let outcome = match copied {
            Ok(o) => o,
            Err(e) => {
                st.index.snapshots.remove(snapshot_id);
                let _ = self.persist(&mut st);
                return Err(e);
            }
        };
        let allocated = std::fs::metadata(sdir.join(&file))
            .map(|m| m.blocks() * 512)
            .unwrap_or(estimate);
        let entry = st
            .index
            .snapshots
            .get_mut(snapshot_id)
            .expect("inserted above, under the id lock");
        entry.pending = false;
        entry.allocated_bytes = allocated;
        entry.method = outcome.method.as_str().to_owned();
        entry.size_bytes = src_size;
        let info = Self::snapshot_info(snapshot_id, entry);
        // If this write fails the entry stays pending on disk and the next
        // open completes it (the file is in place).
        self.persist(&mut st)?;
        tracing::info!(snapshot = %snapshot_id, volume = %source_volume_id, method = outcome.method.as_str(),
            copied = outcome.bytes_copied, "snapshot cut");
        Ok(info)
    }

    pub(super) fn remove_snapshot(&self, snapshot_id: &str) -> Result<()> {
        let _snap = self.ids.lock(snapshot_id);
        let Some(entry) = lock(&self.state).index.snapshots.get(snapshot_id).cloned() else {
            return Ok(());
        };
        let path = self.snapshots_dir().join(&entry.file);
        match std::fs::remove_file(&path) {
            Ok(()) => util::fsync_dir(&self.snapshots_dir())?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&path)(e)),
        }
        let mut st = lock(&self.state);
        st.index.snapshots.remove(snapshot_id);
        self.persist(&mut st)?;
        tracing::info!(snapshot = %snapshot_id, "snapshot deleted");
        Ok(())
    }

    pub(super) fn snapshot_list(&self) -> Result<Vec<SnapshotInfo>> {
        let st = lock(&self.state);
        let complete_group = |g: &Option<String>| match g {
            None => true,
            Some(g) => st.index.groups.get(g).is_some_and(|g| g.complete),
        };
        Ok(st
            .index
            .snapshots
            .iter()
            .filter(|(_, e)| !e.pending && complete_group(&e.group_id))
            .map(|(id, e)| Self::snapshot_info(id, e))
            .collect())
    }

    pub(super) fn fill_from(
        &self,
        volume_id: &str,
        size_bytes: u64,
        source: &ContentSource,
    ) -> Result<Allocation> {
        util::validate_id(volume_id)?;
        // The source cannot be deleted or grown while it is copied; locked
        // before the new volume, the order every two-id call uses.
        let _src = self.ids.lock(match source {
            ContentSource::Snapshot(id) | ContentSource::Volume(id) => id,
        });
        let _id = self.ids.lock(volume_id);
        let (name, src_path, src_size) = {
            let mut st = lock(&self.state);
            if let Some(e) = st.index.volumes.get(volume_id).filter(|e| !e.pending) {
                return if e.size_bytes == size_bytes {
                    Ok(self.allocation(volume_id, e))
                } else {
                    Err(BackendError::SizeMismatch {
                        id: volume_id.to_owned(),
                        existing: e.size_bytes,
                        requested: size_bytes,
                    })
                };
            }
            let (src_path, src_size, block_size) = self.copy_source(&st, source)?;
            if size_bytes < src_size {
                return Err(BackendError::OutOfRange(
                    size_bytes,
                    format!("smaller than its source ({src_size} bytes)"),
                ));
            }
            let name = self.room_for(&st, volume_id, size_bytes)?;
            st.index.volumes.insert(
                volume_id.to_owned(),
                Entry {
                    file: name.clone(),
                    size_bytes,
                    pending: true,
                    made: Some(Made::Copy),
                    block_size: Some(block_size),
                },
            );
            st.reserved += size_bytes;
            if let Err(e) = self.persist(&mut st) {
                st.reserved -= size_bytes;
                st.index.volumes.remove(volume_id);
                return Err(e);
            }
            (name, src_path, src_size)
        };
        let path = self.dir.join(&name);
        let copied = (|| -> Result<()> {
            // The copy keeps the temp name until it has the new size too.
            let tmp = self.dir.join(format!("{}{name}", util::TMP_PREFIX));
            let _ = std::fs::remove_file(&tmp);
            crust_blockdev::clone_file(&src_path, &tmp, 0o600)
                .map_err(|e| io_err(&e.dst.clone())(e.source))?;
            if size_bytes > src_size {
                let f = OpenOptions::new()
                    .write(true)
                    .open(&tmp)
                    .map_err(io_err(&tmp))?;
                f.set_len(size_bytes).map_err(io_err(&tmp))?;
                f.sync_all().map_err(io_err(&tmp))?;
            }
            std::fs::rename(&tmp, &path).map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                io_err(&path)(e)
            })?;
            util::fsync_dir(&self.dir)
        })();
        let mut st = lock(&self.state);
        st.reserved -= size_bytes;
        if let Err(e) = copied {
            st.index.volumes.remove(volume_id);
            let _ = self.persist(&mut st);
            return Err(e);
        }
        let entry = st
            .index
            .volumes
            .get_mut(volume_id)
            .expect("inserted above, under the id lock");
        entry.pending = false;
        let alloc = self.allocation(volume_id, entry);
        self.persist(&mut st)?;
        tracing::info!(volume = %volume_id, size = size_bytes, source = ?source, "pool volume created from a copy");
        Ok(alloc)
    }

    /// The file, size and sector size of a copy's source (a copy keeps
    /// its source's sectors: its filesystem was made on them).
    fn copy_source(&self, st: &State, source: &ContentSource) -> Result<(PathBuf, u64, u32)> {
        Ok(match source {
            ContentSource::Snapshot(id) => {
                let e = st
                    .index
                    .snapshots
                    .get(id)
                    .filter(|e| !e.pending)
                    .ok_or_else(|| BackendError::SnapshotNotFound(id.clone()))?;
                (
                    self.snapshots_dir().join(&e.file),
                    e.size_bytes,
                    e.block_size.unwrap_or(LEGACY_BLOCK_SIZE),
                )
            }
            ContentSource::Volume(id) => {
                let e = st
                    .index
                    .volumes
                    .get(id)
                    .filter(|e| !e.pending)
                    .ok_or_else(|| BackendError::NotFound(id.clone()))?;
                (self.dir.join(&e.file), e.size_bytes, e.block_size())
            }
        })
    }

    pub(super) fn group_begin(&self, group_id: &str, source_volume_ids: &[String]) -> Result<()> {
        util::validate_id(group_id)?;
        let mut st = lock(&self.state);
        if let Some(g) = st.index.groups.get(group_id) {
            if g.source_volume_ids != source_volume_ids {
                return Err(BackendError::SnapshotConflict {
                    id: group_id.to_owned(),
                    existing_source: g.source_volume_ids.join(","),
                    requested_source: source_volume_ids.join(","),
                });
            }
            return Ok(());
        }
        st.index.groups.insert(
            group_id.to_owned(),
            GroupEntry {
                source_volume_ids: source_volume_ids.to_vec(),
                snapshot_ids: Vec::new(),
                created_unix_ms: now_ms(),
                complete: false,
            },
        );
        self.persist(&mut st)
    }

    pub(super) fn group_complete(
        &self,
        group_id: &str,
        snapshot_ids: &[String],
    ) -> Result<GroupInfo> {
        let mut st = lock(&self.state);
        let complete = snapshot_ids.iter().all(|id| {
            st.index
                .snapshots
                .get(id)
                .is_some_and(|e| !e.pending && e.group_id.as_deref() == Some(group_id))
        });
        let g = st
            .index
            .groups
            .get_mut(group_id)
            .ok_or_else(|| BackendError::SnapshotNotFound(group_id.to_owned()))?;
        if !complete {
            return Err(BackendError::Device(format!(
                "group snapshot {group_id} is missing members"
            )));
        }
        g.snapshot_ids = snapshot_ids.to_vec();
        g.complete = true;
        let info = GroupInfo {
            group_id: group_id.to_owned(),
            source_volume_ids: g.source_volume_ids.clone(),
            snapshot_ids: g.snapshot_ids.clone(),
            created_unix_ms: g.created_unix_ms,
        };
        self.persist(&mut st)?;
        Ok(info)
    }

    pub(super) fn group_get(&self, group_id: &str) -> Result<Option<(GroupInfo, bool)>> {
        let st = lock(&self.state);
        Ok(st.index.groups.get(group_id).map(|g| {
            (
                GroupInfo {
                    group_id: group_id.to_owned(),
                    source_volume_ids: g.source_volume_ids.clone(),
                    snapshot_ids: g.snapshot_ids.clone(),
                    created_unix_ms: g.created_unix_ms,
                },
                g.complete,
            )
        }))
    }

    pub(super) fn group_remove(&self, group_id: &str) -> Result<()> {
        let members: Vec<String> = {
            let st = lock(&self.state);
            st.index
                .snapshots
                .iter()
                .filter(|(_, e)| e.group_id.as_deref() == Some(group_id))
                .map(|(id, _)| id.clone())
                .collect()
        };
        for id in members {
            self.remove_snapshot(&id)?;
        }
        let mut st = lock(&self.state);
        if st.index.groups.remove(group_id).is_some() {
            self.persist(&mut st)?;
        }
        Ok(())
    }

    pub(super) fn snapshots_dir(&self) -> PathBuf {
        self.dir.join(SNAPSHOTS)
    }

    /// Finishes or forgets what a crash interrupted (run at open): an
    /// entry still pending whose final file exists was renamed into place
    /// after its data was synced, so it is complete; one without its file
    /// never finished and goes (its temp file was removed with the other
    /// stale temps). A group still pending is forgotten with its members:
    /// members cut in another freeze than their siblings would not be
    /// write-order consistent, so a retry cuts them all again.
    pub(super) fn settle_pending(&self, st: &mut State) -> Result<bool> {
        let mut changed = false;
        util::remove_stale_temps(&self.snapshots_dir());
        let pending: Vec<String> = st
            .index
            .volumes
            .iter()
            .filter(|(_, e)| e.pending)
            .map(|(id, _)| id.clone())
            .collect();
        for id in pending {
            changed = true;
            let e = st.index.volumes.get_mut(&id).expect("listed above");
            if self.dir.join(&e.file).is_file() {
                tracing::info!(volume = %id, "completing a volume clone interrupted after its copy");
                e.pending = false;
            } else {
                tracing::info!(volume = %id, "dropping a volume clone that did not finish");
                st.index.volumes.remove(&id);
            }
        }
        let pending_groups: Vec<String> = st
            .index
            .groups
            .iter()
            .filter(|(_, g)| !g.complete)
            .map(|(id, _)| id.clone())
            .collect();
        let mut doomed: Vec<String> = Vec::new();
        for g in pending_groups {
            changed = true;
            tracing::info!(group = %g, "dropping a group snapshot that did not finish");
            st.index.groups.remove(&g);
            doomed.extend(
                st.index
                    .snapshots
                    .iter()
                    .filter(|(_, e)| e.group_id.as_deref() == Some(g.as_str()))
                    .map(|(id, _)| id.clone()),
            );
        }
        let pending_snaps: Vec<String> = st
            .index
            .snapshots
            .iter()
            .filter(|(_, e)| e.pending)
            .map(|(id, _)| id.clone())
            .collect();
        for id in pending_snaps {
            changed = true;
            let e = st.index.snapshots.get_mut(&id).expect("listed above");
            if self.snapshots_dir().join(&e.file).is_file() {
                tracing::info!(snapshot = %id, "completing a snapshot interrupted after its copy");
                e.pending = false;
            } else {
                tracing::info!(snapshot = %id, "dropping a snapshot whose copy did not finish");
                st.index.snapshots.remove(&id);
            }
        }
        for id in doomed {
            if let Some(e) = st.index.snapshots.remove(&id) {
                let path = self.snapshots_dir().join(&e.file);
                match std::fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                    Err(err) => return Err(io_err(&path)(err)),
                }
            }
        }
        Ok(changed)
    }

    /// Snapshot files the index does not know are copies whose creation
    /// was never acknowledged: removed, so a crash leaks no space.
    pub(super) fn remove_unindexed_snapshots(&self, st: &State) -> Result<()> {
        let dir = self.snapshots_dir();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Ok(());
        };
        let known: std::collections::HashSet<&str> = st
            .index
            .snapshots
            .values()
            .map(|e| e.file.as_str())
            .collect();
        let mut removed = false;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".img") && !known.contains(name.as_str()) {
                tracing::info!(file = %e.path().display(), "removing a snapshot file no index entry owns (interrupted create)");
                std::fs::remove_file(e.path()).map_err(io_err(&e.path()))?;
                removed = true;
            }
        }
        if removed {
            util::fsync_dir(&dir)?;
        }
        Ok(())
    }

    pub(super) fn snapshot_info(id: &str, e: &SnapEntry) -> SnapshotInfo {
        SnapshotInfo {
            snapshot_id: id.to_owned(),
            source_volume_id: e.source_volume_id.clone(),
            size_bytes: e.size_bytes,
            allocated_bytes: e.allocated_bytes,
            created_unix_ms: e.created_unix_ms,
            method: e.method.clone(),
            group_id: e.group_id.clone(),
        }
    }

    /// Copies `src` to `final_path` through a temp file in the same
    /// directory: copy, fsync, rename, fsync the directory.
    pub(super) fn copy_into_place(
        src: &Path,
        final_path: &Path,
    ) -> Result<crust_blockdev::CopyOutcome> {
        let dir = final_path.parent().unwrap_or(Path::new("."));
        let name = final_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dir.join(format!("{}{name}", util::TMP_PREFIX));
        let _ = std::fs::remove_file(&tmp);
        let outcome = crust_blockdev::clone_file(src, &tmp, 0o600).map_err(|e| {
            let path = e.dst.clone();
            io_err(&path)(e.source)
        })?;
        std::fs::rename(&tmp, final_path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io_err(final_path)(e)
        })?;
        util::fsync_dir(dir)?;
        Ok(outcome)
    }
}
