//! `mountInfo.json`: Kata's `MountInfo` with Kata's keys, in Kata's order,
//! encoded the way Go's `encoding/json` does it.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

pub const FS_GROUP_KEY: &str = "fsGroup";
pub const FS_GROUP_CHANGE_POLICY_KEY: &str = "fsGroupChangePolicy";
/// Kata: format the device when it holds no filesystem yet.
pub const CREATE_FILESYSTEM_KEY: &str = "createFilesystem";
/// Kata: encrypt the volume with this key. crust refuses it.
pub const ENCRYPTION_KEY_KEY: &str = "encryptionKey";
/// crust's own key: what proves the device is the one the record was
/// written for ([`crust_blockdev::DeviceIdentity`]'s text form), checked
/// at every plug. Kata ignores metadata it does not know; a crust older
/// than this key refuses records that carry it (upgrade every node's
/// runtime before its plugin).
pub const DEVICE_IDENTITY_KEY: &str = "deviceIdentity";

/// The volume type of a CRUST-layout record (the KEP's examples).
pub const VOLUME_TYPE_BLOCK: &str = "block";
/// The volume type of a Kata-layout record: Kata's Rust runtime (runtime-rs,
/// `RawblockVolume::new`) refuses any other for a block or file device;
/// Kata's Go runtime never reads the field. Kata's CSI driver and Azure
/// Disk write it too.
pub const VOLUME_TYPE_DIRECTVOL: &str = "directvol";

/// What the runtime needs to mount a volume inside the guest.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MountInfo {
    pub volume_type: String,
    pub device: String,
    pub fstype: String,
    pub metadata: BTreeMap<String, String>,
    pub options: Vec<String>,
}

/// Kubernetes' `fsGroupChangePolicy`, spelled as Kata stores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsGroupChangePolicy {
    Always,
    OnRootMismatch,
}

impl FsGroupChangePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            FsGroupChangePolicy::Always => "Always",
            FsGroupChangePolicy::OnRootMismatch => "OnRootMismatch",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "Always" => Ok(FsGroupChangePolicy::Always),
            "OnRootMismatch" => Ok(FsGroupChangePolicy::OnRootMismatch),
            other => Err(format!(
                "fsGroupChangePolicy {other:?} is not Always or OnRootMismatch"
            )),
        }
    }
}

impl MountInfo {
    /// Whether this record (on disk) already says what `wanted` says: the
    /// same, or the same but for the device identity an older crust could
    /// not write (a republish after an upgrade keeps that record, and the
    /// sandbox holding it).
    pub fn is_staged_as(&self, wanted: &MountInfo) -> bool {
        if self == wanted {
            return true;
        }
        if self.metadata.contains_key(DEVICE_IDENTITY_KEY) {
            return false;
        }
        let mut without = wanted.clone();
        without.metadata.remove(DEVICE_IDENTITY_KEY);
        *self == without
    }

    /// A block volume with no metadata and no options.
    pub fn block(device: impl Into<String>, fstype: impl Into<String>) -> Self {
        MountInfo {
            volume_type: VOLUME_TYPE_BLOCK.into(),
            device: device.into(),
            fstype: fstype.into(),
            ..Default::default()
        }
    }

    /// The fsGroup, if set and valid.
    pub fn fs_group(&self) -> Option<u32> {
        self.metadata
            .get(FS_GROUP_KEY)
            .and_then(|v| parse_fs_group(v).ok())
    }

    pub fn set_fs_group(&mut self, gid: Option<u32>) {
        match gid {
            Some(g) => self.metadata.insert(FS_GROUP_KEY.into(), g.to_string()),
            None => self.metadata.remove(FS_GROUP_KEY),
        };
    }

    /// The fsGroup change policy, if set and valid.
    pub fn fs_group_change_policy(&self) -> Option<FsGroupChangePolicy> {
        self.metadata
            .get(FS_GROUP_CHANGE_POLICY_KEY)
            .and_then(|v| FsGroupChangePolicy::parse(v).ok())
    }

    pub fn set_fs_group_change_policy(&mut self, p: Option<FsGroupChangePolicy>) {
        match p {
            Some(p) => self
                .metadata
                .insert(FS_GROUP_CHANGE_POLICY_KEY.into(), p.as_str().into()),
            None => self.metadata.remove(FS_GROUP_CHANGE_POLICY_KEY),
        };
    }

    /// The exact bytes Go's `json.Marshal(&MountInfo{...})` produces:
    /// compact, declaration order, `omitempty` maps/slices left out, map
    /// keys sorted, HTML-safe string escaping.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(128);
        out.push_str("{\"volume-type\":");
        go_string(&mut out, &self.volume_type);
        out.push_str(",\"device\":");
        go_string(&mut out, &self.device);
        out.push_str(",\"fstype\":");
        go_string(&mut out, &self.fstype);
        if !self.metadata.is_empty() {
            out.push_str(",\"metadata\":{");
            for (i, (k, v)) in self.metadata.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                go_string(&mut out, k);
                out.push(':');
                go_string(&mut out, v);
            }
            out.push('}');
        }
        if !self.options.is_empty() {
            out.push_str(",\"options\":[");
            for (i, o) in self.options.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                go_string(&mut out, o);
            }
            out.push(']');
        }
        out.push('}');
        out
    }

    /// Parses a record the way Kata's Go runtime decodes it
    /// (`encoding/json` into its `MountInfo`): keys match case-insensitively
    /// (`"Device"` is `device`), unknown keys are ignored, `null` is the
    /// zero value (a missing `volume-type` is "", which validation reads as
    /// `block`, as Kata does). Stricter than Go
    /// where leniency would be ambiguous: a key given twice (in any case)
    /// is refused rather than "last one wins", and so is a record without
    /// `device` or `fstype`. Nesting deeper than Go's bound is refused as
    /// Go refuses it. Field values are checked separately.
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        // serde would also take a struct as a JSON array; Go would not.
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err("malformed mountInfo.json: not a JSON object".into());
        }
        if nests_deeper_than(bytes, GO_MAX_DEPTH) {
            return Err(format!(
                "malformed mountInfo.json: nested deeper than {GO_MAX_DEPTH} levels"
            ));
        }
        let raw: RawMountInfo =
            serde_json::from_slice(bytes).map_err(|e| format!("malformed mountInfo.json: {e}"))?;
        Ok(MountInfo {
            // Missing or null stays "": validation reads it as block.
            volume_type: raw.volume_type.flatten().unwrap_or_default(),
            device: raw
                .device
                .ok_or_else(|| "malformed mountInfo.json: missing field `device`".to_string())?
                .unwrap_or_default(),
            fstype: raw
                .fstype
                .ok_or_else(|| "malformed mountInfo.json: missing field `fstype`".to_string())?
                .unwrap_or_default(),
            metadata: raw.metadata.flatten().map(|m| m.0).unwrap_or_default(),
            options: raw.options.flatten().unwrap_or_default(),
        })
    }

    /// Kata's `createFilesystem` metadata, read like Go's
    /// `strconv.ParseBool`: `Some(true)` asks the runtime to format a blank
    /// device. `Err` for a value ParseBool refuses.
    pub fn create_filesystem(&self) -> Result<Option<bool>, String> {
        match self.metadata.get(CREATE_FILESYSTEM_KEY).map(String::as_str) {
            None => Ok(None),
            Some("1" | "t" | "T" | "TRUE" | "true" | "True") => Ok(Some(true)),
            Some("0" | "f" | "F" | "FALSE" | "false" | "False") => Ok(Some(false)),
            Some(v) => Err(format!(
                "metadata {CREATE_FILESYSTEM_KEY}={v:?} is not a boolean"
            )),
        }
    }
}

/// Go's `encoding/json` refuses a document nested deeper than this, even
/// inside a key it ignores, and Kata's Go runtime then takes the volume
/// for a plain bind mount; serde skips unknown values without a bound.
/// A record Kata cannot read must not be one crust reads (found by the
/// Go differential, tests/kata_differential.rs).
const GO_MAX_DEPTH: usize = 10_000;

/// Whether arrays and objects nest deeper than `max` (strings skipped).
fn nests_deeper_than(bytes: &[u8], max: usize) -> bool {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &b in bytes {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// The record's keys as Kata declares them; Go matches them ignoring case.
const KEYS: [&str; 5] = ["volume-type", "device", "fstype", "metadata", "options"];

/// Each field: absent (`None`), `null` (`Some(None)`), or a value.
#[derive(Default)]
struct RawMountInfo {
    volume_type: Option<Option<String>>,
    device: Option<Option<String>>,
    fstype: Option<Option<String>>,
    metadata: Option<Option<UniqueMap>>,
    options: Option<Option<Vec<String>>>,
}

impl<'de> Deserialize<'de> for RawMountInfo {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawMountInfo;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a mountInfo object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<RawMountInfo, A::Error> {
                let mut raw = RawMountInfo::default();
                while let Some(key) = a.next_key::<String>()? {
                    let Some(canon) = KEYS.iter().find(|k| go_fold_eq(&key, k)) else {
                        if go_fold_eq(&key, ENCRYPTION_KEY_KEY) {
                            // Ignored by Kata, but a key on disk is never fine.
                            return Err(de::Error::custom(format!(
                                "unknown field {key:?} refused: a key must never be stored in a hand-off record"
                            )));
                        }
                        a.next_value::<de::IgnoredAny>()?;
                        continue;
                    };
                    let dup = || de::Error::custom(format!("duplicate field `{canon}` ({key:?})"));
                    match *canon {
                        "volume-type" if raw.volume_type.is_none() => {
                            raw.volume_type = Some(a.next_value()?)
                        }
                        "device" if raw.device.is_none() => raw.device = Some(a.next_value()?),
                        "fstype" if raw.fstype.is_none() => raw.fstype = Some(a.next_value()?),
                        "metadata" if raw.metadata.is_none() => {
                            raw.metadata = Some(a.next_value()?)
                        }
                        "options" if raw.options.is_none() => raw.options = Some(a.next_value()?),
                        _ => return Err(dup()),
                    }
                }
                Ok(raw)
            }
        }
        d.deserialize_map(V)
    }
}

/// Whether Kata's Rust runtime (serde, exact field names, `null` refused
/// for a string, a map or a list) reads `bytes` as crust and Kata's Go
/// runtime do: every key that names a record field under Go's folding is
/// spelled exactly so and is not `null`. Call only on bytes that
/// [`MountInfo::from_json`] accepted (duplicates are refused there).
pub(crate) fn read_alike_by_every_runtime(bytes: &[u8]) -> bool {
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(bytes) else {
        return false;
    };
    map.iter().all(|(k, v)| {
        !KEYS.iter().any(|f| go_fold_eq(k, f)) || (KEYS.contains(&k.as_str()) && !v.is_null())
    })
}

/// Whether Go's `encoding/json` takes `key` for the ASCII field name
/// `field`: it folds case with Unicode simple folding, under which two
/// non-ASCII letters fold onto ASCII ones (U+017F long s onto `s`, U+212A
/// Kelvin sign onto `k`). Matching only ASCII case would read
/// `"f\u017ftype"` as an unknown key where Kata reads the fstype.
pub(crate) fn go_fold_eq(key: &str, field: &str) -> bool {
    let mut k = key.chars().map(|c| match c {
        '\u{17f}' => 's',
        '\u{212a}' => 'k',
        c => c.to_ascii_lowercase(),
    });
    let mut f = field.chars().map(|c| c.to_ascii_lowercase());
    loop {
        match (k.next(), f.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a == b => {}
            _ => return false,
        }
    }
}

/// A string map that refuses duplicate keys instead of keeping the last.
struct UniqueMap(BTreeMap<String, String>);

impl<'de> Deserialize<'de> for UniqueMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = UniqueMap;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of strings")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<UniqueMap, A::Error> {
                let mut m = BTreeMap::new();
                while let Some((k, v)) = a.next_entry::<String, String>()? {
                    if m.contains_key(&k) {
                        return Err(de::Error::custom(format!("duplicate metadata key {k:?}")));
                    }
                    m.insert(k, v);
                }
                Ok(UniqueMap(m))
            }
        }
        d.deserialize_map(V)
    }
}

/// Go's `encoding/json` string encoding with HTML escaping (the default of
/// `json.Marshal`): `<`, `>`, `&`, U+2028 and U+2029 become `\uXXXX`.
fn go_string(out: &mut String, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || c == '<' || c == '>' || c == '&' => {
                let b = c as u32 as u8;
                out.push_str("\\u00");
                out.push(HEX[(b >> 4) as usize] as char);
                out.push(HEX[(b & 0xf) as usize] as char);
            }
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Canonical decimal gid: digits only, no leading zero, fits in u32.
pub fn parse_fs_group(v: &str) -> Result<u32, String> {
    let canonical =
        !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) && (v == "0" || !v.starts_with('0'));
    if !canonical {
        return Err(format!("fsGroup {v:?} is not a decimal group id"));
    }
    v.parse::<u32>()
        .map_err(|_| format!("fsGroup {v:?} does not fit in 32 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_record_without_the_identity_is_the_same_record() {
        let old = MountInfo::block("/dev/loop3", "ext4");
        let mut new = old.clone();
        new.metadata
            .insert(DEVICE_IDENTITY_KEY.into(), "file:7:0:12:5".into());
        assert!(old.is_staged_as(&new), "an upgrade's republish");
        assert!(new.is_staged_as(&new));
        // A record that carries an identity must carry the same one.
        let mut other = new.clone();
        other
            .metadata
            .insert(DEVICE_IDENTITY_KEY.into(), "file:7:0:13:5".into());
        assert!(!new.is_staged_as(&other));
        // Anything else that differs is a different record.
        let mut moved = new.clone();
        moved.device = "/dev/loop4".into();
        assert!(!old.is_staged_as(&moved));
    }

    fn sample() -> MountInfo {
        let mut mi = MountInfo::block("/dev/loop3", "ext4");
        mi.set_fs_group(Some(100));
        mi.set_fs_group_change_policy(Some(FsGroupChangePolicy::OnRootMismatch));
        mi.options = vec!["noatime".into()];
        mi
    }

    #[test]
    fn go_encoding_byte_exact() {
        assert_eq!(
            sample().to_json(),
            r#"{"volume-type":"block","device":"/dev/loop3","fstype":"ext4","metadata":{"fsGroup":"100","fsGroupChangePolicy":"OnRootMismatch"},"options":["noatime"]}"#
        );
        // omitempty: no metadata, no options.
        assert_eq!(
            MountInfo::block("/dev/sdf", "xfs").to_json(),
            r#"{"volume-type":"block","device":"/dev/sdf","fstype":"xfs"}"#
        );
        // The KEP's example record (fsGroup only).
        let mut kep = MountInfo::block("/dev/sdf", "xfs");
        kep.set_fs_group(Some(4059));
        assert_eq!(
            kep.to_json(),
            r#"{"volume-type":"block","device":"/dev/sdf","fstype":"xfs","metadata":{"fsGroup":"4059"}}"#
        );
    }

    #[test]
    fn go_string_escapes() {
        let mut s = String::new();
        go_string(&mut s, "a<b>&\"\\\n\t\u{1}\u{8}\u{c}\u{2028}\u{7f}é");
        // Go leaves DEL (0x7f) and non-ASCII as they are.
        assert_eq!(
            s,
            "\"a\\u003cb\\u003e\\u0026\\\"\\\\\\n\\t\\u0001\\b\\f\\u2028\u{7f}é\""
        );
    }

    #[test]
    fn accessors() {
        let mi = sample();
        assert_eq!(mi.fs_group(), Some(100));
        assert_eq!(
            mi.fs_group_change_policy(),
            Some(FsGroupChangePolicy::OnRootMismatch)
        );
        let mut mi = mi;
        mi.set_fs_group(None);
        mi.set_fs_group_change_policy(None);
        assert!(mi.metadata.is_empty());
        assert_eq!(mi.fs_group(), None);
    }

    #[test]
    fn parse_accepts_other_spellings() {
        let spaced = br#"{ "fstype" : "ext4", "device": "/dev/loop3",
            "options": ["noatime"], "volume-type": "block",
            "metadata": {"fsGroupChangePolicy": "OnRootMismatch", "fsGroup": "100"} }"#;
        assert_eq!(MountInfo::from_json(spaced).unwrap(), sample());
        let nulls = br#"{"volume-type":"block","device":"/dev/sdf","fstype":"xfs","metadata":null,"options":null}"#;
        assert_eq!(
            MountInfo::from_json(nulls).unwrap(),
            MountInfo::block("/dev/sdf", "xfs")
        );
    }

    /// What Kata's Go decoder takes: keys in any case (Kata's own design
    /// doc writes `"Device"`), unknown keys ignored, no `volume-type`,
    /// `directvol`, nulls.
    #[test]
    fn parse_reads_what_kata_reads() {
        let mi = MountInfo::from_json(br#"{"Device":"/dev/loop3","fstype":"ext4"}"#).unwrap();
        assert_eq!(
            (
                mi.volume_type.as_str(),
                mi.device.as_str(),
                mi.fstype.as_str()
            ),
            ("", "/dev/loop3", "ext4")
        );
        assert_eq!(crate::validate::check_volume_type(&mi.volume_type), Ok(()));
        let mi = MountInfo::from_json(
            br#"{"VOLUME-TYPE":"directvol","device":"/dev/sdf","FsType":"xfs","Metadata":{"fsGroup":"7","createFilesystem":"true"},"Options":["noatime"],"extra":{"x":[1]},"nodeName":"n1"}"#,
        )
        .unwrap();
        assert_eq!(mi.volume_type, VOLUME_TYPE_DIRECTVOL);
        assert_eq!(
            (mi.device.as_str(), mi.fstype.as_str()),
            ("/dev/sdf", "xfs")
        );
        assert_eq!(mi.fs_group(), Some(7));
        assert_eq!(mi.create_filesystem(), Ok(Some(true)));
        assert_eq!(mi.options, ["noatime"]);
        let mi =
            MountInfo::from_json(br#"{"volume-type":null,"device":"/dev/sdf","fstype":"xfs"}"#)
                .unwrap();
        assert_eq!(mi.volume_type, "");
        for (v, want) in [
            ("1", Ok(Some(true))),
            ("False", Ok(Some(false))),
            ("t", Ok(Some(true))),
        ] {
            let mut mi = MountInfo::block("/dev/x", "ext4");
            mi.metadata.insert(CREATE_FILESYSTEM_KEY.into(), v.into());
            assert_eq!(mi.create_filesystem(), want, "{v}");
        }
        let mut mi = MountInfo::block("/dev/x", "ext4");
        mi.metadata
            .insert(CREATE_FILESYSTEM_KEY.into(), "yes".into());
        assert!(mi.create_filesystem().is_err());
        // Writing is unchanged: Go's bytes, canonical keys.
        let read = MountInfo::from_json(
            br#"{"volume-type":"block","Device":"/dev/loop3","FSTYPE":"ext4","Options":["ro"]}"#,
        )
        .unwrap();
        assert_eq!(
            read.to_json(),
            r#"{"volume-type":"block","device":"/dev/loop3","fstype":"ext4","options":["ro"]}"#
        );
    }

    /// A record whose unknown key `y` holds arrays nested `n` deep (the
    /// record itself is one more level).
    fn deep(n: usize) -> Vec<u8> {
        let mut v = br#"{"device":"/dev/sdf","fstype":"xfs","x":"[\\\"{","y":"#.to_vec();
        v.extend(std::iter::repeat_n(b'[', n));
        v.extend(std::iter::repeat_n(b']', n));
        v.push(b'}');
        v
    }

    #[test]
    fn nesting_is_bounded_as_go_bounds_it() {
        let mi = MountInfo::from_json(&deep(GO_MAX_DEPTH - 1)).unwrap();
        assert_eq!(
            mi,
            MountInfo {
                volume_type: String::new(),
                ..MountInfo::block("/dev/sdf", "xfs")
            }
        );
    }

    #[test]
    fn parse_rejects() {
        for (bad, why) in [
            (&br#"{"volume-type":"block","device":"/dev/sdf","device":"/dev/sdg","fstype":"xfs"}"#[..], "duplicate field"),
            (br#"{"volume-type":"block","device":"/dev/sdf","DEVICE":"/dev/sdg","fstype":"xfs"}"#, "duplicate field"),
            (br#"{"volume-type":"block","device":"/dev/sdf","fstype":"xfs","metadata":{"fsGroup":"1","fsGroup":"2"}}"#, "duplicate metadata key"),
            (br#"{"volume-type":"block","device":"/dev/sdf"}"#, "missing field"),
            (br#"{"volume-type":"block","device":"/dev/sdf","fstype":"xf"#, "EOF"),
            (br#"{"volume-type":"block","device":7,"fstype":"xfs"}"#, "invalid type"),
            (br#"[]"#, "not a JSON object"),
            (br#"["block","/dev/sdf","xfs",null,null]"#, "not a JSON object"),
            (b"", "not a JSON object"),
            (br#"{"volume-type":"block","device":"/dev/sdf","fstype":"xfs"} trailing"#, "trailing"),
            (&deep(GO_MAX_DEPTH), "nested deeper than 10000"),
        ] {
            let e = MountInfo::from_json(bad).unwrap_err();
            assert!(e.contains(why), "{}: {e}", String::from_utf8_lossy(bad));
        }
    }
}
