//! Volume backends: where a volume's bytes live and how it becomes a block
//! device on this node.
//!
//! The CSI services talk only to [`Backend`]; each implementation owns its
//! own bookkeeping of which backing store belongs to which volume id. All
//! operations are idempotent: creating an existing id with the same size
//! returns it, deleting a missing id succeeds, attaching an attached volume
//! returns the same device.

use std::path::PathBuf;

/// A backing store allocated to one volume.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Allocation {
    /// Volume id the store belongs to.
    pub volume_id: String,
    /// Size in bytes (exactly what was allocated; never rounded down).
    pub size_bytes: u64,
    /// The backing file (pool) or the device node (static); for messages.
    pub backing: PathBuf,
}

/// Capacity of the backend as GetCapacity reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Bytes that can still be allocated.
    pub available_bytes: u64,
    /// Largest single volume that can be created now.
    pub maximum_volume_size: u64,
    /// Smallest volume the backend will create.
    pub minimum_volume_size: u64,
}

/// What the backend can see about a volume's backing store, for health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackingState {
    /// Backing store present and (if attached) the device matches it.
    Healthy,
    /// Backing file or device node is gone.
    Missing(String),
    /// Present but not usable (wrong size, not a block device, ...).
    Degraded(String),
}

/// A condition of the backend itself, affecting every volume it serves
/// (CSI v1.13 NodeGetStorageHealth).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageProblem {
    /// True when volumes of this backend are expected to be unusable;
    /// false when they work with reduced guarantees (degraded).
    pub unreachable: bool,
    /// CamelCase, stable for machines.
    pub reason: &'static str,
    pub message: String,
}

impl StorageProblem {
    pub fn degraded(reason: &'static str, message: impl Into<String>) -> Self {
        StorageProblem {
            unreachable: false,
            reason,
            message: message.into(),
        }
    }

    pub fn unreachable(reason: &'static str, message: impl Into<String>) -> Self {
        StorageProblem {
            unreachable: true,
            reason,
            message: message.into(),
        }
    }
}

/// A point-in-time copy of a volume, held by the backend independently of
/// its source (deleting the source keeps it usable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub snapshot_id: String,
    pub source_volume_id: String,
    /// Size of the source volume when the snapshot was cut: the smallest
    /// volume it can be restored into.
    pub size_bytes: u64,
    /// Bytes of the pool it occupies (counted against capacity).
    pub allocated_bytes: u64,
    /// Wall-clock time of the copy, milliseconds since the epoch.
    pub created_unix_ms: i64,
    /// `reflink` or `sparse-copy`.
    pub method: String,
    /// Set for members of a volume group snapshot.
    pub group_id: Option<String>,
}

/// A group of snapshots cut together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupInfo {
    pub group_id: String,
    pub source_volume_ids: Vec<String>,
    pub snapshot_ids: Vec<String>,
    pub created_unix_ms: i64,
}

/// What a new volume is filled from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentSource {
    Snapshot(String),
    Volume(String),
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("volume {0} not found in backend")]
    NotFound(String),
    #[error("volume {id} already exists with size {existing} bytes (requested {requested})")]
    SizeMismatch {
        id: String,
        existing: u64,
        requested: u64,
    },
    #[error("not enough space: requested {requested} bytes, {available} available")]
    Exhausted { requested: u64, available: u64 },
    #[error("size {0} bytes is outside what this backend supports: {1}")]
    OutOfRange(u64, String),
    #[error("cannot shrink volume {id} from {current} to {requested} bytes")]
    Shrink {
        id: String,
        current: u64,
        requested: u64,
    },
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("the {backend} backend does not support {what}")]
    Unsupported {
        backend: &'static str,
        what: &'static str,
    },
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    #[error("snapshot {id} already exists for volume {existing_source}, not {requested_source}")]
    SnapshotConflict {
        id: String,
        existing_source: String,
        requested_source: String,
    },
    #[error("block device error: {0}")]
    Device(String),
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// Why (or whether) the backend can prove a volume's store holds no data
/// crust did not write. Crust formats a store only with such a proof; see
/// [`Backend::blankness`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Blankness {
    /// The backend made the store itself, empty, and only crust wrote to it
    /// since (a new pool file).
    MadeEmpty,
    /// A copy of another volume or a snapshot (the plugin decides from the
    /// copy's recorded history).
    Copy,
    /// The operator declared the device blank in the configuration
    /// (`setting` names the flag).
    Declared {
        device: PathBuf,
        setting: &'static str,
    },
    /// DeleteVolume of a volume that got the device blank zeroed it whole
    /// (a fast write-zeroes; a device that cannot is read again instead).
    Released { device: PathBuf, volume: String },
    /// A full read of the device found only zeros.
    ReadAllZero { device: PathBuf },
    /// The full read is running (started by this call if needed): ask again
    /// later.
    Scanning {
        device: PathBuf,
        done_bytes: u64,
        total_bytes: u64,
    },
    /// The full read found data: never formatted. `setting` names how the
    /// operator can declare it blank.
    HoldsData {
        device: PathBuf,
        offset: u64,
        setting: &'static str,
    },
    /// Nothing known: never formatted.
    Unknown,
}

/// A source of block volumes local to this node.
pub trait Backend: Send + Sync + 'static {
    /// Short name for logs and `GetPluginInfo` manifest ("pool", "static").
    fn kind(&self) -> &'static str;

    /// Allocates `size_bytes` for `volume_id`. Idempotent for the same size;
    /// [`BackendError::SizeMismatch`] when the id exists with another size.
    /// The pool allocates exactly `size_bytes`; the static backend picks the
    /// smallest free device with at least `size_bytes` and at most `limit_bytes`
    /// (0 = no limit) and reports the device's real size.
    fn create(&self, volume_id: &str, size_bytes: u64, limit_bytes: u64) -> Result<Allocation>;

    /// Releases the backing store and its data. Idempotent.
    fn delete(&self, volume_id: &str) -> Result<()>;

    /// The allocation of a volume, if it exists.
    fn get(&self, volume_id: &str) -> Result<Option<Allocation>>;

    /// Every allocation, sorted by volume id (ListVolumes pages over this).
    fn list(&self) -> Result<Vec<Allocation>>;

    /// Grows the backing store to at least `new_size_bytes`; returns the new
    /// size. Growing an attached volume also refreshes the device size.
    fn expand(&self, volume_id: &str, new_size_bytes: u64) -> Result<u64>;

    /// Makes the volume available as a block device and returns its path.
    /// Idempotent: an already attached volume returns the same device, also
    /// after a plugin restart (found again, never attached twice).
    fn attach(&self, volume_id: &str) -> Result<PathBuf>;

    /// Whether the volume's backing store may hold data (anything ever
    /// written to it). A store that never did can be dropped or made again
    /// without loss; callers settling after a crash use this. Unknown:
    /// true.
    fn may_hold_data(&self, _volume_id: &str) -> bool {
        true
    }

    /// Whether the volume's store can be proven to hold no data crust did
    /// not write (what formatting needs; the plugin's own records of
    /// formatting and raw use come on top). May start background work and
    /// answer [`Blankness::Scanning`]; never blocks on a full read.
    /// [`BackendError::NotFound`] for an unknown volume.
    fn blankness(&self, _volume_id: &str) -> Result<Blankness> {
        Ok(Blankness::Unknown)
    }

    /// The device path if currently attached.
    fn attached_device(&self, volume_id: &str) -> Result<Option<PathBuf>>;

    /// Detaches the block device. Never destroys data. Idempotent.
    fn detach(&self, volume_id: &str) -> Result<()>;

    /// Free space and limits.
    fn capacity(&self) -> Result<Capacity>;

    /// Whether the backend is usable right now (Probe).
    fn probe(&self) -> Result<()>;

    /// Health of the backing store for VolumeCondition.
    fn backing_state(&self, volume_id: &str) -> BackingState;
    /// Conditions of the backend as a whole (pool directory, its
    /// filesystem, configured devices); empty when none. May block on a
    /// hung filesystem: callers bound it.
    fn storage_health(&self) -> Vec<StorageProblem>;

    // ---- snapshots and clones (optional) ----
    //
    // The caller makes the source consistent first (freezes a mounted
    // filesystem, flushes an attached device) and keeps it so until the
    // call returns. Every call is idempotent; a snapshot is reported only
    // once its copy is complete and durable.

    /// Whether the snapshot and clone calls below are implemented.
    fn supports_snapshots(&self) -> bool {
        false
    }

    /// Copies volume `source_volume_id` into snapshot `snapshot_id` (a
    /// member of group `group` if given). Same id and source again: the
    /// existing snapshot; same id, other source: [`BackendError::SnapshotConflict`].
    fn create_snapshot(
        &self,
        _snapshot_id: &str,
        _source_volume_id: &str,
        _group: Option<&str>,
    ) -> Result<SnapshotInfo> {
        Err(unsupported(self.kind(), "snapshots"))
    }

    /// Removes a snapshot and its data. Idempotent.
    fn delete_snapshot(&self, _snapshot_id: &str) -> Result<()> {
        Err(unsupported(self.kind(), "snapshots"))
    }

    /// Every complete snapshot, sorted by id.
    fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        Ok(Vec::new())
    }

    /// A complete snapshot, if it exists.
    fn get_snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotInfo>> {
        Ok(self
            .list_snapshots()?
            .into_iter()
            .find(|s| s.snapshot_id == snapshot_id))
    }

    /// Creates volume `volume_id` of `size_bytes` (at least the source's
    /// size) holding a copy of `source`. Idempotent like [`Backend::create`].
    fn create_from(
        &self,
        _volume_id: &str,
        _size_bytes: u64,
        _source: &ContentSource,
    ) -> Result<Allocation> {
        Err(unsupported(self.kind(), "cloning"))
    }

    /// Records that a group of snapshots is being cut (its members not
    /// yet complete): a crash leaves it pending, never reported.
    fn begin_group(&self, _group_id: &str, _source_volume_ids: &[String]) -> Result<()> {
        Err(unsupported(self.kind(), "group snapshots"))
    }

    /// Marks a group complete once every member snapshot exists.
    fn complete_group(&self, _group_id: &str, _snapshot_ids: &[String]) -> Result<GroupInfo> {
        Err(unsupported(self.kind(), "group snapshots"))
    }

    /// A group and whether it is complete (`None`: no such group).
    fn get_group(&self, _group_id: &str) -> Result<Option<(GroupInfo, bool)>> {
        Ok(None)
    }

    /// Removes a group record and its member snapshots. Idempotent.
    fn delete_group(&self, _group_id: &str) -> Result<()> {
        Err(unsupported(self.kind(), "group snapshots"))
    }
}

fn unsupported(backend: &'static str, what: &'static str) -> BackendError {
    BackendError::Unsupported { backend, what }
}

mod pool;
mod static_devices;
mod util;

pub use pool::{DEFAULT_MINIMUM_VOLUME_SIZE, IndexSync, PoolBackend, PoolConfig};
pub use static_devices::{DECLARE_BLANK_SETTING, StaticBackend, StaticConfig, WIPE_BYTES};
pub use util::MAX_VOLUME_ID_LEN;
