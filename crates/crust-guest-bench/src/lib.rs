//! crust-guest-bench: the parts of `crustctl bench --guest-io` that run
//! inside the guest and that fio cannot express. A small static binary in
//! the bench guest image (`guest/build-image.sh --bench`); every mode
//! prints one JSON object on stdout.
//!
//! - [`meta`]: create + write + fsync + stat of N small files, then unlink
//!   of each (per-operation latencies); building a tree of N entries; a
//!   `find`-style walk (readdir + lstat of every entry).
//! - [`features`]: native filesystem features exercised for real, each
//!   reported as works / fails with the error: O_DIRECT, xattrs, POSIX
//!   ACLs (enforced for another uid), fallocate + punch hole, flock and
//!   fcntl locks across two processes, inotify, mmap shared writes, and
//!   the statfs figures (compared with CSI stats by crustctl).

pub mod features;
pub mod meta;

use std::time::Duration;

/// Latency summary of a batch of operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latency {
    pub count: usize,
    pub total: Duration,
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
}

impl Latency {
    /// Nearest-rank percentiles of `samples` (sorted in place).
    pub fn of(samples: &mut [Duration]) -> Latency {
        samples.sort_unstable();
        let rank = |p: f64| -> Duration {
            if samples.is_empty() {
                return Duration::ZERO;
            }
            let i = ((p / 100.0) * samples.len() as f64).ceil() as usize;
            samples[i.clamp(1, samples.len()) - 1]
        };
        Latency {
            count: samples.len(),
            total: samples.iter().sum(),
            p50: rank(50.0),
            p99: rank(99.0),
            max: samples.last().copied().unwrap_or_default(),
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "count": self.count,
            "total_s": self.total.as_secs_f64(),
            "ops_per_s": if self.total.is_zero() { 0.0 } else { self.count as f64 / self.total.as_secs_f64() },
            "p50_us": self.p50.as_secs_f64() * 1e6,
            "p99_us": self.p99.as_secs_f64() * 1e6,
            "max_us": self.max.as_secs_f64() * 1e6,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let l = Latency::of(&mut v);
        assert_eq!(l.count, 100);
        assert_eq!(l.p50, Duration::from_micros(50));
        assert_eq!(l.p99, Duration::from_micros(99));
        assert_eq!(l.max, Duration::from_micros(100));
        assert_eq!(l.total, Duration::from_micros(5050));
        let one = Latency::of(&mut [Duration::from_millis(3)]);
        assert_eq!(
            (one.p50, one.p99),
            (Duration::from_millis(3), Duration::from_millis(3))
        );
        assert_eq!(Latency::of(&mut []).p99, Duration::ZERO);
    }
}
