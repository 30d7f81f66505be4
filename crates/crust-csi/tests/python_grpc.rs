//! crust-csi called by Python's `grpcio` (grpc-core, the client of
//! Python, C++, Ruby and PHP COs) on its unix socket with the channel's
//! default `:authority` (the %-encoded socket path, which h2 alone would
//! reset): Identity, Controller and Node answer, with the spec's codes.
//!
//! Time budget: about 3 s (python start-up, proto compilation, one
//! volume).

mod common;

use common::*;
use crust_testkit::grpc_python_calls;
use serde_json::json;

#[test]
fn grpcio_client_with_its_default_authority_calls_every_service() {
    let node = TestNode::new();
    let mount_cap = json!({
        "mount": {"fs_type": "ext4"},
        "access_mode": {"mode": "SINGLE_NODE_WRITER"}
    });
    let create = json!({
        "name": "pvc-python",
        "capacity_range": {"required_bytes": (64 * MIB).to_string()},
        "volume_capabilities": [mount_cap],
    });
    // Both target spellings grpc-core accepts (their authorities differ:
    // `tmp%2F...` and `%2Ftmp%2F...`).
    let targets = [
        format!("unix://{}", node.socket.display()),
        format!("unix:{}", node.socket.display()),
    ];
    let a = grpc_python_calls(
        &targets[0],
        &[
            ("csi.v1.Identity/GetPluginInfo", json!({})),
            ("csi.v1.Identity/Probe", json!({})),
            ("csi.v1.Controller/CreateVolume", create.clone()),
            ("csi.v1.Controller/CreateVolume", create),
            ("csi.v1.Controller/CreateVolume", json!({"name": ""})),
            ("csi.v1.Node/NodeGetInfo", json!({})),
            (
                "csi.v1.Controller/DeleteVolume",
                json!({"volume_id": "vol-00000000000000000000000000000000"}),
            ),
        ],
    );
    for x in &a {
        eprintln!("{} {} {}", x.code, x.details, x.response);
    }
    assert_eq!(a[0].code, "OK", "{}", a[0].details);
    assert_eq!(a[0].response["name"], "blk.crust.dev");
    assert_eq!(a[1].code, "OK");
    assert_eq!(a[1].response["ready"], true);
    assert_eq!(a[2].code, "OK", "{}", a[2].details);
    let vol = a[2].response["volume"].clone();
    let id = vol["volume_id"].as_str().unwrap().to_string();
    assert!(id.starts_with("vol-"), "{vol}");
    assert_eq!(vol["capacity_bytes"], (64 * MIB).to_string());
    // Idempotent: the same volume again.
    assert_eq!(a[3].code, "OK");
    assert_eq!(a[3].response["volume"]["volume_id"], id.as_str());
    assert_eq!(a[4].code, "INVALID_ARGUMENT", "{}", a[4].details);
    assert_eq!(a[5].code, "OK");
    assert_eq!(a[5].response["node_id"], NODE);
    // An unknown volume is already deleted.
    assert_eq!(a[6].code, "OK");

    // The other target spelling, and the volume goes away for real.
    let b = grpc_python_calls(
        &targets[1],
        &[
            ("csi.v1.Controller/DeleteVolume", json!({"volume_id": id})),
            ("csi.v1.Controller/ListVolumes", json!({})),
        ],
    );
    assert_eq!(b[0].code, "OK", "{}", b[0].details);
    assert_eq!(b[1].code, "OK", "{}", b[1].details);
    assert!(
        !b[1].response.to_string().contains(&id),
        "deleted volume still listed: {}",
        b[1].response
    );
}
