//! Figures, not assertions (run explicitly):
//! `cargo test -p crust-runtime --test bench -- --ignored --nocapture`
//!
//! - sandbox create + start to workload running, one volume;
//! - `crust stats` latency through the CLI (process spawn included);
//! - `crust resize` end to end (loop refresh, QMP block_resize, resize2fs).

mod common;

use std::time::{Duration, Instant};

use common::*;
use crust_blockdev::FsType;
use crust_handoff::{Layout, MountInfo};
use crust_testkit::VmSlot;

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn bench_runtime() {
    let env = Env::new();
    {
        let disk = env.disk("bench.img", 64 * MIB, FsType::Ext4);
        let target = env.target("pod-b", "pv-b");
        env.stage(
            Layout::Crust,
            &target,
            &MountInfo::block(disk.dev_str(), "ext4"),
        );
        let bundle = env.bundle("b", &["sleep", "600"], vec![bind("/data", &target, false)]);
        let _slot = VmSlot::acquire();

        let mut starts = Vec::new();
        for i in 0..3 {
            let id = format!("bench{i}");
            let sb = env.sandbox(&id);
            let t0 = Instant::now();
            env.ok(&["create", "--bundle", bundle.to_str().unwrap(), &id]);
            let created = t0.elapsed();
            env.ok(&["start", &id]);
            let started = t0.elapsed();
            assert_eq!(sb.state()["status"], "running");
            println!(
                "run {i}: create {} (boot + hot-plug + mount), create+start {}",
                ms(created),
                ms(started)
            );
            starts.push(started);
            if i < 2 {
                drop(sb);
                continue;
            }

            let mut lat = Vec::new();
            for _ in 0..100 {
                let t = Instant::now();
                env.ok(&["crust", "stats", &target]);
                lat.push(t.elapsed());
            }
            lat.sort();
            println!(
                "crust stats via CLI (100 calls): p50 {}  p99 {}  max {}",
                ms(pct(&lat, 0.5)),
                ms(pct(&lat, 0.99)),
                ms(*lat.last().unwrap())
            );

            let mut rs = Vec::new();
            for k in 1..=4u64 {
                let size = (64 + 16 * k) * MIB;
                disk.grow_file(size);
                let t = Instant::now();
                env.ok(&["crust", "resize", &target, &size.to_string(), "0"]);
                rs.push(t.elapsed());
            }
            rs.sort();
            println!(
                "crust resize end to end (4 x +16 MiB, ext4): median {}  max {}",
                ms(pct(&rs, 0.5)),
                ms(*rs.last().unwrap())
            );
        }
        starts.sort();
        println!(
            "sandbox create+start, one volume (3 runs): median {}",
            ms(pct(&starts, 0.5))
        );
    }
    assert_clean(&env);
}
