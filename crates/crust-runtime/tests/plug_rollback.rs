//! The shared plug routine's hold and rollback against a scripted QMP peer
//! (no guest: the agent is absent, so every guest mount fails) on a real
//! loop device. From `getfd` (QEMU's copy of the hold) and `add-fd` (the
//! device's backing file, by descriptor) to `remove-fd` the peer checks that the host cannot open the device
//! `O_EXCL`: the hold spans QEMU's use. A failed mount whose detach works leaves the device free and the
//! bus returned; a detach that fails keeps the device held until QEMU is
//! gone; a device mounted on the host is refused before any QMP command.
//! A resize of a node on the backing file is refused at a size that is not
//! the file's own. Budget: under a second.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crust_agent_proto::AgentClient;
use crust_blockdev::FsType;
use crust_handoff::MountInfo;
use crust_qmp::QmpClient;
use crust_sandbox::discovery::{LayoutKind, Volume};
use crust_sandbox::plug::{self, Attachments, GuestPorts};
use crust_sandbox::volumes::VolumeError;
use crust_testkit::LoopDisk;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// (command, whether the host's exclusive open failed at that moment).
type Seen = Arc<Mutex<Vec<(String, bool)>>>;

fn held(dev: &Path) -> bool {
    crust_blockdev::ensure_device_free(dev, "test").is_err()
}

/// What a scripted QMP peer answers a command: its reply, and an event
/// it sends first.
type Answer = (Value, Option<Value>);

/// A QMP peer answering one connection with `answer`; it logs each
/// command with whether the host's exclusive open of `dev` (if any)
/// failed at that moment.
fn serve_qmp(
    sock: PathBuf,
    dev: Option<PathBuf>,
    mut answer: impl FnMut(&str, &Value) -> Answer + Send + 'static,
) -> Seen {
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        let (rd, mut wr) = s.into_split();
        let greeting = json!({"QMP": {"version": {"qemu": {"major": 8, "minor": 2, "micro": 0},
            "package": ""}, "capabilities": []}});
        wr.write_all(format!("{greeting}\n").as_bytes())
            .await
            .unwrap();
        let mut lines = BufReader::new(rd).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let req: Value = serde_json::from_str(&line).unwrap();
            let cmd = req["execute"].as_str().unwrap().to_string();
            let busy = dev.as_deref().is_some_and(held);
            log.lock().unwrap().push((cmd.clone(), busy));
            let (mut reply, event) = answer(&cmd, &req);
            reply["id"] = req["id"].clone();
            let mut out = event.map(|e| format!("{e}\n")).unwrap_or_default();
            out.push_str(&format!("{reply}\n"));
            wr.write_all(out.as_bytes()).await.unwrap();
        }
    });
    seen
}

/// A QMP peer answering one connection: `device_del` succeeds (with its
/// DEVICE_DELETED event) unless `stuck`, then it fails as a device QEMU
/// cannot let go of; fd sets are kept as QEMU keeps them.
fn fake_qmp(sock: PathBuf, dev: PathBuf, stuck: bool) -> Seen {
    // The fd sets handed out: (id, opaque tag).
    let mut sets: Vec<(u64, String)> = Vec::new();
    serve_qmp(sock, Some(dev), move |cmd, req| match cmd {
        "add-fd" => {
            let id = sets.len() as u64 + 1;
            let tag = req["arguments"]["opaque"]
                .as_str()
                .unwrap_or("")
                .to_string();
            sets.push((id, tag));
            (json!({"return": {"fdset-id": id, "fd": 9}}), None)
        }
        "remove-fd" => {
            let id = req["arguments"]["fdset-id"].as_u64();
            sets.retain(|(s, _)| Some(*s) != id);
            (json!({"return": {}}), None)
        }
        "query-fdsets" => {
            let list: Vec<Value> = sets
                .iter()
                .map(|(id, tag)| json!({"fdset-id": id, "fds": [{"fd": 9, "opaque": tag}]}))
                .collect();
            (json!({ "return": list }), None)
        }
        "device_del" if stuck => (
            json!({"error": {"class": "GenericError", "desc": "stuck"}}),
            None,
        ),
        "device_del" => {
            let ev = json!({"event": "DEVICE_DELETED",
                "data": {"device": req["arguments"]["id"]},
                "timestamp": {"seconds": 0, "microseconds": 0}});
            (json!({"return": {}}), Some(ev))
        }
        "query-named-block-nodes" | "query-block" => (json!({"return": []}), None),
        _ => (json!({"return": {}}), None),
    })
}

fn commands(seen: &Seen) -> Vec<String> {
    seen.lock()
        .unwrap()
        .iter()
        .map(|(c, _)| c.clone())
        .collect()
}

fn held_at(seen: &Seen, cmd: &str) -> bool {
    seen.lock()
        .unwrap()
        .iter()
        .find(|(c, _)| c == cmd)
        .unwrap_or_else(|| panic!("no {cmd}"))
        .1
}

async fn plug_with(
    dir: &Path,
    name: &str,
    disk: &LoopDisk,
    stuck: bool,
) -> (
    Attachments,
    Result<Option<crust_sandbox::records::VolumeIo>, VolumeError>,
    Seen,
) {
    let sock = dir.join(format!("{name}.qmp"));
    let seen = fake_qmp(sock.clone(), disk.dev().to_path_buf(), stuck);
    let qmp = QmpClient::connect(&sock, Duration::from_secs(5))
        .await
        .unwrap();
    let agent = AgentClient::with_timeout(dir.join("no-agent.sock"), Duration::from_millis(200));
    let ports = GuestPorts {
        qmp: &qmp,
        agent: &agent,
        mount_timeout: Duration::from_millis(200),
        file_device_roots: &[],
        records: None,
    };
    let v = Volume::from_record(
        LayoutKind::Crust,
        &format!("/pods/u/volumes/kubernetes.io~csi/{name}/mount"),
        &MountInfo::block(disk.dev_str(), "ext4"),
        false,
    );
    let att = Attachments::default();
    att.set_buses(vec!["crust-rp0".into()]);
    let res = plug::plug(&att, &ports, &v).await;
    (att, res, seen)
}

#[tokio::test]
async fn the_hold_spans_qemus_use_and_every_rollback() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let disk = LoopDisk::with_fs(dir.path().join("d.img"), 16 << 20, FsType::Ext4);

    // The guest mount fails; the detach works: free device, bus back.
    let (att, res, seen) = plug_with(dir.path(), "a", &disk, false).await;
    assert!(matches!(res, Err(VolumeError::Agent { .. })), "{res:?}");
    assert_eq!(
        commands(&seen),
        [
            "qmp_capabilities",
            // QEMU keeps a copy of the hold on the device (issue 28)...
            "getfd",
            // ... and opens its backing file, by descriptor.
            "query-named-block-nodes",
            "add-fd",
            "blockdev-add",
            // Queues for the VM's vCPUs, the device's own iothread.
            "query-hotpluggable-cpus",
            "query-iothreads",
            "object-add",
            "device_add",
            "device_del",
            "query-iothreads",
            "blockdev-del",
            "closefd",
            "query-fdsets",
            "remove-fd"
        ]
    );
    assert!(held_at(&seen, "add-fd"), "held before QEMU has the file");
    assert!(held_at(&seen, "blockdev-add"), "held before QEMU opens it");
    assert!(held_at(&seen, "getfd"), "held before QEMU keeps a copy");
    assert!(held_at(&seen, "remove-fd"), "held until QEMU let go");
    assert!(!held(disk.dev()), "free after the rollback");
    assert_eq!(att.take_bus().as_deref(), Some("crust-rp0"), "bus returned");
    assert!(att.volumes().is_empty());

    // The detach fails: QEMU may still have it, so it stays held.
    let (att, res, seen) = plug_with(dir.path(), "b", &disk, true).await;
    assert!(matches!(res, Err(VolumeError::Agent { .. })), "{res:?}");
    assert!(commands(&seen).contains(&"device_del".to_string()));
    assert!(held(disk.dev()), "held while QEMU may have it");
    att.guest_gone();
    assert!(!held(disk.dev()), "free once QEMU is gone");

    // Mounted on the host: refused before any QMP command, naming the mount.
    let m = disk.mount_temp(&[], true);
    let (att, res, seen) = plug_with(dir.path(), "c", &disk, false).await;
    let e = res.unwrap_err();
    assert!(matches!(e, VolumeError::HostDevice { .. }), "{e}");
    assert!(
        e.to_string().contains(m.path().to_str().unwrap()),
        "names the mount: {e}"
    );
    assert_eq!(commands(&seen), ["qmp_capabilities"]);
    assert_eq!(att.take_bus().as_deref(), Some("crust-rp0"));
    drop(m);
    assert!(!held(disk.dev()));
}

/// A QMP peer whose only node is `node` on driver `drv`.
fn nodes_qmp(sock: PathBuf, node: String, drv: &'static str) -> Seen {
    serve_qmp(sock, None, move |cmd, _| match cmd {
        "query-named-block-nodes" => (
            json!({"return": [{"node-name": node, "drv": drv, "file": "/dev/fdset/1", "ro": false}]}),
            None,
        ),
        _ => (json!({"return": {}}), None),
    })
}

/// QEMU grows a node opened on the loop device's backing file by
/// truncating the file to the size it is given: a size that is not the
/// file's own now (the file grew again after the loop device was
/// refreshed) is refused before `block_resize`, and the file keeps its
/// bytes. A node on the device itself is not the file's business.
#[tokio::test]
async fn a_resize_never_truncates_the_backing_file() {
    crust_testkit::require_root();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("r.img");
    let disk = LoopDisk::with_fs(img.clone(), 16 << 20, FsType::Ext4);
    let v = Volume::from_record(
        LayoutKind::Crust,
        "/pods/u/volumes/kubernetes.io~csi/r/mount",
        &MountInfo::block(disk.dev_str(), "ext4"),
        false,
    );
    // A second expansion grew the file; the loop device still has 16 MiB.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    for (drv, refused) in [("file", true), ("host_device", false)] {
        let sock = dir.path().join(format!("{drv}.qmp"));
        let seen = nodes_qmp(sock.clone(), v.node_name.clone(), drv);
        let qmp = QmpClient::connect(&sock, Duration::from_secs(5))
            .await
            .unwrap();
        let res = crust_sandbox::volumes::never_shrink_backing_file(&qmp, &v, 16 << 20).await;
        if refused {
            let e = res.unwrap_err();
            assert!(e.to_string().contains("retry"), "{e}");
        } else {
            res.unwrap();
        }
        assert!(!commands(&seen).contains(&"block_resize".to_string()));
        // The file's own size passes.
        if drv == "file" {
            crust_sandbox::volumes::never_shrink_backing_file(&qmp, &v, 32 << 20)
                .await
                .unwrap();
        }
    }
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 32 << 20);
}
