//! Issue 27 at the containerd door: a container spec carrying an AppArmor
//! profile runs (the guest kernel cannot enforce it; the shim logs it
//! once, naming it, and says so in one containerd event) and is refused
//! with `CRUST_SHIM_LSM_POLICY=refuse`.
//! AppArmor is off on these machines: `ctr run --apparmor-profile` only
//! writes the field. The same run drops every containerd default
//! capability but NET_BIND_SERVICE: exactly that one in the guest. A
//! cgroup path in the systemd driver's form
//! (kubeadm's default) puts QEMU and virtiofsd in the scope systemd would
//! make, parent slices created, with no systemd running. Budget: two TCG
//! guests, ~10 s.

mod common;

use common::{Env, in_cgroup, qemus_under, remove_cgroup_tree};
use crust_testkit::BUSYBOX_IMAGE;

const RUNTIME: &str = "io.containerd.crust.v2";
const PROFILE: &str = "crust-test-profile";
/// containerd's default capability set (`oci.populateDefaultUnixSpec`).
const CONTAINERD_DEFAULT_CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

#[test]
fn an_apparmor_profile_runs_and_is_logged_unless_refused() {
    let env = Env::start("default");
    let events = env.ctrd.events("default");
    let mut args = vec!["run", "--rm", "--runtime", RUNTIME];
    args.extend(["--apparmor-profile", PROFILE]);
    // ctr has no `ALL`: every default capability but NET_BIND_SERVICE.
    for c in CONTAINERD_DEFAULT_CAPS {
        if *c != "CAP_NET_BIND_SERVICE" {
            args.extend(["--cap-drop", c]);
        }
    }
    args.extend([
        BUSYBOX_IMAGE,
        "aa",
        "sh",
        "-c",
        "echo ran; grep -E '^Cap(Eff|Bnd)' /proc/self/status",
    ]);
    let o = env.ctrd.ctr_in("default", &args);
    // The capabilities reach the guest through the shim.
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "ran\nCapEff:\t0000000000000400\nCapBnd:\t0000000000000400\n",
        "stderr: {}\n{}",
        String::from_utf8_lossy(&o.stderr),
        env.logs()
    );
    assert!(o.status.success());
    let log = env.shim_log_all();
    let said = format!("AppArmor profile \"{PROFILE}\"");
    assert_eq!(
        log.lines()
            .filter(|l| l.contains(&said) && l.contains("not enforced"))
            .count(),
        1,
        "one log line naming the profile:\n{log}"
    );
    // And one containerd event, naming the container and the profile.
    let out = events.lines();
    let seen: Vec<&String> = out
        .iter()
        .filter(|l| l.contains(crust_shim::task::LSM_TOPIC))
        .collect();
    assert_eq!(seen.len(), 1, "one event: {out:?}\n{}", env.logs());
    assert!(
        seen[0].contains("aa") && seen[0].contains(PROFILE),
        "{}",
        seen[0]
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

/// Removes, on drop, the test's cgroups (deepest first) in every hierarchy.
struct Cgroups(Vec<String>);

impl Drop for Cgroups {
    fn drop(&mut self) {
        for d in self.0.iter().rev() {
            remove_cgroup_tree(d);
        }
    }
}

#[test]
fn a_systemd_cgroup_path_puts_the_vm_in_its_scope() {
    let env = Env::start("default");
    let top = format!("crusttest{}", std::process::id());
    let slice = format!("{top}-besteffort-pod1.slice");
    let scope_dir = format!("{top}.slice/{top}-besteffort.slice/{slice}/cri-containerd-sd.scope");
    let _cg = Cgroups(vec![
        format!("{top}.slice"),
        format!("{top}.slice/{top}-besteffort.slice"),
        format!("{top}.slice/{top}-besteffort.slice/{slice}"),
        scope_dir.clone(),
    ]);
    let systemd_running =
        std::fs::read_to_string("/proc/1/comm").is_ok_and(|c| c.trim() == "systemd");
    ctrd_ok_run(&env, &format!("{slice}:cri-containerd:sd"));
    let qemu = qemus_under(&env.runtime_root);
    assert_eq!(qemu.len(), 1, "{}", env.logs());
    assert!(
        in_cgroup(qemu[0], &scope_dir),
        "QEMU {} in {scope_dir} (systemd running: {systemd_running})\n{}",
        qemu[0],
        env.logs()
    );
    // virtiofsd too: QEMU is not alone in the scope.
    let procs = std::fs::read_to_string(format!("/sys/fs/cgroup/memory/{scope_dir}/cgroup.procs"))
        .or_else(|_| std::fs::read_to_string(format!("/sys/fs/cgroup/{scope_dir}/cgroup.procs")))
        .unwrap();
    assert!(procs.lines().count() >= 2, "QEMU and virtiofsd: {procs}");
    env.ctrd
        .ctr_ok("default", &["task", "kill", "-s", "SIGKILL", "sd"]);
    for _ in 0..100 {
        let ls = env.ctrd.ctr_ok("default", &["task", "ls"]);
        if ls
            .lines()
            .any(|l| l.starts_with("sd") && l.contains("STOPPED"))
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    env.ctrd.ctr_ok("default", &["task", "delete", "sd"]);
    env.ctrd.ctr_ok("default", &["containers", "rm", "sd"]);
    assert!(qemus_under(&env.runtime_root).is_empty());
    assert!(
        !std::path::Path::new("/sys/fs/cgroup/memory")
            .join(&scope_dir)
            .exists(),
        "the scope goes with the pod"
    );
}

/// A detached `ctr run` of a sleeping busybox in `cgroup`.
fn ctrd_ok_run(env: &Env, cgroup: &str) {
    let o = env.ctrd.ctr_in(
        "default",
        &[
            "run",
            "-d",
            "--runtime",
            RUNTIME,
            "--cgroup",
            cgroup,
            BUSYBOX_IMAGE,
            "sd",
            "sleep",
            "600",
        ],
    );
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        env.logs()
    );
}
