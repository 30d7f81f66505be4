//! A descriptor inherited across exec, named by number.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

/// Numbers already taken by [`inherited`] in this process.
static CLAIMED: Mutex<BTreeSet<RawFd>> = Mutex::new(BTreeSet::new());

/// Takes ownership of descriptor `fd`, which this process received across
/// exec (its parent named the number in an argument or the environment).
///
/// A descriptor inherited across exec has close-on-exec cleared, and
/// everything this process opens (std, rustix) has it set: a number with
/// the flag set is refused, as are standard streams, numbers that are not
/// open and a number already taken, so two owners never close the same
/// descriptor. The flag is set once the descriptor is taken.
pub fn inherited(fd: RawFd) -> io::Result<OwnedFd> {
    if fd <= 2 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is a standard stream"),
        ));
    }
    let mut claimed = CLAIMED.lock().unwrap_or_else(|p| p.into_inner());
    if claimed.contains(&fd) {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("descriptor {fd} was already taken"),
        ));
    }
    // F_GETFD fails with EBADF when the number is not open.
    // SAFETY: fcntl(F_GETFD) reads no memory and changes nothing.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & libc::FD_CLOEXEC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is close-on-exec: opened by this process, not inherited"),
        ));
    }
    claimed.insert(fd);
    // SAFETY: the number is open and was not opened by this process (no
    // close-on-exec flag), and is taken once (CLAIMED).
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC)?;
    Ok(owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_closed_numbers_and_second_claims_are_refused() {
        assert_eq!(
            inherited(1).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert!(inherited(100_000).unwrap_err().raw_os_error().is_some());
        // One this process opened (close-on-exec) is not inherited.
        let f = tempfile::tempfile().unwrap();
        let n = std::os::fd::AsRawFd::as_raw_fd(&f);
        assert_eq!(
            inherited(n).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        // The same descriptor as an exec would leave it.
        rustix::io::fcntl_setfd(&f, rustix::io::FdFlags::empty()).unwrap();
        let n = std::os::fd::IntoRawFd::into_raw_fd(f);
        let owned = inherited(n).unwrap();
        let flags = rustix::io::fcntl_getfd(&owned).unwrap();
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        assert_eq!(
            inherited(n).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        drop(owned);
    }
}
