//! The private containerd guard: it starts with its own config and sockets,
//! imports the offline test images, runs a runc container with `ctr run`,
//! and leaves no process, mount or socket behind when dropped.
//! Budget: ~15 s (no guest).

use crust_testkit::{BUSYBOX_IMAGE, Containerd, ContainerdOptions, PAUSE_IMAGE};

#[test]
fn private_containerd_runs_images_and_cleans_up() {
    crust_testkit::require_root();
    let (busybox, pause) = crust_testkit::ensure_test_images();
    let ctrd = Containerd::start(ContainerdOptions::default());
    let dir = ctrd.dir().to_path_buf();
    let sock = ctrd.address();
    assert!(sock.starts_with(&dir), "socket inside the temp dir");

    ctrd.import_images("default", &[&busybox, &pause]);
    let images = ctrd.ctr_ok("default", &["images", "ls", "-q"]);
    for want in [BUSYBOX_IMAGE, PAUSE_IMAGE] {
        assert!(images.lines().any(|l| l == want), "{want} in {images}");
    }

    // The image really runs (runc, host side): output and exit code.
    let runc_root = ctrd.runc_root();
    let runc_root = runc_root.to_str().unwrap();
    let o = ctrd.ctr_in(
        "default",
        &[
            "run",
            "--runc-root",
            runc_root,
            "--rm",
            BUSYBOX_IMAGE,
            "probe",
            "sh",
            "-c",
            "echo hello-from-busybox; exit 7",
        ],
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "hello-from-busybox",
        "stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(o.status.code(), Some(7));

    // A detached container whose shim must be stopped by the guard.
    ctrd.ctr_ok(
        "default",
        &[
            "run",
            "--runc-root",
            runc_root,
            "-d",
            BUSYBOX_IMAGE,
            "sleeper",
            "sleep",
            "600",
        ],
    );
    let shims = ctrd.shim_pids();
    assert_eq!(shims.len(), 1, "one runc shim: {shims:?}");
    let sleeper: i32 = ctrd
        .ctr_ok("default", &["tasks", "ls"])
        .lines()
        .find(|l| l.starts_with("sleeper"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .expect("sleeper task pid");
    assert!(crust_testkit::pid_alive(sleeper));
    let pid = ctrd.pid().unwrap();
    drop(ctrd);

    assert!(!crust_testkit::pid_alive(pid as i32), "containerd stopped");
    for p in shims.into_iter().chain([sleeper]) {
        assert!(!crust_testkit::pid_alive(p), "process {p} stopped");
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(dir.to_str().unwrap()),
        "no mount left below {}",
        dir.display()
    );
    assert!(!dir.exists(), "temp dir removed");
}
