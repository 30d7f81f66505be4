//! Mount options in the guest: crust's one allow-list
//! ([`crust_fs::options`], the same the CSI plugin and crust_ops apply on
//! the host), turned into what mount(2) takes here.

use crust_agent_proto::FsType;
use crust_fs::MountFlag;
use rustix::mount::MountFlags;

pub use crust_fs::OptionError;

/// Options turned into what mount(2) takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedOptions {
    pub flags: MountFlags,
    /// Comma-separated filesystem options.
    pub data: String,
    /// `readonly` requested or `ro` given.
    pub readonly: bool,
}

fn flag(f: MountFlag) -> MountFlags {
    match f {
        MountFlag::ReadOnly => MountFlags::RDONLY,
        MountFlag::NoSuid => MountFlags::NOSUID,
        MountFlag::NoDev => MountFlags::NODEV,
        MountFlag::NoExec => MountFlags::NOEXEC,
        MountFlag::NoAtime => MountFlags::NOATIME,
        MountFlag::NoDirAtime => MountFlags::NODIRATIME,
        MountFlag::RelAtime => MountFlags::RELATIME,
        MountFlag::StrictAtime => MountFlags::STRICTATIME,
        MountFlag::LazyTime => MountFlags::LAZYTIME,
        MountFlag::Synchronous => MountFlags::SYNCHRONOUS,
        MountFlag::DirSync => MountFlags::DIRSYNC,
        MountFlag::NoSymFollow => MountFlags::NOSYMFOLLOW,
    }
}

/// Validates `options` for `fstype` and splits them into flags and data.
pub fn parse(
    fstype: FsType,
    options: &[String],
    readonly: bool,
) -> Result<ParsedOptions, OptionError> {
    let p = crust_fs::options::parse(fstype, options, readonly)?;
    Ok(ParsedOptions {
        flags: p
            .flags
            .iter()
            .fold(MountFlags::empty(), |a, f| a | flag(*f)),
        data: p.data,
        readonly: p.read_only,
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
            "noatime,suidx",
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
            Err(OptionError::Conflict { .. })
        ));
        assert!(matches!(
            p(FsType::Ext4, &["ro", "rw"], false),
            Err(OptionError::Conflict { .. })
        ));
        assert!(matches!(
            p(FsType::Xfs, &["norecovery"], false),
            Err(OptionError::Conflict { .. })
        ));
        assert!(p(FsType::Xfs, &["norecovery", "ro"], false).is_ok());
    }
}
