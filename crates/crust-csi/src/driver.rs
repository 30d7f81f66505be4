//! The plugin core shared by the three services: configuration, backend,
//! volume records, the per-volume operation guard and the health monitor.
//!
//! Operations are written as synchronous functions on [`Driver`] and run on
//! tokio's blocking pool (they call mkfs, mount, ioctls and fsync); the
//! gRPC services are thin async wrappers around them.
//!
//! The driver's parts are private to this module. Each service reaches
//! them through its own facade (a borrowed view holding only the parts it
//! uses), and one service calls another only through a conversion listed
//! here, so the compiler holds every service to its boundary:
//!
//! | facade | parts | may call |
//! |---|---|---|
//! | [`IdentityParts`] | config, backend | |
//! | [`ControllerParts`] | config, backend, records, guards, health, metrics, crust_ops | snapshots (CreateVolume from a source) |
//! | [`SnapshotParts`] (also group snapshots) | config, backend, records, guards, crust_ops | deferred (the sandbox that claims a volume) |
//! | [`NodeParts`] | config, backend, records, guards, health, metrics | deferred, handover |
//! | [`DeferParts`] | config, backend, records, health, metrics, crust_ops | node (a target), handover |
//! | [`HandoverParts`] | config, records, guards, health, crust_ops | node (records) |

use std::sync::Arc;

use crust_backend::Backend;
use crust_ops::CrustOps;
use tonic::Status;

use crate::config::Config;
use crate::error::ServeError;
use crate::guard::OpGuards;
use crate::health::HealthMonitor;
use crate::metrics::Metrics;
use crate::state::StateStore;

pub struct Driver {
    cfg: Config,
    backend: Arc<dyn Backend>,
    state: StateStore,
    guards: OpGuards,
    health: HealthMonitor,
    /// crust_ops in process. Present even with deferral disabled, so
    /// records of volumes published with deferral before a downgrade can
    /// still be removed on unpublish.
    ops: Arc<CrustOps>,
    metrics: Arc<Metrics>,
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
        driver.handover().repair_handovers();
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

    /// The backend's kind, as logged and in GetPluginInfo's manifest.
    pub(crate) fn backend_kind(&self) -> &'static str {
        self.backend.kind()
    }

    /// Whether the backend can take snapshots (the capabilities offered).
    pub(crate) fn supports_snapshots(&self) -> bool {
        self.backend.supports_snapshots()
    }

    pub(crate) fn identity(&self) -> IdentityParts<'_> {
        IdentityParts {
            cfg: &self.cfg,
            backend: &self.backend,
        }
    }

    pub(crate) fn controller(&self) -> ControllerParts<'_> {
        ControllerParts {
            d: self,
            cfg: &self.cfg,
            backend: &self.backend,
            state: &self.state,
            guards: &self.guards,
            health: &self.health,
            metrics: &self.metrics,
            ops: &self.ops,
        }
    }

    pub(crate) fn snapshots(&self) -> SnapshotParts<'_> {
        SnapshotParts {
            d: self,
            cfg: &self.cfg,
            backend: &self.backend,
            state: &self.state,
            guards: &self.guards,
            ops: &self.ops,
        }
    }

    pub(crate) fn node(&self) -> NodeParts<'_> {
        NodeParts {
            d: self,
            cfg: &self.cfg,
            backend: &self.backend,
            state: &self.state,
            guards: &self.guards,
            health: &self.health,
            metrics: &self.metrics,
        }
    }

    fn deferred(&self) -> DeferParts<'_> {
        DeferParts {
            d: self,
            cfg: &self.cfg,
            backend: &self.backend,
            state: &self.state,
            health: &self.health,
            metrics: &self.metrics,
            ops: &self.ops,
        }
    }

    pub(crate) fn handover(&self) -> HandoverParts<'_> {
        HandoverParts {
            d: self,
            cfg: &self.cfg,
            state: &self.state,
            guards: &self.guards,
            health: &self.health,
            ops: &self.ops,
        }
    }

    /// The health monitor, for its unit tests.
    #[cfg(test)]
    pub(crate) fn health_monitor(&self) -> &HealthMonitor {
        &self.health
    }
}

/// What the Identity service reads.
pub(crate) struct IdentityParts<'a> {
    pub(crate) cfg: &'a Config,
    pub(crate) backend: &'a Arc<dyn Backend>,
}

/// What the Controller service (and ControllerModifyVolume, controller
/// volume health) uses.
pub(crate) struct ControllerParts<'a> {
    d: &'a Driver,
    pub(crate) cfg: &'a Config,
    pub(crate) backend: &'a Arc<dyn Backend>,
    pub(crate) state: &'a StateStore,
    pub(crate) guards: &'a OpGuards,
    pub(crate) health: &'a HealthMonitor,
    pub(crate) metrics: &'a Arc<Metrics>,
    /// ControllerModifyVolume hands new I/O limits to a guest.
    pub(crate) ops: &'a Arc<CrustOps>,
}

impl<'a> ControllerParts<'a> {
    /// A volume made from a snapshot or another volume is filled by the
    /// snapshot service.
    pub(crate) fn snapshots(&self) -> SnapshotParts<'a> {
        self.d.snapshots()
    }
}

/// What the snapshot and group snapshot RPCs use: no health monitor, no
/// metrics.
pub(crate) struct SnapshotParts<'a> {
    d: &'a Driver,
    pub(crate) cfg: &'a Config,
    pub(crate) backend: &'a Arc<dyn Backend>,
    pub(crate) state: &'a StateStore,
    pub(crate) guards: &'a OpGuards,
    /// A guest that has the volume mounted freezes it.
    pub(crate) ops: &'a Arc<CrustOps>,
}

impl<'a> SnapshotParts<'a> {
    /// Which sandbox claims a volume (to freeze it in its guest).
    pub(crate) fn deferred(&self) -> DeferParts<'a> {
        self.d.deferred()
    }
}

/// What the Node service uses; crust_ops only through [`DeferParts`].
pub(crate) struct NodeParts<'a> {
    d: &'a Driver,
    pub(crate) cfg: &'a Config,
    pub(crate) backend: &'a Arc<dyn Backend>,
    pub(crate) state: &'a StateStore,
    pub(crate) guards: &'a OpGuards,
    pub(crate) health: &'a HealthMonitor,
    pub(crate) metrics: &'a Arc<Metrics>,
}

impl<'a> NodeParts<'a> {
    /// A publication, stats poll or expansion with deferred filesystem
    /// operations.
    pub(crate) fn deferred(&self) -> DeferParts<'a> {
        self.d.deferred()
    }

    /// A volume handed to a guest and coming back.
    pub(crate) fn handover(&self) -> HandoverParts<'a> {
        self.d.handover()
    }
}

/// What the deferred routes (KEP-2857, through crust_ops) use: no guards
/// of their own (the Node RPC that calls them holds one).
pub(crate) struct DeferParts<'a> {
    d: &'a Driver,
    pub(crate) cfg: &'a Config,
    pub(crate) backend: &'a Arc<dyn Backend>,
    pub(crate) state: &'a StateStore,
    pub(crate) health: &'a HealthMonitor,
    pub(crate) metrics: &'a Arc<Metrics>,
    pub(crate) ops: &'a Arc<CrustOps>,
}

impl<'a> DeferParts<'a> {
    /// A deferred publication's target is prepared as a host one is.
    pub(crate) fn node(&self) -> NodeParts<'a> {
        self.d.node()
    }

    /// A volume a runtime took is taken back before it goes elsewhere.
    pub(crate) fn handover(&self) -> HandoverParts<'a> {
        self.d.handover()
    }
}

/// What the Handover service uses: no backend (a handover moves mounts
/// and records, never the backing store).
pub(crate) struct HandoverParts<'a> {
    d: &'a Driver,
    pub(crate) cfg: &'a Config,
    pub(crate) state: &'a StateStore,
    pub(crate) guards: &'a OpGuards,
    pub(crate) health: &'a HealthMonitor,
    pub(crate) ops: &'a Arc<CrustOps>,
}

impl<'a> HandoverParts<'a> {
    /// A handover finds the volume's record as the Node RPCs do.
    pub(crate) fn node(&self) -> NodeParts<'a> {
        self.d.node()
    }
}

/// Runs `f` on the blocking pool and converts its error to a gRPC status.
pub(crate) async fn blocking<T, E, F>(driver: &Arc<Driver>, f: F) -> Result<T, Status>
where
    F: FnOnce(&Driver) -> Result<T, E> + Send + 'static,
    T: Send + 'static,
    E: Into<Status> + Send + 'static,
{
    blocking_typed(driver, f).await?.map_err(Into::into)
}

/// [`blocking`], keeping the operation's own error for the caller to act
/// on (the outer error: the operation panicked).
pub(crate) async fn blocking_typed<T, E, F>(
    driver: &Arc<Driver>,
    f: F,
) -> Result<Result<T, E>, Status>
where
    F: FnOnce(&Driver) -> Result<T, E> + Send + 'static,
    T: Send + 'static,
    E: Send + 'static,
{
    let d = driver.clone();
    tokio::task::spawn_blocking(move || f(&d))
        .await
        .map_err(|e| Status::internal(format!("operation panicked: {e}")))
}
