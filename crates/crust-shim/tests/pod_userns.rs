//! Issue 27, must-show 4 at the containerd door: a user-namespaced spec
//! (containerd 1.6 ignores CRI's user-namespace options, so `ctr run
//! --uidmap/--gidmap` writes it) runs in a user namespace with exactly
//! the spec's mappings, its init and its execs alike; a file it writes as
//! its uid 0 on a deferred crust volume (an idmapped mount in the guest)
//! is owned by 0 when another pod without a mapping reads it back. A
//! mapping that leaves the process's uid unmapped is refused by field
//! before a VM boots. Budget: two TCG guests, 40 s measured with the
//! machine at load 7-10 on two cores.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use common::{Env, Leftovers, publish, qemus_under, start_plugin};
use crust_testkit::BUSYBOX_IMAGE;

const RUNTIME: &str = "io.containerd.crust.v2";
const NS: &str = "default";

/// `/proc/self/uid_map`'s columns, single-spaced.
fn squeeze(s: &str) -> String {
    s.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_namespaced_container_writes_its_own_ids_to_a_volume() {
    let env = Env::start(NS);
    // The pool's loop devices are detached however the test ends.
    let _leftovers = Leftovers {
        pool: env.dir.path().join("pool"),
        cgroup_parent: None,
    };
    let plugin = start_plugin(&env).await;
    let csi = plugin.csi().await;
    let vol = publish(&env, &csi, "pvc-uns", "u-uns", true).await;
    let mount = format!("type=bind,src={},dst=/data,options=rbind:rw", vol.target);
    let ctrd = &env.ctrd;
    let t0 = std::time::Instant::now();

    // The mapped pod: its init sleeps, an exec does the work.
    let o = ctrd.ctr_in(
        NS,
        &[
            "run",
            "-d",
            "--runtime",
            RUNTIME,
            "--uidmap",
            "0:100000:65536",
            "--gidmap",
            "0:200000:65536",
            "--mount",
            &mount,
            BUSYBOX_IMAGE,
            "mapped",
            "sleep",
            "600",
        ],
    );
    assert!(o.status.success(), "{o:?}\n{}", env.logs());
    let script = "cat /proc/1/uid_map /proc/self/uid_map /proc/self/gid_map; id -u; \
                  echo written > /data/f && mkdir /data/d && sync; \
                  stat -c '%u:%g' /data/f /bin/busybox";
    let o = ctrd.ctr_in(
        NS,
        &[
            "task",
            "exec",
            "--exec-id",
            "e1",
            "mapped",
            "sh",
            "-c",
            script,
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{o:?}\n{}", env.logs());
    assert_eq!(
        squeeze(&out),
        // init's and the exec's maps, exactly the spec's; uid 0 inside;
        // the volume's file owned by the container's 0; the rootfs as
        // containerd's remapped snapshot chowned it, seen through the map.
        "0 100000 65536\n0 100000 65536\n0 200000 65536\n0\n0:0\n0:0",
        "{}",
        env.logs()
    );
    eprintln!("mapped pod and its exec: {:?}", t0.elapsed());
    ctrd.ctr_ok(NS, &["task", "kill", "-s", "SIGKILL", "mapped"]);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !ctrd
        .ctr_in(NS, &["task", "delete", "mapped"])
        .status
        .success()
    {
        assert!(std::time::Instant::now() < until, "{}", env.logs());
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    ctrd.ctr_ok(NS, &["containers", "rm", "mapped"]);
    eprintln!("mapped pod gone: {:?}", t0.elapsed());

    // Another pod, no mapping: the file is root's, as written inside.
    let o = ctrd.ctr_in(
        NS,
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            "--mount",
            &mount,
            BUSYBOX_IMAGE,
            "plain",
            "sh",
            "-c",
            "cat /proc/self/uid_map; stat -c '%u:%g' /data/f /data/d; cat /data/f",
        ],
    );
    assert!(o.status.success(), "{o:?}\n{}", env.logs());
    assert_eq!(
        squeeze(&String::from_utf8_lossy(&o.stdout)),
        "0 0 4294967295\n0:0\n0:0\nwritten",
        "{}",
        env.logs()
    );
    eprintln!("two user-namespace pods: {:?}", t0.elapsed());

    // The process's uid 0 unmapped: refused by field, no VM started.
    let o = ctrd.ctr_in(
        NS,
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            "--uidmap",
            "1000:100000:100",
            "--gidmap",
            "0:100000:65536",
            BUSYBOX_IMAGE,
            "unmapped",
            "true",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("process.user.uid 0 is not mapped by linux.uidMappings"),
        "{err}\n{}",
        env.logs()
    );
    assert!(qemus_under(env.dir.path()).is_empty(), "no VM was left");
}
