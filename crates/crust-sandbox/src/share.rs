//! The sandbox's virtio-fs share on the host: one directory per sandbox
//! (`<root>/<id>/share`) served by virtiofsd, holding bind mounts of the
//! host paths the guest may see. Used by both front doors: the containerd
//! shim (container rootfs and binds) and the `crust-runtime` CLI with
//! `--share-binds` (bundle binds without a hand-off record).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};

use crate::beneath::{self, BeneathError, FsSpec};
pub use crate::beneath::{Propagation, ReadOnly};
use crate::records::SharedMount;

/// The virtio-fs tag of a sandbox's share.
pub const SHARE_TAG: &str = "crust-pod";
/// The share's directory name inside the sandbox directory.
pub const SHARE_DIR: &str = "share";

/// Why the share, or something in it, could not be made or removed.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// A step below the share refused (planted entry, symlink) or failed.
    #[error(transparent)]
    Beneath(#[from] BeneathError),
    #[error("bind mount source {path}: {source}")]
    Source {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Host {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("removing {dir}: still mounted below it: {left}")]
    StillMounted { dir: String, left: String },
}

fn err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ShareError {
    let what = what.into();
    move |source| ShareError::Host { what, source }
}

/// What virtiofsd serves for share `dir`: `<dir>.guest`, a read-only bind
/// of `dir` in the same peer group, so the guest can create nothing at the
/// share's root or in a container's directory, and sees each rootfs or
/// bind mounted below `dir` with that mount's own (rw or ro) attributes.
pub fn guest_view(dir: &Path) -> PathBuf {
    let mut s = dir.as_os_str().to_owned();
    s.push(".guest");
    PathBuf::from(s)
}

/// Creates `dir` as a mount point of its own with shared propagation, so
/// binds made below it after virtiofsd started (in its own mount
/// namespace) still reach virtiofsd, and its read-only guest view
/// ([`guest_view`]), which is what virtiofsd serves: returned.
pub fn make(dir: &Path) -> Result<PathBuf, ShareError> {
    std::fs::create_dir_all(dir).map_err(err("creating the share"))?;
    rustix::mount::mount_bind(dir, dir).map_err(|e| err("binding the share")(e.into()))?;
    rustix::mount::mount_change(dir, MountPropagationFlags::SHARED)
        .map_err(|e| err("making the share shared")(e.into()))?;
    let view = guest_view(dir);
    std::fs::create_dir_all(&view).map_err(err("creating the share's guest view"))?;
    // A bind of a shared mount joins its peer group: later mounts below
    // `dir` show up in the view too.
    rustix::mount::mount_bind(dir, &view)
        .map_err(|e| err("binding the share's guest view")(e.into()))?;
    rustix::mount::mount_remount(
        &view,
        MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
        "",
    )
    .map_err(|e| err("making the share's guest view read-only")(e.into()))?;
    Ok(view)
}

/// The share's root, for the calls below.
pub fn open(dir: &Path) -> Result<OwnedFd, ShareError> {
    Ok(beneath::open_root(dir)?)
}

/// Creates a fresh directory `rel` in the share (a container's own): one
/// that already exists is refused ([`BeneathError::Planted`]).
pub fn create_dir(root: BorrowedFd<'_>, rel: &str) -> Result<OwnedFd, ShareError> {
    Ok(beneath::create_dir(root, rel, 0o755)?)
}

/// Binds host `source` (file or directory, recursively) at `rel` in the
/// share, creating the mount point (refused if anything is there already),
/// read-only and with the propagation asked (see [`beneath::bind`]).
/// Returns the mounts below `source` that came with it, relative to it:
/// the guest has to reach each before it binds the directory into a
/// container, or a read-only bind would make them read-only too (a
/// virtio-fs submount mounted on first use takes its parent's flags).
pub fn bind_into(
    root: BorrowedFd<'_>,
    rel: &str,
    source: &Path,
    readonly: ReadOnly,
    propagation: Propagation,
) -> Result<Vec<String>, ShareError> {
    let meta = std::fs::metadata(source).map_err(|e| ShareError::Source {
        path: source.display().to_string(),
        source: e,
    })?;
    let target = if meta.is_dir() {
        beneath::create_dir(root, rel, 0o755)?
    } else {
        beneath::create_file(root, rel)?
    };
    beneath::bind(source, target.as_fd(), readonly, propagation)?;
    if !meta.is_dir() {
        return Ok(Vec::new());
    }
    let mut below: Vec<String> = mounts_below(source)
        .iter()
        .filter_map(|m| m.strip_prefix(source).ok()?.to_str().map(String::from))
        .filter(|r| !r.is_empty())
        .collect();
    below.sort();
    below.dedup();
    Ok(below)
}

/// Mounts a filesystem (a container's rootfs) at a new directory `rel`.
pub fn mount_into(root: BorrowedFd<'_>, rel: &str, fs: &FsSpec) -> Result<(), ShareError> {
    let target = beneath::create_dir(root, rel, 0o755)?;
    beneath::mount_fs(fs, target.as_fd())?;
    Ok(())
}

/// Mount points strictly below `dir` in this mount namespace (an
/// unreadable mount table reads as none, as it always did here).
pub fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    crust_blockdev::mount_points_below(dir).unwrap_or_default()
}

/// Detaches every mount strictly below `dir`, deepest first, each reached
/// by descriptor from `dir` (a mount point behind a symlink stays).
pub fn unmount_tree(dir: &Path) {
    let Ok(root) = beneath::open_root(dir) else {
        return;
    };
    unmount_below(dir, root.as_fd(), dir);
}

/// Detaches the mounts below `under` (inside `dir`, opened as `root`).
fn unmount_below(dir: &Path, root: BorrowedFd<'_>, under: &Path) {
    for _ in 0..3 {
        let points = mounts_below(under);
        if points.is_empty() {
            return;
        }
        for p in points.iter().rev() {
            if let Some(rel) = p.strip_prefix(dir).ok().and_then(Path::to_str) {
                let _ = beneath::unmount(root, rel);
            }
        }
    }
}

/// Undoes one container's part of the share (`<dir>/<cid>`): its mounts
/// are detached by descriptor, then the directory is removed, never
/// through a mount (if one is left, the directory stays and the error
/// says what). Missing: Ok.
pub fn remove_container(dir: &Path, cid: &str) -> Result<(), ShareError> {
    let root = open(dir)?;
    let cdir = dir.join(cid);
    if std::fs::symlink_metadata(&cdir).is_err() {
        return Ok(());
    }
    unmount_below(dir, root.as_fd(), &cdir);
    still_mounted(&cdir)?;
    // std's remove_dir_all never follows a symlink (nor a planted
    // `<cid>` that is one).
    match std::fs::remove_dir_all(&cdir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(err(format!("removing {}", cdir.display()))(e)),
    }
}

fn still_mounted(dir: &Path) -> Result<(), ShareError> {
    let left = mounts_below(dir);
    if left.is_empty() {
        return Ok(());
    }
    Err(ShareError::StillMounted {
        dir: dir.display().to_string(),
        left: left
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// The share at `dir` with `binds` in place (each at its `path`, read-only
/// ones read-only on the host side too), the one way both doors make a
/// sandbox's share; returns the guest view virtiofsd serves. On failure
/// nothing is left.
pub fn make_with_binds(dir: &Path, binds: &[SharedMount]) -> Result<PathBuf, ShareError> {
    let res = make(dir).and_then(|view| {
        let root = open(dir)?;
        for m in binds {
            bind_into(
                root.as_fd(),
                &m.path,
                Path::new(&m.source),
                m.readonly.into(),
                Propagation::Private,
            )?;
        }
        Ok(view)
    });
    res.inspect_err(|_| remove_logged(dir))
}

/// [`remove`], logging what it could not undo (a teardown goes on).
pub fn remove_logged(dir: &Path) {
    if let Err(e) = remove(dir) {
        tracing::error!("{e}");
    }
}

/// Unmounts everything in and below a share (and its guest view) and
/// removes their directories. Never deletes through a mount: if anything
/// is still mounted below, the directory stays and the error says what.
pub fn remove(dir: &Path) -> Result<(), ShareError> {
    let view = guest_view(dir);
    for d in [&view, dir] {
        unmount_tree(d);
        // The bind itself (EINVAL once `d` is no mount point).
        for _ in 0..4 {
            if rustix::mount::unmount(d, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW).is_err() {
                break;
            }
        }
    }
    for d in [&view, dir] {
        still_mounted(d)?;
        match std::fs::remove_dir_all(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(format!("removing {}", d.display()))(e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A temp dir whose mounts go with it, whatever a test left.
    struct Scratch(tempfile::TempDir);

    impl Scratch {
        fn new() -> Option<Scratch> {
            if !rustix::process::geteuid().is_root() {
                eprintln!("skipped: needs root");
                return None;
            }
            Some(Scratch(tempfile::tempdir().unwrap()))
        }
        fn path(&self) -> &Path {
            self.0.path()
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            crust_testkit::unmount_below(self.0.path());
            let _ = rustix::mount::unmount(self.0.path(), UnmountFlags::DETACH);
        }
    }

    /// Mount points in this namespace (for "nothing mounted outside").
    /// A share with a bind of a directory holding data: removing the share
    /// unmounts the bind and leaves the source's data alone.
    #[test]
    fn remove_never_deletes_through_a_bind() {
        let Some(t) = Scratch::new() else { return };
        let src = t.path().join("src");
        std::fs::create_dir(&src).unwrap();
        std::fs::write(src.join("keep"), b"data").unwrap();
        let share = t.path().join("sb/share");
        let view = make(&share).unwrap();
        assert_eq!(view, t.path().join("sb/share.guest"));
        let root = open(&share).unwrap();
        bind_into(root.as_fd(), "m0", &src, ReadOnly::No, Propagation::Private).unwrap();
        assert_eq!(std::fs::read(share.join("m0/keep")).unwrap(), b"data");
        assert_eq!(std::fs::read(view.join("m0/keep")).unwrap(), b"data");
        drop(root);
        remove(&share).unwrap();
        assert!(!share.exists() && !view.exists());
        assert_eq!(std::fs::read(src.join("keep")).unwrap(), b"data");
        assert!(mounts_below(t.path()).is_empty());
    }

    /// The guest view is read-only but for what is bound read-write. A
    /// read-only bind is read-only as runc has it: the bound directory
    /// only, a mount inside it keeps its own attributes (and is named so
    /// the guest can reach it first); `rro` makes it read-only too.
    #[test]
    fn guest_view_is_read_only_but_for_rw_mounts() {
        let Some(t) = Scratch::new() else { return };
        let (rw, ro, rro, sub) = (
            t.path().join("rw"),
            t.path().join("ro"),
            t.path().join("rro"),
            t.path().join("sub"),
        );
        for d in [&rw, &ro, &rro, &sub] {
            std::fs::create_dir(d).unwrap();
        }
        for d in [&ro, &rro] {
            std::fs::create_dir(d.join("inner")).unwrap();
            rustix::mount::mount_bind(&sub, d.join("inner")).unwrap();
        }
        let file = t.path().join("file");
        std::fs::write(&file, b"host bytes").unwrap();
        let share = t.path().join("sb/share");
        let view = make(&share).unwrap();
        let root = open(&share).unwrap();
        create_dir(root.as_fd(), "c1").unwrap();
        let private = Propagation::Private;
        assert!(
            bind_into(root.as_fd(), "c1/m0", &rw, ReadOnly::No, private)
                .unwrap()
                .is_empty()
        );
        let below = bind_into(root.as_fd(), "c1/m1", &ro, ReadOnly::Top, private).unwrap();
        assert_eq!(below, vec!["inner".to_string()]);
        bind_into(root.as_fd(), "c1/m2", &file, ReadOnly::Top, private).unwrap();
        bind_into(root.as_fd(), "c1/m3", &rro, ReadOnly::Recursive, private).unwrap();

        let erofs = |r: std::io::Result<()>, what: &str| {
            let e = r.expect_err(what);
            assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{what}: {e}");
        };
        erofs(
            std::fs::create_dir(view.join("c2")),
            "mkdir at the view's root",
        );
        erofs(
            std::os::unix::fs::symlink("/etc", view.join("c1/rootfs")),
            "symlink in a container's dir",
        );
        std::fs::write(view.join("c1/m0/new"), b"ok").unwrap();
        assert_eq!(std::fs::read(rw.join("new")).unwrap(), b"ok");
        for base in [&view, &share] {
            erofs(std::fs::write(base.join("c1/m1/new"), b"x"), "ro dir bind");
            erofs(std::fs::write(base.join("c1/m3/new"), b"x"), "rro dir bind");
            erofs(
                std::fs::write(base.join("c1/m3/inner/new"), b"x"),
                "rro, recursively",
            );
            erofs(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(base.join("c1/m2"))
                    .map(drop),
                "ro file bind",
            );
        }
        // Not recursive: the mount inside the read-only bind is writable.
        std::fs::write(view.join("c1/m1/inner/new"), b"inner").unwrap();
        assert_eq!(std::fs::read(sub.join("new")).unwrap(), b"inner");
        assert_eq!(std::fs::read(&file).unwrap(), b"host bytes");
        assert_eq!(std::fs::read_dir(&ro).unwrap().count(), 1, "only 'inner'");
        drop(root);
        remove(&share).unwrap();
        for d in [&ro, &rro] {
            rustix::mount::unmount(d.join("inner"), UnmountFlags::empty()).unwrap();
        }
        assert!(mounts_below(t.path()).is_empty());
    }

    /// A mount made on the host below a bind's source after the bind
    /// reaches the share with HostToContainer (`rslave`), and not with the
    /// default; a mount made in the share never reaches the host, even
    /// when the source sits on a shared mount (a clone would join its
    /// peer group).
    #[test]
    fn later_host_mounts_reach_the_share_only_with_host_to_container() {
        let Some(t) = Scratch::new() else { return };
        let host = t.path().join("host");
        std::fs::create_dir(&host).unwrap();
        rustix::mount::mount_bind(&host, &host).unwrap();
        rustix::mount::mount_change(&host, MountPropagationFlags::SHARED).unwrap();
        let (slave, private, extra) = (
            host.join("slave"),
            host.join("private"),
            t.path().join("extra"),
        );
        for d in [&slave, &private, &extra] {
            std::fs::create_dir(d).unwrap();
        }
        std::fs::write(extra.join("marker"), b"m").unwrap();
        let share = t.path().join("sb/share");
        let view = make(&share).unwrap();
        let root = open(&share).unwrap();
        create_dir(root.as_fd(), "c1").unwrap();
        bind_into(
            root.as_fd(),
            "c1/s",
            &slave,
            ReadOnly::No,
            Propagation::Slave,
        )
        .unwrap();
        bind_into(
            root.as_fd(),
            "c1/p",
            &private,
            ReadOnly::No,
            Propagation::Private,
        )
        .unwrap();
        for d in [&slave, &private] {
            std::fs::create_dir(d.join("later")).unwrap();
            rustix::mount::mount_bind(&extra, d.join("later")).unwrap();
        }
        for base in [&share, &view] {
            assert!(
                base.join("c1/s/later/marker").exists(),
                "rslave: {}",
                base.display()
            );
            assert!(
                !base.join("c1/p/later/marker").exists(),
                "rprivate: {}",
                base.display()
            );
        }
        // Nothing flows back to the host.
        std::fs::create_dir(share.join("c1/s/back")).unwrap();
        rustix::mount::mount_bind(&extra, share.join("c1/s/back")).unwrap();
        assert!(
            !slave.join("back/marker").exists(),
            "a share mount reached the host"
        );
        drop(root);
        remove(&share).unwrap();
    }

    /// The share escape, one path kind at a time: the guest planted a
    /// symlink (to a host file or directory outside the share) or a
    /// directory where crust is about to create the container's directory,
    /// its rootfs, a file bind (`/etc/hosts` and the like) or a directory
    /// bind. Each step is refused, names the path, and leaves the host file's
    /// bytes, the host directory and the mount table as they were.
    #[test]
    fn planted_entries_are_refused_for_every_kind() {
        let Some(t) = Scratch::new() else { return };
        let host_file = t.path().join("host-file");
        std::fs::write(&host_file, b"precious").unwrap();
        let host_dir = t.path().join("host-dir");
        std::fs::create_dir(&host_dir).unwrap();
        let (src_file, src_dir) = (t.path().join("src-file"), t.path().join("src-dir"));
        std::fs::write(&src_file, b"bind source").unwrap();
        std::fs::create_dir(&src_dir).unwrap();
        let share = t.path().join("sb/share");
        make(&share).unwrap();
        let root = open(&share).unwrap();
        let bind = |rel: &str, src: &Path, ro: ReadOnly| {
            bind_into(root.as_fd(), rel, src, ro, Propagation::Private).map(drop)
        };
        // Every planted link points into the scratch dir, so a mount that
        // followed one shows there (the whole table would also see other
        // tests' mounts).
        let before = mounts_below(t.path());
        let overlay = {
            for d in ["lower", "upper", "work"] {
                std::fs::create_dir(t.path().join(d)).unwrap();
            }
            let p = |d: &str| t.path().join(d).display().to_string();
            FsSpec::new(
                "overlay",
                "overlay",
                &[
                    format!("lowerdir={}", p("lower")),
                    format!("upperdir={}", p("upper")),
                    format!("workdir={}", p("work")),
                ],
            )
        };
        let link = |rel: &str, to: &Path| std::os::unix::fs::symlink(to, share.join(rel)).unwrap();
        let planted = |r: Result<(), ShareError>, rel: &str| match r {
            Err(ShareError::Beneath(BeneathError::Planted { path })) => assert_eq!(path, rel),
            other => panic!("{rel}: {other:?}"),
        };

        // The container's own directory: a symlink or a directory there.
        link("c1", &host_dir);
        planted(create_dir(root.as_fd(), "c1").map(drop), "c1");
        std::fs::create_dir(share.join("c2")).unwrap();
        link("c2/rootfs", &host_dir);
        planted(create_dir(root.as_fd(), "c2").map(drop), "c2");
        // Cleaning up after the refusal removes what was planted only.
        remove_container(&share, "c1").unwrap();
        remove_container(&share, "c2").unwrap();
        assert!(!share.join("c1").exists() && !share.join("c2").exists());
        assert!(host_dir.is_dir());

        // Inside a directory crust made (planted between two steps).
        create_dir(root.as_fd(), "c3").unwrap();
        link("c3/rootfs", &host_dir);
        planted(mount_into(root.as_fd(), "c3/rootfs", &overlay), "c3/rootfs");
        link("c3/m0", &host_file);
        planted(bind("c3/m0", &src_file, ReadOnly::Top), "c3/m0");
        link("c3/m1", &host_dir);
        planted(bind("c3/m1", &src_dir, ReadOnly::No), "c3/m1");
        // A rootfs bind (no snapshotter mounts) is a directory bind too.
        link("c3/m2", &host_dir);
        planted(bind("c3/m2", &src_dir, ReadOnly::No), "c3/m2");
        // A symlinked parent on the way is never followed.
        link("c3/via", &t.path().join("sb"));
        match bind("c3/via/x", &src_file, ReadOnly::No) {
            Err(ShareError::Beneath(BeneathError::Escape { path })) => assert_eq!(path, "c3/via"),
            other => panic!("{other:?}"),
        }
        assert!(!t.path().join("sb/x").exists());
        // A regular file planted where a directory bind goes, and the
        // reverse: refused as well.
        std::fs::write(share.join("c3/m3"), b"").unwrap();
        planted(bind("c3/m3", &src_dir, ReadOnly::No), "c3/m3");
        std::fs::create_dir(share.join("c3/m4")).unwrap();
        planted(bind("c3/m4", &src_file, ReadOnly::No), "c3/m4");

        assert_eq!(std::fs::read(&host_file).unwrap(), b"precious");
        assert_eq!(std::fs::read_dir(&host_dir).unwrap().count(), 0);
        assert_eq!(
            mounts_below(t.path()),
            before,
            "nothing was mounted anywhere"
        );
        remove_container(&share, "c3").unwrap();
        assert_eq!(std::fs::read(&host_file).unwrap(), b"precious");
        assert!(host_dir.is_dir());

        // The same steps with nothing planted work (and really mount).
        create_dir(root.as_fd(), "c4").unwrap();
        mount_into(root.as_fd(), "c4/rootfs", &overlay).unwrap();
        std::fs::write(share.join("c4/rootfs/written"), b"w").unwrap();
        assert!(t.path().join("upper/written").exists());
        bind("c4/m0", &src_file, ReadOnly::Top).unwrap();
        assert_eq!(std::fs::read(share.join("c4/m0")).unwrap(), b"bind source");
        bind("c4/m1", &src_dir, ReadOnly::No).unwrap();
        assert_eq!(mounts_below(&share.join("c4")).len(), 3);
        remove_container(&share, "c4").unwrap();
        assert!(mounts_below(&share).is_empty() && !share.join("c4").exists());
        assert_eq!(std::fs::read(&src_file).unwrap(), b"bind source");
        drop(root);
        remove(&share).unwrap();
    }

    /// An overlay with more layers than fit one fsconfig value (256 bytes)
    /// is mounted layer by layer.
    #[test]
    fn overlay_with_many_layers() {
        let Some(t) = Scratch::new() else { return };
        let mut lowers = Vec::new();
        for i in 0..12 {
            let d = t.path().join(format!("layer-with-a-long-name-{i:02}"));
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join(format!("f{i}")), b"l").unwrap();
            lowers.push(d.display().to_string());
        }
        let lowerdir = lowers.join(":");
        assert!(lowerdir.len() > 256);
        for d in ["upper", "work"] {
            std::fs::create_dir(t.path().join(d)).unwrap();
        }
        let share = t.path().join("sb/share");
        make(&share).unwrap();
        let root = open(&share).unwrap();
        create_dir(root.as_fd(), "c").unwrap();
        let fs = FsSpec::new(
            "overlay",
            "overlay",
            &[
                format!("lowerdir={lowerdir}"),
                format!("upperdir={}", t.path().join("upper").display()),
                format!("workdir={}", t.path().join("work").display()),
            ],
        );
        mount_into(root.as_fd(), "c/rootfs", &fs).unwrap();
        for i in 0..12 {
            assert!(share.join(format!("c/rootfs/f{i}")).exists(), "layer {i}");
        }
        drop(root);
        remove(&share).unwrap();
    }
}
