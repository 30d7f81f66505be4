//! Writing a file through a shared memory mapping.

use std::fs::File;
use std::io;

use rustix::mm::{MapFlags, MsyncFlags, ProtFlags};

/// Maps the first `data.len()` bytes of `file` shared and writable, copies
/// `data` in, `msync`s synchronously and unmaps: the bytes reach the file
/// the way a program's stores to a `MAP_SHARED` mapping do. The file must
/// already be that long.
pub fn write_through_mapping(file: &File, data: &[u8]) -> io::Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    if file.metadata()?.len() < data.len() as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the file is shorter than the data: stores past its end would fault",
        ));
    }
    // SAFETY: a fresh mapping of our own file; no other reference to its
    // memory exists. It is written within its length, synced and unmapped
    // before return.
    unsafe {
        let addr = rustix::mm::mmap(
            std::ptr::null_mut(),
            data.len(),
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
            file,
            0,
        )?;
        std::ptr::copy_nonoverlapping(data.as_ptr(), addr.cast::<u8>(), data.len());
        let synced = rustix::mm::msync(addr, data.len(), MsyncFlags::SYNC);
        let _ = rustix::mm::munmap(addr, data.len());
        synced?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn bytes_reach_the_file_and_a_short_file_is_refused() {
        let f = tempfile::tempfile().unwrap();
        assert!(super::write_through_mapping(&f, b"abc").is_err());
        f.set_len(4096).unwrap();
        super::write_through_mapping(&f, b"abc").unwrap();
        let mut buf = [0u8; 3];
        rustix::io::pread(&f, &mut buf, 0).unwrap();
        assert_eq!(&buf, b"abc");
    }
}
