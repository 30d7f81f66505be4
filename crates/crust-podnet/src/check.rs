//! Whether the guest can take what CNI made: the one check every attach
//! runs before it changes anything in the pod's namespace, so a refused
//! pod leaves the namespace exactly as CNI made it.

use std::net::IpAddr;
use std::ops::RangeInclusive;

use crust_agent_proto::NetInterface;
use netlink_packet_route::link::LinkLayerType;

use crate::{NetError, PodLink, PodNetwork};

/// The MTUs a virtio-net NIC takes: Linux's `ETH_MIN_MTU` up to QEMU's
/// 16-bit `host_mtu`.
pub const VIRTIO_NET_MTU: RangeInclusive<u32> = 68..=65535;
/// Below this an interface cannot carry IPv6 (RFC 8200; Linux turns IPv6
/// off on it).
pub const IPV6_MIN_MTU: u32 = 1280;

/// What the guest's kernel and NIC can take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestNet {
    pub mtu: RangeInclusive<u32>,
    pub ipv4: bool,
    pub ipv6: bool,
}

impl Default for GuestNet {
    /// Debian's cloud kernel (IPv4 and IPv6 built in) behind virtio-net.
    fn default() -> Self {
        GuestNet {
            mtu: VIRTIO_NET_MTU,
            ipv4: true,
            ipv6: true,
        }
    }
}

impl GuestNet {
    /// From the guest kernel's `.config`: a family is there when built
    /// in (`=y`); the image loads no protocol modules.
    pub fn from_kernel_config(config: &str) -> GuestNet {
        let built_in = |key: &str| config.lines().any(|l| l.trim() == format!("{key}=y"));
        GuestNet {
            mtu: VIRTIO_NET_MTU,
            ipv4: built_in("CONFIG_INET"),
            ipv6: built_in("CONFIG_IPV6"),
        }
    }
}

/// Why the guest cannot take an interface, one variant per cause (the
/// interface's name is [`NetError::Refused`]'s).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "a {kind} interface of link type {link_type}: it carries no Ethernet frames, \
         which a VM's NIC cannot mirror"
    )]
    NotEthernet { kind: String, link_type: String },
    #[error("a {kind} interface with ports ({ports}): a VM's NIC cannot mirror a master")]
    Master { kind: String, ports: String },
    #[error("a port of {master}: its traffic is the master's, which a VM's NIC cannot mirror")]
    Port { master: String },
    #[error("already has an ingress qdisc: crust's redirect needs tc's ingress hook")]
    IngressTaken,
    #[error(
        "routes in table {table} (policy routing or a VRF): the guest gets the main table only"
    )]
    OtherTable { table: u32 },
    #[error("MTU {mtu}: the guest's virtio-net NIC takes {min} to {max}")]
    Mtu { mtu: u32, min: u32, max: u32 },
    #[error("MTU {mtu} is below IPv6's {IPV6_MIN_MTU}, and it has IPv6 address {address}")]
    MtuTooSmallForIpv6 { mtu: u32, address: IpAddr },
    #[error("{what} {address}: the guest kernel has no {family}")]
    Family {
        what: &'static str,
        address: String,
        family: &'static str,
    },
}

/// Refuses, naming the interface and the reason, what the guest cannot
/// take: an interface whose frames are not Ethernet, a master (bridge,
/// bond, VRF) or one of its ports, one whose tc ingress hook is already
/// someone else's, routes outside the main table, an MTU out of the NIC's
/// range (or too small for its IPv6 addresses), an address family the
/// guest kernel lacks; then what the agent would refuse.
pub fn check(net: &PodNetwork, guest: &GuestNet) -> Result<(), NetError> {
    for (link, iface) in net.links.iter().zip(&net.config.interfaces) {
        check_link(link, iface, net, guest).map_err(|reason| NetError::Refused {
            name: link.name.clone(),
            reason,
        })?;
    }
    for r in &net.config.routes {
        let (family, has) = family_of(r.destination, guest);
        if !has {
            return Err(NetError::Refused {
                name: r.device.clone(),
                reason: Refusal::Family {
                    what: "route to",
                    address: format!("{}/{}", r.destination, r.prefix_len),
                    family,
                },
            });
        }
    }
    crust_agent_proto::network::validate(&net.config)
        .map_err(|reason| NetError::interface("(pod network)", reason))
}

fn family_of(a: IpAddr, guest: &GuestNet) -> (&'static str, bool) {
    if a.is_ipv4() {
        ("IPv4", guest.ipv4)
    } else {
        ("IPv6", guest.ipv6)
    }
}

fn check_link(
    link: &PodLink,
    iface: &NetInterface,
    net: &PodNetwork,
    guest: &GuestNet,
) -> Result<(), Refusal> {
    let kind = if link.kind.is_empty() {
        "device".to_string()
    } else {
        link.kind.clone()
    };
    if link.link_type != LinkLayerType::Ether || link.mac == [0; 6] {
        return Err(Refusal::NotEthernet {
            kind,
            link_type: format!("{:?}", link.link_type),
        });
    }
    if !link.ports.is_empty() {
        return Err(Refusal::Master {
            kind,
            ports: link.ports.join(", "),
        });
    }
    if let Some(master) = &link.master {
        return Err(Refusal::Port {
            master: master.clone(),
        });
    }
    if link.ingress_taken {
        return Err(Refusal::IngressTaken);
    }
    if let Some((_, table)) = net.other_tables.iter().find(|(d, _)| *d == link.name) {
        return Err(Refusal::OtherTable { table: *table });
    }
    if !guest.mtu.contains(&link.mtu) {
        return Err(Refusal::Mtu {
            mtu: link.mtu,
            min: *guest.mtu.start(),
            max: *guest.mtu.end(),
        });
    }
    for a in &iface.addresses {
        let (family, has) = family_of(a.address, guest);
        if !has {
            return Err(Refusal::Family {
                what: "address",
                address: a.address.to_string(),
                family,
            });
        }
        if a.address.is_ipv6() && link.mtu < IPV6_MIN_MTU {
            return Err(Refusal::MtuTooSmallForIpv6 {
                mtu: link.mtu,
                address: a.address,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_agent_proto::{ConfigureNetwork, NetAddress};

    fn pod(mtu: u32, addrs: &[&str]) -> PodNetwork {
        PodNetwork {
            links: vec![PodLink {
                name: "eth0".into(),
                index: 2,
                kind: "veth".into(),
                mac: [0x0a, 0x58, 10, 88, 0, 5],
                mtu,
                link_type: LinkLayerType::Ether,
                master: None,
                ports: Vec::new(),
                ingress_taken: false,
            }],
            config: ConfigureNetwork {
                interfaces: vec![NetInterface {
                    name: "eth0".into(),
                    mac: "0a:58:0a:58:00:05".into(),
                    mtu,
                    addresses: addrs
                        .iter()
                        .map(|a| {
                            let (ip, len) = a.split_once('/').unwrap();
                            NetAddress {
                                address: ip.parse().unwrap(),
                                prefix_len: len.parse().unwrap(),
                            }
                        })
                        .collect(),
                }],
                ..Default::default()
            },
            other_tables: Vec::new(),
        }
    }

    fn refusal(net: &PodNetwork, guest: &GuestNet) -> String {
        check(net, guest).unwrap_err().to_string()
    }

    #[test]
    fn a_cni_bridge_pod_passes() {
        let net = pod(1500, &["10.88.0.5/24", "fd00:88::5/64"]);
        check(&net, &GuestNet::default()).unwrap();
        check(&pod(65535, &["10.88.0.5/24"]), &GuestNet::default()).unwrap();
    }

    #[test]
    fn mtus_the_guest_cannot_take_are_named() {
        let guest = GuestNet::default();
        let e = refusal(&pod(65536, &["10.88.0.5/24"]), &guest);
        assert!(
            e.contains("eth0") && e.contains("MTU 65536") && e.contains("65535"),
            "{e}"
        );
        let e = refusal(&pod(60, &[]), &guest);
        assert!(e.contains("eth0") && e.contains("MTU 60"), "{e}");
        let e = refusal(&pod(1200, &["fd00:88::5/64"]), &guest);
        assert!(e.contains("eth0") && e.contains("below IPv6's 1280"), "{e}");
        // A guest NIC capped lower than the host's interface.
        let small = GuestNet {
            mtu: 68..=1500,
            ..GuestNet::default()
        };
        let e = refusal(&pod(9000, &["10.88.0.5/24"]), &small);
        assert!(e.contains("MTU 9000") && e.contains("68 to 1500"), "{e}");
    }

    #[test]
    fn a_family_the_guest_kernel_lacks_is_named() {
        let config = "CONFIG_INET=y\n# CONFIG_IPV6 is not set\nCONFIG_IPV6_SIT=m\n";
        let v4_only = GuestNet::from_kernel_config(config);
        assert_eq!((v4_only.ipv4, v4_only.ipv6), (true, false));
        let e = refusal(&pod(1500, &["10.88.0.5/24", "fd00:88::5/64"]), &v4_only);
        assert!(
            e.contains("eth0") && e.contains("fd00:88::5") && e.contains("no IPv6"),
            "{e}"
        );
        check(&pod(1500, &["10.88.0.5/24"]), &v4_only).unwrap();
        // A module the image never loads does not count.
        let m = GuestNet::from_kernel_config("CONFIG_INET=y\nCONFIG_IPV6=m\n");
        assert!(!m.ipv6);
        let debian = GuestNet::from_kernel_config("CONFIG_INET=y\nCONFIG_IPV6=y\n");
        assert_eq!(debian, GuestNet::default());
    }

    #[test]
    fn what_no_nic_can_mirror_is_named() {
        let guest = GuestNet::default();
        let mut net = pod(1500, &["10.88.0.5/24"]);
        net.links[0].link_type = LinkLayerType::None;
        net.links[0].kind = "tun".into();
        let e = refusal(&net, &guest);
        assert!(
            e.contains("eth0") && e.contains("tun") && e.contains("Ethernet"),
            "{e}"
        );
        let mut net = pod(1500, &["10.88.0.5/24"]);
        net.links[0].master = Some("vrf-blue".into());
        assert!(refusal(&net, &guest).contains("port of vrf-blue"));
        let mut net = pod(1500, &["10.88.0.5/24"]);
        net.links[0].kind = "bridge".into();
        net.links[0].ports = vec!["veth1".into()];
        let e = refusal(&net, &guest);
        assert!(e.contains("bridge") && e.contains("veth1"), "{e}");
        let mut net = pod(1500, &["10.88.0.5/24"]);
        net.links[0].ingress_taken = true;
        assert!(refusal(&net, &guest).contains("ingress qdisc"));
        let mut net = pod(1500, &["10.88.0.5/24"]);
        net.other_tables = vec![("eth0".into(), 100)];
        assert!(refusal(&net, &guest).contains("table 100"));
        // The cause is a variant, the interface beside it.
        assert!(matches!(
            check(&net, &guest),
            Err(NetError::Refused { name, reason: Refusal::OtherTable { table: 100 } }) if name == "eth0"
        ));
    }
}
