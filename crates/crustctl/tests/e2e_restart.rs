//! Issue 10, restarts and upgrades: `crust-csi` crashes (SIGKILL) and is
//! upgraded (SIGTERM, started again) while a real QEMU guest holds a
//! deferred volume and its workload keeps writing. The claim, the record
//! and the guest are untouched; afterwards every call is answered
//! correctly (stats from the guest, a repeated stage that mounts nothing,
//! unpublish refused while the sandbox runs, a healthy ListVolumes), and
//! the teardown leaves nothing behind. One guest boot; budget ~60 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod e2e_support;

use std::path::Path;
use std::time::{Duration, Instant};

use crust_kubesim::flow::{DeferVia, Flow};
use crust_proto::csi::v1 as csi;
use e2e_support::*;

fn record_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_crash_and_upgrade_leave_guests_claims_and_records_alone() {
    let mut st = Stack::new(Layout::Crust);
    st.start_plugin(true).await;
    let csi = st.csi().await;
    let mut cfg = st.flow_config();
    cfg.volume_name = "pvc-restart".into();
    cfg.size = 64 * MIB;
    cfg.defer_via = DeferVia::Request;
    cfg.workload.args = vec![
        "sh".into(),
        "-c".into(),
        "i=0; while :; do i=$((i+1)); echo $i > /data/n.tmp && mv /data/n.tmp /data/n && sync; sleep 0.2; done"
            .into(),
    ];
    let _slot = crust_testkit::VmSlot::acquire();
    let mut flow = Flow::new(cfg, csi.clone(), st.progress());
    if let Err(e) = flow.bring_up().await {
        panic!("bring-up: {e}\nplugin log:\n{}", st.plugin_log());
    }
    let sandbox = flow.sandbox().unwrap().to_string();
    let target = flow.target_path().to_string();
    let staging = flow.staging_path().unwrap().to_string();
    let id = flow.volume_id().unwrap().to_string();
    let qemu = flow.report().qemu_pid.unwrap();
    let rec = st.crust_root.join(crust_handoff::crust_key(&target));
    let counter = |flow: &Flow| {
        let rt = flow.runtime().clone();
        let sb = sandbox.clone();
        async move {
            rt.sh(&sb, "cat /data/n 2>/dev/null || echo 0")
                .await
                .ok()
                .and_then(|o| o.trim().parse::<u64>().ok())
                .unwrap_or(0)
        }
    };
    let t0 = Instant::now();
    while counter(&flow).await < 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "workload never wrote"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let before = record_files(&rec);
    assert!(
        before.iter().any(|(n, _)| *n == sandbox),
        "claimed: {before:?}"
    );

    for how in ["crash", "upgrade"] {
        if how == "crash" {
            st.crash_plugin().await;
        } else {
            st.stop_plugin().await;
        }
        // The guest and its claim do not depend on the plugin.
        let n0 = counter(&flow).await;
        let t0 = Instant::now();
        while counter(&flow).await <= n0 + 2 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{how}: the workload stalled"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert!(
            crust_kubesim::flow::pid_is_qemu(qemu),
            "{how}: QEMU untouched"
        );
        assert_eq!(
            record_files(&rec),
            before,
            "{how}: record and claim untouched"
        );
        st.start_plugin(true).await;
        let csi = st.csi().await;
        flow.set_csi(csi.clone());
        assert_eq!(
            record_files(&rec),
            before,
            "{how}: the restart changed no record"
        );

        // Stats still come from the guest.
        let stats = flow.stats().await.unwrap();
        let cond = stats.volume_condition.unwrap();
        assert!(!cond.abnormal, "{how}: {cond:?}");
        assert!(
            stats.usage.iter().any(|u| u.total > 0),
            "{how}: {:?}",
            stats.usage
        );
        // kubelet repeats NodeStageVolume: nothing is mounted on the host.
        csi.node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.clone(),
            volume_capability: Some(flow.capability(false)),
            ..Default::default()
        })
        .await
        .unwrap();
        assert!(
            !crust_kubesim::flow::is_mountpoint(Path::new(&staging)),
            "{how}"
        );
        assert!(
            crust_kubesim::flow::is_placeholder(Path::new(&target)),
            "{how}"
        );
        // Unpublish while the sandbox runs: refused, nothing changes.
        let e = csi
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: target.clone(),
                defer_fs_ops: true,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{how}: {e:?}");
        assert!(
            e.message()
                .contains(&format!("still claimed by sandbox {sandbox}")),
            "{e:?}"
        );
        assert_eq!(record_files(&rec), before, "{how}");
        // The volume is healthy.
        let list = csi.list_all_volumes(0, String::new()).await.unwrap();
        let c = list
            .entries
            .iter()
            .find(|e| e.volume.as_ref().is_some_and(|v| v.volume_id == id))
            .and_then(|e| e.status.clone())
            .and_then(|s| s.volume_condition)
            .unwrap();
        assert!(!c.abnormal, "{how}: {c:?}");
    }

    flow.tear_down().await;
    let r = flow.report().clone();
    assert!(
        r.ok,
        "{:?}: {:?}\n{}",
        r.failed_step,
        r.error,
        st.plugin_log()
    );
    assert!(!crust_kubesim::flow::pid_is_qemu(qemu));
    st.assert_clean();
}
