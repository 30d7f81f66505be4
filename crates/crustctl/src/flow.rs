//! `crustctl flow`: plays kubelet and the container manager for one pod,
//! the way KEP-2857 story 1 walks through it.
//!
//! CreateVolume, NodeStageVolume (kubelet's globalmount path),
//! NodePublishVolume with deferral (`defer_fs_ops`, or the StorageClass
//! parameter `deferFsOps=true` carried in the volume context), an OCI
//! bundle whose `/data` mount is the publish target (+ subPath), the VM
//! runtime's create/start, NodeGetVolumeStats, ControllerExpandVolume +
//! NodeExpandVolume, stats again, then the teardown in reverse: runtime
//! kill/delete, NodeUnpublishVolume, NodeUnstageVolume, DeleteVolume.
//!
//! Every step is reported as it completes. Whatever a step created is
//! pushed on an undo stack, so after a failure (or Ctrl-C) exactly the
//! teardown steps that apply run, in reverse.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crust_proto::csi::v1 as csi;
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tonic::{Code, Status};

use crate::client::Csi;
use crate::fmt::Render;
use crate::parse::{human_duration, human_size};
use crate::runtime_cli::{RuntimeCli, parse_df};
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

/// One completed step.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    pub step: String,
    pub ok: bool,
    pub duration_ms: f64,
    /// What happened (or why it failed).
    pub detail: String,
}

impl StepReport {
    /// `✓ CreateVolume          41.2ms  pvc-…: 256.0Mi ext4`
    pub fn line(&self) -> String {
        format!(
            "{} {:<26} {:>8}  {}",
            if self.ok { "✓" } else { "✗" },
            self.step,
            human_duration(Duration::from_secs_f64(self.duration_ms / 1000.0)),
            self.detail
        )
    }
}

/// total / used / available of one unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Figures {
    pub total: u64,
    pub used: u64,
    pub available: u64,
}

/// `df` of the volume as the workload sees it (guest, or host when not
/// deferred).
#[derive(Debug, Clone, Serialize)]
pub struct DfView {
    pub bytes: Figures,
    pub inodes: Figures,
}

/// NodeGetVolumeStats, summarised.
#[derive(Debug, Clone, Serialize)]
pub struct StatsView {
    pub bytes: Option<Figures>,
    pub inodes: Option<Figures>,
    /// None: the plugin reported no condition.
    pub abnormal: Option<bool>,
    pub message: String,
}

impl StatsView {
    fn from_proto(r: &csi::NodeGetVolumeStatsResponse) -> StatsView {
        use csi::volume_usage::Unit;
        let pick = |unit: Unit| {
            r.usage
                .iter()
                .find(|u| u.unit == unit as i32)
                .map(|u| Figures {
                    total: u.total.max(0) as u64,
                    used: u.used.max(0) as u64,
                    available: u.available.max(0) as u64,
                })
        };
        StatsView {
            bytes: pick(Unit::Bytes),
            inodes: pick(Unit::Inodes),
            abnormal: r.volume_condition.as_ref().map(|c| c.abnormal),
            message: r
                .volume_condition
                .as_ref()
                .map(|c| c.message.clone())
                .unwrap_or_default(),
        }
    }

    pub fn health(&self) -> String {
        match self.abnormal {
            None => "not reported".into(),
            Some(false) if self.message.is_empty() => "normal".into(),
            Some(false) => format!("normal ({})", self.message),
            Some(true) => format!("ABNORMAL: {}", self.message),
        }
    }

    fn text(&self) -> String {
        let mut s = String::new();
        if let Some(b) = self.bytes {
            let _ = write!(
                s,
                "{} used of {}",
                human_size(b.used as i64),
                human_size(b.total as i64)
            );
        }
        if let Some(i) = self.inodes {
            let _ = write!(s, ", {} of {} inodes", i.used, i.total);
        }
        let _ = write!(s, "; health {}", self.health());
        s
    }
}

/// The volume as CreateVolume returned it.
#[derive(Debug, Clone, Serialize)]
pub struct VolumeInfo {
    pub id: String,
    pub name: String,
    pub capacity_bytes: i64,
    pub fs_type: String,
    pub context: std::collections::BTreeMap<String, String>,
}

/// Figures observed at one point of the flow.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Observation {
    pub df: Option<DfView>,
    pub stats: Option<StatsView>,
    /// NodeGetVolumeHealth (CSI v1.13); None when the plugin does not serve it.
    pub health: Option<HealthView>,
}

/// NodeGetVolumeHealth (CSI v1.13), summarised.
#[derive(Debug, Clone, Serialize)]
pub struct HealthView {
    /// `(status, reason, message)` of each adverse condition; empty: healthy.
    pub entries: Vec<(String, String, String)>,
}

impl HealthView {
    fn from_proto(h: &csi::VolumeHealth) -> HealthView {
        HealthView {
            entries: h
                .health_statuses
                .iter()
                .map(|e| {
                    let status = csi::VolumeHealthErrorType::try_from(e.status)
                        .map(|s| s.as_str_name().to_string())
                        .unwrap_or_else(|_| e.status.to_string());
                    (status, e.reason.clone(), e.message.clone())
                })
                .collect(),
        }
    }

    pub fn text(&self) -> String {
        if self.entries.is_empty() {
            return "healthy (no adverse condition)".into();
        }
        self.entries
            .iter()
            .map(|(s, r, m)| format!("{s} {r}: {m}"))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct FlowReport {
    /// Every step and teardown step succeeded.
    pub ok: bool,
    pub driver: String,
    pub node_id: String,
    pub defer_via: Option<DeferVia>,
    pub volume: Option<VolumeInfo>,
    pub staging_path: String,
    pub target_path: String,
    /// The OCI mount source (target + subPath).
    pub mount_source: String,
    pub bundle: String,
    pub sandbox_id: String,
    pub qemu_pid: Option<i32>,
    /// The guest's accelerator (`kvm`/`tcg`) as the runtime reports it.
    pub accel: Option<String>,
    /// Why the runtime chose it (a hanging KVM retried under TCG says so).
    pub accel_reason: Option<String>,
    /// Where the runtime mounted the volume in the guest.
    pub guest_volume_path: Option<String>,
    pub before_expand: Observation,
    pub after_expand: Observation,
    /// NodeExpandVolume's capacity.
    pub expanded_bytes: Option<i64>,
    /// Output of the `collect` command.
    pub collected: Option<String>,
    pub steps: Vec<StepReport>,
    /// First failed step and its error.
    pub failed_step: Option<String>,
    pub error: Option<String>,
    pub notes: Vec<String>,
}

impl Render for FlowReport {
    fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("report serializes")
    }

    /// A summary; the steps were printed as they happened.
    fn to_text(&self) -> String {
        let mut out = String::new();
        if let Some(v) = &self.volume {
            let _ = writeln!(
                out,
                "volume {} ({}): {} {}",
                v.id,
                v.name,
                human_size(v.capacity_bytes),
                v.fs_type
            );
        }
        for (label, o) in [
            ("before expansion", &self.before_expand),
            ("after expansion", &self.after_expand),
        ] {
            if let Some(df) = &o.df {
                let _ = writeln!(
                    out,
                    "{label}: df {} total, {} used, {} available",
                    human_size(df.bytes.total as i64),
                    human_size(df.bytes.used as i64),
                    human_size(df.bytes.available as i64)
                );
            }
            if let Some(s) = &o.stats {
                let _ = writeln!(out, "{label}: NodeGetVolumeStats {}", s.text());
            }
        }
        if let Some(c) = &self.collected {
            let _ = writeln!(out, "collected in the guest:");
            for l in c.lines() {
                let _ = writeln!(out, "  {l}");
            }
        }
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        match (&self.failed_step, &self.error) {
            (Some(s), Some(e)) => {
                let _ = writeln!(out, "FAILED at {s}: {e}");
            }
            _ if self.ok => out.push_str("flow completed\n"),
            _ => out.push_str("FAILED\n"),
        }
        out
    }
}

/// The step that failed and why.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{step} failed: {message}")]
pub struct FlowError {
    pub step: String,
    pub message: String,
}

/// Receives each step as it completes.
pub type Progress = Arc<dyn Fn(&StepReport) + Send + Sync>;

/// What teardown has to undo.
#[derive(Debug, Clone)]
enum Undo {
    Volume(String),
    Staged {
        volume: String,
        path: String,
    },
    Published {
        volume: String,
        target: String,
    },
    Sandbox(String),
    /// A directory we made (removed only when empty).
    Dir(PathBuf),
    /// A tree of our own files (the bundle).
    Tree(PathBuf),
}

/// One pod's flow; see the module docs. Use [`Flow::run`] for the whole
/// thing, or the phases ([`Flow::bring_up`], [`Flow::exercise`],
/// [`Flow::tear_down`]) to look around in between.
pub struct Flow {
    cfg: FlowConfig,
    csi: Csi,
    progress: Progress,
    stop: Option<watch::Receiver<bool>>,
    report: FlowReport,
    undo: Vec<Undo>,
    volume_id: Option<String>,
    volume_context: HashMap<String, String>,
    staging: Option<String>,
    target: String,
    /// `defer_fs_ops` on NodeUnpublish (what kubelet remembered).
    unpublish_defer: bool,
    sandbox_up: bool,
}

fn elapsed_ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1000.0
}

fn status_text(s: &Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// Runs `fut` unless `stop` fires first.
async fn guarded<T>(
    stop: &Option<watch::Receiver<bool>>,
    fut: impl Future<Output = Result<T, String>>,
) -> Result<T, String> {
    let Some(mut rx) = stop.clone() else {
        return fut.await;
    };
    if *rx.borrow() {
        return Err("interrupted".into());
    }
    tokio::select! {
        r = fut => r,
        _ = async {
            if rx.wait_for(|v| *v).await.is_err() {
                std::future::pending::<()>().await;
            }
        } => Err("interrupted".into()),
    }
}

impl Flow {
    pub fn new(cfg: FlowConfig, csi: Csi, progress: Progress) -> Flow {
        let target = cfg.target_path().display().to_string();
        let unpublish_defer = cfg.defer_via == DeferVia::Request;
        let report = FlowReport {
            defer_via: Some(cfg.defer_via),
            target_path: target.clone(),
            sandbox_id: cfg.sandbox_id.clone(),
            bundle: cfg.bundle_dir().display().to_string(),
            ..Default::default()
        };
        Flow {
            cfg,
            csi,
            progress,
            stop: None,
            report,
            undo: Vec::new(),
            volume_id: None,
            volume_context: HashMap::new(),
            staging: None,
            target,
            unpublish_defer,
            sandbox_up: false,
        }
    }

    /// Bring-up and exercise stop early once `true` is sent; teardown
    /// still runs in full.
    pub fn with_stop(mut self, stop: watch::Receiver<bool>) -> Flow {
        self.stop = Some(stop);
        self
    }

    pub fn config(&self) -> &FlowConfig {
        &self.cfg
    }
    pub fn report(&self) -> &FlowReport {
        &self.report
    }
    pub fn runtime(&self) -> &RuntimeCli {
        &self.cfg.runtime
    }
    pub fn csi(&self) -> &Csi {
        &self.csi
    }
    /// Talk to another plugin process from now on (a restarted plugin).
    pub fn set_csi(&mut self, csi: Csi) {
        self.csi = csi;
    }
    /// What NodeUnpublishVolume sends as `defer_fs_ops` (KEP story 5: a
    /// downgraded plugin no longer gets it).
    pub fn set_unpublish_defer(&mut self, defer: bool) {
        self.unpublish_defer = defer;
    }
    pub fn volume_id(&self) -> Option<&str> {
        self.volume_id.as_deref()
    }
    pub fn target_path(&self) -> &str {
        &self.target
    }
    pub fn staging_path(&self) -> Option<&str> {
        self.staging.as_deref()
    }
    /// The sandbox id while it runs.
    pub fn sandbox(&self) -> Option<&str> {
        self.sandbox_up.then_some(self.cfg.sandbox_id.as_str())
    }
    pub fn note(&mut self, n: impl Into<String>) {
        self.report.notes.push(n.into());
    }
    /// Whether something is left for [`Flow::tear_down`] to undo.
    pub fn holds_resources(&self) -> bool {
        !self.undo.is_empty()
    }

    /// Records a step; a failure becomes the flow's error (the first one
    /// wins).
    fn record(
        &mut self,
        step: &str,
        t0: Instant,
        res: Result<String, String>,
    ) -> Result<(), FlowError> {
        let (ok, detail) = match &res {
            Ok(d) => (true, d.clone()),
            Err(e) => (false, e.clone()),
        };
        let s = StepReport {
            step: step.to_string(),
            ok,
            duration_ms: elapsed_ms(t0),
            detail,
        };
        (self.progress)(&s);
        self.report.steps.push(s);
        match res {
            Ok(_) => Ok(()),
            Err(message) => {
                if self.report.failed_step.is_none() {
                    self.report.failed_step = Some(step.to_string());
                    self.report.error = Some(message.clone());
                }
                Err(FlowError {
                    step: step.to_string(),
                    message,
                })
            }
        }
    }

    /// Makes `dir` and its missing parents, remembering each for teardown.
    fn make_dirs(&mut self, dir: &Path) -> Result<(), String> {
        crate::dirs::create_missing(dir, |p| {
            // kubelet's directories are root-only.
            let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o750));
            self.undo.push(Undo::Dir(p.to_path_buf()));
        })
        .map_err(|(p, e)| format!("create {}: {e}", p.display()))
    }

    /// The capability of stage/expand (`publish = false`) or of the publish
    /// (with the KEP-2857 group fields when deferred).
    pub fn capability(&self, publish: bool) -> csi::VolumeCapability {
        use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
        // The KEP fields exist only for a deferred publish.
        let sup = publish && self.cfg.deferred();
        csi::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: self.cfg.fs_type.clone(),
                mount_flags: self.cfg.mount_flags.clone(),
                volume_mount_group: String::new(),
                volume_supplemental_group: match (sup, self.cfg.fs_group) {
                    (true, Some(g)) => g.to_string(),
                    _ => String::new(),
                },
                volume_supplemental_group_change_policy: match (sup, self.cfg.change_policy) {
                    (true, Some(p)) if self.cfg.fs_group.is_some() => p.as_str().to_string(),
                    _ => String::new(),
                },
            })),
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
        }
    }

    fn request_defer(&self) -> bool {
        self.cfg.defer_via == DeferVia::Request
    }

    /// The whole flow: bring-up, exercise, teardown. `report().ok` says
    /// whether everything succeeded.
    pub async fn run(mut self) -> FlowReport {
        if self.bring_up().await.is_ok() {
            let _ = self.exercise().await;
        }
        self.tear_down().await;
        self.report
    }

    /// Plugin discovery, CreateVolume, NodeStageVolume, NodePublishVolume,
    /// the OCI bundle, runtime create and start: each a named step.
    pub async fn bring_up(&mut self) -> Result<(), FlowError> {
        let (driver, topology) = self.discover_plugin().await?;
        let vol = self.create_volume(topology).await?;
        let staging = self.stage(&driver, &vol).await?;
        self.publish(&vol, &staging).await?;
        let source = match &self.cfg.sub_path {
            Some(s) => format!("{}/{}", self.target, s.trim_start_matches('/')),
            None => self.target.clone(),
        };
        self.report.mount_source = source.clone();
        if !self.cfg.deferred() {
            self.note("no deferral: the volume stays on the host and no sandbox is started");
            return Ok(());
        }
        if !self.cfg.start_sandbox {
            self.note("no sandbox started: the hand-off record stays unconsumed");
            return Ok(());
        }

        let bundle = self.bundle(&source)?;
        self.start_sandbox(&bundle).await
    }

    /// Records a failed step and returns its error.
    fn fail<T>(&mut self, step: &str, t0: Instant, e: String) -> Result<T, FlowError> {
        match self.record(step, t0, Err(e)) {
            Err(e) => Err(e),
            Ok(()) => unreachable!("a failed step records an error"),
        }
    }

    /// GetPluginInfo, NodeGetInfo, NodeGetCapabilities: the driver name for
    /// kubelet's paths and the node's topology.
    async fn discover_plugin(&mut self) -> Result<(String, Option<csi::Topology>), FlowError> {
        use csi::node_service_capability::{Type, rpc::Type as T};
        let stop = self.stop.clone();
        let c = self.csi.clone();
        let t0 = Instant::now();
        let r = guarded(&stop, async {
            let info = c
                .get_plugin_info(Default::default())
                .await
                .map_err(|s| format!("GetPluginInfo: {}", status_text(&s)))?;
            let node = c
                .node_get_info(Default::default())
                .await
                .map_err(|s| format!("NodeGetInfo: {}", status_text(&s)))?;
            let caps = c
                .node_get_capabilities(Default::default())
                .await
                .map_err(|s| format!("NodeGetCapabilities: {}", status_text(&s)))?;
            let has: Vec<i32> = caps
                .capabilities
                .iter()
                .filter_map(|c| c.r#type.as_ref().map(|Type::Rpc(r)| r.r#type))
                .collect();
            Ok((info, node, has))
        })
        .await;
        let (info, node, has) = match r {
            Ok(v) => v,
            Err(e) => return self.fail("plugin", t0, e),
        };
        let defer_cap = has.contains(&(T::DeferFsOps as i32));
        self.report.driver = info.name.clone();
        self.report.node_id = node.node_id.clone();
        if self.cfg.deferred() && !defer_cap {
            // kubelet would refuse here (KEP story 6); we let the plugin
            // answer so its error is visible.
            self.note("the plugin does not advertise DEFER_FS_OPS");
        }
        let detail = format!(
            "{} {} on node {}{}",
            info.name,
            info.vendor_version,
            node.node_id,
            if defer_cap {
                ", DEFER_FS_OPS advertised"
            } else {
                ", no DEFER_FS_OPS"
            }
        );
        self.record("plugin", t0, Ok(detail))?;
        Ok((
            self.cfg.driver_name.clone().unwrap_or(info.name),
            node.accessible_topology,
        ))
    }

    /// CreateVolume with the flow's parameters (and deferFsOps=true when
    /// deferral goes through the StorageClass).
    async fn create_volume(
        &mut self,
        topology: Option<csi::Topology>,
    ) -> Result<csi::Volume, FlowError> {
        let stop = self.stop.clone();
        let c = self.csi.clone();
        let mut params = self.cfg.params.clone();
        if self.cfg.defer_via == DeferVia::StorageClass {
            params.insert(DEFER_PARAM.into(), "true".into());
        }
        let req = csi::CreateVolumeRequest {
            name: self.cfg.volume_name.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: self.cfg.size as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![self.capability(false)],
            parameters: params,
            accessibility_requirements: topology.map(|t| csi::TopologyRequirement {
                requisite: vec![t.clone()],
                preferred: vec![t],
            }),
            ..Default::default()
        };
        let t0 = Instant::now();
        let r = guarded(&stop, async {
            c.create_volume(req)
                .await
                .map_err(|s| status_text(&s))?
                .volume
                .filter(|v| !v.volume_id.is_empty())
                .ok_or_else(|| "the response carries no volume".to_string())
        })
        .await;
        let vol = match r {
            Ok(v) => v,
            Err(e) => return self.fail("CreateVolume", t0, e),
        };
        self.undo.push(Undo::Volume(vol.volume_id.clone()));
        self.volume_id = Some(vol.volume_id.clone());
        self.volume_context = vol.volume_context.clone();
        let fs_type = vol
            .volume_context
            .get("fsType")
            .cloned()
            .unwrap_or_else(|| self.cfg.fs_type.clone());
        self.report.volume = Some(VolumeInfo {
            id: vol.volume_id.clone(),
            name: self.cfg.volume_name.clone(),
            capacity_bytes: vol.capacity_bytes,
            fs_type: fs_type.clone(),
            context: vol.volume_context.clone().into_iter().collect(),
        });
        let ctx_text = {
            let mut kv: Vec<String> = vol
                .volume_context
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            kv.sort();
            kv.join(",")
        };
        self.record(
            "CreateVolume",
            t0,
            Ok(format!(
                "{}: {} {} (context {})",
                vol.volume_id,
                human_size(vol.capacity_bytes),
                fs_type,
                if ctx_text.is_empty() { "-" } else { &ctx_text }
            )),
        )?;
        if self.cfg.defer_via == DeferVia::StorageClass
            && vol.volume_context.get(DEFER_PARAM).map(String::as_str) != Some("true")
        {
            self.note(format!(
                "the driver did not carry {DEFER_PARAM}=true into the volume context"
            ));
        }
        Ok(vol)
    }

    /// NodeStageVolume at kubelet's staging path.
    async fn stage(&mut self, driver: &str, vol: &csi::Volume) -> Result<PathBuf, FlowError> {
        let stop = self.stop.clone();
        let c = self.csi.clone();
        let staging = self.cfg.staging_path(driver, &vol.volume_id);
        let t0 = Instant::now();
        if let Err(e) = self.make_dirs(&staging) {
            return self.fail("NodeStageVolume", t0, e);
        }
        let staging_s = staging.display().to_string();
        self.staging = Some(staging_s.clone());
        self.report.staging_path = staging_s.clone();
        let req = csi::NodeStageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            publish_context: HashMap::new(),
            staging_target_path: staging_s.clone(),
            volume_capability: Some(self.capability(false)),
            secrets: HashMap::new(),
            volume_context: self.volume_context.clone(),
        };
        let r = guarded(&stop, async {
            c.node_stage_volume(req).await.map_err(|s| status_text(&s))
        })
        .await;
        if let Err(e) = r {
            return self.fail("NodeStageVolume", t0, e);
        }
        self.undo.push(Undo::Staged {
            volume: vol.volume_id.clone(),
            path: staging_s.clone(),
        });
        let staged_mounted = is_mountpoint(&staging);
        self.record(
            "NodeStageVolume",
            t0,
            Ok(format!(
                "{staging_s} ({})",
                if staged_mounted {
                    "mounted on the host"
                } else {
                    "not mounted on the host"
                }
            )),
        )?;
        Ok(staging)
    }

    /// NodePublishVolume at kubelet's target, and a check that the host
    /// mounts are what deferral (or its absence) promises.
    async fn publish(&mut self, vol: &csi::Volume, staging: &Path) -> Result<(), FlowError> {
        let stop = self.stop.clone();
        let c = self.csi.clone();
        let staging_s = staging.display().to_string();
        let target = PathBuf::from(&self.target);
        let t0 = Instant::now();
        if let Err(e) = self.make_dirs(target.parent().expect("target has a parent")) {
            return self.fail("NodePublishVolume", t0, e);
        }
        let req = csi::NodePublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            publish_context: HashMap::new(),
            staging_target_path: staging_s.clone(),
            target_path: self.target.clone(),
            volume_capability: Some(self.capability(true)),
            readonly: false,
            secrets: HashMap::new(),
            volume_context: self.volume_context.clone(),
            defer_fs_ops: self.request_defer(),
        };
        let r = guarded(&stop, async {
            c.node_publish_volume(req)
                .await
                .map_err(|s| status_text(&s))
        })
        .await;
        if let Err(e) = r {
            return self.fail("NodePublishVolume", t0, e);
        }
        self.undo.push(Undo::Published {
            volume: vol.volume_id.clone(),
            target: self.target.clone(),
        });
        // A deferred target shows the plugin's placeholder, never
        // the volume's filesystem.
        let mounted = is_mountpoint(&target) && !is_placeholder(&target);
        let staging_mounted = is_mountpoint(staging);
        let r = match (self.cfg.deferred(), mounted) {
            // The guest will mount it: a host mount too would corrupt it.
            (true, false) if staging_mounted => Err(format!(
                "deferral was requested but the filesystem is still mounted on the host at {staging_s}"
            )),
            (true, false) => Ok(format!(
                "{} (deferred: nothing mounted on the host{})",
                self.target,
                match (self.cfg.fs_group, self.cfg.change_policy) {
                    (Some(g), Some(p)) => format!(", fsGroup {g} {}", p.as_str()),
                    (Some(g), None) => format!(", fsGroup {g}"),
                    _ => String::new(),
                }
            )),
            (true, true) => Err(format!(
                "deferral was requested but {} is mounted on the host",
                self.target
            )),
            (false, true) => Ok(format!("{} (mounted on the host)", self.target)),
            (false, false) => Err(format!(
                "{} is not a mount point after a publish without deferral",
                self.target
            )),
        };
        self.record("NodePublishVolume", t0, r)
    }

    /// The pod's OCI bundle, with the volume's target as a mount source.
    fn bundle(&mut self, source: &str) -> Result<PathBuf, FlowError> {
        let t0 = Instant::now();
        let bundle = self.cfg.bundle_dir();
        let r = self.write_bundle(&bundle, source);
        let r = r.map(|()| {
            format!(
                "{}: {} with {} <- {}",
                bundle.join("config.json").display(),
                self.cfg
                    .workload
                    .args
                    .first()
                    .map(String::as_str)
                    .unwrap_or("?"),
                MOUNT_DESTINATION,
                source
            )
        });
        self.record("OCI bundle", t0, r)?;
        Ok(bundle)
    }

    /// Runtime create (the guest boots and mounts the volume) and start.
    async fn start_sandbox(&mut self, bundle: &Path) -> Result<(), FlowError> {
        let stop = self.stop.clone();
        let rt = self.cfg.runtime.clone();
        let id = self.cfg.sandbox_id.clone();
        let pods = self.cfg.pods_dir().display().to_string();
        let bundle_s = bundle.display().to_string();
        self.undo.push(Undo::Sandbox(id.clone()));
        self.sandbox_up = true;
        let t0 = Instant::now();
        let r = guarded(&stop, async {
            rt.ok(&[
                "--pods-layer-stop",
                &pods,
                "create",
                "--bundle",
                &bundle_s,
                &id,
            ])
            .await
            .map_err(|e| e.to_string())?;
            rt.json(&["state", &id]).await.map_err(|e| e.to_string())
        })
        .await;
        let st = match r {
            Ok(st) => st,
            Err(e) => return self.record("runtime create", t0, Err(e)),
        };
        self.report.qemu_pid = st["qemu"]["pid"].as_i64().map(|p| p as i32);
        self.report.accel = st["accel"]["accel"].as_str().map(str::to_string);
        self.report.accel_reason = st["accel"]["reason"].as_str().map(str::to_string);
        let vol_entry = st["volumes"]
            .as_array()
            .and_then(|vs| vs.iter().find(|v| v["target"] == self.target.as_str()))
            .cloned();
        let r = match vol_entry {
            Some(v) => {
                let gp = format!(
                    "/run/crust/volumes/{}",
                    v["id"].as_str().unwrap_or_default()
                );
                self.report.guest_volume_path = Some(gp.clone());
                Ok(format!(
                    "sandbox {id}: QEMU pid {} ({}), {} ({} {}) mounted at {gp} in the guest",
                    self.report
                        .qemu_pid
                        .map(|p| p.to_string())
                        .unwrap_or_else(|| "?".into()),
                    self.report.accel.as_deref().unwrap_or("?"),
                    v["device"].as_str().unwrap_or("?"),
                    v["fstype"].as_str().unwrap_or("?"),
                    v["layout"].as_str().unwrap_or("?"),
                ))
            }
            None => Err(format!(
                "the runtime found no hand-off record for {} (it would not be in the guest)",
                self.target
            )),
        };
        self.record("runtime create", t0, r)?;
        let t0 = Instant::now();
        let r = guarded(&stop, async {
            rt.ok(&["--pods-layer-stop", &pods, "start", &id])
                .await
                .map_err(|e| e.to_string())?;
            Ok(format!(
                "workload {:?} running",
                self.cfg.workload.args.join(" ")
            ))
        })
        .await;
        self.record("runtime start", t0, r)
    }

    fn write_bundle(&mut self, bundle: &Path, source: &str) -> Result<(), String> {
        if bundle.exists() {
            return Err(format!("{} already exists", bundle.display()));
        }
        self.make_dirs(bundle.parent().expect("bundle has a parent"))?;
        std::fs::create_dir(bundle).map_err(|e| format!("create {}: {e}", bundle.display()))?;
        self.undo.push(Undo::Tree(bundle.to_path_buf()));
        std::fs::create_dir(bundle.join("rootfs")).map_err(|e| format!("create rootfs: {e}"))?;
        let spec = bundle_spec(&self.cfg, source);
        let bytes = serde_json::to_vec_pretty(&spec).expect("spec serializes");
        std::fs::write(bundle.join("config.json"), bytes)
            .map_err(|e| format!("write config.json: {e}"))
    }

    /// Guest (or host) `df`, NodeGetVolumeStats, the expansion, both
    /// again, and the `collect` command.
    pub async fn exercise(&mut self) -> Result<(), FlowError> {
        if self.cfg.deferred() && self.sandbox().is_none() {
            // Nobody consumed the record: nothing can answer for the volume.
            return Ok(());
        }
        self.observe(false).await?;
        if let Some(size) = self.cfg.expand_to {
            self.expand(size).await?;
            self.observe(true).await?;
        }
        if let Some(cmd) = self.cfg.collect.clone()
            && let Some(id) = self.sandbox().map(str::to_string)
        {
            let t0 = Instant::now();
            let rt = self.cfg.runtime.clone();
            let r = guarded(&self.stop.clone(), async {
                rt.sh(&id, &cmd).await.map_err(|e| e.to_string())
            })
            .await;
            let r = r.map(|out| {
                let n = out.lines().count();
                self.report.collected = Some(out);
                format!("{n} lines from `{cmd}`")
            });
            self.record("collect", t0, r)?;
        }
        Ok(())
    }

    /// `df` of `/data` where the workload runs.
    pub async fn df(&self) -> Result<DfView, String> {
        match self.sandbox() {
            Some(id) => {
                let rt = &self.cfg.runtime;
                let b = rt
                    .sh(id, &format!("df -P -B1 {MOUNT_DESTINATION}"))
                    .await
                    .map_err(|e| e.to_string())?;
                let i = rt
                    .sh(id, &format!("df -P -i {MOUNT_DESTINATION}"))
                    .await
                    .map_err(|e| e.to_string())?;
                let f = |out: &str| {
                    parse_df(out)
                        .map(|(total, used, available)| Figures {
                            total,
                            used,
                            available,
                        })
                        .ok_or_else(|| format!("unexpected df output: {out:?}"))
                };
                Ok(DfView {
                    bytes: f(&b)?,
                    inodes: f(&i)?,
                })
            }
            None => {
                let st = rustix::fs::statvfs(self.target.as_str())
                    .map_err(|e| format!("statvfs {}: {e}", self.target))?;
                let fr = st.f_frsize;
                Ok(DfView {
                    bytes: Figures {
                        total: st.f_blocks * fr,
                        used: (st.f_blocks - st.f_bfree) * fr,
                        available: st.f_bavail * fr,
                    },
                    inodes: Figures {
                        total: st.f_files,
                        used: st.f_files - st.f_ffree,
                        available: st.f_ffree,
                    },
                })
            }
        }
    }

    /// NodeGetVolumeStats the way kubelet sends it for this pod.
    pub async fn stats(&self) -> Result<csi::NodeGetVolumeStatsResponse, Status> {
        self.csi
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: self.volume_id.clone().unwrap_or_default(),
                volume_path: self.target.clone(),
                staging_target_path: self.staging.clone().unwrap_or_default(),
                defer_fs_ops: self.request_defer(),
            })
            .await
    }

    async fn observe(&mut self, after: bool) -> Result<(), FlowError> {
        let stop = self.stop.clone();
        let where_ = if self.sandbox().is_some() {
            "guest"
        } else {
            "host"
        };
        let t0 = Instant::now();
        let r = guarded(&stop, self.df()).await;
        let r = r.map(|df| {
            let d = format!(
                "{} {} total, {} used, {} available",
                if where_ == "guest" {
                    MOUNT_DESTINATION
                } else {
                    "target"
                },
                human_size(df.bytes.total as i64),
                human_size(df.bytes.used as i64),
                human_size(df.bytes.available as i64)
            );
            self.observation(after).df = Some(df);
            d
        });
        self.record(&format!("{where_} df"), t0, r)?;
        let t0 = Instant::now();
        let r = guarded(&stop, async {
            self.stats().await.map_err(|s| status_text(&s))
        })
        .await;
        let r = r.map(|resp| {
            let v = StatsView::from_proto(&resp);
            let t = v.text();
            self.observation(after).stats = Some(v);
            t
        });
        self.record("NodeGetVolumeStats", t0, r)?;
        self.observe_health(after).await
    }

    /// NodeGetVolumeHealth (CSI v1.13) for this pod's paths; a plugin
    /// that does not serve it (UNIMPLEMENTED) is noted, not a failure.
    async fn observe_health(&mut self, after: bool) -> Result<(), FlowError> {
        let stop = self.stop.clone();
        let t0 = Instant::now();
        let req = csi::NodeGetVolumeHealthRequest {
            volume_id: self.volume_id.clone().unwrap_or_default(),
            volume_publish_path: self.target.clone(),
            staging_target_path: self.staging.clone().unwrap_or_default(),
        };
        let csi = self.csi.clone();
        let r = guarded(&stop, async {
            match csi.node_get_volume_health(req).await {
                Ok(resp) => Ok(resp.volume_health.map(|h| HealthView::from_proto(&h))),
                Err(s) if s.code() == tonic::Code::Unimplemented => Ok(None),
                Err(s) => Err(status_text(&s)),
            }
        })
        .await;
        let r = r.map(|view| match view {
            Some(v) => {
                let t = v.text();
                self.observation(after).health = Some(v);
                t
            }
            None => "not served by this plugin (CSI v1.12 surface)".to_string(),
        });
        self.record("NodeGetVolumeHealth", t0, r)
    }

    fn observation(&mut self, after: bool) -> &mut Observation {
        if after {
            &mut self.report.after_expand
        } else {
            &mut self.report.before_expand
        }
    }

    /// ControllerExpandVolume, then NodeExpandVolume when the controller
    /// asks for it.
    pub async fn expand(&mut self, size: u64) -> Result<(), FlowError> {
        let stop = self.stop.clone();
        let id = self.volume_id.clone().unwrap_or_default();
        let c = self.csi.clone();
        let range = Some(csi::CapacityRange {
            required_bytes: size as i64,
            limit_bytes: 0,
        });
        let t0 = Instant::now();
        let req = csi::ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: range,
            secrets: HashMap::new(),
            volume_capability: Some(self.capability(false)),
        };
        let r = guarded(&stop, async {
            c.controller_expand_volume(req)
                .await
                .map_err(|s| status_text(&s))
        })
        .await;
        let resp = match r {
            Ok(r) => r,
            Err(e) => return self.record("ControllerExpandVolume", t0, Err(e)),
        };
        self.record(
            "ControllerExpandVolume",
            t0,
            Ok(format!(
                "capacity {}, node expansion {}",
                human_size(resp.capacity_bytes),
                if resp.node_expansion_required {
                    "required"
                } else {
                    "not required"
                }
            )),
        )?;
        if let Some(v) = &mut self.report.volume {
            v.capacity_bytes = resp.capacity_bytes;
        }
        if !resp.node_expansion_required {
            return Ok(());
        }
        let t0 = Instant::now();
        let req = csi::NodeExpandVolumeRequest {
            volume_id: id,
            volume_path: self.target.clone(),
            capacity_range: range,
            staging_target_path: self.staging.clone().unwrap_or_default(),
            volume_capability: Some(self.capability(false)),
            secrets: HashMap::new(),
            defer_fs_ops: self.request_defer(),
        };
        let r = guarded(&stop, async {
            c.node_expand_volume(req).await.map_err(|s| status_text(&s))
        })
        .await;
        let r = r.map(|resp| {
            self.report.expanded_bytes = Some(resp.capacity_bytes);
            format!(
                "capacity {}{}",
                human_size(resp.capacity_bytes),
                if self.cfg.deferred() {
                    " (grown in the guest)"
                } else {
                    ""
                }
            )
        });
        self.record("NodeExpandVolume", t0, r)
    }

    /// Undoes everything that was set up, in reverse. Keeps going after a
    /// failed step; `report().ok` is true only if the whole flow worked.
    pub async fn tear_down(&mut self) {
        while let Some(u) = self.undo.pop() {
            match u {
                Undo::Sandbox(id) => self.stop_sandbox(&id).await,
                Undo::Published { volume, target } => {
                    let req = csi::NodeUnpublishVolumeRequest {
                        volume_id: volume,
                        target_path: target.clone(),
                        defer_fs_ops: self.unpublish_defer,
                    };
                    let t0 = Instant::now();
                    let c = self.csi.clone();
                    let r = retry(|| c.node_unpublish_volume(req.clone())).await;
                    let r = r.map_err(|s| status_text(&s)).and_then(|_| {
                        if is_mountpoint(Path::new(&target)) {
                            Err(format!("{target} is still a mount point"))
                        } else {
                            Ok(format!(
                                "{target}{}",
                                if req.defer_fs_ops {
                                    " (defer_fs_ops)"
                                } else {
                                    ""
                                }
                            ))
                        }
                    });
                    let _ = self.record("NodeUnpublishVolume", t0, r);
                }
                Undo::Staged { volume, path } => {
                    let req = csi::NodeUnstageVolumeRequest {
                        volume_id: volume,
                        staging_target_path: path.clone(),
                    };
                    let t0 = Instant::now();
                    let c = self.csi.clone();
                    let r = retry(|| c.node_unstage_volume(req.clone())).await;
                    let r = r.map_err(|s| status_text(&s)).and_then(|_| {
                        if is_mountpoint(Path::new(&path)) {
                            Err(format!("{path} is still a mount point"))
                        } else {
                            Ok(path.clone())
                        }
                    });
                    let _ = self.record("NodeUnstageVolume", t0, r);
                }
                Undo::Volume(id) => {
                    if self.cfg.keep_volume {
                        self.note(format!("volume {id} kept (--keep-volume)"));
                        continue;
                    }
                    let t0 = Instant::now();
                    let c = self.csi.clone();
                    let req = csi::DeleteVolumeRequest {
                        volume_id: id.clone(),
                        secrets: HashMap::new(),
                    };
                    let r = retry(|| c.delete_volume(req.clone())).await;
                    let r = r.map(|_| id).map_err(|s| status_text(&s));
                    let _ = self.record("DeleteVolume", t0, r);
                }
                Undo::Dir(p) => {
                    // Only empty directories: never recurse into something
                    // a plugin might still have mounted.
                    match std::fs::remove_dir(&p) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => self.note(format!("left {}: {e}", p.display())),
                    }
                }
                Undo::Tree(p) => {
                    if let Err(e) = std::fs::remove_dir_all(&p)
                        && e.kind() != std::io::ErrorKind::NotFound
                    {
                        self.note(format!("left {}: {e}", p.display()));
                    }
                }
            }
        }
        self.report.ok =
            self.report.failed_step.is_none() && self.report.steps.iter().all(|s| s.ok);
    }

    /// `kill` (TERM, then KILL if it lingers) and `delete`, then checks
    /// the sandbox's QEMU is gone.
    async fn stop_sandbox(&mut self, id: &str) {
        self.sandbox_up = false;
        let rt = self.cfg.runtime.clone();
        let t0 = Instant::now();
        let status = |st: &Value| st["status"].as_str().unwrap_or("").to_string();
        let r: Result<String, String> = async {
            let st = match rt.json(&["state", id]).await {
                Ok(st) => st,
                // create never got far enough: delete --force tidies up.
                Err(_) => return Ok("no sandbox state (nothing to stop)".into()),
            };
            if status(&st) != "running" {
                return Ok(format!("sandbox {}", status(&st)));
            }
            rt.ok(&["kill", id, "TERM"])
                .await
                .map_err(|e| e.to_string())?;
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let st = rt.json(&["state", id]).await.map_err(|e| e.to_string())?;
                if status(&st) != "running" {
                    let exit = st["exitStatus"]
                        .as_i64()
                        .map(|c| format!("exit status {c}"))
                        .unwrap_or_else(|| "no exit status".into());
                    return Ok(format!("workload stopped by SIGTERM ({exit})"));
                }
                if Instant::now() > deadline {
                    rt.ok(&["kill", id, "KILL"])
                        .await
                        .map_err(|e| e.to_string())?;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    return Ok("workload ignored SIGTERM for 20s; sent SIGKILL".into());
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        .await;
        let _ = self.record("runtime kill", t0, r);

        let t0 = Instant::now();
        let qemu = self.report.qemu_pid;
        let r = async {
            rt.ok(&["delete", "--force", id])
                .await
                .map_err(|e| e.to_string())?;
            if let Some(pid) = qemu {
                let deadline = Instant::now() + Duration::from_secs(15);
                while pid_is_qemu(pid) {
                    if Instant::now() > deadline {
                        return Err(format!("QEMU pid {pid} still runs after delete"));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok(format!("sandbox {id} deleted, QEMU pid {pid} gone"))
            } else {
                Ok(format!("sandbox {id} deleted"))
            }
        }
        .await;
        let _ = self.record("runtime delete", t0, r);
    }
}

/// Repeats a teardown call while the plugin says another operation on
/// the volume is in flight (ABORTED) or it is briefly unreachable.
async fn retry<T, F, Fut>(mut f: F) -> Result<T, Status>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Status>>,
{
    let mut wait = Duration::from_millis(200);
    for _ in 0..5 {
        match f().await {
            Err(s) if matches!(s.code(), Code::Aborted | Code::Unavailable) => {
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
            r => return r,
        }
    }
    f().await
}

/// The OCI runtime spec of the pod's container.
pub fn bundle_spec(cfg: &FlowConfig, source: &str) -> Value {
    let mut env =
        vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string()];
    env.extend(cfg.workload.env.iter().cloned());
    let mut user = json!({"uid": 0, "gid": 0});
    if let Some(g) = cfg.fs_group {
        // kubelet adds the fsGroup to the container's groups.
        user["additionalGids"] = json!([g]);
    }
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({
            "destination": MOUNT_DESTINATION,
            "type": "bind",
            "source": source,
            "options": ["rbind", "rw"],
        }),
    ];
    for (dest, src) in &cfg.extra_mounts {
        mounts.push(
            json!({"destination": dest, "type": "bind", "source": src, "options": ["rbind", "rw"]}),
        );
    }
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": user,
            "args": cfg.workload.args,
            "env": env,
            "cwd": cfg.workload.cwd,
        },
        "root": {"path": "rootfs"},
        "hostname": cfg.sandbox_id,
        "mounts": mounts,
        "annotations": {
            "io.kubernetes.pod.uid": cfg.pod_uid,
        },
    })
}

/// Lower-case hex sha256 (kubelet's staging directory name).
pub fn hex_sha256(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A random RFC 4122 version 4 UUID (kubelet's pod uid format).
pub fn random_uuid() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        use std::hash::{BuildHasher, RandomState};
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let a = RandomState::new().hash_one((t, std::process::id()));
        let c = RandomState::new().hash_one(a);
        b[..8].copy_from_slice(&a.to_le_bytes());
        b[8..].copy_from_slice(&c.to_le_bytes());
    }
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Whether something is mounted exactly at `p`.
pub fn is_mountpoint(p: &Path) -> bool {
    crust_blockdev::mount_info()
        .map(|ms| ms.iter().any(|m| m.mount_point == p))
        .unwrap_or(false)
}

/// Whether the topmost mount at `p` is the plugin's placeholder for a
/// volume whose filesystem is in a guest.
pub fn is_placeholder(p: &Path) -> bool {
    crust_blockdev::find_mount(p)
        .ok()
        .flatten()
        .is_some_and(|m| m.fs_type == "tmpfs" && m.source == crust_handoff::PLACEHOLDER_SOURCE)
}

/// Whether `pid` is a live (non-zombie) QEMU process.
pub fn pid_is_qemu(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|s| s.split_whitespace().next());
    if matches!(state, None | Some("Z") | Some("X")) {
        return false;
    }
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).contains("qemu"))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubelet_paths() {
        let mut cfg = FlowConfig::new("/w", RuntimeCli::new("/bin/true"));
        cfg.pod_uid = "uid-1".into();
        cfg.volume_name = "pvc-1".into();
        assert_eq!(
            cfg.target_path(),
            PathBuf::from("/w/kubelet/pods/uid-1/volumes/kubernetes.io~csi/pvc-1/mount")
        );
        // sha256("vol-1")
        assert_eq!(
            cfg.staging_path("blk.crust.dev", "vol-1"),
            PathBuf::from(format!(
                "/w/kubelet/plugins/kubernetes.io/csi/blk.crust.dev/{}/globalmount",
                hex_sha256("vol-1")
            ))
        );
        assert_eq!(
            hex_sha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn uuids_look_like_pod_uids() {
        let a = random_uuid();
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
        assert!(a.chars().all(|c| c.is_ascii_hexdigit() || c == '-'));
        assert_ne!(a, random_uuid());
    }

    #[test]
    fn bundle_mounts_the_target_with_subpath() {
        let mut cfg = FlowConfig::new("/w", RuntimeCli::new("/bin/true"));
        cfg.fs_group = Some(2000);
        cfg.workload.args = vec!["sh".into(), "-c".into(), "true".into()];
        cfg.workload.env = vec!["A=b".into()];
        let spec = bundle_spec(&cfg, "/t/mount/sub");
        let m = &spec["mounts"][1];
        assert_eq!(m["destination"], "/data");
        assert_eq!(m["source"], "/t/mount/sub");
        assert_eq!(m["type"], "bind");
        assert_eq!(m["options"], json!(["rbind", "rw"]));
        assert_eq!(spec["process"]["args"], json!(["sh", "-c", "true"]));
        assert_eq!(spec["process"]["env"][1], "A=b");
        assert_eq!(spec["process"]["user"]["additionalGids"], json!([2000]));
        assert_eq!(spec["root"]["path"], "rootfs");
    }

    #[tokio::test]
    async fn publish_capability_carries_the_kep_fields_only_when_deferred() {
        use csi::volume_capability::AccessType;
        let mut cfg = FlowConfig::new("/w", RuntimeCli::new("/bin/true"));
        cfg.fs_group = Some(2000);
        cfg.change_policy = Some(FsGroupChangePolicy::OnRootMismatch);
        let ch = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        let csi = Csi::from_channel(ch, Duration::from_secs(1));
        let f = Flow::new(cfg.clone(), csi.clone(), Arc::new(|_| {}));
        let Some(AccessType::Mount(m)) = f.capability(true).access_type else {
            panic!()
        };
        assert_eq!(
            (
                m.volume_supplemental_group.as_str(),
                m.volume_supplemental_group_change_policy.as_str()
            ),
            ("2000", "OnRootMismatch")
        );
        let Some(AccessType::Mount(m)) = f.capability(false).access_type else {
            panic!()
        };
        assert!(m.volume_supplemental_group.is_empty());
        cfg.defer_via = DeferVia::None;
        let f = Flow::new(cfg, csi, Arc::new(|_| {}));
        let Some(AccessType::Mount(m)) = f.capability(true).access_type else {
            panic!()
        };
        assert!(m.volume_supplemental_group.is_empty());
        assert!(!f.unpublish_defer);
    }
}
