//! A container's user namespace (OCI `linux.uidMappings`/`gidMappings`)
//! and the idmapped mounts of its crust volumes.
//!
//! The agent makes the namespace: a holder process (the agent binary run
//! as `__userns-hold`) unshares it, the agent, root in the guest, writes
//! its `uid_map`/`gid_map` (any mapping, one write each, as the kernel
//! wants), and the init helper joins it by pid. The helper builds the
//! container's mounts as the guest's root first and joins the namespace
//! last, right after the `pivot_root`: the mount, IPC and UTS namespaces stay the
//! guest root's, so the container cannot mount or set a hostname, and
//! mounts that need the guest's root (proc of its PID namespace, sysfs,
//! the virtio-fs binds) work as without a user namespace.
//!
//! What the container sees:
//! - crust volumes: bound with `MOUNT_ATTR_IDMAP` through its namespace, so
//!   a file its uid 0 writes is owned by 0 on disk and reads back as 0 in
//!   a pod without a mapping (ext4 and xfs idmap in 6.1:
//!   `crust_fs::FsSpec::idmap`);
//! - the rootfs and the other virtio-fs binds: not idmapped (6.1's virtiofs
//!   cannot be). Their owners are the host's ids as the guest sees them,
//!   read through the container's mapping: what containerd's remapped
//!   snapshot (`ctr run --uidmap`, kubelet before idmapped rootfs) chowned
//!   into the mapped range shows as the container's own ids; anything
//!   else shows as the overflow id (65534) and is writable only where its
//!   mode lets others write;
//! - tmpfs, `/dev`, `/dev/shm`, mqueue, devpts, proc and sysfs: mounted by
//!   the guest's root, owned by an id outside the mapping (65534 inside).

use crust_sys::spawn::ChildSetup;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};

use crust_agent_proto::IdMapping;
use rustix::mount::{MountAttrFlags, MountFlags, MoveMountFlags, OpenTreeFlags};

/// argv[1] of the holder process.
pub const HOLD_ARG: &str = "__userns-hold";

/// The holder's `main`: waits for stdin to close. Never returns.
pub fn hold_main() -> ! {
    let _ = std::io::stdin().read(&mut [0u8; 1]);
    std::process::exit(0)
}

/// A new user namespace with its maps written, alive while the holder
/// is (killed on drop: once the helper has joined, the container's
/// processes keep the namespace).
pub struct Holder {
    child: Child,
}

impl Holder {
    pub fn new(uid: &[IdMapping], gid: &[IdMapping]) -> Result<Holder, String> {
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg(HOLD_ARG)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // In the child, single-threaded as unshare(CLONE_NEWUSER) requires.
        ChildSetup::new()
            .unshare(rustix::thread::UnshareFlags::NEWUSER)
            .apply(&mut cmd)
            .map_err(|e| format!("creating the user namespace: {e}"))?;
        let child = cmd
            .spawn()
            .map_err(|e| format!("creating the user namespace: {e}"))?;
        let holder = Holder { child };
        let pid = holder.pid();
        // gid_map first is not needed: the writer is the guest's root.
        write_map(pid, "uid_map", "linux.uidMappings", uid)?;
        write_map(pid, "gid_map", "linux.gidMappings", gid)?;
        Ok(holder)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The kernel takes a map in one write only.
fn write_map(pid: u32, file: &str, field: &str, map: &[IdMapping]) -> Result<(), String> {
    let text: String = map
        .iter()
        .map(|l| format!("{} {} {}\n", l.container_id, l.host_id, l.size))
        .collect();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{pid}/{file}"))
        .map_err(|e| format!("{field}: opening {file}: {e}"))?;
    let n = rustix::io::write(&f, text.as_bytes())
        .map_err(|e| format!("{field}: the guest kernel refused it: {e}"))?;
    if n != text.len() {
        return Err(format!("{field}: short write of {file}"));
    }
    Ok(())
}

/// Binds `src` (an `O_PATH` fd in a volume) on `target` (an `O_PATH` fd in
/// the container's root) as an idmapped mount through `userns`, with the
/// read-only/nosuid/nodev/noexec bits of `flags`.
pub fn bind_idmapped(
    src: &OwnedFd,
    target: &OwnedFd,
    flags: MountFlags,
    userns: &OwnedFd,
) -> Result<(), String> {
    let tree = rustix::mount::open_tree(
        src,
        "",
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_EMPTY_PATH,
    )
    .map_err(|e| format!("open_tree: {e}"))?;
    let mut set = MountAttrFlags::MOUNT_ATTR_IDMAP;
    for (f, a) in [
        (MountFlags::RDONLY, MountAttrFlags::MOUNT_ATTR_RDONLY),
        (MountFlags::NOSUID, MountAttrFlags::MOUNT_ATTR_NOSUID),
        (MountFlags::NODEV, MountAttrFlags::MOUNT_ATTR_NODEV),
        (MountFlags::NOEXEC, MountAttrFlags::MOUNT_ATTR_NOEXEC),
    ] {
        if flags.contains(f) {
            set |= a;
        }
    }
    let attr = crust_sys::mount::MountAttr {
        set: u64::from(set.bits()),
        userns: Some(userns.as_fd()),
        ..Default::default()
    };
    crust_sys::mount::setattr(tree.as_fd(), false, &attr)
        .map_err(|e| format!("idmapping the volume (mount_setattr MOUNT_ATTR_IDMAP): {e}"))?;
    rustix::mount::move_mount(
        tree.as_fd(),
        "",
        target.as_fd(),
        "",
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
    )
    .map_err(|e| format!("move_mount: {e}"))
}

/// The user namespace of process `pid` when it is not the caller's (an
/// exec joins its container's).
pub fn of_other(pid: u32) -> Result<Option<OwnedFd>, String> {
    let open = |p: String| {
        rustix::fs::open(
            p.as_str(),
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(|e| format!("{p}: {e}"))
    };
    let theirs = open(format!("/proc/{pid}/ns/user"))?;
    let ours = open("/proc/self/ns/user".into())?;
    let ino = |fd: &OwnedFd| rustix::fs::fstat(fd).map(|s| (s.st_dev, s.st_ino));
    if ino(&theirs).map_err(|e| e.to_string())? == ino(&ours).map_err(|e| e.to_string())? {
        Ok(None)
    } else {
        Ok(Some(theirs))
    }
}

/// Joins `ns`: the process gets every capability in it (dropped by the
/// process's own sets next) and its ids through the mappings.
pub fn join(ns: &OwnedFd) -> Result<(), String> {
    rustix::thread::move_into_link_name_space(
        ns.as_fd(),
        Some(rustix::thread::LinkNameSpaceType::User),
    )
    .map_err(|e| format!("setns into the user namespace: {e}"))
}
