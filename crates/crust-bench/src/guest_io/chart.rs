//! The chart of `bench --guest-io --chart FILE`: an SVG (plotters, SVG
//! backend only) of grouped bars per fio workload: host fio, fio on the
//! loop device, qemu-img bench, guest block, guest virtio-fs. The workloads' units differ, so
//! every bar is its result ÷ host fio's (the physical limit = 1); a group
//! without a host column is scaled to its largest bar instead.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::report::{GuestIoReport, SideSummary};
use super::workload::Unit;

/// The bars of a group, in drawing order, with their colours.
pub const SERIES: [(&str, RGBColor); 5] = [
    ("host fio (O_DIRECT)", RGBColor(0x4d, 0x4d, 0x4d)),
    ("fio on the loop device", RGBColor(0x2c, 0xa0, 0x2c)),
    ("qemu-img bench", RGBColor(0x8c, 0x6b, 0xb1)),
    ("guest block (crust)", RGBColor(0x1f, 0x77, 0xb4)),
    ("guest virtio-fs", RGBColor(0xff, 0x7f, 0x0e)),
];

const WIDTH: u32 = 1400;
const HEIGHT: u32 = 620;

/// One workload's bars: each series' median (`None`: it did not run).
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub workload: String,
    pub unit: Unit,
    pub values: [Option<f64>; SERIES.len()],
}

impl Group {
    /// What the bars are divided by: host fio, else the largest bar.
    pub fn base(&self) -> Option<f64> {
        match self.values[0] {
            Some(h) if h > 0.0 => Some(h),
            _ => self
                .values
                .iter()
                .flatten()
                .copied()
                .filter(|v| *v > 0.0)
                .reduce(f64::max),
        }
    }

    /// Each bar ÷ [`Group::base`].
    pub fn scaled(&self) -> [Option<f64>; SERIES.len()] {
        let base = self.base();
        self.values.map(|v| Some(v? / base?))
    }
}

/// The groups of a report: every fio workload with at least one result.
pub fn groups(rep: &GuestIoReport) -> Vec<Group> {
    let m = |s: &SideSummary| (s.runs > 0).then_some(s.median);
    rep.workloads
        .iter()
        .filter(|w| w.spec.is_fio())
        .map(|w| Group {
            workload: w.workload.clone(),
            unit: w.unit,
            values: [
                m(&w.host_fio),
                m(&w.loop_fio),
                m(&w.qemu_img),
                m(&w.block),
                m(&w.virtiofs),
            ],
        })
        .filter(|g| g.base().is_some())
        .collect()
}

/// The chart of `rep` as an SVG document.
pub fn svg(rep: &GuestIoReport) -> Result<String, String> {
    let groups = groups(rep);
    if groups.is_empty() {
        return Err("no fio workload has a result to draw".into());
    }
    let mut out = String::new();
    draw(rep, &groups, &mut out).map_err(|e| format!("drawing the chart: {e:?}"))?;
    Ok(out)
}

type DrawResult = Result<(), DrawingAreaErrorKind<std::io::Error>>;

/// Width of a group's slot each bar takes (a 0.1 margin either side).
const SLOT: f64 = 0.8 / SERIES.len() as f64;

/// Left edge of series `i`'s bar in group `g`.
fn bar_x(g: usize, i: usize) -> f64 {
    g as f64 + 0.1 + SLOT * i as f64
}

fn draw(rep: &GuestIoReport, groups: &[Group], out: &mut String) -> DrawResult {
    let root = SVGBackend::with_string(out, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = groups
        .iter()
        .flat_map(|g| g.scaled())
        .flatten()
        .fold(1.0, f64::max);
    let n = groups.len() as f64;
    let caption = format!(
        "crust guest I/O against the physical limit: result ÷ host fio (accelerator {})",
        rep.accel.as_deref().unwrap_or("?")
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(62)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..n, 0f64..top * 1.15)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("÷ host fio")
        .y_label_formatter(&|v| format!("{v:.1}"))
        .draw()?;
    for (i, (name, colour)) in SERIES.iter().enumerate() {
        let bars = groups.iter().enumerate().filter_map(move |(g, group)| {
            let v = group.scaled()[i]?;
            let x0 = bar_x(g, i);
            Some(Rectangle::new(
                [(x0, 0.0), (x0 + SLOT * 0.9, v)],
                colour.filled(),
            ))
        });
        chart
            .draw_series(bars)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
        let labels = groups.iter().enumerate().filter_map(move |(g, group)| {
            let v = group.scaled()[i]?;
            let x = bar_x(g, i) + SLOT * 0.45;
            let style = ("sans-serif", 11)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Center, VPos::Bottom));
            Some(Text::new(format!("{v:.2}"), (x, v), style))
        });
        chart.draw_series(labels)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    // The workload under each group, and host fio's own figure.
    for (g, group) in groups.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        let (kind, depth) = group
            .workload
            .rsplit_once('-')
            .unwrap_or((group.workload.as_str(), ""));
        let host = match group.values[0] {
            Some(h) => format!("host {}", group.unit.format(h)),
            None => "no host column".into(),
        };
        for (line, text) in [kind, depth, host.as_str()].into_iter().enumerate() {
            let style = ("sans-serif", 12)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Center, VPos::Top));
            root.draw(&Text::new(
                text.to_string(),
                (px, py + 6 + 16 * line as i32),
                style,
            ))?;
        }
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest_io::report::{Run, Side, WorkloadResult};
    use crate::guest_io::workload::{Kind, Measured, Workload};

    fn run(side: Side, value: f64) -> Run {
        Run {
            repetition: 0,
            side,
            measured: Measured::new(value, 1 << 20, None, None, 1.0),
            host_cpu_s: 0.1,
        }
    }

    fn report() -> GuestIoReport {
        let w = |kind, queue_depth| Workload { kind, queue_depth };
        let all = [
            (
                w(Kind::RandRead, 16),
                [4000.0, 3200.0, 3600.0, 2000.0, 500.0],
            ),
            (w(Kind::SeqRead, 1), [4e8, 3e8, 3.6e8, 1e8, 8e7]),
        ];
        let mut workloads: Vec<WorkloadResult> = all
            .iter()
            .map(|(w, v)| {
                let sides = [
                    Side::HostFio,
                    Side::LoopFio,
                    Side::QemuImg,
                    Side::Block,
                    Side::Virtiofs,
                ];
                WorkloadResult::new(*w, sides.iter().zip(v).map(|(s, v)| run(*s, *v)).collect())
            })
            .collect();
        // A metadata workload: no group.
        workloads.push(WorkloadResult::new(
            w(Kind::Walk, 1),
            vec![run(Side::Block, 9.0), run(Side::Virtiofs, 3.0)],
        ));
        // A fio workload without host columns: scaled to its largest bar.
        workloads.push(WorkloadResult::new(
            w(Kind::SeqWrite, 1),
            vec![run(Side::Block, 50.0), run(Side::Virtiofs, 100.0)],
        ));
        GuestIoReport {
            accel: Some("tcg".into()),
            workloads,
            ..Default::default()
        }
    }

    #[test]
    fn bars_are_results_over_host_fio() {
        let g = groups(&report());
        assert_eq!(g.len(), 3, "{g:?}");
        assert_eq!(g[0].workload, "randread-4k-qd16");
        assert_eq!(
            g[0].scaled(),
            [Some(1.0), Some(0.8), Some(0.9), Some(0.5), Some(0.125)]
        );
        assert_eq!(g[1].scaled()[1], Some(0.75));
        assert_eq!(g[1].scaled()[3], Some(0.25));
        assert_eq!(g[2].scaled(), [None, None, None, Some(0.5), Some(1.0)]);
        // Every series' bar inside its group's slot, none overlapping.
        let last = SERIES.len() - 1;
        assert!((bar_x(1, 0) - 1.1).abs() < 1e-9);
        assert!(bar_x(1, last) + SLOT * 0.9 <= 1.9 + 1e-9);
        assert!((1..=last).all(|i| bar_x(0, i - 1) + SLOT * 0.9 < bar_x(0, i)));
    }

    #[test]
    fn svg_has_a_bar_group_per_fio_workload() {
        let s = svg(&report()).unwrap();
        assert!(
            s.starts_with("<svg") && s.trim_end().ends_with("</svg>"),
            "{s}"
        );
        let fills = |c: RGBColor| {
            let hex = format!("fill=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2);
            s.to_uppercase().matches(&hex.to_uppercase()).count()
        };
        // The host columns: two groups + the legend; block and
        // virtio-fs: three groups + the legend.
        assert_eq!(SERIES.map(|(_, c)| fills(c)), [3, 3, 3, 4, 4], "{s}");
        for label in [
            "randread-4k",
            "seqread-1m",
            "seqwrite-1m",
            "qd16",
            "host 4000 IOPS",
        ] {
            assert!(s.contains(label), "{label} not in the chart");
        }
        assert!(!s.contains("walk"), "a metadata workload has no group");
        assert!(s.contains("accelerator tcg"));
        let empty = GuestIoReport::default();
        assert!(svg(&empty).unwrap_err().contains("no fio workload"));
    }
}
