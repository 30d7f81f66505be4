//! `crust-node-install`: install/uninstall crust's runtime on this node.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use crust_node_install::{Options, install, label};

#[derive(Parser)]
#[command(
    name = "crust-node-install",
    version,
    about = "Installs crust's self-contained runtime on a node (like kata-deploy) and removes exactly that on uninstall"
)]
struct Cli {
    /// Where the host's `/` is mounted in this container.
    #[arg(long, env = "CRUST_INSTALL_HOST_ROOT", default_value = "/host")]
    host_root: PathBuf,
    /// The payload to install (the node-installer image carries it here).
    #[arg(
        long,
        env = "CRUST_INSTALL_PAYLOAD",
        default_value = "/usr/share/crust/payload"
    )]
    payload: PathBuf,
    /// Host install prefix; must be the payload's (its binaries' loader path).
    #[arg(long, env = "CRUST_INSTALL_PREFIX", default_value = "/opt/crust")]
    prefix: PathBuf,
    /// Host path of containerd's root config.
    #[arg(
        long,
        env = "CRUST_INSTALL_CONTAINERD_CONFIG",
        default_value = "/etc/containerd/config.toml"
    )]
    containerd_config: PathBuf,
    /// Host path of the drop-in written for the handler.
    #[arg(
        long,
        env = "CRUST_INSTALL_DROPIN",
        default_value = "/etc/containerd/conf.d/crust.toml"
    )]
    dropin: PathBuf,
    /// RuntimeClass handler name.
    #[arg(long, env = "CRUST_INSTALL_HANDLER", default_value = "crust")]
    handler: String,
    /// Command (split on spaces) run when containerd's configuration
    /// changed, e.g. `nsenter -t 1 -m -u -i -n -p -- systemctl restart containerd`.
    #[arg(long, env = "CRUST_INSTALL_RELOAD_COMMAND")]
    reload_command: Option<String>,
    /// This node's name (the DaemonSet passes spec.nodeName): after an
    /// install the node gets the label `crust.dev/runtime=installed`, and
    /// loses it before an uninstall. Unset: no label is touched.
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// API server URL (default: the in-cluster one).
    #[arg(long, env = "CRUST_INSTALL_API_SERVER")]
    api_server: Option<String>,
    /// Bearer token file (default: the pod's service account token).
    #[arg(long, env = "CRUST_INSTALL_API_TOKEN_FILE")]
    api_token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install or upgrade (idempotent).
    Install {
        /// Then wait for SIGTERM (a DaemonSet container stays running).
        #[arg(long)]
        wait: bool,
    },
    /// Remove what the install record lists (idempotent).
    Uninstall {
        #[arg(long)]
        wait: bool,
    },
    /// Print the install record.
    Status,
}

fn wait_for_termination() {
    // As PID 1 of a container SIGTERM has no default action: wait for it.
    use signal_hook::consts::{SIGINT, SIGTERM};
    match signal_hook::iterator::Signals::new([SIGTERM, SIGINT]) {
        Ok(mut signals) => {
            let _ = signals.forever().next();
        }
        // Without handlers the default actions end the process anyway
        // (but for PID 1): nothing better to wait on.
        Err(e) => eprintln!("crust-node-install: cannot wait for signals: {e}"),
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let opts = Options {
        host_root: cli.host_root,
        payload: cli.payload,
        prefix: cli.prefix,
        containerd_config: cli.containerd_config,
        dropin: cli.dropin,
        handler: cli.handler,
        reload: cli
            .reload_command
            .map(|c| c.split_whitespace().map(str::to_string).collect()),
        fault: None,
    };
    let api = || -> anyhow::Result<label::ApiServer> {
        let mut a = label::ApiServer::in_cluster(cli.api_server.clone())?;
        if let Some(t) = &cli.api_token_file {
            a.token_file = t.clone();
        }
        Ok(a)
    };
    let (report, wait) = match cli.command {
        Cmd::Install { wait } => {
            let r = install::install(&opts).context("install")?;
            if let Some(node) = &cli.node_name {
                label::set_label(&api()?, node, label::LABEL, Some(label::LABEL_VALUE))?;
            }
            (r, wait)
        }
        Cmd::Uninstall { wait } => {
            // First stop the scheduler from sending crust pods here.
            if let Some(node) = &cli.node_name {
                label::set_label(&api()?, node, label::LABEL, None)?;
            }
            (install::uninstall(&opts).context("uninstall")?, wait)
        }
        Cmd::Status => {
            let m = install::read_manifest(&opts)?;
            println!("{}", serde_json::to_string_pretty(&m)?);
            return Ok(());
        }
    };
    println!("{}", serde_json::to_string(&report)?);
    if wait {
        wait_for_termination();
    }
    Ok(())
}
