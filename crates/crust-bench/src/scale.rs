//! Node-scale runs: foreign loop devices held idle during a run
//! (`--idle-loops`), and a sweep of the stats scenario over the number of
//! published volumes (`--stats-volumes 16,256,1024`) that prints cost
//! against N.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crust_blockdev::{AttachOptions, LoopGuard};

use super::{BenchError, BenchReport, Scenario};
use crust_report::units::human_duration;
use crust_report::{Render, table};

/// Loop devices attached to sparse 1 MiB files that nobody uses, as
/// other software on a node would have; detached and removed on drop.
pub struct IdleLoops {
    loops: Vec<LoopGuard>,
    dir: PathBuf,
}

impl IdleLoops {
    pub fn hold(n: u32) -> Result<IdleLoops, BenchError> {
        let dir = PathBuf::from(format!(
            "/var/tmp/crust-bench-idle-loops.{}",
            std::process::id()
        ));
        std::fs::create_dir(&dir)
            .map_err(|e| BenchError::Config(format!("{}: {e}", dir.display())))?;
        // From here on, Drop releases what was made.
        let mut held = IdleLoops {
            loops: Vec::with_capacity(n as usize),
            dir,
        };
        for i in 0..n {
            let f = held.dir.join(format!("idle-{i}.img"));
            std::fs::File::create(&f)
                .and_then(|file| file.set_len(1 << 20))
                .map_err(|e| BenchError::Config(format!("{}: {e}", f.display())))?;
            let g = LoopGuard::attach(&f, AttachOptions::default()).map_err(|e| {
                BenchError::Config(format!("holding idle loop device {}: {e}", i + 1))
            })?;
            held.loops.push(g);
        }
        Ok(held)
    }

    pub fn len(&self) -> usize {
        self.loops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.loops.is_empty()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for IdleLoops {
    fn drop(&mut self) {
        // Detach first: the files are busy until then.
        self.loops.clear();
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            crust_report::say(&format!(
                "warning: could not remove {}: {e}",
                self.dir.display()
            ));
        }
    }
}

/// One report per number of published volumes.
pub struct Sweep {
    pub runs: Vec<(usize, BenchReport)>,
}

impl Render for Sweep {
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "sweep": self.runs.iter().map(|(n, r)| {
                serde_json::json!({"stats_volumes": n, "report": r.to_json()})
            }).collect::<Vec<_>>()
        })
    }

    fn to_text(&self) -> String {
        let mut out = String::new();
        for (n, r) in &self.runs {
            let _ = writeln!(out, "== {n} published volumes ==");
            out.push_str(&r.to_text());
        }
        // Cost against N, with p50 relative to the smallest N.
        let mut rows = Vec::new();
        let mut first_p50 = None;
        for (n, r) in &self.runs {
            let Some(s) = r.scenario(Scenario::Stats) else {
                continue;
            };
            for rpc in &s.rpcs {
                let base = *first_p50.get_or_insert(rpc.p50_us.max(1));
                let d = |us: u64| human_duration(Duration::from_micros(us));
                rows.push(vec![
                    n.to_string(),
                    rpc.rpc.clone(),
                    format!("{:.1}", rpc.ops_per_sec),
                    d(rpc.p50_us),
                    d(rpc.p99_us),
                    format!("{:.2}x", rpc.p50_us as f64 / base as f64),
                ]);
            }
        }
        if !rows.is_empty() {
            let _ = writeln!(out, "== stats cost against published volumes ==");
            out.push_str(&table(
                &["VOLUMES", "RPC", "OPS/S", "P50", "P99", "P50 VS FIRST"],
                &rows,
            ));
        }
        out
    }
}
