//! The verbs crust_ops runs on every kubelet poll, answered before the
//! full command line is built: `crust stats TARGET` (KEP) and
//! `direct-volume stats --volume-path PATH` (Kata). Building clap's tree
//! of every verb costs more instructions than the whole answer, and a
//! tokio runtime is not needed for one blocking request to the shim.
//!
//! Only these exact shapes take this path, with the settings from the
//! environment (`CRUST_RUNTIME_*`, as clap reads them) and no `RUST_LOG`
//! (logging wanted: the ordinary path); anything else goes through clap.
//! Both paths print through [`answer`].

use super::{GlobalOpts, Outcome};
use crate::runtime::Runtime;
use crust_sandbox::error::RuntimeError;

/// A per-poll verb and its volume path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poll<'a> {
    /// `crust stats TARGET`: NodeGetVolumeStatsResponse-shaped JSON.
    CrustStats(&'a str),
    /// `direct-volume stats --volume-path PATH`: the shim's body, as
    /// `kata-runtime` prints it.
    KataStats(&'a str),
}

/// The per-poll verb `args` (the whole command line, program first)
/// names, if it is exactly one of the shapes above.
pub fn recognise(args: &[String]) -> Option<Poll<'_>> {
    let words: Vec<&str> = args.iter().skip(1).map(String::as_str).collect();
    match words.as_slice() {
        ["crust", "stats", t] if is_path(t) => Some(Poll::CrustStats(t)),
        ["direct-volume", "stats", "--volume-path", p] if is_path(p) => Some(Poll::KataStats(p)),
        ["direct-volume", "stats", flag] => flag
            .strip_prefix("--volume-path=")
            .filter(|p| is_path(p))
            .map(Poll::KataStats),
        _ => None,
    }
}

fn is_path(s: &str) -> bool {
    !s.is_empty() && !s.starts_with('-')
}

/// Runs a recognised verb with the environment's settings; None when
/// `RUST_LOG` asks for logs (the ordinary path sets them up).
pub fn run_fast(args: &[String]) -> Option<Result<Outcome, RuntimeError>> {
    if std::env::var_os("RUST_LOG").is_some() {
        return None;
    }
    let poll = recognise(args)?;
    Some(GlobalOpts::from_env().and_then(|g| answer(&Runtime::new(g.config())?, poll)))
}

/// Prints an outcome (or the error) and gives the exit status: what both
/// binaries do with a command's result.
pub fn exit_with(r: Result<Outcome, RuntimeError>) -> std::process::ExitCode {
    use std::io::Write;
    match r {
        Ok(out) => {
            let _ = std::io::stdout().write_all(out.stdout.as_bytes());
            let _ = std::io::stderr().write_all(out.stderr.as_bytes());
            std::process::ExitCode::from(out.exit_code.clamp(0, 255) as u8)
        }
        Err(e) => {
            // Messages already carry their causes.
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The answer to a per-poll verb (both paths print this).
pub fn answer(rt: &Runtime, poll: Poll<'_>) -> Result<Outcome, RuntimeError> {
    Ok(match poll {
        Poll::CrustStats(target) => Outcome::json(&rt.volume_stats(target)?),
        Poll::KataStats(path) => Outcome {
            stdout: rt.volume_stats(path)?.to_kata_json() + "\n",
            ..Default::default()
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        std::iter::once("crust-runtime")
            .chain(s.split(' '))
            .map(String::from)
            .collect()
    }

    #[test]
    fn only_the_exact_shapes_are_recognised() {
        assert_eq!(
            recognise(&argv("crust stats /t")),
            Some(Poll::CrustStats("/t"))
        );
        assert_eq!(
            recognise(&argv("direct-volume stats --volume-path /p")),
            Some(Poll::KataStats("/p"))
        );
        assert_eq!(
            recognise(&argv("direct-volume stats --volume-path=/p")),
            Some(Poll::KataStats("/p"))
        );
        for other in [
            "crust stats",
            "crust stats --help",
            "crust stats /t extra",
            "--root /r crust stats /t",
            "crust resize /t 1 0",
            "direct-volume stats /p",
            "direct-volume stats --volume-path",
            "direct-volume stats --volume-path=",
            "state x",
        ] {
            assert_eq!(recognise(&argv(other)), None, "{other}");
        }
    }

    #[test]
    fn env_settings_match_what_clap_reads_for_the_whole_cli() {
        use clap::Parser;
        let full = crate::cli::Cli::try_parse_from(argv("crust stats /t")).unwrap();
        assert_eq!(
            format!("{:?}", GlobalOpts::from_env().unwrap()),
            format!("{:?}", full.global)
        );
    }
}
