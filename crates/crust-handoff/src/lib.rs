//! The hand-off records through which a CSI plugin (via crust_ops) tells a
//! VM runtime how to mount a volume inside its guest, and through which
//! the runtime says which sandbox consumes it and which CLI serves stats
//! and resize.
//!
//! Two layouts, one API ([`Store`]):
//! - [`Layout::Crust`] (KEP-2857): `<root>/<hex sha256(target)>/` with
//!   `mountInfo.json`, `runtime-cli` and an empty `<sandbox-id>` file.
//! - [`Layout::Kata`] (Kata direct volumes): `<root>/<base64url(path)>/`
//!   with `mountInfo.json` and an empty `<sandbox-id>` file.
//!
//! Records are validated when written and again when read, because the
//! reader (the runtime) must refuse a forged record: see [`Store::read`].
//! The root must be owned by the caller and writable by nobody else.
//! A CRUST record a sandbox claims is not removed until the claim is
//! released or the caller shows the claimant dead ([`Store::remove_with`]).

mod error;
pub mod kubelet;
pub mod liveness;
mod mountinfo;
pub mod qos;
mod store;
pub mod validate;

pub use error::{ErrorKind, HandoffError, Result};
pub use kubelet::kubelet_volumes_layer;
pub use liveness::{Capabilities, SandboxLiveness, SandboxState};
pub use mountinfo::{
    CREATE_FILESYSTEM_KEY, DEVICE_IDENTITY_KEY, ENCRYPTION_KEY_KEY, FS_GROUP_CHANGE_POLICY_KEY,
    FS_GROUP_KEY, FsGroupChangePolicy, MountInfo, VOLUME_TYPE_BLOCK, VOLUME_TYPE_DIRECTVOL,
};
pub use qos::{IO_LIMITS_KEY, IoLimits, QosError};
pub use store::{
    DEFAULT_CRUST_ROOT, DEFAULT_KATA_ROOT, Layout, ListedRecord, MAX_RECORD_SIZE, MOUNT_INFO_FILE,
    Policy, RUNTIME_CLI_FILE, RecordState, SourceMatch, Store, crust_key, kata_key,
};

/// The tmpfs source name of the placeholder the plugin mounts on
/// a publish target while the volume's filesystem is in a guest (a
/// deferred or handed-over publication): runtimes and tools recognise it
/// in the mount table by this name.
pub const PLACEHOLDER_SOURCE: &str = "crust-volume-elsewhere";
