//! The report of `bench --guest-io`: every run, the per-workload summary
//! (median and range over the repetitions; block ÷ virtio-fs, block ÷ host
//! fio, qemu-img ÷ host fio, qemu-img ÷ fio on the loop device, fio on
//! the loop device ÷ host fio), the native
//! feature table, and its text and JSON renderings.

use std::fmt::Write as _;

use serde::Serialize;

use super::workload::{Measured, Sizes, Unit, Workload};
use crate::CleanupReport;
use crust_report::{Render, table};

/// Where a run ran: one of the guest's two mounts, or one of the host
/// columns ([`super::baseline`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Side {
    Block,
    Virtiofs,
    /// The same fio job on the host, O_DIRECT, beside the backing file.
    HostFio,
    /// The same fio job, O_DIRECT, on the scratch loop device there.
    LoopFio,
    /// `qemu-img bench` on what crust's QEMU opens for that device (its
    /// backing file, the loop driver skipped).
    QemuImg,
}

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Side::Block => "block",
            Side::Virtiofs => "virtio-fs",
            Side::HostFio => "host fio",
            Side::LoopFio => "loop fio",
            Side::QemuImg => "qemu-img",
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
    /// The host columns (fio workloads only; `runs` 0 otherwise).
    pub host_fio: SideSummary,
    pub qemu_img: SideSummary,
    /// fio on the scratch loop device.
    pub loop_fio: SideSummary,
    /// Median block ÷ median virtio-fs of the result (higher: block faster).
    pub ratio: Option<f64>,
    /// Guest block ÷ host fio: how close the guest gets to the disk.
    pub block_vs_host: Option<f64>,
    /// qemu-img bench ÷ host fio: what the block layer crust configures
    /// keeps.
    pub qemu_img_vs_host: Option<f64>,
    /// qemu-img bench ÷ fio on the loop device: crust's QEMU path against
    /// the kernel's loop driver.
    pub qemu_img_vs_loop: Option<f64>,
    /// fio on the loop device ÷ host fio: the loop driver alone.
    pub loop_vs_host: Option<f64>,
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

/// The host columns' set-up.
#[derive(Debug, Clone, Default, Serialize)]
pub struct HostReport {
    /// The block volume's backing file.
    pub backing_file: String,
    /// The scratch directory beside it (host fio's files, the scratch
    /// device's file; removed at the end).
    pub dir: String,
    /// The scratch loop device (loop fio's) and its size.
    pub scratch_device: String,
    /// What qemu-img benches: the scratch device's backing file when
    /// crust's runtime would have QEMU skip the loop driver, else the
    /// device.
    pub qemu_img_target: String,
    pub scratch_bytes: u64,
    pub scratch_direct_io: bool,
    /// Its I/O scheduler and `nr_requests` as the run found them (sysfs).
    pub scratch_scheduler: Option<String>,
    pub scratch_nr_requests: Option<u32>,
    /// qemu-img's `-i` (the best the host takes).
    pub qemu_img_aio: String,
    pub qemu_img_version: String,
}

/// Host CPU per GiB of the guest block path against qemu-img bench's for
/// the same I/O (medians over the fio workloads): the difference is what
/// the guest itself costs (under TCG: its emulated CPU).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CpuSplit {
    pub block_s_per_gib: f64,
    pub qemu_img_s_per_gib: f64,
    /// 1 − qemu-img ÷ block, within 0..=1.
    pub guest_share: f64,
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
    /// The settings the share's virtiofsd ran with (read from its
    /// command line: the sandbox's own).
    pub virtiofsd_args: Vec<String>,
    pub repeat: u32,
    pub queue_depths: Vec<u32>,
    pub sizes: Option<Sizes>,
    pub host_caches_dropped: bool,
    /// The block volume went through the host page cache (`--host-cache`).
    pub qemu_host_cache: bool,
    /// Where the host columns ran; `None` when they did not.
    pub host: Option<HostReport>,
    pub workloads: Vec<WorkloadResult>,
    pub features: Vec<FeatureRow>,
    /// From the workloads ([`CpuSplit::of`]).
    pub cpu_split: Option<CpuSplit>,
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

/// Median of `a` ÷ median of `b` when both ran.
fn quotient(a: &SideSummary, b: &SideSummary) -> Option<f64> {
    (a.runs > 0 && b.runs > 0 && b.median > 0.0).then(|| a.median / b.median)
}

impl CpuSplit {
    /// `None` without a fio workload measured by both the block path and
    /// qemu-img.
    pub fn of(workloads: &[WorkloadResult]) -> Option<CpuSplit> {
        let pairs: Vec<(f64, f64)> = workloads
            .iter()
            .filter_map(|w| Some((w.block.cpu_s_per_gib?, w.qemu_img.cpu_s_per_gib?)))
            .filter(|(b, _)| *b > 0.0)
            .collect();
        if pairs.is_empty() {
            return None;
        }
        let mut b: Vec<f64> = pairs.iter().map(|p| p.0).collect();
        let mut q: Vec<f64> = pairs.iter().map(|p| p.1).collect();
        let (b, q) = (median(&mut b), median(&mut q));
        Some(CpuSplit {
            block_s_per_gib: b,
            qemu_img_s_per_gib: q,
            guest_share: (1.0 - q / b).clamp(0.0, 1.0),
        })
    }

    /// The sentence of the text report.
    pub fn sentence(&self, accel: Option<&str>) -> String {
        let what = if accel == Some("tcg") {
            "the emulated guest: under TCG its kernel, ext4 and fio run as translated code on QEMU's threads"
        } else {
            "the guest's own kernel, filesystem and fio, and virtio"
        };
        format!(
            "host CPU per GiB (median of the fio workloads): guest block path {:.1} s, qemu-img bench {:.1} s through the same block layer without a guest; {:.0} % of the block path's host CPU is {what}, which is why guest ÷ host trails qemu-img ÷ host",
            self.block_s_per_gib,
            self.qemu_img_s_per_gib,
            self.guest_share * 100.0
        )
    }
}

impl WorkloadResult {
    pub fn new(w: Workload, runs: Vec<Run>) -> WorkloadResult {
        let of = |s: Side| runs.iter().filter(|r| r.side == s).collect::<Vec<_>>();
        let block = summarize(&of(Side::Block), w.is_fio());
        let virtiofs = summarize(&of(Side::Virtiofs), w.is_fio());
        let host_fio = summarize(&of(Side::HostFio), w.is_fio());
        let qemu_img = summarize(&of(Side::QemuImg), w.is_fio());
        let loop_fio = summarize(&of(Side::LoopFio), w.is_fio());
        let cpu_ratio = match (block.cpu_s_per_gib, virtiofs.cpu_s_per_gib) {
            (Some(b), Some(v)) if v > 0.0 => Some(b / v),
            _ => None,
        };
        WorkloadResult {
            workload: w.name(),
            spec: w,
            unit: w.unit(),
            latency_of: w.latency_of(),
            ratio: quotient(&block, &virtiofs),
            block_vs_host: quotient(&block, &host_fio),
            qemu_img_vs_host: quotient(&qemu_img, &host_fio),
            qemu_img_vs_loop: quotient(&qemu_img, &loop_fio),
            loop_vs_host: quotient(&loop_fio, &host_fio),
            block,
            virtiofs,
            host_fio,
            qemu_img,
            loop_fio,
            cpu_ratio,
            runs,
        }
    }
}

/// The result cell of one side.
fn result_cell(unit: Unit, s: &SideSummary) -> String {
    if s.runs == 0 {
        "no run".to_string()
    } else if s.runs == 1 {
        unit.format(s.median)
    } else {
        format!(
            "{} ({}–{})",
            unit.format(s.median),
            unit.format(s.min).split(' ').next().unwrap_or(""),
            unit.format(s.max).split(' ').next().unwrap_or("")
        )
    }
}

/// Rows of the workload table: the two mounts, then the host columns of
/// the fio workloads; the ratios on each workload's first row.
fn workload_rows(workloads: &[WorkloadResult]) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    for w in workloads {
        let mut sides = vec![(Side::Block, &w.block), (Side::Virtiofs, &w.virtiofs)];
        if w.host_fio.runs > 0 || w.loop_fio.runs > 0 || w.qemu_img.runs > 0 {
            sides.extend([
                (Side::HostFio, &w.host_fio),
                (Side::LoopFio, &w.loop_fio),
                (Side::QemuImg, &w.qemu_img),
            ]);
        }
        for (i, (side, s)) in sides.into_iter().enumerate() {
            let cpu = match s.cpu_s_per_gib {
                Some(c) => format!("{c:.1} s/GiB"),
                None if s.runs > 0 => format!("{:.2} s", s.host_cpu_s),
                None => "-".into(),
            };
            let first = |v: Option<f64>| if i == 0 { ratio(v) } else { String::new() };
            rows.push(vec![
                if i == 0 {
                    w.workload.clone()
                } else {
                    String::new()
                },
                side.name().into(),
                result_cell(w.unit, s),
                us(s.p50_us),
                us(s.p99_us),
                cpu,
                first(w.ratio),
                first(w.cpu_ratio),
                first(w.block_vs_host),
                first(w.qemu_img_vs_host),
                first(w.qemu_img_vs_loop),
                first(w.loop_vs_host),
            ]);
        }
    }
    rows
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

impl GuestIoReport {
    /// The run's shape: driver, accelerator, guest, mounts, host columns,
    /// sizes.
    fn header_text(&self, out: &mut String) {
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
                crust_report::units::human_size(m.capacity_bytes),
                m.fs_type,
                m.volume_id,
                m.path
            );
        }
        if let Some(h) = &self.host {
            let _ = writeln!(
                out,
                "  host      beside {}: fio O_DIRECT; fio O_DIRECT on {} ({}, direct I/O {}, scheduler {}, nr_requests {}); {} bench -t none -i {} on {}, what crust's QEMU opens for that device",
                h.backing_file,
                h.scratch_device,
                crust_report::units::human_size(h.scratch_bytes as i64),
                if h.scratch_direct_io { "on" } else { "off" },
                h.scratch_scheduler.as_deref().unwrap_or("?"),
                h.scratch_nr_requests
                    .map_or_else(|| "?".to_string(), |n| n.to_string()),
                h.qemu_img_version,
                h.qemu_img_aio,
                h.qemu_img_target,
            );
        }
        if let Some(s) = &self.sizes {
            let _ = writeln!(
                out,
                "{} repetition(s), interleaved block/virtio-fs; queue depths {:?}; random file {}, sequential file {}, {:.0?} per random run; {} files; tree of {} entries; caches dropped before cold runs: guest{}{}",
                self.repeat,
                self.queue_depths,
                crust_report::units::human_size(s.rand_file as i64),
                crust_report::units::human_size(s.seq_file as i64),
                s.runtime,
                s.meta_files,
                s.walk_entries,
                if self.host_caches_dropped {
                    " and host"
                } else {
                    " only"
                },
                if self.qemu_host_cache {
                    "; block volume through the host page cache (--host-cache: cache.direct=off aio=threads)"
                } else {
                    ""
                },
            );
        }
    }
}

impl Render for GuestIoReport {
    fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("report serializes")
    }

    fn to_text(&self) -> String {
        let mut out = String::new();
        self.header_text(&mut out);
        out.push('\n');
        out.push_str(&table(
            &[
                "WORKLOAD",
                "RUN ON",
                "RESULT (median, range)",
                "P50",
                "P99",
                "HOST CPU",
                "BLOCK÷VFS",
                "CPU B÷V",
                "BLOCK÷HOST",
                "QEMU÷HOST",
                "QEMU÷LOOP",
                "LOOP÷HOST",
            ],
            &workload_rows(&self.workloads),
        ));
        out.push_str(
            "P50/P99: fsync latency for randwrite-fsync, completion latency for fio reads/writes, one file's create+write+fsync+stat for meta. HOST CPU: QEMU + virtiofsd per GiB moved (total seconds for meta/walk); host fio's, loop fio's and qemu-img's own CPU per GiB. HOST: the same fio job on the host, O_DIRECT, beside the block volume's backing file; LOOP: that fio job, O_DIRECT, on the scratch direct-I/O loop device there (the loop driver alone); QEMU: qemu-img bench on what crust's QEMU opens for that device, its backing file (QEMU's block layer, the loop driver skipped; no random mode: a fixed stride).\n",
        );
        if let Some(c) = &self.cpu_split {
            let _ = writeln!(out, "{}", c.sentence(self.accel.as_deref()));
        }
        out.push('\n');
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
    use crate::guest_io::workload::Kind;

    fn run(rep: u32, side: Side, value: f64, bytes: u64, cpu: f64) -> Run {
        Run {
            repetition: rep,
            side,
            measured: Measured::new(value, bytes, Some(value / 10.0), Some(value), 1.0),
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

    /// The host columns: their medians, guest block ÷ host fio,
    /// qemu-img ÷ host fio and its two parts (qemu-img ÷ loop fio, loop
    /// fio ÷ host fio), CPU per GiB of each.
    #[test]
    fn host_column_ratios() {
        let w = Workload {
            kind: Kind::RandRead,
            queue_depth: 16,
        };
        let gib = 1u64 << 30;
        let r = WorkloadResult::new(
            w,
            vec![
                run(0, Side::Block, 3000.0, gib, 6.0),
                run(0, Side::Virtiofs, 1000.0, gib, 9.0),
                run(0, Side::HostFio, 12000.0, gib / 4, 0.25),
                run(0, Side::QemuImg, 10000.0, gib / 2, 0.5),
                run(1, Side::HostFio, 8000.0, gib / 4, 0.25),
                run(1, Side::QemuImg, 8000.0, gib / 2, 0.5),
                run(0, Side::LoopFio, 5000.0, gib / 8, 0.25),
                run(1, Side::LoopFio, 7000.0, gib / 8, 0.25),
            ],
        );
        assert_eq!((r.host_fio.runs, r.host_fio.median), (2, 10000.0));
        assert_eq!(r.qemu_img.median, 9000.0);
        assert_eq!(r.ratio, Some(3.0));
        assert_eq!(r.block_vs_host, Some(0.3));
        assert_eq!(r.qemu_img_vs_host, Some(0.9));
        assert_eq!((r.loop_fio.runs, r.loop_fio.median), (2, 6000.0));
        // 0.9 = 0.6 (the loop driver) × 1.5 (QEMU's block layer).
        assert_eq!(r.loop_vs_host, Some(0.6));
        assert_eq!(r.qemu_img_vs_loop, Some(1.5));
        assert_eq!(r.loop_fio.cpu_s_per_gib, Some(2.0));
        assert_eq!(r.host_fio.cpu_s_per_gib, Some(1.0));
        assert_eq!(r.qemu_img.cpu_s_per_gib, Some(1.0));
        // A workload without host columns has no such ratio.
        let m = WorkloadResult::new(w, vec![run(0, Side::Block, 1.0, gib, 1.0)]);
        assert_eq!((m.block_vs_host, m.qemu_img_vs_host), (None, None));
        assert_eq!((m.qemu_img_vs_loop, m.loop_vs_host), (None, None));

        // Block 6 s/GiB against qemu-img 1 s/GiB: 5/6 is the guest.
        let split = CpuSplit::of(&[r.clone(), m]).unwrap();
        assert_eq!(split.block_s_per_gib, 6.0);
        assert_eq!(split.qemu_img_s_per_gib, 1.0);
        assert!((split.guest_share - 5.0 / 6.0).abs() < 1e-12);
        let t = split.sentence(Some("tcg"));
        assert!(t.contains("83 %") && t.contains("emulated guest"), "{t}");
        assert!(!split.sentence(Some("kvm")).contains("emulated"));
        assert_eq!(CpuSplit::of(&[]), None);

        let rep = GuestIoReport {
            accel: Some("tcg".into()),
            cpu_split: Some(split),
            workloads: vec![r],
            ..Default::default()
        };
        let t = rep.to_text();
        for want in [
            "BLOCK÷HOST",
            "QEMU÷HOST",
            "QEMU÷LOOP",
            "LOOP÷HOST",
            "host fio",
            "loop fio",
            "qemu-img",
            "6000 IOPS (5000–7000)",
            "0.60×",
            "1.50×",
            "10000 IOPS (8000–12000)",
            "0.30×",
            "0.90×",
            "3.00×",
            "83 %",
        ] {
            assert!(t.contains(want), "{want} not in\n{t}");
        }
        let j = rep.to_json();
        assert_eq!(j["workloads"][0]["block_vs_host"], 0.3);
        assert_eq!(j["workloads"][0]["qemu_img_vs_host"], 0.9);
        assert_eq!(j["workloads"][0]["host_fio"]["median"], 10000.0);
        assert_eq!(j["workloads"][0]["runs"][2]["side"], "host-fio");
        assert_eq!(j["workloads"][0]["loop_vs_host"], 0.6);
        assert_eq!(j["workloads"][0]["qemu_img_vs_loop"], 1.5);
        assert_eq!(j["workloads"][0]["loop_fio"]["median"], 6000.0);
        assert_eq!(j["workloads"][0]["runs"][6]["side"], "loop-fio");
        assert_eq!(j["cpu_split"]["qemu_img_s_per_gib"], 1.0);
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
