//! Container mount destinations, resolved as the container will see them.
//!
//! A container's destination is looked up inside its own root with
//! `openat2(RESOLVE_IN_ROOT)`: images carry symlinks such as
//! `/var/run -> /run` that kubelet's mounts (the service-account token at
//! `/var/run/secrets/...`) must go through, and the kernel keeps every
//! step, `..` and absolute symlinks included, inside the container's root.
//! Nothing outside that root (the guest's own tools, other containers) can
//! be reached.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// What the mounted thing is, and so what the destination must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leaf {
    Directory,
    File,
}

/// Set once, before anything is resolved, by an init helper building a
/// container on the guest's own root: there a symlink that a volume's
/// content planted would make the agent create directories or files in
/// the guest's tree (one filesystem with the container's), so no
/// destination may go through one.
static NO_SYMLINKS: AtomicBool = AtomicBool::new(false);

/// Destinations of this container are resolved without any symlink.
pub fn refuse_symlinks() {
    NO_SYMLINKS.store(true, Ordering::SeqCst);
}

fn open_in(root: &impl AsFd, path: &str, flags: OFlags) -> Result<OwnedFd, Errno> {
    let path = if path.is_empty() { "." } else { path };
    let mut resolve = ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS;
    if NO_SYMLINKS.load(Ordering::SeqCst) {
        resolve |= ResolveFlags::NO_SYMLINKS;
    }
    crust_openat2::openat2(root, path, flags, Mode::empty(), resolve)
}

/// `dest`'s error for `op` failing with `e`.
fn dest_error(dest: &str, op: &str, e: Errno) -> String {
    if e == Errno::LOOP && NO_SYMLINKS.load(Ordering::SeqCst) {
        return format!(
            "destination {dest}: a symlink on the way (on the guest's root no destination follows one)"
        );
    }
    format!("destination {dest}: {op}: {e}")
}

/// The `/proc/self/fd` path of `fd`, for calls that take a path (a
/// mount's target).
pub fn proc_fd(fd: &impl std::os::fd::AsRawFd) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// The normal components of an absolute destination (`..` refused).
pub fn components(dest: &str) -> Result<Vec<String>, String> {
    let p = Path::new(dest);
    if !p.is_absolute() {
        return Err(format!("destination {dest:?} must be absolute"));
    }
    let mut out = Vec::new();
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => out.push(
                n.to_str()
                    .ok_or_else(|| format!("destination {dest:?} is not UTF-8"))?
                    .to_string(),
            ),
            Component::ParentDir | Component::Prefix(_) => {
                return Err(format!("destination {dest:?} must not contain '..'"));
            }
        }
    }
    Ok(out)
}

/// Opens (`O_PATH`) `dest` below `root` as the container sees it, creating
/// missing directories (0755) and, for a file leaf, an empty file.
pub fn open(root: &impl AsFd, dest: &str, leaf: Leaf) -> Result<OwnedFd, String> {
    let comps = components(dest)?;
    let err = |op: &str, e: Errno| dest_error(dest, op, e);
    for i in 0..comps.len() {
        let prefix = comps[..=i].join("/");
        let last = i + 1 == comps.len();
        match open_in(root, &prefix, OFlags::PATH) {
            Ok(fd) if !last => {
                let st = rustix::fs::fstat(&fd).map_err(|e| err("stat", e))?;
                if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
                    return Err(format!(
                        "destination {dest}: /{prefix} is not a directory in the container"
                    ));
                }
            }
            Ok(_) => {}
            Err(Errno::NOENT) => {
                let parent = open_in(
                    root,
                    &comps[..i].join("/"),
                    OFlags::PATH | OFlags::DIRECTORY,
                )
                .map_err(|e| err("open parent", e))?;
                let name = &comps[i];
                let made = if last && leaf == Leaf::File {
                    rustix::fs::openat(
                        &parent,
                        name.as_str(),
                        OFlags::CREATE | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                        Mode::from_raw_mode(0o644),
                    )
                    .map(drop)
                } else {
                    rustix::fs::mkdirat(&parent, name.as_str(), Mode::from_raw_mode(0o755))
                };
                match made {
                    Ok(()) | Err(Errno::EXIST) => {}
                    // A dangling symlink in the way: creating through it
                    // is refused by NOFOLLOW/mkdirat.
                    Err(e) => return Err(err("create", e)),
                }
            }
            Err(e) => return Err(err("open", e)),
        }
    }
    let fd = open_in(root, &comps.join("/"), OFlags::PATH).map_err(|e| err("open", e))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| err("stat", e))?;
    let is_dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
    match (leaf, is_dir) {
        (Leaf::Directory, false) => Err(format!(
            "destination {dest} is a file, but a directory is mounted there"
        )),
        (Leaf::File, true) => Err(format!(
            "destination {dest} is a directory, but a file is mounted there"
        )),
        _ => Ok(fd),
    }
}

/// Opens an existing `dest` below `root` without creating anything.
pub fn open_existing(root: &impl AsFd, dest: &str) -> Result<Option<OwnedFd>, String> {
    let comps = components(dest)?;
    match open_in(root, &comps.join("/"), OFlags::PATH) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(dest_error(dest, "open", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn root(dir: &Path) -> OwnedFd {
        rustix::fs::open(dir, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap()
    }

    fn path_of(fd: &OwnedFd) -> std::path::PathBuf {
        std::fs::read_link(proc_fd(fd)).unwrap()
    }

    #[test]
    fn symlinks_are_followed_inside_the_root_only() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path().join("root");
        std::fs::create_dir_all(r.join("run")).unwrap();
        std::fs::create_dir_all(r.join("var")).unwrap();
        symlink("/run", r.join("var/run")).unwrap();
        symlink("/", r.join("up")).unwrap();
        symlink("../../../..", r.join("dots")).unwrap();
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let rfd = root(&r);

        // /var/run/secrets lands in the root's /run, created on the way.
        let fd = open(&rfd, "/var/run/secrets/token", Leaf::Directory).unwrap();
        assert_eq!(path_of(&fd), r.join("run/secrets/token"));
        // Absolute and climbing symlinks stay in the root.
        let fd = open(&rfd, "/up/outside", Leaf::Directory).unwrap();
        assert_eq!(path_of(&fd), r.join("outside"));
        let fd = open(&rfd, "/dots/x", Leaf::File).unwrap();
        assert_eq!(path_of(&fd), r.join("x"));
        assert!(std::fs::read_dir(&outside).unwrap().next().is_none());
        // Kinds must match.
        assert!(open(&rfd, "/x", Leaf::Directory).is_err());
        assert!(open(&rfd, "/run", Leaf::File).is_err());
        assert!(open(&rfd, "relative", Leaf::File).is_err());
        assert!(open(&rfd, "/a/../b", Leaf::File).is_err());
        assert!(open_existing(&rfd, "/nope").unwrap().is_none());
    }
}
