//! The scenarios' workers: create/delete, stage/publish cycles, and
//! stats (or volume health) over published volumes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crust_proto::csi::v1 as csi;

use crate::ledger::{Ctx, Mount, Vol};
use crate::recorder::{Recorder, status_text};
use crate::{Limit, Scenario};

/// Hands out operation numbers until the limit or a stop.
pub(crate) struct Claims {
    pub(crate) limit: Limit,
    pub(crate) next: AtomicU64,
    pub(crate) deadline: Option<Instant>,
}

impl Claims {
    pub(crate) fn new(limit: Limit) -> Claims {
        Claims {
            limit,
            next: AtomicU64::new(0),
            deadline: match limit {
                Limit::Duration(d) => Some(Instant::now() + d),
                Limit::Ops(_) => None,
            },
        }
    }

    pub(crate) fn claim(&self, ctx: &Ctx) -> Option<u64> {
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

pub(crate) async fn create_delete(ctx: Arc<Ctx>, claims: Arc<Claims>, rec: Arc<Recorder>) {
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
pub(crate) async fn setup_volume(ctx: &Ctx, rec: &Recorder, tag: &str) -> Option<(Vol, Vec<u64>)> {
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

pub(crate) async fn stage_publish_cycle(ctx: Arc<Ctx>, claims: Arc<Claims>, rec: Arc<Recorder>) {
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
pub(crate) async fn stats_worker(
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
pub(crate) async fn stats(ctx: Arc<Ctx>, rec: Arc<Recorder>, scenario: Scenario) -> Duration {
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

pub(crate) async fn join_all(set: &mut tokio::task::JoinSet<()>, rec: &Recorder) {
    while let Some(r) = set.join_next().await {
        if let Err(e) = r {
            rec.failed_ops.fetch_add(1, Ordering::Relaxed);
            rec.sample(format!("worker failed: {e}"));
        }
    }
}
