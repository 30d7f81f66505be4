//! The pod's network, as the host found it in the pod's network namespace
//! (what CNI made there), for the agent to give the guest the same view:
//! each interface is a virtio-net NIC with the interface's MAC, found in
//! the guest by that MAC.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// Configure the guest's network: `lo` up, then every interface (renamed,
/// MTU, addresses, up), then routes in order, then neighbours. Sent once,
/// before any container starts; the agent refuses a second call.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigureNetwork {
    pub interfaces: Vec<NetInterface>,
    /// In the order they must be added (link routes before the routes
    /// whose gateway they reach).
    pub routes: Vec<NetRoute>,
    pub neighbours: Vec<NetNeighbour>,
    /// The netfilter rules of the pod's namespace, carried into the
    /// guest's (the host's `CRUST_SHIM_NETNS_RULES=guest`): applied after
    /// the interfaces, before any container starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netfilter: Option<GuestRules>,
}

/// iptables rules in `iptables-save` format, per family, for
/// `iptables-restore` in the guest (its nftables backend). Empty: none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestRules {
    pub ipv4: String,
    pub ipv6: String,
}

/// Bound on each family's rules (istio's whole set is about 4 KiB).
pub const MAX_RULES_BYTES: usize = 128 * 1024;

/// One interface CNI made in the pod's namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetInterface {
    /// The name in the pod's namespace (`eth0`, `net1`); the guest's NIC
    /// gets it.
    pub name: String,
    /// `aa:bb:cc:dd:ee:ff`, lower case: the virtio-net NIC's MAC.
    pub mac: String,
    pub mtu: u32,
    pub addresses: Vec<NetAddress>,
}

/// An address with its prefix length. IPv6 ones are added without
/// duplicate address detection (CNI's IPAM already owns them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetAddress {
    pub address: IpAddr,
    pub prefix_len: u8,
}

/// A route of the pod's namespace (main table).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetRoute {
    /// Destination network; `0.0.0.0/0` or `::/0` for a default route.
    pub destination: IpAddr,
    pub prefix_len: u8,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<IpAddr>,
    /// The interface name ([`NetInterface::name`]).
    pub device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<IpAddr>,
    /// `link` (directly reachable) or `universe`.
    pub scope: RouteScope,
    #[serde(default)]
    pub metric: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouteScope {
    Universe,
    Link,
    Host,
}

/// A permanent neighbour entry (some CNI plugins pin the gateway's MAC).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetNeighbour {
    pub device: String,
    pub address: IpAddr,
    pub mac: String,
}

/// What the guest configured, for the host's log.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigureNetworkReply {
    /// Guest interface names, in request order.
    pub interfaces: Vec<String>,
}

/// Checks what the agent would otherwise find out half-way: names,
/// MACs, MTUs, prefix lengths, and that routes and neighbours name a
/// listed interface.
pub fn validate(req: &ConfigureNetwork) -> Result<(), String> {
    let mut names = Vec::new();
    for i in &req.interfaces {
        let ok_name = !i.name.is_empty()
            && i.name.len() < 16
            && i.name != "lo"
            && i.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !ok_name {
            return Err(format!("interface name {:?} is not usable", i.name));
        }
        if names.contains(&i.name.as_str()) {
            return Err(format!("interface {} is listed twice", i.name));
        }
        names.push(&i.name);
        parse_mac(&i.mac).ok_or_else(|| format!("interface {}: MAC {:?}", i.name, i.mac))?;
        if !(68..=65535).contains(&i.mtu) {
            return Err(format!("interface {}: MTU {} out of range", i.name, i.mtu));
        }
        for a in &i.addresses {
            check_prefix(a.address, a.prefix_len)
                .map_err(|e| format!("interface {}: {e}", i.name))?;
        }
    }
    for r in &req.routes {
        check_prefix(r.destination, r.prefix_len).map_err(|e| format!("route: {e}"))?;
        if !names.contains(&r.device.as_str()) {
            return Err(format!(
                "route to {} names unknown interface {:?}",
                r.destination, r.device
            ));
        }
        if let Some(g) = r.gateway
            && g.is_ipv4() != r.destination.is_ipv4()
        {
            return Err(format!(
                "route to {}: gateway {g} of another family",
                r.destination
            ));
        }
    }
    for n in &req.neighbours {
        if !names.contains(&n.device.as_str()) {
            return Err(format!(
                "neighbour {} names unknown interface {:?}",
                n.address, n.device
            ));
        }
        parse_mac(&n.mac).ok_or_else(|| format!("neighbour {}: MAC {:?}", n.address, n.mac))?;
    }
    if let Some(r) = &req.netfilter {
        for (family, text) in [("ipv4", &r.ipv4), ("ipv6", &r.ipv6)] {
            if text.len() > MAX_RULES_BYTES || text.contains('\0') {
                return Err(format!(
                    "netfilter {family} rules: more than {MAX_RULES_BYTES} bytes, or a NUL"
                ));
            }
        }
    }
    Ok(())
}

fn check_prefix(a: IpAddr, len: u8) -> Result<(), String> {
    let max = if a.is_ipv4() { 32 } else { 128 };
    if len > max {
        return Err(format!("{a}/{len}: prefix longer than {max}"));
    }
    Ok(())
}

/// `aa:bb:cc:dd:ee:ff` to bytes.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut out {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
        if !p.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
    }
    parts.next().is_none().then_some(out)
}

/// Bytes to `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eth0() -> NetInterface {
        NetInterface {
            name: "eth0".into(),
            mac: "0a:58:0a:f4:00:05".into(),
            mtu: 1500,
            addresses: vec![NetAddress {
                address: "10.244.0.5".parse().unwrap(),
                prefix_len: 24,
            }],
        }
    }

    #[test]
    fn macs_round_trip_and_bad_ones_are_refused() {
        let m = parse_mac("0a:58:0A:f4:00:05").unwrap();
        assert_eq!(format_mac(&m), "0a:58:0a:f4:00:05");
        for bad in [
            "",
            "0a:58:0a:f4:00",
            "0a:58:0a:f4:00:05:06",
            "+a:58:0a:f4:00:05",
            "0a5:8:0a:f4:00:05",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }

    #[test]
    fn validation_names_what_is_wrong() {
        let mut req = ConfigureNetwork {
            interfaces: vec![eth0()],
            routes: vec![NetRoute {
                destination: "0.0.0.0".parse().unwrap(),
                prefix_len: 0,
                gateway: Some("10.244.0.1".parse().unwrap()),
                device: "eth0".into(),
                source: None,
                scope: RouteScope::Universe,
                metric: 0,
            }],
            neighbours: vec![],
            netfilter: None,
        };
        validate(&req).unwrap();
        req.routes[0].gateway = Some("fe80::1".parse().unwrap());
        assert!(validate(&req).unwrap_err().contains("another family"));
        req.routes[0].gateway = None;
        req.routes[0].device = "eth9".into();
        assert!(validate(&req).unwrap_err().contains("eth9"));
        req.routes.clear();
        req.interfaces[0].mtu = 10;
        assert!(validate(&req).unwrap_err().contains("MTU"));
        req.interfaces[0].mtu = 1500;
        req.interfaces[0].addresses[0].prefix_len = 33;
        assert!(validate(&req).unwrap_err().contains("prefix"));
        req.interfaces = vec![eth0(), eth0()];
        assert!(validate(&req).unwrap_err().contains("twice"));
        req.interfaces = vec![NetInterface {
            name: "lo".into(),
            ..eth0()
        }];
        assert!(validate(&req).is_err());
    }

    #[test]
    fn carried_rules_are_bounded() {
        let mut req = ConfigureNetwork {
            netfilter: Some(GuestRules {
                ipv4: "*nat\nCOMMIT\n".into(),
                ipv6: String::new(),
            }),
            ..Default::default()
        };
        assert_eq!(validate(&req), Ok(()));
        req.netfilter.as_mut().unwrap().ipv6 = "x".repeat(MAX_RULES_BYTES + 1);
        assert!(validate(&req).unwrap_err().contains("ipv6"));
        req.netfilter.as_mut().unwrap().ipv6 = "*filter\0".into();
        assert!(validate(&req).unwrap_err().contains("NUL"));
        // Absent from the wire when there are none (older agents).
        let json = serde_json::to_string(&ConfigureNetwork::default()).unwrap();
        assert!(!json.contains("netfilter"), "{json}");
    }
}
