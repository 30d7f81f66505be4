//! Rewrites the `:authority` of HTTP/2 requests before h2 sees them.
//!
//! On a unix socket grpc-core (Python, C++, Ruby, PHP) sends the
//! %-encoded socket path as `:authority` (`tmp%2Fcsi.sock`), grpc-java
//! and grpc-swift something similar. h2 parses the pseudo-header as an
//! `http::uri::Authority`, which refuses `%` and `/`, and resets the
//! stream (PROTOCOL_ERROR) before tonic sees the request. A socket has no
//! authority worth keeping, so [`Rewriter`] replaces any value h2 would
//! refuse with `localhost` (what grpc-go sends on unix sockets).
//!
//! It sits on the client-to-server byte stream only:
//!
//! * after the connection preface it parses frames; a client that does
//!   not start with the HTTP/2 preface is passed through untouched;
//! * DATA, SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, GOAWAY and PRIORITY
//!   frames pass through byte for byte, streamed (never buffered whole);
//! * every header block (HEADERS plus its CONTINUATIONs, padding and
//!   priority fields parsed per RFC 9113 §6.2/§6.10) is decoded with the
//!   client's HPACK context (`loona_hpack`, which keeps the dynamic
//!   table the client's encoder assumes) and re-encoded using only the
//!   static table and literals *without indexing*: h2's own decoder never
//!   gets a dynamic-table entry or size update from us, so its table stays
//!   empty and in sync whatever the client does. Every block is
//!   re-encoded, not only those whose authority changes, since the
//!   client's later blocks may refer to entries of earlier ones.
//! * the re-encoded block is split into frames of at most 16 384 bytes
//!   (the smallest SETTINGS_MAX_FRAME_SIZE a peer may announce); padding
//!   is dropped (it only hides lengths), priority fields are kept.
//!
//! A malformed stream (a CONTINUATION out of place, padding longer than
//! the frame, an HPACK error, a header block over [`MAX_BLOCK`], a
//! PUSH_PROMISE from a client) is a connection error in HTTP/2 anyway:
//! the front reports it and the connection is closed.

use std::borrow::Cow;

pub mod view;

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// What an unusable `:authority` becomes.
pub const REPLACEMENT: &str = "localhost";
/// Largest header block (compressed) accepted from a client.
pub const MAX_BLOCK: usize = 1 << 20;
/// Largest frame payload emitted (the HTTP/2 minimum of every peer's limit).
pub const MAX_FRAME: usize = 16_384;
/// Largest HPACK dynamic table a client may ask for.
const MAX_TABLE: usize = 1 << 16;

const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// Why a client's byte stream cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrontError {
    #[error("HTTP/2 protocol error from the client: {0}")]
    Protocol(String),
    #[error("HPACK error in the client's header block on stream {stream}: {reason}")]
    Hpack { stream: u32, reason: String },
    #[error("header block on stream {stream} exceeds {MAX_BLOCK} bytes")]
    BlockTooLarge { stream: u32 },
}

/// Whether h2 accepts `value` as `:authority`.
pub fn authority_ok(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

#[derive(Debug)]
enum State {
    /// Matched this many bytes of the preface so far.
    Preface(usize),
    Frames,
    /// Not HTTP/2 (or no longer parseable): forward as is.
    Raw,
    Failed,
}

/// A header block being collected.
#[derive(Debug)]
struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// The client-to-server half of the front, without I/O: feed it what the
/// client sent, take what h2 should read.
pub struct Rewriter {
    state: State,
    decoder: loona_hpack::Decoder<'static>,
    /// Bytes not parsed yet (an incomplete frame header or header frame).
    pending: Vec<u8>,
    /// Payload bytes of a pass-through frame still to forward.
    passthrough: usize,
    block: Option<Block>,
    out: Vec<u8>,
    rewritten: u64,
}

impl Default for Rewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl Rewriter {
    pub fn new() -> Rewriter {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(MAX_TABLE);
        Rewriter {
            state: State::Preface(0),
            decoder,
            pending: Vec::new(),
            passthrough: 0,
            block: None,
            out: Vec::new(),
            rewritten: 0,
        }
    }

    /// How many `:authority` values were replaced so far.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Bytes ready for the server.
    pub fn output(&self) -> &[u8] {
        &self.out
    }

    /// Drops the first `n` bytes of [`Rewriter::output`].
    pub fn consume(&mut self, n: usize) {
        self.out.drain(..n);
    }

    /// Takes what the client sent next.
    pub fn feed(&mut self, mut input: &[u8]) -> Result<(), FrontError> {
        while !input.is_empty() {
            match self.state {
                State::Failed => {
                    return Err(FrontError::Protocol("the connection already failed".into()));
                }
                State::Raw => {
                    self.out.extend_from_slice(input);
                    return Ok(());
                }
                State::Preface(seen) => {
                    let want = &PREFACE[seen..];
                    let n = want.len().min(input.len());
                    if input[..n] != want[..n] {
                        // Not HTTP/2 prior knowledge (what matched is out
                        // already): h2 will refuse it itself.
                        self.state = State::Raw;
                        continue;
                    }
                    self.out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.state = if seen + n == PREFACE.len() {
                        State::Frames
                    } else {
                        State::Preface(seen + n)
                    };
                }
                State::Frames => {
                    if self.passthrough > 0 {
                        let n = self.passthrough.min(input.len());
                        self.out.extend_from_slice(&input[..n]);
                        self.passthrough -= n;
                        input = &input[n..];
                        continue;
                    }
                    // Collect a frame header, or a whole header-bearing frame.
                    let take = self.needed().saturating_sub(self.pending.len());
                    let n = take.min(input.len());
                    self.pending.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if let Err(e) = self.step() {
                        self.state = State::Failed;
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Bytes `pending` must hold before [`Rewriter::step`] can act.
    fn needed(&self) -> usize {
        if self.pending.len() < 9 {
            return 9;
        }
        let (len, ty) = frame_header(&self.pending);
        if matches!(ty, HEADERS | CONTINUATION | PUSH_PROMISE) {
            9 + len
        } else {
            9
        }
    }

    fn step(&mut self) -> Result<(), FrontError> {
        if self.pending.len() >= 9 {
            let (len, ty) = frame_header(&self.pending);
            if matches!(ty, HEADERS | CONTINUATION) && len > MAX_BLOCK {
                let stream = u32::from_be_bytes(self.pending[5..9].try_into().expect("4 bytes"));
                return Err(FrontError::BlockTooLarge {
                    stream: stream & 0x7fff_ffff,
                });
            }
        }
        if self.pending.len() < self.needed() {
            return Ok(());
        }
        let (len, ty) = frame_header(&self.pending);
        let flags = self.pending[4];
        let stream =
            u32::from_be_bytes(self.pending[5..9].try_into().expect("4 bytes")) & 0x7fff_ffff;
        if let Some(b) = &self.block
            && (ty != CONTINUATION || stream != b.stream)
        {
            return Err(FrontError::Protocol(format!(
                "frame type {ty} on stream {stream} inside the header block of stream {}",
                b.stream
            )));
        }
        match ty {
            HEADERS => {
                let payload = &self.pending[9..];
                let (priority, fragment) = headers_payload(payload, flags)?;
                let block = Block {
                    stream,
                    end_stream: flags & END_STREAM != 0,
                    priority,
                    fragment: fragment.to_vec(),
                };
                self.pending.clear();
                self.collect(block, flags)?;
            }
            CONTINUATION => {
                let Some(mut block) = self.block.take() else {
                    return Err(FrontError::Protocol(format!(
                        "CONTINUATION on stream {stream} without a HEADERS frame"
                    )));
                };
                block.fragment.extend_from_slice(&self.pending[9..]);
                self.pending.clear();
                self.collect(block, flags)?;
            }
            PUSH_PROMISE => {
                return Err(FrontError::Protocol("PUSH_PROMISE sent by a client".into()));
            }
            _ => {
                self.out.extend_from_slice(&self.pending);
                self.pending.clear();
                self.passthrough = len;
            }
        }
        Ok(())
    }

    fn collect(&mut self, block: Block, flags: u8) -> Result<(), FrontError> {
        if block.fragment.len() > MAX_BLOCK {
            return Err(FrontError::BlockTooLarge {
                stream: block.stream,
            });
        }
        if flags & END_HEADERS == 0 {
            self.block = Some(block);
            return Ok(());
        }
        let encoded = self.reencode(&block)?;
        emit_block(&mut self.out, &block, &encoded);
        Ok(())
    }

    /// Decodes with the client's context, re-encodes statelessly.
    fn reencode(&mut self, block: &Block) -> Result<Vec<u8>, FrontError> {
        let mut encoded = Vec::with_capacity(block.fragment.len() + 64);
        let mut rewritten = 0;
        self.decoder
            .decode_with_cb(&block.fragment, |name: Cow<[u8]>, value: Cow<[u8]>| {
                let value = if &*name == b":authority" && !authority_ok(&value) {
                    rewritten += 1;
                    Cow::Borrowed(REPLACEMENT.as_bytes())
                } else {
                    value
                };
                encode_field(&mut encoded, &name, &value);
            })
            .map_err(|e| FrontError::Hpack {
                stream: block.stream,
                reason: e.to_string(),
            })?;
        self.rewritten += rewritten;
        Ok(encoded)
    }
}

fn frame_header(b: &[u8]) -> (usize, u8) {
    let len = (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]);
    (len, b[3])
}

/// Splits a HEADERS payload into its priority fields and fragment.
fn headers_payload(p: &[u8], flags: u8) -> Result<(Option<[u8; 5]>, &[u8]), FrontError> {
    let bad = |what: &str| FrontError::Protocol(format!("HEADERS frame: {what}"));
    let (pad, mut rest) = if flags & PADDED != 0 {
        let (&n, rest) = p
            .split_first()
            .ok_or_else(|| bad("PADDED without a pad length"))?;
        (usize::from(n), rest)
    } else {
        (0, p)
    };
    let priority = if flags & PRIORITY != 0 {
        if rest.len() < 5 {
            return Err(bad("PRIORITY flag without priority fields"));
        }
        let (pri, r) = rest.split_at(5);
        rest = r;
        Some(pri.try_into().expect("5 bytes"))
    } else {
        None
    };
    if pad > rest.len() {
        return Err(bad("padding longer than the payload"));
    }
    Ok((priority, &rest[..rest.len() - pad]))
}

/// Writes HEADERS (+ CONTINUATION) frames carrying `encoded`.
fn emit_block(out: &mut Vec<u8>, block: &Block, encoded: &[u8]) {
    let pri_len = if block.priority.is_some() { 5 } else { 0 };
    let first = encoded.len().min(MAX_FRAME - pri_len);
    let (head, mut rest) = encoded.split_at(first);
    let mut flags = if block.end_stream { END_STREAM } else { 0 };
    if block.priority.is_some() {
        flags |= PRIORITY;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    write_frame_header(out, pri_len + head.len(), HEADERS, flags, block.stream);
    if let Some(p) = block.priority {
        out.extend_from_slice(&p);
    }
    out.extend_from_slice(head);
    while !rest.is_empty() {
        let n = rest.len().min(MAX_FRAME);
        let (chunk, r) = rest.split_at(n);
        rest = r;
        let flags = if rest.is_empty() { END_HEADERS } else { 0 };
        write_frame_header(out, n, CONTINUATION, flags, block.stream);
        out.extend_from_slice(chunk);
    }
}

fn write_frame_header(out: &mut Vec<u8>, len: usize, ty: u8, flags: u8, stream: u32) {
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.push(ty);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// One field as an indexed static entry, or a literal without indexing
/// (RFC 7541 §6.1, §6.2.2), never touching the peer's dynamic table.
fn encode_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    if let Some(i) = STATIC
        .iter()
        .position(|(n, v)| *n == name && !v.is_empty() && *v == value)
    {
        int(out, i + 1, 7, 0x80);
        return;
    }
    match STATIC.iter().position(|(n, _)| *n == name) {
        Some(i) => int(out, i + 1, 4, 0x00),
        None => {
            out.push(0x00);
            string(out, name);
        }
    }
    string(out, value);
}

fn string(out: &mut Vec<u8>, s: &[u8]) {
    int(out, s.len(), 7, 0x00);
    out.extend_from_slice(s);
}

fn int(out: &mut Vec<u8>, v: usize, prefix: u8, first: u8) {
    loona_hpack::encoder::encode_integer_into(v, prefix, first, out).expect("Vec never fails");
}

/// The HPACK static table (RFC 7541 Appendix A), index = position + 1.
const STATIC: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::{Event, Fields};
    use proptest::prelude::*;

    fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        write_frame_header(&mut f, payload.len(), ty, flags, stream);
        f.extend_from_slice(payload);
        f
    }

    fn server_view(out: &[u8]) -> Vec<Event> {
        let v = view::server_view(out).unwrap();
        assert!(!v.truncated, "block or frame left open");
        v.events
    }

    fn fields(list: &[(&str, &str)]) -> Fields {
        list.iter()
            .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect()
    }

    fn grpc_request(authority: &str) -> Fields {
        fields(&[
            (":path", "/csi.v1.Identity/Probe"),
            (":authority", authority),
            (":method", "POST"),
            (":scheme", "http"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            (
                "user-agent",
                "grpc-python/1.85.1 grpc-c/58.0.0 (linux; chttp2)",
            ),
        ])
    }

    fn with_authority(f: &Fields, a: &str) -> Fields {
        f.iter()
            .map(|(n, v)| {
                if n == b":authority" {
                    (n.clone(), a.as_bytes().to_vec())
                } else {
                    (n.clone(), v.clone())
                }
            })
            .collect()
    }

    fn run(input: &[u8]) -> (Vec<u8>, u64) {
        let mut rw = Rewriter::new();
        rw.feed(input).unwrap();
        (rw.output().to_vec(), rw.rewritten())
    }

    #[test]
    fn unix_socket_authorities_become_localhost_valid_ones_stay() {
        for (sent, want) in [
            ("tmp%2Fi9%2Fops.sock", REPLACEMENT), // grpc-core, unix:/path
            ("%2Frun%2Fcsi%2Fcsi.sock", REPLACEMENT), // grpc-core, unix:///path
            ("/run/csi/csi.sock", REPLACEMENT),
            ("unix:/run/csi.sock", REPLACEMENT),
            ("localhost", "localhost"), // grpc-go
            ("csi.sock", "csi.sock"),
            ("127.0.0.1:50051", "127.0.0.1:50051"),
            ("[::1]:8080", "[::1]:8080"),
        ] {
            assert_eq!(authority_ok(sent.as_bytes()), sent == want, "{sent}");
            let mut enc = loona_hpack::Encoder::new();
            let req = grpc_request(sent);
            let block = enc.encode(req.iter().map(|(n, v)| (&n[..], &v[..])));
            let mut input = PREFACE.to_vec();
            input.extend(frame(HEADERS, END_HEADERS, 1, &block));
            let (out, n) = run(&input);
            assert_eq!(n, u64::from(sent != want));
            assert_eq!(
                server_view(&out),
                [Event::Headers {
                    stream: 1,
                    end_stream: false,
                    priority: None,
                    fields: with_authority(&req, want),
                }]
            );
        }
    }

    #[test]
    fn later_blocks_may_refer_to_the_clients_dynamic_table() {
        // loona's encoder indexes fields whose name is not in the static
        // table (`te` here): later blocks refer to the dynamic entry.
        let mut enc = loona_hpack::Encoder::new();
        let req = grpc_request("tmp%2Fcsi.sock");
        let mut input = PREFACE.to_vec();
        for stream in [1, 3, 5] {
            let block = enc.encode(req.iter().map(|(n, v)| (&n[..], &v[..])));
            if stream > 1 {
                assert!(
                    loona_hpack::Decoder::new().decode(&block).is_err(),
                    "the client refers to its dynamic table"
                );
            }
            input.extend(frame(HEADERS, END_HEADERS, stream, &block));
            input.extend(frame(0x0, END_STREAM, stream, b"\0\0\0\0\0"));
        }
        let (out, n) = run(&input);
        assert_eq!(n, 3);
        let seen = server_view(&out);
        assert_eq!(seen.len(), 6);
        for (i, s) in seen.iter().enumerate() {
            let stream = [1, 3, 5][i / 2];
            if i % 2 == 0 {
                assert_eq!(
                    s,
                    &Event::Headers {
                        stream,
                        end_stream: false,
                        priority: None,
                        fields: with_authority(&req, REPLACEMENT)
                    }
                );
            } else {
                assert_eq!(
                    s,
                    &Event::Other {
                        ty: 0,
                        flags: END_STREAM,
                        stream,
                        payload: b"\0\0\0\0\0".to_vec()
                    }
                );
            }
        }
    }

    #[test]
    fn padding_priority_continuation_and_big_blocks() {
        let mut enc = loona_hpack::Encoder::new();
        let mut req = grpc_request("tmp%2Fcsi.sock");
        req.push((b"x-big".to_vec(), vec![b'v'; 40_000]));
        let block = enc.encode(req.iter().map(|(n, v)| (&n[..], &v[..])));
        // HEADERS (padded, priority, end stream) + 2 CONTINUATIONs.
        let (a, rest) = block.split_at(100);
        let (b, c) = rest.split_at(rest.len() / 2);
        let mut payload = vec![7u8]; // pad length
        payload.extend([0x80, 0, 0, 3, 15]); // exclusive dep on 3, weight 15
        payload.extend(a);
        payload.extend([0u8; 7]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_STREAM | PADDED | PRIORITY, 1, &payload));
        input.extend(frame(CONTINUATION, 0, 1, b));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, c));
        let (out, n) = run(&input);
        assert_eq!(n, 1);
        assert_eq!(
            server_view(&out),
            [Event::Headers {
                stream: 1,
                end_stream: true,
                priority: Some([0x80, 0, 0, 3, 15]),
                fields: with_authority(&req, REPLACEMENT),
            }]
        );
        // 40 kB of value: the re-encoded block spans three frames (the
        // view checked each is at most MAX_FRAME).
        assert!(out.len() - PREFACE.len() > 2 * MAX_FRAME);
    }

    #[test]
    fn not_http2_passes_through() {
        for input in [
            &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
            b"PRI * HTTP/1.1\r\n",
            b"",
        ] {
            assert_eq!(run(input).0, input);
        }
        // A preface that breaks off after its first bytes, fed in pieces.
        let mut rw = Rewriter::new();
        rw.feed(b"PRI * ").unwrap();
        rw.feed(b"HTTP/9").unwrap();
        assert_eq!(rw.output(), b"PRI * HTTP/9");
    }

    #[test]
    fn malformed_streams_are_connection_errors() {
        let mut enc = loona_hpack::Encoder::new();
        let req = grpc_request("localhost");
        let block = enc.encode(req.iter().map(|(n, v)| (&n[..], &v[..])));
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (
                frame(CONTINUATION, END_HEADERS, 1, &block),
                "without a HEADERS",
            ),
            (
                [frame(HEADERS, 0, 1, &block), frame(0x0, 0, 1, b"x")].concat(),
                "inside the header block",
            ),
            (
                [
                    frame(HEADERS, 0, 1, &block),
                    frame(CONTINUATION, END_HEADERS, 3, b""),
                ]
                .concat(),
                "inside the header block",
            ),
            (
                frame(HEADERS, END_HEADERS | PADDED, 1, &[200, 1, 2]),
                "padding",
            ),
            (
                frame(HEADERS, END_HEADERS | PRIORITY, 1, &[1, 2]),
                "PRIORITY",
            ),
            (
                frame(PUSH_PROMISE, END_HEADERS, 1, &[0, 0, 0, 2]),
                "PUSH_PROMISE",
            ),
            (frame(HEADERS, END_HEADERS, 1, &[0xff, 0x7f]), "HPACK"),
            // Only the frame header: refused before 2 MiB are buffered.
            (
                vec![0x20, 0, 0, HEADERS, END_HEADERS, 0, 0, 0, 1],
                "exceeds",
            ),
        ];
        for (frames, why) in cases {
            let mut rw = Rewriter::new();
            let mut input = PREFACE.to_vec();
            input.extend(frames);
            let e = rw.feed(&input).unwrap_err();
            assert!(e.to_string().contains(why), "{why}: {e}");
            assert!(rw.feed(b"more").is_err(), "stays failed");
        }
    }

    fn arb_fields() -> impl Strategy<Value = Fields> {
        let name = "[a-z][a-z0-9-]{0,15}".prop_map(String::into_bytes);
        let value = proptest::collection::vec(0x20u8..0x7f, 0..40);
        proptest::collection::vec((name, value), 0..6)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Any mix of requests (authorities valid or not, blocks split
        /// into CONTINUATIONs, optional padding and priority, DATA and
        /// PING frames in between), fed in any chunks: h2 sees the same
        /// frames, each block decodable on its own, authorities fixed.
        #[test]
        fn any_stream_any_chunking(
            reqs in proptest::collection::vec(
                (arb_fields(), any::<bool>(), 0usize..3, proptest::option::of(0u8..20),
                 any::<bool>(), proptest::collection::vec(any::<u8>(), 0..30)),
                1..6),
            cuts in proptest::collection::vec(1usize..64, 1..40),
        ) {
            let mut enc = loona_hpack::Encoder::new();
            let mut input = PREFACE.to_vec();
            let mut want = Vec::new();
            for (i, (extra, bad, splits, pad, priority, data)) in reqs.iter().enumerate() {
                let stream = 2 * i as u32 + 1;
                let mut req = grpc_request(if *bad { "tmp%2Fcsi.sock" } else { "localhost" });
                req.extend(extra.iter().cloned());
                let block = enc.encode(req.iter().map(|(n, v)| (&n[..], &v[..])));
                let pieces: Vec<&[u8]> = if *splits == 0 || block.len() < 3 {
                    vec![&block[..]]
                } else {
                    let step = block.len() / (splits + 1) + 1;
                    block.chunks(step).collect()
                };
                let pri = priority.then_some([0, 0, 0, 0, 16]);
                for (k, p) in pieces.iter().enumerate() {
                    let last = k + 1 == pieces.len();
                    let mut flags = if last { END_HEADERS } else { 0 };
                    if k == 0 {
                        let mut payload = Vec::new();
                        if let Some(n) = pad {
                            flags |= PADDED;
                            payload.push(*n);
                        }
                        if let Some(pr) = pri {
                            flags |= PRIORITY;
                            payload.extend(pr);
                        }
                        payload.extend(*p);
                        payload.extend(std::iter::repeat_n(0, usize::from(pad.unwrap_or(0))));
                        input.extend(frame(HEADERS, flags, stream, &payload));
                    } else {
                        input.extend(frame(CONTINUATION, flags, stream, p));
                    }
                }
                want.push(Event::Headers {
                    stream,
                    end_stream: false,
                    priority: pri,
                    fields: with_authority(&req, if *bad { REPLACEMENT } else { "localhost" }),
                });
                input.extend(frame(0x0, END_STREAM, stream, data));
                want.push(Event::Other { ty: 0, flags: END_STREAM, stream, payload: data.clone() });
                input.extend(frame(0x6, 0, 0, &[1; 8]));
                want.push(Event::Other { ty: 6, flags: 0, stream: 0, payload: vec![1; 8] });
            }
            let mut rw = Rewriter::new();
            let mut rest = &input[..];
            for c in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let n = (*c).min(rest.len());
                rw.feed(&rest[..n]).unwrap();
                rest = &rest[n..];
            }
            let (whole, _) = run(&input);
            prop_assert_eq!(rw.output(), &whole[..], "chunking changes nothing");
            prop_assert_eq!(server_view(&whole), want);
        }
    }
}
