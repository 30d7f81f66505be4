//! fsGroup ownership with Kubernetes semantics (kubelet's
//! `SetVolumeOwnership`):
//!
//! * every entry gets group `gid` (symlinks themselves via lchown semantics,
//!   never followed);
//! * regular files and other non-directories gain `ug+rw`, plus `g+x` where
//!   the owner has `x`;
//! * directories gain `ug+rwx` and setgid, so new files inherit the group;
//! * `OnRootMismatch` skips everything when the root already has the group,
//!   setgid and at least `rwxrwx---`.
//!
//! The walk is descriptor-based (`openat` with `O_NOFOLLOW`) and stays on
//! the volume's filesystem.
//!
//! Two users: the guest agent (a deferred or handed-over volume mounted in
//! a guest) and crust-csi (a host publication whose fsGroup kubelet
//! delegated through VOLUME_MOUNT_GROUP).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Instant;

use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags, Stat};
use rustix::io::Errno;

/// Kubernetes `fsGroupChangePolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FsGroupPolicy {
    /// Walk the whole volume every time.
    #[default]
    Always,
    /// Walk only when the root does not already have the group, setgid
    /// and group rwx.
    OnRootMismatch,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FsGroupError {
    #[error("applying fsGroup {gid} under {root}: {op} {path:?} failed: {errno}")]
    Io {
        gid: u32,
        root: String,
        op: &'static str,
        path: String,
        errno: Errno,
    },
    #[error("applying fsGroup {gid} under {root}: deadline exceeded after {entries} entries")]
    Deadline {
        gid: u32,
        root: String,
        entries: u64,
    },
}

const S_ISGID: u32 = 0o2000;
const DIR_BITS: u32 = 0o770 | S_ISGID;
const FILE_BITS: u32 = 0o660;

/// The mode an entry should have after fsGroup is applied.
pub fn target_mode(file_type: FileType, mode: u32) -> u32 {
    let perm = mode & 0o7777;
    match file_type {
        FileType::Directory => perm | DIR_BITS,
        FileType::Symlink => perm,
        _ => {
            let exec = if perm & 0o100 != 0 { 0o010 } else { 0 };
            perm | FILE_BITS | exec
        }
    }
}

/// Whether `OnRootMismatch` must walk: root group differs, or setgid or
/// any of `rwxrwx---` is missing.
pub fn root_mismatch(root: &Stat, gid: u32) -> bool {
    let perm = root.st_mode & 0o7777;
    root.st_gid != gid || perm & DIR_BITS != DIR_BITS
}

struct Walk<'a> {
    gid: u32,
    root: &'a Path,
    dev: u64,
    deadline: Option<Instant>,
    entries: u64,
}

impl Walk<'_> {
    fn err(&self, op: &'static str, path: &Path, errno: Errno) -> FsGroupError {
        FsGroupError::Io {
            gid: self.gid,
            root: self.root.display().to_string(),
            op,
            path: path.display().to_string(),
            errno,
        }
    }

    fn tick(&mut self) -> Result<(), FsGroupError> {
        self.entries += 1;
        if self.entries.is_multiple_of(256)
            && let Some(d) = self.deadline
            && Instant::now() > d
        {
            return Err(FsGroupError::Deadline {
                gid: self.gid,
                root: self.root.display().to_string(),
                entries: self.entries,
            });
        }
        Ok(())
    }

    /// Fixes group and mode of the object behind `fd` (an `O_PATH` or
    /// directory descriptor whose stat is `st`).
    fn fix(&self, fd: &OwnedFd, st: &Stat, rel: &Path) -> Result<(), FsGroupError> {
        let ft = FileType::from_raw_mode(st.st_mode);
        let want = target_mode(ft, st.st_mode);
        let regroup = st.st_gid != self.gid;
        if regroup {
            rustix::fs::chownat(
                fd,
                "",
                None,
                Some(Gid::from_raw(self.gid)),
                AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|e| self.err("chown", rel, e))?;
        }
        // chown clears set-id bits on executables, so re-apply the mode
        // whenever the group changed.
        if ft != FileType::Symlink && (regroup || want != st.st_mode & 0o7777) {
            // fchmod does not take O_PATH descriptors; the magic link does
            // and names exactly this inode.
            let proc_path = format!("/proc/self/fd/{}", fd.as_raw_fd());
            rustix::fs::chmod(proc_path.as_str(), Mode::from_raw_mode(want))
                .map_err(|e| self.err("chmod", rel, e))?;
        }
        Ok(())
    }

    fn dir(&mut self, dir: &OwnedFd, rel: &Path) -> Result<(), FsGroupError> {
        let entries = rustix::fs::Dir::read_from(dir).map_err(|e| self.err("opendir", rel, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| self.err("readdir", rel, e))?;
            let name = entry.file_name();
            if name == c"." || name == c".." {
                continue;
            }
            self.tick()?;
            let child_rel = rel.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
            let fd = match rustix::fs::openat(
                dir,
                name,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                // Removed meanwhile: nothing to fix.
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(self.err("open", &child_rel, e)),
            };
            let st = rustix::fs::fstat(&fd).map_err(|e| self.err("stat", &child_rel, e))?;
            if st.st_dev != self.dev {
                // Another filesystem mounted inside the volume.
                continue;
            }
            if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                let sub = rustix::fs::openat(
                    dir,
                    name,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| self.err("open", &child_rel, e))?;
                let st2 = rustix::fs::fstat(&sub).map_err(|e| self.err("stat", &child_rel, e))?;
                if st2.st_ino != st.st_ino || st2.st_dev != st.st_dev {
                    continue; // replaced between the two opens
                }
                self.dir(&sub, &child_rel)?;
                self.fix(&fd, &st, &child_rel)?;
            } else {
                self.fix(&fd, &st, &child_rel)?;
            }
        }
        Ok(())
    }
}

/// Applies fsGroup `gid` below `root` (the volume mount point). Returns
/// whether anything was walked (false when `OnRootMismatch` found the root
/// already right).
pub fn apply(
    root: &Path,
    gid: u32,
    policy: FsGroupPolicy,
    deadline: Option<Instant>,
) -> Result<bool, FsGroupError> {
    let mut walk = Walk {
        gid,
        root,
        dev: 0,
        deadline,
        entries: 0,
    };
    let rootfd = rustix::fs::open(
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| walk.err("open", Path::new("."), e))?;
    let st = rustix::fs::fstat(&rootfd).map_err(|e| walk.err("stat", Path::new("."), e))?;
    if policy == FsGroupPolicy::OnRootMismatch && !root_mismatch(&st, gid) {
        return Ok(false);
    }
    walk.dev = st.st_dev;
    walk.dir(&rootfd, Path::new("."))?;
    // The root last, so an interrupted walk is redone by OnRootMismatch.
    walk.fix(&rootfd, &st, Path::new("."))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }
    fn gid(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().gid()
    }
    fn set_mode(p: &Path, m: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    }

    #[test]
    fn mode_rules() {
        assert_eq!(target_mode(FileType::RegularFile, 0o600), 0o660);
        assert_eq!(target_mode(FileType::RegularFile, 0o700), 0o770);
        assert_eq!(target_mode(FileType::RegularFile, 0o4755), 0o4775);
        assert_eq!(target_mode(FileType::RegularFile, 0o444), 0o664);
        assert_eq!(target_mode(FileType::Directory, 0o700), 0o2770);
        assert_eq!(target_mode(FileType::Directory, 0o755), 0o2775);
        assert_eq!(target_mode(FileType::Symlink, 0o777), 0o777);
    }

    fn root_stat(gid: u32, mode: u32) -> Stat {
        // A real directory's stat, then the fields the rules read.
        let mut st = rustix::fs::stat("/").unwrap();
        st.st_gid = gid;
        st.st_mode = 0o040000 | mode;
        st
    }

    #[test]
    fn root_mismatch_rules() {
        assert!(!root_mismatch(&root_stat(2000, 0o2770), 2000));
        assert!(!root_mismatch(&root_stat(2000, 0o2775), 2000));
        assert!(root_mismatch(&root_stat(2001, 0o2770), 2000));
        assert!(root_mismatch(&root_stat(2000, 0o0770), 2000));
        assert!(root_mismatch(&root_stat(2000, 0o2750), 2000));
    }

    // Needs root (chown to an arbitrary group); the suite runs as root.
    #[test]
    fn always_walks_and_never_follows_symlinks() {
        if !rustix::process::geteuid().is_root() {
            panic!("this test needs root");
        }
        let outside = tempfile::tempdir().unwrap();
        let marker = outside.path().join("marker");
        std::fs::write(&marker, b"x").unwrap();
        set_mode(&marker, 0o600);
        let vol = tempfile::tempdir().unwrap();
        let v = vol.path();
        set_mode(v, 0o755);
        std::fs::create_dir_all(v.join("d/e")).unwrap();
        set_mode(&v.join("d"), 0o700);
        std::fs::write(v.join("d/e/f"), b"1").unwrap();
        set_mode(&v.join("d/e/f"), 0o600);
        std::fs::write(v.join("script"), b"#!/bin/sh").unwrap();
        set_mode(&v.join("script"), 0o744);
        symlink(&marker, v.join("out")).unwrap();

        assert!(apply(v, 4321, FsGroupPolicy::Always, None).unwrap());
        assert_eq!((gid(v), mode(v)), (4321, 0o2775));
        assert_eq!((gid(&v.join("d")), mode(&v.join("d"))), (4321, 0o2770));
        assert_eq!(mode(&v.join("d/e/f")), 0o660);
        assert_eq!(gid(&v.join("d/e/f")), 4321);
        assert_eq!(mode(&v.join("script")), 0o774);
        // The symlink itself is regrouped, its target untouched.
        assert_eq!(gid(&v.join("out")), 4321);
        assert_eq!((gid(&marker), mode(&marker)), (0, 0o600));

        // OnRootMismatch: root is right, so an inner change is left alone.
        rustix::fs::chown(v.join("d/e/f").as_path(), None, Some(Gid::from_raw(0))).unwrap();
        assert!(!apply(v, 4321, FsGroupPolicy::OnRootMismatch, None).unwrap());
        assert_eq!(gid(&v.join("d/e/f")), 0);
        // A different group is a mismatch: everything is redone.
        assert!(apply(v, 999, FsGroupPolicy::OnRootMismatch, None).unwrap());
        assert_eq!(gid(&v.join("d/e/f")), 999);
        assert_eq!(gid(v), 999);
    }
}
