//! A host runtime (Debian's runc, started with `ctr run` on a private
//! containerd) against the real `crust-csi` binary:
//! - `deferFsOps=false`: the container writes into the volume through the
//!   host mount, and the bytes are on the volume's filesystem;
//! - `deferFsOps=true`: the target holds the plugin's read-only
//!   placeholder, so the container's write fails with "Read-only file
//!   system", its `cat README` says where the volume went, and nothing
//!   lands on the node's disk or in the volume.
//!
//! Budget: under 5 s on 2 cores (no guest; containerd start and two runc
//! runs, ~1 s measured).

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::*;
use crust_proto::csi::v1 as csi;
use crust_testkit::{BUSYBOX_IMAGE, Containerd, ContainerdOptions};

/// Creates, stages and publishes a 64 MiB ext4 volume with the
/// StorageClass parameter `deferFsOps=<mode>`; returns (id, staging, target).
async fn published(c: &mut Clients, node: &TestNode, name: &str, mode: &str) -> [String; 3] {
    let mut r = create_req(name, 64 << 20, vec![mount("ext4")]);
    r.parameters.insert("deferFsOps".into(), mode.into());
    let v = c.create(r).await.unwrap();
    let ctx: HashMap<String, String> = v.volume_context.clone();
    let staging = node.mkdir(&format!("staging-{name}"));
    let target = node
        .path(&format!("pods/{name}/mount"))
        .to_str()
        .unwrap()
        .to_string();
    std::fs::create_dir_all(Path::new(&target).parent().unwrap()).unwrap();
    c.node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: staging.clone(),
            volume_capability: Some(mount("ext4")),
            volume_context: ctx.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    c.node
        .node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: staging.clone(),
            target_path: target.clone(),
            volume_capability: Some(mount("ext4")),
            volume_context: ctx,
            ..Default::default()
        })
        .await
        .unwrap();
    [v.volume_id, staging, target]
}

/// `ctr run` of busybox with runc, `target` bound read-write at /data.
fn runc_run(ctrd: &Containerd, name: &str, target: &str, script: &str) -> (i32, String) {
    let runc_root = ctrd.runc_root();
    let mount = format!("type=bind,src={target},dst=/data,options=rbind:rw");
    let o = ctrd.ctr_in(
        "default",
        &[
            "run",
            "--runc-root",
            runc_root.to_str().unwrap(),
            "--rm",
            "--mount",
            &mount,
            BUSYBOX_IMAGE,
            name,
            "sh",
            "-c",
            script,
        ],
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code().unwrap_or(-1), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runc_container_writes_through_a_host_mount_and_never_onto_the_node_disk() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let (busybox, _pause) = crust_testkit::ensure_test_images();
    let ctrd = Containerd::start(ContainerdOptions::default());
    ctrd.import_images("default", &[&busybox]);

    // deferFsOps=false: an ordinary host publication; runc writes into it.
    let [id, staging, target] = published(&mut c, &node, "hostvol", "false").await;
    let (code, out) = runc_run(
        &ctrd,
        "writer",
        &target,
        "echo from-runc > /data/f && sync && cat /data/f",
    );
    assert_eq!((code, out.trim()), (0, "from-runc"), "{out}");
    // The bytes are in the volume's filesystem (its staging mount).
    assert_eq!(
        std::fs::read_to_string(Path::new(&staging).join("f")).unwrap(),
        "from-runc\n"
    );
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();

    // deferFsOps=true: the target is the placeholder, where no data fits.
    let [id, staging, target] = published(&mut c, &node, "vmvol", "true").await;
    let (code, out) = runc_run(
        &ctrd,
        "intruder",
        &target,
        "cat /data/README; echo lost > /data/f",
    );
    eprintln!("runc on the placeholder (exit {code}):\n{out}");
    assert_ne!(code, 0, "the write must fail: {out}");
    assert!(out.contains("No space left on device"), "{out}");
    assert!(
        out.contains("placeholder") && out.contains("VM"),
        "the README says where the volume went: {out}"
    );
    // No byte landed: besides the README, at most the empty name the
    // failed write created.
    let landed: u64 = std::fs::read_dir(&target)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name() != "README")
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert_eq!(landed, 0, "no data landed on the target");
    c.unpublish(&id, &target).await.unwrap();
    // Below the placeholder, on the node's disk: nothing either (the
    // plugin removes the empty target directory).
    assert!(
        !Path::new(&target).exists() || std::fs::read_dir(&target).unwrap().next().is_none(),
        "the node disk under the target is empty"
    );
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    drop(ctrd);
    assert!(
        mounts_under(node.dir.path()).is_empty(),
        "{:?}",
        mounts_under(node.dir.path())
    );
}
