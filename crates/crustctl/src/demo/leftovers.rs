//! The final check: what of the demo is still on the machine, and the
//! sweep that removes it after a failure.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// What the final check found still present.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Leftovers {
    pub loop_devices: Vec<String>,
    pub mounts: Vec<String>,
    pub processes: Vec<String>,
    pub handoff_records: Vec<String>,
    pub sandboxes: Vec<String>,
    pub volumes: Vec<String>,
}

impl Leftovers {
    pub fn is_empty(&self) -> bool {
        self.loop_devices.is_empty()
            && self.mounts.is_empty()
            && self.processes.is_empty()
            && self.handoff_records.is_empty()
            && self.sandboxes.is_empty()
            && self.volumes.is_empty()
    }

    pub(crate) fn all(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (what, items) in [
            ("loop device", &self.loop_devices),
            ("mount", &self.mounts),
            ("process", &self.processes),
            ("hand-off record", &self.handoff_records),
            ("sandbox", &self.sandboxes),
            ("volume", &self.volumes),
        ] {
            v.extend(items.iter().map(|i| format!("{what} {i}")));
        }
        v
    }
}

/// What of the demo is still on the machine: loop devices backed by the
/// pool, mounts under the work dir, QEMU processes naming it, hand-off
/// records and sandboxes in its roots.
pub fn find_leftovers(work: &Path, pool: &Path, roots: &[&Path], sandboxes: &Path) -> Leftovers {
    let mut l = Leftovers::default();
    match crust_blockdev::list_loops() {
        Ok(loops) => {
            l.loop_devices = loops
                .into_iter()
                .filter(|s| s.backing_file.starts_with(pool))
                .map(|s| format!("{} ({})", s.path.display(), s.backing_file.display()))
                .collect()
        }
        Err(e) => l
            .loop_devices
            .push(format!("cannot list loop devices: {e}")),
    }
    match crust_blockdev::mount_info() {
        Ok(ms) => {
            l.mounts = ms
                .into_iter()
                .filter(|m| m.mount_point.starts_with(work))
                .map(|m| m.mount_point.display().to_string())
                .collect()
        }
        Err(e) => l.mounts.push(format!("cannot read mountinfo: {e}")),
    }
    let needle = work.display().to_string();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            if pid == std::process::id() as i32 {
                continue;
            }
            let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
                continue;
            };
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            let zombie = stat
                .rsplit(')')
                .next()
                .and_then(|s| s.split_whitespace().next())
                .is_some_and(|s| s == "Z");
            if !zombie && cmd.contains(&needle) {
                l.processes.push(format!("pid {pid}: {}", cmd.trim()));
            }
        }
    }
    for r in roots {
        if let Ok(rd) = std::fs::read_dir(r) {
            l.handoff_records
                .extend(rd.flatten().map(|e| e.path().display().to_string()));
        }
    }
    if let Ok(rd) = std::fs::read_dir(sandboxes) {
        l.sandboxes
            .extend(rd.flatten().map(|e| e.path().display().to_string()));
    }
    l
}

/// Best effort after a failure: unmount what is under the work dir and
/// detach loop devices on the pool, so removing the work dir is safe.
pub(crate) fn sweep(work: &Path, pool: &Path) {
    for _ in 0..4 {
        let mounts: Vec<PathBuf> = crust_blockdev::mount_info()
            .map(|ms| {
                ms.into_iter()
                    .map(|m| m.mount_point)
                    .filter(|p| p.starts_with(work))
                    .collect()
            })
            .unwrap_or_default();
        if mounts.is_empty() {
            break;
        }
        for m in mounts.into_iter().rev() {
            if crust_blockdev::unmount(&m).is_err() {
                let _ = rustix::mount::unmount(&m, rustix::mount::UnmountFlags::DETACH);
            }
        }
    }
    if let Ok(loops) = crust_blockdev::list_loops() {
        for l in loops
            .into_iter()
            .filter(|l| l.backing_file.starts_with(pool))
        {
            let _ = crust_blockdev::detach(&l.path);
        }
    }
}
