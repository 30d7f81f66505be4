//! The real stack for crustctl's end-to-end tests: a `crust-csi` process
//! (pool backend in a temp dir, real loop devices, real mkfs), the
//! `crust-runtime` binary with its roots in the same temp dir, and the
//! guest image. [`Stack`] undoes everything on drop, also when a test
//! fails: the plugin is stopped, sandboxes deleted (QEMU killed), mounts
//! under the temp dir unmounted, loop devices on the pool detached.
//!
//! A test process killed outright (SIGKILL, a stopped CI job) runs no
//! Drop: each stack holds a lock file for its lifetime, and the next
//! [`Stack::new`] on the machine releases whatever a stack whose lock is
//! free left behind (see [`reap_abandoned_stacks`]).

#![allow(dead_code)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crust_csi_client::Csi;
use crust_kubesim::flow::{FlowConfig, StepReport};
use crust_kubesim::runtime_cli::RuntimeCli;
use crust_proto::endpoint::Endpoint;
use crustctl::demo::PluginProcess;

pub const MIB: u64 = 1 << 20;

/// Builds the guest image with `guest/build-image.sh` when it is missing
/// (once across concurrently running test binaries).
pub fn ensure_guest_image() -> (PathBuf, PathBuf) {
    let dir = crust_testkit::guest_image_dir();
    let ready = || dir.join("vmlinuz").is_file() && dir.join("initramfs.cpio.gz").is_file();
    if !ready() {
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open("/tmp/crust-guest-image-build.lock")
            .unwrap();
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
        if !ready() {
            let script = crust_testkit::workspace_root().join("guest/build-image.sh");
            let st = Command::new("bash")
                .arg(&script)
                .stdin(Stdio::null())
                .status()
                .unwrap();
            assert!(st.success(), "{} failed", script.display());
        }
    }
    crust_testkit::guest_image()
}

/// Which hand-off layout the plugin writes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Layout {
    Crust,
    Kata,
}

pub struct Stack {
    pub root: PathBuf,
    pub pool: PathBuf,
    pub state: PathBuf,
    pub crust_root: PathBuf,
    pub kata_root: PathBuf,
    pub runtime_root: PathBuf,
    pub work: PathBuf,
    pub socket: PathBuf,
    pub layout: Layout,
    pub runtime: RuntimeCli,
    pub csi_bin: PathBuf,
    plugin: Option<PluginProcess>,
    /// Steps of every flow, for failure messages.
    pub steps: Arc<Mutex<Vec<StepReport>>>,
    /// Held (flock) while this stack lives: a free lock means abandoned.
    _owner: std::fs::File,
    // Dropped last: the temp dir itself.
    _dir: tempfile::TempDir,
}

/// Prefix of every stack's temp dir (in /tmp).
const STACK_PREFIX: &str = "crust-e2e-";
/// The owner lock in a stack's root.
const OWNER_LOCK: &str = ".owner.lock";

/// Creates `root/OWNER_LOCK` already locked: made under a temporary name,
/// locked, then renamed, so a reaper never sees it unlocked.
pub fn take_ownership(root: &Path) -> std::fs::File {
    let tmp = root.join(".owner.lock.new");
    let f = std::fs::File::create(&tmp).unwrap();
    rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
    std::fs::rename(&tmp, root.join(OWNER_LOCK)).unwrap();
    f
}

/// Releases what stacks of killed test processes left: for every
/// /tmp/crust-e2e-* whose owner lock can be taken (its process is gone),
/// the processes naming it are killed (QEMU, virtiofsd, shim, plugin),
/// mounts under it unmounted, loop devices on its pool detached, and the
/// dir removed once nothing is mounted below it. Live stacks hold their
/// lock; a dir without a lock file is not ours to judge and is left.
pub fn reap_abandoned_stacks() {
    let Ok(rd) = std::fs::read_dir("/tmp") else {
        return;
    };
    for e in rd.flatten() {
        if !e.file_name().to_string_lossy().starts_with(STACK_PREFIX) {
            continue;
        }
        let root = e.path();
        let Ok(lock) = std::fs::File::open(root.join(OWNER_LOCK)) else {
            continue;
        };
        if rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
            continue;
        }
        eprintln!(
            "reaping {}: left by a test process that was killed",
            root.display()
        );
        release(&root);
        if mounts_under(&root).is_empty() {
            let _ = std::fs::remove_dir_all(&root);
        }
    }
}

/// Kills the processes naming `root`, unmounts what is mounted under it
/// and detaches the loop devices backed by files in `root/pool`.
fn release(root: &Path) {
    let pids = pids_naming(root);
    for pid in &pids {
        if let Some(p) = rustix::process::Pid::from_raw(*pid) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
        }
    }
    if !pids.is_empty() {
        std::thread::sleep(Duration::from_millis(300));
    }
    for _ in 0..8 {
        let ms = mounts_under(root);
        if ms.is_empty() {
            break;
        }
        for m in ms.into_iter().rev() {
            if crust_blockdev::unmount(&m).is_err() {
                let _ = rustix::mount::unmount(&m, rustix::mount::UnmountFlags::DETACH);
            }
        }
    }
    let pool = root.join("pool");
    if let Ok(loops) = crust_blockdev::list_loops() {
        for l in loops
            .into_iter()
            .filter(|l| l.backing_file.starts_with(&pool))
        {
            let _ = crust_blockdev::detach(&l.path);
        }
    }
}

impl Stack {
    pub fn new(layout: Layout) -> Stack {
        crust_testkit::require_root();
        reap_abandoned_stacks();
        let dir = tempfile::Builder::new()
            .prefix(STACK_PREFIX)
            .tempdir_in("/tmp")
            .unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        let owner = take_ownership(&root);
        let (kernel, initrd) = ensure_guest_image();
        let rt_bin = std::fs::canonicalize(crust_testkit::workspace_bin("crust-runtime")).unwrap();
        let csi_bin = crust_testkit::workspace_bin("crust-csi");
        let mut runtime = RuntimeCli::new(&rt_bin);
        runtime.root = Some(root.join("runtime"));
        runtime.crust_root = Some(root.join("crust"));
        runtime.kata_root = Some(root.join("kata"));
        runtime.kata_shim_dirs = Some(format!(
            "{},{}",
            root.join("kata-shim/vc-sbs").display(),
            root.join("kata-shim/kata").display()
        ));
        runtime.pods_layer_stop = Some(root.join("work/kubelet/pods"));
        runtime.guest_kernel = Some(kernel);
        runtime.guest_initrd = Some(initrd);
        runtime.accel = Some("tcg".into());
        runtime.timeout = Duration::from_secs(240);
        // This stack's own Handover socket (the default is node-wide).
        runtime.handover_endpoint = Some(format!(
            "unix://{}",
            root.join("csi/handover.sock").display()
        ));
        Stack {
            pool: root.join("pool"),
            state: root.join("state"),
            crust_root: root.join("crust"),
            kata_root: root.join("kata"),
            runtime_root: root.join("runtime"),
            work: root.join("work"),
            socket: root.join("csi/csi.sock"),
            root,
            layout,
            runtime,
            csi_bin,
            plugin: None,
            steps: Arc::new(Mutex::new(Vec::new())),
            _owner: owner,
            _dir: dir,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Starts `crust-csi` (deferral enabled or disabled), the runtime's
    /// settings in its environment for the CLI it execs.
    pub async fn start_plugin(&mut self, deferral: bool) {
        assert!(self.plugin.is_none(), "plugin already running");
        std::fs::create_dir_all(self.root.join("csi")).unwrap();
        let rt = self.runtime.bin.clone();
        let args: Vec<OsString> = vec![
            "--endpoint".into(),
            self.endpoint().into(),
            "--node-id".into(),
            "e2e-node".into(),
            "--state-dir".into(),
            self.state.clone().into(),
            "--pool-dir".into(),
            self.pool.clone().into(),
            "--pool-capacity".into(),
            "3Gi".into(),
            "--health-ttl".into(),
            "0s".into(),
            "--deferral".into(),
            if deferral { "enabled" } else { "disabled" }.into(),
            "--handoff-layout".into(),
            match self.layout {
                Layout::Crust => "crust",
                Layout::Kata => "kata",
            }
            .into(),
            "--crust-root".into(),
            self.crust_root.clone().into(),
            "--kata-root".into(),
            self.kata_root.clone().into(),
            "--kata-runtime".into(),
            rt.into(),
            "--allowed-target-prefix".into(),
            self.work.join("kubelet/pods").into(),
            "--handover-endpoint".into(),
            format!("unix://{}", self.root.join("csi/handover.sock").display()).into(),
            "-v".into(),
            "debug".into(),
        ];
        let mut env = self.runtime.env();
        env.push(("NO_COLOR", "1".into()));
        let mut p =
            PluginProcess::spawn(&self.csi_bin, &args, &env, &self.root.join("crust-csi.log"))
                .unwrap();
        if let Err(e) = p.wait_ready(&self.socket, Duration::from_secs(30)).await {
            panic!("{e}\n{}", p.log_tail(4000));
        }
        self.plugin = Some(p);
    }

    /// SIGTERM and wait (a node plugin upgrade/downgrade).
    pub async fn stop_plugin(&mut self) {
        let mut p = self.plugin.take().expect("plugin running");
        let r = p.stop(Duration::from_secs(20)).await;
        assert!(r.is_ok(), "{r:?}\n{}", p.log_tail(4000));
    }

    /// SIGKILL, like a crash or an OOM kill: nothing gets to clean up.
    pub async fn crash_plugin(&mut self) {
        let mut p = self.plugin.take().expect("plugin running");
        let pid = rustix::process::Pid::from_raw(p.pid().unwrap() as i32).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
        let t0 = std::time::Instant::now();
        while p.exited().is_none() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "plugin survived SIGKILL"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn plugin_log(&self) -> String {
        crustctl::demo::log_tail(&self.root.join("crust-csi.log"), 6000)
    }

    pub async fn csi(&self) -> Csi {
        Csi::connect(
            &Endpoint::parse(&self.endpoint()).unwrap(),
            Duration::from_secs(120),
        )
        .await
        .unwrap()
    }

    /// A flow config in this stack's work dir, its steps recorded.
    pub fn flow_config(&self) -> FlowConfig {
        FlowConfig::new(&self.work, self.runtime.clone())
    }

    pub fn progress(&self) -> crust_kubesim::flow::Progress {
        let steps = self.steps.clone();
        Arc::new(move |s: &StepReport| {
            eprintln!("{}", s.line());
            steps.lock().unwrap().push(s.clone());
        })
    }

    /// `crustctl` (this crate's binary) against the plugin.
    pub fn crustctl(&self, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_crustctl"))
            .args(["--endpoint", &self.endpoint(), "--timeout", "120s"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// The runtime's global flags as crustctl flags.
    pub fn runtime_flags(&self) -> Vec<String> {
        let r = &self.runtime;
        let mut v = vec![
            "--runtime".to_string(),
            r.bin.display().to_string(),
            "--runtime-root".into(),
            self.runtime_root.display().to_string(),
            "--crust-root".into(),
            self.crust_root.display().to_string(),
            "--kata-root".into(),
            self.kata_root.display().to_string(),
            "--accel".into(),
            "tcg".into(),
        ];
        if let (Some(k), Some(i)) = (&r.guest_kernel, &r.guest_initrd) {
            v.extend([
                "--guest-kernel".into(),
                k.display().to_string(),
                "--guest-initrd".into(),
                i.display().to_string(),
            ]);
        }
        v
    }

    /// Entries of the hand-off roots (records).
    pub fn records(&self) -> Vec<PathBuf> {
        let mut v = Vec::new();
        for r in [&self.crust_root, &self.kata_root] {
            if let Ok(rd) = std::fs::read_dir(r) {
                v.extend(rd.flatten().map(|e| e.path()));
            }
        }
        v
    }

    pub fn mounts_under_root(&self) -> Vec<PathBuf> {
        mounts_under(&self.root)
    }

    pub fn loops_on_pool(&self) -> Vec<PathBuf> {
        crust_blockdev::list_loops()
            .unwrap()
            .into_iter()
            .filter(|l| l.backing_file.starts_with(&self.pool))
            .map(|l| l.path)
            .collect()
    }

    /// QEMU (or shim) processes naming this stack's root.
    pub fn vm_processes(&self) -> Vec<String> {
        processes_naming(&self.root)
            .into_iter()
            .filter(|c| c.contains("qemu") || c.contains(" shim "))
            .collect()
    }

    /// Nothing of this stack is left on the machine (the plugin may run).
    #[track_caller]
    pub fn assert_clean(&self) {
        assert_eq!(
            self.mounts_under_root(),
            Vec::<PathBuf>::new(),
            "mounts left"
        );
        assert_eq!(
            self.loops_on_pool(),
            Vec::<PathBuf>::new(),
            "loop devices left"
        );
        assert_eq!(
            self.vm_processes(),
            Vec::<String>::new(),
            "VM processes left"
        );
        assert_eq!(
            self.records(),
            Vec::<PathBuf>::new(),
            "hand-off records left"
        );
        let sandboxes: Vec<_> = std::fs::read_dir(&self.runtime_root)
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert_eq!(sandboxes, Vec::<PathBuf>::new(), "sandboxes left");
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // 1. the plugin
        drop(self.plugin.take());
        // 2. sandboxes (QEMU), through the runtime, then by force
        if let Ok(rd) = std::fs::read_dir(&self.runtime_root) {
            for e in rd.flatten() {
                let id = e.file_name().to_string_lossy().into_owned();
                let _ = Command::new(&self.runtime.bin)
                    .envs(self.runtime.env())
                    .args(["delete", "--force", &id])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
        // 3. what is left by force: processes, mounts, then loop devices
        release(&self.root);
    }
}

pub fn mounts_under(root: &Path) -> Vec<PathBuf> {
    crust_blockdev::mount_info()
        .unwrap()
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(root))
        .collect()
}

fn proc_entries() -> Vec<(i32, String)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if pid == std::process::id() as i32 {
            continue;
        }
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().next())
            .is_none_or(|s| s == "Z" || s == "X");
        if zombie {
            continue;
        }
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            v.push((pid, String::from_utf8_lossy(&c).replace('\0', " ")));
        }
    }
    v
}

pub fn processes_naming(root: &Path) -> Vec<String> {
    let needle = root.display().to_string();
    proc_entries()
        .into_iter()
        .filter(|(_, c)| c.contains(&needle))
        .map(|(p, c)| format!("{p}: {c}"))
        .collect()
}

fn pids_naming(root: &Path) -> Vec<i32> {
    let needle = root.display().to_string();
    proc_entries()
        .into_iter()
        .filter(|(_, c)| c.contains(&needle))
        .map(|(p, _)| p)
        .collect()
}

/// Figures of one usage unit in a NodeGetVolumeStats response.
pub fn usage(
    r: &crust_proto::csi::v1::NodeGetVolumeStatsResponse,
    unit: crust_proto::csi::v1::volume_usage::Unit,
) -> (u64, u64, u64) {
    let u = r
        .usage
        .iter()
        .find(|u| u.unit == unit as i32)
        .unwrap_or_else(|| panic!("no {unit:?} usage in {r:?}"));
    (u.total as u64, u.used as u64, u.available as u64)
}
