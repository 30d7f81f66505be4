//! The stdio channel: the standard streams of every container process of a
//! guest, multiplexed over one virtio-serial port ([`STDIO_PORT_NAME`]),
//! next to the agent's request port.
//!
//! Why a second port with binary frames rather than more JSON requests on
//! the agent port or one port per process: output is bulk data (base64 in
//! JSON would inflate it by a third and make every log line a request),
//! a chatty container must not delay a stats or unmount reply behind its
//! output, and virtio-serial offers 31 ports per device, fewer than the
//! processes a pod can run. virtio-serial itself gives back-pressure: a
//! guest write blocks while the host is not reading (or not connected, as
//! when the shim restarts), so output is held in the pipes, not dropped.
//!
//! Frames are [`crate::mux`]'s: stream id (chosen by the host, never 0),
//! [`Kind`], payload. Host → guest: [`Kind::Stdin`], [`Kind::StdinClose`];
//! guest → host: [`Kind::Stdout`], [`Kind::Stderr`] and their `Eof`.

/// Name of the virtio-serial port carrying the stdio frames.
pub const STDIO_PORT_NAME: &str = "org.crust.stdio";

use crate::mux::RawDecoder;
pub use crate::mux::{HEADER_LEN, MAX_PAYLOAD};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Stdin = 1,
    StdinClose = 2,
    Stdout = 3,
    Stderr = 4,
    StdoutEof = 5,
    StderrEof = 6,
}

impl Kind {
    pub fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Stdin,
            2 => Kind::StdinClose,
            3 => Kind::Stdout,
            4 => Kind::Stderr,
            5 => Kind::StdoutEof,
            6 => Kind::StderrEof,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub stream: u32,
    pub kind: Kind,
    pub data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StdioError {
    #[error("stdio frame announces {0} bytes, more than {MAX_PAYLOAD}")]
    TooLarge(usize),
    #[error("stdio frame of unknown kind {0}")]
    UnknownKind(u8),
}

/// Encodes one frame; `data` longer than [`MAX_PAYLOAD`] must be split by
/// the caller ([`encode_chunks`]).
pub fn encode(stream: u32, kind: Kind, data: &[u8]) -> Vec<u8> {
    crate::mux::encode(stream, kind as u8, data)
}

/// Encodes `data` as as many frames as it takes.
pub fn encode_chunks(stream: u32, kind: Kind, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in data.chunks(MAX_PAYLOAD) {
        out.extend_from_slice(&encode(stream, kind, c));
    }
    out
}

/// Reassembles frames from a byte stream split anywhere. After an error
/// the stream is out of sync: the caller resets (reconnects).
#[derive(Debug, Default)]
pub struct Decoder {
    raw: RawDecoder,
}

impl Decoder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, data: &[u8]) {
        self.raw.push(data);
    }

    pub fn reset(&mut self) {
        self.raw.reset();
    }

    pub fn next_frame(&mut self) -> Option<Result<Frame, StdioError>> {
        Some(match self.raw.next_frame()? {
            Err(len) => Err(StdioError::TooLarge(len)),
            Ok(f) => match Kind::from_u8(f.kind) {
                Some(kind) => Ok(Frame {
                    stream: f.stream,
                    kind,
                    data: f.data,
                }),
                None => Err(StdioError::UnknownKind(f.kind)),
            },
        })
    }
}

#[cfg(feature = "client")]
pub use host::{Output, StdioMux};

#[cfg(feature = "client")]
mod host {
    use std::collections::HashMap;
    use std::path::PathBuf;
    use std::sync::{Arc, Mutex};

    use tokio::sync::mpsc;

    use super::{Kind, encode, encode_chunks};

    /// What the guest sent for one stream.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Output {
        Stdout(Vec<u8>),
        Stderr(Vec<u8>),
        StdoutEof,
        StderrEof,
    }

    type Streams = Arc<Mutex<HashMap<u32, mpsc::UnboundedSender<Output>>>>;

    /// Host end of the stdio port: one connection to QEMU's chardev socket,
    /// demultiplexed by stream id. Register a stream before the guest
    /// process exists so no output is missed. Reconnects while the socket
    /// is there; ends when it is gone (the VM stopped).
    #[derive(Clone)]
    pub struct StdioMux {
        streams: Streams,
        tx: mpsc::UnboundedSender<Vec<u8>>,
    }

    impl StdioMux {
        pub fn new(socket: impl Into<PathBuf>) -> StdioMux {
            let streams: Streams = Arc::default();
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(run(socket.into(), streams.clone(), rx));
            StdioMux { streams, tx }
        }

        /// Receives everything the guest sends on `stream`.
        pub fn register(&self, stream: u32) -> mpsc::UnboundedReceiver<Output> {
            let (tx, rx) = mpsc::unbounded_channel();
            self.streams.lock().expect("streams").insert(stream, tx);
            rx
        }

        pub fn unregister(&self, stream: u32) {
            self.streams.lock().expect("streams").remove(&stream);
        }

        pub fn stdin(&self, stream: u32, data: &[u8]) {
            let _ = self.tx.send(encode_chunks(stream, Kind::Stdin, data));
        }

        pub fn close_stdin(&self, stream: u32) {
            let _ = self.tx.send(encode(stream, Kind::StdinClose, &[]));
        }
    }

    async fn run(socket: PathBuf, streams: Streams, rx: mpsc::UnboundedReceiver<Vec<u8>>) {
        let port = crate::mux::host::Port {
            socket,
            greeting: None,
            resend: true,
        };
        let frame = |f: crate::mux::RawFrame| {
            let out = match Kind::from_u8(f.kind) {
                Some(Kind::Stdout) => Output::Stdout(f.data),
                Some(Kind::Stderr) => Output::Stderr(f.data),
                Some(Kind::StdoutEof) => Output::StdoutEof,
                Some(Kind::StderrEof) => Output::StderrEof,
                _ => return,
            };
            if let Some(tx) = streams.lock().expect("streams").get(&f.stream) {
                let _ = tx.send(out);
            }
        };
        crate::mux::host::serve(port, rx, frame, || {}).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_split_anywhere() {
        let mut bytes = encode(7, Kind::Stdout, b"hello");
        bytes.extend(encode(7, Kind::StdoutEof, b""));
        bytes.extend(encode_chunks(9, Kind::Stdin, &vec![b'x'; MAX_PAYLOAD + 10]));
        let mut dec = Decoder::new();
        let mut frames = Vec::new();
        for c in bytes.chunks(5) {
            dec.push(c);
            while let Some(f) = dec.next_frame() {
                frames.push(f.unwrap());
            }
        }
        assert_eq!(frames.len(), 4);
        assert_eq!(frames[0].data, b"hello");
        assert_eq!(frames[1].kind, Kind::StdoutEof);
        assert_eq!(frames[2].data.len(), MAX_PAYLOAD);
        assert_eq!((frames[3].stream, frames[3].data.len()), (9, 10));
    }

    #[test]
    fn bad_frames_are_errors() {
        let mut dec = Decoder::new();
        let mut b = encode(1, Kind::Stdout, b"");
        b[4] = 99;
        dec.push(&b);
        assert_eq!(dec.next_frame(), Some(Err(StdioError::UnknownKind(99))));
        let mut dec = Decoder::new();
        let mut b = encode(1, Kind::Stdout, b"");
        b[5..9].copy_from_slice(&((MAX_PAYLOAD + 1) as u32).to_be_bytes());
        dec.push(&b);
        assert!(matches!(
            dec.next_frame(),
            Some(Err(StdioError::TooLarge(_)))
        ));
    }
}
