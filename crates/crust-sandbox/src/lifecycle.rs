//! A sandbox's boot and teardown: one sequence each, called by both doors.
//!
//! Boot: the network attached and recorded, QEMU (and virtiofsd) launched
//! and recorded, QMP and the agent connected, the network configured in
//! the guest. A step that fails undoes the steps before it (the guest
//! killed, the taps removed), so a door only undoes what it did itself
//! (claims, share, records).
//!
//! Teardown: the guest stopped (volumes unmounted, powered off, else
//! killed), then the holds on the devices, the claims and the handed-over
//! volumes, then the taps, then the share. Each step is logged with its
//! time, so a teardown that hangs names the step.

use std::path::Path;
use std::time::{Duration, Instant};

use crust_agent_proto::AgentClient;
use crust_qmp::QmpClient;
use crust_vmm::{NicSpec, VmConfig};
use tokio::sync::watch;

use crate::config::Config;
use crate::discovery::Discovery;
use crate::error::RuntimeError;
use crate::handover::Handover;
use crate::net::{self, Attached, GuestLink, NetPolicy, PodNetworkSpec};
use crate::plug::{self, Attachments};
use crate::records::{SandboxState, Volume};
use crate::vm::{Guest, GuestStop};

/// A step slower than this is worth a warning in the log.
const SLOW_STEP: Duration = Duration::from_secs(5);

/// What a door asks to boot.
pub struct BootSpec<'a> {
    pub cfg: &'a Config,
    /// [`Guest::config`] with the door's sizing, share and cgroups.
    pub vm: VmConfig,
    pub network: PodNetworkSpec,
    pub policy: NetPolicy,
}

/// A booted sandbox's guest and its connections.
pub struct Booted {
    pub guest: Guest,
    pub qmp: QmpClient,
    pub agent: AgentClient,
    /// The pod network mirrored into the guest, if any.
    pub network: Option<Attached>,
    /// Some(reason) once QEMU has exited.
    pub exit: watch::Receiver<Option<String>>,
}

/// What boot has done that the sandbox's record must say before the next
/// step (so a dead door's cleanup finds it).
pub enum Recorded<'a> {
    Network(&'a Attached),
    Guest(&'a Guest),
}

impl Recorded<'_> {
    /// Writes this step into a sandbox record.
    pub fn apply(&self, s: &mut SandboxState) {
        match self {
            Recorded::Network(a) => {
                s.network_namespace = Some(a.ns.path().to_string());
                s.network_links = a.links();
            }
            Recorded::Guest(g) => {
                s.qemu = Some(g.proc_ref());
                s.pid = Some(g.proc_ref().pid);
                s.accel = Some(g.accel_choice());
            }
        }
    }
}

/// The door's way of persisting a [`Recorded`] step.
pub type Record<'r> = dyn FnMut(Recorded<'_>) -> Result<(), RuntimeError> + Send + 'r;

/// Boots a sandbox's guest (see the module's doc).
pub async fn boot(spec: BootSpec<'_>, record: &mut Record<'_>) -> Result<Booted, RuntimeError> {
    let BootSpec {
        cfg,
        mut vm,
        network,
        policy,
    } = spec;
    let guest_net = net::guest_net(&cfg.guest_kernel);
    let attached = net::attach(&network, vm.cpus, &guest_net, policy)?;
    let res = async {
        if let Some(a) = &attached {
            record(Recorded::Network(a))?;
        }
        vm.nics = nics(&network, attached.as_ref());
        let guest = Guest::launch_config(vm, cfg.boot_timeout).await?;
        match connect(cfg, &guest, &network, attached.as_ref(), record).await {
            Ok((qmp, agent)) => Ok((guest, qmp, agent)),
            Err(e) => {
                guest.kill().await;
                Err(e)
            }
        }
    }
    .await;
    match res {
        Ok((guest, qmp, agent)) => {
            let (exit_tx, exit) = watch::channel(None);
            guest.set_exit_notifier(exit_tx);
            Ok(Booted {
                guest,
                qmp,
                agent,
                network: attached,
                exit,
            })
        }
        Err(e) => {
            attached.inspect(Attached::undo);
            Err(e)
        }
    }
}

/// The guest's NICs: the pod's taps, QEMU's user-mode stack for a host
/// network the node allows, else none (`lo` only).
fn nics(network: &PodNetworkSpec, attached: Option<&Attached>) -> Vec<NicSpec> {
    match (attached, network) {
        (Some(a), _) => a.nics.clone(),
        (None, PodNetworkSpec::Host) => vec![NicSpec::user_mode()],
        (None, _) => Vec::new(),
    }
}

/// Records the launched guest, connects QMP and the agent, configures the
/// guest's network.
async fn connect(
    cfg: &Config,
    guest: &Guest,
    network: &PodNetworkSpec,
    attached: Option<&Attached>,
    record: &mut Record<'_>,
) -> Result<(QmpClient, AgentClient), RuntimeError> {
    record(Recorded::Guest(guest))?;
    let qmp = QmpClient::connect(guest.qmp_socket(), cfg.timeout)
        .await
        .map_err(RuntimeError::QmpConnect)?;
    let agent = AgentClient::with_timeout(guest.agent_socket(), cfg.timeout);
    agent
        .wait_ready(cfg.boot_timeout)
        .await
        .map_err(|cause| RuntimeError::AgentNotReady {
            cause,
            console: guest.console_tail(),
        })?;
    let link = match (attached, network) {
        (Some(a), _) => GuestLink::Pod(a),
        (None, PodNetworkSpec::Host) => GuestLink::UserMode,
        (None, _) => GuestLink::LoopbackOnly,
    };
    net::configure(&agent, link)
        .await
        .map_err(RuntimeError::GuestNetwork)?;
    Ok((qmp, agent))
}

/// What a door tears down.
pub struct Teardown<'a> {
    pub id: &'a str,
    /// The guest, and whether QEMU still runs; `None` when never booted.
    pub guest: Option<(GuestStop<'a>, bool)>,
    pub attachments: &'a Attachments,
    pub discovery: &'a Discovery,
    pub handover: &'a Handover,
    /// The sandbox's record as it stands (volumes, handed-over volumes,
    /// network).
    pub state: &'a SandboxState,
    /// The share directory, when the sandbox has one.
    pub share: Option<&'a Path>,
}

/// Tears a sandbox's host side down (see the module's doc). Every step
/// runs, whatever the one before did.
pub async fn teardown(t: Teardown<'_>) {
    let vols: &[Volume] = &t.state.volumes;
    if let Some((stop, running)) = t.guest {
        timed(
            "teardown: stopping the VM",
            crate::vm::stop_guest(stop, vols, running),
        )
        .await;
    }
    timed(
        "teardown: releasing the devices and claims, giving handed-over volumes back",
        plug::release_host_side(
            t.attachments,
            t.discovery,
            t.handover,
            t.id,
            vols,
            &t.state.handover_asked,
        ),
    )
    .await;
    net::detach_recorded(t.state.network_namespace.as_deref(), &t.state.network_links);
    t.share.inspect(|d| crate::share::remove_logged(d));
}

/// Runs one step. A step still running after [`SLOW_STEP`] is logged then
/// and again when it ends, so a hung one names itself.
pub async fn timed<T>(what: &str, step: impl std::future::Future<Output = T>) -> T {
    let t = Instant::now();
    let mut step = std::pin::pin!(step);
    tokio::select! {
        out = &mut step => {
            tracing::debug!("{what} took {:?}", t.elapsed());
            return out;
        }
        () = tokio::time::sleep(SLOW_STEP) => {
            tracing::warn!("{what} still running after {SLOW_STEP:?}");
        }
    }
    let out = step.await;
    tracing::warn!("{what} took {:?}", t.elapsed());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_taps_a_guest_gets_user_mode_only_for_a_host_network() {
        let host = nics(&PodNetworkSpec::Host, None);
        assert_eq!(host.len(), 1);
        assert!(host[0].fds.is_empty(), "user mode: no tap");
        assert!(nics(&PodNetworkSpec::Empty, None).is_empty());
        // A namespace that had nothing to mirror (no interface): `lo` only.
        assert!(nics(&PodNetworkSpec::Namespace("/x".into()), None).is_empty());
    }
}
