//! The pod's network namespace, entered only by threads made for it.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use rustix::fs::{Mode, OFlags};
use rustix::thread::LinkNameSpaceType;

use crate::NetError;

/// `NSFS_MAGIC`: what statfs says of a namespace file.
const NSFS_MAGIC: i64 = 0x6e73_6673;

/// An open network namespace.
#[derive(Debug, Clone)]
pub struct NetNs {
    fd: Arc<OwnedFd>,
    path: String,
}

impl NetNs {
    /// Opens the namespace at `path` (CNI's `/var/run/netns/<name>`, or a
    /// `/proc/<pid>/ns/net`) and checks it is one.
    pub fn open(path: &str) -> Result<NetNs, NetError> {
        let bad = |reason: String| NetError::Namespace {
            path: path.to_string(),
            reason,
        };
        if !Path::new(path).is_absolute() {
            return Err(bad("not an absolute path".into()));
        }
        let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| bad(format!("cannot open: {e}")))?;
        let st = rustix::fs::fstatfs(&fd).map_err(|e| bad(format!("statfs: {e}")))?;
        #[allow(clippy::unnecessary_cast, reason = "f_type's width differs by arch")]
        if st.f_type as i64 != NSFS_MAGIC {
            return Err(bad("not a namespace file (nsfs)".into()));
        }
        // Entering it proves the kind: a thread that tries and fails says so.
        let ns = NetNs {
            fd: Arc::new(fd),
            path: path.to_string(),
        };
        ns.run(|| Ok(()))?;
        Ok(ns)
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// The processes other than this one that live in this namespace,
    /// as (pid, command name): a pod's own processes (a runc pod's pause)
    /// make it that pod's, not a sandbox's to take. A crust pod has none
    /// on the host (its workload is in the guest). Compared by the
    /// namespace's inode, as `/proc/<pid>/ns/net` leads to it.
    pub fn holders(&self) -> Vec<(i32, String)> {
        let Ok(me) = rustix::fs::fstat(self.fd.as_fd()) else {
            return Vec::new();
        };
        let own = std::process::id() as i32;
        let mut out = Vec::new();
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return out;
        };
        for e in procs.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else {
                continue;
            };
            if pid == own {
                continue;
            }
            // A process that exits meanwhile holds nothing.
            let Ok(st) = rustix::fs::stat(e.path().join("ns/net")) else {
                continue;
            };
            if (st.st_dev, st.st_ino) == (me.st_dev, me.st_ino) {
                let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
                out.push((pid, comm.trim().to_string()));
            }
        }
        out
    }

    /// Runs `f` on a new thread inside the namespace and returns its
    /// result. The thread ends with `f`: no thread of the caller's ever
    /// changes namespace.
    pub fn run<T, F>(&self, f: F) -> Result<T, NetError>
    where
        F: FnOnce() -> Result<T, NetError> + Send + 'static,
        T: Send + 'static,
    {
        let fd = self.fd.clone();
        let path = self.path.clone();
        let handle = std::thread::Builder::new()
            .name("crust-netns".into())
            .spawn(move || {
                rustix::thread::move_into_link_name_space(
                    fd.as_fd(),
                    Some(LinkNameSpaceType::Network),
                )
                .map_err(|e| NetError::Namespace {
                    path: path.clone(),
                    reason: format!("cannot enter it as a network namespace: {e}"),
                })?;
                f()
            })
            .map_err(|source| NetError::Io {
                what: "starting a thread for the pod's network namespace".into(),
                source,
            })?;
        handle.join().unwrap_or_else(|_| {
            Err(NetError::Namespace {
                path: self.path.clone(),
                reason: "a thread working in it panicked".into(),
            })
        })
    }

    /// Runs the async `f` (given a netlink handle of the namespace) on a
    /// current-thread runtime inside the namespace.
    pub fn netlink<T, F, Fut>(&self, f: F) -> Result<T, NetError>
    where
        F: FnOnce(rtnetlink::Handle) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, NetError>>,
        T: Send + 'static,
    {
        self.run(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|source| NetError::Io {
                    what: "a runtime for netlink".into(),
                    source,
                })?;
            rt.block_on(async move {
                // The socket is made here, so it belongs to the namespace.
                let (conn, handle, _) =
                    rtnetlink::new_connection().map_err(|source| NetError::Io {
                        what: "a netlink socket".into(),
                        source,
                    })?;
                let task = tokio::spawn(conn);
                let out = f(handle).await;
                task.abort();
                out
            })
        })
    }
}
