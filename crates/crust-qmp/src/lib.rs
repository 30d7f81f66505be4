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

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::task::JoinHandle;

mod blockio;
mod resize;
mod types;
pub use blockio::{Aio, BlockIo, host_engines};

pub use types::{BlockInfo, BlockNode, PciDevice, QemuVersion, QmpEvent, VmStatus};

/// Longest device id accepted (QEMU itself has no hard limit; we keep ids sane).
pub const MAX_ID_LEN: usize = 127;
/// Longest block node name QEMU accepts (`char node_name[32]` inside QEMU).
pub const MAX_NODE_NAME_LEN: usize = 31;
/// Longest virtio-blk serial the guest sees (`VIRTIO_BLK_ID_BYTES`); QEMU
/// would silently truncate a longer one.
pub const MAX_SERIAL_LEN: usize = 20;

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

type Reply = Result<Value, QmpError>;

#[derive(Default)]
struct State {
    pending: HashMap<u64, oneshot::Sender<Reply>>,
    /// Set once, when the connection dies; the reason every later call gets.
    closed: Option<QmpError>,
    /// Dropped on close so event receivers see the end of the stream.
    events: Option<broadcast::Sender<QmpEvent>>,
    /// Block nodes this client opened from an fd set, and the set's id.
    fdsets: HashMap<String, u64>,
    /// How this client opened each block node.
    opened: HashMap<String, BlockIo>,
    /// `query-hotpluggable-cpus`' count, asked once.
    max_vcpus: Option<u16>,
}

struct Shared {
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn closed_error(&self) -> QmpError {
        self.lock()
            .closed
            .clone()
            .unwrap_or_else(|| QmpError::Disconnected("connection closed".into()))
    }

    /// Marks the connection dead and fails every pending call with `err`.
    fn close(&self, err: QmpError) {
        let (pending, events) = {
            let mut st = self.lock();
            if st.closed.is_some() {
                return;
            }
            tracing::debug!(error = %err, "QMP connection closed");
            st.closed = Some(err.clone());
            (std::mem::take(&mut st.pending), st.events.take())
        };
        for (_, tx) in pending {
            let _ = tx.send(Err(err.clone()));
        }
        drop(events);
    }

    /// Routes one line from QEMU. An error is fatal for the connection.
    fn dispatch(&self, line: &[u8]) -> Result<(), QmpError> {
        let line = line.trim_ascii();
        if line.is_empty() {
            return Ok(());
        }
        // A line that is not JSON could have been anyone's reply: fail them
        // all now instead of letting one caller hang until its timeout.
        let msg: Value = serde_json::from_slice(line).map_err(|e| {
            QmpError::Protocol(format!("malformed JSON from QEMU ({e}): {}", excerpt(line)))
        })?;
        let Value::Object(mut obj) = msg else {
            return Err(QmpError::Protocol(format!(
                "QMP message is not an object: {}",
                excerpt(line)
            )));
        };
        if obj.contains_key("event") {
            let event = QmpEvent::from_message(obj);
            tracing::trace!(event = %event.name, "QMP event");
            if let Some(tx) = &self.lock().events {
                let _ = tx.send(event);
            }
            return Ok(());
        }
        let reply = if let Some(ret) = obj.remove("return") {
            Ok(ret)
        } else if let Some(err) = obj.remove("error") {
            Err(command_error(err))
        } else {
            tracing::warn!(message = %excerpt(line), "ignoring unexpected QMP message");
            return Ok(());
        };
        let id = obj.get("id").and_then(Value::as_u64);
        let waiter = id.and_then(|id| self.lock().pending.remove(&id));
        match waiter {
            Some(tx) => {
                let _ = tx.send(reply);
            }
            // A reply to a call that already timed out or was cancelled.
            None => tracing::debug!(?id, "QMP reply nobody waits for"),
        }
        Ok(())
    }
}

fn command_error(err: Value) -> QmpError {
    let field = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    QmpError::Command {
        class: field("class"),
        desc: field("desc"),
    }
}

fn excerpt(line: &[u8]) -> String {
    let s = String::from_utf8_lossy(&line[..line.len().min(200)]);
    if line.len() > 200 {
        format!("{s}...")
    } else {
        s.into_owned()
    }
}

/// Reads one `\n`-terminated line (without the newline); `None` at EOF.
async fn read_line<R: AsyncBufRead + Unpin>(rd: &mut R) -> Result<Option<Vec<u8>>, QmpError> {
    let mut line = Vec::new();
    loop {
        let buf = rd
            .fill_buf()
            .await
            .map_err(|e| QmpError::io("reading from QEMU", e))?;
        if buf.is_empty() {
            // EOF; a partial last line is not a message.
            return Ok(None);
        }
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], i + 1),
            None => (buf, buf.len()),
        };
        if line.len() + chunk.len() > MAX_LINE {
            return Err(QmpError::Protocol(format!(
                "QMP message longer than {MAX_LINE} bytes"
            )));
        }
        line.extend_from_slice(chunk);
        let found_newline = chunk.len() < done;
        rd.consume(done);
        if found_newline {
            return Ok(Some(line));
        }
    }
}

async fn read_loop(mut rd: BufReader<OwnedReadHalf>, shared: Arc<Shared>) {
    let err = loop {
        match read_line(&mut rd).await {
            Ok(Some(line)) => {
                if let Err(e) = shared.dispatch(&line) {
                    break e;
                }
            }
            Ok(None) => break QmpError::Disconnected("QEMU closed the QMP socket".into()),
            Err(e) => break e,
        }
    };
    shared.close(err);
}

/// One command line for the writer task, with a descriptor to pass along.
struct Outgoing {
    line: Vec<u8>,
    fd: Option<OwnedFd>,
}

async fn write_loop(
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    shared: Arc<Shared>,
) {
    while let Some(out) = rx.recv().await {
        let mut sent = 0;
        if let Some(fd) = &out.fd {
            match send_with_fd(&wr, &out.line, fd).await {
                Ok(n) => sent = n,
                Err(e) => {
                    shared.close(QmpError::io("passing a descriptor to QEMU", e));
                    return;
                }
            }
        }
        if let Err(e) = wr.write_all(&out.line[sent..]).await {
            shared.close(QmpError::io("writing a command to QEMU", e));
            return;
        }
    }
}

/// Sends (a first part of) `line` with `fd` attached as `SCM_RIGHTS`;
/// QEMU takes the descriptor for the command that this data starts.
/// Returns how many bytes went.
async fn send_with_fd(wr: &OwnedWriteHalf, line: &[u8], fd: &OwnedFd) -> std::io::Result<usize> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let stream: &UnixStream = wr.as_ref();
    loop {
        stream.writable().await?;
        let res = stream.try_io(tokio::io::Interest::WRITABLE, || {
            let fds = [fd.as_fd()];
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut anc = SendAncillaryBuffer::new(&mut space);
            anc.push(SendAncillaryMessage::ScmRights(&fds));
            rustix::net::sendmsg(
                stream,
                &[std::io::IoSlice::new(line)],
                &mut anc,
                SendFlags::NOSIGNAL,
            )
            .map_err(std::io::Error::from)
        });
        match res {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Removes a call's reply slot when the call ends in any way, including
/// being cancelled, so the pending map cannot leak.
struct PendingGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.shared.lock().pending.remove(&self.id);
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

    /// Opens `path` in QEMU as block node `node_name` (see the crate docs
    /// for the node scheme). `path` must be absolute and name a block device
    /// (driver `host_device`) or a regular file (driver `file`). Returns how
    /// QEMU opened it ([`BlockIo`]).
    ///
    /// Idempotent: if the node already exists on the same file with the same
    /// read-only flag this succeeds; any other clash is QEMU's error.
    pub async fn blockdev_add_file(
        &self,
        node_name: &str,
        path: &Path,
        readonly: bool,
    ) -> Result<BlockIo, QmpError> {
        validate_node_name(node_name)?;
        let driver = file_driver(path).await?;
        let file = path
            .to_str()
            .ok_or_else(|| QmpError::InvalidArgument(format!("{} is not UTF-8", path.display())))?;
        let args = json!({
            "driver": driver,
            "node-name": node_name,
            "filename": file,
            "read-only": readonly,
            // Guest discards punch holes: sparse volumes stay sparse.
            "discard": "unmap",
        });
        match self.blockdev_add_best(node_name, args, None).await {
            Err(err @ QmpError::Command { .. }) => {
                let same = self.query_named_block_nodes().await?.into_iter().find(|n| {
                    n.node_name == node_name && n.file == file && n.read_only == readonly
                });
                match same {
                    Some(n) => Ok(self.opened_with(&n)),
                    None => Err(err),
                }
            }
            other => other,
        }
    }

    /// `blockdev-add` of `args` with the first of [`BlockIo::candidates`]
    /// QEMU accepts: its refusal of one (an engine it lacks, O_DIRECT on a
    /// filesystem without it) moves on to the next; the last refusal is
    /// the answer. `fd`, the descriptor in the node's fd set, gets the
    /// O_DIRECT flag of each try (QEMU up to 9.0 sets it on the shared
    /// file description itself, later ones pick only a descriptor that
    /// already matches).
    async fn blockdev_add_best(
        &self,
        node_name: &str,
        args: Value,
        fd: Option<&OwnedFd>,
    ) -> Result<BlockIo, QmpError> {
        let candidates = BlockIo::candidates();
        let mut refused: Option<QmpError> = None;
        for io in &candidates {
            if let Some(fd) = fd
                && let Err(e) = set_direct(fd, io.direct)
            {
                tracing::debug!(
                    node = node_name,
                    "O_DIRECT={} on its descriptor: {e}",
                    io.direct
                );
                continue;
            }
            let mut a = args.clone();
            io.apply(&mut a);
            match self.execute("blockdev-add", a).await {
                Ok(_) => {
                    if io != &candidates[0] {
                        tracing::warn!(
                            node = node_name,
                            "QEMU opened it with {io} ({} refused: {})",
                            candidates[0],
                            refused
                                .as_ref()
                                .map(ToString::to_string)
                                .unwrap_or_default()
                        );
                    } else {
                        tracing::debug!(node = node_name, "opened with {io}");
                    }
                    self.shared.lock().opened.insert(node_name.to_string(), *io);
                    return Ok(*io);
                }
                Err(e @ QmpError::Command { .. }) => refused = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(refused.unwrap_or_else(|| {
            QmpError::InvalidArgument(format!("no way to open {node_name} was accepted"))
        }))
    }

    /// How an existing node was opened: as recorded by this client, else
    /// what QEMU reports (not its engine).
    fn opened_with(&self, node: &BlockNode) -> BlockIo {
        self.shared
            .lock()
            .opened
            .get(&node.node_name)
            .copied()
            .unwrap_or(BlockIo {
                direct: node.direct,
                aio: Aio::Unknown,
            })
    }

    /// Opens the device behind `fd` (a block device or a regular file the
    /// caller opened and checked) as block node `node_name`, without QEMU
    /// ever resolving a path: the descriptor goes into a new fd set
    /// (`add-fd`, tagged with the node name) and the node is opened from
    /// `/dev/fdset/<id>`. `fd`'s access mode must match `readonly` (QEMU
    /// picks from the set by it); its O_DIRECT flag is set to match the
    /// cache mode chosen. The set lives until [`blockdev_del`]
    /// (QEMU may reopen the node from it).
    ///
    /// Idempotent: a node of that name already opened from an fd set
    /// succeeds (and `fd` is closed).
    ///
    /// [`blockdev_del`]: Self::blockdev_del
    pub async fn blockdev_add_fd(
        &self,
        node_name: &str,
        fd: OwnedFd,
        readonly: bool,
    ) -> Result<BlockIo, QmpError> {
        validate_node_name(node_name)?;
        let st = rustix::fs::fstat(&fd)
            .map_err(|e| QmpError::InvalidArgument(format!("descriptor for {node_name}: {e}")))?;
        let driver = match rustix::fs::FileType::from_raw_mode(st.st_mode) {
            rustix::fs::FileType::BlockDevice => "host_device",
            rustix::fs::FileType::RegularFile => "file",
            _ => {
                return Err(QmpError::InvalidArgument(format!(
                    "descriptor for {node_name} is neither a block device nor a regular file"
                )));
            }
        };
        let writable = rustix::fs::fcntl_getfl(&fd)
            .map(|f| f.contains(rustix::fs::OFlags::RDWR))
            .unwrap_or(false);
        if writable == readonly {
            return Err(QmpError::InvalidArgument(format!(
                "descriptor for {node_name} is opened {}, the node is {}",
                if writable { "read-write" } else { "read-only" },
                if readonly { "read-only" } else { "read-write" }
            )));
        }
        if let Some(n) = self
            .query_named_block_nodes()
            .await?
            .into_iter()
            .find(|n| n.node_name == node_name && n.file.starts_with(FDSET_PREFIX))
        {
            return Ok(self.opened_with(&n));
        }
        // Shares the file description QEMU gets: its status flags are set
        // through this copy.
        let ours = fd
            .try_clone()
            .map_err(|e| QmpError::io("duplicating a volume descriptor", e))?;
        let added = self
            .execute_with_fd("add-fd", json!({ "opaque": fdset_tag(node_name) }), fd)
            .await?;
        let set = added
            .get("fdset-id")
            .and_then(Value::as_u64)
            .ok_or_else(|| QmpError::Protocol(format!("add-fd answered {added}")))?;
        let args = json!({
            "driver": driver,
            "node-name": node_name,
            "filename": format!("{FDSET_PREFIX}{set}"),
            "read-only": readonly,
            "discard": "unmap",
        });
        match self.blockdev_add_best(node_name, args, Some(&ours)).await {
            Ok(io) => {
                self.shared.lock().fdsets.insert(node_name.to_string(), set);
                Ok(io)
            }
            Err(e) => {
                let _ = self.execute("remove-fd", json!({ "fdset-id": set })).await;
                Err(e)
            }
        }
    }

    /// Removes block node `node_name`. Succeeds if it does not exist.
    /// Fails while a device still uses it. An fd set that
    /// [`blockdev_add_fd`](Self::blockdev_add_fd) made for it goes too.
    pub async fn blockdev_del(&self, node_name: &str) -> Result<(), QmpError> {
        validate_node_name(node_name)?;
        match self
            .execute("blockdev-del", json!({ "node-name": node_name }))
            .await
        {
            Err(err @ QmpError::Command { .. }) => {
                let exists = self
                    .query_named_block_nodes()
                    .await?
                    .iter()
                    .any(|n| n.node_name == node_name);
                if exists {
                    return Err(err);
                }
            }
            other => {
                other?;
            }
        }
        self.shared.lock().opened.remove(node_name);
        self.remove_fdsets(node_name).await
    }

    /// `remove-fd` for the fd set this client made for `node_name`, if
    /// any (one another client made stays until QEMU exits).
    async fn remove_fdsets(&self, node_name: &str) -> Result<(), QmpError> {
        let Some(set) = self.shared.lock().fdsets.get(node_name).copied() else {
            return Ok(());
        };
        match self.execute("remove-fd", json!({ "fdset-id": set })).await {
            // Already gone is fine.
            Ok(_) | Err(QmpError::Command { .. }) => {}
            Err(e) => return Err(e),
        }
        self.shared.lock().fdsets.remove(node_name);
        Ok(())
    }

    /// Hot-plugs a `virtio-blk-pci` device `id` backed by node `node_name`.
    /// The guest sees `serial` in `/sys/block/vd*/serial` (and udev's
    /// `/dev/disk/by-id/virtio-<serial>`). `bus` is the id of a free PCIe
    /// root port (q35 cannot hot-plug onto `pcie.0`); `None` lets QEMU pick.
    /// The device gets [`VirtioBlkOptions`]: queues for every vCPU the VM
    /// can have, its own iothread, the host device's sector size.
    ///
    /// Idempotent: succeeds if device `id` already exists on `node_name`.
    pub async fn device_add_virtio_blk(
        &self,
        id: &str,
        node_name: &str,
        serial: &str,
        bus: Option<&str>,
        opts: &VirtioBlkOptions,
    ) -> Result<(), QmpError> {
        validate_id(id)?;
        validate_node_name(node_name)?;
        validate_serial(serial)?;
        let mut args = json!({
            "driver": "virtio-blk-pci",
            "id": id,
            "drive": node_name,
            "serial": serial,
        });
        if let Some(bus) = bus {
            validate_id(bus)?;
            args["bus"] = json!(bus);
        }
        let queues = match opts.num_queues {
            Some(n) => Some(n),
            // A machine without CPU hot-plug slots: QEMU's default (one
            // queue per vCPU since QEMU 5.2).
            None => match self.max_vcpus().await {
                Ok(n) => Some(n),
                Err(QmpError::Command { desc, .. }) => {
                    tracing::debug!("query-hotpluggable-cpus: {desc}");
                    None
                }
                Err(e) => return Err(e),
            },
        };
        if let Some(n) = queues {
            args["num-queues"] = json!(n.max(1));
        }
        if opts.block_size != 0 {
            if !(512..=4096).contains(&opts.block_size) || !opts.block_size.is_power_of_two() {
                return Err(QmpError::InvalidArgument(format!(
                    "block size {} of {id}: a power of two from 512 to 4096",
                    opts.block_size
                )));
            }
            args["logical_block_size"] = json!(opts.block_size);
            args["physical_block_size"] = json!(opts.block_size);
        }
        let iothread = iothread_id(id);
        if opts.iothread {
            self.add_iothread(&iothread).await?;
            args["iothread"] = json!(iothread);
        }
        let res = match self.execute("device_add", args).await {
            Err(err @ QmpError::Command { .. }) => {
                let same = self.query_block().await?.iter().any(|b| {
                    b.is_device(id)
                        && b.inserted
                            .as_ref()
                            .is_some_and(|n| n.node_name == node_name)
                });
                if same { Ok(()) } else { Err(err) }
            }
            other => other.map(drop),
        };
        if res.is_err() && opts.iothread {
            let _ = self.del_iothread(&iothread).await;
        }
        res
    }

    /// How many vCPUs the VM can have (`query-hotpluggable-cpus`: every
    /// slot, plugged or not); asked once per client.
    pub async fn max_vcpus(&self) -> Result<u16, QmpError> {
        if let Some(n) = self.shared.lock().max_vcpus {
            return Ok(n);
        }
        let cpus = self.execute("query-hotpluggable-cpus", Value::Null).await?;
        let n = cpus.as_array().map_or(1, |a| a.len().clamp(1, 1024) as u16);
        self.shared.lock().max_vcpus = Some(n);
        Ok(n)
    }

    /// Ids of the VM's iothreads (`query-iothreads`).
    pub async fn query_iothreads(&self) -> Result<Vec<String>, QmpError> {
        let v = self.execute("query-iothreads", Value::Null).await?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.get("id").and_then(Value::as_str).map(str::to_owned))
            .collect())
    }

    async fn add_iothread(&self, id: &str) -> Result<(), QmpError> {
        if self.query_iothreads().await?.iter().any(|t| t == id) {
            return Ok(());
        }
        self.execute("object-add", json!({ "qom-type": "iothread", "id": id }))
            .await
            .map(drop)
    }

    /// Deletes iothread `id`; gone already is fine.
    async fn del_iothread(&self, id: &str) -> Result<(), QmpError> {
        if !self.query_iothreads().await?.iter().any(|t| t == id) {
            return Ok(());
        }
        self.execute("object-del", json!({ "id": id }))
            .await
            .map(drop)
    }

    /// Asks QEMU to unplug device `id` and waits up to `timeout` for its
    /// `DEVICE_DELETED` event, then deletes its iothread, if it has one.
    /// Succeeds at once if no such device exists.
    ///
    /// PCI unplug needs the guest's cooperation: QEMU presses the slot's
    /// attention button and only removes the device once the guest OS
    /// releases it. A paused (`-S`) or OS-less guest never does, so this
    /// then returns [`QmpError::Timeout`] and the device stays. Calling
    /// again is safe: QEMU refuses a second request while one is pending
    /// ("already in the process of unplug"), which is taken as "keep
    /// waiting" rather than an error.
    pub async fn device_del(&self, id: &str, timeout: Duration) -> Result<(), QmpError> {
        validate_id(id)?;
        // Subscribe first: the event may beat the command's reply.
        let mut rx = self.events();
        match self.execute("device_del", json!({ "id": id })).await {
            Err(QmpError::Command { class, .. }) if class == "DeviceNotFound" => {
                return self.del_iothread(&iothread_id(id)).await;
            }
            // QEMU's wording since 6.2; an earlier request is still pending.
            Err(QmpError::Command { desc, .. }) if desc.contains("in the process of unplug") => {
                Value::Null
            }
            res => res?,
        };
        let is_ours = |ev: &QmpEvent| ev.data.get("device").and_then(Value::as_str) == Some(id);
        self.next_event(&mut rx, "DEVICE_DELETED", is_ours, timeout)
            .await
            .map_err(|e| match e {
                QmpError::Timeout { after, .. } => QmpError::Timeout {
                    what: format!("DEVICE_DELETED of {id} (the guest must release the device)"),
                    after,
                },
                e => e,
            })?;
        self.del_iothread(&iothread_id(id)).await
    }

    /// Throttles the I/O of virtio device `id` (its qdev id) to `limits`;
    /// all zero lifts every limit. Takes effect at once, guest running.
    pub async fn block_set_io_throttle(
        &self,
        id: &str,
        limits: &IoThrottle,
    ) -> Result<(), QmpError> {
        validate_id(id)?;
        // The backend belongs to the proxy's inner device
        // (`…/<id>/virtio-backend`), not to the qdev `id` itself: QEMU
        // takes its QOM path, as query-block reports it.
        let qdev = self
            .query_block()
            .await?
            .into_iter()
            .find(|b| b.is_device(id))
            .and_then(|b| b.qdev)
            .ok_or_else(|| QmpError::Command {
                class: "DeviceNotFound".into(),
                desc: format!("no block device {id}"),
            })?;
        // QEMU 7.2 wants all six rates; bursts are optional.
        let mut args = json!({
            "id": qdev,
            "iops": limits.iops, "iops_rd": limits.iops_rd, "iops_wr": limits.iops_wr,
            "bps": limits.bps, "bps_rd": limits.bps_rd, "bps_wr": limits.bps_wr,
            "iops_max": limits.iops_max, "iops_rd_max": limits.iops_rd_max,
            "iops_wr_max": limits.iops_wr_max, "bps_max": limits.bps_max,
            "bps_rd_max": limits.bps_rd_max, "bps_wr_max": limits.bps_wr_max,
        });
        if limits.max_length > 0 {
            // Only for a burst that is set: QEMU refuses a length without one.
            for (name, max) in [
                ("iops_max", limits.iops_max),
                ("iops_rd_max", limits.iops_rd_max),
                ("iops_wr_max", limits.iops_wr_max),
                ("bps_max", limits.bps_max),
                ("bps_rd_max", limits.bps_rd_max),
                ("bps_wr_max", limits.bps_wr_max),
            ] {
                if max > 0 {
                    args[format!("{name}_length")] = json!(limits.max_length);
                }
            }
        }
        self.execute("block_set_io_throttle", args).await.map(drop)
    }

    /// Sets the size of node `node_name` to `size` bytes and tells the
    /// guest. For a block device node, grow the device first (e.g.
    /// `losetup -c`) and pass its new size; a regular file is grown by QEMU.
    pub async fn block_resize(&self, node_name: &str, size: u64) -> Result<(), QmpError> {
        validate_node_name(node_name)?;
        if size == 0 || size > i64::MAX as u64 {
            return Err(QmpError::InvalidArgument(format!(
                "block size {size} out of range"
            )));
        }
        self.execute(
            "block_resize",
            json!({ "node-name": node_name, "size": size }),
        )
        .await
        .map(drop)
    }

    /// Block backends (what guest devices are attached to) with their nodes.
    pub async fn query_block(&self) -> Result<Vec<BlockInfo>, QmpError> {
        let raw: Vec<types::RawBlockInfo> = self.query("query-block", Value::Null).await?;
        Ok(raw.into_iter().map(BlockInfo::from).collect())
    }

    /// Every named block node, attached or not (flat: no child recursion).
    pub async fn query_named_block_nodes(&self) -> Result<Vec<BlockNode>, QmpError> {
        let raw: Vec<types::RawNode> = self
            .query("query-named-block-nodes", json!({ "flat": true }))
            .await?;
        Ok(raw.into_iter().map(BlockNode::from).collect())
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

fn parse_greeting(line: &[u8]) -> Result<QemuVersion, QmpError> {
    let bad = || QmpError::Protocol(format!("not a QMP greeting: {}", excerpt(line)));
    let msg: Value = serde_json::from_slice(line).map_err(|_| bad())?;
    let version = msg
        .get("QMP")
        .and_then(|q| q.get("version"))
        .ok_or_else(bad)?;
    let qemu = version.get("qemu").ok_or_else(bad)?;
    let num = |k: &str| {
        qemu.get(k)
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(bad)
    };
    Ok(QemuVersion {
        major: num("major")?,
        minor: num("minor")?,
        micro: num("micro")?,
        package: version
            .get("package")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
    })
}

/// How QEMU names a file in an fd set.
const FDSET_PREFIX: &str = "/dev/fdset/";

/// The iothread of device `id`.
fn iothread_id(id: &str) -> String {
    format!("iothread-{id}")
}

/// Sets or clears O_DIRECT on `fd`'s file description.
fn set_direct(fd: &OwnedFd, direct: bool) -> rustix::io::Result<()> {
    use rustix::fs::OFlags;
    let mut fl = rustix::fs::fcntl_getfl(fd)?;
    fl.set(OFlags::DIRECT, direct);
    rustix::fs::fcntl_setfl(fd, fl)
}

/// Limits of [`QmpClient::block_set_io_throttle`], QEMU's names; 0 =
/// unlimited. A total and its read/write split exclude each other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoThrottle {
    pub iops: u64,
    pub iops_rd: u64,
    pub iops_wr: u64,
    pub bps: u64,
    pub bps_rd: u64,
    pub bps_wr: u64,
    /// Burst rates (`*_max`), each at least its rate.
    pub iops_max: u64,
    pub iops_rd_max: u64,
    pub iops_wr_max: u64,
    pub bps_max: u64,
    pub bps_rd_max: u64,
    pub bps_wr_max: u64,
    /// Seconds a burst may last (`*_max_length`); 0: QEMU's 1 s.
    pub max_length: u64,
}

/// How a `virtio-blk-pci` device is set up
/// ([`QmpClient::device_add_virtio_blk`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtioBlkOptions {
    /// `num-queues`; `None`: one per vCPU the VM can have
    /// ([`QmpClient::max_vcpus`]).
    pub num_queues: Option<u16>,
    /// An iothread of its own (`iothread-<id>`), created with the device
    /// and deleted after it.
    pub iothread: bool,
    /// Logical and physical sector size the guest sees; 0: QEMU's 512.
    /// Pass the host device's, so a filesystem the guest makes mounts on
    /// the host too.
    pub block_size: u32,
}

impl Default for VirtioBlkOptions {
    fn default() -> Self {
        VirtioBlkOptions {
            num_queues: None,
            iothread: true,
            block_size: 0,
        }
    }
}

/// The `opaque` tag of the fd set made for block node `node_name`.
fn fdset_tag(node_name: &str) -> String {
    format!("crust-node:{node_name}")
}

async fn file_driver(path: &Path) -> Result<&'static str, QmpError> {
    use std::os::unix::fs::FileTypeExt;
    if !path.is_absolute() {
        return Err(QmpError::InvalidArgument(format!(
            "{} is not an absolute path",
            path.display()
        )));
    }
    let meta = tokio::fs::metadata(path)
        .await
        .map_err(|e| QmpError::InvalidArgument(format!("{}: {e}", path.display())))?;
    let ft = meta.file_type();
    if ft.is_block_device() {
        Ok("host_device")
    } else if ft.is_file() {
        Ok("file")
    } else {
        Err(QmpError::InvalidArgument(format!(
            "{} is neither a block device nor a regular file",
            path.display()
        )))
    }
}

fn check_qemu_id(kind: &str, id: &str, max: usize) -> Result<(), QmpError> {
    let bad = |why: &str| Err(QmpError::InvalidArgument(format!("{kind} {id:?} {why}")));
    if !id.starts_with(|c: char| c.is_ascii_alphabetic()) {
        return bad("must start with a letter");
    }
    if id.len() > max {
        return bad(&format!("is longer than {max} bytes"));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    {
        return bad("may contain only letters, digits, '-', '.' and '_'");
    }
    Ok(())
}

/// Checks a device id against QEMU's rules: a letter, then letters, digits,
/// `-`, `.` or `_`; at most [`MAX_ID_LEN`] bytes.
pub fn validate_id(id: &str) -> Result<(), QmpError> {
    check_qemu_id("device id", id, MAX_ID_LEN)
}

/// Checks a block node name: the id rules, at most [`MAX_NODE_NAME_LEN`]
/// bytes (QEMU rejects longer node names).
pub fn validate_node_name(name: &str) -> Result<(), QmpError> {
    check_qemu_id("node name", name, MAX_NODE_NAME_LEN)
}

/// Checks a virtio-blk serial: 1 to [`MAX_SERIAL_LEN`] printable ASCII
/// characters without spaces.
pub fn validate_serial(serial: &str) -> Result<(), QmpError> {
    if serial.is_empty()
        || serial.len() > MAX_SERIAL_LEN
        || !serial.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(QmpError::InvalidArgument(format!(
            "serial {serial:?} must be 1..={MAX_SERIAL_LEN} printable ASCII characters"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
