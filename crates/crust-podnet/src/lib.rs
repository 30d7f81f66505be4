//! The host side of a crust pod's network (issue 26): what CNI made in the
//! pod's network namespace goes into the guest unchanged.
//!
//! * [`NetNs`]: the pod's namespace, opened once from the sandbox spec's
//!   path and checked to be a network namespace; every step runs on a
//!   short-lived thread that entered it ([`NetNs::run`]), so nothing else
//!   of the shim ever changes namespace.
//! * [`scan`]: each interface CNI left there (any kind: veth, macvlan,
//!   tap...), with its MAC, MTU, addresses, routes and permanent
//!   neighbours, as the agent's [`ConfigureNetwork`] request.
//! * [`check`]: whether the guest can take it (interface kinds, MTUs,
//!   address families...): the one validation, run by [`attach`] before
//!   it changes anything, so a refused pod's namespace stays as CNI made
//!   it.
//! * [`attach`]: per interface a tap in the same namespace
//!   (`IFF_VNET_HDR`, multi-queue for several vCPUs), joined to the
//!   interface with tc: an ingress qdisc on each and a `u32` match-all
//!   filter whose `mirred` action redirects every frame to the other's
//!   egress. CNI's interface is not changed otherwise; QEMU gets the taps'
//!   descriptors. [`detach`] removes exactly what `attach` added, so CNI's
//!   DEL finds its namespace as it left it.
//! * [`guard`]: with anti-spoofing on (the default), the guest's
//!   direction goes through an nftables `netdev` chain on the tap that
//!   drops forged frames, counts them and forwards the rest.
//! * [`forward`]: port-forward's redirect of the namespace's loopback
//!   TCP connections to a host listener that relays them to the guest.
//! * [`netfilter`]: the rules already in the namespace, which the guest's
//!   traffic would bypass, for the caller to refuse or report.

mod check;
pub mod forward;
pub mod guard;
pub mod netfilter;
mod netns;
mod nft;
mod scan;
mod tap;

pub use check::{GuestNet, IPV6_MIN_MTU, Refusal, VIRTIO_NET_MTU, check};
pub use netns::NetNs;
pub use scan::{PodLink, PodNetwork, scan};
pub use tap::{Tap, attach, detach, tap_name};

/// Whether the guest's frames are checked for forged addresses
/// ([`guard`]): on unless a pod says otherwise (router/VRRP pods).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AntiSpoof {
    #[default]
    On,
    Off,
}

use crust_agent_proto::ConfigureNetwork;

/// Why the pod's network cannot go into the guest. Every message names
/// the interface (or namespace) and the reason.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("network namespace {path}: {reason}")]
    Namespace { path: String, reason: String },
    #[error("netlink {what}: {source}")]
    Netlink {
        what: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("interface {name}: {reason}")]
    Interface { name: String, reason: String },
    /// What [`check`] refuses: nothing in the namespace was changed.
    #[error("interface {name}: {reason}")]
    Refused {
        name: String,
        #[source]
        reason: Refusal,
    },
    /// A netfilter tool failed or is missing.
    #[error("{what}: {reason}")]
    Tool { what: String, reason: String },
    /// The namespace holds netfilter rules the guest's traffic would
    /// bypass.
    #[error(
        "network namespace {path}: netfilter rules there would not see the guest's traffic \
         (it crosses the namespace below its IP stack): {}; the node's \
         CRUST_SHIM_NETNS_RULES=guest applies iptables rules in the guest instead, \
         CRUST_SHIM_NETNS_RULES=ignore runs such pods without them",
        found.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    Rules {
        path: String,
        found: Vec<netfilter::RuleFinding>,
    },
    /// The namespace's rules cannot be carried into the guest.
    #[error(
        "network namespace {path}: its netfilter rules cannot be carried into the guest: {what} \
         (found: {})",
        found.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    Uncarried {
        path: String,
        found: Vec<netfilter::RuleFinding>,
        what: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl NetError {
    /// [`NetError::Rules`] as rules that cannot be carried, for `what`.
    pub(crate) fn carry_refused(self, what: String) -> NetError {
        match self {
            NetError::Rules { path, found } => NetError::Uncarried { path, found, what },
            other => other,
        }
    }

    fn netlink(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetError {
        let what = what.into();
        move |source| NetError::Netlink { what, source }
    }

    fn interface(name: &str, reason: impl Into<String>) -> NetError {
        NetError::Interface {
            name: name.to_string(),
            reason: reason.into(),
        }
    }
}

/// What the agent is asked for, from a scan.
pub fn guest_request(net: &PodNetwork) -> &ConfigureNetwork {
    &net.config
}
