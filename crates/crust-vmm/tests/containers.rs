//! Containers in a real guest, driven through the agent protocol: rootfs
//! shared over virtio-fs, OCI mounts (proc, /dev tmpfs with devices,
//! devpts, a read-only file bind from the share), uid/gid/groups, stdio
//! over the stdio port with exact exit codes, stdin, exec into a running
//! container, signals, a terminal with a window size, the five capability
//! sets in a container and an exec, IPC/UTS namespaces of a container's
//! own or another's, and bad input (a user namespace's mappings too).
//! Budget: one TCG guest, ~30 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

use std::time::Duration;

use crust_agent_proto::stdio::{Output, StdioMux};
use crust_agent_proto::{
    AgentClient, Capabilities, ClientError, ContainerMount, CreateContainer, ErrorCode,
    ExecProcess, MountSource, NamespaceSource, ProcessRef, ProcessSpec, RemoveContainer, ResizePty,
    Rlimit, Rootfs, ShareRef, SignalProcess, StartContainer, StdioSpec, WaitProcess, WorkloadUser,
};
use crust_vmm::{Accel, ShareSpec, Vm, VmConfig};
use rustix::mount::{MountPropagationFlags, UnmountFlags};
use tokio::sync::mpsc::UnboundedReceiver;

struct Mounts(std::path::PathBuf);

impl Drop for Mounts {
    fn drop(&mut self) {
        crust_testkit::unmount_below(&self.0);
        let _ = rustix::mount::unmount(&self.0, UnmountFlags::DETACH);
    }
}

/// A busybox rootfs in `dir`.
fn busybox_rootfs(dir: &std::path::Path) {
    for d in ["bin", "etc", "tmp", "proc", "dev", "sys"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", dir.join("bin/busybox")).unwrap();
    for a in [
        "sh", "echo", "cat", "id", "sleep", "stty", "ls", "read", "test", "[", "grep", "chown",
        "readlink", "hostname",
    ] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(a)).unwrap();
    }
    std::fs::write(dir.join("etc/hosts"), "image hosts\n").unwrap();
}

fn proc(args: &[&str], stream: u32) -> ProcessSpec {
    ProcessSpec {
        args: args.iter().map(|s| s.to_string()).collect(),
        env: vec!["PATH=/bin".into()],
        stdio: StdioSpec {
            stream,
            stdin: false,
            stdout: stream != 0,
            stderr: stream != 0,
        },
        ..Default::default()
    }
}

fn mount(dest: &str, source: MountSource, readonly: bool, options: &[&str]) -> ContainerMount {
    ContainerMount {
        destination: dest.into(),
        source,
        readonly,
        options: options.iter().map(|s| s.to_string()).collect(),
        submounts: Vec::new(),
    }
}

fn std_mounts() -> Vec<ContainerMount> {
    vec![
        mount(
            "/proc",
            MountSource::Proc,
            false,
            &["nosuid", "noexec", "nodev"],
        ),
        mount(
            "/dev",
            MountSource::Tmpfs,
            false,
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        ),
        mount(
            "/dev/pts",
            MountSource::Devpts,
            false,
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
            ],
        ),
    ]
}

/// Collects a stream's output until both EOF marks (or the terminal's one).
async fn collect(rx: &mut UnboundedReceiver<Output>, eofs: usize) -> (String, String) {
    let (mut out, mut err, mut seen) = (Vec::new(), Vec::new(), 0);
    while seen < eofs {
        match tokio::time::timeout(Duration::from_secs(60), rx.recv()).await {
            Ok(Some(Output::Stdout(d))) => out.extend(d),
            Ok(Some(Output::Stderr(d))) => err.extend(d),
            Ok(Some(_)) => seen += 1,
            Ok(None) | Err(_) => panic!(
                "stdio stream ended early: {:?}",
                String::from_utf8_lossy(&out)
            ),
        }
    }
    (
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

async fn wait(agent: &AgentClient, container: &str, exec: Option<&str>) -> i32 {
    let r = agent
        .call_with_timeout(
            WaitProcess {
                process: ProcessRef {
                    container: container.into(),
                    exec_id: exec.map(Into::into),
                },
                timeout_ms: 30_000,
            },
            Duration::from_secs(40),
        )
        .await
        .unwrap();
    r.exited.expect("exited").exit_code
}

fn code<T: std::fmt::Debug>(r: Result<T, ClientError>) -> (ErrorCode, String) {
    match r {
        Err(ClientError::Agent(e)) => (e.code, e.message),
        other => panic!("expected an agent error, got {other:?}"),
    }
}

#[tokio::test]
async fn containers_in_a_guest() {
    crust_testkit::require_root();
    crust_testkit::ensure_guest_image();
    let _slot = crust_testkit::VmSlot::acquire();
    let (kernel, initrd) = crust_testkit::guest_image();
    let dir = tempfile::Builder::new()
        .prefix("crust-ctr-")
        .tempdir()
        .unwrap();
    let share = dir.path().join("share");
    std::fs::create_dir(&share).unwrap();
    rustix::mount::mount_bind(&share, &share).unwrap();
    let _mounts = Mounts(share.clone());
    rustix::mount::mount_change(&share, MountPropagationFlags::SHARED).unwrap();
    busybox_rootfs(&share.join("c/rootfs"));
    std::fs::write(share.join("c/hosts"), "10.0.0.1 from-the-pod\n").unwrap();

    let mut cfg = VmConfig::new("ctr", kernel, initrd, dir.path().join("run"));
    cfg.accel = Accel::Tcg;
    cfg.die_with_parent = true;
    cfg.hotplug_ports = 0;
    cfg.shares = vec![ShareSpec {
        tag: "pod".into(),
        dir: share.clone(),
    }];
    let vm = Vm::launch(cfg).await.expect("launch");
    let agent = AgentClient::new(vm.agent_socket());
    if let Err(e) = agent.wait_ready(Duration::from_secs(120)).await {
        panic!("agent not ready: {e}\n{}", vm.failure_context());
    }
    let mux = StdioMux::new(vm.stdio_socket());
    let rootfs = Rootfs::Share(ShareRef {
        tag: "pod".into(),
        path: "c/rootfs".into(),
    });

    // 1. Output, exit code, user and groups, a read-only bind from the share.
    let mut rx = mux.register(1);
    let mut p = proc(
        &[
            "sh",
            "-c",
            "echo out; echo err >&2; cat /etc/hosts; id -u; id -G; ls /dev/null; echo x > /etc/hosts || echo ro; exit 3",
        ],
        1,
    );
    p.user = Some(WorkloadUser {
        uid: 1000,
        gid: 1000,
        supplemental_gids: vec![2000],
    });
    p.rlimits = vec![Rlimit {
        kind: "RLIMIT_NOFILE".into(),
        soft: 512,
        hard: 1024,
    }];
    let mut mounts = std_mounts();
    mounts.push(mount(
        "/etc/hosts",
        MountSource::Share(ShareRef {
            tag: "pod".into(),
            path: "c/hosts".into(),
        }),
        true,
        &[],
    ));
    let created = agent
        .call(CreateContainer {
            id: "one".into(),
            rootfs: rootfs.clone(),
            rootfs_readonly: false,
            process: p,
            mounts,
            masked_paths: vec![],
            readonly_paths: vec![],
            memory_limit_bytes: Some(64 << 20),
            devices: vec![],
            ipc: Default::default(),
            uts: Default::default(),
            hostname: String::new(),
            pid: Default::default(),
            sysctl: Default::default(),
            seccomp: None,
            user: Default::default(),
        })
        .await
        .unwrap();
    assert!(created.pid > 1);
    agent
        .call(StartContainer { id: "one".into() })
        .await
        .unwrap();
    let (out, err) = collect(&mut rx, 2).await;
    assert_eq!(wait(&agent, "one", None).await, 3);
    assert_eq!(
        out,
        "out\n10.0.0.1 from-the-pod\n1000\n1000 2000\n/dev/null\nro\n"
    );
    assert!(err.starts_with("err\n"), "{err}");
    agent
        .call(RemoveContainer { id: "one".into() })
        .await
        .unwrap();

    // 2. A long-running container: stdin, exec, signals.
    let mut rx = mux.register(2);
    let mut p = proc(&["sh", "-c", "read x; echo got $x; exec sleep 600"], 2);
    p.stdio.stdin = true;
    agent
        .call(CreateContainer {
            id: "two".into(),
            rootfs: rootfs.clone(),
            rootfs_readonly: true,
            process: p,
            mounts: std_mounts(),
            masked_paths: vec![],
            readonly_paths: vec![],
            memory_limit_bytes: None,
            devices: vec![],
            ipc: Default::default(),
            uts: Default::default(),
            hostname: String::new(),
            pid: Default::default(),
            sysctl: Default::default(),
            seccomp: None,
            user: Default::default(),
        })
        .await
        .unwrap();
    agent
        .call(StartContainer { id: "two".into() })
        .await
        .unwrap();
    mux.stdin(2, b"hello\n");
    let first = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .unwrap();
    assert_eq!(first, Some(Output::Stdout(b"got hello\n".to_vec())));

    let mut xrx = mux.register(3);
    agent
        .call(ExecProcess {
            container: "two".into(),
            exec_id: "x1".into(),
            process: proc(
                &[
                    "sh",
                    "-c",
                    "cat /etc/hosts; touch /ro-test 2>/dev/null || echo rootfs-ro; exit 5",
                ],
                3,
            ),
        })
        .await
        .unwrap();
    let (out, _) = collect(&mut xrx, 2).await;
    assert_eq!(wait(&agent, "two", Some("x1")).await, 5);
    assert_eq!(out, "image hosts\nrootfs-ro\n");

    agent
        .call(SignalProcess {
            process: ProcessRef {
                container: "two".into(),
                exec_id: None,
            },
            signal: 9,
            all: true,
        })
        .await
        .unwrap();
    assert_eq!(wait(&agent, "two", None).await, 137);
    agent
        .call(RemoveContainer { id: "two".into() })
        .await
        .unwrap();

    // 3. A terminal with a window size.
    let mut rx = mux.register(4);
    let mut p = proc(&["sh", "-c", "[ -t 0 ] && echo isatty; stty size"], 4);
    p.terminal = true;
    p.stdio.stderr = false;
    agent
        .call(CreateContainer {
            id: "tty".into(),
            rootfs: rootfs.clone(),
            rootfs_readonly: false,
            process: p,
            mounts: std_mounts(),
            masked_paths: vec![],
            readonly_paths: vec![],
            memory_limit_bytes: None,
            devices: vec![],
            ipc: Default::default(),
            uts: Default::default(),
            hostname: String::new(),
            pid: Default::default(),
            sysctl: Default::default(),
            seccomp: None,
            user: Default::default(),
        })
        .await
        .unwrap();
    agent
        .call(ResizePty {
            process: ProcessRef {
                container: "tty".into(),
                exec_id: None,
            },
            width: 100,
            height: 40,
        })
        .await
        .unwrap();
    agent
        .call(StartContainer { id: "tty".into() })
        .await
        .unwrap();
    let (out, _) = collect(&mut rx, 1).await;
    assert_eq!(wait(&agent, "tty", None).await, 0);
    assert_eq!(out, "isatty\r\n40 100\r\n");
    agent
        .call(RemoveContainer { id: "tty".into() })
        .await
        .unwrap();

    // 4. Capabilities (`drop: [ALL]`, `add: [NET_BIND_SERVICE]` as
    // containerd writes it): the container, root, holds exactly that one;
    // chown fails. An exec as uid 1000 gets it through the ambient set.
    const NBS: &str = "0000000000000400";
    let one = || vec!["CAP_NET_BIND_SERVICE".to_string()];
    let mut rx = mux.register(5);
    let mut p = proc(
        &[
            "sh",
            "-c",
            "grep ^Cap /proc/self/status; echo x > /tmp/f; chown 1 /tmp/f || echo chown-denied; echo started; exec sleep 600",
        ],
        5,
    );
    p.capabilities = Some(Capabilities {
        bounding: one(),
        effective: one(),
        permitted: one(),
        inheritable: vec![],
        ambient: vec![],
    });
    let mut mounts = std_mounts();
    mounts.push(mount("/tmp", MountSource::Tmpfs, false, &[]));
    agent
        .call(CreateContainer {
            id: "caps".into(),
            rootfs: rootfs.clone(),
            rootfs_readonly: false,
            process: p,
            mounts,
            masked_paths: vec![],
            readonly_paths: vec![],
            memory_limit_bytes: None,
            devices: vec![],
            ipc: Default::default(),
            uts: Default::default(),
            hostname: String::new(),
            pid: Default::default(),
            sysctl: Default::default(),
            seccomp: None,
            user: Default::default(),
        })
        .await
        .unwrap();
    agent
        .call(StartContainer { id: "caps".into() })
        .await
        .unwrap();
    let mut out = String::new();
    while !out.contains("started\n") {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some(Output::Stdout(d) | Output::Stderr(d))) => {
                out.push_str(&String::from_utf8_lossy(&d));
            }
            other => panic!("{other:?} after {out:?}"),
        }
    }
    let want = |inh: &str, amb: &str| {
        format!("CapInh:\t{inh}\nCapPrm:\t{NBS}\nCapEff:\t{NBS}\nCapBnd:\t{NBS}\nCapAmb:\t{amb}\n")
    };
    let zero = "0000000000000000";
    assert!(out.starts_with(&want(zero, zero)), "{out}");
    assert!(out.contains("chown-denied\n"), "{out}");
    let mut xrx = mux.register(6);
    let mut x = proc(&["sh", "-c", "grep ^Cap /proc/self/status; id -u"], 6);
    x.user = Some(WorkloadUser {
        uid: 1000,
        gid: 1000,
        supplemental_gids: vec![],
    });
    x.capabilities = Some(Capabilities {
        bounding: one(),
        effective: one(),
        permitted: one(),
        inheritable: one(),
        ambient: one(),
    });
    agent
        .call(ExecProcess {
            container: "caps".into(),
            exec_id: "x".into(),
            process: x,
        })
        .await
        .unwrap();
    let (out, err) = collect(&mut xrx, 2).await;
    assert_eq!(wait(&agent, "caps", Some("x")).await, 0, "{err}");
    assert_eq!(out, format!("{}1000\n", want(NBS, NBS)), "{err}");
    // An exec without the section keeps every capability (runc's way).
    let mut xrx = mux.register(7);
    agent
        .call(ExecProcess {
            container: "caps".into(),
            exec_id: "full".into(),
            process: proc(&["grep", "^CapEff", "/proc/self/status"], 7),
        })
        .await
        .unwrap();
    let (out, _) = collect(&mut xrx, 2).await;
    assert_ne!(out, format!("CapEff:\t{NBS}\n"));
    assert!(out.starts_with("CapEff:\t000001ff"), "{out}");
    // An unknown name fails the exec, naming it; the container runs on.
    let mut x = proc(&["true"], 0);
    x.capabilities = Some(Capabilities {
        effective: vec!["CAP_BOGUS".into()],
        ..Default::default()
    });
    let (c, m) = code(
        agent
            .call(ExecProcess {
                container: "caps".into(),
                exec_id: "bad".into(),
                process: x,
            })
            .await,
    );
    assert_eq!(c, ErrorCode::InvalidArgument, "{m}");
    assert!(m.contains("CAP_BOGUS") && m.contains("effective"), "{m}");
    agent
        .call(SignalProcess {
            process: ProcessRef {
                container: "caps".into(),
                exec_id: None,
            },
            signal: 9,
            all: true,
        })
        .await
        .unwrap();
    assert_eq!(wait(&agent, "caps", None).await, 137);
    agent
        .call(RemoveContainer { id: "caps".into() })
        .await
        .unwrap();

    // 5. IPC and UTS namespaces: "nsa" has new ones (with its hostname),
    // "nsb" joins them, an exec into "nsa" is in them; the guest's differ.
    const SHOW: &str = "readlink /proc/self/ns/ipc; readlink /proc/self/ns/uts; hostname";
    let guest = agent
        .exec(&["sh", "-c", SHOW], Duration::from_secs(30))
        .await
        .unwrap()
        .stdout;
    let ns_req = |id: &str, p: ProcessSpec, src: NamespaceSource| CreateContainer {
        id: id.into(),
        rootfs: rootfs.clone(),
        rootfs_readonly: false,
        process: p,
        mounts: std_mounts(),
        masked_paths: vec![],
        readonly_paths: vec![],
        memory_limit_bytes: None,
        devices: vec![],
        ipc: src.clone(),
        uts: src,
        hostname: "nsa-host".into(),
        pid: Default::default(),
        sysctl: Default::default(),
        seccomp: None,
        user: Default::default(),
    };
    let mut rx = mux.register(8);
    let cmd = format!("{SHOW}; echo started; exec sleep 600");
    agent
        .call(ns_req(
            "nsa",
            proc(&["sh", "-c", &cmd], 8),
            NamespaceSource::New,
        ))
        .await
        .unwrap();
    agent
        .call(StartContainer { id: "nsa".into() })
        .await
        .unwrap();
    let mut nsa = String::new();
    while !nsa.ends_with("started\n") {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some(Output::Stdout(d) | Output::Stderr(d))) => {
                nsa.push_str(&String::from_utf8_lossy(&d));
            }
            other => panic!("{other:?} after {nsa:?}"),
        }
    }
    let nsa = nsa.trim_end_matches("started\n").to_string();
    let (g, a): (Vec<&str>, Vec<&str>) = (guest.lines().collect(), nsa.lines().collect());
    assert_eq!(a.len(), 3, "{nsa}");
    assert!(
        a[0].starts_with("ipc:[") && a[0] != g[0],
        "{nsa} vs guest {guest}"
    );
    assert!(
        a[1].starts_with("uts:[") && a[1] != g[1],
        "{nsa} vs guest {guest}"
    );
    assert_eq!(a[2], "nsa-host");
    assert_ne!(g[2], "nsa-host", "the guest's hostname is untouched");
    let mut rx = mux.register(9);
    agent
        .call(ns_req(
            "nsb",
            proc(&["sh", "-c", SHOW], 9),
            NamespaceSource::Container { id: "nsa".into() },
        ))
        .await
        .unwrap();
    agent
        .call(StartContainer { id: "nsb".into() })
        .await
        .unwrap();
    let (out, err) = collect(&mut rx, 2).await;
    assert_eq!(wait(&agent, "nsb", None).await, 0, "{err}");
    assert_eq!(out, nsa, "nsb shares nsa's namespaces");
    let mut xrx = mux.register(10);
    agent
        .call(ExecProcess {
            container: "nsa".into(),
            exec_id: "x".into(),
            process: proc(&["sh", "-c", SHOW], 10),
        })
        .await
        .unwrap();
    let (out, _) = collect(&mut xrx, 2).await;
    assert_eq!(wait(&agent, "nsa", Some("x")).await, 0);
    assert_eq!(out, nsa, "an exec is in its container's namespaces");
    let (c, m) = code(
        agent
            .call(ns_req(
                "nsc",
                proc(&["true"], 0),
                NamespaceSource::Container { id: "nope".into() },
            ))
            .await,
    );
    assert_eq!(c, ErrorCode::InvalidArgument, "{m}");
    assert!(m.contains("\"nope\""), "{m}");
    agent
        .call(SignalProcess {
            process: ProcessRef {
                container: "nsa".into(),
                exec_id: None,
            },
            signal: 9,
            all: true,
        })
        .await
        .unwrap();
    assert_eq!(wait(&agent, "nsa", None).await, 137);
    for id in ["nsa", "nsb"] {
        agent.call(RemoveContainer { id: id.into() }).await.unwrap();
    }

    // 6. Bad input: clear errors, nothing left behind.
    let bad = |id: &str, path: &str, args: &[&str]| CreateContainer {
        id: id.into(),
        rootfs: Rootfs::Share(ShareRef {
            tag: "pod".into(),
            path: path.into(),
        }),
        rootfs_readonly: false,
        process: proc(args, 0),
        mounts: std_mounts(),
        masked_paths: vec![],
        readonly_paths: vec![],
        memory_limit_bytes: None,
        devices: vec![],
        ipc: Default::default(),
        uts: Default::default(),
        hostname: String::new(),
        pid: Default::default(),
        sysctl: Default::default(),
        seccomp: None,
        user: Default::default(),
    };
    let (c, m) = code(agent.call(bad("b1", "c/missing", &["sh"])).await);
    assert_eq!(c, ErrorCode::InvalidArgument, "{m}");
    let (c, m) = code(agent.call(bad("b2", "c/../x", &["sh"])).await);
    assert_eq!(c, ErrorCode::InvalidArgument, "{m}");
    agent
        .call(bad("b3", "c/rootfs", &["/no/such/binary"]))
        .await
        .unwrap();
    let (c, m) = code(agent.call(StartContainer { id: "b3".into() }).await);
    assert_eq!(c, ErrorCode::InvalidArgument);
    assert!(m.contains("/no/such/binary"), "{m}");
    agent
        .call(RemoveContainer { id: "b3".into() })
        .await
        .unwrap();
    let mut p = proc(&["sh"], 0);
    p.rlimits = vec![Rlimit {
        kind: "RLIMIT_BOGUS".into(),
        soft: 1,
        hard: 1,
    }];
    let mut req = bad("b4", "c/rootfs", &["sh"]);
    req.process = p;
    let (c, _) = code(agent.call(req).await);
    assert_eq!(c, ErrorCode::InvalidArgument);
    // The agent's own check of a user namespace (the shim's too): by field.
    let mut req = bad("b5", "c/rootfs", &["sh"]);
    let line = |c: u32, h: u32, n: u32| crust_agent_proto::IdMapping {
        container_id: c,
        host_id: h,
        size: n,
    };
    req.user = crust_agent_proto::UserNamespace {
        source: NamespaceSource::New,
        uid_mappings: vec![line(0, 100_000, 100), line(100, 100_050, 100)],
        gid_mappings: vec![line(0, 100_000, 100)],
    };
    let (c, m) = code(agent.call(req).await);
    assert_eq!(c, ErrorCode::InvalidArgument, "{m}");
    assert!(
        m.contains("linux.uidMappings[1] overlaps [0] in hostID"),
        "{m}"
    );
    let (c, _) = code(agent.call(StartContainer { id: "nope".into() }).await);
    assert_eq!(c, ErrorCode::NotFound);
    let left = agent
        .exec(&["sh", "-c", "ls /sys/fs/cgroup | grep -cE '^(one|two|tty|caps|ns[abc]|b[0-9])$'; ls /run/crust/containers | wc -l"], Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(left.stdout, "0\n0\n", "{}", left.stderr);
}
