//! A full read of a device for any non-zero byte.
//!
//! [`crate::probe_fs`] reads signatures and the edges only, so data without
//! a signature in the middle of a device (a raw volume, an operator's
//! image) looks blank to it. Before crust formats a device nobody proved
//! blank otherwise, the whole device is read once: this module does that
//! read. It is slow by nature (the device's size at its read rate), so
//! callers run it in the background and record the verdict.

use std::io;
use std::ops::ControlFlow;
use std::path::Path;

use crate::probe::{ProbeError, open_sized};
use crate::sys;

/// Bytes read per `pread`: large enough that the syscall and the device's
/// per-request cost vanish, small enough that progress moves.
pub const SCAN_CHUNK: usize = 4 << 20;

/// What a full read found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroScan {
    /// Every byte is zero.
    AllZero,
    /// The first non-zero byte is at this offset.
    DataAt(u64),
    /// The caller's progress callback asked to stop after `done` bytes.
    Stopped { done: u64 },
}

/// Reads the whole of `dev` (a block device or a regular file) and returns
/// `None` when every byte is zero, else the offset of the first non-zero
/// byte. `progress(done, total)` is called after each chunk. Reads with
/// `O_DIRECT` where the device allows it, so a stale page cache cannot
/// make data look like zeros (as [`crate::probe_fs`]).
pub fn first_data_offset(
    dev: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Option<u64>, ProbeError> {
    let found = scan_for_data(dev, &mut |done, total| {
        progress(done, total);
        ControlFlow::Continue(())
    })?;
    Ok(match found {
        ZeroScan::AllZero => None,
        ZeroScan::DataAt(offset) => Some(offset),
        ZeroScan::Stopped { .. } => unreachable!("the callback never stops"),
    })
}

/// [`first_data_offset`] that the caller can stop between chunks (a
/// background scan whose owner went away).
pub fn scan_for_data(
    dev: &Path,
    progress: &mut dyn FnMut(u64, u64) -> ControlFlow<()>,
) -> Result<ZeroScan, ProbeError> {
    let err = |source: io::Error| ProbeError {
        path: dev.to_path_buf(),
        source,
    };
    let (fd, size) = open_sized(dev)?;
    let mut buf = sys::AlignedBuf::new(SCAN_CHUNK);
    let mut done = 0u64;
    while done < size {
        let want = (size - done).min(SCAN_CHUNK as u64) as usize;
        // O_DIRECT needs an aligned length; a device's end is sector
        // aligned, so the padded read just comes back short.
        let padded = want.div_ceil(sys::DIRECT_ALIGN) * sys::DIRECT_ALIGN;
        let n = sys::pread_full(&fd, &mut buf.as_mut_slice()[..padded], done).map_err(err)?;
        if n < want {
            // The size was read at open: a device that shrank under the
            // read was not fully read, and a partial read proves nothing.
            return Err(err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "device ended at byte {} while {size} bytes were expected",
                    done + n as u64
                ),
            )));
        }
        if let Some(at) = first_nonzero(&buf.as_slice()[..want]) {
            return Ok(ZeroScan::DataAt(done + at as u64));
        }
        done += want as u64;
        if progress(done, size).is_break() {
            return Ok(ZeroScan::Stopped { done });
        }
    }
    Ok(ZeroScan::AllZero)
}

/// Offset of the first non-zero byte. OR-folding a page at a time has no
/// early exit inside the page, so the compiler vectorises it; the byte
/// search runs only in the one page that holds data.
fn first_nonzero(buf: &[u8]) -> Option<usize> {
    const BLOCK: usize = 4096;
    buf.chunks(BLOCK).enumerate().find_map(|(i, block)| {
        if block.iter().fold(0u8, |acc, &b| acc | b) == 0 {
            return None;
        }
        block.iter().position(|&b| b != 0).map(|p| i * BLOCK + p)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_first_non_zero_byte() {
        let mut buf = vec![0u8; 3 * 4096 + 100];
        assert_eq!(first_nonzero(&buf), None);
        buf[3 * 4096 + 99] = 1;
        assert_eq!(first_nonzero(&buf), Some(3 * 4096 + 99));
        buf[4097] = 0x80;
        assert_eq!(first_nonzero(&buf), Some(4097));
        buf[0] = 2;
        assert_eq!(first_nonzero(&buf), Some(0));
        assert_eq!(first_nonzero(&[]), None);
    }

    #[test]
    fn regular_files_too() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("img");
        // Not a multiple of the O_DIRECT alignment: the last read is short.
        std::fs::write(&f, vec![0u8; 10_000]).unwrap();
        let mut calls = Vec::new();
        let found = first_data_offset(&f, &mut |d, t| calls.push((d, t))).unwrap();
        assert_eq!(found, None);
        assert_eq!(calls, [(10_000, 10_000)]);
        let mut bytes = vec![0u8; 10_000];
        bytes[9_999] = 7;
        std::fs::write(&f, &bytes).unwrap();
        assert_eq!(first_data_offset(&f, &mut |_, _| {}).unwrap(), Some(9_999));
        let err = first_data_offset(&dir.path().join("nope"), &mut |_, _| {}).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }
}
