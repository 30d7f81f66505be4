//! Per-scenario latency rows: each call timed into its RPC's histogram,
//! errors counted with a few samples kept.

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tonic::Status;

use crate::hist::Histogram;
use crate::{RpcReport, Scenario, ScenarioReport};

#[derive(Default)]
pub(crate) struct Row {
    pub(crate) hist: Histogram,
    pub(crate) errors: u64,
}

/// Per-scenario latency rows, in first-use order.
#[derive(Default)]
pub(crate) struct Recorder {
    pub(crate) rows: Mutex<Vec<(&'static str, Row)>>,
    pub(crate) samples: Mutex<Vec<String>>,
    pub(crate) ops: AtomicU64,
    pub(crate) failed_ops: AtomicU64,
}

pub(crate) const MAX_ERROR_SAMPLES: usize = 5;

impl Recorder {
    pub(crate) fn with_row(&self, rpc: &'static str, f: impl FnOnce(&mut Row)) {
        let mut rows = self.rows.lock().unwrap();
        if let Some((_, r)) = rows.iter_mut().find(|(n, _)| *n == rpc) {
            f(r)
        } else {
            let mut r = Row::default();
            f(&mut r);
            rows.push((rpc, r));
        }
    }

    pub(crate) fn ok(&self, rpc: &'static str, d: Duration) {
        self.with_row(rpc, |r| r.hist.record(d.as_micros() as u64));
    }

    pub(crate) fn err(&self, rpc: &'static str, msg: String) {
        self.with_row(rpc, |r| r.errors += 1);
        self.sample(format!("{rpc}: {msg}"));
    }

    /// A cycle that did not complete (its failing RPC is already counted).
    pub(crate) fn cycle_failed(&self) {
        self.failed_ops.fetch_add(1, Ordering::Relaxed);
        self.with_row("cycle", |r| r.errors += 1);
    }

    pub(crate) fn sample(&self, msg: String) {
        let mut s = self.samples.lock().unwrap();
        if s.len() < MAX_ERROR_SAMPLES && !s.contains(&msg) {
            s.push(msg);
        }
    }

    pub(crate) async fn timed<T>(
        &self,
        rpc: &'static str,
        fut: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        let t0 = Instant::now();
        let r = fut.await;
        match &r {
            Ok(_) => self.ok(rpc, t0.elapsed()),
            Err(s) => self.err(rpc, status_text(s)),
        }
        r
    }

    pub(crate) fn report(&self, scenario: Scenario, elapsed: Duration) -> ScenarioReport {
        let secs = elapsed.as_secs_f64().max(1e-9);
        let rpcs = self
            .rows
            .lock()
            .unwrap()
            .iter()
            .map(|(name, r)| RpcReport {
                rpc: name.to_string(),
                count: r.hist.count(),
                errors: r.errors,
                ops_per_sec: r.hist.count() as f64 / secs,
                p50_us: r.hist.percentile(50.0),
                p95_us: r.hist.percentile(95.0),
                p99_us: r.hist.percentile(99.0),
                max_us: r.hist.max(),
                mean_us: r.hist.mean(),
            })
            .collect();
        ScenarioReport {
            scenario,
            elapsed_secs: elapsed.as_secs_f64(),
            ops: self.ops.load(Ordering::Relaxed),
            errors: self.failed_ops.load(Ordering::Relaxed),
            rpcs,
            error_samples: self.samples.lock().unwrap().clone(),
        }
    }
}

pub(crate) fn status_text(s: &Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}
