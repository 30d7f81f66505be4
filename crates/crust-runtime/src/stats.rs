//! JSON shapes of the stats and resize protocols: CSI
//! `NodeGetVolumeStatsResponse` (the KEP's `crust stats` output, Kata's
//! agent `VolumeStatsResponse`), `{"capacity_bytes": N}`, and the shim's
//! resize request in every spelling Kata has used.

use serde::{Deserialize, Deserializer, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unit {
    #[serde(rename = "UNKNOWN")]
    Unknown,
    #[serde(rename = "BYTES")]
    Bytes,
    #[serde(rename = "INODES")]
    Inodes,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeUsage {
    pub available: u64,
    pub total: u64,
    pub used: u64,
    pub unit: Unit,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeCondition {
    pub abnormal: bool,
    pub message: String,
}

/// `NodeGetVolumeStatsResponse` as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeStats {
    pub usage: Vec<VolumeUsage>,
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
}

/// `{"capacity_bytes": N}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResizeResponse {
    pub capacity_bytes: u64,
}

/// The shim's resize request. `volumePath` (the KEP/crust spelling and one
/// of Kata's), `VolumePath`, or `volume_guest_path` (Kata's agent proto);
/// `size` or `Size`, as a number or a decimal string (Kata's curl example
/// quotes it). `maxBytes` is a crust extension: refuse to grow beyond it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    #[serde(
        rename = "volumePath",
        alias = "VolumePath",
        alias = "volume_guest_path"
    )]
    pub volume_path: String,
    #[serde(alias = "Size", deserialize_with = "u64_or_string")]
    pub size: u64,
    #[serde(
        rename = "maxBytes",
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "opt_u64_or_string"
    )]
    pub max_bytes: Option<u64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    Num(u64),
    Str(String),
}

impl NumOrStr {
    fn into_u64<E: serde::de::Error>(self) -> Result<u64, E> {
        match self {
            NumOrStr::Num(n) => Ok(n),
            NumOrStr::Str(s) => s
                .parse::<u64>()
                .map_err(|_| E::custom(format!("size {s:?} is not a non-negative integer"))),
        }
    }
}

fn u64_or_string<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    NumOrStr::deserialize(d)?.into_u64()
}

fn opt_u64_or_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<NumOrStr>::deserialize(d)?
        .map(NumOrStr::into_u64)
        .transpose()
}

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
