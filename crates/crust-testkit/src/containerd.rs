//! A private containerd for tests: Debian's `containerd` started with its
//! own `config.toml`, root, state, gRPC and ttrpc sockets in a temp dir,
//! never the machine's own instance.
//!
//! The config (version 2) enables the CRI plugin with `runc` as the default
//! runtime (the CRI plugin refuses to load without one) and a `crust`
//! handler of type `io.containerd.crust.v2`. Its CNI directories are its
//! own: empty (only host-network pods run) unless the options give a
//! network configuration, which is then served by Debian's CNI plugins
//! (`/usr/lib/cni`). The directory of the crust shim binary is put
//! first on containerd's `PATH`, which is where containerd looks for
//! `containerd-shim-crust-v2`.
//!
//! Drop stops everything the instance started: containerd, every shim it
//! spawned (found by the `-address <our socket>` on their command lines;
//! SIGTERM, then SIGKILL after a grace), and every mount left below the
//! temp dir (snapshots, rootfs mounts). Pods a failed test left running
//! also get CNI's DEL (their addresses, portmap rules and veths) and
//! lose their `cni-*` network namespace (and the taps in it).

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use rustix::mount::UnmountFlags;
use rustix::process::{Pid, Signal};
use tempfile::TempDir;

/// The CRI runtime handler name of the crust shim in the generated config.
pub const CRUST_HANDLER: &str = "crust";
/// The shim's runtime type (`containerd-shim-crust-v2` on PATH).
pub const CRUST_RUNTIME_TYPE: &str = "io.containerd.crust.v2";
/// Image refs built by `scripts/build-test-images.sh`.
pub const BUSYBOX_IMAGE: &str = "crust.test/busybox:latest";
pub const PAUSE_IMAGE: &str = "crust.test/pause:latest";
/// busybox httpd serving a page on port 80 as its entrypoint (critest's
/// web-server image): `webserver.tar` in [`test_images_dir`].
pub const WEBSERVER_IMAGE: &str = "crust.test/webserver:latest";
/// containerd's CRI namespace.
pub const CRI_NAMESPACE: &str = "k8s.io";

/// Bound on one `ctr` command in tests.
pub const CTR_TIMEOUT: Duration = Duration::from_secs(240);

/// How long containerd gets to answer `ctr version` after starting.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Options for [`Containerd::start`].
#[derive(Debug, Clone, Default)]
pub struct ContainerdOptions {
    /// Directory holding `containerd-shim-crust-v2` (put first on PATH).
    pub shim_dir: Option<PathBuf>,
    /// Extra environment for containerd (inherited by the shims it starts).
    pub env: Vec<(String, String)>,
    /// Make the temp dir under this directory (short paths: unix sockets).
    pub parent_dir: Option<PathBuf>,
    /// A CNI network configuration list (JSON) for the CRI plugin's pods.
    pub cni_conflist: Option<String>,
}

/// Where Debian's `containernetworking-plugins` installs the plugins.
pub const CNI_PLUGIN_DIR: &str = "/usr/lib/cni";

/// A running private containerd; everything is stopped on drop.
pub struct Containerd {
    dir: TempDir,
    child: Option<Child>,
    opts: ContainerdOptions,
}

impl Containerd {
    /// Writes the config and starts containerd; returns once it answers.
    pub fn start(opts: ContainerdOptions) -> Containerd {
        let parent = opts
            .parent_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("/tmp"));
        let dir = tempfile::Builder::new()
            .prefix("ctrd-")
            .tempdir_in(parent)
            .expect("containerd temp dir");
        let mut c = Containerd {
            dir,
            child: None,
            opts,
        };
        std::fs::write(c.config_path(), c.config_toml()).expect("write config.toml");
        if let Some(conf) = c.opts.cni_conflist.clone() {
            let (bin, etc) = (c.dir().join("cni/bin"), c.dir().join("cni/conf"));
            std::fs::create_dir_all(&bin).unwrap();
            std::fs::create_dir_all(&etc).unwrap();
            // Every plugin Debian ships; a test may add its own beside them.
            for p in std::fs::read_dir(CNI_PLUGIN_DIR)
                .expect(CNI_PLUGIN_DIR)
                .flatten()
            {
                std::os::unix::fs::symlink(p.path(), bin.join(p.file_name())).unwrap();
            }
            std::fs::write(etc.join("10-crust-test.conflist"), conf).unwrap();
        }
        c.spawn();
        c
    }

    /// The temp dir holding everything of this instance.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir().join("config.toml")
    }

    /// gRPC socket (what `ctr --address` and the CRI client use).
    pub fn address(&self) -> PathBuf {
        self.dir().join("c.sock")
    }

    /// `unix://` form of [`Containerd::address`] for gRPC clients.
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.address().display())
    }

    /// runc's state root for containers of this instance (runc's default,
    /// `/run/containerd/runc`, is machine-wide): pass it as `ctr run
    /// --runc-root`; the CRI runc handler is configured with it.
    pub fn runc_root(&self) -> PathBuf {
        self.dir().join("runc")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir().join("containerd.log")
    }

    /// The last `max` bytes of containerd's log (for failure messages).
    pub fn log_tail(&self, max: usize) -> String {
        let s = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let mut cut = s.len().saturating_sub(max);
        while !s.is_char_boundary(cut) {
            cut += 1;
        }
        s[cut..].to_string()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    fn config_toml(&self) -> String {
        let d = self.dir();
        format!(
            r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{grpc}"
[ttrpc]
  address = "{grpc}.ttrpc"
[debug]
  level = "info"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{runc}"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{handler}]
      runtime_type = "{rtype}"
      pod_annotations = ["io.crust.*"]
      privileged_without_host_devices = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni}/bin"
    conf_dir = "{cni}/conf"
"#,
            root = d.join("root").display(),
            state = d.join("state").display(),
            grpc = self.address().display(),
            opt = d.join("opt").display(),
            pause = PAUSE_IMAGE,
            handler = CRUST_HANDLER,
            rtype = CRUST_RUNTIME_TYPE,
            cni = d.join("cni").display(),
            runc = self.runc_root().display(),
        )
    }

    fn spawn(&mut self) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("containerd log");
        let log2 = log.try_clone().expect("dup log");
        // runc lives in /usr/sbin, not on every user's PATH.
        let mut path = format!(
            "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            std::env::var("PATH").unwrap_or_default()
        );
        if let Some(d) = &self.opts.shim_dir {
            path = format!("{}:{path}", d.display());
        }
        let mut cmd = Command::new("containerd");
        cmd.arg("--config")
            .arg(self.config_path())
            .env("PATH", path)
            .envs(self.opts.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0);
        // A test that dies takes its containerd along.
        crust_sys::spawn::ChildSetup::new()
            .death_signal(Signal::KILL)
            .apply(&mut cmd)
            .expect("containerd's start");
        let child = cmd
            .spawn()
            .expect("start containerd (apt-get install containerd)");
        self.child = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(st) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "containerd exited while starting ({st}); log:\n{}",
                    self.log_tail(4000)
                );
            }
            if self.address().exists() && self.ctr_in("default", &["version"]).status.success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "containerd did not answer within {READY_TIMEOUT:?}; log:\n{}",
                self.log_tail(4000)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `ctr --address <sock> -n <ns> <args>`, output captured. A `ctr`
    /// that has not finished after [`CTR_TIMEOUT`] is killed and the test
    /// fails there, with containerd's log, rather than hanging the suite.
    pub fn ctr_in(&self, namespace: &str, args: &[&str]) -> Output {
        self.ctr_within(namespace, args, CTR_TIMEOUT)
            .unwrap_or_else(|| {
                panic!(
                    "ctr {args:?} did not finish within {CTR_TIMEOUT:?}; containerd log:\n{}",
                    self.log_tail(4000)
                )
            })
    }

    /// [`Containerd::ctr_in`] that gives up (`None`) after `timeout`.
    fn ctr_within(&self, namespace: &str, args: &[&str], timeout: Duration) -> Option<Output> {
        use std::io::Read;
        let mut child = self
            .ctr_cmd(namespace, args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run ctr");
        let mut out = child.stdout.take().expect("piped");
        let mut err = child.stderr.take().expect("piped");
        let o = std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = out.read_to_end(&mut v);
            v
        });
        let e = std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = err.read_to_end(&mut v);
            v
        });
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(st) = child.try_wait().expect("wait ctr") {
                break st;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Some(Output {
            status,
            stdout: o.join().unwrap_or_default(),
            stderr: e.join().unwrap_or_default(),
        })
    }

    /// (sandbox id, network namespace path) of every CRI pod still there
    /// with a CNI namespace, from the sandbox containers' specs. Bounded:
    /// it runs in drop, maybe while a test panics.
    fn cni_pods(&self) -> Vec<(String, PathBuf)> {
        let bound = Duration::from_secs(10);
        let Some(ls) = self.ctr_within(CRI_NAMESPACE, &["containers", "ls", "-q"], bound) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for id in String::from_utf8_lossy(&ls.stdout).split_whitespace() {
            let Some(info) = self.ctr_within(CRI_NAMESPACE, &["containers", "info", id], bound)
            else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&info.stdout) else {
                continue;
            };
            let netns = v["Spec"]["linux"]["namespaces"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|n| n["type"] == "network")
                .and_then(|n| n["path"].as_str())
                .filter(|p| p.starts_with("/var/run/netns/") || p.starts_with("/run/netns/"));
            if let Some(p) = netns {
                out.push((id.to_string(), PathBuf::from(p)));
            }
        }
        out
    }

    /// CNI's DEL for a pod, as containerd would run it: each plugin of the
    /// list in reverse order (addresses, portmap rules, the veth).
    fn cni_del(&self, sandbox: &str, netns: &Path) {
        let Some(list) = &self.opts.cni_conflist else {
            return;
        };
        let Ok(list) = serde_json::from_str::<serde_json::Value>(list) else {
            return;
        };
        let bin = self.dir().join("cni/bin");
        for plugin in list["plugins"].as_array().into_iter().flatten().rev() {
            let mut conf = plugin.clone();
            conf["name"] = list["name"].clone();
            conf["cniVersion"] = list["cniVersion"].clone();
            let Some(kind) = plugin["type"].as_str() else {
                continue;
            };
            let child = Command::new(bin.join(kind))
                .env("CNI_COMMAND", "DEL")
                .env("CNI_CONTAINERID", sandbox)
                .env("CNI_NETNS", netns)
                .env("CNI_IFNAME", "eth0")
                .env("CNI_PATH", &bin)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            if let Ok(mut c) = child {
                if let Some(mut i) = c.stdin.take() {
                    use std::io::Write;
                    let _ = i.write_all(conf.to_string().as_bytes());
                }
                let _ = c.wait();
            }
        }
    }

    /// The `ctr` command for `args`, ready to run (callers pick the stdio).
    pub fn ctr_cmd(&self, namespace: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(self.address())
            .arg("-n")
            .arg(namespace)
            .args(args);
        cmd
    }

    /// `ctr events` of `namespace`, subscribed before this returns (give
    /// it to [`Events::lines`] once the events of interest happened).
    pub fn events(&self, namespace: &str) -> Events {
        let child = self
            .ctr_cmd(namespace, &["events"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn ctr events");
        // `ctr events` subscribes a moment after it starts.
        std::thread::sleep(Duration::from_millis(500));
        Events(crate::ChildGuard::new(child))
    }

    /// `ctr` that must succeed; returns stdout.
    pub fn ctr_ok(&self, namespace: &str, args: &[&str]) -> String {
        let o = self.ctr_in(namespace, args);
        assert!(
            o.status.success(),
            "ctr {args:?} failed ({}): {}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Imports OCI archives (from `scripts/build-test-images.sh`) into
    /// `namespace`.
    pub fn import_images(&self, namespace: &str, tars: &[&Path]) {
        for t in tars {
            let t = t.to_str().expect("utf-8 path");
            self.ctr_ok(namespace, &["images", "import", t]);
        }
    }

    /// Kills containerd (SIGKILL) and starts it again with the same
    /// config, root and state: running shims stay, as after a crash or an
    /// upgrade of the daemon.
    pub fn restart(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.spawn();
    }

    /// Pids of the shims this instance started (their command lines name
    /// our gRPC socket).
    pub fn shim_pids(&self) -> Vec<i32> {
        let addr = self.address().display().to_string();
        let me = std::process::id() as i32;
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return out;
        };
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if pid == me || Some(pid as u32) == self.pid() {
                continue;
            }
            let Ok(raw) = std::fs::read(e.path().join("cmdline")) else {
                continue;
            };
            let args: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
            let is_shim = args
                .first()
                .is_some_and(|a| String::from_utf8_lossy(a).contains("containerd-shim"));
            if is_shim
                && args
                    .windows(2)
                    .any(|w| w[0] == b"-address" && w[1] == addr.as_bytes())
            {
                out.push(pid);
            }
        }
        out
    }

    fn stop_all(&mut self) {
        // Asked while containerd still answers: a panicking test's pods.
        let pods = if self.opts.cni_conflist.is_some() && self.child.is_some() {
            self.cni_pods()
        } else {
            Vec::new()
        };
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Shims: TERM lets the crust shim take its VM down; KILL after a
        // grace, with every process below them (runc's containers outlive
        // a stopped runc shim).
        let shims = self.shim_pids();
        let below = descendants(&shims);
        for pid in shims {
            if let Some(p) = Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(p, Signal::TERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.shim_pids().into_iter().any(pid_alive) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        for pid in self.shim_pids().into_iter().chain(below) {
            if let Some(p) = Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(p, Signal::KILL);
            }
        }
        unmount_below(self.dir());
        // With every process of the pods gone, so the taps QEMU held go
        // with the namespace.
        for (sandbox, netns) in pods {
            self.cni_del(&sandbox, &netns);
            let _ = rustix::mount::unmount(&netns, UnmountFlags::DETACH);
            let _ = std::fs::remove_file(&netns);
        }
    }
}

/// Whether `pid` exists and is not a zombie.
pub fn pid_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 1..].trim_start().to_string()))
        .is_some_and(|rest| !rest.starts_with('Z') && !rest.starts_with('X'))
}

/// Every live process below `roots` in the process tree.
fn descendants(roots: &[i32]) -> Vec<i32> {
    let mut parent_of = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let ppid = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().nth(1)?.parse::<i32>().ok());
            if let Some(ppid) = ppid {
                parent_of.push((pid, ppid));
            }
        }
    }
    let mut out: Vec<i32> = Vec::new();
    let mut frontier: Vec<i32> = roots.to_vec();
    while let Some(p) = frontier.pop() {
        for (child, _) in parent_of.iter().filter(|(_, pp)| *pp == p) {
            if !out.contains(child) {
                out.push(*child);
                frontier.push(*child);
            }
        }
    }
    out
}

/// Lazily unmounts every mount point below `dir`, deepest first.
pub fn unmount_below(dir: &Path) {
    for _ in 0..3 {
        let points = crust_blockdev::mount_points_below(dir).unwrap_or_default();
        if points.is_empty() {
            return;
        }
        for p in points.iter().rev() {
            let _ = rustix::mount::unmount(p, UnmountFlags::DETACH);
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// Where `scripts/build-test-images.sh` leaves the OCI archives.
/// `CRUST_TEST_IMAGES_DIR` overrides `<workspace>/target/test-images`.
pub fn test_images_dir() -> PathBuf {
    std::env::var_os("CRUST_TEST_IMAGES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::workspace_root().join("target/test-images"))
}

/// Builds the test images when missing or stale (the script keeps a stamp)
/// and returns (busybox.tar, pause.tar). One build at a time machine-wide.
pub fn ensure_test_images() -> (PathBuf, PathBuf) {
    let dir = test_images_dir();
    std::fs::create_dir_all(crate::SLOT_DIR).expect("create slot dir");
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(Path::new(crate::SLOT_DIR).join("test-images.lock"))
        .expect("open image lock");
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).expect("lock");
    let status = Command::new(crate::workspace_root().join("scripts/build-test-images.sh"))
        .arg("--out")
        .arg(&dir)
        .stdin(Stdio::null())
        .status()
        .expect("run scripts/build-test-images.sh");
    assert!(status.success(), "scripts/build-test-images.sh failed");
    (dir.join("busybox.tar"), dir.join("pause.tar"))
}

/// A running `ctr events` ([`Containerd::events`]); killed on drop.
pub struct Events(crate::ChildGuard);

impl Events {
    /// Stops listening: every event line printed so far.
    pub fn lines(mut self) -> Vec<String> {
        let _ = self.0.child().kill();
        let out = self
            .0
            .into_inner()
            .wait_with_output()
            .expect("ctr events output");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(String::from)
            .collect()
    }
}
