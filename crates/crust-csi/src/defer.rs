//! KEP-2857 deferred filesystem operations: the Node service hands a
//! staged volume's block device to the pod's runtime instead of mounting
//! it, through crust_ops running in process.
//!
//! * NodePublishVolume writes the hand-off record (device, fstype, mount
//!   flags, fsGroup and its change policy; `ro` when read-only) in the
//!   configured layout(s) and leaves the target an empty directory. One
//!   deferred publication per volume (one sandbox at a time), never
//!   together with host publications: a filesystem mounted by the host and
//!   by a guest at once is corrupted. A staging mount with no host
//!   publications is synced and unmounted first, and the stage remembered
//!   as unmounted for deferral; a later host publication mounts it again.
//! * NodeGetVolumeStats and NodeExpandVolume ask the runtime that consumed
//!   the record (its CLI). A record no runtime consumed yet gives
//!   FAILED_PRECONDITION ("not consumed by a runtime yet"), passed through
//!   from crust_ops like its other codes.
//! * NodeUnpublishVolume removes the record and the empty target, whether
//!   or not the request says `defer_fs_ops`: the plugin's records know.

use std::path::Path;

use crust_ops::{ExpandRequest, StageRequest};
use crust_proto::csi::v1 as csi;

use crate::caps::Capability;
use crate::driver::DeferParts;
use crate::error::{
    NodeError, PathProblem, PublishError, StageError, alias_err, fs_err, mount_err,
};
use crate::health::Condition;
use crate::node::{mounted_here, remove_created_target, sync_and_unmount};
use crate::records::DEFER_CONTEXT_KEY;
use crate::records::{HostMount, Publication, Staging, VolumeRecord};

type Result<T> = std::result::Result<T, NodeError>;

fn utf8<'a>(what: &str, p: &'a Path) -> Result<&'a str> {
    p.to_str()
        .ok_or_else(|| NodeError::Internal(format!("{what} {} is not UTF-8", p.display())))
}

/// Checks a deferred publish target without creating it: its parent
/// exists, and it is missing or a real directory with nothing mounted on
/// it (the runtime mounts in its guest; the host target stays empty).
fn check_deferred_target(target: &Path) -> Result<()> {
    crate::node::check_parent(target)?;
    let bad = |problem| NodeError::PathState {
        field: "target_path",
        path: target.to_path_buf(),
        problem,
    };
    match std::fs::symlink_metadata(target) {
        Ok(m) if m.file_type().is_symlink() => Err(bad(PathProblem::Symlink)),
        Ok(m) if !m.is_dir() => Err(bad(PathProblem::NotADirectoryForFs)),
        Ok(_) if crate::placeholder::is_mounted(target) => Ok(()),
        Ok(_) if crust_blockdev::is_mountpoint(target).map_err(mount_err)? => {
            Err(bad(PathProblem::FilesystemMounted))
        }
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NodeError::Internal(format!(
            "target_path {}: {e}",
            target.display()
        ))),
    }
}

/// Host mount points of the filesystem on `device`.
fn host_mounts_of(device: &Path) -> Result<Vec<std::path::PathBuf>> {
    let Ok(numbers) = crust_blockdev::device_major_minor(device) else {
        return Ok(Vec::new());
    };
    Ok(crust_blockdev::mount_info()
        .map_err(mount_err)?
        .into_iter()
        .filter(|m| (m.major, m.minor) == numbers)
        .map(|m| m.mount_point)
        .collect())
}

impl DeferParts<'_> {
    /// NodePublishVolume with deferral; the caller checked the request,
    /// the staging and the attached device, and holds the volume's guard.
    pub(crate) fn publish_deferred(
        &self,
        req: &csi::NodePublishVolumeRequest,
        mut rec: VolumeRecord,
        mut s: Staging,
        target: std::path::PathBuf,
        cap: Capability,
    ) -> Result<()> {
        let id = rec.id.clone();
        let target_str = utf8("target_path", &target)?.to_string();
        let readonly = req.readonly || cap.mode.read_only() || s.readonly;
        let fs = s.fs_type.unwrap_or(rec.fs_type);
        let gid = cap.fs_group();
        let policy = cap.supplemental.and_then(|g| g.change_policy);
        let wanted = Publication {
            deferred: true,
            supplemental_group: gid,
            supplemental_group_change_policy: policy.map(|p| p.as_str().to_string()),
            ..Publication::host(false, readonly, cap.mode, cap.flags_digest())
        };
        let repeat = repeat_of(&rec, &target, &wanted)?;
        let mut mount_flags = crate::node::mount_flags_of(&rec, fs, &cap.mount_flags);
        if readonly && !mount_flags.iter().any(|f| f == "ro") {
            mount_flags.push("ro".into());
        }
        // The flags are persisted in the hand-off record and applied by a
        // guest's kernel: the same allow-list as a host mount, before
        // anything is written (the record's own check only looks for
        // credential-like words). The error names a flag by position only.
        crust_blockdev::parse_mount_options(fs, &mount_flags, readonly).map_err(mount_err)?;
        let stage = StageRequest {
            target_path: target_str.clone(),
            device: utf8("device", &s.device)?.to_string(),
            fs_type: fs.as_str().to_string(),
            mount_flags,
            fs_group: gid,
            fs_group_change_policy: policy,
            io_limits: rec.io_limits,
        };
        // Everything that can refuse the request is checked before the
        // staging mount or any record changes: flags outside the
        // allow-list (above) or that look like credentials, a target
        // outside the allowed prefixes, a different record a sandbox still
        // holds.
        let mi = stage.mount_info();
        self.ops.check_stage(&target_str, &mi)?;
        check_deferred_target(&target)?;
        let staging_mounted = mounted_here(&s.device, &s.path)?;
        if !repeat {
            let elsewhere: Vec<_> = host_mounts_of(&s.device)?
                .into_iter()
                .filter(|m| *m != s.path)
                .collect();
            if !elsewhere.is_empty() {
                return Err(PublishError::MountedElsewhere {
                    volume: id,
                    at: elsewhere,
                }
                .into());
            }
        }
        let mut unmounted_now = false;
        if staging_mounted {
            sync_and_unmount(&s.path)?;
            unmounted_now = true;
            tracing::info!(volume = %id, path = %s.path.display(),
                "staging mount removed: the filesystem goes to a sandbox's guest");
        }
        s.host_mount = HostMount::UnmountedForDeferral;
        let keep_staging = |rec: &mut VolumeRecord, s: &Staging| {
            // Keep the records true to the node after a partial failure.
            if unmounted_now {
                rec.staging = Some(s.clone());
                if let Err(e) = self.state.put(rec.clone()) {
                    tracing::error!(volume = %rec.id, error = %e, "cannot record the unmounted staging path");
                }
            }
        };
        if let Err(e) = self.ops.stage(stage) {
            keep_staging(&mut rec, &s);
            return Err(e.into());
        }
        // The target is never an empty writable directory for a runtime
        // that is not a VM runtime: a placeholder with no room for data says where
        // the volume went (placeholder.rs).
        let placed = self
            .node()
            .prepare_target(&mut rec, &target, false, None)
            .and_then(|_| {
                crate::placeholder::mount(
                    &target,
                    &id,
                    "It is mounted only inside a VM runtime's guest (deferred filesystem \
                 operations: the StorageClass says deferFsOps=true, or the CO asked with \
                 defer_fs_ops).",
                )
                .map_err(|e| NodeError::Internal(e.to_string()))
            });
        if let Err(e) = placed {
            if !repeat && let Err(ue) = self.ops.unstage(&target_str) {
                tracing::warn!(volume = %id, error = %ue, "could not remove the hand-off record after a failed publish");
            }
            let forgot = !repeat && remove_created_target(&mut rec, &target);
            keep_staging(&mut rec, &s);
            if forgot
                && !unmounted_now
                && let Err(pe) = self.state.put(rec)
            {
                tracing::error!(volume = %id, error = %pe, "cannot forget the removed publish target");
            }
            return Err(e);
        }
        rec.staging = Some(s.clone());
        rec.published.insert(target.clone(), wanted);
        self.state.put(rec)?;
        self.health.forget(&id);
        self.metrics.deferred_publish_succeeded();
        tracing::info!(volume = %id, target = %target_str, device = %s.device.display(),
            readonly, fs_group = ?gid, "volume published with deferred filesystem operations");
        Ok(())
    }

    /// Why a sandbox's guest may have the volume's filesystem mounted, so
    /// that the host must not probe, check, grow or mount it: the records
    /// say so (a deferred publication; a stage deferred by its context or
    /// unmounted for deferral), or a hand-off record naming the volume's
    /// device is claimed by a sandbox.
    pub(crate) fn guest_may_have_fs(
        &self,
        rec: &VolumeRecord,
        attached: Option<&Path>,
    ) -> Option<String> {
        if let Some((t, _)) = rec.deferred_publication() {
            return Some(format!(
                "it is published with deferred filesystem operations at {} (a sandbox's guest \
                 may have its filesystem mounted)",
                t.display()
            ));
        }
        if let Some(s) = &rec.staging {
            if s.deferred {
                return Some(format!(
                    "it is staged with {DEFER_CONTEXT_KEY}=true: its filesystem is mounted only \
                     in sandboxes' guests"
                ));
            }
            if s.host_mount == HostMount::UnmountedForDeferral {
                return Some(
                    "its staging mount was removed for a sandbox's guest (a host publication \
                     mounts it again once no sandbox has it)"
                        .to_string(),
                );
            }
        }
        let device = attached.or(rec.staging.as_ref().map(|s| s.device.as_path()));
        self.sandbox_claim(rec, device)
    }

    /// A sandbox's claim on a hand-off record of this volume: the record
    /// of one of its deferred targets, or any record naming its device
    /// (also one the volume records lost, e.g. after a crash between
    /// writing the record and recording the publication). Read-only.
    pub(crate) fn sandbox_claim(
        &self,
        rec: &VolumeRecord,
        device: Option<&Path>,
    ) -> Option<String> {
        for (t, _) in rec.published.iter().filter(|(_, p)| p.deferred) {
            let Some(ts) = t.to_str() else { continue };
            if let Some(sandbox) = self.ops.claimant(ts) {
                return Some(format!(
                    "sandbox {sandbox} holds the hand-off record of {}",
                    t.display()
                ));
            }
        }
        let c = self.ops.claim_on_device(device?)?;
        Some(format!(
            "sandbox {} holds a hand-off record ({}) for its device {}",
            c.sandbox, c.record, c.device
        ))
    }

    /// A repeated NodeStageVolume while a guest may have the filesystem:
    /// the device is attached (again, after a node reboot) and nothing
    /// else is done.
    pub(crate) fn restage_for_guest(&self, mut rec: VolumeRecord, why: &str) -> Result<()> {
        let id = rec.id.clone();
        let mut s = rec
            .staging
            .clone()
            .ok_or_else(|| NodeError::Internal(format!("volume {id} has no staging")))?;
        // Idempotent: returns the attached device without touching it.
        let device = self.backend.attach(&id)?;
        if device != s.device {
            tracing::warn!(volume = %id, recorded = %s.device.display(), now = %device.display(),
                "staged device changed (node rebooted?)");
            s.device = device;
            rec.staging = Some(s.clone());
            self.state.put(rec)?;
        }
        tracing::info!(volume = %id, device = %s.device.display(), reason = why,
            "repeated stage: device attached, filesystem left to the sandbox");
        Ok(())
    }

    /// Mounts the staging path again for a host publication of a volume
    /// whose mount was left to (or taken away for) a sandbox's guest.
    /// Returns the updated staging, already recorded.
    pub(crate) fn remount_staging(
        &self,
        rec: &mut VolumeRecord,
        cap: &Capability,
    ) -> Result<Staging> {
        let id = rec.id.clone();
        let mut s = rec
            .staging
            .clone()
            .ok_or_else(|| NodeError::Internal(format!("volume {id} has no staging")))?;
        if rec.handover.is_some() {
            // A handover whose sandbox is gone comes back first (a live
            // one keeps the volume: refused below).
            match self.handover().take_back(rec, None) {
                Ok(()) | Err(crate::error::HandoverError::HeldBySandbox { .. }) => {}
                Err(e) => tracing::warn!(volume = %id, error = %e, "cannot check the handover"),
            }
        }
        if let Some((t, _)) = rec.deferred_publication() {
            return Err(PublishError::InGuest {
                volume: id,
                target: t.clone(),
                why: "a sandbox's guest may have its filesystem mounted, and mounting it on the \
                      host as well would corrupt it (two kernels); unpublish it first",
            }
            .into());
        }
        // A remount that crashed before it was recorded is adopted.
        if !mounted_here(&s.device, &s.path)? {
            if let Some(why) = self.sandbox_claim(rec, Some(&s.device)) {
                return Err(StageError::GuestMayHaveFs { volume: id, why }.into());
            }
            if crust_blockdev::is_device_held_exclusively(&s.device).unwrap_or(false) {
                return Err(PublishError::DeviceHeld {
                    volume: id,
                    device: s.device.clone(),
                }
                .into());
            }
            // QEMU opens a guest's disk without O_EXCL: look for openers.
            crust_blockdev::ensure_no_other_openers(&s.device, crust_blockdev::fs::MOUNT)
                .map_err(|e| fs_err("checking for other openers", e))?;
            crust_blockdev::ensure_no_aliases(&s.device, crust_blockdev::fs::MOUNT)
                .map_err(alias_err)?;
            if cap.flags_digest() != s.flags_digest {
                return Err(PublishError::StageFlagsDiffer {
                    volume: id,
                    staging: s.path.clone(),
                }
                .into());
            }
            let fs = s.fs_type.unwrap_or(rec.fs_type);
            let flags =
                self.handover()
                    .check_after_guest(rec, &s.device, fs, cap.mount_flags.clone())?;
            crust_blockdev::mount_fs(&s.device, &s.path, fs, &flags, s.readonly)
                .map_err(mount_err)?;
            if rec.returned.take().is_some() {
                tracing::info!(volume = %id, "filesystem back from a guest passed its check and is mounted on the host");
            }
        }
        s.host_mount = HostMount::Mounted;
        rec.staging = Some(s.clone());
        self.state.put(rec.clone())?;
        self.health.forget(&id);
        tracing::info!(volume = %id, path = %s.path.display(), "staging path mounted again for a host publication");
        Ok(s)
    }

    /// NodeUnpublishVolume of a deferred publication: the hand-off
    /// record(s) and the empty target go; the staging stays as it is.
    pub(crate) fn unpublish_deferred(&self, mut rec: VolumeRecord, target: &Path) -> Result<()> {
        let id = rec.id.clone();
        let target_str = utf8("target_path", target)?;
        let claimant = self.ops.claimant(target_str);
        self.ops.unstage(target_str)?;
        // A guest may have had raw access: the host checks before mounting.
        rec.returned = Some(crate::records::Returned::now(
            claimant.as_deref().unwrap_or_default(),
        ));
        crate::placeholder::remove(target).map_err(|e| NodeError::Internal(e.to_string()))?;
        if crust_blockdev::is_mountpoint(target).unwrap_or(false) {
            tracing::warn!(volume = %id, target = %target_str,
                "something is mounted on a deferred publish target; left in place");
        } else {
            remove_created_target(&mut rec, target);
        }
        rec.published.remove(target);
        self.state.put(rec)?;
        self.health.forget(&id);
        tracing::info!(volume = %id, target = %target_str, "deferred publication removed");
        Ok(())
    }

    /// A deferred publish that crashed after writing the hand-off record
    /// but before recording the publication: the record (if it names this
    /// volume's device) and the placeholder go (the target itself only if
    /// the plugin recorded creating it: the caller's part).
    pub(crate) fn unpublish_unrecorded_deferred(
        &self,
        rec: &VolumeRecord,
        target: &Path,
    ) -> Result<()> {
        let Some(s) = &rec.staging else {
            return Ok(());
        };
        let Some(t) = target.to_str() else {
            return Ok(());
        };
        let ours = self
            .ops
            .records(t)
            .iter()
            .any(|mi| Path::new(&mi.device) == s.device);
        if !ours {
            return Ok(());
        }
        self.ops.unstage(t)?;
        let _ = crate::placeholder::remove(target);
        tracing::info!(volume = %rec.id, target = %t, "removed the hand-off record of an unrecorded deferred publish");
        Ok(())
    }

    /// The condition the runtime consuming a deferred target reports; None
    /// while no runtime consumed the record yet (no guest has the volume).
    pub(crate) fn deferred_condition(
        &self,
        target: &str,
    ) -> std::result::Result<Option<crust_ops::VolumeCondition>, crust_ops::OpsError> {
        match self.ops.stats(target) {
            Ok(stats) => Ok(stats.condition),
            Err(crust_ops::OpsError::NotConsumed(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// NodeGetVolumeStats of a deferred publication: usage and condition
    /// from the runtime, plus what the host can tell about the device.
    pub(crate) fn stats_deferred(
        &self,
        rec: &VolumeRecord,
        path: &Path,
    ) -> Result<csi::NodeGetVolumeStatsResponse> {
        if !self.cfg.deferral.enabled {
            return Err(NodeError::DeferralUnsupported);
        }
        let target = utf8("volume_path", path)?;
        let host = self.health.condition(rec);
        let stats = self.ops.stats(target)?;
        let reported_abnormal = stats.condition.as_ref().is_some_and(|c| c.abnormal);
        if stats.usage.is_empty() && !reported_abnormal {
            // No figures and no abnormal condition is no answer at all: a
            // failure must never read as a healthy volume.
            return Err(NodeError::Internal(format!(
                "the runtime reported no usage for {target}"
            )));
        }
        let usage = stats
            .usage
            .iter()
            .map(|u| csi::VolumeUsage {
                available: clamp(u.available),
                total: clamp(u.total),
                used: clamp(u.used),
                unit: match u.unit {
                    crust_ops::UsageUnit::Bytes => csi::volume_usage::Unit::Bytes,
                    crust_ops::UsageUnit::Inodes => csi::volume_usage::Unit::Inodes,
                    crust_ops::UsageUnit::Unknown => csi::volume_usage::Unit::Unknown,
                } as i32,
            })
            .collect();
        let mut cond = match stats.condition {
            Some(c) => Condition {
                abnormal: c.abnormal,
                message: c.message,
            },
            // Figures without a condition: the runtime served the volume.
            None => Condition::normal("the runtime reported usage and no volume condition"),
        };
        if host.abnormal {
            cond = if cond.abnormal {
                Condition::abnormal(format!("{}; {}", cond.message, host.message))
            } else {
                host
            };
        }
        self.metrics.observe_condition(&rec.id, cond.abnormal);
        Ok(csi::NodeGetVolumeStatsResponse {
            usage,
            volume_condition: self.cfg.csi_spec.serves_condition().then(|| cond.into()),
        })
    }

    /// NodeExpandVolume of a deferred publication: the host device learns
    /// its new size (the backing store was grown by ControllerExpandVolume),
    /// then the runtime grows the filesystem in its guest.
    pub(crate) fn expand_deferred(
        &self,
        rec: &VolumeRecord,
        path: &Path,
        required: u64,
        limit: u64,
    ) -> Result<csi::NodeExpandVolumeResponse> {
        if !self.cfg.deferral.enabled {
            return Err(NodeError::DeferralUnsupported);
        }
        let target = utf8("volume_path", path)?;
        let s = rec
            .staging
            .as_ref()
            .ok_or_else(|| PublishError::NotStaged {
                volume: rec.id.clone(),
            })?;
        let device = &s.device;
        let size = crate::node::refreshed_device_size(&rec.id, device, required, limit)?;
        let capacity = self.ops.expand(ExpandRequest {
            target_path: target.to_string(),
            required_bytes: required,
            limit_bytes: limit,
        })?;
        self.health.forget(&rec.id);
        tracing::info!(volume = %rec.id, device_size = size, capacity, "deferred expansion done");
        Ok(csi::NodeExpandVolumeResponse {
            capacity_bytes: clamp(capacity),
        })
    }
}

fn clamp(v: u64) -> i64 {
    v.min(i64::MAX as u64) as i64
}

/// Whether this publish repeats the one recorded at `target` (the same
/// arguments); a new deferred publication needs the volume published
/// nowhere else (ReadWriteOncePod).
fn repeat_of(rec: &VolumeRecord, target: &Path, wanted: &Publication) -> Result<bool> {
    let id = rec.id.clone();
    let repeat = match rec.published.get(target) {
        Some(p) if p == wanted => true,
        Some(p) if p.deferred => {
            return Err(PublishError::DeferredWithOtherArgs {
                volume: id.to_string(),
                target: target.to_path_buf(),
            }
            .into());
        }
        Some(_) => {
            return Err(PublishError::PublishedOnHostThere {
                volume: id.to_string(),
                target: target.to_path_buf(),
            }
            .into());
        }
        None => false,
    };
    if !repeat {
        if let Some((t, _)) = rec.deferred_publication() {
            return Err(PublishError::InGuest {
                volume: id,
                target: t.clone(),
                why: "only one sandbox may use it at a time (ReadWriteOncePod): unpublish it first",
            }
            .into());
        }
        if let Some((t, _)) = rec.host_publications().next() {
            return Err(PublishError::OnHost {
                volume: id,
                target: t.clone(),
            }
            .into());
        }
    }
    Ok(repeat)
}
