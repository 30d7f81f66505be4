//! Runtime-driven deferral: a VM runtime takes a volume that the plugin
//! published on the host (standard CSI, `deferFsOps=auto`) into its
//! guest, and gives it back when its sandbox ends.
//!
//! Today's kubelet never sends KEP-2857's `defer_fs_ops`, and only the VM
//! runtime knows for certain, at container creation, that a mount goes
//! into a VM. So crust's runtime asks (the `Handover` gRPC service of
//! `handover.proto`, on a root-only socket next to crust_ops' Runtime
//! service) and the plugin, under the volume's operation guard:
//!
//! | step | what | a crash after it is repaired by |
//! |---|---|---|
//! | check | published at exactly this target, mounted nowhere else (every mount namespace), nobody has the device open, no host process has a working directory, open file or mapping on its filesystem, the guest can mount the filesystem and its options, the runtime can serve stats, resize and the fsGroup | – (nothing changed) |
//! | 1 `Recorded` | `handover: Preparing` in the volume record | rolling back: host mounts restored |
//! | 2 `TargetUnmounted` | target bind synced and unmounted | rolling back |
//! | 3 `StagingUnmounted` | staging synced and unmounted | rolling back |
//! | 4 `RecordWritten` | hand-off record written already claimed by the sandbox (claim first, `mountInfo.json` last), device checked free (`O_EXCL`) | rolling forward |
//! | 5 `PlaceholderMounted` | README placeholder (no room for data) on the target | rolling forward |
//! | done | publication deferred + handed over, `handover: HandedOver` | – |
//!
//! Repair runs when the plugin starts and before any handover call on the
//! volume. Rolling back remounts without a check: no complete hand-off
//! record existed, so no guest can have touched the filesystem.
//!
//! While handed over the publication is `deferred`: kubelet's plain
//! NodeGetVolumeStats and NodeExpandVolume go to the runtime's CLI through
//! crust_ops, health reports the guest's view, and the host never mounts
//! it. **Hand-back** (the runtime, after its VM exited and it released its
//! claim) and **take-back** (a dead runtime's stale claim: typed
//! `sandbox-state` = `stopped`, or no claim, and the device free) end in
//! the same *returned* state: no host mount, `returned` recorded. Kubelet's
//! NodeUnpublishVolume and NodeUnstageVolume accept it as is; a later host
//! publication mounts the filesystem again only after a userspace check
//! (`e2fsck -fn`, `xfs_repair -n`) and with `nosuid,nodev`, because a guest
//! had raw access to it (see `docs/security.md`).
//!
//! What is never handed over (declined, or FAILED_PRECONDITION when the
//! request says deferral is required): a volume published at more than one
//! target, mounted or open elsewhere, used by a host process (named in the
//! answer; an EBUSY at the unmount itself rolls back the same way, never a
//! lazy unmount), raw block, `deferFsOps=false`, a
//! plugin with `--deferral disabled`, a filesystem or mount option the
//! guest does not declare, a runtime without stats/resize/fsGroup support.
//!
//! Status codes: malformed request INVALID_ARGUMENT; a caller that is not
//! root PERMISSION_DENIED; another operation on the volume ABORTED; held
//! by another live sandbox, refused with `required`, a hand-back by the
//! wrong sandbox or while the device is still in use FAILED_PRECONDITION.

use std::path::{Path, PathBuf};

use crust_ops::StageRequest;
use crust_proto::handover::v1alpha1 as pb;
use pb::declined::Reason;
use pb::runtime_capability::Type as Cap;
use tonic::{Request, Response, Status};

use crate::driver::{Driver, HandoverParts};
use crate::error::mount_err;
use crate::error::{HandoverError, NodeError};
use crate::node::{DeferMode, mounted_here, publication_of, sync_and_unmount};
use crate::records::SubpathBind;
use crate::records::{HandoverPhase, HandoverRecord, HandoverStep, Returned};
use crate::records::{HostMount, Publication, VolumeRecord};
use crate::subpath_binds;

type Result<T> = std::result::Result<T, HandoverError>;

/// Why a volume is not handed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decline {
    pub reason: Reason,
    pub message: String,
}

impl Decline {
    fn new(reason: Reason, message: impl Into<String>) -> Decline {
        Decline {
            reason,
            message: message.into(),
        }
    }

    fn answer(self) -> pb::HandOverResponse {
        pb::HandOverResponse {
            outcome: Some(pb::hand_over_response::Outcome::Declined(pb::Declined {
                reason: self.reason as i32,
                message: self.message,
            })),
        }
    }
}

/// A checked HandOver request.
struct Ask {
    target: PathBuf,
    sandbox: String,
    runtime_cli: String,
    caps: Vec<Cap>,
    file_systems: Vec<pb::FileSystemSupport>,
    required: bool,
}

impl Ask {
    fn from_proto(r: &pb::HandOverRequest) -> Result<Ask> {
        let target = path_field("target_path", &r.target_path)?;
        if r.sandbox_id.is_empty() {
            return Err(HandoverError::Missing("sandbox_id"));
        }
        crust_handoff::validate::check_sandbox_id(&r.sandbox_id)
            .map_err(|e| HandoverError::InvalidArgument(format!("sandbox_id: {e}")))?;
        if r.runtime_cli.is_empty() {
            return Err(HandoverError::Missing("runtime_cli"));
        }
        crust_handoff::validate::check_abs_path("runtime_cli", &r.runtime_cli)
            .map_err(HandoverError::InvalidArgument)?;
        Ok(Ask {
            target,
            sandbox: r.sandbox_id.clone(),
            runtime_cli: r.runtime_cli.clone(),
            caps: r
                .capabilities
                .iter()
                .filter_map(|c| Cap::try_from(c.r#type).ok())
                .collect(),
            file_systems: r.file_systems.clone(),
            required: r.required,
        })
    }
}

fn path_field(field: &'static str, p: &str) -> Result<PathBuf> {
    if p.is_empty() {
        return Err(HandoverError::Missing(field));
    }
    crust_blockdev::validate_abs_path(p)
        .map_err(|e| HandoverError::InvalidArgument(format!("{field}: {e}")))
}

fn utf8(p: &Path) -> Result<&str> {
    p.to_str()
        .ok_or_else(|| HandoverError::InvalidArgument(format!("{} is not UTF-8", p.display())))
}

impl HandoverParts<'_> {
    /// HandOver: see the module doc.
    pub fn hand_over(&self, req: &pb::HandOverRequest) -> Result<pb::HandOverResponse> {
        let ask = Ask::from_proto(req)?;
        let Some(id) = self.volume_at(&ask.target) else {
            return Ok(not_published(&ask.target).answer());
        };
        let _guard = self.guards.try_begin(&id, "HandOver")?;
        if let Some(gate) = &self.cfg.hooks.handover_gate {
            gate.pass();
        }
        let Ok(mut rec) = self.node().node_record(&id) else {
            return Ok(not_published(&ask.target).answer());
        };
        self.settle_handover(&mut rec)?;
        if let Some(h) = rec.handover.clone() {
            if h.target == ask.target && h.sandbox == ask.sandbox {
                return self.handed_over_answer(&rec, &ask.target);
            }
            self.take_back(&mut rec, Some(&ask.sandbox))?;
        }
        if let Err(d) = self.may_hand_over(&rec, &ask) {
            return if ask.required && d.reason != Reason::NotPublished {
                Err(HandoverError::Required(d.message))
            } else {
                tracing::info!(volume = %rec.id, target = %ask.target.display(),
                    sandbox = %ask.sandbox, reason = ?d.reason, "handover declined: {}", d.message);
                Ok(d.answer())
            };
        }
        self.move_to_guest(&mut rec, &ask)
    }

    /// HandBack: the runtime released its claim after its VM exited.
    pub fn hand_back(&self, req: &pb::HandBackRequest) -> Result<()> {
        let target = path_field("target_path", &req.target_path)?;
        if req.sandbox_id.is_empty() {
            return Err(HandoverError::Missing("sandbox_id"));
        }
        crust_handoff::validate::check_sandbox_id(&req.sandbox_id)
            .map_err(|e| HandoverError::InvalidArgument(format!("sandbox_id: {e}")))?;
        let Some(id) = self.volume_at(&target) else {
            return Ok(());
        };
        let _guard = self.guards.try_begin(&id, "HandBack")?;
        let Ok(mut rec) = self.node().node_record(&id) else {
            return Ok(());
        };
        self.settle_handover(&mut rec)?;
        match &rec.handover {
            Some(h) if h.target != target => Ok(()),
            Some(h) if h.sandbox != req.sandbox_id => Err(HandoverError::WrongSandbox {
                volume: rec.id.clone(),
                holder: h.sandbox.clone(),
                caller: req.sandbox_id.clone(),
            }),
            Some(_) => self.take_back(&mut rec, None),
            None => Ok(()),
        }
    }

    /// The volume published at `target`, or whose handover names it.
    fn volume_at(&self, target: &Path) -> Option<String> {
        self.state.volume_at(target)
    }

    /// Everything that decides whether `rec` may go to the asking guest;
    /// changes nothing.
    fn may_hand_over(&self, rec: &VolumeRecord, ask: &Ask) -> std::result::Result<(), Decline> {
        let id = &rec.id;
        let t = ask.target.display();
        let Some(p) = rec.published.get(&ask.target) else {
            return Err(not_published(&ask.target));
        };
        let Some(s) = &rec.staging else {
            return Err(not_published(&ask.target));
        };
        if p.block || s.block {
            return Err(Decline::new(
                Reason::RawBlock,
                format!("volume {id} is published at {t} as raw block: no filesystem to hand over"),
            ));
        }
        if !self.cfg.deferral.enabled {
            return Err(Decline::new(
                Reason::DeferralDisabled,
                "the plugin runs with --deferral disabled",
            ));
        }
        if DeferMode::of(rec) == DeferMode::Never {
            return Err(Decline::new(
                Reason::DeferralDisabled,
                format!("volume {id}'s StorageClass says deferFsOps=false"),
            ));
        }
        if !self.ops.has_crust_layout() {
            return Err(Decline::new(
                Reason::DeferralDisabled,
                "a handover needs the CRUST hand-off layout (--handoff-layout crust or both)",
            ));
        }
        if p.deferred && !p.handed_over {
            return Err(Decline::new(
                Reason::DeferralDisabled,
                format!(
                    "volume {id} is published at {t} with deferred filesystem operations: its \
                     hand-off record is already there for the runtime"
                ),
            ));
        }
        if rec.published.len() > 1 {
            let all: Vec<String> = rec
                .published
                .keys()
                .map(|k| k.display().to_string())
                .collect();
            return Err(Decline::new(
                Reason::MultipleTargets,
                format!(
                    "volume {id} is published at {} targets ({}): a volume published more than \
                     once is never handed over",
                    all.len(),
                    all.join(", ")
                ),
            ));
        }
        self.guest_can_mount(rec, p, ask)?;
        wait_out_transient(
            |d: &Decline| d.reason == Reason::InUseElsewhere,
            || {
                let binds = kubelet_binds(&ask.target, &s.device)?;
                let mut allowed = vec![s.path.as_path(), ask.target.as_path()];
                allowed.extend(binds.iter().map(|b| b.mount_point.as_path()));
                mounted_only_at(&s.device, &allowed)?;
                no_host_users(&s.device)
            },
        )
    }

    /// The runtime's declared capabilities and filesystems cover the
    /// volume.
    fn guest_can_mount(
        &self,
        rec: &VolumeRecord,
        p: &Publication,
        ask: &Ask,
    ) -> std::result::Result<(), Decline> {
        let s = rec.staging.as_ref().expect("checked by the caller");
        let missing = |what: &str| {
            Decline::new(
                Reason::MissingCapability,
                format!("the runtime does not declare {what}"),
            )
        };
        for (cap, what) in [
            (
                Cap::VolumeStats,
                "VOLUME_STATS (kubelet's NodeGetVolumeStats)",
            ),
            (
                Cap::VolumeResize,
                "VOLUME_RESIZE (kubelet's NodeExpandVolume)",
            ),
        ] {
            if !ask.caps.contains(&cap) {
                return Err(missing(what));
            }
        }
        if p.supplemental_group.is_some() {
            let cap = match p.supplemental_group_change_policy.as_deref() {
                Some("OnRootMismatch") => Cap::FsGroupChangePolicyRootMismatch,
                _ => Cap::FsGroupChangePolicyAlways,
            };
            if !ask.caps.contains(&cap) {
                return Err(missing(&format!(
                    "{} (the volume has an fsGroup)",
                    cap.as_str_name()
                )));
            }
        }
        let fs = s.fs_type.unwrap_or(rec.fs_type);
        let Some(support) = ask.file_systems.iter().find(|f| f.fs_type == fs.as_str()) else {
            return Err(Decline::new(
                Reason::UnsupportedFilesystem,
                format!("the guest does not mount {fs} (volume {})", rec.id),
            ));
        };
        if s.mount_options.is_empty() && !s.flags_digest.is_empty() {
            return Err(Decline::new(
                Reason::UnsupportedMountOption,
                format!(
                    "volume {} was staged before handovers existed and its mount options are \
                     not recorded; stage it again",
                    rec.id
                ),
            ));
        }
        for o in &s.mount_options {
            let key = crust_fs::options::option_key(o);
            if !matches!(key, "ro" | "rw") && !support.mount_options.iter().any(|k| k == key) {
                return Err(Decline::new(
                    Reason::UnsupportedMountOption,
                    format!(
                        "the guest does not accept mount option {} of volume {}",
                        crust_fs::quote(key),
                        rec.id
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Steps 1–5 of the module doc; any failure rolls back.
    fn move_to_guest(&self, rec: &mut VolumeRecord, ask: &Ask) -> Result<pb::HandOverResponse> {
        let started = std::time::Instant::now();
        let target = ask.target.clone();
        let s = rec.staging.clone().expect("checked");
        let host_mounted = mounted_here(&s.device, &s.path)?;
        let subpath_binds = match kubelet_binds(&target, &s.device) {
            Ok(b) => b,
            Err(d) if ask.required => return Err(HandoverError::Required(d.message)),
            Err(d) => return Ok(d.answer()),
        };
        rec.handover = Some(HandoverRecord {
            target: target.clone(),
            sandbox: ask.sandbox.clone(),
            runtime_cli: ask.runtime_cli.clone(),
            phase: HandoverPhase::Preparing,
            host_mounted,
            subpath_binds,
        });
        self.state.put(rec.clone())?;
        self.handover_fault(HandoverStep::Recorded);
        let res = self
            .take_host_mounts(rec, &target)
            .and_then(|()| self.write_claimed_record(rec, ask));
        if let Err(e) = res {
            self.roll_back(rec)?;
            return match e {
                HandoverError::Node(NodeError::Ops(crust_ops::OpsError::DeviceInUse {
                    detail,
                    ..
                })) if !ask.required => Ok(Decline::new(Reason::InUseElsewhere, detail).answer()),
                // A user that came after the check (or one it cannot
                // see): never a lazy unmount, the host keeps the volume.
                HandoverError::Node(NodeError::MountRefused(m))
                    if matches!(*m, crust_blockdev::MountError::Busy { .. }) =>
                {
                    let mut why = format!("{m}: the host mounts were restored");
                    if let Err(d) = no_host_users(&s.device) {
                        why = format!("{why}; {}", d.message);
                    }
                    if ask.required {
                        Err(HandoverError::Required(why))
                    } else {
                        Ok(Decline::new(Reason::InUseElsewhere, why).answer())
                    }
                }
                e => Err(e),
            };
        }
        self.handover_fault(HandoverStep::RecordWritten);
        self.roll_forward(rec)?;
        tracing::info!(volume = %rec.id, target = %target.display(), sandbox = %ask.sandbox,
            elapsed_ms = started.elapsed().as_millis() as u64, "volume handed over to a sandbox");
        self.handed_over_answer(rec, &target)
    }

    /// Steps 2–3: kubelet's subPath binds, the target bind and the
    /// staging mount go, synced.
    fn take_host_mounts(&self, rec: &mut VolumeRecord, target: &Path) -> Result<()> {
        let mut s = rec.staging.clone().expect("checked");
        let binds = rec
            .handover
            .as_ref()
            .map(|h| h.subpath_binds.clone())
            .unwrap_or_default();
        for b in &binds {
            if mounted_of(&s.device, &b.mount_point)? {
                sync_and_unmount(&b.mount_point)?;
            }
        }
        if crust_blockdev::is_mountpoint(target).map_err(mount_err)? {
            if publication_of(&s, target) {
                sync_and_unmount(target)?;
            } else if !crate::placeholder::is_mounted(target) {
                return Err(NodeError::TargetHoldsOther {
                    volume: rec.id.clone(),
                    field: "target",
                    target: target.to_path_buf(),
                    nothing_done: "",
                }
                .into());
            }
        }
        self.handover_fault(HandoverStep::TargetUnmounted);
        if mounted_here(&s.device, &s.path)? {
            sync_and_unmount(&s.path)?;
        }
        s.host_mount = HostMount::UnmountedForDeferral;
        rec.staging = Some(s);
        self.handover_fault(HandoverStep::StagingUnmounted);
        Ok(())
    }

    /// Step 4: the hand-off record, claimed by the sandbox before it
    /// becomes visible; the device is checked free (nobody mounted it in
    /// another namespace meanwhile).
    fn write_claimed_record(&self, rec: &VolumeRecord, ask: &Ask) -> Result<()> {
        let s = rec.staging.as_ref().expect("checked");
        let p = rec.published.get(&ask.target).expect("checked");
        let fs = s.fs_type.unwrap_or(rec.fs_type);
        let mut flags = s.mount_options.clone();
        if (p.readonly || s.readonly) && !flags.iter().any(|f| f == "ro") {
            flags.push("ro".into());
        }
        let req = StageRequest {
            target_path: utf8(&ask.target)?.to_string(),
            device: utf8(&s.device)?.to_string(),
            fs_type: fs.as_str().to_string(),
            mount_flags: flags,
            fs_group: p.supplemental_group,
            fs_group_change_policy: p
                .supplemental_group_change_policy
                .as_deref()
                .and_then(|v| crust_handoff::FsGroupChangePolicy::parse(v).ok()),
            io_limits: rec.io_limits,
        };
        wait_out_transient(
            |e| matches!(e, crust_ops::OpsError::DeviceInUse { .. }),
            || {
                self.ops
                    .stage_claimed(req.clone(), &ask.sandbox, &ask.runtime_cli)
            },
        )
        .map_err(|e| HandoverError::Node(e.into()))
    }

    /// Step 5 and done: the placeholder, then the records say the guest
    /// has the volume. Idempotent (repair uses it).
    fn roll_forward(&self, rec: &mut VolumeRecord) -> Result<()> {
        let h = rec.handover.clone().expect("a handover");
        let target = h.target.clone();
        crate::placeholder::mount(
            &target,
            &rec.id,
            &format!(
                "Its filesystem was handed to sandbox {} (a VM runtime), which mounts it \
                 inside its guest.",
                h.sandbox
            ),
        )
        .map_err(|e| NodeError::Internal(e.to_string()))?;
        for b in &h.subpath_binds {
            subpath_binds::bind_placeholder(&target, b).map_err(|e| {
                NodeError::Internal(format!("binding the placeholder for kubelet: {e}"))
            })?;
        }
        self.handover_fault(HandoverStep::PlaceholderMounted);
        if let Some(s) = rec.staging.as_mut() {
            s.host_mount = HostMount::UnmountedForDeferral;
        }
        if let Some(p) = rec.published.get_mut(&target) {
            p.deferred = true;
            p.handed_over = true;
        }
        rec.handover = Some(HandoverRecord {
            phase: HandoverPhase::HandedOver,
            ..h
        });
        self.state.put(rec.clone())?;
        self.health.forget(&rec.id);
        Ok(())
    }

    /// Undoes an unfinished handover: the partial record goes, the host
    /// mounts that were there come back (no check: no guest could have
    /// had the device).
    fn roll_back(&self, rec: &mut VolumeRecord) -> Result<()> {
        let Some(h) = rec.handover.clone() else {
            return Ok(());
        };
        let target_str = utf8(&h.target)?.to_string();
        if !self
            .ops
            .discard_partial(&target_str)
            .map_err(NodeError::from)?
        {
            // A complete record: the sandbox has it; never roll back then.
            return self.roll_forward(rec);
        }
        let mut s = rec.staging.clone().expect("a staged volume");
        if h.host_mounted {
            if !mounted_here(&s.device, &s.path)? {
                crust_blockdev::ensure_no_other_openers(&s.device, crust_blockdev::fs::MOUNT)
                    .map_err(|e| crate::error::fs_err("checking for other openers", e))?;
                let fs = s.fs_type.unwrap_or(rec.fs_type);
                crust_blockdev::mount_fs(&s.device, &s.path, fs, &s.mount_options, s.readonly)
                    .map_err(mount_err)?;
            }
            s.host_mount = HostMount::Mounted;
            if let Some(p) = rec.published.get(&h.target)
                && !p.handed_over
            {
                crate::placeholder::remove(&h.target)
                    .map_err(|e| NodeError::Internal(e.to_string()))?;
                crust_blockdev::bind_mount(&s.path, &h.target, p.readonly).map_err(mount_err)?;
                // Without them kubelet's containers would see empty host
                // directories: a failure keeps the handover to retry.
                for b in &h.subpath_binds {
                    subpath_binds::restore(&s.path, b).map_err(|e| {
                        NodeError::Internal(format!("restoring kubelet's bind: {e}"))
                    })?;
                }
            }
            rec.staging = Some(s);
        }
        rec.handover = None;
        self.state.put(rec.clone())?;
        self.health.forget(&rec.id);
        tracing::warn!(volume = %rec.id, target = %h.target.display(), sandbox = %h.sandbox,
            "unfinished handover rolled back: the host mounts are as before");
        Ok(())
    }

    /// Finishes what a crashed handover left (the module doc's table).
    pub(crate) fn settle_handover(&self, rec: &mut VolumeRecord) -> Result<()> {
        match &rec.handover {
            Some(h) if h.phase == HandoverPhase::Preparing => {
                let claimed = h.target.to_str().is_some_and(|t| {
                    self.ops.complete_record_claimant(t).as_deref() == Some(&h.sandbox)
                });
                if claimed {
                    tracing::warn!(volume = %rec.id, sandbox = %h.sandbox,
                        "a handover interrupted after its record was written: finishing it");
                    self.roll_forward(rec)
                } else {
                    self.roll_back(rec)
                }
            }
            _ => Ok(()),
        }
    }

    /// Takes a handed-over volume back without mounting it: the record
    /// is unclaimed (hand-back) or its claimant is shown stopped (a dead
    /// runtime: crust_ops asks its typed `sandbox-state`), and the device
    /// is free. `for_sandbox`: another sandbox asks for the volume.
    pub(crate) fn take_back(
        &self,
        rec: &mut VolumeRecord,
        for_sandbox: Option<&str>,
    ) -> Result<()> {
        let Some(h) = rec.handover.clone() else {
            return Ok(());
        };
        let target = utf8(&h.target)?.to_string();
        let held = |detail: String| HandoverError::HeldBySandbox {
            volume: rec.id.clone(),
            sandbox: h.sandbox.clone(),
            detail,
        };
        let claimant = self.ops.crust_claimant(&target);
        if claimant.is_none() {
            // Unclaimed: the runtime let go; the device must be free too
            // (a QEMU that outlived its runtime still has it open).
            let s = rec.staging.as_ref().expect("a staged volume");
            device_released(&s.device).map_err(&held)?;
        }
        if let Err(e) = self.ops.unstage(&target) {
            return Err(match e {
                crust_ops::OpsError::StillClaimed { detail, .. } => held(match for_sandbox {
                    Some(other) => format!("{detail}; sandbox {other} cannot have it"),
                    None => detail,
                }),
                e => HandoverError::Node(e.into()),
            });
        }
        if let Some(p) = rec.published.get_mut(&h.target) {
            p.deferred = false;
        }
        rec.handover = None;
        rec.returned = Some(Returned::now(&h.sandbox));
        self.state.put(rec.clone())?;
        self.health.forget(&rec.id);
        tracing::info!(volume = %rec.id, sandbox = %h.sandbox, target = %target,
            "volume returned from its sandbox (not mounted on the host)");
        Ok(())
    }

    /// A handed-over publication's NodeUnpublishVolume: the volume comes
    /// back first if it still is with a guest (FAILED_PRECONDITION while
    /// that sandbox runs); then the placeholder and the empty target go.
    pub(crate) fn unpublish_handed_over(
        &self,
        mut rec: VolumeRecord,
        target: &Path,
    ) -> std::result::Result<(), NodeError> {
        self.settle_handover(&mut rec).map_err(into_node)?;
        if rec.handover.as_ref().is_some_and(|h| h.target == target) {
            self.take_back(&mut rec, None).map_err(into_node)?;
        }
        crate::placeholder::remove(target).map_err(|e| NodeError::Internal(e.to_string()))?;
        if crust_blockdev::is_mountpoint(target).unwrap_or(false) {
            return Err(NodeError::TargetHoldsOther {
                volume: rec.id.clone(),
                field: "target_path",
                target: target.to_path_buf(),
                nothing_done: "; nothing was unmounted",
            });
        }
        crate::node::remove_created_target(&mut rec, target);
        rec.published.remove(target);
        self.state.put(rec.clone())?;
        self.health.forget(&rec.id);
        tracing::info!(volume = %rec.id, target = %target.display(), "handed-over publication removed");
        Ok(())
    }

    /// At start: finish or undo interrupted handovers, and take back
    /// volumes whose sandbox is gone. Logs only on failure.
    pub(crate) fn repair_handovers(&self) {
        for r in self.state.all() {
            if r.handover.is_none() {
                continue;
            }
            let Ok(_g) = self.guards.try_begin(&r.id, "repair") else {
                continue;
            };
            let mut rec = r;
            if let Err(e) = self.settle_handover(&mut rec) {
                tracing::error!(volume = %rec.id, error = %e, "cannot repair an interrupted handover");
                continue;
            }
            if rec.handover.is_some() {
                match self.take_back(&mut rec, None) {
                    Ok(()) => {}
                    Err(HandoverError::HeldBySandbox { .. }) => {}
                    Err(e) => {
                        tracing::warn!(volume = %rec.id, error = %e, "cannot check a handed-over volume")
                    }
                }
            }
        }
    }

    /// What the runtime needs, from the record now on disk.
    fn handed_over_answer(
        &self,
        rec: &VolumeRecord,
        target: &Path,
    ) -> Result<pb::HandOverResponse> {
        if !self.ops.has_crust_layout() {
            return Err(
                NodeError::Internal("the CRUST hand-off layout is not configured".into()).into(),
            );
        }
        let mi = self
            .ops
            .crust_record(utf8(target)?)
            .map_err(NodeError::Ops)?;
        let readonly = mi.options.iter().any(|o| o == "ro");
        Ok(pb::HandOverResponse {
            outcome: Some(pb::hand_over_response::Outcome::HandedOver(
                pb::HandedOver {
                    volume_id: rec.id.clone(),
                    fs_group: mi.fs_group().map(|g| g.to_string()).unwrap_or_default(),
                    fs_group_change_policy: mi
                        .fs_group_change_policy()
                        .map(|p| p.as_str().to_string())
                        .unwrap_or_default(),
                    device: mi.device,
                    fs_type: mi.fstype,
                    mount_options: mi.options,
                    readonly,
                },
            )),
        })
    }

    fn handover_fault(&self, at: HandoverStep) {
        if self.cfg.hooks.handover_crash == Some(at) {
            tracing::error!(step = at.as_str(), "test fault: the plugin dies here");
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        }
    }
}

impl HandoverParts<'_> {
    /// Before the host kernel mounts a filesystem that a guest had raw
    /// access to (`rec.returned`): a userspace check must pass, and the
    /// mount gets `nosuid,nodev` whatever the capability asked. Returns
    /// the flags to mount with. A volume no guest had: `flags` unchanged.
    pub(crate) fn check_after_guest(
        &self,
        rec: &VolumeRecord,
        device: &Path,
        fs: crate::caps::FsType,
        flags: Vec<String>,
    ) -> std::result::Result<Vec<String>, NodeError> {
        let Some(r) = &rec.returned else {
            return Ok(flags);
        };
        crust_blockdev::check_unmounted(device, fs).map_err(|e| match e {
            e @ crust_blockdev::FsError::CheckFailed { .. } => NodeError::ReturnedFsDamaged {
                volume: rec.id.clone(),
                sandbox: r.sandbox.clone(),
                cause: Box::new(e),
            },
            e => crate::error::fs_err("checking the filesystem", e),
        })?;
        let mut words = crust_fs::options::parse(fs, &flags, false)
            .map(|p| p.words)
            .map_err(|e| NodeError::InvalidArgument(e.to_string()))?;
        words.retain(|w| w != "suid" && w != "dev");
        Ok(words)
    }
}

fn not_published(target: &Path) -> Decline {
    Decline::new(
        Reason::NotPublished,
        format!(
            "no volume of this plugin is published at {}",
            target.display()
        ),
    )
}

fn into_node(e: HandoverError) -> NodeError {
    match e {
        HandoverError::Node(n) => n,
        HandoverError::State(s) => NodeError::State(s),
        HandoverError::Busy(b) => NodeError::Busy(b),
        e => NodeError::Handover(Box::new(e)),
    }
}

/// How long a handover waits for the device's other holders to go before
/// it declines. A process that creates a mount namespace (a container, a
/// sandboxed virtiofsd starting) holds a copy of every host mount, the
/// staging one included, until it pivots away from them: milliseconds
/// that must not send a pod to virtio-fs for its whole life.
const TRANSIENT_HOLDER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
const TRANSIENT_HOLDER_STEP: std::time::Duration = std::time::Duration::from_millis(50);

/// `check` again while its error says the device is held (`in_use`), for
/// up to [`TRANSIENT_HOLDER_WAIT`].
fn wait_out_transient<T, E>(
    in_use: impl Fn(&E) -> bool,
    mut check: impl FnMut() -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    let until = std::time::Instant::now() + TRANSIENT_HOLDER_WAIT;
    loop {
        match check() {
            Err(e) if in_use(&e) && std::time::Instant::now() < until => {
                std::thread::sleep(TRANSIENT_HOLDER_STEP);
            }
            r => return r,
        }
    }
}

/// The device is mounted only at `allowed` (in any mount namespace this
/// process sees) and no process has it open.
fn mounted_only_at(device: &Path, allowed: &[&Path]) -> std::result::Result<(), Decline> {
    let in_use = |m: String| Decline::new(Reason::InUseElsewhere, m);
    let (major, minor) = crust_blockdev::device_major_minor(device)
        .map_err(|e| in_use(format!("cannot read device {}: {e}", device.display())))?;
    if let Some((point, pid)) = crust_blockdev::mounts_everywhere_of(major, minor)
        .into_iter()
        .find(|(point, _)| !allowed.contains(&point.as_path()))
    {
        return Err(in_use(format!(
            "device {} is also mounted at {} (mount namespace of pid {pid}; a container \
             using the volume?)",
            device.display(),
            point.display()
        )));
    }
    match crust_blockdev::device_openers(device) {
        Ok(o) if o.is_empty() => Ok(()),
        Ok(o) => Err(in_use(format!(
            "device {} is open by {}",
            device.display(),
            o[0]
        ))),
        Err(e) => Err(in_use(format!(
            "cannot tell who has device {} open: {e}",
            device.display()
        ))),
    }
}

/// kubelet's subPath binds of the volume published at `target`; a
/// mount table that cannot be read declines.
fn kubelet_binds(target: &Path, device: &Path) -> std::result::Result<Vec<SubpathBind>, Decline> {
    subpath_binds::of(target, device).map_err(|e| {
        Decline::new(
            Reason::InUseElsewhere,
            format!(
                "cannot list kubelet's subPath binds of {}: {e}",
                target.display()
            ),
        )
    })
}

/// Whether the topmost mount at `path` is of `device`'s filesystem (any
/// root: a subPath bind shows a directory of it).
fn mounted_of(device: &Path, path: &Path) -> Result<bool> {
    let Some(m) = crust_blockdev::find_mount(path).map_err(mount_err)? else {
        return Ok(false);
    };
    Ok(crust_blockdev::device_major_minor(device).ok() == Some((m.major, m.minor)))
}

/// No host process works inside the device's filesystem (a working
/// directory, an open file, a mapping): the unmounts of a handover would
/// answer EBUSY. Names the first few.
fn no_host_users(device: &Path) -> std::result::Result<(), Decline> {
    let in_use = |m: String| Decline::new(Reason::InUseElsewhere, m);
    match crust_blockdev::filesystem_users(device) {
        Ok(u) if u.is_empty() => Ok(()),
        Ok(u) => Err(in_use(format!(
            "the filesystem of device {} is in use on the host: {}{}",
            device.display(),
            u.iter()
                .take(3)
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            if u.len() > 3 { ", …" } else { "" }
        ))),
        Err(e) => Err(in_use(format!(
            "cannot tell who uses the filesystem of device {}: {e}",
            device.display()
        ))),
    }
}

/// Nobody holds the device: no mount, no exclusive holder (the runtime's
/// hold), no process with it open (QEMU).
fn device_released(device: &Path) -> std::result::Result<(), String> {
    crust_blockdev::ensure_released(device, "take it back").map_err(|e| e.to_string())?;
    match crust_blockdev::device_openers(device) {
        Ok(o) if o.is_empty() => Ok(()),
        Ok(o) => Err(format!(
            "device {} is still open by {}",
            device.display(),
            o[0]
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// The tonic Handover service.
#[derive(Clone)]
pub struct HandoverService {
    driver: std::sync::Arc<Driver>,
}

impl HandoverService {
    pub fn new(driver: std::sync::Arc<Driver>) -> Self {
        HandoverService { driver }
    }
}

/// Only root may ask (the socket is 0600 already; this also holds when
/// the file mode is changed by hand).
fn require_root<T>(req: &Request<T>) -> Result<()> {
    let uid = req
        .extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|i| i.peer_cred)
        .map(|c| c.uid());
    match uid {
        Some(0) | None => Ok(()),
        Some(u) => Err(HandoverError::NotRoot(u)),
    }
}

#[tonic::async_trait]
impl pb::handover_server::Handover for HandoverService {
    async fn hand_over(
        &self,
        request: Request<pb::HandOverRequest>,
    ) -> std::result::Result<Response<pb::HandOverResponse>, Status> {
        require_root(&request)?;
        let req = request.into_inner();
        let resp =
            crate::driver::blocking(&self.driver, move |d| d.handover().hand_over(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn hand_back(
        &self,
        request: Request<pb::HandBackRequest>,
    ) -> std::result::Result<Response<pb::HandBackResponse>, Status> {
        require_root(&request)?;
        let req = request.into_inner();
        crate::driver::blocking(&self.driver, move |d| d.handover().hand_back(&req)).await?;
        Ok(Response::new(pb::HandBackResponse {}))
    }
}
