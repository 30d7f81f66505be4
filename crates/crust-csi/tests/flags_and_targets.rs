//! Issue 24, node part, against the real `crust-csi` binary (pool backend
//! on real loop devices, real mkfs and mounts):
//! * one check of a capability's mount flags on every RPC and route
//!   (a host NodePublishVolume took `commit=99999999999999999999` and
//!   recorded the publication);
//! * NodeUnpublishVolume removes a target only when the record says the
//!   plugin created it (it deleted a user's empty file under a leftover
//!   bind), also after a publish killed between any two of its steps.
//!
//! Budget: about 10 s for the file on 2 cores.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use common::*;
use crust_proto::csi::v1 as csi;
use crust_proto::endpoint::Endpoint;
use crust_proto::handover::v1alpha1 as hv;
use csi::volume_capability::access_mode::Mode;
use csi::volume_capability::{AccessType, MountVolume};
use sha2::{Digest, Sha256};
use tonic::Code;

const BAD: &str = "commit=99999999999999999999";

fn ext4_with(flags: &[&str]) -> csi::VolumeCapability {
    mode_cap(
        AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            ..Default::default()
        }),
        Mode::SingleNodeWriter,
    )
}

fn record(node: &TestNode, id: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(node.state.join(format!("volumes/{id}.json"))).unwrap())
        .unwrap()
}

/// A refusal of the bad flag: INVALID_ARGUMENT naming the option (by the
/// allow-list's name for it, never by the caller's text).
#[track_caller]
fn refused<T: std::fmt::Debug>(route: &str, r: Result<T, tonic::Status>) {
    let s = match r {
        Ok(v) => panic!("{route}: expected INVALID_ARGUMENT, got Ok({v:?})"),
        Err(s) => s,
    };
    assert_eq!(s.code(), Code::InvalidArgument, "{route}: {}", s.message());
    assert!(
        s.message().contains("commit") && !s.message().contains("9999"),
        "{route}: {}",
        s.message()
    );
}

/// Every file under `dir` (paths, sorted): hand-off records.
fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().unwrap().is_dir() {
                todo.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

/// The replayed bug: a host-route NodePublishVolume with an out-of-range
/// `commit=` is INVALID_ARGUMENT; no publication is recorded, the target
/// is neither created nor mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_publish_refuses_an_out_of_range_flag_and_records_nothing() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("hostflag", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/hostflag");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    let target = format!("{}/vol", node.mkdir("pods/p1"));
    let before = record(&node, &id);
    let mounts = mounts_under(node.dir.path());

    refused(
        "host publish",
        c.publish(&id, &staging, &target, ext4_with(&[BAD]), false)
            .await,
    );
    assert_eq!(record(&node, &id), before, "nothing recorded");
    assert!(
        record(&node, &id)["published"]
            .as_object()
            .unwrap()
            .is_empty()
    );
    assert!(!is_mounted(&target), "target mounted");
    assert!(!Path::new(&target).exists(), "target created");
    assert_eq!(mounts_under(node.dir.path()), mounts);

    // The kernel's own bound passes (and the volume publishes as usual).
    c.publish(
        &id,
        &staging,
        &target,
        ext4_with(&["commit=2147483"]),
        false,
    )
    .await
    .unwrap();
    assert!(host_mounted(&target));
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}

/// The same bad flag through every RPC and route that takes a capability:
/// each refuses it (INVALID_ARGUMENT; ValidateVolumeCapabilities does not
/// confirm, GetCapacity has no capacity for it) and changes nothing — no
/// volume, record, mount or hand-off record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_flag_is_refused_on_every_route() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let bad = ext4_with(&[BAD]);

    refused(
        "CreateVolume",
        c.create(create_req("never", 32 * MIB, vec![bad.clone()]))
            .await,
    );
    assert!(c.list_all().await.is_empty(), "a volume was created");
    let cap = c
        .ctl
        .get_capacity(csi::GetCapacityRequest {
            volume_capabilities: vec![bad.clone()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cap.available_capacity, 0, "GetCapacity: {cap:?}");

    let id = c
        .create(create_req("routes", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let v = c
        .ctl
        .validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
            volume_id: id.clone(),
            volume_capabilities: vec![bad.clone()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        v.confirmed.is_none(),
        "ValidateVolumeCapabilities confirmed"
    );
    assert!(v.message.contains("commit"), "{}", v.message);
    refused(
        "ControllerExpandVolume",
        c.ctl
            .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: id.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: 64 * MIB,
                    limit_bytes: 0,
                }),
                volume_capability: Some(bad.clone()),
                ..Default::default()
            })
            .await,
    );

    let staging = node.mkdir("staging/routes");
    refused("NodeStageVolume", c.stage(&id, &staging, bad.clone()).await);
    assert!(record(&node, &id)["staging"].is_null());
    assert!(loops_under(node.dir.path()).is_empty(), "attached");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();

    let pods = node.mkdir("pods/p1");
    let (host, deferred, handed) = (
        format!("{pods}/host"),
        format!("{pods}/deferred"),
        format!("{pods}/handed"),
    );
    let handoff = files_under(&node.crust_root());
    let publish = |target: &str, defer: bool| csi::NodePublishVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.clone(),
        target_path: target.into(),
        volume_capability: Some(bad.clone()),
        defer_fs_ops: defer,
        ..Default::default()
    };
    let before = record(&node, &id);
    let mounts = mounts_under(node.dir.path());
    // Deferred route first: with a host publication it would refuse for
    // another reason.
    refused(
        "NodePublishVolume deferred",
        c.node.node_publish_volume(publish(&deferred, true)).await,
    );
    refused(
        "NodePublishVolume host",
        c.node.node_publish_volume(publish(&host, false)).await,
    );
    refused(
        "NodeExpandVolume",
        c.node
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: id.clone(),
                volume_path: staging.clone(),
                staging_target_path: staging.clone(),
                volume_capability: Some(bad.clone()),
                ..Default::default()
            })
            .await,
    );
    assert_eq!(record(&node, &id), before, "records changed");
    assert_eq!(mounts_under(node.dir.path()), mounts, "mounts changed");
    assert_eq!(files_under(&node.crust_root()), handoff, "hand-off written");
    for t in [&host, &deferred] {
        assert!(!Path::new(t).exists(), "{t} created");
    }

    // A target a VM runtime took by handover: kubelet repeating the
    // publication with the bad flag is refused like any other route.
    c.publish(&id, &staging, &handed, mount("ext4"), false)
        .await
        .unwrap();
    let mut h = hv::handover_client::HandoverClient::new(
        Endpoint::Unix(node.handover_socket())
            .connect()
            .await
            .unwrap(),
    );
    let r = h
        .hand_over(hv::HandOverRequest {
            target_path: handed.clone(),
            sandbox_id: "sb-1".into(),
            runtime_cli: runtime_cli().to_str().unwrap().into(),
            capabilities: [
                hv::runtime_capability::Type::VolumeStats,
                hv::runtime_capability::Type::VolumeResize,
                hv::runtime_capability::Type::FsGroupChangePolicyAlways,
            ]
            .into_iter()
            .map(|t| hv::RuntimeCapability { r#type: t as i32 })
            .collect(),
            file_systems: vec![hv::FileSystemSupport {
                fs_type: "ext4".into(),
                mount_options: Vec::new(),
            }],
            required: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        matches!(
            r.outcome,
            Some(hv::hand_over_response::Outcome::HandedOver(_))
        ),
        "{r:?}"
    );
    let before = record(&node, &id);
    let mounts = mounts_under(node.dir.path());
    let handoff = files_under(&node.crust_root());
    refused(
        "NodePublishVolume handed over",
        c.node.node_publish_volume(publish(&handed, false)).await,
    );
    assert_eq!(record(&node, &id), before, "records changed");
    assert_eq!(mounts_under(node.dir.path()), mounts, "mounts changed");
    assert_eq!(files_under(&node.crust_root()), handoff);
}

/// Identity of a file or directory: (inode, uid, mode, sha256 of its
/// bytes for a file).
fn identity(p: &str) -> (u64, u32, u32, Option<String>) {
    let m = std::fs::symlink_metadata(p).unwrap();
    let digest = m.is_file().then(|| {
        let d = Sha256::digest(std::fs::read(p).unwrap());
        d.iter().map(|b| format!("{b:02x}")).collect()
    });
    (m.ino(), m.uid(), m.mode(), digest)
}

/// The replayed bug: a user's own empty file (raw block) or directory
/// (filesystem) at a target the plugin never recorded, with a bind of the
/// volume over it as a publish that crashed before recording would leave
/// it. NodeUnpublishVolume undoes the bind and leaves the user's file and
/// directory as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_keeps_a_users_target_under_a_leftover_bind() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let raw = c
        .create(create_req("raw", 16 * MIB, vec![block()]))
        .await
        .unwrap()
        .volume_id;
    let fs = c
        .create(create_req("fs", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let raw_staging = node.mkdir("staging/raw");
    let fs_staging = node.mkdir("staging/fs");
    c.stage(&raw, &raw_staging, block()).await.unwrap();
    c.stage(&fs, &fs_staging, mount("ext4")).await.unwrap();
    let device = record(&node, &raw)["staging"]["device"]
        .as_str()
        .unwrap()
        .to_string();

    let pods = node.mkdir("pods/u");
    let file = format!("{pods}/users-file");
    let dir = format!("{pods}/users-dir");
    std::fs::write(&file, b"").unwrap();
    std::fs::create_dir(&dir).unwrap();
    for p in [&file, &dir] {
        std::os::unix::fs::chown(p, Some(4321), Some(4321)).unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o640)).unwrap();
    }
    let (file_id, dir_id) = (identity(&file), identity(&dir));
    let bind = |src: &str, dst: &str| {
        rustix::mount::mount_bind(src, dst).unwrap_or_else(|e| panic!("bind {src} on {dst}: {e}"));
    };
    bind(&device, &file);
    bind(&fs_staging, &dir);

    c.unpublish(&raw, &file).await.unwrap();
    c.unpublish(&fs, &dir).await.unwrap();
    for p in [&file, &dir] {
        assert!(!is_mounted(p), "{p}: the bind is still there");
    }
    assert_eq!(identity(&file), file_id, "the user's file changed");
    assert_eq!(identity(&dir), dir_id, "the user's directory changed");
    assert!(
        record(&node, &raw)["published"]
            .as_object()
            .unwrap()
            .is_empty()
    );

    c.unstage(&raw, &raw_staging).await.unwrap();
    c.unstage(&fs, &fs_staging).await.unwrap();
}

/// A host publish killed between each two of its steps (target listed in
/// the record, target created, bind made; the publication not recorded
/// yet): after the restart NodeUnpublishVolume removes the bind and the
/// target the record says the plugin created, and forgets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_killed_at_each_step_is_undone_by_unpublish() {
    let mut node = TestNode::new();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("crash", 16 * MIB, vec![block()]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/crash");
    c.stage(&id, &staging, block()).await.unwrap();
    let pods = node.mkdir("pods/c");

    for (step, exists, bound) in [
        ("target-recorded", false, false),
        ("target-created", true, false),
        ("bound", true, true),
    ] {
        let target = format!("{pods}/{step}");
        node.stop();
        node.env
            .push(("CRUST_CSI_TEST_PUBLISH_CRASH".into(), step.into()));
        node.start();
        let mut c = node.clients().await;
        let r = c.publish(&id, &staging, &target, block(), false).await;
        assert!(r.is_err(), "{step}: the plugin did not die: {r:?}");
        node.crash();
        node.env.pop();
        node.start();

        let rec = record(&node, &id);
        assert_eq!(
            rec["created_targets"],
            serde_json::json!([target]),
            "{step}"
        );
        assert!(rec["published"].as_object().unwrap().is_empty(), "{step}");
        assert_eq!(Path::new(&target).exists(), exists, "{step}");
        assert_eq!(is_mounted(&target), bound, "{step}");

        let mut c = node.clients().await;
        c.unpublish(&id, &target).await.unwrap();
        assert!(!is_mounted(&target), "{step}: bind left");
        assert!(!Path::new(&target).exists(), "{step}: target left");
        assert!(
            record(&node, &id).get("created_targets").is_none(),
            "{step}"
        );
    }

    // A publish that completes records its own target; unpublish removes
    // it. One the CO made stays.
    let mut c = node.clients().await;
    let fresh = format!("{pods}/fresh");
    c.publish(&id, &staging, &fresh, block(), false)
        .await
        .unwrap();
    assert_eq!(
        record(&node, &id)["created_targets"],
        serde_json::json!([fresh])
    );
    c.unpublish(&id, &fresh).await.unwrap();
    assert!(!Path::new(&fresh).exists());
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}
