//! crust-bench: the benchmarks behind `crustctl bench`.
//!
//! - this module: a driver-agnostic CSI load generator ([`run_bench`]);
//! - [`deferred`]: the KEP-2857 path (`--deferred`), timed through the
//!   kubelet simulator;
//! - [`guest_io`]: I/O inside the guest against the host and virtio-fs
//!   (`--guest-io`).
//!
//! The load generator:
//!
//! It sends only standard CSI calls (plus `defer_fs_ops` when asked), reads
//! the driver's capabilities first and skips what the driver does not
//! advertise, and acts like kubelet around the calls: it creates the
//! staging directory and the target's parent directory of every operation,
//! passes the volume context from CreateVolume into stage/publish, attaches
//! with ControllerPublishVolume when the controller asks for it, and
//! requests the node's topology when the plugin has accessibility
//! constraints.
//!
//! Everything it creates (volumes, attachments, stagings, publications,
//! directories) is written into a ledger *before* the call that creates it
//! and removed only once undone, so cleanup after an error, a timeout or
//! Ctrl-C knows exactly what to undo. A CreateVolume whose outcome is
//! unknown (deadline, unavailable) is resolved by repeating it under the
//! same name — CSI makes that idempotent — and deleting what it returns.
//!
//! Latencies are kept in [`hist::Histogram`] (log-linear buckets, fixed
//! memory, < 1.6% over-estimate); counts are successful calls, errors are
//! failed calls, ops/s is successful calls over the scenario's wall time.

pub mod deferred;
pub mod guest_io;
pub mod hist;
pub mod scale;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_proto::csi::v1 as csi;
use serde::Serialize;
use tokio::sync::watch;
use tonic::{Code, Status};

use crust_csi_client::Csi;
use crust_report::units::human_duration;
use crust_report::{Render, table};
use hist::Histogram;

/// The workloads `bench` can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// CreateVolume then DeleteVolume of a fresh volume.
    CreateDelete,
    /// On one volume per worker: [NodeStage,] NodePublish, NodeUnpublish,
    /// [NodeUnstage] with fresh directories each time.
    StagePublishCycle,
    /// NodeGetVolumeStats round robin over published volumes.
    Stats,
    /// NodeGetVolumeHealth (CSI v1.13) round robin over published volumes.
    VolumeHealth,
    /// `--deferred`: NodeGetVolumeStats with defer_fs_ops on a volume a
    /// running sandbox holds (answered by the guest).
    #[value(skip)]
    DeferredStats,
    /// `--deferred`: NodeGetVolumeHealth of that volume (the guest's view).
    #[value(skip)]
    DeferredHealth,
    /// `--deferred`: ControllerExpandVolume + NodeExpandVolume with
    /// defer_fs_ops in small steps (grown online in the guest).
    #[value(skip)]
    DeferredExpand,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::CreateDelete => "create-delete",
            Scenario::StagePublishCycle => "stage-publish-cycle",
            Scenario::Stats => "stats",
            Scenario::VolumeHealth => "volume-health",
            Scenario::DeferredStats => "deferred-stats",
            Scenario::DeferredHealth => "deferred-health",
            Scenario::DeferredExpand => "deferred-expand",
        }
    }
}

/// How long each scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Duration(Duration),
    /// Operations (cycles) per scenario, across all workers.
    Ops(u64),
}

/// What to run and with which volume settings.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub scenarios: Vec<Scenario>,
    pub concurrency: usize,
    pub limit: Limit,
    /// Bytes requested for each volume.
    pub size: u64,
    /// Used for CreateVolume, stage and publish.
    pub capability: csi::VolumeCapability,
    pub params: HashMap<String, String>,
    /// Sent with create/delete/stage/publish; never printed.
    pub secrets: HashMap<String, String>,
    /// Root for per-op staging dirs; `None`: a temp dir removed afterwards.
    pub staging_dir: Option<PathBuf>,
    /// Root for per-op target parent dirs; `None`: a temp dir.
    pub target_dir: Option<PathBuf>,
    pub stats_volumes: usize,
    pub defer_fs_ops: bool,
    /// Attempts per cleanup call.
    pub cleanup_retries: u32,
    /// Prefix of every name and directory; `None`: `crust-bench-<random>`.
    pub run_id: Option<String>,
}

impl BenchConfig {
    /// Defaults: all scenarios, 4 workers, 100 ops, 64 MiB ext4-or-default
    /// single-node-writer mounts.
    pub fn new() -> BenchConfig {
        use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
        BenchConfig {
            scenarios: vec![
                Scenario::CreateDelete,
                Scenario::StagePublishCycle,
                Scenario::Stats,
            ],
            concurrency: 4,
            limit: Limit::Ops(100),
            size: 64 << 20,
            capability: csi::VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: Some(AccessMode {
                    mode: Mode::SingleNodeWriter as i32,
                }),
            },
            params: HashMap::new(),
            secrets: HashMap::new(),
            staging_dir: None,
            target_dir: None,
            stats_volumes: 4,
            defer_fs_ops: false,
            cleanup_retries: 5,
            run_id: None,
        }
    }
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig::new()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{rpc} failed: {:?}: {}", .status.code(), .status.message())]
    Discovery { rpc: &'static str, status: Status },
    #[error("{0}")]
    Unsupported(String),
    #[error("invalid bench config: {0}")]
    Config(String),
    /// The deferred mode's volume/sandbox could not be set up (it was
    /// torn down again).
    #[error("deferred set-up failed: {0}")]
    Setup(String),
    #[error("{what} {}: {source}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Latency figures of one RPC (or `cycle`) within a scenario.
#[derive(Debug, Clone, Serialize)]
pub struct RpcReport {
    pub rpc: String,
    /// Successful calls.
    pub count: u64,
    /// Failed calls.
    pub errors: u64,
    pub ops_per_sec: f64,
    pub p50_us: u64,
    pub p95_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    pub mean_us: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    pub scenario: Scenario,
    pub elapsed_secs: f64,
    /// Completed operations (a whole cycle for the cycle scenarios).
    pub ops: u64,
    /// Failed operations.
    pub errors: u64,
    pub rpcs: Vec<RpcReport>,
    /// A few distinct error messages, for diagnosis.
    pub error_samples: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    pub scenario: Scenario,
    pub reason: String,
}

/// What the cleanup path undid (per-op directories and error leftovers,
/// scenario set-ups, the final sweep), and what it could not.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CleanupReport {
    pub node_unpublished: u64,
    pub node_unstaged: u64,
    pub controller_unpublished: u64,
    pub volumes_deleted: u64,
    pub dirs_removed: u64,
    /// Items still present after every retry.
    pub leftovers: Vec<String>,
}

impl CleanupReport {
    fn add(&mut self, o: CleanupReport) {
        self.node_unpublished += o.node_unpublished;
        self.node_unstaged += o.node_unstaged;
        self.controller_unpublished += o.controller_unpublished;
        self.volumes_deleted += o.volumes_deleted;
        self.dirs_removed += o.dirs_removed;
        self.leftovers.extend(o.leftovers);
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub driver: String,
    pub vendor_version: String,
    pub run_id: String,
    pub concurrency: usize,
    /// `{"ops": N}` or `{"duration_secs": S}` per scenario.
    pub limit: serde_json::Value,
    pub scenarios: Vec<ScenarioReport>,
    pub skipped: Vec<Skipped>,
    pub notes: Vec<String>,
    pub cleanup: CleanupReport,
    pub interrupted: bool,
}

impl BenchReport {
    pub fn scenario(&self, s: Scenario) -> Option<&ScenarioReport> {
        self.scenarios.iter().find(|r| r.scenario == s)
    }

    pub fn total_errors(&self) -> u64 {
        self.scenarios
            .iter()
            .map(|s| s.errors + s.rpcs.iter().map(|r| r.errors).sum::<u64>())
            .sum()
    }
}

impl Render for BenchReport {
    fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("report serializes")
    }

    fn to_text(&self) -> String {
        let mut out = String::new();
        let limit = match (self.limit.get("ops"), self.limit.get("duration_secs")) {
            (Some(n), _) => format!("{n} ops per scenario"),
            (_, Some(d)) => format!("{d}s per scenario"),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "driver {} {}, run {}, concurrency {}, {}",
            self.driver, self.vendor_version, self.run_id, self.concurrency, limit
        );
        let mut rows = Vec::new();
        for s in &self.scenarios {
            for r in &s.rpcs {
                let d = |us: u64| human_duration(Duration::from_micros(us));
                rows.push(vec![
                    s.scenario.name().to_string(),
                    r.rpc.clone(),
                    r.count.to_string(),
                    r.errors.to_string(),
                    format!("{:.1}", r.ops_per_sec),
                    d(r.p50_us),
                    d(r.p95_us),
                    d(r.p99_us),
                    d(r.max_us),
                ]);
            }
        }
        out.push_str(&table(
            &[
                "SCENARIO", "RPC", "COUNT", "ERRORS", "OPS/S", "P50", "P95", "P99", "MAX",
            ],
            &rows,
        ));
        for s in &self.scenarios {
            for e in &s.error_samples {
                let _ = writeln!(out, "error in {}: {e}", s.scenario.name());
            }
        }
        for s in &self.skipped {
            let _ = writeln!(out, "skipped {}: {}", s.scenario.name(), s.reason);
        }
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        let c = &self.cleanup;
        let _ = writeln!(
            out,
            "cleanup: {} volumes deleted, {} node-unpublished, {} unstaged, {} controller-unpublished, {} dirs removed, {} left over",
            c.volumes_deleted,
            c.node_unpublished,
            c.node_unstaged,
            c.controller_unpublished,
            c.dirs_removed,
            c.leftovers.len()
        );
        for l in &c.leftovers {
            let _ = writeln!(out, "left over: {l}");
        }
        if self.interrupted {
            out.push_str("interrupted: the run stopped early\n");
        }
        out
    }
}

/// A run prefix unique per run: `crust-bench-` and 8 random hex digits.
pub fn new_run_id() -> String {
    use std::io::Read;
    let mut b = [0u8; 4];
    let random = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if random.is_err() {
        // Fall back to the std hasher's per-process random keys.
        use std::hash::{BuildHasher, RandomState};
        let v = RandomState::new().hash_one(std::process::id());
        b = (v as u32).to_le_bytes();
    }
    format!(
        "crust-bench-{}",
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    )
}

// ---------------------------------------------------------------- recording

#[derive(Default)]
struct Row {
    hist: Histogram,
    errors: u64,
}

/// Per-scenario latency rows, in first-use order.
#[derive(Default)]
struct Recorder {
    rows: Mutex<Vec<(&'static str, Row)>>,
    samples: Mutex<Vec<String>>,
    ops: AtomicU64,
    failed_ops: AtomicU64,
}

const MAX_ERROR_SAMPLES: usize = 5;

impl Recorder {
    fn with_row(&self, rpc: &'static str, f: impl FnOnce(&mut Row)) {
        let mut rows = self.rows.lock().unwrap();
        if let Some((_, r)) = rows.iter_mut().find(|(n, _)| *n == rpc) {
            f(r)
        } else {
            let mut r = Row::default();
            f(&mut r);
            rows.push((rpc, r));
        }
    }

    fn ok(&self, rpc: &'static str, d: Duration) {
        self.with_row(rpc, |r| r.hist.record(d.as_micros() as u64));
    }

    fn err(&self, rpc: &'static str, msg: String) {
        self.with_row(rpc, |r| r.errors += 1);
        self.sample(format!("{rpc}: {msg}"));
    }

    /// A cycle that did not complete (its failing RPC is already counted).
    fn cycle_failed(&self) {
        self.failed_ops.fetch_add(1, Ordering::Relaxed);
        self.with_row("cycle", |r| r.errors += 1);
    }

    fn sample(&self, msg: String) {
        let mut s = self.samples.lock().unwrap();
        if s.len() < MAX_ERROR_SAMPLES && !s.contains(&msg) {
            s.push(msg);
        }
    }

    async fn timed<T>(
        &self,
        rpc: &'static str,
        fut: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        let t0 = Instant::now();
        let r = fut.await;
        match &r {
            Ok(_) => self.ok(rpc, t0.elapsed()),
            Err(s) => self.err(rpc, status_text(s)),
        }
        r
    }

    fn report(&self, scenario: Scenario, elapsed: Duration) -> ScenarioReport {
        let secs = elapsed.as_secs_f64().max(1e-9);
        let rpcs = self
            .rows
            .lock()
            .unwrap()
            .iter()
            .map(|(name, r)| RpcReport {
                rpc: name.to_string(),
                count: r.hist.count(),
                errors: r.errors,
                ops_per_sec: r.hist.count() as f64 / secs,
                p50_us: r.hist.percentile(50.0),
                p95_us: r.hist.percentile(95.0),
                p99_us: r.hist.percentile(99.0),
                max_us: r.hist.max(),
                mean_us: r.hist.mean(),
            })
            .collect();
        ScenarioReport {
            scenario,
            elapsed_secs: elapsed.as_secs_f64(),
            ops: self.ops.load(Ordering::Relaxed),
            errors: self.failed_ops.load(Ordering::Relaxed),
            rpcs,
            error_samples: self.samples.lock().unwrap().clone(),
        }
    }
}

fn status_text(s: &Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

// ------------------------------------------------------------------ ledger

#[derive(Debug, Clone)]
enum Item {
    /// `id` is `None` while the CreateVolume outcome is unknown.
    Volume {
        name: String,
        id: Option<String>,
    },
    ControllerPublished {
        volume: String,
        node: String,
    },
    Staged {
        volume: String,
        path: String,
    },
    Published {
        volume: String,
        target: String,
    },
    /// A directory we made; `child` is a path inside it the driver may
    /// have created (the publish target). `root` dirs outlive scenarios.
    Dir {
        path: PathBuf,
        child: Option<PathBuf>,
        root: bool,
    },
}

impl Item {
    /// Undo order: publications, stagings, attachments, volumes, dirs.
    fn phase(&self) -> u8 {
        match self {
            Item::Published { .. } => 0,
            Item::Staged { .. } => 1,
            Item::ControllerPublished { .. } => 2,
            Item::Volume { .. } => 3,
            Item::Dir { .. } => 4,
        }
    }
}

#[derive(Default)]
struct Ledger {
    next: u64,
    items: BTreeMap<u64, Item>,
}

impl Ledger {
    fn add(&mut self, item: Item) -> u64 {
        self.next += 1;
        self.items.insert(self.next, item);
        self.next
    }
}

// ----------------------------------------------------------------- context

struct Ctx {
    csi: Csi,
    cfg: BenchConfig,
    run_id: String,
    staging_root: PathBuf,
    target_root: PathBuf,
    stage: bool,
    controller_publish: bool,
    node_id: String,
    topology: Option<csi::Topology>,
    ledger: Mutex<Ledger>,
    /// Totals of every cleanup pass (per op, per scenario, final).
    cleaned: Mutex<CleanupReport>,
    stop: watch::Receiver<bool>,
    seq: AtomicU64,
}

/// A volume a worker uses.
#[derive(Clone)]
struct Vol {
    id: String,
    context: HashMap<String, String>,
    publish_context: HashMap<String, String>,
}

/// Directories and ledger keys of one publish of one volume.
struct Mount {
    staging: String,
    target: String,
    keys: Vec<u64>,
}

fn transient(code: Code) -> bool {
    matches!(
        code,
        Code::DeadlineExceeded | Code::Unavailable | Code::Cancelled | Code::Unknown
    )
}

impl Ctx {
    fn stopped(&self) -> bool {
        *self.stop.borrow()
    }

    fn track(&self, item: Item) -> u64 {
        self.ledger.lock().unwrap().add(item)
    }

    fn untrack(&self, key: u64) {
        self.ledger.lock().unwrap().items.remove(&key);
    }

    fn create_request(&self, name: String) -> csi::CreateVolumeRequest {
        csi::CreateVolumeRequest {
            name,
            capacity_range: Some(csi::CapacityRange {
                required_bytes: self.cfg.size as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![self.cfg.capability.clone()],
            parameters: self.cfg.params.clone(),
            secrets: self.cfg.secrets.clone(),
            accessibility_requirements: self.topology.clone().map(|t| csi::TopologyRequirement {
                requisite: vec![t.clone()],
                preferred: vec![t],
            }),
            ..Default::default()
        }
    }

    /// CreateVolume, tracked. Returns the ledger key and the volume.
    async fn create(&self, rec: Option<&Recorder>, name: String) -> Result<(u64, Vol), Status> {
        let key = self.track(Item::Volume {
            name: name.clone(),
            id: None,
        });
        let call = async {
            let resp = self.csi.create_volume(self.create_request(name)).await?;
            match resp.volume {
                Some(v) if !v.volume_id.is_empty() => Ok(v),
                _ => Err(Status::internal("CreateVolume returned no volume id")),
            }
        };
        let res = match rec {
            Some(r) => r.timed("CreateVolume", call).await,
            None => call.await,
        };
        match res {
            Ok(v) => {
                if let Some(Item::Volume { id, .. }) =
                    self.ledger.lock().unwrap().items.get_mut(&key)
                {
                    *id = Some(v.volume_id.clone());
                }
                Ok((
                    key,
                    Vol {
                        id: v.volume_id,
                        context: v.volume_context,
                        publish_context: HashMap::new(),
                    },
                ))
            }
            Err(s) => {
                // A definite failure created nothing; an unknown outcome
                // stays in the ledger for cleanup to resolve.
                if !transient(s.code()) && s.code() != Code::Internal {
                    self.untrack(key);
                }
                Err(s)
            }
        }
    }

    /// Attaches the volume to this node when the controller wants that.
    async fn attach(&self, vol: &mut Vol) -> Result<Option<u64>, Status> {
        if !self.controller_publish {
            return Ok(None);
        }
        let key = self.track(Item::ControllerPublished {
            volume: vol.id.clone(),
            node: self.node_id.clone(),
        });
        let resp = self
            .csi
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: vol.id.clone(),
                node_id: self.node_id.clone(),
                volume_capability: Some(self.cfg.capability.clone()),
                readonly: false,
                secrets: self.cfg.secrets.clone(),
                volume_context: vol.context.clone(),
            })
            .await?;
        vol.publish_context = resp.publish_context;
        Ok(Some(key))
    }

    /// Makes the per-op staging dir (when staging) and target parent dir,
    /// the way kubelet does before calling the driver.
    fn make_dirs(&self, n: u64) -> Result<Mount, BenchError> {
        // Distinct names, so one root may serve as both staging and target.
        let mut keys = Vec::new();
        let staging = if self.stage {
            let p = self.staging_root.join(format!("{}-stage-{n}", self.run_id));
            std::fs::create_dir(&p).map_err(|source| BenchError::Io {
                what: "create staging dir",
                path: p.clone(),
                source,
            })?;
            keys.push(self.track(Item::Dir {
                path: p.clone(),
                child: None,
                root: false,
            }));
            p
        } else {
            PathBuf::new()
        };
        let parent = self.target_root.join(format!("{}-pod-{n}", self.run_id));
        if let Err(source) = std::fs::create_dir(&parent) {
            return Err(BenchError::Io {
                what: "create target parent dir",
                path: parent,
                source,
            });
        }
        let target = parent.join("volume");
        keys.push(self.track(Item::Dir {
            path: parent,
            child: Some(target.clone()),
            root: false,
        }));
        let utf8 = |p: &Path| {
            p.to_str()
                .map(str::to_string)
                .ok_or_else(|| BenchError::Io {
                    what: "use",
                    path: p.to_path_buf(),
                    source: std::io::Error::other("path is not UTF-8"),
                })
        };
        Ok(Mount {
            staging: if self.stage {
                utf8(&staging)?
            } else {
                String::new()
            },
            target: utf8(&target)?,
            keys,
        })
    }

    async fn stage(&self, rec: Option<&Recorder>, vol: &Vol, m: &mut Mount) -> Result<(), Status> {
        if !self.stage {
            return Ok(());
        }
        m.keys.push(self.track(Item::Staged {
            volume: vol.id.clone(),
            path: m.staging.clone(),
        }));
        let call = self.csi.node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: vol.id.clone(),
            publish_context: vol.publish_context.clone(),
            staging_target_path: m.staging.clone(),
            volume_capability: Some(self.cfg.capability.clone()),
            secrets: self.cfg.secrets.clone(),
            volume_context: vol.context.clone(),
        });
        match rec {
            Some(r) => r.timed("NodeStageVolume", call).await.map(drop),
            None => call.await.map(drop),
        }
    }

    async fn publish(
        &self,
        rec: Option<&Recorder>,
        vol: &Vol,
        m: &mut Mount,
    ) -> Result<(), Status> {
        m.keys.push(self.track(Item::Published {
            volume: vol.id.clone(),
            target: m.target.clone(),
        }));
        let call = self.csi.node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: vol.id.clone(),
            publish_context: vol.publish_context.clone(),
            staging_target_path: m.staging.clone(),
            target_path: m.target.clone(),
            volume_capability: Some(self.cfg.capability.clone()),
            readonly: false,
            secrets: self.cfg.secrets.clone(),
            volume_context: vol.context.clone(),
            defer_fs_ops: self.cfg.defer_fs_ops,
        });
        match rec {
            Some(r) => r.timed("NodePublishVolume", call).await.map(drop),
            None => call.await.map(drop),
        }
    }

    /// Takes the ledger entries with `keys` (all when `None`) in undo order.
    fn pending(&self, keys: Option<&[u64]>, roots: bool) -> Vec<(u64, Item)> {
        let l = self.ledger.lock().unwrap();
        let mut v: Vec<(u64, Item)> = l
            .items
            .iter()
            .filter(|(k, _)| keys.is_none_or(|ks| ks.contains(k)))
            .filter(|(_, i)| roots || !matches!(i, Item::Dir { root: true, .. }))
            .map(|(k, i)| (*k, i.clone()))
            .collect();
        // Within a phase, newest first (a dir's children before the dir).
        v.sort_by(|a, b| a.1.phase().cmp(&b.1.phase()).then(b.0.cmp(&a.0)));
        v
    }

    /// Calls `f` until it succeeds or answers NOT_FOUND (nothing to undo),
    /// at most `cleanup_retries` times with a growing pause.
    async fn retry<F, Fut>(&self, what: &str, mut f: F) -> Result<(), String>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(), Status>>,
    {
        let mut pause = Duration::from_millis(100);
        let attempts = self.cfg.cleanup_retries.max(1);
        for attempt in 1..=attempts {
            match f().await {
                Ok(()) => return Ok(()),
                Err(s) if s.code() == Code::NotFound => return Ok(()),
                Err(s)
                    if attempt == attempts
                        || matches!(
                            s.code(),
                            Code::InvalidArgument | Code::Unimplemented | Code::PermissionDenied
                        ) =>
                {
                    return Err(format!("{what}: {}", status_text(&s)));
                }
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            }
        }
        unreachable!("the last attempt returns")
    }

    /// Undoes the ledger entries with `keys` (everything when `None`).
    async fn cleanup(&self, keys: Option<&[u64]>, roots: bool) -> CleanupReport {
        let mut rep = CleanupReport::default();
        for (key, item) in self.pending(keys, roots) {
            let res = match &item {
                Item::Published { volume, target } => self
                    .retry(
                        &format!("NodeUnpublishVolume {volume} {target}"),
                        || async {
                            self.csi
                                .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                                    volume_id: volume.clone(),
                                    target_path: target.clone(),
                                    defer_fs_ops: self.cfg.defer_fs_ops,
                                })
                                .await
                                .map(drop)
                        },
                    )
                    .await
                    .map(|()| rep.node_unpublished += 1),
                Item::Staged { volume, path } => self
                    .retry(&format!("NodeUnstageVolume {volume} {path}"), || async {
                        self.csi
                            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                                volume_id: volume.clone(),
                                staging_target_path: path.clone(),
                            })
                            .await
                            .map(drop)
                    })
                    .await
                    .map(|()| rep.node_unstaged += 1),
                Item::ControllerPublished { volume, node } => self
                    .retry(
                        &format!("ControllerUnpublishVolume {volume} {node}"),
                        || async {
                            self.csi
                                .controller_unpublish_volume(
                                    csi::ControllerUnpublishVolumeRequest {
                                        volume_id: volume.clone(),
                                        node_id: node.clone(),
                                        secrets: self.cfg.secrets.clone(),
                                    },
                                )
                                .await
                                .map(drop)
                        },
                    )
                    .await
                    .map(|()| rep.controller_unpublished += 1),
                Item::Volume { name, id } => {
                    let id = match id {
                        Some(id) => Some(id.clone()),
                        None => self.resolve_unknown_create(name).await,
                    };
                    match id {
                        None => Ok(()),
                        Some(id) => self
                            .retry(&format!("DeleteVolume {id} ({name})"), || async {
                                self.csi
                                    .delete_volume(csi::DeleteVolumeRequest {
                                        volume_id: id.clone(),
                                        secrets: self.cfg.secrets.clone(),
                                    })
                                    .await
                                    .map(drop)
                            })
                            .await
                            .map(|()| rep.volumes_deleted += 1),
                    }
                }
                Item::Dir { path, child, .. } => remove_dir(path, child.as_deref())
                    .map(|removed| {
                        if removed {
                            rep.dirs_removed += 1
                        }
                    })
                    .map_err(|e| format!("directory {}: {e}", path.display())),
            };
            match res {
                Ok(()) => self.untrack(key),
                Err(e) => {
                    rep.leftovers.push(e);
                    // Reported once; do not try again in a later pass.
                    self.untrack(key);
                }
            }
        }
        self.cleaned.lock().unwrap().add(rep.clone());
        rep
    }

    /// A CreateVolume whose outcome is unknown: ask again under the same
    /// name (idempotent) and return the id so it can be deleted.
    async fn resolve_unknown_create(&self, name: &str) -> Option<String> {
        let attempts = self.cfg.cleanup_retries.max(1);
        for _ in 0..attempts {
            match self
                .csi
                .create_volume(self.create_request(name.to_string()))
                .await
            {
                Ok(r) => return r.volume.map(|v| v.volume_id).filter(|id| !id.is_empty()),
                Err(s) if !transient(s.code()) => return None,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        None
    }
}

/// Removes `child` (if the driver left it; only an empty dir or a plain
/// file) and then `path`. Never recursive: a mount still there makes this
/// fail, which is reported instead of hidden. Ok(false): already gone.
fn remove_dir(path: &Path, child: Option<&Path>) -> std::io::Result<bool> {
    if let Some(c) = child
        && std::fs::remove_dir(c).is_err()
    {
        let _ = std::fs::remove_file(c);
    }
    match std::fs::remove_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Hands out operation numbers until the limit or a stop.
struct Claims {
    limit: Limit,
    next: AtomicU64,
    deadline: Option<Instant>,
}

impl Claims {
    fn new(limit: Limit) -> Claims {
        Claims {
            limit,
            next: AtomicU64::new(0),
            deadline: match limit {
                Limit::Duration(d) => Some(Instant::now() + d),
                Limit::Ops(_) => None,
            },
        }
    }

    fn claim(&self, ctx: &Ctx) -> Option<u64> {
        if ctx.stopped() {
            return None;
        }
        match self.limit {
            Limit::Ops(n) => {
                let i = self.next.fetch_add(1, Ordering::Relaxed);
                (i < n).then_some(i)
            }
            Limit::Duration(_) => (Instant::now() < self.deadline.expect("set for durations"))
                .then(|| self.next.fetch_add(1, Ordering::Relaxed)),
        }
    }
}

// --------------------------------------------------------------- scenarios

async fn create_delete(ctx: Arc<Ctx>, claims: Arc<Claims>, rec: Arc<Recorder>) {
    while claims.claim(&ctx).is_some() {
        let n = ctx.seq.fetch_add(1, Ordering::Relaxed);
        let t0 = Instant::now();
        let Ok((key, vol)) = ctx.create(Some(&rec), format!("{}-{n}", ctx.run_id)).await else {
            rec.cycle_failed();
            continue;
        };
        let del = rec
            .timed(
                "DeleteVolume",
                ctx.csi.delete_volume(csi::DeleteVolumeRequest {
                    volume_id: vol.id.clone(),
                    secrets: ctx.cfg.secrets.clone(),
                }),
            )
            .await;
        if del.is_ok() {
            ctx.untrack(key);
            rec.ok("cycle", t0.elapsed());
            rec.ops.fetch_add(1, Ordering::Relaxed);
        } else {
            rec.cycle_failed();
            let rep = ctx.cleanup(Some(&[key]), false).await;
            for l in rep.leftovers {
                rec.sample(format!("cleanup: {l}"));
            }
        }
    }
}

/// Creates (and attaches) one volume for a worker; not timed.
async fn setup_volume(ctx: &Ctx, rec: &Recorder, tag: &str) -> Option<(Vol, Vec<u64>)> {
    let n = ctx.seq.fetch_add(1, Ordering::Relaxed);
    let (key, mut vol) = match ctx.create(None, format!("{}-{tag}{n}", ctx.run_id)).await {
        Ok(v) => v,
        Err(s) => {
            rec.sample(format!("setup CreateVolume: {}", status_text(&s)));
            return None;
        }
    };
    let mut keys = vec![key];
    match ctx.attach(&mut vol).await {
        Ok(k) => keys.extend(k),
        Err(s) => {
            rec.sample(format!(
                "setup ControllerPublishVolume: {}",
                status_text(&s)
            ));
            let _ = ctx.cleanup(Some(&keys), false).await;
            return None;
        }
    }
    Some((vol, keys))
}

async fn stage_publish_cycle(ctx: Arc<Ctx>, claims: Arc<Claims>, rec: Arc<Recorder>) {
    if ctx.stopped() {
        return;
    }
    let Some((vol, vol_keys)) = setup_volume(&ctx, &rec, "sp").await else {
        rec.failed_ops.fetch_add(1, Ordering::Relaxed);
        return;
    };
    while claims.claim(&ctx).is_some() {
        let n = ctx.seq.fetch_add(1, Ordering::Relaxed);
        let t0 = Instant::now();
        let mut m = match ctx.make_dirs(n) {
            Ok(m) => m,
            Err(e) => {
                rec.cycle_failed();
                rec.sample(e.to_string());
                continue;
            }
        };
        let mut ok = ctx.stage(Some(&rec), &vol, &mut m).await.is_ok()
            && ctx.publish(Some(&rec), &vol, &mut m).await.is_ok();
        if ok {
            // Undo in kubelet's order, timing each call.
            let k_pub = m.keys[m.keys.len() - 1];
            let r = rec
                .timed(
                    "NodeUnpublishVolume",
                    ctx.csi
                        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                            volume_id: vol.id.clone(),
                            target_path: m.target.clone(),
                            defer_fs_ops: ctx.cfg.defer_fs_ops,
                        }),
                )
                .await;
            ok = r.is_ok();
            if ok {
                ctx.untrack(k_pub);
            }
            if ok && ctx.stage {
                let k_stage = m.keys[m.keys.len() - 2];
                let r = rec
                    .timed(
                        "NodeUnstageVolume",
                        ctx.csi.node_unstage_volume(csi::NodeUnstageVolumeRequest {
                            volume_id: vol.id.clone(),
                            staging_target_path: m.staging.clone(),
                        }),
                    )
                    .await;
                ok = r.is_ok();
                if ok {
                    ctx.untrack(k_stage);
                }
            }
        }
        // Whatever this op still holds (dirs always; mounts after an error).
        let rep = ctx.cleanup(Some(&m.keys), false).await;
        for l in &rep.leftovers {
            rec.sample(format!("cleanup: {l}"));
        }
        if ok && rep.leftovers.is_empty() {
            rec.ok("cycle", t0.elapsed());
            rec.ops.fetch_add(1, Ordering::Relaxed);
        } else {
            rec.cycle_failed();
        }
    }
    let rep = ctx.cleanup(Some(&vol_keys), false).await;
    for l in rep.leftovers {
        rec.sample(format!("cleanup: {l}"));
    }
}

/// NodeGetVolumeStats, or NodeGetVolumeHealth for [`Scenario::VolumeHealth`],
/// round robin over `vols`.
async fn stats_worker(
    ctx: Arc<Ctx>,
    claims: Arc<Claims>,
    rec: Arc<Recorder>,
    vols: Arc<Vec<(Vol, Mount)>>,
    scenario: Scenario,
) {
    while let Some(i) = claims.claim(&ctx) {
        let (vol, m) = &vols[(i % vols.len() as u64) as usize];
        let ok = if scenario == Scenario::VolumeHealth {
            let req = csi::NodeGetVolumeHealthRequest {
                volume_id: vol.id.clone(),
                volume_publish_path: m.target.clone(),
                staging_target_path: m.staging.clone(),
            };
            rec.timed("NodeGetVolumeHealth", ctx.csi.node_get_volume_health(req))
                .await
                .is_ok()
        } else {
            let req = csi::NodeGetVolumeStatsRequest {
                volume_id: vol.id.clone(),
                volume_path: m.target.clone(),
                staging_target_path: m.staging.clone(),
                defer_fs_ops: ctx.cfg.defer_fs_ops,
            };
            rec.timed("NodeGetVolumeStats", ctx.csi.node_get_volume_stats(req))
                .await
                .is_ok()
        };
        let counter = if ok { &rec.ops } else { &rec.failed_ops };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Stages and publishes `stats_volumes` volumes (not timed), then runs the
/// stats (or volume-health) workers over them.
async fn stats(ctx: Arc<Ctx>, rec: Arc<Recorder>, scenario: Scenario) -> Duration {
    let mut setup = tokio::task::JoinSet::new();
    let sem = Arc::new(tokio::sync::Semaphore::new(ctx.cfg.concurrency));
    for _ in 0..ctx.cfg.stats_volumes {
        let (ctx, rec, sem) = (ctx.clone(), rec.clone(), sem.clone());
        setup.spawn(async move {
            let _permit = sem.acquire_owned().await.ok()?;
            if ctx.stopped() {
                return None;
            }
            let (vol, vol_keys) = setup_volume(&ctx, &rec, "st").await?;
            let n = ctx.seq.fetch_add(1, Ordering::Relaxed);
            let mut m = match ctx.make_dirs(n) {
                Ok(m) => m,
                Err(e) => {
                    rec.sample(format!("setup: {e}"));
                    return None;
                }
            };
            m.keys.extend(vol_keys);
            if let Err(s) = ctx.stage(None, &vol, &mut m).await {
                rec.sample(format!("setup NodeStageVolume: {}", status_text(&s)));
                return None;
            }
            if let Err(s) = ctx.publish(None, &vol, &mut m).await {
                rec.sample(format!("setup NodePublishVolume: {}", status_text(&s)));
                return None;
            }
            Some((vol, m))
        });
    }
    let mut vols = Vec::new();
    while let Some(r) = setup.join_next().await {
        match r {
            Ok(Some(v)) => vols.push(v),
            Ok(None) => {}
            Err(e) => rec.sample(format!("setup task: {e}")),
        }
    }
    let t0 = Instant::now();
    if vols.len() == ctx.cfg.stats_volumes && !ctx.stopped() {
        let vols = Arc::new(vols);
        let claims = Arc::new(Claims::new(ctx.cfg.limit));
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..ctx.cfg.concurrency {
            set.spawn(stats_worker(
                ctx.clone(),
                claims.clone(),
                rec.clone(),
                vols.clone(),
                scenario,
            ));
        }
        join_all(&mut set, &rec).await;
    } else if !ctx.stopped() {
        rec.failed_ops.fetch_add(1, Ordering::Relaxed);
        rec.sample(format!(
            "setup: only {} of {} volumes published; scenario not run",
            vols.len(),
            ctx.cfg.stats_volumes
        ));
    }
    t0.elapsed()
}

async fn join_all(set: &mut tokio::task::JoinSet<()>, rec: &Recorder) {
    while let Some(r) = set.join_next().await {
        if let Err(e) = r {
            rec.failed_ops.fetch_add(1, Ordering::Relaxed);
            rec.sample(format!("worker failed: {e}"));
        }
    }
}

// -------------------------------------------------------------- discovery

struct Discovered {
    driver: String,
    vendor_version: String,
    controller: HashSet<i32>,
    has_controller_service: bool,
    accessibility: bool,
    node: Option<HashSet<i32>>,
    node_id: String,
    topology: Option<csi::Topology>,
    notes: Vec<String>,
}

async fn discover(c: &Csi) -> Result<Discovered, BenchError> {
    use csi::plugin_capability::{Type as PType, service::Type as Svc};
    let disc = |rpc| move |status| BenchError::Discovery { rpc, status };
    let info = c
        .get_plugin_info(Default::default())
        .await
        .map_err(disc("GetPluginInfo"))?;
    let probe = c.probe(Default::default()).await.map_err(disc("Probe"))?;
    if probe.ready == Some(false) {
        return Err(BenchError::Unsupported(format!(
            "driver {} reports not ready (Probe)",
            info.name
        )));
    }
    let pcaps = c
        .get_plugin_capabilities(Default::default())
        .await
        .map_err(disc("GetPluginCapabilities"))?;
    let svc = |t: Svc| {
        pcaps
            .capabilities
            .iter()
            .any(|c| matches!(&c.r#type, Some(PType::Service(s)) if s.r#type == t as i32))
    };
    let has_controller_service = svc(Svc::ControllerService);
    let accessibility = svc(Svc::VolumeAccessibilityConstraints);
    let mut notes = Vec::new();
    let mut controller = HashSet::new();
    if has_controller_service {
        use csi::controller_service_capability::Type;
        let caps = c
            .controller_get_capabilities(Default::default())
            .await
            .map_err(disc("ControllerGetCapabilities"))?;
        controller = caps
            .capabilities
            .iter()
            .filter_map(|c| c.r#type.as_ref().map(|Type::Rpc(r)| r.r#type))
            .collect();
    }
    let (node, node_id, topology) = match c.node_get_capabilities(Default::default()).await {
        Ok(caps) => {
            use csi::node_service_capability::Type;
            let set: HashSet<i32> = caps
                .capabilities
                .iter()
                .filter_map(|c| c.r#type.as_ref().map(|Type::Rpc(r)| r.r#type))
                .collect();
            match c.node_get_info(Default::default()).await {
                Ok(info) => (Some(set), info.node_id, info.accessible_topology),
                Err(s) => {
                    notes.push(format!(
                        "NodeGetInfo failed ({}): no node service",
                        status_text(&s)
                    ));
                    (None, String::new(), None)
                }
            }
        }
        Err(s) => {
            notes.push(format!(
                "NodeGetCapabilities failed ({}): no node service",
                status_text(&s)
            ));
            (None, String::new(), None)
        }
    };
    Ok(Discovered {
        driver: info.name,
        vendor_version: info.vendor_version,
        controller,
        has_controller_service,
        accessibility,
        node,
        node_id,
        topology,
        notes,
    })
}

/// Makes `dir` and any missing parents, recording each one we made so
/// cleanup removes exactly those.
fn make_root(ledger: &mut Ledger, dir: &Path) -> Result<(), BenchError> {
    crust_kubesim::dirs::create_missing(dir, |p| {
        ledger.add(Item::Dir {
            path: p.to_path_buf(),
            child: None,
            root: true,
        });
    })
    .map_err(|(path, source)| BenchError::Io {
        what: "create directory",
        path,
        source,
    })?;
    if !dir.is_dir() {
        return Err(BenchError::Io {
            what: "use directory",
            path: dir.to_path_buf(),
            source: std::io::Error::other("not a directory"),
        });
    }
    Ok(())
}

/// Refuses a configuration no run could honour, before any call.
fn check_config(cfg: &BenchConfig) -> Result<(), BenchError> {
    if cfg.concurrency == 0 {
        return Err(BenchError::Config("concurrency must be at least 1".into()));
    }
    if cfg.stats_volumes == 0
        && cfg
            .scenarios
            .iter()
            .any(|s| matches!(s, Scenario::Stats | Scenario::VolumeHealth))
    {
        return Err(BenchError::Config("stats needs at least 1 volume".into()));
    }
    if matches!(cfg.limit, Limit::Ops(0)) {
        return Err(BenchError::Config("ops must be at least 1".into()));
    }
    if let Some(s) = cfg.scenarios.iter().find(|s| {
        matches!(
            s,
            Scenario::DeferredStats | Scenario::DeferredExpand | Scenario::DeferredHealth
        )
    }) {
        return Err(BenchError::Config(format!(
            "{} runs only in deferred mode (bench::deferred)",
            s.name()
        )));
    }
    if cfg.capability.access_type.is_none() || cfg.capability.access_mode.is_none() {
        return Err(BenchError::Config(
            "the volume capability needs an access type and mode".into(),
        ));
    }
    Ok(())
}

/// Runs the configured scenarios against `csi`. Sending `true` on `stop`
/// (Ctrl-C) stops new work; cleanup still runs. Errors of individual calls
/// are counted in the report; `Err` means the run could not start.
pub async fn run_bench(
    csi: &Csi,
    cfg: BenchConfig,
    stop: watch::Receiver<bool>,
) -> Result<BenchReport, BenchError> {
    use csi::controller_service_capability::rpc::Type as CT;
    use csi::node_service_capability::rpc::Type as NT;

    check_config(&cfg)?;
    let run_id = cfg.run_id.clone().unwrap_or_else(new_run_id);
    let d = discover(csi).await?;
    let mut notes = d.notes.clone();
    let mut skipped = Vec::new();
    let can_create =
        d.has_controller_service && d.controller.contains(&(CT::CreateDeleteVolume as i32));
    let has_node = |t: NT| d.node.as_ref().is_some_and(|n| n.contains(&(t as i32)));
    let mut run = Vec::new();
    for &s in &cfg.scenarios {
        let why = match s {
            _ if !d.has_controller_service => {
                Some("plugin does not advertise CONTROLLER_SERVICE (no CreateVolume)".to_string())
            }
            _ if !can_create => {
                Some("controller does not advertise CREATE_DELETE_VOLUME".to_string())
            }
            Scenario::CreateDelete => None,
            _ if d.node.is_none() => Some("no node service on this endpoint".to_string()),
            Scenario::Stats if !has_node(NT::GetVolumeStats) => {
                Some("node does not advertise GET_VOLUME_STATS".to_string())
            }
            Scenario::VolumeHealth if !has_node(NT::GetVolumeHealth) => {
                Some("node does not advertise GET_VOLUME_HEALTH (CSI v1.13)".to_string())
            }
            _ => None,
        };
        match why {
            Some(reason) => skipped.push(Skipped {
                scenario: s,
                reason,
            }),
            None => run.push(s),
        }
    }
    let node_scenarios = run.iter().any(|s| *s != Scenario::CreateDelete);
    let stage = has_node(NT::StageUnstageVolume);
    if node_scenarios && !stage {
        notes.push(
            "node does not advertise STAGE_UNSTAGE_VOLUME: NodeStageVolume/NodeUnstageVolume not called"
                .into(),
        );
    }
    if node_scenarios && cfg.defer_fs_ops && !has_node(NT::DeferFsOps) {
        return Err(BenchError::Unsupported(
            "--defer-fs-ops given but the node does not advertise DEFER_FS_OPS".into(),
        ));
    }
    let controller_publish = d.controller.contains(&(CT::PublishUnpublishVolume as i32));
    if node_scenarios && controller_publish {
        notes.push(format!(
            "controller advertises PUBLISH_UNPUBLISH_VOLUME: volumes are attached to node {:?} first (not timed)",
            d.node_id
        ));
    }
    let topology = if d.accessibility {
        d.topology.clone()
    } else {
        None
    };

    // Roots for per-op directories.
    let mut ledger = Ledger::default();
    let base = std::env::temp_dir().join(&run_id);
    let staging_root = cfg
        .staging_dir
        .clone()
        .unwrap_or_else(|| base.join("staging"));
    let target_root = cfg
        .target_dir
        .clone()
        .unwrap_or_else(|| base.join("target"));
    if node_scenarios
        && let Err(e) = make_root(&mut ledger, &staging_root)
            .and_then(|()| make_root(&mut ledger, &target_root))
    {
        // Undo the roots we made before failing.
        for item in ledger.items.values().rev() {
            if let Item::Dir { path, .. } = item {
                let _ = std::fs::remove_dir(path);
            }
        }
        return Err(e);
    }

    let ctx = Arc::new(Ctx {
        csi: csi.clone(),
        run_id: run_id.clone(),
        staging_root,
        target_root,
        stage,
        controller_publish,
        node_id: d.node_id.clone(),
        topology,
        ledger: Mutex::new(ledger),
        cleaned: Mutex::new(CleanupReport::default()),
        stop,
        seq: AtomicU64::new(0),
        cfg,
    });

    let mut reports = Vec::new();
    for s in run {
        if ctx.stopped() {
            break;
        }
        let rec = Arc::new(Recorder::default());
        let t0 = Instant::now();
        let elapsed = match s {
            Scenario::Stats | Scenario::VolumeHealth => stats(ctx.clone(), rec.clone(), s).await,
            _ => {
                let claims = Arc::new(Claims::new(ctx.cfg.limit));
                let mut set = tokio::task::JoinSet::new();
                for _ in 0..ctx.cfg.concurrency {
                    let (c, cl, r) = (ctx.clone(), claims.clone(), rec.clone());
                    if s == Scenario::CreateDelete {
                        set.spawn(create_delete(c, cl, r));
                    } else {
                        set.spawn(stage_publish_cycle(c, cl, r));
                    }
                }
                join_all(&mut set, &rec).await;
                t0.elapsed()
            }
        };
        // Whatever the scenario still holds (stats volumes, error leftovers).
        ctx.cleanup(None, false).await;
        reports.push(rec.report(s, elapsed));
    }
    ctx.cleanup(None, true).await;
    let cleanup = ctx.cleaned.lock().unwrap().clone();

    Ok(BenchReport {
        driver: d.driver,
        vendor_version: d.vendor_version,
        run_id,
        concurrency: ctx.cfg.concurrency,
        limit: match ctx.cfg.limit {
            Limit::Ops(n) => serde_json::json!({ "ops": n }),
            Limit::Duration(d) => serde_json::json!({ "duration_secs": d.as_secs_f64() }),
        },
        scenarios: reports,
        skipped,
        notes,
        cleanup,
        interrupted: ctx.stopped(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_unique_and_prefixed() {
        let a = new_run_id();
        let b = new_run_id();
        assert!(a.starts_with("crust-bench-") && a.len() == "crust-bench-".len() + 8);
        assert_ne!(a, b);
    }

    /// A context whose plugin is never called (a lazy channel to nowhere).
    fn idle_ctx(stop: watch::Receiver<bool>) -> Ctx {
        let ch = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        Ctx {
            csi: Csi::from_channel(ch, Duration::from_secs(1)),
            cfg: BenchConfig::new(),
            run_id: "r".into(),
            staging_root: PathBuf::new(),
            target_root: PathBuf::new(),
            stage: true,
            controller_publish: false,
            node_id: String::new(),
            topology: None,
            ledger: Mutex::new(Ledger::default()),
            cleaned: Mutex::new(CleanupReport::default()),
            stop,
            seq: AtomicU64::new(0),
        }
    }

    #[tokio::test]
    async fn ledger_undo_order() {
        let (_tx, rx) = watch::channel(false);
        let ctx = idle_ctx(rx);
        let root = ctx.track(Item::Dir {
            path: "/x".into(),
            child: None,
            root: true,
        });
        let vol = ctx.track(Item::Volume {
            name: "v".into(),
            id: Some("v".into()),
        });
        let dir = ctx.track(Item::Dir {
            path: "/x/y".into(),
            child: None,
            root: false,
        });
        let staged = ctx.track(Item::Staged {
            volume: "v".into(),
            path: "/s".into(),
        });
        let published = ctx.track(Item::Published {
            volume: "v".into(),
            target: "/t".into(),
        });
        let order: Vec<u64> = ctx
            .pending(None, true)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(order, vec![published, staged, vol, dir, root]);
        let order: Vec<u64> = ctx
            .pending(Some(&[dir, staged]), false)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(order, vec![staged, dir]);
        // roots are kept for the end of the run
        assert!(ctx.pending(None, false).iter().all(|(k, _)| *k != root));
    }

    #[tokio::test]
    async fn claims_stop_at_ops() {
        let (tx, rx) = watch::channel(false);
        let ctx = idle_ctx(rx);
        let c = Claims::new(Limit::Ops(3));
        assert_eq!(
            (0..5).filter_map(|_| c.claim(&ctx)).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        let c = Claims::new(Limit::Ops(3));
        tx.send(true).unwrap();
        assert_eq!(c.claim(&ctx), None);
    }
}
