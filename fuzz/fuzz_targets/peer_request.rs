//! The sealed body of a node-to-node request (`crust_peer_seal::open`),
//! what crust-csi's peer port reads from anyone on the pod network.
//! Input: one byte choosing how the rest arrives, then the rest:
//! - even: `mac (32 bytes) || body`, as an attacker without the key sends
//!   it (or answers it): always refused, and nothing is remembered;
//! - odd: a body sealed with the node's key (a sender that has it): the
//!   JSON, nonce, clock and replay checks see arbitrary bodies.
//!
//! Invariants: no panic; what opens has a 32-hex-digit nonce and an issue
//! time inside the window, opens only once, and seals again to a body
//! that opens to the same request; a refusal leaves the cache unchanged.
#![no_main]

use crust_peer_seal::{
    CLOCK_WINDOW_MS, PeerKey, Refusal, ReplayCache, open, open_answer, seal, seal_bytes,
};
use libfuzzer_sys::fuzz_target;

/// The receiver's clock: fixed, so seeds and the dictionary can hit it
/// (`"issued_unix_ms":1800000000000`).
const NOW_MS: i64 = 1_800_000_000_000;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let key = PeerKey::new(b"crust-fuzz-peer-key-of-32-bytes!!").expect("long enough");
    let cache = ReplayCache::new();
    if mode % 2 == 0 {
        let (mac, body) = rest.split_at(rest.len().min(32));
        assert!(open(&key, body, mac, NOW_MS, &cache).is_err());
        assert!(cache.is_empty());
        // Nor as an answer (what a sender reads back from a peer port).
        assert!(open_answer(&key, body, mac, "0123456789abcdef0123456789abcdef").is_err());
        return;
    }
    let sealed = seal_bytes(&key, rest.to_vec());
    match open(&key, &sealed.body, &sealed.mac, NOW_MS, &cache) {
        Ok(body) => {
            assert_eq!(body.nonce.len(), 32);
            assert!(
                body.nonce
                    .bytes()
                    .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
            );
            assert!((NOW_MS - body.issued_unix_ms).abs() <= CLOCK_WINDOW_MS);
            assert_eq!(cache.len(), 1);
            assert_eq!(
                open(&key, &sealed.body, &sealed.mac, NOW_MS, &cache),
                Err(Refusal::Replayed)
            );
            let again = seal(&key, &body);
            assert_eq!(
                open(&key, &again.body, &again.mac, NOW_MS, &ReplayCache::new()),
                Ok(body)
            );
        }
        Err(_) => assert!(cache.is_empty()),
    }
});
