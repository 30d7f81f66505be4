//! Port-forward for a pod (issue 43): connections made to `localhost` in
//! the pod's network namespace (containerd's PortForward dials there)
//! reach `localhost:<port>` in the guest. crust-podnet redirects them to
//! two listeners of the shim; each accepted connection's original
//! destination names the port, and crust-agent-proto's [`ForwardMux`]
//! carries it over the VM's forward port.

use std::net::TcpListener as StdListener;
use std::path::Path;

use crust_agent_proto::forward::{Family, ForwardMux};
use crust_podnet::NetNs;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// The pod's forwarder: its accept loops end when it is dropped (with the
/// pod's VM); relays in flight end with the VM's forward port.
pub struct Forwarder {
    accepts: Vec<AbortHandle>,
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        for a in &self.accepts {
            a.abort();
        }
    }
}

/// Starts port-forward for the pod in `ns` whose VM's forward port is
/// `socket`. Without it the pod runs but `kubectl port-forward` cannot
/// reach it: that is logged, not fatal (the table is removed with the
/// rest of the pod's network).
pub fn start(ns: &NetNs, socket: &Path) -> Option<Forwarder> {
    let set_up = crust_podnet::forward::listen(ns).and_then(|l| {
        crust_podnet::forward::install(ns, &l)?;
        Ok(l)
    });
    let listeners = match set_up {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(netns = %ns.path(), "port-forward unavailable for this pod: {e}");
            return None;
        }
    };
    let mux = ForwardMux::new(socket);
    let mut accepts = Vec::new();
    for (l, family) in [(Some(listeners.v4), Family::V4), (listeners.v6, Family::V6)] {
        let Some(l) = l else { continue };
        match accept_loop(l, family, mux.clone()) {
            Ok(h) => accepts.push(h),
            Err(e) => tracing::warn!("port-forward listener: {e}"),
        }
    }
    Some(Forwarder { accepts })
}

fn accept_loop(l: StdListener, family: Family, mux: ForwardMux) -> std::io::Result<AbortHandle> {
    let l = TcpListener::from_std(l)?;
    let task = tokio::spawn(async move {
        loop {
            let (conn, _) = match l.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors and the like: pause, do not spin.
                    tracing::warn!("port-forward accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Some(port) = original_port(&conn, family) else {
                continue;
            };
            let mux = mux.clone();
            tokio::spawn(async move {
                let _ = conn.set_nodelay(true);
                match mux.relay(conn, port, family).await {
                    Ok(()) => {}
                    Err(e) => tracing::debug!(port, "port-forward connection: {e}"),
                }
            });
        }
    });
    Ok(task.abort_handle())
}

/// The port the client asked for, before the redirect.
fn original_port(conn: &TcpStream, family: Family) -> Option<u16> {
    let r = match family {
        Family::V4 => rustix::net::sockopt::ip_original_dst(conn).map(|a| a.port()),
        Family::V6 => rustix::net::sockopt::ipv6_original_dst(conn).map(|a| a.port()),
    };
    match r {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!("port-forward: no original destination: {e}");
            None
        }
    }
}
