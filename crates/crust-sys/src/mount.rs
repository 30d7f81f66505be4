//! `mount_setattr(2)`, which rustix does not wrap.

use rustix::fd::{AsRawFd, BorrowedFd};
use rustix::io::Errno;

/// `struct mount_attr` (`linux/mount.h`, MOUNT_ATTR_SIZE_VER0).
#[repr(C)]
struct RawMountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// What to change on a mount tree.
#[derive(Debug, Clone, Copy, Default)]
pub struct MountAttr<'a> {
    /// `MOUNT_ATTR_*` bits to set.
    pub set: u64,
    /// `MOUNT_ATTR_*` bits to clear.
    pub clear: u64,
    /// `MS_PRIVATE`, `MS_SLAVE`, … or 0 to leave it.
    pub propagation: u64,
    /// The user namespace of an idmapped mount (with `MOUNT_ATTR_IDMAP`).
    pub userns: Option<BorrowedFd<'a>>,
}

/// `mount_setattr(tree, "", AT_EMPTY_PATH [| AT_RECURSIVE], attr)` on a
/// mount reached by descriptor (an `open_tree` clone, say): the tree's top
/// mount only, or every mount below it when `recursive`.
pub fn setattr(tree: BorrowedFd<'_>, recursive: bool, attr: &MountAttr<'_>) -> Result<(), Errno> {
    let raw = RawMountAttr {
        attr_set: attr.set,
        attr_clr: attr.clear,
        propagation: attr.propagation,
        userns_fd: attr.userns.map_or(0, |f| f.as_raw_fd() as u64),
    };
    let mut flags = libc::AT_EMPTY_PATH;
    if recursive {
        flags |= libc::AT_RECURSIVE;
    }
    // SAFETY: a live descriptor, a NUL-terminated empty path, and a live
    // `mount_attr` of the size passed, which the kernel only reads.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            flags,
            &raw const raw,
            std::mem::size_of::<RawMountAttr>(),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::INVAL))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_file_is_not_a_mount_tree() {
        let f = tempfile::tempfile().unwrap();
        let fd = rustix::fd::AsFd::as_fd(&f);
        // Either EINVAL (not a mount root) or EPERM without privileges:
        // never success, never a crash.
        let attr = MountAttr {
            set: 0x1, // MOUNT_ATTR_RDONLY
            ..Default::default()
        };
        assert!(setattr(fd, false, &attr).is_err());
    }
}
