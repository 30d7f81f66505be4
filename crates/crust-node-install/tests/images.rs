//! `scripts/build-images.sh`: two builds from the same inputs give the same
//! image digests and byte-identical archives; each image holds what it
//! needs at run time; and the node payload, installed by the real
//! `crust-node-install` into an empty root, runs there under `chroot`:
//! nothing from the host's libraries, loader or firmware is needed.
//!
//! Time budget: about 2 x 40 s of image builds on a loaded 2-core machine.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCE_DATE_EPOCH: &str = "1767225600"; // 2026-01-01T00:00:00Z

fn build(out: &Path) -> String {
    common::build_images(out, Some(SOURCE_DATE_EPOCH))
}

/// Whether an ELF64 file has a PT_INTERP program header (is dynamically
/// linked through a loader).
fn has_interpreter(p: &Path) -> bool {
    let elf = fs::read(p).unwrap();
    assert_eq!(&elf[..5], b"\x7fELF\x02", "{}: not ELF64", p.display());
    let u16_at = |o: usize| usize::from(u16::from_le_bytes([elf[o], elf[o + 1]]));
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().unwrap()) as usize;
    let (size, count) = (u16_at(0x36), u16_at(0x38));
    (0..count).any(|i| {
        let o = phoff + i * size;
        u32::from_le_bytes(elf[o..o + 4].try_into().unwrap()) == 3
    })
}

fn sha256_file(p: &Path) -> String {
    let out = Command::new("sha256sum").arg(p).output().unwrap();
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

/// Paths in the (single) layer of an image in an OCI layout.
fn layer_paths(layout: &Path) -> Vec<String> {
    let blob = |digest: &str| layout.join("blobs/sha256").join(&digest[7..]);
    let index: serde_json::Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    let manifest: serde_json::Value = serde_json::from_slice(
        &fs::read(blob(index["manifests"][0]["digest"].as_str().unwrap())).unwrap(),
    )
    .unwrap();
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1);
    let out = Command::new("tar")
        .arg("tzf")
        .arg(blob(layers[0]["digest"].as_str().unwrap()))
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.trim_start_matches('/').trim_end_matches('/').to_string())
        .collect()
}

fn run_in(root: &Path, args: &[&str]) -> std::process::Output {
    Command::new("timeout")
        .arg("10")
        .arg("chroot")
        .arg(root)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn images_build_reproducibly_and_the_node_payload_runs_self_contained() {
    crust_testkit::require_root();
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let first = build(a.path());
    let second = build(b.path());
    assert_eq!(first, second, "same inputs, same digests");
    let version = env!("CARGO_PKG_VERSION");
    let tag = common::tag();
    for name in ["crust-csi", "crust-node-installer"] {
        let tar = format!("{name}-{tag}.oci.tar");
        assert_eq!(
            sha256_file(&a.path().join(&tar)),
            sha256_file(&b.path().join(&tar)),
            "{tar} byte-identical"
        );
        assert!(
            first.contains(&format!("localhost/crust/{name}:{tag} sha256:")),
            "{first}"
        );
    }

    // The plugin image: the plugin, crustctl for probes, the filesystem
    // tools it runs, their libraries and the loader.
    let csi = layer_paths(&a.path().join("stage/crust-csi/oci"));
    for p in [
        "usr/bin/crust-csi",
        "usr/bin/crustctl",
        "usr/sbin/mkfs.ext4",
        "usr/sbin/e2fsck",
        "usr/sbin/resize2fs",
        "usr/sbin/mkfs.xfs",
        "usr/sbin/xfs_growfs",
        "usr/sbin/losetup",
        "usr/sbin/wipefs",
        "etc/mke2fs.conf",
        "lib64/ld-linux-x86-64.so.2",
        "lib/x86_64-linux-gnu/libc.so.6",
        "lib/x86_64-linux-gnu/libext2fs.so.2",
        "usr/share/crust/packages.txt",
    ] {
        assert!(csi.iter().any(|x| x == p), "crust-csi image lacks {p}");
    }
    let inst = layer_paths(&a.path().join("stage/crust-node-installer/oci"));
    for p in [
        "usr/bin/crust-node-install",
        "usr/bin/nsenter",
        "usr/share/crust/payload/bin/crust-runtime",
        "usr/share/crust/payload/bin/crust-runtime-poll",
        "usr/share/crust/payload/bin/qemu-system-x86_64",
        "usr/share/crust/payload/bin/nft",
        "usr/share/crust/payload/lib/ld-linux-x86-64.so.2",
        "usr/share/crust/payload/share/seabios/bios-256k.bin",
        "usr/share/crust/payload/guest-image/vmlinuz",
        "usr/share/crust/payload/guest-image/initramfs.cpio.gz",
        "usr/share/crust/payload/share/crust/payload.json",
    ] {
        assert!(inst.iter().any(|x| x == p), "installer image lacks {p}");
    }

    // Install the staged payload into an empty host root and run it there.
    let host = tempfile::tempdir().unwrap();
    let payload: PathBuf = a
        .path()
        .join("stage/crust-node-installer/rootfs/usr/share/crust/payload");
    let out = Command::new(env!("CARGO_BIN_EXE_crust-node-install"))
        .arg("--host-root")
        .arg(host.path())
        .arg("--payload")
        .arg(&payload)
        .arg("install")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info: serde_json::Value = serde_json::from_slice(
        &fs::read(host.path().join("opt/crust/share/crust/payload.json")).unwrap(),
    )
    .unwrap();
    let components: Vec<&str> = info["components"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    // The poll CLI is static (no program interpreter: no loader runs at each
    // of kubelet's polls), runs too, and hands other verbs to crust-runtime.
    assert!(
        !has_interpreter(&host.path().join("opt/crust/bin/crust-runtime-poll")),
        "the payload's crust-runtime-poll is dynamically linked"
    );
    assert!(has_interpreter(
        &host.path().join("opt/crust/bin/crust-runtime")
    ));
    for cli in [
        "/opt/crust/bin/crust-runtime",
        "/opt/crust/bin/crust-runtime-poll",
    ] {
        let r = run_in(host.path(), &[cli, "--version"]);
        assert!(
            r.status.success(),
            "{cli}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        assert!(
            String::from_utf8_lossy(&r.stdout).contains(version),
            "{cli}"
        );
    }
    // The shim's nft runs from the payload alone (its libraries beside it).
    assert!(components.contains(&"nft"), "{components:?}");
    let r = run_in(host.path(), &["/opt/crust/bin/nft", "--version"]);
    assert!(
        String::from_utf8_lossy(&r.stdout).starts_with("nftables v"),
        "{r:?}"
    );
    let r = run_in(
        host.path(),
        &["/opt/crust/bin/qemu-system-x86_64", "--version"],
    );
    assert!(String::from_utf8_lossy(&r.stdout).starts_with("QEMU emulator version"));
    // Firmware and the TCG module come from /opt/crust too: QEMU builds
    // the q35 machine (loading SeaBIOS) and waits, stopped, until killed.
    let r = Command::new("timeout")
        .args(["3", "chroot"])
        .arg(host.path())
        .args([
            "/opt/crust/bin/qemu-system-x86_64",
            "-machine",
            "q35",
            "-accel",
            "tcg",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-S",
        ])
        .output()
        .unwrap();
    assert_eq!(
        r.status.code(),
        Some(124),
        "QEMU should still be running when timeout stops it: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    // A containerd shim takes Go-style flags: `-v` prints its version.
    for (c, flag) in [
        ("virtiofsd", "--version"),
        ("containerd-shim-crust-v2", "-v"),
    ] {
        if components.contains(&c) {
            let r = run_in(host.path(), &[&format!("/opt/crust/bin/{c}"), flag]);
            assert!(
                r.status.success(),
                "{c}: {}",
                String::from_utf8_lossy(&r.stderr)
            );
        }
    }
}
