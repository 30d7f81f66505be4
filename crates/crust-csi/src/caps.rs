//! Volume capabilities: validation of the CSI `VolumeCapability` messages
//! and the normalized form kept in volume records.
use crust_handoff::FsGroupChangePolicy;
use crust_proto::csi::v1 as csi;
use csi::volume_capability::access_mode::Mode;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Filesystems this plugin creates and mounts: crust-fs's, the one
/// definition shared with the runtime, the agent and the hand-off store.
pub use crust_fs::FsType;

/// Supported access modes (all single-node: volumes are local).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
}

impl AccessMode {
    fn from_proto(m: i32) -> Result<AccessMode, String> {
        match Mode::try_from(m) {
            Ok(Mode::SingleNodeWriter) => Ok(AccessMode::SingleNodeWriter),
            Ok(Mode::SingleNodeReaderOnly) => Ok(AccessMode::SingleNodeReaderOnly),
            Ok(Mode::SingleNodeSingleWriter) => Ok(AccessMode::SingleNodeSingleWriter),
            Ok(Mode::SingleNodeMultiWriter) => Ok(AccessMode::SingleNodeMultiWriter),
            Ok(Mode::Unknown) => Err("access mode is missing or UNKNOWN".to_string()),
            Ok(other) => Err(format!(
                "access mode {} is not supported: volumes are local to one node \
                 (supported: SINGLE_NODE_WRITER, SINGLE_NODE_READER_ONLY, \
                 SINGLE_NODE_SINGLE_WRITER, SINGLE_NODE_MULTI_WRITER)",
                other.as_str_name()
            )),
            Err(_) => Err(format!("access mode {m} is not a known CSI access mode")),
        }
    }

    pub fn to_proto(self) -> Mode {
        match self {
            AccessMode::SingleNodeWriter => Mode::SingleNodeWriter,
            AccessMode::SingleNodeReaderOnly => Mode::SingleNodeReaderOnly,
            AccessMode::SingleNodeSingleWriter => Mode::SingleNodeSingleWriter,
            AccessMode::SingleNodeMultiWriter => Mode::SingleNodeMultiWriter,
        }
    }

    /// Modes that allow only one publish target at a time.
    pub fn single_target(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeSingleWriter | AccessMode::SingleNodeReaderOnly
        )
    }

    pub fn read_only(self) -> bool {
        self == AccessMode::SingleNodeReaderOnly
    }
}

/// Block or filesystem access.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum Access {
    Block,
    /// `fs_type` None = the volume's own fsType.
    Mount {
        fs_type: Option<FsType>,
    },
}

impl Access {
    pub fn is_block(&self) -> bool {
        matches!(self, Access::Block)
    }
}

/// A validated capability. Mount flags are kept only for the mount itself
/// (they may hold sensitive data) and never persisted; records keep a
/// digest to recognise an identical repeat call.
#[derive(Debug, Clone)]
pub struct Capability {
    pub access: Access,
    pub mode: AccessMode,
    pub mount_flags: Vec<String>,
    /// KEP-2857 `volume_supplemental_group` (+ change policy): only
    /// accepted with deferred filesystem operations.
    pub supplemental: Option<SupplementalGroup>,
    /// kubelet's `volume_mount_group` (VOLUME_MOUNT_GROUP: kubelet leaves
    /// fsGroup to the driver): applied to a host publication, or handed to
    /// the runtime with a deferred or handed-over volume.
    pub mount_group: Option<u32>,
}

/// The fsGroup a runtime applies after mounting a deferred volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SupplementalGroup {
    pub gid: u32,
    pub change_policy: Option<FsGroupChangePolicy>,
}

/// A capability's mount flags refused by crust's one allow-list. The
/// message names the flag by position and by the list's name for it,
/// never by its text (flags may carry credentials).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "volume_capability mount_flags: {0} (the flag's text is not repeated: mount flags may \
     carry credentials)"
)]
pub struct BadMountFlags(#[from] pub crust_fs::OptionError);

/// The persisted form of a capability.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CapSpec {
    pub access: Access,
    pub mode: AccessMode,
}

impl Capability {
    /// Validates one CSI capability; the error is a human message for
    /// INVALID_ARGUMENT.
    pub fn from_proto(cap: &csi::VolumeCapability) -> Result<Capability, String> {
        Self::parse(cap, false)
    }

    /// [`Capability::from_proto`] for a request with deferred filesystem
    /// operations, which may carry `volume_supplemental_group` and
    /// `volume_supplemental_group_change_policy`.
    pub fn from_proto_deferred(cap: &csi::VolumeCapability) -> Result<Capability, String> {
        Self::parse(cap, true)
    }

    fn parse(cap: &csi::VolumeCapability, deferred: bool) -> Result<Capability, String> {
        use csi::volume_capability::AccessType;
        let mode = match &cap.access_mode {
            Some(m) => AccessMode::from_proto(m.mode)?,
            None => return Err("volume capability has no access_mode".to_string()),
        };
        let (access, mount_flags, supplemental, mount_group) = match &cap.access_type {
            Some(AccessType::Block(_)) => (Access::Block, Vec::new(), None, None),
            Some(AccessType::Mount(m)) => {
                let fs_type = if m.fs_type.is_empty() {
                    None
                } else {
                    Some(FsType::parse(&m.fs_type).ok_or_else(|| {
                        format!(
                            "fsType {:?} is not supported (supported: {})",
                            m.fs_type,
                            FsType::supported_list()
                        )
                    })?)
                };
                let mount_group = match m.volume_mount_group.as_str() {
                    "" => None,
                    g => Some(
                        crust_handoff::validate::parse_fs_group(g)
                            .map_err(|e| format!("volume_mount_group: {e}"))?,
                    ),
                };
                let supplemental = parse_supplemental(
                    &m.volume_supplemental_group,
                    &m.volume_supplemental_group_change_policy,
                    deferred,
                )?;
                if let (Some(g), Some(s)) = (mount_group, supplemental)
                    && g != s.gid
                {
                    return Err(format!(
                        "volume_mount_group {g} and volume_supplemental_group {} differ",
                        s.gid
                    ));
                }
                for f in &m.mount_flags {
                    // Flags go into the mount data string, which is
                    // comma separated; say which flag without echoing it
                    // (flags may carry secrets).
                    if f.is_empty() || f.contains('\0') {
                        return Err("a mount flag is empty or contains NUL".to_string());
                    }
                }
                (
                    Access::Mount { fs_type },
                    m.mount_flags.clone(),
                    supplemental,
                    mount_group,
                )
            }
            None => {
                return Err("volume capability has neither block nor mount access type".to_string());
            }
        };
        Ok(Capability {
            access,
            mode,
            mount_flags,
            supplemental,
            mount_group,
        })
    }

    /// THE check of a capability's mount flags: every RPC that takes a
    /// capability calls it (CreateVolume, ValidateVolumeCapabilities,
    /// GetCapacity, ControllerExpandVolume, NodeStageVolume, every route
    /// of NodePublishVolume, NodeExpandVolume) before it looks at or
    /// changes anything. It asks crust-fs's allow-list (the one the guest
    /// agent applies too) for the filesystem the capability names, else
    /// the volume's (`volume_fs`), read-only as the access mode says. It
    /// depends on the capability alone, so one capability gets one answer
    /// on every route, whether or not the route mounts with the flags (a
    /// host publication is a bind, a handed-over one does nothing).
    /// Returns the flags normalized (one option per entry); raw block has
    /// none.
    pub fn checked_mount_flags(&self, volume_fs: FsType) -> Result<Vec<String>, BadMountFlags> {
        let fs = match self.access {
            Access::Block => return Ok(Vec::new()),
            Access::Mount { fs_type } => fs_type.unwrap_or(volume_fs),
        };
        let parsed = crust_fs::options::parse(fs, &self.mount_flags, self.mode.read_only())?;
        Ok(parsed.words)
    }

    pub fn spec(&self) -> CapSpec {
        CapSpec {
            access: self.access.clone(),
            mode: self.mode,
        }
    }

    /// A digest of the mount flags (empty string when there are none).
    pub fn flags_digest(&self) -> String {
        flags_digest(&self.mount_flags)
    }

    /// The fsGroup to apply: KEP-2857's supplemental group, else kubelet's
    /// `volume_mount_group`.
    pub fn fs_group(&self) -> Option<u32> {
        self.supplemental.map(|g| g.gid).or(self.mount_group)
    }
}

/// Validates the KEP-2857 supplemental group fields of a MountVolume.
fn parse_supplemental(
    group: &str,
    policy: &str,
    deferred: bool,
) -> Result<Option<SupplementalGroup>, String> {
    if group.is_empty() && policy.is_empty() {
        return Ok(None);
    }
    if !deferred {
        return Err(
            "volume_supplemental_group and volume_supplemental_group_change_policy are only \
             valid with deferred filesystem operations (defer_fs_ops, or deferFsOps=true in \
             the volume context)"
                .to_string(),
        );
    }
    if group.is_empty() {
        return Err(
            "volume_supplemental_group_change_policy is set without volume_supplemental_group"
                .to_string(),
        );
    }
    let gid = crust_handoff::validate::parse_fs_group(group)
        .map_err(|e| format!("volume_supplemental_group: {e}"))?;
    let change_policy = if policy.is_empty() {
        None
    } else {
        Some(FsGroupChangePolicy::parse(policy).map_err(|_| {
            format!(
                "volume_supplemental_group_change_policy {policy:?} is not supported \
                 (supported: Always, OnRootMismatch)"
            )
        })?)
    };
    Ok(Some(SupplementalGroup { gid, change_policy }))
}

pub fn flags_digest(flags: &[String]) -> String {
    if flags.is_empty() {
        return String::new();
    }
    let mut h = Sha256::new();
    for f in flags {
        h.update(f.as_bytes());
        h.update([0u8]);
    }
    hex(&h.finalize()[..16])
}

impl CapSpec {
    pub fn to_proto(&self) -> csi::VolumeCapability {
        use csi::volume_capability::{AccessMode as PMode, AccessType, BlockVolume, MountVolume};
        let access_type = match &self.access {
            Access::Block => AccessType::Block(BlockVolume {}),
            Access::Mount { fs_type } => AccessType::Mount(MountVolume {
                fs_type: fs_type.map(|f| f.as_str().to_string()).unwrap_or_default(),
                ..Default::default()
            }),
        };
        csi::VolumeCapability {
            access_type: Some(access_type),
            access_mode: Some(PMode {
                mode: self.mode.to_proto() as i32,
            }),
        }
    }
}

pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi::volume_capability::{AccessMode as PMode, AccessType, BlockVolume, MountVolume};

    fn cap(access: Option<AccessType>, mode: Mode) -> csi::VolumeCapability {
        csi::VolumeCapability {
            access_type: access,
            access_mode: Some(PMode { mode: mode as i32 }),
        }
    }

    #[test]
    fn validates_access_type_mode_and_fs() {
        let ok = Capability::from_proto(&cap(
            Some(AccessType::Mount(MountVolume {
                fs_type: "xfs".into(),
                ..Default::default()
            })),
            Mode::SingleNodeMultiWriter,
        ))
        .unwrap();
        assert_eq!(
            ok.access,
            Access::Mount {
                fs_type: Some(FsType::Xfs)
            }
        );
        assert!(
            Capability::from_proto(&cap(
                Some(AccessType::Block(BlockVolume {})),
                Mode::MultiNodeMultiWriter
            ))
            .unwrap_err()
            .contains("MULTI_NODE_MULTI_WRITER")
        );
        assert!(
            Capability::from_proto(&cap(
                Some(AccessType::Mount(MountVolume {
                    fs_type: "btrfs".into(),
                    ..Default::default()
                })),
                Mode::SingleNodeWriter
            ))
            .unwrap_err()
            .contains("btrfs")
        );
        assert!(Capability::from_proto(&cap(None, Mode::SingleNodeWriter)).is_err());
        let mut c = cap(
            Some(AccessType::Block(BlockVolume {})),
            Mode::SingleNodeWriter,
        );
        c.access_mode = None;
        assert!(Capability::from_proto(&c).is_err());
    }

    /// The one mount-flag check: the allow-list for the capability's own
    /// fsType else the volume's, read-only as the mode says; words come
    /// back one per entry; raw block has none.
    #[test]
    fn mount_flags_checked_for_the_capability_alone() {
        let with = |fs: &str, flags: &[&str], mode: Mode| {
            Capability::from_proto(&cap(
                Some(AccessType::Mount(MountVolume {
                    fs_type: fs.into(),
                    mount_flags: flags.iter().map(|f| f.to_string()).collect(),
                    ..Default::default()
                })),
                mode,
            ))
            .unwrap()
        };
        let ok = with("", &["noatime,commit=30"], Mode::SingleNodeWriter);
        assert_eq!(
            ok.checked_mount_flags(FsType::Ext4).unwrap(),
            ["noatime", "commit=30"]
        );
        let e = with("", &["commit=99999999999999999999"], Mode::SingleNodeWriter)
            .checked_mount_flags(FsType::Ext4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("commit") && !e.contains("9999"), "{e}");
        // xfs named by the capability: ext4's commit= is not xfs's.
        assert!(
            with("xfs", &["commit=30"], Mode::SingleNodeWriter)
                .checked_mount_flags(FsType::Ext4)
                .is_err()
        );
        assert!(
            with("", &["rw"], Mode::SingleNodeReaderOnly)
                .checked_mount_flags(FsType::Ext4)
                .is_err()
        );
        let raw = Capability::from_proto(&cap(
            Some(AccessType::Block(BlockVolume {})),
            Mode::SingleNodeWriter,
        ))
        .unwrap();
        assert!(raw.checked_mount_flags(FsType::Ext4).unwrap().is_empty());
    }

    #[test]
    fn spec_round_trips_through_proto() {
        let spec = CapSpec {
            access: Access::Mount {
                fs_type: Some(FsType::Ext4),
            },
            mode: AccessMode::SingleNodeSingleWriter,
        };
        let back = Capability::from_proto(&spec.to_proto()).unwrap().spec();
        assert_eq!(back, spec);
        assert_eq!(flags_digest(&[]), "");
        assert_ne!(
            flags_digest(&["noatime".into()]),
            flags_digest(&["noatime,".into()])
        );
    }

    #[test]
    fn supplemental_group_only_with_deferral() {
        let with = |group: &str, policy: &str| {
            cap(
                Some(AccessType::Mount(MountVolume {
                    fs_type: "ext4".into(),
                    volume_supplemental_group: group.into(),
                    volume_supplemental_group_change_policy: policy.into(),
                    ..Default::default()
                })),
                Mode::SingleNodeWriter,
            )
        };
        let e = Capability::from_proto(&with("100", "")).unwrap_err();
        assert!(e.contains("only valid with deferred"), "{e}");
        assert!(Capability::from_proto(&with("", "Always")).is_err());
        assert_eq!(
            Capability::from_proto(&with("", "")).unwrap().supplemental,
            None
        );

        let ok = Capability::from_proto_deferred(&with("100", "OnRootMismatch")).unwrap();
        assert_eq!(
            ok.supplemental,
            Some(SupplementalGroup {
                gid: 100,
                change_policy: Some(FsGroupChangePolicy::OnRootMismatch)
            })
        );
        let ok = Capability::from_proto_deferred(&with("0", "")).unwrap();
        assert_eq!(
            ok.supplemental,
            Some(SupplementalGroup {
                gid: 0,
                change_policy: None
            })
        );
        for (g, p, why) in [
            ("100", "Never", "not supported"),
            ("100", "always", "not supported"),
            ("", "Always", "without volume_supplemental_group"),
            ("x1", "", "not a decimal group id"),
            ("0100", "", "not a decimal group id"),
            ("4294967296", "", "32 bits"),
        ] {
            let e = Capability::from_proto_deferred(&with(g, p)).unwrap_err();
            assert!(e.contains(why), "{g:?} {p:?}: {e}");
        }
    }
}
