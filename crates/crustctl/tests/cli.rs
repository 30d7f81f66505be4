//! The `crustctl` binary against a CSI server over a real unix socket:
//! every subcommand's request reaches the server with the right fields,
//! output parses, errors map to the documented exit codes.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod support;

use std::process::{Command, Output};

use crust_proto::csi::v1 as csi;
use csi::volume_capability::{AccessType, access_mode::Mode};
use serde_json::{Value, json};
use support::{Fake, NODE_ID, Options, TOPOLOGY_KEY};

fn crustctl(fake: &Fake, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_crustctl"))
        .arg("--endpoint")
        .arg(fake.endpoint())
        .args(args)
        .env_remove("CSI_ENDPOINT")
        .output()
        .expect("run crustctl")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "crustctl failed ({:?}): stdout={} stderr={}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn json_out(o: &Output) -> Value {
    let s = ok(o);
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn mount(c: &Option<csi::VolumeCapability>) -> csi::volume_capability::MountVolume {
    match c.as_ref().and_then(|c| c.access_type.clone()) {
        Some(AccessType::Mount(m)) => m,
        other => panic!("expected a mount capability, got {other:?}"),
    }
}

#[test]
fn identity_commands() {
    let fake = Fake::start(Options::default());
    let text = ok(&crustctl(&fake, &["identity", "info"]));
    assert!(
        text.contains(support::DRIVER) && text.contains("0.0.1-test"),
        "{text}"
    );
    let j = json_out(&crustctl(&fake, &["-o", "json", "identity", "info"]));
    assert_eq!(j["name"], support::DRIVER);
    assert_eq!(j["manifest"], json!({"fake": "yes"}));

    let j = json_out(&crustctl(
        &fake,
        &["identity", "capabilities", "-o", "json"],
    ));
    assert_eq!(
        j["capabilities"],
        json!([
            {"service": {"type": "CONTROLLER_SERVICE"}},
            {"service": {"type": "VOLUME_ACCESSIBILITY_CONSTRAINTS"}},
            {"volume_expansion": {"type": "ONLINE"}},
        ])
    );
    let text = ok(&crustctl(&fake, &["identity", "probe"]));
    assert_eq!(text, "ready: true\n");
    assert_eq!(fake.count("Probe"), 1);
}

#[test]
fn create_sends_every_field_and_hides_secrets() {
    let fake = Fake::start(Options::default());
    let o = crustctl(
        &fake,
        &[
            "controller",
            "create",
            "--name",
            "pv-1",
            "--size",
            "1Gi",
            "--limit",
            "2Gi",
            "--fs-type",
            "xfs",
            "--mount-flag",
            "noatime",
            "--access-mode",
            "single-node-single-writer",
            "--param",
            "crust.io/fs=xfs",
            "--param",
            "x=a=b",
            "--mutable-param",
            "iops=5",
            "--secret",
            "token=hunter2-topsecret",
            "--topology",
            "zone=z1",
            "-o",
            "json",
        ],
    );
    let j = json_out(&o);
    assert_eq!(j["volume"]["volume_id"], "fake-vol-1");
    assert_eq!(j["volume"]["capacity_bytes"], 1 << 30);
    assert_eq!(
        j["volume"]["volume_context"],
        json!({"fake.crust.io/name": "pv-1"})
    );
    assert_eq!(
        j["volume"]["accessible_topology"],
        json!([{"segments": {TOPOLOGY_KEY: NODE_ID}}])
    );
    let all = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    assert!(!all.contains("hunter2"), "secret echoed: {all}");

    let r: csi::CreateVolumeRequest = fake.last("CreateVolume");
    assert_eq!(r.name, "pv-1");
    let cr = r.capacity_range.unwrap();
    assert_eq!((cr.required_bytes, cr.limit_bytes), (1 << 30, 2 << 30));
    assert_eq!(r.volume_capabilities.len(), 1);
    let cap = Some(r.volume_capabilities[0].clone());
    let m = mount(&cap);
    assert_eq!(m.fs_type, "xfs");
    assert_eq!(m.mount_flags, vec!["noatime"]);
    assert_eq!(
        r.volume_capabilities[0].access_mode.unwrap().mode,
        Mode::SingleNodeSingleWriter as i32
    );
    assert_eq!(r.parameters["crust.io/fs"], "xfs");
    assert_eq!(r.parameters["x"], "a=b");
    assert_eq!(r.mutable_parameters["iops"], "5");
    assert_eq!(r.secrets["token"], "hunter2-topsecret");
    let top = r.accessibility_requirements.unwrap();
    assert_eq!(top.requisite[0].segments["zone"], "z1");
    assert_eq!(top.preferred[0].segments["zone"], "z1");

    // block + default access mode, text output, clone source
    let text = ok(&crustctl(
        &fake,
        &[
            "controller",
            "create",
            "--name",
            "pv-2",
            "--size",
            "512Mi",
            "--block",
            "--source-volume",
            "fake-vol-1",
        ],
    ));
    assert!(
        text.contains("fake-vol-2") && text.contains("512.0Mi"),
        "{text}"
    );
    let r: csi::CreateVolumeRequest = fake.last("CreateVolume");
    assert!(matches!(
        r.volume_capabilities[0].access_type,
        Some(AccessType::Block(_))
    ));
    assert_eq!(
        r.volume_capabilities[0].access_mode.unwrap().mode,
        Mode::SingleNodeWriter as i32
    );
    assert_eq!(r.capacity_range.unwrap().required_bytes, 512 << 20);
    assert!(matches!(
        r.volume_content_source.unwrap().r#type,
        Some(csi::volume_content_source::Type::Volume(ref v)) if v.volume_id == "fake-vol-1"
    ));
}

#[test]
fn controller_commands() {
    let fake = Fake::start(Options::default());
    for i in 1..=3 {
        fake.add_volume(&format!("v{i}"), i << 30);
    }

    let j = json_out(&crustctl(&fake, &["controller", "get", "v2", "-o", "json"]));
    assert_eq!(j["volume"]["volume_id"], "v2");
    assert_eq!(j["volume"]["capacity_bytes"], 2i64 << 30);
    assert_eq!(j["status"]["volume_condition"]["abnormal"], false);

    // one page, then all pages
    let j = json_out(&crustctl(
        &fake,
        &["controller", "list", "--max-entries", "2", "-o", "json"],
    ));
    assert_eq!(j["entries"].as_array().unwrap().len(), 2);
    assert_eq!(j["next_token"], "2");
    let j = json_out(&crustctl(
        &fake,
        &[
            "controller",
            "list",
            "--max-entries",
            "1",
            "--all",
            "-o",
            "json",
        ],
    ));
    let ids: Vec<&str> = j["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["volume"]["volume_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["v1", "v2", "v3"]);
    assert_eq!(j["next_token"], "");
    let tokens: Vec<String> = fake
        .requests::<csi::ListVolumesRequest>("ListVolumes")
        .into_iter()
        .skip(1)
        .map(|r| r.starting_token)
        .collect();
    assert_eq!(tokens, vec!["", "1", "2"]);
    let text = ok(&crustctl(
        &fake,
        &["controller", "list", "--starting-token", "2"],
    ));
    assert!(text.starts_with("VOLUME_ID") && text.contains("v3") && !text.contains("v1"));
    // a bad token is the server's ABORTED, passed through
    let o = crustctl(&fake, &["controller", "list", "--starting-token", "99"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("error: Aborted: invalid starting_token"),
        "{}",
        stderr(&o)
    );

    let j = json_out(&crustctl(
        &fake,
        &[
            "controller",
            "capacity",
            "--fs-type",
            "ext4",
            "--param",
            "p=1",
            "--topology",
            "zone=a",
            "-o",
            "json",
        ],
    ));
    assert_eq!(j["available_capacity"], 10i64 << 30);
    assert_eq!(j["maximum_volume_size"], 4i64 << 30);
    let r: csi::GetCapacityRequest = fake.last("GetCapacity");
    assert_eq!(
        mount(&Some(r.volume_capabilities[0].clone())).fs_type,
        "ext4"
    );
    assert_eq!(r.parameters["p"], "1");
    assert_eq!(r.accessible_topology.unwrap().segments["zone"], "a");
    // without capability flags none is sent
    ok(&crustctl(&fake, &["controller", "capacity"]));
    let r: csi::GetCapacityRequest = fake.last("GetCapacity");
    assert!(r.volume_capabilities.is_empty());

    let j = json_out(&crustctl(
        &fake,
        &["controller", "expand", "v1", "--size", "3Gi", "-o", "json"],
    ));
    assert_eq!(
        j,
        json!({"capacity_bytes": 3i64 << 30, "node_expansion_required": true})
    );
    let r: csi::ControllerExpandVolumeRequest = fake.last("ControllerExpandVolume");
    assert_eq!(r.capacity_range.unwrap().required_bytes, 3 << 30);
    assert!(r.volume_capability.is_none());
    let o = crustctl(&fake, &["controller", "expand", "v3", "--size", "1Gi"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("error: OutOfRange: cannot shrink"));

    let j = json_out(&crustctl(
        &fake,
        &[
            "controller",
            "validate",
            "v1",
            "--block",
            "--access-mode",
            "multi-node-reader-only",
            "--volume-context",
            "c=1",
            "--param",
            "p=2",
            "-o",
            "json",
        ],
    ));
    assert_eq!(
        j["confirmed"]["volume_capabilities"],
        json!([{"block": {}, "access_mode": {"mode": "MULTI_NODE_READER_ONLY"}}])
    );
    assert_eq!(j["confirmed"]["volume_context"], json!({"c": "1"}));
    assert_eq!(j["confirmed"]["parameters"], json!({"p": "2"}));

    let j = json_out(&crustctl(
        &fake,
        &["controller", "capabilities", "-o", "json"],
    ));
    let caps: Vec<&str> = j["capabilities"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["rpc"]["type"].as_str().unwrap())
        .collect();
    assert!(caps.contains(&"CREATE_DELETE_VOLUME") && caps.contains(&"GET_VOLUME"));

    let j = json_out(&crustctl(
        &fake,
        &[
            "controller",
            "publish",
            "v1",
            "--node-id",
            NODE_ID,
            "--readonly",
            "--volume-context",
            "k=v",
            "--secret",
            "s=zzsecretzz",
            "-o",
            "json",
        ],
    ));
    assert_eq!(j["publish_context"]["devicePath"], "/dev/fake/v1");
    let r: csi::ControllerPublishVolumeRequest = fake.last("ControllerPublishVolume");
    assert!(r.readonly);
    assert_eq!(r.node_id, NODE_ID);
    assert_eq!(r.volume_context["k"], "v");
    assert_eq!(r.secrets["s"], "zzsecretzz");
    assert_eq!(fake.held().1, 1);
    let text = ok(&crustctl(
        &fake,
        &["controller", "unpublish", "v1", "--node-id", NODE_ID],
    ));
    assert_eq!(text, "volume v1 unpublished\n");
    assert_eq!(fake.held().1, 0);

    ok(&crustctl(
        &fake,
        &["controller", "modify", "v1", "--mutable-param", "iops=9"],
    ));
    let r: csi::ControllerModifyVolumeRequest = fake.last("ControllerModifyVolume");
    assert_eq!(r.mutable_parameters["iops"], "9");

    // snapshots
    let j = json_out(&crustctl(
        &fake,
        &[
            "controller",
            "snapshot-create",
            "--source-volume",
            "v1",
            "--name",
            "s1",
            "--param",
            "a=b",
            "-o",
            "json",
        ],
    ));
    assert_eq!(j["snapshot"]["snapshot_id"], "snap-s1");
    assert_eq!(j["snapshot"]["creation_time"], "2023-11-14T22:13:20Z");
    let r: csi::CreateSnapshotRequest = fake.last("CreateSnapshot");
    assert_eq!((r.source_volume_id.as_str(), r.name.as_str()), ("v1", "s1"));
    assert_eq!(r.parameters["a"], "b");
    let j = json_out(&crustctl(
        &fake,
        &["controller", "snapshot-get", "snap-s1", "-o", "json"],
    ));
    assert_eq!(j["snapshot"]["source_volume_id"], "v1");
    let j = json_out(&crustctl(
        &fake,
        &[
            "controller",
            "snapshot-list",
            "--source-volume",
            "v1",
            "--all",
            "-o",
            "json",
        ],
    ));
    assert_eq!(j["entries"].as_array().unwrap().len(), 1);
    assert_eq!(
        fake.last::<csi::ListSnapshotsRequest>("ListSnapshots")
            .source_volume_id,
        "v1"
    );
    let text = ok(&crustctl(
        &fake,
        &["controller", "snapshot-delete", "snap-s1"],
    ));
    assert_eq!(text, "snapshot snap-s1 deleted\n");
    let o = crustctl(&fake, &["controller", "snapshot-get", "snap-s1"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("error: NotFound: snapshot snap-s1 does not exist"));

    let text = ok(&crustctl(&fake, &["controller", "delete", "v3"]));
    assert_eq!(text, "volume v3 deleted\n");
    assert_eq!(
        fake.last::<csi::DeleteVolumeRequest>("DeleteVolume")
            .volume_id,
        "v3"
    );
    assert_eq!(fake.held().0, 2);
    // empty responses are `{}` in JSON
    let j = json_out(&crustctl(
        &fake,
        &["controller", "delete", "v2", "-o", "json"],
    ));
    assert_eq!(j, json!({}));
}

#[test]
fn node_commands_carry_the_kep_fields() {
    let fake = Fake::start(Options::default());
    fake.add_volume("v1", 1 << 30);
    let staging = fake.dir.path().join("globalmount");
    std::fs::create_dir(&staging).unwrap();
    let target = fake.dir.path().join("pod").join("mount");
    std::fs::create_dir(target.parent().unwrap()).unwrap();
    let staging_s = staging.to_str().unwrap();
    let target_s = target.to_str().unwrap();

    let text = ok(&crustctl(
        &fake,
        &[
            "node",
            "stage",
            "v1",
            "--staging-path",
            staging_s,
            "--fs-type",
            "ext4",
            "--publish-context",
            "devicePath=/dev/x",
            "--volume-context",
            "crust.io/defer=true",
            "--secret",
            "key=stage-secret-value",
        ],
    ));
    assert_eq!(text, format!("volume v1 staged at {staging_s}\n"));
    assert!(!text.contains("stage-secret-value"));
    let r: csi::NodeStageVolumeRequest = fake.last("NodeStageVolume");
    assert_eq!(r.staging_target_path, staging_s);
    assert_eq!(mount(&r.volume_capability).fs_type, "ext4");
    assert_eq!(r.publish_context["devicePath"], "/dev/x");
    assert_eq!(r.volume_context["crust.io/defer"], "true");
    assert_eq!(r.secrets["key"], "stage-secret-value");

    let o = crustctl(
        &fake,
        &[
            "node",
            "publish",
            "v1",
            "--target-path",
            target_s,
            "--staging-path",
            staging_s,
            "--readonly",
            "--defer-fs-ops",
            "--supplemental-group",
            "100",
            "--supplemental-group-change-policy",
            "OnRootMismatch",
            "--fs-type",
            "ext4",
            "--mount-flag",
            "ro",
            "--secret",
            "key=publish-secret-value",
            "--volume-context",
            "a=b",
        ],
    );
    let text = ok(&o);
    assert!(text.contains("filesystem deferred"), "{text}");
    assert!(!format!("{text}{}", stderr(&o)).contains("publish-secret-value"));
    assert!(target.is_dir(), "the driver made the target");
    let r: csi::NodePublishVolumeRequest = fake.last("NodePublishVolume");
    assert!(r.defer_fs_ops);
    assert!(r.readonly);
    assert_eq!(r.target_path, target_s);
    assert_eq!(r.staging_target_path, staging_s);
    let m = mount(&r.volume_capability);
    assert_eq!(m.volume_supplemental_group, "100");
    assert_eq!(m.volume_supplemental_group_change_policy, "OnRootMismatch");
    assert_eq!(m.mount_flags, vec!["ro"]);
    assert_eq!(r.volume_context["a"], "b");
    // on the wire: field 9, varint, true
    let raw = fake.raw_requests("NodePublishVolume").pop().unwrap();
    assert!(
        raw.windows(2).any(|w| w == [9 << 3, 1]),
        "field 9 not on the wire"
    );

    // without --defer-fs-ops the field stays off (and off the wire)
    let target2 = fake.dir.path().join("pod").join("mount2");
    ok(&crustctl(
        &fake,
        &[
            "node",
            "publish",
            "v1",
            "--target-path",
            target2.to_str().unwrap(),
            "--staging-path",
            staging_s,
        ],
    ));
    let r: csi::NodePublishVolumeRequest = fake.last("NodePublishVolume");
    assert!(!r.defer_fs_ops && !r.readonly);
    assert_eq!(mount(&r.volume_capability).volume_supplemental_group, "");

    let j = json_out(&crustctl(
        &fake,
        &[
            "node",
            "stats",
            "v1",
            "--volume-path",
            target_s,
            "--staging-path",
            staging_s,
            "--defer-fs-ops",
            "-o",
            "json",
        ],
    ));
    assert_eq!(
        j["usage"][0],
        json!({"available": (1i64 << 30) - 4096, "total": 1i64 << 30, "used": 4096, "unit": "BYTES"})
    );
    assert_eq!(j["usage"][1]["unit"], "INODES");
    assert_eq!(
        j["volume_condition"],
        json!({"abnormal": false, "message": "healthy"})
    );
    let r: csi::NodeGetVolumeStatsRequest = fake.last("NodeGetVolumeStats");
    assert!(r.defer_fs_ops);
    assert_eq!(
        (r.volume_path.as_str(), r.staging_target_path.as_str()),
        (target_s, staging_s)
    );
    let text = ok(&crustctl(
        &fake,
        &["node", "stats", "v1", "--volume-path", target_s],
    ));
    assert!(
        text.contains("BYTES") && text.contains("normal: healthy"),
        "{text}"
    );
    assert!(
        !fake
            .last::<csi::NodeGetVolumeStatsRequest>("NodeGetVolumeStats")
            .defer_fs_ops
    );

    let j = json_out(&crustctl(
        &fake,
        &[
            "node",
            "expand",
            "v1",
            "--volume-path",
            target_s,
            "--size",
            "2Gi",
            "--defer-fs-ops",
            "--supplemental-group",
            "100",
            "--supplemental-group-change-policy",
            "Always",
            "-o",
            "json",
        ],
    ));
    assert_eq!(j, json!({"capacity_bytes": 2i64 << 30}));
    let r: csi::NodeExpandVolumeRequest = fake.last("NodeExpandVolume");
    assert!(r.defer_fs_ops);
    assert_eq!(r.capacity_range.unwrap().required_bytes, 2 << 30);
    assert_eq!(
        mount(&r.volume_capability).volume_supplemental_group_change_policy,
        "Always"
    );
    // field 2857 on the wire, never the spec's field 6 (secrets)
    let raw = fake.raw_requests("NodeExpandVolume").pop().unwrap();
    let mut key = Vec::new();
    prost::encoding::encode_key(2857, prost::encoding::WireType::Varint, &mut key);
    key.push(1);
    assert!(raw.windows(key.len()).any(|w| w == key.as_slice()));

    let text = ok(&crustctl(
        &fake,
        &[
            "node",
            "unpublish",
            "v1",
            "--target-path",
            target_s,
            "--defer-fs-ops",
        ],
    ));
    assert_eq!(text, format!("volume v1 unpublished from {target_s}\n"));
    assert!(
        fake.last::<csi::NodeUnpublishVolumeRequest>("NodeUnpublishVolume")
            .defer_fs_ops
    );
    assert!(!target.exists());
    ok(&crustctl(
        &fake,
        &[
            "node",
            "unpublish",
            "v1",
            "--target-path",
            target2.to_str().unwrap(),
        ],
    ));
    assert!(
        !fake
            .last::<csi::NodeUnpublishVolumeRequest>("NodeUnpublishVolume")
            .defer_fs_ops
    );
    ok(&crustctl(
        &fake,
        &["node", "unstage", "v1", "--staging-path", staging_s],
    ));
    assert_eq!(fake.held(), (1, 0, 0, 0));

    let j = json_out(&crustctl(&fake, &["node", "capabilities", "-o", "json"]));
    let caps: Vec<&str> = j["capabilities"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["rpc"]["type"].as_str().unwrap())
        .collect();
    assert!(caps.contains(&"STAGE_UNSTAGE_VOLUME"));
    assert!(caps.contains(&"DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY"));
    let j = json_out(&crustctl(&fake, &["node", "info", "-o", "json"]));
    assert_eq!(
        j,
        json!({"node_id": NODE_ID, "max_volumes_per_node": 0,
               "accessible_topology": {"segments": {TOPOLOGY_KEY: NODE_ID}},
               "supported_file_systems": ["ext4"]})
    );
    let text = ok(&crustctl(&fake, &["node", "info"]));
    assert!(text.contains(NODE_ID) && text.contains("unlimited"));
}

#[test]
fn volume_health_commands_send_the_v1_13_requests() {
    let fake = Fake::start(Options::default());
    fake.add_volume("v1", 1 << 30);
    let j = json_out(&crustctl(
        &fake,
        &[
            "node",
            "volume-health",
            "v1",
            "--volume-path",
            "/pods/p/mount",
            "--staging-path",
            "/staging/g",
            "-o",
            "json",
        ],
    ));
    let r = fake.last::<csi::NodeGetVolumeHealthRequest>("NodeGetVolumeHealth");
    assert_eq!(
        (
            r.volume_id.as_str(),
            r.volume_publish_path.as_str(),
            r.staging_target_path.as_str()
        ),
        ("v1", "/pods/p/mount", "/staging/g")
    );
    assert_eq!(
        j,
        json!({"volume_health": {"volume_id": "v1", "health_statuses": [
            {"status": "DEGRADED", "reason": "FilesystemReadOnly", "message": "read-only"}
        ]}})
    );
    let text = ok(&crustctl(&fake, &["node", "volume-health", "v1"]));
    assert_eq!(text, "v1: DEGRADED FilesystemReadOnly: read-only\n");

    let text = ok(&crustctl(&fake, &["node", "storage-health"]));
    assert_eq!(text, "storage healthy (no adverse condition)\n");
    fake.last::<csi::NodeGetStorageHealthRequest>("NodeGetStorageHealth");

    let text = ok(&crustctl(&fake, &["controller", "volume-health", "v1"]));
    assert_eq!(text, "v1: healthy\n");
    assert_eq!(
        fake.last::<csi::ControllerGetVolumeHealthRequest>("ControllerGetVolumeHealth")
            .volume_id,
        "v1"
    );
    let j = json_out(&crustctl(
        &fake,
        &[
            "controller",
            "list-volume-health",
            "--max-entries",
            "5",
            "--starting-token",
            "t0",
            "-o",
            "json",
        ],
    ));
    assert_eq!(j, json!({"entries": [], "next_token": ""}));
    let r = fake.last::<csi::ControllerListVolumeHealthRequest>("ControllerListVolumeHealth");
    assert_eq!((r.max_entries, r.starting_token.as_str()), (5, "t0"));
    // unknown volume: the server's NOT_FOUND, exit 1
    let o = crustctl(&fake, &["controller", "volume-health", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("NotFound"), "{}", stderr(&o));
}

#[test]
fn grpc_errors_exit_1_with_the_code() {
    let fake = Fake::start(Options::default());
    let o = crustctl(&fake, &["controller", "get", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stderr(&o), "error: NotFound: volume nope does not exist\n");
    assert!(o.stdout.is_empty());
    // JSON mode keeps errors on stderr too
    let o = crustctl(
        &fake,
        &["-o", "json", "node", "stats", "nope", "--volume-path", "/x"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).starts_with("error: NotFound: "));
    let o = crustctl(
        &fake,
        &["node", "stage", "v", "--staging-path", "/nonexistent-dir"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("error: NotFound: volume v"),
        "{}",
        stderr(&o)
    );
    fake.add_volume("v", 1 << 20);
    let o = crustctl(
        &fake,
        &["node", "stage", "v", "--staging-path", "/nonexistent-dir"],
    );
    assert!(
        stderr(&o).starts_with("error: InvalidArgument: staging_target_path"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn usage_errors_exit_2_without_calling() {
    let fake = Fake::start(Options::default());
    for args in [
        vec!["controller", "create", "--name", "x", "--size", "1GB"],
        vec![
            "controller",
            "create",
            "--name",
            "x",
            "--size",
            "1Gi",
            "--limit",
            "1Mi",
        ],
        vec![
            "controller",
            "create",
            "--name",
            "x",
            "--param",
            "a=1",
            "--param",
            "a=2",
        ],
        vec![
            "controller",
            "create",
            "--name",
            "x",
            "--block",
            "--fs-type",
            "xfs",
        ],
        vec![
            "node",
            "publish",
            "v",
            "--target-path",
            "/t",
            "--supplemental-group-change-policy",
            "Sometimes",
        ],
        vec!["node", "stage", "v"],
        vec!["controller", "list", "--max-entries", "-1"],
        vec!["frobnicate"],
    ] {
        let o = crustctl(&fake, &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("error"), "{args:?}");
    }
    let s = fake.state.lock().unwrap();
    assert!(
        s.requests.is_empty(),
        "usage errors reached the server: {:?}",
        s.requests.iter().map(|r| r.0).collect::<Vec<_>>()
    );
}

#[test]
fn connection_and_deadline_errors() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_crustctl"))
        .arg("--endpoint")
        .arg(format!("unix://{}/missing.sock", dir.path().display()))
        .args(["identity", "info"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("error: cannot connect to unix://"),
        "{}",
        stderr(&o)
    );

    let fake = Fake::start(Options {
        probe_delay: std::time::Duration::from_secs(5),
        ..Options::default()
    });
    let t0 = std::time::Instant::now();
    let o = crustctl(&fake, &["--timeout", "300ms", "identity", "probe"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).starts_with("error: DeadlineExceeded"),
        "{}",
        stderr(&o)
    );
    assert!(t0.elapsed() < std::time::Duration::from_secs(5));
}

#[test]
fn endpoint_from_the_environment() {
    let fake = Fake::start(Options::default());
    let o = Command::new(env!("CARGO_BIN_EXE_crustctl"))
        .env("CSI_ENDPOINT", fake.endpoint())
        .args(["node", "info", "-o", "json"])
        .output()
        .unwrap();
    assert_eq!(json_out(&o)["node_id"], NODE_ID);
}
