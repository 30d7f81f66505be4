//! KEP-2857 story 1 end to end, on one guest boot: a pod with fsGroup
//! 2000 (`OnRootMismatch`) and a subPath runs in a real QEMU guest on a
//! volume of the real `crust-csi` plugin published with `defer_fs_ops`.
//! The guest shows the subPath at /data with the fsGroup applied, the
//! plugin's deferred stats equal the guest's `df`, the online expansion
//! shows in the guest, a snapshot taken while the pod runs freezes the
//! volume in the guest (unsynced bytes are in it), `bench --deferred`'s
//! measurement runs on the same pod, and after teardown a host
//! publication (no deferral) reads the bytes the workload wrote, and the
//! snapshot restores on the host.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod e2e_support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use crust_bench::deferred::{DeferredConfig, measure};
use crust_bench::{Limit, Scenario};
use crust_handoff::FsGroupChangePolicy;
use crust_kubesim::flow::{DeferVia, Flow};
use crust_proto::csi::v1 as csi;
use e2e_support::*;

struct Restored {
    snap: String,
    log: String,
    count: u64,
    hello: String,
    later: bool,
}

/// A new volume from `snapshot`, staged and published on the host; what
/// it holds, then everything undone.
async fn restore_on_host(st: &Stack, c: &crust_csi_client::Csi, snapshot: &str) -> Restored {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    let cap = csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    };
    let v = c
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-restored".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: (128 * MIB) as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            volume_content_source: Some(csi::VolumeContentSource {
                r#type: Some(csi::volume_content_source::Type::Snapshot(
                    csi::volume_content_source::SnapshotSource {
                        snapshot_id: snapshot.into(),
                    },
                )),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .volume
        .unwrap();
    let staging = st.root.join("restore/staging");
    let target = st.root.join("restore/target");
    std::fs::create_dir_all(&staging).unwrap();
    c.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.to_str().unwrap().into(),
        volume_capability: Some(cap.clone()),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.to_str().unwrap().into(),
        target_path: target.to_str().unwrap().into(),
        volume_capability: Some(cap),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let data = target.join("app/data");
    let got = Restored {
        snap: std::fs::read_to_string(target.join("snap.txt")).unwrap_or_default(),
        log: std::fs::read_to_string(target.join("log")).unwrap_or_default(),
        count: std::fs::read_to_string(target.join("count"))
            .ok()
            .and_then(|c| c.trim().parse().ok())
            .unwrap_or(0),
        hello: std::fs::read_to_string(data.join("hello.txt")).unwrap_or_default(),
        later: target.join("later.txt").exists(),
    };
    c.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        target_path: target.to_str().unwrap().into(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.to_str().unwrap().into(),
    })
    .await
    .unwrap();
    c.delete_volume(csi::DeleteVolumeRequest {
        volume_id: v.volume_id,
        ..Default::default()
    })
    .await
    .unwrap();
    got
}

async fn guest(flow: &Flow, script: &str) -> String {
    let id = flow.sandbox().expect("sandbox running");
    flow.runtime()
        .sh(id, script)
        .await
        .unwrap_or_else(|e| panic!("guest `{script}`: {e}"))
}

/// Size of the block device mounted at `gv` in the guest.
async fn guest_dev_size(flow: &Flow, gv: &str) -> u64 {
    guest(
        flow,
        &format!("blockdev --getsize64 $(awk '$2==\"{gv}\"{{print $1}}' /proc/mounts)"),
    )
    .await
    .trim()
    .parse()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn story1_fsgroup_subpath_stats_expand_and_data_on_the_host() {
    let mut st = Stack::new(Layout::Crust);
    st.start_plugin(true).await;
    let csi = st.csi().await;

    let mut cfg = st.flow_config();
    cfg.volume_name = "pvc-story1".into();
    cfg.size = 128 * MIB;
    cfg.expand_to = Some(192 * MIB);
    cfg.fs_group = Some(2000);
    cfg.change_policy = Some(FsGroupChangePolicy::OnRootMismatch);
    cfg.sub_path = Some("app/data".into());
    cfg.defer_via = DeferVia::Request;
    cfg.keep_volume = true;
    cfg.workload.args = vec![
        "sh".into(),
        "-c".into(),
        "echo story1 > /data/hello.txt && sync && exec sleep 100000".into(),
    ];

    let _slot = crust_testkit::VmSlot::acquire();
    let mut flow = Flow::new(cfg, csi.clone(), st.progress());
    if let Err(e) = flow.bring_up().await {
        panic!("bring-up: {e}\nplugin log:\n{}", st.plugin_log());
    }
    let target = flow.target_path().to_string();
    let staging = flow.staging_path().unwrap().to_string();

    // --- the host: the volume mounted nowhere, a root-only record -------
    // (the target shows the plugin's placeholder)
    assert!(crust_kubesim::flow::is_placeholder(Path::new(&target)));
    assert!(
        !crust_kubesim::flow::is_mountpoint(Path::new(&staging)),
        "story 1: the staging path stays empty with deferral"
    );
    let rec = st.crust_root.join(crust_handoff::crust_key(&target));
    let meta = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(meta(&rec), 0o700);
    assert_eq!(meta(&rec.join("mountInfo.json")), 0o600);
    let mi: serde_json::Value =
        serde_json::from_slice(&std::fs::read(rec.join("mountInfo.json")).unwrap()).unwrap();
    assert_eq!(mi["fstype"], "ext4", "{mi}");
    assert_eq!(mi["metadata"]["fsGroup"], "2000", "{mi}");
    assert_eq!(
        mi["metadata"]["fsGroupChangePolicy"], "OnRootMismatch",
        "{mi}"
    );
    let dev = mi["device"].as_str().unwrap().to_string();
    let pool_loops = st.loops_on_pool();
    assert!(
        pool_loops.iter().any(|l| l.to_str() == Some(dev.as_str())),
        "{dev} is not a loop device on the pool: {pool_loops:?}"
    );
    // The runtime records the small poll CLI installed next to it.
    assert_eq!(
        std::fs::read_to_string(rec.join("runtime-cli")).unwrap(),
        st.runtime
            .bin
            .with_file_name("crust-runtime-poll")
            .to_str()
            .unwrap(),
        "the runtime consumed the record"
    );
    assert!(
        rec.join(&flow.config().sandbox_id).is_file(),
        "sandbox claim"
    );

    // --- the guest: subPath at /data, fsGroup applied ---------------------
    let gv = flow.report().guest_volume_path.clone().unwrap();
    let t0 = Instant::now();
    while guest(&flow, "test -f /data/hello.txt && echo y || echo n")
        .await
        .trim()
        != "y"
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "workload never wrote"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let ids = guest(&flow, &format!("stat -c '%d:%i' /data {gv}/app/data")).await;
    let ids: Vec<&str> = ids.lines().collect();
    assert_eq!(ids.len(), 2);
    assert_eq!(ids[0], ids[1], "/data is the volume's subPath app/data");
    assert_eq!(
        guest(&flow, &format!("cat {gv}/app/data/hello.txt")).await,
        "story1\n"
    );
    assert_eq!(
        guest(&flow, &format!("stat -c '%g %a' {gv}")).await.trim(),
        "2000 2775",
        "OnRootMismatch on a fresh filesystem: root gets the group, setgid, g+rwx"
    );
    let groups = guest(
        &flow,
        &format!("stat -c %g {gv}/app {gv}/app/data /data/hello.txt"),
    )
    .await;
    assert_eq!(groups.lines().collect::<Vec<_>>(), ["2000", "2000", "2000"]);
    let mounts = guest(&flow, "cat /proc/mounts").await;
    assert!(
        mounts
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some(gv.as_str()) && l.contains(" ext4 ")),
        "{mounts}"
    );

    // --- a snapshot while the pod runs: frozen in the guest ---------------
    // Written by the workload's guest and never synced: only the guest's
    // freeze (crust_ops -> `crust freeze`) puts it in the snapshot.
    guest(&flow, &format!("seq 1 200000 > {gv}/snap.txt")).await;
    // ...while another writer appends a numbered line and syncs, then
    // records the count and syncs, over and over (in its own session, and
    // the exec returns once it has written: the agent ends an exec's
    // process group when the exec returns).
    let writer = guest(
        &flow,
        &format!(
            "setsid sh -c 'i=0; while true; do i=$((i + 1)); echo line $i >> {gv}/log; \
             sync; echo $i > {gv}/count; sync; done' </dev/null >/dev/null 2>&1 & \
             while [ ! -e {gv}/count ]; do sleep 0.05; done; echo $!"
        ),
    )
    .await;
    let count = async || -> u64 {
        guest(&flow, &format!("cat {gv}/count 2>/dev/null || echo 0"))
            .await
            .trim()
            .parse()
            .unwrap_or(0)
    };
    let t0 = Instant::now();
    while count().await < 5 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the writer never got going"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let synced_before = count().await;
    let snap = csi
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: flow.volume_id().unwrap().into(),
            name: "snap-story1".into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("snapshot: {e}\nplugin log:\n{}", st.plugin_log()))
        .snapshot
        .unwrap();
    assert!(snap.ready_to_use);
    guest(&flow, &format!("kill {}", writer.trim())).await;
    // The snapshot's filesystem is clean as it stands (the freeze made it
    // so; no journal replay needed): e2fsck reads the pool's file.
    let file = std::fs::read_dir(st.pool.join("snapshots"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains(&snap.snapshot_id))
        .expect("the snapshot's file in the pool");
    let fsck = std::process::Command::new("e2fsck")
        .arg("-fn")
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "e2fsck -fn of the snapshot: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    assert_eq!(
        guest(
            &flow,
            &format!("echo later > {gv}/later.txt && cat {gv}/later.txt")
        )
        .await,
        "later\n",
        "the guest writes again after the thaw"
    );

    // --- stats and expansion through the plugin ---------------------------
    if let Err(e) = flow.exercise().await {
        panic!("exercise: {e}\nplugin log:\n{}", st.plugin_log());
    }
    let r = flow.report().clone();
    for (label, o) in [("before", &r.before_expand), ("after", &r.after_expand)] {
        let df = o.df.as_ref().unwrap();
        let s = o.stats.as_ref().unwrap();
        assert_eq!(s.bytes, Some(df.bytes), "{label}: stats bytes = guest df");
        assert_eq!(
            s.inodes,
            Some(df.inodes),
            "{label}: stats inodes = guest df -i"
        );
        assert_eq!(s.abnormal, Some(false), "{label}: {}", s.message);
    }
    let (before, after) = (
        r.before_expand.df.as_ref().unwrap().bytes.total,
        r.after_expand.df.as_ref().unwrap().bytes.total,
    );
    assert!(after > before + 40 * MIB, "df {before} -> {after}");
    assert!(r.expanded_bytes.unwrap() >= (192 * MIB) as i64);
    assert_eq!(guest_dev_size(&flow, &gv).await, 192 * MIB);

    // --- bench --deferred's measurement on the same pod -------------------
    let (_tx, stop) = tokio::sync::watch::channel(false);
    let bcfg = DeferredConfig {
        flow: flow.config().clone(),
        concurrency: 2,
        limit: Limit::Ops(4),
        expand_step: 8 * MIB,
        pause: Duration::from_millis(100),
    };
    let (scenarios, notes) = measure(&csi, &flow, &bcfg, &stop).await;
    // The guest's cost per call is read from its QEMU's threads.
    for s in ["deferred-stats", "deferred-health"] {
        let n = notes
            .iter()
            .find(|n| n.starts_with(&format!("{s}: the guest's QEMU used ")))
            .unwrap_or_else(|| panic!("no QEMU CPU note for {s}: {notes:?}"));
        assert!(n.contains("per call (4 calls, "), "{n}");
        assert!(n.ends_with("includes the idle guest between calls)"), "{n}");
    }
    assert!(
        notes
            .iter()
            .any(|n| n.contains("each worker waited 100.0ms")),
        "{notes:?}"
    );
    let sc = |s: Scenario| scenarios.iter().find(|r| r.scenario == s).unwrap();
    let stats = sc(Scenario::DeferredStats);
    assert_eq!(
        (stats.ops, stats.errors),
        (4, 0),
        "{:?}",
        stats.error_samples
    );
    let row = |s: &crust_bench::ScenarioReport, rpc: &str| {
        s.rpcs.iter().find(|r| r.rpc == rpc).unwrap().clone()
    };
    assert_eq!(row(stats, "NodeGetVolumeStats").count, 4);
    // Two workers, four calls: one worker makes two at least, 100 ms apart.
    assert!(stats.elapsed_secs >= 0.1, "{}", stats.elapsed_secs);
    let exp = sc(Scenario::DeferredExpand);
    assert_eq!((exp.ops, exp.errors), (4, 0), "{:?}", exp.error_samples);
    assert_eq!(row(exp, "NodeExpandVolume").count, 4);
    assert!(row(exp, "NodeExpandVolume").p50_us > 0);
    assert_eq!(
        guest_dev_size(&flow, &gv).await,
        224 * MIB,
        "192Mi + 4 x 8Mi"
    );
    let last_df = flow.df().await.unwrap();
    assert!(last_df.bytes.total > after);

    // --- teardown (volume kept) -------------------------------------------
    let qemu = r.qemu_pid.unwrap();
    flow.tear_down().await;
    let r = flow.report().clone();
    assert!(r.ok, "{:?}: {:?}", r.failed_step, r.error);
    assert!(!crust_kubesim::flow::pid_is_qemu(qemu));
    for step in [
        "runtime kill",
        "runtime delete",
        "NodeUnpublishVolume",
        "NodeUnstageVolume",
    ] {
        assert!(r.steps.iter().any(|s| s.step == step && s.ok), "{step}");
    }
    assert!(!r.steps.iter().any(|s| s.step == "DeleteVolume"));
    assert_eq!(
        st.records(),
        Vec::<std::path::PathBuf>::new(),
        "record removed"
    );
    assert!(st.mounts_under_root().is_empty());
    assert!(st.vm_processes().is_empty());
    let id = r.volume.as_ref().unwrap().id.clone();
    let list = csi.list_all_volumes(0, String::new()).await.unwrap();
    assert!(
        list.entries
            .iter()
            .any(|e| e.volume.as_ref().is_some_and(|v| v.volume_id == id)),
        "the volume was kept"
    );

    // --- the same volume on the host, without deferral ----------------------
    let mut cfg = st.flow_config();
    cfg.volume_name = "pvc-story1".into();
    cfg.size = 128 * MIB;
    cfg.expand_to = None;
    cfg.defer_via = DeferVia::None;
    let mut host = Flow::new(cfg, csi.clone(), st.progress());
    host.bring_up().await.unwrap();
    assert_eq!(
        host.volume_id(),
        Some(id.as_str()),
        "CreateVolume is idempotent"
    );
    let t = Path::new(host.target_path());
    assert!(crust_kubesim::flow::is_mountpoint(t));
    let hello = t.join("app/data/hello.txt");
    assert_eq!(std::fs::read_to_string(&hello).unwrap(), "story1\n");
    assert_eq!(std::fs::metadata(&hello).unwrap().gid(), 2000);
    let root = std::fs::metadata(t).unwrap();
    assert_eq!((root.gid(), root.mode() & 0o7777), (2000, 0o2775));
    assert_eq!(
        host.df().await.unwrap().bytes.total,
        last_df.bytes.total,
        "the host sees the filesystem the guest grew"
    );
    host.tear_down().await;
    let hr = host.report();
    assert!(hr.ok, "{:?}: {:?}", hr.failed_step, hr.error);
    assert!(hr.steps.iter().any(|s| s.step == "DeleteVolume" && s.ok));
    let list = csi.list_all_volumes(0, String::new()).await.unwrap();
    assert_eq!(list.entries, vec![], "volume deleted");

    // --- the snapshot outlives its volume: restored on the host -----------
    let seq: String = (1..=200000).map(|i| format!("{i}\n")).collect();
    let restored = restore_on_host(&st, &csi, &snap.snapshot_id).await;
    assert_eq!(
        restored.snap, seq,
        "the guest's unsynced file is in the snapshot"
    );
    assert_eq!(restored.hello, "story1\n");
    assert!(!restored.later, "written after the snapshot");
    // Every write synced before the snapshot is in it, in order, and the
    // log holds at least as many lines as the count it recorded.
    assert!(
        restored.count >= synced_before,
        "count {} < {synced_before} synced before the snapshot",
        restored.count
    );
    let lines: Vec<&str> = restored.log.lines().collect();
    assert!(
        lines.len() as u64 >= restored.count,
        "{} lines",
        lines.len()
    );
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(*l, format!("line {}", i + 1));
    }
    csi.delete_snapshot(csi::DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    st.assert_clean();
    assert!(
        !st.work.exists(),
        "the flows removed the kubelet dirs they made"
    );
}
