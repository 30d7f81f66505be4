//! `crust-runtime`: parse flags, run the command, print its outcome.

use clap::Parser;
use crust_runtime::cli::{Cli, Command, dispatch};

fn main() -> std::process::ExitCode {
    // Non-UTF-8 arguments are clap's to report.
    let args: Vec<String> = crust_runtime::cli::kata_spellings(
        std::env::args_os()
            .map(|a| a.into_string().unwrap_or_default())
            .collect(),
    );
    // kubelet's stats polls: no clap tree, no tokio (crust_runtime::poll).
    if let Some(r) = crust_runtime::poll::run_fast(&args) {
        return crust_runtime::poll::exit_with(r);
    }
    let cli = match Cli::try_parse_from(&args) {
        Ok(c) => c,
        Err(e) => {
            if let Some(verb) = crust_runtime::cli::unsupported_crust_verb(&args) {
                eprintln!(
                    "{} crust {}",
                    crust_handoff::liveness::UNSUPPORTED_PREFIX,
                    crust_fs::quote(&verb)
                );
                return std::process::ExitCode::from(
                    crust_handoff::liveness::UNSUPPORTED_EXIT as u8,
                );
            }
            e.exit()
        }
    };
    let is_shim = matches!(cli.command, Command::Shim { .. });
    let default_level = if is_shim { "info" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let cfg = cli.global.config();
    // The volume verbs crust_ops runs on every kubelet poll do one
    // request each: no worker threads to start and join for them.
    let rt = if matches!(cli.command, Command::Crust(_) | Command::DirectVolume(_)) {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    };
    let rt = match rt {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: tokio runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    if let Command::Shim { id } = cli.command {
        let code = rt.block_on(crust_runtime::controller::run_shim(cfg, id));
        return std::process::ExitCode::from(code.clamp(0, 255) as u8);
    }
    crust_runtime::poll::exit_with(rt.block_on(dispatch(cfg, cli.command)))
}
