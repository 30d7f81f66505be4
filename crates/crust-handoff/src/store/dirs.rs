//! The root and record directories opened by descriptor (never by a path
//! a symlink could redirect), and what a record directory holds.

use std::ffi::CStr;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};

use rustix::fs::{AtFlags, FileType, FlockOperation, Mode, OFlags};
use rustix::io::Errno;

use super::fsio::{check_owner_mode, read_bounded, read_runtime_cli};
use super::layout::Layout;
use super::{MAX_RECORD_SIZE, MOUNT_INFO_FILE, RUNTIME_CLI_FILE, RecordState, Store, TMP_PREFIX};
use crate::error::{HandoffError, Result};
use crate::mountinfo::MountInfo;
use crate::validate;

/// Entries a record directory may hold.
pub(super) enum Entry {
    MountInfo,
    RuntimeCli,
    Temp(String),
    Sandbox(String),
}

impl Store {
    /// Opens the root (following symlinks in the configured path itself:
    /// `/var/run` is one). With `create`, makes it 0700 (parents 0755).
    /// An existing root that is not ours or that others may write to is
    /// refused ([`HandoffError::UnsafeRoot`]), never fixed up.
    pub(super) fn open_root(&self, create: bool) -> Result<Option<OwnedFd>> {
        let open = || {
            rustix::fs::open(
                &self.root,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
        };
        match open() {
            Ok(fd) => return self.check_root(fd).map(Some),
            Err(Errno::NOENT) if create => {}
            Err(Errno::NOENT) => return Ok(None),
            Err(e) => return Err(HandoffError::io(format!("open {}", self.root.display()), e)),
        }
        if let Some(parent) = self.root.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(parent)
                .map_err(|e| HandoffError::io(format!("create {}", parent.display()), e))?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(&self.root) {
            Ok(()) => std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| HandoffError::io(format!("chmod {}", self.root.display()), e))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(HandoffError::io(
                    format!("create {}", self.root.display()),
                    e,
                ));
            }
        }
        let fd =
            open().map_err(|e| HandoffError::io(format!("open {}", self.root.display()), e))?;
        self.check_root(fd).map(Some)
    }

    /// The root must be ours and writable by nobody else: anyone who can
    /// write there can plant or swap a record directory.
    pub(super) fn check_root(&self, fd: OwnedFd) -> Result<OwnedFd> {
        let st = rustix::fs::fstat(&fd)
            .map_err(|e| HandoffError::io(format!("stat {}", self.root.display()), e))?;
        let unsafe_root = |reason: String| HandoffError::UnsafeRoot {
            path: self.root.display().to_string(),
            reason,
        };
        let euid = rustix::process::geteuid().as_raw();
        if st.st_uid != euid {
            return Err(unsafe_root(format!(
                "owned by uid {}, not by uid {euid} that uses it",
                st.st_uid
            )));
        }
        if st.st_mode & 0o022 != 0 {
            return Err(unsafe_root(format!(
                "mode {:o} lets group or others write; make it 0700",
                st.st_mode & 0o7777
            )));
        }
        Ok(fd)
    }

    /// The record directory, refusing a symlink or non-directory in its
    /// place and a directory others could write to.
    pub(super) fn open_record_dir(&self, root: &OwnedFd, key: &str) -> Result<Option<OwnedFd>> {
        let path = self.display(key);
        match rustix::fs::openat(
            root,
            key,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => {
                let st =
                    rustix::fs::fstat(&fd).map_err(|e| HandoffError::io("stat record dir", e))?;
                check_owner_mode(&st, &path)?;
                Ok(Some(fd))
            }
            Err(Errno::NOENT) => Ok(None),
            Err(Errno::LOOP) | Err(Errno::NOTDIR) => {
                let is_link = rustix::fs::statat(root, key, AtFlags::SYMLINK_NOFOLLOW)
                    .map(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink)
                    .unwrap_or(false);
                Err(HandoffError::bad(
                    path,
                    if is_link {
                        "a symlink stands in place of the record directory"
                    } else {
                        "not a directory"
                    },
                ))
            }
            Err(e) => Err(HandoffError::io(format!("open {path}"), e)),
        }
    }

    /// Opens (creating with `create`) and locks the record directory, and
    /// makes sure it is still the one linked under the root (a remover may
    /// have deleted it while we waited for the lock).
    pub(super) fn lock_record_dir(
        &self,
        root: &OwnedFd,
        key: &str,
        create: bool,
    ) -> Result<Option<OwnedFd>> {
        for _ in 0..16 {
            if create {
                match rustix::fs::mkdirat(root, key, Mode::from_raw_mode(0o700)) {
                    Ok(()) => {
                        rustix::fs::fsync(root).map_err(|e| HandoffError::io("fsync root", e))?;
                    }
                    Err(Errno::EXIST) => {}
                    Err(e) => {
                        return Err(HandoffError::io(format!("create {}", self.display(key)), e));
                    }
                }
            }
            let Some(dir) = self.open_record_dir(root, key)? else {
                if create {
                    continue;
                }
                return Ok(None);
            };
            if create {
                // Explicit, whatever the umask was at mkdir time.
                rustix::fs::fchmod(&dir, Mode::from_raw_mode(0o700))
                    .map_err(|e| HandoffError::io("chmod record dir", e))?;
            }
            rustix::fs::flock(&dir, FlockOperation::LockExclusive)
                .map_err(|e| HandoffError::io("lock record dir", e))?;
            let held =
                rustix::fs::fstat(&dir).map_err(|e| HandoffError::io("stat record dir", e))?;
            match rustix::fs::statat(root, key, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(now) if now.st_dev == held.st_dev && now.st_ino == held.st_ino => {
                    return Ok(Some(dir));
                }
                Ok(_) | Err(Errno::NOENT) if create => continue,
                Ok(_) | Err(Errno::NOENT) => return Ok(None),
                Err(e) => return Err(HandoffError::io("stat record dir", e)),
            }
        }
        Err(HandoffError::io(
            format!("lock {}", self.display(key)),
            std::io::Error::other("record directory keeps being replaced"),
        ))
    }

    /// Classifies every entry; anything unknown is refused.
    pub(super) fn entries(&self, dir: &OwnedFd, path: &str) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        let reader = rustix::fs::Dir::read_from(dir)
            .map_err(|e| HandoffError::io(format!("read {path}"), e))?;
        for ent in reader {
            let ent = ent.map_err(|e| HandoffError::io(format!("read {path}"), e))?;
            let raw: &CStr = ent.file_name();
            let bytes = raw.to_bytes();
            if bytes == b"." || bytes == b".." {
                continue;
            }
            let Ok(name) = raw.to_str() else {
                return Err(HandoffError::bad(
                    path,
                    "unexpected entry with a non-UTF-8 name",
                ));
            };
            let st = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(HandoffError::io(format!("stat {path}/{name}"), e)),
            };
            if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
                return Err(HandoffError::bad(
                    path,
                    format!("unexpected entry {name:?} (not a regular file)"),
                ));
            }
            let entry = match name {
                MOUNT_INFO_FILE => Entry::MountInfo,
                RUNTIME_CLI_FILE if self.layout == Layout::Crust => Entry::RuntimeCli,
                n if n.starts_with(TMP_PREFIX) => Entry::Temp(n.into()),
                n if validate::check_sandbox_id(n).is_ok() => Entry::Sandbox(n.into()),
                n => {
                    return Err(HandoffError::bad(path, format!("unexpected entry {n:?}")));
                }
            };
            out.push(entry);
        }
        out.sort_by(|a, b| entry_name(a).cmp(entry_name(b)));
        Ok(out)
    }

    pub(super) fn read_mount_info(&self, dir: &OwnedFd, path: &str) -> Result<Option<MountInfo>> {
        let Some(bytes) = read_bounded(dir, MOUNT_INFO_FILE, MAX_RECORD_SIZE, path)? else {
            return Ok(None);
        };
        let mi = MountInfo::from_json(&bytes).map_err(|r| HandoffError::bad(path, r))?;
        self.check_record(&mi)
            .map_err(|r| HandoffError::bad(path, r))?;
        Ok(Some(mi))
    }

    pub(super) fn inspect_key(&self, root: &OwnedFd, key: &str) -> Result<Option<RecordState>> {
        let path = self.display(key);
        let Some(dir) = self.open_record_dir(root, key)? else {
            return Ok(None);
        };
        let entries = self.entries(&dir, &path)?;
        let Some(mount_info) = self.read_mount_info(&dir, &path)? else {
            return Ok(None);
        };
        let runtime_cli = if self.layout == Layout::Crust {
            read_runtime_cli(&dir, &path)?
        } else {
            None
        };
        Ok(Some(RecordState {
            mount_info,
            claimant: first_sandbox(&entries).map(str::to_string),
            runtime_cli,
        }))
    }
}

pub(super) enum Staged {
    Nothing,
    Same,
    Different,
}

/// What is staged compared to `mi`; a different record held by a sandbox
/// is a conflict.
pub(super) fn compare_staged(
    dir: &OwnedFd,
    entries: &[Entry],
    mi: &MountInfo,
    target: &str,
    path: &str,
) -> Result<Staged> {
    if !entries.iter().any(|e| matches!(e, Entry::MountInfo)) {
        return Ok(Staged::Nothing);
    }
    let existing = read_bounded(dir, MOUNT_INFO_FILE, MAX_RECORD_SIZE, path)?
        .and_then(|b| MountInfo::from_json(&b).ok());
    if existing.as_ref().is_some_and(|old| old.is_staged_as(mi)) {
        return Ok(Staged::Same);
    }
    if let Some(by) = first_sandbox(entries) {
        return Err(HandoffError::Conflict(format!(
            "a different record is staged for {target} and sandbox {by} holds it"
        )));
    }
    Ok(Staged::Different)
}

pub(super) fn entry_name(e: &Entry) -> &str {
    match e {
        Entry::MountInfo => MOUNT_INFO_FILE,
        Entry::RuntimeCli => RUNTIME_CLI_FILE,
        Entry::Temp(n) | Entry::Sandbox(n) => n,
    }
}

pub(super) fn first_sandbox(entries: &[Entry]) -> Option<&str> {
    entries.iter().find_map(|e| match e {
        Entry::Sandbox(n) => Some(n.as_str()),
        _ => None,
    })
}
