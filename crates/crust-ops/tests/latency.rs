//! Latency figures (not assertions): RuntimeStageVolume over the socket,
//! the same in process, and RuntimeGetVolumeStats through crust-ops and the
//! runtime CLI on a real mount. Run with
//! `cargo test -p crust-ops --release --test latency -- --ignored --nocapture`.

mod support;

use std::time::{Duration, Instant};

use crust_blockdev::FsType;
use crust_handoff::{Layout, Policy, Store};
use crust_ops::{CrustOps, OpsConfig, StageRequest};
use crust_testkit::LoopDisk;
use support::*;

const CLI: &str = env!("CARGO_BIN_EXE_crust-test-runtime-cli");

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let pct = |p: f64| samples[((samples.len() as f64 - 1.0) * p).round() as usize];
    println!(
        "{what}: n={} p50={:?} p99={:?} max={:?}",
        samples.len(),
        pct(0.50),
        pct(0.99),
        samples[samples.len() - 1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: prints figures"]
async fn latency_figures() {
    crust_testkit::require_root();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let lo = LoopDisk::with_fs(t.join("vol.img"), 64 << 20, FsType::Ext4);
    let mnt = lo.mount(&t.join("mnt"), &[], false);
    let crust_root = t.join("crust");
    let target = "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount";
    let map = t.join("map.json");
    std::fs::write(
        &map,
        serde_json::json!({ target: {"mount": mnt.target(), "backing": lo.file(), "loop": lo.dev()} })
            .to_string(),
    )
    .unwrap();
    let daemon = Daemon::start(
        &t.join("ops.sock"),
        &["--crust-root", crust_root.to_str().unwrap()],
        &[("CRUST_TEST_CLI_MAP", map.to_str().unwrap())],
    );
    let mut c = daemon.client().await;

    // Warm up the connection.
    c.runtime_stage_volume(stage_req(target, lo.dev_str()))
        .await
        .unwrap();

    let mut fresh = Vec::new();
    for i in 0..300 {
        let tgt = format!("/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv-{i}/mount");
        let t0 = Instant::now();
        c.runtime_stage_volume(stage_req(&tgt, lo.dev_str()))
            .await
            .unwrap();
        fresh.push(t0.elapsed());
    }
    report("RuntimeStageVolume over the socket (new record)", fresh);

    let mut again = Vec::new();
    for _ in 0..300 {
        let t0 = Instant::now();
        c.runtime_stage_volume(stage_req(target, lo.dev_str()))
            .await
            .unwrap();
        again.push(t0.elapsed());
    }
    report(
        "RuntimeStageVolume over the socket (idempotent repeat)",
        again,
    );

    let ops = CrustOps::new(OpsConfig {
        crust_root: t.join("crust-inproc"),
        ..OpsConfig::default()
    })
    .unwrap();
    let mut inproc = Vec::new();
    for i in 0..300 {
        let t0 = Instant::now();
        ops.stage(StageRequest {
            target_path: format!("/p/{i}"),
            device: lo.dev_str().into(),
            fs_type: "ext4".into(),
            mount_flags: vec![],
            fs_group: Some(2000),
            fs_group_change_policy: None,
            io_limits: Default::default(),
        })
        .unwrap();
        inproc.push(t0.elapsed());
    }
    report("CrustOps::stage in process (new record)", inproc);

    let store = Store::new(Layout::Crust, &crust_root, Policy::default()).unwrap();
    store.claim(target, "sb", |_| true).unwrap();
    store.set_runtime_cli(target, CLI).unwrap();
    let mut stats = Vec::new();
    for _ in 0..200 {
        let t0 = Instant::now();
        c.runtime_get_volume_stats(stats_req(target)).await.unwrap();
        stats.push(t0.elapsed());
    }
    report(
        "RuntimeGetVolumeStats over the socket + runtime CLI (statvfs)",
        stats,
    );
    assert!(daemon.stop().success());
}
