//! Per-volume operation guard, driven through the library's `serve` (in
//! process, real socket, real loop devices) with the stage test hook: the
//! first NodeStageVolume is held inside its critical section, so the race
//! is deterministic.

mod common;

use common::*;
use crust_proto::csi::v1 as csi;
use crust_proto::endpoint::Endpoint;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_operations_on_one_volume_are_aborted_others_proceed() {
    crust_testkit::require_root();
    let dir = tempfile::Builder::new()
        .prefix("crust-csi-test")
        .tempdir_in("/tmp")
        .unwrap();
    let _cleanup = NodeCleanup::new(dir.path());
    let socket = dir.path().join("csi.sock");
    let mut cfg = crust_csi::Config::pool(
        socket.clone(),
        dir.path().join("state"),
        dir.path().join("pool"),
        4 << 30,
    );
    cfg.node_id = NODE.into();
    let gate = crust_csi::Gate::new();
    cfg.hooks.stage_gate = Some(gate.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(crust_csi::serve(cfg, async {
        let _ = stop_rx.await;
    }));
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(!server.is_finished(), "server exited");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let mut c = Clients::new(Endpoint::Unix(socket.clone()).connect().await.unwrap());
    let v = c
        .create(create_req("raced", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id.clone();
    let staging = dir.path().join("staging");
    std::fs::create_dir(&staging).unwrap();
    let staging = staging.to_str().unwrap().to_string();

    // first stage: held at the gate while owning the volume
    let first = {
        let mut c = c.clone();
        let (id, staging) = (id.clone(), staging.clone());
        tokio::spawn(async move { c.stage(&id, &staging, mount("ext4")).await })
    };
    gate.entered.notified().await;

    let s = assert_code(c.stage(&id, &staging, mount("ext4")).await, Code::Aborted);
    assert_eq!(
        s.message(),
        format!("operation NodeStageVolume already in progress for volume {id}")
    );
    assert_code(c.delete(&id).await, Code::Aborted);
    assert_code(
        c.create(create_req("raced", 64 * MIB, vec![mount("ext4")]))
            .await,
        Code::Aborted,
    );
    // nothing global: another volume is created, listed and deleted meanwhile
    let other = c
        .create(create_req("bystander", 8 * MIB, vec![block()]))
        .await
        .unwrap();
    assert_eq!(c.list_all().await.len(), 2);
    c.delete(&other.volume_id).await.unwrap();
    assert!(!first.is_finished());

    gate.release.notify_one();
    first.await.unwrap().unwrap();
    // the loser's retry succeeds (idempotent) and finds the same device
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert_eq!(loops_under(dir.path()).len(), 1);
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();

    stop_tx.send(()).unwrap();
    server.await.unwrap().unwrap();
    assert!(!socket.exists(), "socket removed on shutdown");
    assert!(loops_under(dir.path()).is_empty());
}

/// A HandOver held inside the volume's critical section (the handover
/// test hook): kubelet's NodeUnpublishVolume and NodeExpandVolume and a
/// second runtime's HandOver meanwhile get ABORTED and change nothing;
/// released, the handover completes, and the second runtime is then
/// refused (FAILED_PRECONDITION: the volume is in the first sandbox).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_races_unpublish_expand_and_a_second_runtime() {
    use crust_proto::handover::v1alpha1 as hv;
    use hv::handover_client::HandoverClient;
    use hv::runtime_capability::Type as Cap;
    crust_testkit::require_root();
    let dir = tempfile::Builder::new()
        .prefix("crust-csi-test")
        .tempdir_in("/tmp")
        .unwrap();
    let _cleanup = NodeCleanup::new(dir.path());
    let socket = dir.path().join("csi.sock");
    let ho_socket = dir.path().join("handover.sock");
    let mut cfg = crust_csi::Config::pool(
        socket.clone(),
        dir.path().join("state"),
        dir.path().join("pool"),
        4 << 30,
    );
    cfg.node_id = NODE.into();
    cfg.handover_socket = Some(ho_socket.clone());
    cfg.deferral.ops.crust_root = dir.path().join("handoff");
    let gate = crust_csi::Gate::new();
    cfg.hooks.handover_gate = Some(gate.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(crust_csi::serve(cfg, async {
        let _ = stop_rx.await;
    }));
    while std::os::unix::net::UnixStream::connect(&ho_socket).is_err() {
        assert!(!server.is_finished(), "server exited");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let mut c = Clients::new(Endpoint::Unix(socket.clone()).connect().await.unwrap());
    let h = HandoverClient::new(Endpoint::Unix(ho_socket).connect().await.unwrap());
    let id = c
        .create(create_req("raced-ho", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let mk = |p: &str| {
        let p = dir.path().join(p);
        std::fs::create_dir_all(&p).unwrap();
        p.to_str().unwrap().to_string()
    };
    let staging = mk("staging");
    let target = mk("pods/p/vol");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    let ask = |sandbox: &str| hv::HandOverRequest {
        target_path: target.clone(),
        sandbox_id: sandbox.into(),
        runtime_cli: "/usr/bin/true".into(),
        capabilities: [Cap::VolumeStats, Cap::VolumeResize]
            .into_iter()
            .map(|t| hv::RuntimeCapability { r#type: t as i32 })
            .collect(),
        file_systems: vec![hv::FileSystemSupport {
            fs_type: "ext4".into(),
            mount_options: Vec::new(),
        }],
        required: false,
    };

    let first = {
        let mut h = h.clone();
        let req = ask("sb-1");
        tokio::spawn(async move { h.hand_over(req).await })
    };
    gate.entered.notified().await;
    assert_code(c.unpublish(&id, &target).await, Code::Aborted);
    let expand = c
        .node
        .node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: target.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 64 * MIB,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await;
    assert_code(expand.map(drop), Code::Aborted);
    let mut h2 = h.clone();
    assert_code(h2.hand_over(ask("sb-2")).await.map(drop), Code::Aborted);
    // Nothing moved meanwhile: the host mounts are all still there.
    assert!(crust_blockdev::is_mountpoint(std::path::Path::new(&staging)).unwrap());

    gate.release.notify_one();
    let got = first.await.unwrap().unwrap().into_inner();
    assert!(
        matches!(
            got.outcome,
            Some(hv::hand_over_response::Outcome::HandedOver(_))
        ),
        "{got:?}"
    );
    assert_code(
        h2.hand_over(ask("sb-2")).await.map(drop),
        Code::FailedPrecondition,
    );

    stop_tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}
