//! CSI Controller service.
//!
//! Volumes are local: the plugin on each node provisions from that node's
//! backend (the external-provisioner's distributed provisioning) and every
//! volume is accessible only from `{ "<driver>/node": <node-id> }`.
//!
//! * Volume ids are `vol-` + 32 hex digits of sha256(name): deterministic,
//!   so a retried CreateVolume finds its volume even after a restart.
//! * A CreateVolume without a capacity range gets [`DEFAULT_VOLUME_SIZE`]
//!   (1 GiB), or the limit if that is smaller. Sizes are rounded up to a
//!   multiple of 4 KiB when the range allows it.
//! * Parameters: `fsType` (ext4 | xfs, default ext4); `deferFsOps`
//!   (copied into the volume context: "auto", the default, hands the
//!   volume to a VM runtime that asks for it (`handover.rs`); "true"
//!   defers at NodeStage/NodePublish even when the CO sends no
//!   `defer_fs_ops`, and is refused with `--deferral disabled` and for a
//!   volume with only raw block capabilities; "false" never hands it
//!   over); the `csi.storage.k8s.io/*` keys added by the
//!   external-provisioner's --extra-create-metadata are accepted and
//!   ignored; anything else is INVALID_ARGUMENT.
//! * ListVolumes tokens are the URL-safe base64 of the last volume id of
//!   the previous page; pages continue after that id, so they stay
//!   consistent while volumes are created and deleted.
//! * `published_node_ids` lists this node while the volume is staged or
//!   published here (there is no ControllerPublish for local volumes).

use std::collections::{BTreeMap, HashSet};

use crust_backend::{BackendError, ContentSource};
use crust_handoff::IoLimits;
use crust_proto::csi::v1 as csi;

use crate::caps::{Access, CapSpec, Capability, FsType};
use crate::config::DEFAULT_VOLUME_SIZE;
use crate::driver::ControllerParts;
use crate::error::ControllerError;
use crate::paging::{decode_token, encode_token};
use crate::records::{
    Phase, RECORD_VERSION, SourceRecord, VolumeRecord, is_valid_volume_id, volume_id_for,
};

mod service;
pub use service::ControllerService;

/// Longest accepted CreateVolume name (bytes).
pub const MAX_NAME_LEN: usize = 128;
/// Sizes are rounded up to this when the requested range allows it.
pub const SIZE_ALIGN: u64 = 4096;
/// Block devices come in whole sectors.
pub const SECTOR: u64 = 512;
/// Prefix of the metadata keys the external-provisioner adds.
const K8S_PREFIX: &str = "csi.storage.k8s.io/";

type Result<T> = std::result::Result<T, ControllerError>;

/// A checked CreateVolume request.
struct CreateAsk {
    fs_type: FsType,
    /// The parameters recorded and compared.
    kept: BTreeMap<String, String>,
    specs: Vec<CapSpec>,
    source: Option<ContentSource>,
    /// At least the source's size.
    required: u64,
    limit: u64,
    /// The smallest volume the backend and filesystem allow.
    min: u64,
    /// The mutable parameters' limits.
    io_limits: IoLimits,
}

/// Validated CreateVolume parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Params {
    pub fs_type: Option<FsType>,
    /// `deferFsOps=true`.
    pub defer: bool,
    /// What is persisted and compared (no csi.storage.k8s.io/* keys).
    pub kept: BTreeMap<String, String>,
}

/// Parameters as a plugin without deferral parses them (`deferFsOps=true`
/// refused).
#[cfg(test)]
pub(crate) fn parse_params<'a>(
    params: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Result<Params> {
    parse_params_with(params, false)
}

pub(crate) fn parse_params_with<'a>(
    params: impl IntoIterator<Item = (&'a String, &'a String)>,
    deferral_enabled: bool,
) -> Result<Params> {
    let mut out = Params {
        fs_type: None,
        defer: false,
        kept: BTreeMap::new(),
    };
    for (k, v) in params {
        if k.starts_with(K8S_PREFIX) {
            continue;
        }
        match k.as_str() {
            "fsType" => {
                let fs = FsType::parse(v).ok_or_else(|| {
                    ControllerError::InvalidArgument(format!(
                        "parameter fsType={v:?} is not supported (supported: {})",
                        FsType::supported_list()
                    ))
                })?;
                out.fs_type = Some(fs);
            }
            "deferFsOps" => match v.as_str() {
                "false" | "auto" => {}
                "true" if deferral_enabled => out.defer = true,
                "true" => {
                    return Err(ControllerError::InvalidArgument(
                        "parameter deferFsOps=true: deferral not supported by this plugin configuration"
                            .into(),
                    ));
                }
                _ => {
                    return Err(ControllerError::InvalidArgument(format!(
                        "parameter deferFsOps={v:?}: expected \"auto\", \"true\" or \"false\""
                    )));
                }
            },
            _ => {
                return Err(ControllerError::InvalidArgument(format!(
                    "unknown parameter {k:?} (supported: fsType, deferFsOps; \
                     csi.storage.k8s.io/* keys are ignored)"
                )));
            }
        }
        out.kept.insert(k.clone(), v.clone());
    }
    Ok(out)
}

fn parse_caps(caps: &[csi::VolumeCapability]) -> Result<Vec<Capability>> {
    caps.iter()
        .map(|c| Capability::from_proto(c).map_err(ControllerError::InvalidArgument))
        .collect()
}

/// Mount flags of every capability pass the one check every RPC makes
/// ([`Capability::checked_mount_flags`]), so a flag that would fail later
/// fails now, before anything is allocated.
fn check_mount_flags(fs: FsType, caps: &[Capability]) -> Result<()> {
    for c in caps {
        c.checked_mount_flags(fs)?;
    }
    Ok(())
}

/// The fsType a volume gets: the parameter, else the one the mount
/// capabilities name, else ext4. Conflicts are INVALID_ARGUMENT.
fn effective_fs(params: &Params, caps: &[Capability]) -> Result<FsType> {
    let mut named: Option<FsType> = params.fs_type;
    for c in caps {
        if let Access::Mount { fs_type: Some(f) } = c.access {
            match named {
                Some(n) if n != f => {
                    return Err(ControllerError::InvalidArgument(format!(
                        "conflicting filesystem types: {n} and {f}"
                    )));
                }
                _ => named = Some(f),
            }
        }
    }
    Ok(named.unwrap_or(FsType::Ext4))
}

pub(crate) fn validate_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(ControllerError::Missing("name"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(ControllerError::InvalidArgument(format!(
            "name is {} bytes long; at most {MAX_NAME_LEN} are accepted",
            name.len()
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(ControllerError::InvalidArgument(
            "name contains control characters".into(),
        ));
    }
    Ok(())
}

/// (required, limit) from a CapacityRange, 0 meaning unset.
fn range(r: Option<&csi::CapacityRange>) -> Result<(u64, u64)> {
    let Some(r) = r else { return Ok((0, 0)) };
    if r.required_bytes < 0 || r.limit_bytes < 0 {
        return Err(ControllerError::InvalidArgument(format!(
            "capacity range must not be negative (required_bytes={}, limit_bytes={})",
            r.required_bytes, r.limit_bytes
        )));
    }
    let (req, lim) = (r.required_bytes as u64, r.limit_bytes as u64);
    if lim != 0 && req > lim {
        return Err(ControllerError::InvalidArgument(format!(
            "required_bytes {req} is larger than limit_bytes {lim}"
        )));
    }
    Ok((req, lim))
}

/// Picks the size to allocate for a range, honouring `min`.
fn choose_size(required: u64, limit: u64, min: u64) -> Result<u64> {
    let mut size = if required > 0 {
        required
    } else if limit > 0 {
        DEFAULT_VOLUME_SIZE.min(limit)
    } else {
        DEFAULT_VOLUME_SIZE
    };
    size = size.max(min);
    if limit > 0 && size > limit {
        return Err(ControllerError::LimitBelowMinimum { limit, min });
    }
    align(size, limit)
}

/// Rounds `size` up to 4 KiB, or at least to the 512-byte sector size a
/// block device needs, without exceeding `limit` (0 = none).
pub(crate) fn align(size: u64, limit: u64) -> Result<u64> {
    for unit in [SIZE_ALIGN, SECTOR] {
        let aligned = size.div_ceil(unit) * unit;
        if limit == 0 || aligned <= limit {
            return Ok(aligned);
        }
    }
    Err(ControllerError::NoSectorMultiple {
        size,
        limit,
        sector: SECTOR,
    })
}

fn in_range(size: u64, required: u64, limit: u64) -> bool {
    size >= required && (limit == 0 || size <= limit)
}

fn cap_set(caps: &[CapSpec]) -> HashSet<&CapSpec> {
    caps.iter().collect()
}

impl ControllerParts<'_> {
    fn backend_min_size(&self) -> u64 {
        self.backend
            .capacity()
            .map(|c| c.minimum_volume_size)
            .unwrap_or(0)
    }

    pub(crate) fn volume_proto(&self, rec: &VolumeRecord) -> csi::Volume {
        let mut ctx = std::collections::HashMap::new();
        ctx.insert("fsType".to_string(), rec.fs_type.to_string());
        // The owning node travels with the volume (kubelet passes the
        // context to NodeStage/NodePublish), so another node's plugin can
        // name it instead of answering a bare NOT_FOUND.
        ctx.insert(self.cfg.topology_key(), rec.node_id.clone());
        if let Some(v) = rec.parameters.get(crate::records::DEFER_CONTEXT_KEY) {
            ctx.insert(crate::records::DEFER_CONTEXT_KEY.to_string(), v.clone());
        }
        csi::Volume {
            capacity_bytes: rec.capacity_bytes as i64,
            volume_id: rec.id.clone(),
            volume_context: ctx,
            content_source: rec.content_source.as_ref().map(SourceRecord::to_proto),
            accessible_topology: vec![csi::Topology {
                segments: std::collections::HashMap::from([(
                    self.cfg.topology_key(),
                    rec.node_id.clone(),
                )]),
            }],
        }
    }

    pub fn create_volume(&self, req: &csi::CreateVolumeRequest) -> Result<csi::Volume> {
        let ask = self.create_ask(req)?;
        let id = volume_id_for(&req.name);
        let _guard = self.guards.try_begin(&id, "CreateVolume")?;
        let existing = self.state.get(&id);
        if let Some(rec) = &existing
            && let Some(done) = self.existing_volume(rec, req, &ask)?
        {
            return Ok(done);
        }
        let size = choose_size(ask.required, ask.limit, ask.min)?;
        let rec = VolumeRecord {
            version: RECORD_VERSION,
            id: id.clone(),
            name: req.name.clone(),
            phase: Phase::Creating,
            capacity_bytes: size,
            required_bytes: ask.required,
            limit_bytes: ask.limit,
            fs_type: ask.fs_type,
            parameters: ask.kept,
            capabilities: ask.specs,
            node_id: self.cfg.node_id.clone(),
            staging: None,
            published: BTreeMap::new(),
            content_source: ask.source.as_ref().map(SourceRecord::from),
            inherited: None,
            raw_block_used: false,
            formatted: None,
            format_started: None,
            handover: None,
            returned: None,
            created_targets: Default::default(),
            io_limits: ask.io_limits,
            limits_issued_ms: 0,
        };
        let rec = self.allocate(rec, ask.source.as_ref(), existing.is_none())?;
        tracing::info!(volume = %id, name = %req.name, size = rec.capacity_bytes, fs = %rec.fs_type, "volume created");
        Ok(self.volume_proto(&rec))
    }

    /// A CreateVolume request checked before anything is looked up, with
    /// the size range a content source implies.
    fn create_ask(&self, req: &csi::CreateVolumeRequest) -> Result<CreateAsk> {
        validate_name(&req.name)?;
        if req.volume_capabilities.is_empty() {
            return Err(ControllerError::Missing("volume_capabilities"));
        }
        let caps = parse_caps(&req.volume_capabilities)?;
        let params = parse_params_with(&req.parameters, self.cfg.deferral.enabled)?;
        let fs_type = effective_fs(&params, &caps)?;
        check_mount_flags(fs_type, &caps)?;
        if params.defer && caps.iter().all(|c| c.access.is_block()) {
            return Err(ControllerError::InvalidArgument(
                "parameter deferFsOps=true needs a filesystem (mount) capability: deferral \
                 hands a filesystem to the pod's runtime, a raw block volume has none"
                    .into(),
            ));
        }
        let source = content_source(req.volume_content_source.as_ref())?;
        // VolumeAttributesClass at creation: the same keys ModifyVolume takes.
        let io_limits = IoLimits::default().merged(&req.mutable_parameters)?;
        let (required, limit) = range(req.capacity_range.as_ref())?;
        if let Some(t) = &req.accessibility_requirements
            && !t.requisite.is_empty()
            && !t.requisite.iter().any(|t| self.cfg.topology_matches(t))
        {
            return Err(ControllerError::OtherTopology {
                key: self.cfg.topology_key(),
                node: self.cfg.node_id.clone(),
                rule: "volumes of this plugin are local to the node that creates them",
            });
        }
        let specs: Vec<CapSpec> = {
            let mut v: Vec<CapSpec> = caps.iter().map(Capability::spec).collect();
            v.dedup();
            v
        };
        let wants_fs = caps.iter().any(|c| !c.access.is_block());
        let min = self.backend_min_size().max(if wants_fs {
            fs_type.spec().min_bytes
        } else {
            0
        });
        // The source's size is the least the new volume can have.
        let required = match &source {
            Some(src) => {
                let (src_size, src_fs) = self.snapshots().content_source_facts(src)?;
                if let Some(f) = src_fs
                    && wants_fs
                    && f != fs_type
                {
                    return Err(ControllerError::InvalidArgument(format!(
                        "the source holds {f}, not the requested {fs_type}"
                    )));
                }
                if limit != 0 && limit < src_size {
                    return Err(ControllerError::LimitBelowSource {
                        limit,
                        source_bytes: src_size,
                    });
                }
                required.max(src_size)
            }
            None => required,
        };
        Ok(CreateAsk {
            fs_type,
            kept: params.kept,
            specs,
            source,
            required,
            limit,
            min,
            io_limits,
        })
    }

    /// A volume of the same name recorded already: the answer of a
    /// repeated CreateVolume (`Some`), a conflict, or (`None`) a create
    /// that was never answered and is done again.
    fn existing_volume(
        &self,
        rec: &VolumeRecord,
        req: &csi::CreateVolumeRequest,
        ask: &CreateAsk,
    ) -> Result<Option<csi::Volume>> {
        let id = &rec.id;
        if rec.name != req.name {
            return Err(ControllerError::IdCollision {
                id: id.clone(),
                name: req.name.clone(),
                existing: rec.name.clone(),
            });
        }
        let same_args = rec.fs_type == ask.fs_type
            && rec.parameters == ask.kept
            && cap_set(&rec.capabilities) == cap_set(&ask.specs)
            && rec.content_source == ask.source.as_ref().map(SourceRecord::from);
        let (required, limit) = (ask.required, ask.limit);
        match rec.phase {
            Phase::Ready => {
                if !same_args {
                    return Err(ControllerError::ExistsWithOtherArgs {
                        name: req.name.clone(),
                        fs_type: rec.fs_type,
                        parameters: rec.parameters.clone(),
                    });
                }
                if !in_range(rec.capacity_bytes, required, limit) {
                    return Err(ControllerError::ExistsWithOtherSize {
                        name: req.name.clone(),
                        capacity: rec.capacity_bytes,
                        required,
                        limit,
                    });
                }
                Ok(Some(self.volume_proto(rec)))
            }
            Phase::Creating => {
                // Never answered to the CO: a retry with other arguments
                // replaces it.
                if !same_args || rec.required_bytes != required || rec.limit_bytes != limit {
                    self.backend.delete(id)?;
                    self.state.remove(id)?;
                }
                Ok(None)
            }
        }
    }

    /// Allocates the store of `rec` (empty, or a copy of `source`) and
    /// records the volume Ready; a failure leaves nothing behind.
    ///
    /// A copy writes a Creating record first so a retry can find and
    /// finish it. A plain create writes one record, once allocated: the
    /// backend store of a create that crashed before it holds nothing,
    /// and the next start (Driver::settle) or a retry removes it.
    fn allocate(
        &self,
        mut rec: VolumeRecord,
        source: Option<&ContentSource>,
        no_record: bool,
    ) -> Result<VolumeRecord> {
        let id = rec.id.clone();
        let size = rec.capacity_bytes;
        if source.is_some() {
            self.state.put(rec.clone())?;
        }
        let created = match source {
            None => self.create_plain(&id, size, rec.limit_bytes, no_record),
            Some(src) => match self.snapshots().fill_from(&id, size, src) {
                Ok((n, history)) => {
                    // The copy's data is its source's, and so is its past.
                    rec.inherit(SourceRecord::from(src), history);
                    Ok(n)
                }
                Err(ControllerError::Backend(b)) => Err(b),
                Err(other) => {
                    if let Err(re) = self.state.remove(&id) {
                        tracing::error!(volume = %id, error = %re, "cannot remove record of failed create");
                    }
                    return Err(other);
                }
            },
        };
        let alloc_size = match created {
            Ok(a) => a,
            Err(e) => {
                // Leave nothing behind for a request that failed.
                if let Err(re) = self.state.remove(&id) {
                    tracing::error!(volume = %id, error = %re, "cannot remove record of failed create");
                }
                return Err(match e {
                    e @ BackendError::SizeMismatch { .. } => {
                        ControllerError::BackingExistsWithOtherSize {
                            name: rec.name.clone(),
                            cause: e,
                        }
                    }
                    other => other.into(),
                });
            }
        };
        rec.capacity_bytes = alloc_size;
        rec.phase = Phase::Ready;
        if let Err(e) = self.state.put(rec.clone()) {
            if source.is_none() && !self.backend.may_hold_data(&id) {
                // Nothing records the new store: release it.
                if let Err(be) = self.backend.delete(&id) {
                    tracing::error!(volume = %id, error = %be, "cannot release the store of a failed create");
                }
            }
            return Err(e.into());
        }
        Ok(rec)
    }

    /// Allocates a plain volume. Without a record of `id`, a store the
    /// backend already holds under it is what a create that crashed before
    /// writing its record left (never answered to the CO): reused when the
    /// size fits, replaced when it never held data.
    fn create_plain(
        &self,
        id: &str,
        size: u64,
        limit: u64,
        no_record: bool,
    ) -> std::result::Result<u64, BackendError> {
        match self.backend.create(id, size, limit) {
            Err(BackendError::SizeMismatch { .. })
                if no_record && !self.backend.may_hold_data(id) =>
            {
                tracing::info!(volume = %id, "replacing the unused store of an interrupted create");
                self.backend.delete(id)?;
                self.backend.create(id, size, limit).map(|a| a.size_bytes)
            }
            other => other.map(|a| a.size_bytes),
        }
    }

    pub fn delete_volume(&self, id: &str) -> Result<()> {
        if id.is_empty() {
            return Err(ControllerError::Missing("volume_id"));
        }
        if !is_valid_volume_id(id) {
            // Not an id this plugin issues: nothing to delete.
            return Ok(());
        }
        let _guard = self.guards.try_begin(id, "DeleteVolume")?;
        let Some(rec) = self.state.get(id) else {
            return Ok(());
        };
        if let Some(s) = &rec.staging {
            return Err(ControllerError::InUse {
                volume: id.to_string(),
                use_: format!("staged at {}", s.path.display()),
                first: "NodeUnstageVolume",
            });
        }
        if !rec.published.is_empty() {
            return Err(ControllerError::InUse {
                volume: id.to_string(),
                use_: format!(
                    "published at {:?}",
                    rec.published.keys().collect::<Vec<_>>()
                ),
                first: "NodeUnpublishVolume",
            });
        }
        // A device left attached by an interrupted stage: detach (refused
        // by the backend while anything mounts it).
        if let Some(dev) = self.backend.attached_device(id)? {
            self.backend
                .detach(id)
                .map_err(|e| ControllerError::Undetachable {
                    volume: id.to_string(),
                    device: dev.clone(),
                    reason: e.to_string(),
                })?;
        }
        self.backend.delete(id)?;
        self.state.remove(id)?;
        self.health.forget(id);
        self.metrics.forget_volume(id);
        tracing::info!(volume = %id, name = %rec.name, "volume deleted");
        Ok(())
    }

    /// A Ready record or NOT_FOUND.
    pub(crate) fn ready_record(&self, id: &str) -> Result<VolumeRecord> {
        ready_record(self.state, id)
    }

    pub fn validate_volume_capabilities(
        &self,
        req: &csi::ValidateVolumeCapabilitiesRequest,
    ) -> Result<csi::ValidateVolumeCapabilitiesResponse> {
        if req.volume_id.is_empty() {
            return Err(ControllerError::Missing("volume_id"));
        }
        if req.volume_capabilities.is_empty() {
            return Err(ControllerError::Missing("volume_capabilities"));
        }
        let rec = self.ready_record(&req.volume_id)?;
        let unconfirmed = |msg: String| csi::ValidateVolumeCapabilitiesResponse {
            confirmed: None,
            message: msg,
        };
        for c in &req.volume_capabilities {
            let cap = match Capability::from_proto(c) {
                Ok(c) => c,
                Err(e) => return Ok(unconfirmed(e)),
            };
            match cap.access {
                Access::Block if !rec.allows_block() => {
                    return Ok(unconfirmed(
                        "volume was created for filesystem access only".into(),
                    ));
                }
                Access::Mount { .. } if !rec.allows_mount() => {
                    return Ok(unconfirmed(
                        "volume was created for raw block access only".into(),
                    ));
                }
                Access::Mount { fs_type: Some(f) } if f != rec.fs_type => {
                    return Ok(unconfirmed(format!(
                        "volume has fsType {}, capability asks for {f}",
                        rec.fs_type
                    )));
                }
                _ => {}
            }
            if let Err(e) = cap.checked_mount_flags(rec.fs_type) {
                return Ok(unconfirmed(e.to_string()));
            }
        }
        if !req.parameters.is_empty() {
            match parse_params_with(&req.parameters, self.cfg.deferral.enabled) {
                Ok(p) if p.kept == rec.parameters => {}
                Ok(_) => {
                    return Ok(unconfirmed(
                        "parameters differ from the ones the volume was created with".into(),
                    ));
                }
                Err(e) => return Ok(unconfirmed(e.to_string())),
            }
        }
        if let Some(fs) = req.volume_context.get("fsType")
            && fs != rec.fs_type.as_str()
        {
            return Ok(unconfirmed(format!(
                "volume_context fsType {fs:?} does not match the volume's {}",
                rec.fs_type
            )));
        }
        Ok(csi::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                volume_context: req.volume_context.clone(),
                volume_capabilities: req.volume_capabilities.clone(),
                parameters: req.parameters.clone(),
                mutable_parameters: Default::default(),
            }),
            message: String::new(),
        })
    }

    pub(crate) fn published_nodes(&self, rec: &VolumeRecord) -> Vec<String> {
        if rec.staging.is_some() || !rec.published.is_empty() {
            vec![rec.node_id.clone()]
        } else {
            Vec::new()
        }
    }

    pub fn list_volumes(&self, req: &csi::ListVolumesRequest) -> Result<csi::ListVolumesResponse> {
        if req.max_entries < 0 {
            return Err(ControllerError::InvalidArgument(format!(
                "max_entries must not be negative (got {})",
                req.max_entries
            )));
        }
        let after = if req.starting_token.is_empty() {
            None
        } else {
            Some(decode_token(&req.starting_token)?)
        };
        let (page, more) = self.state.page(after.as_deref(), req.max_entries as usize);
        // v1.13 removed the condition field: skip the checks too.
        let serves_condition = self.cfg.csi_spec.serves_condition();
        let conditions = if serves_condition {
            self.health.conditions(&page)
        } else {
            vec![crate::health::Condition::normal(""); page.len()]
        };
        let next_token = match (more, page.last()) {
            (true, Some(last)) => encode_token(&last.id),
            _ => String::new(),
        };
        let entries = page
            .iter()
            .zip(conditions)
            .map(|(rec, cond)| csi::list_volumes_response::Entry {
                volume: Some(self.volume_proto(rec)),
                status: Some(csi::list_volumes_response::VolumeStatus {
                    published_node_ids: self.published_nodes(rec),
                    volume_condition: serves_condition.then(|| cond.into()),
                }),
            })
            .collect();
        Ok(csi::ListVolumesResponse {
            entries,
            next_token,
        })
    }

    pub fn controller_get_volume(&self, id: &str) -> Result<csi::ControllerGetVolumeResponse> {
        if id.is_empty() {
            return Err(ControllerError::Missing("volume_id"));
        }
        let rec = self.ready_record(id)?;
        let volume_condition = self
            .cfg
            .csi_spec
            .serves_condition()
            .then(|| self.health.condition(&rec).into());
        Ok(csi::ControllerGetVolumeResponse {
            volume: Some(self.volume_proto(&rec)),
            status: Some(csi::controller_get_volume_response::VolumeStatus {
                published_node_ids: self.published_nodes(&rec),
                volume_condition,
            }),
        })
    }

    pub fn get_capacity(&self, req: &csi::GetCapacityRequest) -> Result<csi::GetCapacityResponse> {
        let params = parse_params_with(&req.parameters, self.cfg.deferral.enabled)?;
        let zero = csi::GetCapacityResponse {
            available_capacity: 0,
            maximum_volume_size: Some(0),
            minimum_volume_size: None,
        };
        // Capabilities this plugin cannot serve: no capacity for them.
        let Ok(caps) = parse_caps(&req.volume_capabilities) else {
            return Ok(zero);
        };
        if let Some(t) = &req.accessible_topology
            && !self.cfg.topology_matches(t)
        {
            return Ok(zero);
        }
        let Ok(fs_type) = effective_fs(&params, &caps) else {
            return Ok(zero);
        };
        if check_mount_flags(fs_type, &caps).is_err() {
            return Ok(zero);
        }
        let cap = self.backend.capacity()?;
        let wants_fs = params.fs_type.is_some() || caps.iter().any(|c| !c.access.is_block());
        let min = cap.minimum_volume_size.max(if wants_fs {
            fs_type.spec().min_bytes
        } else {
            0
        });
        let max = cap.maximum_volume_size.min(cap.available_bytes);
        if max < min {
            return Ok(csi::GetCapacityResponse {
                available_capacity: 0,
                maximum_volume_size: Some(0),
                minimum_volume_size: Some(min as i64),
            });
        }
        Ok(csi::GetCapacityResponse {
            available_capacity: cap.available_bytes as i64,
            maximum_volume_size: Some(max as i64),
            minimum_volume_size: Some(min as i64),
        })
    }

    pub fn controller_expand_volume(
        &self,
        req: &csi::ControllerExpandVolumeRequest,
    ) -> Result<csi::ControllerExpandVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(ControllerError::Missing("volume_id"));
        }
        // A range with neither bound set is as good as none.
        let Some(cr) = req
            .capacity_range
            .as_ref()
            .filter(|r| r.required_bytes != 0 || r.limit_bytes != 0)
        else {
            return Err(ControllerError::Missing(
                "capacity_range (required_bytes or limit_bytes)",
            ));
        };
        // NOT_FOUND before the values are checked (error.rs's order).
        self.ready_record(&req.volume_id)?;
        let (required, limit) = range(Some(cr))?;
        let cap = match &req.volume_capability {
            Some(c) => Some(Capability::from_proto(c).map_err(ControllerError::InvalidArgument)?),
            None => None,
        };
        let mut rec = self.ready_record(&req.volume_id)?;
        if let Some(c) = &cap {
            c.checked_mount_flags(rec.fs_type)?;
        }
        let _guard = self.guards.try_begin(&rec.id, "ControllerExpandVolume")?;
        rec = self.ready_record(&req.volume_id)?;
        let node_expansion_required = match (&cap, &rec.staging) {
            (Some(c), _) => !c.access.is_block(),
            (None, Some(s)) => !s.block,
            (None, None) => !rec.is_block_only(),
        };
        let current = rec.capacity_bytes;
        if required <= current {
            if limit != 0 && current > limit {
                return Err(ControllerError::CannotShrink {
                    volume: rec.id.clone(),
                    current,
                    limit,
                });
            }
            return Ok(csi::ControllerExpandVolumeResponse {
                capacity_bytes: current as i64,
                node_expansion_required,
            });
        }
        let target = align(required, limit)?;
        let new_size = self.backend.expand(&rec.id, target)?;
        rec.capacity_bytes = new_size;
        self.state.put(rec.clone())?;
        self.health.forget(&rec.id);
        tracing::info!(volume = %rec.id, from = current, to = new_size, "volume expanded");
        Ok(csi::ControllerExpandVolumeResponse {
            capacity_bytes: new_size as i64,
            node_expansion_required,
        })
    }
}

/// The content source of a CreateVolume request.
fn content_source(src: Option<&csi::VolumeContentSource>) -> Result<Option<ContentSource>> {
    use csi::volume_content_source::Type;
    let Some(src) = src else { return Ok(None) };
    match &src.r#type {
        Some(Type::Snapshot(s)) if !s.snapshot_id.is_empty() => {
            Ok(Some(ContentSource::Snapshot(s.snapshot_id.clone())))
        }
        Some(Type::Volume(v)) if !v.volume_id.is_empty() => {
            Ok(Some(ContentSource::Volume(v.volume_id.clone())))
        }
        Some(Type::Snapshot(_)) => Err(ControllerError::Missing(
            "volume_content_source.snapshot.snapshot_id",
        )),
        Some(Type::Volume(_)) => Err(ControllerError::Missing(
            "volume_content_source.volume.volume_id",
        )),
        None => Err(ControllerError::InvalidArgument(
            "volume_content_source names neither a snapshot nor a volume".into(),
        )),
    }
}

/// A Ready record or NOT_FOUND (also for the snapshot RPCs, which name
/// their source volume).
pub(crate) fn ready_record(state: &crate::state::StateStore, id: &str) -> Result<VolumeRecord> {
    match state.get(id) {
        Some(r) if r.phase == Phase::Ready => Ok(r),
        _ => Err(ControllerError::NotFound(id.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_honour_the_range() {
        assert_eq!(choose_size(0, 0, 0).unwrap(), DEFAULT_VOLUME_SIZE);
        assert_eq!(choose_size(0, 100 << 20, 0).unwrap(), 100 << 20);
        assert_eq!(choose_size(1000, 0, 0).unwrap(), 4096);
        // a range too narrow for 4 KiB still gets whole sectors
        assert_eq!(choose_size(5000, 6000, 0).unwrap(), 5120);
        assert!(matches!(
            choose_size(1000, 1000, 0),
            Err(ControllerError::NoSectorMultiple { .. })
        ));
        assert_eq!(choose_size(5000, 8192, 0).unwrap(), 8192);
        // filesystem minimum raises the size within the limit...
        assert_eq!(choose_size(1 << 20, 0, 300 << 20).unwrap(), 300 << 20);
        // ...or the range is impossible
        assert!(matches!(
            choose_size(1 << 20, 2 << 20, 300 << 20),
            Err(ControllerError::LimitBelowMinimum { .. })
        ));
    }

    #[test]
    fn params_accept_known_and_provisioner_keys_only() {
        let mut m = BTreeMap::new();
        m.insert("fsType".to_string(), "xfs".to_string());
        m.insert(
            "csi.storage.k8s.io/pvc/name".to_string(),
            "data".to_string(),
        );
        let p = parse_params(&m).unwrap();
        assert_eq!(p.fs_type, Some(FsType::Xfs));
        assert_eq!(p.kept.len(), 1);
        m.insert("color".into(), "blue".into());
        assert!(matches!(
            parse_params(&m),
            Err(ControllerError::InvalidArgument(msg)) if msg.contains("color")
        ));
        let mut m = BTreeMap::new();
        m.insert("fsType".to_string(), "btrfs".to_string());
        assert!(parse_params(&m).is_err());
        let mut m = BTreeMap::new();
        m.insert("deferFsOps".to_string(), "true".to_string());
        assert!(matches!(
            parse_params(&m),
            Err(ControllerError::InvalidArgument(msg)) if msg.contains("deferral not supported")
        ));
    }

    #[test]
    fn defer_parameter_with_deferral_enabled() {
        let mut m = BTreeMap::new();
        m.insert("deferFsOps".to_string(), "true".to_string());
        let p = parse_params_with(&m, true).unwrap();
        assert!(p.defer);
        assert_eq!(p.kept.get("deferFsOps").map(String::as_str), Some("true"));
        m.insert("deferFsOps".to_string(), "false".to_string());
        assert!(!parse_params_with(&m, true).unwrap().defer);
        m.insert("deferFsOps".to_string(), "auto".to_string());
        assert!(!parse_params_with(&m, true).unwrap().defer);
        assert!(!parse_params_with(&m, false).unwrap().defer);
        m.insert("deferFsOps".to_string(), "yes".to_string());
        assert!(parse_params_with(&m, true).is_err());
    }

    #[test]
    fn names() {
        assert!(validate_name("pvc-1").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name(&"x".repeat(128)).is_ok());
        assert!(validate_name(&"x".repeat(129)).is_err());
        assert!(validate_name("a\nb").is_err());
    }
}
