//! The gRPC server: Identity, Controller and Node on one unix socket, and
//! the Handover service (runtime-driven deferral) on its own root-only
//! socket when configured.
//!
//! The socket is private: bound under a temporary name, chmod 0600, then
//! renamed into place, so the final path never exists with looser
//! permissions; a missing parent directory is created 0700. A stale
//! socket (nobody accepting on it) is replaced; a live one or any other
//! kind of file is refused. Connections pass crust_proto's authority front
//! (grpc-core/grpc-java clients send a %-encoded path as `:authority`).
//! On shutdown in-flight RPCs finish (bounded by
//! [`SHUTDOWN_GRACE`]) and the socket is removed.
//!
//! With `--peer-address`, other nodes' plugins are served over TCP
//! ([`crate::peer`]).
//!
//! With `--metrics-address`, Prometheus metrics are served at
//! `http://<address>/metrics` (see [`crate::metrics`]); every RPC passes
//! through the metrics layer.

use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crust_backend::Backend;
use crust_proto::csi::v1::controller_server::ControllerServer;
use crust_proto::csi::v1::group_controller_server::GroupControllerServer;
use crust_proto::csi::v1::identity_server::IdentityServer;
use crust_proto::csi::v1::node_server::NodeServer;

use crate::config::{BackendConfig, Config};
use crate::controller::ControllerService;
use crate::driver::Driver;
use crate::error::ServeError;
use crate::group_controller::GroupControllerService;
use crate::handover::HandoverService;
use crate::identity::IdentityService;
use crate::metrics::RpcMetricsLayer;
use crate::node::NodeService;
use crate::state::create_private_dir;
use crust_proto::handover::v1alpha1::handover_server::HandoverServer;

/// How long in-flight RPCs may run after the shutdown signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Builds the backend named in the configuration.
pub fn build_backend(cfg: &Config) -> Result<Arc<dyn Backend>, ServeError> {
    match &cfg.backend {
        BackendConfig::Pool {
            dir,
            capacity_bytes,
        } => crust_backend::PoolBackend::open(crust_backend::PoolConfig {
            // The plugin's volume records are the durable truth; the pool
            // is settled against them at start (Driver::settle).
            index_sync: crust_backend::IndexSync::Deferred,
            ..crust_backend::PoolConfig::new(dir.clone(), *capacity_bytes)
        })
        .map(|b| Arc::new(b) as Arc<dyn Backend>)
        .map_err(|e| ServeError::Backend(format!("pool {}: {e}", dir.display()))),
        BackendConfig::Static {
            devices,
            declared_blank,
        } => {
            crust_backend::StaticBackend::open(crust_backend::StaticConfig {
                devices: devices.clone(),
                declared_blank: declared_blank.clone(),
                state_file: cfg.state_dir.join("static-claims.json"),
            })
        }
        .map(|b| Arc::new(b) as Arc<dyn Backend>)
        .map_err(|e| ServeError::Backend(format!("static devices: {e}"))),
    }
}

/// Serves the plugin on `config.socket` until `shutdown` completes.
pub async fn serve<F>(config: Config, shutdown: F) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let cfg = config.clone();
    let backend = tokio::task::spawn_blocking(move || build_backend(&cfg))
        .await
        .map_err(|e| ServeError::Backend(e.to_string()))??;
    serve_with_backend(config, backend, shutdown).await
}

/// [`serve`] with a backend built by the caller.
pub async fn serve_with_backend<F>(
    config: Config,
    backend: Arc<dyn Backend>,
    shutdown: F,
) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let driver = tokio::task::spawn_blocking(move || Driver::new(config, backend))
        .await
        .map_err(|e| ServeError::Backend(e.to_string()))??;
    // The metrics endpoint is bound first: a bad address stops the plugin
    // before it serves anything.
    let metrics_listener = bind_metrics(driver.config().metrics_address).await?;
    let peer_listener = crate::peer::bind(driver.config()).await?;
    // The Handover socket is bound before the CSI socket: whoever waits
    // for the CSI socket (kubelet, a runtime, a test) finds both.
    let handover = match &driver.config().handover_socket {
        Some(path) => match bind_socket(path) {
            Ok(bound) => {
                tracing::info!(socket = %path.display(), "serving the Handover service");
                Some(bound)
            }
            // The CSI service still runs: runtimes that cannot reach it
            // share host mounts instead, and say so.
            Err(e) => {
                tracing::error!("not serving the Handover service: {e}");
                None
            }
        },
        None => None,
    };
    let (listener, socket) = bind_socket(&driver.config().socket)?;
    tracing::info!(
        socket = %socket.path.display(),
        driver = %driver.config().driver_name,
        node = %driver.config().node_id,
        backend = driver.backend_kind(),
        "serving CSI"
    );

    let (fired_tx, mut fired_rx) = tokio::sync::watch::channel(false);
    if let Some((listener, guard)) = handover {
        let mut stop = fired_rx.clone();
        let svc = HandoverServer::new(HandoverService::new(driver.clone()));
        tokio::spawn(async move {
            let _guard = guard;
            let r = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(crust_proto::server::incoming(listener), async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
            if let Err(e) = r {
                tracing::error!("Handover service: {e}");
            }
        });
    }
    // The pod network reaches these two: their connections fit below the
    // open-file limit with a reserve for the CSI socket and the node's work.
    let idle = driver.config().listener_idle;
    let fit = |l: crust_tcp_guard::Limits| crust_tcp_guard::Limits {
        connections: crust_tcp_guard::descriptor_budget(l.connections, 2, DESCRIPTOR_RESERVE),
        idle,
        ..l
    };
    if let Some(l) = peer_listener {
        tokio::spawn(crate::peer::serve(
            l,
            driver.clone(),
            fit(crate::peer::PEER_LIMITS),
            fired_rx.clone(),
        ));
    }
    if let Some(l) = metrics_listener {
        tokio::spawn(crate::metrics::serve(
            l,
            driver.metrics().clone(),
            fit(crate::metrics::METRICS_LIMITS),
            fired_rx.clone(),
        ));
    }
    let signal = async move {
        shutdown.await;
        let _ = fired_tx.send(true);
    };
    let server = tonic::transport::Server::builder()
        .layer(RpcMetricsLayer::new(driver.metrics().clone()))
        .add_service(IdentityServer::new(IdentityService::new(driver.clone())))
        .add_service(ControllerServer::new(ControllerService::new(
            driver.clone(),
        )))
        .add_service(NodeServer::new(NodeService::new(driver.clone())))
        .add_service(GroupControllerServer::new(GroupControllerService::new(
            driver.clone(),
        )))
        .serve_with_incoming_shutdown(crust_proto::server::incoming(listener), signal);
    tokio::pin!(server);
    let result = tokio::select! {
        r = &mut server => r.map_err(ServeError::from),
        _ = fired_rx.changed() => {
            tracing::info!("shutting down: waiting for in-flight requests");
            match tokio::time::timeout(SHUTDOWN_GRACE, &mut server).await {
                Ok(r) => r.map_err(ServeError::from),
                Err(_) => {
                    tracing::warn!("in-flight requests did not finish within {SHUTDOWN_GRACE:?}");
                    Ok(())
                }
            }
        }
    };
    drop(socket);
    tracing::info!("stopped");
    result
}

/// Descriptors kept for everything but the pod-reachable listeners: the
/// CSI and Handover sockets, mounts, devices, records, the runtime CLI.
const DESCRIPTOR_RESERVE: u64 = 512;

/// Binds `--metrics-address`, if given.
async fn bind_metrics(
    address: Option<std::net::SocketAddr>,
) -> Result<Option<tokio::net::TcpListener>, ServeError> {
    let Some(address) = address else {
        return Ok(None);
    };
    let metrics_err = |source| ServeError::Metrics {
        address: address.to_string(),
        source,
    };
    let l = crate::metrics::bind(address).await.map_err(metrics_err)?;
    let bound = l.local_addr().map_err(metrics_err)?;
    tracing::info!("metrics endpoint listening on http://{bound}/metrics");
    Ok(Some(l))
}

/// Removes the socket on drop if it is still the one we created.
struct SocketGuard {
    path: PathBuf,
    ino: u64,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        if let Ok(m) = std::fs::symlink_metadata(&self.path)
            && m.ino() == self.ino
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn socket_err(path: &Path, reason: impl Into<String>) -> ServeError {
    ServeError::Socket {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

fn bind_socket(path: &Path) -> Result<(tokio::net::UnixListener, SocketGuard), ServeError> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .ok_or_else(|| socket_err(path, "has no parent directory"))?;
    let name = path
        .file_name()
        .ok_or_else(|| socket_err(path, "has no file name"))?
        .to_string_lossy()
        .into_owned();
    create_private_dir(parent)
        .map_err(|e| socket_err(path, format!("parent directory {}: {e}", parent.display())))?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(socket_err(
                    path,
                    "another process is serving on this socket; refusing to replace it",
                ));
            }
            tracing::info!(socket = %path.display(), "replacing stale socket");
            std::fs::remove_file(path)
                .map_err(|e| socket_err(path, format!("removing stale socket: {e}")))?;
        }
        Ok(_) => {
            return Err(socket_err(
                path,
                "exists and is not a socket; refusing to replace it",
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(socket_err(path, e.to_string())),
    }
    let tmp = parent.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let bind = || -> io::Result<std::os::unix::net::UnixListener> {
        let l = std::os::unix::net::UnixListener::bind(&tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&tmp, path)?;
        l.set_nonblocking(true)?;
        Ok(l)
    };
    let std_listener = bind().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        socket_err(path, format!("binding: {e}"))
    })?;
    let ino = std::fs::symlink_metadata(path)
        .map_err(|e| socket_err(path, e.to_string()))?
        .ino();
    let guard = SocketGuard {
        path: path.to_path_buf(),
        ino,
    };
    let listener = tokio::net::UnixListener::from_std(std_listener)
        .map_err(|e| socket_err(path, e.to_string()))?;
    Ok((listener, guard))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn socket_is_private_stale_replaced_and_others_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let sock = tmp.path().join("new/csi.sock");
        let (l, g) = bind_socket(&sock).unwrap();
        let m = std::fs::symlink_metadata(&sock).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::metadata(tmp.path().join("new"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        // live socket: refused
        assert!(
            matches!(bind_socket(&sock), Err(ServeError::Socket { reason, .. }) if reason.contains("another process"))
        );
        // stale socket (listener gone, file left): replaced
        drop(l);
        std::mem::forget(g);
        let (_l2, g2) = bind_socket(&sock).unwrap();
        drop(g2);
        assert!(!sock.exists(), "guard removes the socket");
        // a regular file: refused and untouched
        std::fs::write(&sock, b"keep").unwrap();
        assert!(
            matches!(bind_socket(&sock), Err(ServeError::Socket { reason, .. }) if reason.contains("not a socket"))
        );
        assert_eq!(std::fs::read(&sock).unwrap(), b"keep");
    }
}
