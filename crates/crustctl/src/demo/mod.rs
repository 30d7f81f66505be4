//! `crustctl demo`: the whole stack on one machine, from nothing.
//!
//! In a work directory of its own it prepares the embedded default (a
//! loop-file pool, the plugin's state, the hand-off roots, the runtime's
//! root), builds the guest image if it is missing, starts `crust-csi`
//! with deferral enabled, runs [`crust_kubesim::flow`] with a workload that
//! appends timestamps to `/data/out.txt`, and reports what the guest saw
//! before and after the online expansion, what the plugin reported
//! through deferral, and that nothing was left behind.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;
use tokio::sync::watch;

use crust_csi_client::Csi;
use crust_kubesim::flow::{DeferVia, Flow, FlowConfig, FlowReport, Progress, StepReport, Workload};
use crust_kubesim::runtime_cli::{RuntimeCli, sibling_bin};
use crust_report::Render;
use crust_report::units::human_size;

mod image;
mod leftovers;
mod plugin;

pub use image::{ensure_guest_image, workspace_roots};
use leftovers::sweep;
pub use leftovers::{Leftovers, find_leftovers};
pub use plugin::{PluginProcess, log_tail};

/// The demo's workload: a timestamp a second into `/data/out.txt`, each
/// line flushed to the disk.
pub const DEMO_SCRIPT: &str = "trap 'exit 0' TERM; i=0; while true; do i=$((i+1)); \
    echo \"$(date -u +%Y-%m-%dT%H:%M:%SZ) line $i\" >> /data/out.txt; sync; sleep 1; done";

#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Default: a fresh `/var/tmp/crust-demo-<pid>`.
    pub work_dir: Option<PathBuf>,
    /// Leave the work dir (pool files, logs) in place.
    pub keep: bool,
    /// Default: `crust-csi` next to this executable.
    pub crust_csi: Option<PathBuf>,
    /// Default: `crust-runtime` next to this executable.
    pub runtime_bin: Option<PathBuf>,
    /// Directory with `vmlinuz` and `initramfs.cpio.gz` (built there when
    /// missing).
    pub guest_dir: Option<PathBuf>,
    pub accel: Option<String>,
    pub size: u64,
    pub expand_to: u64,
    pub fs_type: String,
    pub pool_capacity: u64,
    /// Lines the workload must have written before the pod stops.
    pub min_lines: usize,
    /// Deadline of each CSI call.
    pub rpc_timeout: Duration,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            work_dir: None,
            keep: false,
            crust_csi: None,
            runtime_bin: None,
            guest_dir: None,
            accel: None,
            size: 256 << 20,
            expand_to: 512 << 20,
            fs_type: "ext4".into(),
            pool_capacity: 2 << 30,
            min_lines: 5,
            rpc_timeout: Duration::from_secs(120),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct DemoReport {
    pub ok: bool,
    pub work_dir: String,
    /// Steps of the demo itself (set-up, workload, checks), in order,
    /// with the flow's steps in `flow.steps`.
    pub steps: Vec<StepReport>,
    pub flow: Option<FlowReport>,
    /// Lines the workload wrote to /data/out.txt.
    pub lines_written: Option<usize>,
    pub first_line: Option<String>,
    pub last_line: Option<String>,
    pub leftovers: Leftovers,
    pub plugin_stopped: bool,
    pub work_dir_removed: bool,
    pub failed_step: Option<String>,
    pub error: Option<String>,
    /// The end of the plugin's log, when something failed.
    pub plugin_log_tail: Option<String>,
}

impl Render for DemoReport {
    fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("report serializes")
    }

    fn to_text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "\ncrust demo report");
        let _ = writeln!(o, "-----------------");
        let flow = self.flow.as_ref();
        if let Some(v) = flow.and_then(|f| f.volume.as_ref()) {
            let _ = writeln!(
                o,
                "volume:     {} (name {}), {} {}, filesystem mounted only inside the guest",
                v.id,
                v.name,
                human_size(v.capacity_bytes),
                v.fs_type
            );
        }
        if let Some(f) = flow {
            flow_text(&mut o, f);
        }
        if let Some(n) = self.lines_written {
            let _ = writeln!(o, "workload:   wrote {n} lines to /data/out.txt");
            if let (Some(a), Some(b)) = (&self.first_line, &self.last_line) {
                let _ = writeln!(o, "            first: {a}");
                let _ = writeln!(o, "            last:  {b}");
            }
        }
        if self.leftovers.is_empty() && self.plugin_stopped {
            let _ = writeln!(
                o,
                "cleanup:    cleaned up: plugin stopped; no sandbox, volume, loop device on the pool,"
            );
            let _ = writeln!(
                o,
                "            mount under the work dir, QEMU or hand-off record left"
            );
            let _ = writeln!(
                o,
                "            work dir {} {}",
                self.work_dir,
                if self.work_dir_removed {
                    "removed"
                } else {
                    "kept (--keep)"
                }
            );
        } else {
            let _ = writeln!(o, "cleanup:    NOT clean:");
            for l in self.leftovers.all() {
                let _ = writeln!(o, "            left: {l}");
            }
            if !self.plugin_stopped {
                let _ = writeln!(o, "            the plugin did not stop");
            }
        }
        match (&self.failed_step, &self.error) {
            (Some(s), Some(e)) => {
                let _ = writeln!(o, "\nFAILED at step {s}: {e}");
                if let Some(t) = &self.plugin_log_tail {
                    let _ = writeln!(o, "crust-csi log (end):\n{t}");
                }
            }
            _ if self.ok => {
                let _ = writeln!(o, "\ndemo OK");
            }
            _ => {
                let _ = writeln!(o, "\ndemo FAILED");
            }
        }
        o
    }
}

/// What the flow saw: the sandbox, the accelerator, df, CSI stats and
/// health before and after the expansion.
fn flow_text(o: &mut String, f: &FlowReport) {
    if let Some(g) = &f.guest_volume_path {
        let _ = writeln!(
            o,
            "sandbox:    {} (QEMU pid {}), volume at {g} in the guest, /data for the workload",
            f.sandbox_id,
            f.qemu_pid
                .map(|p| p.to_string())
                .unwrap_or_else(|| "?".into())
        );
    }
    if let Some(a) = &f.accel {
        let _ = writeln!(
            o,
            "accel:      {a}: {}",
            f.accel_reason.as_deref().unwrap_or("no reason given")
        );
    }
    for (label, obs) in [("before", &f.before_expand), ("after", &f.after_expand)] {
        if let Some(df) = &obs.df {
            let _ = writeln!(
                o,
                "guest df:   {label:<6} expansion  {} total, {} used, {} available",
                human_size(df.bytes.total as i64),
                human_size(df.bytes.used as i64),
                human_size(df.bytes.available as i64)
            );
        }
    }
    if let (Some(b), Some(a)) = (&f.before_expand.df, &f.after_expand.df) {
        let _ = writeln!(
            o,
            "expansion:  online, while the workload kept writing: {} -> {} ({})",
            human_size(b.bytes.total as i64),
            human_size(a.bytes.total as i64),
            if a.bytes.total > b.bytes.total {
                "larger"
            } else {
                "NOT larger"
            }
        );
    }
    for (label, obs) in [("before", &f.before_expand), ("after", &f.after_expand)] {
        if let Some(s) = &obs.stats {
            let b = s.bytes;
            let _ = writeln!(
                o,
                "CSI stats:  {label:<6} expansion  {} total, {} used, {} available; {} inodes used of {}; health {}",
                b.map(|b| human_size(b.total as i64))
                    .unwrap_or_else(|| "?".into()),
                b.map(|b| human_size(b.used as i64))
                    .unwrap_or_else(|| "?".into()),
                b.map(|b| human_size(b.available as i64))
                    .unwrap_or_else(|| "?".into()),
                s.inodes
                    .map(|i| i.used.to_string())
                    .unwrap_or_else(|| "?".into()),
                s.inodes
                    .map(|i| i.total.to_string())
                    .unwrap_or_else(|| "?".into()),
                s.health()
            );
        }
    }
    for (label, obs) in [("before", &f.before_expand), ("after", &f.after_expand)] {
        if let Some(h) = &obs.health {
            let _ = writeln!(
                o,
                "CSI health: {label:<6} expansion  {} (NodeGetVolumeHealth, CSI v1.13)",
                h.text()
            );
        }
    }
    if f.before_expand.stats.is_some() {
        let _ = writeln!(
            o,
            "            (NodeGetVolumeStats with defer_fs_ops: plugin -> crust-runtime crust stats -> guest agent)"
        );
    }
}

// ------------------------------------------------------------ the demo

struct Steps {
    progress: Progress,
    report: DemoReport,
}

impl Steps {
    fn record(&mut self, step: &str, t0: Instant, r: Result<String, String>) -> Result<(), ()> {
        let (ok, detail) = match &r {
            Ok(d) => (true, d.clone()),
            Err(e) => (false, e.clone()),
        };
        let s = StepReport {
            step: step.into(),
            ok,
            duration_ms: t0.elapsed().as_secs_f64() * 1000.0,
            detail: detail.clone(),
        };
        (self.progress)(&s);
        self.report.steps.push(s);
        if !ok {
            if self.report.failed_step.is_none() {
                self.report.failed_step = Some(step.into());
                self.report.error = Some(detail);
            }
            return Err(());
        }
        Ok(())
    }
}

/// The work dir's layout.
struct Layout {
    work: PathBuf,
    pool: PathBuf,
    state: PathBuf,
    crust: PathBuf,
    kata: PathBuf,
    runtime: PathBuf,
    socket: PathBuf,
    logs: PathBuf,
}

impl Layout {
    fn new(work: &Path) -> Layout {
        Layout {
            work: work.to_path_buf(),
            pool: work.join("pool"),
            state: work.join("state"),
            crust: work.join("handoff/crust"),
            kata: work.join("handoff/kata"),
            runtime: work.join("runtime"),
            socket: work.join("csi/csi.sock"),
            logs: work.join("logs"),
        }
    }
}

/// Runs the demo; see the module docs. Steps go to `progress` as they
/// happen. Teardown and the leftover check run whatever failed.
pub async fn run_demo(
    cfg: DemoConfig,
    progress: Progress,
    stop: watch::Receiver<bool>,
) -> DemoReport {
    let mut s = Steps {
        progress,
        report: DemoReport::default(),
    };
    let work = cfg
        .work_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("/var/tmp/crust-demo-{}", std::process::id())));

    // --- preflight and work dir ----------------------------------------
    let t0 = Instant::now();
    if !rustix::process::geteuid().is_root() {
        let _ = s.record(
            "preflight",
            t0,
            Err("the demo needs root (loop devices, mounts, QEMU): run it with sudo".into()),
        );
        return s.report;
    }
    let made_work = !work.exists();
    let r = prepare_work_dir(&work);
    let work = match r {
        Ok(w) => w,
        Err(e) => {
            let _ = s.record("work dir", t0, Err(e));
            return s.report;
        }
    };
    s.report.work_dir = work.display().to_string();
    let lay = Layout::new(&work);
    let _ = s.record(
        "work dir",
        t0,
        Ok(format!(
            "{} (pool, plugin state, hand-off roots, runtime root)",
            work.display()
        )),
    );

    // Everything below ends in the same teardown.
    let plugin = demo_body(&cfg, &lay, &mut s, stop).await;

    // --- plugin stop, leftovers, work dir --------------------------------
    let mut plugin = plugin;
    if let Some(p) = plugin.as_mut() {
        let t0 = Instant::now();
        let r = p.stop(Duration::from_secs(20)).await;
        s.report.plugin_stopped = r.is_ok();
        if s.report.failed_step.is_some() || r.is_err() {
            s.report.plugin_log_tail = Some(p.log_tail(2000));
        }
        let _ = s.record("stop crust-csi", t0, r);
    } else {
        s.report.plugin_stopped = true;
    }
    drop(plugin);

    let t0 = Instant::now();
    let mut left = find_leftovers(&lay.work, &lay.pool, &[&lay.crust, &lay.kata], &lay.runtime);
    // Volumes still listed were found while the plugin ran.
    left.volumes = std::mem::take(&mut s.report.leftovers.volumes);
    let r = if left.is_empty() {
        Ok(
            "no loop device on the pool, no mount under the work dir, no process of the demo, \
            no hand-off record, no sandbox, no volume"
                .to_string(),
        )
    } else {
        Err(format!("left behind: {}", left.all().join("; ")))
    };
    let clean = left.is_empty();
    s.report.leftovers = left;
    let _ = s.record("leftover check", t0, r);
    if !clean {
        sweep(&lay.work, &lay.pool);
    }

    if !cfg.keep {
        let t0 = Instant::now();
        let r = remove_work_dir(&lay, made_work);
        s.report.work_dir_removed = r.is_ok();
        let _ = s.record("remove work dir", t0, r);
    }
    s.report.ok = s.report.failed_step.is_none() && s.report.steps.iter().all(|x| x.ok);
    s.report
}

fn prepare_work_dir(work: &Path) -> Result<PathBuf, String> {
    if !work.is_absolute() {
        return Err(format!("--work-dir {}: must be absolute", work.display()));
    }
    if work.exists() {
        let mut rd = std::fs::read_dir(work).map_err(|e| format!("{}: {e}", work.display()))?;
        if rd.next().is_some() {
            return Err(format!(
                "{} is not empty; give an empty or new directory",
                work.display()
            ));
        }
    } else {
        std::fs::create_dir_all(work).map_err(|e| format!("create {}: {e}", work.display()))?;
    }
    std::fs::set_permissions(work, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("chmod {}: {e}", work.display()))?;
    let work = std::fs::canonicalize(work).map_err(|e| format!("{}: {e}", work.display()))?;
    for d in ["pool", "state", "handoff", "runtime", "csi", "logs"] {
        let p = work.join(d);
        std::fs::create_dir(&p).map_err(|e| format!("create {}: {e}", p.display()))?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("chmod {}: {e}", p.display()))?;
    }
    Ok(work)
}

/// Removes the work dir (or, if it existed before, its contents) —
/// refused while anything is still mounted beneath it.
fn remove_work_dir(lay: &Layout, made: bool) -> Result<String, String> {
    let mounted: Vec<PathBuf> = crust_blockdev::mount_info()
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(&lay.work))
        .collect();
    if !mounted.is_empty() {
        return Err(format!(
            "not removing {}: still mounted beneath it: {mounted:?}",
            lay.work.display()
        ));
    }
    if made {
        std::fs::remove_dir_all(&lay.work)
            .map_err(|e| format!("remove {}: {e}", lay.work.display()))?;
    } else {
        let rd = std::fs::read_dir(&lay.work).map_err(|e| e.to_string())?;
        for e in rd.flatten() {
            let p = e.path();
            let r = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            r.map_err(|e| format!("remove {}: {e}", p.display()))?;
        }
    }
    Ok(format!("{} removed", lay.work.display()))
}

/// Guest image, plugin, flow, workload. Returns the plugin (if started)
/// for the caller to stop.
async fn demo_body(
    cfg: &DemoConfig,
    lay: &Layout,
    s: &mut Steps,
    stop: watch::Receiver<bool>,
) -> Option<PluginProcess> {
    let (csi_bin, rt_bin) = find_binaries(cfg, s)?;
    let guest = guest_image(cfg, s).await?;
    let runtime = runtime_cli(cfg, lay, &rt_bin, &guest);
    let (plugin, csi) = match start_plugin(cfg, lay, &csi_bin, &rt_bin, &runtime, s).await {
        Ok(p) => p,
        Err(started) => return started,
    };
    // The pod, through the flow, and what the demo claims of it.
    let mut fc = FlowConfig::new(&lay.work, runtime.clone());
    fc.volume_name = "pvc-crust-demo".into();
    fc.sandbox_id = "crust-demo-pod".into();
    fc.size = cfg.size;
    fc.expand_to = Some(cfg.expand_to);
    fc.fs_type = cfg.fs_type.clone();
    fc.defer_via = DeferVia::Request;
    fc.workload = Workload {
        args: vec!["sh".into(), "-c".into(), DEMO_SCRIPT.into()],
        env: Vec::new(),
        cwd: "/".into(),
    };
    let mut flow = Flow::new(fc, csi.clone(), s.progress.clone()).with_stop(stop.clone());
    if flow.bring_up().await.is_ok() && flow.exercise().await.is_ok() {
        let t0 = Instant::now();
        let r = verify(flow.report());
        if s.record("verify", t0, r).is_ok() {
            workload_lines(cfg, &mut flow, s, &stop).await;
        }
    }
    flow.tear_down().await;
    let volume = flow.volume_id().map(str::to_string);
    let fr = flow.report().clone();
    if s.report.failed_step.is_none()
        && let (Some(st), Some(e)) = (&fr.failed_step, &fr.error)
    {
        s.report.failed_step = Some(st.clone());
        s.report.error = Some(e.clone());
    }
    s.report.flow = Some(fr);

    // The volume must be gone from the plugin too.
    if let Some(id) = volume
        && let Ok(list) = csi.list_all_volumes(0, String::new()).await
    {
        s.report.leftovers.volumes = list
            .entries
            .iter()
            .filter_map(|e| e.volume.as_ref())
            .filter(|v| v.volume_id == id)
            .map(|v| v.volume_id.clone())
            .collect();
    }
    Some(plugin)
}

/// crust-csi and crust-runtime: given, or next to crustctl.
fn find_binaries(cfg: &DemoConfig, s: &mut Steps) -> Option<(PathBuf, PathBuf)> {
    let t0 = Instant::now();
    let csi_bin = cfg.crust_csi.clone().or_else(|| sibling_bin("crust-csi"));
    let rt_bin = cfg
        .runtime_bin
        .clone()
        .or_else(|| sibling_bin("crust-runtime"));
    let (csi_bin, rt_bin) = match (csi_bin, rt_bin) {
        (Some(a), Some(b)) if a.is_file() && b.is_file() => (a, b),
        (a, b) => {
            let missing: Vec<&str> = [("crust-csi", a), ("crust-runtime", b)]
                .into_iter()
                .filter(|(_, p)| !p.as_ref().is_some_and(|p| p.is_file()))
                .map(|(n, _)| n)
                .collect();
            let _ = s.record(
                "binaries",
                t0,
                Err(format!(
                    "{} not found next to crustctl; build them with `cargo build --release --workspace --bins` \
                     (or pass --crust-csi / --runtime)",
                    missing.join(" and ")
                )),
            );
            return None;
        }
    };
    let rt_bin = std::fs::canonicalize(&rt_bin).unwrap_or(rt_bin);
    let _ = s.record(
        "binaries",
        t0,
        Ok(format!("{} and {}", csi_bin.display(), rt_bin.display())),
    );
    Some((csi_bin, rt_bin))
}

/// The guest image, built now when missing.
async fn guest_image(cfg: &DemoConfig, s: &mut Steps) -> Option<PathBuf> {
    let t0 = Instant::now();
    match ensure_guest_image(cfg.guest_dir.as_deref()).await {
        Ok((d, built)) => {
            let _ = s.record(
                "guest image",
                t0,
                Ok(format!(
                    "{}{}",
                    d.display(),
                    if built { " (built now)" } else { "" }
                )),
            );
            Some(d)
        }
        Err(e) => {
            let _ = s.record("guest image", t0, Err(e));
            None
        }
    }
}

/// The runtime CLI with every root inside the demo's work dir.
fn runtime_cli(cfg: &DemoConfig, lay: &Layout, rt_bin: &Path, guest: &Path) -> RuntimeCli {
    let mut runtime = RuntimeCli::new(rt_bin);
    runtime.root = Some(lay.runtime.clone());
    runtime.crust_root = Some(lay.crust.clone());
    runtime.kata_root = Some(lay.kata.clone());
    // Kata's CLI paths for the shim, inside the work dir like everything.
    runtime.kata_shim_dirs = Some(format!(
        "{},{}",
        lay.work.join("kata-shim/vc-sbs").display(),
        lay.work.join("kata-shim/kata").display()
    ));
    runtime.pods_layer_stop = Some(lay.work.join("kubelet/pods"));
    runtime.guest_kernel = Some(guest.join("vmlinuz"));
    runtime.guest_initrd = Some(guest.join("initramfs.cpio.gz"));
    runtime.accel = cfg.accel.clone();
    runtime
}

/// Starts crust-csi on the demo's pool and connects to it; on failure the
/// plugin, if it was started, is handed back for the caller to stop.
async fn start_plugin(
    cfg: &DemoConfig,
    lay: &Layout,
    csi_bin: &Path,
    rt_bin: &Path,
    runtime: &RuntimeCli,
    s: &mut Steps,
) -> Result<(PluginProcess, Csi), Option<PluginProcess>> {
    let t0 = Instant::now();
    let endpoint = format!("unix://{}", lay.socket.display());
    let args: Vec<OsString> = [
        "--endpoint".into(),
        OsString::from(&endpoint),
        "--node-id".into(),
        "crust-demo".into(),
        "--state-dir".into(),
        lay.state.clone().into(),
        "--backend".into(),
        "pool".into(),
        "--pool-dir".into(),
        lay.pool.clone().into(),
        "--pool-capacity".into(),
        cfg.pool_capacity.to_string().into(),
        "--deferral".into(),
        "enabled".into(),
        "--handoff-layout".into(),
        "crust".into(),
        "--crust-root".into(),
        lay.crust.clone().into(),
        "--kata-root".into(),
        lay.kata.clone().into(),
        "--kata-runtime".into(),
        rt_bin.into(),
        "--allowed-target-prefix".into(),
        lay.work.join("kubelet/pods").into(),
    ]
    .to_vec();
    let mut env = runtime.env();
    // Plain text in the log we may quote.
    env.push(("NO_COLOR", "1".into()));
    let mut plugin =
        match PluginProcess::spawn(csi_bin, &args, &env, &lay.logs.join("crust-csi.log")) {
            Ok(p) => p,
            Err(e) => {
                let _ = s.record(
                    "start crust-csi",
                    t0,
                    Err(format!("spawn {}: {e}", csi_bin.display())),
                );
                return Err(None);
            }
        };
    let ready = plugin
        .wait_ready(&lay.socket, Duration::from_secs(30))
        .await;
    let csi = match ready {
        Ok(()) => {
            let ep = crust_proto::endpoint::Endpoint::parse(&endpoint);
            match ep {
                Ok(ep) => Csi::connect(&ep, cfg.rpc_timeout)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
        Err(e) => Err(e),
    };
    let csi = match csi {
        Ok(c) => c,
        Err(e) => {
            s.report.plugin_log_tail = Some(plugin.log_tail(2000));
            let _ = s.record("start crust-csi", t0, Err(e));
            return Err(Some(plugin));
        }
    };
    let _ = s.record(
        "start crust-csi",
        t0,
        Ok(format!(
            "pid {}, {endpoint}, pool of {} in {}, deferral enabled (CRUST layout)",
            plugin.pid().unwrap_or_default(),
            human_size(cfg.pool_capacity as i64),
            lay.pool.display()
        )),
    );
    Ok((plugin, csi))
}

/// What the demo claims: the guest saw the filesystem grow online, the
/// plugin's deferred stats are the guest's figures, the volume is healthy.
fn verify(r: &FlowReport) -> Result<String, String> {
    let (Some(b), Some(a)) = (&r.before_expand.df, &r.after_expand.df) else {
        return Err("no guest df before and after the expansion".into());
    };
    if a.bytes.total <= b.bytes.total {
        return Err(format!(
            "the guest's filesystem did not grow: {} -> {} (is --expand-to above the volume's size?)",
            human_size(b.bytes.total as i64),
            human_size(a.bytes.total as i64)
        ));
    }
    for (label, o) in [("before", &r.before_expand), ("after", &r.after_expand)] {
        let (Some(df), Some(st)) = (&o.df, &o.stats) else {
            return Err(format!("no stats {label} the expansion"));
        };
        // The workload keeps writing, so only the totals must agree.
        if st.bytes.map(|x| x.total) != Some(df.bytes.total)
            || st.inodes.map(|x| x.total) != Some(df.inodes.total)
        {
            return Err(format!(
                "NodeGetVolumeStats {label} the expansion ({:?}, {:?}) differs from the guest's df ({:?}, {:?})",
                st.bytes, st.inodes, df.bytes, df.inodes
            ));
        }
        if st.abnormal != Some(false) {
            return Err(format!(
                "volume health {label} the expansion: {}",
                st.health()
            ));
        }
        match &o.health {
            Some(h) if h.entries.is_empty() => {}
            Some(h) => {
                return Err(format!(
                    "NodeGetVolumeHealth {label} the expansion: {}",
                    h.text()
                ));
            }
            None => {
                return Err(format!(
                    "no NodeGetVolumeHealth answer {label} the expansion"
                ));
            }
        }
    }
    Ok(format!(
        "guest df grew {} -> {}; CSI stats totals = guest df; health normal (v1.12 condition and v1.13 NodeGetVolumeHealth)",
        human_size(b.bytes.total as i64),
        human_size(a.bytes.total as i64)
    ))
}

/// Waits until the workload wrote `min_lines` lines, then reads them.
async fn workload_lines(
    cfg: &DemoConfig,
    flow: &mut Flow,
    s: &mut Steps,
    stop: &watch::Receiver<bool>,
) {
    let Some(id) = flow.sandbox().map(str::to_string) else {
        return;
    };
    let rt = flow.runtime().clone();
    let t0 = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(90);
    let r: Result<String, String> = loop {
        if *stop.borrow() {
            break Err("interrupted".into());
        }
        match rt.sh(&id, "cat /data/out.txt 2>/dev/null || true").await {
            Ok(out) => {
                let lines: Vec<&str> = out.lines().collect();
                if lines.len() >= cfg.min_lines {
                    s.report.lines_written = Some(lines.len());
                    s.report.first_line = lines.first().map(|l| l.to_string());
                    s.report.last_line = lines.last().map(|l| l.to_string());
                    break Ok(format!(
                        "{} lines in /data/out.txt, last: {}",
                        lines.len(),
                        lines.last().unwrap_or(&"")
                    ));
                }
                if Instant::now() > deadline {
                    break Err(format!(
                        "only {} lines in /data/out.txt after 90s",
                        lines.len()
                    ));
                }
            }
            Err(e) => break Err(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let _ = s.record("workload output", t0, r);
}
