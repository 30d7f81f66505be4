//! Issue 31, must-shows 4 and 5: subPath the way a stock kubelet does it,
//! under a kubelet root that is not `/var/lib/kubelet` and with no
//! setting naming it (`CRUST_RUNTIME_PODS_LAYER_STOP` empty).
//!
//! One CRI pod on a private containerd with two crust-csi volumes: one
//! deferred from the start (`defer_fs_ops`), one published on the host and
//! handed over when the first container asks for it (`auto`). For each
//! container the test plays kubelet: it makes `<target>/<sub>` (on the
//! placeholder, or on the host mount before the handover) and binds it at
//! `<pod>/volume-subpaths/<volume>/<container>/<index>`, and that bind is
//! the container's mount source. An init container and an app container
//! write through their subPaths; the bytes are read back from the volume
//! images with `debugfs` after unstage. A subPath that is a symlink out of
//! the volume (planted by the init container) is refused.
//!
//! Budget: one TCG guest and three containers, ~40 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Env, qemus_under, start_plugin};
use crust_cri::Cri;
use crust_cri::v1 as cri;
use crust_proto::csi::v1 as csi;

const POD_UID: &str = "31c0ffee-0000-4000-8000-0000000000a4";

/// kubelet's subPath step: `mkdir -p <target>/<sub>`, then a bind of it at
/// `<pod>/volume-subpaths/<volume>/<container>/<index>`; returns the bind.
fn kubelet_subpath(
    pod: &Path,
    target: &str,
    sub: &str,
    volume: &str,
    container: &str,
    index: u32,
) -> crust_blockdev::MountGuard {
    let src = Path::new(target).join(sub);
    std::fs::create_dir_all(&src).unwrap_or_else(|e| panic!("kubelet's mkdir {src:?}: {e}"));
    let at = pod
        .join("volume-subpaths")
        .join(volume)
        .join(container)
        .join(index.to_string());
    std::fs::create_dir_all(&at).unwrap();
    crust_blockdev::bind_mount(&src, &at, false).unwrap();
    crust_blockdev::MountGuard::new(at)
}

fn container(name: &str, script: &str, mounts: &[(&str, &Path)]) -> cri::ContainerConfig {
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
        mounts: mounts
            .iter()
            .map(|(dst, src)| cri::Mount {
                container_path: (*dst).into(),
                host_path: src.display().to_string(),
                ..Default::default()
            })
            .collect(),
        log_path: format!("{name}.log"),
        ..Default::default()
    }
}

/// `debugfs -R "cat <path>" <image>`: the file's bytes inside the image.
fn debugfs_cat(image: &Path, path: &str) -> String {
    let o = Command::new("debugfs")
        .args(["-R", &format!("cat {path}")])
        .arg(image)
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_subpaths_under_another_kubelet_root() {
    let t0 = Instant::now();
    let phase = |what: &str| eprintln!("[{:>6.1}s] {what}", t0.elapsed().as_secs_f64());
    // No setting names the kubelet root: the shim reads it from the pod.
    let mut env = Env::start_with(
        crust_testkit::CRI_NAMESPACE,
        vec![("CRUST_RUNTIME_PODS_LAYER_STOP".into(), String::new())],
    );
    env.pods_dir = env.dir.path().join("var/lib/k0s/kubelet/pods");
    std::fs::create_dir_all(&env.pods_dir).unwrap();
    let cgroup_parent = format!("/crust-test-{}", std::process::id());
    let _leftovers = common::Leftovers {
        pool: env.dir.path().join("pool"),
        cgroup_parent: Some(cgroup_parent.clone()),
    };
    let plugin = start_plugin(&env).await;
    let csi = plugin.csi().await;
    let pod = env.pods_dir.join(POD_UID);
    let logs = || {
        format!(
            "{}\n--- crust-csi\n{}",
            env.logs(),
            plugin.proc.log_tail(4000)
        )
    };

    // --- CSI: one deferred volume, one host publication -------------------
    let mut vols = Vec::new();
    for (name, deferred) in [("pvc-def", true), ("pvc-auto", false)] {
        let p = common::publish(&env, &csi, name, POD_UID, deferred).await;
        vols.push((p.volume_id, p.staging, p.target, deferred));
    }
    let (def, auto) = (vols[0].2.clone(), vols[1].2.clone());
    // kubelet's own files of the pod (they show the root too).
    let hosts = pod.join("etc-hosts");
    std::fs::write(&hosts, "127.0.0.1 localhost\n").unwrap();
    phase("published");

    // --- the pod ------------------------------------------------------------
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let sandbox_config = cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: "subpath-pod".into(),
            uid: POD_UID.into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        log_directory: env.dir.path().join("pod-logs").display().to_string(),
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
    std::fs::create_dir_all(env.dir.path().join("pod-logs")).unwrap();
    let sb = cri
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(sandbox_config.clone()),
            runtime_handler: crust_testkit::CRUST_HANDLER.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", logs()))
        .into_inner()
        .pod_sandbox_id;
    let create = |cri: &mut Cri, cfg: cri::ContainerConfig| {
        let (mut rt, sb, sc) = (cri.runtime.clone(), sb.clone(), sandbox_config.clone());
        async move {
            rt.create_container(cri::CreateContainerRequest {
                pod_sandbox_id: sb,
                config: Some(cfg),
                sandbox_config: Some(sc),
            })
            .await
            .map(|r| r.into_inner().container_id)
        }
    };

    // --- init container: subPath `init` of both, the whole auto volume ------
    let mut binds = vec![
        kubelet_subpath(&pod, &def, "init", "def", "init", 0),
        kubelet_subpath(&pod, &auto, "init", "auto", "init", 1),
    ];
    let init = create(
        &mut cri,
        container(
            "init",
            "echo init-d > /d/f && echo init-a > /a/f && ln -s /etc /whole/esc && \
             mkdir -p /whole/app && sync",
            &[
                ("/d", binds[0].target()),
                ("/a", binds[1].target()),
                ("/whole", Path::new(&auto)),
                ("/etc/hosts", &hosts),
            ],
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("CreateContainer init: {e}\n{}", logs()));
    cri.runtime
        .start_container(cri::StartContainerRequest {
            container_id: init.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("StartContainer init: {e}\n{}", logs()));
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        let st = cri
            .runtime
            .container_status(cri::ContainerStatusRequest {
                container_id: init.clone(),
                verbose: false,
            })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap();
        if st.state == cri::ContainerState::ContainerExited as i32 {
            assert_eq!(st.exit_code, 0, "init failed\n{}", logs());
            break;
        }
        assert!(Instant::now() < until, "init never exited\n{}", logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The auto volume went to the guest (no virtio-fs fallback): the host
    // target holds the placeholder and kubelet's bind shows its path.
    let shown = |p: &Path| crust_blockdev::find_mount(p).unwrap().map(|m| m.source);
    assert_eq!(
        shown(Path::new(&auto)).as_deref(),
        Some(crust_handoff::PLACEHOLDER_SOURCE),
        "handed over\n{}",
        logs()
    );
    assert_eq!(
        shown(binds[1].target()).as_deref(),
        Some(crust_handoff::PLACEHOLDER_SOURCE)
    );
    phase("init done");

    // --- app container: kubelet's mkdir now meets both placeholders ----------
    binds.push(kubelet_subpath(&pod, &def, "app/x", "def", "app", 0));
    binds.push(kubelet_subpath(&pod, &auto, "app/x", "auto", "app", 1));
    let app = create(
        &mut cri,
        container(
            "app",
            "echo app-d > /d/f && echo app-a > /a/f && sync && exec sleep 100000",
            &[("/d", binds[2].target()), ("/a", binds[3].target())],
        ),
    )
    .await
    .unwrap_or_else(|e| panic!("CreateContainer app: {e}\n{}", logs()));
    cri.runtime
        .start_container(cri::StartContainerRequest {
            container_id: app.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("StartContainer app: {e}\n{}", logs()));
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let r = cri
            .runtime
            .exec_sync(cri::ExecSyncRequest {
                container_id: app.clone(),
                cmd: vec![
                    "sh".into(),
                    "-c".into(),
                    "cat /d/f /a/f; awk '$2==\"/d\"||$2==\"/a\"{print $3}' /proc/mounts".into(),
                ],
                timeout: 30,
            })
            .await
            .unwrap()
            .into_inner();
        let out = String::from_utf8_lossy(&r.stdout).into_owned();
        if out == "app-d\napp-a\next4\next4\n" {
            break;
        }
        assert!(Instant::now() < until, "app: {out:?}\n{}", logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    phase("app running");

    // --- a subPath that is a symlink out of the volume: refused ----------------
    binds.push(kubelet_subpath(&pod, &auto, "esc", "auto", "evil", 0));
    let evil = create(
        &mut cri,
        container("evil", "cat /x/passwd", &[("/x", binds[4].target())]),
    )
    .await;
    // Refused at creation or, where the guest mounts it, at start.
    let err = match evil {
        Ok(id) => {
            let started = cri
                .runtime
                .start_container(cri::StartContainerRequest {
                    container_id: id.clone(),
                })
                .await;
            match started {
                Ok(_) => panic!("a container got a subPath through a symlink out of the volume"),
                Err(e) => e.message().to_string(),
            }
        }
        Err(e) => e.message().to_string(),
    };
    assert!(
        err.contains("esc") && err.contains("outside the volume"),
        "{err}\n{}",
        logs()
    );
    phase("escape refused");

    // --- teardown, as kubelet does it --------------------------------------------
    cri.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: sb.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("StopPodSandbox: {e}\n{}", logs()));
    cri.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: sb.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("RemovePodSandbox: {e}\n{}", logs()));
    assert!(qemus_under(&env.runtime_root).is_empty(), "no VM left");
    // kubelet's CleanSubPaths comes before the volume's teardown.
    drop(binds);
    let pool = env.dir.path().join("pool");
    let mut images: Vec<PathBuf> = Vec::new();
    for (id, staging, target, deferred) in &vols {
        csi.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: id.clone(),
            target_path: target.clone(),
            defer_fs_ops: *deferred,
        })
        .await
        .unwrap_or_else(|e| panic!("NodeUnpublish {target}: {e}\n{}", logs()));
        csi.node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("NodeUnstage: {e}\n{}", logs()));
        images.push(pool.join(format!("{id}.img")));
    }
    // The bytes are in each volume, under the subPaths kubelet named.
    for (image, tag) in images.iter().zip(["d", "a"]) {
        assert_eq!(
            debugfs_cat(image, "/init/f"),
            format!("init-{tag}\n"),
            "{image:?}"
        );
        assert_eq!(
            debugfs_cat(image, "/app/x/f"),
            format!("app-{tag}\n"),
            "{image:?}"
        );
    }
    for (id, ..) in &vols {
        csi.delete_volume(csi::DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: HashMap::new(),
        })
        .await
        .unwrap();
    }
    phase("torn down");
}
