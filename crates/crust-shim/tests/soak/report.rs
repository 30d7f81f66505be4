//! What a soak saw: operations and faults by kind, anomalies (each with
//! what was expected and what was seen), and crust-csi's RSS and open fds
//! sampled between operations.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// One sample of crust-csi's footprint.
#[derive(Clone, Copy, Debug)]
pub struct Footprint {
    pub at: Duration,
    pub pid: u32,
    pub rss_kib: u64,
    pub fds: usize,
}

impl Footprint {
    /// Reads `/proc/<pid>`; None when the process is gone.
    pub fn of(pid: u32, at: Duration) -> Option<Footprint> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
        Some(Footprint {
            at,
            pid,
            rss_kib,
            fds,
        })
    }
}

/// Growth within one crust-csi process beyond which it is not flat.
pub const MAX_FD_GROWTH: usize = 16;
pub const MAX_RSS_GROWTH_KIB: u64 = 32 * 1024;

#[derive(Default)]
pub struct Report {
    pub seed: u64,
    pub elapsed: Duration,
    pub ops: BTreeMap<&'static str, u64>,
    pub faults: BTreeMap<&'static str, u64>,
    pub anomalies: Vec<String>,
    pub samples: Vec<Footprint>,
}

impl Report {
    pub fn op(&mut self, kind: &'static str) {
        *self.ops.entry(kind).or_default() += 1;
    }

    pub fn fault(&mut self, kind: &'static str) {
        *self.faults.entry(kind).or_default() += 1;
    }

    pub fn anomaly(&mut self, at: Duration, what: &str, expected: &str, seen: &str) {
        let a = format!(
            "[{:>7.1}s] {what}: expected {expected}; saw {seen}",
            at.as_secs_f64()
        );
        eprintln!("soak anomaly {a}");
        self.anomalies.push(a);
    }

    /// Flatness per crust-csi process (a restart starts a new baseline):
    /// its last sample against its second (the first follows its start
    /// before any request has warmed it up).
    pub fn check_footprint(&mut self) {
        let mut by_pid: BTreeMap<u32, Vec<Footprint>> = BTreeMap::new();
        for s in &self.samples {
            by_pid.entry(s.pid).or_default().push(*s);
        }
        let mut found = Vec::new();
        for (pid, v) in by_pid {
            let (Some(base), Some(last)) = (v.get(1).or(v.first()), v.last()) else {
                continue;
            };
            if last.fds > base.fds + MAX_FD_GROWTH
                || last.rss_kib > base.rss_kib + MAX_RSS_GROWTH_KIB
            {
                found.push((
                    last.at,
                    format!("crust-csi pid {pid} footprint"),
                    format!(
                        "fds <= {} and RSS <= {} KiB (flat within +{MAX_FD_GROWTH} fds, +{MAX_RSS_GROWTH_KIB} KiB)",
                        base.fds + MAX_FD_GROWTH,
                        base.rss_kib + MAX_RSS_GROWTH_KIB
                    ),
                    format!("{} fds, {} KiB after {:.0}s", last.fds, last.rss_kib, (last.at - base.at).as_secs_f64()),
                ));
            }
        }
        for (at, what, exp, seen) in found {
            self.anomaly(at, &what, &exp, &seen);
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "=== soak summary: seed {} ({:.0} s) ===",
            self.seed,
            self.elapsed.as_secs_f64()
        )?;
        let line = |m: &BTreeMap<&str, u64>| {
            let total: u64 = m.values().sum();
            let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
            format!("{total} ({})", parts.join(", "))
        };
        writeln!(f, "operations: {}", line(&self.ops))?;
        writeln!(f, "faults injected: {}", line(&self.faults))?;
        let fp = |s: Option<&Footprint>| {
            s.map_or("-".to_string(), |s| {
                format!(
                    "pid {} RSS {} KiB, {} fds at {:.0}s",
                    s.pid,
                    s.rss_kib,
                    s.fds,
                    s.at.as_secs_f64()
                )
            })
        };
        writeln!(f, "crust-csi start: {}", fp(self.samples.first()))?;
        writeln!(f, "crust-csi end:   {}", fp(self.samples.last()))?;
        if let (Some(r), Some(d)) = (
            self.samples.iter().map(|s| s.rss_kib).max(),
            self.samples.iter().map(|s| s.fds).max(),
        ) {
            writeln!(
                f,
                "crust-csi max:   RSS {r} KiB, {d} fds ({} samples)",
                self.samples.len()
            )?;
        }
        writeln!(f, "anomalies: {}", self.anomalies.len())?;
        for a in &self.anomalies {
            writeln!(f, "  {a}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(pid: u32, secs: u64, rss_kib: u64, fds: usize) -> Footprint {
        Footprint {
            at: Duration::from_secs(secs),
            pid,
            rss_kib,
            fds,
        }
    }

    #[test]
    fn growth_within_one_process_is_an_anomaly_a_restart_is_not() {
        // pid 1 warms up, then stays flat; pid 2 (after a restart) starts low.
        let mut r = Report {
            samples: vec![
                at(1, 0, 9000, 10),
                at(1, 5, 16000, 15),
                at(1, 60, 17000, 16),
            ],
            ..Default::default()
        };
        r.samples.push(at(2, 61, 8000, 9));
        r.samples.push(at(2, 70, 16000, 15));
        r.check_footprint();
        assert!(r.anomalies.is_empty(), "{:?}", r.anomalies);
        r.samples.push(at(2, 900, 16000, 15 + MAX_FD_GROWTH + 1));
        r.check_footprint();
        assert_eq!(r.anomalies.len(), 1, "fds leak");
        r.samples
            .push(at(2, 901, 16000 + MAX_RSS_GROWTH_KIB + 1, 15));
        r.anomalies.clear();
        r.check_footprint();
        assert_eq!(r.anomalies.len(), 1, "RSS grows: {:?}", r.anomalies);
    }
}
