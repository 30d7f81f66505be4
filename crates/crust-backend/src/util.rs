//! Shared helpers: atomic JSON state files, directory locks, id checks,
//! per-volume operation serialisation.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use rustix::fs::{FlockOperation, flock};

use crate::{BackendError, Result};

/// Longest volume id accepted (CSI names are at most 128 bytes in
/// practice; this leaves room for prefixes).
pub const MAX_VOLUME_ID_LEN: usize = 256;

pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> BackendError + '_ {
    move |source| BackendError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Rejects ids that could not be stored or logged safely.
pub(crate) fn validate_id(id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(BackendError::Invalid("volume id is empty".into()));
    }
    if id.len() > MAX_VOLUME_ID_LEN {
        return Err(BackendError::Invalid(format!(
            "volume id is {} bytes long (limit {MAX_VOLUME_ID_LEN})",
            id.len()
        )));
    }
    if id.chars().any(|c| c.is_control()) {
        return Err(BackendError::Invalid(
            "volume id contains control characters".into(),
        ));
    }
    Ok(())
}

/// fsyncs a directory so a rename or unlink in it is durable.
pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Prefix of temp files written by [`atomic_write`]; left-overs from a
/// crash are removed at startup.
pub(crate) const TMP_PREFIX: &str = ".crust-tmp.";

/// Writes `bytes` to `path` atomically: a 0600 temp file in the same
/// directory, fsync, rename over `path`, fsync the directory.
pub(crate) fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        "{TMP_PREFIX}{name}.{}.{}",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(path)(e));
    }
    fsync_dir(dir)
}

/// Removes temp files a crash left in `dir`.
pub(crate) fn remove_stale_temps(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
                tracing::info!(path = %e.path().display(), "removing stale temp file");
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Creates `dir` (and parents) with mode 0700 if missing.
pub(crate) fn ensure_private_dir(dir: &Path) -> Result<()> {
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err(dir))?;
    }
    if !dir.is_dir() {
        return Err(BackendError::Invalid(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    Ok(())
}

/// An exclusive `flock` on a lock file, so two plugin processes never
/// manage the same state at once. Released when dropped (or the process
/// dies).
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: File,
}

impl DirLock {
    pub(crate) fn acquire(path: &Path, what: &str) -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(path)
            .map_err(io_err(path))?;
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(DirLock { _file: file }),
            Err(rustix::io::Errno::WOULDBLOCK) => Err(BackendError::Invalid(format!(
                "{what} is in use by another process (lock {} is held)",
                path.display()
            ))),
            Err(e) => Err(io_err(path)(e.into())),
        }
    }
}

/// Serialises operations per volume id without holding the state mutex
/// across slow I/O: an operation marks its id busy, works, and unmarks it.
#[derive(Debug, Default)]
pub(crate) struct IdLocks {
    busy: Mutex<HashSet<String>>,
    cond: Condvar,
}

pub(crate) struct IdGuard<'a> {
    locks: &'a IdLocks,
    id: String,
}

impl IdLocks {
    /// Waits until no other operation works on `id`, then claims it.
    pub(crate) fn lock(&self, id: &str) -> IdGuard<'_> {
        let mut busy = lock(&self.busy);
        while busy.contains(id) {
            busy = self.cond.wait(busy).unwrap_or_else(|p| p.into_inner());
        }
        busy.insert(id.to_owned());
        IdGuard {
            locks: self,
            id: id.to_owned(),
        }
    }
}

impl Drop for IdGuard<'_> {
    fn drop(&mut self) {
        lock(&self.locks.busy).remove(&self.id);
        self.locks.cond.notify_all();
    }
}

/// Locks a mutex, recovering from poisoning (the state it guards is
/// always left consistent before anything that can panic).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Free bytes of the filesystem holding `dir` for unprivileged writers.
pub(crate) fn fs_free_bytes(dir: &Path) -> Result<u64> {
    let st = rustix::fs::statvfs(dir).map_err(|e| io_err(dir)(e.into()))?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

pub(crate) fn display_list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
