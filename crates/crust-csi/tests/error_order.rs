//! The order of checks every Node and Controller RPC follows (error.rs):
//! a required field left empty is INVALID_ARGUMENT; then an unknown
//! volume NOT_FOUND, whatever else is wrong; then a path the request
//! names to find the volume at, where the volume is not, NOT_FOUND,
//! decided from the string alone (a relative path is never resolved
//! against the plugin's working directory). One case per RPC that
//! answered otherwise before.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::HashMap;

use common::*;
use crust_proto::csi::v1 as csi;
use tonic::Code;

const UNKNOWN: &str = "vol-00000000000000000000000000000000";

fn stats_req(id: &str, path: &str, staging: &str) -> csi::NodeGetVolumeStatsRequest {
    csi::NodeGetVolumeStatsRequest {
        volume_id: id.into(),
        volume_path: path.into(),
        staging_target_path: staging.into(),
        ..Default::default()
    }
}

fn expand_req(id: &str, path: &str, required: i64) -> csi::NodeExpandVolumeRequest {
    csi::NodeExpandVolumeRequest {
        volume_id: id.into(),
        volume_path: path.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: required,
            limit_bytes: 0,
        }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_fields_then_unknown_volume_then_path() {
    let node = TestNode::with_args(&["--pool-capacity", "1Gi"]);
    let mut c = node.clients().await;
    let ia = Code::InvalidArgument;
    let nf = Code::NotFound;

    // A missing required field comes before the unknown volume.
    assert_code(
        c.node
            .node_get_volume_stats(stats_req(UNKNOWN, "", ""))
            .await,
        ia,
    );
    assert_code(
        c.node.node_expand_volume(expand_req(UNKNOWN, "", 0)).await,
        ia,
    );
    assert_code(
        c.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: UNKNOWN.into(),
                staging_target_path: "/s".into(),
                ..Default::default()
            })
            .await,
        ia,
    );
    assert_code(c.publish(UNKNOWN, "", "/t", mount("ext4"), false).await, ia);
    assert_code(
        c.ctl
            .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: UNKNOWN.into(),
                capacity_range: Some(csi::CapacityRange::default()),
                ..Default::default()
            })
            .await,
        ia,
    );

    // An unknown volume comes before the values of the other fields.
    assert_code(c.stage(UNKNOWN, "rel/stage", mount("ext4")).await, nf);
    assert_code(
        c.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: UNKNOWN.into(),
                staging_target_path: "/s".into(),
                volume_capability: Some(mount("ext4")),
                // --deferral disabled: FAILED_PRECONDITION for a known volume.
                volume_context: HashMap::from([("deferFsOps".into(), "true".into())]),
                ..Default::default()
            })
            .await,
        nf,
    );
    assert_code(
        c.publish(UNKNOWN, "/s", "rel/target", mount("ext4"), false)
            .await,
        nf,
    );
    assert_code(c.unstage(UNKNOWN, "/a/../s").await, nf);
    assert_code(
        c.node
            .node_expand_volume(expand_req(UNKNOWN, "rel", -1))
            .await,
        nf,
    );
    assert_code(
        c.ctl
            .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: UNKNOWN.into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: -1,
                    limit_bytes: 0,
                }),
                ..Default::default()
            })
            .await,
        nf,
    );
    // The spec's idempotency: nothing to undo for an unknown volume.
    c.unpublish(UNKNOWN, "rel/target").await.unwrap();

    // A known, staged and published volume: a path where it is not.
    let v = c
        .create(create_req("order", 16 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("stage");
    let target = node.path("pods/p/vol").to_str().unwrap().to_string();
    node.mkdir("pods/p");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    // Relative paths name a place under the plugin's working directory
    // only if resolved: make one that would exist there, and is a mount.
    let cwd = std::env::current_dir().unwrap();
    let rel_target = target.strip_prefix('/').unwrap();
    let via_root = format!("{}{}", "../".repeat(cwd.components().count()), rel_target);
    for path in [
        "some/path",
        via_root.as_str(),
        &format!("{target}/."),
        &format!("{target}/../vol"),
        &format!("{}//p/vol", node.path("pods").display()),
    ] {
        let s = assert_code(
            c.node.node_get_volume_stats(stats_req(&id, path, "")).await,
            nf,
        );
        assert!(
            s.message().contains("is not a staged or published path"),
            "{path}: {}",
            s.message()
        );
        assert_code(
            c.node.node_expand_volume(expand_req(&id, path, 0)).await,
            nf,
        );
    }
    // The optional staging path must be where the volume is staged.
    for staging_hint in ["rel/stage", "/elsewhere"] {
        assert_code(
            c.node
                .node_get_volume_stats(stats_req(&id, &target, staging_hint))
                .await,
            nf,
        );
        assert_code(
            c.node
                .node_expand_volume(csi::NodeExpandVolumeRequest {
                    staging_target_path: staging_hint.into(),
                    ..expand_req(&id, &target, 0)
                })
                .await,
            nf,
        );
    }
    // The exact strings answer.
    c.node
        .node_get_volume_stats(stats_req(&id, &target, &staging))
        .await
        .unwrap();
    c.node
        .node_get_volume_stats(stats_req(&id, &staging, ""))
        .await
        .unwrap();

    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}
