//! What one pod asks for: the volume, the deferral route, the workload,
//! and kubelet's paths derived from them.

use std::collections::HashMap;
use std::path::PathBuf;

use serde::Serialize;

use super::host::{hex_sha256, random_uuid};
use crate::runtime_cli::RuntimeCli;
use crust_handoff::FsGroupChangePolicy;

/// Where the workload sees the volume.
pub const MOUNT_DESTINATION: &str = "/data";
/// StorageClass parameter / volume-context key that selects deferral.
pub const DEFER_PARAM: &str = "deferFsOps";

/// How the pod asks for deferred filesystem operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeferVia {
    /// KEP-2857: `defer_fs_ops=true` in NodePublish/Stats/Expand/Unpublish.
    Request,
    /// Today's clusters: StorageClass parameter `deferFsOps=true`, carried
    /// by the driver in the volume context; requests carry no extension.
    StorageClass,
    /// No deferral: the plugin mounts on the host (KEP stories 2-4). The
    /// VM runtime cannot share a host mount, so no sandbox is started.
    None,
}

/// The pod's single container.
#[derive(Debug, Clone)]
pub struct Workload {
    pub args: Vec<String>,
    /// `KEY=VALUE` entries added after `PATH`.
    pub env: Vec<String>,
    pub cwd: String,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            args: vec![
                "sh".into(),
                "-c".into(),
                "while true; do date -u >> /data/out.txt; sync; sleep 1; done".into(),
            ],
            env: Vec::new(),
            cwd: "/".into(),
        }
    }
}

/// What the flow does.
#[derive(Debug, Clone)]
pub struct FlowConfig {
    /// kubelet's root is `<work_dir>/kubelet`; bundles go to `<work_dir>/bundles`.
    pub work_dir: PathBuf,
    pub runtime: RuntimeCli,
    /// The CSI driver name in kubelet's staging path (default: GetPluginInfo).
    pub driver_name: Option<String>,
    /// CreateVolume name (the PVC's volume name).
    pub volume_name: String,
    /// PV name in the publish path (default: the volume name).
    pub pv_name: Option<String>,
    pub pod_uid: String,
    pub sandbox_id: String,
    pub size: u64,
    /// ControllerExpandVolume + NodeExpandVolume to this size (None: skip).
    pub expand_to: Option<u64>,
    pub fs_type: String,
    pub mount_flags: Vec<String>,
    /// The pod's fsGroup (`volume_supplemental_group`).
    pub fs_group: Option<u32>,
    pub change_policy: Option<FsGroupChangePolicy>,
    pub sub_path: Option<String>,
    pub defer_via: DeferVia,
    /// Extra CreateVolume parameters.
    pub params: HashMap<String, String>,
    pub workload: Workload,
    /// Leave the volume (data) in place: no DeleteVolume.
    pub keep_volume: bool,
    /// A shell command run in the guest before the sandbox stops; its
    /// output lands in the report.
    pub collect: Option<String>,
    /// Start the pod in the VM runtime after a deferred publish. Without
    /// it the flow stops at the hand-off record (nobody consumes it, so
    /// stats and expansion are skipped).
    pub start_sandbox: bool,
    /// More bind mounts of the container: (destination, host source).
    pub extra_mounts: Vec<(String, String)>,
}

impl FlowConfig {
    /// Defaults: 256 MiB ext4 expanded to 512 MiB, deferral by request,
    /// the default workload, random pod uid, sandbox id and volume name.
    pub fn new(work_dir: impl Into<PathBuf>, runtime: RuntimeCli) -> FlowConfig {
        let uid = random_uuid();
        FlowConfig {
            work_dir: work_dir.into(),
            runtime,
            driver_name: None,
            volume_name: format!("pvc-{}", random_uuid()),
            pv_name: None,
            sandbox_id: format!("crust-pod-{}", &uid[..8]),
            pod_uid: uid,
            size: 256 << 20,
            expand_to: Some(512 << 20),
            fs_type: "ext4".into(),
            mount_flags: Vec::new(),
            fs_group: None,
            change_policy: None,
            sub_path: None,
            defer_via: DeferVia::Request,
            params: HashMap::new(),
            workload: Workload::default(),
            keep_volume: false,
            collect: None,
            start_sandbox: true,
            extra_mounts: Vec::new(),
        }
    }

    pub fn deferred(&self) -> bool {
        self.defer_via != DeferVia::None
    }

    pub fn kubelet_dir(&self) -> PathBuf {
        self.work_dir.join("kubelet")
    }

    /// `<kubelet>/pods`: where the runtime stops probing for subPaths.
    pub fn pods_dir(&self) -> PathBuf {
        self.kubelet_dir().join("pods")
    }

    /// kubelet's staging path: `.../plugins/kubernetes.io/csi/<driver>/<sha256(volume handle)>/globalmount`.
    pub fn staging_path(&self, driver: &str, volume_id: &str) -> PathBuf {
        self.kubelet_dir()
            .join("plugins/kubernetes.io/csi")
            .join(driver)
            .join(hex_sha256(volume_id))
            .join("globalmount")
    }

    /// kubelet's publish path: `.../pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`.
    pub fn target_path(&self) -> PathBuf {
        self.pods_dir()
            .join(&self.pod_uid)
            .join("volumes/kubernetes.io~csi")
            .join(self.pv_name.as_deref().unwrap_or(&self.volume_name))
            .join("mount")
    }

    pub fn bundle_dir(&self) -> PathBuf {
        self.work_dir.join("bundles").join(&self.sandbox_id)
    }
}
