//! The pod's containers in the guest: each one a mount namespace over its
//! rootfs (a directory of a virtio-fs share), a cgroup, an init process
//! and its exec processes, with stdio over the stdio port.
//!
//! Processes are started through the init helper ([`init`]), the agent
//! binary re-executed, so that namespace, mount and credential changes
//! happen in a fresh single-threaded process and errors come back as text.

pub mod caps;
pub mod cgroup;
pub mod hostname;
pub mod init;
pub mod rootfs;
pub mod seccomp;
pub mod stdio;
pub mod userns;

use crust_sys::spawn::ChildSetup;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::Duration;

use crust_agent_proto::stdio::Kind;
use crust_agent_proto::{
    AgentError, ContainerStatsReply, CreateContainer, ErrorCode, ExecProcess, GUEST_SHARE_ROOT,
    MountSource, NamespaceSource, PidsReply, ProcessExit, ProcessRef, ProcessReply, ProcessSpec,
    ResizePty, Rootfs, Seccomp, ShareRef, SignalProcess, StdioSpec, WaitReply, valid_id,
    valid_share_path,
};
use rustix::fs::{Mode, OFlags};

use init::{INIT_ARG, InitMode, InitSpec, SYNC_ENV};
use stdio::{StdinMsg, StdioPort};

/// Per-container scratch directories (the rootfs mount point).
pub const CONTAINERS_DIR: &str = "/run/crust/containers";
/// The pod's shared memory, one tmpfs per guest (the containers' `/dev/shm`).
pub const POD_SHM: &str = "/run/crust/pod-shm";

/// How long the helper gets to set a container up or to `exec`.
const HELPER_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("container {0:?} does not exist")]
    NoContainer(String),
    #[error("container {container:?} has no process {exec:?}")]
    NoProcess { container: String, exec: String },
    #[error("{0} already exists")]
    Exists(String),
    #[error("{0}")]
    Precondition(String),
    /// The helper reported a failure building the container or starting
    /// the process (missing binary, bad mount...).
    #[error("{0}")]
    Setup(String),
    #[error("{0}")]
    Internal(String),
}

impl From<ContainerError> for AgentError {
    fn from(e: ContainerError) -> AgentError {
        let code = match &e {
            ContainerError::Invalid(_) | ContainerError::Setup(_) => ErrorCode::InvalidArgument,
            ContainerError::NoContainer(_) | ContainerError::NoProcess { .. } => {
                ErrorCode::NotFound
            }
            ContainerError::Exists(_) => ErrorCode::AlreadyExists,
            ContainerError::Precondition(_) => ErrorCode::FailedPrecondition,
            ContainerError::Internal(_) => ErrorCode::Internal,
        };
        AgentError::new(code, e.to_string())
    }
}

type Result<T> = std::result::Result<T, ContainerError>;

/// One process (a container's init or an exec).
struct Proc {
    pid: u32,
    stream: u32,
    exit: Mutex<Option<ProcessExit>>,
    cv: Condvar,
    stdin: Mutex<Option<mpsc::Sender<StdinMsg>>>,
    pty: Option<OwnedFd>,
}

impl Proc {
    fn exited(&self) -> Option<ProcessExit> {
        *self.exit.lock().expect("exit")
    }
}

struct Container {
    id: String,
    init: Arc<Proc>,
    /// The helper waiting to `exec` the init process, until started.
    start: Mutex<Option<UnixStream>>,
    started: AtomicBool,
    execs: Mutex<HashMap<String, Arc<Proc>>>,
    /// Deferred volumes bound into the container.
    volumes: Vec<String>,
    /// Its seccomp profile, which every exec gets too.
    seccomp: Option<Seccomp>,
    /// A guest-rooted container's mount namespace (the runtime CLI's
    /// workload), held until the container is removed: the CLI's `exec`
    /// runs there, also after the init exited, and its volumes stay in use.
    mount_ns: Mutex<Option<OwnedFd>>,
}

/// The containers of this guest.
#[derive(Default)]
pub struct Containers {
    map: Mutex<HashMap<String, Arc<Container>>>,
    stdio: StdioPort,
    /// Serializes share mounting.
    shares: Mutex<()>,
}

fn io<E: std::fmt::Display>(what: impl std::fmt::Display) -> impl FnOnce(E) -> ContainerError {
    move |e| ContainerError::Internal(format!("{what}: {e}"))
}

/// Guest path of a share path, mounting the share on first use.
pub fn share_path(s: &ShareRef) -> std::result::Result<PathBuf, String> {
    if !valid_share_path(&s.path) {
        return Err(format!(
            "share path {:?} must be relative without '.' or '..'",
            s.path
        ));
    }
    Ok(share_root(&s.tag)?.join(&s.path))
}

/// Guest path where share `tag` is mounted, mounting it on first use.
pub fn share_root(tag: &str) -> std::result::Result<PathBuf, String> {
    if !valid_id(tag) {
        return Err(format!("share tag {tag:?} is invalid"));
    }
    let root = Path::new(GUEST_SHARE_ROOT).join(tag);
    if crate::sys::mount_at(&root).is_none() {
        crate::sys::ensure_filesystem_named("virtiofs")?;
        std::fs::create_dir_all(&root).map_err(|e| format!("mkdir {}: {e}", root.display()))?;
        rustix::mount::mount(
            tag,
            root.as_path(),
            "virtiofs",
            rustix::mount::MountFlags::NODEV,
            None,
        )
        .map_err(|e| format!("mounting virtio-fs share {tag:?}: {e}"))?;
    }
    Ok(root)
}

impl Containers {
    pub fn new(stdio: StdioPort) -> Containers {
        Containers {
            stdio,
            ..Default::default()
        }
    }

    /// Guest-wide setup for containers: devpts (pseudo-terminals), cgroup2,
    /// the pod's shm. Errors are returned for logging; containers that need
    /// the missing piece fail later with their own error.
    pub fn init_guest() -> std::result::Result<(), String> {
        let pts = Path::new("/dev/pts");
        if crate::sys::mount_at(pts).is_none() {
            let _ = std::fs::create_dir_all(pts);
            let data = c"newinstance,ptmxmode=0666,mode=0620";
            rustix::mount::mount(
                "devpts",
                pts,
                "devpts",
                rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NOEXEC,
                Some(data),
            )
            .map_err(|e| format!("mount devpts: {e}"))?;
            // openpt() uses /dev/ptmx: point it at this instance.
            let _ = std::fs::remove_file("/dev/ptmx");
            let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
        }
        let shm = Path::new(POD_SHM);
        if crate::sys::mount_at(shm).is_none() {
            std::fs::create_dir_all(shm).map_err(|e| format!("mkdir {POD_SHM}: {e}"))?;
            rustix::mount::mount(
                "shm",
                shm,
                "tmpfs",
                rustix::mount::MountFlags::NOSUID
                    | rustix::mount::MountFlags::NODEV
                    | rustix::mount::MountFlags::NOEXEC,
                Some(c"mode=1777,size=65536k"),
            )
            .map_err(|e| format!("mount {POD_SHM}: {e}"))?;
        }
        cgroup::init_root()
    }

    /// A descriptor of container `id`'s mount namespace.
    pub fn mount_ns(&self, id: &str) -> Result<OwnedFd> {
        let c = self.get(id)?;
        let held = c.mount_ns.lock().expect("mount_ns");
        let ns = held.as_ref().ok_or_else(|| {
            ContainerError::Precondition(format!(
                "container {id:?} does not run on the guest's root: exec into it instead"
            ))
        })?;
        ns.try_clone()
            .map_err(io(format!("container {id:?}: its mount namespace")))
    }

    fn get(&self, id: &str) -> Result<Arc<Container>> {
        self.map
            .lock()
            .expect("containers")
            .get(id)
            .cloned()
            .ok_or_else(|| ContainerError::NoContainer(id.into()))
    }

    fn process(&self, r: &ProcessRef) -> Result<Arc<Proc>> {
        let c = self.get(&r.container)?;
        match &r.exec_id {
            None => Ok(c.init.clone()),
            Some(e) => c
                .execs
                .lock()
                .expect("execs")
                .get(e)
                .cloned()
                .ok_or_else(|| ContainerError::NoProcess {
                    container: r.container.clone(),
                    exec: e.clone(),
                }),
        }
    }

    /// Checks the request, waits for its disks, plans its namespaces,
    /// then has the init helper build the container; its init waits for
    /// [`Containers::start`].
    pub fn create(&self, req: &CreateContainer) -> Result<ProcessReply> {
        let volumes = check_create(req)?;
        if self.map.lock().expect("containers").contains_key(&req.id) {
            return Err(ContainerError::Exists(format!("container {:?}", req.id)));
        }
        let rootfs = self.shared_paths(req)?;
        let devices = wait_for_devices(&req.devices)?;
        let ns = self.namespaces(req)?;
        hostname::apply_from_binds(&req.mounts);
        let mountpoint = Path::new(CONTAINERS_DIR).join(&req.id).join("rootfs");
        std::fs::create_dir_all(&mountpoint)
            .map_err(io(format!("mkdir {}", mountpoint.display())))?;
        let cg =
            cgroup::create(&req.id, req.memory_limit_bytes).map_err(ContainerError::Internal)?;
        let spec = InitSpec {
            mode: InitMode::Create {
                rootfs,
                guest_root: matches!(req.rootfs, Rootfs::Guest),
                mountpoint,
                rootfs_readonly: req.rootfs_readonly,
                mounts: req.mounts.clone(),
                masked_paths: req.masked_paths.clone(),
                readonly_paths: req.readonly_paths.clone(),
                devices,
                ipc: ns.ipc,
                uts: ns.uts,
                hostname: req.hostname.clone(),
                sysctl: req.sysctl.clone(),
                user: ns.user,
            },
            cgroup: Some(cg),
            process: req.process.clone(),
            seccomp: req.seccomp.clone(),
        };
        let spawned = match self.spawn(&spec, ns.pid) {
            Ok(s) => s,
            Err(e) => {
                cgroup::remove(&req.id, Duration::from_secs(5));
                let _ = std::fs::remove_dir_all(Path::new(CONTAINERS_DIR).join(&req.id));
                return Err(e);
            }
        };
        self.await_ready(req, spawned, ns.holder, volumes)
    }

    /// The rootfs (a directory of a share, or the guest's root), and every
    /// share a mount names resolved: none may leave the share.
    fn shared_paths(&self, req: &CreateContainer) -> Result<PathBuf> {
        let rootfs = match &req.rootfs {
            Rootfs::Guest => PathBuf::from("/"),
            Rootfs::Share(share) => {
                let path = {
                    let _g = self.shares.lock().expect("shares");
                    share_path(share).map_err(ContainerError::Invalid)?
                };
                if !path.is_dir() {
                    return Err(ContainerError::Invalid(format!(
                        "rootfs {} is not a directory in the share",
                        share.path
                    )));
                }
                path
            }
        };
        for m in &req.mounts {
            if let MountSource::Share(s) = &m.source {
                let _g = self.shares.lock().expect("shares");
                share_path(s).map_err(ContainerError::Invalid)?;
            }
        }
        Ok(rootfs)
    }

    /// The namespaces the helper joins or creates; a new user namespace
    /// is held by a [`userns::Holder`] until the helper has joined it.
    fn namespaces(&self, req: &CreateContainer) -> Result<Namespaces> {
        let ipc = self.ns_plan(&req.ipc, "ipc")?;
        let uts = self.ns_plan(&req.uts, "uts")?;
        let pid = self.ns_plan(&req.pid, "pid")?;
        let holder = match &req.user.source {
            NamespaceSource::New => Some(
                userns::Holder::new(&req.user.uid_mappings, &req.user.gid_mappings)
                    .map_err(ContainerError::Invalid)?,
            ),
            _ => None,
        };
        let user = match &holder {
            Some(h) => init::NsPlan::Join(h.pid()),
            None => self.ns_plan(&req.user.source, "user")?,
        };
        Ok(Namespaces {
            ipc,
            uts,
            pid,
            user,
            holder,
        })
    }

    /// Waits for the helper's `ready`, then records the container and
    /// watches its init; a helper that fails is reaped with what it made.
    fn await_ready(
        &self,
        req: &CreateContainer,
        spawned: Spawned,
        holder: Option<userns::Holder>,
        volumes: Vec<String>,
    ) -> Result<ProcessReply> {
        let Spawned {
            child,
            mut sync,
            proc,
        } = spawned;
        // The helper sets the container up and says `ready` (or why not).
        let line = read_line(&mut sync);
        drop(holder);
        if line.as_deref() != Some("ready") {
            self.reap_failed(&req.id, child, &proc);
            return Err(ContainerError::Setup(helper_error(
                line,
                "setting up the container",
            )));
        }
        // The helper waits for its start: its namespace is the container's.
        let mount_ns = matches!(req.rootfs, Rootfs::Guest)
            .then(|| std::fs::File::open(format!("/proc/{}/ns/mnt", proc.pid)))
            .transpose()
            .map_err(io(format!("container {:?}: its mount namespace", req.id)));
        let mount_ns = match mount_ns {
            Ok(ns) => ns.map(OwnedFd::from),
            Err(e) => {
                self.reap_failed(&req.id, child, &proc);
                return Err(e);
            }
        };
        let c = Arc::new(Container {
            id: req.id.clone(),
            init: proc.clone(),
            start: Mutex::new(Some(sync)),
            started: AtomicBool::new(false),
            execs: Mutex::new(HashMap::new()),
            volumes,
            seccomp: req.seccomp.clone(),
            mount_ns: Mutex::new(mount_ns),
        });
        self.map
            .lock()
            .expect("containers")
            .insert(req.id.clone(), c.clone());
        self.watch(child, proc.clone(), Some(req.id.clone()));
        Ok(ProcessReply { pid: proc.pid })
    }

    /// A namespace source as the helper takes it: another container's
    /// must be running here.
    fn ns_plan(&self, src: &NamespaceSource, name: &str) -> Result<init::NsPlan> {
        Ok(match src {
            NamespaceSource::Guest => init::NsPlan::Inherit,
            NamespaceSource::New => init::NsPlan::New,
            NamespaceSource::Container { id } => {
                let c = self.get(id).map_err(|_| {
                    ContainerError::Invalid(format!(
                        "{name} namespace of container {id:?}: no such container"
                    ))
                })?;
                if c.init.exited().is_some() {
                    return Err(ContainerError::Precondition(format!(
                        "{name} namespace of container {id:?}: it has exited"
                    )));
                }
                init::NsPlan::Join(c.init.pid)
            }
        })
    }

    /// Lets the init process `exec`. Starting a started container is a
    /// success (idempotent).
    pub fn start(&self, id: &str) -> Result<ProcessReply> {
        let c = self.get(id)?;
        let sync = c.start.lock().expect("start").take();
        let Some(mut sync) = sync else {
            if c.started.load(Ordering::SeqCst) {
                return Ok(ProcessReply { pid: c.init.pid });
            }
            return Err(ContainerError::Precondition(format!(
                "container {id:?} cannot be started"
            )));
        };
        if let Some(exit) = c.init.exited() {
            return Err(ContainerError::Precondition(format!(
                "container {id:?} exited before it was started ({})",
                exit.exit_code
            )));
        }
        sync.write_all(b"s")
            .map_err(io(format!("starting container {id:?}")))?;
        match read_rest(&mut sync) {
            Some(msg) if !msg.is_empty() => Err(ContainerError::Setup(helper_error(
                Some(msg),
                "starting the process",
            ))),
            _ => {
                c.started.store(true, Ordering::SeqCst);
                Ok(ProcessReply { pid: c.init.pid })
            }
        }
    }

    pub fn exec(&self, req: &ExecProcess) -> Result<ProcessReply> {
        if !valid_id(&req.exec_id) {
            return Err(ContainerError::Invalid(format!(
                "exec id {:?} is invalid",
                req.exec_id
            )));
        }
        validate_process(&req.process)?;
        let c = self.get(&req.container)?;
        if !c.started.load(Ordering::SeqCst) || c.init.exited().is_some() {
            return Err(ContainerError::Precondition(format!(
                "container {:?} is not running",
                req.container
            )));
        }
        // An exec id may be used again once its process has exited (the
        // container manager deletes execs and reuses ids).
        if let Some(old) = c.execs.lock().expect("execs").get(&req.exec_id)
            && old.exited().is_none()
        {
            return Err(ContainerError::Exists(format!(
                "exec {:?} in container {:?} is still running",
                req.exec_id, req.container
            )));
        }
        let spec = InitSpec {
            mode: InitMode::Exec {
                init_pid: c.init.pid,
            },
            cgroup: Some(cgroup::path(&c.id)),
            process: req.process.clone(),
            seccomp: c.seccomp.clone(),
        };
        // setns, then fork: the exec is a process of the container's PID
        // namespace (one that is not cannot be moved into it).
        let Spawned {
            child,
            mut sync,
            proc,
        } = self.spawn(&spec, init::NsPlan::Join(c.init.pid))?;
        if let Some(msg) = read_rest(&mut sync).filter(|m| !m.is_empty()) {
            self.reap_failed("", child, &proc);
            return Err(ContainerError::Setup(helper_error(
                Some(msg),
                "starting the exec",
            )));
        }
        c.execs
            .lock()
            .expect("execs")
            .insert(req.exec_id.clone(), proc.clone());
        self.watch(child, proc.clone(), None);
        Ok(ProcessReply { pid: proc.pid })
    }

    pub fn signal(&self, req: &SignalProcess) -> Result<()> {
        let sig = rustix::process::Signal::from_named_raw(req.signal).ok_or_else(|| {
            ContainerError::Invalid(format!("signal {} is not a valid signal", req.signal))
        })?;
        let p = self.process(&req.process)?;
        let mut targets = Vec::new();
        if req.all && req.process.exec_id.is_none() {
            targets = cgroup::pids(&req.process.container);
        }
        if p.exited().is_none() && !targets.contains(&p.pid) {
            targets.push(p.pid);
        }
        if targets.is_empty() {
            return Err(ContainerError::NoProcess {
                container: req.process.container.clone(),
                exec: format!(
                    "{} (process already finished)",
                    req.process.exec_id.as_deref().unwrap_or("init")
                ),
            });
        }
        for pid in targets {
            if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(pid, sig);
            }
        }
        Ok(())
    }

    pub fn wait(&self, r: &ProcessRef, timeout: Duration) -> Result<WaitReply> {
        let p = self.process(r)?;
        let guard = p.exit.lock().expect("exit");
        let (guard, _) =
            p.cv.wait_timeout_while(guard, timeout, |e| e.is_none())
                .expect("exit");
        Ok(WaitReply { exited: *guard })
    }

    pub fn close_stdin(&self, r: &ProcessRef) -> Result<()> {
        let p = self.process(r)?;
        if let Some(tx) = p.stdin.lock().expect("stdin").take() {
            let _ = tx.send(StdinMsg::Close);
        }
        self.stdio.unregister_stdin(p.stream);
        Ok(())
    }

    pub fn resize(&self, req: &ResizePty) -> Result<()> {
        let p = self.process(&req.process)?;
        let Some(pty) = &p.pty else {
            return Err(ContainerError::Precondition(
                "the process has no terminal".into(),
            ));
        };
        rustix::termios::tcsetwinsize(
            pty,
            rustix::termios::Winsize {
                ws_row: req.height,
                ws_col: req.width,
                ws_xpixel: 0,
                ws_ypixel: 0,
            },
        )
        .map_err(io("resizing the terminal"))
    }

    pub fn pids(&self, id: &str) -> Result<PidsReply> {
        self.get(id)?;
        Ok(PidsReply {
            pids: cgroup::pids(id),
        })
    }

    /// New limits for a container's cgroup ([`cgroup::set_limits`]).
    pub fn update(&self, req: &crust_agent_proto::UpdateContainer) -> Result<()> {
        self.get(&req.id)?;
        cgroup::set_limits(&req.id, req.memory_limit_bytes, req.cpu_max).map_err(|e| {
            let msg = e.to_string();
            match e {
                cgroup::LimitError::BadCpuMax { .. } => ContainerError::Invalid(msg),
                cgroup::LimitError::BelowUsage { .. } => ContainerError::Precondition(msg),
                cgroup::LimitError::Write { .. } => ContainerError::Internal(msg),
            }
        })
    }

    pub fn stats(&self, id: &str) -> Result<ContainerStatsReply> {
        self.get(id)?;
        Ok(cgroup::stats(id))
    }

    /// Kills what runs, frees the cgroup and scratch directory. Unknown
    /// ids succeed.
    pub fn remove(&self, id: &str) -> Result<()> {
        let Some(c) = self.map.lock().expect("containers").remove(id) else {
            return Ok(());
        };
        // A never-started helper exits when its sync socket closes.
        drop(c.start.lock().expect("start").take());
        // Its mounts go with the last process in the namespace.
        drop(c.mount_ns.lock().expect("mount_ns").take());
        cgroup::kill_all(id);
        let guard = c.init.exit.lock().expect("exit");
        let _ = c
            .init
            .cv
            .wait_timeout_while(guard, Duration::from_secs(10), |e| e.is_none());
        cgroup::remove(id, Duration::from_secs(5));
        for p in
            std::iter::once(c.init.clone()).chain(c.execs.lock().expect("execs").values().cloned())
        {
            self.stdio.unregister_stdin(p.stream);
        }
        let _ = std::fs::remove_dir_all(Path::new(CONTAINERS_DIR).join(id));
        Ok(())
    }

    /// Ids of live containers that have `volume` bound in.
    pub fn using_volume(&self, volume: &str) -> Vec<String> {
        self.map
            .lock()
            .expect("containers")
            .values()
            .filter(|c| {
                c.volumes.iter().any(|v| v == volume)
                    && (c.init.exited().is_none() || c.mount_ns.lock().expect("mount_ns").is_some())
            })
            .map(|c| c.id.clone())
            .collect()
    }

    pub fn ids(&self) -> Vec<String> {
        self.map
            .lock()
            .expect("containers")
            .keys()
            .cloned()
            .collect()
    }

    /// Starts the helper with the process's stdio wired up, in PID
    /// namespace `pid`.
    fn spawn(&self, spec: &InitSpec, pid: init::NsPlan) -> Result<Spawned> {
        let (mut parent, child_sync) = UnixStream::pair().map_err(io("socketpair"))?;
        let io_setup = wire_stdio(&spec.process.stdio, spec.process.terminal)?;
        let mut cmd = Command::new("/proc/self/exe");
        let sync_fd = child_sync.as_raw_fd();
        cmd.arg(INIT_ARG)
            .env_clear()
            .env(SYNC_ENV, sync_fd.to_string())
            .stdin(io_setup.child_stdin)
            .stdout(io_setup.child_stdout)
            .stderr(io_setup.child_stderr);
        // The sync socket is the only close-on-exec fd the helper keeps.
        ChildSetup::new()
            .keep(child_sync.as_fd())
            .apply(&mut cmd)
            .map_err(io("setting up the helper's start"))?;
        let child = spawn_in_pid_ns(&mut cmd, pid)?;
        // The child's ends must close here, or EOF never comes.
        drop(cmd);
        drop(child_sync);
        let _ = parent.set_read_timeout(Some(HELPER_TIMEOUT));
        let line = serde_json::to_string(spec).map_err(io("encoding the init spec"))?;
        parent
            .write_all(format!("{line}\n").as_bytes())
            .map_err(io("sending the init spec"))?;
        let stream = spec.process.stdio.stream;
        let stdin = io_setup.stdin.map(|w| {
            let tx = stdio::stdin_writer(w);
            self.stdio.register_stdin(stream, tx.clone());
            tx
        });
        for (kind, r) in io_setup.outputs {
            self.stdio.pump(stream, kind, r);
        }
        let proc = Arc::new(Proc {
            pid: child.id(),
            stream,
            exit: Mutex::new(None),
            cv: Condvar::new(),
            stdin: Mutex::new(stdin),
            pty: io_setup.pty,
        });
        Ok(Spawned {
            child,
            sync: parent,
            proc,
        })
    }

    /// Records the process's exit when it comes. A container's init takes
    /// the rest of its cgroup along: the kernel does so for a PID namespace
    /// of its own, not for one it shares (the pod's, or the guest's).
    fn watch(&self, mut child: Child, proc: Arc<Proc>, container: Option<String>) {
        std::thread::Builder::new()
            .name(format!("wait-{}", proc.pid))
            .spawn(move || {
                let st = child.wait();
                let (exit_code, signal) = match st {
                    Ok(st) => match (st.code(), st.signal()) {
                        (Some(c), _) => (c, None),
                        (None, Some(s)) => (128 + s, Some(s)),
                        _ => (255, None),
                    },
                    Err(_) => (255, None),
                };
                // Read before the rest is killed: those kills are ours.
                let oom_kills = container.as_deref().map_or(0, cgroup::oom_kills);
                if let Some(id) = &container {
                    cgroup::kill_all(id);
                }
                *proc.exit.lock().expect("exit") = Some(ProcessExit {
                    pid: proc.pid,
                    exit_code,
                    signal,
                    oom_kills,
                });
                proc.cv.notify_all();
            })
            .ok();
    }

    fn reap_failed(&self, id: &str, mut child: Child, proc: &Proc) {
        let _ = child.kill();
        let _ = child.wait();
        self.stdio.unregister_stdin(proc.stream);
        if !id.is_empty() {
            cgroup::remove(id, Duration::from_secs(5));
            let _ = std::fs::remove_dir_all(Path::new(CONTAINERS_DIR).join(id));
        }
    }
}

struct Spawned {
    child: Child,
    sync: UnixStream,
    proc: Arc<Proc>,
}

/// Forks the helper from a short-lived thread that first enters PID
/// namespace `plan`: the namespace a process creates children in is a
/// per-thread setting (unshare/setns of CLONE_NEWPID are allowed in a
/// threaded process), so the rest of the agent keeps its own.
fn spawn_in_pid_ns(cmd: &mut Command, plan: init::NsPlan) -> Result<Child> {
    let ns = match plan {
        init::NsPlan::Join(pid) => Some(
            std::fs::File::open(format!("/proc/{pid}/ns/pid"))
                .map_err(io(format!("the pid namespace of process {pid}")))?,
        ),
        _ => None,
    };
    std::thread::scope(|s| {
        s.spawn(move || {
            match (plan, &ns) {
                (init::NsPlan::New, _) => {
                    // NEWPID changes only where this thread's children go.
                    crust_sys::ns::unshare(rustix::thread::UnshareFlags::NEWPID)
                        .map_err(io("unshare(CLONE_NEWPID)"))?
                }
                (init::NsPlan::Join(_), Some(f)) => rustix::thread::move_into_link_name_space(
                    f.as_fd(),
                    Some(rustix::thread::LinkNameSpaceType::ProcessID),
                )
                .map_err(io("setns into the pid namespace"))?,
                _ => {}
            }
            cmd.spawn()
                .map_err(io("starting the container init helper"))
        })
        .join()
        .map_err(|_| ContainerError::Internal("the spawning thread panicked".into()))?
    })
}

/// What [`Containers::create`] plans, in the helper's terms.
struct Namespaces {
    ipc: init::NsPlan,
    uts: init::NsPlan,
    pid: init::NsPlan,
    user: init::NsPlan,
    /// Alive until the helper has joined the namespace (`ready`).
    holder: Option<userns::Holder>,
}

/// The checks of a create that need nothing but the request: id, process,
/// sysctls, user namespace, mount destinations and volume names. Answers
/// the volumes the container uses, each once.
fn check_create(req: &CreateContainer) -> Result<Vec<String>> {
    if !valid_id(&req.id) {
        return Err(ContainerError::Invalid(format!(
            "container id {:?} is invalid",
            req.id
        )));
    }
    validate_process(&req.process)?;
    crust_agent_proto::check_sysctls(&req.sysctl, &req.ipc, &req.uts)
        .map_err(ContainerError::Invalid)?;
    check_user_namespace(req)?;
    let mut volumes = Vec::new();
    for m in &req.mounts {
        rootfs::components(&m.destination).map_err(ContainerError::Invalid)?;
        if let MountSource::Volume { volume, .. } = &m.source {
            crate::volume::validate_name(volume)
                .map_err(|e| ContainerError::Invalid(e.to_string()))?;
            if !volumes.contains(volume) {
                volumes.push(volume.clone());
            }
        }
    }
    Ok(volumes)
}

/// Each device the container asks for, found by its disk's serial (a
/// hot-plugged disk may take a while to appear).
fn wait_for_devices(wanted: &[crust_agent_proto::BlockDevice]) -> Result<Vec<init::DeviceNode>> {
    let mut devices = Vec::new();
    for d in wanted {
        rootfs::components(&d.path).map_err(ContainerError::Invalid)?;
        let until = std::time::Instant::now() + Duration::from_secs(30);
        let disk = crate::sys::wait_for_disk(&d.serial, until).map_err(|seen| {
            ContainerError::Invalid(format!(
                "no disk with serial {:?} in the guest (disks: {})",
                d.serial,
                seen.iter()
                    .map(|x| x.serial.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        devices.push(init::DeviceNode {
            source: disk.dev_path(),
            path: d.path.clone(),
            mode: d.mode.unwrap_or(0o660),
            uid: d.uid.unwrap_or(0),
            gid: d.gid.unwrap_or(0),
        });
    }
    Ok(devices)
}

/// [`crust_agent_proto::check_user_namespace`] with the filesystems of
/// the crust volumes as this guest has them mounted (one not mounted
/// fails at its bind).
fn check_user_namespace(req: &CreateContainer) -> Result<()> {
    let fstypes: Vec<(String, String)> = req
        .mounts
        .iter()
        .filter_map(|m| match &m.source {
            MountSource::Volume { volume, .. } => {
                let e = crate::sys::mount_at(&crate::volume::mount_path(volume))?;
                Some((m.destination.clone(), e.fstype))
            }
            _ => None,
        })
        .collect();
    let volumes: Vec<(&str, &str)> = fstypes
        .iter()
        .map(|(d, f)| (d.as_str(), f.as_str()))
        .collect();
    crust_agent_proto::check_user_namespace(&req.user, req.process.user.as_ref(), &volumes)
        .map_err(ContainerError::Invalid)
}

fn validate_process(p: &ProcessSpec) -> Result<()> {
    if p.args.is_empty() || p.args[0].is_empty() {
        return Err(ContainerError::Invalid(
            "process args must not be empty".into(),
        ));
    }
    if let Some(kv) = p
        .env
        .iter()
        .find(|kv| !kv.contains('=') || kv.starts_with('='))
    {
        return Err(ContainerError::Invalid(format!(
            "env entry {kv:?} is not KEY=VALUE"
        )));
    }
    if let Some(r) = p.rlimits.iter().find(|r| init::resource(&r.kind).is_none()) {
        return Err(ContainerError::Invalid(format!(
            "unknown rlimit {:?}",
            r.kind
        )));
    }
    if let Some(c) = &p.capabilities {
        caps::Sets::parse(c).map_err(ContainerError::Invalid)?;
    }
    if let Some(adj) = p.oom_score_adj.filter(|a| !(-1000..=1000).contains(a)) {
        return Err(ContainerError::Invalid(format!(
            "process.oomScoreAdj {adj} is outside -1000..=1000"
        )));
    }
    if p.args.iter().chain(&p.env).any(|s| s.contains('\0')) {
        return Err(ContainerError::Invalid("NUL byte in args or env".into()));
    }
    if p.stdio.stream == 0 && (p.stdio.stdin || p.stdio.stdout || p.stdio.stderr) {
        return Err(ContainerError::Invalid(
            "stdio streams need a stream id".into(),
        ));
    }
    Ok(())
}

/// The helper's stdio and the agent's ends of it.
struct IoSetup {
    child_stdin: Stdio,
    child_stdout: Stdio,
    child_stderr: Stdio,
    stdin: Option<OwnedFd>,
    outputs: Vec<(Kind, OwnedFd)>,
    pty: Option<OwnedFd>,
}

fn null() -> Result<Stdio> {
    let f = std::fs::File::options()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(io("/dev/null"))?;
    Ok(Stdio::from(f))
}

fn wire_stdio(s: &StdioSpec, terminal: bool) -> Result<IoSetup> {
    if s.stream == 0 {
        return Ok(IoSetup {
            child_stdin: null()?,
            child_stdout: null()?,
            child_stderr: null()?,
            stdin: None,
            outputs: Vec::new(),
            pty: None,
        });
    }
    if terminal {
        use rustix::pty::{OpenptFlags, grantpt, openpt, ptsname, unlockpt};
        let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)
            .map_err(io("openpt"))?;
        grantpt(&master).map_err(io("grantpt"))?;
        unlockpt(&master).map_err(io("unlockpt"))?;
        let name = ptsname(&master, Vec::new()).map_err(io("ptsname"))?;
        let slave = rustix::fs::open(
            name.as_c_str(),
            OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(io("opening the pty slave"))?;
        let dup = |fd: &OwnedFd| fd.try_clone().map_err(io("dup"));
        return Ok(IoSetup {
            child_stdin: Stdio::from(dup(&slave)?),
            child_stdout: Stdio::from(dup(&slave)?),
            child_stderr: Stdio::from(slave),
            stdin: if s.stdin { Some(dup(&master)?) } else { None },
            outputs: vec![(Kind::Stdout, dup(&master)?)],
            pty: Some(master),
        });
    }
    let pipe = || rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(io("pipe"));
    let mut setup = IoSetup {
        child_stdin: null()?,
        child_stdout: null()?,
        child_stderr: null()?,
        stdin: None,
        outputs: Vec::new(),
        pty: None,
    };
    if s.stdin {
        let (r, w) = pipe()?;
        setup.child_stdin = Stdio::from(r);
        setup.stdin = Some(w);
    }
    if s.stdout {
        let (r, w) = pipe()?;
        setup.child_stdout = Stdio::from(w);
        setup.outputs.push((Kind::Stdout, r));
    }
    if s.stderr {
        let (r, w) = pipe()?;
        setup.child_stderr = Stdio::from(w);
        setup.outputs.push((Kind::Stderr, r));
    }
    Ok(setup)
}

fn read_line(s: &mut UnixStream) -> Option<String> {
    let mut line = String::new();
    match BufReader::new(s).read_line(&mut line) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(line.trim_end().to_string()),
    }
}

fn read_rest(s: &mut UnixStream) -> Option<String> {
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out.trim().to_string())
}

/// The helper's error line, or a generic message when it died silently.
fn helper_error(line: Option<String>, what: &str) -> String {
    let parsed = line.as_deref().and_then(|l| {
        serde_json::from_str::<serde_json::Value>(l)
            .ok()?
            .get("error")?
            .as_str()
            .map(str::to_owned)
    });
    match (parsed, line) {
        (Some(e), _) => e,
        (None, Some(l)) if !l.is_empty() => format!("{what}: {l}"),
        _ => format!("{what}: the init helper exited without a word"),
    }
}
