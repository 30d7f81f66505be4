//! `crustctl bench --guest-io`: in-guest I/O on a direct-assigned block
//! volume against the same kind of volume shared over virtio-fs, in one
//! guest, with fio.
//!
//! Two volumes of the same size and filesystem come from the same CSI
//! driver, both through [`crate::flow`] (kubelet's calls):
//!
//! - **block**: published with deferral; crust's runtime hot-plugs the
//!   device (virtio-blk) and the guest mounts it at `/data`;
//! - **virtio-fs**: published on the host (no deferral, `deferFsOps=false`
//!   so no runtime can take it over) and bound into the same sandbox at
//!   `/data-virtiofs`; the runtime (`--share-binds`) shares it through
//!   virtiofsd with exactly the containerd shim's settings
//!   ([`crust_vmm::VIRTIOFSD_ARGS`]).
//!
//! The sandbox runs the bench guest image (`guest/build-image.sh --bench`:
//! fio and `crust-guest-bench`). Every workload runs on both mounts back to
//! back, repeated and interleaved (block, virtio-fs, block, …); dirty data
//! is written back in the guest and on the host before each run, and read
//! workloads start from cold caches (guest and host page caches dropped).
//! Host CPU is QEMU's plus virtiofsd's `utime + stime` from `/proc` over
//! each run. Each fio workload also runs in two host columns between the
//! guest's runs ([`baseline`]): the same fio job on the host and
//! `qemu-img bench`, beside the block volume's backing file. Then every
//! native-feature probe runs on both mounts, and the guest's statfs of
//! each is compared with NodeGetVolumeStats. [`chart`] draws the
//! comparison.
//!
//! The CSI part is driver-agnostic (standard calls through the flow); the
//! sandbox needs crust's runtime.

pub mod baseline;
pub mod chart;
pub mod host;
pub mod report;
pub mod workload;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crust_proto::csi::v1 as csi;
use serde_json::Value;
use tokio::sync::watch;

use super::{BenchError, CleanupReport};
use crust_csi_client::Csi;
use crust_kubesim::flow::{
    DeferVia, Flow, FlowConfig, MOUNT_DESTINATION, Progress, StepReport, Workload as PodWorkload,
};
use crust_kubesim::runtime_cli::RuntimeCli;
use crust_report::units::{parse_duration, parse_size};
use report::{
    CpuSplit, FeatureRow, GuestIoReport, MountReport, Outcome, Run, Side, WorkloadResult,
};
use workload::{HELPER, Measured, Sizes, Workload};

/// Where the virtio-fs volume appears in the guest.
pub const VIRTIOFS_DESTINATION: &str = "/data-virtiofs";
/// The bench's directory on each mount.
const BENCH_DIR: &str = "crust-bench";
/// Slack on top of each guest command's own bound.
const EXEC_SLACK: Duration = Duration::from_secs(30);
/// Consecutive failed runs after which the measurement stops.
const MAX_CONSECUTIVE_FAILURES: u32 = 3;

/// The flags of `bench --guest-io` (flattened into `bench`'s).
#[derive(Debug, Clone, clap::Args)]
pub struct GuestIoArgs {
    /// Guest I/O mode: one sandbox of crust's runtime with two volumes of
    /// the same size and filesystem — one deferred (virtio-blk, mounted in
    /// the guest), one published on the host and shared over virtio-fs —
    /// and fio workloads, metadata workloads and native-feature probes on
    /// both, interleaved. Needs the bench guest image
    /// (`guest/build-image.sh --bench`).
    #[arg(
        long,
        conflicts_with_all = ["deferred", "scenarios", "stats_volumes", "defer_fs_ops", "staging_dir", "target_dir", "duration", "ops"]
    )]
    pub guest_io: bool,
    /// Guest I/O: repetitions of every workload on each mount.
    #[arg(long, default_value_t = 3, requires = "guest_io", value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Guest I/O: the CI form (16 MiB random file, 32 MiB sequential
    /// file, 1 s runs, 200 files, a 2,000-entry tree); the flags below
    /// override single sizes.
    #[arg(long, requires = "guest_io")]
    pub short: bool,
    /// Guest I/O: length of each random fio run [default: 15s].
    #[arg(long, value_parser = parse_duration, requires = "guest_io")]
    pub io_runtime: Option<Duration>,
    /// Guest I/O: file of the random workloads [default: 256Mi].
    #[arg(long, value_parser = parse_size, requires = "guest_io")]
    pub rand_file_size: Option<u64>,
    /// Guest I/O: file of the sequential workloads [default: 512Mi].
    #[arg(long, value_parser = parse_size, requires = "guest_io")]
    pub seq_file_size: Option<u64>,
    /// Guest I/O: files created, fsynced, stat'ed and unlinked [default: 10000].
    #[arg(long, requires = "guest_io", value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub meta_files: Option<u32>,
    /// Guest I/O: entries of the walked tree [default: 50000].
    #[arg(long, requires = "guest_io", value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub walk_entries: Option<u32>,
    /// Guest I/O: fio queue depths.
    #[arg(long, value_delimiter = ',', default_value = "1,16", requires = "guest_io", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub queue_depths: Vec<u32>,
    /// Guest I/O: guest memory (the bench image's initramfs takes ~100 MiB).
    #[arg(long, value_parser = parse_size, default_value = "1Gi", requires = "guest_io")]
    pub guest_memory: u64,
    /// Guest I/O: guest vCPUs.
    #[arg(long, default_value_t = 2, requires = "guest_io", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub guest_cpus: u32,
    /// Guest I/O: size of each volume [default: what the workloads need
    /// plus a quarter, at least 1Gi (256Mi with --short)].
    #[arg(long, value_parser = parse_size, requires = "guest_io")]
    pub volume_size: Option<u64>,
    /// Guest I/O: do not drop the host's page cache before cold runs (it
    /// is machine-wide); reads may then be served from the host's cache.
    #[arg(long, requires = "guest_io")]
    pub keep_host_caches: bool,
    /// Guest I/O: run the host columns (host fio, qemu-img bench) in this
    /// directory instead of beside the block volume's backing file (for
    /// drivers whose volumes are not loop devices).
    #[arg(long, requires = "guest_io", conflicts_with = "no_host_columns")]
    pub host_dir: Option<PathBuf>,
    /// Guest I/O: no host columns (they need fio and qemu-img on the host).
    #[arg(long, requires = "guest_io")]
    pub no_host_columns: bool,
    /// Guest I/O: also draw the comparison as an SVG chart into FILE.
    #[arg(long, value_name = "FILE", requires = "guest_io")]
    pub chart: Option<PathBuf>,
}

/// What `bench --guest-io` does.
#[derive(Debug, Clone)]
pub struct GuestIoConfig {
    /// kubelet's root and the bundles live here.
    pub work_dir: PathBuf,
    /// The runtime; [`GuestIoConfig::block_flow`] turns on its bind
    /// sharing and sets the guest's memory and vCPUs.
    pub runtime: RuntimeCli,
    /// Names of both volumes and the sandbox.
    pub run_id: String,
    pub volume_size: u64,
    pub fs_type: String,
    pub mount_flags: Vec<String>,
    /// CreateVolume parameters of both volumes.
    pub params: HashMap<String, String>,
    pub repeat: u32,
    pub sizes: Sizes,
    pub queue_depths: Vec<u32>,
    pub guest_memory_mib: u32,
    pub guest_cpus: u32,
    pub drop_host_caches: bool,
    /// Run the host columns ([`baseline`]).
    pub host_columns: bool,
    /// Where; `None`: beside the block volume's backing file.
    pub host_dir: Option<PathBuf>,
    /// The pod both volumes belong to.
    pub pod_uid: String,
}

impl GuestIoConfig {
    /// The long form's defaults.
    pub fn new(work_dir: impl Into<PathBuf>, runtime: RuntimeCli, run_id: &str) -> GuestIoConfig {
        let sizes = Sizes::long();
        GuestIoConfig {
            work_dir: work_dir.into(),
            runtime,
            run_id: run_id.to_string(),
            volume_size: default_volume_size(&sizes, false),
            fs_type: "ext4".into(),
            mount_flags: Vec::new(),
            params: HashMap::new(),
            repeat: 3,
            sizes,
            queue_depths: vec![1, 16],
            guest_memory_mib: 1024,
            guest_cpus: 2,
            drop_host_caches: true,
            host_columns: true,
            host_dir: None,
            pod_uid: crust_kubesim::flow::random_uuid(),
        }
    }

    /// Applies the command line's guest-io flags.
    pub fn apply(&mut self, a: &GuestIoArgs) -> Result<(), String> {
        let mut s = if a.short {
            Sizes::short()
        } else {
            Sizes::long()
        };
        if let Some(d) = a.io_runtime {
            s.runtime = d;
        }
        if let Some(v) = a.rand_file_size {
            s.rand_file = v;
        }
        if let Some(v) = a.seq_file_size {
            s.seq_file = v;
        }
        if let Some(v) = a.meta_files {
            s.meta_files = v;
        }
        if let Some(v) = a.walk_entries {
            s.walk_entries = v;
        }
        if s.rand_file < 1 << 20 || s.seq_file < 1 << 20 {
            return Err("--rand-file-size and --seq-file-size must be at least 1Mi".into());
        }
        self.sizes = s;
        self.repeat = a.repeat;
        let mut qd = Vec::new();
        for q in &a.queue_depths {
            if !qd.contains(q) {
                qd.push(*q);
            }
        }
        self.queue_depths = qd;
        self.guest_memory_mib = (a.guest_memory >> 20) as u32;
        if self.guest_memory_mib < 512 {
            return Err(
                "--guest-memory must be at least 512Mi (the bench image alone takes ~100Mi)".into(),
            );
        }
        self.guest_cpus = a.guest_cpus;
        self.volume_size = a
            .volume_size
            .unwrap_or_else(|| default_volume_size(&s, a.short));
        if self.volume_size < s.footprint() {
            return Err(format!(
                "--volume-size {} is smaller than the workloads' {} bytes",
                self.volume_size,
                s.footprint()
            ));
        }
        self.drop_host_caches = !a.keep_host_caches;
        self.host_columns = !a.no_host_columns;
        self.host_dir = a.host_dir.clone();
        Ok(())
    }

    /// The flow of the block volume: deferred, the pod's sandbox holding
    /// it, the virtio-fs volume's target bound at
    /// [`VIRTIOFS_DESTINATION`] (shared by the runtime).
    pub fn block_flow(&self, virtiofs_target: &str) -> FlowConfig {
        let mut rt = self.runtime.clone();
        rt.share_binds = true;
        rt.memory_mib = Some(self.guest_memory_mib);
        rt.cpus = Some(self.guest_cpus);
        let mut f = self.flow(rt, "blk");
        f.defer_via = DeferVia::Request;
        f.sandbox_id = self.run_id.clone();
        f.workload = PodWorkload {
            args: vec![
                "sh".into(),
                "-c".into(),
                "trap 'exit 0' TERM; while true; do sleep 1; done".into(),
            ],
            ..PodWorkload::default()
        };
        f.extra_mounts = vec![(VIRTIOFS_DESTINATION.into(), virtiofs_target.into())];
        f
    }

    /// The flow of the virtio-fs volume: published on the host only.
    pub fn virtiofs_flow(&self) -> FlowConfig {
        let mut f = self.flow(self.runtime.clone(), "vfs");
        f.defer_via = DeferVia::None;
        // crust-csi: never deferred or handed over to a runtime.
        f.params
            .insert(crust_kubesim::flow::DEFER_PARAM.into(), "false".into());
        f
    }

    fn flow(&self, rt: RuntimeCli, suffix: &str) -> FlowConfig {
        let mut f = FlowConfig::new(&self.work_dir, rt);
        // Both volumes belong to one pod.
        f.pod_uid = self.pod_uid.clone();
        f.volume_name = format!("{}-{suffix}", self.run_id);
        f.size = self.volume_size;
        f.expand_to = None;
        f.fs_type = self.fs_type.clone();
        f.mount_flags = self.mount_flags.clone();
        f.params = self.params.clone();
        f
    }
}

/// What the workloads need plus a quarter, rounded up to 256 MiB; at
/// least 1 GiB (256 MiB for the short form).
pub fn default_volume_size(s: &Sizes, short: bool) -> u64 {
    let q = 256u64 << 20;
    let want = (s.footprint() + s.footprint() / 4).div_ceil(q) * q;
    want.max(if short { q } else { 4 * q })
}

/// Runs commands in the sandbox's guest.
struct Guest {
    rt: RuntimeCli,
    id: String,
    /// Ctrl-C/SIGTERM: the running command is abandoned (the runtime CLI
    /// child is killed) so teardown starts at once.
    stop: watch::Receiver<bool>,
}

/// The error of a guest command cut short by an interruption.
const INTERRUPTED: &str = "interrupted";

impl Guest {
    /// `args` in the guest, bounded by `limit`; stdout when it exits 0.
    async fn run(&self, args: &[String], limit: Duration) -> Result<String, String> {
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

    async fn sh(&self, script: &str, limit: Duration) -> Result<String, String> {
        self.run(&["sh".into(), "-c".into(), script.into()], limit)
            .await
    }
}

/// Guest side and host side of the two mounts while the sandbox runs.
struct Bench<'a> {
    guest: Guest,
    cfg: &'a GuestIoConfig,
    /// QEMU and the share's virtiofsd.
    pids: Vec<i32>,
    /// The host columns, when they run.
    host: Option<baseline::HostSide>,
    progress: Progress,
    stop: watch::Receiver<bool>,
}

/// The bench directory of a guest mount.
fn dir_of(side: Side) -> String {
    match side {
        Side::Block => format!("{MOUNT_DESTINATION}/{BENCH_DIR}"),
        Side::Virtiofs => format!("{VIRTIOFS_DESTINATION}/{BENCH_DIR}"),
        Side::HostFio | Side::QemuImg => unreachable!("a host column has no guest directory"),
    }
}

/// Bound of one guest command working on `bytes` (TCG guests are slow:
/// 1 MiB/s at the worst, plus a minute).
fn bound(bytes: u64, runtime: Duration) -> Duration {
    Duration::from_secs(60 + bytes / (1 << 20)) + runtime
}

impl Bench<'_> {
    fn step(&self, step: String, t0: Instant, r: &Result<String, String>) {
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
    async fn settle(&self, cold: bool) -> Result<(), String> {
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
    async fn settle_host(&self, cold: bool) -> Result<(), String> {
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
    async fn prepare(&self, side: Side) -> Result<String, String> {
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
    async fn run_one(
        &self,
        w: &Workload,
        side: Side,
        rep: u32,
        host_rate: Option<f64>,
    ) -> Result<Run, String> {
        // The host columns read with O_DIRECT (host fio; qemu-img on a
        // direct-I/O loop device): no page cache to drop unless the
        // kernel refused the loop device direct I/O.
        match side {
            Side::Block | Side::Virtiofs => self.settle(w.cold()).await?,
            Side::HostFio => self.settle_host(false).await?,
            Side::QemuImg => {
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
            (Side::QemuImg, Some(h)) => {
                let s = &self.cfg.sizes;
                let bytes = h.scratch.device_bytes;
                let count = baseline::request_count(w, s, bytes, host_rate);
                let dev = h.scratch.device_path.display().to_string();
                let cmd = baseline::qemu_img_command(w, &dev, bytes, &h.aio, count);
                let limit = bound(count * baseline::block_size(w), s.runtime);
                let (out, cpu) = baseline::run_host(&cmd, limit, &self.stop).await?;
                (baseline::parse_qemu_img(w, count, &out)?, cpu)
            }
            (Side::HostFio | Side::QemuImg, None) => return Err("no host columns".into()),
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
    async fn run_guest(&self, w: &Workload, side: Side) -> Result<(Measured, f64), String> {
        let s = &self.cfg.sizes;
        let limit = match w.kind {
            workload::Kind::Meta => bound(
                s.meta_files as u64 * 4096,
                Duration::from_secs(s.meta_files as u64 / 5),
            ),
            workload::Kind::Walk => bound(
                s.walk_entries as u64 * 512,
                Duration::from_secs(s.walk_entries as u64 / 100),
            ),
            _ => bound(s.rand_file.max(s.seq_file), s.runtime),
        };
        let cpu0 = host::total_cpu(&self.pids);
        let out = self.guest.run(&w.command(&dir_of(side), s), limit).await?;
        let cpu = host::total_cpu(&self.pids) - cpu0;
        Ok((workload::parse(w, &out)?, cpu.max(0.0)))
    }

    /// Where `w` runs: both mounts, then the host columns of a fio
    /// workload.
    fn sides(&self, w: &Workload) -> Vec<Side> {
        let mut v = vec![Side::Block, Side::Virtiofs];
        if self.host.is_some() && w.is_fio() {
            v.extend([Side::HostFio, Side::QemuImg]);
        }
        v
    }

    /// Every workload, `repeat` times, block and virtio-fs back to back.
    async fn measure(&self, errors: &mut Vec<String>) -> Vec<WorkloadResult> {
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
    async fn features(&self, side: Side) -> Result<Vec<(String, String, Outcome)>, String> {
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
    async fn statfs(&self, side: Side) -> Result<Value, String> {
        let mount = match side {
            Side::Block => MOUNT_DESTINATION,
            Side::Virtiofs => VIRTIOFS_DESTINATION,
            Side::HostFio | Side::QemuImg => unreachable!("a host column has no guest mount"),
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

/// The guest's statfs of a mount against NodeGetVolumeStats of its volume
/// (taken between two guest readings, the volume idle).
async fn statfs_vs_csi(bench: &Bench<'_>, side: Side, flow: &Flow) -> Outcome {
    let fail = |detail: String| Outcome {
        works: false,
        detail,
    };
    let before = match bench.statfs(side).await {
        Ok(v) => v,
        Err(e) => return fail(e),
    };
    let stats = match flow.stats().await {
        Ok(s) => s,
        Err(s) => {
            return fail(format!(
                "NodeGetVolumeStats: {:?}: {}",
                s.code(),
                s.message()
            ));
        }
    };
    let after = bench.statfs(side).await.unwrap_or(Value::Null);
    let usage = |unit: csi::volume_usage::Unit| {
        stats
            .usage
            .iter()
            .find(|u| u.unit == unit as i32)
            .map(|u| (u.total as u64, u.used as u64, u.available as u64))
    };
    let (Some(b), Some(i)) = (
        usage(csi::volume_usage::Unit::Bytes),
        usage(csi::volume_usage::Unit::Inodes),
    ) else {
        return fail(format!(
            "NodeGetVolumeStats has no bytes or inodes usage: {stats:?}"
        ));
    };
    let guest = |v: &Value| {
        let n = |k: &str| v[k].as_u64().unwrap_or(u64::MAX);
        (
            (n("bytes_total"), n("bytes_used"), n("bytes_available")),
            (n("inodes_total"), n("inodes_used"), n("inodes_available")),
        )
    };
    if guest(&before) == (b, i) || guest(&after) == (b, i) {
        Outcome {
            works: true,
            detail: format!(
                "bytes total/used/available {}/{}/{}, inodes {}/{}/{}",
                b.0, b.1, b.2, i.0, i.1, i.2
            ),
        }
    } else {
        fail(format!(
            "CSI says bytes {b:?} inodes {i:?}, the guest's statfs {:?}",
            guest(&before)
        ))
    }
}

/// What the report says of each volume: where it is, how the guest sees it.
fn describe_mounts(rep: &mut GuestIoReport, blk: &Flow, vfs: &Flow, vfs_target: &str, seen: &Seen) {
    let volume = |f: &Flow, dest: &str, path: String, guest: &(String, String)| MountReport {
        destination: dest.into(),
        volume_id: f.volume_id().unwrap_or_default().to_string(),
        capacity_bytes: f
            .report()
            .volume
            .as_ref()
            .map(|v| v.capacity_bytes)
            .unwrap_or(0),
        fs_type: f
            .report()
            .volume
            .as_ref()
            .map(|v| v.fs_type.clone())
            .unwrap_or_default(),
        path,
        guest_source: guest.0.clone(),
        guest_fs_type: guest.1.clone(),
        host_target: f.target_path().to_string(),
        host_sees_bench_files: false,
    };
    rep.block = volume(
        blk,
        MOUNT_DESTINATION,
        format!(
            "virtio-blk {}, {}, mounted in the guest (deferred publish)",
            seen.block.0, seen.block.1
        ),
        &seen.block,
    );
    rep.virtiofs = volume(
        vfs,
        VIRTIOFS_DESTINATION,
        format!(
            "host mount {} shared by virtiofsd {} (the containerd shim's settings)",
            vfs_target,
            rep.virtiofsd_args.join(" ")
        ),
        &seen.virtiofs,
    );
}

/// Sets up, measures, tears down. `Err` only when the run could not start
/// (bad config, set-up failure — already torn down).
pub async fn run_guest_io(
    csi: &Csi,
    cfg: GuestIoConfig,
    progress: Progress,
    stop: watch::Receiver<bool>,
) -> Result<GuestIoReport, BenchError> {
    if cfg.queue_depths.is_empty() {
        return Err(BenchError::Config("no queue depth".into()));
    }
    let t_all = Instant::now();
    let info = csi
        .get_plugin_info(Default::default())
        .await
        .map_err(|status| BenchError::Discovery {
            rpc: "GetPluginInfo",
            status,
        })?;
    let mut rep = GuestIoReport {
        driver: info.name,
        vendor_version: info.vendor_version,
        run_id: cfg.run_id.clone(),
        guest_memory_mib: cfg.guest_memory_mib,
        guest_cpus: cfg.guest_cpus,
        guest_initrd: cfg
            .runtime
            .guest_initrd
            .as_ref()
            .map(|p| p.display().to_string()),
        virtiofsd_args: crust_vmm_args(),
        repeat: cfg.repeat,
        queue_depths: cfg.queue_depths.clone(),
        sizes: Some(cfg.sizes),
        host_caches_dropped: cfg.drop_host_caches && host::can_drop_caches(),
        ..Default::default()
    };
    if cfg.drop_host_caches && !host::can_drop_caches() {
        return Err(BenchError::Config(
            "dropping the host's page cache needs root (or pass --keep-host-caches)".into(),
        ));
    }

    // --- set-up: the virtio-fs volume, then the pod with both ----------------
    // From here on `pods` undoes what was set up, also on a panic.
    let mut pods = Pods {
        vfs: Flow::new(cfg.virtiofs_flow(), csi.clone(), progress.clone()).with_stop(stop.clone()),
        blk: None,
    };
    if let Err(e) = pods.vfs.bring_up().await {
        pods.tear_down().await;
        return Err(BenchError::Setup(e.to_string()));
    }
    let vfs_target = pods.vfs.target_path().to_string();
    let blk_flow = Flow::new(cfg.block_flow(&vfs_target), csi.clone(), progress.clone())
        .with_stop(stop.clone());
    let blk = pods.blk.insert(blk_flow);
    let up = blk.bring_up().await.map_err(|e| e.to_string());
    let checked = match up {
        Ok(()) => check_sandbox(blk, &cfg, stop.clone()).await,
        Err(e) => Err(e),
    };
    let (guest, pids, seen) = match checked {
        Ok(v) => v,
        Err(e) => {
            pods.tear_down().await;
            return Err(BenchError::Setup(e));
        }
    };
    let (blk, vfs) = (pods.blk.as_ref().expect("set up above"), &pods.vfs);
    describe_mounts(&mut rep, blk, vfs, &vfs_target, &seen);
    rep.accel = blk.report().accel.clone();
    rep.accel_reason = blk.report().accel_reason.clone();

    let host = host_columns(&cfg, &seen.block_device, &progress, &stop, &mut rep).await;
    let bench = Bench {
        guest,
        cfg: &cfg,
        pids,
        host,
        progress: progress.clone(),
        stop: stop.clone(),
    };
    // --- prepare, measure, features --------------------------------------------
    let mut prepared = true;
    for side in [Side::Block, Side::Virtiofs] {
        if *stop.borrow() {
            break;
        }
        let t0 = Instant::now();
        let r = bench.prepare(side).await;
        bench.step(format!("prepare {}", side.name()), t0, &r);
        match r {
            Ok(n) => rep.notes.push(format!("{}: {n}", side.name())),
            Err(_) if *stop.borrow() => prepared = false,
            Err(e) => {
                rep.errors.push(format!("preparing {}: {e}", side.name()));
                prepared = false;
            }
        }
    }
    // Where the bytes land: the host sees the virtio-fs volume's files
    // through its host mount, and nothing of the block volume (not
    // mounted on the host at all).
    for (m, f) in [(&mut rep.block, blk), (&mut rep.virtiofs, vfs)] {
        m.host_sees_bench_files = std::path::Path::new(f.target_path())
            .join(BENCH_DIR)
            .join("seq.dat")
            .is_file();
    }
    if prepared {
        rep.workloads = bench.measure(&mut rep.errors).await;
        rep.cpu_split = CpuSplit::of(&rep.workloads);
    }
    if !*stop.borrow() {
        let t0 = Instant::now();
        let r = feature_table(&bench, blk, vfs).await;
        bench.step(
            "features".into(),
            t0,
            &r.as_ref()
                .map(|f| format!("{} features", f.len()))
                .map_err(Clone::clone),
        );
        match r {
            Ok(f) => rep.features = f,
            Err(_) if *stop.borrow() => {}
            Err(e) => rep.errors.push(format!("feature probes: {e}")),
        }
    }

    // --- teardown: the pod first (it holds the share of the other) -------------
    drop(bench);
    let mut cleanup = CleanupReport::default();
    for f in pods.in_teardown_order() {
        let before = f.report().steps.len();
        f.tear_down().await;
        for s in &f.report().steps[before..] {
            if !s.ok {
                cleanup.leftovers.push(format!("{}: {}", s.step, s.detail));
                continue;
            }
            match s.step.as_str() {
                "NodeUnpublishVolume" => cleanup.node_unpublished += 1,
                "NodeUnstageVolume" => cleanup.node_unstaged += 1,
                "DeleteVolume" => cleanup.volumes_deleted += 1,
                _ => {}
            }
        }
        // The host-only flow's own remark would read as a problem here.
        rep.notes.extend(
            f.report()
                .notes
                .iter()
                .filter(|n| !n.starts_with("no deferral:"))
                .cloned(),
        );
    }
    rep.cleanup = cleanup;
    rep.interrupted = *stop.borrow();
    rep.elapsed_secs = t_all.elapsed().as_secs_f64();
    Ok(rep)
}

/// Sets up the host columns ([`baseline`]) beside the block volume's
/// backing file (or in `--host-dir`); a failure is an error of the run,
/// which goes on without them.
async fn host_columns(
    cfg: &GuestIoConfig,
    block_device: &str,
    progress: &Progress,
    stop: &watch::Receiver<bool>,
    rep: &mut GuestIoReport,
) -> Option<baseline::HostSide> {
    if !cfg.host_columns || *stop.borrow() {
        return None;
    }
    let t0 = Instant::now();
    let backing = baseline::backing_file(std::path::Path::new(block_device));
    let parent = match (&cfg.host_dir, &backing) {
        (Some(d), _) => Ok(d.clone()),
        (None, Ok(b)) => b
            .parent()
            .map(std::path::Path::to_path_buf)
            .ok_or_else(|| format!("{} has no directory", b.display())),
        (None, Err(e)) => Err(e.clone()),
    };
    let shown = backing
        .map(|b| b.display().to_string())
        .unwrap_or_else(|_| block_device.to_string());
    let r = match parent {
        Ok(p) => baseline::HostSide::set_up(&p, shown, &cfg.run_id, &cfg.sizes, stop).await,
        Err(e) => Err(e),
    };
    (progress)(&StepReport {
        step: "host columns".into(),
        ok: r.is_ok(),
        duration_ms: t0.elapsed().as_secs_f64() * 1000.0,
        detail: match &r {
            Ok(h) => format!(
                "fio in {}, qemu-img -i {} on {}",
                h.fio_dir,
                h.aio,
                h.scratch.device_path.display()
            ),
            Err(e) => e.clone(),
        },
    });
    match r {
        Ok(h) => {
            rep.host = Some(h.report.clone());
            Some(h)
        }
        Err(_) if *stop.borrow() => None,
        Err(e) => {
            rep.errors.push(format!("host columns: {e}"));
            None
        }
    }
}

/// The two flows of the bench. [`Pods::tear_down`] undoes them in order
/// (the pod first: it holds the share of the other volume's target); when
/// a panic or a dropped future skipped that, `Drop` does it.
struct Pods {
    vfs: Flow,
    blk: Option<Flow>,
}

impl Pods {
    fn in_teardown_order(&mut self) -> impl Iterator<Item = &mut Flow> {
        self.blk.iter_mut().chain(std::iter::once(&mut self.vfs))
    }

    async fn tear_down(&mut self) {
        for f in self.in_teardown_order() {
            f.tear_down().await;
        }
    }
}

impl Drop for Pods {
    fn drop(&mut self) {
        if !self.in_teardown_order().any(|f| f.holds_resources()) {
            return;
        }
        // block_in_place needs a multi-thread runtime (crustctl's is one).
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                crust_report::say("bench --guest-io: stopped unexpectedly, tearing down");
                tokio::task::block_in_place(|| h.block_on(self.tear_down()));
            }
            _ => crust_report::say(
                "bench --guest-io: dropped outside a multi-thread tokio runtime: \
                 the sandbox and volumes of this run are left behind",
            ),
        }
    }
}

fn crust_vmm_args() -> Vec<String> {
    crust_vmm::VIRTIOFSD_ARGS
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// What the guest's /proc/mounts says of each mount: (source, fs type).
struct Seen {
    block: (String, String),
    virtiofs: (String, String),
    /// The block volume's device on the host (the runtime's state).
    block_device: String,
}

/// Both mounts are where they should be in the guest and the bench tools
/// are there. Returns the guest, the pids whose CPU is counted, and what
/// the guest's /proc/mounts shows.
async fn check_sandbox(
    blk: &Flow,
    cfg: &GuestIoConfig,
    stop: watch::Receiver<bool>,
) -> Result<(Guest, Vec<i32>, Seen), String> {
    let id = blk.sandbox().ok_or("no sandbox runs")?.to_string();
    let rt = blk.runtime().clone();
    let st = rt.json(&["state", &id]).await.map_err(|e| e.to_string())?;
    let shared = st["sharedMounts"]
        .as_array()
        .is_some_and(|m| m.iter().any(|m| m["destination"] == VIRTIOFS_DESTINATION));
    if !shared {
        return Err(format!(
            "the runtime did not share {VIRTIOFS_DESTINATION} over virtio-fs (state: {st}); \
             crust-runtime needs --share-binds support"
        ));
    }
    if st["volumes"].as_array().map(Vec::len) != Some(1) {
        return Err(format!(
            "the sandbox should hold exactly the block volume: {}",
            st["volumes"]
        ));
    }
    let block_device = st["volumes"][0]["device"]
        .as_str()
        .ok_or("no device of the block volume in the sandbox state")?
        .to_string();
    let qemu = st["qemu"]["pid"]
        .as_i64()
        .ok_or("no QEMU pid in the sandbox state")? as i32;
    let shim = st["shim"]["pid"]
        .as_i64()
        .ok_or("no shim pid in the sandbox state")? as i32;
    let mut pids = vec![qemu];
    pids.extend(host::virtiofsd_pids(shim));
    if pids.len() < 2 {
        return Err(format!(
            "no virtiofsd found below the sandbox's shim (pid {shim})"
        ));
    }
    let guest = Guest { rt, id, stop };
    let mounts = guest
        .sh("cat /proc/mounts", Duration::from_secs(60))
        .await?;
    let find = |dest: &str| {
        mounts.lines().find_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() > 2 && f[1] == dest).then(|| (f[0].to_string(), f[2].to_string()))
        })
    };
    let block = match find(MOUNT_DESTINATION) {
        Some((dev, fs)) if dev.starts_with("/dev/vd") && fs == cfg.fs_type => (dev, fs),
        other => {
            return Err(format!(
                "{MOUNT_DESTINATION} in the guest is {other:?}, not a {} virtio-blk disk",
                cfg.fs_type
            ));
        }
    };
    let virtiofs = match find(VIRTIOFS_DESTINATION) {
        Some((tag, fs)) if fs == "virtiofs" => (tag, fs),
        other => {
            return Err(format!(
                "{VIRTIOFS_DESTINATION} in the guest is {other:?}, not virtio-fs"
            ));
        }
    };
    guest
        .sh(
            &format!("command -v fio && command -v {HELPER} && fio --version"),
            Duration::from_secs(60),
        )
        .await
        .map_err(|e| {
            format!(
                "the guest image has no fio/{HELPER} ({e}): build the bench image with \
                 `guest/build-image.sh --bench` and pass it with --guest-kernel/--guest-initrd"
            )
        })?;
    Ok((
        guest,
        pids,
        Seen {
            block,
            virtiofs,
            block_device,
        },
    ))
}

/// Human names of the helper's probes.
fn feature_label(name: &str) -> &str {
    match name {
        "o_direct" => "O_DIRECT",
        "xattr" => "xattrs (user.*)",
        "posix_acl" => "POSIX ACLs",
        "fallocate_punch_hole" => "fallocate + punch hole",
        "flock" => "flock, two processes",
        "fcntl_lock" => "fcntl locks, two processes",
        "inotify" => "inotify",
        "mmap_shared_write" => "mmap shared writes",
        other => other,
    }
}

async fn feature_table(
    bench: &Bench<'_>,
    blk: &Flow,
    vfs: &Flow,
) -> Result<Vec<FeatureRow>, String> {
    let b = bench.features(Side::Block).await?;
    let v = bench.features(Side::Virtiofs).await?;
    let mut rows = Vec::new();
    for (name, checks, outcome) in b {
        let other = v
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, _, o)| o.clone())
            .unwrap_or(Outcome {
                works: false,
                detail: "not probed".into(),
            });
        rows.push(FeatureRow {
            feature: feature_label(&name).to_string(),
            checks,
            block: outcome,
            virtiofs: other,
        });
    }
    rows.push(FeatureRow {
        feature: "statfs = CSI stats".into(),
        checks: "the guest's statvfs of the mount equals NodeGetVolumeStats (bytes and inodes)"
            .into(),
        block: statfs_vs_csi(bench, Side::Block, blk).await,
        virtiofs: statfs_vs_csi(bench, Side::Virtiofs, vfs).await,
    });
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> GuestIoArgs {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct T {
            #[command(flatten)]
            g: GuestIoArgs,
            #[arg(long)]
            deferred: bool,
            #[arg(long)]
            scenarios: Option<String>,
            #[arg(long)]
            stats_volumes: Option<u32>,
            #[arg(long)]
            defer_fs_ops: bool,
            #[arg(long)]
            staging_dir: Option<String>,
            #[arg(long)]
            target_dir: Option<String>,
            #[arg(long)]
            duration: Option<String>,
            #[arg(long)]
            ops: Option<u32>,
        }
        let mut v = vec!["t", "--guest-io"];
        v.extend_from_slice(extra);
        T::try_parse_from(v).unwrap().g
    }

    #[test]
    fn short_and_long_forms() {
        let rt = RuntimeCli::new("/bin/true");
        let mut c = GuestIoConfig::new("/w", rt, "crust-bench-1");
        assert_eq!(c.sizes, Sizes::long());
        assert!(c.volume_size >= Sizes::long().footprint());
        c.apply(&args(&["--short", "--repeat", "1"])).unwrap();
        assert_eq!(c.sizes, Sizes::short());
        assert_eq!((c.repeat, c.volume_size), (1, 256 << 20));
        c.apply(&args(&[
            "--short",
            "--meta-files",
            "50",
            "--queue-depths",
            "4,4,1",
        ]))
        .unwrap();
        assert_eq!(
            (c.sizes.meta_files, c.queue_depths.clone()),
            (50, vec![4, 1])
        );
        assert!(
            c.apply(&args(&["--guest-memory", "256Mi"]))
                .unwrap_err()
                .contains("512Mi")
        );
        assert!(
            c.apply(&args(&["--volume-size", "64Mi"]))
                .unwrap_err()
                .contains("smaller")
        ); // The host columns run by default, beside the backing file.
        assert!(c.host_columns && c.host_dir.is_none());
        c.apply(&args(&["--short", "--no-host-columns"])).unwrap();
        assert!(!c.host_columns);
        c.apply(&args(&["--short", "--host-dir", "/srv/disk"]))
            .unwrap();
        assert!(c.host_columns);
        assert_eq!(
            c.host_dir.as_deref(),
            Some(std::path::Path::new("/srv/disk"))
        );
    }

    #[test]
    fn both_flows_are_one_pod() {
        let c = GuestIoConfig::new("/w", RuntimeCli::new("/bin/true"), "crust-bench-2");
        let v = c.virtiofs_flow();
        let b = c.block_flow(&v.target_path().display().to_string());
        assert_eq!(v.pod_uid, b.pod_uid);
        assert_ne!(v.volume_name, b.volume_name);
        assert_eq!(v.size, b.size);
        assert_eq!(v.defer_via, DeferVia::None);
        assert_eq!(
            v.params.get("deferFsOps").map(String::as_str),
            Some("false")
        );
        assert_eq!(b.defer_via, DeferVia::Request);
        assert!(b.runtime.share_binds && !v.runtime.share_binds);
        assert_eq!(b.runtime.memory_mib, Some(1024));
        let spec = crust_kubesim::flow::bundle_spec(&b, "/t/blk");
        let mounts = spec["mounts"].as_array().unwrap();
        assert!(
            mounts
                .iter()
                .any(|m| m["destination"] == VIRTIOFS_DESTINATION
                    && m["source"] == v.target_path().display().to_string().as_str())
        );
    }
}
