//! The agent: request dispatch and the virtio-serial channel loop.

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_agent_proto::{
    AgentError, Empty, ErrorCode, ExecReply, FrameDecoder, FrameError, GUEST_VOLUME_ROOT,
    MAX_EXEC_OUTPUT, Operation, PROTOCOL_VERSION, PingReply, Request, Response, frame,
    parse_request,
};
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

pub use crate::port::find_port;

use crate::container::Containers;
use crate::network::Network;
use crate::process::{self, RunError};
use crate::volume::Volumes;

/// Requests handled at once; more get ResourceExhausted.
const MAX_IN_FLIGHT: usize = 64;

/// Handler threads kept waiting for requests: starting a thread per
/// request costs more than the request itself in an emulated (TCG) guest.
const SPARE_HANDLERS: usize = 4;

/// How often a disconnected port is polled for the host coming back.
const RECONNECT_POLL: Duration = Duration::from_millis(25);

macro_rules! log {
    ($($arg:tt)*) => { eprintln!("crust-agent: {}", format_args!($($arg)*)) };
}

/// What to do once a response has been written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    Nothing,
    PowerOff,
}

struct Outgoing {
    frame: Vec<u8>,
    /// Told once the frame is written (Shutdown waits for it).
    written: Option<mpsc::Sender<()>>,
    /// Host connection the request came in on (as far as the control
    /// queue has told; see [`Writer::write`]).
    connection: u64,
}

/// Agent state shared by the handler threads.
pub struct Agent {
    volumes: Volumes,
    containers: Containers,
    network: Network,
    /// Serializes operations that change mounts.
    mutate: Mutex<()>,
    started: Instant,
}

impl Agent {
    fn new(containers: Containers) -> Self {
        Agent {
            volumes: Volumes::default(),
            containers,
            network: Network::default(),
            mutate: Mutex::new(()),
            started: Instant::now(),
        }
    }
}

fn uptime_ms(fallback: Instant) -> u64 {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map(|s| (s * 1000.0) as u64)
        .unwrap_or_else(|| fallback.elapsed().as_millis() as u64)
}

fn deadline_err(what: &str) -> AgentError {
    AgentError::new(
        ErrorCode::DeadlineExceeded,
        format!("{what}: deadline exceeded"),
    )
}

impl Agent {
    fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.mutate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Handles one request; the flag says whether to power off after the
    /// reply is out.
    #[allow(
        clippy::too_many_lines,
        reason = "one match arm per operation: the dispatch table reads top to bottom"
    )]
    fn handle(&self, req: Request, received: Instant) -> (Response, After) {
        let id = req.id;
        let deadline =
            (req.deadline_ms > 0).then(|| received + Duration::from_millis(req.deadline_ms));
        let name = req.op.name();
        if deadline.is_some_and(|d| Instant::now() > d) {
            return (Response::err(id, deadline_err(name)), After::Nothing);
        }
        let mut after = After::Nothing;
        let result: Result<serde_json::Value, AgentError> = (|| {
            let v = match req.op {
                Operation::Ping(_) => serde_json::to_value(PingReply {
                    version: env!("CARGO_PKG_VERSION").into(),
                    protocol: PROTOCOL_VERSION,
                    uptime_ms: uptime_ms(self.started),
                }),
                Operation::MountVolume(m) => {
                    let _g = self.lock();
                    serde_json::to_value(self.volumes.mount(&m, deadline)?)
                }
                Operation::StatVolume(s) => serde_json::to_value(self.volumes.stat(&s.volume)?),
                // Not under the mount lock: a frozen volume must not hold up
                // the other operations while the host copies it.
                Operation::FreezeVolume(f) => {
                    self.volumes.freeze(&f.volume, f.max_frozen_ms)?;
                    serde_json::to_value(Empty {})
                }
                Operation::ThawVolume(t) => serde_json::to_value(self.volumes.thaw(&t.volume)?),
                Operation::GrowVolume(g) => {
                    let _g = self.lock();
                    serde_json::to_value(self.volumes.grow(&g.volume, g.device_bytes, deadline)?)
                }
                Operation::UnmountVolume(u) => {
                    let _g = self.lock();
                    crate::volume::validate_name(&u.volume)?;
                    let users = self.containers.using_volume(&u.volume);
                    if !users.is_empty() {
                        return Err(AgentError::new(
                            ErrorCode::FailedPrecondition,
                            format!(
                                "volume {:?} is in use by container(s) {}; remove them first",
                                u.volume,
                                users.join(", ")
                            ),
                        ));
                    }
                    self.volumes.unmount(&u.volume)?;
                    serde_json::to_value(Empty {})
                }
                Operation::Exec(e) => {
                    let ns = match &e.container {
                        Some(c) => Some(self.containers.mount_ns(c)?),
                        None => None,
                    };
                    serde_json::to_value(self.exec(&e.args, &e.env, e.timeout_ms, ns, deadline)?)
                }
                Operation::Shutdown(_) => {
                    self.shutdown_prepare();
                    after = After::PowerOff;
                    serde_json::to_value(Empty {})
                }
                Operation::CreateContainer(c) => serde_json::to_value(self.containers.create(&c)?),
                Operation::StartContainer(c) => serde_json::to_value(self.containers.start(&c.id)?),
                Operation::ExecProcess(e) => serde_json::to_value(self.containers.exec(&e)?),
                Operation::SignalProcess(s) => {
                    self.containers.signal(&s)?;
                    serde_json::to_value(Empty {})
                }
                Operation::WaitProcess(w) => {
                    let mut t = Duration::from_millis(w.timeout_ms);
                    if let Some(d) = deadline {
                        // Answer before the caller gives up.
                        t = t.min(
                            d.saturating_duration_since(Instant::now())
                                .saturating_sub(Duration::from_millis(500)),
                        );
                    }
                    serde_json::to_value(self.containers.wait(&w.process, t)?)
                }
                Operation::CloseStdin(c) => {
                    self.containers.close_stdin(&c.process)?;
                    serde_json::to_value(Empty {})
                }
                Operation::ResizePty(r) => {
                    self.containers.resize(&r)?;
                    serde_json::to_value(Empty {})
                }
                Operation::ContainerPids(p) => serde_json::to_value(self.containers.pids(&p.id)?),
                Operation::ContainerStats(p) => serde_json::to_value(self.containers.stats(&p.id)?),
                Operation::RemoveContainer(r) => {
                    self.containers.remove(&r.id)?;
                    serde_json::to_value(Empty {})
                }
                Operation::GuestInfo(_) => serde_json::to_value(guest_info()),
                Operation::ConfigureNetwork(n) => serde_json::to_value(self.network.configure(&n)?),
                Operation::UpdateContainer(u) => {
                    self.containers.update(&u)?;
                    serde_json::to_value(Empty {})
                }
                Operation::OnlineCpus(o) => {
                    let mut t = Duration::from_millis(o.timeout_ms);
                    if let Some(d) = deadline {
                        t = t.min(d.saturating_duration_since(Instant::now()));
                    }
                    serde_json::to_value(online_cpus(o.want, t))
                }
            };
            v.map_err(|e| AgentError::new(ErrorCode::Internal, e.to_string()))
        })();
        let resp = match result {
            Ok(v) => Response {
                id,
                outcome: crust_agent_proto::Outcome::Result(v),
            },
            Err(e) => {
                log!("{name} (id {id}) failed: {e}");
                Response::err(id, e)
            }
        };
        (resp, after)
    }

    fn exec(
        &self,
        args: &[String],
        env: &[String],
        timeout_ms: u64,
        mount_ns: Option<OwnedFd>,
        deadline: Option<Instant>,
    ) -> Result<ExecReply, AgentError> {
        let mut timeout = Duration::from_millis(timeout_ms.max(1));
        if let Some(d) = deadline {
            timeout = timeout.min(d.saturating_duration_since(Instant::now()));
        }
        match process::run_in(args, env, timeout, MAX_EXEC_OUTPUT, mount_ns) {
            Ok(o) => Ok(ExecReply {
                exit_code: o.code,
                signal: o.signal,
                stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
                truncated: o.truncated,
            }),
            Err(e @ RunError::Empty) => {
                Err(AgentError::new(ErrorCode::InvalidArgument, e.to_string()))
            }
            Err(e @ RunError::Spawn { .. }) => {
                Err(AgentError::new(ErrorCode::InvalidArgument, e.to_string()))
            }
            Err(e @ RunError::Timeout { .. }) => {
                Err(AgentError::new(ErrorCode::DeadlineExceeded, e.to_string()))
            }
            Err(e @ RunError::Wait { .. }) => {
                Err(AgentError::new(ErrorCode::Internal, e.to_string()))
            }
        }
    }

    /// Removes the containers and unmounts everything; errors are logged,
    /// not fatal, since the guest is going away either way.
    fn shutdown_prepare(&self) {
        log!("shutdown requested");
        for id in self.containers.ids() {
            let _ = self.containers.remove(&id);
        }
        let _g = self.lock();
        for v in self.volumes.mounted() {
            match self.volumes.unmount(&v) {
                Ok(()) => log!("unmounted volume {v}"),
                Err(e) => log!("unmounting volume {v}: {e}"),
            }
        }
        rustix::fs::sync();
    }
}

/// One `/proc/meminfo` figure, in bytes.
fn meminfo(key: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix(key)?
                .strip_prefix(':')?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(0)
        * 1024
}

/// Memory, CPUs and kernel of the guest.
fn guest_info() -> crust_agent_proto::GuestInfoReply {
    let cpus = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count() as u32;
    crust_agent_proto::GuestInfoReply {
        mem_total_bytes: meminfo("MemTotal"),
        mem_available_bytes: meminfo("MemAvailable"),
        cpus,
        kernel_release: rustix::system::uname()
            .release()
            .to_string_lossy()
            .into_owned(),
    }
}

/// Onlines every offline vCPU (no udev here to do it when one is
/// hot-plugged; the ACPI notice may trail QEMU's answer, hence the wait)
/// until `want` are online or `timeout` passes.
fn online_cpus(want: u32, timeout: Duration) -> crust_agent_proto::OnlineCpusReply {
    let until = Instant::now() + timeout;
    loop {
        let mut online = 0;
        for e in std::fs::read_dir("/sys/devices/system/cpu")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name();
            let is_cpu = name
                .to_str()
                .and_then(|n| n.strip_prefix("cpu"))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
            if !is_cpu {
                continue;
            }
            let f = e.path().join("online");
            // cpu0 has no `online` file: it cannot go offline.
            match std::fs::read_to_string(&f) {
                Err(_) => online += 1,
                Ok(v) if v.trim() == "1" => online += 1,
                Ok(_) => {
                    if std::fs::write(&f, "1").is_ok() {
                        online += 1;
                    }
                }
            }
        }
        if online >= want || Instant::now() >= until {
            return crust_agent_proto::OnlineCpusReply { online };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Agent start-up options.
#[derive(Debug, Clone)]
pub struct Config {
    /// virtio-serial port name to serve on.
    pub port_name: String,
    /// Use this device instead of looking the port up by name.
    pub device: Option<PathBuf>,
    /// How long to wait for the port to appear.
    pub wait_port: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum RunFailure {
    #[error("no virtio-serial port named {name:?} appeared within {after:?} (ports: {seen})")]
    NoPort {
        name: String,
        after: Duration,
        seen: String,
    },
    #[error("opening {path}: {errno}")]
    Open { path: String, errno: Errno },
}

fn open_port(cfg: &Config) -> Result<OwnedFd, RunFailure> {
    let path = match &cfg.device {
        Some(p) => p.clone(),
        None => {
            let until = Instant::now() + cfg.wait_port;
            loop {
                match find_port(&cfg.port_name) {
                    Ok(p) if p.exists() => break p,
                    Ok(_) => {}
                    Err(seen) if Instant::now() >= until => {
                        return Err(RunFailure::NoPort {
                            name: cfg.port_name.clone(),
                            after: cfg.wait_port,
                            seen: if seen.is_empty() {
                                "none".into()
                            } else {
                                seen.join(", ")
                            },
                        });
                    }
                    Err(_) => {}
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    rustix::fs::open(
        path.as_path(),
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|errno| RunFailure::Open {
        path: path.display().to_string(),
        errno,
    })
}

fn power_off() -> ! {
    rustix::fs::sync();
    log!("powering off");
    let _ = rustix::system::reboot(rustix::system::RebootCommand::PowerOff);
    // No ACPI power-off: a restart also ends QEMU when run with -no-reboot.
    let _ = rustix::system::reboot(rustix::system::RebootCommand::Restart);
    std::process::exit(0)
}

/// The port's write side, shared by the writer thread (replies the read
/// loop makes) and the handlers (which write their own replies: one thread
/// hop less per request).
struct Writer {
    port: Mutex<OwnedFd>,
    connection: Arc<AtomicU64>,
}

impl Writer {
    fn write(&self, out: Outgoing) {
        // Written all the same: virtio-serial delivers the host's
        // open/close events on the control queue and its data on another,
        // so a request of the new connection can be read before the old
        // one's close is seen, and dropping its reply left the caller
        // waiting (the hot-plug tests' 60 s stall). A reply that does reach
        // a newer client carries an id it never sent (ids start at random)
        // and is ignored there.
        if out.connection != self.connection.load(Ordering::SeqCst) {
            log!("replying across a host reconnection");
        }
        let port = self.port.lock().expect("port");
        let mut buf = &out.frame[..];
        while !buf.is_empty() {
            match rustix::io::write(&*port, buf) {
                Ok(n) => buf = &buf[n..],
                Err(Errno::INTR) | Err(Errno::AGAIN) => {}
                Err(e) => {
                    log!(
                        "dropping a {}-byte response: write failed: {e}",
                        out.frame.len()
                    );
                    break;
                }
            }
        }
        drop(port);
        if let Some(w) = out.written {
            let _ = w.send(());
        }
    }
}

/// Writes what the read loop cannot wait to write itself.
fn writer_loop(writer: Arc<Writer>, rx: mpsc::Receiver<Outgoing>) {
    for out in rx {
        writer.write(out);
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Spare handler threads. A request goes to a waiting one; when none
/// waits (all busy, some maybe stuck on a hung filesystem) the caller
/// starts a thread for it, as before.
struct Handlers {
    queue: Mutex<(std::collections::VecDeque<Job>, usize)>,
    ready: std::sync::Condvar,
}

impl Handlers {
    fn start(n: usize) -> Arc<Handlers> {
        let h = Arc::new(Handlers {
            queue: Mutex::new((std::collections::VecDeque::new(), 0)),
            ready: std::sync::Condvar::new(),
        });
        for i in 0..n {
            let h2 = h.clone();
            let started = std::thread::Builder::new()
                .name(format!("handler-{i}"))
                .spawn(move || h2.serve());
            if let Err(e) = started {
                log!("cannot start spare handler {i}: {e}");
            }
        }
        h
    }

    fn serve(&self) {
        loop {
            let job = {
                let mut q = self.queue.lock().expect("handler queue");
                q.1 += 1;
                loop {
                    if let Some(j) = q.0.pop_front() {
                        break j;
                    }
                    q = self.ready.wait(q).expect("handler queue");
                }
            };
            job();
        }
    }

    /// Hands `job` to a waiting handler; gives it back when none waits.
    fn offer(&self, job: Job) -> Result<(), Job> {
        let mut q = self.queue.lock().expect("handler queue");
        if q.1 == 0 {
            return Err(job);
        }
        // Each queued job has a waiting handler reserved for it.
        q.1 -= 1;
        q.0.push_back(job);
        self.ready.notify_one();
        Ok(())
    }
}

/// A reply framed for the port; an oversized one becomes an error reply.
fn outgoing(resp: &Response, written: Option<mpsc::Sender<()>>, conn: u64) -> Option<Outgoing> {
    let f = frame::encode(resp).or_else(|e| {
        let msg = format!("reply not sent: {e}");
        frame::encode(&Response::err(
            resp.id,
            AgentError::new(ErrorCode::Internal, msg),
        ))
    });
    f.ok().map(|frame| Outgoing {
        frame,
        written,
        connection: conn,
    })
}

/// Serves the agent protocol on the virtio-serial port until the process
/// ends. Survives the host disconnecting: reads then return EOF, the
/// partial frame is dropped and the port is polled until the host is back.
pub fn run(cfg: Config) -> Result<(), RunFailure> {
    log!("version {} starting", env!("CARGO_PKG_VERSION"));
    if let Err(e) = std::fs::create_dir_all(GUEST_VOLUME_ROOT) {
        log!("creating {GUEST_VOLUME_ROOT}: {e}");
    }
    if let Err(e) = crate::volume::share_root() {
        log!("making / a shared mount: {e}");
    }
    let _ = rustix::fs::chmod("/run/crust", Mode::from_raw_mode(0o700));
    let (port, reader) = open_ports(&cfg)?;
    let dispatch = Dispatch::start(port);
    channel_loop(&reader, &dispatch)
}

/// The port and a second descriptor of it for the read loop (the first
/// goes to the writer).
fn open_ports(cfg: &Config) -> Result<(OwnedFd, OwnedFd), RunFailure> {
    let port = open_port(cfg)?;
    let reader = port.try_clone().map_err(|e| RunFailure::Open {
        path: "port (dup)".into(),
        errno: Errno::from_io_error(&e).unwrap_or(Errno::IO),
    })?;
    log!(
        "serving on {}",
        cfg.device
            .as_deref()
            .map_or(cfg.port_name.clone(), |p| p.display().to_string())
    );
    Ok((port, reader))
}

/// Reads frames off the port for as long as the process lives, following
/// the host as it goes and comes back.
fn channel_loop(reader: &OwnedFd, dispatch: &Dispatch) -> Result<(), RunFailure> {
    let mut dec = FrameDecoder::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut connected = false;
    loop {
        match rustix::io::read(reader.as_fd(), &mut buf) {
            Ok(0) => {
                // virtio-serial: no host on the other end.
                if connected {
                    log!("host disconnected");
                    connected = false;
                    dispatch.connection.fetch_add(1, Ordering::SeqCst);
                }
                dec.reset();
                std::thread::sleep(RECONNECT_POLL);
            }
            Ok(n) => {
                if !connected {
                    log!("host connected");
                    connected = true;
                }
                dec.push(&buf[..n]);
                let conn = dispatch.connection.load(Ordering::SeqCst);
                while let Some(f) = dec.next_frame() {
                    dispatch.frame(f, conn);
                }
            }
            Err(Errno::INTR) | Err(Errno::AGAIN) => {}
            Err(e) => {
                log!("reading the port: {e}");
                dec.reset();
                std::thread::sleep(RECONNECT_POLL * 4);
            }
        }
    }
}

/// What the read loop hands requests to: the writer, the agent, the
/// in-flight count and the spare handlers.
struct Dispatch {
    tx: mpsc::Sender<Outgoing>,
    writer: Arc<Writer>,
    connection: Arc<AtomicU64>,
    agent: Arc<Agent>,
    in_flight: Arc<AtomicUsize>,
    handlers: Arc<Handlers>,
}

impl Dispatch {
    /// Starts the writer thread, readies the guest for containers and
    /// starts the spare handlers.
    fn start(port: OwnedFd) -> Dispatch {
        let (tx, rx) = mpsc::channel::<Outgoing>();
        let connection = Arc::new(AtomicU64::new(0));
        let writer = Arc::new(Writer {
            port: Mutex::new(port),
            connection: connection.clone(),
        });
        {
            let writer = writer.clone();
            std::thread::spawn(move || writer_loop(writer, rx));
        }
        crate::forward::start();
        if let Err(e) = Containers::init_guest() {
            log!("container support incomplete: {e}");
        }
        let agent = Arc::new(Agent::new(Containers::new(
            crate::container::stdio::StdioPort::open(),
        )));
        Dispatch {
            tx,
            writer,
            connection,
            agent,
            in_flight: Arc::new(AtomicUsize::new(0)),
            handlers: Handlers::start(SPARE_HANDLERS),
        }
    }

    /// Queues a reply for the writer thread.
    fn send(&self, resp: &Response, conn: u64) {
        send(&self.tx, resp, None, conn);
    }

    /// One frame off the port: refused, or parsed and handed to a handler.
    fn frame(&self, f: Result<Vec<u8>, FrameError>, conn: u64) {
        let body = match f {
            Ok(b) => b,
            Err(e @ FrameError::TooLarge { .. }) => {
                log!("refusing frame: {e}");
                let r = Response::err(
                    0,
                    AgentError::new(ErrorCode::InvalidArgument, e.to_string()),
                );
                self.send(&r, conn);
                return;
            }
            Err(e) => {
                log!("bad frame: {e}");
                return;
            }
        };
        let received = Instant::now();
        let req = match parse_request(&body) {
            Ok(r) => r,
            Err((id, err)) => {
                log!("bad request (id {id}): {}", err.message);
                self.send(&Response::err(id, err), conn);
                return;
            }
        };
        if self.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            let e = AgentError::new(
                ErrorCode::ResourceExhausted,
                format!("more than {MAX_IN_FLIGHT} requests in flight"),
            );
            self.send(&Response::err(req.id, e), conn);
            return;
        }
        self.dispatch(req, received, conn);
    }

    /// Runs `req` on a spare handler, or a new thread when none waits; the
    /// handler writes its own reply.
    fn dispatch(&self, req: Request, received: Instant, conn: u64) {
        let (agent, w, busy) = (
            self.agent.clone(),
            self.writer.clone(),
            self.in_flight.clone(),
        );
        let id = req.id;
        let tx2 = self.tx.clone();
        let job: Job = Box::new(move || {
            let (resp, after) = agent.handle(req, received);
            if after == After::PowerOff {
                // Reply first, but a vanished host (write
                // blocked) must not keep the VM up.
                // Through the writer thread, so a blocked write
                // cannot hold this one past its timeout.
                let (wtx, wrx) = mpsc::channel();
                send(&tx2, &resp, Some(wtx), conn);
                let _ = wrx.recv_timeout(Duration::from_secs(3));
                std::thread::sleep(Duration::from_millis(200));
                power_off();
            }
            if let Some(out) = outgoing(&resp, None, conn) {
                w.write(out);
            }
            busy.fetch_sub(1, Ordering::SeqCst);
        });
        let spawned = match self.handlers.offer(job) {
            Ok(()) => Ok(()),
            Err(job) => std::thread::Builder::new()
                .name(format!("req-{id}"))
                .spawn(job)
                .map(drop),
        };
        if let Err(e) = spawned {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            let e = AgentError::new(
                ErrorCode::ResourceExhausted,
                format!("cannot start a handler thread: {e}"),
            );
            self.send(&Response::err(id, e), conn);
        }
    }
}

/// Queues `resp` for the writer thread (`written` is told once it is out).
fn send(
    tx: &mpsc::Sender<Outgoing>,
    resp: &Response,
    written: Option<mpsc::Sender<()>>,
    conn: u64,
) {
    if let Some(out) = outgoing(resp, written, conn) {
        let _ = tx.send(out);
    }
}
