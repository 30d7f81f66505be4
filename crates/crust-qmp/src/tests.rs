//! Codec and demultiplexer tests against a scripted fake QMP server on a
//! real unix socket. Behaviour against real QEMU is in `tests/qemu.rs`.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;

use super::*;

const T: Duration = Duration::from_secs(5);

/// The server side of one QMP connection.
struct Fake {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
}

impl Fake {
    async fn send_raw(&mut self, s: &str) {
        self.wr.write_all(s.as_bytes()).await.unwrap();
    }

    async fn send(&mut self, v: Value) {
        self.send_raw(&format!("{v}\r\n")).await;
    }

    /// Next command from the client; `None` once it hung up.
    async fn recv(&mut self) -> Option<Value> {
        let mut line = String::new();
        if self.rd.read_line(&mut line).await.unwrap() == 0 {
            return None;
        }
        Some(serde_json::from_str(&line).expect("client sent valid JSON"))
    }

    async fn recv_cmd(&mut self, name: &str) -> Value {
        let cmd = self.recv().await.expect("a command");
        assert_eq!(cmd["execute"], name, "{cmd}");
        assert!(cmd["id"].is_u64(), "every command carries an id: {cmd}");
        cmd
    }

    async fn reply(&mut self, cmd: &Value, ret: Value) {
        self.send(json!({ "return": ret, "id": cmd["id"] })).await;
    }

    async fn greet(&mut self) {
        self.send(
            json!({"QMP": {"version": {"qemu": {"micro": 2, "minor": 1, "major": 9},
            "package": "fake"}, "capabilities": ["oob"]}}),
        )
        .await;
        let cmd = self.recv_cmd("qmp_capabilities").await;
        assert!(cmd.get("arguments").is_none(), "{cmd}");
        self.reply(&cmd, json!({})).await;
    }
}

/// Serves one connection with `script`; returns the socket path.
fn fake<F, Fut>(dir: &tempfile::TempDir, script: F) -> (PathBuf, JoinHandle<()>)
where
    F: FnOnce(Fake) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let path = dir.path().join("qmp.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let task = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let (rd, wr) = UnixStream::into_split(stream);
        script(Fake {
            rd: BufReader::new(rd),
            wr,
        })
        .await;
    });
    (path, task)
}

#[tokio::test]
async fn greeting_and_capabilities() {
    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.greet().await;
        let cmd = f.recv_cmd("query-status").await;
        f.reply(&cmd, json!({"status": "prelaunch", "running": false}))
            .await;
        assert!(f.recv().await.is_none(), "client hangs up on drop");
    });
    let qmp = QmpClient::connect(&path, T).await.unwrap();
    assert_eq!(
        qmp.version(),
        &QemuVersion {
            major: 9,
            minor: 1,
            micro: 2,
            package: "fake".into()
        }
    );
    let st = qmp.query_status().await.unwrap();
    assert_eq!((st.running, st.status.as_str()), (false, "prelaunch"));
    assert!(qmp.closed_reason().is_none());
    drop(qmp);
    server.await.unwrap();
}

#[tokio::test]
async fn concurrent_calls_get_their_own_replies_out_of_order() {
    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.greet().await;
        let mut cmds = Vec::new();
        for _ in 0..3 {
            cmds.push(f.recv().await.unwrap());
        }
        let ids: Vec<_> = cmds.iter().map(|c| c["id"].clone()).collect();
        assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
        // Answer in reverse order, events interleaved, echoing each command.
        f.send(json!({"event": "EV1", "data": {"n": 1},
            "timestamp": {"seconds": 1700000000, "microseconds": 5}}))
            .await;
        for (i, cmd) in cmds.iter().rev().enumerate() {
            f.reply(cmd, json!({ "echo": cmd["execute"] })).await;
            f.send(json!({"event": "EV2", "data": {"n": i}})).await;
        }
        assert!(f.recv().await.is_none());
    });
    let qmp = Arc::new(QmpClient::connect(&path, T).await.unwrap());
    let mut events = qmp.events();
    let calls = ["cmd-a", "cmd-b", "cmd-c"].map(|name| {
        let qmp = qmp.clone();
        tokio::spawn(async move { qmp.execute(name, Value::Null).await })
    });
    for (call, name) in calls.into_iter().zip(["cmd-a", "cmd-b", "cmd-c"]) {
        assert_eq!(call.await.unwrap().unwrap(), json!({ "echo": name }));
    }
    let first = events.recv().await.unwrap();
    assert_eq!(first.name, "EV1");
    assert_eq!(first.data, json!({"n": 1}));
    assert_eq!(first.timestamp, Some(unix_time(1_700_000_000, 5)));
    for n in 0..3 {
        let ev = events.recv().await.unwrap();
        assert_eq!((ev.name.as_str(), &ev.data), ("EV2", &json!({ "n": n })));
        assert_eq!(ev.timestamp, None);
    }
    drop(events);
    drop(Arc::into_inner(qmp).unwrap());
    server.await.unwrap();
}

fn unix_time(secs: u64, micros: u64) -> std::time::SystemTime {
    std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros)
}

#[tokio::test]
async fn error_reply_becomes_command_error_and_connection_stays_usable() {
    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.greet().await;
        let cmd = f.recv_cmd("block_resize").await;
        assert_eq!(cmd["arguments"], json!({"node-name": "nope", "size": 4096}));
        f.send(json!({"id": cmd["id"], "error": {"class": "GenericError",
            "desc": "Cannot find device='' nor node-name='nope'"}}))
            .await;
        let cmd = f.recv_cmd("query-status").await;
        f.reply(&cmd, json!({"status": "running", "running": true}))
            .await;
        f.recv().await;
    });
    let qmp = QmpClient::connect(&path, T).await.unwrap();
    match qmp.block_resize("nope", 4096).await {
        Err(QmpError::Command { class, desc }) => {
            assert_eq!(class, "GenericError");
            assert!(desc.contains("nope"), "{desc}");
        }
        other => panic!("expected a Command error, got {other:?}"),
    }
    assert!(qmp.query_status().await.unwrap().running);
    drop(qmp);
    server.await.unwrap();
}

#[tokio::test]
async fn server_disconnect_fails_pending_and_later_calls() {
    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.greet().await;
        f.recv_cmd("slow-one").await;
        f.recv_cmd("slow-two").await;
        // Hang up with both calls unanswered.
    });
    let qmp = Arc::new(QmpClient::connect(&path, T).await.unwrap());
    let waiter = {
        let qmp = qmp.clone();
        tokio::spawn(async move { qmp.wait_event("NEVER", |_| true, T).await })
    };
    let (a, b) = tokio::join!(
        qmp.execute("slow-one", Value::Null),
        qmp.execute("slow-two", json!({"x": 1}))
    );
    server.await.unwrap();
    for res in [a, b] {
        match res {
            Err(QmpError::Disconnected(msg)) => assert!(msg.contains("closed"), "{msg}"),
            other => panic!("expected Disconnected, got {other:?}"),
        }
    }
    assert!(matches!(
        waiter.await.unwrap(),
        Err(QmpError::Disconnected(_))
    ));
    assert!(matches!(
        qmp.query_status().await,
        Err(QmpError::Disconnected(_))
    ));
    assert!(matches!(
        qmp.closed_reason(),
        Some(QmpError::Disconnected(_))
    ));
    // A receiver taken after the close ends at once.
    assert!(qmp.events().recv().await.is_err());
}

#[tokio::test]
async fn malformed_json_fails_pending_calls_with_protocol_error() {
    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.greet().await;
        f.recv_cmd("query-status").await;
        f.send_raw("{\"return\": {\"status\": \n").await;
        // Keep the socket open: the client must not wait for EOF.
        let _ = f.recv().await;
    });
    let qmp = QmpClient::connect(&path, T).await.unwrap();
    match qmp.query_status().await {
        Err(QmpError::Protocol(msg)) => assert!(msg.contains("malformed JSON"), "{msg}"),
        other => panic!("expected a Protocol error, got {other:?}"),
    }
    assert!(matches!(
        qmp.execute("query-status", Value::Null).await,
        Err(QmpError::Protocol(_))
    ));
    drop(qmp);
    server.await.unwrap();
}

#[tokio::test]
async fn timeout_then_late_reply_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.greet().await;
        let slow = f.recv_cmd("slow").await;
        let next = f.recv_cmd("query-status").await;
        // The late reply must not be taken as the answer to the next call.
        f.reply(&slow, json!({"status": "late", "running": false}))
            .await;
        f.reply(&next, json!({"status": "paused", "running": false}))
            .await;
        f.recv().await;
    });
    let qmp = QmpClient::connect(&path, T).await.unwrap();
    match qmp
        .execute_timeout("slow", Value::Null, Duration::from_millis(100))
        .await
    {
        Err(QmpError::Timeout { what, after }) => {
            assert!(what.contains("slow"), "{what}");
            assert_eq!(after, Duration::from_millis(100));
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert_eq!(qmp.query_status().await.unwrap().status, "paused");
    assert!(qmp.shared.lock().pending.is_empty());
    drop(qmp);
    server.await.unwrap();
}

#[tokio::test]
async fn cancelled_call_releases_its_slot() {
    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.greet().await;
        f.recv_cmd("never-answered").await;
        f.recv().await;
    });
    let qmp = QmpClient::connect(&path, T).await.unwrap();
    let call = qmp.execute("never-answered", Value::Null);
    assert!(
        tokio::time::timeout(Duration::from_millis(50), call)
            .await
            .is_err()
    );
    assert!(qmp.shared.lock().pending.is_empty());
    drop(qmp);
    server.await.unwrap();
}

#[tokio::test]
async fn invalid_arguments_are_rejected_before_sending() {
    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.greet().await;
        // The first thing after negotiation must be the one valid call.
        let cmd = f.recv_cmd("query-status").await;
        f.reply(&cmd, json!({"status": "prelaunch", "running": false}))
            .await;
        assert!(f.recv().await.is_none());
    });
    let qmp = QmpClient::connect(&path, T).await.unwrap();
    let file = std::env::current_exe().unwrap();
    let bad = [
        qmp.blockdev_add_file("0starts-with-digit", &file, false)
            .await
            .map(drop),
        qmp.blockdev_add_file("ok", Path::new("relative/path"), false)
            .await
            .map(drop),
        qmp.blockdev_add_file("ok", Path::new("/dev/null"), false)
            .await
            .map(drop),
        qmp.blockdev_add_file("ok", Path::new("/nonexistent/x"), false)
            .await
            .map(drop),
        qmp.device_add_virtio_blk("vd0", "has space", "s", None, &VirtioBlkOptions::default())
            .await,
        qmp.device_add_virtio_blk(
            "vd0",
            "n0",
            "serial-longer-than-20b",
            None,
            &VirtioBlkOptions::default(),
        )
        .await,
        qmp.device_add_virtio_blk(
            "vd0",
            "n0",
            "s",
            Some("bus,x=y"),
            &VirtioBlkOptions::default(),
        )
        .await,
        qmp.device_del("id/with/slash", T).await,
        qmp.blockdev_del(&"n".repeat(32)).await,
        qmp.block_resize("n0", 0).await,
        qmp.execute("query-status", json!([1, 2])).await.map(drop),
        qmp.execute("bad\"name", Value::Null).await.map(drop),
    ];
    for res in bad {
        assert!(matches!(res, Err(QmpError::InvalidArgument(_))), "{res:?}");
    }
    qmp.query_status().await.unwrap();
    drop(qmp);
    server.await.unwrap();
}

#[tokio::test]
async fn bad_greeting_and_silent_server() {
    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.send_raw("hello, not QMP\n").await;
        f.recv().await;
    });
    match QmpClient::connect(&path, T).await {
        Err(QmpError::Protocol(msg)) => assert!(msg.contains("greeting"), "{msg}"),
        other => panic!("expected a Protocol error, got {other:?}"),
    }
    server.await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.recv().await;
    });
    match QmpClient::connect(&path, Duration::from_millis(200)).await {
        Err(QmpError::Timeout { what, .. }) => assert!(what.contains("greeting"), "{what}"),
        other => panic!("expected Timeout, got {other:?}"),
    }
    server.await.unwrap();
}

#[tokio::test]
async fn connect_waits_for_the_socket_to_appear() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("late.sock");
    let connecting = tokio::spawn({
        let path = path.clone();
        async move { QmpClient::connect(&path, T).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let listener = UnixListener::bind(&path).unwrap();
    let (stream, _) = listener.accept().await.unwrap();
    let (rd, wr) = stream.into_split();
    let mut f = Fake {
        rd: BufReader::new(rd),
        wr,
    };
    f.greet().await;
    let qmp = connecting.await.unwrap().unwrap();
    assert_eq!(qmp.version().major, 9);
}

#[tokio::test]
async fn device_del_waits_for_its_own_event() {
    let dir = tempfile::tempdir().unwrap();
    let (path, server) = fake(&dir, |mut f| async move {
        f.greet().await;
        let cmd = f.recv_cmd("device_del").await;
        assert_eq!(cmd["arguments"], json!({"id": "vd1"}));
        // The event may precede the reply; other devices' events don't count.
        f.send(json!({"event": "DEVICE_DELETED",
            "data": {"path": "/machine/peripheral/vd1/virtio-backend"}}))
            .await;
        f.send(json!({"event": "DEVICE_DELETED",
            "data": {"device": "vd2", "path": "/machine/peripheral/vd2"}}))
            .await;
        f.send(json!({"event": "DEVICE_DELETED",
            "data": {"device": "vd1", "path": "/machine/peripheral/vd1"}}))
            .await;
        f.reply(&cmd, json!({})).await;
        // Then its iothread, if it has one, goes.
        let cmd = f.recv_cmd("query-iothreads").await;
        f.reply(&cmd, json!([{"id": "iothread-vd9"}])).await;
        let cmd = f.recv_cmd("device_del").await;
        f.send(json!({"id": cmd["id"], "error": {"class": "DeviceNotFound",
            "desc": "Device 'vd1' not found"}}))
            .await;
        let cmd = f.recv_cmd("query-iothreads").await;
        f.reply(&cmd, json!([{"id": "iothread-vd1"}])).await;
        let cmd = f.recv_cmd("object-del").await;
        assert_eq!(cmd["arguments"], json!({"id": "iothread-vd1"}));
        f.reply(&cmd, json!({})).await;
        let cmd = f.recv_cmd("device_del").await;
        f.reply(&cmd, json!({})).await;
        // A retry while the unplug is pending: keep waiting for the event.
        let cmd = f.recv_cmd("device_del").await;
        f.send(json!({"id": cmd["id"], "error": {"class": "GenericError",
            "desc": "Device vd3 is already in the process of unplug"}}))
            .await;
        f.send(json!({"event": "DEVICE_DELETED", "data": {"device": "vd3"}}))
            .await;
        let cmd = f.recv_cmd("query-iothreads").await;
        f.reply(&cmd, json!([])).await;
        let cmd = f.recv_cmd("device_del").await;
        f.send(json!({"id": cmd["id"], "error": {"class": "GenericError",
            "desc": "Bus 'pcie.0' does not support hotplugging"}}))
            .await;
        f.recv().await;
    });
    let qmp = QmpClient::connect(&path, T).await.unwrap();
    qmp.device_del("vd1", T).await.unwrap();
    // Already gone: idempotent success.
    qmp.device_del("vd1", T).await.unwrap();
    match qmp.device_del("vd3", Duration::from_millis(100)).await {
        Err(QmpError::Timeout { what, .. }) => assert!(what.contains("vd3"), "{what}"),
        other => panic!("expected Timeout, got {other:?}"),
    }
    qmp.device_del("vd3", T).await.unwrap();
    match qmp.device_del("vd4", T).await {
        Err(QmpError::Command { desc, .. }) => assert!(desc.contains("hotplugging"), "{desc}"),
        other => panic!("expected a Command error, got {other:?}"),
    }
    drop(qmp);
    server.await.unwrap();
}

#[test]
fn id_rules() {
    for ok in ["a", "vd0", "A.b-c_d", &"x".repeat(MAX_ID_LEN)] {
        validate_id(ok).unwrap();
    }
    for bad in [
        "",
        "0a",
        "-a",
        "_a",
        ".a",
        "a b",
        "a,b",
        "a/b",
        "é",
        "#block1",
        &"x".repeat(MAX_ID_LEN + 1),
    ] {
        assert!(
            matches!(validate_id(bad), Err(QmpError::InvalidArgument(_))),
            "{bad:?}"
        );
    }
    validate_node_name(&"n".repeat(MAX_NODE_NAME_LEN)).unwrap();
    assert!(validate_node_name(&"n".repeat(MAX_NODE_NAME_LEN + 1)).is_err());
    validate_serial("pvc-1234567890abcdef").unwrap();
    for bad in ["", "has space", "ü", &"s".repeat(MAX_SERIAL_LEN + 1)] {
        assert!(validate_serial(bad).is_err(), "{bad:?}");
    }
}

/// QEMU refusing the best way to open a volume (an engine it lacks, or
/// O_DIRECT on a file system without it) moves on to the next one; every
/// try keeps guest flushes (`no-flush=off`) and discards.
#[tokio::test]
async fn a_refused_io_mode_moves_on_to_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let candidates = BlockIo::candidates();
    let (path, server) = fake(&dir, |mut f| async move {
        f.greet().await;
        let mut seen = Vec::new();
        for _ in 0..2 {
            let cmd = f.recv_cmd("blockdev-add").await;
            let a = &cmd["arguments"];
            assert_eq!(a["cache"]["no-flush"], false, "{a}");
            assert_eq!(a["discard"], "unmap", "{a}");
            seen.push((a["cache"]["direct"].clone(), a["aio"].clone()));
            if seen.len() == 1 {
                f.send(json!({"id": cmd["id"], "error": {"class": "GenericError",
                    "desc": "Unable to use io_uring: failed to init linux io_uring ring"}}))
                    .await;
            } else {
                f.reply(&cmd, json!({})).await;
            }
        }
        let want: Vec<_> = BlockIo::candidates()[..2]
            .iter()
            .map(|c| (json!(c.direct), json!(c.aio.as_str())))
            .collect();
        assert_eq!(seen, want);
        f.recv().await;
    });
    let qmp = QmpClient::connect(&path, T).await.unwrap();
    let file = std::env::current_exe().unwrap();
    let io = qmp.blockdev_add_file("n0", &file, false).await.unwrap();
    assert_eq!(io, candidates[1]);
    drop(qmp);
    server.await.unwrap();
}
