//! Issue 43, must-show 6: a pod asking for the host's IPC or PID namespace
//! (`hostIPC`, `hostPID`: CRI's NamespaceMode NODE) is refused through CRI
//! with an error naming the setting, before any VM starts: a VM cannot
//! share them, and running it silently in the guest's namespaces would
//! differ from what the pod was promised. hostNetwork likewise, unless
//! the node opts into QEMU's user-mode network: then the guest reaches
//! the host (a server on the host's loopback, through the gateway) with
//! a NIC of its own. Budget: one guest boots, ~15 s.

mod common;

use std::io::Write;

use common::{Env, exec, qemus_under};
use crust_cri::Cri;
use crust_cri::v1 as cri;

async fn refused(
    env: &Env,
    cri: &mut Cri,
    (name, uid): (&str, &str),
    options: cri::NamespaceOption,
) -> String {
    let mut sandbox = common::host_network_sandbox(name, uid, 0);
    sandbox
        .linux
        .as_mut()
        .unwrap()
        .security_context
        .as_mut()
        .unwrap()
        .namespace_options = Some(options);
    let e = cri
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(sandbox),
            runtime_handler: crust_testkit::CRUST_HANDLER.into(),
        })
        .await
        .map(|r| r.into_inner().pod_sandbox_id)
        .expect_err("a host namespace must be refused");
    assert!(
        qemus_under(&env.runtime_root).is_empty(),
        "no VM for {name}"
    );
    e.message().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_ipc_and_host_pid_pods_are_refused_naming_the_setting() {
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let node = cri::NamespaceMode::Node as i32;
    let host_ipc = cri::NamespaceOption {
        network: node,
        ipc: node,
        ..Default::default()
    };
    let host_pid = cri::NamespaceOption {
        network: node,
        pid: node,
        ..Default::default()
    };
    for (pod, options, setting, opt_in) in [
        (
            ("host-ipc", "43c00000-0000-4000-8000-000000000001"),
            host_ipc,
            "ipc=NODE",
            "=ipc",
        ),
        (
            ("host-pid", "43c00000-0000-4000-8000-000000000002"),
            host_pid,
            "pid=NODE",
            "=pid",
        ),
    ] {
        let e = refused(&env, &mut cri, pod, options).await;
        assert!(
            e.contains(setting) && e.contains(&format!("CRUST_SHIM_HOST_NAMESPACES{opt_in}")),
            "{e}\n{}",
            env.logs()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_network_is_refused_unless_the_node_gives_user_mode_networking() {
    let env = Env::start_with(
        crust_testkit::CRI_NAMESPACE,
        vec![("CRUST_SHIM_HOST_NETWORK".into(), "refuse".into())],
    );
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let node = cri::NamespaceMode::Node as i32;
    let e = refused(
        &env,
        &mut cri,
        ("host-net", "43c00000-0000-4000-8000-000000000003"),
        cri::NamespaceOption {
            network: node,
            ..Default::default()
        },
    )
    .await;
    assert!(
        e.contains("hostNetwork") && e.contains("CRUST_SHIM_HOST_NETWORK=user"),
        "{e}\n{}",
        env.logs()
    );
    drop(env);

    // Opted in (the tests' default): a server on the host's loopback is
    // reached through the user-mode gateway.
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in server.incoming().flatten().take(1) {
            let _ = (&c).write_all(b"from the host\n");
        }
    });
    let sandbox =
        common::host_network_sandbox("host-net-user", "43c00000-0000-4000-8000-000000000004", 0);
    let (sb, app) = env
        .start_busybox_pod(&mut cri, &sandbox, &["sleep", "600"], vec![])
        .await;
    let gateway = crust_vmm::USER_NET_GATEWAY;
    let (rc, out) = exec(
        &mut cri,
        &app,
        &format!("ip -o -4 addr show eth0 && nc {gateway} {port} </dev/null"),
    )
    .await;
    assert_eq!(rc, 0, "{out}\n{}", env.logs());
    assert!(
        out.contains(&format!("inet {}/", crust_vmm::USER_NET_GUEST))
            && out.ends_with("from the host\n"),
        "{out}"
    );
    common::stop_and_remove_sandbox(&mut cri, &sb).await;
}
