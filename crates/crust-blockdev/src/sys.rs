//! Small helpers over rustix: errno of an io::Error, full positioned
//! reads and writes. The ioctls are crust-sys's.

use std::io;

use rustix::fd::AsFd;

pub(crate) use crust_sys::buf::{AlignedBuf, DIRECT_ALIGN};

pub(crate) fn errno(e: &io::Error) -> Option<rustix::io::Errno> {
    e.raw_os_error().map(rustix::io::Errno::from_raw_os_error)
}

/// Reads up to `buf.len()` bytes at `offset`, stopping early only at EOF.
pub(crate) fn pread_full<Fd: AsFd>(fd: Fd, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let fd = fd.as_fd();
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pread(fd, &mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(done)
}

/// Writes all of `buf` at `offset`.
pub(crate) fn pwrite_full<Fd: AsFd>(fd: Fd, buf: &[u8], offset: u64) -> io::Result<()> {
    let fd = fd.as_fd();
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pwrite(fd, &buf[done..], offset + done as u64) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
