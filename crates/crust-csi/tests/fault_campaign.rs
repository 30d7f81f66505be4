//! Issue 10, fault campaign: volume lifecycles against the real
//! `crust-csi` while the plugin is SIGKILLed at random points (during an
//! RPC, a random few milliseconds in) and restarted; every RPC is retried
//! until it succeeds, as a CO does. After the campaign: every volume is
//! present (a long-lived one, its checksum intact) or cleanly gone, the
//! state is readable, no loop device or mount is left, the pool's
//! accounting equals the files on disk, and each cycle's checksum, written
//! through a host publication, was intact after a restage.
//!
//! CI form: 200 cycles (budget ~3 min on 2 cores). Long form:
//! `CRUST_FAULT_CYCLES=2000 cargo test -p crust-csi --test fault_campaign -- --nocapture`
//! (`CRUST_FAULT_SEED` replays a run).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use common::*;
use crust_proto::csi::v1 as csi;
use sha2::{Digest, Sha256};
use tonic::Code;

/// xorshift64*: no dependency, reproducible from the printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Campaign {
    node: TestNode,
    rng: Rng,
    kills: u32,
    retries: u32,
    /// Unexpected answers (a code a retry cannot explain).
    anomalies: Vec<String>,
}

/// Answers a call may get when the plugin died under it or a previous
/// attempt half-happened (a tool the killed plugin started, such as mkfs,
/// still holding the device); anything else is an anomaly.
fn retryable(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Aborted | Code::Cancelled | Code::Unknown
    ) || (s.code() == Code::FailedPrecondition && s.message().contains("still running"))
}

impl Campaign {
    /// Runs `f` until it succeeds; with probability 1/`kill_one_in` the
    /// plugin is SIGKILLed a random 0-40 ms into the call, restarted, and
    /// the call repeated (it must be idempotent).
    async fn call<T, F, Fut>(&mut self, what: &str, kill_one_in: u64, f: F) -> T
    where
        F: Fn(Clients) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>> + Send + 'static,
        T: Send + 'static,
    {
        // Bounded by time, not attempts: a tool the killed plugin started
        // (mkfs) may hold the device for a while on a loaded machine.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        loop {
            assert!(
                std::time::Instant::now() < deadline,
                "{what}: no success within 60 s; last answer: {last}; anomalies: {:?}",
                self.anomalies
            );
            let c = self.node.clients().await;
            if self.rng.below(kill_one_in) == 0 {
                let call = tokio::spawn(f(c));
                tokio::time::sleep(Duration::from_millis(self.rng.below(40))).await;
                self.node.crash();
                self.kills += 1;
                let _ = call.await;
                self.node.start();
                continue;
            }
            match f(c).await {
                Ok(v) => return v,
                Err(s) => {
                    last = format!("{:?}: {}", s.code(), s.message());
                    if !retryable(&s) {
                        self.anomalies.push(format!("{what}: {last}"));
                    }
                    self.retries += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
}

type Call<T> =
    Box<dyn Fn(Clients) -> Pin<Box<dyn Future<Output = Result<T, tonic::Status>> + Send>>>;

fn create_f(name: &str) -> Call<csi::Volume> {
    let name = name.to_string();
    Box::new(move |mut c| {
        let name = name.clone();
        Box::pin(async move {
            c.create(create_req(&name, 16 * MIB, vec![mount("ext4")]))
                .await
        })
    })
}

fn stage_f(id: &str, s: &str) -> Call<()> {
    let (id, s) = (id.to_string(), s.to_string());
    Box::new(move |mut c| {
        let (id, s) = (id.clone(), s.clone());
        Box::pin(async move { c.stage(&id, &s, mount("ext4")).await })
    })
}

fn publish_f(id: &str, s: &str, t: &str) -> Call<()> {
    let (id, s, t) = (id.to_string(), s.to_string(), t.to_string());
    Box::new(move |mut c| {
        let (id, s, t) = (id.clone(), s.clone(), t.clone());
        Box::pin(async move { c.publish(&id, &s, &t, mount("ext4"), false).await })
    })
}

fn unpublish_f(id: &str, t: &str) -> Call<()> {
    let (id, t) = (id.to_string(), t.to_string());
    Box::new(move |mut c| {
        let (id, t) = (id.clone(), t.clone());
        Box::pin(async move { c.unpublish(&id, &t).await })
    })
}

fn unstage_f(id: &str, s: &str) -> Call<()> {
    let (id, s) = (id.to_string(), s.to_string());
    Box::new(move |mut c| {
        let (id, s) = (id.clone(), s.clone());
        Box::pin(async move { c.unstage(&id, &s).await })
    })
}

fn delete_f(id: &str) -> Call<()> {
    let id = id.to_string();
    Box::new(move |mut c| {
        let id = id.clone();
        Box::pin(async move { c.delete(&id).await })
    })
}

fn write_synced(path: &str, data: &[u8]) {
    std::fs::write(path, data).unwrap();
    std::fs::File::open(path).unwrap().sync_all().unwrap();
}

fn payload(rng: &mut Rng) -> Vec<u8> {
    (0..64 * 1024).map(|_| rng.next() as u8).collect()
}

fn sha(b: &[u8]) -> Vec<u8> {
    Sha256::digest(b).to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_cycles_with_the_plugin_sigkilled_at_random_points() {
    let cycles: u64 = std::env::var("CRUST_FAULT_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let seed: u64 = std::env::var("CRUST_FAULT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("fault campaign: {cycles} cycles, CRUST_FAULT_SEED={seed}");
    let node = TestNode::with_args(&["--pool-capacity", "4Gi"]);
    let mut k = Campaign {
        node,
        rng: Rng(seed),
        kills: 0,
        retries: 0,
        anomalies: Vec::new(),
    };
    let t0 = Instant::now();

    // A long-lived volume with a checksum, present through the campaign.
    let keeper_staging = k.node.mkdir("staging/keeper");
    let keeper_target = format!("{}/keeper", k.node.mkdir("pods/keeper"));
    let keeper_id = k
        .call("create keeper", u64::MAX, create_f("keeper"))
        .await
        .volume_id;
    let keeper_data = payload(&mut k.rng);
    k.call(
        "stage keeper",
        u64::MAX,
        stage_f(&keeper_id, &keeper_staging),
    )
    .await;
    k.call(
        "publish keeper",
        u64::MAX,
        publish_f(&keeper_id, &keeper_staging, &keeper_target),
    )
    .await;
    write_synced(&format!("{keeper_target}/data"), &keeper_data);
    k.call(
        "unpublish keeper",
        u64::MAX,
        unpublish_f(&keeper_id, &keeper_target),
    )
    .await;
    k.call(
        "unstage keeper",
        u64::MAX,
        unstage_f(&keeper_id, &keeper_staging),
    )
    .await;

    // One kill in KILL_ONE_IN calls: about one per cycle of 11 calls.
    const KILL_ONE_IN: u64 = 10;
    for cycle in 0..cycles {
        let name = format!("cycle-{}", cycle % 4);
        let staging = k.node.mkdir(&format!("staging/{name}"));
        let target = format!("{}/t", k.node.mkdir(&format!("pods/{name}")));
        let id = k
            .call("CreateVolume", KILL_ONE_IN, create_f(&name))
            .await
            .volume_id;
        k.call("NodeStageVolume", KILL_ONE_IN, stage_f(&id, &staging))
            .await;
        k.call(
            "NodePublishVolume",
            KILL_ONE_IN,
            publish_f(&id, &staging, &target),
        )
        .await;
        let data = payload(&mut k.rng);
        write_synced(&format!("{target}/data"), &data);
        k.call(
            "NodeUnpublishVolume",
            KILL_ONE_IN,
            unpublish_f(&id, &target),
        )
        .await;
        k.call("NodeUnstageVolume", KILL_ONE_IN, unstage_f(&id, &staging))
            .await;
        // Restage: the checksum written through the host publication.
        k.call("NodeStageVolume again", KILL_ONE_IN, stage_f(&id, &staging))
            .await;
        k.call(
            "NodePublishVolume again",
            KILL_ONE_IN,
            publish_f(&id, &staging, &target),
        )
        .await;
        let back = std::fs::read(format!("{target}/data")).unwrap();
        assert_eq!(
            sha(&back),
            sha(&data),
            "cycle {cycle}: checksum after restage"
        );
        k.call(
            "NodeUnpublishVolume again",
            KILL_ONE_IN,
            unpublish_f(&id, &target),
        )
        .await;
        k.call(
            "NodeUnstageVolume again",
            KILL_ONE_IN,
            unstage_f(&id, &staging),
        )
        .await;
        k.call("DeleteVolume", KILL_ONE_IN, delete_f(&id)).await;
        if cycle % 50 == 49 {
            eprintln!(
                "cycle {}: {} kills, {} retries, {:.0}s",
                cycle + 1,
                k.kills,
                k.retries,
                t0.elapsed().as_secs_f64()
            );
        }
    }

    // One last restart: the state must be readable from disk.
    k.node.crash();
    k.node.start();
    let mut c = k.node.clients().await;
    let ids: Vec<String> = c
        .list_all()
        .await
        .into_iter()
        .map(|e| e.volume.unwrap().volume_id)
        .collect();
    assert_eq!(
        ids,
        std::slice::from_ref(&keeper_id),
        "only the long-lived volume is left"
    );
    assert!(
        loops_under(k.node.dir.path()).is_empty(),
        "no loop device left"
    );
    assert!(mounts_under(k.node.dir.path()).is_empty(), "no mount left");
    // Pool accounting equals the files on disk.
    let on_disk: u64 = std::fs::read_dir(&k.node.pool)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("vol-"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert_eq!(on_disk, 16 * MIB as u64, "one backing file: the keeper's");
    let cap = c
        .ctl
        .get_capacity(csi::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    // The pool offers what its capacity leaves after the files on disk,
    // or less when the host filesystem itself has less free space.
    let expect = (4u64 << 30) - on_disk;
    let st = rustix::fs::statvfs(&k.node.pool).unwrap();
    let fs_free = st.f_bavail * st.f_frsize;
    let got = cap.available_capacity as u64;
    assert!(
        got == expect || (got < expect && got.abs_diff(fs_free) < 256 * MIB as u64),
        "{cap:?}: expected {expect} (or the {fs_free} bytes free on the host)"
    );
    // The keeper's data survived every kill.
    c.stage(&keeper_id, &keeper_staging, mount("ext4"))
        .await
        .unwrap();
    c.publish(
        &keeper_id,
        &keeper_staging,
        &keeper_target,
        mount("ext4"),
        false,
    )
    .await
    .unwrap();
    assert_eq!(
        sha(&std::fs::read(format!("{keeper_target}/data")).unwrap()),
        sha(&keeper_data)
    );
    c.unpublish(&keeper_id, &keeper_target).await.unwrap();
    c.unstage(&keeper_id, &keeper_staging).await.unwrap();
    c.delete(&keeper_id).await.unwrap();
    eprintln!(
        "fault campaign: {cycles} cycles, {} SIGKILLs, {} retries, {} anomalies, {:.0}s",
        k.kills,
        k.retries,
        k.anomalies.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(k.kills as u64 >= cycles / 2, "too few kills: {}", k.kills);
    assert!(k.anomalies.is_empty(), "anomalies: {:#?}", k.anomalies);
}
