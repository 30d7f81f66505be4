//! The i386 system call entry (`int 0x80`) of an x86-64 kernel, for tests
//! that prove a seccomp filter covers the compat ABI too.

/// The calls a test may make through the compat entry: none takes a
/// pointer the kernel would follow.
#[derive(Debug, Clone, Copy)]
pub enum Compat32Call {
    /// i386 `getpid` (20).
    Getpid,
    /// i386 `mkdir(NULL, 0)` (39): EFAULT from the kernel unless a filter
    /// answers first.
    MkdirNull,
}

/// Makes `call` through `int 0x80`: the result, or -errno.
pub fn call(call: Compat32Call) -> i32 {
    let (nr, a, b): (u32, u32, u32) = match call {
        Compat32Call::Getpid => (20, 0, 0),
        Compat32Call::MkdirNull => (39, 0, 0),
    };
    let ret: i64;
    // SAFETY: the calls above take no pointer, or a null one the kernel
    // checks; every register the entry may change is declared.
    unsafe {
        // rbx is LLVM's: swapped in and out around the trap.
        std::arch::asm!(
            "xchg {a}, rbx",
            "int 0x80",
            "xchg {a}, rbx",
            a = inout(reg) a as u64 => _,
            inlateout("rax") nr as i64 => ret,
            in("rcx") b as u64,
            lateout("r8") _, lateout("r9") _, lateout("r10") _, lateout("r11") _,
        );
    }
    ret as i32
}
