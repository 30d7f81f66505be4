//! Checks shared by the write and the read side. Each returns a reason
//! string; the caller decides whether that is the caller's fault
//! (InvalidArgument) or the record's (BadRecord).

use std::collections::BTreeMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

// The fsGroup value's format lives with its key; its old path stays.
pub use crate::mountinfo::parse_fs_group;
use crate::mountinfo::{
    ENCRYPTION_KEY_KEY, FS_GROUP_CHANGE_POLICY_KEY, FS_GROUP_KEY, FsGroupChangePolicy, MountInfo,
};

/// Longest path accepted anywhere (PATH_MAX).
pub const MAX_PATH_LEN: usize = 4096;
/// Longest single mount option.
pub const MAX_OPTION_LEN: usize = 256;
/// Longest sum of all mount options.
pub const MAX_OPTIONS_TOTAL: usize = 4096;
/// Longest sandbox id.
pub const MAX_SANDBOX_ID_LEN: usize = 128;

/// Names a sandbox id may never take: they are the record's own files.
const RESERVED_NAMES: [&str; 2] = ["mountInfo.json", "runtime-cli"];

/// Substrings (lower-cased) of a mount option that suggest a credential.
/// Records are persisted, so such an option must never reach disk.
const SECRET_MARKERS: [&str; 11] = [
    "password",
    "passwd",
    "pass=",
    "pwd",
    "secret",
    "cred",
    "token",
    "key=",
    "username=",
    "user=",
    "auth",
];

/// An absolute, lexically normalized path: no `.`/`..` components, no
/// empty components (`//`), no trailing `/`, no control characters, not
/// `/` itself, at most [`MAX_PATH_LEN`] bytes.
pub fn check_abs_path(what: &str, p: &str) -> Result<(), String> {
    if p.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if p.len() > MAX_PATH_LEN {
        return Err(format!("{what} is longer than {MAX_PATH_LEN} bytes"));
    }
    if !p.starts_with('/') {
        return Err(format!("{what} {p:?} is not absolute"));
    }
    if p == "/" {
        return Err(format!("{what} must not be /"));
    }
    if p.chars().any(|c| c.is_control()) {
        return Err(format!("{what} {p:?} contains a control character"));
    }
    for comp in p[1..].split('/') {
        match comp {
            "" => {
                return Err(format!(
                    "{what} {p:?} is not normalized (empty component or trailing /)"
                ));
            }
            "." | ".." => return Err(format!("{what} {p:?} is not normalized ({comp} component)")),
            _ => {}
        }
    }
    Ok(())
}

/// A relative normalized path (used for subpaths); empty means none.
pub fn check_rel_path(p: &str) -> Result<(), String> {
    if p.is_empty() {
        return Ok(());
    }
    check_abs_path("subpath", &format!("/{p}"))
}

/// `true` when `path` is `prefix` or lies beneath it (component-wise).
pub fn is_within(path: &str, prefix: &str) -> bool {
    Path::new(path).starts_with(Path::new(prefix))
}

/// `path` with its longest existing ancestor resolved (symlinks
/// followed) and the rest appended as written. A path whose existing part
/// cannot be resolved is returned unchanged.
pub fn resolve_existing(path: &str) -> String {
    let p = Path::new(path);
    let mut existing = p;
    let mut rest: Vec<&std::ffi::OsStr> = Vec::new();
    loop {
        if let Ok(real) = std::fs::canonicalize(existing) {
            let mut out = real;
            for c in rest.iter().rev() {
                out.push(c);
            }
            return out
                .to_str()
                .map(str::to_string)
                .unwrap_or_else(|| path.to_string());
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name);
                existing = parent;
            }
            _ => return path.to_string(),
        }
    }
}

/// Sandbox ids become file names: `[A-Za-z0-9][A-Za-z0-9_.-]{0,127}`,
/// never one of the record's own file names.
pub fn check_sandbox_id(id: &str) -> Result<(), String> {
    let b = id.as_bytes();
    let ok_first = b.first().is_some_and(|c| c.is_ascii_alphanumeric());
    let ok_rest = b
        .iter()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'));
    if !ok_first || !ok_rest || b.len() > MAX_SANDBOX_ID_LEN {
        return Err(format!(
            "sandbox id {id:?} must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,127}}"
        ));
    }
    if RESERVED_NAMES.contains(&id) {
        return Err(format!("sandbox id {id:?} is a reserved name"));
    }
    Ok(())
}

/// `block`, `directvol` (Kata's Rust runtime, Azure Disk: the same), or
/// none at all (Kata's Go runtime does not look at it).
pub fn check_volume_type(t: &str) -> Result<(), String> {
    match t {
        "block" | "directvol" | "" => Ok(()),
        "network" => Err(
            "volume-type \"network\" is not supported: crust hands off block devices only".into(),
        ),
        other => Err(format!(
            "volume-type {other:?} is unknown (only \"block\" or \"directvol\" is supported)"
        )),
    }
}

pub fn check_fstype(fstype: &str, allowed: &[String]) -> Result<(), String> {
    if allowed.iter().any(|a| a == fstype) {
        Ok(())
    } else {
        Err(format!(
            "fstype {fstype:?} is not allowed (allowed: {})",
            allowed.join(", ")
        ))
    }
}

/// Mount options travel to the guest and are persisted: a conservative
/// charset, bounded sizes, and nothing that looks like a credential.
pub fn check_options(options: &[String]) -> Result<(), String> {
    let mut total = 0usize;
    for o in options {
        if o.is_empty() {
            return Err("empty mount option".into());
        }
        if o.len() > MAX_OPTION_LEN {
            return Err(format!("mount option longer than {MAX_OPTION_LEN} bytes"));
        }
        total += o.len();
        if total > MAX_OPTIONS_TOTAL {
            return Err(format!(
                "mount options exceed {MAX_OPTIONS_TOTAL} bytes in total"
            ));
        }
        let lower = o.to_ascii_lowercase();
        // Checked before the charset so the message never echoes a secret.
        if SECRET_MARKERS.iter().any(|m| lower.contains(m)) {
            return Err(
                "a mount option looks like a credential; secrets must never be persisted in a hand-off record"
                    .into(),
            );
        }
        if let Some(c) = o.chars().find(|c| {
            !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '=' | ':' | '/' | '+'))
        }) {
            return Err(format!(
                "mount option {o:?} contains {c:?} (allowed: A-Z a-z 0-9 _ . - = : / +)"
            ));
        }
    }
    Ok(())
}

/// Only the keys crust (and Kata) understand, with checked values.
pub fn check_metadata(md: &BTreeMap<String, String>) -> Result<(), String> {
    for (k, v) in md {
        match k.as_str() {
            FS_GROUP_KEY => {
                parse_fs_group(v)?;
            }
            FS_GROUP_CHANGE_POLICY_KEY => {
                FsGroupChangePolicy::parse(v)?;
            }
            ENCRYPTION_KEY_KEY => return Err(encryption_refused()),
            crate::qos::IO_LIMITS_KEY => {
                crate::qos::IoLimits::from_wire(v).map_err(|e| e.to_string())?;
            }
            crate::mountinfo::DEVICE_IDENTITY_KEY => {
                v.parse::<crust_blockdev::DeviceIdentity>()?;
            }
            other => {
                return Err(format!(
                    "metadata key {other:?} is not allowed (allowed: {FS_GROUP_KEY}, \
                     {FS_GROUP_CHANGE_POLICY_KEY}, {}, {})",
                    crate::qos::IO_LIMITS_KEY,
                    crate::mountinfo::DEVICE_IDENTITY_KEY
                ));
            }
        }
    }
    Ok(())
}

fn encryption_refused() -> String {
    format!(
        "metadata key {ENCRYPTION_KEY_KEY:?} is not allowed: crust does not encrypt volumes, and \
         a key must never be stored in a hand-off record; refusing the record"
    )
}

/// The metadata of a record being read, as Kata reads it. Per key, what
/// is fatal and what is not:
///
/// | key | unusable value | why |
/// |---|---|---|
/// | `encryptionKey` (any case) | always refused | crust cannot honour it; mounting unencrypted would be a silent downgrade, and a key must never be on disk |
/// | `fsGroup` | ignored, warned ([`metadata_warnings`]) | Kata's Go runtime logs and skips it; the volume works without a group change |
/// | `fsGroupChangePolicy` | ignored, warned | as Kata: meaningless without a usable `fsGroup` |
/// | `createFilesystem` | ignored (nothing formatted), warned | as Kata (`strconv.ParseBool` fails: skipped); not formatting is the safe side |
/// | any other key | ignored | Kata's CSI driver copies the whole volume context here |
///
/// The device, fstype, volume type and options are checked elsewhere and
/// are always fatal: without them there is nothing safe to mount.
pub fn check_metadata_read(mi: &MountInfo) -> Result<(), String> {
    if mi
        .metadata
        .keys()
        .any(|k| k.eq_ignore_ascii_case(ENCRYPTION_KEY_KEY))
    {
        return Err(encryption_refused());
    }
    Ok(())
}

/// What a reader ignores in a record's metadata, one sentence each (see
/// the table at [`check_metadata_read`]); the runtime logs them.
pub fn metadata_warnings(mi: &MountInfo) -> Vec<String> {
    let mut out = Vec::new();
    let group = mi.metadata.get(FS_GROUP_KEY);
    if let Some(v) = group
        && let Err(e) = parse_fs_group(v)
    {
        out.push(format!(
            "metadata {e}: ignored, the volume is mounted without a group change"
        ));
    }
    if let Some(v) = mi.metadata.get(FS_GROUP_CHANGE_POLICY_KEY) {
        if let Err(e) = FsGroupChangePolicy::parse(v) {
            out.push(format!("metadata {e}: ignored"));
        } else if group.is_none() {
            out.push(format!(
                "metadata {FS_GROUP_CHANGE_POLICY_KEY} without {FS_GROUP_KEY}: ignored"
            ));
        }
    }
    if let Err(e) = mi.create_filesystem() {
        out.push(format!("{e}: ignored, nothing is formatted"));
    }
    out
}

/// A device is a block device under /dev, or — only when the policy lists
/// roots for it — a regular file beneath one of those roots that
/// [`open_file_device`] accepts. Symlinks to a block device are resolved
/// and the resolved path is checked again, so /dev/disk/by-id links work
/// but cannot lead elsewhere; a file device is never reached through one.
/// `setting` names the setting that lists the roots, for the refusal.
pub fn check_device(dev: &str, file_device_roots: &[PathBuf], setting: &str) -> Result<(), String> {
    check_abs_path("device", dev)?;
    let meta = std::fs::symlink_metadata(dev).map_err(|e| format!("device {dev:?}: {e}"))?;
    if meta.file_type().is_file() || meta.file_type().is_symlink() && Path::new(dev).is_file() {
        return open_file_device(dev, file_device_roots, setting, false).map(drop);
    }
    let meta = std::fs::metadata(dev).map_err(|e| format!("device {dev:?}: {e}"))?;
    let real = std::fs::canonicalize(dev).map_err(|e| format!("device {dev:?}: {e}"))?;
    if meta.file_type().is_block_device() {
        if dev.starts_with("/dev/") && real.starts_with("/dev") {
            return Ok(());
        }
        return Err(format!("device {dev:?} is a block device outside /dev"));
    }
    Err(format!(
        "device {dev:?} is neither a block device nor an allowed regular file"
    ))
}

/// THE rule for a regular file used as a volume's disk (Kata's CSI driver
/// backs volumes with `<storage>/<volume id>/directvol-rawdisk.<size>`),
/// returning the file opened (read-write when `writable`) so that the
/// caller hands QEMU this descriptor and nobody looks the path up again.
///
/// The path must lie beneath one of `roots` (lexically; `setting` names
/// where they are configured), and is walked from `/` one component at a
/// time with `O_NOFOLLOW`: no symlink anywhere. Every directory on it
/// must be owned by root (or by us) and writable by nobody else, except
/// a root-owned sticky directory such as `/tmp` (Kata's deployment keeps
/// its files under `/tmp/kata-directvol-storages`): there others may add
/// entries but cannot rename or replace root's. The file itself must be
/// owned by root (or us) and not group- or world-writable. Anyone who
/// could write along the path could otherwise swap another file (a host
/// disk image, a secret) in between the check and QEMU's open.
pub fn open_file_device(
    dev: &str,
    roots: &[PathBuf],
    setting: &str,
    writable: bool,
) -> Result<std::os::fd::OwnedFd, String> {
    use rustix::fs::{FileType, Mode, OFlags};
    check_abs_path("device", dev)?;
    let listed = || {
        if roots.is_empty() {
            "none configured".to_string()
        } else {
            roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let within = roots.iter().any(|r| {
        let r = Path::new(r.to_str().unwrap_or_default().trim_end_matches('/'));
        Path::new(dev).starts_with(r) && Path::new(dev) != r
    });
    if !within {
        return Err(format!(
            "device {dev:?} is a regular file outside the configured file-device roots \
             ({}); set {setting} to serve files there",
            listed()
        ));
    }
    let euid = rustix::process::geteuid().as_raw();
    let trusted = |st: &rustix::fs::Stat, what: &str, p: &str| -> Result<(), String> {
        if st.st_uid != 0 && st.st_uid != euid {
            return Err(format!(
                "device {dev:?}: {what} {p:?} is owned by uid {}, not root",
                st.st_uid
            ));
        }
        let sticky_root_dir = what == "directory" && st.st_mode & 0o1000 != 0 && st.st_uid == 0;
        if st.st_mode & 0o022 != 0 && !sticky_root_dir {
            return Err(format!(
                "device {dev:?}: {what} {p:?} is writable by group or others (mode {:o})",
                st.st_mode & 0o7777
            ));
        }
        Ok(())
    };
    let fail = |p: &str, e: rustix::io::Errno| {
        if e == rustix::io::Errno::LOOP || e == rustix::io::Errno::NOTDIR {
            format!(
                "device {dev:?}: {p:?} is a symlink or not a directory; file devices are never reached through symlinks"
            )
        } else {
            format!("device {dev:?}: opening {p:?}: {e}")
        }
    };
    let dir_flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut dir = rustix::fs::open("/", dir_flags, Mode::empty()).map_err(|e| fail("/", e))?;
    let st = rustix::fs::fstat(&dir).map_err(|e| fail("/", e))?;
    trusted(&st, "directory", "/")?;
    let comps: Vec<&str> = dev[1..].split('/').collect();
    let (name, parents) = comps.split_last().expect("check_abs_path: not /");
    let mut walked = String::new();
    for c in parents {
        walked.push('/');
        walked.push_str(c);
        dir =
            rustix::fs::openat(&dir, *c, dir_flags, Mode::empty()).map_err(|e| fail(&walked, e))?;
        let st = rustix::fs::fstat(&dir).map_err(|e| fail(&walked, e))?;
        trusted(&st, "directory", &walked)?;
    }
    let access = if writable {
        OFlags::RDWR
    } else {
        OFlags::RDONLY
    };
    let fd = rustix::fs::openat(
        &dir,
        *name,
        access | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| fail(dev, e))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| fail(dev, e))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(format!("device {dev:?} is not a regular file"));
    }
    trusted(&st, "file", dev)?;
    // Back to blocking I/O for QEMU.
    rustix::fs::fcntl_setfl(&fd, access).map_err(|e| fail(dev, e))?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abs_paths() {
        for ok in [
            "/a",
            "/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/pv/mount",
            "/a b/c",
        ] {
            assert_eq!(check_abs_path("p", ok), Ok(()), "{ok}");
        }
        for bad in [
            "", "/", "a/b", "/a/", "/a//b", "/a/./b", "/a/../b", "/..", "/.", "/a\0b", "/a\nb",
        ] {
            assert!(check_abs_path("p", bad).is_err(), "{bad:?}");
        }
        let long = format!("/{}", "a".repeat(MAX_PATH_LEN));
        assert!(check_abs_path("p", &long).unwrap_err().contains("longer"));
        let max = format!("/{}", "a".repeat(MAX_PATH_LEN - 1));
        assert_eq!(check_abs_path("p", &max), Ok(()));
    }

    #[test]
    fn sandbox_ids() {
        for ok in ["a", "0", "c9be9e-1_2.x", &"a".repeat(128)] {
            assert_eq!(check_sandbox_id(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            ".hidden",
            "-x",
            "_x",
            "a/b",
            "..",
            "a b",
            "mountInfo.json",
            "runtime-cli",
            &"a".repeat(129),
            "é",
            "a\0",
        ] {
            assert!(check_sandbox_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn options_charset_sizes_and_secrets() {
        let ok: Vec<String> = [
            "noatime",
            "data=ordered",
            "errors=remount-ro",
            "logbsize=256k",
            "nouser_xattr",
            "commit=5",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(check_options(&ok), Ok(()));
        for secret in [
            "password=hunter2",
            "PASSWD=x",
            "pass=x",
            "secret=x",
            "credentials=/x",
            "token=abc",
            "key=abc",
            "username=bob",
            "user=bob",
            "AuthMethod=x",
            "Sec_Key=1",
            "pwd=x",
        ] {
            let e = check_options(&[secret.to_string()]).unwrap_err();
            assert!(e.contains("credential"), "{secret}: {e}");
            assert!(!e.contains(secret), "the message must not echo the secret");
        }
        for bad in ["a,b", "a b", "a\"b", "", "a;b", "$(x)"] {
            assert!(check_options(&[bad.to_string()]).is_err(), "{bad:?}");
        }
        assert!(check_options(&["a".repeat(257)]).is_err());
        assert_eq!(check_options(&["a".repeat(256)]), Ok(()));
        let many = vec!["a".repeat(200); 21];
        assert!(check_options(&many).unwrap_err().contains("total"));
    }

    #[test]
    fn metadata_allow_list() {
        let md = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        assert_eq!(check_metadata(&md("fsGroup", "100")), Ok(()));
        assert_eq!(check_metadata(&md("fsGroup", "0")), Ok(()));
        assert_eq!(check_metadata(&md("fsGroup", "4294967295")), Ok(()));
        assert_eq!(check_metadata(&md("fsGroupChangePolicy", "Always")), Ok(()));
        assert_eq!(
            check_metadata(&md("fsGroupChangePolicy", "OnRootMismatch")),
            Ok(())
        );
        assert_eq!(
            check_metadata(&md("deviceIdentity", "file:259:1:1234:99")),
            Ok(())
        );
        for (k, v) in [
            ("deviceIdentity", "file:1:2"),
            ("deviceIdentity", "disk:x"),
            ("fsGroup", "4294967296"),
            ("fsGroup", "-1"),
            ("fsGroup", "+1"),
            ("fsGroup", "010"),
            ("fsGroup", ""),
            ("fsGroup", "1e3"),
            ("fsGroupChangePolicy", "always"),
            ("fsGroupChangePolicy", "Never"),
            ("encryptionKey", "x"),
            ("createFilesystem", "true"),
        ] {
            assert!(check_metadata(&md(k, v)).is_err(), "{k}={v}");
        }
    }

    #[test]
    fn metadata_as_kata_reads_it() {
        let rec = |pairs: &[(&str, &str)]| {
            let mut mi = MountInfo::block("/dev/x", "ext4");
            for (k, v) in pairs {
                mi.metadata.insert(k.to_string(), v.to_string());
            }
            mi
        };
        for ok in [
            &[("fsGroup", "100"), ("fsGroupChangePolicy", "Always")][..],
            &[("createFilesystem", "true")],
            &[("createFilesystem", "0")],
            &[("someDriverKey", "x"), ("fsGroup", "1")],
        ] {
            assert_eq!(check_metadata_read(&rec(ok)), Ok(()), "{ok:?}");
        }
        for (bad, why) in [
            (&[("encryptionKey", "ephemeral")][..], "must never"),
            (&[("EncryptionKey", "x")], "must never"),
        ] {
            let e = check_metadata_read(&rec(bad)).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        // Unusable non-essential values: read, ignored, and said so.
        for (odd, why) in [
            (&[("createFilesystem", "yes")][..], "not a boolean"),
            (&[("fsGroup", "wheel")], "decimal"),
            (
                &[("fsGroup", "abc"), ("fsGroupChangePolicy", "Always")],
                "decimal",
            ),
            (
                &[("fsGroup", "1"), ("fsGroupChangePolicy", "Never")],
                "Always",
            ),
            (&[("fsGroupChangePolicy", "Always")], "without fsGroup"),
        ] {
            let mi = rec(odd);
            assert_eq!(check_metadata_read(&mi), Ok(()), "{odd:?}");
            let w = metadata_warnings(&mi);
            assert_eq!(w.len(), 1, "{odd:?}: {w:?}");
            assert!(
                w[0].contains(why) && w[0].contains("ignored"),
                "{odd:?}: {w:?}"
            );
        }
        assert!(metadata_warnings(&rec(&[("fsGroup", "1"), ("x", "y")])).is_empty());
        // The write side keeps its allow-list, and says why for a key.
        let md = BTreeMap::from([("encryptionKey".to_string(), "k".to_string())]);
        assert!(check_metadata(&md).unwrap_err().contains("must never"));
    }

    #[test]
    fn volume_types_and_fstypes() {
        assert_eq!(check_volume_type("directvol"), Ok(()));
        assert_eq!(check_volume_type("block"), Ok(()));
        assert!(
            check_volume_type("network")
                .unwrap_err()
                .contains("not supported")
        );
        assert!(check_volume_type("Block").is_err());
        let allowed = vec!["ext4".to_string(), "xfs".to_string()];
        assert_eq!(check_fstype("xfs", &allowed), Ok(()));
        assert!(check_fstype("btrfs", &allowed).is_err());
        assert!(check_fstype("", &allowed).is_err());
    }

    #[test]
    fn within() {
        assert!(is_within(
            "/var/lib/kubelet/pods/x",
            "/var/lib/kubelet/pods"
        ));
        assert!(is_within("/var/lib/kubelet/pods", "/var/lib/kubelet/pods"));
        assert!(!is_within(
            "/var/lib/kubelet/podsx/y",
            "/var/lib/kubelet/pods"
        ));
        assert!(!is_within("/var/lib", "/var/lib/kubelet/pods"));
    }
}
