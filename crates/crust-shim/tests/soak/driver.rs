//! The soak's driver: one node's crust-csi, private containerd and crust
//! shim under a seeded random sequence of kubelet-like operations and
//! faults, each followed by the checks that say it did no harm.
//!
//! | operation     | what kubelet or an operator does                      | checked after                                  |
//! |---------------|-------------------------------------------------------|------------------------------------------------|
//! | create-pod    | (CreateVolume) NodeStage, NodePublish, RunPodSandbox, a writer container | the writer acknowledges; the volume holds every earlier writer's acknowledged records |
//! | delete-pod    | StopPodSandbox, RemovePodSandbox, NodeUnpublish, NodeUnstage | no QEMU, virtiofsd, shim, shim socket, sandbox dir or hand-off record of the pod is left |
//! | stats         | NodeGetVolumeStats per volume every `stats_period` (kubelet: 60 s) | usage in bytes, condition normal       |
//! | expand        | ControllerExpandVolume + NodeExpandVolume while in use | the stats' total grows                        |
//! | snapshot      | CreateSnapshot of an in-use volume, DeleteSnapshot    | ready to use                                   |
//! | verify        | reads every writer's file in a pod                    | no acknowledged record lost                    |
//! | delete-volume | DeleteVolume of a volume no pod uses                  | its loop device is detached                    |
//!
//! Faults: SIGKILL of crust-csi (then restarted on its state dir), of a
//! pod's shim, QEMU or virtiofsd (the pod is then torn down and a new pod
//! takes its volume, which is the verification), and a containerd restart.
//! After crust-csi or containerd comes back, every live pod is verified and
//! its stats must be normal.
//!
//! Volumes come in three kinds: deferred (`deferFsOps=true` and
//! `defer_fs_ops`: the block device goes into the guest), handed over
//! (the default `auto`: published on the host, taken into the VM by the
//! shim at container creation and given back) and host-shared
//! (`deferFsOps=false`: mounted on the host, shared over virtio-fs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_cri::Cri;
use crust_cri::v1 as cri;
use crust_proto::csi::v1 as csi;
use crustctl::client::Csi;

use crate::common::{self, Env, MIB, Plugin, mount_cap, qemus_under, start_plugin};
use crate::report::{Footprint, Report};
use crate::rng::Rng;
use crate::writer;

/// Guests at once (the pods' VMs); each beyond the first holds one more
/// of the machine's VM slots.
const MAX_PODS: usize = 2;
const MAX_VOLUMES: usize = 4;
const VOLUME_SIZE: u64 = 64 * MIB;
const MAX_SIZE: u64 = 128 * MIB;
const GROW: u64 = 16 * MIB;
/// How long what a pod or volume held may take to go after its teardown
/// (containerd's background cleanup of a dead shim runs `shim delete`).
const SETTLE: Duration = Duration::from_secs(20);
/// One operation with its checks; longer is a hang.
const STEP_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Deferred,
    Handover,
    HostShared,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Deferred, Kind::Handover, Kind::HostShared];

    /// The StorageClass parameter `deferFsOps`.
    fn param(self) -> &'static str {
        match self {
            Kind::Deferred => "true",
            Kind::Handover => "auto",
            Kind::HostShared => "false",
        }
    }

    /// KEP-2857's `defer_fs_ops` as a kubelet with the KEP sends it.
    fn defer(self) -> bool {
        self == Kind::Deferred
    }
}

/// The soak's knobs, from the environment.
pub struct Config {
    pub seed: u64,
    pub budget: Duration,
    pub stats_period: Duration,
    pub fault_percent: u64,
}

impl Config {
    /// `CRUST_SOAK_SECS` (default 120, the CI form), `CRUST_SOAK_SEED`
    /// (default: from the clock), `CRUST_SOAK_STATS_SECS` (default 60,
    /// kubelet's volume stats period), `CRUST_SOAK_FAULT_PERCENT` (the
    /// chance that a step with a pod running is a fault; default 25).
    pub fn from_env() -> Config {
        let num = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        let seed = num("CRUST_SOAK_SEED").unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
        Config {
            seed,
            budget: Duration::from_secs(num("CRUST_SOAK_SECS").unwrap_or(120)),
            stats_period: Duration::from_secs(num("CRUST_SOAK_STATS_SECS").unwrap_or(60)),
            fault_percent: num("CRUST_SOAK_FAULT_PERCENT").unwrap_or(25).min(100),
        }
    }
}

struct Volume {
    id: String,
    name: String,
    kind: Kind,
    context: std::collections::HashMap<String, String>,
    staging: String,
    size: u64,
    /// Writer -> records acknowledged on this volume.
    acked: BTreeMap<String, u64>,
    in_use: bool,
    /// The stats' total before an expansion whose filesystem growth waits
    /// for the next NodeStage (a host mount without CAP_SYS_RESOURCE).
    grow_at_stage: Option<i64>,
}

struct Pod {
    writer: String,
    /// StopPodSandbox and RemovePodSandbox done (a failed teardown resumes
    /// at NodeUnpublish).
    sandbox_gone: bool,
    sandbox: String,
    container: String,
    volume: String,
    target: String,
    log: PathBuf,
    stats_at: Instant,
}

/// A step's failure that leaves the soak unable to go on (the anomaly is
/// recorded, the run tears down).
type Step = Result<(), String>;

pub struct Soak {
    plugin: Plugin,
    csi: Csi,
    cri: Cri,
    rng: Rng,
    cfg: Config,
    t0: Instant,
    volumes: Vec<Volume>,
    pods: Vec<Pod>,
    serial: u64,
    max_pods: usize,
    _more_slots: Vec<crust_testkit::VmSlot>,
    pub report: Report,
    // Last: the plugin stops before containerd and the mounts go.
    env: Env,
}

impl Soak {
    pub async fn start(env: Env, cfg: Config) -> Soak {
        let plugin = start_plugin(&env).await;
        let csi = plugin.csi().await;
        let cri = Cri::connect(&env.ctrd.endpoint()).await.expect("CRI");
        // The env's slot covers the first pod's guest.
        let max_pods = crust_testkit::VmSlot::limit().min(MAX_PODS);
        let mut more_slots = Vec::new();
        for _ in 1..max_pods {
            more_slots.push(
                tokio::task::spawn_blocking(crust_testkit::VmSlot::acquire)
                    .await
                    .expect("VM slot"),
            );
        }
        Soak {
            plugin,
            csi,
            cri,
            rng: Rng::new(cfg.seed),
            report: Report {
                seed: cfg.seed,
                ..Default::default()
            },
            cfg,
            t0: Instant::now(),
            volumes: Vec::new(),
            pods: Vec::new(),
            serial: 0,
            max_pods,
            _more_slots: more_slots,
            env,
        }
    }

    /// Runs operations until the budget is spent (or a step cannot go
    /// on), then tears everything down and checks nothing is left.
    pub async fn run(&mut self) {
        self.sample();
        while self.t0.elapsed() < self.cfg.budget {
            let r = match tokio::time::timeout(STEP_TIMEOUT, self.step()).await {
                Ok(r) => r,
                Err(_) => Err(format!("a step hung for {STEP_TIMEOUT:?}")),
            };
            if let Err(e) = r {
                self.anomaly("the soak's operation", "success", &e);
                break;
            }
            self.poll_stats().await;
            self.sample();
        }
        if let Err(e) = self.teardown().await {
            self.anomaly("teardown", "success", &e);
        }
        self.report.elapsed = self.t0.elapsed();
        self.report.check_footprint();
    }

    fn anomaly(&mut self, what: &str, expected: &str, seen: &str) {
        self.report.anomaly(self.t0.elapsed(), what, expected, seen);
        self.keep_logs();
    }

    /// The logs as they were at an anomaly, kept past the run (its temp
    /// dir goes with it): `/tmp/crust-soak-<pid>/<n>-{shim,containerd,crust-csi}.log`.
    fn keep_logs(&self) {
        let dir = PathBuf::from(format!("/tmp/crust-soak-{}", std::process::id()));
        let n = self.report.anomalies.len();
        let _ = std::fs::create_dir_all(&dir);
        for (name, from) in [
            ("shim", self.env.dir.path().join("shim.log")),
            ("containerd", self.env.ctrd.log_path()),
            ("crust-csi", self.env.dir.path().join("crust-csi.log")),
        ] {
            let _ = std::fs::copy(&from, dir.join(format!("{n}-{name}.log")));
        }
        self.log(&format!("anomaly {n}: logs kept in {}", dir.display()));
    }

    fn log(&self, what: &str) {
        eprintln!("[{:>7.1}s] {what}", self.t0.elapsed().as_secs_f64());
    }

    fn sample(&mut self) {
        if let Some(s) = self
            .plugin
            .proc
            .pid()
            .and_then(|p| Footprint::of(p, self.t0.elapsed()))
        {
            self.report.samples.push(s);
        }
    }

    async fn step(&mut self) -> Step {
        let has_pod = !self.pods.is_empty();
        if has_pod && self.rng.chance(self.cfg.fault_percent) {
            return self.fault().await;
        }
        let free = self.volumes.iter().any(|v| !v.in_use);
        let can_create =
            self.pods.len() < self.max_pods && (free || self.volumes.len() < MAX_VOLUMES);
        let on = |b: bool, w: u32| if b { w } else { 0 };
        match self.rng.weighted(&[
            on(can_create, 6),
            on(has_pod, 2),
            on(has_pod, 1),
            on(has_pod, 1),
            on(has_pod, 1),
            on(free, 1),
            1,
        ]) {
            0 => self.create_pod(None).await,
            1 => {
                let i = self.rng.below(self.pods.len());
                self.delete_pod(i).await
            }
            2 => self.expand().await,
            3 => self.snapshot().await,
            4 => {
                self.report.op("verify");
                for i in 0..self.pods.len() {
                    self.verify(i).await?;
                }
                Ok(())
            }
            5 => self.delete_volume().await,
            _ => {
                self.report.op("idle");
                tokio::time::sleep(Duration::from_secs(2)).await;
                Ok(())
            }
        }
    }

    // ------------------------------------------------------------ volumes

    async fn create_volume(&mut self) -> Result<usize, String> {
        self.report.op("create-volume");
        let kind = Kind::ALL[self.rng.below(Kind::ALL.len())];
        self.serial += 1;
        let name = format!("pvc-soak-{}", self.serial);
        let vol = self
            .csi
            .create_volume(csi::CreateVolumeRequest {
                name: name.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: VOLUME_SIZE as i64,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![mount_cap(None)],
                parameters: [("deferFsOps".to_string(), kind.param().to_string())].into(),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("CreateVolume {name}: {e}"))?
            .volume
            .ok_or("CreateVolume: no volume")?;
        let staging = self.env.dir.path().join("kubelet/plugins/soak").join(&name);
        std::fs::create_dir_all(&staging).map_err(|e| e.to_string())?;
        self.log(&format!("volume {name} ({kind:?}) {}", vol.volume_id));
        self.volumes.push(Volume {
            id: vol.volume_id,
            name,
            kind,
            context: vol.volume_context,
            staging: staging.display().to_string(),
            size: VOLUME_SIZE,
            acked: BTreeMap::new(),
            in_use: false,
            grow_at_stage: None,
        });
        Ok(self.volumes.len() - 1)
    }

    fn volume(&self, id: &str) -> usize {
        self.volumes
            .iter()
            .position(|v| v.id == id)
            .expect("a pod's volume is known")
    }

    async fn delete_volume(&mut self) -> Step {
        let free: Vec<usize> = (0..self.volumes.len())
            .filter(|i| !self.volumes[*i].in_use)
            .collect();
        let v = self.volumes.remove(free[self.rng.below(free.len())]);
        self.report.op("delete-volume");
        self.csi
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: v.id.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("DeleteVolume {}: {e}", v.id))?;
        let pool = self.env.dir.path().join("pool");
        let left = settle(|| {
            let loops = crust_blockdev::list_loops().unwrap_or_default();
            loops
                .into_iter()
                .filter(|l| {
                    l.backing_file.starts_with(&pool)
                        && l.backing_file.to_string_lossy().contains(&v.id)
                })
                .map(|l| l.path.display().to_string())
                .collect::<Vec<_>>()
        })
        .await;
        if !left.is_empty() {
            self.anomaly(
                &format!("DeleteVolume {}", v.id),
                "its loop device detached",
                &format!("{left:?} still attached"),
            );
        }
        Ok(())
    }

    // --------------------------------------------------------------- pods

    /// A pod with a writer on volume `on` (or a free or new volume): the
    /// volume's earlier writers are verified before the pod counts as up.
    #[allow(
        clippy::too_many_lines,
        reason = "kubelet's steps for one pod, in its order, read top to bottom"
    )]
    async fn create_pod(&mut self, on: Option<usize>) -> Step {
        let vi = match on {
            Some(i) => i,
            None => {
                let free: Vec<usize> = (0..self.volumes.len())
                    .filter(|i| !self.volumes[*i].in_use)
                    .collect();
                if free.is_empty() || (self.volumes.len() < MAX_VOLUMES && self.rng.chance(30)) {
                    self.create_volume().await?
                } else {
                    free[self.rng.below(free.len())]
                }
            }
        };
        self.report.op("create-pod");
        self.serial += 1;
        let writer = format!("p{}", self.serial);
        let uid = format!("50a50000-0000-4000-8000-{:012}", self.serial);
        let v = &self.volumes[vi];
        let (id, kind) = (v.id.clone(), v.kind);
        self.csi
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: v.staging.clone(),
                volume_capability: Some(mount_cap(None)),
                volume_context: v.context.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("NodeStage {id}: {e}"))?;
        let target = self
            .env
            .pods_dir
            .join(&uid)
            .join("volumes/kubernetes.io~csi")
            .join(&v.name)
            .join("mount");
        std::fs::create_dir_all(target.parent().unwrap()).map_err(|e| e.to_string())?;
        let target = target.display().to_string();
        self.csi
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: v.staging.clone(),
                target_path: target.clone(),
                volume_capability: Some(mount_cap(None)),
                volume_context: v.context.clone(),
                defer_fs_ops: kind.defer(),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("NodePublish {id}: {e}"))?;
        let log_dir = self.env.dir.path().join("pod-logs").join(&uid);
        std::fs::create_dir_all(&log_dir).map_err(|e| e.to_string())?;
        let mut sandbox = common::host_network_sandbox(&writer, &uid, 0);
        sandbox.log_directory = log_dir.display().to_string();
        let script = writer::script(&writer);
        let (sb, cid) = self
            .env
            .start_busybox_pod(
                &mut self.cri,
                &sandbox,
                &["sh", "-c", &script],
                vec![cri::Mount {
                    container_path: "/data".into(),
                    host_path: target.clone(),
                    ..Default::default()
                }],
            )
            .await;
        self.volumes[vi].in_use = true;
        self.log(&format!("pod {writer} {sb} on {id} ({kind:?})"));
        self.pods.push(Pod {
            writer,
            sandbox_gone: false,
            sandbox: sb,
            container: cid,
            volume: id.clone(),
            target,
            log: log_dir.join(common::BUSYBOX_POD_LOG),
            // kubelet's first poll follows the mount closely.
            stats_at: Instant::now() - self.cfg.stats_period,
        });
        let i = self.pods.len() - 1;
        // The writer acknowledges, then the volume is read.
        let t = Instant::now();
        while writer::acked(&self.pod_log(i)) == 0 && t.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        if writer::acked(&self.pod_log(i)) == 0 {
            let log = self.pod_log(i);
            self.anomaly(
                &format!("writer {}", self.pods[i].writer),
                "an acknowledged record within 60 s",
                &format!("none; its log: {log:?}"),
            );
        }
        self.verify(i).await?;
        if let Some(before) = self.volumes[vi].grow_at_stage.take() {
            let what = format!("volume {id} restaged after an offline expansion");
            match self.healthy_total(i).await {
                Ok(t) if t >= before + (GROW / 2) as i64 => {
                    self.log(&format!("{what}: {before} -> {t}"))
                }
                r => self.anomaly(
                    &what,
                    "the stats' total grown",
                    &format!("{before} -> {r:?}"),
                ),
            }
        }
        Ok(())
    }

    fn pod_log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.pods[i].log).unwrap_or_default()
    }

    /// Records pod `i`'s acknowledgements on its volume.
    fn note_acks(&mut self, i: usize) {
        let log = self.pod_log(i);
        let (w, vi) = (
            self.pods[i].writer.clone(),
            self.volume(&self.pods[i].volume),
        );
        if log.contains("write-failed") {
            self.anomaly(
                &format!("writer {w}"),
                "every write and fsync succeeds",
                &log,
            );
        }
        let n = writer::acked(&log);
        let e = self.volumes[vi].acked.entry(w).or_default();
        *e = (*e).max(n);
    }

    /// Reads the volume in pod `i`: every acknowledged record of every
    /// writer it has had must be there. Acknowledgements are read first,
    /// so each one counted is durable before the read starts.
    async fn verify(&mut self, i: usize) -> Step {
        self.note_acks(i);
        let (code, out) = try_exec(&mut self.cri, &self.pods[i].container, writer::DUMP)
            .await
            .map_err(|e| format!("ExecSync in {}: {e}", self.pods[i].writer))?;
        let vi = self.volume(&self.pods[i].volume);
        let what = format!(
            "volume {} read in {}",
            self.volumes[vi].id, self.pods[i].writer
        );
        if code != 0 {
            self.anomaly(&what, "exit 0", &format!("exit {code}: {out}"));
            return Ok(());
        }
        let lost = writer::lost(&self.volumes[vi].acked, &writer::parse_dump(&out));
        for l in lost {
            self.anomaly(&what, "every acknowledged record", &l);
        }
        let total: u64 = self.volumes[vi].acked.values().sum();
        self.log(&format!("{what}: {total} acknowledged records all there"));
        Ok(())
    }

    /// kubelet's teardown of pod `i`, then the check that nothing of it
    /// is left.
    async fn delete_pod(&mut self, i: usize) -> Step {
        self.report.op("delete-pod");
        if !self.pods[i].sandbox_gone {
            self.note_acks(i);
            let sb = self.pods[i].sandbox.clone();
            retry("StopPodSandbox", || {
                let mut rt = self.cri.runtime.clone();
                let sb = sb.clone();
                async move {
                    rt.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: sb })
                        .await
                        .map(|_| ())
                }
            })
            .await?;
            // The writer is gone: its count is final.
            self.note_acks(i);
            retry("RemovePodSandbox", || {
                let mut rt = self.cri.runtime.clone();
                let sb = sb.clone();
                async move {
                    rt.remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: sb })
                        .await
                        .map(|_| ())
                }
            })
            .await?;
            self.pods[i].sandbox_gone = true;
        }
        self.unpublish(i).await?;
        let p = self.pods.remove(i);
        let vi = self.volume(&p.volume);
        let v = &self.volumes[vi];
        self.csi
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: v.id.clone(),
                staging_target_path: v.staging.clone(),
            })
            .await
            .map_err(|e| format!("NodeUnstage {}: {e}", v.id))?;
        self.volumes[vi].in_use = false;
        self.log(&format!("pod {} deleted", p.writer));
        self.check_released(&p).await;
        Ok(())
    }

    /// NodeUnpublishVolume of pod `i`'s target. A pod whose shim was
    /// killed is cleaned up by containerd in the background (it runs the
    /// shim binary's `delete`, which stops the VM), so its claim may
    /// outlive RemovePodSandbox by a moment: FAILED_PRECONDITION ("still
    /// claimed") is retried for [`SETTLE`], as kubelet retries.
    async fn unpublish(&mut self, i: usize) -> Step {
        let v = &self.volumes[self.volume(&self.pods[i].volume)];
        let req = csi::NodeUnpublishVolumeRequest {
            volume_id: v.id.clone(),
            target_path: self.pods[i].target.clone(),
            defer_fs_ops: v.kind.defer(),
        };
        let t = Instant::now();
        loop {
            match self.csi.node_unpublish_volume(req.clone()).await {
                Ok(_) => break,
                Err(e) if e.code() == tonic::Code::FailedPrecondition && t.elapsed() < SETTLE => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(format!("NodeUnpublish {}: {e}", req.volume_id)),
            }
        }
        if t.elapsed() > Duration::from_secs(1) {
            self.report.op("unpublish retried");
            let w = self.pods[i].writer.clone();
            self.log(&format!(
                "NodeUnpublish of {w} waited {:.1} s for the claim to go",
                t.elapsed().as_secs_f64()
            ));
        }
        Ok(())
    }

    /// Nothing of a deleted pod is left: processes, the shim's socket, the
    /// sandbox dir, the hand-off record, a mount on its target.
    async fn check_released(&mut self, p: &Pod) {
        let env = &self.env;
        let sb_dir = env.runtime_root.join(&p.sandbox);
        let addr = containerd_shim::socket_address(
            &env.ctrd.address().display().to_string(),
            crust_testkit::CRI_NAMESPACE,
            &p.sandbox,
        );
        let record = env.crust_root.join(crust_handoff::crust_key(&p.target));
        let target = PathBuf::from(&p.target);
        let pool = env.dir.path().join("pool");
        let (pods, volumes) = (self.pods.len(), self.volumes.len());
        let left = settle(|| {
            let mut left = Vec::new();
            // The node as a whole holds no more than the live pods and
            // volumes explain.
            let n = qemus_under(&env.runtime_root).len();
            if n > pods {
                left.push(format!("{n} QEMUs for {pods} pods"));
            }
            let n = env.ctrd.shim_pids().len();
            if n > pods {
                left.push(format!("{n} shims for {pods} pods"));
            }
            let n = std::fs::read_dir(&env.crust_root).map_or(0, Iterator::count);
            if n > pods {
                left.push(format!("{n} hand-off records for {pods} publications"));
            }
            let loops = crust_blockdev::list_loops().unwrap_or_default();
            let n = loops
                .iter()
                .filter(|l| l.backing_file.starts_with(&pool))
                .count();
            if n > volumes {
                left.push(format!(
                    "{n} loop devices on the pool for {volumes} volumes"
                ));
            }
            if !qemus_under(&sb_dir).is_empty() {
                left.push("QEMU".to_string());
            }
            if common::pid_of_child("virtiofsd", &sb_dir).is_some() {
                left.push("virtiofsd".into());
            }
            if common::pid_of_child("containerd-shim-crust-v2", Path::new(&p.sandbox)).is_some() {
                left.push("shim".into());
            }
            if Path::new(addr.trim_start_matches("unix://")).exists() {
                left.push(format!("shim socket {addr}"));
            }
            if sb_dir.exists() {
                left.push(format!("sandbox dir {}", sb_dir.display()));
            }
            if record.exists() {
                left.push(format!("hand-off record {}", record.display()));
            }
            if mounted_below(&target) {
                left.push(format!("a mount on {}", target.display()));
            }
            left
        })
        .await;
        if !left.is_empty() {
            self.anomaly(
                &format!("pod {} ({}) deleted", p.writer, p.sandbox),
                "nothing of it left",
                &left.join(", "),
            );
        }
    }

    // ------------------------------------------------------------ volume ops

    async fn stats(&self, p: &Pod) -> Result<csi::NodeGetVolumeStatsResponse, String> {
        let v = &self.volumes[self.volume(&p.volume)];
        self.csi
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: v.id.clone(),
                volume_path: p.target.clone(),
                staging_target_path: v.staging.clone(),
                defer_fs_ops: v.kind.defer(),
            })
            .await
            .map_err(|e| format!("NodeGetVolumeStats {}: {e}", v.id))
    }

    /// The bytes total of a healthy volume's stats, or what is wrong.
    async fn healthy_total(&self, i: usize) -> Result<i64, String> {
        let s = self.stats(&self.pods[i]).await?;
        let c = s.volume_condition.unwrap_or_default();
        if c.abnormal {
            return Err(format!("abnormal: {}", c.message));
        }
        s.usage
            .iter()
            .find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32 && u.total > 0)
            .map(|u| u.total)
            .ok_or_else(|| format!("no usage in bytes: {:?}", s.usage))
    }

    /// kubelet's periodic NodeGetVolumeStats of every live pod's volume.
    async fn poll_stats(&mut self) {
        for i in 0..self.pods.len() {
            if self.pods[i].stats_at.elapsed() < self.cfg.stats_period {
                continue;
            }
            self.report.op("stats");
            self.pods[i].stats_at = Instant::now();
            if let Err(e) = self.healthy_total(i).await {
                let w = format!("stats of {}'s volume", self.pods[i].writer);
                self.anomaly(&w, "usage in bytes, condition normal", &e);
            }
        }
    }

    async fn expand(&mut self) -> Step {
        let i = self.rng.below(self.pods.len());
        let vi = self.volume(&self.pods[i].volume);
        if self.volumes[vi].size + GROW > MAX_SIZE {
            return self.snapshot().await;
        }
        self.report.op("expand");
        let before = self.healthy_total(i).await;
        let v = &self.volumes[vi];
        let size = v.size + GROW;
        let range = Some(csi::CapacityRange {
            required_bytes: size as i64,
            limit_bytes: 0,
        });
        let r = self
            .csi
            .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: v.id.clone(),
                capacity_range: range,
                volume_capability: Some(mount_cap(None)),
                ..Default::default()
            })
            .await;
        let r = match r {
            Ok(_) => {
                self.csi
                    .node_expand_volume(csi::NodeExpandVolumeRequest {
                        volume_id: v.id.clone(),
                        volume_path: self.pods[i].target.clone(),
                        capacity_range: range,
                        staging_target_path: v.staging.clone(),
                        volume_capability: Some(mount_cap(None)),
                        defer_fs_ops: v.kind.defer(),
                        ..Default::default()
                    })
                    .await
            }
            Err(e) => Err(e),
        };
        let what = format!("expansion of {} ({:?}) to {} MiB", v.id, v.kind, size / MIB);
        match r {
            Ok(_) => {}
            // crust-csi's documented answer for a host-mounted ext4 without
            // CAP_SYS_RESOURCE (this machine): grown at the next NodeStage,
            // which the next pod on the volume checks.
            Err(e)
                if v.kind == Kind::HostShared
                    && e.code() == tonic::Code::FailedPrecondition
                    && e.message().contains("CAP_SYS_RESOURCE") =>
            {
                self.report.op("expand (at next stage)");
                self.volumes[vi].size = size;
                if let Ok(b) = before {
                    self.volumes[vi].grow_at_stage.get_or_insert(b);
                }
                return Ok(());
            }
            Err(e) => {
                self.anomaly(&what, "OK", &e.to_string());
                return Ok(());
            }
        }
        self.volumes[vi].size = size;
        let after = self.healthy_total(i).await;
        match (before, after) {
            (Ok(b), Ok(a)) if a >= b + (GROW / 2) as i64 => {
                self.log(&format!("{what}: {b} -> {a}"))
            }
            (b, a) => self.anomaly(&what, "the stats' total grows", &format!("{b:?} -> {a:?}")),
        }
        Ok(())
    }

    async fn snapshot(&mut self) -> Step {
        self.report.op("snapshot");
        let i = self.rng.below(self.pods.len());
        let v = &self.volumes[self.volume(&self.pods[i].volume)];
        self.serial += 1;
        let (id, kind) = (v.id.clone(), v.kind);
        let r = self
            .csi
            .create_snapshot(csi::CreateSnapshotRequest {
                source_volume_id: id.clone(),
                name: format!("soak-snap-{}", self.serial),
                ..Default::default()
            })
            .await;
        let what = format!("snapshot of in-use {id} ({kind:?})");
        match r.map(|r| r.snapshot.unwrap_or_default()) {
            Ok(s) if s.ready_to_use => {
                self.log(&format!("{what}: {}", s.snapshot_id));
                if let Err(e) = self
                    .csi
                    .delete_snapshot(csi::DeleteSnapshotRequest {
                        snapshot_id: s.snapshot_id.clone(),
                        ..Default::default()
                    })
                    .await
                {
                    self.anomaly(
                        &format!("DeleteSnapshot {}", s.snapshot_id),
                        "OK",
                        &e.to_string(),
                    );
                }
            }
            Ok(s) => self.anomaly(&what, "ready to use", &format!("{s:?}")),
            Err(e) => self.anomaly(&what, "OK", &e.to_string()),
        }
        Ok(())
    }

    // --------------------------------------------------------------- faults

    async fn fault(&mut self) -> Step {
        const KINDS: [&str; 5] = [
            "crust-csi SIGKILL",
            "containerd restart",
            "shim SIGKILL",
            "QEMU SIGKILL",
            "virtiofsd SIGKILL",
        ];
        let k = self.rng.below(KINDS.len());
        self.report.fault(KINDS[k]);
        self.log(&format!("fault: {}", KINDS[k]));
        match k {
            0 => {
                let pid = self.plugin.proc.pid().ok_or("crust-csi not running")?;
                kill9(pid as i32);
                let t = Instant::now();
                while self.plugin.proc.exited().is_none() && t.elapsed() < SETTLE {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                self.plugin = start_plugin(&self.env).await;
                self.csi = self.plugin.csi().await;
                self.after_restart().await
            }
            1 => {
                self.env.ctrd.restart();
                self.cri = Cri::connect(&self.env.ctrd.endpoint())
                    .await
                    .map_err(|e| format!("CRI after the restart: {e}"))?;
                self.wait_cri_ready().await?;
                self.after_restart().await
            }
            _ => {
                let i = self.rng.below(self.pods.len());
                let sb_dir = self.env.runtime_root.join(&self.pods[i].sandbox);
                let pid = match k {
                    2 => common::pid_of_child(
                        "containerd-shim-crust-v2",
                        Path::new(&self.pods[i].sandbox),
                    ),
                    3 => qemus_under(&sb_dir).first().copied(),
                    _ => common::pid_of_child("virtiofsd", &sb_dir),
                };
                let Some(pid) = pid else {
                    let w = self.pods[i].writer.clone();
                    self.anomaly(
                        &format!("{} of pod {w}", KINDS[k]),
                        "a process to kill",
                        "none",
                    );
                    return Ok(());
                };
                kill9(pid);
                self.pod_killed(i, KINDS[k]).await
            }
        }
    }

    /// containerd answers before its CRI plugin has reloaded its pods
    /// ("server is not initialized yet"); kubelet waits for RuntimeReady
    /// in the CRI status, and so does the soak (60 s).
    async fn wait_cri_ready(&mut self) -> Step {
        let t = Instant::now();
        loop {
            let st = self
                .cri
                .runtime
                .status(cri::StatusRequest { verbose: false })
                .await;
            let ready = st.as_ref().is_ok_and(|r| {
                r.get_ref().status.as_ref().is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.r#type == "RuntimeReady" && c.status)
                })
            });
            if ready {
                return Ok(());
            }
            if t.elapsed() > Duration::from_secs(60) {
                return Err(format!(
                    "CRI not RuntimeReady 60 s after the restart: {st:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// After crust-csi or containerd came back: every pod still runs, its
    /// volume reads whole and its stats are normal.
    async fn after_restart(&mut self) -> Step {
        for i in 0..self.pods.len() {
            self.verify(i).await?;
            if let Err(e) = self.healthy_total(i).await {
                let w = format!(
                    "stats of {}'s volume after the restart",
                    self.pods[i].writer
                );
                self.anomaly(&w, "usage in bytes, condition normal", &e);
            }
        }
        Ok(())
    }

    /// Pod `i` lost a process: containerd sees its container end; kubelet
    /// tears it down, and a new pod takes the volume and reads it.
    async fn pod_killed(&mut self, i: usize, fault: &str) -> Step {
        let cid = self.pods[i].container.clone();
        let t = Instant::now();
        loop {
            let st = self
                .cri
                .runtime
                .container_status(cri::ContainerStatusRequest {
                    container_id: cid.clone(),
                    verbose: false,
                })
                .await
                .map(|r| r.into_inner().status.map(|s| s.state));
            if !matches!(st, Ok(Some(s)) if s == cri::ContainerState::ContainerRunning as i32) {
                break;
            }
            if t.elapsed() > Duration::from_secs(60) {
                let w = self.pods[i].writer.clone();
                self.anomaly(
                    &format!("{fault} in pod {w}"),
                    "its container ends",
                    "still running after 60 s",
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let vi = self.volume(&self.pods[i].volume);
        self.delete_pod(i).await?;
        self.create_pod(Some(vi)).await
    }

    // ------------------------------------------------------------- teardown

    async fn teardown(&mut self) -> Step {
        self.log("teardown");
        // A failed read is an anomaly; the pods still go.
        for i in 0..self.pods.len() {
            if let Err(e) = self.verify(i).await {
                self.anomaly("a last read of the volumes", "success", &e);
            }
        }
        while !self.pods.is_empty() {
            self.delete_pod(0).await?;
        }
        while self.volumes.iter().any(|v| !v.in_use) {
            self.delete_volume().await?;
        }
        let env = &self.env;
        let pool = env.dir.path().join("pool");
        let roots = [env.runtime_root.clone(), env.crust_root.clone()];
        let left = settle(|| {
            let mut left = Vec::new();
            let loops = crust_blockdev::list_loops().unwrap_or_default();
            left.extend(
                loops
                    .iter()
                    .filter(|l| l.backing_file.starts_with(&pool))
                    .map(|l| format!("loop device {}", l.path.display())),
            );
            if !qemus_under(&env.runtime_root).is_empty() {
                left.push("QEMU".into());
            }
            if !env.ctrd.shim_pids().is_empty() {
                left.push("a crust shim".into());
            }
            for r in &roots {
                left.extend(
                    std::fs::read_dir(r)
                        .into_iter()
                        .flatten()
                        .flatten()
                        .map(|e| format!("{}", e.path().display())),
                );
            }
            if mounted_below(&env.pods_dir) || mounted_below(&env.dir.path().join("kubelet")) {
                left.push("a mount below the kubelet dir".into());
            }
            left
        })
        .await;
        if !left.is_empty() {
            self.anomaly("the node after teardown", "nothing left", &left.join(", "));
        }
        Ok(())
    }
}

/// Polls `left` until it is empty or [`SETTLE`] has passed; what is
/// still left then.
async fn settle<T, F: FnMut() -> Vec<T>>(mut left: F) -> Vec<T> {
    let t = Instant::now();
    loop {
        let l = left();
        if l.is_empty() || t.elapsed() > SETTLE {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A CRI call kubelet would retry: three tries, 2 s apart.
async fn retry<F, Fut>(what: &str, mut call: F) -> Step
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>>,
{
    let mut last = String::new();
    for _ in 0..3 {
        match call().await {
            Ok(()) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    Err(format!("{what}: {last}"))
}

/// ExecSync that reports a failed call instead of panicking (a soak
/// prints its summary either way).
async fn try_exec(cri: &mut Cri, cid: &str, script: &str) -> Result<(i32, String), String> {
    let r = cri
        .runtime
        .exec_sync(cri::ExecSyncRequest {
            container_id: cid.into(),
            cmd: vec!["sh".into(), "-c".into(), script.into()],
            timeout: 60,
        })
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    Ok((r.exit_code, String::from_utf8_lossy(&r.stdout).into_owned()))
}

fn kill9(pid: i32) {
    if let Some(p) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
    }
}

/// Whether anything is mounted at or below `dir`.
fn mounted_below(dir: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| Path::new(m).starts_with(dir))
}
