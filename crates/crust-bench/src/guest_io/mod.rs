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
//!   virtiofsd with exactly the containerd shim's settings (read back
//!   from the running virtiofsd for the report).
//!
//! The sandbox runs the bench guest image (`guest/build-image.sh --bench`:
//! fio and `crust-guest-bench`). Every workload runs on both mounts back to
//! back, repeated and interleaved (block, virtio-fs, block, …); dirty data
//! is written back in the guest and on the host before each run, and read
//! workloads start from cold caches (guest and host page caches dropped).
//! Host CPU is QEMU's plus virtiofsd's `utime + stime` from `/proc` over
//! each run. Each fio workload also runs in three host columns between the
//! guest's runs ([`baseline`]): the same fio job on the host beside the
//! block volume's backing file, the same fio job on a scratch direct-I/O
//! loop device there, and `qemu-img bench` on what crust's QEMU opens for
//! that device (its backing file). Then every
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

mod checks;
mod measure;

use checks::{check_sandbox, describe_mounts, feature_table};
use measure::Bench;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{BenchError, CleanupReport};
use crust_csi_client::Csi;
use crust_kubesim::flow::{
    DeferVia, Flow, FlowConfig, Progress, StepReport, Workload as PodWorkload,
};
use crust_kubesim::runtime_cli::RuntimeCli;
use crust_report::units::{parse_duration, parse_size};
use report::{CpuSplit, GuestIoReport, Side};
use workload::Sizes;

/// Where the virtio-fs volume appears in the guest.
pub const VIRTIOFS_DESTINATION: &str = "/data-virtiofs";
/// The error of a guest command cut short by an interruption.
const INTERRUPTED: &str = "interrupted";
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
    /// Guest I/O: run the host columns (host fio, fio on a scratch loop
    /// device, qemu-img bench on its backing file) in this
    /// directory instead of beside the block volume's backing file (for
    /// drivers whose volumes are not loop devices).
    #[arg(long, requires = "guest_io", conflicts_with = "no_host_columns")]
    pub host_dir: Option<PathBuf>,
    /// Guest I/O: no host columns (they need fio and qemu-img on the host).
    #[arg(long, requires = "guest_io")]
    pub no_host_columns: bool,
    /// Guest I/O: QEMU opens the block volume through the host page cache
    /// (`cache.direct=off`, `aio=threads`: the path before direct I/O), to
    /// compare the two paths; the report says so.
    #[arg(long, requires = "guest_io")]
    pub host_cache: bool,
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
    /// QEMU through the host page cache ([`GuestIoArgs::host_cache`]).
    pub host_cache: bool,
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
            host_cache: false,
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
        self.host_cache = a.host_cache;
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
        rt.host_cache = self.host_cache;
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
    let mut rep = new_report(info, &cfg);
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
    // What the share's virtiofsd really ran with (pids: QEMU, then the
    // virtiofsd processes found below the shim).
    rep.virtiofsd_args = pids
        .get(1)
        .map(|&p| host::virtiofsd_settings(p))
        .unwrap_or_default();
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
    let prepared = prepare_sides(&bench, &mut rep, &stop).await;
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
    rep.cleanup = tear_down(&mut pods, &mut rep.notes).await;
    rep.interrupted = *stop.borrow();
    rep.elapsed_secs = t_all.elapsed().as_secs_f64();
    Ok(rep)
}

/// The report's header: the driver and the guest's shape.
fn new_report(
    info: crust_proto::csi::v1::GetPluginInfoResponse,
    cfg: &GuestIoConfig,
) -> GuestIoReport {
    GuestIoReport {
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
        repeat: cfg.repeat,
        queue_depths: cfg.queue_depths.clone(),
        sizes: Some(cfg.sizes),
        host_caches_dropped: cfg.drop_host_caches && host::can_drop_caches(),
        qemu_host_cache: cfg.host_cache,
        ..Default::default()
    }
}

/// Lays out the bench's files on both mounts; false when a side could not
/// be prepared (or the run was stopped), so nothing is measured.
async fn prepare_sides(
    bench: &Bench<'_>,
    rep: &mut GuestIoReport,
    stop: &watch::Receiver<bool>,
) -> bool {
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
    prepared
}

/// Tears both pods down (the block pod first: it holds the share of the
/// other) and counts what was undone.
async fn tear_down(pods: &mut Pods, notes: &mut Vec<String>) -> CleanupReport {
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
        notes.extend(
            f.report()
                .notes
                .iter()
                .filter(|n| !n.starts_with("no deferral:"))
                .cloned(),
        );
    }
    cleanup
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
                h.scratch.qemu_img_target.display()
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
        // Direct I/O unless asked; the switch reaches the block flow's runtime only.
        assert!(!b.runtime.host_cache);
        let mut hc = c.clone();
        hc.apply(&args(&["--short", "--host-cache"])).unwrap();
        let hb = hc.block_flow("/t/vfs");
        assert!(hb.runtime.host_cache && !hc.virtiofs_flow().runtime.host_cache);
        assert!(
            hb.runtime
                .env()
                .contains(&("CRUST_RUNTIME_HOST_CACHE", "true".into()))
        );
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
