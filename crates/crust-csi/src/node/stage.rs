//! NodeStageVolume and NodeUnstageVolume: attach, make sure of the
//! filesystem (created on a blank device only), mount at the staging path
//! (or not, for a deferred stage); undo in reverse.

use std::path::{Path, PathBuf};

use crust_blockdev::{BlankProof, Probe};
use crust_proto::csi::v1 as csi;

use super::target::{mounted_here, mounted_source, require_dir, sync_and_unmount};
use super::{FsOps, abs_path, node_cap, require};
use crate::caps::{Access, Capability, FsType};
use crate::driver::NodeParts;
use crate::error::{NodeError, StageError, alias_err, fs_err, mount_err};
use crate::records::{HostMount, Staging, VolumeRecord};

type Result<T> = std::result::Result<T, NodeError>;

/// Mount flags as the one allow-list normalizes them (one option per
/// entry), as recorded for a handover.
fn normalized_options(fs: FsType, flags: &[String]) -> Result<Vec<String>> {
    crust_fs::options::parse(fs, flags, false)
        .map(|p| p.words)
        .map_err(|e| NodeError::InvalidArgument(e.to_string()))
}

/// Grows a freshly mounted xfs that is at least 1 MiB smaller than its
/// device (a volume restored or cloned into a larger size; xfs grows only
/// while mounted).
fn grow_xfs_to_device(id: &str, device: &Path, mountpoint: &Path) -> Result<()> {
    if fs_needs_grow(device, FsType::Xfs)? {
        crust_blockdev::grow_fs(device, mountpoint, FsType::Xfs)
            .map_err(|e| fs_err(&format!("growing xfs on {}", device.display()), e))?;
        tracing::info!(volume = %id, device = %device.display(), "grew xfs to the device size after mounting");
    }
    Ok(())
}

/// Whether the filesystem on `device` is at least 1 MiB smaller than the
/// device (grown while its filesystem was not).
pub(super) fn fs_needs_grow(device: &Path, fs: FsType) -> Result<bool> {
    crust_blockdev::fs_needs_grow(device, fs).map_err(|e| {
        NodeError::Internal(format!(
            "comparing the {fs} superblock with its device: {e}"
        ))
    })
}

/// The mount flags for `rec`'s filesystem: the capability's, plus
/// `nouuid` for an xfs copied from a snapshot or volume (it shares its
/// source's UUID, and the kernel refuses a second xfs with one).
pub(crate) fn mount_flags_of(rec: &VolumeRecord, fs: FsType, flags: &[String]) -> Vec<String> {
    let mut flags = flags.to_vec();
    if fs == FsType::Xfs && rec.content_source.is_some() && !flags.iter().any(|f| f == "nouuid") {
        flags.push("nouuid".into());
    }
    flags
}

/// The filesystem a stage is for (`None`: raw block), checked against
/// what the volume was created for.
fn staged_fs_type(rec: &VolumeRecord, cap: &Capability) -> Result<Option<FsType>> {
    let id = &rec.id;
    let block = cap.access.is_block();
    if block && !rec.allows_block() {
        return Err(StageError::CreatedForOtherAccess {
            volume: id.clone(),
            created_block: false,
        }
        .into());
    }
    if !block && !rec.allows_mount() {
        return Err(StageError::CreatedForOtherAccess {
            volume: id.clone(),
            created_block: true,
        }
        .into());
    }
    let fs_type = match cap.access {
        Access::Block => None,
        Access::Mount { fs_type: Some(f) } => Some(f),
        Access::Mount { fs_type: None } => Some(rec.fs_type),
    };
    if let Some(f) = fs_type
        && f != rec.fs_type
    {
        return Err(NodeError::OtherFsType {
            volume: id.clone(),
            has: format!("has fsType {}", rec.fs_type),
            asked: f,
        });
    }
    Ok(fs_type)
}

/// Whether `wanted` repeats the recorded staging (true), is the first
/// (false), or conflicts with it.
fn repeats_staging(rec: &VolumeRecord, wanted: &Staging) -> Result<bool> {
    let id = &rec.id;
    let path = &wanted.path;
    let Some(s) = &rec.staging else {
        return Ok(false);
    };
    if s.path != *path {
        return Err(StageError::AlreadyStagedElsewhere {
            volume: id.clone(),
            staged: s.path.clone(),
        }
        .into());
    }
    let same = s.block == wanted.block
        && s.fs_type == wanted.fs_type
        && s.mode == wanted.mode
        && s.flags_digest == wanted.flags_digest;
    if !same {
        return Err(StageError::StagedWithOtherCapability {
            volume: id.to_string(),
            path: path.to_path_buf(),
            block: s.block,
            mode: s.mode,
        }
        .into());
    }
    if s.deferred != wanted.deferred {
        return Err(StageError::StagedWithOtherDeferral {
            volume: id.to_string(),
            path: path.to_path_buf(),
            deferred: s.deferred,
        }
        .into());
    }
    Ok(true)
}

/// A mount already at a first stage's path: our own, from a stage that
/// crashed before recording it, is adopted (true: the caller removes it
/// for a deferred stage); anything else is refused.
fn adopt_leftover_mount(path: &Path, attached: Option<&Path>) -> Result<bool> {
    let Some(m) = crust_blockdev::find_mount(path).map_err(mount_err)? else {
        return Ok(false);
    };
    let ours = attached.and_then(|d| crust_blockdev::device_major_minor(d).ok())
        == Some((m.major, m.minor));
    if !ours {
        return Err(NodeError::ForeignMount {
            field: "staging_target_path",
            path: path.to_path_buf(),
            what: m.source,
            volume: None,
        });
    }
    Ok(true)
}

/// The staging a NodeStageVolume asks for (compared with a recorded one).
fn wanted_staging(
    rec: &VolumeRecord,
    cap: &Capability,
    path: &Path,
    fs_type: Option<FsType>,
    deferred: bool,
) -> Result<Staging> {
    Ok(Staging {
        path: path.to_path_buf(),
        device: PathBuf::new(),
        block: fs_type.is_none(),
        fs_type,
        readonly: cap.mode.read_only(),
        mode: cap.mode,
        flags_digest: cap.flags_digest(),
        deferred,
        host_mount: if deferred {
            HostMount::UnmountedForDeferral
        } else {
            HostMount::Mounted
        },
        mount_options: match fs_type {
            Some(fs) => normalized_options(fs, &mount_flags_of(rec, fs, &cap.mount_flags))?,
            None => Vec::new(),
        },
    })
}

impl NodeParts<'_> {
    fn stage_gate(&self) {
        if let Some(gate) = &self.cfg.hooks.stage_gate {
            gate.pass();
        }
    }

    pub fn node_stage_volume(&self, req: &csi::NodeStageVolumeRequest) -> Result<()> {
        require(&[
            ("volume_id", !req.volume_id.is_empty()),
            ("staging_target_path", !req.staging_target_path.is_empty()),
            ("volume_capability", req.volume_capability.is_some()),
        ])?;
        // NOT_FOUND before any other check (re-read under the guard below).
        self.node_record_here(&req.volume_id, &req.volume_context)?;
        let (path, cap, deferred) = self.stage_ask(req)?;
        let _guard = self.guards.try_begin(&req.volume_id, "NodeStageVolume")?;
        self.stage_gate();
        let mut rec = self.node_record_here(&req.volume_id, &req.volume_context)?;
        let id = rec.id.clone();
        let fs_type = staged_fs_type(&rec, &cap)?;
        // Bad mount flags are refused before anything is touched.
        cap.checked_mount_flags(rec.fs_type)?;
        let readonly = cap.mode.read_only();
        let wanted = wanted_staging(&rec, &cap, &path, fs_type, deferred)?;
        let repeat = repeats_staging(&rec, &wanted)?;
        require_dir("staging_target_path", &path)?;
        let attached = self.backend.attached_device(&id)?;
        if fs_type.is_some()
            && let Some(why) = self.deferred().guest_may_have_fs(&rec, attached.as_deref())
        {
            // kubelet repeats NodeStageVolume on every pod start and after
            // its own restarts: while a sandbox's guest may have the
            // filesystem mounted the host neither probes, checks, grows
            // nor mounts it (QEMU does not hold the device O_EXCL, so
            // nothing else would stop a host e2fsck).
            if !repeat {
                return Err(StageError::GuestMayHaveFs { volume: id, why }.into());
            }
            return self.deferred().restage_for_guest(rec, &why);
        }
        let unmount_ours = !repeat
            && fs_type.is_some()
            && adopt_leftover_mount(&path, attached.as_deref())?
            && deferred;
        // What the host mount should be after this call: a deferred stage
        // never mounts (a repeated stage unmounted for deferral returned
        // above; a host publication mounts it again, see
        // remount_staging); a host stage is mounted (or repaired).
        let host_mount = match &rec.staging {
            Some(s) if repeat => s.host_mount,
            _ => wanted.host_mount,
        };
        let was_attached = attached.is_some();
        let device = self.backend.attach(&id)?;
        // Undo our attach if the rest fails, so a failed stage changes nothing.
        let undo = |e: NodeError| {
            if !repeat
                && !was_attached
                && let Err(de) = self.backend.detach(&id)
            {
                tracing::warn!(volume = %id, error = %de, "could not detach after failed stage");
            }
            e
        };
        if !repeat || !was_attached {
            // Another device exposing the same data (the backing file
            // attached again, a loop on it): the host neither formats nor
            // mounts it, nor hands it raw to a pod. Also on a repeated
            // stage that attached again (after a reboot a host tool may
            // have attached the file first).
            crust_blockdev::ensure_no_aliases(&device, "stage it")
                .map_err(alias_err)
                .map_err(undo)?;
        }
        if let Some(fs) = fs_type {
            if unmount_ours {
                sync_and_unmount(&path).map_err(undo)?;
            }
            // A mount of ours still here (adopted above) proves a format
            // that finished before the plugin died: it holds the device.
            let ours_mounted = mounted_here(&device, &path).map_err(undo)?;
            self.ensure_filesystem(&mut rec, &device, fs, ours_mounted)
                .map_err(undo)?;
            if host_mount == HostMount::Mounted {
                let fresh_mount = self
                    .mount_staging(&mut rec, &device, &path, fs, &cap, was_attached)
                    .map_err(undo)?;
                // Only when this call mounted it: growing a mounted volume
                // is NodeExpandVolume's job, a repeated stage changes nothing.
                if fresh_mount && fs == FsType::Xfs && !readonly {
                    grow_xfs_to_device(&id, &device, &path)?;
                }
            }
        } else if readonly {
            crust_blockdev::set_read_only(&device, true)
                .map_err(|e| {
                    NodeError::Internal(format!("setting {} read-only: {e}", device.display()))
                })
                .map_err(undo)?;
        }
        let staging = Staging {
            device,
            host_mount,
            ..wanted
        };
        // Raw use is recorded before the device can reach a workload (the
        // publish comes after this call): its data may carry no signature.
        rec.raw_block_used |= staging.block;
        rec.staging = Some(staging.clone());
        if self.state.get(&id).as_ref() != Some(&rec) {
            self.state.put(rec)?;
        }
        self.health.forget(&id);
        tracing::info!(volume = %id, path = %path.display(), device = %staging.device.display(),
            block = staging.block, deferred, "volume staged");
        Ok(())
    }

    /// The request's staging path, capability and deferral, checked before
    /// anything is looked up.
    fn stage_ask(&self, req: &csi::NodeStageVolumeRequest) -> Result<(PathBuf, Capability, bool)> {
        let path = abs_path("staging_target_path", &req.staging_target_path)?;
        let cap = node_cap(req.volume_capability.as_ref())?;
        let deferred = self.fs_ops_route(false, Some(&req.volume_context))? == FsOps::Deferred;
        if deferred && cap.access.is_block() {
            return Err(NodeError::InvalidArgument(
                "deferFsOps=true cannot be used with raw block access: deferral hands a \
                 filesystem to the pod's runtime, a raw block volume has none"
                    .into(),
            ));
        }
        Ok((path, cap, deferred))
    }

    /// Mounts the staged filesystem at `path` (or finds it mounted there;
    /// returns whether this call mounted it): never a device a sandbox's
    /// QEMU may have open, and a filesystem back from a guest only after
    /// its userspace check.
    fn mount_staging(
        &self,
        rec: &mut VolumeRecord,
        device: &Path,
        path: &Path,
        fs: FsType,
        cap: &Capability,
        was_attached: bool,
    ) -> Result<bool> {
        let fresh_mount = !mounted_here(device, path)?;
        // A device that was already attached may be open in a sandbox's
        // QEMU: never mount it on the host then. (A device this call
        // attached is open nowhere else.)
        // A device this call attached had its alias check in the caller;
        // one found attached (a repeated stage) has it here.
        if was_attached && fresh_mount {
            crust_blockdev::ensure_no_other_openers(device, crust_blockdev::fs::MOUNT)
                .map_err(|e| fs_err("checking for other openers", e))?;
            crust_blockdev::ensure_no_aliases(device, crust_blockdev::fs::MOUNT)
                .map_err(alias_err)?;
        }
        let mut flags = mount_flags_of(rec, fs, &cap.mount_flags);
        if fresh_mount {
            // A filesystem a guest had: checked in userspace first.
            flags = self.handover().check_after_guest(rec, device, fs, flags)?;
        }
        let readonly = cap.mode.read_only();
        crust_blockdev::mount_fs(device, path, fs, &flags, readonly).map_err(mount_err)?;
        if fresh_mount && rec.returned.take().is_some() {
            tracing::info!(volume = %rec.id, "filesystem back from a guest passed its check and is mounted on the host");
        }
        Ok(fresh_mount)
    }

    /// Makes sure `device` holds a filesystem of type `fs`, creating it
    /// only through the format gate: the device probes blank (no signature,
    /// zero edges) AND the volume's history proves it holds no data crust
    /// did not write ([`crate::history::format_proof`]: never raw block,
    /// never formatted, a copy only of a never-used volume, else the
    /// backend's proof). The start of a format is recorded first, so a
    /// stage killed mid-format redoes its own half-made filesystem (and
    /// waits while the orphaned tool still holds the device).
    fn ensure_filesystem(
        &self,
        rec: &mut VolumeRecord,
        device: &Path,
        fs: FsType,
        ours_mounted: bool,
    ) -> Result<()> {
        let id = rec.id.clone();
        let interrupted = rec.format_started == Some(fs) && rec.formatted.is_none();
        if interrupted
            && !ours_mounted
            && crust_blockdev::is_device_held_exclusively(device).unwrap_or(true)
        {
            return Err(StageError::FormatRunning {
                volume: id,
                device: device.to_path_buf(),
            }
            .into());
        }
        let found =
            crust_blockdev::probe_fs(device).map_err(|e| NodeError::Internal(e.to_string()))?;
        let mkfs = |rec: &mut VolumeRecord, proof: BlankProof| -> Result<()> {
            let first = rec.format_started.is_none();
            rec.format_started = Some(fs);
            self.state.put(rec.clone())?;
            if let Err(e) = crust_blockdev::format(device, fs, &proof) {
                // Refused before the tool ran (in use, a signature, data):
                // nothing of ours is on the device, so a retry must not
                // take it for an interrupted format of its own.
                if first && !e.tool_ran() {
                    rec.format_started = None;
                    self.state.put(rec.clone())?;
                }
                return Err(fs_err(&format!("creating {fs} on {}", device.display()), e));
            }
            rec.formatted = Some(fs);
            tracing::info!(volume = %id, device = %device.display(), %fs, %proof, "created filesystem on blank volume");
            Ok(())
        };
        match found {
            Probe::Blank if !interrupted => {
                let proof = crate::history::format_proof(rec, fs, || {
                    Ok(self.backend.blankness(&rec.id)?)
                })?;
                mkfs(rec, proof)
            }
            p if p.fs_type() == Some(fs) => {
                if interrupted {
                    rec.formatted = Some(fs);
                }
                // A volume expanded while it was not staged (or while
                // online ext4 growth was impossible): grow before mounting.
                // Mounted on the host (our staging mount): NodeExpandVolume
                // grows it online. Open in another process (a guest's QEMU,
                // which O_EXCL does not see): grow_fs_offline refuses.
                if fs == FsType::Ext4
                    && fs_needs_grow(device, FsType::Ext4)?
                    && !crust_blockdev::is_device_held_exclusively(device).unwrap_or(true)
                {
                    crust_blockdev::grow_fs_offline(device, fs)
                        .map_err(|e| fs_err(&format!("growing ext4 on {}", device.display()), e))?;
                    tracing::info!(volume = %id, device = %device.display(), "grew ext4 to the device size before mounting");
                }
                Ok(())
            }
            // Our own format, interrupted: never published, so nothing but
            // the half-made filesystem can be there.
            _ if interrupted && !rec.raw_block_used => mkfs(rec, BlankProof::RedoOwnFormat),
            p => Err(StageError::WouldOverwrite {
                volume: id,
                found: format!("holds {p}, not {fs}"),
                refused: "format or mount it (data is never overwritten)".into(),
            }
            .into()),
        }
    }

    pub fn node_unstage_volume(&self, req: &csi::NodeUnstageVolumeRequest) -> Result<()> {
        require(&[
            ("volume_id", !req.volume_id.is_empty()),
            ("staging_target_path", !req.staging_target_path.is_empty()),
        ])?;
        // NOT_FOUND before any other check (re-read under the guard below).
        self.node_record(&req.volume_id)?;
        let path = abs_path("staging_target_path", &req.staging_target_path)?;
        let _guard = self.guards.try_begin(&req.volume_id, "NodeUnstageVolume")?;
        let mut rec = self.node_record(&req.volume_id)?;
        let id = rec.id.clone();
        let Some(s) = rec.staging.clone() else {
            return self.unstage_unrecorded(&id, &path);
        };
        if s.path != path {
            return Err(NodeError::StagedElsewhere {
                volume: id,
                staged: s.path,
                asked: path,
            });
        }
        if !rec.published.is_empty() {
            return Err(StageError::StillPublished {
                volume: id,
                targets: rec.published.keys().cloned().collect(),
            }
            .into());
        }
        if !s.block && crust_blockdev::is_mountpoint(&path).map_err(mount_err)? {
            // Only this volume's own staging mount is removed (a host
            // publication that crashed after remounting the staging path
            // may have left one although the records say unmounted).
            if !mounted_here(&s.device, &path)? {
                return Err(NodeError::ForeignMount {
                    field: "staging_target_path",
                    path: path.clone(),
                    what: mounted_source(&path).unwrap_or_else(|| "something".into()),
                    volume: Some(id),
                });
            }
            crust_blockdev::unmount_top(&path).map_err(mount_err)?;
        }
        if s.block && s.readonly && s.device.exists() {
            let _ = crust_blockdev::set_read_only(&s.device, false);
        }
        self.backend
            .detach(&id)
            .map_err(|e| StageError::Undetachable {
                volume: id.clone(),
                device: s.device.clone(),
                reason: e.to_string(),
            })?;
        rec.staging = None;
        self.state.put(rec)?;
        self.health.forget(&id);
        tracing::info!(volume = %id, path = %path.display(), "volume unstaged");
        Ok(())
    }

    /// Unstage of a volume the records say is not staged: undo what a
    /// stage that crashed before recording may have left (its mount at
    /// `path`, its attached device); otherwise nothing to do.
    fn unstage_unrecorded(&self, id: &str, path: &Path) -> Result<()> {
        let Some(dev) = self.backend.attached_device(id)? else {
            return Ok(());
        };
        let Ok(numbers) = crust_blockdev::device_major_minor(&dev) else {
            return Ok(());
        };
        if let Some(m) = crust_blockdev::find_mount(path).map_err(mount_err)?
            && (m.major, m.minor) == numbers
        {
            crust_blockdev::unmount(path).map_err(mount_err)?;
        }
        let mounted_elsewhere = crust_blockdev::mount_info()
            .map_err(mount_err)?
            .iter()
            .any(|m| (m.major, m.minor) == numbers);
        if !mounted_elsewhere {
            self.backend.detach(id)?;
        }
        Ok(())
    }
}
