//! The agent channel from both ends: a byte stream split anywhere goes
//! through the frame decoder; each frame is parsed as the agent parses a
//! request (every operation, then the agent's own argument checks) and as
//! the host parses a response (and each reply type a guest can send).
//! Invariants: no panic, a frame never exceeds the limit, a request that
//! parses re-encodes to one that parses equal.
#![no_main]

use arbitrary::Unstructured;
use crust_agent_proto::{
    ExecReply, FrameDecoder, GrowVolumeReply, MAX_FRAME_LEN, MountVolumeReply, Operation, Outcome,
    PingReply, ProcessReply, Response, VolumeStats, WaitReply, frame, parse_request,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // First byte: how many bytes go into each push (1..=256), the rest is
    // the stream itself, so seeds are plain frames after one byte.
    let mut u = Unstructured::new(data);
    let step = u.arbitrary::<u8>().unwrap_or(0) as usize + 1;
    let stream = u.take_rest();
    let mut dec = FrameDecoder::new();
    for piece in stream.chunks(step) {
        dec.push(piece);
        while let Some(f) = dec.next_frame() {
            let Ok(body) = f else { continue };
            assert!(body.len() <= MAX_FRAME_LEN);
            as_request(&body);
            as_response(&body);
        }
    }
    // A bare body too: the fuzzer's JSON need not carry a length prefix.
    as_request(stream);
    as_response(stream);
});

fn as_request(body: &[u8]) {
    let Ok(req) = parse_request(body) else { return };
    let again = frame::encode(&req).expect("a parsed request re-encodes");
    let back = parse_request(&again[frame::HEADER_LEN..]).expect("and parses again");
    assert_eq!(back, req);
    // What the agent checks before acting.
    match &req.op {
        Operation::MountVolume(m) => {
            let _ = crust_agent::volume::validate_name(&m.volume);
            let _ = crust_agent::options::parse(m.fstype, &m.options, m.readonly);
        }
        Operation::ConfigureNetwork(n) => {
            let _ = crust_agent_proto::network::validate(n);
        }
        _ => {}
    }
}

fn as_response(body: &[u8]) {
    let Ok(resp) = frame::decode::<Response>(body) else {
        return;
    };
    let Outcome::Result(v) = resp.outcome else {
        return;
    };
    let _ = serde_json::from_value::<PingReply>(v.clone());
    let _ = serde_json::from_value::<VolumeStats>(v.clone());
    let _ = serde_json::from_value::<MountVolumeReply>(v.clone());
    let _ = serde_json::from_value::<GrowVolumeReply>(v.clone());
    let _ = serde_json::from_value::<ProcessReply>(v.clone());
    let _ = serde_json::from_value::<WaitReply>(v.clone());
    let _ = serde_json::from_value::<ExecReply>(v);
}
