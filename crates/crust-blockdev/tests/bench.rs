//! Latency of loop attach + detach (and of finding a device again by its
//! backing file), of the `/proc/*/fd` scan for other openers, and of a
//! claim's alias scan with 0 and 1,000 foreign loop devices. A
//! benchmark, not a test: run with
//! `cargo test -p crust-blockdev --release --test bench -- --ignored --nocapture`.

use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};

use crust_blockdev::{
    AttachOptions, HAND_TO_GUEST, LoopDevice, LoopGuard, claim_exclusive, detach, device_openers,
    ensure_no_aliases, find_by_backing, list_loops,
};

fn stats(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let pct = |p: usize| v[(v.len() * p / 100).min(v.len() - 1)];
    println!(
        "{name}: n={} min={:?} p50={:?} p95={:?} p99={:?} max={:?}",
        v.len(),
        v[0],
        pct(50),
        pct(95),
        pct(99),
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

/// Loop devices a host tool attached (sparse files of their own), detached
/// on drop, and the devices this added to the node removed again, so it
/// is left with the devices it had.
struct ForeignLoops {
    loops: Vec<LoopGuard>,
    existed: std::collections::BTreeSet<String>,
    _dir: tempfile::TempDir,
}

fn sys_block_names() -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/sys/block")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

impl ForeignLoops {
    fn attach(n: usize) -> ForeignLoops {
        let dir = tempfile::tempdir().unwrap();
        let existed = sys_block_names();
        let mut loops = Vec::with_capacity(n);
        for i in 0..n {
            let f = dir.path().join(format!("foreign-{i}.img"));
            File::create(&f).unwrap().set_len(1 << 20).unwrap();
            loops.push(LoopGuard::attach(&f, AttachOptions::default()).unwrap());
        }
        ForeignLoops {
            loops,
            existed,
            _dir: dir,
        }
    }
}

impl Drop for ForeignLoops {
    fn drop(&mut self) {
        let added: Vec<u32> = self
            .loops
            .iter()
            .map(|g| g.info().number)
            .filter(|n| !self.existed.contains(&format!("loop{n}")))
            .collect();
        self.loops.clear(); // detaches
        // LOOP_CTL_REMOVE: the kernel refuses (EBUSY) a device someone
        // bound or opened meanwhile, so only idle ones go.
        let Ok(ctl) = rustix::fs::open(
            "/dev/loop-control",
            rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ) else {
            return;
        };
        for n in added {
            let _ = crust_sys::loopdev::ctl_remove(&ctl, n);
        }
    }
}

fn time_claims(label: &str, dev: &Path, rounds: usize) {
    let (mut claim, mut scan) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        drop(claim_exclusive(dev, true, HAND_TO_GUEST).unwrap());
        claim.push(t.elapsed());
        let t = Instant::now();
        ensure_no_aliases(dev, HAND_TO_GUEST).unwrap();
        scan.push(t.elapsed());
    }
    let bound = list_loops().unwrap().len();
    println!("{label}: {bound} bound loop devices on the node");
    stats(&format!("{label}: claim_exclusive"), claim);
    stats(&format!("{label}: alias scan alone"), scan);
}

/// Issue 24: the alias check's cost, with the node's own loop devices and
/// with 1,000 foreign ones more.
#[test]
#[ignore = "benchmark; run with --ignored --nocapture"]
fn alias_check_latency_with_1000_foreign_loops() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("vol.img");
    File::create(&img).unwrap().set_len(64 << 20).unwrap();
    let vol = LoopGuard::attach(&img, AttachOptions::default()).unwrap();
    time_claims("0 foreign", vol.path(), 200);
    let t = Instant::now();
    let foreign = ForeignLoops::attach(1000);
    println!("attaching 1,000 foreign loops took {:?}", t.elapsed());
    time_claims("1,000 foreign", vol.path(), 200);
    drop(foreign);
}
