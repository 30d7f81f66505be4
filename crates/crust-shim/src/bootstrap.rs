//! The shim binary's three lives, as containerd runs it:
//!
//! * `start` (cwd = the bundle): finds the pod the container belongs to
//!   (CRI annotations), returns the address of that pod's running shim, or
//!   starts one and returns its address, in the caller's format
//!   ([`crate::start_reply`]);
//! * no action, `-socket ADDR`: the long-lived shim serving the task API
//!   (v2 and v3) on ADDR until Shutdown;
//! * `delete` (after the shim died): releases what the dead shim held and
//!   prints a `DeleteResponse`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{Context, anyhow, bail};
use containerd_shim::Flags;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim::asynchronous::publisher::RemotePublisher;
use containerd_shim::protos::protobuf::{Message, MessageField};
use containerd_shim::protos::shim_async::create_task;
use containerd_shim::protos::ttrpc::r#async::Server;
use crust_sandbox::discovery::Discovery;
use crust_sandbox::sandbox::SandboxStore;
use crust_sys::spawn::ChildSetup;

use crate::config::ShimConfig;
use crate::pod::Pod;
use crate::start_reply;
use crate::task::Service;
use crust_sandbox::cgroup::Placement;
use crust_sandbox::spec::{self, Role};

/// The ttrpc service names the task service answers under: containerd 1.x
/// speaks v2, containerd 2.x v3 (same messages, another package name).
pub const TASK_SERVICES: [&str; 2] = ["containerd.task.v2.Task", "containerd.task.v3.Task"];

/// Runs the action `argv` names; the process exit code.
pub fn main() -> i32 {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let flags = match containerd_shim::parse(&args) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("containerd-shim-crust-v2: {e}");
            return 2;
        }
    };
    if flags.version {
        println!("containerd-shim-crust-v2 {}", env!("CARGO_PKG_VERSION"));
        return 0;
    }
    let res = match flags.action.as_str() {
        "start" => start(&flags),
        "delete" => delete(&flags),
        "" => serve(&flags),
        other => Err(anyhow!("unknown action {other:?}")),
    };
    match res {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("containerd-shim-crust-v2: {e:#}");
            1
        }
    }
}

/// The pod (grouping) id of the container whose bundle is `bundle`, and
/// the pod's cgroup placement when that container owns the pod.
pub fn pod_of(bundle: &Path, id: &str) -> anyhow::Result<(String, Option<Placement>)> {
    let oci = spec::load(bundle)?;
    Ok(match spec::role(&oci) {
        Role::Member { sandbox_id } => (sandbox_id, None),
        Role::PodOwner => {
            let placement = oci
                .linux()
                .as_ref()
                .and_then(|l| l.cgroups_path().as_ref())
                .and_then(|p| Placement::resolve(&p.to_string_lossy()).ok());
            (id.to_string(), placement)
        }
    })
}

fn socket_path(address: &str) -> &str {
    address.strip_prefix("unix://").unwrap_or(address)
}

fn alive(address: &str) -> bool {
    std::os::unix::net::UnixStream::connect(socket_path(address)).is_ok()
}

fn start(flags: &Flags) -> anyhow::Result<()> {
    let mut stdin = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut stdin);
    let caller = start_reply::detect(&stdin, flags);
    let bundle = std::env::current_dir()?;
    let (pod, cgroup) = pod_of(&bundle, &flags.id)?;
    let address = match caller.socket_dir() {
        Some(dir) => start_reply::address_in(dir, &flags.address, &flags.namespace, &pod),
        None => containerd_shim::socket_address(&flags.address, &flags.namespace, &pod),
    };
    if !alive(&address) {
        spawn_shim(flags, &pod, &address, cgroup.as_ref())?;
    }
    // containerd 1.x finds the shim again after a restart by this file.
    std::fs::write(bundle.join("address"), &address).context("writing the address file")?;
    let out = start_reply::encode(&caller, &address);
    let mut stdout = std::io::stdout();
    stdout.write_all(&out)?;
    stdout.flush()?;
    Ok(())
}

/// Starts the serving shim for `pod` in its own session and waits until
/// it listens on `address`. With the pod's cgroup known, the shim is born
/// in it ([`born_in_pod_cgroup`]); a cgroup that cannot be made here is
/// left to the serving shim, whose Create reports it.
fn spawn_shim(
    flags: &Flags,
    pod: &str,
    address: &str,
    cgroup: Option<&Placement>,
) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "-namespace",
        &flags.namespace,
        "-id",
        pod,
        "-address",
        &flags.address,
        "-publish-binary",
        &flags.publish_binary,
        "-socket",
        address,
    ]);
    if flags.debug {
        cmd.arg("-debug");
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // A session of its own: the shim outlives this process and
    // containerd's restarts.
    let mut setup = ChildSetup::new().new_session();
    let born = match cgroup {
        Some(cg) => born_in_pod_cgroup(&mut cmd, cg).map(|procs| {
            setup = procs
                .into_iter()
                .fold(std::mem::take(&mut setup), ChildSetup::cgroup);
            cg
        }),
        None => None,
    };
    if let Err(e) = setup.apply(&mut cmd) {
        born.inspect(|cg| cg.remove());
        return Err(e).context("setting up the shim's start");
    }
    let spawned = cmd.spawn().context("spawning the shim");
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            born.inspect(|cg| cg.remove());
            return Err(e);
        }
    };
    let out = child.stdout.take().expect("piped");
    let mut line = String::new();
    let _ = BufReader::new(out).read_line(&mut line);
    if line.trim() != "ok" {
        let _ = child.kill();
        let _ = child.wait();
        born.inspect(|cg| cg.remove());
        let line = line.trim();
        bail!(
            "the shim for pod {pod} failed to start: {}",
            match line.strip_prefix(START_FAILED) {
                Some(why) => why,
                None if line.is_empty() => "no word (see the containerd log)",
                None => line,
            }
        );
    }
    // The shim runs on; its parent (this process) exits and init reaps it.
    Ok(())
}

/// Makes the pod's groups and returns their open `cgroup.procs` for the
/// shim to be born in, handing it what it needs to leave and remove them
/// at the pod's end ([`Placement::hand_over`]): from its first page the
/// shim is charged to the pod, as QEMU and virtiofsd are. None (and
/// nothing left made) when that cannot be done; the shim then joins at
/// boot.
fn born_in_pod_cgroup(cmd: &mut Command, cg: &Placement) -> Option<Vec<OwnedFd>> {
    let handed = cg.create().and_then(|()| cg.hand_over()).and_then(|h| {
        crust_vmm::open_cgroup_procs(&cg.dirs)
            .map_err(|(dir, e)| format!("{}: {e}", dir.display()))
            .map(|procs| (h, procs))
    });
    match handed {
        Ok((h, procs)) => {
            cmd.env(crust_sandbox::cgroup::HANDED_ENV, h);
            Some(procs)
        }
        Err(_) => {
            cg.remove();
            None
        }
    }
}

/// Tracing to containerd's shim log FIFO (`log` in the bundle), which
/// containerd copies into its own log; `CRUST_SHIM_LOG` names a file
/// instead.
fn init_logging(debug: bool) {
    let level = if debug { "debug" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("CRUST_SHIM_LOG_LEVEL")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let file = std::env::var_os("CRUST_SHIM_LOG")
        .map(PathBuf::from)
        .and_then(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok()
        })
        .or_else(|| {
            // Read-write: the open never blocks on a missing reader.
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("log")
                .ok()
        });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false);
    match file {
        Some(f) => builder.with_writer(std::sync::Mutex::new(f)).init(),
        None => builder.with_writer(std::io::sink).init(),
    }
}

fn serve(flags: &Flags) -> anyhow::Result<()> {
    if flags.socket.is_empty() {
        bail!("no -socket given and no action: nothing to do");
    }
    init_logging(flags.debug);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let e = anyhow!(e).context("starting the tokio runtime");
            tell_start_why(&e);
            return Err(e);
        }
    };
    let res = rt.block_on(serve_async(flags));
    if let Err(e) = &res {
        tracing::error!("shim: {e:#}");
        tell_start_why(e);
    }
    // Leftover tasks (relays, waiters) must not hold the exit.
    rt.shutdown_timeout(Duration::from_secs(2));
    res
}

/// Marks the line a serving shim that failed before it was up sends its
/// parent (`start`) instead of "ok".
const START_FAILED: &str = "error: ";

/// Sends `start` the reason this shim could not come up, on one line:
/// containerd puts `start`'s output into the error it reports, where the
/// log file is not. After [`signal_ready`] stdout is /dev/null and this
/// writes nowhere.
fn tell_start_why(e: &anyhow::Error) {
    let why = format!("{e:#}")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{START_FAILED}{why}");
    let _ = out.flush();
}

/// Tells the parent (`start`) the shim is up, then detaches stdout.
fn signal_ready() {
    let mut out = std::io::stdout();
    let _ = out.write_all(b"ok\n");
    let _ = out.flush();
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        let _ = rustix::stdio::dup2_stdout(&null);
    }
}

async fn serve_async(flags: &Flags) -> anyhow::Result<()> {
    let cfg = ShimConfig::from_env()?;
    let born = match Placement::handed() {
        Some(Ok(p)) => Some(p),
        Some(Err(e)) => {
            tracing::warn!("the pod's cgroup handed by start: {e}; joining at boot");
            None
        }
        None => None,
    };
    let ttrpc_address = std::env::var("TTRPC_ADDRESS").context("TTRPC_ADDRESS is not set")?;
    let path = socket_path(&flags.socket).to_string();
    if let Some(dir) = Path::new(&path).parent() {
        std::fs::create_dir_all(dir)?;
    }
    let listener = match std::os::unix::net::UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            if alive(&path) {
                // Another shim of this pod won the race; it serves (and
                // holds the groups, so removing them fails harmlessly).
                if let Some(cg) = born {
                    cg.leave_self();
                    cg.remove();
                }
                signal_ready();
                return Ok(());
            }
            std::fs::remove_file(&path)?;
            std::os::unix::net::UnixListener::bind(&path)?
        }
        Err(e) => return Err(e).context(format!("binding {path}")),
    };
    rustix::fs::chmod(path.as_str(), rustix::fs::Mode::from_raw_mode(0o600))?;
    let pod = Arc::new(Pod::new(&flags.id, cfg)?);
    let publisher = Arc::new(
        RemotePublisher::new(&ttrpc_address)
            .await
            .map_err(|e| anyhow!("connecting to containerd's events at {ttrpc_address}: {e}"))?,
    );
    let exit = Arc::new(ExitSignal::default());
    let service = Arc::new(Service::new(
        pod.clone(),
        flags.namespace.clone(),
        publisher,
        exit.clone(),
        born,
    ));
    let mut services = std::collections::HashMap::new();
    for name in TASK_SERVICES {
        let mut s = create_task(service.clone());
        let (_, svc) = s.drain().next().expect("one service");
        services.insert(name.to_string(), svc);
    }
    use std::os::fd::IntoRawFd;
    let mut server = Server::new()
        .add_listener(listener.into_raw_fd())?
        .set_domain_unix()
        .register_service(services);
    server.start().await?;
    signal_ready();
    tracing::info!("serving pod {} on {}", flags.id, flags.socket);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = exit.wait() => {}
        _ = term.recv() => {
            tracing::info!("SIGTERM: ending the pod");
            pod.teardown().await;
        }
    }
    let _ = server.shutdown().await;
    let _ = std::fs::remove_file(&path);
    tracing::info!("shim of pod {} exits", flags.id);
    Ok(())
}

/// containerd's cleanup after a shim died: whatever the dead shim's pod
/// held is released (QEMU killed, claims dropped, share unmounted).
fn delete(flags: &Flags) -> anyhow::Result<()> {
    let bundle = if flags.bundle.is_empty() {
        std::env::current_dir()?
    } else {
        PathBuf::from(&flags.bundle)
    };
    let cfg = ShimConfig::from_env()?;
    // The bundle may already be gone; then the container is its own pod.
    let pod = pod_of(&bundle, &flags.id).map_or_else(|_| flags.id.clone(), |(p, _)| p);
    let store = SandboxStore::new(cfg.runtime.root.clone());
    let share = store.dir(&pod).join("share");
    // The dead shim's socket: the bundle's address file names it, but
    // containerd may run this after the bundle is gone (a shim killed just
    // before RemovePodSandbox), so the pod's own address, which `start`
    // derived from the same flags, is tried as well.
    let mut sockets: Vec<String> = std::fs::read_to_string(bundle.join("address"))
        .map(|a| vec![a.trim().to_string()])
        .unwrap_or_default();
    if pod == flags.id {
        sockets.push(containerd_shim::socket_address(
            &flags.address,
            &flags.namespace,
            &pod,
        ));
    }
    for address in sockets.iter().filter(|a| !a.is_empty()) {
        remove_dead_socket(address);
    }
    if pod == flags.id {
        cleanup_pod(&cfg, &store, &pod);
    } else {
        if let Err(e) = crust_sandbox::share::remove_container(&share, &flags.id) {
            tracing::warn!("container {}: {e}", flags.id);
        }
    }
    let d = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let mut ts = containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp::new();
    ts.seconds = d.as_secs() as i64;
    ts.nanos = d.subsec_nanos() as i32;
    let resp = containerd_shim::api::DeleteResponse {
        pid: 0,
        exit_status: 137,
        exited_at: MessageField::some(ts),
        ..Default::default()
    };
    std::io::stdout().write_all(&resp.write_to_bytes()?)?;
    Ok(())
}

/// How long `delete` waits for a shim that is still exiting.
const SHIM_EXIT_GRACE: Duration = Duration::from_secs(2);

/// Removes a dead shim's socket. A killed shim's connections close
/// before its listening socket does (containerd runs `delete` on the
/// first), so a socket that still answers is given [`SHIM_EXIT_GRACE`]
/// to die; one that answers after that belongs to a live shim and stays.
fn remove_dead_socket(address: &str) {
    let until = std::time::Instant::now() + SHIM_EXIT_GRACE;
    while alive(address) {
        if std::time::Instant::now() >= until {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_file(socket_path(address));
}

/// Releases a dead shim's pod: kills its QEMU if it still runs, drops its
/// claims, undoes the share, removes the record.
pub fn cleanup_pod(cfg: &ShimConfig, store: &SandboxStore, pod: &str) {
    let Ok(st) = store.load(pod) else {
        return;
    };
    let serving = || {
        st.shim
            .is_some_and(|s| s.alive() && s.pid != std::process::id() as i32)
    };
    // containerd runs `delete` once the shim's connection is gone, which a
    // killed shim closes while it is still exiting: give it a moment.
    let until = std::time::Instant::now() + SHIM_EXIT_GRACE;
    while serving() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    if serving() {
        // Not dead: the serving shim does its own teardown.
        return;
    }
    if let Some(q) = st.qemu.filter(|q| q.alive()) {
        crust_sandbox::sandbox::kill_and_wait(q);
    }
    crust_sandbox::net::detach_recorded(st.network_namespace.as_deref(), &st.network_links);
    if let Ok(d) = Discovery::for_config(&cfg.runtime) {
        crust_sandbox::claims::release_all(&d, pod, &st.volumes);
    }
    if let Err(e) = crust_sandbox::share::remove(&store.dir(pod).join("share")) {
        tracing::warn!("pod {pod}: {e}");
    }
    let _ = store.remove(pod);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    fn scratch(name: &str) -> (tempfile::TempDir, String) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(name);
        let a = format!("unix://{}", p.display());
        (d, a)
    }

    /// A shim still exiting (its socket answers for a moment) loses its
    /// socket once it stops answering, within the grace.
    #[test]
    fn a_dying_shims_socket_is_removed_once_it_stops_answering() {
        let (_d, a) = scratch("dying.sock");
        let l = UnixListener::bind(socket_path(&a)).unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(l);
        });
        remove_dead_socket(&a);
        t.join().unwrap();
        assert!(!Path::new(socket_path(&a)).exists());
    }

    /// A socket that still answers after the grace is a live shim's: kept.
    #[test]
    fn a_live_shims_socket_stays() {
        let (_d, a) = scratch("live.sock");
        let _l = UnixListener::bind(socket_path(&a)).unwrap();
        remove_dead_socket(&a);
        assert!(Path::new(socket_path(&a)).exists());
        assert!(alive(&a));
    }
}
