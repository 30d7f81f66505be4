//! A sandbox's network for its VM (issue 26), for both doors: CNI's
//! interfaces in the sandbox's namespace are mirrored by taps
//! (crust-podnet) that QEMU gets as virtio-net NICs, and the agent gives
//! the guest the same addresses, routes and neighbours.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use crust_agent_proto::AgentClient;
use crust_podnet::{AntiSpoof, GuestNet, NetError, NetNs, PodNetwork};
use crust_vmm::NicSpec;

/// `off` lets the pod's guest send frames from any address (routers,
/// VRRP): the anti-spoofing guard of `crust_podnet::guard` is on
/// otherwise. Logged when off.
pub const CRUST_ANTI_SPOOFING: &str = "io.crust.network.anti-spoofing";

/// What a door does with netfilter rules in a sandbox's namespace
/// (`CRUST_SHIM_NETNS_RULES`, `CRUST_RUNTIME_NETNS_RULES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum NetnsRules {
    /// Fail the sandbox, naming the tables and chains.
    #[default]
    Refuse,
    /// Apply the namespace's iptables rules in the guest's network
    /// namespace before any container starts (a mesh's REDIRECT to its
    /// sidecar works there); rules that cannot be carried refuse the pod.
    Guest,
    /// Run the pod; the rules are logged and do not apply to it.
    Ignore,
}

/// Where a sandbox's network comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodNetworkSpec {
    /// No network namespace in the spec: the node's network
    /// (`hostNetwork`).
    Host,
    /// A namespace of its own that the runtime makes (no CNI): only `lo`.
    Empty,
    /// CNI's namespace at this path: its interfaces go into the guest.
    Namespace(String),
}

impl PodNetworkSpec {
    /// The network an OCI spec asks for (its `linux.namespaces` entry).
    pub fn of(spec: &oci_spec::runtime::Spec) -> Result<PodNetworkSpec, String> {
        let ns = spec
            .linux()
            .as_ref()
            .and_then(|l| l.namespaces().as_ref())
            .and_then(|n| {
                n.iter()
                    .find(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::Network)
                    .cloned()
            });
        Ok(match ns {
            None => PodNetworkSpec::Host,
            Some(n) => match n.path() {
                None => PodNetworkSpec::Empty,
                Some(p) => PodNetworkSpec::Namespace(
                    p.to_str()
                        .map(str::to_string)
                        .ok_or("the network namespace path is not UTF-8")?,
                ),
            },
        })
    }
}

/// The sandbox's [`CRUST_ANTI_SPOOFING`] annotation.
pub fn anti_spoofing(annotations: &HashMap<String, String>) -> Result<AntiSpoof, String> {
    match annotations.get(CRUST_ANTI_SPOOFING).map(String::as_str) {
        None | Some("on") => Ok(AntiSpoof::On),
        Some("off") => Ok(AntiSpoof::Off),
        Some(v) => Err(format!(
            "annotation {CRUST_ANTI_SPOOFING} = {v:?}: \"on\" or \"off\""
        )),
    }
}

/// How a pod's namespace is taken: the node's rule for netfilter rules
/// found there, and the pod's anti-spoofing choice.
#[derive(Debug, Clone, Copy)]
pub struct NetPolicy {
    pub rules: NetnsRules,
    pub anti_spoofing: AntiSpoof,
}

/// What a booting pod attached; detached on failure by [`Attached::undo`].
pub struct Attached {
    pub ns: NetNs,
    pub net: PodNetwork,
    pub nics: Vec<NicSpec>,
}

impl Attached {
    pub fn links(&self) -> Vec<String> {
        self.net.links.iter().map(|l| l.name.clone()).collect()
    }

    /// Removes the taps and redirects (the namespace as CNI left it).
    pub fn undo(&self) {
        if let Err(e) = crust_podnet::detach(&self.ns, &self.links()) {
            tracing::warn!(netns = %self.ns.path(), "detaching the pod network: {e}");
        }
    }
}

/// What the guest can take: from the kernel config the guest image keeps
/// beside its kernel (`<kernel>.config`), else Debian's cloud kernel's.
pub fn guest_net(kernel: &Path) -> GuestNet {
    let mut name = kernel.as_os_str().to_owned();
    name.push(".config");
    match std::fs::read_to_string(&name) {
        Ok(config) => GuestNet::from_kernel_config(&config),
        Err(_) => GuestNet::default(),
    }
}

/// Reads the pod's namespace and, once crust-podnet's check says `guest`
/// can take it (else the error names the interface and nothing changed),
/// makes a tap per interface: one queue per vCPU. `Host` and `Empty` give
/// no tap ([`GuestLink`] says what they get). Netfilter rules in the namespace
/// refuse the pod first, unless the node ignores them.
pub fn attach(
    spec: &PodNetworkSpec,
    cpus: u32,
    guest: &GuestNet,
    policy: NetPolicy,
) -> Result<Option<Attached>, NetError> {
    let PodNetworkSpec::Namespace(path) = spec else {
        return Ok(None);
    };
    let t0 = std::time::Instant::now();
    let ns = NetNs::open(path)?;
    let carried = check_rules(&ns, policy.rules)?;
    let mut net = crust_podnet::scan(&ns)?;
    net.config.netfilter = carried;
    if policy.anti_spoofing == AntiSpoof::Off {
        tracing::warn!(netns = %path, "anti-spoofing off for this pod ({}): its guest may send \
            frames from any address", CRUST_ANTI_SPOOFING);
    }
    let taps = crust_podnet::attach(&ns, &net, guest, cpus.max(1), policy.anti_spoofing)?;
    let nics = taps
        .into_iter()
        .map(|t| NicSpec {
            mac: crust_agent_proto::network::format_mac(&t.mac),
            mtu: t.mtu,
            fds: t.fds.into_iter().map(Arc::new).collect(),
        })
        .collect();
    tracing::info!(netns = %path, interfaces = ?net.links.iter().map(|l| &l.name).collect::<Vec<_>>(),
        elapsed_ms = t0.elapsed().as_millis() as u64, "pod network mirrored into the VM");
    Ok(Some(Attached { ns, net, nics }))
}

/// Netfilter rules in the pod's namespace would not see the guest's
/// traffic: refused, carried into the guest (what the agent is to
/// apply), or logged when the node ignores them.
fn check_rules(
    ns: &NetNs,
    rules: NetnsRules,
) -> Result<Option<crust_agent_proto::GuestRules>, NetError> {
    let found = crust_podnet::netfilter::inspect(ns)?;
    if found.is_empty() {
        return Ok(None);
    }
    match rules {
        NetnsRules::Refuse => Err(NetError::Rules {
            path: ns.path().to_string(),
            found,
        }),
        NetnsRules::Guest => {
            let carried = crust_podnet::netfilter::carry(ns, &found)?;
            tracing::info!(netns = %ns.path(), rules = ?found.iter().map(ToString::to_string).collect::<Vec<_>>(),
                "the namespace's netfilter rules go into the guest (CRUST_SHIM_NETNS_RULES=guest)");
            Ok(Some(carried))
        }
        NetnsRules::Ignore => {
            let err = NetError::Rules {
                path: ns.path().to_string(),
                found,
            };
            tracing::warn!("ignored (CRUST_SHIM_NETNS_RULES=ignore): {err}");
            Ok(None)
        }
    }
}

/// The anti-spoofing guard's drop counters as Prometheus text: family
/// `crust_pod_network_spoofed_frames_total{interface,reason}`. A pod
/// without the guard (or whose namespace is gone) has no samples.
pub fn guard_metrics(netns: Option<&str>, links: &[String]) -> String {
    let name = "crust_pod_network_spoofed_frames_total";
    let mut out = format!(
        "# HELP {name} Frames from the guest dropped for a forged address (interface, reason: \
         mac, arp, ipv4, ipv6, nd, other).\n# TYPE {name} counter\n"
    );
    let Some(ns) = netns.and_then(|p| NetNs::open(p).ok()) else {
        return out;
    };
    for d in crust_podnet::guard::dropped(&ns, links).unwrap_or_default() {
        out.push_str(&format!(
            "{name}{{interface=\"{}\",reason=\"{}\"}} {}\n",
            d.interface.replace('\\', "\\\\").replace('"', "\\\""),
            d.reason,
            d.packets
        ));
    }
    out
}

/// What the guest's network is made of.
pub enum GuestLink<'a> {
    /// CNI's interfaces, mirrored.
    Pod(&'a Attached),
    /// A `hostNetwork` pod the node lets run on QEMU's user-mode network
    /// (the containerd door's `CRUST_SHIM_HOST_NETWORK=user`).
    UserMode,
    /// An empty namespace of its own: `lo` only, as under runc.
    LoopbackOnly,
}

/// The guest side of [`NicSpec::user_mode`]: QEMU's addresses for it.
pub fn user_mode_request() -> crust_agent_proto::ConfigureNetwork {
    use crust_agent_proto::{NetAddress, NetInterface, NetRoute, RouteScope};
    let guest = std::net::IpAddr::V4(crust_vmm::USER_NET_GUEST);
    let prefix = crust_vmm::USER_NET_PREFIX;
    let net = std::net::Ipv4Addr::from(
        u32::from(crust_vmm::USER_NET_GUEST) & (u32::MAX << (32 - prefix)),
    );
    crust_agent_proto::ConfigureNetwork {
        interfaces: vec![NetInterface {
            name: "eth0".into(),
            mac: crust_vmm::USER_NET_MAC.into(),
            mtu: 1500,
            addresses: vec![NetAddress {
                address: guest,
                prefix_len: prefix,
            }],
        }],
        routes: vec![
            NetRoute {
                destination: net.into(),
                prefix_len: prefix,
                gateway: None,
                device: "eth0".into(),
                source: Some(guest),
                scope: RouteScope::Link,
                metric: 0,
            },
            NetRoute {
                destination: std::net::Ipv4Addr::UNSPECIFIED.into(),
                prefix_len: 0,
                gateway: Some(crust_vmm::USER_NET_GATEWAY.into()),
                device: "eth0".into(),
                source: None,
                scope: RouteScope::Universe,
                metric: 0,
            },
        ],
        neighbours: Vec::new(),
        netfilter: None,
    }
}

/// Gives the guest its addresses, routes and neighbours.
pub async fn configure(agent: &AgentClient, link: GuestLink<'_>) -> Result<(), String> {
    let req = match link {
        GuestLink::Pod(a) => a.net.config.clone(),
        GuestLink::UserMode => user_mode_request(),
        GuestLink::LoopbackOnly => Default::default(),
    };
    let t0 = std::time::Instant::now();
    let reply = agent
        .call(req)
        .await
        .map_err(|e| format!("configuring the guest's network: {e}"))?;
    tracing::info!(interfaces = ?reply.interfaces, elapsed_ms = t0.elapsed().as_millis() as u64,
        "guest network configured");
    Ok(())
}

/// Detaches what a pod's record says it attached (a dead shim's cleanup,
/// or a teardown). A namespace already gone took the taps with it.
pub fn detach_recorded(netns: Option<&str>, links: &[String]) {
    let Some(path) = netns else { return };
    match NetNs::open(path) {
        Ok(ns) => {
            if let Err(e) = crust_podnet::detach(&ns, links) {
                tracing::warn!(netns = %path, "detaching the pod network: {e}");
            }
        }
        Err(e) => tracing::info!(netns = %path, "pod network already gone: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_kernels_config_beside_it_says_what_it_takes() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("vmlinuz");
        // No config: Debian's cloud kernel (both families).
        assert_eq!(guest_net(&kernel), GuestNet::default());
        std::fs::write(
            dir.path().join("vmlinuz.config"),
            "CONFIG_INET=y\n# CONFIG_IPV6 is not set\n",
        )
        .unwrap();
        let g = guest_net(&kernel);
        assert!(g.ipv4 && !g.ipv6, "{g:?}");
    }
}
