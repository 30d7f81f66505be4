//! A running QEMU guest: launched with a chosen accelerator, attached to
//! from another process, watched and killed. [`Vm::launch`] and
//! [`Vm::boot`], which choose the accelerator, are in [`crate::boot`].
//!
//! - [`rundir`]: the run directory's files and `vm.json`.
//! - [`cmdline`]: QEMU's command line.
//! - [`virtiofsd`]: a share's virtiofsd.

mod cmdline;
mod rundir;
mod spawn;
mod virtiofsd;

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};

use cmdline::qemu_args;
pub use rundir::{DaemonRef, RunPaths, VmExit, VmState, tail};
use rundir::{io_err, is_our_qemu, proc_start_time, read_state, write_atomic};
pub use spawn::open_cgroup_procs;
use virtiofsd::{DaemonGuard, start_virtiofsd};

use crate::VmError;
use crate::config::{DiskSpec, VmConfig, boot_port_id, hotplug_port_id};
use crust_sandbox_records::{AccelChoice, ResolvedAccel};

/// How long QEMU gets to create its sockets before launch gives up.
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(15);

/// One QEMU process.
///
/// A `Vm` from [`Vm::launch`] kills and reaps QEMU when dropped unless
/// [`Vm::detach`]ed. A `Vm` from [`Vm::attach`] never kills on drop.
#[derive(Debug)]
pub struct Vm {
    state: VmState,
    paths: RunPaths,
    child: Option<Child>,
    /// virtiofsd children (launched VMs only).
    daemons: Vec<Child>,
    owned: bool,
    exit: Option<VmExit>,
}

/// Whether QEMU's monitor executes a command. The greeting alone proves
/// little (the monitor's I/O thread sends it while the machine is still
/// being built); a command reply comes from the main loop, so the kernel
/// and initrd are loaded by then. The connection is closed again; QEMU
/// takes the next client.
pub(crate) async fn qmp_ready(path: &Path) -> bool {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let Ok(s) = tokio::net::UnixStream::connect(path).await else {
        return false;
    };
    let (rd, mut wr) = s.into_split();
    let mut lines = BufReader::new(rd).lines();
    let talk = async {
        let greeting = lines.next_line().await.ok()??;
        if !greeting.contains("\"QMP\"") {
            return None;
        }
        wr.write_all(b"{\"execute\": \"qmp_capabilities\"}\n")
            .await
            .ok()?;
        loop {
            let line = lines.next_line().await.ok()??;
            if line.contains("\"return\"") {
                return Some(());
            }
            if line.contains("\"error\"") {
                return None;
            }
        }
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(10), talk).await,
        Ok(Some(()))
    )
}

/// Waits until the guest agent answers a ping, watching QEMU meanwhile
/// (an exited QEMU fails at once instead of at the deadline).
pub(crate) async fn wait_agent(vm: &mut Vm, timeout: Duration) -> Result<(), String> {
    let agent = crust_agent_proto::AgentClient::new(vm.agent_socket());
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(exit) = vm.poll_exit() {
            return Err(format!("QEMU exited ({exit:?})"));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("no answer to ping".into());
        }
        match agent.wait_ready(left.min(Duration::from_secs(1))).await {
            Ok(_) => return Ok(()),
            Err(crust_agent_proto::ClientError::NotReady { .. }) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// What a guest that did not come up left behind, in one line: QEMU's
/// first complaint, else the console's last words.
pub(crate) fn boot_context(paths: &RunPaths) -> Option<String> {
    let line = |path: &Path, last: bool| -> Option<String> {
        let text = std::fs::read_to_string(path).ok()?;
        let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
        let l = if last {
            lines.next_back()
        } else {
            lines.next()
        }?;
        Some(l.chars().take(160).collect())
    };
    line(&paths.qemu_log, false)
        .map(|l| format!("qemu.log: {l}"))
        .or_else(|| line(&paths.console_log, true).map(|l| format!("console: {l}")))
}

impl Vm {
    /// [`Vm::launch`] with the accelerator already chosen.
    pub(crate) async fn launch_with(cfg: VmConfig, choice: AccelChoice) -> Result<Vm, VmError> {
        cfg.validate()?;
        let paths = RunPaths::new(&cfg.run_dir);
        prepare_run_dir(&paths)?;
        let mut daemons = DaemonGuard(Vec::new());
        for (i, sh) in cfg.shares.iter().enumerate() {
            daemons.0.push(start_virtiofsd(&cfg, &paths, i, sh).await?);
        }
        let child = spawn_qemu(&cfg, choice.accel, &paths)?;
        let daemons = std::mem::take(&mut daemons.0);
        let pid = child.id();
        let start_time = proc_start_time(pid).map(|(t, _)| t).unwrap_or(0);
        let state = VmState {
            name: cfg.name.clone(),
            pid,
            start_time,
            accel: choice.accel,
            accel_reason: choice.reason,
            accel_fallback: choice.fallback,
            boot_disks: cfg
                .disks
                .iter()
                .enumerate()
                .map(|(i, d)| (d.clone(), boot_port_id(i)))
                .collect(),
            hotplug_ports: (0..cfg.hotplug_ports).map(hotplug_port_id).collect(),
            virtiofsd: daemons
                .iter()
                .map(|d| DaemonRef {
                    pid: d.id(),
                    start_time: proc_start_time(d.id()).map(|(t, _)| t).unwrap_or(0),
                })
                .collect(),
            shares: cfg.shares.clone(),
        };
        let mut vm = Vm {
            state,
            paths,
            child: Some(child),
            daemons,
            owned: true,
            exit: None,
        };
        write_atomic(&vm.paths.pid_file, format!("{pid}\n").as_bytes())?;
        let json = serde_json::to_vec_pretty(&vm.state).expect("state serializes");
        write_atomic(&vm.paths.state_file, &json)?;
        vm.wait_started().await?;
        Ok(vm)
    }

    /// Waits until QEMU's sockets exist and its monitor answers; kills it
    /// after [`START_TIMEOUT`].
    async fn wait_started(&mut self) -> Result<(), VmError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(exit) = self.poll_exit() {
                return Err(VmError::EarlyExit {
                    status: format!("{exit:?}"),
                    log_tail: tail(&self.paths.qemu_log, 4096),
                });
            }
            if self.paths.qmp_socket.exists()
                && self.paths.agent_socket.exists()
                && qmp_ready(&self.paths.qmp_socket).await
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let log_tail = tail(&self.paths.qemu_log, 4096);
                self.kill()?;
                return Err(VmError::StartTimeout {
                    after: START_TIMEOUT,
                    log_tail,
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Finds the VM running from `run_dir` (launched by another process)
    /// via `vm.json`, checking that the pid is still that QEMU (start time
    /// and command line). The handle never kills QEMU on drop.
    pub fn attach(run_dir: impl Into<PathBuf>) -> Result<Vm, VmError> {
        let paths = RunPaths::new(run_dir);
        let not_running = |reason: String| VmError::NotRunning {
            run_dir: paths.run_dir.clone(),
            reason,
        };
        let state = read_state(&paths)
            .ok_or_else(|| not_running(format!("no readable {}", paths.state_file.display())))?;
        if !is_our_qemu(&state, &paths) {
            return Err(not_running(format!(
                "pid {} is not the QEMU started from this directory anymore",
                state.pid
            )));
        }
        Ok(Vm {
            state,
            paths,
            child: None,
            daemons: Vec::new(),
            owned: false,
            exit: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.state.pid
    }

    pub fn name(&self) -> &str {
        &self.state.name
    }

    pub fn paths(&self) -> &RunPaths {
        &self.paths
    }

    pub fn qmp_socket(&self) -> &Path {
        &self.paths.qmp_socket
    }

    pub fn agent_socket(&self) -> &Path {
        &self.paths.agent_socket
    }

    pub fn stdio_socket(&self) -> &Path {
        &self.paths.stdio_socket
    }

    pub fn forward_socket(&self) -> &Path {
        &self.paths.forward_socket
    }

    pub fn console_log(&self) -> &Path {
        &self.paths.console_log
    }

    pub fn accel(&self) -> ResolvedAccel {
        self.state.accel
    }

    /// The accelerator and why it was chosen.
    pub fn accel_choice(&self) -> AccelChoice {
        AccelChoice {
            accel: self.state.accel,
            reason: self.state.accel_reason.clone(),
            fallback: self.state.accel_fallback,
        }
    }

    /// The recorded launch state.
    pub fn state(&self) -> &VmState {
        &self.state
    }

    /// Boot disks with the root port each occupies.
    pub fn boot_disks(&self) -> &[(DiskSpec, String)] {
        &self.state.boot_disks
    }

    /// Root ports that were empty at launch (`crust-hp0`, ...). A
    /// hot-plugged disk goes on one of them: QMP `blockdev-add` with
    /// [`DiskSpec::blockdev_add_args`], then `device_add` with
    /// [`DiskSpec::device_add_args`]`(port)`. Each port takes one device;
    /// the caller tracks which are in use.
    pub fn hotplug_ports(&self) -> &[String] {
        &self.state.hotplug_ports
    }

    /// The tails of `qemu.log` and `console.log`, for error messages when
    /// the guest does not come up.
    pub fn failure_context(&self) -> String {
        format!(
            "qemu.log: {}\nconsole.log: {}",
            tail(&self.paths.qemu_log, 2048),
            tail(&self.paths.console_log, 4096)
        )
    }

    fn poll_exit(&mut self) -> Option<VmExit> {
        if self.exit.is_some() {
            return self.exit;
        }
        let mut exit = match &mut self.child {
            Some(c) => match c.try_wait() {
                Ok(Some(st)) => Some(VmExit {
                    code: st.code(),
                    signal: st.signal(),
                    virtiofsd_died: false,
                }),
                Ok(None) => None,
                Err(_) => Some(VmExit {
                    code: None,
                    signal: None,
                    virtiofsd_died: false,
                }),
            },
            None => (!is_our_qemu(&self.state, &self.paths)).then_some(VmExit {
                code: None,
                signal: None,
                virtiofsd_died: false,
            }),
        };
        if exit.is_none() && self.virtiofsd_gone() {
            // The guest's shares no longer answer: end the VM rather than
            // leave its file accesses hanging.
            self.kill_qemu();
            exit = Some(VmExit {
                code: None,
                signal: Some(Signal::KILL.as_raw()),
                virtiofsd_died: true,
            });
        }
        if exit.is_some() {
            self.exit = exit;
            self.stop_daemons();
            self.cleanup_files();
        }
        exit
    }

    /// Whether a virtiofsd of this VM has exited.
    fn virtiofsd_gone(&mut self) -> bool {
        if !self.daemons.is_empty() {
            return self
                .daemons
                .iter_mut()
                .any(|d| !matches!(d.try_wait(), Ok(None)));
        }
        self.state.virtiofsd.iter().any(|d| !d.alive())
    }

    /// SIGKILLs QEMU (no waiting; poll_exit/kill reap it).
    fn kill_qemu(&mut self) {
        match &mut self.child {
            Some(c) => {
                let _ = c.kill();
                let _ = c.wait();
            }
            None => {
                if is_our_qemu(&self.state, &self.paths)
                    && let Some(pid) = Pid::from_raw(self.state.pid as i32)
                {
                    let _ = rustix::process::kill_process(pid, Signal::KILL);
                }
            }
        }
    }

    /// Kills and reaps the virtiofsd daemons (they also exit by themselves
    /// once QEMU closes their socket).
    fn stop_daemons(&mut self) {
        for d in &mut self.daemons {
            let _ = d.kill();
            let _ = d.wait();
        }
        self.daemons.clear();
        for d in &self.state.virtiofsd {
            if d.alive()
                && let Some(pid) = Pid::from_raw(d.pid as i32)
            {
                let _ = rustix::process::kill_process(pid, Signal::KILL);
            }
        }
    }

    /// Pids of the VM's virtiofsd daemons.
    pub fn virtiofsd_pids(&self) -> Vec<u32> {
        self.state.virtiofsd.iter().map(|d| d.pid).collect()
    }

    /// Whether QEMU is still running.
    pub fn is_running(&mut self) -> bool {
        self.poll_exit().is_none()
    }

    /// Waits up to `timeout` for QEMU to exit; `None` if it is still
    /// running.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<VmExit> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.poll_exit() {
                return Some(e);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILLs QEMU and waits for it to be gone. Already gone is fine.
    pub fn kill(&mut self) -> Result<(), VmError> {
        if self.poll_exit().is_some() {
            return Ok(());
        }
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let st = c
                .wait()
                .map_err(|e| io_err("wait", &self.paths.pid_file, e))?;
            self.exit = Some(VmExit {
                code: st.code(),
                signal: st.signal(),
                virtiofsd_died: false,
            });
        } else {
            if let Some(pid) = Pid::from_raw(self.state.pid as i32) {
                let _ = rustix::process::kill_process(pid, Signal::KILL);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while is_our_qemu(&self.state, &self.paths) {
                if Instant::now() >= deadline {
                    return Err(VmError::NotRunning {
                        run_dir: self.paths.run_dir.clone(),
                        reason: format!("pid {} survived SIGKILL for 10s", self.state.pid),
                    });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            self.exit = Some(VmExit {
                code: None,
                signal: Some(Signal::KILL.as_raw()),
                virtiofsd_died: false,
            });
        }
        self.stop_daemons();
        self.cleanup_files();
        Ok(())
    }

    /// Leaves QEMU running when this handle is dropped; returns its pid.
    /// Another process can pick it up with [`Vm::attach`].
    pub fn detach(mut self) -> u32 {
        self.owned = false;
        // Dropping a std Child neither kills nor waits.
        self.child = None;
        self.daemons.clear();
        self.state.pid
    }

    /// Removes the sockets and pid/state files of an exited VM; logs stay.
    fn cleanup_files(&self) {
        for f in [
            &self.paths.qmp_socket,
            &self.paths.agent_socket,
            &self.paths.stdio_socket,
            &self.paths.forward_socket,
            &self.paths.pid_file,
            &self.paths.state_file,
        ] {
            let _ = std::fs::remove_file(f);
        }
        for i in 0..self.state.shares.len() {
            let _ = std::fs::remove_file(self.paths.fs_socket(i));
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if self.owned {
            let _ = self.kill();
        }
    }
}

/// Makes the run directory (0700) and clears what a dead QEMU left in it;
/// refuses while a live QEMU of ours runs from it.
fn prepare_run_dir(paths: &RunPaths) -> Result<(), VmError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&paths.run_dir)
        .map_err(|e| io_err("mkdir", &paths.run_dir, e))?;
    std::fs::set_permissions(&paths.run_dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| io_err("chmod", &paths.run_dir, e))?;
    if let Some(old) = read_state(paths)
        && is_our_qemu(&old, paths)
    {
        return Err(VmError::AlreadyRunning {
            run_dir: paths.run_dir.clone(),
            pid: old.pid,
        });
    }
    for stale in [
        &paths.qmp_socket,
        &paths.agent_socket,
        &paths.stdio_socket,
        &paths.forward_socket,
        &paths.pid_file,
        &paths.state_file,
    ] {
        match std::fs::remove_file(stale) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("remove", stale, e)),
        }
    }
    Ok(())
}

/// Starts QEMU with its log as stdout and stderr, the NICs' descriptors
/// inherited, in a process group of its own.
fn spawn_qemu(cfg: &VmConfig, accel: ResolvedAccel, paths: &RunPaths) -> Result<Child, VmError> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&paths.qemu_log)
        .map_err(|e| io_err("create", &paths.qemu_log, e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| io_err("dup", &paths.qemu_log, e))?;
    let mut cmd = Command::new(&cfg.qemu_binary);
    cmd.args(qemu_args(cfg, accel, paths))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .process_group(0);
    // The NICs' descriptors are kept by QEMU alone (cleared close-on-exec
    // in its child only, so no other process of ours inherits a tap).
    let setup = cfg
        .nics
        .iter()
        .flat_map(|n| n.fds.iter())
        .fold(spawn::vm_child(cfg)?, |s, fd| {
            s.keep(std::os::fd::AsFd::as_fd(&**fd))
        });
    setup
        .apply(&mut cmd)
        .map_err(|e| VmError::InvalidConfig(format!("QEMU's start: {e}")))?;
    cmd.spawn().map_err(|source| VmError::Spawn {
        binary: cfg.qemu_binary.clone(),
        source,
    })
}
