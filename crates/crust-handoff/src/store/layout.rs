//! The two on-disk layouts, and the record directory a target names.

use base64::Engine;
use sha2::{Digest, Sha256};

pub const DEFAULT_CRUST_ROOT: &str = "/var/run/crust";
pub const DEFAULT_KATA_ROOT: &str = "/run/kata-containers/shared/direct-volumes";

/// Which on-disk format a [`Store`](super::Store) speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// KEP-2857: `<root>/<hex sha256(target)>/{mountInfo.json,runtime-cli,<sandbox-id>}`.
    Crust,
    /// Kata direct volumes: `<root>/<base64url(path) with padding>/{mountInfo.json,<sandbox-id>}`.
    Kata,
}

impl Layout {
    pub fn default_root(self) -> &'static str {
        match self {
            Layout::Crust => DEFAULT_CRUST_ROOT,
            Layout::Kata => DEFAULT_KATA_ROOT,
        }
    }

    /// The record directory's name for `target` (no validation).
    pub fn key(self, target: &str) -> String {
        match self {
            Layout::Crust => crust_key(target),
            Layout::Kata => kata_key(target),
        }
    }

    pub(super) fn is_key(self, name: &str) -> bool {
        match self {
            Layout::Crust => {
                name.len() == 64 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            }
            Layout::Kata => {
                !name.is_empty()
                    && name.len().is_multiple_of(4)
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'='))
            }
        }
    }

    pub(super) fn target_of(self, key: &str) -> Option<String> {
        match self {
            Layout::Crust => None,
            Layout::Kata => base64::engine::general_purpose::URL_SAFE
                .decode(key)
                .ok()
                .and_then(|b| String::from_utf8(b).ok()),
        }
    }
}

/// Lowercase hex SHA-256 of the target path string (the KEP's directory name).
pub fn crust_key(target: &str) -> String {
    let d = Sha256::digest(target.as_bytes());
    let mut s = String::with_capacity(64);
    for b in d {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// URL-safe base64 with padding of the volume path (Go's `base64.URLEncoding`).
pub fn kata_key(path: &str) -> String {
    base64::engine::general_purpose::URL_SAFE.encode(path.as_bytes())
}
