//! One run: the driver's capabilities read first, the configuration
//! checked, each scenario run in turn, then the final cleanup.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crust_proto::csi::v1 as csi;
use tokio::sync::watch;

use crate::ledger::{Ctx, Item, Ledger};
use crate::new_run_id;
use crate::recorder::{Recorder, status_text};
use crate::workers::{Claims, create_delete, join_all, stage_publish_cycle, stats};
use crate::{
    BenchConfig, BenchError, BenchReport, CleanupReport, Limit, Scenario, ScenarioReport, Skipped,
};
use crust_csi_client::Csi;

pub(crate) struct Discovered {
    pub(crate) driver: String,
    pub(crate) vendor_version: String,
    pub(crate) controller: HashSet<i32>,
    pub(crate) has_controller_service: bool,
    pub(crate) accessibility: bool,
    pub(crate) node: Option<HashSet<i32>>,
    pub(crate) node_id: String,
    pub(crate) topology: Option<csi::Topology>,
    pub(crate) notes: Vec<String>,
}

pub(crate) async fn discover(c: &Csi) -> Result<Discovered, BenchError> {
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
pub(crate) fn make_root(ledger: &mut Ledger, dir: &Path) -> Result<(), BenchError> {
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
pub(crate) fn check_config(cfg: &BenchConfig) -> Result<(), BenchError> {
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

/// Which scenarios the driver can serve, and why the others are skipped.
fn plan(scenarios: &[Scenario], d: &Discovered) -> (Vec<Scenario>, Vec<Skipped>) {
    use csi::controller_service_capability::rpc::Type as CT;
    use csi::node_service_capability::rpc::Type as NT;

    let mut skipped = Vec::new();
    let can_create =
        d.has_controller_service && d.controller.contains(&(CT::CreateDeleteVolume as i32));
    let has_node = |t: NT| d.node.as_ref().is_some_and(|n| n.contains(&(t as i32)));
    let mut run = Vec::new();
    for &s in scenarios {
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
    (run, skipped)
}

/// Makes the staging and target roots; on a failure removes the ones it
/// made before returning the error.
fn make_roots(
    ledger: &mut Ledger,
    staging_root: &Path,
    target_root: &Path,
) -> Result<(), BenchError> {
    if let Err(e) = make_root(ledger, staging_root).and_then(|()| make_root(ledger, target_root)) {
        for item in ledger.items.values().rev() {
            if let Item::Dir { path, .. } = item {
                let _ = std::fs::remove_dir(path);
            }
        }
        return Err(e);
    }
    Ok(())
}

/// One scenario with its workers, then whatever it still holds undone.
async fn run_scenario(ctx: &Arc<Ctx>, s: Scenario) -> ScenarioReport {
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
    rec.report(s, elapsed)
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
    let (run, skipped) = plan(&cfg.scenarios, &d);
    let has_node = |t: NT| d.node.as_ref().is_some_and(|n| n.contains(&(t as i32)));
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
    if node_scenarios {
        make_roots(&mut ledger, &staging_root, &target_root)?;
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
        reports.push(run_scenario(&ctx, s).await);
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
