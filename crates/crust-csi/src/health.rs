//! Volume health from real signals, served in both CSI generations:
//! `VolumeCondition` (v1.12: NodeGetVolumeStats, ListVolumes,
//! ControllerGetVolume) and `VolumeHealth` (v1.13: NodeGetVolumeHealth,
//! ControllerGetVolumeHealth, ControllerListVolumeHealth). Signals:
//!
//! * the backend's view of the backing store (file or device present,
//!   right size);
//! * for a staged volume: the recorded block device is still the one
//!   attached; for a filesystem, the staging mount exists and is that
//!   device, is not read-only unless asked (the kernel flips ext4 to
//!   read-only on errors), ext4 `errors_count` is zero, statfs/readdir do
//!   not fail (XFS answers EIO after a shutdown); for raw block, the
//!   device's first block can be read;
//! * every publish target is still mounted (bind of the staging mount or
//!   of the device node);
//! * a filesystem left unmounted on the host for deferred filesystem
//!   operations is checked like a raw device (first block readable), and
//!   its deferred publication (an empty directory by design) is not
//!   checked here: its condition comes from the runtime.
//!
//! Each problem found is a [`Problem`]: a v1.13 status (degraded,
//! inaccessible, data loss), a CamelCase reason and a message; the v1.12
//! condition is derived from the same list, so both generations always
//! agree. How each cause is classified:
//!
//! | cause | status | reason |
//! |---|---|---|
//! | backing store missing | INACCESSIBLE | `BackingStoreMissing` |
//! | backing store wrong size / unreadable metadata | DEGRADED | `BackingStoreDegraded` |
//! | staged device detached | INACCESSIBLE | `DeviceDetached` |
//! | backing store now attached as another device | DEGRADED | `DeviceChanged` |
//! | mount gone / something mounted over it | INACCESSIBLE | `NotMounted` / `MountedOver` |
//! | device node gone, size 0, unreadable | INACCESSIBLE | `DeviceMissing` / `DeviceEmpty` / `DeviceUnreadable` |
//! | filesystem or mount read-only although read-write was expected | DEGRADED | `FilesystemReadOnly` / `MountReadOnly` |
//! | ext4 recorded errors (corruption found) | DATA_LOSS | `FilesystemErrors` |
//! | filesystem answers EIO (XFS shutdown, failed device) | INACCESSIBLE | `FilesystemIoErrors` |
//! | a probe hung past its bound | INACCESSIBLE | `Unresponsive` |
//! | a probe could not run | DEGRADED | `HealthProbeFailed` |
//!
//! Checks that touch the volume can hang on a dead device, so they run on
//! worker threads with a time bound, and results are cached per volume for
//! a short TTL. A check still running when its bound expires is reported as
//! abnormal ("not responding") and is not started again while it hangs, so
//! a hung filesystem costs one thread, not one per RPC.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crust_backend::{Backend, BackingState};
use crust_blockdev::{Health, SymptomKind};
use crust_proto::csi::v1 as csi;

use crate::records::VolumeRecord;

/// A computed VolumeCondition (CSI v1.12).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    pub abnormal: bool,
    pub message: String,
}

impl Condition {
    pub fn normal(msg: impl Into<String>) -> Self {
        Condition {
            abnormal: false,
            message: msg.into(),
        }
    }

    pub fn abnormal(msg: impl Into<String>) -> Self {
        Condition {
            abnormal: true,
            message: msg.into(),
        }
    }
}

impl From<Condition> for csi::VolumeCondition {
    fn from(c: Condition) -> Self {
        csi::VolumeCondition {
            abnormal: c.abnormal,
            message: c.message,
        }
    }
}

/// CSI v1.13's volume health status categories.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Usable, not operating optimally.
    Degraded,
    /// Not accessible.
    Inaccessible,
    /// Data loss known or strongly suspected.
    DataLoss,
}

impl From<Status> for csi::VolumeHealthErrorType {
    fn from(s: Status) -> Self {
        match s {
            Status::Degraded => csi::VolumeHealthErrorType::Degraded,
            Status::Inaccessible => csi::VolumeHealthErrorType::Inaccessible,
            Status::DataLoss => csi::VolumeHealthErrorType::DataLoss,
        }
    }
}

/// One thing wrong with a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub status: Status,
    /// CamelCase, stable for machines.
    pub reason: &'static str,
    pub message: String,
}

impl Problem {
    pub fn new(status: Status, reason: &'static str, message: impl Into<String>) -> Self {
        Problem {
            status,
            reason,
            message: message.into(),
        }
    }

    /// A host probe's finding, classified (see the module table).
    pub fn from_symptom(s: crust_blockdev::Symptom) -> Self {
        use SymptomKind as K;
        let status = match s.kind {
            K::NotMounted
            | K::MountedOver
            | K::DeviceMissing
            | K::DeviceEmpty
            | K::DeviceUnreadable
            | K::FilesystemIoErrors
            | K::Unresponsive => Status::Inaccessible,
            K::FilesystemReadOnly | K::MountReadOnly | K::ProbeFailed => Status::Degraded,
            K::FilesystemErrors => Status::DataLoss,
        };
        Problem::new(status, s.kind.reason(), s.message)
    }
}

/// Everything known to be wrong with one volume, plus the message to give
/// when nothing is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assessment {
    pub problems: Vec<Problem>,
    pub normal_message: String,
}

impl Assessment {
    pub fn healthy(msg: impl Into<String>) -> Self {
        Assessment {
            problems: Vec::new(),
            normal_message: msg.into(),
        }
    }

    pub fn of(problems: Vec<Problem>) -> Self {
        Assessment {
            problems,
            normal_message: "volume is healthy".into(),
        }
    }

    pub fn is_abnormal(&self) -> bool {
        !self.problems.is_empty()
    }

    pub fn push(&mut self, p: Problem) {
        self.problems.push(p);
    }

    /// The v1.12 condition: abnormal with every message, or normal.
    pub fn condition(&self) -> Condition {
        if self.problems.is_empty() {
            Condition::normal(self.normal_message.clone())
        } else {
            let msgs: Vec<&str> = self.problems.iter().map(|p| p.message.as_str()).collect();
            Condition::abnormal(msgs.join("; "))
        }
    }

    /// The v1.13 answer. The spec forbids two entries with the same
    /// (status, reason): their messages are joined.
    pub fn volume_health(&self, volume_id: &str) -> csi::VolumeHealth {
        let mut entries: Vec<csi::volume_health::VolumeHealthEntry> = Vec::new();
        let mut keys: Vec<(Status, &str)> = Vec::new();
        for p in &self.problems {
            match keys.iter().position(|k| *k == (p.status, p.reason)) {
                Some(i) => {
                    let e = &mut entries[i];
                    e.message = format!("{}; {}", e.message, p.message);
                }
                None => {
                    keys.push((p.status, p.reason));
                    entries.push(csi::volume_health::VolumeHealthEntry {
                        status: csi::VolumeHealthErrorType::from(p.status) as i32,
                        reason: p.reason.to_string(),
                        message: p.message.clone(),
                    });
                }
            }
        }
        csi::VolumeHealth {
            volume_id: volume_id.to_string(),
            health_statuses: entries,
        }
    }
}

/// Where a pending check leaves its result.
struct Slot {
    result: Mutex<Option<Assessment>>,
    cv: Condvar,
    started: Instant,
}

impl Slot {
    fn new() -> Arc<Slot> {
        Arc::new(Slot {
            result: Mutex::new(None),
            cv: Condvar::new(),
            started: Instant::now(),
        })
    }

    fn wait_until(&self, deadline: Instant) -> Option<Assessment> {
        let mut g = self.result.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(c) = g.as_ref() {
                return Some(c.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[derive(Default)]
struct Inner {
    /// id -> (computed at, generation, assessment)
    cache: HashMap<String, (Instant, u64, Assessment)>,
    /// Bumped by `forget` so results of checks started before a state
    /// change are not cached as current.
    generation: HashMap<String, u64>,
    /// (id, generation) -> running check
    inflight: HashMap<(String, u64), Arc<Slot>>,
    /// Other time-bounded operations (statvfs) by key.
    ops: HashMap<String, Instant>,
}

/// Cached, time-bounded health checks.
pub struct HealthMonitor {
    /// What a check reads: the backing stores, and crust_ops for the
    /// sandbox holding a deferred publication.
    backend: Arc<dyn crust_backend::Backend>,
    ops: Arc<crust_ops::CrustOps>,
    ttl: Duration,
    timeout: Duration,
    inner: Arc<Mutex<Inner>>,
    workers: Arc<crate::workers::Workers>,
}

impl HealthMonitor {
    pub fn new(
        backend: Arc<dyn crust_backend::Backend>,
        ops: Arc<crust_ops::CrustOps>,
        ttl: Duration,
        timeout: Duration,
    ) -> Self {
        HealthMonitor {
            backend,
            ops,
            ttl,
            timeout,
            inner: Arc::default(),
            workers: crate::workers::Workers::new(),
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops the cached condition of `id` (its state just changed).
    pub fn forget(&self, id: &str) {
        let mut g = self.lock();
        g.cache.remove(id);
        *g.generation.entry(id.to_string()).or_default() += 1;
    }

    pub fn condition(&self, rec: &VolumeRecord) -> Condition {
        self.assess(rec).condition()
    }

    /// Conditions of `recs`, in order, within one time bound overall.
    pub fn conditions(&self, recs: &[VolumeRecord]) -> Vec<Condition> {
        self.assessments(recs)
            .iter()
            .map(Assessment::condition)
            .collect()
    }

    pub fn assess(&self, rec: &VolumeRecord) -> Assessment {
        self.assessments(std::slice::from_ref(rec))
            .pop()
            .expect("one record in, one assessment out")
    }

    /// Assessments of `recs`, in order, within one time bound overall.
    pub fn assessments(&self, recs: &[VolumeRecord]) -> Vec<Assessment> {
        enum Pending {
            Done(Assessment),
            Wait(Arc<Slot>),
        }
        let mut pending = Vec::with_capacity(recs.len());
        // Unstaged volumes only need the backend's cheap look at the
        // backing store: they share one worker. Staged volumes touch
        // filesystems and devices that may hang: one worker each.
        let mut light: Vec<(VolumeRecord, u64, Arc<Slot>)> = Vec::new();
        {
            let mut g = self.lock();
            let now = Instant::now();
            for rec in recs {
                let gen_ = g.generation.get(&rec.id).copied().unwrap_or(0);
                if let Some((at, cgen, c)) = g.cache.get(&rec.id)
                    && *cgen == gen_
                    && now.duration_since(*at) < self.ttl
                {
                    pending.push(Pending::Done(c.clone()));
                    continue;
                }
                let key = (rec.id.clone(), gen_);
                if let Some(slot) = g.inflight.get(&key) {
                    pending.push(Pending::Wait(slot.clone()));
                    continue;
                }
                let slot = Slot::new();
                g.inflight.insert(key, slot.clone());
                pending.push(Pending::Wait(slot.clone()));
                if rec.staging.is_none() && rec.published.is_empty() {
                    light.push((rec.clone(), gen_, slot));
                } else {
                    self.spawn(vec![(rec.clone(), gen_, slot)]);
                }
            }
        }
        if !light.is_empty() {
            self.spawn(light);
        }
        let deadline = Instant::now() + self.timeout;
        pending
            .into_iter()
            .map(|p| match p {
                Pending::Done(c) => c,
                Pending::Wait(slot) => slot.wait_until(deadline).unwrap_or_else(|| {
                    Assessment::of(vec![Problem::new(
                        Status::Inaccessible,
                        SymptomKind::Unresponsive.reason(),
                        format!(
                            "health check has not finished after {:.1}s: the volume's \
                             filesystem or device is not responding (hung I/O?); check the \
                             kernel log for errors on its device",
                            slot.started.elapsed().as_secs_f64()
                        ),
                    )])
                }),
            })
            .collect()
    }

    fn spawn(&self, jobs: Vec<(VolumeRecord, u64, Arc<Slot>)>) {
        let inner = self.inner.clone();
        let backend = self.backend.clone();
        let ops = self.ops.clone();
        let run = move || {
            // The sandbox holding a deferred publication, as its runtime
            // establishes it (never what a guest says).
            let claimant = |target: &str| ops.claimant_state(target);
            for (rec, gen_, slot) in jobs {
                let c = evaluate(&*backend, &rec, &claimant);
                {
                    let mut g = inner.lock().unwrap_or_else(|e| e.into_inner());
                    g.inflight.remove(&(rec.id.clone(), gen_));
                    if g.generation.get(&rec.id).copied().unwrap_or(0) == gen_ {
                        g.cache
                            .insert(rec.id.clone(), (Instant::now(), gen_, c.clone()));
                    }
                }
                *slot.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
                slot.cv.notify_all();
            }
        };
        if let Err(e) = self.workers.run("crust-csi-health", run) {
            tracing::error!(error = %e, "cannot start health check thread");
        }
    }

    /// Runs `f` on a worker thread and waits at most the health timeout.
    /// While an earlier call with the same `key` is still running (hung),
    /// fails at once instead of starting another thread.
    pub fn bounded<T, F>(&self, key: &str, f: F) -> Result<T, String>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        {
            let mut g = self.lock();
            if let Some(started) = g.ops.get(key) {
                return Err(format!(
                    "a previous {key} has not returned for {:.1}s (hung filesystem or device?)",
                    started.elapsed().as_secs_f64()
                ));
            }
            g.ops.insert(key.to_string(), Instant::now());
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let inner = self.inner.clone();
        let k = key.to_string();
        let spawned = self.workers.run("crust-csi-bounded", move || {
            let r = f();
            inner
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .ops
                .remove(&k);
            let _ = tx.send(r);
        });
        if let Err(e) = spawned {
            self.lock().ops.remove(key);
            return Err(format!("cannot start worker thread: {e}"));
        }
        rx.recv_timeout(self.timeout).map_err(|_| {
            format!(
                "{key} did not answer within {:.1}s (hung filesystem or device?)",
                self.timeout.as_secs_f64()
            )
        })
    }
}

/// Every signal for one volume; may block on a hung device (runs on a
/// worker thread).
pub(crate) fn evaluate(
    backend: &dyn Backend,
    rec: &VolumeRecord,
    claimant: &dyn Fn(&str) -> Option<crust_ops::ClaimantState>,
) -> Assessment {
    let mut problems: Vec<Problem> = Vec::new();
    match backend.backing_state(&rec.id) {
        BackingState::Healthy => {}
        BackingState::Missing(m) => problems.push(Problem::new(
            Status::Inaccessible,
            "BackingStoreMissing",
            format!(
                "backing store is missing ({m}): the volume's data is gone or was moved outside \
                 the plugin; restore it, or delete the volume"
            ),
        )),
        BackingState::Degraded(m) => problems.push(Problem::new(
            Status::Degraded,
            "BackingStoreDegraded",
            format!("backing store is degraded: {m}"),
        )),
    }
    if let Some(s) = &rec.staging {
        match backend.attached_device(&rec.id) {
            Ok(Some(dev)) if dev == s.device => {}
            Ok(Some(dev)) => problems.push(Problem::new(
                Status::Degraded,
                "DeviceChanged",
                format!(
                    "volume is staged on {} but its backing store is now attached as {}; \
                     unstage and stage it again",
                    s.device.display(),
                    dev.display()
                ),
            )),
            Ok(None) => problems.push(Problem::new(
                Status::Inaccessible,
                "DeviceDetached",
                format!(
                    "volume is staged but its block device {} is no longer attached; \
                     unstage and stage it again (restart the pod)",
                    s.device.display()
                ),
            )),
            Err(e) => problems.push(Problem::new(
                Status::Degraded,
                SymptomKind::ProbeFailed.reason(),
                format!("cannot tell whether the device is attached: {e}"),
            )),
        }
        if problems.is_empty() {
            let h = if s.block || s.host_mount != crate::records::HostMount::Mounted {
                crust_blockdev::device_health(&s.device)
            } else {
                crust_blockdev::fs_health(&s.device, &s.path, s.readonly)
            };
            if let Health::Abnormal(symptom) = h {
                problems.push(Problem::from_symptom(symptom));
            }
        }
        for (target, p) in rec.host_publications() {
            if let Some(m) = publication_problem(&s.device, target, p.block) {
                problems.push(m);
            }
        }
    }
    for (target, _) in rec.published.iter().filter(|(_, p)| p.deferred) {
        use crust_handoff::SandboxState;
        let Some(c) = target.to_str().and_then(claimant) else {
            continue;
        };
        match c.state {
            SandboxState::Running => {}
            SandboxState::Stopped => problems.push(Problem::new(
                Status::Inaccessible,
                "SandboxNotRunning",
                format!(
                    "sandbox {} that holds the volume (published at {}) is stopped: {}; the \
                     pod's VM is gone",
                    c.sandbox,
                    target.display(),
                    c.detail
                ),
            )),
            SandboxState::Unknown => problems.push(Problem::new(
                Status::Inaccessible,
                "SandboxUnknown",
                format!(
                    "sandbox {} that holds the volume (published at {}) is unknown to its \
                     runtime: {}",
                    c.sandbox,
                    target.display(),
                    c.detail
                ),
            )),
        }
    }
    Assessment::of(problems)
}

/// Whether a publish target still shows the volume.
fn publication_problem(device: &Path, target: &Path, block: bool) -> Option<Problem> {
    let t = target.display();
    if block {
        let same = match (rustix::fs::stat(device), rustix::fs::stat(target)) {
            (Ok(d), Ok(t)) => {
                rustix::fs::FileType::from_raw_mode(t.st_mode) == rustix::fs::FileType::BlockDevice
                    && d.st_rdev == t.st_rdev
            }
            _ => false,
        };
        return (!same).then(|| {
            Problem::new(
                Status::Inaccessible,
                SymptomKind::NotMounted.reason(),
                format!(
                    "publish target {t} no longer exposes the block device {} (unmounted \
                     outside the plugin?); unpublish and publish again",
                    device.display()
                ),
            )
        });
    }
    match crust_blockdev::find_mount(target) {
        Ok(Some(m)) => {
            let ok = crust_blockdev::device_major_minor(device)
                .map(|mm| mm == (m.major, m.minor))
                .unwrap_or(false);
            (!ok).then(|| {
                Problem::new(
                    Status::Inaccessible,
                    SymptomKind::MountedOver.reason(),
                    format!(
                        "publish target {t} shows {} instead of the volume's filesystem; \
                         unpublish and publish again",
                        m.source
                    ),
                )
            })
        }
        Ok(None) => Some(Problem::new(
            Status::Inaccessible,
            SymptomKind::NotMounted.reason(),
            format!(
                "publish target {t} is no longer mounted (unmounted outside the plugin); \
                 unpublish and publish again"
            ),
        )),
        Err(e) => Some(Problem::new(
            Status::Degraded,
            SymptomKind::ProbeFailed.reason(),
            format!("cannot read the mount table: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caps::FsType;
    use crate::driver::Driver;
    use crate::records::{Phase, RECORD_VERSION};
    use crust_backend::{Allocation, BackendError, Capacity};
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    /// A backend whose backing_state can be made to hang or fail; only
    /// the health module's caching and time bounds are under test here.
    struct FakeBackend {
        state: Mutex<BackingState>,
        delay: Mutex<Duration>,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl Backend for FakeBackend {
        fn kind(&self) -> &'static str {
            "fake"
        }
        fn create(&self, _: &str, _: u64, _: u64) -> crust_backend::Result<Allocation> {
            Err(BackendError::Invalid("fake".into()))
        }
        fn delete(&self, _: &str) -> crust_backend::Result<()> {
            Ok(())
        }
        fn get(&self, _: &str) -> crust_backend::Result<Option<Allocation>> {
            Ok(None)
        }
        fn list(&self) -> crust_backend::Result<Vec<Allocation>> {
            Ok(vec![])
        }
        fn expand(&self, _: &str, n: u64) -> crust_backend::Result<u64> {
            Ok(n)
        }
        fn attach(&self, _: &str) -> crust_backend::Result<PathBuf> {
            Err(BackendError::Invalid("fake".into()))
        }
        fn attached_device(&self, _: &str) -> crust_backend::Result<Option<PathBuf>> {
            Ok(None)
        }
        fn detach(&self, _: &str) -> crust_backend::Result<()> {
            Ok(())
        }
        fn capacity(&self) -> crust_backend::Result<Capacity> {
            Ok(Capacity {
                available_bytes: 0,
                maximum_volume_size: 0,
                minimum_volume_size: 0,
            })
        }
        fn probe(&self) -> crust_backend::Result<()> {
            Ok(())
        }
        fn backing_state(&self, _: &str) -> BackingState {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let d = *self.delay.lock().unwrap();
            std::thread::sleep(d);
            self.state.lock().unwrap().clone()
        }
        fn storage_health(&self) -> Vec<crust_backend::StorageProblem> {
            vec![]
        }
    }

    fn rec(id: &str) -> VolumeRecord {
        VolumeRecord {
            version: RECORD_VERSION,
            id: id.into(),
            name: id.into(),
            phase: Phase::Ready,
            capacity_bytes: 1,
            required_bytes: 0,
            limit_bytes: 0,
            fs_type: FsType::Ext4,
            parameters: BTreeMap::new(),
            capabilities: vec![],
            node_id: "n".into(),
            staging: None,
            published: BTreeMap::new(),
            content_source: None,
            inherited: None,
            raw_block_used: false,
            formatted: None,
            format_started: None,
            handover: None,
            returned: None,
            created_targets: Default::default(),
            io_limits: Default::default(),
            limits_issued_ms: 0,
        }
    }

    fn driver_with(backend: Arc<FakeBackend>, ttl: Duration, timeout: Duration) -> Arc<Driver> {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = crate::config::Config::pool(
            tmp.path().join("s.sock"),
            tmp.path().join("state"),
            tmp.path().join("pool"),
            1 << 20,
        );
        cfg.health_ttl = ttl;
        cfg.health_timeout = timeout;
        let d = Driver::new(cfg, backend).unwrap();
        std::mem::forget(tmp);
        d
    }

    #[test]
    fn results_are_cached_for_the_ttl_and_dropped_on_forget() {
        let b = Arc::new(FakeBackend {
            state: Mutex::new(BackingState::Healthy),
            delay: Mutex::new(Duration::ZERO),
            calls: Default::default(),
        });
        let d = driver_with(b.clone(), Duration::from_secs(60), Duration::from_secs(5));
        let r = rec("vol-a");
        assert!(!d.health_monitor().condition(&r).abnormal);
        *b.state.lock().unwrap() = BackingState::Missing("file gone".into());
        // cached
        assert!(!d.health_monitor().condition(&r).abnormal);
        assert_eq!(b.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        d.health_monitor().forget("vol-a");
        let c = d.health_monitor().condition(&r);
        assert!(c.abnormal);
        assert!(c.message.contains("file gone"), "{}", c.message);
    }

    #[test]
    fn a_hung_check_is_bounded_and_not_restarted() {
        let b = Arc::new(FakeBackend {
            state: Mutex::new(BackingState::Healthy),
            delay: Mutex::new(Duration::from_millis(1500)),
            calls: Default::default(),
        });
        let d = driver_with(b.clone(), Duration::ZERO, Duration::from_millis(100));
        let r = rec("vol-h");
        let t0 = Instant::now();
        let c = d.health_monitor().condition(&r);
        assert!(c.abnormal && c.message.contains("not responding"), "{c:?}");
        assert!(t0.elapsed() < Duration::from_millis(1000));
        // second call joins the running check instead of starting another
        let c = d.health_monitor().condition(&r);
        assert!(c.abnormal);
        assert_eq!(b.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        // bounded() refuses to pile up behind a hung op
        let hm = d.health_monitor();
        let e = hm
            .bounded("statvfs /x", || {
                std::thread::sleep(Duration::from_millis(800))
            })
            .unwrap_err();
        assert!(e.contains("did not answer"), "{e}");
        let e = hm.bounded("statvfs /x", || ()).unwrap_err();
        assert!(e.contains("has not returned"), "{e}");
        assert_eq!(hm.bounded("statvfs /y", || 7).unwrap(), 7);
        // after the hang clears, checks run again
        std::thread::sleep(Duration::from_millis(1600));
        *b.delay.lock().unwrap() = Duration::ZERO;
        assert!(!d.health_monitor().condition(&r).abnormal);
        assert_eq!(hm.bounded("statvfs /x", || 1).unwrap(), 1);
    }
}
