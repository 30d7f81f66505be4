//! The runtime's side of runtime-driven deferral: a container mount whose
//! source is a mount point without a hand-off record may be a volume that
//! crust-csi published on the host; the runtime asks crust-csi's Handover
//! service (`handover.proto`, root-only unix socket) to hand it over,
//! declaring what its guest can do (the early CRUST interface's
//! capabilities and supported filesystems, with every mount option the one
//! allow-list accepts). Handed over: the hand-off record now exists,
//! claimed by this sandbox, and the volume is hot-plugged and mounted as
//! any deferred volume. Declined (auto mode): the runtime shares the host
//! mount over virtio-fs instead and says so in its log and the sandbox's
//! `events`. When deferral is required (OCI annotation
//! `io.crust.defer-fs-ops: required`) nothing falls back: the plugin
//! answers FAILED_PRECONDITION and the container is not created.
//!
//! At sandbox end, once QEMU exited and the claim is released, the runtime
//! hands the volume back; if it cannot (the plugin is down, the runtime
//! crashed), the plugin takes it back later on its own (no claim, or the
//! claimant `stopped`, and the device free).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_proto::endpoint::Endpoint;
use crust_proto::handover::v1alpha1 as pb;
use pb::handover_client::HandoverClient;
use pb::runtime_capability::Type as Cap;

use crate::bundle::Bundle;
use crate::config::Config;
use crate::discovery::Discovery;
use crate::error::RuntimeError;
use crate::records::{LayoutKind, SandboxState};
// The records' old paths, which crust-shim uses.
pub use crate::records::{DEFER_ANNOTATION, HANDED_OVER, ON_HOST, VolumeEvent};

/// crust-csi's default Handover socket.
pub const DEFAULT_ENDPOINT: &str = "unix:///run/crust/handover.sock";
/// How long an ABORTED handover (another operation on the volume) is
/// retried before the container fails.
const BUSY_RETRY: Duration = Duration::from_secs(20);
/// Bound on one call (the plugin syncs and unmounts: seconds on a slow disk).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// What the runtime's guests do with a mounted filesystem.
pub fn capabilities() -> Vec<pb::RuntimeCapability> {
    [
        Cap::FsGroupChangePolicyAlways,
        Cap::FsGroupChangePolicyRootMismatch,
        Cap::Subpath,
        Cap::VolumeStats,
        Cap::VolumeResize,
    ]
    .into_iter()
    .map(|t| pb::RuntimeCapability { r#type: t as i32 })
    .collect()
}

/// The filesystems the guest mounts, each with every option name the one
/// allow-list (`crust-fs`, which the guest agent applies) accepts.
pub fn file_systems() -> Vec<pb::FileSystemSupport> {
    crust_fs::FsType::ALL
        .into_iter()
        .map(|fs| pb::FileSystemSupport {
            fs_type: fs.as_str().to_string(),
            mount_options: crust_fs::options::option_names(fs)
                .into_iter()
                .map(String::from)
                .collect(),
        })
        .collect()
}

/// A bind source worth asking about: a directory that is a mount point
/// (a host publication is a bind mount; a returned or handed-over target
/// holds the plugin's placeholder mount).
pub fn is_candidate(source: &Path) -> bool {
    std::fs::symlink_metadata(source).is_ok_and(|m| m.is_dir())
        && crust_blockdev::is_mountpoint(source).unwrap_or(false)
}

/// The plugin's answer.
#[derive(Debug, Clone)]
pub enum Answer {
    HandedOver(pb::HandedOver),
    /// No crust-csi volume is published there: a plain host path.
    NotOurs,
    /// Not handed over; the host mount is to be shared (auto mode).
    Declined {
        reason: String,
        message: String,
    },
    /// The service cannot be reached: the host mount is to be shared.
    Unreachable(String),
}

/// A client of crust-csi's Handover service.
#[derive(Debug, Clone)]
pub struct Handover {
    endpoint: Option<PathBuf>,
}

impl Handover {
    pub fn new(cfg: &Config) -> Handover {
        let endpoint = match cfg.handover_endpoint.as_str() {
            "" => None,
            e => Endpoint::parse(e)
                .ok()
                .and_then(|ep| ep.unix_path().map(Path::to_path_buf)),
        };
        Handover { endpoint }
    }

    /// Whether a Handover endpoint is configured at all.
    pub fn configured(&self) -> bool {
        self.endpoint.is_some()
    }

    async fn client(&self) -> Result<HandoverClient<tonic::transport::Channel>, String> {
        let Some(path) = &self.endpoint else {
            return Err("no handover endpoint is configured".into());
        };
        if !path.exists() {
            return Err(format!(
                "{} does not exist (is crust-csi running?)",
                path.display()
            ));
        }
        let ch = tokio::time::timeout(CALL_TIMEOUT, Endpoint::Unix(path.clone()).connect())
            .await
            .map_err(|_| format!("connecting to {} timed out", path.display()))?
            .map_err(|e| e.to_string())?;
        Ok(HandoverClient::new(ch))
    }

    /// Asks for the volume published at `target`. `required`: a decline
    /// comes back as FAILED_PRECONDITION from the plugin, an unreachable
    /// service as FAILED_PRECONDITION here.
    pub async fn ask(
        &self,
        target: &str,
        sandbox: &str,
        runtime_cli: &str,
        required: bool,
    ) -> Result<Answer, RuntimeError> {
        let client = match self.client().await {
            Ok(c) => c,
            Err(why) if required => {
                return Err(RuntimeError::HandoverRequired {
                    target: target.to_string(),
                    why,
                });
            }
            Err(why) => return Ok(Answer::Unreachable(why)),
        };
        let req = pb::HandOverRequest {
            target_path: target.to_string(),
            sandbox_id: sandbox.to_string(),
            runtime_cli: runtime_cli.to_string(),
            capabilities: capabilities(),
            file_systems: file_systems(),
            required,
        };
        let resp = retry_busy(target, &format!("the handover of {target}"), || {
            let (mut c, req) = (client.clone(), req.clone());
            async move { c.hand_over(req).await }
        })
        .await?;
        use pb::hand_over_response::Outcome;
        Ok(match resp.outcome {
            Some(Outcome::HandedOver(h)) => Answer::HandedOver(h),
            Some(Outcome::Declined(d)) => {
                let reason = pb::declined::Reason::try_from(d.reason)
                    .unwrap_or(pb::declined::Reason::Unknown);
                if reason == pb::declined::Reason::NotPublished {
                    Answer::NotOurs
                } else {
                    Answer::Declined {
                        reason: reason.as_str_name().to_string(),
                        message: d.message,
                    }
                }
            }
            None => {
                return Err(RuntimeError::HandoverSilent {
                    target: target.to_string(),
                });
            }
        })
    }

    /// Gives the volume at `target` back (the sandbox's VM has exited and
    /// its claim is released).
    pub async fn hand_back(&self, target: &str, sandbox: &str) -> Result<(), RuntimeError> {
        let client = self
            .client()
            .await
            .map_err(RuntimeError::HandoverUnreachable)?;
        let req = pb::HandBackRequest {
            target_path: target.to_string(),
            sandbox_id: sandbox.to_string(),
        };
        retry_busy(target, &format!("handing {target} back"), || {
            let (mut c, req) = (client.clone(), req.clone());
            async move { c.hand_back(req).await }
        })
        .await
        .map(drop)
    }

    /// Hands back every target in `targets`, logging failures (the plugin
    /// takes a volume back on its own once it sees the claim gone).
    pub async fn hand_back_all(&self, targets: &[String], sandbox: &str) {
        for t in targets {
            match self.hand_back(t, sandbox).await {
                Ok(()) => tracing::info!(target = %t, "volume handed back to crust-csi"),
                Err(e) => {
                    tracing::warn!(target = %t, "handing the volume back: {e} (crust-csi takes it back once it sees the claim released)")
                }
            }
        }
    }
}

/// The publish target to offer for a bundle mount source, if any: the
/// source itself, or for kubelet's subPath bind the target it was bound
/// from; worth offering when it has no hand-off record (a KEP deferred
/// volume is consumed as is) and is a mount point.
pub fn offer_path(discovery: &Discovery, source: &str) -> Option<String> {
    let path = match discovery.kubelet_bind(source) {
        Ok(Some(kb)) => kb.target,
        Ok(None) => source.to_string(),
        Err(e) => {
            tracing::warn!(source, "not offered: {e}");
            return None;
        }
    };
    (discovery.lookup(&path).ok().flatten().is_none() && is_candidate(Path::new(&path)))
        .then_some(path)
}

impl Handover {
    /// Offers the mount source `source` (bound at `destination`) to
    /// crust-csi for `sandbox`; `runtime_cli` serves its stats and resize.
    /// The caller has recorded the offer first (the answer may be a
    /// record this sandbox claims). `None`: not a crust-csi volume, or no
    /// plugin to ask; the source stays an ordinary host path. `required`
    /// (the `io.crust.defer-fs-ops: required` annotation): a decline is the
    /// plugin's FAILED_PRECONDITION, returned as an error.
    pub async fn offer(
        &self,
        source: &str,
        destination: &str,
        sandbox: &str,
        runtime_cli: &str,
        required: bool,
    ) -> Result<Option<VolumeEvent>, RuntimeError> {
        let t0 = Instant::now();
        let answer = self.ask(source, sandbox, runtime_cli, required).await?;
        let answer_ms = Some(t0.elapsed().as_millis() as u64);
        let (outcome, message) = match answer {
            Answer::HandedOver(h) => {
                tracing::info!(target = %source, volume = %h.volume_id, device = %h.device,
                    "crust-csi handed the volume over: it is mounted in the guest, not on the host");
                (
                    HANDED_OVER,
                    format!("volume {} ({})", h.volume_id, h.fs_type),
                )
            }
            Answer::Declined { reason, message } => {
                tracing::warn!(target = %source, reason = %reason,
                    "crust-csi declined the handover ({message}): the host mount is used instead");
                (ON_HOST, format!("{reason}: {message}"))
            }
            Answer::NotOurs => return Ok(None),
            Answer::Unreachable(why) => {
                tracing::info!(target = %source, "no handover ({why}): the host mount is used");
                return Ok(None);
            }
        };
        Ok(Some(VolumeEvent {
            target: source.to_string(),
            destination: destination.to_string(),
            outcome: outcome.into(),
            message,
            answer_ms,
            elapsed_ms: None,
            plug_ms: None,
        }))
    }
}

/// What [`take_published_volumes`] did.
#[derive(Debug, Default)]
pub struct Taken {
    /// When each handed-over source was asked (the hand-off latency log).
    pub asked_at: HashMap<String, Instant>,
    /// The declined offers: each volume stays a host mount shared over
    /// virtio-fs, as its event says (the shim publishes them).
    pub fallbacks: Vec<VolumeEvent>,
}

/// A sandbox's record as a front door keeps it: read, and changed and
/// saved in one step.
pub trait StateLog {
    /// Whether the offer of `source` was answered already (its event is on
    /// record): it is not offered again.
    fn answered(&self, source: &str) -> bool;
    fn update(&mut self, f: impl FnOnce(&mut SandboxState)) -> Result<(), RuntimeError>;
}

/// Runtime-driven deferral, the one routine of both doors: each mount of
/// `bundle` whose source is a crust-csi host publication (a mount point
/// without a hand-off record) is offered to the plugin's Handover service.
/// Handed over, it has a record `sandbox` claims and is planned like any
/// deferred volume; declined, its host mount is shared over virtio-fs.
///
/// Each offer is on disk (`handover_asked`) before it is made: the answer
/// may be a record this sandbox claims. An offer the plugin answered
/// "not mine" (or could not be asked) is taken back off the record. An
/// offer that failed stays on it, and the error is returned: the teardown
/// then gives it back, which is a no-op for a volume never handed, so a
/// volume the plugin may have handed before the failure is never stranded;
/// a later call (kubelet's retry) offers it again, as it has no answer.
/// What was taken before an error is in `taken` all the same (declined
/// offers' events are published either way).
pub async fn take_published_volumes(
    handover: &Handover,
    discovery: &Discovery,
    bundle: &Bundle,
    sandbox: &str,
    runtime_cli: &str,
    log: &mut impl StateLog,
    taken: &mut Taken,
) -> Result<(), RuntimeError> {
    if !handover.configured() {
        return Ok(());
    }
    for m in bundle.mounts.iter().filter(|m| m.source_is_path()) {
        let Some(source) = offer_path(discovery, m.source.as_deref().unwrap_or_default()) else {
            continue;
        };
        if log.answered(&source) {
            continue;
        }
        log.update(|s| {
            if !s.handover_asked.contains(&source) {
                s.handover_asked.push(source.clone());
            }
        })?;
        let t0 = Instant::now();
        let answer = handover
            .offer(
                &source,
                &m.destination,
                sandbox,
                runtime_cli,
                bundle.defer_required,
            )
            .await?;
        match answer {
            Some(ev) => {
                if ev.outcome == HANDED_OVER {
                    taken.asked_at.insert(source.clone(), t0);
                } else if ev.outcome == ON_HOST {
                    taken.fallbacks.push(ev.clone());
                }
                log.update(|s| s.events.push(ev))?;
                crash_point("answered");
            }
            None => log.update(|s| s.handover_asked.retain(|a| *a != source))?,
        }
    }
    Ok(())
}

/// Releases `sandbox`'s claims on handed-over records and hands the
/// volumes back to crust-csi (its VM has exited, or never ran). A failure
/// is logged: crust-csi takes a volume back by itself once the claim is
/// gone or its sandbox is shown stopped.
pub async fn give_back(
    handover: &Handover,
    discovery: &Discovery,
    sandbox: &str,
    targets: &[String],
) {
    if targets.is_empty() {
        return;
    }
    let store = discovery.store(LayoutKind::Crust);
    for t in targets {
        if let Err(e) = store.release(t, sandbox)
            && !matches!(e, crust_handoff::HandoffError::NotFound(_))
        {
            tracing::warn!(target = %t, "releasing the claim: {e}");
        }
    }
    handover.hand_back_all(targets, sandbox).await;
}

/// One Handover call, asked again while the plugin answers ABORTED (the
/// volume's operation guard is held) for up to [`BUSY_RETRY`]; each try
/// bounded by [`CALL_TIMEOUT`]. `what` names the call in the timeout error.
async fn retry_busy<T, F, Fut>(target: &str, what: &str, mut call: F) -> Result<T, RuntimeError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let deadline = Instant::now() + BUSY_RETRY;
    loop {
        match tokio::time::timeout(CALL_TIMEOUT, call()).await {
            Ok(Ok(r)) => return Ok(r.into_inner()),
            Ok(Err(s)) if s.code() == tonic::Code::Aborted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok(Err(s)) => {
                return Err(RuntimeError::HandoverRefused {
                    target: target.to_string(),
                    code: s.code(),
                    message: s.message().to_string(),
                });
            }
            Err(_) => {
                return Err(RuntimeError::HandoverTimeout {
                    what: what.to_string(),
                    after: CALL_TIMEOUT,
                });
            }
        }
    }
}

/// A handed-over volume is mounted in the guest: its time from the
/// handover request (`asked`) and of the plug alone (`plug_t0`) are logged,
/// and the returned step writes them into its event in the record.
pub fn mounted(target: &str, asked: Instant, plug_t0: Instant) -> impl FnOnce(&mut SandboxState) {
    let (ms, plug_ms) = (
        asked.elapsed().as_millis() as u64,
        plug_t0.elapsed().as_millis() as u64,
    );
    tracing::info!(
        target,
        elapsed_ms = ms,
        plug_ms,
        "handed-over volume mounted in the guest (handover request to mounted)"
    );
    let target = target.to_string();
    move |s: &mut SandboxState| {
        if let Some(ev) = s.events.iter_mut().find(|e| e.target == target) {
            ev.elapsed_ms = Some(ms);
            ev.plug_ms = Some(plug_ms);
        }
    }
}

/// Test-only: the handover step at which a runtime shim kills itself
/// (`answered`, `attached`, `mounted`), for the crash tests.
pub const CRASH_ENV: &str = "CRUST_RUNTIME_TEST_HANDOVER_CRASH";

/// SIGKILLs this process if the crash tests asked for it at `step`.
pub fn crash_point(step: &str) {
    if std::env::var(CRASH_ENV).is_ok_and(|s| s == step) {
        tracing::error!(step, "test fault: the runtime dies here");
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_capabilities_cover_what_the_plugin_needs() {
        let caps: Vec<i32> = capabilities().iter().map(|c| c.r#type).collect();
        for c in [
            Cap::VolumeStats,
            Cap::VolumeResize,
            Cap::FsGroupChangePolicyAlways,
        ] {
            assert!(caps.contains(&(c as i32)), "{c:?}");
        }
        let fs = file_systems();
        let ext4 = fs.iter().find(|f| f.fs_type == "ext4").unwrap();
        assert!(ext4.mount_options.iter().any(|o| o == "commit"));
        assert!(fs.iter().any(|f| f.fs_type == "xfs"));
    }
}
