//! `crustctl bench --deferred`: latency of the deferred paths.
//!
//! One volume is set up with [`crate::flow`] (create, stage, deferred
//! publish, a sandbox holding it), then two scenarios run against it:
//!
//! - `deferred-stats`: NodeGetVolumeStats with `defer_fs_ops` from
//!   `concurrency` workers (plugin -> runtime CLI -> guest agent);
//! - `deferred-expand`: ControllerExpandVolume then NodeExpandVolume with
//!   `defer_fs_ops`, growing by `expand_step` each time. Expansions of
//!   one volume are serial by nature, so this one runs one worker.
//!
//! The flow's teardown removes everything afterwards; its steps feed the
//! report's cleanup counts. The report is a [`BenchReport`], printed in
//! the same table as the standard scenarios.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crust_proto::csi::v1 as csi;
use tokio::sync::watch;
use tonic::Code;

use crate::recorder::{Recorder, status_text};
use crate::{BenchError, BenchReport, CleanupReport, Limit, Scenario, ScenarioReport};
use crust_csi_client::Csi;
use crust_kubesim::flow::{DeferVia, Flow, FlowConfig, Progress};
use crust_report::units::human_duration;

#[derive(Debug, Clone)]
pub struct DeferredConfig {
    /// The pod: volume size, fs type, fsGroup, runtime, work dir. Its
    /// `expand_to` is ignored (the expand scenario grows the volume).
    pub flow: FlowConfig,
    pub concurrency: usize,
    /// Per scenario.
    pub limit: Limit,
    /// Bytes added by each expansion.
    pub expand_step: u64,
    /// Wait of each worker after each stats or health call: calls then
    /// reach an idle guest, as kubelet's once-a-minute polls do (zero:
    /// back to back).
    pub pause: Duration,
}

/// Hands out operation numbers until the limit (or Ctrl-C).
struct Budget {
    next: AtomicU64,
    limit: Limit,
    start: Instant,
    stop: watch::Receiver<bool>,
}

impl Budget {
    fn new(limit: Limit, stop: watch::Receiver<bool>) -> Budget {
        Budget {
            next: AtomicU64::new(0),
            limit,
            start: Instant::now(),
            stop,
        }
    }

    fn claim(&self) -> bool {
        if *self.stop.borrow() {
            return false;
        }
        match self.limit {
            Limit::Duration(d) => self.start.elapsed() < d,
            Limit::Ops(n) => self.next.fetch_add(1, Ordering::Relaxed) < n,
        }
    }
}

/// Sets up, measures, tears down. `Err` only when the run could not
/// start (bad config, set-up failure — already torn down).
pub async fn run_deferred(
    csi: &Csi,
    mut cfg: DeferredConfig,
    progress: Progress,
    stop: watch::Receiver<bool>,
) -> Result<BenchReport, BenchError> {
    if cfg.concurrency == 0 {
        return Err(BenchError::Config("concurrency must be at least 1".into()));
    }
    if matches!(cfg.limit, Limit::Ops(0)) {
        return Err(BenchError::Config("ops must be at least 1".into()));
    }
    if cfg.expand_step == 0 {
        return Err(BenchError::Config("--expand-step must be positive".into()));
    }
    if cfg.flow.defer_via == DeferVia::None {
        return Err(BenchError::Config(
            "deferred mode needs deferral (request or storage-class)".into(),
        ));
    }
    let info = csi
        .get_plugin_info(Default::default())
        .await
        .map_err(|status| BenchError::Discovery {
            rpc: "GetPluginInfo",
            status,
        })?;
    cfg.flow.expand_to = None;
    // The pod's names double as the run id (volume and sandbox use it).
    let run_id = cfg.flow.sandbox_id.clone();
    let mut flow = Flow::new(cfg.flow.clone(), csi.clone(), progress).with_stop(stop.clone());
    let mut notes = Vec::new();
    if let Err(e) = flow.bring_up().await {
        flow.tear_down().await;
        return Err(BenchError::Setup(e.to_string()));
    }
    let setup: Vec<String> = flow
        .report()
        .steps
        .iter()
        .map(|s| {
            format!(
                "{} {}",
                s.step,
                human_duration(Duration::from_secs_f64(s.duration_ms / 1000.0))
            )
        })
        .collect();
    notes.push(format!(
        "set-up (not timed in the table): {}",
        setup.join(", ")
    ));
    notes.push(format!(
        "volume {} held by sandbox {} (QEMU pid {})",
        flow.volume_id().unwrap_or("?"),
        cfg.flow.sandbox_id,
        flow.report()
            .qemu_pid
            .map(|p| p.to_string())
            .unwrap_or_else(|| "?".into())
    ));

    let (scenarios, more) = measure(csi, &flow, &cfg, &stop).await;
    notes.extend(more);

    // --- teardown ------------------------------------------------------------
    let before = flow.report().steps.len();
    flow.tear_down().await;
    let mut cleanup = CleanupReport::default();
    for s in &flow.report().steps[before..] {
        if !s.ok {
            cleanup.leftovers.push(format!("{}: {}", s.step, s.detail));
            continue;
        }
        match s.step.as_str() {
            "NodeUnpublishVolume" => cleanup.node_unpublished += 1,
            "NodeUnstageVolume" => cleanup.node_unstaged += 1,
            "DeleteVolume" => cleanup.volumes_deleted += 1,
            _ => {}
        }
    }
    notes.extend(flow.report().notes.iter().cloned());
    Ok(BenchReport {
        driver: info.name,
        vendor_version: info.vendor_version,
        run_id,
        concurrency: cfg.concurrency,
        limit: match cfg.limit {
            Limit::Ops(n) => serde_json::json!({ "ops": n }),
            Limit::Duration(d) => serde_json::json!({ "duration_secs": d.as_secs_f64() }),
        },
        scenarios,
        skipped: Vec::new(),
        notes,
        cleanup,
        interrupted: *stop.borrow(),
    })
}

/// Runs both deferred scenarios against the pod `flow` brought up (its
/// sandbox must be running). Returns the scenario reports and notes.
pub async fn measure(
    csi: &Csi,
    flow: &Flow,
    cfg: &DeferredConfig,
    stop: &watch::Receiver<bool>,
) -> (Vec<ScenarioReport>, Vec<String>) {
    let mut scenarios = Vec::new();
    let mut notes = Vec::new();
    let defer = flow.config().defer_via == DeferVia::Request;
    let stats_req = csi::NodeGetVolumeStatsRequest {
        volume_id: flow.volume_id().unwrap_or_default().to_string(),
        volume_path: flow.target_path().to_string(),
        staging_target_path: flow.staging_path().unwrap_or_default().to_string(),
        defer_fs_ops: defer,
    };
    let qemu = flow.report().qemu_pid;
    if !cfg.pause.is_zero() {
        notes.push(format!(
            "stats and health calls paced: each worker waited {} after each call",
            human_duration(cfg.pause)
        ));
    }
    if !*stop.borrow() {
        let cpu = GuestCpu::start(qemu);
        let r = deferred_stats(csi, &stats_req, cfg, stop).await;
        notes.extend(GuestCpu::note(cpu, &r, !cfg.pause.is_zero()));
        scenarios.push(r);
    }
    if !*stop.borrow() {
        let cpu = GuestCpu::start(qemu);
        let r = deferred_health(csi, &stats_req, cfg, stop).await;
        notes.extend(GuestCpu::note(cpu, &r, !cfg.pause.is_zero()));
        scenarios.push(r);
    }
    if !*stop.borrow() {
        scenarios.push(deferred_expand(csi, flow, &stats_req, cfg, stop, &mut notes).await);
    }

    (scenarios, notes)
}

/// CPU the pod's QEMU (guest, devices, I/O threads) spends during a
/// scenario: what each deferred call costs the node beyond the plugin, and
/// steadier than latency on a shared host. Counted per thread and only for
/// threads alive at both ends (QEMU's short-lived I/O workers are missed:
/// a slight undercount, never a failure).
struct GuestCpu {
    pid: i32,
    at_start: HashMap<String, u64>,
}

impl GuestCpu {
    fn start(pid: Option<i32>) -> Option<GuestCpu> {
        let pid = pid?;
        Some(GuestCpu {
            pid,
            at_start: thread_cpu_ns(pid)?,
        })
    }

    fn note(this: Option<Self>, r: &ScenarioReport, paced: bool) -> Option<String> {
        let this = this?;
        let now = thread_cpu_ns(this.pid)?;
        let ns: u64 = now
            .iter()
            .filter_map(|(t, end)| Some(end.saturating_sub(*this.at_start.get(t)?)))
            .sum();
        let used = Duration::from_nanos(ns);
        let calls: u64 = r.rpcs.iter().map(|x| x.count + x.errors).sum();
        (calls > 0).then(|| {
            format!(
                "{}: the guest's QEMU used {} of CPU per call ({} calls, {} in all{})",
                r.scenario.name(),
                human_duration(used.div_f64(calls as f64)),
                calls,
                human_duration(used),
                if paced {
                    "; paced, so this includes the idle guest between calls"
                } else {
                    ""
                }
            )
        })
    }
}

/// On-CPU nanoseconds of each thread of `pid` (schedstat: not ticks);
/// threads that end while being read are left out. None when the process
/// is gone or not ours to read.
fn thread_cpu_ns(pid: i32) -> Option<HashMap<String, u64>> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    Some(
        tasks
            .flatten()
            .filter_map(|t| {
                let s = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
                let ns = s.split_whitespace().next()?.parse().ok()?;
                Some((t.file_name().to_string_lossy().into_owned(), ns))
            })
            .collect(),
    )
}

/// deferred-stats: NodeGetVolumeStats of the pod's volume, answered by the
/// guest; an abnormal condition counts as a failed call.
async fn deferred_stats(
    csi: &Csi,
    stats_req: &csi::NodeGetVolumeStatsRequest,
    cfg: &DeferredConfig,
    stop: &watch::Receiver<bool>,
) -> ScenarioReport {
    let call = |c: Csi, req: csi::NodeGetVolumeStatsRequest| async move {
        let r = c.node_get_volume_stats(req).await?;
        Ok(r.volume_condition
            .filter(|c| c.abnormal)
            .map(|c| format!("volume reported abnormal: {}", c.message)))
    };
    let (rec, elapsed) = repeat(
        csi,
        "NodeGetVolumeStats",
        stats_req.clone(),
        call,
        cfg,
        stop,
    )
    .await;
    rec.report(Scenario::DeferredStats, elapsed)
}

/// deferred-health: NodeGetVolumeHealth of the pod's volume; an adverse
/// condition counts as a failed call.
async fn deferred_health(
    csi: &Csi,
    stats_req: &csi::NodeGetVolumeStatsRequest,
    cfg: &DeferredConfig,
    stop: &watch::Receiver<bool>,
) -> ScenarioReport {
    let health_req = csi::NodeGetVolumeHealthRequest {
        volume_id: stats_req.volume_id.clone(),
        volume_publish_path: stats_req.volume_path.clone(),
        staging_target_path: stats_req.staging_target_path.clone(),
    };
    let call = |c: Csi, req: csi::NodeGetVolumeHealthRequest| async move {
        let r = c.node_get_volume_health(req).await?;
        Ok(r.volume_health
            .map(|h| h.health_statuses)
            .filter(|s| !s.is_empty())
            .map(|s| format!("adverse condition: {s:?}")))
    };
    let (rec, elapsed) = repeat(csi, "NodeGetVolumeHealth", health_req, call, cfg, stop).await;
    rec.report(Scenario::DeferredHealth, elapsed)
}

/// One request, repeated by `cfg.concurrency` workers until the budget is
/// spent. `call` answers Ok(Some(why)) for a reply that must count as a
/// failure (an abnormal volume), Ok(None) for a good one.
async fn repeat<Req, F, Fut>(
    csi: &Csi,
    rpc: &'static str,
    req: Req,
    call: F,
    cfg: &DeferredConfig,
    stop: &watch::Receiver<bool>,
) -> (Arc<Recorder>, std::time::Duration)
where
    Req: Clone + Send + 'static,
    F: Fn(Csi, Req) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<Option<String>, tonic::Status>> + Send,
{
    let rec = Arc::new(Recorder::default());
    let budget = Arc::new(Budget::new(cfg.limit, stop.clone()));
    let pause = cfg.pause;
    let t0 = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..cfg.concurrency {
        let (c, rec, budget, req, call) = (
            csi.clone(),
            rec.clone(),
            budget.clone(),
            req.clone(),
            call.clone(),
        );
        set.spawn(async move {
            let mut first = true;
            loop {
                // The pause follows a call; the budget (deadline, Ctrl-C)
                // is asked after it, so no call starts late.
                if !std::mem::take(&mut first) && !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
                if !budget.claim() {
                    break;
                }
                match rec.timed(rpc, call(c.clone(), req.clone())).await {
                    Ok(None) => {
                        rec.ops.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Some(why)) => {
                        rec.failed_ops.fetch_add(1, Ordering::Relaxed);
                        rec.sample(format!("{rpc}: {why}"));
                    }
                    Err(_) => {
                        rec.failed_ops.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
    }
    while let Some(r) = set.join_next().await {
        if let Err(e) = r {
            rec.sample(format!("worker failed: {e}"));
        }
    }
    (rec, t0.elapsed())
}

/// deferred-expand: ControllerExpandVolume then NodeExpandVolume in steps,
/// one worker (expansions of one volume are serial).
async fn deferred_expand(
    csi: &Csi,
    flow: &Flow,
    target: &csi::NodeGetVolumeStatsRequest,
    cfg: &DeferredConfig,
    stop: &watch::Receiver<bool>,
    notes: &mut Vec<String>,
) -> ScenarioReport {
    let defer = target.defer_fs_ops;
    if cfg.concurrency > 1 {
        notes.push("deferred-expand runs one worker: expansions of a volume are serial".into());
    }
    let rec = Recorder::default();
    let budget = Budget::new(cfg.limit, stop.clone());
    let mut size = flow
        .report()
        .volume
        .as_ref()
        .map(|v| v.capacity_bytes.max(0) as u64)
        .unwrap_or(flow.config().size);
    let cap = flow.capability(false);
    let mut consecutive_errors = 0;
    let t0 = Instant::now();
    while budget.claim() {
        let want = size + cfg.expand_step;
        let range = Some(csi::CapacityRange {
            required_bytes: want as i64,
            limit_bytes: 0,
        });
        let r = rec
            .timed(
                "ControllerExpandVolume",
                csi.controller_expand_volume(csi::ControllerExpandVolumeRequest {
                    volume_id: target.volume_id.clone(),
                    capacity_range: range,
                    secrets: HashMap::new(),
                    volume_capability: Some(flow.capability(false)),
                }),
            )
            .await;
        let needs_node = match r {
            Ok(resp) => resp.node_expansion_required,
            Err(s) => {
                rec.failed_ops.fetch_add(1, Ordering::Relaxed);
                if matches!(s.code(), Code::OutOfRange | Code::ResourceExhausted) {
                    rec.sample(format!("stopped growing: {}", status_text(&s)));
                    break;
                }
                consecutive_errors += 1;
                if consecutive_errors >= 3 {
                    break;
                }
                continue;
            }
        };
        if needs_node {
            let r = rec
                .timed(
                    "NodeExpandVolume",
                    csi.node_expand_volume(csi::NodeExpandVolumeRequest {
                        volume_id: target.volume_id.clone(),
                        volume_path: target.volume_path.clone(),
                        capacity_range: range,
                        staging_target_path: target.staging_target_path.clone(),
                        volume_capability: Some(cap.clone()),
                        secrets: HashMap::new(),
                        defer_fs_ops: defer,
                    }),
                )
                .await;
            if let Err(s) = r {
                rec.failed_ops.fetch_add(1, Ordering::Relaxed);
                consecutive_errors += 1;
                if consecutive_errors >= 3 || s.code() == Code::OutOfRange {
                    break;
                }
                continue;
            }
        }
        consecutive_errors = 0;
        size = want;
        rec.ops.fetch_add(1, Ordering::Relaxed);
    }
    let report = rec.report(Scenario::DeferredExpand, t0.elapsed());
    notes.push(format!(
        "deferred-expand grew the volume to {} bytes in steps of {}",
        size, cfg.expand_step
    ));
    report
}
