//! The KEP-2857 stories that need no guest, against the real `crust-csi`
//! plugin with real loop devices and mounts:
//!
//! - stories 2/3: deferral not requested: an ordinary host mount whose
//!   data survives unpublish, unstage and a new stage/publish;
//! - the StorageClass route (`deferFsOps=true`, no request field): the
//!   hand-off record is written root-only, nothing is mounted on the host,
//!   and nobody answers for the volume before a runtime consumes it;
//! - story 6: deferral asked of a plugin started with `--deferral
//!   disabled`: FAILED_PRECONDITION, no mount, no record, and `crustctl
//!   flow` reports the failed step and still tears down.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod e2e_support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crust_handoff::FsGroupChangePolicy;
use crust_kubesim::flow::{DeferVia, Flow, is_mountpoint};
use e2e_support::*;
use serde_json::Value;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_mounts_storage_class_records_and_refused_deferral() {
    let mut st = Stack::new(Layout::Crust);
    st.start_plugin(true).await;
    let csi = st.csi().await;

    // --- stories 2/3: no deferral, a host mount ------------------------------
    let mut cfg = st.flow_config();
    cfg.volume_name = "pvc-host".into();
    // xfs: it grows online on the host without CAP_SYS_RESOURCE.
    cfg.fs_type = "xfs".into();
    cfg.size = 320 * MIB;
    cfg.expand_to = Some(384 * MIB);
    cfg.defer_via = DeferVia::None;
    cfg.keep_volume = true;
    let mut flow = Flow::new(cfg.clone(), csi.clone(), st.progress());
    flow.bring_up().await.unwrap();
    let target = PathBuf::from(flow.target_path());
    let staging = PathBuf::from(flow.staging_path().unwrap());
    assert!(is_mountpoint(&target) && is_mountpoint(&staging));
    assert_eq!(st.records(), Vec::<PathBuf>::new(), "no hand-off record");
    std::fs::write(target.join("kept.txt"), b"written on the host\n").unwrap();
    std::fs::File::open(target.join("kept.txt"))
        .unwrap()
        .sync_all()
        .unwrap();
    flow.exercise().await.unwrap();
    let r = flow.report().clone();
    let (b, a) = (&r.before_expand, &r.after_expand);
    assert_eq!(
        b.stats.as_ref().unwrap().bytes.unwrap().total,
        b.df.as_ref().unwrap().bytes.total,
        "host stats = statvfs of the target"
    );
    assert!(a.df.as_ref().unwrap().bytes.total > b.df.as_ref().unwrap().bytes.total + 20 * MIB);
    flow.tear_down().await;
    assert!(flow.report().ok, "{:?}", flow.report().error);
    assert!(!is_mountpoint(&target) && !is_mountpoint(&staging));
    assert_eq!(
        st.loops_on_pool(),
        Vec::<PathBuf>::new(),
        "unstage detached it"
    );

    // A new pod, same volume: restaged and republished, the data is there.
    cfg.pod_uid = crust_kubesim::flow::random_uuid();
    cfg.keep_volume = false;
    let mut again = Flow::new(cfg, csi.clone(), st.progress());
    again.bring_up().await.unwrap();
    assert_eq!(again.volume_id(), flow.volume_id());
    let t2 = Path::new(again.target_path());
    assert_ne!(t2, target.as_path(), "another pod uid");
    assert_eq!(
        std::fs::read_to_string(t2.join("kept.txt")).unwrap(),
        "written on the host\n"
    );
    again.tear_down().await;
    assert!(again.report().ok, "{:?}", again.report().error);
    st.assert_clean();

    // --- StorageClass deferral, no runtime yet ---------------------------------
    let mut cfg = st.flow_config();
    cfg.volume_name = "pvc-sc".into();
    cfg.size = 64 * MIB;
    cfg.defer_via = DeferVia::StorageClass;
    cfg.fs_group = Some(3000);
    cfg.change_policy = Some(FsGroupChangePolicy::Always);
    cfg.start_sandbox = false;
    let mut sc = Flow::new(cfg, csi.clone(), st.progress());
    sc.bring_up().await.unwrap();
    let vol = sc.report().volume.clone().unwrap();
    assert_eq!(
        vol.context.get("deferFsOps").map(String::as_str),
        Some("true"),
        "the StorageClass parameter travels in the volume context"
    );
    let target = sc.target_path().to_string();
    // The target shows the plugin's placeholder, never the volume.
    assert!(crust_kubesim::flow::is_placeholder(Path::new(&target)));
    assert!(!is_mountpoint(Path::new(sc.staging_path().unwrap())));
    let rec = st.crust_root.join(crust_handoff::crust_key(&target));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&st.crust_root), 0o700);
    assert_eq!(mode(&rec), 0o700);
    assert_eq!(mode(&rec.join("mountInfo.json")), 0o600);
    let mi: Value =
        serde_json::from_slice(&std::fs::read(rec.join("mountInfo.json")).unwrap()).unwrap();
    assert_eq!(mi["volume-type"], "block", "{mi}");
    assert_eq!(mi["fstype"], "ext4", "{mi}");
    assert_eq!(mi["metadata"]["fsGroup"], "3000", "{mi}");
    assert_eq!(mi["metadata"]["fsGroupChangePolicy"], "Always", "{mi}");
    let dev = PathBuf::from(mi["device"].as_str().unwrap());
    assert!(st.loops_on_pool().contains(&dev), "{dev:?}");
    assert!(
        !rec.join("runtime-cli").exists(),
        "no runtime consumed it yet"
    );
    // Today's kubelet sends no defer_fs_ops; the plugin knows anyway, and
    // with no runtime behind the record there is nobody to ask.
    let e = sc.stats().await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("not consumed"), "{e:?}");
    sc.tear_down().await;
    assert!(sc.report().ok, "{:?}", sc.report().error);
    st.assert_clean();

    // --- story 6: a plugin without deferral ----------------------------------
    st.stop_plugin().await;
    st.start_plugin(false).await;
    let work = st.root.join("flow-work");
    let mut args: Vec<String> = vec![
        "flow".into(),
        "-o".into(),
        "json".into(),
        "--work-dir".into(),
        work.display().to_string(),
        "--name".into(),
        "pvc-s6".into(),
        "--size".into(),
        "64Mi".into(),
        "--no-expand".into(),
        "--fs-group".into(),
        "2000".into(),
    ];
    args.extend(st.runtime_flags());
    let out = st.crustctl(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let rep: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(rep["failed_step"], "NodePublishVolume", "{rep:#}");
    let err = rep["error"].as_str().unwrap();
    assert!(err.starts_with("FailedPrecondition: "), "{err}");
    assert!(
        stderr.contains("error: NodePublishVolume failed: FailedPrecondition"),
        "{stderr}"
    );
    assert!(
        rep["notes"].as_array().unwrap().iter().any(|n| n
            .as_str()
            .unwrap()
            .contains("does not advertise DEFER_FS_OPS")),
        "{rep:#}"
    );
    let steps: Vec<(String, bool)> = rep["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["step"].as_str().unwrap().to_string(), s["ok"] == true))
        .collect();
    let names: Vec<&str> = steps.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(
        names,
        [
            "plugin",
            "CreateVolume",
            "NodeStageVolume",
            "NodePublishVolume",
            "NodeUnstageVolume",
            "DeleteVolume"
        ],
        "the teardown that applies, in reverse"
    );
    assert!(
        steps
            .iter()
            .all(|(s, ok)| *ok == (s != "NodePublishVolume"))
    );
    // Progress went to stderr while stdout carried the JSON.
    assert!(stderr.contains("✗ NodePublishVolume"), "{stderr}");
    assert!(!work.exists(), "the flow removed the work dir it made");

    // The StorageClass route is refused up front too.
    let mut args2 = args.clone();
    args2.extend(["--defer-via".into(), "storage-class".into()]);
    let out = st.crustctl(&args2.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(1));
    let rep: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["failed_step"], "CreateVolume", "{rep:#}");
    assert!(
        rep["error"]
            .as_str()
            .unwrap()
            .starts_with("InvalidArgument: "),
        "{rep:#}"
    );

    let list = csi_list(&st).await;
    assert_eq!(list, Vec::<String>::new(), "no volume left");
    st.assert_clean();
}

async fn csi_list(st: &Stack) -> Vec<String> {
    st.csi()
        .await
        .list_all_volumes(0, String::new())
        .await
        .unwrap()
        .entries
        .into_iter()
        .filter_map(|e| e.volume.map(|v| v.volume_id))
        .collect()
}
