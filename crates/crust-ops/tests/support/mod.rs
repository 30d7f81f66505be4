//! Real resources for the integration tests, each released on drop: the
//! crust-ops daemon here; loop-backed filesystems and their mounts come from
//! `crust_testkit::LoopDisk`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crust_proto::endpoint::Endpoint;
use crust_proto::runtime::v1alpha1 as pb;
use crust_testkit::ChildGuard;
use pb::runtime_client::RuntimeClient;

/// The real `crust-ops` binary on a socket in a tempdir.
pub struct Daemon {
    pub child: ChildGuard,
    pub socket: PathBuf,
}

impl Daemon {
    pub fn start(socket: &Path, args: &[&str], env: &[(&str, &str)]) -> Daemon {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_crust-ops"));
        cmd.arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(args)
            .arg("--log-level")
            .arg("warn")
            .stdin(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = ChildGuard::new(cmd.spawn().unwrap());
        let t0 = Instant::now();
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            if let Some(status) = child.child().try_wait().unwrap() {
                panic!("crust-ops exited early: {status}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "crust-ops did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Daemon {
            child,
            socket: socket.to_path_buf(),
        }
    }

    pub async fn client(&self) -> RuntimeClient<tonic::transport::Channel> {
        let ch = Endpoint::Unix(self.socket.clone()).connect().await.unwrap();
        RuntimeClient::new(ch)
    }

    /// SIGTERM, then wait for a clean exit.
    pub fn stop(mut self) -> std::process::ExitStatus {
        let pid = self.child.child().id() as i32;
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).unwrap(),
            rustix::process::Signal::TERM,
        )
        .unwrap();
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.child().try_wait().unwrap() {
                return s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "crust-ops ignored SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

pub fn stage_req(target: &str, device: &str) -> pb::RuntimeStageVolumeRequest {
    stage_req_fs(target, device, "ext4")
}

pub fn stage_req_fs(target: &str, device: &str, fs: &str) -> pb::RuntimeStageVolumeRequest {
    pb::RuntimeStageVolumeRequest {
        volume_type: Some(pb::VolumeType {
            r#type: pb::volume_type::Type::Block as i32,
        }),
        volume_target_path: target.into(),
        volume_backing_path: device.into(),
        fs_type: fs.into(),
        mount_flags: vec!["noatime".into()],
        volume_supplemental_group: "2000".into(),
        volume_supplemental_group_change_policy: Some(pb::VolumeGroupChangePolicy {
            policy: pb::volume_group_change_policy::Policy::OnRootMismatch as i32,
        }),
    }
}

pub fn stats_req(target: &str) -> pb::RuntimeGetVolumeStatsRequest {
    pb::RuntimeGetVolumeStatsRequest {
        volume_target_path: target.into(),
    }
}

pub fn expand_req(target: &str, required: i64, limit: i64) -> pb::RuntimeExpandVolumeRequest {
    pb::RuntimeExpandVolumeRequest {
        volume_target_path: target.into(),
        capacity_range: Some(pb::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        }),
    }
}

pub fn unstage_req(target: &str) -> pb::RuntimeUnstageVolumeRequest {
    pb::RuntimeUnstageVolumeRequest {
        volume_target_path: target.into(),
    }
}

/// Usage as statvfs reports it, in the CLI protocol's terms.
pub fn statvfs_usage(dir: &Path) -> (i64, i64, i64, i64, i64, i64) {
    let s = rustix::fs::statvfs(dir).unwrap();
    let bs = s.f_frsize;
    (
        (s.f_bavail * bs) as i64,
        (s.f_blocks * bs) as i64,
        ((s.f_blocks - s.f_bfree) * bs) as i64,
        s.f_favail as i64,
        s.f_files as i64,
        (s.f_files - s.f_ffree) as i64,
    )
}

pub fn proto_usage(r: &pb::RuntimeGetVolumeStatsResponse) -> (i64, i64, i64, i64, i64, i64) {
    let by = |u: pb::volume_usage::Unit| {
        r.usage
            .iter()
            .find(|x| x.unit == u as i32)
            .unwrap_or_else(|| panic!("no {u:?} usage in {r:?}"))
    };
    let b = by(pb::volume_usage::Unit::Bytes);
    let i = by(pb::volume_usage::Unit::Inodes);
    (b.available, b.total, b.used, i.available, i.total, i.used)
}

/// True when `pid` is gone or a zombie.
pub fn is_dead(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .next();
    matches!(state, None | Some("Z"))
}

pub fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}
