//! A log-linear latency histogram with bounded memory.
//!
//! Values (microseconds) below 128 get one bucket each, so they are exact.
//! Above that, each power of two `[2^e, 2^(e+1))` is split into 64 equal
//! buckets, so a bucket is at most 1/64 (~1.6%) of its values wide. A
//! percentile reports the upper edge of the bucket it falls in, clamped to
//! the exact maximum: it never under-reports, and over-reports by < 1.6%.
//! Memory is fixed (3,776 counters, ~30 KiB) whatever the run length, so
//! `--duration` runs cannot grow without bound.

const EXACT: u64 = 128;
const HALF: u64 = 64;
const BUCKETS: usize = (57 * HALF + 128) as usize;

#[derive(Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
    sum: u128,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            max: 0,
            sum: 0,
        }
    }
}

fn index(v: u64) -> usize {
    if v < EXACT {
        return v as usize;
    }
    let e = 63 - v.leading_zeros() as u64; // >= 7
    let shift = e - 6;
    (shift * HALF + (v >> shift)) as usize
}

/// Largest value that lands in bucket `i`.
fn upper(i: usize) -> u64 {
    let i = i as u64;
    if i < EXACT {
        return i;
    }
    let shift = i / HALF - 1;
    let top = i - shift * HALF;
    // the last bucket's edge is 2^64, which wraps to 0 before the -1
    ((top + 1) << shift).wrapping_sub(1)
}

impl Histogram {
    pub fn record(&mut self, micros: u64) {
        self.counts[index(micros)] += 1;
        self.total += 1;
        self.max = self.max.max(micros);
        self.sum += micros as u128;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    pub fn mean(&self) -> u64 {
        if self.total == 0 {
            0
        } else {
            (self.sum / self.total as u128) as u64
        }
    }

    /// Nearest-rank percentile: the smallest recorded bucket such that at
    /// least `p`% of the samples are at or below it. 0 when empty.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((p / 100.0) * self.total as f64)
            .ceil()
            .clamp(1.0, self.total as f64) as u64;
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return upper(i).min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_cover_u64() {
        assert_eq!(index(127), 127);
        assert_eq!(index(128), 128);
        assert_eq!(upper(128), 129);
        assert_eq!(index(129), 128);
        assert_eq!(index(130), 129);
        assert_eq!(index(u64::MAX), BUCKETS - 1);
        assert_eq!(upper(BUCKETS - 1), u64::MAX);
        // every bucket's upper edge + 1 starts the next bucket
        for i in 0..BUCKETS - 1 {
            assert_eq!(index(upper(i)), i, "bucket {i}");
            assert_eq!(index(upper(i) + 1), i + 1, "bucket {i}");
        }
    }

    #[test]
    fn exact_for_small_values() {
        let mut h = Histogram::default();
        for v in 1..=100 {
            h.record(v);
        }
        assert_eq!(h.count(), 100);
        assert_eq!(h.percentile(50.0), 50);
        assert_eq!(h.percentile(95.0), 95);
        assert_eq!(h.percentile(99.0), 99);
        assert_eq!(h.percentile(100.0), 100);
        assert_eq!(h.percentile(0.0), 1);
        assert_eq!(h.max(), 100);
        assert_eq!(h.mean(), 50);
    }

    #[test]
    fn empty_is_zero() {
        let h = Histogram::default();
        assert_eq!(h.percentile(99.0), 0);
        assert_eq!(h.max(), 0);
    }

    #[test]
    fn bounded_relative_error_for_large_values() {
        // deterministic spread over five decades
        let mut samples: Vec<u64> = (0..10_000u64)
            .map(|i| 200 + (i * 7919 % 10_000) * (1 + i % 997))
            .collect();
        let mut h = Histogram::default();
        for &s in &samples {
            h.record(s);
        }
        samples.sort_unstable();
        for p in [50.0, 90.0, 95.0, 99.0, 99.9] {
            let rank = ((p / 100.0) * samples.len() as f64).ceil() as usize;
            let exact = samples[rank - 1];
            let est = h.percentile(p);
            assert!(est >= exact, "p{p}: {est} < {exact}");
            assert!(
                (est - exact) as f64 <= exact as f64 / 64.0,
                "p{p}: {est} vs {exact}"
            );
        }
        assert_eq!(h.max(), *samples.last().unwrap());
        assert_eq!(h.percentile(100.0), h.max());
    }

    #[test]
    fn single_sample() {
        let mut h = Histogram::default();
        h.record(1_234_567);
        for p in [1.0, 50.0, 99.0] {
            assert_eq!(h.percentile(p), 1_234_567);
        }
    }
}
