//! A running QEMU guest.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::accel::{self, AccelChoice, ResolvedAccel};
use crate::config::{
    Accel, DiskSpec, ShareSpec, VIRTIOFSD_ARGS, VmConfig, boot_port_id, hotplug_port_id,
};
use crate::{AGENT_PORT_NAME, STDIO_PORT_NAME, VmError};

/// How long QEMU gets to create its sockets before launch gives up.
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a virtiofsd gets to create its socket.
const VIRTIOFSD_TIMEOUT: Duration = Duration::from_secs(10);

/// Files in a VM's run directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunPaths {
    pub run_dir: PathBuf,
    /// QMP monitor (`-qmp unix:...,server=on,wait=off`).
    pub qmp_socket: PathBuf,
    /// The agent's virtio-serial port (`org.crust.agent`).
    pub agent_socket: PathBuf,
    /// The stdio port of container processes (`org.crust.stdio`).
    pub stdio_socket: PathBuf,
    /// Guest serial console.
    pub console_log: PathBuf,
    /// QEMU's own stdout/stderr.
    pub qemu_log: PathBuf,
    /// QEMU's pid.
    pub pid_file: PathBuf,
    /// [`VmState`] as JSON.
    pub state_file: PathBuf,
}

impl RunPaths {
    /// vhost-user socket of share `i`'s virtiofsd.
    pub fn fs_socket(&self, i: usize) -> PathBuf {
        self.run_dir.join(format!("fs{i}.sock"))
    }

    /// Log of share `i`'s virtiofsd.
    pub fn fs_log(&self, i: usize) -> PathBuf {
        self.run_dir.join(format!("virtiofsd{i}.log"))
    }

    pub fn new(run_dir: impl Into<PathBuf>) -> Self {
        let d: PathBuf = run_dir.into();
        RunPaths {
            qmp_socket: d.join("qmp.sock"),
            agent_socket: d.join("agent.sock"),
            stdio_socket: d.join("stdio.sock"),
            console_log: d.join("console.log"),
            qemu_log: d.join("qemu.log"),
            pid_file: d.join("qemu.pid"),
            state_file: d.join("vm.json"),
            run_dir: d,
        }
    }
}

/// What `vm.json` records, so another process can find and drive the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmState {
    pub name: String,
    pub pid: u32,
    /// Process start time (clock ticks since boot, `/proc/<pid>/stat` field
    /// 22): tells a reused pid apart.
    pub start_time: u64,
    pub accel: ResolvedAccel,
    /// Why `accel` was chosen (see [`AccelChoice`]).
    #[serde(default)]
    pub accel_reason: String,
    /// The guest was booted again under TCG after a KVM boot hung.
    #[serde(default)]
    pub accel_fallback: bool,
    /// Boot disks and the root port each sits on.
    pub boot_disks: Vec<(DiskSpec, String)>,
    /// Root ports left empty for hot-plug.
    pub hotplug_ports: Vec<String>,
    /// The virtiofsd of each share (same order as the shares).
    #[serde(default)]
    pub virtiofsd: Vec<DaemonRef>,
    #[serde(default)]
    pub shares: Vec<ShareSpec>,
}

/// A helper process of the VM, identified by pid and start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonRef {
    pub pid: u32,
    pub start_time: u64,
}

impl DaemonRef {
    /// Still the same live (non-zombie) process.
    pub fn alive(&self) -> bool {
        matches!(proc_start_time(self.pid), Some((t, false)) if t == self.start_time)
    }
}

/// How QEMU ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmExit {
    /// Exit status, when known (only for a VM this process launched).
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// QEMU was killed because a virtiofsd of the VM died.
    pub virtiofsd_died: bool,
}

impl VmExit {
    /// Exited with status 0 (a guest power-off or reset under -no-reboot).
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

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

fn io_err(op: &'static str, path: &Path, source: std::io::Error) -> VmError {
    VmError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// QEMU's key=value syntax escapes a comma by doubling it.
fn esc(p: &Path) -> String {
    p.to_string_lossy().replace(',', ",,")
}

/// Last `max` bytes of a file, lossily decoded.
pub fn tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).trim().to_owned()
}

/// Writes `data` to `path` atomically (temp file, fsync, rename, fsync dir).
fn write_atomic(path: &Path, data: &[u8]) -> Result<(), VmError> {
    let dir = path.parent().expect("file in a directory");
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| io_err("create", &tmp, e))?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(|e| io_err("chmod", &tmp, e))?;
    f.write_all(data).map_err(|e| io_err("write", &tmp, e))?;
    f.sync_all().map_err(|e| io_err("fsync", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io_err("rename", path, e))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err("fsync", dir, e))
}

/// Field 22 of `/proc/<pid>/stat`, and whether the process is a zombie.
fn proc_start_time(pid: u32) -> Option<(u64, bool)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parens: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    // rest starts at field 3 (state); field 22 is index 19.
    let zombie = fields.first() == Some(&"Z") || fields.first() == Some(&"X");
    Some((fields.get(19)?.parse().ok()?, zombie))
}

fn proc_cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
    )
}

/// Whether `pid` is still the QEMU recorded in `state`/`paths`.
fn is_our_qemu(state: &VmState, paths: &RunPaths) -> bool {
    match proc_start_time(state.pid) {
        Some((t, zombie)) if t == state.start_time && !zombie => {}
        _ => return false,
    }
    let qmp_arg = format!("unix:{},server=on,wait=off", esc(&paths.qmp_socket));
    proc_cmdline(state.pid).is_some_and(|c| c.contains(&qmp_arg))
}

fn read_state(paths: &RunPaths) -> Option<VmState> {
    let data = std::fs::read(&paths.state_file).ok()?;
    serde_json::from_slice(&data).ok()
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

const BASE_CMDLINE: &[&str] = &[
    "console=ttyS0",
    "panic=-1",
    "quiet",
    "loglevel=4",
    "rdinit=/init",
    // Nothing is behind the legacy keyboard controller; probing it costs
    // boot time under TCG.
    "i8042.noaux",
    "i8042.nomux",
    "i8042.nopnp",
    "i8042.dumbkbd",
    // A VM's TSC needs no watchdog or re-calibration; skip crypto
    // self-tests and audit: all boot time under TCG.
    "tsc=reliable",
    "no_timer_check",
    "cryptomgr.notests",
    "audit=0",
    // No bounce buffers: virtio devices address guest memory directly.
    // With hot-pluggable memory above 4 GiB the kernel would otherwise set
    // aside (and zero, so the host backs it) a 64 MiB SWIOTLB pool.
    "swiotlb=noforce",
];

fn qemu_args(cfg: &VmConfig, accel: ResolvedAccel, paths: &RunPaths) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    // Threads named by role (`CPU 0/TCG`, `worker`...): their CPU time can
    // be told apart in /proc (top -H, the pod network benchmark).
    push(&["-name", &format!("crust-{},debug-threads=on", cfg.name)]);
    push(&["-machine", "q35"]);
    match accel {
        ResolvedAccel::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
        ResolvedAccel::Tcg => push(&["-accel", "tcg"]),
    }
    let mem = if cfg.memory_hotplug() {
        format!(
            "{}M,slots={},maxmem={}M",
            cfg.memory_mib,
            crate::config::MEMORY_SLOTS,
            cfg.max_memory_mib
        )
    } else {
        cfg.memory_mib.to_string()
    };
    let smp = if cfg.cpu_hotplug() {
        format!("{},maxcpus={}", cfg.cpus, cfg.max_cpus)
    } else {
        cfg.cpus.to_string()
    };
    push(&["-m", &mem, "-smp", &smp]);
    if !cfg.shares.is_empty() {
        // vhost-user devices map guest RAM: it must be shareable memory.
        push(&[
            "-object",
            &format!(
                "memory-backend-memfd,id=crust-mem,size={}M,share=on",
                cfg.memory_mib
            ),
            "-numa",
            "node,memdev=crust-mem",
        ]);
    }
    push(&["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
    push(&["-msg", "timestamp=on"]);
    if let Some(fw) = cfg.firmware_path() {
        push(&["-bios", &fw.to_string_lossy()]);
    }
    let mut cmdline: Vec<String> = BASE_CMDLINE.iter().map(|s| s.to_string()).collect();
    if cfg.memory_hotplug() {
        // Hot-added DIMMs come online by themselves.
        cmdline.push("memhp_default_state=online".into());
    }
    cmdline.extend(cfg.kernel_cmdline_extra.iter().cloned());
    push(&["-kernel", &cfg.kernel.to_string_lossy()]);
    push(&["-initrd", &cfg.initrd.to_string_lossy()]);
    push(&["-append", &cmdline.join(" ")]);
    push(&[
        "-chardev",
        &format!("file,id=crust-console,path={}", esc(&paths.console_log)),
        "-serial",
        "chardev:crust-console",
    ]);
    push(&[
        "-qmp",
        &format!("unix:{},server=on,wait=off", esc(&paths.qmp_socket)),
    ]);
    push(&[
        "-device",
        "virtio-serial-pci,id=crust-vser",
        "-chardev",
        &format!(
            "socket,id=crust-agent,path={},server=on,wait=off",
            esc(&paths.agent_socket)
        ),
        "-device",
        &format!("virtserialport,bus=crust-vser.0,chardev=crust-agent,name={AGENT_PORT_NAME}"),
        "-chardev",
        &format!(
            "socket,id=crust-stdio,path={},server=on,wait=off",
            esc(&paths.stdio_socket)
        ),
        "-device",
        &format!("virtserialport,bus=crust-vser.0,chardev=crust-stdio,name={STDIO_PORT_NAME}"),
    ]);
    for (i, sh) in cfg.shares.iter().enumerate() {
        push(&[
            "-chardev",
            &format!("socket,id=crust-fs{i},path={}", esc(&paths.fs_socket(i))),
            "-device",
            &format!("vhost-user-fs-pci,chardev=crust-fs{i},tag={}", sh.tag),
        ]);
    }
    // Free page reporting: pages the guest frees go back to the host
    // (QEMU discards them), so a pod's host memory falls again after its
    // guest's page cache or heap shrinks. Never inflated.
    push(&[
        "-device",
        "virtio-balloon-pci,id=crust-balloon,free-page-reporting=on",
    ]);
    let vhost = std::path::Path::new(crate::config::VHOST_NET).exists();
    for (i, nic) in cfg.nics.iter().enumerate() {
        let (netdev, device) = nic.qemu_args(i, vhost);
        push(&["-netdev", &netdev, "-device", &device]);
    }
    let mut chassis = 1;
    for (i, d) in cfg.disks.iter().enumerate() {
        let port = boot_port_id(i);
        push(&[
            "-device",
            &format!("pcie-root-port,id={port},chassis={chassis}"),
        ]);
        chassis += 1;
        // JSON syntax: no escaping of paths needed.
        push(&["-blockdev", &d.blockdev_add_args().to_string()]);
        // A queue per vCPU and an iothread per disk, as hot-plugs get
        // (crust-qmp's device_add_virtio_blk); the host's sector size.
        let iothread = d.iothread_id();
        push(&["-object", &format!("iothread,id={iothread}")]);
        let mut dev = d.device_add_args(&port);
        dev["num-queues"] = json!(cfg.cpus);
        dev["iothread"] = json!(iothread);
        if let Ok(bs) = crust_blockdev::logical_block_size(&d.path) {
            dev["logical_block_size"] = json!(bs);
            dev["physical_block_size"] = json!(bs);
        }
        push(&["-device", &dev.to_string()]);
    }
    for i in 0..cfg.hotplug_ports {
        push(&[
            "-device",
            &format!("pcie-root-port,id={},chassis={chassis}", hotplug_port_id(i)),
        ]);
        chassis += 1;
    }
    a
}

/// Kills daemons started for a launch that then failed.
struct DaemonGuard(Vec<Child>);

impl Drop for DaemonGuard {
    fn drop(&mut self) {
        for d in &mut self.0 {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

/// Starts the virtiofsd of share `i` and waits for its socket.
async fn start_virtiofsd(
    cfg: &VmConfig,
    paths: &RunPaths,
    i: usize,
    sh: &ShareSpec,
) -> Result<Child, VmError> {
    let sock = paths.fs_socket(i);
    match std::fs::remove_file(&sock) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("remove", &sock, e)),
    }
    let log_path = paths.fs_log(i);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&log_path)
        .map_err(|e| io_err("create", &log_path, e))?;
    let log2 = log.try_clone().map_err(|e| io_err("dup", &log_path, e))?;
    let mut cmd = Command::new(&cfg.virtiofsd_binary);
    cmd.arg("--socket-path")
        .arg(&sock)
        .arg("--shared-dir")
        .arg(&sh.dir)
        .args(VIRTIOFSD_ARGS)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .process_group(0);
    if cfg.die_with_parent {
        // SAFETY: a single raw prctl between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
                Ok(())
            });
        }
    }
    let failed = |reason: String| VmError::Virtiofsd {
        tag: sh.tag.clone(),
        reason,
    };
    let mut child = cmd.spawn().map_err(|e| {
        failed(format!(
            "{}: {e} (install it: cargo install virtiofsd)",
            cfg.virtiofsd_binary.display()
        ))
    })?;
    let deadline = Instant::now() + VIRTIOFSD_TIMEOUT;
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            return Err(failed(format!("exited ({st}): {}", tail(&log_path, 2048))));
        }
        if sock.exists() {
            return Ok(child);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(failed(format!(
                "no socket after {VIRTIOFSD_TIMEOUT:?}: {}",
                tail(&log_path, 2048)
            )));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl Vm {
    /// Starts QEMU for `cfg` and waits until its QMP monitor answers a
    /// command (the machine is built, sockets exist) — not for the guest to boot: use
    /// the agent client's `wait_ready` for that.
    ///
    /// Fails with [`VmError::AlreadyRunning`] if a live QEMU already owns
    /// `run_dir`, and with [`VmError::EarlyExit`] (carrying the tail of
    /// `qemu.log`) if QEMU dies while starting.
    pub async fn launch(cfg: VmConfig) -> Result<Vm, VmError> {
        cfg.validate()?;
        let choice = accel::choose(&cfg).await?;
        Vm::launch_with(cfg, choice).await
    }

    /// Launches the guest and waits until its agent answers a ping. With
    /// `Accel::Auto`, a KVM boot that does not reach the agent within
    /// `cfg.kvm_boot_timeout` is killed, recorded (later boots on this
    /// host boot use TCG) and booted again under TCG with the full
    /// `ready_timeout`; the VM's [`Vm::accel_choice`] tells what happened.
    pub async fn boot(cfg: VmConfig, ready_timeout: Duration) -> Result<Vm, VmError> {
        cfg.validate()?;
        let choice = accel::choose(&cfg).await?;
        let auto_kvm = cfg.accel == Accel::Auto && choice.accel == ResolvedAccel::Kvm;
        let first_wait = if auto_kvm {
            cfg.kvm_boot_timeout.min(ready_timeout)
        } else {
            ready_timeout
        };
        let mut vm = Vm::launch_with(cfg.clone(), choice.clone()).await?;
        let why = match wait_agent(&mut vm, first_wait).await {
            Ok(()) => return Ok(vm),
            Err(why) => why,
        };
        let context = boot_context(&vm.paths);
        if !auto_kvm {
            let e = VmError::NotReady {
                after: first_wait,
                accel: choice.accel.as_str(),
                reason: why,
                context: vm.failure_context(),
            };
            let _ = vm.kill();
            if cfg.accel == Accel::Auto {
                // Not even TCG boots it: a negative KVM verdict built on
                // this image proves nothing.
                accel::forget_failure(&cfg).await;
            }
            return Err(e);
        }
        let reason = format!(
            "a KVM boot did not reach the guest agent within {first_wait:?} ({why}{}); booted again under TCG",
            context.map(|c| format!("; {c}")).unwrap_or_default()
        );
        tracing::warn!(vm = %cfg.name, "{reason}");
        vm.kill()?;
        drop(vm);
        accel::record_failure(&cfg, &reason).await;
        let tcg = AccelChoice {
            accel: ResolvedAccel::Tcg,
            reason,
            fallback: true,
        };
        let mut vm = Vm::launch_with(cfg, tcg).await?;
        match wait_agent(&mut vm, ready_timeout).await {
            Ok(()) => Ok(vm),
            Err(why) => {
                let e = VmError::NotReady {
                    after: ready_timeout,
                    accel: "tcg",
                    reason: why,
                    context: vm.failure_context(),
                };
                let _ = vm.kill();
                Err(e)
            }
        }
    }

    /// [`Vm::launch`] with the accelerator already chosen.
    pub(crate) async fn launch_with(cfg: VmConfig, choice: AccelChoice) -> Result<Vm, VmError> {
        cfg.validate()?;
        let paths = RunPaths::new(&cfg.run_dir);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&paths.run_dir)
            .map_err(|e| io_err("mkdir", &paths.run_dir, e))?;
        std::fs::set_permissions(&paths.run_dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| io_err("chmod", &paths.run_dir, e))?;
        if let Some(old) = read_state(&paths)
            && is_our_qemu(&old, &paths)
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
            &paths.pid_file,
            &paths.state_file,
        ] {
            match std::fs::remove_file(stale) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("remove", stale, e)),
            }
        }
        let accel = choice.accel;
        let mut daemons = DaemonGuard(Vec::new());
        for (i, sh) in cfg.shares.iter().enumerate() {
            daemons.0.push(start_virtiofsd(&cfg, &paths, i, sh).await?);
        }
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
        cmd.args(qemu_args(&cfg, accel, &paths))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0);
        let inherited: Vec<i32> = cfg
            .nics
            .iter()
            .flat_map(|n| n.fds.iter().map(|f| std::os::fd::AsRawFd::as_raw_fd(&**f)))
            .collect();
        if !inherited.is_empty() {
            // SAFETY: only fcntl between fork and exec, on descriptors the
            // config keeps open; the flag is cleared in the child alone, so
            // no other process of ours inherits a tap.
            unsafe {
                cmd.pre_exec(move || {
                    for fd in &inherited {
                        let f = rustix::fd::BorrowedFd::borrow_raw(*fd);
                        rustix::io::fcntl_setfd(f, rustix::io::FdFlags::empty())?;
                    }
                    Ok(())
                });
            }
        }
        if cfg.die_with_parent {
            // SAFETY: a single raw prctl between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().map_err(|source| VmError::Spawn {
            binary: cfg.qemu_binary.clone(),
            source,
        })?;
        let daemons = std::mem::take(&mut daemons.0);
        let pid = child.id();
        let start_time = proc_start_time(pid).map(|(t, _)| t).unwrap_or(0);
        let state = VmState {
            name: cfg.name.clone(),
            pid,
            start_time,
            accel,
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

        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(exit) = vm.poll_exit() {
                return Err(VmError::EarlyExit {
                    status: format!("{exit:?}"),
                    log_tail: tail(&vm.paths.qemu_log, 4096),
                });
            }
            if vm.paths.qmp_socket.exists()
                && vm.paths.agent_socket.exists()
                && qmp_ready(&vm.paths.qmp_socket).await
            {
                return Ok(vm);
            }
            if Instant::now() >= deadline {
                let log_tail = tail(&vm.paths.qemu_log, 4096);
                vm.kill()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_shape() {
        let k = tempfile::NamedTempFile::new().unwrap();
        let mut cfg = VmConfig::new("t1", k.path(), k.path(), "/run/x,y");
        cfg.disks.push(DiskSpec {
            id: "data".into(),
            path: k.path().into(),
            serial: "crust-data".into(),
            readonly: true,
        });
        cfg.hotplug_ports = 2;
        cfg.max_memory_mib = 2048;
        cfg.max_cpus = 4;
        cfg.kernel_cmdline_extra = vec!["foo=bar".into()];
        cfg.shares.push(ShareSpec {
            tag: "pod".into(),
            dir: "/srv".into(),
        });
        let paths = RunPaths::new(&cfg.run_dir);
        let a = qemu_args(&cfg, ResolvedAccel::Tcg, &paths);
        let joined = a.join(" ");
        for want in [
            "-machine q35",
            "-accel tcg",
            "-nodefaults -no-user-config -nographic -no-reboot",
            "unix:/run/x,,y/qmp.sock,server=on,wait=off",
            "socket,id=crust-agent,path=/run/x,,y/agent.sock,server=on,wait=off",
            "name=org.crust.agent",
            "pcie-root-port,id=crust-boot0,chassis=1",
            "pcie-root-port,id=crust-hp0,chassis=2",
            "pcie-root-port,id=crust-hp1,chassis=3",
            "foo=bar",
            "memory-backend-memfd,id=crust-mem,size=256M,share=on",
            "-numa node,memdev=crust-mem",
            "-m 256M,slots=8,maxmem=2048M",
            "-smp 1,maxcpus=4",
            "memhp_default_state=online",
            "socket,id=crust-fs0,path=/run/x,,y/fs0.sock",
            "vhost-user-fs-pci,chardev=crust-fs0,tag=pod",
        ] {
            assert!(joined.contains(want), "missing {want:?} in {joined}");
        }
        let bd = a.iter().position(|x| x == "-blockdev").unwrap();
        let v: serde_json::Value = serde_json::from_str(&a[bd + 1]).unwrap();
        assert_eq!(v["read-only"], true);
        assert_eq!(v["file"]["cache"]["direct"], true);
        assert_eq!(
            a[bd + 2..bd + 4],
            ["-object", "iothread,id=iothread-crust-disk-data"]
        );
        let dev: serde_json::Value = serde_json::from_str(&a[bd + 5]).unwrap();
        assert_eq!(dev["bus"], "crust-boot0");
        assert_eq!(dev["serial"], "crust-data");
        assert_eq!(dev["iothread"], "iothread-crust-disk-data");
        assert_eq!(dev["num-queues"], cfg.cpus);
    }

    #[test]
    fn proc_stat_parsing_of_self() {
        let (t, zombie) = proc_start_time(std::process::id()).unwrap();
        assert!(t > 0);
        assert!(!zombie);
        assert!(proc_start_time(u32::MAX).is_none());
    }

    #[test]
    fn atomic_write_and_tail() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        write_atomic(&p, b"hello world").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"hello world");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(tail(&p, 5), "world");
        assert_eq!(tail(&d.path().join("missing"), 5), "");
    }
}
