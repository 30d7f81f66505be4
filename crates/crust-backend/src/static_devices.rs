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
//!   A device that is in use is not wiped and the claim is kept. A
//!   device the volume got blank is then zeroed whole if it can do that
//!   without writing every block (`crust_blockdev::zero_out_fast`) and
//!   recorded `Released` (the format gate's proof); otherwise its verdict
//!   is dropped and the next claim reads it in full.
//! * expand: succeeds only when the device is already large enough (it
//!   may have been grown underneath); otherwise `OutOfRange`.
//! * attach/detach: the device is always "attached"; attach returns its
//!   path.
//!
//! ## Blank verdicts ([`Backend::blankness`])
//! A static device may hold anything an operator put there, and data in
//! its middle carries no signature the edge probe sees; crust formats it
//! only with a proof it is blank. The proofs, in the order asked:
//!
//! 1. the operator declared it blank ([`StaticConfig::declared_blank`],
//!    crust-csi's [`DECLARE_BLANK_SETTING`]);
//! 2. a verdict recorded in the state file, per configured path, valid
//!    while the device keeps the major:minor and size it had then:
//!    `released` (delete wiped the edges of a device that was proven
//!    blank when its volume got it: it holds only what that volume left),
//!    `all_zero` or `data` (a full read, [`crust_blockdev::scan_for_data`]);
//! 3. otherwise a full read starts in a background thread (at most one per
//!    device; create starts it too, so it is often done by stage time)
//!    and the answer is `Scanning` with its progress until the verdict is
//!    saved. A restart during a read reads again.
//!
//! Delete records `released` only over a blank proof; a device that held
//! data crust did not write (or was never proven blank) loses its verdict
//! instead and is read again at its next claim. A verdict stops mattering
//! once a volume on the device is used: the plugin never formats a
//! volume it formatted or used raw, and delete replaces the verdict.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crust_blockdev::ZeroScan;

use serde::{Deserialize, Serialize};

use crate::util::{self, IdLocks, io_err, lock};
use crate::{
    Allocation, Backend, BackendError, BackingState, Blankness, Capacity, Result, StorageProblem,
};

/// How much is wiped at each end of a released device.
pub const WIPE_BYTES: u64 = 1 << 20;
const STATE_VERSION: u32 = 1;

/// The crust-csi flag by which an operator declares a static device blank
/// (named in [`Blankness`] answers so a refusal says what to change).
pub const DECLARE_BLANK_SETTING: &str = "--static-device-blank";

/// Configuration of a [`StaticBackend`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticConfig {
    /// Absolute paths of the block devices this backend may hand out.
    pub devices: Vec<PathBuf>,
    /// Devices the operator declares blank: formatted without a full read.
    /// Each must also be in `devices` (matched by device number, so
    /// another name of the same node works); a separate list rather than
    /// an implied device, so a typo cannot add a disk to the pool.
    pub declared_blank: Vec<PathBuf>,
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
    /// Blank verdicts by configured device path (module docs).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    verdicts: BTreeMap<PathBuf, Verdict>,
    /// Full reads running now, by configured device path.
    #[serde(skip)]
    scans: BTreeMap<PathBuf, Arc<Scan>>,
}

/// Which device a verdict is about: a node now bound to another disk
/// (another major:minor or size) is read again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct DeviceId {
    major: u32,
    minor: u32,
    size_bytes: u64,
}

impl DeviceId {
    fn of(dev: &Path) -> Result<DeviceId> {
        let (major, minor) = crust_blockdev::device_major_minor(dev).map_err(dev_err)?;
        let size_bytes = crust_blockdev::block_device_size(dev).map_err(dev_err)?;
        Ok(DeviceId {
            major,
            minor,
            size_bytes,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Verdict {
    device: DeviceId,
    found: Found,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Found {
    /// Delete wiped it after `volume`, which got it blank.
    Released { volume: String },
    /// A full read found only zeros.
    AllZero,
    /// A full read found a non-zero byte at `offset`.
    Data { offset: u64 },
}

impl Found {
    fn answer(&self, device: PathBuf) -> Blankness {
        match self {
            Found::Released { volume } => Blankness::Released {
                device,
                volume: volume.clone(),
            },
            Found::AllZero => Blankness::ReadAllZero { device },
            Found::Data { offset } => Blankness::HoldsData {
                device,
                offset: *offset,
                setting: DECLARE_BLANK_SETTING,
            },
        }
    }
}

/// A full read in progress, shared with its thread.
#[derive(Debug)]
struct Scan {
    device: DeviceId,
    done_bytes: AtomicU64,
    /// Set when the scan is no longer wanted (delete, close): the thread
    /// stops after its current chunk and records nothing.
    stop: AtomicBool,
    /// Why the read failed; reported once by the next `blankness` call.
    failed: Mutex<Option<String>>,
}

/// Pre-provisioned block device backend; see the module docs.
#[derive(Debug)]
pub struct StaticBackend {
    devices: Vec<PathBuf>,
    /// Configured paths (as in `devices`) the operator declared blank.
    declared_blank: BTreeSet<PathBuf>,
    state_file: PathBuf,
    /// Shared with the scan threads, which record their verdicts.
    state: Arc<Mutex<StaticState>>,
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
        let mut declared_blank = BTreeSet::new();
        for dev in &config.declared_blank {
            let numbers = crust_blockdev::device_major_minor(dev).map_err(|e| {
                BackendError::Invalid(format!(
                    "device {} declared blank is not usable: {e}",
                    dev.display()
                ))
            })?;
            let configured = seen.get(&numbers).ok_or_else(|| {
                BackendError::Invalid(format!(
                    "device {} is declared blank but is not one of the configured devices ({})",
                    dev.display(),
                    util::display_list(&config.devices)
                ))
            })?;
            declared_blank.insert(configured.to_path_buf());
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
                ..StaticState::default()
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
            declared_blank,
            state_file,
            state: Arc::new(Mutex::new(state)),
            ids: IdLocks::default(),
            _lock: lock_file,
        })
    }

    fn persist(&self, st: &StaticState) -> Result<()> {
        write_state(&self.state_file, st)
    }

    /// The recorded verdict on `device` if it is still about the same
    /// device.
    fn valid_verdict<'a>(st: &'a StaticState, device: &Path, id: DeviceId) -> Option<&'a Found> {
        let v = st.verdicts.get(device)?;
        if v.device != id {
            tracing::info!(device = %device.display(), was = ?v.device, now = ?id,
                "device changed since its blank verdict; it will be read again");
            return None;
        }
        Some(&v.found)
    }

    /// Starts the full read of `device` unless one is running; returns it.
    fn start_scan(&self, st: &mut StaticState, device: &Path, id: DeviceId) -> Result<Arc<Scan>> {
        if let Some(scan) = st.scans.get(device) {
            if scan.device == id {
                return Ok(Arc::clone(scan));
            }
            scan.stop.store(true, Ordering::Relaxed);
        }
        let scan = Arc::new(Scan {
            device: id,
            done_bytes: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
        });
        // The thread records its verdict under the state lock, which the
        // caller holds: it cannot finish before the scan is registered.
        st.scans.insert(device.to_path_buf(), Arc::clone(&scan));
        let (state, file, dev, s) = (
            Arc::clone(&self.state),
            self.state_file.clone(),
            device.to_path_buf(),
            Arc::clone(&scan),
        );
        let spawned = std::thread::Builder::new()
            .name("crust-zero-scan".into())
            .spawn(move || run_scan(&state, &file, &dev, &s));
        if let Err(e) = spawned {
            st.scans.remove(device);
            return Err(BackendError::Device(format!(
                "cannot start the full read of {}: {e}",
                device.display()
            )));
        }
        tracing::info!(device = %device.display(), size = id.size_bytes,
            "reading the whole device to prove it blank");
        Ok(scan)
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

impl Drop for StaticBackend {
    fn drop(&mut self) {
        // Under the state lock, so no scan records a verdict (and writes
        // the state file) once the file's lock is released.
        let mut st = lock(&self.state);
        for scan in std::mem::take(&mut st.scans).values() {
            scan.stop.store(true, Ordering::Relaxed);
        }
    }
}

fn write_state(path: &Path, st: &StaticState) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(st)
        .map_err(|e| BackendError::Invalid(format!("serialising static state: {e}")))?;
    util::atomic_write(path, &bytes)
}

/// The body of a scan thread: reads `dev`, then records the verdict,
/// unless the scan was called off meanwhile.
fn run_scan(state: &Mutex<StaticState>, state_file: &Path, dev: &Path, scan: &Scan) {
    let started = std::time::Instant::now();
    let result = crust_blockdev::scan_for_data(dev, &mut |done, _| {
        scan.done_bytes.store(done, Ordering::Relaxed);
        if scan.stop.load(Ordering::Relaxed) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    let mut st = lock(state);
    if !st.scans.get(dev).is_some_and(|s| std::ptr::eq(&**s, scan)) {
        return;
    }
    let fail = |why: String| {
        tracing::warn!(device = %dev.display(), error = %why, "full read failed");
        *lock(&scan.failed) = Some(why);
    };
    let found = match result {
        Ok(ZeroScan::AllZero) => Found::AllZero,
        Ok(ZeroScan::DataAt(offset)) => Found::Data { offset },
        Ok(ZeroScan::Stopped { .. }) => return,
        Err(e) => return fail(e.to_string()),
    };
    // A node bound to another disk during the read proves nothing.
    match DeviceId::of(dev) {
        Ok(now) if now == scan.device => {}
        Ok(_) => return fail("the device changed during the read".into()),
        Err(e) => return fail(e.to_string()),
    }
    st.scans.remove(dev);
    tracing::info!(device = %dev.display(), verdict = ?found, secs = started.elapsed().as_secs_f64(),
        "full read of the device done");
    st.verdicts.insert(
        dev.to_path_buf(),
        Verdict {
            device: scan.device,
            found,
        },
    );
    // Kept in memory either way: it is true; a restart reads again.
    if let Err(e) = write_state(state_file, &st) {
        tracing::warn!(device = %dev.display(), error = %e, "cannot save the device's blank verdict");
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
        // Read it now, so the verdict is often there by stage time.
        if !self.declared_blank.contains(&claim.device) {
            let started = DeviceId::of(&claim.device).and_then(|id| {
                if Self::valid_verdict(&st, &claim.device, id).is_some() {
                    return Ok(());
                }
                self.start_scan(&mut st, &claim.device, id).map(drop)
            });
            if let Err(e) = started {
                tracing::warn!(device = %claim.device.display(), error = %e,
                    "cannot start the full read now; stage will ask again");
            }
        }
        Ok(Self::allocation(volume_id, &claim))
    }

    fn delete(&self, volume_id: &str) -> Result<()> {
        let _id = self.ids.lock(volume_id);
        let Some(claim) = self.claim(volume_id) else {
            return Ok(());
        };
        // Released needs the device blank when the volume got it (else the
        // middle holds data crust never wrote, kept for its owner) and
        // zeroed whole now (the tenant's data is not crust's either).
        let got_blank = {
            let st = lock(&self.state);
            self.declared_blank.contains(&claim.device)
                || DeviceId::of(&claim.device).is_ok_and(|id| {
                    matches!(
                        Self::valid_verdict(&st, &claim.device, id),
                        Some(Found::Released { .. } | Found::AllZero)
                    )
                })
        };
        let wiped = match crust_blockdev::wipe_edges(&claim.device, WIPE_BYTES) {
            Ok(()) => true,
            Err(e) if e.is_not_found() => {
                tracing::warn!(volume = %volume_id, device = %claim.device.display(),
                    "device node is gone; releasing the claim without wiping");
                false
            }
            Err(e) => {
                return Err(BackendError::Device(format!(
                    "cannot release volume {volume_id}: {e}"
                )));
            }
        };
        let zeroed = wiped
            && got_blank
            && match crust_blockdev::zero_out_fast(&claim.device) {
                Ok(z) => z,
                Err(e) => {
                    tracing::warn!(volume = %volume_id, device = %claim.device.display(), error = %e,
                        "could not zero the released device; the next claim reads it in full");
                    false
                }
            };
        let id = if zeroed {
            DeviceId::of(&claim.device).ok()
        } else {
            None
        };
        let mut st = lock(&self.state);
        let dev = &claim.device;
        if let Some(scan) = st.scans.remove(dev) {
            scan.stop.store(true, Ordering::Relaxed);
        }
        let verdict_before = st.verdicts.remove(dev);
        if let Some(id) = id {
            let found = Found::Released {
                volume: volume_id.to_owned(),
            };
            st.verdicts
                .insert(dev.clone(), Verdict { device: id, found });
        }
        let removed = st.claims.remove(volume_id);
        if let Err(e) = self.persist(&st) {
            if let Some(r) = removed {
                st.claims.insert(volume_id.to_owned(), r);
            }
            st.verdicts.remove(dev);
            if let Some(v) = verdict_before {
                st.verdicts.insert(dev.clone(), v);
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

    fn blankness(&self, volume_id: &str) -> Result<Blankness> {
        let device = self
            .claim(volume_id)
            .ok_or_else(|| BackendError::NotFound(volume_id.to_owned()))?
            .device;
        if self.declared_blank.contains(&device) {
            return Ok(Blankness::Declared {
                device,
                setting: DECLARE_BLANK_SETTING,
            });
        }
        let id = DeviceId::of(&device)?;
        let mut st = lock(&self.state);
        if let Some(found) = Self::valid_verdict(&st, &device, id) {
            return Ok(found.answer(device));
        }
        let failed = st.scans.get(&device).and_then(|s| lock(&s.failed).take());
        if let Some(why) = failed {
            // Reported once; the next call reads again.
            st.scans.remove(&device);
            return Err(BackendError::Device(format!(
                "the full read of {} (to prove it blank) failed: {why}",
                device.display()
            )));
        }
        let scan = self.start_scan(&mut st, &device, id)?;
        Ok(Blankness::Scanning {
            device,
            done_bytes: scan.done_bytes.load(Ordering::Relaxed),
            total_bytes: id.size_bytes,
        })
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
