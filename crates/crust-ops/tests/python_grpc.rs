//! The crust-ops daemon called by Python's `grpcio` (grpc-core) on its
//! unix socket with the channel's default `:authority` (the %-encoded
//! socket path, which h2 alone would reset): stage writes the record,
//! stats and unstage answer with the KEP's codes.
//!
//! Time budget: about 2 s.

mod support;

use crust_testkit::grpc_python_calls;
use serde_json::json;
use support::Daemon;

#[test]
fn grpcio_client_with_its_default_authority_stages_and_unstages() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let devs = t.join("devs");
    std::fs::create_dir(&devs).unwrap();
    let img = devs.join("disk.img");
    std::fs::write(&img, vec![0u8; 4096]).unwrap();
    let crust_root = t.join("crust");
    let daemon = Daemon::start(
        &t.join("ops.sock"),
        &[
            "--crust-root",
            crust_root.to_str().unwrap(),
            "--allowed-target-prefix",
            "/var/lib/kubelet/pods",
            "--allow-file-devices-under",
            devs.to_str().unwrap(),
        ],
        &[],
    );
    let target = "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/pv-py/mount";
    let record = crust_root
        .join(crust_handoff::crust_key(target))
        .join("mountInfo.json");
    let stage = json!({
        "volume_type": {"type": "BLOCK"},
        "volume_target_path": target,
        "volume_backing_path": img.to_str().unwrap(),
        "fs_type": "ext4",
        "mount_flags": ["noatime"],
        "volume_supplemental_group": "2000",
        "volume_supplemental_group_change_policy": {"policy": "ON_ROOT_MISMATCH"},
    });
    let sock = format!("unix://{}", daemon.socket.display());
    let a = grpc_python_calls(
        &sock,
        &[
            (
                "crust.runtime.v1alpha1.Runtime/RuntimeStageVolume",
                stage.clone(),
            ),
            ("crust.runtime.v1alpha1.Runtime/RuntimeStageVolume", stage),
            (
                "crust.runtime.v1alpha1.Runtime/RuntimeGetVolumeStats",
                json!({"volume_target_path": target}),
            ),
            (
                "crust.runtime.v1alpha1.Runtime/RuntimeGetVolumeStats",
                json!({"volume_target_path": "/var/lib/kubelet/pods/u1/volumes/x/pv-none/mount"}),
            ),
            (
                "crust.runtime.v1alpha1.Runtime/RuntimeStageVolume",
                json!({"volume_type": {"type": "BLOCK"}, "volume_target_path": "pods/relative"}),
            ),
        ],
    );
    for x in &a {
        eprintln!("{} {} {}", x.code, x.details, x.response);
    }
    assert_eq!(a[0].code, "OK", "{}", a[0].details);
    assert_eq!(a[1].code, "OK", "idempotent: {}", a[1].details);
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record).expect("record written")).unwrap();
    assert_eq!(written["device"], img.to_str().unwrap());
    assert_eq!(written["metadata"]["fsGroup"], "2000");
    // Staged but no runtime consumed it yet.
    assert_eq!(a[2].code, "FAILED_PRECONDITION", "{}", a[2].details);
    assert_eq!(a[3].code, "NOT_FOUND", "{}", a[3].details);
    assert_eq!(a[4].code, "INVALID_ARGUMENT", "{}", a[4].details);

    let b = grpc_python_calls(
        &format!("unix:{}", daemon.socket.display()),
        &[(
            "crust.runtime.v1alpha1.Runtime/RuntimeUnstageVolume",
            json!({"volume_target_path": target}),
        )],
    );
    assert_eq!(b[0].code, "OK", "{}", b[0].details);
    assert!(!record.exists(), "unstage removed the record");
    assert!(daemon.stop().success());
}
