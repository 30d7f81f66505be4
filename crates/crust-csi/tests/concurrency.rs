//! Per-volume operation guard, driven through the library's `serve` (in
//! process, real socket, real loop devices) with the stage test hook: the
//! first NodeStageVolume is held inside its critical section, so the race
//! is deterministic.

mod common;

use common::*;
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
