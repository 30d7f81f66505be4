//! Facts kubelet reads from the node: its names for pods and staging
//! directories, mounts, and whether a QEMU still runs.

use sha2::{Digest, Sha256};
use std::path::Path;

/// Lower-case hex sha256 (kubelet's staging directory name).
pub fn hex_sha256(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A random RFC 4122 version 4 UUID (kubelet's pod uid format).
pub fn random_uuid() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        use std::hash::{BuildHasher, RandomState};
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let a = RandomState::new().hash_one((t, std::process::id()));
        let c = RandomState::new().hash_one(a);
        b[..8].copy_from_slice(&a.to_le_bytes());
        b[8..].copy_from_slice(&c.to_le_bytes());
    }
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Whether something is mounted exactly at `p`.
pub fn is_mountpoint(p: &Path) -> bool {
    crust_blockdev::mount_info()
        .map(|ms| ms.iter().any(|m| m.mount_point == p))
        .unwrap_or(false)
}

/// Whether the topmost mount at `p` is the plugin's placeholder for a
/// volume whose filesystem is in a guest.
pub fn is_placeholder(p: &Path) -> bool {
    crust_blockdev::find_mount(p)
        .ok()
        .flatten()
        .is_some_and(|m| m.fs_type == "tmpfs" && m.source == crust_handoff::PLACEHOLDER_SOURCE)
}

/// Whether `pid` is a live (non-zombie) QEMU process.
pub fn pid_is_qemu(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|s| s.split_whitespace().next());
    if matches!(state, None | Some("Z") | Some("X")) {
        return false;
    }
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).contains("qemu"))
        .unwrap_or(false)
}
