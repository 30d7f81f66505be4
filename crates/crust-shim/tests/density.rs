//! What one crust pod costs the host beyond its containers' limits, the
//! figure the RuntimeClass's `overhead.podFixed` must cover. Figures, not
//! assertions (run explicitly):
//! `cargo test --release -p crust-shim --test density -- --ignored --nocapture`
//!
//! `CRUST_BENCH_PODS` pods (default 10) are started one after another
//! through containerd's CRI (hostNetwork, one busybox container with a
//! memory limit of `CRUST_BENCH_LIMIT_MIB`, default 128, which is also the
//! pod's memory, so the guest gets the limit plus the shim's overhead,
//! `CRUST_BENCH_OVERHEAD_MIB` or the shim's default; 0: no limit, the
//! guest gets the shim's base memory). For each pod,
//! RSS and PSS of its QEMU, virtiofsd and shim are read from
//! `/proc/<pid>/smaps_rollup`, idle and again after every guest's page
//! cache was filled (each container writes and reads back a file larger
//! than its guest's memory). QEMU's RSS is split into guest RAM, the TCG
//! translation buffer (absent under KVM) and QEMU's own memory, from
//! `/proc/<pid>/smaps`.

#![allow(
    clippy::too_many_lines,
    reason = "a benchmark reads as one story, top to bottom"
)]

mod common;

use std::time::{Duration, Instant};

use common::{Env, MIB, exec_timeout, host_network_sandbox};
use crust_cri::Cri;
use crust_cri::v1 as cri;

/// One process's memory, in bytes.
#[derive(Debug, Default, Clone, Copy)]
struct Mem {
    rss: u64,
    pss: u64,
}

impl std::ops::AddAssign for Mem {
    fn add_assign(&mut self, o: Mem) {
        self.rss += o.rss;
        self.pss += o.pss;
    }
}

fn rollup(pid: i32) -> Mem {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0)
            * 1024
    };
    Mem {
        rss: field("Rss:"),
        pss: field("Pss:"),
    }
}

/// QEMU's resident memory split: (guest RAM, TCG translation buffer,
/// the rest). Guest RAM is the mapping of the guest's size (or larger:
/// hot-plugged DIMMs are mappings of their own, counted too when they
/// are memfds); the translation buffer is QEMU's executable anonymous
/// mappings (one region per 2 MiB between guard pages with several
/// vCPUs).
fn qemu_split(pid: i32, guest_bytes: u64) -> (u64, u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let (mut ram, mut tb, mut other) = (0, 0, 0);
    let mut kind = 0; // 0 other, 1 ram, 2 tb
    for l in text.lines() {
        let mut it = l.split_whitespace();
        let first = it.next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            let perms = it.next().unwrap_or("");
            let path = l.split_whitespace().nth(5).unwrap_or("");
            let size = b - a;
            kind = if perms.contains('x') && path.is_empty() {
                2
            } else if size >= guest_bytes || path.starts_with("/memfd:crust") {
                1
            } else {
                0
            };
            continue;
        }
        if let Some(v) = l.strip_prefix("Rss:") {
            let kb: u64 = v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
            match kind {
                1 => ram += kb * 1024,
                2 => tb += kb * 1024,
                _ => other += kb * 1024,
            }
        }
    }
    (ram, tb, other)
}

/// QEMU's largest resident mappings, to see where its own memory goes.
fn top_mappings(pid: i32) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut maps: Vec<(u64, String)> = Vec::new();
    let mut head = String::new();
    for l in text.lines() {
        let first = l.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            head = l.to_string();
        } else if let Some(v) = l.strip_prefix("Rss:") {
            let kb: u64 = v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
            maps.push((kb, head.clone()));
        }
    }
    maps.sort_by_key(|m| std::cmp::Reverse(m.0));
    println!("\nQEMU {pid}: largest resident mappings (KiB):");
    for (kb, h) in maps.iter().take(15) {
        println!("  {kb:>8}  {h}");
    }
}

fn pid_with(prefix: &str, needle: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = String::from_utf8_lossy(&std::fs::read(e.path().join("cmdline")).ok()?)
                .replace('\0', " ");
            (cmd.contains(prefix) && cmd.contains(needle) && crust_testkit::pid_alive(pid))
                .then_some(pid)
        })
        .collect()
}

/// The host processes of one pod.
struct PodProcs {
    qemu: Vec<i32>,
    virtiofsd: Vec<i32>,
    shim: Vec<i32>,
}

impl PodProcs {
    fn find(sandbox: &str) -> PodProcs {
        PodProcs {
            qemu: pid_with("qemu-system", sandbox),
            virtiofsd: pid_with("virtiofsd", sandbox),
            shim: pid_with("containerd-shim-crust-v2", sandbox),
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Sample {
    qemu: Mem,
    virtiofsd: Mem,
    shim: Mem,
    ram: u64,
    tb: u64,
    qemu_own: u64,
}

impl Sample {
    fn total(&self) -> Mem {
        let mut m = self.qemu;
        m += self.virtiofsd;
        m += self.shim;
        m
    }
}

fn sample(p: &PodProcs, guest_bytes: u64) -> Sample {
    let mut s = Sample::default();
    for &q in &p.qemu {
        s.qemu += rollup(q);
        let (ram, tb, own) = qemu_split(q, guest_bytes);
        s.ram += ram;
        s.tb += tb;
        s.qemu_own += own;
    }
    for &v in &p.virtiofsd {
        s.virtiofsd += rollup(v);
    }
    for &v in &p.shim {
        s.shim += rollup(v);
    }
    s
}

/// Prints the mean and max of each figure; `limit`: the container's
/// memory limit, for what the pod costs beyond it.
fn report(what: &str, samples: &[Sample], limit: u64) {
    let n = samples.len() as u64;
    let mean = |f: &dyn Fn(&Sample) -> u64| samples.iter().map(f).sum::<u64>() / n;
    let max = |f: &dyn Fn(&Sample) -> u64| samples.iter().map(f).max().unwrap_or(0);
    let m = |b: u64| format!("{:.1}", b as f64 / MIB as f64);
    println!("\n{what} ({n} pods; MiB per pod, mean / max):");
    for (name, f) in [
        (
            "total RSS",
            &(|s: &Sample| s.total().rss) as &dyn Fn(&Sample) -> u64,
        ),
        ("total PSS", &|s: &Sample| s.total().pss),
        ("  QEMU RSS", &|s: &Sample| s.qemu.rss),
        ("    guest RAM", &|s: &Sample| s.ram),
        ("    TCG translation buffer", &|s: &Sample| s.tb),
        ("    QEMU's own", &|s: &Sample| s.qemu_own),
        ("  QEMU PSS", &|s: &Sample| s.qemu.pss),
        ("  virtiofsd RSS", &|s: &Sample| s.virtiofsd.rss),
        ("  virtiofsd PSS", &|s: &Sample| s.virtiofsd.pss),
        ("  shim RSS", &|s: &Sample| s.shim.rss),
        ("  shim PSS", &|s: &Sample| s.shim.pss),
        ("total PSS without the TCG buffer", &|s: &Sample| {
            s.total().pss.saturating_sub(s.tb)
        }),
        (
            "  beyond the container's limit (podFixed's figure)",
            &|s: &Sample| s.total().pss.saturating_sub(s.tb).saturating_sub(limit),
        ),
    ] {
        println!("  {name:<34} {:>8} / {:>8}", m(mean(f)), m(max(f)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with --ignored --nocapture"]
async fn bench_density() {
    let n: usize = std::env::var("CRUST_BENCH_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let limit_mib: u64 = std::env::var("CRUST_BENCH_LIMIT_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128);
    // The shim's guest overhead, to compare settings in one run's
    // conditions (unset: the shim's default).
    let overhead: Vec<(String, String)> = std::env::var("CRUST_BENCH_OVERHEAD_MIB")
        .map(|v| vec![("CRUST_SHIM_MEMORY_OVERHEAD_MIB".to_string(), v)])
        .unwrap_or_default();
    let env = Env::start_with(crust_testkit::CRI_NAMESPACE, overhead);
    let mut c = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let mut pods = Vec::new();
    let mut starts = Vec::new();
    for i in 0..n {
        let mut sb_cfg = host_network_sandbox(
            &format!("density-{i}"),
            &format!("density-{i:04}-4000-8000-000000000000"),
            0,
        );
        let linux = (limit_mib > 0).then(|| {
            // The pod's memory, as kubelet's sandbox resources give it on
            // containerd 1.7: the guest boots with the limit plus overhead.
            sb_cfg.annotations.insert(
                "io.crust.memory-bytes".into(),
                (limit_mib * MIB).to_string(),
            );
            cri::LinuxContainerConfig {
                resources: Some(cri::LinuxContainerResources {
                    memory_limit_in_bytes: (limit_mib * MIB) as i64,
                    ..Default::default()
                }),
                ..Default::default()
            }
        });
        let t0 = Instant::now();
        let (sb, cid) = env
            .start_busybox_pod_with(&mut c, &sb_cfg, &["sleep", "3600"], Vec::new(), linux)
            .await;
        starts.push(t0.elapsed());
        pods.push((sb, cid));
    }
    // Let boot-time work settle (the agent's start, page cache of the
    // image's first reads).
    tokio::time::sleep(Duration::from_secs(5)).await;

    let mut guest = Vec::new();
    for (_, cid) in &pods {
        let (_, out) = exec_timeout(&mut c, cid, "grep MemTotal /proc/meminfo", 30).await;
        let kb: u64 = out
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        guest.push(kb * 1024);
    }
    let procs: Vec<PodProcs> = pods.iter().map(|(sb, _)| PodProcs::find(sb)).collect();
    for (p, (sb, _)) in procs.iter().zip(&pods) {
        assert!(
            // virtiofsd is two processes (its sandbox's parent and the daemon).
            p.qemu.len() == 1 && !p.virtiofsd.is_empty() && p.shim.len() == 1,
            "pod {sb}: qemu {:?} virtiofsd {:?} shim {:?}",
            p.qemu,
            p.virtiofsd,
            p.shim
        );
    }
    let guest_bytes = *guest.iter().max().unwrap();
    let idle: Vec<Sample> = procs.iter().map(|p| sample(p, guest_bytes / 2)).collect();
    if std::env::var_os("CRUST_BENCH_SMAPS").is_some() {
        top_mappings(procs[0].qemu[0]);
    }

    // Fill each guest's page cache: a file larger than its memory,
    // written then read back (the rootfs is virtio-fs: its pages are
    // guest page cache).
    let fill_mib = guest_bytes / MIB + 64;
    for (_, cid) in &pods {
        let (rc, out) = exec_timeout(
            &mut c,
            cid,
            &format!(
                "dd if=/dev/zero of=/fill bs=1M count={fill_mib} 2>&1 && cat /fill > /dev/null && \
                 grep -E '^(MemFree|Cached)' /proc/meminfo"
            ),
            600,
        )
        .await;
        assert_eq!(rc, 0, "{out}");
    }
    let filled: Vec<Sample> = procs.iter().map(|p| sample(p, guest_bytes / 2)).collect();
    // Give memory back where the guest can (the file's pages go when it
    // is removed): what free page reporting returns to the host.
    for (_, cid) in &pods {
        let (rc, out) = exec_timeout(
            &mut c,
            cid,
            "rm -f /fill && sync && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; true",
            120,
        )
        .await;
        assert_eq!(rc, 0, "{out}");
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let released: Vec<Sample> = procs.iter().map(|p| sample(p, guest_bytes / 2)).collect();

    starts.sort();
    println!(
        "\ncrust pod density: {n} pods (TCG guest, {} cores), container limit {limit_mib} MiB \
         (0: none), guest MemTotal {:.0} MiB, start p50 {:.0} ms",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        guest_bytes as f64 / MIB as f64,
        starts[starts.len() / 2].as_secs_f64() * 1e3
    );
    let limit = limit_mib * MIB;
    report("idle", &idle, limit);
    report(
        &format!("page cache filled ({fill_mib} MiB written and read per pod)"),
        &filled,
        limit,
    );
    report(
        "after the file is removed and caches dropped",
        &released,
        limit,
    );

    for (sb, _) in &pods {
        let _ = c
            .runtime
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: sb.clone(),
            })
            .await;
        let _ = c
            .runtime
            .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: sb.clone(),
            })
            .await;
    }
}
