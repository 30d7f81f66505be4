//! Host side of `bench --guest-io`: CPU time of the VM's processes (QEMU
//! and the share's virtiofsd) from `/proc`, and the host page cache.

use std::collections::HashMap;
use std::path::Path;

/// `utime + stime` of `pid` (all its threads) in seconds; `None` when it
/// is gone.
pub fn cpu_seconds(pid: i32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat).map(|t| t as f64 / ticks_per_second())
}

/// Fields 14 and 15 of a `/proc/PID/stat` line (after the `(comm)`).
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14, stime 15.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

fn ticks_per_second() -> f64 {
    rustix::param::clock_ticks_per_second() as f64
}

/// The settings a running virtiofsd was started with: its arguments but
/// for the socket and the shared directory (which name this run).
pub fn virtiofsd_settings(pid: i32) -> Vec<String> {
    let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return Vec::new();
    };
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .skip(1)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    settings_of(&args)
}

fn settings_of(args: &[String]) -> Vec<String> {
    const PER_RUN: [&str; 2] = ["--socket-path", "--shared-dir"];
    let mut out = Vec::new();
    let mut skip_value = false;
    for a in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        if PER_RUN.contains(&a.as_str()) {
            skip_value = true;
        } else if !PER_RUN.iter().any(|f| a.starts_with(&format!("{f}="))) {
            out.push(a.clone());
        }
    }
    out
}

/// The virtiofsd processes below `parent` (the sandbox's shim starts one
/// per share; with `--sandbox namespace` it forks a child that serves).
pub fn virtiofsd_pids(parent: i32) -> Vec<i32> {
    let mut ppid: HashMap<i32, (i32, String)> = HashMap::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            let comm = stat
                .split_once('(')
                .and_then(|(_, r)| r.rsplit_once(')'))
                .map(|(c, _)| c.to_string())
                .unwrap_or_default();
            let pp = stat
                .rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1))
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            ppid.insert(pid, (pp, comm));
        }
    }
    let mut out: Vec<i32> = Vec::new();
    let mut frontier = vec![parent];
    while let Some(p) = frontier.pop() {
        for (pid, (pp, comm)) in &ppid {
            if *pp == p && comm.starts_with("virtiofsd") && !out.contains(pid) {
                out.push(*pid);
                frontier.push(*pid);
            }
        }
    }
    out.sort_unstable();
    out
}

/// CPU seconds of `pids` together (gone ones count 0).
pub fn total_cpu(pids: &[i32]) -> f64 {
    pids.iter().filter_map(|p| cpu_seconds(*p)).sum()
}

/// Writes dirty data back and drops the host's page cache, dentries and
/// inodes (machine-wide: the only way to make a read cold on the host).
pub fn drop_caches() -> Result<(), String> {
    rustix::fs::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| format!("writing /proc/sys/vm/drop_caches: {e}"))
}

/// Writes dirty data back (machine-wide).
pub fn sync() {
    rustix::fs::sync();
}

/// Whether this process may drop the host's caches.
pub fn can_drop_caches() -> bool {
    Path::new("/proc/sys/vm/drop_caches").exists() && rustix::process::geteuid().is_root()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_virtiofsd_s_settings_leave_out_what_names_the_run() {
        let args: Vec<String> = [
            "--socket-path",
            "/run/x/vfs.sock",
            "--shared-dir=/run/x/share",
            "--cache",
            "auto",
            "--xattr",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(settings_of(&args), ["--cache", "auto", "--xattr"]);
        assert!(virtiofsd_settings(i32::MAX).is_empty());
    }

    #[test]
    fn stat_fields() {
        // A comm with spaces and parentheses, utime 1234, stime 56.
        let line =
            "4242 (qemu (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 1234 56 0 0 20 0 3 0 100 0 0";
        assert_eq!(parse_cpu_ticks(line), Some(1290));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn own_cpu_time_grows() {
        let me = std::process::id() as i32;
        let a = cpu_seconds(me).unwrap();
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(150) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(cpu_seconds(me).unwrap() > a);
        assert_eq!(cpu_seconds(i32::MAX), None);
    }
}
