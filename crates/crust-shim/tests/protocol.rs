//! The shim binary at the protocol level, the way each containerd
//! generation starts it (no containerd 2 can be installed here):
//! `start` answers a plain address to 1.6 (no MAX_SHIM_VERSION) and to a
//! 1.x that sets it (the real 1.6 Version service says 1.x), and a
//! protobuf BootstrapResult (task API v3, the socket in the given
//! socket_dir) when stdin carries 2.3's BootstrapParams; a second `start`
//! for the same pod returns the running shim's address; the one socket
//! answers `containerd.task.v2.Task` and `containerd.task.v3.Task` alike
//! over ttrpc; Shutdown through v3 ends the shim. Budget: ~5 s, no guest.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use containerd_shim::protos::ttrpc;
use containerd_shim::protos::ttrpc::r#async::Client;
use containerd_shim_protos::api;
use crust_shim::start_reply::{BootstrapParams, BootstrapResult};
use crust_testkit::{Containerd, ContainerdOptions};
use prost::Message as _;

fn bundle(dir: &Path, annotations: serde_json::Value) {
    std::fs::create_dir_all(dir).unwrap();
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"args": ["true"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
        "root": {"path": "rootfs"},
        "annotations": annotations,
    });
    std::fs::write(dir.join("config.json"), spec.to_string()).unwrap();
}

/// Runs `containerd-shim-crust-v2 ... start` in `bundle`.
fn start(ctrd: &Containerd, bundle: &Path, id: &str, stdin: &[u8], max_version: bool) -> Vec<u8> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_containerd-shim-crust-v2"));
    cmd.args(["-namespace", "proto", "-id", id, "-address"])
        .arg(ctrd.address())
        .args(["-publish-binary", "/usr/bin/containerd", "start"])
        .current_dir(bundle)
        .env(
            "TTRPC_ADDRESS",
            format!("{}.ttrpc", ctrd.address().display()),
        )
        .env_remove("MAX_SHIM_VERSION")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if max_version {
        cmd.env("MAX_SHIM_VERSION", "2");
    }
    let mut child = cmd.spawn().unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "start: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

async fn call<
    Req: containerd_shim::protos::protobuf::Message,
    Resp: containerd_shim::protos::protobuf::Message,
>(
    client: &Client,
    service: &str,
    method: &str,
    req: &Req,
) -> Result<Resp, ttrpc::Status> {
    let r = ttrpc::Request {
        service: service.into(),
        method: method.into(),
        payload: req.write_to_bytes().unwrap(),
        timeout_nano: 5_000_000_000,
        ..Default::default()
    };
    match client.request(r).await {
        Ok(resp) => Ok(Resp::parse_from_bytes(&resp.payload).unwrap()),
        Err(ttrpc::Error::RpcStatus(s)) => Err(s),
        Err(e) => panic!("ttrpc transport: {e:?}"),
    }
}

async fn wait_gone(socket: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    while Path::new(socket).exists() {
        assert!(Instant::now() < until, "{socket} still there");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_formats_and_task_v2_v3_on_one_socket() {
    crust_testkit::require_root();
    let ctrd = Containerd::start(ContainerdOptions::default());
    let dir = tempfile::tempdir().unwrap();

    // containerd 1.6: plain address, and the address file for restarts.
    let b1 = dir.path().join("b1");
    bundle(&b1, serde_json::json!({}));
    let plain = String::from_utf8(start(&ctrd, &b1, "p1", b"", false)).unwrap();
    assert!(plain.starts_with("unix:///run/containerd/s/"), "{plain:?}");
    assert_eq!(std::fs::read_to_string(b1.join("address")).unwrap(), plain);
    let shims = ctrd.shim_pids();
    assert_eq!(shims.len(), 1);

    // A member of the same pod (CRI annotations), from a 1.x that sets
    // MAX_SHIM_VERSION: the running shim's address, no second shim.
    let b2 = dir.path().join("b2");
    bundle(
        &b2,
        serde_json::json!({
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-id": "p1",
        }),
    );
    let again = String::from_utf8(start(&ctrd, &b2, "c2", b"", true)).unwrap();
    assert_eq!(again, plain);
    assert_eq!(ctrd.shim_pids(), shims);

    // containerd 2.3+: BootstrapParams on stdin, BootstrapResult back.
    let b3 = dir.path().join("b3");
    bundle(&b3, serde_json::json!({}));
    let sdir = dir.path().join("s");
    std::fs::create_dir(&sdir).unwrap();
    let params = BootstrapParams {
        instance_id: "p3".into(),
        namespace: "proto".into(),
        containerd_version: "v2.3.0".into(),
        containerd_ttrpc_address: format!("{}.ttrpc", ctrd.address().display()),
        containerd_grpc_address: ctrd.address().display().to_string(),
        socket_dir: Some(sdir.display().to_string()),
        ..Default::default()
    };
    let out = start(&ctrd, &b3, "p3", &params.encode_to_vec(), true);
    let res = BootstrapResult::decode(&out[..]).expect("a protobuf BootstrapResult");
    assert_eq!((res.version, res.protocol.as_str()), (3, "ttrpc"));
    let v3_sock = res.address.strip_prefix("unix://").unwrap().to_string();
    assert!(
        Path::new(&v3_sock).starts_with(&sdir),
        "{v3_sock} in the socket dir"
    );

    // Both task services on each socket.
    for sock in [
        plain.strip_prefix("unix://").unwrap().to_string(),
        v3_sock.clone(),
    ] {
        let client = Client::connect(&format!("unix://{sock}")).unwrap();
        let v2: api::ConnectResponse = call(
            &client,
            "containerd.task.v2.Task",
            "Connect",
            &api::ConnectRequest::new(),
        )
        .await
        .unwrap();
        let v3: api::ConnectResponse = call(
            &client,
            "containerd.task.v3.Task",
            "Connect",
            &api::ConnectRequest::new(),
        )
        .await
        .unwrap();
        assert!(v2.shim_pid > 0);
        assert_eq!(v2.shim_pid, v3.shim_pid, "one shim behind both");
        let mut st = api::StateRequest::new();
        st.id = "nope".into();
        let e = call::<_, api::StateResponse>(&client, "containerd.task.v3.Task", "State", &st)
            .await
            .unwrap_err();
        assert_eq!(e.code(), ttrpc::Code::NOT_FOUND);
        let e = call::<_, api::Empty>(
            &client,
            "containerd.task.v3.Task",
            "Pause",
            &api::PauseRequest::new(),
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), ttrpc::Code::UNIMPLEMENTED);
        // No container left: Shutdown ends the shim.
        let _: api::Empty = call(
            &client,
            "containerd.task.v3.Task",
            "Shutdown",
            &api::ShutdownRequest::new(),
        )
        .await
        .unwrap();
        wait_gone(&sock).await;
    }
    let until = Instant::now() + Duration::from_secs(10);
    while !ctrd
        .shim_pids()
        .into_iter()
        .all(|p| !crust_testkit::pid_alive(p))
    {
        assert!(Instant::now() < until, "shims still running");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
