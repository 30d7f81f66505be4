//! The runtime CLI's JSON output. Stats are shaped like CSI
//! `NodeGetVolumeStatsResponse`; Kata's Go shim marshals the protobuf
//! struct with `omitempty`, so zero counts and the UNKNOWN unit may be
//! missing, and the unit is a number. protojson spellings (camelCase,
//! int64 as decimal strings, enum names) are accepted too.

use serde_json::{Map, Value};

/// CSI `VolumeUsage.Unit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageUnit {
    Unknown,
    Bytes,
    Inodes,
}

/// One CSI `VolumeUsage`. Values fit in i64 (the wire type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeUsage {
    pub unit: UsageUnit,
    pub available: u64,
    pub total: u64,
    pub used: u64,
}

/// CSI `VolumeCondition`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeCondition {
    pub abnormal: bool,
    pub message: String,
}

/// What `RuntimeGetVolumeStats` returns.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VolumeStats {
    pub usage: Vec<VolumeUsage>,
    pub condition: Option<VolumeCondition>,
}

impl VolumeStats {
    /// The usage entry of one unit, if reported.
    pub fn get(&self, unit: UsageUnit) -> Option<&VolumeUsage> {
        self.usage.iter().find(|u| u.unit == unit)
    }
}

/// Longest condition message kept (the rest is cut).
const MAX_MESSAGE: usize = 1024;

/// Parses stats output. What is not a stats answer is an error, never a
/// healthy volume: an error object (`{"code": "NOT_FOUND", ...}`, which
/// Kata's CLI prints with exit status 0 when its shim fails), and output
/// without usage, unless it reports an abnormal condition (a runtime
/// saying the sandbox is gone has no figures to give).
pub fn parse_stats(out: &[u8]) -> Result<VolumeStats, String> {
    let obj = parse_object(out)?;
    if let Some(code) = obj.get("code") {
        let code = match code {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let message = obj
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("no message");
        return Err(format!("the runtime answered an error: {code}: {message}"));
    }
    let stats = parse_stats_fields(&obj)?;
    let abnormal = stats.condition.as_ref().is_some_and(|c| c.abnormal);
    if stats.usage.is_empty() && !abnormal {
        return Err("no usage and no abnormal condition: not a stats answer".into());
    }
    Ok(stats)
}

fn parse_stats_fields(obj: &Map<String, Value>) -> Result<VolumeStats, String> {
    let usage = match obj.get("usage") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| parse_usage(v).map_err(|e| format!("usage[{i}]: {e}")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err("\"usage\" is not an array".into()),
    };
    let condition = match field(obj, "volume_condition", "volumeCondition") {
        None | Some(Value::Null) => None,
        Some(Value::Object(c)) => {
            let abnormal = match c.get("abnormal") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err("volume_condition.abnormal is not a boolean".into()),
            };
            let mut message = match c.get("message") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(_) => return Err("volume_condition.message is not a string".into()),
            };
            if message.len() > MAX_MESSAGE {
                let mut cut = MAX_MESSAGE;
                while !message.is_char_boundary(cut) {
                    cut -= 1;
                }
                message.truncate(cut);
            }
            Some(VolumeCondition { abnormal, message })
        }
        Some(_) => return Err("\"volume_condition\" is not an object".into()),
    };
    Ok(VolumeStats { usage, condition })
}

/// `{"capacity_bytes": N}`.
pub fn parse_resize(out: &[u8]) -> Result<u64, String> {
    let obj = parse_object(out)?;
    match field(&obj, "capacity_bytes", "capacityBytes") {
        None | Some(Value::Null) => Err("\"capacity_bytes\" is missing".into()),
        Some(v) => count(v).map_err(|e| format!("capacity_bytes: {e}")),
    }
}

fn parse_object(out: &[u8]) -> Result<Map<String, Value>, String> {
    if out.iter().all(u8::is_ascii_whitespace) {
        return Err("no output".into());
    }
    match serde_json::from_slice::<Value>(out) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("not a JSON object".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

fn field<'a>(obj: &'a Map<String, Value>, snake: &str, camel: &str) -> Option<&'a Value> {
    obj.get(snake).or_else(|| obj.get(camel))
}

fn parse_usage(v: &Value) -> Result<VolumeUsage, String> {
    let Value::Object(o) = v else {
        return Err("not an object".into());
    };
    let get = |k: &str| match o.get(k) {
        None | Some(Value::Null) => Ok(0),
        Some(v) => count(v).map_err(|e| format!("{k}: {e}")),
    };
    let unit = match o.get("unit") {
        None | Some(Value::Null) => UsageUnit::Unknown,
        Some(Value::Number(n)) => match n.as_u64() {
            Some(0) => UsageUnit::Unknown,
            Some(1) => UsageUnit::Bytes,
            Some(2) => UsageUnit::Inodes,
            _ => return Err(format!("unit {n} is not 0, 1 or 2")),
        },
        Some(Value::String(s)) => match s.as_str() {
            "UNKNOWN" => UsageUnit::Unknown,
            "BYTES" => UsageUnit::Bytes,
            "INODES" => UsageUnit::Inodes,
            other => return Err(format!("unit {other:?} is not UNKNOWN, BYTES or INODES")),
        },
        Some(_) => return Err("unit is neither a number nor a string".into()),
    };
    Ok(VolumeUsage {
        unit,
        available: get("available")?,
        total: get("total")?,
        used: get("used")?,
    })
}

/// A non-negative integer that fits the wire's int64: a JSON integer or a
/// decimal string (protojson's int64 spelling). Floats, negatives and
/// anything else are refused.
fn count(v: &Value) -> Result<u64, String> {
    let n = match v {
        Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| format!("{n} is not a non-negative integer"))?,
        Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => s
            .parse::<u64>()
            .map_err(|_| format!("{s:?} is out of range"))?,
        other => return Err(format!("{other} is not a non-negative integer")),
    };
    if n > i64::MAX as u64 {
        return Err(format!("{n} does not fit in int64"));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_crust_shape() {
        let out = br#"{"usage":[{"available":10,"total":30,"used":20,"unit":"BYTES"},{"available":5,"total":9,"used":4,"unit":"INODES"}],"volume_condition":{"abnormal":false,"message":"ok"}}
"#;
        let s = parse_stats(out).unwrap();
        assert_eq!(
            s.get(UsageUnit::Bytes),
            Some(&VolumeUsage {
                unit: UsageUnit::Bytes,
                available: 10,
                total: 30,
                used: 20
            })
        );
        assert_eq!(s.get(UsageUnit::Inodes).unwrap().total, 9);
        assert_eq!(
            s.condition,
            Some(VolumeCondition {
                abnormal: false,
                message: "ok".into()
            })
        );
    }

    #[test]
    fn stats_kata_go_shape() {
        // Go's json.Marshal of the agent's VolumeStatsResponse: numeric
        // enum, zero fields omitted.
        let out = br#"{"usage":[{"available":1000,"total":2000,"used":1000,"unit":1},{"total":128,"unit":2}],"volume_condition":{"message":"healthy"}}"#;
        let s = parse_stats(out).unwrap();
        assert_eq!(s.get(UsageUnit::Bytes).unwrap().used, 1000);
        let inodes = s.get(UsageUnit::Inodes).unwrap();
        assert_eq!((inodes.available, inodes.used, inodes.total), (0, 0, 128));
        assert!(!s.condition.unwrap().abnormal);
    }

    #[test]
    fn stats_protojson_shape() {
        let out = br#"{"usage":[{"available":"7","total":"9","used":"2","unit":"BYTES"}],"volumeCondition":{"abnormal":true,"message":"I/O errors"}}"#;
        let s = parse_stats(out).unwrap();
        assert_eq!(s.usage[0].available, 7);
        assert!(s.condition.unwrap().abnormal);
        // Abnormal without figures is an answer (the sandbox is gone).
        let s = parse_stats(
            br#"{"volume_condition":{"abnormal":true,"message":"sandbox x is not running"}}"#,
        )
        .unwrap();
        assert!(s.usage.is_empty() && s.condition.unwrap().abnormal);
    }

    #[test]
    fn stats_garbage_is_refused() {
        for (out, why) in [
            (&b""[..], "no output"),
            (b"  \n", "no output"),
            (b"hello", "not JSON"),
            (b"[1,2]", "not a JSON object"),
            (b"{\"usage\":{}}", "not an array"),
            (b"{\"usage\":[1]}", "not an object"),
            (
                br#"{"usage":[{"total":-1,"unit":1}]}"#,
                "not a non-negative integer",
            ),
            (
                br#"{"usage":[{"total":1.5,"unit":1}]}"#,
                "not a non-negative integer",
            ),
            (
                br#"{"usage":[{"total":"-1","unit":1}]}"#,
                "not a non-negative integer",
            ),
            (
                br#"{"usage":[{"total":"12a","unit":1}]}"#,
                "not a non-negative integer",
            ),
            (
                br#"{"usage":[{"total":9223372036854775808,"unit":1}]}"#,
                "int64",
            ),
            (br#"{"usage":[{"total":1,"unit":3}]}"#, "unit 3"),
            (
                br#"{"usage":[{"total":1,"unit":"bytes"}]}"#,
                "unit \"bytes\"",
            ),
            (br#"{"usage":[{"total":1,"unit":true}]}"#, "neither"),
            (br#"{"volume_condition":{"abnormal":"no"}}"#, "boolean"),
            (br#"{"volume_condition":{"message":5}}"#, "string"),
            (br#"{"volume_condition":[]}"#, "not an object"),
            (br#"{"usage":[]} {"usage":[]}"#, "not JSON"),
        ] {
            let e = parse_stats(out).unwrap_err();
            assert!(e.contains(why), "{}: {e}", String::from_utf8_lossy(out));
        }
        assert_eq!(
            parse_stats(br#"{"usage":[{"total":9223372036854775807,"unit":1}]}"#)
                .unwrap()
                .usage[0]
                .total,
            i64::MAX as u64
        );
    }

    /// What Kata's CLI prints, exit status 0, when the shim fails or the
    /// claim is wrong: never a healthy volume.
    #[test]
    fn error_answers_and_empty_stats_are_errors() {
        for (out, why) in [
            (
                &br#"{"code":"NOT_FOUND","message":"no volume /dev/loop9 in sandbox s1"}"#[..],
                "answered an error: NOT_FOUND: no volume /dev/loop9",
            ),
            (
                br#"{"code":5,"message":"not found"}"#,
                "answered an error: 5",
            ),
            (
                br#"{"code":"INTERNAL","message":"x","usage":[{"total":1,"unit":1}]}"#,
                "INTERNAL",
            ),
            (b"{}", "no usage"),
            (br#"{"usage":[]}"#, "no usage"),
            (br#"{"volume_condition":{"message":"OK"}}"#, "no usage"),
            (
                br#"{"usage":null,"volume_condition":{"abnormal":false}}"#,
                "no usage",
            ),
            // Kata's Go shim answers plain text on errors.
            (b"stat /dev/loop9: no such file or directory", "not JSON"),
        ] {
            let e = parse_stats(out).unwrap_err();
            assert!(e.contains(why), "{}: {e}", String::from_utf8_lossy(out));
        }
    }

    #[test]
    fn long_condition_messages_are_cut() {
        let msg = "é".repeat(1000);
        let out = format!(r#"{{"volume_condition":{{"abnormal":true,"message":"{msg}"}}}}"#);
        let c = parse_stats(out.as_bytes()).unwrap().condition.unwrap();
        assert!(c.message.len() <= MAX_MESSAGE && c.message.len() >= MAX_MESSAGE - 1);
    }

    #[test]
    fn resize_output() {
        assert_eq!(
            parse_resize(b"{\"capacity_bytes\":1073741824}\n").unwrap(),
            1 << 30
        );
        assert_eq!(parse_resize(br#"{"capacityBytes":"4096"}"#).unwrap(), 4096);
        for (out, why) in [
            (&b"{}"[..], "missing"),
            (b"", "no output"),
            (b"ok", "not JSON"),
            (br#"{"capacity_bytes":-5}"#, "non-negative"),
            (br#"{"capacity_bytes":"big"}"#, "non-negative"),
        ] {
            let e = parse_resize(out).unwrap_err();
            assert!(e.contains(why), "{}: {e}", String::from_utf8_lossy(out));
        }
    }
}
