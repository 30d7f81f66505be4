//! Host-side block device primitives for crust.
//!
//! Everything the CSI plugin and the backends need to turn a file or a block
//! device into a mounted, measured and health-checked volume:
//!
//! * [`loopdev`]: loop devices through the kernel ioctls (no `losetup`):
//!   [`LoopDevice::attach`], [`find_by_backing`], [`detach`],
//!   [`refresh_capacity`], [`list_loops`], and [`LoopGuard`] for tests.
//! * [`device`]: [`block_device_size`], [`is_block_device`],
//!   [`device_major_minor`], [`set_read_only`], [`is_device_in_use`] (an `O_EXCL` test,
//!   [`is_device_held_exclusively`], plus other processes' descriptors from
//!   `/proc/*/fd`, [`device_openers`]), [`wipe_edges`].
//! * [`holder`]: [`claim_exclusive`] / [`ensure_device_free`]: nobody
//!   else has the device (an `O_EXCL` open plus sysfs holders; the holder
//!   named from `/proc` only after a refusal) and no other device exposes
//!   its data ([`alias`]), and the [`ExclusiveDevice`] the runtime keeps
//!   while a guest may use a device. [`ensure_released`]: the release proof.
//! * [`bypass`]: [`route`], a loop device's whole backing file proven by
//!   descriptor, for QEMU to skip the loop driver.
//! * [`alias`]: [`ensure_no_aliases`]: other loop devices bound to the
//!   same backing inode, loops stacked on the device, kernel holders.
//! * [`probe`]: [`probe_fs`] reads superblocks so a device holding data is
//!   never formatted; [`fs_bytes`] / [`fs_needs_grow`] compare a
//!   filesystem's size with its device's.
//! * [`gate`]: [`format`], the one routine that writes a filesystem over
//!   a device, and only with a [`BlankProof`] (see docs/security.md).
//! * [`fs`]: [`FsType`], [`mkfs`] (the gate with a full read), online [`grow_fs`] and
//!   [`grow_fs_offline`] (the only places that exec tools: `mkfs.ext4`,
//!   `mkfs.xfs`, `resize2fs`, `xfs_growfs`, `e2fsck`). Online ext4 growth
//!   needs `CAP_SYS_RESOURCE`: see [`can_grow_ext4_online`]. [`mkfs`] and
//!   [`grow_fs_offline`] refuse a device another process has open
//!   ([`ensure_no_other_openers`]).
//! * [`mount`]: [`mount_fs`], [`bind_mount`], [`unmount`], [`mount_info`],
//!   [`find_mount`], [`is_mountpoint`], [`MountGuard`].
//! * [`zeros`]: [`first_data_offset`], a full read of a device for any
//!   non-zero byte (what proves a device without signatures blank).
//! * [`mod@usage`]: [`usage()`] from `statvfs`.
//! * [`copy`]: [`clone_file`], a reflink or hole-preserving copy of a
//!   backing file (snapshots, clones).
//! * [`freeze`]: [`freeze`] a mounted filesystem around such a copy, with a
//!   guaranteed thaw.
//! * [`health`]: [`fs_health`], [`device_health`], [`with_timeout`].
//! * [`path`]: [`validate_abs_path`] for paths that come from a CO.
//!
//! All functions are synchronous and may block on I/O; call them from
//! `tokio::task::spawn_blocking` in async code. Health probes should be
//! wrapped in [`with_timeout`] (see [`fs_health_with_timeout`]).

pub mod alias;
pub mod bypass;
pub mod copy;
pub mod device;
pub mod freeze;
pub mod fs;
pub mod gate;
pub mod health;
pub mod holder;
pub mod identity;
pub mod loopdev;
pub mod mount;
pub mod path;
pub mod probe;
mod sys;
mod tool;
pub mod usage;
pub mod users;
pub mod zeros;

pub use alias::{
    ALIAS_SCAN_LIMIT, Alias, AliasError, AliasKind, ensure_no_aliases, ensure_no_aliases_but,
};
pub use bypass::{Route, backing_file_bytes, route};
pub use copy::{CopyError, CopyMethod, CopyOutcome, clone_file};
pub use device::{
    DeviceError, OPENERS_SCAN_LIMIT, Opener, block_device_size, device_major_minor, device_openers,
    flush_device_cache, is_block_device, is_device_held_exclusively, is_device_in_use,
    logical_block_size, set_read_only, sysfs_name, wipe_edges, zero_out_fast,
};
pub use freeze::{FreezeError, Frozen, freeze, freeze_unguarded, thaw_if_frozen};
pub use fs::{
    CHECK, FsError, FsType, can_grow_ext4_online, check_unmounted, ensure_no_other_openers,
    fs_tools, grow_fs, grow_fs_offline, known_signatures, missing_fs_tools,
};
pub use gate::{BlankProof, format, mkfs};
pub use health::{
    DEFAULT_HEALTH_TIMEOUT, Health, Symptom, SymptomKind, containing_fs_health, device_health,
    fs_health, fs_health_with_timeout, with_timeout,
};
pub use holder::{
    ClaimError, ExclusiveDevice, HAND_TO_GUEST, HeldWithAliases, Holder, claim_exclusive,
    claim_exclusive_keeping, ensure_device_free, ensure_released, mounts_everywhere_of,
    name_holders,
};
pub use identity::{DeviceIdentity, identity_of};
pub use loopdev::{
    AttachOptions, LoopDevice, LoopError, LoopGuard, LoopInfo, LoopStatus, detach, dio_block_size,
    find_all_by_backing, find_by_backing, list_loops, loop_status, refresh_capacity,
};
pub use mount::{
    MountEntry, MountError, MountGuard, ParsedOptions, bind_mount, find_mount, is_mountpoint,
    mount_fs, mount_info, mount_points_below, parse_mount_options, parse_mountinfo,
    root_mounted_at, unmount, unmount_top,
};
pub use path::{MAX_PATH_LEN, PathError, validate_abs_path};
pub use probe::{Probe, ProbeError, fs_bytes, fs_needs_grow, probe_fs};
pub use tool::ToolError;
pub use usage::{Usage, UsageError, usage};
pub use users::{FsUser, Use, filesystem_users};
pub use zeros::{SCAN_CHUNK, ZeroScan, first_data_offset, scan_for_data};
