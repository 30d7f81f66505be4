//! What a server makes of an HTTP/2 client stream: its frames, with each
//! header block put together and decoded. The reference the tests and the
//! fuzz target hold [`crate::Rewriter`] to: the client's stream read with
//! the client's HPACK context must equal the rewritten stream read with a
//! fresh decoder per block, but for `:authority`.

use crate::{
    CONTINUATION, END_HEADERS, END_STREAM, HEADERS, MAX_FRAME, MAX_TABLE, PADDED, PREFACE,
    PUSH_PROMISE, frame_header, headers_payload,
};

/// A header list in order, as (name, value) byte strings.
pub type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// One thing a server reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A whole header block (HEADERS and its CONTINUATIONs), decoded.
    Headers {
        stream: u32,
        end_stream: bool,
        priority: Option<[u8; 5]>,
        fields: Fields,
    },
    /// Any other frame, byte for byte.
    Other {
        ty: u8,
        flags: u8,
        stream: u32,
        payload: Vec<u8>,
    },
}

/// A stream read to its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    pub events: Vec<Event>,
    /// The stream stops inside a frame or a header block.
    pub truncated: bool,
}

/// Reads what a client sent (preface first) as a server holding the
/// client's HPACK context would. Err: a connection error.
pub fn client_view(input: &[u8]) -> Result<View, String> {
    let frames = input.strip_prefix(PREFACE).ok_or("no HTTP/2 preface")?;
    let mut decoder = loona_hpack::Decoder::new();
    decoder.set_max_allowed_table_size(MAX_TABLE);
    read(frames, |_, block| {
        decoder.decode(block).map_err(|e| format!("HPACK: {e:?}"))
    })
}

/// Reads what the rewriter emitted, holding it to its promises: header
/// frames of at most [`MAX_FRAME`] bytes (others are the client's own),
/// no padding, no PUSH_PROMISE, and each
/// header block decodable on its own from static-table indexes and
/// literals that never index, so the server's dynamic table stays empty.
pub fn server_view(output: &[u8]) -> Result<View, String> {
    let frames = output
        .strip_prefix(PREFACE)
        .ok_or("preface not forwarded")?;
    read(frames, |flags, block| {
        if flags & PADDED != 0 {
            return Err("padding emitted".into());
        }
        stateless(block)?;
        loona_hpack::Decoder::new()
            .decode(block)
            .map_err(|e| format!("HPACK: {e:?}"))
    })
    .and_then(|v| {
        if let Some((len, _)) = frame_lengths(frames)
            .find(|&(l, ty)| l > MAX_FRAME && matches!(ty, HEADERS | CONTINUATION))
        {
            return Err(format!("a header frame of {len} bytes emitted"));
        }
        Ok(v)
    })
}

/// Every representation is a static index or a literal without indexing.
fn stateless(mut b: &[u8]) -> Result<(), String> {
    while let Some(&first) = b.first() {
        if first & 0x80 != 0 {
            let i = int(&mut b, 7)?;
            if !(1..=61).contains(&i) {
                return Err(format!("index {i} outside the static table"));
            }
        } else {
            if first & 0xf0 != 0 {
                return Err(format!("representation {first:#x} indexes or resizes"));
            }
            if int(&mut b, 4)? == 0 {
                string(&mut b)?;
            }
            string(&mut b)?;
        }
    }
    Ok(())
}

fn int(b: &mut &[u8], prefix: u8) -> Result<usize, String> {
    let short = || "integer cut short".to_string();
    let mask = (1usize << prefix) - 1;
    let (&first, rest) = b.split_first().ok_or_else(short)?;
    *b = rest;
    let mut v = usize::from(first) & mask;
    if v == mask {
        let mut shift = 0;
        loop {
            let (&c, rest) = b.split_first().ok_or_else(short)?;
            *b = rest;
            if shift > 28 {
                return Err("integer too long".into());
            }
            v += usize::from(c & 0x7f) << shift;
            shift += 7;
            if c & 0x80 == 0 {
                break;
            }
        }
    }
    Ok(v)
}

fn string(b: &mut &[u8]) -> Result<(), String> {
    if b.first().is_some_and(|c| c & 0x80 != 0) {
        return Err("Huffman emitted".into());
    }
    let n = int(b, 7)?;
    if n > b.len() {
        return Err("string cut short".into());
    }
    *b = &b[n..];
    Ok(())
}

/// (length, type) of each frame.
fn frame_lengths(mut b: &[u8]) -> impl Iterator<Item = (usize, u8)> {
    std::iter::from_fn(move || {
        if b.len() < 9 {
            return None;
        }
        let (len, ty) = frame_header(b);
        b = &b[(9 + len).min(b.len())..];
        Some((len, ty))
    })
}

/// A header block being put together: (stream, end_stream, priority,
/// the HEADERS frame's flags, fragment).
type Open = (u32, bool, Option<[u8; 5]>, u8, Vec<u8>);

/// Walks frames; `decode(first frame's flags, block)` decodes each block.
fn read(
    mut rest: &[u8],
    mut decode: impl FnMut(u8, &[u8]) -> Result<Fields, String>,
) -> Result<View, String> {
    let mut events = Vec::new();
    let mut open: Option<Open> = None;
    while rest.len() >= 9 {
        let (len, ty) = frame_header(rest);
        if rest.len() < 9 + len {
            break;
        }
        let flags = rest[4];
        // Other frames keep the reserved bit: they must pass byte for byte.
        let raw_stream = u32::from_be_bytes(rest[5..9].try_into().expect("4 bytes"));
        let stream = raw_stream & 0x7fff_ffff;
        let payload = &rest[9..9 + len];
        rest = &rest[9 + len..];
        if let Some(o) = &open
            && (ty != CONTINUATION || stream != o.0)
        {
            return Err(format!("frame type {ty} inside a header block"));
        }
        match ty {
            HEADERS => {
                let (pri, frag) = headers_payload(payload, flags).map_err(|e| e.to_string())?;
                open = Some((stream, flags & END_STREAM != 0, pri, flags, frag.to_vec()));
            }
            CONTINUATION => {
                let o = open.as_mut().ok_or("CONTINUATION without HEADERS")?;
                o.4.extend_from_slice(payload);
            }
            PUSH_PROMISE => return Err("PUSH_PROMISE".into()),
            _ => events.push(Event::Other {
                ty,
                flags,
                stream: raw_stream,
                payload: payload.to_vec(),
            }),
        }
        if matches!(ty, HEADERS | CONTINUATION) && flags & END_HEADERS != 0 {
            let (stream, end_stream, priority, first, fragment) = open.take().expect("open");
            let fields = decode(first, &fragment)?;
            events.push(Event::Headers {
                stream,
                end_stream,
                priority,
                fields,
            });
        }
    }
    Ok(View {
        events,
        truncated: !rest.is_empty() || open.is_some(),
    })
}
