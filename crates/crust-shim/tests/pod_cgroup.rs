//! Issue 41 through containerd's CRI: the whole VM is the pod's. A pod
//! with a cgroup parent (cgroupfs form), under a containerd the test puts
//! in a memory cgroup of its own:
//! - every process of the sandbox (QEMU, each virtiofsd, its forked
//!   worker too) is in the pod's cgroup, and so is the pod's shim;
//! - after boot and after the container fills guest memory, the pod
//!   cgroup's memory usage is at least the sum of QEMU's and virtiofsd's
//!   anonymous and shared PSS (their pages were charged there from the
//!   first one: they are born in the cgroup, not moved after they
//!   started; file pages are the node's shared page cache);
//! - the pod's shim is born in the pod's cgroup (`shim start` makes the
//!   groups and spawns it there), so containerd's cgroup grows by less
//!   than 2 MiB for the pod, and a refused pod leaves no group behind;
//! - at teardown the sandbox's cgroup, which the shim made, is gone, and
//!   the parent the test made before the pod is left in place;
//! - a pod whose own `io.crust.memory-bytes` asks for 16 GiB (the node's
//!   cap is 8) or for more than its cgroup's limit is refused before any
//!   QEMU starts, the message naming the annotation and the cap.
//!
//! The memory figures are v1's `memory.usage_in_bytes` (these machines)
//! or v2's `memory.current`. Budget: one TCG guest, ~30 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::path::{Path, PathBuf};

use common::{Env, MIB, exec};
use crust_cri::Cri;
use crust_cri::v1 as cri;

/// The memory hierarchy: (its root, the usage file's name).
fn memory_root() -> (PathBuf, &'static str) {
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        (PathBuf::from("/sys/fs/cgroup"), "memory.current")
    } else {
        (
            PathBuf::from("/sys/fs/cgroup/memory"),
            "memory.usage_in_bytes",
        )
    }
}

fn usage(dir: &Path) -> u64 {
    let file = dir.join(memory_root().1);
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .trim()
        .parse()
        .unwrap()
}

/// QEMU and every virtiofsd of the pod: the processes whose command line
/// names the runtime root (the shim's does not).
fn sandbox_processes(runtime_root: &Path) -> Vec<(i32, String)> {
    let needle = runtime_root.display().to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(&needle) && (cmd.contains("qemu-system") || cmd.contains("virtiofsd")) {
            out.push((pid, cmd.split(' ').next().unwrap_or_default().to_string()));
        }
    }
    out
}

/// The PSS of what a process itself allocated, in bytes: anonymous and
/// shared memory (guest RAM is a shared memfd). File pages (QEMU's binary
/// and libraries) live in the node's page cache, shared by every pod and
/// charged to whichever cgroup first read them.
fn pss(pid: i32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("{name} missing in /proc/{pid}/smaps_rollup:\n{text}"))
    };
    (field("Pss_Anon:") + field("Pss_Shmem:")) * 1024
}

/// The memory cgroup `pid` is in, as `/proc/<pid>/cgroup` names it.
fn memory_cgroup_of(pid: i32) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    text.lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
            let hit = if v2 {
                ctrl.is_empty()
            } else {
                ctrl.split(',').any(|c| c == "memory")
            };
            hit.then(|| path.to_string())
        })
        .unwrap_or_default()
}

/// The pod's processes and their PSS, each checked to be in `pod_cg`,
/// and the pod's shim with them.
fn check_all_in(env: &Env, pod_cg: &str, when: &str) -> u64 {
    for shim in env.ctrd.shim_pids() {
        let cg = memory_cgroup_of(shim);
        assert_eq!(
            cg, pod_cg,
            "{when}: the shim ({shim}) is in {cg}, not the pod's"
        );
    }
    let procs = sandbox_processes(&env.runtime_root);
    assert!(
        procs.iter().any(|(_, c)| c.contains("qemu"))
            && procs
                .iter()
                .filter(|(_, c)| c.contains("virtiofsd"))
                .count()
                >= 2,
        "{when}: QEMU and virtiofsd with its worker expected: {procs:?}"
    );
    let mut total = 0;
    for (pid, cmd) in &procs {
        let cg = memory_cgroup_of(*pid);
        assert_eq!(
            cg, pod_cg,
            "{when}: {cmd} ({pid}) is in {cg}, not the pod's"
        );
        total += pss(*pid);
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_vm_is_charged_to_the_pod() {
    let me = std::process::id();
    // The pod's parent, made before the pod: not the shim's to remove.
    // Its guard is dropped after containerd and the pod's VM are gone
    // (declared first), so a failed run leaves no group either.
    let parent = format!("/crust-test-pod-{me}");
    let _leftovers = common::Leftovers {
        pool: std::env::temp_dir().join(format!("crust-pod-cgroup-{me}-no-pool")),
        cgroup_parent: Some(parent.clone()),
    };
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let (mem_root, _) = memory_root();
    // containerd in a cgroup of the test's own (its shims are born there).
    let ctrd_cg = mem_root.join(format!("crust-test-ctrd-{me}"));
    std::fs::create_dir_all(&ctrd_cg).unwrap();
    let _ctrd_cg_guard = CgroupDir(ctrd_cg.clone());
    let ctrd_pid = env.ctrd.pid().expect("containerd's pid");
    std::fs::write(ctrd_cg.join("cgroup.procs"), ctrd_pid.to_string()).unwrap();
    let parent_dir = mem_root.join(parent.trim_start_matches('/'));
    std::fs::create_dir_all(&parent_dir).unwrap();
    // kubelet's pod limit on the pod's cgroup: 1 GiB.
    let limit_file = if memory_root().1 == "memory.current" {
        "memory.max"
    } else {
        "memory.limit_in_bytes"
    };
    std::fs::write(parent_dir.join(limit_file), (1u64 << 30).to_string()).unwrap();

    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let mut sandbox =
        common::host_network_sandbox("charged", "9f8a1c2e-0000-4000-8000-00000c9a0001", 0);
    sandbox.linux.as_mut().unwrap().cgroup_parent = parent.clone();

    // The pod's own annotation sizes no VM past the node's cap (8 GiB by
    // default) or the pod's limit: refused before QEMU starts, naming it.
    for (asked, needles) in [
        (
            16u64 << 30,
            ["io.crust.memory-bytes", "CRUST_SHIM_MAX_MEMORY_MIB"],
        ),
        (
            2 << 30,
            ["io.crust.memory-bytes", "the pod cgroup's memory limit"],
        ),
    ] {
        let mut greedy = sandbox.clone();
        let meta = greedy.metadata.as_mut().unwrap();
        meta.name = format!("greedy-{}", asked >> 30);
        meta.uid = format!("9f8a1c2e-0000-4000-8000-00000c9a{:04x}", asked >> 30);
        greedy
            .annotations
            .insert("io.crust.memory-bytes".into(), asked.to_string());
        let e = cri
            .runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(greedy),
                runtime_handler: crust_testkit::CRUST_HANDLER.into(),
            })
            .await
            .expect_err("a VM above the caps");
        for n in needles {
            assert!(e.message().contains(n), "{n:?} in: {e}");
        }
        assert!(
            common::qemus_under(&env.runtime_root).is_empty(),
            "no QEMU started for {asked} bytes"
        );
        // The groups its shim was born in went with the refusal.
        let left: Vec<_> = std::fs::read_dir(&parent_dir)
            .unwrap()
            .flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "groups left by a refused pod: {left:?}");
    }

    let before = usage(&ctrd_cg);
    let (sb, cid) = env
        .start_busybox_pod(&mut cri, &sandbox, &["sleep", "100000"], Vec::new())
        .await;
    let pod_cg = format!("{parent}/{sb}");
    let pod_dir = mem_root.join(pod_cg.trim_start_matches('/'));

    // After boot.
    let booted_pss = check_all_in(&env, &pod_cg, "after boot");
    let booted = usage(&pod_dir);
    let booted_held = unreclaimable(&pod_dir);
    let ctrd_growth = usage(&ctrd_cg).saturating_sub(before);
    eprintln!(
        "after boot: pod cgroup {} MiB, sandbox PSS {} MiB, containerd's cgroup +{} KiB",
        booted / MIB,
        booted_pss / MIB,
        ctrd_growth / 1024
    );
    assert!(
        booted >= booted_pss,
        "the pod's cgroup holds {booted} bytes, its processes' PSS is {booted_pss}"
    );

    // The container fills guest memory (the pod's shm, a guest tmpfs).
    let (code, out) = exec(
        &mut cri,
        &cid,
        "dd if=/dev/zero of=/dev/shm/fill bs=1M count=56 2>&1 && sync && echo filled",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let filled_pss = check_all_in(&env, &pod_cg, "after filling");
    let filled = usage(&pod_dir);
    let filled_held = unreclaimable(&pod_dir);
    let ctrd_growth = usage(&ctrd_cg).saturating_sub(before);
    eprintln!(
        "filled: pod cgroup {} MiB, sandbox PSS {} MiB, containerd's cgroup +{} KiB",
        filled / MIB,
        filled_pss / MIB,
        ctrd_growth / 1024
    );
    assert!(
        filled >= filled_pss,
        "the pod's cgroup holds {filled} bytes, its processes' PSS is {filled_pss}"
    );
    // Not all 56 MiB are new pages: the guest reuses some it freed after
    // boot (the initramfs it moved), which QEMU had already touched; 28
    // to 43 MiB were new in runs here. The host's page cache is left out
    // (it comes and goes with reclaim).
    assert!(
        filled_held >= booted_held + 16 * MIB,
        "the guest's 56 MiB reached the pod's cgroup: {booted_held} -> {filled_held}"
    );
    // The shim is born in the pod's cgroup too: what stays with
    // containerd is its own work for the pod and `shim start`'s moment.
    assert!(
        ctrd_growth < 2 * MIB,
        "containerd's cgroup grew by {ctrd_growth} bytes for one pod"
    );

    common::stop_and_remove_sandbox(&mut cri, &sb).await;
    assert!(!pod_dir.exists(), "the sandbox's own cgroup is removed");
    assert!(parent_dir.is_dir(), "the parent made before the pod stays");
}

/// Moves what is left in a test cgroup to its parent and removes it.
struct CgroupDir(PathBuf);

impl Drop for CgroupDir {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.0.join("cgroup.procs")).unwrap_or_default();
        let up = self.0.parent().unwrap().join("cgroup.procs");
        for pid in procs.lines() {
            let _ = std::fs::write(&up, pid);
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `overhead.podFixed.memory` of the RuntimeClass crust ships, in bytes:
/// the base's (KVM nodes) or the no-kvm overlay's (TCG).
fn pod_fixed(tcg: bool) -> u64 {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes");
    let (file, key) = if tcg {
        ("overlays/no-kvm/kustomization.yaml", "value:")
    } else {
        ("base/runtimeclass.yaml", "memory:")
    };
    let text = std::fs::read_to_string(deploy.join(file)).unwrap();
    let after = text
        .split_once("podFixed")
        .unwrap_or_else(|| panic!("{file}: no podFixed"))
        .1;
    let mib = after
        .lines()
        .find_map(|l| l.trim().strip_prefix(key))
        .and_then(|v| v.trim().strip_suffix("Mi"))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("{file}: no podFixed memory in Mi"));
    mib * MIB
}

/// What the pod cgroup `dir` holds that the host cannot reclaim without
/// swap: anonymous memory, shared memory (guest RAM is a memfd) and
/// kernel memory. Not the page cache of what virtiofsd read and wrote,
/// which the host reclaims under the pod's limit.
fn unreclaimable(dir: &Path) -> u64 {
    let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    let field = |name: &str| {
        stat.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0)
    };
    if stat.lines().any(|l| l.starts_with("total_rss ")) {
        let kmem = std::fs::read_to_string(dir.join("memory.kmem.usage_in_bytes"))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .unwrap_or(0);
        field("total_rss") + field("total_shmem") + kmem
    } else {
        field("anon") + field("shmem") + field("kernel")
    }
}

/// The host OOM kills in the memory cgroup `dir` (v1 `memory.oom_control`,
/// v2 `memory.events`).
fn host_oom_kills(dir: &Path) -> u64 {
    ["memory.oom_control", "memory.events"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(dir.join(f)).ok())
        .flat_map(|t| {
            t.lines()
                .filter_map(|l| l.strip_prefix("oom_kill ")?.trim().parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// Resident bytes of TCG's translation buffer in QEMU `pid`: its
/// executable anonymous mappings (one per region, 2 MiB each between
/// guard pages with several vCPUs; none under KVM).
fn tcg_buffer(pid: i32) -> u64 {
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
                .unwrap_or(0)
                * 1024;
        }
    }
    total
}

/// Issue 41, item 4: the RuntimeClass's podFixed holds. A container with
/// a memory limit fills the guest's page cache (a file larger than the
/// guest, written and read back), then asks for more than its own limit:
/// the guest kills it inside its limit, the host kills nothing, QEMU
/// lives on. The most the pod's cgroup held that the host could not
/// reclaim (sampled every 50 ms), less the container's limit, is the
/// pod's fixed cost: it must be within the podFixed shipped for this
/// accelerator (deploy/, the no-kvm overlay without KVM), so under
/// kubelet's pod limit (the containers' limits plus podFixed) a full pod
/// is never pushed by the host. Under TCG the same cost less the
/// translation buffer (the KVM estimate from its parts) must be within
/// the KVM podFixed. Budget: one TCG guest, ~30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filled_pod_stays_within_its_limit_plus_pod_fixed() {
    const LIMIT: u64 = 128 * MIB;
    let me = std::process::id();
    let parent = format!("/crust-test-fixed-{me}");
    let _leftovers = common::Leftovers {
        pool: std::env::temp_dir().join(format!("crust-pod-fixed-{me}-no-pool")),
        cgroup_parent: Some(parent.clone()),
    };
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let (mem_root, usage_file) = memory_root();
    let parent_dir = mem_root.join(parent.trim_start_matches('/'));
    std::fs::create_dir_all(&parent_dir).unwrap();
    let limit_file = if usage_file == "memory.current" {
        "memory.max"
    } else {
        "memory.limit_in_bytes"
    };
    // A limit well above kubelet's (the container's limit plus podFixed),
    // so what the pod takes is measured, not capped; the measure is then
    // held to kubelet's figure.
    std::fs::write(parent_dir.join(limit_file), (1u64 << 30).to_string()).unwrap();

    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let mut sandbox =
        common::host_network_sandbox("fixed", "9f8a1c2e-0000-4000-8000-00000c9a0f1d", 0);
    sandbox.linux.as_mut().unwrap().cgroup_parent = parent.clone();
    // The pod's memory as kubelet's sandbox resources give it.
    sandbox
        .annotations
        .insert("io.crust.memory-bytes".into(), LIMIT.to_string());
    let linux = cri::LinuxContainerConfig {
        resources: Some(cri::LinuxContainerResources {
            memory_limit_in_bytes: LIMIT as i64,
            ..Default::default()
        }),
        ..Default::default()
    };
    let (sb, cid) = env
        .start_busybox_pod_with(
            &mut cri,
            &sandbox,
            &["sleep", "100000"],
            Vec::new(),
            Some(linux),
        )
        .await;
    let procs = sandbox_processes(&env.runtime_root);
    let (qemu, qemu_cmd) = procs
        .iter()
        .find(|(_, c)| c.contains("qemu"))
        .cloned()
        .expect("the pod's QEMU");
    let cmdline = std::fs::read(format!("/proc/{qemu}/cmdline")).unwrap();
    let tcg = !String::from_utf8_lossy(&cmdline).contains("\0kvm");
    let fixed = pod_fixed(tcg);

    // The most the pod's cgroup held that the host cannot reclaim.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (stop, dir) = (stop.clone(), parent_dir.clone());
        std::thread::spawn(move || {
            let mut peak = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(unreclaimable(&dir));
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            peak.max(unreclaimable(&dir))
        })
    };
    let (code, out) = common::exec_timeout(
        &mut cri,
        &cid,
        "g=$(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) && \
         dd if=/dev/zero of=/fill bs=1M count=$((g + 64)) 2>&1 && cat /fill > /dev/null && \
         grep -E '^(MemTotal|MemFree|Cached)' /proc/meminfo",
        600,
    )
    .await;
    assert_eq!(code, 0, "filling the page cache: {out}");
    let (code, greedy) = common::exec_timeout(
        &mut cri,
        &cid,
        &format!(
            "dd if=/dev/zero of=/dev/null bs={}M count=1 2>&1",
            LIMIT / MIB + 64
        ),
        300,
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.join().unwrap();
    let tb = if tcg { tcg_buffer(qemu) } else { 0 };
    let cost = peak.saturating_sub(LIMIT);
    eprintln!(
        "{}: page cache filled ({}), container limit {} MiB; pod cgroup peak {} MiB \
         unreclaimable, beyond the limit {} MiB (TCG translation buffer {} MiB); \
         podFixed {} MiB",
        if tcg { "TCG" } else { "KVM" },
        out.split_whitespace().collect::<Vec<_>>().join(" "),
        LIMIT / MIB,
        peak / MIB,
        cost / MIB,
        tb / MIB,
        fixed / MIB
    );
    assert!(
        code != 0 && !greedy.contains("records out"),
        "a container past its limit is killed in the guest: {code} {greedy}"
    );
    assert!(
        Path::new(&format!("/proc/{qemu}")).exists(),
        "the pod's QEMU ({qemu_cmd}) lives on"
    );
    assert_eq!(
        host_oom_kills(&parent_dir),
        0,
        "the host killed nothing in the pod's cgroup"
    );
    assert!(
        cost <= fixed,
        "the pod cost {} MiB beyond its limit, podFixed is {} MiB",
        cost / MIB,
        fixed / MIB
    );
    if tcg {
        assert!(
            cost - tb.min(cost) <= pod_fixed(false),
            "the KVM estimate (the same parts without TCG's buffer) {} MiB is above the KVM \
             podFixed {} MiB",
            (cost - tb.min(cost)) / MIB,
            pod_fixed(false) / MIB
        );
    }
    let (code, out) = exec(&mut cri, &cid, "echo alive").await;
    assert_eq!((code, out.trim()), (0, "alive"), "the pod still answers");
    common::stop_and_remove_sandbox(&mut cri, &sb).await;
}
