//! Must-show 3: the VM's memory and vCPUs follow the container's limits; containerd
//! restarted under a running crust container reconnects and later stop
//! and delete work; kill -9 of QEMU, of virtiofsd and of the shim each end
//! in a task exit containerd sees, abnormal CSI stats, and the deferred
//! volume taken by the next container with its data intact; bad input
//! (forged record, volume claimed by another pod, unsupported OCI feature,
//! missing paths) is a clear error that changes nothing.
//! Budget: ~9 TCG boots, ~90 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Env, MIB, mount_cap, pid_of_child, qemus_under, start_plugin};
use crust_proto::csi::v1 as csi;
use crust_testkit::BUSYBOX_IMAGE;

const NS: &str = "default";
const RUNTIME: &str = "io.containerd.crust.v2";

fn run_args<'a>(extra: &[&'a str], id: &'a str, cmd: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["run", "--runtime", RUNTIME];
    v.extend_from_slice(extra);
    v.push(BUSYBOX_IMAGE);
    v.push(id);
    v.extend_from_slice(cmd);
    v
}

/// MemTotal of a fresh container's guest, in bytes.
fn mem_total(env: &Env, id: &str, extra: &[&str]) -> u64 {
    let o = env.ctrd.ctr_in(
        NS,
        &run_args(
            &[&["--rm"], extra].concat(),
            id,
            &["sh", "-c", "grep MemTotal /proc/meminfo"],
        ),
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let kib: u64 = out
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "MemTotal in {out:?}: {}\n{}",
                String::from_utf8_lossy(&o.stderr),
                env.logs()
            )
        });
    kib * 1024
}

/// Polls `ctr task ls` until `id` is no longer running.
fn wait_not_running(env: &Env, id: &str) -> String {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let ls = env.ctrd.ctr_ok(NS, &["task", "ls"]);
        let line = ls
            .lines()
            .find(|l| l.split_whitespace().next() == Some(id))
            .unwrap_or("")
            .to_string();
        if !line.contains("RUNNING") {
            return line;
        }
        assert!(
            Instant::now() < until,
            "{id} still running: {ls}\n{}",
            env.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn forget(env: &Env, id: &str) {
    let _ = env.ctrd.ctr_in(NS, &["task", "delete", "-f", id]);
    let _ = env.ctrd.ctr_in(NS, &["containers", "rm", id]);
}

fn kill9(pid: i32) {
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
}

/// Nothing of a refused container is left: no VM, no sandbox record, no
/// claim on the record of `target`.
fn nothing_changed(env: &Env, target: &str) {
    assert!(qemus_under(&env.runtime_root).is_empty(), "no VM left");
    let left: Vec<_> = std::fs::read_dir(&env.runtime_root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        left.is_empty() || left == ["other"],
        "sandbox records left: {left:?}"
    );
    let st = crust_handoff::Store::new(
        crust_handoff::Layout::Crust,
        env.crust_root.clone(),
        Default::default(),
    )
    .unwrap()
    .inspect(target);
    if let Ok(st) = st {
        assert!(
            st.claimant.is_none() || st.claimant.as_deref() == Some("other"),
            "{st:?}"
        );
    }
}

async fn stats_condition(
    csi: &crustctl::client::Csi,
    vol: &str,
    target: &str,
    staging: &str,
) -> (bool, String) {
    let s = csi
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: vol.into(),
            volume_path: target.into(),
            staging_target_path: staging.into(),
            defer_fs_ops: true,
        })
        .await
        .unwrap();
    let c = s.volume_condition.unwrap_or_default();
    (c.abnormal, c.message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_restart_faults_and_bad_input() {
    let t0 = Instant::now();
    let phase = |what: &str| eprintln!("[{:>6.1}s] {what}", t0.elapsed().as_secs_f64());
    let mut env = Env::start(NS);
    phase("containerd up");
    let _leftovers = common::Leftovers {
        pool: env.dir.path().join("pool"),
        cgroup_parent: None,
    };

    // --- the VM's memory follows the limit ------------------------------------
    let with_limit = mem_total(
        &env,
        "mem512",
        &["--memory-limit", &(512 * MIB).to_string()],
    );
    let default = mem_total(&env, "memdef", &[]);
    assert!(
        with_limit > 512 * MIB
            && with_limit <= (512 + u64::from(crust_shim::config::DEFAULT_OVERHEAD_MIB)) * MIB,
        "512 MiB limit -> MemTotal {} MiB",
        with_limit / MIB
    );
    assert!(
        default < 256 * MIB,
        "no limit -> the default 256 MiB guest ({} MiB)",
        default / MIB
    );

    phase("memory");
    // --- containerd restarted under a running container ---------------------
    env.ctrd.ctr_ok(
        NS,
        &run_args(&["-d"], "survivor", &["sh", "-c", "exec sleep 600"]),
    );
    let shim_before = env.ctrd.shim_pids();
    env.ctrd.restart();
    let ls = env.ctrd.ctr_ok(NS, &["task", "ls"]);
    assert!(
        ls.lines()
            .any(|l| l.starts_with("survivor") && l.contains("RUNNING")),
        "{ls}\n{}",
        env.logs()
    );
    assert_eq!(env.ctrd.shim_pids(), shim_before, "the same shim serves on");
    let o = env.ctrd.ctr_in(
        NS,
        &[
            "task",
            "exec",
            "--exec-id",
            "after",
            "survivor",
            "sh",
            "-c",
            "echo alive",
        ],
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "alive\n",
        "{}",
        env.logs()
    );
    env.ctrd
        .ctr_ok(NS, &["task", "kill", "-s", "SIGKILL", "survivor"]);
    wait_not_running(&env, "survivor");
    env.ctrd.ctr_ok(NS, &["task", "delete", "survivor"]);
    env.ctrd.ctr_ok(NS, &["containers", "rm", "survivor"]);
    assert!(qemus_under(&env.runtime_root).is_empty());

    phase("restart");
    // --- faults on a pod holding a deferred volume ------------------------------
    let plugin = start_plugin(&env).await;
    let csi = plugin.csi().await;
    let vol = csi
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-faults".into(),
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
        .join("kubelet/plugins/g1")
        .display()
        .to_string();
    std::fs::create_dir_all(&staging).unwrap();
    csi.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.clone(),
        volume_capability: Some(mount_cap(None)),
        volume_context: vol.volume_context.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let target = env
        .pods_dir
        .join("u1/volumes/kubernetes.io~csi/pvc-faults/mount");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let target = target.display().to_string();
    csi.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.clone(),
        target_path: target.clone(),
        volume_capability: Some(mount_cap(None)),
        volume_context: vol.volume_context.clone(),
        defer_fs_ops: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let mount = format!("type=bind,src={target},dst=/data,options=rbind:rw");
    let records = crust_handoff::Store::new(
        crust_handoff::Layout::Crust,
        env.crust_root.clone(),
        Default::default(),
    )
    .unwrap();

    for victim in ["qemu", "virtiofsd", "shim"] {
        let id = format!("f-{victim}");
        env.ctrd.ctr_ok(
            NS,
            &run_args(
                &["-d", "--mount", &mount],
                &id,
                &[
                    "sh",
                    "-c",
                    &format!("echo {victim} > /data/{id}; sync; exec sleep 600"),
                ],
            ),
        );
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let o = env.ctrd.ctr_in(
                NS,
                &[
                    "task",
                    "exec",
                    "--exec-id",
                    "chk",
                    &id,
                    "cat",
                    &format!("/data/{id}"),
                ],
            );
            if o.status.success() {
                break;
            }
            assert!(Instant::now() < until, "{id} never wrote: {}", env.logs());
            std::thread::sleep(Duration::from_millis(200));
        }
        assert_eq!(
            records.inspect(&target).unwrap().claimant.as_deref(),
            Some(id.as_str())
        );
        let (abnormal, msg) = stats_condition(&csi, &vol.volume_id, &target, &staging).await;
        assert!(!abnormal, "healthy before the fault: {msg}");
        let pid = match victim {
            "qemu" => qemus_under(&env.runtime_root)[0],
            "virtiofsd" => pid_of_child("virtiofsd", &env.runtime_root).expect("virtiofsd"),
            _ => env.ctrd.shim_pids()[0],
        };
        phase(&format!("{victim}: running"));
        kill9(pid);
        // containerd sees the task end.
        let line = wait_not_running(&env, &id);
        if victim != "shim" {
            assert!(line.contains("STOPPED"), "{line}");
            // The claim no longer holds: stats say abnormal.
            let (abnormal, msg) = stats_condition(&csi, &vol.volume_id, &target, &staging).await;
            assert!(
                abnormal && msg.contains("not running"),
                "{victim}: {abnormal} {msg}"
            );
        }
        assert!(
            qemus_under(&env.runtime_root).is_empty(),
            "{victim}: no QEMU left"
        );
        phase(&format!("{victim}: seen"));
        forget(&env, &id);
        phase(&format!("{victim}: deleted"));
        // containerd cleans up after a dead shim in the background (it runs
        // the shim binary's `delete`), so that release may follow `ctr`'s
        // answer by a moment; a live shim releases before Delete answers.
        if victim == "shim" {
            let until = Instant::now() + Duration::from_secs(15);
            while records.inspect(&target).unwrap().claimant.is_some() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        phase(&format!("{victim}: claim checked"));
        let st = records.inspect(&target).unwrap();
        assert_eq!(
            st.claimant,
            None,
            "{victim}: claim released after delete\n{}",
            env.logs()
        );
    }

    // The next container takes the volume; every earlier write is there.
    let o = env.ctrd.ctr_in(
        NS,
        &run_args(
            &["--rm", "--mount", &mount],
            "f-after",
            &[
                "sh",
                "-c",
                "cat /data/f-qemu /data/f-virtiofsd /data/f-shim",
            ],
        ),
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "qemu\nvirtiofsd\nshim\n",
        "{}",
        env.logs()
    );

    phase("data after faults");
    // --- bad input: a clear error, nothing changed -------------------------------
    // A malformed seccomp profile (an architecture OCI does not know).
    let profile = env.dir.path().join("bad-seccomp.json");
    std::fs::write(
        &profile,
        r#"{"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_Z80"]}"#,
    )
    .unwrap();
    let profile = profile.display().to_string();
    let o = env.ctrd.ctr_in(
        NS,
        &run_args(
            &["--rm", "--seccomp", "--seccomp-profile", &profile],
            "bad-seccomp",
            &["true"],
        ),
    );
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("linux.seccomp"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    forget(&env, "bad-seccomp");
    nothing_changed(&env, &target);
    // A missing bind source.
    let o = env.ctrd.ctr_in(
        NS,
        &run_args(
            &[
                "--rm",
                "--mount",
                "type=bind,src=/nonexistent/crust,dst=/x,options=rbind",
            ],
            "bad-src",
            &["true"],
        ),
    );
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("/nonexistent/crust"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    forget(&env, "bad-src");
    nothing_changed(&env, &target);
    // The volume claimed by another live pod.
    let other = env.runtime_root.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let me = crust_sandbox::sandbox::ProcRef::current();
    let st = serde_json::json!({
        "ociVersion": "1.0.2", "id": "other", "status": "running", "bundle": "/",
        "shim": me, "qemu": me, "created": 0
    });
    std::fs::write(other.join("state.json"), st.to_string()).unwrap();
    records.claim(&target, "other", |_| true).unwrap();
    let o = env.ctrd.ctr_in(
        NS,
        &run_args(&["--rm", "--mount", &mount], "bad-claim", &["true"]),
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(err.contains("other"), "names the holder: {err}");
    forget(&env, "bad-claim");
    nothing_changed(&env, &target);
    records.release(&target, "other").unwrap();
    std::fs::remove_dir_all(&other).unwrap();
    // A forged record: its device is not a block device.
    let forged_target = env
        .pods_dir
        .join("u1/volumes/kubernetes.io~csi/forged/mount");
    std::fs::create_dir_all(&forged_target).unwrap();
    let forged_target = forged_target.display().to_string();
    let dir = env
        .crust_root
        .join(crust_handoff::crust_key(&forged_target));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("mountInfo.json"),
        r#"{"volume-type":"block","device":"/etc/passwd","fstype":"ext4"}"#,
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::set_permissions(
        dir.join("mountInfo.json"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let o = env.ctrd.ctr_in(
        NS,
        &run_args(
            &[
                "--rm",
                "--mount",
                &format!("type=bind,src={forged_target},dst=/data,options=rbind"),
            ],
            "bad-record",
            &["true"],
        ),
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        err.contains("/etc/passwd") || err.contains("block device"),
        "{err}"
    );
    forget(&env, "bad-record");
    nothing_changed(&env, &target);
    assert!(
        !dir.join("bad-record").exists(),
        "no claim on the forged record"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    phase("bad input");
    // No shim socket left, not even the killed shim's. containerd removes
    // a dead shim's socket in its background cleanup (`shim delete`), which
    // may trail `ctr`'s answer on a loaded machine: give it 15 s.
    for id in ["f-qemu", "f-virtiofsd", "f-shim", "survivor"] {
        let addr =
            containerd_shim::socket_address(&env.ctrd.address().display().to_string(), NS, id);
        let sock = Path::new(addr.trim_start_matches("unix://"));
        let until = Instant::now() + Duration::from_secs(15);
        while sock.exists() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(!sock.exists(), "{id}: {addr} left\n{}", env.logs());
    }
    // --- cleanup of the volume ---------------------------------------------------
    csi.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: target.clone(),
        defer_fs_ops: true,
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
        ..Default::default()
    })
    .await
    .unwrap();
    let _ = plugin;
}
