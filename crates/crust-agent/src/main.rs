use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// The crust guest agent (runs inside the VM).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// virtio-serial port name to serve on.
    #[arg(long, default_value = crust_agent_proto::AGENT_PORT_NAME)]
    port_name: String,
    /// Serve on this character device instead of looking the port up.
    #[arg(long)]
    device: Option<PathBuf>,
    /// Seconds to wait for the port to appear.
    #[arg(long, default_value_t = 30)]
    wait_port_secs: u64,
}

fn main() -> anyhow::Result<()> {
    // The image's /sbin/modprobe is this binary: the kernel's requests.
    let argv: Vec<String> = std::env::args().collect();
    if argv
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|n| n == "modprobe")
    {
        std::process::exit(crust_agent::modprobe::main(&argv[1..]));
    }
    // The agent re-executes itself as a container's init helper.
    if std::env::args_os().nth(1).as_deref()
        == Some(std::ffi::OsStr::new(crust_agent::container::init::INIT_ARG))
    {
        crust_agent::container::init::main();
    }
    if std::env::args_os().nth(1).as_deref()
        == Some(std::ffi::OsStr::new(
            crust_agent::container::userns::HOLD_ARG,
        ))
    {
        crust_agent::container::userns::hold_main();
    }
    let args = Args::parse();
    crust_agent::run(crust_agent::Config {
        port_name: args.port_name,
        device: args.device,
        wait_port: Duration::from_secs(args.wait_port_secs),
    })?;
    Ok(())
}
