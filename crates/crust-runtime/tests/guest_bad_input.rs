//! Bad input gets a clear error and starts or mounts nothing: records
//! naming a missing device, relative or traversing mount sources, a forged
//! `mountInfo.json` outside the hand-off roots, a subPath symlink escaping
//! its volume, a bundle of one pod naming another pod's volume, a guest
//! that stops answering (SIGSTOP'd QEMU) and an unpublish meanwhile.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::*;
use crust_blockdev::FsType;
use crust_handoff::{Layout, MountInfo};
use crust_testkit::VmSlot;

/// Writes a record by hand (the store itself would refuse it), with the
/// ownership and modes the store demands, so only its content is wrong.
fn plant_record(root: &std::path::Path, dir_name: &str, json: &str) {
    let dir = root.join(dir_name);
    std::fs::create_dir_all(&dir).unwrap();
    for d in [root, dir.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    let f = dir.join("mountInfo.json");
    std::fs::write(&f, json).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn no_sandbox_left(env: &Env, id: &str) {
    assert!(
        !env.root.join(id).exists(),
        "sandbox {id} left state behind"
    );
}

#[test]
fn bad_input_and_hung_guest() {
    let mut env = Env::new();
    // Short agent/shim bound so the hung-guest case answers quickly.
    env.timeout_ms = 3000;
    {
        // --- refused before anything starts -----------------------------------
        let ghost = env.target("pod-g", "pv-ghost");
        plant_record(
            &env.crust,
            &crust_handoff::crust_key(&ghost),
            r#"{"volume-type":"block","device":"/dev/crust-no-such-device","fstype":"ext4"}"#,
        );
        let b = env.bundle("ghost", &["true"], vec![bind("/data", &ghost, false)]);
        let err = env.fails(&["create", "--bundle", b.to_str().unwrap(), "ghost"]);
        eprintln!("record with a missing device: {err}");
        assert!(err.contains("/dev/crust-no-such-device"), "{err}");
        no_sandbox_left(&env, "ghost");
        assert_eq!(
            env.store(Layout::Crust).claimant(&ghost).ok().flatten(),
            None
        );

        for (src, why) in [
            ("pods/pod-r/volumes/x/pv/mount", "not absolute"),
            (
                &format!("{}/pod-r/volumes/../../../etc", env.pods.display()) as &str,
                "not normalized",
            ),
            (
                &format!("{}/pod-r/volumes/x/./mount", env.pods.display()),
                "not normalized",
            ),
        ] {
            let b = env.bundle("rel", &["true"], vec![bind("/data", src, false)]);
            let err = env.fails(&["create", "--bundle", b.to_str().unwrap(), "rel"]);
            assert!(err.contains(why) && err.contains("/data"), "{src}: {err}");
            no_sandbox_left(&env, "rel");
        }

        // direct-volume add validates before writing anything.
        let t = env.target("pod-k", "pv-k");
        let err = env.fails(&[
            "direct-volume",
            "add",
            "--volume-path",
            &t,
            "--mount-info",
            r#"{"device":"/dev/crust-no-such-device","fstype":"ext4"}"#,
        ]);
        assert!(err.contains("/dev/crust-no-such-device"), "{err}");
        let err = env.fails(&[
            "direct-volume",
            "add",
            "--volume-path",
            "relative/path",
            "--mount-info",
            r#"{"device":"/dev/null","fstype":"ext4"}"#,
        ]);
        assert!(err.contains("not absolute"), "{err}");
        assert!(!env.kata.join(crust_handoff::kata_key(&t)).exists());

        // --- a guest with one real volume, one forged one, one escape --------
        let disk = env.disk("v.img", 32 * MIB, FsType::Ext4);
        disk.with_host_mount(false, |m| {
            std::os::unix::fs::symlink("/etc", m.join("escape")).unwrap();
            std::os::unix::fs::symlink("../../../../..", m.join("up")).unwrap();
            std::fs::create_dir(m.join("inside")).unwrap();
        });
        let target = env.target("pod-v", "pv-v");
        env.stage(
            Layout::Crust,
            &target,
            &MountInfo::block(disk.dev_str(), "ext4"),
        );

        // Another pod's sandbox naming pod-v's volume directory (a hostPath
        // does that): refused before anything starts, naming both pods.
        for (annotations, why) in [
            (
                serde_json::json!({"io.kubernetes.cri.sandbox-uid": "pod-i"}),
                "is a volume of pod pod-v, not of this sandbox's pod pod-i",
            ),
            (
                serde_json::json!({"io.kubernetes.pod.uid": "pod-i"}),
                "is a volume of pod pod-v, not of this sandbox's pod pod-i",
            ),
            // Two annotations that disagree: one was not set by the runtime.
            (
                serde_json::json!({"io.kubernetes.cri.sandbox-uid": "pod-i",
                                   "io.kubernetes.pod.uid": "pod-v"}),
                "annotations disagree on the pod uid",
            ),
        ] {
            let b = env.bundle_annotated(
                "intruder",
                &["true"],
                vec![bind("/steal", &format!("{target}/inside"), false)],
                annotations,
            );
            let err = env.fails(&["create", "--bundle", b.to_str().unwrap(), "intruder"]);
            eprintln!("another pod's volume: {err}");
            assert!(err.contains(why), "{err}");
            no_sandbox_left(&env, "intruder");
            let rec = env.store(Layout::Crust).inspect(&target).unwrap();
            assert_eq!((rec.claimant, rec.runtime_cli), (None, None));
        }

        // The attacker's disk and a record for it planted in a directory the
        // workload controls (an emptyDir), under the names old designs read.
        let victim = env.disk("victim.img", 32 * MIB, FsType::Ext4);
        victim.with_host_mount(false, |m| std::fs::write(m.join("SECRET"), b"s").unwrap());
        let forged_dir = env.pods.join("pod-v/volumes/kubernetes.io~empty-dir/cache");
        std::fs::create_dir_all(&forged_dir).unwrap();
        let forged = MountInfo::block(victim.dev_str(), "ext4").to_json();
        std::fs::write(forged_dir.join("mountInfo.json"), &forged).unwrap();
        std::fs::write(forged_dir.join("csiPlugin.json"), &forged).unwrap();

        // The pod's own sandbox, named the way containerd names it.
        let bundle = env.bundle_annotated(
            "v",
            &["sleep", "600"],
            vec![
                bind("/data", &target, false),
                bind("/cache", forged_dir.to_str().unwrap(), false),
                bind("/escape", &format!("{target}/escape"), false),
            ],
            serde_json::json!({"io.kubernetes.cri.sandbox-uid": "pod-v"}),
        );
        let _slot = VmSlot::acquire();

        // A record whose fstype does not match the disk: the guest refuses
        // to mount, and create rolls everything back.
        let w = env.disk("w.img", 32 * MIB, FsType::Ext4);
        let wrong = env.target("pod-w", "pv-w");
        env.stage(Layout::Crust, &wrong, &MountInfo::block(w.dev_str(), "xfs"));
        let wb = env.bundle("w", &["true"], vec![bind("/w", &wrong, false)]);
        let failed = env.sandbox("wrongfs");
        let err = env.fails(&["create", "--bundle", wb.to_str().unwrap(), "wrongfs"]);
        eprintln!("fstype mismatch: {err}");
        assert!(err.contains("xfs") && err.contains(&wrong), "{err}");
        no_sandbox_left(&env, "wrongfs");
        let rec = env.store(Layout::Crust).inspect(&wrong).unwrap();
        assert_eq!((rec.claimant, rec.runtime_cli), (None, None));
        drop(failed);
        assert_clean_processes(&env);

        let sb = env.sandbox("v");
        env.ok(&["create", "--bundle", bundle.to_str().unwrap(), "v"]);
        let st = sb.state();
        assert_eq!(st["volumes"].as_array().unwrap().len(), 1, "{st}");
        assert_eq!(st["skippedMounts"], serde_json::json!(["/cache"]));
        // Exactly one disk reached the guest, and it is ours.
        let disks = sb.sh("for d in /sys/block/vd*; do cat $d/serial; echo; done");
        let serials: Vec<&str> = disks.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(
            serials,
            [st["volumes"][0]["serial"].as_str().unwrap()],
            "{disks}"
        );

        // A subPath through a symlink leaving the volume: start refuses.
        let err = env.fails(&["start", "v"]);
        eprintln!("start with an escaping subPath: {err}");
        assert!(err.contains("/escape"), "{err}");
        assert_eq!(sb.state()["status"], "created");
        let mounts = sb.sh("cat /proc/mounts");
        assert!(!mounts.contains(" /escape "), "{mounts}");
        assert!(!mounts.contains(" /cache "), "{mounts}");
        let (_, listing, _) = sb.exec(&["ls", "/escape"]);
        assert!(
            !listing.contains("passwd"),
            "the guest's /etc leaked: {listing}"
        );

        // A relative symlink climbing out is refused the same way.
        drop(sb);
        let bundle = env.bundle(
            "v2",
            &["sleep", "600"],
            vec![
                bind("/data", &target, false),
                bind("/up", &format!("{target}/up/etc"), false),
            ],
        );
        let sb = env.sandbox("v2");
        env.ok(&["create", "--bundle", bundle.to_str().unwrap(), "v2"]);
        let err = env.fails(&["start", "v2"]);
        assert!(err.contains("/up"), "{err}");
        assert!(!sb.sh("cat /proc/mounts").contains(" /up "));

        // --- a guest that stops answering --------------------------------------
        let qemu = sb.qemu_pid();
        assert_eq!(
            env.json(&["crust", "stats", &target])["volume_condition"]["abnormal"],
            false
        );
        signal(qemu, Signal::STOP);
        let out = env.run(&["crust", "stats", &target]);
        // A stuck VM still has the device: an unpublish now keeps the record.
        // (Liveness is the host's fact, QEMU's pid and start time: a frozen
        // guest is answered at once as running, without asking the guest.)
        let unstaged = env.unstage(&target);
        signal(qemu, Signal::CONT);
        let e = unstaged.unwrap_err();
        eprintln!("unstage while the guest is frozen: {e}");
        assert!(
            matches!(e, crust_ops::OpsError::StillClaimed { .. })
                && e.to_string().contains("still claimed by sandbox v2")
                && e.to_string().contains("says it serves the volume"),
            "{e}"
        );
        assert_eq!(
            env.store(Layout::Crust)
                .claimant(&target)
                .unwrap()
                .as_deref(),
            Some("v2")
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "stats of a frozen guest succeeded: {err}"
        );
        eprintln!("stats of a frozen guest: {err}");
        assert!(err.contains("timed out") && err.contains(&target), "{err}");
        assert!(out.stdout.is_empty());
        // The agent answers again once the VM runs.
        let stats = wait_for(
            "the thawed guest to answer",
            Duration::from_secs(60),
            || {
                let out = env.run(&["crust", "stats", &target]);
                out.status
                    .success()
                    .then(|| serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap())
            },
        );
        assert_eq!(stats["volume_condition"]["abnormal"], false, "{stats}");

        env.ok(&["delete", "v2"]);
        no_sandbox_left(&env, "v2");
        drop(sb);

        // The attacker's disk was never touched.
        victim.with_host_mount(true, |m| assert!(m.join("SECRET").exists()));
    }
    assert_clean(&env);
}
