//! Host operations inside a tree a guest can write to (the pod's virtio-fs
//! share): every directory, file and mount point is reached by descriptor
//! from the tree's root, with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS
//! | RESOLVE_NO_MAGICLINKS)`, and every mount goes through the fd-based
//! mount API onto such a descriptor. A symlink, a `..` or a magic link that
//! the guest planted fails the step; nothing is ever resolved by path
//! string below the root.
//!
//! Used by [`crate::share`], which both front doors (the containerd shim
//! and the `crust-runtime` CLI) go through.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use rustix::mount::{
    FsMountFlags, FsOpenFlags, MountAttrFlags, MountFlags, MoveMountFlags, OpenTreeFlags,
    UnmountFlags,
};

/// How every path below a root is resolved.
const RESOLVE: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

/// Why a step below a root was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum BeneathError {
    #[error("{path:?} is not a plain relative path (empty, absolute, '.' or '..' component)")]
    BadPath { path: String },
    /// Something is already where crust is about to create a directory,
    /// file or mount point: only a guest writing into the share puts it
    /// there before crust does.
    #[error(
        "{path} already exists in the share before crust created it (refused: planted by the guest?)"
    )]
    Planted { path: String },
    /// A symlink, magic link or a path leaving the root on the way.
    #[error("{path} crosses a symlink or leaves the share (refused)")]
    Escape { path: String },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl BeneathError {
    fn io(what: &'static str, path: &str, e: Errno) -> BeneathError {
        match e {
            Errno::LOOP | Errno::XDEV => BeneathError::Escape { path: path.into() },
            e => BeneathError::Io {
                what,
                path: path.into(),
                source: e.into(),
            },
        }
    }
}

/// The components of a plain relative path (`a/b/c`), or `BadPath`.
fn components(rel: &str) -> Result<Vec<&str>, BeneathError> {
    let parts: Vec<&str> = rel.split('/').collect();
    if rel.is_empty()
        || parts
            .iter()
            .any(|c| c.is_empty() || *c == "." || *c == "..")
    {
        return Err(BeneathError::BadPath { path: rel.into() });
    }
    Ok(parts)
}

/// Opens a root directory the host owns (its path is not guest-writable).
pub fn open_root(dir: &Path) -> Result<OwnedFd, BeneathError> {
    rustix::fs::open(
        dir,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| BeneathError::io("opening", &dir.display().to_string(), e))
}

/// Opens `rel` below `root` without following anything the guest made
/// (a symlink as the last component too: no `O_NOFOLLOW`, which would
/// open the link itself, so `RESOLVE_NO_SYMLINKS` refuses it).
pub fn open(root: BorrowedFd<'_>, rel: &str, flags: OFlags) -> Result<OwnedFd, BeneathError> {
    components(rel)?;
    crust_openat2::openat2(root, rel, flags, Mode::empty(), RESOLVE)
        .map_err(|e| BeneathError::io("opening", rel, e))
}

/// The parent directory of `rel` (opened beneath `root`) and its last name.
fn parent<'a>(root: BorrowedFd<'_>, rel: &'a str) -> Result<(OwnedFd, &'a str), BeneathError> {
    let parts = components(rel)?;
    let (name, dirs) = parts.split_last().expect("components is never empty");
    let dir = if dirs.is_empty() {
        rustix::io::fcntl_dupfd_cloexec(root, 0).map_err(|e| BeneathError::io("dup", rel, e))?
    } else {
        open(
            root,
            &rel[..rel.len() - name.len() - 1],
            OFlags::PATH | OFlags::DIRECTORY,
        )?
    };
    Ok((dir, name))
}

/// Creates directory `rel` below `root` (its parent must exist) and opens
/// it. An existing entry of any kind is refused as [`BeneathError::Planted`].
pub fn create_dir(root: BorrowedFd<'_>, rel: &str, mode: u32) -> Result<OwnedFd, BeneathError> {
    let (dir, name) = parent(root, rel)?;
    match rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(mode)) {
        Ok(()) => {}
        Err(Errno::EXIST) => return Err(BeneathError::Planted { path: rel.into() }),
        Err(e) => return Err(BeneathError::io("creating directory", rel, e)),
    }
    open(dir.as_fd(), name, OFlags::PATH | OFlags::DIRECTORY).map_err(|e| rename_path(e, rel))
}

/// Creates an empty regular file `rel` below `root` (a file bind's mount
/// point) and opens it; an existing entry is refused as `Planted`.
pub fn create_file(root: BorrowedFd<'_>, rel: &str) -> Result<OwnedFd, BeneathError> {
    let (dir, name) = parent(root, rel)?;
    crust_openat2::openat2(
        &dir,
        name,
        OFlags::CREATE | OFlags::EXCL | OFlags::RDONLY | OFlags::NOFOLLOW,
        Mode::from_raw_mode(0o600),
        RESOLVE,
    )
    .map_err(|e| match e {
        Errno::EXIST => BeneathError::Planted { path: rel.into() },
        e => BeneathError::io("creating file", rel, e),
    })
}

fn rename_path(e: BeneathError, rel: &str) -> BeneathError {
    match e {
        BeneathError::Escape { .. } => BeneathError::Escape { path: rel.into() },
        BeneathError::Io { what, source, .. } => BeneathError::Io {
            what,
            path: rel.into(),
            source,
        },
        e => e,
    }
}

/// Attributes every host-side mount in a share gets: the host never needs
/// a device node or a setuid binary that a guest wrote there.
const HOST_SIDE: MountAttrFlags =
    MountAttrFlags::MOUNT_ATTR_NOSUID.union(MountAttrFlags::MOUNT_ATTR_NODEV);

/// How a bind is read-only, as runc has it: OCI `ro` makes the named
/// mount read-only and leaves mounts below it as they are (a tmpfs inside
/// a read-only volume stays writable); `rro` (CRI's recursive read-only)
/// makes every mount of the tree read-only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadOnly {
    #[default]
    No,
    Top,
    Recursive,
}

impl ReadOnly {
    /// From OCI mount options: `rro` wins over `ro`.
    pub fn from_options<S: AsRef<str>>(options: &[S]) -> ReadOnly {
        let has = |o: &str| options.iter().any(|x| x.as_ref() == o);
        if has("rro") {
            ReadOnly::Recursive
        } else if has("ro") {
            ReadOnly::Top
        } else {
            ReadOnly::No
        }
    }
}

impl From<bool> for ReadOnly {
    fn from(readonly: bool) -> ReadOnly {
        if readonly {
            ReadOnly::Top
        } else {
            ReadOnly::No
        }
    }
}

/// Which mounts made later below a bind's host source reach the guest
/// (OCI `rprivate`, `rslave`; the kernel's MS_* propagation types).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Propagation {
    /// None (CRI's default): the tree is what it was when bound.
    #[default]
    Private,
    /// HostToContainer: mounts made below the source on the host after the
    /// bind appear in the share (and in the guest, as virtio-fs
    /// submounts); none flows back.
    Slave,
}

/// Binds host `source` (recursively) onto the mount point `target`. The
/// tree is cloned detached, given its propagation and read-only as asked
/// (before it is attached, so every propagated copy is the same), then
/// moved onto the descriptor.
pub fn bind(
    source: &Path,
    target: BorrowedFd<'_>,
    readonly: ReadOnly,
    propagation: Propagation,
) -> Result<(), BeneathError> {
    let shown = source.display().to_string();
    let tree = rustix::mount::open_tree(
        rustix::fs::CWD,
        source,
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_RECURSIVE,
    )
    .map_err(|e| BeneathError::io("cloning the mount tree of", &shown, e))?;
    let mut attrs = HOST_SIDE;
    if readonly == ReadOnly::Recursive {
        attrs |= MountAttrFlags::MOUNT_ATTR_RDONLY;
    }
    // A clone of a shared mount joins its peer group: without this, mounts
    // would flow between the host source and the share both ways.
    let propagation = match propagation {
        Propagation::Private => libc::MS_PRIVATE,
        Propagation::Slave => libc::MS_SLAVE,
    };
    set_attrs(tree.as_fd(), attrs, propagation, true)
        .map_err(|e| BeneathError::io("setting mount attributes on", &shown, e))?;
    if readonly == ReadOnly::Top {
        set_attrs(tree.as_fd(), MountAttrFlags::MOUNT_ATTR_RDONLY, 0, false)
            .map_err(|e| BeneathError::io("making read-only", &shown, e))?;
    }
    attach(tree.as_fd(), target, &shown)
}

/// A filesystem to mount (the snapshotter's rootfs, usually overlay).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsSpec {
    pub fstype: String,
    pub source: String,
    /// Filesystem options (`key=value` or `flag`), as mount(8) takes them.
    pub data: Vec<String>,
    pub attrs: MountAttrFlags,
}

impl FsSpec {
    /// Splits mount(8) options into per-mount attributes and fs options.
    pub fn new(fstype: &str, source: &str, options: &[String]) -> FsSpec {
        let mut attrs = MountAttrFlags::empty();
        let mut data = Vec::new();
        for o in options {
            match o.as_str() {
                "ro" => attrs |= MountAttrFlags::MOUNT_ATTR_RDONLY,
                "nosuid" => attrs |= MountAttrFlags::MOUNT_ATTR_NOSUID,
                "nodev" => attrs |= MountAttrFlags::MOUNT_ATTR_NODEV,
                "noexec" => attrs |= MountAttrFlags::MOUNT_ATTR_NOEXEC,
                "rw" | "" => {}
                other => data.push(other.to_string()),
            }
        }
        FsSpec {
            fstype: fstype.into(),
            source: source.into(),
            data,
            attrs,
        }
    }
}

/// Mounts a new filesystem onto the mount point `target` with
/// fsopen/fsconfig/fsmount and `move_mount` onto the descriptor.
pub fn mount_fs(fs: &FsSpec, target: BorrowedFd<'_>) -> Result<(), BeneathError> {
    let what = format!("{} filesystem", fs.fstype);
    let fail = |step: &'static str| {
        let what = what.clone();
        move |e: Errno| BeneathError::io(step, &what, e)
    };
    let ctx = rustix::mount::fsopen(fs.fstype.as_str(), FsOpenFlags::FSOPEN_CLOEXEC)
        .map_err(fail("opening"))?;
    if !fs.source.is_empty() {
        rustix::mount::fsconfig_set_string(&ctx, "source", fs.source.as_str())
            .map_err(fail("setting the source of"))?;
    }
    for o in &fs.data {
        match o.split_once('=') {
            // fsconfig takes at most 256 bytes per value: overlay layers go
            // one by one (`lowerdir+`, Linux 6.5+) when the list is longer;
            // an older kernel gets the whole list through mount(2).
            Some(("lowerdir", v)) if fs.fstype == "overlay" && v.len() > 255 => {
                for layer in v.split(':') {
                    match rustix::mount::fsconfig_set_string(&ctx, "lowerdir+", layer) {
                        Ok(()) => {}
                        Err(Errno::INVAL) => return mount_fs_legacy(fs, target),
                        Err(e) => return Err(fail("adding an overlay layer to")(e)),
                    }
                }
            }
            Some((k, v)) => rustix::mount::fsconfig_set_string(&ctx, k, v)
                .map_err(fail("setting an option of"))?,
            None => rustix::mount::fsconfig_set_flag(&ctx, o.as_str())
                .map_err(fail("setting a flag of"))?,
        }
    }
    rustix::mount::fsconfig_create(&ctx).map_err(fail("creating"))?;
    let mnt = rustix::mount::fsmount(&ctx, FsMountFlags::FSMOUNT_CLOEXEC, fs.attrs | HOST_SIDE)
        .map_err(fail("mounting"))?;
    attach(mnt.as_fd(), target, &what)
}

/// [`mount_fs`] through mount(2), for kernels whose overlay lacks
/// `lowerdir+`: the mount point is still the descriptor (its
/// `/proc/self/fd` link names the very dentry, never a path in the tree).
pub fn mount_fs_legacy(fs: &FsSpec, target: BorrowedFd<'_>) -> Result<(), BeneathError> {
    let what = format!("{} filesystem", fs.fstype);
    let attrs = fs.attrs | HOST_SIDE;
    let mut flags = MountFlags::empty();
    for (a, f) in [
        (MountAttrFlags::MOUNT_ATTR_RDONLY, MountFlags::RDONLY),
        (MountAttrFlags::MOUNT_ATTR_NOSUID, MountFlags::NOSUID),
        (MountAttrFlags::MOUNT_ATTR_NODEV, MountFlags::NODEV),
        (MountAttrFlags::MOUNT_ATTR_NOEXEC, MountFlags::NOEXEC),
    ] {
        if attrs.contains(a) {
            flags |= f;
        }
    }
    let data = std::ffi::CString::new(fs.data.join(","))
        .map_err(|_| BeneathError::io("encoding the options of", &what, Errno::INVAL))?;
    let at = format!("/proc/self/fd/{}", target.as_raw_fd());
    let source = if fs.source.is_empty() {
        "none"
    } else {
        fs.source.as_str()
    };
    rustix::mount::mount(
        source,
        at.as_str(),
        fs.fstype.as_str(),
        flags,
        data.as_c_str(),
    )
    .map_err(|e| BeneathError::io("mounting (mount(2))", &what, e))
}

fn attach(tree: BorrowedFd<'_>, target: BorrowedFd<'_>, what: &str) -> Result<(), BeneathError> {
    rustix::mount::move_mount(
        tree,
        "",
        target,
        "",
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
    )
    .map_err(|e| BeneathError::io("attaching", what, e))
}

/// mount_setattr(2) on a (detached) tree, `recursive` or its top mount
/// only.
fn set_attrs(
    tree: BorrowedFd<'_>,
    attrs: MountAttrFlags,
    propagation: u64,
    recursive: bool,
) -> Result<(), Errno> {
    let attr = crust_sys::mount::MountAttr {
        set: u64::from(attrs.bits()),
        propagation,
        ..Default::default()
    };
    crust_sys::mount::setattr(tree, recursive, &attr)
}

/// Detaches the topmost mount at `rel` below `root`, reached by descriptor
/// (umount2 of `/proc/self/fd/N` acts on the descriptor's own mount). A
/// path that crosses a symlink, or no mount root there, is left alone.
pub fn unmount(root: BorrowedFd<'_>, rel: &str) -> Result<(), BeneathError> {
    let fd = open(root, rel, OFlags::PATH)?;
    let proc_path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    rustix::mount::unmount(proc_path.as_str(), UnmountFlags::DETACH)
        .map_err(|e| BeneathError::io("unmounting", rel, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_relative_paths_only() {
        for bad in ["", "/a", "a/../b", "a//b", "./a", "a/", ".."] {
            assert!(
                matches!(components(bad), Err(BeneathError::BadPath { .. })),
                "{bad:?}"
            );
        }
        assert_eq!(components("c1/rootfs").unwrap(), vec!["c1", "rootfs"]);
    }

    #[test]
    fn options_split_into_attributes_and_data() {
        let fs = FsSpec::new(
            "overlay",
            "overlay",
            &[
                "ro".into(),
                "nodev".into(),
                "lowerdir=/a:/b".into(),
                "index=off".into(),
            ],
        );
        assert_eq!(
            fs.attrs,
            MountAttrFlags::MOUNT_ATTR_RDONLY | MountAttrFlags::MOUNT_ATTR_NODEV
        );
        assert_eq!(fs.data, vec!["lowerdir=/a:/b", "index=off"]);
    }

    /// An image with many layers: a lowerdir list over fsconfig's 256
    /// bytes mounts through `lowerdir+` and through the mount(2) fallback
    /// that kernels before 6.5 get.
    #[test]
    fn long_overlay_layer_lists_mount_both_ways() {
        assert!(
            rustix::process::geteuid().is_root(),
            "this test needs root (mounts)"
        );
        let dir = tempfile::tempdir().unwrap();
        let layers: Vec<String> = (0..12)
            .map(|i| {
                let l = dir.path().join(format!("layer-{i:02}-{}", "x".repeat(24)));
                std::fs::create_dir(&l).unwrap();
                std::fs::write(l.join(format!("f{i}")), i.to_string()).unwrap();
                l.display().to_string()
            })
            .collect();
        let lower = format!("lowerdir={}", layers.join(":"));
        assert!(lower.len() > 256, "{}", lower.len());
        let fs = FsSpec::new("overlay", "overlay", &["ro".into(), lower]);
        for legacy in [false, true] {
            let at = dir.path().join(format!("rootfs-{legacy}"));
            std::fs::create_dir(&at).unwrap();
            let fd =
                rustix::fs::open(&at, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
            if legacy {
                mount_fs_legacy(&fs, fd.as_fd()).unwrap();
            } else {
                mount_fs(&fs, fd.as_fd()).unwrap();
            }
            let seen = (std::fs::read(at.join("f0")), std::fs::read(at.join("f11")));
            let ro = std::fs::write(at.join("new"), b"x").is_err();
            rustix::mount::unmount(&at, UnmountFlags::empty()).unwrap();
            assert_eq!(
                (seen.0.unwrap(), seen.1.unwrap()),
                (b"0".to_vec(), b"11".to_vec())
            );
            assert!(ro, "legacy={legacy}: read-only");
        }
    }
}
