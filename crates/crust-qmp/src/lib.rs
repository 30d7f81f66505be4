//! A small async client for QEMU's QMP monitor over a unix socket.
//!
//! [`QmpClient::connect`] reads the greeting and negotiates capabilities.
//! Every command carries a numeric `id`; a background reader task matches
//! replies to callers by id, so the client can be shared (e.g. in an `Arc`)
//! and called from many tasks at once, and routes asynchronous events to a
//! broadcast channel ([`QmpClient::events`]). A writer task owns the socket's
//! write half, so cancelling a call never leaves half a command on the wire.
//!
//! Block device scheme used by the typed helpers: ONE protocol node per
//! volume (`driver` = `host_device` for block devices, `file` for regular
//! files; `cache.direct` and `aio` as [`BlockIo`] chooses, `discard=unmap`),
//! attached directly to a `virtio-blk-pci` device with one queue per vCPU
//! the VM can have and an iothread of its own (`iothread-<device id>`: the
//! device's I/O is served off QEMU's main loop, and one busy volume does
//! not stall another's; QEMU 7.2 runs all of a device's queues in its one
//! iothread). No `raw` format node on top: the
//! volumes are raw already, a format layer would add nothing but a second
//! node to name and delete, and `block_resize` works on the protocol node.
//!
//! A device the caller has opened itself goes to QEMU as that descriptor
//! ([`QmpClient::blockdev_add_fd`]): `add-fd` with the descriptor passed
//! over the QMP socket (`SCM_RIGHTS`), then `blockdev-add` of
//! `/dev/fdset/<id>`. QEMU never looks the file up by path, so what the
//! caller checked is what the guest gets, whatever happens to the path.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::io::BufReader;
use tokio::net::UnixStream;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::task::JoinHandle;

mod block;
mod blockio;
mod ids;
mod resize;
mod types;
mod wire;
pub use blockio::{Aio, BlockIo, HOST_CACHE_ENV, host_cache_forced, host_engines};

pub use block::{IoThrottle, VirtioBlkOptions};
pub use ids::{
    MAX_ID_LEN, MAX_NODE_NAME_LEN, MAX_SERIAL_LEN, validate_id, validate_node_name, validate_serial,
};
pub use types::{BlockInfo, BlockNode, PciDevice, QemuVersion, QmpEvent, VmStatus};
use wire::*;

/// Upper bound on one QMP message, so a broken peer cannot eat all memory.
const MAX_LINE: usize = 16 << 20;
const EVENT_CAPACITY: usize = 256;

/// Errors of every QMP operation.
#[derive(Debug, Clone, thiserror::Error)]
pub enum QmpError {
    /// Rejected before anything was sent to QEMU.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// QEMU answered `{"error": {"class", "desc"}}`.
    #[error("QEMU error {class}: {desc}")]
    Command { class: String, desc: String },
    /// No reply (or awaited event) in time. The connection stays usable.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    /// The connection is gone (QEMU exited or closed the socket). Every call
    /// pending at that moment and every later call fails with this.
    #[error("QMP connection closed: {0}")]
    Disconnected(String),
    /// QEMU sent something that is not QMP (bad greeting, malformed JSON).
    /// Fatal for the connection: pending calls fail rather than hang.
    #[error("QMP protocol error: {0}")]
    Protocol(String),
    #[error("QMP I/O error while {op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: Arc<std::io::Error>,
    },
}

impl QmpError {
    /// A socket error; the peer going away is `Disconnected`, not `Io`.
    fn io(op: &'static str, e: std::io::Error) -> QmpError {
        use std::io::ErrorKind::{BrokenPipe, ConnectionReset, NotConnected};
        if matches!(e.kind(), BrokenPipe | ConnectionReset | NotConnected) {
            return QmpError::Disconnected(format!("QEMU closed the QMP socket ({e})"));
        }
        QmpError::Io {
            op,
            source: Arc::new(e),
        }
    }
}

/// A connected QMP session. Share it with `Arc` to call from several tasks;
/// dropping it closes the socket.
pub struct QmpClient {
    shared: Arc<Shared>,
    tx: mpsc::UnboundedSender<Outgoing>,
    next_id: AtomicU64,
    version: QemuVersion,
    default_timeout: Duration,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
}

impl Drop for QmpClient {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

impl std::fmt::Debug for QmpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QmpClient")
            .field("version", &self.version)
            .field("closed", &self.shared.lock().closed)
            .finish()
    }
}

impl QmpClient {
    /// Connects to QEMU's QMP socket at `path`, reads the greeting and
    /// leaves negotiation mode (`qmp_capabilities`).
    ///
    /// While the socket does not exist yet or refuses connections (QEMU is
    /// still starting) connecting is retried. `timeout` bounds the whole
    /// handshake and is the default timeout of every later command.
    pub async fn connect(path: impl AsRef<Path>, timeout: Duration) -> Result<QmpClient, QmpError> {
        let path = path.as_ref();
        match tokio::time::timeout(timeout, Self::handshake(path, timeout)).await {
            Ok(res) => res,
            Err(_) => Err(QmpError::Timeout {
                what: format!("QMP greeting on {}", path.display()),
                after: timeout,
            }),
        }
    }

    async fn handshake(path: &Path, timeout: Duration) -> Result<QmpClient, QmpError> {
        use std::io::ErrorKind;
        let stream = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
                Err(e)
                    if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused) =>
                {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => return Err(QmpError::io("connecting to the QMP socket", e)),
            }
        };
        let (rd, wr) = stream.into_split();
        let mut rd = BufReader::new(rd);
        let greeting = read_line(&mut rd).await?.ok_or_else(|| {
            QmpError::Disconnected("QEMU closed the socket before its greeting".into())
        })?;
        let version = parse_greeting(&greeting)?;

        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                events: Some(events),
                ..State::default()
            }),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let client = QmpClient {
            reader: tokio::spawn(read_loop(rd, shared.clone())),
            writer: tokio::spawn(write_loop(wr, rx, shared.clone())),
            shared,
            tx,
            next_id: AtomicU64::new(1),
            version,
            default_timeout: timeout,
        };
        client.execute("qmp_capabilities", Value::Null).await?;
        Ok(client)
    }

    /// The QEMU version from the greeting.
    pub fn version(&self) -> &QemuVersion {
        &self.version
    }

    /// Why the connection is closed, or `None` while it is usable.
    pub fn closed_reason(&self) -> Option<QmpError> {
        self.shared.lock().closed.clone()
    }

    /// Runs `command` with `arguments` (a JSON object, or `Value::Null` for
    /// none) and returns QEMU's `return` value, using the connect timeout.
    pub async fn execute(&self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        self.execute_timeout(command, arguments, self.default_timeout)
            .await
    }

    /// [`execute`](Self::execute) with an explicit timeout. A reply arriving
    /// after the timeout is discarded.
    pub async fn execute_timeout(
        &self,
        command: &str,
        arguments: Value,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        self.execute_inner(command, arguments, timeout, None).await
    }

    /// [`execute`](Self::execute) with `fd` passed along (`SCM_RIGHTS`), for
    /// `add-fd` and `getfd`. QEMU keeps its own copy; ours is closed.
    pub async fn execute_with_fd(
        &self,
        command: &str,
        arguments: Value,
        fd: OwnedFd,
    ) -> Result<Value, QmpError> {
        self.execute_inner(command, arguments, self.default_timeout, Some(fd))
            .await
    }

    async fn execute_inner(
        &self,
        command: &str,
        arguments: Value,
        timeout: Duration,
        fd: Option<OwnedFd>,
    ) -> Result<Value, QmpError> {
        if command.is_empty()
            || !command
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(QmpError::InvalidArgument(format!(
                "bad QMP command name {command:?}"
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut msg = json!({ "execute": command, "id": id });
        match arguments {
            Value::Null => {}
            Value::Object(_) => msg["arguments"] = arguments,
            other => {
                return Err(QmpError::InvalidArgument(format!(
                    "QMP arguments must be a JSON object, got {other}"
                )));
            }
        }
        let mut line = serde_json::to_vec(&msg).expect("a JSON value serializes");
        line.push(b'\n');

        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.shared.lock();
            if let Some(err) = &st.closed {
                return Err(err.clone());
            }
            st.pending.insert(id, tx);
        }
        let _guard = PendingGuard {
            shared: &self.shared,
            id,
        };
        tracing::debug!(command, id, "QMP execute");
        if self.tx.send(Outgoing { line, fd }).is_err() {
            return Err(self.shared.closed_error());
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(self.shared.closed_error()),
            Err(_) => Err(QmpError::Timeout {
                what: format!("the reply to {command}"),
                after: timeout,
            }),
        }
    }

    async fn query<T: DeserializeOwned>(
        &self,
        command: &str,
        arguments: Value,
    ) -> Result<T, QmpError> {
        let value = self.execute(command, arguments).await?;
        serde_json::from_value(value)
            .map_err(|e| QmpError::Protocol(format!("unexpected reply to {command}: {e}")))
    }

    /// A receiver of every event QEMU sends from now on. It ends (`Closed`)
    /// when the connection dies; a receiver more than 256 events behind
    /// loses the oldest (`Lagged`).
    pub fn events(&self) -> broadcast::Receiver<QmpEvent> {
        match &self.shared.lock().events {
            Some(tx) => tx.subscribe(),
            None => broadcast::channel(1).1,
        }
    }

    /// Waits for the next event called `name` that satisfies `predicate`,
    /// emitted after this call. To catch an event caused by a command
    /// without a race, subscribe with [`events`](Self::events) BEFORE
    /// sending the command and use [`next_event`](Self::next_event).
    pub async fn wait_event(
        &self,
        name: &str,
        predicate: impl Fn(&QmpEvent) -> bool,
        timeout: Duration,
    ) -> Result<QmpEvent, QmpError> {
        let mut rx = self.events();
        self.next_event(&mut rx, name, predicate, timeout).await
    }

    /// Waits on `rx` for the next event called `name` satisfying `predicate`.
    pub async fn next_event(
        &self,
        rx: &mut broadcast::Receiver<QmpEvent>,
        name: &str,
        predicate: impl Fn(&QmpEvent) -> bool,
        timeout: Duration,
    ) -> Result<QmpEvent, QmpError> {
        let wait = async {
            loop {
                match rx.recv().await {
                    Ok(ev) if ev.name == name && predicate(&ev) => return Ok(ev),
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "QMP event receiver lagged");
                    }
                    Err(broadcast::error::RecvError::Closed) => {
                        return Err(self.shared.closed_error());
                    }
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .unwrap_or_else(|_| {
                Err(QmpError::Timeout {
                    what: format!("event {name}"),
                    after: timeout,
                })
            })
    }

    /// PCI functions on every bus, bridges flattened.
    ///
    /// QEMU walks buses by number, so devices behind a bridge or root port
    /// are listed only once the guest firmware has numbered that bus: in a
    /// VM still paused before its firmware ran (`-S`) they are missing.
    pub async fn query_pci(&self) -> Result<Vec<PciDevice>, QmpError> {
        let raw: Vec<types::RawPciBus> = self.query("query-pci", Value::Null).await?;
        Ok(types::flatten_pci(raw))
    }

    /// The VM's run state.
    pub async fn query_status(&self) -> Result<VmStatus, QmpError> {
        self.query("query-status", Value::Null).await
    }

    /// Starts (or resumes) guest CPUs, e.g. after `-S`.
    pub async fn cont(&self) -> Result<(), QmpError> {
        self.execute("cont", Value::Null).await.map(drop)
    }

    /// Pauses guest CPUs.
    pub async fn stop(&self) -> Result<(), QmpError> {
        self.execute("stop", Value::Null).await.map(drop)
    }

    /// Presses the ACPI power button; the guest decides whether to shut down.
    pub async fn system_powerdown(&self) -> Result<(), QmpError> {
        self.execute("system_powerdown", Value::Null)
            .await
            .map(drop)
    }

    /// Makes QEMU exit immediately. The socket closing before the reply
    /// arrives counts as success: that is what `quit` does.
    pub async fn quit(&self) -> Result<(), QmpError> {
        match self.execute("quit", Value::Null).await {
            Ok(_) | Err(QmpError::Disconnected(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests;
