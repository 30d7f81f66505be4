//! Real resources for the integration tests, each released on drop: a
//! loop device over a sparse file, an ext4 mount, the crust-ops daemon.

#![allow(dead_code)]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crust_proto::endpoint::Endpoint;
use crust_proto::runtime::v1alpha1 as pb;
use crust_testkit::ChildGuard;
use linux_raw_sys::loop_device as ld;
use pb::runtime_client::RuntimeClient;
use rustix::ioctl::{Ioctl, IoctlOutput, Opcode};

/// `LOOP_CTL_GET_FREE` returns the device number as the ioctl's result.
struct GetFree;

unsafe impl Ioctl for GetFree {
    type Output = u32;
    const IS_MUTATING: bool = false;
    fn opcode(&self) -> Opcode {
        ld::LOOP_CTL_GET_FREE as Opcode
    }
    fn as_ptr(&mut self) -> *mut core::ffi::c_void {
        core::ptr::null_mut()
    }
    unsafe fn output_from_ptr(
        out: IoctlOutput,
        _: *mut core::ffi::c_void,
    ) -> rustix::io::Result<u32> {
        Ok(out as u32)
    }
}

/// A loop device over a sparse backing file; detached on drop.
pub struct LoopDev {
    pub path: String,
    pub backing: PathBuf,
    file: File,
}

impl LoopDev {
    pub fn new(backing: &Path, size: u64) -> LoopDev {
        let f = File::create(backing).unwrap();
        f.set_len(size).unwrap();
        drop(f);
        let backing_file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(backing)
            .unwrap();
        let ctl = File::open("/dev/loop-control").unwrap();
        // Other tests race for free devices: retry on EBUSY.
        for _ in 0..50 {
            let n = unsafe { rustix::ioctl::ioctl(&ctl, GetFree) }.unwrap();
            let path = format!("/dev/loop{n}");
            let dev = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            let mut cfg: ld::loop_config = unsafe { std::mem::zeroed() };
            cfg.fd = backing_file.as_raw_fd() as u32;
            cfg.info.lo_flags = ld::LO_FLAGS_AUTOCLEAR as u32;
            let r = unsafe {
                rustix::ioctl::ioctl(
                    &dev,
                    rustix::ioctl::Setter::<{ ld::LOOP_CONFIGURE as Opcode }, ld::loop_config>::new(
                        cfg,
                    ),
                )
            };
            match r {
                Ok(()) => {
                    return LoopDev {
                        path,
                        backing: backing.to_path_buf(),
                        file: dev,
                    };
                }
                Err(rustix::io::Errno::BUSY) => continue,
                Err(e) => panic!("LOOP_CONFIGURE {path}: {e}"),
            }
        }
        panic!("no free loop device");
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = unsafe {
            rustix::ioctl::ioctl(
                &self.file,
                rustix::ioctl::NoArg::<{ ld::LOOP_CLR_FD as Opcode }>::new(),
            )
        };
    }
}

pub fn mkfs(fs: &str, dev: &str) {
    let out = match fs {
        "ext4" => Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "4096", dev])
            .output(),
        "xfs" => Command::new("mkfs.xfs").args(["-q", "-f", dev]).output(),
        other => panic!("no mkfs for {other}"),
    }
    .unwrap();
    assert!(
        out.status.success(),
        "mkfs.{fs}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A mount; unmounted (lazily if busy) on drop.
pub struct Mount {
    pub dir: PathBuf,
}

impl Mount {
    pub fn new(dev: &str, dir: &Path, fs: &str) -> Mount {
        std::fs::create_dir_all(dir).unwrap();
        rustix::mount::mount(dev, dir, fs, rustix::mount::MountFlags::empty(), None).unwrap();
        Mount {
            dir: dir.to_path_buf(),
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if rustix::mount::unmount(&self.dir, rustix::mount::UnmountFlags::empty()).is_err() {
            let _ = rustix::mount::unmount(&self.dir, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// Whether this process may grow a mounted ext4 (EXT4_IOC_RESIZE_FS needs
/// CAP_SYS_RESOURCE, which some sandboxes drop).
pub fn has_cap_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    eff & (1 << 24) != 0
}

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
