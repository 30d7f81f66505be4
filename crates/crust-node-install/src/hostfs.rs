//! Every read and write the installer makes under the host root goes
//! through [`HostRoot`], which holds two rules:
//!
//! * **No symbolic links are followed** below the host root, in any
//!   component. Paths are walked one component at a time from a descriptor
//!   of the host root with `O_NOFOLLOW`, so a link met is refused by name
//!   with its target ([`InstallError::Symlink`]), and a component swapped
//!   for a link between two steps is refused too. Following a link would
//!   let a config named `config.toml` make the installer read (and print)
//!   `/etc/shadow`, resolve an absolute link inside the installer's own
//!   container rather than the host, and replace the link with a regular
//!   file that uninstall could not turn back into the link.
//! * **Only regular files are read or replaced.** A FIFO, socket or device
//!   is refused from `lstat` before it is opened (opening a device runs its
//!   driver; opening a FIFO waits for a writer), and the file is opened
//!   `O_NONBLOCK|O_NOFOLLOW` and `fstat`ed, so an entry swapped in between
//!   is refused instead of blocking.
//!
//! Writes are atomic: a fresh temporary (`O_EXCL`) beside the target,
//! fsync, rename, fsync of the directory.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::error::InstallError;

type Result<T> = std::result::Result<T, InstallError>;

/// A regular file's content and permission bits.
pub struct Regular {
    pub bytes: Vec<u8>,
    pub mode: u32,
}

/// The host's `/` as this process reaches it, opened once.
pub struct HostRoot {
    root: PathBuf,
    fd: OwnedFd,
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

fn kind(ft: FileType) -> &'static str {
    match ft {
        FileType::RegularFile => "regular file",
        FileType::Directory => "directory",
        FileType::Symlink => "symbolic link",
        FileType::Fifo => "FIFO",
        FileType::Socket => "socket",
        FileType::CharacterDevice => "character device",
        FileType::BlockDevice => "block device",
        FileType::Unknown => "special file",
    }
}

/// The normal components of a host path (`/etc/x` → `etc`, `x`).
fn parts(p: &Path) -> Vec<&std::ffi::OsStr> {
    p.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect()
}

impl HostRoot {
    /// Opens the host root itself (its own path may contain links: it is
    /// where this process was told the host is).
    pub fn open(root: &Path) -> Result<HostRoot> {
        let fd = rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| InstallError::Io(root.to_path_buf(), e.into()))?;
        Ok(HostRoot {
            root: root.to_path_buf(),
            fd,
        })
    }

    /// A host path as this process names it (for messages).
    pub fn shown(&self, host: &Path) -> PathBuf {
        parts(host).iter().fold(self.root.clone(), |p, c| p.join(c))
    }

    fn io(&self, host: &Path, e: Errno) -> InstallError {
        InstallError::Io(self.shown(host), e.into())
    }

    /// Why `name` in `dir` could not be used as `wanted`: a link (with its
    /// target), another kind of file, or the error itself.
    fn refuse(&self, dir: &OwnedFd, name: &std::ffi::OsStr, host: &Path, e: Errno) -> InstallError {
        match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => self.refuse_kind(dir, name, host, FileType::from_raw_mode(st.st_mode), e),
            Err(_) => self.io(host, e),
        }
    }

    fn refuse_kind(
        &self,
        dir: &OwnedFd,
        name: &std::ffi::OsStr,
        host: &Path,
        ft: FileType,
        e: Errno,
    ) -> InstallError {
        match ft {
            FileType::Symlink => InstallError::Symlink {
                path: self.shown(host),
                target: rustix::fs::readlinkat(dir, name, Vec::new())
                    .map(|t| PathBuf::from(t.to_string_lossy().into_owned()))
                    .unwrap_or_else(|_| "?".into()),
            },
            FileType::RegularFile => self.io(host, e),
            other => InstallError::NotAFile {
                path: self.shown(host),
                kind: kind(other),
            },
        }
    }

    /// Walks to directory `host` without following links; `None` when a
    /// component does not exist. With `created`, missing components are
    /// made (0755) and recorded.
    fn walk(
        &self,
        host: &Path,
        mut created: Option<&mut BTreeSet<PathBuf>>,
    ) -> Result<Option<OwnedFd>> {
        let mut cur = rustix::io::dup(&self.fd).map_err(|e| self.io(Path::new("/"), e))?;
        let mut at = PathBuf::from("/");
        for c in parts(host) {
            at.push(c);
            let next = match rustix::fs::openat(&cur, c, DIR_FLAGS, Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::NOENT) => {
                    let Some(created) = created.as_deref_mut() else {
                        return Ok(None);
                    };
                    rustix::fs::mkdirat(&cur, c, Mode::from_raw_mode(0o755))
                        .map_err(|e| self.io(&at, e))?;
                    created.insert(at.clone());
                    let fd = rustix::fs::openat(&cur, c, DIR_FLAGS, Mode::empty())
                        .map_err(|e| self.refuse(&cur, c, &at, e))?;
                    // Not the umask's choice: containerd and the shim run as root,
                    // but the tree must stay readable.
                    rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o755))
                        .map_err(|e| self.io(&at, e))?;
                    fd
                }
                Err(e) => {
                    return Err(
                        match rustix::fs::statat(&cur, c, AtFlags::SYMLINK_NOFOLLOW) {
                            Ok(st) => match FileType::from_raw_mode(st.st_mode) {
                                FileType::Symlink => {
                                    self.refuse_kind(&cur, c, &at, FileType::Symlink, e)
                                }
                                FileType::Directory => self.io(&at, e),
                                other => InstallError::NotADirectory {
                                    path: self.shown(&at),
                                    kind: kind(other),
                                },
                            },
                            Err(_) => self.io(&at, e),
                        },
                    );
                }
            };
            cur = next;
        }
        Ok(Some(cur))
    }

    /// The directories of `host` (deepest last) that do not exist yet;
    /// refuses a link or non-directory on the way. Writes nothing.
    pub fn missing_dirs(&self, host: &Path) -> Result<Vec<PathBuf>> {
        let all = parts(host);
        for n in (0..=all.len()).rev() {
            let prefix: PathBuf = std::iter::once(std::ffi::OsStr::new("/"))
                .chain(all[..n].iter().copied())
                .collect();
            if self.walk(&prefix, None)?.is_some() {
                let mut missing = Vec::new();
                let mut p = prefix;
                for c in &all[n..] {
                    p.push(c);
                    missing.push(p.clone());
                }
                return Ok(missing);
            }
        }
        Ok(Vec::new())
    }

    /// Creates directory `host` and its missing parents, recording the
    /// ones created.
    pub fn mkdirs(&self, host: &Path, created: &mut BTreeSet<PathBuf>) -> Result<()> {
        self.walk(host, Some(created)).map(drop)
    }

    fn split<'a>(&self, host: &'a Path) -> (&'a Path, &'a std::ffi::OsStr) {
        (
            host.parent().unwrap_or(Path::new("/")),
            host.file_name().expect("a file path"),
        )
    }

    /// Reads `name` in `dir` if it is a regular file; `None` if absent.
    fn read_in(
        &self,
        dir: &OwnedFd,
        name: &std::ffi::OsStr,
        host: &Path,
    ) -> Result<Option<Regular>> {
        let st = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(None),
            Err(e) => return Err(self.io(host, e)),
        };
        let ft = FileType::from_raw_mode(st.st_mode);
        if ft != FileType::RegularFile {
            return Err(self.refuse_kind(dir, name, host, ft, Errno::INVAL));
        }
        let flags =
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(dir, name, flags, Mode::empty())
            .map_err(|e| self.refuse(dir, name, host, e))?;
        let now = rustix::fs::fstat(&fd).map_err(|e| self.io(host, e))?;
        let ft = FileType::from_raw_mode(now.st_mode);
        if ft != FileType::RegularFile || (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) {
            // Swapped between lstat and open.
            return Err(InstallError::NotAFile {
                path: self.shown(host),
                kind: if ft == FileType::RegularFile {
                    "file replaced while read"
                } else {
                    kind(ft)
                },
            });
        }
        let mut bytes = Vec::new();
        File::from(fd)
            .read_to_end(&mut bytes)
            .map_err(|e| InstallError::Io(self.shown(host), e))?;
        Ok(Some(Regular {
            bytes,
            mode: now.st_mode & 0o7777,
        }))
    }

    /// Reads regular file `host`; `None` if it (or its directory) is absent.
    pub fn read(&self, host: &Path) -> Result<Option<Regular>> {
        let (parent, name) = self.split(host);
        match self.walk(parent, None)? {
            None => Ok(None),
            Some(dir) => self.read_in(&dir, name, host),
        }
    }

    /// Checks, without opening it, that `host` is absent or a regular file
    /// reached without links.
    pub fn check_file(&self, host: &Path) -> Result<()> {
        let (parent, name) = self.split(host);
        let Some(dir) = self.walk(parent, None)? else {
            return Ok(());
        };
        match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(self.io(host, e)),
            Ok(st) => match FileType::from_raw_mode(st.st_mode) {
                FileType::RegularFile => Ok(()),
                ft => Err(self.refuse_kind(&dir, name, host, ft, Errno::INVAL)),
            },
        }
    }

    /// Writes `bytes` to `host` atomically unless it already holds them
    /// with the same mode. `mode` None keeps the existing file's (0644 for
    /// a new one). The directory must exist. Returns whether it wrote.
    pub fn put(&self, host: &Path, bytes: &[u8], mode: Option<u32>) -> Result<bool> {
        let (parent, name) = self.split(host);
        let dir = self
            .walk(parent, None)?
            .ok_or_else(|| self.io(parent, Errno::NOENT))?;
        let old = self.read_in(&dir, name, host)?;
        let mode = mode.or(old.as_ref().map(|o| o.mode)).unwrap_or(0o644);
        if old.is_some_and(|o| o.mode == mode && o.bytes == bytes) {
            return Ok(false);
        }
        let tmp = format!(".{}.crust-tmp", name.to_string_lossy());
        let tmp_host = parent.join(&tmp);
        match rustix::fs::unlinkat(&dir, tmp.as_str(), AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(self.io(&tmp_host, e)),
        }
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&dir, tmp.as_str(), flags, Mode::from_raw_mode(mode))
            .map_err(|e| self.io(&tmp_host, e))?;
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)).map_err(|e| self.io(&tmp_host, e))?;
        let mut f = File::from(fd);
        f.write_all(bytes)
            .and_then(|()| f.sync_all())
            .map_err(|e| InstallError::Io(self.shown(&tmp_host), e))?;
        rustix::fs::renameat(&dir, tmp.as_str(), &dir, name).map_err(|e| self.io(host, e))?;
        rustix::fs::fsync(&dir).map_err(|e| self.io(parent, e))?;
        Ok(true)
    }

    /// Removes regular file `host`; false if it was not there. Anything
    /// else at that path (a link put there since) is refused, not removed.
    pub fn remove_file(&self, host: &Path) -> Result<bool> {
        let (parent, name) = self.split(host);
        let Some(dir) = self.walk(parent, None)? else {
            return Ok(false);
        };
        match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Err(Errno::NOENT) => return Ok(false),
            Err(e) => return Err(self.io(host, e)),
            Ok(st) => match FileType::from_raw_mode(st.st_mode) {
                FileType::RegularFile => {}
                ft => return Err(self.refuse_kind(&dir, name, host, ft, Errno::INVAL)),
            },
        }
        match rustix::fs::unlinkat(&dir, name, AtFlags::empty()) {
            Ok(()) => Ok(true),
            Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(self.io(host, e)),
        }
    }

    /// Removes directory `host` if it is empty; false if it is absent, not
    /// empty, or no longer a directory (someone else's now).
    pub fn remove_dir(&self, host: &Path) -> Result<bool> {
        let (parent, name) = self.split(host);
        let Some(dir) = self.walk(parent, None)? else {
            return Ok(false);
        };
        match rustix::fs::unlinkat(&dir, name, AtFlags::REMOVEDIR) {
            Ok(()) => Ok(true),
            Err(Errno::NOENT | Errno::NOTEMPTY | Errno::EXIST | Errno::NOTDIR) => Ok(false),
            Err(e) => Err(self.io(host, e)),
        }
    }
}
