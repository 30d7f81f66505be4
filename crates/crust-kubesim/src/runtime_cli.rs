//! [`RuntimeCli`]: runs the `crust-runtime` binary the way a container
//! manager would (create, start, kill, delete, exec, state), with a hard
//! timeout per command. Its settings travel as `CRUST_RUNTIME_*`
//! environment variables, the same mechanism the CSI plugin's children
//! rely on: crust_ops execs the runtime CLI without flags, so a plugin
//! started with [`RuntimeCli::env`] reaches the same sandboxes.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

/// Default bound on one runtime command (a guest boot under TCG on a
/// loaded two-core machine can take a while).
pub const DEFAULT_RUNTIME_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum RuntimeCliError {
    #[error("cannot run {}: {source}", .bin.display())]
    Spawn {
        bin: PathBuf,
        source: std::io::Error,
    },
    #[error("`crust-runtime {args}` did not finish within {timeout:?} (killed)")]
    Timeout { args: String, timeout: Duration },
    #[error("`crust-runtime {args}` failed ({status}): {stderr}")]
    Failed {
        args: String,
        status: String,
        stderr: String,
    },
    #[error("`crust-runtime {args}` printed no JSON: {reason}")]
    BadOutput { args: String, reason: String },
}

/// What one runtime command printed.
#[derive(Debug, Clone)]
pub struct RuntimeOutput {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// The runtime binary and the settings it runs with. `None` settings
/// are left to the runtime's own defaults (or the caller's environment).
#[derive(Debug, Clone)]
pub struct RuntimeCli {
    pub bin: PathBuf,
    /// Sandbox state (`CRUST_RUNTIME_ROOT`).
    pub root: Option<PathBuf>,
    /// KEP-2857 hand-off root (`CRUST_RUNTIME_CRUST_ROOT`).
    pub crust_root: Option<PathBuf>,
    /// Kata direct-volumes root (`CRUST_RUNTIME_KATA_ROOT`).
    pub kata_root: Option<PathBuf>,
    /// kubelet pods dir for subPath probing (`CRUST_RUNTIME_PODS_LAYER_STOP`).
    pub pods_layer_stop: Option<PathBuf>,
    /// Where shim sockets are linked for Kata's CLI, comma-separated
    /// (`CRUST_RUNTIME_KATA_SHIM_DIRS`).
    pub kata_shim_dirs: Option<String>,
    pub guest_kernel: Option<PathBuf>,
    pub guest_initrd: Option<PathBuf>,
    /// `tcg`, `kvm` or `auto`.
    pub accel: Option<String>,
    /// Guest memory (`CRUST_RUNTIME_MEMORY_MIB`).
    pub memory_mib: Option<u32>,
    /// Guest vCPUs (`CRUST_RUNTIME_CPUS`).
    pub cpus: Option<u32>,
    /// Share binds without a hand-off record over virtio-fs
    /// (`CRUST_RUNTIME_SHARE_BINDS=true`).
    pub share_binds: bool,
    /// crust-csi's Handover socket (`CRUST_RUNTIME_HANDOVER_ENDPOINT`,
    /// `unix://…`; empty: never asked).
    pub handover_endpoint: Option<String>,
    /// Volumes through the host page cache, the A/B path of
    /// `bench --guest-io --host-cache` (`CRUST_RUNTIME_HOST_CACHE=true`).
    pub host_cache: bool,
    /// Bound on each command.
    pub timeout: Duration,
}

impl RuntimeCli {
    pub fn new(bin: impl Into<PathBuf>) -> RuntimeCli {
        RuntimeCli {
            bin: bin.into(),
            root: None,
            crust_root: None,
            kata_root: None,
            pods_layer_stop: None,
            kata_shim_dirs: None,
            guest_kernel: None,
            guest_initrd: None,
            accel: None,
            memory_mib: None,
            cpus: None,
            share_binds: false,
            handover_endpoint: None,
            host_cache: false,
            timeout: DEFAULT_RUNTIME_TIMEOUT,
        }
    }

    /// `crust-runtime` next to the running executable, else the bare name
    /// (looked up on `PATH`).
    pub fn default_bin() -> PathBuf {
        sibling_bin("crust-runtime").unwrap_or_else(|| PathBuf::from("crust-runtime"))
    }

    /// The `CRUST_RUNTIME_*` variables for the settings that are set.
    pub fn env(&self) -> Vec<(&'static str, OsString)> {
        let mut v = Vec::new();
        let mut put = |k: &'static str, p: &Option<PathBuf>| {
            if let Some(p) = p {
                v.push((k, p.clone().into_os_string()));
            }
        };
        put("CRUST_RUNTIME_ROOT", &self.root);
        put("CRUST_RUNTIME_CRUST_ROOT", &self.crust_root);
        put("CRUST_RUNTIME_KATA_ROOT", &self.kata_root);
        put("CRUST_RUNTIME_PODS_LAYER_STOP", &self.pods_layer_stop);
        put("CRUST_RUNTIME_GUEST_KERNEL", &self.guest_kernel);
        put("CRUST_RUNTIME_GUEST_INITRD", &self.guest_initrd);
        if let Some(a) = &self.accel {
            v.push(("CRUST_RUNTIME_ACCEL", a.into()));
        }
        if let Some(d) = &self.kata_shim_dirs {
            v.push(("CRUST_RUNTIME_KATA_SHIM_DIRS", d.into()));
        }
        if let Some(m) = self.memory_mib {
            v.push(("CRUST_RUNTIME_MEMORY_MIB", m.to_string().into()));
        }
        if let Some(c) = self.cpus {
            v.push(("CRUST_RUNTIME_CPUS", c.to_string().into()));
        }
        if self.share_binds {
            v.push(("CRUST_RUNTIME_SHARE_BINDS", "true".into()));
        }
        if let Some(e) = &self.handover_endpoint {
            v.push(("CRUST_RUNTIME_HANDOVER_ENDPOINT", e.into()));
        }
        if self.host_cache {
            v.push(("CRUST_RUNTIME_HOST_CACHE", "true".into()));
        }
        v
    }

    /// Runs `crust-runtime args...`; any exit status is returned.
    pub async fn run(&self, args: &[&str]) -> Result<RuntimeOutput, RuntimeCliError> {
        self.run_for(args, self.timeout).await
    }

    pub async fn run_for(
        &self,
        args: &[&str],
        timeout: Duration,
    ) -> Result<RuntimeOutput, RuntimeCliError> {
        use tokio::io::AsyncReadExt;
        let mut cmd = tokio::process::Command::new(&self.bin);
        // A switch exported in the caller's shell must not turn the
        // direct-I/O side of an A/B into the buffered one unseen.
        if !self.host_cache {
            cmd.env_remove("CRUST_RUNTIME_HOST_CACHE");
        }
        cmd.args(args)
            .envs(self.env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Own group, so a timeout kills what the command spawned too
            // (a sandbox's shim leaves the group with setsid on purpose).
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|source| RuntimeCliError::Spawn {
            bin: self.bin.clone(),
            source,
        })?;
        let pid = child.id();
        let mut so = child.stdout.take().expect("piped stdout");
        let mut se = child.stderr.take().expect("piped stderr");
        let all = async {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let (a, b, st) = tokio::join!(
                so.read_to_end(&mut out),
                se.read_to_end(&mut err),
                child.wait()
            );
            a.and(b).and(st).map(|st| (st, out, err))
        };
        let res = tokio::time::timeout(timeout, all).await;
        match res {
            Ok(Ok((st, out, err))) => Ok(RuntimeOutput {
                code: st.code(),
                stdout: String::from_utf8_lossy(&out).into_owned(),
                stderr: String::from_utf8_lossy(&err).into_owned(),
            }),
            Ok(Err(source)) => Err(RuntimeCliError::Spawn {
                bin: self.bin.clone(),
                source,
            }),
            Err(_) => {
                // Not reaped yet, so the pid still names the group.
                if let Some(p) = pid.and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
                    let _ = rustix::process::kill_process_group(p, rustix::process::Signal::KILL);
                }
                let _ = child.kill().await;
                Err(RuntimeCliError::Timeout {
                    args: args.join(" "),
                    timeout,
                })
            }
        }
    }

    /// Runs and expects exit 0; returns stdout.
    pub async fn ok(&self, args: &[&str]) -> Result<String, RuntimeCliError> {
        let out = self.run(args).await?;
        if out.code != Some(0) {
            return Err(failed(args, &out));
        }
        Ok(out.stdout)
    }

    /// Runs, expects exit 0 and JSON on stdout.
    pub async fn json(&self, args: &[&str]) -> Result<Value, RuntimeCliError> {
        let out = self.ok(args).await?;
        serde_json::from_str(&out).map_err(|e| RuntimeCliError::BadOutput {
            args: args.join(" "),
            reason: e.to_string(),
        })
    }

    /// `exec ID -- args...` in the guest, any exit status.
    pub async fn exec(&self, id: &str, args: &[&str]) -> Result<RuntimeOutput, RuntimeCliError> {
        let mut a = vec!["exec", id, "--"];
        a.extend_from_slice(args);
        self.run(&a).await
    }

    /// `exec ID -- sh -c SCRIPT`, expecting exit 0; returns stdout.
    pub async fn sh(&self, id: &str, script: &str) -> Result<String, RuntimeCliError> {
        let a = ["exec", id, "--", "sh", "-c", script];
        let out = self.run(&a).await?;
        if out.code != Some(0) {
            return Err(failed(&a, &out));
        }
        Ok(out.stdout)
    }
}

fn failed(args: &[&str], out: &RuntimeOutput) -> RuntimeCliError {
    let stderr = out.stderr.trim();
    RuntimeCliError::Failed {
        args: args.join(" "),
        status: match out.code {
            Some(c) => format!("exit code {c}"),
            None => "killed by a signal".into(),
        },
        stderr: if stderr.is_empty() {
            "no message on stderr".into()
        } else {
            stderr.to_string()
        },
    }
}

/// `name` in the directory of the running executable, if it exists there.
pub fn sibling_bin(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.join(name);
    p.is_file().then_some(p)
}

/// `df -P -B1 PATH` or `df -P -i PATH` output: (total, used, available).
pub fn parse_df(out: &str) -> Option<(u64, u64, u64)> {
    let line = out.lines().nth(1)?;
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() < 4 {
        return None;
    }
    Some((f[1].parse().ok()?, f[2].parse().ok()?, f[3].parse().ok()?))
}

/// Whether `p` exists (without following a final symlink).
pub fn exists(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_carries_only_set_values() {
        let mut r = RuntimeCli::new("/x/crust-runtime");
        assert!(r.env().is_empty());
        r.root = Some("/w/run".into());
        r.accel = Some("tcg".into());
        let env = r.env();
        assert_eq!(
            env,
            vec![
                ("CRUST_RUNTIME_ROOT", OsString::from("/w/run")),
                ("CRUST_RUNTIME_ACCEL", OsString::from("tcg"))
            ]
        );
    }

    #[test]
    fn df_lines() {
        let out = "Filesystem     1-blocks    Used Available Capacity Mounted on\n\
                   /dev/vda       253920256 2101248 234938368   1% /data\n";
        assert_eq!(parse_df(out), Some((253920256, 2101248, 234938368)));
        assert_eq!(parse_df("Filesystem\n"), None);
        assert_eq!(parse_df(""), None);
    }

    #[tokio::test]
    async fn failures_say_why() {
        let r = RuntimeCli::new("/bin/sh");
        let e = r.ok(&["-c", "echo boom >&2; exit 3"]).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "`crust-runtime -c echo boom >&2; exit 3` failed (exit code 3): boom"
        );
        let mut slow = RuntimeCli::new("/bin/sh");
        slow.timeout = Duration::from_millis(200);
        let e = slow.ok(&["-c", "sleep 30"]).await.unwrap_err();
        assert!(matches!(e, RuntimeCliError::Timeout { .. }), "{e}");
        let missing = RuntimeCli::new("/nonexistent/crust-runtime");
        assert!(matches!(
            missing.ok(&["list"]).await.unwrap_err(),
            RuntimeCliError::Spawn { .. }
        ));
    }
}
