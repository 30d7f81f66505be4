//! The KEP-2857 fields must not disturb a CSI v1.12 peer that does not know
//! them. These "stock" messages are hand-declared with exactly the v1.12
//! fields, standing in for a client generated from the upstream csi.proto.

use std::collections::HashMap;

use crust_proto::csi::v1 as ours;
use prost::Message;

#[derive(Clone, PartialEq, prost::Message)]
struct StockCapacityRange {
    #[prost(int64, tag = "1")]
    required_bytes: i64,
    #[prost(int64, tag = "2")]
    limit_bytes: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StockNodeExpandVolumeRequest {
    #[prost(string, tag = "1")]
    volume_id: String,
    #[prost(string, tag = "2")]
    volume_path: String,
    #[prost(message, optional, tag = "3")]
    capacity_range: Option<StockCapacityRange>,
    #[prost(string, tag = "4")]
    staging_target_path: String,
    #[prost(map = "string, string", tag = "6")]
    secrets: HashMap<String, String>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StockNodePublishVolumeRequest {
    #[prost(string, tag = "1")]
    volume_id: String,
    #[prost(string, tag = "4")]
    target_path: String,
    #[prost(bool, tag = "6")]
    readonly: bool,
    #[prost(map = "string, string", tag = "8")]
    volume_context: HashMap<String, String>,
}

#[test]
fn stock_expand_request_with_secrets_is_not_read_as_deferral() {
    let stock = StockNodeExpandVolumeRequest {
        volume_id: "vol-1".into(),
        volume_path: "/var/lib/kubelet/pods/p/volumes/x/mount".into(),
        capacity_range: Some(StockCapacityRange {
            required_bytes: 1 << 30,
            limit_bytes: 0,
        }),
        staging_target_path: String::new(),
        secrets: HashMap::from([("token".to_string(), "s3cr3t".to_string())]),
    };
    let decoded = ours::NodeExpandVolumeRequest::decode(stock.encode_to_vec().as_slice()).unwrap();
    assert!(
        !decoded.defer_fs_ops,
        "field 6 (secrets) must not turn on deferral"
    );
    assert_eq!(
        decoded.secrets.get("token").map(String::as_str),
        Some("s3cr3t")
    );
    assert_eq!(decoded.capacity_range.unwrap().required_bytes, 1 << 30);
}

#[test]
fn deferral_fields_are_skipped_by_a_stock_decoder() {
    let ours_req = ours::NodeExpandVolumeRequest {
        volume_id: "vol-2".into(),
        volume_path: "/t".into(),
        defer_fs_ops: true,
        ..Default::default()
    };
    let bytes = ours_req.encode_to_vec();
    let stock = StockNodeExpandVolumeRequest::decode(bytes.as_slice()).unwrap();
    assert_eq!(stock.volume_id, "vol-2");
    assert!(
        stock.secrets.is_empty(),
        "defer_fs_ops must not land in secrets"
    );

    let publish = ours::NodePublishVolumeRequest {
        volume_id: "vol-3".into(),
        target_path: "/t/mount".into(),
        readonly: true,
        defer_fs_ops: true,
        ..Default::default()
    };
    let stock = StockNodePublishVolumeRequest::decode(publish.encode_to_vec().as_slice()).unwrap();
    assert_eq!(stock.volume_id, "vol-3");
    assert_eq!(stock.target_path, "/t/mount");
    assert!(stock.readonly);
}

#[test]
fn stock_publish_request_decodes_without_deferral() {
    let stock = StockNodePublishVolumeRequest {
        volume_id: "v".into(),
        target_path: "/x".into(),
        readonly: false,
        volume_context: HashMap::from([("k".to_string(), "v".to_string())]),
    };
    let decoded = ours::NodePublishVolumeRequest::decode(stock.encode_to_vec().as_slice()).unwrap();
    assert!(!decoded.defer_fs_ops);
    assert_eq!(
        decoded.volume_context.get("k").map(String::as_str),
        Some("v")
    );
}

#[test]
fn kep_capability_values_are_the_documented_numbers() {
    use ours::node_service_capability::rpc::Type;
    for (name, _, value) in crust_proto::kep2857::NODE_CAPABILITIES {
        let t = Type::from_str_name(name).unwrap_or_else(|| panic!("{name} not in csi.proto"));
        assert_eq!(t as i32, *value, "{name}");
    }
    assert_eq!(Type::VolumeMountGroup as i32, 6);
}
