//! The crust-csi image as a cluster runs it: built by
//! `scripts/build-images.sh`, imported into a real containerd (Debian's,
//! private to the test) and run under runc with the DaemonSet's flags and
//! mounts (privileged, `/var/lib/kubelet` with
//! Bidirectional propagation, `/dev`, state, hand-off and runtime
//! directories). From the host, as kubelet would: Probe answers ready,
//! then create, stage and publish a volume; the publish mount made inside
//! the container is visible at the host's kubelet directory and a file
//! written there lands on the volume; then unpublish, unstage and delete
//! leave nothing mounted or attached.
//!
//! Time budget: one image build (~40 s on a loaded 2-core machine) plus
//! ~10 s of containerd. `CRUST_IMAGES_PREBUILT=<dir>` reuses the archives
//! of an earlier `scripts/build-images.sh` run (for iterating by hand).

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::tag;
use crust_testkit::{Containerd, ContainerdOptions};

const NAMESPACE: &str = "crust-image-test";
const CONTAINER: &str = "crust-csi-node";

/// The plugin's image archive: built into `out`, or the prebuilt one.
fn plugin_image(out: &Path) -> PathBuf {
    let name = format!("crust-csi-{}.oci.tar", tag());
    if let Some(dir) = std::env::var_os("CRUST_IMAGES_PREBUILT") {
        return PathBuf::from(dir).join(name);
    }
    common::build_images(out, None);
    out.join(name)
}

/// The host side of the node: kubelet's directory as a shared mount (this
/// machine's `/` may be private; a node's is shared), and the other
/// directories the DaemonSet mounts. Unmounts everything below on drop.
struct HostNode {
    dir: tempfile::TempDir,
}

impl HostNode {
    fn new() -> HostNode {
        let dir = tempfile::Builder::new()
            .prefix("crust-img-")
            .tempdir_in("/tmp")
            .unwrap();
        let node = HostNode { dir };
        for d in [
            "kubelet",
            "state",
            "run-crust",
            "run-crust-runtime",
            "run-crust-csi",
            "opt",
        ] {
            fs::create_dir_all(node.path(d)).unwrap();
        }
        let kubelet = node.path("kubelet");
        run_ok(
            Command::new("mount")
                .arg("--bind")
                .arg(&kubelet)
                .arg(&kubelet),
        );
        run_ok(Command::new("mount").arg("--make-rshared").arg(&kubelet));
        node
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// Mount points below the node's directory (the kubelet bind itself
    /// excluded).
    fn mounts(&self) -> Vec<String> {
        let kubelet = self.path("kubelet");
        fs::read_to_string("/proc/self/mounts")
            .unwrap()
            .lines()
            .filter_map(|l| l.split(' ').nth(1))
            .filter(|p| Path::new(p).starts_with(self.dir.path()) && Path::new(p) != kubelet)
            .map(str::to_string)
            .collect()
    }
}

impl Drop for HostNode {
    fn drop(&mut self) {
        crust_testkit::unmount_below(self.dir.path());
        // Loop devices the plugin attached for a volume in this pool.
        let pool = self.path("state/pool");
        if let Ok(out) = Command::new("losetup").arg("-a").output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if line.contains(&pool.display().to_string())
                    && let Some(dev) = line.split(':').next()
                {
                    let _ = Command::new("losetup").args(["-d", dev]).status();
                }
            }
        }
    }
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Stops and removes the container (then containerd's own guard stops
/// containerd and anything left).
struct Task<'a>(&'a Containerd);

impl Drop for Task<'_> {
    fn drop(&mut self) {
        let _ = self
            .0
            .ctr_in(NAMESPACE, &["task", "kill", "-s", "SIGTERM", CONTAINER]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline
            && self
                .0
                .ctr_in(NAMESPACE, &["task", "delete", CONTAINER])
                .status
                .code()
                != Some(0)
        {
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = self
            .0
            .ctr_in(NAMESPACE, &["task", "delete", "-f", CONTAINER]);
        let _ = self
            .0
            .ctr_in(NAMESPACE, &["container", "delete", CONTAINER]);
    }
}

#[test]
fn the_plugin_image_serves_kubelet_from_a_containerd_container() {
    crust_testkit::require_root();
    let out = tempfile::tempdir().unwrap();
    let archive = plugin_image(out.path());
    let node = HostNode::new();
    let ctrd = Containerd::start(ContainerdOptions::default());
    ctrd.import_images(NAMESPACE, &[&archive]);
    let image = format!("localhost/crust/crust-csi:{}", tag());

    // The DaemonSet's container, as ctr flags: same arguments (no metrics
    // port: the test shares the host's network), same mounts. Not the host
    // PID namespace: runc here cannot join it from a test (no guest holds
    // a device in this test, which is what hostPID is for).
    let bind = |src: &Path, dst: &str, opts: &str| {
        format!("type=bind,src={},dst={dst},options={opts}", src.display())
    };
    let runc_root = ctrd.runc_root().display().to_string();
    let mounts = [
        bind(
            &node.path("kubelet"),
            "/var/lib/kubelet",
            "rbind:rshared:rw",
        ),
        bind(Path::new("/dev"), "/dev", "rbind:rw"),
        bind(&node.path("state"), "/var/lib/crust-csi", "rbind:rw"),
        bind(&node.path("run-crust"), "/run/crust", "rbind:rw"),
        bind(&node.path("opt"), "/opt", "rbind:ro"),
        bind(
            &node.path("run-crust-runtime"),
            "/run/crust-runtime",
            "rbind:rw",
        ),
        bind(&node.path("run-crust-csi"), "/run/crust-csi", "rbind:rw"),
    ];
    let mut args: Vec<String> = vec![
        "run".into(),
        "-d".into(),
        "--privileged".into(),
        "--net-host".into(),
        "--rootfs-propagation".into(),
        "rshared".into(),
        "--runc-root".into(),
        runc_root,
        "--env".into(),
        "CRUST_CSI_NODE_ID=image-test-node".into(),
        "--env".into(),
        "CRUST_RUNTIME_ROOT=/run/crust-runtime".into(),
    ];
    for m in &mounts {
        args.push("--mount".into());
        args.push(m.clone());
    }
    args.extend(
        [
            image.as_str(),
            CONTAINER,
            "/usr/bin/crust-csi",
            "--endpoint=unix:///var/lib/kubelet/plugins/blk.crust.dev/csi.sock",
            "--state-dir=/var/lib/crust-csi",
            "--pool-dir=/var/lib/crust-csi/pool",
            "--pool-capacity=4Gi",
            "--expansion=node",
            "--deferral=enabled",
            "--handoff-layout=crust",
            "--crust-root=/run/crust",
            "--allowed-target-prefix=/var/lib/kubelet/pods/",
        ]
        .map(String::from),
    );
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    ctrd.ctr_ok(NAMESPACE, &argv);
    let _task = Task(&ctrd);

    // kubelet reaches the plugin through the socket in its own directory.
    let socket = node.path("kubelet/plugins/blk.crust.dev/csi.sock");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "no plugin socket at {}; container output: {}",
            socket.display(),
            ctrd.log_tail(3000)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let crustctl = |args: &[&str]| -> serde_json::Value {
        let out = run_ok(
            Command::new(crust_testkit::workspace_bin("crustctl"))
                .arg("--endpoint")
                .arg(format!("unix://{}", socket.display()))
                .args(["-o", "json"])
                .args(args),
        );
        serde_json::from_str(&out).unwrap_or(serde_json::Value::Null)
    };
    let probe = crustctl(&["identity", "probe"]);
    assert_eq!(probe["ready"], true, "{probe}");
    let info = crustctl(&["node", "info"]);
    assert_eq!(info["node_id"], "image-test-node", "{info}");

    // Paths as kubelet sends them (the container's view is the node's).
    let vol = crustctl(&["controller", "create", "--name", "img", "--size", "64Mi"]);
    let id = vol["volume"]["volume_id"]
        .as_str()
        .expect("volume id")
        .to_string();
    let uid = "0d6c5f4e-img-test";
    let staging = "/var/lib/kubelet/plugins/kubernetes.io/csi/blk.crust.dev/img/globalmount";
    let target = format!("/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~csi/img/mount");
    let host = |p: &str| {
        node.path(&format!(
            "kubelet/{}",
            p.strip_prefix("/var/lib/kubelet/").unwrap()
        ))
    };
    fs::create_dir_all(host(staging)).unwrap();
    fs::create_dir_all(host(target.rsplit_once('/').unwrap().0)).unwrap();
    crustctl(&[
        "node",
        "stage",
        &id,
        "--staging-path",
        staging,
        "--fs-type",
        "ext4",
    ]);
    crustctl(&[
        "node",
        "publish",
        &id,
        "--staging-path",
        staging,
        "--target-path",
        &target,
        "--fs-type",
        "ext4",
    ]);

    // The publication made inside the container reached the host
    // (Bidirectional propagation): kubelet would bind it into the pod.
    let host_target = host(&target);
    assert!(
        node.mounts().iter().any(|m| Path::new(m) == host_target),
        "publish mount not visible on the host: {:?}",
        node.mounts()
    );
    fs::write(host_target.join("written-by-pod"), b"from the host side").unwrap();
    let stats = crustctl(&["node", "stats", &id, "--volume-path", &target]);
    let bytes = stats["usage"]
        .as_array()
        .and_then(|u| u.iter().find(|x| x["unit"] == "BYTES"))
        .unwrap_or_else(|| panic!("no BYTES usage: {stats}"));
    let total = bytes["total"].as_i64().unwrap();
    assert!(
        (40 << 20..=64 << 20).contains(&total),
        "ext4 on a 64 MiB volume: {stats}"
    );

    crustctl(&["node", "unpublish", &id, "--target-path", &target]);
    crustctl(&["node", "unstage", &id, "--staging-path", staging]);
    assert!(
        node.mounts().is_empty(),
        "left mounted: {:?}",
        node.mounts()
    );
    // The file is on the volume's backing file in the pool: stage it again
    // on the host side of the pool and read it back through debugfs.
    let backing = fs::read_dir(node.path("state/pool"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains(&id))
        .expect("backing file in the pool");
    let cat = run_ok(
        Command::new("debugfs")
            .args(["-R", "cat /written-by-pod"])
            .arg(&backing),
    );
    assert_eq!(cat, "from the host side");
    crustctl(&["controller", "delete", &id]);
    assert!(!backing.exists(), "the backing file is deleted");
}
