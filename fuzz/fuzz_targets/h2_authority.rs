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
//! is not HTTP/2 passes through untouched.
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
    let input = match mode % 3 {
        0 => [PREFACE, u.take_rest()].concat(),
        1 => u.take_rest().to_vec(),
        _ => match requests(&mut u) {
            Ok(i) => i,
            Err(_) => return,
        },
    };
    check(&input, seed);
});

fn check(input: &[u8], seed: u64) {
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

/// gRPC-shaped requests, HPACK-encoded with a dynamic table as a client
/// does, framed in the ways HTTP/2 allows.
fn requests(u: &mut Unstructured) -> Result<Vec<u8>> {
    let mut enc = loona_hpack::Encoder::new();
    let mut out = PREFACE.to_vec();
    for i in 0..u.int_in_range(1..=6u32)? {
        let stream = 2 * i + 1;
        let authority = match u.arbitrary::<u8>()? as usize {
            k if k < AUTHORITIES.len() * 24 => AUTHORITIES[k % AUTHORITIES.len()].to_vec(),
            _ => u.arbitrary::<Vec<u8>>()?,
        };
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":scheme".to_vec(), b"http".to_vec()),
            (b":path".to_vec(), b"/csi.v1.Node/NodeGetInfo".to_vec()),
            (b":authority".to_vec(), authority),
        ];
        for _ in 0..u.int_in_range(0..=5u8)? {
            let name = NAMES[u.choose_index(NAMES.len())?].to_vec();
            fields.push((name, u.arbitrary::<Vec<u8>>()?));
        }
        let block = enc.encode(fields.iter().map(|(n, v)| (&n[..], &v[..])));
        let splits = usize::from(u.int_in_range(0..=3u8)?);
        let pieces: Vec<&[u8]> = if splits == 0 || block.len() < 2 {
            vec![&block[..]]
        } else {
            block.chunks(block.len() / (splits + 1) + 1).collect()
        };
        let pad: Option<u8> = u.arbitrary()?;
        let priority: Option<[u8; 5]> = u.arbitrary()?;
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
            let ty = [0x0, 0x3, 0x4, 0x6, 0x8][u.choose_index(5)?];
            let flags = u.arbitrary()?;
            let payload = u.arbitrary::<Vec<u8>>()?;
            out.extend(frame(ty, flags, stream, &payload));
        }
    }
    Ok(out)
}
