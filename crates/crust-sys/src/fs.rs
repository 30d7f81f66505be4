//! Filesystem ioctls: freeze, thaw, inode generation, XFS geometry.

use std::io;

use linux_raw_sys::ioctl as ic;
use rustix::fd::AsFd;

use crate::ioctl;

/// FIFREEZE on a descriptor of the filesystem (its root directory, say):
/// flushes it and blocks new writes until [`thaw`].
pub fn freeze(dir: impl AsFd) -> io::Result<()> {
    // SAFETY: FIFREEZE's argument is unused; nothing is dereferenced.
    unsafe { ioctl::int(dir, ic::FIFREEZE, 0) }.map(drop)
}

/// FITHAW; EINVAL when the filesystem is not frozen.
pub fn thaw(dir: impl AsFd) -> io::Result<()> {
    // SAFETY: FITHAW's argument is unused; nothing is dereferenced.
    unsafe { ioctl::int(dir, ic::FITHAW, 0) }.map(drop)
}

/// FS_IOC_GETVERSION: the inode's generation, where the filesystem keeps
/// one (ext4, XFS; ENOTTY elsewhere).
pub fn inode_generation(file: impl AsFd) -> io::Result<u64> {
    let mut generation: std::ffi::c_long = 0;
    // SAFETY: FS_IOC_GETVERSION writes one long.
    unsafe { ioctl::ptr(file, ic::FS_IOC_GETVERSION, &mut generation) }?;
    Ok(generation as u64)
}

/// XFS_IOC_FSGEOMETRY_V1 (`_IOR('X', 100, struct xfs_fsop_geom_v1)`, 112
/// bytes) on a descriptor of an XFS filesystem: the raw struct as 14 u64
/// (block size in the low half of word 0, data blocks in word 4).
pub fn xfs_geometry_v1(file: impl AsFd) -> io::Result<[u64; 14]> {
    const GEOM_V1: u32 = rustix::ioctl::opcode::read::<[u64; 14]>(b'X', 100);
    let mut g = [0u64; 14];
    // SAFETY: the kernel writes one struct xfs_fsop_geom_v1, 112 bytes,
    // the size of `g` (and encoded in the opcode).
    unsafe { ioctl::ptr(file, GEOM_V1, &mut g) }?;
    Ok(g)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_generation_of_a_memfd_is_refused_or_read() {
        // A memfd: never XFS, whatever filesystem TMPDIR is on.
        let f =
            rustix::fs::memfd_create("crust-sys-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        match super::inode_generation(&f) {
            Ok(_) => {}
            Err(e) => assert!(e.raw_os_error().is_some(), "{e}"),
        }
        // Not XFS: the kernel says so, nothing is written.
        assert!(super::xfs_geometry_v1(&f).is_err());
    }
}
