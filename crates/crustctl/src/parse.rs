//! Parsers for command-line values: `key=value` pairs and
//! fsGroupChangePolicy (sizes and durations: `crust_report::units`). They
//! return plain `String` errors so clap shows them
//! as usage errors.

use std::collections::HashMap;

use crust_handoff::FsGroupChangePolicy;

/// One `key=value` pair. The key must be non-empty; the value may be empty
/// and may itself contain `=`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: String,
}

pub fn parse_key_value(s: &str) -> Result<KeyValue, String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("expected key=value, got {s:?}"))?;
    if k.trim().is_empty() {
        return Err(format!(
            "expected key=value with a non-empty key, got {s:?}"
        ));
    }
    Ok(KeyValue {
        key: k.to_string(),
        value: v.to_string(),
    })
}

/// Collects pairs into a map; a key given twice is an error (which of the
/// two the user meant is not ours to guess). `what` names the flag.
pub fn to_map(pairs: &[KeyValue], what: &str) -> Result<HashMap<String, String>, String> {
    let mut m = HashMap::with_capacity(pairs.len());
    for kv in pairs {
        if m.insert(kv.key.clone(), kv.value.clone()).is_some() {
            return Err(format!("{what}: key {:?} given more than once", kv.key));
        }
    }
    Ok(m)
}

/// Parses Kubernetes' fsGroupChangePolicy (`Always`, `OnRootMismatch`),
/// in any letter case as kubectl users type it.
pub fn parse_change_policy(s: &str) -> Result<FsGroupChangePolicy, String> {
    [
        FsGroupChangePolicy::Always,
        FsGroupChangePolicy::OnRootMismatch,
    ]
    .into_iter()
    .find(|p| p.as_str().eq_ignore_ascii_case(s))
    .ok_or_else(|| format!("{s:?}: expected Always or OnRootMismatch"))
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn change_policies() {
        for (s, p) in [
            ("Always", FsGroupChangePolicy::Always),
            ("onrootmismatch", FsGroupChangePolicy::OnRootMismatch),
            ("OnRootMismatch", FsGroupChangePolicy::OnRootMismatch),
        ] {
            assert_eq!(parse_change_policy(s).unwrap(), p, "{s}");
        }
        for bad in ["", "Never", "OnRoot"] {
            let e = parse_change_policy(bad).unwrap_err();
            assert!(e.contains("Always or OnRootMismatch"), "{bad}: {e}");
        }
    }

    #[test]
    fn key_values() {
        assert_eq!(
            parse_key_value("a=b").unwrap(),
            KeyValue {
                key: "a".into(),
                value: "b".into()
            }
        );
        let kv = parse_key_value("opt=x=y").unwrap();
        assert_eq!((kv.key.as_str(), kv.value.as_str()), ("opt", "x=y"));
        let kv = parse_key_value("empty=").unwrap();
        assert_eq!((kv.key.as_str(), kv.value.as_str()), ("empty", ""));
        assert!(parse_key_value("novalue").is_err());
        assert!(parse_key_value("=v").is_err());
        let pairs = vec![
            parse_key_value("a=1").unwrap(),
            parse_key_value("b=2").unwrap(),
        ];
        let m = to_map(&pairs, "--param").unwrap();
        assert_eq!(m["a"], "1");
        assert_eq!(m["b"], "2");
        let dup = vec![
            parse_key_value("a=1").unwrap(),
            parse_key_value("a=2").unwrap(),
        ];
        let err = to_map(&dup, "--param").unwrap_err();
        assert!(err.contains("--param") && err.contains("\"a\""), "{err}");
    }
}
