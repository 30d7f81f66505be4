//! NodePublishVolume and NodeUnpublishVolume on the host: a bind of the
//! staging mount (filesystem) or of the device node (raw block) onto the
//! target; deferred publications go to `crate::defer`, handed-over ones
//! to `crate::handover`.

use std::path::{Path, PathBuf};

use crust_proto::csi::v1 as csi;

use super::target::{mounted_source, publication_of, remove_created_target};
use super::{FsOps, abs_path, context_defers, require};
use crate::caps::{Access, Capability};
use crate::driver::NodeParts;
use crate::error::{NodeError, PublishError, RouteError, alias_err, mount_err};
use crate::records::PublishStep;
use crate::records::{HostMount, Publication, Staging, VolumeRecord};

type Result<T> = std::result::Result<T, NodeError>;

/// kubelet delegated fsGroup (VOLUME_MOUNT_GROUP): its group on the
/// volume, as kubelet's own SetVolumeOwnership would with
/// fsGroupChangePolicy OnRootMismatch (kubelet passes no policy to a
/// driver; a full walk on every publish would make pod starts
/// proportional to the volume's file count).
fn apply_fs_group(id: &str, root: &Path, gid: u32) -> Result<()> {
    let walked = crust_fsgroup::apply(
        root,
        gid,
        crust_fsgroup::FsGroupPolicy::OnRootMismatch,
        None,
    )
    .map_err(|e| NodeError::Internal(format!("volume {id}: {e}")))?;
    if walked {
        tracing::info!(volume = %id, gid, "applied fsGroup (volume_mount_group) on the host mount");
    }
    Ok(())
}

/// A NodePublishVolume request, checked before anything is looked up.
struct PublishAsk {
    staging: PathBuf,
    target: PathBuf,
    cap: Capability,
    /// The request's `readonly` flag.
    readonly: bool,
}

impl PublishAsk {
    fn from_request(req: &csi::NodePublishVolumeRequest) -> Result<Self> {
        let staging = abs_path("staging_target_path", &req.staging_target_path)?;
        let target = abs_path("target_path", &req.target_path)?;
        let wants_deferral = req.defer_fs_ops || context_defers(Some(&req.volume_context))?;
        let c = req
            .volume_capability
            .as_ref()
            .ok_or(NodeError::Missing("volume_capability"))?;
        let cap = if wants_deferral {
            Capability::from_proto_deferred(c)
        } else {
            Capability::from_proto(c)
        }
        .map_err(NodeError::InvalidArgument)?;
        if target.starts_with(&staging) || staging.starts_with(&target) {
            return Err(NodeError::InvalidArgument(format!(
                "target_path {} and staging_target_path {} must not contain each other",
                target.display(),
                staging.display()
            )));
        }
        if wants_deferral && cap.access.is_block() {
            return Err(NodeError::InvalidArgument(
                "deferred filesystem operations were requested for a raw block volume: \
                 deferral hands a filesystem to the pod's runtime, a raw block volume has none"
                    .into(),
            ));
        }
        Ok(PublishAsk {
            staging,
            target,
            cap,
            readonly: req.readonly,
        })
    }

    fn block(&self) -> bool {
        self.cap.access.is_block()
    }
}

/// Where a publication is carried out, decided once per request.
enum PublishRoute {
    /// The pod's runtime mounts it in its guest (`crate::defer`).
    Deferred,
    /// A VM runtime took this target by handover: kubelet repeating the
    /// publication finds it done.
    HandedOver,
    /// A bind of the device node on the host.
    Block,
    /// A bind of the staging mount on the host.
    Filesystem,
}

/// The staging this publication builds on: at the requested staging path,
/// for the same access type and filesystem.
fn staged_for(rec: &VolumeRecord, ask: &PublishAsk) -> Result<Staging> {
    let id = &rec.id;
    let s = match &rec.staging {
        Some(s) if s.path == ask.staging => s.clone(),
        Some(s) => {
            return Err(NodeError::StagedElsewhere {
                volume: id.clone(),
                staged: s.path.clone(),
                asked: ask.staging.clone(),
            });
        }
        None => {
            return Err(PublishError::NotStaged { volume: id.clone() }.into());
        }
    };
    let block = ask.block();
    if block != s.block {
        return Err(PublishError::StagedForOtherAccess {
            volume: id.clone(),
            staged_block: s.block,
        }
        .into());
    }
    if let Access::Mount { fs_type: Some(f) } = ask.cap.access
        && Some(f) != s.fs_type
    {
        return Err(NodeError::OtherFsType {
            volume: id.clone(),
            has: format!(
                "is staged with {}",
                s.fs_type.map(|f| f.as_str()).unwrap_or("no filesystem")
            ),
            asked: f,
        });
    }
    Ok(s)
}

/// Whether `wanted` at `target` repeats a recorded publication (true), is
/// new and compatible with the others (false), or conflicts.
fn check_publication(rec: &VolumeRecord, target: &Path, wanted: &Publication) -> Result<bool> {
    let id = &rec.id;
    match rec.published.get(target) {
        Some(p)
            if Publication {
                created_target: false,
                ..p.clone()
            } == *wanted =>
        {
            return Ok(true);
        }
        Some(p) => {
            return Err(PublishError::PublishedWithOtherArgs {
                volume: id.to_string(),
                target: target.to_path_buf(),
                readonly: p.readonly,
                mode: p.mode,
            }
            .into());
        }
        None => {}
    }
    let others: Vec<_> = rec.published.iter().filter(|(t, _)| *t != target).collect();
    if let Some((t, p)) = others
        .iter()
        .find(|(_, p)| p.mode.single_target() || wanted.mode.single_target())
    {
        let mode = if p.mode.single_target() {
            p.mode
        } else {
            wanted.mode
        };
        return Err(PublishError::SingleTarget {
            volume: id.clone(),
            other: t.to_path_buf(),
            mode,
        }
        .into());
    }
    if wanted.block
        && let Some((t, _)) = others.iter().find(|(_, p)| p.readonly != wanted.readonly)
    {
        return Err(PublishError::ReadOnlyMix {
            volume: id.clone(),
            other: t.to_path_buf(),
            other_readonly: !wanted.readonly,
        }
        .into());
    }
    Ok(false)
}

/// The route of a publication: deferral as the request or the volume
/// context asks; a target a VM runtime took by handover; else the host,
/// by access type.
fn publish_route(deferral: FsOps, rec: &VolumeRecord, ask: &PublishAsk) -> Result<PublishRoute> {
    if deferral == FsOps::Deferred {
        return Ok(PublishRoute::Deferred);
    }
    match rec.published.get(&ask.target) {
        Some(p) if p.handed_over => Ok(PublishRoute::HandedOver),
        Some(p) if p.deferred => Err(PublishError::PublishedDeferredThere {
            volume: rec.id.clone(),
            target: ask.target.clone(),
        }
        .into()),
        _ if ask.block() => Ok(PublishRoute::Block),
        _ => Ok(PublishRoute::Filesystem),
    }
}

/// The staged filesystem must be mounted at its staging path (not
/// unmounted outside the plugin, not gone with a reboot).
fn require_staging_mount(id: &str, s: &Staging) -> Result<()> {
    let numbers = crust_blockdev::device_major_minor(&s.device)
        .map_err(|e| NodeError::Internal(e.to_string()))?;
    match crust_blockdev::find_mount(&s.path).map_err(mount_err)? {
        Some(m) if (m.major, m.minor) == numbers => Ok(()),
        _ => Err(PublishError::StagingNotMounted {
            volume: id.to_string(),
            path: s.path.clone(),
        }
        .into()),
    }
}

/// Binds the staging mount (filesystem) or the device node (raw block)
/// onto `target`; a read-only raw block publication also sets the device
/// read-only, since a read-only bind of a device node does not stop writes.
fn bind(s: &Staging, target: &Path, readonly: bool) -> Result<()> {
    let source: &Path = if s.block { &s.device } else { &s.path };
    crust_blockdev::bind_mount(source, target, readonly).map_err(mount_err)?;
    if s.block && readonly {
        crust_blockdev::set_read_only(&s.device, true).map_err(|e| {
            let _ = crust_blockdev::unmount(target);
            NodeError::Internal(format!("setting {} read-only: {e}", s.device.display()))
        })?;
    }
    Ok(())
}

impl NodeParts<'_> {
    pub fn node_publish_volume(&self, req: &csi::NodePublishVolumeRequest) -> Result<()> {
        require(&[
            ("volume_id", !req.volume_id.is_empty()),
            ("staging_target_path", !req.staging_target_path.is_empty()),
            ("target_path", !req.target_path.is_empty()),
            ("volume_capability", req.volume_capability.is_some()),
        ])?;
        // NOT_FOUND before any other check (re-read under the guard below).
        self.node_record_here(&req.volume_id, &req.volume_context)?;
        let ask = PublishAsk::from_request(req)?;
        let deferral = self.fs_ops_route(req.defer_fs_ops, Some(&req.volume_context))?;
        let _guard = self.guards.try_begin(&req.volume_id, "NodePublishVolume")?;
        let rec = self.node_record_here(&req.volume_id, &req.volume_context)?;
        // Every route (host, deferred, handed over) refuses bad flags the
        // same way, before anything is recorded or mounted.
        ask.cap.checked_mount_flags(rec.fs_type)?;
        let s = staged_for(&rec, &ask)?;
        self.require_staged_device(&rec, &s)?;
        match publish_route(deferral, &rec, &ask)? {
            PublishRoute::Deferred => self
                .deferred()
                .publish_deferred(req, rec, s, ask.target, ask.cap),
            PublishRoute::HandedOver => {
                tracing::info!(volume = %rec.id, target = %ask.target.display(),
                    "repeated publish of a handed-over target: nothing to do");
                Ok(())
            }
            PublishRoute::Block => self.publish_on_host(rec, s, &ask),
            PublishRoute::Filesystem => {
                let mut rec = rec;
                let s = if s.host_mount == HostMount::Mounted {
                    s
                } else {
                    self.deferred().remount_staging(&mut rec, &ask.cap)?
                };
                require_staging_mount(&rec.id, &s)?;
                self.publish_on_host(rec, s, &ask)
            }
        }
    }

    /// Never bind an empty staging directory or a device number that now
    /// belongs to something else (e.g. after a reboot): the staged device
    /// must still be this volume's.
    fn require_staged_device(&self, rec: &VolumeRecord, s: &Staging) -> Result<()> {
        let attached = self.backend.attached_device(&rec.id)?;
        if attached.as_deref() != Some(s.device.as_path()) {
            return Err(PublishError::DeviceGone {
                volume: rec.id.clone(),
                device: s.device.clone(),
            }
            .into());
        }
        Ok(())
    }

    /// The host bind (filesystem or raw block) of a checked publication.
    fn publish_on_host(&self, mut rec: VolumeRecord, s: Staging, ask: &PublishAsk) -> Result<()> {
        let id = rec.id.clone();
        let block = ask.block();
        let target = &ask.target;
        let readonly = ask.readonly || ask.cap.mode.read_only() || s.readonly;
        let wanted = Publication {
            supplemental_group: ask.cap.fs_group(),
            ..Publication::host(block, readonly, ask.cap.mode, ask.cap.flags_digest())
        };
        let repeat = check_publication(&rec, target, &wanted)?;
        if !block
            && !readonly
            && let Some(gid) = ask.cap.fs_group()
        {
            apply_fs_group(&id, &s.path, gid)?;
        }
        if block && !publication_of(&s, target) {
            // A pod gets raw access: no other device may expose the data
            // (also when a repeated publish binds again after a reboot).
            crust_blockdev::ensure_no_aliases(&s.device, "publish it as a raw block device")
                .map_err(alias_err)?;
        }
        let created = self.prepare_target(&mut rec, target, block, Some(&s.device))?;
        if let Err(e) = bind(&s, target, readonly) {
            if created && remove_created_target(&mut rec, target) {
                self.state.put(rec)?;
            }
            return Err(e);
        }
        self.publish_fault(PublishStep::Bound);
        if !repeat {
            rec.published.insert(target.clone(), wanted);
            self.state.put(rec)?;
        }
        self.health.forget(&id);
        tracing::info!(volume = %id, target = %target.display(), readonly, block, "volume published");
        Ok(())
    }

    pub fn node_unpublish_volume(&self, req: &csi::NodeUnpublishVolumeRequest) -> Result<()> {
        require(&[
            ("volume_id", !req.volume_id.is_empty()),
            ("target_path", !req.target_path.is_empty()),
        ])?;
        // An unknown volume is nothing to undo (error.rs: the spec's
        // idempotency), whatever the path looks like.
        if self.state.get(&req.volume_id).is_none() {
            return Ok(());
        }
        let target = abs_path("target_path", &req.target_path)?;
        let _guard = self
            .guards
            .try_begin(&req.volume_id, "NodeUnpublishVolume")?;
        let Some(mut rec) = self.state.get(&req.volume_id) else {
            return Ok(());
        };
        let id = rec.id.clone();
        let Some(p) = rec.published.get(&target).cloned() else {
            return self.unpublish_unrecorded(rec, &target);
        };
        if p.handed_over {
            return self.handover().unpublish_handed_over(rec, &target);
        }
        if p.deferred {
            // Whatever the request says (a kubelet that lost track of the
            // deferral, or a plugin downgraded to --deferral disabled: KEP
            // story 5), the records know the volume was handed to a runtime.
            return self.deferred().unpublish_deferred(rec, &target);
        }
        if req.defer_fs_ops {
            return Err(if self.cfg.deferral.enabled {
                RouteError::HostPublication {
                    volume: id,
                    path: target,
                    call: "NodeUnpublishVolume",
                }
                .into()
            } else {
                NodeError::DeferralUnsupported
            });
        }
        if crust_blockdev::is_mountpoint(&target).map_err(mount_err)? {
            // Only this volume's own bind is removed: whatever else was
            // mounted there since stays, and so do the records.
            let ours = rec
                .staging
                .as_ref()
                .is_some_and(|s| publication_of(s, &target));
            if !ours {
                return Err(NodeError::ForeignMount {
                    field: "target_path",
                    path: target.clone(),
                    what: mounted_source(&target).unwrap_or_else(|| "something".into()),
                    volume: Some(id.clone()),
                });
            }
            crust_blockdev::unmount_top(&target).map_err(mount_err)?;
        }
        remove_created_target(&mut rec, &target);
        rec.published.remove(&target);
        if p.block
            && p.readonly
            && let Some(s) = &rec.staging
            && !s.readonly
            && !rec.published.values().any(|o| o.block && o.readonly)
            && let Err(e) = crust_blockdev::set_read_only(&s.device, false)
        {
            tracing::warn!(volume = %id, error = %e, "could not make the device writable again");
        }
        self.state.put(rec)?;
        self.health.forget(&id);
        tracing::info!(volume = %id, target = %target.display(), "volume unpublished");
        Ok(())
    }

    /// NodeUnpublishVolume of a target with no recorded publication: what
    /// a publish killed before recording it may have left is undone (this
    /// volume's bind, a deferred publish's hand-off record), and the
    /// target goes only if the record says the plugin created it.
    fn unpublish_unrecorded(&self, mut rec: VolumeRecord, target: &Path) -> Result<()> {
        if let Some(s) = &rec.staging
            && publication_of(s, target)
        {
            crust_blockdev::unmount_top(target).map_err(mount_err)?;
        }
        self.deferred()
            .unpublish_unrecorded_deferred(&rec, target)?;
        if remove_created_target(&mut rec, target) {
            self.state.put(rec)?;
        }
        Ok(())
    }

    pub(crate) fn publish_fault(&self, at: PublishStep) {
        if self.cfg.hooks.publish_crash == Some(at) {
            tracing::error!(step = ?at, "test fault: the plugin dies here");
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        }
    }
}
