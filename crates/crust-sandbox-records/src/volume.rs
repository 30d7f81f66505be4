//! A deferred volume and its mounts, as a sandbox consumes them (found by
//! `crust_sandbox::discovery`).

use crust_handoff::{FsGroupChangePolicy, Layout, MountInfo};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Which hand-off layout a volume came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayoutKind {
    Crust,
    Kata,
}

impl LayoutKind {
    pub fn layout(self) -> Layout {
        match self {
            LayoutKind::Crust => Layout::Crust,
            LayoutKind::Kata => Layout::Kata,
        }
    }
}

/// A deferred volume as the sandbox consumes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    /// Short stable id: 12 hex chars of sha256(target). Also the agent's
    /// volume name.
    pub id: String,
    pub layout: LayoutKind,
    /// The target path the record was staged for (the "volume path").
    pub target: String,
    pub device: String,
    pub fstype: String,
    pub options: Vec<String>,
    pub fs_group: Option<u32>,
    pub fs_group_policy: Option<String>,
    /// Attached read-only (record option `ro`, or every OCI mount of it is `ro`).
    pub readonly: bool,
    /// Kata's `createFilesystem=true`: format the device before attaching
    /// it, only if it is blank.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub create_fs: bool,
    /// virtio-blk serial the guest sees (`crust` + id, 17 bytes).
    pub serial: String,
    /// QMP block node name.
    pub node_name: String,
    /// QMP device id.
    pub device_id: String,
    /// The record's I/O limits (metadata `ioLimits`, their wire form),
    /// applied at every plug; checked by `volumes::check_for_guest`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_limits: Option<String>,
    /// What proves the device is the one the record was written for
    /// (metadata `deviceIdentity`, its text form), checked by descriptor
    /// at every plug (`volumes::check_identity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
}

impl Volume {
    pub fn from_record(
        layout: LayoutKind,
        target: &str,
        mi: &MountInfo,
        oci_readonly: bool,
    ) -> Volume {
        let id = volume_id(target);
        Volume {
            serial: format!("crust{id}"),
            node_name: format!("crust-{id}"),
            device_id: format!("vblk-{id}"),
            id,
            layout,
            target: target.to_string(),
            device: mi.device.clone(),
            fstype: mi.fstype.clone(),
            options: mi.options.clone(),
            fs_group: mi.fs_group(),
            fs_group_policy: mi.fs_group_change_policy().map(|p| p.as_str().to_string()),
            readonly: oci_readonly || mi.options.iter().any(|o| o == "ro"),
            // Records are validated on read; an unreadable value is false.
            create_fs: mi.create_filesystem().ok().flatten().unwrap_or(false),
            io_limits: mi.metadata.get(crust_handoff::IO_LIMITS_KEY).cloned(),
            identity: mi.metadata.get(crust_handoff::DEVICE_IDENTITY_KEY).cloned(),
        }
    }

    /// A host block device a container gets as a device node (OCI
    /// `linux.devices`, kubelet's `volumeDevices`): no filesystem, no
    /// record; its target names the device (`dev:/dev/loop3`), which no
    /// volume path can be.
    pub fn raw_device(host: &std::path::Path, readonly: bool) -> Volume {
        let target = format!("dev:{}", host.display());
        let id = volume_id(&target);
        Volume {
            serial: format!("crust{id}"),
            node_name: format!("crust-{id}"),
            device_id: format!("vblk-{id}"),
            id,
            layout: LayoutKind::Crust,
            target,
            device: host.display().to_string(),
            fstype: String::new(),
            options: Vec::new(),
            fs_group: None,
            fs_group_policy: None,
            readonly,
            create_fs: false,
            io_limits: None,
            identity: None,
        }
    }

    pub fn fs_group_change_policy(&self) -> Option<FsGroupChangePolicy> {
        self.fs_group_policy
            .as_deref()
            .and_then(|p| FsGroupChangePolicy::parse(p).ok())
    }
}

/// 12 hex chars of sha256(target).
pub fn volume_id(target: &str) -> String {
    let d = Sha256::digest(target.as_bytes());
    d.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

/// An OCI mount served from a deferred volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadMount {
    /// [`Volume::id`].
    pub volume: String,
    /// Relative, normalized; empty for the volume root.
    pub subpath: String,
    pub destination: String,
    pub readonly: bool,
}
