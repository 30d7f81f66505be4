//! Putting the pod's VM (QEMU and virtiofsd) into the sandbox's cgroup
//! (`linux.cgroupsPath`), so the pod's resource accounting and limits cover
//! the VM that runs it. cgroup v1 (one directory per controller, as on
//! these machines) and v2 (one unified tree). The systemd driver's
//! `slice:prefix:name` form maps to the cgroupfs layout systemd itself
//! uses (see [`systemd_path`]); the groups are made directly, so systemd
//! need not be running.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const ROOT: &str = "/sys/fs/cgroup";
/// v1 controllers the VM's processes are placed under, when mounted.
const V1_CONTROLLERS: &[&str] = &["memory", "cpu,cpuacct", "cpu", "cpuacct", "pids", "blkio"];

#[derive(Debug, Clone)]
pub struct Placement {
    pub dirs: Vec<PathBuf>,
    pub v2: bool,
    /// The directories [`Placement::create`] made, parents first: the
    /// only ones [`Placement::remove`] takes away (a group that was there
    /// before the pod belongs to someone else). Shared by clones.
    created: Arc<Mutex<Vec<PathBuf>>>,
    /// Where [`Placement::enter_self`] found this process, per group.
    origins: Arc<Mutex<Vec<PathBuf>>>,
    /// `cgroups_path` below each hierarchy's root.
    rel: PathBuf,
    /// The spec's `linux.cgroupsPath` this placement was resolved from.
    source: String,
}

/// What `shim start` hands the serving shim it spawned in the pod's
/// groups ([`Placement::hand_over`]): which groups it made (the serving
/// shim removes them at the end) and where the shim came from (where it
/// goes back to, so the groups can be removed).
#[derive(serde::Serialize, serde::Deserialize)]
struct Handed {
    cgroups_path: String,
    created: Vec<PathBuf>,
    origins: Vec<PathBuf>,
}

/// The environment variable carrying [`Handed`] from `shim start` to the
/// serving shim.
pub const HANDED_ENV: &str = "CRUST_SHIM_BORN_IN_CGROUP";

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
                created: Arc::default(),
                origins: Arc::default(),
                rel: rel.into(),
                source: cgroups_path.into(),
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
        Ok(Placement {
            dirs,
            v2: false,
            created: Arc::default(),
            origins: Arc::default(),
            rel: rel.into(),
            source: cgroups_path.into(),
        })
    }

    pub fn resolve(cgroups_path: &str) -> Result<Placement, String> {
        Placement::resolve_in(Path::new(ROOT), cgroups_path)
    }

    /// Creates the groups (and missing parents), recording each directory
    /// made, so the VM's processes can be born in them.
    pub fn create(&self) -> Result<(), String> {
        let mut created = self.created.lock().expect("created");
        for d in &self.dirs {
            let mut missing: Vec<&Path> = d.ancestors().take_while(|a| !a.exists()).collect();
            missing.reverse();
            for m in missing {
                match std::fs::create_dir(m) {
                    Ok(()) => created.push(m.to_path_buf()),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(format!("mkdir {}: {e}", m.display())),
                }
            }
        }
        Ok(())
    }

    /// Removes the groups [`Placement::create`] made, deepest first. What
    /// is still in one (a virtiofsd finishing its exit after QEMU's) is the
    /// pod's and goes with it: killed, then waited for, a bounded while.
    /// A group that stays is logged (the container manager may remove it
    /// too).
    pub fn remove(&self) {
        let created = std::mem::take(&mut *self.created.lock().expect("created"));
        for d in created.iter().rev() {
            if let Err(e) = remove_emptied(d) {
                tracing::warn!("the pod's cgroup {} stays: {e}", d.display());
            }
        }
    }

    /// The spec's `linux.cgroupsPath` this placement was resolved from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// This process's own group in each hierarchy of the placement.
    fn own_groups(&self) -> Result<Vec<PathBuf>, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("/proc/self/cgroup: {e}"))?;
        self.dirs
            .iter()
            .map(|d| {
                let base = d
                    .ancestors()
                    .nth(self.rel.components().count())
                    .ok_or_else(|| format!("{} has no hierarchy root", d.display()))?;
                own_group(&own, base, self.v2)
                    .ok_or_else(|| format!("this process has no group in {}", base.display()))
            })
            .collect()
    }

    /// Moves this process (the pod's shim, one per pod) into the groups,
    /// remembering where it was: from here on what it allocates for the
    /// pod is charged to the pod, as QEMU's and virtiofsd's pages are. A
    /// shim born in the groups ([`Placement::take_over`]) is there already
    /// and keeps the origins it was handed.
    pub fn enter_self(&self) -> Result<(), String> {
        let mut origins = self.origins.lock().expect("origins");
        if !origins.is_empty() {
            return Ok(());
        }
        let from = self.own_groups()?;
        for d in &self.dirs {
            std::fs::write(d.join("cgroup.procs"), std::process::id().to_string())
                .map_err(|e| format!("moving the shim into {}: {e}", d.display()))?;
        }
        *origins = from;
        Ok(())
    }

    /// What `shim start`, which made the groups for a shim it is about to
    /// spawn in them, hands that shim (through [`HANDED_ENV`]): the groups
    /// it made and its own groups (containerd's), where the serving shim
    /// returns at the pod's end.
    pub fn hand_over(&self) -> Result<String, String> {
        let handed = Handed {
            cgroups_path: self.source.clone(),
            created: self.created.lock().expect("created").clone(),
            origins: self.own_groups()?,
        };
        serde_json::to_string(&handed).map_err(|e| e.to_string())
    }

    /// The placement this shim was born in, when `shim start` handed one
    /// ([`HANDED_ENV`]).
    pub fn handed() -> Option<Result<Placement, String>> {
        let text = std::env::var(HANDED_ENV).ok()?;
        Some(Placement::take_over(Path::new(ROOT), &text))
    }

    /// The placement a shim born in the pod's groups was handed by
    /// `shim start` ([`Placement::hand_over`]), resolved again from the
    /// same `cgroupsPath` under `root`: the groups it made are this shim's
    /// to remove. Text that does not parse, or resolves elsewhere than it
    /// says, is no placement.
    pub fn take_over(root: &Path, text: &str) -> Result<Placement, String> {
        let handed: Handed =
            serde_json::from_str(text).map_err(|e| format!("{HANDED_ENV}: {e}"))?;
        let p = Placement::resolve_in(root, &handed.cgroups_path)?;
        // Only a placement's own directories or their parents below the
        // hierarchies' root.
        let inside =
            |d: &PathBuf| d.starts_with(root) && p.dirs.iter().any(|mine| mine.starts_with(d));
        if !handed.created.iter().all(inside) || handed.origins.len() != p.dirs.len() {
            return Err(format!(
                "{HANDED_ENV} does not match {}",
                handed.cgroups_path
            ));
        }
        *p.created.lock().expect("created") = handed.created;
        *p.origins.lock().expect("origins") = handed.origins;
        Ok(p)
    }

    /// Moves this process back where [`Placement::enter_self`] found it
    /// (best effort), so the pod's groups can be removed.
    pub fn leave_self(&self) {
        let origins = std::mem::take(&mut *self.origins.lock().expect("origins"));
        for o in origins {
            if let Err(e) = std::fs::write(o.join("cgroup.procs"), std::process::id().to_string()) {
                tracing::warn!("moving the shim back to {}: {e}", o.display());
            }
        }
    }

    /// The memory limit of the group above the sandbox's (kubelet's pod
    /// cgroup), when it has one: v1 `memory.limit_in_bytes`, v2
    /// `memory.max` ("max" and v1's page-rounded "unlimited" are none).
    pub fn parent_memory_limit(&self) -> Option<u64> {
        let (dir, file) = if self.v2 {
            (self.dirs.first()?, "memory.max")
        } else {
            let memory = self
                .dirs
                .iter()
                .find(|d| d.components().any(|c| c.as_os_str() == "memory"))?;
            (memory, "memory.limit_in_bytes")
        };
        let text = std::fs::read_to_string(dir.parent()?.join(file)).ok()?;
        text.trim().parse::<u64>().ok().filter(|l| *l < 1 << 62)
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

/// The directory of this process's group in the hierarchy mounted at
/// `base`, from `/proc/self/cgroup` text (`id:controllers:path`; v2's line
/// has no controllers, a v1 line names the base's).
fn own_group(proc_self_cgroup: &str, base: &Path, v2: bool) -> Option<PathBuf> {
    let name = base.file_name()?.to_str()?;
    let mut want: Vec<&str> = name.split(',').collect();
    want.sort_unstable();
    proc_self_cgroup.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        let mut have: Vec<&str> = ctrl.split(',').collect();
        have.sort_unstable();
        let hit = if v2 { ctrl.is_empty() } else { have == want };
        hit.then(|| base.join(path.trim_start_matches('/')))
    })
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

/// How long a pod's cgroup may take to empty once its processes were told
/// to go.
const EMPTY_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// `rmdir` of a cgroup, killing what is left in it first and retrying while
/// the kernel still counts an exiting process.
fn remove_emptied(dir: &Path) -> std::io::Result<()> {
    let deadline = std::time::Instant::now() + EMPTY_WAIT;
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if std::time::Instant::now() >= deadline => return Err(e),
            Err(_) => {}
        }
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        let me = std::process::id() as i32;
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            if pid != me
                && let Some(p) = rustix::process::Pid::from_raw(pid)
            {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
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
    fn own_group_per_hierarchy() {
        let text = "9:name=systemd:/\n4:memory:/a/b\n2:cpu,cpuacct:/c\n0::/d\n";
        let root = Path::new("/sys/fs/cgroup");
        assert_eq!(
            own_group(text, &root.join("memory"), false),
            Some(root.join("memory/a/b"))
        );
        assert_eq!(
            own_group(text, &root.join("cpu,cpuacct"), false),
            Some(root.join("cpu,cpuacct/c"))
        );
        assert_eq!(own_group(text, &root.join("pids"), false), None);
        assert_eq!(own_group(text, root, true), Some(root.join("d")));
    }

    #[test]
    fn only_groups_it_made_are_removed() {
        let t = tempfile::tempdir().unwrap();
        let v2 = t.path();
        std::fs::write(v2.join("cgroup.controllers"), "memory").unwrap();
        // Someone else's: the pod's parent, and a group already at the
        // pod's own path.
        std::fs::create_dir_all(v2.join("kubepods/pod1")).unwrap();
        let theirs = Placement::resolve_in(v2, "kubepods/pod1").unwrap();
        theirs.create().unwrap();
        theirs.remove();
        assert!(v2.join("kubepods/pod1").is_dir(), "a group it found stays");
        // Made here, with a missing parent: both go, the older parent stays.
        let ours = Placement::resolve_in(v2, "kubepods/pod2/sb").unwrap();
        ours.clone().create().unwrap();
        assert!(v2.join("kubepods/pod2/sb").is_dir());
        ours.remove();
        assert!(!v2.join("kubepods/pod2").exists());
        assert!(v2.join("kubepods").is_dir());
    }

    #[test]
    fn a_shim_born_in_the_groups_removes_what_start_made() {
        let t = tempfile::tempdir().unwrap();
        let v2 = t.path();
        std::fs::write(v2.join("cgroup.controllers"), "memory").unwrap();
        std::fs::create_dir_all(v2.join("kubepods")).unwrap();
        let made = Placement::resolve_in(v2, "kubepods/pod3/sb").unwrap();
        made.create().unwrap();
        let handed = serde_json::json!({
            "cgroups_path": "kubepods/pod3/sb",
            "created": [v2.join("kubepods/pod3"), v2.join("kubepods/pod3/sb")],
            "origins": [v2.join("ctrd")],
        })
        .to_string();
        let taken = Placement::take_over(v2, &handed).unwrap();
        assert_eq!(taken.source(), "kubepods/pod3/sb");
        taken.remove();
        assert!(!v2.join("kubepods/pod3").exists(), "start's groups go");
        assert!(v2.join("kubepods").is_dir(), "the older parent stays");
        // A handed group outside the placement is refused, not removed.
        let stray = serde_json::json!({
            "cgroups_path": "kubepods/pod3/sb",
            "created": [v2.join("kubepods/other")],
            "origins": [v2.join("ctrd")],
        })
        .to_string();
        assert!(Placement::take_over(v2, &stray).is_err());
        assert!(Placement::take_over(v2, "not json").is_err());
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
