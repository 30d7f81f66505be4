//! Anti-spoofing between the guest and the pod's interfaces (issue 42).
//!
//! Under runc only a container holding NET_RAW forges frames; in a VM the
//! guest kernel is the attacker's as soon as anything in the pod is, so
//! every frame the guest sends is checked before it reaches CNI's
//! interface: its source MAC is the interface's, an ARP's sender is one
//! of the interface's IPv4 addresses (or 0.0.0.0, a probe), an IP
//! packet's source is one of its addresses (IPv6 also `::` for DAD and
//! link-local), and no router advertisement, redirect, or neighbour
//! advertisement for another's address leaves (the IPv6 forms of the same
//! attack). Anything but IPv4, IPv6 and ARP (VLAN tags included) is
//! dropped. Each drop is counted by interface and reason.
//!
//! Where: an nftables `netdev` table in the pod's namespace whose chain
//! sits on each tap's **ingress** hook, checks and, last, `fwd`s the frame
//! to the interface. The tc redirect that joins the other direction
//! cannot carry the checks: this kernel has no drop action (`act_gact`,
//! police) nor flower/matchall, and netfilter's egress hook does not see
//! frames tc redirected from an ingress (measured: a forged ARP passed an
//! egress chain on the pod's interface untouched). With the guard the
//! tap therefore has no tc redirect; nftables' own `fwd` forwards.

use std::net::IpAddr;

use crate::nft;
use crate::{NetError, NetNs};

/// The table's name in the pod's namespace (netdev family).
pub const GUARD_TABLE: &str = "crust_guard";

/// Why a frame was dropped: the counters' suffixes.
pub const REASONS: [&str; 6] = ["mac", "arp", "ipv4", "ipv6", "nd", "other"];

/// One interface to guard: the tap the guest writes to, the interface
/// it reaches, and what the guest may claim there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guarded {
    pub tap: String,
    pub link: String,
    pub mac: [u8; 6],
    pub addresses: Vec<IpAddr>,
}

/// Frames dropped on one interface for one reason, as counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    pub interface: String,
    pub reason: &'static str,
    pub packets: u64,
    pub bytes: u64,
}

fn mac_text(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn set(items: impl IntoIterator<Item = String>) -> String {
    format!("{{ {} }}", items.into_iter().collect::<Vec<_>>().join(", "))
}

/// The whole table as an `nft -f` script: replaces any table of that
/// name (a dead shim's), so applying it twice leaves one.
pub fn ruleset(links: &[Guarded]) -> String {
    let mut s = format!(
        "table netdev {GUARD_TABLE}\ndelete table netdev {GUARD_TABLE}\n\
         table netdev {GUARD_TABLE} {{\n"
    );
    for i in 0..links.len() {
        for r in REASONS {
            s.push_str(&format!("  counter l{i}_{r} {{}}\n"));
        }
    }
    for (i, g) in links.iter().enumerate() {
        let mac = mac_text(&g.mac);
        let drop = |reason: &str| format!("counter name \"l{i}_{reason}\" drop");
        let v4: Vec<String> = g
            .addresses
            .iter()
            .filter(|a| a.is_ipv4())
            .map(|a| a.to_string())
            .collect();
        let v6: Vec<std::net::Ipv6Addr> = g
            .addresses
            .iter()
            .filter_map(|a| match a {
                IpAddr::V6(a) => Some(*a),
                IpAddr::V4(_) => None,
            })
            .collect();
        let mut rules = vec![
            format!("ether saddr != {mac} {}", drop("mac")),
            format!("arp hlen != 6 {}", drop("arp")),
            format!("arp plen != 4 {}", drop("arp")),
            format!("arp saddr ether != {mac} {}", drop("arp")),
            format!(
                "arp saddr ip != {} {}",
                set(std::iter::once("0.0.0.0".to_string()).chain(v4.iter().cloned())),
                drop("arp")
            ),
        ];
        rules.push(if v4.is_empty() {
            format!("meta protocol ip {}", drop("ipv4"))
        } else {
            format!("ip saddr != {} {}", set(v4.iter().cloned()), drop("ipv4"))
        });
        rules.push(format!(
            "ip6 saddr != {} {}",
            set(["::".to_string(), "fe80::/10".to_string()]
                .into_iter()
                .chain(v6.iter().map(|a| a.to_string()))),
            drop("ipv6")
        ));
        rules.push(format!(
            "icmpv6 type {{ nd-router-advert, nd-redirect }} {}",
            drop("nd")
        ));
        // nft 1.0.6 has no `icmpv6 taddr`: the target is the 128 bits
        // after the ICMPv6 header's first 8 bytes; fe80::/10 is its first
        // 10 bits.
        let own = if v6.is_empty() {
            String::new()
        } else {
            format!(
                " @th,64,128 != {}",
                set(v6.iter().map(|a| format!("0x{:032x}", u128::from(*a))))
            )
        };
        rules.push(format!(
            "icmpv6 type nd-neighbor-advert @th,64,10 != 0x3fa{own} {}",
            drop("nd")
        ));
        rules.push(format!(
            "ether type {{ ip, ip6, arp }} fwd to \"{}\"",
            g.link
        ));
        rules.push(drop("other"));
        s.push_str(&format!(
            "  chain l{i} {{\n    type filter hook ingress device \"{}\" priority 0; policy drop;\n",
            g.tap
        ));
        for r in rules {
            s.push_str(&format!("    {r}\n"));
        }
        s.push_str("  }\n");
    }
    s.push_str("}\n");
    s
}

/// Puts the guard on `links` (their taps exist). A failure leaves no
/// table.
pub fn install(ns: &NetNs, links: &[Guarded]) -> Result<(), NetError> {
    let nft = nft::nft("the guest's frames are checked with nftables")?;
    nft::run_in(ns, &nft, &["-f", "-"], Some(ruleset(links))).map(|_| ())
}

/// Removes the guard's table: idempotent, and a node without `nft` can
/// have made none.
pub fn remove(ns: &NetNs) {
    nft::delete_table(ns, "netdev", GUARD_TABLE, "the anti-spoofing table");
}

/// The guard's drop counters, by interface (`links[i]` is the `i`th
/// guarded interface) and reason. A namespace without the table has none.
pub fn dropped(ns: &NetNs, links: &[String]) -> Result<Vec<Dropped>, NetError> {
    let nft = nft::nft("reading the anti-spoofing counters")?;
    let json = nft::run_in(
        ns,
        &nft,
        &["-j", "list", "counters", "table", "netdev", GUARD_TABLE],
        None,
    )?;
    Ok(parse_counters(&json, links))
}

fn parse_counters(json: &str, links: &[String]) -> Vec<Dropped> {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for o in v["nftables"].as_array().into_iter().flatten() {
        let c = &o["counter"];
        let Some(name) = c["name"].as_str() else {
            continue;
        };
        let Some((link, reason)) = name.strip_prefix('l').and_then(|n| n.split_once('_')) else {
            continue;
        };
        let (Some(interface), Some(reason)) = (
            link.parse::<usize>().ok().and_then(|i| links.get(i)),
            REASONS.iter().find(|r| **r == reason),
        ) else {
            continue;
        };
        out.push(Dropped {
            interface: interface.clone(),
            reason,
            packets: c["packets"].as_u64().unwrap_or(0),
            bytes: c["bytes"].as_u64().unwrap_or(0),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eth0() -> Guarded {
        Guarded {
            tap: "crusttap0".into(),
            link: "eth0".into(),
            mac: [0x02, 0, 0, 0, 0, 0x0a],
            addresses: vec!["10.1.0.2".parse().unwrap(), "fd00::2".parse().unwrap()],
        }
    }

    #[test]
    fn the_ruleset_names_only_the_pods_own_addresses() {
        let s = ruleset(&[eth0()]);
        assert!(s.contains("ether saddr != 02:00:00:00:00:0a"), "{s}");
        assert!(s.contains("arp saddr ip != { 0.0.0.0, 10.1.0.2 }"), "{s}");
        assert!(s.contains("ip saddr != { 10.1.0.2 }"), "{s}");
        assert!(s.contains("ip6 saddr != { ::, fe80::/10, fd00::2 }"), "{s}");
        assert!(
            s.contains("@th,64,128 != { 0xfd000000000000000000000000000002 }"),
            "{s}"
        );
        assert!(s.contains("fwd to \"eth0\""), "{s}");
        assert!(s.contains("device \"crusttap0\""), "{s}");
        // Replacing, so a dead shim's table never doubles the rules.
        assert!(
            s.starts_with("table netdev crust_guard\ndelete table"),
            "{s}"
        );
    }

    #[test]
    fn without_ipv4_every_ipv4_packet_is_dropped() {
        let mut g = eth0();
        g.addresses.retain(IpAddr::is_ipv6);
        let s = ruleset(&[g]);
        assert!(
            s.contains("meta protocol ip counter name \"l0_ipv4\" drop"),
            "{s}"
        );
        assert!(s.contains("arp saddr ip != { 0.0.0.0 }"), "{s}");
    }

    #[test]
    fn counters_are_read_by_interface_and_reason() {
        let json = r#"{"nftables": [{"metainfo": {}},
            {"counter": {"family": "netdev", "name": "l0_arp", "table": "crust_guard", "packets": 3, "bytes": 126}},
            {"counter": {"family": "netdev", "name": "l1_mac", "table": "crust_guard", "packets": 1, "bytes": 60}},
            {"counter": {"family": "netdev", "name": "l7_mac", "table": "crust_guard", "packets": 1, "bytes": 60}},
            {"counter": {"family": "netdev", "name": "l0_what", "table": "crust_guard", "packets": 1, "bytes": 60}}]}"#;
        let d = parse_counters(json, &["eth0".into(), "net1".into()]);
        assert_eq!(d.len(), 2, "{d:?}");
        assert_eq!(
            (d[0].interface.as_str(), d[0].reason, d[0].packets),
            ("eth0", "arp", 3)
        );
        assert_eq!((d[1].interface.as_str(), d[1].reason), ("net1", "mac"));
    }
}
