//! What a publish target shows on the host while the volume's filesystem
//! is inside a VM (a `deferFsOps=true` publication, or a handover): a
//! tmpfs holding one `README` that says where the volume went, and room
//! for directories but for no byte of data.
//!
//! An empty writable directory there would be dangerous: a pod whose
//! runtime is not a VM runtime (runc) gets the target bound into its
//! container and would write onto the node's root disk, silently. Yet
//! kubelet must be able to make a container's subPath directories there
//! (it `mkdirat`s `<target>/<sub>` and bind-mounts it before it asks the
//! runtime for the container; the guest makes the same directories
//! inside the volume). So the tmpfs is exactly one page big and the
//! README fills that page and is immutable: `mkdir` works (a tmpfs
//! directory takes no pages), every write of data fails with `ENOSPC`,
//! and `cat README` explains why. Few inodes, `nosuid,nodev,noexec`,
//! recognised by its source name, so unpublish removes exactly this and
//! nothing else.

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
    let page = rustix::param::page_size();
    let data = std::ffi::CString::new(format!("size={page},nr_inodes={MAX_INODES},mode=0555"))
        .expect("no NUL");
    rustix::mount::mount(SOURCE, target, "tmpfs", flags, data.as_c_str())
        .map_err(|e| err(target, "mount tmpfs")(e.into()))?;
    let res = write_readme(target, &readme_text(volume, where_, page));
    if let Err(e) = res {
        let _ = rustix::mount::unmount(target, UnmountFlags::DETACH);
        return Err(e);
    }
    Ok(())
}

/// Room for kubelet's subPath directories of a pod's containers.
const MAX_INODES: u32 = 1024;

/// The README, padded to exactly one `page` (the tmpfs's size) so that
/// the tmpfs is full.
fn readme_text(volume: &str, where_: &str, page: usize) -> Vec<u8> {
    let text = format!(
        "This directory is a placeholder, not volume {volume}.\n\n{where_}\n\n\\
         No data can be stored here (every write fails: no space left on device), so \\
         a container that is not in that VM, seeing this directory instead of the \\
         volume, never leaves data on the node's disk. Directories can be made: kubelet \\
         makes a container's subPath here before it starts the container, and the VM \\
         makes the same directories inside the volume. Run the pod with a VM \\
         RuntimeClass (crust), or give the volume a StorageClass with deferFsOps=auto \\
         or false.\n"
    );
    let mut bytes = text.into_bytes();
    bytes.truncate(page - 1);
    bytes.resize(page - 1, b' ');
    bytes.push(b'\n');
    bytes
}

/// Writes the README and makes it immutable (not even root rewrites it:
/// its page is the tmpfs's only one).
fn write_readme(target: &Path, text: &[u8]) -> Result<(), PlaceholderError> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o444)
        .open(target.join(README))
        .map_err(err(target, "write README"))?;
    f.write_all(text).map_err(err(target, "write README"))?;
    match rustix::fs::ioctl_setflags(&f, rustix::fs::IFlags::IMMUTABLE) {
        Ok(()) => Ok(()),
        // tmpfs takes the flag since Linux 6.0; before, root could rewrite
        // the README's one page, still no more.
        Err(e @ (rustix::io::Errno::NOTTY | rustix::io::Errno::OPNOTSUPP)) => {
            tracing::warn!(target = %target.display(), "placeholder README not immutable: {e}");
            Ok(())
        }
        Err(e) => Err(err(target, "make README immutable")(e.into())),
    }
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
        // No byte of data lands, not even in the README; kubelet's
        // subPath directories can be made.
        let e = std::fs::write(t.join("data"), b"x").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
        assert_eq!(std::fs::metadata(t.join("data")).unwrap().len(), 0);
        let e = std::fs::OpenOptions::new()
            .append(true)
            .open(t.join(README))
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        assert!(std::fs::remove_file(t.join(README)).is_err());
        std::fs::create_dir_all(t.join("sub/deeper")).unwrap();
        assert!(remove(&t).unwrap());
        assert!(!is_mounted(&t));
        assert_eq!(std::fs::read_dir(&t).unwrap().count(), 0, "nothing landed");
        // Something else mounted there is never removed.
        rustix::mount::mount("other", &t, "tmpfs", MountFlags::empty(), None).unwrap();
        assert!(!remove(&t).unwrap());
        rustix::mount::unmount(&t, UnmountFlags::empty()).unwrap();
    }
}
