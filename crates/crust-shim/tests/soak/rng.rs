//! A seeded generator (SplitMix64): the same seed gives the same sequence
//! of operations, so a failing soak can be replayed with its printed seed.

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }

    /// An index picked by `weights` (not all zero).
    pub fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u64 = weights.iter().map(|w| u64::from(*w)).sum();
        let mut x = self.next_u64() % total;
        for (i, w) in weights.iter().enumerate() {
            if x < u64::from(*w) {
                return i;
            }
            x -= u64::from(*w);
        }
        unreachable!("x < total")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_seed_gives_one_sequence() {
        let a: Vec<u64> = (0..5)
            .map({
                let mut r = super::Rng::new(42);
                move |_| r.next_u64()
            })
            .collect();
        let mut r = super::Rng::new(42);
        assert_eq!(a, (0..5).map(|_| r.next_u64()).collect::<Vec<_>>());
        assert_ne!(a[0], super::Rng::new(43).next_u64());
    }
}
