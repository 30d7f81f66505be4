//! Benchmark of the real `crust-csi` binary (pool backend, real loop
//! devices and mounts). Ignored by default; run with
//!
//! ```text
//! cargo test -p crust-csi --release --test bench -- --ignored --nocapture
//! ```
//!
//! Reports ops/s and p50/p99 latency for CreateVolume+DeleteVolume, the
//! stage/publish/unpublish/unstage cycle, and NodeGetVolumeStats (with
//! the health cache off and with the default 5 s TTL); `deferral_bench`:
//! NodePublishVolume/NodeUnpublishVolume with deferred filesystem
//! operations (hand-off record through crust_ops) and NodeGetVolumeStats
//! through crust_ops and `crust-test-runtime-cli`. Nothing is asserted
//! about speed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use crust_proto::csi::v1 as csi;

struct Stats(Vec<Duration>);

impl Stats {
    fn report(&mut self, what: &str, ops_per_sample: usize) {
        self.0.sort();
        let total: Duration = self.0.iter().sum();
        let n = self.0.len();
        let pct = |p: f64| self.0[((n as f64 * p).ceil() as usize).clamp(1, n) - 1];
        println!(
            "{what:<44} n={n:<5} {:>9.1} ops/s   p50 {:>8.3} ms   p99 {:>8.3} ms",
            (n * ops_per_sample) as f64 / total.as_secs_f64(),
            pct(0.50).as_secs_f64() * 1e3,
            pct(0.99).as_secs_f64() * 1e3,
        );
    }
}

async fn time<F: std::future::Future<Output = ()>>(samples: &mut Vec<Duration>, f: F) {
    let t = Instant::now();
    f.await;
    samples.push(t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run explicitly with --ignored --nocapture"]
async fn csi_bench() {
    let node = TestNode::build(&["--pool-capacity", "20Gi"], "0s");
    let mut c = node.clients().await;

    // CreateVolume + DeleteVolume pairs
    let (mut create, mut delete, mut pair) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..300 {
        let t = Instant::now();
        let mut id = String::new();
        time(&mut create, async {
            id = c
                .create(create_req(
                    &format!("bench-{i}"),
                    64 * MIB,
                    vec![mount("ext4")],
                ))
                .await
                .unwrap()
                .volume_id;
        })
        .await;
        time(&mut delete, async { c.delete(&id).await.unwrap() }).await;
        pair.push(t.elapsed());
    }
    Stats(create).report("CreateVolume (64 MiB)", 1);
    Stats(delete).report("DeleteVolume", 1);
    Stats(pair).report("CreateVolume+DeleteVolume pair", 1);

    // stage/publish/unpublish/unstage on one ext4 volume (first stage
    // formats it and is not counted)
    let v = c
        .create(create_req("cycle", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/cycle");
    let target = format!("{}/t", node.mkdir("pods"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    let (mut st, mut pb, mut up, mut us, mut cyc) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..100 {
        let t = Instant::now();
        time(&mut st, async {
            c.stage(&id, &staging, mount("ext4")).await.unwrap()
        })
        .await;
        time(&mut pb, async {
            c.publish(&id, &staging, &target, mount("ext4"), false)
                .await
                .unwrap()
        })
        .await;
        time(&mut up, async { c.unpublish(&id, &target).await.unwrap() }).await;
        time(&mut us, async { c.unstage(&id, &staging).await.unwrap() }).await;
        cyc.push(t.elapsed());
    }
    Stats(st).report("NodeStageVolume (attach + mount)", 1);
    Stats(pb).report("NodePublishVolume (bind)", 1);
    Stats(up).report("NodeUnpublishVolume", 1);
    Stats(us).report("NodeUnstageVolume (umount + detach)", 1);
    Stats(cyc).report("stage/publish/unpublish/unstage cycle", 1);

    // NodeGetVolumeStats on a published volume, health cache off
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    let mut s = Vec::new();
    for _ in 0..2000 {
        time(&mut s, async {
            let r = c.stats(&id, &target).await.unwrap();
            assert!(!r.volume_condition.unwrap().abnormal);
        })
        .await;
    }
    Stats(s).report("NodeGetVolumeStats (health TTL 0s)", 1);
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    drop(c);
    drop(node);

    // the same with the default health cache
    let node = TestNode::build(&["--pool-capacity", "20Gi"], "5s");
    let mut c = node.clients().await;
    let id = c
        .create(create_req("cached", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/cached");
    let target = format!("{}/t", node.mkdir("pods"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    let mut s = Vec::new();
    for _ in 0..2000 {
        time(&mut s, async {
            c.stats(&id, &target).await.unwrap();
        })
        .await;
    }
    Stats(s).report("NodeGetVolumeStats (health TTL 5s)", 1);
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run explicitly with --ignored --nocapture"]
async fn deferral_bench() {
    let cli = runtime_cli();
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let mut r = create_req("deferred", 64 * MIB, vec![mount("ext4")]);
    r.parameters.insert("deferFsOps".into(), "true".into());
    let v = c.create(r).await.unwrap();
    let (id, ctx) = (v.volume_id, v.volume_context);
    let staging = node.mkdir("staging/deferred");
    c.node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.clone(),
            volume_capability: Some(mount("ext4")),
            volume_context: ctx.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let target = format!("{}/pv", node.mkdir("pods/uid/volumes"));
    let publish = csi::NodePublishVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.clone(),
        target_path: target.clone(),
        volume_capability: Some(mount("ext4")),
        volume_context: ctx.clone(),
        defer_fs_ops: true,
        ..Default::default()
    };
    let unpublish = csi::NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target.clone(),
        defer_fs_ops: true,
    };
    let (mut pb, mut up) = (Vec::new(), Vec::new());
    for _ in 0..300 {
        time(&mut pb, async {
            c.node.node_publish_volume(publish.clone()).await.unwrap();
        })
        .await;
        time(&mut up, async {
            c.node
                .node_unpublish_volume(unpublish.clone())
                .await
                .unwrap();
        })
        .await;
    }
    Stats(pb).report("NodePublishVolume (deferred: hand-off record)", 1);
    Stats(up).report("NodeUnpublishVolume (deferred)", 1);

    // a runtime consumes it; stats run its CLI through crust_ops
    c.node.node_publish_volume(publish.clone()).await.unwrap();
    let lo = loops_under(node.dir.path()).remove(0);
    let mut guest = GuestMount::new(&lo.path, &node.path("guest"), "ext4");
    let map = serde_json::json!({ &target: { "mount": guest.dir, "sandbox": "bench-sandbox" } });
    std::fs::write(node.cli_map(), map.to_string()).unwrap();
    consume(&node.crust_root(), &target, "bench-sandbox", &cli);
    let req = csi::NodeGetVolumeStatsRequest {
        volume_id: id.clone(),
        volume_path: target.clone(),
        defer_fs_ops: true,
        ..Default::default()
    };
    let mut s = Vec::new();
    for _ in 0..1000 {
        time(&mut s, async {
            let r = c
                .node
                .node_get_volume_stats(req.clone())
                .await
                .unwrap()
                .into_inner();
            assert!(!r.volume_condition.unwrap().abnormal);
        })
        .await;
    }
    Stats(s).report("NodeGetVolumeStats (deferred: crust_ops + CLI)", 1);
    guest.unmount();
    c.node.node_unpublish_volume(unpublish).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}
