//! Workload mount destinations, opened without following any symlink.
//!
//! A destination such as `/data/logs` may run through an earlier bind of a
//! volume, whose contents an earlier pod controlled. A string check cannot
//! see a `logs -> /usr/sbin` symlink planted there, so every component is
//! opened with `openat2(RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` from
//! the root, missing directories are made with `mkdirat` in the descriptor
//! just opened, and the caller mounts onto `/proc/self/fd/N` of the result:
//! the path is never looked up by name again.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DestinationError {
    #[error(
        "destination {dest:?}: {component:?} is a symlink; workload mount destinations must not \
         contain symlinks"
    )]
    Symlink { dest: String, component: String },
    #[error("destination {dest:?}: {component:?} is not a directory")]
    NotADirectory { dest: String, component: String },
    #[error("destination {dest:?} is a directory, but the mounted subPath is a file")]
    IsADirectory { dest: String },
    #[error("destination {dest:?} must be an absolute path below /")]
    NotBelowRoot { dest: String },
    #[error("destination {dest:?}: {op} {component:?}: {errno}")]
    Io {
        dest: String,
        component: String,
        op: &'static str,
        errno: Errno,
    },
}

impl DestinationError {
    /// Whether the caller's input is at fault (rather than the guest).
    pub fn is_invalid_argument(&self) -> bool {
        !matches!(self, DestinationError::Io { .. })
    }
}

/// What the mounted source is, and so what the destination must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leaf {
    Directory,
    File,
}

/// An opened destination: its parent directory and its own `O_PATH`
/// descriptor, both reached without following a symlink.
#[derive(Debug)]
pub struct Destination {
    pub parent: OwnedFd,
    pub name: OsString,
    pub fd: OwnedFd,
}

impl Destination {
    /// `/proc/self/fd/N` of the destination itself: the mount target.
    pub fn proc_path(&self) -> PathBuf {
        proc_fd(&self.fd)
    }

    /// `/proc/self/fd/P/name`: the destination looked up afresh in its
    /// parent, which crosses into whatever is mounted on it now. Use with
    /// `UMOUNT_NOFOLLOW`.
    pub fn proc_child_path(&self) -> PathBuf {
        proc_fd(&self.parent).join(&self.name)
    }

    /// The destination opened afresh (`O_PATH`, no symlink followed): the
    /// root of what was mounted on it since [`open`].
    pub fn reopen(&self) -> Result<OwnedFd, Errno> {
        open_one(&self.parent, &self.name, OFlags::PATH, Mode::empty())
    }
}

pub fn proc_fd(fd: &impl AsRawFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

fn names(dest: &Path) -> Vec<&OsStr> {
    dest.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect()
}

/// One component, never following a symlink (trailing ones included).
fn open_one(dir: &impl AsFd, name: &OsStr, flags: OFlags, mode: Mode) -> Result<OwnedFd, Errno> {
    crust_openat2::openat2(
        dir,
        name,
        flags,
        mode,
        ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
}

struct Walk<'a> {
    dest: &'a Path,
}

impl Walk<'_> {
    fn err(&self, name: &OsStr, op: &'static str, e: Errno) -> DestinationError {
        let dest = self.dest.display().to_string();
        let component = name.to_string_lossy().into_owned();
        match e {
            Errno::LOOP => DestinationError::Symlink { dest, component },
            Errno::NOTDIR => DestinationError::NotADirectory { dest, component },
            errno => DestinationError::Io {
                dest,
                component,
                op,
                errno,
            },
        }
    }

    /// Opens directory `name` in `dir`, making it first if `create`.
    fn dir(
        &self,
        dir: &impl AsFd,
        name: &OsStr,
        create: bool,
        mode: Mode,
    ) -> Result<OwnedFd, DestinationError> {
        let flags = OFlags::PATH | OFlags::DIRECTORY;
        match open_one(dir, name, flags, Mode::empty()) {
            Ok(fd) => return Ok(fd),
            Err(Errno::NOENT) if create => {}
            Err(e) => return Err(self.err(name, "open", e)),
        }
        // mkdirat never follows a symlink in its last component; a dangling
        // one gives EEXIST and the re-open below refuses it.
        match rustix::fs::mkdirat(dir, name, mode) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(self.err(name, "mkdir", e)),
        }
        open_one(dir, name, flags, Mode::empty()).map_err(|e| self.err(name, "open", e))
    }

    fn file(&self, dir: &impl AsFd, name: &OsStr) -> Result<OwnedFd, DestinationError> {
        let fd = match open_one(dir, name, OFlags::PATH, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                // O_EXCL: an existing name (a dangling symlink too) is never
                // opened for writing, so no device or FIFO is touched.
                match open_one(
                    dir,
                    name,
                    OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL,
                    Mode::from_raw_mode(0o644),
                ) {
                    Ok(_) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(self.err(name, "create", e)),
                }
                open_one(dir, name, OFlags::PATH, Mode::empty())
                    .map_err(|e| self.err(name, "open", e))?
            }
            Err(e) => return Err(self.err(name, "open", e)),
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| self.err(name, "stat", e))?;
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => Err(DestinationError::IsADirectory {
                dest: self.dest.display().to_string(),
            }),
            FileType::Symlink => Err(self.err(name, "open", Errno::LOOP)),
            _ => Ok(fd),
        }
    }
}

/// Opens (creating what is missing, directories with `dir_mode`) the
/// destination `dest` below `root` for a source of kind `leaf`. `dest` is
/// absolute with no `..` (checked by the caller); it is taken relative to
/// `root`, which is `/` in the guest and a temp dir in tests.
pub fn open(
    root: &impl AsFd,
    dest: &Path,
    leaf: Leaf,
    dir_mode: Mode,
) -> Result<Destination, DestinationError> {
    let w = Walk { dest };
    let all = names(dest);
    if dest.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(DestinationError::NotBelowRoot {
            dest: dest.display().to_string(),
        });
    }
    let Some((last, dirs)) = all.split_last() else {
        return Err(DestinationError::NotBelowRoot {
            dest: dest.display().to_string(),
        });
    };
    let mut parent = open_one(
        root,
        OsStr::new("."),
        OFlags::PATH | OFlags::DIRECTORY,
        Mode::empty(),
    )
    .map_err(|e| w.err(OsStr::new("/"), "open", e))?;
    for name in dirs {
        parent = w.dir(&parent, name, true, dir_mode)?;
    }
    let fd = match leaf {
        Leaf::Directory => w.dir(&parent, last, true, dir_mode)?,
        Leaf::File => w.file(&parent, last)?,
    };
    Ok(Destination {
        parent,
        name: (*last).to_owned(),
        fd,
    })
}

/// The parent directory of an existing destination, reached without
/// following a symlink or creating anything, and the last component.
pub fn open_parent(root: &impl AsFd, dest: &Path) -> Result<(OwnedFd, OsString), DestinationError> {
    let w = Walk { dest };
    let all = names(dest);
    let Some((last, dirs)) = all.split_last() else {
        return Err(DestinationError::NotBelowRoot {
            dest: dest.display().to_string(),
        });
    };
    let mut parent = open_one(
        root,
        OsStr::new("."),
        OFlags::PATH | OFlags::DIRECTORY,
        Mode::empty(),
    )
    .map_err(|e| w.err(OsStr::new("/"), "open", e))?;
    for name in dirs {
        parent = w.dir(&parent, name, false, Mode::empty())?;
    }
    Ok((parent, (*last).to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};

    fn root(dir: &Path) -> OwnedFd {
        rustix::fs::open(dir, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap()
    }

    fn path_of(fd: &OwnedFd) -> PathBuf {
        std::fs::read_link(proc_fd(fd)).unwrap()
    }

    /// Every entry below `dir`, sorted, symlinks not followed.
    fn tree(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    todo.push(e.path());
                }
                out.push(e.path().strip_prefix(dir).unwrap().to_path_buf());
            }
        }
        out.sort();
        out
    }

    const M: Mode = Mode::from_raw_mode(0o755);

    #[test]
    fn creates_missing_directories_and_files() {
        let t = tempfile::tempdir().unwrap();
        let r = root(t.path());
        let d = open(&r, Path::new("/a/b/c"), Leaf::Directory, M).unwrap();
        assert_eq!(path_of(&d.fd), t.path().join("a/b/c"));
        assert_eq!(path_of(&d.parent), t.path().join("a/b"));
        assert_eq!(d.name, "c");
        assert!(std::fs::metadata(t.path().join("a/b/c")).unwrap().is_dir());
        assert_eq!(
            std::fs::read_link(d.proc_path()).unwrap(),
            t.path().join("a/b/c")
        );
        // Idempotent on what exists.
        let d2 = open(&r, Path::new("/a/b/c"), Leaf::Directory, M).unwrap();
        assert_eq!(path_of(&d2.fd), t.path().join("a/b/c"));

        let f = open(&r, Path::new("/a/x/conf"), Leaf::File, M).unwrap();
        let md = std::fs::symlink_metadata(t.path().join("a/x/conf")).unwrap();
        assert!(md.is_file() && md.len() == 0);
        assert_eq!(md.permissions().mode() & 0o7777 & !0o644, 0, "at most 0644");
        std::fs::write(t.path().join("a/x/conf"), b"keep").unwrap();
        let f2 = open(&r, Path::new("/a/x/conf"), Leaf::File, M).unwrap();
        assert_eq!(path_of(&f2.fd), path_of(&f.fd));
        assert_eq!(std::fs::read(t.path().join("a/x/conf")).unwrap(), b"keep");

        // Kind mismatches are refused.
        let e = open(&r, Path::new("/a/b"), Leaf::File, M).unwrap_err();
        assert!(matches!(e, DestinationError::IsADirectory { .. }), "{e}");
        let e = open(&r, Path::new("/a/x/conf"), Leaf::Directory, M).unwrap_err();
        assert!(matches!(e, DestinationError::NotADirectory { .. }), "{e}");
        let e = open(&r, Path::new("/a/x/conf/deeper"), Leaf::Directory, M).unwrap_err();
        assert!(matches!(e, DestinationError::NotADirectory { .. }), "{e}");
        assert!(e.is_invalid_argument());
        assert!(!t.path().join("a/x/conf/deeper").exists());
        for bad in ["/", "", "/a/../b"] {
            let e = open(&r, Path::new(bad), Leaf::Directory, M).unwrap_err();
            assert!(matches!(e, DestinationError::NotBelowRoot { .. }), "{bad}");
        }
    }

    #[test]
    fn symlink_components_are_refused_and_nothing_is_created() {
        let outer = tempfile::tempdir().unwrap();
        let sys = outer.path().join("sbin");
        std::fs::create_dir(&sys).unwrap();
        std::fs::write(sys.join("tool"), b"x").unwrap();
        let rootdir = outer.path().join("root");
        std::fs::create_dir_all(rootdir.join("data")).unwrap();
        // Absolute, relative, dangling and magic links, at the end and
        // in the middle of the path.
        symlink(&sys, rootdir.join("data/logs")).unwrap();
        symlink("../../sbin", rootdir.join("data/rel")).unwrap();
        symlink("nowhere", rootdir.join("data/dangling")).unwrap();
        symlink("/proc/self/root", rootdir.join("data/magic")).unwrap();
        symlink("data", rootdir.join("inner")).unwrap();
        std::fs::write(rootdir.join("data/file"), b"").unwrap();
        symlink("file", rootdir.join("data/filelink")).unwrap();
        let before_sys = tree(&sys);
        let before_root = tree(&rootdir);
        let r = root(&rootdir);
        for (dest, component) in [
            ("/data/logs", "logs"),
            ("/data/logs/new", "logs"),
            ("/data/rel", "rel"),
            ("/data/rel/x/y", "rel"),
            ("/data/dangling", "dangling"),
            ("/data/dangling/x", "dangling"),
            ("/data/magic/etc", "magic"),
            ("/inner/logs", "inner"),
        ] {
            for leaf in [Leaf::Directory, Leaf::File] {
                let e = open(&r, Path::new(dest), leaf, M).unwrap_err();
                assert_eq!(
                    e,
                    DestinationError::Symlink {
                        dest: dest.into(),
                        component: component.into()
                    },
                    "{dest} {leaf:?}"
                );
                assert!(e.is_invalid_argument());
            }
        }
        let e = open(&r, Path::new("/data/filelink"), Leaf::File, M).unwrap_err();
        assert!(matches!(e, DestinationError::Symlink { .. }), "{e}");
        assert_eq!(tree(&sys), before_sys, "nothing made through a symlink");
        assert_eq!(tree(&rootdir), before_root, "nothing made beside it");
        assert!(!rootdir.join("nowhere").exists());
        // The parent lookup used for unmounting refuses them too.
        let e = open_parent(&r, Path::new("/data/logs/x")).unwrap_err();
        assert!(matches!(e, DestinationError::Symlink { .. }), "{e}");
        let (p, name) = open_parent(&r, Path::new("/data/logs")).unwrap();
        assert_eq!((path_of(&p), name), (rootdir.join("data"), "logs".into()));
        let e = open_parent(&r, Path::new("/missing/x")).unwrap_err();
        assert!(
            matches!(
                e,
                DestinationError::Io {
                    errno: Errno::NOENT,
                    ..
                }
            ),
            "{e}"
        );
        assert!(!rootdir.join("missing").exists());
    }
}
