//! Figures, not assertions (run explicitly):
//! `cargo test --release -p crust-shim --test bench -- --ignored --nocapture`
//!
//! - pod start with one deferred volume, RunPodSandbox → CreateContainer →
//!   StartContainer returned, through containerd's CRI and the crust shim,
//!   next to `crust-runtime create` + `start` of the same workload;
//! - per-pod host memory: RSS of shim + virtiofsd + QEMU (containerd), of
//!   shim + QEMU (crust-runtime CLI).
//!
//! `CRUST_BENCH_PODS` sets the number of pods per front door (default 5).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Env, MIB, host_network_sandbox, qemus_under};
use crust_blockdev::FsType;
use crust_cri::Cri;
use crust_cri::v1 as cri;
use crust_handoff::{Layout, MountInfo, Store};

const POD_UID: &str = "bench-0000-4000-8000-000000000001";

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

/// VmRSS of `pid` in bytes.
fn rss(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(0)
        * 1024
}

fn pids_named(name: &str, needle: &Path) -> Vec<i32> {
    let n = needle.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = String::from_utf8_lossy(&std::fs::read(e.path().join("cmdline")).ok()?)
                .into_owned();
            (cmd.contains(name) && cmd.contains(&n) && crust_testkit::pid_alive(pid)).then_some(pid)
        })
        .collect()
}

fn summary(name: &str, v: &mut [Duration]) {
    v.sort();
    println!(
        "{name:<28} n={:<3} p50 {:>8}  p95 {:>8}  min {:>8}  max {:>8}",
        v.len(),
        ms(pct(v, 0.5)),
        ms(pct(v, 0.95)),
        ms(v[0]),
        ms(*v.last().unwrap())
    );
}

fn write_bundle(dir: &Path, target: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"args": ["sleep", "600"], "cwd": "/", "user": {"uid": 0, "gid": 0}, "env": ["PATH=/bin"]},
        "root": {"path": "rootfs"},
        "mounts": [{"destination": "/data", "type": "bind", "source": target, "options": ["rbind", "rw"]}],
    });
    std::fs::write(dir.join("config.json"), spec.to_string()).unwrap();
    dir.to_path_buf()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with --ignored --nocapture"]
async fn bench_pod_start_and_memory() {
    let n: usize = std::env::var("CRUST_BENCH_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let disk =
        crust_testkit::LoopDisk::with_fs(env.dir.path().join("vol.img"), 64 * MIB, FsType::Ext4);
    let target = env
        .pods_dir
        .join(POD_UID)
        .join("volumes/kubernetes.io~csi/pv/mount");
    std::fs::create_dir_all(&target).unwrap();
    let target = target.display().to_string();
    let records = Store::new(Layout::Crust, env.crust_root.clone(), Default::default()).unwrap();
    records
        .stage(&target, &MountInfo::block(disk.dev_str(), "ext4"))
        .unwrap();

    // --- containerd + crust shim --------------------------------------------------
    let mut cri_client = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let mut cri_times = Vec::new();
    let mut cri_rss = Vec::new();
    for i in 0..n {
        let sb_cfg = host_network_sandbox(&format!("bench-{i}"), POD_UID, i as u32);
        let t0 = Instant::now();
        let (sb, _) = env
            .start_busybox_pod(
                &mut cri_client,
                &sb_cfg,
                &["sleep", "600"],
                vec![cri::Mount {
                    container_path: "/data".into(),
                    host_path: target.clone(),
                    ..Default::default()
                }],
            )
            .await;
        cri_times.push(t0.elapsed());
        let mut total = 0;
        for p in qemus_under(&env.runtime_root)
            .into_iter()
            .chain(pids_named("virtiofsd", &env.runtime_root))
            .chain(env.ctrd.shim_pids())
        {
            total += rss(p);
        }
        cri_rss.push(total);
        cri_client
            .runtime
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: sb.clone(),
            })
            .await
            .unwrap();
        cri_client
            .runtime
            .remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: sb })
            .await
            .unwrap();
    }

    // --- crust-runtime CLI ------------------------------------------------------------
    let rt = crust_testkit::workspace_bin("crust-runtime");
    let run = |args: &[&str]| {
        let o = Command::new(&rt)
            .args(args)
            .env("CRUST_RUNTIME_ROOT", &env.runtime_root)
            .env("CRUST_RUNTIME_CRUST_ROOT", &env.crust_root)
            .env("CRUST_RUNTIME_KATA_ROOT", &env.kata_root)
            .env("CRUST_RUNTIME_PODS_LAYER_STOP", &env.pods_dir)
            .env("CRUST_RUNTIME_ACCEL", "tcg")
            .env("CRUST_GUEST_DIR", crust_testkit::guest_image_dir())
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "crust-runtime {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let bundle = write_bundle(&env.dir.path().join("cli-bundle"), &target);
    let bundle = bundle.to_str().unwrap().to_string();
    let mut cli_times = Vec::new();
    let mut cli_rss = Vec::new();
    for i in 0..n {
        let id = format!("clibench{i}");
        let t0 = Instant::now();
        run(&["create", "--bundle", &bundle, &id]);
        run(&["start", &id]);
        cli_times.push(t0.elapsed());
        let mut total = 0;
        for p in qemus_under(&env.runtime_root)
            .into_iter()
            .chain(pids_named("crust-runtime", &env.runtime_root))
        {
            total += rss(p);
        }
        cli_rss.push(total);
        run(&["delete", "--force", &id]);
    }

    println!(
        "\npod start, one deferred volume (TCG guest, {} cores):",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    summary("containerd CRI + crust shim", &mut cri_times);
    summary("crust-runtime CLI", &mut cli_times);
    let mib = |v: &[u64]| v.iter().sum::<u64>() / v.len() as u64 / MIB;
    println!(
        "per-pod host RSS (mean): shim+virtiofsd+QEMU {} MiB (containerd); shim+QEMU {} MiB (CLI)",
        mib(&cri_rss),
        mib(&cli_rss)
    );
    records.remove(&target).unwrap();
}
