//! Issue 24: crust formats a device only when it can prove the device
//! holds no data crust did not write itself. Replayed against the real
//! `crust-csi` binary (pool and static backends on real loop devices): a
//! copy of a volume used as raw block (clone, snapshot restore), a copy
//! whose history is lost, a static device with data only in its middle.
//! Each checks the refusal's code and words, the bytes (sha256 before and
//! after) and that nothing stayed attached or mounted; and the positive
//! side (a copy of a never-used volume, an all-zero static device) is
//! formatted and passes `e2fsck -fn`.
//!
//! Budget: about 15 s for the file on 2 cores.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::*;
use crust_proto::csi::v1 as csi;
use sha2::{Digest, Sha256};
use tonic::Code;

/// Pool volumes' size (the raw data fills all but the first and last MiB).
const VOL: u64 = 64 * MIB as u64;
/// The static device with data at 50 MiB, as the issue replayed it.
const STATIC: u64 = 128 * MIB as u64;

fn with_source(
    name: &str,
    caps: Vec<csi::VolumeCapability>,
    source: csi::volume_content_source::Type,
) -> csi::CreateVolumeRequest {
    let mut r = create_req(name, VOL as i64, caps);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(source),
    });
    r
}

fn clone_of(id: &str) -> csi::volume_content_source::Type {
    csi::volume_content_source::Type::Volume(csi::volume_content_source::VolumeSource {
        volume_id: id.into(),
    })
}

fn restore_of(id: &str) -> csi::volume_content_source::Type {
    csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
        snapshot_id: id.into(),
    })
}

/// Snapshot `name` of volume `source`; its id.
async fn snapshot(c: &mut Clients, source: &str, name: &str) -> String {
    c.ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: source.into(),
            name: name.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap()
        .snapshot_id
}

/// The pool file of volume `id`.
fn backing(node: &TestNode, id: &str) -> PathBuf {
    std::fs::read_dir(&node.pool)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains(id) && p.extension().is_some_and(|e| e == "img"))
        .unwrap_or_else(|| panic!("no pool file for {id}"))
}

/// sha256 of `len` bytes of `file` from `offset`.
fn sha_range(file: &Path, offset: u64, len: u64) -> String {
    let f = std::fs::File::open(file).unwrap();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = offset;
    while at < offset + len {
        let n = buf.len().min((offset + len - at) as usize);
        f.read_exact_at(&mut buf[..n], at).unwrap();
        h.update(&buf[..n]);
        at += n as u64;
    }
    format!("{:x}", h.finalize())
}

/// Not ext2/3/4 at the usual superblock place.
fn has_ext_superblock(file: &Path) -> bool {
    let mut sb = [0u8; 2];
    std::fs::File::open(file)
        .unwrap()
        .read_exact_at(&mut sb, 1080)
        .unwrap();
    sb == [0x53, 0xEF]
}

fn fsck_clean(dev: &Path) {
    let out = std::process::Command::new("e2fsck")
        .args(["-fn"])
        .arg(dev)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "e2fsck -fn {}: {}{}",
        dev.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes a pattern from 1 MiB to `VOL - 1 MiB` through the raw block
/// publication of a new volume; returns (volume id, sha256 of that range).
async fn raw_written_volume(c: &mut Clients, node: &TestNode) -> (String, String) {
    let id = c
        .create(create_req("raw-src", VOL as i64, vec![block()]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/raw-src");
    let target = format!("{}/dev", node.mkdir("pods/raw-src"));
    c.stage(&id, &staging, block()).await.unwrap();
    c.publish(&id, &staging, &target, block(), false)
        .await
        .unwrap();
    let dev = std::fs::OpenOptions::new()
        .write(true)
        .open(&target)
        .unwrap();
    let chunk: Vec<u8> = (0..MIB).map(|i| (i * 13 + 7) as u8).collect();
    let mut at = MIB as u64;
    while at < VOL - MIB as u64 {
        dev.write_all_at(&chunk, at).unwrap();
        at += MIB as u64;
    }
    dev.sync_all().unwrap();
    drop(dev);
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    let sum = sha_range(&backing(node, &id), MIB as u64, VOL - 2 * MIB as u64);
    (id, sum)
}

/// Stages `id` as ext4 and expects a FAILED_PRECONDITION naming `why`,
/// with nothing left attached or mounted.
async fn stage_refused(c: &mut Clients, node: &TestNode, id: &str, why: &str) {
    let staging = node.mkdir(&format!("staging/{id}"));
    let s = assert_code(
        c.stage(id, &staging, mount("ext4")).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains(why), "{}", s.message());
    assert!(mounts_under(node.dir.path()).is_empty(), "nothing mounted");
    assert!(
        loops_under(node.dir.path()).is_empty(),
        "attach undone after the refusal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_a_raw_block_volume_are_never_formatted() {
    let node = TestNode::with_args(&["--pool-capacity", "4Gi"]);
    let mut c = node.clients().await;
    let (src, sum) = raw_written_volume(&mut c, &node).await;

    let clone = c
        .create(with_source(
            "raw-clone",
            vec![mount("ext4")],
            clone_of(&src),
        ))
        .await
        .unwrap()
        .volume_id;
    let snap = snapshot(&mut c, &src, "raw-snap").await;
    // The source goes before the restore: its history lives on in the
    // snapshot's, not in the source's record.
    c.delete(&src).await.unwrap();
    let restored = c
        .create(with_source(
            "raw-restore",
            vec![mount("ext4")],
            restore_of(&snap),
        ))
        .await
        .unwrap()
        .volume_id;

    for copy in [&clone, &restored] {
        stage_refused(&mut c, &node, copy, "raw block").await;
        let file = backing(&node, copy);
        assert!(!has_ext_superblock(&file), "no ext4 written on {copy}");
        assert_eq!(
            sha_range(&file, MIB as u64, VOL - 2 * MIB as u64),
            sum,
            "{copy}'s raw data intact"
        );
        c.delete(copy).await.unwrap();
    }
    c.ctl
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: snap.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        !node.state.join(format!("snapshots/{snap}.json")).exists(),
        "the snapshot's history goes with it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_is_formatted_only_when_its_history_proves_it_blank() {
    let node = TestNode::with_args(&["--pool-capacity", "4Gi"]);
    let mut c = node.clients().await;
    let fresh = c
        .create(create_req("fresh", VOL as i64, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    // A clone of a never-used volume is blank by proof: formatted.
    let clone = c
        .create(with_source(
            "fresh-clone",
            vec![mount("ext4")],
            clone_of(&fresh),
        ))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/fresh-clone");
    c.stage(&clone, &staging, mount("ext4")).await.unwrap();
    c.unstage(&clone, &staging).await.unwrap();
    assert!(has_ext_superblock(&backing(&node, &clone)));

    // A snapshot whose history is lost (cut by an older plugin, say): its
    // restore may hold signature-less data, so it is never formatted.
    let snap = snapshot(&mut c, &fresh, "fresh-snap").await;
    let history = node.state.join(format!("snapshots/{snap}.json"));
    let kept: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&history).unwrap()).unwrap();
    assert_eq!(kept["source_volume_id"], fresh.as_str());
    std::fs::remove_file(&history).unwrap();
    let restored = c
        .create(with_source(
            "lost-restore",
            vec![mount("ext4")],
            restore_of(&snap),
        ))
        .await
        .unwrap()
        .volume_id;
    stage_refused(&mut c, &node, &restored, "history is unknown").await;
    assert!(!has_ext_superblock(&backing(&node, &restored)));
    // ... and neither is a clone of that copy: unknown stays unknown.
    let second = c
        .create(with_source(
            "lost-clone",
            vec![mount("ext4")],
            clone_of(&restored),
        ))
        .await
        .unwrap()
        .volume_id;
    stage_refused(&mut c, &node, &second, "history is unknown").await;

    for v in [&second, &restored, &clone, &fresh] {
        c.delete(v).await.unwrap();
    }
    c.ctl
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: snap,
            ..Default::default()
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_device_with_data_only_in_its_middle_is_never_formatted() {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    // Data only at 50 MiB: zero edges, no signature.
    let data_disk = crust_testkit::LoopDisk::new(dir.path().join("data.img"), STATIC);
    let payload: Vec<u8> = (0..MIB).map(|i| (i * 31 + 1) as u8).collect();
    std::fs::OpenOptions::new()
        .write(true)
        .open(data_disk.dev())
        .unwrap()
        .write_all_at(&payload, 50 * MIB as u64)
        .unwrap();
    let before = sha_range(data_disk.file(), 0, STATIC);
    let blank_disk =
        crust_testkit::LoopDisk::new(dir.path().join("blank.img"), STATIC + 16 * MIB as u64);

    let node = TestNode::with_args(&[
        "--backend",
        "static",
        "--static-device",
        data_disk.dev_str(),
        "--static-device",
        blank_disk.dev_str(),
    ]);
    let mut c = node.clients().await;
    // The smallest fitting device first: the one with data.
    let on_data = c
        .create(create_req("on-data", STATIC as i64, vec![mount("ext4")]))
        .await
        .unwrap();
    let on_data_id = on_data.volume_id;
    let staging = node.mkdir("staging/on-data");
    let s = c
        .stage_after_blank_check(&on_data_id, &staging, mount("ext4"))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
    assert!(s.message().contains(data_disk.dev_str()), "{}", s.message());
    assert!(
        s.message().contains("--static-device-blank"),
        "{}",
        s.message()
    );
    assert!(!crust_blockdev::is_mountpoint(Path::new(&staging)).unwrap());
    assert_eq!(
        sha_range(data_disk.file(), 0, STATIC),
        before,
        "bytes intact"
    );

    // An all-zero device: proven by the read, formatted, clean.
    let on_blank = c
        .create(create_req(
            "on-blank",
            (STATIC + 16 * MIB as u64) as i64,
            vec![mount("ext4")],
        ))
        .await
        .unwrap()
        .volume_id;
    let staging2 = node.mkdir("staging/on-blank");
    c.stage_after_blank_check(&on_blank, &staging2, mount("ext4"))
        .await
        .unwrap();
    c.unstage(&on_blank, &staging2).await.unwrap();
    fsck_clean(blank_disk.dev());

    // DeleteVolume wipes the first and last MiB only: the middle stays.
    let middle = sha_range(data_disk.file(), MIB as u64, STATIC - 2 * MIB as u64);
    c.delete(&on_blank).await.unwrap();
    c.delete(&on_data_id).await.unwrap();
    assert_eq!(
        sha_range(data_disk.file(), MIB as u64, STATIC - 2 * MIB as u64),
        middle
    );
}

/// The volume's data reachable through another device (issue 24): the
/// pool file attached again by a host tool and mounted, or a hard link of
/// it attached, makes NodeStageVolume refuse before it formats, mounts or
/// hands anything out, naming the alias; a loop stacked on a raw block
/// volume's staged device makes NodePublishVolume refuse. Once the alias
/// is gone, the same calls succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_never_mounts_or_publishes_data_another_device_exposes() {
    use crust_testkit::AliasCase;
    let node = TestNode::with_args(&["--pool-capacity", "4Gi"]);
    let mut c = node.clients().await;
    let id = c
        .create(create_req(
            "aliased",
            64 * MIB,
            vec![mount("ext4"), block()],
        ))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/aliased");
    // Formatted once, so the second-attach case can mount its alias.
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    let file = backing(&node, &id);
    for case in [AliasCase::SecondAttachMounted, AliasCase::HardLink] {
        let alias = case.make(&file, Path::new("/nonexistent"));
        let s = assert_code(
            c.stage(&id, &staging, mount("ext4")).await,
            Code::FailedPrecondition,
        );
        assert!(
            s.message().contains(alias.dev_str()),
            "{case:?}: {}",
            s.message()
        );
        assert!(!crust_blockdev::is_mountpoint(Path::new(&staging)).unwrap());
        let ours: Vec<_> = loops_under(node.dir.path())
            .into_iter()
            .filter(|l| l.path != alias.dev())
            .collect();
        assert!(ours.is_empty(), "{case:?}: attach undone: {ours:?}");
    }
    // Raw block: staged, then a loop stacked on its device; publish refuses.
    c.stage(&id, &staging, block()).await.unwrap();
    let device = loops_under(node.dir.path())[0].path.clone();
    let target = format!("{}/dev", node.mkdir("pods/aliased"));
    {
        let alias = AliasCase::Stacked.make(&file, &device);
        let s = assert_code(
            c.publish(&id, &staging, &target, block(), false).await,
            Code::FailedPrecondition,
        );
        assert!(s.message().contains(alias.dev_str()), "{}", s.message());
        assert!(!Path::new(&target).exists(), "no target left");
    }
    c.publish(&id, &staging, &target, block(), false)
        .await
        .unwrap();
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    crust_testkit::assert_fsck_clean(&file);
    c.delete(&id).await.unwrap();
}
