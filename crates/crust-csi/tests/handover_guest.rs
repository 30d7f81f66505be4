//! Runtime-driven handover end to end, real parts only: the real
//! `crust-csi` (pool on loop files, CSI + Handover sockets), the real
//! `crust-runtime` CLI and a real QEMU guest with the real agent. The host
//! publishes a volume as kubelet would; a crust sandbox whose bind source
//! is that target gets the volume handed over, plugged and mounted in its
//! guest; kubelet's plain stats/expansion reach the guest; the sandbox's
//! end hands it back without a host mount; a later host publication
//! checks it and holds all the data.
//!
//! Budget: six TCG guest boots (about 3 s each here), under 4 min on 2
//! loaded cores.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use common::*;
use crust_proto::csi::v1 as csi;
use crust_testkit::VmSlot;

/// The real `crust-runtime`, built into this test's target directory
/// (cargo builds only this package's binaries for its tests).
fn runtime_bin() -> PathBuf {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
        let bin = profile_dir.join("crust-runtime");
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args([
            "build",
            "--quiet",
            "-p",
            "crust-runtime",
            "--bin",
            "crust-runtime",
        ])
        .arg("--target-dir")
        .arg(profile_dir.parent().unwrap())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null());
        if profile_dir.file_name().and_then(|n| n.to_str()) == Some("release") {
            cmd.arg("--release");
        }
        let out = cmd.output().unwrap();
        assert!(
            bin.is_file(),
            "building crust-runtime failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        bin
    })
    .clone()
}

/// The runtime's configuration for this node (flags and, for the plugin
/// that runs `crust stats|resize`, the same as environment variables).
struct Rt {
    vars: Vec<(String, String)>,
    root: PathBuf,
}

impl Rt {
    fn new(node: &TestNode) -> Rt {
        crust_testkit::ensure_guest_image();
        let (kernel, initrd) = crust_testkit::guest_image();
        let root = node.path("runtime");
        let vars = [
            ("CRUST_RUNTIME_ROOT", root.clone()),
            ("CRUST_RUNTIME_CRUST_ROOT", node.crust_root()),
            ("CRUST_RUNTIME_KATA_ROOT", node.kata_root()),
            ("CRUST_RUNTIME_PODS_LAYER_STOP", node.path("pods")),
            ("CRUST_RUNTIME_GUEST_KERNEL", kernel),
            ("CRUST_RUNTIME_GUEST_INITRD", initrd),
            ("CRUST_RUNTIME_ACCEL", "tcg".into()),
            ("CRUST_RUNTIME_KATA_SHIM_DIRS", node.path("vc-sbs")),
            ("CRUST_RUNTIME_TIMEOUT_MS", "30000".into()),
            (
                "CRUST_RUNTIME_HANDOVER_ENDPOINT",
                format!("unix://{}", node.handover_socket().display()).into(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_string()))
        .collect();
        Rt { vars, root }
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new(runtime_bin())
            .args(args)
            .envs(self.vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    #[track_caller]
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "crust-runtime {args:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    #[track_caller]
    fn sh(&self, id: &str, script: &str) -> String {
        self.ok(&["exec", id, "--", "sh", "-c", script])
    }

    fn bundle(&self, name: &str, source: &str) -> PathBuf {
        self.bundle_annotated(name, source, serde_json::json!({}))
    }

    fn bundle_annotated(
        &self,
        name: &str,
        source: &str,
        annotations: serde_json::Value,
    ) -> PathBuf {
        let dir = self.root.with_file_name("bundles").join(name);
        std::fs::create_dir_all(dir.join("rootfs")).unwrap();
        let spec = serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"terminal": false, "user": {"uid": 0, "gid": 0},
                "args": ["sleep", "600"], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "cwd": "/"},
            "root": {"path": "rootfs"},
            "mounts": [{"destination": "/data", "type": "bind", "source": source,
                "options": ["rbind", "rprivate"]}],
            "annotations": annotations,
        });
        std::fs::write(dir.join("config.json"), spec.to_string()).unwrap();
        dir
    }

    fn state(&self, id: &str) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.root.join(id).join("state.json")).unwrap())
            .unwrap()
    }
}

/// Deletes the sandbox (force) on drop.
struct SandboxGuard<'a>(&'a Rt, String);

impl Drop for SandboxGuard<'_> {
    fn drop(&mut self) {
        if self.0.root.join(&self.1).exists() {
            let _ = self.0.run(&["delete", "--force", &self.1]);
        }
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Bytes (total, used) of `df -B1` output's last line.
fn df(out: &str) -> (u64, u64) {
    let f: Vec<u64> = out
        .lines()
        .last()
        .unwrap()
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    (f[0], f[1])
}

/// One sandbox using the published target: handed over, data checked and
/// written in the guest. Returns the handover latencies (the HandOver
/// call; request to mounted in the guest; hot-plug and mount, ms) and
/// leaves it running.
fn start_sandbox(rt: &Rt, id: &str, target: &str) -> (u64, u64, u64) {
    let bundle = rt.bundle(id, target);
    let t0 = Instant::now();
    rt.ok(&["create", "--bundle", bundle.to_str().unwrap(), id]);
    let create_ms = t0.elapsed().as_millis();
    rt.ok(&["start", id]);
    let st = rt.state(id);
    let ev = &st["events"][0];
    assert_eq!(ev["outcome"], "handed-over", "{st}");
    let mounted_ms = ev["elapsed_ms"].as_u64().expect("mounted_ms");
    let answer_ms = ev["answer_ms"].as_u64().expect("answer_ms");
    let plug_ms = ev["plug_ms"].as_u64().expect("plug_ms");
    assert!(answer_ms + plug_ms <= mounted_ms, "{st}");
    eprintln!(
        "handover {id}: rpc {answer_ms} ms, hot-plug+mount {plug_ms} ms, request->mounted in guest \
         {mounted_ms} ms (create {create_ms} ms, includes the guest boot)"
    );
    assert_eq!(st["volumes"].as_array().unwrap().len(), 1, "{st}");
    (answer_ms, mounted_ms, plug_ms)
}

/// Prints the rounds' latencies as p50/p99 for the note.
fn report(latencies: &[(u64, u64, u64)]) {
    let mut rpc: Vec<u64> = latencies.iter().map(|l| l.0).collect();
    let mut mounted: Vec<u64> = latencies.iter().map(|l| l.1).collect();
    let mut own: Vec<u64> = latencies.iter().map(|l| l.0 + l.2).collect();
    rpc.sort_unstable();
    mounted.sort_unstable();
    own.sort_unstable();
    eprintln!(
        "handover over {} rounds: HandOver call p50 {} ms p99 {} ms; HandOver + hot-plug + mount \
         in guest p50 {} ms p99 {} ms; request->mounted in guest (guest boot included) p50 {} ms \
         p99 {} ms",
        latencies.len(),
        percentile(&rpc, 0.5),
        percentile(&rpc, 0.99),
        percentile(&own, 0.5),
        percentile(&own, 0.99),
        percentile(&mounted, 0.5),
        percentile(&mounted, 0.99)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crust_sandbox_gets_the_published_volume_handed_over_and_back() {
    let mut node = TestNode::deferral_unstarted("crust", &[]);
    let rt = Rt::new(&node);
    // The plugin runs the runtime CLI for stats/resize: same roots.
    node.env.extend(rt.vars.iter().cloned());
    node.start();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("hg-1", 256 << 20, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/hg-1");
    let target = node.mkdir("pods/p1/volumes/hg-1/mount");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    std::fs::write(Path::new(&target).join("host.txt"), b"from the host").unwrap();
    let mut latencies = Vec::new();

    {
        let _slot = VmSlot::acquire();
        let _sb = SandboxGuard(&rt, "hg-a".into());
        latencies.push(start_sandbox(&rt, "hg-a", &target));
        // The guest sees the host's data on the device and writes more.
        assert_eq!(rt.sh("hg-a", "cat /data/host.txt"), "from the host");
        rt.sh("hg-a", "echo from the guest > /data/guest.txt && sync");
        // The host target is not the volume while it is handed over.
        assert!(!host_mounted(&target), "target mounted on the host");
        assert!(!Path::new(&target).join("guest.txt").exists());
        assert!(
            std::fs::write(Path::new(&target).join("x"), b"x").is_err(),
            "the host target is writable while handed over"
        );
        // kubelet's plain stats (no defer_fs_ops) are the guest's df.
        let stats = c
            .node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: target.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let bytes = stats
            .usage
            .iter()
            .find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32)
            .unwrap();
        let (total, used) = df(&rt.sh("hg-a", "df -B1 /data"));
        assert_eq!(bytes.total as u64, total, "stats total vs guest df");
        assert_eq!(bytes.used as u64, used, "stats used vs guest df");
        // kubelet's plain expansion grows the filesystem in the guest.
        c.ctl
            .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                volume_id: id.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: 512 << 20,
                    limit_bytes: 0,
                }),
                volume_capability: Some(mount("ext4")),
                ..Default::default()
            })
            .await
            .unwrap();
        c.node
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: id.clone(),
                volume_path: target.clone(),
                staging_target_path: staging.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: 512 << 20,
                    limit_bytes: 0,
                }),
                volume_capability: Some(mount("ext4")),
                ..Default::default()
            })
            .await
            .unwrap();
        let (grown, _) = df(&rt.sh("hg-a", "df -B1 /data"));
        assert!(grown > total + (200 << 20), "guest fs {total} -> {grown}");
        // The sandbox ends: the volume goes back, not mounted on the host.
        rt.ok(&["delete", "--force", "hg-a"]);
    }
    assert!(!host_mounted(&target), "hand back mounted the target");
    assert!(!host_mounted(&staging), "hand back mounted staging");

    // kubelet tears the returned publication down, then publishes again:
    // checked in userspace, mounted nosuid,nodev, all data there.
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    let m = crust_blockdev::find_mount(Path::new(&target))
        .unwrap()
        .expect("host publication mounted");
    assert!(
        m.mount_options.iter().any(|o| o == "nosuid")
            && m.mount_options.iter().any(|o| o == "nodev"),
        "{:?}",
        m.mount_options
    );
    assert_eq!(
        std::fs::read(Path::new(&target).join("guest.txt")).unwrap(),
        b"from the guest\n"
    );
    assert_eq!(
        std::fs::read(Path::new(&target).join("host.txt")).unwrap(),
        b"from the host"
    );

    // More rounds: handed over again each time, the guest sees both files.
    for round in 0..3 {
        let _slot = VmSlot::acquire();
        let sb = format!("hg-b{round}");
        let _sb = SandboxGuard(&rt, sb.clone());
        latencies.push(start_sandbox(&rt, &sb, &target));
        assert_eq!(
            rt.sh(&sb, "cat /data/host.txt /data/guest.txt"),
            "from the hostfrom the guest\n"
        );
        rt.ok(&["delete", "--force", &sb]);
        assert!(
            !host_mounted(&target),
            "round {round}: returned with a host mount"
        );
        c.unpublish(&id, &target).await.unwrap();
        c.unstage(&id, &staging).await.unwrap();
        c.stage(&id, &staging, mount("ext4")).await.unwrap();
        c.publish(&id, &staging, &target, mount("ext4"), false)
            .await
            .unwrap();
    }
    // The last republication holds all data again.
    assert_eq!(
        std::fs::read(Path::new(&target).join("guest.txt")).unwrap(),
        b"from the guest\n"
    );
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    report(&latencies);
    assert!(mounts_under(node.dir.path()).is_empty(), "mounts left");
    assert!(loops_under(node.dir.path()).is_empty(), "loops left");
}

/// A volume published at two targets is never handed over: in auto mode
/// the runtime shares the host mount over virtio-fs and its events say
/// why; with `io.crust.defer-fs-ops: required` the container is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_handover_shares_the_host_mount_and_a_required_one_fails() {
    let mut node = TestNode::deferral_unstarted("crust", &[]);
    let rt = Rt::new(&node);
    node.env.extend(rt.vars.iter().cloned());
    node.start();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("hg-2", 256 << 20, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/hg-2");
    let t1 = node.mkdir("pods/p1/volumes/hg-2/mount");
    let t2 = node.mkdir("pods/p2/volumes/hg-2/mount");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    for t in [&t1, &t2] {
        c.publish(&id, &staging, t, mount("ext4"), false)
            .await
            .unwrap();
    }
    std::fs::write(Path::new(&t1).join("host.txt"), b"shared").unwrap();

    // Required: refused, nothing handed over, the host mounts stay.
    let b = rt.bundle_annotated(
        "hg-req",
        &t1,
        serde_json::json!({"io.crust.defer-fs-ops": "required"}),
    );
    {
        let _sb = SandboxGuard(&rt, "hg-req".into());
        let out = rt.run(&["create", "--bundle", b.to_str().unwrap(), "hg-req"]);
        assert!(
            !out.status.success(),
            "a required handover of a multi-target volume succeeded"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("more than one") || err.contains("target"),
            "{err}"
        );
    }
    assert!(
        host_mounted(&t1) && host_mounted(&t2),
        "the refusal moved the volume"
    );

    // Auto: declined, shared over virtio-fs, the guest sees the host data.
    {
        let _slot = VmSlot::acquire();
        let _sb = SandboxGuard(&rt, "hg-auto".into());
        let b = rt.bundle("hg-auto", &t1);
        rt.ok(&["create", "--bundle", b.to_str().unwrap(), "hg-auto"]);
        rt.ok(&["start", "hg-auto"]);
        let st = rt.state("hg-auto");
        let ev = &st["events"][0];
        assert_eq!(ev["outcome"], "host", "{st}");
        assert!(
            ev["message"].as_str().unwrap().contains("MULTIPLE_TARGETS"),
            "{st}"
        );
        assert_eq!(st["volumes"].as_array().map_or(0, Vec::len), 0, "{st}");
        assert_eq!(rt.sh("hg-auto", "cat /data/host.txt"), "shared");
        rt.sh("hg-auto", "echo via-share > /data/guest.txt");
        rt.ok(&["delete", "--force", "hg-auto"]);
    }
    assert_eq!(
        std::fs::read(Path::new(&t2).join("guest.txt")).unwrap(),
        b"via-share\n"
    );
    for t in [&t1, &t2] {
        c.unpublish(&id, t).await.unwrap();
    }
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(mounts_under(node.dir.path()).is_empty(), "mounts left");
    assert!(loops_under(node.dir.path()).is_empty(), "loops left");
}

/// The runtime's shim is SIGKILLed while its guest uses a handed-over
/// volume (no orderly hand-back): the next `delete` of that sandbox kills
/// its QEMU, releases the claim and hands the volume back, still without a
/// host mount; kubelet's teardown and a republication then work and hold
/// the guest's data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runtime_is_repaired_by_the_next_delete() {
    let mut node = TestNode::deferral_unstarted("crust", &[]);
    let rt = Rt::new(&node);
    node.env.extend(rt.vars.iter().cloned());
    node.start();
    let mut c = node.clients().await;
    let id = c
        .create(create_req("hg-3", 256 << 20, vec![mount("ext4")]))
        .await
        .unwrap()
        .volume_id;
    let staging = node.mkdir("staging/hg-3");
    let target = node.mkdir("pods/p1/volumes/hg-3/mount");
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    {
        let _slot = VmSlot::acquire();
        let _sb = SandboxGuard(&rt, "hg-kill".into());
        start_sandbox(&rt, "hg-kill", &target);
        rt.sh("hg-kill", "echo before-the-crash > /data/g.txt && sync");
        let st = rt.state("hg-kill");
        let shim = st["shim"]["pid"].as_i64().unwrap() as i32;
        let qemu = st["qemu"]["pid"].as_i64().unwrap() as i32;
        let pid = |n: i32| rustix::process::Pid::from_raw(n).unwrap();
        let alive = |n: i32| rustix::process::test_kill_process(pid(n)).is_ok();
        let _ = rustix::process::kill_process(pid(shim), rustix::process::Signal::KILL);
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while alive(shim) && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        // The volume is still the guest's: kubelet cannot take it.
        assert!(!host_mounted(&target));
        rt.ok(&["delete", "--force", "hg-kill"]);
        assert!(!alive(qemu), "QEMU survived delete");
    }
    assert!(!host_mounted(&target), "repair mounted the target");
    assert!(!host_mounted(&staging), "repair mounted staging");
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.stage(&id, &staging, mount("ext4")).await.unwrap();
    c.publish(&id, &staging, &target, mount("ext4"), false)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(Path::new(&target).join("g.txt")).unwrap(),
        b"before-the-crash\n"
    );
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.delete(&id).await.unwrap();
    assert!(mounts_under(node.dir.path()).is_empty(), "mounts left");
    assert!(loops_under(node.dir.path()).is_empty(), "loops left");
}
