//! What CNI made in the pod's namespace, read over netlink.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crust_agent_proto::network::format_mac;
use crust_agent_proto::{
    ConfigureNetwork, NetAddress, NetInterface, NetNeighbour, NetRoute, RouteScope,
};
use futures::TryStreamExt;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkInfo, LinkLayerType, LinkMessage};
use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourState};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteProtocol, RouteScope as NlScope, RouteType,
};
use netlink_packet_route::tc::{TcHandle, TcMessage};
use rtnetlink::RouteMessageBuilder;

use crate::{NetError, NetNs};

/// One interface to mirror into the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodLink {
    pub name: String,
    pub index: u32,
    /// `veth`, `macvlan`, ... (empty when the kernel says none).
    pub kind: String,
    /// All zeros when the interface has no Ethernet address.
    pub mac: [u8; 6],
    pub mtu: u32,
    /// `ARPHRD_*`: only Ethernet frames cross a tap.
    pub link_type: LinkLayerType,
    /// The master (bridge, bond, VRF...) this interface is a port of.
    pub master: Option<String>,
    /// Ports enslaved to this interface.
    pub ports: Vec<String>,
    /// It already has an ingress (or clsact) qdisc: tc's ingress hook,
    /// which the redirect needs, belongs to someone else.
    pub ingress_taken: bool,
}

/// The namespace's interfaces and the guest's view of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodNetwork {
    pub links: Vec<PodLink>,
    pub config: ConfigureNetwork,
    /// (interface, table) of routes outside the main table (policy
    /// routing, VRFs): the guest gets the main table only.
    pub other_tables: Vec<(String, u32)>,
}

impl PodNetwork {
    /// A namespace with only `lo`: the guest gets only `lo` too.
    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }
}

/// Reads the namespace. Interfaces that are down with no address (the
/// kernel's own `tunl0`, `sit0`...) are not the pod's. Only reads:
/// whether the guest can take what it found is [`crate::check`]'s call.
pub fn scan(ns: &NetNs) -> Result<PodNetwork, NetError> {
    ns.netlink(|h| async move {
        let links: Vec<LinkMessage> = h
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(NetError::netlink("listing links"))?;
        let addrs: Vec<_> = h
            .address()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(NetError::netlink("listing addresses"))?;
        let mut routes: Vec<_> = h
            .route()
            .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
            .execute()
            .try_collect()
            .await
            .map_err(NetError::netlink("listing IPv4 routes"))?;
        let v6: Vec<_> = h
            .route()
            .get(RouteMessageBuilder::<Ipv6Addr>::new().build())
            .execute()
            .try_collect()
            .await
            .map_err(NetError::netlink("listing IPv6 routes"))?;
        routes.extend(v6);
        let neighbours: Vec<_> = h
            .neighbours()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(NetError::netlink("listing neighbours"))?;
        let qdiscs: Vec<TcMessage> = h
            .qdisc()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(NetError::netlink("listing qdiscs"))?;
        let ingress: Vec<u32> = qdiscs
            .iter()
            .filter(|q| q.header.parent == TcHandle::INGRESS)
            .map(|q| q.header.index as u32)
            .collect();
        build(&links, &addrs, &routes, &neighbours, &ingress)
    })
}

/// A neighbour entry's IP address and MAC, when it has both.
fn static_neighbour(
    n: &netlink_packet_route::neighbour::NeighbourMessage,
) -> Option<(IpAddr, [u8; 6])> {
    let mut address = None;
    let mut mac = None;
    for a in &n.attributes {
        match a {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)) => {
                address = Some(IpAddr::V4(*ip));
            }
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(ip)) => {
                address = Some(IpAddr::V6(*ip));
            }
            NeighbourAttribute::LinkLayerAddress(m) => {
                mac = <[u8; 6]>::try_from(m.as_slice()).ok();
            }
            _ => {}
        }
    }
    Some((address?, mac?))
}

/// An address message's own address. IPv4: IFA_LOCAL is the interface's
/// own address (IFA_ADDRESS the peer's on point-to-point links).
fn own_address(a: &netlink_packet_route::address::AddressMessage) -> Option<IpAddr> {
    let local = a.attributes.iter().find_map(|x| match x {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    local.or_else(|| {
        a.attributes.iter().find_map(|x| match x {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })
}

fn build(
    links: &[LinkMessage],
    addrs: &[netlink_packet_route::address::AddressMessage],
    routes: &[netlink_packet_route::route::RouteMessage],
    neighbours: &[netlink_packet_route::neighbour::NeighbourMessage],
    ingress: &[u32],
) -> Result<PodNetwork, NetError> {
    let mut by_index: BTreeMap<u32, NetInterface> = BTreeMap::new();
    let mut net = PodNetwork::default();
    for l in links {
        let index = l.header.index;
        let has_addr = addrs.iter().any(|a| a.header.index == index);
        let Some(link) = pod_link(l, links, has_addr, ingress) else {
            continue;
        };
        by_index.insert(
            index,
            NetInterface {
                name: link.name.clone(),
                mac: format_mac(&link.mac),
                mtu: link.mtu,
                addresses: Vec::new(),
            },
        );
        net.links.push(link);
    }
    for a in addrs {
        let Some(iface) = by_index.get_mut(&a.header.index) else {
            continue;
        };
        let Some(address) = own_address(a) else {
            continue;
        };
        // The guest makes its own link-local address from the same MAC.
        if is_link_local(address) {
            continue;
        }
        iface.addresses.push(NetAddress {
            address,
            prefix_len: a.header.prefix_len,
        });
    }
    let mut link_routes = Vec::new();
    let mut via_routes = Vec::new();
    for r in routes {
        let table = r
            .attributes
            .iter()
            .find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            })
            .unwrap_or(u32::from(r.header.table));
        let oif = r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Oif(i) => by_index.get(i),
            _ => None,
        });
        // default (253), main (254) and local (255) are every kernel's.
        if table < 253
            && let Some(iface) = oif
            && !net.other_tables.contains(&(iface.name.clone(), table))
        {
            net.other_tables.push((iface.name.clone(), table));
        }
        let Some(route) = guest_route(&r.header, &r.attributes, &by_index) else {
            continue;
        };
        if route.gateway.is_some() {
            via_routes.push(route);
        } else {
            link_routes.push(route);
        }
    }
    net.config.routes = link_routes.into_iter().chain(via_routes).collect();
    for n in neighbours {
        if n.header.state != NeighbourState::Permanent {
            continue;
        }
        let Some(iface) = by_index.get(&n.header.ifindex) else {
            continue;
        };
        if let Some((address, mac)) = static_neighbour(n) {
            net.config.neighbours.push(NetNeighbour {
                device: iface.name.clone(),
                address,
                mac: format_mac(&mac),
            });
        }
    }
    net.config.interfaces = net
        .links
        .iter()
        .map(|l| by_index.remove(&l.index).expect("indexed above"))
        .collect();
    Ok(net)
}

fn name_of(links: &[LinkMessage], index: u32) -> String {
    links
        .iter()
        .find(|l| l.header.index == index)
        .and_then(|l| {
            l.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(n) => Some(n.clone()),
                _ => None,
            })
        })
        .unwrap_or_else(|| format!("(index {index})"))
}

/// One interface as found, or `None` for loopback and for interfaces that
/// are down with no address.
fn pod_link(
    l: &LinkMessage,
    links: &[LinkMessage],
    has_addr: bool,
    ingress: &[u32],
) -> Option<PodLink> {
    let flags = l.header.flags;
    if flags.contains(LinkFlags::Loopback) || (!flags.contains(LinkFlags::Up) && !has_addr) {
        return None;
    }
    let index = l.header.index;
    let mut name = String::new();
    let (mut mac, mut mtu, mut kind, mut master) = (None, 0, String::new(), None);
    for a in &l.attributes {
        match a {
            LinkAttribute::IfName(n) => name.clone_from(n),
            LinkAttribute::Controller(m) => master = Some(name_of(links, *m)),
            LinkAttribute::Address(m) => mac = <[u8; 6]>::try_from(m.as_slice()).ok(),
            LinkAttribute::Mtu(m) => mtu = *m,
            LinkAttribute::LinkInfo(info) => {
                for i in info {
                    if let LinkInfo::Kind(k) = i {
                        kind = k.to_string();
                    }
                }
            }
            _ => {}
        }
    }
    let ports = links
        .iter()
        .filter(|p| {
            p.attributes
                .iter()
                .any(|a| matches!(a, LinkAttribute::Controller(m) if *m == index))
        })
        .map(|p| name_of(links, p.header.index))
        .collect();
    Some(PodLink {
        name,
        index,
        kind,
        mac: mac.unwrap_or([0; 6]),
        mtu,
        link_type: l.header.link_layer_type,
        master,
        ports,
        ingress_taken: ingress.contains(&index),
    })
}

fn is_link_local(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// A route of the main table the guest needs: not one the kernel makes by
/// itself for an address (`proto kernel`), not link-local or multicast.
fn guest_route(
    h: &RouteHeader,
    attrs: &[RouteAttribute],
    by_index: &BTreeMap<u32, NetInterface>,
) -> Option<NetRoute> {
    if h.table != RouteHeader::RT_TABLE_MAIN
        || h.kind != RouteType::Unicast
        || h.protocol == RouteProtocol::Kernel
    {
        return None;
    }
    let ip = |a: &RouteAddress| match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    };
    let (mut dst, mut gateway, mut source, mut oif, mut metric) = (None, None, None, None, 0);
    for a in attrs {
        match a {
            RouteAttribute::Destination(d) => dst = ip(d),
            RouteAttribute::Gateway(g) => gateway = ip(g),
            RouteAttribute::PrefSource(s) => source = ip(s),
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Priority(p) => metric = *p,
            _ => {}
        }
    }
    let device = by_index.get(&oif?)?.name.clone();
    let destination = dst.unwrap_or(match h.address_family {
        netlink_packet_route::AddressFamily::Inet6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    });
    if is_link_local(destination) || destination.is_multicast() {
        return None;
    }
    let scope = match h.scope {
        NlScope::Link => RouteScope::Link,
        NlScope::Host => RouteScope::Host,
        _ => RouteScope::Universe,
    };
    Some(NetRoute {
        destination,
        prefix_len: h.destination_prefix_length,
        gateway,
        device,
        source,
        scope,
        metric,
    })
}
