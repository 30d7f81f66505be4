//! Backend of pre-provisioned block devices.
//!
//! An administrator lists whole block devices; each volume claims one
//! device exclusively. Claims live in an atomically written JSON state
//! file (mode 0600, directory 0700), guarded by a `<state>.lock` flock.
//!
//! * create: the smallest free device whose size is within
//!   `[size, limit]` (ties: configuration order); devices that are in use
//!   (mounted or held exclusively) are skipped. No device big enough at
//!   all → `OutOfRange`; fitting devices exist but are claimed →
//!   `Exhausted`.
//! * delete: zeroes the first and last MiB of the device, then drops the
//!   claim. That removes every filesystem, partition-table and
//!   volume-manager signature `crust_blockdev::probe_fs` looks for, so
//!   the next claimant sees a `Blank` device and gets a fresh filesystem,
//!   and the old filesystem cannot be mounted by accident. It is not a
//!   secure erase: the rest of the old data stays on the device (use
//!   device-level encryption or a secure-erase job where that matters).
//!   A device that is in use is not wiped and the claim is kept.
//! * expand: succeeds only when the device is already large enough (it
//!   may have been grown underneath); otherwise `OutOfRange`.
//! * attach/detach: the device is always "attached"; attach returns its
//!   path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::util::{self, IdLocks, io_err, lock};
use crate::{Allocation, Backend, BackendError, BackingState, Capacity, Result, StorageProblem};

/// How much is wiped at each end of a released device.
pub const WIPE_BYTES: u64 = 1 << 20;
const STATE_VERSION: u32 = 1;

/// Configuration of a [`StaticBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticConfig {
    /// Absolute paths of the block devices this backend may hand out.
    pub devices: Vec<PathBuf>,
    /// JSON file recording which volume claimed which device.
    pub state_file: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Claim {
    device: PathBuf,
    size_bytes: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StaticState {
    version: u32,
    claims: BTreeMap<String, Claim>,
}

/// Pre-provisioned block device backend; see the module docs.
#[derive(Debug)]
pub struct StaticBackend {
    devices: Vec<PathBuf>,
    state_file: PathBuf,
    state: Mutex<StaticState>,
    ids: IdLocks,
    _lock: util::DirLock,
}

fn dev_err(e: crust_blockdev::DeviceError) -> BackendError {
    BackendError::Device(e.to_string())
}

impl StaticBackend {
    /// Validates the device list (absolute, normalized paths of existing
    /// block devices, no device listed twice, even under another name),
    /// takes the state lock and loads the claims. Claims on devices no
    /// longer configured are kept (and logged) so their volumes can still
    /// be deleted.
    pub fn open(config: StaticConfig) -> Result<Self> {
        if config.devices.is_empty() {
            return Err(BackendError::Invalid(
                "the static backend needs at least one device".into(),
            ));
        }
        let mut seen: BTreeMap<(u32, u32), &Path> = BTreeMap::new();
        for dev in &config.devices {
            let s = dev.to_str().ok_or_else(|| {
                BackendError::Invalid(format!("device path {} is not UTF-8", dev.display()))
            })?;
            crust_blockdev::validate_abs_path(s)
                .map_err(|e| BackendError::Invalid(format!("device {s}: {e}")))?;
            let numbers = crust_blockdev::device_major_minor(dev).map_err(|e| {
                BackendError::Invalid(format!("configured device {s} is not usable: {e}"))
            })?;
            if let Some(other) = seen.insert(numbers, dev) {
                return Err(BackendError::Invalid(format!(
                    "{s} and {} are the same device",
                    other.display()
                )));
            }
        }
        let state_file = config.state_file.clone();
        let dir = state_file
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .ok_or_else(|| BackendError::Invalid("state file needs a directory".into()))?;
        util::ensure_private_dir(dir)?;
        let lock_path = PathBuf::from(format!("{}.lock", state_file.display()));
        let lock_file = util::DirLock::acquire(
            &lock_path,
            &format!("static backend state {}", state_file.display()),
        )?;
        util::remove_stale_temps(dir);
        let state = match std::fs::read(&state_file) {
            Ok(bytes) => {
                let st: StaticState = serde_json::from_slice(&bytes).map_err(|e| {
                    BackendError::Invalid(format!(
                        "static backend state {} is corrupt ({e}); refusing to guess",
                        state_file.display()
                    ))
                })?;
                if st.version != STATE_VERSION {
                    return Err(BackendError::Invalid(format!(
                        "static backend state {} has version {}, expected {STATE_VERSION}",
                        state_file.display(),
                        st.version
                    )));
                }
                st
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => StaticState {
                version: STATE_VERSION,
                claims: BTreeMap::new(),
            },
            Err(e) => return Err(io_err(&state_file)(e)),
        };
        for (id, c) in &state.claims {
            if !config.devices.contains(&c.device) {
                tracing::warn!(volume = %id, device = %c.device.display(),
                    "claimed device is no longer configured; keeping the claim until the volume is deleted");
            }
        }
        Ok(StaticBackend {
            devices: config.devices,
            state_file,
            state: Mutex::new(state),
            ids: IdLocks::default(),
            _lock: lock_file,
        })
    }

    fn persist(&self, st: &StaticState) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(st)
            .map_err(|e| BackendError::Invalid(format!("serialising static state: {e}")))?;
        util::atomic_write(&self.state_file, &bytes)
    }

    fn claim(&self, id: &str) -> Option<Claim> {
        lock(&self.state).claims.get(id).cloned()
    }

    fn allocation(id: &str, c: &Claim) -> Allocation {
        Allocation {
            volume_id: id.to_owned(),
            size_bytes: c.size_bytes,
            backing: c.device.clone(),
        }
    }

    /// Unclaimed configured devices with their current sizes; unreadable
    /// ones are skipped with a warning.
    fn free_devices(&self, st: &StaticState) -> Vec<(PathBuf, u64)> {
        self.devices
            .iter()
            .filter(|d| !st.claims.values().any(|c| &c.device == *d))
            .filter_map(|d| match crust_blockdev::block_device_size(d) {
                Ok(size) => Some((d.clone(), size)),
                Err(e) => {
                    tracing::warn!(device = %d.display(), %e, "skipping unusable device");
                    None
                }
            })
            .collect()
    }
}

impl Backend for StaticBackend {
    fn kind(&self) -> &'static str {
        "static"
    }

    fn create(&self, volume_id: &str, size_bytes: u64, limit_bytes: u64) -> Result<Allocation> {
        util::validate_id(volume_id)?;
        if limit_bytes != 0 && size_bytes > limit_bytes {
            return Err(BackendError::OutOfRange(
                size_bytes,
                format!("larger than the limit of {limit_bytes} bytes"),
            ));
        }
        let fits = |size: u64| size >= size_bytes && (limit_bytes == 0 || size <= limit_bytes);
        let _id = self.ids.lock(volume_id);
        let mut st = lock(&self.state);
        if let Some(c) = st.claims.get(volume_id) {
            return if fits(c.size_bytes) {
                Ok(Self::allocation(volume_id, c))
            } else {
                Err(BackendError::SizeMismatch {
                    id: volume_id.to_owned(),
                    existing: c.size_bytes,
                    requested: size_bytes,
                })
            };
        }
        let free = self.free_devices(&st);
        let mut candidates: Vec<&(PathBuf, u64)> = free.iter().filter(|(_, s)| fits(*s)).collect();
        candidates.sort_by_key(|(_, s)| *s);
        let mut chosen = None;
        for (dev, size) in candidates {
            match crust_blockdev::is_device_in_use(dev) {
                Ok(false) => {
                    chosen = Some((dev.clone(), *size));
                    break;
                }
                Ok(true) => {
                    tracing::warn!(device = %dev.display(), "unclaimed device is in use (mounted?); skipping it")
                }
                Err(e) => tracing::warn!(device = %dev.display(), %e, "skipping unusable device"),
            }
        }
        let Some((device, size)) = chosen else {
            let any_fits = self
                .devices
                .iter()
                .filter_map(|d| crust_blockdev::block_device_size(d).ok())
                .any(fits);
            let largest_free = free.iter().map(|(_, s)| *s).max().unwrap_or(0);
            return Err(if any_fits {
                BackendError::Exhausted {
                    requested: size_bytes,
                    available: largest_free,
                }
            } else {
                let limit = if limit_bytes == 0 {
                    "no limit".to_owned()
                } else {
                    format!("at most {limit_bytes}")
                };
                BackendError::OutOfRange(
                    size_bytes,
                    format!(
                        "no configured device has at least {size_bytes} bytes and {limit} (devices: {})",
                        util::display_list(&self.devices)
                    ),
                )
            });
        };
        let claim = Claim {
            device,
            size_bytes: size,
        };
        st.claims.insert(volume_id.to_owned(), claim.clone());
        if let Err(e) = self.persist(&st) {
            st.claims.remove(volume_id);
            return Err(e);
        }
        tracing::info!(volume = %volume_id, device = %claim.device.display(), size, "static device claimed");
        Ok(Self::allocation(volume_id, &claim))
    }

    fn delete(&self, volume_id: &str) -> Result<()> {
        let _id = self.ids.lock(volume_id);
        let Some(claim) = self.claim(volume_id) else {
            return Ok(());
        };
        match crust_blockdev::wipe_edges(&claim.device, WIPE_BYTES) {
            Ok(()) => {}
            Err(e) if e.is_not_found() => {
                tracing::warn!(volume = %volume_id, device = %claim.device.display(),
                    "device node is gone; releasing the claim without wiping");
            }
            Err(e) => {
                return Err(BackendError::Device(format!(
                    "cannot release volume {volume_id}: {e}"
                )));
            }
        }
        let mut st = lock(&self.state);
        let removed = st.claims.remove(volume_id);
        if let Err(e) = self.persist(&st) {
            if let Some(r) = removed {
                st.claims.insert(volume_id.to_owned(), r);
            }
            return Err(e);
        }
        tracing::info!(volume = %volume_id, device = %claim.device.display(), "static device wiped and released");
        Ok(())
    }

    fn get(&self, volume_id: &str) -> Result<Option<Allocation>> {
        Ok(self
            .claim(volume_id)
            .map(|c| Self::allocation(volume_id, &c)))
    }

    fn list(&self) -> Result<Vec<Allocation>> {
        Ok(lock(&self.state)
            .claims
            .iter()
            .map(|(id, c)| Self::allocation(id, c))
            .collect())
    }

    fn expand(&self, volume_id: &str, new_size_bytes: u64) -> Result<u64> {
        let _id = self.ids.lock(volume_id);
        let claim = self
            .claim(volume_id)
            .ok_or_else(|| BackendError::NotFound(volume_id.to_owned()))?;
        let real = crust_blockdev::block_device_size(&claim.device).map_err(dev_err)?;
        if new_size_bytes > real {
            return Err(BackendError::OutOfRange(
                new_size_bytes,
                format!(
                    "static device {} has {real} bytes and cannot grow",
                    claim.device.display()
                ),
            ));
        }
        if real != claim.size_bytes {
            let mut st = lock(&self.state);
            if let Some(c) = st.claims.get_mut(volume_id) {
                c.size_bytes = real;
            }
            self.persist(&st)?;
        }
        Ok(real)
    }

    fn attach(&self, volume_id: &str) -> Result<PathBuf> {
        let claim = self
            .claim(volume_id)
            .ok_or_else(|| BackendError::NotFound(volume_id.to_owned()))?;
        if !crust_blockdev::is_block_device(&claim.device) {
            return Err(BackendError::Device(format!(
                "device {} of volume {volume_id} is gone or not a block device",
                claim.device.display()
            )));
        }
        Ok(claim.device)
    }

    fn attached_device(&self, volume_id: &str) -> Result<Option<PathBuf>> {
        Ok(self
            .claim(volume_id)
            .map(|c| c.device)
            .filter(|d| crust_blockdev::is_block_device(d)))
    }

    fn detach(&self, _volume_id: &str) -> Result<()> {
        Ok(())
    }

    fn capacity(&self) -> Result<Capacity> {
        let st = lock(&self.state);
        let free = self.free_devices(&st);
        Ok(Capacity {
            available_bytes: free.iter().map(|(_, s)| s).sum(),
            maximum_volume_size: free.iter().map(|(_, s)| *s).max().unwrap_or(0),
            minimum_volume_size: free.iter().map(|(_, s)| *s).min().unwrap_or(0),
        })
    }

    fn probe(&self) -> Result<()> {
        let dir = self.state_file.parent().unwrap_or(Path::new("/"));
        rustix::fs::access(dir, rustix::fs::Access::WRITE_OK).map_err(|e| {
            BackendError::Device(format!(
                "state directory {} is not writable: {e}",
                dir.display()
            ))
        })
    }

    fn backing_state(&self, volume_id: &str) -> BackingState {
        let Some(claim) = self.claim(volume_id) else {
            return BackingState::Missing(format!(
                "volume {volume_id} has no device claimed in the static backend"
            ));
        };
        let d = claim.device.display();
        if !claim.device.exists() {
            return BackingState::Missing(format!(
                "device node {d} is gone (disk removed or renamed)"
            ));
        }
        match crust_blockdev::block_device_size(&claim.device) {
            Ok(size) if size < claim.size_bytes => BackingState::Degraded(format!(
                "device {d} now has {size} bytes, less than the {} the volume was given",
                claim.size_bytes
            )),
            Ok(_) => BackingState::Healthy,
            Err(e) => BackingState::Degraded(format!("device {d} is not usable: {e}")),
        }
    }

    fn storage_health(&self) -> Vec<StorageProblem> {
        let mut problems = Vec::new();
        let missing: Vec<PathBuf> = self
            .devices
            .iter()
            .filter(|d| !crust_blockdev::is_block_device(d))
            .cloned()
            .collect();
        if !missing.is_empty() {
            let all = missing.len() == self.devices.len();
            let msg = format!(
                "configured block device(s) missing or not block devices: {}",
                util::display_list(&missing)
            );
            problems.push(if all {
                StorageProblem::unreachable("DeviceMissing", msg)
            } else {
                StorageProblem::degraded("DeviceMissing", msg)
            });
        }
        if let Err(e) = self.probe() {
            problems.push(StorageProblem::degraded("StateNotWritable", e.to_string()));
        }
        problems
    }
}
