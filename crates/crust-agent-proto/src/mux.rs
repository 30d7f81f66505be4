//! The frame both byte-stream ports share ([`crate::stdio`] and
//! [`crate::forward`]): stream id (u32 BE), kind (u8), payload length
//! (u32 BE, at most [`MAX_PAYLOAD`]), then the payload. Each port gives
//! the kind byte its own meaning.

pub const HEADER_LEN: usize = 9;

/// Largest payload of one frame.
pub const MAX_PAYLOAD: usize = 64 * 1024;

/// One frame with its kind byte not yet interpreted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawFrame {
    pub stream: u32,
    pub kind: u8,
    pub data: Vec<u8>,
}

/// Encodes one frame; `data` must be at most [`MAX_PAYLOAD`] bytes.
pub fn encode(stream: u32, kind: u8, data: &[u8]) -> Vec<u8> {
    debug_assert!(data.len() <= MAX_PAYLOAD);
    let mut out = Vec::with_capacity(HEADER_LEN + data.len());
    out.extend_from_slice(&stream.to_be_bytes());
    out.push(kind);
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// Reassembles frames from a byte stream split anywhere. An announced
/// length over [`MAX_PAYLOAD`] is returned as `Err(length)`: the stream is
/// then out of sync and the caller resets (reconnects).
#[derive(Debug, Default)]
pub struct RawDecoder {
    buf: Vec<u8>,
}

impl RawDecoder {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    pub fn reset(&mut self) {
        self.buf.clear();
    }

    pub fn next_frame(&mut self) -> Option<Result<RawFrame, usize>> {
        if self.buf.len() < HEADER_LEN {
            return None;
        }
        let stream = u32::from_be_bytes(self.buf[0..4].try_into().expect("4 bytes"));
        let kind = self.buf[4];
        let len = u32::from_be_bytes(self.buf[5..9].try_into().expect("4 bytes")) as usize;
        if len > MAX_PAYLOAD {
            return Some(Err(len));
        }
        if self.buf.len() < HEADER_LEN + len {
            return None;
        }
        let data = self.buf[HEADER_LEN..HEADER_LEN + len].to_vec();
        self.buf.drain(..HEADER_LEN + len);
        Some(Ok(RawFrame { stream, kind, data }))
    }
}

/// The host end of a byte-stream port, shared by [`crate::stdio`]'s and
/// [`crate::forward`]'s muxes.
#[cfg(feature = "client")]
pub(crate) mod host {
    use std::path::PathBuf;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixStream;
    use tokio::sync::mpsc;

    use super::{RawDecoder, RawFrame};

    /// How a port is served.
    pub(crate) struct Port {
        /// QEMU's chardev socket.
        pub socket: PathBuf,
        /// Written first on every (re)connection.
        pub greeting: Option<Vec<u8>>,
        /// Whether bytes that failed to go out are sent again after a
        /// reconnect (stdin) or dropped (streams the guest lost anyway).
        pub resend: bool,
    }

    /// Connects to the port's socket, retrying while it exists; hands each
    /// whole frame to `frame`, writes what comes on `rx`, and calls `lost`
    /// whenever a connection ends. Returns when the socket is gone (the VM
    /// stopped) or `rx` is closed.
    pub(crate) async fn serve(
        port: Port,
        mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
        mut frame: impl FnMut(RawFrame),
        mut lost: impl FnMut(),
    ) {
        let mut pending: Option<Vec<u8>> = None;
        loop {
            let conn = match UnixStream::connect(&port.socket).await {
                Ok(c) => c,
                Err(_) if port.socket.exists() => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(_) => {
                    lost();
                    return;
                }
            };
            let (mut rd, mut wr) = conn.into_split();
            if let Some(g) = &port.greeting
                && wr.write_all(g).await.is_err()
            {
                continue;
            }
            let mut dec = RawDecoder::default();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                tokio::select! {
                    n = rd.read(&mut buf) => {
                        let n = match n { Ok(0) | Err(_) => break, Ok(n) => n };
                        dec.push(&buf[..n]);
                        while let Some(f) = dec.next_frame() {
                            match f {
                                Ok(f) => frame(f),
                                // An impossible length: what follows
                                // cannot be framed; start afresh.
                                Err(_) => {
                                    dec.reset();
                                    break;
                                }
                            }
                        }
                    }
                    msg = async {
                        match pending.take() {
                            Some(m) => Some(m),
                            None => rx.recv().await,
                        }
                    } => {
                        let Some(m) = msg else { return };
                        if wr.write_all(&m).await.is_err() {
                            if port.resend {
                                pending = Some(m);
                            }
                            break;
                        }
                    }
                }
            }
            lost();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
