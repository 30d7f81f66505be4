//! The agent's network module (issue 26) on the host, each test in a fresh
//! network namespace of its own thread (it ends with the thread): veth
//! links stand in for the guest's virtio-net NICs, found by MAC, and
//! iproute2's JSON output is the observer. Root only. Budget: < 2 s.

use crust_agent::network::Network;
use crust_agent_proto::{
    AgentError, ConfigureNetwork, ErrorCode, NetAddress, NetInterface, NetNeighbour, NetRoute,
    RouteScope,
};
use crust_testkit::ip;
use serde_json::Value;

const MAC_A: &str = "02:00:00:00:00:0a";
const MAC_B: &str = "02:00:00:00:00:0b";

/// Runs `f` on a thread in a new network namespace.
fn in_netns(f: impl FnOnce() + Send + 'static) {
    crust_testkit::require_root();
    std::thread::spawn(move || {
        crust_sys::ns::unshare(rustix::thread::UnshareFlags::NEWNET)
            .expect("unshare(CLONE_NEWNET)");
        f();
    })
    .join()
    .unwrap_or_else(|p| std::panic::resume_unwind(p));
}

fn ipj(args: &[&str]) -> Value {
    let mut a = vec!["-j"];
    a.extend_from_slice(args);
    serde_json::from_str(&ip(&a)).unwrap()
}

/// A veth standing for a NIC (its peer up, so it has a carrier).
fn nic(name: &str, mac: &str) {
    let peer = format!("{name}p");
    ip(&[
        "link", "add", name, "address", mac, "type", "veth", "peer", "name", &peer,
    ]);
    ip(&["link", "set", &peer, "up"]);
}

fn addr(a: &str, len: u8) -> NetAddress {
    NetAddress {
        address: a.parse().unwrap(),
        prefix_len: len,
    }
}

fn route(dst: &str, len: u8, via: Option<&str>, dev: &str, scope: RouteScope) -> NetRoute {
    NetRoute {
        destination: dst.parse().unwrap(),
        prefix_len: len,
        gateway: via.map(|g| g.parse().unwrap()),
        device: dev.into(),
        source: None,
        scope,
        metric: 0,
    }
}

fn pod_network() -> ConfigureNetwork {
    ConfigureNetwork {
        interfaces: vec![
            NetInterface {
                name: "eth0".into(),
                mac: MAC_A.into(),
                mtu: 1400,
                addresses: vec![addr("10.88.0.5", 16), addr("fd00:88::5", 64)],
            },
            NetInterface {
                name: "net1".into(),
                mac: MAC_B.into(),
                mtu: 1450,
                addresses: vec![addr("192.168.50.7", 24)],
            },
        ],
        routes: vec![
            route(
                "0.0.0.0",
                0,
                Some("10.88.0.1"),
                "eth0",
                RouteScope::Universe,
            ),
            route("::", 0, Some("fd00:88::1"), "eth0", RouteScope::Universe),
            // Listed before the link route its gateway needs.
            route(
                "10.99.0.0",
                16,
                Some("172.30.0.1"),
                "net1",
                RouteScope::Universe,
            ),
            route("172.30.0.1", 32, None, "net1", RouteScope::Link),
        ],
        neighbours: vec![NetNeighbour {
            device: "eth0".into(),
            address: "10.88.0.1".parse().unwrap(),
            mac: "02:00:00:00:00:99".into(),
        }],
        netfilter: None,
    }
}

fn link(name: &str) -> Value {
    ipj(&["link", "show", "dev", name])[0].clone()
}

fn flags(v: &Value) -> Vec<String> {
    serde_json::from_value(v["flags"].clone()).unwrap()
}

#[test]
fn nics_found_by_mac_get_the_pods_interfaces_routes_and_neighbours() {
    in_netns(|| {
        // The guest named them in the other order: eth0 holds net1's MAC.
        nic("eth0", MAC_B);
        nic("enp0s3", MAC_A);
        // Up: the kernel renames only a link that is down.
        ip(&["link", "set", "enp0s3", "up"]);
        let net = Network::default();
        let reply = net.configure(&pod_network()).expect("configure");
        assert_eq!(reply.interfaces, ["eth0", "net1"]);

        assert!(flags(&link("lo")).contains(&"UP".to_string()));
        for (name, mac, mtu) in [("eth0", MAC_A, 1400), ("net1", MAC_B, 1450)] {
            let l = link(name);
            assert_eq!(l["address"], mac, "{l}");
            assert_eq!(l["mtu"], mtu, "{l}");
            assert!(flags(&l).contains(&"UP".to_string()), "{l}");
        }
        let names: Vec<Value> = ipj(&["link"])
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["ifname"].clone())
            .collect();
        assert!(!names.contains(&"enp0s3".into()), "{names:?}");

        let addrs = ipj(&["addr", "show", "dev", "eth0"])[0]["addr_info"].clone();
        let find = |a: &str| {
            addrs
                .as_array()
                .unwrap()
                .iter()
                .find(|i| i["local"] == a)
                .cloned()
                .unwrap_or_else(|| panic!("{a} not on eth0: {addrs}"))
        };
        assert_eq!(find("10.88.0.5")["prefixlen"], 16);
        let v6 = find("fd00:88::5");
        assert_eq!(v6["prefixlen"], 64);
        assert!(v6.get("tentative").is_none(), "DAD ran: {v6}");
        for key in ["accept_ra", "accept_dad"] {
            let p = format!("/proc/sys/net/ipv6/conf/eth0/{key}");
            assert_eq!(std::fs::read_to_string(&p).unwrap().trim(), "0", "{p}");
        }

        let def = ipj(&["route", "show", "default"]);
        assert_eq!(def[0]["gateway"], "10.88.0.1", "{def}");
        assert_eq!(def[0]["dev"], "eth0", "{def}");
        let def6 = ipj(&["-6", "route", "show", "default"]);
        assert_eq!(def6[0]["gateway"], "fd00:88::1", "{def6}");
        let far = ipj(&["route", "show", "10.99.0.0/16"]);
        assert_eq!(far[0]["gateway"], "172.30.0.1", "{far}");
        assert_eq!(far[0]["dev"], "net1", "{far}");

        let n = ipj(&["neigh", "show", "10.88.0.1", "dev", "eth0"]);
        assert_eq!(n[0]["lladdr"], "02:00:00:00:00:99", "{n}");
        assert_eq!(n[0]["state"], serde_json::json!(["PERMANENT"]), "{n}");

        // Once per pod: the same request again answers the same, another
        // is refused.
        assert_eq!(net.configure(&pod_network()).unwrap(), reply);
        let mut other = pod_network();
        other.interfaces[0].mtu = 1500;
        let e = AgentError::from(net.configure(&other).unwrap_err());
        assert_eq!(e.code, ErrorCode::FailedPrecondition, "{e}");
        assert_eq!(link("eth0")["mtu"], 1400);
    });
}

/// Links, addresses, routes and neighbours as iproute2 shows them.
fn snapshot() -> String {
    ["link", "addr", "route", "neigh"]
        .iter()
        .map(|w| ip(&["-d", "-j", w]))
        .chain([ip(&["-6", "-j", "route"])])
        .collect()
}

#[test]
fn bad_input_changes_nothing_and_names_the_cause() {
    in_netns(|| {
        nic("eth0", MAC_A);
        nic("net1", "02:00:00:00:00:0c");
        let before = snapshot();
        let net = Network::default();
        let fail = |req: ConfigureNetwork| AgentError::from(net.configure(&req).unwrap_err());

        let mut r = pod_network();
        r.interfaces[0].addresses[0].prefix_len = 33;
        let e = fail(r);
        assert_eq!(e.code, ErrorCode::InvalidArgument, "{e}");
        assert!(e.message.contains("10.88.0.5/33"), "{e}");

        let mut r = pod_network();
        r.routes[0].device = "eth7".into();
        let e = fail(r);
        assert_eq!(e.code, ErrorCode::InvalidArgument, "{e}");
        assert!(e.message.contains("eth7"), "{e}");

        // No NIC has MAC_B (the virtio_net module missing looks the same).
        let e = fail(pod_network());
        assert_eq!(e.code, ErrorCode::NotFound, "{e}");
        assert!(e.message.contains(MAC_B), "{e}");

        // net1 is held by a link the request does not name.
        let mut r = pod_network();
        r.interfaces.truncate(1);
        r.interfaces[0].name = "net1".into();
        r.routes.clear();
        r.neighbours.clear();
        let e = fail(r);
        assert_eq!(e.code, ErrorCode::FailedPrecondition, "{e}");
        assert!(e.message.contains("net1"), "{e}");

        // Beyond what the NIC takes (veth: 65535) is refused by validate;
        // below the NIC's minimum (veth: 68) too.
        let mut r = pod_network();
        r.interfaces[0].mtu = 67;
        assert_eq!(fail(r).code, ErrorCode::InvalidArgument);

        assert_eq!(
            snapshot(),
            before,
            "a refused request changed the namespace"
        );

        // And nothing was recorded: a good request still goes through.
        let mut r = pod_network();
        r.interfaces.truncate(1);
        r.routes.truncate(2);
        net.configure(&r)
            .expect("a good request after refused ones");
        assert_eq!(link("eth0")["mtu"], 1400);
    });
}

#[test]
fn an_empty_request_brings_up_lo_alone() {
    in_netns(|| {
        nic("eth0", MAC_A);
        Network::default()
            .configure(&ConfigureNetwork::default())
            .unwrap();
        assert!(flags(&link("lo")).contains(&"UP".to_string()));
        let lo = ipj(&["addr", "show", "dev", "lo"])[0]["addr_info"].clone();
        assert!(lo.to_string().contains("127.0.0.1"), "{lo}");
        assert!(!flags(&link("eth0")).contains(&"UP".to_string()));
    });
}

#[test]
fn a_request_that_failed_part_way_can_be_repeated_not_changed() {
    in_netns(|| {
        nic("eth0", MAC_A);
        let mut req = pod_network();
        req.interfaces.truncate(1);
        // A gateway no route reaches: the NIC is configured, then this fails.
        req.routes = vec![route(
            "10.99.0.0",
            16,
            Some("172.31.0.1"),
            "eth0",
            RouteScope::Universe,
        )];
        req.neighbours.clear();
        let net = Network::default();
        let e = AgentError::from(net.configure(&req).unwrap_err());
        assert_eq!(e.code, ErrorCode::Internal, "{e}");
        assert!(e.message.contains("172.31.0.1"), "{e}");
        assert_eq!(link("eth0")["mtu"], 1400);

        let mut other = req.clone();
        other.routes.clear();
        let e = AgentError::from(net.configure(&other).unwrap_err());
        assert_eq!(e.code, ErrorCode::FailedPrecondition, "{e}");

        // Once the gateway is reachable, the same request goes through
        // again over what the first attempt left.
        ip(&["route", "add", "172.31.0.0/16", "dev", "eth0"]);
        net.configure(&req).expect("the same request again");
        let far = ipj(&["route", "show", "10.99.0.0/16"]);
        assert_eq!(far[0]["gateway"], "172.31.0.1", "{far}");
        let addrs = ipj(&["addr", "show", "dev", "eth0"])[0]["addr_info"].clone();
        assert_eq!(
            addrs
                .as_array()
                .unwrap()
                .iter()
                .filter(|a| a["local"] == "10.88.0.5")
                .count(),
            1,
            "{addrs}"
        );
    });
}
