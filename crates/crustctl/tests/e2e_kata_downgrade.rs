//! The Kata path and KEP-2857 story 5, on one guest boot.
//!
//! The plugin writes the Kata direct-volume layout (`--handoff-layout
//! kata`, `--kata-runtime` = crust-runtime); the runtime consumes it from
//! its `--kata-root`; `crust-runtime direct-volume stats|resize
//! --volume-path` answer from the guest (stats equal its `df`, resize
//! grows the device and the filesystem online), and so does the plugin's
//! deferred NodeGetVolumeStats/NodeExpandVolume, which take that route
//! (deferral chosen by the StorageClass parameter: no request carries
//! `defer_fs_ops`, as with today's kubelet).
//! Then the plugin is restarted with `--deferral disabled` while the pod
//! runs (a downgrade): it no longer advertises DEFER_FS_OPS, refuses a
//! deferred stats call, and after the pod stops a NodeUnpublishVolume
//! without `defer_fs_ops` succeeds and leaves no record behind.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod e2e_support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_kubesim::flow::{DeferVia, Flow};
use crust_proto::csi::v1 as csi;
use e2e_support::*;
use serde_json::Value;
use tonic::Code;

fn bytes_usage(v: &Value) -> (u64, u64, u64) {
    let u = v["usage"]
        .as_array()
        .unwrap()
        .iter()
        // Kata's shim spelling: unit 1 = BYTES, zero counts left out.
        .find(|u| u["unit"] == 1)
        .unwrap_or_else(|| panic!("no BYTES (1) usage: {v}"));
    let n = |k: &str| u[k].as_u64().unwrap_or(0);
    (n("total"), n("used"), n("available"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kata_layout_then_plugin_downgrade() {
    let mut st = Stack::new(Layout::Kata);
    st.start_plugin(true).await;
    let csi = st.csi().await;

    let mut cfg = st.flow_config();
    cfg.volume_name = "pvc-kata".into();
    cfg.size = 96 * MIB;
    cfg.expand_to = Some(128 * MIB);
    // Today's clusters: the StorageClass asks, kubelet sends no field.
    cfg.defer_via = DeferVia::StorageClass;
    cfg.workload.args = vec![
        "sh".into(),
        "-c".into(),
        "echo kata > /data/k.txt && sync && exec sleep 100000".into(),
    ];

    let _slot = crust_testkit::VmSlot::acquire();
    let mut flow = Flow::new(cfg, csi.clone(), st.progress());
    if let Err(e) = flow.bring_up().await {
        panic!("bring-up: {e}\nplugin log:\n{}", st.plugin_log());
    }
    let target = flow.target_path().to_string();
    let id = flow.sandbox().unwrap().to_string();
    let rt = st.runtime.clone();

    // --- the Kata record, consumed by the runtime ------------------------------
    let dir = st.kata_root.join(crust_handoff::kata_key(&target));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("mountInfo.json")), 0o600);
    let mi: Value =
        serde_json::from_slice(&std::fs::read(dir.join("mountInfo.json")).unwrap()).unwrap();
    assert_eq!(mi["fstype"], "ext4", "{mi}");
    assert!(
        st.loops_on_pool()
            .contains(&PathBuf::from(mi["device"].as_str().unwrap())),
        "{mi}"
    );
    assert!(dir.join(&id).is_file(), "the sandbox-id file (seed 000)");
    assert_eq!(
        std::fs::read_dir(&st.crust_root)
            .map(|d| d.count())
            .unwrap_or(0),
        0,
        "no CRUST-layout record"
    );
    let state = rt.json(&["state", &id]).await.unwrap();
    assert_eq!(state["volumes"][0]["layout"], "kata", "{state}");
    let t0 = Instant::now();
    while rt
        .sh(&id, "cat /data/k.txt 2>/dev/null || true")
        .await
        .unwrap()
        != "kata\n"
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "workload never wrote"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // --- direct-volume stats = guest df ---------------------------------------
    let df = flow.df().await.unwrap();
    let stats = rt
        .json(&["direct-volume", "stats", "--volume-path", &target])
        .await
        .unwrap();
    assert_eq!(
        bytes_usage(&stats),
        (df.bytes.total, df.bytes.used, df.bytes.available),
        "{stats}"
    );
    // Go's omitempty: a false `abnormal` is left out.
    assert!(stats["volume_condition"].is_object(), "{stats}");
    assert!(
        stats["volume_condition"].get("abnormal").is_none(),
        "{stats}"
    );

    // --- the plugin's deferred stats/expand go the Kata way -------------------
    if let Err(e) = flow.exercise().await {
        panic!("exercise: {e}\nplugin log:\n{}", st.plugin_log());
    }
    let r = flow.report().clone();
    for o in [&r.before_expand, &r.after_expand] {
        assert_eq!(
            o.stats.as_ref().unwrap().bytes,
            Some(o.df.as_ref().unwrap().bytes)
        );
    }
    let grown = r.after_expand.df.as_ref().unwrap().bytes.total;
    assert!(grown > r.before_expand.df.as_ref().unwrap().bytes.total + 20 * MIB);
    assert_eq!(r.expanded_bytes, Some((128 * MIB) as i64));

    // --- direct-volume resize ---------------------------------------------------
    // The controller grows the backing file first, as kubelet's flow would.
    let size = 160 * MIB;
    csi.controller_expand_volume(csi::ControllerExpandVolumeRequest {
        volume_id: flow.volume_id().unwrap().into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: size as i64,
            limit_bytes: 0,
        }),
        secrets: Default::default(),
        volume_capability: Some(flow.capability(false)),
    })
    .await
    .unwrap();
    let out = rt
        .json(&[
            "direct-volume",
            "resize",
            "--volume-path",
            &target,
            "--size",
            &size.to_string(),
        ])
        .await
        .unwrap();
    assert_eq!(out["capacity_bytes"].as_u64(), Some(size), "{out}");
    let gv = r.guest_volume_path.clone().unwrap();
    let dev = rt
        .sh(
            &id,
            &format!("blockdev --getsize64 $(awk '$2==\"{gv}\"{{print $1}}' /proc/mounts)"),
        )
        .await
        .unwrap();
    assert_eq!(dev.trim().parse::<u64>().unwrap(), size);
    let df = flow.df().await.unwrap();
    assert!(df.bytes.total > grown, "{} -> {}", grown, df.bytes.total);
    let stats = rt
        .json(&["direct-volume", "stats", "--volume-path", &target])
        .await
        .unwrap();
    assert_eq!(bytes_usage(&stats).0, df.bytes.total);

    // --- story 5: the plugin is downgraded while the pod runs -------------------
    st.stop_plugin().await;
    st.start_plugin(false).await;
    let old = st.csi().await;
    let caps = old.node_get_capabilities(Default::default()).await.unwrap();
    use csi::node_service_capability::{Type, rpc::Type as T};
    let has = |t: T| {
        caps.capabilities
            .iter()
            .any(|c| matches!(&c.r#type, Some(Type::Rpc(r)) if r.r#type == t as i32))
    };
    assert!(!has(T::DeferFsOps) && has(T::GetVolumeStats));
    flow.set_csi(old.clone());
    // Neither with the KEP field nor without it does the downgraded plugin
    // answer from the host (where the target is an empty directory).
    let e = flow.stats().await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let e = old
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: flow.volume_id().unwrap().into(),
            volume_path: target.clone(),
            staging_target_path: flow.staging_path().unwrap().into(),
            defer_fs_ops: true,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(dir.exists(), "the record stays while the pod runs");

    // The pod stops; kubelet unpublishes without defer_fs_ops.
    flow.set_unpublish_defer(false);
    flow.tear_down().await;
    let r = flow.report().clone();
    assert!(
        r.ok,
        "{:?}: {:?}\n{}",
        r.failed_step,
        r.error,
        st.plugin_log()
    );
    let unpub = r
        .steps
        .iter()
        .find(|s| s.step == "NodeUnpublishVolume")
        .unwrap();
    assert!(
        unpub.ok && !unpub.detail.contains("defer_fs_ops"),
        "{unpub:?}"
    );
    assert!(!dir.exists(), "no record left behind");
    assert!(r.steps.iter().any(|s| s.step == "DeleteVolume" && s.ok));
    let list = old.list_all_volumes(0, String::new()).await.unwrap();
    assert_eq!(list.entries, vec![]);
    st.assert_clean();
}
