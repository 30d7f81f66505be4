//! The plugin as a child process: started, waited for, stopped, and
//! never left behind.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// A `crust-csi` child process: SIGTERM (then SIGKILL) and reaped on
/// drop, so a failing demo or test leaves no plugin behind.
pub struct PluginProcess {
    child: Option<std::process::Child>,
    pub log: PathBuf,
}

impl PluginProcess {
    /// Starts `bin args...` with `env` added, stderr and stdout to `log`,
    /// in its own process group (a Ctrl-C meant for us must not stop the
    /// plugin before our teardown has used it).
    pub fn spawn(
        bin: &Path,
        args: &[OsString],
        env: &[(&str, OsString)],
        log: &Path,
    ) -> std::io::Result<PluginProcess> {
        use std::os::unix::process::CommandExt;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let child = std::process::Command::new(bin)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v)))
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .process_group(0)
            .spawn()?;
        Ok(PluginProcess {
            child: Some(child),
            log: log.to_path_buf(),
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The exit status if it already exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits until `socket` accepts connections (or the plugin exits).
    pub async fn wait_ready(&mut self, socket: &Path, within: Duration) -> Result<(), String> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.exited() {
                return Err(format!("crust-csi exited ({st}) before serving"));
            }
            if tokio::net::UnixStream::connect(socket).await.is_ok() {
                return Ok(());
            }
            if t0.elapsed() > within {
                return Err(format!(
                    "crust-csi did not serve {} within {within:?}",
                    socket.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM, up to `grace` to exit, then SIGKILL. Returns how it ended.
    pub async fn stop(&mut self, grace: Duration) -> Result<String, String> {
        let Some(child) = self.child.as_mut() else {
            return Ok("not running".into());
        };
        if let Ok(Some(st)) = child.try_wait() {
            self.child = None;
            return Err(format!("crust-csi had already exited ({st})"));
        }
        signal(child.id(), rustix::process::Signal::TERM);
        let t0 = Instant::now();
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                self.child = None;
                return Ok(format!("exited after SIGTERM ({st})"));
            }
            if t0.elapsed() > grace {
                let _ = child.kill();
                let st = child.wait();
                self.child = None;
                return Err(format!(
                    "did not exit within {grace:?} of SIGTERM; killed ({st:?})"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The last `max` bytes of its log.
    pub fn log_tail(&self, max: usize) -> String {
        log_tail(&self.log, max)
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(c.id(), rustix::process::Signal::TERM);
            for _ in 0..100 {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(crate) fn signal(pid: u32, sig: rustix::process::Signal) {
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, sig);
    }
}

/// The last `max` bytes of a text file.
pub fn log_tail(path: &Path, max: usize) -> String {
    let s = std::fs::read(path).unwrap_or_default();
    let mut start = s.len().saturating_sub(max);
    // Start at a line.
    if start > 0
        && let Some(nl) = s[start..].iter().position(|b| *b == b'\n')
    {
        start += nl + 1;
    }
    String::from_utf8_lossy(&s[start..]).into_owned()
}
