//! CSI v1.13's health API and v1.12's condition fields against the real
//! plugin, with real faults: a remounted-read-only filesystem, an unmounted
//! publication, a removed backing file, ext4 errors injected with debugfs
//! on the unmounted device, an XFS shutdown, and a pool filesystem that is
//! full, read-only or gone. Each fault is checked in both generations.
//!
//! Time budget: about 40 s on two busy cores (the 1,000-volume paging test
//! dominates).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::BTreeSet;
use std::process::Command;

use common::*;
use crust_proto::csi::v1 as csi;
use tonic::Code;

fn ctl_caps(r: csi::ControllerGetCapabilitiesResponse) -> BTreeSet<i32> {
    r.capabilities
        .into_iter()
        .filter_map(|c| {
            c.r#type
                .map(|csi::controller_service_capability::Type::Rpc(r)| r.r#type)
        })
        .collect()
}

fn node_caps(r: csi::NodeGetCapabilitiesResponse) -> BTreeSet<i32> {
    r.capabilities
        .into_iter()
        .filter_map(|c| {
            c.r#type
                .map(|csi::node_service_capability::Type::Rpc(r)| r.r#type)
        })
        .collect()
}

/// Capability values a strict client of each generation knows (the
/// released enums; v1.13 reserves controller 11 and node 4).
fn known(generation: &str) -> (BTreeSet<i32>, BTreeSet<i32>) {
    match generation {
        "1.12" => ((1..=15).collect(), (1..=6).collect()),
        "1.13" => (
            (1..=17).filter(|v| *v != 11).collect(),
            (1..=8).filter(|v| *v != 4).collect(),
        ),
        _ => unreachable!(),
    }
}

async fn node_health(
    c: &mut Clients,
    id: &str,
    publish: &str,
    staging: &str,
) -> Result<csi::VolumeHealth, tonic::Status> {
    c.node
        .node_get_volume_health(csi::NodeGetVolumeHealthRequest {
            volume_id: id.into(),
            volume_publish_path: publish.into(),
            staging_target_path: staging.into(),
        })
        .await
        .map(|r| r.into_inner().volume_health.expect("volume_health is set"))
}

async fn ctl_health(c: &mut Clients, id: &str) -> csi::VolumeHealth {
    c.ctl
        .controller_get_volume_health(csi::ControllerGetVolumeHealthRequest {
            volume_id: id.into(),
            secrets: Default::default(),
        })
        .await
        .unwrap()
        .into_inner()
        .volume_health
        .expect("volume_health is set")
}

/// (status name, reason) of every entry.
fn entries(h: &csi::VolumeHealth) -> Vec<(String, String)> {
    h.health_statuses
        .iter()
        .map(|e| {
            (
                csi::VolumeHealthErrorType::try_from(e.status)
                    .map(|s| s.as_str_name().to_string())
                    .unwrap_or_else(|_| e.status.to_string()),
                e.reason.clone(),
            )
        })
        .collect()
}

fn has(h: &csi::VolumeHealth, status: &str, reason: &str) -> bool {
    entries(h).iter().any(|(s, r)| s == status && r == reason)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_generation_sees_exactly_its_surface() {
    for generation in ["1.12", "1.13"] {
        let node = TestNode::with_args(&["--pool-capacity", "1Gi", "--csi-spec", generation]);
        let mut c = node.clients().await;
        let (ctl_known, node_known) = known(generation);
        let ctl = ctl_caps(
            c.ctl
                .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
                .await
                .unwrap()
                .into_inner(),
        );
        let nodes = node_caps(
            c.node
                .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
                .await
                .unwrap()
                .into_inner(),
        );
        // A strict client of this generation accepts every value.
        assert!(ctl.is_subset(&ctl_known), "{generation}: {ctl:?}");
        assert!(nodes.is_subset(&node_known), "{generation}: {nodes:?}");

        let v = c
            .create(create_req("gen", 16 * MIB, vec![mount("ext4")]))
            .await
            .unwrap();
        let staging = node.mkdir("staging");
        let target = node.path("target");
        let target = target.to_str().unwrap();
        c.stage(&v.volume_id, &staging, mount("ext4"))
            .await
            .unwrap();
        c.publish(&v.volume_id, &staging, target, mount("ext4"), false)
            .await
            .unwrap();
        let stats = c.stats(&v.volume_id, target).await.unwrap();
        let listed = c.list_all().await;
        let got = c
            .ctl
            .controller_get_volume(csi::ControllerGetVolumeRequest {
                volume_id: v.volume_id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        let health = node_health(&mut c, &v.volume_id, target, "").await;
        let storage = c
            .node
            .node_get_storage_health(csi::NodeGetStorageHealthRequest::default())
            .await;
        if generation == "1.12" {
            assert!(ctl.contains(&11) && nodes.contains(&4));
            assert!(!stats.volume_condition.unwrap().abnormal);
            assert!(
                listed[0]
                    .status
                    .as_ref()
                    .unwrap()
                    .volume_condition
                    .is_some()
            );
            assert!(got.status.unwrap().volume_condition.is_some());
            assert_code(health, Code::Unimplemented);
            assert_code(storage, Code::Unimplemented);
        } else {
            for v in [16, 17] {
                assert!(ctl.contains(&v), "controller {v}");
            }
            for v in [7, 8] {
                assert!(nodes.contains(&v), "node {v}");
            }
            assert!(stats.volume_condition.is_none(), "v1.13 reserves field 2");
            assert!(
                listed[0]
                    .status
                    .as_ref()
                    .unwrap()
                    .volume_condition
                    .is_none()
            );
            assert!(got.status.unwrap().volume_condition.is_none());
            let h = health.unwrap();
            assert_eq!(h.volume_id, v.volume_id);
            assert!(h.health_statuses.is_empty(), "{:?}", entries(&h));
            assert!(storage.unwrap().into_inner().backend_health.is_empty());
        }
        c.unpublish(&v.volume_id, target).await.unwrap();
        c.unstage(&v.volume_id, &staging).await.unwrap();
        c.delete(&v.volume_id).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_volume_is_not_found_before_any_path_check() {
    let node = TestNode::with_args(&["--pool-capacity", "1Gi"]);
    let mut c = node.clients().await;
    let unknown = "vol-00000000000000000000000000000000";
    assert_code(
        c.node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: unknown.into(),
                volume_path: "relative/path".into(),
                staging_target_path: "../x".into(),
                defer_fs_ops: false,
            })
            .await,
        Code::NotFound,
    );
    assert_code(
        node_health(&mut c, unknown, "not/absolute", "..").await,
        Code::NotFound,
    );
    assert_code(
        c.node
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: unknown.into(),
                volume_path: "relative/path".into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: -1,
                    limit_bytes: 0,
                }),
                ..Default::default()
            })
            .await,
        Code::NotFound,
    );
    assert_code(
        c.ctl
            .controller_get_volume_health(csi::ControllerGetVolumeHealthRequest {
                volume_id: unknown.into(),
                secrets: Default::default(),
            })
            .await,
        Code::NotFound,
    );
    // An empty id cannot be looked up: INVALID_ARGUMENT.
    assert_code(node_health(&mut c, "", "", "").await, Code::InvalidArgument);
    // Paths are compared as strings after the lookup: a relative one is
    // just a path where the volume is not.
    let v = c
        .create(create_req("known", 16 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let h = node_health(&mut c, &v.volume_id, "not/absolute", "..")
        .await
        .unwrap();
    assert!(has(&h, "INACCESSIBLE", "NotPublished"), "{:?}", entries(&h));
    assert!(has(&h, "INACCESSIBLE", "NotStaged"), "{:?}", entries(&h));
    // A path where the volume is not (yet) is reported, not refused.
    let h = node_health(&mut c, &v.volume_id, "/var/lib/kubelet/pods/p/x", "/s")
        .await
        .unwrap();
    assert!(has(&h, "INACCESSIBLE", "NotPublished"), "{:?}", entries(&h));
    assert!(has(&h, "INACCESSIBLE", "NotStaged"), "{:?}", entries(&h));
    c.delete(&v.volume_id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_faults_in_both_generations() {
    let node = TestNode::with_args(&["--pool-capacity", "4Gi", "--metrics-address", "127.0.0.1:0"]);
    let mut c = node.clients().await;
    let v = c
        .create(create_req("faults", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id.clone();
    let staging = node.mkdir("staging");
    let target = node.path("target");
    let target = target.to_str().unwrap().to_string();
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    let h = node_health(&mut c, &id, &target, &staging).await.unwrap();
    assert!(h.health_statuses.is_empty(), "{:?}", entries(&h));

    // 1. The filesystem is remounted read-only behind the plugin's back.
    let st = Command::new("mount")
        .args(["-o", "remount,ro", &staging])
        .status()
        .unwrap();
    assert!(st.success());
    let h = node_health(&mut c, &id, &target, "").await.unwrap();
    assert!(
        entries(&h)
            .iter()
            .any(|(s, r)| s == "DEGRADED" && r.ends_with("ReadOnly")),
        "{:?}",
        entries(&h)
    );
    // The gauge follows the v1.13 call alone...
    let metrics = http_get(metrics_address(&node), "/metrics").1;
    assert_eq!(
        sample(&metrics, "volume_stats_health_status_abnormal"),
        Some(1.0),
        "{metrics}"
    );
    // ...and the v1.12 condition says the same.
    let cond = c
        .stats(&id, &target)
        .await
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(
        cond.abnormal && cond.message.contains("read-only"),
        "{cond:?}"
    );
    let st = Command::new("mount")
        .args(["-o", "remount,rw", &staging])
        .status()
        .unwrap();
    assert!(st.success());
    assert!(
        node_health(&mut c, &id, &target, "")
            .await
            .unwrap()
            .health_statuses
            .is_empty()
    );

    // 2. The publication is unmounted outside the plugin.
    crust_blockdev::unmount(std::path::Path::new(&target)).unwrap();
    let h = node_health(&mut c, &id, &target, "").await.unwrap();
    assert!(has(&h, "INACCESSIBLE", "NotMounted"), "{:?}", entries(&h));
    let ctl = ctl_health(&mut c, &id).await;
    assert!(
        has(&ctl, "INACCESSIBLE", "NotMounted"),
        "{:?}",
        entries(&ctl)
    );
    let cond = c
        .stats(&id, &staging)
        .await
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(
        cond.abnormal && cond.message.contains("no longer mounted"),
        "{cond:?}"
    );
    c.unpublish(&id, &target).await.unwrap();

    // 3. ext4 errors recorded in the superblock (injected with debugfs on
    // the unmounted device), seen after the next stage.
    c.unstage(&id, &staging).await.unwrap();
    let img = img_of(&node, &id);
    let out = Command::new("debugfs")
        .args(["-w", "-R", "ssv error_count 3"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    let h = node_health(&mut c, &id, "", &staging).await.unwrap();
    assert!(
        has(&h, "DATA_LOSS", "FilesystemErrors"),
        "{:?}",
        entries(&h)
    );
    let listed = c
        .ctl
        .controller_list_volume_health(csi::ControllerListVolumeHealthRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1);
    assert!(has(&listed.entries[0], "DATA_LOSS", "FilesystemErrors"));
    let cond = c
        .stats(&id, &staging)
        .await
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(
        cond.abnormal && cond.message.contains("3 error"),
        "{cond:?}"
    );
    c.unstage(&id, &staging).await.unwrap();

    // 4. The backing file is removed: the data is gone.
    std::fs::remove_file(&img).unwrap();
    let ctl = ctl_health(&mut c, &id).await;
    assert!(
        has(&ctl, "INACCESSIBLE", "BackingStoreMissing"),
        "{:?}",
        entries(&ctl)
    );
    let old = c
        .ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let cond = old.status.unwrap().volume_condition.unwrap();
    assert!(
        cond.abnormal && cond.message.contains("missing"),
        "{cond:?}"
    );
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfs_shutdown_is_inaccessible() {
    let node = TestNode::with_args(&["--pool-capacity", "4Gi"]);
    let mut c = node.clients().await;
    let v = c
        .create(create_req("xfs", 320 * MIB, vec![mount("xfs")]))
        .await
        .unwrap();
    let staging = node.mkdir("staging");
    c.stage(&v.volume_id, &staging, mount("xfs")).await.unwrap();
    let st = Command::new("xfs_io")
        .args(["-x", "-c", "shutdown", &staging])
        .status()
        .unwrap();
    assert!(st.success());
    let h = node_health(&mut c, &v.volume_id, "", &staging)
        .await
        .unwrap();
    assert!(
        has(&h, "INACCESSIBLE", "FilesystemIoErrors"),
        "{:?}",
        entries(&h)
    );
    c.unstage(&v.volume_id, &staging).await.unwrap();
    c.delete(&v.volume_id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_health_reports_the_pool_filesystem() {
    let mut node = TestNode::unstarted(&["--pool-capacity", "4Gi"], "0s");
    // The pool lives on a filesystem of its own, small enough to fill.
    let disk = crust_testkit::LoopDisk::with_fs(
        node.path("poolfs.img"),
        64 << 20,
        crust_blockdev::FsType::Ext4,
    );
    let poolfs = node.path("poolfs");
    std::fs::create_dir_all(&poolfs).unwrap();
    let _mount = disk.mount(&poolfs, &[], false);
    node.pool = poolfs.join("pool");
    node.start();
    let mut c = node.clients().await;
    let storage = |r: csi::NodeGetStorageHealthResponse| -> Vec<(i32, String)> {
        r.backend_health
            .into_iter()
            .map(|b| (b.status, b.reason))
            .collect()
    };
    let degraded = csi::StorageHealthErrorType::StorageDegraded as i32;
    let unreachable = csi::StorageHealthErrorType::StorageUnreachable as i32;
    let ask = |mut c: Clients| async move {
        c.node
            .node_get_storage_health(csi::NodeGetStorageHealthRequest::default())
            .await
            .unwrap()
            .into_inner()
    };
    assert!(storage(ask(c.clone()).await).is_empty());

    // Volumes promised more than the pool's filesystem holds: each create
    // fits the free space, together they do not (sparse files).
    let a = c
        .create(create_req("a", 40 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    assert!(storage(ask(c.clone()).await).is_empty());
    let b = c
        .create(create_req("b", 40 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let got = storage(ask(c.clone()).await);
    assert!(
        got.contains(&(degraded, "PoolOvercommitted".into())),
        "{got:?}"
    );
    c.delete(&b.volume_id).await.unwrap();
    c.delete(&a.volume_id).await.unwrap();
    assert!(storage(ask(c.clone()).await).is_empty());

    // The pool's filesystem fills up.
    let filler = poolfs.join("filler");
    let _ = Command::new("fallocate")
        .args(["-l", "200M"])
        .arg(&filler)
        .status();
    let _ = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", filler.display()))
        .args(["bs=1M", "oflag=append", "conv=notrunc"])
        .stderr(std::process::Stdio::null())
        .status();
    let got = storage(ask(c.clone()).await);
    assert!(
        got.contains(&(degraded, "PoolFilesystemFull".into())),
        "{got:?}"
    );
    std::fs::remove_file(&filler).unwrap();

    // The pool's directory becomes read-only (a read-only bind over it:
    // remounting the filesystem itself is refused while the plugin holds
    // its lock file open for writing).
    for args in [
        vec!["--bind", poolfs.to_str().unwrap(), poolfs.to_str().unwrap()],
        vec!["-o", "remount,bind,ro", poolfs.to_str().unwrap()],
    ] {
        let st = Command::new("mount").args(&args).status().unwrap();
        assert!(st.success(), "mount {args:?}");
    }
    let got = storage(ask(c.clone()).await);
    assert!(got.contains(&(degraded, "PoolReadOnly".into())), "{got:?}");
    // The plugin may hold files open through the bind: detach it.
    rustix::mount::unmount(&poolfs, rustix::mount::UnmountFlags::DETACH).unwrap();
    assert!(storage(ask(c.clone()).await).is_empty());

    // The pool directory disappears.
    std::fs::remove_dir_all(&node.pool).unwrap();
    let got = storage(ask(c.clone()).await);
    assert!(
        got.contains(&(unreachable, "PoolUnavailable".into())),
        "{got:?}"
    );
    node.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_volume_health_pages_through_a_thousand_volumes_under_churn() {
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
                    .create(create_req(&format!("h-{i:04}"), MIB, vec![mount("ext4")]))
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
    // Every 20th volume loses its backing file.
    let broken: BTreeSet<String> = created.iter().step_by(20).cloned().collect();
    for id in &broken {
        std::fs::remove_file(img_of(&node, id)).unwrap();
    }
    let mut c = c;
    let churn = {
        let mut c = c.clone();
        tokio::spawn(async move {
            for i in 0..40 {
                let v = c
                    .create(create_req(&format!("churn-{i}"), MIB, vec![mount("ext4")]))
                    .await
                    .unwrap();
                c.delete(&v.volume_id).await.unwrap();
            }
        })
    };
    let mut seen: Vec<String> = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let r = c
            .ctl
            .controller_list_volume_health(csi::ControllerListVolumeHealthRequest {
                max_entries: 37,
                starting_token: token.clone(),
                secrets: Default::default(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(r.entries.len() <= 37);
        for h in &r.entries {
            assert!(
                has(h, "INACCESSIBLE", "BackingStoreMissing"),
                "{}: {:?}",
                h.volume_id,
                entries(h)
            );
            seen.push(h.volume_id.clone());
        }
        pages += 1;
        if r.next_token.is_empty() {
            break;
        }
        token = r.next_token;
    }
    churn.await.unwrap();
    let unique: BTreeSet<String> = seen.iter().cloned().collect();
    assert_eq!(unique.len(), seen.len(), "a volume appeared twice");
    // Every broken volume, once; beyond them only churned volumes, which a
    // page can catch between DeleteVolume removing the backing file and
    // the record (the spec allows anything for volumes changing meanwhile).
    assert!(unique.is_superset(&broken), "a broken volume is missing");
    let churned: BTreeSet<String> = (0..40)
        .map(|i| crust_csi::volume_id_for(&format!("churn-{i}")))
        .collect();
    let extra: BTreeSet<&String> = unique.difference(&broken).collect();
    assert!(
        extra.iter().all(|id| churned.contains(*id)),
        "healthy volumes listed: {extra:?}"
    );
    assert!(pages >= N / 37, "{pages} pages");
    assert_code(
        c.ctl
            .controller_list_volume_health(csi::ControllerListVolumeHealthRequest {
                max_entries: 5,
                starting_token: "bogus-token".into(),
                secrets: Default::default(),
            })
            .await,
        Code::Aborted,
    );
    assert_code(
        c.ctl
            .controller_list_volume_health(csi::ControllerListVolumeHealthRequest {
                max_entries: -1,
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    );
}

/// The pool image of volume `id` (named by its id: `vol-…` ids are safe).
fn img_of(node: &TestNode, id: &str) -> std::path::PathBuf {
    let p = node.pool.join(format!("{id}.img"));
    assert!(p.is_file(), "{} missing", p.display());
    p
}
