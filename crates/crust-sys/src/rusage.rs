//! `getrusage(2)`, which rustix does not wrap.

use std::io;
use std::time::Duration;

/// CPU time (user + system) of this process's waited-for children.
pub fn children_cpu() -> io::Result<Duration> {
    // SAFETY: integers and timevals only; all-zero is a valid rusage.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage to a live struct.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &raw mut ru) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    Ok(tv(ru.ru_utime) + tv(ru.ru_stime))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_waited_child_s_time_is_counted() {
        let before = super::children_cpu().unwrap();
        std::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"])
            .status()
            .unwrap();
        assert!(super::children_cpu().unwrap() > before);
    }
}
