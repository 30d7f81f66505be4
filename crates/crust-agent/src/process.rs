//! Running a command to completion with a timeout and bounded output
//! (Exec, and the filesystem tools the agent calls).

use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};

/// Directories searched for tools; the guest's PATH is this too.
pub const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Where the filesystem tools the agent runs as root are: it runs each
/// [`crust_fs::FsSpec::guest_tools`] program by absolute path here (where
/// guest/build-image.sh installs them, and where Debian has them): a PATH
/// lookup could find a binary a workload bound over a PATH directory.
pub const FS_TOOL_DIR: &str = "/usr/sbin";

/// Absolute path of the filesystem tool `program` in the guest.
pub fn fs_tool_path(program: &str) -> String {
    format!("{FS_TOOL_DIR}/{program}")
}

/// The command line of a filesystem's `tool` on `target` (a device or a
/// mount point): its absolute path, its arguments, then `target`.
pub fn fs_tool_command(tool: &crust_fs::Tool, target: String) -> Vec<String> {
    let mut args = vec![fs_tool_path(tool.program)];
    args.extend(tool.args.iter().map(|a| a.to_string()));
    args.push(target);
    args
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// Exit status, or 128+signal.
    pub code: i32,
    pub signal: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub truncated: bool,
}

impl Output {
    pub fn success(&self) -> bool {
        self.code == 0
    }

    /// stderr and stdout, lossily decoded and trimmed, for error messages.
    pub fn text(&self) -> String {
        let mut s = String::from_utf8_lossy(&self.stderr).trim().to_owned();
        let out = String::from_utf8_lossy(&self.stdout);
        if !out.trim().is_empty() {
            if !s.is_empty() {
                s.push_str(" | ");
            }
            s.push_str(out.trim());
        }
        if s.len() > 2000 {
            let mut cut = s.len() - 2000;
            while !s.is_char_boundary(cut) {
                cut += 1;
            }
            s = format!("…{}", &s[cut..]);
        }
        s
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("empty command")]
    Empty,
    #[error("cannot start {program:?}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program:?} did not finish within {after:?} and was killed")]
    Timeout { program: String, after: Duration },
    #[error("waiting for {program:?}: {source}")]
    Wait {
        program: String,
        #[source]
        source: std::io::Error,
    },
}

/// Exit status as (code, signal) with the shell's 128+N convention.
pub fn status_code(st: ExitStatus) -> (i32, Option<i32>) {
    match (st.code(), st.signal()) {
        (Some(c), _) => (c, None),
        (None, Some(s)) => (128 + s, Some(s)),
        (None, None) => (-1, None),
    }
}

fn reader(mut r: impl Read + Send + 'static, cap: usize) -> JoinHandle<(Vec<u8>, bool)> {
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let mut truncated = false;
        let mut buf = [0u8; 8192];
        // Keep draining past the cap so the child never blocks on a full pipe.
        loop {
            match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let room = cap.saturating_sub(kept.len());
                    if n > room {
                        truncated = true;
                    }
                    kept.extend_from_slice(&buf[..n.min(room)]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        (kept, truncated)
    })
}

/// Kills the child's whole process group (it leads one) and reaps it.
pub fn kill_group(child: &mut Child) {
    let pid = Pid::from_raw(child.id() as i32);
    if let Some(pid) = pid {
        let _ = rustix::process::kill_process_group(pid, Signal::KILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs `args` with `env` added to the agent's environment, in its own
/// process group, stdin from /dev/null, output captured up to `cap` bytes
/// each. Killed after `timeout`.
pub fn run(
    args: &[String],
    env: &[String],
    timeout: Duration,
    cap: usize,
) -> Result<Output, RunError> {
    run_in(args, env, timeout, cap, None)
}

/// [`run`] in the mount namespace `mount_ns` refers to, when given (a
/// container's: its root, its mounts; the program is looked up there).
pub fn run_in(
    args: &[String],
    env: &[String],
    timeout: Duration,
    cap: usize,
    mount_ns: Option<std::os::fd::OwnedFd>,
) -> Result<Output, RunError> {
    let (program, rest) = args.split_first().ok_or(RunError::Empty)?;
    let mut cmd = Command::new(program);
    cmd.args(rest)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if std::env::var_os("PATH").is_none() {
        cmd.env("PATH", PATH);
    }
    for kv in env {
        match kv.split_once('=') {
            Some((k, v)) => cmd.env(k, v),
            None => cmd.env(kv, ""),
        };
    }
    if let Some(ns) = mount_ns {
        crust_sys::spawn::ChildSetup::new()
            .mount_namespace(ns)
            .apply(&mut cmd)
            .map_err(|source| RunError::Spawn {
                program: program.clone(),
                source,
            })?;
    }
    let mut child = cmd.spawn().map_err(|source| RunError::Spawn {
        program: program.clone(),
        source,
    })?;
    let out = reader(child.stdout.take().expect("piped"), cap);
    let err = reader(child.stderr.take().expect("piped"), cap);
    let deadline = Instant::now() + timeout;
    let mut nap = Duration::from_millis(1);
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) => {}
            Err(source) => {
                kill_group(&mut child);
                return Err(RunError::Wait {
                    program: program.clone(),
                    source,
                });
            }
        }
        if Instant::now() >= deadline {
            kill_group(&mut child);
            return Err(RunError::Timeout {
                program: program.clone(),
                after: timeout,
            });
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(20));
    };
    // Children that inherited the pipes could keep them open forever; the
    // group kill ends them once the leader is gone.
    if let Some(pid) = Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process_group(pid, Signal::KILL);
    }
    let (stdout, t1) = out.join().unwrap_or_default();
    let (stderr, t2) = err.join().unwrap_or_default();
    let (code, signal) = status_code(status);
    Ok(Output {
        code,
        signal,
        stdout,
        stderr,
        truncated: t1 || t2,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn tool_paths_match_the_guest_image() {
        // The agent execs these by absolute path: build-image.sh must put
        // them exactly there (`X=$(tool e2fsck …)`, `add_prog "$X" path`).
        let script = include_str!("../../../guest/build-image.sh");
        let tools = crust_fs::FsType::ALL
            .into_iter()
            .flat_map(|f| f.spec().guest_tools());
        for tool in tools {
            let var = script
                .lines()
                .find_map(|l| {
                    let (var, call) = l.split_once("=$(tool ")?;
                    (call.split_whitespace().next() == Some(tool)).then_some(var)
                })
                .unwrap_or_else(|| panic!("build-image.sh does not look up {tool}"));
            let line = format!("add_prog \"${var}\" {}\n", fs_tool_path(tool));
            assert!(script.contains(&line), "build-image.sh lacks {line:?}");
        }
        assert_eq!(
            fs_tool_command(&crust_fs::FsType::Xfs.spec().grow, "/m".into()),
            ["/usr/sbin/xfs_growfs", "-d", "/m"]
        );
        assert_eq!(
            fs_tool_command(&crust_fs::FsType::Ext4.spec().grow, "/dev/vdb".into()),
            ["/usr/sbin/resize2fs", "/dev/vdb"]
        );
        let preen = crust_fs::FsType::Ext4.spec().preen.expect("ext4 preens");
        assert_eq!(
            fs_tool_command(&preen, "/dev/vdb".into()),
            ["/usr/sbin/e2fsck", "-p", "/dev/vdb"]
        );
    }

    #[test]
    fn captures_and_reports_exit() {
        let o = run(
            &s(&["sh", "-c", "echo out; echo err >&2; exit 3"]),
            &[],
            Duration::from_secs(10),
            1024,
        )
        .unwrap();
        assert_eq!(o.code, 3);
        assert_eq!(o.stdout, b"out\n");
        assert_eq!(o.stderr, b"err\n");
        assert!(!o.truncated);
    }

    #[test]
    fn caps_output_and_sets_env() {
        let o = run(
            &s(&["sh", "-c", "echo $FOO; head -c 5000 /dev/zero"]),
            &s(&["FOO=bar"]),
            Duration::from_secs(10),
            100,
        )
        .unwrap();
        assert!(o.truncated);
        assert_eq!(o.stdout.len(), 100);
        assert!(o.stdout.starts_with(b"bar\n"));
    }

    #[test]
    fn timeout_kills_the_group() {
        let t = Instant::now();
        let e = run(
            &s(&["sh", "-c", "sleep 30 & sleep 30"]),
            &[],
            Duration::from_millis(300),
            100,
        )
        .unwrap_err();
        assert!(matches!(e, RunError::Timeout { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
        let e = run(&s(&["/nonexistent/tool"]), &[], Duration::from_secs(1), 10).unwrap_err();
        assert!(matches!(e, RunError::Spawn { .. }));
    }
}
