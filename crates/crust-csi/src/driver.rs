//! The plugin core shared by the three services: configuration, backend,
//! volume records, the per-volume operation guard and the health monitor.
//!
//! Operations are written as synchronous functions on [`Driver`] and run on
//! tokio's blocking pool (they call mkfs, mount, ioctls and fsync); the
//! gRPC services are thin async wrappers around them.

use std::collections::HashMap;
use std::sync::Arc;

use crust_backend::Backend;
use crust_ops::CrustOps;
use crust_proto::csi::v1 as csi;
use tonic::Status;

use crate::config::Config;
use crate::error::ServeError;
use crate::guard::OpGuards;
use crate::health::HealthMonitor;
use crate::metrics::Metrics;
use crate::state::StateStore;

pub struct Driver {
    pub(crate) cfg: Config,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) state: StateStore,
    pub(crate) guards: OpGuards,
    pub(crate) health: HealthMonitor,
    /// crust_ops in process. Present even with deferral disabled, so
    /// records of volumes published with deferral before a downgrade can
    /// still be removed on unpublish.
    pub(crate) ops: Arc<CrustOps>,
    pub(crate) metrics: Arc<Metrics>,
}

impl Driver {
    /// Loads the records in `cfg.state_dir` and reconciles them with the
    /// backend (logs only: nothing is deleted on start).
    pub fn new(cfg: Config, backend: Arc<dyn Backend>) -> Result<Arc<Driver>, ServeError> {
        let state = StateStore::open(&cfg.state_dir)?;
        let ops = Arc::new(CrustOps::new(cfg.deferral.ops.clone())?);
        let health = HealthMonitor::new(
            backend.clone(),
            ops.clone(),
            cfg.health_ttl,
            cfg.health_timeout,
        );
        let driver = Driver {
            cfg,
            backend,
            state,
            guards: OpGuards::default(),
            health,
            ops,
            metrics: Arc::new(Metrics::new()),
        };
        driver.reconcile();
        driver.repair_handovers();
        if !crust_blockdev::can_grow_ext4_online() {
            tracing::warn!(
                "no CAP_SYS_RESOURCE: mounted ext4 volumes cannot be grown online; they are \
                 grown when next staged (xfs grows online regardless)"
            );
        }
        Ok(Arc::new(driver))
    }

    /// Settles the backend against the records, reports what it cannot
    /// settle, and thaws filesystems an interrupted snapshot left frozen.
    fn reconcile(&self) {
        self.settle();
        let records = self.state.all();
        for r in records
            .iter()
            .filter(|r| r.phase == crate::records::Phase::Creating)
        {
            tracing::warn!(volume = %r.id, name = %r.name,
                "CreateVolume did not finish before the last stop; a retry completes it");
        }
        for r in records.iter().filter(|r| r.staging.is_some()) {
            let s = r.staging.as_ref().expect("filtered");
            // A plugin killed while a snapshot had the filesystem frozen
            // leaves it frozen (a freeze outlives its process): thaw.
            if !s.block
                && s.host_mount == crate::records::HostMount::Mounted
                && crust_blockdev::root_mounted_at(&s.device, &s.path).unwrap_or(false)
            {
                match crust_blockdev::thaw_if_frozen(&s.path) {
                    Ok(true) => tracing::warn!(volume = %r.id, path = %s.path.display(),
                        "thawed a filesystem left frozen by an interrupted snapshot"),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(volume = %r.id, error = %e, "cannot check whether the filesystem is frozen")
                    }
                }
            }
            match self.backend.attached_device(&r.id) {
                Ok(Some(dev)) if dev == s.device => {
                    tracing::info!(volume = %r.id, device = %dev.display(), "staged volume still attached")
                }
                Ok(other) => tracing::warn!(volume = %r.id, recorded = %s.device.display(),
                    now = ?other, "staged volume's device changed or is detached; the next NodeStageVolume repairs it"),
                Err(e) => {
                    tracing::warn!(volume = %r.id, error = %e, "cannot query attached device")
                }
            }
        }
    }

    /// The records are the durable truth of which volumes exist; a crash
    /// between a record change and the backend's (which the pool writes
    /// lazily, see crust_backend's "Deferred index") is settled here:
    /// - a store without a record that never held data is what a create
    ///   that crashed before its record, or a delete that crashed after
    ///   removing it, left: deleted;
    /// - a Ready record of a plain volume that never held data (never
    ///   staged, formatted or used raw) whose store or its file is
    ///   missing: created again (the create did not reach the disk).
    ///
    /// Never deletes a store that may hold data: it may be the volume of a
    /// record that could not be read (moved aside as `*.corrupt`), or of a
    /// state directory that was lost. Those are logged and left alone.
    pub(crate) fn settle(&self) {
        let allocs = match self.backend.list() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list backend allocations");
                return;
            }
        };
        for a in &allocs {
            if self.state.get(&a.volume_id).is_some() {
                continue;
            }
            if self.backend.may_hold_data(&a.volume_id) {
                tracing::warn!(volume = %a.volume_id, backing = %a.backing.display(),
                    "backing store without a volume record holds data (left untouched)");
                continue;
            }
            match self.backend.delete(&a.volume_id) {
                Ok(()) => tracing::info!(volume = %a.volume_id,
                    "removed the unused backing store of an interrupted create or delete"),
                Err(e) => tracing::warn!(volume = %a.volume_id, error = %e,
                    "cannot remove a backing store without a volume record"),
            }
        }
        for r in self.state.all() {
            let present = allocs.iter().any(|a| a.volume_id == r.id)
                && !matches!(
                    self.backend.backing_state(&r.id),
                    crust_backend::BackingState::Missing(_)
                );
            if present {
                continue;
            }
            let never_used = r.phase == crate::records::Phase::Ready
                && r.content_source.is_none()
                && r.staging.is_none()
                && r.published.is_empty()
                && r.formatted.is_none()
                && r.format_started.is_none()
                && !r.raw_block_used;
            if never_used && !self.backend.may_hold_data(&r.id) {
                // An entry whose file is gone goes first.
                if let Err(e) = self.backend.delete(&r.id) {
                    tracing::warn!(volume = %r.id, error = %e, "cannot clear the entry of a missing store");
                }
                match self
                    .backend
                    .create(&r.id, r.capacity_bytes, r.capacity_bytes)
                {
                    Ok(a) if a.size_bytes == r.capacity_bytes => {
                        tracing::info!(volume = %r.id, "made again the never-used backing store of a create interrupted before it reached the disk");
                        continue;
                    }
                    Ok(a) => {
                        tracing::warn!(volume = %r.id, got = a.size_bytes, want = r.capacity_bytes,
                            "re-created store has another size; released");
                        let _ = self.backend.delete(&r.id);
                    }
                    Err(e) => {
                        tracing::warn!(volume = %r.id, error = %e, "cannot re-create the store of a never-used volume")
                    }
                }
            }
            tracing::warn!(volume = %r.id, name = %r.name,
                "volume record without backing store; it will report an abnormal condition");
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Whether deferred filesystem operations are offered.
    pub fn deferral_enabled(&self) -> bool {
        self.cfg.deferral.enabled
    }

    /// This node's topology segments: `{ "<driver>/node": <node-id> }`.
    pub(crate) fn segments(&self) -> HashMap<String, String> {
        HashMap::from([(self.cfg.topology_key(), self.cfg.node_id.clone())])
    }

    pub(crate) fn topology(&self) -> csi::Topology {
        csi::Topology {
            segments: self.segments(),
        }
    }

    /// Whether a topology requirement entry selects this node: every
    /// segment it names must be one of ours with the same value.
    pub(crate) fn topology_matches(&self, t: &csi::Topology) -> bool {
        let ours = self.segments();
        !t.segments.is_empty() && t.segments.iter().all(|(k, v)| ours.get(k) == Some(v))
    }
}

/// Runs `f` on the blocking pool and converts its error to a gRPC status.
pub(crate) async fn blocking<T, E, F>(driver: &Arc<Driver>, f: F) -> Result<T, Status>
where
    F: FnOnce(&Driver) -> Result<T, E> + Send + 'static,
    T: Send + 'static,
    E: Into<Status> + Send + 'static,
{
    let d = driver.clone();
    match tokio::task::spawn_blocking(move || f(&d)).await {
        Ok(r) => r.map_err(Into::into),
        Err(e) => Err(Status::internal(format!("operation panicked: {e}"))),
    }
}
