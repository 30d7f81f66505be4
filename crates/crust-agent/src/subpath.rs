//! subPath resolution that cannot leave the volume.
//!
//! Every lookup is an `openat2` relative to the volume root with
//! `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`, so `..`, absolute symlinks and
//! relative symlinks climbing out are refused by the kernel, not by string
//! checks that a racing workload could defeat. The result is an `O_PATH`
//! descriptor; callers bind-mount `/proc/self/fd/N`, so the path is never
//! looked up again.

use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubpathError {
    #[error("subPath {0:?} must be relative to the volume root")]
    Absolute(String),
    #[error("subPath {0:?} must not contain '..'")]
    DotDot(String),
    #[error("subPath {0:?} contains a NUL byte")]
    Nul(String),
    #[error("subPath {0:?} resolves outside the volume (a symlink points out of it)")]
    Escapes(String),
    #[error("subPath {path:?}: {component:?} is not a directory")]
    NotADirectory { path: String, component: String },
    #[error("subPath {path:?}: too many symlinks or a /proc magic link at {component:?}")]
    Loop { path: String, component: String },
    #[error("subPath {path:?}: cannot create {component:?} (dangling symlink?)")]
    Dangling { path: String, component: String },
    #[error("subPath {path:?}: {op} failed: {errno}")]
    Io {
        path: String,
        op: &'static str,
        errno: Errno,
    },
}

/// Splits a subPath into components, refusing absolute paths and `..`.
/// Empty and `.` components are dropped; an empty result means the root.
pub fn components(subpath: &str) -> Result<Vec<&str>, SubpathError> {
    if subpath.contains('\0') {
        return Err(SubpathError::Nul(subpath.into()));
    }
    if subpath.starts_with('/') {
        return Err(SubpathError::Absolute(subpath.into()));
    }
    let mut out = Vec::new();
    for c in subpath.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(SubpathError::DotDot(subpath.into())),
            c => out.push(c),
        }
    }
    Ok(out)
}

fn resolve(root: &impl AsFd, path: &str, flags: OFlags) -> Result<OwnedFd, Errno> {
    let path = if path.is_empty() { "." } else { path };
    crust_openat2::openat2(
        root,
        path,
        flags,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
    )
}

fn map_err(path: &str, component: &str, op: &'static str, e: Errno) -> SubpathError {
    match e {
        Errno::XDEV => SubpathError::Escapes(path.into()),
        Errno::LOOP => SubpathError::Loop {
            path: path.into(),
            component: component.into(),
        },
        Errno::NOTDIR => SubpathError::NotADirectory {
            path: path.into(),
            component: component.into(),
        },
        errno => SubpathError::Io {
            path: path.into(),
            op,
            errno,
        },
    }
}

/// Opens `subpath` beneath `root` as an `O_PATH` descriptor, creating
/// missing directories (with `dir_mode`, like kubelet, which copies the
/// volume root's mode) when `create` is set.
pub fn open_beneath(
    root: &impl AsFd,
    subpath: &str,
    create: bool,
    dir_mode: Mode,
) -> Result<OwnedFd, SubpathError> {
    let comps = components(subpath)?;
    let full = comps.join("/");
    match resolve(root, &full, OFlags::PATH) {
        Ok(fd) => return Ok(fd),
        Err(Errno::NOENT) if create => {}
        Err(e) => return Err(map_err(subpath, &full, "open", e)),
    }
    // Walk down, creating what is missing. Each prefix is re-resolved from
    // the root so a symlink planted mid-way is still held beneath it.
    let mut parent = resolve(root, "", OFlags::PATH | OFlags::DIRECTORY)
        .map_err(|e| map_err(subpath, ".", "open", e))?;
    for i in 0..comps.len() {
        let prefix = comps[..=i].join("/");
        let last = i + 1 == comps.len();
        let flags = if last {
            OFlags::PATH
        } else {
            OFlags::PATH | OFlags::DIRECTORY
        };
        match resolve(root, &prefix, flags) {
            Ok(fd) => {
                parent = fd;
                continue;
            }
            Err(Errno::NOENT) => {}
            Err(e) => return Err(map_err(subpath, comps[i], "open", e)),
        }
        match rustix::fs::mkdirat(&parent, comps[i], dir_mode) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(map_err(subpath, comps[i], "mkdir", e)),
        }
        // Re-open read-only to set the mode exactly (umask applies to
        // mkdirat) and then as O_PATH for the caller.
        let dir = match resolve(root, &prefix, OFlags::RDONLY | OFlags::DIRECTORY) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                return Err(SubpathError::Dangling {
                    path: subpath.into(),
                    component: comps[i].into(),
                });
            }
            Err(e) => return Err(map_err(subpath, comps[i], "open", e)),
        };
        rustix::fs::fchmod(&dir, dir_mode).map_err(|e| map_err(subpath, comps[i], "chmod", e))?;
        parent =
            resolve(root, &prefix, flags).map_err(|e| map_err(subpath, comps[i], "open", e))?;
    }
    Ok(parent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};

    fn root(dir: &std::path::Path) -> OwnedFd {
        rustix::fs::open(dir, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap()
    }

    fn path_of(fd: &OwnedFd) -> std::path::PathBuf {
        use std::os::fd::AsRawFd;
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap()
    }

    #[test]
    fn component_rules() {
        assert_eq!(components("a/./b//c/").unwrap(), vec!["a", "b", "c"]);
        assert!(components("").unwrap().is_empty());
        assert!(matches!(components("/etc"), Err(SubpathError::Absolute(_))));
        assert!(matches!(components("a/../b"), Err(SubpathError::DotDot(_))));
        assert!(matches!(components(".."), Err(SubpathError::DotDot(_))));
        assert!(matches!(components("a\0b"), Err(SubpathError::Nul(_))));
    }

    #[test]
    fn resolves_existing_and_inner_symlinks() {
        let vol = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(vol.path().join("data/app")).unwrap();
        symlink("data/app", vol.path().join("link")).unwrap();
        let r = root(vol.path());
        let fd = open_beneath(&r, "data/app", false, Mode::from_raw_mode(0o755)).unwrap();
        assert_eq!(path_of(&fd), vol.path().join("data/app"));
        // A symlink that stays inside the volume is followed.
        let fd = open_beneath(&r, "link", false, Mode::from_raw_mode(0o755)).unwrap();
        assert_eq!(path_of(&fd), vol.path().join("data/app"));
    }

    #[test]
    fn escaping_symlinks_are_refused_and_nothing_is_created() {
        let outer = tempfile::tempdir().unwrap();
        let vol = outer.path().join("vol");
        std::fs::create_dir(&vol).unwrap();
        std::fs::create_dir(outer.path().join("secret")).unwrap();
        symlink("/", vol.join("abs")).unwrap();
        symlink("../secret", vol.join("rel")).unwrap();
        symlink("/proc/self/root", vol.join("magic")).unwrap();
        let r = root(&vol);
        for sp in ["abs", "abs/etc", "rel", "rel/new/dir", "magic/x"] {
            let e = open_beneath(&r, sp, true, Mode::from_raw_mode(0o755)).unwrap_err();
            assert!(matches!(e, SubpathError::Escapes(_)), "{sp}: {e}");
        }
        assert!(!outer.path().join("secret/new").exists());
        assert_eq!(
            std::fs::read_dir(outer.path().join("secret"))
                .unwrap()
                .count(),
            0
        );
    }

    #[test]
    fn creates_missing_dirs_with_given_mode() {
        let vol = tempfile::tempdir().unwrap();
        let r = root(vol.path());
        let e = open_beneath(&r, "x/y/z", false, Mode::from_raw_mode(0o755)).unwrap_err();
        assert!(
            matches!(
                e,
                SubpathError::Io {
                    errno: Errno::NOENT,
                    ..
                }
            ),
            "{e}"
        );
        let fd = open_beneath(&r, "x/y/z", true, Mode::from_raw_mode(0o2775)).unwrap();
        let p = vol.path().join("x/y/z");
        assert_eq!(path_of(&fd), p);
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777,
            0o2775
        );
        // A file in the middle of the path is not a directory.
        std::fs::write(vol.path().join("f"), b"").unwrap();
        let e = open_beneath(&r, "f/sub", true, Mode::from_raw_mode(0o755)).unwrap_err();
        assert!(matches!(e, SubpathError::NotADirectory { .. }), "{e}");
        // A dangling symlink inside the volume cannot be created through.
        symlink("missing", vol.path().join("dangle")).unwrap();
        let e = open_beneath(&r, "dangle", true, Mode::from_raw_mode(0o755)).unwrap_err();
        assert!(matches!(e, SubpathError::Dangling { .. }), "{e}");
    }
}
