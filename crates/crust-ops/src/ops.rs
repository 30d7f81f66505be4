//! [`CrustOps`]: the Runtime operations, usable in-process (the CSI plugin)
//! or behind the gRPC service (the daemon).

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crust_handoff::{FsGroupChangePolicy, Layout, MountInfo, Policy, Store};

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
    /// Targets must lie beneath one of these; empty: any absolute path.
    pub allowed_target_prefixes: Vec<String>,
    /// Regular files beneath these are accepted as devices (tests, images).
    pub file_device_roots: Vec<PathBuf>,
    pub allowed_fstypes: Vec<String>,
}

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
            allowed_target_prefixes: Vec::new(),
            file_device_roots: Vec::new(),
            allowed_fstypes: Policy::default().allowed_fstypes,
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
}

impl StageRequest {
    pub fn mount_info(&self) -> MountInfo {
        let mut mi = MountInfo::block(&self.device, &self.fs_type);
        mi.options = self.mount_flags.clone();
        mi.set_fs_group(self.fs_group);
        mi.set_fs_group_change_policy(self.fs_group_change_policy);
        mi
    }
}

/// `RuntimeExpandVolume`, typed; 0 means "not specified" for both bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpandRequest {
    pub target_path: String,
    pub required_bytes: u64,
    pub limit_bytes: u64,
}

/// Who serves stats/expand for a target.
enum Route {
    CrustCli(String),
    Kata(String),
}

pub struct CrustOps {
    crust: Option<Store>,
    kata: Option<Store>,
    kata_runtime: String,
    cli_timeout: Duration,
}

impl CrustOps {
    pub fn new(cfg: OpsConfig) -> Result<Self, OpsError> {
        let policy = Policy {
            allowed_target_prefixes: cfg.allowed_target_prefixes,
            file_device_roots: cfg.file_device_roots,
            allowed_fstypes: cfg.allowed_fstypes,
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
            cli_timeout: cfg.cli_timeout,
        })
    }

    pub fn crust_store(&self) -> Option<&Store> {
        self.crust.as_ref()
    }

    pub fn kata_store(&self) -> Option<&Store> {
        self.kata.as_ref()
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
    pub async fn stage(&self, req: StageRequest) -> Result<(), OpsError> {
        self.check_target(&req.target_path)?;
        let mi = req.mount_info();
        let stores: Vec<Store> = self.stores().cloned().collect();
        let target = req.target_path.clone();
        blocking(move || {
            // All layouts are checked before any is written.
            for s in &stores {
                s.check_stage(&target, &mi)?;
            }
            for s in &stores {
                s.stage(&target, &mi)?;
            }
            Ok(())
        })
        .await?;
        tracing::info!(target = %req.target_path, device = %req.device, fstype = %req.fs_type, "staged");
        Ok(())
    }

    /// Removes the hand-off record(s). Idempotent.
    ///
    /// CRUST layout: a record a sandbox claims is removed only once that
    /// sandbox is shown to be dead (see [`CrustOps::stale_claimant`]);
    /// otherwise FAILED_PRECONDITION and nothing changes, because its VM
    /// may still have the device and the CO's next publish would hand the
    /// same device to a second VM. Our runtime drops its claim and the
    /// `runtime-cli` when a sandbox is deleted, so the usual order (stop
    /// the sandbox, then unpublish) needs no question at all.
    ///
    /// Kata layout: removed whatever it holds, as Kata's own `direct-volume
    /// remove` does; Kata leaves its `<sandbox-id>` file after a stop, so
    /// that file cannot tell a live sandbox from a dead one.
    pub async fn unstage(&self, target: &str) -> Result<(), OpsError> {
        self.check_target(target)?;
        let stale = match &self.crust {
            Some(s) => self.stale_claimant(s, target).await?,
            None => None,
        };
        let stores: Vec<Store> = self.stores().cloned().collect();
        let t = target.to_string();
        blocking(move || {
            for s in &stores {
                // Any claimant other than the one found dead (one that
                // appeared meanwhile) keeps the record.
                s.remove_with(&t, |by| stale.as_deref() != Some(by))?;
            }
            Ok(())
        })
        .await?;
        tracing::info!(target = %target, "unstaged");
        Ok(())
    }

    /// The CRUST record's claimant, if its runtime says it no longer runs.
    /// None: nobody claims the record. A claimant that runs, or whose
    /// liveness cannot be established (no `runtime-cli` recorded, the CLI
    /// cannot be run, times out, fails otherwise, prints nonsense):
    /// [`OpsError::StillClaimed`].
    ///
    /// The runtime is asked with `<runtime-cli> crust stats <target>`:
    /// the sandbox is dead when the answer is an abnormal volume condition
    /// saying it "is not running", or a failure saying so on stderr (the
    /// wording crust-runtime uses for a sandbox whose VM exited or that
    /// it does not know). Any normal answer means it still serves the volume.
    async fn stale_claimant(
        &self,
        store: &Store,
        target: &str,
    ) -> Result<Option<String>, OpsError> {
        let s = store.clone();
        let t = target.to_string();
        let (claimant, cli) = blocking(move || {
            let not_found = |e: &crust_handoff::HandoffError| {
                matches!(e, crust_handoff::HandoffError::NotFound(_))
            };
            let claimant = match s.claimant(&t) {
                Ok(c) => c,
                Err(e) if not_found(&e) => None,
                Err(e) => return Err(e.into()),
            };
            if claimant.is_none() {
                return Ok((None, Ok(None)));
            }
            // A broken runtime-cli is reported as "cannot ask" below.
            let cli = match s.runtime_cli(&t) {
                Err(e) if not_found(&e) => Ok(None),
                r => r,
            };
            Ok((claimant, cli))
        })
        .await?;
        let Some(by) = claimant else {
            return Ok(None);
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
        let answer = cli::run(&cli, &["crust", "stats", target], self.cli_timeout).await;
        match answer {
            Ok(out) => match parse::parse_stats(&out) {
                Ok(VolumeStats {
                    condition: Some(c), ..
                }) if c.abnormal && says_not_running(&c.message) => {
                    tracing::info!(target = %target, sandbox = %by, condition = %c.message,
                        "the claiming sandbox is not running: its claim is stale");
                    Ok(Some(by))
                }
                Ok(st) => Err(still(format!(
                    "`{cli} crust stats` says it serves the volume{}",
                    st.condition
                        .map(|c| format!(" ({})", c.message))
                        .unwrap_or_default()
                ))),
                Err(reason) => Err(still(format!(
                    "`{cli} crust stats` printed unusable output: {reason}"
                ))),
            },
            Err(OpsError::CliFailed { stderr, .. }) if says_not_running(&stderr) => {
                tracing::info!(target = %target, sandbox = %by, error = %stderr,
                    "the claiming sandbox is not running: its claim is stale");
                Ok(Some(by))
            }
            Err(e) => Err(still(format!("cannot tell whether it still runs: {e}"))),
        }
    }

    /// Stats from the runtime that consumes the volume.
    pub async fn stats(&self, target: &str) -> Result<VolumeStats, OpsError> {
        match self.route(target).await? {
            Route::CrustCli(cli) => {
                let out = cli::run(&cli, &["crust", "stats", target], self.cli_timeout).await?;
                parse::parse_stats(&out).map_err(|reason| bad_output(&cli, "crust stats", reason))
            }
            Route::Kata(kata) => {
                let args = ["direct-volume", "stats", "--volume-path", target];
                let out = cli::run(&kata, &args, self.cli_timeout).await?;
                parse::parse_stats(&out)
                    .map_err(|reason| bad_output(&kata, "direct-volume stats", reason))
            }
        }
    }

    /// Grows the volume through the runtime; returns the new capacity.
    /// Kata's `direct-volume resize` prints nothing on success, so in that
    /// layout the size requested (required, else limit) is reported.
    pub async fn expand(&self, req: ExpandRequest) -> Result<u64, OpsError> {
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
        let capacity = match self.route(target).await? {
            Route::CrustCli(cli) => {
                let (smin, smax) = (min.to_string(), max.to_string());
                let args = ["crust", "resize", target, smin.as_str(), smax.as_str()];
                let out = cli::run(&cli, &args, self.cli_timeout).await?;
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
                cli::run(&kata, &args, self.cli_timeout).await?;
                size
            }
        };
        tracing::info!(target = %target, capacity, "expanded");
        Ok(capacity)
    }

    /// CRUST record with a `runtime-cli` first, then a Kata record with a
    /// sandbox file. A record nobody consumed yet: FAILED_PRECONDITION; no
    /// record at all: NOT_FOUND.
    async fn route(&self, target: &str) -> Result<Route, OpsError> {
        self.check_target(target)?;
        let crust = self.crust.clone();
        let kata = self.kata.clone();
        let kata_runtime = self.kata_runtime.clone();
        let t = target.to_string();
        blocking(move || {
            let mut staged = false;
            if let Some(s) = &crust
                && s.exists(&t)?
            {
                staged = true;
                if let Some(cli) = s.runtime_cli(&t)? {
                    cli::check_executable(&cli)?;
                    return Ok(Route::CrustCli(cli));
                }
            }
            if let Some(s) = &kata
                && s.exists(&t)?
            {
                staged = true;
                if s.claimant(&t)?.is_some() {
                    cli::check_executable(&kata_runtime)?;
                    return Ok(Route::Kata(kata_runtime));
                }
            }
            if staged {
                Err(OpsError::NotConsumed(t))
            } else {
                Err(crust_handoff::HandoffError::NotFound(t).into())
            }
        })
        .await
    }
}

/// crust-runtime's words for a sandbox whose VM is gone or that it does
/// not know ("sandbox S is not running (QEMU exited)", "... (it is unknown
/// to runtime root R)").
fn says_not_running(message: &str) -> bool {
    message.contains("is not running")
}

fn bad_output(cli: &str, op: &str, reason: String) -> OpsError {
    OpsError::BadOutput {
        cli: cli.to_string(),
        op: op.to_string(),
        reason,
    }
}

/// The store does small synchronous file I/O; keep it off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, OpsError> + Send + 'static,
) -> Result<T, OpsError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| OpsError::Io {
            context: "blocking task".into(),
            source: std::io::Error::other(e.to_string()),
        })?
}
