//! The `:authority` front every crust gRPC server puts before h2
//! (crust_h2_authority::Rewriter), over client byte streams. The first
//! byte picks the input: raw bytes after the preface, raw bytes as they
//! come, or requests built here (HPACK with the client's dynamic table,
//! CONTINUATIONs, padding, priority, other frames between). Invariants:
//! no panic; feeding in any chunks gives the same result as feeding at
//! once; whatever is accepted is what a server holding the client's HPACK
//! context reads, frame for frame, with only unusable `:authority` values
//! replaced, and every emitted block decodes on its own; a stream a
//! server would read whole is refused only for its size; a stream that
//! is not HTTP/2 passes through untouched; and h2's own server (the one
//! crust's gRPC servers run on) reads the rewritten stream at least as
//! well as the client's: every request it takes from the input it takes
//! from the output, and it fails on the output only where it fails on the
//! input.
#![no_main]

use arbitrary::{Result, Unstructured};
use crust_h2_authority::view::{Event, client_view, server_view};
use crust_h2_authority::{FrontError, PREFACE, REPLACEMENT, Rewriter, authority_ok};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let (Ok(mode), Ok(seed)) = (u.arbitrary::<u8>(), u.arbitrary::<u64>()) else {
        return;
    };
    // A quarter of the built streams are clean: nothing in them but
    // their authorities may be refused by a server.
    let clean = seed % 4 == 0;
    let (input, authorities) = match mode % 3 {
        0 => ([PREFACE, u.take_rest()].concat(), None),
        1 => (u.take_rest().to_vec(), None),
        _ => match requests(&mut u, clean) {
            Ok((i, a)) => (i, clean.then_some(a)),
            Err(_) => return,
        },
    };
    check(&input, seed, authorities.as_deref());
});

fn check(input: &[u8], seed: u64, clean: Option<&[Vec<u8>]>) {
    let mut whole = Rewriter::new();
    let res = whole.feed(input);
    let mut chunked = Rewriter::new();
    let mut cut_res = Ok(());
    for piece in cuts(input, seed) {
        cut_res = chunked.feed(piece);
        if cut_res.is_err() {
            // Once failed, it stays failed.
            assert!(chunked.feed(b"x").is_err());
            break;
        }
    }
    assert_eq!(res.is_ok(), cut_res.is_ok(), "{res:?} vs {cut_res:?}");

    let n = PREFACE.len().min(input.len());
    if input[..n] != PREFACE[..n] {
        assert!(res.is_ok());
        assert_eq!(whole.output(), input, "not HTTP/2: untouched");
        return;
    }
    let client = client_view(input);
    match res {
        Ok(()) => {
            assert_eq!(whole.output(), chunked.output(), "chunking changes nothing");
            if input.len() < PREFACE.len() {
                return;
            }
            let client = client.expect("accepted only what a server reads");
            let server = server_view(whole.output()).expect("emitted a stream h2 reads");
            let mut replaced = 0;
            let want: Vec<Event> = client
                .events
                .into_iter()
                .map(|e| fix_authority(e, &mut replaced))
                .collect();
            assert_eq!(server.events, want);
            assert_eq!(whole.rewritten(), replaced);
            if let Some(authorities) = clean {
                h2_takes_every_request(whole.output(), authorities);
            }
        }
        Err(e) => {
            if let Ok(v) = client
                && !v.truncated
            {
                assert!(
                    matches!(e, FrontError::BlockTooLarge { .. }),
                    "refused a stream a server reads: {e}"
                );
            }
        }
    }
}

/// What h2's server makes of a client byte stream: the requests it
/// hands over (method and URI) and whether the connection failed with a
/// protocol error. The client's side stays open (h2 drops what it has not
/// handed over once the peer closes): reading stops when h2 waits for
/// more bytes.
fn h2_reads(stream: &[u8]) -> (Vec<String>, Option<String>) {
    use std::task::Poll;
    use tokio::io::AsyncWriteExt;
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    rt.block_on(async {
        // Big enough for the input and all the server writes back (it is
        // never read, so a small pipe would stall the server).
        let (mut client, server) = tokio::io::duplex(1 << 22);
        client.write_all(stream).await.expect("in-memory write");
        let protocol = |e: h2::Error| (!e.is_io()).then(|| e.to_string());
        let mut conn = match h2::server::handshake(server).await {
            Ok(c) => c,
            Err(e) => return (Vec::new(), protocol(e)),
        };
        let mut requests = Vec::new();
        // Pending twice, with a yield between (tokio's cooperative budget
        // can make a read wait once with bytes left): all is read.
        let mut waits = 0;
        loop {
            match std::future::poll_fn(|cx| Poll::Ready(conn.poll_accept(cx))).await {
                Poll::Ready(Some(Ok((req, _respond)))) => {
                    waits = 0;
                    requests.push(format!("{} {}", req.method(), req.uri()));
                }
                Poll::Ready(Some(Err(e))) => return (requests, protocol(e)),
                Poll::Ready(None) => return (requests, None),
                Poll::Pending if waits < 2 => {
                    waits += 1;
                    tokio::task::yield_now().await;
                }
                Poll::Pending => return (requests, None),
            }
        }
    })
}

/// A clean stream (only its authorities may be unusable): h2 takes every
/// request from the rewritten stream, with the authority the client sent
/// where usable and the replacement where not, and no protocol error.
fn h2_takes_every_request(output: &[u8], authorities: &[Vec<u8>]) {
    let (taken, err) = h2_reads(output);
    assert_eq!(err, None, "h2 fails on the output: {taken:?}");
    let want: Vec<String> = authorities
        .iter()
        .map(|a| {
            let a = if authority_ok(a) {
                a.as_slice()
            } else {
                REPLACEMENT.as_bytes()
            };
            format!("POST http://{}{PATH}", String::from_utf8_lossy(a))
        })
        .collect();
    assert_eq!(taken, want, "what h2 took from the output");
}

fn fix_authority(e: Event, replaced: &mut u64) -> Event {
    match e {
        Event::Headers {
            stream,
            end_stream,
            priority,
            fields,
        } => Event::Headers {
            stream,
            end_stream,
            priority,
            fields: fields
                .into_iter()
                .map(|(n, v)| {
                    if n == b":authority" && !authority_ok(&v) {
                        *replaced += 1;
                        (n, REPLACEMENT.as_bytes().to_vec())
                    } else {
                        (n, v)
                    }
                })
                .collect(),
        },
        other => other,
    }
}

/// Splits `input` into pieces of 1 to 64 bytes drawn from `seed`.
fn cuts(mut input: &[u8], mut seed: u64) -> impl Iterator<Item = &[u8]> {
    std::iter::from_fn(move || {
        if input.is_empty() {
            return None;
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let n = (seed % 64 + 1) as usize;
        let (head, rest) = input.split_at(n.min(input.len()));
        input = rest;
        Some(head)
    })
}

const AUTHORITIES: &[&[u8]] = &[
    b"localhost",
    b"tmp%2Fcsi.sock",
    b"%2Frun%2Fcsi%2Fcsi.sock",
    b"/run/csi/csi.sock",
    b"[::1]:50051",
    b"127.0.0.1:1",
    b"",
    b"a b",
];
const NAMES: &[&[u8]] = &[
    b":authority",
    b"content-type",
    b"te",
    b"user-agent",
    b"grpc-timeout",
    b"x-custom",
];

fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.push(ty);
    f.push(flags);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

const PATH: &str = "/csi.v1.Node/NodeGetInfo";

/// Header values a server takes: visible ASCII, `te` only as gRPC sends it.
fn clean_value(name: &[u8], raw: Vec<u8>) -> Vec<u8> {
    if name == b"te" {
        return b"trailers".to_vec();
    }
    raw.into_iter().map(|b| b' ' + 1 + b % 94).collect()
}

/// gRPC-shaped requests, HPACK-encoded with a dynamic table as a client
/// does, framed in the ways HTTP/2 allows, and the authority of each.
/// `clean`: a SETTINGS frame first, header values a server takes, no
/// priority, and only PINGs between requests.
fn requests(u: &mut Unstructured, clean: bool) -> Result<(Vec<u8>, Vec<Vec<u8>>)> {
    let mut enc = loona_hpack::Encoder::new();
    let mut out = PREFACE.to_vec();
    if clean {
        out.extend(frame(0x4, 0, 0, &[]));
    }
    let mut authorities = Vec::new();
    for i in 0..u.int_in_range(1..=6u32)? {
        let stream = 2 * i + 1;
        let authority = match u.arbitrary::<u8>()? as usize {
            k if k < AUTHORITIES.len() * 24 => AUTHORITIES[k % AUTHORITIES.len()].to_vec(),
            _ => u.arbitrary::<Vec<u8>>()?,
        };
        authorities.push(authority.clone());
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":scheme".to_vec(), b"http".to_vec()),
            (b":path".to_vec(), PATH.as_bytes().to_vec()),
            (b":authority".to_vec(), authority),
        ];
        for _ in 0..u.int_in_range(0..=5u8)? {
            // A second :authority is a malformed request, not a clean one.
            let names = if clean { &NAMES[1..] } else { NAMES };
            let name = names[u.choose_index(names.len())?].to_vec();
            let value = u.arbitrary::<Vec<u8>>()?;
            let value = if clean {
                clean_value(&name, value)
            } else {
                value
            };
            fields.push((name, value));
        }
        let block = enc.encode(fields.iter().map(|(n, v)| (&n[..], &v[..])));
        let splits = usize::from(u.int_in_range(0..=3u8)?);
        let pieces: Vec<&[u8]> = if splits == 0 || block.len() < 2 {
            vec![&block[..]]
        } else {
            block.chunks(block.len() / (splits + 1) + 1).collect()
        };
        let pad: Option<u8> = u.arbitrary()?;
        let priority: Option<[u8; 5]> = u.arbitrary::<Option<_>>()?.filter(|_| !clean);
        let end_stream = u.arbitrary::<bool>()?;
        for (k, p) in pieces.iter().enumerate() {
            let mut flags = if k + 1 == pieces.len() { 0x4 } else { 0 };
            if k == 0 {
                let mut payload = Vec::new();
                if end_stream {
                    flags |= 0x1;
                }
                if let Some(n) = pad {
                    flags |= 0x8;
                    payload.push(n);
                }
                if let Some(pr) = priority {
                    flags |= 0x20;
                    payload.extend(pr);
                }
                payload.extend(*p);
                payload.extend(std::iter::repeat_n(0, usize::from(pad.unwrap_or(0))));
                out.extend(frame(0x1, flags, stream, &payload));
            } else {
                out.extend(frame(0x9, flags, stream, p));
            }
        }
        // Frames a client sends between requests, passed through.
        for _ in 0..u.int_in_range(0..=2u8)? {
            if clean {
                out.extend(frame(0x6, 0, 0, &u.arbitrary::<[u8; 8]>()?));
                continue;
            }
            let ty = [0x0, 0x3, 0x4, 0x6, 0x8][u.choose_index(5)?];
            let flags = u.arbitrary()?;
            let payload = u.arbitrary::<Vec<u8>>()?;
            out.extend(frame(ty, flags, stream, &payload));
        }
    }
    Ok((out, authorities))
}
