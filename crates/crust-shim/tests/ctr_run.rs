//! Must-show 1: `ctr run --runtime io.containerd.crust.v2` of the busybox
//! image runs inside a VM (the guest kernel's `uname -r`), prints to
//! stdout and returns the exit code; `ctr task exec` and `ctr task kill`
//! work; a raw block device (`--device`, what Kubernetes volumeDevices
//! become) appears as a node in the container; nothing is left afterwards. Budget: three TCG guests, ~20 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use common::{Env, host_release, qemus_under};
use crust_testkit::BUSYBOX_IMAGE;

const RUNTIME: &str = "io.containerd.crust.v2";

#[test]
fn ctr_run_exec_kill_in_a_vm() {
    let env = Env::start("default");
    let ctrd = &env.ctrd;
    // Every task event containerd receives, for the checks below.
    let events_log = env.dir.path().join("events.log");
    let events = ctrd
        .ctr_cmd("default", &["events"])
        .stdout(std::fs::File::create(&events_log).unwrap())
        .stderr(std::process::Stdio::null())
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut events = crust_testkit::ChildGuard::new(events);

    // A foreground run: output and exit code come back through containerd.
    let o = ctrd.ctr_in(
        "default",
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            BUSYBOX_IMAGE,
            "once",
            "sh",
            "-c",
            "uname -r; echo hello from the guest; echo to-stderr >&2; exit 3",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let mut lines = out.lines();
    let release = lines.next().unwrap_or_default().to_string();
    assert!(
        release.ends_with("-cloud-amd64") && release != host_release(),
        "uname -r {release:?} is the guest kernel's, not the host's {:?}\nstderr: {err}\n{}",
        host_release(),
        env.logs()
    );
    assert_eq!(
        lines.collect::<Vec<_>>(),
        vec!["hello from the guest"],
        "{}",
        env.logs()
    );
    assert!(err.contains("to-stderr"), "stderr: {err}");
    assert_eq!(o.status.code(), Some(3), "exit code; {}", env.logs());
    assert!(
        qemus_under(&env.runtime_root).is_empty(),
        "the VM of a finished --rm run is gone"
    );

    // A detached container: exec into it, then kill it.
    ctrd.ctr_ok(
        "default",
        &[
            "run",
            "-d",
            "--runtime",
            RUNTIME,
            BUSYBOX_IMAGE,
            "bg",
            "sh",
            "-c",
            "echo started; exec sleep 600",
        ],
    );
    assert_eq!(
        qemus_under(&env.runtime_root).len(),
        1,
        "one VM for the container"
    );
    let o = ctrd.ctr_in(
        "default",
        &[
            "task",
            "exec",
            "--exec-id",
            "x1",
            "bg",
            "sh",
            "-c",
            "cat /proc/1/comm >/dev/null; echo from-exec; id -u; exit 4",
        ],
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "from-exec\n0\n",
        "stderr: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        env.logs()
    );
    assert_eq!(o.status.code(), Some(4));
    // An exec id can be used again once the last one is gone; an exec
    // that cannot start fails at once (and leaves nothing waiting).
    let o = ctrd.ctr_in(
        "default",
        &["task", "exec", "--exec-id", "x1", "bg", "echo", "again"],
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "again\n",
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let t = std::time::Instant::now();
    let o = ctrd.ctr_in(
        "default",
        &["task", "exec", "--exec-id", "bad", "bg", "/no/such/binary"],
    );
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("/no/such/binary"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(30));
    let ps = ctrd.ctr_ok("default", &["task", "ps", "bg"]);
    assert!(ps.lines().count() >= 2, "guest pids listed: {ps}");

    ctrd.ctr_ok("default", &["task", "kill", "-s", "SIGKILL", "bg"]);
    let mut status = String::new();
    for _ in 0..100 {
        status = ctrd.ctr_ok("default", &["task", "ls"]);
        if status
            .lines()
            .any(|l| l.starts_with("bg") && l.contains("STOPPED"))
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("bg") && l.contains("STOPPED")),
        "{status}\n{}",
        env.logs()
    );
    // Killed by SIGKILL: 128 + 9, as with runc.
    let info = ctrd.ctr_ok("default", &["task", "delete", "bg"]);
    assert!(info.is_empty() || info.contains("137"), "{info}");
    ctrd.ctr_ok("default", &["containers", "rm", "bg"]);
    // The shim told containerd about each step of "bg" and its exec.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let _ = events.child().kill();
    let seen = std::fs::read_to_string(&events_log).unwrap();
    for topic in [
        "/tasks/create",
        "/tasks/start",
        "/tasks/exec-added",
        "/tasks/exec-started",
        "/tasks/exit",
        "/tasks/delete",
    ] {
        assert!(
            seen.lines()
                .any(|l| l.contains(topic) && l.contains("\"bg\"")),
            "no {topic} event for bg in:\n{seen}"
        );
    }
    assert!(
        qemus_under(&env.runtime_root).is_empty(),
        "the VM is gone after delete"
    );
    assert!(
        std::fs::read_dir(&env.runtime_root)
            .unwrap()
            .next()
            .is_none(),
        "no sandbox record left in {}",
        env.runtime_root.display()
    );
}

/// A shim that cannot start (here `CRUST_RUNTIME_ACCEL=warp-drive` in
/// containerd's environment) puts its reason into the error containerd
/// answers `ctr run` with, not only into the shim's log file; nothing is
/// left running. No guest boots (~2 s).
#[test]
fn a_shim_start_failure_names_its_reason_in_containerds_error() {
    let env = Env::start_with(
        "default",
        vec![("CRUST_RUNTIME_ACCEL".into(), "warp-drive".into())],
    );
    let o = env.ctrd.ctr_in(
        "default",
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            BUSYBOX_IMAGE,
            "nogo",
            "true",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("failed to start") && err.contains("warp-drive") && err.contains("accel"),
        "ctr's error does not say why:\n{err}\n{}",
        env.logs()
    );
    assert!(!err.contains("see the containerd log"), "{err}");
    assert!(qemus_under(&env.runtime_root).is_empty());
}
