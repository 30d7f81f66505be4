//! kubelet's subPath binds of a publication: before it asks the runtime
//! for a container with a subPath, kubelet bind-mounts `<target>/<sub>`
//! at `<pod>/volume-subpaths/<volume>/<container>/<index>` (see
//! `crust_handoff::kubelet`). They are host mounts of the volume's
//! device, so a handover takes them with the target (the guest must be
//! the only one with the filesystem) and a rollback puts them back.
//!
//! Once the placeholder holds the target, each bind shows the same path
//! of the placeholder instead: the host then looks exactly as for a volume
//! deferred from the start, where kubelet made `<sub>` in the placeholder
//! and bound it. The runtime maps either kind of bind to the volume and
//! its subPath (the bind's root in the mount table), kubelet finds its
//! bind still in place when the container restarts, and unmounts it when
//! it cleans the pod's subPaths.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::records::SubpathBind;
use crust_handoff::kubelet::{self, VOLUME_SUBPATHS};
use rustix::fs::{Mode, OFlags, ResolveFlags};

#[derive(Debug, thiserror::Error)]
pub enum SubpathBindError {
    #[error("reading the mount table: {0}")]
    MountTable(#[from] crust_blockdev::MountError),
    #[error("device {device}: {source}")]
    Device {
        device: PathBuf,
        #[source]
        source: crust_blockdev::DeviceError,
    },
    #[error("subPath {root} of the volume (kubelet's bind at {mount_point}): {source}")]
    Resolve {
        root: PathBuf,
        mount_point: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `<pod>/volume-subpaths` of the pod whose volume is published at
/// `target`; None for a target outside kubelet's layout.
fn subpaths_dir(target: &Path) -> Option<PathBuf> {
    let p = kubelet::pod_path(target.to_str()?, None)?;
    (p.layer == kubelet::VOLUMES).then(|| Path::new(&p.pod_dir()).join(VOLUME_SUBPATHS))
}

/// The binds of `device`'s filesystem under the subPath directory of
/// `target`'s pod, in mount order.
pub fn of(target: &Path, device: &Path) -> Result<Vec<SubpathBind>, SubpathBindError> {
    let Some(dir) = subpaths_dir(target) else {
        return Ok(Vec::new());
    };
    let (major, minor) =
        crust_blockdev::device_major_minor(device).map_err(|source| SubpathBindError::Device {
            device: device.to_path_buf(),
            source,
        })?;
    Ok(crust_blockdev::mount_info()?
        .into_iter()
        .filter(|m| (m.major, m.minor) == (major, minor) && m.mount_point.starts_with(&dir))
        .map(|m| SubpathBind {
            readonly: m.is_read_only(),
            root: m.root.strip_prefix("/").unwrap_or(&m.root).to_path_buf(),
            mount_point: m.mount_point,
        })
        .collect())
}

/// Puts `b` back from the filesystem mounted at `fs_root`. The subPath is
/// reached by descriptor beneath the root, following no symlink (the
/// workload may have changed the tree since kubelet resolved it).
pub fn restore(fs_root: &Path, b: &SubpathBind) -> Result<(), SubpathBindError> {
    let resolve = |source: std::io::Error| SubpathBindError::Resolve {
        root: b.root.clone(),
        mount_point: b.mount_point.clone(),
        source,
    };
    let root = rustix::fs::open(
        fs_root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| resolve(e.into()))?;
    let rel = if b.root.as_os_str().is_empty() {
        Path::new(".")
    } else {
        b.root.as_path()
    };
    let fd = crust_openat2::openat2(
        &root,
        rel,
        OFlags::PATH | OFlags::NOFOLLOW,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| resolve(e.into()))?;
    let via = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    crust_blockdev::bind_mount(&via, &b.mount_point, b.readonly)?;
    Ok(())
}

/// Shows `b.root` of the placeholder mounted at `target` at kubelet's
/// mount point instead of the volume. The path is made in the
/// placeholder (directories, or an empty file for a file bind) by
/// descriptor. Idempotent.
pub fn bind_placeholder(target: &Path, b: &SubpathBind) -> Result<(), SubpathBindError> {
    let fail = |source: std::io::Error| SubpathBindError::Resolve {
        root: b.root.clone(),
        mount_point: b.mount_point.clone(),
        source,
    };
    let top = crust_blockdev::find_mount(target)?;
    let shown = crust_blockdev::find_mount(&b.mount_point)?;
    if let (Some(t), Some(m)) = (&top, &shown)
        && (t.major, t.minor) == (m.major, m.minor)
    {
        return Ok(());
    }
    let is_file = std::fs::symlink_metadata(&b.mount_point)
        .map_err(fail)?
        .is_file();
    let mut dir = rustix::fs::open(
        target,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| fail(e.into()))?;
    let parts: Vec<_> = b.root.components().collect();
    let beneath = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    for (i, c) in parts.iter().enumerate() {
        let std::path::Component::Normal(name) = c else {
            return Err(fail(std::io::Error::other("not a plain relative path")));
        };
        let last = i + 1 == parts.len();
        if last && is_file {
            match crust_openat2::openat2(
                &dir,
                *name,
                OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY,
                Mode::from_raw_mode(0o444),
                beneath,
            ) {
                Ok(_) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(fail(e.into())),
            }
        } else {
            match rustix::fs::mkdirat(&dir, *name, Mode::from_raw_mode(0o555)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(fail(e.into())),
            }
        }
        let flags = if last && is_file {
            OFlags::PATH
        } else {
            OFlags::PATH | OFlags::DIRECTORY
        };
        dir = crust_openat2::openat2(&dir, *name, flags, Mode::empty(), beneath)
            .map_err(|e| fail(e.into()))?;
    }
    let via = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    crust_blockdev::bind_mount(&via, &b.mount_point, b.readonly)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_kubelet_targets_have_a_subpaths_dir() {
        assert_eq!(
            subpaths_dir(Path::new(
                "/k0s/kubelet/pods/u1/volumes/kubernetes.io~csi/pv/mount"
            )),
            Some(PathBuf::from("/k0s/kubelet/pods/u1/volume-subpaths"))
        );
        assert_eq!(subpaths_dir(Path::new("/srv/target")), None);
        assert_eq!(
            subpaths_dir(Path::new("/k/pods/u1/volume-subpaths/v/c/0")),
            None
        );
    }
}
