//! Helpers for the guest tests: loop devices, host mounts, a minimal QMP
//! client, and booting a guest with the real image and agent.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crust_agent_proto::{AgentClient, ClientError, ErrorCode};
use crust_vmm::{Accel, DiskSpec, Vm, VmConfig};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

pub const MIB: u64 = 1024 * 1024;

pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A sparse backing file attached to a loop device; detached on drop.
pub struct LoopDev {
    pub file: PathBuf,
    pub dev: PathBuf,
}

impl LoopDev {
    pub fn new(dir: &Path, name: &str, size: u64) -> LoopDev {
        let file = dir.join(name);
        let f = std::fs::File::create(&file).unwrap();
        f.set_len(size).unwrap();
        drop(f);
        let dev = run("losetup", &["--find", "--show", file.to_str().unwrap()]);
        LoopDev {
            file,
            dev: PathBuf::from(dev.trim()),
        }
    }

    pub fn dev_str(&self) -> &str {
        self.dev.to_str().unwrap()
    }

    /// Grows the backing file and makes the loop device see it.
    pub fn grow(&self, size: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&self.file)
            .unwrap()
            .set_len(size)
            .unwrap();
        run("losetup", &["--set-capacity", self.dev_str()]);
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

/// A host mount in a temp dir; unmounted on drop.
pub struct HostMount {
    pub dir: tempfile::TempDir,
}

impl HostMount {
    pub fn new(dev: &Path, opts: &str) -> HostMount {
        let dir = tempfile::tempdir().unwrap();
        run(
            "mount",
            &[
                "-o",
                opts,
                dev.to_str().unwrap(),
                dir.path().to_str().unwrap(),
            ],
        );
        HostMount { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for HostMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

/// Just enough QMP for the tests (the runtime uses crust-qmp).
pub struct Qmp {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
    pub events: Vec<Value>,
}

impl Qmp {
    pub async fn connect(path: &Path) -> Qmp {
        let s = UnixStream::connect(path).await.expect("connect qmp");
        let (rd, wr) = s.into_split();
        let mut q = Qmp {
            rd: BufReader::new(rd),
            wr,
            events: Vec::new(),
        };
        let greeting = q.read().await;
        assert!(greeting.get("QMP").is_some(), "{greeting}");
        q.execute("qmp_capabilities", json!({})).await.unwrap();
        q
    }

    async fn read(&mut self) -> Value {
        let mut line = String::new();
        let n = tokio::time::timeout(Duration::from_secs(60), self.rd.read_line(&mut line))
            .await
            .expect("qmp read timed out")
            .expect("qmp read");
        assert!(n > 0, "qmp closed");
        serde_json::from_str(&line).expect("qmp json")
    }

    pub async fn execute(&mut self, cmd: &str, args: Value) -> Result<Value, String> {
        let msg = json!({"execute": cmd, "arguments": args}).to_string() + "\n";
        self.wr.write_all(msg.as_bytes()).await.unwrap();
        loop {
            let v = self.read().await;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(e.to_string());
            }
            self.events.push(v);
        }
    }

    pub async fn wait_event(&mut self, name: &str, device: &str) {
        let matches = |v: &Value| v["event"] == name && v["data"]["device"] == device;
        if self.events.iter().any(matches) {
            return;
        }
        loop {
            let v = self.read().await;
            if matches(&v) {
                return;
            }
            self.events.push(v);
        }
    }
}

/// Builds the guest image if it is missing (CI builds it before the tests;
/// a stale image is not detected here: rerun guest/build-image.sh after
/// changing the agent). The nested cargo build uses its own target dir:
/// the outer `cargo test` holds the lock on the usual one.
pub fn ensure_guest_image() {
    let dir = crust_testkit::guest_image_dir();
    if dir.join("vmlinuz").is_file() && dir.join("initramfs.cpio.gz").is_file() {
        return;
    }
    std::fs::create_dir_all("/tmp/crust-test-vm-slots").unwrap();
    let lock = std::fs::File::create("/tmp/crust-test-vm-slots/image-build.lock").unwrap();
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
    if dir.join("vmlinuz").is_file() && dir.join("initramfs.cpio.gz").is_file() {
        return;
    }
    let root = crust_testkit::workspace_root();
    let status = Command::new(root.join("guest/build-image.sh"))
        .arg("--out")
        .arg(&dir)
        .env("CARGO_TARGET_DIR", root.join("target/guest-agent-build"))
        .status()
        .expect("run guest/build-image.sh");
    assert!(status.success(), "guest/build-image.sh failed");
}

/// A booted guest with its agent answering.
pub struct Guest {
    pub agent: AgentClient,
    pub vm: Vm,
    pub boot_time: Duration,
    pub run_dir: tempfile::TempDir,
    // Released last: the slot covers the guest's whole life.
    _slot: crust_testkit::VmSlot,
}

impl Guest {
    pub async fn boot(name: &str, disks: Vec<DiskSpec>) -> Guest {
        ensure_guest_image();
        let slot = crust_testkit::VmSlot::acquire();
        let (kernel, initrd) = crust_testkit::guest_image();
        let run_dir = tempfile::Builder::new()
            .prefix("crust-vmm-")
            .tempdir()
            .unwrap();
        let mut cfg = VmConfig::new(name, kernel, initrd, run_dir.path().join("run"));
        cfg.accel = Accel::Auto;
        cfg.disks = disks;
        cfg.hotplug_ports = 2;
        cfg.die_with_parent = true;
        let t0 = Instant::now();
        let vm = Vm::launch(cfg).await.expect("launch");
        let agent = AgentClient::new(vm.agent_socket());
        if let Err(e) = agent.wait_ready(Duration::from_secs(120)).await {
            panic!("agent not ready: {e}\n{}", vm.failure_context());
        }
        let boot_time = t0.elapsed();
        eprintln!("guest {name}: launch -> agent ping in {boot_time:?}");
        Guest {
            agent,
            vm,
            boot_time,
            run_dir,
            _slot: slot,
        }
    }

    /// Runs a command in the guest, asserting it succeeds; returns stdout.
    pub async fn sh(&self, script: &str) -> String {
        let r = self
            .agent
            .exec(&["sh", "-c", script], Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("exec {script:?}: {e}"));
        assert_eq!(
            r.exit_code, 0,
            "guest `{script}` failed: {}{}",
            r.stdout, r.stderr
        );
        r.stdout
    }

    /// The guest's /proc/mounts line for `path`, if mounted.
    pub async fn mount_line(&self, path: &str) -> Option<String> {
        self.sh("cat /proc/mounts")
            .await
            .lines()
            .find(|l| l.split(' ').nth(1) == Some(path))
            .map(str::to_owned)
    }
}

pub fn code_of<T: std::fmt::Debug>(r: Result<T, ClientError>) -> ErrorCode {
    match r {
        Err(e) => e
            .code()
            .unwrap_or_else(|| panic!("expected an agent error, got {e}")),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

/// `df -P -B1` / `df -i` numbers for `path` in the guest: (total, used, avail).
pub async fn guest_df(g: &Guest, flags: &str, path: &str) -> (u64, u64, u64) {
    let out = g.sh(&format!("df {flags} {path}")).await;
    let line = out.lines().nth(1).expect("df data line");
    let f: Vec<&str> = line.split_whitespace().collect();
    (
        f[1].parse().unwrap(),
        f[2].parse().unwrap(),
        f[3].parse().unwrap(),
    )
}

pub fn disk(id: &str, dev: &Path, serial: &str) -> DiskSpec {
    DiskSpec {
        id: id.into(),
        path: dev.to_path_buf(),
        serial: serial.into(),
        readonly: false,
    }
}
