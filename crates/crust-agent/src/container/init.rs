//! The container init helper: the agent binary re-executed as
//! `crust-agent __container-init` becomes the container's process. It
//! reads its [`InitSpec`] from the sync socket (fd number in
//! `CRUST_INIT_SYNC`), builds the container's view (a private mount
//! namespace, the rootfs bind, the OCI mounts, masked and read-only paths,
//! sysctls, the cgroup), pivots into it, takes on the OOM score, user,
//! rlimits, capabilities and terminal, loads the seccomp filter last, and
//! `exec`s the process. The agent starts it already in the container's
//! PID namespace (see [`super::spawn_in_pid_ns`]): a namespace changes
//! only for a process's children.
//!
//! Why pivot_root and not chroot: the container's mount namespace starts
//! as a copy of the agent's, with every share, volume and other
//! container's rootfs in it. A chroot leaves all of that one `..` away
//! for any process holding CAP_SYS_CHROOT (containerd's default set); a
//! pivot_root followed by a detach of the old root removes it from the
//! namespace, as runc does. The guest's `/init` moves the image off the
//! initramfs first, which could not be pivoted away from.
//!
//! Sync protocol (a socketpair, close-on-exec in the helper):
//! agent → helper: the spec as one JSON line. A new container then answers
//! `ready\n` (or an error line) and waits for one byte from the agent
//! before `exec`; an exec process goes straight on. A successful `exec`
//! closes the socket (EOF); a failure writes `{"error": "..."}` first.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use std::collections::BTreeMap;

use crust_agent_proto::{ContainerMount, MountSource, ProcessSpec, Rlimit, Seccomp};
use rustix::fs::{Mode, OFlags};
use rustix::mount::{MountFlags, MountPropagationFlags};
use rustix::process::{Gid, Resource, Uid};
use serde::{Deserialize, Serialize};

use super::rootfs::{self, Leaf, proc_fd};

/// argv[1] that selects the helper.
pub const INIT_ARG: &str = "__container-init";
/// Environment variable naming the sync socket's fd.
pub const SYNC_ENV: &str = "CRUST_INIT_SYNC";

/// What the helper does.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitSpec {
    pub mode: InitMode,
    /// Cgroup directory to join.
    pub cgroup: Option<PathBuf>,
    pub process: ProcessSpec,
    /// The container's filter (an exec gets its container's).
    #[serde(default)]
    pub seccomp: Option<Seccomp>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(
    clippy::large_enum_variant,
    reason = "one message per process, sent once"
)]
pub enum InitMode {
    /// A new container.
    Create {
        /// Guest path of the rootfs source (inside a share, or `/`).
        rootfs: PathBuf,
        /// The rootfs is the guest's own: its mounts stay slaves of the
        /// guest's, so volumes mounted later reach the container too.
        #[serde(default)]
        guest_root: bool,
        /// Empty directory the rootfs is bound on (in the new namespace).
        mountpoint: PathBuf,
        rootfs_readonly: bool,
        mounts: Vec<ContainerMount>,
        masked_paths: Vec<String>,
        readonly_paths: Vec<String>,
        /// (guest device node, container path, mode, uid, gid).
        #[serde(default)]
        devices: Vec<DeviceNode>,
        #[serde(default)]
        ipc: NsPlan,
        #[serde(default)]
        uts: NsPlan,
        /// Set in a new UTS namespace when not empty.
        #[serde(default)]
        hostname: String,
        /// Checked by the agent ([`crust_agent_proto::check_sysctls`]).
        #[serde(default)]
        sysctl: BTreeMap<String, String>,
        /// The user namespace to join last ([`super::userns`]); its fd
        /// idmaps the crust volumes.
        #[serde(default)]
        user: NsPlan,
    },
    /// Join the container whose init runs as `init_pid`.
    Exec { init_pid: u32 },
}

/// How the helper gets one of the container's namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NsPlan {
    /// Keep the agent's (the guest's).
    #[default]
    Inherit,
    New,
    /// The namespace of this process (another container's init).
    Join(u32),
}

/// Opens `/proc/<pid>/ns/<name>` (through the guest's /proc, before the pivot).
fn ns_fd(pid: u32, name: &str) -> Result<OwnedFd, String> {
    rustix::fs::open(
        format!("/proc/{pid}/ns/{name}").as_str(),
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(err(format!("the {name} namespace of process {pid}")))
}

fn join_ns(fd: &OwnedFd, typ: rustix::thread::LinkNameSpaceType, name: &str) -> Result<(), String> {
    rustix::thread::move_into_link_name_space(fd.as_fd(), Some(typ))
        .map_err(err(format!("setns into the {name} namespace")))
}

/// IPC and UTS (IPC first: the container's mqueue mount belongs to it).
fn enter_ipc_uts(ipc: NsPlan, uts: NsPlan, hostname: &str) -> Result<(), String> {
    use rustix::thread::{LinkNameSpaceType as T, UnshareFlags as U};
    for (plan, typ, flag, name) in [
        (ipc, T::InterProcessCommunication, U::NEWIPC, "ipc"),
        (uts, T::HostNameAndNISDomainName, U::NEWUTS, "uts"),
    ] {
        match plan {
            NsPlan::Inherit => {}
            NsPlan::New => crust_sys::ns::unshare(flag)
                .map_err(err(format!("unshare of the {name} namespace")))?,
            NsPlan::Join(pid) => join_ns(&ns_fd(pid, name)?, typ, name)?,
        }
    }
    if uts == NsPlan::New && !hostname.is_empty() {
        rustix::system::sethostname(hostname.as_bytes()).map_err(err("sethostname"))?;
    }
    Ok(())
}

/// A block device node to create in the container.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceNode {
    /// The guest's node, e.g. `/dev/vdc` (its device number is copied).
    pub source: PathBuf,
    pub path: String,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// Devices every container's `/dev` gets when it is a fresh tmpfs.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

fn err<E: std::fmt::Display>(what: impl std::fmt::Display) -> impl FnOnce(E) -> String {
    move |e| format!("{what}: {e}")
}

/// The helper's `main`. Never returns.
pub fn main() -> ! {
    let fd: i32 = match std::env::var(SYNC_ENV).ok().and_then(|v| v.parse().ok()) {
        Some(fd) if fd > 2 => fd,
        _ => {
            eprintln!("{INIT_ARG}: {SYNC_ENV} is not set");
            std::process::exit(125);
        }
    };
    let sync = match crust_sys::fd::inherited(fd) {
        Ok(fd) => fd,
        Err(e) => {
            eprintln!("{INIT_ARG}: {SYNC_ENV}={fd}: {e}");
            std::process::exit(125);
        }
    };
    let _ = rustix::io::fcntl_setfd(&sync, rustix::io::FdFlags::CLOEXEC);
    let mut sync = UnixStream::from(sync);
    let fail = |sync: &mut UnixStream, msg: String| -> ! {
        let line = serde_json::json!({ "error": msg }).to_string();
        let _ = sync.write_all(format!("{line}\n").as_bytes());
        std::process::exit(126);
    };
    let mut line = String::new();
    let read = BufReader::new(&mut sync).read_line(&mut line);
    let spec: InitSpec = match read
        .map_err(|e| e.to_string())
        .and_then(|_| serde_json::from_str(&line).map_err(|e| e.to_string()))
    {
        Ok(s) => s,
        Err(e) => fail(&mut sync, format!("reading the init spec: {e}")),
    };
    let wait_start = matches!(spec.mode, InitMode::Create { .. });
    let mut filter = match spec.seccomp.as_ref().map(super::seccomp::compile) {
        Some(Err(e)) => fail(&mut sync, e),
        Some(Ok(f)) => Some(f),
        None => None,
    };
    if let Err(e) = setup(&spec) {
        fail(&mut sync, e);
    }
    if wait_start {
        if sync.write_all(b"ready\n").is_err() {
            std::process::exit(126);
        }
        let mut b = [0u8; 1];
        match sync.read(&mut b) {
            Ok(1) => {}
            // The agent gave up on this container.
            _ => std::process::exit(126),
        }
    }
    let mut cmd = command(&spec.process);
    // The last step: from here on the profile governs every syscall.
    if let Some(f) = &mut filter
        && let Err(e) = super::seccomp::load(f)
    {
        fail(&mut sync, e);
    }
    let e = cmd.exec();
    fail(
        &mut sync,
        format!(
            "exec {:?}: {e}",
            spec.process.args.first().cloned().unwrap_or_default()
        ),
    )
}

fn command(p: &ProcessSpec) -> std::process::Command {
    let mut cmd = std::process::Command::new(&p.args[0]);
    cmd.args(&p.args[1..]).env_clear();
    if !p.env.iter().any(|kv| kv.starts_with("PATH=")) {
        cmd.env("PATH", crate::process::PATH);
    }
    for kv in &p.env {
        if let Some((k, v)) = kv.split_once('=') {
            cmd.env(k, v);
        }
    }
    cmd
}

/// Everything between the agent's fork and the process's `exec`.
fn setup(spec: &InitSpec) -> Result<(), String> {
    // First, through the guest's /sys and /proc: a container's own mount
    // namespace has neither (or only its read-only view).
    if let Some(cg) = &spec.cgroup {
        std::fs::write(cg.join("cgroup.procs"), "0")
            .map_err(err(format!("joining cgroup {}", cg.display())))?;
    }
    // While the helper is root with every capability (lowering needs
    // CAP_SYS_RESOURCE).
    if let Some(adj) = spec.process.oom_score_adj {
        std::fs::write("/proc/self/oom_score_adj", adj.to_string())
            .map_err(err(format!("process.oomScoreAdj {adj}")))?;
    }
    let userns: Option<OwnedFd>;
    let root: Option<OwnedFd> = match &spec.mode {
        InitMode::Create {
            rootfs,
            guest_root,
            mountpoint,
            rootfs_readonly,
            mounts,
            masked_paths,
            readonly_paths,
            devices,
            ipc,
            uts,
            hostname,
            sysctl,
            user,
        } => {
            userns = match user {
                NsPlan::Join(pid) => Some(ns_fd(*pid, "user")?),
                _ => None,
            };
            enter_ipc_uts(*ipc, *uts, hostname)?;
            // In the container's namespaces, through the guest's /proc.
            for (name, value) in sysctl {
                write_sysctl(name, value)?;
            }
            crust_sys::ns::unshare(rustix::thread::UnshareFlags::NEWNS)
                .map_err(err("unshare(CLONE_NEWNS)"))?;
            if *guest_root {
                rootfs::refuse_symlinks();
            }
            // Nothing the container mounts reaches the guest; a guest-rooted
            // one still receives the guest's later volume mounts.
            let propagation = if *guest_root {
                MountPropagationFlags::DOWNSTREAM
            } else {
                MountPropagationFlags::PRIVATE
            };
            rustix::mount::mount_change("/", propagation | MountPropagationFlags::REC)
                .map_err(err("setting the propagation of /"))?;
            rustix::mount::mount_bind_recursive(rootfs, mountpoint)
                .map_err(err(format!("binding the rootfs {}", rootfs.display())))?;
            let root = open_dir(mountpoint)?;
            for m in mounts {
                mount_one(&root, m, userns.as_ref())
                    .map_err(|e| format!("mount {}: {e}", m.destination))?;
            }
            for d in devices {
                make_device(&root, d).map_err(|e| format!("device {}: {e}", d.path))?;
            }
            for p in masked_paths {
                mask(&root, p)?;
            }
            for p in readonly_paths {
                readonly(&root, p)?;
            }
            if *rootfs_readonly {
                rustix::mount::mount_remount(
                    mountpoint.as_path(),
                    MountFlags::BIND | MountFlags::RDONLY,
                    "",
                )
                .map_err(err("read-only rootfs"))?;
            }
            Some(open_dir(mountpoint)?)
        }
        InitMode::Exec { init_pid } => {
            userns = super::userns::of_other(*init_pid)?;
            let ns = ns_fd(*init_pid, "mnt")?;
            // The container's IPC and UTS, whichever they are.
            enter_ipc_uts(NsPlan::Join(*init_pid), NsPlan::Join(*init_pid), "")?;
            // Entering the namespace sets root and cwd to its root, the
            // container's rootfs (as runc's exec does); never the init's
            // own root, which the container's processes may have changed.
            rustix::thread::move_into_link_name_space(
                ns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Mount),
            )
            .map_err(err("setns into the container"))?;
            None
        }
    };
    // Last, as the guest's root did everything above (the pivot needs
    // CAP_SYS_ADMIN over the mount namespace, which the user namespace
    // does not own).
    if let Some(root) = root {
        pivot_into(root)?;
    }
    if let Some(ns) = &userns {
        super::userns::join(ns)?;
    }
    enter_process(&spec.process)
}

/// Makes `root` (a mount point in this private mount namespace) the
/// namespace's root and detaches everything else: after it no path,
/// `..`, chroot or `/proc` link of this namespace leads out of `root`.
fn pivot_into(root: OwnedFd) -> Result<(), String> {
    rustix::process::fchdir(&root).map_err(err("chdir to the rootfs"))?;
    drop(root);
    // new_root and put_old the same directory: the old root is stacked
    // on the new one, then detached from it (no directory is needed in
    // the container's rootfs, which may be read-only).
    rustix::process::pivot_root(".", ".").map_err(err("pivot_root into the rootfs"))?;
    rustix::mount::unmount(".", rustix::mount::UnmountFlags::DETACH)
        .map_err(err("detaching the guest's root"))?;
    rustix::process::chdir("/").map_err(err("chdir /"))
}

/// `net.ipv4.x` is `/proc/sys/net/ipv4/x`; a name with slashes is a path.
fn write_sysctl(name: &str, value: &str) -> Result<(), String> {
    let rel = if name.contains('/') {
        name.to_string()
    } else {
        name.replace('.', "/")
    };
    std::fs::write(Path::new("/proc/sys").join(rel), value)
        .map_err(err(format!("linux.sysctl {name:?} = {value:?}")))
}

fn open_dir(p: &Path) -> Result<OwnedFd, String> {
    rustix::fs::open(
        p,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(err(format!("open {}", p.display())))
}

/// cwd, terminal, rlimits, capabilities, user, no_new_privs: inside the
/// root, before `exec`.
fn enter_process(p: &ProcessSpec) -> Result<(), String> {
    let cwd = p.cwd.as_deref().unwrap_or("/");
    if !cwd.starts_with('/') {
        return Err(format!("cwd {cwd:?} must be absolute"));
    }
    // runc creates a missing cwd; so do we (as root, before the user switch).
    std::fs::create_dir_all(cwd).map_err(err(format!("creating cwd {cwd}")))?;
    std::env::set_current_dir(cwd).map_err(err(format!("chdir {cwd}")))?;
    if p.terminal {
        rustix::process::setsid().map_err(err("setsid"))?;
        rustix::process::ioctl_tiocsctty(std::io::stdin()).map_err(err("TIOCSCTTY"))?;
    }
    for r in &p.rlimits {
        set_rlimit(r)?;
    }
    let caps = p
        .capabilities
        .as_ref()
        .map(super::caps::Sets::parse)
        .transpose()?;
    if let Some(c) = &caps {
        c.limit_bounding()?;
    }
    if let Some(u) = &p.user {
        let groups: Vec<Gid> = u
            .supplemental_gids
            .iter()
            .map(|g| Gid::from_raw(*g))
            .collect();
        rustix::thread::set_thread_groups(&groups).map_err(err("setgroups"))?;
        rustix::thread::set_thread_gid(Gid::from_raw(u.gid)).map_err(err("setgid"))?;
        rustix::thread::set_thread_uid(Uid::from_raw(u.uid)).map_err(err("setuid"))?;
    }
    if let Some(c) = &caps {
        c.apply()?;
    }
    if p.no_new_privileges {
        rustix::thread::set_no_new_privs(true).map_err(err("no_new_privs"))?;
    }
    Ok(())
}

pub fn resource(name: &str) -> Option<Resource> {
    Some(match name {
        "RLIMIT_CPU" => Resource::Cpu,
        "RLIMIT_FSIZE" => Resource::Fsize,
        "RLIMIT_DATA" => Resource::Data,
        "RLIMIT_STACK" => Resource::Stack,
        "RLIMIT_CORE" => Resource::Core,
        "RLIMIT_RSS" => Resource::Rss,
        "RLIMIT_NPROC" => Resource::Nproc,
        "RLIMIT_NOFILE" => Resource::Nofile,
        "RLIMIT_MEMLOCK" => Resource::Memlock,
        "RLIMIT_AS" => Resource::As,
        "RLIMIT_LOCKS" => Resource::Locks,
        "RLIMIT_SIGPENDING" => Resource::Sigpending,
        "RLIMIT_MSGQUEUE" => Resource::Msgqueue,
        "RLIMIT_NICE" => Resource::Nice,
        "RLIMIT_RTPRIO" => Resource::Rtprio,
        "RLIMIT_RTTIME" => Resource::Rttime,
        _ => return None,
    })
}

fn set_rlimit(r: &Rlimit) -> Result<(), String> {
    let res = resource(&r.kind).ok_or_else(|| format!("unknown rlimit {:?}", r.kind))?;
    let lim = |v: u64| (v != u64::MAX).then_some(v);
    rustix::process::setrlimit(
        res,
        rustix::process::Rlimit {
            current: lim(r.soft),
            maximum: lim(r.hard),
        },
    )
    .map_err(err(format!("setrlimit {}", r.kind)))
}

/// Splits OCI mount options into flags and the data string.
pub fn split_options(readonly: bool, options: &[String]) -> (MountFlags, String) {
    let mut flags = MountFlags::empty();
    if readonly {
        flags |= MountFlags::RDONLY;
    }
    let mut data = Vec::new();
    for o in options {
        match o.as_str() {
            // rro: the host side made every mount below read-only.
            "ro" | "rro" => flags |= MountFlags::RDONLY,
            "nosuid" => flags |= MountFlags::NOSUID,
            "nodev" => flags |= MountFlags::NODEV,
            "noexec" => flags |= MountFlags::NOEXEC,
            "rw" | "suid" | "dev" | "exec" | "bind" | "rbind" | "private" | "rprivate"
            | "slave" | "rslave" | "shared" | "rshared" | "relatime" | "norelatime"
            | "strictatime" | "noatime" | "nosymfollow" => {}
            other => data.push(other.to_string()),
        }
    }
    (flags, data.join(","))
}

fn mount_one(root: &OwnedFd, m: &ContainerMount, userns: Option<&OwnedFd>) -> Result<(), String> {
    let (flags, data) = split_options(m.readonly, &m.options);
    let fs = |root: &OwnedFd, fstype: &str, source: &str| -> Result<(), String> {
        let target = rootfs::open(root, &m.destination, Leaf::Directory)?;
        let data_c = std::ffi::CString::new(data.clone()).map_err(err("mount options"))?;
        rustix::mount::mount(
            source,
            proc_fd(&target).as_path(),
            fstype,
            flags,
            (!data.is_empty()).then_some(data_c.as_c_str()),
        )
        .map_err(err(format!("mount -t {fstype}")))
    };
    match &m.source {
        MountSource::Share(s) => {
            let src = crate::container::share_path(s)?;
            reach_submounts(&src, &m.submounts);
            bind(root, &src, &m.destination, flags)
        }
        MountSource::Volume { volume, subpath } => {
            let vroot = crate::volume::mount_path(volume);
            let vfd = open_dir(&vroot)
                .map_err(|e| format!("volume {volume:?} is not mounted in the guest ({e})"))?;
            let mode = rustix::fs::fstat(&vfd)
                .map(|s| s.st_mode & 0o7777)
                .unwrap_or(0o755);
            let src = crate::subpath::open_beneath(
                &vfd,
                subpath.as_deref().unwrap_or(""),
                true,
                Mode::from_raw_mode(mode),
            )
            .map_err(|e| e.to_string())?;
            match userns {
                Some(ns) => {
                    let st = rustix::fs::fstat(&src).map_err(err("the volume's source"))?;
                    let leaf = match rustix::fs::FileType::from_raw_mode(st.st_mode) {
                        rustix::fs::FileType::Directory => Leaf::Directory,
                        _ => Leaf::File,
                    };
                    let target = rootfs::open(root, &m.destination, leaf)?;
                    super::userns::bind_idmapped(&src, &target, flags, ns)
                }
                None => bind(root, &proc_fd(&src), &m.destination, flags),
            }
        }
        MountSource::PodShm => bind(root, Path::new(super::POD_SHM), &m.destination, flags),
        MountSource::Tmpfs => {
            fs(root, "tmpfs", "tmpfs")?;
            if m.destination.trim_end_matches('/') == "/dev" {
                populate_dev(root)?;
            }
            Ok(())
        }
        MountSource::Proc => fs(root, "proc", "proc"),
        MountSource::Sysfs => fs(root, "sysfs", "sysfs"),
        MountSource::Devpts => fs(root, "devpts", "devpts"),
        MountSource::Mqueue => fs(root, "mqueue", "mqueue"),
        MountSource::Cgroup => {
            let target = rootfs::open(root, &m.destination, Leaf::Directory)?;
            rustix::mount::mount(
                "cgroup2",
                proc_fd(&target).as_path(),
                "cgroup2",
                flags | MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
                None,
            )
            .map_err(err("mount -t cgroup2"))
        }
    }
}

/// Opens each host mount below a share source so virtio-fs mounts it now
/// (on first use it would inherit the flags of the mount it is reached
/// through: a read-only bind would make it read-only). One that cannot be
/// reached (unmounted on the host since) is skipped.
fn reach_submounts(src: &Path, submounts: &[String]) {
    for rel in submounts {
        let p = Path::new(rel);
        if !p
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
        {
            continue;
        }
        if let Err(e) = std::fs::File::open(src.join(p)) {
            eprintln!("crust-agent: submount {rel} of {}: {e}", src.display());
        }
    }
}

/// Binds `src` (a path in the guest, or `/proc/self/fd/N`) on `dest` in the
/// container; read-only (and nosuid/nodev/noexec) by a remount.
fn bind(root: &OwnedFd, src: &Path, dest: &str, flags: MountFlags) -> Result<(), String> {
    let st = std::fs::metadata(src).map_err(err(format!("source {}", src.display())))?;
    let leaf = if st.is_dir() {
        Leaf::Directory
    } else {
        Leaf::File
    };
    let target = rootfs::open(root, dest, leaf)?;
    rustix::mount::mount_bind_recursive(src, proc_fd(&target).as_path())
        .map_err(err("bind mount"))?;
    let extra =
        flags & (MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC);
    if !extra.is_empty() {
        // Reopen: the fd still names the directory under the new mount.
        let mounted = rootfs::open_existing(root, dest)?
            .ok_or_else(|| format!("{dest} vanished after the bind"))?;
        rustix::mount::mount_remount(proc_fd(&mounted).as_path(), MountFlags::BIND | extra, "")
            .map_err(err("remounting the bind with its options"))?;
    }
    Ok(())
}

/// A fresh `/dev` tmpfs gets the standard devices (bound from the guest's
/// devtmpfs) and the `/proc/self/fd` links.
fn populate_dev(root: &OwnedFd) -> Result<(), String> {
    for d in DEVICES {
        bind(
            root,
            &Path::new("/dev").join(d),
            &format!("/dev/{d}"),
            MountFlags::empty(),
        )?;
    }
    let dev = rootfs::open(root, "/dev", Leaf::Directory)?;
    let dev = open_dir(&proc_fd(&dev))?;
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        match rustix::fs::symlinkat(target, &dev, name) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(format!("/dev/{name}: {e}")),
        }
    }
    Ok(())
}

/// Creates a block device node with the guest disk's device number.
fn make_device(root: &OwnedFd, d: &DeviceNode) -> Result<(), String> {
    let st = rustix::fs::stat(&d.source).map_err(err(format!("{}", d.source.display())))?;
    let comps = rootfs::components(&d.path)?;
    let (name, dirs) = comps.split_last().ok_or("empty device path")?;
    let parent = rootfs::open(root, &format!("/{}", dirs.join("/")), Leaf::Directory)?;
    let parent = open_dir(&proc_fd(&parent))?;
    let _ = rustix::fs::unlinkat(&parent, name.as_str(), rustix::fs::AtFlags::empty());
    rustix::fs::mknodat(
        &parent,
        name.as_str(),
        rustix::fs::FileType::BlockDevice,
        Mode::from_raw_mode(d.mode & 0o7777),
        st.st_rdev,
    )
    .map_err(err("mknod"))?;
    rustix::fs::chownat(
        &parent,
        name.as_str(),
        Some(Uid::from_raw(d.uid)),
        Some(Gid::from_raw(d.gid)),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .map_err(err("chown"))
}

/// OCI maskedPaths: a directory gets an empty read-only tmpfs, a file
/// `/dev/null`; a missing path is left alone (as runc does).
fn mask(root: &OwnedFd, p: &str) -> Result<(), String> {
    let Some(fd) = rootfs::open_existing(root, p)? else {
        return Ok(());
    };
    let st = rustix::fs::fstat(&fd).map_err(err(format!("masked path {p}")))?;
    let target = proc_fd(&fd);
    if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory {
        rustix::mount::mount("tmpfs", target.as_path(), "tmpfs", MountFlags::RDONLY, None)
    } else {
        rustix::mount::mount_bind(Path::new("/dev/null"), target.as_path())
    }
    .map_err(err(format!("masking {p}")))
}

/// OCI readonlyPaths: bound on themselves, then remounted read-only.
fn readonly(root: &OwnedFd, p: &str) -> Result<(), String> {
    let Some(fd) = rootfs::open_existing(root, p)? else {
        return Ok(());
    };
    let target = proc_fd(&fd);
    rustix::mount::mount_bind_recursive(target.as_path(), target.as_path())
        .map_err(err(format!("read-only path {p}")))?;
    let Some(fd) = rootfs::open_existing(root, p)? else {
        return Ok(());
    };
    rustix::mount::mount_remount(
        proc_fd(&fd).as_path(),
        MountFlags::BIND
            | MountFlags::RDONLY
            | MountFlags::NOSUID
            | MountFlags::NODEV
            | MountFlags::NOEXEC,
        "",
    )
    .map_err(err(format!("read-only path {p}")))
}
