//! Running a runtime CLI: own process group (so a timeout kills whatever it
//! spawned too), no stdin, bounded stdout/stderr, hard timeout; on the
//! caller's thread, without an async runtime.

use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, Signal};

use crate::error::OpsError;

/// Most stdout kept from a CLI; more is an error.
pub const MAX_STDOUT: usize = 1024 * 1024;
/// Most stderr kept from a CLI (the rest is dropped).
pub const MAX_STDERR: usize = 64 * 1024;
/// Most stderr quoted in an error message.
const MAX_STDERR_IN_ERROR: usize = 4096;

/// The CLI must be an absolute path to an executable regular file.
pub fn check_executable(path: &str) -> Result<(), OpsError> {
    let bad = |reason: String| OpsError::BadRuntimeCli {
        path: path.to_string(),
        reason,
    };
    if !path.starts_with('/') {
        return Err(bad("not an absolute path".into()));
    }
    let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err(bad("not executable".into()));
    }
    Ok(())
}

/// How a runtime CLI is run: its time limit, and variables added to the
/// environment it inherits (a node whose runtime was installed with
/// non-default roots names them here, as `CRUST_RUNTIME_*`).
#[derive(Debug, Clone, Default)]
pub struct CliCall {
    pub timeout: Duration,
    pub env: Vec<(String, String)>,
}

impl CliCall {
    pub fn timeout(timeout: Duration) -> CliCall {
        CliCall {
            timeout,
            env: Vec::new(),
        }
    }
}

/// Runs `program args...`, returns its stdout when it exits 0 in time.
///
/// Synchronous: the calling thread polls the CLI's stdout, stderr and
/// pidfd until the CLI exits and both pipes are closed, or the timeout
/// kills its whole process group. No async runtime and no helper thread:
/// the plugin calls this from the thread already serving the request.
pub fn run(program: &str, args: &[&str], call: &CliCall) -> Result<Vec<u8>, OpsError> {
    let op = args.join(" ");
    let timeout = call.timeout;
    let deadline = Instant::now() + timeout;
    let mut child = Command::new(program)
        .args(args)
        .envs(call.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| OpsError::BadRuntimeCli {
            path: program.to_string(),
            reason: format!("cannot run: {e}"),
        })?;
    let io_err = |context: &str, e: std::io::Error| OpsError::Io {
        context: format!("{context} {program}"),
        source: e,
    };
    let mut out = Pipe::new(child.stdout.take().map(OwnedFd::from), MAX_STDOUT, true);
    let mut err = Pipe::new(child.stderr.take().map(OwnedFd::from), MAX_STDERR, false);
    // From here on every way out kills the CLI's group and reaps it.
    let cli = Running(Some(child));
    let pidfd = rustix::process::pidfd_open(cli.pid(), PidfdFlags::empty())
        .map_err(|e| io_err("pidfd of", e.into()))?;
    // Once the CLI exited, what it left running may hold its pipes open:
    // they get a short grace, not the whole timeout.
    let mut drain_until: Option<Instant> = None;
    loop {
        let done = out.fd.is_none() && err.fd.is_none();
        if let Some(d) = drain_until
            && (done || Instant::now() >= d.min(deadline))
        {
            break;
        }
        let until = drain_until.map_or(deadline, |d| d.min(deadline));
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() && drain_until.is_none() {
            drop(cli);
            return Err(OpsError::CliTimeout {
                cli: program.to_string(),
                op,
                timeout,
            });
        }
        let mut fds = Vec::with_capacity(3);
        for fd in [out.fd.as_ref(), err.fd.as_ref()].into_iter().flatten() {
            fds.push(PollFd::new(fd, PollFlags::IN));
        }
        if drain_until.is_none() {
            fds.push(PollFd::new(&pidfd, PollFlags::IN));
        }
        let ts = Timespec::try_from(left).unwrap_or(Timespec {
            tv_sec: i64::MAX,
            tv_nsec: 0,
        });
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(e) => return Err(io_err("poll", e.into())),
        }
        let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
        let mut i = 0;
        for pipe in [&mut out, &mut err] {
            if pipe.fd.is_some() {
                if ready[i] {
                    pipe.read_some().map_err(|e| io_err("read output of", e))?;
                }
                i += 1;
            }
        }
        if drain_until.is_none() && ready[i] {
            drain_until = Some(Instant::now() + EXIT_DRAIN);
        }
        if out.overflow {
            break;
        }
    }
    let status = cli.finish().map_err(|e| io_err("wait for", e))?;
    if out.overflow {
        return Err(OpsError::BadOutput {
            cli: program.to_string(),
            op,
            reason: format!("output exceeds {MAX_STDOUT} bytes"),
        });
    }
    if !status.success() {
        return Err(OpsError::CliFailed {
            cli: program.to_string(),
            op,
            status: describe(status),
            stderr: quote_stderr(&err.buf),
        });
    }
    Ok(out.buf)
}

/// How long the pipes of an exited CLI are still read (a process it left
/// behind may hold them open).
const EXIT_DRAIN: Duration = Duration::from_millis(200);

/// A spawned CLI. Dropped (an error or timeout on the way out) it kills
/// the CLI's whole process group and reaps the CLI; [`Running::finish`]
/// does the same after a normal exit, so nothing it started outlives it.
struct Running(Option<std::process::Child>);

impl Running {
    fn pid(&self) -> Pid {
        Pid::from_child(self.0.as_ref().expect("running"))
    }

    fn finish(mut self) -> std::io::Result<ExitStatus> {
        let mut child = self.0.take().expect("running");
        // Not reaped yet: the pid still names the CLI's group.
        let _ = rustix::process::kill_process_group(Pid::from_child(&child), Signal::KILL);
        child.wait()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = rustix::process::kill_process_group(Pid::from_child(&child), Signal::KILL);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One output pipe of a CLI, read up to `max` bytes: past that, stdout
/// is an overflow (the pipe is closed, the writer gets EPIPE) and stderr
/// is read on and dropped.
struct Pipe {
    fd: Option<OwnedFd>,
    buf: Vec<u8>,
    max: usize,
    /// Output past `max` is an error (stdout), not just dropped (stderr).
    overflow_is_error: bool,
    overflow: bool,
}

impl Pipe {
    fn new(fd: Option<OwnedFd>, max: usize, overflow_is_error: bool) -> Pipe {
        Pipe {
            fd,
            buf: Vec::new(),
            max,
            overflow_is_error,
            overflow: false,
        }
    }

    /// One read of what is there; EOF or an overflow closes the pipe.
    fn read_some(&mut self) -> std::io::Result<()> {
        let Some(fd) = &self.fd else { return Ok(()) };
        let mut chunk = [0u8; 16 * 1024];
        let n = match rustix::io::read(fd, &mut chunk) {
            Ok(n) => n,
            Err(Errno::INTR | Errno::AGAIN) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if n == 0 {
            self.fd = None;
            return Ok(());
        }
        let room = self.max - self.buf.len();
        self.buf.extend_from_slice(&chunk[..n.min(room)]);
        if n > room && self.overflow_is_error {
            self.overflow = true;
            self.fd = None;
        }
        Ok(())
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "abnormal exit".into(),
    }
}

fn quote_stderr(stderr: &[u8]) -> String {
    let s = String::from_utf8_lossy(stderr);
    let s = s.trim();
    if s.is_empty() {
        return "no message on stderr".into();
    }
    if s.len() <= MAX_STDERR_IN_ERROR {
        return s.to_string();
    }
    let mut cut = MAX_STDERR_IN_ERROR;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &s[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Instant;

    fn script(dir: &Path, name: &str, body: &str) -> String {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p.to_str().unwrap().to_string()
    }

    #[test]
    fn success_failure_and_overflow() {
        let d = tempfile::tempdir().unwrap();
        let ok = script(d.path(), "ok", "echo \"$@\"");
        assert_eq!(
            run(
                &ok,
                &["crust", "stats", "/a b"],
                &CliCall::timeout(Duration::from_secs(10))
            )
            .unwrap(),
            b"crust stats /a b\n"
        );
        let fail = script(d.path(), "fail", "echo 'no such sandbox' >&2; exit 3");
        let e = run(&fail, &["x"], &CliCall::timeout(Duration::from_secs(10))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal);
        let msg = e.to_string();
        assert!(
            msg.contains("exit code 3") && msg.contains("no such sandbox"),
            "{msg}"
        );
        let big = script(d.path(), "big", "head -c 2000000 /dev/zero");
        let e = run(&big, &[], &CliCall::timeout(Duration::from_secs(10))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal);
        assert!(e.to_string().contains("exceeds"), "{e}");
        let e = run(
            "/nonexistent/cli",
            &[],
            &CliCall::timeout(Duration::from_secs(10)),
        )
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn timeout_kills_the_whole_group() {
        let d = tempfile::tempdir().unwrap();
        let pidfile = d.path().join("pids");
        // A grandchild that would outlive a naive kill of the direct child.
        let hang = script(
            d.path(),
            "hang",
            &format!(
                "sleep 300 & echo $! > {}; echo $$ >> {}; wait",
                pidfile.display(),
                pidfile.display()
            ),
        );
        let t0 = Instant::now();
        let e = run(&hang, &[], &CliCall::timeout(Duration::from_millis(500))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded);
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the 300 s sleep was cut short"
        );
        let pids = std::fs::read_to_string(&pidfile).unwrap();
        for pid in pids.split_whitespace() {
            // Dead, or at most an unreaped zombie of init. SIGKILL was sent
            // to the whole group; the grandchild may take a moment to go.
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                let state = stat
                    .rsplit(')')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .next();
                if matches!(state, None | Some("Z")) {
                    break;
                }
                assert!(Instant::now() < deadline, "pid {pid} still alive: {stat}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    #[test]
    fn an_exited_cli_is_not_held_by_what_it_left_running() {
        let d = tempfile::tempdir().unwrap();
        // Exits 0 at once; a background child keeps stdout open for
        // longer than the timeout: the answer is the exit's, not a timeout.
        let cli = script(d.path(), "bg", "echo ok; (sleep 30) & exit 0");
        let out = run(&cli, &[], &CliCall::timeout(Duration::from_secs(3))).unwrap();
        assert_eq!(out, b"ok\n");
    }

    #[test]
    fn executable_checks() {
        let d = tempfile::tempdir().unwrap();
        let ok = script(d.path(), "ok", "true");
        check_executable(&ok).unwrap();
        let noexec = d.path().join("noexec");
        std::fs::write(&noexec, "x").unwrap();
        for (p, why) in [
            ("relative/cli", "absolute"),
            (noexec.to_str().unwrap(), "not executable"),
            (d.path().to_str().unwrap(), "not a regular file"),
            ("/nonexistent/cli", "No such file"),
        ] {
            let e = check_executable(p).unwrap_err();
            assert_eq!(e.code(), tonic::Code::FailedPrecondition);
            assert!(e.to_string().contains(why), "{e}");
        }
    }
}
