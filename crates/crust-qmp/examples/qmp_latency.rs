//! QMP round-trip latency against a real, paused QEMU (TCG):
//! `cargo run --release -p crust-qmp --example qmp_latency [calls]`.
//!
//! Prints p50/p99/max of sequential `query-status` calls, then the
//! throughput of the same number of calls issued from 8 concurrent tasks
//! over the one connection.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crust_qmp::QmpClient;
use crust_testkit::{ChildGuard, VmSlot};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let calls: usize = match std::env::args().nth(1) {
        Some(n) => n.parse()?,
        None => 1000,
    };
    let _slot = tokio::task::spawn_blocking(VmSlot::acquire).await?;
    let dir = tempfile::tempdir()?;
    let sock = dir.path().join("qmp.sock");
    let child = Command::new("qemu-system-x86_64")
        .args(["-M", "q35", "-accel", "tcg", "-m", "64"])
        .args(["-nodefaults", "-display", "none", "-S"])
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", sock.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()?;
    let _qemu = ChildGuard::new(child);
    let qmp = Arc::new(QmpClient::connect(&sock, Duration::from_secs(20)).await?);
    let v = qmp.version();
    println!("QEMU {}.{}.{} ({})", v.major, v.minor, v.micro, v.package);

    for _ in 0..100 {
        qmp.query_status().await?;
    }
    let mut lat = Vec::with_capacity(calls);
    for _ in 0..calls {
        let t = Instant::now();
        qmp.query_status().await?;
        lat.push(t.elapsed());
    }
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!(
        "sequential query-status x{calls}: p50 {:?}  p99 {:?}  max {:?}",
        pct(0.50),
        pct(0.99),
        lat[lat.len() - 1]
    );

    let tasks = 8;
    let t = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let qmp = qmp.clone();
        let n = calls / tasks;
        handles.push(tokio::spawn(async move {
            for _ in 0..n {
                qmp.query_status().await?;
            }
            Ok::<_, crust_qmp::QmpError>(())
        }));
    }
    for h in handles {
        h.await??;
    }
    let total = calls / tasks * tasks;
    let secs = t.elapsed().as_secs_f64();
    println!(
        "concurrent ({tasks} tasks) query-status x{total}: {:.0} calls/s",
        total as f64 / secs
    );
    qmp.quit().await?;
    Ok(())
}
