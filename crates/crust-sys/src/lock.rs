//! POSIX record locks (`fcntl` F_SETLK / F_GETLK) over a whole file; rustix
//! wraps only open-file-description and `flock` locks.

use std::io;

use rustix::fd::{AsFd, AsRawFd};

/// A lock to take (or drop) on a whole file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PosixLock {
    Read,
    Write,
    Unlock,
}

fn whole_file(kind: PosixLock) -> libc::flock {
    // SAFETY: integers only; all-zero is a valid flock (start 0, len 0 is
    // the whole file).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = match kind {
        PosixLock::Read => libc::F_RDLCK,
        PosixLock::Write => libc::F_WRLCK,
        PosixLock::Unlock => libc::F_UNLCK,
    } as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl
}

/// F_SETLK without waiting: takes, or drops, `kind` on the whole file
/// (EAGAIN/EACCES when another process holds a conflicting lock).
pub fn set(file: impl AsFd, kind: PosixLock) -> io::Result<()> {
    let fl = whole_file(kind);
    // SAFETY: a live descriptor and a live flock the kernel only reads.
    if unsafe { libc::fcntl(file.as_fd().as_raw_fd(), libc::F_SETLK, &raw const fl) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// F_GETLK for a write lock on the whole file: the pid of a process whose
/// lock would conflict, if any.
pub fn holder(file: impl AsFd) -> io::Result<Option<i32>> {
    let mut fl = whole_file(PosixLock::Write);
    // SAFETY: a live descriptor and a live flock the kernel reads and
    // writes.
    if unsafe { libc::fcntl(file.as_fd().as_raw_fd(), libc::F_GETLK, &raw mut fl) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((fl.l_type != libc::F_UNLCK as libc::c_short).then_some(fl.l_pid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_is_taken_seen_by_nobody_else_in_this_process_and_dropped() {
        let f = tempfile::tempfile().unwrap();
        set(&f, PosixLock::Write).unwrap();
        // POSIX locks are per process: our own never conflicts.
        assert_eq!(holder(&f).unwrap(), None);
        set(&f, PosixLock::Unlock).unwrap();
        set(&f, PosixLock::Read).unwrap();
    }
}
