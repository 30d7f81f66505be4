//! Issue 27, must-show 5, through containerd's CRI as kubelet's in-place
//! resize asks: UpdateContainerResources on a running container (containerd
//! sends the shim a task Update carrying the container's whole OCI
//! `LinuxResources`). One pod, one TCG guest:
//! - memory 256 -> 512 MiB and CPU 1 -> 2: the guest's `MemTotal` grows
//!   (a DIMM hot-added), the container's `memory.max` and `cpu.max`
//!   follow, `nproc` counts the hot-plugged vCPU; CRI ContainerStats
//!   reports the new limit;
//! - 512 -> 384 MiB: the limit lowers and the guest gives memory back
//!   (the balloon: `MemTotal` falls);
//! - below what the container holds (shared memory it filled), and above
//!   the VM's hot-plug ceiling (maxmem): refused naming the field, nothing
//!   changed (limits, `MemTotal`, vCPUs).
//!
//! Budget: one TCG guest, ~40 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use common::{Env, MIB, exec};
use crust_cri::Cri;
use crust_cri::v1 as cri;

/// The guest's memory as the container sees it (no lxcfs in a guest).
const SHOW: &str = "p=/sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup); \
    echo mem=$(awk '/^MemTotal:/ {print $2 * 1024}' /proc/meminfo) \
    max=$(cat $p/memory.max) cpu=$(tr ' ' _ < $p/cpu.max) nproc=$(nproc)";

#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    mem_total: u64,
    memory_max: u64,
    cpu_max: String,
    nproc: u32,
}

async fn seen(cri: &mut Cri, cid: &str) -> Seen {
    let (code, out) = exec(cri, cid, SHOW).await;
    assert_eq!(code, 0, "{out}");
    let field = |k: &str| {
        let start = out
            .find(&format!("{k}="))
            .unwrap_or_else(|| panic!("{k} in {out}"))
            + k.len()
            + 1;
        out[start..]
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string()
    };
    Seen {
        mem_total: field("mem").parse().unwrap(),
        memory_max: field("max").parse().unwrap(),
        cpu_max: field("cpu"),
        nproc: field("nproc").parse().unwrap(),
    }
}

fn resources(memory: u64, cpus: i64) -> cri::LinuxContainerResources {
    cri::LinuxContainerResources {
        memory_limit_in_bytes: memory as i64,
        cpu_period: 100_000,
        cpu_quota: cpus * 100_000,
        cpu_shares: cpus * 1024,
        ..Default::default()
    }
}

async fn update(
    cri: &mut Cri,
    cid: &str,
    r: cri::LinuxContainerResources,
) -> Result<(), tonic::Status> {
    cri.runtime
        .update_container_resources(cri::UpdateContainerResourcesRequest {
            container_id: cid.into(),
            linux: Some(r),
            ..Default::default()
        })
        .await
        .map(drop)
}

/// CRI's memory figures: containerd reports what is left under the limit
/// (available = limit - working set).
async fn cri_limit(cri: &mut Cri, cid: &str) -> u64 {
    let s = cri
        .runtime
        .container_stats(cri::ContainerStatsRequest {
            container_id: cid.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .stats
        .unwrap();
    let m = s.memory.unwrap();
    m.available_bytes.unwrap().value + m.working_set_bytes.unwrap().value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_container_is_resized_in_place() {
    let t0 = std::time::Instant::now();
    let env = Env::start_with(
        crust_testkit::CRI_NAMESPACE,
        vec![
            ("CRUST_SHIM_MAX_CPUS".into(), "2".into()),
            ("CRUST_SHIM_MAX_MEMORY_MIB".into(), "2048".into()),
        ],
    );
    // The guest slot may have been waited for (other tests' guests).
    eprintln!("containerd up, guest slot held after {:?}", t0.elapsed());
    let t0 = std::time::Instant::now();
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let sandbox =
        common::host_network_sandbox("resized", "5e1f0c2a-0000-4000-8000-00000000a27e", 0);
    // 48 MiB of shared memory it holds (and cannot give back).
    let (sb, cid) = env
        .start_busybox_pod_with(
            &mut cri,
            &sandbox,
            &[
                "sh",
                "-c",
                "dd if=/dev/zero of=/dev/shm/held bs=1M count=48 2>/dev/null; exec sleep 100000",
            ],
            Vec::new(),
            Some(cri::LinuxContainerConfig {
                resources: Some(resources(256 * MIB, 1)),
                ..Default::default()
            }),
        )
        .await;

    let before = seen(&mut cri, &cid).await;
    eprintln!("created: {before:?} ({:?})", t0.elapsed());
    assert_eq!(before.memory_max, 256 * MIB);
    assert_eq!(before.cpu_max, "100000_100000");
    assert_eq!(before.nproc, 1);

    // Up: memory 256 -> 512 MiB, CPU 1 -> 2.
    let t = std::time::Instant::now();
    update(&mut cri, &cid, resources(512 * MIB, 2))
        .await
        .unwrap_or_else(|e| panic!("UpdateContainerResources up: {e}\n{}", env.logs()));
    eprintln!("update up took {:?}", t.elapsed());
    let up = seen(&mut cri, &cid).await;
    eprintln!("raised: {up:?} ({:?})", t0.elapsed());
    assert_eq!(up.memory_max, 512 * MIB);
    assert_eq!(up.cpu_max, "200000_100000");
    assert_eq!(up.nproc, 2, "the hot-plugged vCPU is online");
    assert!(
        up.mem_total >= before.mem_total + 128 * MIB,
        "a DIMM was hot-added: {} -> {}",
        before.mem_total,
        up.mem_total
    );
    assert_eq!(cri_limit(&mut cri, &cid).await, 512 * MIB, "CRI stats");

    // Down within what the guest can give back: 512 -> 384 MiB.
    let t = std::time::Instant::now();
    update(&mut cri, &cid, resources(384 * MIB, 2))
        .await
        .unwrap_or_else(|e| panic!("UpdateContainerResources down: {e}\n{}", env.logs()));
    eprintln!("update down took {:?}", t.elapsed());
    let down = seen(&mut cri, &cid).await;
    eprintln!("lowered: {down:?} ({:?})", t0.elapsed());
    assert_eq!(down.memory_max, 384 * MIB);
    assert_eq!(down.cpu_max, "200000_100000");
    assert!(
        down.mem_total + 96 * MIB <= up.mem_total,
        "the balloon took memory back: {} -> {}",
        up.mem_total,
        down.mem_total
    );
    assert_eq!(cri_limit(&mut cri, &cid).await, 384 * MIB, "CRI stats");

    // Below what the container holds: the 48 MiB of shared memory. Which
    // check refuses first depends on the guest's overhead: the VM cannot
    // shrink that far ("can give back only"), or the container's cgroup
    // cannot ("cannot give back").
    let e = update(&mut cri, &cid, resources(32 * MIB, 1))
        .await
        .expect_err("a limit below what the container holds");
    eprintln!("refused: {}", e.message());
    assert!(
        e.message().contains("linux.resources.memory.limit") && e.message().contains("give back"),
        "{e}"
    );

    // Above the VM's hot-plug ceiling (maxmem 2048 MiB here).
    let e = update(&mut cri, &cid, resources(4096 * MIB, 2))
        .await
        .expect_err("above maxmem");
    eprintln!("refused: {}", e.message());
    assert!(
        e.message().contains("linux.resources.memory.limit") && e.message().contains("maxmem"),
        "{e}"
    );
    assert_eq!(seen(&mut cri, &cid).await, down, "nothing changed");
    eprintln!("done in {:?}", t0.elapsed());

    cri.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: sb.clone(),
        })
        .await
        .unwrap();
    cri.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: sb })
        .await
        .unwrap();
}
