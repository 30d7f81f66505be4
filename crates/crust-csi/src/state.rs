//! Persistent plugin state: one JSON record per volume in
//! `<state-dir>/volumes/<volume-id>.json` (dir 0700, files 0600).
//!
//! Records are written atomically (temp file in the same directory, fsync,
//! rename, fsync the directory), so after a crash or restart a record is
//! either the old or the new version, never a torn one. The in-memory map
//! is only touched for short lookups and swaps; file I/O happens outside
//! its lock, and callers serialize writers per volume with the operation
//! guard.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::records::{Phase, VolumeRecord, is_valid_volume_id};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state directory {path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("writing volume record {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("removing volume record {path}: {source}")]
    Remove {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Another plugin serves this state directory.
    #[error(
        "state directory {} is in use by another crust-csi{}; one plugin per state directory",
        dir.display(),
        holder.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    Locked { dir: PathBuf, holder: Option<u32> },
    #[error("encoding volume record {id}: {source}")]
    Encode {
        id: String,
        #[source]
        source: serde_json::Error,
    },
}

/// The record store.
#[derive(Debug)]
pub struct StateStore {
    /// `<state-dir>/snapshots`: each snapshot's [`crate::records::History`]
    /// as of its cut.
    snapshots: PathBuf,
    dir: PathBuf,
    records: Mutex<Records>,
    /// `<state-dir>/lock`, flock'ed for as long as the store lives: two
    /// plugins on one state (with different pools, say) would each act on
    /// records the other changes.
    _lock: File,
}

/// The records in memory, with an index of the targets they name (their
/// publications and a handover's target), so a lookup by target costs the
/// same with any number of volumes.
#[derive(Debug, Default)]
struct Records {
    by_id: BTreeMap<String, VolumeRecord>,
    by_target: std::collections::HashMap<PathBuf, String>,
}

impl Records {
    fn targets(rec: &VolumeRecord) -> impl Iterator<Item = &PathBuf> {
        rec.published
            .keys()
            .chain(rec.handover.as_ref().map(|h| &h.target))
    }

    fn insert(&mut self, rec: VolumeRecord) {
        self.remove(&rec.id);
        for t in Self::targets(&rec) {
            self.by_target.insert(t.clone(), rec.id.clone());
        }
        self.by_id.insert(rec.id.clone(), rec);
    }

    fn remove(&mut self, id: &str) {
        if let Some(old) = self.by_id.remove(id) {
            for t in Self::targets(&old) {
                if self.by_target.get(t).is_some_and(|o| o == id) {
                    self.by_target.remove(t);
                }
            }
        }
    }
}

/// Name of the lock file in the state directory (holds the owner's pid).
pub const LOCK_FILE: &str = "lock";

/// Takes `<state_dir>/lock` exclusively (non-blocking) and writes our pid
/// into it; a held lock is [`StateError::Locked`] naming the holder's pid.
fn lock_state_dir(state_dir: &Path) -> Result<File, StateError> {
    use std::io::{Read, Seek};
    let path = state_dir.join(LOCK_FILE);
    let dir_err = |source| StateError::Dir {
        path: path.clone(),
        source,
    };
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(dir_err)?;
    match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut pid = String::new();
            let _ = f.read_to_string(&mut pid);
            return Err(StateError::Locked {
                dir: state_dir.to_path_buf(),
                holder: pid.trim().parse().ok(),
            });
        }
        Err(e) => return Err(dir_err(e.into())),
    }
    f.set_len(0).map_err(dir_err)?;
    f.rewind().map_err(dir_err)?;
    writeln!(f, "{}", std::process::id()).map_err(dir_err)?;
    Ok(f)
}

impl StateStore {
    /// Opens (creating 0700) `<state_dir>/volumes` and loads every record.
    /// Unreadable records are moved aside as `*.corrupt` with an error log,
    /// never silently dropped; leftover temp files are removed.
    pub fn open(state_dir: &Path) -> Result<StateStore, StateError> {
        let dir = state_dir.join("volumes");
        let snapshots = state_dir.join("snapshots");
        for d in [state_dir, dir.as_path(), snapshots.as_path()] {
            create_private_dir(d).map_err(|source| StateError::Dir {
                path: d.to_path_buf(),
                source,
            })?;
        }
        let lock = lock_state_dir(state_dir)?;
        let mut records = Records::default();
        let entries = fs::read_dir(&dir).map_err(|source| StateError::Dir {
            path: dir.clone(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| StateError::Dir {
                path: dir.clone(),
                source,
            })?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.contains(".tmp") {
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(id) = name.strip_suffix(".json") else {
                continue;
            };
            match fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<VolumeRecord>(&b).map_err(|e| e.to_string()))
            {
                Ok(rec) if rec.id == id && is_valid_volume_id(id) => {
                    records.insert(rec);
                }
                Ok(rec) => {
                    tracing::error!(file = %path.display(), record_id = %rec.id, "volume record name does not match its id; moved aside");
                    let _ = fs::rename(&path, path.with_extension("json.corrupt"));
                }
                Err(e) => {
                    tracing::error!(file = %path.display(), error = %e, "unreadable volume record; moved aside");
                    let _ = fs::rename(&path, path.with_extension("json.corrupt"));
                }
            }
        }
        tracing::info!(dir = %dir.display(), volumes = records.by_id.len(), "loaded volume records");
        Ok(StateStore {
            snapshots,
            dir,
            records: Mutex::new(records),
            _lock: lock,
        })
    }

    fn map(&self) -> std::sync::MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, id: &str) -> Option<VolumeRecord> {
        self.map().by_id.get(id).cloned()
    }

    /// The volume published at `target`, or whose handover names it.
    pub fn volume_at(&self, target: &Path) -> Option<String> {
        self.map().by_target.get(target).cloned()
    }

    /// Ready records with id greater than `after`, at most `max` (0 = all),
    /// plus whether more follow.
    pub fn page(&self, after: Option<&str>, max: usize) -> (Vec<VolumeRecord>, bool) {
        use std::ops::Bound;
        let map = self.map();
        let map = &map.by_id;
        let lower = match after {
            Some(a) => Bound::Excluded(a.to_string()),
            None => Bound::Unbounded,
        };
        let mut it = map
            .range::<String, _>((lower, Bound::Unbounded))
            .map(|(_, r)| r)
            .filter(|r| r.phase == Phase::Ready);
        let mut out = Vec::new();
        for r in it.by_ref() {
            out.push(r.clone());
            if max != 0 && out.len() == max {
                break;
            }
        }
        let more = max != 0 && it.next().is_some();
        (out, more)
    }

    pub fn all(&self) -> Vec<VolumeRecord> {
        self.map().by_id.values().cloned().collect()
    }

    /// Persists `rec` atomically, then makes it visible.
    pub fn put(&self, rec: VolumeRecord) -> Result<(), StateError> {
        let path = self.dir.join(format!("{}.json", rec.id));
        let data = serde_json::to_vec_pretty(&rec).map_err(|source| StateError::Encode {
            id: rec.id.clone(),
            source,
        })?;
        write_atomic(&self.dir, &path, &data)
            .map_err(|source| StateError::Write { path, source })?;
        self.map().insert(rec);
        Ok(())
    }

    /// Deletes the record of `id` (idempotent).
    pub fn remove(&self, id: &str) -> Result<(), StateError> {
        let path = self.dir.join(format!("{id}.json"));
        match fs::remove_file(&path) {
            Ok(()) => {
                fsync_dir(&self.dir).map_err(|source| StateError::Remove {
                    path: path.clone(),
                    source,
                })?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(StateError::Remove { path, source }),
        }
        self.map().remove(id);
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The history of snapshot `id`'s data as of its cut; `None` when
    /// none was recorded (unknown: restores of it are never formatted).
    pub fn snapshot_history(&self, id: &str) -> Option<crate::records::History> {
        let path = self.snapshot_file(id)?;
        let bytes = fs::read(&path).ok()?;
        match serde_json::from_slice::<SnapshotHistory>(&bytes) {
            Ok(h) => Some(h.history),
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e, "unreadable snapshot history: its restores count as unknown");
                None
            }
        }
    }

    /// Records snapshot `id`'s history (`None`: unknown, so any earlier
    /// record under that id goes), before the copy is cut.
    pub fn put_snapshot_history(
        &self,
        id: &str,
        source_volume_id: &str,
        history: Option<crate::records::History>,
    ) -> Result<(), StateError> {
        let Some(history) = history else {
            return self.remove_snapshot_history(id);
        };
        let path = self.snapshot_file(id).ok_or_else(|| StateError::Encode {
            id: id.to_string(),
            source: serde::ser::Error::custom("not a snapshot id"),
        })?;
        let data = serde_json::to_vec_pretty(&SnapshotHistory {
            source_volume_id: source_volume_id.to_string(),
            history,
        })
        .map_err(|source| StateError::Encode {
            id: id.to_string(),
            source,
        })?;
        write_atomic(&self.snapshots, &path, &data)
            .map_err(|source| StateError::Write { path, source })
    }

    /// Forgets snapshot `id`'s history (idempotent).
    pub fn remove_snapshot_history(&self, id: &str) -> Result<(), StateError> {
        let Some(path) = self.snapshot_file(id) else {
            return Ok(());
        };
        match fs::remove_file(&path) {
            Ok(()) => {
                fsync_dir(&self.snapshots).map_err(|source| StateError::Remove { path, source })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(StateError::Remove { path, source }),
        }
    }

    /// Only ids of this plugin's shape name a file.
    fn snapshot_file(&self, id: &str) -> Option<PathBuf> {
        let ok = !id.is_empty()
            && id.len() <= 128
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        ok.then(|| self.snapshots.join(format!("{id}.json")))
    }
}

/// A snapshot's history file.
#[derive(Debug, Serialize, Deserialize)]
struct SnapshotHistory {
    source_volume_id: String,
    history: crate::records::History,
}

/// Creates `dir` (and missing parents) with mode 0700 for the ones it
/// creates; an existing directory keeps its mode.
pub fn create_private_dir(dir: &Path) -> io::Result<()> {
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "exists and is not a directory",
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
            // DirBuilder's mode is filtered by the umask; make it exact.
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        }
        Err(e) => Err(e),
    }
}

fn write_atomic(dir: &Path, path: &Path, data: &[u8]) -> io::Result<()> {
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{file_name}.tmp{}", std::process::id()));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        fsync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Records for the crate's unit tests.
#[cfg(test)]
pub(crate) mod tests_support {
    use std::collections::BTreeSet;

    use super::*;
    use crate::caps::Access;
    use crate::caps::{AccessMode, CapSpec, FsType};
    use crate::records::RECORD_VERSION;

    /// A ready ext4 mount volume `id` of 1 byte on node `n1`, never used.
    pub fn record(id: &str) -> VolumeRecord {
        VolumeRecord {
            version: RECORD_VERSION,
            id: id.into(),
            name: id.into(),
            phase: Phase::Ready,
            capacity_bytes: 1,
            required_bytes: 0,
            limit_bytes: 0,
            fs_type: FsType::Ext4,
            parameters: BTreeMap::new(),
            capabilities: vec![CapSpec {
                access: Access::Mount { fs_type: None },
                mode: AccessMode::SingleNodeWriter,
            }],
            node_id: "n1".into(),
            staging: None,
            published: BTreeMap::new(),
            content_source: None,
            inherited: None,
            raw_block_used: false,
            formatted: None,
            format_started: None,
            handover: None,
            returned: None,
            created_targets: BTreeSet::new(),
            io_limits: Default::default(),
            limits_issued_ms: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caps::{AccessMode, FsType};
    use crate::records::*;

    fn rec(name: &str) -> VolumeRecord {
        let mut r = tests_support::record(&volume_id_for(name));
        r.name = name.into();
        r.capacity_bytes = 1 << 20;
        r.required_bytes = 1 << 20;
        r
    }

    /// A target is the plugin's when `created_targets` lists it, or when a
    /// record written before that list flags its publication; forgetting
    /// clears both.
    #[test]
    fn created_targets_include_the_legacy_flag() {
        let mut r = rec("t");
        let (a, b, c) = (Path::new("/p/a"), Path::new("/p/b"), Path::new("/p/c"));
        r.created_targets.insert(a.to_path_buf());
        let legacy = Publication {
            created_target: true,
            ..Publication::host(true, false, AccessMode::SingleNodeWriter, String::new())
        };
        r.published.insert(b.to_path_buf(), legacy);
        r.published.insert(
            c.to_path_buf(),
            Publication::host(true, false, AccessMode::SingleNodeWriter, String::new()),
        );
        assert!(r.created_target(a) && r.created_target(b) && !r.created_target(c));
        assert!(r.forget_created_target(a) && r.forget_created_target(b));
        assert!(!r.forget_created_target(c));
        assert!(!r.created_target(a) && !r.created_target(b));
        // An empty list is not written (records stay as before).
        let json = serde_json::to_value(&r).unwrap();
        assert!(json.get("created_targets").is_none(), "{json}");
    }

    #[test]
    fn volumes_are_found_by_target_as_records_change_and_after_reload() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let store = StateStore::open(&state).unwrap();
        let mut r = rec("pvc-t");
        let t = PathBuf::from("/pods/p/vol");
        assert_eq!(store.volume_at(&t), None);
        r.published.insert(
            t.clone(),
            Publication::host(false, false, AccessMode::SingleNodeWriter, String::new()),
        );
        store.put(r.clone()).unwrap();
        assert_eq!(store.volume_at(&t).as_deref(), Some(r.id.as_str()));
        // Unpublished: gone from the index; a handover's target is found.
        r.published.clear();
        r.handover = Some(crate::records::HandoverRecord {
            target: PathBuf::from("/pods/p/ho"),
            sandbox: "sb".into(),
            runtime_cli: "/bin/true".into(),
            phase: crate::records::HandoverPhase::HandedOver,
            host_mounted: false,
            subpath_binds: Vec::new(),
        });
        store.put(r.clone()).unwrap();
        assert_eq!(store.volume_at(&t), None);
        assert_eq!(
            store.volume_at(Path::new("/pods/p/ho")).as_deref(),
            Some(r.id.as_str())
        );
        drop(store);
        let store = StateStore::open(&state).unwrap();
        assert_eq!(
            store.volume_at(Path::new("/pods/p/ho")).as_deref(),
            Some(r.id.as_str())
        );
        store.remove(&r.id).unwrap();
        assert_eq!(store.volume_at(Path::new("/pods/p/ho")), None);
    }

    #[test]
    fn ids_are_deterministic_and_well_formed() {
        let a = volume_id_for("pvc-1");
        assert_eq!(a, volume_id_for("pvc-1"));
        assert_ne!(a, volume_id_for("pvc-2"));
        assert!(is_valid_volume_id(&a));
        assert!(!is_valid_volume_id("vol-../../etc"));
        assert!(!is_valid_volume_id(&a.to_uppercase()));
    }

    #[test]
    fn records_persist_privately_and_reload() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let store = StateStore::open(&state).unwrap();
        assert_eq!(
            fs::metadata(state.join("volumes"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        let mut r = rec("a");
        r.staging = Some(Staging {
            path: "/stage/a".into(),
            device: "/dev/loop9".into(),
            block: false,
            fs_type: Some(FsType::Xfs),
            readonly: false,
            mode: AccessMode::SingleNodeWriter,
            flags_digest: String::new(),
            deferred: false,
            host_mount: HostMount::Mounted,
            mount_options: vec!["noatime".into()],
        });
        store.put(r.clone()).unwrap();
        store.put(rec("b")).unwrap();
        let file = state.join("volumes").join(format!("{}.json", r.id));
        assert_eq!(
            fs::metadata(&file).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // a torn temp file and a corrupt record from a crash
        fs::write(state.join("volumes/.x.json.tmp1"), b"{").unwrap();
        let bad = state
            .join("volumes")
            .join(format!("{}.json", volume_id_for("c")));
        fs::write(&bad, b"not json").unwrap();

        // One store per state directory at a time.
        let e = StateStore::open(&state).unwrap_err();
        assert!(
            matches!(e, StateError::Locked { holder: Some(p), .. } if p == std::process::id()),
            "{e}"
        );
        drop(store);
        let again = StateStore::open(&state).unwrap();
        assert_eq!(again.get(&r.id), Some(r.clone()));
        assert_eq!(again.all().len(), 2);
        assert!(!state.join("volumes/.x.json.tmp1").exists());
        assert!(bad.with_extension("json.corrupt").exists());

        again.remove(&r.id).unwrap();
        again.remove(&r.id).unwrap();
        assert!(!file.exists());
        drop(again);
        assert_eq!(StateStore::open(&state).unwrap().all().len(), 1);
    }

    #[test]
    fn pages_skip_creating_records_and_continue_after_a_deleted_id() {
        let tmp = tempfile::tempdir().unwrap();
        let store = StateStore::open(tmp.path()).unwrap();
        let mut ids = Vec::new();
        for i in 0..5 {
            let r = rec(&format!("v{i}"));
            ids.push(r.id.clone());
            store.put(r).unwrap();
        }
        let mut creating = rec("pending");
        creating.phase = Phase::Creating;
        store.put(creating).unwrap();
        ids.sort();
        let (p1, more) = store.page(None, 2);
        assert!(more);
        assert_eq!(
            p1.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
            ids[..2]
        );
        store.remove(&ids[1]).unwrap();
        let (p2, more) = store.page(Some(&ids[1]), 0);
        assert!(!more);
        assert_eq!(
            p2.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
            ids[2..]
        );
    }

    #[test]
    fn deferral_fields_round_trip_and_old_records_still_load() {
        let tmp = tempfile::tempdir().unwrap();
        let store = StateStore::open(tmp.path()).unwrap();
        let mut r = rec("d");
        r.staging = Some(Staging {
            path: "/stage/d".into(),
            device: "/dev/loop7".into(),
            block: false,
            fs_type: Some(FsType::Ext4),
            readonly: false,
            mode: AccessMode::SingleNodeWriter,
            flags_digest: String::new(),
            deferred: true,
            host_mount: HostMount::UnmountedForDeferral,
            mount_options: Vec::new(),
        });
        r.published.insert(
            "/pods/p".into(),
            Publication {
                deferred: true,
                supplemental_group: Some(100),
                supplemental_group_change_policy: Some("Always".into()),
                ..Publication::host(false, true, AccessMode::SingleNodeWriter, String::new())
            },
        );
        store.put(r.clone()).unwrap();
        drop(store);
        assert_eq!(
            StateStore::open(tmp.path()).unwrap().get(&r.id),
            Some(r.clone())
        );
        assert_eq!(
            r.deferred_publication().map(|(t, _)| t.clone()),
            Some("/pods/p".into())
        );
        assert_eq!(r.host_publications().count(), 0);

        // A record written before deferral existed: host mount, no deferral;
        // and a non-deferred record is written without the new keys.
        let mut old = rec("o");
        old.staging = Some(Staging {
            deferred: false,
            host_mount: HostMount::Mounted,
            mount_options: Vec::new(),
            ..r.staging.clone().unwrap()
        });
        old.published.insert(
            "/pods/h".into(),
            Publication::host(false, false, AccessMode::SingleNodeWriter, String::new()),
        );
        let json = serde_json::to_string(&old).unwrap();
        for key in [
            "deferred",
            "host_mount",
            "supplemental_group",
            "handed_over",
            "handover",
            "returned",
            "mount_options",
        ] {
            assert!(!json.contains(key), "{key} in {json}");
        }
        let back: VolumeRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, old);
        assert_eq!(back.host_publications().count(), 1);
    }
}
