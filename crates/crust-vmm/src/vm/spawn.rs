//! What every process of a VM (QEMU, each virtiofsd) gets between fork
//! and exec: the VM's cgroups joined, and the parent-death signal when
//! asked. Joining before exec matters for memory: cgroups never move a
//! charge already made, so a process moved in after it started leaves its
//! start-up pages (QEMU's guest RAM touched at boot, TCG's translation
//! buffer, virtiofsd's worker) charged to whoever started it.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use crust_sys::spawn::ChildSetup;
use rustix::fs::{Mode, OFlags};
use rustix::process::Signal;

use crate::VmError;
use crate::config::VmConfig;

/// The setup of every process of the VM: born in `cfg.cgroups`, and dying
/// with its parent when `cfg.die_with_parent`. Callers add what is theirs
/// (descriptors to keep) and apply it.
pub(super) fn vm_child(cfg: &VmConfig) -> Result<ChildSetup, VmError> {
    let procs = open_cgroup_procs(&cfg.cgroups).map_err(|(dir, e)| {
        VmError::InvalidConfig(format!("the VM's cgroup {}: {e}", dir.display()))
    })?;
    let mut setup = ChildSetup::new();
    if cfg.die_with_parent {
        setup = setup.death_signal(Signal::KILL);
    }
    Ok(procs.into_iter().fold(setup, ChildSetup::cgroup))
}

/// The `cgroup.procs` of each of `dirs`, open for the child to write
/// itself into before exec: the one routine for every process a sandbox
/// starts (QEMU, each virtiofsd, the pod's shim). Opened here, in the
/// parent, so a missing group fails by name (the error's directory) before
/// anything runs.
pub fn open_cgroup_procs(dirs: &[PathBuf]) -> Result<Vec<OwnedFd>, (PathBuf, rustix::io::Errno)> {
    dirs.iter()
        .map(|dir| open_procs(dir).map_err(|e| (dir.clone(), e)))
        .collect()
}

fn open_procs(dir: &Path) -> Result<OwnedFd, rustix::io::Errno> {
    rustix::fs::open(
        dir.join("cgroup.procs"),
        OFlags::WRONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn a_missing_cgroup_fails_before_anything_runs() {
        let mut cfg = VmConfig::new("t", "/k", "/i", "/r");
        cfg.cgroups = vec![PathBuf::from("/nonexistent/cgroup")];
        let e = vm_child(&cfg).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cgroup"), "{e}");
    }

    /// A group of its own under each hierarchy this machine mounts that a
    /// child can be placed in: v1's memory controller and the v2 tree
    /// (the unified mount of a v1 host, or the root of a v2 host).
    fn hierarchies() -> Vec<(PathBuf, String)> {
        let name = format!("crust-vmm-spawn-{}", std::process::id());
        let mut out = Vec::new();
        for (mount, tag) in [
            ("/sys/fs/cgroup/memory", "memory"),
            ("/sys/fs/cgroup/unified", ""),
            ("/sys/fs/cgroup", ""),
        ] {
            let base = Path::new(mount);
            let v2 = base.join("cgroup.controllers").exists();
            if base.join("cgroup.procs").exists() && (tag.is_empty() == v2) {
                out.push((base.join(&name), format!("{tag}:/{name}")));
            }
        }
        out
    }

    #[test]
    fn a_child_is_born_in_the_vm_cgroups() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("SKIPPED: creating cgroups needs root");
            return;
        }
        let groups = hierarchies();
        if groups.is_empty() {
            eprintln!("SKIPPED: no cgroup hierarchy to place a child in");
            return;
        }
        for (dir, _) in &groups {
            std::fs::create_dir_all(dir).unwrap();
        }
        let mut cfg = VmConfig::new("t", "/k", "/i", "/r");
        cfg.cgroups = groups.iter().map(|(d, _)| d.clone()).collect();
        let mut cmd = Command::new("cat");
        cmd.arg("/proc/self/cgroup");
        vm_child(&cfg).unwrap().apply(&mut cmd).unwrap();
        let out = cmd.output().unwrap();
        for (dir, _) in &groups {
            let _ = std::fs::remove_dir(dir);
        }
        let seen = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{seen}");
        // `/proc/self/cgroup` lines are `id:controllers:path`; the v2
        // tree's controllers field is empty.
        for (_, want) in &groups {
            assert!(
                seen.lines()
                    .any(|l| l.split_once(':').map(|x| x.1) == Some(want)),
                "{want} not in:\n{seen}"
            );
        }
    }
}
