//! A container's seccomp filter from the OCI `linux.seccomp` section,
//! compiled by libseccomp (linked statically into the agent) in the init
//! helper and loaded as its last step before `exec`, for the container's
//! process and for every exec (the agent keeps the container's section).
//!
//! What follows runc, so that a profile means the same as on a runc node:
//! - `errnoRet` defaults to EPERM; a rule whose action equals the default
//!   action is dropped (libseccomp refuses it, and it changes nothing);
//! - several conditions on one argument in a rule are alternatives (one
//!   rule each); conditions on different arguments must all hold;
//! - no_new_privs is set with the filter unless the process keeps
//!   CAP_SYS_ADMIN (the kernel's condition for loading a filter).
//!
//! Architectures: the native one (x86-64) plus those listed. A syscall
//! from an architecture the profile does not list (an i386 `int 0x80`
//! when only x86-64 is listed) fails with ENOSYS: never let through.
//! Unknown names (syscalls, architectures, actions, flags) and
//! SCMP_ACT_NOTIFY (its agent would live on the host) fail container
//! creation with the field named; nothing is skipped.

use crust_agent_proto::{Seccomp, SeccompArg, SeccompOp};
use libseccomp::{
    ScmpAction, ScmpArch, ScmpArgCompare, ScmpCompareOp, ScmpFilterContext, ScmpSyscall,
};
use rustix::thread::CapabilitySet;

const EPERM: u32 = 1;
const ENOSYS: i32 = 38;
/// Errno values the kernel returns as errors (`MAX_ERRNO`).
const MAX_ERRNO: u32 = 4095;

/// The OCI action `name` (with its `errnoRet`) at `field`.
fn action(name: &str, errno_ret: Option<u32>, field: &str) -> Result<ScmpAction, String> {
    let ret = errno_ret.unwrap_or(EPERM);
    if ret > MAX_ERRNO {
        return Err(format!("{field}: errnoRet {ret} is beyond {MAX_ERRNO}"));
    }
    Ok(match name {
        "SCMP_ACT_KILL" | "SCMP_ACT_KILL_THREAD" => ScmpAction::KillThread,
        "SCMP_ACT_KILL_PROCESS" => ScmpAction::KillProcess,
        "SCMP_ACT_TRAP" => ScmpAction::Trap,
        "SCMP_ACT_ERRNO" => ScmpAction::Errno(ret as i32),
        "SCMP_ACT_TRACE" => ScmpAction::Trace(ret as u16),
        "SCMP_ACT_LOG" => ScmpAction::Log,
        "SCMP_ACT_ALLOW" => ScmpAction::Allow,
        "SCMP_ACT_NOTIFY" => {
            return Err(format!(
                "{field}: SCMP_ACT_NOTIFY needs a seccomp agent on the host, which a VM's processes cannot reach"
            ));
        }
        other => return Err(format!("{field}: unknown action {other:?}")),
    })
}

fn compare(a: &SeccompArg, field: &str) -> Result<ScmpArgCompare, String> {
    if a.index > 5 {
        return Err(format!(
            "{field}: index {} (a syscall has 6 arguments)",
            a.index
        ));
    }
    let (op, datum) = match a.op {
        SeccompOp::NotEqual => (ScmpCompareOp::NotEqual, a.value),
        SeccompOp::Less => (ScmpCompareOp::Less, a.value),
        SeccompOp::LessOrEqual => (ScmpCompareOp::LessOrEqual, a.value),
        SeccompOp::Equal => (ScmpCompareOp::Equal, a.value),
        SeccompOp::GreaterOrEqual => (ScmpCompareOp::GreaterEqual, a.value),
        SeccompOp::Greater => (ScmpCompareOp::Greater, a.value),
        // OCI: `value` is the mask, `valueTwo` what the masked arg must be.
        SeccompOp::MaskedEqual => (
            ScmpCompareOp::MaskedEqual(a.value),
            a.value_two.unwrap_or(0),
        ),
    };
    Ok(ScmpArgCompare::new(a.index, op, datum))
}

/// Builds the filter; every error names the field of `linux.seccomp`.
pub fn compile(s: &Seccomp) -> Result<ScmpFilterContext, String> {
    let f = "linux.seccomp";
    if let Some(p) = &s.listener_path {
        return Err(format!(
            "{f}.listenerPath {p:?}: a seccomp agent on the host cannot serve a VM's processes"
        ));
    }
    let default = action(
        &s.default_action,
        s.default_errno_ret,
        &format!("{f}.defaultAction"),
    )?;
    let lib = |what: String| move |e: libseccomp::error::SeccompError| format!("{what}: {e}");
    let mut ctx = ScmpFilterContext::new(default).map_err(lib(format!("{f}.defaultAction")))?;
    ctx.set_act_badarch(ScmpAction::Errno(ENOSYS))
        .map_err(lib("setting the bad-architecture action".into()))?;
    for (i, name) in s.architectures.iter().enumerate() {
        let field = format!("{f}.architectures[{i}]");
        let arch: ScmpArch = name
            .parse()
            .map_err(|_| format!("{field}: unknown architecture {name:?}"))?;
        if !ctx.is_arch_present(arch).map_err(lib(field.clone()))? {
            ctx.add_arch(arch).map_err(lib(format!("{field} {name}")))?;
        }
    }
    for (i, flag) in s.flags.iter().enumerate() {
        let field = format!("{f}.flags[{i}]");
        match flag.as_str() {
            "SECCOMP_FILTER_FLAG_TSYNC" => ctx.set_ctl_tsync(true),
            "SECCOMP_FILTER_FLAG_LOG" => ctx.set_ctl_log(true),
            "SECCOMP_FILTER_FLAG_SPEC_ALLOW" => ctx.set_ctl_ssb(true),
            "SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV" => ctx.set_ctl_waitkill(true),
            other => return Err(format!("{field}: unknown flag {other:?}")),
        }
        .map_err(lib(format!("{field} {flag}")))?;
    }
    for (i, rule) in s.syscalls.iter().enumerate() {
        let field = format!("{f}.syscalls[{i}]");
        let act = action(&rule.action, rule.errno_ret, &format!("{field}.action"))?;
        let conds = rule
            .args
            .iter()
            .enumerate()
            .map(|(j, a)| compare(a, &format!("{field}.args[{j}]")))
            .collect::<Result<Vec<_>, _>>()?;
        let mut indexes: Vec<u32> = rule.args.iter().map(|a| a.index).collect();
        indexes.sort_unstable();
        indexes.dedup();
        // One rule with all conditions (AND), or, when an argument has
        // several, one rule per condition (OR), as runc builds them.
        let groups: Vec<Vec<ScmpArgCompare>> = if indexes.len() == conds.len() {
            vec![conds]
        } else {
            conds.into_iter().map(|c| vec![c]).collect()
        };
        for (j, name) in rule.names.iter().enumerate() {
            let sc = ScmpSyscall::from_name(name)
                .map_err(|_| format!("{field}.names[{j}]: unknown syscall {name:?}"))?;
            if act == default {
                continue;
            }
            for g in &groups {
                ctx.add_rule_conditional(act, sc, g)
                    .map_err(lib(format!("{field}.names[{j}] {name}")))?;
            }
        }
    }
    Ok(ctx)
}

/// Loads the filter into the calling thread (the helper just before
/// `exec`). no_new_privs comes with it unless CAP_SYS_ADMIN stays
/// effective (the kernel takes a filter without it only then).
pub fn load(ctx: &mut ScmpFilterContext) -> Result<(), String> {
    let admin = rustix::thread::capabilities(None)
        .is_ok_and(|c| c.effective.contains(CapabilitySet::SYS_ADMIN));
    ctx.set_ctl_nnp(!admin)
        .and_then(|c| c.load())
        .map_err(|e| format!("loading the seccomp filter: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn profile(v: serde_json::Value) -> Seccomp {
        serde_json::from_value(v).unwrap()
    }

    /// Loads `s` into a fresh thread (a filter binds only the thread that
    /// loads it and its children) and returns what `probe` saw there.
    fn under<T: Send + 'static>(s: &Seccomp, probe: impl FnOnce() -> T + Send + 'static) -> T {
        let s = s.clone();
        std::thread::spawn(move || {
            let mut ctx = compile(&s).unwrap();
            load(&mut ctx).unwrap();
            probe()
        })
        .join()
        .unwrap()
    }

    fn errno<T>(r: rustix::io::Result<T>) -> i32 {
        match r {
            Ok(_) => 0,
            Err(e) => e.raw_os_error(),
        }
    }

    use crust_sys::compat32::{Compat32Call, call as int80};

    #[test]
    fn rules_errno_and_argument_conditions_are_enforced() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let s = profile(json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [
                {"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 123},
                // socket(AF_UNIX, ...) refused with the default errno (EPERM).
                {"names": ["socket"], "action": "SCMP_ACT_ERRNO",
                 "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_EQ"}]},
                // socket(.., type with SOCK_CLOEXEC, ..): masked compare.
                {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": 93,
                 "args": [{"index": 1, "value": 0x80000, "valueTwo": 0x80000, "op": "SCMP_CMP_MASKED_EQ"}]},
                {"names": ["getpid"], "action": "SCMP_ACT_ALLOW"}
            ]
        }));
        let (mk, unix, inet, cloexec) = under(&s, move || {
            use rustix::net::{AddressFamily, SocketFlags, SocketType, socket, socket_with};
            (
                errno(rustix::fs::mkdir(d.join("x"), rustix::fs::Mode::RWXU)),
                errno(socket(AddressFamily::UNIX, SocketType::STREAM, None)),
                errno(socket(AddressFamily::INET, SocketType::STREAM, None)),
                errno(socket_with(
                    AddressFamily::INET,
                    SocketType::STREAM,
                    SocketFlags::CLOEXEC,
                    None,
                )),
            )
        });
        assert_eq!((mk, unix, inet, cloexec), (123, 1, 0, 93));
        // The filter bound only that thread.
        std::fs::create_dir(dir.path().join("y")).unwrap();
    }

    #[test]
    fn i386_syscalls_follow_the_listed_architectures() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let deny_mkdir = |archs: serde_json::Value| {
            profile(json!({
                "defaultAction": "SCMP_ACT_ALLOW", "architectures": archs,
                "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_ERRNO", "errnoRet": 123}]
            }))
        };
        let probe = || {
            (
                int80(Compat32Call::Getpid) > 0,
                int80(Compat32Call::MkdirNull),
            )
        };
        // Unfiltered: getpid works, mkdir(NULL) is EFAULT.
        assert_eq!(probe(), (true, -14));
        // Listed: the i386 mkdir is denied by the same rule, getpid allowed.
        assert_eq!(
            under(
                &deny_mkdir(json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"])),
                probe
            ),
            (true, -123)
        );
        // Not listed: nothing of i386 gets through (ENOSYS).
        assert_eq!(
            under(&deny_mkdir(json!(["SCMP_ARCH_X86_64"])), probe),
            (false, -38)
        );
        assert_eq!(under(&deny_mkdir(json!([])), probe), (false, -38));
    }

    #[test]
    fn a_bad_profile_names_the_field() {
        let base = json!({"defaultAction": "SCMP_ACT_ERRNO",
            "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}]});
        compile(&profile(base.clone())).unwrap();
        for (patch, needle) in [
            (
                json!({"defaultAction": "SCMP_ACT_MAYBE"}),
                "linux.seccomp.defaultAction: unknown action \"SCMP_ACT_MAYBE\"",
            ),
            (
                json!({"architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_Z80"]}),
                "linux.seccomp.architectures[1]: unknown architecture \"SCMP_ARCH_Z80\"",
            ),
            (
                json!({"flags": ["SECCOMP_FILTER_FLAG_FAST"]}),
                "linux.seccomp.flags[0]: unknown flag",
            ),
            (
                json!({"syscalls": [{"names": ["read", "no_such_call"], "action": "SCMP_ACT_ALLOW"}]}),
                "linux.seccomp.syscalls[0].names[1]: unknown syscall \"no_such_call\"",
            ),
            (
                json!({"syscalls": [{"names": ["read"], "action": "SCMP_ACT_ERRNO", "errnoRet": 70000}]}),
                "linux.seccomp.syscalls[0].action: errnoRet 70000",
            ),
            (
                json!({"syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW",
                    "args": [{"index": 6, "value": 0, "op": "SCMP_CMP_EQ"}]}]}),
                "linux.seccomp.syscalls[0].args[0]: index 6",
            ),
            (
                json!({"syscalls": [{"names": ["read"], "action": "SCMP_ACT_NOTIFY"}]}),
                "linux.seccomp.syscalls[0].action: SCMP_ACT_NOTIFY",
            ),
            (
                json!({"listenerPath": "/run/agent.sock"}),
                "linux.seccomp.listenerPath",
            ),
        ] {
            let mut v = base.clone();
            for (k, val) in patch.as_object().unwrap() {
                v[k] = val.clone();
            }
            let e = compile(&profile(v)).map(|_| ()).unwrap_err();
            assert!(e.contains(needle), "{e}\nwanted: {needle}");
        }
    }
}
