//! Command line surface (clap derive). Every global flag can also come
//! from the environment (`CRUST_RUNTIME_*`).

pub mod poll;

use std::path::PathBuf;
use std::time::Duration;

use crate::runtime::Runtime;
use clap::{Parser, Subcommand};
use crust_sandbox::config::Config;
use crust_sandbox::error::RuntimeError;

// The global flags are the sandbox's settings (the shim reads the same
// from its environment).
pub use crust_sandbox::settings::{DEFAULT_QEMU, GlobalOpts};

#[derive(Debug, Parser)]
#[command(
    name = "crust-runtime",
    version,
    about = "crust VM runtime: OCI bundles in QEMU guests with in-guest volume mounts"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalOpts,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a sandbox from an OCI bundle: boot the guest, attach and mount its volumes.
    Create {
        #[arg(long, short = 'b')]
        bundle: PathBuf,
        /// Write the sandbox's pid (QEMU) here.
        #[arg(long)]
        pid_file: Option<PathBuf>,
        id: String,
    },
    /// Start the workload of a created sandbox.
    Start { id: String },
    /// Print the sandbox's state as JSON.
    State { id: String },
    /// Send a signal (number or name, default TERM) to the workload.
    Kill {
        id: String,
        #[arg(default_value = "TERM")]
        signal: String,
    },
    /// Tear the sandbox down (unmount in the guest, stop QEMU, release claims).
    Delete {
        #[arg(long, short = 'f')]
        force: bool,
        id: String,
    },
    /// create + start; waits for the workload, prints its exit status, deletes.
    Run {
        #[arg(long, short = 'b')]
        bundle: PathBuf,
        #[arg(long, short = 'd')]
        detach: bool,
        id: String,
    },
    /// List sandboxes.
    List,
    /// Run a command in the guest (diagnostics).
    Exec {
        id: String,
        #[arg(long, default_value = "30000")]
        timeout_ms: u64,
        #[arg(last = true, required = true)]
        args: Vec<String>,
    },
    /// Print the workload's output.
    Logs { id: String },
    /// Hot-plug the volume staged for PATH into a running sandbox.
    AddVolume {
        id: String,
        #[arg(long)]
        volume_path: String,
    },
    /// KEP-2857 runtime-cli protocol.
    #[command(subcommand)]
    Crust(CrustCommand),
    /// Kata-compatible direct-assigned volume commands.
    #[command(subcommand)]
    DirectVolume(DirectVolumeCommand),
    /// The per-sandbox shim (spawned by `create`).
    #[command(hide = true)]
    Shim {
        #[arg(long)]
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum CrustCommand {
    /// Print the extension verbs this CLI answers (`{"verbs":[…]}`).
    Capabilities,
    /// Print whether sandbox ID runs (`running` | `stopped` | `unknown`),
    /// as established from this runtime root's own records.
    SandboxState { sandbox_id: String },
    /// Print NodeGetVolumeStatsResponse-shaped JSON for the volume at TARGET.
    Stats { target_path: String },
    /// Expand the volume to at least MIN (at most MAX when > 0) bytes.
    Resize {
        target_path: String,
        min: u64,
        max: u64,
    },
    /// Freeze the volume's filesystem in the guest for a point-in-time copy
    /// of its device; the guest thaws it by itself after MAX_FROZEN_MS.
    Freeze {
        target_path: String,
        max_frozen_ms: u64,
    },
    /// Thaw it; prints `{"was_frozen":…,"expired":…}`.
    Thaw { target_path: String },
    /// Set the volume's I/O limits in the guest, live: LIMITS as in the
    /// hand-off record's `ioLimits` (`iops=200,readBps=1048576`; empty or
    /// all 0 lifts them).
    Throttle {
        target_path: String,
        #[arg(default_value = "")]
        limits: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum DirectVolumeCommand {
    /// Write the Kata mountInfo.json record for a volume path.
    Add {
        #[arg(long, allow_hyphen_values = true)]
        volume_path: String,
        #[arg(long, allow_hyphen_values = true)]
        mount_info: String,
    },
    /// Remove the Kata record for a volume path.
    Remove {
        #[arg(long, allow_hyphen_values = true)]
        volume_path: String,
    },
    /// Print the volume's stats (from the guest).
    Stats {
        #[arg(long, allow_hyphen_values = true)]
        volume_path: String,
    },
    /// Resize the volume to SIZE bytes (online, in the guest). SIZE is read
    /// as Kata's CLI reads it (Go, base 0): decimal, `0x` hex, `0o` or a
    /// leading `0` octal, `0b` binary, `_` between digits.
    Resize {
        #[arg(long, allow_hyphen_values = true)]
        volume_path: String,
        #[arg(long, value_parser = parse_go_uint, allow_hyphen_values = true)]
        size: u64,
    },
}

/// The long flags of `direct-volume`'s verbs, each taking a value.
const KATA_FLAGS: [&str; 3] = ["volume-path", "mount-info", "size"];

/// Kata's CLI (urfave/cli over Go's `flag`) takes `-volume-path P` as
/// well as `--volume-path P`: after `direct-volume`, a single-dash
/// spelling of one of its flags becomes the double-dash one. Values are
/// never rewritten (a value may begin with `-`), nor anything after `--`.
pub fn kata_spellings(mut args: Vec<String>) -> Vec<String> {
    let Some(start) = args.iter().position(|a| a == "direct-volume") else {
        return args;
    };
    let mut i = start + 1;
    while i < args.len() {
        let a = &args[i];
        if a == "--" {
            break;
        }
        let name = a
            .strip_prefix("--")
            .or_else(|| a.strip_prefix('-'))
            .unwrap_or_default();
        let (flag, inline) = match name.split_once('=') {
            Some((f, _)) => (f, true),
            None => (name, false),
        };
        if KATA_FLAGS.contains(&flag) {
            if !a.starts_with("--") {
                args[i] = format!("-{a}");
            }
            // The next word is this flag's value.
            i += if inline { 1 } else { 2 };
        } else {
            i += 1;
        }
    }
    args
}

/// An unsigned integer as Go's `strconv.ParseUint(s, 0, 64)` reads it
/// (what Kata's `--size` goes through): `0x`/`0X` hex, `0o`/`0O` or a
/// bare leading `0` octal, `0b`/`0B` binary, else decimal; `_` only
/// between digits (or after a prefix); no sign.
pub fn parse_go_uint(s: &str) -> Result<u64, String> {
    let syntax = || {
        format!(
            "{s:?} is not an unsigned integer as Kata's CLI reads it (decimal, 0x hex, \
             0o or leading-0 octal, 0b binary, '_' between digits)"
        )
    };
    let b = s.as_bytes();
    let (base, digits): (u64, &[u8]) = match b {
        [] => return Err(syntax()),
        [b'0', p, _, ..] if p.eq_ignore_ascii_case(&b'x') => (16, &b[2..]),
        [b'0', p, _, ..] if p.eq_ignore_ascii_case(&b'o') => (8, &b[2..]),
        [b'0', p, _, ..] if p.eq_ignore_ascii_case(&b'b') => (2, &b[2..]),
        [b'0', rest @ ..] => (8, rest),
        _ => (10, b),
    };
    let mut n: u64 = 0;
    let mut underscores = false;
    for &c in digits {
        if c == b'_' {
            underscores = true;
            continue;
        }
        let d = match c {
            b'0'..=b'9' => u64::from(c - b'0'),
            b'a'..=b'z' | b'A'..=b'Z' => u64::from((c | 0x20) - b'a') + 10,
            _ => return Err(syntax()),
        };
        if d >= base {
            return Err(syntax());
        }
        n = n
            .checked_mul(base)
            .and_then(|n| n.checked_add(d))
            .ok_or_else(|| format!("{s:?} does not fit in 64 bits"))?;
    }
    if underscores && !go_underscores_ok(b) {
        return Err(syntax());
    }
    Ok(n)
}

/// Go's rule for `_` in a base-0 literal: only between digits, or between
/// a base prefix and a digit.
fn go_underscores_ok(b: &[u8]) -> bool {
    let (mut i, mut saw, hex) = match b {
        [b'0', p, ..] if matches!(p | 0x20, b'b' | b'o' | b'x') => (2, b'0', p | 0x20 == b'x'),
        _ => (0, b'^', false),
    };
    while i < b.len() {
        let c = b[i];
        i += 1;
        if c.is_ascii_digit() || hex && (b'a'..=b'f').contains(&(c | 0x20)) {
            saw = b'0';
        } else if c == b'_' {
            if saw != b'0' {
                return false;
            }
            saw = b'_';
        } else if saw == b'_' {
            return false;
        } else {
            saw = b'!';
        }
    }
    saw != b'_'
}

/// Parses `9`, `KILL`, `SIGKILL` (case-insensitive) into a signal number.
pub fn parse_signal(s: &str) -> Result<i32, RuntimeError> {
    if let Ok(n) = s.parse::<i32>() {
        if (1..=64).contains(&n) {
            return Ok(n);
        }
    } else {
        let up = s.to_ascii_uppercase();
        let name = up.strip_prefix("SIG").unwrap_or(&up);
        let n = match name {
            "HUP" => Some(libc::SIGHUP),
            "INT" => Some(libc::SIGINT),
            "QUIT" => Some(libc::SIGQUIT),
            "KILL" => Some(libc::SIGKILL),
            "USR1" => Some(libc::SIGUSR1),
            "USR2" => Some(libc::SIGUSR2),
            "TERM" => Some(libc::SIGTERM),
            "CONT" => Some(libc::SIGCONT),
            "STOP" => Some(libc::SIGSTOP),
            "ALRM" => Some(libc::SIGALRM),
            "WINCH" => Some(libc::SIGWINCH),
            _ => None,
        };
        if let Some(n) = n {
            return Ok(n);
        }
    }
    Err(RuntimeError::UnknownSignal(s.to_string()))
}

/// The `crust` verbs this CLI answers (cross-team contract 1).
pub fn capabilities() -> crust_handoff::Capabilities {
    use crust_handoff::liveness::*;
    crust_handoff::Capabilities {
        verbs: [
            VERB_CAPABILITIES,
            VERB_FREEZE,
            VERB_RESIZE,
            VERB_SANDBOX_STATE,
            VERB_STATS,
            VERB_THAW,
            VERB_THROTTLE,
        ]
        .map(String::from)
        .to_vec(),
    }
}

/// For a command line clap refused: `Some(verb)` when it is `crust <verb>`
/// with a verb this CLI does not know (answered with exit status 2 and
/// `unsupported:`, so a caller can tell it from a failure).
pub fn unsupported_crust_verb(args: &[String]) -> Option<String> {
    let pos = args.iter().position(|a| a == "crust")?;
    let verb = args.get(pos + 1)?;
    if verb.starts_with('-') || capabilities().supports(verb) {
        return None;
    }
    Some(verb.clone())
}

/// What a command leaves for the binary to print and exit with.
#[derive(Debug, Default)]
pub struct Outcome {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: i32,
}

impl Outcome {
    pub(crate) fn json<T: serde::Serialize>(v: &T) -> Outcome {
        Outcome {
            stdout: serde_json::to_string_pretty(v).expect("serializable") + "\n",
            ..Default::default()
        }
    }
}

/// Runs every command except `shim` (see [`crate::controller::run_shim`]).
pub async fn dispatch(cfg: Config, command: Command) -> Result<Outcome, RuntimeError> {
    let rt = Runtime::new(cfg)?;
    match command {
        Command::Create {
            bundle,
            pid_file,
            id,
        } => {
            let st = rt.create(&bundle, &id).await?;
            if let (Some(f), Some(pid)) = (pid_file, st.pid) {
                std::fs::write(&f, pid.to_string())
                    .map_err(RuntimeError::io(format!("writing {}", f.display())))?;
            }
            Ok(Outcome::default())
        }
        Command::Start { id } => rt.start(&id).await.map(|_| Outcome::default()),
        Command::State { id } => Ok(Outcome::json(&rt.state(&id).await?)),
        Command::Kill { id, signal } => {
            let sig = parse_signal(&signal)?;
            rt.kill(&id, sig).await.map(|()| Outcome::default())
        }
        Command::Delete { force, id } => rt.delete(&id, force).await.map(|()| Outcome::default()),
        Command::Run { bundle, detach, id } => match rt.run(&bundle, &id, detach).await? {
            Some(code) => Ok(Outcome {
                stdout: format!("{code}\n"),
                exit_code: code.clamp(0, 255),
                ..Default::default()
            }),
            None => Ok(Outcome::default()),
        },
        Command::List => {
            let mut out = Vec::new();
            for id in rt.sandboxes.list()? {
                match rt.load(&id) {
                    Ok(st) => out.push(
                        serde_json::json!({"id": id, "status": st.status, "bundle": st.bundle}),
                    ),
                    Err(e) => out.push(serde_json::json!({"id": id, "error": e.to_string()})),
                }
            }
            Ok(Outcome::json(&out))
        }
        Command::Exec {
            id,
            timeout_ms,
            args,
        } => {
            let r = rt
                .exec(&id, args, Duration::from_millis(timeout_ms))
                .await?;
            Ok(Outcome {
                stdout: r.stdout,
                stderr: r.stderr,
                exit_code: r.exit_code.clamp(0, 255),
            })
        }
        Command::Logs { id } => Ok(Outcome {
            stdout: rt.logs(&id).await?,
            ..Default::default()
        }),
        Command::AddVolume { id, volume_path } => {
            Ok(Outcome::json(&rt.add_volume(&id, &volume_path).await?))
        }
        Command::Crust(c) => crust_verb(&rt, c).await,
        Command::DirectVolume(c) => direct_volume(&rt, c).await,
        Command::Shim { .. } => Err(RuntimeError::ShimNotDispatched),
    }
}

/// The KEP's `crust` verbs (and crust's own: freeze, thaw, throttle).
async fn crust_verb(rt: &Runtime, command: CrustCommand) -> Result<Outcome, RuntimeError> {
    match command {
        CrustCommand::Capabilities => Ok(Outcome {
            stdout: capabilities().to_json() + "\n",
            ..Default::default()
        }),
        CrustCommand::SandboxState { sandbox_id } => Ok(Outcome {
            stdout: rt.sandboxes.liveness(&sandbox_id).to_json() + "\n",
            ..Default::default()
        }),
        CrustCommand::Stats { target_path } => {
            poll::answer(rt, poll::Poll::CrustStats(&target_path))
        }
        CrustCommand::Resize {
            target_path,
            min,
            max,
        } => Ok(Outcome::json(
            &rt.volume_resize(&target_path, min, max).await?,
        )),
        CrustCommand::Freeze {
            target_path,
            max_frozen_ms,
        } => rt
            .volume_freeze(&target_path, max_frozen_ms)
            .await
            .map(|()| Outcome::json(&serde_json::json!({}))),
        CrustCommand::Thaw { target_path } => {
            Ok(Outcome::json(&rt.volume_thaw(&target_path).await?))
        }
        CrustCommand::Throttle {
            target_path,
            limits,
        } => rt
            .volume_throttle(&target_path, &limits)
            .await
            .map(|()| Outcome::json(&serde_json::json!({}))),
    }
}

/// Kata's `direct-volume` verbs.
async fn direct_volume(
    rt: &Runtime,
    command: DirectVolumeCommand,
) -> Result<Outcome, RuntimeError> {
    match command {
        DirectVolumeCommand::Add {
            volume_path,
            mount_info,
        } => rt
            .direct_volume_add(&volume_path, &mount_info)
            .map(|()| Outcome::default()),
        DirectVolumeCommand::Remove { volume_path } => rt
            .direct_volume_remove(&volume_path)
            .map(|()| Outcome::default()),
        DirectVolumeCommand::Stats { volume_path } => {
            poll::answer(rt, poll::Poll::KataStats(&volume_path))
        }
        DirectVolumeCommand::Resize { volume_path, size } => Ok(Outcome::json(
            &rt.volume_resize(&volume_path, size, 0).await?,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_kep_and_kata_forms() {
        let c = Cli::try_parse_from(["crust-runtime", "crust", "resize", "/t", "1", "0"]).unwrap();
        assert!(matches!(
            c.command,
            Command::Crust(CrustCommand::Resize { min: 1, max: 0, .. })
        ));
        let c = Cli::try_parse_from([
            "crust-runtime",
            "--root",
            "/r",
            "direct-volume",
            "add",
            "--volume-path",
            "/v",
            "--mount-info",
            "{}",
        ])
        .unwrap();
        assert_eq!(c.global.root, PathBuf::from("/r"));
        assert!(matches!(
            c.command,
            Command::DirectVolume(DirectVolumeCommand::Add { .. })
        ));
        // Global flags may follow the subcommand.
        let c = Cli::try_parse_from(["crust-runtime", "state", "x", "--timeout-ms", "5"]).unwrap();
        assert_eq!(c.global.config().timeout, Duration::from_millis(5));
        let c = Cli::try_parse_from(["crust-runtime", "exec", "x", "--", "df", "-P"]).unwrap();
        assert!(matches!(c.command, Command::Exec { ref args, .. } if args == &["df", "-P"]));
    }

    #[test]
    fn config_roundtrips_through_shim_args() {
        let c = Cli::try_parse_from([
            "crust-runtime",
            "--guest-kernel",
            "/k/vmlinuz",
            "--accel",
            "tcg",
            "--share-binds",
            "--virtiofsd-binary",
            "/v/virtiofsd",
            "list",
        ])
        .unwrap();
        let cfg = c.global.config();
        assert_eq!(cfg.guest_initrd, PathBuf::from("/k/initramfs.cpio.gz"));
        assert!(cfg.share_binds);
        let mut args = vec!["crust-runtime".into()];
        args.extend(cfg.to_args());
        args.extend(["shim".into(), "--id".into(), "a".into()]);
        let again = Cli::try_parse_from(args).unwrap().global.config();
        assert_eq!(format!("{again:?}"), format!("{cfg:?}"));
    }

    /// Issue 25 item 7: the spellings Kata's CLI accepts (Go's `flag`
    /// package, `strconv.ParseUint(s, 0, 64)` for `--size`).
    #[test]
    fn kata_flag_spellings_and_go_sizes() {
        let argv = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let parse = |v: &[&str]| Cli::try_parse_from(kata_spellings(argv(v)));
        for words in [
            &[
                "k",
                "direct-volume",
                "resize",
                "-volume-path",
                "/v",
                "-size",
                "0x10",
            ][..],
            &[
                "k",
                "direct-volume",
                "resize",
                "-volume-path=/v",
                "-size=020",
            ],
            &[
                "k",
                "direct-volume",
                "resize",
                "--volume-path",
                "/v",
                "--size=0b1_0000",
            ],
            &[
                "k",
                "direct-volume",
                "resize",
                "-size",
                "1_6",
                "--volume-path=/v",
            ],
        ] {
            match parse(words)
                .unwrap_or_else(|e| panic!("{words:?}: {e}"))
                .command
            {
                Command::DirectVolume(DirectVolumeCommand::Resize { volume_path, size }) => {
                    assert_eq!((volume_path.as_str(), size), ("/v", 16), "{words:?}")
                }
                c => panic!("{words:?}: {c:?}"),
            }
        }
        // A value that starts with a dash is never rewritten.
        let c = parse(&[
            "k",
            "direct-volume",
            "add",
            "-mount-info",
            "-size",
            "-volume-path",
            "/v",
        ])
        .unwrap();
        assert!(matches!(
            c.command,
            Command::DirectVolume(DirectVolumeCommand::Add { ref mount_info, .. }) if mount_info == "-size"
        ));
        assert_eq!(
            kata_spellings(argv(&["k", "exec", "x", "--", "-size"])),
            argv(&["k", "exec", "x", "--", "-size"])
        );
        for (s, want) in [
            ("0", 0),
            ("00", 0),
            ("7", 7),
            ("0x1F", 31),
            ("0X_1f", 31),
            ("017", 15),
            ("0o17", 15),
            ("0O1_7", 15),
            ("0_7", 7),
            ("0b101", 5),
            ("1_000_000", 1_000_000),
            ("18446744073709551615", u64::MAX),
            ("0xffffffffffffffff", u64::MAX),
        ] {
            assert_eq!(parse_go_uint(s), Ok(want), "{s}");
        }
        for bad in [
            "", "08", "09", "0x", "0b", "0o", "0xg", "+1", "-1", "_1", "1_", "1__0", "0x_", " 1",
            "1.0", "1e3", "0b2",
        ] {
            let e = parse_go_uint(bad).unwrap_err();
            assert!(e.contains("Kata's CLI"), "{bad:?}: {e}");
        }
        let e = parse_go_uint("18446744073709551616").unwrap_err();
        assert!(e.contains("64 bits"), "{e}");
    }

    #[test]
    fn signals() {
        assert_eq!(parse_signal("9").unwrap(), 9);
        assert_eq!(parse_signal("sigterm").unwrap(), 15);
        assert_eq!(parse_signal("KILL").unwrap(), 9);
        assert!(parse_signal("0").is_err());
        assert!(parse_signal("BOGUS").is_err());
    }
}
