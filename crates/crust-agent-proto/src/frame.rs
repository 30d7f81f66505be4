//! Framing on the agent channel: a 4-byte big-endian body length followed by
//! that many bytes of JSON. Frames larger than [`MAX_FRAME_LEN`] are refused
//! on both sides.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Largest body a frame may carry (1 MiB).
pub const MAX_FRAME_LEN: usize = 1 << 20;

/// Size of the length prefix.
pub const HEADER_LEN: usize = 4;

/// Why a frame could not be produced or consumed.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The length prefix announces more than [`MAX_FRAME_LEN`] bytes.
    #[error("frame of {len} bytes exceeds the {MAX_FRAME_LEN}-byte limit")]
    TooLarge { len: usize },
    /// The body is not the JSON the receiver expected.
    #[error("malformed JSON in frame: {0}")]
    Json(#[from] serde_json::Error),
    /// Reading or writing the channel failed.
    #[error("agent channel i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Serializes `msg` and prefixes it with its length.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; HEADER_LEN];
    serde_json::to_writer(&mut out, msg)?;
    let len = out.len() - HEADER_LEN;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge { len });
    }
    out[..HEADER_LEN].copy_from_slice(&(len as u32).to_be_bytes());
    Ok(out)
}

/// Parses one frame body.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    Ok(serde_json::from_slice(body)?)
}

/// Reassembles frames from a byte stream that arrives in arbitrary pieces
/// (virtio-serial delivers whatever the host wrote, split anywhere).
///
/// An oversized frame yields one [`FrameError::TooLarge`] and its announced
/// body is then skipped as it arrives, so a sender that really sent a big
/// frame stays in sync. [`FrameDecoder::reset`] drops everything, which is
/// what the agent does when the host end disconnects.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    skip: usize,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn push(&mut self, mut data: &[u8]) {
        if self.skip > 0 {
            let n = self.skip.min(data.len());
            self.skip -= n;
            data = &data[n..];
        }
        self.buf.extend_from_slice(data);
    }

    /// The next complete frame body, an error for an oversized frame, or
    /// `None` when more bytes are needed.
    pub fn next_frame(&mut self) -> Option<Result<Vec<u8>, FrameError>> {
        if self.buf.len() < HEADER_LEN {
            return None;
        }
        let len = u32::from_be_bytes(self.buf[..HEADER_LEN].try_into().expect("4 bytes")) as usize;
        if len > MAX_FRAME_LEN {
            self.buf.drain(..HEADER_LEN);
            let have = self.buf.len().min(len);
            self.buf.drain(..have);
            self.skip = len - have;
            return Some(Err(FrameError::TooLarge { len }));
        }
        if self.buf.len() < HEADER_LEN + len {
            return None;
        }
        let body = self.buf[HEADER_LEN..HEADER_LEN + len].to_vec();
        self.buf.drain(..HEADER_LEN + len);
        Some(Ok(body))
    }

    /// Forgets any partial frame and pending skip.
    pub fn reset(&mut self) {
        self.buf.clear();
        self.skip = 0;
    }

    /// Bytes held that do not yet form a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }
}

/// Reads one frame body from an async stream. `Ok(None)` on a clean end of
/// stream between frames.
#[cfg(feature = "client")]
pub async fn read_frame_async<R>(r: &mut R) -> Result<Option<Vec<u8>>, FrameError>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let mut header = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        let n = r.read(&mut header[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        got += n;
    }
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge { len });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    fn frames_of(dec: &mut FrameDecoder) -> Vec<Result<Vec<u8>, String>> {
        let mut out = Vec::new();
        while let Some(f) = dec.next_frame() {
            out.push(f.map_err(|e| e.to_string()));
        }
        out
    }

    #[test]
    fn round_trip() {
        let msg = json!({"id": 7, "op": "ping", "args": {}});
        let bytes = encode(&msg).unwrap();
        assert_eq!(&bytes[..4], &((bytes.len() - 4) as u32).to_be_bytes());
        let mut dec = FrameDecoder::new();
        dec.push(&bytes);
        let body = dec.next_frame().unwrap().unwrap();
        assert_eq!(decode::<Value>(&body).unwrap(), msg);
        assert!(dec.next_frame().is_none());
        assert_eq!(dec.buffered(), 0);
    }

    #[test]
    fn encode_refuses_oversize() {
        let big = "x".repeat(MAX_FRAME_LEN);
        match encode(&big) {
            Err(FrameError::TooLarge { len }) => assert_eq!(len, MAX_FRAME_LEN + 2),
            other => panic!("expected TooLarge, got {other:?}"),
        }
        // Exactly at the limit is fine.
        let fits = "y".repeat(MAX_FRAME_LEN - 2);
        assert_eq!(encode(&fits).unwrap().len(), MAX_FRAME_LEN + HEADER_LEN);
    }

    #[test]
    fn oversized_frame_is_reported_then_skipped() {
        let mut dec = FrameDecoder::new();
        let len = MAX_FRAME_LEN + 10;
        dec.push(&(len as u32).to_be_bytes());
        dec.push(&vec![b'z'; 1000]);
        let frames = frames_of(&mut dec);
        assert_eq!(frames.len(), 1);
        assert!(frames[0].as_ref().unwrap_err().contains("exceeds"));
        // The rest of the oversized body arrives, then a good frame.
        dec.push(&vec![b'z'; len - 1000]);
        assert!(dec.next_frame().is_none());
        dec.push(&encode(&json!({"ok": true})).unwrap());
        let body = dec.next_frame().unwrap().unwrap();
        assert_eq!(decode::<Value>(&body).unwrap(), json!({"ok": true}));
    }

    #[test]
    fn garbage_body_is_a_json_error_and_stream_continues() {
        let mut dec = FrameDecoder::new();
        let garbage = b"\x00\x01not json{{";
        dec.push(&(garbage.len() as u32).to_be_bytes());
        dec.push(garbage);
        dec.push(&encode(&json!([1, 2])).unwrap());
        let body = dec.next_frame().unwrap().unwrap();
        assert!(decode::<Value>(&body).is_err());
        let body = dec.next_frame().unwrap().unwrap();
        assert_eq!(decode::<Value>(&body).unwrap(), json!([1, 2]));
    }

    #[test]
    fn reset_drops_partial_frame() {
        let mut dec = FrameDecoder::new();
        let bytes = encode(&json!({"a": 1})).unwrap();
        dec.push(&bytes[..5]);
        assert!(dec.next_frame().is_none());
        dec.reset();
        dec.push(&bytes);
        assert!(dec.next_frame().unwrap().is_ok());
    }

    #[tokio::test]
    async fn async_reader_handles_eof_and_oversize() {
        let mut data = encode(&json!({"n": 1})).unwrap();
        data.extend_from_slice(&encode(&json!({"n": 2})).unwrap());
        let mut r = &data[..];
        assert!(read_frame_async(&mut r).await.unwrap().is_some());
        assert!(read_frame_async(&mut r).await.unwrap().is_some());
        assert!(read_frame_async(&mut r).await.unwrap().is_none());

        let big = ((MAX_FRAME_LEN + 1) as u32).to_be_bytes();
        let mut r = &big[..];
        assert!(matches!(
            read_frame_async(&mut r).await,
            Err(FrameError::TooLarge { .. })
        ));

        let partial = [0u8, 0];
        let mut r = &partial[..];
        assert!(matches!(
            read_frame_async(&mut r).await,
            Err(FrameError::Io(_))
        ));
    }

    proptest! {
        // Any sequence of messages, cut into arbitrary pieces, comes out whole
        // and in order.
        #[test]
        fn split_anywhere(msgs in proptest::collection::vec(".{0,200}", 1..8),
                          cuts in proptest::collection::vec(1usize..64, 1..40)) {
            let mut stream = Vec::new();
            for m in &msgs {
                stream.extend_from_slice(&encode(m).unwrap());
            }
            let mut dec = FrameDecoder::new();
            let mut out: Vec<String> = Vec::new();
            let mut pos = 0;
            let mut i = 0;
            while pos < stream.len() {
                let n = cuts[i % cuts.len()].min(stream.len() - pos);
                dec.push(&stream[pos..pos + n]);
                pos += n;
                i += 1;
                while let Some(f) = dec.next_frame() {
                    out.push(decode(&f.unwrap()).unwrap());
                }
            }
            prop_assert_eq!(out, msgs);
            prop_assert_eq!(dec.buffered(), 0);
        }

        // Arbitrary bytes never panic the decoder, and every frame it yields
        // respects the size limit.
        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..4096),
                                chunk in 1usize..512) {
            let mut dec = FrameDecoder::new();
            for piece in data.chunks(chunk) {
                dec.push(piece);
                while let Some(f) = dec.next_frame() {
                    if let Ok(body) = f {
                        prop_assert!(body.len() <= MAX_FRAME_LEN);
                        let _ = decode::<Value>(&body);
                    }
                }
            }
        }
    }
}
