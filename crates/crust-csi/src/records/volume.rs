//! The volume record (`<state-dir>/volumes/<volume-id>.json`, stored by
//! `crate::state`) and its parts.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crust_handoff::IoLimits;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{HandoverRecord, Inherited, Returned, SourceRecord};
use crate::caps::{AccessMode, CapSpec, FsType, hex};

/// Volume parameter (copied into the volume context) that selects
/// deferred filesystem operations: `auto` (default), `true`, `false`.
pub const DEFER_CONTEXT_KEY: &str = "deferFsOps";

/// Record format version.
pub const RECORD_VERSION: u32 = 1;
/// Lifecycle of a volume record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Written before the backend allocates; never reported to the CO.
    /// A retried CreateVolume finishes (or replaces) it.
    Creating,
    /// CreateVolume returned it.
    Ready,
}

/// Where and how the volume is staged on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staging {
    pub path: PathBuf,
    pub device: PathBuf,
    pub block: bool,
    /// Filesystem mounted at `path` (None for block).
    pub fs_type: Option<FsType>,
    /// Mounted read-only (SINGLE_NODE_READER_ONLY).
    pub readonly: bool,
    pub mode: AccessMode,
    /// Digest of the mount flags, to recognise an identical repeat.
    #[serde(default)]
    pub flags_digest: String,
    /// Staged with deferred filesystem operations (volume context
    /// `deferFsOps=true`): attached and formatted, never mounted here.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deferred: bool,
    /// Whether the filesystem is mounted at `path` on the host (records
    /// written before deferral existed say nothing: mounted).
    #[serde(default, skip_serializing_if = "HostMount::is_mounted")]
    pub host_mount: HostMount,
    /// The mount options of the filesystem, as the one allow-list
    /// (`crust-fs`) normalized them (one option per entry). Only options
    /// that passed the list are kept, and the list has none that carries a
    /// secret; a handover gives them to the guest. Empty for records
    /// written before handovers existed (then only `flags_digest` says
    /// whether there were any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mount_options: Vec<String>,
}

/// Whether a staged filesystem is mounted on the host. A filesystem
/// mounted by the host and by a guest at once is corrupted (two kernels
/// caching one filesystem), so a volume published with deferral is never
/// mounted on the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostMount {
    /// Mounted at the staging path (standard CSI; raw block: nothing to
    /// mount).
    #[default]
    Mounted,
    /// Not mounted on the host so that a guest can mount it: a deferred
    /// stage (never mounted), or a host mount that a deferred publication
    /// removed. A later host publication mounts it again.
    UnmountedForDeferral,
}

impl HostMount {
    pub fn is_mounted(&self) -> bool {
        *self == HostMount::Mounted
    }
}

/// One publish target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publication {
    pub block: bool,
    pub readonly: bool,
    pub mode: AccessMode,
    #[serde(default)]
    pub flags_digest: String,
    /// Published with deferred filesystem operations: the target is an
    /// empty directory and a hand-off record tells the pod's runtime how
    /// to mount the volume in its guest.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deferred: bool,
    /// fsGroup: KEP-2857's `volume_supplemental_group` (deferred
    /// publications), or kubelet's `volume_mount_group` (VOLUME_MOUNT_GROUP:
    /// applied on the host mount, or handed to the runtime with the volume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supplemental_group: Option<u32>,
    /// fsGroupChangePolicy handed to the runtime (`Always` | `OnRootMismatch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supplemental_group_change_policy: Option<String>,
    /// Records written before [`VolumeRecord::created_targets`]: the
    /// plugin created this target. Read, never set any more.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub created_target: bool,
    /// A host publication whose filesystem a VM runtime took by handover
    /// (see `handover.rs`): its bind is gone and the target holds the
    /// placeholder. While the guest has the volume the
    /// publication is also `deferred`; after the hand-back only this flag
    /// stays, until NodeUnpublishVolume.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub handed_over: bool,
}

impl Publication {
    /// A host publication (bind mount).
    pub fn host(block: bool, readonly: bool, mode: AccessMode, flags_digest: String) -> Self {
        Publication {
            block,
            readonly,
            mode,
            flags_digest,
            deferred: false,
            supplemental_group: None,
            supplemental_group_change_policy: None,
            created_target: false,
            handed_over: false,
        }
    }
}

/// Everything the plugin knows about one volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub version: u32,
    pub id: String,
    pub name: String,
    pub phase: Phase,
    pub capacity_bytes: u64,
    /// The range CreateVolume asked for (0 = unset), to answer a retry.
    pub required_bytes: u64,
    pub limit_bytes: u64,
    /// Filesystem created on first mount-staging.
    pub fs_type: FsType,
    /// CreateVolume parameters minus the ignored `csi.storage.k8s.io/*`.
    pub parameters: BTreeMap<String, String>,
    pub capabilities: Vec<CapSpec>,
    /// The node that owns the volume (topology segment).
    pub node_id: String,
    pub staging: Option<Staging>,
    /// Publish targets, by path.
    pub published: BTreeMap<PathBuf, Publication>,
    /// The volume was staged as raw block at least once: its data may have
    /// no signature any probe can see, so it is never formatted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub raw_block_used: bool,
    /// The filesystem crust created on the volume (a volume crust already
    /// formatted is never formatted again, even if it looks blank now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub formatted: Option<FsType>,
    /// Recorded before crust runs mkfs on the (blank) volume: a stage
    /// killed mid-format finds its own half-made filesystem and redoes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format_started: Option<FsType>,
    /// What the volume was filled from (CreateVolume's content source).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_source: Option<SourceRecord>,
    /// A copy's source and the history its data came with
    /// ([`crate::history`]): what decides whether the copy may be
    /// formatted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inherited: Option<Inherited>,
    /// A handover to a VM runtime in progress or in force (`handover.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover: Option<HandoverRecord>,
    /// A guest had raw access to the filesystem (a handover, or a deferred
    /// publication, ended): the host mounts it again only for a host
    /// publication, only after a userspace check passes, and with
    /// `nosuid,nodev`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub returned: Option<Returned>,
    /// Publish targets the plugin created. A target is listed (the record
    /// written atomically) BEFORE the plugin creates it, and forgotten
    /// once removed, so an unpublish removes exactly what the plugin
    /// created, also after a publish killed between creating the target
    /// and recording its publication; a file or directory a CO or a user
    /// put there is never removed.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub created_targets: BTreeSet<PathBuf>,
    /// I/O limits (CreateVolume's and ControllerModifyVolume's mutable
    /// parameters, merged): put in every hand-off record the plugin writes
    /// for the volume, applied by a guest's runtime (README, "Live QoS").
    #[serde(default, skip_serializing_if = "IoLimits::is_unlimited")]
    pub io_limits: IoLimits,
    /// When the latest ControllerModifyVolume was issued (Unix ms: a
    /// passed request's sender clock, or this node's for its own door). A
    /// request passed from another node issued no later is refused, so a
    /// delayed or replayed one never undoes a newer change (crate::peer).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub limits_issued_ms: i64,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

impl VolumeRecord {
    pub fn is_block_only(&self) -> bool {
        !self.capabilities.is_empty() && self.capabilities.iter().all(|c| c.access.is_block())
    }

    pub fn allows_block(&self) -> bool {
        self.capabilities.iter().any(|c| c.access.is_block())
    }

    pub fn allows_mount(&self) -> bool {
        self.capabilities.iter().any(|c| !c.access.is_block())
    }

    /// The publication with deferred filesystem operations, if any (at
    /// most one: one sandbox at a time).
    pub fn deferred_publication(&self) -> Option<(&PathBuf, &Publication)> {
        self.published.iter().find(|(_, p)| p.deferred)
    }

    /// Whether the plugin recorded creating the publish target `t`.
    pub fn created_target(&self, t: &Path) -> bool {
        self.created_targets.contains(t) || self.published.get(t).is_some_and(|p| p.created_target)
    }

    /// Forgets that the plugin created `t`; returns whether it had.
    pub fn forget_created_target(&mut self, t: &Path) -> bool {
        let listed = self.created_targets.remove(t);
        let legacy = self
            .published
            .get_mut(t)
            .is_some_and(|p| std::mem::take(&mut p.created_target));
        listed || legacy
    }

    /// Publications bind-mounted on the host (a handed-over one is not:
    /// its target holds the placeholder).
    pub fn host_publications(&self) -> impl Iterator<Item = (&PathBuf, &Publication)> {
        self.published
            .iter()
            .filter(|(_, p)| !p.deferred && !p.handed_over)
    }
}

/// Volume id for a CreateVolume name: `vol-` + the first 32 hex digits of
/// sha256(name). Deterministic, so a retried CreateVolume maps to the same
/// volume even across restarts, and safe as a file name.
pub fn volume_id_for(name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    format!("vol-{}", hex(&digest[..16]))
}

/// Whether `id` has the shape of an id this plugin issues.
pub fn is_valid_volume_id(id: &str) -> bool {
    id.len() == 36
        && id.starts_with("vol-")
        && id[4..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}
