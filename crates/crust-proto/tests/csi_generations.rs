//! crust speaks CSI v1.13 and keeps v1.12's condition fields; the KEP-2857
//! extension must collide with nothing a released CSI version uses.
//!
//! The "stock" messages below are hand-declared with exactly the fields of
//! the released specs (v1.12.0 and v1.13.0), standing in for clients
//! generated from the upstream csi.proto of each generation.

use std::collections::{BTreeSet, HashMap};

use crust_proto::csi::v1 as ours;
use prost::Message;

/// Field numbers each message has in CSI v1.13.0 (reserved numbers
/// included: they must not be reused either).
fn v1_13_fields(message: &str) -> BTreeSet<u32> {
    let n: &[u32] = match message {
        "NodePublishVolumeRequest" => &[1, 2, 3, 4, 5, 6, 7, 8],
        "NodeUnpublishVolumeRequest" => &[1, 2],
        "NodeGetVolumeStatsRequest" => &[1, 2, 3],
        "NodeExpandVolumeRequest" => &[1, 2, 3, 4, 5, 6],
        "VolumeCapability.MountVolume" => &[1, 2, 3],
        "NodeGetInfoResponse" => &[1, 2, 3],
        other => panic!("no v1.13 table for {other}"),
    };
    n.iter().copied().collect()
}

/// NodeServiceCapability.RPC.Type values of v1.13.0 (4 is reserved).
const V1_13_NODE_CAPS: &[i32] = &[0, 1, 2, 3, 4, 5, 6, 7, 8];
/// ControllerServiceCapability.RPC.Type values of v1.13.0 (11 reserved).
const V1_13_CONTROLLER_CAPS: std::ops::RangeInclusive<i32> = 0..=17;

#[test]
fn kep_numbers_collide_with_no_released_field_or_value() {
    for (message, field, _, ours) in crust_proto::kep2857::FIELDS {
        assert!(
            !v1_13_fields(message).contains(ours),
            "{message}.{field} = {ours} is a v1.13 field number"
        );
    }
    for (name, _, value) in crust_proto::kep2857::NODE_CAPABILITIES {
        assert!(
            !V1_13_NODE_CAPS.contains(value) && !V1_13_CONTROLLER_CAPS.contains(value),
            "{name} = {value} is a released capability value"
        );
    }
}

/// The generated code puts each KEP field on the number the table says:
/// a message with only that field set encodes as that tag.
#[test]
fn kep_table_matches_the_generated_code() {
    fn tag_of(bytes: &[u8]) -> u32 {
        let mut b = bytes;
        (prost::encoding::decode_varint(&mut b).expect("a key") >> 3) as u32
    }
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "NodePublishVolumeRequest",
            ours::NodePublishVolumeRequest {
                defer_fs_ops: true,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "NodeUnpublishVolumeRequest",
            ours::NodeUnpublishVolumeRequest {
                defer_fs_ops: true,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "NodeGetVolumeStatsRequest",
            ours::NodeGetVolumeStatsRequest {
                defer_fs_ops: true,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "NodeExpandVolumeRequest",
            ours::NodeExpandVolumeRequest {
                defer_fs_ops: true,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "NodeGetInfoResponse",
            ours::NodeGetInfoResponse {
                supported_file_systems: vec!["ext4".into()],
                ..Default::default()
            }
            .encode_to_vec(),
        ),
    ];
    for (message, bytes) in cases {
        let (_, field, _, number) = crust_proto::kep2857::FIELDS
            .iter()
            .find(|(m, ..)| *m == message)
            .expect("in the table");
        assert_eq!(tag_of(&bytes), *number, "{message}.{field}");
    }
    let mv = |group: &str, policy: &str| {
        ours::volume_capability::MountVolume {
            volume_supplemental_group: group.into(),
            volume_supplemental_group_change_policy: policy.into(),
            ..Default::default()
        }
        .encode_to_vec()
    };
    assert_eq!(tag_of(&mv("2000", "")), 4);
    assert_eq!(tag_of(&mv("", "Always")), 5);
}

// ---- NodeGetVolumeStatsResponse in both generations ----

#[derive(Clone, PartialEq, prost::Message)]
struct StockUsage {
    #[prost(int64, tag = "1")]
    available: i64,
    #[prost(int64, tag = "2")]
    total: i64,
    #[prost(int64, tag = "3")]
    used: i64,
    #[prost(int32, tag = "4")]
    unit: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StockCondition {
    #[prost(bool, tag = "1")]
    abnormal: bool,
    #[prost(string, tag = "2")]
    message: String,
}

/// v1.12.0: `usage = 1`, `volume_condition = 2`.
#[derive(Clone, PartialEq, prost::Message)]
struct StatsV1_12 {
    #[prost(message, repeated, tag = "1")]
    usage: Vec<StockUsage>,
    #[prost(message, optional, tag = "2")]
    volume_condition: Option<StockCondition>,
}

/// v1.13.0: `usage = 1`, `reserved 2`.
#[derive(Clone, PartialEq, prost::Message)]
struct StatsV1_13 {
    #[prost(message, repeated, tag = "1")]
    usage: Vec<StockUsage>,
}

#[test]
fn stats_answers_decode_in_both_generations() {
    let answer = ours::NodeGetVolumeStatsResponse {
        usage: vec![ours::VolumeUsage {
            available: 10,
            total: 30,
            used: 20,
            unit: ours::volume_usage::Unit::Bytes as i32,
        }],
        volume_condition: Some(ours::VolumeCondition {
            abnormal: true,
            message: "read-only".into(),
        }),
    };
    let bytes = answer.encode_to_vec();
    let old = StatsV1_12::decode(bytes.as_slice()).unwrap();
    assert_eq!(old.usage[0].total, 30);
    let c = old.volume_condition.expect("v1.12 reads the condition");
    assert!(c.abnormal);
    assert_eq!(c.message, "read-only");
    let new = StatsV1_13::decode(bytes.as_slice()).unwrap();
    assert_eq!(new.usage, old.usage, "v1.13 skips reserved field 2");
    // What crust sends in mode 1.13 has no field 2 at all.
    let v13_only = ours::NodeGetVolumeStatsResponse {
        volume_condition: None,
        ..answer
    }
    .encode_to_vec();
    assert_eq!(v13_only, new.encode_to_vec());
}

// ---- ListVolumes / ControllerGetVolume status in both generations ----

#[derive(Clone, PartialEq, prost::Message)]
struct StatusV1_12 {
    #[prost(string, repeated, tag = "1")]
    published_node_ids: Vec<String>,
    #[prost(message, optional, tag = "2")]
    volume_condition: Option<StockCondition>,
}

#[test]
fn volume_status_decodes_in_both_generations() {
    let ours_status = ours::controller_get_volume_response::VolumeStatus {
        published_node_ids: vec!["n1".into()],
        volume_condition: Some(ours::VolumeCondition {
            abnormal: false,
            message: "volume is healthy".into(),
        }),
    };
    let old = StatusV1_12::decode(ours_status.encode_to_vec().as_slice()).unwrap();
    assert_eq!(old.published_node_ids, ["n1"]);
    assert_eq!(old.volume_condition.unwrap().message, "volume is healthy");
    let list_status = ours::list_volumes_response::VolumeStatus {
        published_node_ids: vec![],
        volume_condition: Some(ours::VolumeCondition {
            abnormal: true,
            message: "gone".into(),
        }),
    };
    let old = StatusV1_12::decode(list_status.encode_to_vec().as_slice()).unwrap();
    assert!(old.volume_condition.unwrap().abnormal);
}

// ---- the v1.13 health messages ----

#[derive(Clone, PartialEq, prost::Message)]
struct StockHealthEntry {
    #[prost(int32, tag = "1")]
    status: i32,
    #[prost(string, tag = "2")]
    reason: String,
    #[prost(string, tag = "3")]
    message: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StockVolumeHealth {
    #[prost(string, tag = "1")]
    volume_id: String,
    #[prost(message, repeated, tag = "2")]
    health_statuses: Vec<StockHealthEntry>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StockListHealthResponse {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<StockVolumeHealth>,
    #[prost(string, tag = "2")]
    next_token: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StockBackendHealth {
    #[prost(int32, tag = "1")]
    status: i32,
    #[prost(string, tag = "2")]
    reason: String,
    #[prost(string, tag = "3")]
    message: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct StockStorageHealthResponse {
    #[prost(message, repeated, tag = "1")]
    backend_health: Vec<StockBackendHealth>,
}

#[test]
fn health_messages_have_the_v1_13_numbers() {
    use ours::VolumeHealthErrorType as V;
    assert_eq!(
        [
            V::UnknownVolumeHealthType,
            V::Degraded,
            V::Inaccessible,
            V::DataLoss
        ]
        .map(|v| v as i32),
        [0, 1, 2, 3]
    );
    use ours::StorageHealthErrorType as S;
    assert_eq!(
        [
            S::UnknownStorageHealthErrorType,
            S::StorageDegraded,
            S::StorageUnreachable
        ]
        .map(|v| v as i32),
        [0, 1, 2]
    );
    let list = ours::ControllerListVolumeHealthResponse {
        entries: vec![ours::VolumeHealth {
            volume_id: "vol-1".into(),
            health_statuses: vec![ours::volume_health::VolumeHealthEntry {
                status: V::DataLoss as i32,
                reason: "FilesystemErrors".into(),
                message: "ext4 recorded 3 errors".into(),
            }],
        }],
        next_token: "t".into(),
    };
    let stock = StockListHealthResponse::decode(list.encode_to_vec().as_slice()).unwrap();
    assert_eq!(stock.next_token, "t");
    assert_eq!(stock.entries[0].volume_id, "vol-1");
    assert_eq!(stock.entries[0].health_statuses[0].status, 3);
    assert_eq!(
        stock.entries[0].health_statuses[0].reason,
        "FilesystemErrors"
    );
    let storage = ours::NodeGetStorageHealthResponse {
        backend_health: vec![
            ours::node_get_storage_health_response::StorageBackendHealth {
                status: S::StorageUnreachable as i32,
                reason: "PoolUnavailable".into(),
                message: "gone".into(),
                volume_capability: None,
            },
        ],
    };
    let stock = StockStorageHealthResponse::decode(storage.encode_to_vec().as_slice()).unwrap();
    assert_eq!(stock.backend_health[0].status, 2);
    assert_eq!(stock.backend_health[0].reason, "PoolUnavailable");
}

/// Requests of a v1.13 CO (hand-built with the released numbers) arrive
/// intact.
#[test]
fn v1_13_health_requests_decode() {
    #[derive(Clone, PartialEq, prost::Message)]
    struct NodeGetVolumeHealthRequest {
        #[prost(string, tag = "1")]
        volume_id: String,
        #[prost(string, tag = "2")]
        volume_publish_path: String,
        #[prost(string, tag = "3")]
        staging_target_path: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct ControllerListVolumeHealthRequest {
        #[prost(int32, tag = "1")]
        max_entries: i32,
        #[prost(string, tag = "2")]
        starting_token: String,
        #[prost(map = "string, string", tag = "3")]
        secrets: HashMap<String, String>,
    }
    let r = ours::NodeGetVolumeHealthRequest::decode(
        NodeGetVolumeHealthRequest {
            volume_id: "v".into(),
            volume_publish_path: "/p".into(),
            staging_target_path: "/s".into(),
        }
        .encode_to_vec()
        .as_slice(),
    )
    .unwrap();
    assert_eq!(
        (
            r.volume_id.as_str(),
            r.volume_publish_path.as_str(),
            r.staging_target_path.as_str()
        ),
        ("v", "/p", "/s")
    );
    let r = ours::ControllerListVolumeHealthRequest::decode(
        ControllerListVolumeHealthRequest {
            max_entries: 5,
            starting_token: "tok".into(),
            secrets: HashMap::from([("k".into(), "v".into())]),
        }
        .encode_to_vec()
        .as_slice(),
    )
    .unwrap();
    assert_eq!((r.max_entries, r.starting_token.as_str()), (5, "tok"));
    assert_eq!(r.secrets.get("k").map(String::as_str), Some("v"));
}
