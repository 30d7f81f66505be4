//! Issue 24 at every door that hands a device to a guest: crust_ops
//! stage (the RPC's in-process core), `crust-runtime direct-volume add`,
//! and the hold a sandbox start or hot-plug takes
//! (`volumes::hold_host_device`). Each refuses a volume whose data another
//! block device exposes (its backing file attached again and mounted, a
//! hard link of it attached, a loop stacked on its device) with
//! FAILED_PRECONDITION naming the alias; no record is written, no hold is
//! left, the bytes are unchanged and the filesystem is clean. No guest is
//! booted (budget: under 10 s).

use std::path::Path;
use std::process::Command;

use crust_handoff::{Layout, MountInfo, Policy, Store};
use crust_sandbox::discovery::{LayoutKind, Volume};
use crust_testkit::{AliasCase, LoopDisk};
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_crust-runtime");
const MIB: u64 = 1 << 20;

#[derive(Debug, Clone, Copy)]
enum Door {
    OpsStage,
    DirectVolumeAdd,
    SandboxHold,
}

struct Roots {
    dir: tempfile::TempDir,
}

impl Roots {
    fn path(&self, p: &str) -> std::path::PathBuf {
        self.dir.path().join(p)
    }

    fn target(&self, pv: &str) -> String {
        self.path("pods/uid-1/volumes/kubernetes.io~csi")
            .join(pv)
            .join("mount")
            .display()
            .to_string()
    }

    fn recorded(&self, target: &str) -> bool {
        [(Layout::Crust, "crust"), (Layout::Kata, "kata")]
            .into_iter()
            .any(|(layout, root)| {
                Store::new(layout, self.path(root), Policy::default())
                    .unwrap()
                    .exists(target)
                    .unwrap_or(false)
            })
    }
}

/// Hands `dev` to a guest through `door`: Ok, or the refusal's code (by
/// name; the CLI prints none) and message.
fn knock(
    door: Door,
    roots: &Roots,
    target: &str,
    dev: &str,
) -> Result<(), (Option<String>, String)> {
    match door {
        Door::OpsStage => {
            let ops = crust_ops::CrustOps::new(crust_ops::OpsConfig {
                crust_root: roots.path("crust"),
                kata_root: roots.path("kata"),
                ..Default::default()
            })
            .unwrap();
            ops.stage(crust_ops::StageRequest {
                target_path: target.into(),
                device: dev.into(),
                fs_type: "ext4".into(),
                mount_flags: Vec::new(),
                fs_group: None,
                fs_group_change_policy: None,
                io_limits: Default::default(),
            })
            .map_err(|e| (Some(format!("{:?}", e.code())), e.to_string()))
        }
        Door::DirectVolumeAdd => {
            let mi = format!(r#"{{"device":"{dev}","fstype":"ext4"}}"#);
            let out = Command::new(BIN)
                .arg("--root")
                .arg(roots.path("run"))
                .arg("--crust-root")
                .arg(roots.path("crust"))
                .arg("--kata-root")
                .arg(roots.path("kata"))
                .args(["direct-volume", "add", "--volume-path", target])
                .args(["--mount-info", &mi])
                .output()
                .unwrap();
            if out.status.success() {
                return Ok(());
            }
            // The CLI exits non-zero with the message and no code.
            Err((None, String::from_utf8_lossy(&out.stderr).into_owned()))
        }
        Door::SandboxHold => {
            let v = Volume::from_record(
                LayoutKind::Crust,
                target,
                &MountInfo::block(dev, "ext4"),
                false,
            );
            crust_sandbox::volumes::hold_host_device(&v)
                .map(drop)
                .map_err(|e| (Some(format!("{:?}", e.code())), e.to_string()))
        }
    }
}

#[test]
fn every_door_refuses_a_volume_whose_data_another_device_exposes() {
    crust_testkit::require_root();
    for door in [Door::OpsStage, Door::DirectVolumeAdd, Door::SandboxHold] {
        for case in AliasCase::ALL {
            let roots = Roots {
                dir: tempfile::tempdir().unwrap(),
            };
            let disk = LoopDisk::with_fs(roots.path("vol.img"), 32 * MIB, "ext4".parse().unwrap());
            disk.with_host_mount(false, |m| {
                std::fs::write(m.join("data"), b"the volume's own data").unwrap()
            });
            let target = roots.target("pv-1");
            let alias = case.make(disk.file(), disk.dev());
            let before = crust_testkit::sha256(disk.file());

            let (code, msg) = knock(door, &roots, &target, disk.dev_str())
                .expect_err(&format!("{door:?} accepted {case:?}"));
            if let Some(code) = code {
                assert_eq!(
                    code,
                    format!("{:?}", Code::FailedPrecondition),
                    "{door:?} {case:?}: {msg}"
                );
            }
            assert!(
                msg.contains(&format!("{} ", alias.dev_str()))
                    && msg.contains("not the only device exposing its data"),
                "{door:?} {case:?}: {msg}"
            );
            assert!(!roots.recorded(&target), "{door:?} {case:?}: a record");
            crust_blockdev::ensure_released(disk.dev(), "check").unwrap();
            if alias.mount_point().is_none() {
                assert_eq!(
                    crust_testkit::sha256(disk.file()),
                    before,
                    "{door:?} {case:?}"
                );
            }
            drop(alias);

            // The alias gone, the same door takes the volume.
            knock(door, &roots, &target, disk.dev_str())
                .unwrap_or_else(|e| panic!("{door:?} after {case:?}: {e:?}"));
            let file = disk.file().to_path_buf();
            drop(disk);
            crust_testkit::assert_fsck_clean(&file);
            assert!(
                crust_blockdev::find_all_by_backing(Path::new(&file))
                    .unwrap()
                    .is_empty()
            );
        }
    }
}
