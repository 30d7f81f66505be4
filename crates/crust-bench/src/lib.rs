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
mod ledger;
mod recorder;
mod run;
pub mod scale;
mod workers;

pub use run::run_bench;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use crust_proto::csi::v1 as csi;
use serde::Serialize;
use tonic::Status;

use crust_report::units::human_duration;
use crust_report::{Render, table};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{Ctx, Item, Ledger};
    use crate::workers::Claims;
    use crust_csi_client::Csi;
    use std::sync::Mutex;
    use std::sync::atomic::AtomicU64;
    use tokio::sync::watch;

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
