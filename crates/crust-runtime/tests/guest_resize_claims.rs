//! One real guest: online expansion (64 MiB → 128 MiB, KEP `crust resize`)
//! while the workload keeps writing and fsync'ing; one sandbox per volume;
//! QEMU killed with SIGKILL turning into an abnormal volume condition and
//! a claim another sandbox can take over; crust_ops' unstage refused while
//! the sandbox runs and allowed once the runtime says it is not running.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::time::Duration;

use common::*;
use crust_blockdev::FsType;
use crust_handoff::{Layout, MountInfo};
use crust_sandbox::sandbox::SandboxStore;
use crust_testkit::VmSlot;

#[test]
fn online_resize_claims_and_qemu_death() {
    let env = Env::new();
    {
        let disk = env.disk("r.img", 64 * MIB, FsType::Ext4);
        let target = env.target("pod-r", "pv-r");
        env.stage(
            Layout::Crust,
            &target,
            &MountInfo::block(disk.dev_str(), "ext4"),
        );
        // A second volume of the same pod, for crust_ops' unstage.
        let side = env.disk("s.img", 32 * MIB, FsType::Ext4);
        let side_target = env.target("pod-r", "pv-s");
        env.stage(
            Layout::Crust,
            &side_target,
            &MountInfo::block(side.dev_str(), "ext4"),
        );
        // Writes and fsyncs 256 KiB chunks over 40 files until told to
        // stop; any failed write ends it with status 3.
        let writer = "i=0; while [ ! -e /data/stop ]; do \
                        dd if=/dev/zero of=/data/f$((i % 40)) bs=256k count=1 conv=fsync 2>/dev/null \
                          || { echo WRITE-FAILED $i; exit 3; }; \
                        i=$((i + 1)); echo $i > /data/count; \
                      done; echo DONE $i; exit 0";
        let bundle = env.bundle(
            "w",
            &["sh", "-c", writer],
            vec![
                bind("/data", &target, false),
                bind("/side", &side_target, false),
            ],
        );

        let _slot = VmSlot::acquire();
        let sb = env.sandbox("writer");
        env.ok(&["create", "--bundle", bundle.to_str().unwrap(), "writer"]);
        env.ok(&["start", "writer"]);
        let count = || -> u64 {
            let (code, out, _) = sb.exec(&["cat", "/data/count"]);
            if code == 0 {
                out.trim().parse().unwrap_or(0)
            } else {
                0
            }
        };
        wait_for("the writer to get going", Duration::from_secs(60), || {
            (count() >= 5).then_some(())
        });

        // --- online resize under load ----------------------------------------
        let before = parse_df(&sb.sh("df -P -B1 /data")).0;
        assert!(before < 64 * MIB);
        disk.grow_file(128 * MIB);
        let n0 = count();
        let out = env.json(&["crust", "resize", &target, &(128 * MIB).to_string(), "0"]);
        assert_eq!(out["capacity_bytes"], 128 * MIB, "{out}");
        let after = parse_df(&sb.sh("df -P -B1 /data")).0;
        assert!(
            after > 110 * MIB && after > before + 50 * MIB,
            "guest df {before} -> {after}"
        );
        assert_eq!(
            sb.sh("blockdev --getsize64 $(awk '$2==\"/data\"{print $1}' /proc/mounts)")
                .trim(),
            (128 * MIB).to_string()
        );
        wait_for("writes after the resize", Duration::from_secs(60), || {
            (count() > n0 + 5).then_some(())
        });
        // The new space is usable: 90 MiB would not fit the old 64 MiB.
        sb.sh("dd if=/dev/zero of=/data/big bs=1M count=90 conv=fsync 2>/dev/null");
        // Stats follow the resize.
        let stats = env.json(&["crust", "stats", &target]);
        assert_eq!(stats["usage"][0]["total"], after, "{stats}");
        // Bounds: min above the device, and a max below it, both refused.
        let err = env.fails(&["crust", "resize", &target, &(256 * MIB).to_string(), "0"]);
        assert!(err.contains("grow it first"), "{err}");
        let err = env.fails(&["crust", "resize", &target, "1", &(100 * MIB).to_string()]);
        assert!(err.contains("more than the limit"), "{err}");

        sb.sh("touch /data/stop && sync");
        let st = wait_for("the writer to finish", Duration::from_secs(60), || {
            let st = sb.state();
            (st["status"] == "stopped").then_some(st)
        });
        assert_eq!(st["exitStatus"], 0, "{st}");
        let log = env.ok(&["logs", "writer"]);
        assert!(
            log.contains("DONE") && !log.contains("WRITE-FAILED"),
            "{log}"
        );

        // --- one sandbox per volume ----------------------------------------------
        // The workload has exited but the VM still has the volume mounted.
        let err = env.fails(&["create", "--bundle", bundle.to_str().unwrap(), "second"]);
        assert!(err.contains("already claimed by sandbox writer"), "{err}");
        assert!(
            !env.root.join("second").exists(),
            "nothing of the refused sandbox may remain"
        );
        assert_eq!(
            env.store(Layout::Crust)
                .claimant(&target)
                .unwrap()
                .as_deref(),
            Some("writer")
        );
        // An unpublish while the VM still runs: the record stays, so the
        // next publish cannot hand the device to a second VM.
        let e = env.unstage(&side_target).unwrap_err();
        assert!(
            matches!(e, crust_ops::OpsError::StillClaimed { .. })
                && e.to_string().contains("still claimed by sandbox writer")
                && e.to_string().contains("says it serves the volume"),
            "{e}"
        );
        assert_eq!(
            env.store(Layout::Crust)
                .claimant(&side_target)
                .unwrap()
                .as_deref(),
            Some("writer")
        );

        // --- QEMU dies --------------------------------------------------------------
        let qemu = sb.qemu_pid();
        let shim = sb.shim_pid();
        signal(qemu, Signal::KILL);
        let st = wait_for("the shim to notice", Duration::from_secs(30), || {
            let st = env.state_file("writer");
            st["reason"]
                .as_str()
                .is_some_and(|r| r.contains("QEMU exited"))
                .then_some(st)
        });
        assert_eq!(st["status"], "stopped");
        assert!(pid_alive(shim), "the shim outlives its VM to report on it");
        let stats = env.json(&["crust", "stats", &target]);
        assert_eq!(stats["volume_condition"]["abnormal"], true, "{stats}");
        assert_eq!(
            stats["volume_condition"]["message"],
            "sandbox writer is not running (QEMU exited)"
        );
        let kata_style = env.json(&["direct-volume", "stats", "--volume-path", &target]);
        assert_eq!(
            kata_style,
            serde_json::json!({"volume_condition": {
                "abnormal": true,
                "message": "sandbox writer is not running (QEMU exited)"
            }})
        );
        let err = env.fails(&["crust", "resize", &target, "1", "0"]);
        assert!(err.contains("not running"), "{err}");
        // The VM is gone but its claim is still there: crust_ops asks the
        // runtime, which says the sandbox is not running, so the stale
        // claim goes with the record.
        let side_store = env.store(Layout::Crust);
        assert_eq!(
            side_store.claimant(&side_target).unwrap().as_deref(),
            Some("writer")
        );
        env.unstage(&side_target).unwrap();
        assert!(!side_store.exists(&side_target).unwrap());
        assert!(!side_store.record_dir(&side_target).unwrap().exists());
        // The claim is stale: a new claimant takes it over.
        let sandboxes = SandboxStore::new(&env.root);
        assert!(!sandboxes.holds_volumes("writer"));
        let store = env.store(Layout::Crust);
        store
            .claim(&target, "takeover", |id| sandboxes.holds_volumes(id))
            .unwrap();
        assert_eq!(
            store.claimant(&target).unwrap().as_deref(),
            Some("takeover")
        );
        store.release(&target, "takeover").unwrap();
        // delete cleans up what is left (shim, state) without complaint.
        env.ok(&["delete", "writer"]);
        assert!(!pid_alive(shim));
        assert!(!env.root.join("writer").exists());
        assert_eq!(store.claimant(&target).unwrap(), None);
        drop(sb);

        // Everything written before the crash that was fsync'd is there.
        disk.with_host_mount(true, |m| {
            assert_eq!(std::fs::metadata(m.join("big")).unwrap().len(), 90 * MIB);
            assert!(m.join("stop").exists());
            let st = rustix::fs::statvfs(m).unwrap();
            assert!(st.f_blocks * st.f_frsize > 110 * MIB);
        });
    }
    assert_clean(&env);
}
