//! The full zero read on real loop devices: data only in the middle of a
//! device (invisible to `probe_fs`) is found at its offset, and an
//! all-zero device is reported so.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use crust_blockdev::{AttachOptions, LoopGuard, Probe, first_data_offset, probe_fs};

const MIB: u64 = 1 << 20;

fn disk(dir: &std::path::Path, name: &str, size: u64) -> (std::path::PathBuf, LoopGuard) {
    let img = dir.join(name);
    File::create(&img).unwrap().set_len(size).unwrap();
    let dev = LoopGuard::attach(&img, AttachOptions::default()).unwrap();
    (img, dev)
}

#[test]
fn data_in_the_middle_is_found_and_zeros_are_zeros() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let (_, zero) = disk(dir.path(), "zero.img", 64 * MIB);
    let (_, data) = disk(dir.path(), "data.img", 128 * MIB);
    // Written through the device (as a raw volume would be): first and
    // last MiB stay zero, no signature anywhere.
    let f = File::options().write(true).open(data.path()).unwrap();
    f.write_all_at(b"payload", 50 * MIB + 123).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(
        probe_fs(data.path()).unwrap(),
        Probe::Blank,
        "the edge probe misses it"
    );

    let mut seen = Vec::new();
    let found = first_data_offset(data.path(), &mut |d, t| seen.push((d, t))).unwrap();
    assert_eq!(found, Some(50 * MIB + 123));
    // Progress per chunk up to the chunk before the data.
    assert_eq!(seen.len(), 12, "{seen:?}");
    assert!(seen.iter().all(|&(_, t)| t == 128 * MIB));
    assert_eq!(seen.last().unwrap().0, 48 * MIB);

    let mut last = (0, 0);
    assert_eq!(
        first_data_offset(zero.path(), &mut |d, t| last = (d, t)).unwrap(),
        None
    );
    assert_eq!(last, (64 * MIB, 64 * MIB), "every byte read");
}

#[test]
fn data_in_the_last_sector_is_found() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    // 4 MiB + 512: the last read is shorter than a page.
    let (img, dev) = disk(dir.path(), "odd.img", 4 * MIB + 512);
    File::options()
        .write(true)
        .open(&img)
        .unwrap()
        .write_all_at(&[1], 4 * MIB + 511)
        .unwrap();
    assert_eq!(
        first_data_offset(dev.path(), &mut |_, _| {}).unwrap(),
        Some(4 * MIB + 511)
    );
}

/// The read rate on zero pages (a sparse backing file: what the device
/// returns costs nothing, so this is the scan's own cost). A benchmark:
/// `cargo test -p crust-blockdev --release --test zeros -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark; run with --ignored --nocapture"]
fn zero_read_rate() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    // Buffered loop (the first pass fills the backing file's page cache)
    // and direct-I/O loop (holes read without caching).
    for direct_io in [false, true] {
        let img = dir.path().join(format!("big-{direct_io}.img"));
        File::create(&img).unwrap().set_len(4096 * MIB).unwrap();
        let opts = AttachOptions {
            direct_io,
            ..AttachOptions::default()
        };
        let dev = LoopGuard::attach(&img, opts).unwrap();
        for pass in 0..2 {
            let t = Instant::now();
            assert_eq!(first_data_offset(dev.path(), &mut |_, _| {}).unwrap(), None);
            let s = t.elapsed().as_secs_f64();
            println!(
                "loop direct_io={direct_io} pass {pass}: 4 GiB of zeros in {s:.2} s: {:.2} GB/s",
                4096.0 * MIB as f64 / s / 1e9
            );
        }
    }
    // The check alone, from memory.
    let buf = vec![0u8; 256 << 20];
    let t = Instant::now();
    for _ in 0..8 {
        assert!(
            std::hint::black_box(&buf)
                .chunks(4096)
                .all(|b| b.iter().fold(0u8, |a, &x| a | x) == 0)
        );
    }
    let s = t.elapsed().as_secs_f64();
    println!(
        "zero check alone: {:.1} GB/s",
        8.0 * 256.0 * MIB as f64 / s / 1e9
    );
}
