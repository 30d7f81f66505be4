//! Measures launch → first agent Ping of the crust guest.
//!
//! `cargo run -p crust-vmm --example boot_time -- [N]` (needs the image from
//! guest/build-image.sh; holds a test VM slot while it runs).

use std::time::{Duration, Instant};

use crust_agent_proto::AgentClient;
use crust_vmm::{Vm, VmConfig};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let _slot = crust_testkit::VmSlot::acquire();
    let (kernel, initrd) = crust_testkit::guest_image();
    let mut times = Vec::new();
    for i in 0..n {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = VmConfig::new(
            format!("boot-{i}"),
            &kernel,
            &initrd,
            dir.path().join("run"),
        );
        cfg.die_with_parent = true;
        if let Some(tb) = std::env::var("CRUST_TCG_TB_MIB")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            cfg.tcg_tb_mib = tb;
        }
        let t0 = Instant::now();
        let mut vm = Vm::launch(cfg).await.expect("launch");
        let launched = t0.elapsed();
        let agent = AgentClient::new(vm.agent_socket());
        agent
            .wait_ready(Duration::from_secs(120))
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", vm.failure_context()));
        let ready = t0.elapsed();
        println!(
            "boot {i}: TCG translation buffer resident {} KiB",
            tb_resident_kib(vm.pid())
        );
        agent.shutdown().await.expect("shutdown");
        let exit = vm.wait_exit(Duration::from_secs(30)).await;
        let gone = t0.elapsed();
        println!(
            "boot {i}: qemu up {launched:?}, agent ping {ready:?}, powered off {gone:?} ({:?}, {exit:?})",
            vm.accel()
        );
        times.push(ready);
    }
    times.sort();
    println!("median launch -> ping: {:?}", times[times.len() / 2]);
}

/// Resident KiB of QEMU's executable anonymous mappings (TCG's
/// translation buffer, in regions with several vCPUs; none under KVM).
fn tb_resident_kib(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let (mut total, mut tb) = (0, false);
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if let Some((a, b)) = f.first().and_then(|r| r.split_once('-'))
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            tb = f.get(1).is_some_and(|p| p.contains('x')) && f.len() == 5 && b > a;
        } else if tb && let Some(v) = l.strip_prefix("Rss:") {
            total += v
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap_or(0);
        }
    }
    total
}
