//! TUNSETIFF: naming and configuring a tap queue.

use std::io;

use rustix::fd::AsFd;

use crate::ioctl;

/// `struct ifreq` as TUNSETIFF reads and writes it: the name, then the
/// flags member of the union, padded to the union's 24 bytes.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// TUNSETIFF on an open `/dev/net/tun`: attaches it to interface `name`
/// (made if absent) with `flags` (`IFF_TAP | IFF_NO_PI | …`). A name the
/// kernel cannot hold is refused here.
pub fn set_iff(tun: impl AsFd, name: &str, flags: libc::c_short) -> io::Result<()> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {name:?} is empty, has NUL or is longer than 15 bytes"),
        ));
    }
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes one struct ifreq, laid out above
    // (a NUL-terminated name, then the flags union member).
    unsafe { ioctl::ptr(tun, linux_raw_sys::ioctl::TUNSETIFF, &mut req) }.map(drop)
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_the_kernel_cannot_hold_are_refused_before_the_call() {
        let f = tempfile::tempfile().unwrap();
        for bad in ["", "sixteen-bytes-xx", "a\0b"] {
            let e = super::set_iff(&f, bad, 0).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{bad:?}");
        }
        // A good name reaches the kernel, which refuses a regular file.
        assert!(
            super::set_iff(&f, "tap0", 0)
                .unwrap_err()
                .raw_os_error()
                .is_some()
        );
    }
}
