//! THE mount-option allow-list, used by the CSI plugin (host mounts,
//! CreateVolume, deferred publications), crust_ops (hand-off records) and
//! the guest agent. Anything not listed is refused, so a caller cannot
//! smuggle in an option nobody thought about, and whatever the plugin
//! accepts the guest accepts too.
//!
//! An element may hold several comma-separated options (as `mount -o`
//! does); [`ParsedOptions::words`] gives them one per entry, which is what
//! a hand-off record stores. Numbers are checked against the bounds the
//! Linux kernel applies (fs/ext4/super.c, fs/xfs/xfs_super.c), taking the
//! strictest kernel configuration where the bound depends on it (ext4's
//! `commit=` must not exceed `INT_MAX / HZ`: 2147483 with HZ=1000), so the
//! kernel never refuses what this list let through.
//!
//! Errors name an option by its position and by this table's name for
//! it, never by the caller's text: mount options may carry credentials.

use std::collections::BTreeSet;

use crate::FsType;

/// VFS mount flags (what becomes `MS_*`), without depending on any
/// syscall crate: the host side and the agent map them to theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MountFlag {
    ReadOnly,
    NoSuid,
    NoDev,
    NoExec,
    NoAtime,
    NoDirAtime,
    RelAtime,
    StrictAtime,
    LazyTime,
    Synchronous,
    DirSync,
    NoSymFollow,
}

/// Options turned into what mount(2) takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedOptions {
    pub flags: BTreeSet<MountFlag>,
    /// Comma-separated filesystem (data) options.
    pub data: String,
    /// `readonly` requested or `ro` given.
    pub read_only: bool,
    /// Every accepted option, one per entry, trimmed (no commas): what a
    /// hand-off record stores.
    pub words: Vec<String>,
    /// The caller asked for `suid` / `dev` explicitly (host mounts add
    /// `nosuid`/`nodev` otherwise).
    pub suid: bool,
    pub dev: bool,
}

impl ParsedOptions {
    pub fn has(&self, f: MountFlag) -> bool {
        self.flags.contains(&f)
    }
}

/// Why options were refused. Never carries the caller's text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    #[error(
        "mount option #{position}{} is not allowed for {fstype}: {reason}",
        name_suffix(*name)
    )]
    NotAllowed {
        /// 1-based, counting comma-separated options across all elements.
        position: usize,
        /// This table's name for the option, if it has one.
        name: Option<&'static str>,
        fstype: FsType,
        reason: String,
    },
    #[error("mount option #{position}{}: {reason}", name_suffix(*name))]
    BadValue {
        position: usize,
        name: Option<&'static str>,
        reason: String,
    },
    #[error("mount options conflict: {name} {reason}")]
    Conflict { name: &'static str, reason: String },
}

fn name_suffix(name: Option<&'static str>) -> String {
    name.map(|n| format!(" ({n})")).unwrap_or_default()
}

impl OptionError {
    pub fn position(&self) -> Option<usize> {
        match self {
            OptionError::NotAllowed { position, .. } | OptionError::BadValue { position, .. } => {
                Some(*position)
            }
            OptionError::Conflict { .. } => None,
        }
    }

    pub fn name(&self) -> Option<&'static str> {
        match self {
            OptionError::NotAllowed { name, .. } | OptionError::BadValue { name, .. } => *name,
            OptionError::Conflict { name, .. } => Some(name),
        }
    }

    /// The reason alone (no position or name).
    pub fn reason(&self) -> &str {
        match self {
            OptionError::NotAllowed { reason, .. }
            | OptionError::BadValue { reason, .. }
            | OptionError::Conflict { reason, .. } => reason,
        }
    }
}

/// What a generic option does.
#[derive(Clone, Copy)]
enum Generic {
    Flag(MountFlag),
    /// The kernel's default; accepted, no effect.
    Default,
    /// `rw`: conflicts with a read-only mount.
    Rw,
    /// `suid` / `dev`: turns off crust's `nosuid`/`nodev` on host mounts.
    Suid,
    Dev,
}

const GENERIC: &[(&str, Generic)] = &[
    ("defaults", Generic::Default),
    ("rw", Generic::Rw),
    ("ro", Generic::Flag(MountFlag::ReadOnly)),
    ("noatime", Generic::Flag(MountFlag::NoAtime)),
    ("atime", Generic::Default),
    ("relatime", Generic::Flag(MountFlag::RelAtime)),
    ("norelatime", Generic::Default),
    ("strictatime", Generic::Flag(MountFlag::StrictAtime)),
    ("nodiratime", Generic::Flag(MountFlag::NoDirAtime)),
    ("diratime", Generic::Default),
    ("lazytime", Generic::Flag(MountFlag::LazyTime)),
    ("nolazytime", Generic::Default),
    ("sync", Generic::Flag(MountFlag::Synchronous)),
    ("async", Generic::Default),
    ("dirsync", Generic::Flag(MountFlag::DirSync)),
    ("nosuid", Generic::Flag(MountFlag::NoSuid)),
    ("suid", Generic::Suid),
    ("nodev", Generic::Flag(MountFlag::NoDev)),
    ("dev", Generic::Dev),
    ("noexec", Generic::Flag(MountFlag::NoExec)),
    ("exec", Generic::Default),
    ("nosymfollow", Generic::Flag(MountFlag::NoSymFollow)),
];

/// Options refused with a reason of their own (whole option or key).
const REFUSED: &[(&str, &str)] = &[
    ("bind", "bind mounts are made by crust itself"),
    ("rbind", "bind mounts are made by crust itself"),
    ("remount", "remounting is not a volume option"),
    ("move", "moving mounts is not a volume option"),
    ("loop", "crust attaches loop devices itself"),
    ("errors=panic", "a volume error must not crash the kernel"),
    ("dax", "DAX needs persistent memory"),
    ("user", "fstab-only option"),
    ("users", "fstab-only option"),
    ("owner", "fstab-only option"),
    ("nofail", "fstab-only option"),
    ("auto", "fstab-only option"),
    ("noauto", "fstab-only option"),
    ("_netdev", "fstab-only option"),
];

/// How a filesystem option's value is checked.
#[derive(Clone, Copy)]
enum Value {
    /// Bare word, no `=`.
    None,
    /// One of a fixed set.
    OneOf(&'static [&'static str]),
    /// Decimal integer within bounds (inclusive).
    Int(u64, u64),
    /// Bare word, or `=N` within bounds.
    OptInt(u64, u64),
    /// 0 or a power of two up to the bound (inclusive).
    ZeroOrPow2(u64),
    /// A size with an optional k/m/g suffix, a power of two within bounds.
    Pow2Size(u64, u64),
    /// Bare word, allowed only for a read-only mount.
    ReadOnlyOnly,
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
    // Mounting a dirty journal without replaying it would write a
    // filesystem that disagrees with its journal.
    ("norecovery", Value::ReadOnlyOnly),
];

const U32: u64 = u32::MAX as u64;
const I32: u64 = i32::MAX as u64;
const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// ext4 (fs/ext4/super.c). `commit`: `INT_MAX / HZ` with HZ up to 1000;
/// `resuid`/`resgid`: `(u32)-1` is not a valid id; `journal_ioprio` < 8;
/// `inode_readahead_blks`: 0 or a power of two up to 2^30.
const EXT4: &[(&str, Value)] = &[
    ("barrier", Value::OptInt(0, 1)),
    ("nobarrier", Value::None),
    ("data", Value::OneOf(&["ordered", "journal", "writeback"])),
    ("errors", Value::OneOf(&["remount-ro", "continue"])),
    ("commit", Value::Int(0, I32 / 1000)),
    ("journal_checksum", Value::None),
    ("nojournal_checksum", Value::None),
    ("journal_async_commit", Value::None),
    ("journal_ioprio", Value::Int(0, 7)),
    ("auto_da_alloc", Value::OptInt(0, 1)),
    ("noauto_da_alloc", Value::None),
    ("delalloc", Value::None),
    ("nodelalloc", Value::None),
    ("init_itable", Value::OptInt(0, U32)),
    ("noinit_itable", Value::None),
    ("block_validity", Value::None),
    ("noblock_validity", Value::None),
    ("dioread_lock", Value::None),
    ("dioread_nolock", Value::None),
    // Not `nouser_xattr`: current kernels (6.18 here) no longer know it
    // (found by the fuzz harness's kernel target).
    ("user_xattr", Value::None),
    ("acl", Value::None),
    ("noacl", Value::None),
    ("i_version", Value::None),
    ("nombcache", Value::None),
    ("noload", Value::ReadOnlyOnly),
    ("resgid", Value::Int(0, U32 - 1)),
    ("resuid", Value::Int(0, U32 - 1)),
    ("stripe", Value::Int(0, U32)),
    ("max_batch_time", Value::Int(0, I32)),
    ("min_batch_time", Value::Int(0, I32)),
    ("inode_readahead_blks", Value::ZeroOrPow2(1 << 30)),
    ("max_dir_size_kb", Value::Int(0, U32)),
];

/// xfs (fs/xfs/xfs_super.c). `logbufs` 2..8; `logbsize` a power of two
/// from 16 KiB to 256 KiB; `allocsize` a power of two from 4 KiB to 1 GiB;
/// Not `sunit`/`swidth`: whether the kernel takes them depends on the
/// superblock (its data-alignment bit, which crust's mkfs never sets;
/// the block size; the allocation group size), so no option list can say;
/// the kernel target of the fuzz harness found each of those refusals.
const XFS: &[(&str, Value)] = &[
    ("inode32", Value::None),
    ("inode64", Value::None),
    ("largeio", Value::None),
    ("nolargeio", Value::None),
    ("logbufs", Value::Int(2, 8)),
    ("logbsize", Value::Pow2Size(16 * KIB, 256 * KIB)),
    ("allocsize", Value::Pow2Size(4 * KIB, GIB)),
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
];

fn fs_table(fstype: FsType) -> &'static [(&'static str, Value)] {
    match fstype {
        FsType::Ext4 => EXT4,
        FsType::Xfs => XFS,
    }
}

/// This table's spelling of `key` (whole option for a refused one), so a
/// message can name an option without repeating the caller's text.
fn known_name(opt: &str) -> Option<&'static str> {
    if let Some((o, _)) = REFUSED.iter().find(|(o, _)| *o == opt) {
        return Some(o);
    }
    let key = opt.split_once('=').map_or(opt, |(k, _)| k);
    GENERIC
        .iter()
        .map(|(n, _)| n)
        .chain(REFUSED.iter().map(|(n, _)| n))
        .chain(COMMON.iter().map(|(n, _)| n))
        .chain(EXT4.iter().map(|(n, _)| n))
        .chain(XFS.iter().map(|(n, _)| n))
        .find(|n| **n == key)
        .copied()
}

/// Decimal digits without a leading zero: the kernel's option parser
/// guesses the base of most integers (`resuid=010` is uid 8 to it), so
/// only a form both read alike passes (found by the fuzz harness's kernel
/// target).
fn parse_int(v: &str) -> Option<u64> {
    (!v.is_empty()
        && v.len() <= 20
        && v.bytes().all(|b| b.is_ascii_digit())
        && (v == "0" || !v.starts_with('0')))
    .then(|| v.parse().ok())
    .flatten()
}

/// `64k`, `1m`, `4096`: xfs's suffix_kstrtoint multipliers.
fn parse_size(v: &str) -> Option<u64> {
    let (digits, mult) = match v.as_bytes().last()? {
        b'k' | b'K' => (&v[..v.len() - 1], KIB),
        b'm' | b'M' => (&v[..v.len() - 1], MIB),
        b'g' | b'G' => (&v[..v.len() - 1], GIB),
        _ => (v, 1),
    };
    parse_int(digits)?.checked_mul(mult)
}

/// Checks one data option's value; Err is the reason.
fn check_value(value: Option<&str>, spec: Value, read_only: bool) -> Result<(), String> {
    let int = |v: &str, lo: u64, hi: u64| match parse_int(v) {
        None => Err(
            "the value must be a non-negative decimal integer without leading zeros".to_string(),
        ),
        Some(n) if n < lo || n > hi => Err(format!("the value must be between {lo} and {hi}")),
        Some(_) => Ok(()),
    };
    match (spec, value) {
        (Value::None, None) => Ok(()),
        (Value::None | Value::ReadOnlyOnly, Some(_)) => Err("takes no value".into()),
        (Value::ReadOnlyOnly, None) if read_only => Ok(()),
        (Value::ReadOnlyOnly, None) => Err("only allowed for read-only mounts".into()),
        (Value::OptInt(..), None) => Ok(()),
        (Value::OptInt(lo, hi) | Value::Int(lo, hi), Some(v)) => int(v, lo, hi),
        (Value::OneOf(set), Some(v)) if set.contains(&v) => Ok(()),
        (Value::OneOf(set), _) => Err(format!("the value must be one of {}", set.join("|"))),
        (Value::ZeroOrPow2(hi), Some(v)) => match parse_int(v) {
            Some(n) if n == 0 || (n.is_power_of_two() && n <= hi) => Ok(()),
            _ => Err(format!("the value must be 0 or a power of two up to {hi}")),
        },
        (Value::Pow2Size(lo, hi), Some(v)) => match parse_size(v) {
            Some(n) if n.is_power_of_two() && (lo..=hi).contains(&n) => Ok(()),
            _ => Err(format!(
                "the value must be a power-of-two size (k/m/g suffix allowed) from {lo} to {hi} bytes"
            )),
        },
        (Value::Int(..) | Value::ZeroOrPow2(_) | Value::Pow2Size(..), None) => {
            Err("needs a value (option=value)".into())
        }
    }
}

/// Why one option word is refused whatever the filesystem: empty, a
/// character no option has, or on the refused list.
fn refusal(opt: &str) -> Result<(), &'static str> {
    if opt.is_empty() {
        return Err("empty option");
    }
    if opt
        .bytes()
        .any(|b| b.is_ascii_control() || b == b'/' || b == b' ' || b >= 0x80)
    {
        return Err("options may not contain paths, spaces, control or non-ASCII characters");
    }
    if let Some((_, reason)) = REFUSED
        .iter()
        .find(|(o, _)| *o == opt || opt.split_once('=').is_some_and(|(k, _)| k == *o))
    {
        return Err(reason);
    }
    Ok(())
}

/// Validates `options` for `fstype` and splits them into VFS flags and the
/// filesystem's data string. `readonly` makes the mount read-only whatever
/// the options say. See the module doc for what is accepted.
pub fn parse(
    fstype: FsType,
    options: &[String],
    readonly: bool,
) -> Result<ParsedOptions, OptionError> {
    let words: Vec<&str> = options
        .iter()
        .flat_map(|o| o.split(','))
        // Spaces around a comma are dropped as mount(8) users expect; any
        // other whitespace is refused below.
        .map(|o| o.trim_matches(' '))
        .collect();
    // Read-only-ness first: `norecovery` before `ro` is fine.
    let read_only = readonly || words.contains(&"ro");
    let mut out = ParsedOptions {
        flags: BTreeSet::new(),
        data: String::new(),
        read_only,
        words: Vec::new(),
        suid: false,
        dev: false,
    };
    let mut data: Vec<&str> = Vec::new();
    let mut rw = false;
    for (i, opt) in words.iter().copied().enumerate() {
        let position = i + 1;
        let name = known_name(opt);
        let not_allowed = |reason: &str| OptionError::NotAllowed {
            position,
            name,
            fstype,
            reason: reason.to_string(),
        };
        refusal(opt).map_err(not_allowed)?;
        out.words.push(opt.to_string());
        if let Some((_, g)) = GENERIC.iter().find(|(n, _)| *n == opt) {
            match g {
                Generic::Flag(f) => {
                    out.flags.insert(*f);
                }
                Generic::Default => {}
                Generic::Rw => rw = true,
                Generic::Suid => out.suid = true,
                Generic::Dev => out.dev = true,
            }
            continue;
        }
        let (key, value) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (opt, None),
        };
        let Some((_, spec)) = COMMON
            .iter()
            .chain(fs_table(fstype))
            .find(|(n, _)| *n == key)
        else {
            return Err(not_allowed("not a supported option"));
        };
        if matches!(spec, Value::ReadOnlyOnly) && value.is_none() && !read_only {
            return Err(OptionError::Conflict {
                name: name.unwrap_or("norecovery"),
                reason: "is only allowed for read-only mounts".into(),
            });
        }
        check_value(value, *spec, read_only).map_err(|reason| OptionError::BadValue {
            position,
            name,
            reason,
        })?;
        data.push(opt);
    }
    if read_only {
        out.flags.insert(MountFlag::ReadOnly);
    }
    if read_only && rw {
        return Err(OptionError::Conflict {
            name: "rw",
            reason: "conflicts with a read-only mount".into(),
        });
    }
    if out.suid && out.has(MountFlag::NoSuid) || out.dev && out.has(MountFlag::NoDev) {
        return Err(OptionError::Conflict {
            name: if out.suid { "suid" } else { "dev" },
            reason: "is given together with its opposite".into(),
        });
    }
    let atimes = [
        MountFlag::RelAtime,
        MountFlag::StrictAtime,
        MountFlag::NoAtime,
    ];
    if atimes.iter().filter(|f| out.has(**f)).count() > 1 {
        return Err(OptionError::Conflict {
            name: "atime",
            reason: "noatime, relatime and strictatime are mutually exclusive".into(),
        });
    }
    if fstype == FsType::Ext4 {
        check_ext4_journal(&data)?;
    }
    out.data = data.join(",");
    Ok(out)
}

/// ext4: `journal_async_commit` needs a data mode other than the default
/// `ordered` (the kernel refuses the mount otherwise: found by the fuzz
/// harness's kernel target).
fn check_ext4_journal(data: &[&str]) -> Result<(), OptionError> {
    let mode = data
        .iter()
        .rev()
        .find_map(|o| o.strip_prefix("data="))
        .unwrap_or("ordered");
    if mode == "ordered" && data.contains(&"journal_async_commit") {
        return Err(OptionError::Conflict {
            name: "journal_async_commit",
            reason: "needs data=journal or data=writeback".into(),
        });
    }
    // Without the journal (noload, norecovery) the kernel refuses every
    // journal setting that differs from its default, and any `data=` at
    // all, even `ordered` ("can't mount with data=, fs mounted w/o
    // journal": found by the kernel target).
    let no_journal = data.iter().find_map(|o| match *o {
        "noload" => Some("noload"),
        "norecovery" => Some("norecovery"),
        _ => None,
    });
    if let Some(no_journal) = no_journal {
        let journal_setting = data.iter().find(|o| {
            matches!(**o, "journal_async_commit" | "journal_checksum")
                || o.strip_prefix("commit=")
                    .is_some_and(|v| !matches!(v, "0" | "5"))
                || o.starts_with("data=")
        });
        if let Some(o) = journal_setting {
            return Err(OptionError::Conflict {
                name: no_journal,
                reason: format!("leaves no journal for {}", option_key(o)),
            });
        }
    }
    Ok(())
}

/// Every option name the allow-list accepts for `fstype` (the part
/// before `=`), in table order: what a guest built with this list can
/// mount, as a runtime declares it in a handover request.
pub fn option_names(fstype: FsType) -> Vec<&'static str> {
    GENERIC
        .iter()
        .map(|(n, _)| *n)
        .chain(COMMON.iter().map(|(n, _)| *n))
        .chain(fs_table(fstype).iter().map(|(n, _)| *n))
        .collect()
}

/// The name of one option word (`commit=5` → `commit`), as
/// [`option_names`] lists it.
pub fn option_key(word: &str) -> &str {
    word.split_once('=').map_or(word, |(k, _)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(fs: FsType, opts: &[&str], ro: bool) -> Result<ParsedOptions, OptionError> {
        let v: Vec<String> = opts.iter().map(|s| s.to_string()).collect();
        parse(fs, &v, ro)
    }

    #[test]
    fn option_names_cover_what_parse_accepts() {
        let ext4 = option_names(FsType::Ext4);
        for w in ["ro", "noatime", "discard", "commit", "data", "nosuid"] {
            assert!(ext4.contains(&w), "{w}");
        }
        assert!(!ext4.contains(&"logbufs") && !ext4.contains(&"bind"));
        assert!(option_names(FsType::Xfs).contains(&"logbufs"));
        assert_eq!(option_key("commit=5"), "commit");
        assert_eq!(option_key("noatime"), "noatime");
        // Every accepted word's key is listed.
        for w in ["commit=5", "data=ordered", "errors=remount-ro", "lazytime"] {
            p(FsType::Ext4, &[w], false).unwrap();
            assert!(ext4.contains(&option_key(w)), "{w}");
        }
    }

    #[test]
    fn flags_and_data_split() {
        let r = p(
            FsType::Ext4,
            &[
                "noatime,nodiratime",
                "data=ordered",
                "errors=remount-ro",
                "discard",
                "nosuid",
                "defaults",
            ],
            false,
        )
        .unwrap();
        assert_eq!(
            r.flags,
            BTreeSet::from([MountFlag::NoAtime, MountFlag::NoDirAtime, MountFlag::NoSuid])
        );
        assert_eq!(r.data, "data=ordered,errors=remount-ro,discard");
        assert_eq!(r.words.len(), 7);
        assert!(!r.read_only && !r.suid && !r.dev);
        let r = p(FsType::Xfs, &["ro", "nouuid"], false).unwrap();
        assert!(r.read_only && r.has(MountFlag::ReadOnly));
        let r = p(FsType::Xfs, &[], true).unwrap();
        assert!(r.read_only && r.data.is_empty());
        let r = p(FsType::Ext4, &["suid", "dev"], false).unwrap();
        assert!(r.suid && r.dev);
    }

    #[test]
    fn unknown_unsafe_and_smuggled_options_refused() {
        for (fs, bad) in [
            (FsType::Ext4, "bind"),
            (FsType::Ext4, "errors=panic"),
            (FsType::Ext4, "journal_path=/dev/sda"),
            (FsType::Xfs, "logdev=/dev/sdb"),
            (FsType::Ext4, "context=system_u:object_r:foo"),
            (FsType::Ext4, "nouuid"),
            (FsType::Xfs, "data=journal"),
            (FsType::Xfs, "nobarrier"),
            (FsType::Ext4, "inode64"),
            (FsType::Ext4, "frobnicate"),
            (FsType::Ext4, "suidx"),
            (FsType::Ext4, "noatime,suidx"),
            (FsType::Ext4, ""),
            (FsType::Ext4, "a,,b"),
            (FsType::Ext4, "mode=0777"),
            (FsType::Ext4, "dax=always"),
            (FsType::Ext4, "no\0atime"),
            (FsType::Ext4, "noatime\n"),
            (FsType::Xfs, "attr2"),
        ] {
            let e = p(fs, &[bad], false).unwrap_err();
            assert!(matches!(e, OptionError::NotAllowed { .. }), "{bad:?}: {e}");
        }
        let e = p(FsType::Xfs, &["data=ordered"], false).unwrap_err();
        assert!(e.to_string().contains("not allowed for xfs"), "{e}");
    }

    #[test]
    fn values_checked_against_the_kernels_bounds() {
        let ok = |fs, o: &str| p(fs, &[o], false).is_ok();
        assert!(ok(FsType::Ext4, "data=journal"));
        assert!(!ok(FsType::Ext4, "data=bogus"));
        assert!(!ok(FsType::Ext4, "data"));
        assert!(ok(FsType::Ext4, "commit=30"));
        assert!(ok(FsType::Ext4, "commit=0"));
        assert!(ok(FsType::Ext4, "commit=2147483"));
        assert!(!ok(FsType::Ext4, "commit=2147484"));
        assert!(!ok(FsType::Ext4, "commit=99999999999999999999"));
        assert!(!ok(FsType::Ext4, "commit=-1"));
        assert!(!ok(FsType::Ext4, "commit=+1"));
        assert!(!ok(FsType::Ext4, "commit"));
        assert!(ok(FsType::Ext4, "barrier"));
        assert!(ok(FsType::Ext4, "barrier=1"));
        assert!(!ok(FsType::Ext4, "barrier=2"));
        assert!(!ok(FsType::Ext4, "nobarrier=1"));
        assert!(ok(FsType::Ext4, "journal_ioprio=7"));
        assert!(!ok(FsType::Ext4, "journal_ioprio=8"));
        assert!(ok(FsType::Ext4, "inode_readahead_blks=0"));
        assert!(ok(FsType::Ext4, "inode_readahead_blks=1073741824"));
        assert!(!ok(FsType::Ext4, "inode_readahead_blks=3"));
        assert!(!ok(FsType::Ext4, "inode_readahead_blks=2147483648"));
        assert!(ok(FsType::Ext4, "resuid=4294967294"));
        assert!(!ok(FsType::Ext4, "resuid=4294967295"));
        assert!(ok(FsType::Xfs, "logbufs=8"));
        assert!(!ok(FsType::Xfs, "logbufs=9"));
        assert!(ok(FsType::Xfs, "logbsize=256k"));
        assert!(!ok(FsType::Xfs, "logbsize=512k"));
        assert!(!ok(FsType::Xfs, "logbsize=48k"));
        assert!(ok(FsType::Xfs, "allocsize=64k"));
        assert!(ok(FsType::Xfs, "allocsize=1g"));
        assert!(!ok(FsType::Xfs, "allocsize=2g"));
        assert!(!ok(FsType::Xfs, "allocsize=kk"));
        assert!(!ok(FsType::Xfs, "allocsize=64kk"));
        assert!(ok(FsType::Xfs, "prjquota"));
        // Stripe geometry depends on the superblock: refused up front
        // rather than left to an EINVAL at mount (the fuzz harness's kernel
        // target: `sunit=8,swidth=32` on an unaligned xfs, `sunit=6` on
        // 4 KiB blocks).
        for o in [&["sunit=8", "swidth=32"][..], &["sunit=6", "swidth=12"]] {
            assert!(p(FsType::Xfs, o, false).is_err(), "{o:?}");
        }
        assert!(p(FsType::Ext4, &["nouser_xattr"], false).is_err());
        // No journal, no journal settings (ro: noload needs it).
        for o in ["commit=2", "data=journal", "journal_checksum"] {
            assert!(p(FsType::Ext4, &["noload", o], true).is_err(), "{o}");
        }
        assert!(p(FsType::Ext4, &["noload", "commit=5"], true).is_ok());
        // Even the default data mode, named, is refused without a journal
        // (the kernel target's input, kept).
        let e = p(
            FsType::Ext4,
            &["noatime", "norecovery", "data=ordered", "ro", "nosuid"],
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("data"), "{e}");
        // Octal to the kernel, decimal to a reader: refused.
        for o in ["resuid=0207924707", "resgid=010", "commit=05"] {
            assert!(p(FsType::Ext4, &[o], false).is_err(), "{o}");
        }
        assert!(p(FsType::Ext4, &["resuid=0", "commit=5"], false).is_ok());
        assert!(p(FsType::Ext4, &["journal_async_commit"], false).is_err());
        assert!(
            p(
                FsType::Ext4,
                &["journal_async_commit", "data=ordered"],
                false
            )
            .is_err()
        );
        assert!(
            p(
                FsType::Ext4,
                &["data=writeback", "journal_async_commit"],
                false
            )
            .is_ok()
        );
    }

    #[test]
    fn conflicts() {
        let conflict =
            |fs, o: &[&str], ro| matches!(p(fs, o, ro), Err(OptionError::Conflict { .. }));
        assert!(conflict(FsType::Ext4, &["rw"], true));
        assert!(conflict(FsType::Ext4, &["ro", "rw"], false));
        assert!(conflict(FsType::Ext4, &["noatime", "relatime"], false));
        assert!(conflict(FsType::Ext4, &["suid", "nosuid"], false));
        assert!(matches!(
            p(FsType::Xfs, &["norecovery"], false),
            Err(OptionError::Conflict { .. })
        ));
        assert!(p(FsType::Xfs, &["norecovery", "ro"], false).is_ok());
        assert!(p(FsType::Ext4, &["noload"], true).is_ok());
    }

    #[test]
    fn errors_name_position_never_text() {
        let secret = "s3cr3tV4lue";
        for (fs, list, position, name) in [
            (
                FsType::Ext4,
                vec!["noatime".to_string(), format!("nodev,passphrase={secret}")],
                3,
                None,
            ),
            (
                FsType::Ext4,
                vec![format!("commit={secret}")],
                1,
                Some("commit"),
            ),
            (
                FsType::Xfs,
                vec!["nouuid".into(), format!("allocsize={secret}")],
                2,
                Some("allocsize"),
            ),
            (
                FsType::Ext4,
                vec![format!("journal_path=/dev/{secret}")],
                1,
                None,
            ),
            (
                FsType::Ext4,
                vec!["ro".into(), "errors=panic".into()],
                2,
                Some("errors=panic"),
            ),
        ] {
            let e = parse(fs, &list, false).unwrap_err();
            assert_eq!(
                (e.position(), e.name()),
                (Some(position), name),
                "{list:?}: {e}"
            );
            assert!(!e.to_string().contains(secret), "{e}");
            assert!(!format!("{e:?}").contains(secret), "{e:?}");
            assert!(
                e.to_string().contains(&format!("mount option #{position}")),
                "{e}"
            );
        }
    }

    proptest::proptest! {
        /// Whatever parse accepts, parsing its words again accepts the
        /// same (a hand-off record stores the words; the guest parses them).
        #[test]
        fn words_reparse_to_the_same(opts in proptest::collection::vec("[a-z_=0-9,]{0,14}", 0..5), ro: bool) {
            for fs in FsType::ALL {
                if let Ok(a) = parse(fs, &opts, ro) {
                    let b = parse(fs, &a.words, ro).unwrap();
                    proptest::prop_assert_eq!(a, b);
                }
            }
        }
    }
}
