//! What a publish target shows on the host while the volume's filesystem
//! is inside a VM (a `deferFsOps=true` publication, or a handover): a
//! read-only tmpfs holding one `README` that says where the volume went.
//!
//! An empty writable directory there would be dangerous: a pod whose
//! runtime is not a VM runtime (runc) gets the target bound into its
//! container and would write onto the node's root disk, silently. With
//! the placeholder its first write fails (`EROFS`, "Read-only file
//! system") and `cat README` explains why. The tmpfs is tiny (16 KiB, a
//! few inodes), `nosuid,nodev,noexec`, and recognised by its source name,
//! so unpublish removes exactly this and nothing else.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rustix::mount::{MountFlags, UnmountFlags};

/// The tmpfs source name that marks a placeholder in the mount table.
pub const SOURCE: &str = crust_handoff::PLACEHOLDER_SOURCE;
/// The file in the placeholder.
pub const README: &str = "README";

#[derive(Debug, thiserror::Error)]
#[error("placeholder on {target}: {op}: {source}")]
pub struct PlaceholderError {
    target: String,
    op: &'static str,
    #[source]
    source: std::io::Error,
}

fn err<'a>(
    target: &'a Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> PlaceholderError + 'a {
    move |source| PlaceholderError {
        target: target.display().to_string(),
        op,
        source,
    }
}

/// Whether the topmost mount at `target` is a placeholder.
pub fn is_mounted(target: &Path) -> bool {
    crust_blockdev::find_mount(target)
        .ok()
        .flatten()
        .is_some_and(|m| m.fs_type == "tmpfs" && m.source == SOURCE)
}

/// Mounts the placeholder on the existing directory `target` (nothing
/// else mounted there) with a README naming `volume` and saying `where_`.
/// Idempotent.
pub fn mount(target: &Path, volume: &str, where_: &str) -> Result<(), PlaceholderError> {
    if is_mounted(target) {
        return Ok(());
    }
    let flags = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    rustix::mount::mount(
        SOURCE,
        target,
        "tmpfs",
        flags,
        Some(c"size=16k,nr_inodes=16,mode=0555"),
    )
    .map_err(|e| err(target, "mount tmpfs")(e.into()))?;
    let text = format!(
        "This directory is a placeholder, not volume {volume}.\n\n{where_}\n\n\
         Nothing can be written here: a container that is not in that VM sees \
         this read-only directory instead of the volume, so its data never \
         lands on the node's disk. Run the pod with a VM RuntimeClass (crust), \
         or give the volume a StorageClass with deferFsOps=auto or false.\n"
    );
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o444)
            .open(target.join(README))?;
        f.write_all(text.as_bytes())
    };
    let res = write().map_err(err(target, "write README")).and_then(|()| {
        rustix::mount::mount_remount(target, flags | MountFlags::RDONLY, c"")
            .map_err(|e| err(target, "remount read-only")(e.into()))
    });
    if let Err(e) = res {
        let _ = rustix::mount::unmount(target, UnmountFlags::DETACH);
        return Err(e);
    }
    Ok(())
}

/// Unmounts the placeholder at `target` if there is one (never anything
/// else). Returns whether one was there.
pub fn remove(target: &Path) -> Result<bool, PlaceholderError> {
    if !is_mounted(target) {
        return Ok(false);
    }
    rustix::mount::unmount(target, UnmountFlags::NOFOLLOW)
        .map_err(|e| err(target, "unmount")(e.into()))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_only_readme_and_removal() {
        assert!(
            rustix::process::geteuid().is_root(),
            "this test needs root (mounts)"
        );
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("target");
        std::fs::create_dir(&t).unwrap();
        assert!(!remove(&t).unwrap(), "nothing there");
        mount(&t, "vol-x", "It is inside sandbox sb1.").unwrap();
        mount(&t, "vol-x", "again").unwrap();
        assert!(is_mounted(&t));
        let readme = std::fs::read_to_string(t.join(README)).unwrap();
        assert!(
            readme.contains("vol-x") && readme.contains("sandbox sb1"),
            "{readme}"
        );
        let e = std::fs::write(t.join("data"), b"x").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
        assert!(remove(&t).unwrap());
        assert!(!is_mounted(&t));
        assert_eq!(std::fs::read_dir(&t).unwrap().count(), 0, "nothing landed");
        // Something else mounted there is never removed.
        rustix::mount::mount("other", &t, "tmpfs", MountFlags::empty(), None).unwrap();
        assert!(!remove(&t).unwrap());
        rustix::mount::unmount(&t, UnmountFlags::empty()).unwrap();
    }
}
