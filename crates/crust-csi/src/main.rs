//! `crust-csi`: the CSI plugin binary (flags in config.rs).

use anyhow::Context;
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};

fn main() -> anyhow::Result<()> {
    crust_csi::limit_malloc_arenas();
    let cli = crust_csi::Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(cli.log_filter())
                .context("invalid --log-level")?,
        )
        .with_writer(std::io::stderr)
        .init();
    let config = cli.into_config()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(async move {
        let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received"),
                _ = int.recv() => tracing::info!("SIGINT received"),
            }
        };
        crust_csi::serve(config, shutdown).await?;
        Ok(())
    })
}
