//! The sealed body of a crust-csi request to another node's crust-csi
//! (the `crust.peer.v1alpha1` gRPC service carries `body` and `mac`).
//!
//! Kubernetes sends ControllerModifyVolume to one node's plugin, while a
//! volume lives on one node: that plugin passes the request on to the
//! others. Anyone on the pod network can reach a plugin's peer port, so a
//! request is accepted only if it is:
//!
//! - **sealed** with the key every node shares (HMAC-SHA256 over a
//!   domain string and the body, compared in constant time, before the
//!   body is parsed);
//! - **fresh**: issued within [`CLOCK_WINDOW_MS`] of the receiver's clock;
//! - **new**: its nonce not seen by this receiver inside that window (a
//!   captured request replayed later could undo a newer change), and
//!   issued after the receiver started (a restarted receiver has forgotten
//!   the nonces it saw).
//!
//! The body is JSON (bounded, unknown fields refused). It is not secret:
//! I/O limits and a volume id.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// The shortest key accepted: 256 bits.
pub const KEY_MIN_BYTES: usize = 32;
/// The longest key file read.
pub const KEY_MAX_BYTES: usize = 4096;
/// The largest body opened (a ModifyVolume's is a few hundred bytes).
pub const BODY_MAX_BYTES: usize = 64 * 1024;
/// How far a request's issue time may be from the receiver's clock.
pub const CLOCK_WINDOW_MS: i64 = 60_000;
/// Nonces remembered at most (inside one clock window); past it requests
/// are refused until old ones age out, never admitted unchecked.
pub const REPLAY_CACHE_MAX: usize = 65_536;

/// Binds a seal to this request kind: a MAC made for another body kind
/// (a future RPC) never opens as a ModifyVolume.
const DOMAIN: &[u8] = b"crust.peer.v1alpha1.ModifyVolume\n";
/// The same for the receiver's answer: a request's seal never passes as
/// an answer's, or the reverse.
const ANSWER_DOMAIN: &[u8] = b"crust.peer.v1alpha1.ModifyVolumeAnswer\n";
const NONCE_BYTES: usize = 16;

/// The key all nodes' plugins share (a Kubernetes Secret's file).
#[derive(Clone)]
pub struct PeerKey(Vec<u8>);

impl std::fmt::Debug for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerKey(<{} bytes>)", self.0.len())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("peer key {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "peer key {}: {len} bytes; at least {KEY_MIN_BYTES} are needed (e.g. 32 bytes of /dev/urandom, base64-encoded)",
        path.display()
    )]
    TooShort { path: PathBuf, len: usize },
    #[error("peer key {}: over {KEY_MAX_BYTES} bytes", path.display())]
    TooLong { path: PathBuf },
}

impl PeerKey {
    /// The key in `bytes`, surrounding ASCII whitespace removed (a
    /// `kubectl create secret --from-literal` or an editor's newline).
    pub fn new(bytes: &[u8]) -> Option<PeerKey> {
        let key = bytes.trim_ascii();
        (KEY_MIN_BYTES..=KEY_MAX_BYTES)
            .contains(&key.len())
            .then(|| PeerKey(key.to_vec()))
    }

    /// Reads the key file (a Secret volume's file is a symbolic link into
    /// kubelet's `..data`: followed; it is the operator's path, not a
    /// guest's).
    pub fn read(path: &Path) -> Result<PeerKey, KeyError> {
        let read_err = |source| KeyError::Read {
            path: path.to_path_buf(),
            source,
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .map_err(read_err)?
            .take(KEY_MAX_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(read_err)?;
        if bytes.len() > KEY_MAX_BYTES {
            return Err(KeyError::TooLong {
                path: path.to_path_buf(),
            });
        }
        PeerKey::new(&bytes).ok_or_else(|| KeyError::TooShort {
            path: path.to_path_buf(),
            len: bytes.trim_ascii().len(),
        })
    }

    fn mac(&self) -> Hmac<Sha256> {
        self.mac_for(DOMAIN)
    }

    fn mac_for(&self, domain: &[u8]) -> Hmac<Sha256> {
        // HMAC takes a key of any length.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts every key length"));
        m.update(domain);
        m
    }
}

/// A ControllerModifyVolume passed on to another node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModifyVolumeBody {
    pub volume_id: String,
    pub mutable_parameters: BTreeMap<String, String>,
    /// The sender's clock, Unix milliseconds.
    pub issued_unix_ms: i64,
    /// 32 lowercase hex digits, random.
    pub nonce: String,
    /// The sender's node id (for the receiver's log only).
    pub from_node: String,
}

impl ModifyVolumeBody {
    /// A body issued now with a fresh random nonce.
    pub fn new(
        volume_id: &str,
        mutable_parameters: BTreeMap<String, String>,
        from_node: &str,
    ) -> Result<ModifyVolumeBody, getrandom::Error> {
        let mut nonce = [0u8; NONCE_BYTES];
        getrandom::getrandom(&mut nonce)?;
        Ok(ModifyVolumeBody {
            volume_id: volume_id.to_string(),
            mutable_parameters,
            issued_unix_ms: now_unix_ms(),
            nonce: nonce.iter().map(|b| format!("{b:02x}")).collect(),
            from_node: from_node.to_string(),
        })
    }
}

/// A sealed body, as the `SealedRequest` message carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub body: Vec<u8>,
    pub mac: Vec<u8>,
}

/// Encodes and seals `body` with `key`.
pub fn seal(key: &PeerKey, body: &ModifyVolumeBody) -> Sealed {
    let body = serde_json::to_vec(body)
        .unwrap_or_else(|_| unreachable!("strings and integers always encode"));
    seal_bytes(key, body)
}

/// Seals bytes as they are (the fuzz target's and tests' way to seal a
/// body no sender would encode).
pub fn seal_bytes(key: &PeerKey, body: Vec<u8>) -> Sealed {
    let mut m = key.mac();
    m.update(&body);
    Sealed {
        mac: m.finalize().into_bytes().to_vec(),
        body,
    }
}

/// A receiver's answer to one request, sealed so that the sender trusts
/// only what a node holding the key said about that very request (an
/// unsealed "OK" from whoever holds a peer's address counts as no answer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Answer {
    /// The request's nonce.
    pub nonce: String,
    /// The answering node's id.
    pub node: String,
    /// Whether the answering node has the volume (its code is then the
    /// volume's answer; otherwise "not mine").
    pub owner: bool,
    /// The gRPC code of the answering node's own ControllerModifyVolume
    /// (0: applied).
    pub code: i32,
    pub message: String,
}

/// Encodes and seals an answer.
pub fn seal_answer(key: &PeerKey, answer: &Answer) -> Sealed {
    let body = serde_json::to_vec(answer)
        .unwrap_or_else(|_| unreachable!("strings and integers always encode"));
    let mut m = key.mac_for(ANSWER_DOMAIN);
    m.update(&body);
    Sealed {
        mac: m.finalize().into_bytes().to_vec(),
        body,
    }
}

/// Opens an answer to the request whose nonce is `nonce`: the seal, then
/// the body, then that it answers this request.
pub fn open_answer(key: &PeerKey, body: &[u8], mac: &[u8], nonce: &str) -> Result<Answer, Refusal> {
    if body.len() > BODY_MAX_BYTES {
        return Err(Refusal::TooLarge(body.len()));
    }
    let mut m = key.mac_for(ANSWER_DOMAIN);
    m.update(body);
    m.verify_slice(mac).map_err(|_| Refusal::BadSeal)?;
    let answer: Answer =
        serde_json::from_slice(body).map_err(|e| Refusal::Malformed(e.to_string()))?;
    if answer.nonce != nonce {
        return Err(Refusal::OtherRequest);
    }
    Ok(answer)
}

/// Why a sealed request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the body is {0} bytes, over the {BODY_MAX_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("the seal does not match (the sender's peer key is not this node's)")]
    BadSeal,
    #[error("the sealed body is not a ModifyVolume body: {0}")]
    Malformed(String),
    #[error("the nonce is not {} lowercase hex digits", 2 * NONCE_BYTES)]
    BadNonce,
    #[error(
        "issued {skew_ms} ms from this node's clock (at most {CLOCK_WINDOW_MS} allowed: are the nodes' clocks synchronised?)"
    )]
    OutsideWindow { skew_ms: i64 },
    #[error("already received (a replayed request)")]
    Replayed,
    #[error("an answer to another request")]
    OtherRequest,
    #[error(
        "issued before this node's plugin started (it may have been received by the previous one; send a new request)"
    )]
    BeforeStart,
    #[error("more than {REPLAY_CACHE_MAX} requests inside the clock window")]
    Flooded,
}

/// The nonces a receiver has admitted, kept while a replay could still
/// pass the clock window.
#[derive(Debug, Default)]
pub struct ReplayCache {
    seen: Mutex<HashMap<String, i64>>,
    /// Requests issued earlier are refused: the nonces a previous process
    /// admitted are gone, so one of its requests could be replayed now.
    not_before_ms: i64,
}

impl ReplayCache {
    /// A cache that admits any issue time the clock window allows.
    pub fn new() -> ReplayCache {
        ReplayCache::default()
    }

    /// A receiver's cache made at its start (`now_unix_ms()`): requests
    /// issued before it are refused (a sender retries with a new one).
    pub fn since(start_ms: i64) -> ReplayCache {
        ReplayCache {
            not_before_ms: start_ms,
            ..ReplayCache::default()
        }
    }

    fn admit(&self, nonce: &str, issued: i64, now: i64) -> Result<(), Refusal> {
        if issued < self.not_before_ms {
            return Err(Refusal::BeforeStart);
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains_key(nonce) {
            return Err(Refusal::Replayed);
        }
        if seen.len() >= REPLAY_CACHE_MAX {
            // Older than the window: the clock check refuses those anyway.
            seen.retain(|_, t| now.saturating_sub(*t) <= CLOCK_WINDOW_MS);
        }
        if seen.len() >= REPLAY_CACHE_MAX {
            return Err(Refusal::Flooded);
        }
        seen.insert(nonce.to_string(), issued);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Opens a sealed request received at `now_ms`: the size, then the seal
/// (before any parsing), then the body, the clock and the nonce. A
/// refused request leaves `cache` as it was.
pub fn open(
    key: &PeerKey,
    body: &[u8],
    mac: &[u8],
    now_ms: i64,
    cache: &ReplayCache,
) -> Result<ModifyVolumeBody, Refusal> {
    if body.len() > BODY_MAX_BYTES {
        return Err(Refusal::TooLarge(body.len()));
    }
    let mut m = key.mac();
    m.update(body);
    m.verify_slice(mac).map_err(|_| Refusal::BadSeal)?;
    let parsed: ModifyVolumeBody =
        serde_json::from_slice(body).map_err(|e| Refusal::Malformed(e.to_string()))?;
    let hex = |c: char| c.is_ascii_digit() || ('a'..='f').contains(&c);
    if parsed.nonce.len() != 2 * NONCE_BYTES || !parsed.nonce.chars().all(hex) {
        return Err(Refusal::BadNonce);
    }
    let skew_ms = now_ms.saturating_sub(parsed.issued_unix_ms);
    if skew_ms.saturating_abs() > CLOCK_WINDOW_MS {
        return Err(Refusal::OutsideWindow { skew_ms });
    }
    cache.admit(&parsed.nonce, parsed.issued_unix_ms, now_ms)?;
    Ok(parsed)
}

/// This host's clock, Unix milliseconds (0 before 1970).
pub fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(fill: u8) -> PeerKey {
        PeerKey::new(&[b'a' + fill; 32]).unwrap()
    }

    fn body(id: &str) -> ModifyVolumeBody {
        ModifyVolumeBody::new(
            id,
            BTreeMap::from([("iops".to_string(), "200".to_string())]),
            "node-a",
        )
        .unwrap()
    }

    #[test]
    fn a_sealed_body_opens_once_with_the_same_key() {
        let k = key(7);
        let b = body("vol-1");
        let s = seal(&k, &b);
        let cache = ReplayCache::new();
        let now = b.issued_unix_ms;
        assert_eq!(open(&k, &s.body, &s.mac, now, &cache).unwrap(), b);
        assert_eq!(
            open(&k, &s.body, &s.mac, now + 10, &cache),
            Err(Refusal::Replayed)
        );
        // Another node has its own cache: the same request opens there
        // once (only the volume's owner acts on it).
        let other = ReplayCache::new();
        assert!(open(&k, &s.body, &s.mac, now, &other).is_ok());
    }

    #[test]
    fn another_key_or_a_changed_byte_is_refused_and_remembered_nowhere() {
        let b = body("vol-1");
        let s = seal(&key(7), &b);
        let cache = ReplayCache::new();
        let now = b.issued_unix_ms;
        assert_eq!(
            open(&key(8), &s.body, &s.mac, now, &cache),
            Err(Refusal::BadSeal)
        );
        let mut tampered = s.body.clone();
        let at = tampered.iter().position(|&c| c == b'2').unwrap();
        tampered[at] = b'9'; // iops 200 -> 900
        assert_eq!(
            open(&key(7), &tampered, &s.mac, now, &cache),
            Err(Refusal::BadSeal)
        );
        assert_eq!(
            open(&key(7), &s.body, &s.mac[..31], now, &cache),
            Err(Refusal::BadSeal)
        );
        assert!(cache.is_empty());
        // Still opens: the refusals did not spend its nonce.
        assert!(open(&key(7), &s.body, &s.mac, now, &cache).is_ok());
    }

    #[test]
    fn a_body_from_outside_the_clock_window_is_refused() {
        let k = key(1);
        let b = body("vol-1");
        let s = seal(&k, &b);
        let cache = ReplayCache::new();
        let t = b.issued_unix_ms;
        for now in [t + CLOCK_WINDOW_MS + 1, t - CLOCK_WINDOW_MS - 1] {
            assert!(matches!(
                open(&k, &s.body, &s.mac, now, &cache),
                Err(Refusal::OutsideWindow { .. })
            ));
        }
        assert!(open(&k, &s.body, &s.mac, t + CLOCK_WINDOW_MS, &cache).is_ok());
    }

    #[test]
    fn nonces_age_out_with_the_window_and_the_cache_is_bounded() {
        let cache = ReplayCache::new();
        cache.admit("a", 0, 0).unwrap();
        assert_eq!(cache.admit("a", 0, 10), Err(Refusal::Replayed));
        let full = ReplayCache::new();
        for i in 0..REPLAY_CACHE_MAX {
            full.admit(&i.to_string(), 5, 5).unwrap();
        }
        assert_eq!(full.admit("x", 5, 5), Err(Refusal::Flooded));
        // Once the window has passed, the old ones make room.
        let later = 6 + CLOCK_WINDOW_MS;
        full.admit("x", later, later).unwrap();
        assert_eq!(full.len(), 1);
    }

    #[test]
    fn answers_open_only_for_their_request_and_never_as_requests() {
        let k = key(6);
        let b = body("vol-1");
        let a = Answer {
            nonce: b.nonce.clone(),
            node: "node-b".into(),
            owner: true,
            code: 0,
            message: String::new(),
        };
        let s = seal_answer(&k, &a);
        assert_eq!(open_answer(&k, &s.body, &s.mac, &b.nonce), Ok(a.clone()));
        assert_eq!(
            open_answer(&k, &s.body, &s.mac, &"0".repeat(32)),
            Err(Refusal::OtherRequest)
        );
        assert_eq!(
            open_answer(&key(7), &s.body, &s.mac, &b.nonce),
            Err(Refusal::BadSeal)
        );
        // Domains: an answer's seal does not open as a request, nor the
        // reverse.
        assert_eq!(
            open(&k, &s.body, &s.mac, b.issued_unix_ms, &ReplayCache::new()),
            Err(Refusal::BadSeal)
        );
        let r = seal(&k, &b);
        assert_eq!(
            open_answer(&k, &r.body, &r.mac, &b.nonce),
            Err(Refusal::BadSeal)
        );
    }

    #[test]
    fn a_restarted_receiver_refuses_what_its_predecessor_may_have_seen() {
        let k = key(5);
        let b = body("vol-1");
        let s = seal(&k, &b);
        let before = ReplayCache::new();
        assert!(open(&k, &s.body, &s.mac, b.issued_unix_ms, &before).is_ok());
        // The process restarts: its nonces are gone, the request is not.
        let after = ReplayCache::since(b.issued_unix_ms + 1);
        assert_eq!(
            open(&k, &s.body, &s.mac, b.issued_unix_ms + 5, &after),
            Err(Refusal::BeforeStart)
        );
        assert!(after.is_empty());
        let fresh = body("vol-1");
        let fs = seal(&k, &fresh);
        assert!(
            open(
                &k,
                &fs.body,
                &fs.mac,
                fresh.issued_unix_ms,
                &ReplayCache::since(fresh.issued_unix_ms)
            )
            .is_ok()
        );
    }

    #[test]
    fn sealed_but_malformed_bodies_are_refused_by_name() {
        let k = key(3);
        let cache = ReplayCache::new();
        let sealed_raw = |raw: &[u8]| seal_bytes(&k, raw.to_vec()).mac;
        let now = now_unix_ms();
        let raw = format!(
            r#"{{"volume_id":"v","mutable_parameters":{{}},"issued_unix_ms":{now},"nonce":"{}","from_node":"n","extra":1}}"#,
            "a".repeat(32)
        );
        assert!(matches!(
            open(&k, raw.as_bytes(), &sealed_raw(raw.as_bytes()), now, &cache),
            Err(Refusal::Malformed(_))
        ));
        let raw = format!(
            r#"{{"volume_id":"v","mutable_parameters":{{}},"issued_unix_ms":{now},"nonce":"{}","from_node":"n"}}"#,
            "A".repeat(32)
        );
        assert_eq!(
            open(&k, raw.as_bytes(), &sealed_raw(raw.as_bytes()), now, &cache),
            Err(Refusal::BadNonce)
        );
        let big = vec![b' '; BODY_MAX_BYTES + 1];
        assert_eq!(
            open(&k, &big, &sealed_raw(&big), now, &cache),
            Err(Refusal::TooLarge(BODY_MAX_BYTES + 1))
        );
    }

    #[test]
    fn keys_are_trimmed_and_must_be_long_enough() {
        assert!(PeerKey::new(b"  short  ").is_none());
        let padded = format!("{}\n", "k".repeat(32));
        assert_eq!(
            format!("{:?}", PeerKey::new(padded.as_bytes()).unwrap()),
            "PeerKey(<32 bytes>)"
        );
        let dir = std::env::temp_dir().join(format!("crust-peer-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key");
        std::fs::write(&f, "tiny\n").unwrap();
        let e = PeerKey::read(&f).unwrap_err().to_string();
        assert!(e.contains("4 bytes") && e.contains("at least 32"), "{e}");
        std::fs::write(&f, vec![b'x'; KEY_MAX_BYTES + 1]).unwrap();
        assert!(matches!(PeerKey::read(&f), Err(KeyError::TooLong { .. })));
        std::fs::write(&f, padded).unwrap();
        assert!(PeerKey::read(&f).is_ok());
        assert!(matches!(
            PeerKey::read(&dir.join("absent")),
            Err(KeyError::Read { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    proptest! {
        // Whatever bytes arrive with whatever seal: refused, no panic,
        // and nothing remembered.
        #[test]
        fn unsealed_bytes_never_open(body in proptest::collection::vec(any::<u8>(), 0..512),
                                     mac in proptest::collection::vec(any::<u8>(), 0..40)) {
            let cache = ReplayCache::new();
            prop_assert!(open(&key(9), &body, &mac, now_unix_ms(), &cache).is_err());
            prop_assert!(cache.is_empty());
        }

        // Any parameters survive the seal unchanged.
        #[test]
        fn bodies_round_trip(params in proptest::collection::btree_map(".{0,12}", ".{0,12}", 0..6),
                             id in ".{0,40}") {
            let k = key(4);
            let mut b = body(&id);
            b.mutable_parameters = params;
            let s = seal(&k, &b);
            let opened = open(&k, &s.body, &s.mac, b.issued_unix_ms, &ReplayCache::new());
            prop_assert_eq!(opened, Ok(b));
        }
    }
}
