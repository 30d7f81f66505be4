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
pub mod liveness;
mod mountinfo;
mod store;
pub mod validate;

pub use error::{ErrorKind, HandoffError, Result};
pub use liveness::{Capabilities, SandboxLiveness, SandboxState};
pub use mountinfo::{
    CREATE_FILESYSTEM_KEY, ENCRYPTION_KEY_KEY, FS_GROUP_CHANGE_POLICY_KEY, FS_GROUP_KEY,
    FsGroupChangePolicy, MountInfo, VOLUME_TYPE_BLOCK, VOLUME_TYPE_DIRECTVOL,
};
pub use store::{
    DEFAULT_CRUST_ROOT, DEFAULT_KATA_ROOT, Layout, ListedRecord, MAX_RECORD_SIZE, MOUNT_INFO_FILE,
    Policy, RUNTIME_CLI_FILE, RecordState, SourceMatch, Store, crust_key, kata_key,
};

/// The tmpfs source name of the read-only placeholder the plugin mounts on
/// a publish target while the volume's filesystem is in a guest (a
/// deferred or handed-over publication): runtimes and tools recognise it
/// in the mount table by this name.
pub const PLACEHOLDER_SOURCE: &str = "crust-volume-elsewhere";

/// For a source under kubelet's pod directory
/// (`<kubelet_root>/pods/<uid>/volumes/...`), the `.../volumes` layer that
/// bounds [`Store::find_for_source`]. None for any other source.
pub fn kubelet_volumes_layer(source: &str, kubelet_root: &str) -> Option<String> {
    let kubelet_root = kubelet_root.trim_end_matches('/');
    let rest = source.strip_prefix(kubelet_root)?.strip_prefix("/pods/")?;
    let (uid, rest) = rest.split_once('/')?;
    if uid.is_empty() || uid == "." || uid == ".." {
        return None;
    }
    if rest != "volumes" && !rest.starts_with("volumes/") {
        return None;
    }
    Some(format!("{kubelet_root}/pods/{uid}/volumes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volumes_layer() {
        let src = "/var/lib/kubelet/pods/1234-ab/volumes/kubernetes.io~csi/pv1/mount/sub";
        assert_eq!(
            kubelet_volumes_layer(src, "/var/lib/kubelet").as_deref(),
            Some("/var/lib/kubelet/pods/1234-ab/volumes")
        );
        assert_eq!(
            kubelet_volumes_layer(src, "/var/lib/kubelet/").as_deref(),
            Some("/var/lib/kubelet/pods/1234-ab/volumes")
        );
        assert_eq!(
            kubelet_volumes_layer("/var/lib/kubelet/pods/x/etc-hosts", "/var/lib/kubelet"),
            None
        );
        assert_eq!(
            kubelet_volumes_layer("/var/lib/kubelet/pods/x/volumesx/a", "/var/lib/kubelet"),
            None
        );
        assert_eq!(kubelet_volumes_layer("/srv/a", "/var/lib/kubelet"), None);
        assert_eq!(
            kubelet_volumes_layer("/var/lib/kubelet/pods/../volumes/a", "/var/lib/kubelet"),
            None
        );
    }
}
