//! crust-podnet against a real network namespace shaped as CNI's bridge
//! plugin leaves one (a veth with IPv4 and IPv6 addresses, a default
//! route via the gateway, a permanent neighbour), built with iproute2.
//! Frames cross the tc redirects both ways: an ARP request from the host
//! comes out of the tap's descriptor, and an ARP reply written into the
//! descriptor teaches the host the pod's MAC. What no NIC can mirror
//! (a layer-3 device, a taken ingress hook, a master or its port, policy
//! routes) is refused by name and leaves the namespace as it was.
//! Budget: about 1 s.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, top to bottom"
)]

use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::{Duration, Instant};

use crust_podnet::{AntiSpoof, GuestNet, NetNs, attach, detach, guard, scan};
use crust_testkit::ip;

/// A named namespace with a veth into it; removed on drop.
struct Pod {
    name: String,
    host_if: String,
}

impl Pod {
    fn new(tag: &str) -> Pod {
        assert!(rustix::process::geteuid().is_root(), "needs root (netns)");
        let name = format!("crust-pn-{tag}-{}", std::process::id());
        let host_if = format!("vh{tag}{}", std::process::id() % 100_000);
        ip(&["netns", "add", &name]);
        let p = Pod { name, host_if };
        let n = p.name.as_str();
        ip(&[
            "link", "add", &p.host_if, "type", "veth", "peer", "name", "eth0", "netns", n,
        ]);
        ip(&["link", "set", &p.host_if, "up"]);
        ip(&["-n", n, "link", "set", "lo", "up"]);
        ip(&["-n", n, "link", "set", "eth0", "mtu", "1400", "up"]);
        ip(&["-n", n, "addr", "add", "10.99.0.2/24", "dev", "eth0"]);
        ip(&[
            "-n",
            n,
            "addr",
            "add",
            "fd00:99::2/64",
            "dev",
            "eth0",
            "nodad",
        ]);
        ip(&[
            "-n",
            n,
            "route",
            "add",
            "default",
            "via",
            "10.99.0.1",
            "dev",
            "eth0",
        ]);
        ip(&[
            "-n",
            n,
            "route",
            "add",
            "10.100.0.0/16",
            "via",
            "10.99.0.1",
            "metric",
            "7",
        ]);
        ip(&[
            "-n",
            n,
            "neigh",
            "add",
            "10.99.0.9",
            "lladdr",
            "02:00:00:00:00:09",
            "dev",
            "eth0",
            "nud",
            "permanent",
        ]);
        p
    }

    /// The gateway's address on the host side (one pod per test process
    /// may have it: the host routes 10.99.0.0/24 to it).
    fn host_address(&self) {
        ip(&["addr", "add", "10.99.0.1/24", "dev", &self.host_if]);
    }

    fn path(&self) -> String {
        format!("/var/run/netns/{}", self.name)
    }

    fn inside(&self, args: &[&str]) -> String {
        let mut a = vec!["-n", self.name.as_str()];
        a.extend(args);
        ip(&a)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .status();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn tc_ingress(pod: &Pod, dev: &str) -> String {
    let o = Command::new("tc")
        .args(["-n", &pod.name, "filter", "show", "dev", dev, "ingress"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The first ARP frame readable from any of `fds` within 3 s, without
/// the 10-byte virtio-net header (the host also sends IPv6 multicast).
fn read_arp(fds: &[std::os::fd::OwnedFd]) -> Option<Vec<u8>> {
    let until = Instant::now() + Duration::from_secs(3);
    let mut buf = vec![0u8; 4096];
    while Instant::now() < until {
        let mut pfd: Vec<_> = fds
            .iter()
            .map(|f| rustix::event::PollFd::new(f, rustix::event::PollFlags::IN))
            .collect();
        let timeout = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 200_000_000,
        };
        if rustix::event::poll(&mut pfd, Some(&timeout)).unwrap() == 0 {
            continue;
        }
        let ready: Vec<bool> = pfd.iter().map(|p| !p.revents().is_empty()).collect();
        for (fd, r) in fds.iter().zip(ready) {
            if !r {
                continue;
            }
            let n = rustix::io::read(fd, &mut buf).unwrap();
            let frame = &buf[10..n];
            if frame.len() >= 14 && frame[12..14] == [0x08, 0x06] {
                return Some(frame.to_vec());
            }
        }
    }
    None
}

#[test]
fn scan_attach_and_detach_a_cni_shaped_namespace() {
    let pod = Pod::new("a");
    pod.host_address();
    // (DAD of the link-local address may end meanwhile.)
    let state = || {
        (
            pod.inside(&["-j", "addr"])
                .replace("\"tentative\":true,", ""),
            pod.inside(&["-j", "route"]),
        )
    };
    let before = state();
    let ns = NetNs::open(&pod.path()).unwrap();
    let net = scan(&ns).unwrap();

    // What the guest is asked for equals what CNI made.
    assert_eq!(net.links.len(), 1, "{net:?}");
    let eth0 = &net.config.interfaces[0];
    assert_eq!((eth0.name.as_str(), eth0.mtu), ("eth0", 1400));
    let addrs: Vec<String> = eth0
        .addresses
        .iter()
        .map(|a| format!("{}/{}", a.address, a.prefix_len))
        .collect();
    assert_eq!(addrs, ["10.99.0.2/24", "fd00:99::2/64"], "no link-local");
    let routes: Vec<String> = net
        .config
        .routes
        .iter()
        .map(|r| {
            format!(
                "{}/{} via {:?} metric {}",
                r.destination, r.prefix_len, r.gateway, r.metric
            )
        })
        .collect();
    assert!(
        routes.contains(&"0.0.0.0/0 via Some(10.99.0.1) metric 0".to_string()),
        "{routes:?}"
    );
    assert!(
        routes.contains(&"10.100.0.0/16 via Some(10.99.0.1) metric 7".to_string()),
        "{routes:?}"
    );
    assert_eq!(net.config.neighbours.len(), 1);
    assert_eq!(net.config.neighbours[0].mac, "02:00:00:00:00:09");

    // Two queues: two descriptors, one tap.
    let taps = attach(&ns, &net, &GuestNet::default(), 2, AntiSpoof::On).unwrap();
    assert_eq!(taps.len(), 1);
    assert_eq!(taps[0].fds.len(), 2);
    let links = pod.inside(&["-j", "link", "show", "crusttap0"]);
    assert!(
        links.contains("\"mtu\":1400") && links.contains("UP"),
        "{links}"
    );
    let tc = tc_ingress(&pod, "eth0");
    assert!(
        tc.contains("protocol all") && tc.contains("mirred"),
        "eth0 redirects: {tc}"
    );
    // The guest's direction is the guard's: checked, then forwarded.
    assert!(tc_ingress(&pod, "crusttap0").is_empty());
    let table = nft(&pod, &["list", "table", "netdev", guard::GUARD_TABLE]);
    assert!(
        table.contains("device \"crusttap0\"") && table.contains("fwd to \"eth0\""),
        "{table}"
    );

    // Host -> pod: the host's ARP request for the pod comes out of a tap queue.
    let mut ping = Command::new("ping")
        .args(["-c", "4", "-i", "0.5", "-W", "1", "10.99.0.2"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let frame = read_arp(&taps[0].fds).unwrap_or_else(|| {
        panic!(
            "the host's ARP request never reached the tap; host: {} {}\n{}\n{}",
            ip(&["route", "get", "10.99.0.2"]),
            String::from_utf8_lossy(
                &Command::new("tc")
                    .args([
                        "-s", "-n", &pod.name, "filter", "show", "dev", "eth0", "ingress"
                    ])
                    .output()
                    .unwrap()
                    .stdout
            ),
            pod.inside(&["-s", "link", "show", "crusttap0"]),
            ip(&["neigh", "show", "dev", &pod.host_if])
        )
    });
    let _ = ping.kill();
    let _ = ping.wait();
    let host_mac = frame[6..12].to_vec();
    // Pod -> host: an ARP reply written into the tap reaches the host,
    // which learns the pod's MAC.
    let mut reply = vec![0u8; 10];
    reply.extend(&host_mac);
    reply.extend(taps[0].mac);
    reply.extend([0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 2]);
    reply.extend(taps[0].mac);
    reply.extend([10, 99, 0, 2]);
    reply.extend(&host_mac);
    reply.extend([10, 99, 0, 1]);
    rustix::io::write(&taps[0].fds[0], &reply).unwrap();
    let until = Instant::now() + Duration::from_secs(3);
    let learned = loop {
        let n = ip(&["neigh", "show", "10.99.0.2", "dev", &pod.host_if]);
        if n.contains(&crust_agent_proto::network::format_mac(&taps[0].mac))
            || Instant::now() > until
        {
            break n;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        learned.contains(&crust_agent_proto::network::format_mac(&taps[0].mac)),
        "{learned}"
    );

    // Detach: CNI's namespace exactly as it was.
    let names: Vec<String> = net.links.iter().map(|l| l.name.clone()).collect();
    let raw: Vec<i32> = taps
        .iter()
        .flat_map(|t| t.fds.iter().map(|f| f.as_raw_fd()))
        .collect();
    assert!(!raw.is_empty());
    drop(taps);
    detach(&ns, &names).unwrap();
    detach(&ns, &names).unwrap();
    assert!(tc_ingress(&pod, "eth0").is_empty());
    assert!(!pod.inside(&["link"]).contains("crusttap"));
    assert!(
        nft(&pod, &["list", "ruleset"]).is_empty(),
        "the guard's table is gone"
    );
    assert_eq!(state(), before);
}

/// `nft args` in the pod's namespace.
fn nft(pod: &Pod, args: &[&str]) -> String {
    let o = Command::new("ip")
        .args(["netns", "exec", &pod.name, "nft"])
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "nft {args:?}: {o:?}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// An Ethernet frame behind the tap's 10-byte virtio-net header.
fn frame(dst: [u8; 6], src: [u8; 6], ethertype: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; 10];
    f.extend(dst);
    f.extend(src);
    f.extend(ethertype);
    f.extend(payload);
    f
}

/// An ARP request "who has `target`? tell `sender` at `sha`".
fn arp_request(sha: [u8; 6], sender: [u8; 4], target: [u8; 4]) -> Vec<u8> {
    let mut p = vec![0, 1, 0x08, 0, 6, 4, 0, 1];
    p.extend(sha);
    p.extend(sender);
    p.extend([0; 6]);
    p.extend(target);
    frame([0xff; 6], sha, &[0x08, 0x06], &p)
}

/// A UDP datagram from `src` to 10.99.0.1:9.
fn udp4(mac: [u8; 6], src: [u8; 4]) -> Vec<u8> {
    let mut h = vec![0x45, 0, 0, 32, 0, 1, 0, 0, 64, 17, 0, 0];
    h.extend(src);
    h.extend([10, 99, 0, 1]);
    let sum = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum::<u32>();
    let sum = !(((sum & 0xffff) + (sum >> 16)) as u16);
    h[10..12].copy_from_slice(&sum.to_be_bytes());
    h.extend([0x30, 0x39, 0, 9, 0, 12, 0, 0, b'h', b'i', b'!', b'\n']);
    frame([0xff; 6], mac, &[0x08, 0x00], &h)
}

/// An ICMPv6 message of `typ` from fe80::1 to all nodes, `body` after
/// its 4-byte header (hop limit 255, as ND wants).
fn icmp6(mac: [u8; 6], typ: u8, body: &[u8]) -> Vec<u8> {
    let len = (4 + body.len()) as u16;
    let mut p = vec![0x60, 0, 0, 0];
    p.extend(len.to_be_bytes());
    p.extend([58, 255]);
    p.extend("fe80::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
    p.extend("ff02::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
    p.extend([typ, 0, 0, 0]);
    p.extend(body);
    frame([0x33, 0x33, 0, 0, 0, 1], mac, &[0x86, 0xdd], &p)
}

/// Issue 42, item 6: what a hostile guest writes into its tap. Without
/// the guard (a pod that turned it off) every forged frame reaches the
/// host's side of the veth, which proves the capture sees them; with it,
/// none does, each is counted under its reason, and the pod's own frames
/// still pass.
#[test]
fn forged_frames_from_the_guest_never_reach_the_pods_interface() {
    let pod = Pod::new("g");
    let ns = NetNs::open(&pod.path()).unwrap();
    let net = scan(&ns).unwrap();
    let own4 = [10, 99, 0, 2];
    let other4 = [10, 99, 0, 9];
    let forged_mac = [0x02, 0, 0, 0, 0, 0x77];
    let mut na_other = vec![0x20, 0, 0, 0];
    na_other.extend("fd00:99::9".parse::<std::net::Ipv6Addr>().unwrap().octets());
    let send = |mac: [u8; 6], fd: &std::os::fd::OwnedFd| {
        let forged = [
            arp_request(mac, other4, [10, 99, 0, 1]),
            arp_request(forged_mac, own4, [10, 99, 0, 1]),
            udp4(mac, other4),
            icmp6(mac, 136, &na_other),
            icmp6(mac, 134, &[64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            frame(
                [0xff; 6],
                mac,
                &[0x81, 0x00, 0, 5, 0x08, 0x06],
                &[0, 1, 0x08, 0, 6, 4, 0, 1],
            ),
        ];
        for f in forged
            .iter()
            .chain([&arp_request(mac, own4, [10, 99, 0, 1]), &udp4(mac, own4)])
        {
            rustix::io::write(fd, f).unwrap();
        }
    };
    let forged_seen = |cap: &str| -> Vec<&str> {
        [
            "10.99.0.9",
            "02:00:00:00:00:77",
            "fd00:99::9",
            "router advertisement",
            "802.1Q",
        ]
        .into_iter()
        .filter(|n| cap.contains(n))
        .collect()
    };

    let taps = attach(&ns, &net, &GuestNet::default(), 1, AntiSpoof::Off).unwrap();
    let cap = crust_testkit::Capture::start(&pod.host_if);
    send(taps[0].mac, &taps[0].fds[0]);
    let open = cap.stop();
    assert_eq!(forged_seen(&open).len(), 5, "without the guard: {open}");
    drop(taps);
    detach(&ns, &["eth0".to_string()]).unwrap();

    let taps = attach(&ns, &net, &GuestNet::default(), 1, AntiSpoof::On).unwrap();
    let cap = crust_testkit::Capture::start(&pod.host_if);
    send(taps[0].mac, &taps[0].fds[0]);
    let guarded = cap.stop();
    assert_eq!(forged_seen(&guarded), Vec::<&str>::new(), "{guarded}");
    assert!(
        guarded.contains("tell 10.99.0.2") && guarded.contains("10.99.0.2.12345 > 10.99.0.1.9"),
        "the pod's own frames pass: {guarded}"
    );
    let dropped = guard::dropped(&ns, &["eth0".to_string()]).unwrap();
    let count = |reason: &str| {
        dropped
            .iter()
            .filter(|d| d.interface == "eth0" && d.reason == reason)
            .map(|d| d.packets)
            .sum::<u64>()
    };
    for (reason, n) in [("arp", 1), ("mac", 1), ("ipv4", 1), ("nd", 2), ("other", 1)] {
        assert_eq!(count(reason), n, "{reason}: {dropped:?}");
    }
    drop(taps);
    detach(&ns, &["eth0".to_string()]).unwrap();
}

/// A second network (as Multus adds): a macvlan interface beside CNI's
/// veth. Both are mirrored, each by its own tap and filters.
#[test]
fn a_macvlan_second_interface_gets_its_own_tap() {
    let pod = Pod::new("m");
    let mv = format!("mv{}", std::process::id() % 100_000);
    ip(&[
        "link",
        "add",
        &mv,
        "link",
        &pod.host_if,
        "type",
        "macvlan",
        "mode",
        "bridge",
    ]);
    ip(&["link", "set", &mv, "netns", &pod.name]);
    pod.inside(&["link", "set", &mv, "name", "net1"]);
    pod.inside(&["addr", "add", "10.98.0.2/24", "dev", "net1"]);
    pod.inside(&["link", "set", "net1", "up"]);
    let ns = NetNs::open(&pod.path()).unwrap();
    let net = scan(&ns).unwrap();
    let kinds: Vec<(&str, &str)> = net
        .links
        .iter()
        .map(|l| (l.name.as_str(), l.kind.as_str()))
        .collect();
    assert_eq!(kinds, [("eth0", "veth"), ("net1", "macvlan")]);
    let net1 = &net.config.interfaces[1];
    assert_eq!(net1.addresses[0].address.to_string(), "10.98.0.2");
    let taps = attach(&ns, &net, &GuestNet::default(), 1, AntiSpoof::Off).unwrap();
    let pairs: Vec<(&str, &str)> = taps
        .iter()
        .map(|t| (t.name.as_str(), t.link.as_str()))
        .collect();
    assert_eq!(pairs, [("crusttap0", "eth0"), ("crusttap1", "net1")]);
    for dev in ["eth0", "net1", "crusttap0", "crusttap1"] {
        assert!(tc_ingress(&pod, dev).contains("mirred"), "{dev}");
    }
    drop(taps);
    detach(&ns, &["eth0".into(), "net1".into()]).unwrap();
    assert!(tc_ingress(&pod, "net1").is_empty());
}

/// Everything of the namespace a refused attach must leave alone, once
/// settled (a new bridge's state and timers move for a while); timer
/// values left out.
fn dump(pod: &Pod) -> String {
    let mut last = raw_dump(pod);
    for _ in 0..30 {
        std::thread::sleep(Duration::from_millis(100));
        let now = raw_dump(pod);
        if now == last {
            break;
        }
        last = now;
    }
    last
}

fn raw_dump(pod: &Pod) -> String {
    let mut out = String::new();
    for line in raw_dump_with_timers(pod).lines() {
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            out += w;
            out.push(' ');
            if w.ends_with("_timer") {
                words.next();
            }
        }
        out.push('\n');
    }
    out
}

fn raw_dump_with_timers(pod: &Pod) -> String {
    let mut out = pod.inside(&["-d", "link"]);
    out += &pod.inside(&["addr"]).replace(" tentative", "");
    out += &pod.inside(&["route", "show", "table", "all"]);
    for args in [
        &["qdisc", "show"][..],
        &["filter", "show", "dev", "eth0", "ingress"],
    ] {
        let mut a = vec!["-n", pod.name.as_str()];
        a.extend(args);
        let o = Command::new("tc").args(&a).output().unwrap();
        out += &String::from_utf8_lossy(&o.stdout);
    }
    out
}

/// Bad input: `attach` refuses, naming the interface and the reason, and
/// the namespace is byte for byte as it was (dumps of links, addresses,
/// routes, qdiscs and filters).
fn refused(pod: &Pod, needles: &[&str]) {
    let before = dump(pod);
    let ns = NetNs::open(&pod.path()).unwrap();
    let net = scan(&ns).unwrap();
    let e = attach(&ns, &net, &GuestNet::default(), 1, AntiSpoof::On)
        .map(|t| t.len())
        .unwrap_err()
        .to_string();
    for n in needles {
        assert!(e.contains(n), "{n:?} not in: {e}");
    }
    assert_eq!(dump(pod), before, "the namespace changed: {e}");
}

#[test]
fn what_cannot_be_a_nic_is_refused_by_name() {
    let pod = Pod::new("b");
    // A layer-3 tun device has no Ethernet address.
    pod.inside(&["tuntap", "add", "mode", "tun", "name", "tun9"]);
    pod.inside(&["link", "set", "tun9", "up"]);
    refused(&pod, &["tun9", "Ethernet"]);
    // Not a namespace at all.
    let e = NetNs::open("/etc/hostname").unwrap_err().to_string();
    assert!(e.contains("nsfs"), "{e}");
    // Only lo: nothing to mirror.
    let empty = Pod::new("c");
    empty.inside(&["link", "del", "eth0"]);
    let ns = NetNs::open(&empty.path()).unwrap();
    let net = scan(&ns).unwrap();
    assert!(net.is_empty() && net.config.routes.is_empty(), "{net:?}");
}

/// tc's ingress hook already in use on CNI's interface (a policing
/// filter): refused before any tap or qdisc is made, and that qdisc and
/// its filter stay (the old attach failed on it, and its undo deleted
/// them).
#[test]
fn a_taken_ingress_hook_is_refused_and_kept() {
    let pod = Pod::new("q");
    let tc = |args: &[&str]| {
        let mut a = vec!["-n", pod.name.as_str()];
        a.extend(args);
        let o = Command::new("tc").args(&a).output().unwrap();
        assert!(o.status.success(), "tc {args:?}: {o:?}");
    };
    tc(&["qdisc", "add", "dev", "eth0", "ingress"]);
    tc(&[
        "filter", "add", "dev", "eth0", "ingress", "protocol", "all", "u32", "match", "u32", "0",
        "0", "action", "mirred", "egress", "mirror", "dev", "lo",
    ]);
    refused(&pod, &["eth0", "ingress qdisc"]);
    assert!(tc_ingress(&pod, "eth0").contains("to device lo"));
}

/// A master in the pod's namespace (a bridge with CNI's veth as its
/// port) and routes outside the main table (source-based routing, as
/// CNI's sbr plugin leaves): neither can be a NIC's.
#[test]
fn masters_ports_and_policy_routes_are_refused_by_name() {
    let pod = Pod::new("r");
    pod.inside(&[
        "route",
        "add",
        "default",
        "via",
        "10.99.0.1",
        "table",
        "100",
    ]);
    refused(&pod, &["eth0", "table 100"]);
    let pod = Pod::new("s");
    pod.inside(&["link", "add", "br9", "type", "bridge"]);
    pod.inside(&["link", "set", "br9", "up"]);
    pod.inside(&["link", "set", "eth0", "master", "br9"]);
    refused(&pod, &["eth0", "port of br9"]);
}

/// One sandbox per network namespace (issue 42, item 5). A namespace
/// another pod's processes live in (a runc pod's pause, played by a
/// `sleep` entered with `ip netns exec`) is refused, naming the process,
/// and left as it was. Once a sandbox's redirect is in place, a second
/// attach to the same namespace is refused (its ingress hook is taken)
/// and the first sandbox keeps its redirect.
#[test]
fn another_pods_namespace_is_refused() {
    let pod = Pod::new("h");
    let mut pause = Command::new("ip")
        .args(["netns", "exec", &pod.name, "sleep", "600"])
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while NetNs::open(&pod.path()).unwrap().holders().is_empty() {
        assert!(
            Instant::now() < until,
            "the sleep never entered the namespace"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    refused(
        &pod,
        &["other processes live in it", "(sleep)", "one sandbox"],
    );
    let _ = pause.kill();
    let _ = pause.wait();

    let ns = NetNs::open(&pod.path()).unwrap();
    let net = scan(&ns).unwrap();
    let first = attach(&ns, &net, &GuestNet::default(), 1, AntiSpoof::On).unwrap();
    let redirect = tc_ingress(&pod, "eth0");
    assert!(redirect.contains("mirred"), "{redirect}");
    let second = attach(
        &ns,
        &scan(&ns).unwrap(),
        &GuestNet::default(),
        1,
        AntiSpoof::On,
    )
    .map(|t| t.len())
    .unwrap_err()
    .to_string();
    assert!(second.contains("ingress qdisc"), "{second}");
    assert_eq!(
        tc_ingress(&pod, "eth0"),
        redirect,
        "the first sandbox keeps its redirect"
    );
    drop(first);
    detach(&ns, &["eth0".to_string()]).unwrap();
}

/// `cmd args` in the pod's namespace, which must succeed.
fn inside_ns(pod: &Pod, cmd: &str, args: &[&str]) {
    let o = Command::new("ip")
        .args(["netns", "exec", &pod.name, cmd])
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{cmd} {args:?}: {o:?}");
}

/// Issue 42, item 4: what netfilter holds in the namespace, in each of
/// its three forms. Tables that only listing made (legacy iptables makes
/// its tables when asked) and crust's own guard are not rules; a DROP
/// policy is, and so is each rule, under its backend, table and chain.
/// What `guest` mode carries is iptables-save text; iptables rules in
/// both backends of one family, and a native nftables table, are refused
/// by name rather than half carried.
#[test]
fn netfilter_rules_in_the_namespace_are_found_by_backend_table_and_chain() {
    use crust_podnet::netfilter::{carry, inspect};
    let pod = Pod::new("f");
    let ns = NetNs::open(&pod.path()).unwrap();
    assert_eq!(inspect(&ns).unwrap(), vec![], "a new namespace");
    // Listing makes empty tables in both iptables backends.
    inside_ns(&pod, "iptables-legacy", &["-t", "nat", "-L", "-n"]);
    inside_ns(&pod, "iptables-nft", &["-t", "filter", "-L", "-n"]);
    // The guard's own table is not the namespace's rules.
    let taps = attach(
        &ns,
        &scan(&ns).unwrap(),
        &GuestNet::default(),
        1,
        AntiSpoof::On,
    )
    .unwrap();
    assert_eq!(inspect(&ns).unwrap(), vec![], "empty tables and the guard");
    drop(taps);
    detach(&ns, &["eth0".to_string()]).unwrap();

    inside_ns(
        &pod,
        "iptables-nft",
        &[
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-p",
            "tcp",
            "-j",
            "REDIRECT",
            "--to-ports",
            "15001",
        ],
    );
    // What `guest` mode carries: iptables-nft's rules, restorable.
    let carried = carry(&ns, &inspect(&ns).unwrap()).unwrap();
    assert!(
        carried
            .ipv4
            .contains("-A PREROUTING -p tcp -j REDIRECT --to-ports 15001")
            && carried.ipv4.contains("COMMIT"),
        "{carried:?}"
    );
    assert!(carried.ipv6.is_empty(), "{carried:?}");
    inside_ns(&pod, "iptables-legacy", &["-P", "OUTPUT", "DROP"]);
    let both = carry(&ns, &inspect(&ns).unwrap()).unwrap_err().to_string();
    assert!(both.contains("both iptables backends"), "{both}");
    inside_ns(
        &pod,
        "ip6tables-legacy",
        &["-A", "INPUT", "-p", "tcp", "-j", "DROP"],
    );
    inside_ns(
        &pod,
        "nft",
        &[
            "add table inet mesh; add chain inet mesh out { type filter hook output priority 0; policy drop; }",
        ],
    );
    let not_iptables: Vec<_> = inspect(&ns)
        .unwrap()
        .into_iter()
        .filter(|f| f.backend != "nftables" || f.table == "inet mesh")
        .filter(|f| f.backend != "iptables-legacy")
        .collect();
    let native = carry(&ns, &not_iptables).unwrap_err().to_string();
    assert!(
        native.contains("inet mesh out") && native.contains("native nftables"),
        "{native}"
    );
    let found: Vec<String> = inspect(&ns)
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        found,
        [
            "nftables inet mesh out: policy drop",
            "nftables ip nat PREROUTING: 1 rule",
            "iptables-legacy filter OUTPUT: policy DROP",
            "ip6tables-legacy filter INPUT: 1 rule",
        ]
    );
}
