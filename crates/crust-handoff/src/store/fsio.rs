//! Reads and writes inside one record directory, by descriptor: bounded
//! reads, atomic writes, owner and mode checks.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::{RUNTIME_CLI_FILE, TMP_PREFIX};
use crate::error::{HandoffError, Result};
use crate::validate;

/// Records are root-only: owned by us and writable by nobody else.
pub(super) fn check_owner_mode(st: &rustix::fs::Stat, path: &str) -> Result<()> {
    if st.st_uid != rustix::process::geteuid().as_raw() {
        return Err(HandoffError::bad(
            path,
            format!("owned by uid {}, not by us", st.st_uid),
        ));
    }
    if st.st_mode & 0o022 != 0 {
        return Err(HandoffError::bad(
            path,
            format!("mode {:o} lets others write", st.st_mode & 0o7777),
        ));
    }
    Ok(())
}

pub(super) fn read_runtime_cli(dir: &OwnedFd, path: &str) -> Result<Option<String>> {
    let Some(bytes) = read_bounded(
        dir,
        RUNTIME_CLI_FILE,
        validate::MAX_PATH_LEN as u64 + 2,
        path,
    )?
    else {
        return Ok(None);
    };
    let s = String::from_utf8(bytes)
        .map_err(|_| HandoffError::bad(path, "runtime-cli is not UTF-8"))?;
    let cli = s.trim_end_matches(['\n', '\r']);
    validate::check_abs_path("runtime-cli", cli).map_err(|r| HandoffError::bad(path, r))?;
    Ok(Some(cli.to_string()))
}

/// Reads a small file below `dir` without following a symlink, without
/// blocking on a FIFO, and without reading more than `max` bytes.
pub(super) fn read_bounded(
    dir: &OwnedFd,
    name: &str,
    max: u64,
    path: &str,
) -> Result<Option<Vec<u8>>> {
    let fd = match rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(None),
        Err(Errno::LOOP) => return Err(HandoffError::bad(path, format!("{name} is a symlink"))),
        Err(e) => return Err(HandoffError::io(format!("open {path}/{name}"), e)),
    };
    let st =
        rustix::fs::fstat(&fd).map_err(|e| HandoffError::io(format!("stat {path}/{name}"), e))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(HandoffError::bad(
            path,
            format!("{name} is not a regular file"),
        ));
    }
    check_owner_mode(&st, &format!("{path}/{name}"))?;
    if st.st_size as u64 > max {
        return Err(HandoffError::bad(
            path,
            format!("{name} is larger than {max} bytes"),
        ));
    }
    let mut buf = Vec::with_capacity(st.st_size as usize);
    File::from(fd)
        .take(max + 1)
        .read_to_end(&mut buf)
        .map_err(|e| HandoffError::io(format!("read {path}/{name}"), e))?;
    if buf.len() as u64 > max {
        return Err(HandoffError::bad(
            path,
            format!("{name} is larger than {max} bytes"),
        ));
    }
    Ok(Some(buf))
}

pub(super) fn unlink_ignore_missing(dir: &OwnedFd, name: &str, path: &str) -> Result<()> {
    match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(HandoffError::io(format!("remove {path}/{name}"), e)),
    }
}

/// Temp file in the same directory, 0600 whatever the umask, fsync,
/// rename over the final name, fsync the directory.
pub(super) fn write_atomic(dir: &OwnedFd, name: &str, data: &[u8], path: &str) -> Result<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let tmp = format!(
        "{TMP_PREFIX}{name}.{}.{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let fd = rustix::fs::openat(
        dir,
        tmp.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| HandoffError::io(format!("create {path}/{tmp}"), e))?;
    let result = (|| {
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o600))?;
        let mut f = File::from(fd);
        f.write_all(data)?;
        f.sync_all()?;
        drop(f);
        rustix::fs::renameat(dir, tmp.as_str(), dir, name)?;
        rustix::fs::fsync(dir)?;
        Ok::<_, std::io::Error>(())
    })();
    if let Err(e) = result {
        let _ = rustix::fs::unlinkat(dir, tmp.as_str(), AtFlags::empty());
        return Err(HandoffError::io(format!("write {path}/{name}"), e));
    }
    Ok(())
}
