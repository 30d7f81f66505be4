//! The sandbox's virtio-fs share on the host: one directory per sandbox
//! (`<root>/<id>/share`) served by virtiofsd, holding bind mounts of the
//! host paths the guest may see. Used by both front doors: the containerd
//! shim (container rootfs and binds) and the `crust-runtime` CLI with
//! `--share-binds` (bundle binds without a hand-off record).

use std::path::{Path, PathBuf};

use rustix::mount::{MountPropagationFlags, UnmountFlags};

/// The virtio-fs tag of a sandbox's share.
pub const SHARE_TAG: &str = "crust-pod";
/// The share's directory name inside the sandbox directory.
pub const SHARE_DIR: &str = "share";

/// What failed on the host, with the path or step it concerns.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct ShareError {
    pub what: String,
    #[source]
    pub source: std::io::Error,
}

fn err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ShareError {
    let what = what.into();
    move |source| ShareError { what, source }
}

/// Creates `dir` as a mount point of its own with shared propagation, so
/// binds made below it after virtiofsd started (in its own mount
/// namespace) still reach virtiofsd.
pub fn make(dir: &Path) -> Result<(), ShareError> {
    std::fs::create_dir_all(dir).map_err(err("creating the share"))?;
    rustix::mount::mount_bind(dir, dir).map_err(|e| err("binding the share")(e.into()))?;
    rustix::mount::mount_change(dir, MountPropagationFlags::SHARED)
        .map_err(|e| err("making the share shared")(e.into()))
}

/// Binds host `source` (file or directory, recursively) at `target` in a
/// share, creating the mount point.
pub fn bind_into(source: &Path, target: &Path) -> Result<(), ShareError> {
    let meta = std::fs::metadata(source)
        .map_err(err(format!("bind mount source {}", source.display())))?;
    if meta.is_dir() {
        std::fs::create_dir_all(target).map_err(err("share dir"))?;
    } else {
        std::fs::File::create(target).map_err(err("share file"))?;
    }
    rustix::mount::mount_bind_recursive(source, target)
        .map_err(|e| err(format!("binding {} into the share", source.display()))(e.into()))
}

/// Mount points strictly below `dir` in this mount namespace.
pub fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .filter(|p| p.starts_with(dir) && p != dir)
        .collect();
    points.sort();
    points.dedup();
    points
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        // One byte per escape: `\400` and above are literal text (and
        // overflowed the u8 arithmetic).
        if b[i] == b'\\'
            && i + 3 < b.len()
            && (b'0'..=b'3').contains(&b[i + 1])
            && b[i + 2..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    use std::os::unix::ffi::OsStringExt;
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// Lazily unmounts every mount strictly below `dir`, deepest first.
pub fn unmount_tree(dir: &Path) {
    for _ in 0..3 {
        let points = mounts_below(dir);
        if points.is_empty() {
            return;
        }
        for p in points.iter().rev() {
            let _ = rustix::mount::unmount(p, UnmountFlags::DETACH);
        }
    }
}

/// Unmounts everything in and below a share and removes its directory.
/// Never deletes through a mount: if anything is still mounted below it,
/// the directory stays and the error says what.
pub fn remove(dir: &Path) -> Result<(), ShareError> {
    unmount_tree(dir);
    // The share's own bind (EINVAL once `dir` is no mount point).
    for _ in 0..4 {
        if rustix::mount::unmount(dir, UnmountFlags::DETACH).is_err() {
            break;
        }
    }
    let left = mounts_below(dir);
    if !left.is_empty() {
        return Err(ShareError {
            what: format!("removing the share {}", dir.display()),
            source: std::io::Error::other(format!(
                "still mounted below it: {}",
                left.iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        });
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(err(format!("removing {}", dir.display()))(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape("/a\\040b"), PathBuf::from("/a b"));
        assert_eq!(unescape("/a\\134b"), PathBuf::from("/a\\b"));
        assert_eq!(unescape("/plain"), PathBuf::from("/plain"));
        assert_eq!(unescape("/end\\04"), PathBuf::from("/end\\04"));
        // Above \377 is no escape: kept as written, no overflow.
        assert_eq!(unescape("/a\\400b"), PathBuf::from("/a\\400b"));
        assert_eq!(unescape("/a\\777"), PathBuf::from("/a\\777"));
    }

    /// A share with a bind of a directory holding data: removing the share
    /// unmounts the bind and leaves the source's data alone.
    #[test]
    fn remove_never_deletes_through_a_bind() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        std::fs::create_dir(&src).unwrap();
        std::fs::write(src.join("keep"), b"data").unwrap();
        let share = t.path().join("sb/share");
        make(&share).unwrap();
        bind_into(&src, &share.join("m0")).unwrap();
        assert_eq!(std::fs::read(share.join("m0/keep")).unwrap(), b"data");
        remove(&share).unwrap();
        assert!(!share.exists());
        assert_eq!(std::fs::read(src.join("keep")).unwrap(), b"data");
        assert!(mounts_below(t.path()).is_empty());
    }
}
