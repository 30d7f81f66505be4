//! `crustctl bench` (and a few single RPCs) against the real `crust-csi`
//! plugin with its pool backend in a tempdir: real loop devices, real mkfs
//! and mounts. Needs root and the `crust-csi` binary built next to this
//! test (`cargo build -p crust-csi`, or the lead's CI, which builds every
//! binary first); without the binary the test says so and passes.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crust_testkit::ChildGuard;
use serde_json::Value;

/// `target/<profile>/crust-csi` if it has been built.
fn crust_csi_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let profile = exe.parent()?.parent()?;
    profile
        .join("crust-csi")
        .is_file()
        .then(|| crust_testkit::workspace_bin("crust-csi"))
}

/// Unmounts everything under `root` and detaches loop devices backed by
/// files under it, on drop — also when the test fails.
struct NodeCleanup(PathBuf);

impl Drop for NodeCleanup {
    fn drop(&mut self) {
        for _ in 0..8 {
            let mounts = mounts_under(&self.0);
            if mounts.is_empty() {
                break;
            }
            for m in mounts.into_iter().rev() {
                if crust_blockdev::unmount(&m).is_err() {
                    let _ = rustix::mount::unmount(&m, rustix::mount::UnmountFlags::DETACH);
                }
            }
        }
        for l in loops_under(&self.0) {
            let _ = crust_blockdev::detach(&l);
        }
    }
}

fn mounts_under(root: &Path) -> Vec<PathBuf> {
    crust_blockdev::mount_info()
        .unwrap()
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(root))
        .collect()
}

fn loops_under(root: &Path) -> Vec<PathBuf> {
    crust_blockdev::list_loops()
        .unwrap()
        .into_iter()
        .filter(|l| l.backing_file.starts_with(root))
        .map(|l| l.path)
        .collect()
}

fn crustctl(endpoint: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_crustctl"))
        .args(["--endpoint", endpoint, "--timeout", "120s"])
        .args(args)
        .output()
        .expect("run crustctl")
}

fn json(o: &Output) -> Value {
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "crustctl failed ({:?}): {out}\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

#[test]
fn bench_against_crust_csi_leaves_nothing_behind() {
    let Some(bin) = crust_csi_bin() else {
        crust_testkit::missing_tool(
            "crust-csi is not built next to this test; run `cargo build -p crust-csi` first",
        );
        return;
    };
    crust_testkit::require_root();
    let dir = tempfile::Builder::new()
        .prefix("crustctl-csi")
        .tempdir_in("/tmp")
        .unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let socket = root.join("csi.sock");
    let endpoint = format!("unix://{}", socket.display());
    let log = root.join("plugin.log");
    let child = Command::new(&bin)
        .arg("--endpoint")
        .arg(&endpoint)
        .args(["--node-id", "bench-node", "--pool-capacity", "8Gi"])
        .arg("--state-dir")
        .arg(root.join("state"))
        .arg("--pool-dir")
        .arg(root.join("pool"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // Drop order: the plugin first, then the node sweep, then the dir.
    let cleanup = NodeCleanup(root.clone());
    let mut plugin = ChildGuard::new(child);
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if let Some(st) = plugin.child().try_wait().unwrap() {
            panic!(
                "crust-csi exited ({st}): {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "crust-csi did not come up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let staging = root.join("kubelet/plugins/globalmount");
    let target = root.join("kubelet/pods");
    for (label, extra) in [
        ("ext4", vec!["--fs-type", "ext4", "--size", "32Mi"]),
        ("xfs", vec!["--fs-type", "xfs", "--size", "320Mi"]),
        ("block", vec!["--block", "--size", "32Mi"]),
    ] {
        let mut args = vec![
            "bench",
            "--ops",
            "6",
            "--concurrency",
            "2",
            "--stats-volumes",
            "2",
            "-o",
            "json",
        ];
        args.extend(extra);
        args.extend(["--staging-dir", staging.to_str().unwrap()]);
        args.extend(["--target-dir", target.to_str().unwrap()]);
        let r = json(&crustctl(&endpoint, &args));
        assert_eq!(r["driver"], "blk.crust.dev", "{label}");
        assert!(
            r["skipped"].as_array().unwrap().is_empty(),
            "{label}: {:#}",
            r["skipped"]
        );
        for s in r["scenarios"].as_array().unwrap() {
            assert_eq!(s["ops"], 6, "{label}: {s:#}");
            assert_eq!(s["errors"], 0, "{label}: {s:#}");
            for row in s["rpcs"].as_array().unwrap() {
                assert_eq!(row["errors"], 0, "{label}: {row}");
                assert!(row["count"].as_u64().unwrap() >= 6, "{label}: {row}");
            }
        }
        assert_eq!(r["scenarios"].as_array().unwrap().len(), 3, "{label}");
        assert!(
            r["cleanup"]["leftovers"].as_array().unwrap().is_empty(),
            "{label}"
        );

        // Nothing left: no mounts, no loop devices on pool files, no volumes,
        // and bench's directories are gone.
        assert_eq!(
            mounts_under(&root),
            Vec::<PathBuf>::new(),
            "{label}: mounts left"
        );
        assert_eq!(
            loops_under(&root),
            Vec::<PathBuf>::new(),
            "{label}: loop devices left"
        );
        let list = json(&crustctl(
            &endpoint,
            &["controller", "list", "--all", "-o", "json"],
        ));
        assert_eq!(
            list["entries"],
            serde_json::json!([]),
            "{label}: volumes left"
        );
        assert!(!root.join("kubelet").exists(), "{label}: bench dirs left");
    }

    // A plain create/stats/delete through the single-RPC commands.
    let v = json(&crustctl(
        &endpoint,
        &[
            "controller",
            "create",
            "--name",
            "ctl-one",
            "--size",
            "16Mi",
            "-o",
            "json",
        ],
    ));
    let id = v["volume"]["volume_id"].as_str().unwrap().to_string();
    assert!(v["volume"]["capacity_bytes"].as_i64().unwrap() >= 16 << 20);
    let o = crustctl(&endpoint, &["controller", "delete", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = crustctl(&endpoint, &["controller", "get", &id]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).starts_with("error: NotFound: "),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // Snapshots, a restore, a clone and a group snapshot through crustctl.
    let mk = |name: &str| {
        json(&crustctl(
            &endpoint,
            &[
                "controller",
                "create",
                "--name",
                name,
                "--size",
                "16Mi",
                "-o",
                "json",
            ],
        ))["volume"]["volume_id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (a, b) = (mk("snap-src-a"), mk("snap-src-b"));
    let s = json(&crustctl(
        &endpoint,
        &[
            "controller",
            "snapshot-create",
            "--name",
            "s-a",
            "--source-volume",
            &a,
            "-o",
            "json",
        ],
    ));
    let sid = s["snapshot"]["snapshot_id"].as_str().unwrap().to_string();
    assert_eq!(s["snapshot"]["source_volume_id"], a.as_str());
    assert_eq!(s["snapshot"]["ready_to_use"], true);
    let listed = json(&crustctl(
        &endpoint,
        &[
            "controller",
            "snapshot-list",
            "--source-volume",
            &a,
            "-o",
            "json",
        ],
    ));
    assert_eq!(listed["entries"].as_array().unwrap().len(), 1);
    let restored = json(&crustctl(
        &endpoint,
        &[
            "controller",
            "create",
            "--name",
            "restored",
            "--size",
            "16Mi",
            "--source-snapshot",
            &sid,
            "-o",
            "json",
        ],
    ));
    assert_eq!(
        restored["volume"]["content_source"]["snapshot"]["snapshot_id"],
        sid.as_str()
    );
    let clone = json(&crustctl(
        &endpoint,
        &[
            "controller",
            "create",
            "--name",
            "clone",
            "--size",
            "16Mi",
            "--source-volume",
            &b,
            "-o",
            "json",
        ],
    ));
    assert_eq!(
        clone["volume"]["content_source"]["volume"]["volume_id"],
        b.as_str()
    );
    let caps = json(&crustctl(
        &endpoint,
        &["group", "capabilities", "-o", "json"],
    ));
    assert_eq!(
        caps["capabilities"][0]["rpc"]["type"],
        "CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT"
    );
    let g = json(&crustctl(
        &endpoint,
        &[
            "group", "create", "--name", "g", "--volume", &a, "--volume", &b, "-o", "json",
        ],
    ));
    let gid = g["group_snapshot"]["group_snapshot_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(g["group_snapshot"]["ready_to_use"], true);
    assert_eq!(
        g["group_snapshot"]["snapshots"].as_array().unwrap().len(),
        2
    );
    let got = json(&crustctl(&endpoint, &["group", "get", &gid, "-o", "json"]));
    assert_eq!(got["group_snapshot"], g["group_snapshot"]);
    let o = crustctl(&endpoint, &["group", "delete", &gid]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = crustctl(&endpoint, &["group", "get", &gid]);
    assert!(
        String::from_utf8_lossy(&o.stderr).starts_with("error: NotFound: "),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for v in [
        &a,
        &b,
        restored["volume"]["volume_id"].as_str().unwrap(),
        clone["volume"]["volume_id"].as_str().unwrap(),
    ] {
        let o = crustctl(&endpoint, &["controller", "delete", v]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let o = crustctl(&endpoint, &["controller", "snapshot-delete", &sid]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    drop(plugin);
    drop(cleanup);
    assert!(mounts_under(&root).is_empty() && loops_under(&root).is_empty());
}
