//! The `crustctl` command line. The binary only parses and calls [`run`].
//!
//! - `args`: the clap definitions (subcommands, flags, value parsers);
//! - `request`: flags to CSI requests and job configs, refusing bad input
//!   before anything connects;
//! - `rpc`: one CSI call per command, its answer printed;
//! - `jobs`: `bench`, `flow` and `demo`, which print their steps as they
//!   happen (stdout, or stderr when stdout carries JSON) and exit 1 when a
//!   step failed (after teardown).

use std::process::ExitCode;

use crust_csi_client::{ConnectError, Csi};
use crust_report::Render;
use crust_report::{OutputFormat, render};

mod args;
mod jobs;
mod request;
mod rpc;

pub use args::*;
use request::{ControllerReq, GroupReq, NodeReq};

/// Exit code for errors reported by the driver or the connection.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code for bad command lines (clap uses the same).
pub const EXIT_USAGE: u8 = 2;
/// Exit code after Ctrl-C (128 + SIGINT), once cleanup ran.
pub const EXIT_INTERRUPTED: u8 = 130;

/// Why a command failed; [`CliError::exit_code`] maps it to the process
/// exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{}: {}", .0.code_name(), .0.message())]
    Grpc(tonic::Status),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Bench(#[from] crust_bench::BenchError),
}

trait CodeName {
    fn code_name(&self) -> String;
}

impl CodeName for tonic::Status {
    /// `NotFound`, `InvalidArgument`, ... (the variant name).
    fn code_name(&self) -> String {
        format!("{:?}", self.code())
    }
}

impl From<tonic::Status> for CliError {
    fn from(s: tonic::Status) -> Self {
        CliError::Grpc(s)
    }
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Usage(_) => ExitCode::from(EXIT_USAGE),
            _ => ExitCode::from(EXIT_FAILURE),
        }
    }
}

/// Runs a parsed command line.
pub async fn run(cli: Cli) -> Result<ExitCode, CliError> {
    let out = cli.output;
    // Validate the command's own input before touching the network.
    match cli.command {
        Command::Identity(cmd) => {
            let c = Csi::connect(&cli.endpoint, cli.timeout).await?;
            rpc::identity(&c, cmd, out).await?;
        }
        Command::Controller(cmd) => {
            let req = ControllerReq::build(cmd)?;
            let c = Csi::connect(&cli.endpoint, cli.timeout).await?;
            rpc::controller(&c, req, out).await?;
        }
        Command::Node(cmd) => {
            let req = NodeReq::build(cmd)?;
            let c = Csi::connect(&cli.endpoint, cli.timeout).await?;
            rpc::node(&c, req, out).await?;
        }
        Command::Group(cmd) => {
            let req = GroupReq::build(cmd)?;
            let c = Csi::connect(&cli.endpoint, cli.timeout).await?;
            rpc::group(&c, req, out).await?;
        }
        Command::Bench(args) if args.deferred => {
            return jobs::bench_deferred_cmd(&cli.endpoint, cli.timeout, args, out).await;
        }
        Command::Bench(args) if args.guest_io.guest_io => {
            return jobs::bench_guest_io_cmd(&cli.endpoint, cli.timeout, args, out).await;
        }
        Command::Bench(args) => {
            return jobs::bench_cmd(&cli.endpoint, cli.timeout, args, out).await;
        }
        Command::Flow(args) => return jobs::flow_cmd(&cli.endpoint, cli.timeout, args, out).await,
        Command::Demo(args) => return jobs::demo_cmd(cli.timeout, args, out).await,
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints a response; a response without data prints `done` in text mode so
/// scripts and humans see the call succeeded.
fn emit<T: Render>(format: OutputFormat, resp: &T, done: &str) {
    use std::io::Write;
    let s = render(resp, format);
    // Nobody reading stdout any more is not a reason to panic.
    let _ = if s.is_empty() {
        writeln!(std::io::stdout(), "{done}")
    } else if s.ends_with('\n') {
        write!(std::io::stdout(), "{s}")
    } else {
        writeln!(std::io::stdout(), "{s}")
    };
}

#[cfg(test)]
mod tests {
    use super::request::{capacity, check_name};
    use super::*;
    use clap::{CommandFactory, Parser};
    use crust_kubesim::flow::DeferVia;
    use crust_proto::csi::v1::volume_capability::{AccessType, access_mode::Mode};

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn capability_from_flags() {
        let cli = Cli::try_parse_from([
            "crustctl",
            "node",
            "publish",
            "v1",
            "--target-path",
            "/t",
            "--fs-type",
            "xfs",
            "--supplemental-group",
            "100",
            "--supplemental-group-change-policy",
            "onrootmismatch",
            "--access-mode",
            "single-node-multi-writer",
        ])
        .unwrap();
        let Command::Node(NodeCmd::Publish { cap, .. }) = cli.command else {
            panic!("wrong command")
        };
        let c = cap.build();
        let Some(AccessType::Mount(m)) = c.access_type else {
            panic!("not a mount")
        };
        assert_eq!(m.fs_type, "xfs");
        assert_eq!(m.volume_supplemental_group, "100");
        assert_eq!(m.volume_supplemental_group_change_policy, "OnRootMismatch");
        assert_eq!(
            c.access_mode.unwrap().mode,
            Mode::SingleNodeMultiWriter as i32
        );
    }

    #[test]
    fn usage_errors() {
        for bad in [
            vec![
                "crustctl",
                "controller",
                "create",
                "--name",
                "x",
                "--size",
                "1GB",
            ],
            vec![
                "crustctl",
                "controller",
                "create",
                "--name",
                "x",
                "--block",
                "--fs-type",
                "ext4",
            ],
            vec![
                "crustctl",
                "controller",
                "create",
                "--name",
                "x",
                "--param",
                "novalue",
            ],
            vec![
                "crustctl",
                "node",
                "publish",
                "v",
                "--target-path",
                "/t",
                "--supplemental-group",
                "abc",
            ],
            vec![
                "crustctl",
                "--endpoint",
                "relative.sock",
                "identity",
                "info",
            ],
            vec!["crustctl", "--timeout", "0s", "identity", "info"],
            vec!["crustctl", "bench", "--scenarios", "nope"],
            vec!["crustctl", "bench", "--ops", "5", "--duration", "1s"],
        ] {
            let e = Cli::try_parse_from(&bad).unwrap_err();
            assert_eq!(e.exit_code(), EXIT_USAGE as i32, "{bad:?}");
        }
    }

    #[test]
    fn flow_demo_and_deferred_bench_parse() {
        let cli = Cli::try_parse_from([
            "crustctl",
            "flow",
            "--work-dir",
            "/w",
            "--fs-group",
            "2000",
            "--fs-group-change-policy",
            "onrootmismatch",
            "--sub-path",
            "a/b",
            "--defer-via",
            "storage-class",
            "--runtime-root",
            "/r",
            "--accel",
            "tcg",
            "--",
            "sh",
            "-c",
            "true",
        ])
        .unwrap();
        let Command::Flow(f) = cli.command else {
            panic!("not flow")
        };
        assert_eq!(f.command, ["sh", "-c", "true"]);
        assert_eq!(f.pod.defer_via, DeferVia::StorageClass);
        let cfg = f.pod.flow_config("/w".into()).unwrap();
        assert_eq!(cfg.fs_group, Some(2000));
        assert_eq!(
            cfg.change_policy,
            Some(crust_handoff::FsGroupChangePolicy::OnRootMismatch)
        );
        assert_eq!(
            cfg.runtime.root.as_deref(),
            Some(std::path::Path::new("/r"))
        );
        assert_eq!(cfg.runtime.accel.as_deref(), Some("tcg"));
        assert_eq!(f.expand_to, 512 << 20);

        let cli = Cli::try_parse_from(["crustctl", "demo", "--keep", "--size", "64Mi"]).unwrap();
        let Command::Demo(d) = cli.command else {
            panic!("not demo")
        };
        assert!(d.keep && d.size == 64 << 20 && d.pool_capacity == 2 << 30);

        let cli = Cli::try_parse_from([
            "crustctl",
            "bench",
            "--deferred",
            "--expand-step",
            "8Mi",
            "--ops",
            "3",
        ])
        .unwrap();
        let Command::Bench(b) = cli.command else {
            panic!("not bench")
        };
        assert!(b.deferred && b.expand_step == 8 << 20);

        for bad in [
            // the policy needs a group
            vec!["crustctl", "flow", "--fs-group-change-policy", "Always"],
            // deferred-mode flags without --deferred
            vec!["crustctl", "bench", "--expand-step", "8Mi"],
            // standard scenarios and --deferred do not mix
            vec!["crustctl", "bench", "--deferred", "--scenarios", "stats"],
            vec!["crustctl", "flow", "--no-expand", "--expand-to", "1Gi"],
            vec!["crustctl", "demo", "--fs-type", "btrfs"],
        ] {
            let e = Cli::try_parse_from(&bad).unwrap_err();
            assert_eq!(e.exit_code(), EXIT_USAGE as i32, "{bad:?}");
        }
        // fsGroup travels as volume_supplemental_group: deferral only.
        let cli =
            Cli::try_parse_from(["crustctl", "flow", "--defer-via", "none", "--fs-group", "1"])
                .unwrap();
        let Command::Flow(f) = cli.command else {
            panic!()
        };
        assert!(matches!(
            f.pod.flow_config("/w".into()),
            Err(CliError::Usage(_))
        ));
        assert!(check_name("--pod-uid", "a/b").is_err());
        assert!(check_name("--pod-uid", "..").is_err());
        assert!(check_name("--pod-uid", "uid-1").is_ok());
    }

    #[test]
    fn limit_below_size_is_a_usage_error() {
        let e = capacity(Some(10), Some(5)).unwrap_err();
        assert!(matches!(e, CliError::Usage(_)));
        assert_eq!(capacity(None, None).unwrap(), None);
    }

    #[test]
    fn grpc_error_text() {
        let e = CliError::from(tonic::Status::not_found("volume x"));
        assert_eq!(e.to_string(), "NotFound: volume x");
        assert_eq!(e.exit_code(), ExitCode::from(EXIT_FAILURE));
    }
}
