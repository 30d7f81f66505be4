//! Snapshots, clones and group snapshots through the real plugin on a pool
//! whose filesystem decides the copy path (xfs: reflink, ext4: sparse
//! copy): checksummed data at snapshot time, a snapshot and a clone of a
//! volume a writer is fsyncing to, the spec's status codes, paging, a
//! crash of the plugin in the middle of a copy.
//!
//! Time budget: about 60 s on two busy cores.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use crust_proto::csi::v1 as csi;
use sha2::{Digest, Sha256};
use tonic::Code;

/// A node whose pool lives on its own filesystem of type `fs`.
struct FsNode {
    node: TestNode,
    _mount: crust_blockdev::MountGuard,
    _disk: crust_testkit::LoopDisk,
}

fn fs_node(fs: crust_blockdev::FsType, size: u64, extra: &[&str]) -> FsNode {
    let mut args = vec!["--pool-capacity", "4Gi"];
    args.extend_from_slice(extra);
    let mut node = TestNode::unstarted(&args, "0s");
    let disk = crust_testkit::LoopDisk::with_fs(node.path("poolfs.img"), size, fs);
    let dir = node.path("poolfs");
    std::fs::create_dir_all(&dir).unwrap();
    let mount = disk.mount(&dir, &[], false);
    node.pool = dir.join("pool");
    node.start();
    FsNode {
        node,
        _mount: mount,
        _disk: disk,
    }
}

fn snap_req(name: &str, source: &str) -> csi::CreateSnapshotRequest {
    csi::CreateSnapshotRequest {
        source_volume_id: source.into(),
        name: name.into(),
        ..Default::default()
    }
}

async fn snapshot(
    c: &mut Clients,
    name: &str,
    source: &str,
) -> Result<csi::Snapshot, tonic::Status> {
    c.ctl
        .create_snapshot(snap_req(name, source))
        .await
        .map(|r| r.into_inner().snapshot.unwrap())
}

fn from_snapshot(name: &str, size: i64, fs: &str, snap: &str) -> csi::CreateVolumeRequest {
    let mut r = create_req(name, size, vec![mount(fs)]);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(
            csi::volume_content_source::SnapshotSource {
                snapshot_id: snap.into(),
            },
        )),
    });
    r
}

fn from_volume(name: &str, size: i64, fs: &str, vol: &str) -> csi::CreateVolumeRequest {
    let mut r = create_req(name, size, vec![mount(fs)]);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Volume(
            csi::volume_content_source::VolumeSource {
                volume_id: vol.into(),
            },
        )),
    });
    r
}

/// Stages and publishes `id` under `tag`; returns (staging, target).
async fn mount_volume(
    c: &mut Clients,
    node: &TestNode,
    id: &str,
    fs: &str,
    tag: &str,
) -> (String, String) {
    let staging = node.mkdir(&format!("{tag}-staging"));
    let target = node.path(&format!("{tag}-target"));
    let target = target.to_str().unwrap().to_string();
    c.stage(id, &staging, mount(fs)).await.unwrap();
    c.publish(id, &staging, &target, mount(fs), false)
        .await
        .unwrap();
    (staging, target)
}

async fn unmount_volume(c: &mut Clients, id: &str, (staging, target): &(String, String)) {
    c.unpublish(id, target).await.unwrap();
    c.unstage(id, staging).await.unwrap();
}

/// sha256 of every regular file under `dir`, by relative path.
fn checksums(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                if e.file_name() != "lost+found" {
                    stack.push(p);
                }
            } else if t.is_file() {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                let sum = format!("{:x}", Sha256::digest(std::fs::read(&p).unwrap()));
                out.push((rel, sum));
            }
        }
    }
    out.sort();
    out
}

fn write_file(dir: &str, name: &str, data: &[u8]) {
    let mut f = std::fs::File::create(Path::new(dir).join(name)).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
}

fn fsck_clean(device: &Path, fs: &str) {
    let out = if fs == "xfs" {
        Command::new("xfs_repair")
            .arg("-n")
            .arg(device)
            .output()
            .unwrap()
    } else {
        Command::new("e2fsck")
            .args(["-fn"])
            .arg(device)
            .output()
            .unwrap()
    };
    assert!(
        out.status.success(),
        "{fs} check of {} failed: {}{}",
        device.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn data_survives(fs_kind: crust_blockdev::FsType, fs: &str, size: i64, method: &str) {
    let n = fs_node(fs_kind, 3 << 30, &[]);
    let node = &n.node;
    let mut c = node.clients().await;
    let v = c
        .create(create_req("src", size, vec![mount(fs)]))
        .await
        .unwrap();
    let mv = mount_volume(&mut c, node, &v.volume_id, fs, "src").await;
    write_file(&mv.1, "a.bin", &vec![0x5A; 3 << 20]);
    write_file(&mv.1, "b.txt", b"before the snapshot");
    let at_snapshot = checksums(Path::new(&mv.1));

    // Snapshot while mounted (frozen around the copy), then overwrite.
    let s = snapshot(&mut c, "snap-1", &v.volume_id).await.unwrap();
    assert!(s.ready_to_use);
    assert_eq!(s.source_volume_id, v.volume_id);
    assert_eq!(s.size_bytes, v.capacity_bytes);
    assert!(s.creation_time.is_some());
    // The source stays writable after the thaw.
    write_file(&mv.1, "b.txt", b"AFTER the snapshot");
    write_file(&mv.1, "c.txt", b"new file");
    assert_ne!(checksums(Path::new(&mv.1)), at_snapshot);
    // The copy path the pool's filesystem allows.
    let meta = std::fs::read_to_string(node.pool.join("index.json")).unwrap();
    assert!(
        meta.contains(&format!("\"method\": \"{method}\"")),
        "{meta}"
    );

    // Idempotent; the name reused for another source is ALREADY_EXISTS.
    assert_eq!(snapshot(&mut c, "snap-1", &v.volume_id).await.unwrap(), s);
    let other = c
        .create(create_req("other", size, vec![mount(fs)]))
        .await
        .unwrap();
    assert_code(
        snapshot(&mut c, "snap-1", &other.volume_id).await,
        Code::AlreadyExists,
    );
    assert_code(
        snapshot(&mut c, "snap-2", "vol-00000000000000000000000000000000").await,
        Code::NotFound,
    );

    // Restore into a larger volume: the bytes of snapshot time, grown fs.
    let bigger = size + 64 * MIB;
    let r = c
        .create(from_snapshot("restored", bigger, fs, &s.snapshot_id))
        .await
        .unwrap();
    assert_eq!(r.capacity_bytes, bigger);
    let src = r.content_source.as_ref().unwrap();
    assert!(
        matches!(&src.r#type, Some(csi::volume_content_source::Type::Snapshot(x)) if x.snapshot_id == s.snapshot_id)
    );
    let mr = mount_volume(&mut c, node, &r.volume_id, fs, "restored").await;
    assert_eq!(checksums(Path::new(&mr.1)), at_snapshot);
    let total = crust_blockdev::usage(Path::new(&mr.1)).unwrap().bytes_total;
    let src_total = crust_blockdev::usage(Path::new(&mv.1)).unwrap().bytes_total;
    assert!(
        total > src_total + 32 * MIB as u64,
        "filesystem grown: {total} vs {src_total}"
    );
    // Too small, unknown snapshot, other filesystem.
    let mut small = from_snapshot("small", size / 2, fs, &s.snapshot_id);
    small.capacity_range.as_mut().unwrap().limit_bytes = size / 2;
    assert_code(c.create(small).await, Code::OutOfRange);
    assert_code(
        c.create(from_snapshot("nope", size, fs, "snap-0000")).await,
        Code::NotFound,
    );
    let wrong_fs = if fs == "xfs" { "ext4" } else { "xfs" };
    assert_code(
        c.create(from_snapshot("wrongfs", size, wrong_fs, &s.snapshot_id))
            .await,
        Code::InvalidArgument,
    );

    // Snapshots are independent: the source can go, the snapshot stays.
    unmount_volume(&mut c, &v.volume_id, &mv).await;
    c.delete(&v.volume_id).await.unwrap();
    let got = c
        .ctl
        .get_snapshot(csi::GetSnapshotRequest {
            snapshot_id: s.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.snapshot.unwrap(), s);

    unmount_volume(&mut c, &r.volume_id, &mr).await;
    for id in [&r.volume_id, &other.volume_id] {
        c.delete(id).await.unwrap();
    }
    c.ctl
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: s.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_code(
        c.ctl
            .get_snapshot(csi::GetSnapshotRequest {
                snapshot_id: s.snapshot_id.clone(),
                ..Default::default()
            })
            .await,
        Code::NotFound,
    );
    let left: Vec<_> = std::fs::read_dir(node.pool.join("snapshots"))
        .unwrap()
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_restore_on_xfs_reflinks() {
    data_survives(crust_blockdev::FsType::Xfs, "xfs", 320 * MIB, "reflink").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_restore_on_ext4_copies() {
    data_survives(
        crust_blockdev::FsType::Ext4,
        "ext4",
        128 * MIB,
        "sparse-copy",
    )
    .await;
}

/// A writer keeps creating files, each fsynced, then counted; whatever was
/// counted before the snapshot must be in the restored copy.
fn start_writer(dir: String) -> (Arc<AtomicBool>, Arc<AtomicU64>, std::thread::JoinHandle<()>) {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let (s, d) = (stop.clone(), done.clone());
    let h = std::thread::spawn(move || {
        let mut i = 0u64;
        while !s.load(Ordering::SeqCst) {
            let name = format!("w-{i:06}");
            let data = vec![(i % 251) as u8; 16 * 1024];
            let mut f = std::fs::File::create(Path::new(&dir).join(&name)).unwrap();
            f.write_all(&data).unwrap();
            f.sync_all().unwrap();
            // The directory entry too (fsync of the file alone does not
            // make a new name durable on every filesystem).
            std::fs::File::open(&dir).unwrap().sync_all().unwrap();
            d.store(i + 1, Ordering::SeqCst);
            i += 1;
        }
    });
    (stop, done, h)
}

fn check_writes(dir: &Path, at_least: u64) {
    for i in 0..at_least {
        let p = dir.join(format!("w-{i:06}"));
        let data = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert_eq!(data, vec![(i % 251) as u8; 16 * 1024], "{}", p.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_and_clone_of_a_volume_being_written() {
    let n = fs_node(crust_blockdev::FsType::Ext4, 1 << 30, &[]);
    let node = &n.node;
    let mut c = node.clients().await;
    let v = c
        .create(create_req("busy", 128 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let mv = mount_volume(&mut c, node, &v.volume_id, "ext4", "busy").await;
    let (stop, done, h) = start_writer(mv.1.clone());
    std::thread::sleep(Duration::from_millis(300));
    let before_snap = done.load(Ordering::SeqCst);
    let s = snapshot(&mut c, "live", &v.volume_id).await.unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let before_clone = done.load(Ordering::SeqCst);
    let clone = c
        .create(from_volume("clone", 128 * MIB, "ext4", &v.volume_id))
        .await
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::SeqCst);
    h.join().unwrap();
    assert!(
        done.load(Ordering::SeqCst) > before_clone,
        "the writer kept going"
    );

    for (name, req, at_least) in [
        (
            "from-snap",
            from_snapshot("from-snap", 128 * MIB, "ext4", &s.snapshot_id),
            before_snap,
        ),
        (
            "clone",
            from_volume("clone", 128 * MIB, "ext4", &v.volume_id),
            before_clone,
        ),
    ] {
        let r = if name == "clone" {
            clone.clone()
        } else {
            c.create(req).await.unwrap()
        };
        // The copy is clean as it is (frozen: nothing to replay).
        let img = node.pool.join(format!("{}.img", r.volume_id));
        fsck_clean(&img, "ext4");
        let m = mount_volume(&mut c, node, &r.volume_id, "ext4", name).await;
        check_writes(Path::new(&m.1), at_least);
        unmount_volume(&mut c, &r.volume_id, &m).await;
        c.delete(&r.volume_id).await.unwrap();
    }
    unmount_volume(&mut c, &v.volume_id, &mv).await;
    c.delete(&v.volume_id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_snapshot_is_consistent_across_volumes() {
    let n = fs_node(crust_blockdev::FsType::Ext4, 1 << 30, &[]);
    let node = &n.node;
    let mut c = node.clients().await;
    let mut vols = Vec::new();
    let mut writers = Vec::new();
    for i in 0..2 {
        let v = c
            .create(create_req(&format!("g{i}"), 64 * MIB, vec![mount("ext4")]))
            .await
            .unwrap();
        let m = mount_volume(&mut c, node, &v.volume_id, "ext4", &format!("g{i}")).await;
        writers.push(start_writer(m.1.clone()));
        vols.push((v, m));
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut g = csi::group_controller_client::GroupControllerClient::new(
        node.plugin
            .as_ref()
            .unwrap()
            .endpoint
            .connect()
            .await
            .unwrap(),
    );
    let caps = g
        .group_controller_get_capabilities(csi::GroupControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 1);
    let before: Vec<u64> = writers.iter().map(|w| w.1.load(Ordering::SeqCst)).collect();
    let ids: Vec<String> = vols.iter().map(|(v, _)| v.volume_id.clone()).collect();
    let req = csi::CreateVolumeGroupSnapshotRequest {
        name: "group".into(),
        source_volume_ids: ids.clone(),
        ..Default::default()
    };
    let gs = g
        .create_volume_group_snapshot(req.clone())
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    let after: Vec<u64> = writers.iter().map(|w| w.1.load(Ordering::SeqCst)).collect();
    for (stop, _, h) in writers {
        stop.store(true, Ordering::SeqCst);
        h.join().unwrap();
    }
    assert!(gs.ready_to_use);
    assert_eq!(gs.snapshots.len(), 2);
    for s in &gs.snapshots {
        assert_eq!(s.group_snapshot_id, gs.group_snapshot_id);
    }
    // Idempotent; other volumes under the same name: ALREADY_EXISTS.
    let again = g
        .create_volume_group_snapshot(req)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.group_snapshot.unwrap(), gs);
    assert_code(
        g.create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
            name: "group".into(),
            source_volume_ids: vec![ids[0].clone()],
            ..Default::default()
        })
        .await,
        Code::AlreadyExists,
    );
    // A member cannot be deleted alone.
    assert_code(
        c.ctl
            .delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: gs.snapshots[0].snapshot_id.clone(),
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    );
    // Each member restores with at least what was fsynced before the cut
    // and at most what was fsynced once it returned (one point in time).
    for (i, s) in gs.snapshots.iter().enumerate() {
        let which = ids.iter().position(|id| *id == s.source_volume_id).unwrap();
        let r = c
            .create(from_snapshot(
                &format!("gr{i}"),
                64 * MIB,
                "ext4",
                &s.snapshot_id,
            ))
            .await
            .unwrap();
        let m = mount_volume(&mut c, node, &r.volume_id, "ext4", &format!("gr{i}")).await;
        check_writes(Path::new(&m.1), before[which]);
        let files = std::fs::read_dir(&m.1).unwrap().count() as u64;
        assert!(
            files <= after[which] + 2,
            "{files} files > {}",
            after[which]
        );
        unmount_volume(&mut c, &r.volume_id, &m).await;
        c.delete(&r.volume_id).await.unwrap();
    }
    let members: Vec<String> = gs.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();
    assert_code(
        g.get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: gs.group_snapshot_id.clone(),
            snapshot_ids: vec![members[0].clone()],
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
    );
    g.delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: gs.group_snapshot_id.clone(),
        snapshot_ids: members,
        ..Default::default()
    })
    .await
    .unwrap();
    assert_code(
        g.get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: gs.group_snapshot_id.clone(),
            ..Default::default()
        })
        .await,
        Code::NotFound,
    );
    for (v, m) in &vols {
        unmount_volume(&mut c, &v.volume_id, m).await;
        c.delete(&v.volume_id).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_snapshots_pages_and_filters() {
    let n = fs_node(crust_blockdev::FsType::Ext4, 512 << 20, &[]);
    let mut c = n.node.clients().await;
    let a = c
        .create(create_req("a", 4 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let b = c
        .create(create_req("b", 4 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let mut all = BTreeSet::new();
    for i in 0..7 {
        let src = if i % 2 == 0 { &a } else { &b };
        all.insert(
            snapshot(&mut c, &format!("s{i}"), &src.volume_id)
                .await
                .unwrap()
                .snapshot_id,
        );
    }
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let r = c
            .ctl
            .list_snapshots(csi::ListSnapshotsRequest {
                max_entries: 3,
                starting_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(r.entries.len() <= 3);
        seen.extend(
            r.entries
                .into_iter()
                .map(|e| e.snapshot.unwrap().snapshot_id),
        );
        if r.next_token.is_empty() {
            break;
        }
        token = r.next_token;
    }
    assert_eq!(seen.len(), 7);
    assert_eq!(seen.iter().cloned().collect::<BTreeSet<_>>(), all);
    let by_source = c
        .ctl
        .list_snapshots(csi::ListSnapshotsRequest {
            source_volume_id: a.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_source.entries.len(), 4);
    let one = seen[2].clone();
    let by_id = c
        .ctl
        .list_snapshots(csi::ListSnapshotsRequest {
            snapshot_id: one.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_id.entries.len(), 1);
    assert_eq!(by_id.entries[0].snapshot.as_ref().unwrap().snapshot_id, one);
    // An unknown id filters to nothing (not an error).
    let none = c
        .ctl
        .list_snapshots(csi::ListSnapshotsRequest {
            snapshot_id: "snap-unknown".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(none.entries.is_empty());
    assert_code(
        c.ctl
            .list_snapshots(csi::ListSnapshotsRequest {
                starting_token: "bogus".into(),
                ..Default::default()
            })
            .await,
        Code::Aborted,
    );
    // Capacity counts snapshots; running out is RESOURCE_EXHAUSTED.
    let caps = c
        .ctl
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    let values: BTreeSet<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| {
            c.r#type
                .map(|csi::controller_service_capability::Type::Rpc(r)| r.r#type)
        })
        .collect();
    for v in [5, 6, 7, 15] {
        assert!(values.contains(&v), "capability {v} missing: {values:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_killed_during_a_copy_leaves_no_partial_snapshot() {
    let mut n = fs_node(crust_blockdev::FsType::Ext4, 2 << 30, &[]);
    let mut c = n.node.clients().await;
    let v = c
        .create(create_req("big", 1 << 30, vec![mount("ext4")]))
        .await
        .unwrap();
    let mv = mount_volume(&mut c, &n.node, &v.volume_id, "ext4", "big").await;
    // Enough data that the copy takes a while.
    for i in 0..6 {
        write_file(&mv.1, &format!("blob-{i}"), &vec![i as u8 + 1; 64 << 20]);
    }
    let sdir = n.node.pool.join("snapshots");
    let mut outcomes = Vec::new();
    for (round, delay_ms) in [30u64, 120, 400].into_iter().enumerate() {
        let mut cc = c.clone();
        let name = format!("crash-{round}");
        let id = v.volume_id.clone();
        let call = tokio::spawn(async move { snapshot(&mut cc, &name, &id).await });
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        n.node.crash();
        let _ = call.await;
        n.node.start();
        c = n.node.clients().await;
        // The staging filesystem is not left frozen: a write completes.
        let probe = mv.1.clone();
        let w = std::thread::spawn(move || write_file(&probe, "after-crash", b"ok"));
        for _ in 0..100 {
            if w.is_finished() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(w.is_finished(), "the volume stayed frozen after the crash");
        w.join().unwrap();
        // Only complete snapshots are reported, and their files are all
        // that is left in the pool.
        let listed: Vec<csi::Snapshot> = c
            .ctl
            .list_snapshots(csi::ListSnapshotsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries
            .into_iter()
            .map(|e| e.snapshot.unwrap())
            .collect();
        let files: BTreeSet<String> = std::fs::read_dir(&sdir)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        let want: BTreeSet<String> = listed
            .iter()
            .map(|s| format!("{}.img", s.snapshot_id))
            .collect();
        assert_eq!(
            files, want,
            "round {round}: leaked or missing snapshot files"
        );
        for s in &listed {
            assert!(s.ready_to_use);
        }
        outcomes.push(listed.len());
    }
    // Whatever the crashes left, every reported snapshot restores whole.
    let listed = c
        .ctl
        .list_snapshots(csi::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries;
    for (i, e) in listed.iter().enumerate() {
        let s = e.snapshot.as_ref().unwrap();
        let r = c
            .create(from_snapshot(
                &format!("check-{i}"),
                1 << 30,
                "ext4",
                &s.snapshot_id,
            ))
            .await
            .unwrap();
        fsck_clean(&n.node.pool.join(format!("{}.img", r.volume_id)), "ext4");
        c.delete(&r.volume_id).await.unwrap();
        c.ctl
            .delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: s.snapshot_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    unmount_volume(&mut c, &v.volume_id, &mv).await;
    c.delete(&v.volume_id).await.unwrap();
    let _ = outcomes;
    let left: Vec<PathBuf> = std::fs::read_dir(&n.node.pool)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "img"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
