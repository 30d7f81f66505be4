//! Limits for a TCP listener that anyone on the pod network reaches
//! (crust-csi's peer port and metrics port): what one pod can take of the
//! process serving it is bounded, so the node's own work (the CSI socket,
//! the stats polls) always gets descriptors and CPU.
//!
//! * **Connections**, in all and per peer address ([`Limits`]): one over
//!   either bound is accepted and closed at once (counted), so it neither
//!   waits in the backlog nor holds a descriptor.
//! * **No connection held without a request**: a connection is closed
//!   once it has had no request in flight for [`Limits::idle`], counted
//!   from its accept or its last request's end. Bytes alone do not count
//!   (a client trickling one byte every few seconds never completes a
//!   request), so idle, slow-loris and half-open connections all go. A
//!   request is in flight from the moment its service sees it
//!   ([`Activity::begin`], done by [`TrackRequestsLayer`] for a tonic
//!   server) to its response; request time is the server's own timeout.
//! * **Accept back-off**: when accepting fails for want of descriptors or
//!   memory (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`), the listener waits
//!   (10 ms doubling to 1 s) instead of spinning on the error; the
//!   pending connection stays in the backlog until then.
//! * **A descriptor reserve** ([`descriptor_budget`]): the soft open-file
//!   limit is raised to the hard one and the listeners' connection bounds
//!   are fitted below it, leaving a reserve for everything else.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};

/// A listener's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once.
    pub connections: usize,
    /// Connections open at once from one peer address.
    pub per_peer: usize,
    /// How long a connection may stay without a request in flight.
    pub idle: Duration,
}

/// What a listener refused or closed, for the metrics.
#[derive(Debug, Default)]
pub struct Counters {
    /// Closed at accept: the listener was full.
    pub refused_full: AtomicU64,
    /// Closed at accept: the peer address had its share.
    pub refused_per_peer: AtomicU64,
    /// Closed for holding no request for [`Limits::idle`].
    pub closed_idle: AtomicU64,
    /// Accepts that failed (descriptors, memory, aborted handshakes).
    pub accept_errors: AtomicU64,
    /// Connections open now.
    pub open: AtomicUsize,
}

/// Open connections, in all and per peer address.
#[derive(Default)]
struct Open {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
}

struct Shared {
    limits: Limits,
    open: Mutex<Open>,
    counters: Arc<Counters>,
    what: &'static str,
}

impl Shared {
    /// A slot for a connection from `ip`, or None when a bound is reached.
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<Slot> {
        let mut open = self.open.lock().expect("open");
        if open.total >= self.limits.connections {
            self.counters.refused_full.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let mine = open.per_peer.entry(ip).or_default();
        if *mine >= self.limits.per_peer {
            self.counters
                .refused_per_peer
                .fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *mine += 1;
        open.total += 1;
        self.counters.open.store(open.total, Ordering::Relaxed);
        Some(Slot {
            shared: self.clone(),
            ip,
        })
    }
}

/// One connection's share of the bounds, given back when it closes.
struct Slot {
    shared: Arc<Shared>,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.shared.open.lock().expect("open");
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.per_peer.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.per_peer.remove(&self.ip);
            }
        }
        self.shared
            .counters
            .open
            .store(open.total, Ordering::Relaxed);
    }
}

/// A connection's requests in flight and when the last one ended; the
/// connection info tonic puts in each request's extensions
/// ([`Guarded`] is `Connected`).
#[derive(Clone)]
pub struct Activity(Arc<ActivityState>);

struct ActivityState {
    in_flight: AtomicUsize,
    last: Mutex<Instant>,
    peer: SocketAddr,
}

impl Activity {
    fn new(peer: SocketAddr) -> Activity {
        Activity(Arc::new(ActivityState {
            in_flight: AtomicUsize::new(0),
            last: Mutex::new(Instant::now()),
            peer,
        }))
    }

    /// A request has started on this connection; it ends when the guard
    /// drops.
    pub fn begin(&self) -> RequestGuard {
        self.0.in_flight.fetch_add(1, Ordering::AcqRel);
        RequestGuard(self.clone())
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.0.peer
    }

    /// When the connection is idle for good if nothing starts meanwhile;
    /// None while a request is in flight.
    fn idle_at(&self, idle: Duration) -> Option<Instant> {
        if self.0.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(*self.0.last.lock().expect("last") + idle)
    }
}

/// A request in flight ([`Activity::begin`]).
pub struct RequestGuard(Activity);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        *self.0.0.last.lock().expect("last") = Instant::now();
        self.0.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An accepted connection under a listener's bounds: its reads fail with
/// `TimedOut` once it has been idle ([`Limits::idle`]), so the server
/// drops it.
pub struct Guarded {
    io: TcpStream,
    activity: Activity,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
    shared: Arc<Shared>,
    _slot: Slot,
}

impl Guarded {
    /// Ready with an error once the connection is idle for good; else
    /// pending, woken by the idle timer.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            let now = Instant::now();
            let at = match self.activity.idle_at(self.idle) {
                Some(at) if at <= now => {
                    self.shared
                        .counters
                        .closed_idle
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(peer = %self.activity.peer(), "{}: closing a connection without a request for {:?}", self.shared.what, self.idle);
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no request on this connection for too long",
                    )));
                }
                Some(at) => at,
                // In flight: look again in one period.
                None => now + self.idle,
            };
            if self.timer.deadline() != at {
                self.timer.as_mut().reset(at);
            }
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }

    pub fn activity(&self) -> &Activity {
        &self.activity
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        match Pin::new(&mut me.io).poll_read(cx, buf) {
            Poll::Pending => me.poll_idle(cx),
            ready => ready,
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, data)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Guarded {
    type ConnectInfo = Activity;

    fn connect_info(&self) -> Activity {
        self.activity.clone()
    }
}

/// The connections of `listener` under `limits`, as a stream a tonic
/// server (or an accept loop) takes. It never yields an error: failed
/// accepts are counted, logged and backed off from.
pub struct Incoming {
    listener: TcpListener,
    shared: Arc<Shared>,
    backoff: Option<Pin<Box<Sleep>>>,
    next_backoff: Duration,
}

const BACKOFF_FIRST: Duration = Duration::from_millis(10);
/// Connections closed at accept before one poll yields.
const CLOSE_BATCH: usize = 64;
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// [`Incoming`] for `listener`; `what` names it in logs.
pub fn incoming(
    listener: TcpListener,
    limits: Limits,
    counters: Arc<Counters>,
    what: &'static str,
) -> Incoming {
    Incoming {
        listener,
        shared: Arc::new(Shared {
            limits,
            open: Mutex::default(),
            counters,
            what,
        }),
        backoff: None,
        next_backoff: BACKOFF_FIRST,
    }
}

/// Whether an accept failed for want of a resource that frees up later.
fn exhausted(e: &io::Error) -> bool {
    use rustix::io::Errno;
    e.raw_os_error().is_some_and(|n| {
        let n = Errno::from_raw_os_error(n);
        n == Errno::MFILE || n == Errno::NFILE || n == Errno::NOBUFS || n == Errno::NOMEM
    })
}

impl Incoming {
    /// The next admitted connection; pending while backing off.
    pub async fn accept(&mut self) -> Guarded {
        std::future::poll_fn(|cx| self.poll_accept(cx)).await
    }

    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Guarded> {
        // Connections closed at accept in this poll: a flood yields to the
        // process's other tasks every so many.
        let mut closed = 0;
        loop {
            if closed >= CLOSE_BATCH {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if let Some(b) = &mut self.backoff {
                if b.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.backoff = None;
            }
            match self.listener.poll_accept(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok((io, peer))) => {
                    self.next_backoff = BACKOFF_FIRST;
                    // Over a bound: closed here, at once.
                    let Some(slot) = self.shared.admit(peer.ip()) else {
                        closed += 1;
                        continue;
                    };
                    let _ = io.set_nodelay(true);
                    let activity = Activity::new(peer);
                    return Poll::Ready(Guarded {
                        io,
                        activity,
                        idle: self.shared.limits.idle,
                        timer: Box::pin(tokio::time::sleep(self.shared.limits.idle)),
                        shared: self.shared.clone(),
                        _slot: slot,
                    });
                }
                Poll::Ready(Err(e)) => {
                    self.shared
                        .counters
                        .accept_errors
                        .fetch_add(1, Ordering::Relaxed);
                    if exhausted(&e) {
                        tracing::warn!(
                            "{}: accepting a connection: {e}; waiting {:?}",
                            self.shared.what,
                            self.next_backoff
                        );
                        self.backoff = Some(Box::pin(tokio::time::sleep(self.next_backoff)));
                        self.next_backoff = (self.next_backoff * 2).min(BACKOFF_MAX);
                    } else {
                        tracing::debug!("{}: accepting a connection: {e}", self.shared.what);
                    }
                }
            }
        }
    }
}

impl tokio_stream::Stream for Incoming {
    type Item = io::Result<Guarded>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_accept(cx).map(|g| Some(Ok(g)))
    }
}

/// A tower layer for a tonic server on [`Incoming`]: each request is in
/// flight on its connection ([`Activity::begin`]) until its response is
/// ready, so a connection with a slow request is not closed as idle.
#[derive(Debug, Clone, Copy, Default)]
pub struct TrackRequestsLayer;

impl<S> tower::Layer<S> for TrackRequestsLayer {
    type Service = TrackRequests<S>;

    fn layer(&self, inner: S) -> TrackRequests<S> {
        TrackRequests(inner)
    }
}

/// [`TrackRequestsLayer`]'s service.
#[derive(Debug, Clone)]
pub struct TrackRequests<S>(S);

impl<S, B> tower::Service<http::Request<B>> for TrackRequests<S>
where
    S: tower::Service<http::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let guard = req.extensions().get::<Activity>().map(Activity::begin);
        let fut = self.0.call(req);
        Box::pin(async move {
            let r = fut.await;
            drop(guard);
            r
        })
    }
}

/// Raises this process's soft open-file limit to its hard limit and
/// returns the connections each of `listeners` listeners may hold so that
/// `reserve` descriptors stay for everything else, at most `wanted`.
pub fn descriptor_budget(wanted: usize, listeners: usize, reserve: u64) -> usize {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current < lim.maximum {
        lim.current = lim.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, lim) {
            tracing::warn!("raising the open-file limit to {:?}: {e}", lim.maximum);
        }
    }
    let soft = getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX);
    fit(wanted, listeners, soft, reserve)
}

/// [`descriptor_budget`]'s arithmetic: what is left of `soft` after
/// `reserve`, shared by `listeners`, at most `wanted`, at least 1.
fn fit(wanted: usize, listeners: usize, soft: u64, reserve: u64) -> usize {
    let share = soft.saturating_sub(reserve) / listeners.max(1) as u64;
    (share.min(wanted as u64) as usize).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn limits(connections: usize, per_peer: usize, idle_ms: u64) -> Limits {
        Limits {
            connections,
            per_peer,
            idle: Duration::from_millis(idle_ms),
        }
    }

    #[test]
    fn the_budget_leaves_the_reserve() {
        assert_eq!(fit(1000, 2, 1024, 256), 384);
        assert_eq!(fit(100, 2, 1024, 256), 100);
        assert_eq!(fit(100, 2, 100, 256), 1);
        assert_eq!(fit(100, 0, 1 << 20, 0), 100);
    }

    /// An echo server on `Incoming`: each connection echoes what it reads,
    /// and a line "req" is one request in flight until "done".
    async fn echo(limits: Limits) -> (SocketAddr, Arc<Counters>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let counters = Arc::new(Counters::default());
        let mut inc = incoming(l, limits, counters.clone(), "test");
        tokio::spawn(async move {
            loop {
                let mut c = inc.accept().await;
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    let mut guard = None;
                    while let Ok(n) = c.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        match &buf[..n] {
                            b"req" => guard = Some(c.activity().begin()),
                            b"done" => guard = None,
                            _ => {}
                        }
                        if c.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    drop(guard);
                });
            }
        });
        (addr, counters)
    }

    /// Whether the server closed `s` (EOF or reset) within `wait`.
    async fn closed_within(s: &mut TcpStream, wait: Duration) -> bool {
        let mut b = [0u8; 8];
        match tokio::time::timeout(wait, s.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => true,
            Ok(Ok(_)) | Err(_) => false,
        }
    }

    #[tokio::test]
    async fn bounds_in_all_and_per_peer() {
        let (addr, counters) = echo(limits(3, 2, 60_000)).await;
        let mut kept = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"x").await.unwrap();
            let mut b = [0u8; 1];
            s.read_exact(&mut b).await.unwrap();
            kept.push(s);
        }
        // A third from the same address: closed at once.
        let mut third = TcpStream::connect(addr).await.unwrap();
        assert!(closed_within(&mut third, Duration::from_secs(2)).await);
        assert_eq!(counters.refused_per_peer.load(Ordering::Relaxed), 1);
        // Another address (127.0.0.2 is loopback too) gets the last slot,
        // and then the listener is full.
        let other = tokio::net::TcpSocket::new_v4().unwrap();
        other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut other = other.connect(addr).await.unwrap();
        other.write_all(b"y").await.unwrap();
        let mut b = [0u8; 1];
        other.read_exact(&mut b).await.unwrap();
        let full = tokio::net::TcpSocket::new_v4().unwrap();
        full.bind("127.0.0.3:0".parse().unwrap()).unwrap();
        let mut full = full.connect(addr).await.unwrap();
        assert!(closed_within(&mut full, Duration::from_secs(2)).await);
        assert_eq!(counters.refused_full.load(Ordering::Relaxed), 1);
        assert_eq!(counters.open.load(Ordering::Relaxed), 3);
        // A slot comes back when its connection closes.
        drop(kept.pop());
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut again = TcpStream::connect(addr).await.unwrap();
        again.write_all(b"z").await.unwrap();
        again.read_exact(&mut b).await.unwrap();
    }

    #[tokio::test]
    async fn no_connection_is_held_without_a_request() {
        let (addr, counters) = echo(limits(16, 16, 300)).await;
        // Silent: closed after the idle time, not before.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        assert!(!closed_within(&mut silent, Duration::from_millis(150)).await);
        assert!(closed_within(&mut silent, Duration::from_secs(2)).await);
        // Trickling bytes that never make a request: closed all the same.
        let mut loris = TcpStream::connect(addr).await.unwrap();
        let t = Instant::now();
        let mut closed = false;
        while t.elapsed() < Duration::from_secs(3) {
            if loris.write_all(b".").await.is_err() {
                closed = true;
                break;
            }
            let mut b = [0u8; 1];
            match tokio::time::timeout(Duration::from_millis(100), loris.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    closed = true;
                    break;
                }
                _ => {}
            }
        }
        assert!(closed, "a trickle kept the connection");
        // A request in flight longer than the idle time keeps it open;
        // once it ends, the idle time counts from then.
        let mut busy = TcpStream::connect(addr).await.unwrap();
        busy.write_all(b"req").await.unwrap();
        let mut b = [0u8; 3];
        busy.read_exact(&mut b).await.unwrap();
        assert!(!closed_within(&mut busy, Duration::from_millis(900)).await);
        busy.write_all(b"done").await.unwrap();
        let mut b = [0u8; 4];
        busy.read_exact(&mut b).await.unwrap();
        assert!(closed_within(&mut busy, Duration::from_secs(2)).await);
        assert!(counters.closed_idle.load(Ordering::Relaxed) >= 3);
    }
}
