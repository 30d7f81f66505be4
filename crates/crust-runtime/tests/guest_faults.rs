//! Issue 10 against real guests (budget ~60 s with two TCG boots):
//!
//! * defect 1: a device mounted on the host (or the host's own disk) is
//!   never handed to a guest: `direct-volume add` and sandbox start refuse
//!   it (FAILED_PRECONDITION naming the mount); nothing is claimed, written
//!   or left running;
//! * the runtime's typed liveness: `crust capabilities`, `crust
//!   sandbox-state` (unknown for an id its root does not know), exit 2 and
//!   `unsupported:` for an unknown verb;
//! * QEMU SIGKILLed while the workload writes and fsyncs: the first `crust
//!   stats` is abnormal, `sandbox-state` says stopped, the device is free
//!   again, `e2fsck -fn` is clean after the journal replay, and the next
//!   sandbox takes the volume and finds the data.

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

/// The whole disk under the host's `/`, if `/` is on a block device.
fn host_root_disk() -> Option<String> {
    let root = crust_blockdev::mount_info()
        .ok()?
        .into_iter()
        .rev()
        .find(|m| m.mount_point == Path::new("/"))?;
    let name = std::fs::read_link(format!("/sys/dev/block/{}:{}", root.major, root.minor)).ok()?;
    // .../block/vda/vda1 -> vda (a partition's parent is its disk)
    let parent = name.parent()?.file_name()?.to_str()?.to_string();
    let own = name.file_name()?.to_str()?.to_string();
    let disk = if parent == "block" { own } else { parent };
    let dev = format!("/dev/{disk}");
    crust_blockdev::is_block_device(Path::new(&dev)).then_some(dev)
}

#[test]
fn mounted_devices_are_refused_liveness_is_typed_and_qemu_death_is_survived() {
    let env = Env::new();
    {
        // --- the typed liveness verbs ------------------------------------------
        let caps = env.json(&["crust", "capabilities"]);
        for v in ["capabilities", "resize", "sandbox-state", "stats"] {
            assert!(
                caps["verbs"].as_array().unwrap().iter().any(|x| x == v),
                "{caps}"
            );
        }
        let st = env.json(&["crust", "sandbox-state", "nobody-here"]);
        assert_eq!(st["state"], "unknown", "{st}");
        assert_eq!(st["sandbox_id"], "nobody-here");
        let out = env.run(&["crust", "frobnicate", "/x"]);
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).starts_with("unsupported:"));

        // --- defect 1: `direct-volume add` of a mounted device ------------------
        let disk = env.disk("f.img", 64 * MIB, FsType::Ext4);
        let target = env.target("pod-f", "pv-f");
        let host_view = env.dir.path().join("host-view");
        std::fs::create_dir(&host_view).unwrap();
        let m = disk.mount(&host_view, &[], false);
        let mi = format!(r#"{{"device":"{}","fstype":"ext4"}}"#, disk.dev_str());
        let err = env.fails(&[
            "direct-volume",
            "add",
            "--volume-path",
            &target,
            "--mount-info",
            &mi,
        ]);
        assert!(
            err.contains("in use") && err.contains(host_view.to_str().unwrap()),
            "{err}"
        );
        assert!(!env.store(Layout::Kata).exists(&target).unwrap());
        if let Some(root_disk) = host_root_disk() {
            let mi = format!(r#"{{"device":"{root_disk}","fstype":"ext4"}}"#);
            let err = env.fails(&[
                "direct-volume",
                "add",
                "--volume-path",
                &target,
                "--mount-info",
                &mi,
            ]);
            // In use (its partitions are mounted), or not even openable by
            // this sandboxed root: refused either way.
            assert!(err.contains(&root_disk), "{root_disk}: {err}");
            assert!(!env.store(Layout::Kata).exists(&target).unwrap());
        }

        // --- defect 1: sandbox start with a record whose device got mounted -----
        drop(m);
        env.stage(
            Layout::Crust,
            &target,
            &MountInfo::block(disk.dev_str(), "ext4"),
        );
        let m = disk.mount(&host_view, &[], false);
        std::fs::write(host_view.join("host-file"), b"host").unwrap();
        let writer = "i=0; while :; do \
                        dd if=/dev/zero of=/data/f$((i % 40)) bs=64k count=1 conv=fsync 2>/dev/null \
                          || { echo WRITE-FAILED $i; exit 3; }; \
                        i=$((i + 1)); echo $i > /data/count.new; \
                        dd if=/dev/null of=/data/count.new conv=notrunc,fsync 2>/dev/null; \
                        mv /data/count.new /data/count; \
                      done";
        let bundle = env.bundle(
            "w",
            &["sh", "-c", writer],
            vec![bind("/data", &target, false)],
        );
        let _slot = VmSlot::acquire();
        let err = env.fails(&["create", "--bundle", bundle.to_str().unwrap(), "intruder"]);
        assert!(
            err.contains("in use") && err.contains(host_view.to_str().unwrap()),
            "{err}"
        );
        assert_eq!(
            env.store(Layout::Crust).claimant(&target).unwrap(),
            None,
            "claim released"
        );
        assert!(!env.root.join("intruder").exists(), "nothing of it remains");
        assert_eq!(std::fs::read(host_view.join("host-file")).unwrap(), b"host");
        drop(m);

        // --- QEMU dies while the workload writes --------------------------------
        let sb = env.sandbox("victim");
        env.ok(&["create", "--bundle", bundle.to_str().unwrap(), "victim"]);
        env.ok(&["start", "victim"]);
        let count = || -> u64 {
            let (code, out, _) = sb.exec(&["cat", "/data/count"]);
            if code == 0 {
                out.trim().parse().unwrap_or(0)
            } else {
                0
            }
        };
        // 6 seen in the guest: 5 is durable (see the writer).
        wait_for("the writer to get going", Duration::from_secs(90), || {
            (count() >= 6).then_some(())
        });
        assert_eq!(
            env.json(&["crust", "sandbox-state", "victim"])["state"],
            "running"
        );
        // While the guest has it, the kernel refuses the host an exclusive
        // open (mkfs, fsck, mount): crust's runtime holds it.
        assert!(crust_blockdev::ensure_device_free(disk.dev(), "test").is_err());
        let qemu = sb.qemu_pid();
        signal(qemu, Signal::KILL);
        wait_for("QEMU to go", Duration::from_secs(30), || {
            (!pid_alive(qemu)).then_some(())
        });
        // Abnormal within one poll, and positively stopped.
        let stats = env.json(&["crust", "stats", &target]);
        assert_eq!(stats["volume_condition"]["abnormal"], true, "{stats}");
        let st = env.json(&["crust", "sandbox-state", "victim"]);
        assert_eq!(st["state"], "stopped", "{st}");
        assert!(st["detail"].as_str().unwrap().contains("QEMU"), "{st}");
        // The shim lets go of the device once QEMU is gone.
        wait_for("the device to be free", Duration::from_secs(30), || {
            crust_blockdev::ensure_device_free(disk.dev(), "test").ok()
        });
        // The journal replays on a host mount; the filesystem is clean.
        let files = disk.with_host_mount(false, |m| std::fs::read_dir(m).unwrap().count());
        assert!(files >= 5, "{files} entries");
        let fsck = std::process::Command::new("e2fsck")
            .args(["-f", "-n"])
            .arg(disk.dev())
            .output()
            .unwrap();
        assert!(
            fsck.status.success(),
            "e2fsck -fn: {}{}",
            String::from_utf8_lossy(&fsck.stdout),
            String::from_utf8_lossy(&fsck.stderr)
        );
        let written = disk.with_host_mount(true, |m| {
            std::fs::read_to_string(m.join("count"))
                .unwrap()
                .trim()
                .parse::<u64>()
                .unwrap()
        });
        // Each round's count is fsynced, then renamed into place, and the
        // next round's fsync commits that rename: the guest saw 6 or more,
        // so 5 was on disk before QEMU died (and never a torn file).
        assert!(
            written >= 5,
            "{written} on disk after the guest saw 6 or more"
        );

        // The claim is free for the next sandbox, which finds the data.
        let reader = env.bundle(
            "r",
            &["sh", "-c", "cat /data/count; sleep 1000"],
            vec![bind("/data", &target, false)],
        );
        let next = env.sandbox("next");
        env.ok(&["create", "--bundle", reader.to_str().unwrap(), "next"]);
        env.ok(&["start", "next"]);
        assert_eq!(
            env.store(Layout::Crust)
                .claimant(&target)
                .unwrap()
                .as_deref(),
            Some("next")
        );
        let seen: u64 = next.sh("cat /data/count").trim().parse().unwrap();
        assert!(seen >= written, "{seen} < {written}");
        env.ok(&["delete", "--force", "next"]);
        env.ok(&["delete", "--force", "victim"]);
        drop(next);
        drop(sb);
        assert_eq!(env.store(Layout::Crust).claimant(&target).unwrap(), None);
        env.store(Layout::Crust).remove(&target).unwrap();
    }
    assert_clean(&env);
}
