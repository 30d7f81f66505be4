//! A tap per pod interface, joined to it with tc `mirred` redirects both
//! ways (an ingress qdisc on each, a `u32` match-all filter): works with
//! any CNI plugin and leaves its interface as it made it.

use std::os::fd::OwnedFd;

use futures::TryStreamExt;
use netlink_packet_route::link::{LinkAttribute, LinkMessage};
use netlink_packet_route::tc::TcHandle;
use rtnetlink::{Handle, LinkUnspec};

use crate::guard::Guarded;
use crate::scan::PodLink;
use crate::{AntiSpoof, GuestNet, NetError, NetNs, PodNetwork};

/// tc's ingress qdisc handle and the filter's parent (`ffff:`).
const INGRESS_PARENT: u32 = 0xffff_0000;
/// `ETH_P_ALL` (every protocol) as tc wants it: in network byte order.
const ETH_P_ALL: u16 = 0x0003_u16.to_be();
/// Prefix of the taps' names (unique within the pod's namespace).
const TAP_PREFIX: &str = "crusttap";

/// One tap, with the descriptors QEMU gets (one per queue).
#[derive(Debug)]
pub struct Tap {
    pub name: String,
    /// The pod interface it mirrors.
    pub link: String,
    pub mac: [u8; 6],
    pub mtu: u32,
    pub fds: Vec<OwnedFd>,
}

/// The tap mirroring the `i`th interface.
pub fn tap_name(i: usize) -> String {
    format!("{TAP_PREFIX}{i}")
}

/// Opens one queue of tap `name` in the calling thread's namespace.
fn open_tap(name: &str, multi_queue: bool) -> Result<OwnedFd, NetError> {
    let io = |what: &str| {
        let what = format!("tap {name}: {what}");
        move |e: std::io::Error| NetError::Io { what, source: e }
    };
    let fd = rustix::fs::open(
        "/dev/net/tun",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| io("opening /dev/net/tun")(e.into()))?;
    let mut flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    if multi_queue {
        flags |= libc::IFF_MULTI_QUEUE as libc::c_short;
    }
    crust_sys::tun::set_iff(&fd, name, flags).map_err(io("TUNSETIFF"))?;
    Ok(fd)
}

async fn index_of(h: &Handle, name: &str) -> Result<u32, NetError> {
    let mut s = h.link().get().match_name(name.to_string()).execute();
    match s.try_next().await {
        Ok(Some(LinkMessage { header, .. })) => Ok(header.index),
        Ok(None) => Err(NetError::interface(name, "gone")),
        Err(e) => Err(NetError::netlink(format!("finding {name}"))(e)),
    }
}

/// tc redirects between `link` and `tap`: towards the guest always, and
/// from it unless the guard forwards that way ([`crate::guard`]).
async fn redirect(
    h: &Handle,
    link: &PodLink,
    tap: u32,
    tap_name: &str,
    from_guest: bool,
) -> Result<(), NetError> {
    let mut ways = vec![(link.index, tap, link.name.clone())];
    if from_guest {
        ways.push((tap, link.index, tap_name.to_string()));
    }
    for (from, to, what) in ways {
        h.qdisc()
            .add(from as i32)
            .ingress()
            .execute()
            .await
            .map_err(NetError::netlink(format!(
                "adding an ingress qdisc to {what}"
            )))?;
        h.traffic_filter(from as i32)
            .add()
            .parent(INGRESS_PARENT)
            .protocol(ETH_P_ALL)
            .redirect(to)
            .map_err(NetError::netlink(format!(
                "building the redirect of {what}"
            )))?
            .execute()
            .await
            .map_err(NetError::netlink(format!("adding the redirect of {what}")))?;
    }
    Ok(())
}

/// Makes a tap for every interface of `net` and joins them, once
/// [`crate::check`] says `guest` can take them all (a refusal changes
/// nothing). `queues` > 1 makes multi-queue taps (one descriptor per
/// queue). On failure nothing is left: qdiscs added are removed (the
/// check proved none was there before) and the taps vanish with their
/// descriptors; the guard's table is removed.
pub fn attach(
    ns: &NetNs,
    net: &PodNetwork,
    guest: &GuestNet,
    queues: u32,
    spoof: AntiSpoof,
) -> Result<Vec<Tap>, NetError> {
    // One sandbox per namespace: another sandbox's redirect shows as a
    // taken ingress hook (the check below); another pod's processes here.
    let held = ns.holders();
    if !held.is_empty() {
        let named: Vec<String> = held
            .iter()
            .take(4)
            .map(|(pid, comm)| format!("pid {pid} ({comm})"))
            .collect();
        return Err(NetError::Namespace {
            path: ns.path().to_string(),
            reason: format!(
                "other processes live in it ({}{}): it is another pod's, and one network \
                 namespace serves one sandbox",
                named.join(", "),
                if held.len() > 4 { ", ..." } else { "" }
            ),
        });
    }
    crate::check(net, guest)?;
    let links = net.links.clone();
    let ns2 = ns.clone();
    let guarded = spoof == AntiSpoof::On;
    let made = ns.netlink(move |h| async move {
        let mut taps = Vec::new();
        for (i, link) in links.iter().enumerate() {
            let name = tap_name(i);
            let fds = (0..queues.max(1))
                .map(|_| open_tap(&name, queues > 1))
                .collect::<Result<Vec<_>, _>>()?;
            let index = index_of(&h, &name).await?;
            h.link()
                .set(LinkUnspec::new_with_index(index).mtu(link.mtu).up().build())
                .execute()
                .await
                .map_err(NetError::netlink(format!("setting up tap {name}")))?;
            taps.push(Tap {
                name: name.clone(),
                link: link.name.clone(),
                mac: link.mac,
                mtu: link.mtu,
                fds,
            });
            redirect(&h, link, index, &name, !guarded).await?;
        }
        Ok(taps)
    });
    let made = made.and_then(|taps| {
        if guarded {
            crate::guard::install(ns, &guarded_links(net, &taps))?;
        }
        Ok(taps)
    });
    if made.is_err() {
        let names: Vec<String> = net.links.iter().map(|l| l.name.clone()).collect();
        if let Err(e) = detach(&ns2, &names) {
            tracing::warn!("undoing a failed network attach: {e}");
        }
    }
    made
}

/// What the guard allows each tap's guest to claim: its interface's MAC
/// and the addresses CNI gave it.
fn guarded_links(net: &PodNetwork, taps: &[Tap]) -> Vec<Guarded> {
    taps.iter()
        .map(|t| Guarded {
            tap: t.name.clone(),
            link: t.link.clone(),
            mac: t.mac,
            addresses: net
                .config
                .interfaces
                .iter()
                .filter(|i| i.name == t.link)
                .flat_map(|i| i.addresses.iter().map(|a| a.address))
                .collect(),
        })
        .collect()
}

/// Removes what [`attach`] added: the guard's table, the ingress qdisc
/// (with its filter) of each of `links`, and every crust tap; and
/// [`crate::forward`]'s redirect. Idempotent;
/// runs after the VM exited or when the shim that attached is gone.
pub fn detach(ns: &NetNs, links: &[String]) -> Result<(), NetError> {
    crate::guard::remove(ns);
    crate::forward::remove(ns);
    let links = links.to_vec();
    ns.netlink(move |h| async move {
        let all: Vec<LinkMessage> = h
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(NetError::netlink("listing links"))?;
        for l in &all {
            let name = l.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(n) => Some(n.clone()),
                _ => None,
            });
            let Some(name) = name else { continue };
            if name.starts_with(TAP_PREFIX) {
                let _ = h.link().del(l.header.index).execute().await;
            } else if links.contains(&name) {
                let mut del = h.qdisc().del(l.header.index as i32);
                let m = del.message_mut();
                m.header.parent = TcHandle::INGRESS;
                m.header.handle = TcHandle::from(INGRESS_PARENT);
                let _ = del.execute().await;
            }
        }
        Ok(())
    })
}
