//! Putting the pod's VM (QEMU and virtiofsd) into the sandbox's cgroup
//! (`linux.cgroupsPath`), so the pod's resource accounting and limits cover
//! the VM that runs it. cgroup v1 (one directory per controller, as on
//! these machines) and v2 (one unified tree); the systemd driver's
//! `slice:prefix:name` form is not handled (the path is then refused).

use std::path::{Path, PathBuf};

const ROOT: &str = "/sys/fs/cgroup";
/// v1 controllers the VM's processes are placed under, when mounted.
const V1_CONTROLLERS: &[&str] = &["memory", "cpu,cpuacct", "cpu", "cpuacct", "pids", "blkio"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub dirs: Vec<PathBuf>,
    pub v2: bool,
}

impl Placement {
    /// The directories of `cgroups_path` under `root` (`/sys/fs/cgroup`).
    pub fn resolve_in(root: &Path, cgroups_path: &str) -> Result<Placement, String> {
        if cgroups_path.contains(':') {
            return Err(format!(
                "cgroupsPath {cgroups_path:?} uses the systemd driver's form, which crust does not handle; use cgroupfs"
            ));
        }
        let rel = cgroups_path.trim_start_matches('/');
        if rel.is_empty()
            || rel
                .split('/')
                .any(|c| c.is_empty() || c == "." || c == "..")
        {
            return Err(format!("cgroupsPath {cgroups_path:?} is not a clean path"));
        }
        if root.join("cgroup.controllers").exists() {
            return Ok(Placement {
                dirs: vec![root.join(rel)],
                v2: true,
            });
        }
        let mut dirs = Vec::new();
        for c in V1_CONTROLLERS {
            let base = root.join(c);
            // `cpu,cpuacct` and its `cpu`/`cpuacct` symlinks are one hierarchy.
            if base.join("cgroup.procs").exists()
                && !base.is_symlink()
                && !dirs.iter().any(|d: &PathBuf| d.starts_with(&base))
            {
                dirs.push(base.join(rel));
            }
        }
        if dirs.is_empty() {
            return Err(format!(
                "no cgroup hierarchy found under {}",
                root.display()
            ));
        }
        Ok(Placement { dirs, v2: false })
    }

    pub fn resolve(cgroups_path: &str) -> Result<Placement, String> {
        Placement::resolve_in(Path::new(ROOT), cgroups_path)
    }

    /// Creates the groups and moves `pids` into them.
    pub fn enter(&self, pids: &[i32]) -> Result<(), String> {
        for d in &self.dirs {
            std::fs::create_dir_all(d).map_err(|e| format!("mkdir {}: {e}", d.display()))?;
            for pid in pids {
                std::fs::write(d.join("cgroup.procs"), pid.to_string())
                    .map_err(|e| format!("moving {pid} into {}: {e}", d.display()))?;
            }
        }
        Ok(())
    }

    /// Removes the groups once empty (best effort: the container manager
    /// may remove them too).
    pub fn remove(&self) {
        for d in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }

    /// Whether `pid` is in every group.
    pub fn contains(&self, pid: i32) -> bool {
        self.dirs.iter().all(|d| {
            std::fs::read_to_string(d.join("cgroup.procs"))
                .map(|s| s.lines().any(|l| l.trim() == pid.to_string()))
                .unwrap_or(false)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_and_v2_layouts() {
        let t = tempfile::tempdir().unwrap();
        let v1 = t.path().join("v1");
        for c in ["memory", "pids", "cpu,cpuacct"] {
            std::fs::create_dir_all(v1.join(c)).unwrap();
            std::fs::write(v1.join(c).join("cgroup.procs"), "").unwrap();
        }
        std::os::unix::fs::symlink("cpu,cpuacct", v1.join("cpu")).unwrap();
        let p = Placement::resolve_in(&v1, "/kubepods/pod1/sb").unwrap();
        assert!(!p.v2);
        assert_eq!(
            p.dirs,
            vec![
                v1.join("memory/kubepods/pod1/sb"),
                v1.join("cpu,cpuacct/kubepods/pod1/sb"),
                v1.join("pids/kubepods/pod1/sb"),
            ]
        );
        let v2 = t.path().join("v2");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("cgroup.controllers"), "memory pids").unwrap();
        let p = Placement::resolve_in(&v2, "kubepods/pod1").unwrap();
        assert!(p.v2);
        assert_eq!(p.dirs, vec![v2.join("kubepods/pod1")]);
        for bad in ["system.slice:cri:x", "/a/../b", "/", "a//b"] {
            assert!(Placement::resolve_in(&v2, bad).is_err(), "{bad}");
        }
    }
}
