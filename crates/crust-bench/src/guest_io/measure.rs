//! Running the workloads: commands in the guest, the same on the host,
//! each side settled (caches dropped) before a run.

use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::watch;

use super::report::{Outcome, Run, Side, WorkloadResult};
use super::workload::{HELPER, Measured, Workload};
use crust_kubesim::flow::{MOUNT_DESTINATION, Progress, StepReport};
use crust_kubesim::runtime_cli::RuntimeCli;

use super::{BENCH_DIR, EXEC_SLACK, GuestIoConfig, MAX_CONSECUTIVE_FAILURES, VIRTIOFS_DESTINATION};
use super::{INTERRUPTED, baseline, host, workload};

/// Runs commands in the sandbox's guest.
pub(crate) struct Guest {
    pub(crate) rt: RuntimeCli,
    pub(crate) id: String,
    /// Ctrl-C/SIGTERM: the running command is abandoned (the runtime CLI
    /// child is killed) so teardown starts at once.
    pub(crate) stop: watch::Receiver<bool>,
}

impl Guest {
    /// `args` in the guest, bounded by `limit`; stdout when it exits 0.
    pub(crate) async fn run(&self, args: &[String], limit: Duration) -> Result<String, String> {
        let ms = limit.as_millis().to_string();
        let mut a: Vec<&str> = vec!["exec", &self.id, "--timeout-ms", &ms, "--"];
        a.extend(args.iter().map(String::as_str));
        let mut stop = self.stop.clone();
        let stopped = async move {
            // A dropped sender never stops the run.
            if stop.wait_for(|s| *s).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        let out = tokio::select! {
            out = self.rt.run_for(&a, limit + EXEC_SLACK) => out.map_err(|e| e.to_string())?,
            () = stopped => return Err(INTERRUPTED.into()),
        };
        if out.code != Some(0) {
            let err = out.stderr.trim();
            return Err(format!(
                "`{}` in the guest failed ({}): {}",
                args.join(" "),
                out.code
                    .map(|c| format!("exit {c}"))
                    .unwrap_or_else(|| "signal".into()),
                if err.is_empty() {
                    out.stdout.trim()
                } else {
                    err
                }
            ));
        }
        Ok(out.stdout)
    }

    pub(crate) async fn sh(&self, script: &str, limit: Duration) -> Result<String, String> {
        self.run(&["sh".into(), "-c".into(), script.into()], limit)
            .await
    }
}

/// Guest side and host side of the two mounts while the sandbox runs.
pub(crate) struct Bench<'a> {
    pub(crate) guest: Guest,
    pub(crate) cfg: &'a GuestIoConfig,
    /// QEMU and the share's virtiofsd.
    pub(crate) pids: Vec<i32>,
    /// The host columns, when they run.
    pub(crate) host: Option<baseline::HostSide>,
    pub(crate) progress: Progress,
    pub(crate) stop: watch::Receiver<bool>,
}

/// The bench directory of a guest mount.
pub(crate) fn dir_of(side: Side) -> String {
    match side {
        Side::Block => format!("{MOUNT_DESTINATION}/{BENCH_DIR}"),
        Side::Virtiofs => format!("{VIRTIOFS_DESTINATION}/{BENCH_DIR}"),
        Side::HostFio | Side::LoopFio | Side::QemuImg => {
            unreachable!("a host column has no guest directory")
        }
    }
}

/// Bound of one guest command working on `bytes` (TCG guests are slow:
/// 1 MiB/s at the worst, plus a minute).
pub(crate) fn bound(bytes: u64, runtime: Duration) -> Duration {
    Duration::from_secs(60 + bytes / (1 << 20)) + runtime
}

impl Bench<'_> {
    pub(crate) fn step(&self, step: String, t0: Instant, r: &Result<String, String>) {
        let (ok, detail) = match r {
            Ok(d) => (true, d.clone()),
            Err(e) => (false, e.clone()),
        };
        (self.progress)(&StepReport {
            step,
            ok,
            duration_ms: t0.elapsed().as_secs_f64() * 1000.0,
            detail,
        });
    }

    /// Dirty data written back in the guest and on the host; for a cold
    /// run both page caches dropped too.
    pub(crate) async fn settle(&self, cold: bool) -> Result<(), String> {
        let script = if cold {
            "sync && echo 3 > /proc/sys/vm/drop_caches"
        } else {
            "sync"
        };
        self.guest.sh(script, Duration::from_secs(120)).await?;
        if cold && self.cfg.drop_host_caches {
            tokio::task::spawn_blocking(host::drop_caches)
                .await
                .map_err(|e| e.to_string())??;
        } else {
            tokio::task::spawn_blocking(host::sync)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The host's part of [`Bench::settle`], before a host column's run:
    /// dirty data written back (caches dropped too when `cold`). The
    /// guest is idle then, with nothing dirty: every fio workload ends
    /// with its data fsynced or only reads.
    pub(crate) async fn settle_host(&self, cold: bool) -> Result<(), String> {
        let cold = cold && self.cfg.drop_host_caches;
        tokio::task::spawn_blocking(move || {
            if cold {
                host::drop_caches()
            } else {
                host::sync();
                Ok(())
            }
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// The files and the tree the workloads use, on one mount (not timed).
    pub(crate) async fn prepare(&self, side: Side) -> Result<String, String> {
        let dir = dir_of(side);
        let s = &self.cfg.sizes;
        self.guest
            .sh(
                &format!("rm -rf {dir} && mkdir -p {dir}"),
                Duration::from_secs(120),
            )
            .await?;
        for cmd in workload::layout_commands(&dir, s) {
            self.guest
                .run(&cmd, bound(s.rand_file.max(s.seq_file), Duration::ZERO))
                .await?;
        }
        let tree = self
            .guest
            .run(
                &[
                    HELPER.into(),
                    "tree".into(),
                    format!("{dir}/tree"),
                    s.walk_entries.to_string(),
                ],
                bound(s.walk_entries as u64 * 4096, Duration::ZERO)
                    + Duration::from_secs(s.walk_entries as u64 / 50),
            )
            .await?;
        let v: Value =
            serde_json::from_str(tree.trim()).map_err(|e| format!("tree output: {e}"))?;
        Ok(format!(
            "{} and {} laid out, tree of {} entries built in {:.1}s",
            crust_report::units::human_size(s.rand_file as i64),
            crust_report::units::human_size(s.seq_file as i64),
            v["entries"],
            v["seconds"].as_f64().unwrap_or(0.0)
        ))
    }

    /// One run of `w` on one mount or host column, with the host CPU it
    /// cost. `host_rate`: host fio's result of this repetition (sizes
    /// qemu-img's time-based rows).
    pub(crate) async fn run_one(
        &self,
        w: &Workload,
        side: Side,
        rep: u32,
        host_rate: Option<f64>,
    ) -> Result<Run, String> {
        // The host columns read with O_DIRECT (host fio; fio and qemu-img
        // on a direct-I/O loop device): no page cache to drop unless the
        // kernel refused the loop device direct I/O.
        match side {
            Side::Block | Side::Virtiofs => self.settle(w.cold()).await?,
            Side::HostFio => self.settle_host(false).await?,
            Side::LoopFio | Side::QemuImg => {
                let buffered = self.host.as_ref().is_some_and(|h| !h.scratch.direct_io);
                self.settle_host(w.cold() && buffered).await?;
            }
        }
        let (measured, host_cpu_s) = match (side, &self.host) {
            (Side::Block | Side::Virtiofs, _) => self.run_guest(w, side).await?,
            (Side::HostFio, Some(h)) => {
                let s = &self.cfg.sizes;
                let cmd = baseline::host_fio_command(w, &h.fio_dir, s);
                let limit = bound(s.rand_file.max(s.seq_file), s.runtime);
                let (out, cpu) = baseline::run_host(&cmd, limit, &self.stop).await?;
                (workload::parse(w, &out)?, cpu)
            }
            (Side::LoopFio, Some(h)) => {
                let s = &self.cfg.sizes;
                let dev = h.scratch.device_path.display().to_string();
                let cmd = baseline::loop_fio_command(w, &dev, s);
                let limit = bound(s.rand_file.max(s.seq_file), s.runtime);
                let (out, cpu) = baseline::run_host(&cmd, limit, &self.stop).await?;
                (workload::parse(w, &out)?, cpu)
            }
            (Side::QemuImg, Some(h)) => {
                let s = &self.cfg.sizes;
                let bytes = h.scratch.device_bytes;
                let count = baseline::request_count(w, s, bytes, host_rate);
                let target = h.scratch.qemu_img_target.display().to_string();
                let cmd = baseline::qemu_img_command(w, &target, bytes, &h.aio, count);
                let limit = bound(count * baseline::block_size(w), s.runtime);
                let (out, cpu) = baseline::run_host(&cmd, limit, &self.stop).await?;
                (baseline::parse_qemu_img(w, count, &out)?, cpu)
            }
            (Side::HostFio | Side::LoopFio | Side::QemuImg, None) => {
                return Err("no host columns".into());
            }
        };
        Ok(Run {
            repetition: rep,
            side,
            measured,
            host_cpu_s,
        })
    }

    /// `w` on a guest mount: what it measured and QEMU's + virtiofsd's
    /// CPU seconds over it.
    pub(crate) async fn run_guest(
        &self,
        w: &Workload,
        side: Side,
    ) -> Result<(Measured, f64), String> {
        let s = &self.cfg.sizes;
        let limit = match w.kind {
            workload::Kind::Meta => bound(
                s.meta_files as u64 * 4096,
                Duration::from_secs(s.meta_files as u64 / 5),
            ),
            workload::Kind::Walk | workload::Kind::WalkWarm => bound(
                s.walk_entries as u64 * 512,
                Duration::from_secs(s.walk_entries as u64 / 100),
            ),
            _ => bound(s.rand_file.max(s.seq_file), s.runtime),
        };
        if let Some(warm_up) = w.warm_up(&dir_of(side), s) {
            self.guest
                .run(&warm_up, limit)
                .await
                .map_err(|e| format!("warm-up walk: {e}"))?;
        }
        let cpu0 = host::total_cpu(&self.pids);
        let out = self.guest.run(&w.command(&dir_of(side), s), limit).await?;
        let cpu = host::total_cpu(&self.pids) - cpu0;
        Ok((workload::parse(w, &out)?, cpu.max(0.0)))
    }

    /// Where `w` runs: both mounts, then the host columns of a fio
    /// workload.
    pub(crate) fn sides(&self, w: &Workload) -> Vec<Side> {
        let mut v = vec![Side::Block, Side::Virtiofs];
        if self.host.is_some() && w.is_fio() {
            v.extend([Side::HostFio, Side::LoopFio, Side::QemuImg]);
        }
        v
    }

    /// Every workload, `repeat` times, block and virtio-fs back to back.
    pub(crate) async fn measure(&self, errors: &mut Vec<String>) -> Vec<WorkloadResult> {
        let workloads = Workload::all(&self.cfg.queue_depths);
        let mut runs: Vec<Vec<Run>> = vec![Vec::new(); workloads.len()];
        let mut failures = 0;
        'all: for rep in 0..self.cfg.repeat {
            for (i, w) in workloads.iter().enumerate() {
                let mut host_rate = None;
                for side in self.sides(w) {
                    if *self.stop.borrow() || failures >= MAX_CONSECUTIVE_FAILURES {
                        break 'all;
                    }
                    let t0 = Instant::now();
                    let r = self.run_one(w, side, rep, host_rate).await;
                    if let (Side::HostFio, Ok(run)) = (side, &r) {
                        host_rate = Some(run.measured.value);
                    }
                    let shown = r
                        .as_ref()
                        .map(|run| w.unit().format(run.measured.value))
                        .map_err(Clone::clone);
                    self.step(
                        format!("{} {} #{}", w.name(), side.name(), rep + 1),
                        t0,
                        &shown,
                    );
                    match r {
                        Ok(run) => {
                            failures = 0;
                            runs[i].push(run);
                        }
                        Err(_) if *self.stop.borrow() => break 'all,
                        Err(e) => {
                            failures += 1;
                            errors.push(format!(
                                "{} on {} (repetition {}): {e}",
                                w.name(),
                                side.name(),
                                rep + 1
                            ));
                        }
                    }
                }
            }
        }
        if failures >= MAX_CONSECUTIVE_FAILURES {
            errors.push(format!("stopped after {failures} failed runs in a row"));
        }
        workloads
            .into_iter()
            .zip(runs)
            .map(|(w, r)| WorkloadResult::new(w, r))
            .collect()
    }

    /// The helper's feature probes on one mount: name -> outcome.
    pub(crate) async fn features(
        &self,
        side: Side,
    ) -> Result<Vec<(String, String, Outcome)>, String> {
        let out = self
            .guest
            .run(
                &[
                    HELPER.into(),
                    "features".into(),
                    format!("{}/features", dir_of(side)),
                ],
                Duration::from_secs(120),
            )
            .await?;
        let v: Value =
            serde_json::from_str(out.trim()).map_err(|e| format!("features output: {e}"))?;
        let list = v["features"]
            .as_array()
            .ok_or("features output has no list")?;
        Ok(list
            .iter()
            .map(|f| {
                let works = f["ok"].as_bool().unwrap_or(false);
                let detail = if works { &f["detail"] } else { &f["error"] };
                (
                    f["name"].as_str().unwrap_or("?").to_string(),
                    f["checks"].as_str().unwrap_or("").to_string(),
                    Outcome {
                        works,
                        detail: detail.as_str().unwrap_or("").to_string(),
                    },
                )
            })
            .collect())
    }

    /// The guest's statfs of one mount.
    pub(crate) async fn statfs(&self, side: Side) -> Result<Value, String> {
        let mount = match side {
            Side::Block => MOUNT_DESTINATION,
            Side::Virtiofs => VIRTIOFS_DESTINATION,
            Side::HostFio | Side::LoopFio | Side::QemuImg => {
                unreachable!("a host column has no guest mount")
            }
        };
        let out = self
            .guest
            .run(
                &[HELPER.into(), "statfs".into(), mount.into()],
                Duration::from_secs(60),
            )
            .await?;
        serde_json::from_str(out.trim()).map_err(|e| format!("statfs output: {e}"))
    }
}
