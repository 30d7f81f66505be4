//! What a child does between fork and exec: one pattern for every spawn.
//!
//! Only raw system calls run in the child (no allocation, no locks), in a
//! fixed order: a new session, the cgroups it is born in, new namespaces,
//! a mount namespace it enters, descriptors it keeps, the identity it runs as (after which it may no
//! longer be allowed the rest), and last the parent-death signal (a change
//! of identity clears it).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use rustix::process::{Gid, Signal, Uid};
use rustix::thread::UnshareFlags;

/// The child's setup; [`ChildSetup::apply`] installs it on a `Command`.
#[derive(Debug, Default)]
pub struct ChildSetup {
    new_session: bool,
    death_signal: Option<Signal>,
    cgroup_procs: Vec<OwnedFd>,
    unshare: Option<UnshareFlags>,
    /// A mount namespace to enter (`setns`).
    mount_ns: Option<OwnedFd>,
    /// A duplicate of each kept descriptor (close-on-exec) and the number
    /// the child must have it under.
    keep: Vec<(OwnedFd, RawFd)>,
    identity: Option<(Vec<Gid>, Gid, Uid)>,
    /// A descriptor that could not be duplicated: reported by `apply`.
    failed: Option<io::Error>,
}

impl ChildSetup {
    pub fn new() -> ChildSetup {
        ChildSetup::default()
    }

    /// `setsid()`: the child leads a new session (it outlives its parent's
    /// terminal and process group).
    pub fn new_session(mut self) -> ChildSetup {
        self.new_session = true;
        self
    }

    /// The child gets `signal` when the thread that spawned it exits.
    pub fn death_signal(mut self, signal: Signal) -> ChildSetup {
        self.death_signal = Some(signal);
        self
    }

    /// The child writes itself into this open `cgroup.procs` before exec,
    /// so it is born there (and everything it starts too).
    pub fn cgroup(mut self, procs: OwnedFd) -> ChildSetup {
        self.cgroup_procs.push(procs);
        self
    }

    /// The child enters new namespaces of these kinds (see
    /// [`crate::ns::unshare`]: namespace flags only).
    pub fn unshare(mut self, flags: UnshareFlags) -> ChildSetup {
        self.unshare = Some(flags);
        self
    }

    /// The child enters the mount namespace `ns` refers to (an open
    /// `/proc/<pid>/ns/mnt`): its root and working directory become the
    /// namespace's root, and the program is looked up there.
    pub fn mount_namespace(mut self, ns: OwnedFd) -> ChildSetup {
        self.mount_ns = Some(ns);
        self
    }

    /// The child has `fd` across exec, under the same number (close-on-exec
    /// cleared in the child only). The setup holds its own duplicate, so
    /// the caller may close `fd` before the spawn.
    pub fn keep(mut self, fd: BorrowedFd<'_>) -> ChildSetup {
        match fd.try_clone_to_owned() {
            Ok(dup) => self.keep.push((dup, fd.as_raw_fd())),
            Err(e) => self.failed = self.failed.or(Some(e)),
        }
        self
    }

    /// The child runs as `uid`/`gid` with exactly `groups`.
    pub fn identity(mut self, uid: Uid, gid: Gid, groups: Vec<Gid>) -> ChildSetup {
        self.identity = Some((groups, gid, uid));
        self
    }

    /// Installs the setup on `cmd`. A step that fails fails the spawn with
    /// its error.
    pub fn apply(mut self, cmd: &mut Command) -> io::Result<()> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        if let Some(flags) = self.unshare {
            // Refused here, in the parent, with a clear error.
            crate::ns::check_namespaces(flags)?;
        }
        if self.is_empty() {
            // Nothing to do in the child: std keeps its faster spawn.
            return Ok(());
        }
        // SAFETY: the closure makes raw system calls only, on values it
        // owns (moved in) or descriptor numbers the caller keeps open; it
        // allocates nothing and takes no lock, as a forked child must.
        unsafe {
            cmd.pre_exec(move || self.in_child());
        }
        Ok(())
    }

    fn is_empty(&self) -> bool {
        !self.new_session
            && self.death_signal.is_none()
            && self.cgroup_procs.is_empty()
            && self.unshare.is_none()
            && self.mount_ns.is_none()
            && self.keep.is_empty()
            && self.identity.is_none()
    }

    fn in_child(&self) -> io::Result<()> {
        if self.new_session {
            rustix::process::setsid()?;
        }
        for procs in &self.cgroup_procs {
            rustix::io::write(procs, b"0")?;
        }
        if let Some(flags) = self.unshare {
            // SAFETY: namespace flags only (checked in apply), in a
            // single-threaded child.
            unsafe { rustix::thread::unshare_unsafe(flags) }?;
        }
        if let Some(ns) = &self.mount_ns {
            rustix::thread::move_into_link_name_space(
                ns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Mount),
            )?;
        }
        for (dup, number) in &self.keep {
            // dup2 onto the number the program expects: the new descriptor
            // has close-on-exec cleared; our duplicate keeps it and goes.
            // SAFETY: dup2 takes two integers and touches this child's
            // descriptor table only, before exec.
            if unsafe { libc::dup2(dup.as_raw_fd(), *number) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        if let Some((groups, gid, uid)) = &self.identity {
            rustix::thread::set_thread_groups(groups)?;
            rustix::thread::set_thread_gid(*gid)?;
            rustix::thread::set_thread_uid(*uid)?;
        }
        if let Some(sig) = self.death_signal {
            rustix::process::set_parent_process_death_signal(Some(sig))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Stdio;

    #[test]
    fn a_kept_descriptor_crosses_exec_and_others_do_not() {
        let kept = tempfile::tempfile().unwrap();
        let other = tempfile::tempfile().unwrap();
        let (k, o) = (kept.as_raw_fd(), other.as_raw_fd());
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!(
                "[ -e /proc/$$/fd/{k} ] && [ ! -e /proc/$$/fd/{o} ] && echo $$ $(cut -d' ' -f6 /proc/$$/stat)"
            ))
            .stdout(Stdio::piped());
        ChildSetup::new()
            .new_session()
            .keep(rustix::fd::AsFd::as_fd(&kept))
            .apply(&mut cmd)
            .unwrap();
        // The setup holds its own duplicate: closing ours changes nothing.
        drop(kept);
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        // The child leads its own session: its session id is its pid.
        let ids: Vec<&str> = text.split_whitespace().collect();
        assert_eq!(ids.len(), 2, "{text}");
        assert_eq!(ids[0], ids[1], "{text}");
    }

    /// Needs root (CAP_SYS_ADMIN for unshare and setns).
    #[test]
    fn a_child_enters_the_mount_namespace_it_is_given() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        // A namespace of its own, held by a sleeping child.
        let mut holder = Command::new("sleep");
        holder.arg("30");
        ChildSetup::new()
            .unshare(UnshareFlags::NEWNS)
            .apply(&mut holder)
            .unwrap();
        let mut holder = holder.spawn().unwrap();
        let ns = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
        let theirs = ns(holder.id());
        assert_ne!(theirs, ns(std::process::id()));
        let fd = std::fs::File::open(format!("/proc/{}/ns/mnt", holder.id())).unwrap();
        let mut cmd = Command::new("readlink");
        cmd.arg("/proc/self/ns/mnt").stdout(Stdio::piped());
        ChildSetup::new()
            .mount_namespace(fd.into())
            .apply(&mut cmd)
            .unwrap();
        let out = cmd.output().unwrap();
        let _ = holder.kill();
        let _ = holder.wait();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            theirs.to_string_lossy()
        );
    }

    #[test]
    fn a_non_namespace_flag_fails_before_the_fork() {
        let mut cmd = Command::new("true");
        let e = ChildSetup::new()
            .unshare(UnshareFlags::FILES)
            .apply(&mut cmd)
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
