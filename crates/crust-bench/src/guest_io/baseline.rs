//! The host columns of `bench --guest-io`: what the block volume's backing
//! store gives without a VM, measured in the same run as the guest.
//!
//! - **host fio**: the guest's fio jobs with `--direct=1` added, on files
//!   in a scratch directory beside the block volume's backing file (the
//!   same filesystem): the physical limit.
//! - **fio on the loop device**: the same fio jobs, O_DIRECT, on the
//!   scratch loop device below: the kernel's loop driver alone, the path
//!   crust's QEMU skips where it can (loop fio ÷ host fio is that
//!   driver's cost).
//! - **qemu-img bench**: QEMU's own block layer without a guest
//!   (`-f raw -t none`, `-i io_uring`, else `native`, else `threads`) on
//!   what crust's runtime has QEMU open for a volume on a scratch loop
//!   device attached with direct I/O, as the pool attaches volumes, over a
//!   file in that directory: that file, when the loop driver can be
//!   skipped ([`crust_blockdev::route`]), else the device. The volume's
//!   own device is not used: the guest has it mounted, and qemu-img would
//!   write under its filesystem. The scratch device is as big as the workloads' files
//!   (not the volume): every block it reads must have been written, or
//!   the backing filesystem answers holes without touching the disk.
//!
//! qemu-img bench has no random mode. The 4 KiB "random" rows run what it
//! has: a fixed stride ([`stride_blocks`]) coprime with the device's block
//! count, so no two requests in a row are neighbours and no block is read
//! twice in a pass. `randwrite-fsync` flushes after every write at depth 1
//! and every `depth` writes above (qemu-img refuses a smaller interval)
//! without draining the queue; the sequential write flushes once at the
//! end (fio's `end_fsync`). The metadata workloads have no host column:
//! they measure the guest's filesystem, which the host does not run.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::sync::watch;

use super::report::HostReport;
use super::workload::{Kind, Measured, Sizes, Unit, Workload};

/// qemu-img's engines, best first (the same order crust's QEMU tries).
pub const AIO_ENGINES: [&str; 3] = ["io_uring", "native", "threads"];

/// The first stride tried (blocks): far apart enough that a pass never
/// looks sequential to the device.
const STRIDE_START: u64 = 1021;

/// The guest's fio command for `w`, run on the host with O_DIRECT.
pub fn host_fio_command(w: &Workload, dir: &str, s: &Sizes) -> Vec<String> {
    let mut c = w.command(dir, s);
    c.push("--direct=1".into());
    c
}

/// The guest's fio job on the scratch loop device, O_DIRECT: the loop
/// driver without QEMU, so qemu-img's gap to host fio splits into the
/// loop device's part and QEMU's. Random rows use the device's first
/// random-file bytes, sequential rows its first sequential-file bytes
/// (all written before: no read finds a hole). Empty for the metadata
/// workloads.
pub fn loop_fio_command(w: &Workload, dev: &str, s: &Sizes) -> Vec<String> {
    let mut c = w.fio_job(dev, s);
    if !c.is_empty() {
        c.push("--direct=1".into());
    }
    c
}

/// The active I/O scheduler in a `queue/scheduler` line
/// (`none [mq-deadline] kyber`).
pub fn active_scheduler(line: &str) -> Option<&str> {
    line.split_whitespace()
        .find_map(|s| s.strip_prefix('[')?.strip_suffix(']'))
}

/// The scratch device's queue settings (scheduler, nr_requests) from
/// sysfs: the loop column's results depend on them.
fn queue_settings(dev: &Path) -> (Option<String>, Option<u32>) {
    let Some(name) = dev.file_name().and_then(|n| n.to_str()) else {
        return (None, None);
    };
    let read = |f: &str| std::fs::read_to_string(format!("/sys/block/{name}/queue/{f}")).ok();
    (
        read("scheduler").and_then(|l| active_scheduler(&l).map(String::from)),
        read("nr_requests").and_then(|n| n.trim().parse().ok()),
    )
}

/// Writes `bytes` to `dev` once (not timed), so reads find data.
pub fn prefill_command(dev: &str, bytes: u64) -> Vec<String> {
    [
        "fio",
        "--name=prefill",
        "--output-format=json",
        "--rw=write",
        "--bs=1m",
        "--direct=1",
        "--iodepth=16",
        "--ioengine=io_uring",
    ]
    .map(String::from)
    .into_iter()
    .chain([format!("--filename={dev}"), format!("--size={bytes}")])
    .collect()
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Stride in blocks of the "random" rows: the first odd number from
/// [`STRIDE_START`] coprime with `blocks` (so a pass of `blocks` requests
/// touches every block once); 1 for a device too small to stride.
pub fn stride_blocks(blocks: u64) -> u64 {
    if blocks <= STRIDE_START {
        return 1;
    }
    (STRIDE_START..)
        .step_by(2)
        .find(|k| gcd(*k, blocks) == 1)
        .expect("an odd prime beyond any u64 factor")
}

/// Block size of a workload's requests.
pub fn block_size(w: &Workload) -> u64 {
    match w.kind {
        Kind::SeqWrite | Kind::SeqRead => 1 << 20,
        _ => 4096,
    }
}

/// Requests of a qemu-img run: the whole file for the sequential rows; for
/// the time-based 4 KiB rows what host fio did in the same time (`host`,
/// IOPS), within one pass over the device (reads never repeat a block).
pub fn request_count(w: &Workload, s: &Sizes, device_bytes: u64, host: Option<f64>) -> u64 {
    let per_pass = (device_bytes / block_size(w)).max(1);
    match w.kind {
        Kind::SeqWrite | Kind::SeqRead => (s.seq_file / block_size(w)).clamp(1, per_pass),
        _ => {
            let want = host
                .filter(|r| r.is_finite() && *r > 0.0)
                .map(|r| (r * s.runtime.as_secs_f64()).round() as u64)
                .unwrap_or(1024);
            want.clamp(64.min(per_pass), per_pass)
        }
    }
}

/// `qemu-img bench` of `w` on `dev` (`device_bytes` long), `count`
/// requests, with the engine `aio`.
pub fn qemu_img_command(
    w: &Workload,
    dev: &str,
    device_bytes: u64,
    aio: &str,
    count: u64,
) -> Vec<String> {
    let bs = block_size(w);
    let qd = w.queue_depth as u64;
    let mut a: Vec<String> = ["qemu-img", "bench", "-f", "raw", "-t", "none", "-i", aio]
        .map(String::from)
        .to_vec();
    a.extend([
        "-c".into(),
        count.to_string(),
        "-d".into(),
        qd.to_string(),
        "-s".into(),
        bs.to_string(),
    ]);
    if matches!(w.kind, Kind::RandWriteFsync | Kind::RandRead) {
        a.push("-S".into());
        a.push((stride_blocks(device_bytes / bs) * bs).to_string());
    }
    match w.kind {
        Kind::RandWriteFsync => {
            a.push("-w".into());
            a.push(format!("--flush-interval={qd}"));
            if qd > 1 {
                a.push("--no-drain".into());
            }
        }
        // The interval is met once, when the last write completes.
        Kind::SeqWrite => {
            a.push("-w".into());
            a.push(format!("--flush-interval={}", count.max(qd)));
        }
        _ => {}
    }
    a.push(dev.into());
    a
}

/// What `qemu-img bench` printed: "Run completed in 1.234 seconds."
pub fn parse_qemu_img(w: &Workload, count: u64, stdout: &str) -> Result<Measured, String> {
    let secs: f64 = stdout
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("Run completed in ")?
                .strip_suffix(" seconds.")
        })
        .ok_or_else(|| format!("no \"Run completed in\" line in qemu-img's output: {stdout}"))?
        .parse()
        .map_err(|e| format!("qemu-img's run time: {e}"))?;
    if !secs.is_finite() || secs <= 0.0 {
        return Err(format!("qemu-img ran for {secs} s"));
    }
    let bytes = count * block_size(w);
    let value = match w.unit() {
        Unit::Iops => count as f64 / secs,
        _ => bytes as f64 / secs,
    };
    Ok(Measured::new(value, bytes, None, None, secs))
}

/// The block volume's backing file: `device` must be a loop device.
pub fn backing_file(device: &Path) -> Result<PathBuf, String> {
    let dev = std::fs::canonicalize(device).map_err(|e| format!("{}: {e}", device.display()))?;
    match crust_blockdev::loop_status(&dev) {
        Ok(Some(s)) if !s.backing_deleted => Ok(s.backing_file),
        Ok(Some(_)) => Err(format!("{}: its backing file was deleted", dev.display())),
        Ok(None) => Err(format!("{} is not bound to a file", dev.display())),
        Err(e) => Err(format!(
            "{} is not a loop device ({e}): pass --host-dir with a directory on its backing store",
            dev.display()
        )),
    }
}

/// CPU seconds (user + system) of this process's waited-for children.
pub fn children_cpu_seconds() -> f64 {
    crust_sys::rusage::children_cpu().map_or(0.0, |d| d.as_secs_f64())
}

/// The scratch directory of the host columns; removed (with what is in
/// it) on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// `.crust-bench-<run>` in `parent`, new.
    pub fn create(parent: &Path, run_id: &str) -> Result<ScratchDir, String> {
        let p = parent.join(format!(".crust-bench-{run_id}"));
        std::fs::create_dir(&p).map_err(|e| format!("creating {}: {e}", p.display()))?;
        Ok(ScratchDir(p))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The scratch loop device of the qemu-img column. Fields drop in order:
/// the device is detached before its directory goes.
#[derive(Debug)]
pub struct Scratch {
    pub device: crust_blockdev::LoopGuard,
    pub device_path: PathBuf,
    /// What qemu-img benches: what crust's runtime has QEMU open for a
    /// volume on this device ([`crust_blockdev::route`]), its backing
    /// file when the loop driver can be skipped.
    pub qemu_img_target: PathBuf,
    pub device_bytes: u64,
    pub direct_io: bool,
    pub dir: ScratchDir,
}

impl Scratch {
    /// A sparse file of `bytes` in `dir`, attached as a direct-I/O loop
    /// device (buffered only where the kernel refuses, as the pool does).
    pub fn attach(dir: ScratchDir, bytes: u64) -> Result<Scratch, String> {
        let file = dir.path().join("qemu-img-bench.raw");
        let f = std::fs::File::create(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        f.set_len(bytes)
            .map_err(|e| format!("{}: {e}", file.display()))?;
        drop(f);
        let block_size = crust_blockdev::dio_block_size(&file).unwrap_or(512);
        let opts = crust_blockdev::AttachOptions {
            direct_io: true,
            block_size,
            ..Default::default()
        };
        let device = crust_blockdev::LoopGuard::attach(&file, opts)
            .map_err(|e| format!("attaching {}: {e}", file.display()))?;
        let device_path = device.path().to_path_buf();
        let direct_io = crust_blockdev::loop_status(&device_path)
            .ok()
            .flatten()
            .is_some_and(|s| s.direct_io);
        let held = std::fs::File::open(&device_path)
            .map_err(|e| format!("{}: {e}", device_path.display()))?;
        let qemu_img_target =
            match crust_blockdev::route(std::os::fd::AsFd::as_fd(&held), &device_path, true) {
                crust_blockdev::Route::BackingFile(_) => file,
                crust_blockdev::Route::Device(_) => device_path.clone(),
            };
        Ok(Scratch {
            device,
            device_path,
            qemu_img_target,
            device_bytes: bytes,
            direct_io,
            dir,
        })
    }
}

/// Runs a host command, bounded by `limit` and abandoned (killed) when
/// `stop` turns true; its stdout and the CPU seconds it used when it
/// exits 0.
pub async fn run_host(
    args: &[String],
    limit: Duration,
    stop: &watch::Receiver<bool>,
) -> Result<(String, f64), String> {
    let line = args.join(" ");
    let cpu0 = children_cpu_seconds();
    let child = tokio::process::Command::new(&args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting `{line}` on the host: {e}"))?;
    let mut stop = stop.clone();
    let stopped = async move {
        if stop.wait_for(|s| *s).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let out = tokio::select! {
        r = tokio::time::timeout(limit, child.wait_with_output()) => match r {
            Ok(r) => r.map_err(|e| format!("`{line}`: {e}"))?,
            Err(_) => return Err(format!("`{line}` did not finish within {limit:?}")),
        },
        () = stopped => return Err(super::INTERRUPTED.into()),
    };
    // Nothing else is reaped meanwhile: host runs are never concurrent
    // with another child of crustctl.
    let cpu = (children_cpu_seconds() - cpu0).max(0.0);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let shown = if err.trim().is_empty() {
            stdout.trim()
        } else {
            err.trim()
        };
        return Err(format!(
            "`{line}` on the host failed ({}): {shown}",
            out.status
        ));
    }
    Ok((stdout, cpu))
}

/// The host columns while the bench runs: host fio's files and the
/// scratch device (both released on drop).
#[derive(Debug)]
pub struct HostSide {
    /// Host fio's directory (in the scratch dir).
    pub fio_dir: String,
    pub scratch: Scratch,
    pub aio: String,
    pub report: HostReport,
}

/// Bound of a set-up command moving `bytes` (1 MiB/s at the worst).
fn setup_bound(bytes: u64) -> Duration {
    Duration::from_secs(60 + bytes / (1 << 20))
}

impl HostSide {
    /// A scratch dir in `parent`, host fio's files laid out, the scratch
    /// device attached and written once, qemu-img's engine chosen.
    pub async fn set_up(
        parent: &Path,
        backing: String,
        run_id: &str,
        s: &Sizes,
        stop: &watch::Receiver<bool>,
    ) -> Result<HostSide, String> {
        let dir = ScratchDir::create(parent, run_id)?;
        let fio_dir = dir.path().display().to_string();
        for cmd in super::workload::layout_commands(&fio_dir, s) {
            run_host(&cmd, setup_bound(s.rand_file.max(s.seq_file)), stop).await?;
        }
        let bytes = s.rand_file.max(s.seq_file).next_multiple_of(1 << 20);
        let scratch = tokio::task::spawn_blocking(move || Scratch::attach(dir, bytes))
            .await
            .map_err(|e| e.to_string())??;
        let dev = scratch.device_path.display().to_string();
        run_host(&prefill_command(&dev, bytes), setup_bound(bytes), stop).await?;
        let target = scratch.qemu_img_target.display().to_string();
        let aio = choose_aio(&target, stop).await?;
        let version = run_host(
            &["qemu-img".into(), "--version".into()],
            Duration::from_secs(30),
            stop,
        )
        .await?
        .0
        .lines()
        .next()
        .unwrap_or("qemu-img")
        .trim()
        .to_string();
        let (scheduler, nr_requests) = queue_settings(&scratch.device_path);
        let report = HostReport {
            backing_file: backing,
            dir: fio_dir.clone(),
            scratch_device: dev,
            qemu_img_target: target,
            scratch_bytes: bytes,
            scratch_direct_io: scratch.direct_io,
            scratch_scheduler: scheduler,
            scratch_nr_requests: nr_requests,
            qemu_img_aio: aio.clone(),
            qemu_img_version: version,
        };
        Ok(HostSide {
            fio_dir,
            scratch,
            aio,
            report,
        })
    }
}

/// The best engine qemu-img opens `dev` with (one 4 KiB read each).
async fn choose_aio(dev: &str, stop: &watch::Receiver<bool>) -> Result<String, String> {
    let mut errors = Vec::new();
    for aio in AIO_ENGINES {
        let probe: Vec<String> = [
            "qemu-img", "bench", "-f", "raw", "-t", "none", "-i", aio, "-c", "1", "-s", "4096", dev,
        ]
        .map(String::from)
        .to_vec();
        match run_host(&probe, Duration::from_secs(60), stop).await {
            Ok(_) => return Ok(aio.to_string()),
            Err(e) if e == super::INTERRUPTED => return Err(e),
            Err(e) => errors.push(e),
        }
    }
    Err(format!(
        "qemu-img bench opens {dev} with no engine ({}); is qemu-utils installed?",
        errors.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(kind: Kind, queue_depth: u32) -> Workload {
        Workload { kind, queue_depth }
    }

    #[test]
    fn strides_visit_every_block_once_per_pass() {
        assert_eq!(stride_blocks(4096), 1021);
        assert_eq!(stride_blocks(100), 1);
        // 1021 divides 1021 * 4: the next odd number coprime with it.
        assert_eq!(stride_blocks(1021 * 4), 1023);
        let blocks = 6000;
        let k = stride_blocks(blocks);
        let mut seen = vec![false; blocks as usize];
        let mut off = 0;
        for _ in 0..blocks {
            assert!(!seen[off as usize], "block {off} twice");
            seen[off as usize] = true;
            off = (off + k) % blocks;
        }
    }

    #[test]
    fn qemu_img_command_lines() {
        let mib = 1u64 << 20;
        let c = qemu_img_command(
            &w(Kind::RandWriteFsync, 16),
            "/dev/loop9",
            32 * mib,
            "io_uring",
            500,
        );
        let want = "qemu-img bench -f raw -t none -i io_uring -c 500 -d 16 -s 4096 \
                    -S 4182016 -w --flush-interval=16 --no-drain /dev/loop9";
        assert_eq!(c.join(" "), want);
        let c = qemu_img_command(&w(Kind::RandWriteFsync, 1), "/d", 32 * mib, "native", 9);
        assert!(c.contains(&"--flush-interval=1".to_string()));
        assert!(!c.contains(&"--no-drain".to_string()), "{c:?}");
        let c = qemu_img_command(&w(Kind::SeqWrite, 16), "/d", 32 * mib, "threads", 8);
        assert_eq!(
            c[8..].join(" "),
            "-c 8 -d 16 -s 1048576 -w --flush-interval=16 /d"
        );
        let c = qemu_img_command(&w(Kind::SeqRead, 1), "/d", 32 * mib, "threads", 32);
        assert_eq!(c[8..].join(" "), "-c 32 -d 1 -s 1048576 /d");
        let c = qemu_img_command(&w(Kind::RandRead, 1), "/d", 32 * mib, "io_uring", 64);
        assert!(c.contains(&"-S".to_string()) && !c.contains(&"-w".to_string()));
        let h = host_fio_command(&w(Kind::RandRead, 16), "/pool/x", &Sizes::short());
        assert_eq!(h.last().map(String::as_str), Some("--direct=1"));
        assert!(h.contains(&"--filename=/pool/x/rand.dat".to_string()));
    }

    #[test]
    fn request_counts() {
        let s = Sizes::short(); // 16 MiB random, 32 MiB sequential, 1 s
        let dev = 32 << 20;
        assert_eq!(request_count(&w(Kind::SeqRead, 1), &s, dev, None), 32);
        // What host fio did in the run's time, within one pass.
        assert_eq!(
            request_count(&w(Kind::RandRead, 16), &s, dev, Some(2500.4)),
            2500
        );
        assert_eq!(
            request_count(&w(Kind::RandRead, 16), &s, dev, Some(1e9)),
            8192
        );
        assert_eq!(
            request_count(&w(Kind::RandWriteFsync, 1), &s, dev, Some(3.0)),
            64
        );
        assert_eq!(
            request_count(&w(Kind::RandWriteFsync, 1), &s, dev, None),
            1024
        );
    }

    #[test]
    fn parses_qemu_img_output() {
        // qemu-img 7.2's output.
        let out = "Sending 2048 requests, 4096 bytes each, 16 in parallel (starting at offset 0, step size 4182016)\n\
                   Run completed in 0.512 seconds.\n";
        let m = parse_qemu_img(&w(Kind::RandRead, 16), 2048, out).unwrap();
        assert_eq!((m.value, m.bytes, m.seconds), (4000.0, 8 << 20, 0.512));
        let m = parse_qemu_img(
            &w(Kind::SeqRead, 1),
            32,
            "Run completed in 0.250 seconds.\n",
        )
        .unwrap();
        assert_eq!(m.value, 128.0 * (1 << 20) as f64);
        assert!(
            parse_qemu_img(&w(Kind::SeqRead, 1), 32, "qemu-img: oops")
                .unwrap_err()
                .contains("Run completed")
        );
        assert!(
            parse_qemu_img(&w(Kind::SeqRead, 1), 1, "Run completed in 0.000 seconds.").is_err()
        );
    }

    /// The loop column runs the guest's fio job on the device itself,
    /// O_DIRECT: random rows on its first random-file bytes, sequential
    /// rows on its first sequential-file bytes; nothing for metadata.
    #[test]
    fn loop_fio_command_lines() {
        let s = Sizes::short(); // 16 MiB random, 32 MiB sequential
        let c = loop_fio_command(&w(Kind::RandRead, 16), "/dev/loop7", &s);
        let host = host_fio_command(&w(Kind::RandRead, 16), "/pool/x", &s);
        let same = |a: &[String], b: &[String]| {
            let strip = |v: &[String]| {
                v.iter()
                    .filter(|x| !x.starts_with("--filename="))
                    .cloned()
                    .collect::<Vec<_>>()
            };
            strip(a) == strip(b)
        };
        assert!(same(&c, &host), "{c:?}\n{host:?}");
        for want in [
            "--filename=/dev/loop7",
            "--size=16777216",
            "--rw=randread",
            "--iodepth=16",
            "--direct=1",
        ] {
            assert!(c.contains(&want.to_string()), "{want} not in {c:?}");
        }
        let c = loop_fio_command(&w(Kind::SeqWrite, 1), "/dev/loop7", &s);
        for want in [
            "--size=33554432",
            "--rw=write",
            "--end_fsync=1",
            "--direct=1",
        ] {
            assert!(c.contains(&want.to_string()), "{want} not in {c:?}");
        }
        let c = loop_fio_command(&w(Kind::RandWriteFsync, 1), "/dev/loop7", &s);
        assert!(c.contains(&"--fsync=1".to_string()) && c.contains(&"--size=16777216".to_string()));
        assert!(loop_fio_command(&w(Kind::Meta, 1), "/dev/loop7", &s).is_empty());
        assert!(loop_fio_command(&w(Kind::Walk, 1), "/dev/loop7", &s).is_empty());
    }

    #[test]
    fn reads_the_active_scheduler() {
        assert_eq!(
            active_scheduler("none [mq-deadline] kyber bfq\n"),
            Some("mq-deadline")
        );
        assert_eq!(active_scheduler("[none] mq-deadline"), Some("none"));
        assert_eq!(active_scheduler("none\n"), None);
    }

    #[test]
    fn prefill_writes_the_whole_device() {
        let c = prefill_command("/dev/loop3", 32 << 20);
        assert!(c.contains(&"--filename=/dev/loop3".to_string()));
        assert!(c.contains(&"--size=33554432".to_string()));
        assert!(c.contains(&"--direct=1".to_string()) && c.contains(&"--rw=write".to_string()));
    }
}
