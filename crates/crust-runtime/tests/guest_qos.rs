//! One real guest, live per-volume QoS (issue 28, must-show 4) along the
//! path ControllerModifyVolume takes: crust_ops `set_io_limits` (what the
//! CSI plugin runs in process) rewrites the hand-off record and runs the
//! runtime CLI's `crust throttle`, which has the sandbox apply QMP
//! `block_set_io_throttle` to the volume's device. The guest reads with
//! O_DIRECT, 16 readers at once (QD16; the test image has no fio, so
//! busybox `dd iflag=direct`, 4 KiB each): unthrottled, then
//! 200 IOPS (≤ 220 measured, no restart), then lifted (the rate comes
//! back), and a new sandbox (a re-plug, as after a runtime restart) takes
//! the recorded 200 IOPS from the hand-off record at its plug. A burst
//! (100 IOPS, 600 for 2 s) lets a run from idle above the limit, capped at
//! the burst rate.
//!
//! Time budget: about 35 s (two guest boots, five short read runs).

mod common;

use common::*;
use crust_blockdev::FsType;
use crust_handoff::{IoLimits, Layout, MountInfo};
use crust_ops::LimitsApplied;
use crust_testkit::VmSlot;

const READERS: u32 = 16;
/// The file the readers read: 16 MiB, 4096 blocks.
const BLOCKS: u32 = 4096;

/// `per` O_DIRECT 4 KiB reads by each of 16 readers at once (each in a
/// region of its own, one `dd` each: a process per read would measure
/// the emulated guest's fork, not the device); the guest's IOPS.
fn direct_read_iops(sb: &Sandbox<'_>, per: u32) -> f64 {
    assert!(per <= BLOCKS / READERS);
    let script = format!(
        "start=$(cut -d' ' -f1 /proc/uptime); \
         for r in $(seq 0 {last}); do \
           dd if=/data/f of=/dev/null bs=4096 count={per} skip=$((r * {region})) iflag=direct \
             2>/dev/null & \
         done; wait; \
         end=$(cut -d' ' -f1 /proc/uptime); echo $start $end",
        last = READERS - 1,
        region = BLOCKS / READERS,
    );
    let out = sb.sh(&script);
    let t: Vec<f64> = out.split_whitespace().map(|v| v.parse().unwrap()).collect();
    let secs = (t[1] - t[0]).max(0.01);
    f64::from(READERS * per) / secs
}

fn limits(iops: u64) -> IoLimits {
    IoLimits {
        iops,
        ..Default::default()
    }
}

#[test]
fn modify_volume_throttles_a_running_guest_and_every_later_plug() {
    let env = Env::new();
    let disk = env.disk("q.img", 64 * MIB, FsType::Ext4);
    let target = env.target("pod-q", "pv-q");
    env.stage(
        Layout::Crust,
        &target,
        &MountInfo::block(disk.dev_str(), "ext4"),
    );
    let bundle = env.bundle(
        "q",
        &["sh", "-c", "sleep 100000"],
        vec![bind("/data", &target, false)],
    );
    let ops = env.ops();
    // Before a runtime consumed the record: only the record changes.
    assert_eq!(
        ops.set_io_limits(&target, &IoLimits::default()).unwrap(),
        LimitsApplied::AtNextPlug
    );

    let _slot = VmSlot::acquire();
    let sb = env.sandbox("qos");
    env.ok(&["create", "--bundle", bundle.to_str().unwrap(), "qos"]);
    env.ok(&["start", "qos"]);
    let caps = env.json(&["crust", "capabilities"]);
    assert!(
        caps["verbs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v == "throttle"),
        "{caps}"
    );
    sb.sh("dd if=/dev/zero of=/data/f bs=1M count=16 conv=fsync 2>/dev/null");

    // --- unthrottled --------------------------------------------------
    let free = direct_read_iops(&sb, 48);
    eprintln!("unthrottled: {free:.0} IOPS");
    assert!(
        free > 300.0,
        "unthrottled reads ({free:.0} IOPS) must be well above the 200 IOPS limit to tell"
    );

    // --- 200 IOPS, live -------------------------------------------------
    let qemu = sb.qemu_pid();
    assert_eq!(
        ops.set_io_limits(&target, &limits(200)).unwrap(),
        LimitsApplied::Live
    );
    let limited = direct_read_iops(&sb, 48);
    eprintln!("iops=200: {limited:.0} IOPS");
    assert!(limited <= 220.0, "{limited:.0} IOPS under a 200 IOPS limit");
    assert!(
        limited >= 100.0,
        "{limited:.0} IOPS: the limit, not a stall"
    );
    assert_eq!(sb.qemu_pid(), qemu, "no restart");

    // Bad limits through the CLI: refused, the limit in force stays.
    let err = env.fails(&["crust", "throttle", &target, "iops=fast"]);
    assert!(err.contains("iops"), "{err}");

    // --- lifted: the rate comes back -------------------------------------
    assert_eq!(
        ops.set_io_limits(&target, &IoLimits::default()).unwrap(),
        LimitsApplied::Live
    );
    let back = direct_read_iops(&sb, 48);
    eprintln!("lifted: {back:.0} IOPS");
    assert!(back > 300.0, "{back:.0} IOPS after the limit was lifted");

    // --- a burst: after a quiet spell the volume runs above its limit, up
    // to the burst rate, until the burst's bucket fills ------------------
    let bursty = IoLimits {
        iops: 100,
        iops_burst: 600,
        burst_seconds: 2,
        ..Default::default()
    };
    assert_eq!(
        ops.set_io_limits(&target, &bursty).unwrap(),
        LimitsApplied::Live
    );
    let burst = direct_read_iops(&sb, 24);
    eprintln!("iops=100, iopsBurst=600 for 2 s, from idle: {burst:.0} IOPS");
    // QEMU lets a burst start with a tenth of its rate at once (its
    // sub-second bucket), so over T seconds at most 60 + 600 T operations
    // pass; /proc/uptime's two readings are each 10 ms coarse.
    let reads = f64::from(READERS * 24);
    let secs = reads / burst;
    let ceiling = 600.0 / 10.0 + 600.0 * (secs + 0.02);
    assert!(
        burst > 200.0 && reads <= ceiling,
        "{burst:.0} IOPS ({reads} reads in {secs:.2} s): above the 100 IOPS limit, \
         at most the 600 IOPS burst with its first tenth at once"
    );

    // --- a re-plug in a new sandbox reads the limit from the record -----
    ops.set_io_limits(&target, &limits(200)).unwrap();
    env.ok(&["delete", "-f", "qos"]);
    let sb2 = env.sandbox("qos2");
    env.ok(&["create", "--bundle", bundle.to_str().unwrap(), "qos2"]);
    env.ok(&["start", "qos2"]);
    let replugged = direct_read_iops(&sb2, 32);
    eprintln!("re-plugged with iops=200 recorded: {replugged:.0} IOPS");
    assert!(
        replugged <= 220.0,
        "{replugged:.0} IOPS after a re-plug with 200 IOPS recorded"
    );
    env.ok(&["delete", "-f", "qos2"]);
    drop(disk);
    assert_clean(&env);
}
