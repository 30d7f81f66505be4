//! CSI Node service.
//!
//! * NodeStageVolume attaches the volume (loop device or static device);
//!   for filesystem access it creates the filesystem only on a blank
//!   device (never reformats: a device holding another filesystem or
//!   unknown data is FAILED_PRECONDITION) and mounts it at the staging
//!   path. The staging path must already exist as a directory (the CO
//!   creates it); if it does not, FAILED_PRECONDITION.
//! * NodePublishVolume bind-mounts the staging mount onto the target
//!   directory (created if missing; its parent must exist), or for raw
//!   block the device node onto a target file (created if missing).
//!   `readonly` is a read-only bind; for raw block, where a read-only bind
//!   does not stop writes to a device node, the device itself is set
//!   read-only (BLKROSET), so read-only and read-write raw publications of
//!   one volume cannot be mixed.
//! * Unpublish/unstage unmount, remove the target, detach: data is never
//!   deleted.
//! * Path syntax errors are INVALID_ARGUMENT; a path in the wrong state
//!   (missing, a file where a directory is needed, something else mounted
//!   there) is FAILED_PRECONDITION and nothing on the node is changed.
//!
//! KEP-2857: [`Driver::fs_ops_route`] decides whether a request's
//! filesystem operations are deferred to the pod's runtime (`defer_fs_ops`
//! in the request, or `deferFsOps=true` in the volume context); the
//! deferred paths are in `defer.rs`. With `--deferral disabled` a request
//! for deferral fails with FAILED_PRECONDITION instead of silently
//! mounting on the host. A volume staged with `deferFsOps=true` in its
//! volume context is attached and formatted but never mounted on the host.
//! While a sandbox's guest may have the filesystem mounted (a deferred
//! publication, a deferred or unmounted-for-deferral stage, or a sandbox's
//! claim on a hand-off record naming the device), a repeated
//! NodeStageVolume only checks that the device is attached: no probe,
//! e2fsck, resize2fs or mount on the host. Formatting, offline growth and
//! host remounts also refuse (FAILED_PRECONDITION) a device another
//! process has open (QEMU does not open it `O_EXCL`).

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crust_blockdev::{MountError, Probe};
use crust_proto::csi::v1 as csi;
use csi::node_server::Node;
use tonic::{Request, Response, Status};

use crate::caps::{Access, Capability, FsType};
use crate::config::Expansion;
use crate::driver::{Driver, blocking};
use crate::error::NodeError;
use crate::state::{HostMount, Phase, Publication, Staging, VolumeRecord};

type Result<T> = std::result::Result<T, NodeError>;

/// Volume-context key that selects deferred filesystem operations.
pub const DEFER_CONTEXT_KEY: &str = "deferFsOps";

/// How a request's filesystem operations are carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsOps {
    /// The plugin mounts/measures/grows on the host (standard CSI).
    Host,
    /// The pod's runtime mounts the filesystem in its guest; the plugin
    /// hands the device over through crust_ops.
    Deferred,
}

/// A StorageClass's `deferFsOps` (copied into the volume context).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeferMode {
    /// Host mounts; a VM runtime that asks gets the volume by handover
    /// (the default).
    Auto,
    /// Deferred at NodeStage/NodePublish, as KEP-2857 `defer_fs_ops`
    /// (for runtimes that only read hand-off records, e.g. Kata).
    Always,
    /// Host mounts only; never handed over.
    Never,
}

impl DeferMode {
    /// `auto` (or absent), `true`, `false`.
    pub fn parse(v: Option<&str>) -> std::result::Result<DeferMode, String> {
        match v {
            None | Some("auto") => Ok(DeferMode::Auto),
            Some("true") => Ok(DeferMode::Always),
            Some("false") => Ok(DeferMode::Never),
            Some(v) => Err(format!(
                "{DEFER_CONTEXT_KEY}={}: expected \"auto\", \"true\" or \"false\"",
                crust_fs::quote(v)
            )),
        }
    }

    /// The mode a volume was created with (its parameters).
    pub fn of(rec: &VolumeRecord) -> DeferMode {
        DeferMode::parse(rec.parameters.get(DEFER_CONTEXT_KEY).map(String::as_str))
            .unwrap_or(DeferMode::Auto)
    }
}

/// Whether a volume context asks for deferral at stage/publish
/// (`deferFsOps=true`).
pub(crate) fn context_defers(volume_context: Option<&HashMap<String, String>>) -> Result<bool> {
    let v = volume_context.and_then(|c| c.get(DEFER_CONTEXT_KEY));
    DeferMode::parse(v.map(String::as_str))
        .map(|m| m == DeferMode::Always)
        .map_err(|e| NodeError::InvalidArgument(format!("volume_context {e}")))
}

pub(crate) fn abs_path(field: &'static str, p: &str) -> Result<PathBuf> {
    if p.is_empty() {
        return Err(NodeError::Missing(field));
    }
    crust_blockdev::validate_abs_path(p)
        .map_err(|e| NodeError::InvalidArgument(format!("{field}: {e}")))
}

fn node_cap(cap: Option<&csi::VolumeCapability>) -> Result<Capability> {
    let cap = cap.ok_or(NodeError::Missing("volume_capability"))?;
    Capability::from_proto(cap).map_err(NodeError::InvalidArgument)
}

pub(crate) fn mount_err(e: MountError) -> NodeError {
    match e {
        MountError::InvalidOption { .. } => NodeError::InvalidArgument(e.to_string()),
        MountError::BadTarget(_)
        | MountError::TargetInUse { .. }
        | MountError::ReadOnlyMismatch { .. }
        | MountError::Busy { .. } => NodeError::FailedPrecondition(e.to_string()),
        other => NodeError::Internal(other.to_string()),
    }
}

/// Maps a format/grow error: a device that is mounted or open in another
/// process (a sandbox's QEMU) is FAILED_PRECONDITION, the rest INTERNAL.
pub(crate) fn fs_err(context: &str, e: crust_blockdev::FsError) -> NodeError {
    use crust_blockdev::FsError;
    match e {
        FsError::InUse { .. } | FsError::OpenElsewhere { .. } => {
            NodeError::FailedPrecondition(e.to_string())
        }
        other => NodeError::Internal(format!("{context}: {other}")),
    }
}

/// Sets or clears the kernel read-only flag of a block device (BLKROSET).
/// Private helper: crust-blockdev has no wrapper for it.
fn set_device_read_only(dev: &Path, ro: bool) -> io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    use rustix::ioctl::{Setter, ioctl};
    let fd = rustix::fs::open(dev, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    let st = rustix::fs::fstat(&fd)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::BlockDevice {
        return Err(io::Error::other(format!(
            "{} is not a block device",
            dev.display()
        )));
    }
    let v: libc::c_int = ro.into();
    // SAFETY: BLKROSET reads one int through the pointer Setter passes.
    unsafe {
        ioctl(
            &fd,
            Setter::<{ linux_raw_sys::ioctl::BLKROSET as rustix::ioctl::Opcode }, libc::c_int>::new(
                v,
            ),
        )
    }?;
    Ok(())
}

/// Mount flags as the one allow-list normalizes them (one option per
/// entry), as recorded for a handover.
fn normalized_options(fs: FsType, flags: &[String]) -> Result<Vec<String>> {
    crust_fs::options::parse(fs, flags, false)
        .map(|p| p.words)
        .map_err(|e| NodeError::InvalidArgument(e.to_string()))
}

/// kubelet delegated fsGroup (VOLUME_MOUNT_GROUP): its group on the
/// volume, as kubelet's own SetVolumeOwnership would with
/// fsGroupChangePolicy OnRootMismatch (kubelet passes no policy to a
/// driver; a full walk on every publish would make pod starts
/// proportional to the volume's file count).
fn apply_fs_group(id: &str, root: &Path, gid: u32) -> Result<()> {
    let walked = crust_fsgroup::apply(
        root,
        gid,
        crust_fsgroup::FsGroupPolicy::OnRootMismatch,
        None,
    )
    .map_err(|e| NodeError::Internal(format!("volume {id}: {e}")))?;
    if walked {
        tracing::info!(volume = %id, gid, "applied fsGroup (volume_mount_group) on the host mount");
    }
    Ok(())
}

/// Bytes an ext4 filesystem spans, from its superblock (blocks count x
/// block size). Private helper: crust-blockdev has no superblock reader
/// that returns the size.
fn ext4_fs_bytes(dev: &Path) -> io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let mut sb = [0u8; 1024];
    fs::File::open(dev)?.read_exact_at(&mut sb, 1024)?;
    let le32 = |o: usize| u32::from_le_bytes(sb[o..o + 4].try_into().expect("4 bytes")) as u64;
    if u16::from_le_bytes([sb[0x38], sb[0x39]]) != 0xEF53 {
        return Err(io::Error::other("no ext4 superblock"));
    }
    let log = le32(0x18);
    if log > 6 {
        return Err(io::Error::other("implausible ext4 block size"));
    }
    let mut blocks = le32(0x04);
    const INCOMPAT_64BIT: u64 = 0x80;
    if le32(0x60) & INCOMPAT_64BIT != 0 {
        blocks |= le32(0x150) << 32;
    }
    Ok(blocks * (1024 << log))
}

/// Bytes an xfs filesystem's data section spans, from its superblock
/// (`sb_dblocks` x `sb_blocksize`, big-endian).
fn xfs_fs_bytes(dev: &Path) -> io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let mut sb = [0u8; 16];
    fs::File::open(dev)?.read_exact_at(&mut sb, 0)?;
    if &sb[0..4] != b"XFSB" {
        return Err(io::Error::other("no xfs superblock"));
    }
    let block = u32::from_be_bytes(sb[4..8].try_into().expect("4 bytes")) as u64;
    let blocks = u64::from_be_bytes(sb[8..16].try_into().expect("8 bytes"));
    Ok(blocks * block)
}

/// Grows a freshly mounted xfs that is at least 1 MiB smaller than its
/// device (a volume restored or cloned into a larger size; xfs grows only
/// while mounted).
fn grow_xfs_to_device(id: &str, device: &Path, mountpoint: &Path) -> Result<()> {
    let fs_bytes = xfs_fs_bytes(device).map_err(|e| {
        NodeError::Internal(format!(
            "reading the xfs superblock of {}: {e}",
            device.display()
        ))
    })?;
    let dev_bytes = crust_blockdev::block_device_size(device)
        .map_err(|e| NodeError::Internal(format!("reading device size: {e}")))?;
    if dev_bytes >= fs_bytes + (1 << 20) {
        crust_blockdev::grow_fs(device, mountpoint, crust_blockdev::FsType::Xfs)
            .map_err(|e| fs_err(&format!("growing xfs on {}", device.display()), e))?;
        tracing::info!(volume = %id, device = %device.display(), "grew xfs to the device size after mounting");
    }
    Ok(())
}

/// The mount flags for `rec`'s filesystem: the capability's, plus
/// `nouuid` for an xfs copied from a snapshot or volume (it shares its
/// source's UUID, and the kernel refuses a second xfs with one).
pub(crate) fn mount_flags_of(rec: &VolumeRecord, fs: FsType, flags: &[String]) -> Vec<String> {
    let mut flags = flags.to_vec();
    if fs == FsType::Xfs && rec.content_source.is_some() && !flags.iter().any(|f| f == "nouuid") {
        flags.push("nouuid".into());
    }
    flags
}

/// Whether the ext4 on `dev` is at least 1 MiB smaller than the device
/// (a grown volume whose filesystem was not grown yet).
fn ext4_needs_grow(dev: &Path) -> Result<bool> {
    let fs_bytes = ext4_fs_bytes(dev).map_err(|e| {
        NodeError::Internal(format!(
            "reading the ext4 superblock of {}: {e}",
            dev.display()
        ))
    })?;
    let dev_bytes = crust_blockdev::block_device_size(dev)
        .map_err(|e| NodeError::Internal(format!("reading device size: {e}")))?;
    Ok(dev_bytes >= fs_bytes + (1 << 20))
}

/// The device's current size after picking up a grown backing store
/// (LOOP_SET_CAPACITY for loop devices), checked against the requested
/// capacity range of a NodeExpandVolume.
pub(crate) fn refreshed_device_size(
    id: &str,
    device: &Path,
    required: u64,
    limit: u64,
) -> Result<u64> {
    let size = match crust_blockdev::loop_status(device) {
        Ok(Some(_)) => crust_blockdev::refresh_capacity(device)
            .map_err(|e| NodeError::Internal(format!("refreshing device size: {e}")))?,
        _ => crust_blockdev::block_device_size(device)
            .map_err(|e| NodeError::Internal(format!("reading device size: {e}")))?,
    };
    if required > size {
        return Err(NodeError::OutOfRange(format!(
            "device {} of volume {id} is {size} bytes, less than the {required} bytes \
             requested; expand the volume with ControllerExpandVolume first",
            device.display()
        )));
    }
    if limit != 0 && size > limit {
        return Err(NodeError::OutOfRange(format!(
            "device of volume {id} is already {size} bytes, above limit_bytes {limit}"
        )));
    }
    Ok(size)
}

/// Checks that `p` is an existing directory (not a symlink).
pub(crate) fn require_dir(field: &str, p: &Path) -> Result<()> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) if m.file_type().is_symlink() => Err(NodeError::FailedPrecondition(format!(
            "{field} {} is a symbolic link; a real directory is required",
            p.display()
        ))),
        Ok(_) => Err(NodeError::FailedPrecondition(format!(
            "{field} {} exists but is not a directory",
            p.display()
        ))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(NodeError::FailedPrecondition(format!(
                "{field} {} does not exist; the CO must create it first",
                p.display()
            )))
        }
        Err(e) => Err(NodeError::Internal(format!("{field} {}: {e}", p.display()))),
    }
}

/// Creates the publish target if missing; returns whether it was created.
///
/// A raw block target must be missing (created here, and recorded so that
/// unpublish removes only what the plugin created), an empty regular file,
/// or this volume's own earlier bind (`staged_device`): an existing device
/// node or a file with data is refused, because a bind over it would hide
/// it and an unpublish would delete it.
pub(crate) fn prepare_target(
    target: &Path,
    block: bool,
    staged_device: Option<&Path>,
) -> Result<bool> {
    let t = target.display();
    if let Some(parent) = target.parent() {
        match fs::metadata(parent) {
            Ok(m) if m.is_dir() => {}
            _ => {
                return Err(NodeError::FailedPrecondition(format!(
                    "parent directory {} of target_path does not exist; the CO must create it",
                    parent.display()
                )));
            }
        }
    }
    match fs::symlink_metadata(target) {
        Ok(m) if m.file_type().is_symlink() => Err(NodeError::FailedPrecondition(format!(
            "target_path {t} is a symbolic link; refusing to follow it"
        ))),
        Ok(m) if block && m.is_dir() => Err(NodeError::FailedPrecondition(format!(
            "target_path {t} is a directory; a raw block volume is published as a file"
        ))),
        // A device node here is acceptable only as this volume's own bind.
        Ok(m) if block && m.file_type().is_block_device() => {
            if staged_device.is_some_and(|d| is_bind_of_device(d, target)) {
                Ok(false)
            } else {
                Err(NodeError::FailedPrecondition(format!(
                    "target_path {t} is an existing device node and not this volume's \
                     publication; refusing to publish over it"
                )))
            }
        }
        Ok(m) if block && !m.is_file() => Err(NodeError::FailedPrecondition(format!(
            "target_path {t} exists and is not a regular file"
        ))),
        Ok(m) if block && m.len() > 0 => Err(NodeError::FailedPrecondition(format!(
            "target_path {t} is a file with data ({} bytes); a raw block volume is published \
             on a new or empty file only",
            m.len()
        ))),
        Ok(m) if !block && !m.is_dir() => Err(NodeError::FailedPrecondition(format!(
            "target_path {t} exists and is not a directory; a filesystem volume needs a directory"
        ))),
        Ok(_) => Ok(false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let r = if block {
                fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(target)
                    .map(drop)
            } else {
                fs::DirBuilder::new().mode(0o750).create(target)
            };
            r.map_err(|e| NodeError::Internal(format!("creating target_path {t}: {e}")))?;
            Ok(true)
        }
        Err(e) => Err(NodeError::Internal(format!("target_path {t}: {e}"))),
    }
}

/// Whether `target` is a mount whose object is the device node `device`
/// (a raw block publication).
fn is_bind_of_device(device: &Path, target: &Path) -> bool {
    if !crust_blockdev::is_mountpoint(target).unwrap_or(false) {
        return false;
    }
    match (rustix::fs::stat(device), rustix::fs::stat(target)) {
        (Ok(d), Ok(t)) => {
            rustix::fs::FileType::from_raw_mode(t.st_mode) == rustix::fs::FileType::BlockDevice
                && d.st_rdev == t.st_rdev
        }
        _ => false,
    }
}

/// Whether the topmost mount at `target` is provably the staged volume's:
/// for raw block a bind of its device node; for a filesystem a mount of
/// its device's filesystem showing the filesystem's root (the staging
/// mount, or a bind of it).
pub(crate) fn publication_of(s: &Staging, target: &Path) -> bool {
    if s.block {
        return is_bind_of_device(&s.device, target);
    }
    let Ok(Some(m)) = crust_blockdev::find_mount(target) else {
        return false;
    };
    crust_blockdev::device_major_minor(&s.device).ok() == Some((m.major, m.minor))
        && m.root == Path::new("/")
}

/// What is mounted at `path`, if anything, for an error message.
fn mounted_source(path: &Path) -> Option<String> {
    crust_blockdev::find_mount(path)
        .ok()
        .flatten()
        .map(|m| format!("{} ({})", m.source, m.fs_type))
}

/// Whether `path` is a mount of the filesystem on `device`.
pub(crate) fn mounted_here(device: &Path, path: &Path) -> Result<bool> {
    let Some(m) = crust_blockdev::find_mount(path).map_err(mount_err)? else {
        return Ok(false);
    };
    Ok(
        crust_blockdev::device_major_minor(device).ok() == Some((m.major, m.minor))
            && m.root == Path::new("/"),
    )
}

/// Flushes the filesystem mounted at `path`, then unmounts it. A busy
/// mount (open files) is FAILED_PRECONDITION and stays mounted.
pub(crate) fn sync_and_unmount(path: &Path) -> Result<()> {
    use rustix::fs::{Mode, OFlags};
    // The descriptor must be closed before unmounting (it pins the mount).
    match rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => {
            if let Err(e) = rustix::fs::syncfs(&fd) {
                tracing::warn!(path = %path.display(), error = %e, "syncfs failed before unmount");
            }
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot open mount to sync it")
        }
    }
    crust_blockdev::unmount(path).map_err(mount_err)
}

/// Removes a publish target after unmounting: an empty directory, or an
/// empty regular file the plugin created (`created_file`). Anything else
/// (a device node, a file with data, a file the plugin did not create) is
/// left where it is.
pub(crate) fn remove_target(target: &Path, created_file: bool) {
    let r = match fs::symlink_metadata(target) {
        Ok(m) if m.is_dir() => fs::remove_dir(target),
        Ok(m) if created_file && m.is_file() && m.len() == 0 => fs::remove_file(target),
        Ok(_) => {
            tracing::info!(target = %target.display(), "publish target left in place (not created by the plugin, or not empty)");
            Ok(())
        }
        Err(_) => Ok(()),
    };
    if let Err(e) = r {
        tracing::warn!(target = %target.display(), error = %e, "could not remove publish target");
    }
}

impl Driver {
    /// KEP-2857 seam: decides how filesystem operations of a request are
    /// carried out: deferred to the pod's runtime when the request
    /// (`defer_fs_ops`) or the volume context (`deferFsOps=true`) asks for
    /// it. A plugin started with `--deferral disabled` refuses such a
    /// request (FAILED_PRECONDITION), never serving it with a host mount.
    pub fn fs_ops_route(
        &self,
        requested: bool,
        volume_context: Option<&HashMap<String, String>>,
    ) -> Result<FsOps> {
        let from_context = context_defers(volume_context)?;
        if !(requested || from_context) {
            return Ok(FsOps::Host);
        }
        if !self.deferral_enabled() {
            return Err(NodeError::DeferralUnsupported);
        }
        Ok(FsOps::Deferred)
    }

    pub(crate) fn node_record(&self, id: &str) -> Result<VolumeRecord> {
        match self.state.get(id) {
            Some(r) if r.phase == Phase::Ready => Ok(r),
            _ => Err(NodeError::NotFound(id.to_string())),
        }
    }

    /// [`Driver::node_record`] for NodeStage/NodePublish, which carry the
    /// volume context: a volume of another node (named by the record or
    /// by the context's `<driver>/node`) is FAILED_PRECONDITION naming
    /// that node, the spec's code for a CO exceeding a volume's
    /// single-node capability, rather than NOT_FOUND: the volume exists,
    /// just not here.
    pub(crate) fn node_record_here(
        &self,
        id: &str,
        volume_context: &HashMap<String, String>,
    ) -> Result<VolumeRecord> {
        let owner = match self.state.get(id) {
            Some(r) if r.phase == Phase::Ready && r.node_id == self.cfg.node_id => return Ok(r),
            Some(r) if r.phase == Phase::Ready => Some(r.node_id),
            _ => volume_context
                .get(&self.cfg.topology_key())
                .filter(|n| **n != self.cfg.node_id)
                .cloned(),
        };
        match owner {
            Some(node) => Err(NodeError::FailedPrecondition(format!(
                "volume {id} lives on node {node:?}, this is node {:?}: a local volume can only \
                 be staged and published on its own node",
                self.cfg.node_id
            ))),
            None => Err(NodeError::NotFound(id.to_string())),
        }
    }

    /// `--expansion node`: grows the backing store to the requested size
    /// (the controller does not, since it does not advertise EXPAND_VOLUME)
    /// and records the new capacity. A request within the current size
    /// changes nothing.
    fn grow_backing_on_node(
        &self,
        rec: &mut VolumeRecord,
        required: u64,
        limit: u64,
    ) -> Result<()> {
        if self.cfg.expansion != Expansion::Node || required <= rec.capacity_bytes {
            return Ok(());
        }
        let target = crate::controller::align(required, limit)
            .map_err(|e| NodeError::OutOfRange(e.to_string()))?;
        let grown = self.backend.expand(&rec.id, target)?;
        rec.capacity_bytes = grown;
        self.state.put(rec.clone())?;
        tracing::info!(volume = %rec.id, size = grown, "backing store grown by NodeExpandVolume");
        Ok(())
    }

    fn stage_gate(&self) {
        if let Some(gate) = &self.cfg.hooks.stage_gate {
            gate.pass();
        }
    }

    #[allow(
        clippy::too_many_lines,
        reason = "to be split by the node service's route dispatch (issue 11), after the handover lands in this file"
    )]
    pub fn node_stage_volume(&self, req: &csi::NodeStageVolumeRequest) -> Result<()> {
        if req.volume_id.is_empty() {
            return Err(NodeError::Missing("volume_id"));
        }
        let path = abs_path("staging_target_path", &req.staging_target_path)?;
        let cap = node_cap(req.volume_capability.as_ref())?;
        let deferred = self.fs_ops_route(false, Some(&req.volume_context))? == FsOps::Deferred;
        if deferred && cap.access.is_block() {
            return Err(NodeError::InvalidArgument(
                "deferFsOps=true cannot be used with raw block access: deferral hands a \
                 filesystem to the pod's runtime, a raw block volume has none"
                    .into(),
            ));
        }
        let _guard = self.guards.try_begin(&req.volume_id, "NodeStageVolume")?;
        self.stage_gate();
        let mut rec = self.node_record_here(&req.volume_id, &req.volume_context)?;
        let id = rec.id.clone();
        let block = cap.access.is_block();
        if block && !rec.allows_block() {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {id} was created for filesystem access only; it cannot be staged as raw block"
            )));
        }
        if !block && !rec.allows_mount() {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {id} was created for raw block access only; staging it as a filesystem would format it"
            )));
        }
        let fs_type: Option<FsType> = match cap.access {
            Access::Block => None,
            Access::Mount { fs_type: Some(f) } => Some(f),
            Access::Mount { fs_type: None } => Some(rec.fs_type),
        };
        if let Some(f) = fs_type
            && f != rec.fs_type
        {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {id} has fsType {}; the capability asks for {f}",
                rec.fs_type
            )));
        }
        let readonly = cap.mode.read_only();
        let wanted = Staging {
            path: path.clone(),
            device: PathBuf::new(),
            block,
            fs_type,
            readonly,
            mode: cap.mode,
            flags_digest: cap.flags_digest(),
            deferred,
            host_mount: if deferred {
                HostMount::UnmountedForDeferral
            } else {
                HostMount::Mounted
            },
            mount_options: match fs_type {
                Some(fs) => normalized_options(fs, &mount_flags_of(&rec, fs, &cap.mount_flags))?,
                None => Vec::new(),
            },
        };
        let repeat = match &rec.staging {
            Some(s) if s.path != path => {
                return Err(NodeError::FailedPrecondition(format!(
                    "volume {id} is already staged at {}; unstage it first (one staging path per volume)",
                    s.path.display()
                )));
            }
            Some(s) => {
                let same = s.block == wanted.block
                    && s.fs_type == wanted.fs_type
                    && s.mode == wanted.mode
                    && s.flags_digest == wanted.flags_digest;
                if !same {
                    return Err(NodeError::AlreadyExists(format!(
                        "volume {id} is already staged at {} with a different capability \
                         ({}, {:?})",
                        path.display(),
                        if s.block { "block" } else { "mount" },
                        s.mode
                    )));
                }
                if s.deferred != deferred {
                    return Err(NodeError::AlreadyExists(format!(
                        "volume {id} is already staged at {} {} deferred filesystem operations \
                         ({DEFER_CONTEXT_KEY}={}); unstage it first to change that",
                        path.display(),
                        if s.deferred { "with" } else { "without" },
                        s.deferred
                    )));
                }
                true
            }
            None => false,
        };
        require_dir("staging_target_path", &path)?;
        if let Some(fs) = fs_type {
            // Reject bad mount flags before touching anything.
            crust_blockdev::parse_mount_options(fs, &cap.mount_flags, readonly)
                .map_err(mount_err)?;
        }
        let attached = self.backend.attached_device(&id)?;
        if !block && let Some(why) = self.guest_may_have_fs(&rec, attached.as_deref()) {
            // kubelet repeats NodeStageVolume on every pod start and after
            // its own restarts: while a sandbox's guest may have the
            // filesystem mounted the host neither probes, checks, grows
            // nor mounts it (QEMU does not hold the device O_EXCL, so
            // nothing else would stop a host e2fsck).
            if !repeat {
                return Err(NodeError::FailedPrecondition(format!(
                    "volume {id}: {why}; the host will not check or mount its filesystem"
                )));
            }
            return self.restage_for_guest(rec, &why);
        }
        let mut unmount_ours = false;
        if !repeat
            && !block
            && let Some(m) = crust_blockdev::find_mount(&path).map_err(mount_err)?
        {
            // Our own mount from a stage that crashed before recording it
            // is adopted (or, for a deferred stage, removed); anything
            // else there is refused.
            let ours = attached
                .as_deref()
                .and_then(|d| crust_blockdev::device_major_minor(d).ok())
                == Some((m.major, m.minor));
            if !ours {
                return Err(NodeError::FailedPrecondition(format!(
                    "staging_target_path {} already has {} mounted on it",
                    path.display(),
                    m.source
                )));
            }
            unmount_ours = deferred;
        }
        // What the host mount should be after this call: a deferred stage
        // never mounts (a repeated stage unmounted for deferral returned
        // above; a host publication mounts it again, see
        // remount_staging); a host stage is mounted (or repaired).
        let host_mount = match &rec.staging {
            Some(s) if repeat => s.host_mount,
            _ => wanted.host_mount,
        };
        let was_attached = attached.is_some();
        let device = self.backend.attach(&id)?;
        // Undo our attach if the rest fails, so a failed stage changes nothing.
        let undo = |e: NodeError| {
            if !repeat
                && !was_attached
                && let Err(de) = self.backend.detach(&id)
            {
                tracing::warn!(volume = %id, error = %de, "could not detach after failed stage");
            }
            e
        };
        if let Some(fs) = fs_type {
            if unmount_ours {
                sync_and_unmount(&path).map_err(undo)?;
            }
            // A mount of ours still here (adopted above) proves a format
            // that finished before the plugin died: it holds the device.
            let ours_mounted = mounted_here(&device, &path).map_err(undo)?;
            self.ensure_filesystem(&mut rec, &device, fs, ours_mounted)
                .map_err(undo)?;
            if host_mount == HostMount::Mounted {
                // A device that was already attached may be open in a
                // sandbox's QEMU: never mount it on the host then. (A
                // device this call attached is open nowhere else.)
                if was_attached && !mounted_here(&device, &path)? {
                    crust_blockdev::ensure_no_other_openers(&device, crust_blockdev::fs::MOUNT)
                        .map_err(|e| fs_err("checking for other openers", e))?;
                }
                let fresh_mount = !mounted_here(&device, &path)?;
                let mut flags = mount_flags_of(&rec, fs, &cap.mount_flags);
                if fresh_mount {
                    // A filesystem a guest had: checked in userspace first.
                    flags = self
                        .check_after_guest(&rec, &device, fs, flags)
                        .map_err(undo)?;
                }
                crust_blockdev::mount_fs(&device, &path, fs, &flags, readonly)
                    .map_err(mount_err)
                    .map_err(undo)?;
                if fresh_mount && rec.returned.take().is_some() {
                    tracing::info!(volume = %id, "filesystem back from a guest passed its check and is mounted on the host");
                }
                // Only when this call mounted it: growing a mounted volume
                // is NodeExpandVolume's job, a repeated stage changes nothing.
                if fresh_mount && fs == FsType::Xfs && !readonly {
                    grow_xfs_to_device(&id, &device, &path)?;
                }
            }
        } else if readonly {
            set_device_read_only(&device, true)
                .map_err(|e| {
                    NodeError::Internal(format!("setting {} read-only: {e}", device.display()))
                })
                .map_err(undo)?;
        }
        let staging = Staging {
            device,
            host_mount,
            ..wanted
        };
        // Raw use is recorded before the device can reach a workload (the
        // publish comes after this call): its data may carry no signature.
        rec.raw_block_used |= block;
        rec.staging = Some(staging.clone());
        if self.state.get(&id).as_ref() != Some(&rec) {
            self.state.put(rec)?;
        }
        self.health.forget(&id);
        tracing::info!(volume = %id, path = %path.display(), device = %staging.device.display(), block, deferred, "volume staged");
        Ok(())
    }

    /// Makes sure `device` holds a filesystem of type `fs`, creating it on
    /// a blank device only. Blank means: no signature libblkid knows and
    /// zero edges ([`Probe::Blank`]), AND the volume's record says it was
    /// never used as raw block (such data has no signature) and crust never
    /// formatted it before. The start of a format is recorded first, so a
    /// stage killed mid-format redoes its own half-made filesystem (and
    /// waits while the orphaned tool still holds the device).
    fn ensure_filesystem(
        &self,
        rec: &mut VolumeRecord,
        device: &Path,
        fs: FsType,
        ours_mounted: bool,
    ) -> Result<()> {
        let id = rec.id.clone();
        let interrupted = rec.format_started == Some(fs) && rec.formatted.is_none();
        if interrupted
            && !ours_mounted
            && crust_blockdev::is_device_held_exclusively(device).unwrap_or(true)
        {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {id}: a format started by an earlier plugin process is still running \
                 on {} (the device is in use); retry",
                device.display()
            )));
        }
        let found =
            crust_blockdev::probe_fs(device).map_err(|e| NodeError::Internal(e.to_string()))?;
        let mkfs = |rec: &mut VolumeRecord, again: bool| -> Result<()> {
            rec.format_started = Some(fs);
            self.state.put(rec.clone())?;
            let r = if again {
                crust_blockdev::mkfs_again(device, fs)
            } else {
                crust_blockdev::mkfs(device, fs)
            };
            r.map_err(|e| fs_err(&format!("creating {fs} on {}", device.display()), e))?;
            rec.formatted = Some(fs);
            tracing::info!(volume = %id, device = %device.display(), %fs, again, "created filesystem on blank volume");
            Ok(())
        };
        match found {
            Probe::Blank if rec.raw_block_used => Err(NodeError::FailedPrecondition(format!(
                "volume {id} was used as a raw block device: its data need not carry any \
                 signature, so it is never formatted; refusing to create {fs} on it"
            ))),
            Probe::Blank if rec.formatted.is_some() => Err(NodeError::FailedPrecondition(format!(
                "volume {id} was formatted with {} by this plugin before and now looks blank \
                 (wiped or replaced behind the plugin's back?); refusing to format it again",
                rec.formatted.map(|f| f.as_str()).unwrap_or_default()
            ))),
            Probe::Blank => mkfs(rec, false),
            p if p.fs_type() == Some(fs) => {
                if interrupted {
                    rec.formatted = Some(fs);
                }
                // A volume expanded while it was not staged (or while
                // online ext4 growth was impossible): grow before mounting.
                // Mounted on the host (our staging mount): NodeExpandVolume
                // grows it online. Open in another process (a guest's QEMU,
                // which O_EXCL does not see): grow_fs_offline refuses.
                if fs == FsType::Ext4
                    && ext4_needs_grow(device)?
                    && !crust_blockdev::is_device_held_exclusively(device).unwrap_or(true)
                {
                    crust_blockdev::grow_fs_offline(device, fs)
                        .map_err(|e| fs_err(&format!("growing ext4 on {}", device.display()), e))?;
                    tracing::info!(volume = %id, device = %device.display(), "grew ext4 to the device size before mounting");
                }
                Ok(())
            }
            // Our own format, interrupted: never published, so nothing but
            // the half-made filesystem can be there.
            _ if interrupted && !rec.raw_block_used => mkfs(rec, true),
            p => Err(NodeError::FailedPrecondition(format!(
                "volume {id} holds {p}, not {fs}; refusing to format or mount it (data is never overwritten)"
            ))),
        }
    }

    pub fn node_unstage_volume(&self, req: &csi::NodeUnstageVolumeRequest) -> Result<()> {
        if req.volume_id.is_empty() {
            return Err(NodeError::Missing("volume_id"));
        }
        let path = abs_path("staging_target_path", &req.staging_target_path)?;
        let _guard = self.guards.try_begin(&req.volume_id, "NodeUnstageVolume")?;
        let mut rec = self.node_record(&req.volume_id)?;
        let id = rec.id.clone();
        let Some(s) = rec.staging.clone() else {
            return self.unstage_unrecorded(&id, &path);
        };
        if s.path != path {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {id} is staged at {}, not at {}",
                s.path.display(),
                path.display()
            )));
        }
        if !rec.published.is_empty() {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {id} is still published at {:?}; unpublish it first",
                rec.published.keys().collect::<Vec<_>>()
            )));
        }
        if !s.block && crust_blockdev::is_mountpoint(&path).map_err(mount_err)? {
            // Only this volume's own staging mount is removed (a host
            // publication that crashed after remounting the staging path
            // may have left one although the records say unmounted).
            if !mounted_here(&s.device, &path)? {
                return Err(NodeError::FailedPrecondition(format!(
                    "staging_target_path {} has {} mounted on it, which is not volume {id}'s \
                     filesystem; nothing was unmounted",
                    path.display(),
                    mounted_source(&path).unwrap_or_else(|| "something".into())
                )));
            }
            crust_blockdev::unmount_top(&path).map_err(mount_err)?;
        }
        if s.block && s.readonly && s.device.exists() {
            let _ = set_device_read_only(&s.device, false);
        }
        self.backend.detach(&id).map_err(|e| {
            NodeError::FailedPrecondition(format!(
                "volume {id}: cannot detach {} (still in use?): {e}",
                s.device.display()
            ))
        })?;
        rec.staging = None;
        self.state.put(rec)?;
        self.health.forget(&id);
        tracing::info!(volume = %id, path = %path.display(), "volume unstaged");
        Ok(())
    }

    /// Unstage of a volume the records say is not staged: undo what a
    /// stage that crashed before recording may have left (its mount at
    /// `path`, its attached device); otherwise nothing to do.
    fn unstage_unrecorded(&self, id: &str, path: &Path) -> Result<()> {
        let Some(dev) = self.backend.attached_device(id)? else {
            return Ok(());
        };
        let Ok(numbers) = crust_blockdev::device_major_minor(&dev) else {
            return Ok(());
        };
        if let Some(m) = crust_blockdev::find_mount(path).map_err(mount_err)?
            && (m.major, m.minor) == numbers
        {
            crust_blockdev::unmount(path).map_err(mount_err)?;
        }
        let mounted_elsewhere = crust_blockdev::mount_info()
            .map_err(mount_err)?
            .iter()
            .any(|m| (m.major, m.minor) == numbers);
        if !mounted_elsewhere {
            self.backend.detach(id)?;
        }
        Ok(())
    }

    #[allow(
        clippy::too_many_lines,
        reason = "to be split by the node service's route dispatch (issue 11), after the handover lands in this file"
    )]
    pub fn node_publish_volume(&self, req: &csi::NodePublishVolumeRequest) -> Result<()> {
        if req.volume_id.is_empty() {
            return Err(NodeError::Missing("volume_id"));
        }
        let staging = abs_path("staging_target_path", &req.staging_target_path)?;
        let target = abs_path("target_path", &req.target_path)?;
        let wants_deferral = req.defer_fs_ops || context_defers(Some(&req.volume_context))?;
        let cap = {
            let c = req
                .volume_capability
                .as_ref()
                .ok_or(NodeError::Missing("volume_capability"))?;
            if wants_deferral {
                Capability::from_proto_deferred(c)
            } else {
                Capability::from_proto(c)
            }
            .map_err(NodeError::InvalidArgument)?
        };
        if target.starts_with(&staging) || staging.starts_with(&target) {
            return Err(NodeError::InvalidArgument(format!(
                "target_path {} and staging_target_path {} must not contain each other",
                target.display(),
                staging.display()
            )));
        }
        if wants_deferral && cap.access.is_block() {
            return Err(NodeError::InvalidArgument(
                "deferred filesystem operations were requested for a raw block volume: \
                 deferral hands a filesystem to the pod's runtime, a raw block volume has none"
                    .into(),
            ));
        }
        let route = self.fs_ops_route(req.defer_fs_ops, Some(&req.volume_context))?;
        let _guard = self.guards.try_begin(&req.volume_id, "NodePublishVolume")?;
        let mut rec = self.node_record_here(&req.volume_id, &req.volume_context)?;
        let id = rec.id.clone();
        let mut s = match &rec.staging {
            Some(s) if s.path == staging => s.clone(),
            Some(s) => {
                return Err(NodeError::FailedPrecondition(format!(
                    "volume {id} is staged at {}, not at {}",
                    s.path.display(),
                    staging.display()
                )));
            }
            None => {
                return Err(NodeError::FailedPrecondition(format!(
                    "volume {id} is not staged; call NodeStageVolume first"
                )));
            }
        };
        let block = cap.access.is_block();
        if block != s.block {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {id} is staged for {} access; it cannot be published for {} access",
                if s.block { "raw block" } else { "filesystem" },
                if block { "raw block" } else { "filesystem" }
            )));
        }
        if let Access::Mount { fs_type: Some(f) } = cap.access
            && Some(f) != s.fs_type
        {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {id} is staged with {}; the capability asks for {f}",
                s.fs_type.map(|f| f.as_str()).unwrap_or("no filesystem")
            )));
        }
        // Never bind an empty staging directory or a device number that
        // now belongs to something else (e.g. after a reboot): the staged
        // device must still be this volume's, and mounted at the staging path.
        let attached = self.backend.attached_device(&id)?;
        if attached.as_deref() != Some(s.device.as_path()) {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {id} was staged on {} but that device is no longer attached to it \
                 (node rebooted?); call NodeStageVolume again",
                s.device.display()
            )));
        }
        if route == FsOps::Deferred {
            return self.publish_deferred(req, rec, s, target, cap);
        }
        if rec.published.get(&target).is_some_and(|p| p.handed_over) {
            // kubelet repeating the publication a VM runtime took by
            // handover: it is there, in the sandbox (or returned from it).
            tracing::info!(volume = %id, target = %target.display(),
                "repeated publish of a handed-over target: nothing to do");
            return Ok(());
        }
        if let Some(p) = rec.published.get(&target)
            && p.deferred
        {
            return Err(NodeError::AlreadyExists(format!(
                "volume {id} is already published at {} with deferred filesystem operations; \
                 a host publication there would differ",
                target.display()
            )));
        }
        if !block && s.host_mount != HostMount::Mounted {
            s = self.remount_staging(&mut rec, &cap)?;
        }
        if !block {
            let numbers = crust_blockdev::device_major_minor(&s.device)
                .map_err(|e| NodeError::Internal(e.to_string()))?;
            match crust_blockdev::find_mount(&staging).map_err(mount_err)? {
                Some(m) if (m.major, m.minor) == numbers => {}
                _ => {
                    return Err(NodeError::FailedPrecondition(format!(
                        "volume {id} is not mounted at its staging path {} (unmounted outside \
                         the plugin, or the node rebooted); call NodeStageVolume again",
                        staging.display()
                    )));
                }
            }
        }
        let readonly = req.readonly || cap.mode.read_only() || s.readonly;
        let wanted = Publication {
            supplemental_group: cap.fs_group(),
            ..Publication::host(block, readonly, cap.mode, cap.flags_digest())
        };
        let repeat = match rec.published.get(&target) {
            Some(p)
                if Publication {
                    created_target: false,
                    ..p.clone()
                } == wanted =>
            {
                true
            }
            Some(p) => {
                return Err(NodeError::AlreadyExists(format!(
                    "volume {id} is already published at {} with readonly={} and access mode {:?}",
                    target.display(),
                    p.readonly,
                    p.mode
                )));
            }
            None => false,
        };
        if !repeat {
            let others: Vec<_> = rec
                .published
                .iter()
                .filter(|(t, _)| **t != target)
                .collect();
            if let Some((t, p)) = others
                .iter()
                .find(|(_, p)| p.mode.single_target() || cap.mode.single_target())
            {
                let mode = if p.mode.single_target() {
                    p.mode
                } else {
                    cap.mode
                };
                return Err(NodeError::FailedPrecondition(format!(
                    "volume {id} is already published at {} and access mode {mode:?} allows \
                     only one publish target",
                    t.display()
                )));
            }
            if block && let Some((t, _)) = others.iter().find(|(_, p)| p.readonly != readonly) {
                return Err(NodeError::FailedPrecondition(format!(
                    "raw block volume {id} is already published {} at {}; read-only raw block \
                     access makes the whole device read-only, so read-only and read-write \
                     publications cannot be mixed",
                    if readonly { "read-write" } else { "read-only" },
                    t.display()
                )));
            }
        }
        if !block
            && !readonly
            && let Some(gid) = cap.fs_group()
        {
            apply_fs_group(&id, &s.path, gid)?;
        }
        let created = prepare_target(&target, block, Some(&s.device))?;
        let source: &Path = if block { &s.device } else { &s.path };
        let result = crust_blockdev::bind_mount(source, &target, readonly)
            .map_err(mount_err)
            .and_then(|()| {
                if block && readonly {
                    set_device_read_only(&s.device, true).map_err(|e| {
                        let _ = crust_blockdev::unmount(&target);
                        NodeError::Internal(format!(
                            "setting {} read-only: {e}",
                            s.device.display()
                        ))
                    })
                } else {
                    Ok(())
                }
            });
        if let Err(e) = result {
            if created {
                remove_target(&target, true);
            }
            return Err(e);
        }
        if !repeat {
            rec.published.insert(
                target.clone(),
                Publication {
                    created_target: created,
                    ..wanted
                },
            );
            self.state.put(rec)?;
        }
        self.health.forget(&id);
        tracing::info!(volume = %id, target = %target.display(), readonly, block, "volume published");
        Ok(())
    }

    pub fn node_unpublish_volume(&self, req: &csi::NodeUnpublishVolumeRequest) -> Result<()> {
        if req.volume_id.is_empty() {
            return Err(NodeError::Missing("volume_id"));
        }
        let target = abs_path("target_path", &req.target_path)?;
        let _guard = self
            .guards
            .try_begin(&req.volume_id, "NodeUnpublishVolume")?;
        let Some(mut rec) = self.state.get(&req.volume_id) else {
            return Ok(());
        };
        let id = rec.id.clone();
        let Some(p) = rec.published.get(&target).cloned() else {
            // Not recorded: only a bind of this volume left by a publish
            // that crashed before recording it is undone, or the hand-off
            // record of a deferred publish that crashed the same way.
            if let Some(s) = &rec.staging
                && publication_of(s, &target)
            {
                crust_blockdev::unmount_top(&target).map_err(mount_err)?;
                // Whether the plugin created it is not recorded: only an
                // empty file or directory goes.
                remove_target(&target, true);
            }
            self.unpublish_unrecorded_deferred(&rec, &target)?;
            return Ok(());
        };
        if p.handed_over {
            return self.unpublish_handed_over(rec, &target);
        }
        if p.deferred {
            // Whatever the request says (a kubelet that lost track of the
            // deferral, or a plugin downgraded to --deferral disabled: KEP
            // story 5), the records know the volume was handed to a runtime.
            return self.unpublish_deferred(rec, &target);
        }
        if req.defer_fs_ops {
            return Err(if self.deferral_enabled() {
                NodeError::FailedPrecondition(format!(
                    "volume {id} is published at {} on the host, not with deferred filesystem \
                     operations; call NodeUnpublishVolume without defer_fs_ops",
                    target.display()
                ))
            } else {
                NodeError::DeferralUnsupported
            });
        }
        if crust_blockdev::is_mountpoint(&target).map_err(mount_err)? {
            // Only this volume's own bind is removed: whatever else was
            // mounted there since stays, and so do the records.
            let ours = rec
                .staging
                .as_ref()
                .is_some_and(|s| publication_of(s, &target));
            if !ours {
                return Err(NodeError::FailedPrecondition(format!(
                    "target_path {} has {} mounted on it, which is not volume {id}'s \
                     publication; nothing was unmounted or removed",
                    target.display(),
                    mounted_source(&target).unwrap_or_else(|| "something".into())
                )));
            }
            crust_blockdev::unmount_top(&target).map_err(mount_err)?;
        }
        remove_target(&target, !p.block || p.created_target);
        rec.published.remove(&target);
        if p.block
            && p.readonly
            && let Some(s) = &rec.staging
            && !s.readonly
            && !rec.published.values().any(|o| o.block && o.readonly)
            && let Err(e) = set_device_read_only(&s.device, false)
        {
            tracing::warn!(volume = %id, error = %e, "could not make the device writable again");
        }
        self.state.put(rec)?;
        self.health.forget(&id);
        tracing::info!(volume = %id, target = %target.display(), "volume unpublished");
        Ok(())
    }

    /// What `volume_path` is for this volume: (is block, device, mount or
    /// device path to measure).
    fn resolve_volume_path(&self, rec: &VolumeRecord, path: &Path) -> Result<(bool, PathBuf)> {
        let Some(s) = &rec.staging else {
            return Err(NodeError::PathNotFound(format!(
                "volume {} is not staged or published on this node",
                rec.id
            )));
        };
        if let Some(p) = rec.published.get(path) {
            if p.handed_over {
                return Err(NodeError::FailedPrecondition(format!(
                    "volume {} at {} was handed to a VM sandbox and returned: it is mounted \
                     nowhere until a host publication needs it",
                    rec.id,
                    path.display()
                )));
            }
            return Ok((p.block, s.device.clone()));
        }
        if s.path == path {
            if !s.block && s.host_mount != HostMount::Mounted {
                return Err(NodeError::FailedPrecondition(format!(
                    "volume {} is not mounted at its staging path {}: its filesystem is left \
                     to a pod's runtime (deferred filesystem operations)",
                    rec.id,
                    path.display()
                )));
            }
            return Ok((s.block, s.device.clone()));
        }
        Err(NodeError::PathNotFound(format!(
            "{} is not a staged or published path of volume {}",
            path.display(),
            rec.id
        )))
    }

    pub fn node_get_volume_stats(
        &self,
        req: &csi::NodeGetVolumeStatsRequest,
    ) -> Result<csi::NodeGetVolumeStatsResponse> {
        if req.volume_id.is_empty() {
            return Err(NodeError::Missing("volume_id"));
        }
        // The spec's table first: an unknown volume is NOT_FOUND whatever
        // the paths look like.
        let rec = self.node_record(&req.volume_id)?;
        let path = abs_path("volume_path", &req.volume_path)?;
        if !req.staging_target_path.is_empty() {
            abs_path("staging_target_path", &req.staging_target_path)?;
        }
        if req.defer_fs_ops && !self.deferral_enabled() {
            return Err(NodeError::DeferralUnsupported);
        }
        if self.deferred_path(&rec, &path, req.defer_fs_ops)? {
            return self.stats_deferred(&rec, &path);
        }
        let (block, device) = self.resolve_volume_path(&rec, &path)?;
        let mut cond = self.health.condition(self, &rec);
        let mut usage = Vec::new();
        let mut add_problem = |m: String| {
            if cond.abnormal {
                cond.message = format!("{}; {m}", cond.message);
            } else {
                cond = crate::health::Condition::abnormal(m);
            }
        };
        if block {
            // Measure what is published when the path is the device file.
            let measured = if crust_blockdev::is_block_device(&path) {
                path.clone()
            } else {
                device.clone()
            };
            let key = format!("BLKGETSIZE64 {}", measured.display());
            match self
                .health
                .bounded(&key, move || crust_blockdev::block_device_size(&measured))
            {
                Ok(Ok(size)) => usage.push(csi::VolumeUsage {
                    available: 0,
                    total: size as i64,
                    used: 0,
                    unit: csi::volume_usage::Unit::Bytes as i32,
                }),
                Ok(Err(e)) => add_problem(format!("cannot read the device size: {e}")),
                Err(e) => add_problem(e),
            }
        } else {
            let key = format!("statvfs {}", path.display());
            let p = path.clone();
            match self.health.bounded(&key, move || crust_blockdev::usage(&p)) {
                Ok(Ok(u)) => {
                    usage.push(csi::VolumeUsage {
                        available: u.bytes_available as i64,
                        total: u.bytes_total as i64,
                        used: u.bytes_used as i64,
                        unit: csi::volume_usage::Unit::Bytes as i32,
                    });
                    usage.push(csi::VolumeUsage {
                        available: u.inodes_free as i64,
                        total: u.inodes_total as i64,
                        used: u.inodes_used as i64,
                        unit: csi::volume_usage::Unit::Inodes as i32,
                    });
                }
                Ok(Err(e)) => add_problem(format!("cannot measure usage: {e}")),
                Err(e) => add_problem(e),
            }
        }
        self.metrics.observe_condition(&rec.id, cond.abnormal);
        Ok(csi::NodeGetVolumeStatsResponse {
            usage,
            volume_condition: self.cfg.csi_spec.serves_condition().then(|| cond.into()),
        })
    }

    pub fn node_expand_volume(
        &self,
        req: &csi::NodeExpandVolumeRequest,
    ) -> Result<csi::NodeExpandVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(NodeError::Missing("volume_id"));
        }
        // NOT_FOUND before any other check (re-read under the guard below).
        self.node_record(&req.volume_id)?;
        let path = abs_path("volume_path", &req.volume_path)?;
        if !req.staging_target_path.is_empty() {
            abs_path("staging_target_path", &req.staging_target_path)?;
        }
        let (required, limit) = match &req.capacity_range {
            Some(r) if r.required_bytes < 0 || r.limit_bytes < 0 => {
                return Err(NodeError::InvalidArgument(
                    "capacity range must not be negative".into(),
                ));
            }
            Some(r) if r.limit_bytes != 0 && r.required_bytes > r.limit_bytes => {
                return Err(NodeError::InvalidArgument(format!(
                    "required_bytes {} is larger than limit_bytes {}",
                    r.required_bytes, r.limit_bytes
                )));
            }
            Some(r) => (r.required_bytes as u64, r.limit_bytes as u64),
            None => (0, 0),
        };
        let cap = match &req.volume_capability {
            Some(c) => Some(Capability::from_proto(c).map_err(NodeError::InvalidArgument)?),
            None => None,
        };
        if req.defer_fs_ops && !self.deferral_enabled() {
            return Err(NodeError::DeferralUnsupported);
        }
        let _guard = self.guards.try_begin(&req.volume_id, "NodeExpandVolume")?;
        let mut rec = self.node_record(&req.volume_id)?;
        if self.deferred_path(&rec, &path, req.defer_fs_ops)? {
            if cap.as_ref().is_some_and(|c| c.access.is_block()) {
                return Err(NodeError::InvalidArgument(
                    "deferred filesystem operations cannot expand a raw block volume".into(),
                ));
            }
            self.grow_backing_on_node(&mut rec, required, limit)?;
            return self.expand_deferred(&rec, &path, required, limit);
        }
        let (recorded_block, device) = self.resolve_volume_path(&rec, &path)?;
        // Block or filesystem: the capability if given, else what the
        // path is (a device node, or a directory with a mount).
        let block = match &cap {
            Some(c) => c.access.is_block(),
            None => {
                let p = path.clone();
                let key = format!("stat {}", path.display());
                match self.health.bounded(&key, move || fs::metadata(&p)) {
                    Ok(Ok(m)) if m.is_dir() => {
                        recorded_block && !crust_blockdev::is_mountpoint(&path).unwrap_or(false)
                    }
                    Ok(Ok(_)) => true,
                    _ => recorded_block,
                }
            }
        };
        if block != recorded_block {
            return Err(NodeError::InvalidArgument(format!(
                "volume {} is used as {} at {}, not as {}",
                rec.id,
                if recorded_block {
                    "raw block"
                } else {
                    "a filesystem"
                },
                path.display(),
                if block { "raw block" } else { "a filesystem" }
            )));
        }
        self.grow_backing_on_node(&mut rec, required, limit)?;
        // Pick up a grown backing store (LOOP_SET_CAPACITY for loop devices).
        let size = refreshed_device_size(&rec.id, &device, required, limit)?;
        if !block {
            let s = rec.staging.as_ref().expect("resolved above");
            let fs = s.fs_type.unwrap_or(rec.fs_type);
            if fs == FsType::Ext4 && !crust_blockdev::can_grow_ext4_online() {
                // The kernel's online ext4 resize needs CAP_SYS_RESOURCE.
                if ext4_needs_grow(&device)? {
                    return Err(NodeError::FailedPrecondition(format!(
                        "ext4 on {} cannot be grown while it is mounted: this plugin lacks                          CAP_SYS_RESOURCE, which online ext4 resize needs; the filesystem is                          grown automatically the next time the volume is staged (restart the                          pod using it), or run the plugin with CAP_SYS_RESOURCE",
                        device.display()
                    )));
                }
            } else {
                crust_blockdev::grow_fs(&device, &s.path, fs).map_err(|e| {
                    NodeError::Internal(format!("growing {fs} on {}: {e}", device.display()))
                })?;
            }
        }
        self.health.forget(&rec.id);
        tracing::info!(volume = %rec.id, size, block, "node expansion done");
        Ok(csi::NodeExpandVolumeResponse {
            capacity_bytes: size as i64,
        })
    }

    pub fn node_get_info(&self) -> csi::NodeGetInfoResponse {
        csi::NodeGetInfoResponse {
            node_id: self.cfg.node_id.clone(),
            max_volumes_per_node: self.cfg.max_volumes_per_node,
            accessible_topology: Some(self.topology()),
            supported_file_systems: [FsType::Ext4, FsType::Xfs]
                .iter()
                .map(|f| f.as_str().to_string())
                .collect(),
        }
    }
}

/// The tonic Node service.
#[derive(Clone)]
pub struct NodeService {
    driver: Arc<Driver>,
}

impl NodeService {
    pub fn new(driver: Arc<Driver>) -> Self {
        NodeService { driver }
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<csi::NodeStageVolumeRequest>,
    ) -> std::result::Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        blocking(&self.driver, move |d| d.node_stage_volume(&req)).await?;
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<csi::NodeUnstageVolumeRequest>,
    ) -> std::result::Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        blocking(&self.driver, move |d| d.node_unstage_volume(&req)).await?;
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> std::result::Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        blocking(&self.driver, move |d| d.node_publish_volume(&req)).await?;
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> std::result::Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        blocking(&self.driver, move |d| d.node_unpublish_volume(&req)).await?;
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> std::result::Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| d.node_get_volume_stats(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn node_expand_volume(
        &self,
        request: Request<csi::NodeExpandVolumeRequest>,
    ) -> std::result::Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| d.node_expand_volume(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> std::result::Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(csi::NodeGetCapabilitiesResponse {
            capabilities: crate::surface::node_capabilities(
                self.driver.cfg.csi_spec,
                self.driver.deferral_enabled(),
            ),
        }))
    }

    async fn node_get_info(
        &self,
        _request: Request<csi::NodeGetInfoRequest>,
    ) -> std::result::Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(self.driver.node_get_info()))
    }

    async fn node_get_volume_health(
        &self,
        request: Request<csi::NodeGetVolumeHealthRequest>,
    ) -> std::result::Result<Response<csi::NodeGetVolumeHealthResponse>, Status> {
        if !self.driver.cfg.csi_spec.serves_health_api() {
            return Err(crate::controller::health_api_off("NodeGetVolumeHealth"));
        }
        let req = request.into_inner();
        let resp = blocking(&self.driver, move |d| d.node_get_volume_health(&req)).await?;
        Ok(Response::new(resp))
    }

    async fn node_get_storage_health(
        &self,
        _request: Request<csi::NodeGetStorageHealthRequest>,
    ) -> std::result::Result<Response<csi::NodeGetStorageHealthResponse>, Status> {
        if !self.driver.cfg.csi_spec.serves_health_api() {
            return Err(crate::controller::health_api_off("NodeGetStorageHealth"));
        }
        let resp = blocking(&self.driver, |d| d.node_get_storage_health()).await?;
        Ok(Response::new(resp))
    }
}
