//! The host paths a CO hands the node service: staging and publish
//! targets checked, created, recognised as this volume's mounts, synced
//! and unmounted, removed.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::driver::NodeParts;
use crate::error::{NodeError, PathProblem, PublishError, mount_err};
use crate::records::PublishStep;
use crate::records::{Staging, VolumeRecord};

type Result<T> = std::result::Result<T, NodeError>;

/// Checks that `p` is an existing directory (not a symlink).
pub(crate) fn require_dir(field: &'static str, p: &Path) -> Result<()> {
    let bad = |problem| NodeError::PathState {
        field,
        path: p.to_path_buf(),
        problem,
    };
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) if m.file_type().is_symlink() => Err(bad(PathProblem::SymlinkForDirectory)),
        Ok(_) => Err(bad(PathProblem::NotADirectory)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(bad(PathProblem::Missing)),
        Err(e) => Err(NodeError::Internal(format!("{field} {}: {e}", p.display()))),
    }
}

/// A publish target's parent must exist: kubelet creates it, and a
/// missing one means the request is for a pod that is not there.
pub(crate) fn check_parent(target: &Path) -> Result<()> {
    match target.parent() {
        Some(parent) if !fs::metadata(parent).is_ok_and(|m| m.is_dir()) => {
            Err(PublishError::MissingParent {
                path: parent.to_path_buf(),
            }
            .into())
        }
        _ => Ok(()),
    }
}

/// Checks a publish target; returns whether it is missing (the caller
/// creates it).
///
/// A raw block target must be missing, an empty regular file, or this
/// volume's own earlier bind (`staged_device`): an existing device node or
/// a file with data is refused, because a bind over it would hide it.
fn check_target(target: &Path, block: bool, staged_device: Option<&Path>) -> Result<bool> {
    check_parent(target)?;
    let bad = |problem| NodeError::PathState {
        field: "target_path",
        path: target.to_path_buf(),
        problem,
    };
    match fs::symlink_metadata(target) {
        Ok(m) if m.file_type().is_symlink() => Err(bad(PathProblem::Symlink)),
        Ok(m) if block && m.is_dir() => Err(bad(PathProblem::DirectoryForBlock)),
        // A device node here is acceptable only as this volume's own bind.
        Ok(m) if block && m.file_type().is_block_device() => {
            if staged_device.is_some_and(|d| is_bind_of_device(d, target)) {
                Ok(false)
            } else {
                Err(bad(PathProblem::ForeignDeviceNode))
            }
        }
        Ok(m) if block && !m.is_file() => Err(bad(PathProblem::NotARegularFile)),
        Ok(m) if block && m.len() > 0 => Err(bad(PathProblem::FileWithData(m.len()))),
        Ok(m) if !block && !m.is_dir() => Err(bad(PathProblem::NotADirectoryForFs)),
        Ok(_) => Ok(false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(NodeError::Internal(format!(
            "target_path {}: {e}",
            target.display()
        ))),
    }
}

/// Creates a missing publish target: an empty file (raw block) or a
/// directory. Never one that exists meanwhile (`create_new`, `mkdir`).
fn create_target(target: &Path, block: bool) -> Result<()> {
    let r = if block {
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(target)
            .map(drop)
    } else {
        fs::DirBuilder::new().mode(0o750).create(target)
    };
    r.map_err(|e| NodeError::Internal(format!("creating target_path {}: {e}", target.display())))
}

impl NodeParts<'_> {
    /// Creates the publish target if missing (checked as
    /// [`check_target`] says); returns whether this call created it.
    /// The record lists the target as the plugin's before it exists, so
    /// that a publish killed at any later point leaves a record saying
    /// what the plugin made (see [`VolumeRecord::created_targets`]).
    pub(crate) fn prepare_target(
        &self,
        rec: &mut VolumeRecord,
        target: &Path,
        block: bool,
        staged_device: Option<&Path>,
    ) -> Result<bool> {
        if !check_target(target, block, staged_device)? {
            return Ok(false);
        }
        if rec.created_targets.insert(target.to_path_buf()) {
            self.state.put(rec.clone())?;
        }
        self.publish_fault(PublishStep::TargetRecorded);
        if let Err(e) = create_target(target, block) {
            // Not made by the plugin after all (something else put a file
            // there meanwhile): not ours to remove later.
            rec.created_targets.remove(target);
            if let Err(pe) = self.state.put(rec.clone()) {
                tracing::error!(volume = %rec.id, error = %pe, "cannot forget a target the plugin did not create");
            }
            return Err(e);
        }
        self.publish_fault(PublishStep::TargetCreated);
        Ok(true)
    }
}

/// Whether `target` is a mount whose object is the device node `device`
/// (a raw block publication).
fn is_bind_of_device(device: &Path, target: &Path) -> bool {
    if !crust_blockdev::is_mountpoint(target).unwrap_or(false) {
        return false;
    }
    match (rustix::fs::stat(device), rustix::fs::stat(target)) {
        (Ok(d), Ok(t)) => {
            rustix::fs::FileType::from_raw_mode(t.st_mode) == rustix::fs::FileType::BlockDevice
                && d.st_rdev == t.st_rdev
        }
        _ => false,
    }
}

/// Whether the topmost mount at `target` is provably the staged volume's:
/// for raw block a bind of its device node; for a filesystem a mount of
/// its device's filesystem showing the filesystem's root (the staging
/// mount, or a bind of it).
pub(crate) fn publication_of(s: &Staging, target: &Path) -> bool {
    if s.block {
        return is_bind_of_device(&s.device, target);
    }
    let Ok(Some(m)) = crust_blockdev::find_mount(target) else {
        return false;
    };
    crust_blockdev::device_major_minor(&s.device).ok() == Some((m.major, m.minor))
        && m.root == Path::new("/")
}

/// What is mounted at `path`, if anything, for an error message.
pub(super) fn mounted_source(path: &Path) -> Option<String> {
    crust_blockdev::find_mount(path)
        .ok()
        .flatten()
        .map(|m| format!("{} ({})", m.source, m.fs_type))
}

/// Whether `path` is a mount of the filesystem on `device`.
pub(crate) fn mounted_here(device: &Path, path: &Path) -> Result<bool> {
    crust_blockdev::root_mounted_at(device, path).map_err(mount_err)
}

/// Flushes the filesystem mounted at `path`, then unmounts it. A busy
/// mount (open files) is FAILED_PRECONDITION and stays mounted.
pub(crate) fn sync_and_unmount(path: &Path) -> Result<()> {
    use rustix::fs::{Mode, OFlags};
    // The descriptor must be closed before unmounting (it pins the mount).
    match rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => {
            if let Err(e) = rustix::fs::syncfs(&fd) {
                tracing::warn!(path = %path.display(), error = %e, "syncfs failed before unmount");
            }
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot open mount to sync it")
        }
    }
    crust_blockdev::unmount(path).map_err(mount_err)
}

/// Removes the publish target `target` once nothing is mounted on it, if
/// the record says the plugin created it and it is still empty (an empty
/// directory or an empty regular file), and forgets it; returns whether
/// the record changed (the caller writes it). A target the plugin did not
/// record creating is left in place, whatever it is.
pub(crate) fn remove_created_target(rec: &mut VolumeRecord, target: &Path) -> bool {
    if !rec.created_target(target) {
        if fs::symlink_metadata(target).is_ok() {
            tracing::info!(volume = %rec.id, target = %target.display(),
                "publish target left in place: the plugin did not create it");
        }
        return false;
    }
    if crust_blockdev::is_mountpoint(target).unwrap_or(true) {
        // Removing would fail or hide what is mounted: kept (and still
        // ours) for a later unpublish.
        tracing::warn!(volume = %rec.id, target = %target.display(),
            "publish target still has something mounted on it; left in place");
        return false;
    }
    let r = match fs::symlink_metadata(target) {
        Ok(m) if m.is_dir() => fs::remove_dir(target),
        Ok(m) if m.is_file() && m.len() == 0 => fs::remove_file(target),
        Ok(_) => {
            tracing::warn!(volume = %rec.id, target = %target.display(),
                "publish target the plugin created is no longer empty; left in place");
            Ok(())
        }
        Err(_) => Ok(()),
    };
    if let Err(e) = r {
        tracing::warn!(volume = %rec.id, target = %target.display(), error = %e,
            "could not remove publish target");
    }
    rec.forget_created_target(target)
}
