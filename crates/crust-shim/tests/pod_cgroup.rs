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
//! - containerd's cgroup grows by less than 4 MiB for the pod (the
//!   shim's start-up, before it can know the pod's cgroup);
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
    // boot (the initramfs it moved), which QEMU had already touched.
    assert!(
        filled >= booted + 28 * MIB,
        "the guest's 56 MiB reached the pod's cgroup: {booted} -> {filled}"
    );
    // What stays with containerd is the shim's start-up before it knows
    // the pod's cgroup (about 3 MiB here; the 2 MiB would need
    // the shim born in the pod's cgroup too: README, issue 41's note).
    assert!(
        ctrd_growth < 4 * MIB,
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
