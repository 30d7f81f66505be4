//! The sandbox state store: `<root>/<id>/` (0700) holding `state.json`
//! (written atomically), the shim's socket and log, and the VM run dir.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crust_handoff::SandboxLiveness;
use serde::{Deserialize, Serialize};

use crate::bundle::Bundle;
use crate::discovery::{Volume, WorkloadMount};

pub const STATE_FILE: &str = "state.json";
pub const SHIM_SOCKET: &str = "shim.sock";
pub const SHIM_LOG: &str = "shim.log";
pub const VM_DIR: &str = "vm";
/// The OCI runtime spec version the `state` output follows.
pub const OCI_VERSION: &str = "1.0.2";

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox id {0:?} is invalid: {1}")]
    InvalidId(String, String),
    #[error("sandbox {0} already exists")]
    AlreadyExists(String),
    #[error("sandbox {0} does not exist")]
    NotFound(String),
    #[error("sandbox {id}: state.json is corrupt: {reason}")]
    Corrupt { id: String, reason: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> SandboxError {
    let context = context.into();
    move |source| SandboxError::Io { context, source }
}

/// OCI lifecycle status, plus `creating` while the shim sets up the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Creating,
    Created,
    Running,
    Stopped,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Creating => "creating",
            Status::Created => "created",
            Status::Running => "running",
            Status::Stopped => "stopped",
        }
    }
}

/// A process identified by pid and start time (so a recycled pid is not
/// mistaken for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcRef {
    pub pid: i32,
    pub start_time: u64,
}

impl ProcRef {
    pub fn of(pid: i32) -> Option<ProcRef> {
        proc_start_time(pid).map(|start_time| ProcRef { pid, start_time })
    }

    pub fn current() -> ProcRef {
        ProcRef::of(std::process::id() as i32).expect("/proc/self/stat is readable")
    }

    /// Still running (not a zombie) and still the same process.
    pub fn alive(&self) -> bool {
        proc_start_time(self.pid) == Some(self.start_time)
    }
}

/// Start time (clock ticks since boot) of a live, non-zombie process.
pub fn proc_start_time(pid: i32) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: skip past the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is the state (field 3), starttime is field 22.
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// A host path bound into the sandbox's virtio-fs share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharedMount {
    pub destination: String,
    pub source: String,
    /// Path inside the share (`m<i>`).
    pub path: String,
    pub readonly: bool,
}

/// Everything persisted about one sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxState {
    pub oci_version: String,
    pub id: String,
    pub status: Status,
    /// OCI `pid`: the host process hosting the workload (QEMU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    pub bundle: PathBuf,
    #[serde(default)]
    pub shim: Option<ProcRef>,
    #[serde(default)]
    pub qemu: Option<ProcRef>,
    /// The guest's accelerator and why it was chosen (a hanging KVM boot
    /// retried under TCG shows `fallback: true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accel: Option<crust_vmm::AccelChoice>,
    #[serde(default)]
    pub volumes: Vec<Volume>,
    /// How QEMU does each plugged volume's I/O (O_DIRECT or not, the
    /// engine), by target path.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub block_io: std::collections::BTreeMap<String, crust_qmp::BlockIo>,
    #[serde(default)]
    pub mounts: Vec<WorkloadMount>,
    /// Host-path mounts without a hand-off record (not visible in the guest).
    #[serde(default)]
    pub skipped_mounts: Vec<String>,
    /// Host-path mounts without a hand-off record shared into the guest
    /// over virtio-fs (`--share-binds`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared_mounts: Vec<SharedMount>,
    /// Mount sources crust-csi was asked to hand over, recorded before
    /// asking: the plugin may write a record claimed by this sandbox,
    /// which teardown releases and hands back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handover_asked: Vec<String>,
    /// What became of each handover candidate (handed over with its
    /// latency, or left on the host and why).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<crate::handover::VolumeEvent>,
    /// The workload's exit code once it has exited.
    #[serde(default)]
    pub exit_status: Option<i32>,
    /// Why the sandbox stopped abnormally (e.g. QEMU exited).
    #[serde(default)]
    pub reason: Option<String>,
    /// Seconds since the epoch.
    pub created: u64,
    #[serde(default)]
    pub annotations: std::collections::BTreeMap<String, String>,
    /// The pod's network namespace whose interfaces the guest mirrors, and
    /// those interfaces: what a dead shim's cleanup detaches (taps, tc).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network_links: Vec<String>,
}

impl SandboxState {
    pub fn new(id: &str, bundle: &Bundle) -> SandboxState {
        SandboxState::for_bundle_dir(id, bundle.dir.clone())
    }

    /// A sandbox being created from the bundle in `dir`, nothing started.
    pub fn for_bundle_dir(id: &str, dir: std::path::PathBuf) -> SandboxState {
        SandboxState {
            oci_version: OCI_VERSION.into(),
            id: id.into(),
            status: Status::Creating,
            pid: None,
            bundle: dir,
            shim: None,
            qemu: None,
            accel: None,
            volumes: Vec::new(),
            block_io: Default::default(),
            mounts: Vec::new(),
            skipped_mounts: Vec::new(),
            shared_mounts: Vec::new(),
            handover_asked: Vec::new(),
            events: Vec::new(),
            exit_status: None,
            reason: None,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            annotations: Default::default(),
            network_namespace: None,
            network_links: Vec::new(),
        }
    }

    /// Whether this sandbox still holds its volumes (the hand-off claim's
    /// liveness test): its QEMU runs (whether or not its shim does), or,
    /// before QEMU is launched, its shim runs and is still creating it. A
    /// sandbox whose workload exited still holds them: the guest keeps them
    /// mounted until delete.
    pub fn holds_volumes(&self) -> bool {
        // A QEMU that outlived its shim (stuck in the kernel after the
        // shim died) may still have the devices open.
        if self.qemu.is_some_and(|q| q.alive()) {
            return true;
        }
        self.qemu.is_none()
            && self.status != Status::Stopped
            && self.shim.is_some_and(|s| s.alive())
    }

    /// The status as seen from outside: a sandbox whose shim is gone is
    /// stopped whatever the file says.
    pub fn effective(mut self) -> SandboxState {
        if self.status != Status::Stopped && !self.shim.is_some_and(|s| s.alive()) {
            self.status = Status::Stopped;
            self.reason
                .get_or_insert_with(|| "the sandbox's shim is not running".into());
        }
        self
    }
}

/// `<root>/<id>/...` for every sandbox.
#[derive(Debug, Clone)]
pub struct SandboxStore {
    root: PathBuf,
}

impl SandboxStore {
    pub fn new(root: impl Into<PathBuf>) -> SandboxStore {
        SandboxStore { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn check_id(id: &str) -> Result<(), SandboxError> {
        crust_handoff::validate::check_sandbox_id(id)
            .map_err(|r| SandboxError::InvalidId(id.into(), r))
    }

    pub fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    pub fn socket(&self, id: &str) -> PathBuf {
        self.dir(id).join(SHIM_SOCKET)
    }

    pub fn log(&self, id: &str) -> PathBuf {
        self.dir(id).join(SHIM_LOG)
    }

    pub fn vm_dir(&self, id: &str) -> PathBuf {
        self.dir(id).join(VM_DIR)
    }

    /// Creates `<root>/<id>/` (0700). An existing one: AlreadyExists.
    pub fn create(&self, id: &str) -> Result<(), SandboxError> {
        Self::check_id(id)?;
        if !self.root.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.root)
                .map_err(io(format!("create {}", self.root.display())))?;
        }
        let dir = self.dir(id);
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(SandboxError::AlreadyExists(id.into()));
            }
            Err(e) => return Err(io(format!("create {}", dir.display()))(e)),
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io(format!("chmod {}", dir.display())))?;
        fsync_dir(&self.root)
    }

    pub fn exists(&self, id: &str) -> bool {
        Self::check_id(id).is_ok() && self.dir(id).is_dir()
    }

    pub fn load(&self, id: &str) -> Result<SandboxState, SandboxError> {
        Self::check_id(id)?;
        let path = self.dir(id).join(STATE_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(SandboxError::NotFound(id.into()));
            }
            Err(e) => return Err(io(format!("read {}", path.display()))(e)),
        };
        serde_json::from_slice(&bytes).map_err(|e| SandboxError::Corrupt {
            id: id.into(),
            reason: e.to_string(),
        })
    }

    /// Temp file in the same dir, fsync, rename, fsync the dir.
    pub fn save(&self, state: &SandboxState) -> Result<(), SandboxError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        Self::check_id(&state.id)?;
        let dir = self.dir(&state.id);
        if !dir.is_dir() {
            return Err(SandboxError::NotFound(state.id.clone()));
        }
        let tmp = dir.join(format!(
            ".{STATE_FILE}.{}.{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let body = serde_json::to_vec_pretty(state).expect("state serializes");
        let res = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
            std::fs::rename(&tmp, dir.join(STATE_FILE))
        })();
        if let Err(e) = res {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(format!("write {}/{STATE_FILE}", dir.display()))(e));
        }
        fsync_dir(&dir)
    }

    /// Removes the sandbox directory and everything in it. Missing: Ok.
    pub fn remove(&self, id: &str) -> Result<(), SandboxError> {
        Self::check_id(id)?;
        let dir = self.dir(id);
        // A share's binds (volume data) must never be deleted through.
        crate::share::unmount_tree(&dir);
        let left = crate::share::mounts_below(&dir);
        if !left.is_empty() {
            return Err(io(format!("remove {}", dir.display()))(
                std::io::Error::other(format!("still mounted below it: {}", left[0].display())),
            ));
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io(format!("remove {}", dir.display()))(e)),
        }
        fsync_dir(&self.root)
    }

    /// Ids of every sandbox directory.
    pub fn list(&self) -> Result<Vec<String>, SandboxError> {
        let rd = match std::fs::read_dir(&self.root) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(format!("read {}", self.root.display()))(e)),
        };
        let mut ids: Vec<String> = rd
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| Self::check_id(n).is_ok())
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// The claim liveness test: a sandbox of this root that still holds
    /// its volumes. An id unknown to this root is a stale claim.
    pub fn holds_volumes(&self, id: &str) -> bool {
        self.load(id).is_ok_and(|s| s.holds_volumes())
    }

    /// The sandbox's liveness as the host establishes it, for `crust
    /// sandbox-state` (the one place this typed answer is built; see
    /// [`crust_handoff::liveness`]). `stopped` only when this root's own
    /// record shows its QEMU (or, before QEMU, its shim) dead by pid and
    /// start time; an id this root does not know, or whose record cannot
    /// be read, is `unknown`.
    pub fn liveness(&self, id: &str) -> SandboxLiveness {
        use crust_handoff::SandboxState as S;
        if Self::check_id(id).is_err() {
            return SandboxLiveness::new(id, S::Unknown, "not a valid sandbox id");
        }
        let st = match self.load(id) {
            Ok(st) => st,
            Err(SandboxError::NotFound(_)) => {
                return SandboxLiveness::new(
                    id,
                    S::Unknown,
                    format!("runtime root {} has no record of it", self.root.display()),
                );
            }
            Err(e) => return SandboxLiveness::new(id, S::Unknown, e.to_string()),
        };
        let proc_desc =
            |what: &str, p: &ProcRef| format!("{what} pid {} (start time {})", p.pid, p.start_time);
        if st.holds_volumes() {
            let who = match (st.qemu, st.shim) {
                (Some(q), _) => format!("{} runs", proc_desc("QEMU", &q)),
                (None, Some(s)) => format!("{} is starting its VM", proc_desc("shim", &s)),
                (None, None) => "it is being created".into(),
            };
            return SandboxLiveness::new(id, S::Running, who);
        }
        let why = match (st.qemu, st.shim) {
            (Some(q), _) => format!("{} exited", proc_desc("QEMU", &q)),
            (None, Some(s)) if s.alive() => "it stopped before its VM started".to_string(),
            (None, Some(s)) => format!("{} exited before its VM started", proc_desc("shim", &s)),
            (None, None) => "it stopped before its shim started".to_string(),
        };
        SandboxLiveness::new(id, S::Stopped, why)
    }
}

fn fsync_dir(dir: &Path) -> Result<(), SandboxError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io(format!("fsync {}", dir.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundle() -> Bundle {
        Bundle {
            dir: "/b".into(),
            args: vec!["/bin/true".into()],
            env: vec![],
            cwd: "/".into(),
            uid: 0,
            gid: 0,
            additional_gids: vec![],
            mounts: vec![],
            pod_uid: None,
            defer_required: false,
            seccomp: false,
            user_namespace: false,
        }
    }

    #[test]
    fn create_save_load_remove() {
        let d = tempfile::tempdir().unwrap();
        let store = SandboxStore::new(d.path().join("root"));
        store.create("sb1").unwrap();
        assert!(matches!(
            store.create("sb1"),
            Err(SandboxError::AlreadyExists(_))
        ));
        assert!(matches!(
            store.create("../x"),
            Err(SandboxError::InvalidId(..))
        ));
        let mode = std::fs::metadata(store.dir("sb1"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        assert!(matches!(store.load("sb1"), Err(SandboxError::NotFound(_))));
        let mut st = SandboxState::new("sb1", &bundle());
        st.shim = Some(ProcRef::current());
        store.save(&st).unwrap();
        assert_eq!(store.load("sb1").unwrap(), st);
        let mode = std::fs::metadata(store.dir("sb1").join(STATE_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // No temp file left behind.
        let names: Vec<_> = std::fs::read_dir(store.dir("sb1"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, [STATE_FILE]);
        assert!(store.holds_volumes("sb1"), "being created");
        st.status = Status::Stopped;
        store.save(&st).unwrap();
        assert!(!store.holds_volumes("sb1"), "failed before QEMU");
        // With a VM: its liveness decides, whatever the workload did.
        st.qemu = Some(ProcRef::current());
        store.save(&st).unwrap();
        assert!(store.holds_volumes("sb1"), "workload stopped, VM up");
        st.qemu = Some(ProcRef {
            pid: i32::MAX,
            start_time: 1,
        });
        st.status = Status::Running;
        store.save(&st).unwrap();
        assert!(!store.holds_volumes("sb1"), "QEMU gone");
        // A QEMU that outlived its shim still holds the devices.
        st.qemu = Some(ProcRef::current());
        st.shim = Some(ProcRef {
            pid: i32::MAX,
            start_time: 1,
        });
        store.save(&st).unwrap();
        assert!(store.holds_volumes("sb1"), "shim gone, VM up");
        st.shim = Some(ProcRef::current());
        st.qemu = Some(ProcRef {
            pid: i32::MAX,
            start_time: 1,
        });
        store.save(&st).unwrap();
        assert!(!store.holds_volumes("unknown"));
        assert_eq!(store.list().unwrap(), ["sb1"]);
        store.remove("sb1").unwrap();
        store.remove("sb1").unwrap();
        assert!(store.list().unwrap().is_empty());
    }

    #[test]
    fn liveness_uses_start_time() {
        let me = ProcRef::current();
        assert!(me.alive());
        assert!(
            !ProcRef {
                start_time: me.start_time + 1,
                ..me
            }
            .alive()
        );
        assert!(
            !ProcRef {
                pid: 0,
                start_time: 0
            }
            .alive()
        );
        let mut st = SandboxState::new("x", &bundle());
        st.status = Status::Running;
        st.shim = Some(ProcRef {
            start_time: me.start_time + 1,
            ..me
        });
        let eff = st.effective();
        assert_eq!(eff.status, Status::Stopped);
        assert!(eff.reason.unwrap().contains("shim"));
    }

    #[test]
    fn corrupt_state_is_reported() {
        let d = tempfile::tempdir().unwrap();
        let store = SandboxStore::new(d.path());
        store.create("c").unwrap();
        std::fs::write(store.dir("c").join(STATE_FILE), b"{").unwrap();
        assert!(matches!(store.load("c"), Err(SandboxError::Corrupt { .. })));
    }
}
