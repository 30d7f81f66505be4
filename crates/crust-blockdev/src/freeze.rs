//! Freezing a mounted filesystem (`FIFREEZE`/`FITHAW`) around a
//! point-in-time copy of its device, with a guaranteed thaw.
//!
//! `FIFREEZE` flushes and blocks new writes until `FITHAW`. A filesystem
//! left frozen hangs every writer on the node, so the freeze is owned by a
//! worker thread that thaws on whichever comes first: [`Frozen::thaw`], the
//! [`Frozen`] being dropped (also during a panic), or the `max_frozen`
//! bound. If the freeze itself does not complete within its deadline (a
//! hung device), the caller gets an error at once and the worker thaws the
//! moment the freeze completes later. A copy is consistent only if
//! [`Frozen::thaw`] reports that the filesystem stayed frozen throughout.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::sys;

#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    #[error("cannot open {path} to freeze it: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("freezing {path} failed: {source}")]
    Freeze {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "freezing {path} did not complete within {timeout:?} (hung I/O?); it is thawed as soon as it does"
    )]
    FreezeTimeout { path: PathBuf, timeout: Duration },
    #[error("{path} was thawed after {max:?} before the copy finished; the copy is not consistent")]
    ThawedEarly { path: PathBuf, max: Duration },
    #[error("thawing {path} failed: {source}")]
    Thaw {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A frozen filesystem; thawed on [`Frozen::thaw`] or drop.
pub struct Frozen {
    path: PathBuf,
    max_frozen: Duration,
    release: Option<mpsc::Sender<()>>,
    worker: Option<JoinHandle<io::Result<()>>>,
    thawed_early: Arc<AtomicBool>,
}

/// Freezes the filesystem mounted at `mountpoint`. Fails if the freeze does
/// not complete within `timeout`; thaws by itself after `max_frozen`.
pub fn freeze(
    mountpoint: &Path,
    timeout: Duration,
    max_frozen: Duration,
) -> Result<Frozen, FreezeError> {
    let path = mountpoint.to_path_buf();
    let dir = File::open(mountpoint).map_err(|source| FreezeError::Open {
        path: path.clone(),
        source,
    })?;
    let (frozen_tx, frozen_rx) = mpsc::sync_channel::<io::Result<()>>(1);
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let thawed_early = Arc::new(AtomicBool::new(false));
    let early = thawed_early.clone();
    let worker = std::thread::Builder::new()
        .name("crust-freeze".into())
        .spawn(move || -> io::Result<()> {
            if let Err(e) = crust_sys::fs::freeze(&dir) {
                let _ = frozen_tx.send(Err(e));
                return Ok(());
            }
            let _ = frozen_tx.send(Ok(()));
            // Thaw on release, on the owner going away, or after the bound.
            if let Err(mpsc::RecvTimeoutError::Timeout) = release_rx.recv_timeout(max_frozen) {
                early.store(true, Ordering::SeqCst);
            }
            crust_sys::fs::thaw(&dir)
        })
        .map_err(|source| FreezeError::Freeze {
            path: path.clone(),
            source,
        })?;
    match frozen_rx.recv_timeout(timeout) {
        Ok(Ok(())) => Ok(Frozen {
            path,
            max_frozen,
            release: Some(release_tx),
            worker: Some(worker),
            thawed_early,
        }),
        Ok(Err(source)) => {
            let _ = worker.join();
            Err(FreezeError::Freeze { path, source })
        }
        Err(_) => {
            // Dropping the release sender makes the worker thaw as soon as
            // its FIFREEZE returns; it is not joined (it may be stuck).
            drop(release_tx);
            Err(FreezeError::FreezeTimeout { path, timeout })
        }
    }
}

/// FIFREEZE of `mountpoint` with no guard: the caller owns the thaw
/// ([`thaw_if_frozen`]). For a process that freezes on behalf of another
/// and exits (a runtime CLI); in-process copies use [`freeze`].
pub fn freeze_unguarded(mountpoint: &Path) -> io::Result<()> {
    let dir = File::open(mountpoint)?;
    crust_sys::fs::freeze(&dir)
}

/// Thaws `mountpoint` if it is frozen (a process that froze it died before
/// thawing: a freeze outlives its process). Ok(true) if it was frozen.
pub fn thaw_if_frozen(mountpoint: &Path) -> io::Result<bool> {
    let dir = File::open(mountpoint)?;
    match crust_sys::fs::thaw(&dir) {
        Ok(_) => Ok(true),
        // Not frozen.
        Err(e) if sys::errno(&e) == Some(rustix::io::Errno::INVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

impl Frozen {
    /// Thaws; Ok only if the filesystem stayed frozen until now.
    pub fn thaw(mut self) -> Result<(), FreezeError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<(), FreezeError> {
        drop(self.release.take());
        let Some(worker) = self.worker.take() else {
            return Ok(());
        };
        let thawed = worker
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("freeze worker panicked")));
        if let Err(source) = thawed {
            return Err(FreezeError::Thaw {
                path: self.path.clone(),
                source,
            });
        }
        if self.thawed_early.load(Ordering::SeqCst) {
            return Err(FreezeError::ThawedEarly {
                path: self.path.clone(),
                max: self.max_frozen,
            });
        }
        Ok(())
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::error!(error = %e, "thaw after an aborted copy");
        }
    }
}
