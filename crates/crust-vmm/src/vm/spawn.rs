//! What every process of a VM (QEMU, each virtiofsd) gets between fork
//! and exec: the VM's cgroups joined, and the parent-death signal when
//! asked. Joining before exec matters for memory: cgroups never move a
//! charge already made, so a process moved in after it started leaves its
//! start-up pages (QEMU's guest RAM touched at boot, TCG's translation
//! buffer, virtiofsd's worker) charged to whoever started it.

use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::fs::{Mode, OFlags};
use rustix::process::Signal;

use crate::VmError;
use crate::config::VmConfig;

/// Sets up `cmd` to be born in `cfg.cgroups` (and to die with its parent
/// when `cfg.die_with_parent`): [`born_in_cgroups`] with the VM's groups.
pub(super) fn born_in_vm_cgroups(cmd: &mut Command, cfg: &VmConfig) -> Result<(), VmError> {
    born_in_cgroups(cmd, &cfg.cgroups, cfg.die_with_parent).map_err(|(dir, e)| {
        VmError::InvalidConfig(format!("the VM's cgroup {}: {e}", dir.display()))
    })
}

/// Sets up `cmd` to be born in the cgroups `dirs` (and to die with its
/// parent when `die_with_parent`): the one routine for every process a
/// sandbox starts (QEMU, each virtiofsd, the pod's shim). The groups'
/// `cgroup.procs` are opened here, in the parent, so a missing group fails
/// by name (the error's directory) before anything runs; the child only
/// writes `0` (itself) to each.
pub fn born_in_cgroups(
    cmd: &mut Command,
    dirs: &[PathBuf],
    die_with_parent: bool,
) -> Result<(), (PathBuf, rustix::io::Errno)> {
    let procs: Vec<OwnedFd> = dirs
        .iter()
        .map(|dir| open_procs(dir).map_err(|e| (dir.clone(), e)))
        .collect::<Result<_, _>>()?;
    let die = die_with_parent;
    if procs.is_empty() && !die {
        return Ok(());
    }
    // SAFETY: between fork and exec the child makes only raw system calls
    // (prctl, write) on descriptors it owns; nothing allocates or locks.
    unsafe {
        cmd.pre_exec(move || {
            if die {
                rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
            }
            for fd in &procs {
                rustix::io::write(fd, b"0")?;
            }
            Ok(())
        });
    }
    Ok(())
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

    #[test]
    fn a_missing_cgroup_fails_before_anything_runs() {
        let mut cfg = VmConfig::new("t", "/k", "/i", "/r");
        cfg.cgroups = vec![PathBuf::from("/nonexistent/cgroup")];
        let mut cmd = Command::new("true");
        let e = born_in_vm_cgroups(&mut cmd, &cfg).unwrap_err();
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
        born_in_vm_cgroups(&mut cmd, &cfg).unwrap();
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
