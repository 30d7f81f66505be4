//! JSON shapes of the stats and resize protocols: CSI
//! `NodeGetVolumeStatsResponse` (the KEP's `crust stats` output, Kata's
//! agent `VolumeStatsResponse`), `{"capacity_bytes": N}`, and the shim's
//! resize request in every spelling Kata has used.

use serde::{Deserialize, Serialize};

/// CSI `VolumeUsage.Unit`. Written by name (`"BYTES"`, the KEP CLI's
/// output); read by name or by Kata's number (1 = BYTES, 2 = INODES).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(try_from = "UnitRepr")]
pub enum Unit {
    #[serde(rename = "UNKNOWN")]
    #[default]
    Unknown,
    #[serde(rename = "BYTES")]
    Bytes,
    #[serde(rename = "INODES")]
    Inodes,
}

impl Unit {
    /// The protobuf enum number Kata's Go shim writes.
    pub fn number(self) -> u8 {
        match self {
            Unit::Unknown => 0,
            Unit::Bytes => 1,
            Unit::Inodes => 2,
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum UnitRepr {
    Num(u64),
    Name(String),
}

impl TryFrom<UnitRepr> for Unit {
    type Error = String;
    fn try_from(r: UnitRepr) -> Result<Unit, String> {
        match r {
            UnitRepr::Num(0) => Ok(Unit::Unknown),
            UnitRepr::Num(1) => Ok(Unit::Bytes),
            UnitRepr::Num(2) => Ok(Unit::Inodes),
            UnitRepr::Name(n) if n == "UNKNOWN" => Ok(Unit::Unknown),
            UnitRepr::Name(n) if n == "BYTES" => Ok(Unit::Bytes),
            UnitRepr::Name(n) if n == "INODES" => Ok(Unit::Inodes),
            UnitRepr::Num(n) => Err(format!("unit {n} is not 0, 1 or 2")),
            UnitRepr::Name(n) => Err(format!("unit {n:?} is not UNKNOWN, BYTES or INODES")),
        }
    }
}

/// Fields Kata's Go shim leaves out when zero are optional on input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeUsage {
    #[serde(default)]
    pub available: u64,
    #[serde(default)]
    pub total: u64,
    #[serde(default)]
    pub used: u64,
    #[serde(default)]
    pub unit: Unit,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct VolumeCondition {
    #[serde(default)]
    pub abnormal: bool,
    #[serde(default)]
    pub message: String,
}

/// `NodeGetVolumeStatsResponse` as JSON: the KEP CLI's spelling on output
/// (every field, units by name); Kata's spelling too on input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeStats {
    #[serde(default)]
    pub usage: Vec<VolumeUsage>,
    #[serde(default)]
    pub volume_condition: VolumeCondition,
}

/// Raw `statvfs` figures of a filesystem (as the guest reports them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsFigures {
    /// Fragment size: the unit of the block counts.
    pub frsize: u64,
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
}

impl VolumeStats {
    /// What `df` and `df -i` show: used = total - free (so reserved blocks
    /// count as used), available = what an unprivileged writer gets.
    pub fn from_figures(f: &FsFigures, message: impl Into<String>) -> VolumeStats {
        VolumeStats {
            usage: vec![
                VolumeUsage {
                    available: f.bavail.saturating_mul(f.frsize),
                    total: f.blocks.saturating_mul(f.frsize),
                    used: f.blocks.saturating_sub(f.bfree).saturating_mul(f.frsize),
                    unit: Unit::Bytes,
                },
                VolumeUsage {
                    available: f.ffree,
                    total: f.files,
                    used: f.files.saturating_sub(f.ffree),
                    unit: Unit::Inodes,
                },
            ],
            volume_condition: VolumeCondition {
                abnormal: false,
                message: message.into(),
            },
        }
    }

    /// No figures, only the condition.
    pub fn abnormal(message: impl Into<String>) -> VolumeStats {
        VolumeStats {
            usage: Vec::new(),
            volume_condition: VolumeCondition {
                abnormal: true,
                message: message.into(),
            },
        }
    }

    pub fn usage(&self, unit: Unit) -> Option<&VolumeUsage> {
        self.usage.iter().find(|u| u.unit == unit)
    }

    /// The bytes Kata's Go shim answers `/direct-volume/stats` with: Go's
    /// `json.Marshal` of the agent's `VolumeStatsResponse` (protobuf
    /// struct tags with `omitempty`): units as numbers, zero counts, a false
    /// `abnormal` and an empty message left out, declaration order.
    pub fn to_kata_json(&self) -> String {
        let mut o = String::from("{");
        if !self.usage.is_empty() {
            o.push_str("\"usage\":[");
            for (i, u) in self.usage.iter().enumerate() {
                if i > 0 {
                    o.push(',');
                }
                let mut fields = Vec::new();
                for (k, v) in [
                    ("available", u.available),
                    ("total", u.total),
                    ("used", u.used),
                    ("unit", u64::from(u.unit.number())),
                ] {
                    if v != 0 {
                        fields.push(format!("\"{k}\":{v}"));
                    }
                }
                o.push('{');
                o.push_str(&fields.join(","));
                o.push('}');
            }
            o.push_str("],");
        }
        let c = &self.volume_condition;
        let mut fields = Vec::new();
        if c.abnormal {
            fields.push("\"abnormal\":true".to_string());
        }
        if !c.message.is_empty() {
            fields.push(format!(
                "\"message\":{}",
                serde_json::to_string(&c.message).expect("a string serializes")
            ));
        }
        o.push_str("\"volume_condition\":{");
        o.push_str(&fields.join(","));
        o.push_str("}}");
        o
    }
}

// The request and answer bodies of the shim API's volume calls live
// with the API's other wire types.
pub use crust_shim_api::{
    FreezeRequest, ResizeRequest, ResizeResponse, ThawRequest, ThawResponse, ThrottleRequest,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_json_shape() {
        let f = FsFigures {
            frsize: 4096,
            blocks: 100,
            bfree: 40,
            bavail: 30,
            files: 64,
            ffree: 50,
        };
        let s = VolumeStats::from_figures(&f, "ok");
        let v: serde_json::Value = serde_json::to_value(&s).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "usage": [
                    {"available": 30 * 4096, "total": 100 * 4096, "used": 60 * 4096, "unit": "BYTES"},
                    {"available": 50, "total": 64, "used": 14, "unit": "INODES"}
                ],
                "volume_condition": {"abnormal": false, "message": "ok"}
            })
        );
        assert_eq!(serde_json::from_value::<VolumeStats>(v).unwrap(), s);
        assert_eq!(s.usage(Unit::Inodes).unwrap().used, 14);
    }

    #[test]
    fn kata_shim_spelling_out_and_both_spellings_in() {
        let f = FsFigures {
            frsize: 4096,
            blocks: 100,
            bfree: 100,
            bavail: 90,
            files: 64,
            ffree: 64,
        };
        let s = VolumeStats::from_figures(&f, "OK");
        // What Kata's Go shim writes for the same figures (used 0 omitted).
        let kata = s.to_kata_json();
        assert_eq!(
            kata,
            r#"{"usage":[{"available":368640,"total":409600,"unit":1},{"available":64,"total":64,"unit":2}],"volume_condition":{"message":"OK"}}"#
        );
        let back: VolumeStats = serde_json::from_str(&kata).unwrap();
        assert_eq!(back, s);
        let ab = VolumeStats::abnormal("sandbox x is not running");
        assert_eq!(
            ab.to_kata_json(),
            r#"{"volume_condition":{"abnormal":true,"message":"sandbox x is not running"}}"#
        );
        assert_eq!(
            serde_json::from_str::<VolumeStats>(&ab.to_kata_json()).unwrap(),
            ab
        );
        for bad in [
            r#"{"usage":[{"unit":3}]}"#,
            r#"{"usage":[{"unit":"bytes"}]}"#,
        ] {
            assert!(serde_json::from_str::<VolumeStats>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn resize_request_spellings() {
        for body in [
            r#"{"volumePath":"/p","size":123}"#,
            r#"{"VolumePath":"/p","Size":123}"#,
            r#"{"volume_guest_path":"/p","size":123}"#,
            r#"{"volumePath":"/p","Size":"123"}"#,
        ] {
            let r: ResizeRequest = serde_json::from_str(body).unwrap();
            assert_eq!(
                (r.volume_path.as_str(), r.size, r.max_bytes),
                ("/p", 123, None),
                "{body}"
            );
        }
        let r: ResizeRequest =
            serde_json::from_str(r#"{"volumePath":"/p","size":1,"maxBytes":"9"}"#).unwrap();
        assert_eq!(r.max_bytes, Some(9));
        for bad in [
            r#"{"volumePath":"/p"}"#,
            r#"{"size":1}"#,
            r#"{"volumePath":"/p","size":-1}"#,
            r#"{"volumePath":"/p","size":"12x"}"#,
            r#"{"volumePath":"/p","size":1,"other":2}"#,
            r#"{"volumePath":"/p","VolumePath":"/q","size":1}"#,
        ] {
            assert!(serde_json::from_str::<ResizeRequest>(bad).is_err(), "{bad}");
        }
    }
}
