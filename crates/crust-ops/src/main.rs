//! `crust-ops`: the Runtime service on a unix socket.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use crust_ops::{CrustOps, LayoutMode, OpsConfig};
use crust_proto::endpoint::Endpoint;

#[derive(Parser, Debug)]
#[command(
    name = "crust-ops",
    version,
    about = "KEP-2857 crust_ops Runtime service"
)]
struct Args {
    /// unix:///path/to/socket
    #[arg(long, env = "CRUST_OPS_ENDPOINT", default_value = crust_ops::DEFAULT_ENDPOINT)]
    endpoint: String,
    /// Hand-off layouts to write and serve: crust, kata or both.
    #[arg(long, env = "CRUST_OPS_LAYOUT", default_value = "crust", value_parser = parse_layout)]
    layout: LayoutMode,
    #[arg(long, env = "CRUST_OPS_CRUST_ROOT", default_value = crust_handoff::DEFAULT_CRUST_ROOT)]
    crust_root: PathBuf,
    #[arg(long, env = "CRUST_OPS_KATA_ROOT", default_value = crust_handoff::DEFAULT_KATA_ROOT)]
    kata_root: PathBuf,
    #[arg(long, env = "CRUST_OPS_KATA_RUNTIME", default_value = crust_ops::DEFAULT_KATA_RUNTIME)]
    kata_runtime: PathBuf,
    /// Seconds a runtime CLI may run before it is killed.
    #[arg(long, env = "CRUST_OPS_CLI_TIMEOUT", default_value_t = 30.0)]
    cli_timeout: f64,
    /// Targets must lie beneath one of these (repeatable); none: any path.
    #[arg(
        long = "allowed-target-prefix",
        env = "CRUST_OPS_ALLOWED_TARGET_PREFIXES",
        value_delimiter = ','
    )]
    allowed_target_prefixes: Vec<String>,
    /// Accept regular files beneath this root as devices (repeatable; tests, VM images).
    #[arg(
        long = "allow-file-devices-under",
        env = "CRUST_OPS_FILE_DEVICE_ROOTS",
        value_delimiter = ','
    )]
    file_device_roots: Vec<PathBuf>,
    /// Where Kata's shims listen (`<dir>/<sandbox-id>/shim-monitor.sock`;
    /// repeatable). A Kata claim is released only when none answers.
    #[arg(
        long = "kata-shim-dir",
        env = "CRUST_OPS_KATA_SHIM_DIRS",
        value_delimiter = ',',
        default_values_t = crust_ops::DEFAULT_KATA_SHIM_DIRS.map(String::from)
    )]
    kata_shim_dirs: Vec<String>,
    /// tracing filter, e.g. info or crust_ops=debug
    #[arg(long, env = "CRUST_OPS_LOG_LEVEL", default_value = "info")]
    log_level: String,
}

fn parse_layout(s: &str) -> Result<LayoutMode, String> {
    s.parse()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&args.log_level).context("--log-level")?,
        )
        .with_writer(std::io::stderr)
        .init();
    if !(args.cli_timeout.is_finite() && args.cli_timeout > 0.0) {
        bail!("--cli-timeout must be a positive number of seconds");
    }
    let endpoint = Endpoint::parse(&args.endpoint)?;
    let Some(sock) = endpoint.unix_path() else {
        bail!("--endpoint must be unix:///path (crust_ops serves a local socket only)");
    };
    let ops = CrustOps::new(OpsConfig {
        layout: args.layout,
        crust_root: args.crust_root,
        kata_root: args.kata_root,
        kata_runtime: args.kata_runtime,
        cli_timeout: Duration::from_secs_f64(args.cli_timeout),
        allowed_target_prefixes: args.allowed_target_prefixes,
        file_device_roots: args.file_device_roots,
        kata_shim_dirs: args.kata_shim_dirs.iter().map(Into::into).collect(),
        ..OpsConfig::default()
    })?;
    let shutdown = shutdown_signal()?;
    let (listener, guard) = crust_ops::server::bind(sock)?;
    tracing::info!(socket = %sock.display(), layout = ?args.layout, "crust-ops serving");
    crust_ops::server::serve(Arc::new(ops), listener, shutdown).await?;
    drop(guard);
    tracing::info!("crust-ops stopped");
    Ok(())
}

/// Registers the handlers now (before the socket accepts anyone, so an
/// early SIGTERM is not fatal) and resolves on the first signal.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM"),
            _ = int.recv() => tracing::info!("SIGINT"),
        }
    })
}
