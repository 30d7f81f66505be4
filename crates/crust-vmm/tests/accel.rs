//! The accelerator choice on a host whose KVM is half-working, simulated
//! by [`HangingKvmQemu`]: under `-accel kvm` it starts the real QEMU
//! paused (`-S`, software emulation), so QMP answers but the guest never
//! runs, exactly what such a host shows. These tests give the same result
//! on hosts where KVM works, is absent or hangs.
//!
//! Time budget: about 30 s (three TCG boots, two short KVM deadlines).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crust_testkit::HangingKvmQemu;
use crust_vmm::accel::{CACHE_FILE, Verdict};
use crust_vmm::{Accel, ResolvedAccel, Vm, VmConfig};

fn verdicts(cache: &Path) -> Vec<Verdict> {
    let raw = std::fs::read(cache.join(CACHE_FILE)).expect("verdict file written");
    let map: std::collections::BTreeMap<String, Verdict> = serde_json::from_slice(&raw).unwrap();
    map.into_values().collect()
}

fn config(dir: &Path, wrapper: PathBuf) -> VmConfig {
    let (kernel, initrd) = crust_testkit::guest_image();
    let mut cfg = VmConfig::new("accel-test", kernel, initrd, dir.join("run"));
    cfg.accel = Accel::Auto;
    cfg.qemu_binary = wrapper;
    cfg.accel_cache = Some(dir.join("cache"));
    cfg.hotplug_ports = 0;
    cfg.die_with_parent = true;
    cfg
}

fn gone(pid: i32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
}

/// A probe boot that never reaches the agent under KVM: the guest comes
/// up under TCG, the reason says why, the verdict is cached (the next
/// choice does not start QEMU at all) and the probe's QEMU is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_working_kvm_fails_the_probe_and_the_guest_boots_under_tcg() {
    crust_testkit::require_root();
    crust_testkit::ensure_guest_image();
    let _slot = crust_testkit::VmSlot::acquire();
    let dir = tempfile::tempdir().unwrap();
    let qemu = HangingKvmQemu::new(dir.path(), None);
    let mut cfg = config(dir.path(), qemu.path.clone());
    cfg.kvm_probe_timeout = Duration::from_secs(3);

    let mut vm = Vm::boot(cfg.clone(), Duration::from_secs(120))
        .await
        .unwrap_or_else(|e| panic!("the guest must come up under TCG: {e}"));
    let choice = vm.accel_choice();
    assert_eq!(vm.accel(), ResolvedAccel::Tcg);
    assert!(!choice.fallback, "the probe decided, no boot fell back");
    assert!(
        choice
            .reason
            .contains("KVM probe boot did not reach the guest agent within 3s"),
        "{}",
        choice.reason
    );
    let calls = qemu.starts();
    let accels: Vec<&str> = calls.iter().map(|c| c.accel.as_str()).collect();
    assert_eq!(accels, ["kvm", "tcg"], "{calls:?}");
    assert_eq!(calls[0].name, "crust-accel-probe");
    assert!(gone(calls[0].pid), "the probe's QEMU was killed and reaped");

    let v = verdicts(&dir.path().join("cache"));
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].accel, ResolvedAccel::Tcg);
    assert_eq!(v[0].reason, choice.reason);
    assert!(v[0].probe_ms >= 3000, "{v:?}");
    let mode = std::fs::metadata(dir.path().join("cache").join(CACHE_FILE))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    // The state file of the running VM carries the reason too.
    let attached = Vm::attach(vm.paths().run_dir.clone()).unwrap();
    assert_eq!(attached.accel_choice(), choice);

    // Within this host boot the verdict is reused: no second probe.
    let again = crust_vmm::accel::choose(&cfg).await.unwrap();
    assert_eq!(again.accel, ResolvedAccel::Tcg);
    assert!(
        again.reason.contains("cached for this host boot"),
        "{}",
        again.reason
    );
    assert_eq!(qemu.starts().len(), 2);
    vm.kill().unwrap();
}

/// A KVM that passed its probe but whose real boot hangs: the boot is
/// retried once under TCG, reported as a fallback, and later choices on
/// this host boot go straight to TCG.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvm_boot_that_hangs_is_retried_once_under_tcg() {
    crust_testkit::require_root();
    crust_testkit::ensure_guest_image();
    let _slot = crust_testkit::VmSlot::acquire();
    let dir = tempfile::tempdir().unwrap();
    let qemu = HangingKvmQemu::new(dir.path(), Some("crust-accel-probe"));
    let mut cfg = config(dir.path(), qemu.path.clone());
    // The "KVM" probe really runs under TCG here: give it TCG's time.
    cfg.kvm_probe_timeout = Duration::from_secs(120);
    cfg.kvm_boot_timeout = Duration::from_secs(3);

    let mut vm = Vm::boot(cfg.clone(), Duration::from_secs(120))
        .await
        .unwrap_or_else(|e| panic!("the guest must come up after the fallback: {e}"));
    let choice = vm.accel_choice();
    assert_eq!(vm.accel(), ResolvedAccel::Tcg);
    assert!(choice.fallback);
    assert!(
        choice
            .reason
            .contains("a KVM boot did not reach the guest agent within 3s")
            && choice.reason.ends_with("booted again under TCG"),
        "{}",
        choice.reason
    );
    let calls = qemu.starts();
    let seen: Vec<(&str, &str)> = calls
        .iter()
        .map(|c| (c.accel.as_str(), c.name.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            ("kvm", "crust-accel-probe"),
            ("kvm", "crust-accel-test"),
            ("tcg", "crust-accel-test")
        ],
        "{calls:?}"
    );
    assert!(
        gone(calls[1].pid),
        "the hung KVM QEMU was killed and reaped"
    );

    let v = verdicts(&dir.path().join("cache"));
    assert_eq!(v.len(), 1);
    assert_eq!(
        (v[0].accel, v[0].reason.as_str()),
        (ResolvedAccel::Tcg, choice.reason.as_str())
    );
    let next = crust_vmm::accel::choose(&cfg).await.unwrap();
    assert_eq!(next.accel, ResolvedAccel::Tcg);
    assert_eq!(qemu.starts().len(), 3, "no new probe");
    vm.kill().unwrap();
}
