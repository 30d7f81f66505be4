//! `crust-runtime-poll`: the runtime CLI a sandbox records for crust_ops
//! when it is installed next to `crust-runtime`. kubelet's stats polls
//! ([`crust_runtime::poll`]) are answered here, in a binary a fraction of
//! `crust-runtime`'s size: loading the big one (relocations, page faults)
//! is most of a poll's cost on the host. Every other command line is
//! handed to `crust-runtime` next to this binary with exec: same process,
//! same arguments, same output and exit status.

use std::os::unix::process::CommandExt;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = crust_runtime::cli::kata_spellings(
        std::env::args_os()
            .map(|a| a.into_string().unwrap_or_default())
            .collect(),
    );
    if let Some(r) = crust_runtime::poll::run_fast(&args) {
        return crust_runtime::poll::exit_with(r);
    }
    // crust_ops runs the absolute path recorded: argv[0] serves where
    // /proc is not mounted (a chroot).
    let exe = std::env::current_exe().ok().or_else(|| {
        let argv0 = std::path::PathBuf::from(std::env::args_os().next()?);
        argv0.is_absolute().then_some(argv0)
    });
    let Some(full) = exe.map(|e| e.with_file_name(crust_sandbox::claims::FULL_CLI)) else {
        eprintln!("error: cannot locate this executable (no /proc/self/exe, relative argv[0])");
        return ExitCode::FAILURE;
    };
    let err = std::process::Command::new(&full)
        .args(std::env::args_os().skip(1))
        .exec();
    eprintln!("error: cannot run {}: {err}", full.display());
    ExitCode::FAILURE
}
