//! Issue 42, item 1, through containerd's CRI: a raw block device a
//! container gets in `linux.devices` (kubelet's `volumeDevices`) goes
//! through the plug routine volumes go through.
//!
//! - A device mounted on the host is refused (FAILED_PRECONDITION, the
//!   device named), and so is one another loop device reads (a second
//!   tool's `losetup` on it), before anything is handed to QEMU.
//! - A free device with kubelet's keep-busy loop, built as kubelet builds
//!   it (the device node bind-mounted at `<globalMapPath>/<podUID>` under
//!   `<kubelet root>/plugins/kubernetes.io/csi/volumeDevices/`, a loop
//!   bound to that path), is plugged; while the guest has it, neither
//!   the device nor kubelet's loop can be opened `O_EXCL` or mounted on
//!   the host; the guest's bytes reach the device.
//! - A device given read-only (`permissions: r`) is read-only in QEMU:
//!   the guest's write fails and the device is unchanged.
//! - After the pod is removed the device is free again.
//!
//! Budget: one TCG guest, ~20 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{Env, exec};
use crust_cri::Cri;
use crust_cri::v1 as cri;
use rustix::fs::{Mode, OFlags};

const POD_UID: &str = "9f8a1c2e-0000-4000-8000-0000000dec01";

fn run(cmd: &str) -> String {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Shell commands that undo what the test set up, run last first on drop
/// (loops stacked on a device before the device, binds before their
/// files).
#[derive(Default)]
struct Undo(Vec<String>);

impl Drop for Undo {
    fn drop(&mut self) {
        for c in self.0.iter().rev() {
            let _ = Command::new("sh").arg("-c").arg(c).status();
        }
    }
}

/// A 32 MiB file on a loop device of its own: (device, backing file).
fn loop_device(dir: &Path, name: &str, undo: &mut Undo) -> (PathBuf, PathBuf) {
    let file = dir.join(name);
    run(&format!("truncate -s 32M {}", file.display()));
    let dev = run(&format!("losetup -f --show {}", file.display()));
    undo.0.push(format!("losetup -d {dev}"));
    (PathBuf::from(dev), file)
}

/// A device with ext4 mounted on the host at `<dir>/host-mnt`, holding
/// `marker` ("host-marker"): (device, mount point).
fn host_mounted_device(dir: &Path, undo: &mut Undo) -> (PathBuf, PathBuf) {
    let (dev, _) = loop_device(dir, "mounted.img", undo);
    run(&format!("mkfs.ext4 -q {}", dev.display()));
    let at = dir.join("host-mnt");
    std::fs::create_dir_all(&at).unwrap();
    run(&format!(
        "mount {} {} && echo host-marker > {}/marker",
        dev.display(),
        at.display(),
        at.display()
    ));
    undo.0.push(format!("umount {}", at.display()));
    (dev, at)
}

/// kubelet's keep-busy loop for `dev` and this pod (`MapBlockVolume`):
/// the device node bind-mounted at `<globalMapPath>/<podUID>` and a loop
/// bound to that path.
fn kubelet_loop(kubelet_root: &Path, dev: &Path, undo: &mut Undo) -> PathBuf {
    let gmp = kubelet_root.join("plugins/kubernetes.io/csi/volumeDevices/pv-raw/dev");
    std::fs::create_dir_all(&gmp).unwrap();
    let map = gmp.join(POD_UID);
    std::fs::write(&map, b"").unwrap();
    run(&format!("mount --bind {} {}", dev.display(), map.display()));
    undo.0.push(format!("umount {}", map.display()));
    // kubelet asks for direct I/O and falls back without it.
    let lo = Command::new("losetup")
        .args(["-f", "--direct-io=on", "--show"])
        .arg(&map)
        .output()
        .unwrap();
    let lo = if lo.status.success() {
        String::from_utf8_lossy(&lo.stdout).trim().to_string()
    } else {
        run(&format!("losetup -f --show {}", map.display()))
    };
    undo.0.push(format!("losetup -d {lo}"));
    PathBuf::from(lo)
}

/// Whether the host can open `dev` exclusively now.
fn host_excl_open(dev: &Path) -> bool {
    rustix::fs::open(
        dev,
        OFlags::RDONLY | OFlags::EXCL | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .is_ok()
}

/// Whether the host can mount `dev` (ext4) now; unmounts it again.
fn host_mounts(dev: &Path, at: &Path) -> bool {
    std::fs::create_dir_all(at).unwrap();
    let ok = Command::new("mount")
        .arg(dev)
        .arg(at)
        .status()
        .unwrap()
        .success();
    if ok {
        run(&format!("umount {}", at.display()));
    }
    ok
}

async fn create(
    cri: &mut Cri,
    sb: &str,
    sandbox: &cri::PodSandboxConfig,
    name: &str,
    devices: Vec<cri::Device>,
) -> Result<String, tonic::Status> {
    let cid = cri
        .runtime
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: sb.into(),
            config: Some(cri::ContainerConfig {
                metadata: Some(cri::ContainerMetadata {
                    name: name.into(),
                    attempt: 0,
                }),
                image: Some(cri::ImageSpec {
                    image: crust_testkit::BUSYBOX_IMAGE.into(),
                    ..Default::default()
                }),
                command: vec!["sleep".into(), "100000".into()],
                devices,
                ..Default::default()
            }),
            sandbox_config: Some(sandbox.clone()),
        })
        .await?
        .into_inner()
        .container_id;
    // containerd's CRI creates the task (and so the shim's container) at
    // StartContainer.
    cri.runtime
        .start_container(cri::StartContainerRequest {
            container_id: cid.clone(),
        })
        .await?;
    Ok(cid)
}

fn device(host: &Path, inside: &str, permissions: &str) -> cri::Device {
    cri::Device {
        container_path: inside.into(),
        host_path: host.display().to_string(),
        permissions: permissions.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_devices_are_held_like_volumes() {
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let kubelet_root = env.pods_dir.parent().unwrap().to_path_buf();
    let work = env.dir.path().join("devices");
    std::fs::create_dir_all(&work).unwrap();
    let mut undo = Undo::default();

    // The device the pod gets, and kubelet's loop on it.
    let (free, free_file) = loop_device(&work, "free.img", &mut undo);
    run(&format!("mkfs.ext4 -q {}", free.display()));
    let keep_busy = kubelet_loop(&kubelet_root, &free, &mut undo);
    // A device mounted on the host, with a marker.
    let (mounted, host_mnt) = host_mounted_device(&work, &mut undo);
    // A device another tool stacked a loop on.
    let (aliased, _) = loop_device(&work, "aliased.img", &mut undo);
    let foreign = run(&format!("losetup -f --show {}", aliased.display()));
    undo.0.push(format!("losetup -d {foreign}"));
    // Read-only for the pod.
    let (ro, ro_file) = loop_device(&work, "ro.img", &mut undo);
    run(&format!(
        "printf ro-original | dd of={} conv=notrunc 2>/dev/null",
        ro_file.display()
    ));

    let mut c = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let sandbox = common::host_network_sandbox("devices", POD_UID, 0);
    let sb = c
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(sandbox.clone()),
            runtime_handler: crust_testkit::CRUST_HANDLER.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", env.logs()))
        .into_inner()
        .pod_sandbox_id;

    // Refused, naming the device and why; nothing changed on the host.
    for (name, dev, why) in [
        ("mounted", &mounted, "in use"),
        ("aliased", &aliased, foreign.as_str()),
    ] {
        let e = create(
            &mut c,
            &sb,
            &sandbox,
            name,
            vec![device(dev, "/dev/xvda", "mrw")],
        )
        .await
        .expect_err("a device the host holds or another device reads");
        let msg = e.message();
        assert!(
            msg.contains(&dev.display().to_string()) && msg.contains(why),
            "{name}: {msg}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(host_mnt.join("marker")).unwrap(),
        "host-marker\n"
    );

    // Plugged, kubelet's loop held with it; the guest writes the device.
    let cid = create(
        &mut c,
        &sb,
        &sandbox,
        "app",
        vec![
            device(&free, "/dev/xvda", "mrw"),
            device(&ro, "/dev/xvdb", "r"),
        ],
    )
    .await
    .unwrap_or_else(|e| panic!("CreateContainer with a free device: {e}\n{}", env.logs()));
    let (code, out) = exec(
        &mut c,
        &cid,
        "printf guest-wrote-this | dd of=/dev/xvda bs=512 seek=2048 conv=notrunc,fsync 2>&1 && \
         dd if=/dev/xvda bs=512 skip=2048 count=1 2>/dev/null | head -c 15",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert!(out.ends_with("guest-wrote-thi"), "{out}");
    for dev in [&free, &keep_busy] {
        assert!(
            !host_excl_open(dev),
            "{} opened O_EXCL on the host while the guest has it",
            dev.display()
        );
        assert!(
            !host_mounts(dev, &work.join("try-mnt")),
            "{} mounted on the host while the guest has it",
            dev.display()
        );
    }
    let (code, out) = exec(
        &mut c,
        &cid,
        "printf guest | dd of=/dev/xvdb conv=notrunc,fsync 2>&1; echo rc=$?",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert!(
        !out.contains("rc=0"),
        "a read-only device took a write: {out}"
    );

    common::stop_and_remove_sandbox(&mut c, &sb).await;
    assert!(host_excl_open(&free), "the device is free after the pod");
    let bytes = std::fs::read(&free_file).unwrap();
    assert_eq!(&bytes[2048 * 512..2048 * 512 + 16], b"guest-wrote-this");
    let bytes = std::fs::read(&ro_file).unwrap();
    assert_eq!(&bytes[..11], b"ro-original");
    // kubelet's loop is kubelet's to detach; it is no longer held.
    assert!(host_excl_open(&keep_busy));
}

/// A pod whose first container names a device mounted on the host
/// (`ctr run --device`, one container that is its own pod) is refused
/// before its VM boots: no QEMU ever starts, the device is named, and the
/// host's mount is untouched. No guest boots (~5 s).
#[test]
fn a_held_device_refuses_the_pod_before_qemu_starts() {
    let env = Env::start("default");
    let work = env.dir.path().join("devices");
    std::fs::create_dir_all(&work).unwrap();
    let mut undo = Undo::default();
    let (mounted, host_mnt) = host_mounted_device(&work, &mut undo);
    // QEMUs of this test's runtime root, seen from the start on.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (stop, root) = (stop.clone(), env.runtime_root.clone());
        std::thread::spawn(move || {
            let mut seen = false;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                seen |= !common::qemus_under(&root).is_empty();
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            seen
        })
    };
    let o = env.ctrd.ctr_in(
        "default",
        &[
            "run",
            "--rm",
            "--runtime",
            "io.containerd.crust.v2",
            "--device",
            &mounted.display().to_string(),
            crust_testkit::BUSYBOX_IMAGE,
            "held",
            "true",
        ],
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a mounted device was handed out");
    assert!(
        err.contains(&mounted.display().to_string()) && err.contains("in use"),
        "{err}"
    );
    assert!(!watcher.join().unwrap(), "a QEMU started for a refused pod");
    assert_eq!(
        std::fs::read_to_string(host_mnt.join("marker")).unwrap(),
        "host-marker\n"
    );
    let _ = env.ctrd.ctr_in("default", &["containers", "rm", "held"]);
}
