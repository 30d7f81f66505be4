//! `--accel auto` on a host whose KVM hangs (simulated by
//! `crust_testkit::HangingKvmQemu`, so the result is the same on every
//! host): the sandbox still comes up, under TCG, and `crust-runtime state`
//! says which accelerator runs the guest and why.
//!
//! Time budget: about 20 s (a 10 s probe, one TCG boot).

mod common;

use common::*;
use crust_testkit::{HangingKvmQemu, VmSlot};

#[test]
fn auto_accel_on_a_hanging_kvm_boots_under_tcg_and_state_says_why() {
    let mut env = Env::new();
    let qemu = HangingKvmQemu::new(env.dir.path(), None);
    let cache = env.dir.path().join("accel-cache");
    env.accel = "auto".into();
    env.extra_args = vec![
        "--qemu".into(),
        qemu.path.display().to_string(),
        "--accel-cache".into(),
        cache.display().to_string(),
    ];
    {
        let _slot = VmSlot::acquire();
        let b = env.bundle("accel", &["sleep", "600"], vec![]);
        env.ok(&["create", "--bundle", b.to_str().unwrap(), "accel"]);
        let sb = env.sandbox("accel");
        assert_eq!(sb.sh("echo up").trim(), "up", "the guest runs");

        let st = sb.state();
        let accel = &st["accel"];
        assert_eq!(accel["accel"], "tcg", "{st}");
        let reason = accel["reason"].as_str().unwrap();
        assert!(
            reason.contains("KVM probe boot did not reach the guest agent within 10s"),
            "{reason}"
        );
        // The verdict is the host boot's: the shim recorded it root-only.
        let verdicts = std::fs::read_to_string(cache.join("accel.json")).unwrap();
        assert!(verdicts.contains("\"accel\": \"tcg\""), "{verdicts}");
        let starts = qemu.starts();
        assert_eq!(
            starts.iter().map(|s| s.accel.as_str()).collect::<Vec<_>>(),
            ["kvm", "tcg"],
            "{starts:?}"
        );
        assert!(!pid_alive(starts[0].pid), "the probe's QEMU is gone");
        env.ok(&["delete", "--force", "accel"]);
    }
    assert_clean(&env);
}
