//! What the pod and kubelet see while the volume is in use: `df` where
//! the workload runs, NodeGetVolumeStats and the volume's health.

use std::time::Instant;

use crust_proto::csi::v1 as csi;
use tonic::Status;

use super::config::MOUNT_DESTINATION;
use super::report::{DfView, Figures, FlowError, HealthView, Observation, StatsView};
use super::{Flow, guarded, status_text};
use crate::runtime_cli::parse_df;
use crust_report::units::human_size;

impl Flow {
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

    pub(super) async fn observe(&mut self, after: bool) -> Result<(), FlowError> {
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
    pub(super) async fn observe_health(&mut self, after: bool) -> Result<(), FlowError> {
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

    pub(super) fn observation(&mut self, after: bool) -> &mut Observation {
        if after {
            &mut self.report.after_expand
        } else {
            &mut self.report.before_expand
        }
    }
}
