//! The report of `bench --guest-io`: every run, the per-workload summary
//! (median and range over the repetitions, block ÷ virtio-fs), the native
//! feature table, and its text and JSON renderings.

use std::fmt::Write as _;

use serde::Serialize;

use super::workload::{Measured, Sizes, Unit, Workload};
use crate::bench::CleanupReport;
use crate::fmt::{Render, table};

/// Which of the two mounts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Side {
    Block,
    Virtiofs,
}

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Side::Block => "block",
            Side::Virtiofs => "virtio-fs",
        }
    }
}

/// One run of one workload on one mount.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub repetition: u32,
    pub side: Side,
    #[serde(flatten)]
    pub measured: Measured,
    /// CPU seconds of QEMU + virtiofsd during the run.
    pub host_cpu_s: f64,
}

/// Median and range of one workload on one mount.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SideSummary {
    pub runs: usize,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    /// Host CPU seconds (QEMU + virtiofsd) per GiB moved (fio workloads).
    pub cpu_s_per_gib: Option<f64>,
    /// Host CPU seconds of a run (median).
    pub host_cpu_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkloadResult {
    pub workload: String,
    #[serde(flatten)]
    pub spec: Workload,
    pub unit: Unit,
    /// What p50/p99 measure.
    pub latency_of: &'static str,
    pub block: SideSummary,
    pub virtiofs: SideSummary,
    /// Median block ÷ median virtio-fs of the result (higher: block faster).
    pub ratio: Option<f64>,
    /// Host CPU per GiB, block ÷ virtio-fs (lower: block cheaper).
    pub cpu_ratio: Option<f64>,
    pub runs: Vec<Run>,
}

/// One native feature on both mounts.
#[derive(Debug, Clone, Serialize)]
pub struct FeatureRow {
    pub feature: String,
    pub checks: String,
    pub block: Outcome,
    pub virtiofs: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Outcome {
    pub works: bool,
    /// What was seen (works) or the error (fails).
    pub detail: String,
}

impl Outcome {
    pub fn text(&self) -> String {
        if self.works {
            "works".into()
        } else {
            format!("fails: {}", self.detail)
        }
    }
}

/// One of the two volumes.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MountReport {
    pub destination: String,
    pub volume_id: String,
    pub capacity_bytes: i64,
    pub fs_type: String,
    /// How it reaches the guest.
    pub path: String,
    /// The mount's source and type in the guest's /proc/mounts (a
    /// `/dev/vd*` disk, or the virtio-fs tag and `virtiofs`).
    pub guest_source: String,
    pub guest_fs_type: String,
    /// The volume's publish target on the host.
    pub host_target: String,
    /// Whether the host saw the bench's files under `host_target` after
    /// the guest laid them out (virtio-fs: yes; block: nothing is mounted
    /// on the host).
    pub host_sees_bench_files: bool,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct GuestIoReport {
    pub driver: String,
    pub vendor_version: String,
    pub run_id: String,
    pub accel: Option<String>,
    pub accel_reason: Option<String>,
    pub guest_memory_mib: u32,
    pub guest_cpus: u32,
    pub guest_initrd: Option<String>,
    pub block: MountReport,
    pub virtiofs: MountReport,
    /// The virtiofsd settings (crust_vmm::VIRTIOFSD_ARGS, the shim's).
    pub virtiofsd_args: Vec<String>,
    pub repeat: u32,
    pub queue_depths: Vec<u32>,
    pub sizes: Option<Sizes>,
    pub host_caches_dropped: bool,
    pub workloads: Vec<WorkloadResult>,
    pub features: Vec<FeatureRow>,
    pub notes: Vec<String>,
    /// Runs or probes that failed (a report with errors is a failed run).
    pub errors: Vec<String>,
    pub cleanup: CleanupReport,
    pub interrupted: bool,
    pub elapsed_secs: f64,
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn median_opt(v: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let mut xs: Vec<f64> = v.flatten().collect();
    (!xs.is_empty()).then(|| median(&mut xs))
}

const GIB: f64 = (1u64 << 30) as f64;

/// Summary of the runs of one side.
pub fn summarize(runs: &[&Run], fio: bool) -> SideSummary {
    if runs.is_empty() {
        return SideSummary::default();
    }
    let mut vals: Vec<f64> = runs.iter().map(|r| r.measured.value).collect();
    let min = vals.iter().copied().fold(f64::INFINITY, f64::min);
    let max = vals.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut cpu: Vec<f64> = runs.iter().map(|r| r.host_cpu_s).collect();
    SideSummary {
        runs: runs.len(),
        median: median(&mut vals),
        min,
        max,
        p50_us: median_opt(runs.iter().map(|r| r.measured.p50_us)),
        p99_us: median_opt(runs.iter().map(|r| r.measured.p99_us)),
        cpu_s_per_gib: if fio {
            median_opt(runs.iter().map(|r| {
                (r.measured.bytes > 0).then(|| r.host_cpu_s / (r.measured.bytes as f64 / GIB))
            }))
        } else {
            None
        },
        host_cpu_s: median(&mut cpu),
    }
}

impl WorkloadResult {
    pub fn new(w: Workload, runs: Vec<Run>) -> WorkloadResult {
        let of = |s: Side| runs.iter().filter(|r| r.side == s).collect::<Vec<_>>();
        let block = summarize(&of(Side::Block), w.is_fio());
        let virtiofs = summarize(&of(Side::Virtiofs), w.is_fio());
        let ratio = (block.runs > 0 && virtiofs.runs > 0 && virtiofs.median > 0.0)
            .then(|| block.median / virtiofs.median);
        let cpu_ratio = match (block.cpu_s_per_gib, virtiofs.cpu_s_per_gib) {
            (Some(b), Some(v)) if v > 0.0 => Some(b / v),
            _ => None,
        };
        WorkloadResult {
            workload: w.name(),
            spec: w,
            unit: w.unit(),
            latency_of: w.latency_of(),
            block,
            virtiofs,
            ratio,
            cpu_ratio,
            runs,
        }
    }
}

fn us(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(u) if u >= 1000.0 => format!("{:.2}ms", u / 1000.0),
        Some(u) => format!("{u:.0}µs"),
    }
}

fn ratio(v: Option<f64>) -> String {
    v.map(|r| format!("{r:.2}×")).unwrap_or_else(|| "-".into())
}

impl Render for GuestIoReport {
    fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("report serializes")
    }

    fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "guest I/O: driver {} {}, run {}, {} ({})",
            self.driver,
            self.vendor_version,
            self.run_id,
            self.accel.as_deref().unwrap_or("?"),
            self.accel_reason.as_deref().unwrap_or("?"),
        );
        if self.accel.as_deref() == Some("tcg") {
            out.push_str(
                "note: TCG (emulated CPU): absolute numbers are not KVM numbers; read the block ÷ virtio-fs ratios\n",
            );
        }
        let _ = writeln!(
            out,
            "one guest: {} MiB, {} vCPU(s), image {}",
            self.guest_memory_mib,
            self.guest_cpus,
            self.guest_initrd.as_deref().unwrap_or("(runtime default)")
        );
        for (side, m) in [("block", &self.block), ("virtio-fs", &self.virtiofs)] {
            let _ = writeln!(
                out,
                "  {side:<9} {:<15} {} {} volume {}: {}",
                m.destination,
                crate::parse::human_size(m.capacity_bytes),
                m.fs_type,
                m.volume_id,
                m.path
            );
        }
        if let Some(s) = &self.sizes {
            let _ = writeln!(
                out,
                "{} repetition(s), interleaved block/virtio-fs; queue depths {:?}; random file {}, sequential file {}, {:.0?} per random run; {} files; tree of {} entries; caches dropped before cold runs: guest{}",
                self.repeat,
                self.queue_depths,
                crate::parse::human_size(s.rand_file as i64),
                crate::parse::human_size(s.seq_file as i64),
                s.runtime,
                s.meta_files,
                s.walk_entries,
                if self.host_caches_dropped {
                    " and host"
                } else {
                    " only"
                },
            );
        }
        out.push('\n');
        let mut rows = Vec::new();
        for w in &self.workloads {
            for (i, (side, s)) in [(Side::Block, &w.block), (Side::Virtiofs, &w.virtiofs)]
                .into_iter()
                .enumerate()
            {
                let result = if s.runs == 0 {
                    "no run".to_string()
                } else if s.runs == 1 {
                    w.unit.format(s.median)
                } else {
                    format!(
                        "{} ({}–{})",
                        w.unit.format(s.median),
                        w.unit.format(s.min).split(' ').next().unwrap_or(""),
                        w.unit.format(s.max).split(' ').next().unwrap_or("")
                    )
                };
                let cpu = match s.cpu_s_per_gib {
                    Some(c) => format!("{c:.1} s/GiB"),
                    None if s.runs > 0 => format!("{:.2} s", s.host_cpu_s),
                    None => "-".into(),
                };
                rows.push(vec![
                    if i == 0 {
                        w.workload.clone()
                    } else {
                        String::new()
                    },
                    side.name().into(),
                    result,
                    us(s.p50_us),
                    us(s.p99_us),
                    cpu,
                    if i == 0 {
                        ratio(w.ratio)
                    } else {
                        String::new()
                    },
                    if i == 0 {
                        ratio(w.cpu_ratio)
                    } else {
                        String::new()
                    },
                ]);
            }
        }
        out.push_str(&table(
            &[
                "WORKLOAD",
                "MOUNT",
                "RESULT (median, range)",
                "P50",
                "P99",
                "HOST CPU",
                "BLOCK÷VFS",
                "CPU B÷V",
            ],
            &rows,
        ));
        out.push_str(
            "P50/P99: fsync latency for randwrite-fsync, completion latency for fio reads/writes, one file's create+write+fsync+stat for meta. HOST CPU: QEMU + virtiofsd per GiB moved (total seconds for meta/walk).\n\n",
        );
        if !self.features.is_empty() {
            let rows: Vec<Vec<String>> = self
                .features
                .iter()
                .map(|f| vec![f.feature.clone(), f.block.text(), f.virtiofs.text()])
                .collect();
            out.push_str(&table(&["FEATURE", "BLOCK", "VIRTIO-FS"], &rows));
            out.push('\n');
        }
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        for e in &self.errors {
            let _ = writeln!(out, "error: {e}");
        }
        let c = &self.cleanup;
        let _ = writeln!(
            out,
            "cleanup: {} volumes deleted, {} node-unpublished, {} unstaged, {} left over; {:.0} s in all",
            c.volumes_deleted,
            c.node_unpublished,
            c.node_unstaged,
            c.leftovers.len(),
            self.elapsed_secs
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::guest_io::workload::Kind;

    fn run(rep: u32, side: Side, value: f64, bytes: u64, cpu: f64) -> Run {
        Run {
            repetition: rep,
            side,
            measured: Measured {
                value,
                bytes,
                p50_us: Some(value / 10.0),
                p99_us: Some(value),
                seconds: 1.0,
            },
            host_cpu_s: cpu,
        }
    }

    #[test]
    fn medians_ranges_and_ratios() {
        let w = Workload {
            kind: Kind::RandWriteFsync,
            queue_depth: 1,
        };
        let gib = 1u64 << 30;
        let r = WorkloadResult::new(
            w,
            vec![
                run(0, Side::Block, 900.0, gib, 2.0),
                run(0, Side::Virtiofs, 300.0, gib, 4.0),
                run(1, Side::Block, 1000.0, gib, 2.0),
                run(1, Side::Virtiofs, 500.0, gib, 8.0),
                run(2, Side::Block, 1100.0, gib / 2, 2.0),
                run(2, Side::Virtiofs, 400.0, gib, 6.0),
            ],
        );
        assert_eq!(
            (r.block.median, r.block.min, r.block.max),
            (1000.0, 900.0, 1100.0)
        );
        assert_eq!(r.virtiofs.median, 400.0);
        assert_eq!(r.ratio, Some(2.5));
        assert_eq!(r.block.cpu_s_per_gib, Some(2.0));
        assert_eq!(r.virtiofs.cpu_s_per_gib, Some(6.0));
        assert_eq!(r.cpu_ratio, Some(2.0 / 6.0));
        assert_eq!(r.block.p99_us, Some(1000.0));
        // Even count: mean of the middle two.
        let r = WorkloadResult::new(
            w,
            vec![
                run(0, Side::Block, 1.0, 1, 0.0),
                run(1, Side::Block, 3.0, 1, 0.0),
            ],
        );
        assert_eq!(r.block.median, 2.0);
        assert_eq!(r.ratio, None, "no virtio-fs run: no ratio");
    }

    #[test]
    fn text_has_both_tables() {
        let w = Workload {
            kind: Kind::Meta,
            queue_depth: 1,
        };
        let rep = GuestIoReport {
            accel: Some("tcg".into()),
            workloads: vec![WorkloadResult::new(
                w,
                vec![
                    run(0, Side::Block, 500.0, 4096, 1.5),
                    run(0, Side::Virtiofs, 250.0, 4096, 1.0),
                ],
            )],
            features: vec![FeatureRow {
                feature: "posix_acl".into(),
                checks: String::new(),
                block: Outcome {
                    works: true,
                    detail: "ok".into(),
                },
                virtiofs: Outcome {
                    works: false,
                    detail: "Operation not supported".into(),
                },
            }],
            ..Default::default()
        };
        let t = rep.to_text();
        assert!(t.contains("not KVM numbers"), "{t}");
        assert!(t.contains("meta-create-fsync-stat-unlink  block"), "{t}");
        assert!(t.contains("500 files/s"), "{t}");
        assert!(t.contains("2.00×"), "{t}");
        assert!(t.contains("fails: Operation not supported"), "{t}");
        let j = rep.to_json();
        assert_eq!(j["workloads"][0]["ratio"], 2.0);
        assert_eq!(j["workloads"][0]["runs"][1]["side"], "virtiofs");
        assert_eq!(j["features"][0]["virtiofs"]["works"], false);
    }
}
