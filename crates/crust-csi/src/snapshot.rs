//! Snapshots, clones and group snapshots (CREATE_DELETE_SNAPSHOT,
//! LIST_SNAPSHOTS, GET_SNAPSHOT, CLONE_VOLUME and the GroupController's
//! CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT) on backends that copy (the
//! pool: reflink or hole-preserving copy, see `crust_backend`).
//!
//! * Ids are derived from names (`snap-`/`group-` + 32 hex digits of
//!   sha256), so a retried create finds its snapshot after a restart;
//!   group members are `snap-` + hash of (group id, volume id).
//! * Snapshots are independent of their source: deleting a volume keeps
//!   its snapshots usable (the spec's preferred behaviour), so DeleteVolume
//!   never fails because of them.
//! * Consistency (`SnapshotParts::quiesce`): a filesystem mounted on the host is
//!   frozen (FIFREEZE) around the copy, with a deadline and a guaranteed
//!   thaw; a volume published with deferral and consumed by a sandbox is
//!   frozen inside that guest (crust_ops → `<runtime-cli> crust freeze`
//!   → shim → agent FIFREEZE, thawed by the agent itself after the same
//!   time limit; a runtime without `crust freeze`, e.g. Kata's, is
//!   FAILED_PRECONDITION), and the copy counts only if the thaw confirms
//!   the volume stayed frozen (a guest that died meanwhile fails the
//!   snapshot); an attached raw device
//!   is flushed and copied as is (crash-consistent at best, like pulling
//!   the plug); a volume used by nobody needs nothing. A group's members
//!   are all quiesced before the first copy and released after the last,
//!   so the group is write-order consistent across volumes.
//! * Every operation holds its volumes' operation guards (ABORTED while
//!   another operation runs on one of them).

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use crust_backend::{BackendError, ContentSource, SnapshotInfo};
use crust_proto::csi::v1 as csi;
use sha2::{Digest, Sha256};

use crate::controller::ready_record;
use crate::driver::SnapshotParts;
use crate::error::{ControllerError, SnapshotError};
use crate::guard::OpGuard;
use crate::paging::{decode_token_of, encode_token};
use crate::records::History;
use crate::records::{HostMount, VolumeRecord};

type Result<T, E = ControllerError> = std::result::Result<T, E>;

/// How long a FIFREEZE may take before the snapshot fails.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a filesystem stays frozen; past it the copy is not consistent
/// and the snapshot fails (writers on the node are not held longer).
const MAX_FROZEN: Duration = Duration::from_secs(60);

fn hashed(prefix: &str, parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            h.update([0u8]);
        }
        h.update(p.as_bytes());
    }
    let d = h.finalize();
    let hex: String = d[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{hex}")
}

/// The snapshot id of a CreateSnapshot `name`.
pub fn snapshot_id_for(name: &str) -> String {
    hashed("snap", &[name])
}

/// The group snapshot id of a CreateVolumeGroupSnapshot `name`.
pub fn group_id_for(name: &str) -> String {
    hashed("group", &[name])
}

/// Whether `id` has the shape of a snapshot id this plugin issues.
fn is_snapshot_id(id: &str) -> bool {
    id.len() == 37
        && id.starts_with("snap-")
        && id[5..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// What a copy of `rec` inherits: its history, or `None` when that is
/// unknown itself (a copy of unknown history).
fn known_history(rec: &VolumeRecord) -> Option<History> {
    rec.history_known().then(|| rec.history())
}

fn member_id(group_id: &str, volume_id: &str) -> String {
    hashed("snap", &[group_id, volume_id])
}

/// Only the parameters the external-snapshotter adds are accepted.
fn check_parameters(params: &HashMap<String, String>) -> Result<()> {
    match params
        .keys()
        .find(|k| !k.starts_with("csi.storage.k8s.io/"))
    {
        Some(k) => Err(ControllerError::InvalidArgument(format!(
            "unknown snapshot parameter {}; this plugin takes none",
            shown(k)
        ))),
        None => Ok(()),
    }
}

/// A caller's string as error messages show it: control characters
/// escaped, at most 128 characters.
fn shown(s: &str) -> String {
    let mut out: String = s.chars().take(128).flat_map(char::escape_debug).collect();
    if s.chars().count() > 128 {
        out.push('…');
    }
    out
}

fn timestamp(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
    }
}

/// What makes one volume consistent while it is copied; released on drop
/// (a host freeze) or by `SnapshotParts::release` (a guest freeze).
enum Quiesced {
    Frozen(crust_blockdev::Frozen),
    /// Frozen inside the pod's guest, through crust_ops and its runtime.
    GuestFrozen {
        volume: String,
        target: String,
    },
    Nothing,
}

impl SnapshotParts<'_> {
    pub(crate) fn snapshot_proto(&self, s: &SnapshotInfo) -> csi::Snapshot {
        csi::Snapshot {
            size_bytes: s.size_bytes as i64,
            snapshot_id: s.snapshot_id.clone(),
            source_volume_id: s.source_volume_id.clone(),
            creation_time: Some(timestamp(s.created_unix_ms)),
            ready_to_use: true,
            group_snapshot_id: s.group_id.clone().unwrap_or_default(),
            accessible_topology: vec![self.cfg.topology()],
        }
    }

    fn require_snapshots(&self) -> Result<()> {
        if self.backend.supports_snapshots() {
            Ok(())
        } else {
            Err(BackendError::Unsupported {
                backend: self.backend.kind(),
                what: "snapshots",
            }
            .into())
        }
    }

    /// Makes `rec` consistent for a copy (see the module docs).
    fn quiesce(&self, rec: &VolumeRecord) -> Result<Quiesced> {
        if let Some((target, _)) = rec.deferred_publication() {
            let t = target.to_str().unwrap_or_default().to_string();
            match self.ops.freeze(&t, MAX_FROZEN) {
                Ok(()) => {
                    if let Some(s) = &rec.staging {
                        // The guest's flush reached QEMU; push it to the
                        // backing store too.
                        let _ = flush_device(&s.device);
                    }
                    return Ok(Quiesced::GuestFrozen {
                        volume: rec.id.clone(),
                        target: t,
                    });
                }
                // No runtime consumed the record: no guest has it mounted.
                Err(crust_ops::OpsError::NotConsumed(_)) => {}
                Err(e) => {
                    return Err(SnapshotError::GuestFreezeFailed {
                        volume: rec.id.clone(),
                        cause: e.to_string(),
                    }
                    .into());
                }
            }
        } else if let Some(why) = self.deferred().sandbox_claim(rec, None) {
            return Err(SnapshotError::NoWayToFreeze {
                volume: rec.id.clone(),
                claim: why,
            }
            .into());
        }
        let Some(s) = &rec.staging else {
            return Ok(Quiesced::Nothing);
        };
        if !s.block && s.host_mount == HostMount::Mounted && !s.readonly {
            let frozen =
                crust_blockdev::freeze(&s.path, FREEZE_TIMEOUT, MAX_FROZEN).map_err(|e| {
                    SnapshotError::HostFreezeFailed {
                        volume: rec.id.clone(),
                        cause: e.to_string(),
                    }
                })?;
            return Ok(Quiesced::Frozen(frozen));
        }
        // A raw, read-only or unmounted device: push what sits in the
        // device's page cache to the backing store before it is copied.
        flush_device(&s.device).map_err(|e| SnapshotError::FlushFailed {
            volume: rec.id.clone(),
            device: s.device.clone(),
            cause: e.to_string(),
        })?;
        Ok(Quiesced::Nothing)
    }

    /// Ends a quiesce; an error means the copy may not be consistent.
    fn release(&self, q: Quiesced) -> Result<()> {
        match q {
            Quiesced::Frozen(f) => f.thaw().map_err(|e| {
                SnapshotError::ThawFailed {
                    cause: e.to_string(),
                }
                .into()
            }),
            Quiesced::GuestFrozen { volume, target } => match self.ops.thaw(&target) {
                Ok(true) => Ok(()),
                Ok(false) => Err(SnapshotError::GuestThawedEarly {
                    volume,
                    limit: MAX_FROZEN,
                }
                .into()),
                Err(e) => Err(SnapshotError::GuestThawUnconfirmed {
                    volume,
                    cause: e.to_string(),
                }
                .into()),
            },
            Quiesced::Nothing => Ok(()),
        }
    }

    /// Guards and records of `ids`, or ABORTED/NOT_FOUND.
    fn begin_on(
        &self,
        ids: &[String],
        op: &'static str,
    ) -> Result<(Vec<OpGuard>, Vec<VolumeRecord>)> {
        let mut guards = Vec::with_capacity(ids.len());
        let mut recs = Vec::with_capacity(ids.len());
        for id in ids {
            let rec = ready_record(self.state, id)?;
            guards.push(self.guards.try_begin(id, op)?);
            recs.push(ready_record(self.state, &rec.id)?);
        }
        Ok((guards, recs))
    }

    /// Quiesces every volume, runs `copy`, releases every volume; the
    /// result fails if any release says the copy is not consistent, and
    /// `discard` then removes the copy (a retry must not find it).
    fn consistent<T>(
        &self,
        recs: &[VolumeRecord],
        copy: impl FnOnce() -> Result<T>,
        discard: impl FnOnce(&T) -> std::result::Result<(), BackendError>,
    ) -> Result<T> {
        let mut held = Vec::with_capacity(recs.len());
        for rec in recs {
            match self.quiesce(rec) {
                Ok(q) => held.push(q),
                Err(e) => {
                    // Release what is already held (in any case).
                    for q in held {
                        let _ = self.release(q);
                    }
                    return Err(e);
                }
            }
        }
        let out = copy();
        let mut released = Ok(());
        for q in held {
            if let Err(e) = self.release(q) {
                released = Err(e);
            }
        }
        let out = out?;
        if let Err(e) = released {
            if let Err(de) = discard(&out) {
                tracing::error!(error = %de, "cannot remove an inconsistent copy");
            }
            return Err(e);
        }
        Ok(out)
    }

    pub fn create_snapshot(&self, req: &csi::CreateSnapshotRequest) -> Result<csi::Snapshot> {
        if req.name.is_empty() {
            return Err(ControllerError::Missing("name"));
        }
        if req.source_volume_id.is_empty() {
            return Err(ControllerError::Missing("source_volume_id"));
        }
        check_parameters(&req.parameters)?;
        self.require_snapshots()?;
        if let Some(t) = &req.accessibility_requirements
            && !t.requisite.is_empty()
            && !t.requisite.iter().any(|t| self.cfg.topology_matches(t))
        {
            return Err(ControllerError::OtherTopology {
                key: self.cfg.topology_key(),
                node: self.cfg.node_id.clone(),
                rule: "snapshots stay on the node of their volume",
            });
        }
        let id = snapshot_id_for(&req.name);
        let _snap_guard = self.guards.try_begin(&id, "CreateSnapshot")?;
        if let Some(s) = self.backend.get_snapshot(&id)? {
            return self.existing_snapshot(&s, &req.source_volume_id);
        }
        let (_guards, recs) = self.begin_on(
            std::slice::from_ref(&req.source_volume_id),
            "CreateSnapshot",
        )?;
        // Before the copy: a restore must never find a snapshot without it.
        self.state
            .put_snapshot_history(&id, &recs[0].id, known_history(&recs[0]))?;
        let info = self.consistent(
            &recs,
            || Ok(self.backend.create_snapshot(&id, &recs[0].id, None)?),
            |_| self.backend.delete_snapshot(&id),
        )?;
        tracing::info!(snapshot = %id, name = %req.name, volume = %req.source_volume_id,
            method = %info.method, "snapshot created");
        Ok(self.snapshot_proto(&info))
    }

    fn existing_snapshot(&self, s: &SnapshotInfo, source: &str) -> Result<csi::Snapshot> {
        if s.source_volume_id != source || s.group_id.is_some() {
            return Err(SnapshotError::SnapshotOfOtherVolume {
                snapshot: s.snapshot_id.clone(),
                volume: s.source_volume_id.clone(),
                group: s
                    .group_id
                    .as_ref()
                    .map(|g| format!(" (in group {g})"))
                    .unwrap_or_default(),
                asked: shown(source),
            }
            .into());
        }
        Ok(self.snapshot_proto(s))
    }

    pub fn delete_snapshot(&self, req: &csi::DeleteSnapshotRequest) -> Result<()> {
        if req.snapshot_id.is_empty() {
            return Err(ControllerError::Missing("snapshot_id"));
        }
        if !self.backend.supports_snapshots() {
            return Ok(());
        }
        let _guard = self.guards.try_begin(&req.snapshot_id, "DeleteSnapshot")?;
        if let Some(s) = self.backend.get_snapshot(&req.snapshot_id)?
            && let Some(g) = &s.group_id
        {
            return Err(ControllerError::InvalidArgument(format!(
                "snapshot {} is part of group snapshot {g}; delete the group \
                 (DeleteVolumeGroupSnapshot)",
                s.snapshot_id
            )));
        }
        self.backend.delete_snapshot(&req.snapshot_id)?;
        self.state.remove_snapshot_history(&req.snapshot_id)?;
        Ok(())
    }

    pub fn get_snapshot(&self, req: &csi::GetSnapshotRequest) -> Result<csi::Snapshot> {
        if req.snapshot_id.is_empty() {
            return Err(ControllerError::Missing("snapshot_id"));
        }
        self.backend
            .get_snapshot(&req.snapshot_id)?
            .map(|s| self.snapshot_proto(&s))
            .ok_or_else(|| BackendError::SnapshotNotFound(req.snapshot_id.clone()).into())
    }

    pub fn list_snapshots(
        &self,
        req: &csi::ListSnapshotsRequest,
    ) -> Result<csi::ListSnapshotsResponse> {
        if req.max_entries < 0 {
            return Err(ControllerError::InvalidArgument(format!(
                "max_entries must not be negative (got {})",
                req.max_entries
            )));
        }
        let after = match req.starting_token.as_str() {
            "" => None,
            t => Some(decode_token_of(t, is_snapshot_id)?),
        };
        let all = self.backend.list_snapshots()?;
        let mut matching = all.iter().filter(|s| {
            (req.snapshot_id.is_empty() || s.snapshot_id == req.snapshot_id)
                && (req.source_volume_id.is_empty() || s.source_volume_id == req.source_volume_id)
                && after.as_deref().is_none_or(|a| s.snapshot_id.as_str() > a)
        });
        let max = req.max_entries as usize;
        let mut entries = Vec::new();
        for s in matching.by_ref() {
            entries.push(csi::list_snapshots_response::Entry {
                snapshot: Some(self.snapshot_proto(s)),
            });
            if max != 0 && entries.len() == max {
                break;
            }
        }
        let next_token = match entries.last() {
            Some(e) if matching.next().is_some() => {
                encode_token(&e.snapshot.as_ref().expect("set above").snapshot_id)
            }
            _ => String::new(),
        };
        Ok(csi::ListSnapshotsResponse {
            entries,
            next_token,
        })
    }

    /// Fills new volume `id` of `size` bytes from `source`, consistently.
    /// (A copied xfs keeps its source's UUID; it is mounted with `nouuid`,
    /// see the node service: its log may need replaying, which rules out
    /// changing the UUID offline.)
    pub(crate) fn fill_from(
        &self,
        id: &str,
        size: u64,
        source: &ContentSource,
    ) -> Result<(u64, Option<History>)> {
        let (alloc, history) = match source {
            ContentSource::Snapshot(snap) => (
                self.backend.create_from(id, size, source)?,
                self.state.snapshot_history(snap),
            ),
            ContentSource::Volume(src) => {
                let (_guards, recs) =
                    self.begin_on(std::slice::from_ref(src), "CreateVolume (clone source)")?;
                // Read under the source's guard: no stage changes it now.
                let history = known_history(&recs[0]);
                let alloc = self.consistent(
                    &recs,
                    || Ok(self.backend.create_from(id, size, source)?),
                    |_| self.backend.delete(id),
                )?;
                (alloc, history)
            }
        };
        Ok((alloc.size_bytes, history))
    }

    /// The source's size and filesystem for CreateVolume; NOT_FOUND when
    /// it does not exist, INVALID_ARGUMENT when this backend cannot copy.
    pub(crate) fn content_source_facts(
        &self,
        source: &ContentSource,
    ) -> Result<(u64, Option<crate::caps::FsType>)> {
        if !self.backend.supports_snapshots() {
            return Err(ControllerError::InvalidArgument(format!(
                "the {} backend cannot create a volume from a snapshot or another volume",
                self.backend.kind()
            )));
        }
        match source {
            ContentSource::Snapshot(id) => {
                let s = self
                    .backend
                    .get_snapshot(id)?
                    .ok_or_else(|| BackendError::SnapshotNotFound(id.clone()))?;
                // Unknown once the source volume is gone: staging then finds
                // the filesystem on the device and refuses a mismatch.
                let fs = self.state.get(&s.source_volume_id).map(|r| r.fs_type);
                Ok((s.size_bytes, fs))
            }
            ContentSource::Volume(id) => {
                let rec = ready_record(self.state, id)?;
                Ok((rec.capacity_bytes, Some(rec.fs_type)))
            }
        }
    }

    // ---- group snapshots ----

    pub fn create_volume_group_snapshot(
        &self,
        req: &csi::CreateVolumeGroupSnapshotRequest,
    ) -> Result<csi::VolumeGroupSnapshot> {
        if req.name.is_empty() {
            return Err(ControllerError::Missing("name"));
        }
        if req.source_volume_ids.is_empty() {
            return Err(ControllerError::Missing("source_volume_ids"));
        }
        check_parameters(&req.parameters)?;
        self.require_snapshots()?;
        let mut sources = req.source_volume_ids.clone();
        sources.sort();
        if sources.windows(2).any(|w| w[0] == w[1]) {
            return Err(ControllerError::InvalidArgument(
                "source_volume_ids lists a volume twice".into(),
            ));
        }
        let gid = group_id_for(&req.name);
        let _group_guard = self.guards.try_begin(&gid, "CreateVolumeGroupSnapshot")?;
        match self.backend.get_group(&gid)? {
            Some((g, true)) if g.source_volume_ids == sources => return self.group_proto(&gid),
            Some((g, _)) if g.source_volume_ids != sources => {
                return Err(SnapshotError::GroupOfOtherVolumes {
                    group: gid.to_string(),
                    volumes: g.source_volume_ids,
                }
                .into());
            }
            // Pending (an earlier attempt stopped half way): cut it again,
            // whole, in one freeze.
            Some(_) => self.backend.delete_group(&gid)?,
            None => {}
        }
        let (_guards, recs) = self.begin_on(&sources, "CreateVolumeGroupSnapshot")?;
        self.backend.begin_group(&gid, &sources)?;
        let members: Vec<String> = sources.iter().map(|v| member_id(&gid, v)).collect();
        for (m, rec) in members.iter().zip(&recs) {
            self.state
                .put_snapshot_history(m, &rec.id, known_history(rec))?;
        }
        // (a failed cut removes the whole group below)
        let cut = self.consistent(
            &recs,
            || {
                for (m, v) in members.iter().zip(&sources) {
                    self.backend.create_snapshot(m, v, Some(&gid))?;
                }
                Ok(())
            },
            |_| Ok(()),
        );
        if let Err(e) = cut {
            if let Err(de) = self.backend.delete_group(&gid) {
                tracing::warn!(group = %gid, error = %de, "could not remove a failed group snapshot");
            }
            return Err(e);
        }
        self.backend.complete_group(&gid, &members)?;
        tracing::info!(group = %gid, name = %req.name, volumes = ?sources, "group snapshot created");
        self.group_proto(&gid)
    }

    fn group_proto(&self, gid: &str) -> Result<csi::VolumeGroupSnapshot> {
        let (g, complete) = self
            .backend
            .get_group(gid)?
            .filter(|(_, c)| *c)
            .ok_or_else(|| BackendError::SnapshotNotFound(gid.to_string()))?;
        let mut snapshots = Vec::new();
        for id in &g.snapshot_ids {
            let s =
                self.backend
                    .get_snapshot(id)?
                    .ok_or_else(|| SnapshotError::GroupMemberGone {
                        member: id.clone(),
                        group: gid.to_string(),
                    })?;
            snapshots.push(self.snapshot_proto(&s));
        }
        Ok(csi::VolumeGroupSnapshot {
            group_snapshot_id: gid.to_string(),
            snapshots,
            creation_time: Some(timestamp(g.created_unix_ms)),
            ready_to_use: complete,
        })
    }

    /// The group's members must be exactly `ids` (when given).
    fn check_members(&self, gid: &str, ids: &[String]) -> Result<()> {
        let Some((g, _)) = self.backend.get_group(gid)? else {
            return Ok(());
        };
        let mut want = g.snapshot_ids.clone();
        want.sort();
        let mut got = ids.to_vec();
        got.sort();
        if !ids.is_empty() && want != got {
            return Err(ControllerError::InvalidArgument(format!(
                "snapshot_ids {got:?} are not the members of group snapshot {gid} ({want:?})"
            )));
        }
        Ok(())
    }

    pub fn delete_volume_group_snapshot(
        &self,
        req: &csi::DeleteVolumeGroupSnapshotRequest,
    ) -> Result<()> {
        if req.group_snapshot_id.is_empty() {
            return Err(ControllerError::Missing("group_snapshot_id"));
        }
        if !self.backend.supports_snapshots() {
            return Ok(());
        }
        let _guard = self
            .guards
            .try_begin(&req.group_snapshot_id, "DeleteVolumeGroupSnapshot")?;
        self.check_members(&req.group_snapshot_id, &req.snapshot_ids)?;
        let members = self
            .backend
            .get_group(&req.group_snapshot_id)?
            .map(|(g, _)| g.snapshot_ids)
            .unwrap_or_default();
        self.backend.delete_group(&req.group_snapshot_id)?;
        for m in &members {
            self.state.remove_snapshot_history(m)?;
        }
        Ok(())
    }

    pub fn get_volume_group_snapshot(
        &self,
        req: &csi::GetVolumeGroupSnapshotRequest,
    ) -> Result<csi::VolumeGroupSnapshot> {
        if req.group_snapshot_id.is_empty() {
            return Err(ControllerError::Missing("group_snapshot_id"));
        }
        self.require_snapshots()?;
        let gsnap = self.group_proto(&req.group_snapshot_id)?;
        self.check_members(&req.group_snapshot_id, &req.snapshot_ids)?;
        Ok(gsnap)
    }
}

/// fsync on a block device writes its dirty page cache to the device
/// (for a loop device, into the backing file).
fn flush_device(dev: &Path) -> std::io::Result<()> {
    std::fs::OpenOptions::new().read(true).open(dev)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_distinct() {
        assert_eq!(snapshot_id_for("a"), snapshot_id_for("a"));
        assert_ne!(snapshot_id_for("a"), snapshot_id_for("b"));
        assert!(snapshot_id_for("a").starts_with("snap-"));
        assert_eq!(snapshot_id_for("a").len(), 37);
        assert!(group_id_for("a").starts_with("group-"));
        assert_ne!(member_id("g", "v1"), member_id("g", "v2"));
        assert_ne!(member_id("ga", "v"), member_id("g", "av"));
    }

    #[test]
    fn timestamps_split_milliseconds() {
        let t = timestamp(1_700_000_000_123);
        assert_eq!((t.seconds, t.nanos), (1_700_000_000, 123_000_000));
    }
}
