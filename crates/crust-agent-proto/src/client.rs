//! Host-side async client for the guest agent.
//!
//! The agent channel is the unix socket behind QEMU's `virtserialport`
//! chardev (`server=on,wait=off`). QEMU accepts one client at a time; the
//! guest sees a disconnect as a HUP and keeps serving the next connection.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::frame::{self, FrameError};
use crate::messages::*;

/// Why a call did not produce a reply.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be connected (QEMU not running, wrong path).
    #[error("cannot connect to agent socket {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The connection dropped before the reply arrived. The request may or
    /// may not have been carried out.
    #[error("agent connection lost before the reply arrived")]
    Disconnected,
    /// No reply within the call's timeout. The agent may still finish it.
    #[error("agent call {op} timed out after {after:?}")]
    Timeout { op: &'static str, after: Duration },
    /// [`AgentClient::wait_ready`] gave up.
    #[error("agent not ready after {after:?}: {last}")]
    NotReady { after: Duration, last: String },
    /// The agent answered with an error.
    #[error("agent: {0}")]
    Agent(#[from] AgentError),
    /// The reply did not have the expected shape.
    #[error("malformed reply to {op}: {message}")]
    Protocol { op: &'static str, message: String },
    /// The request could not be framed (e.g. larger than 1 MiB).
    #[error(transparent)]
    Frame(#[from] FrameError),
}

impl ClientError {
    /// The agent's error code, when the agent answered with an error.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Agent(e) => Some(e.code),
            _ => None,
        }
    }
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Response>>>>;

struct Connection {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    pending: Pending,
    alive: Arc<AtomicBool>,
    reader: JoinHandle<()>,
    writer: JoinHandle<()>,
}

impl Connection {
    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::SeqCst);
        self.reader.abort();
        self.writer.abort();
        // Dropping the senders fails every waiting call with Disconnected.
        self.pending.lock().expect("pending lock").clear();
    }
}

struct Inner {
    path: PathBuf,
    default_timeout: Duration,
    next_id: AtomicU64,
    conn: Mutex<Option<Arc<Connection>>>,
    connect_lock: tokio::sync::Mutex<()>,
}

/// Async client for the guest agent. Cheap to clone; clones share the
/// connection. Concurrent calls are multiplexed by request id.
///
/// The connection is opened lazily and re-opened on the next call after it
/// drops; calls in flight when it drops fail with
/// [`ClientError::Disconnected`].
///
/// ```no_run
/// # async fn demo() -> Result<(), crust_agent_proto::ClientError> {
/// use std::time::Duration;
/// use crust_agent_proto::{AgentClient, MountVolume, FsType};
/// let agent = AgentClient::new("/run/crust/sandbox-1/agent.sock");
/// agent.wait_ready(Duration::from_secs(30)).await?;
/// let reply = agent
///     .mount_volume(MountVolume {
///         volume: "pvc-1".into(),
///         serial: "crust-pvc-1".into(),
///         fstype: FsType::Ext4,
///         options: vec!["noatime".into()],
///         readonly: false,
///         fs_group: Some(2000),
///         fs_group_policy: None,
///     })
///     .await?;
/// println!("mounted at {}", reply.mount_path);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct AgentClient {
    inner: Arc<Inner>,
}

/// Default per-call timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

impl AgentClient {
    /// A client for the socket at `path`; nothing is connected yet.
    pub fn new(path: impl AsRef<Path>) -> Self {
        Self::with_timeout(path, DEFAULT_TIMEOUT)
    }

    /// Like [`AgentClient::new`] with a different default per-call timeout.
    pub fn with_timeout(path: impl AsRef<Path>, default_timeout: Duration) -> Self {
        AgentClient {
            inner: Arc::new(Inner {
                path: path.as_ref().to_path_buf(),
                default_timeout,
                next_id: AtomicU64::new(first_id()),
                conn: Mutex::new(None),
                connect_lock: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// Socket path.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Connects now (replacing any current connection).
    pub async fn reconnect(&self) -> Result<(), ClientError> {
        let _g = self.inner.connect_lock.lock().await;
        self.disconnect();
        let conn = self.open().await?;
        *self.inner.conn.lock().expect("conn lock") = Some(conn);
        Ok(())
    }

    /// Drops the current connection (the guest sees a HUP). The next call
    /// reconnects.
    pub fn disconnect(&self) {
        let old = self.inner.conn.lock().expect("conn lock").take();
        drop(old);
    }

    /// Whether a live connection is open.
    pub fn is_connected(&self) -> bool {
        self.inner
            .conn
            .lock()
            .expect("conn lock")
            .as_ref()
            .is_some_and(|c| c.is_alive())
    }

    async fn connection(&self) -> Result<Arc<Connection>, ClientError> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let _g = self.inner.connect_lock.lock().await;
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let conn = self.open().await?;
        *self.inner.conn.lock().expect("conn lock") = Some(conn.clone());
        Ok(conn)
    }

    fn current(&self) -> Option<Arc<Connection>> {
        self.inner
            .conn
            .lock()
            .expect("conn lock")
            .as_ref()
            .filter(|c| c.is_alive())
            .cloned()
    }

    async fn open(&self) -> Result<Arc<Connection>, ClientError> {
        let stream = UnixStream::connect(&self.inner.path)
            .await
            .map_err(|source| ClientError::Connect {
                path: self.inner.path.clone(),
                source,
            })?;
        let (mut rd, mut wr) = stream.into_split();
        let pending: Pending = Arc::default();
        let alive = Arc::new(AtomicBool::new(true));
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();

        // Whole frames are written by one task so a cancelled call can never
        // leave half a frame on the stream.
        let writer = {
            let alive = alive.clone();
            tokio::spawn(async move {
                while let Some(buf) = rx.recv().await {
                    if wr.write_all(&buf).await.is_err() {
                        alive.store(false, Ordering::SeqCst);
                        break;
                    }
                }
            })
        };
        let reader = {
            let pending = pending.clone();
            let alive = alive.clone();
            tokio::spawn(async move {
                // Any framing or JSON error means the stream is out of sync:
                // give up on it; the next call reconnects.
                while let Ok(Some(body)) = frame::read_frame_async(&mut rd).await {
                    let Ok(resp) = frame::decode::<Response>(&body) else {
                        break;
                    };
                    // Replies to timed-out calls (or from an earlier
                    // connection) have no waiter and are dropped.
                    let waiter = pending.lock().expect("pending lock").remove(&resp.id);
                    if let Some(w) = waiter {
                        let _ = w.send(resp);
                    }
                }
                alive.store(false, Ordering::SeqCst);
                pending.lock().expect("pending lock").clear();
            })
        };
        Ok(Arc::new(Connection {
            tx,
            pending,
            alive,
            reader,
            writer,
        }))
    }

    /// Sends `req` and waits for its reply with the default timeout.
    pub async fn call<C: Call>(&self, req: C) -> Result<C::Reply, ClientError> {
        self.call_with_timeout(req, self.inner.default_timeout)
            .await
    }

    /// Sends `req` and waits at most `timeout` (connecting included). The
    /// agent receives the same budget as its deadline.
    pub async fn call_with_timeout<C: Call>(
        &self,
        req: C,
        timeout: Duration,
    ) -> Result<C::Reply, ClientError> {
        let deadline = Instant::now() + timeout;
        let timed_out = || ClientError::Timeout {
            op: C::NAME,
            after: timeout,
        };
        let conn = tokio::time::timeout_at(deadline, self.connection())
            .await
            .map_err(|_| timed_out())??;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let request = Request {
            id,
            deadline_ms: timeout.as_millis().clamp(1, u64::MAX as u128) as u64,
            op: req.into(),
        };
        let buf = frame::encode(&request)?;
        let (tx, rx) = oneshot::channel();
        conn.pending.lock().expect("pending lock").insert(id, tx);
        let _cleanup = PendingGuard {
            pending: &conn.pending,
            id,
        };
        if conn.tx.send(buf).is_err() || !conn.is_alive() {
            return Err(ClientError::Disconnected);
        }
        let resp = match tokio::time::timeout_at(deadline, rx).await {
            Err(_) => return Err(timed_out()),
            Ok(Err(_)) => return Err(ClientError::Disconnected),
            Ok(Ok(resp)) => resp,
        };
        match resp.outcome {
            Outcome::Result(v) => serde_json::from_value(v).map_err(|e| ClientError::Protocol {
                op: C::NAME,
                message: e.to_string(),
            }),
            Outcome::Error(e) => Err(ClientError::Agent(e)),
        }
    }

    /// Connects and pings until the agent answers or `timeout` passes.
    /// Suitable right after launching QEMU: a missing socket or a guest
    /// still booting is retried.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<PingReply, ClientError> {
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no attempt made");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ClientError::NotReady {
                    after: timeout,
                    last,
                });
            }
            match self
                .call_with_timeout(Ping {}, left.min(Duration::from_secs(1)))
                .await
            {
                Ok(reply) => return Ok(reply),
                Err(e @ ClientError::Agent(_)) => return Err(e),
                Err(e) => {
                    if matches!(e, ClientError::Connect { .. } | ClientError::Disconnected) {
                        tokio::time::sleep(Duration::from_millis(50).min(left)).await;
                    }
                    last = e.to_string();
                }
            }
        }
    }

    pub async fn ping(&self) -> Result<PingReply, ClientError> {
        self.call(Ping {}).await
    }

    pub async fn mount_volume(&self, req: MountVolume) -> Result<MountVolumeReply, ClientError> {
        self.call(req).await
    }

    pub async fn stat_volume(&self, volume: &str) -> Result<VolumeStats, ClientError> {
        self.call(StatVolume {
            volume: volume.into(),
        })
        .await
    }

    /// Grows once the guest sees `device_bytes` (when given).
    pub async fn grow_volume(
        &self,
        volume: &str,
        device_bytes: Option<u64>,
    ) -> Result<GrowVolumeReply, ClientError> {
        self.call(GrowVolume {
            volume: volume.into(),
            device_bytes,
        })
        .await
    }

    /// FIFREEZE in the guest; the agent thaws by itself after `max_frozen`.
    pub async fn freeze_volume(
        &self,
        volume: &str,
        max_frozen: Duration,
    ) -> Result<(), ClientError> {
        self.call(FreezeVolume {
            volume: volume.into(),
            max_frozen_ms: max_frozen.as_millis() as u64,
        })
        .await
        .map(drop)
    }

    pub async fn thaw_volume(&self, volume: &str) -> Result<ThawVolumeReply, ClientError> {
        self.call(ThawVolume {
            volume: volume.into(),
        })
        .await
    }

    pub async fn unmount_volume(&self, volume: &str) -> Result<(), ClientError> {
        self.call(UnmountVolume {
            volume: volume.into(),
        })
        .await
        .map(|_| ())
    }

    /// Runs `args` in the guest, killed after `timeout`.
    pub async fn exec<S: AsRef<str>>(
        &self,
        args: &[S],
        timeout: Duration,
    ) -> Result<ExecReply, ClientError> {
        let req = Exec {
            args: args.iter().map(|a| a.as_ref().to_owned()).collect(),
            env: Vec::new(),
            timeout_ms: timeout.as_millis() as u64,
            container: None,
        };
        self.call_with_timeout(req, timeout + Duration::from_secs(10))
            .await
    }

    /// Asks the guest to clean up and power off. QEMU (started with
    /// `-no-reboot`) exits shortly after the reply.
    pub async fn shutdown(&self) -> Result<(), ClientError> {
        self.call(Shutdown {}).await.map(|_| ())
    }
}

/// Ids start at a time-derived value so a reply still queued in the guest
/// for an earlier client cannot be mistaken for one of ours. Kept below
/// 2^48 so every id is exact as a JSON number anywhere.
fn first_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    ((nanos ^ (u64::from(std::process::id()) << 32)) & ((1 << 47) - 1)) | 1
}

struct PendingGuard<'a> {
    pending: &'a Pending,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.pending.lock().expect("pending lock").remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    //! The client against a scripted agent on a real unix socket.
    use super::*;
    use crate::GuestInfo;
    use crate::frame::FrameDecoder;
    use tokio::io::AsyncReadExt;
    use tokio::net::UnixListener;

    async fn read_request(s: &mut UnixStream, dec: &mut FrameDecoder) -> Option<Request> {
        loop {
            if let Some(f) = dec.next_frame() {
                return Some(parse_request(&f.unwrap()).unwrap());
            }
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).await.unwrap();
            if n == 0 {
                return None;
            }
            dec.push(&buf[..n]);
        }
    }

    async fn reply(s: &mut UnixStream, resp: &Response) {
        s.write_all(&frame::encode(resp).unwrap()).await.unwrap();
    }

    fn pong() -> PingReply {
        PingReply {
            version: "t".into(),
            protocol: crate::PROTOCOL_VERSION,
            uptime_ms: 1,
        }
    }

    #[tokio::test]
    async fn multiplexes_out_of_order_replies_and_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut dec = FrameDecoder::new();
            let a = read_request(&mut s, &mut dec).await.unwrap();
            let b = read_request(&mut s, &mut dec).await.unwrap();
            let c = read_request(&mut s, &mut dec).await.unwrap();
            assert!(a.deadline_ms > 0);
            // Answer in reverse order, plus a stray id nobody waits for;
            // never answer the third (it times out).
            reply(&mut s, &Response::ok(999, &Empty {})).await;
            let (ping, stat) = if matches!(a.op, Operation::Ping(_)) {
                (a, b)
            } else {
                (b, a)
            };
            reply(
                &mut s,
                &Response::err(
                    stat.id,
                    AgentError::new(ErrorCode::NotFound, "volume v is not mounted"),
                ),
            )
            .await;
            reply(&mut s, &Response::ok(ping.id, &pong())).await;
            let _ = c;
            // Keep the connection open until the client is done.
            let mut buf = [0u8; 16];
            let _ = s.read(&mut buf).await;
        });
        let client = AgentClient::new(&path);
        let (p, st, slow) = tokio::join!(
            client.ping(),
            client.stat_volume("v"),
            client.call_with_timeout(GuestInfo {}, Duration::from_millis(300)),
        );
        assert_eq!(p.unwrap(), pong());
        let err = st.unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::NotFound));
        assert!(err.to_string().contains("not mounted"));
        assert!(matches!(
            slow,
            Err(ClientError::Timeout {
                op: "guest_info",
                ..
            })
        ));
        client.disconnect();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn reconnects_after_drop_and_wait_ready_retries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let client = AgentClient::new(&path);
        // No socket yet: connect errors are retried until the deadline.
        let err = client
            .wait_ready(Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::NotReady { .. }), "{err}");

        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            // First connection: read one request and hang up without reply.
            let (mut s, _) = listener.accept().await.unwrap();
            let mut dec = FrameDecoder::new();
            read_request(&mut s, &mut dec).await.unwrap();
            drop(s);
            // Second connection: answer pings.
            let (mut s, _) = listener.accept().await.unwrap();
            let mut dec = FrameDecoder::new();
            while let Some(r) = read_request(&mut s, &mut dec).await {
                reply(&mut s, &Response::ok(r.id, &pong())).await;
            }
        });
        let first = client.ping().await;
        assert!(matches!(first, Err(ClientError::Disconnected)), "{first:?}");
        // The next call opens a new connection by itself.
        assert_eq!(
            client.wait_ready(Duration::from_secs(5)).await.unwrap(),
            pong()
        );
        assert!(client.is_connected());
        client.disconnect();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn garbage_from_the_agent_drops_the_connection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut dec = FrameDecoder::new();
            read_request(&mut s, &mut dec).await.unwrap();
            s.write_all(&[0xff, 0xff, 0xff, 0xff]).await.unwrap();
            let mut buf = [0u8; 16];
            let _ = s.read(&mut buf).await;
        });
        let client = AgentClient::new(&path);
        assert!(matches!(
            client.ping().await,
            Err(ClientError::Disconnected)
        ));
        assert!(!client.is_connected());
        client.disconnect();
        server.await.unwrap();
    }
}
