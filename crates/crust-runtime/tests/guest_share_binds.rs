//! `--share-binds`: the bundle's binds without a hand-off record reach the
//! guest over virtio-fs (one virtiofsd with the shim's settings), next to a
//! deferred volume on virtio-blk in the same guest; read-only binds stay
//! read-only; a missing bind source is refused with nothing left; delete
//! unmounts the share without touching the data behind it.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use crust_blockdev::FsType;
use crust_handoff::{Layout, MountInfo};
use crust_testkit::VmSlot;

/// Mount points at or below `dir` in the host's mount namespace.
fn mounts_below(dir: &Path) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|p| Path::new(p).starts_with(dir))
        .collect()
}

/// Command lines of live virtiofsd processes naming `needle`.
fn virtiofsd_naming(needle: &str) -> Vec<String> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if !e
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        if stat
            .rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'))
        {
            continue;
        }
        let cmd = std::fs::read(e.path().join("cmdline"))
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .unwrap_or_default();
        let argv0 = cmd.split(' ').next().unwrap_or_default();
        if argv0.ends_with("virtiofsd") && cmd.contains(needle) {
            v.push(cmd);
        }
    }
    v
}

#[test]
fn binds_are_shared_over_virtio_fs_next_to_a_deferred_volume() {
    let mut env = Env::new();
    env.extra_args = vec!["--share-binds".into()];
    let root = env.root.display().to_string();

    // Host content: a directory (rw) and a file (ro).
    let shared = env.files.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::write(shared.join("hello.txt"), "from-host\n").unwrap();
    let hosts = env.files.join("hosts");
    std::fs::write(&hosts, "127.0.0.1 crust-test\n").unwrap();

    // A deferred volume in the same bundle.
    let disk = env.disk("v.img", 32 * MIB, FsType::Ext4);
    let target = env.target("pod-s", "pv-s");
    env.stage(
        Layout::Crust,
        &target,
        &MountInfo::block(disk.dev_str(), "ext4"),
    );

    // --- a missing bind source: refused, nothing left -----------------------
    let bad = env.bundle(
        "bad",
        &["sleep", "600"],
        vec![bind("/gone", "/nonexistent/crust-share-src", false)],
    );
    let err = env.fails(&["create", "--bundle", bad.to_str().unwrap(), "bad"]);
    assert!(err.contains("/nonexistent/crust-share-src"), "{err}");
    assert!(!env.root.join("bad").exists(), "sandbox state left");
    assert_eq!(mounts_below(env.dir.path()), Vec::<String>::new());

    let bundle = env.bundle(
        "s",
        &["sleep", "600"],
        vec![
            bind("/data", &target, false),
            bind("/shared", shared.to_str().unwrap(), false),
            bind("/cfg/hosts", hosts.to_str().unwrap(), true),
        ],
    );
    let _slot = VmSlot::acquire();
    let sb = env.sandbox("s");
    env.ok(&["create", "--bundle", bundle.to_str().unwrap(), "s"]);
    let st = sb.state();
    assert_eq!(st["volumes"].as_array().unwrap().len(), 1, "{st}");
    assert_eq!(st["skippedMounts"], serde_json::json!([]), "{st}");
    let sm = st["sharedMounts"].as_array().unwrap();
    assert_eq!(
        sm.iter()
            .map(|m| (
                m["destination"].as_str().unwrap(),
                m["readonly"].as_bool().unwrap()
            ))
            .collect::<Vec<_>>(),
        [("/shared", false), ("/cfg/hosts", true)],
        "{st}"
    );
    // One virtiofsd (its sandbox forks a child) serving the sandbox's
    // share's read-only guest view, with the shim's settings.
    let daemons = virtiofsd_naming(&root);
    assert!(!daemons.is_empty());
    let share_dir = env.root.join("s/share.guest").display().to_string();
    let settings = crust_vmm::VIRTIOFSD_ARGS.join(" ");
    for d in &daemons {
        assert!(d.contains(&format!("--shared-dir {share_dir} ")), "{d}");
        assert!(d.contains(&settings), "{settings:?} missing in {d}");
    }
    env.ok(&["start", "s"]);

    // --- in the guest ----------------------------------------------------------
    let mounts = sb.sh("cat /proc/mounts");
    let fstype_at = |dest: &str| {
        mounts
            .lines()
            .find(|l| l.split(' ').nth(1) == Some(dest))
            .and_then(|l| l.split(' ').nth(2))
            .map(str::to_string)
    };
    assert_eq!(fstype_at("/data").as_deref(), Some("ext4"), "{mounts}");
    assert_eq!(
        fstype_at("/shared").as_deref(),
        Some("virtiofs"),
        "{mounts}"
    );
    assert_eq!(sb.sh("cat /shared/hello.txt"), "from-host\n");
    sb.sh("echo from-guest > /shared/out.txt && sync");
    assert_eq!(
        std::fs::read_to_string(shared.join("out.txt")).unwrap(),
        "from-guest\n"
    );
    assert_eq!(sb.sh("cat /cfg/hosts"), "127.0.0.1 crust-test\n");
    let (code, _, _) = sb.exec(&["sh", "-c", "echo x >> /cfg/hosts"]);
    assert_ne!(code, 0, "a read-only bind was writable");
    assert_eq!(
        std::fs::read_to_string(&hosts).unwrap(),
        "127.0.0.1 crust-test\n"
    );
    sb.sh("echo on-the-volume > /data/v.txt && sync");

    // --- teardown: share unmounted, data behind it intact ------------------------
    env.ok(&["kill", "s", "KILL"]);
    env.ok(&["delete", "--force", "s"]);
    assert!(!env.root.join("s").exists());
    assert_eq!(mounts_below(env.dir.path()), Vec::<String>::new());
    wait_for("virtiofsd to exit", Duration::from_secs(10), || {
        virtiofsd_naming(&root).is_empty().then_some(())
    });
    assert_eq!(
        std::fs::read_to_string(shared.join("hello.txt")).unwrap(),
        "from-host\n"
    );
    assert_eq!(
        std::fs::read_to_string(shared.join("out.txt")).unwrap(),
        "from-guest\n"
    );
    disk.with_host_mount(true, |m| {
        assert_eq!(
            std::fs::read_to_string(m.join("v.txt")).unwrap(),
            "on-the-volume\n"
        );
    });
}
