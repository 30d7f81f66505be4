//! Shared harness of the crust-csi integration tests: a temporary node
//! (socket, state, pool and kubelet-like directories in a tempdir), the
//! real `crust-csi` binary under a [`ChildGuard`], tonic clients, request
//! builders, and a drop guard that unmounts everything under the tempdir
//! and detaches every loop device backed by a file in it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crust_proto::csi::v1 as csi;
use crust_proto::endpoint::Endpoint;
use crust_testkit::ChildGuard;
use csi::controller_client::ControllerClient;
use csi::identity_client::IdentityClient;
use csi::node_client::NodeClient;
use csi::volume_capability::access_mode::Mode;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use tonic::transport::Channel;

pub const MIB: i64 = 1 << 20;
pub const GIB: i64 = 1 << 30;
pub const NODE: &str = "test-node";
pub const TOPO_KEY: &str = "blk.crust.dev/node";

/// Unmounts every mount under `root` and detaches loop devices backed by
/// files under `root`, on drop (also when a test fails).
pub struct NodeCleanup {
    root: PathBuf,
}

impl NodeCleanup {
    pub fn new(root: &Path) -> Self {
        NodeCleanup {
            root: std::fs::canonicalize(root).unwrap(),
        }
    }

    pub fn run(&self) {
        // Unmount what can be unmounted, detach loop devices on files under
        // the root, repeat: a filesystem holding a loop device's backing
        // file (a test's own pool filesystem) unmounts only once the loop
        // device is gone. Lazy unmounts only as a last resort.
        for round in 0..8 {
            let mounts: Vec<PathBuf> = crust_blockdev::mount_info()
                .unwrap_or_default()
                .into_iter()
                .rev()
                .map(|m| m.mount_point)
                .filter(|p| p.starts_with(&self.root))
                .collect();
            for l in crust_blockdev::list_loops().unwrap_or_default() {
                if l.backing_file.starts_with(&self.root) {
                    let _ = crust_blockdev::detach(&l.path);
                }
            }
            if mounts.is_empty() {
                break;
            }
            for m in mounts {
                if crust_blockdev::unmount(&m).is_err() && round == 7 {
                    // Last resort so the machine is not left dirty.
                    let _ = rustix::mount::unmount(&m, rustix::mount::UnmountFlags::DETACH);
                }
            }
        }
        for l in crust_blockdev::list_loops().unwrap_or_default() {
            if l.backing_file.starts_with(&self.root) {
                let _ = crust_blockdev::detach(&l.path);
            }
        }
    }
}

impl Drop for NodeCleanup {
    fn drop(&mut self) {
        self.run();
    }
}

/// Loop devices currently bound to files under `dir` (sysfs evidence).
pub fn loops_under(dir: &Path) -> Vec<crust_blockdev::LoopStatus> {
    let root = std::fs::canonicalize(dir).unwrap();
    crust_blockdev::list_loops()
        .unwrap()
        .into_iter()
        .filter(|l| l.backing_file.starts_with(&root))
        .collect()
}

/// Mount points under `dir`.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let root = std::fs::canonicalize(dir).unwrap();
    crust_blockdev::mount_info()
        .unwrap()
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(&root))
        .collect()
}

/// A running plugin process.
pub struct Plugin {
    pub guard: ChildGuard,
    pub endpoint: Endpoint,
    pub stderr_path: PathBuf,
}

impl Plugin {
    /// Sends SIGTERM and waits for a clean exit; returns the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let child = self.guard.child();
        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                // Already reaped by try_wait; disarm the guard.
                let _ = self.guard.0.take();
                return st;
            }
            assert!(Instant::now() < deadline, "plugin did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, like a crash.
    pub fn kill(self) {
        drop(self.guard);
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }
}

/// A temporary node: directories, the plugin and cleanup.
pub struct TestNode {
    // Field order is drop order: stop the plugin, then clean the node,
    // then remove the directory.
    pub plugin: Option<Plugin>,
    pub cleanup: NodeCleanup,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub state: PathBuf,
    pub pool: PathBuf,
    pub extra: Vec<String>,
    /// Environment of the plugin process.
    pub env: Vec<(String, String)>,
    /// `--health-ttl`; tests use 0s so every condition is fresh.
    pub health_ttl: String,
    /// `--node-id` ([`NODE`] unless a test simulates several nodes).
    pub node_id: String,
    starts: usize,
}

impl TestNode {
    /// A node with a 20 GiB pool (sparse; nothing is preallocated).
    pub fn new() -> TestNode {
        Self::with_args(&["--pool-capacity", "20Gi"])
    }

    pub fn with_args(extra: &[&str]) -> TestNode {
        Self::build(extra, "0s")
    }

    pub fn build(extra: &[&str], health_ttl: &str) -> TestNode {
        let mut n = Self::unstarted(extra, health_ttl);
        n.start();
        n
    }

    /// The node's directories and guards, plugin not started yet.
    pub fn unstarted(extra: &[&str], health_ttl: &str) -> TestNode {
        crust_testkit::require_root();
        let dir = tempfile::Builder::new()
            .prefix("crust-csi-test")
            .tempdir_in("/tmp")
            .unwrap();
        let cleanup = NodeCleanup::new(dir.path());
        TestNode {
            plugin: None,
            cleanup,
            socket: dir.path().join("sock/csi.sock"),
            state: dir.path().join("state"),
            pool: dir.path().join("pool"),
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            health_ttl: health_ttl.to_string(),
            node_id: NODE.to_string(),
            starts: 0,
        }
    }

    /// A node with deferral enabled: hand-off roots under the node's
    /// tempdir, `layout` (crust | kata | both), the runtime CLI map of
    /// `crust-test-runtime-cli` at [`TestNode::cli_map`], plus `more` flags.
    pub fn deferral(layout: &str, more: &[&str]) -> TestNode {
        let mut n = Self::deferral_unstarted(layout, more);
        n.start();
        n
    }

    /// [`TestNode::deferral`] before the plugin starts (to add flags that
    /// name the node's directories).
    pub fn deferral_unstarted(layout: &str, more: &[&str]) -> TestNode {
        let mut n = Self::unstarted(&["--pool-capacity", "20Gi"], "0s");
        let crust = n.crust_root();
        let kata = n.kata_root();
        n.extra.extend(
            [
                "--deferral",
                "enabled",
                "--handoff-layout",
                layout,
                "--crust-root",
                crust.to_str().unwrap(),
                "--kata-root",
                kata.to_str().unwrap(),
            ]
            .iter()
            .chain(more)
            .map(|s| s.to_string()),
        );
        let map = n.cli_map();
        n.env.push((
            "CRUST_TEST_CLI_MAP".into(),
            map.to_str().unwrap().to_string(),
        ));
        n
    }

    pub fn crust_root(&self) -> PathBuf {
        self.path("handoff/crust")
    }

    pub fn kata_root(&self) -> PathBuf {
        self.path("handoff/kata")
    }

    /// The JSON map `crust-test-runtime-cli` answers from.
    pub fn cli_map(&self) -> PathBuf {
        self.path("cli-map.json")
    }

    /// The node's Handover service socket.
    pub fn handover_socket(&self) -> PathBuf {
        self.path("sock/handover.sock")
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// A fresh directory under the node (like kubelet's staging dirs).
    pub fn mkdir(&self, rel: &str) -> String {
        let p = self.path(rel);
        std::fs::create_dir_all(&p).unwrap();
        p.to_str().unwrap().to_string()
    }

    pub fn command(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_crust-csi"));
        // The suites written for the plugin without deferral pin that
        // mode; the deferral suites pass `--deferral enabled` themselves.
        if !self.extra.iter().any(|a| a.starts_with("--deferral")) {
            cmd.args(["--deferral", "disabled"]);
        }
        // Each node serves its own Handover socket (never the host's
        // default /run/crust/handover.sock, shared by parallel tests).
        if !self
            .extra
            .iter()
            .any(|a| a.starts_with("--handover-endpoint"))
        {
            cmd.arg("--handover-endpoint")
                .arg(format!("unix://{}", self.handover_socket().display()));
        }
        cmd.arg("--endpoint")
            .arg(format!("unix://{}", self.socket.display()))
            .arg("--node-id")
            .arg(&self.node_id)
            .arg("--state-dir")
            .arg(&self.state)
            .arg("--pool-dir")
            .arg(&self.pool)
            .arg("--health-ttl")
            .arg(&self.health_ttl)
            .args(&self.extra)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("CRUST_CSI_LOG_LEVEL", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        cmd
    }

    /// Starts the plugin and waits until it answers Probe.
    pub fn start(&mut self) {
        assert!(self.plugin.is_none(), "plugin already running");
        self.starts += 1;
        let stderr_path = self.path(&format!("plugin-{}.log", self.starts));
        let log = std::fs::File::create(&stderr_path).unwrap();
        let child = self.command().stderr(log).spawn().unwrap();
        let plugin = Plugin {
            guard: ChildGuard::new(child),
            endpoint: Endpoint::Unix(self.socket.clone()),
            stderr_path,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut plugin = plugin;
        loop {
            if let Some(st) = plugin.guard.child().try_wait().unwrap() {
                panic!("plugin exited early ({st}): {}", plugin.stderr());
            }
            // The socket appears only once the plugin is ready to serve.
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "plugin did not come up: {}",
                plugin.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.plugin = Some(plugin);
    }

    pub fn stop(&mut self) -> std::process::ExitStatus {
        self.plugin.take().expect("running").terminate()
    }

    pub fn crash(&mut self) {
        self.plugin.take().expect("running").kill();
    }

    pub async fn clients(&self) -> Clients {
        let plugin = self.plugin.as_ref().expect("running");
        // A connection the plugin's listener queued just as a restart
        // replaced it can be reset: retry briefly, then say what happened.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut attempt = plugin.endpoint.connect().await;
        while attempt.is_err() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            attempt = plugin.endpoint.connect().await;
        }
        let ch = attempt.unwrap_or_else(|e| {
            let exited =
                std::fs::read_to_string(format!("/proc/{}/stat", plugin.guard.child_id())).is_err();
            let log = plugin.stderr();
            let tail = &log[log.len().saturating_sub(3000)..];
            panic!("connecting to the plugin: {e} (plugin gone: {exited})\nplugin log:\n{tail}")
        });
        Clients::new(ch)
    }
}

#[derive(Clone)]
pub struct Clients {
    pub id: IdentityClient<Channel>,
    pub ctl: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
}

impl Clients {
    pub fn new(ch: Channel) -> Self {
        Clients {
            id: IdentityClient::new(ch.clone()),
            ctl: ControllerClient::new(ch.clone()),
            node: NodeClient::new(ch),
        }
    }

    pub async fn create(
        &mut self,
        req: csi::CreateVolumeRequest,
    ) -> Result<csi::Volume, tonic::Status> {
        self.ctl
            .create_volume(req)
            .await
            .map(|r| r.into_inner().volume.unwrap())
    }

    pub async fn delete(&mut self, id: &str) -> Result<(), tonic::Status> {
        self.ctl
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: id.into(),
                ..Default::default()
            })
            .await
            .map(drop)
    }

    pub async fn stage(
        &mut self,
        id: &str,
        staging: &str,
        cap: csi::VolumeCapability,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.into(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map(drop)
    }

    /// [`Clients::stage`] repeated, as a CO retries ABORTED, while a
    /// static device's one full read (the format gate's proof) runs.
    pub async fn stage_after_blank_check(
        &mut self,
        id: &str,
        staging: &str,
        cap: csi::VolumeCapability,
    ) -> Result<(), tonic::Status> {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            match self.stage(id, staging, cap.clone()).await {
                Err(s) if s.code() == tonic::Code::Aborted && s.message().contains("reading") => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the full read never ended: {}",
                        s.message()
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => return other,
            }
        }
    }

    pub async fn unstage(&mut self, id: &str, staging: &str) -> Result<(), tonic::Status> {
        self.node
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.into(),
            })
            .await
            .map(drop)
    }

    pub async fn publish(
        &mut self,
        id: &str,
        staging: &str,
        target: &str,
        cap: csi::VolumeCapability,
        readonly: bool,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.into(),
                target_path: target.into(),
                volume_capability: Some(cap),
                readonly,
                ..Default::default()
            })
            .await
            .map(drop)
    }

    pub async fn unpublish(&mut self, id: &str, target: &str) -> Result<(), tonic::Status> {
        self.node
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: id.into(),
                target_path: target.into(),
                ..Default::default()
            })
            .await
            .map(drop)
    }

    pub async fn stats(
        &mut self,
        id: &str,
        path: &str,
    ) -> Result<csi::NodeGetVolumeStatsResponse, tonic::Status> {
        self.node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: id.into(),
                volume_path: path.into(),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner())
    }

    pub async fn get(
        &mut self,
        id: &str,
    ) -> Result<csi::ControllerGetVolumeResponse, tonic::Status> {
        self.ctl
            .controller_get_volume(csi::ControllerGetVolumeRequest {
                volume_id: id.into(),
            })
            .await
            .map(|r| r.into_inner())
    }

    pub async fn list_all(&mut self) -> Vec<csi::list_volumes_response::Entry> {
        self.ctl
            .list_volumes(csi::ListVolumesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries
    }
}

pub fn mode_cap(access: AccessType, mode: Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(access),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

pub fn mount(fs: &str) -> csi::VolumeCapability {
    mount_mode(fs, Mode::SingleNodeWriter)
}

pub fn mount_mode(fs: &str, mode: Mode) -> csi::VolumeCapability {
    mode_cap(
        AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        }),
        mode,
    )
}

pub fn block() -> csi::VolumeCapability {
    block_mode(Mode::SingleNodeWriter)
}

pub fn block_mode(mode: Mode) -> csi::VolumeCapability {
    mode_cap(AccessType::Block(BlockVolume {}), mode)
}

pub fn create_req(
    name: &str,
    bytes: i64,
    caps: Vec<csi::VolumeCapability>,
) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: caps,
        ..Default::default()
    }
}

/// Asserts a gRPC error code, printing the message on mismatch.
#[track_caller]
pub fn assert_code<T: std::fmt::Debug>(
    r: Result<T, tonic::Status>,
    code: tonic::Code,
) -> tonic::Status {
    match r {
        Ok(v) => panic!("expected {code:?}, got Ok({v:?})"),
        Err(s) => {
            assert_eq!(s.code(), code, "unexpected status: {}", s.message());
            s
        }
    }
}

/// Size of a block device node (BLKGETSIZE64).
pub fn dev_size(p: &Path) -> u64 {
    crust_blockdev::block_device_size(p).unwrap()
}

/// statvfs total bytes.
pub fn fs_total(p: &Path) -> u64 {
    crust_blockdev::usage(p).unwrap().bytes_total
}

/// The `crust-test-runtime-cli` binary of crust-ops (a runtime CLI that
/// answers `crust stats|resize` from a real mounted filesystem), built
/// into this test's target directory and profile on first use: cargo
/// builds only this package's binaries for its tests.
pub fn runtime_cli() -> PathBuf {
    static CLI: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    CLI.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        // target/<profile>/deps/<test> -> target/<profile>
        let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
        let target_dir = profile_dir.parent().unwrap();
        let bin = profile_dir.join("crust-test-runtime-cli");
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "--quiet", "-p", "crust-ops"])
            .args(["--bin", "crust-test-runtime-cli", "--target-dir"])
            .arg(target_dir)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdin(Stdio::null());
        match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => {}
            Some("release") => {
                cmd.arg("--release");
            }
            Some(other) => {
                cmd.args(["--profile", other]);
            }
            None => panic!("cannot tell the build profile from {}", exe.display()),
        }
        match cmd.output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => assert!(
                bin.is_file(),
                "building crust-test-runtime-cli failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => assert!(
                bin.is_file(),
                "cannot run cargo ({e}) and {} is not built",
                bin.display()
            ),
        }
        assert!(bin.is_file(), "{} was not built", bin.display());
        bin
    })
    .clone()
}

/// A filesystem mounted on the host where a sandbox's guest would mount
/// it (the tests play the runtime); unmounted on drop.
pub struct GuestMount {
    pub dir: PathBuf,
    mounted: bool,
}

impl GuestMount {
    pub fn new(device: &Path, dir: &Path, fs: &str) -> GuestMount {
        std::fs::create_dir_all(dir).unwrap();
        rustix::mount::mount(device, dir, fs, rustix::mount::MountFlags::empty(), None)
            .unwrap_or_else(|e| panic!("mount {} on {}: {e}", device.display(), dir.display()));
        GuestMount {
            dir: dir.to_path_buf(),
            mounted: true,
        }
    }

    /// Like the runtime at sandbox stop.
    pub fn unmount(&mut self) {
        if self.mounted {
            crust_blockdev::unmount(&self.dir).unwrap();
            self.mounted = false;
        }
    }
}

impl Drop for GuestMount {
    fn drop(&mut self) {
        if self.mounted && crust_blockdev::unmount(&self.dir).is_err() {
            let _ = rustix::mount::unmount(&self.dir, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// The CRUST-layout store at `root`, as a runtime opens it.
pub fn crust_store(root: &Path) -> crust_handoff::Store {
    crust_handoff::Store::new(
        crust_handoff::Layout::Crust,
        root,
        crust_handoff::Policy::default(),
    )
    .unwrap()
}

/// What a runtime does when it consumes a deferred volume: claims it for
/// its sandbox and records the CLI that serves stats and resize.
pub fn consume(root: &Path, target: &str, sandbox: &str, cli: &Path) {
    let store = crust_store(root);
    store.claim(target, sandbox, |_| true).unwrap();
    store
        .set_runtime_cli(target, cli.to_str().unwrap())
        .unwrap();
}

/// The address the plugin logged for its metrics endpoint.
pub fn metrics_address(node: &TestNode) -> std::net::SocketAddr {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = node.plugin.as_ref().expect("running").stderr();
        if let Some(rest) = log.split("metrics endpoint listening on http://").nth(1) {
            let addr = rest.split("/metrics").next().unwrap();
            return addr.parse().unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "no metrics address in the log: {log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `GET <path>` over a plain TCP connection: (status line, body).
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("HTTP response");
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// The value of an un-labelled or fully labelled sample in metrics text.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
}

/// (mount point, source) of every mount in this namespace.
pub fn mountinfo() -> Vec<(PathBuf, String)> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            Some((PathBuf::from(f[4]), f.get(sep + 2)?.to_string()))
        })
        .collect()
}

/// Anything mounted at `p`.
pub fn is_mounted(p: &str) -> bool {
    mountinfo().iter().any(|(m, _)| m == Path::new(p))
}

/// A mount at `p` other than the plugin's placeholder (a host mount of
/// the volume).
pub fn host_mounted(p: &str) -> bool {
    mountinfo()
        .iter()
        .any(|(m, src)| m == Path::new(p) && src != crust_handoff::PLACEHOLDER_SOURCE)
}

/// Mutable parameters from pairs.
pub fn params(pairs: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// ControllerModifyVolume with the given mutable parameters.
pub async fn modify_limits(
    c: &mut Clients,
    id: &str,
    pairs: &[(&str, &str)],
) -> Result<(), tonic::Status> {
    c.ctl
        .controller_modify_volume(csi::ControllerModifyVolumeRequest {
            volume_id: id.into(),
            mutable_parameters: params(pairs),
            ..Default::default()
        })
        .await
        .map(drop)
}

/// The bytes of a volume's record on `node`.
pub fn record_bytes(node: &TestNode, id: &str) -> Vec<u8> {
    std::fs::read(node.state.join(format!("volumes/{id}.json"))).unwrap()
}

/// The I/O limits in a volume's record on `node`.
pub fn limits_of(node: &TestNode, id: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(&record_bytes(node, id)).unwrap();
    v["io_limits"].clone()
}

/// `record` (a hand-off record's expected bytes, without the identity)
/// as the writer makes it for `device`: with the device's identity
/// (`deviceIdentity`, read now from the device) first in its metadata.
pub fn with_device_identity(record: &str, device: &Path) -> String {
    use std::os::fd::AsFd;
    let fd = rustix::fs::open(
        device,
        rustix::fs::OFlags::RDONLY,
        rustix::fs::Mode::empty(),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", device.display()));
    let id = crust_blockdev::identity_of(fd.as_fd(), device).unwrap();
    let key = format!(r#""deviceIdentity":"{id}""#);
    if record.contains(r#""metadata":{"#) {
        return record.replacen(r#""metadata":{"#, &format!(r#""metadata":{{{key},"#), 1);
    }
    let at = record.find(r#""fstype":""#).expect("an fstype") + r#""fstype":""#.len();
    let end = at + record[at..].find('"').expect("a closed fstype") + 1;
    format!(
        "{}{}{}",
        &record[..end],
        format_args!(r#","metadata":{{{key}}}"#),
        &record[end..]
    )
}

/// A TCP port on loopback nobody listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A node serving peers on `own`, asking `all`, with the key at `key`,
/// and `more` flags.
pub fn peer_node(id: &str, own: u16, all: &[u16], key: &Path, more: &[String]) -> TestNode {
    let peers: Vec<String> = all.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let mut n = TestNode::unstarted(&["--pool-capacity", "2Gi"], "0s");
    n.node_id = id.to_string();
    n.extra.extend([
        "--peer-address".to_string(),
        format!("127.0.0.1:{own}"),
        "--peers".to_string(),
        peers.join(","),
        "--peer-key-file".to_string(),
        key.to_str().unwrap().to_string(),
    ]);
    n.extra.extend(more.iter().cloned());
    n.start();
    n
}
