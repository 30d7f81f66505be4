//! A heap buffer aligned for O_DIRECT (no unsafe code: an aligned window
//! into a larger vector).

/// The alignment O_DIRECT needs on every device crust uses.
pub const DIRECT_ALIGN: usize = 4096;

/// `len` zeroed bytes starting at a [`DIRECT_ALIGN`] boundary.
pub struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    pub fn new(len: usize) -> AlignedBuf {
        let storage = vec![0u8; len + DIRECT_ALIGN];
        let addr = storage.as_ptr() as usize;
        let start = (DIRECT_ALIGN - addr % DIRECT_ALIGN) % DIRECT_ALIGN;
        AlignedBuf {
            storage,
            start,
            len,
        }
    }

    /// `len` bytes of `fill`.
    pub fn filled(len: usize, fill: u8) -> AlignedBuf {
        let mut b = AlignedBuf::new(len);
        b.as_mut_slice().fill(fill);
        b
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn aligned_and_of_the_asked_length() {
        for len in [0, 1, 4096, 12345] {
            let b = super::AlignedBuf::filled(len, 7);
            assert_eq!(b.as_slice().len(), len);
            assert_eq!(b.as_slice().as_ptr() as usize % super::DIRECT_ALIGN, 0);
            assert!(b.as_slice().iter().all(|&x| x == 7));
        }
    }
}
