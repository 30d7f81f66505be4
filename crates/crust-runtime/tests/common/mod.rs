//! Helpers of the runtime's guest tests: temp roots, loop-backed disks
//! (`crust_testkit::LoopDisk`), hand-off records, OCI bundles, and the
//! runtime binary with a wall-clock limit. Everything is released by guards
//! on drop (also on panic).

#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crust_blockdev::FsType;
use crust_handoff::{Layout, MountInfo, Policy, Store};
use crust_testkit::LoopDisk;
pub use rustix::process::Signal;
use serde_json::{Value, json};
use tempfile::TempDir;

pub const MIB: u64 = 1 << 20;
/// No runtime command may take longer than this in a test.
const CMD_LIMIT: Duration = Duration::from_secs(240);

pub const BIN: &str = env!("CARGO_BIN_EXE_crust-runtime");

/// Temp roots for one test: sandbox state, both hand-off layouts, a fake
/// kubelet pods dir, disk files.
pub struct Env {
    pub dir: TempDir,
    pub root: PathBuf,
    pub crust: PathBuf,
    pub kata: PathBuf,
    pub pods: PathBuf,
    pub files: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// `--timeout-ms` given to every command (and so to the shims).
    pub timeout_ms: u64,
    /// `--accel` given to every command (`tcg` unless a test proves the
    /// accelerator choice).
    pub accel: String,
    /// More global flags given to every command.
    pub extra_args: Vec<String>,
}

impl Env {
    pub fn new() -> Env {
        crust_testkit::require_root();
        crust_testkit::ensure_guest_image();
        let (kernel, initrd) = crust_testkit::guest_image();
        let dir = tempfile::Builder::new()
            .prefix("crust-rt-")
            .tempdir()
            .unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let p = dir.path().to_path_buf();
        for d in ["files", "pods"] {
            std::fs::create_dir_all(p.join(d)).unwrap();
        }
        Env {
            root: p.join("run"),
            crust: p.join("crust"),
            kata: p.join("kata"),
            pods: p.join("pods"),
            files: p.join("files"),
            kernel,
            initrd,
            timeout_ms: 20_000,
            accel: "tcg".into(),
            extra_args: Vec::new(),
            dir,
        }
    }

    pub fn global_args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--root".into(),
            self.root.display().to_string(),
            "--crust-root".into(),
            self.crust.display().to_string(),
            "--kata-root".into(),
            self.kata.display().to_string(),
            "--pods-layer-stop".into(),
            self.pods.display().to_string(),
            "--guest-kernel".into(),
            self.kernel.display().to_string(),
            "--guest-initrd".into(),
            self.initrd.display().to_string(),
            "--kata-shim-dirs".into(),
            self.kata_shim_dirs(),
            "--accel".into(),
            self.accel.clone(),
            "--timeout-ms".into(),
            self.timeout_ms.to_string(),
        ];
        a.extend(self.extra_args.iter().cloned());
        a
    }

    /// Where this env's sandboxes link their shim for Kata's CLI (in the
    /// order Kata's Go CLI looks): `<tmp>/vc-sbs,<tmp>/kata-run`.
    pub fn kata_shim_dirs(&self) -> String {
        format!(
            "{},{}",
            self.dir.path().join("vc-sbs").display(),
            self.dir.path().join("kata-run").display()
        )
    }

    /// Runs the runtime with this env's roots; killed after [`CMD_LIMIT`].
    pub fn run(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(BIN);
        cmd.args(self.global_args()).args(args);
        run_limited(cmd, CMD_LIMIT)
    }

    /// [`Env::run`] with extra environment variables (settings a test
    /// gives as `CRUST_RUNTIME_*` rather than as flags).
    pub fn run_with_vars(&self, vars: &[(&str, &Path)], args: &[&str]) -> Output {
        let mut cmd = Command::new(BIN);
        for (k, v) in vars {
            cmd.env(k, v);
        }
        cmd.args(self.global_args()).args(args);
        run_limited(cmd, CMD_LIMIT)
    }

    /// Runs with this env's settings in `CRUST_RUNTIME_*` variables
    /// instead of flags, as crust_ops runs the CLI (the per-poll verbs then
    /// take `crust_runtime::poll`'s path). Extra args are not carried.
    pub fn run_from_env(&self, args: &[&str]) -> Output {
        self.run_from_env_with(Path::new(BIN), args)
    }

    /// [`Env::run_from_env`] with another runtime CLI binary.
    pub fn run_from_env_with(&self, bin: &Path, args: &[&str]) -> Output {
        let mut cmd = Command::new(bin);
        cmd.env_remove("RUST_LOG").args(args);
        let g = self.global_args();
        for pair in g[..g.len() - self.extra_args.len()].chunks(2) {
            let flag = pair[0].strip_prefix("--").expect("a --flag");
            let var = format!("CRUST_RUNTIME_{}", flag.replace('-', "_").to_uppercase());
            cmd.env(var, &pair[1]);
        }
        run_limited(cmd, CMD_LIMIT)
    }

    /// Runs and expects success; returns stdout.
    #[track_caller]
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "crust-runtime {args:?} failed ({}):\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs and expects failure; returns stderr.
    #[track_caller]
    pub fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            !out.status.success(),
            "crust-runtime {args:?} unexpectedly succeeded:\nstdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stderr).unwrap()
    }

    pub fn json(&self, args: &[&str]) -> Value {
        let s = self.ok(args);
        serde_json::from_str(&s).unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}): {s}"))
    }

    /// `<pods>/<uid>/volumes/kubernetes.io~csi/<pv>/mount` (not created:
    /// with deferral the target stays an empty path on the host).
    pub fn target(&self, uid: &str, pv: &str) -> String {
        self.pods
            .join(uid)
            .join("volumes/kubernetes.io~csi")
            .join(pv)
            .join("mount")
            .display()
            .to_string()
    }

    pub fn store(&self, layout: Layout) -> Store {
        let root = match layout {
            Layout::Crust => &self.crust,
            Layout::Kata => &self.kata,
        };
        Store::new(layout, root.clone(), Policy::default()).unwrap()
    }

    pub fn stage(&self, layout: Layout, target: &str, mi: &MountInfo) {
        self.store(layout).stage(target, mi).unwrap();
    }

    /// A sparse `files/<name>` of `size` bytes on a loop device, with a fresh
    /// `fstype` filesystem. Detached on drop.
    pub fn disk(&self, name: &str, size: u64, fstype: FsType) -> LoopDisk {
        LoopDisk::with_fs(self.files.join(name), size, fstype)
    }

    /// This env's settings as a deployment gives them to the runtime CLI
    /// that crust_ops runs (the binary a sandbox records as its
    /// `runtime-cli`, started without flags): `CRUST_RUNTIME_*`, passed
    /// through [`crust_ops::OpsConfig::cli_env`].
    pub fn runtime_env(&self) -> Vec<(String, String)> {
        let vars = [
            ("CRUST_RUNTIME_ROOT", self.root.display().to_string()),
            ("CRUST_RUNTIME_CRUST_ROOT", self.crust.display().to_string()),
            ("CRUST_RUNTIME_KATA_ROOT", self.kata.display().to_string()),
            (
                "CRUST_RUNTIME_PODS_LAYER_STOP",
                self.pods.display().to_string(),
            ),
            (
                "CRUST_RUNTIME_GUEST_KERNEL",
                self.kernel.display().to_string(),
            ),
            (
                "CRUST_RUNTIME_GUEST_INITRD",
                self.initrd.display().to_string(),
            ),
            ("CRUST_RUNTIME_ACCEL", "tcg".into()),
            ("CRUST_RUNTIME_KATA_SHIM_DIRS", self.kata_shim_dirs()),
            ("CRUST_RUNTIME_TIMEOUT_MS", self.timeout_ms.to_string()),
        ];
        vars.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    /// crust_ops for this env's CRUST-layout records (what the CSI plugin
    /// runs in process).
    pub fn ops(&self) -> crust_ops::CrustOps {
        crust_ops::CrustOps::new(crust_ops::OpsConfig {
            crust_root: self.crust.clone(),
            kata_root: self.kata.clone(),
            cli_timeout: Duration::from_secs(60),
            cli_env: self.runtime_env(),
            ..Default::default()
        })
        .unwrap()
    }

    /// `RuntimeUnstageVolume` through crust_ops, as NodeUnpublishVolume of a
    /// deferred publication does.
    pub fn unstage(&self, target: &str) -> Result<(), crust_ops::OpsError> {
        self.ops().unstage(target)
    }

    /// Writes `<dir>/<name>/config.json` and returns the bundle dir.
    pub fn bundle(&self, name: &str, args: &[&str], mounts: Vec<Value>) -> PathBuf {
        self.bundle_annotated(name, args, mounts, json!({}))
    }

    /// [`Env::bundle`] with OCI annotations.
    pub fn bundle_annotated(
        &self,
        name: &str,
        args: &[&str],
        mounts: Vec<Value>,
        annotations: Value,
    ) -> PathBuf {
        let dir = self.dir.path().join("bundles").join(name);
        std::fs::create_dir_all(dir.join("rootfs")).unwrap();
        let spec = json!({
            "ociVersion": "1.0.2",
            "process": {
                "terminal": false,
                "user": {"uid": 0, "gid": 0},
                "args": args,
                "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
                "cwd": "/"
            },
            "root": {"path": "rootfs"},
            "mounts": mounts,
            "annotations": annotations,
        });
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_vec_pretty(&spec).unwrap(),
        )
        .unwrap();
        dir
    }

    /// Starts managing sandbox `id` (deleted with --force on drop).
    pub fn sandbox(&self, id: &str) -> Sandbox<'_> {
        Sandbox {
            env: self,
            id: id.into(),
        }
    }

    /// The sandbox's state.json as written by the runtime.
    pub fn state_file(&self, id: &str) -> Value {
        serde_json::from_slice(&std::fs::read(self.root.join(id).join("state.json")).unwrap())
            .unwrap()
    }
}

/// An OCI bind mount.
pub fn bind(destination: &str, source: &str, ro: bool) -> Value {
    let mut opts = vec!["rbind", "rprivate"];
    if ro {
        opts.push("ro");
    }
    json!({"destination": destination, "type": "bind", "source": source, "options": opts})
}

pub fn run_limited(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn crust-runtime");
    let pid = child.id() as i32;
    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    loop {
        if let Ok(out) = rx.recv_timeout(Duration::from_millis(100)) {
            return out.expect("wait crust-runtime");
        }
        if start.elapsed() > limit {
            signal(pid, Signal::KILL);
            panic!("{cmd:?} did not finish within {limit:?}");
        }
    }
}

/// Deletes the sandbox with --force on drop; if that fails, kills what the
/// state file names so no QEMU outlives the test.
pub struct Sandbox<'a> {
    pub env: &'a Env,
    pub id: String,
}

impl Sandbox<'_> {
    pub fn state(&self) -> Value {
        self.env.json(&["state", &self.id])
    }

    /// Runs a command in the guest; returns (exit code, stdout, stderr).
    pub fn exec(&self, args: &[&str]) -> (i32, String, String) {
        let mut a = vec!["exec", self.id.as_str(), "--"];
        a.extend_from_slice(args);
        let out = self.env.run(&a);
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Like [`exec`](Self::exec), expecting exit 0; returns stdout.
    #[track_caller]
    pub fn sh(&self, script: &str) -> String {
        let (code, out, err) = self.exec(&["sh", "-c", script]);
        assert_eq!(code, 0, "guest `{script}` failed: {out}{err}");
        out
    }

    pub fn qemu_pid(&self) -> i32 {
        self.env.state_file(&self.id)["qemu"]["pid"]
            .as_i64()
            .unwrap() as i32
    }

    pub fn shim_pid(&self) -> i32 {
        self.env.state_file(&self.id)["shim"]["pid"]
            .as_i64()
            .unwrap() as i32
    }
}

impl Drop for Sandbox<'_> {
    fn drop(&mut self) {
        let dir = self.env.root.join(&self.id);
        if !dir.exists() {
            return;
        }
        let pids: Vec<i64> = std::fs::read(dir.join("state.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .map(|v| {
                ["shim", "qemu"]
                    .iter()
                    .filter_map(|k| v[k]["pid"].as_i64())
                    .collect()
            })
            .unwrap_or_default();
        // A stopped (SIGSTOP) QEMU would stall the orderly path.
        for p in &pids {
            signal(*p as i32, Signal::CONT);
        }
        let mut cmd = Command::new(BIN);
        cmd.args(self.env.global_args())
            .args(["delete", "--force", &self.id]);
        let out = run_limited(cmd, Duration::from_secs(90));
        if !out.status.success() || dir.exists() {
            eprintln!(
                "sandbox {}: delete --force failed: {}",
                self.id,
                String::from_utf8_lossy(&out.stderr)
            );
            for p in &pids {
                signal(*p as i32, Signal::KILL);
            }
            std::thread::sleep(Duration::from_millis(500));
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Sends `sig` to `pid` (gone already: ignored).
pub fn signal(pid: i32, sig: Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(pid, sig);
    }
}

/// Polls `f` until it returns Some, or panics after `within`.
#[track_caller]
pub fn wait_for<T>(what: &str, within: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < within,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn pid_alive(pid: i32) -> bool {
    crust_sandbox::sandbox::proc_start_time(pid).is_some()
}

/// `df -P -B1 <path>` parsed: (total, used, available).
pub fn parse_df(out: &str) -> (u64, u64, u64) {
    let line = out
        .lines()
        .nth(1)
        .unwrap_or_else(|| panic!("df output: {out}"));
    let f: Vec<&str> = line.split_whitespace().collect();
    (
        f[1].parse().unwrap(),
        f[2].parse().unwrap(),
        f[3].parse().unwrap(),
    )
}

/// `df -P -i <path>` parsed: (inodes, used, free).
pub fn parse_df_i(out: &str) -> (u64, u64, u64) {
    parse_df(out)
}

/// Asserts the host has no leftovers of this test (mounts under the temp
/// dir, loop devices on its files, QEMU processes using its roots).
pub fn assert_clean(env: &Env) {
    let dir = env.dir.path().display().to_string();
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(!mounts.contains(&dir), "mount left under {dir}:\n{mounts}");
    let loops = crust_blockdev::list_loops().unwrap();
    assert!(
        !loops
            .iter()
            .any(|l| l.backing_file.starts_with(env.dir.path())),
        "loop device left: {loops:?}"
    );
    assert_clean_processes(env);
}

/// No QEMU or shim of this test's roots is running.
pub fn assert_clean_processes(env: &Env) {
    let dir = env.dir.path().display().to_string();
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        if !p
            .file_name()
            .to_str()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        {
            continue;
        }
        let Ok(pid) = p.file_name().to_str().unwrap().parse::<i32>() else {
            continue;
        };
        if !pid_alive(pid) {
            continue; // a zombie waiting for init
        }
        if let Ok(cmd) = std::fs::read(p.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd);
            assert!(
                !(cmd.contains(&dir) && (cmd.contains("qemu") || cmd.contains("shim"))),
                "process left: {} {cmd}",
                p.path().display()
            );
        }
    }
}
