//! Helpers for the guest tests: formatting, a minimal QMP client, and
//! booting a guest with the real image and agent. Loop devices and host
//! mounts come from `crust_testkit::LoopDisk`.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crust_agent_proto::{AgentClient, ClientError, ErrorCode};
use crust_testkit::LoopDisk;
use crust_vmm::{Accel, DiskSpec, Vm, VmConfig};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

pub const MIB: u64 = 1024 * 1024;

/// Formats with the tools' own defaults, not crust_blockdev::mkfs: that one
/// makes `errors=remount-ro` the superblock default, and the kernel then
/// hides the option the tests pass and look for in the guest's mount table.
pub fn mkfs_tool_defaults(ext4: &LoopDisk, xfs: &LoopDisk) {
    run("mkfs.ext4", &["-q", "-F", ext4.dev_str()]);
    run("mkfs.xfs", &["-q", "-f", xfs.dev_str()]);
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
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
        Guest::boot_with(name, disks, |_| {}).await
    }

    /// [`Guest::boot`] with `adjust` applied to the config last.
    pub async fn boot_with(
        name: &str,
        disks: Vec<DiskSpec>,
        adjust: impl FnOnce(&mut VmConfig),
    ) -> Guest {
        crust_testkit::ensure_guest_image();
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
        adjust(&mut cfg);
        let t0 = Instant::now();
        // Auto: KVM only where a probe boot proved it (else TCG).
        let vm = Vm::boot(cfg, Duration::from_secs(120))
            .await
            .unwrap_or_else(|e| panic!("guest {name} did not boot: {e}"));
        let agent = AgentClient::new(vm.agent_socket());
        let boot_time = t0.elapsed();
        let accel = vm.accel_choice();
        eprintln!(
            "guest {name}: launch -> agent ping in {boot_time:?} under {} ({})",
            accel.accel.as_str(),
            accel.reason
        );
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
