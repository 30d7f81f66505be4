//! Issue 10, a node reboot simulated against the real `crust-csi`: the
//! plugin dies (SIGKILL), every mount and loop device goes, the hand-off
//! root (`/var/run/crust` in production, a tmpfs) is cleared, other loop
//! devices take the old numbers; then kubelet replays NodeStageVolume and
//! NodePublishVolume. Every volume comes back with its data (a host
//! filesystem publication, a raw block publication, a deferred one), the
//! stale device paths in the records are repaired, and nothing is
//! formatted (the filesystems' UUIDs are unchanged). Budget ~5 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::*;
use crust_proto::csi::v1 as csi;
use tonic::Code;

fn record(node: &TestNode, id: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(node.state.join(format!("volumes/{id}.json"))).unwrap())
        .unwrap()
}

/// The ext4 UUID from the superblock of the volume's backing file.
fn ext4_uuid(node: &TestNode, id: &str) -> [u8; 16] {
    let f = std::fs::File::open(backing(node, id)).unwrap();
    let mut u = [0u8; 16];
    f.read_exact_at(&mut u, 1024 + 0x68).unwrap();
    u
}

fn backing(node: &TestNode, id: &str) -> std::path::PathBuf {
    std::fs::read_dir(&node.pool)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains(id))
        .unwrap()
}

async fn publish(
    c: &mut Clients,
    id: &str,
    staging: &str,
    target: &str,
    cap: csi::VolumeCapability,
    defer: bool,
) {
    c.node
        .node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            target_path: target.into(),
            volume_capability: Some(cap),
            defer_fs_ops: defer,
            ..Default::default()
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_replay_after_a_reboot_brings_every_volume_back_unformatted() {
    let mut node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let mk = |name: &str, cap| create_req(name, 32 * MIB, vec![cap]);
    let fs_id = c.create(mk("fs", mount("ext4"))).await.unwrap().volume_id;
    let raw_id = c.create(mk("raw", block())).await.unwrap().volume_id;
    let def_id = c.create(mk("def", mount("ext4"))).await.unwrap().volume_id;
    let (s_fs, s_raw, s_def) = (
        node.mkdir("staging/fs"),
        node.mkdir("staging/raw"),
        node.mkdir("staging/def"),
    );
    let pods = node.mkdir("pods/uid/volumes");
    let (t_fs, t_raw, t_def, t_tmp) = (
        format!("{pods}/fs"),
        format!("{pods}/raw"),
        format!("{pods}/def"),
        format!("{pods}/tmp"),
    );

    // Before the reboot: data on each volume.
    c.stage(&fs_id, &s_fs, mount("ext4")).await.unwrap();
    publish(&mut c, &fs_id, &s_fs, &t_fs, mount("ext4"), false).await;
    std::fs::write(format!("{t_fs}/a"), b"host data").unwrap();
    c.stage(&raw_id, &s_raw, block()).await.unwrap();
    publish(&mut c, &raw_id, &s_raw, &t_raw, block(), false).await;
    let payload: Vec<u8> = (0..256 * 1024).map(|i| (i % 251) as u8).collect();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&t_raw)
        .unwrap();
    f.write_all_at(&payload, 16 * MIB as u64).unwrap();
    f.sync_all().unwrap();
    drop(f);
    // The deferred volume: written through a host publication first, then
    // handed to a "sandbox" (request deferral unmounts the staging path).
    c.stage(&def_id, &s_def, mount("ext4")).await.unwrap();
    publish(&mut c, &def_id, &s_def, &t_tmp, mount("ext4"), false).await;
    std::fs::write(format!("{t_tmp}/c"), b"guest data").unwrap();
    c.unpublish(&def_id, &t_tmp).await.unwrap();
    publish(&mut c, &def_id, &s_def, &t_def, mount("ext4"), true).await;
    let rec_dir = node.crust_root().join(crust_handoff::crust_key(&t_def));
    assert!(rec_dir.join("mountInfo.json").is_file());
    let uuids = (ext4_uuid(&node, &fs_id), ext4_uuid(&node, &def_id));
    let devices_before: HashMap<String, String> = [&fs_id, &raw_id, &def_id]
        .iter()
        .map(|id| {
            (
                id.to_string(),
                record(&node, id)["staging"]["device"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
        })
        .collect();

    // --- the reboot ----------------------------------------------------------
    node.crash();
    node.cleanup.run(); // every mount and loop device of the node goes
    std::fs::remove_dir_all(node.crust_root()).unwrap();
    assert!(loops_under(node.dir.path()).is_empty() && mounts_under(node.dir.path()).is_empty());
    // Other devices come up first and take the old loop numbers.
    let others = tempfile::tempdir().unwrap();
    let _squatters: Vec<_> = (0..3)
        .map(|i| {
            crust_testkit::LoopDisk::new(others.path().join(format!("{i}.img")), 4 * MIB as u64)
        })
        .collect();
    node.start();
    let mut c = node.clients().await;
    // Before the replay the plugin refuses to bind a stale device.
    let e = c
        .publish(&fs_id, &s_fs, &t_fs, mount("ext4"), false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");

    // --- kubelet's replay ------------------------------------------------------
    c.stage(&fs_id, &s_fs, mount("ext4")).await.unwrap();
    publish(&mut c, &fs_id, &s_fs, &t_fs, mount("ext4"), false).await;
    c.stage(&raw_id, &s_raw, block()).await.unwrap();
    publish(&mut c, &raw_id, &s_raw, &t_raw, block(), false).await;
    c.stage(&def_id, &s_def, mount("ext4")).await.unwrap();
    publish(&mut c, &def_id, &s_def, &t_def, mount("ext4"), true).await;

    // Every volume is back with its data; nothing was formatted.
    assert_eq!(std::fs::read(format!("{t_fs}/a")).unwrap(), b"host data");
    let mut got = vec![0u8; payload.len()];
    std::fs::File::open(&t_raw)
        .unwrap()
        .read_exact_at(&mut got, 16 * MIB as u64)
        .unwrap();
    assert_eq!(got, payload);
    assert_eq!(
        (ext4_uuid(&node, &fs_id), ext4_uuid(&node, &def_id)),
        uuids,
        "not formatted"
    );
    // Stale records repaired: the records name today's devices.
    for id in [&fs_id, &raw_id, &def_id] {
        let now = record(&node, id)["staging"]["device"]
            .as_str()
            .unwrap()
            .to_string();
        let attached = loops_under(node.dir.path())
            .into_iter()
            .find(|l| l.backing_file.to_string_lossy().contains(id.as_str()))
            .unwrap();
        assert_eq!(Path::new(&now), attached.path, "{id}");
        assert_ne!(now, devices_before[id], "{id}: the device number changed");
    }
    let mi: serde_json::Value =
        serde_json::from_slice(&std::fs::read(rec_dir.join("mountInfo.json")).unwrap()).unwrap();
    let def_dev = record(&node, &def_id)["staging"]["device"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        mi["device"],
        def_dev.as_str(),
        "hand-off record rewritten with today's device"
    );
    // The deferred volume is not mounted on the host; a "guest" finds the data.
    assert!(!crust_blockdev::is_mountpoint(Path::new(&s_def)).unwrap());
    {
        let guest = GuestMount::new(Path::new(&def_dev), &node.path("guest"), "ext4");
        assert_eq!(std::fs::read(guest.dir.join("c")).unwrap(), b"guest data");
    }
    for e in c.list_all().await {
        let cond = e.status.unwrap().volume_condition.unwrap();
        assert!(!cond.abnormal, "{cond:?}");
    }

    // Teardown.
    for (id, s, t) in [
        (&fs_id, &s_fs, &t_fs),
        (&raw_id, &s_raw, &t_raw),
        (&def_id, &s_def, &t_def),
    ] {
        c.unpublish(id, t).await.unwrap();
        c.unstage(id, s).await.unwrap();
        c.delete(id).await.unwrap();
    }
    assert!(loops_under(node.dir.path()).is_empty());
    assert!(mounts_under(node.dir.path()).is_empty());
}

/// Found by the fault campaign (seed 1795473414149315591): a first stage
/// killed after its mkfs and its mount but before it recorded them left
/// "format started, not finished" in the record and the device mounted at
/// the staging path; every retry then took the mount for an orphaned mkfs
/// and answered FAILED_PRECONDITION forever. The retry adopts the mount
/// (it proves the format finished), keeps the data and formats nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_killed_between_its_mount_and_its_record_is_adopted() {
    let mut node = TestNode::new();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("adopt", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/adopt");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    std::fs::write(format!("{staging}/a"), b"kept").unwrap();
    let uuid = ext4_uuid(&node, &id);

    // The record as the killed stage left it: format started, neither its
    // end nor the staging recorded.
    node.crash();
    let path = node.state.join(format!("volumes/{id}.json"));
    let mut rec = record(&node, &id);
    assert_eq!(rec["format_started"], "ext4", "{rec}");
    rec["formatted"] = serde_json::Value::Null;
    rec["staging"] = serde_json::Value::Null;
    std::fs::write(&path, serde_json::to_vec(&rec).unwrap()).unwrap();
    node.start();

    let mut c = node.clients().await;
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert_eq!(
        std::fs::read(format!("{staging}/a")).unwrap(),
        b"kept",
        "the data written before the crash"
    );
    assert_eq!(ext4_uuid(&node, &id), uuid, "not formatted again");
    let rec = record(&node, &id);
    assert_eq!(rec["formatted"], "ext4", "{rec}");
    assert!(rec["staging"].is_object(), "{rec}");
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(mounts_under(node.dir.path()).is_empty());
    assert!(loops_under(&node.pool).is_empty());
}

fn pool_index(node: &TestNode) -> Vec<String> {
    match std::fs::read(node.pool.join("index.json")) {
        Ok(b) => {
            let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
            v["volumes"].as_object().unwrap().keys().cloned().collect()
        }
        Err(_) => Vec::new(),
    }
}

fn listed(entries: &[csi::list_volumes_response::Entry]) -> Vec<String> {
    let mut ids: Vec<String> = entries
        .iter()
        .map(|e| e.volume.as_ref().unwrap().volume_id.clone())
        .collect();
    ids.sort();
    ids
}

/// Issue 16: a plain CreateVolume writes one record (the pool's index is
/// written lazily, before the first attach), a DeleteVolume removes the
/// image then the record. The plugin is killed between those steps and the
/// states a power loss can leave are laid out on disk; the next start
/// settles every one: no leaked image, no record pointing at nothing, and
/// a store that holds data is never removed. Budget ~3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_and_deletes_interrupted_between_their_steps_are_settled_at_start() {
    let mut node = TestNode::new();
    let mut c = node.clients().await;
    async fn create(c: &mut Clients, name: &str) -> String {
        c.create(create_req(name, 32 * MIB, vec![mount("ext4")]))
            .await
            .unwrap()
            .volume_id
    }
    // Staged (so the index is written) and holding data.
    let used = create(&mut c, "used").await;
    let staging = node.mkdir("staging/used");
    c.stage(&used, &staging, mount("ext4")).await.unwrap();
    std::fs::write(format!("{staging}/a"), b"kept").unwrap();
    c.unstage(&used, &staging).await.unwrap();
    // Created after the last index write: in no index on disk.
    let lost_image = create(&mut c, "lost-image").await;
    let lost_record = create(&mut c, "lost-record").await;
    let deleted = create(&mut c, "deleted").await;
    // Data with no record (a record that could not be kept).
    let orphan_data = create(&mut c, "orphan-data").await;
    c.stage(&orphan_data, &node.mkdir("staging/od"), mount("ext4"))
        .await
        .unwrap();
    c.unstage(&orphan_data, &node.path("staging/od").to_string_lossy())
        .await
        .unwrap();
    // Indexed (the stage above wrote the index), then deleted.
    c.delete(&deleted).await.unwrap();
    let pool = node.pool.clone();
    let img = |id: &str| pool.join(format!("{id}.img"));
    assert!(!img(&deleted).exists());
    let on_disk = pool_index(&node);
    assert!(on_disk.contains(&deleted), "a delete writes no index");
    assert!(on_disk.contains(&lost_image) && on_disk.contains(&lost_record));
    let late = create(&mut c, "late").await;
    let late_lost = create(&mut c, "late-lost").await;
    assert!(
        !pool_index(&node).contains(&late),
        "a create writes no index"
    );

    node.crash();
    // Power loss: the image of a create never reached the disk, nor the
    // record of another create (the store's creation did), nor the
    // record of a volume whose store holds data.
    std::fs::remove_file(img(&lost_image)).unwrap();
    std::fs::remove_file(img(&late_lost)).unwrap();
    let state = node.state.clone();
    let rec_path = |id: &str| state.join(format!("volumes/{id}.json"));
    std::fs::remove_file(rec_path(&lost_record)).unwrap();
    std::fs::remove_file(rec_path(&orphan_data)).unwrap();
    node.start();
    let mut c = node.clients().await;

    // The record of a never-used volume whose image is gone: made again.
    for id in [&lost_image, &late_lost] {
        assert_eq!(std::fs::metadata(img(id)).unwrap().len(), 32 << 20);
    }
    // No record: the unused store is gone, the index of the deleted one
    // is cleared, the store holding data is kept.
    assert!(!img(&lost_record).exists());
    assert!(
        img(&orphan_data).exists(),
        "a store with data is never removed"
    );
    // A create after the last index write kept its image and record.
    assert!(img(&late).exists());
    let mut want = vec![
        used.clone(),
        lost_image.clone(),
        late.clone(),
        late_lost.clone(),
    ];
    want.sort();
    assert_eq!(listed(&c.list_all().await), want);

    // Each settled volume works; the used one still has its data.
    let s2 = node.mkdir("staging/lost-image");
    c.stage(&lost_image, &s2, mount("ext4")).await.unwrap();
    c.unstage(&lost_image, &s2).await.unwrap();
    c.stage(&used, &staging, mount("ext4")).await.unwrap();
    assert_eq!(std::fs::read(format!("{staging}/a")).unwrap(), b"kept");
    c.unstage(&used, &staging).await.unwrap();
    // The stage above wrote the settled index.
    let mut idx = pool_index(&node);
    idx.sort();
    let mut want_idx = vec![
        used.clone(),
        lost_image.clone(),
        late.clone(),
        late_lost.clone(),
        orphan_data.clone(),
    ];
    want_idx.sort();
    assert_eq!(idx, want_idx);
    for id in [&used, &lost_image, &late, &late_lost] {
        c.delete(id).await.unwrap();
    }
    node.stop();
    // The orphan with data stays for a person; remove it for the cleanup.
    let _ = std::fs::remove_file(img(&orphan_data));
    assert!(mounts_under(node.dir.path()).is_empty());
    assert!(loops_under(&node.pool).is_empty());
}
