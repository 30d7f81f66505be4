//! Mount option allow-list. Options arrive one per entry (no commas); each
//! is either a VFS flag (turned into `MS_*`) or a filesystem option passed
//! in the data string. Anything not listed is refused, so a caller cannot
//! smuggle in e.g. `suid` semantics changes we did not think about, or a
//! second option through a comma.

use crust_agent_proto::FsType;
use rustix::mount::MountFlags;

/// Options turned into what mount(2) takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedOptions {
    pub flags: MountFlags,
    /// Comma-separated filesystem options.
    pub data: String,
    /// `readonly` requested or `ro` given.
    pub readonly: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    #[error("mount option {option:?} is not allowed for {fstype} (allowed: {allowed})")]
    NotAllowed {
        option: String,
        fstype: FsType,
        allowed: String,
    },
    #[error("mount option {option:?}: {reason}")]
    BadValue { option: String, reason: String },
    #[error("mount options conflict: {0}")]
    Conflict(String),
}

/// VFS flags; `None` means accepted with no effect (the default already).
const FLAGS: &[(&str, Option<MountFlags>)] = &[
    ("defaults", None),
    ("rw", None),
    ("ro", Some(MountFlags::RDONLY)),
    ("noatime", Some(MountFlags::NOATIME)),
    ("atime", None),
    ("relatime", Some(MountFlags::RELATIME)),
    ("norelatime", None),
    ("strictatime", Some(MountFlags::STRICTATIME)),
    ("nodiratime", Some(MountFlags::NODIRATIME)),
    ("diratime", None),
    ("lazytime", Some(MountFlags::LAZYTIME)),
    ("nolazytime", None),
    ("sync", Some(MountFlags::SYNCHRONOUS)),
    ("async", None),
    ("dirsync", Some(MountFlags::DIRSYNC)),
    ("nosuid", Some(MountFlags::NOSUID)),
    ("suid", None),
    ("nodev", Some(MountFlags::NODEV)),
    ("dev", None),
    ("noexec", Some(MountFlags::NOEXEC)),
    ("exec", None),
];

/// How a filesystem option's value is checked.
#[derive(Clone, Copy)]
enum Value {
    /// Bare word, no `=`.
    None,
    /// One of a fixed set.
    OneOf(&'static [&'static str]),
    /// Unsigned integer within bounds.
    Int(u64, u64),
    /// Bare word or `=N` within bounds.
    OptInt(u64, u64),
    /// Size with an optional k/m/g suffix.
    Size,
}

const COMMON: &[(&str, Value)] = &[
    ("discard", Value::None),
    ("nodiscard", Value::None),
    ("usrquota", Value::None),
    ("grpquota", Value::None),
    ("prjquota", Value::None),
    ("quota", Value::None),
    ("noquota", Value::None),
    ("grpid", Value::None),
    ("bsdgroups", Value::None),
    ("nogrpid", Value::None),
    ("sysvgroups", Value::None),
];

const EXT4: &[(&str, Value)] = &[
    ("barrier", Value::OptInt(0, 1)),
    ("nobarrier", Value::None),
    ("data", Value::OneOf(&["ordered", "journal", "writeback"])),
    ("errors", Value::OneOf(&["remount-ro", "continue", "panic"])),
    ("commit", Value::Int(0, 86400)),
    ("journal_checksum", Value::None),
    ("nojournal_checksum", Value::None),
    ("journal_ioprio", Value::Int(0, 7)),
    ("auto_da_alloc", Value::OptInt(0, 1)),
    ("noauto_da_alloc", Value::None),
    ("delalloc", Value::None),
    ("nodelalloc", Value::None),
    ("init_itable", Value::OptInt(0, 1000)),
    ("noinit_itable", Value::None),
    ("block_validity", Value::None),
    ("noblock_validity", Value::None),
    ("dioread_lock", Value::None),
    ("dioread_nolock", Value::None),
    ("user_xattr", Value::None),
    ("acl", Value::None),
    ("noacl", Value::None),
    ("i_version", Value::None),
    ("resgid", Value::Int(0, u32::MAX as u64)),
    ("resuid", Value::Int(0, u32::MAX as u64)),
    ("stripe", Value::Int(0, u32::MAX as u64)),
    ("max_batch_time", Value::Int(0, 1_000_000)),
    ("min_batch_time", Value::Int(0, 1_000_000)),
    ("inode_readahead_blks", Value::Int(0, 1 << 30)),
];

const XFS: &[(&str, Value)] = &[
    ("inode32", Value::None),
    ("inode64", Value::None),
    ("largeio", Value::None),
    ("nolargeio", Value::None),
    ("logbufs", Value::Int(2, 8)),
    ("logbsize", Value::Size),
    ("allocsize", Value::Size),
    ("nouuid", Value::None),
    ("wsync", Value::None),
    ("swalloc", Value::None),
    ("noalign", Value::None),
    ("filestreams", Value::None),
    ("ikeep", Value::None),
    ("noikeep", Value::None),
    ("uquota", Value::None),
    ("gquota", Value::None),
    ("pquota", Value::None),
    ("uqnoenforce", Value::None),
    ("gqnoenforce", Value::None),
    ("pqnoenforce", Value::None),
    ("qnoenforce", Value::None),
    ("norecovery", Value::None),
];

fn fs_table(fstype: FsType) -> &'static [(&'static str, Value)] {
    match fstype {
        FsType::Ext4 => EXT4,
        FsType::Xfs => XFS,
    }
}

fn allowed_list(fstype: FsType) -> String {
    let mut names: Vec<String> = FLAGS.iter().map(|(n, _)| n.to_string()).collect();
    for (name, v) in COMMON.iter().chain(fs_table(fstype)) {
        names.push(match v {
            Value::None => name.to_string(),
            Value::OptInt(..) => format!("{name}[=N]"),
            _ => format!("{name}=…"),
        });
    }
    names.join(", ")
}

fn check_value(option: &str, value: Option<&str>, spec: Value) -> Result<(), OptionError> {
    let bad = |reason: &str| OptionError::BadValue {
        option: option.to_owned(),
        reason: reason.to_owned(),
    };
    let int = |v: &str, lo: u64, hi: u64| -> Result<(), OptionError> {
        let n: u64 = v
            .parse()
            .map_err(|_| bad("value must be a non-negative integer"))?;
        if n < lo || n > hi {
            return Err(bad(&format!("value must be between {lo} and {hi}")));
        }
        Ok(())
    };
    match (spec, value) {
        (Value::None, None) => Ok(()),
        (Value::None, Some(_)) => Err(bad("takes no value")),
        (Value::OptInt(..), None) => Ok(()),
        (Value::OptInt(lo, hi) | Value::Int(lo, hi), Some(v)) => int(v, lo, hi),
        (Value::OneOf(set), Some(v)) if set.contains(&v) => Ok(()),
        (Value::OneOf(set), _) => Err(bad(&format!("value must be one of {}", set.join("|")))),
        (Value::Size, Some(v)) => {
            let digits = v.trim_end_matches(['k', 'K', 'm', 'M', 'g', 'G']);
            if digits.len() + 1 < v.len() || digits.is_empty() {
                return Err(bad("value must be a size like 64k or 1m"));
            }
            int(digits, 1, u32::MAX as u64)
        }
        (Value::Int(..) | Value::Size, None) => Err(bad("needs a value (option=value)")),
    }
}

/// Validates `options` for `fstype` and splits them into flags and data.
pub fn parse(
    fstype: FsType,
    options: &[String],
    readonly: bool,
) -> Result<ParsedOptions, OptionError> {
    let mut flags = MountFlags::empty();
    let mut data: Vec<&str> = Vec::new();
    let mut saw_rw = false;
    for opt in options {
        if let Some((_, flag)) = FLAGS.iter().find(|(n, _)| *n == opt) {
            if opt == "rw" {
                saw_rw = true;
            }
            if let Some(f) = flag {
                flags |= *f;
            }
            continue;
        }
        let (name, value) = match opt.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (opt.as_str(), None),
        };
        let Some((_, spec)) = COMMON
            .iter()
            .chain(fs_table(fstype))
            .find(|(n, _)| *n == name)
        else {
            return Err(OptionError::NotAllowed {
                option: opt.clone(),
                fstype,
                allowed: allowed_list(fstype),
            });
        };
        check_value(opt, value, *spec)?;
        data.push(opt);
    }
    let readonly = readonly || flags.contains(MountFlags::RDONLY);
    if readonly && saw_rw {
        return Err(OptionError::Conflict(
            "\"rw\" given for a read-only mount".into(),
        ));
    }
    if data.contains(&"norecovery") && !readonly {
        return Err(OptionError::Conflict(
            "\"norecovery\" needs a read-only mount".into(),
        ));
    }
    if readonly {
        flags |= MountFlags::RDONLY;
    }
    Ok(ParsedOptions {
        flags,
        data: data.join(","),
        readonly,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(fs: FsType, opts: &[&str], ro: bool) -> Result<ParsedOptions, OptionError> {
        let v: Vec<String> = opts.iter().map(|s| s.to_string()).collect();
        parse(fs, &v, ro)
    }

    #[test]
    fn flags_and_data_split() {
        let r = p(
            FsType::Ext4,
            &[
                "noatime",
                "nodiratime",
                "data=ordered",
                "errors=remount-ro",
                "discard",
                "nosuid",
            ],
            false,
        )
        .unwrap();
        assert_eq!(
            r.flags,
            MountFlags::NOATIME | MountFlags::NODIRATIME | MountFlags::NOSUID
        );
        assert_eq!(r.data, "data=ordered,errors=remount-ro,discard");
        assert!(!r.readonly);
    }

    #[test]
    fn ro_option_or_flag_makes_readonly() {
        let r = p(FsType::Xfs, &["ro", "nouuid"], false).unwrap();
        assert!(r.readonly && r.flags.contains(MountFlags::RDONLY));
        let r = p(FsType::Xfs, &[], true).unwrap();
        assert!(r.readonly && r.flags.contains(MountFlags::RDONLY));
        assert_eq!(r.data, "");
    }

    #[test]
    fn unknown_and_smuggled_options_refused() {
        for bad in [
            "suidx",
            "noatime,suid",
            "",
            "data",
            "mode=0777",
            "context=x",
        ] {
            let e = p(FsType::Ext4, &[bad], false).unwrap_err();
            assert!(
                matches!(
                    e,
                    OptionError::NotAllowed { .. } | OptionError::BadValue { .. }
                ),
                "{bad}: {e}"
            );
        }
        let e = p(FsType::Xfs, &["data=ordered"], false).unwrap_err();
        assert!(e.to_string().contains("not allowed for xfs"), "{e}");
        let e = p(FsType::Xfs, &["nobarrier"], false).unwrap_err();
        assert!(matches!(e, OptionError::NotAllowed { .. }));
        let e = p(FsType::Ext4, &["inode64"], false).unwrap_err();
        assert!(matches!(e, OptionError::NotAllowed { .. }));
    }

    #[test]
    fn values_checked() {
        assert!(p(FsType::Ext4, &["data=journal"], false).is_ok());
        assert!(p(FsType::Ext4, &["data=bogus"], false).is_err());
        assert!(p(FsType::Ext4, &["commit=30"], false).is_ok());
        assert!(p(FsType::Ext4, &["commit=-1"], false).is_err());
        assert!(p(FsType::Ext4, &["commit"], false).is_err());
        assert!(p(FsType::Ext4, &["barrier"], false).is_ok());
        assert!(p(FsType::Ext4, &["barrier=1"], false).is_ok());
        assert!(p(FsType::Ext4, &["barrier=2"], false).is_err());
        assert!(p(FsType::Ext4, &["nobarrier=1"], false).is_err());
        assert!(p(FsType::Xfs, &["logbufs=8"], false).is_ok());
        assert!(p(FsType::Xfs, &["logbufs=9"], false).is_err());
        assert!(p(FsType::Xfs, &["logbsize=256k"], false).is_ok());
        assert!(p(FsType::Xfs, &["allocsize=kk"], false).is_err());
        assert!(p(FsType::Xfs, &["allocsize=64kk"], false).is_err());
        assert!(p(FsType::Xfs, &["prjquota"], false).is_ok());
    }

    #[test]
    fn conflicts() {
        assert!(matches!(
            p(FsType::Ext4, &["rw"], true),
            Err(OptionError::Conflict(_))
        ));
        assert!(matches!(
            p(FsType::Ext4, &["ro", "rw"], false),
            Err(OptionError::Conflict(_))
        ));
        assert!(matches!(
            p(FsType::Xfs, &["norecovery"], false),
            Err(OptionError::Conflict(_))
        ));
        assert!(p(FsType::Xfs, &["norecovery", "ro"], false).is_ok());
    }
}
