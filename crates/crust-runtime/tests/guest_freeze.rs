//! One real guest: `crust freeze` / `crust thaw` (the runtime CLI verbs a
//! snapshot of a deferred volume uses, reached through crust_ops): while
//! frozen the guest's writers block and the device's bytes do not change;
//! the thaw lets them go on and says the volume stayed frozen; the guest
//! thaws by itself after the time limit and the next thaw says so; a guest
//! that dies while frozen makes the thaw fail (so a snapshot taken then
//! fails) and leaves nothing frozen: the next sandbox mounts the volume.
//!
//! Time budget: about 30 s (one guest boot, one reboot after the kill).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use crust_blockdev::FsType;
use crust_handoff::{Layout, MountInfo};
use crust_testkit::VmSlot;
use sha2::{Digest, Sha256};

fn device_digest(dev: &str) -> String {
    // O_DIRECT: QEMU writes the loop device's backing file around the
    // device's own page cache, which the runtime's hold keeps alive.
    let out = std::process::Command::new("dd")
        .args([&format!("if={dev}"), "iflag=direct", "bs=1M", "status=none"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    format!("{:x}", Sha256::digest(&out.stdout))
}

#[test]
fn freeze_blocks_writers_keeps_the_device_still_and_thaws() {
    let env = Env::new();
    let disk = env.disk("f.img", 64 * MIB, FsType::Ext4);
    let target = env.target("pod-f", "pv-f");
    env.stage(
        Layout::Crust,
        &target,
        &MountInfo::block(disk.dev_str(), "ext4"),
    );
    // Appends a numbered line and fsyncs, over and over.
    let writer = "i=0; while true; do i=$((i + 1)); echo line $i >> /data/log; sync; \
                  echo $i > /data/count; sync; done";
    let bundle = env.bundle(
        "w",
        &["sh", "-c", writer],
        vec![bind("/data", &target, false)],
    );
    let _slot = VmSlot::acquire();
    let sb = env.sandbox("freezer");
    env.ok(&["create", "--bundle", bundle.to_str().unwrap(), "freezer"]);
    env.ok(&["start", "freezer"]);
    // `state` says how QEMU does the volume's I/O: on the loop device's
    // backing file, O_DIRECT, the host's best engine (issue 28).
    let st = sb.state();
    let io = &st["blockIo"][&target];
    assert_eq!(io["backingFile"], true, "{st}");
    assert_eq!(io["direct"], true, "{st}");
    assert_eq!(io["aio"], crust_qmp::host_engines()[0].as_str(), "{io}");
    let count = || -> u64 {
        let (code, out, _) = sb.exec(&["cat", "/data/count"]);
        if code == 0 {
            out.trim().parse().unwrap_or(0)
        } else {
            0
        }
    };
    wait_for("the writer to get going", Duration::from_secs(60), || {
        (count() >= 3).then_some(())
    });
    let caps = env.json(&["crust", "capabilities"]);
    for verb in ["freeze", "thaw"] {
        assert!(
            caps["verbs"].as_array().unwrap().iter().any(|v| v == verb),
            "{caps}"
        );
    }

    // --- frozen: writers wait, the device does not change ----------------
    env.ok(&["crust", "freeze", &target, "60000"]);
    let at_freeze = count();
    let d1 = device_digest(disk.dev_str());
    std::thread::sleep(Duration::from_millis(1500));
    let d2 = device_digest(disk.dev_str());
    assert_eq!(d1, d2, "the device changed while the guest had it frozen");
    assert!(
        count() <= at_freeze + 1,
        "the writer kept writing while frozen"
    );
    let out = env.json(&["crust", "thaw", &target]);
    assert_eq!(out["was_frozen"], true, "{out}");
    assert_eq!(out["expired"], false, "{out}");
    wait_for("the writer to go on", Duration::from_secs(30), || {
        (count() > at_freeze + 2).then_some(())
    });
    // A second thaw: nothing was frozen.
    let out = env.json(&["crust", "thaw", &target]);
    assert_eq!(out["was_frozen"], false, "{out}");

    // --- the guest's own time limit --------------------------------------
    env.ok(&["crust", "freeze", &target, "1000"]);
    let frozen_at = count();
    let t0 = Instant::now();
    wait_for(
        "the guest to thaw by itself",
        Duration::from_secs(30),
        || (count() > frozen_at + 1).then_some(()),
    );
    assert!(t0.elapsed() >= Duration::from_millis(900));
    let out = env.json(&["crust", "thaw", &target]);
    assert_eq!(out["was_frozen"], false, "{out}");
    assert_eq!(
        out["expired"], true,
        "the thaw reports the time limit: {out}"
    );
    // A freeze of a frozen volume is refused (one copy at a time).
    env.ok(&["crust", "freeze", &target, "60000"]);
    let err = env.fails(&["crust", "freeze", &target, "60000"]);
    assert!(err.contains("already frozen"), "{err}");

    // --- the guest dies while frozen ---------------------------------------
    signal(sb.qemu_pid(), Signal::KILL);
    let err = env.fails(&["crust", "thaw", &target]);
    assert!(!err.is_empty());
    env.ok(&["delete", "-f", "freezer"]);
    // Nothing stays frozen: a new sandbox takes the volume, mounts it
    // (journal replay in its guest) and finds the fsynced lines.
    let bundle2 = env.bundle(
        "r",
        &["sh", "-c", "sleep 100000"],
        vec![bind("/data", &target, false)],
    );
    let sb2 = env.sandbox("after");
    env.ok(&["create", "--bundle", bundle2.to_str().unwrap(), "after"]);
    env.ok(&["start", "after"]);
    // The log is the fsynced record, line by line. The count file is
    // rewritten in place (truncate, then write): a guest killed between
    // the two (or frozen there) leaves it empty, which is no loss.
    let log = sb2.sh("cat /data/log");
    let complete = (1..)
        .take_while(|i| log.contains(&format!("line {i}\n")))
        .count() as u64;
    assert!(complete >= frozen_at, "line {} lost: {log}", complete + 1);
    if let Ok(n) = sb2.sh("cat /data/count").trim().parse::<u64>() {
        assert!(
            (frozen_at..=complete).contains(&n),
            "count {n}, {complete} lines, {frozen_at} when frozen"
        );
    }
    env.ok(&["crust", "freeze", &target, "60000"]);
    let out = env.json(&["crust", "thaw", &target]);
    assert_eq!(out["was_frozen"], true, "{out}");
    env.ok(&["delete", "-f", "after"]);
    drop(disk);
    assert_clean(&env);
}
