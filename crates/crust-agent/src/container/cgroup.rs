//! One cgroup v2 group per container in the guest (`/sys/fs/cgroup/<id>`):
//! memory limit, the process list (Pids), usage (Stats), and killing every
//! process of a container at once (`cgroup.kill`), which stands in for the
//! end of a PID namespace when the container's init exits.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_agent_proto::ContainerStatsReply;

pub const ROOT: &str = "/sys/fs/cgroup";

/// Mounts cgroup2 on [`ROOT`] and enables the controllers the containers
/// use. Idempotent.
pub fn init_root() -> Result<(), String> {
    let root = Path::new(ROOT);
    if !root.join("cgroup.controllers").exists() {
        std::fs::create_dir_all(root).map_err(|e| format!("mkdir {ROOT}: {e}"))?;
        rustix::mount::mount(
            "cgroup2",
            ROOT,
            "cgroup2",
            rustix::mount::MountFlags::NOSUID
                | rustix::mount::MountFlags::NODEV
                | rustix::mount::MountFlags::NOEXEC,
            None,
        )
        .map_err(|e| format!("mount cgroup2 on {ROOT}: {e}"))?;
    }
    let available = std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
    let wanted: Vec<String> = ["memory", "pids", "cpu"]
        .iter()
        .filter(|c| available.split_whitespace().any(|a| a == **c))
        .map(|c| format!("+{c}"))
        .collect();
    if !wanted.is_empty() {
        std::fs::write(root.join("cgroup.subtree_control"), wanted.join(" "))
            .map_err(|e| format!("enabling controllers {wanted:?}: {e}"))?;
    }
    Ok(())
}

pub fn path(id: &str) -> PathBuf {
    Path::new(ROOT).join(id)
}

/// Creates the group of container `id`, with `memory.max` when given.
pub fn create(id: &str, memory_limit: Option<u64>) -> Result<PathBuf, String> {
    let p = path(id);
    match std::fs::create_dir(&p) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("mkdir {}: {e}", p.display())),
    }
    if let Some(limit) = memory_limit {
        std::fs::write(p.join("memory.max"), limit.to_string())
            .map_err(|e| format!("memory.max of {id}: {e}"))?;
    }
    Ok(p)
}

/// Pids in the group.
pub fn pids(id: &str) -> Vec<u32> {
    std::fs::read_to_string(path(id).join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// SIGKILLs every process of the group.
pub fn kill_all(id: &str) {
    let p = path(id);
    if std::fs::write(p.join("cgroup.kill"), "1").is_err() {
        // Kernels before 5.14: signal one by one.
        for pid in pids(id) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
}

/// Kills what is left and removes the group (waits up to `wait` for the
/// processes to be gone).
pub fn remove(id: &str, wait: Duration) {
    let p = path(id);
    if !p.exists() {
        return;
    }
    kill_all(id);
    let until = Instant::now() + wait;
    while !pids(id).is_empty() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = std::fs::remove_dir(&p);
}

/// How many of the group's processes an OOM killer has killed, the
/// group's memory limit or the guest's memory running out
/// (`memory.events` counts both, descendants included).
pub fn oom_kills(id: &str) -> u64 {
    let events = std::fs::read_to_string(path(id).join("memory.events")).unwrap_or_default();
    oom_kill_count(&events)
}

fn oom_kill_count(events: &str) -> u64 {
    events
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
        .unwrap_or(0)
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

pub fn stats(id: &str) -> ContainerStatsReply {
    let p = path(id);
    let cpu_usec = std::fs::read_to_string(p.join("cpu.stat"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("usage_usec ")?.trim().parse::<u64>().ok())
        .unwrap_or(0);
    ContainerStatsReply {
        memory_bytes: read_u64(&p.join("memory.current")).unwrap_or(0),
        memory_limit_bytes: read_u64(&p.join("memory.max")),
        cpu_usage_ns: cpu_usec * 1000,
        pids: read_u64(&p.join("pids.current")).unwrap_or(pids(id).len() as u64),
    }
}

/// Memory the group holds that only an OOM kill frees (the guest has no
/// swap): anonymous and shared memory and unreclaimable kernel memory.
fn pinned_bytes(p: &Path) -> u64 {
    const PINNED: &[&str] = &[
        "anon",
        "shmem",
        "kernel_stack",
        "pagetables",
        "percpu",
        "sock",
        "slab_unreclaimable",
    ];
    std::fs::read_to_string(p.join("memory.stat"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| PINNED.contains(k))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum()
}

/// Why a limit update was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    #[error("cpu.max of {id}: period {period_us} us out of 1000..=1000000, or quota below 1000 us")]
    BadCpuMax { id: String, period_us: u64 },
    #[error(
        "memory limit {limit} bytes of {id} is below the {pinned} bytes the container holds and cannot give back (anonymous and shared memory; the guest has no swap): limits unchanged"
    )]
    BelowUsage { id: String, limit: u64, pinned: u64 },
    #[error("writing {file} of {id}: {source} (limits put back as they were)")]
    Write {
        id: String,
        file: &'static str,
        source: std::io::Error,
    },
}

/// Sets `memory.max` and `cpu.max` of container `id`, all or nothing:
/// checked first, then written in order, what was written put back when a
/// later write fails.
pub fn set_limits(
    id: &str,
    memory: Option<u64>,
    cpu: Option<crust_agent_proto::CpuMax>,
) -> Result<(), LimitError> {
    let p = path(id);
    if let Some(c) = cpu
        && (!(1000..=1_000_000).contains(&c.period_us) || c.quota_us.is_some_and(|q| q < 1000))
    {
        return Err(LimitError::BadCpuMax {
            id: id.into(),
            period_us: c.period_us,
        });
    }
    if let Some(limit) = memory {
        let pinned = pinned_bytes(&p);
        if limit < pinned {
            return Err(LimitError::BelowUsage {
                id: id.into(),
                limit,
                pinned,
            });
        }
    }
    let mut writes: Vec<(&'static str, String)> = Vec::new();
    if let Some(m) = memory {
        writes.push(("memory.max", m.to_string()));
    }
    if let Some(c) = cpu {
        let quota = c.quota_us.map_or("max".to_string(), |q| q.to_string());
        writes.push(("cpu.max", format!("{quota} {}", c.period_us)));
    }
    let mut done: Vec<(&'static str, String)> = Vec::new();
    for (file, value) in writes {
        let old = std::fs::read_to_string(p.join(file)).unwrap_or_default();
        if let Err(source) = std::fs::write(p.join(file), &value) {
            for (f, v) in done.iter().rev() {
                let _ = std::fs::write(p.join(f), v.trim());
            }
            return Err(LimitError::Write {
                id: id.into(),
                file,
                source,
            });
        }
        done.push((file, old));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::oom_kill_count;

    #[test]
    fn oom_kills_are_read_from_memory_events() {
        let events = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(oom_kill_count(events), 2);
        // oom_group_kill must not be taken for oom_kill.
        assert_eq!(oom_kill_count("oom_group_kill 5\n"), 0);
        assert_eq!(oom_kill_count(""), 0);
    }
}
