//! The CLI side of every command: sandbox lifecycle (through the shim),
//! the KEP `crust stats|resize` protocol and the Kata-compatible
//! `direct-volume` commands.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crust_handoff::{HandoffError, MountInfo};
use serde::{Deserialize, Serialize};

use crust_sandbox::bundle::Bundle;
use crust_sandbox::config::Config;
use crust_sandbox::discovery::Discovery;
use crust_sandbox::error::RuntimeError;
use crust_sandbox::records::{LayoutKind, Volume};
use crust_sandbox::records::{ProcRef, SandboxState, Status};
use crust_sandbox::sandbox::SandboxStore;
use crust_sandbox::shim::{ApiError, ExecRequest, ExecResponse, ShimClient, ShimError};
use crust_sandbox::stats::{ResizeRequest, ResizeResponse, VolumeStats};
use crust_sandbox::volumes;

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// What the shim writes on its stdout once: ready, or why not.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadyLine {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
}

/// How long `delete` waits for a shim to exit after `/shutdown`.
const SHIM_EXIT_WAIT: Duration = Duration::from_secs(20);

pub struct Runtime {
    pub cfg: Config,
    pub sandboxes: SandboxStore,
    pub discovery: Discovery,
}

impl Runtime {
    pub fn new(cfg: Config) -> Result<Runtime> {
        let discovery = Discovery::for_config(&cfg)?;
        Ok(Runtime {
            sandboxes: SandboxStore::new(cfg.root.clone()),
            discovery,
            cfg,
        })
    }

    /// A client of sandbox `id`'s shim. Its bound is a little longer than
    /// the shim's own bound on agent calls, so a hung guest is reported by
    /// the shim (naming the agent call) rather than as a silent shim.
    pub fn client(&self, id: &str) -> ShimClient {
        ShimClient::new(
            self.sandboxes.socket(id),
            self.cfg.timeout + Duration::from_secs(2),
        )
    }

    /// Loads a sandbox's state with its effective status.
    pub fn load(&self, id: &str) -> Result<SandboxState> {
        Ok(self.sandboxes.load(id)?.effective())
    }

    // ---- lifecycle -------------------------------------------------------

    /// Validates everything that can be validated without side effects,
    /// then spawns the shim and waits until it reports the sandbox ready
    /// (guest booted, volumes attached and mounted) or failed.
    pub async fn create(&self, bundle_dir: &Path, id: &str) -> Result<SandboxState> {
        SandboxStore::check_id(id)?;
        let dir = if bundle_dir.is_absolute() {
            bundle_dir.to_path_buf()
        } else {
            std::env::current_dir()
                .map_err(RuntimeError::io("current directory"))?
                .join(bundle_dir)
        };
        let bundle = Bundle::load(&dir)?;
        bundle.refuse_unsupported()?;
        // A kubelet root mismatch fails here, before any handover.
        let discovery = self.discovery.for_bundle(&bundle)?;
        let plan = discovery.plan(&bundle)?;
        // Every record checked before a VM starts (issue 25).
        crust_sandbox::volumes::check_before_boot(&discovery, &plan.volumes)?;
        for v in &plan.volumes {
            let claimant = self.discovery.store(v.layout).claimant(&v.target)?;
            if let Some(other) = claimant.filter(|o| o != id && self.sandboxes.holds_volumes(o)) {
                return Err(RuntimeError::Handoff(HandoffError::Claimed {
                    target: v.target.clone(),
                    by: other,
                }));
            }
        }
        for (what, p) in [
            ("guest kernel", &self.cfg.guest_kernel),
            ("guest initrd", &self.cfg.guest_initrd),
        ] {
            if !p.is_file() {
                return Err(RuntimeError::GuestImageMissing {
                    what,
                    path: p.clone(),
                });
            }
        }
        self.sandboxes.create(id)?;
        let res = self.spawn_shim(id, &bundle).await;
        if let Err(e) = res {
            self.cleanup_dead(id);
            return Err(e);
        }
        self.load(id)
    }

    async fn spawn_shim(&self, id: &str, bundle: &Bundle) -> Result<()> {
        self.sandboxes
            .save(&SandboxState::for_bundle_dir(id, bundle.dir.clone()))?;
        let exe = std::env::current_exe().map_err(RuntimeError::io("locating this executable"))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(self.sandboxes.log(id))
            .map_err(RuntimeError::io("creating shim.log"))?;
        let (rd, wr) = std::io::pipe().map_err(RuntimeError::io("pipe"))?;
        let mut cmd = Command::new(exe);
        cmd.args(self.cfg.to_args())
            .arg("shim")
            .arg("--id")
            .arg(id)
            .stdin(Stdio::null())
            .stdout(wr)
            .stderr(log);
        crust_sys::spawn::ChildSetup::new()
            .new_session()
            .apply(&mut cmd)
            .map_err(RuntimeError::io("setting up the shim's start"))?;
        let mut child = cmd.spawn().map_err(RuntimeError::io("spawning the shim"))?;
        drop(cmd); // closes our copy of the pipe's write end
        let reader = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            BufReader::new(rd).read_line(&mut line).map(|_| line)
        });
        let wait = self.cfg.create_timeout() + Duration::from_secs(5);
        let line = match tokio::time::timeout(wait, reader).await {
            Ok(Ok(Ok(line))) => line,
            Ok(_) => String::new(),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(RuntimeError::ShimNotReady {
                    id: id.to_string(),
                    wait,
                });
            }
        };
        match serde_json::from_str::<ReadyLine>(line.trim()) {
            Ok(ReadyLine { ok: true, .. }) => Ok(()),
            Ok(ReadyLine { error, .. }) => {
                let _ = wait_child(&mut child, SHIM_EXIT_WAIT);
                Err(error.map_or(RuntimeError::ShimFailedSilently, |e| {
                    RuntimeError::Shim(ShimError::Api(e))
                }))
            }
            Err(_) => {
                let _ = wait_child(&mut child, SHIM_EXIT_WAIT);
                Err(RuntimeError::ShimExited {
                    id: id.to_string(),
                    log_tail: log_tail(&self.sandboxes.log(id), 2000),
                })
            }
        }
    }

    /// Best-effort teardown of a sandbox whose shim is gone (or never
    /// came up): kill its QEMU, release its claims, drop its directory.
    pub fn cleanup_dead(&self, id: &str) {
        if let Ok(st) = self.sandboxes.load(id) {
            if let Some(shim) = st
                .shim
                .filter(|s| s.alive() && s.pid != std::process::id() as i32)
            {
                crust_sandbox::sandbox::kill_and_wait(shim);
            }
            if let Some(q) = st.qemu.filter(ProcRef::alive) {
                crust_sandbox::sandbox::kill_and_wait(q);
            }
            crust_sandbox::net::detach_recorded(st.network_namespace.as_deref(), &st.network_links);
            for v in &st.volumes {
                if let Err(e) = self.discovery.store(v.layout).release(&v.target, id) {
                    tracing::warn!(target = %v.target, "releasing the claim: {e}");
                }
            }
            // Handed-over volumes not planned yet (the shim died right
            // after the plugin answered): crust-csi takes an unclaimed
            // volume back at kubelet's next unpublish, or a handover.
            let crust = self
                .discovery
                .store(crust_sandbox::records::LayoutKind::Crust);
            for t in &st.handover_asked {
                if let Err(e) = crust.release(t, id)
                    && !matches!(e, crust_handoff::HandoffError::NotFound(_))
                {
                    tracing::warn!(target = %t, "releasing the claim: {e}");
                }
            }
        }
        crust_sandbox::katashim::unlink(&self.cfg.kata_shim_dirs, id, &self.sandboxes.socket(id));
        if let Err(e) = self.sandboxes.remove(id) {
            tracing::warn!("removing sandbox {id}: {e}");
        }
    }

    pub async fn start(&self, id: &str) -> Result<SandboxState> {
        let st = self.load(id)?;
        if st.status != Status::Created {
            return Err(RuntimeError::NotCreated {
                id: id.to_string(),
                status: st.status.as_str(),
            });
        }
        Ok(self.client(id).start().await?)
    }

    /// The current state: from the shim when it answers, else from disk.
    pub async fn state(&self, id: &str) -> Result<SandboxState> {
        let st = self.load(id)?;
        if st.shim.is_some_and(|s| s.alive())
            && let Ok(fresh) = self.client(id).state().await
        {
            return Ok(fresh);
        }
        Ok(st)
    }

    pub async fn kill(&self, id: &str, signal: i32) -> Result<()> {
        let st = self.load(id)?;
        if st.status != Status::Running {
            return Err(RuntimeError::NotRunning {
                id: id.to_string(),
                status: st.status.as_str(),
            });
        }
        Ok(self.client(id).kill(signal).await?)
    }

    /// Tears the sandbox down. A running workload needs `force`. A missing
    /// sandbox is an error unless `force`.
    pub async fn delete(&self, id: &str, force: bool) -> Result<()> {
        SandboxStore::check_id(id)?;
        let st = match self.load(id) {
            Ok(st) => st,
            Err(RuntimeError::Sandbox(crust_sandbox::sandbox::SandboxError::NotFound(_))) => {
                if self.sandboxes.exists(id) {
                    // A create that died before writing its state.
                    self.cleanup_dead(id);
                    return Ok(());
                }
                if force {
                    return Ok(());
                }
                return Err(RuntimeError::NoSandbox { id: id.to_string() });
            }
            Err(e) => return Err(e),
        };
        if st.status == Status::Running && !force {
            return Err(RuntimeError::StillRunning { id: id.to_string() });
        }
        if let Some(shim) = st.shim.filter(ProcRef::alive) {
            let client = self
                .client(id)
                .with_timeout(self.cfg.timeout * 3 + Duration::from_secs(20));
            if let Err(e) = client.shutdown().await {
                tracing::warn!("sandbox {id}: orderly shutdown failed ({e}); killing it");
            }
            let deadline = Instant::now() + SHIM_EXIT_WAIT;
            while shim.alive() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        self.cleanup_dead(id);
        Ok(())
    }

    /// create + start; unless `detach`, waits for the workload to exit,
    /// deletes the sandbox and returns the workload's exit status.
    pub async fn run(&self, bundle_dir: &Path, id: &str, detach: bool) -> Result<Option<i32>> {
        self.create(bundle_dir, id).await?;
        if let Err(e) = self.start(id).await {
            let _ = self.delete(id, true).await;
            return Err(e);
        }
        if detach {
            return Ok(None);
        }
        let st = loop {
            let st = self.load(id)?;
            if st.status == Status::Stopped {
                break st;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        self.delete(id, true).await?;
        match st.exit_status {
            Some(code) => Ok(Some(code)),
            None => Err(RuntimeError::NoExitStatus {
                id: id.to_string(),
                reason: st.reason.unwrap_or_else(|| "unknown reason".into()),
            }),
        }
    }

    pub async fn exec(
        &self,
        id: &str,
        args: Vec<String>,
        timeout: Duration,
    ) -> Result<ExecResponse> {
        let req = ExecRequest {
            args,
            env: Vec::new(),
            timeout_ms: Some(timeout.as_millis() as u64),
        };
        let client = self.client(id).with_timeout(timeout + self.cfg.timeout);
        Ok(client.exec(&req).await?)
    }

    pub async fn logs(&self, id: &str) -> Result<String> {
        Ok(self.client(id).logs().await?.output)
    }

    pub async fn add_volume(&self, id: &str, volume_path: &str) -> Result<Volume> {
        let client = self.client(id).with_timeout(self.cfg.boot_timeout);
        Ok(client.add_volume(volume_path).await?)
    }

    // ---- stats and resize ------------------------------------------------

    /// The sandbox serving `volume_path` (via the record's claimant), or
    /// the abnormal condition to report when it no longer runs.
    fn serving_sandbox(
        &self,
        volume_path: &str,
    ) -> Result<std::result::Result<String, VolumeStats>> {
        let (layout, _) =
            self.discovery
                .exact(volume_path)?
                .ok_or_else(|| RuntimeError::NoRecord {
                    what: format!("volume {volume_path}"),
                })?;
        let claimant = self
            .discovery
            .store(layout)
            .claimant(volume_path)?
            .ok_or_else(|| RuntimeError::Unclaimed {
                target: volume_path.to_string(),
            })?;
        // These words are for people; whether a claim may go is decided
        // by `crust sandbox-state` (SandboxStore::liveness), never by them.
        let st = match self.sandboxes.load(&claimant) {
            Ok(st) => st,
            Err(crust_sandbox::sandbox::SandboxError::NotFound(_)) => {
                return Ok(Err(VolumeStats::abnormal(format!(
                    "sandbox {claimant} is unknown to runtime root {} (state unknown)",
                    self.cfg.root.display()
                ))));
            }
            Err(e) => return Err(e.into()),
        };
        let qemu_alive = st.qemu.is_some_and(|q| q.alive());
        let shim_alive = st.shim.is_some_and(|s| s.alive());
        if !st.holds_volumes() {
            let why = if st.qemu.is_some() {
                "QEMU exited"
            } else if !shim_alive {
                "its shim exited"
            } else {
                "it stopped before its VM started"
            };
            return Ok(Err(VolumeStats::abnormal(format!(
                "sandbox {claimant} is not running ({why})"
            ))));
        }
        if !qemu_alive {
            return Ok(Err(VolumeStats::abnormal(format!(
                "sandbox {claimant} is starting (its VM is not up yet)"
            ))));
        }
        if !shim_alive {
            return Ok(Err(VolumeStats::abnormal(format!(
                "the shim of sandbox {claimant} exited but its QEMU (pid {}) still runs; \
                 delete the sandbox",
                st.qemu.map(|q| q.pid).unwrap_or_default()
            ))));
        }
        Ok(Ok(claimant))
    }

    /// KEP `crust stats` / Kata `direct-volume stats`. Blocking: it is the
    /// whole work of a CLI run on every kubelet poll (see [`crate::cli::poll`]).
    pub fn volume_stats(&self, volume_path: &str) -> Result<VolumeStats> {
        let id = match self.serving_sandbox(volume_path)? {
            Ok(id) => id,
            Err(abnormal) => return Ok(abnormal),
        };
        match self.client(&id).stats_blocking(volume_path) {
            Ok(s) => Ok(s),
            Err(ShimError::Unreachable { .. }) if !self.sandboxes.holds_volumes(&id) => Ok(
                VolumeStats::abnormal(format!("sandbox {id} is not running (QEMU exited)")),
            ),
            Err(e) => Err(e.into()),
        }
    }

    /// `crust freeze`: the sandbox serving `volume_path` freezes it.
    pub async fn volume_freeze(&self, volume_path: &str, max_frozen_ms: u64) -> Result<()> {
        // Before any record or guest is looked at.
        crust_agent_proto::freeze_limit(max_frozen_ms).map_err(RuntimeError::BadFreezeLimit)?;
        let id = self.serving(volume_path)?;
        let req = crust_sandbox::stats::FreezeRequest {
            volume_path: volume_path.to_string(),
            max_frozen_ms,
        };
        Ok(self.client(&id).freeze(&req).await?)
    }

    /// `crust thaw`.
    pub async fn volume_thaw(
        &self,
        volume_path: &str,
    ) -> Result<crust_sandbox::stats::ThawResponse> {
        let id = self.serving(volume_path)?;
        let req = crust_sandbox::stats::ThawRequest {
            volume_path: volume_path.to_string(),
        };
        Ok(self.client(&id).thaw(&req).await?)
    }

    /// `crust throttle`: the sandbox serving `volume_path` applies the
    /// I/O limits (wire form, empty = none) to its device.
    pub async fn volume_throttle(&self, volume_path: &str, limits: &str) -> Result<()> {
        // Before any record or guest is looked at.
        crust_handoff::IoLimits::from_wire(limits).map_err(RuntimeError::BadIoLimits)?;
        let id = self.serving(volume_path)?;
        let req = crust_sandbox::stats::ThrottleRequest {
            volume_path: volume_path.to_string(),
            limits: limits.to_string(),
        };
        Ok(self.client(&id).throttle(&req).await?)
    }

    /// The sandbox serving `volume_path`, or UNAVAILABLE saying why not.
    fn serving(&self, volume_path: &str) -> Result<String> {
        match self.serving_sandbox(volume_path)? {
            Ok(id) => Ok(id),
            Err(abnormal) => Err(RuntimeError::NotServed(abnormal.volume_condition.message)),
        }
    }

    /// KEP `crust resize` (min, max) / Kata `direct-volume resize` (size).
    pub async fn volume_resize(
        &self,
        volume_path: &str,
        min: u64,
        max: u64,
    ) -> Result<ResizeResponse> {
        if max > 0 && max < min {
            return Err(RuntimeError::MaxBelowMin { min, max });
        }
        let id = self.serving(volume_path)?;
        let req = ResizeRequest {
            volume_path: volume_path.to_string(),
            size: min,
            max_bytes: (max > 0).then_some(max),
        };
        let client = self.client(&id).with_timeout(self.cfg.boot_timeout);
        let resp = client.resize(&req).await?;
        if resp.capacity_bytes < min || (max > 0 && resp.capacity_bytes > max) {
            return Err(RuntimeError::ResizedOutOfRange {
                target: volume_path.to_string(),
                capacity: resp.capacity_bytes,
                min,
                max,
            });
        }
        Ok(resp)
    }

    // ---- Kata direct-volume records --------------------------------------

    /// `direct-volume add`: writes the Kata layout record (0600 in a 0700
    /// dir) for what a sandbox would consume: the reader's rules
    /// ([`crust_handoff::Store::stage_bytes`]: keys as Kata's Go decoder
    /// reads them, unknown metadata ignored, `createFilesystem` understood)
    /// and the guest's ([`volumes::check_for_guest`]: fstype, options once
    /// `bind` is dropped). The caller's bytes are stored as given when
    /// every reader takes them alike, else their canonical form. A new or
    /// changed record needs a device nobody holds (not mounted in any
    /// namespace, no exclusive holder): the host's own disk, or a volume
    /// mounted on the host, is refused.
    pub fn direct_volume_add(&self, volume_path: &str, mount_info: &str) -> Result<()> {
        let bad = RuntimeError::BadMountInfo;
        let store = self.discovery.store(LayoutKind::Kata);
        let mi = store.normalized(&MountInfo::from_json(mount_info.as_bytes()).map_err(bad)?);
        store.check_target(volume_path)?;
        store.check_record(&mi).map_err(bad)?;
        let v = Volume::from_record(LayoutKind::Kata, volume_path, &mi, false);
        volumes::check_for_guest(&v).map_err(|e| bad(e.to_string()))?;
        for w in crust_handoff::validate::metadata_warnings(&mi) {
            tracing::warn!(volume_path, "--mount-info: {w}");
        }
        if !store.read(volume_path).is_ok_and(|old| old == mi) {
            crust_blockdev::ensure_device_free(
                Path::new(&mi.device),
                crust_blockdev::HAND_TO_GUEST,
            )
            .map_err(RuntimeError::DeviceHeld)?;
        }
        store.stage_bytes(volume_path, mount_info.as_bytes())?;
        Ok(())
    }

    /// `direct-volume remove`: drops the Kata record, refused while a live
    /// sandbox uses the volume.
    pub fn direct_volume_remove(&self, volume_path: &str) -> Result<()> {
        let store = self.discovery.store(LayoutKind::Kata);
        match store.claimant(volume_path) {
            Ok(Some(id)) if self.sandboxes.holds_volumes(&id) => {
                return Err(RuntimeError::Handoff(HandoffError::Claimed {
                    target: volume_path.into(),
                    by: id,
                }));
            }
            Ok(_) | Err(HandoffError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(store.remove(volume_path)?)
    }
}

fn wait_child(
    child: &mut std::process::Child,
    within: Duration,
) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            return child.wait().ok();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The last `max` bytes of a log file (for error messages).
pub fn log_tail(path: &Path, max: usize) -> String {
    let data = std::fs::read(path).unwrap_or_default();
    let start = data.len().saturating_sub(max);
    String::from_utf8_lossy(&data[start..]).into_owned()
}
