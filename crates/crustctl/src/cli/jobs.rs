//! Commands that run a job rather than one call (`bench`, `flow`, `demo`):
//! they print progress as it happens, stop and tear down on Ctrl-C/SIGTERM,
//! and say in the exit code whether the job failed or left anything behind.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use crust_proto::endpoint::Endpoint;

use super::args::{BenchArgs, DemoArgs, FlowArgs};
use super::request::map;
use super::{CliError, EXIT_FAILURE, EXIT_INTERRUPTED, emit};
use crate::demo::{DemoConfig, run_demo};
use crust_bench::{self as bench, BenchConfig, Limit};
use crust_csi_client::Csi;
use crust_kubesim::flow::{DeferVia, Flow, FlowConfig, StepReport, Workload};
use crust_report::OutputFormat;
use crust_report::say;

pub(super) async fn bench_cmd(
    ep: &Endpoint,
    timeout: Duration,
    a: BenchArgs,
    out: OutputFormat,
) -> Result<ExitCode, CliError> {
    // The KEP fields go on the wire only in a deferral run.
    if !a.defer_fs_ops
        && (a.cap.supplemental_group.is_some() || a.cap.supplemental_group_change_policy.is_some())
    {
        return Err(CliError::Usage(
            "--supplemental-group and --supplemental-group-change-policy need --defer-fs-ops in bench"
                .into(),
        ));
    }
    let limit = match (a.duration, a.ops) {
        (Some(d), _) => Limit::Duration(d),
        (None, Some(n)) => Limit::Ops(n),
        (None, None) => Limit::Ops(100),
    };
    let mut scenarios = Vec::new();
    for s in a.scenarios {
        if !scenarios.contains(&s) {
            scenarios.push(s);
        }
    }
    let mut sweep: Vec<usize> = Vec::new();
    for n in a.stats_volumes {
        if !sweep.contains(&(n as usize)) {
            sweep.push(n as usize);
        }
    }
    let config = BenchConfig {
        scenarios,
        concurrency: a.concurrency as usize,
        limit,
        size: a.size,
        capability: a.cap.build(),
        params: map(&a.params, "--param")?,
        secrets: map(&a.secrets, "--secret")?,
        staging_dir: a.staging_dir,
        target_dir: a.target_dir,
        stats_volumes: sweep[0],
        defer_fs_ops: a.defer_fs_ops,
        cleanup_retries: a.cleanup_retries,
        run_id: None,
    };
    let c = Csi::connect(ep, timeout).await?;
    let idle = match a.idle_loops {
        0 => None,
        n => Some(bench::scale::IdleLoops::hold(n)?),
    };
    let (stop_rx, signals) = stop_on_signals();
    let mut runs = Vec::new();
    for &n in &sweep {
        let cfg = BenchConfig {
            stats_volumes: n,
            ..config.clone()
        };
        let mut report = match bench::run_bench(&c, cfg, stop_rx.clone()).await {
            Ok(r) => r,
            Err(e) => {
                signals.abort();
                return Err(e.into());
            }
        };
        if let Some(idle) = &idle {
            report.notes.push(format!(
                "{} idle loop devices held during the run (files in {})",
                idle.len(),
                idle.dir().display()
            ));
        }
        let stop = report.interrupted || !report.cleanup.leftovers.is_empty();
        runs.push((n, report));
        if stop {
            break;
        }
    }
    signals.abort();
    drop(idle);
    if sweep.len() == 1 {
        let (_, report) = runs.pop().expect("one run");
        return Ok(finish_bench(out, &report));
    }
    let sweep = bench::scale::Sweep { runs };
    emit(out, &sweep, "");
    let mut code = ExitCode::SUCCESS;
    for (_, r) in &sweep.runs {
        if r.interrupted {
            code = ExitCode::from(EXIT_INTERRUPTED);
        }
        if !r.cleanup.leftovers.is_empty() {
            say("error: cleanup left item(s) behind (listed in the report)");
            return Ok(ExitCode::from(EXIT_FAILURE));
        }
    }
    Ok(code)
}

/// Prints a bench report; the exit code says whether cleanup left anything
/// behind or the run was interrupted.
fn finish_bench(out: OutputFormat, report: &bench::BenchReport) -> ExitCode {
    emit(out, report, "");
    if !report.cleanup.leftovers.is_empty() {
        say(&format!(
            "error: cleanup left {} item(s) behind (listed in the report)",
            report.cleanup.leftovers.len()
        ));
        return ExitCode::from(EXIT_FAILURE);
    }
    if report.interrupted {
        return ExitCode::from(EXIT_INTERRUPTED);
    }
    ExitCode::SUCCESS
}

pub(super) async fn flow_cmd(
    ep: &Endpoint,
    timeout: Duration,
    a: FlowArgs,
    out: OutputFormat,
) -> Result<ExitCode, CliError> {
    if let Some(sp) = &a.sub_path
        && (sp.is_empty()
            || sp.starts_with('/')
            || sp.split('/').any(|c| c == "..")
            || sp.contains('\0'))
    {
        return Err(CliError::Usage(format!(
            "--sub-path {sp:?}: must be a relative path without '..'"
        )));
    }
    if a.sub_path.is_some() && a.pod.defer_via == DeferVia::None {
        return Err(CliError::Usage(
            "--sub-path is resolved by the VM runtime in the guest; it needs deferral".into(),
        ));
    }
    if !a.no_expand && a.expand_to <= a.pod.size {
        return Err(CliError::Usage(format!(
            "--expand-to ({}) must be larger than --size ({}); or use --no-expand",
            a.expand_to, a.pod.size
        )));
    }
    let c = Csi::connect(ep, timeout).await?;
    let (work, made) = work_dir(a.pod.work_dir.clone(), "crust-flow")?;
    let mut cfg = match a.pod.flow_config(work.clone()) {
        Ok(c) => c,
        Err(e) => {
            drop_work_dir(&work, made);
            return Err(e);
        }
    };
    cfg.expand_to = (!a.no_expand).then_some(a.expand_to);
    cfg.sub_path = a.sub_path;
    if !a.command.is_empty() {
        cfg.workload.args = a.command;
    }
    cfg.workload.env = a.env;
    cfg.workload.cwd = a.cwd;
    cfg.keep_volume = a.keep_volume;
    cfg.collect = a.collect;
    cfg.start_sandbox = !a.no_sandbox;
    let (stop, signals) = stop_on_signals();
    let report = Flow::new(cfg, c, progress_printer(out))
        .with_stop(stop.clone())
        .run()
        .await;
    signals.abort();
    drop_work_dir(&work, made);
    emit(out, &report, "");
    Ok(step_exit(
        *stop.borrow(),
        report.ok,
        report.failed_step.as_deref(),
        report.error.as_deref(),
    ))
}

pub(super) async fn demo_cmd(
    timeout: Duration,
    a: DemoArgs,
    out: OutputFormat,
) -> Result<ExitCode, CliError> {
    if a.expand_to <= a.size {
        return Err(CliError::Usage(format!(
            "--expand-to ({}) must be larger than --size ({})",
            a.expand_to, a.size
        )));
    }
    if a.expand_to > a.pool_capacity {
        return Err(CliError::Usage(format!(
            "--expand-to ({}) does not fit the pool (--pool-capacity {})",
            a.expand_to, a.pool_capacity
        )));
    }
    let cfg = DemoConfig {
        work_dir: a.work_dir,
        keep: a.keep,
        crust_csi: a.crust_csi,
        runtime_bin: a.runtime_bin,
        guest_dir: a.guest_dir,
        accel: a.accel,
        size: a.size,
        expand_to: a.expand_to,
        fs_type: a.fs_type,
        pool_capacity: a.pool_capacity,
        rpc_timeout: timeout.max(Duration::from_secs(120)),
        ..DemoConfig::default()
    };
    let (stop, signals) = stop_on_signals();
    if out == OutputFormat::Text {
        use std::io::Write;
        let _ = writeln!(
            std::io::stdout(),
            "crust demo: one pod with a deferred volume, end to end\n"
        );
    }
    let report = run_demo(cfg, progress_printer(out), stop.clone()).await;
    signals.abort();
    emit(out, &report, "");
    Ok(step_exit(
        *stop.borrow(),
        report.ok,
        report.failed_step.as_deref(),
        report.error.as_deref(),
    ))
}

/// The exit code of a job reported step by step (flow, demo), saying on
/// stderr which step failed.
fn step_exit(stopped: bool, ok: bool, failed_step: Option<&str>, error: Option<&str>) -> ExitCode {
    if stopped {
        return ExitCode::from(EXIT_INTERRUPTED);
    }
    if ok {
        return ExitCode::SUCCESS;
    }
    if let (Some(s), Some(e)) = (failed_step, error) {
        say(&format!("error: {s} failed: {e}"));
    }
    ExitCode::from(EXIT_FAILURE)
}

pub(super) async fn bench_deferred_cmd(
    ep: &Endpoint,
    timeout: Duration,
    a: BenchArgs,
    out: OutputFormat,
) -> Result<ExitCode, CliError> {
    if a.cap.block {
        return Err(CliError::Usage(
            "--deferred hands a filesystem to the runtime; --block does not apply".into(),
        ));
    }
    let limit = match (a.duration, a.ops) {
        (Some(d), _) => Limit::Duration(d),
        (None, Some(n)) => Limit::Ops(n),
        (None, None) => Limit::Ops(100),
    };
    let c = Csi::connect(ep, timeout).await?;
    let (work, made) = work_dir(a.work_dir.clone(), "crust-bench")?;
    let mut f = FlowConfig::new(work.clone(), a.runtime.build());
    let run = bench::new_run_id();
    f.volume_name = run.clone();
    f.sandbox_id = run;
    f.size = a.size;
    f.fs_type = a.cap.fs_type.clone().unwrap_or_else(|| "ext4".into());
    f.mount_flags = a.cap.mount_flags.clone();
    f.fs_group = a.cap.supplemental_group;
    f.change_policy = a.cap.supplemental_group_change_policy;
    f.params = match map(&a.params, "--param") {
        Ok(p) => p,
        Err(e) => {
            drop_work_dir(&work, made);
            return Err(e);
        }
    };
    f.workload = Workload {
        args: vec![
            "sh".into(),
            "-c".into(),
            "trap 'exit 0' TERM; while true; do sleep 1; done".into(),
        ],
        ..Workload::default()
    };
    let cfg = bench::deferred::DeferredConfig {
        flow: f,
        concurrency: a.concurrency as usize,
        limit,
        expand_step: a.expand_step,
        pause: a.pause.unwrap_or_default(),
    };
    let (stop, signals) = stop_on_signals();
    // Set-up and teardown steps go to stderr: stdout is the table.
    let progress: crust_kubesim::flow::Progress =
        std::sync::Arc::new(|s: &StepReport| say(&s.line()));
    let report = bench::deferred::run_deferred(&c, cfg, progress, stop).await;
    signals.abort();
    drop_work_dir(&work, made);
    Ok(finish_bench(out, &report?))
}

pub(super) async fn bench_guest_io_cmd(
    ep: &Endpoint,
    timeout: Duration,
    a: BenchArgs,
    out: OutputFormat,
) -> Result<ExitCode, CliError> {
    use crust_bench::guest_io::{GuestIoConfig, run_guest_io};
    if a.cap.block {
        return Err(CliError::Usage(
            "--guest-io mounts filesystems; --block does not apply".into(),
        ));
    }
    let mut rt = a.runtime.build();
    if rt.guest_kernel.is_none() {
        // The bench image next to the binaries (target/guest-image-bench).
        let dir = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|d| d.join("../guest-image-bench")))
            .filter(|d| d.join("vmlinuz").is_file())
            .ok_or_else(|| {
                CliError::Usage(
                    "no bench guest image next to crustctl: build it with `guest/build-image.sh --bench` \
                     or pass --guest-kernel/--guest-initrd of one"
                        .into(),
                )
            })?;
        rt.guest_kernel = Some(dir.join("vmlinuz"));
        rt.guest_initrd = Some(dir.join("initramfs.cpio.gz"));
    }
    let run = bench::new_run_id();
    let (work, made) = work_dir(a.work_dir.clone(), "crust-bench")?;
    let mut cfg = GuestIoConfig::new(work.clone(), rt, &run);
    cfg.fs_type = a.cap.fs_type.clone().unwrap_or_else(|| "ext4".into());
    cfg.mount_flags = a.cap.mount_flags.clone();
    let prepared = map(&a.params, "--param").and_then(|p| {
        cfg.params = p;
        cfg.apply(&a.guest_io).map_err(CliError::Usage)
    });
    if let Err(e) = prepared {
        drop_work_dir(&work, made);
        return Err(e);
    }
    let c = match Csi::connect(ep, timeout).await {
        Ok(c) => c,
        Err(e) => {
            drop_work_dir(&work, made);
            return Err(e.into());
        }
    };
    let (stop, signals) = stop_on_signals();
    // Steps go to stderr: stdout is the report.
    let progress: crust_kubesim::flow::Progress =
        std::sync::Arc::new(|s: &StepReport| say(&s.line()));
    let report = run_guest_io(&c, cfg, progress, stop).await;
    signals.abort();
    drop_work_dir(&work, made);
    let report = report?;
    emit(out, &report, "");
    let chart_failed = a
        .guest_io
        .chart
        .as_ref()
        .is_some_and(|path| !write_chart(&report, path));
    let failed = chart_failed || !report.cleanup.leftovers.is_empty() || !report.errors.is_empty();
    if failed {
        say(&format!(
            "error: {} failed run(s)/probe(s), {} item(s) left behind (listed in the report)",
            report.errors.len(),
            report.cleanup.leftovers.len()
        ));
    }
    Ok(ExitCode::from(match (failed, report.interrupted) {
        (true, _) => EXIT_FAILURE,
        (false, true) => EXIT_INTERRUPTED,
        (false, false) => 0,
    }))
}

/// `--chart FILE`: the guest-io chart as SVG; false (said) when it could
/// not be drawn or written.
fn write_chart(report: &crust_bench::guest_io::report::GuestIoReport, path: &Path) -> bool {
    let r = crust_bench::guest_io::chart::svg(report)
        .and_then(|svg| std::fs::write(path, svg).map_err(|e| e.to_string()));
    match r {
        Ok(()) => {
            say(&format!("chart written to {}", path.display()));
            true
        }
        Err(e) => {
            say(&format!("error: chart {}: {e}", path.display()));
            false
        }
    }
}

/// Step lines as they happen: stdout for text, stderr when stdout is JSON
/// (write errors ignored, see [`say`]).
fn progress_printer(out: OutputFormat) -> crust_kubesim::flow::Progress {
    std::sync::Arc::new(move |s: &StepReport| match out {
        OutputFormat::Text => {
            use std::io::Write;
            let _ = writeln!(std::io::stdout(), "{}", s.line());
        }
        OutputFormat::Json => say(&s.line()),
    })
}

/// First Ctrl-C/SIGTERM: stop and tear down. Second: leave now.
fn stop_on_signals() -> (
    tokio::sync::watch::Receiver<bool>,
    tokio::task::JoinHandle<()>,
) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let signals = tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        interrupted(&mut term).await;
        let _ = stop_tx.send(true);
        say("interrupted: tearing down (interrupt again to abort the teardown)");
        interrupted(&mut term).await;
        say("teardown aborted; resources may be left behind");
        std::process::exit(EXIT_INTERRUPTED as i32);
    });
    (stop_rx, signals)
}

/// The given work dir (created if missing) or a fresh
/// `/var/tmp/<prefix>-<pid>`; says whether we created it.
fn work_dir(given: Option<PathBuf>, prefix: &str) -> Result<(PathBuf, bool), CliError> {
    let dir =
        given.unwrap_or_else(|| PathBuf::from(format!("/var/tmp/{prefix}-{}", std::process::id())));
    if !dir.is_absolute() {
        return Err(CliError::Usage(format!(
            "--work-dir {}: must be an absolute path",
            dir.display()
        )));
    }
    if dir.is_dir() {
        return Ok((dir, false));
    }
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError::Usage(format!("cannot create {}: {e}", dir.display())))?;
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
    Ok((dir, true))
}

/// Removes a work dir we created, if the flow left it empty.
fn drop_work_dir(dir: &std::path::Path, made: bool) {
    if made && let Err(e) = std::fs::remove_dir(dir) {
        say(&format!(
            "warning: work dir {} not removed: {e}",
            dir.display()
        ));
    }
}

/// Waits for Ctrl-C or SIGTERM.
async fn interrupted(term: &mut Option<tokio::signal::unix::Signal>) {
    match term {
        Some(t) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = t.recv() => {}
            }
        }
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
