//! The embedded default backend: sparse files attached as loop devices.
//!
//! Layout of the pool directory (mode 0700):
//!
//! ```text
//! <dir>/index.json        volume id -> {file, size_bytes, made, block_size}; the source of truth
//! <dir>/<name>.img        one sparse file per volume (mode 0600)
//! <dir>/quarantine/       orphaned files that hold data (never deleted by crust)
//! <dir>/.lock             flock held while a PoolBackend is open
//! ```
//!
//! `<name>` is the volume id itself when it only uses `[A-Za-z0-9._-]`
//! (not starting with `.`, at most 128 bytes), otherwise a sanitised
//! prefix plus 16 hex digits of its SHA-256.
//!
//! ## Crash safety
//! Create writes the file (O_EXCL, ftruncate, fsync) before the index
//! entry; delete removes the file before the entry; expand grows the file
//! before the entry. So after a crash the index may lack an entry for a
//! file, or list a file that is gone, or list a smaller size. [`PoolBackend::open`]
//! reconciles:
//!
//! * file without entry, no blocks allocated (`st_blocks == 0`): nothing
//!   was ever written, it is a create that did not finish: removed;
//! * file without entry that holds data: moved to `quarantine/` with a
//!   timestamp suffix and logged; never deleted, never counted;
//! * entry without file: kept, so the CO still sees the volume,
//!   [`Backend::backing_state`] reports it `Missing`, and a retried
//!   DeleteVolume removes the entry;
//! * file larger than its entry: an expand that did not finish: the
//!   entry adopts the file's size (growing never loses data); a file
//!   smaller than its entry is left alone and reported `Degraded`, unless
//!   it never held data (no blocks): a create whose size did not reach the
//!   disk, grown to its entry's size.
//!
//! ## Deferred index ([`IndexSync::Deferred`])
//! For a caller that keeps its own durable record of every volume and
//! settles the pool against it at start (crust-csi), plain creates and
//! deletes cost no index write: a create makes the sparse file (no fsync:
//! it holds nothing yet) and changes the index in memory; a delete unlinks
//! the file, fsyncs the directory (skipped when the volume's creation was
//! itself never written: nothing can have reached its file) and changes the
//! index in memory. The index is written, every deferred change at once
//! (group commit), before a loop attach (so a volume's entry and file are
//! durable before any data can reach the file), with any other index
//! change (expand, snapshots, clones), by [`PoolBackend::flush`] and on
//! drop. After a crash the disk then holds one of the states listed above,
//! and the caller's records decide: an entry or empty file whose volume has
//! no record is deleted, a record whose never-used volume is missing is
//! created again (see crust-csi's `Driver::settle`).
//!
//! ## Concurrency
//! One mutex guards the in-memory index (and the index write, a small
//! fsynced file). File creation, truncation, loop attach/detach run
//! outside it; operations on the same volume id are serialised by a
//! per-id lock, and in-flight creates/expands reserve their bytes so
//! concurrent creates cannot overcommit.

use std::fs::OpenOptions;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crust_blockdev::{AttachOptions, LoopDevice, LoopError};

mod health;
mod index;
mod loops;
mod snapshots;

use crate::util::{self, IdLocks, io_err, lock};
use crate::{
    Allocation, Backend, BackendError, BackingState, Blankness, Capacity, ContentSource, GroupInfo,
    Result, SnapshotInfo, StorageProblem,
};
use index::{Entry, Index, Made, State, image_name};
use loops::{LoopIndex, loop_err};

/// Smallest volume the pool creates unless configured otherwise.
pub const DEFAULT_MINIMUM_VOLUME_SIZE: u64 = 1 << 20;

const INDEX: &str = "index.json";
const LOCK: &str = ".lock";
const QUARANTINE: &str = "quarantine";
const SNAPSHOTS: &str = "snapshots";
/// Version 2 added snapshots, groups and pending entries; version 1
/// indexes are read as version 2 with none of them.
const INDEX_VERSION: u32 = 2;

/// Configuration of a [`PoolBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Directory holding the images and the index; created (0700) if
    /// missing.
    pub dir: PathBuf,
    /// Total bytes the pool may hand out (sum of volume sizes).
    pub capacity_bytes: u64,
    /// Smallest volume size accepted.
    pub minimum_volume_size: u64,
    /// When plain creates and deletes write the index.
    pub index_sync: IndexSync,
}

/// When the pool writes its index for plain creates and deletes (module
/// docs, "Deferred index").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IndexSync {
    /// Every change is durable when the call returns.
    #[default]
    EveryChange,
    /// Written before an attach, with other index changes, by `flush` and
    /// on drop; for a caller that records volumes durably itself.
    Deferred,
}

impl PoolConfig {
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        PoolConfig {
            dir: dir.into(),
            capacity_bytes,
            minimum_volume_size: DEFAULT_MINIMUM_VOLUME_SIZE,
            index_sync: IndexSync::EveryChange,
        }
    }
}

/// Sparse-file pool backend; see the module docs.
#[derive(Debug)]
pub struct PoolBackend {
    config: PoolConfig,
    dir: PathBuf,
    state: Mutex<State>,
    ids: IdLocks,
    loops: LoopIndex,
    _lock: util::DirLock,
}

impl PoolBackend {
    /// Opens (creating if needed) the pool in `config.dir`, takes its lock
    /// (a second open of the same directory fails until the first is
    /// dropped), and reconciles the index with the files (see the module
    /// docs). A corrupt index is an error: a person must look at it.
    pub fn open(config: PoolConfig) -> Result<Self> {
        if config.minimum_volume_size == 0 {
            return Err(BackendError::Invalid(
                "minimum volume size must be at least 1 byte".into(),
            ));
        }
        util::ensure_private_dir(&config.dir)?;
        let dir = std::fs::canonicalize(&config.dir).map_err(io_err(&config.dir))?;
        let lock_file = util::DirLock::acquire(
            &dir.join(LOCK),
            &format!("pool directory {}", dir.display()),
        )?;
        util::remove_stale_temps(&dir);
        let index_path = dir.join(INDEX);
        let index = match std::fs::read(&index_path) {
            Ok(bytes) => {
                let index: Index = serde_json::from_slice(&bytes).map_err(|e| {
                    BackendError::Invalid(format!(
                        "pool index {} is corrupt ({e}); refusing to guess, fix or move it away",
                        index_path.display()
                    ))
                })?;
                if index.version != INDEX_VERSION && index.version != 1 {
                    return Err(BackendError::Invalid(format!(
                        "pool index {} has version {}, this build understands {INDEX_VERSION}",
                        index_path.display(),
                        index.version
                    )));
                }
                index
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Index {
                version: INDEX_VERSION,
                ..Index::default()
            },
            Err(e) => return Err(io_err(&index_path)(e)),
        };
        let loops = LoopIndex::read(&dir)?;
        let pool = PoolBackend {
            config,
            dir,
            state: Mutex::new(State {
                index,
                ..State::default()
            }),
            ids: IdLocks::default(),
            loops,
            _lock: lock_file,
        };
        pool.reconcile()?;
        Ok(pool)
    }

    /// The pool directory (canonical).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where orphaned files holding data are moved.
    pub fn quarantine_dir(&self) -> PathBuf {
        self.dir.join(QUARANTINE)
    }

    /// The backing file of a volume, if it is in the index.
    pub fn backing_file(&self, volume_id: &str) -> Option<PathBuf> {
        lock(&self.state)
            .index
            .volumes
            .get(volume_id)
            .map(|e| self.dir.join(&e.file))
    }

    fn reconcile(&self) -> Result<()> {
        let mut st = lock(&self.state);
        let mut changed = st.index.version != INDEX_VERSION;
        st.index.version = INDEX_VERSION;
        changed |= self.settle_pending(&mut st)?;
        for (id, entry) in st.index.volumes.iter_mut() {
            let path = self.dir.join(&entry.file);
            match std::fs::metadata(&path) {
                Ok(m) if m.len() > entry.size_bytes => {
                    tracing::warn!(volume = %id, file = %path.display(), index = entry.size_bytes, file_size = m.len(),
                        "backing file larger than the index (interrupted expand); adopting the file size");
                    entry.size_bytes = m.len();
                    changed = true;
                }
                Ok(m) if m.len() < entry.size_bytes && m.blocks() == 0 && m.is_file() => {
                    tracing::warn!(volume = %id, file = %path.display(), "backing file smaller than the index and never written (a create whose size did not reach the disk); growing it");
                    let grown = OpenOptions::new()
                        .write(true)
                        .open(&path)
                        .and_then(|f| f.set_len(entry.size_bytes).and_then(|_| f.sync_all()));
                    grown.map_err(io_err(&path))?;
                }
                Ok(m) if m.len() < entry.size_bytes => {
                    tracing::warn!(volume = %id, file = %path.display(), "backing file smaller than the index; reporting it degraded");
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    tracing::warn!(volume = %id, file = %path.display(), "backing file is missing; keeping the index entry so the volume reports Missing");
                }
                Err(e) => return Err(io_err(&path)(e)),
            }
        }
        self.remove_unindexed_snapshots(&st)?;
        let known: std::collections::HashSet<&str> =
            st.index.volumes.values().map(|e| e.file.as_str()).collect();
        let entries = std::fs::read_dir(&self.dir).map_err(io_err(&self.dir))?;
        let mut orphans = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".img") && !known.contains(name.as_str()) {
                orphans.push(e.path());
            }
        }
        for path in orphans {
            let meta = std::fs::symlink_metadata(&path).map_err(io_err(&path))?;
            if meta.is_file() && meta.blocks() == 0 {
                tracing::info!(file = %path.display(), "removing orphaned image that never held data (interrupted create)");
                std::fs::remove_file(&path).map_err(io_err(&path))?;
            } else {
                let qdir = self.quarantine_dir();
                util::ensure_private_dir(&qdir)?;
                let stamp = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                let dest = qdir.join(format!(
                    "{}.{stamp}",
                    path.file_name().unwrap_or_default().to_string_lossy()
                ));
                tracing::warn!(file = %path.display(), dest = %dest.display(),
                    "image holds data but no volume owns it; quarantined (not deleted)");
                std::fs::rename(&path, &dest).map_err(io_err(&path))?;
            }
            util::fsync_dir(&self.dir)?;
        }
        if changed {
            self.persist(&mut st)?;
        }
        Ok(())
    }

    /// Writes the whole index (and with it every deferred change).
    fn persist(&self, st: &mut State) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(&st.index)
            .map_err(|e| BackendError::Invalid(format!("serialising pool index: {e}")))?;
        util::atomic_write(&self.dir.join(INDEX), &bytes)?;
        st.dirty = false;
        st.unwritten.clear();
        Ok(())
    }

    /// A plain create's or delete's index change: written now, or left
    /// for the next write ([`IndexSync::Deferred`]).
    fn commit(&self, st: &mut State) -> Result<()> {
        match self.config.index_sync {
            IndexSync::EveryChange => self.persist(st),
            IndexSync::Deferred => {
                st.dirty = true;
                Ok(())
            }
        }
    }

    /// Writes deferred index changes, if any ([`IndexSync::Deferred`]).
    pub fn flush(&self) -> Result<()> {
        let mut st = lock(&self.state);
        if st.dirty {
            self.persist(&mut st)
        } else {
            Ok(())
        }
    }

    /// The image file name of a new volume, once the pool has room for
    /// `size_bytes` and no other volume uses that name.
    fn room_for(&self, st: &State, volume_id: &str, size_bytes: u64) -> Result<String> {
        let available = self.available(st)?;
        if size_bytes > available {
            return Err(BackendError::Exhausted {
                requested: size_bytes,
                available,
            });
        }
        let name = image_name(volume_id);
        if st.index.volumes.values().any(|e| e.file == name) {
            return Err(BackendError::Device(format!(
                "image name {name} for volume {volume_id} collides with another volume"
            )));
        }
        Ok(name)
    }

    fn available(&self, st: &State) -> Result<u64> {
        let allocated: u64 = st.index.volumes.values().map(|e| e.size_bytes).sum::<u64>()
            + st.index
                .snapshots
                .values()
                .map(|e| e.allocated_bytes)
                .sum::<u64>();
        let by_config = self
            .config
            .capacity_bytes
            .saturating_sub(allocated.saturating_add(st.reserved));
        Ok(by_config.min(util::fs_free_bytes(&self.dir)?))
    }

    fn allocation(&self, id: &str, e: &Entry) -> Allocation {
        Allocation {
            volume_id: id.to_owned(),
            size_bytes: e.size_bytes,
            backing: self.dir.join(&e.file),
        }
    }

    fn entry(&self, id: &str) -> Option<Entry> {
        lock(&self.state)
            .index
            .volumes
            .get(id)
            .filter(|e| !e.pending)
            .cloned()
    }

    /// Detaches the given loop devices, turning "busy" into a clear error.
    fn detach_all(&self, id: &str, devices: &[PathBuf]) -> Result<()> {
        for dev in devices {
            crust_blockdev::detach(dev).map_err(|e| match e {
                LoopError::Busy { .. } => {
                    BackendError::Device(format!("volume {id} is in use: {e}"))
                }
                other => BackendError::Device(other.to_string()),
            })?;
        }
        Ok(())
    }
}

impl Drop for PoolBackend {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::error!(dir = %self.dir.display(), error = %e,
                "cannot write the pool index on close; the next open settles from the files");
        }
    }
}

impl Backend for PoolBackend {
    fn kind(&self) -> &'static str {
        "pool"
    }

    fn create(&self, volume_id: &str, size_bytes: u64, limit_bytes: u64) -> Result<Allocation> {
        util::validate_id(volume_id)?;
        let min = self.config.minimum_volume_size;
        if size_bytes < min {
            return Err(BackendError::OutOfRange(
                size_bytes,
                format!("the pool's minimum volume size is {min} bytes"),
            ));
        }
        if limit_bytes != 0 && size_bytes > limit_bytes {
            return Err(BackendError::OutOfRange(
                size_bytes,
                format!("larger than the limit of {limit_bytes} bytes"),
            ));
        }
        let _id = self.ids.lock(volume_id);
        let name = {
            let mut st = lock(&self.state);
            if let Some(e) = st.index.volumes.get(volume_id) {
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
            let name = self.room_for(&st, volume_id, size_bytes)?;
            st.reserved += size_bytes;
            name
        };
        let path = self.dir.join(&name);
        let deferred = self.config.index_sync == IndexSync::Deferred;
        let written = (|| -> std::io::Result<u32> {
            let f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)?;
            f.set_len(size_bytes)?;
            let block_size = crust_blockdev::dio_block_size(&path)?;
            // Deferred: nothing is in the file; the index write before
            // its first attach makes it durable (module docs).
            if !deferred {
                f.sync_all()?;
            }
            Ok(block_size)
        })();
        let mut st = lock(&self.state);
        st.reserved -= size_bytes;
        let block_size = match written {
            Ok(b) => b,
            Err(e) => {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    return Err(BackendError::Device(format!(
                        "{} already exists but no volume owns it; refusing to reuse it (move it away)",
                        path.display()
                    )));
                }
                let _ = std::fs::remove_file(&path);
                return Err(io_err(&path)(e));
            }
        };
        let entry = Entry {
            file: name,
            size_bytes,
            pending: false,
            made: Some(Made::Empty),
            block_size: Some(block_size),
        };
        st.index.volumes.insert(volume_id.to_owned(), entry.clone());
        let synced = if deferred {
            st.unwritten.insert(volume_id.to_owned());
            self.commit(&mut st)
        } else {
            util::fsync_dir(&self.dir).and_then(|_| self.persist(&mut st))
        };
        if let Err(e) = synced {
            st.index.volumes.remove(volume_id);
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        tracing::info!(volume = %volume_id, size = size_bytes, file = %path.display(), "pool volume created");
        Ok(self.allocation(volume_id, &entry))
    }

    fn delete(&self, volume_id: &str) -> Result<()> {
        let _id = self.ids.lock(volume_id);
        let Some(entry) = self.entry(volume_id) else {
            return Ok(());
        };
        let path = self.dir.join(&entry.file);
        // The data is going away, so stale devices on a deleted copy go too.
        let devices: Vec<PathBuf> = self
            .loops
            .devices(&path)?
            .into_iter()
            .map(|s| s.path)
            .collect();
        self.detach_all(volume_id, &devices)?;
        self.loops.forget(&path);
        // A volume whose creation was never written was never attached
        // either: its file holds nothing, and a crash that brings it back
        // leaves an empty orphan that open() removes.
        let never_written = lock(&self.state).unwritten.contains(volume_id);
        match std::fs::remove_file(&path) {
            Ok(()) if never_written => {}
            Ok(()) => util::fsync_dir(&self.dir)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&path)(e)),
        }
        let mut st = lock(&self.state);
        let removed = st.index.volumes.remove(volume_id);
        st.unwritten.remove(volume_id);
        if let Err(e) = self.commit(&mut st) {
            if let Some(r) = removed {
                st.index.volumes.insert(volume_id.to_owned(), r);
            }
            return Err(e);
        }
        tracing::info!(volume = %volume_id, "pool volume deleted");
        Ok(())
    }

    fn get(&self, volume_id: &str) -> Result<Option<Allocation>> {
        Ok(self
            .entry(volume_id)
            .map(|e| self.allocation(volume_id, &e)))
    }

    fn list(&self) -> Result<Vec<Allocation>> {
        let st = lock(&self.state);
        Ok(st
            .index
            .volumes
            .iter()
            .filter(|(_, e)| !e.pending)
            .map(|(id, e)| self.allocation(id, e))
            .collect())
    }

    fn expand(&self, volume_id: &str, new_size_bytes: u64) -> Result<u64> {
        let _id = self.ids.lock(volume_id);
        let entry = self
            .entry(volume_id)
            .ok_or_else(|| BackendError::NotFound(volume_id.to_owned()))?;
        let path = self.dir.join(&entry.file);
        let mut size = entry.size_bytes;
        if new_size_bytes > size {
            let delta = new_size_bytes - size;
            {
                let mut st = lock(&self.state);
                let available = self.available(&st)?;
                if delta > available {
                    return Err(BackendError::Exhausted {
                        requested: delta,
                        available,
                    });
                }
                st.reserved += delta;
            }
            let grown = (|| -> std::io::Result<()> {
                let f = OpenOptions::new().write(true).open(&path)?;
                f.set_len(new_size_bytes)?;
                f.sync_all()
            })();
            let mut st = lock(&self.state);
            st.reserved -= delta;
            if let Err(e) = grown {
                if e.kind() == std::io::ErrorKind::NotFound {
                    return Err(BackendError::Device(format!(
                        "backing file {} of volume {volume_id} was removed; cannot expand",
                        path.display()
                    )));
                }
                return Err(io_err(&path)(e));
            }
            if let Some(e) = st.index.volumes.get_mut(volume_id) {
                e.size_bytes = new_size_bytes;
            }
            if let Err(e) = self.persist(&mut st) {
                // The file stays larger; open() adopts that size later.
                if let Some(e) = st.index.volumes.get_mut(volume_id) {
                    e.size_bytes = size;
                }
                return Err(e);
            }
            size = new_size_bytes;
            tracing::info!(volume = %volume_id, size, "pool volume expanded");
        }
        // Also on the idempotent path: a previous call may have grown the
        // file and crashed before refreshing the device.
        if let Some(dev) = self.loops.live(&path)? {
            let dev_size = crust_blockdev::refresh_capacity(&dev).map_err(loop_err)?;
            if dev_size != size {
                return Err(BackendError::Device(format!(
                    "{} reports {dev_size} bytes after refreshing, expected {size}",
                    dev.display()
                )));
            }
        }
        Ok(size)
    }

    fn attach(&self, volume_id: &str) -> Result<PathBuf> {
        let _id = self.ids.lock(volume_id);
        let entry = self
            .entry(volume_id)
            .ok_or_else(|| BackendError::NotFound(volume_id.to_owned()))?;
        let path = self.dir.join(&entry.file);
        if !path.is_file() {
            return Err(BackendError::Device(format!(
                "backing file {} of volume {volume_id} was removed; cannot attach",
                path.display()
            )));
        }
        // Entry and file durable before any data can reach the file.
        self.flush()?;
        if let Some(dev) = self.loops.live(&path)? {
            // Found again (e.g. after a restart); catch up on an expand
            // that grew the file but never refreshed the device.
            let file_len = std::fs::metadata(&path).map_err(io_err(&path))?.len();
            if crust_blockdev::block_device_size(&dev)
                .map_err(|e| BackendError::Device(e.to_string()))?
                != file_len
            {
                crust_blockdev::refresh_capacity(&dev).map_err(loop_err)?;
            }
            return Ok(dev);
        }
        let opts = AttachOptions {
            read_only: false,
            direct_io: true,
            block_size: entry.block_size(),
        };
        let info = LoopDevice::attach(&path, opts).map_err(loop_err)?;
        self.loops.add(&path, &info.path)?;
        // The kernel keeps the page cache when the backing filesystem
        // cannot do direct I/O at this sector size: works, but say so.
        let direct_io = crust_blockdev::loop_status(&info.path)
            .map(|s| s.is_some_and(|s| s.direct_io))
            .unwrap_or(false);
        if direct_io {
            tracing::info!(volume = %volume_id, device = %info.path.display(),
                block_size = opts.block_size, "pool volume attached with direct I/O");
        } else {
            tracing::warn!(volume = %volume_id, device = %info.path.display(),
                block_size = opts.block_size,
                "pool volume attached with buffered I/O: the kernel refused direct I/O to its backing file");
        }
        Ok(info.path)
    }

    fn may_hold_data(&self, volume_id: &str) -> bool {
        let Some(entry) = lock(&self.state).index.volumes.get(volume_id).cloned() else {
            return false;
        };
        if entry.pending {
            return true;
        }
        let path = self.dir.join(&entry.file);
        match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            // Attached: writes may still sit in the page cache.
            Ok(m) if m.is_file() && m.blocks() == 0 => {
                !matches!(self.loops.devices(&path).as_deref(), Ok([]))
            }
            _ => true,
        }
    }

    fn blankness(&self, volume_id: &str) -> Result<Blankness> {
        let entry = self
            .entry(volume_id)
            .ok_or_else(|| BackendError::NotFound(volume_id.to_owned()))?;
        Ok(match entry.made {
            Some(Made::Empty) => Blankness::MadeEmpty,
            // An unrecorded entry may be a clone: never claim it was empty.
            Some(Made::Copy) | None => Blankness::Copy,
        })
    }

    fn attached_device(&self, volume_id: &str) -> Result<Option<PathBuf>> {
        let Some(entry) = self.entry(volume_id) else {
            return Ok(None);
        };
        self.loops.live(&self.dir.join(&entry.file))
    }

    fn detach(&self, volume_id: &str) -> Result<()> {
        let _id = self.ids.lock(volume_id);
        let Some(entry) = self.entry(volume_id) else {
            return Ok(());
        };
        let path = self.dir.join(&entry.file);
        let mut live = Vec::new();
        for s in self.loops.devices(&path)? {
            if s.backing_deleted {
                // That device holds the only remaining copy of the data.
                tracing::warn!(volume = %volume_id, device = %s.path.display(),
                    "leaving loop device attached: its backing file was deleted and it holds the last copy of the data");
            } else {
                live.push(s.path);
            }
        }
        self.detach_all(volume_id, &live)
    }

    fn capacity(&self) -> Result<Capacity> {
        let st = lock(&self.state);
        let available = self.available(&st)?;
        Ok(Capacity {
            available_bytes: available,
            maximum_volume_size: available,
            minimum_volume_size: self.config.minimum_volume_size,
        })
    }

    fn probe(&self) -> Result<()> {
        rustix::fs::access(&self.dir, rustix::fs::Access::WRITE_OK).map_err(|e| {
            BackendError::Device(format!(
                "pool directory {} is not writable: {e}",
                self.dir.display()
            ))
        })?;
        // Opened, not just looked up: a container whose device cgroup or
        // /dev mount withholds it sees the node but cannot use it.
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/loop-control")
            .map_err(|e| {
                BackendError::Device(format!(
                    "/dev/loop-control cannot be opened ({e}): load the loop module, or give \
                     the plugin the host's /dev"
                ))
            })?;
        Ok(())
    }

    fn backing_state(&self, volume_id: &str) -> BackingState {
        self.backing_health(volume_id)
    }

    fn supports_snapshots(&self) -> bool {
        true
    }

    fn create_snapshot(
        &self,
        snapshot_id: &str,
        source_volume_id: &str,
        group: Option<&str>,
    ) -> Result<SnapshotInfo> {
        self.snapshot_volume(snapshot_id, source_volume_id, group)
    }

    fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
        self.remove_snapshot(snapshot_id)
    }

    fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        self.snapshot_list()
    }

    fn create_from(
        &self,
        volume_id: &str,
        size_bytes: u64,
        source: &ContentSource,
    ) -> Result<Allocation> {
        self.fill_from(volume_id, size_bytes, source)
    }

    fn begin_group(&self, group_id: &str, source_volume_ids: &[String]) -> Result<()> {
        self.group_begin(group_id, source_volume_ids)
    }

    fn complete_group(&self, group_id: &str, snapshot_ids: &[String]) -> Result<GroupInfo> {
        self.group_complete(group_id, snapshot_ids)
    }

    fn get_group(&self, group_id: &str) -> Result<Option<(GroupInfo, bool)>> {
        self.group_get(group_id)
    }

    fn delete_group(&self, group_id: &str) -> Result<()> {
        self.group_remove(group_id)
    }

    fn storage_health(&self) -> Vec<StorageProblem> {
        self.pool_health()
    }
}
