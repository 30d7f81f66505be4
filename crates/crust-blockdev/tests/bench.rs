//! Latency of loop attach + detach (and of finding a device again by its
//! backing file), and of the `/proc/*/fd` scan for other openers. A
//! benchmark, not a test: run with
//! `cargo test -p crust-blockdev --release --test bench -- --ignored --nocapture`.

use std::fs::File;
use std::time::{Duration, Instant};

use crust_blockdev::{
    AttachOptions, LoopDevice, LoopGuard, detach, device_openers, find_by_backing,
};

fn stats(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let pct = |p: usize| v[(v.len() * p / 100).min(v.len() - 1)];
    println!(
        "{name}: n={} min={:?} p50={:?} p95={:?} max={:?}",
        v.len(),
        v[0],
        pct(50),
        pct(95),
        v[v.len() - 1]
    );
}

#[test]
#[ignore = "benchmark; run with --ignored --nocapture"]
fn attach_detach_latency() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("bench.img");
    File::create(&img).unwrap().set_len(64 << 20).unwrap();
    let rounds = 100;
    let (mut attach, mut find, mut det, mut total) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let t0 = Instant::now();
        let info = LoopDevice::attach(&img, AttachOptions::default()).unwrap();
        let guard = LoopGuard::adopt(info.clone());
        let t1 = Instant::now();
        assert_eq!(find_by_backing(&img).unwrap(), Some(info.path.clone()));
        let t2 = Instant::now();
        detach(&info.path).unwrap();
        let t3 = Instant::now();
        drop(guard);
        attach.push(t1 - t0);
        find.push(t2 - t1);
        det.push(t3 - t2);
        total.push((t1 - t0) + (t3 - t2));
    }
    stats("attach", attach);
    stats("find_by_backing", find);
    stats("detach", det);
    stats("attach+detach", total);
}

#[test]
#[ignore = "benchmark; run with --ignored --nocapture"]
fn device_openers_scan_latency() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("scan.img");
    File::create(&img).unwrap().set_len(16 << 20).unwrap();
    let guard = LoopGuard::attach(&img, AttachOptions::default()).unwrap();
    let (procs, fds) = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .fold((0, 0), |(p, f), pid| {
            let n = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
            (p + 1, f + n)
        });
    let mut v = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        assert!(device_openers(guard.path()).unwrap().is_empty());
        v.push(t.elapsed());
    }
    println!("{procs} processes, {fds} descriptors");
    stats("device_openers", v);
}
