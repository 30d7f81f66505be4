//! Guest end of the forward port ([`crust_agent_proto::forward`]): each
//! stream the host opens becomes a TCP connection to `localhost:<port>` in
//! the guest's network namespace (the one the pod's containers share).
//!
//! Threads, as in the rest of the agent: one reads the port and routes
//! frames; per stream, one connects and then writes what the host sends
//! into the socket, one reads the socket within the stream's credit.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::Duration;

use crust_agent_proto::forward::{Decoder, Family, ForwardError, MAX_PAYLOAD, Msg, WINDOW};
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

/// Connecting to a local port is answered at once; bound it anyway.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The port, written a whole frame at a time.
struct Port(Mutex<OwnedFd>);

impl Port {
    /// Blocks while the host is not reading: the port's back-pressure
    /// (each stream's window keeps that bounded).
    fn send(&self, stream: u32, m: &Msg) {
        let fd = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let frame = m.encode(stream);
        let mut buf = &frame[..];
        while !buf.is_empty() {
            match rustix::io::write(&*fd, buf) {
                Ok(n) => buf = &buf[n..],
                Err(Errno::INTR) | Err(Errno::AGAIN) => {}
                Err(_) => return,
            }
        }
    }
}

/// What a stream's writer thread receives.
enum ToSocket {
    Data(Vec<u8>),
    Shut,
}

/// Credit the host granted for this stream's guest → host data, and
/// whether the stream has ended.
struct Credit {
    state: Mutex<(usize, bool)>,
    cv: Condvar,
}

impl Credit {
    fn new() -> Credit {
        Credit {
            state: Mutex::new((WINDOW, false)),
            cv: Condvar::new(),
        }
    }

    fn grant(&self, n: u32) {
        let mut s = self.state.lock().expect("credit");
        s.0 = (s.0 + n as usize).min(WINDOW);
        self.cv.notify_all();
    }

    fn end(&self) {
        self.state.lock().expect("credit").1 = true;
        self.cv.notify_all();
    }

    /// Waits for credit; `None` once the stream is ended.
    fn take(&self) -> Option<usize> {
        let mut s = self.state.lock().expect("credit");
        loop {
            if s.1 {
                return None;
            }
            if s.0 > 0 {
                return Some(s.0.min(MAX_PAYLOAD));
            }
            s = self.cv.wait(s).expect("credit");
        }
    }

    fn ended(&self) -> bool {
        self.state.lock().expect("credit").1
    }

    fn spend(&self, n: usize) {
        let mut s = self.state.lock().expect("credit");
        s.0 = s.0.saturating_sub(n);
    }
}

/// One stream as the router sees it.
struct Stream {
    tx: mpsc::Sender<ToSocket>,
    credit: Arc<Credit>,
    /// Host bytes routed to the writer and not yet written.
    queued: Arc<AtomicUsize>,
    /// The connection, once made: reset from here, so a writer blocked on
    /// a workload that does not read cannot keep it.
    socket: Arc<Mutex<Option<TcpStream>>>,
}

impl Stream {
    /// Resets the connection (RST to the workload) and ends both threads.
    fn kill(&self) {
        self.credit.end();
        if let Some(s) = self.socket.lock().expect("socket").as_ref() {
            let _ = rustix::net::sockopt::set_socket_linger(s, Some(Duration::ZERO));
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

type Streams = Arc<Mutex<HashMap<u32, Stream>>>;

/// Opens the port named [`crust_agent_proto::FORWARD_PORT_NAME`] when the
/// VM has one and serves it on a thread.
pub fn start() {
    let Ok(path) = crate::port::find_port(crust_agent_proto::FORWARD_PORT_NAME) else {
        return;
    };
    let Ok(fd) = rustix::fs::open(
        path.as_path(),
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return;
    };
    let Ok(reader) = fd.try_clone() else { return };
    let port = Arc::new(Port(Mutex::new(fd)));
    std::thread::Builder::new()
        .name("forward-in".into())
        .spawn(move || read_loop(reader, port))
        .ok();
}

fn read_loop(fd: OwnedFd, port: Arc<Port>) {
    let streams: Streams = Arc::default();
    let mut dec = Decoder::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match rustix::io::read(fd.as_fd(), &mut buf) {
            Ok(0) => {
                // No host on the other end: its streams are gone.
                reset_all(&streams);
                dec.reset();
                std::thread::sleep(Duration::from_millis(25));
            }
            Ok(n) => {
                dec.push(&buf[..n]);
                while let Some(f) = dec.next_frame() {
                    match f {
                        Ok((id, m)) => route(&port, &streams, id, m),
                        Err(ForwardError::TooLarge(_)) => {
                            dec.reset();
                            break;
                        }
                        Err(_) => {}
                    }
                }
            }
            Err(Errno::INTR) | Err(Errno::AGAIN) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn reset_all(streams: &Streams) {
    for (_, s) in streams.lock().expect("streams").drain() {
        s.kill();
    }
}

fn route(port: &Arc<Port>, streams: &Streams, id: u32, m: Msg) {
    match m {
        Msg::Open { port: p, family } => {
            if streams.lock().expect("streams").contains_key(&id) {
                return;
            }
            open(port.clone(), streams.clone(), id, p, family);
        }
        Msg::Data(d) => {
            let mut map = streams.lock().expect("streams");
            let Some(s) = map.get(&id) else { return };
            let q = s.queued.fetch_add(d.len(), Ordering::SeqCst) + d.len();
            if q > WINDOW || s.tx.send(ToSocket::Data(d)).is_err() {
                let s = map.remove(&id).expect("present");
                drop(map);
                s.kill();
                port.send(id, &Msg::Reset);
            }
        }
        Msg::Shut => {
            if let Some(s) = streams.lock().expect("streams").get(&id) {
                let _ = s.tx.send(ToSocket::Shut);
            }
        }
        Msg::Credit(n) => {
            if let Some(s) = streams.lock().expect("streams").get(&id) {
                s.credit.grant(n);
            }
        }
        Msg::Reset => {
            let s = streams.lock().expect("streams").remove(&id);
            if let Some(s) = s {
                s.kill();
            }
        }
        Msg::ResetAll => reset_all(streams),
        // Only the guest sends these.
        Msg::Opened | Msg::Refused(_) => {}
    }
}

/// Registers stream `id` and connects it on its own thread, which then
/// becomes the stream's writer.
fn open(port: Arc<Port>, streams: Streams, id: u32, p: u16, family: Family) {
    let (tx, rx) = mpsc::channel();
    let stream = Stream {
        tx,
        credit: Arc::new(Credit::new()),
        queued: Arc::default(),
        socket: Arc::default(),
    };
    let credit = stream.credit.clone();
    let queued = stream.queued.clone();
    let socket = stream.socket.clone();
    streams.lock().expect("streams").insert(id, stream);
    let registry = streams.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("forward-{id}"))
        .spawn(move || {
            let conn = match connect(p, family) {
                Ok(c) => c,
                Err(reason) => {
                    streams.lock().expect("streams").remove(&id);
                    port.send(id, &Msg::Refused(reason));
                    return;
                }
            };
            let (Ok(reader), Ok(writer)) = (conn.try_clone(), conn.try_clone()) else {
                streams.lock().expect("streams").remove(&id);
                port.send(id, &Msg::Refused("out of file descriptors".into()));
                return;
            };
            let _ = conn.set_nodelay(true);
            *socket.lock().expect("socket") = Some(conn);
            // Reset while connecting: the host has given up on it.
            if !streams.lock().expect("streams").contains_key(&id) {
                let _ = rustix::net::sockopt::set_socket_linger(&writer, Some(Duration::ZERO));
                return;
            }
            port.send(id, &Msg::Opened);
            let halves = Arc::new(AtomicUsize::new(0));
            {
                let (port, streams, halves, credit) = (
                    port.clone(),
                    streams.clone(),
                    halves.clone(),
                    credit.clone(),
                );
                std::thread::Builder::new()
                    .name(format!("forward-{id}-rd"))
                    .spawn(move || {
                        read_socket(reader, &port, &streams, id, &credit);
                        half_done(&streams, id, &halves);
                    })
                    .ok();
            }
            write_socket(writer, &port, &streams, id, rx, &queued);
            half_done(&streams, id, &halves);
        });
    if spawned.is_err() {
        registry.lock().expect("streams").remove(&id);
    }
}

/// `localhost:<port>` in the family the host was reached by, then the
/// other: kubelet's client dials IPv4 first and IPv6 after a failure, and
/// the host side accepts either, so the guest retries for it.
fn connect(p: u16, family: Family) -> Result<TcpStream, String> {
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, p));
    let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, p));
    let order = match family {
        Family::V4 => [v4, v6],
        Family::V6 => [v6, v4],
    };
    let mut why = Vec::new();
    for a in order {
        match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => why.push(format!("{a}: {e}")),
        }
    }
    Err(why.join("; "))
}

/// The stream failed on this side: forget it, reset it, tell the host.
fn fail(streams: &Streams, port: &Port, id: u32) {
    let s = streams.lock().expect("streams").remove(&id);
    if let Some(s) = s {
        s.kill();
        port.send(id, &Msg::Reset);
    }
}

/// Both halves closed cleanly: the stream is done.
fn half_done(streams: &Streams, id: u32, halves: &AtomicUsize) {
    if halves.fetch_add(1, Ordering::SeqCst) + 1 == 2 {
        streams.lock().expect("streams").remove(&id);
    }
}

/// Socket → host, never more than the credit the host granted.
fn read_socket(mut sock: TcpStream, port: &Port, streams: &Streams, id: u32, credit: &Credit) {
    let mut buf = vec![0u8; MAX_PAYLOAD];
    while let Some(cap) = credit.take() {
        match sock.read(&mut buf[..cap]) {
            Ok(0) => {
                if !credit.ended() {
                    port.send(id, &Msg::Shut);
                }
                return;
            }
            Ok(n) => {
                credit.spend(n);
                port.send(id, &Msg::Data(buf[..n].to_vec()));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return fail(streams, port, id),
        }
    }
}

/// Host → socket; each written frame is credited back to the host.
fn write_socket(
    mut sock: TcpStream,
    port: &Port,
    streams: &Streams,
    id: u32,
    rx: mpsc::Receiver<ToSocket>,
    queued: &AtomicUsize,
) {
    for m in rx {
        match m {
            ToSocket::Data(d) => {
                if sock.write_all(&d).is_err() {
                    return fail(streams, port, id);
                }
                queued.fetch_sub(d.len(), Ordering::SeqCst);
                port.send(id, &Msg::Credit(d.len() as u32));
            }
            ToSocket::Shut => {
                let _ = sock.shutdown(Shutdown::Write);
                return;
            }
        }
    }
}
