//! Issue 43, must-show 4: a container that fills its memory limit in the
//! guest is killed by the guest's OOM killer, and kubelet can tell: CRI's
//! ContainerStatus says reason "OOMKilled" with exit code 137, and
//! containerd's event stream carries TaskOOM for it (runc's shim sends
//! the same). A second container of the pod that dies of SIGKILL without
//! running out of memory says "Error": 137 alone is not read as an OOM
//! kill. Budget: one TCG guest, ~15 s.

mod common;

use std::time::{Duration, Instant};

use common::Env;
use crust_cri::Cri;
use crust_cri::v1 as cri;

const LIMIT: i64 = 32 << 20;

fn limited(limit: i64) -> cri::LinuxContainerConfig {
    cri::LinuxContainerConfig {
        resources: Some(cri::LinuxContainerResources {
            memory_limit_in_bytes: limit,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Waits for the container to exit: (exit code, reason).
async fn exited(cri: &mut Cri, env: &Env, cid: &str) -> (i32, String) {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let s = common::container_status(cri, cid).await;
        if s.state == cri::ContainerState::ContainerExited as i32 {
            return (s.exit_code, s.reason);
        }
        assert!(
            Instant::now() < until,
            "{cid} still running: {s:?}\n{}",
            env.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_over_its_memory_limit_is_reported_oomkilled() {
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let events = env.ctrd.events(crust_testkit::CRI_NAMESPACE);
    let sandbox = common::host_network_sandbox("oom", "43b00000-0000-4000-8000-000000000001", 0);
    // dd's one 64 MiB buffer, filled by the read, is twice the limit.
    let (sb, hog) = env
        .start_busybox_pod_with(
            &mut cri,
            &sandbox,
            &["dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=4"],
            vec![],
            Some(limited(LIMIT)),
        )
        .await;
    let (code, reason) = exited(&mut cri, &env, &hog).await;
    assert_eq!(
        (code, reason.as_str()),
        (137, "OOMKilled"),
        "{}",
        env.logs()
    );

    // The control: the same exit code without an OOM kill.
    let crash = common::busybox_container(
        "crash",
        &["sh", "-c", "kill -9 $$"],
        vec![],
        Some(limited(LIMIT)),
    );
    let crash = common::create_container(&mut cri, &sb, &sandbox, crash)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", env.logs()));
    cri.runtime
        .start_container(cri::StartContainerRequest {
            container_id: crash.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", env.logs()));
    let (code, reason) = exited(&mut cri, &env, &crash).await;
    assert_eq!((code, reason.as_str()), (137, "Error"), "{}", env.logs());

    common::stop_and_remove_sandbox(&mut cri, &sb).await;
    let lines = events.lines();
    let ooms: Vec<&String> = lines.iter().filter(|l| l.contains("/tasks/oom")).collect();
    assert_eq!(ooms.len(), 1, "one TaskOOM event: {lines:#?}");
    assert!(ooms[0].contains(&hog), "TaskOOM names {hog}: {}", ooms[0]);
}
