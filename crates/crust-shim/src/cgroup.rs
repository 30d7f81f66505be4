//! Putting the pod's VM (QEMU and virtiofsd) into the sandbox's cgroup
//! (`linux.cgroupsPath`), so the pod's resource accounting and limits cover
//! the VM that runs it. cgroup v1 (one directory per controller, as on
//! these machines) and v2 (one unified tree). The systemd driver's
//! `slice:prefix:name` form maps to the cgroupfs layout systemd itself
//! uses (see [`systemd_path`]); the groups are made directly, so systemd
//! need not be running.

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
        let systemd;
        let rel = if cgroups_path.contains(':') {
            systemd = systemd_path(cgroups_path)?;
            systemd.as_str()
        } else {
            cgroups_path.trim_start_matches('/')
        };
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

/// The cgroupfs path (relative, no leading `/`) of the systemd driver's
/// `slice:prefix:name`, as systemd lays it out: each `-` of the slice's
/// name is a parent slice (`kubepods-besteffort-pod1.slice` lives in
/// `kubepods.slice/kubepods-besteffort.slice/`), the unit is
/// `<prefix>-<name>.scope` (a `name` ending in `.slice` is the unit
/// itself); an empty slice is `system.slice`, `-.slice` the root.
pub fn systemd_path(cgroups_path: &str) -> Result<String, String> {
    let bad = |why: &str| format!("cgroupsPath {cgroups_path:?} (systemd form): {why}");
    let parts: Vec<&str> = cgroups_path.split(':').collect();
    let [slice, prefix, name] = parts[..] else {
        return Err(bad("expected slice:prefix:name"));
    };
    let plain = |s: &str| !s.contains('/') && s != "." && s != "..";
    if name.is_empty() || !plain(name) || !plain(prefix) {
        return Err(bad(
            "the prefix and name must be plain names, the name not empty",
        ));
    }
    let slice = if slice.is_empty() {
        "system.slice"
    } else {
        slice
    };
    let mut dirs = Vec::new();
    if slice != "-.slice" {
        let base = slice
            .strip_suffix(".slice")
            .filter(|b| plain(b))
            .ok_or_else(|| bad("the slice must be a name ending in .slice"))?;
        let words: Vec<&str> = base.split('-').collect();
        if words.iter().any(|w| w.is_empty()) {
            return Err(bad("the slice's name has an empty part between dashes"));
        }
        for n in 1..=words.len() {
            dirs.push(format!("{}.slice", words[..n].join("-")));
        }
    }
    dirs.push(if name.ends_with(".slice") {
        name.to_string()
    } else if prefix.is_empty() {
        format!("{name}.scope")
    } else {
        format!("{prefix}-{name}.scope")
    });
    Ok(dirs.join("/"))
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
        for bad in ["/a/../b", "/", "a//b"] {
            assert!(Placement::resolve_in(&v2, bad).is_err(), "{bad}");
        }
        let p =
            Placement::resolve_in(&v1, "kubepods-besteffort-pod1.slice:cri-containerd:c1").unwrap();
        assert_eq!(
            p.dirs[0],
            v1.join(
                "memory/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-c1.scope"
            )
        );
    }

    #[test]
    fn systemd_form_expands_like_systemd() {
        for (given, want) in [
            (
                "kubepods-besteffort-pod123.slice:cri-containerd:abc",
                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod123.slice/cri-containerd-abc.scope",
            ),
            (
                "kubepods-pod9.slice:crio:x",
                "kubepods.slice/kubepods-pod9.slice/crio-x.scope",
            ),
            ("system.slice:docker:y", "system.slice/docker-y.scope"),
            (":docker:y", "system.slice/docker-y.scope"),
            ("-.slice::z", "z.scope"),
            ("machine.slice::sub.slice", "machine.slice/sub.slice"),
        ] {
            assert_eq!(systemd_path(given).as_deref(), Ok(want), "{given}");
        }
        for bad in [
            "a:b",
            "a.slice:b:c:d",
            "kubepods.slice:cri:",
            "kubepods:cri:x",
            "kube--pods.slice:cri:x",
            "-kubepods.slice:cri:x",
            "kubepods.slice:cri:../x",
            "kubepods.slice:c/r:x",
            "a/b.slice:cri:x",
            "..slice:cri:x",
        ] {
            let e = systemd_path(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }
}
