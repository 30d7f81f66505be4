//! Issue 10: data safety under hostile and unlucky inputs, against the
//! real `crust-csi` binary (pool backend on real loop devices, real mkfs
//! and mounts). Each test replays the original attack and checks the
//! refusal and that nothing changed (files, mounts, records, claims).
//! Budget: about 15 s for the file on 2 cores.

mod common;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::*;
use crust_proto::csi::v1 as csi;
use csi::volume_capability::access_mode::Mode;
use csi::volume_capability::{AccessType, MountVolume};
use tonic::Code;

fn mount_flags(fs: &str, flags: &[&str]) -> csi::VolumeCapability {
    mode_cap(
        AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            ..Default::default()
        }),
        Mode::SingleNodeWriter,
    )
}

fn record(node: &TestNode, id: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(node.state.join(format!("volumes/{id}.json"))).unwrap())
        .unwrap()
}

fn mount_options(p: &str) -> Vec<String> {
    crust_blockdev::find_mount(Path::new(p))
        .unwrap()
        .map(|m| m.mount_options)
        .unwrap_or_default()
}

/// Defect 2: a raw block NodeUnpublishVolume deleted a file (or device
/// node) it did not create. Now: an existing device node or a file with
/// data is refused as a target and left as it was; an empty file a CO
/// made is used and kept; a file the plugin created is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_block_targets_are_never_files_the_plugin_did_not_create() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("raw", 16 * MIB, vec![block()]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/raw");
    c.stage(&id, &staging, block()).await.unwrap();
    let pods = node.mkdir("pods");

    // A user's file with data: refused, untouched.
    let user_file = format!("{pods}/users-file");
    std::fs::write(&user_file, b"precious").unwrap();
    let s = assert_code(
        c.publish(&id, &staging, &user_file, block(), false).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("data"), "{}", s.message());
    assert_eq!(std::fs::read(&user_file).unwrap(), b"precious");
    assert!(!crust_blockdev::is_mountpoint(Path::new(&user_file)).unwrap());

    // A device node (as /dev/sda would be): refused, untouched.
    let node_path = format!("{pods}/sda");
    let loops = loops_under(node.dir.path());
    let (maj, min) = crust_blockdev::device_major_minor(&loops[0].path).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        node_path.as_str(),
        rustix::fs::FileType::BlockDevice,
        rustix::fs::Mode::from_raw_mode(0o600),
        rustix::fs::makedev(maj, min),
    )
    .unwrap();
    let s = assert_code(
        c.publish(&id, &staging, &node_path, block(), false).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("device node"), "{}", s.message());
    assert!(crust_blockdev::is_block_device(Path::new(&node_path)));
    // Unpublish of a path never published: nothing removed.
    c.unpublish(&id, &node_path).await.unwrap();
    c.unpublish(&id, &user_file).await.unwrap();
    assert!(crust_blockdev::is_block_device(Path::new(&node_path)));
    assert_eq!(std::fs::read(&user_file).unwrap(), b"precious");

    // An empty file the CO made: used, and kept after unpublish.
    let empty = format!("{pods}/co-made");
    std::fs::write(&empty, b"").unwrap();
    c.publish(&id, &staging, &empty, block(), false)
        .await
        .unwrap();
    c.publish(&id, &staging, &empty, block(), false)
        .await
        .unwrap();
    c.unpublish(&id, &empty).await.unwrap();
    assert!(Path::new(&empty).is_file(), "the CO's file is kept");

    // A target the plugin creates: recorded, and removed on unpublish.
    let fresh = format!("{pods}/fresh");
    c.publish(&id, &staging, &fresh, block(), false)
        .await
        .unwrap();
    assert_eq!(
        record(&node, &id)["created_targets"],
        serde_json::json!([fresh])
    );
    c.unpublish(&id, &fresh).await.unwrap();
    assert!(!Path::new(&fresh).exists());
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}

/// Defect 5: NodeUnpublishVolume unmounted whatever was mounted at the
/// recorded target and removed the directory. Now only this volume's own
/// bind (device numbers and root match) is unmounted; anything else is
/// FAILED_PRECONDITION and nothing changes. The same for unstage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_and_unstage_unmount_only_this_volumes_mounts() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("mine", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/mine");
    let target = format!("{}/t", node.mkdir("pods/u"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();

    // Someone else's filesystem now sits on the target.
    crust_blockdev::unmount(Path::new(&target)).unwrap();
    rustix::mount::mount(
        "tmpfs",
        target.as_str(),
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .unwrap();
    std::fs::write(format!("{target}/theirs"), b"x").unwrap();
    let before = record(&node, &id);
    let s = assert_code(c.unpublish(&id, &target).await, Code::FailedPrecondition);
    assert!(s.message().contains("tmpfs"), "{}", s.message());
    assert_eq!(std::fs::read(format!("{target}/theirs")).unwrap(), b"x");
    assert_eq!(record(&node, &id), before, "records unchanged");
    crust_blockdev::unmount(Path::new(&target)).unwrap();
    // Once it is gone, unpublish completes.
    c.unpublish(&id, &target).await.unwrap();

    // The same for the staging path.
    crust_blockdev::unmount(Path::new(&staging)).unwrap();
    rustix::mount::mount(
        "tmpfs",
        staging.as_str(),
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .unwrap();
    let before = record(&node, &id);
    assert_code(c.unstage(&id, &staging).await, Code::FailedPrecondition);
    assert!(crust_blockdev::is_mountpoint(Path::new(&staging)).unwrap());
    assert_eq!(record(&node, &id), before);
    assert_eq!(loops_under(node.dir.path()).len(), 1, "still attached");
    crust_blockdev::unmount(Path::new(&staging)).unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());

    // Also noted: host mounts are nosuid,nodev (bind included) unless the
    // flags ask otherwise.
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    for p in [&staging, &target] {
        let o = mount_options(p);
        assert!(
            o.iter().any(|x| x == "nosuid") && o.iter().any(|x| x == "nodev"),
            "{p}: {o:?}"
        );
    }
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}

/// Defect 6: `commit=99999999999999999999` passed the plugin's number
/// check and the kernel's EINVAL came back as INTERNAL. Now every
/// numeric option is checked against the kernel's bounds by the one
/// allow-list: INVALID_ARGUMENT at CreateVolume, and at NodeStageVolume
/// before anything is attached. Also noted: CreateVolume accepted a
/// `bind` flag that NodeStageVolume refused later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_and_refused_mount_flags_fail_early_and_change_nothing() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    for flags in [
        &["commit=99999999999999999999"][..],
        &["commit=2147484"],
        &["bind"],
        &["errors=panic"],
        &["journal_path=/dev/sda"],
        &["noatime,suid,nosuid"],
    ] {
        let s = assert_code(
            c.create(create_req(
                "flags",
                32 * MIB,
                vec![mount_flags("ext4", flags)],
            ))
            .await,
            Code::InvalidArgument,
        );
        assert!(
            s.message().contains("mount option"),
            "{flags:?}: {}",
            s.message()
        );
        assert!(c.list_all().await.is_empty(), "{flags:?}: nothing created");
    }
    let backing: Vec<_> = std::fs::read_dir(&node.pool)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("vol-"))
        .collect();
    assert!(backing.is_empty(), "no backing file allocated: {backing:?}");

    // A volume created without flags, staged with a bad one: refused
    // before the device is attached or anything mounted.
    let id = c
        .create(create_req("flags", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/flags");
    let s = assert_code(
        c.stage(
            &id,
            &staging,
            mount_flags("ext4", &["commit=99999999999999999999"]),
        )
        .await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("commit"), "{}", s.message());
    assert!(loops_under(node.dir.path()).is_empty(), "nothing attached");
    assert!(mounts_under(node.dir.path()).is_empty(), "nothing mounted");
    assert!(record(&node, &id)["staging"].is_null());
    // The kernel's own bound is accepted.
    c.stage(&id, &staging, mount_flags("ext4", &["commit=2147483"]))
        .await
        .unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}

/// Defect 7: the blank probe looked only at the first and last 128 KiB,
/// so a volume written as raw block in the middle and later staged as a
/// filesystem was formatted. Now the record remembers raw use, and such
/// a volume is never formatted; its data stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_used_as_raw_block_is_never_formatted() {
    let node = TestNode::new();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("both", 64 * MIB, vec![block(), mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/both");
    let target = format!("{}/dev", node.mkdir("pods/b"));
    c.stage(&id, &staging, block()).await.unwrap();
    c.publish(&id, &staging, &target, block(), false)
        .await
        .unwrap();
    // The workload writes raw data in the middle only (no signature).
    let payload: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + 3) as u8).collect();
    let dev = std::fs::OpenOptions::new()
        .write(true)
        .open(&target)
        .unwrap();
    dev.write_all_at(&payload, 32 * MIB as u64).unwrap();
    dev.sync_all().unwrap();
    drop(dev);
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();

    let s = assert_code(
        c.stage(&id, &staging, mount("ext4")).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("raw block"), "{}", s.message());
    assert!(mounts_under(node.dir.path()).is_empty());
    assert!(loops_under(node.dir.path()).is_empty(), "attach undone");
    // The data is where the workload left it; no filesystem was made.
    let backing = std::fs::read_dir(&node.pool)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains(&id))
        .unwrap();
    let mut got = vec![0u8; payload.len()];
    std::fs::File::open(&backing)
        .unwrap()
        .read_exact_at(&mut got, 32 * MIB as u64)
        .unwrap();
    assert_eq!(got, payload);
    let mut sb = [0u8; 2];
    std::fs::File::open(&backing)
        .unwrap()
        .read_exact_at(&mut sb, 1080)
        .unwrap();
    assert_ne!(sb, [0x53, 0xEF], "no ext4 superblock was written");
    assert_eq!(record(&node, &id)["raw_block_used"], true);
    c.delete(&id).await.unwrap();
}

/// Also noted: one plugin per state directory (a second one on the same
/// state, with another pool, would act on the same records); caller
/// strings are echoed bounded and without control bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_plugin_per_state_dir_and_bounded_echoes() {
    let mut node = TestNode::new();
    let first_pid = node.plugin.as_mut().unwrap().guard.child().id();
    let mut second = std::process::Command::new(env!("CARGO_BIN_EXE_crust-csi"));
    second
        .args(["--deferral", "disabled", "--node-id", NODE])
        .arg("--endpoint")
        .arg(format!("unix://{}", node.path("other.sock").display()))
        .arg("--state-dir")
        .arg(&node.state)
        .arg("--pool-dir")
        .arg(node.path("other-pool"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    // It must refuse to start (an old plugin would serve forever: bounded).
    let log = node.path("second.log");
    let child = second
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut guard = crust_testkit::ChildGuard::new(child);
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(st) = guard.child().try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "a second plugin started on the same state directory"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    drop(guard);
    assert!(!status.success());
    let err = std::fs::read_to_string(&log).unwrap();
    assert!(
        err.contains("in use by another crust-csi") && err.contains(&format!("pid {first_pid}")),
        "{err}"
    );
    assert!(!node.path("other.sock").exists());

    let mut c = node.clients().await;
    let hostile = format!("vol-\0\x1b[31m{}", "A".repeat(10_000));
    let s = assert_code(
        c.stage(&hostile, &node.mkdir("staging/x"), mount("ext4"))
            .await,
        Code::NotFound,
    );
    assert!(
        !s.message().contains('\0') && !s.message().contains('\x1b'),
        "{:?}",
        s.message()
    );
    assert!(s.message().len() < 1024, "{} bytes", s.message().len());
    // A known volume, so the path is checked (an unknown one is NOT_FOUND first).
    let known = c
        .create(create_req("echo", 16 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let s = assert_code(
        c.stage(
            &known,
            &format!("relative/\0{}", "B".repeat(5000)),
            mount("ext4"),
        )
        .await,
        Code::InvalidArgument,
    );
    assert!(
        !s.message().contains('\0') && s.message().len() < 1024,
        "{:?}",
        s.message()
    );
}

/// Also noted: `--allowed-target-prefix` was checked lexically, so a
/// symlinked component led a deferred target out of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_target_prefix_is_checked_after_symlinks() {
    let mut node = TestNode::deferral_unstarted("crust", &[]);
    let pods = node.mkdir("kubelet/pods");
    node.extra
        .extend(["--allowed-target-prefix".to_string(), pods.clone()]);
    node.start();
    let mut c = node.clients().await;
    let outside = node.mkdir("elsewhere");
    std::os::unix::fs::symlink(&outside, format!("{pods}/escape")).unwrap();
    let id = c
        .create(create_req("pfx", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/pfx");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    let ctx = HashMap::from([("deferFsOps".to_string(), "true".to_string())]);
    let publish = |target: String| {
        let mut c = c.clone();
        let (id, staging, ctx) = (id.clone(), staging.clone(), ctx.clone());
        async move {
            c.node
                .node_publish_volume(csi::NodePublishVolumeRequest {
                    volume_id: id,
                    staging_target_path: staging,
                    target_path: target,
                    volume_capability: Some(mount("ext4")),
                    volume_context: ctx,
                    defer_fs_ops: true,
                    ..Default::default()
                })
                .await
        }
    };
    let escaping = format!("{pods}/escape/mount");
    let s = assert_code(publish(escaping.clone()).await, Code::InvalidArgument);
    assert!(
        s.message().contains("outside the allowed prefixes"),
        "{}",
        s.message()
    );
    assert!(!Path::new(&format!("{outside}/mount")).exists());
    assert!(
        std::fs::read_dir(node.crust_root())
            .map(|d| d.count())
            .unwrap_or(0)
            == 0,
        "no record written"
    );
    assert!(
        crust_blockdev::is_mountpoint(Path::new(&staging)).unwrap(),
        "staging kept"
    );
    // A real directory below the prefix is fine.
    let inside = format!("{}/mount", node.mkdir("kubelet/pods/uid/volumes/pv"));
    publish(inside.clone()).await.unwrap();
    c.unpublish(&id, &inside).await.unwrap();
}

async fn publish_deferred(c: &mut Clients, id: &str, staging: &str, target: &str) {
    c.node
        .node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            target_path: target.into(),
            volume_capability: Some(mount("ext4")),
            volume_context: HashMap::from([("deferFsOps".to_string(), "true".to_string())]),
            defer_fs_ops: true,
            ..Default::default()
        })
        .await
        .unwrap();
}

fn abnormal_in_list(entries: &[csi::list_volumes_response::Entry], id: &str) -> Option<String> {
    entries
        .iter()
        .find(|e| e.volume.as_ref().is_some_and(|v| v.volume_id == id))
        .and_then(|e| e.status.as_ref())
        .and_then(|s| s.volume_condition.as_ref())
        .filter(|c| c.abnormal)
        .map(|c| c.message.clone())
}

/// Defects 3 and 4: a claim was released when stats text said "is not
/// running" (text a guest controls) or when the runtime did not know the
/// sandbox (a wrong runtime root). Now only the runtime's typed
/// `sandbox-state` = stopped, with the device free, releases it; the
/// health of a volume whose sandbox is stopped or unknown is abnormal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_released_only_on_proof_that_the_sandbox_stopped() {
    let mut node = TestNode::deferral_unstarted("crust", &[]);
    // The runtime finds the records (right hand-off root) but its sandbox
    // root is the wrong one.
    let wrong_root = node.mkdir("wrong-runtime-root");
    node.env.push(("CRUST_RUNTIME_ROOT".into(), wrong_root));
    let crust_root = node.crust_root().to_str().unwrap().to_string();
    node.env
        .push(("CRUST_RUNTIME_CRUST_ROOT".into(), crust_root));
    node.start();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("claims", 32 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/claims");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    let pods = node.mkdir("pods/uid/volumes");
    let store = crust_store(&node.crust_root());

    // Defect 4: the real crust-runtime, whose root does not know the
    // claimant (crust-csi started with the wrong CRUST_RUNTIME_ROOT).
    let t1 = format!("{pods}/pv-a");
    publish_deferred(&mut c, &id, &staging, &t1).await;
    let runtime = crust_testkit::workspace_bin("crust-runtime");
    consume(&node.crust_root(), &t1, "sb-live", &runtime);
    let s = assert_code(c.unpublish(&id, &t1).await, Code::FailedPrecondition);
    assert!(
        s.message().contains("still claimed by sandbox sb-live")
            && s.message().contains("does not know"),
        "{}",
        s.message()
    );
    assert_eq!(store.claimant(&t1).unwrap().as_deref(), Some("sb-live"));
    assert!(Path::new(&t1).is_dir());
    let m = abnormal_in_list(&c.list_all().await, &id).expect("abnormal");
    assert!(m.contains("unknown to its runtime"), "{m}");
    let got = c
        .get(&id)
        .await
        .unwrap()
        .status
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(got.abnormal, "{got:?}");
    store.release(&t1, "sb-live").unwrap();
    c.unpublish(&id, &t1).await.unwrap();

    // Defect 3: stats say "is not running" (what a guest can make them
    // say), while the runtime's sandbox-state says running.
    let t2 = format!("{pods}/pv-b");
    publish_deferred(&mut c, &id, &staging, &t2).await;
    let not_mounted = node.mkdir("guest-view");
    let write_map = |behaviour: &str| {
        let map = serde_json::json!({ &t2: {
            "mount": not_mounted, "sandbox": "sb-guest", "behaviour": behaviour,
        }});
        std::fs::write(node.cli_map(), map.to_string()).unwrap();
    };
    write_map("running");
    consume(&node.crust_root(), &t2, "sb-guest", &runtime_cli());
    let st = c
        .node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: t2.clone(),
            defer_fs_ops: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        st.volume_condition
            .unwrap()
            .message
            .contains("is not running")
    );
    let s = assert_code(c.unpublish(&id, &t2).await, Code::FailedPrecondition);
    assert!(s.message().contains("serves the volume"), "{}", s.message());
    assert_eq!(store.claimant(&t2).unwrap().as_deref(), Some("sb-guest"));
    assert!(abnormal_in_list(&c.list_all().await, &id).is_none());

    // The sandbox stops: abnormal at the next poll, and the claim goes.
    write_map("stopped");
    let m = abnormal_in_list(&c.list_all().await, &id).expect("abnormal");
    assert!(m.contains("stopped"), "{m}");
    c.unpublish(&id, &t2).await.unwrap();
    assert!(
        !node
            .crust_root()
            .join(crust_handoff::crust_key(&t2))
            .exists()
    );
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}
