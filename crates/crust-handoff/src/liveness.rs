//! The runtime CLI's extension verbs (cross-team contract 1), typed in
//! one place: the runtime builds these values, crust_ops parses them.
//!
//! | command | stdout (exit 0) |
//! |---|---|
//! | `<cli> crust capabilities` | `{"verbs":["capabilities","resize","sandbox-state","stats"]}` |
//! | `<cli> crust sandbox-state <id>` | `{"sandbox_id":"…","state":"running"\|"stopped"\|"unknown","detail":"…"}` |
//!
//! A verb the CLI does not know: exit status 2 and a stderr line starting
//! with `unsupported:`. A CLI that fails `capabilities` (Kata's, the KEP's
//! minimal one) supports only `stats` and `resize`.
//!
//! Liveness is established by the host, never by a guest: `stopped` is
//! positive proof (the runtime's own record of the sandbox, its shim and
//! QEMU pids with their start times shown dead). An id the runtime does
//! not know is `unknown`, never `stopped`, and never releases a claim.

use serde::{Deserialize, Serialize};

use crate::validate::check_sandbox_id;

pub const VERB_CAPABILITIES: &str = "capabilities";
pub const VERB_RESIZE: &str = "resize";
pub const VERB_SANDBOX_STATE: &str = "sandbox-state";
pub const VERB_STATS: &str = "stats";
/// `<cli> crust freeze <target> <max-frozen-ms>`: freeze the volume's
/// filesystem where it is mounted (the guest) for a point-in-time copy;
/// the runtime thaws it by itself after the time given.
pub const VERB_FREEZE: &str = "freeze";
/// `<cli> crust thaw <target>` → `{"was_frozen":bool,"expired":bool}`.
pub const VERB_THAW: &str = "thaw";
/// `crust throttle <target> <limits>`: applies [`crate::IoLimits`] (their
/// wire form, empty = unlimited) to the volume's device in the guest.
pub const VERB_THROTTLE: &str = "throttle";
/// Exit status of a runtime CLI asked for a verb it does not know.
pub const UNSUPPORTED_EXIT: i32 = 2;
/// Start of its stderr line.
pub const UNSUPPORTED_PREFIX: &str = "unsupported:";
/// Longest `detail` kept.
const MAX_DETAIL: usize = 1024;

/// What `crust capabilities` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    pub verbs: Vec<String>,
}

impl Capabilities {
    /// What a CLI that cannot answer `capabilities` is taken to support.
    pub fn minimal() -> Capabilities {
        Capabilities {
            verbs: vec![VERB_RESIZE.into(), VERB_STATS.into()],
        }
    }

    pub fn supports(&self, verb: &str) -> bool {
        self.verbs.iter().any(|v| v == verb)
    }

    pub fn parse(out: &[u8]) -> Result<Capabilities, String> {
        let c: Capabilities = serde_json::from_slice(trim(out))
            .map_err(|e| format!("not a capabilities object: {e}"))?;
        if c.verbs.len() > 64 || c.verbs.iter().any(|v| v.is_empty() || v.len() > 64) {
            return Err("implausible verb list".into());
        }
        Ok(c)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("serializable")
    }
}

/// A sandbox's state as its runtime establishes it from the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Its VM (or the shim creating it) may still have the devices.
    Running,
    /// Positive proof that nothing of it is left that could use a device.
    Stopped,
    /// Not known to the runtime (wrong root, never existed, record
    /// unreadable): could be running anywhere.
    Unknown,
}

/// What `crust sandbox-state <id>` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLiveness {
    pub sandbox_id: String,
    pub state: SandboxState,
    #[serde(default)]
    pub detail: String,
}

impl SandboxLiveness {
    pub fn new(sandbox_id: &str, state: SandboxState, detail: impl Into<String>) -> Self {
        SandboxLiveness {
            sandbox_id: sandbox_id.to_string(),
            state,
            detail: detail.into(),
        }
    }

    /// Strict: unknown keys, another sandbox's id or a bad id are refused
    /// (a confused CLI must not release a claim).
    pub fn parse(out: &[u8], expected_id: &str) -> Result<SandboxLiveness, String> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Wire {
            sandbox_id: String,
            state: SandboxState,
            #[serde(default)]
            detail: String,
        }
        let w: Wire = serde_json::from_slice(trim(out))
            .map_err(|e| format!("not a sandbox-state object: {e}"))?;
        check_sandbox_id(&w.sandbox_id)?;
        if w.sandbox_id != expected_id {
            return Err(format!(
                "it answered for sandbox {}, not {expected_id}",
                w.sandbox_id
            ));
        }
        let mut detail = w.detail;
        if detail.len() > MAX_DETAIL {
            let mut cut = MAX_DETAIL;
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            detail.truncate(cut);
        }
        detail.retain(|c| !c.is_control());
        Ok(SandboxLiveness {
            sandbox_id: w.sandbox_id,
            state: w.state,
            detail,
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("serializable")
    }
}

fn trim(b: &[u8]) -> &[u8] {
    let s = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let e = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(s, |i| i + 1);
    &b[s..e]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_forms() {
        let l = SandboxLiveness::new("sb1", SandboxState::Stopped, "QEMU pid 7 exited");
        assert_eq!(
            l.to_json(),
            r#"{"sandbox_id":"sb1","state":"stopped","detail":"QEMU pid 7 exited"}"#
        );
        assert_eq!(
            SandboxLiveness::parse(l.to_json().as_bytes(), "sb1").unwrap(),
            l
        );
        for bad in [
            r#"{"sandbox_id":"sb2","state":"stopped"}"#,
            r#"{"sandbox_id":"sb1","state":"dead"}"#,
            r#"{"sandbox_id":"sb1","state":"stopped","extra":1}"#,
            r#"{"sandbox_id":"../x","state":"stopped"}"#,
            "is not running",
            "",
        ] {
            assert!(
                SandboxLiveness::parse(bad.as_bytes(), "sb1").is_err(),
                "{bad}"
            );
        }
        let c = Capabilities::parse(br#"{"verbs":["capabilities","sandbox-state"]}"#).unwrap();
        assert!(c.supports(VERB_SANDBOX_STATE) && !c.supports(VERB_STATS));
        assert!(!Capabilities::minimal().supports(VERB_SANDBOX_STATE));
        assert!(Capabilities::parse(b"nope").is_err());
    }
}
