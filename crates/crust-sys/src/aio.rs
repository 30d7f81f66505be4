//! Probes for the kernel's asynchronous I/O interfaces.

use std::io;

/// Whether `io_uring_setup` works here (seccomp, a sysctl or an old kernel
/// may refuse it). The ring is closed at once; nothing is mapped.
pub fn io_uring_works() -> io::Result<()> {
    let mut params = rustix::io_uring::io_uring_params::default();
    // SAFETY: params is a valid, zeroed io_uring_params; the returned
    // descriptor is dropped at once and nothing is mapped.
    unsafe { rustix::io_uring::io_uring_setup(1, &mut params) }
        .map(drop)
        .map_err(io::Error::from)
}

/// Whether Linux native AIO (`io_setup`) works here. The context is
/// destroyed at once.
pub fn linux_aio_works() -> io::Result<()> {
    let mut ctx: libc::c_ulong = 0;
    // SAFETY: io_setup writes one aio_context_t to ctx.
    let r = unsafe { libc::syscall(libc::SYS_io_setup, 1 as libc::c_long, &raw mut ctx) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ctx came from io_setup above and is destroyed once.
    unsafe { libc::syscall(libc::SYS_io_destroy, ctx) };
    Ok(())
}
