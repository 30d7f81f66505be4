//! Real-device behaviour of the plugin binary: data survival on ext4 and
//! xfs, online expansion, raw block sizes, and health signals from real
//! failures (backing file removed, filesystem remounted read-only,
//! mount removed behind the plugin's back).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::path::Path;

use common::*;
use crust_proto::csi::v1 as csi;
use tonic::Code;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

async fn data_survives(fs: &str, size: i64) {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let v = c
        .create(create_req(&format!("data-{fs}"), size, vec![mount(fs)]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/v");
    let pods = node.mkdir("pods");
    let t1 = format!("{pods}/pod1");
    c.stage(&id, &staging, mount(fs)).await.unwrap();
    let m = crust_blockdev::find_mount(Path::new(&staging))
        .unwrap()
        .unwrap();
    assert_eq!(m.fs_type, fs);
    c.publish(&id, &staging, &t1, mount(fs), false)
        .await
        .unwrap();
    let data = pattern(3 << 20, 7);
    std::fs::create_dir(format!("{t1}/dir")).unwrap();
    std::fs::write(format!("{t1}/dir/blob"), &data).unwrap();
    std::fs::File::open(format!("{t1}/dir/blob"))
        .unwrap()
        .sync_all()
        .unwrap();

    c.unpublish(&id, &t1).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(
        loops_under(node.dir.path()).is_empty(),
        "detached after unstage"
    );
    assert!(mounts_under(node.dir.path()).is_empty());

    // restage + republish elsewhere: same bytes, no reformat
    c.stage(&id, &staging, mount(fs)).await.unwrap();
    let t2 = format!("{pods}/pod2");
    c.publish(&id, &staging, &t2, mount(fs), false)
        .await
        .unwrap();
    assert_eq!(std::fs::read(format!("{t2}/dir/blob")).unwrap(), data);
    c.unpublish(&id, &t2).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext4_data_survives_unpublish_unstage_restage_republish() {
    data_survives("ext4", 64 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfs_data_survives_unpublish_unstage_restage_republish() {
    data_survives("xfs", 320 * MIB).await;
}

async fn online_expansion(fs: &str, size: i64, grown: i64) {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let v = c
        .create(create_req(&format!("grow-{fs}"), size, vec![mount(fs)]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/v");
    let t = format!("{}/pod", node.mkdir("pods"));
    c.stage(&id, &staging, mount(fs)).await.unwrap();
    c.publish(&id, &staging, &t, mount(fs), false)
        .await
        .unwrap();
    std::fs::write(format!("{t}/keep"), b"still here").unwrap();
    let before = fs_total(Path::new(&t));
    assert!(before <= size as u64);

    let r = c
        .ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: grown,
                limit_bytes: 0,
            }),
            volume_capability: Some(mount(fs)),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, grown);
    assert!(r.node_expansion_required);
    // a repeated stage of the mounted, grown volume stays a no-op
    c.stage(&id, &staging, mount(fs)).await.unwrap();
    assert_eq!(fs_total(Path::new(&t)), before);

    let expand =
        |path: &str, cap: Option<csi::VolumeCapability>, req: i64| csi::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: path.into(),
            staging_target_path: staging.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: req,
                limit_bytes: 0,
            }),
            volume_capability: cap,
            ..Default::default()
        };
    assert_code(
        c.node.node_expand_volume(expand("", None, grown)).await,
        Code::InvalidArgument,
    );
    assert_code(
        c.node
            .node_expand_volume(expand(&format!("{t}-nope"), None, grown))
            .await,
        Code::NotFound,
    );
    assert_code(
        c.node.node_expand_volume(expand(&t, None, grown * 2)).await,
        Code::OutOfRange,
    );
    let mut deferred = expand(&t, None, grown);
    deferred.defer_fs_ops = true;
    assert_code(
        c.node.node_expand_volume(deferred).await,
        Code::FailedPrecondition,
    );
    let online = fs == "xfs" || crust_blockdev::can_grow_ext4_online();
    if !online {
        // Online ext4 resize needs CAP_SYS_RESOURCE, which this machine
        // withholds even from root: a clear refusal, nothing changed...
        let s = assert_code(
            c.node.node_expand_volume(expand(&t, None, grown)).await,
            Code::FailedPrecondition,
        );
        assert!(s.message().contains("CAP_SYS_RESOURCE"), "{}", s.message());
        assert_eq!(fs_total(Path::new(&t)), before);
        // ...and the growth completes when the volume is staged again.
        c.unpublish(&id, &t).await.unwrap();
        c.unstage(&id, &staging).await.unwrap();
        c.stage(&id, &staging, mount(fs)).await.unwrap();
        c.publish(&id, &staging, &t, mount(fs), false)
            .await
            .unwrap();
    }
    // no capability: block vs filesystem detected from the path; repeated
    for cap in [None, Some(mount(fs))] {
        let r = c
            .node
            .node_expand_volume(expand(&t, cap, grown))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.capacity_bytes, grown);
    }
    let after = fs_total(Path::new(&t));
    assert!(
        after > before,
        "statvfs shows the growth: {before} -> {after}"
    );
    assert!(
        after as i64 > grown * 85 / 100 && after as i64 <= grown,
        "{after} vs {grown}"
    );
    let st = c.stats(&id, &t).await.unwrap();
    let bytes = st
        .usage
        .iter()
        .find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32)
        .unwrap();
    assert_eq!(bytes.total as u64, after);
    assert_eq!(std::fs::read(format!("{t}/keep")).unwrap(), b"still here");

    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext4_expansion_while_published() {
    online_expansion("ext4", 64 * MIB, 160 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfs_online_expansion_while_published() {
    online_expansion("xfs", 320 * MIB, 640 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_block_device_has_exactly_the_requested_size_and_grows_online() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let size = 40 * MIB + 512 * 3;
    let mut req = create_req("raw", size, vec![block()]);
    req.capacity_range.as_mut().unwrap().limit_bytes = size;
    let v = c.create(req).await.unwrap();
    assert_eq!(v.capacity_bytes, size);
    let id = v.volume_id;
    let staging = node.mkdir("staging/raw");
    let t = format!("{}/dev", node.mkdir("pods"));
    c.stage(&id, &staging, block()).await.unwrap();
    c.publish(&id, &staging, &t, block(), false).await.unwrap();
    assert_eq!(
        dev_size(Path::new(&t)) as i64,
        size,
        "BLKGETSIZE64 on the published target"
    );

    let grown = 64 * MIB;
    let r = c
        .ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: grown,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, grown);
    assert!(!r.node_expansion_required);
    assert_eq!(
        dev_size(Path::new(&t)) as i64,
        grown,
        "published device grew online"
    );
    let r = c
        .node
        .node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: t.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, grown);
    let st = c.stats(&id, &t).await.unwrap();
    assert_eq!(st.usage[0].total, grown);
    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}

/// Condition as seen by NodeGetVolumeStats, ListVolumes and
/// ControllerGetVolume.
async fn conditions(c: &mut Clients, id: &str, path: &str) -> [csi::VolumeCondition; 3] {
    let a = c.stats(id, path).await.unwrap().volume_condition.unwrap();
    let b = c
        .list_all()
        .await
        .into_iter()
        .find(|e| e.volume.as_ref().unwrap().volume_id == id)
        .unwrap()
        .status
        .unwrap()
        .volume_condition
        .unwrap();
    let g = c
        .get(id)
        .await
        .unwrap()
        .status
        .unwrap()
        .volume_condition
        .unwrap();
    [a, b, g]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_a_removed_backing_file() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let v = c
        .create(create_req("doomed", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/v");
    let t = format!("{}/pod", node.mkdir("pods"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &t, mount("ext4"), false)
        .await
        .unwrap();
    for cond in conditions(&mut c, &id, &t).await {
        assert!(!cond.abnormal, "{}", cond.message);
    }
    let img = node.pool.join(format!("{id}.img"));
    std::fs::remove_file(&img).unwrap();
    for cond in conditions(&mut c, &id, &t).await {
        assert!(cond.abnormal);
        assert!(cond.message.contains("removed"), "{}", cond.message);
    }
    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(c.list_all().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_a_read_only_remount_and_a_lost_mount() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let v = c
        .create(create_req("flaky", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/v");
    let t = format!("{}/pod", node.mkdir("pods"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &t, mount("ext4"), false)
        .await
        .unwrap();
    // what `mount -o remount,ro <staging>` does: the superblock goes
    // read-only, as after an ext4 error with errors=remount-ro
    rustix::mount::mount_remount(staging.as_str(), rustix::mount::MountFlags::RDONLY, c"").unwrap();
    for cond in conditions(&mut c, &id, &t).await {
        assert!(cond.abnormal);
        assert!(cond.message.contains("read-only"), "{}", cond.message);
    }
    rustix::mount::mount_remount(staging.as_str(), rustix::mount::MountFlags::empty(), c"")
        .unwrap();
    for cond in conditions(&mut c, &id, &t).await {
        assert!(!cond.abnormal, "{}", cond.message);
    }
    // someone unmounts the pod's target behind the plugin's back
    crust_blockdev::unmount(Path::new(&t)).unwrap();
    let cond = c.stats(&id, &t).await.unwrap().volume_condition.unwrap();
    assert!(cond.abnormal);
    assert!(
        cond.message.contains("no longer mounted"),
        "{}",
        cond.message
    );
    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stage_never_formats_a_device_holding_another_filesystem() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    // created for both access types: raw access lets us put xfs on it
    let v = c
        .create(create_req("mixed", 320 * MIB, vec![mount("ext4"), block()]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/v");
    let t = format!("{}/dev", node.mkdir("pods"));
    c.stage(&id, &staging, block()).await.unwrap();
    c.publish(&id, &staging, &t, block(), false).await.unwrap();
    let out = std::process::Command::new("mkfs.xfs")
        .args(["-q", "-f", &t])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();

    let s = assert_code(
        c.stage(&id, &staging, mount("ext4")).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("xfs"), "{}", s.message());
    assert!(mounts_under(node.dir.path()).is_empty());
    assert!(
        loops_under(node.dir.path()).is_empty(),
        "failed stage detached again"
    );
    // the xfs signature is intact
    let probe = crust_blockdev::probe_fs(&node.pool.join(format!("{id}.img"))).unwrap();
    assert_eq!(
        probe,
        crust_blockdev::Probe::Fs(crust_blockdev::FsType::Xfs)
    );
    c.delete(&id).await.unwrap();
}
