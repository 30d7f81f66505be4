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

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crust_blockdev::{AttachOptions, LoopDevice, LoopError, LoopStatus};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::util::{self, IdLocks, io_err, lock};
use crate::{
    Allocation, Backend, BackendError, BackingState, Blankness, Capacity, ContentSource, GroupInfo,
    Result, SnapshotInfo, StorageProblem,
};

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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    /// File name inside the pool directory.
    file: String,
    size_bytes: u64,
    /// A volume being filled from a snapshot or another volume: its file
    /// is written under a temp name and renamed when complete (see
    /// [`PoolBackend::reconcile`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pending: bool,
    /// How the file was made (for [`Backend::blankness`]). `None` in
    /// indexes written before it was recorded: such an entry may be a
    /// clone as well as an empty create, so it answers `Copy` and the
    /// plugin's own record of the volume's content source decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    made: Option<Made>,
    /// Logical block size of its loop device, fixed when the volume is
    /// made (a filesystem mounts only on the sector size it was made on).
    /// `None` in entries written before it was recorded: those were
    /// always attached with 512-byte sectors, so they keep 512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    block_size: Option<u32>,
}

/// Sector size of volumes made before the pool recorded one.
const LEGACY_BLOCK_SIZE: u32 = 512;

impl Entry {
    fn block_size(&self) -> u32 {
        self.block_size.unwrap_or(LEGACY_BLOCK_SIZE)
    }
}

/// How a volume's file was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Made {
    /// `create`: a new sparse file, all zeros.
    Empty,
    /// `create_from`: a copy of a volume or a snapshot.
    Copy,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SnapEntry {
    /// File name inside `snapshots/`.
    file: String,
    source_volume_id: String,
    size_bytes: u64,
    allocated_bytes: u64,
    created_unix_ms: i64,
    method: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    group_id: Option<String>,
    /// Being copied; never reported (see [`PoolBackend::reconcile`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pending: bool,
    /// The source volume's block size, which volumes restored from this
    /// snapshot keep (`None`: 512, as for [`Entry::block_size`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    block_size: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct GroupEntry {
    source_volume_ids: Vec<String>,
    snapshot_ids: Vec<String>,
    created_unix_ms: i64,
    complete: bool,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Index {
    version: u32,
    volumes: BTreeMap<String, Entry>,
    #[serde(default)]
    snapshots: BTreeMap<String, SnapEntry>,
    #[serde(default)]
    groups: BTreeMap<String, GroupEntry>,
}

#[derive(Debug, Default)]
struct State {
    index: Index,
    /// Bytes promised to creates/expands still writing their files.
    reserved: u64,
    /// The in-memory index has changes the file on disk lacks
    /// ([`IndexSync::Deferred`]).
    dirty: bool,
    /// Volumes created since the index was last written: neither their
    /// entry nor their file is known durable, and nothing was attached.
    unwritten: std::collections::HashSet<String>,
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
struct LoopIndex(Mutex<BTreeMap<PathBuf, Vec<Bound>>>);

/// A device node and the disk sequence number of the attach it stands for.
type Bound = (PathBuf, Option<u64>);

impl LoopIndex {
    fn read(dir: &Path) -> Result<LoopIndex> {
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
    fn devices(&self, file: &Path) -> Result<Vec<LoopStatus>> {
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
    fn live(&self, file: &Path) -> Result<Option<PathBuf>> {
        Ok(self
            .devices(file)?
            .into_iter()
            .find(|s| !s.backing_deleted)
            .map(|s| s.path))
    }

    /// Drops what is known of a deleted volume's file.
    fn forget(&self, file: &Path) {
        lock(&self.0).remove(file);
    }

    /// Records `dev`, just attached to `file` by this process.
    fn add(&self, file: &Path, dev: &Path) -> Result<()> {
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

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// File name for a new volume's image.
fn image_name(id: &str) -> String {
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

fn loop_err(e: LoopError) -> BackendError {
    BackendError::Device(e.to_string())
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

    fn supports_snapshots(&self) -> bool {
        true
    }

    fn create_snapshot(
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

    fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
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

    fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
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

    fn create_from(
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
            // A copy keeps its source's sectors: its filesystem was made on them.
            let (src_path, src_size, block_size) = match source {
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
            };
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

    fn begin_group(&self, group_id: &str, source_volume_ids: &[String]) -> Result<()> {
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

    fn complete_group(&self, group_id: &str, snapshot_ids: &[String]) -> Result<GroupInfo> {
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

    fn get_group(&self, group_id: &str) -> Result<Option<(GroupInfo, bool)>> {
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

    fn delete_group(&self, group_id: &str) -> Result<()> {
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
            self.delete_snapshot(&id)?;
        }
        let mut st = lock(&self.state);
        if st.index.groups.remove(group_id).is_some() {
            self.persist(&mut st)?;
        }
        Ok(())
    }

    fn storage_health(&self) -> Vec<StorageProblem> {
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
}

impl PoolBackend {
    fn snapshots_dir(&self) -> PathBuf {
        self.dir.join(SNAPSHOTS)
    }

    /// Finishes or forgets what a crash interrupted (run at open): an
    /// entry still pending whose final file exists was renamed into place
    /// after its data was synced, so it is complete; one without its file
    /// never finished and goes (its temp file was removed with the other
    /// stale temps). A group still pending is forgotten with its members:
    /// members cut in another freeze than their siblings would not be
    /// write-order consistent, so a retry cuts them all again.
    fn settle_pending(&self, st: &mut State) -> Result<bool> {
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
    fn remove_unindexed_snapshots(&self, st: &State) -> Result<()> {
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

    fn snapshot_info(id: &str, e: &SnapEntry) -> SnapshotInfo {
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
    fn copy_into_place(src: &Path, final_path: &Path) -> Result<crust_blockdev::CopyOutcome> {
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
