//! Port-forward's host end in the pod's namespace. containerd serves CRI
//! PortForward by dialing `localhost:<port>` inside the pod's network
//! namespace; a crust pod's listeners are in the guest, so nothing there
//! answers. An nftables `nat` output chain redirects every TCP connection
//! made inside the namespace to a loopback address onto one listener per
//! family, which the caller relays to the guest, reading the port asked
//! for from the connection's original destination (`SO_ORIGINAL_DST`).
//!
//! Why a redirect rather than a listener per port: the workload opens
//! ports whenever it likes, and the host cannot know which; one rule
//! covers every port, both families and any client (containerd 1.6 and
//! 2.x dial differently, both reach it). Only loopback traffic is
//! touched: the pod's own addresses are the guest's, reached over its NIC.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};

use crate::{NetError, NetNs, nft};

/// The table's name (family `inet`).
pub const FORWARD_TABLE: &str = "crust_forward";

/// The forwarder's listeners, bound inside the pod's namespace.
pub struct Listeners {
    pub v4: TcpListener,
    /// `None` when the namespace has no IPv6 loopback (IPv6 disabled).
    pub v6: Option<TcpListener>,
}

/// Binds the listeners on ephemeral loopback ports inside `ns`.
pub fn listen(ns: &NetNs) -> Result<Listeners, NetError> {
    let what = ns.path().to_string();
    ns.run(move || {
        let io = |source| NetError::Io {
            what: format!("listening on the loopback of {what}"),
            source,
        };
        let v4 = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).map_err(io)?;
        let v6 = TcpListener::bind(SocketAddr::from((Ipv6Addr::LOCALHOST, 0))).ok();
        v4.set_nonblocking(true).map_err(io)?;
        if let Some(l) = &v6 {
            l.set_nonblocking(true).map_err(io)?;
        }
        Ok(Listeners { v4, v6 })
    })
}

/// The redirect for listeners on ports `v4` and `v6`, replacing any
/// earlier table of ours.
pub fn ruleset(v4: u16, v6: Option<u16>) -> String {
    let mut s = format!(
        "table inet {FORWARD_TABLE}\ndelete table inet {FORWARD_TABLE}\n\
         table inet {FORWARD_TABLE} {{\n  chain output {{\n    \
         type nat hook output priority -100; policy accept;\n    \
         oifname \"lo\" ip daddr 127.0.0.0/8 meta l4proto tcp redirect to :{v4}\n"
    );
    if let Some(p) = v6 {
        s.push_str(&format!(
            "    oifname \"lo\" ip6 daddr ::1 meta l4proto tcp redirect to :{p}\n"
        ));
    }
    s.push_str("  }\n}\n");
    s
}

/// Sends the namespace's loopback TCP connections to `l`. A failure
/// leaves no table.
pub fn install(ns: &NetNs, l: &Listeners) -> Result<(), NetError> {
    let port = |l: &TcpListener| l.local_addr().map(|a| a.port());
    let io = |source| NetError::Io {
        what: "reading the forwarder's port".into(),
        source,
    };
    let v4 = port(&l.v4).map_err(io)?;
    let v6 = l.v6.as_ref().map(port).transpose().map_err(io)?;
    let nft = nft::nft("port-forward redirects the pod's loopback connections with nftables")?;
    nft::run_in(ns, &nft, &["-f", "-"], Some(ruleset(v4, v6))).map(|_| ())
}

/// Removes the redirect: idempotent, and a node without `nft` made none.
pub fn remove(ns: &NetNs) {
    nft::delete_table(ns, "inet", FORWARD_TABLE, "the port-forward table");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ruleset_redirects_loopback_only() {
        let r = ruleset(40000, Some(40001));
        assert!(
            r.contains("oifname \"lo\" ip daddr 127.0.0.0/8 meta l4proto tcp redirect to :40000")
        );
        assert!(r.contains("ip6 daddr ::1 meta l4proto tcp redirect to :40001"));
        assert!(!ruleset(40000, None).contains("ip6"));
    }
}
