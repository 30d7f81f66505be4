//! Issue 27 (density): a pod whose container fills its memory limit still
//! leaves its guest room to work. The guest gets the pod's limits plus the
//! shim's overhead (`CRUST_SHIM_MEMORY_OVERHEAD_MIB`, the figure the
//! RuntimeClass's `podFixed` is built on); here one container with a
//! 128 MiB limit (the pod's memory through `io.crust.memory-bytes`, as
//! kubelet's sandbox resources give it on containerd 1.7) fills all but
//! 16 MiB of its limit with anonymous memory it cannot give back (a `dd`
//! holding its buffer, stuck writing to a pipe nobody reads), then streams
//! a file of twice its limit through the page cache. After that:
//! - the guest kernel killed nothing (`oom_kill` in `/proc/vmstat`), the
//!   container's cgroup reclaimed its own page cache instead;
//! - the guest keeps memory of its own: `MemAvailable` beyond what the
//!   container may still take stays above [`ROOM_MIB`];
//! - the agent still starts new processes (execs answer).
//!
//! Budget: one TCG guest, ~20 s.

mod common;

use common::{Env, MIB, exec};
use crust_cri::Cri;
use crust_cri::v1 as cri;

/// The container's memory limit.
const LIMIT_MIB: u64 = 128;
/// Memory the guest must keep beyond its containers' limits once they are
/// full: the agent's execs, virtio queues, the kernel's free-page reserve.
const ROOM_MIB: u64 = 16;

/// `key value` pairs printed by `script`, as numbers.
fn field(out: &str, key: &str) -> u64 {
    out.split_whitespace()
        .skip_while(|w| *w != key)
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{key} in {out:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_at_its_limit_leaves_the_guest_room() {
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let mut sandbox =
        common::host_network_sandbox("room", "6a0f0c2a-0000-4000-8000-0000000a0a0a", 0);
    sandbox.annotations.insert(
        "io.crust.memory-bytes".into(),
        (LIMIT_MIB * MIB).to_string(),
    );
    let (_sb, cid) = env
        .start_busybox_pod_with(
            &mut cri,
            &sandbox,
            &[
                "sh",
                "-c",
                &format!(
                    "dd if=/dev/zero bs={held}M count=1 2>/dev/null | sleep 100000",
                    held = LIMIT_MIB - 16
                ),
            ],
            Vec::new(),
            Some(cri::LinuxContainerConfig {
                resources: Some(cri::LinuxContainerResources {
                    memory_limit_in_bytes: (LIMIT_MIB * MIB) as i64,
                    ..Default::default()
                }),
                ..Default::default()
            }),
        )
        .await;

    // Once dd holds its buffer, the file goes through the page cache.
    let fill = format!(
        "p=/sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup); \
         until [ $(cat $p/memory.current) -ge {held} ]; do sleep 0.2; done; \
         dd if=/dev/zero of=/stream bs=1M count={stream} 2>/dev/null && \
         cat /stream > /dev/null && rm /stream",
        held = (LIMIT_MIB - 16) * MIB,
        stream = 2 * LIMIT_MIB,
    );
    let (rc, out) = common::exec_timeout(&mut cri, &cid, &fill, 300).await;
    assert_eq!(
        rc,
        0,
        "filling the container's limit: {out}\n{}",
        env.logs()
    );

    let show = "p=/sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup); \
        echo total $(awk '/^MemTotal:/ {print $2 * 1024}' /proc/meminfo) \
        available $(awk '/^MemAvailable:/ {print $2 * 1024}' /proc/meminfo) \
        kills $(awk '/^oom_kill / {print $2}' /proc/vmstat) \
        max $(cat $p/memory.max) current $(cat $p/memory.current)";
    let (rc, out) = exec(&mut cri, &cid, show).await;
    assert_eq!(rc, 0, "{out}");
    let (total, available) = (field(&out, "total"), field(&out, "available"));
    let (max, current) = (field(&out, "max"), field(&out, "current"));
    eprintln!(
        "guest MemTotal {} MiB, MemAvailable {} MiB; container {} of {} MiB",
        total / MIB,
        available / MIB,
        current / MIB,
        max / MIB
    );
    assert_eq!(max, LIMIT_MIB * MIB, "{out}");
    assert_eq!(field(&out, "kills"), 0, "the guest OOM-killed: {out}");
    let room = available.saturating_sub(max.saturating_sub(current));
    assert!(
        room >= ROOM_MIB * MIB,
        "the guest keeps {} MiB beyond what its container may still take \
         (MemTotal {} MiB, which leaves out what the kernel reserved at boot): {out}",
        room / MIB,
        total / MIB
    );
    let (rc, out) = exec(&mut cri, &cid, "echo alive").await;
    assert_eq!((rc, out.trim()), (0, "alive"), "a new exec");
}
