//! The Handover service (runtime-driven deferral) against the real
//! `crust-csi` binary: pool backend on real loop devices, real mkfs and
//! mounts, the CSI socket and the node's own Handover socket. The tests
//! play the VM runtime: they ask for the volume published at a target,
//! mount the device where the guest would, and hand it back.
//!
//! Budget: under 30 s on 2 cores (no guest).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::path::Path;

use common::*;
use crust_proto::endpoint::Endpoint;
use crust_proto::handover::v1alpha1 as hv;
use hv::declined::Reason;
use hv::hand_over_response::Outcome;
use hv::handover_client::HandoverClient;
use hv::runtime_capability::Type as Cap;
use tonic::Code;
use tonic::transport::Channel;

async fn handover_client(node: &TestNode) -> HandoverClient<Channel> {
    let ch = Endpoint::Unix(node.handover_socket())
        .connect()
        .await
        .unwrap();
    HandoverClient::new(ch)
}

fn ask(target: &str, sandbox: &str, fs: &[&str], required: bool) -> hv::HandOverRequest {
    hv::HandOverRequest {
        target_path: target.into(),
        sandbox_id: sandbox.into(),
        runtime_cli: runtime_cli().to_str().unwrap().into(),
        capabilities: [
            Cap::VolumeStats,
            Cap::VolumeResize,
            Cap::FsGroupChangePolicyAlways,
        ]
        .into_iter()
        .map(|t| hv::RuntimeCapability { r#type: t as i32 })
        .collect(),
        file_systems: fs
            .iter()
            .map(|f| hv::FileSystemSupport {
                fs_type: f.to_string(),
                mount_options: Vec::new(),
            })
            .collect(),
        required,
    }
}

/// A 1 GiB ext4 volume created, staged at `staging/<name>` and published
/// at `pods/<pod>/<name>`, as kubelet leaves a runc pod's volume:
/// (volume id, staging path, target path).
async fn host_published(
    node: &TestNode,
    c: &mut Clients,
    name: &str,
    pod: &str,
) -> (String, String, String) {
    let id = c
        .create(create_req(name, 1 << 30, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir(&format!("staging/{name}"));
    let target = node.mkdir(&format!("pods/{pod}/{name}"));
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    (id, staging, target)
}

/// HandOver of `target` for sandbox `sb-1` (ext4): the answer and how
/// long it took.
async fn timed_hand_over(
    h: &mut HandoverClient<Channel>,
    target: &str,
) -> (hv::HandOverResponse, std::time::Duration) {
    let t0 = std::time::Instant::now();
    let r = h
        .hand_over(ask(target, "sb-1", &["ext4"], false))
        .await
        .unwrap()
        .into_inner();
    (r, t0.elapsed())
}

/// The device is mounted nowhere in this namespace.
fn device_unmounted(dev: &str) -> bool {
    !mountinfo().iter().any(|(_, src)| src == dev)
}

fn handed_over(r: hv::HandOverResponse) -> hv::HandedOver {
    match r.outcome {
        Some(Outcome::HandedOver(h)) => h,
        other => panic!("expected a handover, got {other:?}"),
    }
}

fn declined(r: hv::HandOverResponse) -> hv::Declined {
    match r.outcome {
        Some(Outcome::Declined(d)) => d,
        other => panic!("expected a decline, got {other:?}"),
    }
}

/// Host publication → HandOver (no host mount left, the device carries
/// the host's data, the "guest" writes) → HandBack (still no host mount)
/// → kubelet's NodeUnpublish/NodeUnstage accept the returned volume → a
/// later stage+publish checks and mounts it and holds all data →
/// DeleteVolume; nothing leaked.
#[tokio::test(flavor = "multi_thread")]
async fn hand_over_and_back_without_a_host_mount() {
    let mut node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let mut h = handover_client(&node).await;
    let (id, staging, target) = host_published(&node, &mut c, "ho-1", "p1").await;
    // The runc-side writer (the host mount).
    std::fs::write(Path::new(&target).join("host.txt"), b"from the host").unwrap();

    let t0 = std::time::Instant::now();
    let got = handed_over(
        h.hand_over(ask(&target, "sb-1", &["ext4"], false))
            .await
            .unwrap()
            .into_inner(),
    );
    eprintln!("HandOver took {:?}", t0.elapsed());
    assert_eq!(got.volume_id, id);
    assert_eq!(got.fs_type, "ext4");
    assert!(!got.readonly);
    assert!(!host_mounted(&target), "target still mounted on the host");
    assert!(is_mounted(&target), "the placeholder shows on the target");
    assert!(!is_mounted(&staging), "staging still mounted on the host");
    assert!(
        device_unmounted(&got.device),
        "{} still mounted",
        got.device
    );
    // Asking again from the same sandbox is idempotent.
    let again = handed_over(
        h.hand_over(ask(&target, "sb-1", &["ext4"], false))
            .await
            .unwrap()
            .into_inner(),
    );
    assert_eq!(again.device, got.device);
    // kubelet cannot tear it down under the sandbox's claim: the volume is
    // in use by the sandbox (and its runtime CLI says it is not stopped).

    let guest_dir = node.path("guest/ho-1");
    // The runtime CLI's view of the sandbox: running while its guest
    // mount is there, stopped once it is gone (HandBack checks it).
    let map = serde_json::json!({
        target.as_str(): {"sandbox": "sb-1", "mount": guest_dir.to_str().unwrap()}
    });
    std::fs::write(node.cli_map(), map.to_string()).unwrap();
    {
        let mut g = GuestMount::new(Path::new(&got.device), &guest_dir, &got.fs_type);
        assert_eq!(
            std::fs::read(guest_dir.join("host.txt")).unwrap(),
            b"from the host"
        );
        std::fs::write(guest_dir.join("guest.txt"), b"from the guest").unwrap();
        g.unmount();
    }

    h.hand_back(hv::HandBackRequest {
        target_path: target.clone(),
        sandbox_id: "sb-1".into(),
    })
    .await
    .unwrap();
    assert!(!host_mounted(&target), "hand back mounted the target");
    assert!(!is_mounted(&staging), "hand back mounted the staging path");
    assert!(
        device_unmounted(&got.device),
        "hand back mounted the device"
    );
    // Idempotent.
    h.hand_back(hv::HandBackRequest {
        target_path: target.clone(),
        sandbox_id: "sb-1".into(),
    })
    .await
    .unwrap();

    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(!is_mounted(&target) && !is_mounted(&staging));

    // A later host publication checks the returned filesystem and mounts it.
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    assert!(host_mounted(&target));
    let log = node.plugin.as_ref().unwrap().stderr();
    assert!(
        log.contains("filesystem back from a guest passed its check and is mounted on the host"),
        "{log}"
    );
    assert_eq!(
        std::fs::read(Path::new(&target).join("host.txt")).unwrap(),
        b"from the host"
    );
    assert_eq!(
        std::fs::read(Path::new(&target).join("guest.txt")).unwrap(),
        b"from the guest"
    );
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(mounts_under(node.dir.path()).is_empty());
    assert!(loops_under(node.dir.path()).is_empty());
    let st = node.stop();
    assert!(st.success(), "{st}");
}

/// What cannot be handed over is declined (auto: the runtime shares the
/// host mount) or FAILED_PRECONDITION when deferral was required; the host
/// mount stays untouched either way.
#[tokio::test(flavor = "multi_thread")]
async fn declines_leave_the_host_mount() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let mut h = handover_client(&node).await;
    let id = c
        .create(create_req("ho-2", 1 << 30, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/ho-2");
    let t1 = node.mkdir("pods/p1/ho-2");
    let t2 = node.mkdir("pods/p2/ho-2");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &t1, mount("ext4"), false)
        .await
        .unwrap();

    // Not ours.
    let other = node.mkdir("pods/p3/none");
    let d = declined(
        h.hand_over(ask(&other, "sb-1", &["ext4"], false))
            .await
            .unwrap()
            .into_inner(),
    );
    assert_eq!(d.reason, Reason::NotPublished as i32);

    // The guest cannot mount ext4.
    let d = declined(
        h.hand_over(ask(&t1, "sb-1", &["xfs"], false))
            .await
            .unwrap()
            .into_inner(),
    );
    assert_eq!(
        d.reason,
        Reason::UnsupportedFilesystem as i32,
        "{}",
        d.message
    );
    let e = h
        .hand_over(ask(&t1, "sb-1", &["xfs"], true))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(host_mounted(&t1));

    // Published twice: never handed over.
    c.publish(&id, &staging, &t2, mount("ext4"), false)
        .await
        .unwrap();
    let d = declined(
        h.hand_over(ask(&t1, "sb-1", &["ext4"], false))
            .await
            .unwrap()
            .into_inner(),
    );
    assert_eq!(d.reason, Reason::MultipleTargets as i32, "{}", d.message);
    assert!(host_mounted(&t1) && host_mounted(&t2));

    c.unpublish(&id, &t2).await.unwrap();
    c.unpublish(&id, &t1).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(mounts_under(node.dir.path()).is_empty());
}

/// Another process holding the device keeps the handover from taking it.
/// Such holders can be short-lived: a process that creates a mount
/// namespace (a container, a sandboxed virtiofsd starting) has a copy of
/// every host mount until it pivots away. So the handover waits for them
/// (bounded): one gone within the wait does not send the pod to virtio-fs,
/// and a lasting one is declined with the host mount left as it was. The
/// holder here has the device open (a namespace copy would also hold the
/// other tests' mounts). Budget: about 3 s (no guest).
#[tokio::test(flavor = "multi_thread")]
async fn a_holder_of_the_device_is_waited_for_then_declined() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let mut h = handover_client(&node).await;
    let (id, staging, target) = host_published(&node, &mut c, "ho-ns", "p1").await;
    let device = mountinfo()
        .into_iter()
        .find(|(point, _)| point == Path::new(&staging))
        .map(|(_, src)| src)
        .expect("staging mounted");
    let holder = |secs: &str| {
        let dev = std::fs::File::open(&device).unwrap();
        std::process::Command::new("sleep")
            .arg(secs)
            .stdin(dev)
            .spawn()
            .expect("sleep")
    };

    // Lasting: declined after the wait, nothing changed on the host.
    let mut long = holder("30");
    let (r, waited) = timed_hand_over(&mut h, &target).await;
    long.kill().unwrap();
    long.wait().unwrap();
    let d = declined(r);
    assert_eq!(d.reason, Reason::InUseElsewhere as i32, "{}", d.message);
    assert!(d.message.contains("is open by"), "{}", d.message);
    assert!(waited.as_millis() >= 1500, "declined after {waited:?}");
    assert!(host_mounted(&target) && is_mounted(&staging));
    assert_eq!(
        std::fs::read_dir(&target).unwrap().count(),
        std::fs::read_dir(&staging).unwrap().count()
    );

    // Short-lived (gone within the wait): handed over once it is gone.
    let mut short = holder("0.5");
    let (r, took) = timed_hand_over(&mut h, &target).await;
    short.wait().unwrap();
    let got = handed_over(r);
    assert!(took.as_millis() >= 300, "handed over after {took:?}");
    assert!(device_unmounted(&got.device));
    assert!(!host_mounted(&target) && !is_mounted(&staging));

    // Back, then kubelet's teardown: nothing left.
    // The runtime CLI's view: the sandbox stopped (its guest mount is gone).
    let guest_dir = node.path("guest/ho-ns");
    let map = serde_json::json!({
        target.as_str(): {"sandbox": "sb-1", "mount": guest_dir.to_str().unwrap()}
    });
    std::fs::write(node.cli_map(), map.to_string()).unwrap();
    h.hand_back(hv::HandBackRequest {
        target_path: target.clone(),
        sandbox_id: "sb-1".into(),
    })
    .await
    .unwrap();
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(mounts_under(node.dir.path()).is_empty());
}

/// A host process working inside the published target (an operator's
/// shell left there) is found before anything is unmounted: the handover
/// is declined naming it (pid and comm), so an `auto` volume falls back
/// to virtio-fs instead of failing the pod; with `required` it is the
/// clear FAILED_PRECONDITION naming it. Either way the host mounts are as
/// before. A user the scan cannot see (a loop device backed by a file on
/// the volume: the kernel holds it, no process) makes the unmount answer
/// EBUSY: rolled back and declined the same way, never a lazy unmount.
/// Budget: about 7 s (three waits for a transient holder, no guest).
#[tokio::test(flavor = "multi_thread")]
async fn a_host_user_of_the_target_is_declined_by_name() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let mut h = handover_client(&node).await;
    let (id, staging, target) = host_published(&node, &mut c, "ho-cwd", "p1").await;
    std::fs::create_dir(Path::new(&target).join("work")).unwrap();
    let mounts_before = mounts_under(node.dir.path());

    let sleeper = std::process::Command::new("sleep")
        .arg("30")
        .current_dir(Path::new(&target).join("work"))
        .spawn()
        .expect("sleep");
    let mut sleeper = crust_testkit::ChildGuard::new(sleeper);
    let named = format!(
        "pid {} (sleep) has its working directory on it",
        sleeper.child_id()
    );
    let (r, _) = timed_hand_over(&mut h, &target).await;
    let d = declined(r);
    assert_eq!(d.reason, Reason::InUseElsewhere as i32, "{}", d.message);
    assert!(d.message.contains(&named), "{}", d.message);
    assert_eq!(mounts_under(node.dir.path()), mounts_before);
    let e = h
        .hand_over(ask(&target, "sb-1", &["ext4"], true))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("deferral was required"), "{e:?}");
    assert!(e.message().contains(&named), "{e:?}");
    assert_eq!(mounts_under(node.dir.path()), mounts_before);
    sleeper.child().kill().unwrap();
    sleeper.child().wait().unwrap();

    // The kernel's hold through the target's mount: EBUSY at the unmount.
    let backing = Path::new(&target).join("work/backing.img");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let lo = crust_testkit::losetup(&backing, false);
    let (r, _) = timed_hand_over(&mut h, &target).await;
    let d = declined(r);
    assert_eq!(d.reason, Reason::InUseElsewhere as i32, "{}", d.message);
    assert!(
        d.message.contains("is busy") && d.message.contains("host mounts were restored"),
        "{}",
        d.message
    );
    assert!(host_mounted(&target) && is_mounted(&staging));
    assert!(Path::new(&target).join("work/backing.img").exists());
    drop(lo);

    // Nobody left: handed over, then back and kubelet's teardown.
    let got = handed_over(timed_hand_over(&mut h, &target).await.0);
    assert!(device_unmounted(&got.device));
    let guest_dir = node.path("guest/ho-cwd");
    let map = serde_json::json!({
        target.as_str(): {"sandbox": "sb-1", "mount": guest_dir.to_str().unwrap()}
    });
    std::fs::write(node.cli_map(), map.to_string()).unwrap();
    h.hand_back(hv::HandBackRequest {
        target_path: target.clone(),
        sandbox_id: "sb-1".into(),
    })
    .await
    .unwrap();
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(mounts_under(node.dir.path()).is_empty());
}

/// The plugin SIGKILLed at every step of a handover (the test-only crash
/// point), then restarted: before the hand-off record is complete the
/// handover is rolled back (host mounts as before, no record); from the
/// record on it is rolled forward (no host mount, the record claimed by
/// the asking sandbox). Either way the runtime's retry gets the volume,
/// hands it back, and kubelet's teardown succeeds with nothing left.
/// Budget: about 10 s (five plugin starts, no guest).
#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_killed_at_every_step_of_a_handover_is_repaired_at_start() {
    let steps = [
        ("recorded", false),
        ("target-unmounted", false),
        ("staging-unmounted", false),
        ("record-written", true),
        ("placeholder-mounted", true),
    ];
    for (step, forward) in steps {
        let mut node = TestNode::deferral_unstarted("crust", &[]);
        node.env
            .push((crust_csi::HANDOVER_CRASH_ENV.into(), step.into()));
        node.start();
        let mut c = node.clients().await;
        let (id, staging, target) = host_published(&node, &mut c, "ho-k", "pk").await;
        std::fs::write(Path::new(&target).join("host.txt"), b"before").unwrap();

        let mut h = handover_client(&node).await;
        let r = h.hand_over(ask(&target, "sb-k", &["ext4"], false)).await;
        assert!(r.is_err(), "{step}: the plugin died mid-handover: {r:?}");
        node.crash();
        node.env.clear();
        node.env.push((
            "CRUST_TEST_CLI_MAP".into(),
            node.cli_map().to_str().unwrap().into(),
        ));
        node.start();
        let rec = crust_store(&node.crust_root());
        if forward {
            assert!(
                !host_mounted(&target),
                "{step}: rolled forward, no host mount"
            );
            assert!(!is_mounted(&staging), "{step}");
            assert_eq!(
                rec.claimant(&target).unwrap().as_deref(),
                Some("sb-k"),
                "{step}: the record is the asking sandbox's"
            );
        } else {
            assert!(
                host_mounted(&target),
                "{step}: rolled back to the host mount"
            );
            assert_eq!(
                std::fs::read(Path::new(&target).join("host.txt")).unwrap(),
                b"before",
                "{step}"
            );
            assert!(
                rec.read(&target).is_err(),
                "{step}: no record after a roll back"
            );
        }

        // The runtime retries: the volume is handed over, then back.
        let mut h = handover_client(&node).await;
        let got = handed_over(
            h.hand_over(ask(&target, "sb-k", &["ext4"], false))
                .await
                .unwrap_or_else(|e| panic!("{step}: {e}"))
                .into_inner(),
        );
        assert!(device_unmounted(&got.device), "{step}");
        // The runtime CLI reports the sandbox stopped (no guest mount).
        let map = serde_json::json!({
            target.as_str(): {"sandbox": "sb-k", "mount": node.path("guest/none").to_str().unwrap()}
        });
        std::fs::write(node.cli_map(), map.to_string()).unwrap();
        rec.release(&target, "sb-k").unwrap();
        h.hand_back(hv::HandBackRequest {
            target_path: target.clone(),
            sandbox_id: "sb-k".into(),
        })
        .await
        .unwrap_or_else(|e| panic!("{step}: {e}"));
        c = node.clients().await;
        c.unpublish(&id, &target).await.unwrap();
        c.unstage(&id, &staging).await.unwrap();
        c.delete(&id).await.unwrap();
        assert!(mounts_under(node.dir.path()).is_empty(), "{step}");
        assert!(loops_under(node.dir.path()).is_empty(), "{step}");
        let st = node.stop();
        assert!(st.success(), "{step}: {st}");
    }
}

/// Twenty rounds of HandOver and HandBack of one volume: each round moves
/// the volume off the host and back (asserted), and the HandOver latency
/// (request to answer: sync, unmounts, claimed record) is printed as
/// p50/p99 for the issue's note (a figure, not an assertion).
/// Budget: about 5 s (no guest).
#[tokio::test(flavor = "multi_thread")]
async fn handover_rounds_report_their_latency() {
    let mut node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let mut h = handover_client(&node).await;
    let id = c
        .create(create_req("ho-r", 1 << 30, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/ho-r");
    let target = node.mkdir("pods/pr/ho-r");
    let map = serde_json::json!({
        target.as_str(): {"sandbox": "sb-r", "mount": node.path("guest/none").to_str().unwrap()}
    });
    std::fs::write(node.cli_map(), map.to_string()).unwrap();
    let rec = crust_store(&node.crust_root());
    let mut took = Vec::new();
    for round in 0..20 {
        c.stage(&id, &staging, mount("ext4")).await.unwrap();
        c.publish(&id, &staging, &target, mount("ext4"), false)
            .await
            .unwrap();
        assert!(host_mounted(&target), "round {round}");
        let t0 = std::time::Instant::now();
        let got = handed_over(
            h.hand_over(ask(&target, "sb-r", &["ext4"], false))
                .await
                .unwrap()
                .into_inner(),
        );
        took.push(t0.elapsed());
        assert!(device_unmounted(&got.device), "round {round}");
        rec.release(&target, "sb-r").unwrap();
        h.hand_back(hv::HandBackRequest {
            target_path: target.clone(),
            sandbox_id: "sb-r".into(),
        })
        .await
        .unwrap();
        c.unpublish(&id, &target).await.unwrap();
        c.unstage(&id, &staging).await.unwrap();
    }
    took.sort();
    eprintln!(
        "HandOver latency over {} rounds: p50 {:?}, p99 {:?}, max {:?}",
        took.len(),
        took[took.len() / 2],
        took[took.len() * 99 / 100],
        took[took.len() - 1]
    );
    c.delete(&id).await.unwrap();
    assert!(mounts_under(node.dir.path()).is_empty());
    assert!(loops_under(node.dir.path()).is_empty());
    let st = node.stop();
    assert!(st.success(), "{st}");
}

/// The topmost mount at `p`: (source, root within its filesystem).
fn shown_at(p: &Path) -> (String, String) {
    let m = crust_blockdev::find_mount(p)
        .unwrap()
        .unwrap_or_else(|| panic!("nothing mounted at {}", p.display()));
    (m.source, m.root.display().to_string())
}

/// kubelet's subPath binds (issue 31): before it asks for a container with
/// a subPath, kubelet binds `<target>/<sub>` at
/// `<pod>/volume-subpaths/<volume>/<container>/<index>`: host mounts of
/// the device. A handover takes them with the target and leaves the same
/// path of the placeholder bound there (as for a volume deferred from the
/// start); an EBUSY that rolls the handover back restores them. On a
/// deferred target kubelet can make its subPath directories, but no data
/// lands there.
/// Budget: about 3 s (no guest).
#[tokio::test(flavor = "multi_thread")]
async fn kubelet_subpath_binds_go_with_the_volume() {
    let node = TestNode::deferral("crust", &[]);
    let mut c = node.clients().await;
    let mut h = handover_client(&node).await;
    let id = c
        .create(create_req("ho-sp", 1 << 30, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/ho-sp");
    let pod = node.path("kubelet/pods/u-31");
    let target = node.mkdir("kubelet/pods/u-31/volumes/kubernetes.io~csi/ho-sp/mount");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    let t = Path::new(&target);
    std::fs::create_dir_all(t.join("sub/dir")).unwrap();
    std::fs::write(t.join("sub/dir/f"), b"in sub").unwrap();
    std::fs::write(t.join("sub/file"), b"a file").unwrap();
    // kubelet's binds: a directory and a file subPath.
    let binds = pod.join("volume-subpaths/data/app");
    std::fs::create_dir_all(binds.join("0")).unwrap();
    std::fs::write(binds.join("1"), b"").unwrap();
    crust_blockdev::bind_mount(&t.join("sub/dir"), &binds.join("0"), false).unwrap();
    let _b0 = crust_blockdev::MountGuard::new(binds.join("0"));
    crust_blockdev::bind_mount(&t.join("sub/file"), &binds.join("1"), false).unwrap();
    let _b1 = crust_blockdev::MountGuard::new(binds.join("1"));
    let dev = crust_blockdev::find_mount(Path::new(&staging))
        .unwrap()
        .unwrap()
        .source;
    let before = [shown_at(&binds.join("0")), shown_at(&binds.join("1"))];
    assert_eq!(before[0], (dev.clone(), "/sub/dir".into()));

    // An EBUSY at the target's unmount rolls back: the binds are back.
    let backing = t.join("backing.img");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let lo = crust_testkit::losetup(&backing, false);
    let d = declined(timed_hand_over(&mut h, &target).await.0);
    assert!(
        d.message.contains("host mounts were restored"),
        "{}",
        d.message
    );
    assert_eq!(
        [shown_at(&binds.join("0")), shown_at(&binds.join("1"))],
        before
    );
    assert_eq!(std::fs::read(binds.join("0/f")).unwrap(), b"in sub");
    drop(lo);
    std::fs::remove_file(&backing).unwrap();

    // Handed over: no host mount of the device anywhere, the binds show
    // the placeholder's same paths (kubelet finds them in place).
    let got = handed_over(timed_hand_over(&mut h, &target).await.0);
    assert!(device_unmounted(&got.device), "{}", got.device);
    let ph = crust_handoff::PLACEHOLDER_SOURCE.to_string();
    assert_eq!(shown_at(&binds.join("0")), (ph.clone(), "/sub/dir".into()));
    assert_eq!(shown_at(&binds.join("1")), (ph, "/sub/file".into()));
    assert!(std::fs::read_dir(binds.join("0")).unwrap().next().is_none());
    let e = std::fs::write(binds.join("0/new"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");

    // The guest side, then the hand-back and kubelet's teardown (its
    // subPath cleanup unmounts the binds first).
    let map = serde_json::json!({
        target.as_str(): {"sandbox": "sb-1", "mount": node.path("guest/none").to_str().unwrap()}
    });
    std::fs::write(node.cli_map(), map.to_string()).unwrap();
    h.hand_back(hv::HandBackRequest {
        target_path: target.clone(),
        sandbox_id: "sb-1".into(),
    })
    .await
    .unwrap();
    drop((_b0, _b1));
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    // The data is where kubelet's subPath pointed.
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    assert_eq!(
        std::fs::read(Path::new(&staging).join("sub/dir/f")).unwrap(),
        b"in sub"
    );
    c.unstage(&id, &staging).await.unwrap();

    // Deferred from the start: kubelet's mkdir works, data does not land.
    let t2 = node.mkdir("kubelet/pods/u-31/volumes/kubernetes.io~csi/ho-sp2/mount");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.node
        .node_publish_volume(crust_proto::csi::v1::NodePublishVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.clone(),
            target_path: t2.clone(),
            volume_capability: Some(mount("ext4")),
            volume_context: [("deferFsOps".to_string(), "true".to_string())].into(),
            defer_fs_ops: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(is_mounted(&t2) && !host_mounted(&t2), "the placeholder");
    std::fs::create_dir_all(Path::new(&t2).join("a/b")).unwrap();
    let e = std::fs::write(Path::new(&t2).join("a/b/f"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
    c.unpublish(&id, &t2).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(mounts_under(node.dir.path()).is_empty());
    assert!(loops_under(node.dir.path()).is_empty());
}
