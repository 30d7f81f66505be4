//! [`CrustOps`]: the Runtime operations, usable in-process (the CSI plugin)
//! or behind the gRPC service (the daemon).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use crust_handoff::liveness::{
    UNSUPPORTED_EXIT, VERB_FREEZE, VERB_SANDBOX_STATE, VERB_THAW, VERB_THROTTLE,
};
use crust_handoff::{
    Capabilities, FsGroupChangePolicy, HandoffError, IO_LIMITS_KEY, IoLimits, Layout, MountInfo,
    Policy, SandboxLiveness, SandboxState, Store,
};

use crate::cli;
use crate::error::OpsError;
use crate::parse::{self, VolumeStats};

/// Which hand-off layouts crust_ops writes and serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutMode {
    /// KEP-2857 `/var/run/crust/<sha256>/` with a `runtime-cli`.
    Crust,
    /// Kata direct volumes, served through `kata-runtime direct-volume`.
    Kata,
    /// Both records on stage; stats/expand through whichever a runtime took.
    Both,
}

impl FromStr for LayoutMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "crust" => Ok(LayoutMode::Crust),
            "kata" => Ok(LayoutMode::Kata),
            "both" => Ok(LayoutMode::Both),
            other => Err(format!("layout {other:?} is not crust, kata or both")),
        }
    }
}

#[derive(Debug, Clone)]
pub struct OpsConfig {
    pub layout: LayoutMode,
    pub crust_root: PathBuf,
    pub kata_root: PathBuf,
    /// `kata-runtime` (Kata layout: `direct-volume stats|resize`).
    pub kata_runtime: PathBuf,
    /// How long a runtime CLI may take before it is killed.
    pub cli_timeout: Duration,
    /// Variables added to every runtime CLI's environment.
    pub cli_env: Vec<(String, String)>,
    /// Targets must lie beneath one of these; empty: any absolute path.
    pub allowed_target_prefixes: Vec<String>,
    /// Regular files beneath these are accepted as devices (tests, images).
    pub file_device_roots: Vec<PathBuf>,
    pub allowed_fstypes: Vec<String>,
    /// Where Kata's shims listen: `<dir>/<sandbox-id>/shim-monitor.sock`.
    /// A Kata claim is released only when none of these answers.
    pub kata_shim_dirs: Vec<PathBuf>,
}

/// Kata's shim socket directories, in the order Kata's CLI tries them.
pub const DEFAULT_KATA_SHIM_DIRS: [&str; 2] = ["/run/vc/sbs", "/run/kata"];
/// File name of Kata's shim socket in its sandbox directory.
pub const KATA_SHIM_SOCKET: &str = "shim-monitor.sock";

pub const DEFAULT_KATA_RUNTIME: &str = "/usr/bin/kata-runtime";
pub const DEFAULT_CLI_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for OpsConfig {
    fn default() -> Self {
        OpsConfig {
            layout: LayoutMode::Crust,
            crust_root: crust_handoff::DEFAULT_CRUST_ROOT.into(),
            kata_root: crust_handoff::DEFAULT_KATA_ROOT.into(),
            kata_runtime: DEFAULT_KATA_RUNTIME.into(),
            cli_timeout: DEFAULT_CLI_TIMEOUT,
            cli_env: Vec::new(),
            allowed_target_prefixes: Vec::new(),
            file_device_roots: Vec::new(),
            allowed_fstypes: Policy::default().allowed_fstypes,
            kata_shim_dirs: DEFAULT_KATA_SHIM_DIRS.iter().map(PathBuf::from).collect(),
        }
    }
}

/// `RuntimeStageVolume`, typed. Only block volumes exist here: the proto
/// conversion refuses anything else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageRequest {
    pub target_path: String,
    pub device: String,
    pub fs_type: String,
    pub mount_flags: Vec<String>,
    pub fs_group: Option<u32>,
    pub fs_group_change_policy: Option<FsGroupChangePolicy>,
    /// The volume's I/O limits, applied by the runtime at every plug.
    pub io_limits: IoLimits,
}

impl StageRequest {
    pub fn mount_info(&self) -> MountInfo {
        let mut mi = MountInfo::block(&self.device, &self.fs_type);
        mi.options = self.mount_flags.clone();
        mi.set_fs_group(self.fs_group);
        mi.set_fs_group_change_policy(self.fs_group_change_policy);
        if !self.io_limits.is_unlimited() {
            mi.metadata
                .insert(IO_LIMITS_KEY.into(), self.io_limits.to_wire());
        }
        mi
    }
}

/// `mi` with its device's identity ([`crust_handoff::DEVICE_IDENTITY_KEY`]),
/// which every plug checks by descriptor: a record must prove it names the
/// device it was written for, as device paths are reused. A file device
/// (Kata's) has none; a disk that has none (no WWN, serial or filesystem
/// UUID) is recorded without, and said.
fn with_identity(mut mi: MountInfo) -> MountInfo {
    use std::os::fd::AsFd;
    let dev = std::path::Path::new(&mi.device);
    if !crust_blockdev::is_block_device(dev) {
        return mi;
    }
    let id = rustix::fs::open(
        dev,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| e.to_string())
    .and_then(|fd| crust_blockdev::identity_of(fd.as_fd(), dev));
    match id {
        Ok(id) => {
            mi.metadata
                .insert(crust_handoff::DEVICE_IDENTITY_KEY.into(), id.to_string());
        }
        Err(e) => tracing::warn!(device = %mi.device, "the record carries no device identity: {e}"),
    }
    mi
}

/// Where [`CrustOps::set_io_limits`] got the limits to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitsApplied {
    /// The running guest's device has them now (and the record, for the
    /// next plug).
    Live,
    /// Only the record has them: no runtime consumed it yet; the runtime
    /// applies them when it plugs the device.
    AtNextPlug,
}

/// `RuntimeExpandVolume`, typed; 0 means "not specified" for both bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpandRequest {
    pub target_path: String,
    pub required_bytes: u64,
    pub limit_bytes: u64,
}

/// A record's claimant and its state ([`CrustOps::claimant_state`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimantState {
    pub sandbox: String,
    pub state: SandboxState,
    pub detail: String,
}

impl ClaimantState {
    fn unknown(sandbox: &str, detail: impl Into<String>) -> Self {
        ClaimantState {
            sandbox: sandbox.to_string(),
            state: SandboxState::Unknown,
            detail: detail.into(),
        }
    }
}

/// Who serves stats/expand for a target.
enum Route {
    CrustCli(String),
    Kata(String),
}

/// A sandbox's claim on a hand-off record naming a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceClaim {
    pub sandbox: String,
    /// The record's target (or its directory name when the target is not
    /// recorded).
    pub record: String,
    pub device: String,
}

pub struct CrustOps {
    crust: Option<Store>,
    kata: Option<Store>,
    kata_runtime: String,
    cli: cli::CliCall,
    kata_shim_dirs: Vec<PathBuf>,
    /// `crust capabilities` answers, per CLI path and modification time.
    capabilities: Mutex<HashMap<(String, Option<SystemTime>), Capabilities>>,
}

impl CrustOps {
    pub fn new(cfg: OpsConfig) -> Result<Self, OpsError> {
        let policy = Policy {
            allowed_target_prefixes: cfg.allowed_target_prefixes,
            file_device_roots: cfg.file_device_roots,
            allowed_fstypes: cfg.allowed_fstypes,
            file_device_setting: "--allow-file-devices-under (CRUST_OPS_FILE_DEVICE_ROOTS)".into(),
        };
        let want = |l: LayoutMode| cfg.layout == l || cfg.layout == LayoutMode::Both;
        let crust = want(LayoutMode::Crust)
            .then(|| Store::new(Layout::Crust, cfg.crust_root, policy.clone()))
            .transpose()?;
        let kata = want(LayoutMode::Kata)
            .then(|| Store::new(Layout::Kata, cfg.kata_root, policy))
            .transpose()?;
        let kata_runtime = cfg
            .kata_runtime
            .to_str()
            .ok_or_else(|| OpsError::InvalidArgument("kata runtime path is not UTF-8".into()))?
            .to_string();
        if cfg.cli_timeout.is_zero() {
            return Err(OpsError::InvalidArgument(
                "the CLI timeout must be positive".into(),
            ));
        }
        Ok(CrustOps {
            crust,
            kata,
            kata_runtime,
            cli: cli::CliCall {
                timeout: cfg.cli_timeout,
                env: cfg.cli_env,
            },
            kata_shim_dirs: cfg.kata_shim_dirs,
            capabilities: Mutex::new(HashMap::new()),
        })
    }

    /// Whether the CRUST layout, which a handover needs, is configured.
    pub fn has_crust_layout(&self) -> bool {
        self.crust.is_some()
    }

    /// Checks in every layout, changing nothing, that `mi` could be staged
    /// at `target` (a different record a sandbox holds is refused).
    pub fn check_stage(&self, target: &str, mi: &MountInfo) -> Result<(), OpsError> {
        for s in self.stores() {
            s.check_stage(target, mi)?;
        }
        Ok(())
    }

    /// The sandbox claiming `target`'s record, in any layout (CRUST first).
    pub fn claimant(&self, target: &str) -> Option<String> {
        self.stores()
            .find_map(|s| s.claimant(target).ok().flatten())
    }

    /// The sandbox claiming `target`'s CRUST-layout record (a handover's).
    pub fn crust_claimant(&self, target: &str) -> Option<String> {
        self.crust.as_ref()?.claimant(target).ok().flatten()
    }

    /// The sandbox claiming the complete CRUST record of `target` (a
    /// record directory a crash left without `mountInfo.json` has none).
    pub fn complete_record_claimant(&self, target: &str) -> Option<String> {
        self.crust.as_ref()?.inspect(target).ok()?.claimant
    }

    /// A claimed record, in any layout, whose device is `device` (the same
    /// device numbers): also one whose target the caller lost track of.
    /// Lists every record: for a check before the host touches a device,
    /// not for a hot path.
    pub fn claim_on_device(&self, device: &Path) -> Option<DeviceClaim> {
        let numbers = crust_blockdev::device_major_minor(device).ok()?;
        for store in self.stores() {
            let records = match store.list() {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list hand-off records");
                    continue;
                }
            };
            for r in records {
                let Ok(state) = r.state else { continue };
                if let Some(sandbox) = state.claimant
                    && crust_blockdev::device_major_minor(Path::new(&state.mount_info.device)).ok()
                        == Some(numbers)
                {
                    return Some(DeviceClaim {
                        sandbox,
                        record: r.target.unwrap_or(r.key),
                        device: state.mount_info.device,
                    });
                }
            }
        }
        None
    }

    /// The records of `target`, one per layout that has one (CRUST first).
    pub fn records(&self, target: &str) -> Vec<MountInfo> {
        self.stores().filter_map(|s| s.read(target).ok()).collect()
    }

    /// The CRUST-layout record of `target` (a handover's).
    pub fn crust_record(&self, target: &str) -> Result<MountInfo, OpsError> {
        let store = self.crust.as_ref().ok_or_else(|| {
            OpsError::InvalidArgument("the CRUST hand-off layout is not configured".into())
        })?;
        Ok(store.read(target)?)
    }

    fn stores(&self) -> impl Iterator<Item = &Store> {
        self.crust.iter().chain(self.kata.iter())
    }

    /// Checks the target against every configured layout first, so a
    /// request valid for one and not the other changes nothing.
    fn check_target(&self, target: &str) -> Result<(), OpsError> {
        for s in self.stores() {
            s.check_target(target)?;
        }
        Ok(())
    }

    /// Writes the hand-off record(s). Idempotent.
    ///
    /// The mount flags must pass crust's one allow-list ([`crust_fs`], the
    /// list the guest applies) and are stored one option per entry. A new
    /// or changed record is written only for a device that nobody holds
    /// (not mounted in any namespace, no exclusive or kernel holder:
    /// [`crust_blockdev::ensure_device_free`]); repeating an identical
    /// record does not look at the device (its sandbox may hold it).
    pub fn stage(&self, mut req: StageRequest) -> Result<(), OpsError> {
        self.check_target(&req.target_path)?;
        normalize_flags(&mut req)?;
        let mi = with_identity(req.mount_info());
        let target = &req.target_path;
        // All layouts are checked before any is written.
        self.check_stage(target, &mi)?;
        let unchanged = self.stores().all(|s| {
            s.read(target)
                .is_ok_and(|old| old.is_staged_as(&s.normalized(&mi)))
        });
        if !unchanged {
            check_device_free(&mi.device)?;
        }
        for s in self.stores() {
            s.stage(target, &mi)?;
        }
        tracing::info!(target = %req.target_path, device = %req.device, fstype = %req.fs_type, "staged");
        Ok(())
    }

    /// Writes the CRUST-layout record for a handover, already claimed by
    /// `sandbox` with its `runtime_cli` (see
    /// [`crust_handoff::Store::stage_claimed`]): a runtime that asked the
    /// plugin for a host-published volume gets it, and no other runtime
    /// can claim the record first. Flags pass the one allow-list; a new
    /// record needs a device nobody holds. Idempotent for the same sandbox.
    pub fn stage_claimed(
        &self,
        mut req: StageRequest,
        sandbox: &str,
        runtime_cli: &str,
    ) -> Result<(), OpsError> {
        let store = self.crust.as_ref().ok_or_else(|| {
            OpsError::InvalidArgument(
                "a handover needs the CRUST hand-off layout (--handoff-layout crust or both)"
                    .into(),
            )
        })?;
        store.check_target(&req.target_path)?;
        normalize_flags(&mut req)?;
        let mi = with_identity(req.mount_info());
        let target = &req.target_path;
        let mine = store.inspect(target).is_ok_and(|st| {
            st.mount_info.is_staged_as(&store.normalized(&mi))
                && st.claimant.as_deref() == Some(sandbox)
        });
        if !mine {
            check_device_free(&mi.device)?;
        }
        store.stage_claimed(target, &mi, sandbox, Some(runtime_cli))?;
        tracing::info!(target = %req.target_path, device = %req.device, "staged for a handover");
        Ok(())
    }

    /// Removes what an interrupted [`CrustOps::stage_claimed`] left (a
    /// record directory without `mountInfo.json`, which nobody could have
    /// used). Ok(false): a complete record is there (left alone).
    pub fn discard_partial(&self, target: &str) -> Result<bool, OpsError> {
        let Some(store) = &self.crust else {
            return Ok(true);
        };
        Ok(store.discard_partial(target)?)
    }

    /// Removes the hand-off record(s). Idempotent.
    ///
    /// A record a sandbox claims is removed only on positive proof that
    /// the sandbox can no longer use the device (otherwise
    /// FAILED_PRECONDITION and nothing changes: the CO's next publish
    /// would hand the same device to a second VM):
    ///
    /// * CRUST layout: its runtime CLI says `stopped` (`crust
    ///   sandbox-state`, see [`crust_handoff::liveness`]) AND the device is
    ///   free ([`device_released`]). `running`, `unknown`, a failing CLI or
    ///   one without the verb keep the claim. Our runtime drops its claim
    ///   when a sandbox is deleted, so the usual order (stop the sandbox,
    ///   then unpublish) needs no question at all.
    /// * Kata layout (Kata leaves its `<sandbox-id>` file behind after a
    ///   stop and its CLI exits 0 on errors): Kata's shim socket for that
    ///   sandbox is absent or refuses connections AND the device is free.
    pub fn unstage(&self, target: &str) -> Result<(), OpsError> {
        self.check_target(target)?;
        let crust_stale = match &self.crust {
            Some(s) => self.stale_claimant(s, target)?,
            None => None,
        };
        let kata_stale = match &self.kata {
            Some(s) => self.stale_kata_claimant(s, target)?,
            None => None,
        };
        for s in self.stores() {
            let stale = match s.layout() {
                Layout::Crust => &crust_stale,
                Layout::Kata => &kata_stale,
            };
            // Any claimant other than the one shown gone (one that
            // appeared meanwhile) keeps the record.
            s.remove_unless_claimed(target, |by| stale.as_deref() != Some(by))?;
        }
        tracing::info!(target = %target, "unstaged");
        Ok(())
    }

    /// What `cli` answers to `crust capabilities`, asked once per CLI
    /// (path and modification time). A CLI that fails the query supports
    /// only `stats` and `resize`.
    pub fn capabilities(&self, cli: &str) -> Capabilities {
        let mtime = std::fs::metadata(cli).and_then(|m| m.modified()).ok();
        let key = (cli.to_string(), mtime);
        if let Some(c) = self.capabilities.lock().expect("cache").get(&key) {
            return c.clone();
        }
        let answer = cli::run(cli, &["crust", "capabilities"], &self.cli);
        let caps = match answer {
            Ok(out) => Capabilities::parse(&out).unwrap_or_else(|_| Capabilities::minimal()),
            // Not cached: a slow CLI may answer next time.
            Err(OpsError::CliTimeout { .. }) => return Capabilities::minimal(),
            Err(_) => Capabilities::minimal(),
        };
        self.capabilities
            .lock()
            .expect("cache")
            .insert(key, caps.clone());
        caps
    }

    /// Who claims `target`'s record and whether that sandbox runs, as the
    /// host establishes it (CRUST layout: `crust sandbox-state` of the
    /// recorded runtime CLI; Kata: whether a Kata shim answers for it).
    /// None when nobody claims a record. For health reporting: a claim is
    /// released only by [`CrustOps::unstage`], which also wants the device
    /// free.
    pub fn claimant_state(&self, target: &str) -> Option<ClaimantState> {
        if let Some(s) = &self.crust
            && let Ok(Some(by)) = s.claimant(target)
        {
            let cli = match s.runtime_cli(target) {
                Ok(Some(cli)) => cli,
                _ => return Some(ClaimantState::unknown(&by, "no runtime-cli is recorded")),
            };
            if cli::check_executable(&cli).is_err()
                || !self.capabilities(&cli).supports(VERB_SANDBOX_STATE)
            {
                return Some(ClaimantState::unknown(
                    &by,
                    format!("its runtime CLI {cli} cannot report sandbox state"),
                ));
            }
            let answer = cli::run(&cli, &["crust", VERB_SANDBOX_STATE, &by], &self.cli);
            return Some(match answer.map(|out| SandboxLiveness::parse(&out, &by)) {
                Ok(Ok(l)) => ClaimantState {
                    sandbox: by,
                    state: l.state,
                    detail: l.detail,
                },
                Ok(Err(e)) => ClaimantState::unknown(&by, e),
                Err(e) => ClaimantState::unknown(&by, e.to_string()),
            });
        }
        if let Some(s) = &self.kata
            && let Ok(Some(by)) = s.claimant(target)
        {
            let answering = self.kata_shim_dirs.iter().find(|d| {
                std::os::unix::net::UnixStream::connect(d.join(&by).join(KATA_SHIM_SOCKET)).is_ok()
            });
            return Some(match answering {
                Some(d) => ClaimantState {
                    sandbox: by,
                    state: SandboxState::Running,
                    detail: format!("Kata's shim answers under {}", d.display()),
                },
                None => ClaimantState {
                    sandbox: by,
                    state: SandboxState::Stopped,
                    detail: "no Kata shim answers for it".into(),
                },
            });
        }
        None
    }

    /// The CRUST record's claimant, once shown gone (see
    /// [`CrustOps::unstage`]). None: nobody claims the record.
    fn stale_claimant(&self, store: &Store, target: &str) -> Result<Option<String>, OpsError> {
        let by = match store.claimant(target) {
            Ok(Some(by)) => by,
            Ok(None) | Err(HandoffError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let device = store.read(target)?.device;
        // A broken runtime-cli is reported as "cannot ask" below.
        let cli = match store.runtime_cli(target) {
            Err(HandoffError::NotFound(_)) => Ok(None),
            r => r,
        };
        let still = |detail: String| OpsError::StillClaimed {
            target: target.to_string(),
            by: by.clone(),
            detail,
        };
        let cli = match cli {
            Ok(Some(cli)) => cli,
            Ok(None) => {
                return Err(still(
                    "no runtime-cli is recorded to ask whether it still runs".into(),
                ));
            }
            Err(e) => {
                return Err(still(format!(
                    "cannot ask its runtime whether it still runs: {e}"
                )));
            }
        };
        if let Err(e) = cli::check_executable(&cli) {
            return Err(still(format!(
                "cannot ask its runtime whether it still runs: {e}"
            )));
        }
        if !self.capabilities(&cli).supports(VERB_SANDBOX_STATE) {
            return Err(still(format!(
                "its runtime CLI {cli} cannot report sandbox state (no `crust {VERB_SANDBOX_STATE}`)"
            )));
        }
        let out = match cli::run(&cli, &["crust", VERB_SANDBOX_STATE, &by], &self.cli) {
            Ok(out) => out,
            Err(OpsError::CliFailed { status, .. })
                if status == format!("exit code {UNSUPPORTED_EXIT}") =>
            {
                return Err(still(format!(
                    "its runtime CLI {cli} does not support `crust {VERB_SANDBOX_STATE}`"
                )));
            }
            Err(e) => return Err(still(format!("cannot tell whether it still runs: {e}"))),
        };
        let liveness = SandboxLiveness::parse(&out, &by).map_err(|reason| {
            still(format!(
                "`{cli} crust {VERB_SANDBOX_STATE}` printed unusable output: {reason}"
            ))
        })?;
        match liveness.state {
            SandboxState::Running => Err(still(format!(
                "its runtime says it serves the volume: it runs ({})",
                liveness.detail
            ))),
            SandboxState::Unknown => Err(still(format!(
                "its runtime ({cli}) does not know it ({}); a claim is released only on proof \
                 that its sandbox stopped",
                liveness.detail
            ))),
            SandboxState::Stopped => {
                device_released(&device)
                    .map_err(|why| still(format!("its runtime says it stopped, but {why}")))?;
                tracing::info!(target = %target, sandbox = %by, detail = %liveness.detail,
                    "the claiming sandbox stopped and its device is free: the claim is stale");
                Ok(Some(by))
            }
        }
    }

    /// The Kata record's claimant, once shown gone: none of Kata's shim
    /// sockets for it answers, and the device is free.
    fn stale_kata_claimant(&self, store: &Store, target: &str) -> Result<Option<String>, OpsError> {
        let (s, t) = (store, target);
        let by = match s.claimant(t) {
            Ok(Some(by)) => by,
            Ok(None) | Err(HandoffError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let device = s.read(t)?.device;
        let still = |detail: String| OpsError::StillClaimed {
            target: target.to_string(),
            by: by.clone(),
            detail,
        };
        for d in &self.kata_shim_dirs {
            let sock = d.join(&by).join(KATA_SHIM_SOCKET);
            match std::os::unix::net::UnixStream::connect(&sock) {
                Ok(_) => {
                    return Err(still(format!("Kata's shim answers at {}", sock.display())));
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                    ) => {}
                Err(e) => {
                    return Err(still(format!(
                        "cannot tell whether Kata's shim at {} runs: {e}",
                        sock.display()
                    )));
                }
            }
        }
        device_released(&device)
            .map_err(|why| still(format!("no Kata shim answers for it, but {why}")))?;
        Ok(Some(by))
    }

    /// Stats from the runtime that consumes the volume.
    pub fn stats(&self, target: &str) -> Result<VolumeStats, OpsError> {
        match self.route(target)? {
            Route::CrustCli(cli) => {
                let out = cli::run(&cli, &["crust", "stats", target], &self.cli)?;
                parse::parse_stats(&out).map_err(|reason| bad_output(&cli, "crust stats", reason))
            }
            Route::Kata(kata) => {
                let args = ["direct-volume", "stats", "--volume-path", target];
                let out = cli::run(&kata, &args, &self.cli)?;
                parse::parse_stats(&out)
                    .map_err(|reason| bad_output(&kata, "direct-volume stats", reason))
            }
        }
    }

    /// Freezes the volume's filesystem where its runtime mounted it (the
    /// guest), for a point-in-time copy of its device; the runtime thaws it
    /// by itself after `max_frozen`. FAILED_PRECONDITION when that runtime
    /// does not offer `crust freeze` (Kata's, the KEP's minimal CLI).
    pub fn freeze(&self, target: &str, max_frozen: Duration) -> Result<(), OpsError> {
        let ms = u64::try_from(max_frozen.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        crust_agent_proto::freeze_limit(ms)
            .map_err(|e| OpsError::InvalidArgument(e.to_string()))?;
        let cli = self.cli_offering(target, VERB_FREEZE)?;
        let ms = ms.to_string();
        cli::run(&cli, &["crust", "freeze", target, ms.as_str()], &self.cli)?;
        tracing::info!(target = %target, "frozen in the guest");
        Ok(())
    }

    /// Thaws what [`CrustOps::freeze`] froze; Ok(true) when the volume
    /// stayed frozen from the freeze until now (a copy made meanwhile is
    /// consistent), Ok(false) when the runtime's time limit thawed it first.
    pub fn thaw(&self, target: &str) -> Result<bool, OpsError> {
        let cli = self.cli_offering(target, VERB_THAW)?;
        let out = cli::run(&cli, &["crust", "thaw", target], &self.cli)?;
        let v: serde_json::Value = serde_json::from_slice(&out)
            .map_err(|e| bad_output(&cli, "crust thaw", e.to_string()))?;
        let was_frozen = v.get("was_frozen").and_then(|b| b.as_bool());
        let expired = v.get("expired").and_then(|b| b.as_bool());
        match (was_frozen, expired) {
            (Some(w), Some(e)) => Ok(w && !e),
            _ => Err(bad_output(
                &cli,
                "crust thaw",
                "expected {\"was_frozen\":bool,\"expired\":bool}".into(),
            )),
        }
    }

    /// Gives the volume at `target` new I/O limits: its hand-off
    /// record(s) first (every later plug applies them), then the running
    /// guest through the consuming runtime's `crust throttle`. A runtime
    /// that cannot throttle live (Kata's, or a CLI without the verb):
    /// FAILED_PRECONDITION, the records keeping the new limits. No record:
    /// NOT_FOUND.
    pub fn set_io_limits(
        &self,
        target: &str,
        limits: &IoLimits,
    ) -> Result<LimitsApplied, OpsError> {
        self.check_target(target)?;
        let mut found = false;
        for s in self.stores() {
            match s.set_io_limits(target, limits) {
                Ok(_) => found = true,
                Err(HandoffError::NotFound(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if !found {
            return Err(HandoffError::NotFound(target.to_string()).into());
        }
        let cli = match self.cli_offering(target, VERB_THROTTLE) {
            Ok(cli) => cli,
            Err(OpsError::NotConsumed(_)) => return Ok(LimitsApplied::AtNextPlug),
            Err(e) => return Err(e),
        };
        let wire = limits.to_wire();
        cli::run(
            &cli,
            &["crust", VERB_THROTTLE, target, wire.as_str()],
            &self.cli,
        )?;
        tracing::info!(target = %target, limits = %wire, "I/O limits applied in the guest");
        Ok(LimitsApplied::Live)
    }

    /// The CRUST runtime CLI consuming `target`, if it offers `verb`.
    fn cli_offering(&self, target: &str, verb: &'static str) -> Result<String, OpsError> {
        match self.route(target)? {
            Route::CrustCli(cli) if self.capabilities(&cli).supports(verb) => Ok(cli),
            Route::CrustCli(cli) => Err(OpsError::Unsupported {
                target: target.to_string(),
                verb,
                runtime: cli,
            }),
            Route::Kata(kata) => Err(OpsError::Unsupported {
                target: target.to_string(),
                verb,
                runtime: kata,
            }),
        }
    }

    /// Grows the volume through the runtime; returns the new capacity.
    /// Kata's `direct-volume resize` prints nothing on success, so in that
    /// layout the size requested (required, else limit) is reported.
    pub fn expand(&self, req: ExpandRequest) -> Result<u64, OpsError> {
        let (min, max) = (req.required_bytes, req.limit_bytes);
        if max != 0 && min > max {
            return Err(OpsError::InvalidArgument(format!(
                "required_bytes {min} exceeds limit_bytes {max}"
            )));
        }
        for (name, v) in [("required_bytes", min), ("limit_bytes", max)] {
            if v > i64::MAX as u64 {
                return Err(OpsError::InvalidArgument(format!(
                    "{name} does not fit in int64"
                )));
            }
        }
        let target = req.target_path.as_str();
        let capacity = match self.route(target)? {
            Route::CrustCli(cli) => {
                let (smin, smax) = (min.to_string(), max.to_string());
                let args = ["crust", "resize", target, smin.as_str(), smax.as_str()];
                let out = cli::run(&cli, &args, &self.cli)?;
                let cap = parse::parse_resize(&out)
                    .map_err(|reason| bad_output(&cli, "crust resize", reason))?;
                if cap < min || (max != 0 && cap > max) {
                    return Err(bad_output(
                        &cli,
                        "crust resize",
                        format!("capacity {cap} is outside the requested range [{min}, {max}]"),
                    ));
                }
                cap
            }
            Route::Kata(kata) => {
                let size = if min != 0 { min } else { max };
                if size == 0 {
                    return Err(OpsError::InvalidArgument(
                        "the Kata layout needs a capacity_range with required_bytes or limit_bytes"
                            .into(),
                    ));
                }
                let s = size.to_string();
                let args = [
                    "direct-volume",
                    "resize",
                    "--volume-path",
                    target,
                    "--size",
                    s.as_str(),
                ];
                cli::run(&kata, &args, &self.cli)?;
                size
            }
        };
        tracing::info!(target = %target, capacity, "expanded");
        Ok(capacity)
    }

    /// CRUST record with a `runtime-cli` first, then a Kata record with a
    /// sandbox file. A record nobody consumed yet: FAILED_PRECONDITION; no
    /// record at all: NOT_FOUND.
    fn route(&self, t: &str) -> Result<Route, OpsError> {
        self.check_target(t)?;
        let mut staged = false;
        if let Some(s) = &self.crust
            && s.exists(t)?
        {
            staged = true;
            if let Some(cli) = s.runtime_cli(t)? {
                cli::check_executable(&cli)?;
                return Ok(Route::CrustCli(cli));
            }
        }
        if let Some(s) = &self.kata
            && s.exists(t)?
        {
            staged = true;
            if s.claimant(t)?.is_some() {
                cli::check_executable(&self.kata_runtime)?;
                return Ok(Route::Kata(self.kata_runtime.clone()));
            }
        }
        if staged {
            Err(OpsError::NotConsumed(t.to_string()))
        } else {
            Err(crust_handoff::HandoffError::NotFound(t.to_string()).into())
        }
    }
}

/// Flags through crust's one allow-list, stored one option per entry.
/// An fstype crust does not know is left to the record's own check.
fn normalize_flags(req: &mut StageRequest) -> Result<(), OpsError> {
    let Some(fs) = crust_fs::FsType::parse(&req.fs_type) else {
        return Ok(());
    };
    let parsed = crust_fs::options::parse(fs, &req.mount_flags, false)
        .map_err(|e| OpsError::InvalidArgument(e.to_string()))?;
    req.mount_flags = parsed.words;
    Ok(())
}

/// Before a record hands `device` to a guest: nobody holds it and no
/// other device exposes its data.
fn check_device_free(device: &str) -> Result<(), OpsError> {
    match crust_blockdev::ensure_device_free(Path::new(device), crust_blockdev::HAND_TO_GUEST) {
        Ok(()) => Ok(()),
        Err(e) if e.is_refusal() => Err(OpsError::DeviceInUse {
            device: device.to_string(),
            detail: e.to_string(),
        }),
        Err(e) => Err(OpsError::Io {
            context: format!("checking device {device}"),
            source: std::io::Error::other(e.to_string()),
        }),
    }
}

/// Positive proof that no VM can still use `device`: its exclusive open
/// succeeds (no crust sandbox, mount or exclusive holder) and no process
/// has it open (a QEMU whose runtime died).
fn device_released(device: &str) -> Result<(), String> {
    let path = Path::new(device);
    crust_blockdev::ensure_released(path, "release its claim").map_err(|e| e.to_string())?;
    if crust_blockdev::is_block_device(path) {
        let openers = crust_blockdev::device_openers(path).map_err(|e| e.to_string())?;
        if let Some(o) = openers.first() {
            return Err(format!("device {device} is still open by {o}"));
        }
    }
    Ok(())
}

fn bad_output(cli: &str, op: &str, reason: String) -> OpsError {
    OpsError::BadOutput {
        cli: cli.to_string(),
        op: op.to_string(),
        reason,
    }
}
