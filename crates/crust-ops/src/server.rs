//! Serving the Runtime service on a unix socket.

use std::future::Future;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::ops::CrustOps;
use crate::service::RuntimeService;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("{0} is served by another live process")]
    InUse(PathBuf),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServeError {
    let context = context.into();
    move |source| ServeError::Io { context, source }
}

/// Removes the socket on drop if it is still the one we bound.
#[derive(Debug)]
pub struct SocketGuard {
    path: PathBuf,
    ino: u64,
}

impl SocketGuard {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.ino) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds `path` with mode 0600 from the first moment it is visible: the
/// socket is bound in a private 0700 directory, chmod'ed, then renamed into
/// place (which also replaces a stale socket atomically). A missing parent
/// is created 0700. A live socket or a non-socket at `path` is refused.
pub fn bind(path: &Path) -> Result<(UnixListener, SocketGuard), ServeError> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .ok_or_else(|| ServeError::Io {
            context: format!("socket path {}", path.display()),
            source: std::io::Error::other("has no parent directory"),
        })?;
    if !parent.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .map_err(io(format!("create {}", parent.display())))?;
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o700))
            .map_err(io(format!("chmod {}", parent.display())))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(ServeError::InUse(path.to_path_buf()));
            }
            tracing::info!(path = %path.display(), "replacing stale socket");
        }
        Ok(_) => return Err(ServeError::NotASocket(path.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(format!("stat {}", path.display()))(e)),
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let private = parent.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_dir_all(&private);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .map_err(io(format!("create {}", private.display())))?;
    let result = (|| {
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700))?;
        let tmp = private.join("s");
        let listener = UnixListener::bind(&tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&tmp, path)?;
        Ok::<_, std::io::Error>(listener)
    })();
    let _ = std::fs::remove_dir_all(&private);
    let listener = result.map_err(io(format!("bind {}", path.display())))?;
    let ino = std::fs::symlink_metadata(path)
        .map_err(io(format!("stat {}", path.display())))?
        .ino();
    Ok((
        listener,
        SocketGuard {
            path: path.to_path_buf(),
            ino,
        },
    ))
}

/// Serves until `shutdown` resolves, then finishes in-flight requests.
pub async fn serve(
    ops: Arc<CrustOps>,
    listener: UnixListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    listener
        .set_nonblocking(true)
        .map_err(io("set socket non-blocking"))?;
    let listener = tokio::net::UnixListener::from_std(listener).map_err(io("register socket"))?;
    tonic::transport::Server::builder()
        .add_service(RuntimeService::new(ops).into_server())
        .serve_with_incoming_shutdown(crust_proto::server::incoming(listener), shutdown)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn bind_modes_stale_and_refusals() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("run/crust/ops.sock");
        let (l, g) = bind(&path).unwrap();
        assert!(
            std::fs::symlink_metadata(&path)
                .unwrap()
                .file_type()
                .is_socket()
        );
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            1
        );
        // A live listener: refused.
        assert!(matches!(bind(&path), Err(ServeError::InUse(_))));
        // Stale (listener gone, file left): replaced.
        drop(l);
        std::mem::forget(g);
        let (_l2, g2) = bind(&path).unwrap();
        assert_eq!(mode(&path), 0o600);
        drop(g2);
        assert!(!path.exists(), "guard removes the socket");
        // Not a socket: refused, untouched.
        std::fs::write(&path, "data").unwrap();
        assert!(matches!(bind(&path), Err(ServeError::NotASocket(_))));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "data");
    }
}
