//! `unshare(2)` of namespaces.

use std::io;

pub use rustix::thread::UnshareFlags;

/// Moves the calling thread into new namespaces of the kinds in `flags`.
///
/// Only namespace flags are taken: `CLONE_FILES` (a private descriptor
/// table, under which descriptors owned by other threads could name other
/// files) and the rest of unshare's flags are refused. `NEWUSER` and
/// `NEWPID`'s rules (a single-threaded caller; children go into the new
/// PID namespace) are the kernel's to enforce.
pub fn unshare(flags: UnshareFlags) -> io::Result<()> {
    check_namespaces(flags)?;
    // SAFETY: no CLONE_FILES (checked above): every descriptor keeps the
    // meaning it has for the other threads.
    unsafe { rustix::thread::unshare_unsafe(flags) }.map_err(io::Error::from)
}

/// Refuses any flag of `unshare(2)` that is not a namespace.
pub(crate) fn check_namespaces(flags: UnshareFlags) -> io::Result<()> {
    let namespaces = UnshareFlags::NEWNS
        | UnshareFlags::NEWUTS
        | UnshareFlags::NEWIPC
        | UnshareFlags::NEWPID
        | UnshareFlags::NEWNET
        | UnshareFlags::NEWUSER
        | UnshareFlags::NEWCGROUP
        | UnshareFlags::NEWTIME;
    if !namespaces.contains(flags) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "unshare of {:?}: only namespaces are unshared",
                flags - namespaces
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_descriptor_table_is_never_unshared() {
        let e = unshare(UnshareFlags::FILES).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        let e = unshare(UnshareFlags::NEWNS | UnshareFlags::FILES).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
