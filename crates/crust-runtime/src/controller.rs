//! The per-sandbox shim process: owns the QEMU guest, its QMP connection
//! and the agent client; claims, attaches and mounts the volumes; serves
//! the shim API; tears everything down on `/shutdown` or SIGTERM.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crust_agent_proto::AgentClient;
use crust_agent_proto::stdio::StdioMux;
use crust_qmp::QmpClient;
use tokio::sync::watch;

use crate::runtime::ReadyLine;
use crust_sandbox::bundle::Bundle;
use crust_sandbox::claims::{claim, recorded_cli, release_all};
use crust_sandbox::config::Config;
use crust_sandbox::discovery::{Discovery, HostBind};
use crust_sandbox::error::RuntimeError;
use crust_sandbox::handover::{self, Handover};
use crust_sandbox::lifecycle::{self, BootSpec, Recorded};
use crust_sandbox::net;
use crust_sandbox::plug::{self, Attachments, GuestPorts};
use crust_sandbox::records::Volume;
use crust_sandbox::records::{ProcRef, SandboxState, SharedMount, Status};
use crust_sandbox::sandbox::SandboxStore;
use crust_sandbox::served::{Reach, Served, VolumeLocks};
use crust_sandbox::share;
use crust_sandbox::shim::{self, ApiError, ExecRequest, ExecResponse, LogsResponse, ShimHandler};
use crust_sandbox::stats::{
    FreezeRequest, ResizeRequest, ResizeResponse, ThawRequest, ThawResponse, ThrottleRequest,
    VolumeStats,
};
use crust_sandbox::vm::Guest;
use crust_sandbox::volumes::{self, VolumeError};
use crust_sandbox::workload;

type ApiResult<T> = Result<T, ApiError>;

/// Grace the workload gets between SIGTERM and SIGKILL at teardown.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// Workload status polling period (TCG guests are slow: keep it sparse).
const WORKLOAD_POLL: Duration = Duration::from_millis(500);

pub struct Controller {
    cfg: Config,
    id: String,
    store: SandboxStore,
    discovery: Discovery,
    bundle: Bundle,
    state: Mutex<SandboxState>,
    guest: Guest,
    qmp: QmpClient,
    agent: AgentClient,
    /// The guest's stdio port: the workload's output.
    stdio: StdioMux,
    /// Whether the workload's container was created (until teardown
    /// removes it).
    started: AtomicBool,
    /// Hot-plug buses, plugged volumes and the exclusive holds on their
    /// host devices (kept while the guest may use them).
    attachments: Attachments,
    /// One resize / throttle at a time per volume.
    volume_locks: VolumeLocks,
    hotplug: tokio::sync::Mutex<()>,
    teardown: tokio::sync::Mutex<bool>,
    stopping: AtomicBool,
    /// Some(reason) once QEMU has exited.
    qemu_exit: watch::Receiver<Option<String>>,
}

/// The shim's `main`: sets the sandbox up, reports readiness on the
/// original stdout, serves until shutdown. Returns the exit code.
pub async fn run_shim(cfg: Config, id: String) -> i32 {
    let mut ready = match take_stdout() {
        Ok(f) => f,
        Err(e) => {
            tracing::error!("cannot take over stdout: {e}");
            return 1;
        }
    };
    let store = SandboxStore::new(cfg.root.clone());
    let cfg_kata_dirs = cfg.kata_shim_dirs.clone();
    let ctrl = match setup(cfg, id.clone(), store.clone()).await {
        Ok(c) => Arc::new(c),
        Err(e) => {
            tracing::error!("sandbox {id}: {e}");
            report_failure(&mut ready, e);
            return 1;
        }
    };
    let listener = match shim::bind(&store.socket(&id)) {
        Ok(l) => l,
        Err(e) => {
            let e = RuntimeError::ShimSocket(e);
            ctrl.teardown(Some(e.to_string())).await;
            report_failure(&mut ready, e);
            return 1;
        }
    };
    // Where Kata's CLI looks for it, too (a drop-in for kata-runtime).
    if let Err(msg) = crust_sandbox::katashim::link(&cfg_kata_dirs, &id, &store.socket(&id)) {
        let e = RuntimeError::KataLink(msg);
        ctrl.teardown(Some(e.to_string())).await;
        let _ = std::fs::remove_file(store.socket(&id));
        report_failure(&mut ready, e);
        return 1;
    }
    let (stop_tx, mut stop_rx) = watch::channel(false);
    ctrl.spawn_qemu_watch();
    ctrl.spawn_workload_watch();
    let server = tokio::spawn(shim::serve(listener, ctrl.clone(), stop_tx.clone()));
    ctrl.set_status(Status::Created);
    let _ = writeln!(
        ready,
        "{}",
        serde_json::to_string(&ReadyLine {
            ok: true,
            error: None
        })
        .expect("serializable")
    );
    drop(ready);
    tracing::info!("sandbox {id} ready");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok();
    tokio::select! {
        _ = stop_rx.wait_for(|s| *s) => {}
        _ = async { match term.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => {
            tracing::info!("SIGTERM: tearing down");
            ctrl.teardown(None).await;
            let _ = stop_tx.send(true);
        }
        _ = async { match int.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => {
            tracing::info!("SIGINT: tearing down");
            ctrl.teardown(None).await;
            let _ = stop_tx.send(true);
        }
    }
    let _ = server.await;
    crust_sandbox::katashim::unlink(&cfg_kata_dirs, &id, &store.socket(&id));
    let _ = std::fs::remove_file(store.socket(&id));
    tracing::info!("shim of sandbox {id} exits");
    0
}

/// Tells the waiting CLI on the readiness pipe why the sandbox is not
/// ready (the API's error: code and message).
fn report_failure(ready: &mut File, e: RuntimeError) {
    let line = ReadyLine {
        ok: false,
        error: Some(ApiError::from(e)),
    };
    let _ = writeln!(
        ready,
        "{}",
        serde_json::to_string(&line).expect("serializable")
    );
}

/// Keeps the original stdout (the readiness pipe) and points fd 1 at
/// /dev/null so nothing later can block on or break the pipe.
fn take_stdout() -> std::io::Result<File> {
    let pipe = rustix::io::dup(std::io::stdout())?;
    let null = File::options().write(true).open("/dev/null")?;
    rustix::stdio::dup2_stdout(&null)?;
    Ok(File::from(pipe))
}

/// Everything until the sandbox is ready; on failure undoes what it did.
async fn setup(cfg: Config, id: String, store: SandboxStore) -> Result<Controller, RuntimeError> {
    let mut state = store.load(&id)?;
    let bundle = Bundle::load(&state.bundle)?;
    let discovery = Discovery::for_config(&cfg).and_then(|d| d.for_bundle(&bundle));
    let discovery = match discovery {
        Ok(d) => d,
        Err(e) => {
            let e = RuntimeError::from(e);
            mark_failed(&store, &mut state, &e);
            return Err(e);
        }
    };
    let handover = Handover::new(&cfg);
    let asked_at = take_published_volumes(&handover, &discovery, &bundle, &store, &mut state).await;
    let plan = match asked_at.and_then(|a| {
        let plan = discovery.plan(&bundle)?;
        volumes::check_before_boot(&discovery, &plan.volumes)?;
        Ok((plan, a))
    }) {
        Ok(p) => p,
        Err(e) => {
            handover::give_back(&handover, &discovery, &id, &state.handover_asked).await;
            mark_failed(&store, &mut state, &e);
            return Err(e);
        }
    };
    let (plan, asked_at) = plan;
    let share_dir = record_plan(&cfg, &store, &id, &plan, &mut state)?;

    let undo = |claimed| Undo {
        store: &store,
        discovery: &discovery,
        handover: &handover,
        claimed,
        share_dir: share_dir.as_deref(),
    };
    let mut claimed: Vec<Volume> = Vec::new();
    let res = async {
        for v in &plan.volumes {
            claim(&discovery, &store, &id, v, &recorded_cli()?)?;
            claimed.push(v.clone());
        }
        let spec = boot_spec(&cfg, &store, &bundle, share_dir.as_deref(), &state)?;
        let mut record = |step: Recorded<'_>| {
            step.apply(&mut state);
            Ok(store.save(&state)?)
        };
        lifecycle::boot(spec, &mut record).await
    }
    .await;
    let booted = match res {
        Ok(b) => b,
        Err(e) => {
            undo(&claimed).run(&mut state, &e).await;
            return Err(e);
        }
    };
    let attachments = Attachments::default();
    attachments.set_buses(booted.guest.hotplug_buses());
    let ctrl = Controller {
        state: Mutex::new(state.clone()),
        attachments,
        volume_locks: VolumeLocks::default(),
        hotplug: tokio::sync::Mutex::new(()),
        teardown: tokio::sync::Mutex::new(false),
        stopping: AtomicBool::new(false),
        qemu_exit: booted.exit,
        cfg: cfg.clone(),
        id: id.clone(),
        store: store.clone(),
        discovery: discovery.clone(),
        bundle,
        stdio: StdioMux::new(booted.guest.stdio_socket()),
        started: AtomicBool::new(false),
        guest: booted.guest,
        qmp: booted.qmp,
        agent: booted.agent,
    };
    plug_planned(&ctrl, &plan.volumes, &asked_at).await?;
    Ok(ctrl)
}

/// What a setup that failed after its claims undoes, in teardown order
/// (a failed boot killed its guest and removed its taps): the claims, the
/// handed-over volumes, the share; the record says why.
struct Undo<'a> {
    store: &'a SandboxStore,
    discovery: &'a Discovery,
    handover: &'a Handover,
    claimed: &'a [Volume],
    share_dir: Option<&'a Path>,
}

impl Undo<'_> {
    async fn run(self, state: &mut SandboxState, e: &RuntimeError) {
        release_all(self.discovery, &state.id, self.claimed);
        handover::give_back(
            self.handover,
            self.discovery,
            &state.id,
            &state.handover_asked,
        )
        .await;
        self.share_dir.inspect(|d| share::remove_logged(d));
        mark_failed(self.store, state, e);
    }
}

/// What the CLI door boots: the configured guest with the virtio-fs share
/// (when the sandbox has one) and the bundle's network namespace, if it
/// names one (mirrored as the VM's NICs, as the containerd door mirrors a
/// pod's; none named: the guest has `lo` only).
fn boot_spec<'a>(
    cfg: &'a Config,
    store: &SandboxStore,
    bundle: &Bundle,
    share_dir: Option<&Path>,
    state: &SandboxState,
) -> Result<BootSpec<'a>, RuntimeError> {
    let mut vm = Guest::config(cfg, &store.vm_dir(&state.id), &state.id);
    if let Some(dir) = share_dir {
        let view = share::make_with_binds(dir, &state.shared_mounts)?;
        vm.shares = vec![crust_vmm::ShareSpec {
            tag: share::SHARE_TAG.into(),
            dir: view,
        }];
        vm.virtiofsd_binary = cfg.virtiofsd.clone();
    }
    let network = match &bundle.network_namespace {
        Some(path) => net::PodNetworkSpec::Namespace(path.clone()),
        None => net::PodNetworkSpec::Empty,
    };
    let policy = net::NetPolicy {
        rules: cfg.netns_rules,
        anti_spoofing: if bundle.anti_spoofing_off {
            crust_podnet::AntiSpoof::Off
        } else {
            crust_podnet::AntiSpoof::On
        },
    };
    Ok(BootSpec {
        cfg,
        vm,
        network,
        policy,
    })
}

/// Persists who we are and what we are about to claim before claiming, so
/// a crash at any point leaves enough on disk to clean up; answers the
/// sandbox's virtio-fs share directory when it has one.
fn record_plan(
    cfg: &Config,
    store: &SandboxStore,
    id: &str,
    plan: &crust_sandbox::discovery::Plan,
    state: &mut SandboxState,
) -> Result<Option<PathBuf>, RuntimeError> {
    state.shim = Some(ProcRef::current());
    state.volumes = plan.volumes.clone();
    state.mounts = plan.mounts.clone();
    // A declined handover leaves a host mount the workload expects: it is
    // shared over virtio-fs (auto mode's fallback), never skipped.
    let declined = state.events.iter().any(|e| e.outcome == handover::ON_HOST);
    let share_dir = ((cfg.share_binds || declined) && !plan.binds.is_empty())
        .then(|| store.dir(id).join(share::SHARE_DIR));
    if share_dir.is_some() {
        state.shared_mounts = shared_mounts(&plan.binds);
    } else {
        state.skipped_mounts = plan.skipped.clone();
    }
    store.save(state)?;
    for m in &state.skipped_mounts {
        tracing::warn!(
            "mount {m} has no hand-off record; the guest cannot see host paths, skipping it \
             (--share-binds shares them over virtio-fs)"
        );
    }
    Ok(share_dir)
}

/// Plugs the planned volumes into the ready guest; a failure tears the
/// sandbox down. A handed-over volume's time from request to mounted is
/// logged and recorded.
async fn plug_planned(
    ctrl: &Controller,
    volumes: &[Volume],
    asked_at: &HashMap<String, Instant>,
) -> Result<(), RuntimeError> {
    for v in volumes {
        let plug_t0 = Instant::now();
        if let Err(e) = ctrl.plug(v).await {
            let e = RuntimeError::from(e);
            ctrl.teardown(Some(e.to_string())).await;
            return Err(e);
        }
        if let Some(t0) = asked_at.get(&v.target) {
            ctrl.update(handover::mounted(&v.target, *t0, plug_t0));
            handover::crash_point("mounted");
        }
    }
    Ok(())
}

/// The CLI door's sandbox record: in memory, saved on every change.
struct Saved<'a> {
    store: &'a SandboxStore,
    state: &'a mut SandboxState,
}

impl handover::StateLog for Saved<'_> {
    fn answered(&self, source: &str) -> bool {
        self.state.events.iter().any(|e| e.target == source)
    }

    fn update(&mut self, f: impl FnOnce(&mut SandboxState)) -> Result<(), RuntimeError> {
        f(self.state);
        Ok(self.store.save(self.state)?)
    }
}

/// Offers the bundle's crust-csi host publications for hand-over
/// ([`handover::take_published_volumes`]); returns when each handed-over
/// target was asked, for the latency log.
async fn take_published_volumes(
    handover: &Handover,
    discovery: &Discovery,
    bundle: &Bundle,
    store: &SandboxStore,
    state: &mut SandboxState,
) -> Result<HashMap<String, Instant>, RuntimeError> {
    if !handover.configured() {
        return Ok(HashMap::new());
    }
    let cli = recorded_cli()?;
    let id = state.id.clone();
    let mut log = Saved { store, state };
    let mut taken = handover::Taken::default();
    handover::take_published_volumes(handover, discovery, bundle, &id, &cli, &mut log, &mut taken)
        .await?;
    Ok(taken.asked_at)
}

/// Where each bind goes in the share: `m<i>` in bundle order.
fn shared_mounts(binds: &[HostBind]) -> Vec<SharedMount> {
    binds
        .iter()
        .enumerate()
        .map(|(i, b)| SharedMount {
            destination: b.destination.clone(),
            source: b.source.clone(),
            path: format!("m{i}"),
            readonly: b.readonly,
        })
        .collect()
}

fn mark_failed(store: &SandboxStore, state: &mut SandboxState, e: &RuntimeError) {
    state.status = Status::Stopped;
    state.reason = Some(e.to_string());
    let _ = store.save(state);
}

impl Controller {
    fn snapshot(&self) -> SandboxState {
        self.state.lock().expect("state lock").clone()
    }

    /// Applies `f` to the state and persists it.
    fn update(&self, f: impl FnOnce(&mut SandboxState)) -> SandboxState {
        let mut st = self.state.lock().expect("state lock");
        f(&mut st);
        if let Err(e) = self.store.save(&st) {
            tracing::error!("persisting state: {e}");
        }
        st.clone()
    }

    fn set_status(&self, status: Status) {
        self.update(|s| s.status = status);
    }

    fn qemu_exited(&self) -> Option<String> {
        self.qemu_exit.borrow().clone()
    }

    fn not_running(&self, reason: &str) -> ApiError {
        RuntimeError::SandboxDown {
            id: self.id.clone(),
            reason: reason.to_string(),
        }
        .into()
    }

    /// Marks the sandbox stopped when QEMU exits on its own.
    fn spawn_qemu_watch(self: &Arc<Self>) {
        let me = self.clone();
        let mut rx = self.qemu_exit.clone();
        tokio::spawn(async move {
            let Ok(reason) = rx.wait_for(|r| r.is_some()).await.map(|r| r.clone()) else {
                return;
            };
            if me.stopping.load(Ordering::SeqCst) {
                return;
            }
            // QEMU is gone: its guest cannot use the devices any more.
            me.attachments.guest_gone();
            let reason = reason.unwrap_or_default();
            tracing::error!("QEMU exited unexpectedly: {reason}");
            me.update(|s| {
                s.status = Status::Stopped;
                s.reason = Some(format!("QEMU exited ({reason})"));
            });
        });
    }

    /// Once the workload runs, waits for it to exit and records its status.
    fn spawn_workload_watch(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                if me.stopping.load(Ordering::SeqCst) || me.qemu_exited().is_some() {
                    return;
                }
                if me.snapshot().status != Status::Running {
                    tokio::time::sleep(WORKLOAD_POLL).await;
                    continue;
                }
                match workload::wait(&me.agent).await {
                    Ok(exit) => {
                        tracing::info!("workload exited with {}", exit.exit_code);
                        me.update(|s| {
                            s.status = Status::Stopped;
                            s.exit_status = Some(exit.exit_code);
                        });
                        return;
                    }
                    Err(e) => {
                        tracing::debug!("waiting for the workload: {e}");
                        tokio::time::sleep(WORKLOAD_POLL).await;
                    }
                }
            }
        });
    }

    /// Formats (createFilesystem), holds, attaches and mounts one volume
    /// through the plug routine both front doors share.
    async fn plug(&self, v: &Volume) -> Result<(), VolumeError> {
        let ports = GuestPorts {
            qmp: &self.qmp,
            agent: &self.agent,
            mount_timeout: self.cfg.boot_timeout,
            file_device_roots: &self.cfg.file_device_roots,
            records: Some(&self.discovery),
        };
        if let Some(io) = plug::plug(&self.attachments, &ports, v).await? {
            self.update(|s| {
                s.block_io.insert(v.target.clone(), io);
            });
        }
        Ok(())
    }

    /// The sandbox as its shim API serves it ([`Served`]).
    fn served(&self) -> Served<'_> {
        let reach = if self.qemu_exited().is_some() {
            Reach::Down("QEMU exited".into())
        } else if self.stopping.load(Ordering::SeqCst) {
            Reach::Down("shutting down".into())
        } else {
            Reach::Live {
                qmp: &self.qmp,
                agent: &self.agent,
            }
        };
        Served {
            state: self.snapshot(),
            reach,
            attachments: &self.attachments,
            locks: &self.volume_locks,
            timeout: self.cfg.timeout,
            slow_timeout: self.cfg.boot_timeout,
            // The workload's view (its root and binds), once it exists.
            exec_in: self
                .started
                .load(Ordering::SeqCst)
                .then(|| workload::ID.to_string()),
        }
    }

    /// Stops the workload, unmounts, powers the guest off (killing it if
    /// it does not comply), releases the claims. Idempotent.
    pub async fn teardown(&self, failure: Option<String>) {
        let mut done = self.teardown.lock().await;
        if *done {
            return;
        }
        self.stopping.store(true, Ordering::SeqCst);
        let running = self.qemu_exited().is_none();
        if running && self.started.swap(false, Ordering::SeqCst) {
            lifecycle::timed(
                "teardown: stopping the workload",
                workload::stop(&self.agent, STOP_GRACE),
            )
            .await;
        }
        let st = self.snapshot();
        let stop = crust_sandbox::vm::GuestStop {
            guest: &self.guest,
            qmp: &self.qmp,
            agent: &self.agent,
            timeout: self.cfg.timeout,
        };
        let share = self.store.dir(&self.id).join(share::SHARE_DIR);
        lifecycle::teardown(lifecycle::Teardown {
            id: &self.id,
            guest: Some((stop, running)),
            attachments: &self.attachments,
            discovery: &self.discovery,
            handover: &Handover::new(&self.cfg),
            state: &st,
            share: (!st.shared_mounts.is_empty()).then_some(share.as_path()),
        })
        .await;
        self.update(|s| {
            s.status = Status::Stopped;
            if let Some(f) = failure {
                s.reason = Some(f);
            }
        });
        *done = true;
    }
}

impl ShimHandler for Controller {
    async fn state(&self) -> ApiResult<SandboxState> {
        Ok(self.snapshot())
    }

    async fn start(&self) -> ApiResult<SandboxState> {
        if let Some(r) = self.qemu_exited() {
            return Err(self.not_running(&format!("QEMU exited: {r}")));
        }
        let st = self.snapshot();
        if st.status != Status::Created {
            return Err(RuntimeError::NotCreated {
                id: self.id.clone(),
                status: st.status.as_str(),
            }
            .into());
        }
        let req = workload::request(&self.bundle, &st, share::SHARE_TAG);
        let log = workload::log_path(&self.store.dir(&self.id));
        self.started.store(true, Ordering::SeqCst);
        let started = workload::start(&self.agent, &self.stdio, req, &log, self.cfg.boot_timeout);
        if let Err(e) = started.await {
            self.started.store(false, Ordering::SeqCst);
            return Err(e.into());
        }
        Ok(self.update(|s| s.status = Status::Running))
    }

    async fn kill(&self, signal: i32) -> ApiResult<()> {
        if let Some(r) = self.qemu_exited() {
            return Err(self.not_running(&format!("QEMU exited: {r}")));
        }
        Ok(workload::signal(&self.agent, signal).await?)
    }

    async fn shutdown(&self) -> ApiResult<()> {
        self.teardown(None).await;
        Ok(())
    }

    async fn metrics(&self) -> ApiResult<String> {
        Ok(self.served().metrics().await)
    }

    async fn stats(&self, path: String) -> ApiResult<VolumeStats> {
        self.served().stats(&path).await
    }

    async fn resize(&self, req: ResizeRequest) -> ApiResult<ResizeResponse> {
        self.served().resize(req).await
    }

    async fn freeze(&self, req: FreezeRequest) -> ApiResult<()> {
        self.served().freeze(req).await
    }

    async fn thaw(&self, req: ThawRequest) -> ApiResult<ThawResponse> {
        self.served().thaw(req).await
    }

    async fn throttle(&self, req: ThrottleRequest) -> ApiResult<()> {
        self.served().throttle(req).await
    }

    async fn add_volume(&self, volume_path: String) -> ApiResult<Volume> {
        if let Some(r) = self.qemu_exited() {
            return Err(self.not_running(&format!("QEMU exited: {r}")));
        }
        if self.stopping.load(Ordering::SeqCst) {
            return Err(self.not_running("shutting down"));
        }
        let _g = self.hotplug.lock().await;
        if let Ok(v) = self.served().volume(&volume_path)
            && v.target == volume_path
        {
            return Ok(v);
        }
        let (layout, mi) = self
            .discovery
            .exact(&volume_path)
            .map_err(RuntimeError::from)?
            .ok_or_else(|| RuntimeError::NoRecord {
                what: volume_path.clone(),
            })?;
        let v = Volume::from_record(layout, &volume_path, &mi, false);
        volumes::check_before_boot(&self.discovery, std::slice::from_ref(&v))
            .map_err(ApiError::from)?;
        if self.snapshot().volumes.iter().any(|o| o.id == v.id) {
            return Err(RuntimeError::VolumeIdTaken(v.id).into());
        }
        // Record before claiming so a crash leaves the claim releasable.
        self.update(|s| s.volumes.push(v.clone()));
        let res = match recorded_cli()
            .and_then(|cli| claim(&self.discovery, &self.store, &self.id, &v, &cli))
        {
            Ok(()) => self.plug(&v).await.map_err(RuntimeError::from),
            Err(e) => Err(e),
        };
        if let Err(e) = res {
            release_all(&self.discovery, &self.id, std::slice::from_ref(&v));
            self.update(|s| s.volumes.retain(|o| o.id != v.id));
            return Err(e.into());
        }
        Ok(v)
    }

    async fn exec(&self, req: ExecRequest) -> ApiResult<ExecResponse> {
        self.served().exec(req).await
    }

    /// The workload's log is on the host: it answers after the guest
    /// is gone, too.
    async fn logs(&self) -> ApiResult<LogsResponse> {
        let log = workload::log_path(&self.store.dir(&self.id));
        let output = workload::tail(&log).map_err(|source| RuntimeError::Io {
            context: format!("reading the workload's log {}", log.display()),
            source,
        })?;
        Ok(LogsResponse { output })
    }
}
