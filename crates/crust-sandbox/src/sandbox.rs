//! The sandbox state store: `<root>/<id>/` (0700) holding `state.json`
//! (written atomically), the shim's socket and log, and the VM run dir.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crust_handoff::SandboxLiveness;

// The records' old paths, which crust-shim and the tests use.
pub use crate::records::{
    OCI_VERSION, ProcRef, SandboxState, SharedMount, Status, proc_start_time,
};

pub const STATE_FILE: &str = "state.json";
pub const SHIM_SOCKET: &str = "shim.sock";
pub const SHIM_LOG: &str = "shim.log";
pub const VM_DIR: &str = "vm";

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

/// How long a killed process gets to disappear.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// SIGKILL and wait until the process is gone (or a zombie).
pub fn kill_and_wait(p: ProcRef) {
    if !p.alive() {
        return;
    }
    if let Some(pid) = rustix::process::Pid::from_raw(p.pid) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
    let deadline = Instant::now() + KILL_WAIT;
    while p.alive() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::Bundle;

    fn bundle() -> Bundle {
        crate::bundle::for_tests(Vec::new())
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
        let mut st = SandboxState::for_bundle_dir("sb1", bundle().dir);
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
        let mut st = SandboxState::for_bundle_dir("x", bundle().dir);
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
