//! The shared plug routine's hold and rollback against a scripted QMP peer
//! (no guest: the agent is absent, so every guest mount fails) on a real
//! loop device. From `add-fd` (the device's backing file, by descriptor)
//! to `remove-fd` the peer checks that the host cannot open the device
//! `O_EXCL`: the hold spans QEMU's use. A failed mount whose detach works leaves the device free and the
//! bus returned; a detach that fails keeps the device held until QEMU is
//! gone; a device mounted on the host is refused before any QMP command.
//! Budget: under a second.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crust_agent_proto::AgentClient;
use crust_blockdev::FsType;
use crust_handoff::MountInfo;
use crust_qmp::QmpClient;
use crust_runtime::discovery::{LayoutKind, Volume};
use crust_runtime::plug::{self, Attachments, GuestPorts};
use crust_runtime::volumes::VolumeError;
use crust_testkit::LoopDisk;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// (command, whether the host's exclusive open failed at that moment).
type Seen = Arc<Mutex<Vec<(String, bool)>>>;

fn held(dev: &Path) -> bool {
    crust_blockdev::ensure_device_free(dev, "test").is_err()
}

/// A QMP peer answering one connection: `device_del` succeeds (with its
/// DEVICE_DELETED event) unless `stuck`, then it fails as a device QEMU
/// cannot let go of.
fn fake_qmp(sock: PathBuf, dev: PathBuf, stuck: bool) -> Seen {
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
            log.lock().unwrap().push((cmd.clone(), held(&dev)));
            let mut out = String::new();
            let reply = match cmd.as_str() {
                "device_del" if stuck => {
                    json!({"error": {"class": "GenericError", "desc": "stuck"}})
                }
                "device_del" => {
                    let ev = json!({"event": "DEVICE_DELETED",
                        "data": {"device": req["arguments"]["id"]},
                        "timestamp": {"seconds": 0, "microseconds": 0}});
                    out.push_str(&format!("{ev}\n"));
                    json!({"return": {}})
                }
                "query-named-block-nodes" | "query-block" => json!({"return": []}),
                // The loop device's backing file comes by descriptor.
                "add-fd" => json!({"return": {"fdset-id": 1, "fd": 9}}),
                _ => json!({"return": {}}),
            };
            let mut reply = reply;
            reply["id"] = req["id"].clone();
            out.push_str(&format!("{reply}\n"));
            wr.write_all(out.as_bytes()).await.unwrap();
        }
    });
    seen
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
    Result<Option<crust_runtime::records::VolumeIo>, VolumeError>,
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
            // The loop device's backing file, by descriptor (issue 28).
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
            "remove-fd"
        ]
    );
    assert!(held_at(&seen, "add-fd"), "held before QEMU has the file");
    assert!(held_at(&seen, "blockdev-add"), "held before QEMU opens it");
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
