//! A VM's run directory: where its sockets and logs go, and `vm.json`,
//! the record another process attaches by (checked against the live
//! process before it is trusted).

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::VmError;
use crate::config::{DiskSpec, ShareSpec};
use crust_sandbox_records::ResolvedAccel;

/// Files in a VM's run directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunPaths {
    pub run_dir: PathBuf,
    /// QMP monitor (`-qmp unix:...,server=on,wait=off`).
    pub qmp_socket: PathBuf,
    /// The agent's virtio-serial port (`org.crust.agent`).
    pub agent_socket: PathBuf,
    /// The stdio port of container processes (`org.crust.stdio`).
    pub stdio_socket: PathBuf,
    /// The port-forward port (`org.crust.forward`).
    pub forward_socket: PathBuf,
    /// Guest serial console.
    pub console_log: PathBuf,
    /// QEMU's own stdout/stderr.
    pub qemu_log: PathBuf,
    /// QEMU's pid.
    pub pid_file: PathBuf,
    /// [`VmState`] as JSON.
    pub state_file: PathBuf,
}

impl RunPaths {
    /// vhost-user socket of share `i`'s virtiofsd.
    pub fn fs_socket(&self, i: usize) -> PathBuf {
        self.run_dir.join(format!("fs{i}.sock"))
    }

    /// Log of share `i`'s virtiofsd.
    pub fn fs_log(&self, i: usize) -> PathBuf {
        self.run_dir.join(format!("virtiofsd{i}.log"))
    }

    pub fn new(run_dir: impl Into<PathBuf>) -> Self {
        let d: PathBuf = run_dir.into();
        RunPaths {
            qmp_socket: d.join("qmp.sock"),
            agent_socket: d.join("agent.sock"),
            stdio_socket: d.join("stdio.sock"),
            forward_socket: d.join("forward.sock"),
            console_log: d.join("console.log"),
            qemu_log: d.join("qemu.log"),
            pid_file: d.join("qemu.pid"),
            state_file: d.join("vm.json"),
            run_dir: d,
        }
    }
}

/// What `vm.json` records, so another process can find and drive the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmState {
    pub name: String,
    pub pid: u32,
    /// Process start time (clock ticks since boot, `/proc/<pid>/stat` field
    /// 22): tells a reused pid apart.
    pub start_time: u64,
    pub accel: ResolvedAccel,
    /// Why `accel` was chosen (see [`crate::AccelChoice`]).
    #[serde(default)]
    pub accel_reason: String,
    /// The guest was booted again under TCG after a KVM boot hung.
    #[serde(default)]
    pub accel_fallback: bool,
    /// Boot disks and the root port each sits on.
    pub boot_disks: Vec<(DiskSpec, String)>,
    /// Root ports left empty for hot-plug.
    pub hotplug_ports: Vec<String>,
    /// The virtiofsd of each share (same order as the shares).
    #[serde(default)]
    pub virtiofsd: Vec<DaemonRef>,
    #[serde(default)]
    pub shares: Vec<ShareSpec>,
}

/// A helper process of the VM, identified by pid and start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonRef {
    pub pid: u32,
    pub start_time: u64,
}

impl DaemonRef {
    /// Still the same live (non-zombie) process.
    pub fn alive(&self) -> bool {
        matches!(proc_start_time(self.pid), Some((t, false)) if t == self.start_time)
    }
}

/// How QEMU ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmExit {
    /// Exit status, when known (only for a VM this process launched).
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// QEMU was killed because a virtiofsd of the VM died.
    pub virtiofsd_died: bool,
}

impl VmExit {
    /// Exited with status 0 (a guest power-off or reset under -no-reboot).
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

pub(crate) fn io_err(op: &'static str, path: &Path, source: std::io::Error) -> VmError {
    VmError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// QEMU's key=value syntax escapes a comma by doubling it.
pub(crate) fn esc(p: &Path) -> String {
    p.to_string_lossy().replace(',', ",,")
}

/// Last `max` bytes of a file, lossily decoded.
pub fn tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).trim().to_owned()
}

/// Writes `data` to `path` atomically (temp file, fsync, rename, fsync dir).
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> Result<(), VmError> {
    let dir = path.parent().expect("file in a directory");
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| io_err("create", &tmp, e))?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(|e| io_err("chmod", &tmp, e))?;
    f.write_all(data).map_err(|e| io_err("write", &tmp, e))?;
    f.sync_all().map_err(|e| io_err("fsync", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io_err("rename", path, e))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err("fsync", dir, e))
}

/// Field 22 of `/proc/<pid>/stat`, and whether the process is a zombie.
pub(crate) fn proc_start_time(pid: u32) -> Option<(u64, bool)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parens: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    // rest starts at field 3 (state); field 22 is index 19.
    let zombie = fields.first() == Some(&"Z") || fields.first() == Some(&"X");
    Some((fields.get(19)?.parse().ok()?, zombie))
}

pub(crate) fn proc_cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
    )
}

/// Whether `pid` is still the QEMU recorded in `state`/`paths`.
pub(crate) fn is_our_qemu(state: &VmState, paths: &RunPaths) -> bool {
    match proc_start_time(state.pid) {
        Some((t, zombie)) if t == state.start_time && !zombie => {}
        _ => return false,
    }
    let qmp_arg = format!("unix:{},server=on,wait=off", esc(&paths.qmp_socket));
    proc_cmdline(state.pid).is_some_and(|c| c.contains(&qmp_arg))
}

pub(crate) fn read_state(paths: &RunPaths) -> Option<VmState> {
    let data = std::fs::read(&paths.state_file).ok()?;
    serde_json::from_slice(&data).ok()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn proc_stat_parsing_of_self() {
        let (t, zombie) = proc_start_time(std::process::id()).unwrap();
        assert!(t > 0);
        assert!(!zombie);
        assert!(proc_start_time(u32::MAX).is_none());
    }

    #[test]
    fn atomic_write_and_tail() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        write_atomic(&p, b"hello world").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"hello world");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(tail(&p, 5), "world");
        assert_eq!(tail(&d.path().join("missing"), 5), "");
    }
}
