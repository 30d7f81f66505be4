//! Runtime-driven deferral through containerd: a volume published on the
//! host by crust-csi (default `deferFsOps=auto`) and written by a runc
//! container is bound into a `ctr run --runtime io.containerd.crust.v2`
//! container. containerd-shim-crust-v2 asks the plugin's Handover
//! service for it, so the container in the VM sees the volume (ext4, the
//! runc container's file) and writes to it while the host target holds
//! only the placeholder. When the container (and its pod VM)
//! ends, the shim hands the volume back without a host mount; a later
//! host publication checks it and holds both files; teardown leaves
//! nothing. Budget: one TCG guest and one runc run, about 20 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::path::Path;

use common::*;
use crust_proto::csi::v1 as csi;
use crust_testkit::BUSYBOX_IMAGE;

const RUNTIME: &str = "io.containerd.crust.v2";

/// (source, fs type) of the topmost mount at `p`.
fn mount_at(p: &Path) -> Option<(String, String)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let sep = f.iter().position(|x| *x == "-")?;
        (Path::new(f[4]) == p).then(|| (f[sep + 2].to_string(), f[sep + 1].to_string()))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctr_run_takes_a_host_published_volume_into_the_vm_and_gives_it_back() {
    let env = Env::start("default");
    let _leftovers = common::Leftovers {
        pool: env.dir.path().join("pool"),
        cgroup_parent: None,
    };
    let plugin = start_plugin(&env).await;
    let csi = plugin.csi().await;
    let vol = csi
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-ho".into(),
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
    let id = vol.volume_id.clone();
    let staging = env
        .dir
        .path()
        .join("kubelet/plugins/blk.crust.dev/ho/globalmount");
    std::fs::create_dir_all(&staging).unwrap();
    let target = env
        .pods_dir
        .join("5e1f0000-0000-4000-8000-0000000000b0/volumes/kubernetes.io~csi/pvc-ho/mount");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let (staging_s, target_s) = (staging.display().to_string(), target.display().to_string());
    let stage = csi::NodeStageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging_s.clone(),
        volume_capability: Some(mount_cap(None)),
        volume_context: vol.volume_context.clone(),
        ..Default::default()
    };
    let publish = csi::NodePublishVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging_s.clone(),
        target_path: target_s.clone(),
        volume_capability: Some(mount_cap(None)),
        volume_context: vol.volume_context.clone(),
        ..Default::default()
    };
    csi.node_stage_volume(stage.clone()).await.unwrap();
    csi.node_publish_volume(publish.clone()).await.unwrap();

    // A runc container writes through the host mount.
    let bind = format!("type=bind,src={target_s},dst=/data,options=rbind:rw");
    let runc_root = env.ctrd.runc_root();
    let o = env.ctrd.ctr_in(
        "default",
        &[
            "run",
            "--runc-root",
            runc_root.to_str().unwrap(),
            "--rm",
            "--mount",
            &bind,
            BUSYBOX_IMAGE,
            "runc-writer",
            "sh",
            "-c",
            "echo from-runc > /data/runc.txt && sync",
        ],
    );
    assert!(o.status.success(), "runc: {o:?}");

    // The same target in a crust container: handed over into its VM.
    let o = env.ctrd.ctr_in(
        "default",
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            "--mount",
            &bind,
            BUSYBOX_IMAGE,
            "vm-user",
            "sh",
            "-c",
            "cat /data/runc.txt; awk '$2==\"/data\"{print $3}' /proc/mounts; \
             echo from-vm > /data/vm.txt && sync",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "crust container: {o:?}\n{}\n{}",
        env.logs(),
        plugin.proc.log_tail(4000)
    );
    assert_eq!(out, "from-runc\next4\n", "{}", env.logs());
    let log = plugin.proc.log_tail(20000);
    assert!(
        log.contains("handed over"),
        "the plugin handed it over: {log}"
    );
    // The shim timed the handover in a running pod VM: request to mounted,
    // of which hot-plug and mount.
    let shim_log = std::fs::read_to_string(env.dir.path().join("shim.log")).unwrap();
    let line = shim_log
        .lines()
        .find(|l| l.contains("handover request to mounted"))
        .unwrap_or_else(|| panic!("no handover latency in the shim log: {}", env.logs()));
    let field = |k: &str| -> u64 {
        let at = line
            .find(&format!("{k}="))
            .unwrap_or_else(|| panic!("{k}: {line}"));
        let v: String = line[at + k.len() + 1..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        v.parse().unwrap_or_else(|_| panic!("{k}: {line}"))
    };
    let (elapsed, plug) = (field("elapsed_ms"), field("plug_ms"));
    assert!(plug <= elapsed, "{line}");
    eprintln!(
        "containerd handover: request->mounted in guest {elapsed} ms, of which hot-plug+mount {plug} ms"
    );

    // The pod VM is gone: the volume came back, mounted nowhere.
    assert_eq!(
        mount_at(&target).map(|m| m.0).as_deref(),
        Some("crust-volume-elsewhere"),
        "returned: the placeholder holds the target"
    );
    assert!(
        mount_at(&staging).is_none(),
        "returned without a host mount"
    );

    // kubelet: unpublish, then a host publication checks and mounts it.
    csi.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target_s.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    csi.node_stage_volume(stage).await.unwrap();
    csi.node_publish_volume(publish).await.unwrap();
    assert_eq!(mount_at(&staging).unwrap().1, "ext4");
    assert_eq!(
        std::fs::read_to_string(target.join("runc.txt")).unwrap(),
        "from-runc\n"
    );
    assert_eq!(
        std::fs::read_to_string(target.join("vm.txt")).unwrap(),
        "from-vm\n"
    );

    // A host process works in the target: the handover is declined, the
    // volume is shared over virtio-fs instead, and containerd's event
    // stream says why (issue 31).
    std::fs::create_dir_all(target.join("work")).unwrap();
    let sleeper = std::process::Command::new("sleep")
        .arg("120")
        .current_dir(target.join("work"))
        .spawn()
        .unwrap();
    let sleeper = crust_testkit::ChildGuard::new(sleeper);
    let events = env.ctrd.events("default");
    let o = env.ctrd.ctr_in(
        "default",
        &[
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            "--mount",
            &bind,
            BUSYBOX_IMAGE,
            "vm-fallback",
            "sh",
            "-c",
            "cat /data/vm.txt; awk '$2==\"/data\"{print $3}' /proc/mounts",
        ],
    );
    assert!(o.status.success(), "fallback: {o:?}\n{}", env.logs());
    assert_eq!(String::from_utf8_lossy(&o.stdout), "from-vm\nvirtiofs\n");
    assert_eq!(mount_at(&staging).unwrap().1, "ext4", "the host kept it");
    let out = events.lines();
    let line = out
        .iter()
        .find(|l| l.contains(crust_shim::task::FALLBACK_TOPIC))
        .unwrap_or_else(|| panic!("no fallback event: {out:?}\n{}", env.logs()));
    assert!(
        line.contains(&target_s) && line.contains(&format!("pid {}", sleeper.child_id())),
        "{line}"
    );
    drop(sleeper);

    csi.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target_s,
        ..Default::default()
    })
    .await
    .unwrap();
    csi.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging_s,
    })
    .await
    .unwrap();
    csi.delete_volume(csi::DeleteVolumeRequest {
        volume_id: id,
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(qemus_under(&env.runtime_root).is_empty());
}
