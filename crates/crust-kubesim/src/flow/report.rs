//! What a flow reports: each step as it completes, the views of the
//! volume before and after expansion, and the whole flow's report.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use crust_proto::csi::v1 as csi;
use serde::Serialize;
use serde_json::Value;

use super::config::DeferVia;
use crust_report::Render;
use crust_report::units::{human_duration, human_size};

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
    pub(super) fn from_proto(r: &csi::NodeGetVolumeStatsResponse) -> StatsView {
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

    pub(super) fn text(&self) -> String {
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
    pub(super) fn from_proto(h: &csi::VolumeHealth) -> HealthView {
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
