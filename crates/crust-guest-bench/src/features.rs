//! Native filesystem features, each exercised for real on one mount and
//! reported as works (with what was checked) or fails (with the error).
//! Probes that need a second process (locks, an ACL seen by another uid)
//! re-execute this binary in a hidden mode ([`probe_lock`], [`probe_open`]).

use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crust_sys::buf::AlignedBuf;
use crust_sys::lock::{self as posix_lock, PosixLock};
use rustix::fs::{FallocateFlags, FlockOperation, XattrFlags};
use serde_json::{Value, json};

/// Every probe, in table order: (name, what it checks).
pub const FEATURES: &[(&str, &str)] = &[
    ("o_direct", "4 KiB aligned write + read back with O_DIRECT"),
    ("xattr", "user.* set, get, list, remove"),
    (
        "posix_acl",
        "system.posix_acl_access set; uid 4242 (named in the ACL) may write a 0600 file, uid 4243 may not",
    ),
    (
        "fallocate_punch_hole",
        "fallocate 4 MiB, punch 2 MiB: blocks freed, hole reads zeros, size kept",
    ),
    (
        "flock",
        "a second process's LOCK_EX|LOCK_NB fails while held, succeeds after unlock",
    ),
    (
        "fcntl_lock",
        "a second process sees the holder with F_GETLK, F_SETLK fails while held, succeeds after unlock",
    ),
    (
        "inotify",
        "IN_CREATE, IN_MODIFY, IN_CLOSE_WRITE, IN_DELETE of a file",
    ),
    (
        "mmap_shared_write",
        "MAP_SHARED writes + msync seen by read() on another descriptor and after reopening",
    ),
];

type Probe = Result<String, String>;

fn ctx(what: &str, p: &Path) -> impl FnOnce(std::io::Error) -> String {
    let s = format!("{what} {}", p.display());
    move |e| format!("{s}: {e}")
}

fn rx(what: &str, p: &Path) -> impl FnOnce(rustix::io::Errno) -> String {
    let s = format!("{what} {}", p.display());
    move |e| format!("{s}: {}", std::io::Error::from(e))
}

/// Runs every probe in a fresh directory `dir` (removed afterwards) and
/// reports statfs of it. `exe` is this binary (for second processes).
pub fn run_all(dir: &Path, exe: &Path) -> Result<Value, String> {
    fs::create_dir(dir).map_err(ctx("mkdir", dir))?;
    // Other uids must reach the ACL probe's file.
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(ctx("chmod", dir))?;
    let mut out = Vec::new();
    for (name, checks) in FEATURES {
        let d = dir.join(name);
        let r = fs::create_dir(&d)
            .map_err(ctx("mkdir", &d))
            .and_then(|()| {
                fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).map_err(ctx("chmod", &d))
            })
            .and_then(|()| match *name {
                "o_direct" => o_direct(&d),
                "xattr" => xattr(&d),
                "posix_acl" => posix_acl(&d, exe),
                "fallocate_punch_hole" => punch_hole(&d),
                "flock" => locks(&d, exe, "flock"),
                "fcntl_lock" => locks(&d, exe, "fcntl"),
                "inotify" => inotify(&d),
                "mmap_shared_write" => mmap_shared(&d),
                _ => unreachable!(),
            });
        let _ = fs::remove_dir_all(&d);
        out.push(match r {
            Ok(detail) => json!({"name": name, "checks": checks, "ok": true, "detail": detail}),
            Err(error) => json!({"name": name, "checks": checks, "ok": false, "error": error}),
        });
    }
    let statfs = statfs(dir);
    fs::remove_dir_all(dir).map_err(ctx("rm -r", dir))?;
    Ok(json!({"features": out, "statfs": statfs?}))
}

/// statvfs figures and the CSI usage derived from them the way crust's
/// plugin and agent do (bytes: blocks/bfree/bavail × frsize).
pub fn statfs(p: &Path) -> Result<Value, String> {
    let s = rustix::fs::statvfs(p).map_err(rx("statvfs", p))?;
    Ok(json!({
        "f_bsize": s.f_bsize, "f_frsize": s.f_frsize, "f_blocks": s.f_blocks,
        "f_bfree": s.f_bfree, "f_bavail": s.f_bavail, "f_files": s.f_files, "f_ffree": s.f_ffree,
        "bytes_total": s.f_blocks * s.f_frsize,
        "bytes_used": s.f_blocks.saturating_sub(s.f_bfree) * s.f_frsize,
        "bytes_available": s.f_bavail * s.f_frsize,
        "inodes_total": s.f_files,
        "inodes_used": s.f_files.saturating_sub(s.f_ffree),
        "inodes_available": s.f_ffree,
    }))
}

fn o_direct(d: &Path) -> Probe {
    let p = d.join("direct");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .map_err(ctx("open O_DIRECT", &p))?;
    let flags = rustix::fs::fcntl_getfl(&f).map_err(rx("F_GETFL", &p))?;
    if !flags.contains(rustix::fs::OFlags::DIRECT) {
        return Err("O_DIRECT was dropped from the open file's flags".into());
    }
    let mut w = AlignedBuf::new(4096);
    for (i, b) in w.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    f.write_at(w.as_slice(), 0)
        .map_err(ctx("O_DIRECT write", &p))?;
    let mut r = AlignedBuf::new(4096);
    let n = f
        .read_at(r.as_mut_slice(), 0)
        .map_err(ctx("O_DIRECT read", &p))?;
    if n != 4096 || r.as_slice() != w.as_slice() {
        return Err(format!(
            "O_DIRECT read back {n} bytes that differ from what was written"
        ));
    }
    Ok("4096 bytes written and read back with O_DIRECT".into())
}

fn xattr(d: &Path) -> Probe {
    let p = d.join("x");
    File::create(&p).map_err(ctx("create", &p))?;
    rustix::fs::setxattr(&p, "user.crust", b"v1", XattrFlags::CREATE)
        .map_err(rx("setxattr user.crust", &p))?;
    let mut buf = [0u8; 64];
    let n = rustix::fs::getxattr(&p, "user.crust", &mut buf[..]).map_err(rx("getxattr", &p))?;
    if &buf[..n] != b"v1" {
        return Err(format!("getxattr returned {:?}", &buf[..n]));
    }
    let mut names = [0u8; 256];
    let n = rustix::fs::listxattr(&p, &mut names[..]).map_err(rx("listxattr", &p))?;
    if !names[..n].split(|b| *b == 0).any(|s| s == b"user.crust") {
        return Err("listxattr does not list user.crust".into());
    }
    rustix::fs::removexattr(&p, "user.crust").map_err(rx("removexattr", &p))?;
    match rustix::fs::getxattr(&p, "user.crust", &mut buf[..]) {
        Err(rustix::io::Errno::NODATA) => Ok("set, get, list and remove of user.crust".into()),
        other => Err(format!("after removexattr getxattr gave {other:?}")),
    }
}

/// `system.posix_acl_access` in the kernel's xattr format (version 2,
/// entries of tag u16, perm u16, id u32), sorted by tag then id.
pub fn acl_xattr(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        v.extend(tag.to_le_bytes());
        v.extend(perm.to_le_bytes());
        v.extend(id.to_le_bytes());
    }
    v
}

const ACL_USER_OBJ: u16 = 0x01;
const ACL_USER: u16 = 0x02;
const ACL_GROUP_OBJ: u16 = 0x04;
const ACL_MASK: u16 = 0x10;
const ACL_OTHER: u16 = 0x20;
const NO_ID: u32 = u32::MAX;
/// The uid the ACL names, and one it does not.
const ACL_UID: u32 = 4242;
const OTHER_UID: u32 = 4243;

fn posix_acl(d: &Path, exe: &Path) -> Probe {
    let p = d.join("acl");
    fs::write(&p, b"secret").map_err(ctx("write", &p))?;
    fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).map_err(ctx("chmod", &p))?;
    let acl = acl_xattr(&[
        (ACL_USER_OBJ, 6, NO_ID),
        (ACL_USER, 6, ACL_UID),
        (ACL_GROUP_OBJ, 0, NO_ID),
        (ACL_MASK, 6, NO_ID),
        (ACL_OTHER, 0, NO_ID),
    ]);
    rustix::fs::setxattr(&p, "system.posix_acl_access", &acl, XattrFlags::empty())
        .map_err(rx("setxattr system.posix_acl_access", &p))?;
    let mut buf = [0u8; 128];
    let n = rustix::fs::getxattr(&p, "system.posix_acl_access", &mut buf[..])
        .map_err(rx("getxattr system.posix_acl_access", &p))?;
    if buf[..n] != acl[..] {
        return Err("the ACL read back differs from the one set".into());
    }
    let named = probe_open_as(exe, &p, ACL_UID)?;
    let other = probe_open_as(exe, &p, OTHER_UID)?;
    match (named, other) {
        (Ok(()), Err(e)) => Ok(format!(
            "uid {ACL_UID} (in the ACL) opened a 0600 root file for writing; uid {OTHER_UID} got: {e}"
        )),
        (Err(e), _) => Err(format!(
            "uid {ACL_UID}, granted by the ACL, could not open: {e}"
        )),
        (Ok(()), Ok(())) => Err(format!(
            "uid {OTHER_UID} (not in the ACL) could open the file"
        )),
    }
}

/// Runs `exe probe-open PATH` as `uid`: Ok(Ok) opened for writing,
/// Ok(Err(message)) refused.
fn probe_open_as(exe: &Path, p: &Path, uid: u32) -> Result<Result<(), String>, String> {
    use std::os::unix::process::CommandExt;
    let out = Command::new(exe)
        .arg("probe-open")
        .arg(p)
        .uid(uid)
        .gid(uid)
        .output()
        .map_err(|e| format!("running {} as uid {uid}: {e}", exe.display()))?;
    match out.status.code() {
        Some(0) => Ok(Ok(())),
        Some(1) => Ok(Err(String::from_utf8_lossy(&out.stderr).trim().to_string())),
        _ => Err(format!(
            "probe-open as uid {uid} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// Hidden mode `probe-open PATH`: exit 0 when PATH opens for writing, 1
/// with the error on stderr when it does not.
pub fn probe_open(p: &Path) -> i32 {
    match OpenOptions::new().write(true).open(p) {
        Ok(_) => 0,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

fn punch_hole(d: &Path) -> Probe {
    const MIB: u64 = 1 << 20;
    let p = d.join("holes");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .map_err(ctx("create", &p))?;
    rustix::fs::fallocate(&f, FallocateFlags::empty(), 0, 4 * MIB).map_err(rx("fallocate", &p))?;
    let allocated = f.metadata().map_err(ctx("stat", &p))?.blocks() * 512;
    if allocated < 4 * MIB {
        return Err(format!("fallocate of 4 MiB allocated {allocated} bytes"));
    }
    f.write_all_at(&vec![0xa5u8; 4 * MIB as usize], 0)
        .map_err(ctx("write", &p))?;
    f.sync_all().map_err(ctx("fsync", &p))?;
    let before = f.metadata().map_err(ctx("stat", &p))?.blocks() * 512;
    rustix::fs::fallocate(
        &f,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        MIB,
        2 * MIB,
    )
    .map_err(rx("fallocate PUNCH_HOLE", &p))?;
    f.sync_all().map_err(ctx("fsync", &p))?;
    let md = f.metadata().map_err(ctx("stat", &p))?;
    let after = md.blocks() * 512;
    if md.len() != 4 * MIB {
        return Err(format!("size {} after punching (want 4 MiB)", md.len()));
    }
    if before.saturating_sub(after) < 2 * MIB {
        return Err(format!(
            "punching 2 MiB freed {} bytes (allocated {before} -> {after})",
            before.saturating_sub(after)
        ));
    }
    let mut buf = vec![0u8; 4 * MIB as usize];
    f.read_exact_at(&mut buf, 0).map_err(ctx("read", &p))?;
    let (head, rest) = buf.split_at(MIB as usize);
    let (hole, tail) = rest.split_at(2 * MIB as usize);
    if hole.iter().any(|b| *b != 0) || head.iter().chain(tail).any(|b| *b != 0xa5) {
        return Err("the file's contents are wrong after punching".into());
    }
    Ok(format!(
        "allocated {before} -> {after} bytes, hole reads zeros, size kept"
    ))
}

fn locks(d: &Path, exe: &Path, kind: &str) -> Probe {
    let p = d.join("lock");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .map_err(ctx("create", &p))?;
    match kind {
        "flock" => rustix::fs::flock(&f, FlockOperation::LockExclusive).map_err(rx("flock", &p))?,
        _ => posix_lock::set(&f, PosixLock::Write).map_err(ctx("F_SETLK", &p))?,
    }
    let held = probe_lock_child(exe, kind, &p)?;
    match kind {
        "flock" => rustix::fs::flock(&f, FlockOperation::Unlock).map_err(rx("unlock", &p))?,
        _ => posix_lock::set(&f, PosixLock::Unlock).map_err(ctx("F_SETLK unlock", &p))?,
    }
    let free = probe_lock_child(exe, kind, &p)?;
    if held["locked"] == true {
        return Err(format!(
            "a second process took the lock while it was held: {held}"
        ));
    }
    if kind == "fcntl" && held["holder_pid"] != std::process::id() {
        return Err(format!(
            "F_GETLK did not name the holder (pid {}): {held}",
            std::process::id()
        ));
    }
    if free["locked"] != true {
        return Err(format!(
            "a second process could not lock after unlock: {free}"
        ));
    }
    Ok(format!(
        "second process while held: {}; after unlock: locked",
        held["error"].as_str().unwrap_or("?")
    ))
}

fn probe_lock_child(exe: &Path, kind: &str, p: &Path) -> Result<Value, String> {
    let out = Command::new(exe)
        .args(["probe-lock", kind])
        .arg(p)
        .output()
        .map_err(|e| format!("running {}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!(
            "probe-lock failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("probe-lock output: {e}"))
}

/// Hidden mode `probe-lock flock|fcntl PATH`: tries an exclusive lock
/// without waiting; prints `{"locked": bool, "error": …, "holder_pid": …}`.
pub fn probe_lock(kind: &str, p: &Path) -> Result<Value, String> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .map_err(ctx("open", p))?;
    if kind == "flock" {
        return Ok(
            match rustix::fs::flock(&f, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => json!({"locked": true}),
                Err(e) => json!({"locked": false, "error": std::io::Error::from(e).to_string()}),
            },
        );
    }
    let holder = posix_lock::holder(&f).map_err(|e| format!("F_GETLK: {e}"))?;
    Ok(match posix_lock::set(&f, PosixLock::Write) {
        Ok(()) => json!({"locked": true, "holder_pid": holder}),
        Err(e) => json!({"locked": false, "error": e.to_string(), "holder_pid": holder}),
    })
}

fn inotify(d: &Path) -> Probe {
    use rustix::fs::inotify::{self, CreateFlags, WatchFlags};
    let fd = inotify::init(CreateFlags::NONBLOCK | CreateFlags::CLOEXEC)
        .map_err(|e| format!("inotify_init: {}", std::io::Error::from(e)))?;
    let w = WatchFlags::CREATE | WatchFlags::MODIFY | WatchFlags::CLOSE_WRITE | WatchFlags::DELETE;
    inotify::add_watch(&fd, d, w).map_err(rx("inotify_add_watch", d))?;
    let p = d.join("watched");
    fs::write(&p, b"x").map_err(ctx("write", &p))?;
    fs::remove_file(&p).map_err(ctx("unlink", &p))?;
    let want = [
        ("IN_CREATE", libc::IN_CREATE),
        ("IN_MODIFY", libc::IN_MODIFY),
        ("IN_CLOSE_WRITE", libc::IN_CLOSE_WRITE),
        ("IN_DELETE", libc::IN_DELETE),
    ];
    let mut seen = 0u32;
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline && want.iter().any(|(_, m)| seen & m == 0) {
        match rustix::io::read(&fd, &mut buf[..]) {
            Ok(n) => {
                let mut off = 0;
                // struct inotify_event: wd i32, mask u32, cookie u32, len u32, name[len]
                while off + 16 <= n {
                    let mask = u32::from_ne_bytes(buf[off + 4..off + 8].try_into().unwrap());
                    let len =
                        u32::from_ne_bytes(buf[off + 12..off + 16].try_into().unwrap()) as usize;
                    let name = &buf[off + 16..(off + 16 + len).min(n)];
                    if name.split(|b| *b == 0).next() == Some(b"watched".as_slice()) {
                        seen |= mask;
                    }
                    off += 16 + len;
                }
            }
            Err(rustix::io::Errno::AGAIN) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => {
                return Err(format!(
                    "reading inotify events: {}",
                    std::io::Error::from(e)
                ));
            }
        }
    }
    let missing: Vec<&str> = want
        .iter()
        .filter(|(_, m)| seen & m == 0)
        .map(|(n, _)| *n)
        .collect();
    if missing.is_empty() {
        Ok("IN_CREATE, IN_MODIFY, IN_CLOSE_WRITE and IN_DELETE seen".into())
    } else {
        Err(format!("no {} within 2 s", missing.join(", ")))
    }
}

fn mmap_shared(d: &Path) -> Probe {
    const LEN: usize = 64 << 10;
    let p = d.join("mapped");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .map_err(ctx("create", &p))?;
    f.set_len(LEN as u64).map_err(ctx("ftruncate", &p))?;
    let pattern: Vec<u8> = (0..LEN).map(|i| (i % 253) as u8 + 1).collect();
    crust_sys::mm::write_through_mapping(&f, &pattern)
        .map_err(ctx("mmap MAP_SHARED + msync", &p))?;
    let mut other = vec![0u8; LEN];
    File::open(&p)
        .map_err(ctx("open", &p))?
        .read_exact_at(&mut other, 0)
        .map_err(ctx("read", &p))?;
    if other != pattern {
        return Err("read() on another descriptor does not see the mapped writes".into());
    }
    drop(f);
    let mut again = Vec::new();
    File::open(&p)
        .and_then(|mut f| f.read_to_end(&mut again))
        .map_err(ctx("reopen and read", &p))?;
    if again != pattern {
        return Err("the mapped writes are gone after reopening".into());
    }
    Ok(format!(
        "{LEN} bytes written through MAP_SHARED, msync'ed, read back twice"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acl_xattr_layout() {
        let v = acl_xattr(&[(ACL_USER_OBJ, 6, NO_ID), (ACL_USER, 4, 7)]);
        assert_eq!(v.len(), 4 + 2 * 8);
        assert_eq!(&v[..4], &[2, 0, 0, 0]);
        assert_eq!(&v[4..12], &[1, 0, 6, 0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(&v[12..20], &[2, 0, 4, 0, 7, 0, 0, 0]);
    }

    /// The single-process probes on the host's temp filesystem: each
    /// either works or names its error (tmpfs has no O_DIRECT on old
    /// kernels, no user xattrs on some): never a panic or a silent pass.
    #[test]
    fn probes_report_works_or_the_error() {
        let t = tempfile::tempdir().unwrap();
        for (name, f) in [
            ("xattr", xattr as fn(&Path) -> Probe),
            ("punch", punch_hole),
            ("inotify", inotify),
            ("mmap", mmap_shared),
            ("direct", o_direct),
        ] {
            let d = t.path().join(name);
            fs::create_dir(&d).unwrap();
            match f(&d) {
                Ok(detail) => assert!(!detail.is_empty()),
                Err(e) => assert!(!e.is_empty(), "{name}"),
            }
        }
        // inotify and mmap work on every local filesystem.
        let d = t.path().join("again");
        fs::create_dir(&d).unwrap();
        inotify(&d).unwrap();
        mmap_shared(&d).unwrap();
        let s = statfs(t.path()).unwrap();
        assert!(s["bytes_total"].as_u64().unwrap() > 0);
    }
}
