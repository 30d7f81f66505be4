//! A deferred volume's life inside a running guest: hot-plug the host
//! device as virtio-blk over QMP, have the agent mount it (fsGroup
//! applied), and serve stats and online resize from the guest.

use std::path::Path;
use std::time::Duration;

use crust_agent_proto::{
    AgentClient, ClientError, FsGroupPolicy, FsType, GUEST_VOLUME_ROOT, MountVolume,
    MountVolumeReply,
};
use crust_handoff::{FsGroupChangePolicy, IoLimits};
use crust_qmp::{QmpClient, QmpError};

use crate::records::{Volume, VolumeIo};
use crate::stats::{Unit, VolumeCondition, VolumeStats, VolumeUsage};

/// How long the guest gets to release a hot-unplugged disk.
const UNPLUG_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {target}: {what}: {source}")]
    Qmp {
        target: String,
        what: &'static str,
        #[source]
        source: QmpError,
    },
    #[error("volume {target}: guest agent {what}: {source}")]
    Agent {
        target: String,
        what: &'static str,
        #[source]
        source: ClientError,
    },
    #[error("volume {target}: host device {device}: {reason}")]
    HostDevice {
        target: String,
        device: String,
        reason: String,
    },
    #[error("volume {target}: {reason}")]
    OutOfRange { target: String, reason: String },
    #[error("volume {target}: {reason}")]
    Precondition { target: String, reason: String },
    /// `crust throttle`'s limits do not read.
    #[error("volume {target}: I/O limits: {source}")]
    BadLimits {
        target: String,
        #[source]
        source: crust_handoff::QosError,
    },
}

/// A guest agent call about the sandbox rather than one volume (the
/// workload, exec): `what` names it in the message.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {cause}")]
pub struct AgentCallError {
    pub what: &'static str,
    pub cause: ClientError,
}

impl AgentCallError {
    pub fn of(what: &'static str) -> impl FnOnce(ClientError) -> AgentCallError {
        move |cause| AgentCallError { what, cause }
    }
}

/// The shim API's `/exec`: runs a command in the guest (in `container`'s
/// mount namespace when given), waiting its own timeout (default 30 s)
/// plus `slack` for the agent's answer.
pub async fn exec_in_guest(
    agent: &AgentClient,
    req: crust_shim_api::ExecRequest,
    container: Option<String>,
    slack: std::time::Duration,
) -> Result<crust_shim_api::ExecResponse, AgentCallError> {
    let timeout = std::time::Duration::from_millis(req.timeout_ms.unwrap_or(30_000));
    let r = agent
        .call_with_timeout(
            crust_agent_proto::Exec {
                args: req.args,
                env: req.env,
                timeout_ms: timeout.as_millis() as u64,
                container,
            },
            timeout + slack,
        )
        .await
        .map_err(AgentCallError::of("exec"))?;
    Ok(crust_shim_api::ExecResponse {
        exit_code: r.exit_code,
        stdout: r.stdout,
        stderr: r.stderr,
    })
}

fn qmp_err(v: &Volume, what: &'static str) -> impl FnOnce(QmpError) -> VolumeError {
    let target = v.target.clone();
    move |source| VolumeError::Qmp {
        target,
        what,
        source,
    }
}

fn agent_err(v: &Volume, what: &'static str) -> impl FnOnce(ClientError) -> VolumeError {
    let target = v.target.clone();
    move |source| VolumeError::Agent {
        target,
        what,
        source,
    }
}

/// Where the agent mounts `v` in the guest.
pub fn guest_path(v: &Volume) -> String {
    format!("{GUEST_VOLUME_ROOT}/{}", v.id)
}

pub fn agent_fstype(v: &Volume) -> Result<FsType, VolumeError> {
    FsType::parse(&v.fstype).ok_or_else(|| VolumeError::Precondition {
        target: v.target.clone(),
        reason: format!("the guest cannot mount fstype {:?}", v.fstype),
    })
}

/// Record options that mean nothing for a block device handed to a VM:
/// Kata's CSI driver writes `["bind","rw"]` (it also bind-mounts the
/// volume on the host). The guest mounts a filesystem from a disk, never
/// a bind, so these are accepted and dropped.
pub const HOST_ONLY_OPTIONS: [&str; 2] = ["bind", "rbind"];

/// The options the agent mounts `v` with: the record's, without the
/// host-only ones and without `ro`/`rw` (read-only-ness travels as the
/// readonly flag).
pub fn guest_options(v: &Volume) -> Vec<String> {
    v.options
        .iter()
        .filter(|o| !HOST_ONLY_OPTIONS.contains(&o.as_str()) && *o != "ro" && *o != "rw")
        .cloned()
        .collect()
}

/// THE check of everything a volume's record carries that the guest
/// would act on, run by every door before a VM starts or a device is
/// plugged (so a bad record never costs a boot): the fstype is one the
/// guest mounts, and the options pass crust's one allow-list
/// ([`crust_fs::options`], what the agent applies) once the host-only
/// ones are dropped. The record itself (device, volume type, secrets)
/// was checked when it was read.
pub fn check_for_guest(v: &Volume) -> Result<(), VolumeError> {
    // A record's limits that cannot be read never plug unthrottled.
    io_limits(v)?;
    let fs = agent_fstype(v)?;
    crust_fs::options::parse(fs, &guest_options(v), v.readonly).map_err(|e| {
        VolumeError::Precondition {
            target: v.target.clone(),
            reason: format!("record options: {e}"),
        }
    })?;
    Ok(())
}

/// [`check_for_guest`] for every volume of a plan, before anything is
/// claimed or booted; also says which metadata each record's reader
/// ignored ([`crust_handoff::validate::metadata_warnings`]).
pub fn check_before_boot(
    discovery: &crate::discovery::Discovery,
    volumes: &[Volume],
) -> Result<(), VolumeError> {
    for v in volumes {
        check_for_guest(v)?;
        if let Ok(mi) = discovery.store(v.layout).read(&v.target) {
            for w in crust_handoff::validate::metadata_warnings(&mi) {
                tracing::warn!(target = %v.target, "hand-off record: {w}");
            }
        }
    }
    Ok(())
}

/// Checks the host device right before handing it to QEMU: it must still
/// be a block device (records are validated when read, but time passes).
pub fn check_host_device(v: &Volume) -> Result<(), VolumeError> {
    if crust_blockdev::is_block_device(Path::new(&v.device)) {
        Ok(())
    } else {
        Err(VolumeError::HostDevice {
            target: v.target.clone(),
            device: v.device.clone(),
            reason: "is not a block device (any more)".into(),
        })
    }
}

/// Kata's `createFilesystem=true`: the record's filesystem is created
/// before the guest sees the device, through the format gate with the
/// only proof the runtime can have ([`crust_blockdev::BlankProof::ReadNow`]:
/// no signature, zero edges, and a full read finds only zeros). A device
/// that already holds the asked filesystem is left as is; one that holds
/// anything else, a signature or data without one, is refused
/// (FAILED_PRECONDITION): the runtime never knows what wrote it.
/// Without the flag nothing is formatted. Runs before the sandbox takes
/// its exclusive hold (mkfs needs the device to itself).
pub async fn format_if_requested(v: &Volume) -> Result<(), VolumeError> {
    if !v.create_fs || v.readonly {
        return Ok(());
    }
    let host = |reason: String| VolumeError::HostDevice {
        target: v.target.clone(),
        device: v.device.clone(),
        reason,
    };
    let fstype: crust_blockdev::FsType = v
        .fstype
        .parse()
        .map_err(|e| host(format!("createFilesystem: {e}")))?;
    let dev = std::path::PathBuf::from(&v.device);
    let formatted = tokio::task::spawn_blocking(move || {
        match crust_blockdev::probe_fs(&dev).map_err(|e| e.to_string())? {
            crust_blockdev::Probe::Fs(found) if found == fstype => Ok(false),
            _ => crust_blockdev::format(&dev, fstype, &crust_blockdev::BlankProof::ReadNow)
                .map(|()| true)
                .map_err(|e| e.to_string()),
        }
    })
    .await
    .map_err(|e| host(format!("createFilesystem: {e}")))?
    .map_err(|e| host(format!("createFilesystem: {e}")))?;
    if formatted {
        tracing::info!(target = %v.target, device = %v.device, fstype = %v.fstype,
            "createFilesystem: formatted the device, which a full read proved blank");
    }
    Ok(())
}

/// Takes the exclusive hold on `v`'s host device that the sandbox keeps
/// while its guest may use the device: refused (FAILED_PRECONDITION,
/// naming the holder) when the device is mounted anywhere or held. QEMU
/// opens the device without `O_EXCL`; this hold is what keeps the host
/// (mkfs, fsck, mount) and other sandboxes away meanwhile.
pub fn hold_host_device(v: &Volume) -> Result<crust_blockdev::ExclusiveDevice, VolumeError> {
    crust_blockdev::claim_exclusive(
        Path::new(&v.device),
        !v.readonly,
        crust_blockdev::HAND_TO_GUEST,
    )
    .map_err(|e| VolumeError::HostDevice {
        target: v.target.clone(),
        device: v.device.clone(),
        reason: e.to_string(),
    })
}

/// kubelet's keep-busy loop of one pod's block volume: for every
/// `volumeDevices` claim kubelet bind-mounts the device node at
/// `<globalMapPath>/<podUID>` (under `<kubelet root>/plugins/`, in a
/// `volumeDevices` directory) and binds a loop device to that path
/// (`MapBlockVolume` → `AttachFileDevice`), so the device stays busy while
/// the pod uses it. That loop reads the device itself: the alias scan
/// would refuse it, and it is the one alias a raw device may have.
#[derive(Debug, Clone)]
pub struct KubeletLoop {
    /// kubelet's root directory (the parent of its pods directory).
    pub kubelet_root: std::path::PathBuf,
    /// The pod's uid; without one no loop is kubelet's.
    pub pod_uid: Option<String>,
}

impl KubeletLoop {
    /// Whether `backing` (a loop's backing file) is this pod's map path.
    pub fn is_map_path(&self, backing: &Path) -> bool {
        let Some(uid) = self.pod_uid.as_deref() else {
            return false;
        };
        let Ok(rest) = backing.strip_prefix(self.kubelet_root.join("plugins")) else {
            return false;
        };
        let parts: Vec<&std::ffi::OsStr> = rest.iter().collect();
        parts.len() >= 3
            && parts.contains(&std::ffi::OsStr::new("volumeDevices"))
            && parts.last().is_some_and(|l| *l == uid)
            && !parts.iter().any(|p| *p == ".." || *p == ".")
    }

    /// Whether `alias` of the device named `device` (kernel name) is this
    /// pod's keep-busy loop: a loop reading the device itself whose
    /// backing file is the pod's map path.
    fn accepts(&self, device: &str, alias: &crust_blockdev::Alias) -> bool {
        let crust_blockdev::AliasKind::StackedOn { of } = &alias.kind else {
            return false;
        };
        if of != device {
            return false;
        }
        match crust_blockdev::loop_status(&Path::new("/dev").join(&alias.name)) {
            Ok(Some(st)) => !st.backing_deleted && self.is_map_path(&st.backing_file),
            _ => false,
        }
    }
}

/// The sandbox's hold on a raw device ([`Volume::raw_device`]), the same
/// rule as a volume's ([`hold_host_device`]: refused when mounted,
/// held, or exposed by another device, naming it), except that this
/// pod's kubelet loop ([`KubeletLoop`]) is held too instead of refusing.
pub fn hold_raw_device(
    v: &Volume,
    kubelet: &KubeletLoop,
) -> Result<crust_blockdev::HeldWithAliases, VolumeError> {
    let dev = Path::new(&v.device);
    let name =
        crust_blockdev::device::sysfs_name(dev).map_err(|e| host_device_error(v, e.to_string()))?;
    let held = crust_blockdev::claim_exclusive_keeping(
        dev,
        !v.readonly,
        crust_blockdev::HAND_TO_GUEST,
        &mut |a| kubelet.accepts(&name, a),
    )
    .map_err(|e| host_device_error(v, e.to_string()))?;
    for n in &held.names {
        tracing::info!(device = %v.device, "kubelet's loop /dev/{n} on it held too");
    }
    Ok(held)
}

/// Checks by descriptor (`hold`, the sandbox's hold on the device) that
/// the device is the one `v`'s record was written for: a record names its
/// device by path, and paths are reused (a detached loop's number goes to
/// the next attach of any file). A mismatch refuses the plug, naming both
/// identities; nothing is attached. A record without an identity (one
/// Kata's CSI driver wrote, or an older crust) is plugged as before, and
/// the identity found is returned for the caller to record once the plug
/// succeeded ([`crate::plug`]), so every later plug is held to it.
pub fn check_identity(
    v: &Volume,
    hold: &crust_blockdev::ExclusiveDevice,
) -> Result<Option<crust_blockdev::DeviceIdentity>, VolumeError> {
    use std::os::fd::AsFd;
    let found = crust_blockdev::identity_of(hold.as_fd(), Path::new(&v.device));
    let Some(want) = &v.identity else {
        return Ok(match found {
            Ok(id) => Some(id),
            Err(e) => {
                tracing::info!(target = %v.target, device = %v.device,
                    "the record carries no device identity; the device has none: {e}");
                None
            }
        });
    };
    let want: crust_blockdev::DeviceIdentity =
        want.parse().map_err(|e| VolumeError::Precondition {
            target: v.target.clone(),
            reason: format!(
                "record metadata {}: {e}",
                crust_handoff::DEVICE_IDENTITY_KEY
            ),
        })?;
    let found = found.map_err(|e| {
        host_device_error(
            v,
            format!(
                "cannot tell whether it is the device the record was written for ({want}): {e}"
            ),
        )
    })?;
    if !want.matches(&found) {
        return Err(host_device_error(
            v,
            format!(
                "is not the device the hand-off record was written for: the record names {want}, \
                 the device is {found} (device paths are reused; the record is stale)"
            ),
        ));
    }
    Ok(None)
}

/// A refusal of `v`'s host device.
pub fn host_device_error(v: &Volume, reason: String) -> VolumeError {
    VolumeError::HostDevice {
        target: v.target.clone(),
        device: v.device.clone(),
        reason,
    }
}

/// For a volume whose device is a regular file (Kata's CSI driver backs
/// volumes with files), that file opened by the one rule
/// ([`crust_handoff::validate::open_file_device`]: beneath `roots`, no
/// symlink, only root can change the path); None for a block device.
pub fn open_file_device(
    v: &Volume,
    roots: &[std::path::PathBuf],
) -> Result<Option<std::os::fd::OwnedFd>, VolumeError> {
    if crust_blockdev::is_block_device(Path::new(&v.device)) {
        return Ok(None);
    }
    crust_handoff::validate::open_file_device(
        &v.device,
        roots,
        crate::config::FILE_DEVICE_SETTING,
        !v.readonly,
    )
    .map(Some)
    .map_err(|reason| host_device_error(v, reason))
}

/// Hot-plugs `v` on PCIe root port `bus`: its block device (a node
/// under /dev, checked again now), or `file`, the descriptor of its file
/// device ([`open_file_device`]), which QEMU gets as it is. `hold` is the
/// sandbox's hold on the device ([`hold_host_device`]). A loop device
/// that maps a whole file proven its own ([`bypass`]) is opened by QEMU on
/// that file, by descriptor: QEMU does the loop driver's work itself.
/// QEMU then also keeps a copy of the hold ([`QmpClient::keep_fd`]), so
/// the host stays away from the device, and sees QEMU using it, for as
/// long as QEMU may write the file, even if this runtime dies. Returns
/// what QEMU opened and how (direct, engine). The guest sees the host
/// device's sector size (a filesystem it makes must mount on the host).
/// Idempotent (crust-qmp is) while the route stays the same; a sandbox
/// plugs a volume once ([`crate::plug`]).
pub async fn attach(
    qmp: &QmpClient,
    v: &Volume,
    bus: Option<&str>,
    file: Option<std::os::fd::OwnedFd>,
    hold: &crust_blockdev::ExclusiveDevice,
) -> Result<VolumeIo, VolumeError> {
    let (io, block_size, backing_file) = match file {
        Some(fd) => (
            qmp.blockdev_add_fd(&v.node_name, fd, v.readonly).await,
            0,
            false,
        ),
        None => {
            check_host_device(v)?;
            let dev = Path::new(&v.device);
            let bs = crust_blockdev::logical_block_size(dev)
                .map_err(|e| host_device_error(v, e.to_string()))?;
            match bypass(v, hold)? {
                Some((file, keep)) => {
                    qmp.keep_fd(&v.node_name, keep)
                        .await
                        .map_err(qmp_err(v, "getfd"))?;
                    let io = qmp.blockdev_add_fd(&v.node_name, file, v.readonly).await;
                    if io.is_err() {
                        // The kept copy of the hold goes with the node.
                        let _ = qmp.blockdev_del(&v.node_name).await;
                    }
                    (io, bs, true)
                }
                None => (
                    qmp.blockdev_add_file(&v.node_name, dev, v.readonly).await,
                    bs,
                    false,
                ),
            }
        }
    };
    let io = io.map_err(qmp_err(v, "blockdev-add"))?;
    let opts = crust_qmp::VirtioBlkOptions {
        block_size,
        ..Default::default()
    };
    if let Err(e) = qmp
        .device_add_virtio_blk(&v.device_id, &v.node_name, &v.serial, bus, &opts)
        .await
    {
        let _ = qmp.blockdev_del(&v.node_name).await;
        return Err(qmp_err(v, "device_add")(e));
    }
    Ok(VolumeIo { io, backing_file })
}

/// For a volume on a loop device: its backing file for QEMU
/// ([`crust_blockdev::route`], asked through the sandbox's `hold`) and a
/// copy of the hold for QEMU to keep. None keeps the device itself, with
/// the reason logged: a loop that is not a whole file proven its own, or
/// a device page cache this process cannot flush (no `CAP_SYS_ADMIN`: a
/// host reader after the guest could then read what it cached before).
fn bypass(
    v: &Volume,
    hold: &crust_blockdev::ExclusiveDevice,
) -> Result<Option<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)>, VolumeError> {
    use std::os::fd::AsFd;
    let dev = Path::new(&v.device);
    let file = match crust_blockdev::route(hold.as_fd(), dev, !v.readonly) {
        crust_blockdev::Route::BackingFile(fd) => fd,
        crust_blockdev::Route::Device(why) => {
            tracing::info!(target = %v.target, device = %v.device,
                "QEMU opens the device itself: {why}");
            return Ok(None);
        }
    };
    // The hold flushed the cache when taken; QEMU has written nothing yet.
    if !hold.cache_flushable() {
        tracing::warn!(target = %v.target, device = %v.device,
            "QEMU opens the device itself: its page cache cannot be flushed here (no CAP_SYS_ADMIN)");
        return Ok(None);
    }
    let keep = hold
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| host_device_error(v, format!("duplicating the hold: {e}")))?;
    Ok(Some((file, keep)))
}

/// The I/O limits `v`'s record carries (none: unlimited).
pub fn io_limits(v: &Volume) -> Result<IoLimits, VolumeError> {
    let Some(wire) = &v.io_limits else {
        return Ok(IoLimits::default());
    };
    IoLimits::from_wire(wire).map_err(|e| VolumeError::Precondition {
        target: v.target.clone(),
        reason: format!("record metadata {}: {e}", crust_handoff::IO_LIMITS_KEY),
    })
}

/// Applies `limits` to `v`'s device in the running guest (QMP
/// `block_set_io_throttle` on its qdev id): at every plug, and when the
/// CSI plugin changes them (`crust throttle`). Unlimited lifts them all.
pub async fn throttle(qmp: &QmpClient, v: &Volume, limits: &IoLimits) -> Result<(), VolumeError> {
    let t = crust_qmp::IoThrottle {
        iops: limits.iops,
        iops_rd: limits.read_iops,
        iops_wr: limits.write_iops,
        bps: limits.bps,
        bps_rd: limits.read_bps,
        bps_wr: limits.write_bps,
        iops_max: limits.iops_burst,
        iops_rd_max: limits.read_iops_burst,
        iops_wr_max: limits.write_iops_burst,
        bps_max: limits.bps_burst,
        bps_rd_max: limits.read_bps_burst,
        bps_wr_max: limits.write_bps_burst,
        max_length: limits.burst_seconds,
    };
    qmp.block_set_io_throttle(&v.device_id, &t)
        .await
        .map_err(qmp_err(v, "block_set_io_throttle"))
}

/// The shim API's `/volume/throttle` for both doors: `wire` read as
/// [`IoLimits::from_wire`], then [`throttle`].
pub async fn throttle_request(qmp: &QmpClient, v: &Volume, wire: &str) -> Result<(), VolumeError> {
    let limits = IoLimits::from_wire(wire).map_err(|source| VolumeError::BadLimits {
        target: v.target.clone(),
        source,
    })?;
    throttle(qmp, v, &limits).await?;
    tracing::info!(target = %v.target, limits = %wire, "I/O limits applied live");
    Ok(())
}

/// Unplugs `v` (rollback of a failed hot-plug into a running sandbox).
pub async fn detach(qmp: &QmpClient, v: &Volume) -> Result<(), VolumeError> {
    qmp.device_del(&v.device_id, UNPLUG_TIMEOUT)
        .await
        .map_err(qmp_err(v, "device_del"))?;
    qmp.blockdev_del(&v.node_name)
        .await
        .map_err(qmp_err(v, "blockdev-del"))
}

/// Has the agent mount `v` with the record's fstype, options and fsGroup.
pub async fn mount(
    agent: &AgentClient,
    v: &Volume,
    timeout: Duration,
) -> Result<MountVolumeReply, VolumeError> {
    let req = MountVolume {
        volume: v.id.clone(),
        serial: v.serial.clone(),
        fstype: agent_fstype(v)?,
        options: guest_options(v),
        readonly: v.readonly,
        fs_group: v.fs_group,
        fs_group_policy: v.fs_group_change_policy().map(|p| match p {
            FsGroupChangePolicy::Always => FsGroupPolicy::Always,
            FsGroupChangePolicy::OnRootMismatch => FsGroupPolicy::OnRootMismatch,
        }),
    };
    agent
        .call_with_timeout(req, timeout)
        .await
        .map_err(agent_err(v, "mount"))
}

pub async fn unmount(
    agent: &AgentClient,
    v: &Volume,
    timeout: Duration,
) -> Result<(), VolumeError> {
    agent
        .call_with_timeout(
            crust_agent_proto::UnmountVolume {
                volume: v.id.clone(),
            },
            timeout,
        )
        .await
        .map(drop)
        .map_err(agent_err(v, "unmount"))
}

/// Usage and condition of `v`, as the guest sees them.
pub async fn stats(
    agent: &AgentClient,
    v: &Volume,
    timeout: Duration,
) -> Result<VolumeStats, VolumeError> {
    let s = agent
        .call_with_timeout(
            crust_agent_proto::StatVolume {
                volume: v.id.clone(),
            },
            timeout,
        )
        .await
        .map_err(agent_err(v, "stats"))?;
    let usage = |u: crust_agent_proto::Usage, unit| VolumeUsage {
        available: u.available,
        total: u.total,
        used: u.used,
        unit,
    };
    Ok(VolumeStats {
        usage: vec![usage(s.bytes, Unit::Bytes), usage(s.inodes, Unit::Inodes)],
        volume_condition: VolumeCondition {
            abnormal: s.condition.abnormal,
            message: s.condition.message,
        },
    })
}

/// Freezes the volume's filesystem in the guest (the agent thaws it by
/// itself after `max_frozen`).
pub async fn freeze(
    agent: &AgentClient,
    v: &Volume,
    max_frozen: Duration,
    timeout: Duration,
) -> Result<(), VolumeError> {
    agent
        .call_with_timeout(
            crust_agent_proto::FreezeVolume {
                volume: v.id.clone(),
                max_frozen_ms: max_frozen.as_millis() as u64,
            },
            timeout,
        )
        .await
        .map(drop)
        .map_err(agent_err(v, "freeze"))
}

/// Thaws what [`freeze`] froze.
pub async fn thaw(
    agent: &AgentClient,
    v: &Volume,
    timeout: Duration,
) -> Result<crate::stats::ThawResponse, VolumeError> {
    let r = agent
        .call_with_timeout(
            crust_agent_proto::ThawVolume {
                volume: v.id.clone(),
            },
            timeout,
        )
        .await
        .map_err(agent_err(v, "thaw"))?;
    Ok(crate::stats::ThawResponse {
        was_frozen: r.was_frozen,
        expired: r.expired,
    })
}

/// The host device's size, after making a loop device re-read its
/// backing file (the CSI plugin grows the file, we propagate it).
pub async fn refresh_host_size(v: &Volume) -> Result<u64, VolumeError> {
    let dev = v.device.clone();
    let res = tokio::task::spawn_blocking(move || {
        let path = Path::new(&dev);
        if !crust_blockdev::is_block_device(path) {
            // A file device: QEMU grows the file it holds to this size.
            return std::fs::metadata(path)
                .map(|m| m.len())
                .map_err(|e| e.to_string());
        }
        let is_loop = crust_blockdev::loop_status(path).ok().flatten().is_some();
        if is_loop {
            crust_blockdev::refresh_capacity(path).map_err(|e| e.to_string())
        } else {
            crust_blockdev::block_device_size(path).map_err(|e| e.to_string())
        }
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r);
    res.map_err(|reason| VolumeError::HostDevice {
        target: v.target.clone(),
        device: v.device.clone(),
        reason,
    })
}

/// QEMU grows a node opened on a loop device's backing file by
/// truncating that file to the size given: refused unless that is the
/// file's size now (a second expansion may have grown it since the loop
/// device was refreshed; the caller retries).
pub async fn never_shrink_backing_file(
    qmp: &QmpClient,
    v: &Volume,
    size: u64,
) -> Result<(), VolumeError> {
    if !crust_blockdev::is_block_device(Path::new(&v.device)) {
        return Ok(());
    }
    let on_file = qmp
        .query_named_block_nodes()
        .await
        .map_err(qmp_err(v, "query-named-block-nodes"))?
        .into_iter()
        .any(|n| n.node_name == v.node_name && n.driver == "file");
    if !on_file {
        return Ok(());
    }
    let dev = v.device.clone();
    let file_bytes =
        tokio::task::spawn_blocking(move || crust_blockdev::backing_file_bytes(Path::new(&dev)))
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|reason| host_device_error(v, format!("its backing file: {reason}")))?;
    if file_bytes != size {
        return Err(VolumeError::Precondition {
            target: v.target.clone(),
            reason: format!(
                "the host device {} has {size} bytes but its backing file {file_bytes}: it changed during the resize; retry",
                v.device
            ),
        });
    }
    Ok(())
}

/// Online expansion: refresh the host device, `block_resize` the QEMU node
/// to the device's size, grow the filesystem in the guest. Refuses before
/// touching anything when the device is smaller than `min_bytes` or larger
/// than `max_bytes` (when given and non-zero). Returns the disk size the
/// guest sees afterwards.
pub async fn resize(
    qmp: &QmpClient,
    agent: &AgentClient,
    v: &Volume,
    min_bytes: u64,
    max_bytes: Option<u64>,
    timeout: Duration,
) -> Result<u64, VolumeError> {
    if v.readonly {
        return Err(VolumeError::Precondition {
            target: v.target.clone(),
            reason: "the volume is attached read-only; it cannot be expanded".into(),
        });
    }
    let size = refresh_host_size(v).await?;
    if size < min_bytes {
        return Err(VolumeError::OutOfRange {
            target: v.target.clone(),
            reason: format!(
                "the host device {} has {size} bytes, less than the requested {min_bytes}; grow it first",
                v.device
            ),
        });
    }
    if let Some(max) = max_bytes.filter(|m| *m > 0)
        && size > max
    {
        return Err(VolumeError::OutOfRange {
            target: v.target.clone(),
            reason: format!(
                "the host device {} has {size} bytes, more than the limit {max}",
                v.device
            ),
        });
    }
    never_shrink_backing_file(qmp, v, size).await?;
    qmp.block_resize(&v.node_name, size)
        .await
        .map_err(qmp_err(v, "block_resize"))?;
    let grown = agent
        .call_with_timeout(
            crust_agent_proto::GrowVolume {
                volume: v.id.clone(),
                device_bytes: Some(size),
            },
            timeout,
        )
        .await
        .map_err(agent_err(v, "grow"))?;
    if grown.device_bytes < min_bytes {
        return Err(VolumeError::OutOfRange {
            target: v.target.clone(),
            reason: format!(
                "the guest sees {} bytes after the resize, less than the requested {min_bytes}",
                grown.device_bytes
            ),
        });
    }
    Ok(grown.device_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::LayoutKind;
    use crate::shim::Code;
    use crust_handoff::MountInfo;

    #[test]
    fn kubelet_loop_map_path_is_this_pods_only() {
        let k = KubeletLoop {
            kubelet_root: "/var/lib/kubelet".into(),
            pod_uid: Some("u1".into()),
        };
        let csi = "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/pv1/dev";
        assert!(k.is_map_path(Path::new(&format!("{csi}/u1"))));
        // In-tree plugins keep the same shape under their own directory.
        assert!(k.is_map_path(Path::new(
            "/var/lib/kubelet/plugins/kubernetes.io/local-volume/volumeDevices/pv2/u1"
        )));
        for other in [
            format!("{csi}/u2"),                                  // another pod's
            "/var/lib/kubelet/pods/u1/volumeDevices/x/u1".into(), // not a map path
            "/srv/plugins/volumeDevices/pv/u1".into(),            // not kubelet's
            "/var/lib/kubelet/plugins/x/dev/u1".into(),           // no volumeDevices
            format!("{csi}/../pv9/dev/u1"),
        ] {
            assert!(!k.is_map_path(Path::new(&other)), "{other}");
        }
        let no_pod = KubeletLoop { pod_uid: None, ..k };
        assert!(!no_pod.is_map_path(Path::new(&format!("{csi}/u1"))));
    }

    #[test]
    fn codes_and_paths() {
        let mut mi = MountInfo::block("/dev/loop0", "xfs");
        mi.options = vec!["ro".into(), "noatime".into()];
        let v = Volume::from_record(LayoutKind::Crust, "/t/x", &mi, false);
        assert!(v.readonly);
        assert_eq!(guest_path(&v), format!("/run/crust/volumes/{}", v.id));
        assert_eq!(agent_fstype(&v).unwrap(), FsType::Xfs);
        let e = VolumeError::Agent {
            target: "/t".into(),
            what: "stats",
            source: ClientError::Timeout {
                op: "stat_volume",
                after: Duration::from_secs(1),
            },
        };
        assert_eq!(e.code(), Code::DeadlineExceeded);
        assert!(e.to_string().contains("timed out"), "{e}");
        let bad = Volume {
            fstype: "btrfs".into(),
            ..v
        };
        assert!(agent_fstype(&bad).is_err());
    }

    #[test]
    fn a_record_whose_limits_do_not_read_is_never_plugged() {
        let mut mi = MountInfo::block("/dev/loop0", "ext4");
        mi.metadata
            .insert(crust_handoff::IO_LIMITS_KEY.into(), "iops=200".into());
        let v = Volume::from_record(LayoutKind::Crust, "/t/q", &mi, false);
        check_for_guest(&v).unwrap();
        assert_eq!(io_limits(&v).unwrap().iops, 200);
        // A record written by another tool, or damaged: no unthrottled plug.
        for bad in ["iops=fast", "iops=5,readIops=1", "burst=9"] {
            let v = Volume {
                io_limits: Some(bad.into()),
                ..v.clone()
            };
            let e = check_for_guest(&v).unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition, "{bad}: {e}");
            assert!(e.to_string().contains("ioLimits"), "{e}");
        }
        let none = Volume::from_record(
            LayoutKind::Crust,
            "/t/q",
            &MountInfo::block("/dev/loop0", "ext4"),
            false,
        );
        assert!(io_limits(&none).unwrap().is_unlimited());
    }
}
