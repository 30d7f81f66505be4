//! The guest's single workload: volume bind mounts (with subPath), the
//! process, its log, signals and stop.

use crust_sys::spawn::ChildSetup;
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crust_agent_proto::{
    AgentError, ErrorCode, MAX_LOG_TAIL, StartWorkload, StartWorkloadReply, WorkloadLogReply,
    WorkloadMount, WorkloadShare, WorkloadState,
};
use rustix::fs::{FileType, Gid, Mode, OFlags, Uid};
use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags};
use rustix::process::{Pid, Signal};

use crate::destination::{self, DestinationError, Leaf};
use crate::process;
use crate::subpath::{self, SubpathError};
use crate::volume::{self, Volumes, mount_path};

/// Combined stdout/stderr of the workload.
pub const LOG_PATH: &str = "/run/crust/workload.log";

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("invalid workload spec: {0}")]
    Invalid(String),
    #[error("mount of volume {volume:?} at {destination}: {source}")]
    Subpath {
        volume: String,
        destination: String,
        #[source]
        source: SubpathError,
    },
    #[error(transparent)]
    Destination(#[from] DestinationError),
    #[error("volume {0:?} is not mounted; call MountVolume first")]
    VolumeNotMounted(String),
    #[error("a different workload is already running (pid {0}); stop it first")]
    AlreadyRunning(u32),
    #[error("no workload is running")]
    NotRunning,
    #[error("cannot start workload {program:?}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{op} {path}: {errno}")]
    Io {
        op: &'static str,
        path: String,
        errno: Errno,
    },
}

impl From<WorkloadError> for AgentError {
    fn from(e: WorkloadError) -> AgentError {
        use WorkloadError::*;
        let code = match &e {
            Invalid(_) | Subpath { .. } => ErrorCode::InvalidArgument,
            Destination(d) if d.is_invalid_argument() => ErrorCode::InvalidArgument,
            Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                ErrorCode::InvalidArgument
            }
            VolumeNotMounted(_) | NotRunning => ErrorCode::FailedPrecondition,
            AlreadyRunning(_) => ErrorCode::AlreadyExists,
            Spawn { .. } | Io { .. } | Destination(_) => ErrorCode::Internal,
        };
        AgentError::new(code, e.to_string())
    }
}

fn io_err(op: &'static str, path: &Path, errno: Errno) -> WorkloadError {
    WorkloadError::Io {
        op,
        path: path.display().to_string(),
        errno,
    }
}

fn errno_of(e: &std::io::Error) -> Errno {
    Errno::from_io_error(e).unwrap_or(Errno::IO)
}

/// A bind mount made for the workload.
#[derive(Debug, Clone)]
struct Bind {
    /// The volume it comes from; `None` for a share path.
    volume: Option<String>,
    destination: PathBuf,
}

struct Current {
    spec: StartWorkload,
    pid: u32,
    state: WorkloadState,
    binds: Vec<Bind>,
}

#[derive(Default)]
struct Slot {
    current: Option<Current>,
}

/// The workload slot. Cheap to share (`Arc` inside).
#[derive(Clone, Default)]
pub struct Workloads {
    inner: Arc<(Mutex<Slot>, Condvar)>,
}

/// Guest paths a workload mount must not cover.
const RESERVED: &[&str] = &["/proc", "/sys", "/dev", "/run/crust"];

fn validate_destination(dest: &str) -> Result<PathBuf, WorkloadError> {
    let p = Path::new(dest);
    let bad = |why: &str| WorkloadError::Invalid(format!("destination {dest:?} {why}"));
    if !p.is_absolute() {
        return Err(bad("must be absolute"));
    }
    if p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(bad("must not contain '..'"));
    }
    let clean: PathBuf = p.components().collect();
    if clean == Path::new("/") {
        return Err(bad("must not be /"));
    }
    if RESERVED.iter().any(|r| clean.starts_with(r)) {
        return Err(bad(&format!("must not be under {}", RESERVED.join(", "))));
    }
    Ok(clean)
}

fn validate(spec: &StartWorkload) -> Result<Vec<PathBuf>, WorkloadError> {
    if spec.args.is_empty() || spec.args[0].is_empty() {
        return Err(WorkloadError::Invalid("args must not be empty".into()));
    }
    if let Some(kv) = spec
        .env
        .iter()
        .find(|kv| !kv.contains('=') || kv.starts_with('='))
    {
        return Err(WorkloadError::Invalid(format!(
            "env entry {kv:?} is not KEY=VALUE"
        )));
    }
    if let Some(cwd) = &spec.cwd
        && !cwd.starts_with('/')
    {
        return Err(WorkloadError::Invalid(format!(
            "cwd {cwd:?} must be absolute"
        )));
    }
    let mut dests = Vec::new();
    for m in &spec.mounts {
        volume::validate_name(&m.volume).map_err(|e| WorkloadError::Invalid(e.to_string()))?;
        let d = validate_destination(&m.destination)?;
        if dests.contains(&d) {
            return Err(WorkloadError::Invalid(format!(
                "destination {} is used twice",
                d.display()
            )));
        }
        if let Some(sp) = &m.subpath {
            subpath::components(sp).map_err(|source| WorkloadError::Subpath {
                volume: m.volume.clone(),
                destination: m.destination.clone(),
                source,
            })?;
        }
        dests.push(d);
    }
    for s in &spec.shares {
        if !crust_agent_proto::valid_id(&s.share.tag)
            || !crust_agent_proto::valid_share_path(&s.share.path)
        {
            return Err(WorkloadError::Invalid(format!(
                "share {:?} path {:?} is invalid",
                s.share.tag, s.share.path
            )));
        }
        let d = validate_destination(&s.destination)?;
        if dests.contains(&d) {
            return Err(WorkloadError::Invalid(format!(
                "destination {} is used twice",
                d.display()
            )));
        }
        dests.push(d);
    }
    Ok(dests)
}

fn open_root() -> Result<OwnedFd, WorkloadError> {
    rustix::fs::open(
        "/",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err("open", Path::new("/"), e))
}

/// Unmounts everything stacked on `path` (a `/proc/self/fd/P/name`).
fn unmount_all(path: &Path) {
    loop {
        // NOFOLLOW: a symlink swapped in for the name is not followed.
        match rustix::mount::unmount(path, UnmountFlags::NOFOLLOW) {
            Ok(()) => {}
            Err(Errno::BUSY) => {
                // Workload leftovers still hold it: detach so the volume
                // can be unmounted; the kernel finishes when they go.
                let _ = rustix::mount::unmount(path, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW);
            }
            Err(_) => break,
        }
    }
}

/// Unmounts what is on `dest` below `root`. The parent is walked again
/// without following symlinks (the workload may have swapped a directory on
/// the way for one) and held only for this call, so it pins nothing.
fn unmount_beneath(root: &impl AsFd, dest: &Path) {
    if let Ok((parent, name)) = destination::open_parent(root, dest) {
        unmount_all(&destination::proc_fd(&parent).join(name));
    }
}

fn unmount_binds(binds: &[Bind]) {
    let Ok(root) = open_root() else { return };
    for b in binds.iter().rev() {
        unmount_beneath(&root, &b.destination);
    }
}

/// Resolves one workload mount and bind-mounts it at `dest`.
fn bind_one(m: &WorkloadMount, dest: &Path, volumes: &Volumes) -> Result<(), WorkloadError> {
    if volumes.lookup(&m.volume).is_none() {
        return Err(WorkloadError::VolumeNotMounted(m.volume.clone()));
    }
    let root_path = mount_path(&m.volume);
    let root = rustix::fs::open(
        root_path.as_path(),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err("open", &root_path, e))?;
    let root_mode = rustix::fs::fstat(&root)
        .map_err(|e| io_err("stat", &root_path, e))?
        .st_mode
        & 0o7777;
    let src = subpath::open_beneath(
        &root,
        m.subpath.as_deref().unwrap_or(""),
        true,
        Mode::from_raw_mode(root_mode),
    )
    .map_err(|source| WorkloadError::Subpath {
        volume: m.volume.clone(),
        destination: m.destination.clone(),
        source,
    })?;
    bind_at(&open_root()?, &src, dest, m.readonly)
}

/// Binds a path of a virtio-fs share (mounting the share on first use)
/// at `dest`. The path is resolved beneath the share's root, so a symlink
/// in host content cannot point the bind elsewhere in the guest.
fn bind_share(s: &WorkloadShare, dest: &Path) -> Result<(), WorkloadError> {
    let root_path = crate::container::share_root(&s.share.tag).map_err(WorkloadError::Invalid)?;
    let root = rustix::fs::open(
        root_path.as_path(),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err("open", &root_path, e))?;
    let src = subpath::open_beneath(&root, &s.share.path, false, Mode::from_raw_mode(0o755))
        .map_err(|source| WorkloadError::Subpath {
            volume: format!("share {}", s.share.tag),
            destination: s.destination.clone(),
            source,
        })?;
    bind_at(&open_root()?, &src, dest, s.readonly)
}

/// Bind-mounts `src` (an `O_PATH` descriptor) on `dest` below `root`
/// (`/` in the guest), creating the destination if missing.
fn bind_at(
    root: &impl AsFd,
    src: &OwnedFd,
    dest: &Path,
    readonly: bool,
) -> Result<(), WorkloadError> {
    let st = rustix::fs::fstat(src).map_err(|e| io_err("stat", dest, e))?;
    let leaf = if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
        Leaf::Directory
    } else {
        Leaf::File
    };
    // No symlink anywhere in the destination is followed: an earlier bind
    // may have put volume contents (an earlier pod's) on the way.
    let target = destination::open(root, dest, leaf, Mode::from_raw_mode(0o755))?;
    // Both ends through descriptors: neither path is looked up by name again.
    rustix::mount::mount_bind(destination::proc_fd(src), target.proc_path())
        .map_err(|e| io_err("bind mount at", dest, e))?;
    if readonly {
        let remounted = target.reopen().and_then(|mounted| {
            rustix::mount::mount_remount(
                destination::proc_fd(&mounted),
                MountFlags::BIND | MountFlags::RDONLY,
                "",
            )
        });
        if let Err(e) = remounted {
            unmount_all(&target.proc_child_path());
            return Err(io_err("read-only remount of", dest, e));
        }
    }
    Ok(())
}

fn spawn(spec: &StartWorkload) -> Result<Child, WorkloadError> {
    let log = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(LOG_PATH)
        .map_err(|e| io_err("open", Path::new(LOG_PATH), errno_of(&e)))?;
    let log2 = log
        .try_clone()
        .map_err(|e| io_err("dup", Path::new(LOG_PATH), errno_of(&e)))?;
    let mut cmd = Command::new(&spec.args[0]);
    cmd.args(&spec.args[1..])
        .env_clear()
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .current_dir(spec.cwd.as_deref().unwrap_or("/"))
        .process_group(0);
    if !spec.env.iter().any(|kv| kv.starts_with("PATH=")) {
        cmd.env("PATH", process::PATH);
    }
    for kv in &spec.env {
        let (k, v) = kv.split_once('=').expect("validated");
        cmd.env(k, v);
    }
    if let Some(user) = &spec.user {
        let groups: Vec<Gid> = user
            .supplemental_gids
            .iter()
            .map(|g| Gid::from_raw(*g))
            .collect();
        let (uid, gid) = (Uid::from_raw(user.uid), Gid::from_raw(user.gid));
        ChildSetup::new()
            .identity(uid, gid, groups)
            .apply(&mut cmd)
            .map_err(|source| WorkloadError::Spawn {
                program: spec.args[0].clone(),
                source,
            })?;
    }
    cmd.spawn().map_err(|source| WorkloadError::Spawn {
        program: spec.args[0].clone(),
        source,
    })
}

impl Workloads {
    pub fn start(
        &self,
        spec: &StartWorkload,
        volumes: &Volumes,
    ) -> Result<StartWorkloadReply, WorkloadError> {
        let dests = validate(spec)?;
        let mut slot = self.inner.0.lock().expect("workload lock");
        if let Some(cur) = &slot.current
            && let WorkloadState::Running { pid } = cur.state
        {
            if cur.spec == *spec {
                return Ok(StartWorkloadReply { pid });
            }
            return Err(WorkloadError::AlreadyRunning(pid));
        }
        if let Some(old) = slot.current.take() {
            unmount_binds(&old.binds);
        }
        let mut binds: Vec<Bind> = Vec::new();
        for (m, dest) in spec.mounts.iter().zip(&dests) {
            if let Err(e) = bind_one(m, dest, volumes) {
                unmount_binds(&binds);
                return Err(e);
            }
            binds.push(Bind {
                volume: Some(m.volume.clone()),
                destination: dest.clone(),
            });
        }
        for (sh, dest) in spec.shares.iter().zip(&dests[spec.mounts.len()..]) {
            if let Err(e) = bind_share(sh, dest) {
                unmount_binds(&binds);
                return Err(e);
            }
            binds.push(Bind {
                volume: None,
                destination: dest.clone(),
            });
        }
        let mut child = match spawn(spec) {
            Ok(c) => c,
            Err(e) => {
                unmount_binds(&binds);
                return Err(e);
            }
        };
        let pid = child.id();
        slot.current = Some(Current {
            spec: spec.clone(),
            pid,
            state: WorkloadState::Running { pid },
            binds,
        });
        drop(slot);
        let inner = self.inner.clone();
        std::thread::spawn(move || {
            let status = child.wait();
            let (lock, cv) = &*inner;
            let mut slot = lock.lock().expect("workload lock");
            if let Some(cur) = slot.current.as_mut()
                && cur.pid == pid
            {
                let (exit_code, signal) = match status {
                    Ok(st) => {
                        let (code, sig) = process::status_code(st);
                        (if sig.is_some() { None } else { Some(code) }, sig)
                    }
                    Err(_) => (None, None),
                };
                cur.state = WorkloadState::Exited {
                    pid,
                    exit_code,
                    signal,
                };
            }
            cv.notify_all();
        });
        Ok(StartWorkloadReply { pid })
    }

    pub fn status(&self) -> WorkloadState {
        let slot = self.inner.0.lock().expect("workload lock");
        slot.current
            .as_ref()
            .map_or(WorkloadState::NotStarted, |c| c.state)
    }

    pub fn log(&self, tail: u64) -> Result<WorkloadLogReply, WorkloadError> {
        let tail = tail.min(MAX_LOG_TAIL);
        let mut f = match std::fs::File::open(LOG_PATH) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(WorkloadLogReply {
                    data: String::new(),
                    size: 0,
                    truncated: false,
                });
            }
            Err(e) => return Err(io_err("open", Path::new(LOG_PATH), errno_of(&e))),
        };
        let size = f
            .metadata()
            .map_err(|e| io_err("stat", Path::new(LOG_PATH), errno_of(&e)))?
            .len();
        let start = size.saturating_sub(tail);
        f.seek(SeekFrom::Start(start))
            .map_err(|e| io_err("seek", Path::new(LOG_PATH), errno_of(&e)))?;
        let mut buf = Vec::new();
        f.take(tail)
            .read_to_end(&mut buf)
            .map_err(|e| io_err("read", Path::new(LOG_PATH), errno_of(&e)))?;
        Ok(WorkloadLogReply {
            data: String::from_utf8_lossy(&buf).into_owned(),
            size,
            truncated: start > 0,
        })
    }

    fn running_pid(&self) -> Option<u32> {
        let slot = self.inner.0.lock().expect("workload lock");
        match slot.current.as_ref().map(|c| c.state) {
            Some(WorkloadState::Running { pid }) => Some(pid),
            _ => None,
        }
    }

    pub fn signal(&self, signal: i32) -> Result<(), WorkloadError> {
        let sig = Signal::from_named_raw(signal)
            .ok_or_else(|| WorkloadError::Invalid(format!("unknown signal {signal}")))?;
        let pid = self.running_pid().ok_or(WorkloadError::NotRunning)?;
        let pid = Pid::from_raw(pid as i32).expect("nonzero pid");
        match rustix::process::kill_process_group(pid, sig) {
            Ok(()) | Err(Errno::SRCH) => Ok(()),
            Err(e) => Err(WorkloadError::Io {
                op: "kill",
                path: format!("process group {}", pid.as_raw_nonzero()),
                errno: e,
            }),
        }
    }

    fn wait_exit(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.inner;
        let mut slot = lock.lock().expect("workload lock");
        loop {
            if !matches!(
                slot.current.as_ref().map(|c| c.state),
                Some(WorkloadState::Running { .. })
            ) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            slot = cv.wait_timeout(slot, left).expect("workload lock").0;
        }
    }

    /// TERM, then KILL after `grace`; returns the final state.
    pub fn stop(&self, grace: Duration) -> WorkloadState {
        if let Some(pid) = self.running_pid() {
            let pid = Pid::from_raw(pid as i32).expect("nonzero pid");
            let _ = rustix::process::kill_process_group(pid, Signal::TERM);
            if !self.wait_exit(grace) {
                let _ = rustix::process::kill_process_group(pid, Signal::KILL);
                self.wait_exit(Duration::from_secs(10));
            }
            // Stragglers left in the group after the leader exited.
            let _ = rustix::process::kill_process_group(pid, Signal::KILL);
        }
        self.status()
    }

    /// Where a volume is bind-mounted for the workload, and whether the
    /// workload is running.
    pub fn uses(&self, volume: &str) -> (bool, Vec<PathBuf>) {
        let slot = self.inner.0.lock().expect("workload lock");
        match &slot.current {
            None => (false, Vec::new()),
            Some(c) => (
                matches!(c.state, WorkloadState::Running { .. }),
                c.binds
                    .iter()
                    .filter(|b| b.volume.as_deref() == Some(volume))
                    .map(|b| b.destination.clone())
                    .collect(),
            ),
        }
    }

    /// Removes the (stopped) workload's bind mounts of `volume`, or of all
    /// volumes when `None`.
    pub fn release_binds(&self, volume: Option<&str>) {
        let mut slot = self.inner.0.lock().expect("workload lock");
        if let Some(c) = slot.current.as_mut() {
            let (drop, keep): (Vec<Bind>, Vec<Bind>) = c
                .binds
                .drain(..)
                .partition(|b| volume.is_none_or(|v| b.volume.as_deref() == Some(v)));
            unmount_binds(&drop);
            c.binds = keep;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_agent_proto::WorkloadMount;
    use std::os::unix::fs::symlink;

    fn spec(mounts: Vec<WorkloadMount>) -> StartWorkload {
        StartWorkload {
            args: vec!["sh".into()],
            env: vec!["A=1".into()],
            cwd: None,
            mounts,
            user: None,
            shares: Vec::new(),
        }
    }

    fn m(dest: &str, sub: Option<&str>) -> WorkloadMount {
        WorkloadMount {
            volume: "v".into(),
            subpath: sub.map(Into::into),
            destination: dest.into(),
            readonly: false,
        }
    }

    /// Unmounts (lazily, deepest first) whatever a test left below `dir`.
    struct MountsBelow(PathBuf);

    fn mounts_below(dir: &Path) -> Vec<PathBuf> {
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mut v: Vec<PathBuf> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(PathBuf::from)
            .filter(|p| p.starts_with(dir))
            .collect();
        v.sort();
        v
    }

    impl Drop for MountsBelow {
        fn drop(&mut self) {
            for p in mounts_below(&self.0).iter().rev() {
                let _ = rustix::mount::unmount(p, UnmountFlags::DETACH);
            }
        }
    }

    fn opath(p: &Path) -> OwnedFd {
        rustix::fs::open(p, OFlags::PATH | OFlags::CLOEXEC, Mode::empty()).unwrap()
    }

    /// The nested-bind attack on real mounts: a volume carrying
    /// `logs -> <system dir>` bound at /data, then /data/logs requested.
    #[test]
    fn nested_destination_through_planted_symlink_mounts_nothing() {
        if !rustix::process::geteuid().is_root() {
            panic!("this test needs root (bind mounts)");
        }
        let t = tempfile::tempdir().unwrap();
        let _guard = MountsBelow(t.path().to_path_buf());
        let sys = t.path().join("sbin");
        std::fs::create_dir(&sys).unwrap();
        std::fs::write(sys.join("e2fsck"), b"real").unwrap();
        let vol = t.path().join("vol");
        std::fs::create_dir_all(vol.join("trap")).unwrap();
        std::fs::create_dir_all(vol.join("evil")).unwrap();
        std::fs::write(vol.join("evil/e2fsck"), b"evil").unwrap();
        symlink(&sys, vol.join("trap/logs")).unwrap();
        symlink("/", vol.join("trap/up")).unwrap();
        let other = t.path().join("other");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join("f"), b"other").unwrap();
        let rootdir = t.path().join("root");
        std::fs::create_dir(&rootdir).unwrap();
        let root = opath(&rootdir);

        bind_at(&root, &opath(&vol.join("trap")), Path::new("/data"), false).unwrap();
        assert_eq!(mounts_below(t.path()), vec![rootdir.join("data")]);
        assert!(rootdir.join("data/logs").is_symlink());
        for dest in ["/data/logs", "/data/logs/x", "/data/up/tmp"] {
            let e = bind_at(&root, &opath(&vol.join("evil")), Path::new(dest), false).unwrap_err();
            assert!(
                matches!(
                    e,
                    WorkloadError::Destination(DestinationError::Symlink { .. })
                ),
                "{dest}: {e}"
            );
            assert_eq!(AgentError::from(e).code, ErrorCode::InvalidArgument);
        }
        assert_eq!(mounts_below(t.path()), vec![rootdir.join("data")]);
        assert!(
            !mounts_below(Path::new("/"))
                .iter()
                .any(|p| p.starts_with(&sys))
        );
        assert_eq!(std::fs::read(sys.join("e2fsck")).unwrap(), b"real");
        assert_eq!(std::fs::read_dir(&sys).unwrap().count(), 1);

        // A real nested directory works, read-only, and is made inside the
        // volume bound at /data.
        bind_at(&root, &opath(&other), Path::new("/data/sub/ro"), true).unwrap();
        assert!(vol.join("trap/sub/ro").is_dir());
        assert_eq!(
            std::fs::read(rootdir.join("data/sub/ro/f")).unwrap(),
            b"other"
        );
        let sv = rustix::fs::statvfs(rootdir.join("data/sub/ro").as_path()).unwrap();
        assert!(sv.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY));
        assert!(std::fs::write(rootdir.join("data/sub/ro/g"), b"").is_err());
        // A file source gets a file destination.
        bind_at(
            &root,
            &opath(&other.join("f")),
            Path::new("/data/one"),
            false,
        )
        .unwrap();
        assert_eq!(std::fs::read(rootdir.join("data/one")).unwrap(), b"other");

        for d in ["/data/one", "/data/sub/ro", "/data"] {
            unmount_beneath(&root, Path::new(d));
        }
        assert_eq!(mounts_below(t.path()), Vec::<PathBuf>::new());
        assert!(rootdir.join("data").is_dir());
        assert_eq!(std::fs::read_dir(rootdir.join("data")).unwrap().count(), 0);
    }

    #[test]
    fn destinations_validated() {
        assert!(validate(&spec(vec![m("/data", None)])).is_ok());
        assert_eq!(
            validate(&spec(vec![m("/data//x/", None)])).unwrap(),
            vec![PathBuf::from("/data/x")]
        );
        for bad in [
            "data",
            "/",
            "/a/../b",
            "/proc/x",
            "/dev",
            "/run/crust/volumes/v",
        ] {
            assert!(validate(&spec(vec![m(bad, None)])).is_err(), "{bad}");
        }
        assert!(validate(&spec(vec![m("/a", None), m("/a/", None)])).is_err());
        assert!(validate(&spec(vec![m("/a", Some("../x"))])).is_err());
        assert!(validate(&spec(vec![m("/a", Some("/x"))])).is_err());
        let mut s = spec(vec![]);
        s.env = vec!["NOEQUALS".into()];
        assert!(validate(&s).is_err());
        s.env = vec![];
        s.args = vec![];
        assert!(validate(&s).is_err());
    }
}
