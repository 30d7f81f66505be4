//! The pod's network in the guest ([`ConfigureNetwork`], issue 26): the
//! host mirrors each interface CNI made in the pod's namespace as a
//! virtio-net NIC with the same MAC; here each NIC is found by that MAC and
//! given the interface's name, MTU, addresses, routes and neighbours.
//!
//! Order: everything that can be checked is checked before the first
//! change (the request, each MAC present once, each MTU within the NIC's
//! limits, no other link holding a wanted name, IPv6 present when asked
//! for), so bad input changes nothing. Then `lo` up; per NIC: down, renamed,
//! MTU, IPv6 router advertisements and duplicate address detection off,
//! addresses (IPv6 `nodad`: CNI's IPAM owns them, and DAD would add about a
//! second to every pod start), up; routes in the given order; permanent
//! neighbours.
//!
//! Once: a pod's network is set before its containers start. A repeat of
//! the same request answers as the first did (the host may retry after a
//! lost reply); a different one is refused. A request that failed half-way
//! can be repeated (every step replaces what it finds), not changed.
//!
//! Netlink over a synchronous socket: the agent serves each request on its
//! own thread and has no async runtime.

use std::net::IpAddr;
use std::sync::Mutex;

use crust_agent_proto::network::{format_mac, parse_mac};
use crust_agent_proto::{
    AgentError, ConfigureNetwork, ConfigureNetworkReply, ErrorCode, NetInterface, NetRoute,
    RouteScope,
};
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkHeader,
    NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::address::{
    AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage, AddressScope,
};
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkMessage};
use netlink_packet_route::neighbour::{NeighbourAttribute, NeighbourMessage, NeighbourState};
use netlink_packet_route::route::{
    RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope as NlScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use rustix::io::Errno;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("invalid network request: {0}")]
    Invalid(String),
    #[error(
        "interface {name}: no guest NIC has MAC {mac} (guest links: {seen}); is the virtio_net module loaded?"
    )]
    NoNic {
        name: String,
        mac: String,
        seen: String,
    },
    #[error("interface {name}: MAC {mac} is on several guest links ({links})")]
    SharedMac {
        name: String,
        mac: String,
        links: String,
    },
    #[error("interface {name}: MTU {mtu} is outside what the guest NIC takes ({min}..={max})")]
    Mtu {
        name: String,
        mtu: u32,
        min: u32,
        max: u32,
    },
    #[error("interface {name}: the guest link {holder} (MAC {mac}) already has that name")]
    NameTaken {
        name: String,
        holder: String,
        mac: String,
    },
    #[error("interface {0}: IPv6 is asked for but the guest kernel has no IPv6")]
    NoIpv6(String),
    #[error(
        "the guest's network was already configured (or a request failed part-way) with different content; it is set once per pod"
    )]
    AlreadyConfigured,
    #[error("{step}: {errno}")]
    Netlink { step: String, errno: Errno },
    #[error("writing {path}: {error}")]
    Sysctl { path: String, error: String },
    /// The pod namespace's rules could not be applied in the guest.
    #[error("netfilter rules from the pod's namespace: {0}")]
    Netfilter(String),
}

impl From<NetError> for AgentError {
    fn from(e: NetError) -> AgentError {
        use NetError::*;
        let code = match &e {
            Invalid(_) | Mtu { .. } => ErrorCode::InvalidArgument,
            NoNic { .. } => ErrorCode::NotFound,
            SharedMac { .. } | NameTaken { .. } | NoIpv6(_) | AlreadyConfigured => {
                ErrorCode::FailedPrecondition
            }
            Netlink { .. } | Sysctl { .. } | Netfilter(_) => ErrorCode::Internal,
        };
        AgentError::new(code, e.to_string())
    }
}

enum State {
    Fresh,
    /// Changes were made and failed part-way.
    Failed(ConfigureNetwork),
    Done(ConfigureNetwork, ConfigureNetworkReply),
}

/// The guest's one network configuration.
pub struct Network {
    state: Mutex<State>,
}

impl Default for Network {
    fn default() -> Self {
        Network {
            state: Mutex::new(State::Fresh),
        }
    }
}

impl Network {
    pub fn configure(&self, req: &ConfigureNetwork) -> Result<ConfigureNetworkReply, NetError> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match &*state {
            State::Done(prev, reply) if prev == req => return Ok(reply.clone()),
            State::Done(..) => return Err(NetError::AlreadyConfigured),
            State::Failed(prev) if prev != req => return Err(NetError::AlreadyConfigured),
            _ => {}
        }
        crust_agent_proto::network::validate(req).map_err(NetError::Invalid)?;
        let mut nl = Rtnl::open()?;
        let links = nl.links()?;
        let plan = preflight(req, &links)?;
        *state = State::Failed(req.clone());
        apply(&mut nl, req, &plan)?;
        if let Some(rules) = &req.netfilter {
            apply_rules(rules)?;
        }
        let reply = ConfigureNetworkReply {
            interfaces: req.interfaces.iter().map(|i| i.name.clone()).collect(),
        };
        *state = State::Done(req.clone(), reply.clone());
        Ok(reply)
    }
}

/// Applies the pod namespace's iptables rules in the guest, each family
/// with `iptables-restore` (the image's nftables backend) after loading
/// the image's netfilter modules. Before any container starts, so no
/// workload ever runs without them.
fn apply_rules(rules: &crust_agent_proto::GuestRules) -> Result<(), NetError> {
    use std::io::Write;
    if rules.ipv4.is_empty() && rules.ipv6.is_empty() {
        return Ok(());
    }
    crate::sys::unpack_payload(crate::modprobe::PAYLOAD).map_err(NetError::Netfilter)?;
    crate::sys::load_module_group("netfilter").map_err(NetError::Netfilter)?;
    for (tool, text) in [
        ("/usr/sbin/iptables-restore", &rules.ipv4),
        ("/usr/sbin/ip6tables-restore", &rules.ipv6),
    ] {
        if text.is_empty() {
            continue;
        }
        let fail = |e: String| NetError::Netfilter(format!("{tool}: {e}"));
        let mut child = std::process::Command::new(tool)
            .arg("-w")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| fail(e.to_string()))?;
        if let Some(mut pipe) = child.stdin.take() {
            pipe.write_all(text.as_bytes())
                .map_err(|e| fail(e.to_string()))?;
        }
        let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
        if !out.status.success() {
            return Err(fail(
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ));
        }
    }
    Ok(())
}

/// A guest link as a dump shows it.
#[derive(Debug)]
struct Link {
    index: u32,
    name: String,
    mac: Option<[u8; 6]>,
    min_mtu: Option<u32>,
    max_mtu: Option<u32>,
    up: bool,
}

/// `lo` and the NIC of each requested interface, in order, as they were.
struct Plan<'a> {
    lo: Option<&'a Link>,
    nics: Vec<&'a Link>,
}

/// Every check that needs the guest's links, before anything changes.
fn preflight<'a>(req: &ConfigureNetwork, links: &'a [Link]) -> Result<Plan<'a>, NetError> {
    let mut nics: Vec<&Link> = Vec::new();
    for i in &req.interfaces {
        let mac = parse_mac(&i.mac).ok_or_else(|| NetError::Invalid(format!("MAC {}", i.mac)))?;
        let found: Vec<&Link> = links.iter().filter(|l| l.mac == Some(mac)).collect();
        let l = match found[..] {
            [l] => l,
            [] => {
                return Err(NetError::NoNic {
                    name: i.name.clone(),
                    mac: i.mac.clone(),
                    seen: describe(links),
                });
            }
            _ => {
                return Err(NetError::SharedMac {
                    name: i.name.clone(),
                    mac: i.mac.clone(),
                    links: found
                        .iter()
                        .map(|l| l.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        };
        if nics.iter().any(|n| n.index == l.index) {
            return Err(NetError::Invalid(format!(
                "interface {}: MAC {} is listed twice",
                i.name, i.mac
            )));
        }
        let (min, max) = (l.min_mtu.unwrap_or(68), l.max_mtu.unwrap_or(u32::MAX));
        if i.mtu < min || (max > 0 && i.mtu > max) {
            return Err(NetError::Mtu {
                name: i.name.clone(),
                mtu: i.mtu,
                min,
                max,
            });
        }
        if i.addresses.iter().any(|a| a.address.is_ipv6()) && !ipv6_present() {
            return Err(NetError::NoIpv6(i.name.clone()));
        }
        nics.push(l);
    }
    // A wanted name held by a link that is not being renamed away.
    for i in &req.interfaces {
        if let Some(h) = links
            .iter()
            .find(|l| l.name == i.name && !nics.iter().any(|n| n.index == l.index))
        {
            return Err(NetError::NameTaken {
                name: i.name.clone(),
                holder: h.name.clone(),
                mac: h.mac.as_ref().map_or("none".into(), format_mac),
            });
        }
    }
    if let Some(r) = req.routes.iter().find(|r| r.destination.is_ipv6())
        && !ipv6_present()
    {
        return Err(NetError::NoIpv6(r.device.clone()));
    }
    Ok(Plan {
        lo: links.iter().find(|l| l.name == "lo"),
        nics,
    })
}

fn describe(links: &[Link]) -> String {
    links
        .iter()
        .map(|l| match &l.mac {
            Some(m) => format!("{} {}", l.name, format_mac(m)),
            None => l.name.clone(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn ipv6_present() -> bool {
    std::path::Path::new("/proc/sys/net/ipv6").exists()
}

fn apply(nl: &mut Rtnl, req: &ConfigureNetwork, plan: &Plan) -> Result<(), NetError> {
    // Each netlink change costs milliseconds in an emulated guest (on a
    // pod's start path): none is made that changes nothing.
    if let Some(lo) = plan.lo.filter(|l| !l.up) {
        nl.set_up(lo.index, true).map_err(step("bringing lo up"))?;
    }
    // A NIC to rename goes down first (the kernel renames only a down
    // link; a fresh guest's NICs are down already), and out of the way
    // under a temporary name when it holds another interface's name: the
    // guest may have named them eth0, eth1 in another order than the pod's.
    let wanted: Vec<&str> = req.interfaces.iter().map(|i| i.name.as_str()).collect();
    for (i, l) in req.interfaces.iter().zip(&plan.nics) {
        if l.up && l.name != i.name {
            nl.set_up(l.index, false)
                .map_err(step(&format!("interface {}: link down", i.name)))?;
        }
        if l.name != i.name && wanted.contains(&l.name.as_str()) {
            let tmp = format!("crusttmp{}", l.index);
            nl.set_link(l.index, vec![LinkAttribute::IfName(tmp)])
                .map_err(step(&format!("interface {}: temporary name", i.name)))?;
        }
    }
    for (i, l) in req.interfaces.iter().zip(&plan.nics) {
        configure_nic(nl, i, l.index)?;
    }
    let nics: Vec<u32> = plan.nics.iter().map(|l| l.index).collect();
    add_routes(nl, &req.routes, &req.interfaces, &nics)?;
    for n in &req.neighbours {
        let index = index_of(&n.device, &req.interfaces, &nics);
        let mut m = NeighbourMessage::default();
        m.header.family = family(n.address);
        m.header.ifindex = index;
        m.header.state = NeighbourState::Permanent;
        m.attributes = vec![
            NeighbourAttribute::Destination(n.address.into()),
            NeighbourAttribute::LinkLayerAddress(parse_mac(&n.mac).unwrap_or_default().to_vec()),
        ];
        nl.change(RouteNetlinkMessage::NewNeighbour(m))
            .map_err(step(&format!("neighbour {} on {}", n.address, n.device)))?;
    }
    Ok(())
}

fn configure_nic(nl: &mut Rtnl, i: &NetInterface, index: u32) -> Result<(), NetError> {
    let what = |s: &str| format!("interface {}: {s}", i.name);
    nl.set_link(
        index,
        vec![
            LinkAttribute::IfName(i.name.clone()),
            LinkAttribute::Mtu(i.mtu),
        ],
    )
    .map_err(step(&what("name and MTU")))?;
    if ipv6_present() {
        // Before any address: RA would add addresses and routes CNI did
        // not; DAD would hold the addresses tentative.
        for key in ["accept_ra", "accept_dad"] {
            let path = format!("/proc/sys/net/ipv6/conf/{}/{key}", i.name);
            std::fs::write(&path, "0").map_err(|e| NetError::Sysctl {
                path,
                error: e.to_string(),
            })?;
        }
    }
    for a in &i.addresses {
        let mut m = AddressMessage::default();
        m.header.family = family(a.address);
        m.header.prefix_len = a.prefix_len;
        m.header.index = index;
        m.header.scope = match a.address {
            IpAddr::V6(v6) if v6.is_unicast_link_local() => AddressScope::Link,
            a if a.is_loopback() => AddressScope::Host,
            _ => AddressScope::Universe,
        };
        m.attributes = vec![
            AddressAttribute::Local(a.address),
            AddressAttribute::Address(a.address),
        ];
        if a.address.is_ipv6() {
            m.header.flags = AddressHeaderFlags::Nodad;
            m.attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        nl.change(RouteNetlinkMessage::NewAddress(m))
            .map_err(step(&what(&format!(
                "address {}/{}",
                a.address, a.prefix_len
            ))))?;
    }
    nl.set_up(index, true).map_err(step(&what("link up")))
}

/// In the given order; a gateway route the kernel finds unreachable waits
/// for the others (a link route listed after it) and is tried again while
/// that makes progress.
fn add_routes(
    nl: &mut Rtnl,
    routes: &[NetRoute],
    interfaces: &[NetInterface],
    nics: &[u32],
) -> Result<(), NetError> {
    let mut pending: Vec<&NetRoute> = routes.iter().collect();
    while !pending.is_empty() {
        let before = pending.len();
        let mut later = Vec::new();
        let mut last = None;
        for r in pending {
            let m = route_message(r, index_of(&r.device, interfaces, nics));
            match nl.change(RouteNetlinkMessage::NewRoute(m)) {
                Ok(()) => {}
                Err(Errno::NETUNREACH) if r.gateway.is_some() => {
                    later.push(r);
                    last = Some(Errno::NETUNREACH);
                }
                Err(e) => return Err(step(&route_name(r))(e)),
            }
        }
        if later.len() == before {
            let r = later[0];
            return Err(step(&route_name(r))(last.unwrap_or(Errno::NETUNREACH)));
        }
        pending = later;
    }
    Ok(())
}

fn route_name(r: &NetRoute) -> String {
    let via = r.gateway.map(|g| format!(" via {g}")).unwrap_or_default();
    format!(
        "route {}/{}{via} dev {}",
        r.destination, r.prefix_len, r.device
    )
}

fn route_message(r: &NetRoute, index: u32) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = family(r.destination);
    m.header.destination_prefix_length = r.prefix_len;
    m.header.table = RouteHeader::RT_TABLE_MAIN;
    m.header.protocol = RouteProtocol::Boot;
    m.header.scope = match r.scope {
        RouteScope::Universe => NlScope::Universe,
        RouteScope::Link => NlScope::Link,
        RouteScope::Host => NlScope::Host,
    };
    m.header.kind = RouteType::Unicast;
    if r.prefix_len > 0 {
        m.attributes
            .push(RouteAttribute::Destination(r.destination.into()));
    }
    if let Some(g) = r.gateway {
        m.attributes.push(RouteAttribute::Gateway(g.into()));
    }
    m.attributes.push(RouteAttribute::Oif(index));
    if let Some(s) = r.source {
        m.attributes.push(RouteAttribute::PrefSource(s.into()));
    }
    if r.metric > 0 {
        m.attributes.push(RouteAttribute::Priority(r.metric));
    }
    m
}

/// validate() made sure every device names a listed interface.
fn index_of(device: &str, interfaces: &[NetInterface], nics: &[u32]) -> u32 {
    interfaces
        .iter()
        .position(|i| i.name == device)
        .map_or(0, |p| nics[p])
}

fn family(a: IpAddr) -> AddressFamily {
    if a.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

fn step(what: &str) -> impl Fn(Errno) -> NetError + '_ {
    move |errno| NetError::Netlink {
        step: what.to_string(),
        errno,
    }
}

/// A route netlink socket: one request at a time, each acknowledged.
struct Rtnl {
    sock: Socket,
    seq: u32,
}

impl Rtnl {
    fn open() -> Result<Rtnl, NetError> {
        let fail = |e: std::io::Error| NetError::Netlink {
            step: "opening a route netlink socket".into(),
            errno: Errno::from_io_error(&e).unwrap_or(Errno::IO),
        };
        let mut sock = Socket::new(NETLINK_ROUTE).map_err(fail)?;
        sock.bind_auto().map_err(fail)?;
        sock.connect(&SocketAddr::new(0, 0)).map_err(fail)?;
        Ok(Rtnl { sock, seq: 0 })
    }

    /// Sends `msg` and reads answers until the kernel says done (a dump)
    /// or acknowledges; returns what it sent back.
    fn call(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<Vec<RouteNetlinkMessage>, Errno> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.seq;
        let mut req = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        req.finalize();
        let mut buf = vec![0; req.buffer_len()];
        req.serialize(&mut buf);
        self.sock.send(&buf, 0).map_err(io_errno)?;
        let mut out = Vec::new();
        loop {
            let (data, _) = self.sock.recv_from_full().map_err(io_errno)?;
            let mut at = 0;
            while at < data.len() {
                let m = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&data[at..])
                    .map_err(|_| Errno::PROTO)?;
                let len = m.header.length as usize;
                if len == 0 {
                    return Err(Errno::PROTO);
                }
                at += (len + 3) & !3;
                if m.header.sequence_number != self.seq {
                    continue;
                }
                match m.payload {
                    NetlinkPayload::Done(_) => return Ok(out),
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(out),
                            Some(c) => Err(Errno::from_raw_os_error(-c.get())),
                        };
                    }
                    NetlinkPayload::InnerMessage(inner) => out.push(inner),
                    _ => {}
                }
            }
        }
    }

    /// A change the kernel acknowledges; replaces what is there already.
    fn change(&mut self, msg: RouteNetlinkMessage) -> Result<(), Errno> {
        self.call(msg, NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE)
            .map(drop)
    }

    fn set_link(&mut self, index: u32, attributes: Vec<LinkAttribute>) -> Result<(), Errno> {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.attributes = attributes;
        self.call(RouteNetlinkMessage::SetLink(m), NLM_F_ACK)
            .map(drop)
    }

    fn set_up(&mut self, index: u32, up: bool) -> Result<(), Errno> {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.header.change_mask = LinkFlags::Up;
        if up {
            m.header.flags = LinkFlags::Up;
        }
        self.call(RouteNetlinkMessage::SetLink(m), NLM_F_ACK)
            .map(drop)
    }

    fn links(&mut self) -> Result<Vec<Link>, NetError> {
        let msgs = self
            .call(
                RouteNetlinkMessage::GetLink(LinkMessage::default()),
                NLM_F_DUMP,
            )
            .map_err(step("listing the guest's links"))?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(link_of(l)),
                _ => None,
            })
            .collect())
    }
}

fn link_of(l: LinkMessage) -> Link {
    let mut link = Link {
        index: l.header.index,
        name: String::new(),
        mac: None,
        min_mtu: None,
        max_mtu: None,
        up: l.header.flags.contains(LinkFlags::Up),
    };
    for a in l.attributes {
        match a {
            LinkAttribute::IfName(n) => link.name = n,
            LinkAttribute::Address(b) => link.mac = b.try_into().ok(),
            LinkAttribute::MinMtu(m) => link.min_mtu = Some(m),
            LinkAttribute::MaxMtu(m) => link.max_mtu = Some(m),
            _ => {}
        }
    }
    link
}

fn io_errno(e: std::io::Error) -> Errno {
    Errno::from_io_error(&e).unwrap_or(Errno::IO)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_by_cause() {
        let c = |e: NetError| AgentError::from(e).code;
        assert_eq!(c(NetError::Invalid("x".into())), ErrorCode::InvalidArgument);
        assert_eq!(
            c(NetError::NoNic {
                name: "eth0".into(),
                mac: "02:00:00:00:00:01".into(),
                seen: "lo".into()
            }),
            ErrorCode::NotFound
        );
        assert_eq!(
            c(NetError::AlreadyConfigured),
            ErrorCode::FailedPrecondition
        );
        assert_eq!(
            c(NetError::Netlink {
                step: "x".into(),
                errno: Errno::PERM
            }),
            ErrorCode::Internal
        );
    }
}
