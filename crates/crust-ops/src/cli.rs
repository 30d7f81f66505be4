//! Running a runtime CLI: own process group (so a timeout kills whatever it
//! spawned too), no stdin, bounded stdout/stderr, hard timeout.

use std::os::unix::fs::PermissionsExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

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

/// Runs `program args...`, returns its stdout when it exits 0 in time.
pub async fn run(program: &str, args: &[&str], timeout: Duration) -> Result<Vec<u8>, OpsError> {
    let op = args.join(" ");
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| OpsError::BadRuntimeCli {
        path: program.to_string(),
        reason: format!("cannot run: {e}"),
    })?;
    let pid = child.id();
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");

    let result = tokio::time::timeout(timeout, async {
        let (out, err, status) = tokio::join!(
            read_bounded(stdout, MAX_STDOUT),
            read_bounded(stderr, MAX_STDERR),
            child.wait()
        );
        (out, err, status)
    })
    .await;

    let (out, err, status) = match result {
        Ok(r) => r,
        Err(_) => {
            // The child is not reaped yet, so its pid still names its group.
            if let Some(pid) = pid.and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
            }
            let _ = child.kill().await;
            return Err(OpsError::CliTimeout {
                cli: program.to_string(),
                op,
                timeout,
            });
        }
    };
    let status = status.map_err(|e| OpsError::Io {
        context: format!("wait for {program}"),
        source: e,
    })?;
    let (stderr, _) = err.unwrap_or_default();
    let (stdout, overflow) = out.map_err(|e| OpsError::Io {
        context: format!("read output of {program}"),
        source: e,
    })?;
    // Checked first: once we stop reading, the CLI dies of EPIPE/SIGPIPE.
    if overflow {
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
            stderr: quote_stderr(&stderr),
        });
    }
    Ok(stdout)
}

/// Reads up to `max` bytes; past that it stops reading (the writer gets
/// EPIPE) and reports the overflow.
async fn read_bounded(
    mut r: impl AsyncRead + Unpin,
    max: usize,
) -> std::io::Result<(Vec<u8>, bool)> {
    let mut buf = Vec::new();
    let n = (&mut r).take(max as u64 + 1).read_to_end(&mut buf).await?;
    if n > max {
        buf.truncate(max);
        return Ok((buf, true));
    }
    Ok((buf, false))
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

    #[tokio::test]
    async fn success_failure_and_overflow() {
        let d = tempfile::tempdir().unwrap();
        let ok = script(d.path(), "ok", "echo \"$@\"");
        assert_eq!(
            run(&ok, &["crust", "stats", "/a b"], Duration::from_secs(10))
                .await
                .unwrap(),
            b"crust stats /a b\n"
        );
        let fail = script(d.path(), "fail", "echo 'no such sandbox' >&2; exit 3");
        let e = run(&fail, &["x"], Duration::from_secs(10))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal);
        let msg = e.to_string();
        assert!(
            msg.contains("exit code 3") && msg.contains("no such sandbox"),
            "{msg}"
        );
        let big = script(d.path(), "big", "head -c 2000000 /dev/zero");
        let e = run(&big, &[], Duration::from_secs(10)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal);
        assert!(e.to_string().contains("exceeds"), "{e}");
        let e = run("/nonexistent/cli", &[], Duration::from_secs(10))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_group() {
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
        let e = run(&hang, &[], Duration::from_millis(500))
            .await
            .unwrap_err();
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
