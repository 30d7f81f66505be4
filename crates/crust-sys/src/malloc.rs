//! glibc allocator tunables.

/// Caps glibc's malloc at `n` arenas (M_ARENA_MAX); without glibc, nothing.
/// Call it first thing in `main`, before threads start.
pub fn limit_arenas(n: i32) {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator tunable; M_ARENA_MAX takes any
    // positive count at any time.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, n.max(1));
    }
    #[cfg(not(target_env = "gnu"))]
    let _ = n;
}
