//! The virtiofsd of each share, started before QEMU.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::rundir::{RunPaths, io_err, tail};
use crate::VmError;
use crate::config::{ShareSpec, VIRTIOFSD_ARGS, VmConfig};

/// How long a virtiofsd gets to create its socket.
const VIRTIOFSD_TIMEOUT: Duration = Duration::from_secs(10);

/// Kills daemons started for a launch that then failed.
pub(crate) struct DaemonGuard(pub(crate) Vec<Child>);

impl Drop for DaemonGuard {
    fn drop(&mut self) {
        for d in &mut self.0 {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

/// Starts the virtiofsd of share `i` and waits for its socket.
pub(crate) async fn start_virtiofsd(
    cfg: &VmConfig,
    paths: &RunPaths,
    i: usize,
    sh: &ShareSpec,
) -> Result<Child, VmError> {
    let sock = paths.fs_socket(i);
    match std::fs::remove_file(&sock) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("remove", &sock, e)),
    }
    let log_path = paths.fs_log(i);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&log_path)
        .map_err(|e| io_err("create", &log_path, e))?;
    let log2 = log.try_clone().map_err(|e| io_err("dup", &log_path, e))?;
    let mut cmd = Command::new(&cfg.virtiofsd_binary);
    cmd.arg("--socket-path")
        .arg(&sock)
        .arg("--shared-dir")
        .arg(&sh.dir)
        .args(VIRTIOFSD_ARGS)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .process_group(0);
    super::spawn::vm_child(cfg)?
        .apply(&mut cmd)
        .map_err(|e| VmError::InvalidConfig(format!("virtiofsd's start: {e}")))?;
    let failed = |reason: String| VmError::Virtiofsd {
        tag: sh.tag.clone(),
        reason,
    };
    let mut child = cmd.spawn().map_err(|e| {
        failed(format!(
            "{}: {e} (install it: cargo install virtiofsd)",
            cfg.virtiofsd_binary.display()
        ))
    })?;
    let deadline = Instant::now() + VIRTIOFSD_TIMEOUT;
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            return Err(failed(format!("exited ({st}): {}", tail(&log_path, 2048))));
        }
        if sock.exists() {
            return Ok(child);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(failed(format!(
                "no socket after {VIRTIOFSD_TIMEOUT:?}: {}",
                tail(&log_path, 2048)
            )));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
