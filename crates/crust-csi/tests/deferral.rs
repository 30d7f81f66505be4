//! KEP-2857 deferred filesystem operations, against the real `crust-csi`
//! binary (pool backend on real loop devices, real mkfs and mounts, a
//! unix socket), with crust_ops in process writing real hand-off records
//! under the node's tempdir. The tests play the pod's runtime: they claim
//! a record with crust-handoff, record `crust-test-runtime-cli` as its
//! `runtime-cli`, and mount the device themselves where the guest would.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::collections::{BTreeSet, HashMap};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::*;
use crust_proto::csi::v1 as csi;
use csi::volume_capability::access_mode::Mode;
use csi::volume_capability::{AccessType, MountVolume};
use tonic::Code;

const DEFER_KEY: &str = "deferFsOps";

/// A mount capability with KEP-2857 supplemental group fields and flags.
fn mount_with(fs: &str, group: &str, policy: &str, flags: &[&str]) -> csi::VolumeCapability {
    mode_cap(
        AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            volume_supplemental_group: group.into(),
            volume_supplemental_group_change_policy: policy.into(),
            ..Default::default()
        }),
        Mode::SingleNodeWriter,
    )
}

fn defer_ctx() -> HashMap<String, String> {
    HashMap::from([(DEFER_KEY.to_string(), "true".to_string())])
}

/// CreateVolume with the StorageClass parameter `deferFsOps: "true"`;
/// returns the id and the volume context the CO passes to the node.
async fn create_deferred(
    c: &mut Clients,
    name: &str,
    bytes: i64,
    fs: &str,
) -> (String, HashMap<String, String>) {
    let mut r = create_req(name, bytes, vec![mount(fs)]);
    r.parameters.insert(DEFER_KEY.into(), "true".into());
    let v = c.create(r.clone()).await.unwrap();
    // idempotent, same context
    let again = c.create(r).await.unwrap();
    assert_eq!(again.volume_context, v.volume_context);
    (v.volume_id, v.volume_context)
}

async fn stage_ctx(
    c: &mut Clients,
    id: &str,
    staging: &str,
    cap: csi::VolumeCapability,
    ctx: &HashMap<String, String>,
) -> Result<(), tonic::Status> {
    c.node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            volume_capability: Some(cap),
            volume_context: ctx.clone(),
            ..Default::default()
        })
        .await
        .map(drop)
}

#[derive(Clone)]
struct Pub<'a> {
    id: &'a str,
    staging: &'a str,
    target: &'a str,
    cap: csi::VolumeCapability,
    ctx: HashMap<String, String>,
    defer: bool,
    readonly: bool,
}

impl Pub<'_> {
    async fn send(&self, c: &mut Clients) -> Result<(), tonic::Status> {
        c.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: self.id.into(),
                staging_target_path: self.staging.into(),
                target_path: self.target.into(),
                volume_capability: Some(self.cap.clone()),
                readonly: self.readonly,
                volume_context: self.ctx.clone(),
                defer_fs_ops: self.defer,
                ..Default::default()
            })
            .await
            .map(drop)
    }
}

async fn unpublish_flag(
    c: &mut Clients,
    id: &str,
    target: &str,
    defer: bool,
) -> Result<(), tonic::Status> {
    c.node
        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: id.into(),
            target_path: target.into(),
            defer_fs_ops: defer,
        })
        .await
        .map(drop)
}

async fn stats_flag(
    c: &mut Clients,
    id: &str,
    path: &str,
    defer: bool,
) -> Result<csi::NodeGetVolumeStatsResponse, tonic::Status> {
    c.node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            defer_fs_ops: defer,
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner())
}

fn expand_req(
    id: &str,
    path: &str,
    staging: &str,
    fs: &str,
    required: i64,
    defer: bool,
) -> csi::NodeExpandVolumeRequest {
    csi::NodeExpandVolumeRequest {
        volume_id: id.into(),
        volume_path: path.into(),
        staging_target_path: staging.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: required,
            limit_bytes: 0,
        }),
        volume_capability: Some(mount(fs)),
        defer_fs_ops: defer,
        ..Default::default()
    }
}

fn crust_record(node: &TestNode, target: &str) -> PathBuf {
    node.crust_root().join(crust_handoff::crust_key(target))
}

fn kata_record(node: &TestNode, target: &str) -> PathBuf {
    node.kata_root().join(crust_handoff::kata_key(target))
}

fn mode_of(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

fn is_mountpoint(p: &str) -> bool {
    crust_blockdev::is_mountpoint(Path::new(p)).unwrap()
}

/// The target of a deferred publication: the plugin's read-only
/// placeholder (a tiny tmpfs named `crust-volume-elsewhere` holding only a
/// README), never a writable host directory nor the volume.
#[track_caller]
fn assert_empty_target(target: &str) {
    let m = std::fs::symlink_metadata(target).unwrap();
    assert!(m.is_dir(), "{target} is a directory");
    let top = crust_blockdev::find_mount(Path::new(target))
        .unwrap()
        .unwrap_or_else(|| panic!("the placeholder is mounted on {target}"));
    assert_eq!(
        (top.fs_type.as_str(), top.source.as_str()),
        ("tmpfs", PLACEHOLDER),
        "{target} shows the placeholder"
    );
    let names: Vec<_> = std::fs::read_dir(target)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["README"], "{target} holds only the README");
    let e = std::fs::write(Path::new(target).join("x"), b"x").unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::ENOSPC),
        "no data fits on {target}"
    );
}

/// The tmpfs source name of the plugin's placeholder.
const PLACEHOLDER: &str = "crust-volume-elsewhere";

/// Mounts under the node other than placeholders (host mounts of volumes).
fn host_mounts_under(dir: &Path) -> Vec<PathBuf> {
    mounts_under(dir)
        .into_iter()
        .filter(|p| {
            crust_blockdev::find_mount(p)
                .ok()
                .flatten()
                .is_none_or(|m| m.source != PLACEHOLDER)
        })
        .collect()
}

/// The single loop device of the node's pool.
fn the_loop(node: &TestNode) -> crust_blockdev::LoopStatus {
    let loops = loops_under(node.dir.path());
    assert_eq!(loops.len(), 1, "{loops:?}");
    loops.into_iter().next().unwrap()
}

fn node_caps_of(resp: csi::NodeGetCapabilitiesResponse) -> BTreeSet<i32> {
    resp.capabilities
        .into_iter()
        .filter_map(|c| {
            c.r#type
                .map(|csi::node_service_capability::Type::Rpc(r)| r.r#type)
        })
        .collect()
}

async fn node_caps(c: &mut Clients) -> BTreeSet<i32> {
    node_caps_of(
        c.node
            .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner(),
    )
}

fn usage(r: &csi::NodeGetVolumeStatsResponse, unit: csi::volume_usage::Unit) -> csi::VolumeUsage {
    *r.usage
        .iter()
        .find(|u| u.unit == unit as i32)
        .unwrap_or_else(|| panic!("no {unit:?} usage in {r:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defer_capabilities_are_advertised_only_when_enabled() {
    use csi::node_service_capability::rpc::Type as N;
    let kep: BTreeSet<i32> = [
        N::DeferFsOps,
        N::DeferFsOpsWithSupplementalGroup,
        N::DeferFsOpsWithSupplementalGroupChangePolicy,
    ]
    .into_iter()
    .map(|t| t as i32)
    .collect();
    // Out of every released CSI range (v1.13 gives 7 and 8 to health).
    assert_eq!(kep, BTreeSet::from([2857, 2858, 2859]));

    let on = TestNode::deferral("crust", &[]);
    let off = TestNode::with_args(&["--deferral", "disabled"]);
    let with = node_caps(&mut on.clients().await).await;
    let without = node_caps(&mut off.clients().await).await;
    for (node, want) in [(&on, "enabled"), (&off, "disabled")] {
        let info = node
            .clients()
            .await
            .id
            .get_plugin_info(csi::GetPluginInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            info.manifest.get("deferral").map(String::as_str),
            Some(want)
        );
    }
    assert!(without.is_disjoint(&kep), "{without:?}");
    assert_eq!(
        with,
        without.union(&kep).copied().collect::<BTreeSet<_>>(),
        "enabled adds exactly the three KEP capabilities"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_deferral_stages_without_mounting_and_publish_writes_the_crust_record() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let (id, ctx) = create_deferred(&mut c, "ctx-ext4", 64 * MIB, "ext4").await;
    assert_eq!(ctx.get(DEFER_KEY).map(String::as_str), Some("true"));
    assert_eq!(ctx.get("fsType").map(String::as_str), Some("ext4"));

    // --- stage: attached and formatted, never mounted ---
    let staging = node.mkdir("staging/ctx");
    for _ in 0..2 {
        stage_ctx(&mut c, &id, &staging, mount("ext4"), &ctx)
            .await
            .unwrap();
    }
    assert!(!is_mountpoint(&staging));
    assert!(mounts_under(node.dir.path()).is_empty());
    let lo = the_loop(&node);
    assert_eq!(
        crust_blockdev::probe_fs(&lo.path).unwrap().fs_type(),
        Some(crust_blockdev::FsType::Ext4),
        "stage formatted the blank volume"
    );
    // the staging path is no filesystem to measure on the host
    assert_code(c.stats(&id, &staging).await, Code::FailedPrecondition);

    // --- publish: the CRUST record, byte-exact; the target stays empty ---
    let pods = node.mkdir("pods/uid-1/volumes");
    let target = format!("{pods}/pv-ctx");
    let p = Pub {
        id: &id,
        staging: &staging,
        target: &target,
        cap: mount_with("ext4", "100", "OnRootMismatch", &["noatime"]),
        ctx: ctx.clone(),
        defer: false, // today's kubelet: only the volume context says so
        readonly: false,
    };
    for _ in 0..2 {
        p.send(&mut c).await.unwrap();
    }
    let dir = crust_record(&node, &target);
    let want = with_device_identity(
        &format!(
            r#"{{"volume-type":"block","device":"{}","fstype":"ext4","metadata":{{"fsGroup":"100","fsGroupChangePolicy":"OnRootMismatch"}},"options":["noatime"]}}"#,
            lo.path.display()
        ),
        &lo.path,
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("mountInfo.json")).unwrap(),
        want
    );
    assert_eq!(mode_of(&dir), 0o700);
    assert_eq!(mode_of(&dir.join("mountInfo.json")), 0o600);
    assert_eq!(std::fs::read_dir(node.crust_root()).unwrap().count(), 1);
    assert_empty_target(&target);
    assert!(
        host_mounts_under(node.dir.path()).is_empty(),
        "nothing mounted on the host"
    );
    assert_code(c.unstage(&id, &staging).await, Code::FailedPrecondition);

    // --- the guest uses the volume ---
    let mut guest = GuestMount::new(&lo.path, &node.path("guest/ctx"), "ext4");
    std::fs::write(guest.dir.join("from-guest"), b"written in the sandbox").unwrap();
    guest.unmount();

    // --- unpublish (no defer_fs_ops: the records know) ---
    for _ in 0..2 {
        c.unpublish(&id, &target).await.unwrap();
    }
    assert!(!dir.exists(), "hand-off record removed");
    assert!(!Path::new(&target).exists(), "target removed");

    // --- unstage: refused while a "guest" still holds the device ---
    let mut guest = GuestMount::new(&lo.path, &node.path("guest/ctx"), "ext4");
    let s = assert_code(c.unstage(&id, &staging).await, Code::FailedPrecondition);
    assert!(s.message().contains("detach"), "{}", s.message());
    assert_eq!(the_loop(&node).path, lo.path, "still attached");
    guest.unmount();
    for _ in 0..2 {
        c.unstage(&id, &staging).await.unwrap();
    }
    assert!(loops_under(node.dir.path()).is_empty());

    // --- data survives restage + republish to another pod ---
    stage_ctx(&mut c, &id, &staging, mount("ext4"), &ctx)
        .await
        .unwrap();
    let target2 = format!("{}/pv-ctx", node.mkdir("pods/uid-2/volumes"));
    Pub {
        target: &target2,
        cap: mount("ext4"),
        ..p.clone()
    }
    .send(&mut c)
    .await
    .unwrap();
    let lo2 = the_loop(&node);
    assert_eq!(
        std::fs::read_to_string(crust_record(&node, &target2).join("mountInfo.json")).unwrap(),
        with_device_identity(
            &format!(
                r#"{{"volume-type":"block","device":"{}","fstype":"ext4"}}"#,
                lo2.path.display()
            ),
            &lo2.path,
        )
    );
    let mut guest = GuestMount::new(&lo2.path, &node.path("guest/ctx"), "ext4");
    assert_eq!(
        std::fs::read(guest.dir.join("from-guest")).unwrap(),
        b"written in the sandbox"
    );
    guest.unmount();
    c.unpublish(&id, &target2).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
    assert!(
        std::fs::read_dir(node.crust_root())
            .unwrap()
            .next()
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_deferral_unmounts_the_staging_mount_and_a_host_publish_remounts_it() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    // an ordinary volume: no deferFsOps in its context
    let v = c
        .create(create_req("req", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id;
    assert!(!v.volume_context.contains_key(DEFER_KEY));
    let staging = node.mkdir("staging/req");
    let pods = node.mkdir("pods");
    let (t1, t2, t3) = (
        format!("{pods}/host1"),
        format!("{pods}/sandbox"),
        format!("{pods}/host2"),
    );
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert!(is_mountpoint(&staging));
    c.publish(&id, &staging, &t1, mount("ext4"), false)
        .await
        .unwrap();
    std::fs::write(format!("{t1}/from-host"), b"host").unwrap();
    let lo = the_loop(&node);

    // a deferred publication while the host has the filesystem: refused
    let deferred = Pub {
        id: &id,
        staging: &staging,
        target: &t2,
        cap: mount("ext4"),
        ctx: v.volume_context.clone(),
        defer: true,
        readonly: false,
    };
    let s = assert_code(deferred.send(&mut c).await, Code::FailedPrecondition);
    assert!(s.message().contains("two kernels"), "{}", s.message());
    assert!(
        is_mountpoint(&staging) && is_mountpoint(&t1),
        "nothing changed"
    );
    assert!(!Path::new(&t2).exists());
    assert!(!crust_record(&node, &t2).exists());

    // without host publications the staging mount is synced and removed
    c.unpublish(&id, &t1).await.unwrap();
    for _ in 0..2 {
        deferred.send(&mut c).await.unwrap();
    }
    assert!(!is_mountpoint(&staging), "staging unmounted for deferral");
    assert!(host_mounts_under(node.dir.path()).is_empty());
    assert_empty_target(&t2);
    assert_eq!(
        std::fs::read_to_string(crust_record(&node, &t2).join("mountInfo.json")).unwrap(),
        with_device_identity(
            &format!(
                r#"{{"volume-type":"block","device":"{}","fstype":"ext4"}}"#,
                lo.path.display()
            ),
            &lo.path,
        )
    );
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(node.state.join(format!("volumes/{id}.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(state["staging"]["host_mount"], "unmounted_for_deferral");
    assert_eq!(state["published"][&t2]["deferred"], true);

    // the host may not mount it while the sandbox may have it
    let s = assert_code(
        c.publish(&id, &staging, &t3, mount("ext4"), false).await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("two kernels"), "{}", s.message());
    assert!(!Path::new(&t3).exists());
    assert_code(c.stats(&id, &staging).await, Code::FailedPrecondition);
    // kubelet repeats NodeStageVolume: still no host mount
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert!(!is_mountpoint(&staging));

    // the guest sees the host's data and adds its own
    let mut guest = GuestMount::new(&lo.path, &node.path("guest/req"), "ext4");
    assert_eq!(std::fs::read(guest.dir.join("from-host")).unwrap(), b"host");
    std::fs::write(guest.dir.join("from-guest"), b"guest").unwrap();
    guest.unmount();

    unpublish_flag(&mut c, &id, &t2, true).await.unwrap();
    assert!(!crust_record(&node, &t2).exists());
    assert!(!Path::new(&t2).exists());

    // a host publication mounts the staging path again first
    c.publish(&id, &staging, &t3, mount("ext4"), false)
        .await
        .unwrap();
    assert!(is_mountpoint(&staging) && is_mountpoint(&t3));
    assert_eq!(std::fs::read(format!("{t3}/from-host")).unwrap(), b"host");
    assert_eq!(std::fs::read(format!("{t3}/from-guest")).unwrap(), b"guest");
    let st = c.stats(&id, &t3).await.unwrap();
    assert!(!st.volume_condition.unwrap().abnormal);

    // unstage of a stage unmounted for deferral: no mount to remove
    c.unpublish(&id, &t3).await.unwrap();
    deferred.send(&mut c).await.unwrap();
    assert!(!is_mountpoint(&staging));
    unpublish_flag(&mut c, &id, &t2, true).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
    assert!(mounts_under(node.dir.path()).is_empty());
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kata_and_both_layouts_write_their_records() {
    for layout in ["kata", "both"] {
        let node = TestNode::deferral(layout, &[]);
        let mut c = node.clients().await;
        let (id, ctx) = create_deferred(&mut c, "kata", 64 * MIB, "ext4").await;
        let staging = node.mkdir("staging/k");
        stage_ctx(&mut c, &id, &staging, mount("ext4"), &ctx)
            .await
            .unwrap();
        let target = format!("{}/pv", node.mkdir("pods/uid/volumes"));
        let p = Pub {
            id: &id,
            staging: &staging,
            target: &target,
            cap: mount_with("ext4", "2000", "Always", &[]),
            ctx: ctx.clone(),
            defer: true,
            readonly: true,
        };
        p.send(&mut c).await.unwrap();
        p.send(&mut c).await.unwrap();
        let lo = the_loop(&node);
        let want = with_device_identity(
            &format!(
                r#"{{"volume-type":"block","device":"{}","fstype":"ext4","metadata":{{"fsGroup":"2000","fsGroupChangePolicy":"Always"}},"options":["ro"]}}"#,
                lo.path.display()
            ),
            &lo.path,
        );
        let kata = kata_record(&node, &target);
        // Kata's Rust runtime takes only `directvol` in its layout.
        assert_eq!(
            std::fs::read_to_string(kata.join("mountInfo.json")).unwrap(),
            want.replace(r#""volume-type":"block""#, r#""volume-type":"directvol""#),
            "{layout}"
        );
        assert_eq!(mode_of(&kata), 0o700);
        assert_eq!(mode_of(&kata.join("mountInfo.json")), 0o600);
        let crust = crust_record(&node, &target);
        if layout == "both" {
            assert_eq!(
                std::fs::read_to_string(crust.join("mountInfo.json")).unwrap(),
                want
            );
        } else {
            assert!(!crust.exists(), "kata only");
        }
        assert_empty_target(&target);
        // no sandbox consumed it yet
        let s = assert_code(
            stats_flag(&mut c, &id, &target, true).await,
            Code::FailedPrecondition,
        );
        assert!(s.message().contains("not consumed"), "{}", s.message());

        unpublish_flag(&mut c, &id, &target, true).await.unwrap();
        assert!(
            !kata.exists() && !crust.exists(),
            "{layout}: records removed"
        );
        assert!(!Path::new(&target).exists());
        c.unstage(&id, &staging).await.unwrap();
        c.delete(&id).await.unwrap();
        assert!(loops_under(node.dir.path()).is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_and_expansion_go_through_crust_ops_and_the_runtime_cli() {
    let cli = runtime_cli();
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let (size, grown) = (320 * MIB, 400 * MIB);
    let (id, ctx) = create_deferred(&mut c, "grow", size, "xfs").await;
    let staging = node.mkdir("staging/g");
    stage_ctx(&mut c, &id, &staging, mount("xfs"), &ctx)
        .await
        .unwrap();
    let target = format!("{}/pv", node.mkdir("pods/uid/volumes"));
    Pub {
        id: &id,
        staging: &staging,
        target: &target,
        cap: mount("xfs"),
        ctx: ctx.clone(),
        defer: true,
        readonly: false,
    }
    .send(&mut c)
    .await
    .unwrap();

    // before a runtime consumed the record: FAILED_PRECONDITION, whether
    // the request says defer_fs_ops or only the records do
    for flag in [true, false] {
        let s = assert_code(
            stats_flag(&mut c, &id, &target, flag).await,
            Code::FailedPrecondition,
        );
        assert!(
            s.message().contains("not consumed by a runtime yet"),
            "{}",
            s.message()
        );
    }
    assert_code(
        c.node
            .node_expand_volume(expand_req(&id, &target, &staging, "xfs", size, true))
            .await,
        Code::FailedPrecondition,
    );

    // the runtime takes the volume: mounts it in its "guest", claims the
    // record and records its CLI
    let lo = the_loop(&node);
    let guest = GuestMount::new(&lo.path, &node.path("guest/g"), "xfs");
    let map = serde_json::json!({
        &target: {
            "mount": guest.dir,
            "backing": lo.backing_file,
            "loop": lo.path,
            "sandbox": "sandbox-1",
        }
    });
    std::fs::write(node.cli_map(), map.to_string()).unwrap();
    consume(&node.crust_root(), &target, "sandbox-1", &cli);
    std::fs::write(guest.dir.join("blob"), vec![7u8; 8 << 20]).unwrap();
    rustix::fs::sync();

    for flag in [true, false] {
        let st = stats_flag(&mut c, &id, &target, flag).await.unwrap();
        let fs = crust_blockdev::usage(&guest.dir).unwrap();
        let b = usage(&st, csi::volume_usage::Unit::Bytes);
        let i = usage(&st, csi::volume_usage::Unit::Inodes);
        // the guest's statvfs (xfs may settle a few blocks in between)
        assert_eq!(b.total, fs.bytes_total as i64, "{b:?}");
        assert!((b.used - fs.bytes_used as i64).abs() <= MIB, "{b:?} {fs:?}");
        assert!(
            (b.available - fs.bytes_available as i64).abs() <= MIB,
            "{b:?} {fs:?}"
        );
        assert_eq!(
            (i.total, i.used, i.available),
            (
                fs.inodes_total as i64,
                fs.inodes_used as i64,
                fs.inodes_free as i64
            )
        );
        assert!(b.used >= 8 << 20, "{b:?}");
        let cond = st.volume_condition.unwrap();
        assert!(!cond.abnormal, "{}", cond.message);
        assert_eq!(cond.message, "mounted", "the runtime's condition");
    }

    // An error object printed with exit status 0 (Kata's CLI when its
    // shim fails or a claim is wrong) or an empty answer is an error,
    // never a healthy volume without figures.
    for (behaviour, why) in [
        ("kata-error", "answered an error: NOT_FOUND"),
        ("empty", "no usage"),
    ] {
        let mut m = map.clone();
        m[&target]["behaviour"] = behaviour.into();
        std::fs::write(node.cli_map(), m.to_string()).unwrap();
        let s = assert_code(stats_flag(&mut c, &id, &target, true).await, Code::Internal);
        assert!(s.message().contains(why), "{behaviour}: {}", s.message());
    }
    std::fs::write(node.cli_map(), map.to_string()).unwrap();

    // grow: the controller grows the backing file, the node refreshes the
    // loop device, the runtime grows the filesystem in its guest
    let r = c
        .ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: grown,
                limit_bytes: 0,
            }),
            volume_capability: Some(mount("xfs")),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, grown);
    assert!(r.node_expansion_required);
    // (the pool backend already refreshes an attached loop device; the
    // node refreshes it again, which covers a controller that crashed
    // between growing the file and LOOP_SET_CAPACITY)
    let before = fs_total(&guest.dir);
    for _ in 0..2 {
        let r = c
            .node
            .node_expand_volume(expand_req(&id, &target, &staging, "xfs", grown, true))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.capacity_bytes, grown);
    }
    assert_eq!(dev_size(&lo.path), grown as u64, "device refreshed");
    let after = fs_total(&guest.dir);
    assert!(
        after >= before + 70 * MIB as u64 && after <= grown as u64,
        "filesystem grew in the guest: {before} -> {after}"
    );
    let st = stats_flag(&mut c, &id, &target, true).await.unwrap();
    assert_eq!(
        usage(&st, csi::volume_usage::Unit::Bytes).total as u64,
        after
    );
    // more than the device holds
    assert_code(
        c.node
            .node_expand_volume(expand_req(&id, &target, &staging, "xfs", 2 * grown, true))
            .await,
        Code::OutOfRange,
    );
    assert_eq!(
        std::fs::read(guest.dir.join("blob")).unwrap().len(),
        8 << 20
    );

    let mut guest = guest;
    guest.unmount();
    c.unpublish(&id, &target).await.unwrap();
    assert!(!crust_record(&node, &target).exists());
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn story5_unpublish_after_a_downgrade_cleans_up_the_record() {
    let mut node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let (id, ctx) = create_deferred(&mut c, "downgrade", 64 * MIB, "ext4").await;
    let staging = node.mkdir("staging/d");
    stage_ctx(&mut c, &id, &staging, mount("ext4"), &ctx)
        .await
        .unwrap();
    let pods = node.mkdir("pods");
    let target = format!("{pods}/pod");
    let p = Pub {
        id: &id,
        staging: &staging,
        target: &target,
        cap: mount("ext4"),
        ctx: ctx.clone(),
        defer: true,
        readonly: false,
    };
    p.send(&mut c).await.unwrap();
    let record = crust_record(&node, &target);
    assert!(record.join("mountInfo.json").is_file());
    drop(c);

    // the plugin is downgraded (restarted without deferral), node not drained
    assert!(node.stop().success());
    let flag = node.extra.iter().position(|a| a == "--deferral").unwrap();
    node.extra[flag + 1] = "disabled".into();
    node.start();
    let mut c = node.clients().await;
    assert!(
        !node_caps(&mut c)
            .await
            .contains(&(csi::node_service_capability::rpc::Type::DeferFsOps as i32))
    );
    // stats are not deferred any more (kubelet would not ask)
    let s = assert_code(c.stats(&id, &target).await, Code::FailedPrecondition);
    assert!(
        s.message()
            .contains("plugin does not support deferred filesystem operations"),
        "{}",
        s.message()
    );
    // story 6: a new deferred publication fails, never a host mount
    let other = format!("{pods}/other");
    let s = assert_code(
        Pub {
            target: &other,
            ..p.clone()
        }
        .send(&mut c)
        .await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message()
            .contains("plugin does not support deferred filesystem operations"),
        "{}",
        s.message()
    );
    assert!(!Path::new(&other).exists());
    assert!(host_mounts_under(node.dir.path()).is_empty());

    // kubelet unpublishes without defer_fs_ops: success, record cleaned up
    for _ in 0..2 {
        c.unpublish(&id, &target).await.unwrap();
    }
    assert!(!record.exists(), "hand-off record removed");
    assert!(!Path::new(&target).exists());
    c.unstage(&id, &staging).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impossible_deferral_is_an_error_never_a_host_mount() {
    // --deferral disabled: FAILED_PRECONDITION (KEP story 6)
    let node = TestNode::with_args(&["--deferral", "disabled"]);
    let mut c = node.clients().await;
    let id = c
        .create(create_req("plain", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/p");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    let target = format!("{}/t", node.mkdir("pods"));
    let s = assert_code(
        Pub {
            id: &id,
            staging: &staging,
            target: &target,
            cap: mount_with("ext4", "100", "", &[]),
            ctx: HashMap::new(),
            defer: true,
            readonly: false,
        }
        .send(&mut c)
        .await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message()
            .contains("plugin does not support deferred filesystem operations"),
        "{}",
        s.message()
    );
    assert!(!Path::new(&target).exists());
    let staging_real = std::fs::canonicalize(&staging).unwrap();
    assert_eq!(mounts_under(node.dir.path()), vec![staging_real.clone()]);
    // a volume context asking for deferral at stage: refused, not mounted
    let other = c
        .create(create_req("other", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging2 = node.mkdir("staging/o");
    assert_code(
        stage_ctx(&mut c, &other, &staging2, mount("ext4"), &defer_ctx()).await,
        Code::FailedPrecondition,
    );
    assert!(!is_mountpoint(&staging2));
    assert_eq!(loops_under(node.dir.path()).len(), 1, "nothing attached");
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    c.delete(&other).await.unwrap();
    drop(c);
    drop(node);

    // raw block: INVALID_ARGUMENT
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let mut r = create_req("blk-defer", 16 * MIB, vec![block()]);
    r.parameters.insert(DEFER_KEY.into(), "true".into());
    let s = assert_code(c.create(r).await, Code::InvalidArgument);
    assert!(s.message().contains("raw block"), "{}", s.message());
    let id = c
        .create(create_req("blk", 16 * MIB, vec![block()]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/b");
    let s = assert_code(
        stage_ctx(&mut c, &id, &staging, block(), &defer_ctx()).await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("raw block"), "{}", s.message());
    assert!(loops_under(node.dir.path()).is_empty(), "nothing attached");
    c.stage(&id, &staging, block()).await.unwrap();
    let target = format!("{}/dev", node.mkdir("pods"));
    for (defer, ctx) in [(true, HashMap::new()), (false, defer_ctx())] {
        let s = assert_code(
            Pub {
                id: &id,
                staging: &staging,
                target: &target,
                cap: block(),
                ctx,
                defer,
                readonly: false,
            }
            .send(&mut c)
            .await,
            Code::InvalidArgument,
        );
        assert!(s.message().contains("raw block"), "{}", s.message());
        assert!(!Path::new(&target).exists());
        assert!(mounts_under(node.dir.path()).is_empty());
    }
    assert!(!node.crust_root().exists(), "no hand-off record written");
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_deferral_arguments_are_invalid_and_change_nothing() {
    let mut node = TestNode::deferral_unstarted("crust", &[]);
    let allowed = node.mkdir("pods");
    node.extra
        .extend(["--allowed-target-prefix".to_string(), allowed.clone()]);
    node.start();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("args", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/a");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    let target = format!("{allowed}/t");
    let p = |cap: csi::VolumeCapability, defer: bool| Pub {
        id: &id,
        staging: &staging,
        target: &target,
        cap,
        ctx: HashMap::new(),
        defer,
        readonly: false,
    };
    let unchanged = |node: &TestNode| {
        assert!(is_mountpoint(&staging), "staging mount kept");
        assert!(!Path::new(&target).exists());
        assert!(
            !node.crust_root().exists()
                || std::fs::read_dir(node.crust_root()).unwrap().count() == 0
        );
    };
    // supplemental group without deferral
    let s = assert_code(
        p(mount_with("ext4", "100", "", &[]), false)
            .send(&mut c)
            .await,
        Code::InvalidArgument,
    );
    assert!(
        s.message().contains("only valid with deferred"),
        "{}",
        s.message()
    );
    unchanged(&node);
    for (group, policy, what) in [
        ("100", "Sometimes", "Sometimes"),
        ("abc", "", "abc"),
        ("", "Always", "without volume_supplemental_group"),
        ("-1", "", "-1"),
    ] {
        let s = assert_code(
            p(mount_with("ext4", group, policy, &[]), true)
                .send(&mut c)
                .await,
            Code::InvalidArgument,
        );
        assert!(s.message().contains(what), "{what}: {}", s.message());
        unchanged(&node);
    }
    // mount flags that look like a credential are never persisted
    let s = assert_code(
        p(mount_with("ext4", "", "", &["password=hunter2"]), true)
            .send(&mut c)
            .await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("credential"), "{}", s.message());
    assert!(!s.message().contains("hunter2"), "{}", s.message());
    unchanged(&node);
    // a target outside --allowed-target-prefix
    let outside = format!("{}/t", node.mkdir("elsewhere"));
    let s = assert_code(
        Pub {
            target: &outside,
            ..p(mount("ext4"), true)
        }
        .send(&mut c)
        .await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("allowed prefixes"), "{}", s.message());
    assert!(!Path::new(&outside).exists());
    unchanged(&node);
    // a bad volume context value
    assert_code(
        Pub {
            ctx: HashMap::from([(DEFER_KEY.to_string(), "yes".to_string())]),
            ..p(mount("ext4"), false)
        }
        .send(&mut c)
        .await,
        Code::InvalidArgument,
    );
    unchanged(&node);
    // a valid one after all that
    p(
        mount_with("ext4", "0", "OnRootMismatch", &["noatime"]),
        true,
    )
    .send(&mut c)
    .await
    .unwrap();
    assert!(!is_mountpoint(&staging));
    assert_empty_target(&target);
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_deferred_publication_per_volume_and_crashed_publishes_are_cleaned() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let (id, ctx) = create_deferred(&mut c, "rwop", 64 * MIB, "ext4").await;
    let staging = node.mkdir("staging/r");
    stage_ctx(&mut c, &id, &staging, mount("ext4"), &ctx)
        .await
        .unwrap();
    let pods = node.mkdir("pods");
    let (t1, t2) = (format!("{pods}/pod1"), format!("{pods}/pod2"));
    let p1 = Pub {
        id: &id,
        staging: &staging,
        target: &t1,
        cap: mount("ext4"),
        ctx: ctx.clone(),
        defer: true,
        readonly: false,
    };
    p1.send(&mut c).await.unwrap();
    // a second sandbox: refused, nothing written
    let s = assert_code(
        Pub {
            target: &t2,
            ..p1.clone()
        }
        .send(&mut c)
        .await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("one sandbox"), "{}", s.message());
    assert!(!Path::new(&t2).exists());
    assert!(!crust_record(&node, &t2).exists());
    // the same target with other options
    assert_code(
        Pub {
            readonly: true,
            ..p1.clone()
        }
        .send(&mut c)
        .await,
        Code::AlreadyExists,
    );
    // a host publication at the deferred target
    assert_code(
        c.publish(&id, &staging, &t1, mount("ext4"), false).await,
        Code::AlreadyExists,
    );
    c.unpublish(&id, &t1).await.unwrap();

    // read-only: the record says "ro"
    let p2 = Pub {
        target: &t2,
        readonly: true,
        ..p1.clone()
    };
    p2.send(&mut c).await.unwrap();
    let lo = the_loop(&node);
    assert_eq!(
        std::fs::read_to_string(crust_record(&node, &t2).join("mountInfo.json")).unwrap(),
        with_device_identity(
            &format!(
                r#"{{"volume-type":"block","device":"{}","fstype":"ext4","options":["ro"]}}"#,
                lo.path.display()
            ),
            &lo.path,
        )
    );
    c.unpublish(&id, &t2).await.unwrap();

    // a publish that crashed after writing the record, before recording
    // the publication: the unpublish the CO retries removes the record
    // (the target only if the plugin recorded creating it: not this one,
    // made here)
    let t3 = format!("{pods}/pod3");
    std::fs::create_dir(&t3).unwrap();
    crust_store(&node.crust_root())
        .stage(
            &t3,
            &crust_handoff::MountInfo::block(lo.path.to_str().unwrap(), "ext4"),
        )
        .unwrap();
    unpublish_flag(&mut c, &id, &t3, true).await.unwrap();
    assert!(!crust_record(&node, &t3).exists());
    assert!(Path::new(&t3).is_dir() && !is_mounted(&t3));
    // a record naming another volume's device is not this volume's: kept
    let (other, other_ctx) = create_deferred(&mut c, "rwop-other", 64 * MIB, "ext4").await;
    let other_staging = node.mkdir("staging/other");
    stage_ctx(&mut c, &other, &other_staging, mount("ext4"), &other_ctx)
        .await
        .unwrap();
    let other_dev = loops_under(node.dir.path())
        .into_iter()
        .find(|l| l.path != lo.path)
        .unwrap()
        .path;
    let t4 = format!("{pods}/pod4");
    crust_store(&node.crust_root())
        .stage(
            &t4,
            &crust_handoff::MountInfo::block(other_dev.to_str().unwrap(), "ext4"),
        )
        .unwrap();
    unpublish_flag(&mut c, &id, &t4, true).await.unwrap();
    assert!(crust_record(&node, &t4).exists(), "not this volume's: kept");
    crust_store(&node.crust_root()).remove(&t4).unwrap();
    c.unstage(&other, &other_staging).await.unwrap();
    c.delete(&other).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_counts_deferred_publishes_abnormal_volumes_and_rpcs() {
    let node = TestNode::deferral("crust", &["--metrics-address", "127.0.0.1:0"]);
    let addr = metrics_address(&node);
    let scrape = || {
        let (status, body) = http_get(addr, "/metrics");
        assert!(status.contains("200"), "{status}");
        body
    };
    let m = scrape();
    assert_eq!(
        sample(&m, "volumes_published_with_deferred_ops_total"),
        Some(0.0)
    );
    assert_eq!(sample(&m, "volume_stats_health_status_abnormal"), Some(0.0));
    assert!(m.ends_with("# EOF\n"), "{m}");
    let (status, _) = http_get(addr, "/other");
    assert!(status.contains("404"), "{status}");

    let mut c = node.clients().await;
    // two successful deferred publishes (one a repeat) and a refused one
    let (id, ctx) = create_deferred(&mut c, "m-defer", 64 * MIB, "ext4").await;
    let staging = node.mkdir("staging/m");
    stage_ctx(&mut c, &id, &staging, mount("ext4"), &ctx)
        .await
        .unwrap();
    let pods = node.mkdir("pods");
    let t1 = format!("{pods}/a");
    let t2 = format!("{pods}/b");
    let p = Pub {
        id: &id,
        staging: &staging,
        target: &t1,
        cap: mount("ext4"),
        ctx: ctx.clone(),
        defer: false,
        readonly: false,
    };
    p.send(&mut c).await.unwrap();
    p.send(&mut c).await.unwrap();
    assert_code(
        Pub {
            target: &t2,
            ..p.clone()
        }
        .send(&mut c)
        .await,
        Code::FailedPrecondition,
    );

    // an ordinary volume whose filesystem goes read-only, then recovers
    let host = c
        .create(create_req("m-host", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let hs = node.mkdir("staging/h");
    let ht = format!("{pods}/h");
    c.stage(&host, &hs, mount("ext4")).await.unwrap();
    c.publish(&host, &hs, &ht, mount("ext4"), false)
        .await
        .unwrap();
    assert!(
        !c.stats(&host, &ht)
            .await
            .unwrap()
            .volume_condition
            .unwrap()
            .abnormal
    );
    rustix::mount::mount_remount(hs.as_str(), rustix::mount::MountFlags::RDONLY, c"").unwrap();
    for _ in 0..2 {
        assert!(
            c.stats(&host, &ht)
                .await
                .unwrap()
                .volume_condition
                .unwrap()
                .abnormal
        );
    }
    let m = scrape();
    assert_eq!(
        sample(&m, "volumes_published_with_deferred_ops_total"),
        Some(2.0)
    );
    assert_eq!(
        sample(&m, "volume_stats_health_status_abnormal"),
        Some(1.0),
        "one abnormal volume, however often it is asked about"
    );
    let rpc = |m: &str, method: &str, code: &str| {
        sample(
            m,
            &format!("csi_rpc_requests_total{{method=\"{method}\",code=\"{code}\"}}"),
        )
    };
    assert_eq!(rpc(&m, "NodePublishVolume", "OK"), Some(3.0));
    assert_eq!(
        rpc(&m, "NodePublishVolume", "FAILED_PRECONDITION"),
        Some(1.0)
    );
    assert_eq!(rpc(&m, "NodeGetVolumeStats", "OK"), Some(3.0));
    assert_eq!(rpc(&m, "CreateVolume", "OK"), Some(3.0));
    assert_eq!(
        sample(
            &m,
            "csi_rpc_duration_seconds_count{method=\"NodePublishVolume\"}"
        ),
        Some(4.0)
    );
    rustix::mount::mount_remount(hs.as_str(), rustix::mount::MountFlags::empty(), c"").unwrap();
    assert!(
        !c.stats(&host, &ht)
            .await
            .unwrap()
            .volume_condition
            .unwrap()
            .abnormal
    );
    let m = scrape();
    assert_eq!(sample(&m, "volume_stats_health_status_abnormal"), Some(0.0));
    assert_eq!(rpc(&m, "NodeGetVolumeStats", "OK"), Some(4.0));

    c.unpublish(&host, &ht).await.unwrap();
    c.unstage(&host, &hs).await.unwrap();
    c.delete(&host).await.unwrap();
    c.unpublish(&id, &t1).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert_eq!(
        sample(&scrape(), "volumes_published_with_deferred_ops_total"),
        Some(2.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stock_client_sees_the_standard_behaviour_with_deferral_enabled() {
    let node = TestNode::deferral("both", &[]);
    let mut c = node.clients().await;
    let (size, grown) = (320 * MIB, 384 * MIB);
    let v = c
        .create(create_req("stock", size, vec![mount("xfs")]))
        .await
        .unwrap();
    assert_eq!(
        v.volume_context,
        HashMap::from([
            ("fsType".to_string(), "xfs".to_string()),
            (TOPO_KEY.to_string(), NODE.to_string())
        ])
    );
    let id = v.volume_id;
    let staging = node.mkdir("staging/s");
    let t = format!("{}/t", node.mkdir("pods"));
    c.stage(&id, &staging, mount("xfs")).await.unwrap();
    assert!(is_mountpoint(&staging));
    c.publish(&id, &staging, &t, mount("xfs"), false)
        .await
        .unwrap();
    assert!(is_mountpoint(&t), "a bind mount, as before");
    std::fs::write(format!("{t}/f"), b"stock").unwrap();
    let st = c.stats(&id, &t).await.unwrap();
    assert_eq!(
        usage(&st, csi::volume_usage::Unit::Bytes).total as u64,
        fs_total(Path::new(&t))
    );
    // ControllerExpand + NodeExpand with secrets (field 6, the number the
    // KEP proposed for defer_fs_ops): grown on the host
    c.ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: grown,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let before = fs_total(Path::new(&t));
    let mut req = expand_req(&id, &t, &staging, "xfs", grown, false);
    req.secrets = HashMap::from([("token".to_string(), "not-a-deferral".to_string())]);
    let r = c.node.node_expand_volume(req).await.unwrap().into_inner();
    assert_eq!(r.capacity_bytes, grown);
    assert!(fs_total(Path::new(&t)) > before, "grown on the host");
    assert_eq!(std::fs::read(format!("{t}/f")).unwrap(), b"stock");
    c.unpublish(&id, &t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(
        !node.crust_root().exists() && !node.kata_root().exists(),
        "no hand-off records"
    );
    assert!(loops_under(node.dir.path()).is_empty());
}

// ---------------------------------------------------------------------
// The host never checks, grows or mounts a filesystem a guest may have
// mounted. A sandbox's QEMU opens the device without O_EXCL; the tests
// play it with a child process holding the loop device open.

/// Plays a sandbox's QEMU: another process holding `dev` open read-write
/// without `O_EXCL`. Killed and reaped on drop.
fn qemu_holding(dev: &Path) -> crust_testkit::ChildGuard {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dev)
        .unwrap();
    let child = std::process::Command::new("sleep")
        .arg("600")
        .stdin(f)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    crust_testkit::ChildGuard::new(child)
}

/// The ext4 primary superblock (1 KiB at offset 1 KiB): e2fsck stamps its
/// last-check time there and resize2fs its block count.
fn ext4_superblock(dev: &Path) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut sb = vec![0u8; 1024];
    std::fs::File::open(dev)
        .unwrap()
        .read_exact_at(&mut sb, 1024)
        .unwrap();
    assert_eq!(&sb[0x38..0x3a], &[0x53, 0xef], "ext4 magic");
    sb
}

/// The filesystem on `dev` is exactly as it was: resize2fs would change
/// the block count, e2fsck the last-check time (and both the checksum).
#[track_caller]
fn assert_untouched(dev: &Path, before: &[u8]) {
    let now = ext4_superblock(dev);
    let le32 = |sb: &[u8], o: usize| u32::from_le_bytes(sb[o..o + 4].try_into().unwrap());
    assert!(
        now == before,
        "the host touched the guest's filesystem: blocks {} -> {}, last check {} -> {}, \
         mount count {} -> {}",
        le32(before, 0x04),
        le32(&now, 0x04),
        le32(before, 0x40),
        le32(&now, 0x40),
        u16::from_le_bytes([before[0x34], before[0x35]]),
        u16::from_le_bytes([now[0x34], now[0x35]]),
    );
}

async fn controller_expand(c: &mut Clients, id: &str, bytes: i64, fs: &str) {
    let r = c
        .ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: id.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: bytes,
                limit_bytes: 0,
            }),
            volume_capability: Some(mount(fs)),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, bytes);
}

#[track_caller]
fn assert_running(holder: &mut crust_testkit::ChildGuard) {
    assert!(
        holder.child().try_wait().unwrap().is_none(),
        "the 'guest' still runs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_stage_of_a_context_deferred_volume_leaves_the_guests_filesystem_alone() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let (id, ctx) = create_deferred(&mut c, "held", 64 * MIB, "ext4").await;
    let staging = node.mkdir("staging/held");
    stage_ctx(&mut c, &id, &staging, mount("ext4"), &ctx)
        .await
        .unwrap();
    let target = format!("{}/pv", node.mkdir("pods/uid/volumes"));
    Pub {
        id: &id,
        staging: &staging,
        target: &target,
        cap: mount("ext4"),
        ctx: ctx.clone(),
        defer: false,
        readonly: false,
    }
    .send(&mut c)
    .await
    .unwrap();
    let lo = the_loop(&node);

    // the sandbox starts: its QEMU opens the device (no O_EXCL)
    let mut qemu = qemu_holding(&lo.path);
    let sb = ext4_superblock(&lo.path);
    // the volume grows: the pool resizes the attached loop device at once,
    // the filesystem is now smaller than the device until the guest grows it
    controller_expand(&mut c, &id, 128 * MIB, "ext4").await;
    assert_eq!(dev_size(&lo.path), 128 * MIB as u64);

    // kubelet repeats NodeStageVolume (pod restart, kubelet restart)
    for _ in 0..2 {
        stage_ctx(&mut c, &id, &staging, mount("ext4"), &ctx)
            .await
            .unwrap();
    }
    assert_untouched(&lo.path, &sb);
    assert_running(&mut qemu);
    assert!(
        host_mounts_under(node.dir.path()).is_empty(),
        "no host mount"
    );
    assert_eq!(the_loop(&node).path, lo.path, "same device");
    let log = node.plugin.as_ref().unwrap().stderr();
    assert!(
        log.contains("filesystem left to the sandbox"),
        "the repeat was recognised: {log}"
    );

    drop(qemu);
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_a_sandbox_still_holds_is_never_grown_or_mounted_on_the_host() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    // an ordinary volume, handed to a sandbox by a deferred publication
    let v = c
        .create(create_req("req-held", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/rh");
    let pods = node.mkdir("pods");
    let (sandbox_t, host_t) = (format!("{pods}/sandbox"), format!("{pods}/host"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    std::fs::write(format!("{staging}/from-host"), b"host").unwrap();
    Pub {
        id: &id,
        staging: &staging,
        target: &sandbox_t,
        cap: mount("ext4"),
        ctx: v.volume_context.clone(),
        defer: true,
        readonly: false,
    }
    .send(&mut c)
    .await
    .unwrap();
    assert!(!is_mountpoint(&staging));
    let lo = the_loop(&node);
    let mut qemu = qemu_holding(&lo.path);
    let qemu_pid = qemu.child().id();
    let sb = ext4_superblock(&lo.path);
    controller_expand(&mut c, &id, 128 * MIB, "ext4").await;

    // repeated stage while published to the sandbox: OK, nothing touched
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert_untouched(&lo.path, &sb);
    assert!(!is_mountpoint(&staging));

    // the pod goes, but its sandbox has not stopped yet (QEMU still has
    // the device): the records no longer say "deferred", the device does
    c.unpublish(&id, &sandbox_t).await.unwrap();
    assert!(!crust_record(&node, &sandbox_t).exists());
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert_untouched(&lo.path, &sb);
    assert!(!is_mountpoint(&staging), "still unmounted for deferral");
    // a host publication would mount it next to the guest: refused
    for _ in 0..2 {
        let s = assert_code(
            c.publish(&id, &staging, &host_t, mount("ext4"), false)
                .await,
            Code::FailedPrecondition,
        );
        assert!(
            s.message()
                .contains(&format!("is open by pid {qemu_pid} (sleep)")),
            "{}",
            s.message()
        );
        assert!(
            s.message()
                .contains("refusing to mount a filesystem another kernel may have mounted"),
            "{}",
            s.message()
        );
    }
    assert!(!is_mountpoint(&staging), "nothing mounted");
    assert!(!Path::new(&host_t).exists(), "no target created");
    assert_untouched(&lo.path, &sb);
    assert_running(&mut qemu);

    // the sandbox stops: the host may have the filesystem again
    drop(qemu);
    c.publish(&id, &staging, &host_t, mount("ext4"), false)
        .await
        .unwrap();
    assert!(is_mountpoint(&staging) && is_mountpoint(&host_t));
    assert_eq!(
        std::fs::read(format!("{host_t}/from-host")).unwrap(),
        b"host"
    );
    c.unpublish(&id, &host_t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
    assert!(mounts_under(node.dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restage_refuses_to_grow_or_mount_a_device_another_process_holds() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let id = c
        .create(create_req("lost-held", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/lh");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    std::fs::write(format!("{staging}/on-volume"), b"v").unwrap();
    let lo = the_loop(&node);
    // the staging mount is lost (outside the plugin) and some process has
    // the device open
    crust_blockdev::unmount(Path::new(&staging)).unwrap();
    let mut other = qemu_holding(&lo.path);
    let pid = other.child().id();
    let sb = ext4_superblock(&lo.path);
    let refused = |s: tonic::Status, action: &str| {
        assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
        assert!(
            s.message()
                .contains(&format!("is open by pid {pid} (sleep)"))
                && s.message().contains(action),
            "{}",
            s.message()
        );
    };
    refused(
        c.stage(&id, &staging, mount("ext4")).await.unwrap_err(),
        "refusing to mount",
    );
    controller_expand(&mut c, &id, 128 * MIB, "ext4").await;
    refused(
        c.stage(&id, &staging, mount("ext4")).await.unwrap_err(),
        "refusing to check or grow a filesystem another kernel may have mounted",
    );
    assert_untouched(&lo.path, &sb);
    assert!(!is_mountpoint(&staging));
    assert_running(&mut other);

    drop(other);
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert!(is_mountpoint(&staging));
    assert!(
        fs_total(Path::new(&staging)) > 100 * MIB as u64,
        "grown offline before mounting"
    );
    assert_eq!(std::fs::read(format!("{staging}/on-volume")).unwrap(), b"v");
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}

/// Every regular file under `dir` that contains `needle` (skipping the
/// pool's backing files, which hold the volumes' filesystems).
fn files_containing(dir: &Path, needle: &[u8], skip: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return found;
    };
    for e in rd.flatten() {
        let p = e.path();
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if p.starts_with(skip) {
            continue;
        }
        if m.is_dir() {
            found.extend(files_containing(&p, needle, skip));
        } else if m.is_file()
            && std::fs::read(&p).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle))
        {
            found.push(p);
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_publish_applies_the_mount_option_allow_list_and_never_echoes_a_flag() {
    let node = TestNode::deferral("both", &[]);
    let mut c = node.clients().await;
    let (id, ctx) = create_deferred(&mut c, "flags", 64 * MIB, "ext4").await;
    let staging = node.mkdir("staging/f");
    const SECRET: &str = "Hunter2Zebra";
    // at stage, the host mount's allow-list: the flag is named by position
    let s = assert_code(
        stage_ctx(
            &mut c,
            &id,
            &staging,
            mount_with(
                "ext4",
                "",
                "",
                &["noatime", &format!("nodev,passphrase={SECRET}")],
            ),
            &ctx,
        )
        .await,
        Code::InvalidArgument,
    );
    assert!(s.message().contains("mount option #3"), "{}", s.message());
    assert!(!s.message().contains(SECRET), "{}", s.message());
    stage_ctx(&mut c, &id, &staging, mount("ext4"), &ctx)
        .await
        .unwrap();
    let target = format!("{}/pv", node.mkdir("pods/uid/volumes"));
    let p = |flags: &[&str]| Pub {
        id: &id,
        staging: &staging,
        target: &target,
        cap: mount_with("ext4", "", "", flags),
        ctx: ctx.clone(),
        defer: true,
        readonly: false,
    };
    // flags the hand-off record's credential heuristic lets through, or
    // that the host would never mount: refused before anything is written
    for (flags, position) in [
        (
            vec!["noatime".to_string(), format!("passphrase={SECRET}")],
            2,
        ),
        (vec![format!("commit={SECRET}")], 1),
        (vec![format!("{SECRET}")], 1),
        (vec!["ro".to_string(), "errors=panic".to_string()], 2),
    ] {
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let s = assert_code(p(&flags).send(&mut c).await, Code::InvalidArgument);
        assert!(
            s.message().contains(&format!("mount option #{position}")),
            "{flags:?}: {}",
            s.message()
        );
        assert!(!s.message().contains(SECRET), "{}", s.message());
        assert!(!Path::new(&target).exists(), "no target created");
        assert!(!crust_record(&node, &target).exists(), "no CRUST record");
        assert!(!kata_record(&node, &target).exists(), "no Kata record");
    }
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(node.state.join(format!("volumes/{id}.json"))).unwrap(),
    )
    .unwrap();
    assert!(
        state["published"].as_object().is_none_or(|m| m.is_empty()),
        "{state}"
    );
    // nowhere on the node's disk: records, state, the plugin's logs
    assert_eq!(
        files_containing(node.dir.path(), SECRET.as_bytes(), &node.pool),
        Vec::<PathBuf>::new()
    );
    // allowed flags go through and land in both records
    p(&["noatime", "commit=30"]).send(&mut c).await.unwrap();
    let lo = the_loop(&node);
    assert_eq!(
        std::fs::read_to_string(crust_record(&node, &target).join("mountInfo.json")).unwrap(),
        with_device_identity(
            &format!(
                r#"{{"volume-type":"block","device":"{}","fstype":"ext4","options":["noatime","commit=30"]}}"#,
                lo.path.display()
            ),
            &lo.path,
        )
    );
    assert!(kata_record(&node, &target).join("mountInfo.json").exists());
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_claim_on_a_leftover_record_keeps_the_host_off_the_filesystem() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let v = c
        .create(create_req("claimed", 64 * MIB, vec![mount("ext4")]))
        .await
        .unwrap();
    let id = v.volume_id;
    let staging = node.mkdir("staging/cl");
    let pods = node.mkdir("pods");
    let (sandbox_t, host_t) = (format!("{pods}/sandbox"), format!("{pods}/host"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    std::fs::write(format!("{staging}/kept"), b"k").unwrap();
    let deferred = Pub {
        id: &id,
        staging: &staging,
        target: &sandbox_t,
        cap: mount("ext4"),
        ctx: v.volume_context.clone(),
        defer: true,
        readonly: false,
    };
    deferred.send(&mut c).await.unwrap();
    c.unpublish(&id, &sandbox_t).await.unwrap();
    let lo = the_loop(&node);
    let sb = ext4_superblock(&lo.path);

    // a hand-off record the plugin's records do not know (a publish that
    // crashed before recording it), consumed by a sandbox
    let store = crust_store(&node.crust_root());
    let lost = format!("{pods}/lost");
    store
        .stage(
            &lost,
            &crust_handoff::MountInfo::block(lo.path.to_str().unwrap(), "ext4"),
        )
        .unwrap();
    store.claim(&lost, "sandbox-9", |_| true).unwrap();

    let s = assert_code(
        c.publish(&id, &staging, &host_t, mount("ext4"), false)
            .await,
        Code::FailedPrecondition,
    );
    assert!(s.message().contains("sandbox-9"), "{}", s.message());
    assert!(!is_mountpoint(&staging) && !Path::new(&host_t).exists());
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert!(!is_mountpoint(&staging), "repeated stage mounts nothing");
    assert_untouched(&lo.path, &sb);

    // the sandbox lets go of it: the host may mount the filesystem again
    store.release(&lost, "sandbox-9").unwrap();
    store.remove(&lost).unwrap();
    c.publish(&id, &staging, &host_t, mount("ext4"), false)
        .await
        .unwrap();
    assert_eq!(std::fs::read(format!("{host_t}/kept")).unwrap(), b"k");
    c.unpublish(&id, &host_t).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(loops_under(node.dir.path()).is_empty());
}

fn snapshot_req(name: &str, source: &str) -> csi::CreateSnapshotRequest {
    csi::CreateSnapshotRequest {
        source_volume_id: source.into(),
        name: name.into(),
        ..Default::default()
    }
}

async fn snapshot_names(c: &mut Clients) -> BTreeSet<String> {
    c.ctl
        .list_snapshots(csi::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .map(|e| e.snapshot.unwrap().snapshot_id)
        .collect()
}

fn with_source(
    name: &str,
    fs: &str,
    source: csi::volume_content_source::Type,
) -> csi::CreateVolumeRequest {
    let mut r = create_req(name, 320 * MIB, vec![mount(fs)]);
    r.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(source),
    });
    r
}

/// A snapshot of a volume a pod's guest has mounted freezes it there
/// (`crust freeze` through crust_ops): data the guest has not synced yet
/// is in the snapshot. A thaw that cannot confirm the freeze held fails
/// the snapshot and leaves none behind; a runtime that cannot freeze
/// refuses it with FAILED_PRECONDITION.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_a_consumed_deferred_volume_freezes_it_in_the_guest() {
    use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
    let cli = runtime_cli();
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let (id, ctx) = create_deferred(&mut c, "snapsrc", 320 * MIB, "ext4").await;
    let staging = node.mkdir("staging/s");
    stage_ctx(&mut c, &id, &staging, mount("ext4"), &ctx)
        .await
        .unwrap();
    let target = format!("{}/pv", node.mkdir("pods/uid/volumes"));
    Pub {
        id: &id,
        staging: &staging,
        target: &target,
        cap: mount("ext4"),
        ctx: ctx.clone(),
        defer: true,
        readonly: false,
    }
    .send(&mut c)
    .await
    .unwrap();

    // Not consumed yet: nothing has it mounted, the copy needs no freeze.
    let early = c
        .ctl
        .create_snapshot(snapshot_req("early", &id))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(early.ready_to_use);

    let lo = the_loop(&node);
    let guest = GuestMount::new(&lo.path, &node.path("guest/s"), "ext4");
    let map = serde_json::json!({
        &target: {
            "mount": guest.dir,
            "backing": lo.backing_file,
            "loop": lo.path,
            "sandbox": "sandbox-1",
        }
    });
    std::fs::write(node.cli_map(), map.to_string()).unwrap();
    consume(&node.crust_root(), &target, "sandbox-1", &cli);
    // Written by the "guest" and never synced: only its freeze flushes it.
    let data: Vec<u8> = (0..6u32 << 20).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(guest.dir.join("unsynced.bin"), &data).unwrap();

    let snap = c
        .ctl
        .create_snapshot(snapshot_req("frozen", &id))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(snap.ready_to_use);
    assert!(
        !crust_blockdev::thaw_if_frozen(&guest.dir).unwrap(),
        "the guest's filesystem is thawed after the snapshot"
    );
    std::fs::write(guest.dir.join("after.txt"), b"written after").unwrap();

    // Restored on the host: the unsynced bytes are there, the later file
    // is not, and the filesystem is clean.
    let restored = c
        .create(with_source(
            "restored",
            "ext4",
            Type::Snapshot(SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            }),
        ))
        .await
        .unwrap();
    let rs = node.mkdir("staging/r");
    let rt = node.path("restored-target");
    let rt = rt.to_str().unwrap();
    c.stage(&restored.volume_id, &rs, mount("ext4"))
        .await
        .unwrap();
    c.publish(&restored.volume_id, &rs, rt, mount("ext4"), false)
        .await
        .unwrap();
    assert!(std::fs::read(Path::new(rt).join("unsynced.bin")).unwrap() == data);
    assert!(!Path::new(rt).join("after.txt").exists());
    c.unpublish(&restored.volume_id, rt).await.unwrap();
    c.unstage(&restored.volume_id, &rs).await.unwrap();

    // The runtime cannot confirm the freeze held until the copy ended:
    // INTERNAL, and no snapshot (a retry must not find an inconsistent
    // one); a clone the same way leaves no volume.
    let volumes_before = c.list_all().await.len();
    for (how, why) in [
        ("expired", "the guest thawed it"),
        ("fail", "cannot confirm the guest kept it frozen"),
    ] {
        let mut m = map.clone();
        m[&target]["thaw"] = how.into();
        std::fs::write(node.cli_map(), m.to_string()).unwrap();
        let before = snapshot_names(&mut c).await;
        let s = assert_code(
            c.ctl
                .create_snapshot(snapshot_req(&format!("thaw-{how}"), &id))
                .await,
            Code::Internal,
        );
        assert!(s.message().contains(why), "{how}: {}", s.message());
        assert_eq!(snapshot_names(&mut c).await, before, "{how}");
        let s = assert_code(
            c.create(with_source(
                &format!("clone-{how}"),
                "ext4",
                Type::Volume(VolumeSource {
                    volume_id: id.clone(),
                }),
            ))
            .await,
            Code::Internal,
        );
        assert!(s.message().contains(why), "{how}: {}", s.message());
        assert_eq!(c.list_all().await.len(), volumes_before, "{how}");
        assert!(
            !crust_blockdev::thaw_if_frozen(&guest.dir).unwrap(),
            "{how}"
        );
    }

    // A runtime that cannot freeze: FAILED_PRECONDITION, nothing created.
    let mut m = map.clone();
    m[&target]["freeze"] = "fail".into();
    std::fs::write(node.cli_map(), m.to_string()).unwrap();
    let before = snapshot_names(&mut c).await;
    let s = assert_code(
        c.ctl
            .create_snapshot(snapshot_req("freeze-fail", &id))
            .await,
        Code::FailedPrecondition,
    );
    assert!(
        s.message().contains("freezing it there failed"),
        "{}",
        s.message()
    );
    assert_eq!(snapshot_names(&mut c).await, before);

    // The runtime behaves again: the failed names can be retried.
    std::fs::write(node.cli_map(), map.to_string()).unwrap();
    for name in ["thaw-expired", "freeze-fail"] {
        c.ctl
            .create_snapshot(snapshot_req(name, &id))
            .await
            .unwrap();
    }
    assert_eq!(snapshot_names(&mut c).await.len(), 4);

    let mut guest = guest;
    guest.unmount();
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    for snap in snapshot_names(&mut c).await {
        c.ctl
            .delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: snap,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    for v in [&id, &restored.volume_id] {
        c.delete(v).await.unwrap();
    }
    assert!(loops_under(node.dir.path()).is_empty());
}
