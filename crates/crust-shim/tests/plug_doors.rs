//! Issue 31: both front doors reach a volume through one plug routine, so
//! one test body runs against each: the `crust-runtime` CLI (`create` +
//! `start`) and containerd-shim-crust-v2 (`ctr run` on a private
//! containerd), with crust-csi playing kubelet's CSI calls.
//!
//! * A deferred volume (`defer_fs_ops`) and a host-published one handed
//!   over (`auto`) are mounted read-write in the guest; meanwhile the
//!   host's `O_EXCL` open and `mount -o ro,noload` of either device fail,
//!   and QEMU has both devices' backing files open (the loop driver
//!   skipped, issue 28). After the workload is gone, both devices are
//!   free and unclaimed.
//! * The deferred volume's device mounted on the host after
//!   NodePublishVolume: the start fails naming the mount; QEMU never opens
//!   the device or its backing file (sampled throughout), the host mount and its file are
//!   untouched, no claim is left.
//!
//! * QEMU killed under a running workload: the door's delete releases the
//!   holds and claims of both volumes (one teardown routine), and what the
//!   guest synced is on each device.
//! * ControllerExpandVolume + NodeExpandVolume of both volumes while the
//!   workload runs: each filesystem grows in the guest (`df`).
//! * ControllerModifyVolume (`iops`) on the deferred volume while it runs:
//!   the guest's direct reads fall to the limit, live, through that door.
//!   For the containerd door it is sent, as in a cluster, to another
//!   node's crust-csi (where the external-resizer runs), which passes it
//!   to this node's over the peer port (README "ModifyVolume across
//!   nodes").
//!
//! * The network (`the_guest_takes_the_network_namespace`): a namespace
//!   with netfilter rules refused by name, a CNI namespace mirrored into
//!   the guest and left as CNI made it.
//!
//! * A seccomp profile (`the_workload_runs_under_its_seccomp_profile`):
//!   the system calls it denies fail in the workload with its errno, the
//!   rest run (issue 44: the CLI's workload is a container too).
//!
//! Budget: per door containerd + crust-csi + two TCG boots, ~30 s, and
//! ~15 s each for the network and the seccomp profile; the door tests run
//! side by side (two VM slots).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Env, Leftovers, qemus_under};
use crust_proto::csi::v1 as csi;
use crust_testkit::BUSYBOX_IMAGE;

const NS: &str = "default";
const RUNTIME: &str = "io.containerd.crust.v2";
const CMD_LIMIT: Duration = Duration::from_secs(240);

#[derive(Clone, Copy, Debug)]
enum Door {
    /// `crust-runtime create/start/exec/delete`.
    Cli,
    /// `ctr run` through containerd and containerd-shim-crust-v2.
    Containerd,
}

/// Runs `cmd` with piped output; killed (and the test failed) after
/// [`CMD_LIMIT`].
fn run_limited(mut cmd: Command) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(CMD_LIMIT) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            if let Some(p) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            panic!("{cmd:?} did not finish within {CMD_LIMIT:?}");
        }
    }
}

/// The runtime CLI with the roots containerd gives the shim (as a node's
/// `CRUST_RUNTIME_*` settings would).
fn cli(env: &Env, args: &[&str]) -> Output {
    let d = env.dir.path();
    let mut cmd = Command::new(crust_testkit::workspace_bin("crust-runtime"));
    cmd.env_remove("RUST_LOG")
        .env("CRUST_RUNTIME_ROOT", &env.runtime_root)
        .env("CRUST_RUNTIME_CRUST_ROOT", &env.crust_root)
        .env("CRUST_RUNTIME_KATA_ROOT", &env.kata_root)
        .env("CRUST_RUNTIME_PODS_LAYER_STOP", &env.pods_dir)
        .env(
            "CRUST_RUNTIME_KATA_SHIM_DIRS",
            format!(
                "{},{}",
                d.join("vc-sbs").display(),
                d.join("kata-run").display()
            ),
        )
        .env(
            "CRUST_RUNTIME_HANDOVER_ENDPOINT",
            format!("unix://{}", common::handover_socket(d).display()),
        )
        .env("CRUST_RUNTIME_ACCEL", "tcg")
        .env("CRUST_GUEST_DIR", crust_testkit::guest_image_dir())
        .args(args);
    run_limited(cmd)
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// One test per door running the same body: `per_door!(body: cli_test,
/// containerd_test)`.
macro_rules! per_door {
    ($body:ident: $cli:ident, $containerd:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $cli() {
            $body(Door::Cli).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $containerd() {
            $body(Door::Containerd).await;
        }
    };
}

/// A workload started through a door; removed (forcibly) on drop.
struct Workload<'a> {
    env: &'a Env,
    door: Door,
    id: String,
}

impl Door {
    /// Starts `script` with each `(destination, source)` bound read-write;
    /// Err(the door's error output) when it refuses.
    fn start<'a>(
        self,
        env: &'a Env,
        id: &str,
        binds: &[(&str, &str)],
        script: &str,
    ) -> Result<Workload<'a>, String> {
        self.start_in(env, id, binds, script, None)
    }

    /// [`Door::start`] in the network namespace at `netns` (its OCI
    /// `linux.namespaces` entry: the CLI's bundle, `ctr run --with-ns`).
    fn start_in<'a>(
        self,
        env: &'a Env,
        id: &str,
        binds: &[(&str, &str)],
        script: &str,
        netns: Option<&str>,
    ) -> Result<Workload<'a>, String> {
        self.launch(env, id, binds, script, netns, None)
    }

    /// [`Door::start`] under the seccomp profile in the file `profile`
    /// (the CLI's bundle `linux.seccomp`, `ctr run --seccomp-profile`).
    fn start_filtered<'a>(
        self,
        env: &'a Env,
        id: &str,
        script: &str,
        profile: &Path,
    ) -> Result<Workload<'a>, String> {
        self.launch(env, id, &[], script, None, Some(profile))
    }

    fn launch<'a>(
        self,
        env: &'a Env,
        id: &str,
        binds: &[(&str, &str)],
        script: &str,
        netns: Option<&str>,
        seccomp: Option<&Path>,
    ) -> Result<Workload<'a>, String> {
        let w = Workload {
            env,
            door: self,
            id: id.into(),
        };
        let out = match self {
            Door::Cli => {
                let bundle = env.dir.path().join("bundles").join(id);
                std::fs::create_dir_all(bundle.join("rootfs")).unwrap();
                let mounts: Vec<_> = binds
                    .iter()
                    .map(|(dst, src)| {
                        serde_json::json!({"destination": dst, "type": "bind",
                            "source": src, "options": ["rbind", "rprivate"]})
                    })
                    .collect();
                let mut spec = serde_json::json!({
                    "ociVersion": "1.0.2",
                    "process": {"terminal": false, "user": {"uid": 0, "gid": 0},
                        "args": ["sh", "-c", script],
                        "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "cwd": "/"},
                    "root": {"path": "rootfs"},
                    "mounts": mounts,
                });
                if let Some(p) = netns {
                    spec["linux"] =
                        serde_json::json!({"namespaces": [{"type": "network", "path": p}]});
                }
                if let Some(p) = seccomp {
                    spec["linux"]["seccomp"] =
                        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
                }
                std::fs::write(bundle.join("config.json"), spec.to_string()).unwrap();
                let o = cli(env, &["create", "--bundle", bundle.to_str().unwrap(), id]);
                if o.status.success() {
                    cli(env, &["start", id])
                } else {
                    o
                }
            }
            Door::Containerd => {
                let mounts: Vec<String> = binds
                    .iter()
                    .map(|(dst, src)| format!("type=bind,src={src},dst={dst},options=rbind:rw"))
                    .collect();
                let mut args = vec!["run", "-d", "--runtime", RUNTIME];
                for m in &mounts {
                    args.extend(["--mount", m.as_str()]);
                }
                let with_ns = netns.map(|p| format!("network:{p}"));
                if let Some(ns) = &with_ns {
                    args.extend(["--with-ns", ns.as_str()]);
                }
                let profile = seccomp.map(|p| p.display().to_string());
                if let Some(p) = &profile {
                    args.extend(["--seccomp", "--seccomp-profile", p.as_str()]);
                }
                args.extend([BUSYBOX_IMAGE, id, "sh", "-c", script]);
                env.ctrd.ctr_in(NS, &args)
            }
        };
        if out.status.success() {
            Ok(w)
        } else {
            Err(text(&out))
        }
    }
}

impl Workload<'_> {
    /// Runs `script` next to the workload; its stdout when it exits 0.
    fn exec(&self, script: &str) -> Option<String> {
        let o = match self.door {
            Door::Cli => cli(self.env, &["exec", &self.id, "--", "sh", "-c", script]),
            Door::Containerd => self.env.ctrd.ctr_in(
                NS,
                &[
                    "task",
                    "exec",
                    "--exec-id",
                    &format!("x{}", Instant::now().elapsed().as_nanos()),
                    &self.id,
                    "sh",
                    "-c",
                    script,
                ],
            ),
        };
        o.status
            .success()
            .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
    }
}

impl Drop for Workload<'_> {
    fn drop(&mut self) {
        match self.door {
            Door::Cli => {
                let _ = cli(self.env, &["delete", "--force", &self.id]);
            }
            Door::Containerd => {
                let _ = self
                    .env
                    .ctrd
                    .ctr_in(NS, &["task", "kill", "-s", "SIGKILL", &self.id]);
                let _ = self
                    .env
                    .ctrd
                    .ctr_in(NS, &["task", "delete", "-f", &self.id]);
                let _ = self.env.ctrd.ctr_in(NS, &["containers", "rm", &self.id]);
            }
        }
    }
}

/// The IOPS limit the test sets: low enough that a TCG guest's direct
/// reads exceed it several times over.
const THROTTLE_IOPS: u32 = 30;

/// The guest's O_DIRECT 4 KiB read rate on `/data/r` (8 readers at once,
/// 8 reads each, each in a region of its own: one `dd` per reader, not a
/// process per read).
fn direct_read_iops(w: &Workload<'_>) -> f64 {
    let script = "[ -f /data/r ] || { dd if=/dev/zero of=/data/r bs=4096 count=256 2>/dev/null && sync; }; \
         s=$(cut -d' ' -f1 /proc/uptime); \
         for r in 0 1 2 3 4 5 6 7; do \
           dd if=/data/r of=/dev/null bs=4096 count=8 skip=$((r * 32)) iflag=direct 2>/dev/null & \
         done; wait; \
         e=$(cut -d' ' -f1 /proc/uptime); echo $s $e";
    let out = w.exec(script).expect("direct reads in the guest");
    let t: Vec<f64> = out
        .split_whitespace()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{out:?}")))
        .collect();
    f64::from(8 * 8) / (t[1] - t[0]).max(0.01)
}

/// Whether a QEMU of this test has `dev` open.
fn qemu_has_open(root: &Path, dev: &Path) -> bool {
    qemus_under(root).into_iter().any(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l == dev))
    })
}

/// The file behind loop device `dev`: what QEMU opens in its place.
fn backing_of(dev: &Path) -> PathBuf {
    crust_blockdev::loop_status(dev)
        .unwrap()
        .unwrap_or_else(|| panic!("{dev:?} is bound to no file"))
        .backing_file
}

/// Samples [`qemu_has_open`] every 10 ms until [`FdWatch::seen`].
struct FdWatch {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<bool>,
}

impl FdWatch {
    fn start(root: &Path, dev: &Path) -> FdWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, root, dev) = (stop.clone(), root.to_path_buf(), dev.to_path_buf());
        let thread = std::thread::spawn(move || {
            let file = backing_of(&dev);
            while !s.load(Ordering::SeqCst) {
                if qemu_has_open(&root, &dev) || qemu_has_open(&root, &file) {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            false
        });
        FdWatch { stop, thread }
    }

    fn seen(self) -> bool {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

/// `open(dev, O_EXCL)` on the host, as mkfs, e2fsck and mount do.
fn exclusive_open(dev: &Path) -> rustix::io::Result<rustix::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    rustix::fs::open(
        dev,
        OFlags::RDONLY | OFlags::EXCL | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// `mount -o ro,noload dev dir`; Err(mount's message) when refused.
fn host_mount_ro(dev: &Path, dir: &Path) -> Result<crust_blockdev::MountGuard, String> {
    std::fs::create_dir_all(dir).unwrap();
    let o = Command::new("mount")
        .args(["-o", "ro,noload"])
        .arg(dev)
        .arg(dir)
        .output()
        .unwrap();
    if o.status.success() {
        Ok(crust_blockdev::MountGuard::new(dir))
    } else {
        Err(text(&o))
    }
}

/// (source, fs type) of the topmost mount at `p`.
fn mount_at(p: &Path) -> Option<(String, String)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let sep = f.iter().position(|x| *x == "-")?;
        (Path::new(f[4]) == p).then(|| (f[sep + 2].to_string(), f[sep + 1].to_string()))
    })
}

/// The one body both doors run.
async fn the_guest_holds_its_devices(door: Door) {
    let t0 = Instant::now();
    let phase = |what: &str| eprintln!("[{door:?} {:>6.1}s] {what}", t0.elapsed().as_secs_f64());
    let env = Env::start(NS);
    let _leftovers = Leftovers {
        pool: env.dir.path().join("pool"),
        cgroup_parent: None,
    };
    // This node and the resizer's node serve each other's peer ports.
    let key = env.dir.path().join("peer-key");
    std::fs::write(&key, "plug-doors-peer-key-of-at-least-32-bytes\n").unwrap();
    let (here, there) = (common::free_port(), common::free_port());
    let plugin =
        common::start_plugin_with(&env, &common::peer_flags(here, &[here, there], &key)).await;
    let csi = plugin.csi().await;
    let uid = "31000000-0000-4000-8000-000000000031";
    let deferred_vol = common::publish(&env, &csi, "pvc-deferred", uid, true).await;
    let deferred = deferred_vol.target.clone();
    let auto_vol = common::publish(&env, &csi, "pvc-auto", uid, false).await;
    let auto = auto_vol.target.clone();
    let records = crust_handoff::Store::new(
        crust_handoff::Layout::Crust,
        env.crust_root.clone(),
        Default::default(),
    )
    .unwrap();
    let claimant = |t: &str| records.inspect(t).ok().and_then(|s| s.claimant);
    let logs = || {
        format!(
            "{}\n--- crust-csi\n{}",
            env.logs(),
            plugin.proc.log_tail(4000)
        )
    };
    phase("published");

    // A record that names its device by path alone (as Kata's CSI driver
    // writes them, or an older crust): the first plug records the identity
    // it finds, which must be the one crust-ops wrote, and the stale record
    // at the end is refused by it.
    let written = records.inspect(&deferred).unwrap().mount_info.metadata
        [crust_handoff::DEVICE_IDENTITY_KEY]
        .clone();
    let file = records
        .record_dir(&deferred)
        .unwrap()
        .join("mountInfo.json");
    let mut mi: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    mi["metadata"]
        .as_object_mut()
        .unwrap()
        .remove(crust_handoff::DEVICE_IDENTITY_KEY);
    std::fs::write(&file, serde_json::to_vec(&mi).unwrap()).unwrap();
    let pinned = || {
        records
            .inspect(&deferred)
            .unwrap()
            .mount_info
            .metadata
            .get(crust_handoff::DEVICE_IDENTITY_KEY)
            .cloned()
    };
    assert_eq!(pinned(), None);

    // --- while the guest uses both volumes, the host cannot have them -------
    let w = door
        .start(
            &env,
            "user",
            &[("/data", &deferred), ("/auto", &auto)],
            "echo d > /data/f && echo a > /auto/f && sync && exec sleep 600",
        )
        .unwrap_or_else(|e| panic!("{door:?}: start: {e}\n{}", logs()));
    let until = Instant::now() + Duration::from_secs(60);
    let mounted = loop {
        let out = w.exec(
            "cat /data/f /auto/f && awk '$2==\"/data\"||$2==\"/auto\"{print $3}' /proc/mounts",
        );
        if let Some(o) = out.filter(|o| o.starts_with("d\na\n")) {
            break o;
        }
        assert!(Instant::now() < until, "{door:?}: never wrote\n{}", logs());
        std::thread::sleep(Duration::from_millis(200));
    };
    // Block devices in the guest, not a virtio-fs fallback.
    assert_eq!(mounted, "d\na\next4\next4\n", "{door:?}\n{}", logs());
    // Both volumes on their loop device's backing file, with O_DIRECT
    // and the host's best engine, as the shim's log says (issue 28).
    if let Door::Containerd = door {
        let want = format!(
            "QEMU does its I/O on the loop device's backing file, {}",
            crust_qmp::BlockIo::host_best()
        );
        let said = env.shim_log_all().matches(&want).count();
        assert_eq!(said, 2, "{want:?} in the shim's log\n{}", logs());
    }
    assert_eq!(
        pinned().as_ref(),
        Some(&written),
        "{door:?}: the first plug records the device's identity"
    );
    phase("running");

    // --- a host tool's second loop device on the live volume's pool file
    // (issue 42, item 7): the next stats poll says abnormal, naming it.
    let live = PathBuf::from(records.inspect(&deferred).unwrap().mount_info.device);
    let second = Command::new("losetup")
        .args(["-f", "--show", "--read-only"])
        .arg(backing_of(&live))
        .output()
        .unwrap();
    assert!(second.status.success(), "{}", text(&second));
    let second = String::from_utf8_lossy(&second.stdout).trim().to_string();
    let stats = cli(&env, &["crust", "stats", &deferred]);
    let _ = Command::new("losetup").args(["-d", &second]).status();
    let said: serde_json::Value = serde_json::from_slice(&stats.stdout)
        .unwrap_or_else(|e| panic!("{door:?}: stats: {e}: {}", text(&stats)));
    let condition = &said["volume_condition"];
    assert!(
        condition["abnormal"] == true
            && condition["message"]
                .as_str()
                .unwrap_or_default()
                .contains(&second),
        "{door:?}: stats with {second} on the pool file: {said}"
    );
    phase("second loop reported");

    // --- online expansion through this door: ControllerExpand + NodeExpand
    // of the deferred and the handed-over volume grow each filesystem in
    // the guest (crust_ops asks the runtime CLI the door recorded).
    let df_total = |dir: &str| -> u64 {
        let out = w
            .exec(&format!("df -k {dir} | tail -1"))
            .unwrap_or_else(|| panic!("{door:?}: df {dir}\n{}", logs()));
        out.split_whitespace()
            .nth(1)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap()
            * 1024
    };
    let grown = 128 * common::MIB;
    let volumes = [
        (
            deferred_vol.volume_id.clone(),
            deferred.clone(),
            Some(deferred_vol.staging.clone()),
            "/data",
            true,
        ),
        (
            auto_vol.volume_id.clone(),
            auto.clone(),
            Some(auto_vol.staging.clone()),
            "/auto",
            false,
        ),
    ];
    for (id, target, staging, dir, deferred_ops) in volumes {
        let before = df_total(dir);
        csi.controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: grown as i64,
                limit_bytes: 0,
            }),
            volume_capability: Some(common::mount_cap(None)),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("{door:?}: ControllerExpandVolume {dir}: {e}\n{}", logs()));
        csi.node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: id,
            volume_path: target,
            capacity_range: Some(csi::CapacityRange {
                required_bytes: grown as i64,
                limit_bytes: 0,
            }),
            staging_target_path: staging.unwrap_or_default(),
            volume_capability: Some(common::mount_cap(None)),
            defer_fs_ops: deferred_ops,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("{door:?}: NodeExpandVolume {dir}: {e}\n{}", logs()));
        let after = df_total(dir);
        assert!(
            after > before + 50 * common::MIB,
            "{door:?}: {dir} in the guest grew {before} -> {after}\n{}",
            logs()
        );
    }
    phase("expanded");

    // --- live QoS through this door (issue 28): ControllerModifyVolume, as
    // the resizer sends for a VolumeAttributesClass, reaches the sandbox
    // serving the volume and the guest's direct reads slow to the limit.
    // The unthrottled rate is bound by the guest's CPU (a TCG guest
    // spawning dd): on a loaded host one sample can fall near the limit,
    // so take the best of up to three before judging.
    let mut unthrottled = direct_read_iops(&w);
    for _ in 0..2 {
        if unthrottled > 2.0 * f64::from(THROTTLE_IOPS) {
            break;
        }
        unthrottled = unthrottled.max(direct_read_iops(&w));
    }
    let modify = csi::ControllerModifyVolumeRequest {
        volume_id: deferred_vol.volume_id.clone(),
        mutable_parameters: [("iops".to_string(), THROTTLE_IOPS.to_string())].into(),
        ..Default::default()
    };
    let _resizer_node = match door {
        Door::Cli => {
            csi.controller_modify_volume(modify)
                .await
                .map(drop)
                .unwrap_or_else(|e| panic!("{door:?}: ModifyVolume: {e}\n{}", logs()));
            None
        }
        Door::Containerd => {
            let other =
                common::start_other_node(&env, &common::peer_flags(there, &[here, there], &key))
                    .await;
            other.csi().await.controller_modify_volume(modify).await.map(drop)
                .unwrap_or_else(|e| panic!("{door:?}: ModifyVolume through the resizer's node: {e}\n{}\n--- resizer's node\n{}", logs(), other.proc.log_tail(3000)));
            Some(other)
        }
    };
    let throttled = direct_read_iops(&w);
    eprintln!("[{door:?}] direct reads: {unthrottled:.0} IOPS, at {THROTTLE_IOPS}: {throttled:.0}");
    let limit = THROTTLE_IOPS as f64;
    assert!(
        unthrottled > 2.0 * limit,
        "{door:?}: unthrottled {unthrottled:.0} IOPS cannot tell a {limit} limit"
    );
    assert!(
        throttled <= 1.2 * limit,
        "{door:?}: {throttled:.0} IOPS after ModifyVolume(iops={limit})\n{}",
        logs()
    );
    phase("throttled");

    let dev = |t: &str| -> PathBuf {
        PathBuf::from(
            records
                .inspect(t)
                .unwrap_or_else(|e| panic!("{t}: {e}"))
                .mount_info
                .device,
        )
    };
    let devices = [dev(&deferred), dev(&auto)];
    for (d, t) in devices.iter().zip([&deferred, &auto]) {
        assert_eq!(claimant(t).as_deref(), Some("user"), "{door:?}: {t}");
        // QEMU skips the loop driver: it has the backing file, and keeps
        // a copy of the runtime's hold on the device.
        assert!(
            qemu_has_open(&env.runtime_root, &backing_of(d)),
            "{door:?}: QEMU has the backing file of {d:?}"
        );
        assert!(
            qemu_has_open(&env.runtime_root, d),
            "{door:?}: QEMU keeps {d:?} open"
        );
        let e = exclusive_open(d).expect_err("the host's O_EXCL open must fail");
        assert_eq!(e, rustix::io::Errno::BUSY, "{door:?}: {d:?}");
        let probe = env.dir.path().join("probe");
        if let Ok(m) = host_mount_ro(d, &probe) {
            drop(m);
            panic!("{door:?}: the host mounted {d:?} (ro,noload) while the guest had it");
        }
    }
    drop(w);
    for (d, t) in devices.iter().zip([&deferred, &auto]) {
        assert_eq!(claimant(t), None, "{door:?}: {t} released\n{}", logs());
        assert!(exclusive_open(d).is_ok(), "{door:?}: {d:?} free again");
    }
    assert!(
        qemus_under(&env.runtime_root).is_empty(),
        "{door:?}: no VM left"
    );
    phase("released");

    // --- teardown after a kill: QEMU dies under a running workload; the
    // door's delete still releases the holds, the claims and the
    // handed-over volume (one teardown routine for both doors), and what
    // the guest synced before is on the device.
    let w = door
        .start(
            &env,
            "killed",
            &[("/data", &deferred), ("/auto", &auto)],
            "echo k > /data/k && echo k > /auto/k && sync && exec sleep 600",
        )
        .unwrap_or_else(|e| panic!("{door:?}: start: {e}\n{}", logs()));
    let until = Instant::now() + Duration::from_secs(60);
    while w.exec("cat /data/k /auto/k").as_deref() != Some("k\nk\n") {
        assert!(Instant::now() < until, "{door:?}: never wrote\n{}", logs());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(w.exec("sync").is_some());
    let qemus = qemus_under(&env.runtime_root);
    assert_eq!(qemus.len(), 1, "{door:?}: one VM");
    for pid in &qemus {
        let pid = rustix::process::Pid::from_raw(*pid).unwrap();
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
    let until = Instant::now() + Duration::from_secs(30);
    while !qemus_under(&env.runtime_root).is_empty() {
        assert!(Instant::now() < until, "{door:?}: QEMU outlived SIGKILL");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(w);
    // containerd's side: a forced delete right after the VM's death was
    // seen once (1 in 4 full runs) not to reach the shim; kubelet retries
    // its cleanup, and so does this check, saying how often it had to.
    if let Door::Containerd = door {
        let until = Instant::now() + Duration::from_secs(30);
        let mut retries = 0;
        while [&deferred, &auto].iter().any(|t| claimant(t).is_some()) && Instant::now() < until {
            retries += 1;
            let _ = env.ctrd.ctr_in(NS, &["task", "delete", "-f", "killed"]);
            let _ = env.ctrd.ctr_in(NS, &["containers", "rm", "killed"]);
            std::thread::sleep(Duration::from_millis(500));
        }
        eprintln!("[{door:?}] cleanup after the kill retried {retries} time(s)");
    }
    for (d, t) in devices.iter().zip([&deferred, &auto]) {
        assert_eq!(
            claimant(t),
            None,
            "{door:?}: {t} released after the kill\n{}",
            logs()
        );
        assert!(
            exclusive_open(d).is_ok(),
            "{door:?}: {d:?} free after the kill"
        );
        let probe = env.dir.path().join("after-kill");
        // `ro` without `noload`: the journal the kill left is replayed.
        std::fs::create_dir_all(&probe).unwrap();
        let o = Command::new("mount")
            .args(["-o", "ro"])
            .arg(d)
            .arg(&probe)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{door:?}: mounting {d:?} after the kill: {}",
            text(&o)
        );
        let m = crust_blockdev::MountGuard::new(&probe);
        assert_eq!(
            std::fs::read(probe.join("k")).unwrap(),
            b"k\n",
            "{door:?}: {d:?}"
        );
        drop(m);
    }
    phase("released after a kill");

    // --- the deferred volume's device mounted on the host after publish ---
    let host_view = env.dir.path().join("host-view");
    std::fs::create_dir_all(&host_view).unwrap();
    let dev = &devices[0];
    let st = Command::new("mount")
        .arg(dev)
        .arg(&host_view)
        .status()
        .unwrap();
    assert!(st.success());
    let _host_mount = crust_blockdev::MountGuard::new(&host_view);
    std::fs::write(host_view.join("host-file"), b"host").unwrap();
    let watch = FdWatch::start(&env.runtime_root, dev);
    let refused = door.start(&env, "intruder", &[("/data", &deferred)], "exec sleep 600");
    let seen = watch.seen();
    let err = match refused {
        Ok(w) => {
            drop(w);
            panic!(
                "{door:?}: a pod started on a device the host has mounted\n{}",
                logs()
            );
        }
        Err(e) => e,
    };
    assert!(
        err.contains(host_view.to_str().unwrap()),
        "{door:?}: the error names the mount: {err}\n{}",
        logs()
    );
    assert!(!seen, "{door:?}: QEMU opened {dev:?} (blockdev-add)");
    assert_eq!(
        mount_at(&host_view),
        Some((dev.display().to_string(), "ext4".into())),
        "{door:?}: the host mount stays"
    );
    assert_eq!(std::fs::read(host_view.join("host-file")).unwrap(), b"host");
    assert_eq!(claimant(&deferred), None, "{door:?}: no claim left");
    assert!(
        qemus_under(&env.runtime_root).is_empty(),
        "{door:?}: no VM left"
    );
    if let Door::Containerd = door {
        let _ = env.ctrd.ctr_in(NS, &["containers", "rm", "intruder"]);
    }
    phase("refused");

    // --- a stale record (issue 42, item 2): the deferred volume's loop is
    // detached by an operator and its path goes to another volume; the
    // record still names the path. The start is refused naming both
    // identities, and the other volume is not touched.
    drop(_host_mount);
    let record_id = records.inspect(&deferred).unwrap().mount_info.metadata
        [crust_handoff::DEVICE_IDENTITY_KEY]
        .clone();
    let detached = Command::new("losetup").arg("-d").arg(dev).status().unwrap();
    assert!(detached.success());
    let other = env.dir.path().join("pool").join("other-volume.img");
    let st = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "truncate -s 64M {o} && mkfs.ext4 -q -E root_owner=0:0 {o} && losetup {d} {o}",
            o = other.display(),
            d = dev.display()
        ))
        .status()
        .unwrap();
    assert!(st.success(), "{door:?}: the other volume on {dev:?}");
    let sum = |p: &Path| {
        use sha2::Digest;
        sha2::Sha256::digest(std::fs::read(p).unwrap())
    };
    let before = sum(&other);
    let stale = door.start(
        &env,
        "stale",
        &[("/data", &deferred)],
        "echo x > /data/x; sync; exec sleep 600",
    );
    let err = match stale {
        Ok(w) => {
            drop(w);
            panic!(
                "{door:?}: a stale record plugged another volume\n{}",
                logs()
            );
        }
        Err(e) => e,
    };
    let found = crust_blockdev::identity_of(
        rustix::fs::open(dev, rustix::fs::OFlags::RDONLY, rustix::fs::Mode::empty())
            .unwrap()
            .as_fd(),
        dev,
    )
    .unwrap()
    .to_string();
    assert_ne!(found, record_id);
    assert!(
        err.contains(&record_id) && err.contains(&found),
        "{door:?}: the refusal names both identities ({record_id}, {found}): {err}"
    );
    assert_eq!(
        sum(&other),
        before,
        "{door:?}: the other volume is untouched"
    );
    assert_eq!(claimant(&deferred), None, "{door:?}: no claim left");
    assert!(
        qemus_under(&env.runtime_root).is_empty(),
        "{door:?}: no VM left"
    );
    if let Door::Containerd = door {
        let _ = env.ctrd.ctr_in(NS, &["containers", "rm", "stale"]);
    }
    phase("stale record refused");
}

per_door!(
    the_guest_holds_its_devices:
    cli_door_holds_the_device_while_the_guest_uses_it,
    containerd_door_holds_the_device_while_the_guest_uses_it
);

/// Both doors take a network namespace through crust-sandbox's `net`: one
/// with netfilter rules is refused naming them and nothing is attached;
/// a CNI namespace is mirrored (the guest's `eth0` has CNI's address and
/// route and reaches CNI's gateway) and left as CNI made it after the
/// workload is removed. Budget: per door containerd + one TCG boot, ~15 s.
async fn the_guest_takes_the_network_namespace(door: Door) {
    let env = Env::start(NS);
    let tag = format!("{door:?}").to_lowercase();
    let cni = crust_testkit::CniNamespace::new(env.dir.path(), &tag);
    let before = cni.links();
    let in_ns = |args: &[&str]| {
        let o = Command::new("nsenter")
            .arg(format!("--net={}", cni.path()))
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{args:?}: {}", text(&o));
    };

    in_ns(&[
        "iptables-nft",
        "-A",
        "INPUT",
        "-p",
        "tcp",
        "--dport",
        "9",
        "-j",
        "DROP",
    ]);
    let err = door
        .start_in(
            &env,
            &format!("{tag}-rules"),
            &[],
            "sleep 600",
            Some(&cni.path()),
        )
        .err()
        .unwrap_or_else(|| panic!("{door:?}: a namespace with netfilter rules was taken"));
    assert!(err.contains("INPUT"), "{door:?}: {err}\n{}", env.logs());
    assert_eq!(cni.links(), before, "{door:?}: refused, yet attached");
    if let Door::Containerd = door {
        let _ = env
            .ctrd
            .ctr_in(NS, &["containers", "rm", &format!("{tag}-rules")]);
    }
    in_ns(&["nft", "delete", "table", "ip", "filter"]);

    let w = door
        .start_in(
            &env,
            &format!("{tag}-net"),
            &[],
            "sleep 600",
            Some(&cni.path()),
        )
        .unwrap_or_else(|e| panic!("{door:?}: {e}\n{}", env.logs()));
    assert!(cni.links().len() > before.len(), "{door:?}: no tap");
    let addrs = w.exec("ip -o -4 addr show dev eth0").unwrap_or_default();
    assert!(addrs.contains(&cni.address), "{door:?}: {addrs}");
    let routes = w.exec("ip -4 route").unwrap_or_default();
    assert!(
        routes.contains(&format!("default via {}", cni.gateway)),
        "{door:?}: {routes}"
    );
    assert!(
        w.exec(&format!("ping -c 2 -W 5 {}", cni.gateway)).is_some(),
        "{door:?}: the gateway is not reached"
    );
    drop(w);
    assert_eq!(
        cni.links(),
        before,
        "{door:?}: the namespace is not as CNI left it"
    );
}

per_door!(
    the_guest_takes_the_network_namespace:
    cli_door_takes_the_network_namespace,
    containerd_door_takes_the_network_namespace
);

/// The one seccomp body both doors run: a profile denying `mkdir` with
/// EPERM; the workload records what it met.
async fn the_workload_runs_under_its_seccomp_profile(door: Door) {
    let env = Env::start(NS);
    let profile = env.dir.path().join("no-mkdir.json");
    std::fs::write(
        &profile,
        serde_json::json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "architectures": ["SCMP_ARCH_X86_64"],
            "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]
        })
        .to_string(),
    )
    .unwrap();
    let id = format!("filtered-{door:?}").to_lowercase();
    let w = door
        .start_filtered(
            &env,
            &id,
            "if mkdir /tmp/probe-dir 2>/tmp/probe-err; then echo made; else echo refused; fi \
             > /tmp/probe; touch /tmp/probe-file && echo touched >> /tmp/probe; exec sleep 600",
            &profile,
        )
        .unwrap_or_else(|e| panic!("{door:?}: start: {e}\n{}", env.logs()));
    let until = Instant::now() + Duration::from_secs(60);
    let seen = loop {
        if let Some(o) = w
            .exec("cat /tmp/probe /tmp/probe-err")
            .filter(|o| o.contains("touched"))
        {
            break o;
        }
        assert!(
            Instant::now() < until,
            "{door:?}: the workload never ran\n{}",
            env.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        seen.starts_with("refused\ntouched\n") && seen.contains("not permitted"),
        "{door:?}: mkdir under a profile denying it with EPERM: {seen:?}"
    );
}

per_door!(
    the_workload_runs_under_its_seccomp_profile:
    cli_door_runs_the_workload_under_its_seccomp_profile,
    containerd_door_runs_the_workload_under_its_seccomp_profile
);
