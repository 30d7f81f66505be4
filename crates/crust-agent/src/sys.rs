//! Small readers of /proc and /sys used by the volume operations.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_agent_proto::FsType;

/// One line of /proc/self/mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Which mount this is: its id and the device of its filesystem.
    pub identity: MountIdentity,
    pub mount_point: PathBuf,
    /// Root of the mount within its filesystem (`/` unless a bind mount of
    /// a subdirectory).
    pub root: String,
    pub fstype: String,
    pub source: String,
    /// Per-mount options (`rw`, `noatime`, ...), unescaped, no empty ones.
    pub mount_options: Vec<String>,
    /// Superblock options (`rw`, `errors=remount-ro`, ...), likewise.
    pub super_options: Vec<String>,
}

impl MountEntry {
    /// Read-only at either the mount or the superblock level.
    pub fn is_readonly(&self) -> bool {
        self.mount_options.iter().any(|o| o == "ro") || self.super_options.iter().any(|o| o == "ro")
    }
}

/// A mount instance: the kernel's mount id (as in mountinfo's first field
/// and `statx`'s `STATX_MNT_ID`) and the `major:minor` of its filesystem.
/// Ids are reused after an unmount, so both are compared; the same pair
/// at the same path again is that device mounted there again (a disk
/// swapped under the same minor is caught by the disk-node check of stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MountIdentity {
    pub id: u64,
    pub dev: (u32, u32),
}

/// The identity of the mount whose root is exactly `path`, from one
/// `statx` (no walk of the mount table). None when `path` is not a mount
/// point (or a symlink), cannot be reached, or the kernel does not report
/// mount ids and mount roots (before Linux 5.8).
pub fn mount_identity(path: &Path) -> Option<MountIdentity> {
    use rustix::fs::{AtFlags, CWD, StatxAttributes, StatxFlags};
    let st = rustix::fs::statx(
        CWD,
        path,
        AtFlags::NO_AUTOMOUNT | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::MNT_ID,
    )
    .ok()?;
    let root = StatxAttributes::MOUNT_ROOT;
    let known = StatxFlags::from_bits_retain(st.stx_mask).contains(StatxFlags::MNT_ID)
        && st.stx_attributes_mask.contains(root);
    (known && st.stx_attributes.contains(root)).then_some(MountIdentity {
        id: st.stx_mnt_id,
        dev: (st.stx_dev_major, st.stx_dev_minor),
    })
}

impl From<crust_mountinfo::MountEntry> for MountEntry {
    fn from(e: crust_mountinfo::MountEntry) -> Self {
        MountEntry {
            identity: MountIdentity {
                id: e.mount_id.into(),
                dev: (e.major, e.minor),
            },
            root: e.root.to_string_lossy().into_owned(),
            mount_point: e.mount_point,
            fstype: e.fs_type,
            source: e.source,
            mount_options: e.mount_options,
            super_options: e.super_options,
        }
    }
}

/// Parses mountinfo text with `crust-mountinfo`, skipping a line it
/// refuses: one odd mount must not hide every other from the agent.
pub fn parse_mountinfo(text: impl AsRef<[u8]>) -> Vec<MountEntry> {
    crust_mountinfo::entries(text.as_ref())
        .filter_map(Result::ok)
        .map(MountEntry::from)
        .collect()
}

/// Current mount table of this process's namespace.
pub fn mounts() -> Vec<MountEntry> {
    // Bytes: a mount point the kernel prints unescaped need not be UTF-8.
    std::fs::read("/proc/self/mountinfo")
        .map(parse_mountinfo)
        .unwrap_or_default()
}

/// The topmost mount at exactly `path`.
pub fn mount_at(path: &Path) -> Option<MountEntry> {
    mounts().into_iter().rev().find(|m| m.mount_point == path)
}

/// A virtio disk as the guest sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disk {
    /// Kernel name, e.g. `vdb`.
    pub name: String,
    pub serial: String,
}

impl Disk {
    pub fn dev_path(&self) -> PathBuf {
        Path::new("/dev").join(&self.name)
    }
}

/// virtio-blk serial of `/sys/block/<name>`, without padding.
pub fn disk_serial(name: &str) -> Option<String> {
    let raw = std::fs::read(Path::new("/sys/block").join(name).join("serial")).ok()?;
    let s = String::from_utf8_lossy(&raw);
    Some(s.trim_end_matches(['\0', '\n', ' ']).to_owned())
}

/// Identity of the disk's sysfs node (the inode of `/sys/block/<name>`,
/// unique per device instance: a disk removed and another attached under
/// the same name get different ones). None when no such disk exists.
pub fn disk_node(name: &str) -> Option<u64> {
    rustix::fs::stat(Path::new("/sys/block").join(name))
        .ok()
        .map(|st| st.st_ino)
}

/// Every virtio disk currently present.
pub fn disks() -> Vec<Disk> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/sys/block") {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with("vd") {
                continue;
            }
            if let Some(serial) = disk_serial(&name) {
                out.push(Disk { name, serial });
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Waits (polling) until a disk with `serial` shows up or `until` passes;
/// a hot-plugged disk takes a moment to be probed.
pub fn wait_for_disk(serial: &str, until: Instant) -> Result<Disk, Vec<Disk>> {
    loop {
        let all = disks();
        if let Some(d) = all.iter().find(|d| d.serial == serial) {
            return Ok(d.clone());
        }
        if Instant::now() >= until {
            return Err(all);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Disk size in bytes from `/sys/block/<name>/size` (512-byte sectors).
pub fn disk_bytes(name: &str) -> Option<u64> {
    let s = std::fs::read_to_string(Path::new("/sys/block").join(name).join("size")).ok()?;
    s.trim().parse::<u64>().ok().map(|n| n * 512)
}

/// Whether the disk itself is read-only (attached with `read-only=on`).
pub fn disk_readonly(name: &str) -> bool {
    std::fs::read_to_string(Path::new("/sys/block").join(name).join("ro"))
        .map(|s| s.trim() == "1")
        .unwrap_or(false)
}

/// Which of our filesystems a superblock holds, by magic number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detected {
    Fs(FsType),
    Unknown,
}

/// Reads the start of `dev` and tells its filesystem by magic
/// ([`detect_fs_bytes`]).
pub fn detect_fs(dev: &Path) -> std::io::Result<Detected> {
    let mut f = std::fs::File::open(dev)?;
    let mut buf = vec![0u8; crust_fs::SUPERBLOCK_HEAD];
    let mut got = 0;
    while got < buf.len() {
        let n = f.read(&mut buf[got..])?;
        if n == 0 {
            break;
        }
        got += n;
    }
    Ok(detect_fs_bytes(&buf[..got]))
}

/// The filesystem whose magic the start of a device carries
/// ([`crust_fs::detect`]: by magic alone, so an ext2/3 superblock counts
/// as ext4, which mounts it).
pub fn detect_fs_bytes(b: &[u8]) -> Detected {
    crust_fs::detect(b).map_or(Detected::Unknown, Detected::Fs)
}

/// The last few kernel log lines mentioning `needle`, for error messages.
pub fn kmsg_tail(needles: &[&str], max: usize) -> Vec<String> {
    let Ok(fd) = rustix::fs::open(
        "/dev/kmsg",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) else {
        return Vec::new();
    };
    let mut lines: Vec<String> = Vec::new();
    let mut buf = vec![0u8; 8192];
    loop {
        match rustix::io::read(&fd, &mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]);
                let msg = rec.split_once(';').map(|(_, m)| m).unwrap_or(&rec);
                let msg = msg.lines().next().unwrap_or("").trim();
                if needles.iter().any(|n| msg.contains(n)) {
                    lines.push(msg.to_owned());
                    if lines.len() > max {
                        lines.remove(0);
                    }
                }
            }
            // EPIPE: a record was overwritten while reading; keep going.
            Err(rustix::io::Errno::PIPE) | Err(rustix::io::Errno::INTR) => continue,
            Err(_) => break,
        }
    }
    lines
}

/// Whether the kernel has filesystem `name` registered.
pub fn filesystem_registered(name: &str) -> bool {
    std::fs::read_to_string("/proc/filesystems")
        .map(|t| t.lines().any(|l| l.split_whitespace().last() == Some(name)))
        .unwrap_or(false)
}

/// Makes sure the kernel knows `fs`, loading the modules the image lists in
/// `/etc/modules.d/<fs>` (dependency order) on first use: they are not
/// loaded at boot because loading xfs costs more than a second under TCG.
pub fn ensure_filesystem(fs: FsType) -> Result<(), String> {
    ensure_filesystem_named(fs.as_str())
}

/// [`ensure_filesystem`] by the name `/proc/filesystems` shows (`virtiofs`).
pub fn ensure_filesystem_named(name: &str) -> Result<(), String> {
    if filesystem_registered(name) {
        return Ok(());
    }
    let list_path = Path::new("/etc/modules.d").join(name);
    let list = std::fs::read_to_string(&list_path).map_err(|e| {
        format!(
            "the guest kernel has no {name} support and {} is unreadable: {e}",
            list_path.display()
        )
    })?;
    load_modules(&list)?;
    if filesystem_registered(name) {
        Ok(())
    } else {
        Err(format!(
            "{name} still unknown to the kernel after loading {}",
            list.trim()
        ))
    }
}

/// Unpacks the image's optional payload `/usr/lib/crust/<name>.cpio.gz`
/// (programs, libraries, modules and their `/etc/modules.d` list) onto
/// the guest's root, once: kept packed, it costs nothing at boot.
pub fn unpack_payload(name: &str) -> Result<(), String> {
    let done = Path::new("/run/crust").join(format!("{name}.unpacked"));
    if done.exists() {
        return Ok(());
    }
    // The agent and the kernel's modprobe may both want it at once: one
    // unpacks, the other waits and finds it done.
    let _ = std::fs::create_dir_all("/run/crust");
    let lock_path = Path::new("/run/crust").join(format!("{name}.lock"));
    let lock =
        std::fs::File::create(&lock_path).map_err(|e| format!("{}: {e}", lock_path.display()))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| format!("locking {}: {e}", lock_path.display()))?;
    if done.exists() {
        return Ok(());
    }
    let archive = format!("/usr/lib/crust/{name}.cpio.gz");
    if !Path::new(&archive).exists() {
        return Err(format!("the guest image has no {archive}"));
    }
    let out = std::process::Command::new("/bin/busybox")
        .args([
            "sh",
            "-c",
            &format!("cd / && gunzip -c {archive} | cpio -idmu"),
        ])
        .output()
        .map_err(|e| format!("unpacking {archive}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "unpacking {archive}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    std::fs::write(&done, b"").map_err(|e| format!("{}: {e}", done.display()))
}

/// Loads the modules the image lists in `/etc/modules.d/<group>`, in
/// order (a group that is not a filesystem: `netfilter`); ones already
/// loaded are fine.
pub fn load_module_group(group: &str) -> Result<(), String> {
    let list_path = Path::new("/etc/modules.d").join(group);
    let list = std::fs::read_to_string(&list_path)
        .map_err(|e| format!("{} is unreadable: {e}", list_path.display()))?;
    load_modules(&list)
}

fn load_modules(list: &str) -> Result<(), String> {
    for m in list.split_whitespace() {
        let ko = Path::new("/lib/modules").join(format!("{m}.ko"));
        let f = std::fs::File::open(&ko).map_err(|e| format!("opening {}: {e}", ko.display()))?;
        match rustix::system::finit_module(&f, c"", 0) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(format!("loading kernel module {m}: {e}")),
        }
    }
    Ok(())
}

/// Reads a small sysfs attribute, trimmed.
///
/// For sysfs attributes (and regular files): a short read is taken as the
/// end, which a /proc file does not promise. Invalid UTF-8 is replaced,
/// not refused.
pub fn read_attr(path: impl AsRef<Path>) -> Option<String> {
    // open, read, close: `fs::read_to_string` also stats the file and reads
    // once more for EOF, two syscalls that cost ~50 µs in an emulated guest
    // on every stats poll. A sysfs attribute fits one page and comes whole
    // in the first read; a longer file is read on to its end.
    let fd = rustix::fs::open(
        path.as_ref(),
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .ok()?;
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    loop {
        match rustix::io::read(&fd, &mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => {
                len += n;
                if len < buf.len() {
                    break;
                }
                buf.resize(buf.len() * 2, 0);
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return None,
        }
    }
    Some(String::from_utf8_lossy(&buf[..len]).trim().to_owned())
}

/// Freezes the filesystem `dir` (an open directory on it) belongs to:
/// flushes it and blocks new writes until [`thaw_fs`].
pub fn freeze_fs(dir: &rustix::fd::OwnedFd) -> rustix::io::Result<()> {
    crust_sys::fs::freeze(dir).map_err(errno)
}

/// Thaws the filesystem `dir` belongs to; EINVAL when it is not frozen.
pub fn thaw_fs(dir: &rustix::fd::OwnedFd) -> rustix::io::Result<()> {
    crust_sys::fs::thaw(dir).map_err(errno)
}

fn errno(e: std::io::Error) -> rustix::io::Errno {
    rustix::io::Errno::from_io_error(&e).unwrap_or(rustix::io::Errno::IO)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `mountinfo` fuzz target: `\400` overflowed the octal
    /// decoder's u8 arithmetic (a panic in the agent). An escape above
    /// `\377` is now kept as text, as the host's parser keeps it.
    #[test]
    fn mountinfo_escape_above_377_is_text() {
        let crash = b"24\x00\x00\x00254:0 / / rw,\x5c011x rw,nosuid shared:5 m\x12aster:2 - ext4 /dev/l 3pooro,errors=remount-ro\x0a38 22 7:4 /sub /mnt/back\x5c400\x5c\x5cslash rw - xfs /dev/loop4 rw,atwr2\x0a";
        let text = std::str::from_utf8(crash).unwrap();
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].mount_point, Path::new("/mnt/back\\400\\\\slash"));
        // The path's own bytes (no lossy UTF-8): `\376` and `\377`
        // are two mount points, not one.
        let m = parse_mountinfo("1 2 3:4 / /a\\777\\377\\040 rw - ext4 /dev/x rw\n");
        assert_eq!(
            m[0].mount_point.as_os_str().as_encoded_bytes(),
            b"/a\\777\xff "
        );
    }

    #[test]
    fn mountinfo_parsing() {
        let text = "22 1 0:5 / / rw,relatime - rootfs rootfs rw\n\
                    30 22 254:16 / /run/crust/volumes/v1 rw,noatime - ext4 /dev/vdb rw,errors=remount-ro\n\
                    31 22 254:16 /data/app /data ro,noatime shared:1 - ext4 /dev/vdb rw\n\
                    32 22 254:32 / /mnt/with\\040space ro - xfs /dev/vdc ro,attr2\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 4);
        assert_eq!(m[1].mount_point, Path::new("/run/crust/volumes/v1"));
        assert_eq!(m[1].source, "/dev/vdb");
        assert_eq!(m[1].fstype, "ext4");
        assert!(m[1].mount_options.contains(&"noatime".to_string()));
        assert!(
            m[1].super_options
                .contains(&"errors=remount-ro".to_string())
        );
        assert!(!m[1].is_readonly());
        assert_eq!(m[2].root, "/data/app");
        assert!(m[2].is_readonly());
        assert_eq!(m[3].mount_point, Path::new("/mnt/with space"));
        assert!(m[3].is_readonly());
        assert_eq!(
            m[1].identity,
            MountIdentity {
                id: 30,
                dev: (254, 16)
            }
        );
        assert_eq!(m[3].identity.dev, (254, 32));
        // A line without a numeric id or device is skipped, not misread.
        assert!(parse_mountinfo("x 1 0:5 / /a rw - ext4 /dev/vdb rw\n").is_empty());
        assert!(parse_mountinfo("7 1 05 / /a rw - ext4 /dev/vdb rw\n").is_empty());
    }

    #[test]
    fn a_bad_or_non_utf8_line_hides_no_other_mount() {
        // The kernel does not escape bytes above 0x7f; a bad line between
        // good ones is skipped alone.
        let text = b"1 0 0:1 / / rw - rootfs rootfs rw\n\
                     2 1 0:2 / /odd\xff rw - tmpfs tmpfs rw\n\
                     3 1 0:3 / /broken rw ext4 /dev/vdb rw\n\
                     4 1 254:16 / /run/crust/volumes/v1 ro - ext4 /dev/vdb rw\n";
        let m = parse_mountinfo(text);
        let ids: Vec<u64> = m.iter().map(|e| e.identity.id).collect();
        assert_eq!(ids, [1, 2, 4]);
        assert_eq!(m[1].mount_point.as_os_str().as_encoded_bytes(), b"/odd\xff");
        assert!(m[2].is_readonly());
    }

    #[test]
    fn attributes_are_read_whole_and_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, "3\n").unwrap();
        assert_eq!(read_attr(&short).as_deref(), Some("3"));
        // Longer than the first read's page: read on to the end.
        let long = dir.path().join("long");
        let text = "x".repeat(4096) + "yz";
        std::fs::write(&long, format!("{text}\n")).unwrap();
        assert_eq!(read_attr(&long), Some(text));
        let exact = dir.path().join("exact");
        std::fs::write(&exact, "a".repeat(4096)).unwrap();
        assert_eq!(read_attr(&exact).map(|s| s.len()), Some(4096));
        assert_eq!(read_attr(dir.path().join("missing")), None);
        // A real sysfs attribute, where there is one.
        if let Some(n) = read_attr("/sys/kernel/mm/transparent_hugepage/enabled") {
            assert!(n.contains('['), "{n}");
        }
    }

    #[test]
    fn mount_identity_agrees_with_the_mount_table() {
        // The root of this process's namespace is in the table under the
        // id statx reports for it (only the id: on btrfs a stat's device
        // is the subvolume's, not the one mountinfo names).
        let table = mounts();
        let top = table.iter().rev().find(|m| m.mount_point == Path::new("/"));
        if let (Some(id), Some(top)) = (mount_identity(Path::new("/")), top) {
            assert_eq!(top.identity.id, id.id);
        }
        assert_eq!(mount_identity(Path::new("/nonexistent/crust")), None);
        // A directory that is not a mount root has no identity of its own.
        let dir = tempfile::tempdir().unwrap();
        if table.iter().all(|m| m.mount_point != dir.path()) {
            assert_eq!(mount_identity(dir.path()), None);
        }
    }

    #[test]
    fn fs_magic() {
        let mut b = vec![0u8; 2048];
        assert_eq!(detect_fs_bytes(&b), Detected::Unknown);
        b[1080] = 0x53;
        b[1081] = 0xEF;
        assert_eq!(detect_fs_bytes(&b), Detected::Fs(FsType::Ext4));
        b[..4].copy_from_slice(b"XFSB");
        assert_eq!(detect_fs_bytes(&b), Detected::Fs(FsType::Xfs));
        assert_eq!(detect_fs_bytes(&[]), Detected::Unknown);
    }
}
