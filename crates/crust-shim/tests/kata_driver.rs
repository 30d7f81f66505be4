//! Issue 25 at the containerd door (`ctr run` on a private containerd,
//! containerd-shim-crust-v2): a volume exactly as Kata's CSI driver
//! (csi-kata-directvolume) makes it, a root-owned regular file
//! `<storage>/<volume id>/directvol-rawdisk.64M` formatted by the driver,
//! and its record as the driver marshals it (`directvol`, the volume
//! context as metadata, `["bind","rw"]`, here with an unusable `fsGroup`),
//! is mounted in the pod's guest; QEMU holds the file through the
//! descriptor the shim opened. A record with an option the guest refuses
//! fails the container, naming the option, before QEMU gets the file.
//! (The CLI door: crust-runtime's `guest_kata.rs`.)
//!
//! Budget: containerd + one TCG boot, ~20 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use common::{Env, qemus_under};
use crust_testkit::BUSYBOX_IMAGE;

const NS: &str = "default";
const RUNTIME: &str = "io.containerd.crust.v2";

fn plant_kata_record(kata_root: &Path, target: &str, json: &str) {
    let dir = kata_root.join(crust_handoff::kata_key(target));
    std::fs::create_dir_all(&dir).unwrap();
    for d in [kata_root, dir.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    let f = dir.join("mountInfo.json");
    std::fs::write(&f, json).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// Whether a QEMU of this test holds the inode of `file`.
fn qemu_holds(root: &Path, file: &Path) -> bool {
    let ino = std::fs::metadata(file).unwrap().ino();
    qemus_under(root).into_iter().any(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| std::fs::metadata(fd.path()).is_ok_and(|m| m.is_file() && m.ino() == ino))
    })
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn kata_driver_file_volume_through_containerd() {
    let storage_dir = tempfile::tempdir().unwrap();
    let storage = storage_dir.path().join("kata-directvol-storages");
    let env = Env::start_with(
        NS,
        vec![(
            "CRUST_RUNTIME_FILE_DEVICE_ROOTS".into(),
            storage.display().to_string(),
        )],
    );
    let vol = storage.join("62a268d9-893a-11ee-97cb-d89d6725e7b0");
    std::fs::create_dir_all(&vol).unwrap();
    for d in [&storage, &vol] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o750)).unwrap();
    }
    let file = vol.join("directvol-rawdisk.64M");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(
        std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(&file)
            .status()
            .unwrap()
            .success()
    );
    let record = |opts: &str| {
        format!(
            r#"{{"volume-type":"directvol","device":"{}","fstype":"ext4","metadata":{{"fsGroup":"abc","is_directvolume":"True","katacontainers.direct.volume/fstype":"ext4","katacontainers.direct.volume/volumetype":"directvol"}},"options":[{opts}]}}"#,
            file.display()
        )
    };
    let target = |pv: &str| {
        let t = env
            .pods_dir
            .join(format!("uid-k/volumes/kubernetes.io~csi/{pv}/mount"));
        std::fs::create_dir_all(&t).unwrap();
        t.display().to_string()
    };
    let run = |id: &str, src: &str, script: &str| {
        let mount = format!("type=bind,src={src},dst=/data,options=rbind:rw");
        env.ctrd.ctr_in(
            NS,
            &[
                "run",
                "-d",
                "--runtime",
                RUNTIME,
                "--mount",
                &mount,
                BUSYBOX_IMAGE,
                id,
                "sh",
                "-c",
                script,
            ],
        )
    };
    let remove = |id: &str| {
        let _ = env.ctrd.ctr_in(NS, &["task", "kill", "-s", "SIGKILL", id]);
        let _ = env.ctrd.ctr_in(NS, &["task", "delete", "-f", id]);
        let _ = env.ctrd.ctr_in(NS, &["containers", "rm", id]);
    };

    // A refused option: the container fails, QEMU never gets the file.
    let bad = target("pvc-bad");
    plant_kata_record(
        &env.kata_root,
        &bad,
        &record(r#""bind","rw","errors=panic""#),
    );
    let out = run("kbad", &bad, "sleep 600");
    let msg = text(&out);
    remove("kbad");
    assert!(!out.status.success(), "{msg}");
    assert!(msg.contains("errors=panic"), "{msg}\n{}", env.logs());
    assert!(!qemu_holds(env.dir.path(), &file));

    // The driver's record: mounted read-write, fsGroup "abc" ignored.
    let good = target("pvc-good");
    plant_kata_record(&env.kata_root, &good, &record(r#""bind","rw""#));
    let out = run(
        "kgood",
        &good,
        "echo from-containerd > /data/f && sync && stat -c %g /data > /data/g && sleep 600",
    );
    assert!(out.status.success(), "{}\n{}", text(&out), env.logs());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut n = 0;
    let seen = loop {
        n += 1;
        let exec_id = format!("x{n}");
        let o = env.ctrd.ctr_in(
            NS,
            &[
                "task",
                "exec",
                "--exec-id",
                &exec_id,
                "kgood",
                "cat",
                "/data/f",
                "/data/g",
            ],
        );
        if o.status.success() && String::from_utf8_lossy(&o.stdout).lines().count() == 2 {
            break String::from_utf8_lossy(&o.stdout).into_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{}\n{}",
            text(&o),
            env.logs()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(seen, "from-containerd\n0\n");
    assert!(qemu_holds(env.dir.path(), &file), "QEMU holds the file");
    remove("kgood");
    let out = std::process::Command::new("debugfs")
        .args(["-R", "cat /f"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-containerd\n");
}
