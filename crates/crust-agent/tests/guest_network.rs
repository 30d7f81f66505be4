//! configure_network in a real guest (issue 26): the image loads
//! virtio_net at boot, and the agent gives two virtio-net NICs (QEMU user
//! networking, added by a wrapper around QEMU: the VMM grows its own NIC
//! support separately) the pod's names swapped against the guest's probe
//! order, MTU, IPv4 and IPv6 addresses and a default route; a TCP
//! connection from the guest through that route reaches a server on the
//! host. Then the pod's hostname: a container whose `/etc/hostname` bind
//! (CRI writes the sandbox's hostname there) names the guest.
//! Budget: one TCG guest, ~15 s.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use crust_agent_proto::{
    AgentClient, ConfigureNetwork, ContainerMount, CreateContainer, Exec, MountSource, NetAddress,
    NetInterface, NetRoute, ProcessSpec, Rootfs, RouteScope, ShareRef,
};
use crust_vmm::{Accel, ShareSpec, Vm, VmConfig};
use rustix::mount::{MountPropagationFlags, UnmountFlags};

struct Mounts(std::path::PathBuf);

impl Drop for Mounts {
    fn drop(&mut self) {
        crust_testkit::unmount_below(&self.0);
        let _ = rustix::mount::unmount(&self.0, UnmountFlags::DETACH);
    }
}

/// QEMU probes this one first: the guest calls it eth0.
const MAC_FIRST: &str = "02:00:00:00:01:01";
const MAC_SECOND: &str = "02:00:00:00:01:02";

async fn sh(agent: &AgentClient, script: &str) -> String {
    let r = agent
        .call(Exec {
            args: vec!["sh".into(), "-c".into(), script.into()],
            env: vec!["PATH=/usr/sbin:/usr/bin:/sbin:/bin".into()],
            timeout_ms: 20_000,
            container: None,
        })
        .await
        .expect("exec");
    assert_eq!(r.exit_code, 0, "{script}: {}{}", r.stdout, r.stderr);
    r.stdout
}

fn addr(a: &str, len: u8) -> NetAddress {
    NetAddress {
        address: a.parse().unwrap(),
        prefix_len: len,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_guest_nic_gets_the_pods_interface_and_reaches_the_host() {
    crust_testkit::require_root();
    crust_testkit::ensure_guest_image();
    let _slot = crust_testkit::VmSlot::acquire();
    let (kernel, initrd) = crust_testkit::guest_image();
    let dir = tempfile::Builder::new()
        .prefix("crust-gnet-")
        .tempdir()
        .unwrap();
    let wrapper = dir.path().join("qemu");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec qemu-system-x86_64 \"$@\" \
             -netdev user,id=n0,net=10.0.2.0/24 -device virtio-net-pci,netdev=n0,mac={MAC_FIRST} \
             -netdev user,id=n1,net=10.0.3.0/24 -device virtio-net-pci,netdev=n1,mac={MAC_SECOND}\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();

    // The pod's share: a rootfs and the hostname file CRI would write.
    let share = dir.path().join("share");
    let rootfs = share.join("c/rootfs");
    for d in ["bin", "etc", "proc"] {
        std::fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", rootfs.join("bin/sh")).unwrap();
    std::fs::write(share.join("c/hostname"), "web-0\n").unwrap();
    rustix::mount::mount_bind(&share, &share).unwrap();
    let _mounts = Mounts(share.clone());
    rustix::mount::mount_change(&share, MountPropagationFlags::SHARED).unwrap();

    let mut cfg = VmConfig::new("gnet", kernel, initrd, dir.path().join("run"));
    cfg.accel = Accel::Tcg;
    cfg.die_with_parent = true;
    cfg.hotplug_ports = 0;
    cfg.qemu_binary = wrapper;
    cfg.shares = vec![ShareSpec {
        tag: "pod".into(),
        dir: share.clone(),
    }];
    let t0 = std::time::Instant::now();
    let vm = Vm::launch(cfg).await.expect("launch");
    let agent = AgentClient::new(vm.agent_socket());
    if let Err(e) = agent.wait_ready(Duration::from_secs(120)).await {
        panic!("agent not ready: {e}\n{}", vm.failure_context());
    }
    eprintln!("agent ready {:?} after launch", t0.elapsed());
    // virtio_net is loaded at boot: both NICs are there before any request.
    let seen = sh(&agent, "cat /sys/class/net/*/address").await;
    assert!(
        seen.contains(MAC_FIRST) && seen.contains(MAC_SECOND),
        "{seen}"
    );

    // QEMU's user network answers at .2 and forwards to the host.
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    let got = std::thread::spawn(move || {
        let (mut c, _) = server.accept().unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut s = String::new();
        c.read_to_string(&mut s).unwrap();
        s
    });

    let req = ConfigureNetwork {
        interfaces: vec![
            NetInterface {
                name: "eth0".into(),
                mac: MAC_SECOND.into(),
                mtu: 1400,
                addresses: vec![addr("10.0.3.15", 24)],
            },
            NetInterface {
                name: "net1".into(),
                mac: MAC_FIRST.into(),
                mtu: 1460,
                addresses: vec![addr("10.0.2.15", 24), addr("fd00:2::15", 64)],
            },
        ],
        routes: vec![NetRoute {
            destination: "0.0.0.0".parse().unwrap(),
            prefix_len: 0,
            gateway: Some("10.0.2.2".parse().unwrap()),
            device: "net1".into(),
            source: None,
            scope: RouteScope::Universe,
            metric: 0,
        }],
        neighbours: vec![],
        netfilter: None,
    };
    // The time a pod start spends here, beside a round trip that does
    // nothing (the protocol's own share).
    let t = std::time::Instant::now();
    agent.call(crust_agent_proto::Ping {}).await.expect("ping");
    let ping = t.elapsed();
    let t = std::time::Instant::now();
    let reply = agent.call(req).await.expect("configure_network");
    eprintln!(
        "configure_network took {:?} (ping {ping:?}) in a TCG guest",
        t.elapsed()
    );
    assert_eq!(reply.interfaces, ["eth0", "net1"]);

    // IFF_UP (operstate follows a moment later, from the kernel's link
    // watch).
    let links = sh(
        &agent,
        "for i in eth0 net1; do echo $i $(cat /sys/class/net/$i/address /sys/class/net/$i/mtu /sys/class/net/$i/flags); done",
    )
    .await;
    let mut lines = links.lines().map(|l| l.split(' ').collect::<Vec<_>>());
    for (name, mac, mtu) in [("eth0", MAC_SECOND, "1400"), ("net1", MAC_FIRST, "1460")] {
        let l = lines.next().unwrap_or_default();
        assert_eq!(l[..3], [name, mac, mtu], "{links}");
        let flags = u32::from_str_radix(l[3].trim_start_matches("0x"), 16).unwrap();
        assert_eq!(flags & 1, 1, "{name} is not up: {links}");
    }
    // /proc/net/if_inet6: address, index, prefix, scope, flags (0x40
    // tentative), name.
    let v6 = sh(&agent, "grep fd000002 /proc/net/if_inet6").await;
    let flags = u32::from_str_radix(v6.split_whitespace().nth(4).unwrap(), 16).unwrap();
    assert_eq!(flags & 0x40, 0, "tentative: {v6}");
    assert!(v6.trim_end().ends_with("net1"), "{v6}");
    let route = sh(&agent, "ip route show default").await;
    assert!(route.contains("via 10.0.2.2 dev net1"), "{route}");

    sh(
        &agent,
        &format!("echo hello from the guest | nc 10.0.2.2 {port}"),
    )
    .await;
    let got = tokio::task::spawn_blocking(move || got.join().unwrap())
        .await
        .unwrap();
    assert_eq!(got, "hello from the guest\n");

    let share_ref = |path: &str| ShareRef {
        tag: "pod".into(),
        path: path.into(),
    };
    assert_eq!(sh(&agent, "hostname").await, "crust\n");
    agent
        .call(CreateContainer {
            id: "c".into(),
            rootfs: Rootfs::Share(share_ref("c/rootfs")),
            rootfs_readonly: false,
            process: ProcessSpec {
                args: vec!["sh".into()],
                env: vec!["PATH=/bin".into()],
                ..Default::default()
            },
            mounts: vec![ContainerMount {
                destination: "/etc/hostname".into(),
                source: MountSource::Share(share_ref("c/hostname")),
                readonly: true,
                options: vec![],
                submounts: vec![],
            }],
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
        .expect("create_container");
    assert_eq!(sh(&agent, "hostname").await, "web-0\n");
}
