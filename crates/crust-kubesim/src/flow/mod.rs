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
//!
//! Here: [`Flow`], its phases and the teardown. The steps live by side:
//! `volume` (the CSI calls), `sandbox` (the bundle and the runtime CLI),
//! `observe` (df, stats, health); `config` is what the pod asks for,
//! `report` what the flow says, `host` what kubelet reads from the node.

use std::collections::HashMap;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_proto::csi::v1 as csi;
use tokio::sync::watch;
use tonic::{Code, Status};

use crate::runtime_cli::RuntimeCli;
use crust_csi_client::Csi;

mod config;
mod host;
mod observe;
mod report;
mod sandbox;
mod volume;

pub use config::{DEFER_PARAM, DeferVia, FlowConfig, MOUNT_DESTINATION, Workload};
pub use host::{hex_sha256, is_mountpoint, is_placeholder, pid_is_qemu, random_uuid};
pub use report::{
    DfView, Figures, FlowError, FlowReport, HealthView, Observation, Progress, StatsView,
    StepReport, VolumeInfo,
};
pub use sandbox::bundle_spec;

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
}

impl Flow {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crust_handoff::FsGroupChangePolicy;
    use serde_json::json;
    use std::sync::Arc;

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
