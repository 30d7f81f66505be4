//! Must-show 2: kubelet's sequence through CRI for a pod with the `crust`
//! RuntimeClass handler on a real containerd, with a crust-csi deferred
//! volume: CreateVolume → NodeStage → NodePublish (deferred) →
//! RunPodSandbox → CreateContainer (/data, an /etc/hosts bind, a
//! configMap-like dir) → StartContainer → ExecSync writes and `df /data`
//! → NodeGetVolumeStats equals the guest's df → ControllerExpand +
//! NodeExpand while running → df shows the growth → a second container
//! sees the same /data (one QEMU for the pod) → ContainerStatus and logs →
//! StopPodSandbox → RemovePodSandbox → NodeUnpublish → NodeUnstage → the
//! data is intact on a host mount. Budget: one TCG guest, ~60 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{Env, MIB, mount_cap, qemus_under, start_plugin};
use crust_cri::Cri;
use crust_cri::v1 as cri;
use crust_proto::csi::v1 as csi;
const POD_UID: &str = "9f8a1c2e-0000-4000-8000-00000000c0de";

async fn exec_sync(cri: &mut Cri, cid: &str, script: &str) -> String {
    let r = cri
        .runtime
        .exec_sync(cri::ExecSyncRequest {
            container_id: cid.into(),
            cmd: vec!["sh".into(), "-c".into(), script.into()],
            timeout: 60,
        })
        .await
        .unwrap_or_else(|e| panic!("ExecSync {script:?}: {e}"))
        .into_inner();
    assert_eq!(
        r.exit_code,
        0,
        "`{script}`: {}{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    String::from_utf8_lossy(&r.stdout).into_owned()
}

/// `df -P -B1 /data` in the container: (total, used, available).
async fn df(cri: &mut Cri, cid: &str) -> (u64, u64, u64) {
    let out = exec_sync(cri, cid, "df -P -B1 /data").await;
    let f: Vec<u64> = out
        .lines()
        .nth(1)
        .unwrap()
        .split_whitespace()
        .skip(1)
        .take(3)
        .map(|x| x.parse().unwrap())
        .collect();
    (f[0], f[1], f[2])
}

fn container_config(
    name: &str,
    script: &str,
    target: &str,
    hosts: &Path,
    config: &Path,
    logs: &str,
) -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: crust_testkit::BUSYBOX_IMAGE.into(),
            ..Default::default()
        }),
        command: vec!["sh".into(), "-c".into(), script.into()],
        mounts: vec![
            cri::Mount {
                container_path: "/data".into(),
                host_path: target.into(),
                ..Default::default()
            },
            cri::Mount {
                container_path: "/etc/hosts".into(),
                host_path: hosts.display().to_string(),
                ..Default::default()
            },
            cri::Mount {
                container_path: "/etc/config".into(),
                host_path: config.display().to_string(),
                readonly: true,
                ..Default::default()
            },
        ],
        log_path: logs.into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_sequence_with_a_deferred_volume() {
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let cgroup_parent = format!("/crust-test-{}", std::process::id());
    let _leftovers = common::Leftovers {
        pool: env.dir.path().join("pool"),
        cgroup_parent: Some(cgroup_parent.clone()),
    };
    let pods_dir = env.pods_dir.clone();
    let pods = pods_dir.clone();
    let plugin = start_plugin(&env).await;
    let csi = plugin.csi().await;

    // --- CSI: create, stage, deferred publish -------------------------------
    let vol = csi
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-shim-1".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: (64 * MIB) as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_cap(None)],
            ..Default::default()
        })
        .await
        .unwrap()
        .volume
        .unwrap();
    let staging = env
        .dir
        .path()
        .join("kubelet/plugins/blk.crust.dev/globalmount");
    std::fs::create_dir_all(&staging).unwrap();
    let staging = staging.display().to_string();
    csi.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.clone(),
        volume_capability: Some(mount_cap(None)),
        volume_context: vol.volume_context.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let target = format!(
        "{}/{POD_UID}/volumes/kubernetes.io~csi/pvc-shim-1/mount",
        pods_dir.display()
    );
    std::fs::create_dir_all(Path::new(&target).parent().unwrap()).unwrap();
    csi.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.clone(),
        target_path: target.clone(),
        volume_capability: Some(mount_cap(Some(2000))),
        volume_context: vol.volume_context.clone(),
        defer_fs_ops: true,
        ..Default::default()
    })
    .await
    .unwrap();

    // Host files kubelet would bind: /etc/hosts and a configMap dir.
    let hosts = env.dir.path().join("etc-hosts");
    std::fs::write(&hosts, "127.0.0.1 localhost\n10.9.8.7 crust-pod\n").unwrap();
    let config = pods
        .join(POD_UID)
        .join("volumes/kubernetes.io~configmap/cfg");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(config.join("app.conf"), "mode=deferred\n").unwrap();
    let log_dir = env.dir.path().join("pod-logs");
    std::fs::create_dir_all(&log_dir).unwrap();

    // --- CRI: the pod -----------------------------------------------------------
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let sandbox_config = cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: "shim-pod".into(),
            uid: POD_UID.into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        log_directory: log_dir.display().to_string(),
        linux: Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: cgroup_parent.clone(),
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    network: cri::NamespaceMode::Node as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let sb = cri
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(sandbox_config.clone()),
            runtime_handler: crust_testkit::CRUST_HANDLER.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", env.logs()))
        .into_inner()
        .pod_sandbox_id;
    let qemu = qemus_under(&env.runtime_root);
    assert_eq!(qemu.len(), 1, "the sandbox boots the pod's VM");
    // The VM is the pod's: QEMU runs in the sandbox's cgroup.
    assert!(
        common::in_cgroup(qemu[0], &format!("{cgroup_parent}/{sb}")),
        "QEMU {} in cgroup {cgroup_parent}/{sb}",
        qemu[0]
    );

    let app = cri
        .runtime
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: sb.clone(),
            config: Some(container_config(
                "app",
                "echo app-started; cat /etc/config/app.conf; exec sleep 100000",
                &target,
                &hosts,
                &config,
                "app.log",
            )),
            sandbox_config: Some(sandbox_config.clone()),
        })
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", env.logs()))
        .into_inner()
        .container_id;
    cri.runtime
        .start_container(cri::StartContainerRequest {
            container_id: app.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", env.logs()));

    // The binds: /etc/hosts from the host file, the configMap read-only.
    let out = exec_sync(
        &mut cri,
        &app,
        "cat /etc/hosts; cat /etc/config/app.conf; touch /etc/config/x 2>/dev/null || echo cfg-ro",
    )
    .await;
    assert_eq!(
        out,
        "127.0.0.1 localhost\n10.9.8.7 crust-pod\nmode=deferred\ncfg-ro\n"
    );
    // The volume: a real ext4 in the guest, fsGroup applied, nothing on the host.
    let out = exec_sync(
        &mut cri,
        &app,
        "echo precious > /data/f && sync && awk '$2==\"/data\"{print $3}' /proc/mounts && stat -c %g /data",
    )
    .await;
    assert_eq!(out, "ext4\n2000\n");
    // The host target shows only the plugin's placeholder.
    let names: Vec<String> = std::fs::read_dir(&target)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(names, ["README"], "nothing written on the host target");

    // NodeGetVolumeStats (through crust_ops and the runtime CLI) = the guest's df.
    let (total, used, avail) = df(&mut cri, &app).await;
    let stats = csi
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: target.clone(),
            staging_target_path: staging.clone(),
            defer_fs_ops: true,
        })
        .await
        .unwrap_or_else(|e| panic!("NodeGetVolumeStats: {e}\n{}", plugin.proc.log_tail(3000)));
    let bytes = stats
        .usage
        .iter()
        .find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32)
        .unwrap();
    assert_eq!(
        (
            bytes.total as u64,
            bytes.used as u64,
            bytes.available as u64
        ),
        (total, used, avail)
    );

    // Online expansion while it runs.
    let grown = 128 * MIB;
    csi.controller_expand_volume(csi::ControllerExpandVolumeRequest {
        volume_id: vol.volume_id.clone(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: grown as i64,
            limit_bytes: 0,
        }),
        volume_capability: Some(mount_cap(None)),
        ..Default::default()
    })
    .await
    .unwrap();
    csi.node_expand_volume(csi::NodeExpandVolumeRequest {
        volume_id: vol.volume_id.clone(),
        volume_path: target.clone(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: grown as i64,
            limit_bytes: 0,
        }),
        staging_target_path: staging.clone(),
        volume_capability: Some(mount_cap(None)),
        defer_fs_ops: true,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("NodeExpandVolume: {e}\n{}", plugin.proc.log_tail(3000)));
    let (total2, _, _) = df(&mut cri, &app).await;
    assert!(
        total2 > total + 50 * MIB,
        "df after expansion: {total2} vs {total}"
    );

    let mem_total = |out: String| -> u64 {
        out.split_whitespace()
            .nth(1)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap()
            * 1024
    };
    let before = mem_total(exec_sync(&mut cri, &app, "grep MemTotal /proc/meminfo").await);
    assert!(
        before < 256 * MIB,
        "the pod starts with the default guest ({} MiB)",
        before / MIB
    );

    // A second container of the pod sees the same /data, in the same VM.
    let side = cri
        .runtime
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: sb.clone(),
            config: Some(container_config(
                "side",
                "exec sleep 100000",
                &target,
                &hosts,
                &config,
                "side.log",
            )),
            sandbox_config: Some(sandbox_config.clone()),
        })
        .await
        .unwrap_or_else(|e| panic!("CreateContainer side: {e}\n{}", env.logs()))
        .into_inner()
        .container_id;
    cri.runtime
        .start_container(cri::StartContainerRequest {
            container_id: side.clone(),
        })
        .await
        .unwrap();
    assert_eq!(
        exec_sync(&mut cri, &side, "cat /data/f").await,
        "precious\n"
    );
    assert_eq!(
        qemus_under(&env.runtime_root).len(),
        1,
        "one QEMU for the whole pod"
    );

    // ContainerStatus and the CRI log.
    let st = cri
        .runtime
        .container_status(cri::ContainerStatusRequest {
            container_id: app.clone(),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap();
    assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);
    let log = std::fs::read_to_string(log_dir.join("app.log")).unwrap_or_default();
    assert!(
        log.contains("stdout F app-started") && log.contains("stdout F mode=deferred"),
        "CRI log: {log}"
    );

    // --- teardown, as kubelet does it -------------------------------------------
    cri.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: sb.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("StopPodSandbox: {e}\n{}", env.logs()));
    cri.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: sb.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("RemovePodSandbox: {e}\n{}", env.logs()));
    assert!(
        qemus_under(&env.runtime_root).is_empty(),
        "the VM is gone with the pod"
    );
    csi.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: target.clone(),
        defer_fs_ops: true,
    })
    .await
    .unwrap_or_else(|e| panic!("NodeUnpublish: {e}\n{}", plugin.proc.log_tail(3000)));
    csi.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.clone(),
    })
    .await
    .unwrap();

    // The data, on a host publication (no deferral).
    csi.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.clone(),
        volume_capability: Some(mount_cap(None)),
        volume_context: vol.volume_context.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let host_target = env.dir.path().join("host-target");
    csi.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.clone(),
        target_path: host_target.display().to_string(),
        volume_capability: Some(mount_cap(None)),
        volume_context: vol.volume_context.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(
        std::fs::read_to_string(host_target.join("f")).unwrap(),
        "precious\n"
    );
    csi.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: host_target.display().to_string(),
        defer_fs_ops: false,
    })
    .await
    .unwrap();
    csi.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.clone(),
    })
    .await
    .unwrap();
    csi.delete_volume(csi::DeleteVolumeRequest {
        volume_id: vol.volume_id.clone(),
        secrets: HashMap::new(),
    })
    .await
    .unwrap();
    let _ = plugin;
}
