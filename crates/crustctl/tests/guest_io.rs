//! `crustctl bench --guest-io` in its short (CI) form, run as the binary
//! against the real crust-csi and crust-runtime:
//!
//! - `guest_io_short_form_end_to_end`: both volumes reach one guest
//!   (a `/dev/vd*` ext4 disk at /data, the host mount over virtiofs at
//!   /data-virtiofs, whose files the host sees while the block volume is
//!   not mounted on the host), fio and the metadata workloads run on both,
//!   the native-feature table is produced (with the failure virtio-fs
//!   really has: no POSIX ACLs), every number of the JSON report parses,
//!   the host columns (host fio beside the block volume's backing file,
//!   fio and qemu-img bench on a scratch loop device there) have a
//!   positive result and ratios for every fio workload and none for the
//!   metadata ones, `--chart` writes an SVG with one bar group per
//!   fio workload, and nothing is left behind (the scratch loop device
//!   and directory of the host columns included).
//! - `guest_io_interrupted_mid_run_leaves_nothing`: SIGTERM while fio runs
//!   in the guest, after whoever read crustctl's stderr is gone (what a
//!   killed test leaves it with): crustctl abandons the run, tears
//!   everything down and exits 130 with a report that says so.
//! - `a_killed_runs_leftovers_are_reaped_by_the_next_run`: the stack
//!   reaper for test processes killed outright.
//!
//! Budget (TCG, debug build, one guest each, 2 cores): about 35 s and
//! 25 s here, plus ~15 s for the host columns in the first (measured:
//! 1.2 s set-up, 8.8 s for the 16 host fio and qemu-img runs; the 8 runs
//! of fio on the loop device added 10 s at load 11, where the whole test
//! took 215 s); the bench image is built
//! once (~45 s, cached by guest/build-image.sh's stamp; scripts/test.sh
//! builds it beforehand).
//! The long form is the documented command (README, "Guest I/O").

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod e2e_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use e2e_support::*;
use serde_json::Value;

/// A hang guard, not a speed assertion.
const LIMIT: Duration = Duration::from_secs(600);

/// `guest/build-image.sh --bench` when the bench image is missing (once
/// across concurrently running test binaries; CI builds it beforehand).
fn ensure_bench_image() -> (PathBuf, PathBuf) {
    let dir = crust_testkit::workspace_root().join("target/guest-image-bench");
    let ready = || dir.join("vmlinuz").is_file() && dir.join("initramfs.cpio.gz").is_file();
    if !ready() {
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open("/tmp/crust-guest-image-bench-build.lock")
            .unwrap();
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
        if !ready() {
            let root = crust_testkit::workspace_root();
            let st = Command::new("bash")
                .arg(root.join("guest/build-image.sh"))
                .args(["--bench", "--out"])
                .arg(&dir)
                // The outer cargo may hold the usual target dir's lock.
                .env("CARGO_TARGET_DIR", root.join("target/guest-agent-build"))
                .stdin(Stdio::null())
                .status()
                .unwrap();
            assert!(st.success(), "guest/build-image.sh --bench failed");
        }
    }
    (dir.join("vmlinuz"), dir.join("initramfs.cpio.gz"))
}

/// `crustctl bench --guest-io --short` against the stack, on the bench
/// image, JSON report. crustctl gets SIGTERM (and tears down) when the
/// test thread dies.
fn bench_command(st: &Stack, kernel: &Path, initrd: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_crustctl"));
    cmd.args([
        "--endpoint",
        &st.endpoint(),
        "--timeout",
        "120s",
        "-o",
        "json",
    ])
    .args(["bench", "--guest-io", "--short", "--repeat", "1"])
    .args(["--guest-memory", "768Mi", "--guest-cpus", "1"])
    .arg("--work-dir")
    .arg(&st.work)
    .arg("--runtime")
    .arg(&st.runtime.bin)
    .arg("--runtime-root")
    .arg(&st.runtime_root)
    .arg("--crust-root")
    .arg(&st.crust_root)
    .arg("--kata-root")
    .arg(&st.kata_root)
    .args(["--accel", "tcg"])
    .arg("--guest-kernel")
    .arg(kernel)
    .arg("--guest-initrd")
    .arg(initrd);
    crust_sys::spawn::ChildSetup::new()
        .death_signal(rustix::process::Signal::TERM)
        .apply(&mut cmd)
        .unwrap();
    cmd
}

fn sigterm(pid: u32) {
    let p = rustix::process::Pid::from_raw(pid as i32).unwrap();
    let _ = rustix::process::kill_process(p, rustix::process::Signal::TERM);
}

/// Runs `cmd`, stopping it after `limit`; (exit code, stdout, stderr).
fn run_limited(mut cmd: Command, limit: Duration) -> (Option<i32>, String, String) {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => {
            let out = out.unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
        Err(_) => {
            // crustctl tears down before it exits.
            sigterm(pid);
            let _ = rx.recv_timeout(Duration::from_secs(120));
            panic!("crustctl bench --guest-io did not finish within {LIMIT:?}");
        }
    }
}

fn num(v: &Value, what: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"))
}

#[test]
fn guest_io_short_form_end_to_end() {
    let mut st = Stack::new(Layout::Crust);
    let (kernel, initrd) = ensure_bench_image();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(st.start_plugin(true));

    let _slot = crust_testkit::VmSlot::acquire();
    let t0 = Instant::now();
    // Not in the work dir: crustctl removes that one.
    let chart = st.root.join("guest-io.svg");
    let mut cmd = bench_command(&st, &kernel, &initrd);
    cmd.arg("--chart").arg(&chart);
    let (code, out, err) = run_limited(cmd, LIMIT);
    eprintln!("{err}");
    eprintln!("bench --guest-io --short took {:.0?}", t0.elapsed());
    assert_eq!(
        code,
        Some(0),
        "crustctl failed:\n{out}\n{err}\nplugin log:\n{}",
        st.plugin_log()
    );
    let r: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("no JSON ({e}):\n{out}"));

    // --- the set-up the report describes -----------------------------------
    assert_eq!(r["errors"], serde_json::json!([]), "{r:#}");
    assert_eq!(r["interrupted"], false);
    assert_eq!(r["cleanup"]["leftovers"], serde_json::json!([]));
    assert_eq!(r["cleanup"]["volumes_deleted"], 2);
    assert_eq!(r["block"]["destination"], "/data");
    assert_eq!(r["virtiofs"]["destination"], "/data-virtiofs");
    // The guest's /proc/mounts: a virtio-blk disk with the volume's
    // filesystem, and virtiofs.
    let (b, v) = (&r["block"], &r["virtiofs"]);
    assert!(
        b["guest_source"].as_str().unwrap().starts_with("/dev/vd"),
        "{b}"
    );
    assert_eq!(b["guest_fs_type"], "ext4", "{b}");
    assert_eq!(v["guest_fs_type"], "virtiofs", "{v}");
    assert!(
        b["path"].as_str().unwrap().contains("virtio-blk /dev/vd"),
        "{b}"
    );
    // The mode QEMU opened the volume with, from the runtime's state: the
    // best this host allows, direct I/O.
    let want = format!(
        "QEMU on the loop device's backing file, {}",
        crust_qmp::BlockIo::host_best()
    );
    assert!(b["path"].as_str().unwrap().ends_with(&want), "{b}: {want}");
    // The host sees the virtio-fs volume's files through its host mount;
    // the block volume is not mounted on the host at all.
    assert_eq!(v["host_sees_bench_files"], true, "{v}");
    assert_eq!(b["host_sees_bench_files"], false, "{b}");
    assert_eq!(
        r["block"]["capacity_bytes"],
        r["virtiofs"]["capacity_bytes"]
    );
    assert_eq!(r["block"]["fs_type"], r["virtiofs"]["fs_type"]);
    let vargs: Vec<&str> = crust_vmm::VIRTIOFSD_ARGS.to_vec();
    assert_eq!(r["virtiofsd_args"], serde_json::json!(vargs));
    assert_eq!(r["accel"], "tcg");

    // --- every workload ran once on each mount, and its numbers parse ----------
    let sizes = &r["sizes"];
    let ws = r["workloads"].as_array().unwrap();
    let names: Vec<&str> = ws.iter().map(|w| w["workload"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "randwrite-fsync-4k-qd1",
            "randwrite-fsync-4k-qd16",
            "randread-4k-qd1",
            "randread-4k-qd16",
            "seqwrite-1m-qd1",
            "seqwrite-1m-qd16",
            "seqread-1m-qd1",
            "seqread-1m-qd16",
            "meta-create-fsync-stat-unlink",
            "walk-tree",
            "walk-tree-warm",
        ]
    );
    for w in ws {
        let name = w["workload"].as_str().unwrap();
        let fio = !name.starts_with("meta") && !name.starts_with("walk");
        for side in ["block", "virtiofs"] {
            let s = &w[side];
            assert_eq!(s["runs"], 1, "{name} {side}");
            let v = num(&s["median"], name);
            assert!(v.is_finite() && v > 0.0, "{name} {side}: {v}");
            if !name.starts_with("walk") {
                let (p50, p99) = (num(&s["p50_us"], name), num(&s["p99_us"], name));
                assert!(
                    p50 > 0.0 && p99 >= p50,
                    "{name} {side}: p50 {p50} p99 {p99}"
                );
            }
            if fio {
                assert!(num(&s["cpu_s_per_gib"], name) > 0.0, "{name} {side}");
            }
        }
        assert!(num(&w["ratio"], name) > 0.0, "{name}");
        let run = w["runs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["side"] == "virtiofs")
            .unwrap();
        let bytes = run["bytes"].as_u64().unwrap();
        match name {
            // Whole files, once.
            n if n.starts_with("seq") => {
                assert_eq!(bytes, sizes["seq_file"].as_u64().unwrap(), "{n}")
            }
            // Each block at most once.
            n if n.starts_with("randread") => {
                assert!(
                    bytes > 0 && bytes <= sizes["rand_file"].as_u64().unwrap(),
                    "{n}: {bytes}"
                )
            }
            n if n.starts_with("meta") => assert_eq!(bytes, 200 * 4096),
            _ => {}
        }
        // The counted CPU is QEMU's and virtiofsd's: something ran.
        assert!(num(&run["host_cpu_s"], name) >= 0.0);
    }

    // The cold walk read the block device under the tree; the warm one
    // found it in the guest's caches; virtio-fs has no device to count.
    let walk_run = |name: &str, side: &str| {
        let w = ws.iter().find(|w| w["workload"] == name).unwrap();
        let runs = w["runs"].as_array().unwrap();
        runs.iter().find(|x| x["side"] == side).unwrap().clone()
    };
    let cold = &walk_run("walk-tree", "block");
    let (cold_reads, cold_bytes) = (
        cold["device_reads"].as_u64().unwrap(),
        cold["device_read_bytes"].as_u64().unwrap(),
    );
    assert!(cold_reads > 0, "the cold walk read nothing from the device");
    assert!(
        cold_bytes >= cold_reads * 512,
        "{cold_bytes} bytes in {cold_reads} reads"
    );
    let warm = walk_run("walk-tree-warm", "block")["device_read_bytes"]
        .as_u64()
        .unwrap();
    assert!(warm < cold_bytes, "warm {warm} >= cold {cold_bytes}");
    assert!(
        walk_run("walk-tree", "virtiofs")
            .get("device_read_bytes")
            .is_none()
    );

    check_host_columns(&r);
    check_chart(&chart, &names[..8]);

    // --- the feature table: all on the block volume; ACLs fail on virtio-fs ----
    let fs = r["features"].as_array().unwrap();
    let names: Vec<&str> = fs.iter().map(|f| f["feature"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "O_DIRECT",
            "xattrs (user.*)",
            "POSIX ACLs",
            "fallocate + punch hole",
            "flock, two processes",
            "fcntl locks, two processes",
            "inotify",
            "mmap shared writes",
            "statfs = CSI stats",
        ]
    );
    for f in fs {
        assert_eq!(f["block"]["works"], true, "block: {f}");
    }
    let acl = &fs[2]["virtiofs"];
    assert_eq!(acl["works"], false, "{acl}");
    assert!(
        acl["detail"].as_str().unwrap().contains("not supported"),
        "{acl}"
    );
    assert_eq!(fs[8]["virtiofs"]["works"], true, "{}", fs[8]);

    // --- and the machine agrees: nothing left ------------------------------------
    st.assert_clean();
    drop(rt);
}

/// The host columns ran beside the block volume's backing file, on a
/// direct-I/O scratch device, and every fio workload has a positive
/// result in both, with the ratios; the scratch is gone.
fn check_host_columns(r: &Value) {
    let h = &r["host"];
    let backing = Path::new(
        h["backing_file"]
            .as_str()
            .unwrap_or_else(|| panic!("{r:#}")),
    );
    let dir = Path::new(h["dir"].as_str().unwrap());
    assert_eq!(dir.parent(), backing.parent(), "{h}");
    assert!(!dir.exists(), "{} left behind", dir.display());
    assert_eq!(h["scratch_direct_io"], true, "{h}");
    // The loop column's queue settings, as sysfs had them.
    assert!(h["scratch_scheduler"].is_string(), "{h}");
    assert!(num(&h["scratch_nr_requests"], "nr_requests") > 0.0, "{h}");
    assert!(
        ["io_uring", "native", "threads"].contains(&h["qemu_img_aio"].as_str().unwrap()),
        "{h}"
    );
    assert!(h["qemu_img_version"].as_str().unwrap().contains("qemu-img"));
    let scratch = h["scratch_device"].as_str().unwrap();
    let bound = crust_blockdev::list_loops()
        .unwrap()
        .into_iter()
        .any(|l| l.path == Path::new(scratch) && l.backing_file.starts_with(dir));
    assert!(!bound, "{scratch} still attached");
    for w in r["workloads"].as_array().unwrap() {
        let name = w["workload"].as_str().unwrap();
        if name.starts_with("meta") || name.starts_with("walk") {
            // No host equivalent.
            assert_eq!(w["host_fio"]["runs"], 0, "{name}");
            assert_eq!(w["qemu_img"]["runs"], 0, "{name}");
            assert_eq!(w["loop_fio"]["runs"], 0, "{name}");
            assert!(w["block_vs_host"].is_null(), "{name}");
            assert!(w["loop_vs_host"].is_null(), "{name}");
            continue;
        }
        for col in ["host_fio", "loop_fio", "qemu_img"] {
            assert_eq!(w[col]["runs"], 1, "{name} {col}");
            assert!(num(&w[col]["median"], name) > 0.0, "{name} {col}");
            assert!(num(&w[col]["cpu_s_per_gib"], name) >= 0.0, "{name} {col}");
        }
        for ratio in [
            "block_vs_host",
            "qemu_img_vs_host",
            "qemu_img_vs_loop",
            "loop_vs_host",
        ] {
            let v = num(&w[ratio], name);
            assert!(v.is_finite() && v > 0.0, "{name} {ratio}: {v}");
        }
        let runs = w["runs"].as_array().unwrap();
        let host = runs.iter().find(|x| x["side"] == "host-fio").unwrap();
        let on_loop = runs.iter().find(|x| x["side"] == "loop-fio").unwrap();
        if name.starts_with("seq") {
            // host fio and fio on the loop device moved the whole file's
            // worth, as the guest did.
            assert_eq!(host["bytes"], r["sizes"]["seq_file"], "{name}");
            assert_eq!(on_loop["bytes"], r["sizes"]["seq_file"], "{name}");
        }
        assert!(runs.iter().any(|x| x["side"] == "qemu-img"), "{name}: {w}");
    }
    let split = &r["cpu_split"];
    assert!(num(&split["block_s_per_gib"], "cpu_split") > 0.0, "{split}");
}

/// `--chart`: a well-formed SVG with one bar per series and fio workload
/// (plus the legend's swatch) and each workload's label.
fn check_chart(path: &Path, fio_workloads: &[&str]) {
    let svg = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("not XML ({e}): {svg}"));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for (kind, depth) in fio_workloads.iter().map(|w| w.rsplit_once('-').unwrap()) {
        assert!(
            texts.contains(&kind) && texts.contains(&depth),
            "{kind} {depth}: {texts:?}"
        );
    }
    for colour in ["#4D4D4D", "#2CA02C", "#8C6BB1", "#1F77B4", "#FF7F0E"] {
        let bars = doc
            .descendants()
            .filter(|n| n.has_tag_name("rect"))
            .filter(|n| {
                n.attribute("fill")
                    .is_some_and(|f| f.eq_ignore_ascii_case(colour))
            })
            .count();
        assert_eq!(bars, fio_workloads.len() + 1, "{colour}: {svg}");
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn guest_io_interrupted_mid_run_leaves_nothing() {
    let mut st = Stack::new(Layout::Crust);
    let (kernel, initrd) = ensure_bench_image();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(st.start_plugin(true));

    let _slot = crust_testkit::VmSlot::acquire();
    let mut child = bench_command(&st, &kernel, &initrd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdout = child.stdout.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut s);
        s
    });
    // The step lines on stderr until the first fio run is done (the next
    // one is then running in the guest); then the reader goes away, like
    // a killed test process: crustctl's later writes to stderr fail
    // (EPIPE) and must not keep it from tearing down.
    let (tx, rx) = std::sync::mpsc::channel::<Vec<String>>();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        for l in std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok) {
            let done = l.contains("randwrite-fsync-4k-qd1 block #1");
            seen.push(l);
            if done {
                break;
            }
        }
        let _ = tx.send(seen);
    });
    let seen = rx.recv_timeout(LIMIT).unwrap_or_else(|e| {
        sigterm(pid);
        panic!("no fio run finished within {LIMIT:?} ({e})")
    });
    let log = seen.join("\n");
    assert!(
        log.contains("randwrite-fsync-4k-qd1 block #1"),
        "crustctl ended early:\n{log}"
    );
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    sigterm(pid);
    let status = child.wait().unwrap();
    let took = t0.elapsed();
    let out = out.join().unwrap();
    eprintln!("{log}\nexited {status} {took:.1?} after SIGTERM");
    assert_eq!(status.code(), Some(130), "{log}\n{out}");
    let r: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("no JSON ({e}):\n{out}"));
    assert_eq!(r["interrupted"], true);
    assert_eq!(
        r["errors"],
        serde_json::json!([]),
        "an interruption is not a failed run"
    );
    assert_eq!(r["cleanup"]["leftovers"], serde_json::json!([]));
    assert_eq!(r["cleanup"]["volumes_deleted"], 2);
    assert_eq!(r["cleanup"]["node_unstaged"], 2);
    // The run in progress was abandoned: no later workload ran, no probe.
    for w in r["workloads"].as_array().unwrap() {
        if w["workload"] != "randwrite-fsync-4k-qd1" {
            assert_eq!(
                (&w["block"]["runs"], &w["virtiofs"]["runs"]),
                (&0.into(), &0.into()),
                "{w}"
            );
        }
    }
    assert_eq!(r["features"], serde_json::json!([]));
    st.assert_clean();
    drop(rt);
}

/// What a test process killed outright leaves (its stack's lock file
/// free, a loop device on its pool, a mount under its dir, a process
/// naming it) is released by the next stack's set-up; a live stack next
/// to it is untouched.
///
/// The dir is built while its lock is held, as a real stack's is, so the
/// reaper of a test running concurrently in another binary cannot take
/// it half-built (it did once: it removed the dir before `tail` started
/// and never killed it). Once the lock is dropped, this reaper or a
/// concurrent one may release it, so the checks wait for the outcome
/// within a bound instead of blocking on `tail`.
#[test]
fn a_killed_runs_leftovers_are_reaped_by_the_next_run() {
    crust_testkit::require_root();
    let live = Stack::new(Layout::Crust);
    let root = tempfile::Builder::new()
        .prefix("crust-e2e-")
        .tempdir_in("/tmp")
        .unwrap()
        .keep();
    let owner = take_ownership(&root);
    std::fs::create_dir_all(root.join("pool")).unwrap();
    let img = root.join("pool/vol.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let dev = crust_blockdev::LoopDevice::attach(&img, Default::default())
        .unwrap()
        .path;
    let mnt = root.join("work/mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(st.success());
    // A process holding a file of the dir (its command line names it).
    let mut sleeper = Command::new("tail")
        .arg("-f")
        .arg(&img)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let tail = format!("{}: ", sleeper.id());
    // Until it has exec'd, the child's command line is still this test's.
    let seen_by = Instant::now() + Duration::from_secs(10);
    while !processes_naming(&root).iter().any(|p| p.starts_with(&tail)) {
        assert!(
            Instant::now() < seen_by,
            "tail is not seen naming {}: {:?}",
            root.display(),
            processes_naming(&root)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The owner dies.
    drop(owner);

    reap_abandoned_stacks();

    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = sleeper.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = sleeper.kill();
            let _ = sleeper.wait();
            panic!(
                "tail was not killed within 30s; naming {}: {:?}",
                root.display(),
                processes_naming(&root)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let attached = || {
        crust_blockdev::list_loops()
            .unwrap()
            .iter()
            .any(|l| l.path == dev)
    };
    while (root.exists() || attached()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(mounts_under(&root), Vec::<PathBuf>::new());
    assert!(!attached(), "{} still attached", dev.display());
    assert!(!root.exists());
    // The live stack keeps its dir and lock.
    assert!(live.root.join(".owner.lock").is_file());
}
