//! Conformance suite written from the CSI spec, against the real
//! `crust-csi` binary (pool backend in a tempdir, real loop devices,
//! mounts and a unix socket). Every call is repeated to prove idempotency;
//! every error path checks that nothing on the node changed.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::{BTreeSet, HashMap};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;

use common::*;
use crust_proto::csi::v1 as csi;
use csi::volume_capability::access_mode::Mode;
use tonic::Code;

fn img_files(pool: &Path) -> Vec<String> {
    std::fs::read_dir(pool)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".img"))
                .collect()
        })
        .unwrap_or_default()
}

fn record_files(state: &Path) -> Vec<String> {
    std::fs::read_dir(state.join("volumes"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".json"))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_info_capabilities_and_probe() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    for _ in 0..2 {
        let info =
            c.id.get_plugin_info(csi::GetPluginInfoRequest {})
                .await
                .unwrap()
                .into_inner();
        assert_eq!(info.name, "blk.crust.dev");
        assert_eq!(info.vendor_version, env!("CARGO_PKG_VERSION"));
        assert_eq!(
            info.manifest.get("backend").map(String::as_str),
            Some("pool")
        );

        let caps =
            c.id.get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
                .await
                .unwrap()
                .into_inner()
                .capabilities;
        use csi::plugin_capability::{Type, service, volume_expansion};
        let services: BTreeSet<i32> = caps
            .iter()
            .filter_map(|c| match &c.r#type {
                Some(Type::Service(s)) => Some(s.r#type),
                _ => None,
            })
            .collect();
        assert_eq!(
            services,
            BTreeSet::from([
                service::Type::ControllerService as i32,
                service::Type::VolumeAccessibilityConstraints as i32,
                // the pool snapshots: group snapshots, node-local snapshots
                service::Type::GroupControllerService as i32,
                service::Type::SnapshotAccessibilityConstraints as i32,
            ])
        );
        assert!(caps.iter().any(|c| matches!(&c.r#type,
            Some(Type::VolumeExpansion(v)) if v.r#type == volume_expansion::Type::Online as i32)));

        let probe = c.id.probe(csi::ProbeRequest {}).await.unwrap().into_inner();
        assert_eq!(probe.ready, Some(true));
    }
    // The backend really is checked: without its pool directory the
    // plugin is not ready and says why.
    let moved = node.path("pool-moved");
    std::fs::rename(&node.pool, &moved).unwrap();
    let s = assert_code(
        c.id.probe(csi::ProbeRequest {}).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("pool directory"), "{}", s.message());
    std::fs::rename(&moved, &node.pool).unwrap();
    assert_eq!(
        c.id.probe(csi::ProbeRequest {})
            .await
            .unwrap()
            .into_inner()
            .ready,
        Some(true)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_node_info_and_unimplemented_rpcs() {
    let node = TestNode::with_args(&["--pool-capacity", "1Gi", "--max-volumes-per-node", "17"]);
    let mut c = node.clients().await;
    use csi::controller_service_capability::rpc::Type as C;
    let ctl: BTreeSet<i32> = c
        .ctl
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| {
            c.r#type
                .map(|csi::controller_service_capability::Type::Rpc(r)| r.r#type)
        })
        .collect();
    let want: BTreeSet<i32> = [
        C::CreateDeleteVolume,
        C::ListVolumes,
        C::GetCapacity,
        C::ExpandVolume,
        C::ListVolumesPublishedNodes,
        C::VolumeCondition,
        C::GetVolume,
        C::SingleNodeMultiWriter,
        C::ModifyVolume,
        C::GetVolumeHealth,
        C::ListVolumeHealth,
        C::CreateDeleteSnapshot,
        C::ListSnapshots,
        C::GetSnapshot,
        C::CloneVolume,
    ]
    .into_iter()
    .map(|t| t as i32)
    .collect();
    assert_eq!(
        ctl, want,
        "--csi-spec both: both generations' health; the pool snapshots and clones"
    );

    use csi::node_service_capability::rpc::Type as N;
    let nodecaps: BTreeSet<i32> = c
        .node
        .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| {
            c.r#type
                .map(|csi::node_service_capability::Type::Rpc(r)| r.r#type)
        })
        .collect();
    let want: BTreeSet<i32> = [
        N::StageUnstageVolume,
        N::GetVolumeStats,
        N::ExpandVolume,
        N::VolumeCondition,
        N::SingleNodeMultiWriter,
        N::GetVolumeHealth,
        N::GetStorageHealth,
        N::VolumeMountGroup,
    ]
    .into_iter()
    .map(|t| t as i32)
    .collect();
    assert_eq!(nodecaps, want, "DEFER_FS_OPS must not be advertised");

    let info = c
        .node
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, NODE);
    assert_eq!(info.max_volumes_per_node, 17);
    assert_eq!(
        info.accessible_topology.unwrap().segments,
        HashMap::from([(TOPO_KEY.to_string(), NODE.to_string())])
    );

    let u = Code::Unimplemented;
    assert_code(
        c.ctl
            .controller_publish_volume(csi::ControllerPublishVolumeRequest::default())
            .await,
        u,
    );
    assert_code(
        c.ctl
            .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest::default())
            .await,
        u,
    );
    // Snapshots are served (the pool copies): empty requests are refused
    // as the spec says, not UNIMPLEMENTED.
    let ia = Code::InvalidArgument;
    assert_code(
        c.ctl
            .create_snapshot(csi::CreateSnapshotRequest::default())
            .await,
        ia,
    );
    assert_code(
        c.ctl
            .delete_snapshot(csi::DeleteSnapshotRequest::default())
            .await,
        ia,
    );
    assert!(
        c.ctl
            .list_snapshots(csi::ListSnapshotsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries
            .is_empty()
    );
    assert_code(
        c.ctl.get_snapshot(csi::GetSnapshotRequest::default()).await,
        ia,
    );
    assert_code(
        c.ctl
            .controller_modify_volume(csi::ControllerModifyVolumeRequest::default())
            .await,
        ia,
    );
    let ch = node
        .plugin
        .as_ref()
        .unwrap()
        .endpoint
        .connect()
        .await
        .unwrap();
    let mut group = csi::group_controller_client::GroupControllerClient::new(ch);
    let caps = group
        .group_controller_get_capabilities(csi::GroupControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    use csi::group_controller_service_capability::{Type as G, rpc::Type as GR};
    assert!(matches!(
        caps.as_slice(),
        [csi::GroupControllerServiceCapability { r#type: Some(G::Rpc(r)) }]
            if r.r#type == GR::CreateDeleteGetVolumeGroupSnapshot as i32
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_volume_arguments_sizes_and_idempotency() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let ext4 = || vec![mount("ext4")];
    let ia = Code::InvalidArgument;

    // --- bad requests: each refused, nothing created ---
    assert_code(c.create(create_req("", MIB, ext4())).await, ia);
    assert_code(
        c.create(create_req(&"n".repeat(129), MIB, ext4())).await,
        ia,
    );
    assert_code(c.create(create_req("bad\u{7}name", MIB, ext4())).await, ia);
    assert_code(c.create(create_req("no-caps", MIB, vec![])).await, ia);
    let mut no_access = mount("ext4");
    no_access.access_type = None;
    assert_code(
        c.create(create_req("no-access", MIB, vec![no_access]))
            .await,
        ia,
    );
    let s = assert_code(
        c.create(create_req(
            "multi",
            MIB,
            vec![mount_mode("ext4", Mode::MultiNodeMultiWriter)],
        ))
        .await,
        ia,
    );
    assert!(
        s.message().contains("MULTI_NODE_MULTI_WRITER"),
        "{}",
        s.message()
    );
    assert_code(
        c.create(create_req("btrfs", MIB, vec![mount("btrfs")]))
            .await,
        ia,
    );
    let mut r = create_req("param-fs", MIB, ext4());
    r.parameters.insert("fsType".into(), "btrfs".into());
    assert_code(c.create(r).await, ia);
    let mut r = create_req("param-unknown", MIB, ext4());
    r.parameters.insert("replicas".into(), "3".into());
    let s = assert_code(c.create(r).await, ia);
    assert!(s.message().contains("replicas"), "{}", s.message());
    let mut r = create_req("conflict", MIB, vec![mount("xfs")]);
    r.parameters.insert("fsType".into(), "ext4".into());
    assert_code(c.create(r).await, ia);
    let mut r = create_req("snap", MIB, ext4());
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(
            csi::volume_content_source::SnapshotSource {
                snapshot_id: "s1".into(),
            },
        )),
    });
    // An unknown source: NOT_FOUND (the spec's "source does not exist").
    let s = assert_code(c.create(r).await, Code::NotFound);
    assert!(s.message().contains("snapshot"), "{}", s.message());
    let mut r = create_req("range", 10 * MIB, ext4());
    r.capacity_range.as_mut().unwrap().limit_bytes = 5 * MIB;
    assert_code(c.create(r).await, ia);
    let mut r = create_req("negative", -1, ext4());
    r.capacity_range.as_mut().unwrap().required_bytes = -1;
    assert_code(c.create(r).await, ia);
    let mut r = create_req("defer", MIB, ext4());
    r.parameters.insert("deferFsOps".into(), "true".into());
    let s = assert_code(c.create(r).await, ia);
    assert!(
        s.message().contains("deferral not supported"),
        "{}",
        s.message()
    );
    // sizes the backend cannot do
    let mut r = create_req("odd", 1000, ext4());
    r.capacity_range.as_mut().unwrap().limit_bytes = 1000;
    assert_code(c.create(r).await, Code::OutOfRange);
    let mut r = create_req("tiny-xfs", MIB, vec![mount("xfs")]);
    r.capacity_range.as_mut().unwrap().limit_bytes = 100 * MIB;
    let s = assert_code(c.create(r).await, Code::OutOfRange);
    assert!(s.message().contains("smallest"), "{}", s.message());
    assert_code(
        c.create(create_req("huge", 100 * GIB, ext4())).await,
        Code::ResourceExhausted,
    );
    // topology: only this node can hold the volume
    let mut r = create_req("elsewhere", MIB, ext4());
    r.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![csi::Topology {
            segments: HashMap::from([(TOPO_KEY.into(), "other-node".into())]),
        }],
        preferred: vec![],
    });
    assert_code(c.create(r).await, Code::ResourceExhausted);
    assert!(c.list_all().await.is_empty());
    assert!(
        img_files(&node.pool).is_empty(),
        "{:?}",
        img_files(&node.pool)
    );
    assert!(
        record_files(&node.state).is_empty(),
        "{:?}",
        record_files(&node.state)
    );

    // --- success and idempotency ---
    let mut req = create_req("pvc-a", 64 * MIB, ext4());
    req.parameters
        .insert("csi.storage.k8s.io/pvc/name".into(), "data".into());
    req.parameters
        .insert("csi.storage.k8s.io/pvc/namespace".into(), "default".into());
    req.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![
            csi::Topology {
                segments: HashMap::from([(TOPO_KEY.into(), "other-node".into())]),
            },
            csi::Topology {
                segments: HashMap::from([(TOPO_KEY.into(), NODE.into())]),
            },
        ],
        preferred: vec![],
    });
    let v = c.create(req.clone()).await.unwrap();
    assert_eq!(v.capacity_bytes, 64 * MIB);
    assert!(
        v.volume_id.starts_with("vol-") && v.volume_id.len() == 36,
        "{}",
        v.volume_id
    );
    assert_eq!(
        v.volume_context.get("fsType").map(String::as_str),
        Some("ext4")
    );
    assert_eq!(
        v.accessible_topology,
        vec![csi::Topology {
            segments: HashMap::from([(TOPO_KEY.into(), NODE.into())])
        }]
    );
    assert_eq!(
        c.create(req.clone()).await.unwrap(),
        v,
        "repeat is idempotent"
    );
    let mut wider = req.clone();
    wider.capacity_range = Some(csi::CapacityRange {
        required_bytes: 32 * MIB,
        limit_bytes: 128 * MIB,
    });
    assert_eq!(
        c.create(wider).await.unwrap(),
        v,
        "existing size within the new range"
    );
    let mut bigger = req.clone();
    bigger.capacity_range.as_mut().unwrap().required_bytes = 128 * MIB;
    assert_code(c.create(bigger).await, Code::AlreadyExists);
    let mut smaller = req.clone();
    smaller.capacity_range = Some(csi::CapacityRange {
        required_bytes: MIB,
        limit_bytes: 32 * MIB,
    });
    assert_code(c.create(smaller).await, Code::AlreadyExists);
    let mut xfs = req.clone();
    xfs.volume_capabilities = vec![mount("xfs")];
    assert_code(c.create(xfs).await, Code::AlreadyExists);
    let mut blk = req.clone();
    blk.volume_capabilities = vec![block()];
    assert_code(c.create(blk).await, Code::AlreadyExists);
    let mut param = req.clone();
    param.parameters.insert("fsType".into(), "ext4".into());
    assert_code(c.create(param).await, Code::AlreadyExists);
    assert_eq!(c.list_all().await.len(), 1);
    assert_eq!(img_files(&node.pool).len(), 1);

    // default size, limit-only, alignment
    let d = c
        .create(csi::CreateVolumeRequest {
            name: "default-size".into(),
            volume_capabilities: ext4(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(d.capacity_bytes, GIB, "documented default: 1 GiB");
    let mut lim = create_req("limit-only", 0, ext4());
    lim.capacity_range = Some(csi::CapacityRange {
        required_bytes: 0,
        limit_bytes: 100 * MIB,
    });
    assert_eq!(c.create(lim).await.unwrap().capacity_bytes, 100 * MIB);
    let odd = c
        .create(create_req("unaligned", MIB + 1, ext4()))
        .await
        .unwrap();
    assert_eq!(odd.capacity_bytes, MIB + 4096);
    let x = c
        .create(create_req("xfs-default-min", MIB, vec![mount("xfs")]))
        .await
        .unwrap();
    assert_eq!(x.capacity_bytes, 300 * MIB, "raised to the xfs minimum");
    assert_eq!(
        x.volume_context.get("fsType").map(String::as_str),
        Some("xfs")
    );
    let name128 = "n".repeat(128);
    let long = c.create(create_req(&name128, MIB, ext4())).await.unwrap();

    for id in [
        &v.volume_id,
        &d.volume_id,
        &odd.volume_id,
        &x.volume_id,
        &long.volume_id,
    ] {
        c.delete(id).await.unwrap();
        c.delete(id).await.unwrap();
    }
    let rest: Vec<String> = c
        .list_all()
        .await
        .into_iter()
        .map(|e| e.volume.unwrap().volume_id)
        .collect();
    for id in rest {
        c.delete(&id).await.unwrap();
    }
    assert!(img_files(&node.pool).is_empty());
    assert!(record_files(&node.state).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_validate_get_list_capacity_and_expand() {
    let node = TestNode::with_args(&["--pool-capacity", "4Gi"]);
    let mut c = node.clients().await;
    let v = c
        .create(create_req("vol", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id.clone();
    let unknown = crust_csi::volume_id_for("never-created");

    // DeleteVolume
    assert_code(c.delete("").await, Code::InvalidArgument);
    c.delete(&unknown).await.unwrap();
    c.delete("../../etc/passwd").await.unwrap();

    // ValidateVolumeCapabilities
    let validate =
        |caps: Vec<csi::VolumeCapability>, vid: &str| csi::ValidateVolumeCapabilitiesRequest {
            volume_id: vid.into(),
            volume_capabilities: caps,
            ..Default::default()
        };
    assert_code(
        c.ctl
            .validate_volume_capabilities(validate(vec![mount("ext4")], ""))
            .await,
        Code::InvalidArgument,
    );
    assert_code(
        c.ctl
            .validate_volume_capabilities(validate(vec![], &id))
            .await,
        Code::InvalidArgument,
    );
    assert_code(
        c.ctl
            .validate_volume_capabilities(validate(vec![mount("ext4")], &unknown))
            .await,
        Code::NotFound,
    );
    for caps in [
        vec![mount("ext4")],
        vec![mount("")],
        vec![
            mount_mode("ext4", Mode::SingleNodeMultiWriter),
            mount_mode("", Mode::SingleNodeReaderOnly),
        ],
        vec![mount_mode("ext4", Mode::SingleNodeSingleWriter)],
    ] {
        let r = c
            .ctl
            .validate_volume_capabilities(validate(caps.clone(), &id))
            .await
            .unwrap()
            .into_inner();
        let confirmed = r
            .confirmed
            .unwrap_or_else(|| panic!("not confirmed: {}", r.message));
        assert_eq!(confirmed.volume_capabilities, caps);
    }
    for caps in [
        vec![mount_mode("ext4", Mode::MultiNodeReaderOnly)],
        vec![mount("xfs")],
        vec![block()],
        vec![
            mount("ext4"),
            mount_mode("ext4", Mode::MultiNodeMultiWriter),
        ],
    ] {
        let r = c
            .ctl
            .validate_volume_capabilities(validate(caps, &id))
            .await
            .unwrap()
            .into_inner();
        assert!(r.confirmed.is_none());
        assert!(!r.message.is_empty());
    }

    // ControllerGetVolume
    assert_code(c.get("").await, Code::InvalidArgument);
    assert_code(c.get(&unknown).await, Code::NotFound);
    let g = c.get(&id).await.unwrap();
    assert_eq!(g.volume.as_ref().unwrap(), &v);
    let st = g.status.unwrap();
    assert!(st.published_node_ids.is_empty());
    let cond = st.volume_condition.unwrap();
    assert!(!cond.abnormal, "{}", cond.message);

    // ListVolumes basics
    assert_code(
        c.ctl
            .list_volumes(csi::ListVolumesRequest {
                max_entries: -1,
                starting_token: String::new(),
            })
            .await,
        Code::InvalidArgument,
    );
    for token in ["not base64 !", "dm9sLXh4eA", "AAAA"] {
        assert_code(
            c.ctl
                .list_volumes(csi::ListVolumesRequest {
                    max_entries: 0,
                    starting_token: token.into(),
                })
                .await,
            Code::Aborted,
        );
    }
    let all = c.list_all().await;
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].volume.as_ref().unwrap(), &v);
    assert!(
        !all[0]
            .status
            .as_ref()
            .unwrap()
            .volume_condition
            .as_ref()
            .unwrap()
            .abnormal
    );

    // GetCapacity
    let cap = |req: csi::GetCapacityRequest| {
        let mut ctl = c.ctl.clone();
        async move { ctl.get_capacity(req).await }
    };
    let base = cap(csi::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(base.available_capacity, 4 * GIB - 64 * MIB);
    assert_eq!(base.maximum_volume_size, Some(4 * GIB - 64 * MIB));
    assert_eq!(base.minimum_volume_size, Some(MIB));
    let here = csi::Topology {
        segments: HashMap::from([(TOPO_KEY.into(), NODE.into())]),
    };
    let there = csi::Topology {
        segments: HashMap::from([(TOPO_KEY.into(), "elsewhere".into())]),
    };
    let r = cap(csi::GetCapacityRequest {
        accessible_topology: Some(here),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner();
    assert_eq!(r.available_capacity, base.available_capacity);
    let r = cap(csi::GetCapacityRequest {
        accessible_topology: Some(there),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner();
    assert_eq!(r.available_capacity, 0);
    let r = cap(csi::GetCapacityRequest {
        volume_capabilities: vec![mount_mode("ext4", Mode::MultiNodeMultiWriter)],
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner();
    assert_eq!(
        r.available_capacity, 0,
        "unsupported capability: no capacity for it"
    );
    let r = cap(csi::GetCapacityRequest {
        parameters: HashMap::from([("fsType".into(), "xfs".into())]),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner();
    assert_eq!(r.minimum_volume_size, Some(300 * MIB));
    assert_code(
        cap(csi::GetCapacityRequest {
            parameters: HashMap::from([("nope".into(), "1".into())]),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
    );

    // ControllerExpandVolume
    let expand = |vid: &str, req: i64, lim: i64| csi::ControllerExpandVolumeRequest {
        volume_id: vid.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: req,
            limit_bytes: lim,
        }),
        ..Default::default()
    };
    assert_code(
        c.ctl.controller_expand_volume(expand("", MIB, 0)).await,
        Code::InvalidArgument,
    );
    assert_code(
        c.ctl
            .controller_expand_volume(expand(&unknown, 128 * MIB, 0))
            .await,
        Code::NotFound,
    );
    let mut no_range = expand(&id, 0, 0);
    no_range.capacity_range = None;
    assert_code(
        c.ctl.controller_expand_volume(no_range).await,
        Code::InvalidArgument,
    );
    assert_code(
        c.ctl
            .controller_expand_volume(expand(&id, 256 * MIB, 128 * MIB))
            .await,
        Code::InvalidArgument,
    );
    for _ in 0..2 {
        let r = c
            .ctl
            .controller_expand_volume(expand(&id, 128 * MIB, 0))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.capacity_bytes, 128 * MIB);
        assert!(r.node_expansion_required);
    }
    let img = node.pool.join(format!("{id}.img"));
    assert_eq!(
        std::fs::metadata(&img).unwrap().len(),
        128 << 20,
        "backing file grown"
    );
    let r = c
        .ctl
        .controller_expand_volume(expand(&id, 32 * MIB, 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 128 * MIB, "smaller request is a no-op");
    assert_code(
        c.ctl
            .controller_expand_volume(expand(&id, 32 * MIB, 64 * MIB))
            .await,
        Code::OutOfRange,
    );
    assert_code(
        c.ctl
            .controller_expand_volume(expand(&id, 64 * GIB, 0))
            .await,
        Code::ResourceExhausted,
    );
    assert_eq!(
        c.get(&id).await.unwrap().volume.unwrap().capacity_bytes,
        128 * MIB
    );
    let b = c
        .create(create_req("blockvol", 8 * MIB, vec![block()]))
        .await
        .unwrap();
    let r = c
        .ctl
        .controller_expand_volume(expand(&b.volume_id, 16 * MIB, 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 16 * MIB);
    assert!(
        !r.node_expansion_required,
        "raw block needs no node expansion"
    );

    for vid in [&id, &b.volume_id] {
        c.delete(vid).await.unwrap();
        c.delete(vid).await.unwrap();
        assert_code(c.get(vid).await, Code::NotFound);
    }
    assert!(img_files(&node.pool).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_filesystem_lifecycle_and_errors() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let v = c
        .create(create_req(
            "fsvol",
            64 * MIB,
            vec![
                mount("ext4"),
                mount_mode("ext4", Mode::SingleNodeMultiWriter),
            ],
        ))
        .await
        .unwrap();
    let id = v.volume_id.clone();
    let other = c
        .create(create_req("other", 16 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let staging = node.mkdir("kubelet/staging/fsvol");
    let unknown = crust_csi::volume_id_for("nope");
    let untouched = |n: &TestNode| {
        assert!(
            loops_under(n.dir.path()).is_empty(),
            "loop devices left: {:?}",
            loops_under(n.dir.path())
        );
        assert!(
            mounts_under(n.dir.path()).is_empty(),
            "mounts left: {:?}",
            mounts_under(n.dir.path())
        );
    };

    // --- NodeStageVolume errors change nothing ---
    let ia = Code::InvalidArgument;
    assert_code(c.stage("", &staging, mount("ext4")).await, ia);
    assert_code(c.stage(&id, "", mount("ext4")).await, ia);
    assert_code(c.stage(&id, "relative/path", mount("ext4")).await, ia);
    assert_code(
        c.stage(&id, &format!("{staging}/../x"), mount("ext4"))
            .await,
        ia,
    );
    assert_code(
        c.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: staging.clone(),
                ..Default::default()
            })
            .await,
        ia,
    );
    assert_code(
        c.stage(
            &id,
            &staging,
            mount_mode("ext4", Mode::MultiNodeMultiWriter),
        )
        .await,
        ia,
    );
    assert_code(c.stage(&id, &staging, mount("vfat")).await, ia);
    let mut bad_flags = mount("ext4");
    if let Some(csi::volume_capability::AccessType::Mount(m)) = bad_flags.access_type.as_mut() {
        m.mount_flags = vec!["errors=panic".into()];
    }
    assert_code(c.stage(&id, &staging, bad_flags).await, ia);
    assert_code(
        c.stage(&unknown, &staging, mount("ext4")).await,
        Code::NotFound,
    );
    let missing = node.path("kubelet/staging/missing");
    let s = assert_code(
        c.stage(&id, missing.to_str().unwrap(), mount("ext4")).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("does not exist"), "{}", s.message());
    assert!(!missing.exists());
    let file = node.path("kubelet/staging/a-file");
    std::fs::write(&file, b"x").unwrap();
    assert_code(
        c.stage(&id, file.to_str().unwrap(), mount("ext4")).await,
        Code::FailedPrecondition,
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    assert_code(
        c.stage(&id, &staging, mount("xfs")).await,
        Code::FailedPrecondition,
    );
    assert_code(
        c.stage(&id, &staging, block()).await,
        Code::FailedPrecondition,
    );
    let mut ctx_defer = csi::NodeStageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.clone(),
        volume_capability: Some(mount("ext4")),
        ..Default::default()
    };
    ctx_defer
        .volume_context
        .insert("deferFsOps".into(), "true".into());
    let s = assert_code(
        c.node.node_stage_volume(ctx_defer).await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message().contains("deferral not supported"),
        "{}",
        s.message()
    );
    untouched(&node);

    // --- stage, repeatedly ---
    for _ in 0..2 {
        c.stage(&id, &staging, mount("ext4")).await.unwrap();
    }
    let loops = loops_under(node.dir.path());
    assert_eq!(loops.len(), 1, "{loops:?}");
    let m = crust_blockdev::find_mount(Path::new(&staging))
        .unwrap()
        .expect("staged mount");
    assert_eq!(m.fs_type, "ext4");
    assert_eq!(m.source, loops[0].path.to_str().unwrap());
    let staging2 = node.mkdir("kubelet/staging/elsewhere");
    assert_code(
        c.stage(&id, &staging2, mount("ext4")).await,
        Code::FailedPrecondition,
    );
    assert_code(
        c.stage(
            &id,
            &staging,
            mount_mode("ext4", Mode::SingleNodeMultiWriter),
        )
        .await,
        Code::AlreadyExists,
    );
    assert_code(c.delete(&id).await, Code::FailedPrecondition);

    // --- NodePublishVolume errors change nothing ---
    let pods = node.mkdir("kubelet/pods");
    let t1 = format!("{pods}/t1");
    assert_code(c.publish(&id, "", &t1, mount("ext4"), false).await, ia);
    assert_code(c.publish(&id, &staging, "", mount("ext4"), false).await, ia);
    assert_code(
        c.publish(&id, &staging, "pods/t1", mount("ext4"), false)
            .await,
        ia,
    );
    assert_code(
        c.publish(
            &id,
            &staging,
            &format!("{staging}/inside"),
            mount("ext4"),
            false,
        )
        .await,
        ia,
    );
    assert_code(
        c.publish(&unknown, &staging, &t1, mount("ext4"), false)
            .await,
        Code::NotFound,
    );
    assert_code(
        c.publish(&other.volume_id, &staging, &t1, mount("ext4"), false)
            .await,
        Code::FailedPrecondition,
    );
    assert_code(
        c.publish(&id, &staging2, &t1, mount("ext4"), false).await,
        Code::FailedPrecondition,
    );
    assert_code(
        c.publish(&id, &staging, &t1, block(), false).await,
        Code::FailedPrecondition,
    );
    let file_target = format!("{pods}/a-file");
    std::fs::write(&file_target, b"keep").unwrap();
    assert_code(
        c.publish(&id, &staging, &file_target, mount("ext4"), false)
            .await,
        Code::FailedPrecondition,
    );
    assert_eq!(std::fs::read(&file_target).unwrap(), b"keep");
    assert_code(
        c.publish(
            &id,
            &staging,
            &format!("{pods}/no/parent"),
            mount("ext4"),
            false,
        )
        .await,
        Code::FailedPrecondition,
    );
    let mut defer = csi::NodePublishVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.clone(),
        target_path: t1.clone(),
        volume_capability: Some(mount("ext4")),
        defer_fs_ops: true,
        ..Default::default()
    };
    let s = assert_code(
        c.node.node_publish_volume(defer.clone()).await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message()
            .contains("deferral not supported by this plugin configuration"),
        "{}",
        s.message()
    );
    defer.defer_fs_ops = false;
    defer
        .volume_context
        .insert("deferFsOps".into(), "true".into());
    assert_code(
        c.node.node_publish_volume(defer).await,
        Code::FailedPrecondition,
    );
    assert!(
        !Path::new(&t1).exists(),
        "no target created by failed publishes"
    );
    assert_eq!(
        mounts_under(node.dir.path()).len(),
        1,
        "only the staging mount"
    );

    // --- publish, repeatedly; several targets (SINGLE_NODE_MULTI_WRITER) ---
    let t2 = format!("{pods}/t2");
    let ro = format!("{pods}/ro");
    for _ in 0..2 {
        c.publish(&id, &staging, &t1, mount("ext4"), false)
            .await
            .unwrap();
    }
    std::fs::write(format!("{t1}/hello.txt"), b"hello").unwrap();
    c.publish(
        &id,
        &staging,
        &t2,
        mount_mode("ext4", Mode::SingleNodeMultiWriter),
        false,
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read(format!("{t2}/hello.txt")).unwrap(), b"hello");
    c.publish(&id, &staging, &ro, mount("ext4"), true)
        .await
        .unwrap();
    let err = std::fs::write(format!("{ro}/nope"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    assert_eq!(std::fs::read(format!("{ro}/hello.txt")).unwrap(), b"hello");
    assert_code(
        c.publish(&id, &staging, &t1, mount("ext4"), true).await,
        Code::AlreadyExists,
    );
    assert_code(
        c.publish(
            &id,
            &staging,
            &t1,
            mount_mode("ext4", Mode::SingleNodeMultiWriter),
            false,
        )
        .await,
        Code::AlreadyExists,
    );

    // --- stats ---
    assert_code(c.stats("", &t1).await, ia);
    assert_code(c.stats(&id, "").await, ia);
    // A relative path is a path where the volume is not (error.rs).
    assert_code(c.stats(&id, "rel").await, Code::NotFound);
    assert_code(c.stats(&unknown, &t1).await, Code::NotFound);
    assert_code(
        c.stats(&id, &format!("{pods}/not-published")).await,
        Code::NotFound,
    );
    assert_code(
        c.node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: t1.clone(),
                defer_fs_ops: true,
                ..Default::default()
            })
            .await,
        Code::FailedPrecondition,
    );
    for path in [&t1, &t2, &ro, &staging] {
        let st = c.stats(&id, path).await.unwrap();
        let cond = st.volume_condition.unwrap();
        assert!(!cond.abnormal, "{}", cond.message);
        let bytes = st
            .usage
            .iter()
            .find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32)
            .unwrap();
        let inodes = st
            .usage
            .iter()
            .find(|u| u.unit == csi::volume_usage::Unit::Inodes as i32)
            .unwrap();
        let fs = crust_blockdev::usage(Path::new(path)).unwrap();
        assert_eq!(bytes.total as u64, fs.bytes_total);
        assert!(
            bytes.total > 40 * MIB && bytes.total <= 64 * MIB,
            "{bytes:?}"
        );
        assert!(
            bytes.used > 0 && bytes.available > 0 && bytes.used + bytes.available <= bytes.total
        );
        assert_eq!(inodes.total as u64, fs.inodes_total);
        assert!(inodes.used >= 11, "{inodes:?}");
    }
    let e = c
        .list_all()
        .await
        .into_iter()
        .find(|e| e.volume.as_ref().unwrap().volume_id == id)
        .unwrap();
    assert_eq!(e.status.unwrap().published_node_ids, vec![NODE.to_string()]);

    // --- unstage refused while published; unpublish ---
    assert_code(c.unstage(&id, &staging).await, Code::FailedPrecondition);
    assert_code(c.unpublish("", &t1).await, ia);
    assert_code(c.unpublish(&id, "").await, ia);
    assert_code(c.unpublish(&id, "rel/t").await, ia);
    assert_code(
        c.node
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: t1.clone(),
                defer_fs_ops: true,
            })
            .await,
        Code::FailedPrecondition,
    );
    for t in [&t1, &t2, &ro] {
        for _ in 0..2 {
            c.unpublish(&id, t).await.unwrap();
        }
        assert!(!Path::new(t).exists(), "target {t} removed");
    }
    c.unpublish(&unknown, &t1).await.unwrap();
    c.unpublish(&id, &format!("{pods}/never")).await.unwrap();

    // --- unstage ---
    assert_code(c.unstage("", &staging).await, ia);
    assert_code(c.unstage(&id, "").await, ia);
    assert_code(c.unstage(&unknown, &staging).await, Code::NotFound);
    assert_code(c.unstage(&id, &staging2).await, Code::FailedPrecondition);
    for _ in 0..2 {
        c.unstage(&id, &staging).await.unwrap();
    }
    untouched(&node);
    assert!(
        Path::new(&staging).is_dir(),
        "the CO's staging dir is left alone"
    );

    // data survives a restage; the filesystem is not recreated
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert_eq!(
        std::fs::read(format!("{staging}/hello.txt")).unwrap(),
        b"hello"
    );
    c.unstage(&id, &staging).await.unwrap();

    c.delete(&id).await.unwrap();
    c.delete(&other.volume_id).await.unwrap();
    untouched(&node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_target_access_modes_refuse_a_second_target() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let pods = node.mkdir("pods");
    for (i, mode) in [Mode::SingleNodeSingleWriter, Mode::SingleNodeReaderOnly]
        .into_iter()
        .enumerate()
    {
        let v = c
            .create(create_req(
                &format!("single-{i}"),
                16 * MIB,
                vec![mount_mode("ext4", mode)],
            ))
            .await
            .unwrap();
        let id = v.volume_id;
        let staging = node.mkdir(&format!("staging-{i}"));
        c.stage(&id, &staging, mount_mode("ext4", mode))
            .await
            .unwrap();
        let a = format!("{pods}/a{i}");
        let b = format!("{pods}/b{i}");
        c.publish(&id, &staging, &a, mount_mode("ext4", mode), false)
            .await
            .unwrap();
        c.publish(&id, &staging, &a, mount_mode("ext4", mode), false)
            .await
            .unwrap();
        let s = assert_code(
            c.publish(&id, &staging, &b, mount_mode("ext4", mode), false)
                .await,
            Code::FailedPrecondition,
        );
        assert!(
            s.message().contains("only one publish target"),
            "{}",
            s.message()
        );
        assert!(!Path::new(&b).exists());
        if mode == Mode::SingleNodeReaderOnly {
            let err = std::fs::write(format!("{a}/x"), b"x").unwrap_err();
            assert_eq!(
                err.raw_os_error(),
                Some(libc::EROFS),
                "reader-only is read-only"
            );
        } else {
            std::fs::write(format!("{a}/x"), b"x").unwrap();
        }
        c.unpublish(&id, &a).await.unwrap();
        // now the other target may take it
        c.publish(&id, &staging, &b, mount_mode("ext4", mode), false)
            .await
            .unwrap();
        c.unpublish(&id, &b).await.unwrap();
        c.unstage(&id, &staging).await.unwrap();
        c.delete(&id).await.unwrap();
    }
    assert!(loops_under(node.dir.path()).is_empty());
    assert!(mounts_under(node.dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_raw_block_lifecycle() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let v = c
        .create(create_req("blk", 10 * MIB, vec![block()]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/blk");
    let pods = node.mkdir("pods");
    assert_code(
        c.stage(&id, &staging, mount("ext4")).await,
        Code::FailedPrecondition,
    );
    for _ in 0..2 {
        c.stage(&id, &staging, block()).await.unwrap();
    }
    assert!(
        mounts_under(node.dir.path()).is_empty(),
        "block staging mounts nothing"
    );
    assert_eq!(loops_under(node.dir.path()).len(), 1);

    let dir_target = node.mkdir("pods/a-dir");
    assert_code(
        c.publish(&id, &staging, &dir_target, block(), false).await,
        Code::FailedPrecondition,
    );
    assert_code(
        c.publish(&id, &staging, &format!("{pods}/m"), mount("ext4"), false)
            .await,
        Code::FailedPrecondition,
    );

    let dev = format!("{pods}/dev");
    for _ in 0..2 {
        c.publish(&id, &staging, &dev, block(), false)
            .await
            .unwrap();
    }
    assert!(
        std::fs::metadata(&dev)
            .unwrap()
            .file_type()
            .is_block_device()
    );
    assert_eq!(dev_size(Path::new(&dev)), 10 << 20);
    let st = c.stats(&id, &dev).await.unwrap();
    assert_eq!(st.usage.len(), 1);
    assert_eq!(st.usage[0].unit, csi::volume_usage::Unit::Bytes as i32);
    assert_eq!(st.usage[0].total, 10 * MIB);
    assert!(!st.volume_condition.unwrap().abnormal);
    // write through the device, read it back through a second target
    let dev2 = format!("{pods}/dev2");
    c.publish(
        &id,
        &staging,
        &dev2,
        block_mode(Mode::SingleNodeMultiWriter),
        false,
    )
    .await
    .unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&dev).unwrap();
        f.write_all_at(b"raw-bytes", 4096).unwrap();
        f.sync_all().unwrap();
        let mut buf = [0u8; 9];
        std::fs::File::open(&dev2)
            .unwrap()
            .read_exact_at(&mut buf, 4096)
            .unwrap();
        assert_eq!(&buf, b"raw-bytes");
    }
    let ro = format!("{pods}/ro");
    let s = assert_code(
        c.publish(&id, &staging, &ro, block(), true).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("cannot be mixed"), "{}", s.message());
    assert!(!Path::new(&ro).exists());
    for t in [&dev, &dev2] {
        c.unpublish(&id, t).await.unwrap();
        c.unpublish(&id, t).await.unwrap();
        assert!(!Path::new(t).exists());
    }
    // a read-only raw publication really refuses writes
    c.publish(&id, &staging, &ro, block(), true).await.unwrap();
    let err = std::fs::OpenOptions::new()
        .write(true)
        .open(&ro)
        .and_then(|f| {
            use std::os::unix::fs::FileExt;
            f.write_all_at(b"x", 0)
        })
        .unwrap_err();
    assert!(
        matches!(
            err.raw_os_error(),
            Some(libc::EPERM) | Some(libc::EROFS) | Some(libc::EACCES)
        ),
        "{err}"
    );
    c.unpublish(&id, &ro).await.unwrap();
    // ...and the device is writable again afterwards
    c.publish(&id, &staging, &dev, block(), false)
        .await
        .unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&dev).unwrap();
        f.write_all_at(b"again", 0).unwrap();
    }
    c.unpublish(&id, &dev).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_between_stage_and_publish_reuses_the_loop_device() {
    let mut node = TestNode::new();
    let mut c = node.clients().await;
    let v = c
        .create(create_req("survivor", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/s");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    let before = loops_under(node.dir.path());
    assert_eq!(before.len(), 1);

    // crash (SIGKILL) and come back on the same state dir
    drop(c);
    node.crash();
    node.start();
    let mut c = node.clients().await;
    let t = format!("{}/t", node.mkdir("pods"));
    c.publish(&id, &staging, &t, mount("ext4"), false)
        .await
        .unwrap();
    std::fs::write(format!("{t}/f"), b"after restart").unwrap();
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    let after = loops_under(node.dir.path());
    assert_eq!(after.len(), 1, "no second loop device: {after:?}");
    assert_eq!(after[0].path, before[0].path);
    assert_eq!(
        c.create(create_req("survivor", 32 * MIB, vec![mount("ext4")]))
            .await
            .unwrap()
            .volume_id,
        id
    );
    assert_eq!(c.list_all().await.len(), 1, "no duplicate volume");

    // graceful restart while published: still one device, data intact
    drop(c);
    assert!(node.stop().success());
    node.start();
    let mut c = node.clients().await;
    let st = c.stats(&id, &t).await.unwrap();
    assert!(!st.volume_condition.unwrap().abnormal);
    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert_eq!(
        std::fs::read(format!("{staging}/f")).unwrap(),
        b"after restart"
    );
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_lifecycle_and_environment_configuration() {
    let mut node = TestNode::new();
    let meta = std::fs::symlink_metadata(&node.socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(
        std::fs::metadata(node.socket.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    // SIGTERM: clean exit, socket removed
    assert!(node.stop().success());
    assert!(!node.socket.exists());
    // a crash leaves a stale socket, which the next start replaces
    node.start();
    node.crash();
    assert!(node.socket.exists());
    node.start();
    let mut c = node.clients().await;
    c.id.probe(csi::ProbeRequest {}).await.unwrap();
    drop(c);
    assert!(node.stop().success());
    // any other file at the socket path is refused and left alone
    std::fs::write(&node.socket, b"not a socket").unwrap();
    let out = node.command().output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&node.socket).unwrap(), b"not a socket");
    std::fs::remove_file(&node.socket).unwrap();

    // configuration from the environment
    let sock2 = node.path("env/csi.sock");
    let mut child = crust_testkit::ChildGuard::new(
        std::process::Command::new(env!("CARGO_BIN_EXE_crust-csi"))
            .env("CRUST_CSI_ENDPOINT", format!("unix://{}", sock2.display()))
            .env("CRUST_CSI_NODE_ID", "env-node")
            .env("CRUST_CSI_DRIVER_NAME", "example.org")
            .env("CRUST_CSI_STATE_DIR", node.path("env-state"))
            .env("CRUST_CSI_POOL_DIR", node.path("env-pool"))
            .env("CRUST_CSI_POOL_CAPACITY", "512Mi")
            .env("CRUST_CSI_MAX_VOLUMES_PER_NODE", "3")
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&sock2).is_err() {
        assert!(
            child.child().try_wait().unwrap().is_none(),
            "env-configured plugin exited"
        );
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut c = Clients::new(
        crust_proto::endpoint::Endpoint::Unix(sock2.clone())
            .connect()
            .await
            .unwrap(),
    );
    let info = c
        .node
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "env-node");
    assert_eq!(info.max_volumes_per_node, 3);
    assert_eq!(
        info.accessible_topology.unwrap().segments,
        HashMap::from([("example.org/node".to_string(), "env-node".to_string())])
    );
    let cap = c
        .ctl
        .get_capacity(csi::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cap.available_capacity, 512 * MIB);
    assert_eq!(
        c.id.get_plugin_info(csi::GetPluginInfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .name,
        "example.org"
    );
    drop(c);
    drop(child);

    // --help documents every flag with its environment variable
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_crust-csi"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--endpoint",
        "--node-id",
        "--driver-name",
        "--state-dir",
        "--backend",
        "--pool-dir",
        "--pool-capacity",
        "--static-device",
        "--max-volumes-per-node",
        "--log-level",
        "-v",
        "--health-ttl",
        "--health-timeout",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
    for env in [
        "CRUST_CSI_ENDPOINT",
        "CRUST_CSI_NODE_ID",
        "CRUST_CSI_POOL_CAPACITY",
        "CRUST_CSI_STATIC_DEVICE",
    ] {
        assert!(help.contains(env), "--help lacks {env}");
    }
    // bad flags: clear error, non-zero exit
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_crust-csi"))
        .args(["--endpoint", "relative.sock", "--node-id", "n"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("relative.sock"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_volumes_pages_through_a_thousand_volumes() {
    let node = TestNode::with_args(&["--pool-capacity", "4Gi"]);
    let c = node.clients().await;
    const N: usize = 1000;
    let mut created = BTreeSet::new();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..8 {
        let mut c = c.clone();
        tasks.spawn(async move {
            let mut ids = Vec::new();
            for i in (w..N).step_by(8) {
                let v = c
                    .create(create_req(
                        &format!("page-{i:04}"),
                        MIB,
                        vec![mount("ext4")],
                    ))
                    .await
                    .unwrap();
                ids.push(v.volume_id);
            }
            ids
        });
    }
    while let Some(r) = tasks.join_next().await {
        created.extend(r.unwrap());
    }
    assert_eq!(created.len(), N);
    let mut c = c;

    // page through in steps of 37, deleting and creating volumes between
    // pages: every volume present throughout appears exactly once
    let mut seen: Vec<String> = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    let mut churned_deleted = BTreeSet::new();
    loop {
        let r = c
            .ctl
            .list_volumes(csi::ListVolumesRequest {
                max_entries: 37,
                starting_token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(r.entries.len() <= 37);
        for e in &r.entries {
            let st = e.status.as_ref().unwrap();
            assert!(!st.volume_condition.as_ref().unwrap().abnormal);
            seen.push(e.volume.as_ref().unwrap().volume_id.clone());
        }
        pages += 1;
        if pages % 5 == 0 {
            // churn: delete one not-yet-seen volume, add a new one
            let victim = created
                .iter()
                .find(|id| !seen.contains(id) && !churned_deleted.contains(*id))
                .cloned();
            if let Some(victim) = victim {
                c.delete(&victim).await.unwrap();
                churned_deleted.insert(victim);
            }
            c.create(create_req(
                &format!("churn-{pages}"),
                MIB,
                vec![mount("ext4")],
            ))
            .await
            .unwrap();
        }
        if r.next_token.is_empty() {
            break;
        }
        token = r.next_token;
    }
    let unique: BTreeSet<_> = seen.iter().cloned().collect();
    assert_eq!(unique.len(), seen.len(), "a volume appeared twice");
    for id in &created {
        if !churned_deleted.contains(id) {
            assert!(unique.contains(id), "{id} missing from the pages");
        }
    }
    assert!(pages >= N / 37, "{pages} pages");
    assert_code(
        c.ctl
            .list_volumes(csi::ListVolumesRequest {
                max_entries: 10,
                starting_token: "bogus-token".into(),
            })
            .await,
        Code::Aborted,
    );
    // max_entries = 0 returns everything
    let all = c.list_all().await;
    assert_eq!(all.len(), N - churned_deleted.len() + (pages / 5));

    let mut tasks = tokio::task::JoinSet::new();
    let ids: Vec<String> = all
        .into_iter()
        .map(|e| e.volume.unwrap().volume_id)
        .collect();
    for chunk in ids.chunks(ids.len().div_ceil(8)) {
        let mut c = c.clone();
        let chunk = chunk.to_vec();
        tasks.spawn(async move {
            for id in chunk {
                c.delete(&id).await.unwrap();
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    assert!(c.list_all().await.is_empty());
    assert!(img_files(&node.pool).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_backend_hands_out_whole_devices() {
    crust_testkit::require_root();
    let scratch = tempfile::Builder::new()
        .prefix("crust-csi-test")
        .tempdir_in("/tmp")
        .unwrap();
    let _cleanup = NodeCleanup::new(scratch.path());
    let mut devs = Vec::new();
    for (name, mib) in [("small.img", 16u64), ("big.img", 48)] {
        let f = scratch.path().join(name);
        std::fs::File::create(&f)
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        let info = crust_blockdev::LoopDevice::attach(&f, crust_blockdev::AttachOptions::default())
            .unwrap();
        devs.push(info.path);
    }
    let node = TestNode::with_args(&[
        "--backend",
        "static",
        "--static-device",
        devs[0].to_str().unwrap(),
        "--static-device",
        devs[1].to_str().unwrap(),
    ]);
    let mut c = node.clients().await;
    let info =
        c.id.get_plugin_info(csi::GetPluginInfoRequest {})
            .await
            .unwrap()
            .into_inner();
    assert_eq!(
        info.manifest.get("backend").map(String::as_str),
        Some("static")
    );
    // the smallest device that fits: 20 MiB needs the 48 MiB one
    let v = c
        .create(create_req("on-static", 20 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    assert_eq!(v.capacity_bytes, 48 * MIB);
    assert_code(
        c.create(create_req("too-big", 100 * MIB, vec![mount("ext4")]))
            .await,
        Code::OutOfRange,
    );
    let staging = node.mkdir("staging/s");
    let t = format!("{}/t", node.mkdir("pods"));
    c.stage_after_blank_check(&v.volume_id, &staging, mount("ext4"))
        .await
        .unwrap();
    c.publish(&v.volume_id, &staging, &t, mount("ext4"), false)
        .await
        .unwrap();
    std::fs::write(format!("{t}/f"), b"static").unwrap();
    let m = crust_blockdev::find_mount(Path::new(&staging))
        .unwrap()
        .unwrap();
    assert_eq!(m.source, devs[1].to_str().unwrap());
    let st = c.stats(&v.volume_id, &t).await.unwrap();
    assert!(!st.volume_condition.unwrap().abnormal);
    c.unpublish(&v.volume_id, &t).await.unwrap();
    c.unstage(&v.volume_id, &staging).await.unwrap();
    c.delete(&v.volume_id).await.unwrap();
    // released: the device is blank again for the next claimant
    assert_eq!(
        crust_blockdev::probe_fs(&devs[1]).unwrap(),
        crust_blockdev::Probe::Blank
    );
    drop(c);
    drop(node);
}

/// Rewrites a volume record while the plugin is stopped, as if the plugin
/// had crashed between a mount and the record update.
fn forget_in_record(node: &TestNode, id: &str, field: &str) {
    let path = node.state.join("volumes").join(format!("{id}.json"));
    let mut rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    rec[field] = match field {
        "staging" => serde_json::Value::Null,
        _ => serde_json::json!({}),
    };
    std::fs::write(&path, serde_json::to_vec(&rec).unwrap()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_windows_between_mount_and_record_are_recovered() {
    let mut node = TestNode::new();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("window", 16 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/w");
    let t = format!("{}/t", node.mkdir("pods"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    let dev = loops_under(node.dir.path())[0].path.clone();

    // stage mounted, record lost: a retried stage adopts the mount
    drop(c);
    node.crash();
    forget_in_record(&node, &id, "staging");
    node.start();
    let mut c = node.clients().await;
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    let loops = loops_under(node.dir.path());
    assert_eq!(loops.len(), 1);
    assert_eq!(loops[0].path, dev);

    // publish bound, record lost: unpublish still cleans the target
    c.publish(&id, &staging, &t, mount("ext4"), false)
        .await
        .unwrap();
    drop(c);
    node.crash();
    forget_in_record(&node, &id, "published");
    node.start();
    let mut c = node.clients().await;
    c.unpublish(&id, &t).await.unwrap();
    assert!(!Path::new(&t).exists());
    assert_eq!(
        mounts_under(node.dir.path()),
        vec![std::fs::canonicalize(&staging).unwrap()]
    );

    // staged, record lost: unstage still unmounts and detaches
    drop(c);
    node.crash();
    forget_in_record(&node, &id, "staging");
    node.start();
    let mut c = node.clients().await;
    c.unstage(&id, &staging).await.unwrap();
    assert!(mounts_under(node.dir.path()).is_empty());
    assert!(loops_under(node.dir.path()).is_empty());
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_refuses_a_staging_path_that_lost_its_mount_and_restage_repairs_it() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("lost", 16 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/l");
    let t = format!("{}/t", node.mkdir("pods"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    std::fs::write(format!("{staging}/on-volume"), b"v").unwrap();
    // like a reboot: the mount is gone, the record still says staged
    crust_blockdev::unmount(Path::new(&staging)).unwrap();
    let s = assert_code(
        c.publish(&id, &staging, &t, mount("ext4"), false).await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message().contains("NodeStageVolume again"),
        "{}",
        s.message()
    );
    assert!(
        !Path::new(&t).exists(),
        "nothing bound onto the bare directory"
    );
    let cond = c
        .get(&id)
        .await
        .unwrap()
        .status
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(cond.abnormal, "lost staging mount is reported");
    // the repeated stage repairs it
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &t, mount("ext4"), false)
        .await
        .unwrap();
    assert_eq!(std::fs::read(format!("{t}/on-volume")).unwrap(), b"v");
    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}
