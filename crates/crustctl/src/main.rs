use std::process::ExitCode;

use clap::Parser;
use crust_report::say;
use crustctl::cli::{Cli, EXIT_FAILURE, run};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            say(&format!("error: cannot start the async runtime: {e}"));
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            say(&format!("error: {e}"));
            e.exit_code()
        }
    }
}
