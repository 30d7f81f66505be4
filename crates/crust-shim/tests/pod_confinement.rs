//! Issue 27 through containerd's CRI, as kubelet asks: a pod's
//! containers are confined inside the guest by what their spec says.
//! One pod (one TCG guest) with pod sysctls, and in it:
//! - `rd`: containerd's RuntimeDefault seccomp profile, `drop: [ALL]` +
//!   `add: [NET_BIND_SERVICE]`, noNewPrivileges, a read-only rootfs,
//!   kubelet's masked paths, an OOM score: `unshare -U` (CLONE_NEWUSER)
//!   fails with EPERM while allowed calls work, the Cap* lines, NoNewPrivs
//!   and Seccomp of PID 1 and of an exec'd process, `chown` and a rootfs
//!   write refused, `/proc/kcore` empty; its own PID namespace (PID 1 is
//!   its command, no agent, nothing of the other container);
//! - `lh`: a Localhost profile that denies mkdir: `mkdir` fails in an
//!   exec'd process.
//!
//! Bad input fails StartContainer naming the field, the pod unharmed: a
//! profile with an unknown architecture (malformed for the OCI schema) or
//! an unknown syscall, a sysctl that is not namespaced. Budget: one TCG
//! guest, ~40 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

mod common;

use common::{Env, exec};
use crust_cri::Cri;
use crust_cri::v1 as cri;

fn profile(kind: cri::security_profile::ProfileType, file: &str) -> Option<cri::SecurityProfile> {
    Some(cri::SecurityProfile {
        profile_type: kind as i32,
        localhost_ref: file.into(),
    })
}

/// kubelet's namespace options for a hostNetwork pod's container; `pid`
/// POD when the pod shares its process namespace.
fn namespaces(pid: cri::NamespaceMode) -> Option<cri::NamespaceOption> {
    Some(cri::NamespaceOption {
        network: cri::NamespaceMode::Node as i32,
        pid: pid as i32,
        ..Default::default()
    })
}

fn config(name: &str, security: cri::LinuxContainerSecurityContext) -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: crust_testkit::BUSYBOX_IMAGE.into(),
            ..Default::default()
        }),
        command: vec!["sleep".into(), "100000".into()],
        linux: Some(cri::LinuxContainerConfig {
            resources: Some(cri::LinuxContainerResources {
                oom_score_adj: 500,
                ..Default::default()
            }),
            security_context: Some(cri::LinuxContainerSecurityContext {
                namespace_options: security
                    .namespace_options
                    .or(namespaces(cri::NamespaceMode::Container)),
                masked_paths: common::strings(common::KUBELET_MASKED_PATHS),
                readonly_paths: common::strings(common::KUBELET_READONLY_PATHS),
                ..security
            }),
        }),
        log_path: format!("{name}.log"),
        ..Default::default()
    }
}

async fn create(
    cri: &mut Cri,
    sb: &str,
    sandbox: &cri::PodSandboxConfig,
    c: cri::ContainerConfig,
) -> Result<String, tonic::Status> {
    cri.runtime
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: sb.into(),
            config: Some(c),
            sandbox_config: Some(sandbox.clone()),
        })
        .await
        .map(|r| r.into_inner().container_id)
}

async fn create_and_start(
    env: &Env,
    cri: &mut Cri,
    sb: &str,
    sandbox: &cri::PodSandboxConfig,
    c: cri::ContainerConfig,
) -> String {
    let id = create(cri, sb, sandbox, c)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", env.logs()));
    cri.runtime
        .start_container(cri::StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", env.logs()));
    id
}

/// The processes a container sees in its /proc: (PID 1's command line,
/// the `pid command line` lines).
async fn processes(cri: &mut Cri, cid: &str) -> (String, String) {
    let (code, out) = exec(
        cri,
        cid,
        "for p in /proc/[0-9]*; do echo \"${p#/proc/} $(tr '\\0' ' ' < $p/cmdline)\"; done",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let first = out
        .lines()
        .find_map(|l| l.strip_prefix("1 "))
        .unwrap_or_default()
        .to_string();
    (first, out)
}

/// The container's exit code once CRI reports it exited (30 s at most).
async fn exited(cri: &mut Cri, cid: &str) -> i32 {
    for _ in 0..150 {
        let st = cri
            .runtime
            .container_status(cri::ContainerStatusRequest {
                container_id: cid.into(),
                verbose: false,
            })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap();
        if st.state == cri::ContainerState::ContainerExited as i32 {
            return st.exit_code;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    panic!("{cid} did not exit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_containers_are_confined_in_the_guest() {
    use cri::security_profile::ProfileType;
    let env = Env::start(crust_testkit::CRI_NAMESPACE);
    let log_dir = env.dir.path().join("pod-logs");
    std::fs::create_dir_all(&log_dir).unwrap();
    let deny_mkdir = env.dir.path().join("deny-mkdir.json");
    std::fs::write(
        &deny_mkdir,
        r#"{"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"],
            "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO"}]}"#,
    )
    .unwrap();
    let bad_arch = env.dir.path().join("bad-arch.json");
    std::fs::write(
        &bad_arch,
        r#"{"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_Z80"]}"#,
    )
    .unwrap();
    let bad_call = env.dir.path().join("bad-call.json");
    std::fs::write(
        &bad_call,
        r#"{"defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": ["mkdir", "no_such_call"], "action": "SCMP_ACT_ERRNO"}]}"#,
    )
    .unwrap();

    let mut cri = Cri::connect(&env.ctrd.endpoint()).await.unwrap();
    let sandbox = cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: "confined".into(),
            uid: "9f8a1c2e-0000-4000-8000-0000000c0f1d".into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        log_directory: log_dir.display().to_string(),
        linux: Some(cri::LinuxPodSandboxConfig {
            sysctls: [
                ("kernel.shm_rmid_forced", "1"),
                ("net.ipv4.ip_unprivileged_port_start", "80"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: namespaces(cri::NamespaceMode::Container),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let sb = cri
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(sandbox.clone()),
            runtime_handler: crust_testkit::CRUST_HANDLER.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", env.logs()))
        .into_inner()
        .pod_sandbox_id;

    let rd = create_and_start(
        &env,
        &mut cri,
        &sb,
        &sandbox,
        config(
            "rd",
            cri::LinuxContainerSecurityContext {
                seccomp: profile(ProfileType::RuntimeDefault, ""),
                capabilities: Some(cri::Capability {
                    drop_capabilities: vec!["ALL".into()],
                    add_capabilities: vec!["NET_BIND_SERVICE".into()],
                    ..Default::default()
                }),
                no_new_privs: true,
                readonly_rootfs: true,
                ..Default::default()
            },
        ),
    )
    .await;
    let lh = create_and_start(
        &env,
        &mut cri,
        &sb,
        &sandbox,
        config(
            "lh",
            cri::LinuxContainerSecurityContext {
                seccomp: profile(ProfileType::Localhost, &deny_mkdir.display().to_string()),
                ..Default::default()
            },
        ),
    )
    .await;

    // shareProcessNamespace: the pod's (the pause container's) PID namespace.
    let shared = create_and_start(
        &env,
        &mut cri,
        &sb,
        &sandbox,
        config(
            "shared",
            cri::LinuxContainerSecurityContext {
                namespace_options: namespaces(cri::NamespaceMode::Pod),
                ..Default::default()
            },
        ),
    )
    .await;

    // RuntimeDefault: CLONE_NEWUSER is EPERM; what the profile allows works.
    let (code, out) = exec(&mut cri, &rd, "unshare -U true").await;
    assert!(
        code != 0 && out.contains("Operation not permitted"),
        "{code} {out}"
    );
    let (code, out) = exec(&mut cri, &rd, "echo allowed; uname -s").await;
    assert_eq!((code, out.as_str()), (0, "allowed\nLinux\n"));
    // The container's PID 1 and this exec'd shell: filtered (mode 2),
    // NoNewPrivs, exactly NET_BIND_SERVICE.
    let status = "grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp):'";
    for who in ["1", "self"] {
        let (code, out) = exec(&mut cri, &rd, &format!("{status} /proc/{who}/status")).await;
        assert_eq!(
            (code, out.as_str()),
            (
                0,
                "CapInh:\t0000000000000000\nCapPrm:\t0000000000000400\nCapEff:\t0000000000000400\n\
                 CapBnd:\t0000000000000400\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n"
            ),
            "/proc/{who}/status"
        );
    }
    let (code, out) = exec(&mut cri, &rd, "chown 1 /dev/shm").await;
    assert!(
        code != 0 && out.contains("Operation not permitted"),
        "{out}"
    );
    let (code, out) = exec(&mut cri, &rd, "touch /written").await;
    assert!(code != 0 && out.contains("Read-only file system"), "{out}");
    assert_eq!(
        exec(&mut cri, &rd, "wc -c < /proc/kcore").await,
        (0, "0\n".into())
    );
    // Its own PID namespace: PID 1 is its sleep, the agent is not there,
    // nor `lh`'s sleep; only this exec's processes besides.
    let (first, out) = processes(&mut cri, &rd).await;
    assert_eq!(first, "sleep 100000 ", "{out}");
    assert_eq!(out.matches("sleep").count(), 1, "{out}");
    assert!(!out.contains("crust-agent"), "{out}");
    // The shared one: the pause container (the test image's is `sleep
    // infinity`) is PID 1, its own sleep beside it, no agent and nothing
    // of the containers with namespaces of their own.
    let (first, out) = processes(&mut cri, &shared).await;
    assert_eq!(first, "/bin/sleep infinity ", "{out}");
    assert_eq!(out.matches("sleep 100000").count(), 1, "{out}");
    assert!(!out.contains("crust-agent"), "{out}");
    // The pod's sysctls, in its namespaces; the OCI OOM score.
    assert_eq!(
        exec(
            &mut cri,
            &rd,
            "cat /proc/sys/kernel/shm_rmid_forced /proc/sys/net/ipv4/ip_unprivileged_port_start /proc/1/oom_score_adj"
        )
        .await,
        (0, "1\n80\n500\n".into())
    );

    // Localhost: mkdir denied in an exec'd process, the rest allowed.
    let (code, out) = exec(&mut cri, &lh, "mkdir /tmp/d").await;
    assert!(
        code != 0 && out.contains("Operation not permitted"),
        "{out}"
    );
    assert_eq!(
        exec(
            &mut cri,
            &lh,
            "touch /tmp/f && ls /tmp && grep Seccomp: /proc/1/status"
        )
        .await,
        (0, "f\nSeccomp:\t2\n".into())
    );

    // --- bad input: the container fails naming the field -------------------------
    // (containerd's CRI creates the task, so the shim sees the spec, at
    // StartContainer.)
    let bad = |name: &str, sc: cri::LinuxContainerSecurityContext| config(name, sc);
    for (c, needle) in [
        (
            bad(
                "bad-arch",
                cri::LinuxContainerSecurityContext {
                    seccomp: profile(ProfileType::Localhost, &bad_arch.display().to_string()),
                    ..Default::default()
                },
            ),
            "linux.seccomp: unknown variant `SCMP_ARCH_Z80`",
        ),
        (
            bad(
                "bad-call",
                cri::LinuxContainerSecurityContext {
                    seccomp: profile(ProfileType::Localhost, &bad_call.display().to_string()),
                    ..Default::default()
                },
            ),
            "linux.seccomp.syscalls[0].names[1]: unknown syscall",
        ),
    ] {
        let id = create(&mut cri, &sb, &sandbox, c).await.unwrap();
        let e = cri
            .runtime
            .start_container(cri::StartContainerRequest { container_id: id })
            .await
            .expect_err(needle);
        let msg = e.message().to_string();
        assert!(msg.contains(needle), "{needle}: {e}\n{}", env.logs());
    }
    // containerd gives pod sysctls to the sandbox: refused before a VM boots.
    let mut bad_pod = sandbox.clone();
    bad_pod.metadata.as_mut().unwrap().name = "bad-sysctl".into();
    bad_pod.metadata.as_mut().unwrap().uid = "9f8a1c2e-0000-4000-8000-0000000bad51".into();
    let l = bad_pod.linux.as_mut().unwrap();
    l.sysctls.insert("kernel.panic".into(), "1".into());
    let e = cri
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(bad_pod),
            runtime_handler: crust_testkit::CRUST_HANDLER.into(),
        })
        .await
        .unwrap_err();
    assert!(
        e.message().contains("kernel.panic") && e.message().contains("is not namespaced"),
        "{e}"
    );
    assert_eq!(
        common::qemus_under(&env.runtime_root).len(),
        1,
        "no second VM"
    );
    // The pod runs on.
    assert_eq!(
        exec(&mut cri, &rd, "echo alive").await,
        (0, "alive\n".into())
    );

    // Exit codes and kills still reach CRI from a PID 1 of its own.
    let mut exits = config("exits", Default::default());
    exits.command = vec!["sh".into(), "-c".into(), "exit 3".into()];
    let exits = create_and_start(&env, &mut cri, &sb, &sandbox, exits).await;
    assert_eq!(exited(&mut cri, &exits).await, 3);
    cri.runtime
        .stop_container(cri::StopContainerRequest {
            container_id: rd.clone(),
            timeout: 0,
        })
        .await
        .unwrap();
    assert_eq!(exited(&mut cri, &rd).await, 137, "SIGKILL");

    cri.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: sb.clone(),
        })
        .await
        .unwrap();
    cri.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: sb })
        .await
        .unwrap();
}
