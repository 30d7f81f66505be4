//! `openat2(2)` retried: the one call every descriptor-relative lookup of
//! crust makes (the host in a guest-writable share or a volume, the guest
//! agent in volumes and container roots).
//!
//! Under `RESOLVE_BENEATH` or `RESOLVE_IN_ROOT` the kernel answers EAGAIN
//! when a rename or a mount anywhere on the system raced a lookup that
//! went through `..`: it cannot prove the walk stayed inside. A guest or a
//! pod can cause that at will, so a caller that does not retry fails
//! spuriously, and one that retries forever can be held in the loop. The
//! retries here are bounded ([`MAX_TRIES`]); after the last one the
//! caller gets EAGAIN, as from the kernel. EINTR is retried the same way.
//! Every other answer, refusals included (EXDEV for an escape, ELOOP for a
//! symlink under `RESOLVE_NO_SYMLINKS`), is returned unchanged.

use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use rustix::path::Arg;

/// Calls made before EAGAIN or EINTR is given to the caller. A lookup
/// takes microseconds, so this waits out any honest race; a sustained
/// one (a workload renaming in a loop) ends as an error instead of a
/// livelock.
pub const MAX_TRIES: u32 = 128;

/// `openat2` of `path` relative to `dir` with `O_CLOEXEC` added, retried
/// on EAGAIN and EINTR at most [`MAX_TRIES`] times in all.
pub fn openat2<P: Arg + Copy>(
    dir: impl AsFd,
    path: P,
    flags: OFlags,
    mode: Mode,
    resolve: ResolveFlags,
) -> Result<OwnedFd, Errno> {
    retried(|| rustix::fs::openat2(dir.as_fd(), path, flags | OFlags::CLOEXEC, mode, resolve))
}

/// Runs `call` until it answers other than EAGAIN/EINTR, at most
/// [`MAX_TRIES`] times.
fn retried<T>(mut call: impl FnMut() -> Result<T, Errno>) -> Result<T, Errno> {
    let mut tries = 1;
    loop {
        match call() {
            Err(Errno::AGAIN | Errno::INTR) if tries < MAX_TRIES => tries += 1,
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::fs::symlink;

    use super::*;

    const BENEATH: ResolveFlags = ResolveFlags::BENEATH
        .union(ResolveFlags::NO_SYMLINKS)
        .union(ResolveFlags::NO_MAGICLINKS);

    /// A root with `a/file` inside, `secret` beside it, and symlinks out.
    fn tree() -> (tempfile::TempDir, OwnedFd) {
        let top = tempfile::tempdir().unwrap();
        let root = top.path().join("root");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::write(root.join("a/file"), b"inside").unwrap();
        std::fs::write(top.path().join("secret"), b"outside").unwrap();
        symlink("../../secret", root.join("a/up")).unwrap();
        symlink(top.path().join("secret"), root.join("abs")).unwrap();
        let fd = rustix::fs::open(&root, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
        (top, fd)
    }

    fn read(fd: OwnedFd) -> String {
        let mut s = String::new();
        std::fs::File::from(fd).read_to_string(&mut s).unwrap();
        s
    }

    #[test]
    fn resolves_beneath_and_sets_cloexec() {
        let (_top, root) = tree();
        let fd = openat2(&root, "a/file", OFlags::RDONLY, Mode::empty(), BENEATH).unwrap();
        let fl = rustix::io::fcntl_getfd(&fd).unwrap();
        assert!(fl.contains(rustix::io::FdFlags::CLOEXEC));
        assert_eq!(read(fd), "inside");
        // a `..` that stays inside is fine
        let fd = openat2(&root, "a/../a/file", OFlags::RDONLY, Mode::empty(), BENEATH).unwrap();
        assert_eq!(read(fd), "inside");
    }

    #[test]
    fn refuses_dotdot_escapes_and_symlinks_out() {
        let (_top, root) = tree();
        let open = |p: &str, r: ResolveFlags| openat2(&root, p, OFlags::RDONLY, Mode::empty(), r);
        assert_eq!(open("../secret", BENEATH).unwrap_err(), Errno::XDEV);
        assert_eq!(open("a/../../secret", BENEATH).unwrap_err(), Errno::XDEV);
        // symlinks are refused outright with NO_SYMLINKS...
        assert_eq!(open("a/up", BENEATH).unwrap_err(), Errno::LOOP);
        assert_eq!(open("abs", BENEATH).unwrap_err(), Errno::LOOP);
        // ...and a relative one leading out still cannot leave without it
        let beneath_only = ResolveFlags::BENEATH;
        assert_eq!(open("a/up", beneath_only).unwrap_err(), Errno::XDEV);
        assert_eq!(open("abs", beneath_only).unwrap_err(), Errno::XDEV);
        // IN_ROOT: the absolute link is read inside the root, where no
        // `secret` exists
        let in_root = ResolveFlags::IN_ROOT;
        assert_eq!(open("abs", in_root).unwrap_err(), Errno::NOENT);
    }

    #[test]
    fn retries_are_bounded_and_other_errors_pass_at_once() {
        let mut calls = 0;
        let r: Result<(), _> = retried(|| {
            calls += 1;
            Err(Errno::AGAIN)
        });
        assert_eq!((r, calls), (Err(Errno::AGAIN), MAX_TRIES));

        let mut calls = 0;
        let r = retried(|| {
            calls += 1;
            if calls < 3 {
                Err(Errno::INTR)
            } else {
                Ok(calls)
            }
        });
        assert_eq!(r, Ok(3));

        let mut calls = 0;
        let r: Result<(), _> = retried(|| {
            calls += 1;
            Err(Errno::XDEV)
        });
        assert_eq!((r, calls), (Err(Errno::XDEV), 1));
    }
}
