//! Mounting, unmounting and reading `/proc/self/mountinfo`.

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, CWD, StatxAttributes, StatxFlags};
use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags};

use crate::FsType;
use crate::device::{self, DeviceError};

/// Errors from mount operations.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// Never carries the option's text (options may hold credentials and
    /// this message reaches gRPC statuses, logs and pod events): only its
    /// position and, when it is one crust knows, its name from crust's
    /// own tables.
    #[error(
        "mount option {}{} is not allowed: {reason} (the option's text is not repeated: mount options may carry credentials)",
        position.map(|n| format!("#{n}")).unwrap_or_default(),
        name.map(|k| format!(" ({k})")).unwrap_or_default()
    )]
    InvalidOption {
        /// 1-based, counting comma-separated options across all elements;
        /// None for a conflict between options.
        position: Option<usize>,
        /// A name from crust's option tables (never the caller's text).
        name: Option<&'static str>,
        reason: String,
    },
    #[error("mount target {0} does not exist or is not a directory")]
    BadTarget(PathBuf),
    #[error("{target} already has {existing} mounted on it")]
    TargetInUse { target: PathBuf, existing: String },
    #[error("{target} is already mounted {actual}, but {wanted} was requested")]
    ReadOnlyMismatch {
        target: PathBuf,
        actual: &'static str,
        wanted: &'static str,
    },
    #[error("mounting {source_path} on {target}: {source}")]
    Mount {
        source_path: PathBuf,
        target: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{target} is busy (files open or mounts below it); not unmounted")]
    Busy { target: PathBuf },
    #[error("unmounting {target}: {source}")]
    Unmount {
        target: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reading /proc/self/mountinfo: {0}")]
    MountInfo(#[source] io::Error),
    #[error("malformed mountinfo line {line}: {reason}")]
    Parse { line: usize, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Device(#[from] DeviceError),
}

pub use crust_mountinfo::MountEntry;

/// Parses the contents of a mountinfo file (see `proc(5)`).
pub fn parse_mountinfo(text: &[u8]) -> Result<Vec<MountEntry>, MountError> {
    crust_mountinfo::parse(text).map_err(|e| MountError::Parse {
        line: e.line,
        reason: e.reason,
    })
}

/// Mount points strictly below `dir`, sorted, each once (from the cached
/// table: what a teardown must detach before removing `dir`).
pub fn mount_points_below(dir: &Path) -> Result<Vec<PathBuf>, MountError> {
    let mut points: Vec<PathBuf> = current_table()?
        .entries
        .iter()
        .filter(|m| m.mount_point.starts_with(dir) && m.mount_point != dir)
        .map(|m| m.mount_point.clone())
        .collect();
    points.sort();
    points.dedup();
    Ok(points)
}

/// Every mount visible to this process, in mount order (later entries are
/// stacked on top of earlier ones at the same path). From the cached table
/// (see [`MountTable`]): no parsing unless the mounts changed.
pub fn mount_info() -> Result<Vec<MountEntry>, MountError> {
    Ok(current_table()?.entries.clone())
}

/// The parsed mount table with an index by mount point. A node with
/// hundreds of volumes has thousands of mounts: parsing the whole table
/// for every lookup made each RPC cost time in the number of volumes.
/// The table is parsed again only after the kernel says it changed: a
/// descriptor of `/proc/self/mountinfo` polls `POLLPRI` after any mount or
/// unmount in the namespace (`proc(5)`), and polling consumes the event,
/// so the read that follows the poll is at least as new as the event.
struct MountTable {
    entries: Vec<MountEntry>,
    /// Mount point -> index of the topmost entry there.
    top: std::collections::HashMap<PathBuf, usize>,
}

struct MountCache {
    /// The mount namespace the watch belongs to (its inode): a process
    /// that moved to another namespace starts over.
    ns: u64,
    watch: std::os::fd::OwnedFd,
    table: std::sync::Arc<MountTable>,
}

static MOUNT_CACHE: std::sync::Mutex<Option<MountCache>> = std::sync::Mutex::new(None);

fn read_table() -> Result<MountTable, MountError> {
    let text = std::fs::read("/proc/self/mountinfo").map_err(MountError::MountInfo)?;
    let entries = parse_mountinfo(&text)?;
    let top = entries
        .iter()
        .enumerate()
        .map(|(i, m)| (m.mount_point.clone(), i))
        .collect();
    Ok(MountTable { entries, top })
}

/// Whether the mounts changed since the last call on `watch`.
fn mounts_changed(watch: &std::os::fd::OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut fds = [PollFd::new(watch, PollFlags::PRI)];
    match poll(&mut fds, Some(&rustix::event::Timespec::default())) {
        Ok(0) => false,
        Ok(_) => !(fds[0].revents() & (PollFlags::PRI | PollFlags::ERR)).is_empty(),
        // Cannot tell: assume it changed.
        Err(_) => true,
    }
}

fn current_table() -> Result<std::sync::Arc<MountTable>, MountError> {
    // 0 where the kernel has no namespace files: the watch alone decides.
    let ns = std::fs::metadata("/proc/self/ns/mnt")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap_or(0);
    let mut cache = MOUNT_CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = cache.as_ref()
        && c.ns == ns
        && !mounts_changed(&c.watch)
    {
        return Ok(c.table.clone());
    }
    let watch = match cache.take() {
        Some(c) if c.ns == ns => c.watch,
        // Opened before the read: a change after the open is seen.
        _ => rustix::fs::open(
            "/proc/self/mountinfo",
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(|e| MountError::MountInfo(e.into()))?,
    };
    let table = std::sync::Arc::new(read_table()?);
    *cache = Some(MountCache {
        ns,
        watch,
        table: table.clone(),
    });
    Ok(table)
}

/// `path` as mountinfo would print it, without touching the (maybe hung)
/// filesystem mounted there: the parent is canonicalized, the last
/// component kept.
fn mountinfo_form(path: &Path) -> PathBuf {
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => std::fs::canonicalize(parent)
            .map(|p| p.join(name))
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

/// Whether the topmost mount at `path` is `device`'s filesystem from its
/// root (not a bind of a subdirectory): the mount a stage made.
pub fn root_mounted_at(device: &Path, path: &Path) -> Result<bool, MountError> {
    let Some(m) = find_mount(path)? else {
        return Ok(false);
    };
    Ok(
        crate::device_major_minor(device).ok() == Some((m.major, m.minor))
            && m.root == Path::new("/"),
    )
}

/// The topmost mount whose mount point is `target`, if any. Does not
/// access the filesystem mounted there, so it is safe on a hung mount.
pub fn find_mount(target: &Path) -> Result<Option<MountEntry>, MountError> {
    let want = mountinfo_form(target);
    let t = current_table()?;
    Ok(t.top.get(&want).map(|&i| t.entries[i].clone()))
}

/// Whether `path` is the root of a mount (also for file bind mounts).
/// A missing path is `false`. Uses `statx` `STATX_ATTR_MOUNT_ROOT`, falling
/// back to mountinfo on kernels without it.
pub fn is_mountpoint(path: &Path) -> Result<bool, MountError> {
    match rustix::fs::statx(
        CWD,
        path,
        AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::BASIC_STATS,
    ) {
        Ok(st) if st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT) => {
            Ok(st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))
        }
        Ok(_) => Ok(find_mount(path)?.is_some()),
        Err(Errno::NOENT) | Err(Errno::NOTDIR) => Ok(false),
        // A hung or shut-down filesystem: decide from mountinfo.
        Err(_) => Ok(find_mount(path)?.is_some()),
    }
}

/// Mount options split into `mount(2)` flags and the filesystem data string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedOptions {
    pub flags: MountFlags,
    /// Comma-separated filesystem-specific options (may be empty).
    pub data: String,
    pub read_only: bool,
    /// The caller asked for `suid` / `dev` (host mounts get `nosuid` /
    /// `nodev` otherwise, see [`mount_fs`]).
    pub suid: bool,
    pub dev: bool,
}

fn mount_flag(f: crust_fs::MountFlag) -> MountFlags {
    use crust_fs::MountFlag as F;
    match f {
        F::ReadOnly => MountFlags::RDONLY,
        F::NoSuid => MountFlags::NOSUID,
        F::NoDev => MountFlags::NODEV,
        F::NoExec => MountFlags::NOEXEC,
        F::NoAtime => MountFlags::NOATIME,
        F::NoDirAtime => MountFlags::NODIRATIME,
        F::RelAtime => MountFlags::RELATIME,
        F::StrictAtime => MountFlags::STRICTATIME,
        F::LazyTime => MountFlags::LAZYTIME,
        F::Synchronous => MountFlags::SYNCHRONOUS,
        F::DirSync => MountFlags::DIRSYNC,
        F::NoSymFollow => MountFlags::NOSYMFOLLOW,
    }
}

impl From<crust_fs::OptionError> for MountError {
    fn from(e: crust_fs::OptionError) -> MountError {
        MountError::InvalidOption {
            position: e.position(),
            name: e.name(),
            reason: match &e {
                crust_fs::OptionError::NotAllowed { fstype, reason, .. } => {
                    format!("{reason} (for {fstype})")
                }
                other => other.reason().to_string(),
            },
        }
    }
}

/// Validates mount options for `fstype` with crust's one allow-list
/// ([`crust_fs::options::parse`], the same the guest agent applies) and
/// splits them into flags and a data string. Each element may itself hold
/// comma-separated options. An error names the option by position (and by
/// crust's name for it, if it has one), never by its text.
pub fn parse_mount_options(
    fstype: FsType,
    options: &[String],
    readonly: bool,
) -> Result<ParsedOptions, MountError> {
    let p = crust_fs::options::parse(fstype, options, readonly)?;
    Ok(ParsedOptions {
        flags: p
            .flags
            .iter()
            .fold(MountFlags::empty(), |acc, f| acc | mount_flag(*f)),
        data: p.data,
        read_only: p.read_only,
        suid: p.suid,
        dev: p.dev,
    })
}

fn ro_word(ro: bool) -> &'static str {
    if ro { "read-only" } else { "read-write" }
}

fn ensure_dir(target: &Path) -> Result<(), MountError> {
    match std::fs::metadata(target) {
        Ok(m) if m.is_dir() => Ok(()),
        _ => Err(MountError::BadTarget(target.to_path_buf())),
    }
}

/// Mounts the filesystem on block device `dev` at directory `target`.
///
/// Options are validated by [`parse_mount_options`]; `readonly` adds
/// `MS_RDONLY`. Idempotent: if `target` already has `dev` mounted (its
/// whole filesystem) with the same read-only-ness, returns `Ok`. Another
/// mount there gives [`MountError::TargetInUse`], a different
/// read-only-ness [`MountError::ReadOnlyMismatch`]. The target directory
/// must exist.
pub fn mount_fs(
    dev: &Path,
    target: &Path,
    fstype: FsType,
    options: &[String],
    readonly: bool,
) -> Result<(), MountError> {
    let parsed = parse_mount_options(fstype, options, readonly)?;
    let (major, minor) = device::device_major_minor(dev)?;
    if let Some(m) = find_mount(target)? {
        if (m.major, m.minor) == (major, minor) && m.root == Path::new("/") {
            if m.is_read_only() == parsed.read_only {
                return Ok(());
            }
            return Err(MountError::ReadOnlyMismatch {
                target: target.to_path_buf(),
                actual: ro_word(m.is_read_only()),
                wanted: ro_word(parsed.read_only),
            });
        }
        return Err(MountError::TargetInUse {
            target: target.to_path_buf(),
            existing: m.source,
        });
    }
    ensure_dir(target)?;
    let data = CString::new(parsed.data).expect("NUL rejected above");
    // A volume's content is the workload's: no setuid programs or device
    // nodes from it on the host unless the caller asks (`suid`, `dev`).
    let mut flags = parsed.flags;
    if !parsed.suid {
        flags |= MountFlags::NOSUID;
    }
    if !parsed.dev {
        flags |= MountFlags::NODEV;
    }
    rustix::mount::mount(dev, target, fstype.as_str(), flags, Some(data.as_c_str())).map_err(
        |e| MountError::Mount {
            source_path: dev.to_path_buf(),
            target: target.to_path_buf(),
            source: e.into(),
        },
    )?;
    tracing::debug!(device = %dev.display(), target = %target.display(), "mounted");
    Ok(())
}

fn same_object(a: &Path, b: &Path) -> bool {
    match (rustix::fs::stat(a), rustix::fs::stat(b)) {
        (Ok(x), Ok(y)) => x.st_dev == y.st_dev && x.st_ino == y.st_ino,
        _ => false,
    }
}

/// Bind-mounts `src` (a directory, a file or a device node) onto `target`
/// (an existing directory or file of the same kind). A read-only bind
/// needs a second `MS_REMOUNT|MS_BIND|MS_RDONLY` call; if that fails the
/// bind is undone so no writable mount is left behind.
///
/// Idempotent: if `target` is already a mount showing the same object as
/// `src` with the same read-only-ness, returns `Ok`.
pub fn bind_mount(src: &Path, target: &Path, readonly: bool) -> Result<(), MountError> {
    if is_mountpoint(target)? {
        if same_object(src, target) {
            let ro = find_mount(target)?.is_some_and(|m| m.is_read_only());
            if ro == readonly {
                return Ok(());
            }
            return Err(MountError::ReadOnlyMismatch {
                target: target.to_path_buf(),
                actual: ro_word(ro),
                wanted: ro_word(readonly),
            });
        }
        let existing = find_mount(target)?
            .map(|m| m.source)
            .unwrap_or_else(|| "another mount".into());
        return Err(MountError::TargetInUse {
            target: target.to_path_buf(),
            existing,
        });
    }
    let map = |e: Errno| MountError::Mount {
        source_path: src.to_path_buf(),
        target: target.to_path_buf(),
        source: e.into(),
    };
    rustix::mount::mount_bind(src, target).map_err(map)?;
    // A bind remount replaces the per-mount flags: keep the ones the bind
    // inherited (nosuid, nodev, noexec) and add read-only.
    let inherited = find_mount(target)
        .ok()
        .flatten()
        .map(|m| {
            [
                ("nosuid", MountFlags::NOSUID),
                ("nodev", MountFlags::NODEV),
                ("noexec", MountFlags::NOEXEC),
            ]
            .into_iter()
            .filter(|(o, _)| m.mount_options.iter().any(|x| x == o))
            .fold(MountFlags::empty(), |acc, (_, f)| acc | f)
        })
        .unwrap_or_else(MountFlags::empty);
    if readonly
        && let Err(e) = rustix::mount::mount_remount(
            target,
            MountFlags::BIND | MountFlags::RDONLY | inherited,
            c"",
        )
    {
        let _ = rustix::mount::unmount(target, UnmountFlags::NOFOLLOW);
        return Err(map(e));
    }
    tracing::debug!(src = %src.display(), target = %target.display(), readonly, "bind mounted");
    Ok(())
}

/// Unmounts `target` until it is no longer a mount point (stacked mounts
/// are all removed). Idempotent: a path that is not mounted or does not
/// exist is success. Never detaches lazily: a busy mount gives
/// [`MountError::Busy`]. Symlinks are not followed.
pub fn unmount(target: &Path) -> Result<(), MountError> {
    for _ in 0..64 {
        match rustix::mount::unmount(target, UnmountFlags::NOFOLLOW) {
            Ok(()) => {
                tracing::debug!(target = %target.display(), "unmounted");
                continue;
            }
            Err(Errno::INVAL) | Err(Errno::NOENT) => return Ok(()),
            Err(Errno::BUSY) => {
                return Err(MountError::Busy {
                    target: target.to_path_buf(),
                });
            }
            Err(e) => {
                return Err(MountError::Unmount {
                    target: target.to_path_buf(),
                    source: e.into(),
                });
            }
        }
    }
    Err(MountError::Unmount {
        target: target.to_path_buf(),
        source: io::Error::other("more than 64 mounts stacked on the target"),
    })
}

/// Unmounts the topmost mount at `target` only (a caller that checked
/// which mount that is). Not mounted: Ok. Busy: [`MountError::Busy`].
pub fn unmount_top(target: &Path) -> Result<(), MountError> {
    match rustix::mount::unmount(target, UnmountFlags::NOFOLLOW) {
        Ok(()) | Err(Errno::INVAL) | Err(Errno::NOENT) => Ok(()),
        Err(Errno::BUSY) => Err(MountError::Busy {
            target: target.to_path_buf(),
        }),
        Err(e) => Err(MountError::Unmount {
            target: target.to_path_buf(),
            source: e.into(),
        }),
    }
}

/// Unmounts its target when dropped (tests and error paths).
#[derive(Debug)]
pub struct MountGuard {
    target: Option<PathBuf>,
}

impl MountGuard {
    /// Guards an existing mount at `target`.
    pub fn new(target: impl Into<PathBuf>) -> Self {
        MountGuard {
            target: Some(target.into()),
        }
    }

    /// [`mount_fs`] and guard the result.
    pub fn mount_fs(
        dev: &Path,
        target: &Path,
        fstype: FsType,
        options: &[String],
        readonly: bool,
    ) -> Result<Self, MountError> {
        mount_fs(dev, target, fstype, options, readonly)?;
        Ok(Self::new(target))
    }

    pub fn target(&self) -> &Path {
        self.target.as_deref().expect("guard armed")
    }

    /// Unmounts now, reporting errors.
    pub fn unmount(mut self) -> Result<(), MountError> {
        let t = self.target.take().expect("guard armed");
        unmount(&t)
    }

    /// Disarms the guard; the mount stays.
    pub fn release(mut self) -> PathBuf {
        self.target.take().expect("guard armed")
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        if let Some(t) = self.target.take()
            && let Err(e) = unmount(&t)
        {
            tracing::warn!(target = %t.display(), %e, "MountGuard could not unmount");
            eprintln!("MountGuard: could not unmount {}: {e}", t.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,errors=remount-ro
36 22 7:3 / /var/lib/kubelet/pods/a\\040b/vol\\011x rw,nosuid shared:5 master:2 - ext4 /dev/loop3 ro,errors=remount-ro
37 22 0:5 /loop3 /tmp/raw\\134file ro - devtmpfs udev rw,size=10k
38 22 7:4 /sub /mnt/back\\\\slash rw - xfs /dev/loop4 rw,attr2
";

    #[test]
    fn parses_mountinfo_with_escapes() {
        let m = parse_mountinfo(SAMPLE.as_bytes()).unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(m[0].mount_point, Path::new("/"));
        assert_eq!(m[0].optional_fields, vec!["shared:1"]);
        assert_eq!(m[1].mount_id, 36);
        assert_eq!((m[1].major, m[1].minor), (7, 3));
        assert_eq!(
            m[1].mount_point,
            Path::new("/var/lib/kubelet/pods/a b/vol\tx")
        );
        assert_eq!(m[1].optional_fields, vec!["shared:5", "master:2"]);
        assert!(!m[1].is_read_only());
        assert!(m[1].super_read_only());
        assert_eq!(m[1].super_option("errors"), Some("remount-ro"));
        assert_eq!(m[1].source, "/dev/loop3");
        assert_eq!(m[2].root, Path::new("/loop3"));
        assert_eq!(m[2].mount_point, Path::new("/tmp/raw\\file"));
        assert!(m[2].is_read_only());
        assert!(m[2].optional_fields.is_empty());
        // A backslash not followed by three octal digits stays literal.
        assert_eq!(m[3].mount_point, Path::new("/mnt/back\\\\slash"));
        assert_eq!(m[3].fs_type, "xfs");
    }

    /// The `mountinfo` fuzz target's crash input (it crashed the agent's
    /// parser): `\400` and above are text here too, not a truncated byte.
    #[test]
    fn escape_above_377_is_text() {
        // Its first line has no major:minor: refused, never misread.
        assert!(parse_mountinfo(b"24\x00\x00\x00254:0 / / rw,\x5c011x rw,nosuid shared:5 m\x12aster:2 - ext4 /dev/l 3pooro,errors=remount-ro\x0a38 22 7:4 /sub /mnt/back\x5c400\x5c\x5cslash rw - xfs /dev/loop4 rw,atwr2\x0a").is_err());
        let m = parse_mountinfo(
            b"38 22 7:4 /sub /mnt/back\x5c400\x5c\x5cslash rw - xfs /dev/loop4 rw,atwr2\x0a",
        )
        .unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].mount_point, Path::new("/mnt/back\\400\\\\slash"));
        let m = parse_mountinfo(b"1 2 3:4 / /a\\777\\377 rw - ext4 /dev/x rw\n").unwrap();
        assert_eq!(
            m[0].mount_point.as_os_str().as_encoded_bytes(),
            b"/a\\777\xff"
        );
    }

    #[test]
    fn rejects_malformed_mountinfo() {
        assert!(matches!(
            parse_mountinfo(b"1 2 3:4 / /x rw ext4 /dev/x rw\n"),
            Err(MountError::Parse { line: 1, .. })
        ));
        assert!(matches!(
            parse_mountinfo(b"1 2 3-4 / /x rw - ext4 /dev/x rw\n"),
            Err(MountError::Parse { .. })
        ));
    }

    /// The cached table follows mounts and unmounts at once (the poll
    /// event), and a lookup finds the topmost of stacked mounts.
    #[test]
    fn cached_table_sees_every_change() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        assert!(find_mount(p).unwrap().is_none());
        let tmpfs = |size: &str| {
            let opts = CString::new(format!("size={size}")).unwrap();
            rustix::mount::mount("tmpfs", p, "tmpfs", MountFlags::empty(), opts.as_c_str())
                .unwrap();
        };
        tmpfs("1m");
        let first = find_mount(p).unwrap().expect("mounted");
        assert_eq!(first.fs_type, "tmpfs");
        tmpfs("2m");
        let second = find_mount(p).unwrap().expect("stacked");
        assert_ne!(second.mount_id, first.mount_id, "the topmost mount");
        assert!(second.super_options.iter().any(|o| o == "size=2048k"));
        rustix::mount::unmount(p, UnmountFlags::empty()).unwrap();
        assert_eq!(find_mount(p).unwrap().unwrap().mount_id, first.mount_id);
        rustix::mount::unmount(p, UnmountFlags::empty()).unwrap();
        assert!(find_mount(p).unwrap().is_none());
        assert!(!mount_info().unwrap().iter().any(|m| m.mount_point == p));
    }

    #[test]
    fn reads_own_mountinfo() {
        let m = mount_info().unwrap();
        assert!(m.iter().any(|e| e.mount_point == Path::new("/")));
    }

    fn opts(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn splits_flags_and_data() {
        let p = parse_mount_options(
            FsType::Ext4,
            &opts(&[
                "noatime,nodev",
                "errors=remount-ro",
                "commit=30",
                "defaults",
            ]),
            false,
        )
        .unwrap();
        assert_eq!(p.flags, MountFlags::NOATIME | MountFlags::NODEV);
        assert_eq!(p.data, "errors=remount-ro,commit=30");
        assert!(!p.read_only);

        let p =
            parse_mount_options(FsType::Xfs, &opts(&["nouuid", "allocsize=64k"]), true).unwrap();
        assert_eq!(p.flags, MountFlags::RDONLY);
        assert_eq!(p.data, "nouuid,allocsize=64k");
        assert!(p.read_only);
    }

    #[test]
    fn rejects_unsafe_and_unknown_options() {
        for (fs, bad) in [
            (FsType::Ext4, "bind"),
            (FsType::Ext4, "errors=panic"),
            (FsType::Ext4, "journal_path=/dev/sda"),
            (FsType::Xfs, "logdev=/dev/sdb"),
            (FsType::Ext4, "context=system_u:object_r:foo"),
            (FsType::Ext4, "nouuid"),
            (FsType::Xfs, "data=journal"),
            (FsType::Ext4, "commit=abc"),
            (FsType::Xfs, "allocsize=1x"),
            (FsType::Ext4, "frobnicate"),
            (FsType::Ext4, "norecovery"),
        ] {
            let err = parse_mount_options(fs, &opts(&[bad]), false).unwrap_err();
            assert!(
                matches!(err, MountError::InvalidOption { .. }),
                "{bad}: {err}"
            );
        }
        assert!(parse_mount_options(FsType::Ext4, &opts(&["rw"]), true).is_err());
        assert!(parse_mount_options(FsType::Ext4, &opts(&["noatime", "relatime"]), false).is_err());
        assert!(parse_mount_options(FsType::Xfs, &opts(&["norecovery"]), true).is_ok());
    }

    #[test]
    fn rejections_name_the_position_never_the_text() {
        let secret = "s3cr3tV4lue";
        for (fs, list, position, name) in [
            // unknown key holding a secret: position only
            (
                FsType::Ext4,
                vec!["noatime", &*format!("nodev,passphrase={secret}")],
                3,
                None,
            ),
            // known key, secret as its value: the key from our table only
            (
                FsType::Ext4,
                vec![&*format!("commit={secret}")],
                1,
                Some("commit"),
            ),
            (
                FsType::Xfs,
                vec!["nouuid", &*format!("allocsize={secret}")],
                2,
                Some("allocsize"),
            ),
            // a path (could be anything)
            (
                FsType::Ext4,
                vec![&*format!("journal_path=/dev/{secret}")],
                1,
                None,
            ),
            (FsType::Ext4, vec![secret], 1, None),
            (
                FsType::Ext4,
                vec!["ro", "errors=panic"],
                2,
                Some("errors=panic"),
            ),
        ] {
            let list: Vec<String> = list.iter().map(|s| s.to_string()).collect();
            let err = parse_mount_options(fs, &list, false).unwrap_err();
            let MountError::InvalidOption {
                position: p,
                name: n,
                ..
            } = &err
            else {
                panic!("{err}");
            };
            assert_eq!((*p, *n), (Some(position), name), "{list:?}: {err}");
            let msg = err.to_string();
            assert!(!msg.contains(secret), "{msg}");
            assert!(msg.contains(&format!("mount option #{position}")), "{msg}");
            assert!(!format!("{err:?}").contains(secret), "{err:?}");
        }
        // conflicts name crust's words only
        let err = parse_mount_options(FsType::Ext4, &opts(&["rw"]), true).unwrap_err();
        assert!(matches!(
            err,
            MountError::InvalidOption {
                position: None,
                name: Some("rw"),
                ..
            }
        ));
    }
}
