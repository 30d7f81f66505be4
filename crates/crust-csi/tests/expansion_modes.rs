//! `--expansion controller` (the default: ControllerExpandVolume grows the
//! backing file, NodeExpandVolume the filesystem) against `--expansion
//! node` (the Kubernetes deployment: the controller does not advertise
//! EXPAND_VOLUME, so the external-resizer leaves the work to kubelet, and
//! NodeExpandVolume grows the backing file and then the filesystem), on
//! real loop devices.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use crust_proto::csi::v1 as csi;
use csi::controller_service_capability::rpc::Type as CtlRpc;
use csi::node_service_capability::rpc::Type as NodeRpc;
use tonic::Code;

async fn ctl_caps(c: &mut Clients) -> Vec<i32> {
    c.ctl
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| match c.r#type {
            Some(csi::controller_service_capability::Type::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect()
}

async fn node_caps(c: &mut Clients) -> Vec<i32> {
    c.node
        .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| match c.r#type {
            Some(csi::node_service_capability::Type::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect()
}

fn backing(node: &TestNode, id: &str) -> PathBuf {
    node.pool.join(format!("{id}.img"))
}

fn file_len(p: &Path) -> i64 {
    std::fs::metadata(p).unwrap().len() as i64
}

fn node_expand(id: &str, path: &str, required: i64) -> csi::NodeExpandVolumeRequest {
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

async fn recorded_capacity(c: &mut Clients, id: &str) -> i64 {
    c.ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .capacity_bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_mode_advertises_controller_expansion_and_node_does_not_grow_the_file() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    assert!(
        ctl_caps(&mut c)
            .await
            .contains(&(CtlRpc::ExpandVolume as i32))
    );
    assert!(
        node_caps(&mut c)
            .await
            .contains(&(NodeRpc::ExpandVolume as i32))
    );

    let v = c
        .create(create_req("ctl-mode", 40 * MIB, vec![block()]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/v");
    let t = format!("{}/dev", node.mkdir("pods"));
    c.stage(&id, &staging, block()).await.unwrap();
    c.publish(&id, &staging, &t, block(), false).await.unwrap();
    // Without ControllerExpandVolume first, the node does not grow the
    // backing file: OUT_OF_RANGE, nothing changed.
    assert_code(
        c.node
            .node_expand_volume(node_expand(&id, &t, 64 * MIB))
            .await,
        Code::OutOfRange,
    );
    assert_eq!(file_len(&backing(&node, &id)), 40 * MIB);
    assert_eq!(dev_size(Path::new(&t)) as i64, 40 * MIB);
    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_mode_grows_the_backing_file_and_the_filesystem_in_node_expand() {
    let node = TestNode::with_args(&["--pool-capacity", "2Gi", "--expansion", "node"]);
    let mut c = node.clients().await;
    // What the external-resizer looks at: no controller expansion, node
    // expansion present, so it marks the PVC for kubelet.
    assert!(
        !ctl_caps(&mut c)
            .await
            .contains(&(CtlRpc::ExpandVolume as i32))
    );
    assert!(
        node_caps(&mut c)
            .await
            .contains(&(NodeRpc::ExpandVolume as i32))
    );

    let (size, grown) = (320 * MIB, 640 * MIB);
    let v = c
        .create(create_req("node-mode", size, vec![mount("xfs")]))
        .await
        .unwrap();
    let id = v.volume_id;
    let file = backing(&node, &id);
    let s = assert_code(
        c.ctl
            .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: id.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: grown,
                    limit_bytes: 0,
                }),
                ..Default::default()
            })
            .await,
        Code::Unimplemented,
    );
    assert!(s.message().contains("--expansion node"), "{}", s.message());
    assert_eq!(file_len(&file), size);

    let staging = node.mkdir("staging/v");
    let t = format!("{}/pod", node.mkdir("pods"));
    c.stage(&id, &staging, mount("xfs")).await.unwrap();
    c.publish(&id, &staging, &t, mount("xfs"), false)
        .await
        .unwrap();
    std::fs::write(format!("{t}/keep"), b"still here").unwrap();
    let before = fs_total(Path::new(&t));

    // Bad input changes nothing: a path that is not this volume's.
    assert_code(
        c.node
            .node_expand_volume(node_expand(&id, &format!("{t}-nope"), grown))
            .await,
        Code::NotFound,
    );
    // More than the pool holds: RESOURCE_EXHAUSTED, nothing changed.
    assert_code(
        c.node
            .node_expand_volume(node_expand(&id, &t, 4 << 30))
            .await,
        Code::ResourceExhausted,
    );
    assert_eq!(file_len(&file), size);
    assert_eq!(recorded_capacity(&mut c, &id).await, size);

    // kubelet's call after the resizer marked the PVC: file, device and
    // filesystem grow; repeated, nothing more happens.
    for _ in 0..2 {
        let r = c
            .node
            .node_expand_volume(node_expand(&id, &t, grown))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.capacity_bytes, grown);
        assert_eq!(file_len(&file), grown);
    }
    let loops = loops_under(node.dir.path());
    assert_eq!(loops.len(), 1);
    assert_eq!(dev_size(&loops[0].path) as i64, grown);
    let after = fs_total(Path::new(&t));
    assert!(
        after > before && after as i64 > grown * 85 / 100,
        "{before} -> {after}"
    );
    assert_eq!(recorded_capacity(&mut c, &id).await, grown);
    assert_eq!(std::fs::read(format!("{t}/keep")).unwrap(), b"still here");

    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_mode_grows_a_raw_block_volume_and_an_ext4_at_next_stage() {
    let node = TestNode::with_args(&["--pool-capacity", "2Gi", "--expansion", "node"]);
    let mut c = node.clients().await;

    // Raw block: the published device grows online.
    let v = c
        .create(create_req("node-raw", 40 * MIB, vec![block()]))
        .await
        .unwrap();
    let raw = v.volume_id;
    let staging = node.mkdir("staging/raw");
    let dev = format!("{}/dev", node.mkdir("pods"));
    c.stage(&raw, &staging, block()).await.unwrap();
    c.publish(&raw, &staging, &dev, block(), false)
        .await
        .unwrap();
    let r = c
        .node
        .node_expand_volume(node_expand(&raw, &dev, 64 * MIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 64 * MIB);
    assert_eq!(dev_size(Path::new(&dev)) as i64, 64 * MIB);
    assert_eq!(file_len(&backing(&node, &raw)), 64 * MIB);
    c.unpublish(&raw, &dev).await.unwrap();
    c.unstage(&raw, &staging).await.unwrap();
    c.delete(&raw).await.unwrap();

    // ext4 mounted on the host: the file grows at once; the filesystem
    // online where the plugin has CAP_SYS_RESOURCE, else at the next stage.
    let v = c
        .create(create_req("node-ext4", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/e");
    let t = format!("{}/pod-e", node.mkdir("pods"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &t, mount("ext4"), false)
        .await
        .unwrap();
    let before = fs_total(Path::new(&t));
    let r = c
        .node
        .node_expand_volume(node_expand(&id, &t, 160 * MIB))
        .await;
    assert_eq!(file_len(&backing(&node, &id)), 160 * MIB);
    if crust_blockdev::can_grow_ext4_online() {
        assert_eq!(r.unwrap().into_inner().capacity_bytes, 160 * MIB);
    } else {
        let s = assert_code(r, Code::FailedPrecondition);
        assert!(s.message().contains("CAP_SYS_RESOURCE"), "{}", s.message());
        assert_eq!(fs_total(Path::new(&t)), before);
        c.unpublish(&id, &t).await.unwrap();
        c.unstage(&id, &staging).await.unwrap();
        c.stage(&id, &staging, mount("ext4")).await.unwrap();
        c.publish(&id, &staging, &t, mount("ext4"), false)
            .await
            .unwrap();
    }
    let after = fs_total(Path::new(&t));
    assert!(
        after > before && after as i64 > 130 * MIB,
        "{before} -> {after}"
    );
    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}
