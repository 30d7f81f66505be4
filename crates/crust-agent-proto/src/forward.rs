//! The port-forward channel: TCP connections made on the host to a port of
//! the pod carried to `localhost:<port>` in the guest, multiplexed over one
//! virtio-serial port ([`FORWARD_PORT_NAME`]).
//!
//! Why a port of its own rather than the stdio port: a connection's bytes
//! must never wait behind a container's output, and each connection needs
//! its own flow control. virtio-serial only pushes back on the whole port,
//! so every stream has a window of [`WINDOW`] bytes: a side sends at most
//! that much data the other has not yet acknowledged with [`Msg::Credit`],
//! which the receiver grants once the bytes are written to its socket. A
//! peer that ignores the window has the stream reset, so a slow reader in
//! one connection stalls only its own connection.
//!
//! Frames are [`crate::mux`]'s. Host → guest: [`Msg::Open`] (the host picks
//! the stream id), then either side may send [`Msg::Data`], [`Msg::Shut`]
//! (half-close: no more data from me), [`Msg::Reset`] (the connection is
//! gone: reset yours) and [`Msg::Credit`]. Guest → host answers an open
//! with [`Msg::Opened`] or [`Msg::Refused`]. [`Msg::ResetAll`] (host →
//! guest, stream 0) starts every connection of the host over: the host
//! sends it on each (re)connect, since streams of an earlier host are gone.

use crate::mux::{RawDecoder, encode};

pub use crate::mux::MAX_PAYLOAD;

/// Name of the virtio-serial port carrying port-forward frames.
pub const FORWARD_PORT_NAME: &str = "org.crust.forward";

/// Bytes of data either side may have in flight per stream.
pub const WINDOW: usize = 256 * 1024;

/// Longest a reason in [`Msg::Refused`] may be.
pub const MAX_REASON: usize = 512;

/// Address family the host side was reached by (the guest tries it first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

/// One message of the forward port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    Open { port: u16, family: Family },
    Opened,
    Refused(String),
    Data(Vec<u8>),
    Shut,
    Reset,
    Credit(u32),
    ResetAll,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    #[error("forward frame announces {0} bytes, more than {MAX_PAYLOAD}")]
    TooLarge(usize),
    #[error("forward frame of unknown kind {0}")]
    UnknownKind(u8),
    #[error("forward frame of kind {kind} with a malformed {len}-byte payload")]
    BadPayload { kind: u8, len: usize },
}

const OPEN: u8 = 1;
const OPENED: u8 = 2;
const REFUSED: u8 = 3;
const DATA: u8 = 4;
const SHUT: u8 = 5;
const RESET: u8 = 6;
const CREDIT: u8 = 7;
const RESET_ALL: u8 = 8;

impl Msg {
    /// Encodes the message for `stream`; [`Msg::Data`] must be at most
    /// [`MAX_PAYLOAD`] bytes, a refusal reason is cut to [`MAX_REASON`].
    pub fn encode(&self, stream: u32) -> Vec<u8> {
        match self {
            Msg::Open { port, family } => {
                let mut p = port.to_be_bytes().to_vec();
                p.push(match family {
                    Family::V4 => 4,
                    Family::V6 => 6,
                });
                encode(stream, OPEN, &p)
            }
            Msg::Opened => encode(stream, OPENED, &[]),
            Msg::Refused(why) => {
                let mut end = why.len().min(MAX_REASON);
                while !why.is_char_boundary(end) {
                    end -= 1;
                }
                encode(stream, REFUSED, &why.as_bytes()[..end])
            }
            Msg::Data(d) => encode(stream, DATA, d),
            Msg::Shut => encode(stream, SHUT, &[]),
            Msg::Reset => encode(stream, RESET, &[]),
            Msg::Credit(n) => encode(stream, CREDIT, &n.to_be_bytes()),
            Msg::ResetAll => encode(stream, RESET_ALL, &[]),
        }
    }

    fn decode(kind: u8, data: Vec<u8>) -> Result<Msg, ForwardError> {
        let bad = |data: &[u8]| ForwardError::BadPayload {
            kind,
            len: data.len(),
        };
        let empty = |m: Msg| {
            if data.is_empty() {
                Ok(m)
            } else {
                Err(bad(&data))
            }
        };
        match kind {
            OPEN => match data[..] {
                [hi, lo, 4] => Ok(Msg::Open {
                    port: u16::from_be_bytes([hi, lo]),
                    family: Family::V4,
                }),
                [hi, lo, 6] => Ok(Msg::Open {
                    port: u16::from_be_bytes([hi, lo]),
                    family: Family::V6,
                }),
                _ => Err(bad(&data)),
            },
            OPENED => empty(Msg::Opened),
            REFUSED if data.len() <= MAX_REASON => {
                Ok(Msg::Refused(String::from_utf8_lossy(&data).into_owned()))
            }
            REFUSED => Err(bad(&data)),
            DATA => Ok(Msg::Data(data)),
            SHUT => empty(Msg::Shut),
            RESET => empty(Msg::Reset),
            CREDIT => match data[..] {
                [a, b, c, d] => Ok(Msg::Credit(u32::from_be_bytes([a, b, c, d]))),
                _ => Err(bad(&data)),
            },
            RESET_ALL => empty(Msg::ResetAll),
            k => Err(ForwardError::UnknownKind(k)),
        }
    }
}

/// Reassembles forward frames from a byte stream split anywhere. A
/// malformed payload spoils one frame only; an over-long one desyncs the
/// stream (the caller resets).
#[derive(Debug, Default)]
pub struct Decoder {
    raw: RawDecoder,
}

impl Decoder {
    pub fn push(&mut self, data: &[u8]) {
        self.raw.push(data);
    }

    pub fn reset(&mut self) {
        self.raw.reset();
    }

    /// The next whole frame as (stream, message).
    pub fn next_frame(&mut self) -> Option<Result<(u32, Msg), ForwardError>> {
        Some(match self.raw.next_frame()? {
            Err(len) => Err(ForwardError::TooLarge(len)),
            Ok(f) => Msg::decode(f.kind, f.data).map(|m| (f.stream, m)),
        })
    }
}

#[cfg(feature = "client")]
pub use host::{ForwardMux, RelayError};

#[cfg(feature = "client")]
mod host {
    use std::collections::{HashMap, VecDeque};
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::net::TcpStream;
    use tokio::sync::mpsc;

    use super::{Family, MAX_PAYLOAD, Msg, WINDOW};

    /// How long the guest has to answer an open.
    const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

    /// How a relayed connection ended other than by both sides closing.
    #[derive(Debug, thiserror::Error)]
    pub enum RelayError {
        #[error("nothing accepts connections on port {port} in the guest: {reason}")]
        Refused { port: u16, reason: String },
        #[error("the guest did not answer the open of port {port} within {OPEN_TIMEOUT:?}")]
        OpenTimeout { port: u16 },
        #[error("the guest reset the connection")]
        GuestReset,
        #[error("the guest sent more than the {WINDOW}-byte window")]
        Overrun,
        #[error("the connection to the guest's forward port was lost")]
        Lost,
        #[error("host socket: {0}")]
        Io(#[from] std::io::Error),
    }

    type Streams = Arc<Mutex<HashMap<u32, mpsc::UnboundedSender<Msg>>>>;

    /// Host end of the forward port: one connection to QEMU's chardev
    /// socket, demultiplexed by stream id; reconnects while the socket is
    /// there and ends when it is gone (the VM stopped).
    #[derive(Clone)]
    pub struct ForwardMux {
        streams: Streams,
        tx: mpsc::UnboundedSender<Vec<u8>>,
        next: Arc<AtomicU32>,
    }

    impl ForwardMux {
        pub fn new(socket: impl Into<PathBuf>) -> ForwardMux {
            let streams: Streams = Arc::default();
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(run(socket.into(), streams.clone(), rx));
            // Ids of an earlier shim's streams may still be in flight from
            // the guest: start somewhere else.
            let seed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(1);
            ForwardMux {
                streams,
                tx,
                next: Arc::new(AtomicU32::new(seed | 1)),
            }
        }

        /// Queues `m`; false once the port's task has ended (VM gone).
        fn send(&self, stream: u32, m: &Msg) -> bool {
            self.tx.send(m.encode(stream)).is_ok()
        }

        /// Carries `tcp` to `localhost:port` in the guest until both sides
        /// have closed. A refused or failed connection resets `tcp`, so
        /// the client sees an error, never a clean end.
        pub async fn relay(
            &self,
            tcp: TcpStream,
            port: u16,
            family: Family,
        ) -> Result<(), RelayError> {
            let id = loop {
                let id = self.next.fetch_add(1, Ordering::Relaxed);
                if id != 0 {
                    break id;
                }
            };
            let (tx, mut rx) = mpsc::unbounded_channel();
            self.streams.lock().expect("streams").insert(id, tx);
            let _registered = Registered(self, id);
            if !self.send(id, &Msg::Open { port, family }) {
                reset(tcp);
                return Err(RelayError::Lost);
            }
            let answer = tokio::time::timeout(OPEN_TIMEOUT, rx.recv()).await;
            let failed = match answer {
                Ok(Some(Msg::Opened)) => None,
                Ok(Some(Msg::Refused(reason))) => Some(RelayError::Refused { port, reason }),
                Ok(Some(Msg::Reset)) | Ok(Some(_)) => Some(RelayError::GuestReset),
                Ok(None) => Some(RelayError::Lost),
                Err(_) => {
                    self.send(id, &Msg::Reset);
                    Some(RelayError::OpenTimeout { port })
                }
            };
            if let Some(e) = failed {
                reset(tcp);
                return Err(e);
            }
            let r = pump(self, id, &tcp, &mut rx).await;
            if r.is_err() {
                reset(tcp);
            }
            r
        }
    }

    struct Registered<'a>(&'a ForwardMux, u32);

    impl Drop for Registered<'_> {
        fn drop(&mut self) {
            self.0.streams.lock().expect("streams").remove(&self.1);
        }
    }

    /// Closes with RST (SO_LINGER 0): the client learns the connection
    /// failed rather than reading a clean end of stream.
    fn reset(tcp: TcpStream) {
        let _ = tcp.set_zero_linger();
        drop(tcp);
    }

    /// Moves bytes both ways inside the windows, half-closes each way when
    /// its sender does, and returns once both ways are closed.
    async fn pump(
        mux: &ForwardMux,
        id: u32,
        tcp: &TcpStream,
        rx: &mut mpsc::UnboundedReceiver<Msg>,
    ) -> Result<(), RelayError> {
        let mut credit = WINDOW;
        let mut reading = true;
        let mut out: VecDeque<Vec<u8>> = VecDeque::new();
        let mut out_off = 0;
        let mut queued = 0usize;
        let mut guest_shut = false;
        let mut wrote_shut = false;
        let mut buf = vec![0u8; MAX_PAYLOAD];
        loop {
            if guest_shut && out.is_empty() && !wrote_shut {
                shutdown_write(tcp)?;
                wrote_shut = true;
            }
            if !reading && wrote_shut {
                return Ok(());
            }
            tokio::select! {
                r = tcp.readable(), if reading && credit > 0 => {
                    r?;
                    let cap = credit.min(MAX_PAYLOAD);
                    match tcp.try_read(&mut buf[..cap]) {
                        Ok(0) => {
                            mux.send(id, &Msg::Shut);
                            reading = false;
                        }
                        Ok(n) => {
                            mux.send(id, &Msg::Data(buf[..n].to_vec()));
                            credit -= n;
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => {
                            mux.send(id, &Msg::Reset);
                            return Err(e.into());
                        }
                    }
                }
                r = tcp.writable(), if !out.is_empty() => {
                    r?;
                    let front = out.front().expect("non-empty");
                    match tcp.try_write(&front[out_off..]) {
                        Ok(n) => {
                            out_off += n;
                            if out_off == front.len() {
                                let done = front.len();
                                out.pop_front();
                                out_off = 0;
                                queued -= done;
                                mux.send(id, &Msg::Credit(done as u32));
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => {
                            mux.send(id, &Msg::Reset);
                            return Err(e.into());
                        }
                    }
                }
                m = rx.recv() => match m {
                    None => return Err(RelayError::Lost),
                    Some(Msg::Data(d)) if !guest_shut => {
                        queued += d.len();
                        if queued > WINDOW {
                            mux.send(id, &Msg::Reset);
                            return Err(RelayError::Overrun);
                        }
                        if !d.is_empty() {
                            out.push_back(d);
                        }
                    }
                    Some(Msg::Shut) => guest_shut = true,
                    Some(Msg::Credit(n)) => credit = (credit + n as usize).min(WINDOW),
                    Some(Msg::Reset) => return Err(RelayError::GuestReset),
                    // Data after Shut, or a message only an open expects.
                    Some(_) => {
                        mux.send(id, &Msg::Reset);
                        return Err(RelayError::GuestReset);
                    }
                },
            }
        }
    }

    /// shutdown(SHUT_WR) on a shared `TcpStream`.
    fn shutdown_write(tcp: &TcpStream) -> std::io::Result<()> {
        socket2::SockRef::from(tcp).shutdown(std::net::Shutdown::Write)
    }

    async fn run(socket: PathBuf, streams: Streams, rx: mpsc::UnboundedReceiver<Vec<u8>>) {
        // Streams of an earlier connection are gone on the guest's side
        // too: the greeting resets them there, `lose_all` here.
        let port = crate::mux::host::Port {
            socket,
            greeting: Some(Msg::ResetAll.encode(0)),
            resend: false,
        };
        let frame = |f: crate::mux::RawFrame| {
            // A malformed frame is dropped; the stream times out or the
            // guest resets it.
            let Ok(msg) = Msg::decode(f.kind, f.data) else {
                return;
            };
            if let Some(tx) = streams.lock().expect("streams").get(&f.stream) {
                let _ = tx.send(msg);
            }
        };
        crate::mux::host::serve(port, rx, frame, || lose_all(&streams)).await;
    }

    /// Ends every open relay: their guest halves are gone.
    fn lose_all(streams: &Streams) {
        for tx in streams.lock().expect("streams").values() {
            let _ = tx.send(Msg::Reset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_split_anywhere() {
        let msgs = vec![
            (
                3,
                Msg::Open {
                    port: 8080,
                    family: Family::V6,
                },
            ),
            (3, Msg::Opened),
            (4, Msg::Refused("connection refused".into())),
            (3, Msg::Data(vec![7; MAX_PAYLOAD])),
            (3, Msg::Credit(65536)),
            (3, Msg::Shut),
            (3, Msg::Reset),
            (0, Msg::ResetAll),
        ];
        let mut bytes = Vec::new();
        for (s, m) in &msgs {
            bytes.extend(m.encode(*s));
        }
        let mut dec = Decoder::default();
        let mut got = Vec::new();
        for c in bytes.chunks(7) {
            dec.push(c);
            while let Some(f) = dec.next_frame() {
                got.push(f.unwrap());
            }
        }
        assert_eq!(got, msgs);
    }

    #[test]
    fn malformed_payloads_are_errors_and_do_not_desync() {
        let mut dec = Decoder::default();
        dec.push(&crate::mux::encode(1, 1, &[0, 80, 5]));
        dec.push(&crate::mux::encode(1, 7, &[1, 2]));
        dec.push(&crate::mux::encode(1, 5, b"x"));
        dec.push(&crate::mux::encode(1, 42, b""));
        dec.push(&Msg::Opened.encode(9));
        let errs: Vec<_> = std::iter::from_fn(|| dec.next_frame()).collect();
        assert_eq!(
            errs,
            vec![
                Err(ForwardError::BadPayload { kind: 1, len: 3 }),
                Err(ForwardError::BadPayload { kind: 7, len: 2 }),
                Err(ForwardError::BadPayload { kind: 5, len: 1 }),
                Err(ForwardError::UnknownKind(42)),
                Ok((9, Msg::Opened)),
            ]
        );
    }

    #[test]
    fn long_reasons_are_cut_on_a_char_boundary() {
        let why = "é".repeat(MAX_REASON);
        let mut dec = Decoder::default();
        dec.push(&Msg::Refused(why).encode(1));
        let Some(Ok((1, Msg::Refused(r)))) = dec.next_frame() else {
            panic!("not a refusal")
        };
        assert!(r.len() <= MAX_REASON && r.chars().all(|c| c == 'é'));
    }

    /// The host relay against a scripted guest on QEMU's side of the port.
    #[cfg(feature = "client")]
    mod relay {
        use std::time::Duration;

        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

        use super::super::*;

        struct Guest {
            rd: tokio::net::unix::OwnedReadHalf,
            wr: tokio::net::unix::OwnedWriteHalf,
            dec: Decoder,
        }

        impl Guest {
            async fn next(&mut self) -> (u32, Msg) {
                let mut buf = [0u8; 4096];
                loop {
                    if let Some(f) = self.dec.next_frame() {
                        return f.unwrap();
                    }
                    let n = tokio::time::timeout(Duration::from_secs(10), self.rd.read(&mut buf))
                        .await
                        .expect("host silent")
                        .unwrap();
                    assert!(n > 0, "host closed the port");
                    self.dec.push(&buf[..n]);
                }
            }

            async fn send(&mut self, id: u32, m: Msg) {
                self.wr.write_all(&m.encode(id)).await.unwrap();
            }
        }

        /// A mux on a fake port, and a client connection whose server
        /// side the mux relays.
        async fn setup() -> (tempfile::TempDir, Guest, TcpStream) {
            setup_buffers(None).await
        }

        /// [`setup`] with the client's receive and the relay's send buffers
        /// at `small` bytes, so the kernel holds little of what is sent.
        async fn setup_buffers(small: Option<u32>) -> (tempfile::TempDir, Guest, TcpStream) {
            let dir = tempfile::tempdir().unwrap();
            let sock = dir.path().join("forward.sock");
            let port = UnixListener::bind(&sock).unwrap();
            let mux = ForwardMux::new(&sock);
            let (conn, _) = port.accept().await.unwrap();
            let (rd, wr) = conn.into_split();
            let mut guest = Guest {
                rd,
                wr,
                dec: Decoder::default(),
            };
            assert_eq!(guest.next().await, (0, Msg::ResetAll));
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            if let Some(n) = small {
                socket.set_recv_buffer_size(n).unwrap();
            }
            let client = socket.connect(l.local_addr().unwrap()).await.unwrap();
            let (server, _) = l.accept().await.unwrap();
            if let Some(n) = small {
                socket2::SockRef::from(&server)
                    .set_send_buffer_size(n as usize)
                    .unwrap();
            }
            tokio::spawn(async move { mux.relay(server, 8080, Family::V4).await });
            (dir, guest, client)
        }

        async fn read_err(client: &mut TcpStream) -> std::io::Result<usize> {
            let mut b = [0u8; 16];
            tokio::time::timeout(Duration::from_secs(10), client.read(&mut b))
                .await
                .expect("client hung")
        }

        #[tokio::test]
        async fn a_refusal_resets_the_client() {
            let (_d, mut guest, mut client) = setup().await;
            let (id, open) = guest.next().await;
            assert_eq!(
                open,
                Msg::Open {
                    port: 8080,
                    family: Family::V4
                }
            );
            guest
                .send(id, Msg::Refused("connection refused".into()))
                .await;
            let e = read_err(&mut client).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
        }

        #[tokio::test]
        async fn bytes_credits_and_half_close_both_ways() {
            let (_d, mut guest, mut client) = setup().await;
            let (id, _) = guest.next().await;
            guest.send(id, Msg::Opened).await;
            client.write_all(b"ping").await.unwrap();
            assert_eq!(guest.next().await, (id, Msg::Data(b"ping".to_vec())));
            guest.send(id, Msg::Data(b"pong".to_vec())).await;
            let mut b = [0u8; 4];
            client.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"pong");
            // Written to the client: the guest gets its credit back.
            assert_eq!(guest.next().await, (id, Msg::Credit(4)));
            // The guest's half-close is the client's end of stream...
            guest.send(id, Msg::Shut).await;
            assert_eq!(read_err(&mut client).await.unwrap(), 0);
            // ...and the client may still send, then close its half.
            client.write_all(b"last").await.unwrap();
            assert_eq!(guest.next().await, (id, Msg::Data(b"last".to_vec())));
            client.shutdown().await.unwrap();
            assert_eq!(guest.next().await, (id, Msg::Shut));
        }

        #[tokio::test]
        async fn the_guest_never_gets_more_than_the_window() {
            let (_d, mut guest, mut client) = setup().await;
            let (id, _) = guest.next().await;
            guest.send(id, Msg::Opened).await;
            let big = vec![7u8; WINDOW + 100_000];
            let writer = tokio::spawn(async move {
                let _ = client.write_all(&big).await;
                client
            });
            let mut got = 0;
            while got < WINDOW {
                match guest.next().await {
                    (i, Msg::Data(d)) if i == id => got += d.len(),
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(got, WINDOW);
            // Nothing more until credit comes.
            let more = tokio::time::timeout(Duration::from_millis(300), guest.next()).await;
            assert!(more.is_err(), "sent past the window: {more:?}");
            guest.send(id, Msg::Credit(1000)).await;
            assert!(matches!(guest.next().await, (_, Msg::Data(d)) if d.len() <= 1000));
            writer.abort();
        }

        /// A hostile guest: frames for streams the host never opened are
        /// dropped, and data past the window resets only its own stream.
        #[tokio::test]
        async fn a_guest_ignoring_the_window_loses_only_its_stream() {
            let (_d, mut guest, mut client) = setup_buffers(Some(4096)).await;
            let (id, _) = guest.next().await;
            guest.send(id, Msg::Opened).await;
            guest.send(id ^ 0x5555, Msg::Data(b"stray".to_vec())).await;
            guest.send(id ^ 0x5555, Msg::Opened).await;
            // The client does not read, with tiny buffers: the relay must
            // hold what the guest sends, and refuses past the window.
            // Written while the frames coming back are read, as the agent
            // does (a port nobody reads stalls its writer).
            let mut wr = std::mem::replace(&mut guest.wr, spare_writer().await);
            let flood = tokio::spawn(async move {
                let frame = Msg::Data(vec![1u8; MAX_PAYLOAD]).encode(id);
                for _ in 0..(2 * WINDOW / MAX_PAYLOAD + 40) {
                    if wr.write_all(&frame).await.is_err() {
                        break;
                    }
                }
                wr
            });
            let reset = loop {
                match guest.next().await {
                    (i, Msg::Reset) if i == id => break true,
                    (i, Msg::Credit(_)) if i == id => {}
                    other => panic!("unexpected {other:?}"),
                }
            };
            assert!(reset);
            let mut sink = vec![0u8; 1 << 20];
            let e = loop {
                match tokio::time::timeout(Duration::from_secs(10), client.read(&mut sink))
                    .await
                    .expect("client hung")
                {
                    Ok(0) => panic!("clean end of stream after an overrun"),
                    Ok(_) => {}
                    Err(e) => break e,
                }
            };
            assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
            drop(flood.await.unwrap());
        }

        /// A write half nobody uses, to stand in while the real one floods.
        async fn spare_writer() -> tokio::net::unix::OwnedWriteHalf {
            let (a, _b) = UnixStream::pair().unwrap();
            a.into_split().1
        }

        #[tokio::test]
        async fn a_lost_guest_resets_the_client() {
            let (_d, mut guest, mut client) = setup().await;
            let (id, _) = guest.next().await;
            guest.send(id, Msg::Opened).await;
            drop(guest);
            let e = read_err(&mut client).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
        }
    }
}
