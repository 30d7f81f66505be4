//! Distributed provisioning simulated on one machine: two `crust-csi`
//! processes play two Kubernetes nodes (own node id, pool, state and
//! socket), as the external-provisioner's node deployment runs them.
//! Capacity and topology are per node; a volume is created only where the
//! accessibility requirements allow; a volume of one node is never staged
//! or published on the other.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::*;
use crust_proto::csi::v1 as csi;
use tonic::Code;

fn node(id: &str, capacity: &str) -> TestNode {
    let mut n = TestNode::unstarted(&["--pool-capacity", capacity], "0s");
    n.node_id = id.to_string();
    n.start();
    n
}

fn topo(node: &str) -> csi::Topology {
    csi::Topology {
        segments: HashMap::from([(TOPO_KEY.to_string(), node.to_string())]),
    }
}

async fn capacity(c: &mut Clients, at: &str) -> i64 {
    c.ctl
        .get_capacity(csi::GetCapacityRequest {
            volume_capabilities: vec![mount("ext4")],
            parameters: HashMap::from([("fsType".to_string(), "ext4".to_string())]),
            accessible_topology: Some(topo(at)),
        })
        .await
        .unwrap()
        .into_inner()
        .available_capacity
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_report_their_own_capacity_and_refuse_each_others_volumes() {
    let a = node("node-a", "2Gi");
    let b = node("node-b", "3Gi");
    let mut ca = a.clients().await;
    let mut cb = b.clients().await;

    // Each node reports its own id and topology segment (what kubelet
    // puts on the CSINode and the node's labels).
    for (c, id) in [(&mut ca, "node-a"), (&mut cb, "node-b")] {
        let info = c
            .node
            .node_get_info(csi::NodeGetInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.node_id, id);
        assert_eq!(info.accessible_topology, Some(topo(id)));
    }

    // GetCapacity per segment, as the provisioner asks each node for its
    // own CSIStorageCapacity: the node's pool for its segment, 0 for the
    // other's.
    assert_eq!(capacity(&mut ca, "node-a").await, 2 << 30);
    assert_eq!(capacity(&mut ca, "node-b").await, 0);
    assert_eq!(capacity(&mut cb, "node-b").await, 3 << 30);
    assert_eq!(capacity(&mut cb, "node-a").await, 0);

    // Requisite topology naming only the other node: RESOURCE_EXHAUSTED
    // (CSI: "unable to provision in accessible_topology"), nothing made.
    let mut elsewhere = create_req("pv-elsewhere", 64 * MIB, vec![mount("ext4")]);
    elsewhere.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![topo("node-b")],
        preferred: vec![topo("node-b")],
    });
    let s = assert_code(ca.create(elsewhere).await, Code::ResourceExhausted);
    assert!(s.message().contains("node-a"), "{}", s.message());
    let images = |dir: &Path| {
        std::fs::read_dir(dir).map_or(0, |d| {
            d.filter(|e| e.as_ref().unwrap().path().extension() == Some("img".as_ref()))
                .count()
        })
    };
    assert_eq!(images(&a.pool), 0, "no backing file");

    // What the provisioner sends with --strict-topology for a PVC whose
    // pod was scheduled to node-a.
    let mut here = create_req("pv-here", 64 * MIB, vec![mount("ext4")]);
    here.accessibility_requirements = Some(csi::TopologyRequirement {
        requisite: vec![topo("node-a")],
        preferred: vec![topo("node-a")],
    });
    let v = ca.create(here).await.unwrap();
    assert_eq!(v.accessible_topology, vec![topo("node-a")]);
    assert_eq!(
        v.volume_context.get(TOPO_KEY).map(String::as_str),
        Some("node-a")
    );
    assert_eq!(capacity(&mut ca, "node-a").await, (2 << 30) - 64 * MIB);
    assert_eq!(capacity(&mut cb, "node-b").await, 3 << 30, "B unaffected");

    // A volume of node-a is never staged or published on node-b: the
    // node is named, nothing is attached or mounted there.
    let staging_b = b.mkdir("staging/v");
    let target_b = format!("{}/pod", b.mkdir("pods"));
    let stage_b = csi::NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging_b.clone(),
        volume_capability: Some(mount("ext4")),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    };
    let s = assert_code(
        cb.node.node_stage_volume(stage_b.clone()).await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message().contains("\"node-a\"") && s.message().contains("\"node-b\""),
        "{}",
        s.message()
    );
    let s = assert_code(
        cb.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: v.volume_id.clone(),
                staging_target_path: staging_b.clone(),
                target_path: target_b.clone(),
                volume_capability: Some(mount("ext4")),
                volume_context: v.volume_context.clone(),
                ..Default::default()
            })
            .await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("\"node-a\""), "{}", s.message());
    assert!(loops_under(b.dir.path()).is_empty());
    assert!(loops_under(a.dir.path()).is_empty(), "A untouched too");
    assert!(mounts_under(b.dir.path()).is_empty());
    assert!(!Path::new(&target_b).exists());

    // Without a context naming another node, an unknown id stays NOT_FOUND.
    let mut unknown = stage_b;
    unknown.volume_context.clear();
    assert_code(cb.node.node_stage_volume(unknown).await, Code::NotFound);

    // On its own node the volume stages as usual.
    let staging_a = a.mkdir("staging/v");
    ca.node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: staging_a.clone(),
            volume_capability: Some(mount("ext4")),
            volume_context: v.volume_context.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(loops_under(a.dir.path()).len(), 1);
    ca.unstage(&v.volume_id, &staging_a).await.unwrap();
    ca.delete(&v.volume_id).await.unwrap();
    assert_eq!(capacity(&mut ca, "node-a").await, 2 << 30);
}

/// The livenessprobe sidecar turns Probe into the container's liveness:
/// Probe must fail when the node's storage cannot be used, here the state
/// directory (a hostPath) gone read-only, and recover with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_reports_a_read_only_state_directory() {
    use rustix::mount::{MountFlags, MountPropagationFlags, mount_bind, mount_remount};
    let n = node("node-a", "1Gi");
    let mut c = n.clients().await;
    let probe = |mut c: Clients| async move {
        c.id.probe(csi::ProbeRequest {})
            .await
            .map(|r| r.into_inner().ready)
    };
    assert_eq!(probe(c.clone()).await.unwrap(), Some(true));

    mount_bind(&n.state, &n.state).unwrap();
    let _ = rustix::mount::mount_change(&n.state, MountPropagationFlags::PRIVATE);
    mount_remount(&n.state, MountFlags::BIND | MountFlags::RDONLY, "").unwrap();
    let s = assert_code(probe(c.clone()).await, Code::FailedPrecondition);
    assert!(
        s.message().contains("state directory") && s.message().contains("not writable"),
        "{}",
        s.message()
    );
    crust_blockdev::unmount(&n.state).unwrap();
    assert_eq!(probe(c.clone()).await.unwrap(), Some(true));
    // A volume can be created again: the probe's verdict matched reality.
    let v = c
        .create(create_req("after-probe", 16 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    c.delete(&v.volume_id).await.unwrap();
}
