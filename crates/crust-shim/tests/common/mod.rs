//! A private containerd with the crust shim on its PATH and crust's roots
//! in a temp dir, plus helpers shared by the shim's tests.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use std::ffi::OsString;
use std::time::Duration;

use crust_proto::csi::v1 as csi;
use crust_proto::endpoint::Endpoint;
use crust_testkit::{Containerd, ContainerdOptions};
use crustctl::client::Csi;
use crustctl::demo::PluginProcess;

pub const MIB: u64 = 1 << 20;

/// What kubelet sends for a non-privileged container (procMount Default).
pub const KUBELET_MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
];
pub const KUBELET_READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

pub fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Everything one test needs: the guest slot, containerd, crust's roots.
pub struct Env {
    pub ctrd: Containerd,
    pub dir: tempfile::TempDir,
    pub runtime_root: PathBuf,
    pub crust_root: PathBuf,
    pub kata_root: PathBuf,
    /// kubelet's pods dir (volume targets go below it).
    pub pods_dir: PathBuf,
    // Released last: covers every guest the test boots.
    pub _slot: crust_testkit::VmSlot,
}

pub fn shim_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_containerd-shim-crust-v2"))
}

fn root_only(p: &Path) {
    std::fs::create_dir_all(p).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700)).unwrap();
}

impl Env {
    pub fn start(namespace: &str) -> Env {
        Env::start_with(namespace, Vec::new())
    }

    pub fn start_with(namespace: &str, extra_env: Vec<(String, String)>) -> Env {
        Env::start_full(namespace, extra_env, None)
    }

    /// With a CNI network configuration for the CRI plugin's pods.
    pub fn start_full(
        namespace: &str,
        extra_env: Vec<(String, String)>,
        cni_conflist: Option<String>,
    ) -> Env {
        crust_testkit::require_root();
        crust_testkit::ensure_guest_image();
        let (busybox, pause) = crust_testkit::ensure_test_images();
        let slot = crust_testkit::VmSlot::acquire();
        // Short: the pod's VM sockets live below the runtime root.
        let dir = tempfile::Builder::new()
            .prefix("cs-")
            .tempdir_in("/tmp")
            .unwrap();
        root_only(dir.path());
        let runtime_root = dir.path().join("rt");
        let crust_root = dir.path().join("crust");
        let kata_root = dir.path().join("kata");
        let pods_dir = dir.path().join("kubelet/pods");
        for d in [&runtime_root, &crust_root, &kata_root, &pods_dir] {
            root_only(d);
        }
        let mut env = vec![
            (
                "CRUST_RUNTIME_ROOT".to_string(),
                runtime_root.display().to_string(),
            ),
            // This test's own Handover socket (the default is node-wide).
            (
                "CRUST_RUNTIME_HANDOVER_ENDPOINT".into(),
                format!("unix://{}", handover_socket(dir.path()).display()),
            ),
            (
                "CRUST_RUNTIME_CRUST_ROOT".into(),
                crust_root.display().to_string(),
            ),
            (
                "CRUST_RUNTIME_KATA_ROOT".into(),
                kata_root.display().to_string(),
            ),
            ("CRUST_RUNTIME_ACCEL".into(), "tcg".into()),
            (
                "CRUST_RUNTIME_PODS_LAYER_STOP".into(),
                pods_dir.display().to_string(),
            ),
            (
                "CRUST_GUEST_DIR".into(),
                crust_testkit::guest_image_dir().display().to_string(),
            ),
            (
                "CRUST_SHIM_RUNTIME_CLI".into(),
                crust_testkit::workspace_bin("crust-runtime")
                    .display()
                    .to_string(),
            ),
            (
                "CRUST_SHIM_LOG".into(),
                dir.path().join("shim.log").display().to_string(),
            ),
        ];
        // Most tests' pods use hostNetwork for want of CNI: the node lets
        // them (a test of the refusal says otherwise in `extra_env`).
        if !extra_env
            .iter()
            .any(|(k, _)| k == "CRUST_SHIM_HOST_NETWORK")
        {
            env.push(("CRUST_SHIM_HOST_NETWORK".into(), "user".into()));
        }
        env.extend(extra_env);
        let ctrd = Containerd::start(ContainerdOptions {
            shim_dir: Some(shim_bin().parent().unwrap().to_path_buf()),
            env,
            parent_dir: None,
            cni_conflist,
        });
        ctrd.import_images(namespace, &[&busybox, &pause]);
        Env {
            ctrd,
            dir,
            runtime_root,
            crust_root,
            kata_root,
            pods_dir,
            _slot: slot,
        }
    }

    /// The shim's whole log (every pod's shims append to it).
    pub fn shim_log_all(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("shim.log")).unwrap_or_default()
    }

    /// The end of the shim's log (for failure messages).
    pub fn shim_log(&self) -> String {
        let s = self.shim_log_all();
        let cut = s.len().saturating_sub(6000);
        let mut c = cut;
        while !s.is_char_boundary(c) {
            c += 1;
        }
        s[c..].to_string()
    }

    pub fn logs(&self) -> String {
        format!(
            "--- shim.log\n{}\n--- containerd.log\n{}",
            self.shim_log(),
            self.ctrd.log_tail(4000)
        )
    }
}

impl Drop for Env {
    /// What a failed test leaves mounted below its dir (a staging mount,
    /// the plugin's placeholder on a target) goes with it.
    fn drop(&mut self) {
        crust_testkit::unmount_below(self.dir.path());
    }
}

/// Detaches, on drop, loop devices whose backing file lies below a dir
/// (a crust-csi pool), and removes test cgroup parents: what a failed test
/// would leave behind.
pub struct Leftovers {
    pub pool: PathBuf,
    pub cgroup_parent: Option<String>,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        if let Ok(loops) = crust_blockdev::list_loops() {
            for l in loops
                .into_iter()
                .filter(|l| l.backing_file.starts_with(&self.pool))
            {
                let _ = std::process::Command::new("losetup")
                    .arg("-d")
                    .arg(&l.path)
                    .status();
            }
        }
        if let Some(parent) = &self.cgroup_parent {
            remove_cgroup_tree(parent);
        }
    }
}

/// Removes `/sys/fs/cgroup/<controller>/<parent>` (and its empty children)
/// in every hierarchy.
pub fn remove_cgroup_tree(parent: &str) {
    let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    for c in rd.flatten() {
        let base = c.path().join(parent.trim_start_matches('/'));
        if let Ok(children) = std::fs::read_dir(&base) {
            for ch in children.flatten() {
                if ch.path().is_dir() {
                    let _ = std::fs::remove_dir(ch.path());
                }
            }
        }
        let _ = std::fs::remove_dir(&base);
    }
}

/// Whether `pid` is in the cgroup `path` of the v1 `memory` hierarchy (or
/// v2's unified tree).
pub fn in_cgroup(pid: i32, path: &str) -> bool {
    let rel = path.trim_start_matches('/');
    [
        Path::new("/sys/fs/cgroup/memory").join(rel),
        Path::new("/sys/fs/cgroup").join(rel),
    ]
    .iter()
    .any(|d| {
        std::fs::read_to_string(d.join("cgroup.procs"))
            .map(|s| s.lines().any(|l| l.trim() == pid.to_string()))
            .unwrap_or(false)
    })
}

/// QEMU processes whose command line names `needle` (a run dir).
pub fn qemus_under(needle: &Path) -> Vec<i32> {
    let n = needle.display().to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        if cmd.starts_with("qemu-system") && cmd.contains(&n) && crust_testkit::pid_alive(pid) {
            out.push(pid);
        }
    }
    out
}

/// A live process whose command line holds `pattern` and `needle`.
pub fn pid_of_child(pattern: &str, needle: &Path) -> Option<i32> {
    let n = needle.display().to_string();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd =
            String::from_utf8_lossy(&std::fs::read(e.path().join("cmdline")).ok()?).into_owned();
        (cmd.contains(pattern) && cmd.contains(&n) && crust_testkit::pid_alive(pid)).then_some(pid)
    })
}

/// `uname -r` of the host.
pub fn host_release() -> String {
    rustix::system::uname()
        .release()
        .to_string_lossy()
        .into_owned()
}

/// crust-csi with a loop-file pool in the test's dir; its environment
/// names the runtime's roots for the `crust-runtime` CLI crust_ops runs.
pub struct Plugin {
    pub proc: PluginProcess,
    pub socket: PathBuf,
}

impl Plugin {
    pub async fn csi(&self) -> Csi {
        Csi::connect(
            &Endpoint::parse(&format!("unix://{}", self.socket.display())).unwrap(),
            Duration::from_secs(180),
        )
        .await
        .unwrap()
    }
}

/// The Handover socket of the test's crust-csi.
pub fn handover_socket(dir: &Path) -> PathBuf {
    dir.join("csi/handover.sock")
}

pub async fn start_plugin(env: &Env) -> Plugin {
    start_plugin_with(env, &[]).await
}

/// The test's crust-csi (node `shim-node`) with `extra` flags.
pub async fn start_plugin_with(env: &Env, extra: &[String]) -> Plugin {
    let pods = env.pods_dir.as_path();
    let d = env.dir.path();
    let socket = d.join("csi/csi.sock");
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    let mut args: Vec<OsString> = [
        "--endpoint".into(),
        format!("unix://{}", socket.display()),
        "--node-id".into(),
        "shim-node".into(),
        "--state-dir".into(),
        d.join("csi-state").display().to_string(),
        "--pool-dir".into(),
        d.join("pool").display().to_string(),
        "--pool-capacity".into(),
        "1Gi".into(),
        "--health-ttl".into(),
        "0s".into(),
        "--handoff-layout".into(),
        "crust".into(),
        "--crust-root".into(),
        env.crust_root.display().to_string(),
        "--kata-root".into(),
        env.kata_root.display().to_string(),
        "--allowed-target-prefix".into(),
        pods.display().to_string(),
        "--handover-endpoint".into(),
        format!("unix://{}", handover_socket(d).display()),
    ]
    .into_iter()
    .map(OsString::from)
    .collect();
    args.extend(extra.iter().map(OsString::from));
    let rt_env: Vec<(&str, OsString)> = vec![
        ("CRUST_RUNTIME_ROOT", env.runtime_root.clone().into()),
        ("CRUST_RUNTIME_CRUST_ROOT", env.crust_root.clone().into()),
        ("CRUST_RUNTIME_KATA_ROOT", env.kata_root.clone().into()),
        ("CRUST_RUNTIME_PODS_LAYER_STOP", pods.into()),
    ];
    let bin = crust_testkit::workspace_bin("crust-csi");
    let mut p = PluginProcess::spawn(&bin, &args, &rt_env, &d.join("crust-csi.log")).unwrap();
    if let Err(e) = p.wait_ready(&socket, Duration::from_secs(30)).await {
        panic!("{e}\n{}", p.log_tail(4000));
    }
    Plugin { proc: p, socket }
}

/// A second crust-csi playing another node (`resizer-node`, no volumes,
/// its own directories), where the cluster's external-resizer would send
/// ControllerModifyVolume: `peer_flags` name the nodes' peer ports and key.
pub async fn start_other_node(env: &Env, peer_flags: &[String]) -> Plugin {
    let d = env.dir.path().join("resizer-node");
    std::fs::create_dir_all(&d).unwrap();
    let socket = d.join("csi.sock");
    let mut args: Vec<OsString> = [
        "--endpoint".into(),
        format!("unix://{}", socket.display()),
        "--node-id".into(),
        "resizer-node".into(),
        "--state-dir".into(),
        d.join("state").display().to_string(),
        "--pool-dir".into(),
        d.join("pool").display().to_string(),
        "--pool-capacity".into(),
        "1Gi".into(),
        "--deferral".into(),
        "disabled".into(),
        "--handover-endpoint".into(),
        String::new(),
        "--crust-root".into(),
        d.join("crust").display().to_string(),
        "--kata-root".into(),
        d.join("kata").display().to_string(),
    ]
    .into_iter()
    .map(OsString::from)
    .collect();
    args.extend(peer_flags.iter().map(OsString::from));
    let bin = crust_testkit::workspace_bin("crust-csi");
    let mut p = PluginProcess::spawn(&bin, &args, &[], &d.join("crust-csi.log")).unwrap();
    if let Err(e) = p.wait_ready(&socket, Duration::from_secs(30)).await {
        panic!("{e}\n{}", p.log_tail(4000));
    }
    Plugin { proc: p, socket }
}

/// The flags of a node serving peers on `own` and asking `all`.
pub fn peer_flags(own: u16, all: &[u16], key: &Path) -> Vec<String> {
    let peers: Vec<String> = all.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    vec![
        format!("--peer-address=127.0.0.1:{own}"),
        format!("--peers={}", peers.join(",")),
        format!("--peer-key-file={}", key.display()),
    ]
}

/// A loopback port free at the moment.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn mount_cap(fs_group: Option<u32>) -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            volume_supplemental_group: fs_group.map(|g| g.to_string()).unwrap_or_default(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

/// A volume as kubelet left it for a pod.
pub struct Published {
    pub volume_id: String,
    pub staging: String,
    /// `<pods dir>/<uid>/volumes/kubernetes.io~csi/<name>/mount`.
    pub target: String,
}

/// crust-csi's CreateVolume (64 MiB ext4) + NodeStage + NodePublish for
/// pod `uid`, under the env's kubelet pods dir; `deferred`: KEP-2857's
/// `defer_fs_ops`.
pub async fn publish(env: &Env, csi: &Csi, name: &str, uid: &str, deferred: bool) -> Published {
    publish_with(env, csi, name, uid, deferred, None).await
}

/// [`publish`] with the pod's fsGroup in the publish capability (as
/// kubelet sends it when the driver takes `VOLUME_MOUNT_GROUP`).
pub async fn publish_with(
    env: &Env,
    csi: &Csi,
    name: &str,
    uid: &str,
    deferred: bool,
    fs_group: Option<u32>,
) -> Published {
    let vol = csi
        .create_volume(csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: (64 * MIB) as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_cap(None)],
            ..Default::default()
        })
        .await
        .unwrap()
        .volume
        .unwrap();
    let staging = env.dir.path().join("kubelet/plugins/g").join(name);
    std::fs::create_dir_all(&staging).unwrap();
    let staging = staging.display().to_string();
    csi.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.clone(),
        volume_capability: Some(mount_cap(None)),
        volume_context: vol.volume_context.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let target = env
        .pods_dir
        .join(uid)
        .join("volumes/kubernetes.io~csi")
        .join(name)
        .join("mount");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let target = target.display().to_string();
    csi.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.clone(),
        target_path: target.clone(),
        volume_capability: Some(mount_cap(fs_group)),
        volume_context: vol.volume_context,
        defer_fs_ops: deferred,
        ..Default::default()
    })
    .await
    .unwrap();
    Published {
        volume_id: vol.volume_id,
        staging,
        target,
    }
}

/// Runs `sh -c script` in container `cid` through CRI's ExecSync (60 s):
/// (exit code, stdout then stderr).
pub async fn exec(cri: &mut crust_cri::Cri, cid: &str, script: &str) -> (i32, String) {
    exec_timeout(cri, cid, script, 60).await
}

/// StopPodSandbox then RemovePodSandbox, as kubelet ends a pod.
pub async fn stop_and_remove_sandbox(cri: &mut crust_cri::Cri, sandbox: &str) {
    cri.runtime
        .stop_pod_sandbox(crust_cri::v1::StopPodSandboxRequest {
            pod_sandbox_id: sandbox.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("StopPodSandbox {sandbox}: {e}"));
    cri.runtime
        .remove_pod_sandbox(crust_cri::v1::RemovePodSandboxRequest {
            pod_sandbox_id: sandbox.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("RemovePodSandbox {sandbox}: {e}"));
}

/// [`exec`] with its own timeout in seconds.
pub async fn exec_timeout(
    cri: &mut crust_cri::Cri,
    cid: &str,
    script: &str,
    timeout: i64,
) -> (i32, String) {
    let r = cri
        .runtime
        .exec_sync(crust_cri::v1::ExecSyncRequest {
            container_id: cid.into(),
            cmd: vec!["sh".into(), "-c".into(), script.into()],
            timeout,
        })
        .await
        .unwrap_or_else(|e| panic!("ExecSync {script:?}: {e}"))
        .into_inner();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    (r.exit_code, out)
}

/// A CRI sandbox config for a hostNetwork pod.
pub fn host_network_sandbox(
    name: &str,
    uid: &str,
    attempt: u32,
) -> crust_cri::v1::PodSandboxConfig {
    use crust_cri::v1 as cri;
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            uid: uid.into(),
            namespace: "default".into(),
            attempt,
        }),
        linux: Some(cri::LinuxPodSandboxConfig {
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    network: cri::NamespaceMode::Node as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The CRI log of [`Env::start_busybox_pod`]'s container, below the
/// sandbox config's `log_directory` (no log without one).
pub const BUSYBOX_POD_LOG: &str = "app.log";

impl Env {
    /// RunPodSandbox with crust's handler, then CreateContainer and
    /// StartContainer of one busybox container `app` running `command`
    /// with `mounts`: (sandbox id, container id). Panics with the logs.
    pub async fn start_busybox_pod(
        &self,
        cri: &mut crust_cri::Cri,
        sandbox: &crust_cri::v1::PodSandboxConfig,
        command: &[&str],
        mounts: Vec<crust_cri::v1::Mount>,
    ) -> (String, String) {
        self.start_busybox_pod_with(cri, sandbox, command, mounts, None)
            .await
    }

    /// [`Env::start_busybox_pod`] with the container's `linux` settings
    /// (resources, security context).
    pub async fn start_busybox_pod_with(
        &self,
        cri: &mut crust_cri::Cri,
        sandbox: &crust_cri::v1::PodSandboxConfig,
        command: &[&str],
        mounts: Vec<crust_cri::v1::Mount>,
        linux: Option<crust_cri::v1::LinuxContainerConfig>,
    ) -> (String, String) {
        use crust_cri::v1 as cri;
        let sb = cri
            .runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(sandbox.clone()),
                runtime_handler: crust_testkit::CRUST_HANDLER.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", self.logs()))
            .into_inner()
            .pod_sandbox_id;
        let mut config = busybox_container("app", command, mounts, linux);
        config.log_path = BUSYBOX_POD_LOG.into();
        let cid = create_container(cri, &sb, sandbox, config)
            .await
            .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", self.logs()));
        cri.runtime
            .start_container(cri::StartContainerRequest {
                container_id: cid.clone(),
            })
            .await
            .unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", self.logs()));
        (sb, cid)
    }
}

/// A busybox container `name` running `command` with `mounts` and its
/// `linux` settings (no log path).
pub fn busybox_container(
    name: &str,
    command: &[&str],
    mounts: Vec<crust_cri::v1::Mount>,
    linux: Option<crust_cri::v1::LinuxContainerConfig>,
) -> crust_cri::v1::ContainerConfig {
    use crust_cri::v1 as cri;
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: crust_testkit::BUSYBOX_IMAGE.into(),
            ..Default::default()
        }),
        command: strings(command),
        mounts,
        linux,
        ..Default::default()
    }
}

/// CreateContainer of `config` in sandbox `sb` (containerd only records
/// it: the shim sees it at StartContainer).
pub async fn create_container(
    cri: &mut crust_cri::Cri,
    sb: &str,
    sandbox: &crust_cri::v1::PodSandboxConfig,
    config: crust_cri::v1::ContainerConfig,
) -> Result<String, tonic::Status> {
    cri.runtime
        .create_container(crust_cri::v1::CreateContainerRequest {
            pod_sandbox_id: sb.into(),
            config: Some(config),
            sandbox_config: Some(sandbox.clone()),
        })
        .await
        .map(|r| r.into_inner().container_id)
}

/// CRI ContainerStatus of `cid` (panics when there is none).
pub async fn container_status(
    cri: &mut crust_cri::Cri,
    cid: &str,
) -> crust_cri::v1::ContainerStatus {
    cri.runtime
        .container_status(crust_cri::v1::ContainerStatusRequest {
            container_id: cid.into(),
            verbose: false,
        })
        .await
        .unwrap_or_else(|e| panic!("ContainerStatus {cid}: {e}"))
        .into_inner()
        .status
        .unwrap_or_else(|| panic!("ContainerStatus {cid}: no status"))
}

/// The pod's network namespace (its name under /var/run/netns), from the
/// sandbox's runtime spec in CRI's verbose status.
pub async fn netns_of(cri: &mut crust_cri::Cri, sandbox: &str) -> String {
    let st = cri
        .runtime
        .pod_sandbox_status(crust_cri::v1::PodSandboxStatusRequest {
            pod_sandbox_id: sandbox.into(),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner();
    let info: serde_json::Value = serde_json::from_str(&st.info["info"]).unwrap();
    let path = info["runtimeSpec"]["linux"]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["type"] == "network")
        .and_then(|n| n["path"].as_str())
        .unwrap()
        .to_string();
    path.rsplit('/').next().unwrap().to_string()
}

/// The test's bridge; deleted on drop (CNI's DEL leaves bridges).
pub struct Bridge(pub String);

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.0])
            .status();
    }
}

/// A containerd whose CRI puts pods on one IPv4 bridge network
/// `10.<octet>.<pid>.0/24` (bridge `<prefix><pid>`).
pub fn ipv4_env(
    prefix: &str,
    octet: u8,
    extra_env: Vec<(String, String)>,
) -> (Env, Bridge, tempfile::TempDir) {
    bridge_env(prefix, octet, Vec::new(), extra_env)
}

/// The first three octets of [`ipv4_env`]'s network.
pub fn ipv4_net(octet: u8) -> String {
    format!("10.{octet}.{}", std::process::id() % 250)
}

/// [`ipv4_env`] with `chained` plugins after the bridge in the CNI list.
pub fn bridge_env(
    prefix: &str,
    octet: u8,
    chained: Vec<serde_json::Value>,
    extra_env: Vec<(String, String)>,
) -> (Env, Bridge, tempfile::TempDir) {
    let bridge = Bridge(format!("{prefix}{}", std::process::id() % 100_000));
    let ipam_dir = tempfile::tempdir().unwrap();
    let mut plugins = vec![serde_json::json!({
        "type": "bridge", "bridge": bridge.0, "isGateway": true,
        "ipam": {"type": "host-local",
                 "ranges": [[{"subnet": format!("{}.0/24", ipv4_net(octet))}]],
                 "routes": [{"dst": "0.0.0.0/0"}],
                 "dataDir": ipam_dir.path().display().to_string()}
    })];
    plugins.extend(chained);
    let conflist = serde_json::json!({
        "cniVersion": "1.0.0", "name": "crust-test", "plugins": plugins
    });
    let env = Env::start_full(
        crust_testkit::CRI_NAMESPACE,
        extra_env,
        Some(conflist.to_string()),
    );
    (env, bridge, ipam_dir)
}
