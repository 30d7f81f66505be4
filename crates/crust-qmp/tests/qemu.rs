//! crust-qmp against a real `qemu-system-x86_64` (TCG, CPUs paused with
//! `-S`, no guest OS): hot-plug, resize, queries, errors, events, quit.
//!
//! Without a guest nothing acknowledges a PCI unplug, so `device_del` is
//! only tested up to its timeout here.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crust_qmp::{BlockIo, QmpClient, QmpError};
use crust_testkit::{ChildGuard, LoopDisk, VmSlot};
use serde_json::Value;
use tempfile::TempDir;

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(20);

/// A paused QEMU with two PCIe root ports (`rp0`, `rp1`) for hot-plug.
/// Fields drop in order: socket, process, temp dir, then the VM slot.
struct Qemu {
    qmp: QmpClient,
    guard: ChildGuard,
    dir: TempDir,
    _slot: VmSlot,
}

impl Qemu {
    async fn start() -> Qemu {
        let slot = tokio::task::spawn_blocking(VmSlot::acquire).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("qmp.sock");
        let child = Command::new("qemu-system-x86_64")
            .args([
                "-M",
                "q35",
                "-accel",
                "tcg",
                "-m",
                "64",
                "-smp",
                "1,maxcpus=3",
            ])
            .args(["-nodefaults", "-display", "none", "-S"])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", sock.display()))
            .args(["-device", "pcie-root-port,id=rp0,chassis=1"])
            .args(["-device", "pcie-root-port,id=rp1,chassis=2"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn qemu-system-x86_64");
        let guard = ChildGuard::new(child);
        let qmp = QmpClient::connect(&sock, T).await.expect("QMP handshake");
        Qemu {
            qmp,
            guard,
            dir,
            _slot: slot,
        }
    }

    /// A sparse file of `size` bytes in the test's temp dir.
    fn sparse_file(&self, name: &str, size: u64) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::File::create(&path).unwrap().set_len(size).unwrap();
        path
    }

    /// Waits for QEMU to exit on its own; returns whether it exited cleanly.
    fn wait_exit(&mut self, within: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < within {
            if let Some(status) = self.guard.child().try_wait().unwrap() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("QEMU still running after {within:?}");
    }
}

fn node_size(nodes: &[crust_qmp::BlockNode], name: &str) -> Option<u64> {
    nodes.iter().find(|n| n.node_name == name).map(|n| n.size)
}

async fn attached_size(qmp: &QmpClient, id: &str) -> u64 {
    let blocks = qmp.query_block().await.unwrap();
    let b = blocks
        .iter()
        .find(|b| b.is_device(id))
        .expect("device in query-block");
    b.inserted.as_ref().expect("medium inserted").size
}

fn assert_command_error(res: Result<(), QmpError>, classes: &[&str]) -> String {
    match res {
        Err(QmpError::Command { class, desc }) => {
            assert!(classes.contains(&class.as_str()), "class {class}: {desc}");
            desc
        }
        other => panic!("expected a QEMU error of class {classes:?}, got {other:?}"),
    }
}

#[tokio::test]
async fn file_volume_hotplug_resize_and_quit() {
    let mut vm = Qemu::start().await;
    let qmp = &vm.qmp;
    let img = vm.sparse_file("vol0.img", 64 * MIB);
    let other = vm.sparse_file("other.img", 8 * MIB);

    let io = qmp.blockdev_add_file("vol0", &img, false).await.unwrap();
    // O_DIRECT with the kernel's best engine (io_uring here), which
    // QEMU took.
    let best = BlockIo {
        direct: true,
        aio: crust_qmp::host_engines()[0],
    };
    assert_eq!(io, best);
    let nodes = qmp.query_named_block_nodes().await.unwrap();
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    assert_eq!(nodes[0].node_name, "vol0");
    assert_eq!(nodes[0].driver, "file");
    assert!(nodes[0].direct, "{nodes:?}");
    assert_eq!(Path::new(&nodes[0].file), img);
    assert_eq!(nodes[0].size, 64 * MIB);
    assert!(!nodes[0].read_only);

    // Idempotent re-add; a different file under the same name is refused.
    assert_eq!(
        qmp.blockdev_add_file("vol0", &img, false).await.unwrap(),
        best
    );
    assert_command_error(
        qmp.blockdev_add_file("vol0", &other, false).await.map(drop),
        &["GenericError"],
    );
    assert_eq!(qmp.query_named_block_nodes().await.unwrap().len(), 1);

    qmp.device_add_virtio_blk(
        "vd0",
        "vol0",
        "crust-vol0",
        Some("rp0"),
        &crust_qmp::VirtioBlkOptions::default(),
    )
    .await
    .unwrap();
    // A queue per vCPU the VM can have, an iothread of its own.
    assert_eq!(qmp.max_vcpus().await.unwrap(), 3);
    let queues = qmp
        .execute(
            "qom-get",
            serde_json::json!({"path": "/machine/peripheral/vd0", "property": "num-queues"}),
        )
        .await
        .unwrap();
    assert_eq!(queues, 3);
    assert_eq!(qmp.query_iothreads().await.unwrap(), ["iothread-vd0"]);
    let thread = qmp
        .execute(
            "qom-get",
            serde_json::json!({"path": "/machine/peripheral/vd0", "property": "iothread"}),
        )
        .await
        .unwrap();
    assert_eq!(thread, "/objects/iothread-vd0");
    qmp.device_add_virtio_blk(
        "vd0",
        "vol0",
        "crust-vol0",
        Some("rp0"),
        &crust_qmp::VirtioBlkOptions::default(),
    )
    .await
    .unwrap();
    let blocks = qmp.query_block().await.unwrap();
    let vd0 = blocks
        .iter()
        .find(|b| b.is_device("vd0"))
        .expect("vd0 attached");
    let node = vd0.inserted.as_ref().unwrap();
    assert_eq!(
        (node.node_name.as_str(), node.size),
        ("vol0", 64 * MIB),
        "{vd0:?}"
    );
    assert_eq!(Path::new(&node.file), img);
    // A second writer on the same node is refused by QEMU's permission model.
    assert_command_error(
        qmp.device_add_virtio_blk(
            "vd1",
            "vol0",
            "crust-vol0b",
            Some("rp1"),
            &crust_qmp::VirtioBlkOptions::default(),
        )
        .await,
        &["GenericError"],
    );

    // Grown on the host, then announced.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(96 * MIB)
        .unwrap();
    qmp.block_resize("vol0", 96 * MIB).await.unwrap();
    assert_eq!(attached_size(qmp, "vd0").await, 96 * MIB);
    // Grown by QEMU itself: the file on disk follows.
    qmp.block_resize("vol0", 128 * MIB).await.unwrap();
    assert_eq!(attached_size(qmp, "vd0").await, 128 * MIB);
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 128 * MIB);

    throttles_with_a_burst(qmp, "vd0").await;

    assert_command_error(
        qmp.block_resize("no-such-node", 128 * MIB).await,
        &["GenericError", "DeviceNotFound"],
    );
    // In use by vd0: refused, and the node stays.
    assert_command_error(qmp.blockdev_del("vol0").await, &["GenericError"]);
    assert_eq!(
        node_size(&qmp.query_named_block_nodes().await.unwrap(), "vol0"),
        Some(128 * MIB)
    );

    // Paused guest: the unplug request is accepted but never completes.
    match qmp.device_del("vd0", Duration::from_secs(2)).await {
        Err(QmpError::Timeout { what, .. }) => assert!(what.contains("vd0"), "{what}"),
        other => panic!("expected a DEVICE_DELETED timeout, got {other:?}"),
    }
    assert!(
        qmp.query_block()
            .await
            .unwrap()
            .iter()
            .any(|b| b.is_device("vd0"))
    );

    let mut events = qmp.events();
    qmp.quit().await.unwrap();
    let shutdown = qmp
        .next_event(&mut events, "SHUTDOWN", |_| true, T)
        .await
        .unwrap();
    assert_eq!(shutdown.data["reason"], "host-qmp-quit");
    assert!(vm.wait_exit(T), "QEMU exits cleanly on quit");
    assert!(matches!(
        vm.qmp.query_status().await,
        Err(QmpError::Disconnected(_))
    ));
}

#[tokio::test]
async fn loop_device_volume_resize() {
    crust_testkit::require_root();
    let backing_dir = tempfile::tempdir().unwrap();
    let lo = LoopDisk::new(backing_dir.path().join("loop.img"), 32 * MIB);
    let vm = Qemu::start().await;
    let qmp = &vm.qmp;

    qmp.blockdev_add_file("lvol", lo.dev(), false)
        .await
        .unwrap();
    let nodes = qmp.query_named_block_nodes().await.unwrap();
    let node = nodes.iter().find(|n| n.node_name == "lvol").unwrap();
    assert_eq!(node.driver, "host_device");
    assert_eq!(Path::new(&node.file), lo.dev());
    assert_eq!(node.size, 32 * MIB);
    qmp.device_add_virtio_blk(
        "vd0",
        "lvol",
        "crust-lvol",
        Some("rp0"),
        &crust_qmp::VirtioBlkOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(attached_size(qmp, "vd0").await, 32 * MIB);

    lo.grow(48 * MIB);
    qmp.block_resize("lvol", 48 * MIB).await.unwrap();
    assert_eq!(attached_size(qmp, "vd0").await, 48 * MIB);
    // QEMU cannot grow a block device beyond its real size.
    assert_command_error(qmp.block_resize("lvol", 64 * MIB).await, &["GenericError"]);
    assert_eq!(attached_size(qmp, "vd0").await, 48 * MIB);

    // An unattached read-only node comes and goes; deleting twice is fine.
    let spare = vm.sparse_file("spare.img", 4 * MIB);
    qmp.blockdev_add_file("spare", &spare, true).await.unwrap();
    let nodes = qmp.query_named_block_nodes().await.unwrap();
    assert!(nodes.iter().any(|n| n.node_name == "spare" && n.read_only));
    qmp.blockdev_del("spare").await.unwrap();
    qmp.blockdev_del("spare").await.unwrap();
    let nodes = qmp.query_named_block_nodes().await.unwrap();
    assert_eq!(node_size(&nodes, "spare"), None);
    assert_eq!(node_size(&nodes, "lvol"), Some(48 * MIB));

    // QEMU must let go of the loop device before it is detached.
    drop(vm);
    drop(lo);
}

#[tokio::test]
async fn errors_events_and_connection_loss() {
    let mut vm = Qemu::start().await;
    let qmp = &vm.qmp;

    let out = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let v = qmp.version();
    assert!(
        text.contains(&format!("version {}.{}.{}", v.major, v.minor, v.micro)),
        "{v:?} vs {text}"
    );

    let status = qmp.query_status().await.unwrap();
    assert_eq!(
        (status.running, status.status.as_str()),
        (false, "prelaunch")
    );

    // Bad names never reach QEMU, so nothing changes.
    let img = vm.sparse_file("x.img", MIB);
    let pci_before = qmp.query_pci().await.unwrap();
    for res in [
        qmp.blockdev_add_file("9lives", &img, false).await.map(drop),
        qmp.blockdev_add_file("a,driver=qcow2", &img, false)
            .await
            .map(drop),
        qmp.blockdev_add_file(&"n".repeat(32), &img, false)
            .await
            .map(drop),
        qmp.device_add_virtio_blk(
            "vd 0",
            "n0",
            "s",
            Some("rp0"),
            &crust_qmp::VirtioBlkOptions::default(),
        )
        .await,
        qmp.device_add_virtio_blk(
            "vd0",
            "n0",
            "s",
            Some("rp0,addr=3"),
            &crust_qmp::VirtioBlkOptions::default(),
        )
        .await,
        qmp.block_resize("-x", MIB).await,
    ] {
        assert!(matches!(res, Err(QmpError::InvalidArgument(_))), "{res:?}");
    }
    assert!(qmp.query_named_block_nodes().await.unwrap().is_empty());
    assert_eq!(qmp.query_pci().await.unwrap(), pci_before);

    assert_command_error(
        qmp.execute("no-such-command", Value::Null).await.map(drop),
        &["CommandNotFound"],
    );

    // Events: run, pause, power button.
    let mut events = qmp.events();
    qmp.cont().await.unwrap();
    qmp.next_event(&mut events, "RESUME", |_| true, T)
        .await
        .unwrap();
    assert!(qmp.query_status().await.unwrap().running);

    // A hot-plugged disk shows up behind the root port in query-pci. The
    // firmware may still be numbering buses (SeaBIOS parks a bridge's
    // secondary bus at 255 while it scans), so wait for one snapshot where
    // rp0's bus is settled and the disk sits on it.
    qmp.blockdev_add_file("n0", &img, false).await.unwrap();
    qmp.device_add_virtio_blk(
        "vd0",
        "n0",
        "crust-n0",
        Some("rp0"),
        &crust_qmp::VirtioBlkOptions::default(),
    )
    .await
    .unwrap();
    let deadline = Instant::now() + T;
    loop {
        let pci = qmp.query_pci().await.unwrap();
        let rp0 = pci.iter().find(|d| d.qdev_id == "rp0").expect("rp0");
        // Behind an unnumbered bridge the disk is not listed at all.
        let dev = pci.iter().find(|d| d.qdev_id == "vd0");
        match (rp0.secondary_bus, dev) {
            (Some(n), Some(dev)) if n > 0 && n < 255 && dev.bus == n => {
                assert_eq!((dev.vendor, dev.class), (0x1af4, 0x0100), "{dev:?}");
                break;
            }
            _ => assert!(
                Instant::now() < deadline,
                "vd0 never settled behind rp0: {dev:?} {rp0:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    qmp.stop().await.unwrap();
    qmp.next_event(&mut events, "STOP", |_| true, T)
        .await
        .unwrap();
    assert_eq!(qmp.query_status().await.unwrap().status, "paused");
    qmp.system_powerdown().await.unwrap();
    let ev = qmp
        .next_event(&mut events, "POWERDOWN", |_| true, T)
        .await
        .unwrap();
    assert!(ev.timestamp.is_some());

    // QEMU dies under a waiting caller: it learns at once, not at timeout.
    let waiting = qmp.wait_event("NEVER_SENT", |_| true, T);
    let killer = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        vm.guard.child().kill().unwrap();
    };
    let (res, ()) = tokio::join!(waiting, killer);
    assert!(matches!(res, Err(QmpError::Disconnected(_))), "{res:?}");
    assert!(matches!(
        vm.qmp.query_status().await,
        Err(QmpError::Disconnected(_))
    ));
    assert!(vm.qmp.closed_reason().is_some());
}

/// Throttled with a burst: QEMU reports what was set; a burst below its
/// rate is QEMU's refusal and leaves the limits as they were.
async fn throttles_with_a_burst(qmp: &QmpClient, id: &str) {
    let limits = crust_qmp::IoThrottle {
        iops: 100,
        iops_max: 400,
        bps_wr: 1 << 20,
        bps_wr_max: 4 << 20,
        max_length: 5,
        ..Default::default()
    };
    qmp.block_set_io_throttle(id, &limits).await.unwrap();
    let throttle = || async {
        let blocks = qmp.execute("query-block", Value::Null).await.unwrap();
        let vd0 = blocks
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["qdev"].as_str().is_some_and(|q| q.contains(id)))
            .unwrap()
            .clone();
        let i = &vd0["inserted"];
        [
            "iops",
            "iops_max",
            "iops_max_length",
            "bps_wr",
            "bps_wr_max",
            "bps_wr_max_length",
            "bps_rd_max",
        ]
        // QEMU leaves out a burst that is not set.
        .map(|k| i[k].as_u64().unwrap_or(0))
    };
    assert_eq!(throttle().await, [100, 400, 5, 1 << 20, 4 << 20, 5, 0]);
    assert_command_error(
        qmp.block_set_io_throttle(
            id,
            &crust_qmp::IoThrottle {
                iops: 100,
                iops_max: 50,
                ..Default::default()
            },
        )
        .await,
        &["GenericError"],
    );
    assert_eq!(throttle().await, [100, 400, 5, 1 << 20, 4 << 20, 5, 0]);
    qmp.block_set_io_throttle(id, &Default::default())
        .await
        .unwrap();
    assert_eq!(throttle().await[..2], [0, 0]);
}

/// Runs a qemu-io command on block node `node` (HMP; its output goes to
/// QEMU's stdout, so only failures are seen here).
async fn qemu_io(qmp: &QmpClient, node: &str, cmd: &str) {
    let out = qmp
        .execute(
            "human-monitor-command",
            serde_json::json!({ "command-line": format!("qemu-io {node} \"{cmd}\"") }),
        )
        .await
        .unwrap();
    assert_eq!(out.as_str(), Some(""), "qemu-io {node} {cmd}: {out}");
}

/// Issue 25 item 1: a file handed over as a descriptor is the one the
/// caller opened. The path is then swapped for another file and for a
/// symlink: QEMU still reads the original inode (it never looked the path
/// up), and its fd set goes with the node.
#[tokio::test]
async fn descriptor_volume_is_the_opened_file_whatever_the_path_becomes() {
    use std::os::unix::fs::OpenOptionsExt;
    let vm = Qemu::start().await;
    let qmp = &vm.qmp;
    let img = vm.sparse_file("vol.img", 8 * MIB);
    std::fs::write(&img, vec![b'A'; 4096]).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(8 * MIB)
        .unwrap();
    let file = std::fs::File::options()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&img)
        .unwrap();
    // The path now names something else.
    std::fs::rename(&img, vm.dir.path().join("moved.img")).unwrap();
    let other = vm.sparse_file("other.img", 8 * MIB);
    std::fs::write(&other, vec![b'B'; 4096]).unwrap();
    std::os::unix::fs::symlink(&other, &img).unwrap();

    // Access modes must agree (QEMU picks from the set by them).
    let ro = std::fs::File::open(vm.dir.path().join("moved.img")).unwrap();
    assert!(matches!(
        qmp.blockdev_add_fd("fdvol", ro.into(), false)
            .await
            .map(drop),
        Err(QmpError::InvalidArgument(_))
    ));
    // A copy shares the file description QEMU gets, and so its flags.
    let ours = file.try_clone().unwrap();
    let io = qmp
        .blockdev_add_fd("fdvol", file.into(), false)
        .await
        .unwrap();
    assert!(io.direct, "{io:?}");
    let fl = rustix::fs::fcntl_getfl(&ours).unwrap();
    assert!(
        fl.contains(rustix::fs::OFlags::DIRECT),
        "the descriptor QEMU opens with cache.direct=on is O_DIRECT: {fl:?}"
    );
    let nodes = qmp.query_named_block_nodes().await.unwrap();
    let node = nodes.iter().find(|n| n.node_name == "fdvol").unwrap();
    assert!(node.file.starts_with("/dev/fdset/"), "{node:?}");
    assert_eq!((node.driver.as_str(), node.size), ("file", 8 * MIB));
    // QEMU writes through the node (HMP `qemu-io`): the opened inode
    // changes, the file the path names now does not.
    qemu_io(qmp, "fdvol", "write -P 0x5a 0 4096").await;
    let moved = std::fs::read(vm.dir.path().join("moved.img")).unwrap();
    assert_eq!(
        &moved[..4096],
        &[0x5a; 4096][..],
        "QEMU wrote the opened file"
    );
    let swapped = std::fs::read(&other).unwrap();
    assert_eq!(
        &swapped[..4096],
        &[b'B'; 4096][..],
        "never the path's new target"
    );
    qmp.device_add_virtio_blk(
        "vdfd",
        "fdvol",
        "crust-fd",
        Some("rp0"),
        &crust_qmp::VirtioBlkOptions::default(),
    )
    .await
    .unwrap();
    // Idempotent.
    let again = std::fs::File::options()
        .read(true)
        .write(true)
        .open(vm.dir.path().join("moved.img"))
        .unwrap();
    qmp.blockdev_add_fd("fdvol", again.into(), false)
        .await
        .unwrap();
    let sets = qmp.execute("query-fdsets", Value::Null).await.unwrap();
    assert_eq!(sets.as_array().unwrap().len(), 1, "{sets}");
    // No guest acknowledges an unplug here, so an unattached node shows
    // that the set goes with the node.
    let file2 = std::fs::File::options()
        .read(true)
        .open(vm.dir.path().join("moved.img"))
        .unwrap();
    qmp.blockdev_add_fd("fdro", file2.into(), true)
        .await
        .unwrap();
    assert_eq!(
        qmp.execute("query-fdsets", Value::Null)
            .await
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        2
    );
    // QEMU closes a removed set's descriptors only while the VM runs.
    qmp.cont().await.unwrap();
    qmp.blockdev_del("fdro").await.unwrap();
    let sets = qmp.execute("query-fdsets", Value::Null).await.unwrap();
    assert_eq!(sets.as_array().unwrap().len(), 1, "{sets}");
    assert!(sets.to_string().contains("crust-node:fdvol"), "{sets}");
}
