//! The real `crust-ops` daemon on a real unix socket, driven by the tonic
//! client, with a real runtime CLI answering from a real loop-backed ext4.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use crust_handoff::{Layout, Policy, Store, crust_key, kata_key};
use crust_proto::runtime::v1alpha1 as pb;
use crust_testkit::LoopDisk;
use support::*;
use tonic::Code;

const CLI: &str = env!("CARGO_BIN_EXE_crust-test-runtime-cli");
const MIB: i64 = 1024 * 1024;

fn freeze_req(target: &str, ms: u64) -> pb::RuntimeFreezeVolumeRequest {
    pb::RuntimeFreezeVolumeRequest {
        volume_target_path: target.into(),
        max_frozen_ms: ms,
    }
}

fn thaw_req(target: &str) -> pb::RuntimeThawVolumeRequest {
    pb::RuntimeThawVolumeRequest {
        volume_target_path: target.into(),
    }
}

fn limits_req(target: &str, limits: &[(&str, &str)]) -> pb::RuntimeSetVolumeIoLimitsRequest {
    pb::RuntimeSetVolumeIoLimitsRequest {
        volume_target_path: target.into(),
        io_limits: limits
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// The `ioLimits` of the record in `dir` (none: unlimited).
fn recorded_limits(dir: &Path) -> Option<String> {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("mountInfo.json")).unwrap()).unwrap();
    v["metadata"]["ioLimits"].as_str().map(String::from)
}

fn write_map(path: &Path, map: serde_json::Value) {
    std::fs::write(path, map.to_string()).unwrap();
}

/// What a runtime does when it consumes a volume (CRUST layout).
fn consume(crust_root: &Path, target: &str, cli: &str, sandbox: &str) {
    let store = Store::new(Layout::Crust, crust_root, Policy::default()).unwrap();
    store.claim(target, sandbox, |_| true).unwrap();
    store.set_runtime_cli(target, cli).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfs_volume_stage_stats_expand_unstage() {
    // XFS needs 300 MiB at least; the file is sparse.
    full_flow("xfs", 320 * MIB, 400 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext4_volume_stage_stats_expand_unstage() {
    full_flow("ext4", 64 * MIB, 96 * MIB).await;
}

/// Stats through crust-ops equal statvfs of the mount (read between two
/// identical statvfs samples, so background fs work cannot skew it).
async fn assert_stats_match(
    c: &mut pb::runtime_client::RuntimeClient<tonic::transport::Channel>,
    target: &str,
    mnt: &Path,
) -> (i64, i64, i64, i64, i64, i64) {
    for _ in 0..20 {
        rustix::fs::sync();
        let before = statvfs_usage(mnt);
        let r = c
            .runtime_get_volume_stats(stats_req(target))
            .await
            .unwrap()
            .into_inner();
        let after = statvfs_usage(mnt);
        if before == after {
            assert_eq!(proto_usage(&r), before);
            assert!(!r.volume_condition.unwrap().abnormal);
            return before;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("filesystem usage never settled");
}

async fn full_flow(fs: &str, size: i64, grown: i64) {
    crust_testkit::require_root();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let lo = LoopDisk::with_fs(t.join("vol.img"), size as u64, fs.parse().unwrap());
    // The "guest" (a host mount the test CLI answers from) mounts the
    // volume after it was handed over: a mounted device is never staged.
    let guest_view = t.join("guest-view");
    std::fs::create_dir(&guest_view).unwrap();
    let crust_root = t.join("crust");
    let pods = t.join("kubelet/pods");
    let target = format!(
        "{}/uid-1/volumes/kubernetes.io~csi/pv-1/mount",
        pods.display()
    );
    let map = t.join("cli-map.json");
    write_map(
        &map,
        serde_json::json!({ &target: {"mount": &guest_view, "backing": lo.file(), "loop": lo.dev(), "sandbox": "sandbox-a"} }),
    );
    let daemon = Daemon::start(
        &t.join("run/ops.sock"),
        &[
            "--crust-root",
            crust_root.to_str().unwrap(),
            "--cli-timeout",
            "60",
            "--allowed-target-prefix",
            pods.to_str().unwrap(),
        ],
        &[("CRUST_TEST_CLI_MAP", map.to_str().unwrap())],
    );
    let mut c = daemon.client().await;

    // Stage: the record on disk, byte for byte, root-only.
    c.runtime_stage_volume(stage_req_fs(&target, lo.dev_str(), fs))
        .await
        .unwrap();
    let mnt = lo.mount(&guest_view, &[], false);
    // Staging it again (same record) does not look at the device.
    c.runtime_stage_volume(stage_req_fs(&target, lo.dev_str(), fs))
        .await
        .unwrap();
    // Issue 10, defect 1: a device mounted on the host is never handed to
    // a guest: FAILED_PRECONDITION naming the mount, no record written.
    let second = format!(
        "{}/uid-2/volumes/kubernetes.io~csi/pv-9/mount",
        pods.display()
    );
    let e = c
        .runtime_stage_volume(stage_req_fs(&second, lo.dev_str(), fs))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("in use") && e.message().contains(guest_view.to_str().unwrap()),
        "{e:?}"
    );
    assert!(!crust_root.join(crust_key(&second)).exists());
    let dir = crust_root.join(crust_key(&target));
    // The record proves which device it names (its backing file).
    let identity = {
        use std::os::fd::AsFd;
        let fd = rustix::fs::open(
            lo.dev(),
            rustix::fs::OFlags::RDONLY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        crust_blockdev::identity_of(fd.as_fd(), lo.dev()).unwrap()
    };
    assert!(identity.to_string().starts_with("file:"), "{identity}");
    let expected = format!(
        r#"{{"volume-type":"block","device":"{}","fstype":"{fs}","metadata":{{"deviceIdentity":"{identity}","fsGroup":"2000","fsGroupChangePolicy":"OnRootMismatch"}},"options":["noatime"]}}"#,
        lo.dev().display()
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("mountInfo.json")).unwrap(),
        expected
    );
    assert_eq!(mode(&crust_root), 0o700);
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("mountInfo.json")), 0o600);
    // Idempotent.
    c.runtime_stage_volume(stage_req_fs(&target, lo.dev_str(), fs))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.join("mountInfo.json")).unwrap(),
        expected
    );

    // Nobody consumed it yet.
    let e = c
        .runtime_get_volume_stats(stats_req(&target))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("not consumed by a runtime yet"),
        "{e:?}"
    );
    let e = c
        .runtime_expand_volume(expand_req(&target, grown, 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let e = c
        .runtime_freeze_volume(freeze_req(&target, 1000))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    // Unknown volume.
    let other = format!(
        "{}/uid-1/volumes/kubernetes.io~csi/pv-2/mount",
        pods.display()
    );
    let e = c
        .runtime_get_volume_stats(stats_req(&other))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = c
        .runtime_freeze_volume(freeze_req(&other, 1000))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // I/O limits before any runtime consumed it: recorded, for the plug.
    let applied =
        |r: tonic::Response<pb::RuntimeSetVolumeIoLimitsResponse>| r.into_inner().applied_live;
    assert!(!applied(
        c.runtime_set_volume_io_limits(limits_req(
            &target,
            &[("iops", "200"), ("readBps", "1048576")]
        ))
        .await
        .unwrap()
    ));
    assert_eq!(
        recorded_limits(&dir).as_deref(),
        Some("iops=200,readBps=1048576")
    );
    // Bad limits, a missing target, an unknown volume: refused, nothing
    // written; the codes in CSI's order (the request's fields first).
    for (req, code, needle) in [
        (
            limits_req(&target, &[("iopz", "1")]),
            Code::InvalidArgument,
            "iopz",
        ),
        (
            limits_req(&target, &[("iops", "fast")]),
            Code::InvalidArgument,
            "iops",
        ),
        (
            limits_req("", &[("iops", "1")]),
            Code::InvalidArgument,
            "volume_target_path",
        ),
        (limits_req(&other, &[("iops", "1")]), Code::NotFound, ""),
        (
            limits_req(&other, &[("iopz", "1")]),
            Code::InvalidArgument,
            "iopz",
        ),
    ] {
        let e = c.runtime_set_volume_io_limits(req).await.unwrap_err();
        assert_eq!(e.code(), code, "{e:?}");
        assert!(e.message().contains(needle), "{e:?}");
    }
    assert_eq!(
        recorded_limits(&dir).as_deref(),
        Some("iops=200,readBps=1048576")
    );
    assert!(!crust_root.join(crust_key(&other)).exists());
    // A freeze needs a time limit, and not an unbounded one.
    for ms in [0, 600_001] {
        let e = c
            .runtime_freeze_volume(freeze_req(&target, ms))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{ms}: {e:?}");
    }

    // The runtime takes the volume and records its CLI.
    consume(&crust_root, &target, CLI, "sandbox-a");

    // Stats are those of the real filesystem, payload included.
    let empty = assert_stats_match(&mut c, &target, mnt.target()).await;
    let data = vec![0xA5u8; 8 * MIB as usize];
    std::fs::write(mnt.target().join("payload"), &data).unwrap();
    let full = assert_stats_match(&mut c, &target, mnt.target()).await;
    assert!(
        full.2 >= empty.2 + 8 * MIB,
        "used {} -> {}",
        empty.2,
        full.2
    );
    assert_eq!(full.5, empty.5 + 1, "one more inode in use");

    // Expand.
    let e = c
        .runtime_expand_volume(expand_req(&target, grown, grown - MIB))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let r = c.runtime_expand_volume(expand_req(&target, grown, 0)).await;
    if fs == "ext4" && !crust_blockdev::can_grow_ext4_online() {
        // This host may not grow a mounted ext4 (the guest can): the CLI's
        // failure comes back as INTERNAL with its stderr, and the
        // filesystem is unchanged.
        let e = r.unwrap_err();
        assert_eq!(e.code(), Code::Internal, "{e:?}");
        assert!(e.message().contains("resize2fs"), "{e:?}");
        let now = assert_stats_match(&mut c, &target, mnt.target()).await;
        assert_eq!(now.1, full.1, "fs size unchanged");
    } else {
        assert_eq!(r.unwrap().into_inner().capacity_bytes, grown);
        assert_eq!(std::fs::metadata(lo.file()).unwrap().len(), grown as u64);
        let now = assert_stats_match(&mut c, &target, mnt.target()).await;
        assert!(
            now.1 >= full.1 + (grown - size) * 9 / 10,
            "fs total {} -> {}",
            full.1,
            now.1
        );
        // Again to the same size: idempotent.
        let r = c
            .runtime_expand_volume(expand_req(&target, grown, 0))
            .await
            .unwrap();
        assert_eq!(r.into_inner().capacity_bytes, grown);
    }
    // The data is untouched.
    assert_eq!(std::fs::read(mnt.target().join("payload")).unwrap(), data);

    // Freeze and thaw through the runtime (the test CLI FIFREEZEs its
    // mount): the thaw finds it frozen, a second thaw does not.
    std::fs::write(mnt.target().join("unsynced"), b"flushed by the freeze").unwrap();
    c.runtime_freeze_volume(freeze_req(&target, 30_000))
        .await
        .unwrap();
    let thawed = |r: tonic::Response<pb::RuntimeThawVolumeResponse>| r.into_inner().stayed_frozen;
    assert!(thawed(
        c.runtime_thaw_volume(thaw_req(&target)).await.unwrap()
    ));
    assert!(!thawed(
        c.runtime_thaw_volume(thaw_req(&target)).await.unwrap()
    ));
    std::fs::write(mnt.target().join("after"), b"writable again").unwrap();

    // I/O limits of a consumed volume: the record and the guest (the
    // runtime's `crust throttle`); an empty map lifts them.
    let throttled = format!("{}.throttled", map.display());
    assert!(applied(
        c.runtime_set_volume_io_limits(limits_req(&target, &[("iops", "100")]))
            .await
            .unwrap()
    ));
    assert_eq!(recorded_limits(&dir).as_deref(), Some("iops=100"));
    assert!(applied(
        c.runtime_set_volume_io_limits(limits_req(&target, &[]))
            .await
            .unwrap()
    ));
    assert_eq!(recorded_limits(&dir), None);
    assert_eq!(
        std::fs::read_to_string(&throttled).unwrap(),
        format!("{target} iops=100\n{target} \n")
    );

    // The sandbox still has the volume: unstage is refused, nothing changes
    // (the CO's next publish must not hand the device to a second VM).
    let record = std::fs::read(dir.join("mountInfo.json")).unwrap();
    let e = c
        .runtime_unstage_volume(unstage_req(&target))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().starts_with(&format!(
            "volume at {target} is still claimed by sandbox sandbox-a; stop the sandbox first"
        )),
        "{e:?}"
    );
    assert_eq!(std::fs::read(dir.join("mountInfo.json")).unwrap(), record);
    assert!(dir.join("sandbox-a").is_file() && dir.join("runtime-cli").is_file());
    assert_stats_match(&mut c, &target, mnt.target()).await;

    // The sandbox dies without releasing its claim: its runtime now says
    // `stopped` (crust sandbox-state) and the device is free, so the claim
    // is stale and goes with the record.
    let guest_view = mnt.target().to_path_buf();
    mnt.unmount().unwrap();
    let st = c
        .runtime_get_volume_stats(stats_req(&target))
        .await
        .unwrap()
        .into_inner();
    let cond = st.volume_condition.unwrap();
    assert!(
        cond.abnormal && cond.message.contains("is not running"),
        "{cond:?}"
    );
    assert!(guest_view.is_dir());

    // Unstage twice; afterwards the volume is unknown.
    c.runtime_unstage_volume(unstage_req(&target))
        .await
        .unwrap();
    assert!(!dir.exists());
    c.runtime_unstage_volume(unstage_req(&target))
        .await
        .unwrap();
    let e = c
        .runtime_get_volume_stats(stats_req(&target))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    let status = daemon.stop();
    assert!(status.success(), "{status}");
    assert!(
        !t.join("run/ops.sock").exists(),
        "socket removed on SIGTERM"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_runtime_clis() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let devs = t.join("devs");
    std::fs::create_dir(&devs).unwrap();
    let img = devs.join("disk.img");
    std::fs::write(&img, vec![0u8; 4096]).unwrap();
    let crust_root = t.join("crust");
    let map = t.join("map.json");
    let pidfile = t.join("hang.pid");
    let [hang, garbage, fail, noexec, relative] = [
        "/v/hang",
        "/v/garbage",
        "/v/fail",
        "/v/noexec",
        "/v/relative",
    ];
    write_map(
        &map,
        serde_json::json!({
            hang: {"behaviour": "hang", "pidfile": pidfile, "sandbox": "sb-hang"},
            garbage: {"behaviour": "garbage", "sandbox": "sb-garbage"},
            fail: {"behaviour": "fail", "sandbox": "sb-fail"},
        }),
    );
    let daemon = Daemon::start(
        &t.join("ops.sock"),
        &[
            "--crust-root",
            crust_root.to_str().unwrap(),
            "--cli-timeout",
            "1.5",
            "--allow-file-devices-under",
            devs.to_str().unwrap(),
        ],
        &[("CRUST_TEST_CLI_MAP", map.to_str().unwrap())],
    );
    let mut c = daemon.client().await;
    for target in [hang, garbage, fail, noexec, relative] {
        c.runtime_stage_volume(stage_req(target, img.to_str().unwrap()))
            .await
            .unwrap();
        consume(&crust_root, target, CLI, &format!("sb-{}", &target[3..]));
    }

    // Hangs: DEADLINE_EXCEEDED within the timeout, and the CLI is killed.
    let t0 = Instant::now();
    let e = c
        .runtime_get_volume_stats(stats_req(hang))
        .await
        .unwrap_err();
    let took = t0.elapsed();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(15),
        "{took:?}"
    );
    let pid: u32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let t0 = Instant::now();
    while !is_dead(pid) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "hung CLI {pid} still alive"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let e = c
        .runtime_expand_volume(expand_req(hang, 1 << 30, 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");

    // Garbage: INTERNAL, saying so.
    let e = c
        .runtime_get_volume_stats(stats_req(garbage))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    assert!(e.message().contains("unusable output"), "{e:?}");
    let e = c
        .runtime_expand_volume(expand_req(garbage, 1 << 30, 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Internal, "{e:?}");

    // Non-zero exit: INTERNAL carrying its stderr.
    let e = c
        .runtime_get_volume_stats(stats_req(fail))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    assert!(e.message().contains("sandbox for /v/fail is gone"), "{e:?}");

    // A recorded CLI that is not executable, or not absolute.
    let store = Store::new(Layout::Crust, &crust_root, Policy::default()).unwrap();
    let plain = t.join("not-a-program");
    std::fs::write(&plain, "#!/bin/sh\n").unwrap();
    store
        .set_runtime_cli(noexec, plain.to_str().unwrap())
        .unwrap();
    let e = c
        .runtime_get_volume_stats(stats_req(noexec))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("not executable"), "{e:?}");
    std::fs::write(
        store.record_dir(relative).unwrap().join("runtime-cli"),
        "bin/sh",
    )
    .unwrap();
    let e = c
        .runtime_get_volume_stats(stats_req(relative))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("not absolute"), "{e:?}");

    // Unstage of a claimed record while the claimant's liveness cannot be
    // established: refused, record and claim kept. Each case says why.
    for (target, why) in [
        (hang, "did not finish within"),
        (garbage, "unusable output"),
        (fail, "sandbox sb-fail is gone"),
        (noexec, "not executable"),
        (relative, "not absolute"),
    ] {
        let e = c
            .runtime_unstage_volume(unstage_req(target))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{target}: {e:?}");
        assert!(
            e.message().contains(&format!(
                "volume at {target} is still claimed by sandbox sb"
            )) && e.message().contains(why),
            "{target}: {e:?}"
        );
        let dir = store.record_dir(target).unwrap();
        assert!(
            dir.join("mountInfo.json").is_file()
                && dir.join(format!("sb-{}", &target[3..])).is_file(),
            "{target}: record kept"
        );
    }

    // A claim without a runtime-cli: nobody to ask, refused.
    let orphan = "/v/orphan";
    c.runtime_stage_volume(stage_req(orphan, img.to_str().unwrap()))
        .await
        .unwrap();
    store.claim(orphan, "sb", |_| true).unwrap();
    let e = c
        .runtime_unstage_volume(unstage_req(orphan))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("no runtime-cli is recorded"), "{e:?}");
    assert!(store.record_dir(orphan).unwrap().join("sb").is_file());
    // ...until its sandbox releases it.
    store.release(orphan, "sb").unwrap();
    c.runtime_unstage_volume(unstage_req(orphan)).await.unwrap();
    assert!(!store.record_dir(orphan).unwrap().exists());

    // Only `stopped` (with a free device) releases a claim. `running`,
    // `unknown` (issue 10: a runtime root that does not know the id), a
    // CLI without the verb, and stats text saying "is not running" (what a
    // guest can make stats say) all keep it.
    for (target, behaviour, released) in [
        ("/v/stopped", "stopped", true),
        ("/v/unknown", "unknown", false),
        ("/v/running", "running", false),
        ("/v/no-verb", "unsupported", false),
    ] {
        let sb = format!("sb-{behaviour}");
        let mut m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&map).unwrap()).unwrap();
        m[target] = serde_json::json!({ "behaviour": behaviour, "sandbox": sb });
        write_map(&map, m);
        c.runtime_stage_volume(stage_req(target, img.to_str().unwrap()))
            .await
            .unwrap();
        consume(&crust_root, target, CLI, &sb);
        let r = c.runtime_unstage_volume(unstage_req(target)).await;
        let dir = store.record_dir(target).unwrap();
        if released {
            r.unwrap();
            assert!(!dir.exists(), "{behaviour}");
        } else {
            let e = r.unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition, "{behaviour}: {e:?}");
            assert!(e.message().contains("still claimed by sandbox"), "{e:?}");
            assert!(dir.join(&sb).is_file() && dir.join("mountInfo.json").is_file());
            store.release(target, &sb).unwrap();
            c.runtime_unstage_volume(unstage_req(target)).await.unwrap();
        }
    }

    assert!(daemon.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_invalid_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let devs = t.join("devs");
    std::fs::create_dir(&devs).unwrap();
    let img = devs.join("disk.img");
    std::fs::write(&img, vec![0u8; 4096]).unwrap();
    let img = img.to_str().unwrap().to_string();
    let outside = t.join("outside.img");
    std::fs::write(&outside, vec![0u8; 4096]).unwrap();
    let crust_root = t.join("crust");
    let kata_root = t.join("kata");
    let daemon = Daemon::start(
        &t.join("ops.sock"),
        &[
            "--layout",
            "both",
            "--crust-root",
            crust_root.to_str().unwrap(),
            "--kata-root",
            kata_root.to_str().unwrap(),
            "--allowed-target-prefix",
            "/var/lib/kubelet/pods",
            "--allow-file-devices-under",
            devs.to_str().unwrap(),
        ],
        &[],
    );
    let mut c = daemon.client().await;
    let good_target = "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount";
    type Mutate = Box<dyn Fn(&mut crust_proto::runtime::v1alpha1::RuntimeStageVolumeRequest)>;
    let cases: Vec<(&str, Mutate)> = vec![
        (
            "relative target",
            Box::new(|r| r.volume_target_path = "pods/x".into()),
        ),
        (
            "dotdot target",
            Box::new(|r| r.volume_target_path = "/var/lib/kubelet/pods/../../../etc".into()),
        ),
        (
            "outside prefix",
            Box::new(|r| r.volume_target_path = "/etc/x".into()),
        ),
        (
            "too long for kata",
            Box::new(|r| {
                r.volume_target_path = format!("/var/lib/kubelet/pods/{}", "a".repeat(300))
            }),
        ),
        (
            "network",
            Box::new(|r| r.volume_type.as_mut().unwrap().r#type = 2),
        ),
        ("no type", Box::new(|r| r.volume_type = None)),
        (
            "secret",
            Box::new(|r| r.mount_flags = vec!["password=hunter2".into()]),
        ),
        ("bad flag", Box::new(|r| r.mount_flags = vec!["a b".into()])),
        ("fstype", Box::new(|r| r.fs_type = "ntfs".into())),
        (
            "no device",
            Box::new(|r| r.volume_backing_path = "/dev/crust-missing".into()),
        ),
        (
            "file outside roots",
            Box::new(move |r| r.volume_backing_path = "/etc/hostname".into()),
        ),
        (
            "group",
            Box::new(|r| r.volume_supplemental_group = "wheel".into()),
        ),
        (
            "policy",
            Box::new(|r| {
                r.volume_supplemental_group_change_policy
                    .as_mut()
                    .unwrap()
                    .policy = 9
            }),
        ),
    ];
    for (what, mutate) in cases {
        let mut r = stage_req(good_target, &img);
        mutate(&mut r);
        let e = c.runtime_stage_volume(r).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
        assert!(!e.message().contains("hunter2"), "secret echoed: {e:?}");
        assert!(
            !crust_root.exists() && !kata_root.exists(),
            "{what}: something was written"
        );
    }
    let mut r = stage_req(good_target, &img);
    r.volume_backing_path = outside.to_str().unwrap().into();
    assert_eq!(
        c.runtime_stage_volume(r).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    for target in ["", "relative", "/etc/passwd"] {
        let e = c
            .runtime_unstage_volume(unstage_req(target))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{target:?}");
        let e = c
            .runtime_get_volume_stats(stats_req(target))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{target:?}");
    }
    let e = c
        .runtime_expand_volume(expand_req(good_target, -1, 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(!crust_root.exists() && !kata_root.exists());

    // Layout both: one stage, two records.
    c.runtime_stage_volume(stage_req(good_target, &img))
        .await
        .unwrap();
    assert!(
        crust_root
            .join(crust_key(good_target))
            .join("mountInfo.json")
            .is_file()
    );
    assert!(
        kata_root
            .join(kata_key(good_target))
            .join("mountInfo.json")
            .is_file()
    );
    // A different record while a sandbox holds it: ALREADY_EXISTS.
    let kata = Store::new(Layout::Kata, &kata_root, Policy::default()).unwrap();
    kata.claim(good_target, "sb", |_| true).unwrap();
    let mut r = stage_req(good_target, &img);
    r.fs_type = "xfs".into();
    let e = c.runtime_stage_volume(r).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    // ...and the CRUST record was not rewritten either.
    let raw = std::fs::read_to_string(
        crust_root
            .join(crust_key(good_target))
            .join("mountInfo.json"),
    )
    .unwrap();
    assert!(raw.contains(r#""fstype":"ext4""#), "{raw}");
    // ...and the CRUST record was not rewritten either.
    let crust = Store::new(Layout::Crust, &crust_root, Policy::default()).unwrap();
    assert!(
        crust
            .inspect(good_target)
            .is_err_and(|e| e.to_string().contains("file-device roots"))
            || crust.inspect(good_target).unwrap().mount_info.fstype == "ext4"
    );
    let raw = std::fs::read_to_string(
        crust_root
            .join(crust_key(good_target))
            .join("mountInfo.json"),
    )
    .unwrap();
    assert!(raw.contains(r#""fstype":"ext4""#), "{raw}");
    c.runtime_unstage_volume(unstage_req(good_target))
        .await
        .unwrap();
    assert!(!crust_root.join(crust_key(good_target)).exists());
    assert!(!kata_root.join(kata_key(good_target)).exists());
    assert!(daemon.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kata_layout_through_a_fake_kata_runtime() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let devs = t.join("devs");
    std::fs::create_dir(&devs).unwrap();
    let img = devs.join("disk.img");
    std::fs::write(&img, vec![0u8; 4096]).unwrap();
    let kata_root = t.join("kata");
    let log = t.join("kata.log");
    // Prints what Kata's shim marshals (numeric units, omitempty zeros);
    // resize prints nothing, like kata-runtime.
    let fake = t.join("kata-runtime");
    std::fs::write(
        &fake,
        format!(
            r#"#!/bin/sh
echo "$@" >> {log}
case "$2" in
  stats) echo '{{"usage":[{{"available":1000,"total":4000,"used":3000,"unit":1}},{{"available":7,"total":9,"used":2,"unit":2}}],"volume_condition":{{"message":"ok"}}}}' ;;
  resize) ;;
  *) echo "unknown $2" >&2; exit 2 ;;
esac
"#,
            log = log.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let daemon = Daemon::start(
        &t.join("ops.sock"),
        &[
            "--layout",
            "kata",
            "--kata-root",
            kata_root.to_str().unwrap(),
            "--kata-runtime",
            fake.to_str().unwrap(),
            "--allow-file-devices-under",
            devs.to_str().unwrap(),
            "--kata-shim-dir",
            t.join("vc-sbs").to_str().unwrap(),
        ],
        &[],
    );
    let mut c = daemon.client().await;
    let target = "/kubelet/kata-test-vol-001/volume001";
    c.runtime_stage_volume(stage_req(target, img.to_str().unwrap()))
        .await
        .unwrap();
    let dir = kata_root.join("L2t1YmVsZXQva2F0YS10ZXN0LXZvbC0wMDEvdm9sdW1lMDAx");
    assert_eq!(
        std::fs::read_to_string(dir.join("mountInfo.json")).unwrap(),
        format!(
            r#"{{"volume-type":"directvol","device":"{}","fstype":"ext4","metadata":{{"fsGroup":"2000","fsGroupChangePolicy":"OnRootMismatch"}},"options":["noatime"]}}"#,
            img.display()
        )
    );
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("mountInfo.json")), 0o600);

    // No sandbox file yet.
    let e = c
        .runtime_get_volume_stats(stats_req(target))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        !log.exists(),
        "kata-runtime must not be called before a sandbox took the volume"
    );

    // What the Kata shim writes when a sandbox uses the volume.
    std::fs::write(dir.join("c9be9e0c63af5a"), "").unwrap();
    let r = c
        .runtime_get_volume_stats(stats_req(target))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(proto_usage(&r), (1000, 4000, 3000, 7, 9, 2));
    assert_eq!(r.volume_condition.unwrap().message, "ok");

    let r = c
        .runtime_expand_volume(expand_req(target, 5 << 30, 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 5 << 30);
    let r = c
        .runtime_expand_volume(expand_req(target, 0, 6 << 30))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 6 << 30);
    let e = c
        .runtime_expand_volume(expand_req(target, 0, 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    // Kata's runtime cannot freeze a guest's filesystem: a snapshot of this
    // volume is FAILED_PRECONDITION, and kata-runtime is not even asked.
    for e in [
        c.runtime_freeze_volume(freeze_req(target, 1000))
            .await
            .unwrap_err(),
        c.runtime_thaw_volume(thaw_req(target)).await.unwrap_err(),
    ] {
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    }
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        format!(
            "direct-volume stats --volume-path {target}\n\
             direct-volume resize --volume-path {target} --size {}\n\
             direct-volume resize --volume-path {target} --size {}\n",
            5u64 << 30,
            6u64 << 30
        )
    );
    // Kata's shim for the claimant still answers: its VM may have the
    // device, so the record and claim stay (Kata's CLI would exit 0).
    let shim_dir = t.join("vc-sbs/c9be9e0c63af5a");
    std::fs::create_dir_all(&shim_dir).unwrap();
    let listener =
        std::os::unix::net::UnixListener::bind(shim_dir.join("shim-monitor.sock")).unwrap();
    let e = c
        .runtime_unstage_volume(unstage_req(target))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("Kata's shim answers"), "{e:?}");
    assert!(dir.join("c9be9e0c63af5a").is_file() && dir.join("mountInfo.json").is_file());
    // The shim is gone (its socket file left behind, refusing): released.
    drop(listener);
    c.runtime_unstage_volume(unstage_req(target)).await.unwrap();
    assert!(!dir.exists());
    assert!(daemon.stop().success());
}

#[test]
fn daemon_socket_lifecycle() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let sock = t.join("fresh/dir/ops.sock");
    let root = t.join("crust");
    let args = ["--crust-root", root.to_str().unwrap()];
    let d = Daemon::start(&sock, &args, &[]);
    assert_eq!(mode(&sock), 0o600);
    assert_eq!(mode(sock.parent().unwrap()), 0o700);
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::symlink_metadata(&sock)
            .unwrap()
            .file_type()
            .is_socket()
    );

    // A second daemon on a live socket is refused and leaves it alone.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_crust-ops"))
        .args(["--endpoint", &format!("unix://{}", sock.display())])
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("another live process"),
        "{out:?}"
    );
    assert!(std::os::unix::net::UnixStream::connect(&sock).is_ok());

    // SIGTERM: clean exit, socket removed.
    assert!(d.stop().success());
    assert!(!sock.exists());

    // A stale socket file (bound, nobody listening) is replaced.
    let stale = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    drop(stale);
    assert!(sock.exists());
    let d = Daemon::start(&sock, &args, &[]);
    assert_eq!(mode(&sock), 0o600);
    assert!(d.stop().success());

    // A regular file at the path: refused, untouched.
    std::fs::write(&sock, "precious").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_crust-ops"))
        .args(["--endpoint", &format!("unix://{}", sock.display())])
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a socket"),
        "{out:?}"
    );
    assert_eq!(std::fs::read_to_string(&sock).unwrap(), "precious");
}
