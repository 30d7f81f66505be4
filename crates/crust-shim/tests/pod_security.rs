//! Issue 27 at the containerd door: a container spec carrying an AppArmor
//! profile runs (the guest kernel cannot enforce it; the shim logs it
//! once, naming it) and is refused with `CRUST_SHIM_LSM_POLICY=refuse`.
//! AppArmor is off on these machines: `ctr run --apparmor-profile` only
//! writes the field. Budget: one TCG guest, ~10 s.

mod common;

use common::{Env, qemus_under};
use crust_testkit::BUSYBOX_IMAGE;

const RUNTIME: &str = "io.containerd.crust.v2";
const PROFILE: &str = "crust-test-profile";

#[test]
fn an_apparmor_profile_runs_and_is_logged_unless_refused() {
    let env = Env::start("default");
    let o = env.ctrd.ctr_in(
        "default",
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            "--apparmor-profile",
            PROFILE,
            BUSYBOX_IMAGE,
            "aa",
            "sh",
            "-c",
            "echo ran",
        ],
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "ran\n",
        "stderr: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        env.logs()
    );
    assert!(o.status.success());
    let log = env.shim_log();
    let said = format!("AppArmor profile \"{PROFILE}\"");
    assert_eq!(
        log.lines()
            .filter(|l| l.contains(&said) && l.contains("not enforced"))
            .count(),
        1,
        "one log line naming the profile:\n{log}"
    );
    drop(env);

    // With the option on, the same run is refused by name before a VM starts.
    let env = Env::start_with(
        "default",
        vec![("CRUST_SHIM_LSM_POLICY".into(), "refuse".into())],
    );
    let o = env.ctrd.ctr_in(
        "default",
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            "--apparmor-profile",
            PROFILE,
            BUSYBOX_IMAGE,
            "aa2",
            "true",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains(&format!("AppArmor profile \\\"{PROFILE}\\\""))
            || err.contains(&format!("AppArmor profile \"{PROFILE}\"")),
        "ctr's error names the profile:\n{err}\n{}",
        env.logs()
    );
    assert!(qemus_under(&env.runtime_root).is_empty());
}
