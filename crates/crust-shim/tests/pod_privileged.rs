//! Issue 43, must-show 2: a privileged pod through CRI, as kubelet asks
//! for one (the sandbox and the container privileged). containerd is
//! configured as crust's node installer configures it
//! (`privileged_without_host_devices = true`), so the spec carries no host
//! device; the container starts in the guest with every capability
//! containerd grants (its own), no seccomp filter, and none of the host's
//! device nodes. Budget: one TCG guest, ~10 s.

mod common;

use common::{Env, exec};
use crust_cri::Cri;
use crust_cri::v1 as cri;

/// Host device nodes this machine has that a guest must never show.
fn host_only_devices() -> Vec<String> {
    [
        "autofs",
        "loop-control",
        "kvm",
        "fuse",
        "net/tun",
        "mapper/control",
    ]
    .into_iter()
    .filter(|d| std::path::Path::new("/dev").join(d).exists())
    .map(String::from)
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privileged_container_runs_with_every_capability_and_no_host_device() {
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let mut sandbox =
        common::host_network_sandbox("privileged", "43a00000-0000-4000-8000-000000000001", 0);
    sandbox
        .linux
        .as_mut()
        .unwrap()
        .security_context
        .as_mut()
        .unwrap()
        .privileged = true;
    let linux = cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            privileged: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let (sb, app) = env
        .start_busybox_pod_with(&mut cri, &sandbox, &["sleep", "600"], vec![], Some(linux))
        .await;
    let (rc, out) = exec(
        &mut cri,
        &app,
        "grep -E '^(CapEff|CapBnd|Seccomp):' /proc/self/status; \
         cat /proc/sys/kernel/cap_last_cap; ls -R /dev | tr '\\n' ' '",
    )
    .await;
    assert_eq!(rc, 0, "{out}\n{}", env.logs());
    let field = |k: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| panic!("{k} not in {out}"))
    };
    // Every capability containerd grants a privileged container: those of
    // its own process (this test's, root, here), within what the guest
    // kernel knows. runc gives the same set.
    let last: u32 = out
        .lines()
        .nth(3)
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("cap_last_cap in {out}"));
    let host = std::fs::read_to_string("/proc/self/status").unwrap();
    let host_eff = host
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    let want = format!("{:016x}", host_eff & ((1u64 << (last + 1)) - 1));
    assert_eq!(field("CapEff:"), want, "{out}");
    assert_eq!(field("CapBnd:"), want, "{out}");
    assert_eq!(field("Seccomp:"), "0", "no seccomp filter: {out}");
    let devs = out.lines().last().unwrap_or_default();
    eprintln!("the privileged container's /dev: {devs}");
    let host = host_only_devices();
    assert!(
        !host.is_empty(),
        "this host has none of the devices looked for"
    );
    for d in host {
        let leaf = d.rsplit('/').next().unwrap();
        assert!(
            !devs.split_whitespace().any(|x| x == leaf),
            "host device /dev/{d} in the guest container: {devs}"
        );
    }
    common::stop_and_remove_sandbox(&mut cri, &sb).await;
}
