//! A volume's I/O limits (QoS): the one reading of the CSI mutable
//! parameters that set them, and their form in a hand-off record.
//!
//! Keys (CSI `mutable_parameters`, VolumeAttributesClass `parameters`),
//! each a decimal integer, `0` or absent = unlimited:
//!
//! | key | QMP `block_set_io_throttle` field |
//! |---|---|
//! | `iops` | `iops` (reads + writes) |
//! | `readIops` / `writeIops` | `iops_rd` / `iops_wr` |
//! | `bps` | `bps` (bytes per second, reads + writes) |
//! | `readBps` / `writeBps` | `bps_rd` / `bps_wr` |
//! | `iopsBurst`, `readIopsBurst`, `writeIopsBurst` | `iops_max`, `iops_rd_max`, `iops_wr_max` |
//! | `bpsBurst`, `readBpsBurst`, `writeBpsBurst` | `bps_max`, `bps_rd_max`, `bps_wr_max` |
//! | `burstSeconds` | every set burst's `*_max_length` (QEMU's default: 1) |
//!
//! A total and its read/write split exclude each other (QEMU refuses
//! both at once). A burst is the rate a volume may reach for
//! `burstSeconds` after it ran below its limit (a token bucket): it needs
//! its limit and is at least that limit, as QEMU requires. The plugin records the limits with the volume and puts
//! them in the hand-off record's metadata under [`IO_LIMITS_KEY`], where
//! the runtime reads them at every plug; a change reaches a running guest
//! through the runtime CLI's `crust throttle`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Metadata key of a hand-off record holding [`IoLimits::to_wire`].
pub const IO_LIMITS_KEY: &str = "ioLimits";

/// QEMU's own ceiling for a throttle value (`THROTTLE_VALUE_MAX`).
pub const MAX_LIMIT: u64 = 1_000_000_000_000_000;

/// The keys, in wire order.
pub const KEYS: [&str; 13] = [
    "iops",
    "readIops",
    "writeIops",
    "bps",
    "readBps",
    "writeBps",
    "iopsBurst",
    "readIopsBurst",
    "writeIopsBurst",
    "bpsBurst",
    "readBpsBurst",
    "writeBpsBurst",
    "burstSeconds",
];

/// Each burst key with the limit it raises.
const BURSTS: [(&str, &str); 6] = [
    ("iopsBurst", "iops"),
    ("readIopsBurst", "readIops"),
    ("writeIopsBurst", "writeIops"),
    ("bpsBurst", "bps"),
    ("readBpsBurst", "readBps"),
    ("writeBpsBurst", "writeBps"),
];

/// Why a set of limits is refused; the message names the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QosError {
    #[error("mutable parameter {key:?} is not known (known: {})", KEYS.join(", "))]
    UnknownKey { key: String },
    #[error("mutable parameter {key}={value:?} is not a decimal integer (0 = unlimited)")]
    NotANumber { key: String, value: String },
    #[error("mutable parameter {key}={value} exceeds {MAX_LIMIT}")]
    TooLarge { key: String, value: u64 },
    #[error(
        "mutable parameters {total} and {split} exclude each other: set the total or the read/write split"
    )]
    TotalAndSplit {
        total: &'static str,
        split: &'static str,
    },
    #[error("mutable parameter {burst} needs {limit}: a burst raises a limit for a while")]
    BurstWithoutLimit {
        burst: &'static str,
        limit: &'static str,
    },
    #[error("mutable parameter {burst}={value} is below {limit}={limit_value}")]
    BurstBelowLimit {
        burst: &'static str,
        value: u64,
        limit: &'static str,
        limit_value: u64,
    },
    #[error("mutable parameter burstSeconds needs a burst ({})", BURSTS.map(|b| b.0).join(", "))]
    SecondsWithoutBurst,
    #[error("mutable parameters {burst} × burstSeconds exceed {MAX_LIMIT}")]
    BurstTooLong { burst: &'static str },
}

/// Per-volume I/O limits; 0 = unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IoLimits {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_iops: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_iops: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_bps: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_bps: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops_burst: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_iops_burst: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_iops_burst: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps_burst: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_bps_burst: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_bps_burst: u64,
    /// How long a burst may last, in seconds (0: QEMU's 1 s).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub burst_seconds: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl IoLimits {
    /// No limit at all.
    pub fn is_unlimited(&self) -> bool {
        *self == IoLimits::default()
    }

    fn slot(&mut self, key: &str) -> Option<&mut u64> {
        Some(match key {
            "iops" => &mut self.iops,
            "readIops" => &mut self.read_iops,
            "writeIops" => &mut self.write_iops,
            "bps" => &mut self.bps,
            "readBps" => &mut self.read_bps,
            "writeBps" => &mut self.write_bps,
            "iopsBurst" => &mut self.iops_burst,
            "readIopsBurst" => &mut self.read_iops_burst,
            "writeIopsBurst" => &mut self.write_iops_burst,
            "bpsBurst" => &mut self.bps_burst,
            "readBpsBurst" => &mut self.read_bps_burst,
            "writeBpsBurst" => &mut self.write_bps_burst,
            "burstSeconds" => &mut self.burst_seconds,
            _ => return None,
        })
    }

    fn values(&self) -> [u64; 13] {
        [
            self.iops,
            self.read_iops,
            self.write_iops,
            self.bps,
            self.read_bps,
            self.write_bps,
            self.iops_burst,
            self.read_iops_burst,
            self.write_iops_burst,
            self.bps_burst,
            self.read_bps_burst,
            self.write_bps_burst,
            self.burst_seconds,
        ]
    }

    fn value(&self, key: &str) -> u64 {
        KEYS.iter()
            .position(|k| *k == key)
            .map_or(0, |i| self.values()[i])
    }

    /// These limits with `params` laid over them (a key given replaces
    /// its value, `0` lifts it), checked as a whole. The one rule every
    /// door uses: CreateVolume, ControllerModifyVolume, a record's reader.
    pub fn merged<'a>(
        &self,
        params: impl IntoIterator<Item = (&'a String, &'a String)>,
    ) -> Result<IoLimits, QosError> {
        let mut out = *self;
        for (k, v) in params {
            let slot = out
                .slot(k)
                .ok_or_else(|| QosError::UnknownKey { key: k.clone() })?;
            let n = parse_value(k, v)?;
            *slot = n;
        }
        out.check()?;
        Ok(out)
    }

    /// Parses a full set of parameters.
    pub fn from_params(params: &BTreeMap<String, String>) -> Result<IoLimits, QosError> {
        IoLimits::default().merged(params)
    }

    fn check(&self) -> Result<(), QosError> {
        for (total, r, w, rn, wn) in [
            (
                "iops",
                self.read_iops,
                self.write_iops,
                "readIops",
                "writeIops",
            ),
            ("bps", self.read_bps, self.write_bps, "readBps", "writeBps"),
        ] {
            let t = if total == "iops" { self.iops } else { self.bps };
            if t != 0 && (r != 0 || w != 0) {
                let split = if r != 0 { rn } else { wn };
                return Err(QosError::TotalAndSplit { total, split });
            }
        }
        let mut any_burst = false;
        for (burst, limit) in BURSTS {
            let (b, l) = (self.value(burst), self.value(limit));
            if b == 0 {
                continue;
            }
            any_burst = true;
            if l == 0 {
                return Err(QosError::BurstWithoutLimit { burst, limit });
            }
            if b < l {
                return Err(QosError::BurstBelowLimit {
                    burst,
                    value: b,
                    limit,
                    limit_value: l,
                });
            }
            if self.burst_seconds > MAX_LIMIT / b {
                return Err(QosError::BurstTooLong { burst });
            }
        }
        if self.burst_seconds != 0 && !any_burst {
            return Err(QosError::SecondsWithoutBurst);
        }
        Ok(())
    }

    /// The metadata value: `key=value` pairs of the non-zero limits,
    /// comma-separated, in [`KEYS`] order (empty: unlimited).
    pub fn to_wire(&self) -> String {
        KEYS.iter()
            .zip(self.values())
            .filter(|(_, v)| *v != 0)
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Reads [`IoLimits::to_wire`]'s form, with the same checks as the
    /// parameters.
    pub fn from_wire(s: &str) -> Result<IoLimits, QosError> {
        let mut params = BTreeMap::new();
        for pair in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').ok_or_else(|| QosError::NotANumber {
                key: pair.to_string(),
                value: String::new(),
            })?;
            params.insert(k.to_string(), v.to_string());
        }
        IoLimits::from_params(&params)
    }

    /// The limits a hand-off record's metadata carries (none: unlimited).
    pub fn from_metadata(md: &BTreeMap<String, String>) -> Result<IoLimits, QosError> {
        md.get(IO_LIMITS_KEY)
            .map_or(Ok(IoLimits::default()), |v| IoLimits::from_wire(v))
    }
}

fn parse_value(key: &str, v: &str) -> Result<u64, QosError> {
    let bad = || QosError::NotANumber {
        key: key.to_string(),
        value: v.to_string(),
    };
    // Digits only: no sign, no spaces, no units.
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = v.parse().map_err(|_| QosError::TooLarge {
        key: key.to_string(),
        value: u64::MAX,
    })?;
    if n > MAX_LIMIT {
        return Err(QosError::TooLarge {
            key: key.to_string(),
            value: n,
        });
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parse_merge_and_wire() {
        let l = IoLimits::from_params(&p(&[("iops", "200"), ("writeBps", "1048576")])).unwrap();
        assert_eq!((l.iops, l.write_bps), (200, 1 << 20));
        assert_eq!(l.to_wire(), "iops=200,writeBps=1048576");
        assert_eq!(IoLimits::from_wire(&l.to_wire()).unwrap(), l);
        // 0 lifts a limit; other keys stay.
        let m = l.merged(&p(&[("iops", "0")])).unwrap();
        assert_eq!(m.to_wire(), "writeBps=1048576");
        assert!(m.merged(&p(&[("writeBps", "0")])).unwrap().is_unlimited());
        assert_eq!(IoLimits::from_wire("").unwrap(), IoLimits::default());
    }

    #[test]
    fn refusals_name_the_key() {
        let e = |pairs: &[(&str, &str)]| IoLimits::from_params(&p(pairs)).unwrap_err();
        assert!(
            matches!(e(&[("XXX_FakeKey", "1")]), QosError::UnknownKey { key } if key == "XXX_FakeKey")
        );
        for v in ["", "-1", "+5", " 5", "1e3", "12k", "1.5"] {
            assert!(
                matches!(e(&[("iops", v)]), QosError::NotANumber { .. }),
                "{v:?}"
            );
        }
        assert!(matches!(
            e(&[("bps", "1000000000000001")]),
            QosError::TooLarge { .. }
        ));
        assert!(matches!(
            e(&[("bps", "99999999999999999999999")]),
            QosError::TooLarge { .. }
        ));
        assert_eq!(
            e(&[("iops", "5"), ("writeIops", "3")]),
            QosError::TotalAndSplit {
                total: "iops",
                split: "writeIops"
            }
        );
        // A merge that would combine a recorded total with a new split.
        let l = IoLimits::from_params(&p(&[("bps", "100")])).unwrap();
        assert!(l.merged(&p(&[("readBps", "1")])).is_err());
        assert!(l.merged(&p(&[("bps", "0"), ("readBps", "1")])).is_ok());
    }

    #[test]
    fn bursts_raise_a_set_limit_for_a_while() {
        let l = IoLimits::from_params(&p(&[
            ("iops", "100"),
            ("iopsBurst", "400"),
            ("burstSeconds", "5"),
            ("writeBps", "1000"),
            ("writeBpsBurst", "1000"),
        ]))
        .unwrap();
        assert_eq!(
            (l.iops_burst, l.burst_seconds, l.write_bps_burst),
            (400, 5, 1000)
        );
        assert_eq!(
            l.to_wire(),
            "iops=100,writeBps=1000,iopsBurst=400,writeBpsBurst=1000,burstSeconds=5"
        );
        assert_eq!(IoLimits::from_wire(&l.to_wire()).unwrap(), l);
        let e = |pairs: &[(&str, &str)]| IoLimits::from_params(&p(pairs)).unwrap_err();
        assert_eq!(
            e(&[("iopsBurst", "10")]),
            QosError::BurstWithoutLimit {
                burst: "iopsBurst",
                limit: "iops"
            }
        );
        assert_eq!(
            e(&[("readBps", "10"), ("readBpsBurst", "9")]),
            QosError::BurstBelowLimit {
                burst: "readBpsBurst",
                value: 9,
                limit: "readBps",
                limit_value: 10
            }
        );
        assert_eq!(
            e(&[("iops", "10"), ("burstSeconds", "3")]),
            QosError::SecondsWithoutBurst
        );
        assert_eq!(
            e(&[
                ("bps", "10"),
                ("bpsBurst", "1000000000000"),
                ("burstSeconds", "1000000")
            ]),
            QosError::BurstTooLong { burst: "bpsBurst" }
        );
        // Lifting a limit without its burst is refused: nothing half-set.
        assert!(matches!(
            l.merged(&p(&[("iops", "0")])),
            Err(QosError::BurstWithoutLimit { .. })
        ));
        assert!(
            l.merged(&p(&[
                ("iops", "0"),
                ("iopsBurst", "0"),
                ("burstSeconds", "0")
            ]))
            .is_ok()
        );
    }
}
