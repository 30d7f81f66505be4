//! Issue 25 (Kata half), without booting a guest: the exact words of
//! Kata's CLI (`kata-runtime direct-volume …`: urfave/cli over Go's
//! `flag`, sizes through `strconv.ParseUint(s, 0, 64)`) and the exact
//! bytes Kata's CSI driver (`csi-kata-directvolume`, NodePublishVolume)
//! hands it, against `crust-runtime`; records checked before any VM
//! starts (a QEMU stand-in records whether it was ever run).
//!
//! Time budget: about 2 s (no guest).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::*;
use crust_blockdev::FsType;

/// What csi-kata-directvolume's NodePublishVolume passes to
/// `AddDirectVolume` (Go's json.Marshal of its MountInfo): volume type
/// from the StorageClass, the whole volume context as metadata (sorted
/// keys), `["bind","rw"]`; plus the metadata Kata's runtime reads
/// (`createFilesystem`, and an unusable `fsGroup`).
fn kata_driver_record(dev: &str) -> String {
    format!(
        r#"{{"volume-type":"directvol","device":"{dev}","fstype":"ext4","metadata":{{"capacity_in_bytes":"67108864","createFilesystem":"true","direct_volume_name":"pvc-1","fsGroup":"abc","is_directvolume":"True","katacontainers.direct.volume/fstype":"ext4","katacontainers.direct.volume/volumetype":"directvol","storage.kubernetes.io/csiProvisionerIdentity":"1700000000000-8081-directvolume.csi.katacontainers.io"}},"options":["bind","rw"]}}"#
    )
}

fn record_file(env: &Env, target: &str) -> PathBuf {
    env.kata
        .join(crust_handoff::kata_key(target))
        .join("mountInfo.json")
}

/// Writes a Kata-layout record as Kata's `volume.Add` does (0600 file in
/// a 0700 directory).
fn plant(env: &Env, target: &str, json: &str) {
    let f = record_file(env, target);
    let dir = f.parent().unwrap();
    std::fs::create_dir_all(dir).unwrap();
    for d in [env.kata.as_path(), dir] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    std::fs::write(&f, json).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A QEMU that only leaves a mark that it was run, then fails.
fn qemu_stand_in(env: &Env) -> (PathBuf, PathBuf) {
    let mark = env.files.join("qemu-was-run");
    let bin = env.files.join("qemu-stand-in");
    std::fs::write(
        &bin,
        format!("#!/bin/sh\necho \"$@\" >> {}\nexit 1\n", mark.display()),
    )
    .unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    (bin, mark)
}

/// Items 2, 4, 7, 8 through `direct-volume add`, spelled as Kata's CLI
/// takes it: single-dash flags, the driver's bytes stored as given,
/// `bind` accepted, the unusable fsGroup a warning; sizes in Go's bases.
#[test]
fn kata_cli_words_and_driver_bytes_are_accepted() {
    let env = Env::new();
    let disk = env.disk("kata.img", 64 * MIB, FsType::Ext4);
    let target = env.target("pod-k", "pv-k");
    let given = kata_driver_record(disk.dev_str());
    let out = env.run(&[
        "direct-volume",
        "add",
        "-volume-path",
        &target,
        "-mount-info",
        &given,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("fsGroup") && stderr.contains("ignored"),
        "the unusable fsGroup is said: {stderr}"
    );
    // Kata's `volume.Add` stores the caller's bytes: so does crust here.
    assert_eq!(
        std::fs::read_to_string(record_file(&env, &target)).unwrap(),
        given
    );
    let rec = env
        .store(crust_handoff::Layout::Kata)
        .read(&target)
        .unwrap();
    assert_eq!(rec.options, ["bind", "rw"]);

    // `-flag=value` and `--flag`, as Go's flag package takes them.
    env.ok(&["direct-volume", "remove", &format!("-volume-path={target}")]);
    assert!(!record_file(&env, &target).exists());

    // Kata's design-doc record (`block`, `Device`): the canonical form is
    // stored, with the volume type Kata's Rust runtime requires.
    let doc = format!(
        r#"{{"volume-type":"block","Device":"{}","fstype":"ext4","options":["bind","ro"]}}"#,
        disk.dev_str()
    );
    env.ok(&[
        "direct-volume",
        "add",
        "--volume-path",
        &target,
        "--mount-info",
        &doc,
    ]);
    let stored = std::fs::read_to_string(record_file(&env, &target)).unwrap();
    assert_eq!(
        stored,
        format!(
            r#"{{"volume-type":"directvol","device":"{}","fstype":"ext4","options":["bind","ro"]}}"#,
            disk.dev_str()
        )
    );

    // Sizes: hex, octal, binary and `_` read as Go reads them; a bad one
    // is refused by the flag parser, naming the rule. (No sandbox serves
    // the volume, so a well-formed resize fails later, for that reason.)
    for size in ["0x4000000", "0400000000", "0b1_0000", "67_108_864"] {
        let out = env.run(&[
            "direct-volume",
            "resize",
            "-volume-path",
            &target,
            "-size",
            size,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert_ne!(
            out.status.code(),
            Some(2),
            "{size}: a usage error: {stderr}"
        );
        assert!(!stderr.contains("invalid value"), "{size}: {stderr}");
    }
    for bad in ["08", "0x", "-1", "1__0"] {
        let out = env.run(&[
            "direct-volume",
            "resize",
            "-volume-path",
            &target,
            "-size",
            bad,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert!(stderr.contains("as Kata's CLI reads it"), "{bad}: {stderr}");
    }
    env.ok(&["direct-volume", "remove", "--volume-path", &target]);
    drop(disk);
}

/// Item 2: everything a record carries is judged before a VM starts. An
/// option the guest would refuse fails `create` with QEMU never run; the
/// driver's `bind` does not stop it (QEMU is run, the stand-in fails).
#[test]
fn records_are_checked_before_any_vm_starts() {
    let mut env = Env::new();
    let (qemu, mark) = qemu_stand_in(&env);
    env.extra_args = vec!["--qemu".into(), qemu.display().to_string()];
    let disk = env.disk("pre.img", 64 * MIB, FsType::Ext4);
    let target = env.target("pod-p", "pv-p");
    let store = env.store(crust_handoff::Layout::Kata);
    let with_options = |opts: &str| {
        format!(
            r#"{{"volume-type":"directvol","device":"{}","fstype":"ext4","options":[{opts}]}}"#,
            disk.dev_str()
        )
    };
    plant(
        &env,
        &target,
        &with_options(r#""bind","rw","errors=panic""#),
    );
    let b = env.bundle("pre", &["true"], vec![bind("/data", &target, false)]);
    let err = env.fails(&["create", "--bundle", b.to_str().unwrap(), "pre"]);
    assert!(
        err.contains("errors=panic") && err.contains(&target),
        "{err}"
    );
    assert!(
        !mark.exists(),
        "QEMU was run for a record the guest refuses"
    );
    assert!(!env.root.join("pre").exists());
    assert!(
        !Path::new(&store.record_dir(&target).unwrap())
            .join("pre")
            .exists(),
        "no claim"
    );

    plant(&env, &target, &with_options(r#""bind","rw""#));
    let err = env.fails(&["create", "--bundle", b.to_str().unwrap(), "pre"]);
    assert!(
        mark.exists(),
        "bind is no reason to stop before boot: {err}"
    );
    assert!(!err.contains("bind"), "{err}");
    drop(disk);
    assert_clean(&env);
}

/// Item 1: a file device outside the file-device roots is refused before
/// anything starts, naming the setting; a file the roots cover but
/// reached through a symlink is refused too.
#[test]
fn file_devices_outside_the_roots_are_refused_naming_the_setting() {
    let mut env = Env::new();
    let (qemu, mark) = qemu_stand_in(&env);
    let storage = env.dir.path().join("storages");
    env.extra_args = vec!["--qemu".into(), qemu.display().to_string()];
    std::fs::create_dir_all(storage.join("v")).unwrap();
    let inside = storage.join("v/directvol-rawdisk.8M");
    let outside = env.files.join("directvol-rawdisk.8M");
    for f in [&inside, &outside] {
        std::fs::File::create(f).unwrap().set_len(8 * MIB).unwrap();
    }
    std::os::unix::fs::symlink(&inside, storage.join("v/link")).unwrap();
    let target = env.target("pod-f", "pv-f");
    let b = env.bundle("f", &["true"], vec![bind("/data", &target, false)]);
    for (dev, why) in [
        (outside.clone(), "CRUST_RUNTIME_FILE_DEVICE_ROOTS"),
        (storage.join("v/link"), "symlink"),
    ] {
        plant(
            &env,
            &target,
            &format!(
                r#"{{"volume-type":"directvol","device":"{}","fstype":"ext4","options":["bind","rw"]}}"#,
                dev.display()
            ),
        );
        let out = env.run_with_vars(
            &[("CRUST_RUNTIME_FILE_DEVICE_ROOTS", &storage)],
            &["create", "--bundle", b.to_str().unwrap(), "f"],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains(why), "{why}: {err}");
        assert!(!mark.exists(), "QEMU was run");
    }
    assert_clean(&env);
}
