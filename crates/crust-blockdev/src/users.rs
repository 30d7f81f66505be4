//! Processes that use a device's mounted filesystem: a working or root
//! directory, an open file or a file mapping on it. Any of them makes an
//! unmount of its mount answer EBUSY, so a caller that must unmount (a
//! handover) asks first and can name who is in the way.

use std::io;
use std::path::Path;
use std::time::Instant;

use rustix::fs::{AtFlags, StatxFlags};

use crate::device::{DeviceError, OPENERS_SCAN_LIMIT, device_major_minor, for_other_processes};

/// How a process uses the filesystem (the first one found).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Use {
    WorkingDirectory,
    RootDirectory,
    OpenFile,
    Mapping,
}

impl Use {
    pub fn as_str(self) -> &'static str {
        match self {
            Use::WorkingDirectory => "working directory",
            Use::RootDirectory => "root directory",
            Use::OpenFile => "open file",
            Use::Mapping => "memory-mapped file",
        }
    }
}

/// A process using the filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsUser {
    pub pid: u32,
    /// `/proc/PID/comm`, or "?" when the process went away meanwhile.
    pub comm: String,
    pub how: Use,
}

impl std::fmt::Display for FsUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pid {} ({}) has its {} on it",
            self.pid,
            self.comm,
            self.how.as_str()
        )
    }
}

/// Processes other than this one using the filesystem on `device` (whose
/// files carry the device's numbers as `st_dev`), whichever mount or
/// path they reached it by. Only this PID namespace is visible; vanished
/// processes are skipped; bounded by [`OPENERS_SCAN_LIMIT`] (an error,
/// never an "unused" answer). Sorted by pid.
pub fn filesystem_users(device: &Path) -> Result<Vec<FsUser>, DeviceError> {
    let (major, minor) = device_major_minor(device)?;
    users_of(major, minor, Instant::now() + OPENERS_SCAN_LIMIT).map_err(|e| DeviceError::Io {
        path: device.to_path_buf(),
        source: e,
    })
}

fn users_of(major: u32, minor: u32, deadline: Instant) -> io::Result<Vec<FsUser>> {
    let mut found = Vec::new();
    for_other_processes(
        deadline,
        "/proc for users of the filesystem",
        |pid, comm| {
            if let Some(how) = process_use(pid, major, minor) {
                found.push(FsUser {
                    pid,
                    comm: comm(),
                    how,
                });
            }
        },
    )?;
    found.sort_by_key(|u| u.pid);
    Ok(found)
}

/// Whether `link` (a /proc magic link, followed) lies on `major:minor`.
fn on_device(link: &Path, major: u32, minor: u32) -> bool {
    // DONT_SYNC: a hung network filesystem must not stall the scan.
    rustix::fs::statx(
        rustix::fs::CWD,
        link,
        AtFlags::STATX_DONT_SYNC,
        StatxFlags::empty(),
    )
    .is_ok_and(|st| st.stx_dev_major == major && st.stx_dev_minor == minor)
}

/// How process `pid` uses the filesystem, if it does. Errors (the
/// process exited meanwhile) are "no".
fn process_use(pid: u32, major: u32, minor: u32) -> Option<Use> {
    let proc = format!("/proc/{pid}");
    if on_device(Path::new(&format!("{proc}/cwd")), major, minor) {
        return Some(Use::WorkingDirectory);
    }
    if on_device(Path::new(&format!("{proc}/root")), major, minor) {
        return Some(Use::RootDirectory);
    }
    if let Ok(fds) = std::fs::read_dir(format!("{proc}/fd")) {
        let open = fds.flatten().any(|fd| {
            // Sockets, pipes, anon inodes ("socket:[123]") live elsewhere.
            matches!(std::fs::read_link(fd.path()),
                Ok(t) if t.as_os_str().as_encoded_bytes().first() == Some(&b'/'))
                && on_device(&fd.path(), major, minor)
        });
        if open {
            return Some(Use::OpenFile);
        }
    }
    let maps = std::fs::read_to_string(format!("{proc}/maps")).ok()?;
    maps.lines()
        .any(|l| maps_line_on(l, major, minor))
        .then_some(Use::Mapping)
}

/// A `/proc/PID/maps` line (`addr perms offset MM:mm inode path`) that
/// maps a file of device `major:minor`.
fn maps_line_on(line: &str, major: u32, minor: u32) -> bool {
    let mut f = line.split_ascii_whitespace().skip(3);
    let (Some(dev), Some(inode)) = (f.next(), f.next()) else {
        return false;
    };
    let Some((ma, mi)) = dev.split_once(':') else {
        return false;
    };
    inode != "0"
        && u32::from_str_radix(ma, 16).is_ok_and(|m| m == major)
        && u32::from_str_radix(mi, 16).is_ok_and(|m| m == minor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines() {
        let l = "7f00-7f10 r--p 00000000 07:1f 131 /mnt/v/lib.so";
        assert!(maps_line_on(l, 7, 31));
        assert!(!maps_line_on(l, 7, 30));
        assert!(!maps_line_on("7f00-7f10 rw-p 00000000 00:00 0 ", 0, 0));
        assert!(!maps_line_on("garbage", 7, 31));
        // Minor numbers past 255 are printed in wider hex.
        assert!(maps_line_on("1-2 r--p 0 103:100 5 /x", 0x103, 0x100));
    }
}
