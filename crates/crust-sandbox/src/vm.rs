//! The sandbox's QEMU guest: a thin adapter over crust-vmm that shares the
//! `Vm` between the shim's tasks and turns QEMU's exit into a notification.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crust_vmm::{AccelChoice, Vm, VmConfig, VmExit};
use tokio::sync::{Mutex, watch};

use crate::config::{Accel, Config};
use crate::error::RuntimeError;
use crate::records::ProcRef;

/// Empty PCIe root ports reserved for volume hot-plug.
pub const HOTPLUG_PORTS: u32 = 8;
/// How often the shim checks whether QEMU is still there.
const EXIT_POLL: Duration = Duration::from_millis(100);

pub struct Guest {
    vm: Arc<Mutex<Vm>>,
    proc: ProcRef,
    qmp_socket: PathBuf,
    agent_socket: PathBuf,
    stdio_socket: PathBuf,
    forward_socket: PathBuf,
    virtiofsd: Vec<ProcRef>,
    ports: Vec<String>,
    accel: AccelChoice,
    context: Box<dyn Fn() -> String + Send + Sync>,
}

impl Guest {
    /// Starts QEMU and waits (up to the boot bound) for the guest agent;
    /// under `--accel auto` a hanging KVM boot is retried under TCG.
    /// QEMU dies with the shim, so a crashed shim never leaves a VM behind
    /// holding volumes.
    pub async fn launch(cfg: &Config, run_dir: &Path, id: &str) -> Result<Guest, RuntimeError> {
        Guest::launch_config(Guest::config(cfg, run_dir, id), cfg.boot_timeout).await
    }

    /// The VM configuration [`Guest::launch`] uses, for callers that add
    /// to it (shares, memory) before [`Guest::launch_config`].
    pub fn config(cfg: &Config, run_dir: &Path, id: &str) -> VmConfig {
        let name: String = format!("crust-{id}").chars().take(64).collect();
        let mut vc = VmConfig::new(name, &cfg.guest_kernel, &cfg.guest_initrd, run_dir);
        vc.memory_mib = cfg.memory_mib;
        vc.cpus = cfg.cpus;
        vc.accel = match cfg.accel {
            Accel::Tcg => crust_vmm::Accel::Tcg,
            Accel::Kvm => crust_vmm::Accel::Kvm,
            Accel::Auto => crust_vmm::Accel::Auto,
        };
        vc.qemu_binary = cfg.qemu.clone();
        vc.accel_cache = Some(cfg.accel_cache.clone());
        vc.hotplug_ports = HOTPLUG_PORTS;
        vc.die_with_parent = true;
        // A self-contained install (/opt/crust) brings its own QEMU and
        // firmware; never mix it with the host's. An explicit --qemu wins.
        if cfg.qemu == std::path::Path::new(crate::settings::DEFAULT_QEMU)
            && let Some(qemu) = Config::bundled("qemu-system-x86_64")
        {
            vc.qemu_binary = qemu;
            vc.firmware = Config::bundled("../share/qemu/qboot.rom");
        }
        vc
    }

    /// Starts QEMU (and the virtiofsd of each share) for `vc` and waits up
    /// to `ready_timeout` for the guest agent (with the KVM-to-TCG retry of
    /// `--accel auto`).
    pub async fn launch_config(
        vc: VmConfig,
        ready_timeout: Duration,
    ) -> Result<Guest, RuntimeError> {
        let id = vc.name.clone();
        let vm = Vm::boot(vc, ready_timeout).await.map_err(|e| match e {
            crust_vmm::VmError::NotReady { .. } => RuntimeError::GuestNotReady(e),
            e => RuntimeError::Launch(e),
        })?;
        let accel = vm.accel_choice();
        if accel.fallback {
            tracing::warn!("{id}: {}", accel.reason);
        } else {
            tracing::info!("{id}: {} ({})", accel.accel.as_str(), accel.reason);
        }
        let proc = ProcRef {
            pid: vm.pid() as i32,
            start_time: vm.state().start_time,
        };
        let paths = vm.paths().clone();
        Ok(Guest {
            proc,
            qmp_socket: vm.qmp_socket().to_path_buf(),
            agent_socket: vm.agent_socket().to_path_buf(),
            stdio_socket: vm.stdio_socket().to_path_buf(),
            forward_socket: vm.forward_socket().to_path_buf(),
            virtiofsd: vm
                .state()
                .virtiofsd
                .iter()
                .map(|d| ProcRef {
                    pid: d.pid as i32,
                    start_time: d.start_time,
                })
                .collect(),
            ports: vm.hotplug_ports().to_vec(),
            accel,
            context: Box::new(move || {
                format!(
                    "qemu.log: {}\nconsole.log: {}",
                    crust_vmm::tail(&paths.qemu_log, 1024),
                    crust_vmm::tail(&paths.console_log, 2048)
                )
            }),
            vm: Arc::new(Mutex::new(vm)),
        })
    }

    /// The accelerator the guest runs under and why.
    pub fn accel_choice(&self) -> AccelChoice {
        self.accel.clone()
    }

    /// The stdio port's socket (container stdio).
    pub fn stdio_socket(&self) -> &Path {
        &self.stdio_socket
    }

    /// The port-forward port's socket.
    pub fn forward_socket(&self) -> &Path {
        &self.forward_socket
    }

    /// The virtiofsd daemons of the VM's shares.
    pub fn virtiofsd(&self) -> &[ProcRef] {
        &self.virtiofsd
    }

    pub fn proc_ref(&self) -> ProcRef {
        self.proc
    }

    pub fn qmp_socket(&self) -> &Path {
        &self.qmp_socket
    }

    pub fn agent_socket(&self) -> &Path {
        &self.agent_socket
    }

    /// The ends of qemu.log and console.log, for error messages.
    pub fn console_tail(&self) -> String {
        (self.context)()
    }

    pub fn hotplug_buses(&self) -> Vec<String> {
        self.ports.clone()
    }

    /// Sends `Some(reason)` on `tx` once QEMU has exited.
    pub fn set_exit_notifier(&self, tx: watch::Sender<Option<String>>) {
        let vm = self.vm.clone();
        tokio::spawn(async move {
            loop {
                let exit = vm.lock().await.wait_exit(Duration::ZERO).await;
                if let Some(e) = exit {
                    let _ = tx.send(Some(describe(&e)));
                    return;
                }
                if tx.is_closed() {
                    return;
                }
                tokio::time::sleep(EXIT_POLL).await;
            }
        });
    }

    /// Waits up to `timeout` for QEMU to exit; true once it has.
    pub async fn wait_exit(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self
                .vm
                .lock()
                .await
                .wait_exit(Duration::ZERO)
                .await
                .is_some()
            {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILLs QEMU and reaps it.
    pub async fn kill(&self) {
        if let Err(e) = self.vm.lock().await.kill() {
            tracing::error!("killing QEMU: {e}");
        }
    }
}

fn describe(e: &VmExit) -> String {
    if e.virtiofsd_died {
        return "killed because its virtiofsd exited".into();
    }
    match (e.code, e.signal) {
        (_, Some(s)) => format!("killed by signal {s}"),
        (Some(c), None) => format!("exit status {c}"),
        (None, None) => "exited".into(),
    }
}

/// How long a guest asked to power off may take before QEMU is told to
/// quit.
pub const POWEROFF_WAIT: Duration = Duration::from_secs(15);

/// A live guest and what stopping it needs.
pub struct GuestStop<'a> {
    pub guest: &'a Guest,
    pub qmp: &'a crust_qmp::QmpClient,
    pub agent: &'a crust_agent_proto::AgentClient,
    /// The bound on each agent or QMP request.
    pub timeout: Duration,
}

/// Stops a sandbox's guest, the one order both doors use: a dead QEMU is
/// reaped; a live guest (whose containers its door stopped and removed)
/// has its volumes unmounted (each filesystem clean on its device), then is
/// powered off, else QEMU quits through QMP, else it is killed. Returns
/// once QEMU is gone; a step that fails is logged and the next one runs.
pub async fn stop_guest(s: GuestStop<'_>, volumes: &[crate::records::Volume], running: bool) {
    if !running {
        s.guest.kill().await;
        return;
    }
    for v in volumes {
        if let Err(e) = crate::volumes::unmount(s.agent, v, s.timeout).await {
            tracing::warn!("{e}");
        }
    }
    if let Err(e) = s.agent.shutdown().await {
        tracing::warn!("agent shutdown: {e}");
    }
    if !s.guest.wait_exit(POWEROFF_WAIT).await {
        tracing::warn!("the guest did not power off; quitting QEMU");
        let _ = tokio::time::timeout(s.timeout, s.qmp.quit()).await;
        if !s.guest.wait_exit(Duration::from_secs(5)).await {
            s.guest.kill().await;
        }
    }
}

/// A booted pod VM: the handles that the containerd door's pod, in-place
/// resize ([`crate::resize`]) and its task service use to reach it.
pub struct PodVm {
    pub guest: Guest,
    pub qmp: crust_qmp::QmpClient,
    pub agent: crust_agent_proto::AgentClient,
    pub stdio: crust_agent_proto::stdio::StdioMux,
    /// Port-forward into the guest; `None` without a pod network.
    pub forward: Option<crate::forward::Forwarder>,
    /// Some(reason) once QEMU has exited.
    pub exit: watch::Receiver<Option<String>>,
}
