//! ControllerModifyVolume and CreateVolume's mutable parameters (I/O
//! limits, README "Live QoS") against the real plugin: the spec's order of
//! checks, bad parameters changing nothing (the record's bytes), the
//! limits kept across a plugin restart, and carried into the hand-off
//! record of a deferred publication, where a runtime that cannot apply
//! them live is an error, never a silent success. The live path into a
//! guest is crust-runtime's `guest_qos`. About 2 s.

mod common;

use common::*;
use crust_proto::csi::v1 as csi;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modify_checks_in_order_changes_nothing_on_bad_input_and_persists() {
    let mut node = TestNode::with_args(&["--pool-capacity", "2Gi"]);
    let mut c = node.clients().await;

    // Bad mutable parameters at creation: refused, nothing created.
    let mut bad = create_req("qos-bad", 64 * MIB, vec![mount("ext4")]);
    bad.mutable_parameters = params(&[("iops", "fast")]);
    let s = assert_code(c.create(bad).await, Code::InvalidArgument);
    assert!(s.message().contains("iops"), "{}", s.message());
    assert!(c.list_all().await.is_empty());

    let mut req = create_req("qos", 64 * MIB, vec![mount("ext4")]);
    req.mutable_parameters = params(&[("iops", "100")]);
    let id = c.create(req).await.unwrap().volume_id;
    assert_eq!(limits_of(&node, &id), serde_json::json!({"iops": 100}));

    // Order: missing fields, then NOT_FOUND, then the values.
    assert_code(
        modify_limits(&mut c, "", &[("iops", "1")]).await,
        Code::InvalidArgument,
    );
    assert_code(
        modify_limits(&mut c, "nope", &[]).await,
        Code::InvalidArgument,
    );
    assert_code(
        modify_limits(&mut c, "nope", &[("XXX_FakeKey", "1")]).await,
        Code::NotFound,
    );

    // Bad values change nothing, byte for byte.
    let before = record_bytes(&node, &id);
    for bad in [
        &[("XXX_FakeKey", "1")][..],
        &[("iops", "-5")],
        &[("iops", "1e3")],
        &[("bps", "1000000000000001")],
        // a split beside the recorded total
        &[("readIops", "50")],
        &[("iops", "200"), ("iops_rd", "1")],
        // a burst without its limit, below it; a length without a burst
        &[("writeIopsBurst", "500")],
        &[("iopsBurst", "50")],
        &[("burstSeconds", "4")],
    ] {
        let s = assert_code(modify_limits(&mut c, &id, bad).await, Code::InvalidArgument);
        assert!(
            bad.iter().any(|(k, _)| s.message().contains(k)),
            "{bad:?}: {}",
            s.message()
        );
        assert_eq!(
            record_bytes(&node, &id),
            before,
            "{bad:?} changed the record"
        );
    }

    // A merge: keys given replace, 0 lifts, the rest stay.
    modify_limits(
        &mut c,
        &id,
        &[("iops", "0"), ("readIops", "300"), ("writeBps", "4096")],
    )
    .await
    .unwrap();
    let want = serde_json::json!({"readIops": 300, "writeBps": 4096});
    assert_eq!(limits_of(&node, &id), want);
    modify_limits(&mut c, &id, &[("readIops", "300")])
        .await
        .unwrap(); // idempotent

    // Kept across a restart of the plugin.
    node.stop();
    node.start();
    let mut c = node.clients().await;
    assert_eq!(limits_of(&node, &id), want);
    modify_limits(&mut c, &id, &[("readIops", "0"), ("writeBps", "0")])
        .await
        .unwrap();
    assert_eq!(limits_of(&node, &id), serde_json::Value::Null, "unlimited");
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_volume_carries_its_limits_in_the_handoff_record() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let mut req = create_req("qos-defer", 64 * MIB, vec![mount("ext4")]);
    req.parameters.insert("deferFsOps".into(), "true".into());
    req.mutable_parameters = params(&[("iops", "200")]);
    let v = c.create(req).await.unwrap();
    let (id, ctx) = (v.volume_id, v.volume_context);
    let staging = node.mkdir("staging/q");
    c.node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.clone(),
            volume_capability: Some(mount("ext4")),
            volume_context: ctx.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let target = format!("{}/pv", node.mkdir("pods/uid/volumes"));
    c.node
        .node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.clone(),
            target_path: target.clone(),
            volume_capability: Some(mount("ext4")),
            volume_context: ctx,
            ..Default::default()
        })
        .await
        .unwrap();
    let mi = node
        .crust_root()
        .join(crust_handoff::crust_key(&target))
        .join("mountInfo.json");
    // The metadata besides the device's identity, which every change
    // keeps (the record goes on proving its device).
    let metadata = |mi: &std::path::Path| -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(mi).unwrap()).unwrap();
        let mut md = v["metadata"].clone();
        let id = md.as_object_mut().unwrap().remove("deviceIdentity");
        assert!(
            id.as_ref()
                .and_then(|i| i.as_str())
                .is_some_and(|i| i.starts_with("file:")),
            "{v}"
        );
        md
    };
    assert_eq!(metadata(&mi), serde_json::json!({"ioLimits": "iops=200"}));

    // No runtime consumed it yet: the record takes the change, for the plug.
    modify_limits(&mut c, &id, &[("iops", "0"), ("readBps", "1048576")])
        .await
        .unwrap();
    assert_eq!(
        metadata(&mi),
        serde_json::json!({"ioLimits": "readBps=1048576"})
    );

    // Consumed by a runtime whose CLI has no `crust throttle`: an error
    // saying the limits are recorded but not live, never a silent OK.
    let old_cli = cli_without_throttle(std::path::Path::new(&node.mkdir("bin")));
    consume(&node.crust_root(), &target, "sandbox-1", &old_cli);
    let s = assert_code(
        modify_limits(&mut c, &id, &[("readBps", "2097152")]).await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message().contains("recorded") && s.message().contains("throttle"),
        "{}",
        s.message()
    );
    assert_eq!(
        metadata(&mi),
        serde_json::json!({"ioLimits": "readBps=2097152"})
    );
    // The claim and the runtime CLI stayed.
    let dir = mi.parent().unwrap();
    assert!(dir.join("sandbox-1").exists() && dir.join("runtime-cli").exists());
}

/// The test runtime CLI as a runtime without `crust throttle` answers:
/// its capabilities lack the verb, every other call goes through.
fn cli_without_throttle(dir: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("cli-without-throttle");
    let script = format!(
        "#!/bin/sh\n\
         if [ \"$1 $2\" = \"crust capabilities\" ]; then\n\
           echo '{{\"verbs\": [\"capabilities\", \"freeze\", \"resize\", \"sandbox-state\", \"stats\", \"thaw\"]}}'\n\
           exit 0\n\
         fi\n\
         exec '{}' \"$@\"\n",
        runtime_cli().display()
    );
    std::fs::write(&p, script).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}
