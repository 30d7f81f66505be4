//! Runtime-driven deferral (issue 14), on one guest boot: a volume of the
//! default StorageClass mode (`deferFsOps=auto`) is staged and published
//! on the host like any CSI volume, and a runc container (`ctr run` on a
//! private containerd) writes to it. The crust
//! runtime, creating a sandbox whose bundle mounts that target, asks the
//! plugin's Handover service for it: the guest mounts the volume (and
//! sees the host's file), the host target shows only the read-only
//! placeholder, and kubelet's plain NodeGetVolumeStats and
//! NodeExpandVolume (no `defer_fs_ops`) are answered from the guest. When
//! the sandbox is deleted the volume comes back without any host mount;
//! a new host publication checks it (e2fsck) and mounts it with
//! nosuid,nodev, holding both files; unpublish, unstage and delete
//! succeed and nothing is left.
//!
//! Budget: one TCG guest boot and one runc run, under 30 s on 2 cores
//! (about 4 s measured).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod e2e_support;

use std::path::Path;
use std::time::Instant;

use crust_csi_client::Csi;
use crust_proto::csi::v1 as csi;
use crust_testkit::{BUSYBOX_IMAGE, Containerd, ContainerdOptions};
use csi::volume_capability::access_mode::Mode;
use csi::volume_capability::{AccessMode, AccessType, MountVolume};
use e2e_support::*;
use serde_json::json;

/// A mount capability; `group`: kubelet's `volume_mount_group` (the pod's
/// fsGroup, delegated because the plugin advertises VOLUME_MOUNT_GROUP).
fn cap_with(group: &str) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            volume_mount_group: group.into(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

fn cap() -> csi::VolumeCapability {
    cap_with("")
}

/// (source, fs type, options) of the topmost mount at `p`.
fn mount_at(p: &Path) -> Option<(String, String, String)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let sep = f.iter().position(|x| *x == "-")?;
        (Path::new(f[4]) == p).then(|| {
            (
                f[sep + 2].to_string(),
                f[sep + 1].to_string(),
                f[5].to_string(),
            )
        })
    })
}

/// A volume staged and published on the host as kubelet does it, with the
/// requests to repeat and undo that.
struct HostVolume {
    id: String,
    staging: std::path::PathBuf,
    target: std::path::PathBuf,
    stage: csi::NodeStageVolumeRequest,
    publish: csi::NodePublishVolumeRequest,
}

impl HostVolume {
    /// CreateVolume (the default `deferFsOps=auto`), NodeStage, NodePublish;
    /// `group`: kubelet's `volume_mount_group` ("" for none).
    async fn publish(
        st: &Stack,
        csi: &Csi,
        name: &str,
        pod_uid: &str,
        size: u64,
        group: &str,
    ) -> HostVolume {
        let staging = st
            .work
            .join(format!("kubelet/plugins/blk.crust.dev/{name}/globalmount"));
        let target = st.work.join(format!(
            "kubelet/pods/{pod_uid}/volumes/kubernetes.io~csi/{name}/mount"
        ));
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        let vol = csi
            .create_volume(csi::CreateVolumeRequest {
                name: name.into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: size as i64,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![cap()],
                ..Default::default()
            })
            .await
            .unwrap()
            .volume
            .unwrap();
        let stage = csi::NodeStageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: staging.to_str().unwrap().into(),
            volume_capability: Some(cap_with(group)),
            volume_context: vol.volume_context.clone(),
            ..Default::default()
        };
        let publish = csi::NodePublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: staging.to_str().unwrap().into(),
            target_path: target.to_str().unwrap().into(),
            volume_capability: Some(cap_with(group)),
            volume_context: vol.volume_context.clone(),
            ..Default::default()
        };
        csi.node_stage_volume(stage.clone()).await.unwrap();
        csi.node_publish_volume(publish.clone()).await.unwrap();
        HostVolume {
            id: vol.volume_id,
            staging,
            target,
            stage,
            publish,
        }
    }

    fn target_s(&self) -> String {
        self.target.to_str().unwrap().to_string()
    }

    async fn unpublish(&self, csi: &Csi) -> Result<(), tonic::Status> {
        csi.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: self.id.clone(),
            target_path: self.target_s(),
            ..Default::default()
        })
        .await
        .map(drop)
    }

    /// kubelet publishes it on the host again (stage, publish).
    async fn republish(&self, csi: &Csi) -> Result<(), tonic::Status> {
        csi.node_stage_volume(self.stage.clone()).await?;
        csi.node_publish_volume(self.publish.clone())
            .await
            .map(drop)
    }

    /// NodeUnpublish, NodeUnstage, DeleteVolume.
    async fn remove(self, csi: &Csi) {
        self.unpublish(csi).await.unwrap();
        csi.node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: self.id.clone(),
            staging_target_path: self.staging.to_str().unwrap().into(),
        })
        .await
        .unwrap();
        csi.delete_volume(csi::DeleteVolumeRequest {
            volume_id: self.id,
            ..Default::default()
        })
        .await
        .unwrap();
    }
}

/// An OCI bundle whose workload sleeps with `source` bound at /data.
fn bundle(st: &Stack, name: &str, source: &str) -> std::path::PathBuf {
    let dir = st.work.join(format!("bundles/{name}"));
    std::fs::create_dir_all(dir.join("rootfs")).unwrap();
    let spec = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["sh", "-c", "exec sleep 100000"],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/"
        },
        "root": {"path": "rootfs"},
        "mounts": [{
            "destination": "/data",
            "type": "bind",
            "source": source,
            "options": ["rbind", "rw"]
        }],
    });
    std::fs::write(dir.join("config.json"), spec.to_string()).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_published_volume_is_handed_to_the_guest_and_back() {
    let mut st = Stack::new(Layout::Crust);
    st.start_plugin(true).await;
    let csi = st.csi().await;
    // --- the host: an ordinary CSI volume, written by a host workload ---
    let vol = HostVolume::publish(
        &st,
        &csi,
        "pvc-h",
        "0b1e5c9e-0000-4000-8000-00000000a11c",
        96 * MIB,
        "2000",
    )
    .await;
    let (id, staging, target, target_s) = (
        vol.id.clone(),
        vol.staging.clone(),
        vol.target.clone(),
        vol.target_s(),
    );
    // A runc pod (Debian's runc through `ctr run` on a private
    // containerd) uses the host mount and writes; then it ends.
    let (busybox, _pause) = crust_testkit::ensure_test_images();
    let ctrd = Containerd::start(ContainerdOptions::default());
    ctrd.import_images("default", &[&busybox]);
    let runc_root = ctrd.runc_root();
    let bind = format!("type=bind,src={target_s},dst=/data,options=rbind:rw");
    let o = ctrd.ctr_in(
        "default",
        &[
            "run",
            "--runc-root",
            runc_root.to_str().unwrap(),
            "--rm",
            "--mount",
            &bind,
            BUSYBOX_IMAGE,
            "runc-pod",
            "sh",
            "-c",
            "echo 'written on the host' > /data/host.txt && sync",
        ],
    );
    assert!(o.status.success(), "runc pod: {o:?}");
    drop(ctrd);
    assert_eq!(
        std::fs::read_to_string(target.join("host.txt")).unwrap(),
        "written on the host\n"
    );

    // --- a crust sandbox mounts the target: handover -----------------
    let bundle = bundle(&st, "h", &target_s);
    let rt = &st.runtime;
    let t0 = Instant::now();
    rt.ok(&["create", "-b", bundle.to_str().unwrap(), "h"])
        .await
        .unwrap_or_else(|e| panic!("create: {e}\n{}", st.plugin_log()));
    let create_ms = t0.elapsed().as_millis();
    rt.ok(&["start", "h"]).await.unwrap();
    let state = rt.json(&["state", "h"]).await.unwrap();
    let ev = &state["events"][0];
    assert_eq!(ev["outcome"], "handed-over", "{state}");
    assert_eq!(ev["target"], target_s.as_str(), "{state}");
    let handover_ms = ev["elapsed_ms"]
        .as_u64()
        .unwrap_or_else(|| panic!("no latency: {state}"));
    let answer_ms = ev["answer_ms"].as_u64().unwrap();
    eprintln!(
        "handover: plugin answered in {answer_ms} ms; request to mounted in the guest \
         {handover_ms} ms, with the guest boot (create {create_ms} ms)"
    );

    // The guest has the volume (ext4, the host's file) and writes to it.
    let out = rt
        .sh(
            "h",
            "cat /data/host.txt && echo from-guest > /data/guest.txt && sync && \
             awk '$2==\"/data\"{print $3}' /proc/mounts",
        )
        .await
        .unwrap();
    assert_eq!(out, "written on the host\next4\n");
    // The pod's fsGroup, from kubelet's volume_mount_group (no KEP field),
    // travelled with the handover and holds in the guest.
    assert_eq!(state["volumes"][0]["fs_group"], 2000, "{state}");
    let gids = rt
        .sh("h", "stat -c %g /data /data/guest.txt")
        .await
        .unwrap();
    assert_eq!(gids, "2000\n2000\n");
    // The host target is the placeholder, never the volume.
    let (src, fstype, _) = mount_at(&target).unwrap();
    assert_eq!(
        (src.as_str(), fstype.as_str()),
        ("crust-volume-elsewhere", "tmpfs")
    );
    assert!(!target.join("host.txt").exists());
    assert!(
        std::fs::write(target.join("x"), "x").is_err(),
        "no data fits on the placeholder"
    );
    assert!(
        mount_at(&staging).is_none(),
        "the staging mount is gone while handed over"
    );

    // kubelet's plain stats and expansion are answered from the guest.
    let df = rt.sh("h", "df -B1 /data | tail -1").await.unwrap();
    let f: Vec<u64> = df
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let stats = csi
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: target_s.clone(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("stats: {e}\n{}", st.plugin_log()));
    let bytes = stats
        .usage
        .iter()
        .find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32)
        .unwrap();
    assert_eq!(
        bytes.total as u64, f[0],
        "NodeGetVolumeStats total = guest df: {df}"
    );
    csi.controller_expand_volume(csi::ControllerExpandVolumeRequest {
        volume_id: id.clone(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: (160 * MIB) as i64,
            limit_bytes: 0,
        }),
        volume_capability: Some(cap()),
        ..Default::default()
    })
    .await
    .unwrap();
    csi.node_expand_volume(csi::NodeExpandVolumeRequest {
        volume_id: id.clone(),
        volume_path: target_s.clone(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: (160 * MIB) as i64,
            limit_bytes: 0,
        }),
        volume_capability: Some(cap()),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("expand: {e}\n{}", st.plugin_log()));
    let df2 = rt.sh("h", "df -B1 /data | tail -1").await.unwrap();
    let total2: u64 = df2.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(
        total2 > f[0] + 40 * MIB,
        "grown in the guest: {df} -> {df2}"
    );

    // --- the sandbox ends: the volume comes back, mounted nowhere -----
    rt.ok(&["kill", "h", "KILL"]).await.ok();
    rt.ok(&["delete", "--force", "h"]).await.unwrap();
    let (src, _, _) = mount_at(&target).unwrap_or_default();
    assert_eq!(
        src, "crust-volume-elsewhere",
        "returned: still the placeholder"
    );
    assert!(
        mount_at(&staging).is_none(),
        "returned without a host mount"
    );
    assert!(st.records().is_empty(), "{:?}", st.records());

    // kubelet: unpublish (nothing to unmount), publish again on the host.
    vol.unpublish(&csi).await.unwrap();
    assert!(mount_at(&target).is_none());
    vol.republish(&csi)
        .await
        .unwrap_or_else(|e| panic!("republish: {e}\n{}", st.plugin_log()));
    let (_, fstype, opts) = mount_at(&staging).unwrap();
    assert_eq!(fstype, "ext4");
    assert!(
        opts.contains("nosuid") && opts.contains("nodev"),
        "back from a guest: nosuid,nodev ({opts})"
    );
    assert_eq!(
        std::fs::read_to_string(target.join("host.txt")).unwrap(),
        "written on the host\n"
    );
    assert_eq!(
        std::fs::read_to_string(target.join("guest.txt")).unwrap(),
        "from-guest\n"
    );
    assert!(
        st.plugin_log().contains("passed its check"),
        "the plugin checked the filesystem before mounting it"
    );
    vol.remove(&csi).await;
    st.stop_plugin().await;
    st.assert_clean();
}

/// The runtime (its sandbox shim) SIGKILLed right after crust-csi handed
/// the volume over (`answered`, before the guest boots), between hot-plug
/// and mount (`attached`) and after the guest mounted it (`mounted`): `crust-runtime delete --force` clears the
/// sandbox and its claims, kubelet's NodeUnpublishVolume then takes the
/// volume back (returned, no host mount), and the next host publication
/// checks it and holds the data. Nothing is left.
/// Budget: two TCG guest boots (the `answered` case boots none), ~15 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_killed_mid_handover_leaves_a_volume_kubelet_takes_back() {
    let mut st = Stack::new(Layout::Crust);
    st.start_plugin(true).await;
    let csi = st.csi().await;
    for (n, step) in ["answered", "attached", "mounted"].into_iter().enumerate() {
        let name = format!("pvc-k{n}");
        let vol = HostVolume::publish(
            &st,
            &csi,
            &name,
            &format!("0b1e5c9e-0000-4000-8000-00000000b00{n}"),
            64 * MIB,
            "",
        )
        .await;
        std::fs::write(vol.target.join("before.txt"), step).unwrap();
        let bundle = bundle(&st, &name, &vol.target_s());
        let rt = &st.runtime;
        let o = std::process::Command::new(&rt.bin)
            .envs(rt.env())
            .env("CRUST_RUNTIME_TEST_HANDOVER_CRASH", step)
            .args(["create", "-b", bundle.to_str().unwrap(), &name])
            .output()
            .unwrap();
        assert!(!o.status.success(), "{step}: the shim died: {o:?}");
        assert_ne!(
            mount_at(&vol.staging).map(|m| m.1).as_deref(),
            Some("ext4"),
            "{step}: the host never mounts a handed-over volume"
        );
        rt.ok(&["delete", "--force", &name])
            .await
            .unwrap_or_else(|e| panic!("{step}: delete: {e}"));

        // kubelet: the pod is gone; unpublish takes the volume back.
        vol.unpublish(&csi)
            .await
            .unwrap_or_else(|e| panic!("{step}: unpublish: {e}\n{}", st.plugin_log()));
        assert!(mount_at(&vol.target).is_none(), "{step}");
        assert!(st.records().is_empty(), "{step}: {:?}", st.records());
        vol.republish(&csi)
            .await
            .unwrap_or_else(|e| panic!("{step}: republish: {e}\n{}", st.plugin_log()));
        assert_eq!(
            std::fs::read_to_string(vol.target.join("before.txt")).unwrap(),
            step
        );
        vol.remove(&csi).await;
    }
    st.stop_plugin().await;
    st.assert_clean();
}
